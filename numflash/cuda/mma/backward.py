"""The FlashAttention-2 backward on tensor cores, composed from the forward's pieces over the
same operand kinds: two kernels, no atomics, so two runs give bitwise-equal gradients.

With P = exp(S - lse) recomputed from q, k and the forward's lse, and delta = rowsum(dO * O)
(computed by the query pass, which has dO and O in shared memory, for the key pass):
dV = P^T dO, dP = dO V^T, dS = P * (dP - delta), dQ = scale dS K, dK = scale dS^T Q.

- Query pass (``query_pass_source``): a block owns BR = 16 NW query rows, as the forward does,
  with Q and dO staged in shared memory; the K / V tiles stream past through the forward's
  double-buffered cp.async loop and causal / window bounds (mask.py, staging.py). Per tile a warp
  computes its 16 x BC block of S = Q K^T and of dP = dO V^T (V read like K), forms dS in the S
  registers and adds dS K (K read like V in the forward's P V) to its dQ fragments.
- Key pass (``key_pass_source``): a block owns BK = 16 NW key rows of one K/V head, K and V staged
  once; the query tiles (Q, dO, and per query lse and delta) stream past through the same loop,
  for every query head of the K/V head's group (GQA: dK and dV are summed over the group in
  registers). The warp's products are transposed: S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T,
  dK += dS^T Q, so each warp owns whole rows of dK and dV and no block shares an output.

This recomputes S and dP in both passes (7 matrix products where dQ by atomic adds needs 5), in
exchange for no float32 dQ buffer, no atomics and determinism by construction.

dQ by adds (MmaConfig.DQADD, FlashAttention-2's default; ``deterministic=True`` keeps the two
passes): the key pass also writes each warp's dS^T (16-bit, as the dK product reads it) to a
shared tile, and after a barrier its warps split dQ's SUB x D tile = dS K over the block's keys
(dS read with ldmatrix.trans, K like the query pass's V) and add it into a float32 dQ
accumulator (``red.global.add.v4.f32``): 5 products. The query pass then computes delta only.

A row that sees no key (lse = -inf) reads lse as +inf, so its P, and its gradients, are zero.
"""

import contextlib

from . import dropout, mods
from .emit import (VARLEN_ARGUMENTS, U, Source, define, emit_views_at_use, emit_sequence,
                   emit_thread_indices, head_view, row_value)
from .forward import emit_block_row, emit_modified_scale, namespace_with_mods
from .mask import first_key, row_end, emit_row_bounds, emit_score_mask, warp_sees_tile
from .operands import operands_for
from .staging import emit_cp_async_rows, tile_loop
from .tiles import MmaConfig

ARGUMENTS = {"queries": "q, k, v, do, o, lse, delta, dq, ",
             "keys": "q, k, v, do, lse, delta, dk, dv, "}
SCALARS = "scale_log2_in, scale_in, causal, causal_offset"
KERNEL_NAMES = {"queries": "mma_backward_queries", "keys": "mma_backward_keys"}


def backward_layout(cfg):
    """Row pitches (words) of the backward's shared tiles: a 16-bit row of n elements takes n / 2
    + 4 words, a word row n + 4 (float64 rows read as the forward's V, n + 2), so ldmatrix and
    the fragment loads stay free of bank conflicts (see operands.py)."""
    ops = operands_for(cfg)
    if cfg.DT in ("f16", "bf16"):
        return ops, (lambda n, read_as_v=False: n // 2 + 4)
    v_pad = ops.kind["v_pad"]
    return ops, (lambda n, read_as_v=False: n + (v_pad if read_as_v else 4))


def _stage_rows(s, ops, src, rows, first, limit, width, dim, off, W, NT):
    emit_cp_async_rows(s, src, rows, "row", first, limit, width, dim, off, W, ops.chunk,
                       ops.per_word, NT)


def _lse2(value):
    """Source of lse in log2 units, +inf for a row that saw no key (so its P is 0, never NaN)."""
    return f"INF if {value} == NEG_INF else {value} * LOG2E"


def _emit_delta(s, ops, cfg, do_off, o_off, OW):
    """Emit delta = rowsum(dO * O) of the thread's rows r0, r1 (delta0, delta1), written to
    ``delta`` for the key pass: the diagonal of the warp's 16 x 16 block of dO O^T, one small
    tensor-core product over the staged dO and O rows (dO * O summed in the accumulators'
    precision, as a separate reduction would), so no pass over O outside the kernel and no
    O(N d) buffers. In
    the C layout row g's diagonal element is register g % 2 of n8 tile 0 on lane (g, g // 2),
    row g + 8's register 2 + g % 2 of tile 1 on the same lane; a shuffle brings them to the
    quad. With column slices (CHUNKS) the first slice's blocks write it (every slice computes
    the same value)."""
    ops.zero_scores(s, 2, "dd", "ddc")
    ops.b_fragments(s, f"warp * {U(16 * OW)} + ", o_off, "o", OW)
    for kk in range(cfg.DV // ops.k_step):
        regs = [f"doa{r}" for r in range(4)]
        ops.load_a(s, kk, regs, "do", OW)
        for n in range(2):
            ops.product(s, [f"dd_{n}_{r}" for r in range(4)], regs, ops.load_b(s, kk, n, "o", OW),
                        [f"ddc_{n}_{r}" for r in range(4)])
    ops.finish_scores(s, 2, "dd", "ddc")
    s(f"diag_lane = g * {U(4)} + g // {U(2)}",
      f"delta0 = cuda.shfl_sync(FULL, dd_0_0 if g % {U(2)} == {U(0)} else dd_0_1, diag_lane)",
      f"delta1 = cuda.shfl_sync(FULL, dd_1_2 if g % {U(2)} == {U(0)} else dd_1_3, diag_lane)")
    first = " and cuda.blockIdx.z == 0" if cfg.CHUNKS else ""
    for half, row in ((0, "r0"), (1, "r1")):
        s(f"if t == {U(0)} and {row} < Nq{first}:")
        with s.block():
            s(f"{row_value(cfg, 'delta', 'h', f'U({row})')} = delta{half}")


def _store_rows(s, ops, cfg, rows, limit, outputs):
    """Emit the stores of the thread's two rows (below ``limit``) of each output (accumulator,
    n8 tiles, factor, view, column limit, first column), in the inputs' dtype or, with
    cfg.GRAD32, in float32 as accumulated. With cfg.CHUNKS the outputs are column slices
    starting at their first columns (else at 0)."""
    assert not cfg.GRAD32 or cfg.DT in ("f16", "bf16"), "the word kinds store floats anyway"
    chunked = bool(cfg.CHUNKS)
    store = ops.store_floats if cfg.GRAD32 else ops.store_o
    for half, row in enumerate(rows):
        s(f"if {row} < {limit}:")
        with s.block():
            s(f"ru = U({row})")
            if not chunked:
                s(f"cbase = t * {U(2)}")
            ra, rb = (0, 1) if half == 0 else (2, 3)
            for acc, tiles, factor, out, dim, col0 in outputs:
                if chunked:   # each output's slice starts at its own column
                    s(f"cbase = {col0} + t * {U(2)}")
                for n in range(tiles):
                    store(s, n, ra, rb, half, acc=acc, factor=factor, out=out, dim=dim)


def _ds(p, dp, delta, grad=None):
    """Source of dS = P (dP - delta), exactly 0 where P is: a masked pair's dP may hold a NaN or
    inf of a V row it never reads (0 * NaN would carry it into dQ and dK). With modifications,
    times ``grad``, the derivative of the modified score in the scaled one."""
    return f"ZERO if {p} == ZERO else {p} * ({dp} - {delta})" + (f" * {grad}" if grad else "")


def _emit_column_slice(s, ops, cfg, names):
    """Emit, for a CHUNKS variant, the first column (c0<x>) and shared-memory word (cw<x>) of
    this block's slice of each (x, head dim) in ``names``: gridDim.z slices of the gradients'
    columns, so each block holds 1 / CHUNKS of them in registers."""
    if not cfg.CHUNKS:
        return
    for x, dim in names:
        s(f"c0{x} = U(cuda.blockIdx.z) * {U(dim // cfg.CHUNKS)}",
          f"cw{x} = c0{x} // {U(ops.per_word)}")


def _slice(cfg, kb, x):
    """The buffer prefix of a streamed tile read at this block's column slice ``x``."""
    return f"{kb}cw{x} + " if cfg.CHUNKS else kb


def _dot_products(s, ops, NN, acc, a, a_W, b, b_off, b_W, kb, steps):
    """Emit acc (NN n8 tiles) = A B^T for the warp's 16 rows of A (shared tile ``a``) against the
    streamed tile ``b`` (row-major, contracted over its columns), ``steps`` k-steps."""
    ops.zero_scores(s, NN, acc, acc + "c")
    ops.b_fragments(s, kb, b_off, b, b_W)
    for kk in range(steps):
        regs = [f"{a}a{r}" for r in range(4)]
        ops.load_a(s, kk, regs, a, a_W)
        for n in range(NN):
            ops.product(s, [f"{acc}_{n}_{r}" for r in range(4)], regs, ops.load_b(s, kk, n, b, b_W),
                        [f"{acc}c_{n}_{r}" for r in range(4)])
    ops.finish_scores(s, NN, acc, acc + "c")


def query_pass_layout(cfg):
    """(ops, QW, OW, KW, VW, do_off, kv_off, kv_words, total words) of the query pass: Q and dO
    of the block's rows, then two buffers of a K and a V tile (whose space holds the rows' O
    from kv_off on until delta is computed)."""
    ops, pitch = backward_layout(cfg)
    QW, OW = pitch(cfg.D), pitch(cfg.DV)
    KW, VW = pitch(cfg.D, True), pitch(cfg.DV)      # K is read both ways; V like the forward's K
    do_off = cfg.BR * QW
    kv_off = do_off + cfg.BR * OW
    kv_words = cfg.BC * (KW + VW)
    # O's rows borrow the K/V buffers (longer than them only for narrow tiles of wide rows)
    return ops, QW, OW, KW, VW, do_off, kv_off, kv_words, kv_off + max(2 * kv_words,
                                                                          cfg.BR * OW)


def key_pass_layout(cfg):
    """(ops, KW, VW, QW, OW, v_off, tiles_off, do_rel, lse_rel, delta_rel, tile_words, total
    words) of the key pass: K and V of the block's rows, then two buffers of a Q tile, a dO tile
    and the tile's lse (log2 units) and delta as floats."""
    ops, pitch = backward_layout(cfg)
    KW, VW = pitch(cfg.D), pitch(cfg.DV)             # the block's own K and V rows (A operands)
    QW, OW = pitch(cfg.D, True), pitch(cfg.DV, True)  # streamed Q, dO: read both ways
    v_off = cfg.BR * KW
    tiles_off = v_off + cfg.BR * VW
    do_rel = cfg.BC * QW
    lse_rel = do_rel + cfg.BC * OW
    delta_rel = lse_rel + cfg.BC
    tile_words = delta_rel + cfg.BC
    tile_words += -tile_words % (16 // ops.word_bytes)   # the next buffer 16-byte aligned
    total = tiles_off + 2 * tile_words
    if cfg.DQADD:   # the dS^T tiles (ds_tiles) follow
        DSW, buffers = _ds_shape(cfg)
        total += buffers * cfg.BR * DSW
    return (ops, KW, VW, QW, OW, v_off, tiles_off, do_rel, lse_rel, delta_rel, tile_words,
            total)


def _ds_shape(cfg):
    SUB = cfg.SUB or cfg.BC
    return SUB // 2 + 4, 2 if cfg.BC > SUB else 1


def ds_tiles(cfg):
    """(word offset, row pitch in words, count) of a DQADD key pass's shared dS^T tiles: BR key
    rows of SUB 16-bit queries (pitch SUB / 2 + 4 words: the quads' stores and ldmatrix's rows
    hit distinct banks), two when the staged tile has several sub-tiles, so a warp writes the
    next sub-tile's dS while others still read this one (one barrier a sub-tile; the tile loop's
    barriers separate the tiles)."""
    lay = key_pass_layout(cfg)
    DSW, buffers = _ds_shape(cfg)
    return lay[-1] - buffers * cfg.BR * DSW, DSW, buffers


def shared_bytes(cfg, kernel):
    """Dynamic shared memory of the "queries" or "keys" kernel of a config, in bytes."""
    lay = (query_pass_layout if kernel == "queries" else key_pass_layout)(cfg)
    return lay[0].word_bytes * lay[-1]


def query_pass_source(cfg):
    """Python source of the dQ kernel for one MmaConfig (BC: keys a tile)."""
    assert cfg.VEC, "the backward stages with cp.async"
    ops, QW, OW, KW, VW, do_off, kv_off, kv_words, _ = query_pass_layout(cfg)
    k_step = ops.k_step
    NN, ND = cfg.BC // 8, cfg.D // 8 // (cfg.CHUNKS or 1)   # ND: dQ's n8 tiles in this block
    window = bool(cfg.WINDOW)

    s = Source()
    s(f"def {KERNEL_NAMES['queries']}({ARGUMENTS['queries']}{SCALARS}"
      f"{', window_left, window_right' if window else ''}"
      f"{VARLEN_ARGUMENTS if cfg.VARLEN else ''}{mods.parameters(cfg.MODS)}"
      f"{dropout.parameters(cfg)}):")
    with s.block():
        emit_thread_indices(s, ops.float)
        s(f"qb = U(cuda.gridDim.x) - {U(1)} - U(cuda.blockIdx.x)",  # longest causal block first
          "bh = U(cuda.blockIdx.y)", "b = bh // U(H)", "h = bh % U(H)",
          "hk = kv_head(h, U(H), U(Hkv))", f"i0 = qb * {U(cfg.BR)}")
        if cfg.VARLEN:
            emit_sequence(s, "i0", "Nq_u")
        s(*(f"{x}h = {head_view(cfg, x, head, rows)}" for x, head, rows in (
            ("q", "h", "q"), ("k", "hk", "k"), ("v", "hk", "k"), ("do", "h", "q"),
            ("o", "h", "q"), ("dq", "h", "q")) if not cfg.VARLEN or x in ("q", "do", "o")),
          f"smem = cuda.shared.array(0, {ops.word})")
        _emit_column_slice(s, ops, cfg, (("q", cfg.D),))
        if cfg.MODS:
            emit_modified_scale(s, ops.float, cfg.MODS, "scale")
            s("hi = I(h)")
        dropout.emit_locals(s, cfg, ops.float)
        if not cfg.DQADD:
            _stage_rows(s, ops, "qh", cfg.BR, "i0", "Nq_u", cfg.D, "d_u", 0, QW, cfg.NT)
        _stage_rows(s, ops, "doh", cfg.BR, "i0", "Nq_u", cfg.DV, "dv_u", do_off, OW, cfg.NT)
        _stage_rows(s, ops, "oh", cfg.BR, "i0", "Nq_u", cfg.DV, "dv_u", kv_off, OW, cfg.NT)
        s("cp_async_commit()")
        emit_row_bounds(s, cfg.BR, window)
        if cfg.DQADD:   # the key pass adds dQ: this pass computes delta only
            ops.a_fragments(s, "do", do_off, OW)
            s("cp_async_wait_0()", "cuda.syncthreads()")
            _emit_delta(s, ops, cfg, do_off, kv_off, OW)
            return s.text()
        for half, row in ((0, "r0"), (1, "r1")):
            s(f"lse2_{half} = INF", f"if {row} < Nq:")
            with s.block():
                s(f"lse2_{half} = {_lse2(row_value(cfg, 'lse', 'h', row))}")
        ops.a_fragments(s, "q", 0, QW)
        ops.a_fragments(s, "do", do_off, OW)
        s("cp_async_wait_0()", "cuda.syncthreads()")
        _emit_delta(s, ops, cfg, do_off, kv_off, OW)
        s("cuda.syncthreads()  # the K/V buffers take O's place")
        ops.zero_scores(s, ND, "dq", "dqc")

        def stage_kv(j0u, buf):
            k_off = kv_off + buf * kv_words
            v_off = k_off + cfg.BC * KW
            emit_views_at_use(s, cfg, (("kh", "k", "hk", "k"), ("vh", "v", "hk", "k")))
            _stage_rows(s, ops, "kh", cfg.BC, j0u, "Nk_u", cfg.D, "d_u", k_off, KW, cfg.NT)
            _stage_rows(s, ops, "vh", cfg.BC, j0u, "Nk_u", cfg.DV, "dv_u", v_off, VW, cfg.NT)
            s("cp_async_commit()")
            return k_off, v_off

        with tile_loop(s, stage_kv, cfg.BC, kv_words, 1, kv_off, KW, window,
                       sparse=emit_block_row(s, cfg.MODS)) as (k_off, v_off, kb):
            s(f"if {warp_sees_tile(cfg.BC, window)}:")
            with s.block():
                if cfg.MODS:
                    # dP first: each score's modification and its derivative are then used
                    # where they are made, never held across a product
                    _dot_products(s, ops, NN, "dp", "do", OW, "v", v_off, VW, kb,
                                  cfg.DV // k_step)
                    _emit_dropped_dp(s, cfg, NN)
                _dot_products(s, ops, NN, "s", "q", QW, "k", k_off, KW, kb, cfg.D // k_step)
                emit_score_mask(s, NN, cfg.BC, window)
                if cfg.MODS:
                    s("cm = j0 + I(t) * 2")
                    for n in range(NN):
                        for r in range(4):
                            name = f"s_{n}_{r}"
                            mods.emit_apply_grad(s, cfg.MODS, name, "gm", "r0" if r < 2 else "r1",
                                                 f"cm + {n * 8 + r % 2}", guard="{i} < Nq")
                            s(f"pm = ex2({name} * scale_log2 - lse2_{r // 2})",
                              f"{name} = {_ds('pm', f'dp_{n}_{r}', f'delta{r // 2}', 'gm')}")
                else:
                    for n in range(NN):
                        s(*(f"s_{n}_{r} = ex2(s_{n}_{r} * scale_log2 - lse2_{r // 2})"
                            for r in range(4)))
                    _dot_products(s, ops, NN, "dp", "do", OW, "v", v_off, VW, kb,
                                  cfg.DV // k_step)
                    _emit_dropped_dp(s, cfg, NN)
                    for n in range(NN):
                        s(*(f"s_{n}_{r} = {_ds(f's_{n}_{r}', f'dp_{n}_{r}', f'delta{r // 2}')}"
                            for r in range(4)))
                ops.accumulate_pv(s, _slice(cfg, kb, "q"), k_off, ND, cfg.BC // k_step, p="s",
                                  acc="dq", name="kt", W=KW, rescaled=False)
        emit_views_at_use(s, cfg, (("dqh", "dq", "h", "q"),))
        _store_rows(s, ops, cfg, ("r0", "r1"), "Nq", [("dq", ND, "scale", "dqh", "d_u", "c0q")])
    return s.text()


def _emit_dropped_dp(s, cfg, NN):
    """Emit, with dropout, Z dP in the query pass's dP registers (dS = P (Z dP - delta))."""
    if cfg.DROP:
        s("dj = j0 + I(t) * 2")
        dropout.emit_rows(s, NN, "dp", cfg.BC)


def key_pass_source(cfg):
    """Python source of the dK / dV kernel for one MmaConfig (BR = 16 NW keys a block; BC:
    queries a streamed tile)."""
    assert cfg.VEC, "the backward stages with cp.async"
    window = bool(cfg.WINDOW)
    (ops, KW, VW, QW, OW, v_off, tiles_off, do_rel, lse_rel, delta_rel, tile_words,
     _) = key_pass_layout(cfg)
    ND, NVN = cfg.D // 8 // (cfg.CHUNKS or 1), cfg.DV // 8 // (cfg.CHUNKS or 1)  # this block's
    SUB = cfg.SUB or cfg.BC
    assert cfg.BC % SUB == 0 and SUB % ops.k_step == 0
    # dQ adds read the block's whole K rows and 16-bit dS pairs (gradients.dq_adds)
    assert not cfg.DQADD or (cfg.DT in ("f16", "bf16") and not cfg.CHUNKS)

    s = Source()
    s(f"def {KERNEL_NAMES['keys']}({ARGUMENTS['keys']}{SCALARS}"
      f"{', window_left, window_right' if window else ''}"
      f"{VARLEN_ARGUMENTS if cfg.VARLEN else ''}{mods.parameters(cfg.MODS)}"
      f"{dropout.parameters(cfg)}{', dbias' if cfg.DBIAS else ''}"
      f"{arg_grad_parameters(cfg)}{', dqacc' if cfg.DQADD else ''}):")
    with s.block():
        emit_thread_indices(s, ops.float)
        s("bh = U(cuda.blockIdx.y)", "b = bh // U(Hkv)", "hk = bh % U(Hkv)",
          "group = U(H // Hkv)",
          f"j0k = U(cuda.blockIdx.x) * {U(cfg.BR)}")
        if cfg.VARLEN:
            emit_sequence(s, "j0k", "Nk_u")
        # (made here even with VARLEN: reloading the offsets for dK / dV's views after the loop,
        # as the other passes do, made ptxas spill more at d128, not less: bench/NOTES.md)
        s(*(f"{x}h = {head_view(cfg, x, 'hk', 'k')}" for x in ("k", "v", "dk", "dv")),
          f"smem = cuda.shared.array(0, {ops.word})",
          f"smemf = cuda.shared.array(0, {ops.float})")
        _emit_column_slice(s, ops, cfg, (("k", cfg.D), ("v", cfg.DV)))
        if cfg.MODS:
            emit_modified_scale(s, ops.float, cfg.MODS, "scale")
        dropout.emit_locals(s, cfg, ops.float)
        _stage_rows(s, ops, "kh", cfg.BR, "j0k", "Nk_u", cfg.D, "d_u", 0, KW, cfg.NT)
        _stage_rows(s, ops, "vh", cfg.BR, "j0k", "Nk_u", cfg.DV, "dv_u", v_off, VW, cfg.NT)
        s("cp_async_commit()")
        # the warp's keys; the queries that see any key of the block: a row's key end and
        # first key grow with the row (mask.py), so from the first row whose end passes the
        # block's first key to the last row whose first key is at most the block's last key
        s("j0ks = I(j0k)", "wk = j0ks + I(warp) * 16", "kr0 = wk + I(g)", "kr1 = kr0 + 8",
          "q_first = min(Nq, max(0, j0ks - causal_offset)) if causal else 0")
        dropout.emit_key_shifts(s, cfg)
        if window:
            emit_window_queries(s, cfg.BR)
        ops.a_fragments(s, "k", 0, KW)
        ops.a_fragments(s, "v", v_off, VW)
        s("cp_async_wait_0()", "cuda.syncthreads()")
        ops.zero_scores(s, ND, "dk", "dkc")
        ops.zero_scores(s, NVN, "dv", "dvc")

        def stage_queries(i0u, buf):
            off = tiles_off + buf * tile_words
            _stage_rows(s, ops, "qh", cfg.BC, i0u, "Nq_u", cfg.D, "d_u", off, QW, cfg.NT)
            _stage_rows(s, ops, "doh", cfg.BC, i0u, "Nq_u", cfg.DV, "dv_u", off + do_rel, OW,
                        cfg.NT)
            s("cp_async_commit()")
            s(f"for idx in range(tid, {U(cfg.BC)}, {U(cfg.NT)}):")
            with s.block():
                s(f"i = {i0u} + idx", "lse2 = INF", "dlt = ZERO", "if i < Nq_u:")
                with s.block():
                    s(f"lse2 = {_lse2('lseh[i]')}", "dlt = deltah[i]")
                s(f"smemf[{U(off + lse_rel)} + idx] = lse2",
                  f"smemf[{U(off + delta_rel)} + idx] = dlt")
            return off, off + do_rel

        s("for hq in range(group):")
        with s.block():
            # (made a head, not a tile, even with VARLEN: made in each tile's staging, as the
            # query pass's K / V are, the d128 key pass spilled 88-112 bytes against 64)
            s("h = hk * group + hq",
              *(f"{x}h = {head_view(cfg, x, 'h')}" for x in ("q", "do", "lse", "delta") +
                (("dqacc",) if cfg.DQADD else ())),
              "cuda.syncthreads()  # the previous head's last tile is no longer read")
            if cfg.MODS:
                s("hi = I(h)")
            sparse = None
            if mods.sparse(cfg.MODS):   # the query blocks listed for this key block column
                s("bm_col = I(j0k) // bm_bk", "bm_list = bm_q_blocks[b, h, bm_col]")
                sparse = ("bm_list", "bm_q_count[b, h, bm_col]", "bm_bq")
            if cfg.DBIAS == "rows":
                s(f"bsum0 = {_row_sum_type(cfg.DT)}(0)", f"bsum1 = {_row_sum_type(cfg.DT)}(0)")
            with tile_loop(s, stage_queries, cfg.BC, tile_words, 1, tiles_off, QW, True,
                           start="q_first", end="q_end" if window else "Nq",
                           sparse=sparse) as (q_off, do_off, kb):
                if SUB == cfg.BC:
                    s("js = j0")
                    _key_pass_products(s, ops, cfg, SUB, kb, q_off, do_off, q_off + lse_rel,
                                       q_off + delta_rel, KW, VW, QW, OW)
                else:
                    # the staged tile SUB queries at a time (unrolled: constant offsets; a
                    # run-time loop's offsets spilled on sm_90): S^T, dP^T of SUB columns in
                    # registers, the barriers and staging amortized over BC rows
                    for sub in range(cfg.BC // SUB):
                        s(f"js = j0 + {sub * SUB}")
                        _key_pass_products(s, ops, cfg, SUB, kb, q_off + sub * SUB * QW,
                                           do_off + sub * SUB * OW, q_off + lse_rel + sub * SUB,
                                           q_off + delta_rel + sub * SUB, KW, VW, QW, OW,
                                           ds_buffer=sub % 2)
            if cfg.DBIAS == "rows":
                _flush_bias_rows(s, cfg)
        _store_rows(s, ops, cfg, ("kr0", "kr1"), "Nk",
                    [("dk", ND, "scale", "dkh", "d_u", "c0k"),
                     ("dv", NVN, "ONE", "dvh", "dv_u", "c0v")])
    return s.text()


def emit_window_queries(s, BR):
    """Emit, for a key pass whose block holds the BR keys from j0ks, the window's clip of the
    queries that see any of them: q_first past those whose right edge ends before the block,
    q_end (exclusive) before those whose left edge starts after it."""
    s("if window_right >= 0:")
    with s.block():
        s("q_first = min(Nq, max(q_first, j0ks - causal_offset - window_right))")
    s(f"q_end = Nq if window_left < 0 else max(0, min(Nq, min(Nk, j0ks + {BR}) - 1 "
      f"- causal_offset + window_left + 1))")


def _per_query(s, NN, reads, emit):
    """Emit, for each query column of the transposed S fragments (NN n8 tiles; the thread's
    columns 2t, 2t + 1 of each), the read of each float ``name`` of ``reads`` ((name, source of
    its offset), ...) from shared memory at that offset + column, then ``emit(n, r, c)`` for
    both rows' registers r of that column (the column's offset c in the thread's columns of
    tile n)."""
    for n in range(NN):
        for c in (0, 1):
            s(*(f"{name} = smemf[{at} + qc + {U(8 * n + c)}]" for name, at in reads))
            for r in (c, 2 + c):
                emit(n, r, c)


def emit_transposed_mask(s, NN, window=False):
    """Emit -inf for the transposed scores (S^T fragments, NN n8 tiles of queries from js; the
    thread's key rows kr0, kr1 of the warp's 16 from wk) of pairs a query does not see: keys
    at or past its key end (causal, Nk), outside its window, and every key of a query past Nq
    (a padded query column must give P = 0 even where a K row holds a NaN no real query sees).
    Only where the tile needs it: it runs past Nq, or its first query misses the warp's last
    key (or, with a window, its last query starts after the warp's first key)."""
    last = f"min(Nq - 1, js + {8 * NN - 1})"
    masks = f"js + {8 * NN} > Nq or wk + 15 >= {row_end('js', window)}" + (
        f" or wk < {first_key(last)}" if window else "")
    s(f"if {masks}:")
    with s.block():
        for n in range(NN):
            for c in (0, 1):
                col = f"js + I(t) * 2 + {8 * n + c}"
                s(f"qe = {row_end(col, window)} if {col} < Nq else 0")
                if window:
                    s(f"qf = {first_key(col)}")
                for r, kr in ((c, "kr0"), (2 + c, "kr1")):
                    s(f"if {kr} >= qe or {kr} < qf:" if window else f"if {kr} >= qe:")
                    with s.block():
                        s(f"s_{n}_{r} = NEG_INF")


def _key_pass_products(s, ops, cfg, SUB, kb, q_off, do_off, lse_off, delta_off, KW, VW, QW, OW,
                       ds_buffer=0):
    """Emit one warp's work on SUB streamed queries starting at js (in the buffer at ``kb``:
    their Q rows at word q_off, dO rows at do_off, lse and delta floats at lse_off, delta_off):
    S^T = K Q^T, the causal mask on the transposed fragments, P^T from lse, dV += P^T dO,
    dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q; with DQADD then the block's
    dQ adds for these queries (_emit_dq_adds, dS^T through shared tile ``ds_buffer``)."""
    k_step, NN = ops.k_step, SUB // 8
    ND, NVN = cfg.D // 8 // (cfg.CHUNKS or 1), cfg.DV // 8 // (cfg.CHUNKS or 1)
    # The warp works if the last of these queries sees past its first key (and, with a
    # window, the first of them starts at or before its last key); it masks if the first
    # misses its last key (or the last starts after its first). Ends and first keys grow with
    # the row (mask.py).
    window = bool(cfg.WINDOW)
    last = f"min(Nq - 1, js + {SUB - 1})"
    sees = f"wk < {row_end(last, window)}" + (
        f" and wk + 15 >= {first_key('js')}" if window else "")
    s(f"if {sees}:")
    with s.block():
        _dot_products(s, ops, NN, "s", "k", KW, "q", q_off, QW, kb, cfg.D // k_step)
        # (and where the tile runs past Nq: a padded query column must give P = 0 even when
        # a K row holds a NaN, which no real query sees)
        emit_transposed_mask(s, NN, window)
        s(f"qc = t * {U(2)}")
        if cfg.MODS or cfg.DROP:
            _key_pass_elementwise(s, ops, cfg, NN, kb, lse_off, delta_off, do_off, OW, VW)
            ds = "dp"   # P^T stays in the S registers for dV, dS^T goes to dP's
        else:
            _per_query(s, NN, [("lse2", f"{kb}{U(lse_off)}")],
                       lambda n, r, c: s(f"s_{n}_{r} = ex2(s_{n}_{r} * scale_log2 - lse2)"))
            ops.accumulate_pv(s, _slice(cfg, kb, "v"), do_off, NVN, SUB // k_step, p="s",
                              acc="dv", name="dot", W=OW, rescaled=False)
            _dot_products(s, ops, NN, "dp", "v", VW, "do", do_off, OW, kb, cfg.DV // k_step)
            _per_query(s, NN, [("dlt", f"{kb}{U(delta_off)}")],
                       lambda n, r, c: s(f"s_{n}_{r} = "
                                         f"{_ds(f's_{n}_{r}', f'dp_{n}_{r}', 'dlt')}"))
            ds = "s"
        if cfg.DQADD:
            _emit_ds_store(s, ops, cfg, NN, ds, ds_buffer)
        ops.accumulate_pv(s, _slice(cfg, kb, "k"), q_off, ND, SUB // k_step, p=ds, acc="dk",
                          name="qt", W=QW, rescaled=False)
    if cfg.DQADD:
        s("else:")
        with s.block():   # a warp that sees none of these queries: its keys' dS are 0
            _emit_ds_store(s, ops, cfg, NN, None, ds_buffer)
        s("cuda.syncthreads()  # the block's dS^T tile is written")
        _emit_dq_adds(s, ops, cfg, SUB, KW, ds_buffer)


def _emit_ds_store(s, ops, cfg, NN, ds, buffer):
    """Emit the store of the warp's dS^T (C fragments ``ds``, NN n8 tiles of queries; None:
    zeros) into shared dS^T tile ``buffer`` (ds_tiles): the thread's two adjacent queries of key
    rows g and g + 8 as one 16-bit pair each, rounded as the dK product rounds them."""
    off, DSW, _ = ds_tiles(cfg)
    s(f"dsw = {U(off + buffer * cfg.BR * DSW)} + (warp * {U(16)} + g) * {U(DSW)} + t")
    for n in range(NN):
        lo, hi = (f"{ops.pack}({ds}_{n}_0, {ds}_{n}_1)", f"{ops.pack}({ds}_{n}_2, {ds}_{n}_3)"
                  ) if ds else ("uint32(0)", "uint32(0)")
        s(f"smem[dsw + {U(4 * n)}] = {lo}", f"smem[dsw + {U(8 * DSW + 4 * n)}] = {hi}")


def dq_work(cfg):
    """(pairs, items, per_warp) of a DQADD key pass's dQ product for one sub-tile: its SUB x D
    tile is cut into items of 16 queries x (16 x pairs) columns (2 x pairs n8 accumulator
    tiles; up to 4 pairs, so one A fragment of dS serves up to 8 mma), warp w taking items w,
    w + NW, ... (``per_warp`` of them)."""
    SUB = cfg.SUB or cfg.BC
    groups, column_pairs = SUB // 16, cfg.D // 16
    share = max(1, groups * column_pairs // cfg.NW)
    pairs = max(p for p in range(1, min(4, share) + 1) if column_pairs % p == 0)
    items = groups * (column_pairs // pairs)
    return pairs, items, -(-items // cfg.NW)


def _emit_dq_adds(s, ops, cfg, SUB, KW, buffer):
    """Emit the block's dQ adds for SUB queries from js: dQ = scale dS K over its BR keys, dS
    read from shared dS^T tile ``buffer`` with ldmatrix.trans (the A fragment of 16 queries x 16
    keys), K from the block's staged rows as the query pass reads its K (ldmatrix.trans, B
    contracted over keys), added into the float32 accumulator by four-float reductions."""
    off, DSW, _ = ds_tiles(cfg)
    off += buffer * cfg.BR * DSW
    pairs, items, per_warp = dq_work(cfg)
    chunks = cfg.D // 16 // pairs     # items of one 16-query group
    for it in range(per_warp):
        s(f"item = warp + {U(it * cfg.NW)}")
        guarded = (it + 1) * cfg.NW > items
        if guarded:
            s(f"if item < {U(items)}:")
        with s.block() if guarded else contextlib.nullcontext():
            s(f"mg = item // {U(chunks)}", f"pc = item % {U(chunks)}")
            ops.zero_scores(s, 2 * pairs, "dqa")
            s(f"dslm = shared_addr(smem, {U(off)} + ((lane // {U(16)}) * {U(8)} + lane % {U(8)})"
              f" * {U(DSW)} + ((lane // {U(8)}) % {U(2)}) * {U(4)} + mg * {U(8)})",
              f"kdlm = shared_addr(smem, (((lane // {U(8)}) % {U(2)}) * {U(8)} + lane % {U(8)})"
              f" * {U(KW)} + (lane // {U(16)}) * {U(4)} + pc * {U(8 * pairs)})")
            for kk in range(cfg.BR // 16):
                s(f"da0, da1, da2, da3 = ldmatrix_x4_trans(dslm + {U(4 * 16 * kk * DSW)})")
                for p in range(pairs):
                    s(f"kd0, kd1, kd2, kd3 = ldmatrix_x4_trans(kdlm + "
                      f"{U(4 * (16 * kk * KW + 8 * p))})")
                    for n, b in ((2 * p, ["kd0", "kd1"]), (2 * p + 1, ["kd2", "kd3"])):
                        ops.product(s, [f"dqa_{n}_{r}" for r in range(4)],
                                    ["da0", "da1", "da2", "da3"], b)
            # lanes t, t ^ 1 swap halves so that an even lane holds four adjacent columns of
            # row g and an odd one those of row g + 8: one four-float reduction each, a warp's
            # 16 rows x 32 bytes (two-float ones from the C layout ran at ~0.7x the rate)
            emit_dq_reductions(s, "dqa", 2 * pairs, "js + I(mg) * 16", f"pc * {U(16 * pairs)}")


def emit_dq_reductions(s, acc, tiles, first_row, first_col):
    """Emit the adds of a warp's dQ fragments (``acc``, ``tiles`` n8 tiles of the C layout: rows
    first_row + g and + 8, columns first_col + 8 n + 2t, + 1), times scale, into the float32
    accumulator dqacch (rows below Nq). Lanes t, t ^ 1 swap halves so that an even lane holds
    four adjacent columns of row g and an odd one those of row g + 8: one four-float reduction
    each, a warp's 16 rows x 32 bytes (two-float ones from the C layout ran at ~0.7x the
    rate)."""
    s("odd = t % U(2)", f"qrow = {first_row} + I(g) + I(odd) * 8",
      f"qcol = {first_col} + (t - odd) * {U(2)}")
    for n in range(tiles):
        c = [f"{acc}_{n}_{r}" for r in range(4)]
        s(f"x0 = cuda.shfl_xor_sync(FULL, {c[0]} if odd else {c[2]}, 1)",
          f"x1 = cuda.shfl_xor_sync(FULL, {c[1]} if odd else {c[3]}, 1)",
          f"{', '.join(c)} = (x0, x1, {c[2]}, {c[3]}) if odd else ({c[0]}, {c[1]}, x0, x1)")
    s("if qrow < Nq:")
    with s.block():
        for n in range(tiles):
            s(f"red_add_f32x4(global_addr2(dqacch, qrow, qcol + {U(8 * n)}), "
              + ", ".join(f"{acc}_{n}_{r} * scale" for r in range(4)) + ")")


def _key_pass_elementwise(s, ops, cfg, NN, kb, lse_off, delta_off, do_off, OW, VW):
    """The key pass's scores with modifications or dropout: dP^T = V dO^T first, then per
    score its modification and derivative, P^T (kept in the S registers, added into dV here;
    with dropout P^T Z) and dS^T = P^T (Z dP^T - delta) (left in dP's registers), so no
    derivative or keep is held across a product."""
    NVN = cfg.DV // 8 // (cfg.CHUNKS or 1)
    SUB = NN * 8
    _dot_products(s, ops, NN, "dp", "v", VW, "do", do_off, OW, kb, cfg.DV // ops.k_step)
    s("qcol = js + I(t) * 2")
    _per_query(s, NN, [("lse2", f"{kb}{U(lse_off)}"), ("dlt", f"{kb}{U(delta_off)}")],
               lambda n, r, c: emit_modified_score(s, cfg, n, r, c, paired=SUB % 16 == 0))
    ops.accumulate_pv(s, _slice(cfg, kb, "v"), do_off, NVN, SUB // ops.k_step, p="s",
                      acc="dv", name="dot", W=OW, rescaled=False)


def emit_modified_score(s, cfg, n, r, c, paired=True):
    """Emit, for the transposed score s_n_r (query qcol + 8 n + c, key kr0 / kr1; lse2 and dlt
    its query's) with dP^T in dp_n_r: its modification and derivative, P^T (left in s_n_r)
    and dS^T = P^T (Z dP^T - delta) (in dp_n_r); with dropout (``paired``: the keep bits drawn
    for two columns at once) P^T Z for dV once dS^T has read P^T. cuda.mma's key pass and
    cuda.wgmma's (whose config sets no DROP, DBIAS or MARGS) both emit it."""
    name = f"s_{n}_{r}"
    query, key = f"qcol + {8 * n + c}", "kr0" if r < 2 else "kr1"
    if cfg.MODS:
        mods.emit_apply_grad(s, cfg.MODS, name, "gm", query, key,
                             bias_grad="gbias" if cfg.DBIAS else None,
                             arg_score="xa" if cfg.MARGS else None)
    s(f"{name} = ex2({name} * scale_log2 - lse2)")
    if cfg.DROP:   # Z dP^T first; P^T Z for dV once dS^T has read P^T
        dropout.emit_transposed(s, n, r, c, f"dp_{n}_{r}", paired=paired)
    if cfg.DBIAS or cfg.MARGS:
        _emit_modification_grads(s, cfg, name, f"dp_{n}_{r}", query, key)
    else:
        s(f"dp_{n}_{r} = {_ds(name, f'dp_{n}_{r}', 'dlt', 'gm' if cfg.MODS else None)}")
    if cfg.DROP:
        dropout.emit_transposed(s, n, r, c, name, paired=paired, draw=False)


#: DBIAS modes: "store" (a full bias: one write an element), "f32" / "f64" (a broadcast one:
#: atomic adds of that type), "rows" (a bias shared by the queries: each thread sums its two
#: keys' column in registers over the head's query tiles, then the four lanes holding a key add
#: their sum atomically into float64, once a head)
BIAS_MODES = ("store", "f32", "f64", "rows")


def bias_accumulator_type(mode, DT):
    """The accumulator's float type name for a DBIAS mode and operand kind."""
    return "float64" if DT == "f64" or mode in ("f64", "rows") else "float32"


def _row_sum_type(DT):
    """The registers' type of DBIAS "rows": float32 for 16-bit kinds (two float64 sums pushed
    the sm_90 float16 d64 key pass to 8 bytes of spill; the rule's 16-bit baseline stores dS in
    16 bits), float64 for float32 and float64 inputs."""
    return "float32" if DT in ("f16", "bf16") else "float64"


def arg_grad_parameters(cfg):
    """The MARGS key pass's extra parameters: darg<k>, the float64 accumulator of each trained
    mod_args array, and dargbad, a one-int flag set by an index outside one."""
    if not cfg.MARGS:
        return ""
    count = len(mods.arg_grad_functions(cfg.MARGS))
    return "".join(f", darg{k}" for k in range(count)) + ", dargbad"


def _emit_modification_grads(s, cfg, p, dp, query, key):
    """Emit, for a DBIAS / MARGS key pass, dS^T through the modifications into ``dp``, then the
    shares of P (dP - delta) that go to mod_args (mods.emit_arg_grads) and to attn_bias
    (_emit_bias_grad). Zeros are not added (the accumulators start at zero; masked and padding
    pairs have P = 0), nor pairs past Nq or Nk; with column slices (CHUNKS) only slice 0 adds,
    as every slice recomputes the same dS."""
    s(f"dsb = {_ds(p, dp, 'dlt')}", f"{dp} = dsb * gm")
    if cfg.MARGS:
        s(f"if dsb != ZERO and {query} < Nq and {key} < Nk" +
          (" and cuda.blockIdx.z == 0:" if cfg.CHUNKS else ":"))
        with s.block():
            mods.emit_arg_grads(s, cfg.MODS, cfg.MARGS, "dsb", "xa", query, key)
    if cfg.DBIAS:
        _emit_bias_grad(s, cfg, query, key)


def _emit_bias_grad(s, cfg, query, key):
    """Emit, for a DBIAS key pass, the bias's share of dS, dsb * gbias, atomically added into
    dbias[b, h, query, key] (a view broadcast like the bias: pairs that share an element sum
    there; a full bias's element has one pair, so DBIAS "store" writes it)."""
    if cfg.DBIAS == "rows":   # summed over the queries here, added once a head (_flush_bias_rows)
        s(f"bsum{0 if key == 'kr0' else 1} += {_row_sum_type(cfg.DT)}(dsb * gbias)")
        return
    value = f"{bias_accumulator_type(cfg.DBIAS, cfg.DT)}(dsb * gbias)"
    s("if dsb != ZERO" + (" and cuda.blockIdx.z == 0:" if cfg.CHUNKS else ":"))
    with s.block():
        at = f"(b, h, U({query}), U({key}))"
        if cfg.DBIAS == "store":   # a full bias: this thread is the element's only writer
            s(f"dbias[{at}] = {value}")
        else:
            s(f"cuda.atomic.add(dbias, {at}, {value})")


def _flush_bias_rows(s, cfg):
    """Emit, for DBIAS "rows" after a head's query tiles, the sum of each key's column over the
    four lanes (t) that hold it, added by lane t = 0 into dbias[b, h, 0, key] (slice 0 only
    with CHUNKS); the sums restart for the next head."""
    for n in (0, 1):
        s(f"bsum{n} += cuda.shfl_xor_sync(FULL, bsum{n}, 1)",
          f"bsum{n} += cuda.shfl_xor_sync(FULL, bsum{n}, 2)")
    s("if t == 0" + (" and cuda.blockIdx.z == 0:" if cfg.CHUNKS else ":"))
    with s.block():
        for n in (0, 1):
            s(f"if bsum{n} != 0 and kr{n} < Nk:")
            with s.block():
                s(f"cuda.atomic.add(dbias, (b, h, U(0), U(kr{n})), float64(bsum{n}))")
    s(f"bsum0 = {_row_sum_type(cfg.DT)}(0)", f"bsum1 = {_row_sum_type(cfg.DT)}(0)")


SOURCES = {"queries": query_pass_source, "keys": key_pass_source}


def _namespace(cfg):
    """The forward's names, and the two constants the backward adds."""
    import numpy as np
    from .forward import _namespace as forward_namespace
    ns = forward_namespace(cfg)
    real = np.float64 if cfg.DT == "f64" else np.float32
    ns.update({"INF": real(np.inf), "LOG2E": real(np.log2(np.e))})
    return ns


def _dq_adds_namespace(cfg):
    """The four-float reduction a DQADD key pass calls (bound apart from _namespace, whose
    source is part of every backward variant's identity: the shipped two-pass PTX keeps its
    keys)."""
    from .. import ptx_reduce
    return {"red_add_f32x4": ptx_reduce.red_add_f32x4}


def _make(kernel, **config):
    cfg = MmaConfig(**config)
    ns = namespace_with_mods(cfg, _namespace)
    if cfg.DQADD:
        ns.update(_dq_adds_namespace(cfg))
    return define(SOURCES[kernel](cfg), f"numflash.cuda.mma backward {kernel}", cfg, ns,
                  KERNEL_NAMES[kernel])


def make_query_kernel(**config):
    """The dQ kernel for one config (numba compiles it; see launch.py)."""
    return _make("queries", **config)


def make_key_kernel(**config):
    """The dK / dV kernel for one config."""
    return _make("keys", **config)


def _identity(kernel, **config):
    """What decides a backward variant's PTX: its generated source and the code binding its
    names (forward.source_identity; the forward's own source does not enter)."""
    from .forward import source_identity
    from .. import ptx_reduce
    cfg = MmaConfig(**config)
    return source_identity(SOURCES[kernel](cfg), (_namespace,) + (
        mods.identity_functions(cfg.MODS, bool(cfg.DBIAS or cfg.MARGS)) if cfg.MODS else ()) +
        (mods.arg_grad_identity_functions() if cfg.MARGS else ()) +
        dropout.identity_functions(cfg) + (
        (_dq_adds_namespace, ptx_reduce._make_red_add_f32x4) if cfg.DQADD else ()))


def _cacheable(**config):
    return mods.cacheable(config.get("MODS", ""), config.get("MARGS", ""))


make_query_kernel.code_identity = lambda **config: _identity("queries", **config)
make_key_kernel.code_identity = lambda **config: _identity("keys", **config)
make_query_kernel.cacheable = make_key_kernel.cacheable = _cacheable
