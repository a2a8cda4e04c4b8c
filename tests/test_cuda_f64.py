"""float64 on float64 tensor cores (cuda.mma with DT="f64": mma.sync m16n8k8 .f64 on sm_90, four
m8n8k4 .f64 on sm_80). float64 mma products are IEEE double FMAs, so the kernel is held to the same
accuracy rule as every exact kernel (numflash.testing.check).

Without a GPU: the float64 variants compile to cubins for sm_80 / sm_90 (in a subprocess, since
conftest turns numba's simulator on in this one) with the right mma in the PTX and no spills; the
generated source runs under a CPU emulator of the warp (tests/mma_emu.py) against the reference;
the planner's choices and refusals are checked. On a GPU (``-m gpu``): both mma forms alone, and
the kernel through the public API at real sizes. bench/mma_probe.py's ``f64`` section adds timings.
"""
import pathlib
import sys

import numpy as np
import pytest

import numflash
from mma_compile import assert_register_resident, compile_variant
from mma_forced import run_forced_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMEM_LIMIT = {(9, 0): 227 * 1024, (8, 0): 163 * 1024}


def _cfg(D, DV=None, cc=(9, 0), VEC=1):
    from numflash.cuda.mma import _tile
    DV = DV or D
    nw, bc, holdq = _tile(D, DV, "f64", SMEM_LIMIT[cc], VEC)
    return {"D": D, "DV": DV, "NW": nw, "BC": bc, "HOLDQ": holdq, "DT": "f64", "VEC": VEC,
            "MMA": "m16n8k8" if cc >= (9, 0) else "m8n8k4"}


@pytest.mark.parametrize("D, DV, cc, VEC", [(64, 64, (9, 0), 1), (64, 64, (8, 0), 1),
                                            (128, 128, (9, 0), 1), (128, 128, (9, 0), 0),
                                            (32, 128, (9, 0), 0), (32, 64, (8, 0), 0)],
                         ids=["d64-sm90", "d64-sm80", "d128-sm90", "d128-sm90-scalar",
                              "d32-dv128-sm90-scalar", "d32-dv64-sm80-scalar"])
def test_f64_variant_compiles_clean(D, DV, cc, VEC):
    cfg = _cfg(D, DV, cc, VEC)
    got = compile_variant(cfg, cc, ("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64",
                                    "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64",
                                    "ex2.approx", "cp.async.cg.shared.global"))
    ops = got["ops"]
    # one 16x8x8 product per (k-step, key tile) of S and per (key k-step, column tile) of P V
    products = (D // 8) * (cfg["BC"] // 8) + (cfg["BC"] // 8) * (DV // 8)
    if cc >= (9, 0):
        assert ops["mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64"] == products
        assert ops["mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64"] == 0
    else:  # sm_80 has no m16n8k8 .f64: four m8n8k4 each
        assert ops["mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64"] == 4 * products
        assert ops["mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64"] == 0
    assert ops["ex2.approx"] == 0, "float64 must not go through the float32 ex2.approx"
    assert (ops["cp.async.cg.shared.global"] > 0) == bool(VEC)
    assert_register_resident(got)


def test_f64_source_and_shared_memory():
    from numflash.cuda import mma
    for D in (32, 64, 96, 128):
        for cc in SMEM_LIMIT:
            cfg = _cfg(D, cc=cc)
            if cfg["MMA"] == "m8n8k4" and D > 64:
                continue
            src = mma.kernel_source_word(D, D, cfg["NW"], cfg["BC"], cfg["HOLDQ"], "f64",
                                         VEC=cfg["VEC"])
            compile(src, "<f64>", "exec")
            assert "mma_f64(" in src and "to_tf32" not in src and "local.array" not in src
            assert "cuda.shared.array(0, float64)" in src and "cp_async_16(" in src
            assert mma.smem_bytes(cfg) <= SMEM_LIMIT[cc]
    # float64 words: 8 bytes each, Q/K rows padded by 4 words, V rows by 2; VEC double-buffers
    cfg = dict(_cfg(64), HOLDQ=0)
    BR, kv = 16 * cfg["NW"], cfg["BC"] * 68 + cfg["BC"] * 66
    assert mma.smem_bytes(dict(cfg, VEC=0)) == 8 * (BR * 68 + kv)
    assert mma.smem_bytes(cfg) == 8 * (BR * 68 + 2 * kv)
    # a smaller shared memory takes a smaller tile, never a refusal of d=64
    assert mma._tile(64, 64, "f64", 99 * 1024, 1) == (8, 32, 1)
    for D, tiles in mma.F64_TILES.items():  # each entry needs less than the one before it, so
        sizes = [mma.smem_bytes({"D": D, "DV": D, "NW": nw, "BC": bc, "HOLDQ": hq, "DT": "f64",
                                 "VEC": 1}) for nw, bc, hq in tiles]  # each can be chosen
        assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes


def test_f64_fragment_loads_are_bank_conflict_free():
    """A 64-bit shared load is served a half-warp at a time: lanes 0-15 (g = 0..3, t = 0..3) must
    hit 16 distinct 8-byte slots modulo 16 (32 four-byte banks) for Q/K (row g, column t) and for V
    (row 2t, column g) -- the pads of mma.word_pads make it so for every padded head dim."""
    from numflash.cuda import mma
    qk_pad, v_pad = mma.word_pads("f64")
    for D in mma.HEAD_DIMS[:-1]:
        for half in (0, 1):
            lanes = range(16 * half, 16 * half + 16)
            qk = {((l // 4) * (D + qk_pad) + l % 4) % 16 for l in lanes}
            vv = {((l % 4) * 2 * (D + v_pad) + l // 4) % 16 for l in lanes}
            assert len(qk) == 16 and len(vv) == 16, (D, half, qk, vv)


@pytest.mark.parametrize("case", [(1, 2, 40, 170, 64, 64, False, 1, None),
                                  (1, 1, 33, 90, 32, 96, "bottom_right", 1, None),
                                  (1, 1, 70, 50, 59, 40, True, 0, None),
                                  (1, 1, 150, 100, 64, 64, True, 1, (8, 32, 1))],
                         ids=["d64-cp.async", "d32-dv96-bottom_right-cp.async",
                              "d59-dv40-causal-scalar", "d64-q-in-registers-cp.async"])
def test_f64_source_emulated_on_cpu(rng, case):
    """The generated float64 kernel source, run by a CPU emulator of the warp: the fragment
    bookkeeping (S layout, the permuted-k P V, masking, softmax, epilogue) meets the accuracy rule
    of every exact kernel. The inline-PTX mma itself is checked on the GPU only."""
    sys.path.insert(0, str(ROOT / "tests"))
    from mma_emu import run_word_kernel
    from numflash.inputs import parse_causal
    from numflash.reference import naive
    from numflash.testing import check
    B, H, Nq, Nk, d, dv, causal, vec, tile = case
    q, k, v = (rng.standard_normal(s) for s in ((B, H, Nq, d), (B, H, Nk, d), (B, H, Nk, dv)))
    is_causal, off = parse_causal(causal, Nq, Nk)
    out, lse = run_word_kernel(q, k, v, "f64", is_causal, off, VEC=vec, tile=tile)
    rep = check(out, q, k, v, causal=causal)
    assert rep.ok, str(rep)
    assert rep.max_err < 1e-12, str(rep)  # float64 all the way
    _, ref_lse = naive(q, k, v, scale=1 / np.sqrt(d), causal=is_causal, causal_offset=off)
    inf = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), inf)
    assert np.allclose(lse[~inf], ref_lse[~inf], rtol=1e-12, atol=1e-12)  # lse is float64


class _Arr:
    """Just enough of a device array for mma.config (shape, dtype, strides, itemsize, data.ptr)."""

    def __init__(self, shape, dtype="float64"):
        a = np.empty(shape, dtype)
        self.shape, self.dtype, self.strides = a.shape, a.dtype, a.strides
        self.itemsize = a.itemsize
        self.data = type("P", (), {"ptr": 0})()


class _Problem:
    def __init__(self, d, dv=None, dtype="float64", precision="auto"):
        dv = dv or d
        self.q, self.k, self.v = (_Arr(s, dtype) for s in ((1, 2, 64, d), (1, 2, 64, d),
                                                            (1, 2, 64, dv)))
        self.dtype, self.shape, self.precision = self.q.dtype, (1, 2, 64, 64, d, dv), precision
        self.on_device = True


@pytest.mark.parametrize("cc, want", [((9, 0), "m16n8k8"), ((8, 0), "m8n8k4"), ((8, 9), "m8n8k4"),
                                      ((10, 0), "m16n8k8")])
def test_config_picks_the_mma_form_by_compute_capability(cc, want):
    from numflash.cuda import mma
    from numflash.plan import Device
    cfg = mma.config(_Problem(64), Device("gpu", cc=cc, smem_per_block_optin=227 * 1024))
    assert cfg["DT"] == "f64" and cfg["MMA"] == want and cfg["VEC"] == 1


def test_config_refuses_what_f64_cannot_run_and_says_why():
    from numflash.cuda import mma
    from numflash.plan import Device, Unsupported
    dev = Device("gpu", cc=(9, 0), smem_per_block_optin=227 * 1024)
    with pytest.raises(Unsupported, match="float64 head dims up to 128.*cuda.block"):
        mma.config(_Problem(256), dev)
    with pytest.raises(Unsupported, match="float64 head dims up to 128"):
        mma.config(_Problem(64, 200), dev)
    ampere = Device("a100", cc=(8, 0), smem_per_block_optin=163 * 1024)
    with pytest.raises(Unsupported, match=r"up to 64 on a100 \(mma m8n8k4\).*cuda.block"):
        mma.config(_Problem(59, 111), ampere)  # four m8n8k4 per product spill at dv=128
    assert mma.config(_Problem(59, 64), ampere)["D"] == 64
    # 99 KB a block (sm_120): d=64 takes the smaller tile; d=96 with cp.async double buffering
    # would not fit, so it stages with scalar loads rather than being refused
    small = Device("sm120", cc=(12, 0), smem_per_block_optin=99 * 1024)
    assert mma.config(_Problem(64), small)["NW"] == 8 and mma.config(_Problem(64), small)["VEC"]
    cfg = mma.config(_Problem(96), small)
    assert cfg["VEC"] == 0 and mma.smem_bytes(cfg) <= 99 * 1024
    assert mma.config(_Problem(64), Device("sim-like", cc=None, smem_per_block_optin=227 * 1024))
    with pytest.raises(Unsupported, match="compute capability >= 8.0"):
        mma.config(_Problem(64), Device("turing", cc=(7, 5)))
    with pytest.raises(Unsupported, match="shared memory"):  # d=128 holds Q in shared memory
        mma.config(_Problem(128), Device("small", cc=(9, 0), smem_per_block_optin=48 * 1024))


def test_kernel_spec_declares_float64():
    from numflash.plan import kernel_specs
    spec = kernel_specs()["cuda.mma"]
    assert "float64" in spec.dtypes and spec.min_cc == (8, 0) and not spec.runs_in_simulator


def test_simulator_runs_float64_on_block_and_says_why_not_mma(rng):
    q = rng.standard_normal((1, 1, 8, 16))
    plan = numflash.explain(q, q, q, backend="cuda")
    assert plan.kernel == "cuda.block"
    assert "simulator" in plan.rejected["cuda.mma"]


# ------------------------------------------------------------------------------------- GPU

def _run_mma_16x8x8(intrinsic, A, Bm, C):
    sys.path.insert(0, str(ROOT / "bench"))
    from mma_probe import run_mma_16x8x8
    return run_mma_16x8x8(intrinsic, A, Bm, C)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["mma_f64_m16n8k8", "mma_f64_m8n8k4x4"])
def test_gpu_mma_f64_alone(rng, form):
    import cupy
    from numflash.cuda import ptx
    if form == "mma_f64_m16n8k8" and cupy.cuda.Device().compute_capability < "90":
        pytest.skip("m16n8k8 .f64 needs sm_90")
    A, Bm, C = (rng.standard_normal(s) for s in ((16, 8), (8, 8), (16, 8)))
    D = _run_mma_16x8x8(getattr(ptx, form), A, Bm, C)
    assert np.abs(D - (A @ Bm + C)).max() < 1e-13


GPU_CASES = [  # (B, H, Nq, Nk, d, dv)
    (1, 1, 1, 1, 64, 64),
    (2, 3, 128, 128, 64, 64),
    (2, 3, 300, 777, 64, 64),
    (1, 2, 777, 300, 128, 128),
    (2, 2, 1025, 1025, 128, 128),
    (2, 3, 200, 333, 59, 111),
    (1, 2, 97, 1025, 1, 8),
    (2, 4, 4096, 4096, 64, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_gpu_f64_against_reference(rng, case, causal):
    import cupy
    from numflash.testing import check
    B, H, Nq, Nk, d, dv = case
    q, k, v = (cupy.asarray(rng.standard_normal(s))
               for s in ((B, H, Nq, d), (B, H, Nk, d), (B, H, Nk, dv)))
    plan = numflash.explain(q, k, v, causal=causal)
    from numflash.cuda.mma import head_dim_pad
    dev = plan.device
    # d <= 64 runs on cuda.mma on every cc >= 8.0; d <= 128 on sm_90-class parts (m16n8k8 .f64
    # and ~227 KB of shared memory a block); elsewhere cuda.block, with mma's reason recorded
    if max(head_dim_pad(d), head_dim_pad(dv)) <= 64 or (
            dev.cc >= (9, 0) and dev.smem_per_block_optin >= 200 * 1024):
        assert plan.kernel == "cuda.mma" and plan.config["DT"] == "f64", str(plan)
    else:
        assert plan.kernel == "cuda.block" and "cuda.mma" in plan.rejected, str(plan)
    out, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == cupy.float64 and type(out) is type(q)
    rows = None if Nq <= 1025 else np.arange(0, Nq, 37)
    rep = check(out, q, k, v, lse=lse, causal=causal, rows=rows)
    assert rep.ok, str(rep)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["m8n8k4", "m16n8k8"])
@pytest.mark.parametrize("tile", [t + (vec,) for t in ((8, 64, 0), (8, 32, 1), (4, 16, 0))
                                  for vec in (1, 0)],
                         ids=lambda t: "NW{}-BC{}-HOLDQ{}-VEC{}".format(*t))
def test_gpu_f64_every_tile_and_mma_form(rng, form, tile):
    """The configs other GPUs get (sm_80-89: four m8n8k4 per product, the smaller tiles), forced
    here on whatever GPU runs the tests, through mma.run, against the reference."""
    import cupy
    nw, bc, holdq, vec = tile
    q, k, v = (cupy.asarray(rng.standard_normal(s)) for s in ((2, 3, 300, 64), (2, 3, 777, 64),
                                                             (2, 3, 777, 64)))
    cfg, rep = run_forced_config(
        q, k, v, True, NW=nw, BC=bc, HOLDQ=holdq, VEC=vec, MMA=form,
        skip=lambda dev: "m16n8k8 .f64 needs sm_90" if form == "m16n8k8" and dev.cc < (9, 0)
        else None)
    assert rep.ok, f"{cfg}: {rep}"


@pytest.mark.gpu
def test_gpu_f64_bshd_strided_and_out(rng):
    import cupy
    from numflash.testing import check
    B, N, H, d = 2, 300, 4, 64
    q = cupy.asarray(rng.standard_normal((B, N, H, 2 * d)))[..., ::2]
    k, v = (cupy.asarray(rng.standard_normal((B, N, H, d))) for _ in range(2))
    out = cupy.full((B, N, H, d), np.nan)
    res = numflash.attention(q, k, v, layout="bshd", causal=True, out=out)
    assert res is out
    rep = check(out, q, k, v, layout="bshd", causal=True)
    assert rep.ok, str(rep)


@pytest.mark.gpu
def test_gpu_f64_d256_runs_on_block_and_mma_refuses(rng):
    import cupy
    q = cupy.asarray(rng.standard_normal((1, 1, 64, 256)))
    plan = numflash.explain(q, q, q)
    assert plan.kernel == "cuda.block" and "up to 128" in plan.rejected["cuda.mma"]
    with pytest.raises(ValueError, match="float64 head dims up to 128"):
        numflash.attention(q, q, q, algorithm="mma")
