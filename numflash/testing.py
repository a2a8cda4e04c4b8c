"""The accuracy rule every test and the benchmark apply, after flash-attn's own tests.

A result passes when its max abs error against the float64 reference is at most twice the error of
naive attention computed in the same dtype, plus a small absolute floor for that dtype. The lse must
match the reference's to float32 precision, with -inf exactly where the reference has -inf.
"""
from dataclasses import dataclass

import numpy as np

from . import dropout as _dropout
from . import reference
from .inputs import lse_dtype, normalize

ABS_FLOOR = {"float64": 1e-12, "float32": 2e-6, "float16": 2e-4, "bfloat16": 2e-3}
# lse is float32 (float64 for float64 inputs): it must match the reference to that precision.
LSE_TOL = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-5, "bfloat16": 1e-5}


def _to_host(a):
    if a is None:
        return None
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def _naive_same_dtype(q, k, v, p, rows, mods=None, dropout=None):
    """Naive attention with every step rounded to the input dtype (float16: float32 matmuls)."""
    dt = p.dtype
    work = np.float32 if dt.name in ("float16", "bfloat16") else dt.type
    o, _ = reference.naive(q, k, v, scale=p.scale, causal=p.causal, causal_offset=p.causal_offset,
                           dtype=work, query_positions=rows, mods=mods, dropout=dropout)
    return o.astype(dt).astype(np.float64)


@dataclass
class AccuracyReport:
    max_err: float          # max |out - reference|
    naive_err: float        # max |naive attention in the same dtype - reference|
    bound: float            # 2 * naive_err + floor
    rel_err: float          # ||out - ref|| / ||ref|| (Frobenius)
    lse_ok: bool
    finite: bool

    @property
    def ok(self):
        return self.finite and self.lse_ok and self.max_err <= self.bound

    def __str__(self):
        return (f"max_err={self.max_err:.3g} bound={self.bound:.3g} (naive {self.naive_err:.3g}) "
                f"rel={self.rel_err:.3g} lse_ok={self.lse_ok} finite={self.finite}")


def check(out, q, k, v, *, lse=None, causal=False, softmax_scale=None, layout="bhsd", rows=None,
          dropout_p=0.0, dropout_seed=None, **mod_options):
    """Compare an attention result (and optionally its lse) with the float64 reference.

    ``rows``: check only these query rows (indices into Nq) — for sizes where the full
    Nq x Nk reference would not fit; every key is still used for each checked row.
    ``mod_options``: the modifications the result was computed with (numflash.mods), and
    ``dropout_p`` / ``dropout_seed`` its dropout (the reference draws the same mask).
    """
    p = normalize(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout)
    mods = reference.mods_of(p, mod_options)
    dropout = _dropout.build(dropout_p, dropout_seed)
    qs = p.q if rows is None else p.q[:, :, rows]
    qh, kh, vh = (_to_host(a).astype(np.float64) for a in (qs, p.k, p.v))
    ref, ref_lse = reference.naive(qh, kh, vh, scale=p.scale, causal=p.causal,
                                   causal_offset=p.causal_offset, query_positions=rows,
                                   mods=mods, dropout=dropout)
    o = _to_host(out)
    o = (o if layout == "bhsd" else o.transpose(0, 2, 1, 3))
    if rows is not None:
        o = o[:, :, rows]
        lse = None if lse is None else _to_host(lse)[:, :, rows]
    o = o.astype(np.float64)
    if o.shape != ref.shape:
        raise ValueError(f"out has shape {o.shape}, expected {ref.shape} (bhsd order)")
    naive = _naive_same_dtype(_to_host(qs), _to_host(p.k), _to_host(p.v), p, rows, mods, dropout)
    finite = bool(np.isfinite(o).all())
    max_err = float(np.abs(o - ref).max()) if o.size else 0.0
    naive_err = float(np.abs(naive - ref).max()) if o.size else 0.0
    bound = 2 * naive_err + ABS_FLOOR[p.dtype.name]
    denom = float(np.linalg.norm(ref)) or 1.0
    rel = float(np.linalg.norm(o - ref)) / denom if o.size else 0.0
    lse_ok = True
    if lse is not None:
        lh = _to_host(lse)
        if lh.dtype != lse_dtype(p.dtype) or lh.shape != ref_lse.shape:
            lse_ok = False
        else:
            inf_ref = np.isneginf(ref_lse)
            lse_ok = bool(np.array_equal(np.isneginf(lh), inf_ref)) and bool(np.allclose(
                lh[~inf_ref], ref_lse[~inf_ref], rtol=LSE_TOL[p.dtype.name],
                atol=LSE_TOL[p.dtype.name]))
    return AccuracyReport(max_err, naive_err, bound, rel, lse_ok, finite)


def assert_accurate(out, q, k, v, **kwargs):
    rep = check(out, q, k, v, **kwargs)
    assert rep.ok, f"attention result fails the accuracy rule: {rep}"
    return rep


@dataclass
class GradientReport:
    """The accuracy rule applied to each of dq, dk, dv (same bound as the forward's rule)."""
    errors: dict        # name -> max |grad - reference|
    naive_errors: dict  # name -> max |naive backward in the same dtype - reference|
    bounds: dict        # name -> 2 * naive error + floor
    finite: bool
    rel_errors: dict = None  # name -> ||grad - ref|| / ||ref|| (Frobenius)

    @property
    def ok(self):
        return self.finite and all(self.errors[n] <= self.bounds[n] for n in self.errors)

    def __str__(self):
        parts = [f"{n}: err={self.errors[n]:.3g} bound={self.bounds[n]:.3g} "
                 f"(naive {self.naive_errors[n]:.3g})" for n in self.errors]
        return "; ".join(parts) + f"; finite={self.finite}"


def check_backward(grads, do, q, k, v, *, causal=False, softmax_scale=None, layout="bhsd",
                   dropout_p=0.0, dropout_seed=None, **mod_options):
    """Compare gradients (dq, dk, dv) for output gradient ``do`` with the float64 reference;
    a fourth, ``dbias``, is attn_bias's gradient (in the bias's shape); a last tuple, mod_args'
    gradients (as ``return_mod_args_grad`` gives them; each compared as ``mod_args[n]``).

    The naive backward in the same dtype reads its own forward output rounded to that dtype, as a
    kernel reads the stored o (D = rowsum(dO * O) depends on it). For float16 / bfloat16 it runs
    its products in float32 and stores P, dP and dS in the dtype, as flash-attn's rule's baseline
    (torch in that dtype) does; S it keeps in float32, which torch would round too.
    """
    p = normalize(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout)
    bhsd = (lambda a: a) if layout == "bhsd" else (lambda a: a.transpose(0, 2, 1, 3))
    dt = p.dtype
    raw = [_to_host(a) for a in (bhsd(do), p.q, p.k, p.v)]
    arg_grads = isinstance(grads[-1], tuple)
    arrays = grads[:-1] if arg_grads else grads
    opts = dict(scale=p.scale, causal=p.causal, causal_offset=p.causal_offset,
                mods=reference.mods_of(p, mod_options),
                dropout=_dropout.build(dropout_p, dropout_seed), bias_grad=len(arrays) == 4,
                mod_args_grad=arg_grads)
    ref = reference.naive_backward(*(a.astype(np.float64) for a in raw), **opts)
    work = np.float32 if dt.name in ("float16", "bfloat16") else dt.type
    o_low, _ = reference.naive(*raw[1:], dtype=work, **{k: v for k, v in opts.items()
                                                          if not k.endswith("_grad")})
    stored = dt if dt.name in ("float16", "bfloat16") else None
    naive = reference.naive_backward(*raw, dtype=work, o=o_low.astype(dt), stored=stored, **opts)
    names = ("dq", "dk", "dv", "dbias")[:len(arrays)]
    compared = list(zip(names, arrays, ref, naive))
    if arg_grads:
        if len(grads[-1]) != len(ref[-1]):
            raise ValueError(f"{len(grads[-1])} mod_args gradients, expected {len(ref[-1])}")
        compared += [(f"mod_args[{n}]", g, r, nv) for n, (g, r, nv) in
                     enumerate(zip(grads[-1], ref[-1], naive[-1])) if r is not None or
                     g is not None]
    errors, naive_errors, bounds, rel, finite = {}, {}, {}, {}, True
    for name, g, r, n in compared:
        if g is None or r is None:
            raise ValueError(f"{name}: a gradient where the reference has none, or none where "
                             f"it has one")
        g_raw = _to_host(g)
        g = (bhsd(g_raw) if name in names[:3] else g_raw).astype(np.float64)
        if g.shape != r.shape:
            raise ValueError(f"{name} has shape {g.shape}, expected {r.shape} (bhsd order)")
        finite = finite and bool(np.isfinite(g).all())
        errors[name] = float(np.abs(g - r).max()) if g.size else 0.0
        # rounded as the result is stored: in the inputs' dtype, or a mod_args array's own
        # when that is coarser (float32 tables of float64 inputs get float32 gradients)
        out = dt if name in names or dt.itemsize <= g_raw.dtype.itemsize else g_raw.dtype
        naive_errors[name] = float(np.abs(n.astype(out).astype(np.float64) - r).max()) \
            if g.size else 0.0
        bounds[name] = 2 * naive_errors[name] + ABS_FLOOR[dt.name]
        rel[name] = float(np.linalg.norm(g - r)) / (float(np.linalg.norm(r)) or 1.0)
    return GradientReport(errors, naive_errors, bounds, finite, rel)


def assert_gradients_accurate(grads, do, q, k, v, **kwargs):
    rep = check_backward(grads, do, q, k, v, **kwargs)
    assert rep.ok, f"gradients fail the accuracy rule: {rep}"
    return rep
