"""Sliding-window attention against the causal kernel, N = 8192 .. 65536: a window's time should
grow as N x window, the causal kernel's as N^2 (issue 15's block-sparsity goal).

    python bench/window_scaling.py [--window 1024] [--dtype float16] [--d 128] [--heads 16]
                                   [--backward] [--algorithms auto,mma]

``--backward`` times attention_backward (the gradients of the same calls) instead.
``--algorithms``: the window is timed on each (the first one's kernel named), in the same run;
the causal column is "auto"'s.

Times by CUDA events (numflash.bench.timing.median_ms: warm-up, median of repeats); the windowed
output at the first size is checked against the float64 reference on sampled rows (the GPU tests
check the kernel across sizes and options).
"""
import argparse

import numpy as np


def main():
    import cupy
    import numflash
    from numflash.bench.timing import median_ms
    from numflash.testing import check
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--sizes", default="8192,16384,32768,65536")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--algorithms", default="auto")
    a = ap.parse_args()
    algorithms = a.algorithms.split(",")
    rng = np.random.default_rng(0)
    others = "".join(f" window on {name} ms | {algorithms[0]} / {name} |"
                     for name in algorithms[1:])
    print(f"| N | causal ms | window ({a.window}, 0) ms | window / causal | window ms per "
          f"1k tokens | checked |{others}")
    print("|---|---|---|---|---|---|" + "---|---|" * (len(algorithms) - 1))
    for i, N in enumerate(int(n) for n in a.sizes.split(",")):
        q, k, v = (cupy.asarray(rng.standard_normal((1, a.heads, N, a.d)).astype(np.float32))
                   .astype(a.dtype) for _ in range(3))
        opts = dict(causal=True, window_size=(a.window, 0))
        if i == 0:
            plan = numflash.explain(q, k, v, backward=a.backward, algorithm=algorithms[0], **opts)
            print(f"(window on {algorithms[0]}: {plan.kernel}; {a.dtype} d{a.d} H{a.heads})")
        if a.backward:
            do = cupy.asarray(rng.standard_normal(q.shape).astype(np.float32)).astype(a.dtype)

            def timed(**o):
                out, lse = numflash.attention(q, k, v, return_lse=True, **o)
                return median_ms(lambda: numflash.attention_backward(do, q, k, v, out, lse, **o))
        else:
            def timed(**o):
                return median_ms(lambda: numflash.attention(q, k, v, **o))
        causal = timed(causal=True)
        windows = [timed(algorithm=name, **opts) for name in algorithms]
        window = windows[0]
        checked = "-"
        if i == 0 and not a.backward:  # the GPU tests check the windowed gradients
            rows = np.unique(np.r_[0:8, N - 8:N, rng.choice(N, 48, replace=False)])
            rep = check(numflash.attention(q, k, v, **opts), q, k, v, rows=rows, **opts)
            checked = "ok" if rep.ok else f"FAILED {rep}"
        rest = "".join(f" {t:.3f} | {window / t:.3f} |" for t in windows[1:])
        print(f"| {N} | {causal:.3f} | {window:.3f} | {window / causal:.3f} | "
              f"{window / N * 1024:.4f} | {checked} |{rest}", flush=True)


if __name__ == "__main__":
    main()
