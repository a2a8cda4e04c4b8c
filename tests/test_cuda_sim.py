"""Both CUDA kernels through the public API in numba's CUDA simulator (CI has no GPU).

tests/conftest.py turns the simulator on when no GPU is usable; there `attention(..., backend="cuda")`
takes NumPy arrays and runs the very kernel source the GPU runs. Shapes are tiny: every simulated
thread is a Python thread.
"""
import numpy as np
import pytest

import numflash
from numflash.testing import check

pytestmark = pytest.mark.simulator

ALGORITHMS = ("block", "row")


def arrays(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


# (B, H, Nq, Nk, d, dv): odd sizes, Nq != Nk both ways, tiles' edges (16-row simulator tiles).
SHAPES = [
    (1, 1, 1, 1, 1, 1),
    (2, 1, 17, 9, 5, 7),
    (1, 2, 9, 33, 16, 16),
    (1, 1, 33, 33, 59, 20),
]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_accuracy(rng, algorithm, dtype, shape, causal):
    B, H, Nq, Nk, d, dv = shape
    q, k, v = arrays(rng, (B, H, Nq, d), dtype), arrays(rng, (B, H, Nk, d), dtype), \
        arrays(rng, (B, H, Nk, dv), dtype)
    out, lse = numflash.attention(q, k, v, causal=causal, backend="cuda", algorithm=algorithm,
                                  return_lse=True)
    assert out.dtype == q.dtype and out.shape == (B, H, Nq, dv)
    rep = check(out, q, k, v, lse=lse, causal=causal)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_layout_strides_out_scale(rng, algorithm):
    B, N, H, d = 1, 20, 2, 8
    base = arrays(rng, (B, N, H, 2 * d), "float32")
    q = base[..., ::2]                                  # strided last axis
    k = arrays(rng, (B, N + 3, H, d), "float32")[:, ::-1][:, :N]  # negative stride
    v = np.asfortranarray(arrays(rng, (B, N, H, d), "float32"))
    out = np.full((B, N, H, d), np.nan, np.float32)
    res, lse = numflash.attention(q, k, v, layout="bshd", causal=True, softmax_scale=0.3,
                                  out=out, return_lse=True, backend="cuda", algorithm=algorithm)
    assert res is out
    rep = check(out, q, k, v, lse=lse, layout="bshd", causal=True, softmax_scale=0.3)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_rows_that_see_no_key_give_zeros_and_minus_inf(rng, algorithm):
    q = arrays(rng, (1, 1, 12, 4), "float32")
    k = arrays(rng, (1, 1, 5, 4), "float32")
    out, lse = numflash.attention(q, k, k, causal="bottom_right", return_lse=True,
                                  backend="cuda", algorithm=algorithm)
    # bottom_right with Nq=12, Nk=5: query i sees keys j <= i - 7, so rows 0..6 see nothing
    assert np.all(out[0, 0, :7] == 0) and np.all(np.isneginf(lse[0, 0, :7]))
    assert np.all(np.isfinite(lse[0, 0, 7:]))
    assert check(out, q, k, k, lse=lse, causal="bottom_right").ok


def test_large_scores_keep_float32_accuracy(rng):
    """Scores near 100: scaling q before the dot product would round q once more and break the
    accuracy rule; the kernels scale the scores instead."""
    q = arrays(rng, (1, 1, 20, 16), "float32") * 10
    k = arrays(rng, (1, 1, 20, 16), "float32") * 10
    v = arrays(rng, (1, 1, 20, 2), "float32")
    for algorithm in ALGORITHMS:
        out = numflash.attention(q, k, v, softmax_scale=0.5, backend="cuda", algorithm=algorithm)
        rep = check(out, q, k, v, softmax_scale=0.5)
        assert rep.ok, f"{algorithm}: {rep}"


def test_empty_and_keyless_problems_on_cuda_backend(rng):
    q = arrays(rng, (1, 2, 0, 8), "float32")
    k = arrays(rng, (1, 2, 5, 8), "float32")
    assert numflash.attention(q, k, k, backend="cuda").shape == (1, 2, 0, 8)
    q = arrays(rng, (1, 2, 3, 8), "float32")
    k0 = arrays(rng, (1, 2, 0, 8), "float32")
    out, lse = numflash.attention(q, k0, k0, backend="cuda", return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_explain_names_the_simulator_and_every_kernel(rng):
    q = arrays(rng, (1, 1, 8, 8), "float32")
    plan = numflash.explain(q, q, q, backend="cuda")
    text = str(plan)
    assert plan.kernel == "cuda.block" and "simulator" in text
    assert "cuda.row" in text and "cpu.tiled" in text
    assert numflash.explain(q, q, q).kernel == "cpu.tiled"  # auto follows the array type


def test_tensor_core_kernel_is_refused_in_the_simulator(rng):
    q = arrays(rng, (1, 1, 8, 64), "float16")
    with pytest.raises(ValueError, match="simulator|not built"):
        numflash.attention(q, q, q, backend="cuda", algorithm="mma")


def test_cuda_backend_refuses_cpu_only_algorithm_names(rng):
    q = arrays(rng, (1, 1, 8, 8), "float32")
    with pytest.raises(ValueError, match="algorithm"):
        numflash.attention(q, q, q, backend="cuda", algorithm="tiled")


@pytest.mark.parametrize("prefetch,pipelined", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("shape", [(1, 2, 17, 40, 59, 20), (1, 1, 33, 33, 5, 7)],
                         ids=lambda s: "x".join(map(str, s)))
def test_block_tile_staging_and_micro_gemm_variants(rng, prefetch, pipelined, shape):
    """Both ways cuda.block moves K/V tiles: fetched a tile ahead into registers (PF=1), or
    staged synchronously in register-sized parts (PF=0, several parts at d=59); and both ways its
    micro-GEMMs run: operands of step k+1 loaded before step k's FMAs (SP=1), or not."""
    from numflash import plan as _plan
    from numflash.cuda import block
    from numflash.inputs import normalize
    B, H, Nq, Nk, d, dv = shape
    q, k, v = arrays(rng, (B, H, Nq, d), "float32"), arrays(rng, (B, H, Nk, d), "float32"), \
        arrays(rng, (B, H, Nk, dv), "float32")
    problem = normalize(q, k, v, causal=True)
    device = _plan.choose(problem, "cuda", "block").device
    cfg = block.tile_config(d, dv, block.SIMULATOR_TILE[:4], "float32", prefetch=prefetch,
                            pipelined=pipelined)
    parts = block.staged_parts(cfg)
    assert (parts == (1, 1)) if prefetch else (d < 16 or parts[0] > 1)
    lse = block.run(problem, cfg, device)
    rep = check(problem.out, q, k, v, lse=lse, causal=True)
    assert rep.ok, str(rep)


def test_launch_packing_marks_every_array_data_pointer():
    """What the GPU fast path patches on a repeated call: the data-pointer slot of each array in
    the numba ABI's flattened parameters (meminfo, parent, nitems, itemsize, data, shape, strides)."""
    from numflash.cuda import launch

    class FakeDeviceArray:
        def __init__(self, ptr, shape, itemsize=4):
            self.ndim, self.shape, self.itemsize = len(shape), shape, itemsize
            self.size = int(np.prod(shape))
            self.strides = tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))
            self.data = type("Ptr", (), {"ptr": ptr})()

    args = (FakeDeviceArray(1000, (2, 3, 4, 5)), FakeDeviceArray(2000, (2, 3, 4)), 0.5, 7)
    values, slots = launch._pack(args)
    assert len(values) == 5 + 8 + 5 + 6 + 2
    assert [values[s] for s in slots] == [1000, 2000]
    assert values[slots[0] + 1: slots[0] + 5] == [2, 3, 4, 5]
    assert values[-1] == 7 and values[-2] == np.float64(0.5).view(np.int64)
    recipe = launch.Recipe(handle=0, grid=(4,), block=(32,), shared_bytes=0, values=values,
                           slots=slots)
    assert recipe.pointers == (1000, 2000) and recipe.grid == (4, 1, 1)


def test_replay_signature_is_only_for_device_arrays(rng):
    """NumPy calls never take the GPU fast path, and importing numflash imports neither numba
    nor CuPy (the fast path's signature check must stay cheap to import)."""
    import subprocess
    import sys
    from numflash.cuda import fastpath
    q = arrays(rng, (1, 1, 8, 8), "float32")
    assert fastpath.signature(q, q, q, (False, None)) is None
    out = subprocess.run([sys.executable, "-c", "import sys, numflash; "
                          "print('numba' in sys.modules, 'cupy' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


@pytest.mark.parametrize("dtype,d,dv,chunks", [("float32", 16, 256, 2), ("float64", 59, 111, 2),
                                               ("float32", 200, 40, 1)])
def test_row_kernel_large_head_dims(rng, dtype, d, dv, chunks):
    """Head dims past the registers: the row kernel keeps q in shared memory (QS) and splits the
    output columns across blocks (DV < dv), every option still exact."""
    q, k, v = arrays(rng, (1, 2, 9, d), dtype), arrays(rng, (1, 2, 40, d), dtype), \
        arrays(rng, (1, 2, 40, dv), dtype)
    plan = numflash.explain(q, k, v, backend="cuda", algorithm="row")
    assert plan.config["QS"] == 1 and -(-dv // plan.config["DV"]) == chunks
    for causal in (False, "bottom_right"):
        out, lse = numflash.attention(q, k, v, causal=causal, backend="cuda", algorithm="row",
                                      return_lse=True)
        rep = check(out, q, k, v, lse=lse, causal=causal)
        assert rep.ok, str(rep)
