"""The accuracy rule every test and the benchmark apply, after flash-attn's own tests.

A result passes when its max abs error against the float64 reference is at most twice the error of
naive attention computed in the same dtype, plus a small absolute floor for that dtype. The lse must
match the reference's to float32 precision, with -inf exactly where the reference has -inf.
"""
from dataclasses import dataclass

import numpy as np

from . import reference
from .inputs import normalize

ABS_FLOOR = {"float64": 1e-12, "float32": 2e-6, "float16": 2e-4, "bfloat16": 2e-3}


def _to_host(a):
    if a is None:
        return None
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def _naive_same_dtype(q, k, v, p, rows):
    """Naive attention with every step rounded to the input dtype (float16: float32 matmuls)."""
    dt = p.dtype
    work = np.float32 if dt.name in ("float16", "bfloat16") else dt.type
    o, _ = reference.naive(q, k, v, scale=p.scale, causal=p.causal, causal_offset=p.causal_offset,
                           dtype=work, query_positions=rows)
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


def check(out, q, k, v, *, lse=None, causal=False, softmax_scale=None, layout="bhsd", rows=None):
    """Compare an attention result (and optionally its lse) with the float64 reference.

    ``rows``: check only these query rows (indices into Nq) — for sizes where the full
    Nq x Nk reference would not fit; every key is still used for each checked row.
    """
    p = normalize(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout)
    qs = p.q if rows is None else p.q[:, :, rows]
    qh, kh, vh = (_to_host(a).astype(np.float64) for a in (qs, p.k, p.v))
    ref, ref_lse = reference.naive(qh, kh, vh, scale=p.scale, causal=p.causal,
                                   causal_offset=p.causal_offset, query_positions=rows)
    o = _to_host(out)
    o = (o if layout == "bhsd" else o.transpose(0, 2, 1, 3))
    if rows is not None:
        o = o[:, :, rows]
        lse = None if lse is None else _to_host(lse)[:, :, rows]
    o = o.astype(np.float64)
    if o.shape != ref.shape:
        raise ValueError(f"out has shape {o.shape}, expected {ref.shape} (bhsd order)")
    naive = _naive_same_dtype(_to_host(qs), _to_host(p.k), _to_host(p.v), p, rows)
    finite = bool(np.isfinite(o).all())
    max_err = float(np.abs(o - ref).max()) if o.size else 0.0
    naive_err = float(np.abs(naive - ref).max()) if o.size else 0.0
    bound = 2 * naive_err + ABS_FLOOR[p.dtype.name]
    denom = float(np.linalg.norm(ref)) or 1.0
    rel = float(np.linalg.norm(o - ref)) / denom if o.size else 0.0
    lse_ok = True
    if lse is not None:
        lh = _to_host(lse)
        if lh.dtype != np.float32 or lh.shape != ref_lse.shape:
            lse_ok = False
        else:
            inf_ref = np.isneginf(ref_lse)
            lse_ok = bool(np.array_equal(np.isneginf(lh), inf_ref)) and bool(np.allclose(
                lh[~inf_ref], ref_lse[~inf_ref], rtol=1e-5, atol=1e-5))
    return AccuracyReport(max_err, naive_err, bound, rel, lse_ok, finite)


def assert_accurate(out, q, k, v, **kwargs):
    rep = check(out, q, k, v, **kwargs)
    assert rep.ok, f"attention result fails the accuracy rule: {rep}"
    return rep
