"""cuda.row's backward: in numba's simulator (CI), compiled for sm_75/80/90 without spills, and
on a GPU at real sizes (marked gpu)."""
import json

import numpy as np
import pytest

import numflash
from numflash import testing

from test_backward import make
from test_cuda_compile import run_without_simulator


def cuda_forward_backward(q, k, v, do, xp=np, deterministic=False, **opts):
    q, k, v, do = (xp.asarray(a) for a in (q, k, v, do))
    o, lse = numflash.attention(q, k, v, return_lse=True, backend="cuda", **opts)
    return numflash.attention_backward(do, q, k, v, o, lse, backend="cuda",
                                       deterministic=deterministic, **opts)


# (B, H, Nq, Nk, d, dv): more query rows than a query tile, more keys than a block of threads,
# odd sizes, Nq != Nk both ways.
SIM_SHAPES = [(1, 1, 1, 1, 1, 1), (1, 2, 70, 9, 20, 12), (2, 1, 17, 40, 5, 7)]


@pytest.mark.simulator
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("shape", SIM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_simulated_gradients_meet_the_accuracy_rule(rng, dtype, shape, causal):
    q, k, v, do = make(rng, *shape, dtype=dtype)
    grads = cuda_forward_backward(q, k, v, do, causal=causal)
    assert all(g.dtype == dtype for g in grads)
    testing.assert_gradients_accurate(grads, do, q, k, v, causal=causal)


@pytest.mark.simulator
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_simulated_bfloat16_gradients_meet_the_accuracy_rule(rng, causal):
    """bfloat16 runs the float32 kernels on float32 copies; o and lse come from the reference
    (the bfloat16 forward is cuda.mma's, which the simulator cannot run)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    q, k, v, do = (a.astype(bf16) for a in make(rng, 1, 2, 33, 20, 12, 7))
    o, lse = numflash.reference.attention(q, k, v, causal=causal, return_lse=True)
    plan = numflash.explain(q, k, v, backward=True, backend="cuda", causal=causal)
    assert plan.kernel == "cuda.row"
    grads = numflash.attention_backward(do, q, k, v, o.astype(bf16), lse.astype(np.float32),
                                        backend="cuda", causal=causal)
    assert all(g.dtype == bf16 for g in grads)
    testing.assert_gradients_accurate(grads, do, q, k, v, causal=causal)


@pytest.mark.simulator
def test_simulated_column_chunks_layout_strides_and_outputs(rng):
    """float64 d=59, dv=111: [dK | dV] and dQ split across grid z; bshd, strided, given outputs."""
    q, k, v, do = make(rng, 1, 2, 9, 40, 59, 111, dtype=np.float64, layout="bshd")
    plan = numflash.explain(q, k, v, layout="bshd", backward=True, backend="cuda")
    cfg = plan.config
    assert plan.kernel == "cuda.row" and cfg["CW_KEY"] < cfg["D"] + cfg["DV"]
    assert cfg["CW_QUERY"] < cfg["D"]
    k2 = np.repeat(k, 2, axis=-1)[..., ::2]
    opts = dict(layout="bshd", causal="bottom_right", softmax_scale=0.2)
    o, lse = numflash.attention(q, k2, v, return_lse=True, backend="cuda", **opts)
    outs = tuple(np.full(a.shape, np.nan) for a in (q, k, v))
    res = numflash.attention_backward(do, q, k2, v, o, lse, backend="cuda", dq=outs[0],
                                      dk=outs[1], dv=outs[2], **opts)
    assert all(r is g for r, g in zip(res, outs))
    testing.assert_gradients_accurate(res, do, q, k, v, **opts)


@pytest.mark.simulator
def test_simulator_explains_the_cuda_backward(rng):
    q, k, v, _ = make(rng, 1, 2, 5, 7, 4)
    text = str(numflash.explain(q, k, v, backward=True, backend="cuda"))
    assert text.startswith("numflash backward plan: cuda.row (backend='cuda', algorithm='row') "
                           "on numba CUDA simulator")
    assert "not cpu.tiled: backend='cuda'" in text
    with pytest.raises(ValueError, match=r"cuda\.row computes in exact float32; no backward "
                                         r"kernel takes precision='tf32'"):
        numflash.explain(q, k, v, backward=True, backend="cuda", precision="tf32")
    with pytest.raises(ValueError, match=r"algorithm='mma' was asked for"):
        numflash.explain(q, k, v, backward=True, backend="cuda", algorithm="mma")


@pytest.mark.simulator
def test_simulated_rows_without_keys_and_determinism(rng):
    q, k, v, do = make(rng, 1, 1, 40, 6, 8)
    runs = [cuda_forward_backward(q, k, v, do, causal="bottom_right") for _ in range(2)]
    assert (runs[0][0][:, :, :34] == 0).all()
    assert all(np.array_equal(a, b) for a, b in zip(*runs))
    testing.assert_gradients_accurate(runs[0], do, q, k, v, causal="bottom_right")


def test_backward_kernels_compile_without_spills():
    out = run_without_simulator("""
        import json
        from numflash.cuda import launch, row_backward as rb
        from numflash.plan import Device

        class Shape:
            def __init__(self, d, dv, dt):
                self.shape, self.dtype_name = (1, 1, 128, 128, d, dv), dt

        rows = []
        for cc, optin, d, dv, dt in (((7, 5), 64 * 1024, 64, 64, "float32"),
                                     ((8, 0), 163 * 1024, 59, 111, "float64"),
                                     ((9, 0), 227 * 1024, 128, 128, "float16")):
            cfg = rb.config(Shape(d, dv, dt), Device("sm", cc=cc, smem_per_block_optin=optin))
            for kind, (kernel, sig) in zip(("keys", "queries"), rb.compiled_kernels(cfg, dt)):
                res = launch.compile_to_cubin(kernel.pyfunc, sig, cc)[3]
                rows.append([list(cc), d, kind, res.get("registers", 0),
                             res.get("spill_store_bytes", 0) + res.get("spill_load_bytes", 0),
                             res.get("stack_bytes", 0)])
        print(json.dumps(rows))
    """)
    rows = json.loads(out.splitlines()[-1])
    assert len(rows) == 6 and all(r[3] > 0 for r in rows)
    assert not [r for r in rows if r[4] or r[5]], rows


GPU_CASES = [  # (B, H, Nq, Nk, d, dv, dtype, causal)
    (2, 4, 1024, 1024, 64, 64, "float32", False),
    (2, 4, 1024, 1024, 64, 64, "float32", True),
    (1, 4, 1000, 1537, 128, 128, "float32", "bottom_right"),
    (1, 2, 777, 513, 59, 111, "float64", True),
    (1, 2, 513, 700, 256, 256, "float16", False),
    (1, 2, 300, 260, 1, 1, "float64", False),
    (2, 4, 1024, 999, 64, 64, "bfloat16", True),
    # float32 sums over many rows (dV, dK: 4097 queries to one key; dQ: 4097 keys), found by
    # the GPU property test: one float32 accumulator missed the rule (dV 9.96e-5 against a
    # bound of 4.69e-5 at 1025 queries); two levels (RowBackwardConfig.SUMS) meet it
    (1, 1, 4097, 1, 59, 59, "float32", False),
    (1, 2, 3, 4097, 59, 59, "float32", False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_gradients_meet_the_accuracy_rule_and_repeat_bitwise(rng, case):
    import cupy
    B, H, Nq, Nk, d, dv, dtype, causal = case
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    q, k, v, do = make(rng, B, H, Nq, Nk, d, dv, dtype=np.dtype(dtype))
    first = cuda_forward_backward(q, k, v, do, xp=cupy, causal=causal, deterministic=True)
    again = cuda_forward_backward(q, k, v, do, xp=cupy, causal=causal, deterministic=True)
    assert all(bool((a == b).all()) for a, b in zip(first, again))
    testing.assert_gradients_accurate(first, do, q, k, v, causal=causal)


@pytest.mark.simulator
def test_simulated_float32_gradients_of_float16_inputs(rng):
    """grad_dtype=float32 on cuda.row: its float32 accumulators written as they are; rounded to
    float16 they are its float16 gradients."""
    q, k, v, do = make(rng, 1, 1, 33, 20, 12, 7, dtype=np.float16)
    o, lse = numflash.attention(q, k, v, return_lse=True, backend="cuda", causal=True)
    plain = numflash.attention_backward(do, q, k, v, o, lse, backend="cuda", causal=True)
    wide = numflash.attention_backward(do, q, k, v, o, lse, backend="cuda", causal=True,
                                       grad_dtype=np.float32)
    assert all(g.dtype == np.float32 for g in wide)
    assert all(np.array_equal(b.astype(np.float16), a) for a, b in zip(plain, wide))
    testing.assert_gradients_accurate(wide, do, q, k, v, causal=True)
