"""What each kernel supports, how "auto" chooses, and why a kernel cannot take an input, in words.

Every kernel is declared here as data (like xformers' fmha operators), so ``explain`` can say
why each one was or was not chosen without importing or compiling any of them.
"""
from dataclasses import dataclass, field
import importlib

from .device import Device, Unsupported, simulator_enabled  # noqa: F401 (kernels' and tests' names)
from .inputs import IEEE_REASON

BACKENDS = ("auto", "cpu", "cuda")
ALGORITHMS = ("auto", "block", "row", "mma")


@dataclass(frozen=True)
class KernelSpec:
    name: str
    backend: str
    algorithm: str
    module: str  # defines config(problem, device) -> dict (or raises Unsupported) and
    #              run(problem, config, device) -> lse
    dtypes: tuple
    max_head_dim: int = None         # for both d and dv
    min_cc: tuple = None
    runs_in_simulator: bool = True
    summary: str = ""
    tf32: bool = False               # float32 on tensor cores: 3xTF32, or one tf32 mma per
    #                                  product with precision="tf32"; not precision="ieee"
    direction: str = "forward"       # "backward": run() fills problem.dq, dk, dv
    mods: bool = False               # takes score / mask modifications (numflash.mods)

    def why_not(self, problem, device):
        """None if this kernel can run the problem on the device, else the reason in words."""
        dt = problem.dtype_name
        mods = getattr(problem, "mods", None)
        if mods is not None and not self.mods:
            return (f"{self.name} does not take score/mask modifications yet ({mods}); the CPU "
                    f"path (cpu.tiled, NumPy arrays) does")
        precision = getattr(problem, "precision", "auto")
        if precision == "tf32" and not self.tf32:
            return (f"{self.name} computes in exact {dt}; precision='tf32' runs on cuda.mma only "
                    f"(CuPy float32 arrays, compute capability >= 8.0)")
        if self.tf32 and dt == "float32" and precision == "ieee":
            return IEEE_REASON
        if dt not in self.dtypes:
            return f"{self.name} takes {', '.join(self.dtypes)}, not {dt}"
        B, H, Nq, Nk, d, dv = problem.shape
        if self.max_head_dim is not None and max(d, dv) > self.max_head_dim:
            return (f"{self.name} takes head dims up to {self.max_head_dim} (d={d}, dv={dv}); "
                    f"the CPU path takes any head dim")
        if self.backend == "cuda":
            if device.simulator and not self.runs_in_simulator:
                return (f"{self.name} uses inline PTX, which numba's CUDA simulator cannot run; "
                        f"unset NUMBA_ENABLE_CUDASIM and run on a GPU, or use algorithm='block'")
            if self.min_cc and device.cc is not None and device.cc < self.min_cc:
                return (f"{self.name} needs compute capability >= {self.min_cc[0]}.{self.min_cc[1]}; "
                        f"{device.name} is {device.cc[0]}.{device.cc[1]}")
        return None


KERNELS = (
    KernelSpec("cuda.mma", "cuda", "mma", "numflash.cuda.mma",
               dtypes=("float16", "bfloat16", "float32", "float64"), max_head_dim=256,
               min_cc=(8, 0), runs_in_simulator=False, tf32=True,
               summary="FlashAttention-2 on tensor cores: mma.sync m16n8k16, register online "
                       "softmax, cp.async double-buffered K/V, ldmatrix; float64 (d <= 128, 64 on "
                       "sm_8x) on float64 mma.sync; float32 (d <= 128, cc 8.0 / 9.0) as 3xTF32 "
                       "on m16n8k8 tf32, or one tf32 mma per product with precision='tf32'"),
    KernelSpec("cpu.tiled", "cpu", "block", "numflash.cpu.tiled",
               dtypes=("float16", "float32", "float64"), mods=True,
               summary="numba.njit block-tiled online softmax, parallel over (batch, head, query block)"),
    KernelSpec("cuda.block", "cuda", "block", "numflash.cuda.block",
               dtypes=("float16", "float32", "float64"), max_head_dim=256,
               summary="block-tiled: Q blocks across the grid, K/V tiles in shared memory, "
                       "register micro-tiles, online softmax per row"),
    KernelSpec("cuda.row", "cuda", "row", "numflash.cuda.row",
               dtypes=("float16", "float32", "float64"), max_head_dim=256,
               summary="FA1 per-row: one thread owns one query row, K/V tiles in shared memory"),
)

BACKWARD_KERNELS = (
    KernelSpec("cpu.tiled", "cpu", "block", "numflash.cpu.backward",
               dtypes=("float16", "float32", "float64"), direction="backward", mods=True,
               summary="numba.njit FlashAttention-2 backward: parallel over (batch, head, key-block "
                       "split), P recomputed from lse tile by tile, dQ per split summed in a "
                       "fixed order (always deterministic)"),
    KernelSpec("cuda.row", "cuda", "row", "numflash.cuda.row_backward",
               dtypes=("float16", "bfloat16", "float32", "float64"), max_head_dim=256,
               direction="backward",
               summary="FMA FlashAttention-2 backward, one thread a row: a key pass (dK, dV) and a "
                       "query pass (dQ) that recomputes S, no atomics (always deterministic)"),
)

# "auto" tries these in order and takes the first that can run the problem.
AUTO_ORDER = {
    "forward": {"cpu": ("cpu.tiled",), "cuda": ("cuda.mma", "cuda.block", "cuda.row")},
    "backward": {"cpu": ("cpu.tiled",), "cuda": ("cuda.row",)},
}

_SPECS = {"forward": {s.name: s for s in KERNELS},
          "backward": {s.name: s for s in BACKWARD_KERNELS}}


def kernel_specs(direction="forward"):
    return _SPECS[direction]


@dataclass
class Plan:
    """What attention() will run: the kernel, its tile config, and why every other one was not chosen."""
    backend: str
    algorithm: str
    kernel: str
    device: Device
    config: dict = field(default_factory=dict)
    rejected: dict = field(default_factory=dict)  # kernel name -> reason in words
    direction: str = "forward"
    mods: str = ""  # the modifications compiled into the kernel, in words
    dtype: str = ""  # the inputs' dtype name (which compiled variants the config launches)

    def compiled_kernels(self):
        """[(Kernel, numba argument types)] that running this plan launches (CUDA plans)."""
        if self.backend != "cuda":
            return []
        module = importlib.import_module(kernel_specs(self.direction)[self.kernel].module)
        return module.compiled_kernels(self.config, self.dtype)

    def cache_status(self):
        """Where the plan's kernels get their code on first use in a process, in words; None
        where nothing is compiled for a GPU (the CPU path, the simulator)."""
        if self.backend != "cuda" or self.device.cc is None:
            return None
        words = {"cached": "cached on disk (loads in milliseconds)",
                 "prebuilt": "shipped PTX (links in about a second, then cached)",
                 "compile": "not cached: compiles from source on first use (5-60 s; python -m "
                            "numflash.precompile compiles ahead)"}
        loaded = [k.loaded_for(sig, self.device.cc) for k, sig in self.compiled_kernels()]
        if all(loaded):
            return "loaded in this process"
        return "; ".join(f"{k.name}: {words[k.status(sig, self.device.cc)]}"
                         for k, sig in self.compiled_kernels())

    def __str__(self):
        cfg = ", ".join(f"{k}={v}" for k, v in self.config.items())
        what = "" if self.direction == "forward" else " backward"
        lines = [f"numflash{what} plan: {self.kernel} (backend={self.backend!r}, "
                 f"algorithm={self.algorithm!r}) on {self.device.name}",
                 f"  config: {cfg or '-'}"]
        cache = self.cache_status()
        if cache:
            lines.append(f"  kernel cache: {cache}")
        if self.mods:
            lines.append(f"  modifications: {self.mods} (compiled into the kernel on first use "
                         f"in a process, a few seconds, not cached on disk)")
        for name, why in self.rejected.items():
            lines.append(f"  not {name}: {why}")
        return "\n".join(lines)

    def run(self, problem):
        module = importlib.import_module(kernel_specs(self.direction)[self.kernel].module)
        return module.run(problem, self.config, self.device)


_device_cache = {}


def _cuda_device(problem):
    if simulator_enabled():
        return Device(name="numba CUDA simulator", simulator=True)
    dev_id = problem.q.device.id
    if dev_id not in _device_cache:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(dev_id)
        cc = (int(props["major"]), int(props["minor"]))
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        _device_cache[dev_id] = Device(name=f"{name} (cc {cc[0]}.{cc[1]})", cc=cc,
                                       smem_per_block_optin=int(props["sharedMemPerBlockOptin"]))
    return _device_cache[dev_id]


def _cuda_unavailable(problem):
    """Why the CUDA backend cannot take these arrays at all, or None."""
    if not problem.on_device and not simulator_enabled():
        return ("backend='cuda' got NumPy arrays: pass CuPy arrays (cupy.asarray), or set "
                "NUMBA_ENABLE_CUDASIM=1 to run the CUDA kernels in numba's simulator")
    if problem.on_device and simulator_enabled():
        return ("NUMBA_ENABLE_CUDASIM=1 is set, so numba cannot launch on the GPU: unset it to run "
                "CuPy arrays, or pass NumPy arrays to the simulator")
    try:
        importlib.import_module("numba.cuda")
    except ImportError as e:
        return f"numba-cuda is not installed ({e}): pip install 'numflash[cuda13]' or '[cuda12]'"
    return None


_plans = {}


def choose(problem, backend="auto", algorithm="auto"):
    """The Plan for a normalized problem; raises ValueError (with every reason) if none can run it.

    Plans depend only on array kind, dtype, precision, shape, strides, 16-byte alignment, device,
    the modifications and the two choices, so they are memoized on those: a repeated call skips
    straight to the kernel.
    """
    arrays = (problem.q, problem.k, problem.v)
    mods = getattr(problem, "mods", None)
    key = (None if mods is None else (mods.key(), str(mods)),  # a kernel may refuse mods
           getattr(problem, "direction", "forward"), backend, algorithm,
           getattr(problem, "precision", "auto"), problem.kind, problem.dtype,
           problem.shape, simulator_enabled(),
           tuple(a.strides for a in arrays),  # configs may depend on layout (mma's vector path)
           (problem.q.device.id, tuple(a.data.ptr % 16 for a in arrays))
           if problem.on_device else None)
    plan = _plans.get(key)
    if plan is None:
        plan = _choose(problem, backend, algorithm)
        if len(_plans) > 1024:
            _plans.clear()
        _plans[key] = plan
    return plan


def _choose(problem, backend, algorithm, device=None):
    """``device``: plan for this Device instead of the arrays' (numflash.precompile plans for
    GPUs it does not have)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}; got {algorithm!r}")
    if backend == "auto":
        backend = "cuda" if problem.on_device else "cpu"

    direction = getattr(problem, "direction", "forward")
    rejected = {}
    if backend == "cpu" and getattr(problem, "precision", "auto") == "tf32":
        raise ValueError("precision='tf32' runs on tensor cores (cuda.mma): pass CuPy float32 "
                         "arrays on a GPU of compute capability >= 8.0; the CPU path computes in "
                         "exact float32 (precision='auto')")
    if backend == "cpu":
        if problem.on_device:
            raise ValueError("backend='cpu' got device (CuPy) arrays: numflash never copies "
                             "behind your back; use backend='cuda', or move the arrays to the "
                             "host with .get()")
        device = Device(name="CPU")
    elif device is None:
        why = _cuda_unavailable(problem)
        if why:
            raise ValueError(why)
        device = _cuda_device(problem)

    specs = kernel_specs(direction)
    chosen = None
    for name in AUTO_ORDER[direction][backend]:
        spec = specs.get(name)
        if spec is None:
            rejected[name] = "not built yet"
            continue
        if algorithm != "auto" and spec.algorithm != algorithm:
            rejected[name] = f"algorithm={algorithm!r} was asked for"
            continue
        why = spec.why_not(problem, device)
        if why is None and chosen is None:
            try:
                config = importlib.import_module(spec.module).config(problem, device)
                chosen = spec
            except Unsupported as e:
                why = str(e)
        if why is not None:
            rejected[name] = why
        elif chosen is not spec:
            rejected[name] = f"{chosen.name} comes first for 'auto'"
    for spec in specs.values():  # kernels of the other backend, for a complete explanation
        if spec.backend != backend:
            rejected.setdefault(spec.name, f"backend={backend!r}")

    if chosen is None:
        asked = f"algorithm={algorithm!r} on backend={backend!r}"

        if backend == "cpu" and algorithm in ("row", "mma"):
            raise ValueError(f"{asked} does not exist: the CPU path implements the block-tiled "
                             f"loop only (algorithm='block' or 'auto')")
        reasons = "; ".join(f"{n}: {w}" for n, w in rejected.items()
                            if specs.get(n) is not None and specs[n].backend == backend)
        raise ValueError(f"no numflash kernel can run {asked} for these inputs: {reasons}")

    mods = getattr(problem, "mods", None)
    return Plan(backend=backend, algorithm=chosen.algorithm, kernel=chosen.name, device=device,
                config=config, rejected=rejected, direction=direction,
                mods="" if mods is None else str(mods), dtype=problem.dtype_name)

