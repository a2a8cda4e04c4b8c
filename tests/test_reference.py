"""The float64 reference against an independent, written-out formula.

Everything else is judged against numflash.reference, so it is checked here against a loop-per-row
softmax that shares no code with it (no matmul, no shared masking code).
"""
import math

import numpy as np
import pytest

from numflash import reference
from numflash.inputs import lse_dtype


def direct(q, k, v, scale, visible):
    """Row by row in Python floats: o_i = sum_j e^(s_ij - m_i) v_j / sum_j e^(s_ij - m_i).

    q, k, v are (B, H, N, d) NumPy arrays, visible(i, j) says whether query i sees key j.
    Returns (o float64, lse float64), zeros and -inf for rows that see no key.
    """
    B, H, Nq, _ = q.shape
    Nk, dv = k.shape[2], v.shape[3]
    o = np.zeros((B, H, Nq, dv))
    lse = np.full((B, H, Nq), -math.inf)
    for b in range(B):
        for h in range(H):
            for i in range(Nq):
                js = [j for j in range(Nk) if visible(i, j)]
                if not js:
                    continue
                s = [scale * math.fsum(float(x) * float(y) for x, y in zip(q[b, h, i], k[b, h, j]))
                     for j in js]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                den = math.fsum(w)
                for c in range(dv):
                    o[b, h, i, c] = math.fsum(wj * float(v[b, h, j, c]) for wj, j in zip(w, js)) / den
                lse[b, h, i] = m + math.log(den)
    return o, lse


def visibility(causal, Nq, Nk):
    if causal in (False, None):
        return lambda i, j: True
    if causal in (True, "top_left"):
        return lambda i, j: j <= i
    assert causal == "bottom_right"
    return lambda i, j: j <= i + Nk - Nq


def qkv(rng, B, H, Nq, Nk, d, dv, dtype=np.float64, scale=1.0):
    return (scale * rng.standard_normal((B, H, Nq, d)).astype(dtype),
            scale * rng.standard_normal((B, H, Nk, d)).astype(dtype),
            rng.standard_normal((B, H, Nk, dv)).astype(dtype))


CASES = [  # (B, H, Nq, Nk, d, dv)
    (1, 1, 1, 1, 1, 1),
    (1, 2, 5, 5, 4, 4),
    (2, 1, 3, 8, 5, 2),
    (1, 2, 8, 3, 3, 6),
    (2, 2, 7, 7, 16, 1),
]
CAUSAL = [False, True, "top_left", "bottom_right"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_reference_matches_direct_formula(rng, case, causal):
    B, H, Nq, Nk, d, dv = case
    q, k, v = qkv(rng, *case)
    scale = 1.0 / math.sqrt(d)
    o, lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    o_d, lse_d = direct(q, k, v, scale, visibility(causal, Nq, Nk))
    assert o.dtype == np.float64 and o.shape == (B, H, Nq, dv)
    np.testing.assert_allclose(o, o_d, rtol=1e-12, atol=1e-13)
    assert lse.dtype == lse_dtype(q.dtype) and lse.shape == (B, H, Nq)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_d))
    fin = np.isfinite(lse_d)
    np.testing.assert_allclose(lse[fin], lse_d[fin], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", CAUSAL)
def test_naive_float64_lse_matches_direct_formula_exactly(rng, causal):
    q, k, v = qkv(rng, 2, 2, 6, 9, 5, 3, scale=2.0)
    o, lse = reference.naive(q, k, v, scale=0.7, causal=causal is not False,
                             causal_offset=9 - 6 if causal == "bottom_right" else 0)
    o_d, lse_d = direct(q, k, v, 0.7, visibility(causal, 6, 9))
    assert lse.dtype == np.float64
    np.testing.assert_allclose(lse, lse_d, rtol=1e-13)
    np.testing.assert_allclose(o, o_d, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("causal", CAUSAL)
def test_lse_is_logsumexp_of_scaled_masked_scores(rng, causal):
    B, H, Nq, Nk, d, dv = 2, 3, 11, 17, 8, 4
    q, k, v = qkv(rng, B, H, Nq, Nk, d, dv, scale=3.0)  # large scores: exp would overflow unshifted
    scale = 1.7
    _, lse = reference.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    s = scale * np.einsum("bhid,bhjd->bhij", q, k)
    vis = np.array([[visibility(causal, Nq, Nk)(i, j) for j in range(Nk)] for i in range(Nq)])
    s = np.where(vis, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    expected = (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]
    assert np.abs(s).max() > 100  # the shift matters
    np.testing.assert_allclose(lse, expected, rtol=1e-6)


def test_top_left_and_true_are_the_same(rng):
    q, k, v = qkv(rng, 1, 2, 6, 10, 4, 4)
    a = reference.attention(q, k, v, causal=True)
    b = reference.attention(q, k, v, causal="top_left")
    np.testing.assert_array_equal(a, b)


def test_bottom_right_equals_top_left_when_square(rng):
    q, k, v = qkv(rng, 1, 2, 7, 7, 4, 4)
    a = reference.attention(q, k, v, causal="bottom_right")
    b = reference.attention(q, k, v, causal="top_left")
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("causal,Nq,Nk", [("top_left", 5, 9), ("top_left", 9, 5),
                                          ("bottom_right", 5, 9), ("bottom_right", 9, 5)])
def test_masked_keys_do_not_influence_rows(rng, causal, Nq, Nk):
    """Changing keys/values a row cannot see leaves that row unchanged; changing seen ones does not."""
    q, k, v = qkv(rng, 1, 1, Nq, Nk, 4, 3)
    o = reference.attention(q, k, v, causal=causal)
    vis = visibility(causal, Nq, Nk)
    for i in range(Nq):
        hidden = [j for j in range(Nk) if not vis(i, j)]
        seen = [j for j in range(Nk) if vis(i, j)]
        k2, v2 = k.copy(), v.copy()
        k2[0, 0, hidden] = 100.0
        v2[0, 0, hidden] = -100.0
        o2 = reference.attention(q, k2, v2, causal=causal)
        np.testing.assert_array_equal(o2[0, 0, i], o[0, 0, i])
        if seen:
            v3 = v.copy()
            v3[0, 0, seen[-1]] += 1.0
            o3 = reference.attention(q, k, v3, causal=causal)
            assert np.abs(o3[0, 0, i] - o[0, 0, i]).min() > 0


@pytest.mark.parametrize("Nq,Nk", [(9, 4), (3, 1), (5, 0)])
def test_fully_masked_rows_give_zeros_and_minus_inf(rng, Nq, Nk):
    q, k, v = qkv(rng, 2, 1, Nq, Nk, 3, 2)
    o, lse = reference.attention(q, k, v, causal="bottom_right", return_lse=True)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    masked = Nq - Nk  # rows i < Nq - Nk see no key
    assert (o[:, :, :masked] == 0).all()
    assert np.isneginf(lse[:, :, :masked]).all()
    assert np.isfinite(lse[:, :, masked:]).all()
    if Nk:
        # the first row that sees a key sees exactly key 0, so its output is v[0]
        np.testing.assert_allclose(o[:, :, masked], v[:, :, 0], rtol=1e-15)
        np.testing.assert_allclose(lse[:, :, masked],
                                   np.einsum("bhd,bhd->bh", q[:, :, masked], k[:, :, 0]) / math.sqrt(3),
                                   rtol=1e-6)


def test_nk_zero_reference(rng):
    q, k, v = qkv(rng, 1, 2, 4, 0, 3, 5)
    o, lse = reference.attention(q, k, v, return_lse=True)
    assert o.shape == (1, 2, 4, 5) and (o == 0).all()
    assert np.isneginf(lse).all()


def test_nq_zero_reference(rng):
    q, k, v = qkv(rng, 1, 2, 0, 4, 3, 5)
    o, lse = reference.attention(q, k, v, return_lse=True, causal="bottom_right")
    assert o.shape == (1, 2, 0, 5) and lse.shape == (1, 2, 0)


def test_ones_values_give_ones(rng):
    q, k, _ = qkv(rng, 2, 2, 6, 8, 5, 1, scale=4.0)
    v = np.ones((2, 2, 8, 3))
    for causal in CAUSAL:
        o = reference.attention(q, k, v, causal=causal)
        np.testing.assert_allclose(o, 1.0, rtol=1e-14)


def test_softmax_is_invariant_to_a_per_row_shift(rng):
    """Adding u to every key adds q_i.u to row i's scores: output unchanged, lse shifted."""
    q, k, v = qkv(rng, 1, 2, 6, 8, 4, 3)
    u = rng.standard_normal(4)
    scale = 0.9
    o, lse = reference.naive(q, k, v, scale=scale)
    o2, lse2 = reference.naive(q, k + u, v, scale=scale)
    np.testing.assert_allclose(o2, o, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse2, lse + scale * (q @ u), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, "float32", np.dtype("float32")])
def test_naive_float32_differs_slightly_from_float64(rng, dtype):
    q, k, v = qkv(rng, 2, 2, 64, 80, 32, 16)
    o64, lse64 = reference.naive(q, k, v, scale=1 / math.sqrt(32))
    o32, lse32 = reference.naive(q, k, v, scale=1 / math.sqrt(32), dtype=dtype)
    assert o32.dtype == np.float32
    err = np.abs(o32.astype(np.float64) - o64).max()
    assert 0 < err < 1e-5
    assert np.abs(lse32 - lse64).max() < 1e-5


def test_naive_float16_work_is_coarser_than_float32(rng):
    q, k, v = qkv(rng, 1, 2, 32, 40, 16, 8)
    o64, _ = reference.naive(q, k, v, scale=0.25)
    o32, _ = reference.naive(q, k, v, scale=0.25, dtype=np.float32)
    o16, _ = reference.naive(q, k, v, scale=0.25, dtype=np.float16)
    e32 = np.abs(o32 - o64).max()
    e16 = np.abs(o16.astype(np.float64) - o64).max()
    assert e32 < e16 < 1e-2


def test_reference_accepts_float16_and_returns_float64(rng):
    q, k, v = (a.astype(np.float16) for a in qkv(rng, 1, 1, 4, 6, 3, 3))
    o = reference.attention(q, k, v)
    assert o.dtype == np.float64
    o_d, _ = direct(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                    1 / math.sqrt(3), lambda i, j: True)
    np.testing.assert_allclose(o, o_d, rtol=1e-12)


def test_reference_layout_bshd(rng):
    q, k, v = qkv(rng, 2, 3, 5, 7, 4, 6)
    o = reference.attention(q, k, v, causal="bottom_right")
    t = [a.transpose(0, 2, 1, 3) for a in (q, k, v)]
    o2 = reference.attention(*t, causal="bottom_right", layout="bshd")
    assert o2.shape == (2, 5, 3, 6)
    np.testing.assert_array_equal(o2, o.transpose(0, 2, 1, 3))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_reference_out_is_written_and_returned(rng, layout):
    q, k, v = qkv(rng, 1, 2, 5, 7, 4, 3, dtype=np.float32)
    if layout == "bshd":
        q, k, v = (np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v))
    expected = reference.attention(q, k, v, layout=layout)
    out = np.full(expected.shape, np.nan, np.float32)
    res, lse = reference.attention(q, k, v, layout=layout, out=out, return_lse=True)
    assert res is out
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert lse.shape == (1, 2, 5)


def test_reference_default_scale(rng):
    q, k, v = qkv(rng, 1, 1, 4, 5, 9, 2)
    a = reference.attention(q, k, v)
    b = reference.attention(q, k, v, softmax_scale=1 / 3)
    c = reference.attention(q, k, v, softmax_scale=1.0)
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-3


def test_reference_validates_inputs(rng):
    q, k, v = qkv(rng, 1, 1, 4, 5, 3, 2)
    with pytest.raises(ValueError, match="softmax_scale"):
        reference.attention(q, k, v, softmax_scale=-1)
    with pytest.raises(ValueError, match="^causal"):
        reference.attention(q, k, v, causal="sometimes")
    with pytest.raises(ValueError, match="^q must be 4-D"):
        reference.attention(q[0], k, v)
