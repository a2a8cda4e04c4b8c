"""Attention dropout on the fragments (MmaConfig.DROP): numflash.dropout's keep of each pair a
thread holds, drawn in the kernel from the call's seed, applied where the rule of numflash.dropout
puts it:

- forward: P, after the online softmax took it into the row sums, before P V (O = (P Z) V);
- backward query pass: dP, right after dP = dO V^T (dS = P (Z dP - delta));
- backward key pass (transposed fragments): P^T Z for dV and P^T (Z dP^T - delta) for dS^T,
  score by score, as with modifications (backward.py's elementwise path).

A generator call (numflash.dropout.row_bytes) gives one byte for each pair of rows i, i + 8 (bit 3
of i clear) and keys j + 8 n of a 64-key group. A row fragment's thread holds rows g, g + 8 of
its warp's 16 and keys 2t + e + 8 n: one call per (e, 64 keys) serves 16 of its scores. A
transposed fragment's thread holds keys g, g + 8 and queries 2t + e + 8 n: a call serves the two
keys of two queries 8 apart (of one sub-tile's n, n + 1). A dropped pair is set to zero by a
select, so a NaN or inf of a V or dO row it would read never reaches an output (0 * NaN).

Packed sequences (MmaConfig.VARLEN): sequence b draws its mask as a batch of one under its own
seed, numflash.dropout.packed_seed(seed, b), which each block derives from the call's seed in
its prologue (one generator call), so the one launch draws what each sequence's own call
draws."""
from ... import dropout as rule

#: the kernels' dropout parameters: the seed's two words and the threshold (ints), 1 / (1 - p)
PARAMETERS = ", drop_lo_in, drop_hi_in, drop_threshold_in, drop_scale_in"


def parameters(cfg):
    return PARAMETERS if cfg.DROP else ""


def argument_types(drop):
    from numba import types
    return (types.int64, types.int64, types.int64, types.float64) if drop else ()


def arguments(problem):
    """The launch's dropout arguments ((), without dropout)."""
    return problem.dropout.arguments() if problem.dropout is not None else ()


def emit_locals(s, cfg, flt):
    """Emit the arguments as the generator and the kernel's float arithmetic read them, and the
    batch index the mask is drawn for (``drop_b``): b, or with VARLEN 0 under the sequence's
    own seed (after emit_sequence: b is the sequence)."""
    if not cfg.DROP:
        return
    s("drop_lo = U(drop_lo_in)", "drop_hi = U(drop_hi_in)",
      "drop_threshold = U(drop_threshold_in)", f"drop_scale = {flt}(drop_scale_in)")
    if cfg.VARLEN:
        s("drop_lo, drop_hi = packed_seed_words(drop_lo, drop_hi, U(b))", "drop_b = U(0)")
    else:
        s("drop_b = b")


def _dropped(reg, row, shift, scaled=True):
    """Source dropping register ``reg`` whose pair's byte is at bit ``shift`` of ``row`` (kept:
    scaled by 1 / (1 - p), or left for the caller to scale)."""
    kept = f"{reg} * drop_scale" if scaled else reg
    return f"{reg} = {kept} if (({row} >> {shift}) & U(255)) >= drop_threshold else ZERO"


def emit_rows(s, NN, reg, BC, rows=("r0", "r1"), first_key="dj", scaled=True):
    """Emit dropout on row fragments ``reg``_n_r (NN n8 tiles of a BC-key tile; registers 0, 1
    of row rows[0] and 2, 3 of rows[1] = rows[0] + 8, rows[0] a multiple of 16 plus g; keys
    first_key + 8 n + e, first_key = the tile's first key + 2t): dropped ones 0, kept ones
    scaled (``scaled``; else the caller scales them). One call per e and 64 keys (a tile of
    fewer keys lies in one 64-key group); with tiles of whole 64-key groups each key's byte is
    at a constant place."""
    for e in (0, 1):
        for group in range(max(1, BC // 64)):
            s(f"dlo, dhi = row_bytes(drop_lo, drop_hi, drop_b, h, {rows[0]}, {first_key} + "
              f"{64 * group + e})")
            for n in range(group * 8, min(NN, group * 8 + 8)):
                if BC % 64 == 0:
                    sh = f"U({8 * (n % 8)})"
                else:
                    s(f"sh = (U({first_key} + {8 * n + e}) & U(56))")
                    sh = "sh"
                s(_dropped(f"{reg}_{n}_{e}", "dlo", sh, scaled),
                  _dropped(f"{reg}_{n}_{2 + e}", "dhi", sh, scaled))


def emit_key_shifts(s, cfg, keys=("kr0", "kr1")):
    """Emit, for the key pass, where each of the thread's two keys' bytes sit in a row of
    bytes (the keys are fixed for the whole kernel)."""
    if cfg.DROP:
        s(*(f"ksh{n} = U({key}) & U(56)" for n, key in enumerate(keys)))


def emit_transposed(s, n, r, c, reg, paired, draw=True, first_query="qcol", keys=("kr0",)):
    """Emit, on a transposed fragment (register r of n8 tile n: key row r // 2 of the thread's
    two, query first_query + 8 n + c), the drop of register ``reg``. ``paired``: the sub-tile's
    first query is a multiple of 16, so the call for query q (bit 3 clear, at even n) also
    serves q + 8 (n + 1); otherwise each n draws its own and picks the row by bit 3. ``draw``
    False: the bytes were drawn for this register already (a second register dropped by the
    same pair)."""
    if draw and r == c and (not paired or n % 2 == 0):   # this column's first register: draw
        s(f"dlo{c}, dhi{c} = row_bytes(drop_lo, drop_hi, drop_b, h, {first_query} + {8 * n + c}, "
          f"{keys[0]})")
        if not paired:
            s(f"drow{c} = dhi{c} if ((U({first_query} + {8 * n + c}) >> U(3)) & U(1)) "
              f"else dlo{c}")
    row = f"drow{c}" if not paired else (f"dlo{c}" if n % 2 == 0 else f"dhi{c}")
    s(_dropped(reg, row, f"ksh{r // 2}"))


def namespace(cfg, device_jit=None):
    """The generator's device functions for a DROP variant (plain Python without
    ``device_jit``: the tests' warp emulator)."""
    if not cfg.DROP:
        return {}
    fns = rule.compiled(device_jit) if device_jit else {f.__name__: f for f in rule.FUNCTIONS}
    return {name: fns[name] for name in ("row_bytes",) + (("packed_seed_words",)
                                                          if cfg.VARLEN else ())}


def identity_functions(cfg):
    """What decides a DROP variant's code besides its source: the generator's functions."""
    return (namespace, rule.compiled, *rule.FUNCTIONS) if cfg.DROP else ()

