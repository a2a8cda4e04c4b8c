"""How cuda.mma is configured, with no GPU: head-dim padding, the tile tables and the shared
memory each tile takes, the config the planner picks for a problem on a device (or its refusal and
the reason), what the kernel spec declares, the ``precision`` option, and the refusals numba's
simulator explains."""
import numpy as np
import pytest

import numflash
from mma_tools import SMEM_LIMIT, tile_config
from numflash.plan import Device

HOPPER = Device("h100", cc=(9, 0), smem_per_block_optin=227 * 1024)
AMPERE = Device("a100", cc=(8, 0), smem_per_block_optin=163 * 1024)
TURING = Device("turing", cc=(7, 5))


def _f32(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------------------- tiles

def test_head_dims_pad_to_supported_sizes():
    from numflash.cuda import mma
    from numflash.plan import Unsupported
    assert [mma.head_dim_pad(n) for n in (1, 32, 33, 59, 64, 65, 96, 111, 128, 129, 256)] == \
        [32, 32, 64, 64, 64, 96, 96, 128, 128, 256, 256]
    with pytest.raises(Unsupported):
        mma.head_dim_pad(257)


DEFAULT_TILES = (  # (kind, D, cc, VEC, shared memory the tile must fit)
    [("f16", D, (9, 0), VEC, 160 * 1024) for D in (32, 64, 96, 128, 256) for VEC in (0, 1)]
    + [("tf32", D, (9, 0), 0, 160 * 1024) for D in (32, 64, 96, 128)]  # A100's opt-in is 163 KiB
    + [("f64", D, cc, 1, SMEM_LIMIT[cc]) for D in (32, 64, 96, 128) for cc in SMEM_LIMIT
       if cc >= (9, 0) or D <= 64]  # sm_80 (m8n8k4) takes float64 up to d=64
    + [("3xtf32", D, cc, 1, SMEM_LIMIT[cc]) for D in (32, 64, 96, 128) for cc in SMEM_LIMIT])


@pytest.mark.parametrize("DT, D, cc, VEC, limit", DEFAULT_TILES,
                         ids=[f"{t[0]}-d{t[1]}-sm{t[2][0]}{t[2][1]}-VEC{t[3]}"
                              for t in DEFAULT_TILES])
def test_default_tile_fits_shared_memory(DT, D, cc, VEC, limit):
    from numflash.cuda import mma
    assert mma.shared_bytes(tile_config(DT, D, cc=cc, VEC=VEC)) <= limit


def test_f64_shared_memory_layout():
    """float64 words: 8 bytes each, Q/K rows padded by 4 words, V rows by 2; VEC double-buffers
    K/V. shared_bytes takes an MmaConfig or a mapping of its fields."""
    import dataclasses
    from numflash.cuda import mma
    cfg = dataclasses.replace(tile_config("f64", 64), HOLDQ=0)
    BR, kv = 16 * cfg.NW, cfg.BC * 68 + cfg.BC * 66
    assert mma.shared_bytes(dataclasses.replace(cfg, VEC=0)) == 8 * (BR * 68 + kv)
    assert mma.shared_bytes(cfg) == 8 * (BR * 68 + 2 * kv)
    assert mma.shared_bytes(dict(cfg)) == mma.shared_bytes(cfg)


@pytest.mark.parametrize("DT, D, limit, cc, want", [("f64", 64, 99 * 1024, None, (8, 32, 1)),
                                                    ("3xtf32", 128, 100 * 1024, (9, 0),
                                                     (8, 32, 0))], ids=["f64", "3xtf32"])
def test_less_shared_memory_takes_a_smaller_tile(DT, D, limit, cc, want):
    """Never a refusal where a smaller tile fits (d=64 float64 on the 99 KB of sm_86/89/120)."""
    from numflash.cuda import mma
    assert mma.choose_tile(D, D, DT, limit, 1, cc) == want


def test_f64_tiles_need_ever_less_shared_memory():
    """Each F64_TILES entry needs less than the one before it, so each can be chosen."""
    from numflash.cuda import mma
    from numflash.cuda.mma.tiles import F64_TILES
    for D, tiles in F64_TILES.items():
        sizes = [mma.shared_bytes(mma.MmaConfig(D, D, nw, bc, hq, "f64", 1)) for nw, bc, hq in tiles]
        assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes


def test_3xtf32_keys_per_tile_by_head_dims_and_architecture():
    """The wide tile where it fits in registers and shared memory (d=128: 202 KB, sm_90 only);
    32 keys elsewhere, 16 at dv=128 (ptxas spills 32 there on sm_80, and at d=96 on sm_90)."""
    tiles = {(D, DV, cc): tile_config("3xtf32", D, DV, cc).BC
             for D, DV in ((64, 64), (128, 128), (96, 96), (64, 128), (32, 96))
             for cc in SMEM_LIMIT}
    assert tiles == {(64, 64, (9, 0)): 64, (64, 64, (8, 0)): 64,
                     (128, 128, (9, 0)): 64, (128, 128, (8, 0)): 16,
                     (96, 96, (9, 0)): 32, (96, 96, (8, 0)): 32,
                     (64, 128, (9, 0)): 16, (64, 128, (8, 0)): 16,
                     (32, 96, (9, 0)): 32, (32, 96, (8, 0)): 32}


# ------------------------------------------------------------------------------- config choice

class _Arr:
    """Just enough of a device array for mma.config (shape, dtype, strides, itemsize, data.ptr)."""

    def __init__(self, shape, dtype, strided=False):
        a = np.empty(shape[:-1] + (2 * shape[-1],) if strided else shape, dtype)
        a = a[..., ::2] if strided else a
        self.shape, self.dtype, self.strides = a.shape, a.dtype, a.strides
        self.itemsize = a.itemsize
        self.data = type("P", (), {"ptr": 0})()


class _Problem:
    """Just enough of a normalized problem for mma.config: B=1, H=2, 64 queries and keys."""

    def __init__(self, dtype, d, dv=None, precision="auto", strided=False):
        dv = dv or d
        self.q = _Arr((1, 2, 64, d), dtype, strided)
        self.k, self.v = _Arr((1, 2, 64, d), dtype), _Arr((1, 2, 64, dv), dtype)
        self.dtype, self.shape, self.precision = self.q.dtype, (1, 2, 64, 64, d, dv), precision
        self.dtype_name, self.on_device = self.dtype.name, True


def _gpu(cc, smem=227 * 1024, name=None):
    return Device(name or f"sm{cc[0]}{cc[1]}", cc=cc, smem_per_block_optin=smem)


def check_key_pass_gradient_refusals(p, dev, field, request, mode_of, deterministic_says,
                                     packed_refused=True):
    """For a gradient the backward's key pass adds atomically (attn_bias's: DBIAS, mod_args':
    MARGS; ``p`` asks for it through attribute ``request``): deterministic=True refuses it
    (saying ``deterministic_says``), packed sequences refuse it where ``packed_refused``
    (``mode_of(p)`` raises; else it gives the same mode), and without it the key pass has no
    ``field``."""
    from numflash.cuda.mma import gradients
    from numflash.device import Unsupported
    p.deterministic = True
    with pytest.raises(Unsupported, match=deterministic_says):
        gradients.config(p, dev)
    p.deterministic = False
    alone = mode_of(p)
    p.varlen = object()
    if packed_refused:
        with pytest.raises(Unsupported, match="packed sequences"):
            mode_of(p)
    else:
        assert mode_of(p) == alone
    p.varlen = None
    setattr(p, request, None)
    assert field not in dict(gradients.config(p, dev)["keys"])


CHOICES = [  # (dtype, d, dv, precision, device, the config fields it must get)
    # float64: the mma form by compute capability, smaller tiles / scalar staging on less smem
    *[pytest.param("float64", 64, None, "auto", _gpu(cc), dict(DT="f64", MMA=form, VEC=1),
                   id=f"float64-form-sm{cc[0]}{cc[1]}")
      for cc, form in (((9, 0), "m16n8k8"), ((8, 0), "m8n8k4"), ((8, 9), "m8n8k4"),
                       ((10, 0), "m16n8k8"))],
    pytest.param("float64", 59, 64, "auto", AMPERE, dict(D=64, DV=64), id="float64-d59-sm80"),
    pytest.param("float64", 64, None, "auto", _gpu((12, 0), 99 * 1024), dict(NW=8, VEC=1),
                 id="float64-d64-99KB"),
    pytest.param("float64", 96, None, "auto", _gpu((12, 0), 99 * 1024), dict(VEC=0),
                 id="float64-d96-99KB-scalar"),  # cp.async double buffering would not fit
    pytest.param("float64", 64, None, "auto", Device("sim-like", cc=None,
                                                     smem_per_block_optin=227 * 1024),
                 dict(DT="f64"), id="float64-no-cc"),
    # float32: 3xTF32 where it wins, the one-mma tf32 kernel (scalar staging) when asked for
    *[pytest.param("float32", d, None, "auto", dev,
                   dict(DT="3xtf32", VEC=1, NW=tile[0], BC=tile[1], HOLDQ=tile[2], MMA=None),
                   id=f"3xtf32-d{d}-{dev.name}")
      for d, dev, tile in ((64, HOPPER, (8, 64, 0)), (128, HOPPER, (8, 64, 0)),
                           (128, AMPERE, (8, 16, 0)), (96, AMPERE, (8, 32, 0)),
                           (8, HOPPER, (8, 64, 0)))],
    pytest.param("float32", 64, None, "tf32", HOPPER, dict(DT="tf32", VEC=0), id="tf32-h100"),
    *[pytest.param("float32", 64, None, "tf32", _gpu(cc, 99 * 1024), dict(DT="tf32"),
                   id=f"tf32-sm{cc[0]}{cc[1]}") for cc in ((8, 6), (8, 9), (12, 0))],
]


@pytest.mark.parametrize("dtype, d, dv, precision, device, want", CHOICES)
def test_config_choice(dtype, d, dv, precision, device, want):
    from numflash.cuda import mma
    cfg = mma.config(_Problem(dtype, d, dv, precision), device)
    assert {f: getattr(cfg, f) for f in want} == want, cfg
    assert ("MMA" in cfg) == (cfg.MMA is not None)  # the mapping leaves an unset form out
    assert mma.shared_bytes(cfg) <= device.smem_per_block_optin


GPU = _gpu((9, 0), name="gpu")
REFUSALS = [  # (dtype, d, dv, precision, strided, device, the reason it must give)
    pytest.param("float64", 256, None, "auto", False, GPU,
                 "float64 head dims up to 128.*cuda.block", id="float64-d256"),
    pytest.param("float64", 64, 200, "auto", False, GPU, "float64 head dims up to 128",
                 id="float64-dv200"),
    pytest.param("float64", 59, 111, "auto", False, AMPERE,
                 r"up to 64 on a100 \(mma m8n8k4\).*cuda.block",  # four m8n8k4 spill at dv=128
                 id="float64-dv111-sm80"),
    pytest.param("float64", 64, None, "auto", False, TURING, "compute capability >= 8.0",
                 id="float64-sm75"),
    pytest.param("float64", 128, None, "auto", False, _gpu((9, 0), 48 * 1024, "small"),
                 "shared memory", id="float64-d128-48KB"),  # d=128 holds Q in shared memory
    pytest.param("float32", 256, None, "auto", False, HOPPER,
                 "float32 head dims up to 128.*cuda.block", id="3xtf32-d256"),
    *[pytest.param("float32", 64, None, "auto", False, _gpu(cc, 99 * 1024),
                   "3xTF32.*8.0 / 9.0.*cuda.block is faster", id=f"3xtf32-sm{cc[0]}{cc[1]}")
      for cc in ((8, 6), (8, 9), (12, 0))],  # tf32 tensor cores at about the FMA rate
    pytest.param("float32", 64, None, "auto", True, HOPPER,
                 "cp.async.*last axis is strided.*slower than cuda.block", id="3xtf32-strided"),
    pytest.param("float32", 59, None, "auto", False, HOPPER, "head dim 59 is not a multiple of 4",
                 id="3xtf32-d59"),
    pytest.param("float32", 64, None, "ieee", False, HOPPER, "precision='ieee'.*cuda.block",
                 id="float32-ieee"),
    pytest.param("float32", 64, None, "auto", False, TURING, "compute capability >= 8.0",
                 id="3xtf32-sm75"),
]


@pytest.mark.parametrize("dtype, d, dv, precision, strided, device, match", REFUSALS)
def test_config_refuses_and_says_why(dtype, d, dv, precision, strided, device, match):
    """Through the operator: its declarations, then the kernel's own limits."""
    from numflash.kernels import operators
    from numflash.plan import Unsupported
    with pytest.raises(Unsupported, match=match):
        operators()["cuda.mma"].config(_Problem(dtype, d, dv, precision, strided), device)


def test_kernel_spec_declares_what_mma_runs():
    from numflash.inputs import IEEE_REASON
    from numflash.kernels import operators
    specs = operators()
    spec = specs["cuda.mma"]
    assert spec.min_cc == (8, 0) and not spec.runs_in_simulator
    assert "float32" in spec.dtypes and "float64" in spec.dtypes
    assert spec.tf32 and not any(s.tf32 for n, s in specs.items() if n != "cuda.mma")
    assert "3xTF32" in spec.summary and "cuda.block" in IEEE_REASON


# ------------------------------------------------------------------------------- precision=

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


def test_plan_memo_key_includes_precision():
    from numflash import plan
    from numflash.inputs import normalize
    q = np.zeros((1, 1, 8, 32), np.float32)
    p_auto = plan.choose(normalize(q, q, q))
    with pytest.raises(ValueError, match="tf32"):
        plan.choose(normalize(q, q, q, precision="tf32"))
    assert plan.choose(normalize(q, q, q)) is p_auto


# ------------------------------------------------------------------------------- the simulator

SIMULATOR_PLANS = [  # (dtype, shape, explain's options, the kernel it takes, why not cuda.mma)
    pytest.param("float16", (1, 2, 33, 64), {}, None, "simulator", id="float16"),
    pytest.param("float32", (1, 2, 33, 64), {}, "cuda.block", "simulator", id="float32"),
    pytest.param("float32", (1, 2, 33, 64), {"precision": "ieee"}, "cuda.block",
                 "precision='ieee'", id="float32-ieee"),
    pytest.param("float64", (1, 1, 8, 16), {}, "cuda.block", "simulator", id="float64"),
]


@pytest.mark.simulator
@pytest.mark.parametrize("dtype, shape, opts, kernel, reason", SIMULATOR_PLANS)
def test_simulator_plans_without_mma_and_says_why(rng, dtype, shape, opts, kernel, reason):
    q = rng.standard_normal(shape).astype(dtype)
    plan = numflash.explain(q, q, q, backend="cuda", **opts)
    assert plan.kernel != "cuda.mma" and (kernel is None or plan.kernel == kernel)
    assert reason in plan.rejected["cuda.mma"]


SIMULATOR_REFUSALS = [  # (dtype, options, the error it must raise)
    pytest.param("float16", {"algorithm": "mma"}, "simulator", id="float16-mma"),
    pytest.param("float32", {"precision": "tf32"}, "simulator", id="tf32"),
    pytest.param("float32", {"algorithm": "block", "precision": "tf32"},
                 "cuda.block computes in exact float32", id="tf32-block"),
    pytest.param("float32", {"algorithm": "row", "precision": "tf32"},
                 "cuda.row computes in exact float32", id="tf32-row"),
    pytest.param("float32", {"algorithm": "mma", "precision": "ieee"},
                 "precision='ieee' keeps float32 on the FMA units", id="float32-ieee-mma"),
]


@pytest.mark.simulator
@pytest.mark.parametrize("dtype, opts, match", SIMULATOR_REFUSALS)
def test_simulator_refuses_mma_with_a_reason(rng, dtype, opts, match):
    q = rng.standard_normal((1, 2, 33, 64)).astype(dtype)
    for fn in (numflash.explain, numflash.attention):
        with pytest.raises(ValueError, match=match):
            fn(q, q, q, backend="cuda", **opts)


# ------------------------------------------------------------------------------- modifications

def test_mma_takes_a_sliding_window_and_the_other_mods():
    """cuda.mma takes window_size (a key range per row, tile skipping) and every other
    modification (device functions, MODS); cuda.block refuses all of them; an operator
    declaring some kinds refuses the others by name."""
    import dataclasses
    from numflash import mods as _mods
    from numflash.kernels import operators
    dev = _gpu((9, 0))
    ops = operators()
    p = _Problem("float16", 64)
    p.mods = _mods.build(p.shape, "cupy", 0, window_size=(128, 0))
    assert ops["cuda.mma"].why_not(p, dev) is None
    cfg = ops["cuda.mma"].config(p, dev)
    assert cfg.WINDOW == 1 and cfg["WINDOW"] == 1
    assert "score/mask modifications" in ops["cuda.block"].why_not(p, dev)
    p.mods = _mods.build(p.shape, "cupy", 0, window_size=(128, 0), softcap=30.0)
    assert ops["cuda.mma"].why_not(p, dev) is None
    cfg = ops["cuda.mma"].config(p, dev)
    assert cfg.WINDOW == 1 and cfg.MODS == "score:softcap_score/softcap_grad[f,f]"
    why = dataclasses.replace(ops["cuda.mma"], mods=("window_size",)).why_not(p, dev)
    assert "takes window_size" in why and "not softcap" in why and "cpu.tiled" in why
    p.mods = None
    assert ops["cuda.mma"].config(p, dev).WINDOW == 0


def test_a_window_avoids_the_tiles_it_would_spill_and_says_why_not_float64_d128():
    from numflash import mods as _mods
    from numflash.cuda import mma
    from numflash.plan import Unsupported
    dev = _gpu((9, 0))
    p = _Problem("float32", 128)
    p.mods = _mods.build(p.shape, "cupy", 0, window_size=(64, 0))
    cfg = mma.config(p, dev)
    assert (cfg.NW, cfg.BC, cfg.HOLDQ, cfg.WINDOW) == (8, 32, 0, 1)  # not the (8, 64, 0) tile
    p.mods = None
    assert (mma.config(p, dev).BC, mma.config(p, dev).WINDOW) == (64, 0)
    p = _Problem("float64", 128)
    p.mods = _mods.build(p.shape, "cupy", 0, window_size=(64, 0))
    with pytest.raises(Unsupported, match="float64 window_size up to head dim 64"):
        mma.config(p, dev)
