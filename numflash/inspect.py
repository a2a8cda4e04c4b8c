"""`python -m numflash.inspect`: compile every CUDA kernel variant and print what ptxas reports.

Per kernel and config: registers, spill bytes, stack frame and shared memory, for one or more
architectures, with no GPU needed (numba -> PTX -> nvJitLink with ptxas -v). `--check` exits
non-zero if any default config spills, so CI can hold the line.
"""
import argparse
import sys


DTYPES = ("float16", "float32", "float64")
HEAD_DIMS = (1, 32, 59, 64, 111, 128, 256)
KERNELS = ("block", "row", "mma")


def variants(archs, head_dims=HEAD_DIMS, dtypes=DTYPES, kernels=KERNELS):
    """(kernel module, config, dtype, cc) for the default config of every kernel at each size."""
    from .device import Device
    from .kernels import operators
    from .precompile import StandIn
    for cc in archs:
        device = Device.of_arch(cc)
        for op in (operators()[f"cuda.{k}"] for k in kernels):
            for d in head_dims:
                for dt in dtypes:
                    try:
                        cfg = op.config(StandIn(d, dt), device)
                    except ValueError as e:  # Unsupported: this arch can't take it
                        yield op.module, None, dt, cc, d, str(e)
                        continue
                    yield op.module, cfg, dt, cc, d, None


def inspect(archs, head_dims=HEAD_DIMS, dtypes=DTYPES, out=sys.stdout, kernels=("block", "row")):
    """Compile each variant once; returns a list of result dicts. ``kernels`` may add "mma"
    (each tensor-core variant takes ~0.5-2 minutes to compile)."""
    from .cuda import launch
    rows, seen = [], set()
    for module, cfg, dt, cc, d, why in variants(archs, head_dims, dtypes, kernels):
        if cfg is None:
            rows.append({"kernel": module.NAME, "cc": cc, "d": d, "dtype": dt, "unsupported": why})
            continue
        key = (module.NAME, tuple(sorted(cfg.items())), dt, cc)
        if key in seen:
            continue
        seen.add(key)
        shared = module.shared_bytes(cfg)
        (kernel, args), = module.compiled_kernels(cfg, dt)
        _, _, ptx, res = launch.compile_to_cubin(kernel.pyfunc, args, cc)
        rows.append({"kernel": module.NAME, "cc": cc, "d": d, "dtype": dt, "config": dict(cfg),
                     "shared_bytes": shared, **res})
    print(f"{'kernel':11s} {'sm':>3s} {'dtype':8s} {'config':52s} {'regs':>4s} {'spill':>5s} "
          f"{'stack':>5s} {'smem':>7s}", file=out)
    for r in rows:
        if "unsupported" in r:
            print(f"{r['kernel']:11s} {r['cc'][0]}{r['cc'][1]:<2d} {r['dtype']:8s} d={r['d']}: "
                  f"{r['unsupported'][:90]}", file=out)
            continue
        cfg = " ".join(f"{k}={v}" for k, v in r["config"].items())
        spill = r.get("spill_store_bytes", 0) + r.get("spill_load_bytes", 0)
        print(f"{r['kernel']:11s} {r['cc'][0]}{r['cc'][1]:<2d} {r['dtype']:8s} {cfg:52s} "
              f"{r.get('registers', 0):4d} {spill:5d} {r.get('stack_bytes', 0):5d} "
              f"{r['shared_bytes']:7d}", file=out)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m numflash.inspect",
        description="Compile CUDA kernel variants and print what ptxas reports (registers, spills, "
                    "stack, shared memory). Needs no GPU, only numba-cuda: pip install "
                    "'numflash[cuda13]' (or '[cuda12]').")
    ap.add_argument("--arch", default="75,80,90", help="comma-separated compute capabilities")
    ap.add_argument("--d", default=None, help="comma-separated head dims")
    ap.add_argument("--dtype", default=None, help="comma-separated dtypes")
    ap.add_argument("--kernels", default="block,row",
                    help="comma-separated: block, row, mma (default block,row: each cuda.mma "
                         "variant takes 0.5-2 minutes to compile, so ask for it)")
    ap.add_argument("--check", action="store_true",
                    help="fail if any default config spills registers")
    args = ap.parse_args(argv)
    archs = [(int(a[0]), int(a[1:])) for a in args.arch.split(",")]
    dims = tuple(int(x) for x in args.d.split(",")) if args.d else HEAD_DIMS
    dtypes = tuple(args.dtype.split(",")) if args.dtype else DTYPES
    rows = inspect(archs, dims, dtypes, kernels=tuple(args.kernels.split(",")))
    if args.check:
        bad = [r for r in rows if "config" in r
               and r.get("spill_store_bytes", 0) + r.get("spill_load_bytes", 0) > 0]
        if bad:
            print(f"{len(bad)} default configs spill registers", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
