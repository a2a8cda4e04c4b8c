"""cuda.merge: combine split-KV partial results into the output, on the GPU.

A split-KV forward (cuda.mma with MmaConfig.SPLIT) leaves, per share s of the keys, each row's
attention over those keys normalized, O_s, and its lse_s, in float32 (float64 for float64
inputs). Over all keys:

    lse = log sum_s exp(lse_s),    O = sum_s exp(lse_s - lse) O_s

computed with the largest lse_s subtracted first (no overflow). A share that saw no key of a
row (lse_s = -inf) weighs 0; a row no share saw gets zeros and lse = -inf; a NaN lse_s (a NaN
score in that share) makes the row's O and lse NaN, as the unsplit kernel would. This is the
rule of :func:`numflash.merge_partials`, applied in one launch: a thread per output element,
which reads its row's lse_s from cache and writes the output in its dtype (16-bit outputs as
their bits). merge_partials runs this kernel for CuPy arrays (:func:`merge_arrays`); its NumPy
form is the independent host implementation the tests check this kernel against.
"""
import functools

import numpy as np

NAME = "cuda.merge"

_SOURCE = """
def merge_splits(part, part_lse, out, lse):
    n_split = part.shape[0]
    B = part.shape[1]
    H = part.shape[2]
    Nq = part.shape[3]
    dv = part.shape[4]
    idx = I(cuda.blockIdx.x) * I(cuda.blockDim.x) + I(cuda.threadIdx.x)
    if idx >= B * H * Nq * dv:
        return
    c = idx % dv
    row = idx // dv
    i = row % Nq
    h = (row // Nq) % H
    b = row // (Nq * H)
    top = NEG_INF
    poisoned = False
    for sp in range(n_split):
        x = part_lse[sp, b, h, i]
        if x != x:
            poisoned = True
        elif x > top:
            top = x
    if poisoned:
        value = NAN
        row_lse = NAN
    elif top == NEG_INF:
        value = ZERO
        row_lse = NEG_INF
    else:
        weights = ZERO
        acc = ZERO
        for sp in range(n_split):
            w = math.exp(part_lse[sp, b, h, i] - top)
            weights += w
            acc += w * part[sp, b, h, i, c]
        value = acc / weights
        row_lse = top + math.log(weights)
    out[b, h, i, c] = {store}
    if c == 0:
        lse[b, h, i] = row_lse
"""

#: how a value (float32 or float64) is written into an output of each kind, 16-bit ones as their
#: bits rounded to nearest even (cuda.dq_round's kernel writes dQ so too)
STORE = {"f16": "uint16(U(pack_f16x2(value, ZERO)) & U(0xFFFF))",
          "bf16": "uint16(U(pack_bf16x2(value, ZERO)) & U(0xFFFF))",
          "f32": "value", "f64": "value"}

#: the output kind of an input dtype name, and the partials' precision
OUT_KIND = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}


def kernel_source(OUT):
    """Python source of the merge kernel writing outputs of kind ``OUT`` (f16, bf16, f32,
    f64)."""
    return _SOURCE.format(store=STORE[OUT])


def make_kernel(OUT):
    """The merge kernel function for one output kind (numba compiles it; see launch.py)."""
    import math
    from numba import cuda, int64, uint16, uint64
    from . import ptx
    real = np.float64 if OUT == "f64" else np.float32
    ns = {"cuda": cuda, "math": math, "I": int64, "U": uint64, "uint16": uint16,
          "ZERO": real(0), "NEG_INF": real(-np.inf), "NAN": real(np.nan),
          "pack_f16x2": ptx.pack_f16x2, "pack_bf16x2": ptx.pack_bf16x2}
    exec(compile(kernel_source(OUT), f"<{NAME} {OUT}>", "exec"), ns)  # noqa: S102
    return ns["merge_splits"]


@functools.lru_cache(maxsize=16)
def signature(dtype_name):
    """The merge kernel's argument types: partial O (5-D) and lse (4-D) in the lse's dtype
    (numflash.inputs.lse_dtype), the output (16-bit as its bits) and lse."""
    from ..inputs import lse_dtype
    from .launch import array_type
    part = lse_dtype(dtype_name)
    out = "uint16" if dtype_name in ("float16", "bfloat16") else dtype_name
    return (array_type(part, 5), array_type(part, 4), array_type(out), array_type(part, 3))


def kernel(dtype_name):
    """(Kernel, argument types) of the merge for outputs of ``dtype_name``."""
    from . import launch
    return (launch.get_kernel(NAME, make_kernel, {"OUT": OUT_KIND[dtype_name]}),
            signature(dtype_name))


THREADS = 256


def merge_arrays(outs, lses, device):
    """:func:`numflash.merge_partials` on CuPy arrays (checked there): outs (..., Nq, dv) of one
    dtype, lses (..., Nq); returns new (out, lse). The parts are stacked in the lse's dtype,
    with the leading axes folded into one (the kernel is elementwise over rows), then merged in
    one launch."""
    import cupy
    from ..inputs import lse_dtype
    dtype = np.dtype(outs[0].dtype)
    shape, work = tuple(outs[0].shape), lse_dtype(dtype)
    rows, dv = int(np.prod(shape[:-2], dtype=np.int64)), shape[-1]
    nq = shape[-2]
    part = cupy.stack([cupy.asarray(o, dtype=work) for o in outs]).reshape(
        len(outs), 1, rows, nq, dv)
    part_lse = cupy.stack([cupy.asarray(s, dtype=work) for s in lses]).reshape(
        len(lses), 1, rows, nq)
    out = cupy.empty((1, rows, nq, dv), dtype)
    lse = cupy.empty((1, rows, nq), work)
    sixteen = dtype.name in ("float16", "bfloat16")
    run(part, part_lse, out.view(cupy.uint16) if sixteen else out, lse, dtype.name, device)
    return out.reshape(shape), lse.reshape(shape[:-1])


def run(part, part_lse, out, lse, dtype_name, device):
    """Merge ``part`` (splits, B, H, Nq, dv) and ``part_lse`` (splits, B, H, Nq) into ``out``
    (B, H, Nq, dv; 16-bit outputs passed as their uint16 bits) and ``lse`` (B, H, Nq)."""
    fn, _ = kernel(dtype_name)
    n = int(np.prod(out.shape))
    if n:
        fn(((n + THREADS - 1) // THREADS,), (THREADS,), 0, (part, part_lse, out, lse), device)
