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
``jax.vjp`` of :func:`attention` run in O(N) memory, eagerly and under ``jax.jit``.
"""
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


def _forward(q, k, v, causal, scale, layout):
    def host(q, k, v):
        return _api.attention(q, k, v, causal=causal, softmax_scale=scale, layout=layout,
                              return_lse=True, backend="cpu")
    return _run(host, _shapes(q, v, layout), q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, causal, scale, layout):
    return _forward(q, k, v, causal, scale, layout)


def _attention_fwd(q, k, v, causal, scale, layout):
    out, lse = _forward(q, k, v, causal, scale, layout)
    return (out, lse), (q, k, v, out, lse)


def _attention_bwd(causal, scale, layout, residuals, cotangents):
    q, k, v, out, lse = residuals
    d_out = cotangents[0]  # the lse's cotangent is ignored: it is not differentiable

    def host(do, q, k, v, o, lse):
        return _api.attention_backward(np.ascontiguousarray(do), q, k, v, o, lse, causal=causal,
                                       softmax_scale=scale, layout=layout, backend="cpu")
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v))
    return _run(host, shapes, d_out.astype(q.dtype), q, k, v, out, lse)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, *, causal=False, softmax_scale=None, layout="bhsd", return_lse=False):
    """:func:`numflash.attention` for jax arrays (CPU), differentiable (``jax.grad``,
    ``jax.vjp``) and usable under ``jax.jit`` and ``jax.vmap``. Options mean what they mean
    there; the lse is not differentiable. Returns jax arrays."""
    _check(q=q, k=k, v=v)
    # Every check numflash makes, now (under jit the call runs later, inside a callback): on
    # zero-stride stand-ins with the arrays' shapes and dtypes, which hold no memory.
    stand_ins = [np.broadcast_to(np.zeros((), np.dtype(a.dtype)), a.shape) for a in (q, k, v)]
    _api.explain(*stand_ins, causal=causal, softmax_scale=softmax_scale, layout=layout,
                 backend="cpu")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = _attention(q, k, v, causal or False, float(scale), layout)
    return (out, lse) if return_lse else out
