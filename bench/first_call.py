"""Where the first call's time goes: fresh processes per configuration with an empty kernel
cache, compiling from source (NUMFLASH_PREBUILT=0: numba typing + lowering + NVVM to PTX, then
nvJitLink/ptxas to a cubin, then load and run) and from the shipped PTX (link only); a process
on the warm disk cache; and a warm in-process call.

    python bench/first_call.py [--no-source] [INDEX ...]   (GPU; a markdown table; INDEX: CONFIGS)
"""
import json
import os
import subprocess
import sys
import tempfile
import textwrap

CONFIGS = [  # dtype, d, causal, direction
    ("float16", 64, False, "forward"),
    ("float16", 128, True, "forward"),
    ("bfloat16", 128, False, "forward"),
    ("float32", 64, False, "forward"),
    ("float32", 128, False, "forward"),
    ("float64", 64, False, "forward"),
    ("float32", 64, False, "backward"),
]

CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import cupy, numpy as np
    import numflash
    from numflash.cuda import launch
    t_import = time.perf_counter() - t0
    phases = {"ptx": 0.0, "link": 0.0}
    ptx_fn, link_fn = launch.compile_ptx, launch.link_ptx

    def timed_ptx(*a, **k):
        t = time.perf_counter(); r = ptx_fn(*a, **k); phases["ptx"] += time.perf_counter() - t
        return r

    def timed_link(*a, **k):
        t = time.perf_counter(); r = link_fn(*a, **k); phases["link"] += time.perf_counter() - t
        return r
    launch.compile_ptx, launch.link_ptx = timed_ptx, timed_link
    dtype, d, causal, direction = json.loads(sys.argv[1])
    if dtype == "bfloat16":  # CuPy holds bfloat16 only through DLPack
        import torch
        q, k, v, do = (cupy.from_dlpack(torch.randn(1, 2, 256, d, device="cuda",
                                                    dtype=torch.bfloat16)) for _ in range(4))
    else:
        rng = np.random.default_rng(0)
        q, k, v, do = (cupy.asarray(rng.standard_normal((1, 2, 256, d)).astype(dtype))
                       for _ in range(4))

    def call():
        if direction == "forward":
            numflash.attention(q, k, v, causal=causal)
        else:
            o, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
            cupy.cuda.get_current_stream().synchronize()
            t = time.perf_counter()
            numflash.attention_backward(do, q, k, v, o, lse, causal=causal)
            cupy.cuda.get_current_stream().synchronize()
            return time.perf_counter() - t
        cupy.cuda.get_current_stream().synchronize()
    before = len(list(launch.cache_dir().glob("*.cubin"))) if launch.cache_dir().exists() else 0
    t = time.perf_counter(); first = call(); first = first or time.perf_counter() - t
    t = time.perf_counter(); warm = call(); warm = warm or time.perf_counter() - t
    sources = sorted({("disk" if e.meta.get("from_disk") else e.meta.get("source"))
                      for kern in launch._kernels.values() for e in kern._loaded.values()})
    print(json.dumps({"import": t_import, "first": first, "warm": warm, **phases,
                      "cached_before": before, "sources": sources}))
""")


def run(cfg, cache, prebuilt=True):
    env = dict(os.environ, NUMFLASH_CACHE_DIR=cache, NUMFLASH_PREBUILT="1" if prebuilt else "0")
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], env=env,
                         capture_output=True, text=True, timeout=300)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1][:80]}
    return json.loads(out.stdout.splitlines()[-1])


def main():
    rows = ["| config | from source, empty cache (s) | of which PTX (numba+NVVM) | shipped PTX, "
            "empty cache (s) | of which link (nvJitLink) | disk cache (s) | warm call (ms) | "
            "import (s) |", "|---|---|---|---|---|---|---|---|"]
    args = [a for a in sys.argv[1:] if a != "--no-source"]
    picked = [CONFIGS[int(i)] for i in args] or CONFIGS
    for cfg in picked:
        with tempfile.TemporaryDirectory() as c1, tempfile.TemporaryDirectory() as c2:
            # --no-source: skip the compile from source (minutes for 3xTF32), e.g. to time the
            # shipped PTX first on a fresh machine
            source = {"first": float("nan"), "ptx": float("nan")} if "--no-source" in sys.argv \
                else run(cfg, c1, prebuilt=False)
            shipped = run(cfg, c2)
            disk = run(cfg, c2)
        name = f"{cfg[0]} d{cfg[1]}{' causal' if cfg[2] else ''} {cfg[3]}"
        print(name, json.dumps([source, shipped, disk]), file=sys.stderr, flush=True)
        errors = [r["error"] for r in (source, shipped, disk) if "error" in r]
        if errors:
            rows.append(f"| {name} | {errors[0]} |||||||")
        else:
            rows.append(f"| {name} | {source['first']:.2f} | {source['ptx']:.2f} | "
                        f"{shipped['first']:.2f} | {shipped['link']:.2f} | {disk['first']:.3f} | "
                        f"{disk['warm'] * 1e3:.2f} | {shipped['import']:.2f} |")
        print(rows[-1], file=sys.stderr, flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
