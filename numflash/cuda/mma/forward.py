"""The FlashAttention-2 forward on tensor cores, composed once over the operand kinds.

A block of NW warps owns BR = 16 NW query rows; each warp owns 16 of them. K and V tiles of BC
keys are staged in shared memory; per tile each warp computes its 16 x BC block of S = Q K^T on
the tensor cores (float32 accumulators; float64 for float64), masks the boundary tiles, runs the
online softmax on the accumulator fragments in registers, and feeds P straight back as the A
operand of P V, accumulating O in registers. O is normalized once at the end; lse is written.
Tiles no row of the block can see are never loaded, and warps skip tiles none of their rows see.
A row that sees no key gives zeros and lse = -inf.

Split-KV (MmaConfig.SPLIT, for calls with too few query blocks to fill the GPU: decoding): the
blocks of grid z take equal runs of each query block's key tiles (with a block mask: of the
blocks its block row lists, whole blocks each) and write partial results, which
numflash.cuda.merge combines.
"""
import hashlib
import math

import numpy as np

from .emit import (VARLEN_ARGUMENTS, Source, define, emit_views_at_use, emit_prologue,
                   head_view, row_value)
from . import dropout, mods
from .mask import emit_debug_dump, emit_row_bounds, emit_score_mask, warp_sees_tile
from .operands import operands_for
from .softmax import emit_accumulators, emit_epilogue, emit_online_update
from .staging import emit_q_ready, emit_split_range, tile_loop
from .tiles import MmaConfig

ARGUMENTS = "q, k, v, out, lse, dbg, scale_log2_in, scale_in, causal, causal_offset"
WINDOW_ARGUMENTS = ", window_left, window_right"  # -1 = unbounded (numflash.mods.window_key_range)
#: a KV cache's (KVLEN) per-entry key counts, and (PAGE) the pages of each entry's rows
KVCACHE_ARGUMENTS = {False: ", kv_lens", True: ", kv_lens, block_table"}


def kernel_source(cfg):
    """Python source of the forward kernel for one MmaConfig (``print`` it to read it)."""
    assert not (cfg.DBG and cfg.VARLEN), "the debug dump indexes unpacked rows"
    ops = operands_for(cfg)
    L = ops.lay
    NKK, NN, NVN, NPK = cfg.D // ops.k_step, cfg.BC // 8, cfg.DV // 8, cfg.BC // ops.k_step

    window = bool(cfg.WINDOW)
    s = Source()
    s(f"def mma_attention({ARGUMENTS}{WINDOW_ARGUMENTS if window else ''}"
      f"{KVCACHE_ARGUMENTS[bool(cfg.PAGE)] if cfg.KVLEN else ''}"
      f"{VARLEN_ARGUMENTS if cfg.VARLEN else ''}{mods.parameters(cfg.MODS)}"
      f"{dropout.parameters(cfg)}):")
    with s.block():
        if cfg.SPLIT:   # out, lse: (splits, B, H, Nq, .) partials; blockIdx.z is the share
            emit_prologue(s, cfg.BR, ops.float, ops.word, views=(
                "qh = q[b, h]", "kh = k[b, hk]", "vh = v[b, hk]",
                "oh = out[U(cuda.blockIdx.z), b, h]"))
        else:
            emit_prologue(s, cfg.BR, ops.float, ops.word, views=(
                f"qh = {head_view(cfg, 'q', 'h')}",) + (() if cfg.VARLEN else (
                    "kh = k[b, hk]", "vh = v[b, hk]", "oh = out[b, h]")),
                packed=bool(cfg.VARLEN))
        if cfg.KVLEN:   # this entry's cached keys; the queries are the newest of them
            s("Nk = I(kv_lens[b])", "Nk_u = U(Nk)", "causal_offset = Nk - Nq")
        if cfg.MODS:
            emit_modified_scale(s, ops.float, cfg.MODS, "ONE")
            s("hi = I(h)")
        dropout.emit_locals(s, cfg, ops.float)
        ops.stage_q(s)
        emit_row_bounds(s, cfg.BR, window)
        # split-KV deals out key tiles, or with a block mask the listed blocks (tile_loop)
        split_tiles = bool(cfg.SPLIT) and not mods.sparse(cfg.MODS)
        if split_tiles:
            emit_split_range(s, cfg.BC, window)
        ops.a_fragments(s)
        emit_q_ready(s, cfg.VEC, cfg.HOLDQ, NKK, lambda kk, names: ops.load_a(s, kk, names))
        emit_accumulators(s, NVN)

        def stage_kv(j0u, buf):
            emit_views_at_use(s, cfg, (("kh", "k", "hk", "k"), ("vh", "v", "hk", "k")))
            return ops.stage_kv(s, j0u, buf)

        bounds = {"start": "split_first", "end": "split_end"} if split_tiles else {}
        with tile_loop(s, stage_kv, cfg.BC, L.kv_words, cfg.VEC, L.kv_off, L.KW,
                       window or split_tiles, sparse=emit_block_row(s, cfg.MODS),
                       shares=bool(cfg.SPLIT) and not split_tiles, **bounds) as (k_off, v_off, kb):
            s(f"if {warp_sees_tile(cfg.BC, window)}:")
            with s.block():
                # ---- S = Q K^T
                ops.zero_scores(s, NN)
                ops.b_fragments(s, kb, k_off)
                for kk in range(NKK):
                    if cfg.HOLDQ:
                        qa = [f"qf_{kk}_{r}" for r in range(4)]
                    else:
                        qa = [f"qa{r}" for r in range(4)]
                        ops.load_a(s, kk, qa)
                    for n in range(NN):
                        b = ops.load_b(s, kk, n)
                        ops.product(s, [f"s_{n}_{r}" for r in range(4)], qa, b,
                                    [f"c_{n}_{r}" for r in range(4)])
                ops.finish_scores(s, NN)
                # ---- mask, online softmax, O += P V
                emit_score_mask(s, NN, cfg.BC, window)
                if cfg.MODS:
                    emit_tile_mods(s, cfg.MODS, NN)
                if cfg.DBG:
                    emit_debug_dump(s, NN)
                emit_online_update(s, NN, NVN, rescale_o=ops.rescales_o_in_softmax)
                if cfg.DROP:   # P dropped after the row sums took it, before P V; the kept
                    #            ones' 1 / (1 - p) is O's, in the epilogue
                    s("dj = j0 + I(t) * 2")
                    dropout.emit_rows(s, NN, "s", cfg.BC, scaled=False)
                ops.accumulate_pv(s, kb, v_off, NVN, NPK)

        if cfg.SPLIT:
            emit_epilogue(s, NVN, lambda n, ra, rb, half: ops.store_partial(s, n, ra, rb, half),
                          lse_at="lse[U(cuda.blockIdx.z), b, h, ru]",
                          factor="drop_scale" if cfg.DROP else "ONE")
        else:
            emit_views_at_use(s, cfg, (("oh", "out", "h", "q"),))
            emit_epilogue(s, NVN, lambda n, ra, rb, half: ops.store_o(s, n, ra, rb, half),
                          lse_at=row_value(cfg, "lse", "h", "ru"),
                          factor="drop_scale" if cfg.DROP else "ONE")
    return s.text()


def emit_block_row(s, token, div32=None):
    """With a block mask, emit the block row of the thread block's queries (which bq divides:
    config.py checks) and return tile_loop's ``sparse`` for the key blocks it lists; else
    None. ``div32``: a 32-bit division to use (emit_prologue's)."""
    if not mods.sparse(token):
        return None
    s(f"bm_row = I({div32}(i0, bm_bq))" if div32 else "bm_row = I(i0) // bm_bq",
      "bm_list = bm_kv_blocks[b, h, bm_row]")
    return "bm_list", "bm_kv_count[b, h, bm_row]", "bm_bk"


def emit_tile_mods(s, token, NN):
    """Emit the modifications of MODS token ``token`` on a key tile's S registers (NN n8 tiles in
    the C layout: rows r0 / r1, the tile's first key j0), rows past Nq left alone."""
    s("cm = j0 + I(t) * 2")
    mods.emit_apply(s, token, [
        (f"s_{n}_{r}", "r0" if r < 2 else "r1", f"cm + {n * 8 + r % 2}")
        for n in range(NN) for r in range(4)], guard="{i} < Nq")


def emit_modified_scale(s, flt, token, scale):
    """Emit, for a kernel with modifications, the scale the mods read (mod_scale: they take the
    scaled score) and the softmax's: its scores are then modified scaled scores, so exp2 takes
    log2(e) and lse's scale becomes ``scale`` (the forward's "ONE"; the backward keeps the
    softmax scale, which its gradients carry); the mods' batch index bi (int64, as their other
    indices; the caller emits hi where the head is known) and arguments."""
    s("mod_scale = scale", f"scale_log2 = {flt}({math.log2(math.e)!r})", "bi = I(b)")
    if scale != "scale":
        s(f"scale = {scale}")
    mods.emit_locals(s, token, flt)


def _namespace(cfg):
    """The names the generated source calls: numba types, the inline-PTX intrinsics and
    numflash.cuda.common's device functions, bound for this config."""
    from numba import cuda, float32, float64, int64, uint16, uint32, uint64
    from .. import ptx
    from ..common import key_end
    real = np.float64 if cfg.DT == "f64" else np.float32
    return {
        "cuda": cuda, "math": math, "U": uint64, "I": int64, "uint32": uint32, "uint16": uint16,
        "float32": float32, "float64": float64,
        "ZERO": real(0), "ONE": real(1), "NEG_INF": real(-np.inf),
        "FULL": 0xFFFFFFFF, "key_end": key_end, "kv_head": _kv_head_device(),
        "mma_f16": ptx.mma_f16, "mma_bf16": ptx.mma_bf16, "mma_tf32": ptx.mma_tf32,
        "to_tf32": ptx.to_tf32, "split_tf32": ptx.split_tf32,
        "mma_f64": ptx.mma_f64_m16n8k8 if cfg.MMA == "m16n8k8" else ptx.mma_f64_m8n8k4x4,
        "pack_f16x2": ptx.pack_f16x2, "pack_bf16x2": ptx.pack_bf16x2,
        # float64 needs the exact exp2 (libdevice), not ex2.approx.f32
        "ex2": math.exp2 if cfg.DT == "f64" else ptx.ex2,
        "ldmatrix_x4": ptx.ldmatrix_x4, "ldmatrix_x4_trans": ptx.ldmatrix_x4_trans,
        "shared_addr": ptx.shared_addr, "global_addr2": ptx.global_addr2,
        "cp_async_16": ptx.cp_async_16, "cp_async_commit": ptx.cp_async_commit,
        "cp_async_wait_0": ptx.cp_async_wait_0, "cp_async_wait_1": ptx.cp_async_wait_1,
    }


def kv_head(h, H, Hkv):
    """The K/V head serving query head h (GQA: H / Hkv query heads share one)."""
    return h // (H // Hkv)


_device_functions = {}


def _kv_head_device():
    if "kv_head" not in _device_functions:
        from numba import cuda
        _device_functions["kv_head"] = cuda.jit(device=True)(kv_head)
    return _device_functions["kv_head"]


def make_kernel(**config):
    """The kernel function for one config (numba compiles it; see launch.py)."""
    cfg = MmaConfig(**config)
    assert (cfg.MMA is not None) == (cfg.DT == "f64"), "MMA names the float64 instruction only"
    return define(kernel_source(cfg), "numflash.cuda.mma", cfg, namespace_with_mods(cfg,
                                                                                   _namespace),
                  "mma_attention")


def namespace_with_mods(cfg, base):
    """``base(cfg)``, and the config's modifications and dropout generator compiled as device
    functions."""
    ns = base(cfg)
    if cfg.MODS or cfg.DROP:
        from numba import cuda
        real = np.float64 if cfg.DT == "f64" else np.float32
        if cfg.MODS:
            ns.update(mods.namespace(cfg.MODS, real, cuda.jit(device=True)))
        if cfg.DBIAS or cfg.MARGS:
            ns.update(mods.grad_namespace(cfg.MODS, real, cuda.jit(device=True),
                                          bias=bool(cfg.DBIAS), args=bool(cfg.MARGS)))
        if cfg.MARGS:
            ns.update(mods.arg_grad_namespace(cfg.MARGS, cuda.jit(device=True)))
        ns.update(dropout.namespace(cfg, cuda.jit(device=True)))
    return ns


def source_identity(src, binders=()):
    """What decides a generated kernel's PTX besides the launcher: its source ``src``, and the
    code that binds its names (this module's _namespace, kv_head, any further ``binders``, and
    the device-function modules bound, numflash.cuda.ptx and .common). An edit of a generator
    that leaves its source alike keeps every cached cubin and shipped PTX valid."""
    import inspect
    from .. import common, launch, ptx
    h = hashlib.sha256(src.encode())
    for fn in (_namespace, kv_head, *binders):
        h.update(inspect.getsource(fn).encode())
    h.update(launch.source_digest(ptx.__name__).encode())
    h.update(launch.source_digest(common.__name__).encode())
    return h.hexdigest()[:16]


def code_identity(**config):
    """The forward variant's identity (source_identity of its generated source and, with
    modifications, of their functions)."""
    cfg = MmaConfig(**config)
    return source_identity(kernel_source(cfg), (mods.identity_functions(cfg.MODS) if cfg.MODS
                                                else ()) + dropout.identity_functions(cfg))


make_kernel.code_identity = code_identity
make_kernel.cacheable = lambda **config: mods.cacheable(config.get("MODS", ""))
