"""Score and mask modifications (numflash.mods) on the CPU path, forward and backward.

Every result passes the accuracy rule against the float64 reference extended with the same
modifications, and each built-in is also checked against an independent formulation (an explicit
mask or bias built with NumPy, packed sequences through attention_varlen), since the reference
calls the same modification functions the kernels compile.
"""
import math

import numpy as np
import pytest

import numflash
from numflash import mods, testing


@pytest.fixture
def rng():
    return np.random.default_rng(11)


def _qkv(rng, B=2, H=2, Hk=None, Nq=23, Nk=23, d=8, dv=None, dtype=np.float32):
    Hk = Hk or H
    q = rng.standard_normal((B, H, Nq, d)).astype(dtype)
    k = rng.standard_normal((B, Hk, Nk, d)).astype(dtype)
    v = rng.standard_normal((B, Hk, Nk, dv or d)).astype(dtype)
    do = rng.standard_normal((B, H, Nq, dv or d)).astype(dtype)
    return q, k, v, do


def _run_and_check(q, k, v, do, *, causal=False, layout="bhsd", **opts):
    o, lse = numflash.attention(q, k, v, causal=causal, layout=layout, return_lse=True, **opts)
    rep = testing.check(o, q, k, v, lse=lse, causal=causal, layout=layout, **opts)
    assert rep.ok, rep
    grads = numflash.attention_backward(do, q, k, v, o, lse, causal=causal, layout=layout, **opts)
    rep = testing.check_backward(grads, do, q, k, v, causal=causal, layout=layout, **opts)
    assert rep.ok, rep
    return o, lse, grads


BUILTINS = {
    "window": lambda rng, B, H, Nq, Nk: dict(window_size=(4, 1)),
    "window-left-only": lambda rng, B, H, Nq, Nk: dict(window_size=(6, -1)),
    "softcap": lambda rng, B, H, Nq, Nk: dict(softcap=1.5),
    "alibi": lambda rng, B, H, Nq, Nk: dict(alibi_slopes=rng.uniform(0.05, 0.5, H)),
    "alibi-per-batch": lambda rng, B, H, Nq, Nk: dict(alibi_slopes=rng.uniform(0.05, 0.5, (B, H))),
    "bias": lambda rng, B, H, Nq, Nk: dict(attn_bias=rng.standard_normal((1, H, Nq, Nk))),
    "key-padding": lambda rng, B, H, Nq, Nk: dict(
        attn_mask=np.arange(Nk)[None, None, None, :] < np.array([Nk, Nk - 7])[:B, None, None, None]),
    "mask": lambda rng, B, H, Nq, Nk: dict(attn_mask=rng.random((B, 1, Nq, Nk)) > 0.4),
    "all": lambda rng, B, H, Nq, Nk: dict(window_size=(9, 3), softcap=4.0,
                                          alibi_slopes=rng.uniform(0.05, 0.5, H),
                                          attn_bias=rng.standard_normal((B, 1, 1, Nk))),
}


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("name", list(BUILTINS))
def test_each_builtin_forward_and_backward(rng, name, causal):
    q, k, v, do = _qkv(rng, Nq=19, Nk=26)
    _run_and_check(q, k, v, do, causal=causal, **BUILTINS[name](rng, 2, 2, 19, 26))


@pytest.mark.parametrize("dtype,layout,gqa,d", [
    (np.float16, "bhsd", False, 59), (np.float64, "bshd", True, 1), (np.float32, "bshd", True, 111)])
def test_builtins_combined_with_dtypes_layouts_gqa_and_odd_head_dims(rng, dtype, layout, gqa, d):
    q, k, v, do = _qkv(rng, B=2, H=4, Hk=2 if gqa else 4, Nq=17, Nk=30, d=d, dtype=dtype)
    if layout == "bshd":
        q, k, v, do = (np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v, do))
    _run_and_check(q, k, v, do, causal="bottom_right", layout=layout,
                   **BUILTINS["all"](rng, 2, 4, 17, 30))


# ---- the built-ins against independent formulations ----

def _numpy_attention(q, k, v, scores):
    """Softmax attention from explicit float64 scores (-inf = masked)."""
    s = scores(q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2) / math.sqrt(
        q.shape[-1]))
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    return (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)


def test_window_equals_the_explicit_band_mask(rng):
    q, k, v, _ = _qkv(rng, Nq=20, Nk=28, dtype=np.float64)
    i, j = np.arange(20)[:, None] + 8, np.arange(28)[None, :]   # bottom-right: offset Nk - Nq
    band = (j >= i - 5) & (j <= i + 2)
    got = numflash.attention(q, k, v, causal="bottom_right", window_size=(5, 2))
    want = numflash.attention(q, k, v, causal="bottom_right", attn_mask=band)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-14)
    np.testing.assert_allclose(got, _numpy_attention(
        q, k, v, lambda s: np.where(band & (j <= i), s, -np.inf)), atol=1e-12)


def test_softcap_and_alibi_and_bias_equal_numpy_formulas(rng):
    q, k, v, _ = _qkv(rng, Nq=12, Nk=12, dtype=np.float64)
    slopes = np.array([0.3, 0.1])
    bias = rng.standard_normal((2, 1, 12, 12))
    dist = np.abs(np.arange(12)[:, None] - np.arange(12)[None, :])
    got = numflash.attention(q, k, v, softcap=2.0, alibi_slopes=slopes, attn_bias=bias)
    want = _numpy_attention(q, k, v, lambda s: 2.0 * np.tanh(s / 2.0)
                            - slopes[None, :, None, None] * dist + bias)
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_document_mask_equals_varlen_on_the_packed_documents(rng):
    lengths = [5, 9, 3, 7]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    N = cu[-1]
    q, k, v = (rng.standard_normal((N, 2, 8)) for _ in range(3))
    ids = np.repeat(np.arange(len(lengths)), lengths)[None, :]
    mask_mod, args = mods.document_mask(ids)
    bhsd = lambda a: a.transpose(1, 0, 2)[None]  # noqa: E731
    got = numflash.attention(bhsd(q), bhsd(k), bhsd(v), causal=True, mask_mod=mask_mod,
                             mod_args=args)
    want = numflash.attention_varlen(q, k, v, cu, cu, causal=True)
    np.testing.assert_allclose(got[0].transpose(1, 0, 2), want, atol=1e-12)


def test_a_float16_bias_is_added_in_float64_by_the_reference(rng):
    """NumPy 2 adds a Python float and a float16 scalar in float16: the reference must not (it
    once did, which rounded every biased score to float16)."""
    q, k, v, _ = _qkv(rng, Nq=12, Nk=12, dtype=np.float64)
    bias = rng.standard_normal((1, 2, 12, 12)).astype(np.float16)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(8) + bias.astype(np.float64)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v)
    got = numflash.reference.attention(q, k, v, attn_bias=bias)
    assert np.abs(got - want).max() < 1e-13


def test_prefix_lm_equals_its_explicit_mask(rng):
    q, k, v, do = _qkv(rng, B=2, Nq=15, Nk=15, dtype=np.float64)
    prefix = np.array([4, 9])
    mask_mod, args = mods.prefix_lm_mask(prefix)
    i, j = np.arange(15)[:, None], np.arange(15)[None, :]
    explicit = (j <= i)[None, None] | (j[None, None] < prefix[:, None, None, None])
    got = numflash.attention(q, k, v, mask_mod=mask_mod, mod_args=args)
    np.testing.assert_allclose(got, numflash.attention(q, k, v, attn_mask=explicit), atol=1e-14)
    _run_and_check(q, k, v, do, mask_mod=mask_mod, mod_args=args)


def test_prefix_lm_mask_rule_and_arguments():
    """The fast tier's look at prefix_lm_mask (the attention run is in the extended tier): its
    rule over every (i, j) and its argument check."""
    mask_mod, (prefix,) = mods.prefix_lm_mask(np.array([4, 9]))
    i, j = np.arange(15)[:, None], np.arange(15)[None, :]
    for b in range(2):
        got = np.vectorize(lambda ii, jj: mask_mod(b, 0, ii, jj, prefix))(i, j)
        np.testing.assert_array_equal(got, (j <= i) | (j < prefix[b]))
    with pytest.raises(ValueError, match="prefix_lengths must be a"):
        mods.prefix_lm_mask(np.array([[1, 2]]))


# ---- user-written modifications ----

def relative_bias(score, b, h, i, j, table):
    return score + table[h, i - j + table.shape[1] // 2]


def relative_bias_grad(score, b, h, i, j, table):
    return 1.0


def tanh_cap(score, b, h, i, j, cap):
    return cap * math.tanh(score / cap)


def tanh_cap_grad(score, b, h, i, j, cap):
    t = math.tanh(score / cap)
    return 1.0 - t * t


def test_user_relative_position_table_equals_the_expanded_bias(rng):
    q, k, v, do = _qkv(rng, Nq=16, Nk=16)
    table = rng.standard_normal((2, 31))
    idx = np.arange(16)[:, None] - np.arange(16)[None, :] + 15
    expanded = table[:, idx][None]  # (1, H, N, N)
    got = numflash.attention(q, k, v, causal=True, score_mod=relative_bias, mod_args=(table,))
    want = numflash.attention(q, k, v, causal=True, attn_bias=expanded)
    np.testing.assert_allclose(got, want, atol=2e-6)
    _run_and_check(q, k, v, do, causal=True, score_mod=relative_bias,
                   score_mod_grad=relative_bias_grad, mod_args=(table,))


def test_hand_written_softcap_equals_the_builtin_forward_and_backward(rng):
    q, k, v, do = _qkv(rng, dtype=np.float64)
    o, lse = numflash.attention(q, k, v, softcap=3.0, return_lse=True)
    o2, lse2 = numflash.attention(q, k, v, score_mod=tanh_cap, mod_args=(3.0,), return_lse=True)
    np.testing.assert_allclose(o2, o, atol=1e-13)
    g = numflash.attention_backward(do, q, k, v, o, lse, softcap=3.0)
    g2 = numflash.attention_backward(do, q, k, v, o2, lse2, score_mod=tanh_cap,
                                     score_mod_grad=tanh_cap_grad, mod_args=(3.0,))
    for a, b in zip(g, g2):
        np.testing.assert_allclose(a, b, atol=1e-12)


def test_the_cpu_softcaps_float32_tanh_is_within_two_ulp_and_keeps_nan_and_inf():
    """The CPU path computes the built-in softcap in the call's precision: float32's tanh is
    inline (a polynomial below 0.625, exp2 above), held to 2 ulp of float64's tanh over both
    branches and their seam; NaN stays NaN, +-inf give +-1; float64 keeps libm's tanh."""
    from numba import njit
    from numflash.cpu import tiled

    @njit
    def sweep(xs, out):
        for n in range(xs.size):
            out[n] = tiled._tanh(xs[n])

    seam = np.float32(0.625)
    xs = np.concatenate([np.linspace(-12, 12, 400_001, dtype=np.float32),
                         np.float32(10.0) ** np.linspace(-30, 1, 20_001, dtype=np.float32),
                         seam + np.arange(-300, 300, dtype=np.float32) * np.spacing(seam)])
    xs = np.concatenate([xs, -xs])
    got = np.empty_like(xs)
    sweep(xs, got)
    want = np.tanh(xs.astype(np.float64))
    ulps = np.abs(got - want) / np.spacing(np.abs(want).astype(np.float32))
    assert ulps.max() <= 2, (ulps.max(), xs[ulps.argmax()])
    special = np.array([np.nan, np.inf, -np.inf], np.float32)
    out = np.empty_like(special)
    sweep(special, out)
    assert np.isnan(out[0]) and out[1] == 1 and out[2] == -1
    wide = np.linspace(-12, 12, 1001)
    out = np.empty_like(wide)
    sweep(wide, out)
    np.testing.assert_array_equal(out, [math.tanh(x) for x in wide])


def test_rows_left_with_nothing_give_zeros_minus_inf_and_zero_gradients(rng):
    q, k, v, do = _qkv(rng, Nq=6, Nk=6, dtype=np.float64)
    mask = np.ones((2, 2, 6, 6), bool)
    mask[1, 0, 3] = False  # row 3 of (batch 1, head 0) keeps no key
    o, lse = numflash.attention(q, k, v, attn_mask=mask, return_lse=True)
    assert (o[1, 0, 3] == 0).all() and np.isneginf(lse[1, 0, 3])
    assert np.isfinite(lse[~np.isneginf(lse)]).all() and np.isneginf(lse).sum() == 1
    dq, dk, dv = numflash.attention_backward(do, q, k, v, o, lse, attn_mask=mask)
    assert (dq[1, 0, 3] == 0).all() and np.isfinite(dk).all() and np.isfinite(dv).all()


# ---- refusals ----

def test_bad_modification_arguments_raise_naming_them(rng):
    q, k, v, do = _qkv(rng, Nq=8, Nk=8)
    bad = [
        (dict(attn_mask=np.ones((2, 3, 8, 8), bool)), ValueError, "attn_mask of shape"),
        (dict(attn_mask=np.ones((8, 8))), TypeError, "attn_mask must be a boolean array"),
        (dict(attn_bias=np.ones((8, 7))), ValueError, "attn_bias of shape"),
        (dict(attn_bias=np.ones((8, 8), np.int32)), TypeError, "attn_bias must be a float"),
        (dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes must be a float array of shape"),
        (dict(window_size=(2,)), ValueError, "window_size must be (left, right)"),
        (dict(window_size=(-2, 1)), ValueError, "window_size entries must be >= -1"),
        (dict(softcap=-1.0), ValueError, "softcap must be a finite number > 0"),
        (dict(score_mod=3), TypeError, "score_mod must be a function"),
        (dict(mod_args=(1.0,)), ValueError, "mod_args were given without"),
        (dict(score_mod_grad=tanh_cap_grad), ValueError, "score_mod_grad was given without"),
        (dict(score_mod=tanh_cap, mod_args=[2.0]), TypeError, "mod_args must be a tuple"),
    ]
    for opts, err, text in bad:
        with pytest.raises(err, match=text.replace("(", r"\(").replace(")", r"\)")):
            numflash.attention(q, k, v, **opts)


class _Settings:  # a plain Python object: numba cannot type it
    offset = 1.0


_SETTINGS = _Settings()


def reads_a_python_object(score, b, h, i, j):
    return score + _SETTINGS.offset


def test_a_modification_numba_cannot_compile_raises_a_clear_error(rng):
    q, k, v, _ = _qkv(rng, Nq=8, Nk=8)

    with pytest.raises(TypeError, match="numba cannot compile the modifications"):
        numflash.attention(q, k, v, score_mod=reads_a_python_object)


def test_backward_of_a_score_mod_without_derivative_says_how_to_give_one(rng):
    q, k, v, do = _qkv(rng, Nq=8, Nk=8)
    o, lse = numflash.attention(q, k, v, score_mod=tanh_cap, mod_args=(2.0,), return_lse=True)
    with pytest.raises(ValueError, match="pass score_mod_grad=f"):
        numflash.attention_backward(do, q, k, v, o, lse, score_mod=tanh_cap, mod_args=(2.0,))


@pytest.mark.simulator
def test_cuda_kernels_take_or_refuse_modifications_and_explain_says_why(rng):
    """In the simulator (no cuda.mma): cuda.row takes the modifications, cuda.block refuses
    them, and a block mask, which cuda.row does not take, is refused with both reasons."""
    q, k, v, _ = _qkv(rng, Nq=8, Nk=8)
    # a plan memoized for the same shapes without modifications must not be reused for them
    numflash.attention(q, k, v, backend="cuda")
    numflash.explain(q, k, v, score_mod=tanh_cap, mod_args=(1.0,))
    plan = numflash.explain(q, k, v, softcap=2.0, window_size=(3, -1))
    assert "cpu.tiled" in str(plan)
    assert "modifications: window_size=(3, -1), softcap=2 (compiled into the kernel" in str(plan)
    plan = numflash.explain(q, k, v, backend="cuda", softcap=2.0)
    assert plan.kernel == "cuda.row", str(plan)
    assert "does not take score/mask modifications yet" in plan.rejected["cuda.block"]
    block = numflash.create_block_mask(lambda b, h, i, j: j <= i, *q.shape[:3], k.shape[2])
    with pytest.raises(ValueError, match="(?s)does not take score/mask modifications yet.*"
                                         "not block_mask"):
        numflash.attention(q, k, v, backend="cuda", block_mask=block)


def test_window_key_range_is_the_window_mask_as_a_range():
    """numflash.mods.window_key_range (what cuda.mma generates as source) keeps exactly the keys
    _window_mask keeps, below Nk, for every side bounded or not and both alignments."""
    from numflash.mods import _window_mask, window_key_range
    nk = 23
    for offset in (0, 5, -7):
        for left in (-1, 0, 3, 40):
            for right in (-1, 0, 2, 40):
                for i in range(-2, 30):
                    first, end = window_key_range(i, nk, left, right, offset)
                    want = [j for j in range(nk) if _window_mask(0, 0, i, j, left, right, offset)]
                    assert list(range(first, end)) == want, (i, left, right, offset)


def test_the_cpu_path_skips_exactly_the_tiles_outside_a_window(rng):
    """The composition's ``live`` (what cpu.tiled and its backward ask per tile) is False for a
    tile exactly when no pair of it passes the window's mask, for both sides bounded or not,
    both alignments, with another mask beside the window; the results stay exact."""
    from numflash.mods import _window_mask
    for offset in (0, 6, -9):
        for window in ((3, 0), (-1, 2), (5, 4), (0, -1)):
            built = mods.build((1, 1, 30, 40, 8, 8), "numpy", offset, window_size=window,
                               softcap=3.0, attn_mask=np.ones((30, 40), bool))
            live = built.compiled()[3]
            left, right = window
            for i0, rows in ((0, 4), (7, 5), (26, 4)):
                for j0, cols in ((0, 8), (8, 8), (16, 8), (32, 8)):
                    any_pair = any(_window_mask(0, 0, i, j, left, right, offset)
                                   for i in range(i0, i0 + rows) for j in range(j0, j0 + cols))
                    assert live(0, 0, i0, rows, j0, cols, built.args) == any_pair, (
                        offset, window, i0, j0)
    q, k, v = (rng.standard_normal((1, 2, n, 16)) for n in (300, 500, 500))
    for causal in (False, "bottom_right"):
        out = numflash.attention(q, k, v, causal=causal, window_size=(20, 7), softcap=4.0)
        assert testing.check(out, q, k, v, causal=causal, window_size=(20, 7), softcap=4.0).ok


def test_huge_windows_are_clamped_and_mods_must_say_their_kinds():
    from numflash import mods as _mods
    m = _mods.build((1, 1, 8, 9), "numpy", 1, window_size=(2 ** 62, 2 ** 62))
    assert m.window == (18, 18) and m.kinds == {"window_size"}
    with pytest.raises(ValueError, match="kinds"):
        _mods.Mods([(_mods._window_mask, (1, 1, 0))], [], ["w"], ())


@pytest.mark.extended
def test_bench_mods_cost_cpu_table_checks_every_row_and_its_sdpa_peer(tmp_path):
    """bench/mods_cost.py --cpu at a tiny size: every modification row is checked "ok" against
    the float64 reference, and so is torch's CPU SDPA with the equivalent attn_mask; the softcap
    row, which SDPA cannot express, has no peer cells."""
    import importlib.util
    import pathlib
    import subprocess
    import sys
    pytest.importorskip("torch", reason="the CPU table's peer is torch's SDPA")
    root = pathlib.Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "bench" / "mods_cost.py"), "--cpu", "--N",
                          "128", "--B", "2", "--H", "2", "--d", "16", "--reps", "1"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in run.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| modification")]
    spec = importlib.util.spec_from_file_location("bench_mods_cost", root / "bench" / "mods_cost.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    names = list(bench.cases(2, 2, 128, np.random.default_rng(0), np, np.float32)[0])
    assert [row[0] for row in rows] == names, run.stdout   # one row a modification, in order
    for name, kernel, ms, ratio, checked, sdpa_ms, sdpa_ratio, against, sdpa_checked in rows:
        assert kernel == "cpu.tiled", (name, run.stdout)
        assert checked == "ok" and float(ms) > 0 and float(ratio) > 0, (name, run.stdout)
        if name.startswith("softcap"):
            assert (sdpa_ms, sdpa_checked) == ("-", "-")
        else:
            assert float(sdpa_ms) > 0 and float(against) > 0 and sdpa_checked == "ok", name
