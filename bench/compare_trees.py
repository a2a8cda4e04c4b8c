"""Time numflash's kernels from two source trees side by side on one GPU: the guard rail of a
refactor (bench/NOTES.md keeps the tables).

    python bench/compare_trees.py OLD_TREE [NEW_TREE] [--rounds 2] [--out results.json]

Each tree runs in its own process (its ``numflash`` first on sys.path), rounds alternating
old/new so that clock drift hits both; each config is timed by CUDA events with warm-up, the
median of repeats rotating over input sets (numflash.bench.timing). Every config's output for a
fixed seed is hashed too: equal hashes mean the two trees computed the same bits.
"""
import argparse
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parents[1]
SHAPE = (4, 16, 4096, 4096)
# (label, dtype, d, causal, (B, H, Nq, Nk), extra): the 16-bit, 3xTF32 and float64 tensor-core
# kernels at B4 H16 N4096, then calls that take other paths of cuda.mma: a sliding window, a
# dense mask modification and decoding (split-KV and its merge)
CONFIGS = [(f"{dt} d{d}{' causal' if c else ''}", dt, d, c, SHAPE, None)
           for dt, ds in (("float16", (64, 128)), ("bfloat16", (128,)), ("float32", (64, 128)),
                          ("float64", (64,)))
           for d in ds for c in (False, True)] + [
    ("float16 d128 causal window 256 (B4 H16 N4096)", "float16", 128, True, SHAPE, "window"),
    ("float16 d64 attn_mask (B2 H16 N2048)", "float16", 64, False, (2, 16, 2048, 2048), "mask"),
    ("float16 d128 decode (B1 H32 Nq1 Nk65536)", "float16", 128, "bottom_right",
     (1, 32, 1, 65536), None),
    ("float32 d128 decode (B1 H32 Nq1 Nk65536)", "float32", 128, "bottom_right",
     (1, 32, 1, 65536), None)]


def _timing():
    """numflash/bench/timing.py of this checkout, loaded by path (the trees' numflash differ)."""
    spec = importlib.util.spec_from_file_location("nf_timing", HERE / "numflash/bench/timing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(reps, only):
    import cupy as cp
    import ml_dtypes
    import numflash
    timing = _timing()
    timer = timing.CudaEventTimer()
    results = {}
    for label, dt, d, causal, (B, H, Nq, Nk), extra in CONFIGS:
        if only and not any(re.fullmatch(o, label) for o in only):
            continue
        rng = cp.random.default_rng(0)
        sets = []
        for _ in range(3):
            q = rng.standard_normal((B, H, Nq, d), dtype=cp.float32)
            k, v = (rng.standard_normal((B, H, Nk, d), dtype=cp.float32) for _ in range(2))
            sets.append(tuple(x.astype(ml_dtypes.bfloat16 if dt == "bfloat16" else dt)
                              for x in (q, k, v)))
        opts = {}
        if extra == "window":
            opts["window_size"] = (256, 0)
        elif extra == "mask":
            opts["attn_mask"] = rng.random((B, 1, Nq, Nk)) > 0.1
        plan = numflash.explain(*sets[0], causal=causal, **opts)

        def call(i):
            return numflash.attention(*sets[i % 3], causal=causal, **opts)
        timing.warm_up(timer, call, 3, 3)
        times, _, _ = timing.time_repeats(timer, call, 3, reps)
        out = call(0).view(cp.uint8)
        results[label] = {"ms": timing.summarize(times), "kernel": plan.kernel,
                          "config": dict(plan.config),
                          "hash": hashlib.sha256(cp.asnumpy(out).tobytes()).hexdigest()[:16]}
        print(f"  {label}: {results[label]['ms']['median']:.3f} ms", file=sys.stderr, flush=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default=str(HERE))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    ap.add_argument("--only", action="append", default=[],
                    help="time only the configs whose label matches this regular expression "
                    "(repeatable)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.reps, a.only)))
        return
    runs = {"old": [], "new": []}
    for r in range(a.rounds):
        for name in ("old", "new"):
            tree = pathlib.Path(getattr(a, name)).resolve()
            print(f"round {r + 1}: {name} tree {tree}", file=sys.stderr, flush=True)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [str(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                               if p and pathlib.Path(p).resolve() != HERE]))
            argv = [sys.executable, __file__, "--child", "--reps", str(a.reps), a.old]
            got = subprocess.run(argv + [f"--only={o}" for o in a.only], env=env,
                                 capture_output=True, text=True, cwd="/")
            sys.stderr.write(got.stderr[-4000:])
            if got.returncode:
                raise SystemExit(f"{name} tree failed")
            runs[name].append(json.loads(got.stdout.strip().splitlines()[-1]))
    print("| config (B4 H16 N4096 unless named) | kernel | old ms | new ms | new / old | "
          "same output bits |")
    print("|---|---|---|---|---|---|")
    for label, *_ in CONFIGS:
        if label not in runs["new"][0]:
            continue
        old = min(run[label]["ms"]["median"] for run in runs["old"])
        new = min(run[label]["ms"]["median"] for run in runs["new"])
        same = len({run[label]["hash"] for run in runs["old"] + runs["new"]}) == 1
        print(f"| {label} | {runs['new'][0][label]['kernel']} | {old:.3f} | {new:.3f} | "
              f"{new / old:.3f} | {'yes' if same else 'NO'} |")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
