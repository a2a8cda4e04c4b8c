"""cuda.mma: FlashAttention-2 on tensor cores, compute capability >= 8.0, generated as Python
source per compile-time config and compiled by numba: float16 / bfloat16 on m16n8k16; float64 on
float64 tensor cores (exact IEEE products); float32 on tf32 tensor cores as 3xTF32
(float32-level accuracy) or, with precision="tf32", one tf32 mma per product.

The generator is split by concern, so the backward and a Hopper kernel can be composed from the
same pieces:

    emit.py      the source buffer, constants, the prologue (indices, per-head views)
    mask.py      each row's key range, boundary/causal -inf on the fragments
    softmax.py   accumulators, the online softmax update, the epilogue (normalize, lse)
    staging.py   cp.async row copies, the double-buffered K/V tile loop, Q ready
    operands.py  operand kinds (16-bit pairs, tf32 / float64 words, 3xTF32 splits): staging into
                 words, fragment loads, products, P V, O stores
    forward.py   the forward kernel composed over those; make_kernel; the code identity
    tiles.py     MmaConfig, the tile tables, shared memory per config
    config.py    a problem -> its MmaConfig, or the reason it cannot run

Head dims are padded (zero-filled) up to the next of 32, 64, 96, 128, 256. A sliding window
(``window_size``) is a key range per row (mask.py): the key tiles outside every row's range of a
block are never loaded, so its cost grows as N x window, not N^2.
"""
import functools
import math

from ...mods import compile_errors
from . import dropout, mods
from .config import F64_MAX_HEAD_DIM, TF32_MAX_HEAD_DIM, config, split_count, vector_ok
from .forward import kernel_source, make_kernel
from .tiles import HEAD_DIMS, NAME, X3_CCS, MmaConfig, choose_tile, head_dim_pad, shared_bytes

__all__ = ["NAME", "HEAD_DIMS", "X3_CCS", "MmaConfig", "head_dim_pad", "choose_tile",
           "shared_bytes", "config", "vector_ok", "TF32_MAX_HEAD_DIM", "F64_MAX_HEAD_DIM",
           "kernel_source", "make_kernel", "signature", "compiled_kernels", "split_count",
           "notes", "run"]

_dummy = {}


def no_debug_dump(device_id):
    """The placeholder passed as the kernels' ``dbg`` argument (cuda.mma's ABI, which cuda.wgmma
    shares) when nothing is dumped: one float32, made once per device."""
    if device_id not in _dummy:
        import cupy
        from .. import fastpath
        _dummy[device_id] = fastpath.keep(cupy.zeros((1, 1, 1, 1), dtype=cupy.float32))
    return _dummy[device_id]


def _as_bits(a):
    import cupy
    return a.view(cupy.uint16)


@functools.lru_cache(maxsize=256)   # numba types are made anew otherwise: ~0.1 ms a call
def signature(dtype, window=False, token="", split=False, kvlen=False, paged=False,
              varlen=False, drop=False):
    """The kernel's argument types: q, k, v, out (16-bit inputs as their bits), lse, a float32
    debug array, the exp2 and natural scales, causal, causal_offset (and with a window its left
    and right sizes, a KV cache's lengths and block table, packed sequences' cu_q and cu_k,
    with modifications their arguments: mods.argument_types, with dropout its four:
    dropout.argument_types). Split-KV: out and lse are the
    (splits, B, H, Nq, .) partials (cuda.merge's precision)."""
    from numba import types
    from ...inputs import lse_dtype
    from ..launch import array_type
    # 16-bit inputs as their bits (by name: np.dtype("bfloat16") needs ml_dtypes)
    arr = array_type("uint16" if str(dtype) in ("float16", "bfloat16") else dtype)
    out, lse = arr, array_type(lse_dtype(dtype), 3)
    if split:
        part = lse_dtype(dtype)
        out, lse = array_type(part, 5), array_type(part, 4)
    cache = (array_type("int32", 1),) if kvlen else ()
    cache += (array_type("int32", 2),) if paged else ()
    cache += (array_type("int32", 1),) * 2 if varlen else ()
    return (arr, arr, arr, out, lse, array_type("float32"),
            types.float64, types.float64, types.int64, types.int64) + \
        ((types.int64, types.int64) if window else ()) + cache + mods.argument_types(token) + \
        dropout.argument_types(drop)


def compiled_kernels(cfg, dtype):
    """What run() launches for this config and input dtype: [(Kernel, numba argument types)],
    for `numflash.precompile` and `explain`'s cache status."""
    from .. import launch, merge
    kernels = [(launch.get_kernel(NAME, make_kernel, cfg),
                signature(dtype, cfg.WINDOW, cfg.MODS, bool(cfg.SPLIT), bool(cfg.KVLEN),
                          bool(cfg.PAGE), bool(cfg.VARLEN), bool(cfg.DROP)))]
    return kernels + ([merge.kernel(str(dtype))] if cfg.SPLIT else [])


def notes(problem, cfg, device):
    """What explain adds about this config's schedule: packed sequences, the KV cache, the
    split-KV choice."""
    n = split_count(problem, cfg, device)
    lines = []
    if cfg.VARLEN:
        lines.append(packed_note(problem, cfg.BR))
    if cfg.KVLEN:
        lines.append("KV cache: each batch entry's keys counted by kv_lens, causal aligned "
                     "bottom-right per entry" + (f"; rows read in place through the block "
                                                 f"table, {cfg.PAGE} a page" if cfg.PAGE else ""))
    if not cfg.SPLIT:
        return lines
    B, H, Nq = problem.shape[:3]
    blocks = -(-Nq // cfg.BR) * B * H
    why = ("num_splits was given" if getattr(problem, "num_splits", None) is not None else
           f"{blocks} query blocks for {device.sm_count} SMs")
    if cfg.KVLEN:
        why += "; planned for the cache's capacity, the shares counted from the longest entry"
    if mods.sparse(cfg.MODS):   # (more shares than a block row lists leave some empty)
        why += "; with the block mask each share takes a run of the listed blocks"
    return lines + [f"split-KV: each query block's keys in {n} shares ({why}); the partial "
                    f"results are merged by cuda.merge (one more launch, "
                    f"{'float64' if cfg.DT == 'f64' else 'float32'} partials: "
                    f"{n} x B x H x Nq x dv)"]


def packed_note(problem, BR):
    """explain's line about packed sequences (MmaConfig.VARLEN) for a forward whose blocks own
    BR query rows."""
    packed = problem.varlen
    return packed.note(problem.causal, f"{-(-packed.max_q // BR)} blocks of {BR} query rows "
                                       f"for the longest ({packed.max_q} rows)")


def run(problem, cfg, device, debug=None):
    """Launch; returns lse. ``debug``: a float32 (B, H, Nq, BC) CuPy array to receive the masked
    raw scores of key tile 0 (only with cfg.DBG = 1)."""
    import cupy
    from .. import fastpath
    p = problem
    B, H, Nq, Nk, d, dv = p.shape
    kernel = compiled_kernels(cfg, p.dtype_name)[0][0]
    lse = p.empty_lse()
    if debug is None:
        debug = no_debug_dump(p.q.device.id)
    grid = (-(-Nq // cfg.BR), B * H)
    causal_offset = int(p.causal_offset)
    packed = ()
    if cfg.VARLEN:
        grid = p.varlen.grid(cfg.BR, H)
        causal_offset, packed = p.varlen.arguments()
    # 16-bit kernels take the bits; tf32, 3xTF32 and float64 read their inputs as they are
    bits = _as_bits if cfg.DT in ("f16", "bf16") else (lambda a: a)
    window = tuple(int(w) for w in p.mods.window) if cfg.WINDOW else ()
    cache = ()
    if cfg.KVLEN:
        cache = (p.kvcache.lens,) + ((p.kvcache.block_table,) if cfg.PAGE else ())
    out, out_lse = bits(p.out), lse
    if cfg.SPLIT:   # the shares' partials, merged below
        n = split_count(p, cfg, device)
        grid += (n,)
        out = fastpath.note_scratch(cupy.empty((n, B, H, Nq, dv), lse.dtype))
        out_lse = fastpath.note_scratch(cupy.empty((n, B, H, Nq), lse.dtype))
    with compile_errors(p.mods, NAME):
        kernel(grid, (cfg.NT,), shared_bytes(cfg),
               (bits(p.q), bits(p.k), bits(p.v), out, out_lse, debug,
                float(p.scale * math.log2(math.e)), float(p.scale), int(p.causal),
                causal_offset) + window + cache + packed +
               (mods.arguments(p.mods) if cfg.MODS else ()) + dropout.arguments(p), device)
    if cfg.SPLIT:
        from .. import merge
        merge.run(out, out_lse, bits(p.out), lse, p.dtype_name, device)
    return lse
