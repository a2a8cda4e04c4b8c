"""cuda.mma's backward operator: the config for a problem (or why not), the compiled kernels and
the launch of backward.py's two passes.

The query pass writes dQ and delta = rowsum(dO * O) (B x H x Nq float32, the only extra device
memory), the key pass dK and dV, each in the inputs' dtype, with no atomics and no float32
gradient buffers (two runs are bitwise equal).
"""
import dataclasses
import math

import numpy as np

from ...device import Unsupported
from ...mods import compile_errors
from .backward import make_key_kernel, make_query_kernel, shared_bytes
from . import mods
from .config import check_block_tiles, modifications, padded_dims, vector_ok
from .tiles import NAME, MmaConfig

#: the largest padded head dim of the backward: the key pass keeps dK and dV fragments (D / 2 +
#: DV / 2 float32 per thread) and the tile's S and dP in registers; at 256 that is past the 255
#: a thread may hold.
MAX_HEAD_DIM = 128

#: (NW, BC, SUB) of the query pass and of the key pass by largest padded head dim, fastest
#: first, then one for less shared memory (sm_86 / 89 / 12x give a block 99 KB). BC: the
#: streamed tile's rows (keys in the query pass, queries in the key pass); SUB: the key pass
#: takes its tile SUB queries at a time (S^T, dP^T of SUB columns in registers with dK, dV).
#: Timed on the H100 (bench/backward_tiles.py, B4 H16 N4096 float16, bench/NOTES.md): key pass
#: d64 (4, 128, 64) 2.50 ms against (4, 64) 3.02; d128 (8, 64, 16) 6.00 ms against (4, 16)
#: 8.52; query pass (4, 64) within 2% of (8, 64), ahead of (4, 32). ptxas fits each in 255
#: registers with no spill on sm_80 and sm_90 (the compile tests check it).
TILES = {64: {"queries": [(4, 64, 0)], "keys": [(4, 128, 64), (4, 64, 0)]},
         128: {"queries": [(4, 64, 0), (4, 32, 0)], "keys": [(8, 64, 16), (4, 32, 16)]}}
#: With a sliding window the key pass keeps a few more integers live: at d128 (8, 64, 16)
#: spills 12 bytes on sm_90 (ptxas, session 11), (8, 32, 16) none.
WINDOW_TILES = {128: {"keys": [(8, 32, 16), (4, 32, 16)]}}
#: With score modifications (their arguments and each score's indices live too; compile sweep
#: with every built-in, ptxas session 12): the d64 key pass takes its 128 staged queries 32 at
#: a time (64 at a time spills 144 bytes on sm_90), the d128 query pass a tile of 32 keys
#: (spill-free), the d128 key pass (4, 32, 16), the least-spilling tile found (208 bytes on
#: sm_90; (8, 64, 16) spills 296): dK and dV alone take 128 registers a thread there.
MODS_TILES = {64: {"keys": [(4, 128, 32), (4, 64, 32)]},
              128: {"queries": [(4, 32, 0)], "keys": [(4, 32, 16)]}}


def _kind(dtype_name):
    return {"float16": "f16", "bfloat16": "bf16"}[dtype_name]


def tiles(D, DV, smem_limit=None, window=False, mods=False):
    """{"queries": MmaConfig, "keys": MmaConfig} for padded head dims (``window``: the WINDOW
    variants; ``mods``: with score modifications): per pass the first tile of TILES (or
    WINDOW_TILES, MODS_TILES) whose shared memory fits ``smem_limit`` (else the last, which
    config() refuses)."""
    chosen = {}
    size = 64 if max(D, DV) <= 64 else 128
    for kernel, candidates in TILES[size].items():
        if window:
            candidates = WINDOW_TILES.get(size, {}).get(kernel, candidates)
        if mods:
            candidates = MODS_TILES.get(size, {}).get(kernel, candidates)
        for NW, BC, SUB in candidates:
            cfg = MmaConfig(D, DV, NW, BC, 0, "f16", 1, SUB=SUB, WINDOW=int(window))
            if smem_limit is None or shared_bytes(cfg, kernel) <= smem_limit:
                break
        chosen[kernel] = cfg
    return chosen


def config(problem, device):
    """{"queries": MmaConfig, "keys": MmaConfig} for a backward problem; raises Unsupported
    saying why not (the operator's declarations were checked before)."""
    DT = _kind(problem.dtype_name)
    B, H, Nq, Nk, d, dv = problem.shape
    D, DV, window = padded_dims(problem)
    if max(D, DV) > MAX_HEAD_DIM:
        raise Unsupported(f"{NAME}'s backward takes head dims up to {MAX_HEAD_DIM} (d={d}, "
                          f"dv={dv}): the key pass keeps dK and dV in registers; cuda.row's "
                          "backward takes any head dim")
    # explain(..., backward=True) plans before there are dO and O: checked when they are given
    staged = ("q", "k", "v") + tuple(n for n in ("do", "o")
                                     if getattr(problem, n, None) is not None)
    why = vector_ok(problem, staged) if problem.on_device else "these are not device arrays"
    if why:
        raise Unsupported(f"{NAME}'s backward stages q, k, v, dO and O with 16-byte cp.async, "
                          f"and {why} (a contiguous last axis, head dims that are multiples of 8 "
                          "and 16-byte aligned rows take it; cuda.row's backward takes any "
                          "layout)")
    token = modifications(problem)
    cfg = {kernel: dataclasses.replace(c, DT=DT, MODS=token)
           for kernel, c in tiles(D, DV, device.smem_per_block_optin, window,
                                  bool(token)).items()}
    check_block_tiles(problem, ((cfg["queries"].BR, cfg["queries"].BC, "backward's query pass"),
                                (cfg["keys"].BC, cfg["keys"].BR, "backward's key pass")))
    for kernel, c in cfg.items():
        need = shared_bytes(c, kernel)
        if need > device.smem_per_block_optin:
            raise Unsupported(f"{NAME}'s backward {kernel} pass needs {need} bytes of shared "
                              f"memory for d={d}, dv={dv}, more than the "
                              f"{device.smem_per_block_optin} a block may use on {device.name}")
    return cfg


def signature(dtype, kernel, window=False, token=""):
    """Argument types of the "queries" or "keys" kernel: q, k, v, dO (and O for the query pass)
    as their 16-bit bits, lse and delta (float32), dQ or dK, dV (like q), the exp2 and natural
    scales, causal, causal_offset (and with a window its left and right sizes, with
    modifications their arguments: mods.argument_types)."""
    from numba import types
    from ...inputs import lse_dtype
    from ..launch import array_type
    arr = array_type("uint16")
    rows = array_type(lse_dtype(dtype), 3)
    inputs = (arr,) * (5 if kernel == "queries" else 4)
    grads = (arr,) if kernel == "queries" else (arr, arr)
    return (*inputs, rows, rows, *grads, types.float64, types.float64, types.int64,
            types.int64) + ((types.int64, types.int64) if window else ()) + \
        mods.argument_types(token)


def compiled_kernels(cfg, dtype):
    """[(Kernel, numba argument types)] run() launches: the query pass, then the key pass."""
    from .. import launch
    return [(launch.get_kernel(NAME + ".backward_queries", make_query_kernel, cfg["queries"]),
             signature(dtype, "queries", cfg["queries"].WINDOW, cfg["queries"].MODS)),
            (launch.get_kernel(NAME + ".backward_keys", make_key_kernel, cfg["keys"]),
             signature(dtype, "keys", cfg["keys"].WINDOW, cfg["keys"].MODS))]


def run(problem, cfg, device):
    """Fill problem.dq, dk, dv for a normalized CuPy problem."""
    import cupy
    p = problem
    B, H, Nq, Nk, d, dv = p.shape
    bits = (lambda a: a.view(cupy.uint16))
    with cupy.cuda.Device(p.q.device.id):     # on the arrays' GPU, not the current one
        delta = cupy.empty((B, H, Nq), np.float32)   # rowsum(dO * O): the query pass writes it
    lse = p.lse
    scalars = (float(p.scale * math.log2(math.e)), float(p.scale), int(p.causal),
               int(p.causal_offset))
    if cfg["queries"].WINDOW:
        scalars += tuple(int(w) for w in p.mods.window)
    if cfg["queries"].MODS:
        scalars += mods.arguments(p.mods)
    (queries, _), (keys, _) = compiled_kernels(cfg, p.dtype_name)
    inputs = tuple(bits(a) for a in (p.q, p.k, p.v, p.do))
    qc, kc = cfg["queries"], cfg["keys"]
    with compile_errors(p.mods, NAME):
        queries((-(-Nq // qc.BR), B * H), (qc.NT,), shared_bytes(qc, "queries"),
                inputs + (bits(p.o), lse, delta, bits(p.dq)) + scalars, device)
        keys((-(-Nk // kc.BR), B * p.k.shape[1]), (kc.NT,), shared_bytes(kc, "keys"),
             inputs + (lse, delta, bits(p.dk), bits(p.dv)) + scalars, device)
