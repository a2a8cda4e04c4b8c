"""A packed training batch on the GPU: sequences of lengths drawn from 128..8192 (total 65536
tokens by default), causal, forward and forward + backward, as packed sequences in one launch
(numflash.attention_varlen), as one call per sequence (what attention_varlen ran before the
one-launch kernels), and padded to the longest sequence as one dense batch; against torch's
varlen_attn (flash) and SDPA on the padded batch where torch has them.

    python bench/varlen.py [--dtypes float16,bfloat16] [--total 65536] [--heads 16] [--d 64,128]
                           [--seed 0] [--reps 10] [--out FILE.json]
    python bench/varlen.py --cpu --total 8192 --max 2048 --heads 8 --d 64 --reps 3
    python bench/varlen.py --one-sequence 16384 --dtypes float16,float32
    python bench/varlen.py --window 1024 --softcap 30   # modifications in the one launch
    python bench/varlen.py --dropout 0.1                # dropout in the one launch

Padding on the right with causal (top-left) masking gives every real query row exactly its
sequence's keys, so the padded batch computes the same rows as the packed one, plus the padding's
work. ms are CUDA events around each call (warm-up, median of repeats;
numflash.bench.timing.median_ms); TFLOP/s count each sequence's causal FLOPs (4 n^2 d H / 2
forward, 2.5x that for the backward), not the padding's (with --window, too: the FLOPs the
window skips are still counted). Every numflash result is checked against the float64 reference
on its shortest and longest sequences' first two heads. ``--window W`` / ``--softcap S`` give
every numflash call window_size=(W, 0) and that softcap; torch's varlen_attn takes the window
only (not timed with a softcap), SDPA on the padded batch neither (not timed with them).
``--dropout P``: dropout_p=P, the one launch under seed DROPOUT_SEED and sequence b's own call
under numflash.dropout.packed_seed(DROPOUT_SEED, b) (the same masks, both checked against the
reference with them); the padded batch and the peers are not timed with it (the padded call's
masks are drawn for its batch entries, which the reference check cannot cut apart).
"""
import argparse
import json

import numpy as np

#: the --dropout runs' seed
DROPOUT_SEED = 1234


def draw_lengths(rng, total, low=128, high=8192):
    """Lengths from low..high (uniform) until they sum to ``total`` (the last one trimmed)."""
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(rng.integers(low, high + 1)))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--total", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    ap.add_argument("--one-sequence", type=int, default=0, metavar="N",
                    help="instead: what the packed variant costs over the plain kernels, one "
                         "sequence of N tokens through attention_varlen against attention()")
    ap.add_argument("--cpu", action="store_true",
                    help="instead: the CPU path (NumPy) against torch's CPU SDPA on the padded "
                         "batch (use a smaller --total, e.g. 8192, and --max 2048)")
    ap.add_argument("--max", type=int, default=8192, help="longest length drawn")
    ap.add_argument("--window", type=int, default=None,
                    help="window_size=(W, 0) for every numflash call")
    ap.add_argument("--softcap", type=float, default=None, help="a softcap for numflash's calls")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="dropout_p for the one launch and the per-sequence calls")
    a = ap.parse_args()
    if a.one_sequence:
        return one_sequence(a)
    if a.cpu:
        return cpu_table(a)
    import cupy
    import numflash
    from numflash import testing
    from numflash.bench.timing import median_ms
    from numflash.dropout import packed_seed
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    rng = np.random.default_rng(a.seed)
    lengths = draw_lengths(rng, a.total, high=a.max)
    B, longest, H = len(lengths), max(lengths), a.heads
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    opts = {name: value for name, value in (("window_size", None if a.window is None else
                                             (a.window, 0)), ("softcap", a.softcap))
            if value is not None}
    drop = dict(dropout_p=a.dropout, dropout_seed=DROPOUT_SEED) if a.dropout else {}

    def sequence_drop(b):   # sequence b's own call draws what the one launch draws for it
        return dict(drop, dropout_seed=packed_seed(DROPOUT_SEED, b)) if drop else {}
    print(f"{B} sequences, {a.total} tokens, longest {longest} (padded: {B * longest} tokens), "
          f"H{H}, causal{''.join(f', {n}={v}' for n, v in {**opts, **drop}.items())}; "
          f"lengths {lengths}")
    methods = ["varlen (one launch)", "per-sequence calls", "padded", "torch varlen_attn",
               "SDPA flash, padded"]
    print("ms (TFLOP/s of the sequences' own causal work)")
    print("| dtype | d | pass | " + " | ".join(methods) + " | one launch vs padded | "
          "vs best peer | check |")
    print("|---" * (6 + len(methods)) + "|")
    rows = []
    for dtype in a.dtypes.split(","):
        dt = np.dtype(__import__("ml_dtypes").bfloat16) if dtype == "bfloat16" else dtype
        for d in (int(x) for x in a.d.split(",")):
            q, k, v, do = (cupy.asarray(rng.standard_normal((a.total, H, d), np.float32))
                           .astype(dt) for _ in range(4))
            flops = sum(4 * n * n * d * H / 2 for n in lengths)
            padded = []
            for x in (q, k, v, do):   # (B, longest, H, d), zeros past each sequence
                p = cupy.zeros((B, longest, H, d), dt)
                for b, n in enumerate(lengths):
                    p[b, :n] = x[int(cu[b]):int(cu[b]) + n]
                padded.append(p)
            qp, kp, vp, dop = padded

            def one_launch():
                return numflash.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True,
                                                 **opts, **drop)

            def per_sequence():
                out = cupy.empty_like(q)
                lse = cupy.empty((H, a.total), np.float32)
                for b, n in enumerate(lengths):
                    s = int(cu[b])
                    lse[:, s:s + n] = numflash.attention(
                        q[None, s:s + n], k[None, s:s + n], v[None, s:s + n], causal=True,
                        layout="bshd", out=out[None, s:s + n], return_lse=True, **opts,
                        **sequence_drop(b))[1][0]
                return out, lse

            def per_sequence_backward(out, lse):
                grads = [cupy.empty_like(x) for x in (q, k, v)]
                for b, n in enumerate(lengths):
                    s = int(cu[b])
                    sl = slice(s, s + n)
                    numflash.attention_backward(
                        do[None, sl], q[None, sl], k[None, sl], v[None, sl], out[None, sl],
                        cupy.ascontiguousarray(lse[:, sl])[None], causal=True, layout="bshd",
                        dq=grads[0][None, sl], dk=grads[1][None, sl], dv=grads[2][None, sl],
                        **opts, **sequence_drop(b))
                return grads

            def padded_forward():
                return numflash.attention(qp, kp, vp, causal=True, layout="bshd",
                                          return_lse=True, **opts)

            fwd = {"varlen (one launch)": one_launch, "per-sequence calls": per_sequence,
                   "padded": padded_forward}
            out_v, lse_v = one_launch()
            out_s, lse_s = per_sequence()
            out_p, lse_p = padded_forward()
            both = {
                "varlen (one launch)": lambda: numflash.attention_varlen_backward(
                    do, q, k, v, *one_launch(), cu, cu, causal=True, **opts, **drop),
                "per-sequence calls": lambda: per_sequence_backward(*per_sequence()),
                "padded": lambda: numflash.attention_backward(
                    dop, qp, kp, vp, *padded_forward(), causal=True, layout="bshd", **opts),
            }
            if drop:   # (the padded call would draw other masks: not timed, not checked)
                del fwd["padded"], both["padded"]
            if torch is not None and not drop:
                tq, tk, tv, tdo = (torch.from_dlpack(x) for x in (q, k, v, do))
                tcu = torch.from_dlpack(cu)
                if varlen_attn is not None and "softcap" not in opts:
                    def torch_varlen(grad=False):
                        xs = [x.detach().requires_grad_(grad) for x in (tq, tk, tv)]
                        o = varlen_attn(*xs, tcu, tcu, longest, longest,
                                        window_size=(a.window if a.window is not None else -1,
                                                     0))
                        return torch.autograd.grad(o, xs, tdo) if grad else o
                    fwd["torch varlen_attn"] = torch_varlen
                    both["torch varlen_attn"] = lambda: torch_varlen(True)
                tqp, tkp, tvp, tdop = (torch.from_dlpack(x).transpose(1, 2)
                                       for x in (qp, kp, vp, dop))

                def sdpa(grad=False):
                    xs = [x.detach().requires_grad_(grad) for x in (tqp, tkp, tvp)]
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        o = torch.nn.functional.scaled_dot_product_attention(*xs,
                                                                             is_causal=True)
                    return torch.autograd.grad(o, xs, tdop) if grad else o
                if not opts:
                    fwd["SDPA flash, padded"] = sdpa
                    both["SDPA flash, padded"] = lambda: sdpa(True)
            # the reference check: shortest and longest sequences, first two heads
            checks = []
            for b in (int(np.argmin(lengths)), int(np.argmax(lengths))):
                s, n = int(cu[b]), lengths[b]
                seq = [x[None, s:s + n, :2].get() for x in (q, k, v)]
                for name, got in (("one launch", out_v), ("per-sequence", out_s)):
                    rep = testing.check(got[None, s:s + n, :2].get(), *seq, causal=True,
                                        layout="bshd", **opts, **sequence_drop(b))
                    checks.append(rep.ok)
                if not drop:
                    rep = testing.check(out_p[b:b + 1, :n, :2].get(), *seq, causal=True,
                                        layout="bshd", **opts)
                    checks.append(rep.ok)
            check = "OK" if all(checks) else "FAIL"
            for label, table, factor in (("forward", fwd, 1.0), ("fwd+bwd", both, 3.5)):
                times = {}
                for name in methods:
                    fn = table.get(name)
                    if fn is None:
                        times[name] = None
                        continue
                    try:
                        times[name] = median_ms(fn, reps=a.reps)
                    except Exception as e:  # a peer that refuses these inputs
                        times[name] = f"n/a ({str(e).splitlines()[0][:40]})"
                cells = [f"{t:.2f} ({flops * factor / t / 1e9:.0f})" if isinstance(t, float)
                         else (t or "-") for t in times.values()]
                ours = times["varlen (one launch)"]
                peers = [t for n, t in times.items() if isinstance(t, float) and
                         n in ("torch varlen_attn", "SDPA flash, padded")]
                vs_pad = (f"{times['padded'] / ours:.2f}x" if isinstance(times["padded"], float)
                          else "-")
                vs_peer = f"{min(peers) / ours:.2f}x" if peers else "-"
                print(f"| {dtype} | {d} | {label} | " + " | ".join(cells) +
                      f" | {vs_pad} | {vs_peer} | {check} |", flush=True)
                rows.append({"dtype": dtype, "d": d, "pass": label, "ms": times,
                             "mods": {**opts, **drop},
                             "tflops_counted": flops * factor / 1e12, "check": check,
                             "lengths": lengths, "heads": H})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    _plot(rows, a.out)


def cpu_table(a):
    """The packed batch on the CPU: attention_varlen (one call per sequence, the numba path)
    against the same batch padded through numflash and through torch's CPU SDPA (float32,
    causal), forward and forward + backward; wall-clock medians (time.perf_counter)."""
    import statistics
    import time
    import numflash
    torch = None
    try:
        import torch
    except ImportError:
        pass
    rng = np.random.default_rng(a.seed)
    lengths = draw_lengths(rng, a.total, high=a.max)
    B, longest, H = len(lengths), max(lengths), a.heads
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    print(f"CPU: {B} sequences, {a.total} tokens, longest {longest}, H{H}, float32, causal: ms")
    print("| d | pass | varlen | padded (numflash) | torch SDPA, padded | varlen vs torch |")
    print("|---|---|---|---|---|---|")

    def median_wall(fn, reps):
        fn()   # warm-up (compiles on first use)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    for d in (int(x) for x in a.d.split(",")):
        q, k, v, do = (rng.standard_normal((a.total, H, d), np.float32) for _ in range(4))
        padded = []
        for x in (q, k, v, do):
            p = np.zeros((B, longest, H, d), np.float32)
            for b, n in enumerate(lengths):
                p[b, :n] = x[cu[b]:cu[b] + n]
            padded.append(p)
        qp, kp, vp, dop = padded
        fwd = lambda: numflash.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)
        pad = lambda: numflash.attention(qp, kp, vp, causal=True, layout="bshd", return_lse=True)
        rows = {"forward": [fwd, pad], "fwd+bwd": [
            lambda: numflash.attention_varlen_backward(do, q, k, v, *fwd(), cu, cu, causal=True),
            lambda: numflash.attention_backward(dop, qp, kp, vp, *pad(), causal=True,
                                                layout="bshd")]}
        if torch is not None:
            tq, tk, tv, tdo = (torch.from_numpy(x).transpose(1, 2) for x in padded)

            def sdpa(grad=False):
                xs = [x.detach().requires_grad_(grad) for x in (tq, tk, tv)]
                o = torch.nn.functional.scaled_dot_product_attention(*xs, is_causal=True)
                return torch.autograd.grad(o, xs, tdo) if grad else o
            rows["forward"].append(sdpa)
            rows["fwd+bwd"].append(lambda: sdpa(True))
        for label, fns in rows.items():
            times = [median_wall(fn, a.reps) for fn in fns]
            vs = f"{times[2] / times[0]:.2f}x" if len(times) > 2 else "-"
            cells = [f"{t:.1f}" for t in times] + (["-"] if len(times) < 3 else [])
            print(f"| {d} | {label} | " + " | ".join(cells) + f" | {vs} |", flush=True)


def one_sequence(a):
    """attention_varlen on a single sequence against attention() on the same memory (bshd):
    the same tiles, so the difference is what the packed variant's per-block sequence lookup
    and its register cost add (forward, and forward + backward)."""
    import cupy
    import numflash
    from numflash.bench.timing import median_ms
    N, H = a.one_sequence, a.heads
    cu = cupy.asarray(np.array([0, N], np.int32))
    rng = np.random.default_rng(a.seed)
    print(f"one sequence of {N} tokens, H{H}, causal: ms")
    print("| dtype | d | pass | attention() | attention_varlen | varlen / plain | kernels: plain "
          "| kernels: packed | packed / plain |")
    print("|---" * 9 + "|")
    for dtype in a.dtypes.split(","):
        dt = np.dtype(__import__("ml_dtypes").bfloat16) if dtype == "bfloat16" else dtype
        for d in (int(x) for x in a.d.split(",")):
            q, k, v, do = (cupy.asarray(rng.standard_normal((N, H, d), np.float32)).astype(dt)
                           for _ in range(4))
            plain_f = lambda: numflash.attention(q[None], k[None], v[None], causal=True,
                                                 layout="bshd", return_lse=True)
            packed_f = lambda: numflash.attention_varlen(q, k, v, cu, cu, causal=True,
                                                         return_lse=True)
            plain_b = lambda: numflash.attention_backward(
                do[None], q[None], k[None], v[None], *plain_f(), causal=True, layout="bshd")
            packed_b = lambda: numflash.attention_varlen_backward(do, q, k, v, *packed_f(),
                                                                  cu, cu, causal=True)
            kernels = _kernels_only(q, k, v, do, cu)
            for label, plain, packed in (("forward", plain_f, packed_f),
                                         ("fwd+bwd", plain_b, packed_b)):
                tp, tv = median_ms(plain, reps=a.reps), median_ms(packed, reps=a.reps)
                kp, kv = (median_ms(f, reps=a.reps) for f in kernels[label])
                print(f"| {dtype} | {d} | {label} | {tp:.3f} | {tv:.3f} | {tv / tp:.3f} | "
                      f"{kp:.3f} | {kv:.3f} | {kv / kp:.3f} |", flush=True)


def _kernels_only(q, k, v, do, cu):
    """{"forward": (plain, packed), "backward": (plain, packed)}: the plans' launches alone on
    problems made once (no argument checks, no copy of cu_seqlens to the host)."""
    from numflash import plan as planner
    from numflash.inputs import normalize, normalize_backward
    from numflash.varlen import _one_launch
    ends = np.array([0, q.shape[0]])
    made = {}
    for name, extra in (("plain", None), ("packed", cu)):
        fwd = normalize(q[None], k[None], v[None], causal=True, layout="bshd", return_lse=True)
        plan = (planner.choose(fwd) if extra is None else
                _one_launch(fwd, ends, ends, cu, cu, True, "auto", "auto")[0])
        lse = plan.run(fwd)
        back = normalize_backward(do[None], q[None], k[None], v[None], fwd.result, lse,
                                  causal=True, layout="bshd")
        back_plan = (planner.choose(back) if extra is None else
                     _one_launch(back, ends, ends, cu, cu, True, "auto", "auto")[0])
        made[name] = (lambda p=plan, f=fwd: p.run(f), lambda p=back_plan, b=back: p.run(b))
    return {"forward": (made["plain"][0], made["packed"][0]),
            "fwd+bwd": (made["plain"][1], made["packed"][1])}


def _plot(rows, out):
    """A bar chart of the rows next to the JSON (when matplotlib is installed)."""
    if not out:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{r['dtype']} d{r['d']}\n{r['pass']}" for r in rows]
    names = list(rows[0]["ms"])
    fig, ax = plt.subplots(figsize=(1.8 * len(rows) + 2, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [r["ms"][name] if isinstance(r["ms"][name], float) else 0 for r in rows]
        ax.bar(np.arange(len(rows)) + i * width, vals, width, label=name)
    ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, labels, fontsize=8)
    ax.set_ylabel("ms (lower is better)")
    ax.set_title("packed batch, causal: one launch, per-sequence calls, padded, torch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.rsplit(".", 1)[0] + ".png", dpi=110)


if __name__ == "__main__":
    main()
