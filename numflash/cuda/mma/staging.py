"""Moving tiles from global into shared memory: 16-byte ``cp.async`` row copies, the K/V tile
loop (double-buffered with cp.async, or staged synchronously between two barriers), and the wait
for the Q tile (then read into registers when Q is held there).

Scalar staging (a strided last axis, odd head dims, misaligned views) belongs to the operand kind
(operands.py): how elements become shared-memory words is what the kinds differ in.
"""
import contextlib

from .emit import U


def paged_row(page):
    """``row_map`` for emit_cp_async_rows reading a paged cache of ``page`` rows a page (a power
    of two): logical row r of batch entry b is row r % page of page block_table[b, r / page] in
    the view of all pages' rows."""
    shift = page.bit_length() - 1
    return lambda r: (f"(U(block_table[b, {r} >> {U(shift)}]) << {U(shift)}) + "
                      f"({r} & {U(page - 1)})")


def emit_cp_async_rows(s, src, rows, row, first, limit, width, dim, off, W, chunk, per_word,
                       NT, row_map=None):
    """Emit the 16-byte cp.async copy of rows x width elements of ``src`` (a 2-D global view)
    into shared rows of W words at word offset ``off``: ``chunk`` elements per 16 bytes,
    ``per_word`` elements per shared word. Rows at or past ``limit`` and columns at or past
    ``dim`` are zero-filled (cp.async's src-size 0), so padding needs no second pass.
    ``row_map``: the source row of a logical row (paged_row); only rows below ``limit`` are
    mapped."""
    col = "c" if per_word == 1 else f"c // {U(per_word)}"
    at = row_map(row) if row_map else row
    s(f"for idx in range(tid, {U(rows * width // chunk)}, {U(NT)}):")
    with s.block():
        s(f"r = idx // {U(width // chunk)}",
          f"c = (idx % {U(width // chunk)}) * {U(chunk)}",
          f"{row} = {first} + r",
          f"n = {U(16)} if {row} < {limit} and c < {dim} else {U(0)}",
          f"src = global_addr2({src}, {at} if {row} < {limit} else {U(0)}, "
          f"c if c < {dim} else {U(0)})",
          f"cp_async_16(shared_addr(smem, {U(off)} + r * {U(W)} + {col}), src, n)")


def emit_split_range(s, BC, window):
    """Emit split_first / split_end, the keys of this block's share of its key range when the
    range is split over gridDim.z blocks (split-KV, MmaConfig.SPLIT): the range's tiles (from
    the window's first one) dealt out in runs of equal length, so every share starts on a tile
    and only the range's own ends need masking. A share past the range is empty."""
    s(f"split_t0 = block_first // {BC}" if window else "split_t0 = I(0)",
      f"split_tiles = max(0, (block_keys - split_t0 * {BC} + {BC - 1}) // {BC})",
      "split_n = I(cuda.gridDim.z)",
      "split_per = (split_tiles + split_n - 1) // split_n",
      f"split_first = (split_t0 + I(cuda.blockIdx.z) * split_per) * {BC}",
      f"split_end = min(block_keys, split_first + split_per * {BC})")


def emit_window_tiles(s, BC, start, end):
    """Emit the window's tile range, t_first (the tile holding row ``start``) and ntiles (up to
    row ``end``), and return the source of iteration it's first row."""
    s(f"t_first = {start} // {BC}",
      f"ntiles = max(0, ({end} - t_first * {BC} + {BC - 1}) // {BC})")
    return f"(t_first + it) * {BC}"


@contextlib.contextmanager
def tile_loop(s, stage_kv, BC, kv_words, VEC, KV_OFF, KW, window=False, start="block_first",
              end="block_keys", sparse=None, shares=False):
    """Emit the K/V tile loop's head and enter its body, yielding the word offsets of the tile
    being read (k_off, v_off) and the source prefix of its buffer (kb): VEC double-buffers with
    cp.async; otherwise each tile is staged synchronously between two barriers. The loop visits
    the tiles from 0 (with a window: from the one holding row ``start``) up to row ``end`` of the
    streamed array (the keys; the backward's key pass streams the queries). j0 is the first row
    of the tile in the body.

    ``sparse``: a block mask's (list, count, block): the source of the 1-D view of this block
    row's (or column's) entries (block index * 2 + 1 if FULL, ascending; numflash.block_mask),
    of their number, and of the blocks' size along the streamed axis. The loop then visits the
    BC-row tiles of the listed blocks between ``start`` and ``end`` only, and the body has
    ``tile_full`` (the tile lies in a FULL block). ``shares``: split-KV over grid z deals those
    blocks out (_emit_sparse_range), so a block is never cut between two shares."""
    if sparse and VEC:
        _emit_sparse_double_buffered_loop(s, stage_kv, BC, kv_words, sparse,
                                          start if window else None, end, shares)
    elif sparse:
        _emit_sparse_range(s, BC, start if window else None, end, *sparse, shares=shares)
        s("for it in range(ntiles):")
    elif window:
        first = emit_window_tiles(s, BC, start, end)
    else:
        s(f"ntiles = ({end} + {BC - 1}) // {BC}")
        first = f"it * {BC}"
    if VEC and not sparse:
        _emit_double_buffered_loop(s, stage_kv, BC, kv_words, first,
                                   f"U(t_first * {BC})" if window else U(0))
    elif not VEC and not sparse:
        s("for it in range(ntiles):")
    with s.block():
        if VEC:
            yield KV_OFF, KV_OFF + BC * KW, "buf + "
            return
        if sparse:
            s(f"entry = I({sparse[0]}[e])")
            emit_sparse_tile(s, BC, sparse)
            _emit_next_tile(s)
        else:
            s(f"j0 = {first}")
        s("j0u = U(j0)")
        s("cuda.syncthreads()  # the previous tile is no longer read")
        k_off, v_off = stage_kv("j0u", 0)
        s("cuda.syncthreads()")
        yield k_off, v_off, ""


def _emit_next_tile(s, entry_next=None):
    """Emit the step to the next listed tile without a division (64-bit integer division costs
    dozens of instructions a tile): the next sub-tile of the block, or the first of the next
    block (whose entry becomes ``entry``; with ``entry_next``, the entry after it is read now,
    a block ahead of its use)."""
    s("sub += 1", "if sub == bm_reps:")
    with s.block():
        s("sub = I(0)", "e += 1")
        if entry_next:
            s("entry = entry_next", f"entry_next = {entry_next}")


def _emit_sparse_range(s, BC, start, end, lst, count, block, shares=False):
    """Emit the range [e_lo, e_hi) of a block mask's list ``lst`` (``count`` entries, ascending)
    whose blocks of ``block`` rows reach past row ``start`` (None: 0) and begin before row
    ``end``, and ntiles, the BC-row tiles in them. Each warp counts both ends at once, its lanes
    reading the entries 32 apart (a serial scan would wait on one dependent load per block).
    With ``shares`` (split-KV) the range's blocks are dealt out over grid z in runs of equal
    length, whole blocks each: a share past them is empty."""
    s(f"bm_reps = {block} // {BC}", "n_lo = I(0)", "n_hi = I(0)",
      f"for e in range(I(lane), I({count}), 32):")
    with s.block():
        s(f"block_row = I({lst}[e] // 2) * {block}")
        if start is not None:
            s(f"if block_row + {block} <= {start}:")
            with s.block():
                s("n_lo += 1")
        s(f"if block_row < {end}:")
        with s.block():
            s("n_hi += 1")
    for shift in (16, 8, 4, 2, 1):
        if start is not None:
            s(f"n_lo += cuda.shfl_xor_sync(FULL, n_lo, {shift})")
        s(f"n_hi += cuda.shfl_xor_sync(FULL, n_hi, {shift})")
    s("e_lo = n_lo", "e_hi = max(n_hi, e_lo)")
    if shares:
        s("split_n = I(cuda.gridDim.z)", "split_per = (e_hi - e_lo + split_n - 1) // split_n",
          "e_lo = min(e_hi, e_lo + I(cuda.blockIdx.z) * split_per)",
          "e_hi = min(e_hi, e_lo + split_per)")
    s("ntiles = (e_hi - e_lo) * bm_reps", "e = e_lo", "sub = I(0)")


def emit_sparse_tiles(s, BC, start, end, sparse, stage_first, shares=False):
    """Emit the walk over a block mask's listed tiles (``sparse``, as tile_loop takes it) whose
    blocks reach past row ``start`` (None: 0) and begin before row ``end``: the range, its
    tile count ntiles, and the first tile put in flight by ``stage_first(row source)``. Returns
    the source of the next tile's first row (after emit_sparse_tile's j0); the walk keeps the
    block (e) and sub-tile (sub) counters, and the entry of the block after the current one is
    read when the current one is entered (emit_next_sparse_tile), so the address of the next
    copy never waits on a global load. ``shares``: _emit_sparse_range's."""
    lst, count, block = sparse
    _emit_sparse_range(s, BC, start, end, lst, count, block, shares)
    s("entry = I(0)", "entry_next = I(0)", "if ntiles > 0:")
    with s.block():
        s(f"entry = {_entry_at(lst, 'e')}")
        stage_first(f"U((entry // 2) * {block})")
        s(f"entry_next = {_entry_at(lst, 'e + 1')}")
    return f"j0 + {BC} if sub + 1 < bm_reps else (entry_next // 2) * {block}"


def emit_sparse_tile(s, BC, sparse):
    """Emit the current listed tile's first row j0 and tile_full (whether it lies in a FULL
    block) from its block's entry (block index * 2 + 1 if FULL)."""
    s(f"j0 = (entry // 2) * {sparse[2]} + sub * {BC}", "tile_full = entry % 2 == 1")


def emit_next_sparse_tile(s, sparse):
    """Emit the step of emit_sparse_tiles' walk to the next listed tile."""
    _emit_next_tile(s, _entry_at(sparse[0], "e + 1"))


def _entry_at(lst, e):
    return f"I({lst}[min({e}, e_hi - 1)])"


def _emit_sparse_double_buffered_loop(s, stage_kv, BC, kv_words, sparse, start, end, shares):
    """The double-buffered loop over a block mask's listed tiles (emit_sparse_tiles), as
    _emit_double_buffered_loop."""
    next_tile = emit_sparse_tiles(s, BC, start, end, sparse, lambda row: stage_kv(row, 0),
                                  shares)
    s("for it in range(ntiles):")
    with s.block():
        emit_sparse_tile(s, BC, sparse)
        s(f"buf = U(it % 2) * {U(kv_words)}")
        s("cuda.syncthreads()  # everyone is done reading the buffer refilled next")
        s("if it + 1 < ntiles:")
        with s.block():
            s(f"next_row = {next_tile}")
            s("if it % 2 == 0:")
            with s.block():
                stage_kv("U(next_row)", 1)
            s("else:")
            with s.block():
                stage_kv("U(next_row)", 0)
            s("cp_async_wait_1()")
        s("else:")
        with s.block():
            s("cp_async_wait_0()")
        s("cuda.syncthreads()")
        emit_next_sparse_tile(s, sparse)


def _emit_double_buffered_loop(s, stage_kv, BC, kv_words, first, first_key):
    """Emit the head of the K/V tile loop with cp.async double buffering: the first tile (at key
    ``first_key``) is put in flight before the loop; each iteration starts tile it+1 in the other
    buffer, then waits for tile it. The body that follows reads the tile at word offset ``buf``;
    ``first``: the source of its first key, j0."""
    s("if ntiles > 0:")
    with s.block():
        stage_kv(first_key, 0)
    s("for it in range(ntiles):")
    with s.block():
        s(f"j0 = {first}")
        s(f"buf = U(it % 2) * {U(kv_words)}")
        s("cuda.syncthreads()  # everyone is done reading the buffer refilled next")
        s("if it + 1 < ntiles:")
        with s.block():
            # generated twice: the buffer offset must be a compile-time constant
            s("if it % 2 == 0:")
            with s.block():
                stage_kv(f"U(j0 + {BC})", 1)
            s("else:")
            with s.block():
                stage_kv(f"U(j0 + {BC})", 0)
            s("cp_async_wait_1()")
        s("else:")
        with s.block():
            s("cp_async_wait_0()")
        s("cuda.syncthreads()")


def emit_q_ready(s, VEC, HOLDQ, NKK, load_q):
    """Emit the wait for the staged Q tile and, when HOLDQ, its load into registers qf_{kk}_{r}
    (after which K/V may overwrite Q's shared memory)."""
    if VEC:
        s("cp_async_wait_0()")
    s("cuda.syncthreads()")
    if HOLDQ:
        for kk in range(NKK):
            load_q(kk, [f"qf_{kk}_{r}" for r in range(4)])
        s("cuda.syncthreads()  # K/V tiles reuse Q's shared memory")
