"""Scratch benchmark for the CPU path (numflash.cpu.tiled) against numpy naive attention.

    python bench/cpu_probe.py bench [--reps 7] [--causal] [--dtype float32] [--N 4096]
    python bench/cpu_probe.py gemm          # numpy float32 matmul GFLOP/s on this machine
    python bench/cpu_probe.py mem           # peak memory: tracemalloc (naive) + RSS high-water
                                            #   of separate subprocesses for each method
    python bench/cpu_probe.py check         # accuracy rule over dtypes / causal modes / odd sizes

Timings: one warm-up call per method (compiles numba), then `reps` rounds; each round draws fresh
random inputs and times naive and tiled back to back (order alternates), median and min reported.
"""
import argparse
import math
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def naive(q, k, v, scale):
    s = q @ np.swapaxes(k, -1, -2) * scale
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return p @ v


def naive_causal(q, k, v, scale):
    n, nk = q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) * scale
    s = np.where(np.arange(nk)[None, :] <= np.arange(n)[:, None], s, -np.inf)
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return p @ v


def inputs(rng, B, H, N, d, dtype):
    return [rng.standard_normal((B, H, N, d)).astype(dtype) for _ in range(3)]


def bench(args):
    import numflash
    rng = np.random.default_rng(0)
    B, H, N, d = args.B, args.H, args.N, args.d
    scale = 1.0 / math.sqrt(d)
    nv = naive_causal if args.causal else naive
    q, k, v = inputs(rng, B, H, N, d, args.dtype)
    if args.block_q:  # a forced tile config, through the kernel module directly
        from numflash.cpu import tiled
        from numflash.inputs import normalize
        cfg = {"block_q": args.block_q, "block_k": args.block_k}

        def flash(q, k, v):
            p = normalize(q, k, v, causal=args.causal)
            tiled.run(p, cfg)
            return p.result
    else:
        def flash(q, k, v):
            return numflash.attention(q, k, v, causal=args.causal)
    flash(q, k, v)
    if not args.skip_naive:
        nv(q, k, v, scale)
    tn, tt = [], []
    for r in range(args.reps):
        q, k, v = inputs(rng, B, H, N, d, args.dtype)
        order = [0, 1] if r % 2 == 0 else [1, 0]
        for which in order:
            if which == 0 and args.skip_naive:
                continue
            # Let the other method's idle BLAS/OpenMP threads stop spinning before timing.
            time.sleep(args.gap)
            t0 = time.perf_counter()
            if which == 0:
                nv(q, k, v, scale)
            else:
                flash(q, k, v)
            (tn if which == 0 else tt).append(time.perf_counter() - t0)
    flops = 4 * B * H * N * N * d / (2 if args.causal else 1)
    ms = lambda xs: f"median {1e3*np.median(xs):8.1f} ms  min {1e3*min(xs):8.1f} ms"  # noqa: E731
    print(f"B={B} H={H} N={N} d={d} {args.dtype} causal={args.causal} reps={args.reps} "
          f"numba threads={__import__('numba').get_num_threads()} gap={args.gap}s")
    if tn:
        print(f"  naive : {ms(tn)}  ({flops/np.median(tn)/1e9:.1f} GFLOP/s)")
    print(f"  tiled : {ms(tt)}  ({flops/np.median(tt)/1e9:.1f} GFLOP/s)")
    if tn:
        print(f"  tiled/naive speed ratio (naive_median / tiled_median) = "
              f"{np.median(tn)/np.median(tt):.2f}  (min/min {min(tn)/min(tt):.2f})")


def gemm(args):
    rng = np.random.default_rng(0)
    for n in (1024, 2048, 4096):
        a = rng.standard_normal((n, n)).astype(np.float32)
        b = rng.standard_normal((n, n)).astype(np.float32)
        a @ b
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            a @ b
            ts.append(time.perf_counter() - t0)
        print(f"numpy float32 {n}x{n} @ {n}x{n}: median {2*n**3/np.median(ts)/1e9:.1f} GFLOP/s "
              f"(best {2*n**3/min(ts)/1e9:.1f})")
    # the shapes the tiled kernel uses, through numba's np.dot with the BLAS on one thread, as
    # the kernel runs them (process CPU time: robust to other jobs on the cores)
    from numba import njit
    from numflash.cpu.tiled import _SingleThreadedBlas

    @njit
    def qk(a, b, s, reps):
        for _ in range(reps):
            np.dot(a, b.T, s)

    @njit
    def pv(s, v, o, reps):
        for _ in range(reps):
            np.dot(s, v, o)
    with _SingleThreadedBlas():
        for bq, bk in ((128, 256), (256, 256), (256, 512), (512, 512), (1024, 1024)):
            a = rng.standard_normal((bq, 64)).astype(np.float32)
            b = rng.standard_normal((bk, 64)).astype(np.float32)
            s = np.empty((bq, bk), np.float32)
            o = np.empty((bq, 64), np.float32)
            reps = max(1, int(2e9 / (2 * bq * bk * 64)))
            qk(a, b, s, 1)
            pv(s, b, o, 1)
            r1, r2 = [], []
            for _ in range(3):
                c0 = time.process_time()
                qk(a, b, s, reps)
                r1.append(time.process_time() - c0)
                c0 = time.process_time()
                pv(s, b, o, reps)
                r2.append(time.process_time() - c0)
            f = 2 * bq * bk * 64 * reps
            print(f"one thread, d=64, block {bq}x{bk}: QK^T {f/min(r1)/1e9:6.1f} GFLOP/s, "
                  f"PV {f/min(r2)/1e9:6.1f} GFLOP/s")
        a = rng.standard_normal((2048, 2048)).astype(np.float32)
        o = np.empty_like(a)
        pv(a, a, o, 1)
        c0 = time.process_time()
        pv(a, a, o, 1)
        print(f"one thread, 2048^3: {2*2048**3/(time.process_time()-c0)/1e9:.1f} GFLOP/s")


def sweep(args):
    """Block sizes, interleaved round-robin in one process so load changes hit all alike."""
    from numflash.cpu import tiled
    from numflash.inputs import normalize
    rng = np.random.default_rng(0)
    cfgs = [(bq, bk) for bq in (64, 128, 256, 512) for bk in (128, 256, 512, 1024)]
    if args.block_q:
        cfgs = [(args.block_q, args.block_k)]
    times = {c: [] for c in cfgs}
    cpu = {c: [] for c in cfgs}
    q, k, v = inputs(rng, args.B, args.H, args.N, args.d, args.dtype)
    for r in range(args.reps + 1):
        for c in cfgs:
            p = normalize(q, k, v, causal=args.causal)
            c0, t0 = time.process_time(), time.perf_counter()
            tiled.run(p, {"block_q": c[0], "block_k": c[1]})
            if r:  # round 0 is the warm-up
                times[c].append(time.perf_counter() - t0)
                cpu[c].append(time.process_time() - c0)
    # process CPU time (all threads) is less sensitive to other people's jobs on the cores
    # than wall time; with NUMBA_NUM_THREADS=1 it is the single-core cost.
    for c in cfgs:
        print(f"block_q={c[0]:4d} block_k={c[1]:5d}: wall median {1e3*np.median(times[c]):7.1f} ms "
              f"min {1e3*min(times[c]):7.1f} ms | cpu median {1e3*np.median(cpu[c]):7.1f} ms "
              f"min {1e3*min(cpu[c]):7.1f} ms")


MEM_CHILD = r"""
import sys, math, resource, numpy as np
sys.path.insert(0, {root!r})
which, N = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
q, k, v = [rng.standard_normal((1, 8, N, 64)).astype(np.float32) for _ in range(3)]
import numflash
sys.path.insert(0, {here!r})
from cpu_probe import naive
if which == 'tiled':
    numflash.attention(q[:, :, :256], k[:, :, :256], v[:, :, :256])  # compile on a small input
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if which == 'naive':
    o = naive(q, k, v, 1 / 8)
elif which == 'tiled':
    o = numflash.attention(q, k, v)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(base, peak)
"""


def mem(args):
    import tracemalloc
    N = args.N
    # RSS first, from this still-small process: ru_maxrss survives fork+exec into the children.
    here = os.path.dirname(os.path.abspath(__file__))
    code = MEM_CHILD.format(root=os.path.dirname(here), here=here)
    out_bytes = 8 * N * 64 * 4
    for which in ("none", "naive", "tiled"):
        base, peak = map(int, subprocess.check_output([sys.executable, "-c", code, which, str(N)],
                                                      text=True).split())
        print(f"RSS high-water {which:5s}: before call {base/1024:7.1f} MiB, after {peak/1024:7.1f} "
              f"MiB, growth {(peak-base)/1024:7.1f} MiB (output itself {out_bytes/2**20:.1f} MiB)")
    rng = np.random.default_rng(0)
    q, k, v = inputs(rng, 1, 8, N, 64, np.float32)
    tracemalloc.start()
    naive(q, k, v, 1 / 8)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"tracemalloc peak of naive (beyond inputs): {peak/2**20:.1f} MiB")
    import numflash
    numflash.attention(q, k, v)
    tracemalloc.start()
    numflash.attention(q, k, v)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # numba 0.68 allocates its arrays through PyMem_RawMalloc, so tracemalloc sees them too.
    print(f"tracemalloc peak of tiled (output + lse + numba's per-task buffers): "
          f"{peak/2**20:.1f} MiB")


def check(args):
    import numflash
    from numflash.testing import check as chk
    rng = np.random.default_rng(1)
    cases = []
    for dt in ("float16", "float32", "float64"):
        for causal in (False, True, "bottom_right"):
            for (nq, nk, d) in ((1, 1, 1), (97, 97, 59), (1025, 1025, 64), (97, 1025, 111),
                                (1025, 97, 64), (300, 700, 256), (513, 64, 32), (64, 513, 128),
                                (700, 300, 64), (1, 1025, 64), (1025, 1, 16)):
                cases.append((dt, causal, nq, nk, d))
    bad = 0
    worst = {}
    for dt, causal, nq, nk, d in cases:
        q = rng.standard_normal((2, 3, nq, d)).astype(dt)
        k = rng.standard_normal((2, 3, nk, d)).astype(dt)
        v = rng.standard_normal((2, 3, nk, d)).astype(dt)
        if dt != "float64":
            q *= 2  # sharper softmax: harder for the online rescale
        o, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
        rep = chk(o, q, k, v, lse=lse, causal=causal)
        ninf = int(np.isneginf(lse).sum())
        if not rep.ok:
            bad += 1
            print("FAIL", dt, causal, nq, nk, d, rep)
        w = worst.get(dt)
        ratio = rep.max_err / rep.bound
        if w is None or ratio > w[0]:
            worst[dt] = (ratio, causal, nq, nk, d, str(rep), ninf)
    # later key blocks with much larger scores than the first: exercises the lazy rescale's
    # fallback (block sums >= 2**16) and large alphas; and a very sharp softmax
    for dt in ("float16", "float32", "float64"):
        for causal in (False, True):
            for ramp, qmul in ((0.01, 1.0), (0.003, 4.0), (0.0, 12.0)):
                q = (rng.standard_normal((1, 2, 2000, 64)) * qmul).astype(dt)
                k = (rng.standard_normal((1, 2, 2000, 64))
                     * (1 + ramp * np.arange(2000))[:, None]).astype(dt)
                v = rng.standard_normal((1, 2, 2000, 64)).astype(dt)
                o, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
                rep = chk(o, q, k, v, lse=lse, causal=causal)
                cases.append(None)
                if not rep.ok:
                    bad += 1
                    print("FAIL ramp", dt, causal, ramp, qmul, rep)
                w = worst.get(dt)
                if rep.max_err / rep.bound > w[0]:
                    worst[dt] = (rep.max_err / rep.bound, causal, 2000, 2000, 64,
                                 f"ramp={ramp} qmul={qmul} " + str(rep), 0)
    # strided (bshd) input and an explicit scale
    q, k, v = (rng.standard_normal((2, 130, 3, 40)).astype(np.float32) for _ in range(3))
    o, lse = numflash.attention(q, k, v, causal=True, layout="bshd", softmax_scale=0.3,
                                return_lse=True)
    rep = chk(o, q, k, v, lse=lse, causal=True, layout="bshd", softmax_scale=0.3)
    bad += not rep.ok
    print("bshd strided:", rep)
    # rows with no key: bottom_right with Nq > Nk
    q, k, v = (rng.standard_normal((1, 2, n, 16)).astype(np.float32) for n in (50, 20, 20))
    o, lse = numflash.attention(q, k, v, causal="bottom_right", return_lse=True)
    empty_ok = (np.all(o[:, :, :30] == 0) and np.all(np.isneginf(lse[:, :, :30]))
                and np.isfinite(o).all() and np.isfinite(lse[:, :, 30:]).all())
    bad += not empty_ok
    print(f"rows with no key (bottom_right 50x20): zeros and -inf lse, no NaN: {empty_ok}")
    for dt, w in worst.items():
        print(f"worst {dt}: err/bound={w[0]:.3f} at causal={w[1]} Nq={w[2]} Nk={w[3]} d={w[4]}: {w[5]}")
    print(f"{len(cases) + 2} cases, {bad} failed")
    return bad


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["bench", "gemm", "mem", "check", "sweep"])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--block-q", type=int, default=0)
    ap.add_argument("--block-k", type=int, default=0)
    ap.add_argument("--skip-naive", action="store_true")
    ap.add_argument("--gap", type=float, default=0.5, help="seconds of sleep before each timed call")
    a = ap.parse_args()
    sys.exit({"bench": bench, "gemm": gemm, "mem": mem, "check": check, "sweep": sweep}[a.mode](a) or 0)
