"""cuda.row with modifications, forward and backward: the kernel of every GPU numflash runs on
(Turing and Volta have no other), so score / mask modifications run on any of them.

In numba's simulator (CI has no GPU) against the float64 reference with each option: every
built-in, combined with causal in both alignments, GQA, Nq != Nk and dv != d, a user mask_mod
and a user score_mod with its derivative; the planner's choice on a Turing GPU and the refusals
(a block mask, dropout) by name; and (extended tier) the compiled variants on sm_75 without
spills. On a GPU (marked): the same cases at real sizes through algorithm="row"."""
import numpy as np
import pytest

import numflash
from numflash.testing import assert_gradients_accurate, check
from test_mods import tanh_cap, tanh_cap_grad   # a softcap written by hand (a user's score_mod)

# the simulator tests are marked one by one: a module mark would also skip the GPU test on a GPU
simulator = pytest.mark.simulator


def _document(b, h, i, j, ids):
    return ids[i] == ids[j]


def _options(name, rng, B, H, Nq, Nk, dtype):
    ids = np.arange(max(Nq, Nk)) * 8 // max(Nq, Nk)   # 8 documents at any length
    return {
        "window": dict(window_size=(5, 3)),
        "window-causal-softcap": dict(causal="bottom_right", window_size=(7, 0), softcap=3.0),
        "window-left-open": dict(causal=True, window_size=(-1, 4)),
        "alibi": dict(alibi_slopes=np.linspace(0.1, 0.6, H)),
        "mask-bias": dict(attn_mask=rng.random((B, 1, Nq, Nk)) > 0.3,
                          attn_bias=rng.standard_normal((1, H, Nq, Nk)).astype(dtype)),
        "document": dict(mask_mod=_document, mod_args=(ids,), causal=True),
        "user-softcap": dict(score_mod=tanh_cap, score_mod_grad=tanh_cap_grad, mod_args=(2.5,),
                             causal="bottom_right"),
    }[name]


CASES = [  # (options, dtype, B, H, Hk, Nq, Nk, d, dv)
    ("window", "float32", 1, 2, 1, 37, 53, 16, 24),
    ("window-causal-softcap", "float64", 2, 2, 2, 53, 37, 8, 8),
    ("window-left-open", "float16", 1, 2, 2, 40, 40, 16, 16),
    ("alibi", "float32", 1, 4, 2, 33, 33, 16, 16),
    ("mask-bias", "float64", 1, 2, 2, 29, 45, 16, 8),
    ("document", "float32", 1, 2, 1, 50, 50, 16, 16),
    ("user-softcap", "float64", 1, 2, 2, 31, 47, 8, 8),
]


@simulator
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_row_kernels_apply_modifications_forward_and_backward(rng, case):
    name, dtype, B, H, Hk, Nq, Nk, d, dv = case
    q = rng.standard_normal((B, H, Nq, d)).astype(dtype)
    k = rng.standard_normal((B, Hk, Nk, d)).astype(dtype)
    v = rng.standard_normal((B, Hk, Nk, dv)).astype(dtype)
    opts = _options(name, rng, B, H, Nq, Nk, dtype)
    for backward in (False, True):
        plan = numflash.explain(q, k, v, backend="cuda", algorithm="row", backward=backward,
                                **opts)
        assert plan.kernel == "cuda.row", str(plan)
        assert plan.config.get("MODS") or plan.config.get("WINDOW"), str(plan)
    o, lse = numflash.attention(q, k, v, backend="cuda", algorithm="row", return_lse=True,
                                **opts)
    rep = check(o, q, k, v, lse=lse, **opts)
    assert rep.ok, str(rep)
    do = rng.standard_normal(o.shape).astype(dtype)
    grads = numflash.attention_backward(do, q, k, v, o, lse, backend="cuda", algorithm="row",
                                        **opts)
    assert_gradients_accurate(grads, do, q, k, v, **opts)


@simulator
def test_a_window_changes_the_row_kernels_result(rng):
    """The window is applied, not only accepted: outside the reference's tolerance of the
    unwindowed result, forward and backward."""
    q, k, v = (rng.standard_normal((1, 1, 40, 16)).astype(np.float32) for _ in range(3))
    run = dict(backend="cuda", algorithm="row")
    o, lse = numflash.attention(q, k, v, return_lse=True, window_size=(2, 2), **run)
    o_all, lse_all = numflash.attention(q, k, v, return_lse=True, **run)
    assert np.abs(o - o_all).max() > 0.1
    do = np.ones_like(o)
    g = numflash.attention_backward(do, q, k, v, o, lse, window_size=(2, 2), **run)
    g_all = numflash.attention_backward(do, q, k, v, o_all, lse_all, **run)
    assert np.abs(g[1] - g_all[1]).max() > 0.1


@simulator
def test_on_a_turing_gpu_auto_takes_cuda_row_for_modifications_and_refuses_the_rest(rng):
    from numflash import mods as _mods
    from numflash.dropout import build as dropout
    from numflash.kernels import operators
    from numflash.plan import Device, _choose
    from numflash.precompile import StandIn
    turing = Device("sm75", cc=(7, 5), smem_per_block_optin=64 * 1024)
    p = StandIn(64, "float16")   # a CuPy float16 problem as the planner sees it (nothing runs)
    p.mods = _mods.build(p.shape, "numpy", 0, window_size=(32, 0), softcap=20.0)
    p.dropout = None
    plan = _choose(p, "auto", "auto", device=turing)
    assert plan.kernel == "cuda.row", str(plan)
    assert "cuda.mma needs compute capability >= 8.0" in plan.rejected["cuda.mma"]
    assert "does not take score/mask modifications" in plan.rejected["cuda.block"]
    block = numflash.create_block_mask(lambda b, h, i, j: j <= i, *p.shape[:4])
    p.mods = _mods.build(p.shape, "numpy", 0, block_mask=block)
    why = operators()["cuda.row"].why_not(p, turing)
    assert "not block_mask" in why and "cpu.tiled" in why
    p.mods, p.dropout = None, dropout(0.1, 7)
    assert "has no dropout" in operators()["cuda.row"].why_not(p, turing)


@simulator
def test_row_variants_with_modifications_compile_for_turing_without_spills():
    """ptxas for sm_75 (and sm_90) on cuda.row's forward and backward variants with a window, a
    softcap and ALiBi, and with a user mask and a bias, in each compute type."""
    from test_cuda_compile import run_without_simulator
    out = run_without_simulator("""
        import json
        import numpy as np
        from numflash import mods
        from numflash.cuda import launch, row, row_backward
        from numflash.device import Device
        from numflash.precompile import StandIn

        def doc(b, h, i, j, ids):
            return ids[i] == ids[j]
        rows = []
        for dt in ("float16", "float32", "float64"):
            for opts in (dict(window_size=(5, 3), softcap=2.0, alibi_slopes=np.ones(1)),
                         dict(mask_mod=doc, mod_args=(np.zeros(128, np.int64),),
                              attn_bias=np.zeros((1, 1, 128, 128), np.float32))):
                for module, direction in ((row, "forward"), (row_backward, "backward")):
                    p = StandIn(64, dt, direction=direction)
                    p.mods = mods.build(p.shape, "numpy", 0, **opts)
                    for cc in ((7, 5), (9, 0)):
                        cfg = module.config(p, Device.of_arch(cc))
                        for kernel, sig in module.compiled_kernels(cfg, dt):
                            res = launch.compile_to_cubin(kernel.pyfunc, sig, cc)[3]
                            rows.append([dt, direction, list(cc), res["registers"],
                                         res.get("spill_store_bytes", 0),
                                         res.get("stack_bytes", 0)])
        print(json.dumps(rows))
    """)
    import json
    rows = json.loads(out.splitlines()[-1])
    assert len(rows) == 3 * 2 * 2 * 3   # dtypes, options, archs, kernels (the backward's two)
    assert not [r for r in rows if r[4] or r[5]], rows


# ---- on a GPU ----

@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_gpu_row_kernels_apply_modifications(rng, case):
    import cupy as cp
    name, dtype, B, H, Hk, Nq, Nk, d, dv = case
    Nq, Nk = Nq * 20 + 3, Nk * 20 + 1    # real sizes, not multiples of the tiles
    host = [rng.standard_normal(s).astype(dtype) for s in
            ((B, H, Nq, d), (B, Hk, Nk, d), (B, Hk, Nk, dv), (B, H, Nq, dv))]
    q, k, v, do = (cp.asarray(a) for a in host)
    opts = _options(name, rng, B, H, Nq, Nk, dtype)
    dev_opts = {key: (cp.asarray(val) if isinstance(val, np.ndarray) else
                      tuple(cp.asarray(a) if isinstance(a, np.ndarray) else a for a in val)
                      if key == "mod_args" else val) for key, val in opts.items()}
    o, lse = numflash.attention(q, k, v, algorithm="row", return_lse=True, **dev_opts)
    rep = check(o, q, k, v, lse=lse, **opts)
    assert rep.ok, str(rep)
    grads = numflash.attention_backward(do, q, k, v, o, lse, algorithm="row", **dev_opts)
    assert_gradients_accurate([g.get() for g in grads], *host[3:], *host[:3], **opts)
