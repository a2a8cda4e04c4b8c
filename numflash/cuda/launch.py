"""Compile once, cache on disk, load with the driver API, launch with raw pointers.

Why not call the ``@cuda.jit`` dispatcher: numba-cuda re-types CuPy arrays through DLPack on every
call (~140 us on the lent H100). Instead each kernel variant is compiled by numba to PTX, linked to
a cubin for the device's exact architecture by nvJitLink (so PTX newer than the user's driver never
has to be JIT-loaded), stored on disk, loaded with the driver API (cuModuleLoadData) and launched
with the numba ABI's flattened arguments packed into one buffer (cuLaunchKernel through ctypes)
on CuPy's current stream. Under numba's CUDA simulator the same Python kernel source is launched
through the simulator's dispatcher instead, on NumPy arrays.
"""
import contextlib
import ctypes
import functools
import hashlib
import json
import os
import pathlib
import re
import tempfile
import struct
import threading
from collections import Counter, defaultdict

import numpy as np

from ..device import simulator_enabled
from . import fastpath, prebuilt
from .common import FASTMATH

_CUDA_DIR = pathlib.Path(__file__).parent


def cache_dir():
    root = os.environ.get("NUMFLASH_CACHE_DIR")
    if root:
        return pathlib.Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "numflash"


#: Modules that never reach generated code: the launch machinery (this module: of it, only
#: compile_ptx and _device_functions_target do, and their source is hashed by itself), replays
#: and the shipped-PTX store.
_NOT_CODE = ("launch.py", "fastpath.py", "prebuilt.py")


def _module_file(directory, name):
    """The file of module ``name`` (dotted, relative) under ``directory``: a module or a
    package's __init__; None if neither exists."""
    base = directory.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def _sources(path):
    """A kernel module's file and every numflash.cuda module it imports, transitively (read from
    its source, relative imports inside functions included), but for those in _NOT_CODE."""
    import ast
    seen, todo = set(), [pathlib.Path(path)]
    while todo:
        path = todo.pop()
        if path in seen or path.name in _NOT_CODE:
            continue
        seen.add(path)
        if _CUDA_DIR not in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level >= 1):
                continue
            here = path.parent
            for _ in range(node.level - 1):
                here = here.parent
            names = ([f"{node.module}.{a.name}" for a in node.names] + [node.module]
                     if node.module else [a.name for a in node.names])
            for name in names:
                dep = _module_file(here, name)
                if dep is not None and _CUDA_DIR in dep.parents:
                    todo.append(dep)
    return sorted(seen)


_DIGESTS = {}


def source_digest(module_name):
    """Hash of a kernel module's source, of the numflash.cuda modules it imports and of the code
    that turns kernels into PTX: an edit of any of them invalidates that kernel's cached cubins
    and shipped PTX, and no other kernel's."""
    digest = _DIGESTS.get(module_name)
    if digest is None:
        import inspect
        import sys
        h = hashlib.sha256()
        for path in _sources(sys.modules[module_name].__file__):
            h.update(path.name.encode())
            h.update(path.read_bytes())
        for fn in (compile_ptx, _device_functions_target):  # how kernels become PTX
            h.update(inspect.getsource(fn).encode())
        digest = _DIGESTS[module_name] = h.hexdigest()[:16]
    return digest


def numba_type(value):
    """The numba type a kernel argument is compiled for (arrays read through their strides).

    Every argument is 8 bytes in the numba ABI (array fields, int64, float64), so one int64 buffer
    can carry them all to cuLaunchKernel.
    """
    from numba import types
    from numba.np import numpy_support
    if hasattr(value, "ndim") and hasattr(value, "dtype") and getattr(value, "ndim", 0) > 0:
        return types.Array(numpy_support.from_dtype(np.dtype(value.dtype)), value.ndim, "A")
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("pass flags as int, not bool: the numba ABI packs bools as 1 byte")
    if isinstance(value, (int, np.integer)):
        return types.int64
    if isinstance(value, (float, np.floating)):
        return types.float64
    raise TypeError(f"unsupported kernel argument {value!r}")


def array_type(dtype, ndim=4):
    """The numba type an array argument of this dtype is compiled for (see numba_type)."""
    from numba import types
    from numba.np import numpy_support
    return types.Array(numpy_support.from_dtype(np.dtype(dtype)), ndim, "A")


def _argtypes_key(argtypes):
    """_signature_key for numba argument types: what explain has before any launch."""
    from numba import types
    return tuple((np.dtype(str(t.dtype)).char, t.ndim) if isinstance(t, types.Array)
                 else (float if isinstance(t, types.Float) else int) for t in argtypes)


def _signature_key(args):
    """A cheap hashable stand-in for the argument types (building numba types costs ~4 us each)."""
    return tuple([(a.dtype.char, a.ndim) if hasattr(a, "ndim") else type(a) for a in args])


def _pack(args):
    """The kernel's parameters in the numba ABI as int64 values, and for each array argument the
    index of its data pointer among them. Each array becomes meminfo, parent, nitems, itemsize,
    data, shape..., strides...; floats travel as their float64 bits."""
    flat, slots = [], []
    for a in args:
        if hasattr(a, "ndim"):
            slots.append(len(flat) + 4)
            flat += (0, 0, a.size, a.itemsize, a.data.ptr, *a.shape, *a.strides)
        elif isinstance(a, float):
            flat.append(_F64_BITS.unpack(_F64.pack(a))[0])
        else:
            flat.append(int(a))
    return flat, slots


class Recipe:
    """One launch ready to be replayed with new data pointers for its array arguments.

    The parameter values live in ctypes buffers, one per calling thread (cuLaunchKernel copies
    them at the call, so a thread may patch and reuse its buffer right after).
    """
    __slots__ = ("handle", "grid", "block", "shared_bytes", "values", "slots", "pointers",
                 "_buffers", "_head")

    def __init__(self, handle, grid, block, shared_bytes, values, slots):
        self.handle, self.shared_bytes = handle, shared_bytes
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        self._head = (handle, *self.grid, *self.block, shared_bytes)  # cuLaunchKernel's first 8
        self.values, self.slots = values, tuple(slots)
        self.pointers = tuple(values[s] for s in slots)  # the data pointers it was recorded with
        self._buffers = {}

    def _buffer(self):
        ident = threading.get_ident()
        buf = self._buffers.get(ident)
        if buf is None:
            n = len(self.values)
            values = (ctypes.c_int64 * n)(*self.values)
            base = ctypes.addressof(values)
            params = (ctypes.c_void_p * n)(*range(base, base + 8 * n, 8))
            buf = self._buffers[ident] = (values, params, ctypes.addressof(params))
        return buf

    def launch(self, stream, pointers=()):
        """Launch on `stream` (a CUstream handle), the first array arguments at `pointers` (None:
        the recorded one)."""
        values, _, params = self._buffer()
        for slot, ptr in zip(self.slots, pointers):
            if ptr is not None:
                values[slot] = ptr
        (_launch_fn or _kernel_launcher())(*self._head, stream, params, 0)


_F64, _F64_BITS = struct.Struct("d"), struct.Struct("q")


def _driver_call(result):
    """Unwrap a cuda.bindings (err, *values) tuple, raising on any error."""
    from cuda.bindings import driver
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"CUDA driver error {name.decode() if name else err}")
    return values[0] if len(values) == 1 else values


_RESOURCE_PATTERNS = {
    "registers": r"[Uu]sed (\d+) registers",
    "stack_bytes": r"(\d+) bytes stack frame",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
    "static_smem_bytes": r"(\d+) bytes smem",
    "local_bytes": r"(\d+) bytes lmem",
    # ptxas's code when it serializes a kernel's wgmma (C7509: a subroutine call in it)
    "wgmma_serialized": r"\(C(\d+)\) Potential Performance Loss: wgmma",
}


def parse_ptxas_report(log):
    """Registers, spills, stack and shared memory from ptxas' verbose report."""
    out = {}
    for key, pattern in _RESOURCE_PATTERNS.items():
        found = re.findall(pattern, log)
        if found:
            out[key] = max(int(x) for x in found)
    return out


_compile_lock = threading.Lock()


@contextlib.contextmanager
def _device_functions_target(cc):
    """Let numba compile device functions without a GPU.

    numba-cuda 0.30 asks the *current device* for a compute capability when a kernel calls a
    ``@cuda.jit(device=True)`` function, even inside ``compile_ptx(cc=...)``, so offline
    compilation (CI, or sm_75 PTX on an H100) fails or mixes targets. Within this block that
    question is answered with the target's cc.
    """
    from numba.cuda import dispatcher

    class _Target:
        compute_capability = tuple(cc)

    original = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: _Target
    try:
        yield
    finally:
        dispatcher.get_current_device = original


def singly_assigned_variables(lower):
    """The variables numba's lowering may keep out of stack slots (defined in one block, by one
    assignment there, used nowhere else, not needing an alloca): the set numba-cuda 0.30's
    ``Lower._find_singly_assigned_variable`` computes, with one pass over each block's
    assignments instead of one pass a variable."""
    from numba.cuda.core import ir
    from numba.cuda.core.analysis import compute_use_defs, must_use_alloca
    if lower.func_ir.func_id.is_generator:
        return set()
    blocks = lower.func_ir.blocks
    use_defs = compute_use_defs(blocks)
    alloca_vars = must_use_alloca(blocks)
    defined_in = defaultdict(set)
    for label, names in use_defs.defmap.items():
        for name in names:
            defined_in[name].add(label)
    used_across = set().union(*use_defs.usemap.values())  # read before (or without) a local def
    assignments = {}  # label -> how often each name is assigned there
    found = set()
    for name, labels in defined_in.items():
        if name in alloca_vars or len(labels) != 1 or name in used_across:
            continue
        [label] = labels
        if label not in assignments:
            assignments[label] = Counter(stmt.target.name for stmt in
                                         lower.blocks[label].find_insts(ir.assign_types))
        if assignments[label][name] == 1:
            found.add(name)
    return found


def live_variables(cfg, blocks, var_use_map, var_def_map):
    """numba-cuda 0.30's ``compute_live_map`` (the variables live at each block's entry), the
    same two fix-point loops in the same order, over Python integers as bit sets instead of sets
    of names: a union of thousands of names is one integer OR."""
    bit = {}

    def to_bits(names):
        out = 0
        for name in names:
            out |= 1 << bit.setdefault(name, len(bit))
        return out
    defs = {label: to_bits(names) for label, names in var_def_map.items()}
    uses = {label: to_bits(var_use_map[label]) for label in var_def_map}
    reach = defaultdict(int)
    changed = True
    while changed:   # definitions reaching each block's entry
        changed = False
        for label in var_def_map:
            before = reach[label]
            reach[label] |= defs[label] | uses[label]
            for succ, _ in cfg.successors(label):
                grown = reach[succ] | reach[label]
                changed |= grown != reach[succ]
                reach[succ] = grown
            changed |= reach[label] != before
    live = {label: to_bits(var_use_map[label]) for label in blocks}
    changed = True
    while changed:   # uses pushed backward to where their definitions reach
        changed = False
        for label in live:
            for pred, _ in cfg.predecessors(label):
                grown = live[pred] | (live[label] & reach[pred] & ~defs.get(pred, 0))
                changed |= grown != live[pred]
                live[pred] = grown
    names = sorted(bit, key=bit.get)
    return {label: {names[i] for i, one in enumerate(reversed(bin(b))) if one == "1"}
            for label, b in live.items()}


#: The numba-cuda functions the replacements below were checked against (numba-cuda 0.30.4):
#: sha256 of their source, first 16 hex digits. Any other version of them is left in place.
CHECKED_NUMBA_ANALYSES = {"_find_singly_assigned_variable": "c3b499f765172885",
                          "compute_live_map": "cdb51290c1658e92"}


def function_digest(fn):
    """The first 16 hex digits of the sha256 of a function's source, or None."""
    import inspect
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


@functools.lru_cache(maxsize=None)   # found once, before any swap: numba's own functions
def _find_analysis_targets():
    """(Lower class, its original method, [modules holding compute_live_map], the original
    compute_live_map) when numba-cuda's two functions are the checked ones, else None."""
    try:
        from numba.cuda import lowering
        from numba.cuda.core import analysis, ir_utils
        find = lowering.Lower._find_singly_assigned_variable
        live = analysis.compute_live_map
    except (ImportError, AttributeError):
        return None
    if {"_find_singly_assigned_variable": function_digest(find),
            "compute_live_map": function_digest(live)} != CHECKED_NUMBA_ANALYSES:
        return None
    holders = [m for m in (analysis, ir_utils) if getattr(m, "compute_live_map", None) is live]
    return lowering.Lower, find, holders, live


@contextlib.contextmanager
def _faster_numba_analyses():
    """Two of numba-cuda's IR analyses, swapped for equivalent faster ones while numflash
    compiles (bench/NOTES.md, "Compile time"): lowering's search for singly assigned variables
    scans a block's assignments once for every variable defined there, quadratic in a block's
    length, and the generated kernels are long straight-line blocks
    (singly_assigned_variables: one pass); and the live-variable fix point unions sets of
    thousands of names (live_variables: the same loops on integer bit sets).
    tests/test_cuda_compile.py checks that both give numba's own results on a real kernel.
    Only numba-cuda's checked versions of the two are replaced (CHECKED_NUMBA_ANALYSES); call
    within _compile_lock."""
    targets = _find_analysis_targets()
    if targets is None:
        yield
        return
    lower_cls, original_find, holders, original_live = targets

    def find(self):
        self._singly_assigned_vars = singly_assigned_variables(self)
        self._blk_local_varmap = {}

    lower_cls._find_singly_assigned_variable = find
    for m in holders:
        m.compute_live_map = live_variables
    try:
        yield
    finally:
        lower_cls._find_singly_assigned_variable = original_find
        for m in holders:
            m.compute_live_map = original_live


def compile_ptx(pyfunc, argtypes, cc, fastmath=FASTMATH):
    """numba -> PTX for sm_<cc>, without needing a GPU."""
    from numba import cuda
    with _compile_lock, _device_functions_target(cc), _faster_numba_analyses():
        ptx, _ = cuda.compile_ptx(pyfunc, tuple(argtypes), cc=tuple(cc), fastmath=fastmath)
    return ptx


def arch_specific(ptx, cc):
    """PTX retargeted from sm_<cc> to sm_<cc>a, the architecture-specific features that run on
    that compute capability alone (Hopper's wgmma: numflash.cuda.wgmma); link_ptx then links
    for it. Kept out of compile_ptx, whose source is part of every kernel's identity."""
    target = f"sm_{cc[0]}{cc[1]}"
    return re.sub(rf"^\.target {target}$", f".target {target}a", ptx, count=1, flags=re.M)


def link_ptx(ptx, cc):
    """PTX -> cubin for sm_<cc> with nvJitLink (which runs ptxas). Returns (cubin bytes, entry
    name, resources from ptxas' report)."""
    try:
        from cuda.core import Linker, LinkerOptions, ObjectCode
    except ImportError:  # cuda-core < 0.5 kept these under .experimental
        from cuda.core.experimental import Linker, LinkerOptions, ObjectCode
    entry = re.search(r"\.entry\s+(\S+)\s*\(", ptx).group(1)
    arch = f"sm_{cc[0]}{cc[1]}"
    if re.search(rf"^\.target {arch}a$", ptx, re.M):   # arch_specific's
        arch += "a"
    linker = Linker(ObjectCode.from_ptx(ptx.encode()),
                    options=LinkerOptions(arch=arch, verbose=True, ptxas_options="-v"))
    cubin = linker.link("cubin")
    return bytes(cubin.code), entry, parse_ptxas_report(linker.get_info_log() or "")


def cap_registers(ptx, cap):
    """PTX whose entry asks ptxas for at most ``cap`` registers a thread (.maxnreg, a performance
    directive between the parameter list and the body)."""
    end = re.search(r"\.entry\s+\S+\s*\([^)]*\)", ptx).end()
    return f"{ptx[:end]}\n.maxnreg {int(cap)}\n{ptx[end:]}"


def kernel_ptx(pyfunc, argtypes, cc, fastmath=FASTMATH):
    """compile_ptx, retargeted to sm_<cc>a for a kernel function marked ``arch_specific``, with
    the register cap of one that sets ``max_registers`` (its code identity must name the cap)."""
    ptx = compile_ptx(pyfunc, argtypes, cc, fastmath)
    if getattr(pyfunc, "max_registers", None):
        ptx = cap_registers(ptx, pyfunc.max_registers)
    return arch_specific(ptx, cc) if getattr(pyfunc, "arch_specific", False) else ptx


def compile_to_cubin(pyfunc, argtypes, cc, fastmath=FASTMATH):
    """numba -> PTX -> cubin for sm_<cc>. Returns (cubin bytes, entry name, ptx, resources)."""
    ptx = kernel_ptx(pyfunc, argtypes, cc, fastmath)
    cubin, entry, resources = link_ptx(ptx, cc)
    return cubin, entry, ptx, resources


_unwritable_warned = set()


def _warn_unwritable(directory, error):
    """Once per directory and process: compiled kernels cannot be kept."""
    if str(directory) in _unwritable_warned:
        return
    _unwritable_warned.add(str(directory))
    import warnings
    warnings.warn(f"numflash: cannot write the kernel cache in {directory} "
                  f"({error.strerror or error}); every new process will compile its kernels "
                  f"again. Set NUMFLASH_CACHE_DIR to a writable directory.", RuntimeWarning,
                  stacklevel=4)


def _read_entry(cubin_path, meta_path):
    """(cubin, meta) of a valid cache entry; None if there is none, or it is damaged (warned)."""
    try:
        meta_text, cubin = meta_path.read_text(), cubin_path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # no entry (or no cache directory)
        return None
    except OSError as e:  # unreadable: permissions, a directory in its place, an I/O error
        why = f"cannot be read ({e.strerror or e})"
    else:
        try:
            meta = json.loads(meta_text)
            ok = isinstance(meta, dict) and isinstance(meta.get("entry"), str) and \
                meta.get("sha256") == hashlib.sha256(cubin).hexdigest()
        except ValueError:
            ok = False
        if ok:
            meta["from_disk"] = True
            return cubin, meta
        why = "is damaged (its cubin does not match the checksum its metadata records)"
    import warnings
    warnings.warn(f"numflash: the kernel cache entry {cubin_path.name} {why}; compiling it again",
                  RuntimeWarning, stacklevel=3)
    return None


def describe(name, config, cc=None, argtypes=None):
    """A variant in words, for progress lines: its name, config, input type and target."""
    cfg = " ".join(f"{k}={v}" for k, v in sorted(config.items()))
    text = f"{name} [{cfg}]"
    if argtypes:
        text += f" on {argtypes[0].dtype} arrays"
    return text + ("" if cc is None else f" for sm_{cc[0]}{cc[1]}")


def _announce(kernel, cc, argtypes, directory):
    """One line on stderr before a compile from source (seconds to a minute), unless quiet."""
    if os.environ.get("NUMFLASH_QUIET", "") not in ("", "0"):
        return
    import sys
    what = describe(kernel.name, kernel.config, cc, argtypes)
    if directory is None:  # a user's modification: kept for this process only
        print(f"numflash: compiling {what}: first use in this process, 5-60 s (not cached on "
              f"disk: a modification function reads something numflash.fingerprint cannot "
              f"describe, such as an object or a module of yours)", file=sys.stderr, flush=True)
        return
    print(f"numflash: compiling {what}: first use of this configuration, 5-60 s; cached "
          f"afterwards in {directory} (python -m numflash.precompile compiles ahead)",
          file=sys.stderr, flush=True)


class Kernel:
    """One kernel variant: a Python kernel function made by a factory for one config.

    ``name`` and ``config`` identify the variant; ``factory(**config)`` returns the function.
    Compiled cubins are cached per (variant, argument types, architecture, numba-cuda version,
    the sources of its kernel module, of what that imports, and of compile_ptx) on disk, and the
    loaded functions in memory.
    """

    def __init__(self, name, factory, config, fastmath=FASTMATH):
        self.name = name
        self.factory = factory
        self.config = dict(config)
        self.fastmath = fastmath
        self._pyfunc = None
        self._loaded = {}   # (argtypes, cc, device id) -> (CuPy function, build metadata)
        self._sim = None
        self._lock = threading.Lock()

    @property
    def pyfunc(self):
        if self._pyfunc is None:
            self._pyfunc = self.factory(**self.config)
        return self._pyfunc

    def _identity(self, argtypes):
        """What decides this variant's PTX: name, config, argument types, code, fastmath. The
        code is the factory's ``code_identity(**config)`` where it has one (a generator hashes
        the source it generates), else the sources of the factory's module and its imports."""
        code = getattr(self.factory, "code_identity", None)
        code = code(**self.config) if code else source_digest(self.factory.__module__)
        return [self.name, sorted(self.config.items()), [str(t) for t in argtypes], code,
                self.fastmath]

    def cache_key(self, argtypes, cc):
        """The disk cache's key: the variant's identity, the architecture and numba-cuda's
        version. No driver or nvJitLink version: a cubin does not depend on the driver that
        loads it, and one an older nvJitLink linked stays valid."""
        import numba_cuda
        ver = getattr(numba_cuda, "__version__", "?")
        text = json.dumps(self._identity(argtypes) + [list(cc), ver], default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def prebuilt_key(self, argtypes):
        """The key of this variant's shipped PTX (numflash/cuda/prebuilt): its identity, without
        numba-cuda's version, which changes nothing in PTX already generated."""
        text = json.dumps(self._identity(argtypes), default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def _paths(self, argtypes, cc):
        key, d = self.cache_key(argtypes, cc), cache_dir()
        return d, d / f"{self.name}-{key}.cubin", d / f"{self.name}-{key}.json"

    @property
    def cacheable(self):
        """Whether this variant's code is decided by what its key holds: not so for a kernel
        compiled with a user's function (its factory's ``cacheable(**config)`` says), which is
        compiled once per process and never read from or written to disk."""
        check = getattr(self.factory, "cacheable", None)
        return check is None or check(**self.config)

    def status(self, argtypes, cc):
        """Where this variant's first launch in a process gets its code: "cached" (a cubin on
        disk), "prebuilt" (shipped PTX, linked in about a second) or "compile" (numba + NVVM,
        seconds to a minute)."""
        if not self.cacheable:
            return "compile"
        _, cubin_path, meta_path = self._paths(argtypes, cc)
        if cubin_path.exists() and meta_path.exists():
            return "cached"
        return "prebuilt" if prebuilt.find(self.prebuilt_key(argtypes), cc) else "compile"

    def build(self, argtypes, cc, quiet=False):
        """(cubin, meta) for these argument types and architecture: from the disk cache, else
        linked from shipped PTX, else compiled from the Python source; then cached on disk.

        A cache entry is used only if its metadata parses and its cubin has the SHA-256 the
        metadata records: a truncated, corrupt or half-written entry (a full disk, a crash, a
        hand edit) is compiled again and rewritten, with a warning, never loaded.
        """
        d = linked = None   # a variant that is not cacheable never looks at the disk
        if self.cacheable:
            d, cubin_path, meta_path = self._paths(argtypes, cc)
            cached = _read_entry(cubin_path, meta_path)
            if cached is not None:
                return cached
            linked = prebuilt.link(self.prebuilt_key(argtypes), cc)
        if linked is not None:
            cubin, entry, resources = linked
            source = "prebuilt"
        else:
            if not quiet:
                _announce(self, cc, argtypes, d)
            cubin, entry, _, resources = compile_to_cubin(self.pyfunc, argtypes, cc, self.fastmath)
            source = "compiled"
        meta = {"entry": entry, "resources": resources, "cc": list(cc), "config": self.config,
                "sha256": hashlib.sha256(cubin).hexdigest(), "source": source}
        if d is not None:
            try:
                d.mkdir(parents=True, exist_ok=True)
                for path, data in ((cubin_path, cubin), (meta_path, json.dumps(meta).encode())):
                    fd, tmp = tempfile.mkstemp(dir=d)  # atomic: no process ever sees halves
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                    os.replace(tmp, path)
            except OSError as e:  # an unwritable cache only costs a recompile next process
                _warn_unwritable(d, e)
        meta["from_disk"] = False
        return cubin, meta

    def loaded_for(self, argtypes, cc):
        """True if a device of compute capability ``cc`` has this variant loaded already, for
        these argument types (one Kernel may run several: cuda.row's backward on float16 and on
        float32 arrays)."""
        want = _argtypes_key(argtypes)
        return any(key[0] == want and key[1] == tuple(cc) for key in self._loaded)

    def _function(self, args, cc, device_id):
        key = (_signature_key(args), cc, device_id)
        entry = self._loaded.get(key)
        if entry is None:
            with self._lock:
                entry = self._loaded.get(key)
                if entry is None:
                    from cuda.bindings import driver
                    cubin, meta = self.build(tuple(numba_type(a) for a in args), cc)
                    module = _driver_call(driver.cuModuleLoadData(cubin))
                    fn = _driver_call(driver.cuModuleGetFunction(module, meta["entry"].encode()))
                    entry = self._loaded[key] = _Loaded(module, fn, meta)
        return entry

    def __call__(self, grid, block, shared_bytes, args, device):
        """Launch on the current CuPy stream (or in the simulator, with NumPy arrays)."""
        if simulator_enabled():
            if self._sim is None:
                from numba import cuda
                self._sim = cuda.jit(self.pyfunc)
            # Hand the simulator device-array wrappers: it would otherwise "transfer" each NumPy
            # argument and refuse strided views, which the kernels read in place on a GPU.
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
            self._sim[grid, block, 0, shared_bytes](
                *(FakeCUDAArray(a) if isinstance(a, np.ndarray) else a for a in args))
            return
        import cupy
        dev_id = args[0].device.id
        if cupy.cuda.runtime.getDevice() == dev_id:
            self._launch(grid, block, shared_bytes, args, device.cc, dev_id)
        else:
            with cupy.cuda.Device(dev_id):  # the module must live in the arrays' device context
                self._launch(grid, block, shared_bytes, args, device.cc, dev_id)

    def _launch(self, grid, block, shared_bytes, args, cc, dev_id):
        import cupy
        from cuda.bindings import driver
        loaded = self._function(args, cc, dev_id)
        if shared_bytes > loaded.max_shared:
            _driver_call(driver.cuFuncSetAttribute(
                loaded.fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared_bytes))
            loaded.max_shared = shared_bytes
        values, slots = _pack(args)
        recipe = Recipe(loaded.handle, grid, block, shared_bytes, values, slots)
        recipe.launch(cupy.cuda.get_current_stream().ptr)
        fastpath.note_launch(recipe)


class _Loaded:
    """A kernel loaded into one device context."""
    __slots__ = ("module", "fn", "handle", "meta", "max_shared")

    def __init__(self, module, fn, meta):
        self.module, self.fn, self.meta = module, fn, meta
        self.handle = int(fn)  # the CUfunction pointer, for the launch binding
        self.max_shared = 48 * 1024


_launch_fn = None


def _kernel_launcher():
    """cuLaunchKernel(function, grid x3, block x3, shared bytes, stream, params, extra) at the
    least cost Python has, raising on an error: CuPy's Cython binding (driver.launchKernel), else
    the driver library through ctypes with fixed argument types. Measured on the H200's host
    (bench/NOTES.md, "The forward's host time"): CuPy's binding issues a launch in 5.8 us where
    ctypes takes 8.7 us; cuda.bindings' wrapper converts its arguments on every call and costs
    more than either. Modules are still loaded through cuda.bindings (once per kernel)."""
    global _launch_fn
    if _launch_fn is None:
        try:
            from cupy_backends.cuda.api.driver import launchKernel
            _launch_fn = launchKernel
        except ImportError:
            _launch_fn = _ctypes_launcher()
    return _launch_fn


def _ctypes_launcher():
    lib = ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
    fn = lib.cuLaunchKernel
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3

    def launch(*args):
        err = fn(*args)
        if err:
            from cuda.bindings import driver
            _driver_call((driver.CUresult(err),))
    return launch


_kernels = {}


def get_kernel(name, factory, config, fastmath=FASTMATH):
    """The process-wide Kernel object for (name, config)."""
    key = (name, tuple(sorted(config.items())), fastmath)
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = Kernel(name, factory, config, fastmath)
    return k
