"""Attention dropout (``dropout_p``): which (batch, head, query, key) pairs a call keeps.

Dropout after the softmax, as FlashAttention-2 and SDPA apply it: each probability P[i, j] is
zeroed with probability p and the others are scaled by 1 / (1 - p), while the softmax's
denominator (and lse) stays that of the whole row. With Z = keep / (1 - p):

    O = (P * Z) V,    dV = (P * Z)^T dO,    dS = P * (Z * dP - D),    D = rowsum(dO * O)

(dP = dO V^T; D from the dropped O, as the backward of the dropped forward needs).

No mask is stored. Whether pair (b, h, i, j) is kept is a pure function of the call's 64-bit
seed, drawn from Philox-4x32-10 (Salmon et al., SC'11, the counter-based generator of Random123)
keyed by the seed: one generator call gives 16 random bytes, one for each of 16 pairs, and a pair
is kept when its byte is >= threshold = round(256 p). So p is applied in steps of 1 / 256, as
flash-attn's kernels apply it: the share dropped is threshold / 256 and kept probabilities are
scaled by 256 / (256 - threshold), which keeps the output unbiased (:attr:`Dropout.applied_p`).

Which 16 pairs share a call is chosen for the tensor cores' fragments: the call at counter
(j // 64, i // 16, h * 64 + (i % 8) * 8 + j % 8, b) gives the pairs of rows i0 = i with bit 3
clear and i0 + 8 and keys j0 + 8 n (n = 0..7, j0 = j with bits 3-5 clear): bytes 0-7 row i0's,
8-15 row i0 + 8's, byte n of each the key j0 + 8 n. A thread of an m16n8 fragment holds exactly
such rows (g, g + 8) and keys (2t + e + 8 n), so the forward and the backward's query pass use
all 16 bytes of a call, and the key pass (transposed fragments) 4 of them. ``h`` is the query
head, ``i`` and ``j`` positions in q and k. The backward regenerates the forward's mask from
the seed, and every backend (the CPU path, cuda.mma, the float64 reference) draws the same mask,
whatever its tiling: results agree with the reference pair by pair, and tests compare them under
the accuracy rule.

The generator is written once. The same functions run as plain Python on NumPy uint64 arrays
(the reference) or scalars (the tests' warp emulator), under numba.njit (the CPU path) and as
CUDA device functions (:func:`compiled`): uint64 arithmetic on 32-bit values, whose products fit
64 bits.
"""
import math
import types
from dataclasses import dataclass

import numpy as np

__all__ = ["Dropout", "build", "philox4x32_10", "keep_mask", "compiled", "packed_seed"]

MASK32 = np.uint64(0xFFFFFFFF)
SHIFT32 = np.uint64(32)
ZERO, ONE, THREE, FOUR, SIX, SEVEN, BYTE = (np.uint64(n) for n in (0, 1, 3, 4, 6, 7, 255))
#: the last counter word of :func:`packed_seed`'s calls (the masks' is a batch index)
PACKED_TAG = np.uint64(0xFFFFFFFF)
# Philox-4x32's multipliers and Weyl key increments (Random123)
PHILOX_M0 = np.uint64(0xD2511F53)
PHILOX_M1 = np.uint64(0xCD9E8D57)
PHILOX_W0 = np.uint64(0x9E3779B9)
PHILOX_W1 = np.uint64(0xBB67AE85)


def mulhilo(a, m):
    """(high, low) 32-bit halves of the product of two values below 2**32."""
    p = a * m
    return p >> SHIFT32, p & MASK32


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox-4x32 with 10 rounds: the four 32-bit words (as uint64) for counter (c0..c3) and
    key (k0, k1), each a uint64 below 2**32 (scalars or NumPy arrays)."""
    for _ in range(10):
        hi0, lo0 = mulhilo(c0, PHILOX_M0)
        hi1, lo1 = mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def row_bytes(seed_lo, seed_hi, b, h, i, j):
    """The call holding pair (i, j), as two 8-byte rows: (bytes of row i with bit 3 clear, of
    that row + 8), byte n of each for key (j with bits 3-5 clear) + 8 n."""
    ui, uj = np.uint64(i), np.uint64(j)
    w0, w1, w2, w3 = philox4x32_10(
        uj >> SIX, ui >> FOUR, (np.uint64(h) << SIX) | ((ui & SEVEN) << THREE) | (uj & SEVEN),
        np.uint64(b), seed_lo, seed_hi)
    return w0 | (w1 << SHIFT32), w2 | (w3 << SHIFT32)


def byte_keeps(row, j, threshold):
    """Whether key j is kept in a row of :func:`row_bytes`: its byte >= threshold."""
    return (row >> (((np.uint64(j) >> THREE) & SEVEN) << THREE)) & BYTE >= threshold


def keep(seed_lo, seed_hi, threshold, b, h, i, j):
    """Whether pair (b, h, i, j) is kept (elementwise on arrays)."""
    lo, hi = row_bytes(seed_lo, seed_hi, b, h, i, j)
    # row i's bytes by arithmetic, so arrays select too (uint64 wraps: the result is exact)
    return byte_keeps(lo + (hi - lo) * ((np.uint64(i) >> THREE) & ONE), j, threshold)


def packed_seed_words(seed_lo, seed_hi, index):
    """The two 32-bit words (lo, hi) of :func:`packed_seed`: one generator call at counter
    (index's low word, its high word, 0, PACKED_TAG) keyed by the call's seed words."""
    w0, w1, _, _ = philox4x32_10(index & MASK32, index >> SHIFT32, ZERO, PACKED_TAG, seed_lo,
                                 seed_hi)
    return w0, w1


#: the generator's functions, callees first (compiled() rebinds each one's callees)
FUNCTIONS = (mulhilo, philox4x32_10, row_bytes, byte_keeps, keep, packed_seed_words)


def compiled(jit):
    """{name: function} of :data:`FUNCTIONS` compiled by ``jit`` (``numba.njit``, or
    ``numba.cuda.jit(device=True)``), each calling the compiled others."""
    env = dict(globals())
    for fn in FUNCTIONS:
        env[fn.__name__] = jit(types.FunctionType(fn.__code__, env, fn.__name__))
    return {fn.__name__: env[fn.__name__] for fn in FUNCTIONS}


def packed_seed(seed, index):
    """The seed of packed sequence ``index`` (numflash.attention_varlen) under a call's 64-bit
    ``seed`` (:func:`packed_seed_words`). Every sequence draws its own mask as a batch of one
    under it, so its own attention call with this seed gives the same result, and its backward
    regenerates the mask from it; cuda.mma's one launch of packed sequences derives it in the
    kernel, each block for its sequence."""
    w0, w1 = packed_seed_words(np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32),
                               np.uint64(int(index)))
    return int(w0) | (int(w1) << 32)


@dataclass(frozen=True)
class Dropout:
    """A call's dropout: the probability p, its 64-bit seed, and what the kernels take."""
    p: float
    seed: int

    @property
    def threshold(self):
        """Bytes below it are dropped: round(256 p), 1 to 255 (build checks)."""
        return int(round(self.p * 256))

    @property
    def applied_p(self):
        """The share of pairs dropped: p in steps of 1 / 256 (threshold / 256)."""
        return self.threshold / 256

    @property
    def scale(self):
        """What a kept probability is multiplied by: 1 / (1 - applied_p)."""
        return 256 / (256 - self.threshold)

    @property
    def seed_words(self):
        return self.seed & 0xFFFFFFFF, self.seed >> 32

    def arguments(self):
        """The kernels' dropout arguments: seed_lo, seed_hi, threshold (ints), scale (float)."""
        lo, hi = self.seed_words
        return lo, hi, self.threshold, self.scale

    def __str__(self):
        return f"dropout_p={self.p:g} (applied {self.applied_p:g}, seed {self.seed})"


def build(dropout_p, dropout_seed):
    """The :class:`Dropout` of a call, or None for dropout_p = 0 (checked, each argument named
    in its error)."""
    try:
        p = float(dropout_p)
    except (TypeError, ValueError):
        raise TypeError(f"dropout_p must be a number in [0, 1); got {dropout_p!r}") from None
    if not (math.isfinite(p) and 0.0 <= p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1) (the probability of dropping a pair; 1 "
                         f"would drop everything); got {dropout_p!r}")
    if p == 0.0:
        if dropout_seed is not None and not isinstance(dropout_seed, (int, np.integer)):
            raise TypeError(f"dropout_seed must be an int; got {type(dropout_seed).__name__}")
        return None
    if not 1 <= round(p * 256) <= 255:
        raise ValueError(f"dropout_p={dropout_p!r} rounds to {round(p * 256)} / 256, and numflash "
                         f"drops pairs in steps of 1 / 256 (as flash-attn's kernels do): pass 0 "
                         f"for none, or a dropout_p from 1/512 to 511/512")
    if dropout_seed is None:
        raise ValueError("dropout_p > 0 needs dropout_seed=<int>: the mask is drawn from it, "
                         "and attention_backward must be given the same seed and dropout_p "
                         "to regenerate the forward's mask (numflash.torch draws one from "
                         "torch's generator for you)")
    if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, (int, np.integer)):
        raise TypeError(f"dropout_seed must be an int in [0, 2**64); got "
                        f"{type(dropout_seed).__name__}")
    seed = int(dropout_seed)
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"dropout_seed must be in [0, 2**64); got {seed}")
    return Dropout(p, seed)


def keep_mask(dropout, shape, query_positions=None):
    """The (B, H, Nq, Nk) boolean keep mask of a :class:`Dropout` (the reference's; Nq x Nk
    memory). ``query_positions``: the rows' positions when only some rows are drawn."""
    B, H, Nq, Nk = shape
    lo, hi = (np.uint64(w) for w in dropout.seed_words)
    rows = np.arange(Nq) if query_positions is None else np.asarray(query_positions)
    b, h, i, j = np.meshgrid(np.arange(B), np.arange(H), rows, np.arange(Nk), indexing="ij",
                             sparse=True)
    out = keep(lo, hi, np.uint64(dropout.threshold), *(x.astype(np.uint64) for x in (b, h, i, j)))
    return np.broadcast_to(out, (B, H, len(rows), Nk))
