"""float32 on tf32 tensor cores as 3xTF32 (cuda.mma with DT="3xtf32"): every operand split into
two tf32 values (x = hi + lo), every product three tf32 mma, O accumulated in float32 outside the
tensor cores. It is what precision="auto" runs for float32 on compute capability 8.0 / 9.0, so it
is held to the accuracy rule of the FMA kernels (numflash.testing.check).

Without a GPU: the variants the planner picks compile to cubins for sm_80 / sm_90 (in a
subprocess, since conftest turns numba's simulator on in this one) with three mma per product and
no spills; the generated source runs under a CPU emulator of the warp (tests/mma_emu.py) against
the reference; the planner's choices and refusals are checked. On a GPU (``-m gpu``): the split
intrinsic bit for bit against the emulator's, and the kernel through the public API at real
sizes. bench/mma_probe.py's ``x3`` section adds timings.
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
MMA_TF32 = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"


def _cfg(D, DV=None, cc=(9, 0)):
    from numflash.cuda.mma import _tile
    DV = DV or D
    nw, bc, holdq = _tile(D, DV, "3xtf32", SMEM_LIMIT[cc], 1, cc)
    return {"D": D, "DV": DV, "NW": nw, "BC": bc, "HOLDQ": holdq, "DT": "3xtf32", "VEC": 1}


def _f32(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("D, DV, cc", [(64, 64, (9, 0)), (128, 128, (9, 0)), (96, 96, (9, 0)),
                                       (96, 128, (9, 0)), (128, 128, (8, 0)), (64, 128, (8, 0)),
                                       (32, 96, (8, 0))],
                         ids=["d64-sm90", "d128-sm90", "d96-sm90", "d96-dv128-sm90", "d128-sm80",
                              "d64-dv128-sm80", "d32-dv96-sm80"])
def test_3xtf32_variant_compiles_clean(D, DV, cc):
    cfg = _cfg(D, DV, cc)
    got = compile_variant(cfg, cc, (MMA_TF32, "cvt.rna.tf32.f32", "cp.async.cg.shared.global"))
    ops = got["ops"]
    # three tf32 mma per 16x8x8 product: (k-step, key tile) of S, (key k-step, column tile) of PV
    products = (cfg["D"] // 8) * (cfg["BC"] // 8) + (cfg["BC"] // 8) * (cfg["DV"] // 8)
    assert ops[MMA_TF32] == 3 * products
    assert ops["cvt.rna.tf32.f32"] == 0, "operands are split by integer add and mask"
    assert ops["cp.async.cg.shared.global"] > 0
    assert_register_resident(got)


def test_3xtf32_source_and_shared_memory():
    from numflash.cuda import mma
    for D in (32, 64, 96, 128):
        for cc, limit in SMEM_LIMIT.items():
            cfg = _cfg(D, cc=cc)
            src = mma.kernel_source_word(D, D, cfg["NW"], cfg["BC"], cfg["HOLDQ"], "3xtf32",
                                         VEC=1)
            compile(src, "<3xtf32>", "exec")
            assert "split_tf32(" in src and "to_tf32" not in src and "local.array" not in src
            assert "cuda.shared.array(0, float32)" in src and "cp_async_16(" in src
            # O is rescaled where each tile's P V is added, never inside an mma
            assert "o_0_0 = o_0_0 * alpha0 + (pv0 + pc0)" in src and "o_0_0 *= alpha0" not in src
            assert mma.smem_bytes(cfg) <= limit
    # the wide tile where it fits in registers and shared memory (d=128: 202 KB, sm_90 only);
    # 32 keys elsewhere, 16 at dv=128 (ptxas spills 32 there on sm_80, and at d=96 on sm_90)
    tiles = {(D, DV, cc): _cfg(D, DV, cc)["BC"]
             for D, DV in ((64, 64), (128, 128), (96, 96), (64, 128), (32, 96)) for cc in SMEM_LIMIT}
    assert tiles == {(64, 64, (9, 0)): 64, (64, 64, (8, 0)): 64,
                     (128, 128, (9, 0)): 64, (128, 128, (8, 0)): 16,
                     (96, 96, (9, 0)): 32, (96, 96, (8, 0)): 32,
                     (64, 128, (9, 0)): 16, (64, 128, (8, 0)): 16,
                     (32, 96, (9, 0)): 32, (32, 96, (8, 0)): 32}
    assert mma._tile(128, 128, "3xtf32", 100 * 1024, 1, (9, 0)) == (8, 32, 0)


def test_split_tf32_emulation_is_a_tight_split(rng):
    """What the emulator (and the GPU test below, bit for bit) holds ptx.split_tf32 to: hi is x
    rounded to 10 mantissa bits as the mma reads it, hi + lo (lo read the same way) is x to
    2**-21 relative, far tighter than the 2**-11 of one tf32 value (down to where lo is
    subnormal: tf32 subnormals are multiples of 2**-136); NaN and infinity survive the split."""
    sys.path.insert(0, str(ROOT / "tests"))
    from mma_emu import split_tf32_bits, tf32_bits, tf32_operand
    xs = np.concatenate([_f32(rng, 2000) * np.float32(10.0) ** rng.integers(-30, 30, 2000),
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


@pytest.mark.parametrize("case", [(1, 2, 40, 170, 64, 64, False, 1, None),
                                  (1, 1, 33, 90, 32, 96, "bottom_right", 1, None),
                                  (1, 1, 70, 50, 59, 40, True, 0, (2, 32, 0)),
                                  (1, 1, 40, 60, 128, 128, True, 1, (2, 32, 0)),
                                  (1, 1, 150, 100, 64, 64, True, 1, (8, 32, 1))],
                         ids=["d64-cp.async", "d32-dv96-bottom_right-cp.async",
                              "d59-dv40-causal-scalar", "d128-causal-cp.async",
                              "d64-q-in-registers-cp.async"])
def test_3xtf32_source_emulated_on_cpu(rng, case):
    """The generated 3xTF32 kernel source, run by a CPU emulator of the warp: the split operands,
    the separate small-term accumulators, the per-tile P V merged into O, masking and softmax
    meet the accuracy rule of every exact kernel. The inline PTX runs on the GPU only."""
    sys.path.insert(0, str(ROOT / "tests"))
    from mma_emu import run_word_kernel
    from numflash.inputs import parse_causal
    from numflash.reference import naive
    from numflash.testing import check
    B, H, Nq, Nk, d, dv, causal, vec, tile = case
    q, k, v = _f32(rng, (B, H, Nq, d)), _f32(rng, (B, H, Nk, d)), _f32(rng, (B, H, Nk, dv))
    is_causal, off = parse_causal(causal, Nq, Nk)
    out, lse = run_word_kernel(q, k, v, "3xtf32", is_causal, off, VEC=vec, tile=tile)
    rep = check(out, q, k, v, causal=causal)
    assert rep.ok, str(rep)
    # one tf32 mma per product would be ~1e-3 off: the split must carry float32's accuracy
    assert rep.rel_err < 2e-6, str(rep)
    _, ref_lse = naive(q, k, v, scale=1 / np.sqrt(d), causal=is_causal, causal_offset=off)
    inf = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), inf)
    assert np.allclose(lse[~inf], ref_lse[~inf], rtol=1e-5, atol=1e-5)


class _Arr:
    """Just enough of a device array for mma.config (shape, dtype, strides, itemsize, data.ptr)."""

    def __init__(self, shape, strided=False):
        a = np.empty(shape[:-1] + (2 * shape[-1],) if strided else shape, np.float32)
        a = a[..., ::2] if strided else a
        self.shape, self.dtype, self.strides = a.shape, a.dtype, a.strides
        self.itemsize = a.itemsize
        self.data = type("P", (), {"ptr": 0})()


class _Problem:
    def __init__(self, d, dv=None, precision="auto", strided=False):
        dv = dv or d
        self.q = _Arr((1, 2, 64, d), strided)
        self.k, self.v = _Arr((1, 2, 64, d)), _Arr((1, 2, 64, dv))
        self.dtype, self.shape, self.precision = self.q.dtype, (1, 2, 64, 64, d, dv), precision
        self.on_device = True


def test_config_takes_float32_as_3xtf32_where_it_wins():
    from numflash.cuda import mma
    from numflash.plan import Device
    hopper = Device("h100", cc=(9, 0), smem_per_block_optin=227 * 1024)
    ampere = Device("a100", cc=(8, 0), smem_per_block_optin=163 * 1024)
    for d, dev, tile in ((64, hopper, (8, 64, 0)), (128, hopper, (8, 64, 0)),
                         (128, ampere, (8, 16, 0)), (96, ampere, (8, 32, 0)),
                         (8, hopper, (8, 64, 0))):
        cfg = mma.config(_Problem(d), dev)
        assert cfg["DT"] == "3xtf32" and cfg["VEC"] == 1, cfg
        assert (cfg["NW"], cfg["BC"], cfg["HOLDQ"]) == tile and "MMA" not in cfg
    # precision="tf32" keeps the one-mma kernel, staged (and rounded) by scalar loads
    cfg = mma.config(_Problem(64, precision="tf32"), hopper)
    assert cfg["DT"] == "tf32" and cfg["VEC"] == 0


def test_config_refuses_what_3xtf32_cannot_win_and_says_why():
    from numflash.cuda import mma
    from numflash.plan import Device, Unsupported
    hopper = Device("h100", cc=(9, 0), smem_per_block_optin=227 * 1024)
    with pytest.raises(Unsupported, match="float32 head dims up to 128.*cuda.block"):
        mma.config(_Problem(256), hopper)
    for cc in ((8, 6), (8, 9), (12, 0)):  # tf32 tensor cores at about the FMA rate
        dev = Device(f"sm{cc[0]}{cc[1]}", cc=cc, smem_per_block_optin=99 * 1024)
        with pytest.raises(Unsupported, match="3xTF32.*8.0 / 9.0.*cuda.block is faster"):
            mma.config(_Problem(64), dev)
        assert mma.config(_Problem(64, precision="tf32"), dev)["DT"] == "tf32"
    with pytest.raises(Unsupported, match="cp.async.*last axis is strided.*slower than "
                                          "cuda.block"):
        mma.config(_Problem(64, strided=True), hopper)
    with pytest.raises(Unsupported, match="head dim 59 is not a multiple of 4"):
        mma.config(_Problem(59), hopper)
    with pytest.raises(Unsupported, match="precision='ieee'.*cuda.block"):
        mma.config(_Problem(64, precision="ieee"), hopper)
    with pytest.raises(Unsupported, match="compute capability >= 8.0"):
        mma.config(_Problem(64), Device("turing", cc=(7, 5)))


def test_kernel_spec_declares_float32():
    from numflash.plan import IEEE_REASON, kernel_specs
    specs = kernel_specs()
    assert "float32" in specs["cuda.mma"].dtypes and specs["cuda.mma"].tf32
    assert "3xTF32" in specs["cuda.mma"].summary and "cuda.block" in IEEE_REASON


@pytest.mark.simulator
def test_simulator_explains_float32_choices(rng):
    q = _f32(rng, (1, 2, 33, 64))
    plan = numflash.explain(q, q, q, backend="cuda")
    assert plan.kernel == "cuda.block" and "simulator" in plan.rejected["cuda.mma"]
    plan = numflash.explain(q, q, q, backend="cuda", precision="ieee")
    assert plan.kernel == "cuda.block" and "precision='ieee'" in plan.rejected["cuda.mma"]
    with pytest.raises(ValueError, match="precision='ieee' keeps float32 on the FMA units"):
        numflash.attention(q, q, q, backend="cuda", algorithm="mma", precision="ieee")


# ------------------------------------------------------------------------------------- GPU

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


@pytest.mark.gpu
def test_gpu_split_tf32_matches_the_emulator_bit_for_bit(rng):
    sys.path.insert(0, str(ROOT / "tests"))
    from mma_emu import split_tf32_bits
    x = np.concatenate([_f32(rng, 4000) * np.float32(10.0) ** rng.integers(-30, 30, 4000),
                        np.float32([0.0, -0.0, 1.0, 3.0e38, -1.5e-38, 1e-45, 1.0000001])])
    special = np.array([0x7F800000, 0xFF800000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000],
                       np.uint32).view(np.float32)
    x = np.concatenate([x.astype(np.float32), special])
    hi, lo = _gpu_split(x)
    want = np.array([split_tf32_bits(e) for e in x], np.uint32)
    finite = np.isfinite(x)  # lo of inf / NaN is a NaN whose bits differ between GPU and numpy
    assert np.array_equal(hi, want[:, 0]) and np.array_equal(lo[finite], want[finite, 1])


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_gpu_nan_inputs_reach_the_output(rng, where):
    """A NaN in q poisons its row, in k every row, in v its column, as in the reference: never
    zeros (a NaN row sum once took the "row saw no key" path)."""
    import cupy
    from numflash.reference import naive
    host = {n: _f32(rng, (1, 2, 200, 64)) for n in "qkv"}
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


GPU_CASES = [  # (B, H, Nq, Nk, d, dv)
    (1, 1, 1, 1, 64, 64),
    (2, 3, 128, 128, 64, 64),
    (2, 3, 300, 777, 64, 64),
    (1, 2, 777, 300, 128, 128),
    (2, 2, 1025, 1025, 128, 128),
    (2, 3, 200, 333, 32, 96),
    (2, 3, 200, 333, 96, 64),
    (1, 2, 97, 1025, 8, 8),
    (2, 4, 4096, 4096, 64, 64),
    (1, 2, 16384, 16384, 128, 128),   # error must not grow with the number of keys
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_gpu_3xtf32_against_reference(rng, case, causal):
    import cupy
    from numflash.testing import check
    B, H, Nq, Nk, d, dv = case
    q, k, v = (cupy.asarray(_f32(rng, s)) for s in ((B, H, Nq, d), (B, H, Nk, d), (B, H, Nk, dv)))
    plan = numflash.explain(q, k, v, causal=causal)
    _expect_3xtf32(plan, q, k, v)
    assert numflash.explain(q, k, v, causal=causal, precision="ieee").kernel == "cuda.block"
    out, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == cupy.float32 and type(out) is type(q)
    rows = None if Nq <= 1025 else np.unique(np.r_[0:16, Nq - 16:Nq, 16:Nq:61])
    rep = check(out, q, k, v, lse=lse, causal=causal, rows=rows)
    assert rep.ok, str(rep)


TILES = [(64, 8, 64, 0, 1), (64, 8, 64, 0, 0), (64, 8, 64, 1, 1), (64, 4, 32, 1, 1),
         (128, 8, 64, 0, 1), (128, 8, 64, 0, 0), (128, 8, 32, 0, 1), (128, 8, 16, 0, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("d, nw, bc, holdq, vec", TILES,
                         ids=["d{}-NW{}-BC{}-HOLDQ{}-VEC{}".format(*t) for t in TILES])
def test_gpu_3xtf32_every_tile(rng, d, nw, bc, holdq, vec):
    """Tiles other GPUs get (sm_80's d=128 tile), tiles bench/mma_probe.py times, and the scalar
    staging path, forced through mma.run."""
    import cupy
    from numflash.cuda.mma import X3_CCS
    q, k, v = (cupy.asarray(_f32(rng, s)) for s in ((2, 3, 300, d), (2, 3, 777, d),
                                                    (2, 3, 777, d)))
    cfg, rep = run_forced_config(
        q, k, v, True, NW=nw, BC=bc, HOLDQ=holdq, VEC=vec,
        skip=lambda dev: None if dev.cc in X3_CCS else f"{dev.name} runs float32 on cuda.block")
    assert rep.ok, f"{cfg}: {rep}"


@pytest.mark.gpu
def test_gpu_3xtf32_layouts_strides_and_out(rng):
    import cupy
    from numflash.testing import check
    B, N, H, d = 2, 300, 4, 64
    k, v = (cupy.asarray(_f32(rng, (B, N, H, d))) for _ in range(2))
    for q in (cupy.asarray(_f32(rng, (B, N, H, d))),                # bshd, 16-byte rows
              cupy.asarray(_f32(rng, (B, N, H, 2 * d)))[..., ::2]):  # strided: cuda.block
        plan = numflash.explain(q, k, v, layout="bshd", causal=True)
        if q.strides[-1] != 4:
            assert plan.kernel == "cuda.block" and "strided" in plan.rejected["cuda.mma"]
        else:
            _expect_3xtf32(plan, q, k, v)
        out = cupy.full((B, N, H, d), np.nan, dtype=cupy.float32)
        res = numflash.attention(q, k, v, layout="bshd", causal=True, out=out)
        assert res is out
        rep = check(out, q, k, v, layout="bshd", causal=True)
        assert rep.ok, str(rep)
