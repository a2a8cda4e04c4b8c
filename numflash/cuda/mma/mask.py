"""Which keys each query row sees, on the fragments: the rows' key ends (``key_end``, the one
causal rule of numflash.cuda.common), the key counts a warp and the block visit (whole tiles past
them are never loaded), and -inf for the keys of a boundary tile a row does not see.

A thread holds two rows of its warp's 16, r0 = g and r1 = g + 8; an accumulator fragment of key
tile n gives it keys 2t, 2t + 1 of both rows in registers 0, 1 (r0) and 2, 3 (r1).
"""
from .emit import U


def emit_row_bounds(s, BR):
    """Emit the thread's two rows, their key ends e0 / e1, and the key counts the warp and the
    block must visit (signed: causal offsets can be negative)."""
    s("i0s = I(i0)",
      "w_first = i0s + I(warp) * 16",
      "r0 = w_first + I(g)",
      "r1 = r0 + 8",
      "e0 = key_end(r0, Nk, causal, causal_offset)",
      "e1 = key_end(r1, Nk, causal, causal_offset)",
      "warp_min_end = key_end(w_first, Nk, causal, causal_offset)",
      "warp_keys = key_end(min(Nq - 1, w_first + 15), Nk, causal, causal_offset) "
      "if w_first < Nq else 0",
      "block_keys = key_end(min(Nq, i0s + %d) - 1, Nk, causal, causal_offset)" % BR)


def emit_score_mask(s, NN, BC):
    """Emit -inf for the scores of keys past Nk or above the causal diagonal, in the S fragments
    (NN n8 tiles) of a tile that reaches past the first row's key end (boundary tiles only)."""
    s(f"if j0 + {BC} > warp_min_end:")
    with s.block():
        s("cb = j0 + I(t) * 2")
        for n in range(NN):
            for r, (e, add) in enumerate((("e0", 0), ("e0", 1), ("e1", 0), ("e1", 1))):
                s(f"if cb + {n * 8 + add} >= {e}:")
                with s.block():
                    s(f"s_{n}_{r} = NEG_INF")


def emit_debug_dump(s, NN):
    """Emit the copy of key tile 0's masked raw scores into ``dbg`` (configs with DBG=1)."""
    s("if j0 == 0:")
    with s.block():
        for n in range(NN):
            for r, (row, add) in enumerate((("r0", 0), ("r0", 1), ("r1", 0), ("r1", 1))):
                s(f"if {row} < Nq:")
                with s.block():
                    s(f"dbg[b, h, U({row}), t * {U(2)} + {U(n * 8 + add)}] = s_{n}_{r}")
