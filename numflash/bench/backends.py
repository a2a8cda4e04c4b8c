"""Where the benchmark runs: the CPU backend (numba CPU path against NumPy naive attention) and the
CUDA backend (numflash's CUDA algorithms against CuPy naive attention), each with torch SDPA when
torch is importable. A backend describes its device, makes the input sets, times one call, probes
peak memory, and lists the methods of a row."""
import gc
import os
import platform
import re
import tracemalloc

import numpy as np

from .baselines import causal_hidden, cupy_bmm_half, naive_attention, plain_naive_attention
from .checks import gradient_check
from .failures import first_line
from .methods import Method, numflash_backward_methods, numflash_methods, selected
from .peers import torch_sdpa_backward_methods, torch_sdpa_methods, try_torch
from .report import base_versions
from .timing import CudaEventTimer, HostTimer, proc_jiffies


def slug(text, maxlen=40):
    """A file-name-safe lower-case version of a device name."""
    text = re.sub(r"\((R|TM|tm|r)\)", "", text)
    text = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()
    return text[:maxlen].strip("-") or "device"


def _available_memory():
    """Free physical memory in bytes (None where the OS does not say): naive's S must fit."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _peak_hook_class(cupy):
    """A CuPy MemoryHook class (made here, since CuPy is imported only on a GPU)."""
    class PeakHook(cupy.cuda.MemoryHook):
        """Records the CuPy pool's high-water mark of used bytes."""
        name = "numflash_bench_peak"

        def __init__(self, pool):
            super().__init__()
            self.pool = pool
            self.peak = 0
            self.calls = 0

        def malloc_postprocess(self, **kwargs):
            self.calls += 1
            self.peak = max(self.peak, self.pool.used_bytes())
    return PeakHook


class CpuBackend:
    """The numba CPU path against NumPy naive attention (and torch SDPA on the CPU)."""
    name = "cpu"
    timer = HostTimer.description

    def __init__(self, torch=None, torch_missing=None):
        self.torch = torch
        self.torch_missing = torch_missing
        self.timed = HostTimer()  # fn -> (output, ms, host ms)

    def device(self):
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        return f"{name} ({os.cpu_count()} logical cores)", "cpu-" + slug(name, 30)

    def info(self):
        import numba
        out = {"cores": os.cpu_count(), "numba threads": numba.get_num_threads()}
        try:
            with open("/sys/fs/cgroup/cpu.max") as f:
                quota = f.read().split()
            if quota and quota[0] != "max":
                out["cgroup CPU quota (cores)"] = round(int(quota[0]) / int(quota[1]), 2)
        except (OSError, ValueError, IndexError):
            pass
        if hasattr(os, "getloadavg"):
            out["load average at start (1/5/15 min)"] = [round(x, 2) for x in os.getloadavg()]
        return out

    def versions(self):
        v = base_versions()
        v["torch"] = self.torch.__version__ if self.torch else f"not importable ({self.torch_missing})"
        v["cupy"] = "not used on the CPU path"
        return v

    def cache_bytes(self):
        try:
            with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
                text = f.read().strip()
            mult = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(text[-1].upper(), 1)
            return int(text.rstrip("KMGkmg")) * mult
        except (OSError, ValueError):
            return 32 * 1024 ** 2

    def make_sets(self, cfg, n, seed):
        rng = np.random.default_rng(seed)
        shapes = ((cfg.B, cfg.H, cfg.Nq, cfg.d), (cfg.B, cfg.H, cfg.Nk, cfg.d),
                  (cfg.B, cfg.H, cfg.Nk, cfg.d))
        return [tuple(rng.standard_normal(s, dtype=np.float32).astype(cfg.dtype) for s in shapes)
                for _ in range(n)]

    def load_probe(self):
        return proc_jiffies()

    def peak(self, method, fn):
        """Peak bytes NumPy allocates during one call (tracemalloc; numba's own scratch unseen)."""
        gc.collect()
        started = not tracemalloc.is_tracing()
        if started:
            tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            out = fn()
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            if started:
                tracemalloc.stop()
        del out
        return {"peak_bytes": float(peak), "peak_how": "tracemalloc (NumPy allocations)"}

    def to_host(self, a):
        if isinstance(a, np.ndarray):
            return a
        if type(a).__module__.startswith("torch"):
            return a.detach().contiguous().cpu().numpy()
        return np.asarray(a)

    def cleanup(self):
        gc.collect()

    def methods(self, cfg, sets, patterns, suite_defaults):
        nf, skipped = numflash_methods(cfg, sets, "cpu", patterns,
                                       default_algorithms=suite_defaults.get("algorithms"))
        methods = list(nf)
        peer_patterns = patterns if patterns is not None else suite_defaults.get("peers")
        if selected("numpy-naive", peer_patterns):
            hidden = causal_hidden(np, cfg.Nq, cfg.Nk) if cfg.causal else None
            need = cfg.B * cfg.H * cfg.Nq * cfg.Nk * np.dtype(cfg.dtype).itemsize
            avail = _available_memory()

            def call(i):
                if avail is not None and need > 0.8 * avail:
                    raise MemoryError(f"not attempted: S alone needs {need / 2**30:.1f} GiB of "
                                      f"{avail / 2**30:.1f} GiB available")
                q, k, v = sets[i]
                return naive_attention(np, q, k, v, cfg.scale, hidden)
            methods.append(Method("numpy-naive", "peer", call, io="standard"))
        if self.torch is not None:
            tsets = [tuple(self.torch.from_numpy(np.ascontiguousarray(a)) for a in s)
                     for s in sets]
            tm, tskip = torch_sdpa_methods(self.torch, tsets, cfg, peer_patterns)
            methods += tm
            skipped.update(tskip)
        return methods, skipped


class CudaBackend:
    """numflash's CUDA algorithms against CuPy naive attention and torch SDPA on one GPU."""
    name = "cuda"

    def __init__(self, cupy, torch=None, torch_missing=None):
        self.cp = cupy
        self.torch = torch
        self.torch_missing = torch_missing
        self.pool = cupy.get_default_memory_pool()
        self.timed = CudaEventTimer("cupy")  # fn -> (output, event ms, host ms)
        self.timer = self.timed.description
        self.props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        self.PeakHook = _peak_hook_class(cupy)

    def device(self):
        name = self.props["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        return name, slug(name)

    def info(self):
        p, rt = self.props, self.cp.cuda.runtime
        out = {"compute capability": f"{p['major']}.{p['minor']}",
               "memory GiB": round(p["totalGlobalMem"] / 2 ** 30, 1),
               "memory bytes": int(p["totalGlobalMem"]),
               "L2 bytes": int(p.get("l2CacheSize", 0)),
               "SMs": int(p.get("multiProcessorCount", 0)),
               "shared memory per block (opt-in)": int(p.get("sharedMemPerBlockOptin", 0)),
               "CUDA runtime": rt.runtimeGetVersion(), "CUDA driver": rt.driverGetVersion(),
               "CUPY_TF32": os.environ.get("CUPY_TF32", "unset")}
        if self.torch is not None:
            out["torch allow_tf32 (matmul)"] = bool(self.torch.backends.cuda.matmul.allow_tf32)
        return out

    def versions(self):
        v = base_versions()
        v["cupy"] = self.cp.__version__
        v["torch"] = self.torch.__version__ if self.torch else f"not importable ({self.torch_missing})"
        return v

    def cache_bytes(self):
        return int(self.props.get("l2CacheSize", 50 * 1024 ** 2))

    def make_sets(self, cfg, n, seed):
        cp = self.cp
        rs = cp.random.RandomState(seed)
        shapes = ((cfg.B, cfg.H, cfg.Nq, cfg.d), (cfg.B, cfg.H, cfg.Nk, cfg.d),
                  (cfg.B, cfg.H, cfg.Nk, cfg.d))
        sets = [tuple(rs.standard_normal(s, dtype=cp.float32).astype(cfg.dtype) for s in shapes)
                for _ in range(n)]
        cp.cuda.Device().synchronize()
        return sets

    def peak(self, method, fn):
        """Peak device bytes of one call above what was live before it.

        CuPy pool: the high-water mark of used bytes, from a MemoryHook (the pool's total_bytes()
        growth is kept as a cross-check); torch methods: torch.cuda.max_memory_allocated.
        Allocations outside both allocators are not seen.
        """
        cp, pool = self.cp, self.pool
        gc.collect()
        pool.free_all_blocks()
        cp.cuda.Device().synchronize()
        base_used, base_total = pool.used_bytes(), pool.total_bytes()
        torch_base = None
        if self.torch is not None and method.memory == "torch":
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            torch_base = self.torch.cuda.memory_allocated()
        hook = self.PeakHook(pool)
        with hook:
            out = fn()
            cp.cuda.Device().synchronize()
        del out
        res = {"pool_total_growth_bytes": float(pool.total_bytes() - base_total),
               "hook_mallocs": hook.calls}
        if hook.calls:
            peak, how = float(max(0, hook.peak - base_used)), "CuPy pool high-water mark (hook)"
        else:
            peak, how = res["pool_total_growth_bytes"], "CuPy pool total_bytes growth"
        if torch_base is not None:
            self.torch.cuda.synchronize()
            tpeak = float(self.torch.cuda.max_memory_allocated() - torch_base)
            res["torch_peak_bytes"] = tpeak
            peak, how = peak + tpeak, "torch max_memory_allocated + CuPy pool"
        res.update(peak_bytes=peak, peak_how=how)
        return res

    def to_host(self, a):
        if isinstance(a, np.ndarray):
            return a
        if type(a).__module__.startswith("torch"):
            return a.detach().contiguous().cpu().numpy()
        return self.cp.ascontiguousarray(a).get()

    def cleanup(self):
        gc.collect()
        self.cp.cuda.Device().synchronize()
        self.pool.free_all_blocks()
        self.cp.get_default_pinned_memory_pool().free_all_blocks()
        if self.torch is not None:
            self.torch.cuda.empty_cache()

    def methods(self, cfg, sets, patterns, suite_defaults):
        cp = self.cp
        nf, skipped = numflash_methods(cfg, sets, "cuda", patterns,
                                       default_algorithms=suite_defaults.get("algorithms"))
        methods = list(nf)
        peer_patterns = patterns if patterns is not None else suite_defaults.get("peers")
        if selected("cupy-naive", peer_patterns):
            state = {}

            def call(i):
                if cfg.causal and "hidden" not in state:  # built once, outside the timed calls
                    state["hidden"] = causal_hidden(cp, cfg.Nq, cfg.Nk)
                q, k, v = sets[i]
                return naive_attention(cp, q, k, v, cfg.scale, state.get("hidden"), bmm)
            bmm = ((lambda a, b, trans_b: cupy_bmm_half(cp, a, b, trans_b))
                   if cfg.dtype == "float16" else None)
            methods.append(Method("cupy-naive", "peer", call, io="standard",
                                  info={"matmul": "cuBLAS strided-batched GEMM, float16 in/out, "
                                                  "float32 accumulation" if bmm else "cupy.matmul",
                                        "mask": "(Nq, Nk) bool, built in the first warm-up call"
                                        if cfg.causal else None}))
        if selected("cupy-naive-plain", peer_patterns):
            plain_state = {}

            def call_plain(i):
                if cfg.causal and "hidden" not in plain_state:
                    plain_state["hidden"] = causal_hidden(cp, cfg.Nq, cfg.Nk)
                q, k, v = sets[i]
                return plain_naive_attention(cp, q, k, v, cfg.scale, plain_state.get("hidden"))
            methods.append(Method("cupy-naive-plain", "peer", call_plain, io="standard",
                                  info={"matmul": "cupy.matmul", "softmax": "textbook, "
                                        "out of place, in the input dtype"}))
        if self.torch is not None:
            tsets = [tuple(self.torch.from_dlpack(a) for a in s) for s in sets]
            tm, tskip = torch_sdpa_methods(self.torch, tsets, cfg, peer_patterns)
            methods += tm
            skipped.update(tskip)
        return methods, skipped


def detect_backend(choice):
    """(backend, why): CudaBackend when CuPy sees a device (unless choice == 'cpu'), else CPU."""
    why = None
    if choice in ("auto", "cuda"):
        if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
            why = "NUMBA_ENABLE_CUDASIM is set (numba cannot launch on a GPU)"
        else:
            try:
                import cupy
                if cupy.cuda.runtime.getDeviceCount() < 1:
                    why = "CuPy sees no CUDA device"
            except Exception as e:  # noqa: BLE001
                why = f"CuPy is not usable ({type(e).__name__}: {first_line(e)})"
        if why is None:
            torch, torch_missing = try_torch()
            return CudaBackend(cupy, torch, torch_missing), None
        if choice == "cuda":
            raise SystemExit(f"--backend cuda: {why}")
    torch, torch_missing = try_torch()
    return CpuBackend(torch, torch_missing), why


def backward_methods(backend, cfg, sets, patterns, torch=None):
    """The backward suite: numflash's backward kernels (every algorithm explain() takes), torch
    SDPA's backward per backend, and on the CPU the naive backward in NumPy. Each call returns
    (dq, dk, dv) for output gradient dos[i] (the next set's q: independent, same shape). The
    forward each backward needs (numflash's o and lse, torch's autograd graph) is made here,
    outside the timing, so each timed call is the backward alone. The check compares head (0, 0)
    with the float64 reference gradients (numflash.testing.check_backward).
    """
    from .. import reference
    dos = [sets[(i + 1) % len(sets)][0] for i in range(len(sets))]
    check = gradient_check(cfg, sets, dos, backend.to_host)
    methods, skipped = numflash_backward_methods(cfg, sets, dos, backend.name, patterns, check)
    if backend.name == "cpu" and selected("numpy-naive", patterns):
        def naive(i):
            q, k, v = sets[i]
            return reference.naive_backward(dos[i], q, k, v, scale=cfg.scale, causal=cfg.causal,
                                            dtype=np.dtype(cfg.dtype))
        methods.append(Method("numpy-naive", "peer", naive, check=check))
    if torch is not None:
        peers, peers_skipped = torch_sdpa_backward_methods(torch, cfg, sets, dos, patterns, check)
        methods += peers
        skipped.update(peers_skipped)
    return methods, skipped
