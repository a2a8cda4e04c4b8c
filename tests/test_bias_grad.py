"""attn_bias's gradient (``attention_backward(..., return_bias_grad=True)``, and autograd through
a torch bias that requires grad): each pair's dS through the score mods after the bias, summed
over the dims the bias broadcasts along, in the bias's shape. Against the float64 reference
(itself checked by finite differences) with the accuracy rule, on the CPU path, cuda.mma's
generated key pass under the warp emulator and on a GPU; the torch layer against torch's own
autograd; the refusals."""
import numpy as np
import pytest

import numflash
from numflash import reference, testing
from numflash.inputs import parse_causal

B, H, NQ, NK = 2, 3, 45, 52


def _inputs(rng, dtype, B, H, Hk, Nq, Nk, d):
    return (rng.standard_normal((B, H, Nq, d)).astype(dtype),
            rng.standard_normal((B, Hk, Nk, d)).astype(dtype),
            rng.standard_normal((B, Hk, Nk, d)).astype(dtype),
            rng.standard_normal((B, H, Nq, d)).astype(dtype))


def _scaled(x, b, h, i, j):
    return 1.5 * x


def _scaled_grad(x, b, h, i, j):
    return 1.5


def _run(rng, dtype, bias_shape, B=B, H=H, Hk=H, Nq=NQ, Nk=NK, d=16, **opts):
    q, k, v, do = _inputs(rng, dtype, B, H, Hk, Nq, Nk, d)
    bias = rng.standard_normal(bias_shape).astype(np.float32 if dtype == np.float16 else dtype)
    opts["attn_bias"] = bias
    o, lse = numflash.attention(q, k, v, return_lse=True, **opts)
    grads = numflash.attention_backward(do, q, k, v, o, lse, return_bias_grad=True, **opts)
    return grads, (do, q, k, v), opts


LONG = pytest.mark.extended  # each case compiles its own CPU kernel (~7 s on 2 cores)
CPU_CASES = [  # (dtype, bias shape, options)
    (np.float64, (B, H, NQ, NK), dict(causal=True)),
    (np.float64, (B, 1, 1, NK), dict(causal="bottom_right", softcap=4.0)),
    (np.float32, (1, H, NQ, NK), dict(score_mod=_scaled, score_mod_grad=_scaled_grad)),
    pytest.param(np.float32, (NQ, NK), dict(window_size=(6, 3), causal=True), marks=LONG),
    pytest.param(np.float32, (B, H, NQ, 1), dict(softcap=2.0, score_mod=_scaled,
                                                 score_mod_grad=_scaled_grad), marks=LONG),
    (np.float16, (1, H, 1, NK), dict(causal=True, dropout_p=0.2, dropout_seed=7)),
    pytest.param(np.float64, (1,), dict(alibi_slopes=np.linspace(0.1, 0.5, H)), marks=LONG),
]


@pytest.mark.parametrize("dtype, shape, opts", CPU_CASES)
def test_cpu_bias_gradient_meets_the_rule_in_the_bias_shape(rng, dtype, shape, opts):
    """cpu.tiled's dbias, full and broadcast along each dim, with the causal alignments, a
    window, softcap before the bias, a user score_mod after it (its derivative enters), dropout
    and ALiBi: the bias's shape and dtype, within the rule of the float64 reference, dq, dk, dv
    too."""
    grads, tensors, opts = _run(rng, dtype, shape, **opts)
    dbias = grads[3]
    assert dbias.shape == shape and dbias.dtype == opts["attn_bias"].dtype
    rep = testing.assert_gradients_accurate(grads, *tensors, **opts)
    assert set(rep.errors) == {"dq", "dk", "dv", "dbias"}


@pytest.mark.parametrize("Nq, Nk, d, Hk, causal", [
    (1, 97, 59, 3, True), pytest.param(97, 1, 1, 1, False, marks=LONG),
    pytest.param(1025, 33, 8, 1, "bottom_right", marks=LONG)])
def test_cpu_bias_gradient_at_odd_sizes_and_grouped_heads(rng, Nq, Nk, d, Hk, causal):
    grads, tensors, opts = _run(rng, np.float32, (1, H, Nq, Nk), B=1, Hk=Hk, Nq=Nq, Nk=Nk, d=d,
                                causal=causal)
    testing.assert_gradients_accurate(grads, *tensors, **opts)


def test_reference_bias_gradient_matches_finite_differences(rng):
    """The float64 reference's dbias (through a softcap before and a score_mod after the bias)
    against central differences of the reference forward's loss sum(o * do)."""
    q, k, v, do = _inputs(rng, np.float64, 1, 2, 2, 5, 7, 4)
    bias = rng.standard_normal((1, 2, 1, 7))
    opts = dict(causal="bottom_right", softcap=3.0, score_mod=_scaled, score_mod_grad=_scaled_grad)
    *_, dbias = reference.attention_backward(do, q, k, v, attn_bias=bias, return_bias_grad=True,
                                             **opts)
    eps, fd = 1e-6, np.zeros_like(bias)
    for idx in np.ndindex(bias.shape):
        plus, minus = bias.copy(), bias.copy()
        plus[idx] += eps
        minus[idx] -= eps
        fd[idx] = (np.sum(reference.attention(q, k, v, attn_bias=plus, **opts) * do) -
                   np.sum(reference.attention(q, k, v, attn_bias=minus, **opts) * do)) / (2 * eps)
    np.testing.assert_allclose(dbias, fd, rtol=1e-6, atol=1e-8)


def test_rows_that_see_no_key_give_no_bias_gradient(rng):
    """A mask that empties some rows: their bias gradient is exactly zero (never NaN), and the
    sum over a shared bias is the sum over the rows that see keys."""
    mask = np.ones((1, 1, NQ, NK), bool)
    mask[..., 3:9, :] = False
    grads, tensors, opts = _run(rng, np.float64, (B, H, NQ, NK), attn_mask=mask)
    assert np.all(grads[3][:, :, 3:9] == 0)
    testing.assert_gradients_accurate(grads, *tensors, **opts)


def test_cpu_bias_gradient_is_the_same_bit_for_bit_on_every_run(rng):
    q, k, v, do = _inputs(rng, np.float32, B, H, H, NQ, NK, 16)
    bias = rng.standard_normal((1, 1, NQ, NK)).astype(np.float32)   # shared by every task
    o, lse = numflash.attention(q, k, v, return_lse=True, attn_bias=bias)
    runs = [numflash.attention_backward(do, q, k, v, o, lse, attn_bias=bias,
                                        return_bias_grad=True, deterministic=True)
            for _ in range(2)]
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


def test_explain_names_the_bias_gradient_and_kernels_without_it_refuse(rng):
    from numflash.kernels import operators
    from numflash.plan import Device
    q, k, v, _ = _inputs(rng, np.float32, 1, 2, 2, 16, 16, 8)
    bias = np.zeros((1, 1, 16, 16), np.float32)
    plan = numflash.explain(q, k, v, attn_bias=bias, backward=True, return_bias_grad=True)
    assert plan.kernel == "cpu.tiled" and "attn_bias gradient" in str(plan)
    assert "attn_bias gradient" not in str(numflash.explain(q, k, v, attn_bias=bias,
                                                            backward=True))
    problem = type("P", (), {"dbias": bias, "dtype_name": "float32", "mods": None,
                             "shape": (1, 2, 16, 16, 8, 8)})()
    why = operators("backward")["cuda.row"].why_not(problem, Device(name="x"))
    assert "attn_bias's gradient" in why and "cpu.tiled" in why


@pytest.mark.parametrize("call, error, match", [
    (lambda q, k, v, o, lse, do: numflash.attention_backward(do, q, k, v, o, lse,
                                                             return_bias_grad=True),
     ValueError, "needs an attn_bias"),
    (lambda q, k, v, o, lse, do: numflash.explain(q, k, v, attn_bias=np.zeros(16, np.float32),
                                                  return_bias_grad=True),
     ValueError, "return_bias_grad is a backward option"),
])
def test_bad_bias_gradient_requests_raise_naming_the_argument(rng, call, error, match):
    q, k, v, do = _inputs(rng, np.float32, 1, 2, 2, 16, 16, 8)
    o, lse = numflash.attention(q, k, v, return_lse=True)
    with pytest.raises(error, match=match):
        call(q, k, v, o, lse, do)


# ------------------------------------------------------------------------------ cuda.mma

def _emulated(rng, DT, shape, causal, acc, Hkv=1, Nq=33, Nk=45, mod_opts=None):
    """cuda.mma's DBIAS key pass (and the query pass) of kind DT under the warp emulator."""
    from mma_tools import run_backward_kernels
    from numflash import mods as _mods
    from test_mma_backward import _kind_dtype
    dtype = _kind_dtype(DT) if DT in ("f16", "bf16", "f64") else np.dtype(np.float32)
    Bn, Hn, d = 2, 2, 32
    q, k, v, do = _inputs(rng, dtype, Bn, Hn, Hkv, Nq, Nk, d)
    is_causal, off = parse_causal(causal, Nq, Nk)
    bias = rng.standard_normal(shape).astype(np.float64 if DT == "f64" else np.float32)
    opts = dict(attn_bias=bias, **(mod_opts or {}))
    built = _mods.build((Bn, Hn, Nq, Nk, d, d), "numpy", off, **opts)
    opts["causal"] = causal
    o, lse = reference.attention(q, k, v, return_lse=True, **opts)
    grads = run_backward_kernels(q, k, v, do, o.astype(q.dtype),
                                 lse.astype(np.float64 if DT == "f64" else np.float32), DT,
                                 is_causal, off, mods=built, bias_grad=acc)
    assert grads[3].shape == shape
    testing.assert_gradients_accurate(grads, do, q, k, v, **opts)


def test_mma_bias_gradient_source_under_the_warp_emulator_fast(rng):
    """The DBIAS key pass, float64, a bias broadcast over the batch (atomic adds from blocks of
    every batch entry into one element), top-left causal, grouped heads."""
    _emulated(rng, "f64", (1, 2, 17, 20), True, "f64", Nq=17, Nk=20)


def test_mma_bias_gradient_rows_mode_under_the_warp_emulator_fast(rng):
    """DBIAS "rows": a key-padding bias (B, 1, 1, Nk), each key's column summed in registers
    over every head of a group (grouped heads) and query tile, added once a head."""
    _emulated(rng, "f64", (2, 1, 1, 20), "bottom_right", "rows", Nq=17, Nk=20)


@pytest.mark.extended
@pytest.mark.parametrize("DT, shape, causal, acc, mod_opts", [
    ("f16", (2, 2, 33, 45), False, "store", dict(softcap=4.0, score_mod=_scaled,
                                               score_mod_grad=_scaled_grad)),
    ("bf16", (2, 1, 1, 45), "bottom_right", "rows", None),
    ("f16", (2, 2, 33, 1), False, "f64", dict(softcap=4.0)),
    ("f16", (1, 2, 33, 45), True, "f32", None),
    ("3xtf32", (1, 2, 1, 45), "bottom_right", "rows", dict(softcap=4.0)),
    ("f64", (2, 2, 33, 45), True, "f64", dict(score_mod=_scaled, score_mod_grad=_scaled_grad)),
])
def test_mma_bias_gradient_source_under_the_warp_emulator(rng, DT, shape, causal, acc,
                                                          mod_opts):
    _emulated(rng, DT, shape, causal, acc, mod_opts=mod_opts)


def test_mma_config_carries_dbias_on_the_key_pass_only(rng):
    """A full bias gets float32 stores (one write an element), one broadcast along the heads
    float32 atomic adds (H an element), one shared by the queries float64 column sums in
    registers, one shared by the keys float64 atomic adds (up to Nk an element);
    deterministic=True refuses a broadcast bias (atomic order) and packed sequences refuse it;
    without the gradient the configs are those of before (DBIAS left out of the mapping)."""
    from numba import types
    from numflash import mods as _mods
    from numflash.cuda.mma import gradients
    from test_mma_config import _gpu, _Problem, check_key_pass_gradient_refusals
    dev = _gpu((9, 0))
    p = _Problem("float16", 64)
    p.varlen = None
    for shape, acc in (((1, 2, 64, 64), "store"), ((1, 1, 64, 64), "f32"),
                       ((1, 1, 1, 64), "rows"), ((1, 2, 64, 1), "f64")):
        p.mods = _mods.build(p.shape, "numpy", 0, attn_bias=np.zeros(shape, np.float32))
        p.dbias = np.zeros(shape, np.float32)
        p.deterministic = False
        cfg = gradients.config(p, dev)
        assert cfg["keys"].DBIAS == acc and "DBIAS" not in dict(cfg["queries"])
        assert cfg["keys"].SUB == (16 if acc == "rows" else 32)
        assert gradients._signature("float16", "keys", cfg["keys"])[-1] == \
            types.Array(types.float64 if acc in ("f64", "rows") else types.float32, 4, "A")
        assert "attn_bias gradient" in " ".join(gradients.notes(p, cfg, dev))
    p.dbias = np.zeros((1, 1, 64, 64), np.float32)
    check_key_pass_gradient_refusals(p, dev, "DBIAS", "dbias", gradients.bias_grad_mode,
                                     "deterministic=True takes a full")


@pytest.mark.extended
def test_mma_dbias_key_passes_compile_with_no_spills():
    """The DBIAS key passes at d64 (sm_90 float16 summing a key-padding bias's columns in
    registers, "rows"; sm_80 bfloat16 with float32 atomic adds, "f32"): no spill, stack or
    local memory, and the adds are atomics of the accumulator's type."""
    import json
    from test_cuda_compile import run_without_simulator
    code = """
        import dataclasses, json
        import numpy as np
        from numflash import mods
        from numflash.cuda import launch
        from numflash.cuda.mma import gradients, mods as kernel_mods
        rows = []
        for cc, DT, dtype, acc, shape, smem in (
                ((9, 0), "f16", "float16", "rows", (2, 1, 1, 64), 227 * 1024),
                ((8, 0), "bf16", "bfloat16", "f32", (1, 2, 64, 64), 163 * 1024)):
            built = mods.build((2, 2, 64, 64, 64, 64), "numpy", 0,
                               attn_bias=np.zeros(shape, np.float32))
            token = kernel_mods.token_for(built)
            cfg = {k: dataclasses.replace(c, MODS=token) for k, c in
                   gradients.tiles(64, 64, smem, False, mods=True, DT=DT, cc=cc).items()}
            cfg["keys"] = gradients.with_bias_grad(cfg["keys"], acc)
            kernel, sig = gradients.compiled_kernels(cfg, dtype)[1]
            cubin, entry, ptx, res = launch.compile_to_cubin(kernel.pyfunc, sig, cc)
            rows.append([DT, res.get("registers", 0),
                         res.get("spill_store_bytes", 0) + res.get("spill_load_bytes", 0),
                         res.get("stack_bytes", 0), ptx.count("ld.local") + ptx.count("st.local"),
                         ptx.count("atom.add.f64" if acc == "rows" else "atom.add.f32")])
        print(json.dumps(rows))
    """
    rows = json.loads(run_without_simulator(code).strip().splitlines()[-1])
    assert len(rows) == 2, rows
    for DT, regs, spills, stack, local, atomics in rows:
        assert 0 < regs <= 255 and spills == stack == local == 0 and atomics > 0, rows


# ------------------------------------------------------------------------------ torch

@pytest.mark.parametrize("shape", [(1, 3, 1, 40), (2, 1, 33, 1),
                                   pytest.param((2, 3, 33, 40), marks=LONG),
                                   pytest.param((40,), marks=LONG)])
def test_torch_trains_a_float_attn_mask_as_torch_does(shape):
    """SDPA's float attn_mask that requires grad: numflash's gradient of the mask equals
    torch's own autograd through its SDPA (float64, CPU), and q's too."""
    torch = pytest.importorskip("torch")
    import numflash.torch as nt
    torch.manual_seed(0)
    q = torch.randn(2, 3, 33, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, 40, 16, dtype=torch.float64, requires_grad=True) for _ in "kv")
    mask = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    grads = []
    for sdpa in (nt.scaled_dot_product_attention,
                 torch.nn.functional.scaled_dot_product_attention):
        q.grad = mask.grad = None
        sdpa(q, k, v, attn_mask=mask).square().sum().backward()
        grads.append((q.grad.clone(), mask.grad.clone()))
    (gq, gm), (tq, tm) = grads
    assert gm.shape == mask.shape
    torch.testing.assert_close(gm, tm, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gq, tq, rtol=1e-10, atol=1e-12)


def test_torch_attention_backward_returns_the_bias_gradient(rng):
    torch = pytest.importorskip("torch")
    import numflash.torch as nt
    q, k, v, do = (torch.from_numpy(a) for a in _inputs(rng, np.float32, 1, 2, 2, 20, 24, 8))
    bias = torch.from_numpy(rng.standard_normal((1, 2, 1, 24)).astype(np.float32))
    o, lse = nt.attention(q, k, v, return_lse=True, attn_bias=bias, causal=True)
    grads = nt.attention_backward(do, q, k, v, o, lse, attn_bias=bias, causal=True,
                                  return_bias_grad=True)
    assert isinstance(grads[3], torch.Tensor) and grads[3].shape == bias.shape
    testing.assert_gradients_accurate([g.numpy() for g in grads], do.numpy(), q.numpy(),
                                      k.numpy(), v.numpy(), attn_bias=bias.numpy(), causal=True)


# ------------------------------------------------------------------------------ GPU

GPU_CASES = [  # (dtype, bias shape, B, H, Hk, Nq, Nk, d, causal)
    ("float16", (1, 4, 300, 257), 1, 4, 4, 300, 257, 64, True),
    ("bfloat16", (2, 1, 1, 333), 2, 4, 2, 200, 333, 128, "bottom_right"),
    ("float32", (1, 2, 200, 300), 2, 2, 2, 200, 300, 64, False),
    ("float64", (2, 1, 200, 1), 2, 2, 1, 200, 150, 64, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, shape, B, H, Hk, Nq, Nk, d, causal", GPU_CASES)
def test_gpu_mma_bias_gradient(dtype, shape, B, H, Hk, Nq, Nk, d, causal):
    """On the GPU: cuda.mma's DBIAS key pass against the reference (the accuracy rule), full
    and broadcast biases, grouped heads, both causal alignments (the bias alone: the
    composition with other modifications runs under the emulator above)."""
    import cupy
    from test_mma_backward import _kind_dtype
    rng = np.random.default_rng(2)
    dt = _kind_dtype("bf16") if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v, do = _inputs(rng, dt, B, H, Hk, Nq, Nk, d)
    bias = rng.standard_normal(shape).astype(np.float64 if dtype == "float64" else np.float32)
    opts = dict(causal=causal, attn_bias=bias)
    on = [cupy.asarray(a) for a in (q, k, v, do)]
    gopts = dict(opts, attn_bias=cupy.asarray(bias))
    plan = numflash.explain(*on[:3], backward=True, return_bias_grad=True, **gopts)
    assert plan.kernel == "cuda.mma" and plan.config["keys"].DBIAS
    out, lse = numflash.attention(*on[:3], return_lse=True, **gopts)
    grads = numflash.attention_backward(on[3], *on[:3], out, lse, return_bias_grad=True,
                                        **gopts)
    assert grads[3].shape == shape
    testing.assert_gradients_accurate([g.get() for g in grads], do, q, k, v, **opts)


@pytest.mark.gpu
def test_gpu_torch_sdpa_trains_a_float_mask():
    """Through numflash.torch's SDPA on CUDA float16 tensors, a float32 mask that requires grad:
    its gradient's error against float64 torch is within twice that of torch's own float16
    SDPA (the rule's yardstick, here torch's kernel), plus the float16 floor."""
    torch = pytest.importorskip("torch")
    import numflash.torch as nt
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True)
               for _ in "qkv")
    mask = torch.randn(1, 1, 256, 256, device="cuda", dtype=torch.float32, requires_grad=True)
    got = {}
    for name, sdpa, cast in (
            ("numflash", nt.scaled_dot_product_attention, lambda t: t),
            ("torch16", torch.nn.functional.scaled_dot_product_attention, lambda t: t),
            ("torch64", torch.nn.functional.scaled_dot_product_attention, lambda t: t.double())):
        leaves = [cast(t.detach()).requires_grad_() for t in (q, k, v)]
        m = cast(mask.detach()).requires_grad_()
        sdpa(*leaves, attn_mask=m.to(leaves[0].dtype) if name == "torch16" else m) \
            .float().square().sum().backward()
        got[name] = m.grad.double()
    ours = (got["numflash"] - got["torch64"]).abs().max().item()
    theirs = (got["torch16"] - got["torch64"]).abs().max().item()
    assert ours <= 2 * theirs + testing.ABS_FLOOR["float16"], (ours, theirs)
