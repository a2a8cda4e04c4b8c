"""How "auto" chooses a kernel for a problem, and why every other kernel was not chosen, in words.

The kernels and what each declares it supports are in kernels.py; the planner walks its FORWARD
or BACKWARD list, asking each operator's declarations first (no import, no compile), then its
kernel module for a config.
"""
from dataclasses import dataclass, field
import importlib

from .device import Device, Unsupported, simulator_enabled  # noqa: F401 (tests' names)
from .kernels import operators

BACKENDS = ("auto", "cpu", "cuda")
ALGORITHMS = ("auto", "block", "row", "mma", "wgmma")


@dataclass
class Plan:
    """What attention() will run: the kernel, its tile config, and why every other one was not chosen."""
    backend: str
    algorithm: str
    kernel: str
    device: Device
    config: dict = field(default_factory=dict)  # a dict, or cuda.mma's MmaConfig (a Mapping)
    rejected: dict = field(default_factory=dict)  # kernel name -> reason in words
    direction: str = "forward"
    mods: str = ""  # the modifications compiled into the kernel, in words
    dtype: str = ""  # the inputs' dtype name (which compiled variants the config launches)
    notes: list = field(default_factory=list)  # the kernel's schedule in words (split-KV)
    dropout: bool = False  # the kernel drops P (numflash.dropout)
    bias_grad: bool = False  # the backward also returns attn_bias's gradient
    mod_args_grad: bool = False  # ... and trainable mod_args' gradients

    @property
    def operator(self):
        return operators(self.direction)[self.kernel]

    def compiled_kernels(self):
        """[(Kernel, numba argument types)] that running this plan launches (CUDA plans)."""
        if self.backend != "cuda":
            return []
        return self.operator.module.compiled_kernels(self.config, self.dtype)

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
        if self.mods and self.backend == "cuda":
            lines.append(f"  modifications: {self.mods} (a window's key tiles outside it are "
                         f"skipped; the others are device functions compiled into the kernel, "
                         f"applied score by score and cached on disk like any kernel (a "
                         f"user's function by its fingerprint; one that reads an object or a "
                         f"module of the user's compiles once per process, 5-60 s); their "
                         f"arrays and scalars are run-time arguments)")
        elif self.mods:
            lines.append(f"  modifications: {self.mods} (compiled into the kernel on first use "
                         f"in a process, a few seconds, not cached on disk)")
        if "block_mask=" in self.mods:
            lines.append("  block mask: the tiles in its EMPTY blocks are skipped" + (
                "; in FULL blocks its mask_mod is not evaluated" if self.backend == "cuda"
                else " (a CPU tile covering only EMPTY blocks); its mask_mod is evaluated in "
                     "the others"))
        if self.dropout:
            lines.append("  dropout: each pair's keep drawn from dropout_seed by Philox-4x32-10 "
                         "(numflash.dropout) in the kernel" + (
                             ", the forward's mask regenerated, never stored"
                             if self.direction == "backward" else "; nothing of size Nq x Nk "
                             "is stored"))
        if self.bias_grad:
            lines.append("  attn_bias gradient: each pair's dS (through the score_mods after the "
                         "bias) summed into an array of the bias's shape in the kernel, nothing "
                         "of size Nq x Nk beyond the bias's own")
        if self.mod_args_grad:
            lines.append("  mod_args gradients: each visible pair's dS times score_mod_args_grad's "
                         "derivative, added at its index" + (
                             " into one float64 copy of the trained arrays a task, summed in a "
                             "fixed order" if self.backend == "cpu" else ""))
        lines += [f"  {note}" for note in self.notes]
        for name, why in self.rejected.items():
            lines.append(f"  not {name}: {why}")
        return "\n".join(lines)

    def run(self, problem):
        return self.operator.module.run(problem, self.config, self.device)


_device_cache = {}


def _cuda_device(problem):
    return device_of(problem.q)


def device_of(array):
    """The Device a CuPy array's kernels run on (numba's simulator when it is on)."""
    if simulator_enabled():
        return Device(name="numba CUDA simulator", simulator=True)
    dev_id = array.device.id
    if dev_id not in _device_cache:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(dev_id)
        cc = (int(props["major"]), int(props["minor"]))
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        _device_cache[dev_id] = Device(name=f"{name} (cc {cc[0]}.{cc[1]})", cc=cc,
                                       smem_per_block_optin=int(props["sharedMemPerBlockOptin"]),
                                       sm_count=int(props["multiProcessorCount"]))
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
    # the backward's dO and O are staged like q, k, v (cuda.mma's cp.async needs them aligned)
    arrays = tuple(a for a in (problem.q, problem.k, problem.v, getattr(problem, "do", None),
                               getattr(problem, "o", None)) if a is not None)
    mods = getattr(problem, "mods", None)
    key = (None if mods is None else (mods.key(), str(mods), mods.argument_types()),
           getattr(problem, "direction", "forward"), getattr(problem, "grad_dtype", None),
           backend, algorithm,
           getattr(problem, "precision", "auto"), getattr(problem, "num_splits", None),
           None if getattr(problem, "kvcache", None) is None else ("kvcache", problem.kvcache.page),
           # packed sequences: explain's notes name the count and the longest
           None if getattr(problem, "varlen", None) is None else (problem.varlen.key(),
                                                                  problem.causal),
           getattr(problem, "dropout", None) is not None,  # its p and seed are run-time values
           # attn_bias's gradient: kernels arrange their tasks by the dims it broadcasts along
           None if getattr(problem, "dbias", None) is None else problem.dbias.shape,
           getattr(problem, "dmod_args", None) is not None,
           # the sm_90 backwards add dQ atomically unless asked for repeatable gradients
           getattr(problem, "deterministic", False),
           problem.kind, problem.dtype,
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

    ops = operators(direction)
    chosen = None
    # this backend's operators in order, then the others' (for a complete explanation)
    for op in sorted(ops.values(), key=lambda o: o.backend != backend):
        if op.backend != backend:
            rejected[op.name] = f"backend={backend!r}"
            continue
        if algorithm != "auto" and op.algorithm != algorithm:
            rejected[op.name] = f"algorithm={algorithm!r} was asked for"
            continue
        why = op.why_not(problem, device)
        if why is None and chosen is None:
            try:
                config = op.module.config(problem, device)
                passed = (op.auto_passes(problem, device) if algorithm == "auto"
                          and op.auto_passes else None)
                if passed:   # it runs the problem, but the next one is the faster
                    why = f"'auto' passes it over: {passed}"
                else:
                    chosen = op
            except Unsupported as e:
                why = str(e)
        if why is not None:
            rejected[op.name] = why
        elif chosen is not op:
            rejected[op.name] = f"{chosen.name} comes first for 'auto'"

    if chosen is None:
        asked = f"algorithm={algorithm!r} on backend={backend!r}"

        if backend == "cpu" and algorithm in ("row", "mma", "wgmma"):
            raise ValueError(f"{asked} does not exist: the CPU path implements the block-tiled "
                             f"loop only (algorithm='block' or 'auto')")
        reasons = "; ".join(f"{n}: {w}" for n, w in rejected.items()
                            if ops[n].backend == backend)
        raise ValueError(f"no numflash kernel can run {asked} for these inputs: {reasons}")

    mods = getattr(problem, "mods", None)
    notes = getattr(chosen.module, "notes", None)
    return Plan(backend=backend, algorithm=chosen.algorithm, kernel=chosen.name, device=device,
                config=config, rejected=rejected, direction=direction,
                mods="" if mods is None else str(mods), dtype=problem.dtype_name,
                notes=notes(problem, config, device) if notes else [],
                dropout=getattr(problem, "dropout", None) is not None,
                bias_grad=getattr(problem, "dbias", None) is not None,
                mod_args_grad=getattr(problem, "dmod_args", None) is not None)

