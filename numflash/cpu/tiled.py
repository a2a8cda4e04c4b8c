"""The CPU path: the block-tiled online-softmax loop, compiled with numba.njit.

Each (batch, head, query block) is one parallel task; where those are fewer than the threads
(decoding), each one's key blocks are dealt out in runs, a task each, and the runs' partial
results merged (tiled_forward's ``splits``). Key/value blocks stream past a task: S = Q K^T
for the block (BLAS through np.dot), the running row max m and row sum l are updated, the
accumulator is rescaled by exp(m_old - m_new) and P V is added. Nothing of size Nq x Nk exists.
float16 inputs are read as their bit patterns and decoded through a 65536-entry table, tile by tile.

Speed notes (measurements in bench/NOTES.md, "CPU path"):
- Exponentials are exp2(c2 * s - m), c2 = scale * log2(e): one fused multiply-add and one exp2.
  (Pre-scaling Q instead would round every q element once more than naive attention does, which
  fails the accuracy rule for large scores; see tests/test_cpu.py.) float32 uses a branch-free
  polynomial exp2 that LLVM vectorizes (numba has no vector libm here); float64 keeps libm's.
- The row max uses llvm.maxnum: LLVM vectorizes that reduction without the 'nnan' flag, which
  we cannot allow (masked scores are -inf and must stay -inf).
- Most key blocks need one pass over S: the running max is only raised when a block's values
  would pass 2**16 (lazy rescale, _online_softmax).
- The BLAS calls run single-threaded: the parallelism is numba's prange over tasks, and OpenBLAS
  threads started inside each task fight numba's threads for the same cores.
"""
import ctypes
import math
import threading

import numpy as np
from llvmlite import ir
import numba
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .. import dropout as _dropout
from ..mods import compile_errors

NAME = "cpu.tiled"
# GEMMs with inner dimension d = 64 run at ~127 GFLOP/s on one core here at 512 x 512 blocks and
# ~109 at 128 x 256 (big square GEMMs: ~153); the 1 MiB float32 S tile still fits the 2 MiB L2.
BLOCK_Q = 512
BLOCK_K = 512
MIN_BLOCK_Q = 64
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LAZY_RESCALE_LIMIT = 65536.0  # 2**16: see _online_softmax
# Loop orders (config's "order"): a task per (batch, head, query block) reading its head's K/V
# tiles, or, for few query rows over a (B, N, Hk, d) KV cache, a task per run of keys reading
# each key's rows of every head at once (keymajor_forward).
HEAD_MAJOR = "head-major"
KEY_MAJOR = "key-major"
# Query rows up to which it is taken: at 16 it still beat head-major's strided tiles on this
# 2-core machine, GQA groups 1-16 (bench/NOTES.md), at 32 it lost.
KEY_MAJOR_MAX_ROWS = 16


def _decode(x, lut):
    """Element value as the compute dtype (float16 arrive as uint16 bit patterns)."""


@overload(_decode, inline="always")
def _decode_impl(x, lut):
    if isinstance(x, types.Integer):
        return lambda x, lut: lut[x]
    return lambda x, lut: x


@intrinsic
def _maxnum(typingctx, a, b):
    """llvm.maxnum(a, b): max that LLVM vectorizes as a reduction without 'nnan'."""
    if not (isinstance(a, types.Float) and a == b):
        return None

    def codegen(context, builder, sig, args):
        ty = args[0].type
        fn = builder.module.declare_intrinsic("llvm.maxnum", [ty], ir.FunctionType(ty, [ty, ty]))
        return builder.call(fn, args)
    return a(a, b), codegen


@intrinsic
def _f32_from_bits(typingctx, x):
    """Reinterpret int32 bits as a float32."""
    if x != types.int32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


def _exp2(x):
    """2**x in x's float type, for x <= 64 (x may be -inf)."""


@overload(_exp2, inline="always")
def _exp2_impl(x):
    if x == types.float64:
        return lambda x: np.exp2(x)

    def exp2_f32(x):
        # 2^x = 2^n * 2^f, n = round(x), |f| <= 1/2; 2^f by Cephes exp2f's degree-6 polynomial
        # (max relative error 8e-8 measured). Below 2^-126 the result is flushed to 0, which is
        # also what -inf (a masked score) gives; above 2^64 it saturates (callers only need to
        # see that it is large). Branch-free so the row loop vectorizes.
        xc = min(max(x, np.float32(-127.0)), np.float32(64.0))
        n = np.floor(xc + np.float32(0.5))
        f = xc - n
        p = np.float32(1.535336188319500e-4)
        p = p * f + np.float32(1.339887440266574e-3)
        p = p * f + np.float32(9.618437357674640e-3)
        p = p * f + np.float32(5.550332471162809e-2)
        p = p * f + np.float32(2.402264791363012e-1)
        p = p * f + np.float32(6.931472028550421e-1)
        p = p * f + np.float32(1.0)
        two_n = _f32_from_bits(np.int32((n + np.float32(127.0)) * np.float32(8388608.0)))
        # NaN (neither >= nor <) comes back as NaN: a poisoned score poisons its row.
        if x >= np.float32(-126.0):
            return p * two_n
        return np.float32(0.0) if x < np.float32(-126.0) else x
    return exp2_f32


def _tanh(x):
    """tanh(x) in x's float type: libm's for float64; for float32 an inline one (<= 2 ulp
    measured over float32 arguments; libm's tanhf: 1.4), about 10x faster than the libm call
    numba makes per score (bench/NOTES.md, session 40)."""


# tanh(x) = x + x^3 p(x^2) for |x| < 0.625: p least-squares fitted to tanh's relative error on
# [0, 0.625] (4.5e-9 at most, in float64; bench/NOTES.md, session 40)
_TANH_SMALL = (-0.33333281, 0.13331432, -0.05373915, 0.02063782, -0.005704)


@overload(_tanh, inline="always")
def _tanh_impl(x):
    if x == types.float64:
        return lambda x: math.tanh(x)
    c0, c1, c2, c3, c4 = (np.float32(c) for c in _TANH_SMALL)
    minus_two_log2e = np.float32(-2 * LOG2E)

    def tanh_f32(x):
        a = abs(x)
        if a < np.float32(0.625):
            u = x * x
            return x + x * u * ((((c4 * u + c3) * u + c2) * u + c1) * u + c0)
        # Above 0.625 e <= 0.29, so 1 - e loses no digits; NaN falls through to NaN.
        e = _exp2(a * minus_two_log2e)
        t = (np.float32(1.0) - e) / (np.float32(1.0) + e)
        return t if x > 0 else -t
    return tanh_f32


def _in_type(x, value):
    """value (a Python float) as x's float type."""


@overload(_in_type, inline="always")
def _in_type_impl(x, value):
    if x == types.float32:
        return lambda x, value: np.float32(value)
    return lambda x, value: value


def softcap_score(x, b, h, i, j, cap, inverse_cap):
    """numflash.mods' softcap, cap tanh(x / cap), in x's precision (float32 for float32 and
    float16 calls): the CPU path's compile of it (numflash.mods._compile)."""
    return cap * _tanh(x * _in_type(x, inverse_cap))


def softcap_grad(x, b, h, i, j, cap, inverse_cap):
    """d softcap_score / dx = 1 - tanh(x / cap)^2, in x's precision."""
    t = _tanh(x * _in_type(x, inverse_cap))
    return 1 - t * t


# No 'nnan'/'ninf': fully masked rows rely on -inf comparisons that those flags would delete.
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

_DROPOUT = _dropout.compiled(njit)
_row_bytes = _DROPOUT["row_bytes"]
_keep = _DROPOUT["keep"]


@njit(fastmath=FASTMATH, cache=True)
def apply_dropout(x, b, h, i0, j0, seed_lo, seed_hi, threshold, factor):
    """x[r, c], the probability of pair (b, h, i0 + r, j0 + c), times ``factor`` (1 / (1 - p))
    where numflash.dropout keeps the pair, 0 where it drops it: one generator call per row and
    8 keys (the keys j, j + 8, ..., j + 56 of a 64-key group share its bytes)."""
    rows, cols = x.shape
    zero = x.dtype.type(0)
    for r in range(rows):
        i = i0 + r
        odd = (i >> 3) & 1   # the call's bytes 8-15 are this row's
        for c0 in range(cols):
            j = j0 + c0
            if c0 >= 8 and (j & 63) >= 8:   # its call was made at key j - 8 (or earlier)
                continue
            lo, hi = _row_bytes(seed_lo, seed_hi, b, h, i, j)
            row = hi if odd else lo
            for n in range((j & 63) >> 3, 8):   # this key and j + 8, ... in the group
                c = c0 + (n - ((j & 63) >> 3)) * 8
                if c >= cols:
                    break
                kept = (row >> np.uint64(8 * n)) & np.uint64(255) >= threshold
                x[r, c] = x[r, c] * factor if kept else zero


@njit(fastmath=FASTMATH, cache=True)
def _load_block(src, b, h, r0, rows, lut, dst):
    """dst[:rows] = src[b, h, r0:r0+rows, :], converted to dst's dtype (any strides)."""
    for r in range(rows):
        for c in range(src.shape[3]):
            dst[r, c] = _decode(src[b, h, r0 + r, c], lut)


def _rows_of(src, b, h, r0, rows, lut, buf):
    """src[b, h, r0:r0+rows] in buf's dtype: a view of src where it is C-contiguous in that
    dtype (decoding reads each K/V row once, so a copy would double its memory traffic), else
    converted into buf (returned as buf[:rows])."""


@overload(_rows_of, inline="always")
def _rows_of_impl(src, b, h, r0, rows, lut, buf):
    if isinstance(src, types.Array) and src.layout == "C" and src.dtype == buf.dtype:
        return lambda src, b, h, r0, rows, lut, buf: src[b, h, r0:r0 + rows]

    def converted(src, b, h, r0, rows, lut, buf):
        _load_block(src, b, h, r0, rows, lut, buf)
        return buf[:rows]
    return converted


@njit(fastmath=FASTMATH, cache=True)
def all_finite(a):
    """No NaN or inf in a 2-D array (BLAS would spread one through a zero weight: 0 * NaN)."""
    for r in range(a.shape[0]):
        for c in range(a.shape[1]):
            if not np.isfinite(a[r, c]):
                return False
    return True


@njit(fastmath=FASTMATH, cache=True)
def visible_keys(i, j0, cols, causal, causal_offset):
    """How many of the keys j0:j0+cols query row i sees (they are the first ones)."""
    if not causal:
        return cols
    return min(cols, max(0, i + causal_offset - j0 + 1))


@njit(fastmath=FASTMATH, cache=True)
def _row_max(row):
    """max(row); -inf for a row of -inf."""
    mx = row[0]
    for c in range(1, row.shape[0]):
        mx = _maxnum(mx, row[c])
    return mx


@njit(fastmath=FASTMATH, cache=True)
def _exp2_row(row, c2, mx, p, zero):
    """p = 2**(c2 * row - mx); returns sum(p) (zero: 0 in row's dtype, so the sum stays in it)."""
    total = zero
    for c in range(row.shape[0]):
        e = _exp2(row[c] * c2 - mx)  # one fused multiply-add: the exponent has a single rounding
        p[c] = e
        total += e
    return total


@njit(fastmath=FASTMATH, cache=True)
def _online_softmax(s, c2, p, m, l, alpha, zero):
    """One key block of the online softmax, row by row, for raw scores s = q k^T.

    With c2 = softmax_scale * log2(e) and the running max m kept in log2 units (m = c2 * max s):
    p = 2**(c2 * s - m) with the updated m; l (running sum) updated; alpha = the factor the
    accumulator must be scaled by before P V is added.
    """
    for r in range(s.shape[0]):
        m_old = m[r]
        if m_old > -np.inf:
            # Lazy rescale (as FlashAttention-3 does): keep the old max as the reference unless this
            # block's values would exceed 2**16, which the sum shows. Precision does not depend on
            # the reference, overflow is far off, and the common case is one pass without a max.
            total = _exp2_row(s[r], c2, m_old, p[r], zero)
            if total < LAZY_RESCALE_LIMIT:
                l[r] += total
                alpha[r] = 1
                continue
        m_new = max(m_old, _row_max(s[r]) * c2)  # c2 > 0, so max commutes with the scaling
        if m_new == -np.inf:  # no visible key yet: P = 0 (and exp2(-inf - -inf) would be NaN)
            poison = zero  # ...but a NaN score (maxnum skips it) must still poison the row
            for c in range(s.shape[1]):
                x = s[r, c]
                p[r, c] = zero if x == -np.inf else x
                poison += p[r, c]
            l[r] += poison
            alpha[r] = 1
            continue
        total = _exp2_row(s[r], c2, m_new, p[r], zero)
        alpha[r] = np.exp2(m_old - m_new)  # 0 while m was -inf
        l[r] = l[r] * alpha[r] + total
        m[r] = m_new


@njit(fastmath=FASTMATH, cache=True)
def _mask_past_diagonal(s, i0, j0, causal_offset):
    """-inf for the keys of tile s (rows i0.., keys j0..) past each row's causal diagonal."""
    rows, cols = s.shape
    if j0 + cols - 1 > i0 + causal_offset:  # the tile crosses the diagonal
        for r in range(rows):
            for c in range(visible_keys(i0 + r, j0, cols, True, causal_offset), cols):
                s[r, c] = -np.inf


@njit(fastmath=FASTMATH, cache=True)
def _tile_probabilities(s, p, b, h, i0, j0, causal, causal_offset, c2, scale, m, l, alpha,
                        dropout, mod, mod_args):
    """Raw scores s = q k^T of one tile (rows i0.., keys j0.. of head h) to probabilities p:
    the causal mask, the modification, one step of the online softmax (m, l, alpha: the rows'
    state), then dropout. Shared by both loop orders."""
    if causal:
        _mask_past_diagonal(s, i0, j0, causal_offset)
    if mod is not None:  # compiled away without a modification
        mod(s, b, h, i0, j0, scale, mod_args)
    _online_softmax(s, c2, p, m, l, alpha, p.dtype.type(0))
    if dropout is not None:  # compiled away without dropout
        apply_dropout(p, b, h, i0, j0, *dropout)


@njit(fastmath=FASTMATH, cache=True)
def _takes_part(b, h, i, j, j0, cols, causal, causal_offset, dropout, mod_visible, mod_args):
    """Pair (i, j) of a tile (keys j0..j0+cols) adds its p v: it is visible and not dropped.
    What keeps a non-finite v from reaching rows through a zero weight (0 * inf is NaN)."""
    if j - j0 >= visible_keys(i, j0, cols, causal, causal_offset):
        return False
    if mod_visible is not None and not mod_visible(b, h, i, j, mod_args):
        return False
    return dropout is None or _keep(dropout[0], dropout[1], dropout[2], b, h, i, j)


@njit(fastmath=FASTMATH, cache=True)
def _write_rows(acc, m, l, out, lse, ob, h, i0):
    """out[ob, h, i0 + r] = acc[r] / l[r] and lse[ob, h, i0 + r] from the online softmax's state
    (m in log2 units); a row that saw no key gets zeros and lse = -inf."""
    for r in range(acc.shape[0]):
        if l[r] != 0:  # l > 0, or NaN from a poisoned score: NaN out and lse, as the reference
            inv = 1 / l[r]
            for c in range(acc.shape[1]):
                out[ob, h, i0 + r, c] = acc[r, c] * inv
            lse[ob, h, i0 + r] = np.log(l[r]) + m[r] * LN2
        else:  # the row sees no key
            for c in range(acc.shape[1]):
                out[ob, h, i0 + r, c] = 0
            lse[ob, h, i0 + r] = -np.inf


@njit(fastmath=FASTMATH, cache=True)
def _key_run(kend, block_k, splits, s):
    """Keys [kstart, kend) of split s when keys 0..kend are dealt out in ``splits`` runs of
    whole blocks."""
    run = (kend + block_k - 1) // block_k
    run = (run + splits - 1) // splits * block_k
    kstart = min(kend, s * run)
    return kstart, min(kend, kstart + run)


@njit(fastmath=FASTMATH, cache=True)
def _attend_block(q, k, v, out, lse, b, ob, h, hk, i0, rows, kstart, kend, causal,
                  causal_offset, block_k, c2, lut, scale, dropout, mod, mod_visible, mod_live,
                  mod_args):
    """Rows i0:i0+rows of out[ob, h] and lse[ob, h] from keys kstart:kend (kstart a multiple of
    block_k) of batch entry b's key/value head hk: one parallel task (ob is b, or a split's
    partial-result entry; see tiled_forward). ``mod`` (None, or numflash.mods' compiled
    apply_forward) turns each tile of raw scores into modified scaled scores; the caller then
    passes c2 = log2(e). A tile that ``mod_live`` says a block mask empties is skipped (it
    would add nothing). ``dropout`` (None, or dropout_arguments' tuple): P is dropped
    (numflash.dropout) after the row sums take it, before P V."""
    d = q.shape[3]
    dv = v.shape[3]
    dt = out.dtype
    zero = out.dtype.type(0)
    # Buffers allocated once per task and reused for every key block (O(block) memory).
    qi = np.empty((rows, d), dt)
    _load_block(q, b, h, i0, rows, lut, qi)
    kj = np.empty((block_k, d), dt)
    vj = np.empty((block_k, dv), dt)
    s_buf = np.empty(rows * block_k, dt)
    p_buf = np.empty(rows * block_k, dt)
    pv = np.empty((rows, dv), dt)
    alpha = np.empty(rows, dt)
    m = np.full(rows, -np.inf, dt)
    l = np.zeros(rows, dt)
    acc = np.zeros((rows, dv), dt)

    for j0 in range(kstart, kend, block_k):
        cols = min(block_k, kend - j0)
        if mod is not None and not mod_live(b, h, i0, rows, j0, cols, mod_args):
            continue
        kt = _rows_of(k, b, hk, j0, cols, lut, kj)
        vt = _rows_of(v, b, hk, j0, cols, lut, vj)
        s = s_buf[:rows * cols].reshape((rows, cols))  # contiguous, so np.dot can write it
        p = p_buf[:rows * cols].reshape((rows, cols))
        np.dot(qi, kt.T, s)
        _tile_probabilities(s, p, b, h, i0, j0, causal, causal_offset, c2, scale, m, l, alpha,
                            dropout, mod, mod_args)
        np.dot(p, vt, pv)
        # An inf or NaN in v makes its whole column of pv non-finite (0 * inf is NaN), so a finite
        # pv (rows x dv: cheaper to scan than the tile) clears the tile. Else redo it exactly: a
        # non-finite v reaches only the rows that see its key, never through a 0 weight.
        if not all_finite(pv):
            pv[:] = zero
            for r in range(rows):
                for c in range(cols):
                    if _takes_part(b, h, i0 + r, j0 + c, j0, cols, causal, causal_offset,
                                   dropout, mod_visible, mod_args):
                        for x in range(dv):
                            pv[r, x] += p[r, c] * vt[c, x]
        # Rescale and add in one pass: the multiply rides along with the add for free.
        for r in range(rows):
            a = alpha[r]
            for c in range(dv):
                acc[r, c] = acc[r, c] * a + pv[r, c]
    _write_rows(acc, m, l, out, lse, ob, h, i0)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def tiled_forward(q, k, v, out, lse, c2, causal, causal_offset, block_q, block_k, lut, scale,
                  dropout, mod, mod_visible, mod_live, mod_args, splits, task_first, task_step):
    """out[b, h] = softmax(scale q k^T [causal mask]) v; lse[b, h] = log of each row's denominator.

    q, k, v: (B, H, N, d) arrays of any strides (float32, float64, or float16 bits as uint16);
    out: (B, H, Nq, dv) in the compute dtype (float64 for float64 inputs, float32 otherwise).
    c2 = softmax_scale * log2(e) in the compute dtype: exp(scale * s) = exp2(c2 * s); with a
    modification (mod, mod_visible, mod_live, mod_args from numflash.mods; None, None, None, ()
    without) the
    scores are scaled and modified first and c2 = log2(e). ``dropout``: None, or the call's
    (seed_lo, seed_hi, threshold, factor) (dropout_arguments). ``splits`` > 1 (split-KV, for
    calls with fewer query blocks than threads): each query block's key blocks are dealt out in
    ``splits`` runs, run s writing its partial result (normalized over its keys) to out[s B + b]
    and lse[s B + b] (out, lse then have splits B entries; run() merges them). Runs tasks
    task_first, task_first + task_step, ... (0, 1: all of them; see run_tasks for the
    modification path's threads). Call with the BLAS single-threaded (see run()).
    """
    B, H, Nq, d = q.shape
    Nk = k.shape[2]
    group = H // k.shape[1]  # grouped-query attention: query head h reads key/value head h // group
    nqb = (Nq + block_q - 1) // block_q
    per_split = B * H * nqb
    # Causal tasks differ in size (a query block sees keys up to its diagonal): run() sets
    # numba's chunk size to 1 so tasks are handed out one at a time, and they go largest first,
    # so no thread is left with a long tail.
    for n in prange((per_split * splits - task_first + task_step - 1) // task_step):
        task = task_first + n * task_step
        s = task % splits   # innermost: a query block's runs go out together, largest first
        block = task // splits
        b = block // (H * nqb)
        h = (block // nqb) % H
        qb = block % nqb
        i0 = (nqb - 1 - qb if causal else qb) * block_q
        rows = min(block_q, Nq - i0)
        # Only keys some row of this block can see: later blocks are never loaded.
        kend = Nk
        if causal:
            kend = min(Nk, max(0, i0 + rows + causal_offset))
        kstart, kend = _key_run(kend, block_k, splits, s)
        _attend_block(q, k, v, out, lse, b, s * B + b, h, h // group, i0, rows, kstart, kend,
                      causal, causal_offset, block_k, c2, lut, scale, dropout, mod, mod_visible,
                      mod_live, mod_args)


@njit(fastmath=FASTMATH, cache=True)
def _scores_of_keys(qh, t0, t1, keys, hk, s, c):
    """s[t, c + i] = qh[t] . keys[i, hk] for the (at most 4) keys of ``keys`` (n, Hk, d) and rows
    t0..t1. Four keys at a time: four independent sums (one would wait on each add's latency)
    sharing each load of the query row. (Indexed by the loop's own x: an offset added to it in
    the inner loop ran 2-4x slower.)"""
    zero = s.dtype.type(0)
    if keys.shape[0] == 4:
        for t in range(t0, t1):
            a0 = a1 = a2 = a3 = zero
            for x in range(qh.shape[1]):
                qx = qh[t, x]
                a0 += qx * keys[0, hk, x]
                a1 += qx * keys[1, hk, x]
                a2 += qx * keys[2, hk, x]
                a3 += qx * keys[3, hk, x]
            s[t, c], s[t, c + 1], s[t, c + 2], s[t, c + 3] = a0, a1, a2, a3
        return
    for i in range(keys.shape[0]):
        for t in range(t0, t1):
            a0 = zero
            for x in range(qh.shape[1]):
                a0 += qh[t, x] * keys[i, hk, x]
            s[t, c + i] = a0


@njit(fastmath=FASTMATH, cache=True)
def _add_values_of_keys(p, t, c, values, hk, acc):
    """acc[t] += sum over the 4 keys i of values (4, Hk, dv) of p[t, c + i] values[i, hk]: one
    load and store of the accumulator row for four keys."""
    w0, w1, w2, w3 = p[t, c], p[t, c + 1], p[t, c + 2], p[t, c + 3]
    for x in range(acc.shape[1]):
        acc[t, x] += (w0 * values[0, hk, x] + w1 * values[1, hk, x] + w2 * values[2, hk, x] +
                      w3 * values[3, hk, x])


@njit(fastmath=FASTMATH, cache=True)
def _attend_heads(q, k_rows, v_rows, out, lse, b, ob, kstart, kend, causal, causal_offset,
                  block_k, c2, lut, scale, dropout, mod, mod_visible, mod_live, mod_args):
    """All rows and heads of out[ob] and lse[ob] from keys kstart:kend of batch entry b, four
    keys at a time: k_rows[b, 0, j] holds key j's rows of every key/value head next to each
    other (a KV cache's (B, N, Hk, d) layout, as (B, 1, N, Hk d)), so the keys are read in
    memory order, once, however many heads there are. Scores and P V are dot products and
    axpys on the rows (a decode has too few query rows for a matrix product to pay); masks,
    modifications, the online softmax and dropout are _attend_block's, a head's tile at a
    time."""
    H, rows, d = q.shape[1], q.shape[2], q.shape[3]
    Hk = k_rows.shape[3] // d
    dv = v_rows.shape[3] // Hk
    group = H // Hk
    dt = out.dtype
    # Row t = h rows + r of every per-row array is query row r of head h; K/V head hk's query
    # heads hold rows hk span .. (hk + 1) span (span = group rows).
    qh = np.empty((H * rows, d), dt)
    for h in range(H):
        _load_block(q, b, h, 0, rows, lut, qh[h * rows:(h + 1) * rows])
    key = np.empty((4, Hk * d), dt)
    value = np.empty((4, Hk * dv), dt)
    s_buf = np.empty(H * rows * block_k, dt)
    p_buf = np.empty(H * rows * block_k, dt)
    alpha = np.empty(H * rows, dt)
    m = np.full(H * rows, -np.inf, dt)
    l = np.zeros(H * rows, dt)
    acc = np.zeros((H * rows, dv), dt)
    live = np.ones(H * rows, np.bool_)   # by row: a block mask empties a head's tile
    span = group * rows

    for j0 in range(kstart, kend, block_k):
        cols = min(block_k, kend - j0)
        s = s_buf[:H * rows * cols].reshape((H * rows, cols))   # a head's tile: C-contiguous
        p = p_buf[:H * rows * cols].reshape((H * rows, cols))
        if mod is not None:
            for h in range(H):
                live[h * rows:(h + 1) * rows] = mod_live(b, h, 0, rows, j0, cols, mod_args)
        for c in range(0, cols, 4):   # (a dead head's scores are computed and never read)
            n = min(4, cols - c)
            keys = _rows_of(k_rows, b, 0, j0 + c, n, lut, key).reshape((n, Hk, d))
            for hk in range(Hk):
                _scores_of_keys(qh, hk * span, (hk + 1) * span, keys, hk, s, c)
        for h in range(H):
            t0 = h * rows
            if live[t0]:
                _tile_probabilities(s[t0:t0 + rows], p[t0:t0 + rows], b, h, 0, j0, causal,
                                    causal_offset, c2, scale, m[t0:t0 + rows], l[t0:t0 + rows],
                                    alpha[t0:t0 + rows], dropout, mod, mod_args)
                for t in range(t0, t0 + rows):
                    a = alpha[t]
                    for x in range(dv):
                        acc[t, x] *= a
        for c in range(0, cols, 4):
            n = min(4, cols - c)
            values = _rows_of(v_rows, b, 0, j0 + c, n, lut, value).reshape((n, Hk, dv))
            for hk in range(Hk):
                for t in range(hk * span, (hk + 1) * span):
                    if not live[t]:
                        continue
                    # (with one row a K/V head, four axpys streamed faster than the fused add)
                    if n == 4 and span > 1 and p[t, c] != 0 and p[t, c + 1] != 0 and \
                            p[t, c + 2] != 0 and p[t, c + 3] != 0:
                        _add_values_of_keys(p, t, c, values, hk, acc)
                        continue
                    for i in range(n):
                        w = p[t, c + i]
                        # a zero weight adds only where the pair takes part (0 * inf is NaN)
                        if w != 0 or _takes_part(b, t // rows, t % rows, j0 + c + i, j0, cols,
                                                 causal, causal_offset, dropout, mod_visible,
                                                 mod_args):
                            for x in range(dv):
                                acc[t, x] += w * values[i, hk, x]
    for h in range(H):
        t0 = h * rows
        _write_rows(acc[t0:t0 + rows], m[t0:t0 + rows], l[t0:t0 + rows], out, lse, ob, h, 0)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def keymajor_forward(q, k_rows, v_rows, out, lse, c2, causal, causal_offset, block_q, block_k,
                     lut, scale, dropout, mod, mod_visible, mod_live, mod_args, splits,
                     task_first, task_step):
    """tiled_forward for few query rows and K and V in a KV cache's layout: k_rows, v_rows are
    (B, N, Hk, d) C-contiguous arrays seen as (B, 1, N, Hk d) (_key_rows). A task is a batch
    entry's run of keys for all of its heads and query rows (_attend_heads), so each task reads
    one contiguous stretch of the cache. Arguments and the split results as tiled_forward's
    (block_q unused: one block of every row)."""
    B, Nq = q.shape[0], q.shape[2]
    Nk = k_rows.shape[2]
    for n in prange((B * splits - task_first + task_step - 1) // task_step):
        task = task_first + n * task_step
        s = task % splits
        b = task // splits
        kend = min(Nk, max(0, Nq + causal_offset)) if causal else Nk
        kstart, kend = _key_run(kend, block_k, splits, s)
        _attend_heads(q, k_rows, v_rows, out, lse, b, s * B + b, kstart, kend, causal,
                      causal_offset, block_k, c2, lut, scale, dropout, mod, mod_visible,
                      mod_live, mod_args)


def uncached(dispatcher, **rebind):
    """A copy of a njit function that is not cached on disk, with some global names rebound (to
    other copies). Kernels that take a modification get numba functions as arguments, and numba
    writes a new disk-cache entry for such a signature in every process and never reuses it: the
    modification path compiles these copies instead, once per process."""
    import types as pytypes
    py = dispatcher.py_func
    names = dict(py.__globals__)
    names.update(rebind)
    clone = pytypes.FunctionType(py.__code__, names, py.__name__, py.__defaults__, py.__closure__)
    options = {k: v for k, v in dispatcher.targetoptions.items()
               if k in ("fastmath", "boundscheck", "error_model")}
    # Not parallel: numba's parallel loops cannot take tuples or functions as arguments, which
    # is what a modification is. nogil instead: run_tasks spreads the tasks over Python threads.
    return njit(nogil=True, **options)(clone)


def run_tasks(kernel, args, total):
    """Run a kernel copy from uncached() on every core: thread t takes tasks t, t + T, ... (the
    kernels' last two arguments). It is compiled first, on no task, so that the threads only
    run it."""
    kernel(*args, total, 1)
    threads = max(1, min(numba.get_num_threads(), total))
    if threads == 1:
        kernel(*args, 0, 1)
        return
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(kernel, *args, t, threads) for t in range(threads)]:
            f.result()


_MOD_KERNELS = {}


def _forward_with_mods(order):
    """The kernel of a loop order (config's "order") for calls with a modification or dropout,
    and the pieces that take a modification's functions, as uncached copies."""
    if not _MOD_KERNELS:
        pieces = {"_tile_probabilities": uncached(_tile_probabilities),
                  "_takes_part": uncached(_takes_part)}
        _MOD_KERNELS[HEAD_MAJOR] = uncached(tiled_forward,
                                            _attend_block=uncached(_attend_block, **pieces))
        _MOD_KERNELS[KEY_MAJOR] = uncached(keymajor_forward,
                                           _attend_heads=uncached(_attend_heads, **pieces))
    return _MOD_KERNELS[order]


_HALF_TABLE = None


def half_table():
    """float32 value of every float16 bit pattern."""
    global _HALF_TABLE
    if _HALF_TABLE is None:
        _HALF_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    return _HALF_TABLE


class _SingleThreadedBlas:
    """Hold the BLAS behind numba's np.dot (scipy's) at one thread while kernels run.

    numba's prange already uses every core; a multi-threaded BLAS call inside each task starts
    more threads on the same cores, and on 2 cores that made the kernel 3-10x slower (NOTES.md).
    Nested uses (several Python threads) share one saved count, restored by the last to leave.
    If the BLAS cannot be found (not OpenBLAS), this does nothing.
    """
    _lock = threading.Lock()
    _depth = 0
    _saved = None
    _fns = None

    @classmethod
    def _find(cls):
        if cls._fns is None:
            cls._fns = ()
            try:
                import scipy.linalg.cython_blas as cython_blas
                lib = ctypes.CDLL(cython_blas.__file__)  # dlsym also searches its dependencies
                for prefix in ("scipy_openblas", "openblas"):
                    get = getattr(lib, prefix + "_get_num_threads", None)
                    put = getattr(lib, prefix + "_set_num_threads", None)
                    if get is not None and put is not None:
                        get.restype, put.argtypes = ctypes.c_int, [ctypes.c_int]
                        cls._fns = (get, put)
                        break
            except (ImportError, OSError):
                pass
        return cls._fns

    def __enter__(self):
        with self._lock:
            fns = self._find()
            if fns and type(self)._depth == 0:
                type(self)._saved = fns[0]()
                fns[1](1)
            type(self)._depth += 1

    def __exit__(self, *exc):
        with self._lock:
            type(self)._depth -= 1
            fns = self._find()
            if fns and type(self)._depth == 0:
                fns[1](self._saved)


def dropout_arguments(problem, compute):
    """The kernels' ``dropout`` argument of a problem: None (numba compiles the dropout away),
    or (seed_lo, seed_hi, threshold, factor)."""
    if problem.dropout is None:
        return None
    lo, hi, threshold, factor = problem.dropout.arguments()
    return np.uint64(lo), np.uint64(hi), np.uint64(threshold), compute(factor)


def config(problem, device):
    B, H, Nq, Nk, d, dv = problem.shape
    # Small problems: smaller query blocks, so every thread gets a few tasks.
    block_q = BLOCK_Q
    while block_q > MIN_BLOCK_Q and B * H * -(-Nq // block_q) < 4 * numba.get_num_threads():
        block_q //= 2
    # float64 tiles are twice the bytes: halve the key block to keep S and P in L2.
    block_k = BLOCK_K // 2 if problem.dtype == np.float64 else BLOCK_K
    key_blocks = -(-Nk // block_k)
    order = HEAD_MAJOR
    if Nq <= KEY_MAJOR_MAX_ROWS and _key_rows(problem.k) is not None and \
            _key_rows(problem.v) is not None:
        order, block_q = KEY_MAJOR, max(Nq, 1)   # a task takes every row and head
    forced = getattr(problem, "num_splits", None)
    tasks = B if order == KEY_MAJOR else B * H * -(-Nq // block_q)
    splits = max(1, min(forced, key_blocks)) if forced is not None else \
        split_count(tasks, key_blocks, numba.get_num_threads())
    return {"order": order, "block_q": block_q, "block_k": block_k, "splits": splits}


def _key_rows(x):
    """x, a (B, H, N, d) view, as its (B, N, H, d) array seen as (B, 1, N, H d) where that is
    C-contiguous and x is not (a KV cache in "bshd": a key's rows of all heads lie together;
    see keymajor_forward); else None."""
    rows = x.transpose(0, 2, 1, 3)
    if rows.flags.c_contiguous and not x.flags.c_contiguous:
        B, N, H, d = rows.shape
        return rows.reshape(B, 1, N, H * d)   # a run of keys is then one C-contiguous block
    return None


def split_count(tasks, key_blocks, threads):
    """Split-KV on the CPU: where the query blocks are fewer than the threads (decoding: one
    task a head, or a K/V head's rows, numflash.gqa), each one's key blocks in as many runs as
    give every thread two tasks, whole blocks each, at most one a block; else 1."""
    if tasks == 0 or tasks >= threads:   # (no query rows: nothing to split)
        return 1
    return max(1, min(key_blocks, -(-2 * threads // tasks)))


def run(problem, config, device=None):
    """Run the CPU kernel on a normalized NumPy problem; fills problem.out and returns lse."""
    p = problem
    compute = np.float64 if p.dtype == np.float64 else np.float32
    lut = half_table()
    q, k, v = p.q, p.k, p.v
    if p.dtype == np.float16:
        q, k, v = q.view(np.uint16), k.view(np.uint16), v.view(np.uint16)
    lse = p.empty_lse()
    B, H, Nq = p.q.shape[:3]
    splits = config.get("splits", 1)
    if splits > 1:   # each split's partial result, merged below
        out = np.empty((splits * B,) + tuple(p.out.shape[1:]), compute)
        part_lse = np.empty((splits * B,) + lse.shape[1:], lse.dtype)
    else:
        out = p.out if p.out.dtype == compute else np.empty(p.out.shape, compute)
        part_lse = lse
    order = config.get("order", HEAD_MAJOR)
    if order == KEY_MAJOR:
        k, v = _key_rows(k), _key_rows(v)
        kernel, tasks = keymajor_forward, B * splits
    else:
        kernel, tasks = tiled_forward, B * H * -(-Nq // config["block_q"]) * splits
    args = (q, k, v, out, part_lse, compute(p.scale * LOG2E), p.causal, p.causal_offset,
            config["block_q"], config["block_k"], lut, compute(p.scale),
            dropout_arguments(p, compute))
    no_mods = (None, None, None, ())
    chunk = numba.set_parallel_chunksize(1)  # returns the previous value
    try:
        with _SingleThreadedBlas(), compile_errors(p.mods):
            if p.mods is None and p.dropout is None:
                kernel(*args, *no_mods, splits, 0, 1)
            elif p.mods is None:  # numba's parallel loops take no tuple: run_tasks' threads
                run_tasks(_forward_with_mods(order), args + no_mods + (splits,), tasks)
            else:  # scores are scaled and modified in the kernel, then exp2(log2(e) x)
                apply_forward, _, visible, live, _ = p.mods.compiled()
                args = args[:5] + (compute(LOG2E),) + args[6:] + (apply_forward, visible, live,
                                                                  p.mods.args, splits)
                run_tasks(_forward_with_mods(order), args, tasks)
    finally:
        numba.set_parallel_chunksize(chunk)
    if splits > 1:
        from ..varlen import merge_partials
        merged, lse[...] = merge_partials([out[s * B:(s + 1) * B] for s in range(splits)],
                                          [part_lse[s * B:(s + 1) * B] for s in range(splits)])
        p.out[...] = merged
    elif out is not p.out:
        p.out[...] = out
    return lse
