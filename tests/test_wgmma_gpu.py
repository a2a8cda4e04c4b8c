"""cuda.wgmma on a Hopper GPU (``-m gpu``; they skip without one, or on a GPU that is not
compute capability 9.0): the forward through the public API against the float64 reference
(numflash.testing's rule) for float16 and bfloat16 at odd and real sizes, both causal alignments,
Nq != Nk, GQA and the bshd layout; and that it runs what explain says. Its generated source
runs on the CPU under the warp emulator in tests/test_wgmma.py."""
import numpy as np
import pytest

import numflash
from test_mma_gpu import _device_array, _on_device, _rows

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def hopper():
    import cupy
    from numflash.plan import device_of
    dev = device_of(cupy.zeros(1))
    if tuple(dev.cc) != (9, 0):
        pytest.skip(f"cuda.wgmma runs on compute capability 9.0; this GPU is {dev.cc}")
    return dev


CASES = [  # B, H, Hkv, Nq, Nk, d, dv: head dims are multiples of 8 (16-byte rows), padded
    (1, 1, 1, 1, 1, 64, 64),       # to 64 or 128
    (1, 2, 2, 97, 1025, 56, 56),
    (2, 4, 2, 1025, 97, 128, 128),
    (1, 3, 1, 200, 333, 104, 64),
    (1, 2, 2, 130, 130, 8, 72),
    (2, 8, 8, 4096, 4096, 64, 64),
    (1, 8, 2, 4096, 4096, 128, 128),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}Hkv{}-{}x{}-d{}dv{}".format(*c))
def test_wgmma_forward_is_accurate(hopper, rng, case, causal, dtype):
    B, H, Hkv, Nq, Nk, d, dv = case
    q = _device_array(rng, (B, H, Nq, d), dtype)
    k = _device_array(rng, (B, Hkv, Nk, d), dtype)
    v = _device_array(rng, (B, Hkv, Nk, dv), dtype)
    plan = numflash.explain(q, k, v, causal=causal, algorithm="wgmma")
    assert plan.kernel == "cuda.wgmma", str(plan)
    out, lse = numflash.attention(q, k, v, causal=causal, algorithm="wgmma", return_lse=True)
    from numflash.testing import check
    rep = check(out, q, k, v, lse=lse, causal=causal, rows=_rows(Nq, rng))
    assert rep.ok, str(rep)


MODIFIED = [  # (dtype, B, H, Hkv, Nq, Nk, d, causal, mods name: test_mma_mods.MODS)
    ("float16", 2, 8, 8, 1024, 1024, 64, True, "all-but-window"),
    ("bfloat16", 1, 8, 2, 777, 1025, 128, "bottom_right", "mask-softcap"),
    ("float16", 2, 4, 2, 513, 700, 64, False, "key-padding-alibi-per-batch"),
    ("float16", 2, 4, 4, 600, 600, 128, True, "user-document-and-relative-bias"),
    ("bfloat16", 1, 2, 2, 2048, 2048, 64, True, "all-but-window"),
    # sliding windows: alone (full tiles), with the other built-ins (half-width ones)
    ("float16", 2, 8, 8, 4096, 4096, 64, True, "sliding-window"),
    ("bfloat16", 1, 8, 2, 3000, 2500, 128, False, "sliding-window"),
    ("float16", 1, 4, 4, 1000, 1400, 128, "bottom_right", "all-builtins"),
    ("bfloat16", 2, 4, 2, 700, 333, 64, True, "user-tanh-softcap-causal-window"),
    # block masks: alone, with ALiBi (d64: one block an SM, uncapped), Nq != Nk
    ("float16", 2, 8, 2, 2048, 2048, 64, True, "document-block-mask"),
    ("bfloat16", 1, 4, 4, 1500, 1300, 128, False, "document-block-mask-alibi"),
    ("float16", 2, 4, 4, 1000, 1300, 64, "bottom_right", "document-block-mask-alibi"),
]


@pytest.mark.parametrize("case", MODIFIED, ids=lambda c: "-".join(map(str, c)))
def test_wgmma_forward_with_modifications_is_accurate(hopper, rng, case):
    """Score / mask modifications and sliding windows on cuda.wgmma (forced: at these sizes
    "auto" leaves some calls to cuda.mma's split-KV; tests/test_wgmma.py checks that it takes
    them where the query blocks fill the GPU), against the float64 reference with the same
    modifications."""
    from test_mma_mods import check_gpu_forward_with_mods
    check_gpu_forward_with_mods(rng, case, "wgmma", lambda Nq: _rows(Nq, rng))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_runs_packed_sequences_with_a_window_in_one_launch(hopper, rng, dtype):
    """attention_varlen with a sliding window on cuda.wgmma (explain says so, one launch):
    each sequence's rows meet the rule against its own call's reference with the window in
    its alignment (lengths 0, 1, odd and 1025, Nq != Nk both ways, GQA)."""
    import cupy
    from numflash import testing
    from test_varlen import packed
    dtype = pytest.importorskip("ml_dtypes").bfloat16 if dtype == "bfloat16" else dtype
    q, k, v, _, cq, ck = packed(rng, [1, 0, 97, 1025, 300], [5, 13, 97, 1025, 150], H=8, Hk=2,
                                d=64, dv=64, dtype=np.dtype(dtype))
    dev = [cupy.asarray(a) for a in (q, k, v, cq, ck)]
    for causal, window in ((False, (100, 30)), ("bottom_right", (64, 0))):
        plan = numflash.explain_varlen(*dev, causal=causal, window_size=window)
        assert plan.kernel == "cuda.wgmma" and plan.config.WINDOW, str(plan)
        assert "5 in one launch" in str(plan), str(plan)
        out, lse = numflash.attention_varlen(*dev, causal=causal, window_size=window,
                                             return_lse=True)
        out, lse = out.get(), lse.get()
        for b in range(len(cq) - 1):
            s, e, sk, ek = cq[b], cq[b + 1], ck[b], ck[b + 1]
            if e > s:
                testing.assert_accurate(out[None, s:e], q[None, s:e], k[None, sk:ek],
                                        v[None, sk:ek], lse=lse[None, :, s:e], causal=causal,
                                        layout="bshd", window_size=window)


def test_wgmma_takes_the_bshd_layout_and_a_scale(hopper, rng):
    q, k, v = (_device_array(rng, (2, 300, 4, 64), "float16") for _ in range(3))
    out = numflash.attention(q, k, v, layout="bshd", softmax_scale=0.3, algorithm="wgmma")
    from numflash.testing import check
    rep = check(out, q, k, v, layout="bshd", softmax_scale=0.3)
    assert rep.ok, str(rep)


def test_wgmma_refuses_what_it_does_not_run_and_says_what_does(hopper, rng):
    for d in (1, 59, 111):   # rows that are not whole 16-byte chunks: cuda.mma pads those
        q = _device_array(rng, (1, 2, 64, d), "float16")
        with pytest.raises(ValueError, match=f"head dim {d} is not a multiple of 8: cuda.mma"):
            numflash.attention(q, q, q, algorithm="wgmma")
        assert numflash.explain(q, q, q).kernel == "cuda.mma"
    q = _device_array(rng, (1, 2, 64, 256), "float16")
    with pytest.raises(ValueError, match="cuda.wgmma takes head dims up to 128"):
        numflash.attention(q, q, q, algorithm="wgmma")
    q = _device_array(rng, (1, 2, 256, 64), "float16")
    causal = numflash.create_block_mask(lambda b, h, i, j: j <= i, 1, 2, 256, 256,
                                        block_size=64, device="cuda")
    with pytest.raises(ValueError, match="the block mask's 64 x 64 blocks are not whole tiles"):
        numflash.attention(q, q, q, algorithm="wgmma", block_mask=causal)
    assert numflash.explain(q, q, q, block_mask=causal).kernel != "cuda.wgmma"
    strided = _device_array(rng, (1, 2, 64, 128), "float16")[..., ::2]
    with pytest.raises(ValueError, match="16-byte cp.async"):
        numflash.attention(strided, strided, strided, algorithm="wgmma")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_nan_scores_poison_exactly_their_rows(hopper, rng, dtype):
    """A NaN in q poisons its row only, a NaN in k the rows that see that key (output and lse)."""
    import numpy as np
    from numflash import reference
    from numflash.testing import _to_host
    q, k, v = (rng.standard_normal((1, 2, 300, 64)) for _ in range(3))
    q[0, 1, 5, 3] = np.nan
    k[0, 0, 200, 0] = np.nan
    q, k, v = (_on_device(a, dtype) for a in (q, k, v))
    out, lse = numflash.attention(q, k, v, causal=True, algorithm="wgmma", return_lse=True)
    want, want_lse = reference.attention(*(_to_host(a).astype(np.float64) for a in (q, k, v)),
                                         causal=True, return_lse=True)
    got = _to_host(out).astype(np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(want).any()
    assert np.array_equal(np.isnan(_to_host(lse)), np.isnan(want_lse))


@pytest.mark.xfail(strict=True, reason="cuda.wgmma multiplies the whole V tile by P on tensor "
                   "cores, as cuda.mma does: 0 * NaN at a key a row does not see reaches that "
                   "row (issue 22; algorithm='block' is exact there)")
def test_wgmma_a_nan_value_reaches_only_the_rows_that_see_its_key(hopper, rng):
    import numpy as np
    from numflash import reference
    from numflash.testing import _to_host
    q, k, v = (rng.standard_normal((1, 2, 300, 64)) for _ in range(3))
    v[0, 1, 200, 2] = np.nan
    q, k, v = (_on_device(a, "float16") for a in (q, k, v))
    out = numflash.attention(q, k, v, causal=True, algorithm="wgmma")
    want = reference.attention(*(_to_host(a).astype(np.float64) for a in (q, k, v)),
                               causal=True)
    assert np.array_equal(np.isnan(_to_host(out).astype(np.float64)), np.isnan(want))


# ---- the backward (cuda.wgmma's key pass after cuda.mma's delta pass)

BACKWARD_CASES = [  # B, H, Hkv, Nq, Nk, d, dv
    (1, 1, 1, 1, 1, 64, 64),
    (2, 4, 4, 1000, 1000, 64, 64),
    (1, 4, 2, 1025, 1100, 128, 128),
    (1, 4, 4, 700, 513, 128, 128),   # bottom-right: rows that see no key
    (1, 2, 1, 97, 300, 40, 72),
    (1, 8, 8, 2048, 2048, 128, 128),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("case", BACKWARD_CASES,
                         ids=lambda c: "B{}H{}Hkv{}-{}x{}-d{}dv{}".format(*c))
def test_wgmma_backward_is_accurate(hopper, rng, case, causal, dtype):
    B, H, Hkv, Nq, Nk, d, dv = case
    q = _device_array(rng, (B, H, Nq, d), dtype)
    k = _device_array(rng, (B, Hkv, Nk, d), dtype)
    v = _device_array(rng, (B, Hkv, Nk, dv), dtype)
    do = _device_array(rng, (B, H, Nq, dv), dtype)
    plan = numflash.explain(q, k, v, causal=causal, backward=True)
    assert plan.kernel == "cuda.wgmma", str(plan)   # what auto takes here
    o, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
    grads = numflash.attention_backward(do, q, k, v, o, lse, causal=causal)
    from numflash.testing import check_backward
    rep = check_backward(grads, do, q, k, v, causal=causal)
    assert rep.ok, str(rep)


BACKWARD_MODIFIED = [  # as MODIFIED: what cuda.wgmma's backward takes (no block mask)
    ("float16", 2, 8, 8, 1024, 1024, 64, True, "all-but-window"),
    ("bfloat16", 1, 8, 2, 777, 1025, 128, "bottom_right", "mask-softcap"),
    ("float16", 2, 4, 4, 600, 600, 128, True, "user-document-and-relative-bias"),
    ("float16", 2, 4, 2, 513, 700, 64, False, "key-padding-alibi-per-batch"),
    ("float16", 1, 4, 2, 2048, 2048, 64, True, "sliding-window"),
    ("bfloat16", 1, 4, 4, 1000, 1400, 128, "bottom_right", "all-builtins"),
]


@pytest.mark.parametrize("case", BACKWARD_MODIFIED, ids=lambda c: "-".join(map(str, c)))
def test_wgmma_backward_with_modifications_is_accurate(hopper, rng, case):
    """Sliding windows and score / mask modifications with their derivatives in cuda.wgmma's
    key pass ("auto" takes it for them too), dQ, dK and dV against the float64 reference with
    the same modifications."""
    from test_mma_mods import _gpu_inputs
    from numflash import testing
    dtype, B, H, Hkv, Nq, Nk, d, causal, name = case
    (q, k, v, do), (qg, kg, vg, dog), opts, gpu_opts = _gpu_inputs(rng, dtype, B, H, Hkv, Nq,
                                                                     Nk, d, name)
    plan = numflash.explain(qg, kg, vg, causal=causal, backward=True, algorithm="wgmma",
                            **gpu_opts)
    keys = plan.config["keys"]
    assert plan.kernel == "cuda.wgmma" and (keys.MODS or keys.WINDOW), str(plan)
    auto = numflash.explain(qg, kg, vg, causal=causal, backward=True, **gpu_opts)
    assert auto.kernel == "cuda.wgmma" and auto.config["keys"] == keys, str(auto)
    o, lse = numflash.attention(qg, kg, vg, causal=causal, return_lse=True, **gpu_opts)
    grads = numflash.attention_backward(dog, qg, kg, vg, o, lse, causal=causal,
                                        algorithm="wgmma", **gpu_opts)
    testing.assert_gradients_accurate([g.get() for g in grads], do, q, k, v, causal=causal,
                                      **opts)


def test_wgmma_backward_takes_bshd_a_scale_and_given_buffers(hopper, rng):
    import cupy
    q, k, v, do = (_device_array(rng, (2, 300, 4, 64), "float16") for _ in range(4))
    o, lse = numflash.attention(q, k, v, layout="bshd", softmax_scale=0.3, return_lse=True)
    bufs = [cupy.full_like(a, 7) for a in (q, k, v)]
    got = numflash.attention_backward(do, q, k, v, o, lse, layout="bshd", softmax_scale=0.3,
                                      algorithm="wgmma", dq=bufs[0], dk=bufs[1], dv=bufs[2])
    assert all(g is b for g, b in zip(got, bufs))
    from numflash.testing import check_backward
    rep = check_backward(got, do, q, k, v, layout="bshd", softmax_scale=0.3)
    assert rep.ok, str(rep)


def test_wgmma_backward_leaves_what_it_does_not_run_to_cuda_mma(hopper, rng):
    q, k, v, do = (_device_array(rng, (1, 2, 256, 64), "float16") for _ in range(4))
    o, lse = numflash.attention(q, k, v, return_lse=True)
    plan = numflash.explain(q, k, v, backward=True, deterministic=True)
    assert plan.kernel == "cuda.mma", str(plan)
    with pytest.raises(ValueError, match="deterministic=True takes cuda.mma's two passes"):
        numflash.attention_backward(do, q, k, v, o, lse, algorithm="wgmma", deterministic=True)
    a = numflash.attention_backward(do, q, k, v, o, lse, deterministic=True)
    b = numflash.attention_backward(do, q, k, v, o, lse, deterministic=True)
    assert all(bool((x == y).all()) for x, y in zip(a, b))
