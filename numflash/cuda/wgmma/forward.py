"""The forward on Hopper's warpgroup products (wgmma), composed from cuda.mma's pieces.

A block of NWG warpgroups owns BR = 64 NWG query rows; warpgroup w owns 64 of them and, inside
it, each warp 16 (so cuda.mma's row bounds, masking, online softmax and epilogue apply as they
are: the wgmma accumulator layout is mma.sync's C layout, n8 tile after n8 tile). Q, K and V
tiles sit in shared memory in the 128-byte swizzled layout (numflash.cuda.ptx_wgmma), copied by
every thread with 16-byte cp.async: a warp's copy instruction reads whole rows (128 contiguous
bytes each) and writes four 128-byte runs, each across all 32 banks. Per key tile each
warpgroup computes

    S = Q K^T     wgmma_ss: Q and K from shared memory through descriptors, D / 16 k-steps
    mask, online softmax on S in registers (cuda.mma.mask / softmax)
    O += P V      wgmma_rs: P packed from the S registers as the A operand, V from shared
                  memory read MN-major (transposed), BC / 16 k-steps

overlapped as in FlashAttention-3 (intra-warpgroup pipelining): iteration it issues S of tile
it and P V of tile it - 1 together, waits for S only and runs tile it's softmax while the
tensor cores add P V. K/V tiles rotate through three buffers: tile it + 1 is copied while tiles
it and it - 1 are read. A warpgroup skips the key tiles none of its rows sees (a
warpgroup-uniform condition, as wgmma needs); the block never loads the tiles none of its rows
sees.

Nothing in the kernel calls a subroutine (64-bit integer or IEEE float division would): ptxas
serializes every wgmma of a kernel that does (warning C7509; the compile test checks its
absence).
"""
import math

import numpy as np

from ..mma.emit import (VARLEN_ARGUMENTS, U, Source, define, emit_prologue, emit_views_at_use,
                        head_view, row_value)
from ..mma import mods
from ..mma.forward import (ARGUMENTS, WINDOW_ARGUMENTS, _kv_head_device, emit_block_row,
                           emit_modified_scale, emit_tile_mods, kv_head, source_identity)
from ..mma.mask import emit_row_bounds, emit_score_mask, first_key, span_keys
from ..mma.operands import _OperandKind, packed_a_step
from ..mma.softmax import emit_accumulators, emit_epilogue, emit_online_update
from ..mma.staging import (emit_next_sparse_tile, emit_sparse_tile, emit_sparse_tiles,
                           emit_window_tiles)
from ..ptx_wgmma import descriptor_fields
from .tiles import ATOM, SWIZZLE, WgmmaConfig, layout, region_bytes, register_cap


def emit_copies_setup(s, name, src, width, dim, NT):
    """Emit what one thread keeps for copying rows of ``src`` (a 2-D view, ``width`` padded
    columns, ``dim`` real ones) into a swizzled tile, tile after tile. Copy idx = tid + i NT
    takes chunk c8 = idx % 8 of column slab a = (idx / 8) % (width / 64) of row idx / (8 width
    / 64): a warp's 32 copies read whole rows, and each 8 of them write one row's 128 bytes
    (chunk c8 lands at chunk c8 ^ (row % 8): all 32 banks). NT is a multiple of 8 x the slabs,
    so a thread keeps its chunk and slab, and its rows step by RSTEP = NT / (8 x slabs), a
    multiple of 8: its swizzled chunk stays too. Its source address then advances by a
    constant and no tile recomputes an index (64-bit index arithmetic costs several
    instructions an operation)."""
    slabs = width // 64
    assert NT % (8 * slabs) == 0 and (NT // (8 * slabs)) % 8 == 0
    s(f"{name}_c8 = tid % {U(8)}",
      f"{name}_a = (tid // {U(8)}) % {U(slabs)}",
      f"{name}_r0 = tid // {U(8 * slabs)}",
      f"{name}_col = {name}_a * {U(64)} + {name}_c8 * {U(8)}",
      f"{name}_cols = {name}_col < {dim}",
      f"{name}_p0 = global_addr2({src}, {U(0)}, {name}_col if {name}_cols else {U(0)})",
      f"{name}_rs = U({src}.strides[0])",
      f"{name}_step = {name}_rs * {U(NT // (8 * slabs))}",
      # byte offset in a tile of `rows` rows, but for the slab term: {name}_a * rows * 128
      f"{name}_dst = {name}_r0 * {U(SWIZZLE)} + (({name}_c8 ^ ({name}_r0 % {U(8)})) * {U(16)})")


def emit_copies(s, name, rows, width, first, limit, base, NT):
    """Emit one tile's copies of ``rows`` rows from row ``first`` (source) into the swizzled
    tile at shared byte address ``base`` (source; 1024-byte aligned), with what
    emit_copies_setup kept: rows at or past ``limit`` and columns past the real ones are
    zero-filled (cp.async's src-size 0)."""
    slabs = width // 64
    total, rstep = rows * width // 8, NT // (8 * slabs)
    count = -(-total // NT)
    s(f"row = {first} + {name}_r0",
      f"src = {name}_p0 + row * {name}_rs",
      f"dst = {base} + {name}_a * {U(rows * SWIZZLE)} + {name}_dst")
    for i in range(count):
        guard = (i + 1) * NT > total
        if guard:
            s(f"if tid < {U(total - i * NT)}:")
            s.ind += 1
        s(f"ok = row < {limit} and {name}_cols",
          f"cp_async_16(dst + {U(i * rstep * SWIZZLE)}, src if ok else {name}_p0, "
          f"{U(16)} if ok else {U(0)})")
        if guard:
            s.ind -= 1
        if i + 1 < count:
            s(f"row += {U(rstep)}", f"src += {name}_step")


def k_step_offset(rows, kk):
    """Descriptor offset (16-byte units) of k-step kk of a K-major tile of ``rows`` rows: 32
    bytes a step inside a 128-byte row, a column slab (rows x 128 bytes) every 4."""
    return (kk // 4 * rows * SWIZZLE + kk % 4 * 32) // 16


def emit_pack(s, pack, src, dst, steps):
    """Emit a register A operand of ``steps`` k-steps (dst_kk_r) packed by function ``pack``
    from C fragments ``src``: two adjacent n8 tiles a k-step (the accumulator layout is the A
    layout once packed)."""
    for kk in range(steps):
        s(*packed_a_step(pack, src, kk, [f"{dst}_{kk}_{r}" for r in range(4)]))


class _Products:
    """Source of the two products of a key tile and of what sits between them."""

    def __init__(self, cfg):
        self.cfg = cfg
        # K-major Q and K: SBO the next 8 rows (LBO unused); MN-major V: LBO the next 64
        # columns, SBO the next 8 keys
        self.k_fields = descriptor_fields(16, ATOM, swizzle=SWIZZLE)
        self.v_fields = descriptor_fields(cfg.BC * SWIZZLE, ATOM, swizzle=SWIZZLE)
        self.NN, self.NVN, self.PV_STEPS = cfg.BC // 8, cfg.DV // 8, cfg.BC // 16
        self.scores = ", ".join(f"s_{n}_{r}" for n in range(self.NN) for r in range(4))
        self.acc = ", ".join(f"o_{n}_{r}" for n in range(self.NVN) for r in range(4))
        self.pa = ", ".join(f"pa_{kk}_{r}" for kk in range(self.PV_STEPS) for r in range(4))

    def descriptors(self, s, k_base, v_base):
        """Emit kd and vd, the descriptors of the K and V tiles at shared byte addresses
        ``k_base``, ``v_base`` (source)."""
        s(f"kd = (({k_base}) >> {U(4)}) | {U(self.k_fields)}",
          f"vd = (({v_base}) >> {U(4)}) | {U(self.v_fields)}")

    def qk(self, s, fn="wgmma_qk"):
        """Emit S = Q K^T."""
        cfg = self.cfg
        qs = ", ".join(f"qd + {U(k_step_offset(cfg.BR, kk))}" for kk in range(cfg.D // 16))
        ks = ", ".join(f"kd + {U(k_step_offset(cfg.BC, kk))}" for kk in range(cfg.D // 16))
        s(f"{self.scores} = {fn}(({qs},), ({ks},))")

    def softmax(self, s, rescale_o=True):
        """Emit the mask, the modifications and the online update of the S registers (P left
        in them)."""
        emit_score_mask(s, self.NN, self.cfg.BC, bool(self.cfg.WINDOW))
        if self.cfg.MODS:
            emit_tile_mods(s, self.cfg.MODS, self.NN)
        emit_online_update(s, self.NN, self.NVN, rescale_o=rescale_o)

    def rescale_o(self, s):
        for n in range(self.NVN):
            s(*(f"o_{n}_{r} *= alpha{r // 2}" for r in range(4)))

    def pack_p(self, s):
        """Emit P's A operand: two adjacent n8 tiles of S per k-step, packed."""
        emit_pack(s, self.cfg.pack, "s", "pa", self.PV_STEPS)

    def pv(self, s, fn="wgmma_pv", vd="vd"):
        """Emit O += P V (16 keys a k-step: two 1024-byte atoms of V along the keys)."""
        steps = ", ".join(f"{vd} + {U(2 * ATOM // 16 * kk)}" for kk in range(self.PV_STEPS))
        s(f"{self.acc} = {fn}(({self.acc},), ({self.pa},), ({steps},))")


def _stage_tile(s, cfg, first, base):
    """Emit the cp.async copies of the K and V rows first.. into the buffer at shared byte
    address ``base`` (source)."""
    emit_copies(s, "kc", cfg.BC, cfg.D, first, "Nk_u", base, cfg.NT)
    emit_copies(s, "vc", cfg.BC, cfg.DV, first, "Nk_u",
                f"{base} + {U(region_bytes(cfg.BC, cfg.D))}", cfg.NT)
    s("cp_async_commit()")


def _emit_loop(s, cfg, L, products, sparse=None):
    """The tile loop (module docstring): one more iteration than tiles adds the last P V. With a
    window the block's tiles start at the one holding its first row's first key (t_first), and
    a warpgroup computes the tiles between its first row's first key and its last row's end.
    With a block mask (``sparse``: emit_block_row's) the loop walks the tiles of the blocks its
    block row lists (cuda.mma's walk, staging.emit_sparse_tiles), tile_full marking a FULL
    block's; the P V of a tile then finds its first key in j_prev."""
    def buffer(it):
        return f"(tiles + U(({it}) % 3) * {U(L.kv_bytes)})"
    BC = cfg.BC
    seen = " and {} > wg_first_key" if cfg.WINDOW else ""
    if sparse:
        next_tile = emit_sparse_tiles(
            s, BC, "block_first" if cfg.WINDOW else None, "block_keys", sparse,
            lambda row: _stage_tile(s, cfg, row, "tiles"))
        prev, prev_end = "j_prev", f"j_prev + {BC}"
        s("j_prev = I(0)")
    else:
        if cfg.WINDOW:
            tile = emit_window_tiles(s, BC, "block_first", "block_keys")
            first, first_row = "ntiles > 0", f"U(t_first * {BC})"
        else:
            first, tile, first_row = "block_keys > 0", f"it * {BC}", U(0)
        s(f"if {first}:")
        with s.block():
            _stage_tile(s, cfg, first_row, "tiles")
        if not cfg.WINDOW:
            s(f"ntiles = (block_keys + {BC - 1}) // {BC}")
        next_tile, prev, prev_end = f"j0 + {BC}", f"j0 - {BC}", "j0"
    s("s_0_0 = ZERO", "alpha0 = ONE", "alpha1 = ONE")
    # P of the tile before the first: never read
    s(*(f"pa_{kk}_{r} = uint32(0)" for kk in range(products.PV_STEPS) for r in range(4)))
    s("for it in range(ntiles + 1):")
    with s.block():
        if sparse:
            emit_sparse_tile(s, BC, sparse)
        else:
            s(f"j0 = {tile}")
        s("cuda.syncthreads()  # the buffer refilled next held tile it - 2: read by now")
        s("if it + 1 < ntiles:")
        with s.block():
            _stage_tile(s, cfg, f"U({next_tile})", buffer("it + 1"))
            s("cp_async_wait_1()")
        s("else:")
        with s.block():
            s("cp_async_wait_0()")
        s("fence_proxy_async()", "cuda.syncthreads()")
        # warpgroup-uniform: this tile's S, the previous tile's P V
        s("has_s = it < ntiles and j0 < wg_keys" + seen.format(f"j0 + {BC}"),
          f"has_pv = it > 0 and {prev} < wg_keys" + seen.format(prev_end))
        products.descriptors(s, buffer("it"),
                             f"{buffer('it + 2')} + {U(region_bytes(cfg.BC, cfg.D))}")
        s("if has_s and has_pv:")
        with s.block():
            products.qk(s, "wgmma_qk_async")
            products.pv(s, "wgmma_pv_async")
            s(f"{products.scores} = wgmma_wait_s(({products.scores},))")
            products.softmax(s, rescale_o=False)
            s(f"{products.acc} = wgmma_wait_o(({products.acc},))")
            products.rescale_o(s)
            products.pack_p(s)
        s("elif has_s:")   # the warpgroup's first tile
        with s.block():
            products.qk(s)
            products.softmax(s)
            products.pack_p(s)
        s("elif has_pv:")  # its last tile's P V
        with s.block():
            products.pv(s)
        if sparse:
            s("j_prev = j0")
            emit_next_sparse_tile(s, sparse)


def kernel_source(cfg):
    """Python source of the wgmma forward kernel for one WgmmaConfig."""
    L = layout(cfg)
    NVN = cfg.DV // 8
    s = Source()
    s(f"def wgmma_attention({ARGUMENTS}{WINDOW_ARGUMENTS if cfg.WINDOW else ''}"
      f"{VARLEN_ARGUMENTS if cfg.VARLEN else ''}"
      f"{mods.parameters(cfg.MODS)}):")
    with s.block():
        if cfg.VARLEN:   # b is the sequence: its rows' views (O's made at the stores)
            emit_prologue(s, cfg.BR, "float32", "uint32", div32="div_u32", packed=True,
                          views=(f"qh = {head_view(cfg, 'q', 'h')}",
                                 f"kh = {head_view(cfg, 'k', 'hk', 'k')}",
                                 f"vh = {head_view(cfg, 'v', 'hk', 'k')}"))
        else:
            emit_prologue(s, cfg.BR, "float32", "uint32", div32="div_u32")
        if cfg.MODS:
            emit_modified_scale(s, "float32", cfg.MODS, "ONE")
            s("hi = I(h)")
        # swizzled tiles must start on 1024 bytes: the dynamic shared array is padded for it
        s(f"sbase = U(shared_addr(smem, {U(0)}))",
          f"qbase = (sbase + {U(ATOM - 1)}) & ~{U(ATOM - 1)}",
          f"tiles = qbase + {U(L.q_bytes)}")
        emit_copies_setup(s, "qc", "qh", cfg.D, "d_u", cfg.NT)
        emit_copies(s, "qc", cfg.BR, cfg.D, "i0", "Nq_u", "qbase", cfg.NT)
        s("cp_async_commit()")
        emit_copies_setup(s, "kc", "kh", cfg.D, "d_u", cfg.NT)
        emit_copies_setup(s, "vc", "vh", cfg.DV, "dv_u", cfg.NT)
        emit_row_bounds(s, cfg.BR, bool(cfg.WINDOW))
        products = _Products(cfg)
        # the warpgroup's rows and the keys any of them sees: its tiles outside those are skipped
        s(f"wg = warp // {U(4)}",
          "wg_first = i0s + I(wg) * 64",
          f"wg_keys = {span_keys('wg_first', 64, bool(cfg.WINDOW))}",
          f"qd = ((qbase + wg * {U(64 * SWIZZLE)}) >> {U(4)}) | {U(products.k_fields)}")
        if cfg.WINDOW:
            s(f"wg_first_key = {first_key('wg_first')}")
        s("cp_async_wait_0()", "fence_proxy_async()", "cuda.syncthreads()")
        emit_accumulators(s, NVN)
        _emit_loop(s, cfg, L, products, emit_block_row(s, cfg.MODS, "div_u32"))

        def store(n, ra, rb, half):
            _OperandKind._store_pair(
                s, n, f"uint16(word & {U(0xFFFF)})", f"uint16(word >> {U(16)})",
                [f"word = U({cfg.pack}(o_{n}_{ra} * inv{half}, o_{n}_{rb} * inv{half}))"])
        emit_views_at_use(s, cfg, (("oh", "out", "h", "q"),))
        emit_epilogue(s, NVN, store, lse_at=row_value(cfg, "lse", "h", "ru"),
                      reciprocal="rcp_approx")
    return s.text()


def common_namespace():
    """The names every wgmma kernel's generated source calls but its products: numba's types,
    the float32 constants, the causal rule, the packs, exp2, the copies, the proxy fence and
    the inline 32-bit division."""
    from numba import cuda, float32, int64, uint16, uint32, uint64
    from .. import ptx, ptx_wgmma
    from ..common import key_end
    return {
        "cuda": cuda, "math": math, "U": uint64, "I": int64, "uint32": uint32,
        "uint16": uint16, "float32": float32,
        "ZERO": np.float32(0), "ONE": np.float32(1), "NEG_INF": np.float32(-np.inf),
        "FULL": 0xFFFFFFFF, "key_end": key_end,
        "pack_f16x2": ptx.pack_f16x2, "pack_bf16x2": ptx.pack_bf16x2, "ex2": ptx.ex2,
        "shared_addr": ptx.shared_addr, "global_addr2": ptx.global_addr2,
        "cp_async_16": ptx.cp_async_16, "cp_async_commit": ptx.cp_async_commit,
        "cp_async_wait_0": ptx.cp_async_wait_0,
        "fence_proxy_async": ptx_wgmma.fence_proxy_async, "div_u32": ptx_wgmma.div_u32,
    }


def _namespace(cfg):
    """The names the generated source calls, bound for this config (with modifications, their
    composition as device functions)."""
    from .. import ptx, ptx_wgmma
    kind = cfg.DT
    ns = {
        **common_namespace(),
        "kv_head": _kv_head_device(), "cp_async_wait_1": ptx.cp_async_wait_1,
        "rcp_approx": ptx_wgmma.rcp_approx,
        "wgmma_qk": ptx_wgmma.wgmma_ss(cfg.BC, kind, cfg.D // 16),
        "wgmma_pv": ptx_wgmma.wgmma_rs(cfg.DV, kind, cfg.BC // 16, True),
        "wgmma_qk_async": ptx_wgmma.wgmma_ss(cfg.BC, kind, cfg.D // 16, False),
        "wgmma_pv_async": ptx_wgmma.wgmma_rs(cfg.DV, kind, cfg.BC // 16, True, False),
        "wgmma_wait_s": ptx_wgmma.wgmma_wait(cfg.BC // 2, 1),   # S, with P V still in flight
        "wgmma_wait_o": ptx_wgmma.wgmma_wait(cfg.DV // 2, 0),
    }
    if cfg.MODS:
        from numba import cuda
        ns.update(mods.namespace(cfg.MODS, np.float32, cuda.jit(device=True)))
    return ns


def make_kernel(**config):
    """The kernel function for one config (numba compiles it for sm_90a: launch.py)."""
    cfg = WgmmaConfig(**config)
    fn = define(kernel_source(cfg), "numflash.cuda.wgmma", cfg, _namespace(cfg),
                "wgmma_attention")
    fn.arch_specific = True   # wgmma exists on sm_90a only
    fn.max_registers = register_cap(cfg)
    return fn


def code_identity(**config):
    """The variant's identity: its generated source and the code binding its names."""
    from .. import launch, ptx_wgmma
    cfg = WgmmaConfig(**config)
    cap = register_cap(cfg)   # (launch.kernel_ptx writes it into the PTX)
    binders = (_namespace, common_namespace, kv_head) + \
        (mods.identity_functions(cfg.MODS) if cfg.MODS else ())
    return source_identity(kernel_source(cfg), binders) + \
        launch.source_digest(ptx_wgmma.__name__)[:16] + (f"-maxnreg{cap}" if cap else "")


make_kernel.code_identity = code_identity
make_kernel.cacheable = lambda **config: mods.cacheable(config.get("MODS", ""))
