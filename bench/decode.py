"""Decoding on the GPU: a few query rows against a long K/V, where one block per (batch, head)
cannot fill the GPU and split-KV (num_splits) has to. numflash with its automatic split count
and with num_splits=1 against PyTorch SDPA's backends on the same memory.

    python bench/decode.py [--dtypes float16,bfloat16,float32] [--nk 131072] [--heads 32]
                           [--kv-heads 32] [--d 128] [--nq 1,16] [--batch 1]
                           [--splits 8,16,32,64] [--kvcache] [--block-mask]
                           [--tiles 1/64/1,2/64/1]

Reports ms (CUDA events: warm-up, median of repeats; numflash.bench.timing.median_ms) and the
K/V read rate in GB/s (the bytes of K and V over the time), and the largest difference of each
output from SDPA's first backend that ran (the GPU tests check numflash against the float64
reference at these shapes' smaller siblings). Not causal: SDPA's is_causal aligns top-left,
which for Nq < Nk is not decoding's bottom-right (numflash's causal="bottom_right").
With --block-mask a column times numflash (auto) with a key-padding block mask that keeps every
key (each entry's length Nk: FULL blocks), so its cost over the plain call is the list walk's.
With --kv-heads below --heads (GQA) a column times decode (Nq 1) with each K/V head's query
heads passed as its query rows (q reshaped to (B, Hk, H / Hk, d), plain multi-head attention:
each K/V row read once, not once a query head), the same attention as the GQA call.
"""
import argparse
import contextlib

import numpy as np


def _sdpa_backends(torch):
    from torch.nn.attention import SDPBackend
    return {"SDPA flash": SDPBackend.FLASH_ATTENTION, "SDPA cuDNN": SDPBackend.CUDNN_ATTENTION,
            "SDPA efficient": SDPBackend.EFFICIENT_ATTENTION}


def main():
    import cupy
    import numflash
    from numflash.bench.timing import median_ms
    from mods_cost import _key_padding   # (bench/ is on this script's path)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float16,bfloat16,float32")
    ap.add_argument("--nk", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--nq", default="1,16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--splits", default="",
                    help="also time these forced num_splits counts (a column each)")
    ap.add_argument("--kvcache", action="store_true",
                    help="time attention_with_kvcache (contiguous, pages of 16 and 256) instead")
    ap.add_argument("--block-mask", action="store_true",
                    help="also time numflash with a key-padding block mask keeping every key")
    ap.add_argument("--tiles", default="",
                    help="also time numflash (auto) with cuda.mma's split tile forced to each "
                         "NW/BC/HOLDQ given, e.g. 1/64/1,2/64/1 (an experiment: a column each, "
                         "ms (GB/s; shares; largest difference from auto's output))")
    a = ap.parse_args()
    if a.kvcache and (a.block_mask or a.tiles):
        ap.error("--block-mask and --tiles time attention(), not attention_with_kvcache")
    try:
        tiles = [tuple(int(x) for x in t.split("/")) for t in a.tiles.split(",") if t]
    except ValueError:
        tiles = [()]
    if any(len(t) != 3 for t in tiles):
        ap.error(f"--tiles takes NW/BC/HOLDQ triples, e.g. 1/64/1,2/64/1; got {a.tiles!r}")
    if a.kvcache:
        return kvcache_table(a)
    try:
        import torch
        from torch.nn.attention import sdpa_kernel
        backends = _sdpa_backends(torch)
    except ImportError:
        torch = None
        backends = {}
    B, H, Hk, Nk, d = a.batch, a.heads, a.kv_heads or a.heads, a.nk, a.d
    rng = np.random.default_rng(0)
    print(f"B{B} H{H} Hk{Hk} Nk{Nk} d{d}: ms (K/V GB/s)")
    forced = [int(n) for n in a.splits.split(",") if n]
    masked = ["block mask"] if a.block_mask else []
    rows_of = ["heads as rows"] if Hk < H else []
    print("| dtype | Nq | numflash auto | splits | numflash num_splits=1 | " +
          "".join(f"num_splits={n} | " for n in forced) +
          ("auto, block mask | " if masked else "") +
          ("auto, each K/V head's query heads as rows (Nq 1) | " if rows_of else "") +
          "".join(f"tile {'/'.join(map(str, t))} (splits) | " for t in tiles) +
          " | ".join(backends) + " | auto vs best peer | max diff |")
    print("|---" * (7 + len(forced) + len(masked) + len(rows_of) + len(tiles) + len(backends))
          + "|")
    for dtype in a.dtypes.split(","):
        dt = np.dtype(__import__("ml_dtypes").bfloat16) if dtype == "bfloat16" else dtype
        k, v = (cupy.asarray(rng.standard_normal((B, Hk, Nk, d), np.float32)).astype(dt)
                for _ in range(2))
        kv_gb = 2 * k.nbytes / 1e9
        for Nq in (int(n) for n in a.nq.split(",")):
            q = cupy.asarray(rng.standard_normal((B, H, Nq, d), np.float32)).astype(dt)
            plan = numflash.explain(q, k, v)
            splits = _shares(plan)
            row = {}
            row["auto"] = median_ms(lambda: numflash.attention(q, k, v))
            row["one"] = median_ms(lambda: numflash.attention(q, k, v, num_splits=1))
            for n in forced:
                row[n] = median_ms(lambda: numflash.attention(q, k, v, num_splits=n))
            if masked:   # (built once, as a model would for all its layers)
                bm = numflash.create_block_mask(_key_padding, B, None, Nq, Nk,
                                                (cupy.full(B, Nk, np.int64),))
                row["block mask"] = median_ms(lambda: numflash.attention(q, k, v, block_mask=bm))
            ours = numflash.attention(q, k, v)
            if rows_of and Nq == 1:   # flash-attn's decode trick: K/V read once per K/V head
                grouped = q.reshape(B, Hk, H // Hk, d)   # (query head h reads K/V head h // G)
                ms = median_ms(lambda: numflash.attention(grouped, k, v))
                gap = float(abs(numflash.attention(grouped, k, v).reshape(ours.shape)
                                .astype(np.float32) - ours.astype(np.float32)).max())
                row["heads as rows"] = f"{ms:.3f} ({kv_gb / ms * 1e3:.0f}; {gap:.1e} from auto)"
            elif rows_of:
                row["heads as rows"] = "n/a (Nq > 1)"
            for tile in tiles:
                with _split_tile(tile):
                    tiled = numflash.explain(q, k, v)
                    cfg = tiled.config
                    if tiled.kernel != "cuda.mma" or not cfg.SPLIT or \
                            (cfg.NW, cfg.BC, cfg.HOLDQ) != tile:
                        why = tiled.rejected.get("cuda.mma", "no split")
                        row[tile] = f"n/a ({tiled.kernel}: {why})"
                        continue
                    shares = _shares(tiled)
                    ms = median_ms(lambda: numflash.attention(q, k, v))
                    gap = float(abs(numflash.attention(q, k, v).astype(np.float32) -
                                    ours.astype(np.float32)).max())
                row[tile] = f"{ms:.3f} ({kv_gb / ms * 1e3:.0f}; {shares}; {gap:.1e} from auto)"
            peers, diff = {}, "-"
            if torch is not None:
                tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
                gqa = {"enable_gqa": True} if Hk != H else {}
                for name, backend in backends.items():
                    try:
                        with sdpa_kernel(backend):
                            def call():
                                return torch.nn.functional.scaled_dot_product_attention(
                                    tq, tk, tv, **gqa)
                            ref = call()
                            peers[name] = median_ms(call)
                        if diff == "-":
                            diff = float(abs(torch.from_dlpack(ours).float() - ref.float())
                                         .max())
                    except RuntimeError as e:
                        peers[name] = f"n/a ({str(e).splitlines()[0][:40]})"
            best = min((t for t in peers.values() if isinstance(t, float)), default=None)
            cells = [f"{row['auto']:.3f} ({kv_gb / row['auto'] * 1e3:.0f})", splits,
                     f"{row['one']:.3f} ({kv_gb / row['one'] * 1e3:.0f})"]
            cells += [f"{row[n]:.3f} ({kv_gb / row[n] * 1e3:.0f})" for n in forced + masked]
            cells += [row[n] for n in rows_of] + [row[t] for t in tiles]
            cells += [f"{t:.3f} ({kv_gb / t * 1e3:.0f})" if isinstance(t, float) else t
                      for t in peers.values()]
            cells += [f"{best / row['auto']:.2f}x" if best else "-",
                      f"{diff:.2e}" if isinstance(diff, float) else diff]
            print(f"| {dtype} | {Nq} | " + " | ".join(cells) + " |", flush=True)


def _shares(plan):
    """The split-KV share count explain's plan names ("1" where it does not split)."""
    return next((n.split(" shares")[0].rsplit(" ", 1)[1] for n in plan.notes
                 if "split-KV" in n), "1")


@contextlib.contextmanager
def _split_tile(tile):
    """cuda.mma's split-KV calls planned on ``tile`` (NW, BC, HOLDQ) instead of choose_tile's:
    the decode-tile experiment (one warp a block leaves 48 of 64 rows of padding out of the
    products at Nq <= 16). The plan memo and the recorded launches (fastpath's replays) are
    cleared on the way in and out, so no call replays another tile's launch."""
    import dataclasses
    from numflash import plan
    from numflash.cuda import fastpath, mma
    from numflash.device import Unsupported
    original = mma.config

    def config(problem, device):
        cfg = original(problem, device)
        if not cfg.SPLIT:
            return cfg
        cfg = dataclasses.replace(cfg, NW=tile[0], BC=tile[1], HOLDQ=tile[2])
        if mma.shared_bytes(cfg) > device.smem_per_block_optin:
            raise Unsupported(f"tile {tile} needs {mma.shared_bytes(cfg)} bytes of shared memory")
        return cfg

    def forget():
        plan._plans.clear()
        fastpath.clear()
    forget()
    mma.config = config
    try:
        yield
    finally:
        mma.config = original
        forget()


def kvcache_table(a):
    """attention_with_kvcache at the decode shape, one new row appended a call, the cache in
    flash-attn's (B, S, Hk, d) layout (paged: the same rows in shuffled pages), against
    attention() on the same K / V (bhsd), with cache_seqlens and block_table given as CuPy
    arrays (read back to the host for their checks: a synchronization) and as NumPy arrays.
    Each cell: one call from an idle GPU (its host time counts) / back-to-back calls (what a
    decode loop sees: host time hides behind the GPU's unless something synchronizes)."""
    import cupy
    import numflash
    from numflash.bench.timing import CudaEventTimer, median_ms, per_call_ms
    B, H, Hk, S, d = a.batch, a.heads, a.kv_heads or a.heads, a.nk, a.d
    rng = np.random.default_rng(0)
    timer = CudaEventTimer()
    print(f"attention_with_kvcache, B{B} H{H} Hk{Hk} cache {S} rows d{d}, Nq 1: ms (K/V GB/s), "
          f"one call / back-to-back (30 calls)")
    print("| dtype | lengths, table | attention (bhsd K/V) | attention (the cache, bshd) | "
          "kvcache contiguous | paged 16 | paged 256 |")
    print("|---|---|---|---|---|---|---|")
    for dtype in a.dtypes.split(","):
        dt = np.dtype(__import__("ml_dtypes").bfloat16) if dtype == "bfloat16" else dtype
        kc, vc = (cupy.asarray(rng.standard_normal((B, S, Hk, d), np.float32)).astype(dt)
                  for _ in range(2))
        q = cupy.asarray(rng.standard_normal((B, 1, H, d), np.float32)).astype(dt)
        new = cupy.asarray(rng.standard_normal((B, 1, Hk, d), np.float32)).astype(dt)
        host_lens = np.full((B,), S - 1, np.int32)
        gb = 2 * kc.nbytes / 1e9
        kb, vb = (cupy.ascontiguousarray(c.transpose(0, 2, 1, 3)) for c in (kc, vc))
        qb = cupy.ascontiguousarray(q.transpose(0, 2, 1, 3))
        caches = {None: (kc, vc, None)}
        for page in (16, 256):
            n = B * S // page
            caches[page] = tuple(c.reshape(n, page, Hk, d) for c in (kc, vc)) + (
                rng.permutation(n).astype(np.int32).reshape(B, -1),)

        def cell(fn):
            one = median_ms(fn)
            back = per_call_ms(timer, fn, 30)[0]
            return f"{one:.3f} / {back:.3f} ({gb / back * 1e3:.0f})"
        plain = [cell(lambda: numflash.attention(qb, kb, vb)),
                 cell(lambda: numflash.attention(q, kc, vc, layout="bshd"))]
        for kind, to in (("CuPy", cupy.asarray), ("NumPy", np.asarray)):
            cells = list(plain)
            for page, (kp, vp, table) in caches.items():
                lens, table = to(host_lens), None if table is None else to(table)
                cells.append(cell(lambda: numflash.attention_with_kvcache(
                    q, kp, vp, new, new, lens, table)))
            print(f"| {dtype} | {kind} | " + " | ".join(cells) + " |", flush=True)

if __name__ == "__main__":
    main()
