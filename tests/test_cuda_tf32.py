"""precision="tf32": float32 inputs on the tensor-core kernel (cuda.mma, m16n8k8 tf32 mma).

Without a GPU: the tf32 variants compile to cubins for sm_80 / sm_90 (in a subprocess, since
conftest turns numba's simulator on in this one) with the m16n8k8 tf32 mma in the PTX and no
spills; the public API validates ``precision`` and explains every refusal. On a GPU (``-m gpu``):
accuracy against the float64 reference with a tf32 bound (10-bit mantissa products: relative
error ~1e-3). bench/mma_probe.py's ``tf32`` section runs the same checks with a timing.
"""
import pathlib
import sys

import numpy as np
import pytest

import numflash
from mma_compile import assert_register_resident, compile_variant

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cfg(D, DV=None, DBG=0):
    from numflash.cuda.mma import _tile
    DV = DV or D
    nw, bc, holdq = _tile(D, DV, "tf32")
    return {"D": D, "DV": DV, "NW": nw, "BC": bc, "HOLDQ": holdq, "DT": "tf32", "VEC": 0,
            "DBG": DBG}


@pytest.mark.parametrize("cfg, cc", [(_cfg(64), (8, 0)), (_cfg(128), (9, 0)),
                                     (_cfg(32), (9, 0)), (_cfg(96), (8, 0))],
                         ids=["d64-sm80", "d128-sm90", "d32-sm90", "d96-sm80"])
def test_tf32_variant_compiles_clean(cfg, cc):
    got = compile_variant(cfg, cc, ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
                                    "mma.sync.aligned.m16n8k16", "cvt.rna.tf32.f32"))
    ops = got["ops"]
    # S: D/8 k-steps x BC/8 key tiles; P V: BC/8 k-steps x DV/8 column tiles
    assert ops["mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"] == \
        (cfg["D"] // 8) * (cfg["BC"] // 8) + (cfg["BC"] // 8) * (cfg["DV"] // 8)
    assert ops["mma.sync.aligned.m16n8k16"] == 0 and ops["cvt.rna.tf32.f32"] > 0
    assert_register_resident(got)


def test_tf32_source_and_shared_memory():
    from numflash.cuda import mma
    for D in (32, 64, 96, 128):
        cfg = _cfg(D)
        src = mma.kernel_source_word(D, D, cfg["NW"], cfg["BC"], cfg["HOLDQ"], "tf32")
        compile(src, "<tf32>", "exec")
        assert "mma_tf32(" in src and "to_tf32(" in src and "local.array" not in src
        assert mma.smem_bytes(cfg) <= 160 * 1024


def _f32(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("bad", ["bogus", "TF32", "fp32", None, 32])
def test_precision_value_is_validated(rng, bad):
    q = _f32(rng, (1, 2, 16, 32))
    for fn in (numflash.attention, numflash.explain):
        with pytest.raises(ValueError, match="precision"):
            fn(q, q, q, precision=bad)


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_tf32_needs_float32(rng, dtype):
    q = _f32(rng, (1, 2, 16, 32)).astype(dtype)
    for fn in (numflash.attention, numflash.explain):
        with pytest.raises(ValueError, match="precision='tf32'.*float32"):
            fn(q, q, q, precision="tf32")


def test_tf32_refused_on_the_cpu(rng):
    q = _f32(rng, (1, 2, 16, 32))
    for fn in (numflash.attention, numflash.explain):
        with pytest.raises(ValueError, match="precision='tf32'.*cuda.mma"):
            fn(q, q, q, precision="tf32")
        with pytest.raises(ValueError, match="precision='tf32'"):
            fn(q, q, q, precision="tf32", backend="cpu")


def test_exact_precisions_are_unchanged_on_the_cpu(rng):
    from numflash.reference import attention as ref
    q, k, v = (_f32(rng, (1, 2, 40, 32)) for _ in range(3))
    want = ref(q, k, v, precision="tf32")  # accepted and ignored by the reference
    for precision in ("auto", "ieee"):
        got = numflash.attention(q, k, v, precision=precision)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5)
        assert numflash.explain(q, k, v, precision=precision).kernel == "cpu.tiled"


@pytest.mark.simulator
def test_simulator_explains_tf32(rng):
    q = _f32(rng, (1, 2, 33, 64))
    plan = numflash.explain(q, q, q, backend="cuda")
    assert plan.kernel == "cuda.block"
    assert "simulator" in plan.rejected["cuda.mma"]
    for fn in (numflash.explain, numflash.attention):
        with pytest.raises(ValueError, match="simulator"):
            fn(q, q, q, backend="cuda", precision="tf32")
        with pytest.raises(ValueError, match="cuda.block computes in exact float32"):
            fn(q, q, q, backend="cuda", algorithm="block", precision="tf32")
        with pytest.raises(ValueError, match="cuda.row computes in exact float32"):
            fn(q, q, q, backend="cuda", algorithm="row", precision="tf32")


def test_plan_memo_key_includes_precision():
    from numflash import plan
    from numflash.inputs import normalize
    q = np.zeros((1, 1, 8, 32), np.float32)
    p_auto = plan.choose(normalize(q, q, q))
    with pytest.raises(ValueError, match="tf32"):
        plan.choose(normalize(q, q, q, precision="tf32"))
    assert plan.choose(normalize(q, q, q)) is p_auto


def test_kernel_specs_declare_tf32():
    from numflash.plan import kernel_specs
    specs = kernel_specs()
    assert specs["cuda.mma"].tf32 and "float32" in specs["cuda.mma"].dtypes
    assert not any(s.tf32 for n, s in specs.items() if n != "cuda.mma")


# ------------------------------------------------------------------------------------- GPU

GPU_CASES = [  # (B, H, Nq, Nk, d, dv)
    (1, 1, 1, 1, 64, 64),
    (2, 3, 128, 128, 64, 64),
    (2, 3, 300, 777, 64, 64),
    (1, 2, 777, 300, 128, 128),
    (2, 2, 1025, 1025, 128, 128),
    (2, 3, 200, 333, 59, 111),
    (1, 2, 257, 300, 32, 96),
]


def _tf32_close(q, k, v, out, lse, causal):
    from numflash.reference import attention as ref
    from numflash.testing import check
    rep = check(out, q, k, v, causal=causal)
    assert rep.finite, str(rep)
    assert rep.rel_err < 5e-3, str(rep)
    _, ref_lse = ref(q, k, v, causal=causal, return_lse=True)
    got = lse.get()
    inf = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(got), inf)
    assert np.allclose(got[~inf], ref_lse[~inf], rtol=1e-2, atol=1e-2)
    return rep


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_gpu_tf32_against_reference(rng, case, causal):
    import cupy
    B, H, Nq, Nk, d, dv = case
    q, k, v = (cupy.asarray(_f32(rng, s)) for s in ((B, H, Nq, d), (B, H, Nk, d), (B, H, Nk, dv)))
    plan = numflash.explain(q, k, v, causal=causal, precision="tf32")
    assert plan.kernel == "cuda.mma" and plan.config["DT"] == "tf32", str(plan)
    # float32-level accuracy (3xTF32 or the FMA kernels) unless tf32 is asked for
    default = numflash.explain(q, k, v, causal=causal)
    assert default.kernel == "cuda.block" or default.config["DT"] == "3xtf32", str(default)
    out, lse = numflash.attention(q, k, v, causal=causal, precision="tf32", return_lse=True)
    assert out.dtype == cupy.float32 and lse.dtype == cupy.float32
    _tf32_close(q, k, v, out, lse, causal)


@pytest.mark.gpu
def test_gpu_tf32_bshd_strided_out(rng):
    import cupy
    B, N, H, d = 2, 300, 3, 64
    q = cupy.asarray(_f32(rng, (B, N, H, 2 * d)))[..., ::2]
    k, v = (cupy.asarray(_f32(rng, (B, N, H, d))) for _ in range(2))
    out = cupy.full((B, N, H, d), np.nan, dtype=cupy.float32)
    res = numflash.attention(q, k, v, layout="bshd", causal=True, out=out, precision="tf32")
    assert res is out
    from numflash.testing import check
    rep = check(out, q, k, v, layout="bshd", causal=True)
    assert rep.finite and rep.rel_err < 5e-3, str(rep)


@pytest.mark.gpu
def test_gpu_tf32_refuses_large_head_dims(rng):
    import cupy
    q = cupy.asarray(_f32(rng, (1, 1, 64, 256)))
    with pytest.raises(ValueError, match="tf32"):
        numflash.attention(q, q, q, precision="tf32")


@pytest.mark.parametrize("case", [(1, 1, 40, 70, 64, 64, False),
                                  (1, 1, 33, 90, 32, 96, "bottom_right")],
                         ids=["d64", "d32-dv96-bottom_right"])
def test_tf32_source_emulated_on_cpu(rng, case):
    """The generated tf32 kernel source, run by a CPU emulator of the warp (tests/mma_emu.py):
    checks the fragment bookkeeping (S layout, the permuted-k P V, masking, softmax, epilogue)
    without a GPU. The inline-PTX intrinsics themselves are checked on the GPU only."""
    sys.path.insert(0, str(ROOT / "tests"))
    from mma_emu import run_word_kernel
    from numflash.inputs import parse_causal
    from numflash.reference import naive
    B, H, Nq, Nk, d, dv, causal = case
    q, k, v = _f32(rng, (B, H, Nq, d)), _f32(rng, (B, H, Nk, d)), _f32(rng, (B, H, Nk, dv))
    is_causal, off = parse_causal(causal, Nq, Nk)
    out, lse = run_word_kernel(q, k, v, "tf32", is_causal, off)
    ref, ref_lse = naive(q, k, v, scale=1 / np.sqrt(d), causal=is_causal, causal_offset=off)
    assert np.isfinite(out).all()
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert 1e-5 < rel < 2e-3  # tf32 rounding is visible, and bounded
    assert np.allclose(lse, ref_lse, rtol=1e-3, atol=1e-3)
