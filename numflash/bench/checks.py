"""The accuracy check of every timed output: numflash.testing.check (float64 reference) on all of
a small output, or on a sample of heads and query rows of a big one, so that the check never needs
more memory than the problem itself."""
import numpy as np

CHECK_ELEMS = 2 ** 22  # largest (heads x rows x Nk) score block the float64 check may build


def check_plan(B, H, Nq, Nk, max_elems=CHECK_ELEMS):
    """Which part of an output the float64 check looks at, and that choice in words.

    Returns (parts, description); each part is (b, h, rows): batch and head index (None for all)
    and an index array of query rows (None for all). Query rows are independent, so a sample of
    them is checked against every key (testing.check applies the causal mask at each row's true
    position); keys are never sliced. Big problems are checked on the first and the last
    (batch, head), on their first and last query rows.
    """
    if B * H * Nq * Nk <= max_elems:
        return [(None, None, None)], "all"
    heads = [(0, 0)] if B * H == 1 else [(0, 0), (B - 1, H - 1)]
    per_head = max(2, max_elems // (len(heads) * Nk))
    if per_head >= Nq:
        rows, rows_desc = None, "all rows"
    else:
        first = (per_head + 1) // 2
        last = per_head - first
        rows = np.concatenate([np.arange(first), np.arange(Nq - last, Nq)])
        rows_desc = f"rows 0:{first}+{Nq - last}:{Nq}"
    desc = ",".join(f"b{b}h{h}" for b, h in heads) + " " + rows_desc
    return [(b, h, rows) for b, h in heads], desc


def sampled_check(out, q, k, v, causal, max_elems=CHECK_ELEMS, to_host=np.asarray):
    """numflash.testing.check on the part of the output that :func:`check_plan` picks.

    ``out``, ``q``, ``k``, ``v``: (B, H, N, d) arrays of any kind that ``to_host`` turns into
    NumPy. Returns a dict: ok, max_err, rel_err (largest over the parts), bound, naive_err,
    checked (what was checked, in words).
    """
    from .. import testing
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    parts, desc = check_plan(B, H, Nq, Nk, max_elems)
    reports = []
    for b, h, rows in parts:
        sl = (slice(None), slice(None)) if b is None else (slice(b, b + 1), slice(h, h + 1))
        host = [to_host(a[sl]) for a in (out, q, k, v)]
        reports.append(testing.check(host[0], *host[1:], causal=causal, rows=rows))
    worst = max(reports, key=lambda r: r.max_err - r.bound)
    return {"ok": all(r.ok for r in reports), "max_err": max(r.max_err for r in reports),
            "rel_err": max(r.rel_err for r in reports), "bound": worst.bound,
            "naive_err": worst.naive_err, "finite": all(r.finite for r in reports),
            "checked": desc}



def gradient_check(cfg, sets, dos, to_host):
    """The backward suite's check: a function of (dq, dk, dv) for input set 0 and output gradient
    dos[0] that compares head (0, 0) with the float64 reference gradients
    (numflash.testing.check_backward) and returns the same dict as sampled_check."""
    from .. import testing
    head = (slice(0, 1), slice(0, 1))

    def check(grads):
        q, k, v = sets[0]
        part = [to_host(a[head]) for a in (dos[0], q, k, v)]
        rep = testing.check_backward([to_host(g[head]) for g in grads], *part,
                                     causal=cfg.causal, softmax_scale=cfg.scale)
        worst = max(rep.errors, key=lambda n: rep.errors[n] / rep.bounds[n])
        return {"ok": rep.ok, "max_err": rep.errors[worst], "bound": rep.bounds[worst],
                "naive_err": rep.naive_errors[worst], "rel_err": max(rep.rel_errors.values()),
                "checked": f"b0h0 dq, dk, dv (worst: {worst})"}
    return check
