"""Ring attention across real processes: run by tests/test_distributed.py as a script.

    python tests/ring_worker.py --world 2 --out results.json [--backend gloo|nccl]
                                [--cases cpu|gpu|none]

Spawns ``world`` processes joined by torch.distributed (gloo over CPU tensors, or NCCL over one GPU
each). Every rank builds the same whole-sequence inputs from one seed, takes its shard, runs
numflash.distributed.ring_attention forward and backward, and the shards are gathered; rank 0
compares them with one numflash call on the whole sequence and with the float64 reference (the
accuracy rule), then runs bad-input cases that must raise on every rank without hanging
(``--cases none``: those alone, which compile one small kernel instead of every case's). Rank 0
writes a JSON report that the tests assert on.
"""
import argparse
import datetime
import json
import os
import sys
import time
import traceback
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TIMEOUT_S = 60  # every collective; a hang fails the run instead of blocking CI

# name, dict(B, H, Hk, n_local (per rank; q and k), nk_local (non-causal cross), d, dv, dtype,
#            causal, sharding, layout)
CPU_CASES = [
    ("zigzag-causal-f32", dict(B=2, H=2, Hk=2, n=6, d=16, dtype="float32", causal=True,
                               sharding="zigzag")),
    ("zigzag-plain-f32", dict(B=1, H=2, Hk=2, n=6, d=16, dtype="float32", causal=False,
                              sharding="zigzag")),
    ("contiguous-causal-f32-odd", dict(B=1, H=2, Hk=2, n=7, d=16, dtype="float32", causal=True,
                                       sharding="contiguous")),
    ("contiguous-plain-f32-odd", dict(B=2, H=1, Hk=1, n=7, d=8, dtype="float32", causal=False,
                                      sharding="contiguous")),
    ("zigzag-causal-f64-bshd-d59", dict(B=1, H=3, Hk=3, n=10, d=59, dtype="float64",
                                        causal=True, sharding="zigzag", layout="bshd")),
    ("zigzag-causal-f16", dict(B=1, H=2, Hk=2, n=8, d=32, dtype="float16", causal=True,
                               sharding="zigzag")),
    ("zigzag-causal-f16-d128", dict(B=1, H=4, Hk=4, n=256, d=128, dtype="float16", causal=True,
                                    sharding="zigzag")),  # 16-bit gradient steps: see the ring
    ("zigzag-causal-gqa-f32", dict(B=1, H=4, Hk=2, n=6, d=16, dtype="float32", causal=True,
                                   sharding="zigzag")),
    ("contiguous-cross-f32", dict(B=1, H=2, Hk=2, n=5, nk=7, d=16, dv=24, dtype="float32",
                                  causal=False, sharding="contiguous")),
    ("zigzag-causal-gqa-headchunks-f32", dict(B=1, H=4, Hk=2, n=6, d=16, dtype="float32",
                                              causal=True, sharding="zigzag", head_chunks=2)),
    ("contiguous-plain-bshd-headchunks-f64", dict(B=2, H=3, Hk=3, n=5, d=8, dtype="float64",
                                                  causal=False, sharding="contiguous",
                                                  layout="bshd", head_chunks=3)),
    ("zigzag-causal-d1-f64", dict(B=1, H=1, Hk=1, n=2, d=1, dtype="float64", causal=True,
                                  sharding="zigzag")),
]
GPU_CASES = [
    ("gpu-zigzag-causal-f16-d128", dict(B=1, H=4, Hk=4, n=1024, d=128, dtype="float16",
                                        causal=True, sharding="zigzag")),
    ("gpu-zigzag-causal-bf16-gqa", dict(B=1, H=8, Hk=2, n=1024, d=64, dtype="bfloat16",
                                        causal=True, sharding="zigzag")),
    ("gpu-contiguous-plain-f32", dict(B=2, H=2, Hk=2, n=513, d=64, dtype="float32",
                                      causal=False, sharding="contiguous")),
    ("gpu-zigzag-causal-f16-headchunks", dict(B=1, H=8, Hk=4, n=512, d=64, dtype="float16",
                                              causal=True, sharding="zigzag", head_chunks=2)),
]
_CASES = {"cpu": CPU_CASES, "gpu": GPU_CASES, "none": []}


def _tensors(spec, world, device, seed):
    import torch
    dt = getattr(torch, spec["dtype"])
    g = torch.Generator().manual_seed(seed)
    n_q = spec["n"] * world
    n_k = spec.get("nk", spec["n"]) * world
    B, H, Hk, d, dv = spec["B"], spec["H"], spec["Hk"], spec["d"], spec.get("dv", spec["d"])
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v, do = make(B, H, n_q, d), make(B, Hk, n_k, d), make(B, Hk, n_k, dv), make(B, H, n_q, dv)
    if spec.get("layout", "bhsd") == "bshd":
        q, k, v, do = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    return [t.to(dt).to(device) for t in (q, k, v, do)]


def warm_up(cases="cpu"):
    """Compile, in this one process, every numflash CPU kernel the ranks will run: each case's
    ring steps as ranks 0 and 1 of two, with the transfers replaced by local copies. The ranks
    then load the kernels from numba's disk cache instead of each compiling them at once on the
    same cores (137 s of a cold 2-core CI run before this)."""
    import torch
    from numflash import distributed as nd
    for name, spec in _CASES[cases]:
        layout = spec.get("layout", "bhsd")
        sd = 2 if layout == "bhsd" else 1
        q, k, v, do = _tensors(spec, 2, torch.device("cpu"), seed=0)
        for rank in range(2):
            local = [nd.shard(t, rank, 2, sharding=spec["sharding"], seq_dim=sd)
                     for t in (q, k, v, do)]
            ring = nd._Ring(None, rank, 2, spec["causal"], q.shape[-1] ** -0.5, layout,
                            spec["sharding"], (), communicate=False,
                            head_chunks=spec.get("head_chunks", 1))
            out, lse = nd._ring_forward(*local[:3], ring)
            nd._ring_backward(local[3], *local[:3], out, lse, ring)


def _gather(t, seq_dim, sharding, world):
    import torch
    import torch.distributed as dist
    from numflash.distributed import unshard
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return unshard(parts, sharding=sharding, seq_dim=seq_dim)


def _run_case(name, spec, rank, world, device):
    import numpy as np
    import torch
    import numflash.torch as nt
    from numflash import testing
    from numflash.distributed import ring_attention, shard
    layout = spec.get("layout", "bhsd")
    sd = 2 if layout == "bhsd" else 1
    sharding, causal = spec["sharding"], spec["causal"]
    q, k, v, do = _tensors(spec, world, device, seed=zlib.crc32(name.encode()))
    local = [shard(t, rank, world, sharding=sharding, seq_dim=sd).detach().clone().requires_grad_()
             for t in (q, k, v)]
    local_do = shard(do, rank, world, sharding=sharding, seq_dim=sd)
    t0 = time.perf_counter()
    out, lse = ring_attention(*local, causal=causal, layout=layout, sharding=sharding,
                              head_chunks=spec.get("head_chunks", 1), return_lse=True)
    out.backward(local_do)
    ring_s = time.perf_counter() - t0
    got = [_gather(t, sd, sharding, world) for t in (out, local[0].grad, local[1].grad,
                                                     local[2].grad)]
    got_lse = _gather(lse, 2, sharding, world)
    if rank != 0:
        return None
    whole = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    one, one_lse = nt.attention(*whole, causal=causal, layout=layout, return_lse=True)
    one.backward(do)
    single = [one, whole[0].grad, whole[1].grad, whole[2].grad]
    host = lambda t: t.detach().float().cpu().numpy() if t.dtype == torch.bfloat16 \
        else t.detach().cpu().numpy()  # noqa: E731
    qh, kh, vh, doh = (host(t) for t in (q, k, v, do))
    fwd = testing.check(host(got[0]), qh, kh, vh, lse=host(got_lse), causal=causal,
                        layout=layout) if spec["dtype"] != "bfloat16" else None
    bwd = testing.check_backward([host(g) for g in got[1:]], doh, qh, kh, vh, causal=causal,
                                 layout=layout) if spec["dtype"] != "bfloat16" else None
    names = ("out", "dq", "dk", "dv")
    got, single = [t.detach() for t in got], [t.detach() for t in single]
    diff = {n: float((a.double() - b.double()).abs().max()) for n, a, b in zip(names, got, single)}
    scale = {n: float(b.double().abs().max()) for n, b in zip(names, single)}
    lse_diff = float((got_lse.double() - one_lse.double()).abs().max())
    return dict(case=name, forward_ok=None if fwd is None else fwd.ok,
                forward=None if fwd is None else str(fwd),
                bounds=None if fwd is None else dict(out=fwd.bound, **bwd.bounds),
                backward_ok=None if bwd is None else bwd.ok,
                backward=None if bwd is None else str(bwd),
                vs_single=diff, single_max=scale, lse_diff=lse_diff,
                finite=bool(all(np.isfinite(host(g)).all() for g in got)), seconds=ring_s)


def _bad_cases(rank, world, device):
    """Each must raise on every rank, quickly, and leave the group usable."""
    import torch
    from numflash.distributed import ring_attention
    x = lambda n: torch.randn(1, 2, n, 8, device=device)  # noqa: E731
    cases = {
        "unequal shards": lambda: ring_attention(x(6 if rank else 4), x(6 if rank else 4),
                                                 x(6 if rank else 4), causal=True),
        "mismatched causal": lambda: ring_attention(x(4), x(4), x(4), causal=bool(rank % 2)),
        "mismatched sharding": lambda: ring_attention(
            x(4), x(4), x(4), causal=True, sharding="zigzag" if rank else "contiguous"),
        "one rank's bad shape": lambda: ring_attention(
            x(4)[0] if rank == world - 1 else x(4), x(4), x(4)),
        "odd zigzag shard": lambda: ring_attention(x(5), x(5), x(5), causal=True),
        "mismatched head_chunks": lambda: ring_attention(x(4), x(4), x(4),
                                                         head_chunks=1 + (rank == 0)),
        "head_chunks not dividing": lambda: ring_attention(x(4), x(4), x(4), head_chunks=3),
        "bad causal on one rank": lambda: ring_attention(
            x(4), x(4), x(4), causal="sideways" if rank == world - 1 else True),
        "mismatched precision": lambda: ring_attention(
            x(4), x(4), x(4), precision="ieee" if rank == 0 else "auto"),
        "GQA heads not dividing": lambda: ring_attention(
            torch.randn(1, 3, 4, 8, device=device), x(4), x(4)),
        "bfloat16 on the CPU": lambda: ring_attention(
            *(x(4).to(torch.bfloat16) for _ in range(3))),
    }
    report = {}
    for name, call in cases.items():
        t0 = time.perf_counter()
        try:
            call()
            report[name] = dict(raised=None, seconds=time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - the test reads which error and why
            report[name] = dict(raised=type(e).__name__, message=str(e),
                                seconds=time.perf_counter() - t0)
    # the group still works: a good call after the refusals
    out = ring_attention(x(4), x(4), x(4), causal=True)
    report["good call after"] = dict(raised=None, finite=bool(torch.isfinite(out).all()))
    return report


def _worker(rank, world, backend, init_file, cases, out_path):
    import torch
    import torch.distributed as dist
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    report = dict(world=world, backend=backend, cases=[], bad={})
    try:
        for name, spec in _CASES[cases]:
            try:
                r = _run_case(name, spec, rank, world, device)
            except Exception:  # noqa: BLE001 - reported, then the test fails on it
                r = dict(case=name, error=traceback.format_exc())
                if rank == 0:
                    report["cases"].append(r)
                raise
            if rank == 0:
                report["cases"].append(r)
        bad = _bad_cases(rank, world, device)
        report["bad"] = bad
        all_bad = [None] * world
        dist.all_gather_object(all_bad, bad)
        report["bad_every_rank"] = all_bad
    finally:
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(report, f, indent=1)
        dist.destroy_process_group()
    # About one run in six, a gloo process aborted in C++ teardown at interpreter exit
    # ("terminate called without an active exception", no Python frame), after all of the work
    # above had finished and the report was written; leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--cases", default="cpu", choices=sorted(_CASES))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import tempfile
    import torch.multiprocessing as mp
    if a.backend == "gloo":
        warm_up(a.cases)
    init_file = tempfile.mktemp(prefix="numflash-ring-")
    try:
        mp.spawn(_worker, args=(a.world, a.backend, init_file, a.cases, a.out), nprocs=a.world)
    finally:
        if os.path.exists(init_file):
            os.remove(init_file)


if __name__ == "__main__":
    main()
