"""Gradients to trainable mod_args (``score_mod_args_grad`` + ``return_mod_args_grad``): a
relative-position bias table, learned ALiBi slopes and a per-head temperature, read by a user's
score_mod. The float64 reference against finite differences; the CPU path against the reference
with the accuracy rule, with the options they combine with; bitwise repeats; the torch layer
against torch's own autograd; the refusals."""
import numpy as np
import pytest

import numflash
from numflash import reference, testing

B, H, NQ, NK, D = 2, 3, 37, 45, 16


def _bias_table(x, b, h, i, j, table, slopes, temperature, shift):
    """A T5-style relative bias (one table entry a distance), learned ALiBi slopes and a
    per-head temperature."""
    return x * temperature[h] + table[h, i - j + shift] - slopes[h] * abs(i - j)


def _bias_table_grad(x, b, h, i, j, table, slopes, temperature, shift):
    return temperature[h]


def _table_index(x, b, h, i, j, table, slopes, temperature, shift):
    return (h, i - j + shift), 1.0


def _slope_index(x, b, h, i, j, table, slopes, temperature, shift):
    return h, -1.0 * abs(i - j)


def _temperature_index(x, b, h, i, j, table, slopes, temperature, shift):
    return h, x


def _arrays(rng, dtype, Nq=NQ, Nk=NK, Hk=H, d=D, Bn=B):
    q = rng.standard_normal((Bn, H, Nq, d)).astype(dtype)
    k = rng.standard_normal((Bn, Hk, Nk, d)).astype(dtype)
    v = rng.standard_normal((Bn, Hk, Nk, d)).astype(dtype)
    do = rng.standard_normal((Bn, H, Nq, d)).astype(dtype)
    return q, k, v, do


def _options(rng, Nq=NQ, Nk=NK, trained=(True, True, True), arg_dtype=np.float64, heads=H):
    table = (0.5 * rng.standard_normal((heads, Nq + Nk))).astype(arg_dtype)
    slopes = rng.uniform(0.01, 0.2, heads).astype(arg_dtype)
    temperature = rng.uniform(0.5, 1.5, heads).astype(arg_dtype)
    fns = (_table_index, _slope_index, _temperature_index)
    return dict(score_mod=_bias_table, score_mod_grad=_bias_table_grad,
                mod_args=(table, slopes, temperature, Nk),
                score_mod_args_grad=tuple(f if t else None for f, t in zip(fns, trained)) +
                (None,))


def _loss(q, k, v, do, **opts):
    return float(np.sum(reference.attention(q, k, v, **opts) * do))


def test_reference_mod_args_gradients_match_finite_differences(rng):
    """The float64 reference's gradients of the table, the slopes and the temperature (causal
    bottom-right, so some pairs are masked) against central differences of sum(o * do)."""
    q, k, v, do = _arrays(rng, np.float64, Nq=5, Nk=7, d=4, Bn=1)
    opts = dict(_options(rng, Nq=5, Nk=7), causal="bottom_right")
    *_, margs = reference.attention_backward(do, q, k, v, return_mod_args_grad=True, **opts)
    assert margs[3] is None
    eps = 1e-6
    for n in range(3):
        fd = np.zeros_like(margs[n])
        for idx in np.ndindex(fd.shape):
            args = [[a.copy() if hasattr(a, "copy") else a for a in opts["mod_args"]]
                    for _ in range(2)]
            args[0][n][idx] += eps
            args[1][n][idx] -= eps
            fd[idx] = (_loss(q, k, v, do, **dict(opts, mod_args=tuple(args[0]))) -
                       _loss(q, k, v, do, **dict(opts, mod_args=tuple(args[1])))) / (2 * eps)
        np.testing.assert_allclose(margs[n], fd, rtol=1e-6, atol=1e-9)


LONG = pytest.mark.extended  # each combination compiles its own CPU kernels (~20 s on 2 cores)
CPU_CASES = [  # (dtype, the mod_args' dtype, options)
    (np.float32, np.float32, dict(causal="bottom_right", softcap=5.0)),
    pytest.param(np.float64, np.float64, dict(causal=True), marks=LONG),
    pytest.param(np.float16, np.float32, dict(attn_bias=np.full((1, H, 1, 1), 0.3, np.float32),
                                              return_bias_grad=True), marks=LONG),
    pytest.param(np.float32, np.float64, dict(window_size=(9, 4), causal=True), marks=LONG),
    pytest.param(np.float32, np.float32, dict(dropout_p=0.25, dropout_seed=3,
                                              alibi_slopes=np.linspace(0.1, 0.3, H)),
                 marks=LONG),
    pytest.param(np.float64, np.float32, dict(Hk=1, Nq=1, Nk=97, d=59), marks=LONG),
    pytest.param(np.float32, np.float32, dict(Nq=97, Nk=1, d=1, causal="bottom_right",
                                              trained=(True, False, True)), marks=LONG),
]


@pytest.mark.parametrize("dtype, arg_dtype, opts", CPU_CASES)
def test_cpu_mod_args_gradients_meet_the_rule(rng, dtype, arg_dtype, opts):
    """cpu.tiled's gradients of the trained mod_args (each in its array's shape and dtype, a
    float32 one of float64 inputs too; None for the untrained ones and the scalar), with the
    causal alignments, softcap and an
    attn_bias (with its gradient) before the score_mod, a window, dropout with ALiBi, grouped
    heads and odd sizes: within the rule of the float64 reference, dq, dk, dv too; a second
    run (one accumulator a task, summed in a fixed order) equal bit for bit."""
    opts = dict(opts)
    bias_grad = opts.pop("return_bias_grad", False)
    sizes = {n: opts.pop(n) for n in ("Hk", "Nq", "Nk", "d") if n in opts}
    trained = opts.pop("trained", (True,) * 3)
    q, k, v, do = _arrays(rng, dtype, **sizes)
    opts = dict(_options(rng, sizes.get("Nq", NQ), sizes.get("Nk", NK), trained, arg_dtype),
                **opts)
    o, lse = numflash.attention(q, k, v, return_lse=True, **opts)
    runs = [numflash.attention_backward(do, q, k, v, o, lse, return_mod_args_grad=True,
                                        return_bias_grad=bias_grad, **opts) for _ in range(2)]
    grads = runs[0]
    assert len(grads) == 4 + bias_grad
    if bias_grad:
        assert grads[3].shape == (1, H, 1, 1)
    margs = grads[-1]
    for n, t in enumerate(trained):
        a = opts["mod_args"][n]
        assert (margs[n] is not None) == t
        assert margs[n] is None or (margs[n].shape == a.shape and margs[n].dtype == a.dtype)
    assert margs[3] is None
    rep = testing.assert_gradients_accurate(grads, do, q, k, v, **opts)
    assert {f"mod_args[{n}]" for n, t in enumerate(trained) if t} <= set(rep.errors)
    for a, b in zip(margs, runs[1][-1]):
        assert (a is None and b is None) or np.array_equal(a, b)


def test_explain_names_mod_args_gradients_and_kernels_without_them_refuse(rng):
    from numflash.kernels import operators
    from numflash.plan import Device
    q, k, v, _ = _arrays(rng, np.float32, 16, 16)
    opts = _options(rng, 16, 16)
    plan = numflash.explain(q, k, v, backward=True, return_mod_args_grad=True, **opts)
    assert plan.kernel == "cpu.tiled" and "mod_args gradients" in str(plan)
    assert "mod_args gradients" not in str(numflash.explain(q, k, v, backward=True, **opts))
    problem = type("P", (), {"dmod_args": (np.zeros(3),), "dtype_name": "float32",
                             "mods": None, "shape": (2, 3, 16, 16, 16, 16)})()
    why = operators("backward")["cuda.row"].why_not(problem, Device(name="x"))
    assert "mod_args' gradients" in why and "cpu.tiled" in why


def test_accumulators_too_large_for_one_copy_a_task_are_refused(rng, monkeypatch):
    from numflash import plan
    from numflash.cpu import backward
    monkeypatch.setattr(backward, "ARG_GRAD_BYTES", 1024)
    monkeypatch.setattr(plan, "_plans", {})  # (plans are memoized)
    q, k, v, _ = _arrays(rng, np.float32, 16, 16)
    with pytest.raises(ValueError, match="better an attn_bias"):
        numflash.explain(q, k, v, backward=True, return_mod_args_grad=True,
                         **_options(rng, 16, 16))


def _past_the_end(x, b, h, i, j, table, slopes, temperature, shift):
    return (h, i - j + shift + 1000), 1.0


@pytest.mark.parametrize("change, error, match", [
    (dict(score_mod_args_grad=None), ValueError, "needs score_mod_args_grad"),
    (dict(score_mod_args_grad=(_table_index,)), TypeError, "aligned with mod_args"),
    (dict(score_mod_args_grad=(None, None, None, _table_index)), TypeError,
     "mod_args\\[3\\] is not a float array"),
    (dict(score_mod_args_grad=(None,) * 4), ValueError, "holds no function"),
    (dict(score_mod_args_grad=("table", None, None, None)), TypeError, "function or None"),
    (dict(score_mod=None, score_mod_grad=None, mask_mod=lambda b, h, i, j, *a: True),
     ValueError, "without a score_mod"),
])
def test_bad_mod_args_gradient_requests_raise_naming_the_argument(rng, change, error, match):
    q, k, v, do = _arrays(rng, np.float32, 16, 16)
    opts = _options(rng, 16, 16)
    o, lse = np.zeros_like(q), np.zeros(q.shape[:3], np.float32)  # (raised before they are read)
    with pytest.raises(error, match=match):
        numflash.attention_backward(do, q, k, v, o, lse, return_mod_args_grad=True,
                                    **dict(opts, **change))


@pytest.mark.extended  # (compiles its own kernels)
def test_an_index_outside_the_array_raises_instead_of_writing_there(rng):
    q, k, v, do = _arrays(rng, np.float32, 16, 16)
    opts = dict(_options(rng, 16, 16), score_mod_args_grad=(_past_the_end, None, None, None))
    o, lse = numflash.attention(q, k, v, return_lse=True, **opts)
    table = opts["mod_args"][0].copy()
    with pytest.raises(IndexError):
        numflash.attention_backward(do, q, k, v, o, lse, return_mod_args_grad=True, **opts)
    assert np.array_equal(table, opts["mod_args"][0])


def test_mod_args_gradients_is_a_backward_option(rng):
    q, k, v, _ = _arrays(rng, np.float32, 16, 16)
    with pytest.raises(ValueError, match="return_mod_args_grad is a backward option"):
        numflash.explain(q, k, v, return_mod_args_grad=True, **_options(rng, 16, 16))


@pytest.mark.extended  # (compiles its own float64 kernels, ~25 s)
def test_torch_mod_args_that_require_grad_train_through_autograd(rng):
    """numflash.torch.attention with a trained table and slopes (the temperature left
    untrained) against torch's own autograd of the same scores; explain reads the trained
    tensors; a tensor that requires grad without a derivative is refused."""
    torch = pytest.importorskip("torch")
    nt = pytest.importorskip("numflash.torch")
    Nq, Nk, d = 21, 26, 8
    q, k, v, do = (torch.from_numpy(a) for a in _arrays(rng, np.float64, Nq, Nk, d=d))
    for t in (q, k, v):
        t.requires_grad_(True)
    table, slopes, temperature, shift = (torch.from_numpy(a) if hasattr(a, "shape") else a
                                         for a in _options(rng, Nq, Nk)["mod_args"])
    table.requires_grad_(True)
    slopes.requires_grad_(True)
    opts = dict(score_mod=_bias_table, score_mod_grad=_bias_table_grad,
                mod_args=(table, slopes, temperature, shift),
                score_mod_args_grad=(_table_index, _slope_index, _temperature_index, None))
    assert numflash.explain(q, k, v, causal=True, backward=True, return_mod_args_grad=True,
                            **opts).kernel == "cpu.tiled"   # (trainable tensors read as such)
    out = nt.attention(q, k, v, causal=True, **opts)
    mine = torch.autograd.grad((out * do).sum(), (q, k, v, table, slopes))
    i, j = torch.arange(Nq)[:, None], torch.arange(Nk)[None, :]
    s = (q @ k.transpose(-1, -2)) / d ** 0.5 * temperature[None, :, None, None]
    s = s + table[:, i - j + shift][None] - slopes[None, :, None, None] * (i - j).abs()
    s = s.masked_fill(j > i, -float("inf"))
    theirs = torch.autograd.grad(((torch.softmax(s, -1) @ v) * do).sum(),
                                 (q, k, v, table, slopes))
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    with pytest.raises(NotImplementedError, match="score_mod_args_grad"):
        nt.attention(q, k, v, **dict(opts, score_mod_args_grad=(_table_index, None, None, None)))


# ------------------------------------------------------------------------------ cuda.mma

def _emulated(rng, DT, causal, Bn=1, Hn=2, Nq=17, Nk=20, d=32, trained=(True,) * 3, **more):
    """cuda.mma's MARGS key pass (and the query pass) of kind DT under the warp emulator,
    against the reference with the rule."""
    from mma_tools import run_backward_kernels
    from numflash import mods as _mods
    from numflash.inputs import parse_causal
    from test_mma_backward import _kind_dtype
    dtype = _kind_dtype(DT) if DT in ("f16", "bf16", "f64") else np.dtype(np.float32)
    q = rng.standard_normal((Bn, Hn, Nq, d)).astype(dtype)
    k, v = (rng.standard_normal((Bn, Hn, Nk, d)).astype(dtype) for _ in "kv")
    do = rng.standard_normal((Bn, Hn, Nq, d)).astype(dtype)
    is_causal, off = parse_causal(causal, Nq, Nk)
    opts = dict(_options(rng, Nq, Nk, trained), **more)
    bias_grad = "store" if "attn_bias" in more else None
    built = _mods.build((Bn, Hn, Nq, Nk, d, d), "numpy", off, **opts)
    opts["causal"] = causal
    o, lse = reference.attention(q, k, v, return_lse=True, **opts)
    grads = run_backward_kernels(q, k, v, do, o.astype(q.dtype),
                                 lse.astype(np.float64 if DT == "f64" else np.float32), DT,
                                 is_causal, off, mods=built, bias_grad=bias_grad,
                                 mod_args_grad=True)
    assert [g is None for g in grads[-1]] == [not t for t in trained] + [True]
    testing.assert_gradients_accurate(grads, do, q, k, v, **opts)


def test_mma_mod_args_gradients_under_the_warp_emulator_fast(rng):
    """The MARGS key pass, float64, top-left causal (masked pairs add nothing): the table, the
    slopes and the temperature by float64 atomic adds."""
    _emulated(rng, "f64", True)


@pytest.mark.extended
@pytest.mark.parametrize("DT, causal, more", [
    ("f16", "bottom_right", dict(Bn=2, Nq=24, Nk=37)),
    ("bf16", False, dict(softcap=4.0, trained=(True, False, True))),
    ("3xtf32", True, dict(attn_bias=np.full((1, 2, 17, 20), 0.25, np.float32))),
])
def test_mma_mod_args_gradients_under_the_warp_emulator(rng, DT, causal, more):
    """float16 with batches, bfloat16 after a softcap with one array untrained, 3xTF32 beside
    attn_bias's gradient (DBIAS "store" and MARGS in one key pass)."""
    _emulated(rng, DT, causal, **more)


def test_mma_config_carries_margs_on_the_key_pass_only():
    """The key pass gets MARGS (float64 accumulators of the trained arrays' dims, then the
    int32 bad-index flag, in its signature), the query pass nothing; deterministic=True
    refuses, saying where they run, packed sequences take them; explain's note."""
    from numba import types
    from numflash import mods as _mods
    from numflash.cuda.mma import gradients
    from test_mma_config import _gpu, _Problem, check_key_pass_gradient_refusals
    dev = _gpu((9, 0))
    p = _Problem("float16", 64)
    p.varlen, p.deterministic, p.dbias = None, False, None
    opts = _options(np.random.default_rng(0), 64, 64)
    p.mods = _mods.build(p.shape, "numpy", 0, **opts)
    p.dmod_args = tuple(np.zeros(np.shape(a)) if n < 3 else None
                        for n, a in enumerate(opts["mod_args"]))
    cfg = gradients.config(p, dev)
    assert cfg["keys"].MARGS and "MARGS" not in dict(cfg["queries"])
    assert gradients._signature("float16", "keys", cfg["keys"])[-4:] == (
        types.Array(types.float64, 2, "A"), types.Array(types.float64, 1, "A"),
        types.Array(types.float64, 1, "A"), types.Array(types.int32, 1, "A"))
    assert "mod_args gradients" in " ".join(gradients.notes(p, cfg, dev))
    check_key_pass_gradient_refusals(p, dev, "MARGS", "dmod_args",
                                     gradients.mod_args_grad_token,
                                     "deterministic=True takes them on the CPU path",
                                     packed_refused=False)


@pytest.mark.extended
def test_mma_margs_key_passes_compile():
    """The MARGS key pass (a table and slopes trained) for sm_90 float16 at d64: no spill, stack
    or local memory, and float64 atomic adds (sm_80 bfloat16 d64: 233 registers, no spill,
    compiled once, bench/NOTES.md; left out here for CI time)."""
    import json
    from test_cuda_compile import run_without_simulator
    code = """
        import dataclasses, json
        import numpy as np
        from numflash import mods
        from numflash.cuda import launch
        from numflash.cuda.mma import gradients, mods as kernel_mods

        def rel(x, b, h, i, j, table, slopes, shift):
            return x + table[h, i - j + shift] - slopes[h] * abs(i - j)

        def rel_grad(x, b, h, i, j, table, slopes, shift):
            return 1.0

        def table_at(x, b, h, i, j, table, slopes, shift):
            return (h, i - j + shift), 1.0

        def slope_at(x, b, h, i, j, table, slopes, shift):
            return h, -1.0 * abs(i - j)

        rows = []
        for cc, DT, dtype, smem in (((9, 0), "f16", "float16", 227 * 1024),):
            built = mods.build((2, 2, 64, 64, 64, 64), "numpy", 0, score_mod=rel,
                               score_mod_grad=rel_grad, mod_args=(np.zeros((2, 128), np.float32),
                               np.zeros(2, np.float32), 64),
                               score_mod_args_grad=(table_at, slope_at, None))
            token = kernel_mods.token_for(built)
            cfg = {k: dataclasses.replace(c, MODS=token) for k, c in
                   gradients.tiles(64, 64, smem, False, mods=True, DT=DT, cc=cc).items()}
            cfg["keys"] = dataclasses.replace(cfg["keys"],
                                              MARGS=kernel_mods.arg_grad_token(built))
            kernel, sig = gradients.compiled_kernels(cfg, dtype)[1]
            cubin, entry, ptx, res = launch.compile_to_cubin(kernel.pyfunc, sig, cc)
            rows.append([DT, res.get("registers", 0),
                         res.get("spill_store_bytes", 0) + res.get("spill_load_bytes", 0),
                         res.get("stack_bytes", 0), ptx.count("ld.local") + ptx.count("st.local"),
                         sum("atom" in ln and "add.f64" in ln for ln in ptx.splitlines())])
        print(json.dumps(rows))
    """
    rows = json.loads(run_without_simulator(code).strip().splitlines()[-1])
    assert len(rows) == 1, rows
    for DT, regs, spills, stack, local, atomics in rows:
        assert 0 < regs <= 255 and spills == stack == local == 0 and atomics > 0, rows


GPU_CASES = [  # (dtype, B, H, Hk, Nq, Nk, d, causal, more options)
    ("float16", 2, 4, 2, 300, 257, 64, True, {}),
    ("bfloat16", 1, 4, 4, 200, 333, 128, "bottom_right", dict(softcap=20.0)),
    ("float32", 2, 2, 2, 200, 300, 64, False, {}),
    ("float64", 1, 2, 1, 130, 150, 64, True, {}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, B, H, Hk, Nq, Nk, d, causal, more", GPU_CASES)
def test_gpu_mma_mod_args_gradients(dtype, B, H, Hk, Nq, Nk, d, causal, more):
    """On the GPU: cuda.mma's MARGS key pass against the reference (the accuracy rule), every
    operand kind, grouped heads, both causal alignments; (float16) an index outside the table
    raises IndexError after the kernel. The forward's o and lse come from the reference: a
    kernel with a user's functions compiles in every process, and these tests compile only the
    backward's two passes."""
    import cupy
    from test_mma_backward import _kind_dtype
    rng = np.random.default_rng(3)
    dt = _kind_dtype("bf16") if dtype == "bfloat16" else np.dtype(dtype)
    q = rng.standard_normal((B, H, Nq, d)).astype(dt)
    k, v = (rng.standard_normal((B, Hk, Nk, d)).astype(dt) for _ in "kv")
    do = rng.standard_normal((B, H, Nq, d)).astype(dt)
    opts = dict(_options(rng, Nq, Nk, arg_dtype=np.float32, heads=H), causal=causal, **more)
    gopts = dict(opts, mod_args=tuple(cupy.asarray(a) if hasattr(a, "shape") else a
                                      for a in opts["mod_args"]))
    on = [cupy.asarray(a) for a in (q, k, v, do)]
    plan = numflash.explain(*on[:3], backward=True, return_mod_args_grad=True, **gopts)
    assert plan.kernel == "cuda.mma" and plan.config["keys"].MARGS
    o, lse = reference.attention(q, k, v, return_lse=True, **opts)
    out, lse = cupy.asarray(o.astype(dt)), cupy.asarray(lse)
    grads = numflash.attention_backward(on[3], *on[:3], out, lse, return_mod_args_grad=True,
                                        **gopts)
    host = [g.get() for g in grads[:3]] + [tuple(None if g is None else g.get()
                                                 for g in grads[3])]
    testing.assert_gradients_accurate(host, do, q, k, v, **opts)
    if dtype != "float16":
        return
    bad = dict(gopts, score_mod_args_grad=(_past_the_end, None, None, None))
    with pytest.raises(IndexError, match="outside"):
        numflash.attention_backward(on[3], *on[:3], out, lse, return_mod_args_grad=True, **bad)
