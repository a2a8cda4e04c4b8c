"""The float64 naive attention that every test and the benchmark compare against.

It materializes the full Nq x Nk score matrix, so it is only for checking results.
"""
import numpy as np

from . import dropout as _dropout
from .inputs import lse_dtype, normalize


def attention(q, k, v, *, causal=False, softmax_scale=None, layout="bhsd", return_lse=False, out=None,
              backend="auto", algorithm="auto", precision="auto", dropout_p=0.0,
              dropout_seed=None, **mod_options):
    """Naive float64 attention with the same signature as :func:`numflash.attention`.

    Works on NumPy arrays and on device arrays (copied to the host). The result is float64 NumPy
    (or written into ``out``, cast to its dtype); ``backend``, ``algorithm`` and ``precision``
    are accepted for signature compatibility and ignored (the reference is always float64).
    Dropout draws numflash.dropout's mask for the same seed.
    """
    p = normalize(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout,
                  return_lse=return_lse, out=out)
    o, lse = naive(p.host(p.q), p.host(p.k), p.host(p.v), scale=p.scale, causal=p.causal,
                   causal_offset=p.causal_offset, dtype=np.float64,
                   mods=mods_of(p, mod_options),
                   dropout=_dropout.build(dropout_p, dropout_seed))
    if out is not None:
        p.write_out(o)
        o = out
    elif layout == "bshd":
        o = o.transpose(0, 2, 1, 3)
    return (o, lse.astype(lse_dtype(p.dtype))) if return_lse else o


def mods_of(problem, mod_options):
    """The numflash.mods.Mods that :func:`numflash.attention` builds for these options."""
    if not mod_options:
        return None
    from . import mods
    return mods.build(problem.shape, "numpy", problem.causal_offset, **_on_host(mod_options))


def _on_host(mod_options):
    """The options with device arrays (a GPU call's) copied to NumPy: the reference runs here."""
    def host(a):
        if not hasattr(a, "__cuda_array_interface__"):
            return a
        import cupy  # any device array (CuPy, numba, torch CUDA tensors) through CuPy
        return cupy.asnumpy(cupy.asarray(a))
    out = {name: host(a) for name, a in mod_options.items()}
    if out.get("block_mask") is not None:
        out["block_mask"] = out["block_mask"].to_host()
    if "mod_args" in out:
        out["mod_args"] = tuple(host(a) for a in out["mod_args"])
    return out


def _apply_mods(s, visible, mods, rows, want_grad):
    """The scores after the modifications, pair by pair in plain Python (float64): a pair a mask
    refuses becomes -inf and not visible; score_mods apply in order. Also, when asked, the
    derivative of the composed score_mod at each visible pair and that of the score_mods after
    an attn_bias (Mods.grad's two values), stacked: (2, B, H, Nq, Nk), and the visible pairs'
    derivatives in trainable mod_args, [(b, h, i, j, n, index, derivative)]
    (Mods.arg_grad_terms)."""
    s = np.array(s, copy=True)
    vis = np.array(np.broadcast_to(visible, s.shape), copy=True)
    grad = np.zeros((2,) + s.shape) if want_grad else None
    terms = []
    for b, h, i, j in zip(*np.nonzero(vis)):
        pos = int(rows[i])
        if not mods.visible(b, h, pos, j):
            vis[b, h, i, j], s[b, h, i, j] = False, -np.inf
            continue
        # a NumPy float64, not a Python float: NumPy 2 computes a Python float with a float16
        # array element (a float16 attn_bias) in float16
        x = np.float64(s[b, h, i, j])
        if want_grad:
            grad[:, b, h, i, j] = mods.grad(x, b, h, pos, j)
            terms += [(b, h, i, j) + t for t in mods.arg_grad_terms(x, b, h, pos, j)]
        s[b, h, i, j] = mods.score(x, b, h, pos, j)
    return s, vis, grad, terms


def _scores(q, k, *, scale, causal, causal_offset, dtype, query_positions, mods=None,
            want_grad=False):
    """(scale * q k^T in ``dtype`` with masked-out positions at -inf, the (Nq, Nk) mask of the
    pairs that see each other, (B, H, Nq, Nk) with modifications). A pair is masked by the masks
    alone: a -inf score that the data make (an inf in q or k) is still a visible pair. With
    ``want_grad`` a third and a fourth value: the score_mods' derivatives and those in trainable
    mod_args (_apply_mods'; None and [] without modifications)."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.matmul(q, np.swapaxes(k, -1, -2)) * dtype(scale)
    nq, nk = q.shape[-2], k.shape[-2]
    visible = np.ones((nq, nk), bool)
    if causal:
        rows = np.arange(nq) if query_positions is None else np.asarray(query_positions)
        visible = np.arange(nk)[None, :] <= rows[:, None] + causal_offset
        s = np.where(visible, s, -np.inf)
    grad, terms = None, []
    if mods is not None:
        rows = np.arange(nq) if query_positions is None else np.asarray(query_positions)
        s, visible, grad, terms = _apply_mods(s, visible, mods, rows, want_grad)
        s = s.astype(dtype)
    return (s, visible, grad, terms) if want_grad else (s, visible)


def _exp_and_sums(s, dtype):
    """(p, l, m): p = exp(s - m) with m the row max (0 where a row sees no key or has a NaN
    score), l = row sums. A +inf score stays the max, so exp(inf - inf) makes its row NaN (l and
    the lse too), as a NaN score does and as every kernel's online softmax gives."""
    nk = s.shape[-1]
    m = s.max(axis=-1, keepdims=True) if nk else np.full(s.shape[:-1] + (1,), -np.inf, dtype)
    m_safe = np.where(np.isneginf(m) | np.isnan(m), 0, m).astype(dtype)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - m_safe)
    return p, p.sum(axis=-1, keepdims=True), m_safe


def _visible_matmul(a, b, visible):
    """a @ b summing only over the pairs ``visible`` marks (shape (.., I, J), the pairs of a's
    last two axes): a masked pair contributes nothing, even where b holds inf or NaN (0 * NaN
    would be NaN), as the kernels sum. Plain matmul when every value is finite."""
    if np.isfinite(a).all() and np.isfinite(b).all():
        return np.matmul(a, b)
    with np.errstate(invalid="ignore", over="ignore"):
        terms = a[..., :, :, None] * b[..., None, :, :]  # (.., I, J, X): small test sizes only
        return np.where(visible[..., None], terms, 0).sum(axis=-2)


def naive(q, k, v, *, scale, causal=False, causal_offset=0, dtype=np.float64, query_positions=None,
          mods=None, dropout=None):
    """softmax(scale * q k^T + mask) v in ``dtype`` on (B, H, N, d) NumPy arrays; returns (o, lse).

    Rows that see no key give zeros and lse = -inf; a NaN score makes its row's output and lse NaN. ``dtype`` lets the accuracy tests compute the
    same naive formula in a lower precision, to measure that precision's own error.
    ``query_positions``: the original row index of each q row, when q holds a subset of the rows
    (rows are independent, so a sample of them can be checked at sizes where all would not fit).
    ``dropout``: a numflash.dropout.Dropout: P's pairs dropped by its mask and the rest scaled
    (lse is the undropped softmax's).
    """
    dtype = np.dtype(dtype).type  # accept np.float32, "float32" or np.dtype("float32")
    q, k, v = (np.asarray(a, dtype=dtype) for a in (q, k, v))
    k, v = _shared_heads(q, k), _shared_heads(q, v)
    s, visible = _scores(q, k, scale=scale, causal=causal, causal_offset=causal_offset,
                         dtype=dtype, query_positions=query_positions, mods=mods)
    p, l, m_safe = _exp_and_sums(s, dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        if dropout is not None:
            z = _dropout_factors(dropout, p.shape, query_positions, dtype)
            p, visible = p * z, visible & (z != 0)  # a dropped pair reads no v, as in kernels
        o = _visible_matmul(p, v, visible) / np.where(l > 0, l, 1).astype(dtype)
        # -inf only for a row that sees no key; a NaN score gives a NaN l, hence a NaN lse
        lse = np.where(l == 0, -np.inf, np.log(np.where(l == 0, 1, l)) + m_safe)[..., 0]
    return o.astype(dtype), lse


def naive_backward(do, q, k, v, *, scale, causal=False, causal_offset=0, dtype=np.float64, o=None,
                   mods=None, stored=None, dropout=None, bias_grad=False, mod_args_grad=False):
    """Gradients (dq, dk, dv) of naive attention for the output gradient ``do``, in ``dtype``;
    with ``bias_grad`` also that of the attn_bias among ``mods`` (dS through the score_mods
    after the bias, summed over the dims it broadcasts along, in its shape); with
    ``mod_args_grad`` last a tuple aligned with mod_args: the gradients of those
    score_mod_args_grad differentiates (each visible pair's dS times its derivative, added at
    its index; None for the others).

    The textbook backward: P = softmax(S), dV = P^T dO, dP = dO V^T, D = rowsum(dO * O),
    dS = P * (dP - D), dQ = scale dS K, dK = scale dS^T Q. ``o``: the forward output as it was
    stored (a lower-precision run passes its own rounded output, as a kernel reads it);
    by default P V in ``dtype``. Rows that see no key contribute nothing (P = 0).
    ``stored``: a dtype the N x N intermediates P, dP and dS are rounded to, as a framework
    computing in that dtype stores them (the same-dtype baseline of flash-attn's rule is torch
    in float16 / bfloat16, which stores these and S too). ``dropout``: a numflash.dropout.Dropout
    with factors Z (0 or 1 / (1 - p)): O = (P Z) V, dV = (P Z)^T dO, dS = P (Z dP - D).
    """
    dtype = np.dtype(dtype).type
    keep = (lambda a: a) if stored is None else (lambda a: a.astype(stored).astype(dtype))
    do, q, k, v = (np.asarray(a, dtype=dtype) for a in (do, q, k, v))
    kv_heads = k.shape[1]
    k, v = _shared_heads(q, k), _shared_heads(q, v)
    s, visible, grad, terms = _scores(q, k, scale=scale, causal=causal,
                                      causal_offset=causal_offset, dtype=dtype,
                                      query_positions=None, mods=mods, want_grad=True)
    p, l, _ = _exp_and_sums(s, dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = keep(p / np.where(l == 0, 1, l).astype(dtype))  # a NaN row sum poisons its row
    # Every product sums over the (row, key) pairs that see each other only, as the kernels do:
    # a non-finite dO, q or v where nothing reads it reaches no gradient through P = 0.
    vis = visible & ~(l == 0)  # a row whose every score is -inf sees nothing, as in the kernels
    vis_t = np.swapaxes(vis, -1, -2)
    z = 1 if dropout is None else _dropout_factors(dropout, p.shape, None, dtype)
    pz = p * z
    vis_z = vis & (z != 0)  # a dropped pair reads no v, as in the kernels
    o = _visible_matmul(pz, v, vis_z) if o is None else np.asarray(o, dtype=dtype)
    dv = _visible_matmul(np.swapaxes(pz, -1, -2), do, np.swapaxes(vis_z, -1, -2))
    with np.errstate(invalid="ignore"):
        dp = keep(np.where(vis_z, np.matmul(do, np.swapaxes(v, -1, -2)), 0) * z)
        delta = (do * o).sum(axis=-1, keepdims=True)
        ds_softmax = p * (dp - delta)  # d loss / d(the modified score)
        ds = ds_softmax * dtype(scale)
        if grad is not None:  # the chain rule through the score_mods
            ds = ds * grad[0].astype(dtype)
        ds = keep(np.where(vis, ds, 0))
    dq = _visible_matmul(ds, k, vis)
    dk = _visible_matmul(np.swapaxes(ds, -1, -2), q, vis_t)
    dk, dv = _group_sum(dk, kv_heads), _group_sum(dv, kv_heads)
    grads = (dq.astype(dtype), dk.astype(dtype), dv.astype(dtype))
    if bias_grad:
        if mods is None or mods.bias is None:
            raise ValueError("bias_grad needs an attn_bias among the modifications")
        with np.errstate(invalid="ignore"):
            dbias = keep(np.where(vis, ds_softmax * grad[1].astype(dtype), 0))
        from .mods import sum_to_shape
        grads += (sum_to_shape(dbias, mods.bias[1]).astype(dtype),)
    if mod_args_grad:
        if mods is None or not mods.arg_grads:
            raise ValueError("mod_args_grad needs score_mod_args_grad among the modifications")
        args = mods.user_args
        trained = dict(mods.arg_grads)
        # summed in ``dtype``, as a framework computing in it scatter-adds these gradients
        sums = tuple(np.zeros(np.shape(a), dtype) if n in trained else None
                     for n, a in enumerate(args))
        ds_kept = keep(ds_softmax)
        for b, h, i, j, n, at, deriv in terms:
            if vis[b, h, i, j]:  # (a row that sees nothing contributes nothing)
                sums[n][at] += ds_kept[b, h, i, j] * dtype(deriv)
        grads += (sums,)
    return grads


def _dropout_factors(dropout, shape, query_positions, dtype):
    """Z: 0 where the mask drops a pair, 1 / (1 - p) where it keeps it."""
    return np.where(_dropout.keep_mask(dropout, shape, query_positions), dtype(dropout.scale),
                    dtype(0))


def _shared_heads(q, kv):
    """Grouped-query attention: each key/value head repeated for the query heads it serves."""
    group = q.shape[1] // kv.shape[1] if kv.shape[1] else 1
    return kv if group == 1 else np.repeat(kv, group, axis=1)


def _group_sum(g, kv_heads):
    """The gradient of a repeated key/value head: the sum over the query heads it served."""
    B, H = g.shape[:2]
    if kv_heads in (0, H):
        return g
    return g.reshape(B, kv_heads, H // kv_heads, *g.shape[2:]).sum(axis=2)


def attention_backward(do, q, k, v, o=None, lse=None, *, causal=False, softmax_scale=None,
                       layout="bhsd", backend="auto", algorithm="auto", precision="auto",
                       deterministic=False, dq=None, dk=None, dv=None, dropout_p=0.0,
                       dropout_seed=None, return_bias_grad=False, return_mod_args_grad=False,
                       **mod_options):
    """Float64 naive gradients with the signature of :func:`numflash.attention_backward`.

    Returns float64 NumPy (dq, dk, dv) in ``layout`` (and attn_bias's gradient, in its shape,
    with ``return_bias_grad``; mod_args' gradients, last, with ``return_mod_args_grad``). ``o`` and ``lse`` may be omitted (the
    reference recomputes them); ``backend``, ``algorithm``, ``precision``, ``deterministic``
    and the output arrays are accepted for signature compatibility and ignored.
    """
    p = normalize(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout)
    d4 = do if layout == "bhsd" else do.transpose(0, 2, 1, 3)
    grads = naive_backward(p.host(d4), p.host(p.q), p.host(p.k), p.host(p.v), scale=p.scale,
                           causal=p.causal, causal_offset=p.causal_offset,
                           mods=mods_of(p, mod_options),
                           dropout=_dropout.build(dropout_p, dropout_seed),
                           bias_grad=return_bias_grad, mod_args_grad=return_mod_args_grad)
    return tuple(g if layout == "bhsd" else g.transpose(0, 2, 1, 3) for g in grads[:3]) + \
        grads[3:]
