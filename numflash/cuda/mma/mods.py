"""Score and mask modifications on the fragments: a call's mask_mods and score_mods
(numflash.mods; the built-ins are such functions too) composed into one device function that the
tensor-core kernels call for each score a thread holds, forward and backward.

    mod_score(x, b, h, i, j, mod0, mod1, ...) -> the modified score of the scaled score x, or
        -inf where a mask refuses the pair
    mod_score_grad(x, b, h, i, j, ...) -> (that score, its derivative in x), for the backward
        (made when every score mod has its derivative: the backward refuses one without)

The sliding window is not among them: mask.py makes it a key range per row, so the tiles outside
it are skipped. Other masks are applied score by score. A block mask's mask_mod (numflash.
block_mask) is evaluated in its PARTIAL blocks only: the kernels' tile loops (staging.py) visit
only the blocks its lists name, and set ``tile_full`` for a tile inside a FULL block, where
``mod_score_dense`` (every modification but that mask) runs instead, or, when nothing else is
compiled in, only the scaling.

A kernel variant names its composition in ``MmaConfig.MODS``: a token made of each function's
name and its arguments' types (numba compiles one kernel per argument type). numflash's own
functions give the same token in every process, so their kernels are cached on disk like any
other (keyed by the functions' source). A user's function carries its fingerprint
(numflash.fingerprint: its bytecode, constants, closure and the globals it reads, frozen at its
first use as numba freezes them): the same function gives the same token in any process, and its
kernels are cached on disk too. A function that reads something the fingerprint cannot describe
(an object of the user's, a user's module) gets a number unique to this process instead, and its
kernels compile once per process (``cacheable``). Either way, define such a function once, not
per call (each new function object is looked at again).
"""
import itertools
import math
from dataclasses import dataclass

import numpy as np

from ... import mods as user_mods
from ...fingerprint import fingerprint
from .emit import Source

#: what each modification argument is in the kernel: an integer, a float, or an array
INT, FLOAT = "i", "f"


@dataclass(frozen=True)
class Composition:
    """The modifications compiled into a kernel variant: masks ((fn, n_args), ...) and score
    mods ((fn, grad, n_args), ...) in the order numflash.mods applies them, a block mask's
    mask_mod ((fn, n_args),) or (), and one spec per argument (INT, FLOAT, or (dtype str, ndim)
    of an array): the masks', the score mods', the block mask's, then its BLOCK_ARRAYS."""
    token: str
    masks: tuple
    scores: tuple
    specs: tuple
    sparse: tuple = ()

    @property
    def functions(self):
        """Every function compiled in: masks, score mods and their derivatives."""
        return tuple(f for f, _ in self.masks + self.sparse) + \
            tuple(f for f, _, _ in self.scores) + \
            tuple(g for _, g, _ in self.scores if g is not None)

    @property
    def dense(self):
        """Whether anything besides a block mask's mask_mod is compiled in."""
        return bool(self.masks or self.scores)

    @property
    def keyed(self):
        """numflash's own functions or fingerprinted ones: the same token means the same code in
        any process."""
        return all(_is_keyed(f) for f in self.functions)

    @property
    def parameters(self):
        return ", ".join(f"mod{n}" for n in range(len(self.specs)))

    @property
    def locals(self):
        return ", ".join(f"ma{n}" for n in range(len(self.specs)))


#: the kernel's names for a block mask's arrays (numflash.block_mask.BlockArrays, less the state
#: the CPU path reads), the last arguments of a composition with one
BLOCK_ARRAYS = ("bm_kv_count", "bm_kv_blocks", "bm_q_count", "bm_q_blocks", "bm_bq", "bm_bk")

_registry = {}   # token -> Composition
_arg_registry = {}  # MARGS token -> ((n, fn), ...) of numflash.mods.Mods.arg_grads
_user_names = {}  # a user's function -> its name in tokens (the function is kept alive)
_next_id = itertools.count(1)  # next() is atomic: two threads never draw the same number
FINGERPRINTED, NUMBERED = "~", "#"  # what follows a user's function's name in a token


def _is_builtin(fn):
    """One of numflash's own functions (or an njit dispatcher of one)."""
    return getattr(getattr(fn, "py_func", fn), "__module__", None) == user_mods.__name__


def _is_keyed(fn):
    return _is_builtin(fn) or FINGERPRINTED in _name(fn)


def _name(fn):
    """A function's name in tokens: numflash's own by name; a user's by name and fingerprint
    (the same in every process), or by a number of this process where it has none."""
    fn = getattr(fn, "py_func", fn)
    name = getattr(fn, "__name__", "fn").lstrip("_")
    if _is_builtin(fn):
        return name
    known = _user_names.get(fn)
    if known is None:
        digest = fingerprint(fn)
        known = _user_names.setdefault(
            fn, f"{name}{FINGERPRINTED}{digest[:20]}" if digest
            else f"{name}{NUMBERED}{next(_next_id)}")
    return known


def _spec(value):
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        return INT
    if isinstance(value, (float, np.floating)):
        return FLOAT
    return (np.dtype(value.dtype).str.lstrip("<>|="), value.ndim)


def _spec_text(spec):
    return spec if isinstance(spec, str) else f"{spec[0]}/{spec[1]}"


def kernel_mods(mods):
    """The modifications of a numflash.mods.Mods a kernel computes score by score (all but the
    sliding window and a block mask's mask_mod): (masks ((fn, args), ...), score mods ((fn,
    grad, args), ...))."""
    if mods is None:
        return (), ()
    masks = mods.masks[:-1] if mods.block else mods.masks
    return tuple(m for m in masks if m[0] is not user_mods._window_mask), mods.scores


def _block_part(mods):
    """((fn, args),) of a block mask's mask_mod and its BLOCK_ARRAYS' values, or ((), ())."""
    if mods is None or not mods.block:
        return (), ()
    b = mods.block
    return (mods.masks[-1],), (b.kv_count, b.kv_blocks, b.q_count, b.q_blocks, b.bq, b.bk)


def token_for(mods):
    """The MODS token of a call's modifications ("" if the kernel computes none), registered so
    that the kernel factory finds the functions."""
    masks, scores = kernel_mods(mods)
    sparse, arrays = _block_part(mods)
    if not masks and not scores and not sparse:
        return ""
    parts, specs = [], []
    for kind, fns, args in ([("mask", (f,), a) for f, a in masks] +
                            [("score", (f,) + ((g,) if g is not None else ()), a)
                             for f, g, a in scores] +
                            [("block", (f,), a + arrays) for f, a in sparse]):
        arg_specs = [_spec(a) for a in args]
        specs += arg_specs
        parts.append(f"{kind}:{'/'.join(_name(f) for f in fns)}"
                     f"[{','.join(_spec_text(s) for s in arg_specs)}]")
    token = "+".join(parts)
    if token not in _registry:
        _registry[token] = Composition(token, tuple((f, len(a)) for f, a in masks),
                                       tuple((f, g, len(a)) for f, g, a in scores), tuple(specs),
                                       tuple((f, len(a)) for f, a in sparse))
    return token


def arg_grad_token(mods):
    """The MARGS token of a call's score_mod_args_grad functions ("" without): each function's
    name (a user's, numbered as in :func:`token_for`) and the position of the array it
    differentiates among the user's score_mod arguments; registered for the kernel factory."""
    if mods is None or not mods.arg_grads:
        return ""
    token = "+".join(f"{_name(fn)}@{n}" for n, fn in mods.arg_grads)
    _arg_registry.setdefault(token, tuple(mods.arg_grads))
    return token


def emit_arg_grads(s, token, arg_token, ds, x, i, j):
    """Emit, for a MARGS key pass, each trained mod_args array's share of a pair's ``ds``: its
    score_mod_args_grad function's (index, derivative) at the score ``x`` that entered the
    user's score_mod (the composition's last), added atomically into float64 accumulator
    darg<k> of the array's shape. An index outside it adds nothing and sets dargbad[0] (the
    launch raises IndexError after the kernel)."""
    comp = composition(token)
    first = _user_args_first(comp)
    user = "".join(f", ma{first + k}" for k in range(comp.scores[-1][2]))
    for k, (n, _) in enumerate(_arg_registry[arg_token]):
        ndim = comp.specs[first + n][1]
        s(f"at, dd = ag{k}({x}, bi, hi, {i}, {j}{user})",
          f"if {user_mods.index_in_bounds('at', f'darg{k}.shape', ndim)}:")
        with s.block():
            s(f"cuda.atomic.add(darg{k}, at, float64({ds}) * float64(dd))")
        s("else:")
        with s.block():
            s("dargbad[0] = 1")


def arg_grad_namespace(arg_token, device_jit=None):
    """{"ag<k>": ...}: score_mod_args_grad's functions as device functions (plain Python for
    the warp emulator: ``device_jit`` None)."""
    return {f"ag{k}": device_jit(getattr(fn, "py_func", fn)) if device_jit
            else getattr(fn, "py_func", fn) for k, (_, fn) in
            enumerate(_arg_registry[arg_token])}


def _user_args_first(comp):
    """Where the user's score_mod's arguments (the last score mod's) start among the kernel's
    modification arguments: after the masks' and the other score mods'."""
    return sum(n for _, n in comp.masks) + sum(n for _, _, n in comp.scores[:-1])


def arg_grad_ndims(token, arg_token):
    """The dims of the trained mod_args arrays of a MARGS token, in its order (the key pass's
    float64 accumulators have them)."""
    comp = composition(token)
    first = _user_args_first(comp)
    return tuple(comp.specs[first + n][1] for n, _ in _arg_registry[arg_token])


def arg_grad_identity_functions():
    """The code that binds a MARGS token's functions into a key pass (the functions themselves,
    a user's, are named by their fingerprints in the token)."""
    return (emit_arg_grads, arg_grad_namespace, arg_grad_ndims)


def arg_grad_functions(arg_token):
    """score_mod_args_grad's Python functions of a MARGS token (they enter a variant's
    identity)."""
    return tuple(getattr(fn, "py_func", fn) for _, fn in _arg_registry[arg_token])


def composition(token):
    try:
        return _registry[token]
    except KeyError:
        raise LookupError(f"no modifications registered as {token!r} in this process: a kernel "
                          "with modifications is made from a call that has them") from None


def arguments(mods):
    """The kernel's modification arguments of a call, flattened in the token's order: arrays as
    they are, integers as int, floats as float (the launch packs Python int / float)."""
    masks, scores = kernel_mods(mods)
    sparse, arrays = _block_part(mods)
    out = []
    for args in [a for _, a in masks] + [a for _, _, a in scores] + [a for _, a in sparse] + \
            [arrays]:
        for a in args:
            spec = _spec(a)
            out.append(int(a) if spec == INT else float(a) if spec == FLOAT else a)
    return tuple(out)


def argument_types(token):
    """numba types of the kernel's modification arguments (the ABI: int64, float64, arrays)."""
    if not token:
        return ()
    from numba import types
    from ..launch import array_type
    return tuple(types.int64 if s == INT else types.float64 if s == FLOAT
                 else array_type(s[0], s[1]) for s in composition(token).specs)


def parameters(token):
    """Source of the kernel's extra parameters: ", mod0, mod1, ..." ("" without mods)."""
    return f", {composition(token).parameters}" if token else ""


def _offset_arguments(comp):
    """Where ALiBi's causal offset lies among the composition's arguments: the kernels read
    their own ``causal_offset`` there, which packed sequences (VARLEN) and KV-cache entries
    (KVLEN) recompute for each sequence or entry; elsewhere it equals the argument."""
    at, out = sum(n for _, n in comp.masks), set()
    for fn, _, n in comp.scores:
        if getattr(fn, "py_func", fn) is user_mods._alibi_score:
            out.add(at + 1)   # (slopes, offset)
        at += n
    return out


def emit_locals(s, token, flt):
    """Emit the modification arguments as the functions read them: a float scalar in the
    kernel's float type (one float64 in the score arithmetic would make it float64), ALiBi's
    offset as the kernel's causal offset, the rest as passed."""
    comp = composition(token)
    specs, offsets = comp.specs, _offset_arguments(comp)
    for n, spec in enumerate(specs):
        s(f"ma{n} = {flt}(mod{n})" if spec == FLOAT else
          "ma%d = causal_offset" % n if n in offsets else f"ma{n} = mod{n}")
    if sparse(token):
        first = len(specs) - len(BLOCK_ARRAYS)
        s(*(f"{name} = ma{first + n}" for n, name in enumerate(BLOCK_ARRAYS)))


def sparse(token):
    """Whether the variant has a block mask (its tile loops visit the blocks' lists)."""
    return bool(token) and bool(composition(token).sparse)


def emit_apply(s, token, element_index, guard=""):
    """Emit, for each score register ``(name, query index source, key index source)`` of
    ``element_index``, the modified score in place of the scaled one (-inf where a mask
    refuses). A register that is -inf already (a bound of mask.py) is left, as is one whose row
    fails ``guard`` (a padding row past Nq, whose indices the mod arrays do not hold). With a
    block mask, a tile in a FULL block (``tile_full``) skips its mask_mod."""
    comp = composition(token)

    def apply(fn):
        for name, i, j in element_index:
            s(_applies(name, guard, i, j))
            with s.block():
                s(f"{name} = {fn}({name} * mod_scale, bi, hi, {i}, {j}, {comp.locals})")
    _emit_by_tile(s, comp, apply, "",
                  lambda: s(*(f"{name} = {name} * mod_scale" for name, _, _ in element_index)))


def _emit_by_tile(s, comp, apply, suffix, scale_only):
    """Emit ``apply("mod_score" + suffix)``; with a block mask, inside a branch on tile_full
    whose FULL side applies mod_score_dense + suffix (everything but the block mask's mask_mod)
    or, with nothing else compiled in, ``scale_only()`` (the scale the softmax, in log2(e)
    units, expects)."""
    if not comp.sparse:
        apply(f"mod_score{suffix}")
        return
    s("if tile_full:")
    with s.block():
        if comp.dense:
            apply(f"mod_score_dense{suffix}")
        else:
            scale_only()
    s("else:")
    with s.block():
        apply(f"mod_score{suffix}")


def _applies(name, guard, i, j):
    """Source of the condition under which a score register is modified: not -inf already and
    (with a ``guard``) its row in range."""
    return f"if {name} != NEG_INF" + (f" and {guard.format(i=i, j=j)}:" if guard else ":")


def emit_apply_grad(s, token, name, grad, i, j, guard="", bias_grad=None, arg_score=None):
    """Emit the backward's form for one score register: ``name`` <- the modified score (-inf
    where refused) and ``grad`` <- its derivative in the scaled score (0 where refused; left as
    it is where the row fails ``guard``, as in :func:`emit_apply`; a block mask's FULL tiles
    skip its mask_mod). With ``bias_grad`` (a register name) also the derivative of the score
    mods after attn_bias, for the bias's gradient; with ``arg_score`` (a register name) the
    score entering the user's score_mod, for mod_args' gradients (:func:`grad_source`)."""
    comp = composition(token)
    extra = [r for r in (bias_grad, arg_score) if r]
    outputs = ", ".join([grad] + extra)
    suffix = grad_suffix(bool(bias_grad), bool(arg_score))

    def apply(fn):
        s(f"{grad} = ZERO", *(f"{r} = ZERO" for r in extra), _applies(name, guard, i, j))
        with s.block():
            s(f"{name}, {outputs} = {fn}({name} * mod_scale, bi, hi, {i}, {j}, {comp.locals})")

    def scale_only():  # (no score_mod in a FULL block: the user's would be compiled in)
        s(f"{name} = {name} * mod_scale", f"{grad} = ONE",
          *([f"{bias_grad} = ONE"] if bias_grad else []))
    _emit_by_tile(s, comp, apply, suffix, scale_only)


def composition_source(token, real):
    """Python source of mod_score and mod_score_grad for a token: masks and-ed, score mods in
    order, every intermediate in the kernel's float type ``real`` ("float32" / "float64"); with
    a block mask and other modifications also mod_score_dense(_grad), without its mask_mod."""
    comp = composition(token)
    text = _functions_source(comp, real, "mod_score", True)
    if comp.sparse and comp.dense:
        text += _functions_source(comp, real, "mod_score_dense", False)
    return text


def grad_suffix(bias, args):
    """The name suffix of the key pass's composition function: "_grad", with "_bias" (attn_bias's
    gradient) and "_args" (mod_args')."""
    return "_grad" + ("_bias" if bias else "") + ("_args" if args else "")


def grad_source(token, real, bias=False, args=False):
    """Python source of mod_score_grad_bias / _grad_args / _grad_bias_args (and the dense form
    with a block mask and other modifications): mod_score_grad's (score, derivative), then with
    ``bias`` the derivative of the score mods after attn_bias (the bias's gradient is dS times
    it), with ``args`` the score entering the user's score_mod (what score_mod_args_grad's
    functions read), for the key pass of a DBIAS / MARGS variant."""
    comp = composition(token)
    at = next(m for m, (f, _, _) in enumerate(comp.scores) if f is user_mods._bias_score) \
        if bias else None
    text = _functions_source(comp, real, "mod_score", True, bias_at=at, args=args)
    if comp.sparse and comp.dense:
        text += _functions_source(comp, real, "mod_score_dense", False, bias_at=at, args=args)
    return text


def _functions_source(comp, real, name, with_block_mask, bias_at=None, args=False):
    """Source of ``name`` and ``name``_grad (the latter when every score mod has its
    derivative), each taking every argument of the composition; with ``bias_at`` (attn_bias's
    position among the score mods) or ``args`` only the backward's function of
    :func:`grad_source`."""
    params = ", ".join(f"a{k}" for k in range(len(comp.specs)))
    head = "x, b, h, i, j" + (f", {params}" if params else "")

    def arg_list(first, nargs):
        return "".join(f", a{first + k}" for k in range(nargs))
    # masks' arguments first, then the score mods', then the block mask's (specs' order)
    firsts = list(itertools.accumulate([nargs for _, nargs in comp.masks] +
                                       [nargs for _, _, nargs in comp.scores], initial=0))
    masks = [(f"m{m}", firsts[m], nargs) for m, (_, nargs) in enumerate(comp.masks)]
    if with_block_mask:
        masks += [(f"bm{m}", firsts[-1], nargs) for m, (_, nargs) in enumerate(comp.sparse)]
    score, grad = Source(), Source()
    score(f"def {name}({head}):")
    grad(f"def {name}{grad_suffix(bias_at is not None, args)}({head}):")
    refused = "NEG_INF, ZERO" + (", ZERO" if bias_at is not None else "") + \
        (", ZERO" if args else "")
    with score.block(), grad.block():
        for fn, first, nargs in masks:
            call = f"{fn}(b, h, i, j{arg_list(first, nargs)})"
            score(f"if not {call}:", "    return NEG_INF")
            grad(f"if not {call}:", f"    return {refused}")
        grad("gr = ONE")
        if bias_at is not None:
            grad("gb = ONE")
        for m, (_, _, nargs) in enumerate(comp.scores):
            a = arg_list(firsts[len(comp.masks) + m], nargs)
            if args and m == len(comp.scores) - 1:
                grad("xa = x")
            grad(f"gr = gr * {real}(g{m}(x, b, h, i, j{a}))")
            if bias_at is not None and m > bias_at:
                grad(f"gb = gb * {real}(g{m}(x, b, h, i, j{a}))")
            for src in (score, grad):
                src(f"x = {real}(s{m}(x, b, h, i, j{a}))")
        score("return x")
        grad("return x, gr" + (", gb" if bias_at is not None else "") + (", xa" if args else ""))
    if bias_at is not None or args:
        return grad.text()
    return score.text() + (grad.text() if _has_grad(comp) else "")


def _has_grad(comp):
    return all(g is not None for _, g, _ in comp.scores)


def _environment(comp, real, device_jit):
    """The names a composition's generated source reads, and the function that compiles each
    (device functions, or plain Python for the CPU warp emulator)."""
    def fn(f):
        f = getattr(f, "py_func", f)  # an njit dispatcher: its Python function
        return device_jit(f) if device_jit else f
    env = {"NEG_INF": real(-np.inf), "ZERO": real(0), "ONE": real(1), "math": math,
           real.__name__: _real_type(real, device_jit)}
    for m, (f, _) in enumerate(comp.masks):
        env[f"m{m}"] = fn(f)
    for m, (f, _) in enumerate(comp.sparse):
        env[f"bm{m}"] = fn(f)
    for m, (f, g, _) in enumerate(comp.scores):
        env[f"s{m}"] = fn(f)
        if g is not None:
            env[f"g{m}"] = fn(g)
    return env, fn


def grad_namespace(token, real, device_jit=None, bias=False, args=False):
    """{"mod_score_grad_bias": ...} (or _args, _bias_args; and the dense form) for a DBIAS /
    MARGS key pass's namespace, as :func:`namespace` makes the others."""
    env, fn = _environment(composition(token), real, device_jit)
    exec(grad_source(token, real.__name__, bias, args), env)  # noqa: S102 - names generated here
    suffix = grad_suffix(bias, args)
    return {name: fn(env[name]) for name in (f"mod_score{suffix}", f"mod_score_dense{suffix}")
            if name in env}


def namespace(token, real, device_jit=None):
    """{"mod_score": ..., "mod_score_grad": ...} for a kernel's namespace: the composition
    compiled as device functions by ``device_jit`` (numba.cuda.jit(device=True)), or plain
    Python (None: the CPU warp emulator of the tests). ``real``: np.float32 / np.float64."""
    env, fn = _environment(composition(token), real, device_jit)
    exec(composition_source(token, real.__name__), env)  # noqa: S102 - names generated here
    return {name: fn(env[name]) for name in ("mod_score", "mod_score_grad", "mod_score_dense",
                                             "mod_score_dense_grad") if name in env}


def _real_type(real, device_jit):
    if device_jit is None:
        return real
    import numba
    return getattr(numba, real.__name__)


def identity_functions(token, extra_grads=False):
    """The functions whose source decides a MODS variant's code besides its generated kernel
    source: this module's composition and the modification functions themselves (with
    ``extra_grads``, a DBIAS / MARGS key pass's, also grad_source's)."""
    return (composition_source, _functions_source, namespace, _environment, emit_locals,
            *((grad_source, grad_namespace, grad_suffix) if extra_grads else ()),
            *(getattr(f, "py_func", f) for f in composition(token).functions
              if _is_builtin(f)))  # a user's: its fingerprint is in the token


def cacheable(token, arg_token=""):
    """Whether a variant with these modifications (and score_mod_args_grad functions) may be
    cached on disk: numflash's own functions, whose source the cache key holds, and users'
    fingerprinted ones, whose fingerprint the token holds."""
    return (not token or composition(token).keyed) and \
        (not arg_token or all(_is_keyed(fn) for _, fn in _arg_registry[arg_token]))
