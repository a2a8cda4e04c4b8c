"""Compiling ahead of the first call (issue 20): the shipped PTX is current and links, a build
takes it before compiling from source, `python -m numflash.precompile` fills the cache with a
progress report, explain says where each kernel's code would come from, and the argument types
planned ahead are the ones real launches pass."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("numba_cuda", reason="precompiling belongs to the CUDA path")
import numflash  # noqa: E402
from numflash import plan as planner  # noqa: E402
from numflash.cuda import launch, prebuilt  # noqa: E402
from numflash.device import Device  # noqa: E402
from numflash.precompile import COMMON, StandIn, targets  # noqa: E402

from conftest import HAS_GPU  # noqa: E402


def common_targets():
    return targets(COMMON["archs"], COMMON["dtypes"], COMMON["head_dims"], COMMON["directions"])


def test_shipped_ptx_is_current_and_covers_the_common_set():
    """Fails after an edit of a kernel's sources until `python -m numflash.precompile --ship`
    has made its shipped PTX again (a stale file is never used: its key no longer matches)."""
    shipped = prebuilt.manifest()
    found = common_targets()
    kinds = {(k.name.split(".backward")[0], plan.direction) for k, _, _, plan in found}
    # every common forward and backward runs on cuda.mma (float32 as 3xTF32), but the 16-bit
    # forward and backward on sm_90 (cuda.wgmma; its backward's delta pass is cuda.mma's, and
    # its dQ adds end with cuda.dq_round)
    assert kinds == {("cuda.mma", "forward"), ("cuda.mma", "backward"),
                     ("cuda.wgmma", "forward"), ("cuda.wgmma", "backward"),
                     ("cuda.dq_round", "backward")}, kinds
    for kernel, sig, cc, _ in found:
        path = prebuilt.find(kernel.prebuilt_key(sig), cc)
        assert path is not None and path.name.endswith(f"sm{cc[0]}{cc[1]}.ptx.xz"), (
            f"no current shipped PTX for {launch.describe(kernel.name, kernel.config, cc, sig)}:"
            " run `python -m numflash.precompile --ship`")
    assert len(shipped["entries"]) == len({k.prebuilt_key(s) for k, s, _, _ in found})


def test_shipped_ptx_links_without_a_gpu():
    """nvJitLink + ptxas take the shipped PTX (the smallest file of each kernel kind and data
    type, so each of cuda.mma's f16, bf16 and 3xTF32 forms)."""
    smallest = {}
    for kernel, sig, cc, _ in common_targets():
        path = prebuilt.find(kernel.prebuilt_key(sig), cc)
        kind = (kernel.name, kernel.config.get("DT"))
        if kind not in smallest or path.stat().st_size < smallest[kind][0]:
            smallest[kind] = (path.stat().st_size, kernel.prebuilt_key(sig), cc)
    for name, (_, key, cc) in smallest.items():
        cubin, entry, resources = prebuilt.link(key, cc)
        assert cubin[:4] == b"\x7fELF" and entry and resources["registers"] > 0, name
        assert resources.get("spill_store_bytes", 0) <= SHIPPED_SPILLS.get(name, 0), (
            name, resources)


#: spill-store bytes ptxas reports for the smallest shipped file of a kind where the planner's
#: tile spills: the 3xTF32 d128 key pass (4, 16, 8) stores 4 bytes on sm_90, 8 on sm_80
#: (test_mma_backward.KNOWN_SPILLS; bench/NOTES.md "Tensor-core backward for float32 and
#: float64")
SHIPPED_SPILLS = {("cuda.mma.backward_keys", "3xtf32"): 8}


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMFLASH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_build_links_shipped_ptx_before_compiling_and_explain_follows(cache, monkeypatch,
                                                                      capsys):
    def no_compile(*a, **k):
        raise AssertionError("compiled from source although PTX is shipped")
    monkeypatch.setattr(launch, "compile_to_cubin", no_compile)
    monkeypatch.setenv("NUMFLASH_QUIET", "0")
    device = Device.of_arch((8, 0))
    plan = planner._choose(StandIn(64, "float32", direction="backward"), "cuda", "auto",
                           device=device)
    assert "kernel cache: cuda.mma.backward_queries: shipped PTX" in str(plan) and \
        "cuda.mma.backward_keys: shipped PTX" in str(plan), str(plan)
    for kernel, sig in plan.compiled_kernels():
        assert kernel.status(sig, (8, 0)) == "prebuilt"
        cubin, meta = kernel.build(sig, (8, 0))
        assert meta["source"] == "prebuilt" and not meta["from_disk"]
        assert kernel.status(sig, (8, 0)) == "cached"
    assert "cached on disk" in str(plan) and "shipped PTX" not in str(plan)
    assert "compiling" not in capsys.readouterr().err


def test_an_unshipped_variant_says_it_compiles_and_announces_the_compile(cache, monkeypatch,
                                                                        capsys):
    compiled = []

    def fake(pyfunc, argtypes, cc, fastmath):
        compiled.append(cc)
        return b"\x7fELF-stand-in", "entry_fn", "ptx", {}
    monkeypatch.setattr(launch, "compile_to_cubin", fake)
    monkeypatch.setenv("NUMFLASH_QUIET", "0")
    plan = planner._choose(StandIn(96, "float64"), "cuda", "auto", device=Device.of_arch((9, 0)))
    assert plan.kernel == "cuda.mma" and "not cached: compiles from source" in str(plan)
    (kernel, sig), = plan.compiled_kernels()
    _, meta = kernel.build(sig, (9, 0))
    assert compiled == [(9, 0)] and meta["source"] == "compiled"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "numflash: compiling cuda.mma" in err and "sm_90" in err
    assert "precompile" in err and str(cache) in err
    monkeypatch.setenv("NUMFLASH_QUIET", "1")
    kernel.build(sig, (8, 0))
    assert capsys.readouterr().err == ""
    assert "cached on disk" in str(plan)


def test_a_shipped_file_that_cannot_link_is_warned_once_and_compiled_from_source(
        cache, monkeypatch):
    compiled = []

    def fake(pyfunc, argtypes, cc, fastmath):
        compiled.append(cc)
        return b"\x7fELF-stand-in", "entry_fn", "ptx", {}

    def refuse(ptx, cc):
        raise RuntimeError("Unsupported .version 9.9; current version is '8.0'")
    monkeypatch.setattr(launch, "compile_to_cubin", fake)
    monkeypatch.setattr(launch, "link_ptx", refuse)
    monkeypatch.setattr(prebuilt, "_link_failed", [])
    plan = planner._choose(StandIn(64, "float16"), "cuda", "auto", device=Device.of_arch((9, 0)))
    (kernel, sig), = plan.compiled_kernels()
    with pytest.warns(RuntimeWarning, match="shipped PTX cannot be linked here.*9.9"):
        _, meta = kernel.build(sig, (9, 0))
    assert meta["source"] == "compiled" and compiled == [(9, 0)]
    assert kernel.status(sig, (8, 0)) == "compile"  # no further attempts in this process


def test_an_edited_kernel_makes_only_its_own_files_stale(monkeypatch):
    """A SIMT kernel's key hashes its module and the numflash.cuda modules it imports; the
    tensor-core generator's key hashes the source it generates, so a refactor of the generator
    that leaves that source alike reships nothing."""
    found = common_targets()
    cuda_dir = launch._CUDA_DIR
    row_backward = launch._sources(cuda_dir / "row_backward.py")
    assert cuda_dir / "common.py" in row_backward and cuda_dir / "block.py" not in row_backward
    mma_parts = launch._sources(cuda_dir / "mma" / "__init__.py")
    assert {cuda_dir / "mma" / f for f in ("forward.py", "operands.py", "staging.py")} <= \
        set(mma_parts) and cuda_dir / "row.py" not in mma_parts

    def stale():
        return {kernel.name for kernel, sig, cc, _ in found
                if prebuilt.find(kernel.prebuilt_key(sig), cc) is None}
    assert stale() == set()
    from numflash.cuda.mma import forward
    generate = forward.kernel_source
    with monkeypatch.context() as m:  # the forward's generated source changes
        m.setattr(forward, "kernel_source", lambda cfg: generate(cfg) + "# edited\n")
        assert stale() == {"cuda.mma"}
    from numflash.cuda.mma import backward
    keys = backward.SOURCES["keys"]
    with monkeypatch.context() as m:  # the backward key pass's generated source changes
        m.setitem(backward.SOURCES, "keys", lambda cfg: keys(cfg) + "# edited\n")
        assert stale() == {"cuda.mma.backward_keys"}
    # cuda.row's backward ships nothing now (every common backward runs on cuda.mma): an edit
    # of cuda/row_backward.py changes its own variants' keys and stales no shipped file
    row = targets([(8, 0)], ("float64",), (256,), ("backward",))
    assert {kernel.name for kernel, _, _, _ in row} == {"cuda.row.backward_keys",
                                                        "cuda.row.backward_queries"}
    before = {kernel.prebuilt_key(sig) for kernel, sig, _, _ in row}
    with monkeypatch.context() as m:  # as after an edit of cuda/row_backward.py
        m.setitem(launch._DIGESTS, "numflash.cuda.row_backward", "0" * 16)
        assert stale() == set()
        assert before.isdisjoint(kernel.prebuilt_key(sig) for kernel, sig, _, _ in row)


def test_planned_argument_types_are_the_launched_ones(monkeypatch, rng):
    """What precompile and explain plan ahead (compiled_kernels) is what a launch passes: the
    SIMT forward kernels and the backward, run in the simulator (cuda.mma on the GPU test)."""
    if HAS_GPU:
        pytest.skip("checked in the simulator; the GPU test covers it there")
    launched = []
    original = launch.Kernel.__call__

    def record(self, grid, block, shared, args, device):
        launched.append((self.name, tuple(self.config.items()),
                         tuple(launch.numba_type(a) for a in args)))
        return original(self, grid, block, shared, args, device)
    monkeypatch.setattr(launch.Kernel, "__call__", record)
    for dtype in ("float16", "float32", "float64"):
        q, k, v, do = (rng.standard_normal((1, 1, 5, 4)).astype(dtype) for _ in range(4))
        for algorithm in ("block", "row"):
            launched.clear()
            numflash.attention(q, k, v, backend="cuda", algorithm=algorithm)
            plan = numflash.explain(q, k, v, backend="cuda", algorithm=algorithm)
            assert launched == [(kk.name, tuple(kk.config.items()), sig)
                                for kk, sig in plan.compiled_kernels()]
        o, lse = numflash.attention(q, k, v, backend="cuda", algorithm="row", return_lse=True)
        launched.clear()
        numflash.attention_backward(do, q, k, v, o, lse, backend="cuda")
        plan = numflash.explain(q, k, v, backend="cuda", backward=True)
        assert len(launched) == 2 and launched == [
            (kk.name, tuple(kk.config.items()), sig) for kk, sig in plan.compiled_kernels()]


def test_precompile_command_fills_the_cache_with_progress(tmp_path):
    """The command in a fresh process: one shipped variant pair (linked) and one that compiles
    from source (sm_75 float64 d32 forward, cuda.row), then everything reported cached."""
    env = dict(os.environ, NUMFLASH_CACHE_DIR=str(tmp_path / "c"), NUMBA_ENABLE_CUDASIM="1")

    def run(*args):
        proc = subprocess.run([sys.executable, "-m", "numflash.precompile", *args], env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc
    first = run("--arch", "80", "--dtype", "float32", "--d", "64", "--direction", "backward")
    assert first.stdout.count("linked from shipped PTX") == 2, first.stdout
    assert "numflash precompile" in first.stderr  # the progress bar
    odd = run("--arch", "75", "--dtype", "float64", "--d", "32", "--direction", "forward",
              "--jobs", "1")
    assert "cuda.block" in odd.stdout and odd.stdout.count("compiled in") == 1, odd.stdout
    for args in (("--arch", "80", "--dtype", "float32", "--d", "64", "--direction", "backward"),
                 ("--arch", "75", "--dtype", "float64", "--d", "32", "--direction", "forward")):
        again = run(*args)
        assert " in " not in again.stdout.split("kernel variants ready")[0], again.stdout
        assert "already cached" in again.stdout
    cubins = list((tmp_path / "c").glob("*.cubin"))
    metas = [json.loads(p.with_suffix(".json").read_text()) for p in cubins]
    assert sorted(m["source"] for m in metas)[:3] == ["compiled", "prebuilt", "prebuilt"], metas


def test_precompile_refuses_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "numflash.precompile", "--dtype", "int8"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dtype: int8 is not one of" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_first_calls_of_the_common_set_compile_nothing(tmp_path):
    """In a fresh process with an empty cache: every common configuration's first call (forward
    both causal modes, backward) links shipped PTX and compiles nothing from source."""
    code = f"""
import json, sys, time, warnings
warnings.simplefilter("error")
import cupy, numpy as np, numflash
from numflash.cuda import launch
def refuse(*a, **k):
    raise AssertionError("compiled from source")
launch.compile_to_cubin = refuse
rows = []
for dt in {list(COMMON["dtypes"])}:
    for d in {list(COMMON["head_dims"])}:
        if dt == "bfloat16":
            import torch
            q, k, v, do = (cupy.from_dlpack(torch.randn(1, 2, 256, d, device="cuda",
                           dtype=torch.bfloat16)) for _ in range(4))
        else:
            q, k, v, do = (cupy.asarray(np.random.default_rng(0).standard_normal(
                (1, 2, 256, d)).astype(dt)) for _ in range(4))
        for causal in (False, True):
            t = time.perf_counter()
            o, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
            cupy.cuda.get_current_stream().synchronize()
            t1 = time.perf_counter()
            numflash.attention_backward(do, q, k, v, o, lse, causal=causal)
            cupy.cuda.get_current_stream().synchronize()
            rows.append([dt, d, causal, t1 - t, time.perf_counter() - t1])
print(json.dumps(rows))
"""
    env = dict(os.environ, NUMFLASH_CACHE_DIR=str(tmp_path / "c"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.splitlines()[-1])
    print("\n".join(f"first call {r[0]} d{r[1]} causal={r[2]}: forward {r[3]:.2f} s, "
                    f"backward {r[4]:.2f} s" for r in rows))
    assert len(rows) == 12
    assert all(json.loads(p.read_text())["source"] == "prebuilt"
               for p in (tmp_path / "c").glob("*.json"))


def test_ship_writes_portable_ptx_and_only_remakes_what_changed(tmp_path, monkeypatch):
    """The maintainers' --ship path on one small variant pair (cuda.row's backward, float64
    d256, which cuda.mma's backward leaves to it, sm_80) into a scratch directory: PTX written
    with the oldest ISA header that links to the same cubin, a manifest entry each; a second run
    keeps them; a file no target wants goes."""
    from numflash import precompile as pc
    monkeypatch.setattr(prebuilt, "DIR", tmp_path / "ptx")
    monkeypatch.setattr(prebuilt, "MANIFEST", tmp_path / "ptx" / "manifest.json")
    monkeypatch.setattr(prebuilt, "_manifest", None)
    (tmp_path / "ptx").mkdir()
    (tmp_path / "ptx" / "stale-sm80.ptx.xz").write_bytes(b"old")
    args = dict(archs=[(8, 0)], dtypes=("float64",), head_dims=(256,), directions=("backward",),
                jobs=1, ship=True, progress=False)
    report = pc.precompile(**args)
    assert sorted(status for _, status, _ in report) == ["compile", "compile"]
    files = sorted(p.name for p in (tmp_path / "ptx").glob("*.ptx.xz"))
    assert len(files) == 2 and "stale-sm80.ptx.xz" not in files
    import lzma
    for name in files:
        assert lzma.decompress((tmp_path / "ptx" / name).read_bytes()).decode().count(
            ".version 7.0") == 1
    entries = prebuilt.manifest()["entries"]
    assert len(entries) == 2 and all(e["ccs"] == [[8, 0]] for e in entries.values())
    again = pc.precompile(**args)
    assert sorted(status for _, status, _ in again) == ["cached", "cached"]
    assert sorted(p.name for p in (tmp_path / "ptx").glob("*.ptx.xz")) == files


def test_explain_says_loaded_only_for_the_argument_types_loaded():
    """cuda.row's backward runs one Kernel on float16 arrays and on bfloat16's float32 copies
    (float32 inputs take their own two-level sums): a load for one must not make explain call
    the other loaded."""
    plans = {dt: planner._choose(StandIn(64, dt, direction="backward"), "cuda", "row",
                                 device=Device.of_arch((9, 0))) for dt in ("float16", "bfloat16")}
    (k16, s16), _ = plans["float16"].compiled_kernels()
    (k32, s32), _ = plans["bfloat16"].compiled_kernels()
    assert k16 is k32 and s16 != s32
    args = [np.zeros((1, 1, 1, 1), np.float16)] * 4 + [np.zeros((1, 1, 1), np.float32)] * 2 + \
        [np.zeros((1, 1, 1, 1), np.float32)] * 2 + [0.5, 1, 0]
    assert launch._signature_key(args) == launch._argtypes_key(s16)
    k16._loaded[(launch._signature_key(args), (9, 0), 0)] = object()
    try:
        assert k16.loaded_for(s16, (9, 0)) and not k16.loaded_for(s32, (9, 0))
        assert not k16.loaded_for(s16, (8, 0))
    finally:
        k16._loaded.clear()


def test_the_common_set_plans_without_ml_dtypes():
    """Planning the common set names bfloat16 by its name: a process without ml_dtypes (numpy
    alone cannot parse "bfloat16") still lists every kernel and its argument types."""
    code = """
import sys
sys.modules["ml_dtypes"] = None   # as if it were not installed
import numpy as np
try:
    np.dtype("bfloat16")
    raise SystemExit("numpy parsed bfloat16: ml_dtypes is registered in this process")
except TypeError:
    pass
from numflash.precompile import COMMON, targets
found = targets(COMMON["archs"], COMMON["dtypes"], COMMON["head_dims"], COMMON["directions"])
print(sum(1 for _, _, _, plan in found if plan.dtype == "bfloat16"), len(found))
"""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    bf16, total = map(int, proc.stdout.split())
    assert bf16 > 0 and total == len(common_targets())
