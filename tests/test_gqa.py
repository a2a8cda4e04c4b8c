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
