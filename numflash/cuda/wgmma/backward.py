"""The backward's key pass on Hopper's warpgroup products (wgmma), with dQ by adds.

FlashAttention-3's backward loop, composed from cuda.mma's backward pieces (the transposed
mask, P^T from lse, dS^T, the dQ reductions, the 16-bit stores) and the wgmma forward's
swizzled copies. A block owns BR = 64 NWG keys of one K/V head; warpgroup w owns 64 of them and,
inside it, each warp 16, so every product below has the warpgroup's keys as its M rows (the
transposed products of cuda.mma's key pass). K and V sit in shared memory for the whole block;
the query tiles (Q, dO: BC rows each; lse in log2 units and delta as floats) stream past in two
cp.async buffers, for every query head of the K/V head's group (GQA: dK, dV summed over it).
Per query tile each warpgroup computes

    S^T  = K Q^T      wgmma_ss: K rows of the warpgroup and the Q tile, both K-major
    dP^T = V dO^T     wgmma_ss, issued with S^T; the mask and P^T = exp2(S^T - lse) run
                      while it is in flight
    dV  += P^T dO     wgmma_rs: P^T packed from registers, dO read MN-major
    dS^T = P^T (dP^T - delta)
    dK  += dS^T Q     wgmma_rs: Q read MN-major
    dQ   = dS K       wgmma_ss from the shared dS^T tile (A MN-major: a row of 128 bytes is one
                      key's 64 queries) and K read MN-major, over the block's BR keys; added
                      into the float32 accumulator by four-float reductions

dQ's product needs every warpgroup's dS^T, so it follows a barrier. DQ "split": warpgroup w
takes D / NWG of dQ's columns; "alternate": the warpgroup (tile index mod NWG) takes all of
them while the others wait at the next tile's barrier (its registers hold 64 x D / 128 more
floats, so narrow head dims only). dK is scaled by the softmax scale once, at the end; dQ's
adds carry it.

Two barriers a tile: one after the tile's copies landed (every warpgroup then is past the
previous tile: its buffers and the dS^T tile are free, and the next tile is copied into the
other buffer while this one is computed), one after the dS^T tile is written. Nothing calls a
subroutine (ptxas would serialize every wgmma: numflash.cuda.ptx_wgmma).
"""
from dataclasses import dataclass

import numpy as np

from ..config import TileConfig
from ..mma import mods
from ..mma.backward import (ARGUMENTS, SCALARS, _ds, _lse2, _per_query, _store_rows,
                            emit_dq_reductions, emit_modified_score, emit_transposed_mask,
                            emit_window_queries)
from ..mma.emit import (VARLEN_ARGUMENTS, U, Source, define, emit_sequence, emit_thread_indices,
                        emit_views_at_use, head_view)
from ..mma.forward import emit_modified_scale, source_identity
from ..ptx_wgmma import descriptor_fields
from .forward import (common_namespace, emit_copies, emit_copies_setup, emit_pack,
                      k_step_offset)
from .tiles import ATOM, SWIZZLE, Warpgroups, region_bytes

KERNEL_NAME = "wgmma_backward_keys"
#: the dQ product's split over the block's warpgroups (module docstring)
DQ_FORMS = ("split", "alternate")


@dataclass(frozen=True)
class WgmmaBackwardConfig(Warpgroups, TileConfig):
    """One compile-time variant of the wgmma key pass: D, DV padded head dims (64 or 128); NWG
    warpgroups a block (BR = 64 NWG keys, NT = 128 NWG threads); BC queries a streamed tile (64:
    dQ's product has them as its M rows); DT "f16" or "bf16"; DQ the dQ product's form; VARLEN:
    packed sequences in one launch (cuda.mma's VARLEN: grid y walks the sequences' K/V heads,
    each block finds its sequence's rows in cu_q / cu_k and views them); MODS: cuda.mma's
    modification token (score and mask modifications, not a block mask's lists, applied per
    score with its derivative as cuda.mma's key pass applies them); WINDOW: a sliding window
    (the query tiles outside the block's windows never visited, the rest masked as cuda.mma's
    key pass masks them). Neither on packed sequences yet."""
    D: int
    DV: int
    NWG: int
    BC: int
    DT: str
    DQ: str
    VARLEN: int = 0
    MODS: str = ""
    WINDOW: int = 0

    #: what cuda.mma's shared backward pieces read off a config: 16-bit gradients, no column
    #: slices, no dropout
    GRAD32 = 0
    CHUNKS = 0
    DROP = 0
    #: and what cuda.mma's launch of the two passes reads (gradients.launch_passes): dQ by
    #: four-float adds, no attn_bias or mod_args gradients
    DQADD = "red4"
    DBIAS = ""
    MARGS = ""

    def __post_init__(self):
        assert self.DQ in DQ_FORMS and self.BC == 64 and self.DT in ("f16", "bf16")
        assert self.DQ != "split" or self.D % (8 * self.NWG) == 0
        assert not mods.sparse(self.MODS) and not ((self.MODS or self.WINDOW) and self.VARLEN)

    @property
    def dq_columns(self):
        """dQ's columns one warpgroup's product computes."""
        return self.D // self.NWG if self.DQ == "split" else self.D


@dataclass(frozen=True)
class BackwardLayout:
    """Byte offsets from the 1024-aligned base: K, V (the block's rows), two query buffers of
    a Q and a dO tile (``tile`` bytes each, dO at ``do`` inside), the dS^T tile (BR keys x BC
    queries), then two buffers of BC lse and BC delta floats; ``total`` with the alignment's
    padding."""
    k: int
    v: int
    tiles: int
    tile: int
    do: int
    ds: int
    rows: int
    total: int


def layout(cfg):
    k, v = 0, region_bytes(cfg.BR, cfg.D)
    tiles = v + region_bytes(cfg.BR, cfg.DV)
    do = region_bytes(cfg.BC, cfg.D)
    tile = do + region_bytes(cfg.BC, cfg.DV)
    ds = tiles + 2 * tile
    rows = ds + region_bytes(cfg.BR, cfg.BC)
    return BackwardLayout(k, v, tiles, tile, do, ds, rows, ATOM + rows + 2 * 2 * cfg.BC * 4)


def shared_bytes(cfg):
    return layout(cfg).total


def _descs(name, count, step):
    """Source of a tuple of ``count`` descriptors from ``name``, ``step(kk)`` apart."""
    return "(" + ", ".join(f"{name} + {U(step(kk))}" for kk in range(count)) + ",)"


def _regs(name, tiles):
    return ", ".join(f"{name}_{n}_{r}" for n in range(tiles) for r in range(4))


def _stage(s, cfg, L, first, buffer):
    """Emit the copies of query tile rows ``first``.. (source, uint64) into buffer ``buffer``
    (source): Q and dO by cp.async (committed), lse (log2 units, +inf past Nq and for rows that
    saw no key: their P is 0) and delta by plain stores."""
    s(f"tb = base + {U(L.tiles)} + ({buffer}) * {U(L.tile)}",
      f"fb = fbase + {U(L.rows // 4)} + ({buffer}) * {U(2 * cfg.BC)}")
    emit_copies(s, "cq", cfg.BC, cfg.D, first, "Nq_u", "tb", cfg.NT)
    emit_copies(s, "cdo", cfg.BC, cfg.DV, first, "Nq_u", f"tb + {U(L.do)}", cfg.NT)
    s("cp_async_commit()", f"if tid < {U(cfg.BC)}:")
    with s.block():
        s(f"i = {first} + tid", "lse2 = INF", "dlt = ZERO", "if i < Nq_u:")
        with s.block():
            s(f"lse2 = {_lse2('lseh[i]')}", "dlt = deltah[i]")
        s("smemf[fb + tid] = lse2", f"smemf[fb + {U(cfg.BC)} + tid] = dlt")


def _emit_ds_store(s, cfg, L):
    """Emit the store of the warp's packed dS^T (da_kk_r) into the shared dS^T tile, row = the
    block's key, 128 bytes = BC = 64 queries a row, 16-byte chunk c of row r at c ^ (r % 8)
    (the descriptors' 128-byte swizzle; r % 8 = g): lanes g, t of one chunk hit 32 banks."""
    s(f"dsw = fbase + {U(L.ds // 4)} + (warp * {U(16)} + g) * {U(SWIZZLE // 4)} + t")
    for kk in range(cfg.BC // 16):
        for r, (chunk, row8) in enumerate(((2 * kk, 0), (2 * kk, 8), (2 * kk + 1, 0),
                                           (2 * kk + 1, 8))):
            s(f"smem[dsw + {U(row8 * SWIZZLE // 4)} + ({U(chunk)} ^ g) * {U(4)}] = da_{kk}_{r}")


def kernel_source(cfg):
    """Python source of the wgmma key pass for one WgmmaBackwardConfig."""
    from ..mma.operands import Packed16
    from ..mma.tiles import MmaConfig
    L = layout(cfg)
    NN, ND, NVN = cfg.BC // 8, cfg.D // 8, cfg.DV // 8
    QSTEPS, KSTEPS = cfg.BC // 16, cfg.BR // 16
    NQN = cfg.dq_columns // 8
    k_fields = descriptor_fields(16, ATOM, swizzle=SWIZZLE)
    # MN-major operands: LBO the next 64 columns (a slab of the tile's rows), SBO the next 8 rows
    q_mn = descriptor_fields(cfg.BC * SWIZZLE, ATOM, swizzle=SWIZZLE)
    k_mn = descriptor_fields(cfg.BR * SWIZZLE, ATOM, swizzle=SWIZZLE)
    mn_step = lambda kk: 2 * ATOM // 16 * kk   # 16 rows: two atoms
    # the 16-bit stores of dK and dV (cuda.mma's operand kind for this DT)
    ops = Packed16(MmaConfig(cfg.D, cfg.DV, 4, cfg.BC, 0, cfg.DT, 1))

    s = Source()
    s(f"def {KERNEL_NAME}({ARGUMENTS['keys']}{SCALARS}"
      f"{', window_left, window_right' if cfg.WINDOW else ''}"
      f"{VARLEN_ARGUMENTS if cfg.VARLEN else ''}{mods.parameters(cfg.MODS)}, dqacc):")
    with s.block():
        emit_thread_indices(s, "float32")
        s("bh = U(cuda.blockIdx.y)", "b = U(div_u32(bh, Hkv))", "hk = bh - b * U(Hkv)",
          "group = U(div_u32(H, Hkv))", f"j0k = U(cuda.blockIdx.x) * {U(cfg.BR)}")
        if cfg.MODS:
            emit_modified_scale(s, "float32", cfg.MODS, "scale")
        if cfg.VARLEN:   # b is the sequence: its rows, counts and causal offset
            emit_sequence(s, "j0k", "Nk_u")
        # (packed, dK's and dV's views are made at the stores: emit_views_at_use)
        s(*(f"{x}h = {head_view(cfg, x, 'hk', 'k')}" for x in ("k", "v") +
            (() if cfg.VARLEN else ("dk", "dv"))),
          "smem = cuda.shared.array(0, uint32)", "smemf = cuda.shared.array(0, float32)",
          # swizzled tiles start on 1024 bytes: the dynamic shared array is padded for it
          "sbase = U(shared_addr(smem, U(0)))",
          f"base = (sbase + {U(ATOM - 1)}) & ~{U(ATOM - 1)}",
          "fbase = (base - sbase) // U(4)")
        emit_copies_setup(s, "ck", "kh", cfg.D, "d_u", cfg.NT)
        emit_copies_setup(s, "cv", "vh", cfg.DV, "dv_u", cfg.NT)
        emit_copies(s, "ck", cfg.BR, cfg.D, "j0k", "Nk_u", f"base + {U(L.k)}", cfg.NT)
        emit_copies(s, "cv", cfg.BR, cfg.DV, "j0k", "Nk_u", f"base + {U(L.v)}", cfg.NT)
        s("cp_async_commit()")
        # the warp's keys; the first query that sees any key of the block (a row's key end
        # grows with the row)
        s("j0ks = I(j0k)", "wk = j0ks + I(warp) * 16", "kr0 = wk + I(g)", "kr1 = kr0 + 8",
          f"wg = warp // {U(4)}", f"w4 = warp % {U(4)}",
          "q_first = min(Nq, max(0, j0ks - causal_offset)) if causal else 0")
        if cfg.WINDOW:   # (and the last query that sees any)
            emit_window_queries(s, cfg.BR)
        s(f"t_first = q_first // {cfg.BC}",
          f"ntiles = ({'q_end' if cfg.WINDOW else 'Nq'} + {cfg.BC - 1}) // {cfg.BC}",
          # the warpgroup's K and V rows as K-major A operands, K as dQ's MN-major B
          f"kd = ((base + {U(L.k)} + wg * {U(64 * SWIZZLE)}) >> {U(4)}) | {U(k_fields)}",
          f"vd = ((base + {U(L.v)} + wg * {U(64 * SWIZZLE)}) >> {U(4)}) | {U(k_fields)}",
          f"dsd = ((base + {U(L.ds)}) >> {U(4)}) | {U(k_mn)}")
        if cfg.DQ == "split":   # the warpgroup's first column: its slab, then 2 bytes a column
            s(f"dq_col = wg * {U(cfg.dq_columns)}",
              f"ktd = ((base + {U(L.k)} + dq_col // {U(64)} * {U(cfg.BR * SWIZZLE)} + "
              f"dq_col % {U(64)} * {U(2)}) >> {U(4)}) | {U(k_mn)}")
        else:
            s(f"ktd = ((base + {U(L.k)}) >> {U(4)}) | {U(k_mn)}", "dq_col = U(0)")
        s(f"{_regs('dk', ND)} = {', '.join(['ZERO'] * 4 * ND)}",
          f"{_regs('dv', NVN)} = {', '.join(['ZERO'] * 4 * NVN)}")
        s("for hq in range(group):")
        with s.block():
            s("h = hk * group + hq",
              *(f"{x}h = {head_view(cfg, x, 'h')}" for x in ("q", "do", "lse", "delta", "dqacc")),
              "cuda.syncthreads()  # the previous head's last tile is no longer read")
            if cfg.MODS:
                s("hi = I(h)")
            emit_copies_setup(s, "cq", "qh", cfg.D, "d_u", cfg.NT)
            emit_copies_setup(s, "cdo", "doh", cfg.DV, "dv_u", cfg.NT)
            s("if t_first < ntiles:")
            with s.block():
                _stage(s, cfg, L, f"U(t_first * {cfg.BC})", "U(0)")
            s("for x in range(t_first, ntiles):")
            with s.block():
                s(f"j0 = x * {cfg.BC}", "js = I(j0)", "buf = U(x - t_first) % U(2)",
                  "cp_async_wait_0()", "fence_proxy_async()",
                  "cuda.syncthreads()  # tile x landed; every warpgroup is past tile x - 1")
                s("if x + 1 < ntiles:")
                with s.block():
                    _stage(s, cfg, L, f"U(j0 + {cfg.BC})", "U(1) - buf")
                s(f"tb = base + {U(L.tiles)} + buf * {U(L.tile)}",
                  f"fb = fbase + {U(L.rows // 4)} + buf * {U(2 * cfg.BC)}",
                  f"qd = (tb >> {U(4)}) | {U(k_fields)}",
                  f"dod = ((tb + {U(L.do)}) >> {U(4)}) | {U(k_fields)}",
                  f"qtd = (tb >> {U(4)}) | {U(q_mn)}",
                  f"dotd = ((tb + {U(L.do)}) >> {U(4)}) | {U(q_mn)}")
                S, DP = _regs("s", NN), _regs("dp", NN)
                DK, DV, DQ = _regs("dk", ND), _regs("dv", NVN), _regs("dq", NQN)
                keys, queries = (lambda kk: k_step_offset(cfg.BR, kk),
                                 lambda kk: k_step_offset(cfg.BC, kk))
                s(f"{S} = wgmma_s({_descs('kd', cfg.D // 16, keys)}, "
                  f"{_descs('qd', cfg.D // 16, queries)})",
                  f"{DP} = wgmma_dp({_descs('vd', cfg.DV // 16, keys)}, "
                  f"{_descs('dod', cfg.DV // 16, queries)})",
                  f"{S} = wait_s(({S},))")
                emit_transposed_mask(s, NN, bool(cfg.WINDOW))
                s(f"qc = t * {U(2)}")
                lse2, dlt = ("lse2", "fb"), ("dlt", f"fb + {U(cfg.BC)}")
                if cfg.MODS:   # dP^T first: each score's derivative is used where it is made
                    s(f"{DP} = wait_dp_0(({DP},))", "qcol = js + I(t) * 2")
                    _per_query(s, NN, [lse2, dlt],
                               lambda n, r, c: emit_modified_score(s, cfg, n, r, c))
                else:
                    _per_query(s, NN, [lse2], lambda n, r, c: s(
                        f"s_{n}_{r} = ex2(s_{n}_{r} * scale_log2 - lse2)"))
                emit_pack(s, cfg.pack, "s", "pa", QSTEPS)
                PA = _regs("pa", QSTEPS)
                s(f"{DV} = wgmma_dv(({DV},), ({PA},), {_descs('dotd', QSTEPS, mn_step)})")
                if not cfg.MODS:   # dP^T arrived while P^T was made
                    s(f"{DP} = wait_dp(({DP},))")
                    _per_query(s, NN, [dlt], lambda n, r, c: s(
                        f"s_{n}_{r} = {_ds(f's_{n}_{r}', f'dp_{n}_{r}', 'dlt')}"))
                # dS^T: in dP^T's registers with modifications (P^T was still packed from S^T's)
                emit_pack(s, cfg.pack, "dp" if cfg.MODS else "s", "da", QSTEPS)
                DA = _regs("da", QSTEPS)
                s(f"{DK} = wgmma_dk(({DK},), ({DA},), {_descs('qtd', QSTEPS, mn_step)})")
                _emit_ds_store(s, cfg, L)
                s("fence_proxy_async()", "cuda.syncthreads()  # the block's dS^T tile is written")

                def dq_product():
                    s(f"{DQ} = wgmma_dq({_descs('dsd', KSTEPS, mn_step)}, "
                      f"{_descs('ktd', KSTEPS, mn_step)})",
                      f"{DV} = wait_dv_2(({DV},))", f"{DK} = wait_dk_1(({DK},))",
                      f"{DQ} = wait_dq(({DQ},))")
                    emit_dq_reductions(s, "dq", NQN, "js + I(w4) * 16", "dq_col")

                if cfg.DQ == "split":
                    dq_product()
                else:
                    s(f"if U(x - t_first) % {U(cfg.NWG)} == wg:")
                    with s.block():
                        dq_product()
                    s("else:")
                    with s.block():
                        s(f"{DV} = wait_dv_1(({DV},))", f"{DK} = wait_dk_0(({DK},))")
        s("cp_async_wait_0()")
        emit_views_at_use(s, cfg, (("dkh", "dk", "hk", "k"), ("dvh", "dv", "hk", "k")))
        _store_rows(s, ops, cfg, ("kr0", "kr1"), "Nk",
                    [("dk", ND, "scale", "dkh", "d_u", None),
                     ("dv", NVN, "ONE", "dvh", "dv_u", None)])
    return s.text()


def _namespace(cfg):
    """The names the generated source calls, bound for this config."""
    from .. import ptx_reduce, ptx_wgmma as w
    kind = cfg.DT
    return {
        **common_namespace(),
        "INF": np.float32(np.inf), "LOG2E": np.float32(np.log2(np.e)),
        "red_add_f32x4": ptx_reduce.red_add_f32x4,
        "wgmma_s": w.wgmma_ss(cfg.BC, kind, cfg.D // 16, False),
        "wgmma_dp": w.wgmma_ss(cfg.BC, kind, cfg.DV // 16, False),
        "wait_s": w.wgmma_wait(cfg.BC // 2, 1),    # S^T, with dP^T in flight
        "wgmma_dv": w.wgmma_rs(cfg.DV, kind, cfg.BC // 16, True, False),
        "wait_dp": w.wgmma_wait(cfg.BC // 2, 1),   # dP^T, with dV in flight
        "wgmma_dk": w.wgmma_rs(cfg.D, kind, cfg.BC // 16, True, False),
        "wgmma_dq": w.wgmma_ss(cfg.dq_columns, kind, cfg.BR // 16, False, True, True),
        # committed in the order dV, dK (, dQ): each wait leaves the later ones in flight
        "wait_dv_2": w.wgmma_wait(cfg.DV // 2, 2), "wait_dv_1": w.wgmma_wait(cfg.DV // 2, 1),
        "wait_dk_1": w.wgmma_wait(cfg.D // 2, 1), "wait_dk_0": w.wgmma_wait(cfg.D // 2, 0),
        "wait_dq": w.wgmma_wait(cfg.dq_columns // 2, 0),
    }


def _modified_namespace(cfg):
    """What a variant with modifications calls besides _namespace's (bound apart, so that the
    plain variants' identity and shipped PTX stay): dP^T's wait with nothing after it, and the
    composition and its derivative as device functions."""
    from numba import cuda
    from .. import ptx_wgmma as w
    return {"wait_dp_0": w.wgmma_wait(cfg.BC // 2, 0),
            **mods.namespace(cfg.MODS, np.float32, cuda.jit(device=True))}


def make_kernel(**config):
    """The key-pass kernel for one config (numba compiles it for sm_90a: launch.py)."""
    cfg = WgmmaBackwardConfig(**config)
    ns = {**_namespace(cfg), **(_modified_namespace(cfg) if cfg.MODS else {})}
    fn = define(kernel_source(cfg), "numflash.cuda.wgmma backward", cfg, ns, KERNEL_NAME)
    fn.arch_specific = True   # wgmma exists on sm_90a only
    return fn


def code_identity(**config):
    """The variant's identity: its generated source and the code binding its names."""
    from .. import launch, ptx_reduce, ptx_wgmma
    cfg = WgmmaBackwardConfig(**config)
    binders = (_namespace, common_namespace, ptx_reduce._make_red_add_f32x4) + \
        ((_modified_namespace,) + mods.identity_functions(cfg.MODS) if cfg.MODS else ())
    return source_identity(kernel_source(cfg), binders) + \
        launch.source_digest(ptx_wgmma.__name__)[:16]


make_kernel.code_identity = code_identity
make_kernel.cacheable = lambda **config: mods.cacheable(config.get("MODS", ""))
