"""`python -m numflash.inspect`: compile every CUDA kernel variant and print what ptxas reports.

Per kernel and config: registers, spill bytes, stack frame and shared memory, for one or more
architectures, with no GPU needed (numba -> PTX -> nvJitLink with ptxas -v). `--check` exits
non-zero if any default config spills, so CI can hold the line.
"""
import argparse
import sys

import numpy as np

DTYPES = ("float16", "float32", "float64")
HEAD_DIMS = (1, 32, 59, 64, 111, 128, 256)


class _Shape:
    """Just enough of a Problem for a kernel module's config()."""

    def __init__(self, d, dtype):
        self.shape = (1, 1, 128, 128, d, d)
        self.dtype = np.dtype(dtype)
        self.dtype_name = self.dtype.name


def argtypes(dtype, ndim_lse=3):
    from numba import types
    from numba.np import numpy_support
    elem = numpy_support.from_dtype(np.dtype(dtype))
    arr = types.Array(elem, 4, "A")
    return (arr, arr, arr, arr, types.Array(types.float32, ndim_lse, "A"), types.float64,
            types.int64, types.int64)


def variants(archs, head_dims=HEAD_DIMS, dtypes=DTYPES):
    """(kernel module, config, dtype, cc) for the default config of every kernel at each size."""
    from .cuda import block, row
    from .plan import Device
    for cc in archs:
        # Shared memory each architecture lets one block opt into (CUDA programming guide).
        optin = {(7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024,
                 (8, 9): 99 * 1024, (9, 0): 227 * 1024}.get(cc, 99 * 1024)
        device = Device(name=f"sm_{cc[0]}{cc[1]}", cc=cc, smem_per_block_optin=optin)
        for module in (block, row):
            for d in head_dims:
                for dt in dtypes:
                    try:
                        cfg = module.config(_Shape(d, dt), device)
                    except ValueError as e:  # plan.Unsupported: this arch can't take it
                        yield module, None, dt, cc, d, str(e)
                        continue
                    yield module, cfg, dt, cc, d, None


def inspect(archs, head_dims=HEAD_DIMS, dtypes=DTYPES, out=sys.stdout):
    """Compile each variant once; returns a list of result dicts."""
    from .cuda import launch
    rows, seen = [], set()
    for module, cfg, dt, cc, d, why in variants(archs, head_dims, dtypes):
        if cfg is None:
            rows.append({"kernel": module.NAME, "cc": cc, "d": d, "dtype": dt, "unsupported": why})
            continue
        key = (module.NAME, tuple(sorted(cfg.items())), dt, cc)
        if key in seen:
            continue
        seen.add(key)
        _, _, ptx, res = launch.compile_to_cubin(module.make_kernel(**cfg), argtypes(dt), cc)
        rows.append({"kernel": module.NAME, "cc": cc, "d": d, "dtype": dt, "config": cfg,
                     "shared_bytes": module.shared_bytes(cfg), **res})
    print(f"{'kernel':11s} {'sm':>3s} {'dtype':8s} {'config':52s} {'regs':>4s} {'spill':>5s} "
          f"{'stack':>5s} {'smem':>7s}", file=out)
    for r in rows:
        if "unsupported" in r:
            print(f"{r['kernel']:11s} {r['cc'][0]}{r['cc'][1]:<2d} {r['dtype']:8s} d={r['d']}: "
                  f"{r['unsupported'][:90]}", file=out)
            continue
        cfg = " ".join(f"{k}={v}" for k, v in r["config"].items() if k != "acc")
        spill = r.get("spill_store_bytes", 0) + r.get("spill_load_bytes", 0)
        print(f"{r['kernel']:11s} {r['cc'][0]}{r['cc'][1]:<2d} {r['dtype']:8s} {cfg:52s} "
              f"{r.get('registers', 0):4d} {spill:5d} {r.get('stack_bytes', 0):5d} "
              f"{r['shared_bytes']:7d}", file=out)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="75,80,90", help="comma-separated compute capabilities")
    ap.add_argument("--d", default=None, help="comma-separated head dims")
    ap.add_argument("--dtype", default=None, help="comma-separated dtypes")
    ap.add_argument("--check", action="store_true",
                    help="fail if any default config spills registers")
    args = ap.parse_args(argv)
    archs = [(int(a[0]), int(a[1:])) for a in args.arch.split(",")]
    dims = tuple(int(x) for x in args.d.split(",")) if args.d else HEAD_DIMS
    dtypes = tuple(args.dtype.split(",")) if args.dtype else DTYPES
    rows = inspect(archs, dims, dtypes)
    if args.check:
        bad = [r for r in rows if "config" in r
               and r.get("spill_store_bytes", 0) + r.get("spill_load_bytes", 0) > 0]
        if bad:
            print(f"{len(bad)} default configs spill registers", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
