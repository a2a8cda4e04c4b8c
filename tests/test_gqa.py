"""Grouped-query / multi-query attention (k and v with Hk heads, H a multiple of Hk): the
reference against repeated heads, every kernel forward and backward against the reference (CPU
here, CUDA kernels in the simulator and the tensor-core word kernels in the warp emulator, all
of them on a GPU), the framework layers, and the input checks."""
import numpy as np
import pytest

import numflash
from numflash import reference, testing

HEADS = [(4, 2), (6, 1), (8, 4)]  # (H, Hk)


def make(rng, B, H, Hk, Nq, Nk, d, dv, dtype=np.float64, layout="bhsd"):
    def arr(heads, N, dim):
        shape = (B, heads, N, dim) if layout == "bhsd" else (B, N, heads, dim)
        return rng.standard_normal(shape).astype(dtype)
    return arr(H, Nq, d), arr(Hk, Nk, d), arr(Hk, Nk, dv), arr(H, Nq, dv)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}-Hk{h[1]}")
def test_reference_equals_attention_on_repeated_heads(rng, heads):
    H, Hk = heads
    q, k, v, do = make(rng, 2, H, Hk, 9, 12, 5, 3)
    kr, vr = np.repeat(k, H // Hk, axis=1), np.repeat(v, H // Hk, axis=1)
    opts = dict(scale=0.4, causal=True, causal_offset=3)
    o, lse = reference.naive(q, k, v, **opts)
    o_rep, lse_rep = reference.naive(q, kr, vr, **opts)
    np.testing.assert_array_equal(o, o_rep)
    np.testing.assert_array_equal(lse, lse_rep)
    dq, dk, dv = reference.naive_backward(do, q, k, v, **opts)
    dq_r, dk_r, dv_r = reference.naive_backward(do, q, kr, vr, **opts)
    np.testing.assert_array_equal(dq, dq_r)
    # the shared head's gradient is the sum over the query heads that read it
    np.testing.assert_allclose(dk, dk_r.reshape(2, Hk, H // Hk, 12, 5).sum(2), rtol=1e-13)
    np.testing.assert_allclose(dv, dv_r.reshape(2, Hk, H // Hk, 12, 3).sum(2), rtol=1e-13)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}-Hk{h[1]}")
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_cpu_forward_and_backward_meet_the_accuracy_rule(rng, heads, causal, dtype, layout):
    q, k, v, do = make(rng, 2, *heads, 97, 61, 59, 40, dtype, layout)
    opts = dict(causal=causal, layout=layout)
    o, lse = numflash.attention(q, k, v, return_lse=True, **opts)
    testing.assert_accurate(o, q, k, v, lse=lse, **opts)
    grads = numflash.attention_backward(do, q, k, v, o, lse, **opts)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    testing.assert_gradients_accurate(grads, do, q, k, v, **opts)


def test_cpu_backward_splits_key_blocks_across_threads_deterministically(rng):
    """One (batch, key/value head): the key blocks are split, each split with its own dQ."""
    q, k, v, do = make(rng, 1, 8, 1, 300, 700, 16, 16, np.float32)
    o, lse = numflash.attention(q, k, v, return_lse=True, causal=True)
    runs = [numflash.attention_backward(do, q, k, v, o, lse, causal=True) for _ in range(2)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    testing.assert_gradients_accurate(runs[0], do, q, k, v, causal=True)


@pytest.mark.simulator
@pytest.mark.parametrize("algorithm", ["block", "row"])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1)], ids=lambda h: f"H{h[0]}-Hk{h[1]}")
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_simulated_cuda_kernels(rng, algorithm, heads, causal):
    q, k, v, do = make(rng, 1, *heads, 21, 13, 8, 5)
    o, lse = numflash.attention(q, k, v, return_lse=True, causal=causal, backend="cuda",
                                algorithm=algorithm)
    testing.assert_accurate(o, q, k, v, lse=lse, causal=causal)
    grads = numflash.attention_backward(do, q, k, v, o, lse, causal=causal, backend="cuda")
    testing.assert_gradients_accurate(grads, do, q, k, v, causal=causal)


@pytest.mark.simulator
@pytest.mark.parametrize("algorithm", ["block", "row"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_simulated_cuda_decode_runs_query_heads_as_rows(rng, algorithm, layout):
    """The CUDA kernels take the swap wherever it applies (numflash.gqa: no thread count to
    weigh): explain's note, lse as (B, H, 1), the rule met (cuda.row with a softcap, which
    cuda.block does not take)."""
    q, k, v, _ = make(rng, 2, 6, 2, 1, 37, 8, 5, np.float32, layout)
    mods = dict(softcap=4.0) if algorithm == "row" else {}
    opts = dict(causal="bottom_right", layout=layout, **mods)
    plan = numflash.explain(q, k, v, backend="cuda", algorithm=algorithm, **opts)
    assert plan.kernel == f"cuda.{algorithm}"
    assert "grouped-query decode: each K/V head's 3 query heads" in str(plan)
    o, lse = numflash.attention(q, k, v, return_lse=True, backend="cuda", algorithm=algorithm,
                                **opts)
    assert lse.shape == (2, 6, 1) and o.shape == q.shape[:-1] + (5,)
    testing.assert_accurate(o, q, k, v, lse=lse, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_decode_runs_query_heads_as_rows(rng, dtype):
    """At decode sizes on the GPU: the swapped (B, Hk, G) call (split over the keys by cuda.mma
    where its blocks cannot fill the GPU) meets the rule, in both layouts; the second call of a
    signature replays the first's launches (numflash.cuda.fastpath) on new arrays."""
    cp = pytest.importorskip("cupy")
    for layout in ("bhsd", "bshd"):
        plan = None
        for _ in range(2):
            q, k, v, _ = make(rng, 2, 32, 8, 1, 20000, 128, 128, np.dtype(dtype), layout)
            dq_, dk_, dv_ = (cp.asarray(a) for a in (q, k, v))
            plan = plan or numflash.explain(dq_, dk_, dv_, layout=layout)
            assert "grouped-query decode" in str(plan), str(plan)
            o, lse = numflash.attention(dq_, dk_, dv_, return_lse=True, layout=layout)
            assert lse.shape == (2, 32, 1)
            testing.assert_accurate(o, q, k, v, lse=lse, layout=layout)


@pytest.mark.parametrize("DT, dtype", [("f64", np.float64), ("3xtf32", np.float32)])
def test_tensor_core_word_kernel_emulated(rng, DT, dtype):
    """cuda.mma's float64 and 3xTF32 source, run by the warp emulator with Hk < H."""
    from mma_tools import run_forward_kernel
    q, k, v, _ = make(rng, 1, 4, 2, 40, 24, 16, 16, dtype)
    out, lse = run_forward_kernel(q, k, v, DT, True, 24 - 40)
    testing.assert_accurate(out.astype(dtype), q, k, v, lse=lse.astype(
        np.float64 if DT == "f64" else np.float32), causal="bottom_right")


@pytest.mark.parametrize("k_heads, v_heads, match", [
    (3, 3, r"q's heads must be a multiple of k's and v's .* got q 4 heads, k and v 3"),
    (2, 4, "k and v must have the same number of heads; got k 2, v 4"),
    (0, 0, "q's heads must be a multiple"),
])
def test_head_counts_that_do_not_group_are_refused(rng, k_heads, v_heads, match):
    q = rng.standard_normal((1, 4, 5, 8))
    k, v = rng.standard_normal((1, k_heads, 5, 8)), rng.standard_normal((1, v_heads, 5, 8))
    with pytest.raises(ValueError, match=match):
        numflash.attention(q, k, v)


# ---- decoding: each K/V head's query heads as its query rows (numflash.gqa)

DECODE_CASES = [  # (H, Hk, Nk, d, dtype, layout, causal, softcap)
    (8, 2, 97, 59, np.float32, "bhsd", False, None),
    (6, 1, 1025, 128, np.float16, "bshd", "bottom_right", 3.0),
    (4, 2, 1, 1, np.float64, "bhsd", "bottom_right", None),
    (8, 4, 300, 111, np.float64, "bshd", False, 20.0),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "-".join(
    str(getattr(x, "__name__", x)) for x in c))
@pytest.mark.parametrize("given_out", [False, True])
def test_cpu_decode_runs_query_heads_as_rows(rng, monkeypatch, case, given_out):
    """One query row a head against shared K/V heads: the CPU path runs the (B, Hk, G) call on
    views of q and out (explain says so), meeting the rule with lse as (B, H, 1); a given out
    buffer is the result, written in place. (worth_it, which counts the machine's threads, is
    held True: test_the_swap_is_taken_where_the_threads_finish_no_later checks it.)"""
    from numflash import gqa
    monkeypatch.setattr(gqa, "worth_it", lambda problem, threads: True)
    H, Hk, Nk, d, dtype, layout, causal, softcap = case
    q, k, v, _ = make(rng, 2, H, Hk, 1, Nk, d, d, dtype, layout)
    opts = dict(causal=causal, softcap=softcap, layout=layout)
    assert "grouped-query decode: each K/V head's" in str(numflash.explain(q, k, v, **opts))
    buffer = np.full_like(q, 7) if given_out else None
    o, lse = numflash.attention(q, k, v, return_lse=True, out=buffer, **opts)
    assert lse.shape == (2, H, 1) and o.shape == q.shape
    if given_out:
        assert o is buffer
    testing.assert_accurate(o, q, k, v, lse=lse, **opts)


@pytest.mark.parametrize("Nq, opts", [
    (1, dict(causal=True)),             # top-left: the row sees key 0 only
    (2, {}),                            # rows of their own
    (1, dict(window_size=(4, 0), causal="bottom_right")),
    (1, dict(alibi_slopes=np.linspace(0.1, 0.8, 4))),   # a slope per query head
    (1, dict(dropout_p=0.25, dropout_seed=5)),          # its mask is drawn by (b, h, i, j)
])
def test_cpu_decode_keeps_heads_where_rows_would_change_the_attention(rng, monkeypatch, Nq,
                                                                       opts):
    """explain (which plans what attention runs) names no swap, where the same shape without
    the option does swap (Nq 1), and the result meets the rule."""
    from numflash import gqa
    monkeypatch.setattr(gqa, "worth_it", lambda problem, threads: True)
    q, k, v, _ = make(rng, 1, 4, 2, Nq, 50, 16, 16, np.float32)
    assert "grouped-query" not in str(numflash.explain(q, k, v, **opts))
    if Nq == 1:
        assert "grouped-query" in str(numflash.explain(q, k, v, causal="bottom_right"))
    if "dropout_p" not in opts:
        testing.assert_accurate(numflash.attention(q, k, v, **opts), q, k, v, **opts)


def test_the_swap_is_taken_where_the_threads_finish_no_later():
    """numflash.gqa.worth_it: rounds of tasks, each swapped task of G rows costing 1 + (G - 1) / 12
    of a one-row task (the 2-core measurements' fit)."""
    from types import SimpleNamespace as NS
    from numflash import gqa

    def problem(B, H, Hk):
        return NS(q=np.empty((B, H, 1, 1)), k=np.empty((B, Hk, 9, 1)))
    assert gqa.worth_it(problem(1, 32, 8), 2)        # 4 rounds of 1.25 against 16
    assert gqa.worth_it(problem(1, 8, 1), 2)         # 1 round of 1.58 against 4
    assert not gqa.worth_it(problem(1, 32, 8), 64)   # 1 round of 1.25 against 1
    assert gqa.worth_it(problem(4, 32, 8), 16)       # 2 rounds of 1.25 against 8


def test_torch_layers_take_grouped_heads_in_place():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    import numflash.torch as nt
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 33, 16, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 41, 16, dtype=torch.float64, generator=g, requires_grad=True)
            for _ in range(2))
    for causal in (False, True):
        ours = nt.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        mask = torch.ones(33, 41, dtype=torch.bool).tril() if causal else None
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
        got = torch.autograd.grad(ours.sum(), (q, k, v))
        want = torch.autograd.grad(ref.sum(), (q, k, v))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        nt.scaled_dot_product_attention(q, k, v)
    out, lse, probs = nt.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2)[:, :, :1],
                                         v.transpose(1, 2)[:, :, :1], causal=True,
                                         return_attn_probs=True)  # multi-query: one k/v head
    host = [t.detach().numpy() for t in (q.transpose(1, 2), k.transpose(1, 2)[:, :, :1],
                                         v.transpose(1, 2)[:, :, :1])]
    testing.assert_accurate(out.detach().numpy(), *host, lse=lse.numpy(), causal="bottom_right",
                            layout="bshd")
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 8, 33, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("algorithm", ["auto", "block", "row"])
def test_gpu_forward_and_backward(rng, dtype, algorithm):
    import cupy as cp
    if dtype == "bfloat16":
        if algorithm != "auto":
            pytest.skip("bfloat16 runs on cuda.mma only")
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    q, k, v, do = make(rng, 2, 8, 2, 1000, 777, 64, 64, np.dtype(dtype))
    opts = dict(causal="bottom_right")
    dq_, dk_, dv_, do_ = (cp.asarray(a) for a in (q, k, v, do))
    o, lse = numflash.attention(dq_, dk_, dv_, return_lse=True, algorithm=algorithm, **opts)
    testing.assert_accurate(o, q, k, v, lse=lse, **opts)
    grads = numflash.attention_backward(do_, dq_, dk_, dv_, o, lse, **opts)
    testing.assert_gradients_accurate(grads, do, q, k, v, **opts)
