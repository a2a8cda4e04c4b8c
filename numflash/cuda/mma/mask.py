"""Which keys each query row sees, on the fragments: the rows' key ends (``key_end``, the one
causal rule of numflash.cuda.common), the key counts a warp and the block visit (whole tiles past
them are never loaded), and -inf for the keys of a boundary tile a row does not see.

A thread holds two rows of its warp's 16, r0 = g and r1 = g + 8; an accumulator fragment of key
tile n gives it keys 2t, 2t + 1 of both rows in registers 0, 1 (r0) and 2, 3 (r1).
"""
from .emit import U


def row_end(row, window):
    """Source of the exclusive end of the keys ``row`` sees: numflash.cuda.common's causal
    ``key_end``, and with a window its right edge (numflash.mods.window_key_range)."""
    end = f"key_end({row}, Nk, causal, causal_offset)"
    if window:
        end = (f"(min({end}, max(0, {row} + causal_offset + window_right + 1)) "
               f"if window_right >= 0 else {end})")
    return end


def first_key(row):
    """Source of the first key ``row`` sees through a window's left edge."""
    return f"(max(0, {row} + causal_offset - window_left) if window_left >= 0 else 0)"


def span_keys(first_row, rows, window=False):
    """Source of the keys any of ``rows`` rows from ``first_row`` (a warp's, a warpgroup's) must
    visit: its last row's key end, 0 when it starts past Nq (its first key through a window is
    its first row's: first_key(first_row))."""
    return f"{row_end(f'min(Nq - 1, {first_row} + {rows - 1})', window)} if {first_row} < Nq else 0"


def emit_row_bounds(s, BR, window=False):
    """Emit the thread's two rows, their key ends e0 / e1, and the key counts the warp and the
    block must visit (signed: causal offsets can be negative). With a window also the rows' first
    keys f0 / f1, the first key any row of the warp (warp_first) and of the block (block_first)
    sees, and the first key the warp's last row sees (warp_max_first): a row's first key and end
    grow with the row, so the first and last rows bound them."""
    s("i0s = I(i0)",
      "w_first = i0s + I(warp) * 16",
      "r0 = w_first + I(g)",
      "r1 = r0 + 8",
      f"e0 = {row_end('r0', window)}",
      f"e1 = {row_end('r1', window)}",
      f"warp_min_end = {row_end('w_first', window)}",
      f"warp_keys = {span_keys('w_first', 16, window)}",
      f"block_keys = {row_end('min(Nq, i0s + %d) - 1' % BR, window)}")
    if window:
        s(f"f0 = {first_key('r0')}",
          f"f1 = {first_key('r1')}",
          f"warp_first = {first_key('w_first')}",
          f"warp_max_first = {first_key('min(Nq - 1, w_first + 15)')}",
          f"block_first = {first_key('i0s')}")


def emit_score_mask(s, NN, BC, window=False):
    """Emit -inf for the scores of keys past Nk or above the causal diagonal (and, with a window,
    outside it), in the S fragments (NN n8 tiles) of a boundary tile: one that reaches past the
    first row's key end (or starts before the last row's first key)."""
    if window:
        s(f"if j0 + {BC} > warp_min_end or j0 < warp_max_first:")
    else:
        s(f"if j0 + {BC} > warp_min_end:")
    with s.block():
        s("cb = j0 + I(t) * 2")
        for n in range(NN):
            for r, (e, f, add) in enumerate((("e0", "f0", 0), ("e0", "f0", 1), ("e1", "f1", 0),
                                             ("e1", "f1", 1))):
                key = f"cb + {n * 8 + add}"
                s(f"if {key} >= {e} or {key} < {f}:" if window else f"if {key} >= {e}:")
                with s.block():
                    s(f"s_{n}_{r} = NEG_INF")


def warp_sees_tile(BC, window=False):
    """Source of the condition under which a warp computes the tile at j0 (others it skips)."""
    return f"j0 < warp_keys and j0 + {BC} > warp_first" if window else "j0 < warp_keys"


def emit_debug_dump(s, NN):
    """Emit the copy of key tile 0's masked raw scores into ``dbg`` (configs with DBG=1)."""
    s("if j0 == 0:")
    with s.block():
        for n in range(NN):
            for r, (row, add) in enumerate((("r0", 0), ("r0", 1), ("r1", 0), ("r1", 1))):
                s(f"if {row} < Nq:")
                with s.block():
                    s(f"dbg[b, h, U({row}), t * {U(2)} + {U(n * 8 + add)}] = s_{n}_{r}")
