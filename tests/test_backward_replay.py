"""A repeated backward call replays its recorded launches (numflash.cuda.fastpath.GradientReplay):
the key, the pointer mapping and the scratch rules with stand-ins for CuPy and the launches (CPU),
then the real thing on a GPU (marked): the replay is taken, and its gradients are the full
path's for new inputs, through the CuPy and the torch entry points."""
import types

import numpy as np
import pytest

import numflash
from numflash.cuda import fastpath
from numflash.testing import assert_gradients_accurate


class FakeArray:  # what gradient_signature / gradient_replay read of a cupy.ndarray
    def __init__(self, a, ptr, device=0):
        self.shape, self.strides, self.dtype = a.shape, a.strides, a.dtype
        self.nbytes = a.nbytes
        self.flags = types.SimpleNamespace(c_contiguous=a.flags.c_contiguous)
        self.data = types.SimpleNamespace(ptr=ptr, device_id=device)


class FakeRecipe:  # a launch.Recipe: the data pointers it was recorded with; launch() logs
    def __init__(self, pointers, log):
        self.pointers, self.log = tuple(pointers), log

    def launch(self, stream, pointers=()):
        self.log.append(("launch", self, stream, tuple(pointers)))


@pytest.fixture
def fake_cupy(monkeypatch):
    current = [0]
    log = []
    runtime = types.SimpleNamespace(
        getDevice=lambda: current[0],
        memsetAsync=lambda ptr, value, n, stream: log.append(("memset", ptr, value, n, stream)))
    fake = types.SimpleNamespace(ndarray=FakeArray, cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setattr(fastpath, "_cupy", fake)
    monkeypatch.setattr(fastpath, "_cupy_ndarray", FakeArray)
    monkeypatch.setattr(fastpath, "_get_device", runtime.getDevice)
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake)
    return types.SimpleNamespace(current=current, log=log)


def _six(rng, ptr0=1 << 20, **changes):
    shapes = {"do": (2, 3, 8, 16), "q": (2, 3, 8, 16), "k": (2, 3, 8, 16), "v": (2, 3, 8, 16),
              "o": (2, 3, 8, 16)}
    out = []
    for n, name in enumerate(("do", "q", "k", "v", "o", "lse")):
        a = changes.get(name)
        if a is None:
            a = np.zeros(shapes[name], np.float16) if name != "lse" else \
                np.zeros((2, 3, 8), np.float32)
        out.append(a if isinstance(a, FakeArray) else FakeArray(a, ptr0 + n * 4096))
    return out


def test_gradient_signature_tells_apart_what_the_full_path_would(rng, fake_cupy):
    """Equal for the same call on other data; different wherever a check, the plan or the packed
    parameters could differ; None where a replay would not be valid."""
    opts = ("none", None, "bhsd", "auto", "auto", "auto", False, None)
    base = fastpath.gradient_signature(_six(rng), opts)
    assert base is not None
    assert fastpath.gradient_signature(_six(rng, ptr0=1 << 24), opts) == base   # other data
    assert fastpath.gradient_signature(_six(rng, ptr0=(1 << 20) + 8), opts) != base  # alignment
    wide = np.zeros((2, 3, 8, 32), np.float16)[..., :16]
    assert fastpath.gradient_signature(_six(rng, q=wide), opts) != base        # strides
    assert fastpath.gradient_signature(
        _six(rng, lse=np.zeros((2, 3, 8), np.float64)), opts) != base          # dtype
    for n, changed in ((0, "top_left"), (1, 0.5), (2, "bshd"), (3, "cuda"), (4, "mma"),
                       (5, "ieee"), (6, True), (7, np.float32)):
        other = opts[:n] + (changed,) + opts[n + 1:]
        assert fastpath.gradient_signature(_six(rng), other) != base
    assert fastpath.gradient_signature(_six(rng), opts[:6] + (1,) + opts[7:]) != \
        fastpath.gradient_signature(_six(rng), opts[:6] + (True,) + opts[7:])  # 1 is not True
    assert fastpath.gradient_signature(_six(rng), opts[:1] + ([0.5],) + opts[2:]) is None
    six = _six(rng)
    assert fastpath.gradient_signature(six[:1] + [np.zeros((2, 3, 8, 16))] + six[2:],
                                       opts) is None                   # not all CuPy arrays
    fake_cupy.current[0] = 1
    assert fastpath.gradient_signature(_six(rng), opts) is None        # q not on this device


def _recorded(rng, log, first_pointers, scratch_zeroed=(False, True)):
    """Launches as a backward records them: a delta pass and a key pass passing the six inputs,
    the three gradients and two scratch arrays (delta; the dQ accumulator, zero-filled)."""
    arrays = _six(rng)
    grads = [FakeArray(np.zeros((2, 3, 8, 16), np.float16), (1 << 30) + n * 4096)
             for n in range(3)]
    scratch = [FakeArray(np.zeros((2, 3, 8), np.float32), 1 << 32),
               FakeArray(np.zeros((2, 3, 8, 16), np.float32), (1 << 32) + 4096)]
    launches = fastpath.Launches()
    launches.scratch += scratch
    launches.zeroed += list(scratch_zeroed)
    ptr = {a: a.data.ptr for a in arrays + grads + scratch}
    do, q, k, v, o, lse = arrays
    dq, dk, dv = grads
    delta, acc = scratch
    queries = FakeRecipe([ptr[x] for x in (q, k, v, do, o, lse, delta, dq)] + first_pointers,
                         log)
    keys = FakeRecipe([ptr[x] for x in (q, k, v, do, lse, delta, dk, dv, acc)], log)
    launches += [queries, keys]
    return launches, arrays, grads, (queries, keys)


def test_gradient_replay_patches_every_pointer_and_zero_fills_the_accumulator(rng, fake_cupy):
    kept = fastpath.keep(types.SimpleNamespace(data=types.SimpleNamespace(ptr=77)))
    launches, arrays, grads, (queries, keys) = _recorded(rng, fake_cupy.log, [kept.data.ptr])
    pointers = [a.data.ptr for a in arrays + grads]
    replay = fastpath.gradient_replay(launches, pointers, grads)
    assert isinstance(replay, fastpath.GradientReplay)
    made = []

    def allocate(nbytes):
        made.append(nbytes)
        return object(), 5000 + 1000 * len(made)
    new = [100 + 10 * n for n in range(9)]   # do, q, k, v, o, lse, dq, dk, dv
    del fake_cupy.log[:]
    owners = replay.launch(42, new, allocate)
    assert len(owners) == 2 and made == [2 * 3 * 8 * 4, 2 * 3 * 8 * 16 * 4]
    delta, acc = 6000, 7000
    do, q, k, v, o, lse, dq, dk, dv = new
    assert fake_cupy.log == [
        ("memset", acc, 0, made[1], 42),            # only the accumulator, before the launches
        ("launch", queries, 42, (q, k, v, do, o, lse, delta, dq, None)),   # kept: as recorded
        ("launch", keys, 42, (q, k, v, do, lse, delta, dk, dv, acc))]


def test_gradient_replay_refuses_what_it_cannot_replay(rng, fake_cupy):
    launches, arrays, grads, _ = _recorded(rng, fake_cupy.log, [])
    pointers = [a.data.ptr for a in arrays + grads]
    assert fastpath.gradient_replay(launches, pointers, grads) is not None
    # an array that is none of the call's (a CuPy temporary the kernel module made)
    stray, _, _, _ = _recorded(rng, fake_cupy.log, [123456])
    assert fastpath.gradient_replay(stray, pointers, grads) is None
    # q is k in the recording: which one a launch read cannot be told
    twice = list(pointers)
    twice[2] = twice[1]
    launches_qk, _, _, _ = _recorded(rng, fake_cupy.log, [])
    for recipe in launches_qk:
        recipe.pointers = tuple(twice[1] if p == pointers[2] else p for p in recipe.pointers)
    assert fastpath.gradient_replay(launches_qk, twice, grads) is None
    # other GPU work in the call (a CuPy operation on an output)
    launches.unreplayable.append("attn_bias's gradient")
    assert fastpath.gradient_replay(launches, pointers, grads) is None
    # gradients the replay would not make as the full path made them
    launches, _, _, _ = _recorded(rng, fake_cupy.log, [])
    strided = FakeArray(np.zeros((2, 3, 8, 32), np.float16)[..., :16], grads[0].data.ptr)
    assert fastpath.gradient_replay(launches, pointers, [strided] + grads[1:]) is None
    assert fastpath.gradient_replay(fastpath.Launches(), pointers, grads) is None


def test_a_forward_replay_never_takes_zero_filled_scratch(rng, fake_cupy):
    """The forward's Replay reuses scratch without zero-filling it: a recording that noted one
    is not remembered."""
    launches = fastpath.Launches()
    launches.append(FakeRecipe([1, 2, 3, 4, 5], []))
    launches.scratch.append(FakeArray(np.zeros(4, np.float32), 99))
    launches.zeroed.append(True)
    problem = types.SimpleNamespace(q=FakeArray(np.zeros(1), 1), k=FakeArray(np.zeros(1), 2),
                                    v=FakeArray(np.zeros(1), 3), out=FakeArray(np.zeros(1), 4))
    assert fastpath.remember(("key",), launches, problem, FakeArray(np.zeros(1), 5)) is None


# ---- cuda.dq_round, the launch a DQADD backward ends with ----

@pytest.mark.parametrize("OUT", ["f16", "bf16", "f32"])
def test_dq_round_kernel_writes_the_accumulator_rounded_into_any_strides(rng, OUT):
    """Its generated source under numba's simulator (stand-ins for the PTX helpers): the first
    d columns of the padded accumulator, rounded to nearest even, into a bshd (strided) dQ;
    every other element left as it was; NaN and inf kept."""
    from mma_tools import pack_bf16x2, pack_f16x2
    from numba import cuda
    from numflash.cuda import dq_round
    B, H, Nq, d, D = 2, 3, 5, 59, 64
    acc = rng.standard_normal((B, H, Nq, D)).astype(np.float32) * 100
    acc[0, 1, 2, 3], acc[1, 2, 4, 58] = np.nan, -np.inf
    ns = {"cuda": cuda, "U": np.uint64, "uint16": np.uint16, "ZERO": np.float32(0),
          "vector_load": lambda a, i, w: tuple(a[int(i) + n] for n in range(w)),
          "div_u32": lambda a, b: np.uint32(int(a) // int(b)),
          "pack_f16x2": pack_f16x2, "pack_bf16x2": pack_bf16x2}
    exec(dq_round.kernel_source(OUT), ns)  # noqa: S102 - the package's generated source
    bits = OUT != "f32"
    poison = 0xABCD if bits else np.float32(-7.5)
    store = np.full((B, Nq, H, d + 3), poison, np.uint16 if bits else np.float32)
    out = store[..., :d].transpose(0, 2, 1, 3)    # (B, H, Nq, d) view of a bshd array
    threads = acc.size // 4
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray   # a strided view, in
    cuda.jit(ns["round_dq"])[(threads + 63) // 64, 64](acc.reshape(-1), D,  # place (launch.py)
                                                       FakeCUDAArray(out))
    want = acc[..., :d]
    if OUT == "f16":
        got, want = out.view(np.float16), want.astype(np.float16)
    elif OUT == "bf16":
        ml = pytest.importorskip("ml_dtypes")
        got, want = out.view(ml.bfloat16), want.astype(ml.bfloat16)
    else:
        got = out
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))
    assert (store[..., d:] == poison).all()


def test_dq_round_compiles_without_spills_to_vector_loads_and_32_bit_divisions():
    from test_cuda_compile import run_without_simulator
    out = run_without_simulator("""
        import json
        from numflash.cuda import dq_round, launch
        rows = []
        for dt in ("float16", "bfloat16", "float32"):
            k, sig = dq_round.kernel(dt)
            ptx = launch.kernel_ptx(k.pyfunc, sig, (9, 0))
            res = launch.compile_to_cubin(k.pyfunc, sig, (9, 0))[3]
            rows.append([dt, "ld.global.v4.f32" in ptx or "ld.global.nc.v4.f32" in ptx,
                         ptx.count("div.u32"), ptx.count("div.u64") + ptx.count("div.s64"),
                         res.get("spill_store_bytes", 0) + res.get("local_bytes", 0)])
        print(json.dumps(rows))
    """)
    for dt, vector, div32, div64, spills in __import__("json").loads(out.splitlines()[-1]):
        assert vector and div32 == 3 and div64 == 0 and spills == 0, dt


# ---- on a GPU ----

CASES = [  # (dtype, B, H, Hk, Nq, Nk, d, causal, layout, options)
    ("float16", 2, 4, 4, 200, 200, 64, True, "bhsd", {}),
    ("bfloat16", 1, 4, 2, 97, 300, 128, False, "bshd", {}),
    ("float16", 2, 2, 2, 130, 130, 64, "bottom_right", "bhsd", {"deterministic": True}),
    ("float16", 1, 2, 2, 64, 128, 64, False, "bhsd", {"grad_dtype": np.float32}),
    ("float32", 1, 2, 2, 100, 100, 64, True, "bhsd", {}),
    ("float64", 1, 2, 2, 50, 70, 32, False, "bhsd", {}),
]


def _inputs(rng, dtype, B, H, Hk, Nq, Nk, d, layout):
    from test_mma_gpu import _device_array

    def make(heads, n):
        return _device_array(rng, (B, heads, n, d) if layout == "bhsd" else (B, n, heads, d),
                             dtype)
    return make(H, Nq), make(Hk, Nk), make(Hk, Nk), make(H, Nq)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[6]}-{c[7]}-{c[8]}")
def test_gpu_repeated_backward_replays_with_new_inputs(rng, case):
    import cupy as cp
    dtype, B, H, Hk, Nq, Nk, d, causal, layout, options = case
    fastpath.clear()
    runs = []
    for replayed in (False, True):
        q, k, v, do = _inputs(rng, dtype, B, H, Hk, Nq, Nk, d, layout)
        o, lse = numflash.attention(q, k, v, causal=causal, layout=layout, return_lse=True)
        args = (do, q, k, v, o, lse)
        kw = dict(causal=causal, layout=layout, **options)
        key = fastpath.gradient_signature(args, (causal, None, layout, "auto", "auto", "auto",
                                                 options.get("deterministic", False),
                                                 options.get("grad_dtype")))
        assert (fastpath.lookup(key) is not None) == replayed
        grads = numflash.attention_backward(*args, **kw)
        assert isinstance(fastpath.lookup(key), fastpath.GradientReplay)
        assert_gradients_accurate(grads, do, q, k, v, causal=causal, layout=layout)
        assert all(g.dtype == (options.get("grad_dtype") or q.dtype) for g in grads)
        runs.append((args, kw, grads))
    # the replay's gradients are the full path's for the same new inputs
    args, kw, replayed = runs[1]
    fastpath.clear()
    full = numflash.attention_backward(*args, **kw)
    exact = ("dq", "dk", "dv") if kw.get("deterministic") or dtype in ("float32", "float64") \
        else ("dk", "dv")   # dQ by atomic adds (16-bit on sm_90): its sums' order varies
    for name, a, b in zip(("dq", "dk", "dv"), replayed, full):
        if name in exact:
            assert bool((a.view(cp.uint8) == b.view(cp.uint8)).all()), name


@pytest.mark.gpu
def test_gpu_torch_backward_replays(rng, monkeypatch):
    torch = pytest.importorskip("torch")
    import numflash.torch as nt
    replayed = []
    original = nt._replay_gradients
    monkeypatch.setattr(nt, "_replay_gradients",
                        lambda *a: replayed.append(1) or original(*a))
    nt._replays.clear()
    results = []
    for _ in range(3):
        q, k, v = (torch.randn(2, 4, 150, 64, device="cuda", dtype=torch.float16,
                               requires_grad=True) for _ in range(3))
        out = nt.attention(q, k, v, causal=True)
        out.float().square().sum().backward()
        results.append((q, k, v))
    keys = [key for key in nt._replays if key[0] == "backward"]
    assert keys and isinstance(nt._replays[keys[-1]], fastpath.GradientReplay)
    assert len(replayed) == 2   # the second and third backward
    for q, k, v in results[1:]:   # replayed calls: checked against the float64 reference
        do = (2 * nt.attention(q, k, v, causal=True).detach().float()).half()
        assert_gradients_accurate([t.grad.cpu().numpy() for t in (q, k, v)],
                                  *(t.detach().cpu().numpy() for t in (do, q, k, v)),
                                  causal=True)


@pytest.mark.gpu
def test_gpu_replayed_backward_host_time(rng):
    """A replayed backward's host time: far under the full path's (0.43-0.82 ms on the H200,
    bench/NOTES.md "The backward's host time"); the bound is loose, as test_call_overhead's."""
    import cupy as cp
    from numflash.bench.timing import CudaEventTimer
    import time
    q, k, v, do = _inputs(rng, "float16", 1, 2, 2, 128, 128, 64, "bhsd")
    o, lse = numflash.attention(q, k, v, return_lse=True)
    call = lambda: numflash.attention_backward(do, q, k, v, o, lse)   # noqa: E731
    timer = CudaEventTimer()
    call()
    timer(call)
    host = []
    for _ in range(20):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            call()
        host.append((time.perf_counter() - t0) / 20 * 1e6)
    assert sorted(host)[10] < 150, f"median host time {sorted(host)[10]:.0f} us a call"
