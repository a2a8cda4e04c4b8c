"""cuda.dq_round: dQ's float32 accumulator rounded into the gradient, on the GPU.

A backward whose key pass adds dQ into a float32 accumulator (cuda.mma's and cuda.wgmma's DQADD
key passes, sm_90) leaves it as (B, H, Nq, D) at the padded head dim D. This kernel writes its
first d columns into dq, of any strides, in dq's dtype (16-bit as bits rounded to nearest even,
as cuda.merge writes outputs and the query pass writes dQ; float32 gradients copied): one
thread for four accumulator words, read in one 16-byte load. It is a numflash launch rather
than a CuPy copy so that a repeated backward replays it with the rest (numflash.cuda.fastpath),
and it moves only the bytes it must (the H200 ran CuPy's strided copy at about a quarter of
its bandwidth: bench/NOTES.md, "The backward's host time").
"""
import functools

import numpy as np

from .merge import OUT_KIND, STORE

NAME = "cuda.dq_round"

_SOURCE = """
def round_dq(acc, D, out):
    H = U(out.shape[1])
    Nq = U(out.shape[2])
    d = U(out.shape[3])
    quads = U(D) // U(4)
    idx = U(cuda.blockIdx.x) * U(cuda.blockDim.x) + U(cuda.threadIdx.x)
    row = U(div_u32(idx, quads))   # 32-bit divisions: run() keeps every index below 2**32
    if row >= U(out.shape[0]) * H * Nq:
        return
    c = (idx - row * quads) * U(4)
    if c >= d:
        return
    bh = U(div_u32(row, Nq))
    i = row - bh * Nq
    b = U(div_u32(bh, H))
    h = bh - b * H
    words = vector_load(acc, idx * U(4), 4)
    for w in range(4):
        if c + U(w) < d:
            value = words[w]
            out[b, h, i, c + U(w)] = {store}
"""


def kernel_source(OUT):
    """Python source of the kernel writing dQ of kind ``OUT`` (f16, bf16, f32)."""
    return _SOURCE.format(store=STORE[OUT])


def make_kernel(OUT):
    """The kernel function for one gradient kind (numba compiles it; see launch.py)."""
    from numba import cuda, uint16, uint64
    from . import ptx
    from .common import vector_load
    from .ptx_wgmma import div_u32
    ns = {"cuda": cuda, "U": uint64, "uint16": uint16, "ZERO": np.float32(0),
          "vector_load": vector_load, "div_u32": div_u32, "pack_f16x2": ptx.pack_f16x2,
          "pack_bf16x2": ptx.pack_bf16x2}
    exec(compile(kernel_source(OUT), f"<{NAME} {OUT}>", "exec"), ns)  # noqa: S102
    return ns["round_dq"]


@functools.lru_cache(maxsize=8)
def signature(grad_dtype_name):
    """The kernel's argument types: the accumulator (flat float32), D, dq (16-bit as bits)."""
    from numba import types
    from .launch import array_type
    out = "uint16" if grad_dtype_name in ("float16", "bfloat16") else grad_dtype_name
    return (array_type("float32", 1), types.int64, array_type(out))


def kernel(grad_dtype_name):
    """(Kernel, argument types) writing dQ of ``grad_dtype_name``."""
    from . import launch
    return (launch.get_kernel(NAME, make_kernel, {"OUT": OUT_KIND[grad_dtype_name]}),
            signature(grad_dtype_name))


THREADS = 256


def fits(rows, D):
    """Whether an accumulator of ``rows`` rows (B x H x Nq) at padded head dim ``D`` is within
    the kernel's 32-bit indices (fewer than 2**34 words: 64 GiB; the planners send a larger one
    to the two passes, which need no accumulator)."""
    return rows * D // 4 + THREADS < 2 ** 32


def run(acc, dq_bits, grad_dtype_name, device):
    """dq[...] = acc[..., :d] rounded to ``grad_dtype_name``: ``acc`` a C-contiguous float32
    (B, H, Nq, D) CuPy array (D a multiple of 4; CuPy's allocations are 16-byte aligned),
    ``dq_bits`` the (B, H, Nq, d) gradient, d <= D, 16-bit ones as their uint16 bits."""
    assert acc.flags.c_contiguous and acc.shape[3] % 4 == 0 and acc.data.ptr % 16 == 0
    fn, _ = kernel(grad_dtype_name)
    threads = acc.size // 4
    assert fits(acc.size // acc.shape[3], acc.shape[3]), "planned with dq_round.fits"
    if threads:
        fn(((threads + THREADS - 1) // THREADS,), (THREADS,), 0,
           (acc.reshape(-1), int(acc.shape[3]), dq_bits), device)
