"""A NaN score poisons its row, on every backend, as in the float64 reference: a NaN in a query
row or a key makes the rows that see it NaN (output and lse), never zeros with lse = -inf, and
nothing leaks into other rows, heads or batches."""
import numpy as np
import pytest

import numflash
from numflash import reference, testing

BACKENDS = [("cpu", "auto"),
            pytest.param("cuda", "block", marks=pytest.mark.simulator),
            pytest.param("cuda", "row", marks=pytest.mark.simulator),
            pytest.param("gpu", "block", marks=pytest.mark.gpu),
            pytest.param("gpu", "row", marks=pytest.mark.gpu),
            pytest.param("gpu", "mma", marks=pytest.mark.gpu)]


def run(backend, fn, *arrays, **opts):
    """fn on NumPy arrays (cpu, simulator) or on their CuPy copies (gpu); NumPy results."""
    if backend != "gpu":
        return fn(*arrays, backend=backend, **opts)
    import cupy
    res = fn(*(cupy.asarray(a) for a in arrays), backend="cuda", **opts)
    return tuple(r.get() for r in res)


def _poisoned(rng, where, dtype):
    q, k, v = (rng.standard_normal((2, 2, 37, 12)).astype(dtype) for _ in range(3))
    if where == "q":
        q[1, 0, 5, 3] = np.nan
    else:
        k[0, 1, 20, 0] = np.nan
    return q, k, v


def _assert_same_nan_rows_and_finite_rest(got, ref, what):
    got = np.asarray(got, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(ref)), f"{what}: NaN pattern differs"
    assert np.isnan(ref).any(), f"{what}: the case poisons nothing"
    ok = ~np.isnan(ref)
    assert np.isfinite(got[ok]).all()


@pytest.mark.parametrize("backend,algorithm", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_scores_poison_exactly_the_rows_that_see_them(rng, backend, algorithm, causal, where,
                                                           dtype):
    q, k, v = _poisoned(rng, where, dtype)
    o, lse = run(backend, numflash.attention, q, k, v, causal=causal, return_lse=True,
                 algorithm=algorithm)
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    _assert_same_nan_rows_and_finite_rest(o, ref_o, "out")
    _assert_same_nan_rows_and_finite_rest(lse, ref_lse, "lse")
    clean = ~np.isnan(ref_o).any(axis=-1)  # the untouched rows are still exact
    err = np.abs(o.astype(np.float64) - ref_o)[clean].max()
    assert err <= 1e-5 if dtype == np.float32 else err <= 1e-12


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.simulator),
                                     pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("where", ["q", "k"])
def test_nan_scores_poison_the_gradients_as_in_the_reference(rng, backend, where):
    q, k, v = _poisoned(rng, where, np.float64)
    do = rng.standard_normal(q.shape)
    o, lse = run(backend, numflash.attention, q, k, v, return_lse=True)
    grads = run(backend, numflash.attention_backward, do, q, k, v, o, lse)
    for name, g, r in zip(("dq", "dk", "dv"), grads,
                          reference.attention_backward(do, q, k, v)):
        _assert_same_nan_rows_and_finite_rest(g, r, name)


def test_rows_without_keys_still_give_zeros_and_minus_inf(rng):
    q, k, v = (rng.standard_normal((1, 1, 9, 4)) for _ in range(3))
    o, lse = numflash.attention(q, k[:, :, :3], v[:, :, :3], causal="bottom_right",
                                return_lse=True)
    assert (o[0, 0, :6] == 0).all() and np.isneginf(lse[0, 0, :6]).all()
    testing.assert_accurate(o, q, k[:, :, :3], v[:, :, :3], lse=lse, causal="bottom_right")
