"""Decode on the CPU from K/V in a KV cache's layout, (B, N, Hk, d) ("bshd"), against the same
data contiguous per head ("bhsd") and torch's CPU SDPA on both (the cache as a transposed view,
which is what a torch user passes, and a contiguous copy).

    python bench/cpu_kvcache_decode.py [--nk 32768] [--threads 2]

Times are medians of --reps calls after two warm-up calls, every method in one process, one
case's methods one after another. ms per call; the last column is numflash on the cache over
torch on the cache view.
"""
import argparse
import time

import numpy as np

import numflash

CASES = [  # (H, Hk, Nq, d, dtype)
    (32, 32, 1, 128, "float32"), (32, 8, 1, 128, "float32"), (32, 32, 4, 128, "float32"),
    (32, 8, 16, 128, "float32"), (32, 32, 1, 128, "float16"), (8, 8, 1, 64, "float64"),
]


def median_ms(fn, reps):
    fn()
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nk", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="torch's and numba's threads")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        torch = None
    if a.threads:
        import numba
        numba.set_num_threads(a.threads)
        if torch is not None:
            torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    print(f"| H, Hk, Nq, d, dtype (Nk {a.nk}) | loop | numflash cache | numflash bhsd | "
          "torch cache view | torch bhsd | numflash / torch (cache) |")
    print("|---|---|---|---|---|---|---|")
    for H, Hk, Nq, d, dtype in CASES:
        q = rng.standard_normal((1, Nq, H, d)).astype(dtype)
        k, v = (rng.standard_normal((1, a.nk, Hk, d)).astype(dtype) for _ in range(2))
        qc, kc, vc = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
        causal = "bottom_right" if Nq > 1 else False
        order = numflash.explain(q, k, v, layout="bshd", causal=causal).config.get(
            "order", "head-major")   # (trees before the key-major loop had one order)
        times = {"cache": median_ms(lambda: numflash.attention(q, k, v, layout="bshd",
                                                               causal=causal), a.reps),
                 "bhsd": median_ms(lambda: numflash.attention(qc, kc, vc, causal=causal),
                                   a.reps)}
        if torch is not None:
            sdpa = torch.nn.functional.scaled_dot_product_attention
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
            tqc, tkc, tvc = (torch.from_numpy(x) for x in (qc, kc, vc))
            # torch's is_causal is top-left: Nq > 1 rows get their bottom-right mask as a bool
            mask = None if Nq == 1 else torch.from_numpy(
                np.arange(a.nk)[None, :] <= np.arange(Nq)[:, None] + a.nk - Nq)
            gqa = dict(enable_gqa=True) if H != Hk else {}
            with torch.no_grad():
                times["torch cache"] = median_ms(lambda: sdpa(
                    tq.transpose(1, 2), tk.transpose(1, 2), tv.transpose(1, 2), attn_mask=mask,
                    **gqa), a.reps)
                times["torch bhsd"] = median_ms(lambda: sdpa(tqc, tkc, tvc, attn_mask=mask,
                                                             **gqa), a.reps)
        t = [times.get(n) for n in ("cache", "bhsd", "torch cache", "torch bhsd")]
        cells = " | ".join("-" if x is None else f"{x:.2f}" for x in t)
        ratio = "-" if t[2] is None else f"{t[0] / t[2]:.2f}"
        print(f"| H{H} Hk{Hk} Nq{Nq} d{d} {dtype} | {order} | {cells} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
