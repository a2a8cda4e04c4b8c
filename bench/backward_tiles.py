"""cuda.mma's backward, pass by pass, for candidate tiles: the query pass (dQ), the key pass
(dK, dV) and the delta = rowsum(dO * O) preprocessing timed apart, B4 H16 N4096 by default.

    python bench/backward_tiles.py [--d 64 128] [--dtype float16] [--n 4096] [--causal]

Variants compile in parallel processes into the kernel cache first (each 10-30 s). Times by CUDA
events (numflash.bench.timing.median_ms: warm-up, median of repeats); each variant's gradients
are compared with the planner's variant's (bitwise equal is not expected across tiles: the
float32 sums are ordered differently; the GPU tests check the planner's against the reference).
"""
import argparse
import concurrent.futures
import dataclasses
import math
import multiprocessing

import numpy as np

CANDIDATES = {  # largest head dim -> pass -> [(NW, BC, SUB)]
    64: {"queries": [(4, 64, 0), (8, 64, 0), (4, 32, 0)],
         "keys": [(4, 64, 0), (8, 64, 0), (4, 32, 0), (4, 128, 64)]},
    128: {"queries": [(4, 64, 0), (8, 64, 0), (4, 32, 0)],
          "keys": [(4, 16, 0), (8, 16, 0), (4, 32, 16), (4, 64, 16), (8, 64, 16)]},
}


def _build(args):
    kernel, cfg, dtype, cc = args
    from numflash.cuda import launch
    from numflash.cuda.mma import backward, gradients
    make = backward.make_query_kernel if kernel == "queries" else backward.make_key_kernel
    k = launch.get_kernel(f"cuda.mma.backward_{kernel}", make, cfg)
    k.build(gradients.signature(dtype, kernel), cc, quiet=True)
    return kernel, str(cfg)


def main():
    import cupy
    import numflash
    from numflash.bench.timing import median_ms
    from numflash.cuda.mma import MmaConfig, backward, gradients
    from numflash.inputs import normalize_backward
    from numflash.plan import _cuda_device
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--passes", nargs="+", default=["queries", "keys"])
    a = ap.parse_args()
    dev = cupy.cuda.Device()
    cc = dev.compute_capability
    cc = (int(cc[:-1]), int(cc[-1]))
    DT = "bf16" if a.dtype == "bfloat16" else "f16"
    jobs = [(kernel, MmaConfig(d, d, NW, BC, 0, DT, 1, SUB=SUB), a.dtype, cc)
            for d in a.d for kernel, tiles in CANDIDATES[d].items() for NW, BC, SUB in tiles
            if kernel in a.passes]
    with concurrent.futures.ProcessPoolExecutor(
            8, mp_context=multiprocessing.get_context("spawn")) as pool:
        for kernel, cfg in pool.map(_build, jobs):
            print(f"built {kernel} {cfg}", flush=True)
    rng = np.random.default_rng(0)
    B, H, N = a.batch, a.heads, a.n
    print("\n| d | pass | NW | BC | SUB | ms | TFLOP/s (the pass's own products) | max diff vs "
          "plan |")
    print("|---|---|---|---|---|---|---|---|")
    for d in a.d:
        q, k, v, do = (cupy.asarray(rng.standard_normal((B, H, N, d)).astype(np.float32))
                       .astype(a.dtype) for _ in range(4))
        o, lse = numflash.attention(q, k, v, causal=a.causal, return_lse=True)
        p = normalize_backward(do, q, k, v, o, lse, causal=a.causal)
        device = _cuda_device(p)
        plan_cfg = gradients.config(p, device)
        delta_ms = median_ms(lambda: (p.do.astype(np.float32) * p.o.astype(np.float32))
                             .sum(axis=-1))
        print(f"| {d} | delta | - | - | - | {delta_ms:.3f} | - | - |")
        planned = [g.copy() for g in numflash.attention_backward(do, q, k, v, o, lse,
                                                                 causal=a.causal)]
        products = {"queries": 3, "keys": 4}
        for kernel in a.passes:
            for NW, BC, SUB in CANDIDATES[d][kernel]:
                cfg = dict(plan_cfg)
                cfg[kernel] = dataclasses.replace(plan_cfg[kernel], NW=NW, BC=BC, SUB=SUB)
                (qk, _), (kk, _) = gradients.compiled_kernels(cfg, a.dtype)
                c = cfg[kernel]
                delta = (p.do.astype(np.float32) * p.o.astype(np.float32)).sum(axis=-1)
                bits = [x.view(cupy.uint16) for x in (p.q, p.k, p.v, p.do)]
                grads = [cupy.empty_like(x) for x in (q, k, v)]
                scalars = (float(p.scale * math.log2(math.e)), float(p.scale), int(p.causal),
                           int(p.causal_offset))
                if kernel == "queries":
                    def call():
                        qk((-(-N // c.BR), B * H), (c.NT,), backward.shared_bytes(c, kernel),
                           (*bits, p.lse, delta, grads[0].view(cupy.uint16)) + scalars, device)
                    got, want = grads[0], planned[0]
                else:
                    def call():
                        kk((-(-N // c.BR), B * H), (c.NT,), backward.shared_bytes(c, kernel),
                           (*bits, p.lse, delta, grads[1].view(cupy.uint16),
                            grads[2].view(cupy.uint16)) + scalars, device)
                    got, want = grads[1], planned[1]
                ms = median_ms(call)
                diff = float(cupy.abs(got.astype(np.float32) - want.astype(np.float32)).max())
                flops = products[kernel] * 2 * B * H * N * N * d / (2 if a.causal else 1)
                print(f"| {d} | {kernel} | {NW} | {BC} | {SUB or '-'} | {ms:.3f} | "
                      f"{flops / ms / 1e9:.0f} | "
                      f"{diff:.3g} |", flush=True)


if __name__ == "__main__":
    main()
