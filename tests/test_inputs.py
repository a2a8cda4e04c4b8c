"""Argument checking, empty problems, explain(), the default scale and the two layouts.

Every bad input must raise TypeError or ValueError whose message names the offending argument,
before any kernel runs; empty problems are not errors.
"""
import math

import numpy as np
import pytest

import numflash
from numflash import testing
from numflash.inputs import normalize


def _qkv(rng, B=1, H=2, Nq=5, Nk=7, d=4, dv=None, dtype=np.float32, layout="bhsd"):
    dv = d if dv is None else dv
    if layout == "bhsd":
        shapes = (B, H, Nq, d), (B, H, Nk, d), (B, H, Nk, dv)
    else:
        shapes = (B, Nq, H, d), (B, Nk, H, d), (B, Nk, H, dv)
    return tuple(rng.standard_normal(s).astype(dtype) for s in shapes)


class FakeDeviceArray:
    """Stands in for a device array: only __cuda_array_interface__ (never dereferenced here)."""

    def __init__(self, shape, typestr="<f4"):
        self.shape = shape
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (0, False),
                                         "version": 3, "strides": None}


# --------------------------------------------------------------------------- bad arrays

@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("ndim", [2, 3, 5])
def test_wrong_rank_names_the_array(rng, which, ndim):
    q, k, v = _qkv(rng)
    arrs = {"q": q, "k": k, "v": v}
    a = arrs[which]
    arrs[which] = a.reshape(a.shape[:ndim - 1] + (-1,)) if ndim < 4 else a[..., None]
    with pytest.raises(ValueError, match=rf"^{which} must be 4-D"):
        numflash.attention(arrs["q"], arrs["k"], arrs["v"])


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_wrong_rank_message_states_layout_order(rng, layout):
    q, k, v = _qkv(rng, layout=layout)
    order = r"\(B, H, N, d\)" if layout == "bhsd" else r"\(B, N, H, d\)"
    with pytest.raises(ValueError, match=rf"q must be 4-D {order}"):
        numflash.attention(q[0], k, v, layout=layout)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("which,axis,pattern", [
    ("k", "B", r"same batch size B: q has 1, k has 2, v has 1"),
    ("v", "B", r"same batch size B: q has 1, k has 1, v has 2"),
    ("k", "H", r"k and v must have the same number of heads; got k 3, v 2"),
    ("v", "H", r"k and v must have the same number of heads; got k 2, v 3"),
    ("v", "N", r"k and v must have the same sequence length.*v N=8"),
    ("k", "N", r"k and v must have the same sequence length.*k N=8"),
    ("k", "d", r"q and k must have the same head dim d.*k d=5"),
])
def test_mismatched_dims_name_the_array(rng, layout, which, axis, pattern):
    q, k, v = _qkv(rng, B=1, H=2, Nq=5, Nk=7, d=4, layout=layout)
    arrs = {"q": q, "k": k, "v": v}
    a = arrs[which]
    pos = {"B": 0, "H": 1 if layout == "bhsd" else 2, "N": 2 if layout == "bhsd" else 1, "d": 3}[axis]
    new = {"B": 2, "H": 3, "N": 8, "d": 5}[axis]
    shape = list(a.shape)
    shape[pos] = new
    arrs[which] = rng.standard_normal(shape).astype(a.dtype)
    with pytest.raises(ValueError, match=pattern):
        numflash.attention(arrs["q"], arrs["k"], arrs["v"], layout=layout)


def test_zero_head_dim_d_is_rejected(rng):
    q, k, v = _qkv(rng, d=4)
    with pytest.raises(ValueError, match=r"head dim d of q and k is 0"):
        numflash.attention(q[..., :0], k[..., :0], v)


def test_zero_head_dim_dv_is_rejected(rng):
    q, k, v = _qkv(rng, d=4)
    with pytest.raises(ValueError, match=r"head dim of v is 0"):
        numflash.attention(q, k, v[..., :0])


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int8, np.uint8, np.uint16, np.bool_])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_integer_arrays_are_rejected(rng, dtype, which):
    arrs = dict(zip("qkv", _qkv(rng)))
    arrs[which] = (arrs[which] * 3).astype(dtype)
    with pytest.raises(TypeError, match=rf"^{which} has an integer dtype"):
        numflash.attention(arrs["q"], arrs["k"], arrs["v"])


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, np.longdouble, object, "U3",
                                   "datetime64[s]"])
def test_unsupported_dtypes_are_rejected(rng, dtype):
    if np.dtype(dtype) == np.float64:
        pytest.skip("longdouble is float64 on this platform")
    q, k, v = _qkv(rng)
    bad = np.zeros(q.shape, dtype=dtype)
    with pytest.raises(TypeError, match=r"^q has an unsupported dtype"):
        numflash.attention(bad, k, v)
    with pytest.raises(TypeError, match=r"^v has an unsupported dtype"):
        numflash.attention(q, k, np.zeros(v.shape, dtype=dtype))


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">f2"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_native_byte_order_is_rejected_not_crashed(rng, dtype, which):
    arrs = {n: a.astype(np.dtype(dtype).newbyteorder("=")) for n, a in zip("qkv", _qkv(rng))}
    arrs = {n: a.astype(dtype) for n, a in arrs.items()}  # all share the one (swapped) dtype
    with pytest.raises(TypeError, match=r"^q has .*byte order"):
        numflash.attention(arrs["q"], arrs["k"], arrs["v"])
    native = {n: a.astype(np.dtype(dtype).newbyteorder("=")) for n, a in arrs.items()}
    native[which] = arrs[which]
    with pytest.raises(TypeError, match=rf"^{which} has .*byte order"):
        numflash.attention(native["q"], native["k"], native["v"])


def test_bfloat16_is_refused_by_the_cpu_path_with_a_reason(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = (a.astype(ml_dtypes.bfloat16) for a in _qkv(rng))
    with pytest.raises(ValueError, match=r"cpu\.tiled takes float16, float32, float64, not bfloat16"):
        numflash.attention(q, k, v)


@pytest.mark.parametrize("pair", [("float32", "float64"), ("float16", "float32"),
                                  ("float64", "float16")])
@pytest.mark.parametrize("which", ["k", "v"])
def test_mixed_dtypes_are_rejected(rng, pair, which):
    arrs = {n: a.astype(pair[0]) for n, a in zip("qkv", _qkv(rng))}
    arrs[which] = arrs[which].astype(pair[1])
    with pytest.raises(TypeError, match=rf"q, k and v must share one dtype.*{which}={pair[1]}"):
        numflash.attention(arrs["q"], arrs["k"], arrs["v"])


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [None, 3.0, "q", lambda a: a.tolist(), lambda a: memoryview(a)])
def test_non_arrays_are_rejected(rng, which, bad):
    arrs = dict(zip("qkv", _qkv(rng)))
    arrs[which] = bad(arrs[which]) if callable(bad) else bad
    with pytest.raises(TypeError, match=rf"^{which} must be a NumPy array"):
        numflash.attention(arrs["q"], arrs["k"], arrs["v"])


@pytest.mark.parametrize("which", ["k", "v"])
def test_mixed_host_and_device_kinds_are_rejected(rng, which):
    arrs = dict(zip("qkv", _qkv(rng)))
    arrs[which] = FakeDeviceArray(arrs[which].shape)
    with pytest.raises(TypeError, match=rf"same side.*q is numpy.*{which} is cuda"):
        numflash.attention(arrs["q"], arrs["k"], arrs["v"])


# --------------------------------------------------------------------------- bad options

@pytest.mark.parametrize("scale", [0, 0.0, -1.0, -1e-30, float("nan"), float("inf"), -float("inf"),
                                   np.float32("nan"), np.float64(0),
                                   pytest.param(10 ** 400, id="int-1e400"),
                                   pytest.param(-10 ** 400, id="int-minus-1e400")])
def test_bad_softmax_scale_values(rng, scale):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=r"softmax_scale must be finite and > 0"):
        numflash.attention(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("scale", [True, False, np.True_, "0.5", b"1", 1j, [0.5], np.array(0.5),
                                   np.array([0.5])])
def test_bad_softmax_scale_types(rng, scale):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match=r"softmax_scale must be a real number"):
        numflash.attention(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("layout", ["BHSD", "bhds", "sbhd", "", " bhsd", None, 0, ["bhsd"]])
def test_bad_layout(rng, layout):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=r"^layout must be 'bhsd'.*or 'bshd'"):
        numflash.attention(q, k, v, layout=layout)


@pytest.mark.parametrize("causal", ["yes", "TOP_LEFT", "bottom-right", "", 2, 1.5, -1, ["top_left"],
                                    {"causal": True}])
def test_bad_causal(rng, causal):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=r"^causal must be one of False, True, 'top_left', "
                                         r"'bottom_right'"):
        numflash.attention(q, k, v, causal=causal)


# (the id is not "gpu": conftest skips any test whose keywords contain "gpu", ids included)
@pytest.mark.parametrize("backend", [pytest.param("gpu", id="str-gpu"), "CPU", "numba", "", None])
def test_bad_backend(rng, backend):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        numflash.attention(q, k, v, backend=backend)
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        numflash.explain(q, k, v, backend=backend)


@pytest.mark.parametrize("algorithm", ["flash", "BLOCK", "tiled", "", None])
def test_bad_algorithm(rng, algorithm):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=r"^algorithm must be one of"):
        numflash.attention(q, k, v, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ["row", "mma"])
@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_cpu_refuses_row_and_mma_with_a_reason(rng, algorithm, backend):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=rf"algorithm='{algorithm}' on backend='cpu' does not exist"
                                         r".*block-tiled loop only"):
        numflash.attention(q, k, v, backend=backend, algorithm=algorithm)
    with pytest.raises(ValueError, match=rf"algorithm='{algorithm}'"):
        numflash.explain(q, k, v, backend=backend, algorithm=algorithm)


def test_cuda_backend_on_numpy_without_simulator_says_why(rng, monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=r"backend='cuda' got NumPy arrays.*cupy"):
        numflash.attention(q, k, v, backend="cuda")


@pytest.mark.parametrize("algorithm", ["auto", "block"])
def test_forced_cpu_block_runs(rng, algorithm):
    q, k, v = _qkv(rng)
    o = numflash.attention(q, k, v, backend="cpu", algorithm=algorithm)
    testing.assert_accurate(o, q, k, v)


# --------------------------------------------------------------------------- bad out

def test_out_wrong_shape(rng):
    q, k, v = _qkv(rng, dv=3)
    for shape in [(1, 2, 5, 4), (1, 2, 5), (1, 5, 2, 3), (2, 2, 5, 3)]:
        with pytest.raises(ValueError, match=r"^out must have shape \(1, 2, 5, 3\)"):
            numflash.attention(q, k, v, out=np.empty(shape, np.float32))


def test_out_wrong_shape_for_bshd(rng):
    q, k, v = _qkv(rng, dv=3, layout="bshd")
    with pytest.raises(ValueError, match=r"^out must have shape \(1, 5, 2, 3\) for layout='bshd'"):
        numflash.attention(q, k, v, layout="bshd", out=np.empty((1, 2, 5, 3), np.float32))


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32])
def test_out_wrong_dtype(rng, dtype):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match=r"^out must have q's dtype float32"):
        numflash.attention(q, k, v, out=np.empty((1, 2, 5, 4), dtype))


@pytest.mark.parametrize("bad", [[0.0], 1.0, lambda s: np.empty(s, np.float32).tolist(),
                                 lambda s: FakeDeviceArray(s)])
def test_out_wrong_kind(rng, bad):
    q, k, v = _qkv(rng)
    out = bad((1, 2, 5, 4)) if callable(bad) else bad
    with pytest.raises(TypeError, match=r"^out must be the same kind of array as q \(numpy\)"):
        numflash.attention(q, k, v, out=out)


def test_out_read_only(rng):
    q, k, v = _qkv(rng)
    out = np.full((1, 2, 5, 4), 7.0, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match=r"^out is read-only"):
        numflash.attention(q, k, v, out=out)
    assert (out == 7.0).all()


@pytest.mark.parametrize("base_shape", [(1, 1, 5, 4), (1, 2, 1, 4), (1, 2, 5, 1), (1, 1, 1, 1)])
def test_out_broadcast_zero_stride(rng, base_shape):
    q, k, v = _qkv(rng)
    out = np.broadcast_to(np.zeros(base_shape, np.float32), (1, 2, 5, 4))
    with pytest.raises(ValueError, match=r"^out has a zero stride"):
        numflash.attention(q, k, v, out=out)


def test_writeable_zero_stride_out_is_rejected(rng):
    q, k, v = _qkv(rng)
    base = np.zeros((1, 2, 1, 4), np.float32)
    out = np.lib.stride_tricks.as_strided(base, shape=(1, 2, 5, 4),
                                          strides=(base.strides[0], base.strides[1], 0, 4),
                                          writeable=True)
    with pytest.raises(ValueError, match=r"^out has a zero stride"):
        numflash.attention(q, k, v, out=out)


def test_bad_input_leaves_out_untouched(rng):
    q, k, v = _qkv(rng)
    out = np.full((1, 2, 5, 4), 7.0, np.float32)
    with pytest.raises(ValueError, match="softmax_scale"):
        numflash.attention(q, k, v, softmax_scale=-1.0, out=out)
    assert (out == 7.0).all()


# --------------------------------------------------------------------------- empty problems

@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_nq_zero_returns_empty(rng, layout, causal):
    q, k, v = _qkv(rng, Nq=0, Nk=6, d=4, dv=3, layout=layout)
    o, lse = numflash.attention(q, k, v, causal=causal, layout=layout, return_lse=True)
    assert o.shape == ((1, 2, 0, 3) if layout == "bhsd" else (1, 0, 2, 3))
    assert o.dtype == np.float32
    assert lse.shape == (1, 2, 0) and lse.dtype == np.float32


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True, "top_left", "bottom_right"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nk_zero_gives_zeros_and_minus_inf(rng, layout, causal, dtype):
    q, k, v = _qkv(rng, Nq=6, Nk=0, d=4, dv=3, layout=layout, dtype=dtype)
    o, lse = numflash.attention(q, k, v, causal=causal, layout=layout, return_lse=True)
    assert o.shape == ((1, 2, 6, 3) if layout == "bhsd" else (1, 6, 2, 3))
    assert o.dtype == dtype
    assert (o == 0).all() and not np.isnan(o).any()
    assert lse.shape == (1, 2, 6) and lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert np.isneginf(lse).all()
    testing.assert_accurate(o, q, k, v, lse=lse, causal=causal, layout=layout)


def test_nk_zero_writes_zeros_into_out(rng):
    q, k, v = _qkv(rng, Nq=6, Nk=0, d=4, dv=3)
    out = np.full((1, 2, 6, 3), np.nan, np.float32)
    res = numflash.attention(q, k, v, out=out)
    assert res is out
    assert (out == 0).all()


@pytest.mark.parametrize("B,H", [(0, 2), (2, 0), (0, 0)])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_zero_batch_or_heads_returns_empty(rng, B, H, layout):
    q, k, v = _qkv(rng, B=B, H=H, Nq=5, Nk=7, d=4, dv=3, layout=layout)
    o, lse = numflash.attention(q, k, v, layout=layout, return_lse=True, causal=True)
    assert o.shape == ((B, H, 5, 3) if layout == "bhsd" else (B, 5, H, 3))
    assert lse.shape == (B, H, 5) and o.size == 0 and lse.size == 0


def test_nq_and_nk_zero(rng):
    q, k, v = _qkv(rng, Nq=0, Nk=0)
    o, lse = numflash.attention(q, k, v, return_lse=True)
    assert o.shape == (1, 2, 0, 4) and lse.shape == (1, 2, 0)


def test_empty_problems_still_validate_arguments(rng):
    q, k, v = _qkv(rng, Nq=0, Nk=0)
    with pytest.raises(ValueError, match="softmax_scale"):
        numflash.attention(q, k, v, softmax_scale=0.0)
    with pytest.raises(ValueError, match="^backend"):
        numflash.attention(q, k, v, backend="gpu")
    with pytest.raises(ValueError, match="^causal"):
        numflash.attention(q, k, v, causal="both")


# --------------------------------------------------------------------------- explain

def test_explain_names_kernel_config_and_reasons(rng):
    q, k, v = _qkv(rng)
    plan = numflash.explain(q, k, v, causal=True)
    text = str(plan)
    assert plan.kernel == "cpu.tiled" and plan.backend == "cpu" and plan.algorithm == "block"
    assert text.splitlines()[0].startswith("numflash plan: cpu.tiled (backend='cpu', "
                                           "algorithm='block') on CPU")
    assert "config: " in text and "block_q=" in text and "block_k=" in text
    # every kernel not chosen is listed with a reason
    assert "not cuda.block: backend='cpu'" in text
    assert "not cuda.row: backend='cpu'" in text
    assert set(plan.rejected) >= {"cuda.block", "cuda.row"}
    assert all(isinstance(why, str) and why for why in plan.rejected.values())


def test_explain_does_not_run_anything(rng):
    q, k, v = _qkv(rng)
    out = np.full((1, 2, 5, 4), 7.0, np.float32)
    plan = numflash.explain(q, k, v, out=out)
    assert plan.kernel == "cpu.tiled"
    assert (out == 7.0).all()


def test_explain_raises_the_same_input_errors(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=r"^q must be 4-D"):
        numflash.explain(q[0], k, v)
    with pytest.raises(TypeError, match=r"^out must have q's dtype"):
        numflash.explain(q, k, v, out=np.empty((1, 2, 5, 4), np.float64))


def test_explain_cuda_without_simulator_says_why(rng, monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=r"backend='cuda' got NumPy arrays"):
        numflash.explain(q, k, v, backend="cuda")


def test_plan_run_matches_attention(rng):
    q, k, v = _qkv(rng)
    plan = numflash.explain(q, k, v)
    p = normalize(q, k, v, return_lse=True)
    lse = plan.run(p)
    o, lse2 = numflash.attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(p.result, o)
    np.testing.assert_array_equal(lse, lse2)


# --------------------------------------------------------------------------- scale and layouts

@pytest.mark.parametrize("d", [1, 3, 16, 59])
def test_default_scale_is_one_over_sqrt_d(rng, d):
    q, k, v = _qkv(rng, Nq=9, Nk=11, d=d, dv=5)
    assert normalize(q, k, v).scale == 1.0 / math.sqrt(d)
    o_default, lse_default = numflash.attention(q, k, v, return_lse=True)
    o_explicit, lse_explicit = numflash.attention(q, k, v, softmax_scale=1.0 / math.sqrt(d),
                                                  return_lse=True)
    np.testing.assert_array_equal(o_default, o_explicit)
    np.testing.assert_array_equal(lse_default, lse_explicit)
    testing.assert_accurate(o_default, q, k, v, lse=lse_default)
    # and the default is really used: the reference with scale 1/sqrt(d) agrees
    ref = numflash.reference.attention(q, k, v, softmax_scale=1.0 / math.sqrt(d))
    np.testing.assert_allclose(o_default, ref, rtol=1e-4, atol=1e-5)
    if d > 1:
        o_one = numflash.attention(q, k, v, softmax_scale=1.0)
        assert np.abs(o_one - o_default).max() > 1e-3


def test_scale_accepts_ints_and_numpy_scalars(rng):
    q, k, v = _qkv(rng)
    o_int = numflash.attention(q, k, v, softmax_scale=2)
    o_f = numflash.attention(q, k, v, softmax_scale=2.0)
    o_np = numflash.attention(q, k, v, softmax_scale=np.float32(2.0))
    np.testing.assert_array_equal(o_int, o_f)
    np.testing.assert_array_equal(o_np, o_f)
    testing.assert_accurate(o_f, q, k, v, softmax_scale=2.0)


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_bshd_equals_transposed_bhsd(rng, causal):
    B, H, Nq, Nk, d, dv = 2, 3, 13, 17, 8, 6
    q, k, v = _qkv(rng, B=B, H=H, Nq=Nq, Nk=Nk, d=d, dv=dv, layout="bshd")
    o, lse = numflash.attention(q, k, v, layout="bshd", causal=causal, return_lse=True)
    assert o.shape == (B, Nq, H, dv) and lse.shape == (B, H, Nq)
    t = [np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v)]
    o2, lse2 = numflash.attention(*t, causal=causal, return_lse=True)
    np.testing.assert_allclose(o, o2.transpose(0, 2, 1, 3), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, lse2, rtol=1e-6, atol=1e-6)
    testing.assert_accurate(o, q, k, v, lse=lse, causal=causal, layout="bshd")


def test_normalize_reports_bhsd_views_and_causal_offset(rng):
    q, k, v = _qkv(rng, B=2, H=3, Nq=5, Nk=9, d=4, dv=6, layout="bshd")
    p = normalize(q, k, v, layout="bshd", causal="bottom_right", softmax_scale=0.25)
    assert p.shape == (2, 3, 5, 9, 4, 6)
    assert np.shares_memory(p.q, q) and p.q.shape == (2, 3, 5, 4)
    assert p.result.shape == (2, 5, 3, 6) and p.out.shape == (2, 3, 5, 6)
    assert p.causal and p.causal_offset == 4 and p.scale == 0.25
    assert normalize(q, k, v, layout="bshd", causal=True).causal_offset == 0
    assert normalize(q, k, v, layout="bshd", causal="top_left").causal_offset == 0
    assert not normalize(q, k, v, layout="bshd").causal


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_output_has_q_dtype_and_lse_is_float32_or_float64_for_float64(rng, dtype):
    q, k, v = _qkv(rng, dtype=dtype)
    o, lse = numflash.attention(q, k, v, return_lse=True)
    assert o.dtype == dtype and isinstance(o, np.ndarray)
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert lse.shape == (1, 2, 5)
    testing.assert_accurate(o, q, k, v, lse=lse)
