"""A content fingerprint of a user's function: what numba compiles from it, so that a kernel with
that function inside can be cached on disk and found again by another process.

numba compiles a function from its bytecode and freezes, at compile time, the globals and closure
values it reads (numbers, tuples, arrays, other functions, modules' functions). The fingerprint
hashes exactly those: the code objects (bytecode, exception table, constants, names, argument
counts; not file or line numbers), the defaults, the closure cells and every global the code
names, followed into the functions and numba dispatchers (with their options) it calls. A value it cannot describe faithfully (an object, a class of the user's, a
large array) makes the function opaque: :func:`fingerprint` returns None and the caller keeps such
a kernel for its process only, as numba would recompile it.
"""
import builtins
import hashlib
import sys
import types

import numpy as np

#: Global arrays up to this size are hashed (numba bakes them into the code as constants).
MAX_ARRAY_BYTES = 1 << 20


class _Opaque(Exception):
    """A value the fingerprint cannot vouch for."""


def fingerprint(fn):
    """Hex sha256 of what numba compiles from ``fn`` (a Python function or a numba dispatcher:
    its ``py_func``), or None where something it reads cannot be described."""
    fn = getattr(fn, "py_func", fn)
    if not isinstance(fn, types.FunctionType):
        return None
    try:
        tree = [sys.implementation.name, sys.version_info[:2], np.__version__,
                _function(fn, {})]
        return hashlib.sha256(repr(tree).encode()).hexdigest()
    except Exception:  # noqa: BLE001 - _Opaque, deep recursion, a value whose repr or
        return None    # attributes raise: no fingerprint, never a wrong one


def _function(fn, seen):
    """A nested description of a function: every part in its own list, so that no two
    different walks flatten to the same text (a global belongs to the function that names it)."""
    if fn in seen:          # recursion (direct or mutual): named by its place in the walk
        return ("seen", seen[fn])
    seen[fn] = len(seen)
    globals_ = []
    for name in sorted(_names(fn.__code__)):
        if name in fn.__globals__:
            globals_.append((name, _value(fn.__globals__[name], seen)))
        elif hasattr(builtins, name):
            globals_.append((name, "builtin"))
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(_value(cell.cell_contents, seen))
        except ValueError:  # an empty cell (a name assigned after the function was made)
            raise _Opaque from None
    return ("function", fn.__qualname__, _code(fn.__code__, seen),
            ("defaults", _value(fn.__defaults__, seen),
             _value(tuple(sorted((fn.__kwdefaults__ or {}).items())), seen)),
            ("closure", cells), ("globals", globals_))


def _names(code):
    """The global and attribute names a code object and those nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _code(code, seen):
    return ("code", code.co_code, getattr(code, "co_exceptiontable", b""), code.co_names,
            code.co_varnames, code.co_freevars, code.co_cellvars, code.co_argcount,
            code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
            [_code(c, seen) if isinstance(c, types.CodeType) else _value(c, seen)
             for c in code.co_consts])


def _dtype(dtype):
    return (dtype.str, repr(dtype))   # repr names a structured dtype's fields


def _value(value, seen):
    """Describe a constant, a default, a closure value or a global; raise _Opaque if unsure."""
    kind = type(value)
    if value is None or kind in (bool, int, float, complex, str, bytes):
        return (kind.__name__, repr(value))
    if kind in (tuple, frozenset):
        items = sorted(value, key=repr) if kind is frozenset else value
        return (kind.__name__, [_value(item, seen) for item in items])
    if isinstance(value, np.generic) and type(value).__module__ == "numpy":
        return ("numpy scalar", _dtype(value.dtype), value.tobytes())
    if kind is np.ndarray:
        if value.dtype.hasobject or value.nbytes > MAX_ARRAY_BYTES:
            raise _Opaque
        return ("array", _dtype(value.dtype), value.shape,
                hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest())
    if kind is types.ModuleType:
        if not _trusted(value.__name__):  # a user's module: what numba reads from it is unknown
            raise _Opaque
        return ("module", value.__name__, getattr(value, "__version__", ""))
    if kind is types.FunctionType:
        return _function(value, seen)
    if _is_dispatcher(value):
        # compiled from its py_func, with its options and any signatures it was given
        return ("dispatcher", kind.__qualname__, repr(sorted(value.targetoptions.items())),
                None if value._can_compile else sorted(str(sig) for sig in value.signatures),
                _function(value.py_func, seen))
    if (kind is types.BuiltinFunctionType and _trusted(_owner(value))) or \
            (kind is np.ufunc) or (isinstance(value, type) and _library(value)):
        # math.exp, np.exp, np.float32: named by where they live (their code is the library's)
        return ("library", getattr(value, "__module__", None) or "", value.__name__)
    if _is_numba_type(value):
        return ("numba type", str(value))   # numba.float32 and kin (a type's str is its key)
    raise _Opaque


#: Libraries whose functions and constants the fingerprint names instead of hashing.
TRUSTED = ("builtins", "math", "cmath", "operator", "numpy", "numba", "numba_cuda")


def _trusted(module_name):
    return module_name.split(".")[0] in TRUSTED


def _owner(builtin_function):
    """The module a built-in function belongs to ("" for a method of some object)."""
    owner = getattr(builtin_function, "__self__", None)
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    return (getattr(builtin_function, "__module__", None) or "") if owner is None else ""


def _library(cls):
    """Whether a class belongs to Python, NumPy or numba (not to the user's code)."""
    return _trusted(getattr(cls, "__module__", "") or "")


def _is_dispatcher(value):
    """A numba njit / cuda.jit dispatcher (not an intrinsic, a jitclass or a ufunc builder)."""
    try:
        from numba.core.dispatcher import Dispatcher
    except ImportError:
        return False
    if isinstance(value, Dispatcher):
        return True
    return type(value).__name__ == "CUDADispatcher" and _library(type(value)) and \
        isinstance(getattr(value, "py_func", None), types.FunctionType)


def _is_numba_type(value):
    try:
        from numba.core.types import Type
    except ImportError:
        return False
    return isinstance(value, Type) and _library(type(value))
