"""``python -m numflash.bench``: numflash against naive attention and torch SDPA, on one machine.

On a GPU (CuPy importable and a device present) every numflash CUDA algorithm that accepts the
inputs runs against CuPy naive attention (matmul, softmax, matmul in the input dtype) and, when
torch is importable, torch SDPA with each backend that accepts them (flash, efficient, cuDNN,
math), all on the same inputs in the same run (torch sees the CuPy arrays through DLPack, zero
copy). Without a GPU the numba CPU path runs against NumPy naive attention (and torch SDPA on the
CPU when torch is importable) at sizes that finish in about a minute.

Suites: the main grid (default), ``--backward`` (gradients: attention_backward against torch
SDPA's backward and the naive backward), ``--memory`` (long-sequence time and peak memory, naive
shown as OOM where it fails) and ``--decode`` (decode Nq=1 and cross-attention Nq != Nk rows).

How it measures: a warm-up first, then the median (with min and max) of at least 10 timed repeats
(fewer only where 10 calls would take longer than ``--cap`` seconds; the ``reps`` column says how
many), with CUDA events around each call on the GPU and ``time.perf_counter`` on the CPU. Inputs are
drawn fresh for every row and rotated among several input sets, enough to overflow the last-level
cache. Every timed output goes through :func:`numflash.testing.check` (float64 reference, on a
sample of heads and query rows for big shapes); a method that fails it is shown as FAIL.
TFLOP/s = 4 B H Nq Nk d / time (halved for causal). Each numflash time is given as a speedup
against every peer of the same row (peer time / numflash time: > 1 means numflash is faster).

Results: a markdown table on stdout, and ``<date>_<device>.md`` / ``.json`` / ``_<suite>.png``
under ``--out`` (default ./numflash-bench, which git ignores in a clone of numflash; the
curated runs in bench/results were written with ``--out bench/results``).
"""
import argparse
import datetime
import fnmatch
import gc
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
import tracemalloc
import warnings
import zlib
from dataclasses import dataclass, field

import numpy as np

# ----------------------------------------------------------------------------------------------
# Default sizes
# ----------------------------------------------------------------------------------------------

MEMORY_N = tuple(1024 * 2 ** i for i in range(9))          # 1024 ... 262144
DEFAULTS = {
    # (backend, suite, quick) -> sizes
    ("cuda", "grid", False): dict(batch=4, heads=16, n=(512, 1024, 2048, 4096, 8192), d=(64, 128),
                                  dtype=("float32", "float16"), causal=(False, True)),
    ("cuda", "grid", True): dict(batch=4, heads=16, n=(1024, 4096), d=(64,),
                                 dtype=("float32", "float16"), causal=(False, True)),
    ("cuda", "memory", False): dict(batch=1, heads=8, n=MEMORY_N, d=(64,), dtype=("float16",),
                                    causal=(False,)),
    ("cuda", "memory", True): dict(batch=1, heads=8, n=(1024, 8192, 65536), d=(64,),
                                   dtype=("float16",), causal=(False,)),
    ("cuda", "decode", False): dict(batch=4, heads=16, nq=(1, 512), n=(512, 2048, 8192, 32768),
                                    d=(64, 128), dtype=("float32", "float16"), causal=(False,)),
    ("cuda", "decode", True): dict(batch=4, heads=16, nq=(1, 512), n=(2048, 32768), d=(64,),
                                   dtype=("float16",), causal=(False,)),
    ("cpu", "grid", False): dict(batch=1, heads=8, n=(512, 1024, 2048, 4096), d=(64,),
                                 dtype=("float32",), causal=(False, True)),
    ("cpu", "grid", True): dict(batch=1, heads=4, n=(256, 512), d=(64,), dtype=("float32",),
                                causal=(False, True)),
    ("cpu", "memory", False): dict(batch=1, heads=8, n=(1024, 2048, 4096, 8192), d=(64,),
                                   dtype=("float32",), causal=(False,)),
    ("cpu", "memory", True): dict(batch=1, heads=8, n=(1024, 2048), d=(64,), dtype=("float32",),
                                  causal=(False,)),
    ("cpu", "decode", False): dict(batch=1, heads=8, nq=(1, 512), n=(512, 2048, 8192, 32768),
                                   d=(64,), dtype=("float32",), causal=(False,)),
    ("cpu", "decode", True): dict(batch=1, heads=8, nq=(1, 512), n=(2048, 8192), d=(64,),
                                  dtype=("float32",), causal=(False,)),
    ("cuda", "backward", False): dict(batch=4, heads=16, n=(1024, 4096), d=(64, 128),
                                      dtype=("float32", "float16"), causal=(False, True)),
    ("cuda", "backward", True): dict(batch=4, heads=16, n=(1024,), d=(64,), dtype=("float32",),
                                     causal=(False, True)),
    ("cpu", "backward", False): dict(batch=1, heads=8, n=(512, 1024, 2048), d=(64,),
                                     dtype=("float32",), causal=(False, True)),
    ("cpu", "backward", True): dict(batch=1, heads=4, n=(256, 512), d=(64,), dtype=("float32",),
                                    causal=(False, True)),
}
# The backward keeps each input set's forward (and a peer's saved tensors) alive: few sets.
BACKWARD_SETS = 3
# FlashAttention-2's backward does 5 matrix products of the forward's 2 sizes: 2.5x its FLOPs.
BACKWARD_FLOPS = 2.5

# Timing policy per backend: min/max repeats, the seconds one method may spend timing one row
# before its repeats drop below min_reps (never below floor_reps), warm-up calls.
POLICY = {
    "cuda": dict(warmup=3, min_reps=10, max_reps=50, budget_s=0.5, cap_s=30.0, floor_reps=3),
    "cpu": dict(warmup=1, min_reps=10, max_reps=10, budget_s=0.0, cap_s=3.0, floor_reps=3),
}

CHECK_ELEMS = 2 ** 22
BUSY_SHARE = 0.2  # CPU path: flag rows timed while other processes used more of the CPUs  # largest (heads x rows x Nk) score block the float64 check may build

TORCH_SDPA = (("torch-flash", "FLASH_ATTENTION"), ("torch-efficient", "EFFICIENT_ATTENTION"),
              ("torch-cudnn", "CUDNN_ATTENTION"), ("torch-math", "MATH"))

# ----------------------------------------------------------------------------------------------
# Pure helpers
# ----------------------------------------------------------------------------------------------


def attention_flops(B, H, Nq, Nk, d, causal=False):
    """FLOPs of one attention forward: 4 B H Nq Nk d (two matmuls), halved for causal."""
    flops = 4.0 * B * H * Nq * Nk * d
    return flops / 2 if causal else flops


def tflops(flops, ms):
    """TFLOP/s of ``flops`` done in ``ms`` milliseconds (None for a missing or zero time)."""
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def summarize(times_ms):
    """Median, min, max and count of a list of times."""
    if not times_ms:
        raise ValueError("no times to summarize")
    return {"median": float(statistics.median(times_ms)), "min": float(min(times_ms)),
            "max": float(max(times_ms)), "n": len(times_ms)}


def speed_ratio(peer_ms, ours_ms):
    """Peer time / numflash time: > 1 means numflash is faster. None if either is missing."""
    if peer_ms is None or ours_ms is None or ours_ms <= 0 or peer_ms <= 0:
        return None
    return peer_ms / ours_ms


def choose_repeats(est_s, min_reps=10, max_reps=50, budget_s=0.5, cap_s=30.0, floor_reps=3):
    """How many timed repeats for a call that takes about ``est_s`` seconds.

    As many as fit in ``budget_s`` (between min_reps and max_reps); but when that many would take
    longer than ``cap_s``, as many as fit in ``cap_s``, never fewer than ``floor_reps``.
    """
    reps = min_reps if est_s <= 0 or budget_s <= 0 else int(budget_s / est_s)
    reps = max(min_reps, min(max_reps, reps))
    if est_s > 0 and est_s * reps > cap_s:
        reps = max(floor_reps, min(reps, int(cap_s / est_s)))
    return reps


def n_input_sets(set_bytes, cache_bytes, lo=3, hi=8):
    """Input sets to rotate: enough that together they exceed twice the last-level cache."""
    if set_bytes <= 0:
        return lo
    return max(lo, min(hi, math.ceil(2 * cache_bytes / set_bytes)))


def slug(text, maxlen=40):
    """A file-name-safe lower-case version of a device name."""
    text = re.sub(r"\((R|TM|tm|r)\)", "", text)
    text = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()
    return text[:maxlen].strip("-") or "device"


def check_plan(B, H, Nq, Nk, max_elems=CHECK_ELEMS):
    """Which part of an output the float64 check looks at, and that choice in words.

    Returns (parts, description); each part is (b, h, rows): batch and head index (None for all)
    and an index array of query rows (None for all). Query rows are independent, so a sample of
    them is checked against every key (testing.check applies the causal mask at each row's true
    position); keys are never sliced. Big problems are checked on the first and the last
    (batch, head), on their first and last query rows.
    """
    if B * H * Nq * Nk <= max_elems:
        return [(None, None, None)], "all"
    heads = [(0, 0)] if B * H == 1 else [(0, 0), (B - 1, H - 1)]
    per_head = max(2, max_elems // (len(heads) * Nk))
    if per_head >= Nq:
        rows, rows_desc = None, "all rows"
    else:
        first = (per_head + 1) // 2
        last = per_head - first
        rows = np.concatenate([np.arange(first), np.arange(Nq - last, Nq)])
        rows_desc = f"rows 0:{first}+{Nq - last}:{Nq}"
    desc = ",".join(f"b{b}h{h}" for b, h in heads) + " " + rows_desc
    return [(b, h, rows) for b, h in heads], desc


def sampled_check(out, q, k, v, causal, max_elems=CHECK_ELEMS, to_host=np.asarray):
    """numflash.testing.check on the part of the output that :func:`check_plan` picks.

    ``out``, ``q``, ``k``, ``v``: (B, H, N, d) arrays of any kind that ``to_host`` turns into
    NumPy. Returns a dict: ok, max_err, rel_err (largest over the parts), bound, naive_err,
    checked (what was checked, in words).
    """
    from . import testing
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    parts, desc = check_plan(B, H, Nq, Nk, max_elems)
    reports = []
    for b, h, rows in parts:
        sl = (slice(None), slice(None)) if b is None else (slice(b, b + 1), slice(h, h + 1))
        host = [to_host(a[sl]) for a in (out, q, k, v)]
        reports.append(testing.check(host[0], *host[1:], causal=causal, rows=rows))
    worst = max(reports, key=lambda r: r.max_err - r.bound)
    return {"ok": all(r.ok for r in reports), "max_err": max(r.max_err for r in reports),
            "rel_err": max(r.rel_err for r in reports), "bound": worst.bound,
            "naive_err": worst.naive_err, "finite": all(r.finite for r in reports),
            "checked": desc}


def blocks_from_config(config):
    """(block_rows, block_cols) of a numflash kernel's tile config, or None if it names none."""
    lower = {str(k).lower(): v for k, v in (config or {}).items()}
    rows = next((lower[k] for k in ("br", "block_q", "block_m", "block_rows", "rows")
                 if k in lower), None)
    cols = next((lower[k] for k in ("bc", "block_k", "block_n", "block_cols") if k in lower), None)
    if isinstance(rows, int) and isinstance(cols, int):
        return rows, cols
    return None


def model_bytes(rec):
    """(bytes, what) the memory-traffic model predicts for one record's method; (None, why)."""
    from .io_model import io_model
    e = np.dtype(rec["dtype"]).itemsize
    B, H, Nq, Nk, d = rec["B"], rec["H"], rec["Nq"], rec["Nk"], rec["d"]
    if Nq != Nk:
        floor = e * B * H * (2 * Nq * d + 2 * Nk * d)
        return float(floor), "floor: q, k, v read and o written once"
    io = rec.get("io")
    if io == "standard":
        m = io_model(Nq, d, dtype_bytes=e, block_rows=64, block_cols=64, batch=B, heads=H,
                     causal=rec["causal"])
        return float(m["standard_bytes"]), "io_model standard"
    if io == "tiled" and rec.get("blocks"):
        br, bc = rec["blocks"]
        m = io_model(Nq, d, dtype_bytes=e, block_rows=br, block_cols=bc, batch=B, heads=H,
                     causal=rec["causal"])
        return float(m["tiled_bytes"]), f"io_model tiled BR={br} BC={bc}"
    if io == "tiled" and rec.get("sram_bytes"):
        m = io_model(Nq, d, sram_bytes=rec["sram_bytes"], dtype_bytes=e, batch=B, heads=H,
                     causal=rec["causal"])
        return float(m["tiled_bytes"]), f"io_model tiled from {rec['sram_bytes']} B SRAM"
    return None, "no model for this method"


def predicted_peak(rec):
    """io_model's predicted peak extra memory for a square record: naive (S and P) or tiled."""
    from .io_model import io_model
    if rec["Nq"] != rec["Nk"] or rec.get("io") not in ("standard", "tiled"):
        return None
    m = io_model(rec["Nq"], rec["d"], dtype_bytes=np.dtype(rec["dtype"]).itemsize,
                 block_rows=64, block_cols=64, batch=rec["B"], heads=rec["H"],
                 causal=rec["causal"])
    return float(m["standard_peak_bytes" if rec["io"] == "standard" else "tiled_peak_bytes"])


def is_oom(exc):
    """True for an out-of-memory error of NumPy, CuPy or torch."""
    if isinstance(exc, MemoryError):  # cupy.cuda.memory.OutOfMemoryError is a MemoryError
        return True
    return "OutOfMemory" in type(exc).__name__ or "out of memory" in str(exc).lower()


def first_line(text, n=160):
    text = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return text if len(text) <= n else text[:n - 3] + "..."


def clean_torch_warnings(messages, limit=300):
    """torch's reasons for refusing an SDPA backend, without its source locations and filler."""
    out = []
    for msg in messages:
        msg = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", str(msg)).strip()
        if not msg or msg.endswith("because:") or "runtime disabled" in msg:
            continue
        if msg not in out:
            out.append(msg)
    text = "; ".join(out)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def config_key(rec):
    return (rec["suite"], rec["B"], rec["H"], rec["Nq"], rec["Nk"], rec["d"], rec["dtype"],
            rec["causal"])


def attach_ratios(records):
    """Give every numflash record ``speedup``: {peer: peer median / numflash median}.

    Only a numflash result that passed the accuracy check is compared. A peer that was timed but
    failed the check is still compared, and named in ``speedup_flags`` ({peer: "FAIL"}); a peer
    with no time (OOM, ERROR) is listed in ``speedup_missing`` with its status instead.
    """
    groups = {}
    for r in records:
        groups.setdefault(config_key(r), []).append(r)
    for group in groups.values():
        peers = [r for r in group if r["family"] == "peer" and r["status"] != "skipped"]
        for r in group:
            if r["family"] != "numflash":
                continue
            r["speedup"], r["speedup_flags"], r["speedup_missing"] = {}, {}, {}
            for p in peers:
                if r["status"] == "ok" and p["status"] in ("ok", "FAIL"):
                    r["speedup"][p["method"]] = speed_ratio(p["time_ms"]["median"],
                                                            r["time_ms"]["median"])
                    if p["status"] == "FAIL":
                        r["speedup_flags"][p["method"]] = "FAIL"
                else:
                    r["speedup_missing"][p["method"]] = (p["status"] if r["status"] == "ok"
                                                         else r["status"])
    return records


# ----------------------------------------------------------------------------------------------
# Rows and methods
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    suite: str
    B: int
    H: int
    Nq: int
    Nk: int
    d: int
    dtype: str
    causal: bool

    def label(self):
        n = f"N={self.Nq}" if self.Nq == self.Nk else f"Nq={self.Nq} Nk={self.Nk}"
        return (f"B={self.B} H={self.H} {n} d={self.d} {self.dtype}"
                f"{' causal' if self.causal else ''}")

    @property
    def scale(self):
        return 1.0 / math.sqrt(self.d)

    def set_bytes(self):
        e = np.dtype(self.dtype).itemsize
        return e * self.B * self.H * self.d * (self.Nq + 2 * self.Nk)


@dataclass
class Method:
    """One thing to time: ``call(i)`` runs it on input set i and returns its (B, H, Nq, dv) output."""
    name: str
    family: str                       # "numflash" or "peer"
    call: object
    io: str = None                    # "tiled" / "standard": which io_model prediction applies
    info: dict = field(default_factory=dict)
    memory: str = "pool"              # which peak-memory probe: "pool" (CuPy/NumPy) or "torch"
    refusal: object = None            # exc -> reason if the exception means "does not take these"
    check: object = None              # result -> check dict; default: sampled forward check


def selected(name, patterns):
    """Does a --methods pattern list pick this method? (exact name, prefix, or glob)."""
    if patterns is None:
        return True
    return any(name == p or name.startswith(p) or fnmatch.fnmatch(name, p) for p in patterns)


def numflash_methods(cfg, sets, backend_name, patterns, default_algorithms=None):
    """A Method per numflash algorithm that accepts the inputs, discovered through explain().

    Returns (methods, skipped) where skipped maps a method name to the reason it cannot run.
    """
    import numflash
    from numflash.plan import ALGORITHMS
    q, k, v = sets[0]
    algorithms = [a for a in ALGORITHMS if a != "auto"]
    if patterns is None and default_algorithms is not None:
        algorithms = list(default_algorithms)
    methods, skipped = [], {}
    for alg in algorithms:
        try:
            plan = numflash.explain(q, k, v, causal=cfg.causal, backend=backend_name,
                                    algorithm=alg)
        except ValueError as e:
            if alg != "auto":
                skipped[f"numflash-{alg}"] = f"refused: {first_line(e, 300)}"
            continue
        except Exception as e:  # noqa: BLE001 - a kernel module that fails to import
            skipped[f"numflash-{alg}"] = f"unavailable: {type(e).__name__}: {first_line(e)}"
            continue
        name = f"numflash-{plan.algorithm}"
        if not selected(name, patterns) or any(m.name == name for m in methods):
            continue

        def call(i, _alg=plan.algorithm):
            qi, ki, vi = sets[i]
            return numflash.attention(qi, ki, vi, causal=cfg.causal, backend=backend_name,
                                      algorithm=_alg)
        sram = getattr(plan.device, "smem_per_block_optin", None)
        methods.append(Method(name, "numflash", call, io="tiled",
                              info={"kernel": plan.kernel, "config": dict(plan.config),
                                    "blocks": blocks_from_config(plan.config),
                                    "sram_bytes": sram if backend_name == "cuda" else None}))
    return methods, skipped


def torch_sdpa_methods(torch, tsets, cfg, patterns):
    """torch SDPA with each backend, on torch tensors (already made from the inputs, zero copy)."""
    methods, skipped = [], {}
    wanted = [(n, a) for n, a in TORCH_SDPA if selected(n, patterns)]
    if not wanted:
        return methods, skipped
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        F = torch.nn.functional
    except Exception as e:  # noqa: BLE001
        for n, _ in wanted:
            skipped[n] = f"unavailable: torch.nn.attention.sdpa_kernel: {first_line(e)}"
        return methods, skipped

    def refusal(exc):
        if isinstance(exc, RuntimeError) and not is_oom(exc):
            return f"refused: {first_line(exc)}"
        return None
    refusal.explain_warnings = clean_torch_warnings

    for name, attr in wanted:
        be = getattr(SDPBackend, attr, None)
        if be is None:
            skipped[name] = f"unavailable: SDPBackend.{attr} is not in torch {torch.__version__}"
            continue

        def call(i, _be=be):
            tq, tk, tv = tsets[i]
            with sdpa_kernel([_be]):
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=cfg.causal,
                                                      scale=cfg.scale)
        methods.append(Method(name, "peer", call, io="standard" if attr == "MATH" else None,
                              memory="torch", refusal=refusal,
                              info={"sdpa_backend": attr}))
    return methods, skipped


def backward_methods(backend, cfg, sets, patterns, torch=None):
    """The backward suite: numflash's backward kernels (every algorithm explain() takes), torch
    SDPA's backward per backend, and on the CPU the naive backward in NumPy. Each call returns
    (dq, dk, dv) for output gradient dos[i] (the next set's q: independent, same shape). The
    forward each backward needs (numflash's o and lse, torch's autograd graph) is made here,
    outside the timing, so each timed call is the backward alone. The check compares head (0, 0)
    with the float64 reference gradients (numflash.testing.check_backward).
    """
    import numflash
    from numflash import reference, testing
    from numflash.plan import ALGORITHMS
    dos = [sets[(i + 1) % len(sets)][0] for i in range(len(sets))]
    head = (slice(0, 1), slice(0, 1))

    def check(grads):
        q, k, v = sets[0]
        part = [backend.to_host(a[head]) for a in (dos[0], q, k, v)]
        rep = testing.check_backward([backend.to_host(g[head]) for g in grads], *part,
                                     causal=cfg.causal, softmax_scale=cfg.scale)
        worst = max(rep.errors, key=lambda n: rep.errors[n] / rep.bounds[n])
        return {"ok": rep.ok, "max_err": rep.errors[worst], "bound": rep.bounds[worst],
                "naive_err": rep.naive_errors[worst], "rel_err": max(rep.rel_errors.values()),
                "checked": f"b0h0 dq, dk, dv (worst: {worst})"}

    methods, skipped = [], {}
    for alg in [a for a in ALGORITHMS if a != "auto"]:
        name = f"numflash-{alg}"
        if not selected(name, patterns):
            continue
        try:
            plan = numflash.explain(*sets[0], causal=cfg.causal, backend=backend.name,
                                    algorithm=alg, backward=True)
        except ValueError as e:
            skipped[name] = f"refused: {first_line(e, 300)}"
            continue
        forwards = [numflash.attention(*s, causal=cfg.causal, backend=backend.name,
                                       return_lse=True) for s in sets]

        def call(i, _alg=alg, _fw=forwards):
            q, k, v = sets[i]
            return numflash.attention_backward(dos[i], q, k, v, *_fw[i], causal=cfg.causal,
                                               backend=backend.name, algorithm=_alg)
        methods.append(Method(name, "numflash", call, check=check,
                              info={"kernel": plan.kernel, "config": dict(plan.config)}))
    if backend.name == "cpu" and selected("numpy-naive", patterns):
        def naive(i):
            q, k, v = sets[i]
            return reference.naive_backward(dos[i], q, k, v, scale=cfg.scale, causal=cfg.causal,
                                            dtype=np.dtype(cfg.dtype))
        methods.append(Method("numpy-naive", "peer", naive, check=check))
    if torch is None:
        return methods, skipped
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for name, attr in TORCH_SDPA:
        if not selected(name, patterns) or getattr(SDPBackend, attr, None) is None:
            continue
        graphs = []
        try:
            for s, do in zip(sets, dos):
                t = [torch.from_dlpack(a).requires_grad_() for a in s]
                with sdpa_kernel([getattr(SDPBackend, attr)]):
                    out = torch.nn.functional.scaled_dot_product_attention(
                        *t, is_causal=cfg.causal, scale=cfg.scale)
                graphs.append((out, t, torch.from_dlpack(do)))
        except RuntimeError as e:
            skipped[name] = (f"OOM: {first_line(e)}" if is_oom(e) else
                             f"refused: {first_line(e)}")
            continue

        def call(i, _g=graphs):
            out, t, do = _g[i]
            return torch.autograd.grad(out, t, do, retain_graph=True)
        methods.append(Method(name, "peer", call, check=check, memory="torch",
                              info={"sdpa_backend": attr}))
    return methods, skipped


def plain_naive_attention(xp, q, k, v, scale, hidden=None):
    """The textbook expression softmax(scale q k^T) v, each step a new array in the input dtype:
    the "CuPy naive" that the performance issue's own numbers (../shared/device/GPU.md) timed."""
    s = xp.matmul(q, xp.swapaxes(k, -1, -2)) * q.dtype.type(scale)
    if hidden is not None:
        s = xp.where(hidden, s.dtype.type(-np.inf), s)
    s = xp.exp(s - s.max(axis=-1, keepdims=True))
    return xp.matmul(s / s.sum(axis=-1, keepdims=True), v)


def naive_attention(xp, q, k, v, scale, hidden=None, bmm=None):
    """softmax(scale q k^T) v with NumPy or CuPy: S and P held in the input dtype, in place.

    The two matmuls run in the input dtype (BLAS / cuBLAS); the softmax arithmetic is done in
    float32 for float16/float32 inputs (as torch's softmax does on half tensors), with the scale
    applied in float32, and P written back over S in the input dtype. One Nq x Nk matrix is held
    at a time. ``hidden``: (Nq, Nk) bool mask of the scores a causal mask removes, or None.
    ``bmm(a, b, trans_b)``: the batched matmul to use (default ``xp.matmul``).
    """
    if bmm is None:
        def bmm(a, b, trans_b):
            return xp.matmul(a, xp.swapaxes(b, -1, -2) if trans_b else b)
    s = bmm(q, k, True)
    if hidden is not None:
        xp.copyto(s, s.dtype.type(-np.inf), where=hidden)
    m = s.max(axis=-1, keepdims=True)          # max of the unscaled scores (scale > 0)
    if s.dtype in (np.float32, np.float64) and (xp is np or s.dtype == np.float64):
        s -= m
        s *= s.dtype.type(scale)
        xp.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
    elif xp is np:                              # float16 on the CPU
        for i in np.ndindex(s.shape[:-2]):     # one (Nq, Nk) float32 temporary at a time
            p = np.exp((s[i].astype(np.float32) - m[i]) * np.float32(scale))
            p /= p.sum(axis=-1, keepdims=True)
            s[i] = p
    else:
        rowsum, normalize = _cupy_softmax_kernels(xp)
        sc = np.float32(scale)
        mb = xp.broadcast_to(m, s.shape)
        l = rowsum(s, mb, sc, axis=-1, keepdims=True)
        normalize(mb, xp.broadcast_to(l, s.shape), sc, s)
    return bmm(s, v, False)


def cupy_bmm_half(cp, a, b, trans_b):
    """a @ b (b^T when trans_b) over the leading batch dims, float16 in and out, float32 sums.

    CuPy's matmul computes float16 products of > 2-D arrays in float32 (it converts both operands
    and the result), which would make naive float16 attention an fp32 GEMM with three times the
    memory; this calls cuBLAS's strided-batched GEMM on the float16 data directly instead.
    """
    from cupy_backends.cuda.libs import cublas
    a, b = cp.ascontiguousarray(a), cp.ascontiguousarray(b)
    batch_shape = tuple(a.shape[:-2])
    M, K = a.shape[-2:]
    N, Kb = b.shape[-2:] if trans_b else b.shape[-2:][::-1]
    if Kb != K or tuple(b.shape[:-2]) != batch_shape:
        raise ValueError(f"bmm shapes {a.shape} and {b.shape} (trans_b={trans_b}) do not match")
    c = cp.empty(batch_shape + (M, N), dtype=cp.float16)
    batch = int(np.prod(batch_shape, dtype=np.int64))
    one, zero = np.array(1, np.float32), np.array(0, np.float32)
    r16f = cp.cuda.runtime.CUDA_R_16F
    compute = getattr(cublas, "CUBLAS_COMPUTE_32F", cp.cuda.runtime.CUDA_R_32F)
    # Row-major C = A B is column-major C^T = B^T A^T: cuBLAS gets b first.
    cublas.gemmStridedBatchedEx(
        cp.cuda.device.get_cublas_handle(),
        cublas.CUBLAS_OP_T if trans_b else cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N,
        N, M, K, one.ctypes.data,
        b.data.ptr, r16f, K if trans_b else N, N * K,
        a.data.ptr, r16f, K, M * K,
        zero.ctypes.data, c.data.ptr, r16f, N, M * N,
        batch, compute, cublas.CUBLAS_GEMM_DEFAULT)
    return c


_SOFTMAX_KERNELS = {}


def _cupy_softmax_kernels(cp):
    """Row sums of exp(scale (s - m)) in float32, and s <- exp(scale (s - m)) / l in place."""
    if "k" not in _SOFTMAX_KERNELS:
        rowsum = cp.ReductionKernel(
            "T s, T m, float32 scale", "float32 l",
            "expf(((float)s - (float)m) * scale)", "a + b", "l = a", "0",
            "numflash_bench_rowsum")
        normalize = cp.ElementwiseKernel(
            "T m, float32 l, float32 scale", "T s",
            "s = (T)(expf(((float)s - (float)m) * scale) / l)",
            "numflash_bench_softmax")
        _SOFTMAX_KERNELS["k"] = (rowsum, normalize)
    return _SOFTMAX_KERNELS["k"]


def causal_hidden(xp, Nq, Nk):
    """Scores hidden by a top-left causal mask (query i sees keys j <= i)."""
    return ~xp.tri(Nq, Nk, dtype=bool)


# ----------------------------------------------------------------------------------------------
# Backends: how to make inputs, time a call, probe memory, and which methods there are
# ----------------------------------------------------------------------------------------------

def _version(dist):
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:  # noqa: BLE001
        return None


def _git_describe():
    here = os.path.dirname(os.path.abspath(__file__))
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


def _base_versions():
    import numba
    import numflash
    return {"numflash": numflash.__version__, "numflash git": _git_describe(),
            "python": platform.python_version(), "numpy": np.__version__,
            "numba": numba.__version__, "numba-cuda": _version("numba-cuda"),
            "scipy": _version("scipy")}


def _try_torch():
    try:
        import torch
        return torch, None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {first_line(e)}"


class CpuBackend:
    """The numba CPU path against NumPy naive attention (and torch SDPA on the CPU)."""
    name = "cpu"
    timer = "time.perf_counter around each call (NumPy and numba calls return when done)"

    def __init__(self, torch=None, torch_missing=None):
        self.torch = torch
        self.torch_missing = torch_missing

    def device(self):
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        return f"{name} ({os.cpu_count()} logical cores)", "cpu-" + slug(name, 30)

    def info(self):
        import numba
        out = {"cores": os.cpu_count(), "numba threads": numba.get_num_threads()}
        try:
            with open("/sys/fs/cgroup/cpu.max") as f:
                quota = f.read().split()
            if quota and quota[0] != "max":
                out["cgroup CPU quota (cores)"] = round(int(quota[0]) / int(quota[1]), 2)
        except (OSError, ValueError, IndexError):
            pass
        if hasattr(os, "getloadavg"):
            out["load average at start (1/5/15 min)"] = [round(x, 2) for x in os.getloadavg()]
        return out

    def versions(self):
        v = _base_versions()
        v["torch"] = self.torch.__version__ if self.torch else f"not importable ({self.torch_missing})"
        v["cupy"] = "not used on the CPU path"
        return v

    def cache_bytes(self):
        try:
            with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
                text = f.read().strip()
            mult = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(text[-1].upper(), 1)
            return int(text.rstrip("KMGkmg")) * mult
        except (OSError, ValueError):
            return 32 * 1024 ** 2

    def make_sets(self, cfg, n, seed):
        rng = np.random.default_rng(seed)
        shapes = ((cfg.B, cfg.H, cfg.Nq, cfg.d), (cfg.B, cfg.H, cfg.Nk, cfg.d),
                  (cfg.B, cfg.H, cfg.Nk, cfg.d))
        return [tuple(rng.standard_normal(s, dtype=np.float32).astype(cfg.dtype) for s in shapes)
                for _ in range(n)]

    def timed(self, fn):
        t0 = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t0) * 1e3
        return out, ms, ms

    def load_probe(self):
        return _proc_jiffies()

    def peak(self, method, fn):
        """Peak bytes NumPy allocates during one call (tracemalloc; numba's own scratch unseen)."""
        gc.collect()
        started = not tracemalloc.is_tracing()
        if started:
            tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            out = fn()
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            if started:
                tracemalloc.stop()
        del out
        return {"peak_bytes": float(peak), "peak_how": "tracemalloc (NumPy allocations)"}

    def to_host(self, a):
        if isinstance(a, np.ndarray):
            return a
        if type(a).__module__.startswith("torch"):
            return a.detach().contiguous().cpu().numpy()
        return np.asarray(a)

    def cleanup(self):
        gc.collect()

    def methods(self, cfg, sets, patterns, suite_defaults):
        nf, skipped = numflash_methods(cfg, sets, "cpu", patterns,
                                       default_algorithms=suite_defaults.get("algorithms"))
        methods = list(nf)
        peer_patterns = patterns if patterns is not None else suite_defaults.get("peers")
        if selected("numpy-naive", peer_patterns):
            hidden = causal_hidden(np, cfg.Nq, cfg.Nk) if cfg.causal else None
            need = cfg.B * cfg.H * cfg.Nq * cfg.Nk * np.dtype(cfg.dtype).itemsize
            avail = _available_memory()

            def call(i):
                if avail is not None and need > 0.8 * avail:
                    raise MemoryError(f"not attempted: S alone needs {need / 2**30:.1f} GiB of "
                                      f"{avail / 2**30:.1f} GiB available")
                q, k, v = sets[i]
                return naive_attention(np, q, k, v, cfg.scale, hidden)
            methods.append(Method("numpy-naive", "peer", call, io="standard"))
        if self.torch is not None:
            tsets = [tuple(self.torch.from_numpy(np.ascontiguousarray(a)) for a in s)
                     for s in sets]
            tm, tskip = torch_sdpa_methods(self.torch, tsets, cfg, peer_patterns)
            methods += tm
            skipped.update(tskip)
        return methods, skipped


def _proc_jiffies():
    """(busy jiffies of all CPUs, all jiffies of all CPUs, this process's jiffies) or None."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total = sum(vals)
        return total - vals[3] - vals[4], total, int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def others_cpu_share(before, after):
    """Share of all CPUs' time that other processes (and steal) used between two _proc_jiffies."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    busy = after[0] - before[0]
    own = after[2] - before[2]
    return max(0.0, min(1.0, (busy - own) / (after[1] - before[1])))


def _available_memory():
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _peak_hook_class(cupy):
    class PeakHook(cupy.cuda.MemoryHook):
        """Records the CuPy pool's high-water mark of used bytes."""
        name = "numflash_bench_peak"

        def __init__(self, pool):
            super().__init__()
            self.pool = pool
            self.peak = 0
            self.calls = 0

        def malloc_postprocess(self, **kwargs):
            self.calls += 1
            self.peak = max(self.peak, self.pool.used_bytes())
    return PeakHook


class CudaBackend:
    """numflash's CUDA algorithms against CuPy naive attention and torch SDPA on one GPU."""
    name = "cuda"
    timer = ("CUDA events recorded on the current CuPy stream around each call "
             "(host time after a device synchronize kept alongside)")

    def __init__(self, cupy, torch=None, torch_missing=None):
        self.cp = cupy
        self.torch = torch
        self.torch_missing = torch_missing
        self.pool = cupy.get_default_memory_pool()
        self.start = cupy.cuda.Event()
        self.end = cupy.cuda.Event()
        self.props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        self.PeakHook = _peak_hook_class(cupy)

    def device(self):
        name = self.props["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        return name, slug(name)

    def info(self):
        p, rt = self.props, self.cp.cuda.runtime
        out = {"compute capability": f"{p['major']}.{p['minor']}",
               "memory GiB": round(p["totalGlobalMem"] / 2 ** 30, 1),
               "memory bytes": int(p["totalGlobalMem"]),
               "L2 bytes": int(p.get("l2CacheSize", 0)),
               "SMs": int(p.get("multiProcessorCount", 0)),
               "shared memory per block (opt-in)": int(p.get("sharedMemPerBlockOptin", 0)),
               "CUDA runtime": rt.runtimeGetVersion(), "CUDA driver": rt.driverGetVersion(),
               "CUPY_TF32": os.environ.get("CUPY_TF32", "unset")}
        if self.torch is not None:
            out["torch allow_tf32 (matmul)"] = bool(self.torch.backends.cuda.matmul.allow_tf32)
        return out

    def versions(self):
        v = _base_versions()
        v["cupy"] = self.cp.__version__
        v["torch"] = self.torch.__version__ if self.torch else f"not importable ({self.torch_missing})"
        return v

    def cache_bytes(self):
        return int(self.props.get("l2CacheSize", 50 * 1024 ** 2))

    def make_sets(self, cfg, n, seed):
        cp = self.cp
        rs = cp.random.RandomState(seed)
        shapes = ((cfg.B, cfg.H, cfg.Nq, cfg.d), (cfg.B, cfg.H, cfg.Nk, cfg.d),
                  (cfg.B, cfg.H, cfg.Nk, cfg.d))
        sets = [tuple(rs.standard_normal(s, dtype=cp.float32).astype(cfg.dtype) for s in shapes)
                for _ in range(n)]
        cp.cuda.Device().synchronize()
        return sets

    def timed(self, fn):
        cp = self.cp
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        self.start.record()
        out = fn()
        self.end.record()
        self.end.synchronize()
        cp.cuda.Device().synchronize()  # work on any other stream too, for the host time
        host_ms = (time.perf_counter() - t0) * 1e3
        return out, cp.cuda.get_elapsed_time(self.start, self.end), host_ms

    def peak(self, method, fn):
        """Peak device bytes of one call above what was live before it.

        CuPy pool: the high-water mark of used bytes, from a MemoryHook (the pool's total_bytes()
        growth is kept as a cross-check); torch methods: torch.cuda.max_memory_allocated.
        Allocations outside both allocators are not seen.
        """
        cp, pool = self.cp, self.pool
        gc.collect()
        pool.free_all_blocks()
        cp.cuda.Device().synchronize()
        base_used, base_total = pool.used_bytes(), pool.total_bytes()
        torch_base = None
        if self.torch is not None and method.memory == "torch":
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            torch_base = self.torch.cuda.memory_allocated()
        hook = self.PeakHook(pool)
        with hook:
            out = fn()
            cp.cuda.Device().synchronize()
        del out
        res = {"pool_total_growth_bytes": float(pool.total_bytes() - base_total),
               "hook_mallocs": hook.calls}
        if hook.calls:
            peak, how = float(max(0, hook.peak - base_used)), "CuPy pool high-water mark (hook)"
        else:
            peak, how = res["pool_total_growth_bytes"], "CuPy pool total_bytes growth"
        if torch_base is not None:
            self.torch.cuda.synchronize()
            tpeak = float(self.torch.cuda.max_memory_allocated() - torch_base)
            res["torch_peak_bytes"] = tpeak
            peak, how = peak + tpeak, "torch max_memory_allocated + CuPy pool"
        res.update(peak_bytes=peak, peak_how=how)
        return res

    def to_host(self, a):
        if isinstance(a, np.ndarray):
            return a
        if type(a).__module__.startswith("torch"):
            return a.detach().contiguous().cpu().numpy()
        return self.cp.ascontiguousarray(a).get()

    def cleanup(self):
        gc.collect()
        self.cp.cuda.Device().synchronize()
        self.pool.free_all_blocks()
        self.cp.get_default_pinned_memory_pool().free_all_blocks()
        if self.torch is not None:
            self.torch.cuda.empty_cache()

    def methods(self, cfg, sets, patterns, suite_defaults):
        cp = self.cp
        nf, skipped = numflash_methods(cfg, sets, "cuda", patterns,
                                       default_algorithms=suite_defaults.get("algorithms"))
        methods = list(nf)
        peer_patterns = patterns if patterns is not None else suite_defaults.get("peers")
        if selected("cupy-naive", peer_patterns):
            state = {}

            def call(i):
                if cfg.causal and "hidden" not in state:  # built once, outside the timed calls
                    state["hidden"] = causal_hidden(cp, cfg.Nq, cfg.Nk)
                q, k, v = sets[i]
                return naive_attention(cp, q, k, v, cfg.scale, state.get("hidden"), bmm)
            bmm = ((lambda a, b, trans_b: cupy_bmm_half(cp, a, b, trans_b))
                   if cfg.dtype == "float16" else None)
            methods.append(Method("cupy-naive", "peer", call, io="standard",
                                  info={"matmul": "cuBLAS strided-batched GEMM, float16 in/out, "
                                                  "float32 accumulation" if bmm else "cupy.matmul",
                                        "mask": "(Nq, Nk) bool, built in the first warm-up call"
                                        if cfg.causal else None}))
        if selected("cupy-naive-plain", peer_patterns):
            plain_state = {}

            def call_plain(i):
                if cfg.causal and "hidden" not in plain_state:
                    plain_state["hidden"] = causal_hidden(cp, cfg.Nq, cfg.Nk)
                q, k, v = sets[i]
                return plain_naive_attention(cp, q, k, v, cfg.scale, plain_state.get("hidden"))
            methods.append(Method("cupy-naive-plain", "peer", call_plain, io="standard",
                                  info={"matmul": "cupy.matmul", "softmax": "textbook, "
                                        "out of place, in the input dtype"}))
        if self.torch is not None:
            tsets = [tuple(self.torch.from_dlpack(a) for a in s) for s in sets]
            tm, tskip = torch_sdpa_methods(self.torch, tsets, cfg, peer_patterns)
            methods += tm
            skipped.update(tskip)
        return methods, skipped


def detect_backend(choice):
    """(backend, why): CudaBackend when CuPy sees a device (unless choice == 'cpu'), else CPU."""
    why = None
    if choice in ("auto", "cuda"):
        if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
            why = "NUMBA_ENABLE_CUDASIM is set (numba cannot launch on a GPU)"
        else:
            try:
                import cupy
                if cupy.cuda.runtime.getDeviceCount() < 1:
                    why = "CuPy sees no CUDA device"
            except Exception as e:  # noqa: BLE001
                why = f"CuPy is not usable ({type(e).__name__}: {first_line(e)})"
        if why is None:
            torch, torch_missing = _try_torch()
            return CudaBackend(cupy, torch, torch_missing), None
        if choice == "cuda":
            raise SystemExit(f"--backend cuda: {why}")
    torch, torch_missing = _try_torch()
    return CpuBackend(torch, torch_missing), why


# ----------------------------------------------------------------------------------------------
# The runner
# ----------------------------------------------------------------------------------------------

def base_record(cfg, method_name, family, backend_name):
    flops = attention_flops(cfg.B, cfg.H, cfg.Nq, cfg.Nk, cfg.d, cfg.causal)
    return {"suite": cfg.suite, "backend": backend_name, "B": cfg.B, "H": cfg.H, "Nq": cfg.Nq,
            "Nk": cfg.Nk, "d": cfg.d, "dtype": cfg.dtype, "causal": cfg.causal,
            "method": method_name, "family": family, "status": None, "note": None,
            "time_ms": None, "host_ms": None, "reps": None, "tflops": None, "check": None,
            "flops": flops * (BACKWARD_FLOPS if cfg.suite == "backward" else 1)}


def measure(method, cfg, sets, backend, policy, probe_memory=False, max_elems=CHECK_ELEMS):
    """Warm up, time, check and (optionally) probe the peak memory of one method on one row."""
    rec = base_record(cfg, method.name, method.family, backend.name)
    rec.update(io=method.io, blocks=method.info.get("blocks"),
               sram_bytes=method.info.get("sram_bytes"),
               info={k: v for k, v in method.info.items() if k not in ("blocks", "sram_bytes")})
    n = len(sets)
    kept, failure = None, None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for w in range(max(1, policy["warmup"])):
                out, ms, host = backend.timed(lambda: method.call((w + 1) % n))
                del out
                if ms > 1000:  # one slow call is warm-up enough
                    break
        times, hosts = [], []
        reps = policy["min_reps"]
        probe = getattr(backend, "load_probe", None)
        load0 = probe() if probe else None
        i = 0
        while i < reps:
            out, ms, host = backend.timed(lambda: method.call(i % n))
            if i == 0:
                kept = out
                reps = choose_repeats(ms / 1e3, policy["min_reps"], policy["max_reps"],
                                      policy["budget_s"], policy["cap_s"], policy["floor_reps"])
            del out
            times.append(ms)
            hosts.append(host)
            i += 1
        if probe:
            rec["others_cpu"] = others_cpu_share(load0, probe())
        if probe_memory:
            rec["memory"] = backend.peak(method, lambda: method.call(0))
    except Exception as e:  # noqa: BLE001 - every failure is reported in the table
        reason = method.refusal(e) if method.refusal else None
        if reason is not None:
            msgs = [str(w.message) for w in caught] if "caught" in locals() else []
            clean = getattr(method.refusal, "explain_warnings", None)
            why = clean(msgs) if clean else "; ".join(dict.fromkeys(first_line(m) for m in msgs))
            failure = ("skipped", reason + (f" ({why})" if why else ""))
        elif is_oom(e):
            failure = ("OOM", f"{type(e).__name__}: {first_line(e)}")
        else:
            failure = ("ERROR", f"{type(e).__name__}: {first_line(e)}")
        del e
    if failure is not None:
        kept = None
        backend.cleanup()
        rec["status"], rec["note"] = failure
        return rec
    rec["time_ms"] = summarize(times)
    rec["host_ms"] = summarize(hosts)
    rec["reps"] = len(times)
    rec["tflops"] = tflops(rec["flops"], rec["time_ms"]["median"])
    mb, how = model_bytes(rec)
    rec["model_bytes"], rec["model_how"] = mb, how
    rec["bandwidth_GBps"] = mb / (rec["time_ms"]["median"] * 1e-3) / 1e9 if mb else None
    rec["predicted_peak_bytes"] = predicted_peak(rec)
    try:
        rec["check"] = (method.check(kept) if method.check else
                        sampled_check(kept, *sets[0], cfg.causal, max_elems, backend.to_host))
        rec["status"] = "ok" if rec["check"]["ok"] else "FAIL"
    except Exception as e:  # noqa: BLE001
        rec["status"], rec["note"] = "ERROR", f"check failed: {type(e).__name__}: {first_line(e)}"
    del kept
    med, hmed = rec["time_ms"]["median"], rec["host_ms"]["median"]
    if backend.name == "cuda" and hmed - med > 0.5 and med < 0.5 * hmed:
        rec["note"] = (f"event time {med:.3g} ms is under half the host time {hmed:.3g} ms: "
                       f"host overhead dominates, or work ran on another stream")
    return rec


def build_configs(backend_name, suite, args):
    d = dict(DEFAULTS[(backend_name, suite, bool(args.quick))])
    B = args.batch if args.batch is not None else d["batch"]
    H = args.heads if args.heads is not None else d["heads"]
    ns = tuple(args.n) if args.n else d["n"]
    ds = tuple(args.d) if args.d else d["d"]
    dtypes = tuple(args.dtype) if args.dtype else d["dtype"]
    causals = args.causal if args.causal is not None else d["causal"]
    configs = []
    if suite == "decode":
        nqs = tuple(args.nq) if args.nq else d["nq"]
        for dt in dtypes:
            for dd in ds:
                for nq in nqs:
                    for nk in ns:
                        for c in causals:
                            configs.append(Config(suite, B, H, nq, nk, dd, dt, c))
    else:
        for dt in dtypes:
            for dd in ds:
                for c in causals:
                    for n in ns:
                        configs.append(Config(suite, B, H, n, n, dd, dt, c))
    return configs


SUITE_METHOD_DEFAULTS = {
    "grid": {},
    "decode": {},
    # the memory sweep: the algorithm numflash picks by itself, against naive attention
    "memory": {"algorithms": ("auto",), "peers": ("cupy-naive", "numpy-naive")},
    "backward": {},
}


def run_suite(backend, suite, configs, args, policy, progress, deadline, on_config_done=None):
    records, stopped = [], None
    bar = progress(configs, desc=suite)
    for idx, cfg in enumerate(bar):
        if deadline is not None and time.monotonic() > deadline:
            stopped = f"stopped before {cfg.label()}: --time-limit reached"
            break
        seed = zlib.crc32(f"{args.seed}/{suite}/{idx}/{cfg}".encode())
        n_sets = args.sets or n_input_sets(cfg.set_bytes(), backend.cache_bytes())
        if suite == "backward":
            n_sets = min(n_sets, BACKWARD_SETS)
        step = "making inputs"
        try:
            sets = backend.make_sets(cfg, n_sets, seed)
            step = "preparing methods"  # e.g. the forwards a backward row needs
            if suite == "backward":
                methods, skipped = backward_methods(backend, cfg, sets, args.methods,
                                                    getattr(backend, "torch", None))
            else:
                methods, skipped = backend.methods(cfg, sets, args.methods,
                                                   SUITE_METHOD_DEFAULTS[suite])
        except Exception as e:  # noqa: BLE001
            rec = base_record(cfg, "inputs", "peer", backend.name)
            rec["status"] = "OOM" if is_oom(e) else "ERROR"
            rec["note"] = f"{step}: {type(e).__name__}: {first_line(e)}"
            del e
            backend.cleanup()
            records.append(rec)
            continue
        for name, why in skipped.items():
            rec = base_record(cfg, name, "numflash" if name.startswith("numflash") else "peer",
                              backend.name)
            rec["status"], rec["note"] = "skipped", why
            records.append(rec)
        for m in methods:
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(f"{cfg.label()} | {m.name}")
            rec = measure(m, cfg, sets, backend, policy, probe_memory=args.probe_memory(suite),
                          max_elems=args.check_elems)
            rec["input_sets"] = n_sets
            records.append(rec)
            _log_row(rec)
        del sets, methods
        backend.cleanup()
        attach_ratios(records)
        if on_config_done is not None:
            on_config_done(records)
    return records, stopped


def _log_row(rec):
    if rec["status"] in ("ok", "FAIL"):
        c = rec["check"]
        msg = (f"{rec['method']:>16}: {rec['time_ms']['median']:10.3f} ms  "
               f"{rec['tflops'] or 0:8.3f} TFLOP/s  {rec['status']} rel {c['rel_err']:.2e}")
    else:
        msg = f"{rec['method']:>16}: {rec['status']} {rec['note'] or ''}"
    from tqdm import tqdm
    tqdm.write(f"  {_row_label(rec)} {msg}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------
# Tables
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


def predicted_peak_for(rec):
    """io_model's prediction for a record that has no time (an OOM row), by its method family."""
    io = rec.get("io") or ("tiled" if rec["family"] == "numflash" else
                           "standard" if rec["method"].endswith("naive") else None)
    return predicted_peak(dict(rec, io=io)) if io else None


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
            notes.append(f"- {r['method']} at {_row_label(r)}: {r['note']}")
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


def _row_label(r):
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
# Plots
# ----------------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _plain_number(y):
    return f"{y:,.0f}" if y >= 1000 else f"{y:g}"


def _plain_log_y(ax):
    """Log y axis labelled with plain numbers (0.06, 20, 3,000) instead of 6x10^-2."""
    from matplotlib import ticker

    class Plain(ticker.LogFormatter):
        def __call__(self, x, pos=None):  # keep LogFormatter's choice of which ticks get labels
            return _plain_number(x) if super().__call__(x, pos) else ""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(Plain())
    ax.yaxis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.tick_params(axis="y", which="minor", labelsize=7)


def _method_colors(records):
    """One colour per method, the same in every panel (numflash methods first)."""
    import matplotlib
    names = sorted({r["method"] for r in records},
                   key=lambda m: (not m.startswith("numflash"), m))
    cmap = matplotlib.colormaps["tab10"]
    return {m: cmap(i % 10) for i, m in enumerate(names)}


def _panels(records, keyfn):
    keys = []
    for r in records:
        k = keyfn(r)
        if k not in keys:
            keys.append(k)
    return keys


def _panel_grid(plt, n):
    """A figure with n panels, at most 4 a row."""
    cols = min(4, n)
    rows = math.ceil(n / cols)
    return plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)


def _save(plt, fig, path, title):
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(records, path, title):
    """TFLOP/s vs N per method, one panel per (d, dtype, causal); FAIL points marked with x."""
    plt = _pyplot()
    recs = [r for r in records if r["status"] in ("ok", "FAIL")]
    keys = _panels(recs, lambda r: (r["d"], r["dtype"], r["causal"]))
    if not keys:
        return None
    colors = _method_colors(recs)
    fig, axes = _panel_grid(plt, len(keys))
    for ax, key in zip(axes.flat, keys):
        sub = [r for r in recs if (r["d"], r["dtype"], r["causal"]) == key]
        for m in _panels(sub, lambda r: r["method"]):
            pts = sorted((r["Nq"], r["tflops"], r["status"]) for r in sub if r["method"] == m)
            ok = [(n, t) for n, t, s in pts if s == "ok"]
            style = "-" if m.startswith("numflash") else "--"
            ax.plot([n for n, _ in ok], [t for _, t in ok], style, marker="o", ms=4,
                    color=colors[m], label=m)
            bad = [(n, t) for n, t, s in pts if s == "FAIL"]
            if bad:
                ax.plot([n for n, _ in bad], [t for _, t in bad], "x", color="red", ms=9,
                        mew=2, label=f"{m} FAIL")
        d, dt, c = key
        ax.set_title(f"d={d} {dt}{' causal' if c else ''}", fontsize=10)
        ax.set_xscale("log", base=2)
        _plain_log_y(ax)
        ax.set_xlabel("N (sequence length)")
        ax.set_ylabel("TFLOP/s (log scale)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    return _save(plt, fig, path, title)


def plot_memory(records, path, title, device_bytes=None):
    """Peak memory and time vs N on log axes per method, io_model predictions dashed, OOM marked."""
    plt = _pyplot()
    recs = [r for r in records if r["status"] != "skipped"]
    methods = _panels(recs, lambda r: r["method"])
    if not methods:
        return None
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = _method_colors(recs)
    for m in methods:
        sub = sorted((r for r in recs if r["method"] == m), key=lambda r: r["Nq"])
        good = [r for r in sub if r["status"] in ("ok", "FAIL") and r.get("memory")]
        line, = ax_m.plot([r["Nq"] for r in good], [r["memory"]["peak_bytes"] / 2 ** 20
                                                    for r in good], marker="o", color=colors[m],
                          label=f"{m} measured")
        pred = [(r["Nq"], predicted_peak_for(r)) for r in sub]
        pred = [(n, p) for n, p in pred if p]
        if pred:
            ax_m.plot([n for n, _ in pred], [p / 2 ** 20 for _, p in pred], ":",
                      color=line.get_color(), label=f"{m} io_model")
        oom = [r for r in sub if r["status"] == "OOM"]
        if oom:
            first = oom[0]
            y = (predicted_peak_for(first) or (device_bytes or 1)) / 2 ** 20
            ax_m.plot([r["Nq"] for r in oom], [(predicted_peak_for(r) or y * 2 ** 20) / 2 ** 20
                                               for r in oom], "X", color="red", ms=10,
                      label=f"{m} OOM")
            ax_m.annotate(f"naive OOM from N={first['Nq']}", (first["Nq"], y),
                          textcoords="offset points", xytext=(-12, -4), ha="right", va="top",
                          color="red", fontsize=8)
        timed = [r for r in sub if r["status"] == "ok"]
        ax_t.plot([r["Nq"] for r in timed], [r["time_ms"]["median"] for r in timed], marker="o",
                  color=line.get_color(), label=m)
    if device_bytes:
        ax_m.axhline(device_bytes / 2 ** 20, color="gray", lw=1, ls="--", label="device memory")
    for ax, ylabel in ((ax_m, "peak extra memory (MiB)"), (ax_t, "median time (ms)")):
        ax.set_xscale("log", base=2)
        _plain_log_y(ax)
        ax.set_xlabel("N (sequence length)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, path, title)


def plot_decode(records, path, title):
    """Median time vs Nk per method on log axes, one panel per (Nq, d, dtype)."""
    plt = _pyplot()
    recs = [r for r in records if r["status"] in ("ok", "FAIL")]
    keys = _panels(recs, lambda r: (r["Nq"], r["d"], r["dtype"]))
    if not keys:
        return None
    colors = _method_colors(recs)
    fig, axes = _panel_grid(plt, len(keys))
    for ax, key in zip(axes.flat, keys):
        sub = [r for r in recs if (r["Nq"], r["d"], r["dtype"]) == key]
        for m in _panels(sub, lambda r: r["method"]):
            pts = sorted((r["Nk"], r["time_ms"]["median"], r["status"]) for r in sub
                         if r["method"] == m)
            ok = [(n, t) for n, t, s in pts if s == "ok"]
            ax.plot([n for n, _ in ok], [t for _, t in ok],
                    "-" if m.startswith("numflash") else "--", marker="o", ms=4,
                    color=colors[m], label=m)
            bad = [(n, t) for n, t, s in pts if s == "FAIL"]
            if bad:
                ax.plot([n for n, _ in bad], [t for _, t in bad], "x", color="red", ms=9, mew=2,
                        label=f"{m} FAIL")
        nq, d, dt = key
        ax.set_title(f"Nq={nq} d={d} {dt}", fontsize=10)
        ax.set_xscale("log", base=2)
        _plain_log_y(ax)
        ax.set_xlabel("Nk (keys)")
        ax.set_ylabel("median time (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    return _save(plt, fig, path, title)


def plot_suite(suite, records, path, meta):
    title = f"numflash {suite}: {meta['device']} ({meta['date'][:10]})"
    if suite == "memory":
        return plot_memory(records, path, title, (meta.get("device_info") or {}).get("memory bytes"))
    if suite == "decode":
        return plot_decode(records, path, title)
    return plot_throughput(records, path, title)


# ----------------------------------------------------------------------------------------------
# Output files
# ----------------------------------------------------------------------------------------------

def _jsonable(x):
    if isinstance(x, dict):
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
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_jsonable({"meta": meta, "suites": suites}), f, indent=1)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

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


if __name__ == "__main__":
    sys.exit(main())
