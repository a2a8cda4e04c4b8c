"""Moving tiles from global into shared memory: 16-byte ``cp.async`` row copies, the K/V tile
loop (double-buffered with cp.async, or staged synchronously between two barriers), and the wait
for the Q tile (then read into registers when Q is held there).

Scalar staging (a strided last axis, odd head dims, misaligned views) belongs to the operand kind
(operands.py): how elements become shared-memory words is what the kinds differ in.
"""
import contextlib

from .emit import U


def emit_cp_async_rows(s, src, rows, row, first, limit, width, dim, off, W, chunk, per_word,
                       NT):
    """Emit the 16-byte cp.async copy of rows x width elements of ``src`` (a 2-D global view)
    into shared rows of W words at word offset ``off``: ``chunk`` elements per 16 bytes,
    ``per_word`` elements per shared word. Rows at or past ``limit`` and columns at or past
    ``dim`` are zero-filled (cp.async's src-size 0), so padding needs no second pass."""
    col = "c" if per_word == 1 else f"c // {U(per_word)}"
    s(f"for idx in range(tid, {U(rows * width // chunk)}, {U(NT)}):")
    with s.block():
        s(f"r = idx // {U(width // chunk)}",
          f"c = (idx % {U(width // chunk)}) * {U(chunk)}",
          f"{row} = {first} + r",
          f"n = {U(16)} if {row} < {limit} and c < {dim} else {U(0)}",
          f"src = global_addr2({src}, {row} if {row} < {limit} else {U(0)}, "
          f"c if c < {dim} else {U(0)})",
          f"cp_async_16(shared_addr(smem, {U(off)} + r * {U(W)} + {col}), src, n)")


@contextlib.contextmanager
def tile_loop(s, stage_kv, BC, kv_words, VEC, KV_OFF, KW, window=False, start="block_first",
              end="block_keys"):
    """Emit the K/V tile loop's head and enter its body, yielding the word offsets of the tile
    being read (k_off, v_off) and the source prefix of its buffer (kb): VEC double-buffers with
    cp.async; otherwise each tile is staged synchronously between two barriers. The loop visits
    the tiles from 0 (with a window: from the one holding row ``start``) up to row ``end`` of the
    streamed array (the keys; the backward's key pass streams the queries). j0 is the first row
    of the tile in the body."""
    if window:
        s(f"t_first = {start} // {BC}",
          f"ntiles = max(0, ({end} - t_first * {BC} + {BC - 1}) // {BC})")
        first = f"(t_first + it) * {BC}"
    else:
        s(f"ntiles = ({end} + {BC - 1}) // {BC}")
        first = f"it * {BC}"
    if VEC:
        _emit_double_buffered_loop(s, stage_kv, BC, kv_words, first,
                                   f"U(t_first * {BC})" if window else U(0))
    else:
        s("for it in range(ntiles):")
    with s.block():
        if VEC:
            yield KV_OFF, KV_OFF + BC * KW, "buf + "
            return
        s(f"j0 = {first}", "j0u = U(j0)")
        s("cuda.syncthreads()  # the previous tile is no longer read")
        k_off, v_off = stage_kv("j0u", 0)
        s("cuda.syncthreads()")
        yield k_off, v_off, ""


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
