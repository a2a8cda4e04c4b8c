"""JAX: :func:`attention` on jax arrays, differentiable with ``jax.custom_vjp``.

Eagerly, CPU jax arrays are read in place through DLPack (``np.from_dlpack``: no copy) and
numflash's CPU path runs on them; the results come back through DLPack. Under ``jax.jit`` (and
``vmap``, which maps it one call at a time) the same host function runs through
``jax.pure_callback``: XLA hands it host buffers and takes the results back. GPU jax arrays are
not run by numflash's CUDA kernels from JAX: that needs an XLA FFI custom call, which numflash does
not ship. A concrete GPU jax array passed here raises; under ``jax.jit`` the arrays are tracers
whose device is not known here, and GPU data would be staged through the host by the callback
(numflash's CPU path).

Gradients use numflash's backward (:func:`numflash.attention_backward`), so ``jax.grad`` and
``jax.vjp`` of :func:`attention` run in O(N) memory, eagerly and under ``jax.jit``. The built-in
modifications (a window, softcap, ALiBi, a bias, with its gradient, and a boolean mask), a block
mask, a user's score_mod / mask_mod with their mod_args (gradients to the float ones that
score_mod_args_grad names) and attention dropout run too; their arrays travel as inputs of the
call (traced under ``jax.jit``), the functions and the block mask as static parts of it.
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import api as _api
from .inputs import lse_dtype

__all__ = ["attention"]


def _check(**arrays):
    for name, a in arrays.items():
        if not isinstance(a, (jax.Array, np.ndarray)):
            raise TypeError(f"{name} must be a jax array; got {type(a).__name__}")
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
            platforms = {d.platform for d in a.devices()}
            if platforms != {"cpu"}:
                raise ValueError(f"{name} lives on {sorted(platforms)}: numflash.jax runs CPU jax "
                                 f"arrays (numflash's CUDA kernels are not callable from XLA); "
                                 f"move it with jax.device_put(x, jax.devices('cpu')[0])")


def _traced(arrays):
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


def _run(host_fn, result_shapes, *arrays):
    """host_fn on NumPy views of the arrays: in place through DLPack when the arrays are concrete,
    through jax.pure_callback when traced."""
    if _traced(arrays):
        def on_host(*buffers):  # XLA's host buffers, as jax arrays: NumPy views of them
            return host_fn(*(np.asarray(b) for b in buffers))
        return jax.pure_callback(on_host, result_shapes, *arrays, vmap_method="sequential")
    views = [np.from_dlpack(a) for a in arrays]
    return tuple(jnp.from_dlpack(r) if r.flags.c_contiguous else jnp.asarray(r)
                 for r in host_fn(*views))


def _shapes(q, v, layout):
    out = list(q.shape)
    out[3] = v.shape[3]
    b, h, n = (0, 1, 2) if layout == "bhsd" else (0, 2, 1)
    return (jax.ShapeDtypeStruct(tuple(out), q.dtype),
            jax.ShapeDtypeStruct((q.shape[b], q.shape[h], q.shape[n]), lse_dtype(q.dtype)))


def _forward(q, k, v, extras, static):
    causal, scale, layout, options = static

    def host(q, k, v, *extra):
        return _api.attention(q, k, v, causal=causal, softmax_scale=scale, layout=layout,
                              return_lse=True, backend="cpu", **_host_options(options, extra))
    return _run(host, _shapes(q, v, layout), q, k, v, *extras)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, extras, static):
    return _forward(q, k, v, extras, static)


def _attention_fwd(q, k, v, extras, static):
    out, lse = _forward(q, k, v, extras, static)
    return (out, lse), (q, k, v, extras, out, lse)


def _attention_bwd(static, residuals, cotangents):
    causal, scale, layout, options = static
    q, k, v, extras, out, lse = residuals
    d_out = cotangents[0]  # the lse's cotangent is ignored: it is not differentiable
    # the arrays that get a gradient: attn_bias, and the mod_args score_mod_args_grad names
    trained = [n for n, name in enumerate(options.arrays) if name == "attn_bias"
               or name in options.trained_mod_args]
    bias_grad = "attn_bias" in options.arrays
    args_grad = bool(options.trained_mod_args)

    def host(do, q, k, v, o, lse, *extra):
        result = _api.attention_backward(
            np.ascontiguousarray(do), q, k, v, o, lse, causal=causal, softmax_scale=scale,
            layout=layout, backend="cpu", return_bias_grad=bias_grad,
            return_mod_args_grad=args_grad, **_host_options(options, extra))
        if not args_grad:
            return result
        *grads, arg_grads = result   # aligned with mod_args: pick the trained arrays'
        return tuple(grads) + tuple(arg_grads[_mod_arg_index(name)] for name in options.arrays
                                    if name in options.trained_mod_args)
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in
                   (q, k, v) + tuple(extras[n] for n in trained))
    grads = _run(host, shapes, d_out.astype(q.dtype), q, k, v, out, lse, *extras)
    # no gradient reaches the other arrays: ALiBi slopes, a boolean mask, untrained mod_args,
    # dropout's seed words
    by_array = dict(zip(trained, grads[3:]))
    d_extras = tuple(by_array[n] if n in by_array else _zero_cotangent(a)
                     for n, a in enumerate(extras))
    return tuple(grads[:3]) + (d_extras,)


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros(a.shape, a.dtype)
    return np.zeros(a.shape, jax.dtypes.float0)   # integer and boolean inputs


_attention.defvjp(_attention_fwd, _attention_bwd)


@dataclasses.dataclass(frozen=True)
class _Options:
    """A call's modification and dropout options, split for jax.custom_vjp: ``arrays`` names the
    array-valued ones, passed as traced inputs (their values in ``extras``; mod_args' arrays as
    "mod_args[n]"); ``scalars`` holds the rest as a hashable tuple of (name, value): functions,
    and mod_args' scalars as ("mod_args", ((n, value), ...));
    ``trained_mod_args`` names the arrays whose gradient the backward returns."""
    arrays: tuple
    scalars: tuple
    trained_mod_args: tuple = ()


def _host_options(options, extra):
    """numflash's keyword options on the host: the scalars, the arrays as NumPy views,
    mod_args put back in order, and dropout's seed from its two 32-bit words."""
    kwargs = dict(options.scalars)
    mod_args = dict(kwargs.pop("mod_args", ()))
    for name, a in zip(options.arrays, extra):
        if name == "dropout_seed":
            words = np.asarray(a).astype(np.uint64)
            kwargs[name] = int(words[0] | (words[1] << np.uint64(32)))
        elif name.startswith("mod_args["):
            mod_args[_mod_arg_index(name)] = np.asarray(a)
        else:
            kwargs[name] = np.asarray(a)
    if mod_args:
        kwargs["mod_args"] = tuple(mod_args[n] for n in range(len(mod_args)))
    return kwargs


def _mod_arg_index(name):
    """n of an array's name "mod_args[n]" (as _split_mod_args names them)."""
    return int(name[len("mod_args["):-1])


def _split_mod_args(mod_args, score_mod_args_grad):
    """mod_args as {"mod_args[n]": array} (traced inputs), ((n, scalar), ...) (static), and the
    names of the float arrays score_mod_args_grad differentiates."""
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple; got {type(mod_args).__name__}")
    derivatives = tuple(score_mod_args_grad or ())
    arrays, scalars, trained = {}, [], []
    for n, a in enumerate(mod_args):
        if isinstance(a, (jax.Array, np.ndarray)):
            arrays[f"mod_args[{n}]"] = a
            if n < len(derivatives) and derivatives[n] is not None \
                    and jnp.issubdtype(a.dtype, jnp.inexact):
                trained.append(f"mod_args[{n}]")
        elif isinstance(a, (bool, int, float, np.number)):
            scalars.append((n, a))
        else:
            raise TypeError(f"mod_args[{n}] must be a jax or NumPy array or a scalar; got "
                            f"{type(a).__name__}")
    return arrays, tuple(scalars), tuple(trained)


def _seed_words(seed):
    """dropout_seed as two uint32 words (low, high): a Python int, or a jax / NumPy integer array
    of shape () or (2,) (a traced one under jax.jit: a new seed each step needs no recompile)."""
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        if not 0 <= int(seed) < 2 ** 64:
            raise ValueError(f"dropout_seed must be in [0, 2**64); got {seed}")
        return jnp.asarray([int(seed) & 0xFFFFFFFF, int(seed) >> 32], jnp.uint32)
    if isinstance(seed, (jax.Array, np.ndarray)) and jnp.issubdtype(seed.dtype, jnp.integer) \
            and seed.shape in ((), (2,)):
        seed = seed.astype(jnp.uint32)
        return jnp.stack([seed, jnp.zeros((), jnp.uint32)]) if seed.shape == () else seed
    raise TypeError(f"dropout_seed must be an int, or an integer jax array of shape () or (2,) "
                    f"(two 32-bit words, low first, as jax.random.bits(key, (2,), jnp.uint32) "
                    f"gives); got {type(seed).__name__}")


def attention(q, k, v, *, causal=False, softmax_scale=None, layout="bhsd", return_lse=False,
              window_size=None, softcap=None, alibi_slopes=None, attn_bias=None, attn_mask=None,
              dropout_p=0.0, dropout_seed=None, score_mod=None, mask_mod=None, mod_args=(),
              score_mod_grad=None, score_mod_args_grad=None, block_mask=None):
    """:func:`numflash.attention` for jax arrays (CPU), differentiable (``jax.grad``,
    ``jax.vjp``) and usable under ``jax.jit`` and ``jax.vmap``. Options mean what they mean
    there; the lse is not differentiable. Returns jax arrays.

    Modifications: ``window_size``, ``softcap``, ``alibi_slopes``, ``attn_bias`` (differentiable:
    ``jax.grad`` with respect to it gives its gradient in its shape, summed over the dims it
    broadcasts along) and ``attn_mask`` (boolean, True = take part), jax or NumPy arrays.
    No gradient is computed for the ALiBi slopes: ``jax.grad`` with respect to them gives zeros
    (train a bias through ``attn_bias`` instead).
    A user's ``score_mod`` / ``mask_mod`` (with ``score_mod_grad`` for gradients), their
    ``mod_args`` (jax or NumPy arrays and Python scalars) mean what they mean for
    numflash.attention. A ``block_mask`` (numflash.create_block_mask with ``device="cpu"``: its
    blocks and arrays are NumPy, made once and reused) is static too: its EMPTY blocks are
    skipped, forward and backward. The functions are static: a new
    function is a new trace, and a new kernel compile. ``jax.grad`` with respect to a float
    mod_args array gives its gradient where ``score_mod_args_grad`` names that argument's
    derivative (see numflash.attention_backward), zeros for the other arrays.
    ``dropout_p`` with ``dropout_seed``: an int, or an integer jax array of shape () or (2,)
    (low and high 32-bit words; under ``jax.jit`` pass it as an argument, e.g.
    ``jax.random.bits(key, (2,), jnp.uint32)``, so each step draws a new mask without a
    recompile); the backward regenerates the same mask."""
    _check(q=q, k=k, v=v)
    arrays = {name: a for name, a in (("alibi_slopes", alibi_slopes), ("attn_bias", attn_bias),
                                      ("attn_mask", attn_mask)) if a is not None}
    _check(**arrays)
    margs, marg_scalars, trained = _split_mod_args(mod_args, score_mod_args_grad)
    _check(**margs)
    arrays.update(margs)
    if dropout_p:
        if dropout_seed is None:
            raise ValueError("dropout_p > 0 needs a dropout_seed (an int, or an integer jax "
                             "array such as jax.random.bits(key, (2,), jnp.uint32))")
        arrays["dropout_seed"] = _seed_words(dropout_seed)
    elif dropout_seed is not None:
        raise ValueError("dropout_seed was given without dropout_p")
    scalars = tuple((name, value) for name, value in (
        ("window_size", None if window_size is None else tuple(int(w) for w in window_size)),
        ("softcap", softcap), ("dropout_p", float(dropout_p) if dropout_p else None),
        ("score_mod", score_mod), ("mask_mod", mask_mod), ("score_mod_grad", score_mod_grad),
        ("score_mod_args_grad", None if score_mod_args_grad is None
         else tuple(score_mod_args_grad)),
        ("mod_args", marg_scalars or None), ("block_mask", block_mask))   # (hashed by identity)
        if value is not None)
    # Every check numflash makes, now (under jit the call runs later, inside a callback): on
    # zero-stride stand-ins with the arrays' shapes and dtypes, which hold no memory.
    def stand_in(a):
        return np.broadcast_to(np.zeros((), np.dtype(a.dtype)), a.shape)
    checked = {name: stand_in(a) for name, a in arrays.items() if name != "dropout_seed"}
    _api.explain(*(stand_in(a) for a in (q, k, v)), causal=causal, softmax_scale=softmax_scale,
                 layout=layout, backend="cpu", dropout_seed=0 if dropout_p else None,
                 **_host_options(_Options(tuple(checked), scalars), tuple(checked.values())))
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    options = _Options(tuple(arrays), scalars, trained)
    out, lse = _attention(q, k, v, tuple(arrays.values()),
                          (causal or False, float(scale), layout, options))
    return (out, lse) if return_lse else out
