"""A content fingerprint of a user's function: what numba compiles from it, so that a kernel with
that function inside can be cached on disk and found again by another process.

numba compiles a function from its bytecode and freezes, at compile time, the globals and closure
values it reads (numbers, tuples, arrays, other functions, modules' functions). The fingerprint
hashes exactly those: the code objects (bytecode, constants, names, argument counts; not file or
line numbers), the defaults, the closure cells and every global the code names, followed into the
functions it calls. A value it cannot describe faithfully (an object, a class of the user's, a
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
    parts = [sys.implementation.name, sys.version_info[:2], np.__version__]
    try:
        _function(fn, parts, {})
    except (_Opaque, RecursionError):
        return None
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _function(fn, out, seen):
    if fn in seen:          # recursion (direct or mutual): named by its place in the walk
        out.append(("seen", seen[fn]))
        return
    seen[fn] = len(seen)
    out.append(("function", fn.__qualname__))
    _code(fn.__code__, out, seen)
    out.append("defaults")
    _value(fn.__defaults__, out, seen)
    _value(tuple(sorted((fn.__kwdefaults__ or {}).items())), out, seen)
    out.append("closure")
    for cell in fn.__closure__ or ():
        try:
            _value(cell.cell_contents, out, seen)
        except ValueError:  # an empty cell (a name assigned after the function was made)
            raise _Opaque from None
    out.append("globals")
    for name in sorted(_names(fn.__code__)):
        if name in fn.__globals__:
            out.append(name)
            _value(fn.__globals__[name], out, seen)
        elif hasattr(builtins, name):
            out.append(("builtin", name))


def _names(code):
    """The global and attribute names a code object and those nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _code(code, out, seen):
    out.append((code.co_code, code.co_names, code.co_varnames, code.co_freevars,
                code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
                code.co_kwonlyargcount, code.co_flags))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code(const, out, seen)
        else:
            _value(const, out, seen)


def _value(value, out, seen):
    """Describe a constant, a default, a closure value or a global; raise _Opaque if unsure."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        out.append((type(value).__name__, repr(value)))
    elif isinstance(value, (tuple, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, frozenset) else value
        out.append((type(value).__name__, len(items)))
        for item in items:
            _value(item, out, seen)
    elif isinstance(value, np.generic):
        out.append(("numpy scalar", value.dtype.str, value.tobytes()))
    elif isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.nbytes > MAX_ARRAY_BYTES:
            raise _Opaque
        out.append(("array", value.dtype.str, value.shape,
                    hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()))
    elif isinstance(value, types.ModuleType):
        if not _trusted(value.__name__):  # a user's module: what numba reads from it is unknown
            raise _Opaque
        out.append(("module", value.__name__, getattr(value, "__version__", "")))
    elif isinstance(value, types.FunctionType):
        _function(value, out, seen)
    elif hasattr(value, "py_func") and isinstance(value.py_func, types.FunctionType):
        _function(value.py_func, out, seen)     # a numba dispatcher: compiled from its py_func
    elif (isinstance(value, types.BuiltinFunctionType) and _trusted(_owner(value))) or \
            isinstance(value, np.ufunc) or (isinstance(value, type) and _library(value)):
        # math.exp, np.exp, np.float32: named by where they live (their code is the library's)
        out.append(("library", getattr(value, "__module__", None) or "", value.__name__))
    elif _library(type(value)) and type(value).__module__.startswith("numba"):
        out.append(("numba", type(value).__qualname__, str(value)))  # numba.float32 and kin
    else:
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
