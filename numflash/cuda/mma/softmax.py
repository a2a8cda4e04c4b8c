"""The online softmax on accumulator fragments in registers: zeroed accumulators, the running
max / sum update per key tile with the rescale of O, and the epilogue that normalizes O and writes
lse. Row max and sum reduce over the 4 lanes of a quad (shfl_xor 1, 2); every fragment layout
numflash's kernels use has the same C layout, so every operand kind shares these."""
from .emit import U


def emit_accumulators(s, NVN):
    """Emit the zeroed O fragments (NVN n8 tiles) and the running max / sum of both rows."""
    for n in range(NVN):
        s(", ".join(f"o_{n}_{r}" for r in range(4)) + " = ZERO, ZERO, ZERO, ZERO")
    s("m0 = NEG_INF", "m1 = NEG_INF", "l0 = ZERO", "l1 = ZERO")


def emit_online_update(s, NN, NVN, rescale_o=True):
    """Emit, for one warp's masked S fragments (NN n8 tiles), the online-softmax update of m, l
    and (``rescale_o``) the NVN O tiles, leaving P = exp(S - m) in the S registers; otherwise
    alpha0 / alpha1 are left for the caller to apply."""
    for half, (ra, rb) in enumerate(((0, 1), (2, 3))):
        terms = [f"s_{n}_{r}" for n in range(NN) for r in (ra, rb)]
        s(f"mx = {terms[0]}")
        for term in terms[1:]:
            s(f"mx = max(mx, {term})")
        s("mx = max(mx, cuda.shfl_xor_sync(FULL, mx, 1))",
          "mx = max(mx, cuda.shfl_xor_sync(FULL, mx, 2))",
          f"mn = max(m{half}, mx)",
          "mu = ZERO if mn == NEG_INF else mn * scale_log2",
          # exactly 1 while the max stands: computed, m * scale_log2 - mu contracts to an fma
          # whose result is mu's rounding error, and l and O were scaled by 2**(that) every
          # tile -- lse drifted with the number of key tiles (1.2e-4 at N=131072)
          f"alpha{half} = ONE if mn == m{half} else ex2(m{half} * scale_log2 - mu)",
          f"m{half} = mn")
        for term in terms:
            s(f"{term} = ex2({term} * scale_log2 - mu)")
        s(f"l{half} = l{half} * alpha{half} + (" + " + ".join(terms) + ")")
        for n in range(NVN if rescale_o else 0):
            for r in (ra, rb):
                s(f"o_{n}_{r} *= alpha{half}")


def emit_epilogue(s, NVN, store, lse_at="lse[b, h, ru]", factor="ONE", reciprocal=None):
    """Emit the quad sums of l, ``factor`` / l, the O stores (``store(n, ra, rb, half)`` writes O
    tile n's registers ra, rb of row half, in scope: ru, cbase, inv0 / inv1) and lse (into
    ``lse_at``). ``factor``: what O is scaled by besides 1 / l (dropout's 1 / (1 - p)).
    ``reciprocal``: a function name to take 1 / l with instead of a division (cuda.wgmma: an
    IEEE division has a subroutine slow path, which makes ptxas serialize wgmma)."""
    for half, row in ((0, "r0"), (1, "r1")):
        s(f"l{half} += cuda.shfl_xor_sync(FULL, l{half}, 1)",
          f"l{half} += cuda.shfl_xor_sync(FULL, l{half}, 2)",
          # l is 0 for a row that saw no key, NaN if an input was: NaN must reach the output
          f"inv{half} = ZERO if l{half} == ZERO else " +
          (f"{factor} * {reciprocal}(l{half})" if reciprocal else f"{factor} / l{half}"))
        s(f"if {row} < Nq:")
        with s.block():
            s(f"ru = U({row})", f"cbase = t * {U(2)}")
            ra, rb = (0, 1) if half == 0 else (2, 3)
            for n in range(NVN):
                store(n, ra, rb, half)
            s("if t == U(0):")
            with s.block():
                s(f"{lse_at} = NEG_INF if l{half} == ZERO else "
                  f"m{half} * scale + math.log(l{half})")
