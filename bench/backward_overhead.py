"""Where a 16-bit backward call's time goes: host work against GPU kernels, numflash against
SDPA flash (issue 13's N = 1024 rows, issue 14's per-call overhead).

For each shape, each method is timed four ways on the same inputs (CuPy arrays for numflash,
torch tensors sharing their memory for SDPA):

- alone: CUDA events around one call after a synchronize (what `numflash.bench --backward`
  reports), median of --reps;
- queued: events around --calls back-to-back calls, per call (how a training step issues them);
- issue: host time to issue those --calls calls (perf_counter, no synchronize), per call: the
  host's cost of a call when the GPU is behind;
- kernels: the GPU time of each kernel a call launches (torch.profiler's CUPTI trace of --calls
  calls, which sees CuPy's and numflash's driver-API launches too), per call.

    python bench/backward_overhead.py [--n 1024 4096] [--d 64 128] [--causal both]

``--memory N``: instead, at B=1 H=16 and sequence length N, the peak device memory a backward
call uses beyond its inputs (do, q, k, v, o, lse) and its gradients (numflash: CuPy's pool
high-water mark through a memory hook; SDPA flash: torch.cuda.max_memory_allocated), with one
call's time (CUDA events, median of 3).
"""
import argparse
import json
import statistics
import time

import cupy
import torch
import torch.nn.functional as F

import numflash
from numflash.bench.timing import CudaEventTimer, per_call_ms


def kernel_times(fn, calls):
    """{kernel name: GPU us per call} over ``calls`` calls, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = e.cuda_time_total
        if us:
            out[e.key[:90]] = us / calls
    return out


def measure(fn, timer, reps, calls):
    for _ in range(3):
        fn()
    alone = statistics.median(timer(fn)[1] for _ in range(reps))
    queued = statistics.median(per_call_ms(timer, fn, calls)[0] for _ in range(3))
    issue = []
    for _ in range(3):
        torch.cuda.synchronize()
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        issue.append((time.perf_counter() - t0) / calls * 1e3)
        cupy.cuda.Device().synchronize()
    kernels = kernel_times(fn, calls)
    return {"alone_ms": alone, "queued_ms": queued, "issue_ms": statistics.median(issue),
            "kernels_us": kernels, "kernel_sum_ms": sum(kernels.values()) / 1e3}


def memory(N, dims, causals):
    from numflash.bench.backends import _peak_hook_class
    pool = cupy.get_default_memory_pool()
    hook_class = _peak_hook_class(cupy)
    rng = cupy.random.default_rng(0)
    timer = CudaEventTimer("cupy")
    print("| N | d | causal | numflash extra MiB | SDPA flash extra MiB | one q (MiB) "
          "| numflash ms | SDPA flash ms |")
    print("|---|---|---|---|---|---|---|---|")
    for d in dims:
        for causal in causals:
            shape = (1, 16, N, d)
            q, k, v, do = (rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
                           for _ in range(4))
            o, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
            call = lambda: numflash.attention_backward(do, q, k, v, o, lse,  # noqa: E731
                                                       causal=causal)
            call()
            cupy.cuda.Device().synchronize()
            base = pool.used_bytes()
            hook = hook_class(pool)
            with hook:
                grads = call()
                cupy.cuda.Device().synchronize()
            extra = hook.peak - base - sum(g.nbytes for g in grads)
            del grads
            nf_ms = statistics.median(timer(call)[1] for _ in range(3))
            tq, tk, tv = (torch.as_tensor(x, device="cuda").requires_grad_() for x in (q, k, v))
            tdo = torch.as_tensor(do, device="cuda")
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
            grad = lambda: torch.autograd.grad(out, (tq, tk, tv), tdo,  # noqa: E731
                                               retain_graph=True)
            grad()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            tbase = torch.cuda.memory_allocated()
            g = grad()
            torch.cuda.synchronize()
            t_extra = torch.cuda.max_memory_allocated() - tbase - sum(x.nbytes for x in g)
            del g
            fa_ms = statistics.median(CudaEventTimer("torch")(grad)[1] for _ in range(3))
            print(f"| {N} | {d} | {'yes' if causal else 'no'} | {extra / 2**20:.1f} | "
                  f"{t_extra / 2**20:.1f} | {q.nbytes / 2**20:.0f} | {nf_ms:.1f} | "
                  f"{fa_ms:.1f} |", flush=True)
            pool.free_all_blocks()
            torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--causal", default="both", choices=("yes", "no", "both"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--json", help="write every number here")
    p.add_argument("--memory", type=int, metavar="N", help="the peak-memory run at length N")
    a = p.parse_args()
    causals = {"yes": [True], "no": [False], "both": [False, True]}[a.causal]
    if a.memory:
        return memory(a.memory, a.d, causals)
    rows, timer_cupy, timer_torch = [], CudaEventTimer("cupy"), CudaEventTimer("torch")
    rng = cupy.random.default_rng(0)
    for N in a.n:
        for d in a.d:
            for causal in causals:
                shape = (a.batch, a.heads, N, d)
                q, k, v, do = (rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
                               for _ in range(4))
                o, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
                kernel = numflash.explain(q, k, v, causal=causal, backward=True).kernel
                nf = measure(lambda: numflash.attention_backward(do, q, k, v, o, lse,
                                                                 causal=causal),
                             timer_cupy, a.reps, a.calls)
                tq, tk, tv = (torch.as_tensor(x, device="cuda").requires_grad_()
                              for x in (q, k, v))
                tdo = torch.as_tensor(do, device="cuda")
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                    out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                fa = measure(lambda: torch.autograd.grad(out, (tq, tk, tv), tdo,
                                                         retain_graph=True),
                             timer_torch, a.reps, a.calls)
                rows.append({"N": N, "d": d, "causal": causal, "kernel": kernel,
                             "numflash": nf, "sdpa_flash": fa})
                print(f"N{N} d{d} causal={causal} ({kernel})", flush=True)
                for name, m in (("numflash", nf), ("sdpa flash", fa)):
                    print(f"  {name:10s} alone {m['alone_ms']:.3f}  queued {m['queued_ms']:.3f}"
                          f"  issue {m['issue_ms']:.3f}  kernels {m['kernel_sum_ms']:.3f} ms",
                          flush=True)
                    for kname, us in sorted(m["kernels_us"].items(), key=lambda x: -x[1]):
                        print(f"      {us:9.1f} us  {kname}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\n| N | d | causal | numflash alone / queued / issue / kernels (ms) "
          "| SDPA flash alone / queued / issue / kernels (ms) | queued ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        nf, fa = r["numflash"], r["sdpa_flash"]
        print(f"| {r['N']} | {r['d']} | {'yes' if r['causal'] else 'no'} | "
              f"{nf['alone_ms']:.3f} / {nf['queued_ms']:.3f} / {nf['issue_ms']:.3f} / "
              f"{nf['kernel_sum_ms']:.3f} | {fa['alone_ms']:.3f} / {fa['queued_ms']:.3f} / "
              f"{fa['issue_ms']:.3f} / {fa['kernel_sum_ms']:.3f} | "
              f"{fa['queued_ms'] / nf['queued_ms']:.2f}x |")


if __name__ == "__main__":
    main()
