"""attention_backward: the float64 reference (checked by finite differences), the CPU kernel
against it by the accuracy rule, every option, input checks, determinism and explain."""
import numpy as np
import pytest

import numflash
from numflash import reference, testing
from numflash.inputs import lse_dtype


def make(rng, B, H, Nq, Nk, d, dv=None, dtype=np.float32, layout="bhsd", kv_heads=None):
    """q, k, v, do; ``kv_heads``: K/V heads (grouped-query attention), H by default."""
    dv = d if dv is None else dv
    Hkv = H if kv_heads is None else kv_heads

    def arr(N, dim, heads=H):
        shape = (B, heads, N, dim) if layout == "bhsd" else (B, N, heads, dim)
        return rng.standard_normal(shape).astype(dtype)
    return arr(Nq, d), arr(Nk, d, Hkv), arr(Nk, dv, Hkv), arr(Nq, dv)


def forward_backward(q, k, v, do, **opts):
    o, lse = numflash.attention(q, k, v, return_lse=True, **opts)
    return numflash.attention_backward(do, q, k, v, o, lse, **opts)


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("shape", [(1, 2, 3, 4, 3, 2), (1, 1, 5, 3, 2, 4), (2, 1, 1, 1, 1, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_reference_gradients_match_finite_differences(rng, causal, shape):
    B, H, Nq, Nk, d, dv = shape
    q, k, v, do = make(rng, B, H, Nq, Nk, d, dv, dtype=np.float64)
    scale = 0.7

    def loss(q_, k_, v_):
        o, _ = reference.naive(q_, k_, v_, scale=scale, causal=bool(causal),
                               causal_offset=Nk - Nq if causal == "bottom_right" else 0)
        return float((o * do).sum())

    grads = reference.attention_backward(do, q, k, v, causal=causal, softmax_scale=scale)
    eps = 1e-6
    for which, g in enumerate(grads):
        args = [q, k, v]
        num = np.zeros_like(args[which])
        for idx in np.ndindex(*num.shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            num[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8)


SHAPES = [  # (B, H, Nq, Nk, d, dv): odd sizes, Nq != Nk, dv != d, several key and query blocks
    (1, 2, 97, 97, 59, 59),
    (2, 1, 1, 1, 1, 1),
    (1, 1, 1025, 97, 111, 8),
    (1, 1, 97, 1025, 16, 40),
    (1, 1, 300, 600, 256, 256),
]


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_cpu_gradients_meet_the_accuracy_rule(rng, dtype, shape, causal):
    q, k, v, do = make(rng, *shape, dtype=dtype)
    grads = forward_backward(q, k, v, do, causal=causal)
    assert all(g.dtype == dtype and g.shape == a.shape for g, a in zip(grads, (q, k, v)))
    testing.assert_gradients_accurate(grads, do, q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bshd_layout_strided_inputs_scale_and_given_outputs(rng, dtype):
    q, k, v, do = make(rng, 2, 3, 70, 90, 24, 12, dtype=dtype, layout="bshd")
    # Strided views: every other element of the head dim.
    q2, k2 = (np.repeat(a, 2, axis=-1)[..., ::2] for a in (q, k))
    assert not q2.flags.c_contiguous
    opts = dict(causal="bottom_right", softmax_scale=0.3, layout="bshd")
    o, lse = numflash.attention(q2, k2, v, return_lse=True, **opts)
    outs = tuple(np.full(a.shape, np.nan, dtype) for a in (q, k, v))
    res = numflash.attention_backward(do, q2, k2, v, o, lse, dq=outs[0], dk=outs[1], dv=outs[2],
                                      **opts)
    assert all(r is g for r, g in zip(res, outs))
    testing.assert_gradients_accurate(res, do, q, k, v, **opts)


def test_rows_that_see_no_key_get_zero_gradients(rng):
    # bottom_right with Nq > Nk: the first Nq - Nk query rows see no key.
    q, k, v, do = make(rng, 1, 2, 40, 10, 8)
    dq, dk, dv = forward_backward(q, k, v, do, causal="bottom_right")
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert (dq[:, :, :30] == 0).all()
    testing.assert_gradients_accurate((dq, dk, dv), do, q, k, v, causal="bottom_right")


@pytest.mark.parametrize("B,H,Nq,Nk", [(1, 2, 0, 5), (1, 2, 5, 0), (0, 2, 5, 5)])
def test_empty_problems(rng, B, H, Nq, Nk):
    q, k, v, do = make(rng, B, H, Nq, Nk, 4)
    dq, dk, dv = forward_backward(q, k, v, do)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert not (np.isnan(dq).any() or np.isnan(dk).any() or np.isnan(dv).any())
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


def test_key_block_splits_sum_to_the_single_split_result(rng):
    """One head spreads its key blocks over several dQ accumulators (splits); the sum in a fixed
    order must give the same gradients as one split, and be bitwise reproducible."""
    from numflash.cpu import backward
    from numflash.inputs import normalize_backward
    q, k, v, do = make(rng, 1, 1, 200, 300, 16, dtype=np.float64)
    o, lse = numflash.attention(q, k, v, return_lse=True, causal=True)
    results = []
    for splits in (1, 3, 3):
        p = normalize_backward(do, q, k, v, o, lse, causal=True)
        backward.run(p, {"block_q": 64, "block_k": 32, "splits": splits, "share_b": False,
                         "share_h": False})
        results.append(p.result)
    for a, b in zip(results[0], results[1]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    for a, b in zip(results[1], results[2]):
        assert np.array_equal(a, b)
    testing.assert_gradients_accurate(results[1], do, q, k, v, causal=True)


def test_deterministic_runs_are_bitwise_equal(rng):
    q, k, v, do = make(rng, 1, 1, 300, 500, 32)
    o, lse = numflash.attention(q, k, v, return_lse=True)
    runs = [numflash.attention_backward(do, q, k, v, o, lse, deterministic=True) for _ in range(3)]
    for run in runs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(runs[0], run))


def test_lse_is_float64_for_float64_inputs_and_bounds_the_gradient_error(rng):
    q, k, v, do = make(rng, 1, 1, 50, 60, 8, dtype=np.float64)
    o, lse = numflash.attention(q, k, v, return_lse=True)
    assert lse.dtype == np.float64 == lse_dtype(q.dtype)
    ref_o, ref_lse = reference.attention(q, k, v, return_lse=True)
    assert ref_lse.dtype == np.float64
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-13)
    with pytest.raises(TypeError, match=r"^lse must be float64 for float64 inputs"):
        numflash.attention_backward(do, q, k, v, o, lse.astype(np.float32))


def _valid(rng):
    q, k, v, do = make(rng, 1, 2, 5, 7, 4, 3)
    o, lse = numflash.attention(q, k, v, return_lse=True)
    return dict(do=do, q=q, k=k, v=v, o=o, lse=lse)


@pytest.mark.parametrize("change,exc,pattern", [
    (lambda a: {"do": a["do"][:, :, :4]}, ValueError, r"^do must have the output's shape"),
    (lambda a: {"o": a["o"].astype(np.float64)}, TypeError, r"^o must have q's dtype float32"),
    (lambda a: {"lse": a["lse"][:, :1]}, ValueError, r"^lse must have shape \(B, H, Nq\)"),
    (lambda a: {"lse": a["lse"].astype(np.float64)}, TypeError, r"^lse must be float32"),
    (lambda a: {"do": a["do"].tolist()}, TypeError, r"^do must be a NumPy array"),
    (lambda a: {"q": a["q"][..., :3]}, ValueError, r"^q and k must have the same head dim"),
    (lambda a: {"k": a["k"].astype(np.float64)}, TypeError, r"^q, k and v must share one dtype"),
])
def test_bad_inputs_name_the_argument(rng, change, exc, pattern):
    args = _valid(rng)
    args.update(change(args))
    with pytest.raises(exc, match=pattern):
        numflash.attention_backward(args["do"], args["q"], args["k"], args["v"], args["o"],
                                    args["lse"])


def test_bad_gradient_outputs_and_options(rng):
    a = _valid(rng)
    pos = (a["do"], a["q"], a["k"], a["v"], a["o"], a["lse"])
    with pytest.raises(ValueError, match=r"^dq overlaps q"):
        numflash.attention_backward(*pos, dq=a["q"])
    with pytest.raises(ValueError, match=r"^dk must have shape"):
        numflash.attention_backward(*pos, dk=np.empty((1, 2, 5, 4), np.float32))
    with pytest.raises(TypeError, match=r"^dv must have q's dtype"):
        numflash.attention_backward(*pos, dv=np.empty((1, 2, 7, 3), np.float64))
    shared = np.empty((1, 2, 7, 4), np.float32)
    with pytest.raises(ValueError, match=r"^dk overlaps dq"):
        numflash.attention_backward(*pos, dq=shared[:, :, :5], dk=shared)
    with pytest.raises(TypeError, match=r"^deterministic must be True or False"):
        numflash.attention_backward(*pos, deterministic="yes")
    with pytest.raises(ValueError, match=r"^causal must be one of"):
        numflash.attention_backward(*pos, causal="diagonal")
    with pytest.raises(ValueError, match=r"^softmax_scale must be finite"):
        numflash.attention_backward(*pos, softmax_scale=float("nan"))


def test_explain_names_the_backward_kernel(rng):
    a = _valid(rng)
    plan = numflash.explain(a["q"], a["k"], a["v"], backward=True, causal=True)
    assert plan.kernel == "cpu.tiled" and plan.direction == "backward"
    text = str(plan)
    assert text.startswith("numflash backward plan: cpu.tiled") and "splits=" in text
    assert "not cuda.block: backend='cpu'" not in text  # no forward-only kernels listed
    assert "not cuda.row: backend='cpu'" in text
    with pytest.raises(ValueError, match=r"CPU path implements the block-tiled loop only"):
        numflash.attention_backward(a["do"], a["q"], a["k"], a["v"], a["o"], a["lse"],
                                    algorithm="row")


# ---- grad_dtype: float32 gradients of 16-bit inputs


@pytest.mark.parametrize("causal", [True, "bottom_right"])
def test_float32_gradients_of_float16_inputs(rng, causal):
    """grad_dtype=float32: the gradients as accumulated, which round to the float16 gradients
    bit for bit, meet the rule, and go into given float32 buffers."""
    q, k, v, do = make(rng, 1, 2, 97, 70, 59, 40, dtype=np.float16)
    o, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
    plain = numflash.attention_backward(do, q, k, v, o, lse, causal=causal)
    wide = numflash.attention_backward(do, q, k, v, o, lse, causal=causal, grad_dtype="float32")
    assert [g.dtype for g in wide] == [np.float32] * 3
    for a, b in zip(plain, wide):
        assert np.array_equal(b.astype(np.float16), a)
    assert any(not np.array_equal(b, a.astype(np.float32)) for a, b in zip(plain, wide))
    testing.assert_gradients_accurate(wide, do, q, k, v, causal=causal)
    given = tuple(np.full(a.shape, np.nan, np.float32) for a in (q, k, v))
    res = numflash.attention_backward(do, q, k, v, o, lse, causal=causal, grad_dtype=np.float32,
                                      dq=given[0], dk=given[1], dv=given[2])
    assert all(r is g for r, g in zip(res, given))
    assert all(np.array_equal(r, w) for r, w in zip(res, wide))


def test_float32_partials_over_key_chunks_sum_to_the_gradients(rng):
    """What ring attention does with grad_dtype: each chunk of keys' gradients against the whole
    row's lse and O, in float32, summed (dK, dV per chunk, dQ over chunks) meet the rule."""
    q, k, v, do = make(rng, 1, 2, 150, 300, 32, dtype=np.float16)
    o, lse = numflash.attention(q, k, v, return_lse=True)
    dq = np.zeros(q.shape, np.float32)
    dk, dv = np.zeros(k.shape, np.float32), np.zeros(v.shape, np.float32)
    for k0 in range(0, 300, 100):
        part = numflash.attention_backward(do, q, k[:, :, k0:k0 + 100], v[:, :, k0:k0 + 100], o,
                                           lse, grad_dtype=np.float32)
        dq += part[0]
        dk[:, :, k0:k0 + 100], dv[:, :, k0:k0 + 100] = part[1], part[2]
    testing.assert_gradients_accurate((dq, dk, dv), do, q, k, v)


def test_grad_dtype_refusals(rng):
    q, k, v, do = make(rng, 1, 1, 5, 6, 4, dtype=np.float16)
    o, lse = numflash.attention(q, k, v, return_lse=True)
    pos = (do, q, k, v, o, lse)
    with pytest.raises(TypeError, match=r"^grad_dtype=float64 with float16 inputs"):
        numflash.attention_backward(*pos, grad_dtype=np.float64)
    with pytest.raises(TypeError, match=r"^grad_dtype must be None or a dtype"):
        numflash.attention_backward(*pos, grad_dtype="wide")
    with pytest.raises(TypeError, match=r"^dk must have grad_dtype's dtype float32"):
        numflash.attention_backward(*pos, grad_dtype="float32", dk=np.empty(k.shape, np.float16))
    with pytest.raises(TypeError, match=r"^dq must have q's dtype float16"):
        numflash.attention_backward(*pos, dq=np.empty(q.shape, np.float32))
    q32, k32, v32, do32 = (a.astype(np.float32) for a in (q, k, v, do))
    o32, lse32 = numflash.attention(q32, k32, v32, return_lse=True)
    with pytest.raises(TypeError, match=r"^grad_dtype=float16 with float32 inputs"):
        numflash.attention_backward(do32, q32, k32, v32, o32, lse32, grad_dtype=np.float16)
    same = numflash.attention_backward(do32, q32, k32, v32, o32, lse32, grad_dtype=np.float32)
    assert all(g.dtype == np.float32 for g in same)
    with pytest.raises(ValueError, match=r"^grad_dtype is a backward option"):
        numflash.explain(q, k, v, grad_dtype=np.float32)
    assert numflash.explain(q, k, v, backward=True, grad_dtype=np.float32).kernel == "cpu.tiled"
