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


STAGING_CASES = [  # (prefetch, pipelined, tile, dtype, (B, H, Nq, Nk, d, dv))
    (True, True, (16, 16, 4, 4), "float32", (1, 2, 17, 40, 59, 20)),
    (False, True, (16, 16, 4, 4), "float32", (1, 2, 17, 40, 59, 20)),
    (True, False, (16, 16, 4, 4), "float32", (1, 1, 33, 33, 5, 7)),
    (False, False, (16, 16, 4, 2), "float32", (1, 2, 17, 40, 59, 20)),
    (False, True, (16, 16, 4, 2), "float32", (1, 1, 33, 33, 5, 7)),
    (True, True, (16, 16, 4, 2), "float64", (1, 1, 20, 37, 24, 40)),
]


@pytest.mark.parametrize("prefetch,pipelined,tile,dtype,shape", STAGING_CASES,
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_block_tile_staging_and_micro_gemm_variants(rng, prefetch, pipelined, tile, dtype, shape):
    """Both ways cuda.block moves K/V tiles: fetched a tile ahead into registers (PF=1), or
    staged synchronously in register-sized parts (PF=0, several parts at d=59); both ways its
    micro-GEMMs run: operands of step k+1 loaded before step k's FMAs (SP=1), or not; and key
    interleaving with TX != TN (TX = TN would map every key to itself)."""
    from numflash import plan as _plan
    from numflash.cuda import block
    from numflash.inputs import normalize
    B, H, Nq, Nk, d, dv = shape
    q, k, v = arrays(rng, (B, H, Nq, d), dtype), arrays(rng, (B, H, Nk, d), dtype), \
        arrays(rng, (B, H, Nk, dv), dtype)
    problem = normalize(q, k, v, causal="bottom_right")
    device = _plan.choose(problem, "cuda", "block").device
    acc = "float64" if dtype == "float64" else "float32"
    cfg = block.tile_config(d, dv, tile, acc, prefetch=prefetch, pipelined=pipelined)
    parts = block.staged_parts(cfg)
    assert (parts == (1, 1)) if prefetch else (d < 16 or parts[0] > 1)
    lse = block.run(problem, cfg, device)
    rep = check(problem.out, q, k, v, lse=lse, causal="bottom_right")
    assert rep.ok, str(rep)


def test_launch_packing_marks_every_array_data_pointer():
    """What the GPU fast path patches on a repeated call: the data-pointer slot of each array in
    the numba ABI's flattened parameters (meminfo, parent, nitems, itemsize, data, shape,
    strides)."""
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


def test_importing_numflash_imports_neither_numba_nor_cupy():
    """The GPU fast path's signature check runs before anything else in attention(): importing
    numflash must stay cheap."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import sys, numflash; "
                          "print('numba' in sys.modules, 'cupy' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_replay_signature_tells_apart_what_the_full_path_would(rng, monkeypatch):
    """The fast path's key, with a stand-in for CuPy: equal for the same call on other data,
    different wherever a check, the plan or the packed parameters could differ, and absent where
    a replay would not be valid (NumPy arrays, another device, unhashable options)."""
    import types
    from numflash.cuda import fastpath

    class FakeArray:  # what signature() reads of a cupy.ndarray
        def __init__(self, a, ptr, device=0):
            self.shape, self.strides, self.dtype = a.shape, a.strides, a.dtype
            self.data = types.SimpleNamespace(ptr=ptr, device_id=device)

    current = [0]
    fake = types.SimpleNamespace(ndarray=FakeArray, cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: current[0])))
    monkeypatch.setattr(fastpath, "_cupy", fake)
    monkeypatch.setattr(fastpath, "_cupy_ndarray", FakeArray)
    monkeypatch.setattr(fastpath, "_get_device", fake.cuda.runtime.getDevice)

    a = arrays(rng, (2, 3, 8, 16), "float32")
    opts = fastpath.call_options(False, None, "bhsd", "auto", "auto", False, "auto")

    def key(q=a, k=a, v=a, options=opts, ptrs=(4096, 8192, 12288), device=0):
        return fastpath.signature(FakeArray(q, ptrs[0], device), FakeArray(k, ptrs[1], device),
                                  FakeArray(v, ptrs[2], device), options)

    base = key()
    assert base is not None and key(ptrs=(0, 16, 32)) == base     # other data, same layout
    assert key(ptrs=(8, 16, 32)) != base                           # 16-byte alignment differs
    assert key(q=a[:, :, ::2]) != base                             # shape
    assert key(q=np.asfortranarray(a)) != base                     # strides
    assert key(v=a.astype(np.float64)) != base                     # dtype
    for changed in ((True, None), (1, None), (False, 0.5), (False, np.float64(0.5))):
        other = fastpath.call_options(*changed, "bhsd", "auto", "auto", False, "auto")
        assert key(options=other) != base
    assert key(options=fastpath.call_options(1, None, "bhsd", "auto", "auto", False, "auto")) \
        != key(options=fastpath.call_options(True, None, "bhsd", "auto", "auto", False, "auto"))
    assert key(options=fastpath.call_options([1], None, "bhsd", "auto", "auto", False,
                                             "auto")) is None       # unhashable: full path
    # modifications a replay takes: scalars with their element types, (device) arrays as q
    bias = a[0, :, :, :8]
    given = ({"window_size": (20, 3)}, {"window_size": (20, 4)}, {"window_size": (20.0, 3)},
             {"softcap": 30.0}, {"softcap": np.float32(30.0)},
             {"softcap": 30.0, "window_size": (20, 3)},
             {"attn_bias": FakeArray(bias, 4096)}, {"attn_bias": FakeArray(bias, 4104)},
             {"attn_bias": FakeArray(bias.astype(np.float16), 4096)},
             {"attn_bias": FakeArray(bias[:, :1], 4096)},
             {"attn_mask": FakeArray(bias > 0, 4096), "softcap": 30.0})
    mods = [fastpath.replay_mods(m) for m in given]

    def with_mods(part):
        return key(options=fastpath.call_options(False, None, "bhsd", "auto", "auto", False,
                                                 "auto", None, part))
    keys = [with_mods(m[0]) for m in mods]
    assert None not in keys and len(set(keys + [base])) == len(keys) + 1, keys
    assert keys[0] == with_mods(fastpath.replay_mods({"window_size": (20, 3)})[0])
    assert keys[6] == with_mods(fastpath.replay_mods({"attn_bias": FakeArray(bias, 8192)})[0])
    assert [len(m[1]) for m in mods] == [0] * 6 + [1] * 5   # the arrays a replay patches
    assert fastpath.replay_mods({"alibi_slopes": np.ones(3)}) is None     # a host array
    assert fastpath.replay_mods({"softcap": 30.0, "mask_mod": len}) is None
    assert with_mods(fastpath.replay_mods({"window_size": [20, 3]})[0]) is None  # unhashable
    assert key(device=1) is None                                    # q not on the current device
    current[0] = 1
    assert key(device=1) is not None and key(device=1) != base
    assert fastpath.signature(a, a, a, opts) is None                # NumPy arrays


@pytest.mark.parametrize("dtype,d,dv,hold_q,chunks", [("float32", 16, 256, 1, 2),
                                                      ("float64", 59, 111, 0, 2),
                                                      ("float32", 200, 40, 0, 1)])
def test_row_kernel_large_head_dims(rng, dtype, d, dv, hold_q, chunks):
    """Head dims past the registers: the row kernel splits the output columns across blocks
    (DV < dv) with q still in registers (HOLDQ), or keeps q in shared memory, every option
    exact."""
    q, k, v = arrays(rng, (1, 2, 9, d), dtype), arrays(rng, (1, 2, 70, d), dtype), \
        arrays(rng, (1, 2, 70, dv), dtype)
    plan = numflash.explain(q, k, v, backend="cuda", algorithm="row")
    assert plan.config["HOLDQ"] == hold_q and -(-dv // plan.config["DV"]) == chunks
    for causal in (False, "bottom_right"):
        out, lse = numflash.attention(q, k, v, causal=causal, backend="cuda", algorithm="row",
                                      return_lse=True)
        rep = check(out, q, k, v, lse=lse, causal=causal)
        assert rep.ok, str(rep)


def test_a_launch_is_replayable_only_on_its_own_pointers_and_kept_arrays():
    """fastpath.replayable, shared by the CuPy replay and numflash.torch's: one launch, whose first
    array arguments are the call's q, k, v, out, lse, and whose others live for the process."""
    from types import SimpleNamespace
    from numflash.cuda import fastpath
    kept = fastpath.keep(SimpleNamespace(data=SimpleNamespace(ptr=999)))
    ours = (10, 20, 30, 40, 50)
    launch = SimpleNamespace(pointers=ours + (kept.data.ptr,))
    assert fastpath.replayable([launch], ours) is launch
    assert fastpath.replayable([launch, launch], ours) is None            # two launches
    assert fastpath.replayable([launch], (10, 20, 31, 40, 50)) is None    # another array
    assert fastpath.replayable([SimpleNamespace(pointers=ours + (7,))], ours) is None  # not kept


def test_replay_steps_map_each_launchs_arrays_to_the_calls():
    """fastpath.replay_steps, the CuPy replay's: every array argument of every launch is one of
    the call's q, k, v, out, lse, a scratch array (split-KV's partials, read by the merge) or a
    kept one; q = k = v maps by position; anything else, or an ambiguous pointer out of its
    position, is not replayable."""
    from types import SimpleNamespace
    from numflash.cuda import fastpath
    kept = fastpath.keep(SimpleNamespace(data=SimpleNamespace(ptr=998)))
    part, part_lse = (SimpleNamespace(data=SimpleNamespace(ptr=p)) for p in (60, 70))
    ours = (10, 20, 30, 40, 50)
    main = SimpleNamespace(pointers=(10, 20, 30, 60, 70, 998))
    merge = SimpleNamespace(pointers=(60, 70, 40, 50))
    steps = fastpath.replay_steps([main, merge], ours, (part, part_lse))
    assert steps == [(main, (0, 1, 2, 5, 6, None)), (merge, (5, 6, 3, 4))]
    same = SimpleNamespace(pointers=(10, 10, 10, 40, 50, 998))   # q is k is v
    assert fastpath.replay_steps([same], (10, 10, 10, 40, 50)) == [(same, (0, 1, 2, 3, 4, None))]
    assert fastpath.replay_steps([main, merge], ours) is None               # scratch not noted
    moved = SimpleNamespace(pointers=(40, 50, 998, 10))     # q (= k = v) out of its places
    assert fastpath.replay_steps([moved], (10, 10, 10, 40, 50)) is None
    assert kept.data.ptr == 998
