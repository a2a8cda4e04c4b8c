"""Packed sequences (flash-attn's varlen convention) and the merge of partial results.

:func:`attention_varlen` and :func:`attention_varlen_backward` take sequences of different lengths
packed along one axis, q (total_q, H, d) and k, v (total_k, Hk, d), with cumulative lengths
``cu_seqlens_q`` / ``cu_seqlens_k`` (B + 1 integers from 0 to the total). This first version runs
one :func:`numflash.attention` call per sequence on views of the packed arrays, writing into views
of the packed outputs: no padding is computed and nothing is copied, on every backend and with every
option :func:`numflash.attention` takes; each call launches on its own, so many short sequences
pay a per-call cost that a single-launch varlen kernel would not (not built yet).

:func:`merge_partials` combines results computed over disjoint sets of keys (split-KV, cascade or
shared-prefix attention, sequence parallelism) into the result over all of them, exactly.
"""
import numpy as np

from .inputs import array_kind, host_values, lse_dtype

__all__ = ["attention_varlen", "attention_varlen_backward", "merge_partials"]


def _host_lengths(name, cu, total, batch=None):
    """cu_seqlens as a host int64 array, checked: 1-D, integer, starts at 0, non-decreasing,
    ends at the packed total."""
    cu = host_values(name, cu, "a 1-D integer array (NumPy or CuPy) or a list")
    if cu.ndim != 1 or cu.size < 1:
        raise ValueError(f"{name} must be 1-D with B + 1 entries; got shape {cu.shape}")
    if cu.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32 or int64); got {cu.dtype}")
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0; got {int(cu[0])}")
    steps = np.diff(cu)
    if (steps < 0).any():
        at = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must be non-decreasing; it goes from {int(cu[at])} to "
                         f"{int(cu[at + 1])} at entry {at}")
    if cu[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}; it ends at {int(cu[-1])}")
    if batch is not None and cu.size != batch + 1:
        raise ValueError(f"{name} has {cu.size - 1} sequences, cu_seqlens_q has {batch}")
    return cu


def _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  torch_ok=False):
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not torch_ok and type(a).__module__.startswith("torch"):
            raise TypeError(f"{name} is a torch tensor: use numflash.torch.flash_attn_varlen_func "
                            f"(differentiable) for torch tensors")
        if getattr(a, "ndim", None) != 3:
            raise ValueError(f"{name} must be 3-D (total, heads, head dim) for attention_varlen; "
                             f"got shape {tuple(getattr(a, 'shape', ()))}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same packed length; got {k.shape[0]} and "
                         f"{v.shape[0]}")
    cq = _host_lengths("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ck = _host_lengths("cu_seqlens_k", cu_seqlens_k, k.shape[0], batch=cq.size - 1)
    for name, given, cu in (("max_seqlen_q", max_seqlen_q, cq), ("max_seqlen_k", max_seqlen_k, ck)):
        longest = int(np.diff(cu).max()) if cu.size > 1 else 0
        if given is not None and int(given) < longest:
            raise ValueError(f"{name}={given} is shorter than the longest sequence ({longest})")
    return cq, ck


def _xp(a):
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     *, causal=False, softmax_scale=None, backend="auto", algorithm="auto",
                     return_lse=False, out=None, precision="auto"):
    """Attention over packed sequences: sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]
    against k, v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]], flash-attn's ``flash_attn_varlen_func``
    layout: q (total_q, H, d), k (total_k, Hk, d), v (total_k, Hk, dv). ``causal`` applies per
    sequence, in either alignment. ``max_seqlen_q/k`` are optional and checked when given.

    Returns the packed output (total_q, H, dv) in q's dtype and kind (or ``out``), and with
    ``return_lse`` the lse as (H, total_q) (flash-attn's varlen layout).
    """
    from .api import attention
    cq, ck = _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    xp = _xp(q)
    if out is None:
        out = xp.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype)
    elif tuple(out.shape) != (q.shape[0], q.shape[1], v.shape[2]):
        raise ValueError(f"out must have shape (total_q, H, dv) = "
                         f"{(q.shape[0], q.shape[1], v.shape[2])}; got {tuple(out.shape)}")
    lse = xp.empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q.dtype)) if return_lse else None
    for b in range(cq.size - 1):
        sq, eq, sk, ek = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if eq == sq:
            continue
        res = attention(q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], causal=causal,
                        softmax_scale=softmax_scale, layout="bshd", backend=backend,
                        algorithm=algorithm, return_lse=return_lse, out=out[None, sq:eq],
                        precision=precision)
        if return_lse:
            lse[:, sq:eq] = res[1][0]
    return (out, lse) if return_lse else out


def attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                              max_seqlen_k=None, *, causal=False, softmax_scale=None,
                              backend="auto", algorithm="auto", precision="auto",
                              deterministic=False, dq=None, dk=None, dv=None):
    """Gradients (dq, dk, dv) of :func:`attention_varlen`, packed like q, k and v; ``o`` and
    ``lse`` are what it returned (lse as (H, total_q)). One :func:`numflash.attention_backward`
    call per sequence, on views, into views of the packed gradients."""
    from .api import attention_backward
    cq, ck = _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    xp = _xp(q)
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise ValueError(f"lse must have shape (H, total_q) = {(q.shape[1], q.shape[0])} (what "
                         f"attention_varlen(..., return_lse=True) returns); got "
                         f"{tuple(lse.shape)}")
    out_shape = (q.shape[0], q.shape[1], v.shape[2])
    for name, a in (("do", do), ("o", o)):
        if tuple(a.shape) != out_shape:
            raise ValueError(f"{name} must have the output's shape (total_q, H, dv) = {out_shape}; "
                             f"got {tuple(a.shape)}")
    inputs = (("q", q), ("k", k), ("v", v), ("do", do), ("o", o), ("lse", lse))
    grads = []
    for name, given, src in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if given is None:  # keys no query sees get zero gradients: start from zeros
            grads.append(xp.zeros(src.shape, src.dtype))
            continue
        if tuple(given.shape) != tuple(src.shape):
            raise ValueError(f"{name} must have the shape of {name[1]} {tuple(src.shape)}; got "
                             f"{tuple(given.shape)}")
        for other, a in inputs + tuple(zip(("dq", "dk"), grads)):
            if xp.may_share_memory(given, a):  # checked before anything is written
                raise ValueError(f"{name} overlaps {other}: pass a separate output array")
        grads.append(given)
    for g in grads:
        g[...] = 0
    for b in range(cq.size - 1):
        sq, eq, sk, ek = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if eq == sq or ek == sk:
            continue
        lse_b = xp.ascontiguousarray(lse[:, sq:eq])[None]
        attention_backward(do[None, sq:eq], q[None, sq:eq], k[None, sk:ek], v[None, sk:ek],
                           o[None, sq:eq], lse_b, causal=causal, softmax_scale=softmax_scale,
                           layout="bshd", backend=backend, algorithm=algorithm,
                           precision=precision, deterministic=deterministic,
                           dq=grads[0][None, sq:eq], dk=grads[1][None, sk:ek],
                           dv=grads[2][None, sk:ek])
    return tuple(grads)


def merge_partials(outs, lses):
    """The attention result over the union of disjoint key sets, from the results over each.

    outs: a sequence of outputs of the same shape (..., Nq, dv), each normalized over its own keys
    (what :func:`numflash.attention` returns); lses: their lse, (..., Nq). Returns (out, lse) with
    lse = log(sum_i exp(lse_i)) and out = sum_i exp(lse_i - lse) out_i, computed in float32
    (float64 for float64 inputs). A row that sees no key in any part gets zeros and lse = -inf; a
    NaN lse in any part makes its row NaN. NumPy or CuPy arrays, all of one kind.
    """
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge_partials needs as many outs as lses, at least one; got "
                         f"{len(outs)} outs and {len(lses)} lses")
    kinds = {array_kind(a) for a in outs + lses}
    if None in kinds or len({k in ("cupy", "cuda") for k in kinds}) > 1:
        raise TypeError("outs and lses must all be NumPy arrays or all device (CuPy) arrays")
    shape, dtype = tuple(outs[0].shape), np.dtype(outs[0].dtype)
    for i, (o, s) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != shape or np.dtype(o.dtype) != dtype:
            raise ValueError(f"outs[{i}] has shape {tuple(o.shape)} and dtype {o.dtype}; outs[0] "
                             f"has {shape} and {dtype}")
        if tuple(s.shape) != shape[:-1]:
            raise ValueError(f"lses[{i}] must have shape {shape[:-1]} (the outs' without the last "
                             f"axis); got {tuple(s.shape)}")
    xp = _xp(outs[0])
    work = np.float64 if dtype == np.float64 else np.float32
    lse_all = xp.stack([xp.asarray(s, dtype=work) for s in lses])
    top = lse_all.max(axis=0)
    top_safe = xp.where(xp.isfinite(top), top, 0)  # rows with no key anywhere: all -inf
    with np.errstate(invalid="ignore", over="ignore"):
        weights = xp.exp(lse_all - top_safe)         # (parts, ..., Nq); NaN stays NaN
        total = weights.sum(axis=0)
        lse = xp.where(total > 0, xp.log(xp.where(total > 0, total, 1)) + top_safe, -xp.inf)
        lse = xp.where(xp.isnan(total), xp.nan, lse)
        scale = weights / xp.where(total > 0, total, 1)
        out = sum(scale[i][..., None] * xp.asarray(o, dtype=work) for i, o in enumerate(outs))
    return out.astype(dtype), lse.astype(lse_dtype(dtype))
