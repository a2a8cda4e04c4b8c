"""The results as a reader gets them: the markdown report (header, one table a suite, notes),
the JSON file, and the versions and git commit that the report names."""
import json
from collections.abc import Mapping
import math
import os
import platform
import subprocess

import numpy as np

from .cases import predicted_peak_for
from .timing import BUSY_SHARE

# ----------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------

def _fmt(x, spec=".3g"):
    return "-" if x is None else format(x, spec)


def _num(x):
    """A table number: thousands separators from 1000 up, else 4 significant digits."""
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _mib(x):
    if x is None:
        return "-"
    x = x / 2 ** 20
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def speedup_text(rec):
    """The "speedup vs peers" cell of a numflash record."""
    if rec["family"] != "numflash":
        return "-"
    if rec["status"] != "ok":
        return rec["status"]
    flags = rec.get("speedup_flags", {})
    parts = [f"{r:.2f}x {p}" + (f" (peer {flags[p]})" if p in flags else "")
             for p, r in rec.get("speedup", {}).items() if r is not None]
    parts += [f"{p} {s}" for p, s in rec.get("speedup_missing", {}).items()]
    return "; ".join(parts) or "-"


def check_text(rec):
    """The "check" cell: the accuracy verdict, or why there is none."""
    c = rec.get("check")
    if rec["status"] in ("OOM", "ERROR"):
        return f"{rec['status']}: {rec['note']}"
    if not c:
        return "-"
    verdict = "OK" if c["ok"] else f"FAIL (bound {c['bound']:.2g})"
    return f"{verdict} max {c['max_err']:.2g} rel {c['rel_err']:.2g}"


def columns(suite, backend_name):
    """The table's (header, cell function) pairs for a suite on a backend."""
    def timed(f):
        return lambda r: f(r) if r["status"] == "ok" else r["status"]
    cols = []
    if suite == "grid":
        cols += [("N", lambda r: str(r["Nq"]))]
    elif suite == "decode":
        cols += [("Nq", lambda r: str(r["Nq"])), ("Nk", lambda r: str(r["Nk"]))]
    else:
        cols += [("N", lambda r: str(r["Nq"]))]
    cols += [("d", lambda r: str(r["d"])), ("dtype", lambda r: r["dtype"]),
             ("causal", lambda r: "yes" if r["causal"] else "no"),
             ("method", lambda r: r["method"]),
             ("median ms", timed(lambda r: f"{r['time_ms']['median']:.4g}")),
             ("min-max ms", timed(lambda r: f"{r['time_ms']['min']:.4g}-{r['time_ms']['max']:.4g}")),
             ("reps", lambda r: str(r["reps"]) if r["reps"] else "-"),
             ("TFLOP/s", timed(lambda r: _fmt(r["tflops"])))]
    if suite == "memory":
        cols += [("peak MiB (measured)",
                  lambda r: _mib((r.get("memory") or {}).get("peak_bytes")) if r["status"] in
                  ("ok", "FAIL") else r["status"]),
                 ("peak MiB (io_model)", lambda r: _mib(r.get("predicted_peak_bytes") or
                                                        predicted_peak_for(r)))]
    elif backend_name == "cuda":
        cols += [("model MB", lambda r: _num(r.get("model_bytes") and r["model_bytes"] / 1e6)),
                 ("GB/s", timed(lambda r: _num(r.get("bandwidth_GBps"))))]
    if backend_name == "cpu":
        cols += [("others' CPU", lambda r: "-" if r.get("others_cpu") is None
                  else f"{100 * r['others_cpu']:.0f}%")]
    cols += [("speedup vs peers", speedup_text), ("check", check_text),
             ("checked", lambda r: (r.get("check") or {}).get("checked", "-"))]
    return cols


def markdown_table(records, suite, backend_name):
    """The markdown table of one suite's records (skipped methods go to the notes below it)."""
    shown = [r for r in records if r["status"] != "skipped"]
    cols = columns(suite, backend_name)
    lines = ["| " + " | ".join(h for h, _ in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for r in shown:
        cells = [str(f(r)).replace("|", "/") for _, f in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_notes(records, policy):
    """The notes under a suite's table: methods not run and why, short repeats, FAILs, busy CPU."""
    notes = []
    skipped = {}
    for r in records:
        if r["status"] == "skipped":
            skipped.setdefault((r["method"], r["note"]), []).append(r)
    for (name, why), rs in skipped.items():
        notes.append(f"- {name} not run on {len(rs)} row(s): {why}")
    few = [r for r in records if r.get("reps") and r["reps"] < policy["min_reps"]]
    if few:
        notes.append(f"- {len(few)} row(s) have fewer than {policy['min_reps']} repeats: "
                     f"{policy['min_reps']} calls would have taken over {policy['cap_s']:g} s "
                     f"(at least {policy['floor_reps']} are always timed).")
    for r in records:
        if r["status"] in ("ok", "FAIL") and r.get("note"):
            notes.append(f"- {r['method']} at {row_label(r)}: {r['note']}")
    busy = [r for r in records if (r.get("others_cpu") or 0) > BUSY_SHARE]
    if busy:
        notes.append(f"- {len(busy)} row(s) were timed while other processes used more than "
                     f"{100 * BUSY_SHARE:.0f}% of the CPUs (column others' CPU): those times are "
                     f"inflated by the shared machine, and so are ratios taken from them.")
    fails = [r for r in records if r["status"] == "FAIL"]
    if fails:
        notes.append(f"- {len(fails)} result(s) FAIL numflash.testing.check: their times are in "
                     f"the JSON; a failing numflash result is not compared, a failing peer is "
                     f"compared and marked (peer FAIL).")
    return notes


def row_label(r):
    """A record's problem in a few words (N, d, dtype, causal) for notes and the progress log."""
    n = f"N={r['Nq']}" if r["Nq"] == r["Nk"] else f"Nq={r['Nq']} Nk={r['Nk']}"
    return f"{n} d={r['d']} {r['dtype']}{' causal' if r['causal'] else ''}"


SUITE_TITLES = {"grid": "Attention forward", "backward": "Attention backward (gradients only)",
                "memory": "Long-sequence memory sweep",
                "decode": "Decode (Nq=1) and cross-attention (Nq != Nk)"}


def render_markdown(meta, suites, policy):
    """The whole report: header (device, versions, command, method) and one table per suite."""
    lines = [f"# numflash benchmark: {meta['device']}", "",
             f"- date: {meta['date']}",
             f"- command: `{meta['command']}`",
             f"- backend: {meta['backend']}" + (f" ({meta['backend_why']})"
                                                 if meta.get("backend_why") else ""),
             f"- device: {meta['device']}; " + ", ".join(f"{k}: {v}" for k, v in
                                                       meta["device_info"].items()),
             "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             f"- timing: {meta['timer']}; warm-up first; median (min-max) of the reps column; "
             f"inputs (standard normal) drawn fresh per row and rotated among the input sets",
             "- TFLOP/s = 4 B H Nq Nk d / median time, halved for causal (the backward: 2.5x "
             "that, FlashAttention-2's count; its peers are timed on autograd.grad over a "
             "forward made before the timing, so every time is the backward alone)",
             *(["- others' CPU: share of all CPUs that other processes (and VM steal) used "
                "while the row was timed (/proc/stat minus this process): above "
                f"{100 * BUSY_SHARE:.0f}% the time is inflated by the shared machine"]
               if meta["backend"] == "cpu" else []),
             "- speedup vs peers = peer median / numflash median from the same run "
             "(> 1: numflash is faster)",
             "- naive = matmul, softmax, matmul with S and P stored in the input dtype (softmax "
             "arithmetic in float32, in place: one Nq x Nk matrix); float16 S cannot meet the "
             "float16 accuracy rule on every input, so naive float16 rows may show FAIL",
             "- check: numflash.testing.check against the float64 reference "
             "(max abs error <= 2 x same-dtype naive error + floor); max = max abs error, "
             "rel = Frobenius relative error; `checked` says which heads/query rows were compared "
             "(every key is used)"]
    if meta["backend"] == "cuda":
        lines.append("- model MB: io_model's predicted device-memory traffic (tiled, with the "
                     "kernel's own tile sizes, for numflash; standard for naive and torch-math; "
                     "the q, k, v, o floor for Nq != Nk); GB/s = model bytes / median time")
    if meta.get("stopped"):
        lines.append(f"- **stopped early**: {meta['stopped']}")
    for suite, recs in suites.items():
        B, H = (recs[0]["B"], recs[0]["H"]) if recs else ("-", "-")
        lines += ["", f"## {SUITE_TITLES[suite]} (B={B}, H={H}, {meta['backend']})", "",
                  markdown_table(recs, suite, meta["backend"])]
        if suite == "memory":
            lines += ["", "- peak MiB (measured): " + ("CuPy pool high-water mark" if
                      meta["backend"] == "cuda" else "tracemalloc (NumPy allocations)") +
                      " during one call, above the inputs; io_model assumes naive holds S and "
                      "P (2 N^2 per head), while this naive softmax works in place (one N^2)."]
        notes = table_notes(recs, policy)
        if notes:
            lines += [""] + notes
    if meta.get("load_end") is not None:
        lines += ["", f"Load average at end (1/5/15 min): {meta['load_end']}"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# JSON
# ----------------------------------------------------------------------------------------------

def _jsonable(x):
    if isinstance(x, Mapping):  # dicts, and configs that are mappings (cuda.mma's MmaConfig)
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json(path, meta, suites):
    """meta and the suites' records as JSON, replacing ``path`` only once it is written whole."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_jsonable({"meta": meta, "suites": suites}), f, indent=1)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Versions
# ----------------------------------------------------------------------------------------------

def dist_version(dist):
    """The installed version of a distribution, or None."""
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:  # noqa: BLE001
        return None


def git_describe():
    """The commit of the numflash checkout this runs from, and whether numflash/ has uncommitted
    changes; None outside a git checkout."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # numflash/
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=5)
        return head.stdout.strip() + (" (uncommitted changes in numflash/)"
                                      if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001
        return None


def base_versions():
    """Versions every report names; each backend adds its own (CuPy, torch)."""
    import numba
    import numflash
    return {"numflash": numflash.__version__, "numflash git": git_describe(),
            "python": platform.python_version(), "numpy": np.__version__,
            "numba": numba.__version__, "numba-cuda": dist_version("numba-cuda"),
            "scipy": dist_version("scipy")}
