"""The block-tiled kernel (FA2's parallelism): Q blocks across the grid, K/V tiles streamed.

A block of NT threads owns BR query rows. Q (pre-scaled) is staged once in shared memory, then each
BC-key tile of K and V is loaded, S = Q K^T is computed as register micro-tiles (each thread a TM x TN
patch: rows ty + TY*ii, keys tx + TX*jj, so shared-memory reads are conflict-free or broadcast), the
online softmax runs on the patch (row max over the TX threads of a row group by lane shuffles), P goes
through shared memory, and O += P V accumulates in registers (rows as for S, columns tx + TX*kk).
Row sums stay per thread and are reduced once at the end. Tiles that no row of the block can see
(causal) are never loaded.

Shared memory (in the compute type), rows padded by one so transposed stores are conflict-free:
Qt[D][BR+1], Kt[D][BC+1], Vs[BC][DV], Pt[BC][BR+1], and NT words of scratch for the simulator's
stand-in for shuffles.
"""
import math

from numba import cuda

from ..plan import Unsupported
from . import launch
from .common import NEG_INF, compute_type, element_size, exp_for, group_max, group_sum, \
    head_dim_bucket, key_end

NAME = "cuda.block"


def smem_words(D, DV, BR, BC, TM, TN):
    nt = (BR // TM) * (BC // TN)
    return D * (BR + 1) + D * (BC + 1) + BC * DV + BC * (BR + 1) + nt


def make_kernel(D, DV, BR, BC, TM, TN, acc):
    """Kernel for head dims padded to D (q, k) and DV (v, a multiple of BC // TN)."""
    ACC = compute_type(acc)
    exp = exp_for(acc)
    TY, TX = BR // TM, BC // TN  # thread grid: TX threads share a row group (consecutive lanes)
    NT = TX * TY
    TO = DV // TX                # output columns per thread
    QP, KP = BR + 1, BC + 1      # padded row lengths
    K_OFF = D * QP
    V_OFF = K_OFF + D * KP
    P_OFF = V_OFF + BC * DV
    S_OFF = P_OFF + BC * QP

    def block_attention(q, k, v, out, lse, scale, causal, causal_offset):
        H, Nq, d = q.shape[1], q.shape[2], q.shape[3]
        Nk, dv = k.shape[2], v.shape[3]
        tid = cuda.threadIdx.x
        tx = tid % TX
        ty = tid // TX
        b = cuda.blockIdx.x // H
        h = cuda.blockIdx.x % H
        i0 = cuda.blockIdx.y * BR
        smem = cuda.shared.array(0, ACC)
        scratch = smem[S_OFF:]

        for idx in range(tid, BR * D, NT):  # Qt[c][r] = scale * q[i0 + r, c]
            r = idx // D
            c = idx - r * D
            smem[c * QP + r] = ACC(q[b, h, i0 + r, c]) * scale if i0 + r < Nq and c < d else ACC(0)

        s = cuda.local.array((TM, TN), ACC)
        o = cuda.local.array((TM, TO), ACC)
        m = cuda.local.array(TM, ACC)
        l = cuda.local.array(TM, ACC)  # this thread's share of each row's sum
        a = cuda.local.array(TM, ACC)
        bk = cuda.local.array(TN, ACC)
        bv = cuda.local.array(TO, ACC)
        for ii in range(TM):
            m[ii] = NEG_INF
            l[ii] = 0
            for kk in range(TO):
                o[ii, kk] = 0

        block_keys = key_end(min(Nq, i0 + BR) - 1, Nk, causal, causal_offset)
        for j0 in range(0, block_keys, BC):
            cuda.syncthreads()  # previous tile's Kt, Vs, Pt are no longer read
            for idx in range(tid, BC * D, NT):
                j = idx // D
                c = idx - j * D
                smem[K_OFF + c * KP + j] = ACC(k[b, h, j0 + j, c]) if j0 + j < Nk and c < d \
                    else ACC(0)
            for idx in range(tid, BC * DV, NT):
                j = idx // DV
                c = idx - j * DV
                smem[V_OFF + idx] = ACC(v[b, h, j0 + j, c]) if j0 + j < Nk and c < dv else ACC(0)
            cuda.syncthreads()

            for ii in range(TM):
                for jj in range(TN):
                    s[ii, jj] = 0
            for c in range(D):
                for ii in range(TM):
                    a[ii] = smem[c * QP + ty + TY * ii]
                for jj in range(TN):
                    bk[jj] = smem[K_OFF + c * KP + tx + TX * jj]
                for ii in range(TM):
                    for jj in range(TN):
                        s[ii, jj] += a[ii] * bk[jj]

            # Keys past Nk or above the causal diagonal: only boundary tiles need the check.
            if j0 + BC > Nk or (causal and j0 + BC - 1 > i0 + causal_offset):
                for ii in range(TM):
                    visible = key_end(i0 + ty + TY * ii, Nk, causal, causal_offset)
                    for jj in range(TN):
                        if j0 + tx + TX * jj >= visible:
                            s[ii, jj] = NEG_INF

            for ii in range(TM):
                mx = s[ii, 0]
                for jj in range(1, TN):
                    mx = max(mx, s[ii, jj])
                m_new = max(m[ii], group_max(mx, TX, scratch, tid))
                if m_new == NEG_INF:  # the row has seen no key yet: nothing to add
                    for jj in range(TN):
                        smem[P_OFF + (tx + TX * jj) * QP + ty + TY * ii] = 0
                else:
                    alpha = exp(m[ii] - m_new)
                    row_sum = ACC(0)
                    for jj in range(TN):
                        p = exp(s[ii, jj] - m_new)
                        row_sum += p
                        smem[P_OFF + (tx + TX * jj) * QP + ty + TY * ii] = p
                    l[ii] = l[ii] * alpha + row_sum
                    m[ii] = m_new
                    for kk in range(TO):
                        o[ii, kk] *= alpha
            cuda.syncthreads()

            for j in range(BC):
                for ii in range(TM):
                    a[ii] = smem[P_OFF + j * QP + ty + TY * ii]
                for kk in range(TO):
                    bv[kk] = smem[V_OFF + j * DV + tx + TX * kk]
                for ii in range(TM):
                    for kk in range(TO):
                        o[ii, kk] += a[ii] * bv[kk]

        for ii in range(TM):
            total = group_sum(l[ii], TX, scratch, tid)
            row = i0 + ty + TY * ii
            if row < Nq:
                inv = 1 / total if total > 0 else ACC(0)
                for kk in range(TO):
                    col = tx + TX * kk
                    if col < dv:
                        out[b, h, row, col] = o[ii, kk] * inv
                if tx == 0:
                    lse[b, h, row] = m[ii] + math.log(total) if total > 0 else NEG_INF

    return block_attention


# Tile shapes (BR, BC, TM, TN), best first; the first whose shared memory fits is taken.
TILES = ((64, 64, 4, 4), (64, 32, 4, 2), (32, 32, 2, 2), (16, 16, 1, 1))
SIMULATOR_TILE = (16, 16, 4, 4)  # 16 threads: the simulator runs each thread as a Python thread


def config(problem, device):
    B, H, Nq, Nk, d, dv = problem.shape
    acc = "float64" if problem.dtype.name == "float64" else "float32"
    D = head_dim_bucket(d)
    tiles = (SIMULATOR_TILE,) if device.simulator else TILES
    for BR, BC, TM, TN in tiles:
        TX = BC // TN
        DV = -(-head_dim_bucket(dv) // TX) * TX
        cfg = {"D": D, "DV": DV, "BR": BR, "BC": BC, "TM": TM, "TN": TN, "acc": acc}
        if device.simulator or shared_bytes(cfg) <= device.smem_per_block_optin:
            return cfg
    raise Unsupported(f"{NAME}: even its smallest tile needs {shared_bytes(cfg)} bytes of shared "
                      f"memory for d={d}, dv={dv} in {acc}, more than the "
                      f"{device.smem_per_block_optin} a block may use on {device.name}; "
                      f"algorithm='row' or the CPU path can take it")


def shared_bytes(cfg):
    return smem_words(cfg["D"], cfg["DV"], cfg["BR"], cfg["BC"], cfg["TM"], cfg["TN"]) * \
        element_size(cfg["acc"])


def run(problem, cfg, device):
    p = problem
    B, H, Nq, Nk, d, dv = p.shape
    kernel = launch.get_kernel(NAME, make_kernel, cfg)
    lse = p.empty_lse()
    threads = (cfg["BR"] // cfg["TM"]) * (cfg["BC"] // cfg["TN"])
    grid = (B * H, -(-Nq // cfg["BR"]))
    kernel(grid, (threads,), shared_bytes(cfg),
           (p.q, p.k, p.v, p.out, lse, compute_type(cfg["acc"])(p.scale), int(p.causal),
            int(p.causal_offset)), device)
    return lse
