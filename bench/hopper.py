"""Hopper 16-bit forward, side by side (issue 17): numflash's cuda.wgmma and cuda.mma against
PyTorch SDPA's flash and cuDNN backends and FlexAttention (torch.compile), on one GPU in one run.

    python bench/hopper.py [--shapes 4x16x4096 1x16x16384] [--d 64 128] [--dtype float16 bfloat16]
                           [--tiles 64:2x64 128:2x128] [--repeats 20] [--timing queued|alone]
                           [--out DIR]

Each row: three input sets rotated (fresh inputs each call), 3 warm-up calls per method, then
CUDA events on the one default stream, reported with TFLOP/s (4 B H N^2 d, halved for causal).
``--timing queued`` (the default): the median over 5 rounds of --repeats back-to-back calls
between two events, divided by --repeats, so the host runs ahead of the GPU as in a model and
a method's host time per call is hidden wherever its kernel takes longer.
``--timing alone`` (session 26's runs): the median of --repeats calls each between its own two
events, host time to the launch included (numflash called from torch tensors through DLPack
pays ~0.1 ms there, SDPA ~0.03 ms: bench/NOTES.md). Every method's output is compared with
the first method's (max_diff in the JSON), and cuda.wgmma's with the float64 reference on
sampled rows (numflash.testing's rule). ``--tiles D:NWGxBC``: cuda.wgmma's tile for padded head
dim D (a sweep; the shipped table is numflash/cuda/wgmma/tiles.py). Progress goes to stderr;
the table to stdout and, with --out, to DIR/hopper.json.
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["4x16x4096", "1x16x16384"],
                   help="BxHxN rows")
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtype", nargs="+", default=["float16", "bfloat16"],
                   choices=("float16", "bfloat16"))
    p.add_argument("--causal", nargs="+", default=["no", "yes"], choices=("no", "yes"))
    p.add_argument("--tiles", nargs="*", default=[], help="D:NWGxBC overrides")
    p.add_argument("--methods", nargs="+",
                   default=["wgmma", "mma", "sdpa-flash", "sdpa-cudnn", "flex"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--timing", default="queued", choices=("queued", "alone"))
    p.add_argument("--out")
    return p.parse_args(argv)


def _methods(torch, names, causal):
    """{name: f(q, k, v) -> out} over torch (B, H, N, d) tensors."""
    import cupy
    import numflash
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    out = {}

    def numflash_method(algorithm):
        def call(q, k, v):
            o = numflash.attention(cupy.from_dlpack(q), cupy.from_dlpack(k),
                                   cupy.from_dlpack(v), causal=causal, algorithm=algorithm)
            return torch.from_dlpack(o)
        return call

    def sdpa(backend):
        def call(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return call
    for name in names:
        if name in ("wgmma", "mma"):
            out[f"numflash-{name}"] = numflash_method(name)
        elif name == "sdpa-flash":
            out[name] = sdpa(SDPBackend.FLASH_ATTENTION)
        elif name == "sdpa-cudnn":
            out[name] = sdpa(SDPBackend.CUDNN_ATTENTION)
        elif name == "flex":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            flex = torch.compile(flex_attention, dynamic=False)
            masks = {}

            def call(q, k, v, _flex=flex, _masks=masks):
                if not causal:
                    return _flex(q, k, v)
                key = (q.shape[2], k.shape[2])
                if key not in _masks:
                    _masks[key] = create_block_mask(lambda b, h, i, j: i >= j, None, None,
                                                    q.shape[2], k.shape[2], device="cuda")
                return _flex(q, k, v, block_mask=_masks[key])
            out[name] = call
    return out


def _time(torch, fn, sets, repeats, timing="queued"):
    """Median milliseconds a call, inputs rotated: ``repeats`` calls each timed alone, or
    (queued) 5 rounds of ``repeats`` back-to-back calls each timed as a whole."""
    for i in range(3):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    per_span, spans = (1, repeats) if timing == "alone" else (repeats, 5)
    times = []
    for r in range(spans):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(per_span):
            fn(*sets[(r * per_span + i) % len(sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_span)
    return statistics.median(times)


def main(argv=None):
    args = _args(argv)
    import cupy
    import torch
    import numflash
    from numflash.cuda.wgmma import tiles
    from numflash.testing import check
    for item in args.tiles:
        D, tile = item.split(":")
        tiles.TILES[int(D)] = tuple(int(x) for x in tile.split("x"))
    name = torch.cuda.get_device_name()
    print(f"# {name}, torch {torch.__version__}, numflash cuda.wgmma tiles {tiles.TILES}, "
          f"timing {args.timing}", flush=True)
    rows = []
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        B, H, N = (int(x) for x in shape.split("x"))
        for d in args.d:
            for dtype in args.dtype:
                tdt = getattr(torch, dtype)
                sets = [tuple(torch.randn(B, H, N, d, device="cuda", dtype=tdt)
                              for _ in range(3)) for _ in range(3)]
                for causal_name in args.causal:
                    causal = causal_name == "yes"
                    flops = 4 * B * H * N * N * d / (2 if causal else 1)
                    row = {"B": B, "H": H, "N": N, "d": d, "dtype": dtype, "causal": causal,
                           "gpu": name, "timing": args.timing, "ms": {}, "tflops": {},
                           "max_diff": {}}
                    methods = _methods(torch, args.methods, causal)
                    ref_out = None
                    for mname, fn in methods.items():
                        t0 = time.time()
                        try:
                            out = fn(*sets[0])
                            ms = _time(torch, fn, sets, args.repeats, args.timing)
                        except Exception as e:  # noqa: BLE001 - a peer that refuses the row
                            print(f"  {mname}: {type(e).__name__}: {str(e)[:200]}",
                                  file=sys.stderr, flush=True)
                            continue
                        if ref_out is None:
                            ref_out = out.float()
                        row["ms"][mname] = ms
                        row["tflops"][mname] = flops / ms / 1e9
                        row["max_diff"][mname] = float((out.float() - ref_out).abs().max())
                        print(f"  {mname} {ms:.3f} ms ({time.time() - t0:.0f} s)",
                              file=sys.stderr, flush=True)
                    if "numflash-wgmma" in methods and "numflash-wgmma" in row["ms"]:
                        q, k, v = (cupy.from_dlpack(x) for x in sets[0])
                        out = numflash.attention(q, k, v, causal=causal, algorithm="wgmma")
                        pick = np.unique(np.r_[0:8, N - 8:N, rng.choice(N, 48, replace=False)])
                        rep = check(out, q, k, v, causal=causal, rows=pick)
                        row["check"] = {"ok": rep.ok, "err": rep.max_err, "bound": rep.bound}
                    rows.append(row)
                    base = row["ms"].get("numflash-wgmma")
                    cells = "  ".join(f"{m} {row['ms'][m]:.3f} ms {row['tflops'][m]:.0f} TF"
                                      + (f" ({row['ms'][m] / base:.2f}x)" if base else "")
                                      for m in row["ms"])
                    print(f"B{B} H{H} N{N} d{d} {dtype} {'causal' if causal else 'full'}: "
                          f"{cells}  check={row.get('check')}", flush=True)
    if args.out:
        import pathlib
        path = pathlib.Path(args.out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "hopper.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
