"""`python -m numflash.precompile`: compile the CUDA kernels your configurations will use, ahead
of the first call, into the kernel cache (numflash/cuda/launch.py), in parallel processes, with a
progress bar. Needs numba-cuda, not a GPU (give --arch on a machine without one).

A first call otherwise compiles its kernels from the Python source: numba typing and lowering
plus NVVM, 5-60 s per variant (bench/RESULTS.md). The common configurations ship as PTX inside
the package (numflash/cuda/prebuilt.py) and link in about a second; `--ship` is the maintainers'
command that makes those files again after a kernel source changes.

    python -m numflash.precompile                       # the common set, for this machine's GPUs
    python -m numflash.precompile --dtype float64 --d 96 --arch 80,90
"""
import argparse
import concurrent.futures as futures
import multiprocessing
import os
import sys
import time

#: What ships as PTX and what precompile compiles by default: the configurations most models use.
COMMON = {"dtypes": ("float16", "bfloat16", "float32"), "head_dims": (64, 128),
          "directions": ("forward", "backward"), "archs": ((8, 0), (9, 0))}


class _Dtype:
    def __init__(self, name, itemsize):
        self.name, self.itemsize = name, itemsize


class _DeviceArray:
    """Shape, dtype, strides and a 16-byte aligned address: what the planners read."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.itemsize = shape, dtype, dtype.itemsize
        self.ndim = len(shape)
        self.strides = tuple(
            _prod(shape[i + 1:]) * dtype.itemsize for i in range(len(shape)))
        self.data = type("Ptr", (), {"ptr": 0})()


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


class StandIn:
    """Just enough of an inputs.Problem to plan one: contiguous, aligned (B, H, N, d) device
    arrays, as most callers pass (so cuda.mma takes its 16-byte cp.async path)."""

    def __init__(self, d, dtype, dv=None, direction="forward", precision="auto"):
        dv = d if dv is None else dv
        itemsize = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[dtype]
        self.dtype, self.dtype_name = _Dtype(dtype, itemsize), dtype
        self.shape = (1, 1, 128, 128, d, dv)
        self.q = self.k = _DeviceArray((1, 1, 128, d), self.dtype)
        self.v = _DeviceArray((1, 1, 128, dv), self.dtype)
        self.on_device, self.kind, self.precision = True, "cupy", precision
        self.direction, self.mods, self.deterministic = direction, None, False


def targets(archs, dtypes, head_dims, directions):
    """[(Kernel, argument types, cc, plan)]: every kernel variant that calls with these dtypes,
    head dims (d = dv) and directions would launch on these architectures, as "auto" plans them
    (causal or not, any sequence length: those are runtime arguments of one variant)."""
    from . import plan as planner
    from .device import Device
    out, seen = [], set()
    for cc in archs:
        device = Device.of_arch(cc)
        for direction in directions:
            for dt in dtypes:
                for d in head_dims:
                    problem = StandIn(d, dt, direction=direction)
                    try:
                        plan = planner._choose(problem, "cuda", "auto", device=device)
                    except ValueError:  # nothing runs it there (explain says why): nothing to do
                        continue
                    for kernel, sig in plan.compiled_kernels():
                        key = (kernel.name, tuple(sorted(kernel.config.items())), str(sig), cc)
                        if key not in seen:
                            seen.add(key)
                            out.append((kernel, sig, tuple(cc), plan))
    return out


def _build_one(name, config, module, factory_name, sig, cc, ship):
    """In a worker process: build one variant into the cache (or, shipping, make its PTX)."""
    import importlib
    from .cuda import launch, prebuilt
    factory = getattr(importlib.import_module(module), factory_name)
    kernel = launch.get_kernel(name, factory, config)
    t = time.perf_counter()
    if ship:
        ptx = prebuilt.portable(launch.kernel_ptx(kernel.pyfunc, sig, cc, kernel.fastmath), cc)
        return kernel.prebuilt_key(sig), ptx, time.perf_counter() - t
    kernel.build(sig, cc, quiet=True)
    return None, None, time.perf_counter() - t


def _progress(total, desc):
    """A tqdm bar if tqdm is installed, else one line per finished item."""
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit="kernel", file=sys.stderr)
    except ImportError:
        class Lines:
            n = 0

            def update(self, k=1):
                self.n += k
                print(f"{desc}: {self.n}/{total}", file=sys.stderr, flush=True)

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass
        return Lines()


def precompile(archs=None, dtypes=COMMON["dtypes"], head_dims=COMMON["head_dims"],
               directions=COMMON["directions"], jobs=None, ship=False, progress=True):
    """Compile every variant those calls would launch that the cache does not hold yet (with
    ``ship``: into the package's shipped PTX, every variant whose current source is not shipped
    yet). Returns [(description, status before, seconds)]."""
    from .cuda import launch, prebuilt
    if archs is None:
        archs = visible_archs() or COMMON["archs"]
    todo, report, keep = [], [], []
    for kernel, sig, cc, plan in targets(archs, dtypes, head_dims, directions):
        about = launch.describe(kernel.name, kernel.config, cc, sig)
        if ship:  # only what is not shipped for its current source yet
            path = prebuilt.find(kernel.prebuilt_key(sig), cc)
            status = "cached" if path and path.name.endswith(
                f"sm{cc[0]}{cc[1]}.ptx.xz") else "compile"
            if status == "cached":
                keep.append((kernel.prebuilt_key(sig), cc))
        else:
            status = kernel.status(sig, cc)
        if status == "cached":
            report.append((about, status, 0.0))
        else:
            todo.append((kernel, sig, cc, about, status))
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo) or 1))
    bar = _progress(len(todo), "numflash precompile") if progress else None
    shipped = []
    # spawn: fresh workers that import numba themselves (a fork of a process that already
    # started numba's threads is not safe); they compile for real GPUs, never in the simulator,
    # so the variable they inherit is set to 0 while the pool runs.
    simulator = os.environ.get("NUMBA_ENABLE_CUDASIM")
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    try:
        report += _run_pool(todo, jobs, ship, bar, shipped)
    finally:
        if simulator is None:
            del os.environ["NUMBA_ENABLE_CUDASIM"]
        else:
            os.environ["NUMBA_ENABLE_CUDASIM"] = simulator
    if bar is not None:
        bar.close()
    if ship:
        import numba_cuda
        prebuilt.write(shipped, keep, getattr(numba_cuda, "__version__", "?"))
    return report


def _run_pool(todo, jobs, ship, bar, shipped):
    from .cuda import launch
    report = []
    with futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        running = {pool.submit(_build_one, k.name, k.config, k.factory.__module__,
                               k.factory.__name__, sig, cc, ship): (k, sig, cc, about, status)
                   for k, sig, cc, about, status in todo}
        for done in futures.as_completed(running):
            k, sig, cc, about, status = running[done]
            key, ptx, seconds = done.result()
            report.append((about, status, seconds))
            if ship:
                shipped.append((key, cc, ptx, launch.describe(k.name, k.config, None, sig)))
            if bar is not None:
                bar.set_postfix_str(about[:60])
                bar.update(1)
    return report


def visible_archs():
    """The compute capabilities of this machine's GPUs ([] without a GPU or CuPy)."""
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
        return sorted({tuple(int(x) for x in cupy.cuda.Device(i).compute_capability)
                       for i in range(n)})
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no GPU: the caller picks archs
        return []


def _csv(kind):
    return lambda text: tuple(kind(x) for x in text.split(",") if x)


def _arch(text):
    text = text.strip().replace("sm_", "").replace(".", "")
    return int(text[0]), int(text[1:])


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m numflash.precompile",
        description="Compile the CUDA kernels that calls with these dtypes and head dims will "
                    "launch (causal or not, any length), ahead of the first call, into the "
                    "kernel cache (NUMFLASH_CACHE_DIR, default ~/.cache/numflash). Needs "
                    "numba-cuda (pip install 'numflash[cuda13]' or '[cuda12]'), not a GPU.")
    ap.add_argument("--dtype", type=_csv(str), default=COMMON["dtypes"],
                    help="comma-separated: float16, bfloat16, float32, float64 "
                         "(default float16,bfloat16,float32)")
    ap.add_argument("--d", type=_csv(int), default=COMMON["head_dims"],
                    help="comma-separated head dims (default 64,128)")
    ap.add_argument("--direction", type=_csv(str), default=COMMON["directions"],
                    help="forward, backward or both (default both)")
    ap.add_argument("--arch", type=_csv(_arch), default=None,
                    help="comma-separated compute capabilities, e.g. 80,90 (default: this "
                         "machine's GPUs; without one, 80,90)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel processes (default: cores)")
    ap.add_argument("--ship", action="store_true",
                    help="maintainers: remake the PTX shipped in numflash/cuda/ptx for the "
                         "common set (after a kernel source changed)")
    args = ap.parse_args(argv)
    if args.ship:
        args.arch = args.arch or COMMON["archs"]
    bad = [d for d in args.dtype if d not in ("float16", "bfloat16", "float32", "float64")]
    if bad:
        ap.error(f"--dtype: {', '.join(bad)} is not one of float16, bfloat16, float32, float64")
    bad = [d for d in args.direction if d not in ("forward", "backward")]
    if bad:
        ap.error(f"--direction: {', '.join(bad)} is not forward or backward")
    import importlib.util
    if importlib.util.find_spec("numba_cuda") is None:
        ap.error("numba-cuda is not installed: pip install 'numflash[cuda13]' (or '[cuda12]')")
    t = time.perf_counter()
    report = precompile(args.arch, args.dtype, args.d, args.direction, args.jobs, args.ship)
    for about, status, seconds in sorted(report):
        how = "linked from shipped PTX" if status == "prebuilt" else "compiled"
        done = "already shipped" if args.ship else "already cached"
        what = done if status == "cached" else f"{how} in {seconds:.1f} s"
        print(f"{about}: {what}")
    print(f"{len(report)} kernel variants ready in {time.perf_counter() - t:.1f} s"
          + ("" if args.ship else f" (cache: {_cache_dir()})"))
    return 0


def _cache_dir():
    from .cuda.launch import cache_dir
    return cache_dir()


if __name__ == "__main__":
    sys.exit(main())
