"""The block-tiled kernel (FA2's parallelism): Q blocks across the grid, K/V tiles streamed.

A block of NT threads owns BR query rows. Q is staged once in shared memory, then each BC-key tile of
K and V is loaded (through registers, the next tile's loads in flight during this one's compute
where registers allow), S = Q K^T is computed as register micro-tiles (thread (ty, tx) owns rows
ty*TM .. +TM and keys jj*TX + tx for jj < TN; K is stored so those keys sit next to each other,
so its operands are contiguous in shared memory and are read with 16-byte vector loads: broadcast
within a row group, conflict-free across it), the online softmax runs on the patch (row max over
the TX threads of a row group by lane shuffles), P goes through shared memory in 16-byte stores
(the TX lanes of a row group write consecutive keys: no bank conflicts), and O += P V accumulates
in registers (rows as for S, columns tx*TO .. +TO). Row sums stay per thread and are reduced once
at the end. Tiles that no row of the block can see (causal) are never loaded.

Shared memory (in the compute type; row lengths padded to a multiple of 16 bytes, every region
16-byte aligned): Qt[D][BR+pad], Kt[D][BC+pad] sharing its space with Pt[BC][BR+pad] (K is dead
once S is computed), Vs[BC][DV], and NT words of scratch for the simulator's stand-in for shuffles.
Fewer bytes per block means more resident blocks, and occupancy is what this kernel is short of.
"""
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda

from ..device import Unsupported
from . import launch
from .config import SIMT_ACC, SIMT_DT, SimtConfig, simt_dt
from .common import NEG_INF, SMEM_ALIGN, compute_type, element_size, exp_for, forward_signature, \
    group_max, group_sum, head_dim_bucket, inlined_device, key_end, stage_chunk, stage_parts, \
    tile_needs_mask, tile_stager, vector_load, vector_store

NAME = "cuda.block"


@dataclass(frozen=True)
class BlockConfig(SimtConfig):
    """One compile-time variant of cuda.block (cuda.config's naming scheme).

    D, DV: padded head dims (DV a multiple of BC // TN, the output columns a thread group
    splits). BR query rows a block, BC keys a tile. TM x TN: the patch of S a thread computes,
    so NT = (BR / TM) x (BC / TN) threads. DT: "f32" or "f64", the accumulators' type. PF: the
    next K / V tile is prefetched into registers during this one's compute. SP: the micro-GEMMs
    are software-pipelined.
    """
    D: int
    DV: int
    BR: int
    BC: int
    TM: int
    TN: int
    DT: str
    PF: int
    SP: int

    @property
    def NT(self):
        return (self.BR // self.TM) * (self.BC // self.TN)


def _layout(D, DV, BR, BC, TM, TN, acc):
    """Offsets (in elements) of each shared region, and the total."""
    vw = 16 // element_size(acc)         # elements per 16-byte vector
    QP = -(-BR // vw) * vw + vw          # + one vector: transposed stores spread over banks
    KP = -(-BC // vw) * vw + vw
    nt = (BR // TM) * (BC // TN)
    k_off = p_off = D * QP
    v_off = k_off + max(D * KP, BC * QP)
    s_off = v_off + BC * DV
    return QP, KP, k_off, v_off, p_off, s_off, s_off + -(-nt // vw) * vw


def smem_words(D, DV, BR, BC, TM, TN, acc="float32"):
    return _layout(D, DV, BR, BC, TM, TN, acc)[-1]


def _vector_width(n, acc):
    """Widest vector (<= 16 bytes) that divides n elements."""
    w = 16 // element_size(acc)
    while n % w:
        w //= 2
    return w


# Registers a thread may hold for the next K and V tile (PF = 1); past this the tiles are staged
# synchronously, stage_chunk() elements per thread at a time.
PREFETCH_REGS = 32


def prefetch_fits(D, DV, BC, TM, TN, BR, acc):
    """Whether a thread's share of the next K and V tiles fits PREFETCH_REGS registers."""
    threads = (BR // TM) * (BC // TN)
    held = sum(stage_parts(BC, cols, threads)[0] for cols in (D, DV))
    return held * (element_size(acc) // 4) <= PREFETCH_REGS


def kv_chunk(prefetch, acc):
    """Part size for staging K and V: a whole tile when prefetched, else stage_chunk()."""
    return None if prefetch else stage_chunk(acc)


def micro_gemm(M, N, acc, pipelined):
    """Device function: out[M][N] += sum over k < steps of A[k][0:M] (outer) B[k][0:N], where the
    rows A[k] and B[k] are read from shared memory at a_off + k * a_pitch and b_off + k * b_pitch
    in 16-byte vectors into the register arrays a and b (a2 and b2: a second set).

    `pipelined`: step k+1's operands are loaded into the second set before step k's FMAs, so the
    shared-memory latency hides behind them (steps must be even); otherwise each step loads, then
    multiplies, and only other warps hide the latency.
    """
    u = np.uint64
    VA, VB = _vector_width(M, acc), _vector_width(N, acc)
    uM, uN, uVA, uVB, zero, two = u(M), u(N), u(VA), u(VB), u(0), u(2)

    @inlined_device
    def load(smem, a, b, a_off, b_off):
        for i in range(zero, uM, uVA):
            t = vector_load(smem, a_off + i, VA)
            for w in range(uVA):
                a[i + w] = t[w]
        for j in range(zero, uN, uVB):
            t = vector_load(smem, b_off + j, VB)
            for w in range(uVB):
                b[j + w] = t[w]

    @inlined_device
    def fma(out, a, b):
        for i in range(uM):
            for j in range(uN):
                out[i, j] += a[i] * b[j]

    @inlined_device
    def gemm(smem, out, a, b, a2, b2, a_off, a_pitch, b_off, b_pitch, steps):
        if pipelined:
            load(smem, a, b, a_off, b_off)
            for k in range(zero, steps, two):
                load(smem, a2, b2, a_off + a_pitch, b_off + b_pitch)
                fma(out, a, b)
                a_off += two * a_pitch
                b_off += two * b_pitch
                if k + two < steps:
                    load(smem, a, b, a_off, b_off)
                fma(out, a2, b2)
        else:
            for k in range(steps):
                load(smem, a, b, a_off, b_off)
                fma(out, a, b)
                a_off += a_pitch
                b_off += b_pitch

    return gemm


def make_kernel(D, DV, BR, BC, TM, TN, DT, PF, SP):
    """Kernel for head dims padded to D (q, k) and DV (v, a multiple of BC // TN).

    Index arithmetic is unsigned 64-bit throughout: numba guards every signed index with
    negative-wraparound code (shift, and, add per access), which cost more than the FMAs here.
    Every constant that meets an index is a uint64 (numba turns uint64 + int64 into float64).
    """
    acc = SIMT_ACC[DT]
    ACC = compute_type(acc)
    exp = exp_for(acc)
    u = np.uint64
    TY, TX = BR // TM, BC // TN  # thread grid: TX threads share a row group (consecutive lanes)
    NT = TX * TY
    TO = DV // TX                # output columns per thread
    VA = _vector_width(TM, acc)
    assert not SP or (D % 2 == 0 and BC % 2 == 0), "pipelined micro-GEMMs take even step counts"
    qk_gemm = micro_gemm(TM, TN, acc, SP)   # S = Q K^T over the head dim
    pv_gemm = micro_gemm(TM, TO, acc, SP)   # O += P V over the tile's keys
    uD, uDV, uBR, uBC = u(D), u(DV), u(BR), u(BC)
    uTM, uTN, uTO, uTX, uVA = u(TM), u(TN), u(TO), u(TX), u(VA)
    QP, KP, K_OFF, V_OFF, P_OFF, S_OFF, _ = (u(x) for x in _layout(D, DV, BR, BC, TM, TN, acc))
    zero, one = u(0), u(1)
    chunk = kv_chunk(PF, acc)
    _, _, stage_q, Q_REGS, _ = tile_stager(BR, D, NT, acc, True, QP, stage_chunk(acc))
    # Kt[c][position]: thread tx owns keys jj * TX + tx (jj < TN), stored next to each other
    fetch_k, store_k, stage_k, K_REGS, _ = tile_stager(BC, D, NT, acc, True, KP, chunk, TX)
    fetch_v, store_v, stage_v, V_REGS, _ = tile_stager(BC, DV, NT, acc, False, DV, chunk)  # Vs

    def block_attention(q, k, v, out, lse, scale, causal, causal_offset):
        H = q.shape[1]
        Nq, d, Nk, dv = u(q.shape[2]), u(q.shape[3]), u(k.shape[2]), u(v.shape[3])
        sc = ACC(scale)
        tid = u(cuda.threadIdx.x)
        tx = tid % uTX
        ty = tid // uTX
        b = u(cuda.blockIdx.x // H)
        h = u(cuda.blockIdx.x % H)
        # Last query blocks first: under a causal mask they have the most keys, and starting
        # the longest blocks first leaves short ones, not long ones, for the final wave.
        i0 = u(cuda.gridDim.y - 1 - cuda.blockIdx.y) * uBR
        smem = cuda.shared.array(0, ACC, alignment=SMEM_ALIGN)
        scratch = smem[S_OFF:]

        hk = h // u(H // k.shape[1])  # grouped-query attention: the key/value head h reads
        qbh, kbh, vbh = q[b, h], k[b, hk], v[b, hk]  # 2-D views: two index products, not four
        qreg = cuda.local.array(Q_REGS, ACC)
        stage_q(qbh, i0, Nq, d, qreg, smem, zero, tid)  # Qt[c][r] = q[i0 + r, c]

        s = cuda.local.array((TM, TN), ACC)
        o = cuda.local.array((TM, TO), ACC)
        m = cuda.local.array(TM, ACC)  # running max of the unscaled scores
        l = cuda.local.array(TM, ACC)  # this thread's share of each row's sum
        a = cuda.local.array(TM, ACC)
        bk = cuda.local.array(TN, ACC)
        bv = cuda.local.array(TO, ACC)
        pcol = cuda.local.array(TM, ACC)
        a2 = cuda.local.array(TM if SP else 1, ACC)   # second operand set (pipelined)
        bk2 = cuda.local.array(TN if SP else 1, ACC)
        bv2 = cuda.local.array(TO if SP else 1, ACC)
        for ii in range(uTM):
            m[ii] = NEG_INF
            l[ii] = 0
            for kk in range(uTO):
                o[ii, kk] = 0

        row0 = i0 + ty * uTM   # this thread's first row and output column
        col0 = tx * uTO
        key0 = tx * uTN        # where its keys jj * TX + tx (jj < TN) sit in Kt
        last_row = min(Nq, i0 + uBR) - one
        block_keys = u(key_end(last_row, Nk, causal, causal_offset))
        kreg = cuda.local.array(K_REGS, ACC)
        vreg = cuda.local.array(V_REGS, ACC)
        if PF:  # tile j+1 is fetched into registers while tile j is computed on
            fetch_k(kbh, zero, Nk, d, kreg, tid, zero)
            fetch_v(vbh, zero, Nk, dv, vreg, tid, zero)
        for j0 in range(zero, block_keys, uBC):
            cuda.syncthreads()  # previous tile's Kt, Vs, Pt are no longer read
            if PF:
                store_k(smem, K_OFF, kreg, tid, zero)
                store_v(smem, V_OFF, vreg, tid, zero)
            else:
                stage_k(kbh, j0, Nk, d, kreg, smem, K_OFF, tid)
                stage_v(vbh, j0, Nk, dv, vreg, smem, V_OFF, tid)
            cuda.syncthreads()
            if PF and j0 + uBC < block_keys:
                fetch_k(kbh, j0 + uBC, Nk, d, kreg, tid, zero)
                fetch_v(vbh, j0 + uBC, Nk, dv, vreg, tid, zero)

            for ii in range(uTM):
                for jj in range(uTN):
                    s[ii, jj] = 0
            qk_gemm(smem, s, a, bk, a2, bk2, ty * uTM, QP, K_OFF + key0, KP, uD)
            # Keys past Nk or above the causal diagonal: only boundary tiles need the check.
            masked = tile_needs_mask(i0, j0, BC, Nk, causal, causal_offset)
            # A masked tile's P V must not read a non-finite value at a masked (P = 0) place:
            # 0 * NaN = NaN would reach rows that never see that key. Such tiles are rare (NaN
            # or inf in v, near the diagonal or the end), so they are found here with one scan
            # of the staged V tile and take an exact, slower product below.
            nonfinite = 0
            if masked:
                for e in range(tid, uBC * uDV, u(NT)):
                    if not abs(smem[V_OFF + e]) < math.inf:
                        nonfinite = 1
            cuda.syncthreads()  # Kt is read by all; P overwrites it below

            if masked:
                for ii in range(uTM):
                    visible = u(key_end(row0 + ii, Nk, causal, causal_offset))
                    for jj in range(uTN):
                        if j0 + jj * uTX + tx >= visible:
                            s[ii, jj] = NEG_INF

            for ii in range(uTM):
                mx = s[ii, 0]
                for jj in range(one, uTN):
                    mx = max(mx, s[ii, jj])
                m_new = max(m[ii], group_max(mx, TX, scratch, tid))
                if m_new == NEG_INF:  # the row has seen no key yet: nothing to add...
                    for jj in range(uTN):  # ...but a NaN score (max skips it) poisons the row
                        x = s[ii, jj]
                        s[ii, jj] = ACC(0) if x == NEG_INF else x
                        l[ii] += s[ii, jj]
                else:
                    # scale is applied to scores, not to q: pre-scaling would round q once more
                    msc = m_new * sc
                    alpha = exp(m[ii] * sc - msc)
                    row_sum = ACC(0)
                    for jj in range(uTN):
                        p = exp(s[ii, jj] * sc - msc)
                        row_sum += p
                        s[ii, jj] = p
                    l[ii] = l[ii] * alpha + row_sum
                    m[ii] = m_new
                    for kk in range(uTO):
                        o[ii, kk] *= alpha
            # Pt[key][this thread's TM rows] in 16-byte stores: the TX lanes of a row group write
            # consecutive keys, QP / 4 words apart (odd): no bank conflicts.
            for jj in range(uTN):
                for ii in range(uTM):
                    pcol[ii] = s[ii, jj]
                pt = P_OFF + (jj * uTX + tx) * QP + ty * uTM
                for ii in range(zero, uTM, uVA):
                    vector_store(smem, pt + ii, pcol, ii, VA)
            if masked:  # (the same for the whole block) the barrier, and: did any thread see one?
                exact = cuda.syncthreads_or(nonfinite)
            else:
                exact = 0
                cuda.syncthreads()

            if exact:  # the visible keys' products only, as the reference sums
                # keys outermost, so the row and column loops unroll and o stays in registers;
                # V's row goes through bv as in the micro-GEMM
                for c in range(uBC):
                    for kk in range(uTO):
                        bv[kk] = smem[V_OFF + c * uDV + col0 + kk]
                    for ii in range(uTM):
                        if j0 + c < u(key_end(row0 + ii, Nk, causal, causal_offset)):
                            p = smem[P_OFF + c * QP + ty * uTM + ii]
                            for kk in range(uTO):
                                o[ii, kk] += p * bv[kk]
            else:
                pv_gemm(smem, o, a, bv, a2, bv2, P_OFF + ty * uTM, QP, V_OFF + col0, uDV, uBC)

        for ii in range(uTM):
            total = group_sum(l[ii], TX, scratch, tid)
            row = row0 + ii
            if row < Nq:
                inv = 1 / total if total != 0 else ACC(0)  # NaN total: NaN out, as the reference
                for kk in range(uTO):
                    if col0 + kk < dv:
                        out[b, h, row, col0 + kk] = o[ii, kk] * inv
                if tx == zero:
                    lse[b, h, row] = m[ii] * sc + math.log(total) if total != 0 else NEG_INF

    return block_attention


# Tiles (BR, BC, TM, TN) with their staging (PF: next tile prefetched into registers; None: if it
# fits PREFETCH_REGS) and micro-GEMM (SP: software-pipelined) choices, best first, per architecture,
# accumulator and head-dim class; the first whose shared memory fits is taken. From H100 sweeps
# (bench/NOTES.md, v6): pipelined micro-GEMMs win everywhere they do not spill, and with them the
# registers go to the pipeline rather than to a prefetched tile. 8x4 or 8x8 patches per thread win,
# and shared memory per block (hence resident warps) decides between them. In float64 an 8x4 patch
# leaves part of it in local memory, so float64 starts from 4x4. ptxas for sm_80 and sm_75 runs the
# large patches to 255 registers and spills, so those start from 2x4.
TILES = {
    ("sm90", "float32", 64): ((256, 64, 8, 8, 0, 1), (128, 32, 8, 4, None, 1), (64, 64, 8, 4, 0, 1),
                              (32, 32, 2, 2, None, 1), (16, 16, 1, 1, None, 1)),
    ("sm90", "float32", 128): ((128, 64, 8, 4, 0, 1), (128, 32, 8, 4, 0, 1),
                               (32, 32, 2, 2, None, 1), (16, 16, 1, 1, None, 1)),
    ("sm90", "float32", 256): ((64, 64, 8, 4, None, 1), (32, 32, 2, 2, None, 1),
                               (16, 16, 1, 1, None, 1)),
    ("sm90", "float64", 256): ((64, 64, 4, 4, None, 1), (64, 32, 4, 2, None, 1),
                               (32, 32, 2, 2, None, 1), (16, 16, 1, 1, None, 1)),
    ("older", "float32", 256): ((32, 64, 2, 4, None, 1), (32, 32, 2, 2, None, 1),
                                (16, 16, 1, 1, None, 1)),
    ("older", "float64", 256): ((32, 64, 2, 4, None, 1), (32, 32, 2, 2, None, 1),
                                (16, 16, 1, 1, None, 1)),
}
# 16 threads: the simulator runs each thread as a Python thread
SIMULATOR_TILE = (16, 16, 4, 4, None, 1)


def tile_candidates(device, acc, D):
    if device.simulator:
        return (SIMULATOR_TILE,)
    arch = "sm90" if device.cc >= (9, 0) else "older"
    for (a, c, max_d), tiles in TILES.items():  # head-dim classes in increasing order
        if a == arch and c == acc and D <= max_d:
            return tiles
    raise AssertionError("every (arch, acc) has a class up to d=256")


def tile_config(d, dv, tile, acc, prefetch=None, pipelined=1):
    """The kernel config for head dims d, dv and a (BR, BC, TM, TN) tile; prefetch (PF) None means
    whether the next tile fits in PREFETCH_REGS registers. A TILES entry's PF and SP override."""
    BR, BC, TM, TN = tile[:4]
    if len(tile) > 4:
        prefetch, pipelined = tile[4:]
    D = head_dim_bucket(d)
    DV = -(-head_dim_bucket(dv) // (BC // TN)) * (BC // TN)
    if prefetch is None:
        prefetch = prefetch_fits(D, DV, BC, TM, TN, BR, acc)
    return BlockConfig(D, DV, BR, BC, TM, TN, SIMT_DT[acc], int(prefetch), int(pipelined))


def config(problem, device):
    B, H, Nq, Nk, d, dv = problem.shape
    acc = SIMT_ACC[simt_dt(problem.dtype_name)]
    # The class of the larger head dim: dv sizes the output patch as d sizes the score loop.
    for tile in tile_candidates(device, acc, head_dim_bucket(max(d, dv))):
        cfg = tile_config(d, dv, tile, acc)
        if device.simulator or shared_bytes(cfg) <= device.smem_per_block_optin:
            return cfg
    raise Unsupported(f"{NAME}: even its smallest tile needs {shared_bytes(cfg)} bytes of shared "
                      f"memory for d={d}, dv={dv} in {acc}, more than the "
                      f"{device.smem_per_block_optin} a block may use on {device.name}; "
                      f"algorithm='row' or the CPU path can take it")


def staged_parts(cfg):
    """How many register-sized parts a K and a V tile are staged in (1 each with prefetch)."""
    chunk = kv_chunk(cfg.PF, cfg.acc)
    return tuple(stage_parts(cfg.BC, cols, cfg.NT, chunk)[1] for cols in (cfg.D, cfg.DV))


def shared_bytes(cfg):
    return smem_words(cfg.D, cfg.DV, cfg.BR, cfg.BC, cfg.TM, cfg.TN, cfg.acc) \
        * element_size(cfg.acc)


def compiled_kernels(cfg, dtype):
    """What run() launches for this config and input dtype: [(Kernel, numba argument types)],
    for `numflash.precompile` and `explain`'s cache status."""
    return [(launch.get_kernel(NAME, make_kernel, cfg), forward_signature(dtype))]


def run(problem, cfg, device):
    p = problem
    B, H, Nq, Nk, d, dv = p.shape
    (kernel, _), = compiled_kernels(cfg, p.dtype_name)
    lse = p.empty_lse()
    grid = (B * H, -(-Nq // cfg.BR))
    kernel(grid, (cfg.NT,), shared_bytes(cfg),
           (p.q, p.k, p.v, p.out, lse, float(p.scale), int(p.causal), int(p.causal_offset)),
           device)
    return lse
