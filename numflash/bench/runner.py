"""The runner: for each row of a suite, make the inputs, list the methods, and measure each
(warm-up, timed repeats, accuracy check, peak memory); then compare numflash with the peers of the
same row. A failure of one method (OOM, refusal, error) is recorded and the run goes on."""
import sys
import time
import warnings
import zlib

from .backends import backward_methods
from .cases import (BACKWARD_FLOPS, BACKWARD_SETS, SUITE_METHOD_DEFAULTS, attention_flops,
                    model_bytes, predicted_peak, tflops)
from .checks import CHECK_ELEMS, sampled_check
from .failures import first_line, is_oom
from .report import row_label
from .timing import (choose_repeats, n_input_sets, others_cpu_share, summarize, time_repeats,
                     warm_up)


def base_record(cfg, method_name, family, backend_name):
    """The record of one method on one row, before it runs."""
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
            warm_up(backend.timed, method.call, n, policy["warmup"], enough_ms=1000)
        probe = getattr(backend, "load_probe", None)
        load0 = probe() if probe else None
        times, hosts, kept = time_repeats(
            backend.timed, method.call, n, policy["min_reps"],
            revise=lambda ms: choose_repeats(ms / 1e3, policy["min_reps"], policy["max_reps"],
                                             policy["budget_s"], policy["cap_s"],
                                             policy["floor_reps"]))
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


def run_suite(backend, suite, configs, args, policy, progress, deadline, on_config_done=None):
    """Every row of one suite: inputs, methods, one record per method (skipped ones included).
    Returns (records, why it stopped early or None)."""
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
    tqdm.write(f"  {row_label(rec)} {msg}", file=sys.stderr)


def speed_ratio(peer_ms, ours_ms):
    """Peer time / numflash time: > 1 means numflash is faster. None if either is missing."""
    if peer_ms is None or ours_ms is None or ours_ms <= 0 or peer_ms <= 0:
        return None
    return peer_ms / ours_ms


def config_key(rec):
    """What makes two records the same row."""
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

