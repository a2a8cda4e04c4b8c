"""numflash.bench: the CPU suite end to end at tiny sizes, the pure helpers, and the GPU-side
table/plot code on fabricated records (no GPU needed); each helper from the module it lives in."""
import glob
import json
import math
import os

import numpy as np
import pytest

from numflash import bench
from numflash.bench import (backends, baselines, cases, checks, cli, failures, methods, plots,
                            report, runner, timing)
from numflash.testing import check

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--backend", "cpu", "--batch", "1", "--heads", "2", "--d", "16", "--no-progress",
        "--repeats", "3", "--sets", "2"]


def _outputs(tmpdir):
    md = glob.glob(os.path.join(tmpdir, "*.md"))
    js = glob.glob(os.path.join(tmpdir, "*.json"))
    assert len(md) == 1 and len(js) == 1, (md, js)
    with open(js[0]) as f:
        data = json.load(f)
    with open(md[0]) as f:
        text = f.read()
    return text, data


def _header(text, first_col):
    lines = [ln for ln in text.splitlines() if ln.startswith(f"| {first_col} |")]
    assert lines, f"no table starting with column {first_col!r}"
    return [c.strip() for c in lines[0].strip("|").split("|")]


# ---------------------------------------------------------------------------------- end to end

def test_cpu_backward_end_to_end(tmp_path, capsys):
    """--backward times attention_backward against the naive NumPy backward (and torch SDPA's
    backward where torch is installed), each gradient set checked against the reference."""
    out = str(tmp_path / "res")
    assert bench.main(TINY + ["--backward", "--n", "64", "--causal", "both", "--out", out]) == 0
    assert "Attention backward" in capsys.readouterr().out
    _, data = _outputs(out)
    assert set(data["suites"]) == {"backward"}  # --backward alone runs no forward grid
    rows = [r for r in data["suites"]["backward"] if r["status"] != "skipped"]
    assert {r["method"] for r in rows} >= {"numflash-block", "numpy-naive"}
    for r in rows:
        assert r["status"] == "ok" and r["check"]["ok"], r
        assert r["check"]["checked"].startswith("b0h0 dq, dk, dv")
        assert r["flops"] == pytest.approx(
            2.5 * cases.attention_flops(1, 2, 64, 64, 16, r["causal"]))
    ours = [r for r in rows if r["method"] == "numflash-block"]
    assert len(ours) == 2 and all("numpy-naive" in r["speedup"] for r in ours)
    assert all(r["info"]["kernel"] == "cpu.tiled" for r in ours)


def test_backward_check_catches_wrong_gradients(monkeypatch, tmp_path):
    """A kernel whose dk is off fails the backward check: the suite's check is not a stub."""
    import numflash
    real = numflash.attention_backward

    def wrong(*args, **kwargs):
        dq, dk, dv = real(*args, **kwargs)
        return dq, dk * 1.01, dv
    monkeypatch.setattr(numflash, "attention_backward", wrong)
    out = str(tmp_path / "res")
    bench.main(TINY + ["--backward", "--n", "32", "--causal", "no", "--methods",
                       "numflash-block", "--out", out])
    _, data = _outputs(out)
    row = next(r for r in data["suites"]["backward"] if r["method"] == "numflash-block")
    assert row["status"] == "FAIL" and "dk" in row["check"]["checked"]


def test_cpu_grid_end_to_end(tmp_path, capsys):
    out = str(tmp_path / "res")
    rc = bench.main(TINY + ["--n", "64", "96", "--causal", "both", "--out", out])
    assert rc == 0
    printed = capsys.readouterr().out
    header = _header(printed, "N")
    for col in ("N", "d", "dtype", "causal", "method", "median ms", "min-max ms", "reps",
                "TFLOP/s", "speedup vs peers", "check", "checked"):
        assert col in header, col
    assert "GB/s" not in header  # bandwidth is a GPU-report column
    assert "others' CPU" in header  # how busy the shared machine was while each row ran

    text, data = _outputs(out)
    assert text.strip() in printed  # the saved markdown is what was printed
    meta = data["meta"]
    assert meta["backend"] == "cpu"
    assert meta["command"].startswith("python -m numflash.bench --backend cpu")
    for lib in ("numflash", "numpy", "numba", "numba-cuda", "torch"):
        assert lib in meta["versions"]
    rows = [r for r in data["suites"]["grid"] if r["status"] != "skipped"]
    # 2 sizes x causal/not, numflash and numpy-naive each (no torch on this machine)
    configs = {(r["Nq"], r["causal"]) for r in rows}
    assert configs == {(64, False), (64, True), (96, False), (96, True)}
    methods = {r["method"] for r in rows}
    assert {"numflash-block", "numpy-naive"} <= methods
    for r in rows:
        assert r["status"] == "ok", r
        assert r["check"]["ok"] and r["check"]["checked"] == "all"
        assert r["reps"] >= 3 and r["time_ms"]["min"] <= r["time_ms"]["median"] <= r["time_ms"]["max"]
        assert r["tflops"] == pytest.approx(
            cases.attention_flops(1, 2, r["Nq"], r["Nk"], 16, r["causal"])
            / (r["time_ms"]["median"] * 1e-3) / 1e12)
    for r in rows:
        if r["method"] == "numflash-block":
            peer = next(p for p in rows if p["method"] == "numpy-naive"
                        and runner.config_key(p) == runner.config_key(r))
            assert r["speedup"]["numpy-naive"] == pytest.approx(
                peer["time_ms"]["median"] / r["time_ms"]["median"])
            assert r["info"]["kernel"] == "cpu.tiled"
    # the CPU path has no row/mma algorithm: listed as not run, with explain()'s reason
    skipped = {r["method"]: r["note"] for r in data["suites"]["grid"] if r["status"] == "skipped"}
    assert "numflash-row" in skipped and "refused" in skipped["numflash-row"]
    assert "not run" in text
    # correctness column says OK on every timed row of the printed table
    table_rows = [ln for ln in printed.splitlines() if ln.startswith("| 64 ") or
                  ln.startswith("| 96 ")]
    assert len(table_rows) == len(rows)
    ci = header.index("check")
    assert all(ln.strip("|").split("|")[ci].strip().startswith("OK") for ln in table_rows)
    pngs = glob.glob(os.path.join(out, "*_grid.png"))
    assert len(pngs) == 1
    with open(pngs[0], "rb") as f:
        assert f.read(8) == PNG_MAGIC


def test_cpu_memory_and_decode_suites(tmp_path, capsys):
    out = str(tmp_path / "res")
    bench.main(TINY + ["--memory", "--decode", "--n", "128", "256", "--nq", "1", "8",
                       "--out", out])
    printed = capsys.readouterr().out
    assert "peak MiB (measured)" in _header(printed, "N")
    dec_header = _header(printed, "Nq")
    assert dec_header[:2] == ["Nq", "Nk"]
    text, data = _outputs(out)
    assert set(data["suites"]) == {"memory", "decode"}  # --memory/--decode replace the grid
    mem = [r for r in data["suites"]["memory"] if r["status"] != "skipped"]
    assert {r["method"] for r in mem} == {"numflash-block", "numpy-naive"}
    for r in mem:
        assert r["status"] == "ok" and r["memory"]["peak_bytes"] > 0
        assert r["predicted_peak_bytes"] > 0
    naive256 = next(r for r in mem if r["method"] == "numpy-naive" and r["Nq"] == 256)
    # the naive S matrix (2 heads x 256 x 256 float32 = 512 KiB) shows in the measured peak
    assert naive256["memory"]["peak_bytes"] >= 2 * 256 * 256 * 4
    dec = [r for r in data["suites"]["decode"] if r["status"] != "skipped"]
    assert {(r["Nq"], r["Nk"]) for r in dec} == {(1, 128), (1, 256), (8, 128), (8, 256)}
    assert all(r["check"]["ok"] and not r["causal"] for r in dec)
    for suite in ("memory", "decode"):
        assert os.path.exists(os.path.join(out, os.path.basename(
            glob.glob(os.path.join(out, f"*_{suite}.png"))[0])))


# ----------------------------------------------------------------------------- pure helpers

def test_flops_and_tflops():
    assert cases.attention_flops(4, 16, 1024, 1024, 64) == 4 * 4 * 16 * 1024 * 1024 * 64
    assert cases.attention_flops(4, 16, 1024, 1024, 64, causal=True) == 2 * 4 * 16 * 1024 ** 2 * 64
    assert cases.attention_flops(1, 1, 1, 32768, 128) == 4 * 32768 * 128  # decode row
    assert cases.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert cases.tflops(1e9, 0.5) == pytest.approx(2.0)
    assert cases.tflops(1e9, None) is None and cases.tflops(1e9, 0) is None


def test_summarize_and_ratio():
    s = timing.summarize([3.0, 1.0, 10.0, 2.0])
    assert s == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    assert timing.summarize([5.0])["median"] == 5.0
    with pytest.raises(ValueError):
        timing.summarize([])
    assert runner.speed_ratio(10.0, 4.0) == pytest.approx(2.5)  # numflash 2.5x faster
    assert runner.speed_ratio(1.0, 4.0) == pytest.approx(0.25)
    assert runner.speed_ratio(None, 4.0) is None and runner.speed_ratio(1.0, 0.0) is None


def test_choose_repeats_and_input_sets():
    gpu = dict(min_reps=10, max_reps=50, budget_s=0.5, cap_s=30.0, floor_reps=3)
    assert timing.choose_repeats(0.001, **gpu) == 50       # fast: as many as the budget allows
    assert timing.choose_repeats(0.1, **gpu) == 10         # never under the minimum ...
    assert timing.choose_repeats(10.0, **gpu) == 3         # ... unless 10 calls exceed the cap
    assert timing.choose_repeats(100.0, **gpu) == 3        # and never under the floor
    cpu = dict(min_reps=10, max_reps=10, budget_s=0.0, cap_s=3.0, floor_reps=3)
    assert timing.choose_repeats(0.05, **cpu) == 10
    assert timing.choose_repeats(0.5, **cpu) == 6
    assert timing.n_input_sets(10 * 2 ** 20, 50 * 2 ** 20) == 8   # capped
    assert timing.n_input_sets(40 * 2 ** 20, 50 * 2 ** 20) == 3
    assert timing.n_input_sets(1 << 30, 50 * 2 ** 20) == 3        # never fewer than 3


def test_attach_ratios_only_compares_accurate_results():
    def rec(method, family, ms, status="ok"):
        r = {"suite": "grid", "B": 1, "H": 1, "Nq": 8, "Nk": 8, "d": 4, "dtype": "float32",
             "causal": False, "method": method, "family": family, "status": status,
             "time_ms": {"median": ms}}
        return r
    recs = [rec("numflash-block", "numflash", 2.0), rec("numflash-row", "numflash", 4.0, "FAIL"),
            rec("cupy-naive", "peer", 6.0), rec("torch-flash", "peer", 1.0, "OOM"),
            rec("torch-cudnn", "peer", None, "skipped"), rec("torch-math", "peer", 5.0, "FAIL")]
    runner.attach_ratios(recs)
    assert recs[0]["speedup"] == {"cupy-naive": pytest.approx(3.0),
                                  "torch-math": pytest.approx(2.5)}
    assert recs[0]["speedup_flags"] == {"torch-math": "FAIL"}
    assert recs[0]["speedup_missing"] == {"torch-flash": "OOM"}
    # a numflash result that fails the check is never compared
    assert recs[1]["speedup"] == {} and recs[1]["speedup_missing"]["cupy-naive"] == "FAIL"
    assert report.speedup_text(recs[1]) == "FAIL"
    text = report.speedup_text(recs[0])
    assert "3.00x cupy-naive" in text and "2.50x torch-math (peer FAIL)" in text
    assert "torch-flash OOM" in text and "torch-cudnn" not in text


def test_check_plan_samples_rows_and_heads():
    parts, desc = checks.check_plan(1, 2, 64, 64, max_elems=1 << 20)
    assert parts == [(None, None, None)] and desc == "all"
    parts, desc = checks.check_plan(4, 16, 8192, 8192, max_elems=1 << 22)
    assert [(b, h) for b, h, _ in parts] == [(0, 0), (3, 15)]
    rows = parts[0][2]
    assert len(rows) == (1 << 22) // (2 * 8192) and rows[0] == 0 and rows[-1] == 8191
    assert "rows 0:128+8064:8192" in desc
    # a decode row: few queries, many keys -> all rows of two heads
    parts, desc = checks.check_plan(4, 16, 1, 32768, max_elems=1 << 20)
    assert parts[0][2] is None and desc.endswith("all rows")


@pytest.mark.parametrize("causal", [False, True])
def test_sampled_check_catches_errors_in_sampled_rows(causal, rng):
    B, H, N, d = 2, 3, 256, 16
    q, k, v = (rng.standard_normal((B, H, N, d)).astype(np.float32) for _ in range(3))
    from numflash.reference import naive
    good, _ = naive(q, k, v, scale=d ** -0.5, causal=causal)
    good = good.astype(np.float32)
    small = 2 * 16 * N  # forces 2 heads x 16 rows: the first and last 8 rows
    rep = checks.sampled_check(good, q, k, v, causal, max_elems=small)
    assert rep["ok"] and rep["checked"] == "b0h0,b1h2 rows 0:8+248:256"
    # the last rows of a causal problem see almost all keys: a wrong mask offset would fail here
    bad = good.copy()
    bad[1, 2, 250] += 1e-3
    rep = checks.sampled_check(bad, q, k, v, causal, max_elems=small)
    assert not rep["ok"] and rep["max_err"] == pytest.approx(1e-3, rel=1e-2)
    full = checks.sampled_check(bad, q, k, v, causal, max_elems=1 << 30)
    assert not full["ok"] and full["checked"] == "all"


def test_blocks_and_model_bytes():
    assert cases.blocks_from_config({"block_q": 128, "block_k": 256}) == (128, 256)
    assert cases.blocks_from_config({"D": 64, "BR": 64, "BC": 32, "TM": 4}) == (64, 32)
    assert cases.blocks_from_config({"D": 64, "BC": 64, "ROWS": 128}) == (128, 64)
    from numflash.cuda.mma.tiles import MmaConfig   # BR is derived there (16 rows a warp)
    assert cases.blocks_from_config(MmaConfig(64, 64, 4, 32, 1, "f16", 1)) == (64, 32)
    assert cases.blocks_from_config({"D": 64}) is None
    from numflash import io_model
    r = {"B": 4, "H": 16, "Nq": 4096, "Nk": 4096, "d": 64, "dtype": "float16", "causal": True}
    mb, how = cases.model_bytes(dict(r, io="tiled", blocks=(64, 64)))
    assert mb == io_model(4096, 64, dtype_bytes=2, block_rows=64, block_cols=64, batch=4,
                          heads=16, causal=True)["tiled_bytes"] and "BR=64" in how
    mb, _ = cases.model_bytes(dict(r, io="standard"))
    assert mb == io_model(4096, 64, dtype_bytes=2, block_rows=1, block_cols=1, batch=4,
                          heads=16, causal=True)["standard_bytes"]
    mb, how = cases.model_bytes(dict(r, Nq=1, Nk=32768, io="tiled", blocks=(64, 64)))
    assert mb == 2 * 4 * 16 * (2 * 64 + 2 * 32768 * 64) and how.startswith("floor")
    assert cases.model_bytes(dict(r, io=None))[0] is None


def test_is_oom_and_naive_attention():
    class OutOfMemoryError(RuntimeError):
        pass
    assert failures.is_oom(MemoryError()) and failures.is_oom(OutOfMemoryError("x"))
    assert failures.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not failures.is_oom(RuntimeError("No available kernel. Aborting execution."))
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 32, 8)).astype(np.float32) for _ in range(3))
    from numflash.reference import naive
    for causal in (False, True):
        hidden = baselines.causal_hidden(np, 32, 32) if causal else None
        o = baselines.naive_attention(np, q, k, v, 8 ** -0.5, hidden)
        assert o.dtype == np.float32
        np.testing.assert_allclose(o, naive(q, k, v, scale=8 ** -0.5, causal=causal)[0],
                                   atol=1e-5)
    # float16: S and P stored in float16 (so about float16 precision), output float16
    q16, k16, v16 = (a.astype(np.float16) for a in (q, k, v))
    o16 = baselines.naive_attention(np, q16, k16, v16, 8 ** -0.5, baselines.causal_hidden(np, 32, 32))
    assert o16.dtype == np.float16
    ref = naive(q16, k16, v16, scale=8 ** -0.5, causal=True)[0]
    err = np.abs(o16.astype(np.float64) - ref).max()
    assert 1e-5 < err < 5e-3  # float16 rounding is visible, nothing worse


def test_cli_parsing_and_configs():
    args = cli.parse_args(["--causal", "yes", "--n", "128", "--dtype", "float16"])
    assert args.causal == (True,)
    assert cli.parse_args(["--causal", "both"]).causal == (False, True)
    with pytest.raises(SystemExit):
        cli.parse_args(["--causal", "maybe"])
    args = cli.parse_args([])
    gpu = cases.build_configs("cuda", "grid", args)
    assert len(gpu) == 5 * 2 * 2 * 2 and {c.B for c in gpu} == {4} and {c.H for c in gpu} == {16}
    assert {c.Nq for c in gpu} == {512, 1024, 2048, 4096, 8192}
    mem = cases.build_configs("cuda", "memory", args)
    assert [c.Nq for c in mem] == [1024 * 2 ** i for i in range(9)] and mem[-1].Nq == 262144
    assert {(c.B, c.H, c.d) for c in mem} == {(1, 8, 64)}
    dec = cases.build_configs("cuda", "decode", args)
    assert max(c.Nk for c in dec) == 32768 and {c.Nq for c in dec} == {1, 512}
    cpu = cases.build_configs("cpu", "grid", args)
    assert {(c.B, c.H, c.d, c.dtype) for c in cpu} == {(1, 8, 64, "float32")}
    assert len(cpu) == 8
    assert methods.selected("numflash-row", ["numflash"]) and not methods.selected("cupy-naive",
                                                                             ["torch"])
    assert methods.selected("torch-math", ["torch-*"]) and methods.selected("x", None)


# ------------------------------------------------------------- GPU report on fabricated records

def _gpu_record(method, family, N, ms, status="ok", dtype="float16", causal=False, suite="grid",
                **extra):
    r = runner.base_record(cases.Config(suite, 4 if suite == "grid" else 1,
                                       16 if suite == "grid" else 8, N, N, 64, dtype, causal),
                          method, family, "cuda")
    r.update(status=status, io={"numflash": "tiled", "peer": "standard"}[family]
             if method != "torch-flash" else None,
             blocks=(64, 64) if family == "numflash" else None)
    if status in ("ok", "FAIL"):
        r["time_ms"] = {"median": ms, "min": ms * 0.9, "max": ms * 1.2, "n": 10}
        r["host_ms"] = r["time_ms"]
        r["reps"] = 10
        r["tflops"] = cases.tflops(r["flops"], ms)
        r["model_bytes"], r["model_how"] = cases.model_bytes(r)
        r["bandwidth_GBps"] = (r["model_bytes"] / (ms * 1e-3) / 1e9 if r["model_bytes"]
                               else None)
        r["predicted_peak_bytes"] = cases.predicted_peak(r)
        r["check"] = {"ok": status == "ok", "max_err": 1e-4 if status == "ok" else 0.5,
                      "rel_err": 1e-4, "bound": 4e-4, "naive_err": 1e-4, "finite": True,
                      "checked": "b0h0,b3h15 rows 0:128+3968:4096"}
    else:
        r["note"] = "OutOfMemoryError: Out of memory allocating 1 bytes"
    r.update(extra)
    return r


def test_gpu_table_and_plot_from_fabricated_records(tmp_path):
    recs = []
    for N, f in ((1024, 1.0), (4096, 16.0)):
        recs += [_gpu_record("numflash-block", "numflash", N, 0.5 * f),
                 _gpu_record("numflash-row", "numflash", N, 2.0 * f,
                             status="FAIL" if N == 4096 else "ok"),
                 _gpu_record("cupy-naive", "peer", N, 1.5 * f),
                 _gpu_record("torch-flash", "peer", N, 0.25 * f)]
    recs.append(_gpu_record("torch-cudnn", "peer", 1024, None, status="skipped",
                            note="refused: No available kernel"))
    runner.attach_ratios(recs)
    table = report.markdown_table(recs, "grid", "cuda")
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    assert "model MB" in header and "GB/s" in header and "speedup vs peers" in header
    lines = table.splitlines()[2:]
    assert len(lines) == 8  # the skipped method is a note, not a row
    block1024 = next(ln for ln in lines if ln.startswith("| 1024 ") and "| numflash-block |" in ln)
    assert "3.00x cupy-naive" in block1024 and "0.50x torch-flash" in block1024
    row4096 = next(ln for ln in lines if ln.startswith("| 4096 ") and "| numflash-row |" in ln)
    cells = [c.strip() for c in row4096.strip("|").split("|")]
    assert cells[header.index("median ms")] == "FAIL"
    assert cells[header.index("TFLOP/s")] == "FAIL"
    assert cells[header.index("speedup vs peers")] == "FAIL"
    assert cells[header.index("check")].startswith("FAIL")
    gbs = float(next(ln for ln in lines if ln.startswith("| 1024 ") and "| cupy-naive |" in ln)
                .strip("|").split("|")[header.index("GB/s")].replace(",", ""))
    expect = cases.model_bytes(recs[2])[0] / 1.5e-3 / 1e9
    assert gbs == pytest.approx(expect, rel=1e-3)
    notes = report.table_notes(recs, timing.POLICY["cuda"])
    assert any("torch-cudnn not run on 1 row(s): refused" in n for n in notes)
    assert any("FAIL" in n for n in notes)
    png = plots.plot_throughput(recs, str(tmp_path / "grid.png"), "fabricated")
    with open(png, "rb") as f:
        assert f.read(8) == PNG_MAGIC


def test_gpu_memory_report_marks_oom(tmp_path):
    recs = []
    for N in (1024, 4096, 16384, 65536, 262144):
        nf = _gpu_record("numflash-block", "numflash", N, N / 1000, suite="memory")
        nf["memory"] = {"peak_bytes": cases.predicted_peak(nf)}
        recs.append(nf)
        if N <= 16384:
            nv = _gpu_record("cupy-naive", "peer", N, N / 500, suite="memory")
            nv["memory"] = {"peak_bytes": cases.predicted_peak(nv) / 2}
        else:
            nv = _gpu_record("cupy-naive", "peer", N, None, status="OOM", suite="memory")
        recs.append(nv)
    runner.attach_ratios(recs)
    table = report.markdown_table(recs, "memory", "cuda")
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    assert "peak MiB (measured)" in header and "peak MiB (io_model)" in header
    oom = next(ln for ln in table.splitlines() if ln.startswith("| 65536 ") and "| cupy-naive |" in ln)
    cells = [c.strip() for c in oom.strip("|").split("|")]
    assert cells[header.index("peak MiB (measured)")] == "OOM"
    # io_model's prediction is still shown for the row that ran out of memory: 8 x 2 x N^2 x 2 B
    assert cells[header.index("peak MiB (io_model)")] == f"{(8 * 2 * 65536 ** 2 * 2 + 8 * 65536 * 64 * 2) / 2 ** 20:,.0f}"
    nf = next(r for r in recs if r["method"] == "numflash-block" and r["Nq"] == 65536)
    assert nf["speedup_missing"] == {"cupy-naive": "OOM"}
    meta = {"device": "NVIDIA H100 80GB HBM3 (fabricated)", "date": "2026-01-01T00:00:00",
            "device_info": {"memory bytes": 80 * 2 ** 30}}
    png = plots.plot_suite("memory", recs, str(tmp_path / "mem.png"), meta)
    with open(png, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    # the whole report renders with a GPU header
    meta.update(command="python -m numflash.bench --memory", backend="cuda", versions={},
                timer="CUDA events")
    text = report.render_markdown(meta, {"memory": recs}, timing.POLICY["cuda"])
    assert "## Long-sequence memory sweep (B=1, H=8, cuda)" in text and "model MB" in text


def test_measure_reports_oom_error_and_fail_with_a_fake_backend():
    """The runner's handling of failing methods, as the GPU path uses it, on a fake device."""
    cleaned = []

    class FakeBackend(backends.CpuBackend):
        name = "cuda"

        def cleanup(self):
            cleaned.append(True)

    class OutOfMemoryError(MemoryError):
        pass

    be = FakeBackend()
    cfg = cases.Config("grid", 1, 2, 32, 32, 8, "float32", False)
    sets = be.make_sets(cfg, 2, seed=0)
    policy = dict(timing.POLICY["cpu"], min_reps=3, max_reps=3)
    good = methods.Method("cupy-naive", "peer", lambda i: baselines.naive_attention(
        np, *sets[i], cfg.scale))
    wrong = methods.Method("numflash-block", "numflash", lambda i: baselines.naive_attention(
        np, *sets[i], cfg.scale) + 1e-2, io="tiled", info={"blocks": (16, 16)})

    def oom(i):
        raise OutOfMemoryError("Out of memory allocating 68,719,476,736 bytes")

    def broken(i):
        raise RuntimeError("No available kernel. Aborting execution.")
    r_good = runner.measure(good, cfg, sets, be, policy)
    r_wrong = runner.measure(wrong, cfg, sets, be, policy)
    r_oom = runner.measure(methods.Method("cupy-naive", "peer", oom), cfg, sets, be, policy)
    r_ref = runner.measure(methods.Method("torch-flash", "peer", broken,
                                       refusal=lambda e: f"refused: {e}"), cfg, sets, be, policy)
    r_err = runner.measure(methods.Method("torch-math", "peer", broken), cfg, sets, be, policy)
    assert r_good["status"] == "ok" and r_good["reps"] == 3 and r_good["check"]["ok"]
    assert r_wrong["status"] == "FAIL" and r_wrong["check"]["max_err"] == pytest.approx(1e-2,
                                                                                      rel=1e-3)
    assert r_wrong["model_bytes"] > 0 and "BR=16" in r_wrong["model_how"]
    assert r_oom["status"] == "OOM" and "68,719,476,736" in r_oom["note"]
    assert r_ref["status"] == "skipped" and r_ref["note"].startswith("refused")
    assert r_err["status"] == "ERROR" and "No available kernel" in r_err["note"]
    assert len(cleaned) == 3  # memory is released after every failed method
    recs = runner.attach_ratios([r_good, r_wrong, r_oom, r_ref, r_err])
    assert r_wrong["speedup"] == {} and report.speedup_text(r_wrong) == "FAIL"
    assert not math.isnan(r_good["time_ms"]["median"])
    table = report.markdown_table(recs, "grid", "cuda")
    assert "OOM: OutOfMemoryError" in table and "ERROR: RuntimeError" in table


@pytest.mark.gpu
def test_gpu_suite_end_to_end_tiny(tmp_path):
    """On a GPU machine: the real CUDA path at a tiny size, numflash accurate, peers timed."""
    out = str(tmp_path / "res")
    bench.main(["--backend", "cuda", "--batch", "1", "--heads", "2", "--n", "256", "--d", "64",
                "--dtype", "float16", "float32", "--causal", "both", "--repeats", "3",
                "--no-progress", "--out", out])
    _, data = _outputs(out)
    rows = data["suites"]["grid"]
    timed = [r for r in rows if r["status"] != "skipped"]
    assert {r["method"] for r in timed} >= {"cupy-naive", "numflash-block", "numflash-row"}
    for r in timed:
        # naive float16 keeps S in float16 and may miss the float16 accuracy rule: FAIL allowed
        allowed = ("ok", "FAIL") if r["method"].startswith("cupy-naive") \
            and r["dtype"] == "float16" else ("ok",)
        assert r["status"] in allowed, r
        assert r["time_ms"]["median"] > 0 and r["memory"]["peak_bytes"] >= 0
        assert r["host_ms"]["median"] >= r["time_ms"]["median"] * 0.5
    for r in timed:
        if r["family"] == "numflash":
            assert "cupy-naive" in r["speedup"], r
            assert r["memory"]["peak_bytes"] <= 4 * r["predicted_peak_bytes"] + 2 ** 20
    assert glob.glob(os.path.join(out, "*_grid.png"))


def test_time_limit_stops_cleanly_and_still_writes_results(tmp_path):
    out = str(tmp_path / "res")
    bench.main(TINY + ["--n", "64", "--time-limit", "0", "--out", out])
    text, data = _outputs(out)
    assert "stopped before" in data["meta"]["stopped"] and data["suites"]["grid"] == []
    assert "**stopped early**" in text


def test_others_cpu_share_sees_a_busy_process(tmp_path):
    import subprocess
    import sys
    import time
    before = timing.proc_jiffies()
    assert before is not None
    t0 = time.time()
    while time.time() - t0 < 0.3:  # this process busy: not counted as others
        pass
    quiet = timing.others_cpu_share(before, timing.proc_jiffies())
    hog = subprocess.Popen([sys.executable, "-c",
                            "import time\nt=time.time()\nwhile time.time()-t<0.6: pass"])
    try:
        before = timing.proc_jiffies()
        time.sleep(0.5)
        busy = timing.others_cpu_share(before, timing.proc_jiffies())
    finally:
        hog.wait()
    ncpu = os.cpu_count() or 1
    assert 0.0 <= quiet <= 1.0
    assert busy >= 0.5 / ncpu  # one spinning process alone takes about 1/ncpu of the machine
    # busy 200 jiffies of 400, of which this process 100: others took a quarter
    assert timing.others_cpu_share((100, 1000, 10), (300, 1400, 110)) == pytest.approx(0.25)
    assert timing.others_cpu_share(None, before) is None


def test_plain_naive_peer_is_exact_attention(rng):
    """The textbook naive peer (the performance issue's "CuPy naive") on NumPy, with and without
    the causal mask."""
    from numflash.bench.baselines import causal_hidden, plain_naive_attention
    q, k, v = (rng.standard_normal((1, 2, 33, 16)).astype(np.float32) for _ in range(3))
    assert check(plain_naive_attention(np, q, k, v, 0.25), q, k, v, softmax_scale=0.25).ok
    hidden = causal_hidden(np, 33, 33)
    assert check(plain_naive_attention(np, q, k, v, 0.25, hidden), q, k, v, softmax_scale=0.25,
                 causal=True).ok


def test_results_json_takes_configs_that_are_mappings():
    """A backward plan's config holds one MmaConfig per pass (a Mapping, not a dict): the
    results file must still serialize (an H100 run failed there once)."""
    import json
    from numflash.bench.report import _jsonable
    from numflash.cuda.mma import MmaConfig
    cfg = {"queries": MmaConfig(64, 64, 4, 64, 0, "f16", 1),
           "keys": MmaConfig(64, 64, 4, 128, 0, "f16", 1, SUB=64)}
    got = json.loads(json.dumps(_jsonable({"config": cfg})))
    assert got["config"]["keys"] == {"D": 64, "DV": 64, "NW": 4, "BC": 128, "HOLDQ": 0,
                                     "DT": "f16", "VEC": 1, "SUB": 64}
