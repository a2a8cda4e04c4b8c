"""Score and mask modifications: FlexAttention's score_mod / mask_mod, and built-ins made of them.

A modification is a plain Python function that numba can compile:

- ``mask_mod(b, h, q_idx, kv_idx, *mod_args) -> bool``: True = the pair takes part;
- ``score_mod(score, b, h, q_idx, kv_idx, *mod_args) -> score``, applied to the scaled score
  (softmax_scale * q.k) before the softmax; its derivative with respect to ``score``, with the same
  signature, is ``score_mod_grad`` (the backward needs it; without it the backward refuses).

``h`` is the query head; q_idx and kv_idx are positions in q and k. The backward returns
attn_bias's gradient on request (``return_bias_grad``; :func:`bias_grad_accumulator`), and those
of trainable mod_args (``return_mod_args_grad``): ``score_mod_args_grad`` is a tuple aligned with
mod_args holding, for a float array the score_mod reads one element of per pair (a bias table, a
learned slope a head), a function with score_mod's signature returning ``(index, derivative)``:
which element of that array the pair's score reads (an int for a 1-D array, else a tuple of
ints) and d score_mod / d that element; None for the other arguments (the CPU path and
cuda.mma compute them). The built-in options of
:func:`numflash.attention` (``window_size``, ``softcap``, ``alibi_slopes``, ``attn_bias``,
``attn_mask``) are such functions with their own arguments, and :func:`document_mask` /
:func:`prefix_lm_mask` build mask_mods for packed documents and prefix-LM. All the modifications of
one call are composed into one :class:`Mods`: masks are and-ed, score_mods applied in order
(softcap, then ALiBi, then the bias, then the user's), and the kernels call the composition for
every (query, key) pair they compute; the reference (numflash.reference) calls the same functions
in plain Python.

Which kernels take modifications (each declares the kinds it takes, numflash.kernels): the CPU path
(cpu.tiled, forward and backward) takes them all (its softcap in the call's precision:
numflash.cpu.tiled.softcap_score); the tensor-core kernels (cuda.mma, forward and
backward) take ``window_size`` as a key range per row (:func:`window_key_range`), skipping the key
tiles outside it, and every other one as CUDA device functions applied score by score
(numflash/cuda/mma/mods.py), cuda.row too (but a block mask), and cuda.wgmma's forward (but a
window, a block mask and packed sequences); cuda.block refuses them with a reason
(``numflash.explain`` shows it). A ``block_mask`` (numflash.block_mask) is a mask_mod with its
blocks marked once: kernels skip its EMPTY blocks (cuda.mma also its evaluation in FULL ones). With
CuPy inputs the arrays of a modification must be CuPy arrays on q's GPU. A new modification
compiles a new CPU kernel (a few seconds) once per process and combination of argument types; on
the GPU kernels are cached on disk, a user's function named by its fingerprint
(numflash.fingerprint; one it cannot fingerprint compiles once per process).
"""
import math

import numpy as np

__all__ = ["Mods", "build", "document_mask", "prefix_lm_mask"]


# ---- the built-ins, as modification functions ----

def _window_mask(b, h, i, j, left, right, offset):
    c = i + offset  # the key aligned with query i
    return (left < 0 or j >= c - left) and (right < 0 or j <= c + right)


def window_key_range(i, nk, left, right, offset):
    """[first, end) of the keys query row i sees through a window alone (-1 = unbounded side):
    the key range form of ``_window_mask``, for kernels that skip whole key tiles (the CUDA
    tensor-core kernel generates the same arithmetic)."""
    c = i + offset
    first = 0 if left < 0 else max(0, c - left)
    end = nk if right < 0 else max(0, min(nk, c + right + 1))
    return first, end


# x times 1 / cap, not x / cap: an IEEE division is a subroutine on the GPU, and a kernel that
# calls one has its wgmma serialized by ptxas (cuda.wgmma)
def _softcap_score(x, b, h, i, j, cap, inverse_cap):
    return cap * math.tanh(x * inverse_cap)


def _softcap_grad(x, b, h, i, j, cap, inverse_cap):
    t = math.tanh(x * inverse_cap)
    return 1.0 - t * t


def _alibi_score(x, b, h, i, j, slopes, offset):
    return x - slopes[b, h] * abs(i + offset - j)


def _unit_grad(x, b, h, i, j, *args):
    return 1.0


def _bias_score(x, b, h, i, j, bias):
    return x + bias[b, h, i, j]


def _bool_mask(b, h, i, j, mask):
    return mask[b, h, i, j]


def _document_mask(b, h, i, j, doc_q, doc_k):
    return doc_q[b, i] == doc_k[b, j]


def _prefix_lm_mask(b, h, i, j, prefix):
    return j <= i or j < prefix[b]


def split_alibi_rows(alibi_slopes, count, heads, what):
    """For entry points that run ``count`` calls of one sequence each (packed sequences, KV-cache
    entries): check that alibi_slopes is (H,), for every call, or (count, H), a row per call
    (its dtype and values are checked by each call). ``what`` names a call's unit."""
    if alibi_slopes is None:
        return
    shape = tuple(getattr(alibi_slopes, "shape", np.shape(alibi_slopes)))
    if shape not in ((heads,), (count, heads)):
        raise ValueError(f"alibi_slopes must have shape (H,) = ({heads},) for every {what}, or "
                         f"(B, H) = ({count}, {heads}) with a row per {what}; got shape {shape}")


def row_options(options, b):
    """The modification options of call b of such an entry point: row b of a 2-D
    alibi_slopes (see :func:`split_alibi_rows`), and the user's score_mod / mask_mod (and
    score_mod_grad) seeing b as their batch index, as the one-launch kernels show them
    sequence b (:func:`at_batch`; the call itself is a batch of one: score_mod_args_grad's
    functions too, and its tuple gains a None for the index it now leads); the rest as they
    are."""
    slopes = options.get("alibi_slopes")
    if slopes is not None and np.ndim(slopes) == 2:
        options = dict(options, alibi_slopes=slopes[b])
    user = [name for name in ("score_mod", "mask_mod", "score_mod_grad") if name in options]
    if not user:
        return options
    args = tuple(options.get("mod_args", ()))
    shifted = {name: at_batch(options[name], len(args), score=name != "mask_mod")
               for name in user}
    if options.get("score_mod_args_grad") is not None:   # aligned with the new mod_args
        shifted["score_mod_args_grad"] = (None,) + tuple(
            None if fn is None else at_batch(fn, len(args), score=True)
            for fn in options["score_mod_args_grad"])
    return dict(options, mod_args=(int(b),) + args, **shifted)


_AT_BATCH = {}   # (function, argument count, score) -> its at_batch wrapper


def at_batch(fn, n_args, score):
    """``fn`` (a user's score_mod, its derivatives, or with ``score`` False a mask_mod, taking
    ``n_args`` mod_args) as a function whose first mod_arg is added to the batch index before
    ``fn`` sees it: a call of one packed sequence (batch 0) passes the sequence's index there.
    One wrapper per function, so the CPU path compiles it once, not once per sequence; the
    wrapper keeps ``fn`` alive (define such a function once, not per call)."""
    if not callable(fn):
        return fn   # build() names the bad argument
    key = (fn, n_args, score)
    wrapper = _AT_BATCH.get(key)
    if wrapper is None:
        names = "".join(f", a{n}" for n in range(n_args))
        x = "x, " if score else ""
        env = {"inner": _jit(fn, "score_mod" if score else "mask_mod")}
        exec(f"def at_batch({x}b, h, i, j, base{names}):\n"  # noqa: S102 - fixed text
             f"    return inner({x}b + base, h, i, j{names})\n", env)
        wrapper = env["at_batch"]
        wrapper.__name__ = getattr(fn, "__name__", "fn")
        wrapper = _AT_BATCH.setdefault(key, wrapper)
    return wrapper


def document_mask(doc_ids_q, doc_ids_k=None):
    """(mask_mod, mod_args) keeping each query to the keys of its own document.

    doc_ids_q: (B, Nq) integer document id of every query position (packed sequences);
    doc_ids_k: (B, Nk), by default the same. Combine with ``causal=True`` for causal packing.
    """
    q = np.asarray(doc_ids_q)
    k = q if doc_ids_k is None else np.asarray(doc_ids_k)
    for name, a in (("doc_ids_q", q), ("doc_ids_k", k)):
        if a.ndim != 2 or a.dtype.kind not in "iu":
            raise ValueError(f"{name} must be a (B, N) integer array; got shape {a.shape}, "
                             f"dtype {a.dtype}")
    return _document_mask, (q, k)


def prefix_lm_mask(prefix_lengths):
    """(mask_mod, mod_args) for prefix-LM: every query sees the first ``prefix_lengths[b]`` keys
    (the prefix, bidirectionally) and the keys up to its own position (causally after it). Use
    with ``causal=False``."""
    p = np.asarray(prefix_lengths)
    if p.ndim != 1 or p.dtype.kind not in "iu":
        raise ValueError(f"prefix_lengths must be a (B,) integer array; got shape {p.shape}, "
                         f"dtype {p.dtype}")
    return _prefix_lm_mask, (p,)


# ---- composition and compilation ----

class Mods:
    """The modifications of one call: masks (function, args) and score_mods (function, grad,
    args), in the order they apply, their names (for explain and errors) and kinds (which
    built-in or user modification each is: what a kernel declares it takes).

    ``window``: (left, right) of ``window_size``, or None. Besides its mask function, a window is
    a key range per query row, [i + offset - left, i + offset + right] (see
    :func:`window_key_range`): a kernel can skip the key tiles outside it instead of masking them.
    """

    def __init__(self, masks, scores, names, kinds, window=None, block=None, bias=None,
                 arg_grads=()):
        self.masks = tuple(masks)      # ((fn, args), ...)
        self.scores = tuple(scores)    # ((fn, grad or None, args), ...)
        self.names = tuple(names)
        self.kinds = frozenset(kinds)  # e.g. {"window_size", "softcap", "mask_mod"}
        if (self.masks or self.scores) and not self.kinds:  # never admitted by default
            raise ValueError("Mods needs the kinds of its modifications (numflash.kernels "
                             "decides by them which kernel may run it)")
        self.window = window
        # a block mask's numflash.block_mask.BlockArrays, or None; its mask_mod is the
        # last of ``masks``, which kernels that know the blocks evaluate in PARTIAL ones only
        self.block = block
        # attn_bias's (position among ``scores``, shape as the caller gave it, dtype), or None:
        # where its gradient is taken (see :meth:`grad`) and what it is summed back to
        self.bias = bias
        # ((n, fn), ...): score_mod_args_grad's functions, fn giving (index, derivative) of
        # mod_args[n] at a pair; the user's score_mod, whose arguments they are, applies last
        # (so d loss / d its output is the softmax's dS itself)
        self.arg_grads = tuple(arg_grads)

    @property
    def args(self):
        """Every function's arguments, in order: what the compiled composition reads (with a
        block mask, last, its (state, block rows, block columns))."""
        args = tuple(a for _, a in self.masks) + tuple(a for _, _, a in self.scores)
        return args + ((self.block.state, self.block.bq, self.block.bk),) if self.block else args

    @property
    def user_args(self):
        """The user's score_mod's arguments (the last score_mod's): what score_mod_args_grad's
        functions read and differentiate."""
        return self.scores[-1][2]

    @property
    def has_grad(self):
        return all(g is not None for _, g, _ in self.scores)

    def missing_grad(self):
        return [getattr(f, "__name__", repr(f)) for f, g, _ in self.scores if g is None]

    def key(self):
        return tuple(f for f, _ in self.masks) + tuple((f, g) for f, g, _ in self.scores) + \
            tuple(fn for _, fn in self.arg_grads)

    def argument_types(self):
        """What a compiled kernel depends on in the arguments: each one's type, and an array's
        dtype and dimensions (the plan memo keys on it with :meth:`key`)."""
        return tuple((str(a.dtype), a.ndim) if hasattr(a, "dtype") and hasattr(a, "ndim")
                     else type(a) for args in self.args for a in args)

    def __str__(self):
        return ", ".join(self.names)

    # -- plain Python, for the reference --
    def visible(self, b, h, i, j):
        return all(f(b, h, i, j, *a) for f, a in self.masks)

    # (each step a NumPy float64: a Python float plus a float32 array element, such as a
    # softcap's result plus a float32 attn_bias, is float32 under NumPy 2's promotion rules)
    def score(self, x, b, h, i, j):
        for f, _, a in self.scores:
            x = np.float64(f(x, b, h, i, j, *a))
        return x

    def grad(self, x, b, h, i, j):
        """(d(composed score) / d(scaled score), d(composed score) / d(the value just after
        attn_bias is added)), in one pass over the score_mods: the second is the derivative of
        the score_mods that follow the bias, what attn_bias's gradient needs (1 without a
        bias), as the compiled apply_backward's g and gb."""
        g = gb = 1.0
        bias_at = len(self.scores) if self.bias is None else self.bias[0]
        for n, (f, df, a) in enumerate(self.scores):
            d = np.float64(df(x, b, h, i, j, *a))
            g *= d
            if n > bias_at:
                gb *= d
            x = np.float64(f(x, b, h, i, j, *a))
        return g, gb

    def arg_grad_terms(self, x, b, h, i, j):
        """[(n, index, derivative)] of score_mod_args_grad at a visible pair whose scaled score
        is ``x``: d score / d mod_args[n][index] (the user's score_mod applies last)."""
        if not self.arg_grads:
            return []
        args = self.user_args
        for f, _, a in self.scores[:-1]:
            x = np.float64(f(x, b, h, i, j, *a))
        terms = []
        for n, fn in self.arg_grads:
            at, d = fn(x, b, h, i, j, *args)
            index = at if isinstance(at, tuple) else (at,)
            if len(index) != args[n].ndim or not all(0 <= a < m for a, m in
                                                     zip(index, args[n].shape)):
                raise IndexError(f"score_mod_args_grad[{n}] gave index {at!r}, outside "
                                 f"mod_args[{n}] of shape {args[n].shape}")
            terms.append((n, at, d))
        return terms

    # -- compiled, for the kernels --
    def compiled(self):
        """(apply_forward, apply_backward, visible, live, add_arg_grads) njit functions of the
        composition (add_arg_grads None without score_mod_args_grad)."""
        key = self.key() + (self.block is not None,)
        hit = _COMPILED.get(key)
        if hit is None:
            hit = _COMPILED[key] = _compile(self)
        return hit


_COMPILED = {}


def compile_errors(mods, kernel="the CPU kernel"):
    """A context that turns numba's typing errors, raised while a kernel is compiled with these
    modifications, into a TypeError naming them and the ``kernel`` (which compiles without
    them); nothing for None."""
    import contextlib
    if mods is None:
        return contextlib.nullcontext()
    errors = [_typing_error("numba.core.errors"), _typing_error("numba.cuda.core.errors")]
    errors = tuple(e for e in errors if e is not None)

    @contextlib.contextmanager
    def translate():
        try:
            yield
        except errors as e:
            first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
            raise TypeError(f"numba cannot compile the modifications ({mods}) into {kernel}: "
                            f"{first} -- a mod must be a function numba can compile (nopython "
                            f"mode; for the GPU, as a CUDA device function) taking the "
                            f"documented arguments; see numflash.mods") from e
    return translate()


def _typing_error(module):
    """numba's TypingError class of ``module`` (numba-cuda has its own), or None."""
    import importlib
    try:
        return importlib.import_module(module).TypingError
    except ImportError:
        return None


def _jit(fn, what):
    from numba import njit  # numba is imported when a kernel first needs it, not with numflash
    if hasattr(fn, "py_func"):  # already a numba dispatcher
        return fn
    try:
        return njit(fn)
    except Exception as e:  # noqa: BLE001 - numba compiles lazily; this catches bad objects
        raise TypeError(f"{what} {fn!r} cannot be compiled by numba: {e}") from e


def _compile(mods):
    """Generate, for the composition, numba functions over a tile of raw scores s = q.k:

    apply_forward(s, b, h, i0, j0, scale, args): s <- the modified scaled scores, -inf where a
        mask says no (a -inf already there, the causal mask's, stays);
    apply_backward(s, g, gb, xa, ...): the same, and g <- d(modified)/d(scaled score) (0 where
        masked), gb <- d(modified)/d(the value after attn_bias is added) (1 without a bias),
        with score_mod_args_grad xa <- the score entering the user's score_mod;
    visible(b, h, i, j, args): whether the masks let the pair take part;
    live(b, h, i0, rows, j0, cols, args): False when the tile lies outside a window's band
        (no row i0.. sees a key j0..) or a block mask marks every block the tile touches EMPTY
        (the tile is skipped), True otherwise;
    add_arg_grads(ds, x, b, h, i, j, args, accs, task): for each of score_mod_args_grad's
        functions, accs[k][task][index] += ds * derivative at pair (i, j), whose score entering
        the user's score_mod is x (an index outside the array raises IndexError).
    ``args`` is the tuple of every function's argument tuple, in :attr:`Mods.args` order.
    """
    from numba import njit
    env = {"np": np, "math": math}
    n_masks = len(mods.masks)
    lines_vis = ["def visible(b, h, i, j, args):"]
    cond = []
    for n, (f, _) in enumerate(mods.masks):
        env[f"m{n}"] = _jit(f, "mask_mod")
        cond.append(f"m{n}(b, h, i, j, *args[{n}])")
    lines_vis.append("    return " + (" and ".join(cond) if cond else "True"))
    score_lines, grad_lines = [], []
    bias_at = mods.bias[0] if mods.bias is not None else len(mods.scores)
    user_at = len(mods.scores) - 1  # the user's score_mod, when score_mod_args_grad is given
    # The built-in softcap in the compute precision (the reference and the GPU keep math.tanh)
    from .cpu.tiled import softcap_grad, softcap_score
    cpu_version = {_softcap_score: softcap_score, _softcap_grad: softcap_grad}
    for n, (f, g, _) in enumerate(mods.scores):
        f, g = cpu_version.get(f, f), cpu_version.get(g, g)
        env[f"s{n}"] = _jit(f, "score_mod")
        a = f"*args[{n_masks + n}]"
        if mods.arg_grads and n == user_at:
            grad_lines.append("                xa[r, c] = x")
        if g is not None:
            env[f"g{n}"] = _jit(g, "score_mod_grad")
            grad_lines.append(f"                d = g{n}(x, b, h, i, j, {a})")
            grad_lines.append("                gr *= d")
            if n > bias_at:  # the bias's gradient takes the score_mods after it
                grad_lines.append("                gbv *= d")
        grad_lines.append(f"                x = s{n}(x, b, h, i, j, {a})")
        score_lines.append(f"                x = s{n}(x, b, h, i, j, {a})")

    def apply_source(name, grad):
        """One tile loop for both directions: the backward's also keeps the derivative."""
        lines = [f"def {name}(s, {'g, gb, xa, ' if grad else ''}b, h, i0, j0, scale, args):",
                 "    for r in range(s.shape[0]):",
                 "        i = i0 + r",
                 "        for c in range(s.shape[1]):"]
        lines += ["            g[r, c] = 0", "            gb[r, c] = 0"] if grad else []
        lines += ["            if s[r, c] == -np.inf:",
                  "                continue",
                  "            j = j0 + c",
                  "            if not visible(b, h, i, j, args):",
                  "                s[r, c] = -np.inf",
                  "            else:",
                  "                x = s[r, c] * scale"]
        lines += ["                gr = 1.0", "                gbv = 1.0"] + grad_lines if grad \
            else score_lines
        lines += ["                s[r, c] = x"]
        lines += ["                g[r, c] = gr", "                gb[r, c] = gbv"] if grad else []
        return "\n".join(lines) + "\n"

    live = ["def live(b, h, i0, rows, j0, cols, args):"]
    for n, (f, _) in enumerate(mods.masks):
        if f is _window_mask:   # the rows' bands together: [first row's first key, last row's
            live += [f"    left, right, offset = args[{n}]",          # last key]
                     "    if left >= 0 and j0 + cols - 1 < i0 + offset - left:",
                     "        return False",
                     "    if right >= 0 and j0 > i0 + rows - 1 + offset + right:",
                     "        return False"]
    if mods.block is None:
        live.append("    return True")
    else:
        live += [f"    state, bq, bk = args[{len(mods.masks) + len(mods.scores)}]",
                 "    for qb in range(i0 // bq, (i0 + rows - 1) // bq + 1):",
                 "        for kb in range(j0 // bk, (j0 + cols - 1) // bk + 1):",
                 "            if state[b, h, qb, kb] != 0:",
                 "                return True",
                 "    return False"]
    adds = ["def add_arg_grads(ds, x, b, h, i, j, args, accs, task):"]
    for k, (n, fn) in enumerate(mods.arg_grads):
        env[f"a{k}"] = _jit(fn, "score_mod_args_grad function")
        ndim = mods.user_args[n].ndim
        adds += [f"    at, d = a{k}(x, b, h, i, j, *args[{n_masks + user_at}])",
                 f"    if not ({index_in_bounds('at', f'accs[{k}].shape[1:]', ndim)}):",
                 f"        raise IndexError('score_mod_args_grad[{n}] gave an index outside "
                 f"mod_args[{n}]')",
                 f"    accs[{k}][task][at] += ds * d"]
    exec("\n".join(lines_vis), env)  # noqa: S102 - generated from the functions' names only
    exec("\n".join(live), env)  # noqa: S102
    env["visible"] = njit(env["visible"])
    exec(apply_source("apply_forward", False), env)  # noqa: S102
    exec(apply_source("apply_backward", True), env)  # noqa: S102
    add_arg_grads = None
    if mods.arg_grads:
        exec("\n".join(adds), env)  # noqa: S102
        add_arg_grads = njit(env["add_arg_grads"])
    return (njit(env["apply_forward"]), njit(env["apply_backward"]), env["visible"],
            njit(env["live"]), add_arg_grads)


def index_in_bounds(index, shape, ndim):
    """Source of the condition that ``index`` (an int for ``ndim`` 1, else a tuple of ints) lies
    inside ``shape`` (a source expression of a tuple), negative entries refused: what
    score_mod_args_grad's functions must give, checked the same way on every backend."""
    if ndim == 1:
        return f"0 <= {index} < {shape}[0]"
    return " and ".join(f"0 <= {index}[{a}] < {shape}[{a}]" for a in range(ndim))


# ---- checking the options and building a call's Mods ----

def _array(name, a, kind, device_id):
    """A modification's array argument, on the side of the call: a NumPy array for NumPy
    inputs, a CuPy array on q's GPU for device inputs (never copied across; the error names
    the argument)."""
    if a is None:
        return None
    on_device = type(a).__module__.split(".")[0] == "cupy" or \
        hasattr(a, "__cuda_array_interface__")
    if kind != "cupy":
        if on_device:
            raise TypeError(f"{name} is a device array but q is a NumPy array: pass {name} as a "
                            f"NumPy array")
        return np.asarray(a)
    if not on_device:
        raise TypeError(f"{name} is a host array ({type(a).__name__}) but q is on GPU "
                        f"{device_id}: pass {name} as a CuPy array on that GPU")
    import cupy
    a = cupy.asarray(a)  # zero-copy for any __cuda_array_interface__ object
    if a.device.id != device_id:
        raise ValueError(f"{name} is on GPU {a.device.id} but q is on GPU {device_id}")
    return a


def _xp(a):
    return np if isinstance(a, np.ndarray) else __import__("cupy")


def _broadcast(name, a, shape, dims):
    """a as a read-only zero-copy view of ``shape`` (numpy broadcasting rules), or a clear error."""
    try:
        return _xp(a).broadcast_to(a, shape)
    except ValueError:
        raise ValueError(f"{name} of shape {a.shape} does not broadcast to {dims} = {shape}") \
            from None


def build(problem_shape, kind, causal_offset, *, device_id=None, score_mod=None, mask_mod=None,
          mod_args=(), score_mod_grad=None, window_size=None, softcap=None, alibi_slopes=None,
          attn_bias=None, attn_mask=None, block_mask=None, score_mod_args_grad=None):
    """The :class:`Mods` of one call, or None when it has none (checked: each argument named in
    its error). ``kind``: "numpy" or "cupy" (then arrays must be CuPy arrays on GPU
    ``device_id``)."""
    B, H, Nq, Nk = problem_shape[:4]
    masks, scores, names, kinds, window, block = [], [], [], [], None, None
    full = (B, H, Nq, Nk)
    if window_size is not None:
        try:
            left, right = (int(w) for w in window_size)
        except (TypeError, ValueError):
            raise ValueError(f"window_size must be (left, right) integers (-1 = unbounded); got "
                             f"{window_size!r}") from None
        if left < -1 or right < -1:
            raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded); got "
                             f"{window_size!r}")
        # wider than any distance between a query and a key: the same window, and the kernels'
        # int64 arithmetic (i + offset + right + 1) cannot overflow
        widest = Nq + Nk + abs(int(causal_offset))
        left, right = (min(w, widest) for w in (left, right))
        if (left, right) != (-1, -1):
            masks.append((_window_mask, (left, right, causal_offset)))
            names.append(f"window_size=({left}, {right})")
            kinds.append("window_size")
            window = (left, right)
    if attn_mask is not None:
        m = _array("attn_mask", attn_mask, kind, device_id)
        if m.dtype != np.bool_:
            raise TypeError(f"attn_mask must be a boolean array (True = take part); got {m.dtype}")
        masks.append((_bool_mask, (_broadcast("attn_mask", m, full, "(B, H, Nq, Nk)"),)))
        names.append("attn_mask")
        kinds.append("attn_mask")
    if mask_mod is not None:
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be a function; got {type(mask_mod).__name__}")
        masks.append((mask_mod, _user_args(mod_args, kind, device_id)))
        names.append(f"mask_mod={getattr(mask_mod, '__name__', 'fn')}")
        kinds.append("mask_mod")
    if block_mask is not None:  # last of the masks: see Mods.block
        from .block_mask import BlockMask
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a numflash.BlockMask (numflash."
                            f"create_block_mask); got {type(block_mask).__name__}")
        block = block_mask.structure(B, H, Nq, Nk, kind, device_id)
        masks.append((block_mask.mask_mod, block_mask.mod_args))
        names.append(f"block_mask={getattr(block_mask.mask_mod, '__name__', 'fn')} "
                     f"({block.bq}x{block.bk} blocks)")
        kinds.append("block_mask")
    if softcap is not None and softcap != 0:
        cap = float(softcap)
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"softcap must be a finite number > 0 (0 or None: off); got "
                             f"{softcap!r}")
        scores.append((_softcap_score, _softcap_grad, (cap, 1.0 / cap)))
        names.append(f"softcap={cap:g}")
        kinds.append("softcap")
    if alibi_slopes is not None:
        s = _array("alibi_slopes", alibi_slopes, kind, device_id)
        if s.dtype.kind != "f" or s.shape not in ((H,), (B, H)):
            raise ValueError(f"alibi_slopes must be a float array of shape (H,) = ({H},) or "
                             f"(B, H) = ({B}, {H}); got shape {s.shape}, dtype {s.dtype}")
        # float64 on the CPU; a GPU kernel reads float32 slopes as they are
        s = s if kind == "cupy" and s.dtype in (np.float32, np.float64) else s.astype(np.float64)
        scores.append((_alibi_score, _unit_grad, (_xp(s).broadcast_to(s, (B, H)),
                                                  int(causal_offset))))
        names.append("alibi_slopes")
        kinds.append("alibi_slopes")
    bias_at = None
    if attn_bias is not None:
        bias = _array("attn_bias", attn_bias, kind, device_id)
        if bias.dtype.kind != "f":
            raise TypeError(f"attn_bias must be a float array; got {bias.dtype}")
        bias_at = (len(scores), tuple(bias.shape), bias.dtype)
        if kind == "numpy" and bias.dtype == np.float16:  # numba's CPU arrays have no float16
            bias = bias.astype(np.float32)
        scores.append((_bias_score, _unit_grad,
                       (_broadcast("attn_bias", bias, full, "(B, H, Nq, Nk)"),)))
        names.append("attn_bias")
        kinds.append("attn_bias")
    if score_mod is not None:
        if not callable(score_mod):
            raise TypeError(f"score_mod must be a function; got {type(score_mod).__name__}")
        if score_mod_grad is not None and not callable(score_mod_grad):
            raise TypeError(f"score_mod_grad must be a function; got "
                            f"{type(score_mod_grad).__name__}")
        scores.append((score_mod, score_mod_grad, _user_args(mod_args, kind, device_id)))
        names.append(f"score_mod={getattr(score_mod, '__name__', 'fn')}")
        kinds.append("score_mod")
    elif score_mod_grad is not None:
        raise ValueError("score_mod_grad was given without a score_mod")
    arg_grads = ()
    if score_mod_args_grad is not None:
        if score_mod is None:
            raise ValueError("score_mod_args_grad was given without a score_mod (its functions "
                             "are the score_mod's derivatives in mod_args)")
        arg_grads = _arg_grad_functions(score_mod_args_grad, scores[-1][2])
    if mod_args and score_mod is None and mask_mod is None:
        raise ValueError("mod_args were given without a score_mod or mask_mod to read them")
    if not masks and not scores:
        return None
    return Mods(masks, scores, names, kinds, window, block, bias_at, arg_grads)


def _arg_grad_functions(functions, args):
    """score_mod_args_grad checked against the (converted) mod_args: ((n, fn), ...) for the
    entries that are functions, each for a float array."""
    if not isinstance(functions, tuple) or len(functions) != len(args):
        raise TypeError(f"score_mod_args_grad must be a tuple aligned with mod_args ({len(args)} "
                        f"entries: a function for each trainable array, None for the rest); got "
                        f"{functions!r}")
    out = []
    for n, (fn, a) in enumerate(zip(functions, args)):
        if fn is None:
            continue
        if not callable(fn):
            raise TypeError(f"score_mod_args_grad[{n}] must be a function or None; got "
                            f"{type(fn).__name__}")
        if getattr(a, "ndim", 0) < 1 or np.dtype(a.dtype).kind != "f":
            raise TypeError(f"score_mod_args_grad[{n}] is given, but mod_args[{n}] is not a "
                            f"float array ({type(a).__name__}"
                            f"{f' of {a.dtype}' if hasattr(a, 'dtype') else ''}): gradients "
                            f"flow to float arrays only")
        out.append((n, fn))
    if not out:
        raise ValueError("score_mod_args_grad holds no function: give one for each mod_args "
                         "array that takes a gradient, or leave it None")
    return tuple(out)


def bias_grad_accumulator(xp, out, full, dtype):
    """(acc, view) for attn_bias's gradient ``out`` (the bias's shape): ``acc`` zeros of that
    shape with missing leading dims as 1, in ``dtype`` (``out`` itself, zeroed, when it has
    that dtype and is contiguous), ``view`` a writable broadcast of it to ``full`` = (B, H, Nq,
    Nk) (stride 0 where the bias broadcasts). A kernel adds each pair's dS into view[b, h, i,
    j]: the sums over broadcast dims happen in place, never in an expanded array. Kernels make
    sure that no two threads add into one element at once (or add atomically); the caller
    copies ``acc`` into ``out`` when it is not ``out``."""
    shape4 = (1,) * (4 - out.ndim) + tuple(out.shape)
    if out.dtype == dtype and out.flags.c_contiguous:
        out.fill(0)
        acc = out.reshape(shape4)
    else:
        acc = xp.zeros(shape4, dtype)
    strides = tuple(0 if n == 1 and f != 1 else s for n, f, s in zip(shape4, full, acc.strides))
    return acc, xp.lib.stride_tricks.as_strided(acc, shape=full, strides=strides)


def sum_to_shape(g, shape):
    """A (B, H, Nq, Nk) gradient summed over the dims a ``shape`` array broadcasts along, in
    that shape (numpy broadcasting: missing leading dims, dims of size 1)."""
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + n for n, size in enumerate(shape)
                                      if size == 1 and g.shape[lead + n] != 1)
    return g.sum(axis=axes, keepdims=True).reshape(shape) if axes else g.reshape(shape)


def _user_args(mod_args, kind, device_id):
    """mod_args checked: a tuple; on the GPU each one a CuPy array on q's GPU or a scalar (the
    kernel's arguments)."""
    if not isinstance(mod_args, tuple):
        raise TypeError(f"mod_args must be a tuple (of arrays and scalars); got "
                        f"{type(mod_args).__name__}")
    out = []
    for n, a in enumerate(mod_args):
        name = f"mod_args[{n}]"
        if isinstance(a, (bool, int, float, np.bool_, np.integer, np.floating)):
            out.append(a)
        elif kind == "cupy" and not hasattr(a, "ndim"):
            raise TypeError(f"{name} is a {type(a).__name__}: on the GPU mod_args are CuPy "
                            f"arrays and int / float scalars")
        elif kind == "cupy" and a.ndim == 0:
            raise TypeError(f"{name} is a 0-d array: pass the scalar itself (a device scalar "
                            f"would need a copy to the host)")
        elif kind == "cupy" and np.dtype(a.dtype).kind not in "biuf":
            raise TypeError(f"{name} has dtype {a.dtype}: the GPU kernels read bool, integer "
                            f"and float arrays")
        else:
            out.append(_array(name, a, kind, device_id) if hasattr(a, "ndim") else a)
    return tuple(out)
