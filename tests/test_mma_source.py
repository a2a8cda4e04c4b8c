"""The Python source cuda.mma generates, with no GPU: it compiles as Python and calls what each
operand kind should; shared-memory pads keep fragment loads free of bank conflicts; and the
tf32 / 3xTF32 / float64 ("word") kernels, run by a CPU emulator of the warp
(tests/mma_tools.py), meet their accuracy against the reference. The inline PTX itself runs on the
GPU only (tests/test_mma_gpu.py)."""
import numpy as np
import pytest

from mma_tools import SMEM_LIMIT, config_id, tile_config

#: per operand kind: (strings the source must contain, strings it must not)
SOURCE_CALLS = {
    "f16": (("mma_f16(", "ldmatrix_x4_trans(", "cp_async_16("), ()),
    "tf32": (("mma_tf32(", "to_tf32("), ()),
    "f64": (("mma_f64(", "cuda.shared.array(0, float64)", "cp_async_16("), ("to_tf32",)),
    # 3xTF32: O is rescaled where each tile's P V is added, never inside an mma
    "3xtf32": (("split_tf32(", "cuda.shared.array(0, float32)", "cp_async_16(",
                "o_0_0 = o_0_0 * alpha0 + (pv0 + pc0)"), ("to_tf32", "o_0_0 *= alpha0")),
}

SOURCES = ([(tile_config("f16", 64, VEC=1), (9, 0))]
           + [(tile_config("tf32", D), (9, 0)) for D in (32, 64, 96, 128)]
           + [(tile_config(DT, D, cc=cc), cc) for DT in ("f64", "3xtf32")
              for D in (32, 64, 96, 128) for cc in SMEM_LIMIT
              if DT != "f64" or cc >= (9, 0) or D <= 64])  # sm_80 float64 up to d=64


@pytest.mark.parametrize("cfg, cc", SOURCES, ids=[config_id(*c) for c in SOURCES])
def test_kernel_source_is_python_with_the_kinds_calls(cfg, cc):
    from numflash.cuda import mma
    src = mma.kernel_source(cfg)
    compile(src, f"<{cfg.DT}>", "exec")
    assert "local.array" not in src  # every fragment is a scalar: registers
    must, must_not = SOURCE_CALLS[cfg.DT]
    assert all(s in src for s in must), [s for s in must if s not in src]
    assert not any(s in src for s in must_not), [s for s in must_not if s in src]


@pytest.mark.parametrize("D", [32, 64, 96, 128])
def test_f64_fragment_loads_are_bank_conflict_free(D):
    """A 64-bit shared load is served a half-warp at a time: lanes 0-15 (g = 0..3, t = 0..3) must
    hit 16 distinct 8-byte slots modulo 16 (32 four-byte banks) for Q/K (row g, column t) and for V
    (row 2t, column g) -- the row pads of the float64 shared layout make it so."""
    from numflash.cuda.mma.operands import Words, operands_for
    lay = operands_for(tile_config("f64", D)).lay
    assert (lay.QW, lay.KW, lay.VW) == (D + 4, D + 4, D + Words.KINDS["f64"]["v_pad"])
    for half in (0, 1):
        lanes = range(16 * half, 16 * half + 16)
        qk = {((l // 4) * lay.QW + l % 4) % 16 for l in lanes}
        vv = {((l % 4) * 2 * lay.VW + l // 4) % 16 for l in lanes}
        assert len(qk) == 16 and len(vv) == 16, (D, half, qk, vv)


def test_split_tf32_emulation_is_a_tight_split(rng):
    """What the emulator (and the GPU test, bit for bit) holds ptx.split_tf32 to: hi is x
    rounded to 10 mantissa bits as the mma reads it, hi + lo (lo read the same way) is x to
    2**-21 relative, far tighter than the 2**-11 of one tf32 value (down to where lo is
    subnormal: tf32 subnormals are multiples of 2**-136); NaN and infinity survive the split."""
    from mma_tools import split_tf32_bits, tf32_bits, tf32_operand
    xs = np.concatenate([rng.standard_normal(2000).astype(np.float32)
                         * np.float32(10.0) ** rng.integers(-30, 30, 2000),
                         np.float32([1.0, -1.0, 3.4e38, -1.5e-38, 1e-45])])
    for x in xs.astype(np.float32):
        hi, lo = split_tf32_bits(x)
        assert tf32_operand(hi) == tf32_operand(tf32_bits(x))  # cvt.rna.tf32's rounding
        got = tf32_operand(hi) + tf32_operand(lo)
        assert abs(got - float(x)) <= 2.0 ** -21 * abs(float(x)) + 2.0 ** -136, (x, got)
    assert tf32_operand(split_tf32_bits(np.float32(0.0))[1]) == 0
    for inf in (np.inf, -np.inf):
        assert tf32_operand(split_tf32_bits(np.float32(inf))[0]) == inf
    for nan_bits in (0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000):  # GPU's, numpy's NaNs
        hi, lo = split_tf32_bits(np.uint32(nan_bits).view(np.float32))
        assert np.isnan(tf32_operand(hi)) or np.isnan(tf32_operand(lo)), hex(nan_bits)


# ------------------------------------------------------------------------------- emulated runs

SHAPES = {  # (B, H, Nq, Nk, d, dv, causal)
    "d64": (1, 2, 40, 170, 64, 64, False),
    "d64-short": (1, 1, 40, 70, 64, 64, False),
    "d32-dv96-bottom_right": (1, 1, 33, 90, 32, 96, "bottom_right"),
    "d59-dv40-causal": (1, 1, 70, 50, 59, 40, True),
    "d128-causal": (1, 1, 40, 60, 128, 128, True),
    "d64-q-in-registers": (1, 1, 150, 100, 64, 64, True),
}


def _emulated(DT, shape, VEC, tile=None, fast=False):
    staging = "cp.async" if VEC else "scalar"
    return pytest.param(DT, SHAPES[shape], VEC, tile, id=f"{DT}-{shape}-{staging}",
                        marks=() if fast else pytest.mark.extended)


# the fast tier emulates one case of each kind (3xTF32's d64 cases take minutes on 2 cores)
EMULATED = [
    _emulated("tf32", "d64-short", 0),
    _emulated("tf32", "d32-dv96-bottom_right", 0, fast=True),
    _emulated("f64", "d64", 1),
    _emulated("f64", "d32-dv96-bottom_right", 1, fast=True),
    _emulated("f64", "d59-dv40-causal", 0, fast=True),
    _emulated("f64", "d64-q-in-registers", 1, (8, 32, 1)),
    _emulated("3xtf32", "d64", 1),
    # extended (28 s on 2 cores): the README tier emulates 3xTF32 in the window cases, with
    # cp.async and scalar staging
    _emulated("3xtf32", "d32-dv96-bottom_right", 1),
    _emulated("3xtf32", "d59-dv40-causal", 0, (2, 32, 0)),
    _emulated("3xtf32", "d128-causal", 1, (2, 32, 0)),
    _emulated("3xtf32", "d64-q-in-registers", 1, (8, 32, 1)),
]


@pytest.mark.parametrize("DT, VEC, tile", [("f16", 1, (2, 32, 1)), ("bf16", 1, (2, 32, 0))])
def test_16bit_kernel_source_emulated_on_cpu(rng, DT, VEC, tile):
    """The 16-bit forward (ldmatrix, ldmatrix.trans, m16n8k16, P packed from the S fragments)
    under the warp emulator, bottom-right causal with dv != d: it meets the accuracy rule."""
    from mma_tools import run_forward_kernel
    from numflash.inputs import parse_causal
    from numflash.testing import check
    dtype = np.float16 if DT == "f16" else np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    B, H, Nq, Nk, d, dv, causal = SHAPES["d32-dv96-bottom_right"]
    q, k, v = (rng.standard_normal(s).astype(dtype)
               for s in ((B, H, Nq, d), (B, H, Nk, d), (B, H, Nk, dv)))
    is_causal, off = parse_causal(causal, Nq, Nk)
    out, lse = run_forward_kernel(q, k, v, DT, is_causal, off, VEC=VEC, tile=tile)
    rep = check(out, q, k, v, lse=lse, causal=causal)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("DT, shape, VEC, tile", EMULATED)
def test_word_kernel_source_emulated_on_cpu(rng, DT, shape, VEC, tile):
    """The fragment bookkeeping (S layout, the permuted-k P V, masking, softmax, epilogue; for
    3xTF32 the split operands, the small-term accumulators and the per-tile P V merged into O),
    run under the warp emulator: float64 and 3xTF32 meet the accuracy rule of every exact kernel
    (float64 to 1e-12; 3xTF32 to 2e-6, where one tf32 mma per product would be ~1e-3 off); tf32
    shows its rounding, bounded."""
    from mma_tools import run_forward_kernel
    from numflash.inputs import parse_causal
    from numflash.reference import naive
    from numflash.testing import check
    B, H, Nq, Nk, d, dv, causal = shape
    dtype = np.float64 if DT == "f64" else np.float32
    q, k, v = (rng.standard_normal(s).astype(dtype)
               for s in ((B, H, Nq, d), (B, H, Nk, d), (B, H, Nk, dv)))
    is_causal, off = parse_causal(causal, Nq, Nk)
    out, lse = run_forward_kernel(q, k, v, DT, is_causal, off, VEC=VEC, tile=tile)
    ref, ref_lse = naive(q, k, v, scale=1 / np.sqrt(d), causal=is_causal, causal_offset=off)
    if DT == "tf32":
        assert np.isfinite(out).all()
        rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert 1e-5 < rel < 2e-3  # tf32 rounding is visible, and bounded
    else:
        rep = check(out, q, k, v, causal=causal)
        assert rep.ok, str(rep)
        if DT == "f64":
            assert rep.max_err < 1e-12, str(rep)  # float64 all the way
        else:
            assert rep.rel_err < 2e-6, str(rep)
    inf = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), inf)
    tol = {"tf32": 1e-3, "3xtf32": 1e-5, "f64": 1e-12}[DT]  # lse is float64 for float64
    assert np.allclose(lse[~inf], ref_lse[~inf], rtol=tol, atol=tol)


# ------------------------------------------------------------------------------- sliding window

WINDOW_CASES = [  # (B, H, Nq, Nk, d, causal, window_size, VEC, tile): tiles of 16 keys, so
    # windows skip whole tiles on both sides; rows with no key (bottom-right, Nq > Nk)
    pytest.param(1, 1, 70, 90, 32, False, (5, 3), 0, (2, 16, 0), id="both-sides-scalar"),
    pytest.param(1, 1, 70, 90, 32, "bottom_right", (20, -1), 1, (2, 16, 0),
                 id="left-bottom_right-cp.async"),
    pytest.param(1, 2, 90, 50, 32, True, (7, -1), 1, (2, 16, 1), id="left-causal-q-held"),
    pytest.param(1, 1, 40, 64, 32, False, (-1, 2), 0, (2, 16, 0), id="right-only"),
    pytest.param(1, 1, 60, 40, 32, "bottom_right", (0, 0), 1, (2, 16, 0),
                 id="diagonal-only-empty-rows"),
    pytest.param(1, 1, 33, 70, 32, False, (200, 200), 0, (2, 16, 0), id="wider-than-keys"),
]


@pytest.mark.parametrize("DT", ["f64", "3xtf32"])
@pytest.mark.parametrize("B, H, Nq, Nk, d, causal, window, VEC, tile", WINDOW_CASES)
def test_window_source_emulated_on_cpu(rng, DT, B, H, Nq, Nk, d, causal, window, VEC, tile):
    """The WINDOW variant (each row's key range, the tile loop starting at the block's first
    key, warps skipping tiles outside their rows' ranges, both edges masked) against the
    float64 reference with the same window_size, under the warp emulator."""
    from mma_tools import run_forward_kernel
    from numflash.inputs import parse_causal
    from numflash.reference import attention as ref
    from numflash.testing import check
    dtype = np.float64 if DT == "f64" else np.float32
    q, k, v = (rng.standard_normal((B, H, n, d)).astype(dtype) for n in (Nq, Nk, Nk))
    is_causal, off = parse_causal(causal, Nq, Nk)
    out, lse = run_forward_kernel(q, k, v, DT, is_causal, off, VEC=VEC, tile=tile, window=window)
    rep = check(out, q, k, v, causal=causal, window_size=window)
    assert rep.ok, str(rep)
    _, ref_lse = ref(q, k, v, causal=causal, window_size=window, return_lse=True)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty) and np.all(out[empty] == 0)
    assert np.allclose(lse[~empty], ref_lse[~empty], rtol=1e-6, atol=1e-6)


def test_window_source_is_a_separate_variant():
    """Without a window the generated source is the plain kernel's (WINDOW=0 is left out of the
    config's mapping, so its cache keys and shipped PTX stay); with one, the two sizes are
    arguments and the tile loop starts at the block's first key."""
    from numflash.cuda.mma import MmaConfig, kernel_source
    plain = MmaConfig(64, 64, 4, 64, 1, "f16", 1)
    windowed = MmaConfig(64, 64, 4, 64, 1, "f16", 1, WINDOW=1)
    assert dict(plain) == {k: v for k, v in dict(windowed).items() if k != "WINDOW"}
    assert "WINDOW" not in dict(plain) and "window_left" not in kernel_source(plain)
    src = kernel_source(windowed)
    assert "window_left, window_right):" in src and "t_first = block_first // 64" in src
