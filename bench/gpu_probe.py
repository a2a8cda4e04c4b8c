"""Kernel-development probe for one device call: times numflash's CUDA kernels against CuPy naive
attention and torch SDPA on the same inputs, checks every output, measures launch overhead, and
prints each loaded kernel's registers / local memory. `python bench/gpu_probe.py [--quick] [--json F]`

(The user-facing benchmark is `python -m numflash.bench`; this is the quick loop behind NOTES.md.)
"""
import argparse
import json
import statistics
import sys
import time

import cupy as cp
import numpy as np

import numflash
from numflash.cuda import fastpath, launch
from numflash.testing import check


def host_us_per_call(call, batches=30, calls=100):
    """Median host time of one call in microseconds, over batches of `calls` calls between
    synchronizations (far fewer than the launch queue holds, so a kernel slower than its launch
    does not turn this into a GPU timing)."""
    per = []
    for _ in range(batches):
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            call()
        per.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(per)


def cuda_time(fn, inputs, warmup=2, reps=10):
    """Median / min / max ms over reps, cycling through input sets, with CUDA events."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    times = []
    for i in range(reps):
        args = inputs[i % len(inputs)]
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times), min(times), max(times)


def naive(q, k, v, causal):
    s = q @ k.transpose(0, 1, 3, 2) * q.dtype.type(1 / np.sqrt(q.shape[-1]))
    if causal:
        n = s.shape[-1]
        s = cp.where(cp.tri(s.shape[-2], n, dtype=bool), s, -cp.inf)
    s = cp.exp(s - s.max(-1, keepdims=True))
    return (s / s.sum(-1, keepdims=True)) @ v


def sdpa_methods():
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:
        return {}

    def make(backend):
        def run(q, k, v, causal):
            tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
            return cp.from_dlpack(o)
        return run
    return {f"sdpa_{name}": make(b) for name, b in
            (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
             ("cudnn", SDPBackend.CUDNN_ATTENTION))}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--algorithms", default="block,row")
    ap.add_argument("--overhead-only", action="store_true", help="only the per-call overhead")
    ap.add_argument("--sweep-only", type=int, nargs="*", default=None,
                    help="only the block tile sweep at these sequence lengths "
                         "(B4 H16; d=64, and 128 at 4096)")
    args = ap.parse_args(argv)
    algos = args.algorithms.split(",")
    shapes = [  # B, H, N, d, dtype, causal
        (4, 16, 4096, 64, "float32", False),
        (4, 16, 4096, 64, "float32", True),
        (4, 16, 4096, 128, "float32", False),
        (4, 16, 4096, 64, "float16", False),
        (4, 16, 4096, 64, "float64", False),
        (4, 16, 512, 64, "float32", False),
        (1, 16, 16384, 64, "float32", False),
    ]
    if args.quick:
        shapes = shapes[:2]
    if args.overhead_only or args.sweep_only:
        shapes = []
    rng = np.random.default_rng(0)
    rows = []
    peers = {"cupy_naive": naive, **sdpa_methods()}
    import warnings
    warnings.filterwarnings("ignore", category=UserWarning)
    for B, H, N, d, dt, causal in shapes:
        inputs = [tuple(cp.asarray(rng.standard_normal((B, H, N, d)).astype(dt)) for _ in range(3))
                  for _ in range(2)]
        flops = 4 * B * H * N * N * d / (2 if causal else 1)
        methods = {f"numflash_{a}": (lambda a: lambda q, k, v, c: numflash.attention(
            q, k, v, causal=c, algorithm=a))(a) for a in algos}
        methods.update(peers)
        res = {}
        for name, fn in methods.items():
            try:
                out = fn(*inputs[0], causal)
                q, k, v = inputs[0]
                sample = np.r_[0:8, N - 8:N, rng.choice(N, 40, replace=False)]
                rep = check(out[:1, :2], q[:1, :2], k[:1, :2], v[:1, :2], causal=causal,
                            rows=sample)
                med, lo, hi = cuda_time(lambda q, k, v: fn(q, k, v, causal), inputs,
                                        reps=5 if N >= 16384 or dt == "float64" else 10)
                res[name] = {"ms": med, "min": lo, "max": hi, "tflops": flops / med / 1e9,
                             "ok": rep.ok, "rel": rep.rel_err}
            except Exception as e:  # a peer that refuses the input is reported, not fatal
                res[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
            cp.get_default_memory_pool().free_all_blocks()
        rows.append({"shape": [B, H, N, d, dt, causal], "results": res})
        line = f"B{B} H{H} N{N} d{d} {dt} causal={causal}:"
        for name, r in res.items():
            line += (f"\n   {name:22s} {r['ms']:9.3f} ms {r['tflops']:7.2f} TFLOP/s ok={r['ok']} "
                     f"rel={r['rel']:.2e}" if "ms" in r else f"\n   {name:22s} {r['error']}")
        print(line, flush=True)

    # Block-kernel tile sweep at the headline shape (which tile does ptxas + the H100 like best?).
    from numflash import plan as _plan
    from numflash.cuda import block
    from numflash.inputs import normalize
    sweep = {  # (tile, prefetch, pipelined micro-GEMMs); None: the module's default
        64: [((256, 64, 8, 8), None, 0), ((256, 64, 8, 8), None, 1), ((256, 64, 8, 8), False, 1),
             ((128, 32, 8, 4), None, 0), ((128, 32, 8, 4), None, 1), ((128, 64, 8, 8), None, 0),
             ((128, 64, 8, 8), None, 1), ((128, 64, 8, 4), None, 1), ((64, 64, 8, 4), None, 1)],
        128: [((128, 32, 8, 4), None, 0), ((128, 32, 8, 4), None, 1), ((128, 64, 8, 4), None, 0),
              ((128, 64, 8, 4), None, 1), ((64, 64, 8, 4), None, 1), ((128, 64, 8, 8), None, 0),
              ((128, 64, 8, 8), None, 1)]}
    runs = [(n, d) for n in (args.sweep_only or [4096])
            for d in ((64, 128) if n == 4096 else (64,))]
    for N, d in runs if not args.overhead_only else ():
        dt = "float32"
        q, k, v = (cp.asarray(rng.standard_normal((4, 16, N, d)).astype(dt)) for _ in range(3))
        prob = normalize(q, k, v)
        dev = _plan.choose(prob, "cuda", "block").device
        for tile, prefetch, pipelined in sweep[d]:
            cfg = block.tile_config(d, d, tile, "float32", prefetch, pipelined)
            name = "x".join(map(str, tile[:2])) + "/" + "x".join(map(str, tile[2:])) + \
                f" PF={cfg['PF']} SP={cfg['SP']}"
            if block.shared_bytes(cfg) > dev.smem_per_block_optin:
                continue
            try:
                block.run(prob, cfg, dev)
                rep = check(prob.out[:1, :1], q[:1, :1], k[:1, :1], v[:1, :1], rows=np.r_[0:64])
                med, lo, hi = cuda_time(lambda a, b_, c: block.run(prob, cfg, dev), [(q, k, v)])
                res = launch.get_kernel(block.NAME, block.make_kernel, cfg)
                regs = next(iter(res._loaded.values())).meta["resources"]
                print(f"tile N={N} d={d} {name}: {med:8.3f} ms "
                      f"{4 * 4 * 16 * N * N * d / med / 1e9:6.2f} TFLOP/s ok={rep.ok} "
                      f"regs={regs.get('registers')} spill={regs.get('spill_store_bytes', 0)}",
                      flush=True)
            except Exception as e:
                print(f"tile N={N} d={d} {name}: {type(e).__name__}: {str(e)[:100]}")

    if args.sweep_only:
        return
    # Per-call overhead at a tiny size vs a bare RawKernel launch (host wall time per call).
    q = cp.asarray(rng.standard_normal((1, 1, 128, 64)).astype("float32"))
    empty = cp.RawKernel('extern "C" __global__ void e(float* x){}', "e")
    numflash.attention(q, q, q)
    empty((1,), (32,), (q,))
    cp.cuda.Device().synchronize()
    overhead = {name: host_us_per_call(call) for name, call in (
        ("numflash", lambda: numflash.attention(q, q, q)),
        ("raw_kernel", lambda: empty((1,), (32,), (q,))))}
    print(f"per-call host time: numflash {overhead['numflash']:.1f} us, bare RawKernel "
          f"{overhead['raw_kernel']:.1f} us, difference {overhead['numflash'] - overhead['raw_kernel']:.1f} us")
    # Where the replayed call's time goes, piece by piece (host time, 100-call batches).
    options = fastpath.call_options(False, None, "bhsd", "auto", "auto", False, "auto")
    replay = fastpath.lookup(fastpath.signature(q, q, q, options))  # the call timed above
    stream_ptr = cp.cuda.get_current_stream().ptr
    out, lse = cp.empty_like(q), cp.empty(q.shape[:3], cp.float32)
    pointers = (q.data.ptr, q.data.ptr, q.data.ptr, out.data.ptr, lse.data.ptr)
    for name, call in (("cupy.empty", lambda: cp.empty((1, 1, 128, 64), cp.float32)),
                       ("get_current_stream().ptr", lambda: cp.cuda.get_current_stream().ptr),
                       ("fastpath.signature", lambda: fastpath.signature(q, q, q, options)),
                       ("Recipe.launch", lambda: replay.recipe.launch(stream_ptr, pointers)),
                       ("Replay (2 empty + launch)", lambda: replay(q, q, q))):
        print(f"  piece {name:28s} {host_us_per_call(call):6.2f} us", flush=True)
    first_call = []
    for _ in range(200):  # the full path (checks, plan, packing), as every new signature takes
        fastpath.clear()
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        numflash.attention(q, q, q)
        first_call.append((time.perf_counter() - t) * 1e6)
    overhead["full_path"] = statistics.median(first_call)
    print(f"per-call host time of the full path (new signature): {overhead['full_path']:.1f} us")

    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        numflash.attention(q, q, q)
    prof.disable()
    cp.cuda.Device().synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)

    resources = []
    for kern in launch._kernels.values():
        for key, loaded in kern._loaded.items():
            resources.append({"kernel": kern.name, "config": kern.config,
                              "ptxas": loaded.meta["resources"]})
            print(f"{kern.name} {kern.config}: ptxas {loaded.meta['resources']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                       "rows": rows, "overhead_us": overhead, "resources": resources}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
