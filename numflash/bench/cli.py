"""The command line: ``python -m numflash.bench`` and the ``numflash-bench`` entry point. Parses the
options, picks the backend and the suites, runs them, and writes the report, JSON and plots."""
import argparse
import datetime
import os
import shlex
import sys
import time

from .backends import detect_backend
from .cases import build_configs
from .checks import CHECK_ELEMS
from .plots import plot_suite
from .report import render_markdown, write_json
from .runner import attach_ratios, run_suite
from .timing import POLICY


def _bool_list(values):
    out = []
    for v in values:
        v = v.lower()
        if v in ("both", "all"):
            out += [False, True]
        elif v in ("1", "true", "yes", "on", "causal"):
            out.append(True)
        elif v in ("0", "false", "no", "off", "full"):
            out.append(False)
        else:
            raise argparse.ArgumentTypeError(f"--causal takes yes, no or both; got {v!r}")
    return tuple(dict.fromkeys(out))


def parse_args(argv):
    """The command line, with --causal turned into a tuple of bools."""
    p = argparse.ArgumentParser(
        prog="python -m numflash.bench",
        description="Benchmark numflash against naive attention and torch SDPA on this machine "
                    "(GPU when CuPy sees one, else the CPU path).")
    p.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when CuPy sees a GPU, else the CPU path")
    p.add_argument("--grid", action="store_true",
                   help="run the main grid (the default when no other suite is asked for)")
    p.add_argument("--memory", action="store_true",
                   help="long-sequence sweep: time and peak memory, numflash vs naive")
    p.add_argument("--decode", action="store_true",
                   help="decode (Nq=1) and cross-attention (Nq != Nk) rows")
    p.add_argument("--backward", action="store_true",
                   help="the backward: attention_backward against torch SDPA's backward (and "
                        "the naive NumPy backward on the CPU), gradients checked")
    p.add_argument("--quick", action="store_true", help="a few rows of each chosen suite")
    p.add_argument("--n", type=int, nargs="+", help="sequence lengths (Nk for --decode)")
    p.add_argument("--nq", type=int, nargs="+", help="query counts for --decode")
    p.add_argument("--d", type=int, nargs="+", help="head dims")
    p.add_argument("--dtype", nargs="+", choices=("float16", "float32", "float64"))
    p.add_argument("--causal", nargs="+", metavar="{yes,no,both}",
                   help="causal rows, non-causal rows, or both")
    p.add_argument("--methods", nargs="+",
                   help="names, prefixes or globs: numflash-block numflash-row numflash-mma "
                        "cupy-naive numpy-naive torch-flash torch-efficient torch-cudnn "
                        "torch-math (e.g. 'numflash' 'torch')")
    p.add_argument("--batch", type=int, help="B")
    p.add_argument("--heads", type=int, help="H")
    p.add_argument("--repeats", type=int, help="minimum timed repeats per row (default 10)")
    p.add_argument("--max-repeats", type=int, help="most timed repeats per row")
    p.add_argument("--cap", type=float,
                   help="seconds one method may spend timing one row before its repeats drop "
                        "below --repeats (never below 3); default 30 on a GPU, 3 on the CPU")
    p.add_argument("--warmup", type=int, help="warm-up calls per method and row")
    p.add_argument("--sets", type=int,
                   help="input sets rotated per row (default: enough to exceed twice the "
                        "last-level cache, 3 to 8)")
    p.add_argument("--check-elems", type=int, default=CHECK_ELEMS,
                   help="largest heads x rows x Nk block the float64 check builds (default 2^22)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float,
                   help="seconds: start no new row after this, and write what was measured")
    p.add_argument("--out", default="numflash-bench",
                   help="directory for the .md, .json and .png results (default ./numflash-bench; "
                        "the repository's curated runs live in bench/results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.causal is not None:
        try:
            args.causal = _bool_list(args.causal)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
    for name in ("n", "nq", "d"):
        vals = getattr(args, name)
        if vals and any(v <= 0 for v in vals):
            p.error(f"--{name} values must be positive")
    return args


def _require_bench_extras():
    missing = []
    for mod in ("tqdm", "matplotlib"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise SystemExit(f"numflash.bench needs {' and '.join(missing)}: "
                         f"pip install 'numflash[bench]' (or pip install {' '.join(missing)})")


def _command(argv):
    return "python -m numflash.bench" + (" " + shlex.join(argv) if argv else "")


def main(argv=None):
    """Command-line entry point (``numflash-bench``); returns 0 when the run completed."""
    run(argv)
    return 0


def run(argv=None):
    """Run the benchmark for a command line; returns {"meta", "suites", "paths"}."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    _require_bench_extras()
    from tqdm import tqdm

    backend, why = detect_backend(args.backend)
    suites_to_run = [s for s, on in (("grid", args.grid or not (args.memory or args.decode
                                                                  or args.backward)),
                                     ("backward", args.backward), ("memory", args.memory),
                                     ("decode", args.decode)) if on]
    policy = dict(POLICY[backend.name])
    for key, val in (("min_reps", args.repeats), ("max_repeats", args.max_repeats),
                     ("cap_s", args.cap), ("warmup", args.warmup)):
        if val is not None:
            policy["max_reps" if key == "max_repeats" else key] = val
    policy["max_reps"] = max(policy["max_reps"], policy["min_reps"])
    policy["floor_reps"] = min(policy["floor_reps"], policy["min_reps"])
    args.probe_memory = lambda suite: suite == "memory" or backend.name == "cuda"

    device, device_slug = backend.device()
    now = datetime.datetime.now()
    meta = {"date": now.isoformat(timespec="seconds"), "command": _command(argv),
            "argv": argv, "cwd": os.getcwd(), "python": sys.executable,
            "backend": backend.name, "backend_why": why, "device": device,
            "device_info": backend.info(), "versions": backend.versions(), "timer": backend.timer,
            "policy": policy, "suites": suites_to_run, "check_elems": args.check_elems,
            "seed": args.seed}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{now:%Y-%m-%d_%H%M%S}_{device_slug}")
    json_path, md_path = stem + ".json", stem + ".md"
    print(f"numflash.bench on {device} ({backend.name}"
          + (f"; {why}" if why else "") + f"); results -> {stem}.*", file=sys.stderr)

    def progress(items, desc):
        return tqdm(items, desc=desc, file=sys.stderr, disable=args.no_progress,
                    dynamic_ncols=True, leave=True)

    deadline = time.monotonic() + args.time_limit if args.time_limit is not None else None
    suites, t0 = {}, time.monotonic()
    for suite in suites_to_run:
        configs = build_configs(backend.name, suite, args)

        def save_partial(recs, _suite=suite):
            suites[_suite] = recs
            write_json(json_path, meta, suites)
        records, stopped = run_suite(backend, suite, configs, args, policy, progress, deadline,
                                     on_config_done=save_partial)
        suites[suite] = attach_ratios(records)
        if stopped:
            meta["stopped"] = stopped
            break
    meta["wall_s"] = round(time.monotonic() - t0, 1)
    if hasattr(os, "getloadavg") and backend.name == "cpu":
        meta["load_end"] = [round(x, 2) for x in os.getloadavg()]

    pngs = {}
    for suite, recs in suites.items():
        png = plot_suite(suite, recs, f"{stem}_{suite}.png", meta)
        if png:
            pngs[suite] = png
    meta["plots"] = {s: os.path.basename(p) for s, p in pngs.items()}
    write_json(json_path, meta, suites)
    text = render_markdown(meta, suites, policy)
    if pngs:
        text += "\n" + "\n".join(f"![{s}]({os.path.basename(p)})" for s, p in pngs.items()) + "\n"
    with open(md_path, "w") as f:
        f.write(text)
    print(text)
    print("saved: " + ", ".join([md_path, json_path] + list(pngs.values())))
    return {"meta": meta, "suites": suites, "paths": {"md": md_path, "json": json_path,
                                                      "png": pngs}}
