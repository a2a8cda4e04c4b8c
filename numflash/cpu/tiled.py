"""The CPU path: the block-tiled online-softmax loop, compiled with numba.njit.

Each (batch, head, query block) is one parallel task. Key/value blocks stream past it: S = Q K^T
for the block (BLAS through np.dot), the running row max m and row sum l are updated, the
accumulator is rescaled by exp(m_old - m_new) and P V is added. Nothing of size Nq x Nk exists.
float16 inputs are read as their bit patterns and decoded through a 65536-entry table, tile by tile.
"""
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

NAME = "cpu.tiled"
BLOCK_Q = 128
BLOCK_K = 256


def _decode(x, lut):
    """Element value as the compute dtype (float16 arrive as uint16 bit patterns)."""


@overload(_decode, inline="always")
def _decode_impl(x, lut):
    if isinstance(x, types.Integer):
        return lambda x, lut: lut[x]
    return lambda x, lut: x


@njit(cache=True)
def _load_block(src, b, h, r0, rows, scale, lut, dst):
    """dst[:rows] = src[b, h, r0:r0+rows, :] * scale, converted to dst's dtype (any strides)."""
    for r in range(rows):
        for c in range(src.shape[3]):
            dst[r, c] = _decode(src[b, h, r0 + r, c], lut) * scale


# No 'nnan'/'ninf': fully masked rows rely on -inf comparisons that those flags would delete.
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def tiled_forward(q, k, v, out, lse, scale, causal, causal_offset, block_q, block_k, lut):
    """out[b, h] = softmax(scale q k^T [causal mask]) v; lse[b, h] = log of each row's denominator.

    q, k, v: (B, H, N, d) arrays of any strides (float32, float64, or float16 bits as uint16);
    out: (B, H, Nq, dv) in the compute dtype (float64 for float64 inputs, float32 otherwise).
    """
    B, H, Nq, d = q.shape
    Nk = k.shape[2]
    dv = v.shape[3]
    nqb = (Nq + block_q - 1) // block_q
    for task in prange(B * H * nqb):
        b = task // (H * nqb)
        h = (task // nqb) % H
        i0 = (task % nqb) * block_q
        rows = min(block_q, Nq - i0)
        # Only keys some row of this block can see: later blocks are never loaded.
        kend = Nk
        if causal:
            kend = min(Nk, max(0, i0 + rows + causal_offset))

        qi = np.empty((rows, d), out.dtype)
        _load_block(q, b, h, i0, rows, scale, lut, qi)
        kj = np.empty((block_k, d), out.dtype)
        vj = np.empty((block_k, dv), out.dtype)
        m = np.full(rows, -np.inf, out.dtype)
        l = np.zeros(rows, out.dtype)
        acc = np.zeros((rows, dv), out.dtype)

        for j0 in range(0, kend, block_k):
            cols = min(block_k, kend - j0)
            _load_block(k, b, h, j0, cols, 1.0, lut, kj)
            _load_block(v, b, h, j0, cols, 1.0, lut, vj)
            s = np.dot(qi, kj[:cols].T)
            diagonal = causal and j0 + cols - 1 > i0 + causal_offset
            for r in range(rows):
                if diagonal:
                    last = i0 + r + causal_offset - j0  # last visible column of this row
                    for c in range(max(0, last + 1), cols):
                        s[r, c] = -np.inf
                m_new = m[r]
                for c in range(cols):
                    m_new = max(m_new, s[r, c])
                if m_new == -np.inf:
                    for c in range(cols):
                        s[r, c] = 0.0
                    continue
                alpha = np.exp(m[r] - m_new)
                row_sum = 0.0
                for c in range(cols):
                    p = np.exp(s[r, c] - m_new)
                    s[r, c] = p
                    row_sum += p
                l[r] = l[r] * alpha + row_sum
                m[r] = m_new
                for c in range(dv):
                    acc[r, c] *= alpha
            acc += np.dot(s, vj[:cols])

        for r in range(rows):
            if l[r] > 0:
                inv = 1.0 / l[r]
                for c in range(dv):
                    out[b, h, i0 + r, c] = acc[r, c] * inv
                lse[b, h, i0 + r] = np.log(l[r]) + m[r]
            else:
                for c in range(dv):
                    out[b, h, i0 + r, c] = 0.0
                lse[b, h, i0 + r] = -np.inf


_HALF_TABLE = None


def half_table():
    """float32 value of every float16 bit pattern."""
    global _HALF_TABLE
    if _HALF_TABLE is None:
        _HALF_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    return _HALF_TABLE


def config(problem, device):
    return {"block_q": BLOCK_Q, "block_k": BLOCK_K}


def run(problem, config, device=None):
    """Run the CPU kernel on a normalized NumPy problem; fills problem.out and returns lse."""
    p = problem
    compute = np.float64 if p.dtype == np.float64 else np.float32
    lut = half_table()
    q, k, v = p.q, p.k, p.v
    if p.dtype == np.float16:
        q, k, v = q.view(np.uint16), k.view(np.uint16), v.view(np.uint16)
    out = p.out if p.out.dtype == compute else np.empty(p.out.shape, compute)
    lse = p.empty_lse()
    tiled_forward(q, k, v, out, lse, compute(p.scale), p.causal, p.causal_offset,
                  config["block_q"], config["block_k"], lut)
    if out is not p.out:
        p.out[...] = out
    return lse
