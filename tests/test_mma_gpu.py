"""cuda.mma on a GPU (``-m gpu``; they skip without one): the 3xTF32 operand split, then the
kernel through the public API against the float64 reference for every input dtype and
precision (float16, bfloat16, float32 as tf32 or 3xTF32, float64) x case x causal mode, layouts
and strides, the configs other GPUs get (forced tiles and mma forms), and what it refuses.
Each inline-PTX intrinsic alone: tests/test_ptx_intrinsics.py."""
import numpy as np
import pytest

import numflash
from mma_tools import run_forced_config

pytestmark = pytest.mark.gpu


#: input dtype and precision by name; 16-bit inputs name algorithm="mma" (auto picks it anyway)
PRECISIONS = {"float16": ("float16", "auto"), "bfloat16": ("bfloat16", "auto"),
              "tf32": ("float32", "tf32"), "3xtf32": ("float32", "auto"),
              "float64": ("float64", "auto")}


def _attention_options(name):
    dtype, precision = PRECISIONS[name]
    return dict(precision=precision, **({"algorithm": "mma"} if name.endswith("16") else {}))


def _device_array(rng, shape, dtype):
    """Standard normal values on the device (see _on_device)."""
    return _on_device(rng.standard_normal(shape), dtype)


def _on_device(values, dtype):
    """Host float values as a device array of ``dtype``; bfloat16 through ml_dtypes, else torch,
    else skip."""
    import cupy
    if dtype != "bfloat16":
        return cupy.asarray(values.astype(dtype))
    try:
        import ml_dtypes
        return cupy.asarray(values.astype(np.float32)).astype(ml_dtypes.bfloat16)
    except Exception:
        pass
    try:
        import torch
        return cupy.from_dlpack(torch.tensor(values, dtype=torch.bfloat16, device="cuda"))
    except Exception as e:
        pytest.skip(f"no way to hold bfloat16 on the device here ({e})")


def _rows(Nq, rng):
    """The query rows to check: all up to 1025, else the first and last 16, every 37th and 128
    at random."""
    if Nq <= 1025:
        return None
    return np.unique(np.r_[0:16, Nq - 16:Nq, 0:Nq:37, rng.choice(Nq, 128, replace=False)])


def _expect_3xtf32(plan, q, k, v):
    """cuda.mma 3xTF32 where the planner should take it, else cuda.block with mma's reason."""
    from numflash.cuda.mma import X3_CCS, head_dim_pad, vector_ok
    from numflash.inputs import normalize
    d, dv = q.shape[-1], v.shape[-1]
    dev = plan.device
    wins = (dev.cc in X3_CCS and max(head_dim_pad(d), head_dim_pad(dv)) <= 128
            and vector_ok(normalize(q, k, v)) is None)
    if wins:
        assert plan.kernel == "cuda.mma" and plan.config["DT"] == "3xtf32", str(plan)
    else:
        assert plan.kernel == "cuda.block" and "cuda.mma" in plan.rejected, str(plan)


def assert_auto_16bit(plan):
    """Where "auto" sends a 16-bit forward: cuda.wgmma on compute capability 9.0 unless it says
    why not (or why auto passes it over), else cuda.mma."""
    if tuple(plan.device.cc) == (9, 0) and "cuda.wgmma" not in plan.rejected:
        assert plan.kernel == "cuda.wgmma", str(plan)
    else:
        assert plan.kernel == "cuda.mma", str(plan)


def _expect_plan(name, q, k, v, causal):
    """Where the planner must send these inputs."""
    from numflash.cuda.mma import head_dim_pad
    plan = numflash.explain(q, k, v, causal=causal)
    if name in ("float16", "bfloat16"):
        assert_auto_16bit(plan)
    elif name == "tf32":
        # float32-level accuracy (3xTF32 or the FMA kernels) unless tf32 is asked for
        assert plan.kernel == "cuda.block" or plan.config["DT"] == "3xtf32", str(plan)
        tf32 = numflash.explain(q, k, v, causal=causal, precision="tf32")
        assert tf32.kernel == "cuda.mma" and tf32.config["DT"] == "tf32", str(tf32)
    elif name == "3xtf32":
        _expect_3xtf32(plan, q, k, v)
        assert numflash.explain(q, k, v, causal=causal, precision="ieee").kernel == "cuda.block"
    else:  # float64: d <= 64 runs on cuda.mma on every cc >= 8.0; d <= 128 on sm_90-class parts
        # (m16n8k8 .f64 and ~227 KB of shared memory a block); elsewhere cuda.block, with mma's
        # reason recorded
        d, dv = q.shape[-1], v.shape[-1]
        dev = plan.device
        if max(head_dim_pad(d), head_dim_pad(dv)) <= 64 or (
                dev.cc >= (9, 0) and dev.smem_per_block_optin >= 200 * 1024):
            assert plan.kernel == "cuda.mma" and plan.config["DT"] == "f64", str(plan)
        else:
            assert plan.kernel == "cuda.block" and "cuda.mma" in plan.rejected, str(plan)


def _assert_accurate(name, out, q, k, v, lse=None, rows=None, **opts):
    """The accuracy rule of every exact kernel (numflash.testing.check); tf32 (10-bit mantissa
    products) to 5e-3 relative, its lse to 1e-2."""
    from numflash.reference import attention as ref
    from numflash.testing import check
    if name != "tf32":
        rep = check(out, q, k, v, lse=lse, rows=rows, **opts)
        assert rep.ok, str(rep)
        return
    rep = check(out, q, k, v, **opts)
    assert rep.finite and rep.rel_err < 5e-3, str(rep)
    if lse is not None:
        _, ref_lse = ref(q, k, v, return_lse=True, **opts)
        got = lse.get()
        inf = np.isneginf(ref_lse)
        assert np.array_equal(np.isneginf(got), inf)
        assert np.allclose(got[~inf], ref_lse[~inf], rtol=1e-2, atol=1e-2)


def _gpu_split(x):
    """ptx.split_tf32 on the GPU, element-wise: (hi, lo) bits."""
    import cupy
    from numba import cuda
    from numflash.cuda import ptx

    @cuda.jit
    def kern(x, hi, lo):
        i = cuda.grid(1)
        if i < x.size:
            h, low = ptx.split_tf32(x[i])
            hi[i] = h
            lo[i] = low
    xd = cupy.asarray(x)
    hi, lo = cupy.zeros(x.size, cupy.uint32), cupy.zeros(x.size, cupy.uint32)
    kern[(x.size + 255) // 256, 256](xd, hi, lo)
    return hi.get(), lo.get()


def test_gpu_split_tf32_matches_the_emulator_bit_for_bit(rng):
    from mma_tools import split_tf32_bits
    x = np.concatenate([rng.standard_normal(4000).astype(np.float32)
                        * np.float32(10.0) ** rng.integers(-30, 30, 4000),
                        np.float32([0.0, -0.0, 1.0, 3.0e38, -1.5e-38, 1e-45, 1.0000001])])
    special = np.array([0x7F800000, 0xFF800000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000],
                       np.uint32).view(np.float32)
    x = np.concatenate([x.astype(np.float32), special])
    hi, lo = _gpu_split(x)
    want = np.array([split_tf32_bits(e) for e in x], np.uint32)
    finite = np.isfinite(x)  # lo of inf / NaN is a NaN whose bits differ between GPU and numpy
    assert np.array_equal(hi, want[:, 0]) and np.array_equal(lo[finite], want[finite, 1])


# ------------------------------------------------------------------------------- the kernel

CASES = [  # (B, H, Nq, Nk, d, dv), the precisions that run it
    ((1, 1, 1, 1, 64, 64), "float16 tf32 3xtf32 float64"),
    ((2, 3, 128, 128, 32, 32), "float16"),
    ((2, 3, 128, 128, 64, 64), "tf32 3xtf32 float64"),
    ((2, 3, 300, 777, 64, 64), "tf32 3xtf32 float64"),
    ((2, 2, 300, 257, 64, 64), "bfloat16"),
    ((2, 2, 300, 257, 128, 128), "bfloat16"),
    ((1, 2, 777, 300, 96, 96), "float16"),
    ((1, 2, 300, 777, 128, 128), "float16"),
    ((1, 2, 777, 300, 128, 128), "tf32 3xtf32 float64"),
    ((2, 3, 1025, 1025, 64, 64), "float16"),
    ((2, 2, 1025, 1025, 128, 128), "tf32 3xtf32 float64"),
    ((1, 2, 257, 300, 256, 256), "float16"),
    ((2, 3, 200, 333, 59, 111), "float16 tf32 float64"),
    ((1, 2, 257, 300, 32, 96), "tf32"),
    ((2, 3, 200, 333, 32, 96), "3xtf32"),
    ((2, 3, 200, 333, 96, 64), "3xtf32"),
    ((1, 2, 97, 1025, 1, 8), "float64"),
    ((1, 2, 97, 1025, 8, 8), "3xtf32"),
    ((1, 2, 4096, 4096, 64, 64), "float16"),
    ((2, 4, 4096, 4096, 64, 64), "3xtf32 float64"),
    ((1, 2, 16384, 16384, 128, 128), "float16 3xtf32"),  # error must not grow with the keys
]


@pytest.mark.parametrize("name, case", [
    pytest.param(name, case, id=f"{name}-{'x'.join(map(str, case))}")
    for name in PRECISIONS for case, names in CASES if name in names.split()])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_gpu_against_reference(rng, name, case, causal):
    B, H, Nq, Nk, d, dv = case
    dtype = PRECISIONS[name][0]
    q, k, v = (_device_array(rng, s, dtype) for s in ((B, H, Nq, d), (B, H, Nk, d),
                                                      (B, H, Nk, dv)))
    _expect_plan(name, q, k, v, causal)
    out, lse = numflash.attention(q, k, v, causal=causal, return_lse=True,
                                  **_attention_options(name))
    from numflash.inputs import lse_dtype
    assert out.dtype == q.dtype and type(out) is type(q) and lse.dtype == lse_dtype(q.dtype)
    _assert_accurate(name, out, q, k, v, lse=lse, rows=_rows(Nq, rng), causal=causal)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("name", ["float16", "bfloat16", "tf32", "3xtf32", "float64"])
def test_gpu_bshd_strided_inputs_and_out(rng, name, strided):
    """layout="bshd", a strided q (16-bit and float64 stage it with scalar loads, 3xTF32 leaves
    it to cuda.block), a given ``out`` filled in place."""
    import cupy
    from numflash.cuda.mma import X3_CCS
    dtype = PRECISIONS[name][0]
    B, N, H, d = 2, 300, 3, 64
    q = (_device_array(rng, (B, N, H, 2 * d), dtype)[..., ::2] if strided
         else _device_array(rng, (B, N, H, d), dtype))
    k, v = (_device_array(rng, (B, N, H, d), dtype) for _ in range(2))
    opts = dict(layout="bshd", causal=True, **_attention_options(name))
    plan = numflash.explain(q, k, v, **opts)
    if name in ("float16", "bfloat16"):
        assert plan.kernel == "cuda.mma" and plan.config["VEC"] == (0 if strided else 1)
    if name == "3xtf32":
        _expect_3xtf32(plan, q, k, v)
        if strided and plan.device.cc in X3_CCS:
            assert "strided" in plan.rejected["cuda.mma"], str(plan)
    out = cupy.full((B, N, H, d), np.nan, dtype=np.float32).astype(q.dtype)  # bfloat16 too
    res = numflash.attention(q, k, v, out=out, **opts)
    assert res is out
    _assert_accurate(name, out, q, k, v, layout="bshd", causal=True)


FORCED = (  # (input dtype, head dim, the config fields forced)
    [pytest.param("float64", 64, dict(NW=nw, BC=bc, HOLDQ=hq, VEC=vec, MMA=form),
                  id=f"float64-{form}-NW{nw}-BC{bc}-HOLDQ{hq}-VEC{vec}")
     for form in ("m8n8k4", "m16n8k8") for nw, bc, hq in ((8, 64, 0), (8, 32, 1), (4, 16, 0))
     for vec in (1, 0)]
    + [pytest.param("float32", d, dict(NW=nw, BC=bc, HOLDQ=hq, VEC=vec),
                    id=f"3xtf32-d{d}-NW{nw}-BC{bc}-HOLDQ{hq}-VEC{vec}")
       for d, nw, bc, hq, vec in ((64, 8, 64, 0, 1), (64, 8, 64, 0, 0), (64, 8, 64, 1, 1),
                                  (64, 4, 32, 1, 1), (128, 8, 64, 0, 1), (128, 8, 64, 0, 0),
                                  (128, 8, 32, 0, 1), (128, 8, 16, 0, 1))])


def _cannot_force(dtype, fields):
    """Why a device cannot run the forced config, or None."""
    from numflash.cuda.mma import X3_CCS
    if dtype == "float64":
        return lambda dev: ("m16n8k8 .f64 needs sm_90" if fields["MMA"] == "m16n8k8"
                            and dev.cc < (9, 0) else None)
    return lambda dev: None if dev.cc in X3_CCS else f"{dev.name} runs float32 on cuda.block"


@pytest.mark.parametrize("dtype, d, fields", FORCED)
def test_gpu_forced_tiles_and_mma_forms(rng, dtype, d, fields):
    """The configs other GPUs get (sm_80-89: four m8n8k4 per float64 product, smaller tiles,
    sm_80's d=128 3xTF32 tile), the tiles the float64 / 3xTF32 sweeps timed (bench/NOTES.md), and the scalar staging path,
    forced here through mma.run on whatever GPU runs the tests."""
    q, k, v = (_device_array(rng, s, dtype) for s in ((2, 3, 300, d), (2, 3, 777, d),
                                                      (2, 3, 777, d)))
    cfg, rep = run_forced_config(q, k, v, True, skip=_cannot_force(dtype, fields), **fields)
    assert rep.ok, f"{cfg}: {rep}"


@pytest.mark.parametrize("dtype, opts, match", [
    ("float64", {"algorithm": "mma"}, "float64 head dims up to 128"),
    ("float32", {"precision": "tf32"}, "tf32")], ids=["float64", "tf32"])
def test_gpu_d256_runs_on_block_and_mma_refuses(rng, dtype, opts, match):
    import cupy
    q = cupy.asarray(rng.standard_normal((1, 1, 64, 256)).astype(dtype))
    plan = numflash.explain(q, q, q)
    assert plan.kernel == "cuda.block" and "up to 128" in plan.rejected["cuda.mma"]
    with pytest.raises(ValueError, match=match):
        numflash.attention(q, q, q, **opts)


# ------------------------------------------------------------------------------- numerics

@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_gpu_nan_inputs_reach_the_output(rng, where):
    """A NaN in q poisons its row, in k every row, in v its column, as in the reference: never
    zeros (a NaN row sum once took the "row saw no key" path). float32: 3xTF32."""
    import cupy
    from numflash.reference import naive
    host = {n: rng.standard_normal((1, 2, 200, 64)).astype(np.float32) for n in "qkv"}
    host[where][0, 1, 17, 5] = np.nan
    q, k, v = (cupy.asarray(host[n]) for n in "qkv")
    _expect_3xtf32(numflash.explain(q, k, v), q, k, v)
    out, lse = numflash.attention(q, k, v, return_lse=True)
    with np.errstate(invalid="ignore"):
        ref, _ = naive(*(host[n].astype(np.float64) for n in "qkv"), scale=1 / 8.0)
    assert np.isnan(ref).any()
    assert np.array_equal(np.isnan(out.get()), np.isnan(ref))
    # a row whose softmax is poisoned (NaN in q or k) has no log-sum-exp either
    assert np.array_equal(np.isnan(lse.get()), np.isnan(ref).all(axis=-1))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_gpu_lse_does_not_drift_with_the_number_of_key_tiles(rng, dtype):
    """N=131072 keys is 2048 key tiles a row. The running-max rescale must be exactly 1 while
    the max stands: a rescale of 1 + (rounding error) per tile made lse drift by 1.2e-4 here
    (f16 and 3xTF32 alike) where cuda.block stays at ~1e-6. bfloat16 shares the f16 source."""
    import cupy
    from numflash.reference import naive
    N, d = 131072, 64
    host = [rng.standard_normal((1, 1, N, d)).astype(dtype) for _ in range(3)]
    q, k, v = (cupy.asarray(h) for h in host)
    plan = numflash.explain(q, k, v)
    if plan.kernel != "cuda.mma" and dtype == "float32":
        pytest.skip(f"float32 runs on cuda.block on {plan.device.name}")
    if dtype == "float32":
        assert plan.kernel == "cuda.mma", str(plan)
    else:   # cuda.wgmma on compute capability 9.0, which shares the online softmax
        assert_auto_16bit(plan)
    out, lse = numflash.attention(q, k, v, return_lse=True)
    rows = np.r_[0:8, N - 8:N, rng.choice(N, 32, replace=False)]
    qh, kh, vh = (h.astype(np.float64) for h in host)
    _, ref_lse = naive(qh[:, :, rows], kh, vh, scale=1 / np.sqrt(d))
    err = np.abs(lse.get()[:, :, rows].astype(np.float64) - ref_lse).max()
    assert err < 1e-5, f"lse off by {err:.2e} after {N // plan.config['BC']} key tiles"


@pytest.mark.parametrize("algorithm, shape", [
    ("mma", (2, 8, 4096, 64)),
    # 128-row blocks, one per SM: at B2 H8 (512 blocks) the last wave's imbalance left causal
    # only 1.36x faster (bench/NOTES.md); the tiles it skips show at B4 H16
    ("wgmma", (4, 16, 4096, 64)),
])
def test_gpu_causal_skips_tiles(rng, algorithm, shape):
    """Causal does about half the work: it must be clearly faster than non-causal."""
    import cupy
    q, k, v = (_device_array(rng, shape, "float16") for _ in range(3))
    try:   # cuda.wgmma runs on compute capability 9.0 only
        numflash.explain(q, k, v, causal=True, algorithm=algorithm)
    except ValueError as e:
        pytest.skip(str(e))

    def ms(causal):
        numflash.attention(q, k, v, causal=causal, algorithm=algorithm)
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        for _ in range(5):
            numflash.attention(q, k, v, causal=causal, algorithm=algorithm)
        b.record()
        b.synchronize()
        return cupy.cuda.get_elapsed_time(a, b)
    assert ms(True) * 1.4 < ms(False)


# ------------------------------------------------------------------------------- sliding window

WINDOWS = [(64, 0), (200, -1), (-1, 33), (0, 0), (1000, 1000)]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("name", ["float16", "bfloat16", "3xtf32", "float64"])
def test_gpu_sliding_window_against_reference(rng, name, causal, d):
    """window_size on cuda.mma (a key range per row, tiles outside skipped) against the float64
    reference with the same window, Nq != Nk, every causal alignment, GQA; lse of rows with no
    key -inf. float64 at d=128 is refused, saying why (the window's bounds would spill)."""
    dtype = PRECISIONS[name][0]
    B, H, Hk, Nq, Nk = 2, 4, 2, 300, 457
    q = _device_array(rng, (B, H, Nq, d), dtype)
    k, v = (_device_array(rng, (B, Hk, Nk, d), dtype) for _ in range(2))
    for window in WINDOWS:
        opts = dict(causal=causal, window_size=window, **_attention_options(name))
        if name == "float64" and d == 128:
            with pytest.raises(ValueError, match="float64 window_size up to head dim 64"):
                numflash.attention(q, k, v, **opts)
            continue
        plan = numflash.explain(q, k, v, **opts)
        if name == "3xtf32":
            _expect_3xtf32(plan, q, k, v)
            if plan.kernel != "cuda.mma":
                continue
        assert plan.kernel == "cuda.mma" and plan.config["WINDOW"] == 1, str(plan)
        out, lse = numflash.attention(q, k, v, return_lse=True, **opts)
        _assert_accurate(name, out, q, k, v, lse=lse, causal=causal, window_size=window)


def test_gpu_window_skips_tiles(rng):
    """A 1024-key window over 16384 causal keys costs a fraction of the causal kernel (tiles
    outside it are never loaded): under a third of its time (the work is 1/8 of it)."""
    import cupy
    from numflash.bench.timing import median_ms
    q, k, v = (cupy.asarray(rng.standard_normal((1, 8, 16384, 64)).astype(np.float16))
               for _ in range(3))
    full = median_ms(lambda: numflash.attention(q, k, v, causal=True))
    window = median_ms(lambda: numflash.attention(q, k, v, causal=True, window_size=(1024, 0)))
    assert window < full / 3, (window, full)
