"""cuda.mma's backward for candidate tiles: each (query pass, key pass) tile pair of the chosen
dtype and head dims compiled (ptxas registers and spills reported), then the whole backward
timed, B4 H16 N4096 by default.

    python bench/backward_tiles.py [--dtype float32] [--d 64 128] [--n 4096] [--causal]

Variants compile in parallel processes into the kernel cache first. One candidate per pass is
varied at a time, the other pass keeping the planner's tile, so a row's time differs from the
planner's row by that pass alone. Times by CUDA events (numflash.bench.timing.median_ms:
warm-up, median of repeats); each row's gradients are compared with the planner's row (bitwise
equality is not expected across tiles: float32 sums run in another order; the GPU tests check the
planner's choice against the reference).
"""
import argparse
import concurrent.futures
import dataclasses
import multiprocessing

import numpy as np

#: (dtype, largest head dim) -> pass -> [(NW, BC, SUB)] tried beside the planner's tiles
CANDIDATES = {
    ("float16", 64): {"keys": [(4, 128, 64), (8, 128, 32), (8, 64, 0)]},
    ("float16", 128): {"keys": [(8, 64, 16), (8, 32, 32), (4, 64, 32), (8, 64, 64)]},
    ("float32", 64): {"queries": [(4, 64, 0), (4, 32, 0), (8, 32, 0)],
                      "keys": [(4, 64, 16), (4, 32, 16), (8, 32, 16), (4, 64, 8)]},
    ("float32", 128): {"queries": [(4, 32, 0), (4, 16, 0), (8, 16, 0)],
                       "keys": [(4, 32, 8), (4, 16, 8), (8, 16, 8), (4, 64, 8)]},
    ("float64", 64): {"queries": [(4, 32, 0), (4, 16, 0), (8, 16, 0)],
                      "keys": [(4, 32, 8), (4, 16, 8), (2, 32, 8), (8, 16, 8)]},
}


def _build(args):
    kernel, cfg, dtype, cc = args
    from numflash.cuda import launch
    from numflash.cuda.mma import backward, gradients
    make = backward.make_query_kernel if kernel == "queries" else backward.make_key_kernel
    k = launch.get_kernel(f"cuda.mma.backward_{kernel}", make, cfg)
    _, meta = k.build(gradients._signature(dtype, kernel, cfg), cc, quiet=True)
    res = meta.get("resources", {})
    return (kernel, str(cfg), res.get("registers", 0),
            res.get("spill_store_bytes", 0) + res.get("spill_load_bytes", 0))


def _variants(plan_cfg, dtype, d, repeatable_cfg=None):
    """[(pass varied or None, {"queries": cfg, "keys": cfg})]: the planner's pair first; where
    deterministic=True plans another pair (the two passes beside dQ adds), that one next."""
    out = [(None, dict(plan_cfg))]
    if repeatable_cfg and dict(repeatable_cfg) != dict(plan_cfg):
        out.append(("deterministic", dict(repeatable_cfg)))
    for kernel, tiles in CANDIDATES.get((dtype, d), {}).items():   # else the planner's alone
        for NW, BC, SUB in tiles:
            c = dataclasses.replace(plan_cfg[kernel], NW=NW, BC=BC, SUB=SUB)
            if c != plan_cfg[kernel]:
                out.append((kernel, {**plan_cfg, kernel: c}))
    return out


def main():
    import cupy
    import numflash
    from numflash.bench.timing import median_ms
    from numflash.cuda.mma import gradients
    from numflash.inputs import normalize_backward
    from numflash.plan import _cuda_device
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dtype", default="float32", choices=("float16", "float32", "float64"))
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--jobs", type=int, default=12)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    B, H, N = a.batch, a.heads, a.n
    rows = []
    for d in a.d:
        q, k, v, do = (cupy.asarray(rng.standard_normal((B, H, N, d)).astype(a.dtype))
                       for _ in range(4))
        o, lse = numflash.attention(q, k, v, causal=a.causal, return_lse=True)
        p = normalize_backward(do, q, k, v, o, lse, causal=a.causal)
        device = _cuda_device(p)
        p.deterministic = True
        repeatable = gradients.config(p, device)
        p.deterministic = False
        variants = _variants(gradients.config(p, device), a.dtype, d, repeatable)
        jobs = {(kernel, c) for _, cfg in variants for kernel, c in cfg.items()}
        with concurrent.futures.ProcessPoolExecutor(
                a.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            built = {}
            for kernel, name, regs, spill in pool.map(
                    _build, [(kernel, c, a.dtype, device.cc) for kernel, c in jobs]):
                built[(kernel, name)] = (regs, spill)
                print(f"built {kernel} {name}: {regs} registers, {spill} bytes spilled",
                      flush=True)
        want = None
        for varied, cfg in variants:
            p.dq, p.dk, p.dv = (cupy.empty_like(x) for x in (q, k, v))
            ms = median_ms(lambda: gradients.run(p, cfg, device))
            got = [g.copy() for g in (p.dq, p.dk, p.dv)]
            want = want or got
            diff = max(float(cupy.abs(x.astype(np.float64) - y.astype(np.float64)).max())
                       for x, y in zip(got, want))
            flops = 2.5 * 4 * B * H * N * N * d / (2 if a.causal else 1)
            kernel = varied or "planner"
            c = cfg["queries"], cfg["keys"]
            regs = "/".join(f"{built[(n, str(x))][0]}r {built[(n, str(x))][1]}B"
                            for n, x in zip(("queries", "keys"), c))
            rows.append(f"| {d} | {kernel} | {(c[0].NW, c[0].BC)} | "
                        f"{(c[1].NW, c[1].BC, c[1].SUB)} | {regs} | {ms:.3f} | "
                        f"{flops / ms / 1e9:.1f} | {diff:.3g} |")
            print(rows[-1], flush=True)
    print(f"\n{a.dtype} B{B} H{H} N{N}{' causal' if a.causal else ''}: the whole backward "
          "(delta, query pass, key pass); TFLOP/s counted as 2.5x the forward's FLOPs")
    print("| d | varied | queries (NW, BC) | keys (NW, BC, SUB) | registers, spill bytes "
          "(queries / keys) | ms | TFLOP/s | max diff vs planner |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
