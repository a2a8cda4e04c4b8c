"""The FMA backward (float16 in float32, float32, float64; bfloat16 staged as float32):
FlashAttention-2's gradients with one thread per row, deterministic by construction (no atomics).

bfloat16: numba has no bfloat16 type, so q, k, v and dO are first copied to float32 (CuPy casts,
4 x N x d words more device memory, still O(N)) and the float32 kernels run; the gradients are
rounded to bfloat16 at the end, as the float16 ones are.

Two kernels after the preprocessing pass D = rowsum(dO * O) (one CuPy reduction):
- key pass: one thread owns one key row j. Its k and v rows sit in shared memory (transposed:
  a warp reads 32 consecutive words, no bank conflicts). The block walks the query tiles that can
  see its keys (causal: from the first visible row on); each tile of Q, dO, lse and D is staged
  into shared memory once and read by every thread as broadcasts. Per query row: s = q . k,
  P = exp(scale s - lse), dP = dO . v, dS = scale P (dP - D); dV += P dO, dK += dS q.
- query pass: one thread owns one query row i, the key tiles stream past it: dQ += dS k.
  This recomputes S and dP once more (FlashAttention-2's deterministic dQ), in exchange for no
  atomics and no float32 dQ accumulator in device memory.

The accumulated columns ([dK | dV] in the key pass, dQ in the query pass) are split across grid z
in chunks of at most ACC_WORDS words, each block recomputing the dot products, so the
accumulators stay in registers at any head dim (as the forward row kernel splits its output).
"""
from dataclasses import dataclass

import numpy as np
from numba import cuda, int64

from ..device import Unsupported
from .. import mods as user_mods
from . import launch, row
from .config import SIMT_ACC, SimtConfig, simt_dt
from .common import NEG_INF, SMEM_ALIGN, compute_type, device_function, element_size, exp_for, \
    head_dim_bucket, inlined_device, key_end, stage_chunk, tile_stager
from .mma import mods

NAME = "cuda.row"
ACC_WORDS = 64        # 32-bit words of accumulated gradient columns a thread keeps (no spills)
TILE_BYTES = 48 * 1024


@dataclass(frozen=True)
class RowBackwardConfig(SimtConfig):
    """One compile-time variant of cuda.row's backward (cuda.config's naming scheme).

    D, DV: padded head dims. BR: the rows a block owns, one thread each (NT = BR): key rows in
    the key pass, query rows in the query pass; BC: the rows of the other side a tile (query
    tiles in the key pass, key tiles in the query pass). DT: "f32" or "f64", the accumulators'
    type. CW_KEY, CW_QUERY: the accumulated columns a block of the key pass ([dK | dV]) and of
    the query pass (dQ) computes (grid z covers the rest). SUMS: 2 for float32 inputs, whose
    gradients are summed a tile at a time and the tiles' sums then added (a float32 sum over
    thousands of rows in one accumulator misses the accuracy rule: the naive baseline's BLAS
    sums in blocks), for ~40 more registers; 1 (one accumulator) for the others.
    """
    D: int
    DV: int
    BR: int
    BC: int
    DT: str
    CW_KEY: int
    CW_QUERY: int
    SUMS: int = 1
    MODS: str = ""    # as cuda.row's forward: modifications score by score (their derivatives)
    WINDOW: int = 0   # a sliding window: each row's (key's) range limited to it

    def pass_config(self, kernel):
        """The compile-time config of the "keys" or "queries" kernel."""
        cw = self.CW_KEY if kernel == "keys" else self.CW_QUERY
        return {"D": self.D, "DV": self.DV, "CW": cw, "BR": self.BR, "BC": self.BC,
                "DT": self.DT, "SUMS": self.SUMS,
                **{name: getattr(self, name) for name in ("MODS", "WINDOW")
                   if getattr(self, name)}}


def _own_rows_loader(D, BR, ACC):
    """Copies this thread's row of a (B, H, N, d) array into shared memory, transposed
    (smem[base + c * BR + tid]), zero past the row count or d."""
    u = np.uint64
    uD, uBR = u(D), u(BR)

    @device_function
    def load_own_row(src, b, h, row, nrows, ncols, smem, base, tid):
        for c in range(uD):
            smem[base + c * uBR + tid] = ACC(src[b, h, row, c]) \
                if row < nrows and c < ncols else ACC(0)
    return load_own_row


def _pass_pieces(BC, D, DV, BR, acc):
    """What both passes need: stagers for the streamed tiles (BC rows of width D, then DV),
    the number of staging registers, and loaders for the thread's own rows (widths D and DV)."""
    chunk = stage_chunk(acc)
    _, _, stage_d, regs_d, _ = tile_stager(BC, D, BR, acc, False, D, chunk)
    _, _, stage_dv, regs_dv, _ = tile_stager(BC, DV, BR, acc, False, DV, chunk)
    ACC = compute_type(acc)
    return (stage_d, stage_dv, max(regs_d, regs_dv), _own_rows_loader(D, BR, ACC),
            _own_rows_loader(DV, BR, ACC))


def make_key_kernel(D, DV, CW, BR, BC, DT, SUMS=1, MODS="", WINDOW=0):
    """dK and dV: BR key rows a block, query tiles of BC rows, CW accumulated columns of the
    concatenated [dK | dV] (D + DV padded columns) per block (grid z); SUMS levels of sums;
    MODS, WINDOW as cuda.row's forward (a pair's dS times the modifications' derivative)."""
    acc = SIMT_ACC[DT]
    ACC = compute_type(acc)
    exp = exp_for(acc)
    u = np.uint64
    uD, uDV, uBR, uBC, uCW = u(D), u(DV), u(BR), u(BC), u(CW)
    two_level, CW_T = SUMS == 2, CW if SUMS == 2 else 1
    KT, VT = u(0), u(D * BR)                    # own k, v rows (transposed)
    QS = u((D + DV) * BR)                       # then the Q tile, the dO tile, lse and D
    DOS = QS + u(BC * D)
    LS = DOS + u(BC * DV)
    DS = LS + uBC
    zero = u(0)
    stage_q, stage_do, STAGE_REGS, load_own_row, load_own_v = _pass_pieces(BC, D, DV, BR, acc)
    mod_score_grad = row.mod_functions(MODS, acc, "mod_score_grad")

    @inlined_device
    def key_gradients(q, k, v, do, lse, delta, dk, dv, scale, causal, causal_offset,
                      window_left, window_right, margs):
        H = q.shape[1]  # dk, dv: (B, H, Nk, .), each query head's share (see run())
        Nq, d, Nk, dvd = u(q.shape[2]), u(q.shape[3]), u(k.shape[2]), u(v.shape[3])
        sc = ACC(scale)
        tid = u(cuda.threadIdx.x)
        b = u(cuda.blockIdx.x // H)
        h = u(cuda.blockIdx.x % H)
        hk = h // u(H // k.shape[1])  # grouped-query attention: the key/value head h reads
        j_first = u(cuda.blockIdx.y) * uBR
        j = j_first + tid
        col0 = u(cuda.blockIdx.z) * uCW        # this block's columns of [dK | dV]
        smem = cuda.shared.array(0, ACC, alignment=SMEM_ALIGN)
        regs = cuda.local.array(STAGE_REGS, ACC)
        load_own_row(k, b, hk, j, Nk, d, smem, KT, tid)
        load_own_v(v, b, hk, j, Nk, dvd, smem, VT, tid)
        acc_g = cuda.local.array(CW, ACC)  # the gradient sums; with two levels, acc_t sums
        acc_t = cuda.local.array(CW_T, ACC)  # a tile's rows and acc_g the tiles' sums
        for c in range(uCW):
            acc_g[c] = 0
        # The first query row that sees key j_first (causal), rounded down to a tile.
        i_start = zero
        if causal and int(j_first) - causal_offset > 0:
            i_start = u(int(j_first) - causal_offset) // uBC * uBC
        i_end = Nq
        if WINDOW:  # the rows whose window reaches the block's keys
            if window_right >= 0 and int(j_first) - causal_offset - window_right > 0:
                i_start = max(i_start, u(int(j_first) - causal_offset - window_right) // uBC
                              * uBC)
            if window_left >= 0:
                last = int(j_first) + int(uBR) - 1 - causal_offset + window_left + 1
                i_end = min(Nq, u(max(0, last)))
        qbh, dobh = q[b, h], do[b, h]
        for i0 in range(i_start, i_end, uBC):
            cuda.syncthreads()  # the previous tile is no longer read
            stage_q(qbh, i0, Nq, d, regs, smem, QS, tid)
            stage_do(dobh, i0, Nq, dvd, regs, smem, DOS, tid)
            for t in range(tid, uBC, uBR):
                inside = i0 + t < Nq
                smem[LS + t] = ACC(lse[b, h, i0 + t]) if inside else ACC(NEG_INF)
                smem[DS + t] = ACC(delta[b, h, i0 + t]) if inside else ACC(0)
            cuda.syncthreads()
            rows = min(uBC, Nq - i0)
            if two_level:
                for w in range(uCW):
                    acc_t[w] = 0
            for r in range(rows):
                m = smem[LS + r]
                if j >= Nk or m == NEG_INF or j >= u(key_end(i0 + r, Nk, causal, causal_offset)):
                    continue  # this key is not seen by the row, or the row sees no key
                if WINDOW:
                    first, end = row.window_range(int64(i0 + r), int64(Nk), window_left,
                                                  window_right, causal_offset)
                    if int64(j) < first or int64(j) >= end:
                        continue
                s = ACC(0)
                for c in range(uD):
                    s += smem[QS + r * uD + c] * smem[KT + c * uBR + tid]
                dp = ACC(0)
                for c in range(uDV):
                    dp += smem[DOS + r * uDV + c] * smem[VT + c * uBR + tid]
                x = s * sc
                grad = ACC(1)
                if MODS:
                    x, grad = mod_score_grad(x, int64(b), int64(h), int64(i0 + r), int64(j),
                                             *margs)
                    if x == NEG_INF:  # a refused pair
                        continue
                p = exp(x - m)
                ds = p * (dp - smem[DS + r]) * grad * sc
                for w in range(uCW):
                    c = col0 + w
                    if c < uD:
                        x = ds * smem[QS + r * uD + c]
                    elif c < uD + uDV:
                        x = p * smem[DOS + r * uDV + (c - uD)]
                    else:
                        continue
                    if two_level:
                        acc_t[w] += x
                    else:
                        acc_g[w] += x
            if two_level:
                for w in range(uCW):
                    acc_g[w] += acc_t[w]
        if j < Nk:
            for w in range(uCW):
                c = col0 + w
                if c < d:
                    dk[b, h, j, c] = acc_g[w]
                elif uD <= c and c - uD < dvd:
                    dv[b, h, j, c - uD] = acc_g[w]

    return row.entry("key_gradients", key_gradients, KEY_PARAMETERS, MODS, WINDOW, acc)


KEY_PARAMETERS = "q, k, v, do, lse, delta, dk, dv, scale, causal, causal_offset"
QUERY_PARAMETERS = "q, k, v, do, lse, delta, dq, scale, causal, causal_offset"


def make_query_kernel(D, DV, CW, BR, BC, DT, SUMS=1, MODS="", WINDOW=0):
    """dQ: BR query rows a block, key tiles of BC rows, CW columns of dQ per block (grid z);
    SUMS levels of sums; MODS, WINDOW as the key pass."""
    acc = SIMT_ACC[DT]
    ACC = compute_type(acc)
    exp = exp_for(acc)
    u = np.uint64
    uD, uDV, uBR, uBC, uCW = u(D), u(DV), u(BR), u(BC), u(CW)
    two_level, CW_T = SUMS == 2, CW if SUMS == 2 else 1
    QT, DOT = u(0), u(D * BR)                   # own q, dO rows (transposed)
    KS = u((D + DV) * BR)                       # then the K tile and the V tile
    VS = KS + u(BC * D)
    zero = u(0)
    stage_k, stage_v, STAGE_REGS, load_own_row, load_own_do = _pass_pieces(BC, D, DV, BR, acc)
    mod_score_grad = row.mod_functions(MODS, acc, "mod_score_grad")

    @inlined_device
    def query_gradients(q, k, v, do, lse, delta, dq, scale, causal, causal_offset, window_left,
                        window_right, margs):
        H = q.shape[1]
        Nq, d, Nk, dvd = u(q.shape[2]), u(q.shape[3]), u(k.shape[2]), u(v.shape[3])
        sc = ACC(scale)
        tid = u(cuda.threadIdx.x)
        b = u(cuda.blockIdx.x // H)
        h = u(cuda.blockIdx.x % H)
        block_first = u(cuda.gridDim.y - 1 - cuda.blockIdx.y) * uBR  # longest (causal) first
        i = block_first + tid
        col0 = u(cuda.blockIdx.z) * uCW
        smem = cuda.shared.array(0, ACC, alignment=SMEM_ALIGN)
        regs = cuda.local.array(STAGE_REGS, ACC)
        load_own_row(q, b, h, i, Nq, d, smem, QT, tid)
        load_own_do(do, b, h, i, Nq, dvd, smem, DOT, tid)
        m = ACC(lse[b, h, i]) if i < Nq else ACC(NEG_INF)
        di = ACC(delta[b, h, i]) if i < Nq else ACC(0)
        acc_g = cuda.local.array(CW, ACC)    # as in the key pass
        acc_t = cuda.local.array(CW_T, ACC)
        for c in range(uCW):
            acc_g[c] = 0
        row_keys = u(key_end(i, Nk, causal, causal_offset)) if i < Nq and m != NEG_INF else zero
        last_row = min(Nq, block_first + uBR) - u(1)
        block_keys = u(key_end(last_row, Nk, causal, causal_offset))
        row_first = zero
        block_start = zero
        if WINDOW:
            row_first, row_keys, block_keys, block_start = row.window_keys(
                i, last_row, block_first, Nk, row_keys, block_keys, window_left, window_right,
                causal_offset, uBC)
        hk = h // u(H // k.shape[1])  # grouped-query attention: the key/value head h reads
        kbh, vbh = k[b, hk], v[b, hk]
        for j0 in range(block_start, block_keys, uBC):
            cuda.syncthreads()
            stage_k(kbh, j0, Nk, d, regs, smem, KS, tid)
            stage_v(vbh, j0, Nk, dvd, regs, smem, VS, tid)
            cuda.syncthreads()
            keys = min(uBC, row_keys - j0) if row_keys > j0 else zero
            if two_level:
                for w in range(uCW):
                    acc_t[w] = 0
            skip = row_first - j0 if WINDOW and row_first > j0 else zero
            for jj in range(skip, keys):
                s = ACC(0)
                for c in range(uD):
                    s += smem[QT + c * uBR + tid] * smem[KS + jj * uD + c]
                dp = ACC(0)
                for c in range(uDV):
                    dp += smem[DOT + c * uBR + tid] * smem[VS + jj * uDV + c]
                x = s * sc
                grad = ACC(1)
                if MODS:
                    x, grad = mod_score_grad(x, int64(b), int64(h), int64(i), int64(j0 + jj),
                                             *margs)
                    if x == NEG_INF:  # a refused pair
                        continue
                ds = exp(x - m) * (dp - di) * grad * sc
                for w in range(uCW):
                    c = col0 + w
                    if c < uD:
                        if two_level:
                            acc_t[w] += ds * smem[KS + jj * uD + c]
                        else:
                            acc_g[w] += ds * smem[KS + jj * uD + c]
            if two_level:
                for w in range(uCW):
                    acc_g[w] += acc_t[w]
        if i < Nq:
            for w in range(uCW):
                c = col0 + w
                if c < d:
                    dq[b, h, i, c] = acc_g[w]

    return row.entry("query_gradients", query_gradients, QUERY_PARAMETERS, MODS, WINDOW, acc)


for _factory in (make_key_kernel, make_query_kernel):
    _factory.code_identity = lambda **config: row.identity(__name__, config.get("MODS", ""))
    _factory.cacheable = lambda **config: mods.cacheable(config.get("MODS", ""))


def _chunk_width(total, words):
    """Columns a block accumulates: all of them up to ACC_WORDS words, else even chunks of 16."""
    most = ACC_WORDS // words
    if total <= most:
        return total
    chunks = -(-total // most)
    return -(-total // chunks // 16) * 16


def config(problem, device):
    B, H, Nq, Nk, d, dv = problem.shape
    DT = simt_dt(problem.dtype_name)
    acc = SIMT_ACC[DT]
    esize = element_size(acc)
    D, DV = head_dim_bucket(d), head_dim_bucket(dv)
    words = esize // 4
    limit = None if device.simulator else device.smem_per_block_optin
    mod = getattr(problem, "mods", None)
    token = mods.token_for(mod)
    window = int(bool(getattr(mod, "window", None)))
    for rows in ((32,) if device.simulator else (128, 64, 32)):
        for tile in (64, 32, 16, 8):
            cfg = RowBackwardConfig(D, DV, rows, tile, DT,
                                    _chunk_width(D + DV, words), _chunk_width(D, words),
                                    2 if problem.dtype_name == "float32" else 1, token, window)
            if tile * (D + DV) * esize <= TILE_BYTES and (
                    limit is None or shared_bytes(cfg) <= limit):
                return cfg
    raise Unsupported(f"{NAME} backward: its smallest block needs {shared_bytes(cfg)} bytes of "
                      f"shared memory for d={d}, dv={dv} in {acc}, more than the {limit} a block "
                      f"may use on {device.name}; the CPU path can take it")


def shared_bytes(cfg):
    own = cfg.BR * (cfg.D + cfg.DV)
    tiles = cfg.BC * (cfg.D + cfg.DV) + 2 * cfg.BC
    return (own + tiles) * element_size(cfg.acc)


def signature(dtype, kernel, window=0, token=""):
    """The argument types of the "keys" or "queries" kernel: q, k, v, dO (bfloat16 staged as
    float32), lse and D in the compute type, then dK, dV or dQ in the compute type, then scale,
    causal, causal_offset (then a window's two edges, then the modifications' arguments)."""
    from numba import types
    from .launch import array_type
    acc = SIMT_ACC[simt_dt(dtype)]
    arr = array_type("float32" if dtype == "bfloat16" else dtype)
    rows, grad = array_type(acc, 3), array_type(acc)
    grads = (grad, grad) if kernel == "keys" else (grad,)
    return (arr, arr, arr, arr, rows, rows, *grads, types.float64, types.int64, types.int64) + \
        (types.int64,) * (2 * window) + mods.argument_types(token)


def compiled_kernels(cfg, dtype):
    """What run() launches for this config and input dtype: [(Kernel, numba argument types)]
    for the key pass, then the query pass (`numflash.precompile`, `explain`'s cache status)."""
    keys = launch.get_kernel(NAME + ".backward_keys", make_key_kernel, cfg.pass_config("keys"))
    queries = launch.get_kernel(NAME + ".backward_queries", make_query_kernel,
                                cfg.pass_config("queries"))
    return [(keys, signature(dtype, "keys", cfg.WINDOW, cfg.MODS)),
            (queries, signature(dtype, "queries", cfg.WINDOW, cfg.MODS))]


def run(problem, cfg, device):
    """Fill problem.dq, dk, dv (the gradients) for a normalized device or simulator problem."""
    from . import fastpath
    fastpath.note_unreplayable("cuda.row's backward: CuPy computes delta, copies and GQA sums")
    p = problem
    xp = p.xp
    B, H, Nq, Nk, d, dv = p.shape
    acc = np.dtype(cfg.acc)
    q, k, v, do = p.q, p.k, p.v, p.do
    if p.dtype_name == "bfloat16":  # no bfloat16 in numba: the float32 kernels read copies
        q, k, v, do = (a.astype(np.float32) for a in (q, k, v, do))
    # Preprocessing: D = rowsum(dO * O) in the compute type, from O as stored.
    delta = (do.astype(acc) * p.o.astype(acc)).sum(axis=-1)
    lse = p.lse if p.lse.dtype == acc else p.lse.astype(acc)
    grads = [g if g.dtype == acc else xp.empty(g.shape, acc) for g in (p.dq, p.dk, p.dv)]
    # Grouped-query attention: the key pass writes each query head's share of dK and dV, and the
    # group's shares are summed here in a fixed order. Summing them inside the kernel (one
    # accumulator over group x Nq rows) failed the float32 accuracy rule on the H100 (dK error
    # 1.7e-5 against a bound of 8.1e-6 at H 8, Hk 2, Nq 1000); one share per head is as
    # accurate as without GQA, for (group - 1) x (Nk x (d + dv)) words more memory.
    group = p.kv_group
    shares = grads[1:] if group == 1 else [xp.empty((B, H, Nk, g.shape[3]), acc)
                                           for g in grads[1:]]
    D, DV, BR = cfg.D, cfg.DV, cfg.BR
    opts = (float(p.scale), int(p.causal), int(p.causal_offset))
    if cfg.WINDOW:
        opts += tuple(int(w) for w in p.mods.window)
    if cfg.MODS:
        opts += mods.arguments(p.mods)
    (key_kernel, _), (query_kernel, _) = compiled_kernels(cfg, p.dtype_name)
    with user_mods.compile_errors(p.mods, NAME):
        key_kernel((B * H, -(-Nk // BR), -(-(D + DV) // cfg.CW_KEY)), (cfg.NT,),
                   shared_bytes(cfg), (q, k, v, do, lse, delta, shares[0], shares[1], *opts),
                   device)
        if group > 1:
            for g, share in zip(grads[1:], shares):
                g[...] = share.reshape(B, H // group, group, Nk, g.shape[3]).sum(axis=2)
        query_kernel((B * H, -(-Nq // BR), -(-D // cfg.CW_QUERY)), (cfg.NT,),
                     shared_bytes(cfg), (q, k, v, do, lse, delta, grads[0], *opts), device)
    for g, mine in zip((p.dq, p.dk, p.dv), grads):
        if g is not mine:
            g[...] = mine
