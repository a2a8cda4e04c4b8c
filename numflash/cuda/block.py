"""The block-tiled kernel (FA2's parallelism): Q blocks across the grid, K/V tiles streamed.

A block of NT threads owns BR query rows. Q is staged once in shared memory, then each
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

import numpy as np
from numba import cuda

from ..plan import Unsupported
from . import launch
from .common import NEG_INF, compute_type, element_size, exp_for, group_max, group_sum, \
    head_dim_bucket, key_end, tile_needs_mask

NAME = "cuda.block"


def smem_words(D, DV, BR, BC, TM, TN):
    nt = (BR // TM) * (BC // TN)
    return D * (BR + 1) + D * (BC + 1) + BC * DV + BC * (BR + 1) + nt


def make_kernel(D, DV, BR, BC, TM, TN, acc):
    """Kernel for head dims padded to D (q, k) and DV (v, a multiple of BC // TN).

    Index arithmetic is unsigned 64-bit throughout: numba guards every signed index with
    negative-wraparound code (shift, and, add per access), which cost more than the FMAs here.
    Every constant that meets an index is a uint64 (numba turns uint64 + int64 into float64).
    """
    ACC = compute_type(acc)
    exp = exp_for(acc)
    u = np.uint64
    TY, TX = BR // TM, BC // TN  # thread grid: TX threads share a row group (consecutive lanes)
    NT = TX * TY
    TO = DV // TX                # output columns per thread
    uD, uDV, uBR, uBC, uNT = u(D), u(DV), u(BR), u(BC), u(NT)
    uTM, uTN, uTO, uTX, uTY = u(TM), u(TN), u(TO), u(TX), u(TY)
    QP, KP = u(BR + 1), u(BC + 1)  # padded row lengths
    K_OFF = u(D) * QP
    V_OFF = K_OFF + u(D) * KP
    P_OFF = V_OFF + u(BC * DV)
    S_OFF = P_OFF + u(BC) * QP
    zero, one = u(0), u(1)

    def block_attention(q, k, v, out, lse, scale, causal, causal_offset):
        H = q.shape[1]
        Nq, d, Nk, dv = u(q.shape[2]), u(q.shape[3]), u(k.shape[2]), u(v.shape[3])
        sc = ACC(scale)
        tid = u(cuda.threadIdx.x)
        tx = tid % uTX
        ty = tid // uTX
        b = u(cuda.blockIdx.x // H)
        h = u(cuda.blockIdx.x % H)
        i0 = u(cuda.blockIdx.y) * uBR
        smem = cuda.shared.array(0, ACC)
        scratch = smem[S_OFF:]

        for idx in range(tid, uBR * uD, uNT):  # Qt[c][r] = q[i0 + r, c]
            r = idx // uD
            c = idx - r * uD
            smem[c * QP + r] = ACC(q[b, h, i0 + r, c]) if i0 + r < Nq and c < d else ACC(0)

        s = cuda.local.array((TM, TN), ACC)
        o = cuda.local.array((TM, TO), ACC)
        m = cuda.local.array(TM, ACC)  # running max of the unscaled scores
        l = cuda.local.array(TM, ACC)  # this thread's share of each row's sum
        a = cuda.local.array(TM, ACC)
        bk = cuda.local.array(TN, ACC)
        bv = cuda.local.array(TO, ACC)
        for ii in range(uTM):
            m[ii] = NEG_INF
            l[ii] = 0
            for kk in range(uTO):
                o[ii, kk] = 0

        last_row = min(Nq, i0 + uBR) - one
        block_keys = u(key_end(last_row, Nk, causal, causal_offset))
        for j0 in range(zero, block_keys, uBC):
            cuda.syncthreads()  # previous tile's Kt, Vs, Pt are no longer read
            for idx in range(tid, uBC * uD, uNT):
                j = idx // uD
                c = idx - j * uD
                smem[K_OFF + c * KP + j] = ACC(k[b, h, j0 + j, c]) if j0 + j < Nk and c < d \
                    else ACC(0)
            for idx in range(tid, uBC * uDV, uNT):
                j = idx // uDV
                c = idx - j * uDV
                smem[V_OFF + idx] = ACC(v[b, h, j0 + j, c]) if j0 + j < Nk and c < dv else ACC(0)
            cuda.syncthreads()

            for ii in range(uTM):
                for jj in range(uTN):
                    s[ii, jj] = 0
            qa = ty
            kb = K_OFF + tx
            for c in range(uD):
                for ii in range(uTM):
                    a[ii] = smem[qa + uTY * ii]
                for jj in range(uTN):
                    bk[jj] = smem[kb + uTX * jj]
                for ii in range(uTM):
                    for jj in range(uTN):
                        s[ii, jj] += a[ii] * bk[jj]
                qa += QP
                kb += KP

            # Keys past Nk or above the causal diagonal: only boundary tiles need the check.
            if tile_needs_mask(i0, j0, BC, Nk, causal, causal_offset):
                for ii in range(uTM):
                    visible = u(key_end(i0 + ty + uTY * ii, Nk, causal, causal_offset))
                    for jj in range(uTN):
                        if j0 + tx + uTX * jj >= visible:
                            s[ii, jj] = NEG_INF

            for ii in range(uTM):
                mx = s[ii, 0]
                for jj in range(one, uTN):
                    mx = max(mx, s[ii, jj])
                m_new = max(m[ii], group_max(mx, TX, scratch, tid))
                pt = P_OFF + tx * QP + ty + uTY * ii
                if m_new == NEG_INF:  # the row has seen no key yet: nothing to add
                    for jj in range(uTN):
                        smem[pt + uTX * QP * jj] = 0
                else:
                    # scale is applied to scores, not to q: pre-scaling would round q once more
                    msc = m_new * sc
                    alpha = exp(m[ii] * sc - msc)
                    row_sum = ACC(0)
                    for jj in range(uTN):
                        p = exp(s[ii, jj] * sc - msc)
                        row_sum += p
                        smem[pt + uTX * QP * jj] = p
                    l[ii] = l[ii] * alpha + row_sum
                    m[ii] = m_new
                    for kk in range(uTO):
                        o[ii, kk] *= alpha
            cuda.syncthreads()

            pa = P_OFF + ty
            vb = V_OFF + tx
            for j in range(uBC):
                for ii in range(uTM):
                    a[ii] = smem[pa + uTY * ii]
                for kk in range(uTO):
                    bv[kk] = smem[vb + uTX * kk]
                for ii in range(uTM):
                    for kk in range(uTO):
                        o[ii, kk] += a[ii] * bv[kk]
                pa += QP
                vb += uDV

        for ii in range(uTM):
            total = group_sum(l[ii], TX, scratch, tid)
            row = i0 + ty + uTY * ii
            if row < Nq:
                inv = 1 / total if total > 0 else ACC(0)
                for kk in range(uTO):
                    col = tx + uTX * kk
                    if col < dv:
                        out[b, h, row, col] = o[ii, kk] * inv
                if tx == zero:
                    lse[b, h, row] = m[ii] * sc + math.log(total) if total > 0 else NEG_INF

    return block_attention


# Tile shapes (BR, BC, TM, TN), best first; the first whose shared memory fits is taken. The
# 4x4-per-thread 64x64 tile needs ~150-200 registers: ptxas for sm_90 fits it spill-free, ptxas for
# sm_80 and sm_75 goes to 255 and spills, so those start from the 2x4 patch (~128 registers).
TILES = {
    "sm90": ((64, 64, 4, 4), (64, 32, 4, 2), (32, 32, 2, 2), (16, 16, 1, 1)),
    "older": ((32, 64, 2, 4), (32, 32, 2, 2), (16, 16, 1, 1)),
}
SIMULATOR_TILE = (16, 16, 4, 4)  # 16 threads: the simulator runs each thread as a Python thread


def tile_candidates(device):
    if device.simulator:
        return (SIMULATOR_TILE,)
    return TILES["sm90" if device.cc >= (9, 0) else "older"]


def config(problem, device):
    B, H, Nq, Nk, d, dv = problem.shape
    acc = "float64" if problem.dtype_name == "float64" else "float32"
    D = head_dim_bucket(d)
    for BR, BC, TM, TN in tile_candidates(device):
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
           (p.q, p.k, p.v, p.out, lse, float(p.scale), int(p.causal), int(p.causal_offset)),
           device)
    return lse
