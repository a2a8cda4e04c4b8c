"""Ring attention on several GPUs of one host: correctness at scale, scaling, overlap, memory.

    python bench/ring_scaling.py --world 2 --out DIR [--quick]

Spawns one process per GPU (NCCL). Every rank draws the same whole-sequence inputs from one seed
on its GPU and keeps its zigzag shard. Measured (CUDA events; before each timed call a barrier;
a step's time is the slowest rank's; median of the repeats after a warm-up):

- correctness: the ring's output (B1 H32 d128 fp16 causal, N = 131072) gathered and compared with
  one numflash call on the whole sequence on one GPU, and rows of it with the float64 reference
  (the accuracy rule); the gradients (H = 1) against the one-GPU backward;
- the forward on 1 GPU (the whole sequence, one numflash call) against the ring on P GPUs, for N
  in 65536..524288, float16 and bfloat16: scaling efficiency = t1 / (P * tP);
- the same ring with its transfers replaced by local copies (the overlap: comm on vs off);
- the backward (ring backward alone vs numflash.attention_backward on one GPU);
- the training step (``--phases step``): forward + backward, B1 H32 d128 bf16 causal, on 1 GPU
  (numflash.attention then attention_backward) and as a ring over the first P GPUs for each P
  of ``--step-counts`` (a subgroup; the other ranks wait), efficiency against the smallest
  count measured at that N;
- the peak memory per GPU (torch's allocator) for each.

Writes DIR/ring.json after every measurement (a run cut short keeps what it measured) and
DIR/ring.md at the end.
"""
import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FLOPS = lambda B, H, N, d, causal: 4 * B * H * N * N * d / (2 if causal else 1)  # noqa: E731


def log(rank, *a):
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def _timed(fn, reps, warmup, group_sync):
    """(CUDA-event milliseconds of each repeat after the warm-up, peak GiB allocated by torch
    during them, inputs included).

    The events are numflash.bench.timing's; the loop is this script's own, because every call
    must start after ``group_sync`` (a barrier of all ranks: a step's time is the slowest
    rank's), and a call's output must be gone before the next starts (the peak is one call's).
    """
    import torch
    from numflash.bench.timing import CudaEventTimer
    timer = CudaEventTimer("torch")
    ts = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + reps):
        group_sync()
        out, ms, _ = timer(fn)
        del out
        if i >= warmup:
            ts.append(ms)
    return ts, torch.cuda.max_memory_allocated() / 2 ** 30


def _does_not_fit_one_gpu(rank, world, dev, results, quick, ring_of, gather, log):
    """B1 H128 d128 fp16 causal at the N where q, k, v and the output (fp16) need more than one
    GPU's memory: one numflash call on one GPU fails to allocate; the ring with head_chunks runs.
    A few rows are checked against float64 attention computed on the GPU."""
    import torch
    import torch.distributed as dist
    import numflash.torch as nt
    from numflash.distributed import _ring_forward
    H, d, chunks = (8, 64, 2) if quick else (128, 128, 8)
    total = torch.cuda.get_device_properties(dev).total_memory
    step = 2 * world * 1024
    N = -(-int(1.05 * total / (4 * H * d * 2)) // step) * step if not quick else 65536
    row = dict(N=N, B=1, H=H, d=d, dtype="float16", causal=True, head_chunks=chunks,
               gpu_total_gib=total / 2 ** 30, one_gpu_needs_gib=4 * N * H * d * 2 / 2 ** 30)
    log(rank, f"does-not-fit: N={N} H={H} d={d}: one GPU needs {row['one_gpu_needs_gib']:.1f} "
              f"GiB for q, k, v, out; it has {row['gpu_total_gib']:.1f}")
    if rank == 0:
        try:
            q, k, v = (torch.empty(1, H, N, d, dtype=torch.float16, device=dev) for _ in range(3))
            nt.attention(q, k, v, causal=True)
            row["one_gpu"] = "ran"
        except torch.OutOfMemoryError as e:
            row["one_gpu"] = "OutOfMemoryError: " + str(e).split(".")[0]
        q = k = v = None
        torch.cuda.empty_cache()
    dist.barrier()
    n = N // world
    g = torch.Generator(device=dev).manual_seed(100 + rank)
    q, k, v = (torch.randn(1, H, n, d, generator=g, device=dev, dtype=torch.float16)
               for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    dist.barrier()
    t0 = time.perf_counter()
    out, lse = _ring_forward(q, k, v, ring_of(head_chunks=chunks))
    torch.cuda.synchronize()
    row["ring_s"] = time.perf_counter() - t0
    peak = torch.tensor([torch.cuda.max_memory_allocated(dev) / 2 ** 30], device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    row["ring_peak_gib_per_gpu"] = float(peak)
    t = torch.tensor([row["ring_s"]], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    row["ring_s"] = float(t)
    row["finite"] = bool(torch.isfinite(out).all())
    # rows of head 0 against float64 attention over the gathered keys of head 0
    kh, vh = (gather(x.narrow(1, 0, 1)) for x in (k, v))
    qh = gather(q.narrow(1, 0, 1))
    oh = gather(out.narrow(1, 0, 1))
    if rank == 0:
        rows = torch.linspace(0, N - 1, 8, device=dev).long()
        s = (qh[0, 0, rows].double() @ kh[0, 0].double().T) * d ** -0.5
        s = s.masked_fill(torch.arange(N, device=dev)[None, :] > rows[:, None], float("-inf"))
        ref = torch.softmax(s, dim=-1) @ vh[0, 0].double()
        row["rows_checked"] = 8
        row["max_err_vs_float64"] = float((oh[0, 0, rows].double() - ref).abs().max())
        row["max_abs_out"] = float(ref.abs().max())
        results["does_not_fit_one_gpu"] = row
        log(rank, row)
    del q, k, v, out, lse, kh, vh, qh, oh
    torch.cuda.empty_cache()


def _worker(rank, world, init_file, out_dir, quick, deadline, phases, backward_heads=2,
            backward_ns=(32768, 65536), backward_reps=2, correctness_n=131072,
            step_ns=(131072,), step_counts=(1, 2, 4), step_no_comm=False):
    import torch
    import torch.distributed as dist
    import numflash.torch as nt
    from numflash import distributed as nd
    from numflash import testing

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=20))
    results = dict(world=world, gpu=torch.cuda.get_device_name(dev), torch=torch.__version__,
                   correctness=[], forward=[], backward=[], step=[],
                   started=time.strftime("%F %T"))

    def save():
        if rank == 0:
            with open(os.path.join(out_dir, "ring.json"), "w") as f:
                json.dump(results, f, indent=1)

    def sync():
        torch.cuda.synchronize()
        dist.barrier()

    def slowest(ts):  # per repeat, the slowest rank's time
        t = torch.tensor(ts, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def whole(B, H, N, d, dtype, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        return [torch.randn(B, H, N, d, generator=g, device=dev, dtype=torch.float32).to(dtype)
                for _ in range(4)]

    def gather(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return nd.unshard(parts, sharding="zigzag", seq_dim=2)

    def ring_of(causal=True, communicate=True, head_chunks=1):
        return nd._Ring(None, rank, world, causal, 128 ** -0.5, "bhsd", "zigzag", (),
                        communicate=communicate, head_chunks=head_chunks)

    def time_rings(row, make_fn, reps, warm):
        """Time make_fn(ring)() with transfers on and replaced by local copies: the slowest
        rank's median and repeats, and the largest peak memory of any rank, into row."""
        for key, ring in (("ring", ring_of()), ("ring_no_comm", ring_of(communicate=False))):
            ts, gib = _timed(make_fn(ring), reps, warm, sync)
            ts = slowest(ts)
            row[f"{key}_ms"], row[f"{key}_repeats"] = statistics.median(ts), ts
            mem = torch.tensor([gib], device=dev)
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            row[f"{key}_peak_gib_per_gpu"] = float(mem)

    t_start = time.time()

    def out_of_time(what):  # every rank decides alike: rank 0's clock
        late = torch.tensor([time.time() - t_start > deadline], device=dev)
        dist.broadcast(late, 0)
        if bool(late):
            results.setdefault("skipped", []).append(what)
            log(rank, f"skipped (past the {deadline} s deadline): {what}")
        return bool(late)

    if "fit" in phases:
        _does_not_fit_one_gpu(rank, world, dev, results, quick, ring_of, gather, log)
        save()

    # ---- correctness at scale ----
    if "correctness" in phases:
        N = 32768 if quick else correctness_n
        log(rank, f"correctness: forward N={N} B1 H32 d128 fp16 causal")
        q, k, v, do = whole(1, 32, N, 128, torch.float16, 1)
        shards = [nd.shard(t, rank, world, seq_dim=2) for t in (q, k, v)]
        out, lse = nd._ring_forward(*shards, ring_of())
        got, got_lse = gather(out), gather(lse)
        if rank == 0:
            one, one_lse = nt.attention(q, k, v, causal=True, return_lse=True)
            rows = torch.linspace(0, N - 1, 12).long().tolist()
            host = [t.cpu().numpy() for t in (got, q, k, v, got_lse)]
            rep = testing.check(host[0], *host[1:4], lse=host[4], causal=True, rows=rows)
            results["correctness"].append(dict(
                what="forward", N=N, H=32, d=128, dtype="float16",
                max_diff_vs_one_gpu=float((got.float() - one.float()).abs().max()),
                lse_max_diff=float((got_lse - one_lse).abs().max()),
                rows_checked=len(rows), accuracy_rule=str(rep), ok=rep.ok))
            log(rank, results["correctness"][-1])
            del one, one_lse
        del q, k, v, do, shards, out, lse, got, got_lse
        save()
        log(rank, f"correctness: backward N={N} B1 H1 d128 fp16 causal")
        q, k, v, do = whole(1, 1, N, 128, torch.float16, 2)
        local = [nd.shard(t, rank, world, seq_dim=2).requires_grad_() for t in (q, k, v)]
        out = nd.ring_attention(*local, causal=True)
        out.backward(nd.shard(do, rank, world, seq_dim=2))
        grads = [gather(t.grad) for t in local]
        if rank == 0:
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            one = nt.attention(*full, causal=True)
            one.backward(do)
            diffs = {n: float((a.float() - b.grad.float()).abs().max())
                     for n, a, b in zip(("dq", "dk", "dv"), grads, full)}
            scale = {n: float(b.grad.float().abs().max())
                     for n, b in zip(("dq", "dk", "dv"), full)}
            results["correctness"].append(dict(what="backward", N=N, H=1, d=128, dtype="float16",
                                               max_diff_vs_one_gpu=diffs, max_abs_one_gpu=scale))
            log(rank, results["correctness"][-1])
            del full, one
        del q, k, v, do, local, out, grads
        torch.cuda.empty_cache()
        save()

    # ---- forward scaling ----
    plan = []
    if "forward" in phases:
        plan = [(torch.float16, n) for n in ((32768, 65536) if quick else
                                             (65536, 131072, 262144, 524288))]
        plan += [] if quick else [(torch.bfloat16, n) for n in (131072, 262144)]
    for dtype, N in plan:
        reps, warm = (3, 1) if N <= 131072 else (2, 0)
        log(rank, f"forward {dtype} N={N}")
        if out_of_time(f"forward {dtype} N={N}"):
            continue
        q, k, v, _ = whole(1, 32, N, 128, dtype, N)
        del _
        row = dict(dtype=str(dtype).split(".")[-1], N=N, B=1, H=32, d=128, causal=True)
        if rank == 0:
            fn = partial(nt.attention, q, k, v, causal=True)
            t1, row["one_gpu_peak_gib"] = _timed(fn, reps, warm, torch.cuda.synchronize)
            row["one_gpu_ms"], row["one_gpu_repeats"] = statistics.median(t1), t1
        dist.barrier()
        shards = [nd.shard(t, rank, world, seq_dim=2) for t in (q, k, v)]
        del q, k, v
        torch.cuda.empty_cache()
        time_rings(row, lambda ring, sh=shards: partial(nd._ring_forward, *sh, ring), reps, warm)
        if rank == 0:
            row["efficiency"] = row["one_gpu_ms"] / (world * row["ring_ms"])
            row["one_gpu_tflops"] = FLOPS(1, 32, N, 128, True) / row["one_gpu_ms"] / 1e9
            results["forward"].append(row)
            log(rank, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                       if not k.endswith("repeats")})
        del shards
        torch.cuda.empty_cache()
        save()

    # ---- backward scaling (numflash's CUDA backward is cuda.row: slow, so fewer heads) ----
    H = backward_heads
    for N in (((8192, 16384) if quick else backward_ns) if "backward" in phases else ()):
        if out_of_time(f"backward fp16 H={H} N={N}"):
            continue
        log(rank, f"backward fp16 H={H} N={N}")
        q, k, v, do = whole(1, H, N, 128, torch.float16, 7 * N)
        row = dict(dtype="float16", N=N, B=1, H=H, d=128, causal=True)
        if rank == 0:
            o, lse = nt.attention(q, k, v, causal=True, return_lse=True)
            fn = partial(nt.attention_backward, do, q, k, v, o, lse, causal=True)
            t1, row["one_gpu_peak_gib"] = _timed(fn, backward_reps, 1 if N <= 32768 else 0,
                                                 torch.cuda.synchronize)
            row["one_gpu_ms"], row["one_gpu_repeats"] = statistics.median(t1), t1
            del o, lse
        dist.barrier()
        shards = [nd.shard(t, rank, world, seq_dim=2) for t in (q, k, v, do)]
        del q, k, v, do
        def backward_of(ring, sh=shards):  # the ring's own forward gives its out and lse
            o, lse = nd._ring_forward(*sh[:3], ring)
            return partial(nd._ring_backward, sh[3], *sh[:3], o, lse, ring)

        time_rings(row, backward_of, backward_reps, 1 if N <= 32768 else 0)
        if rank == 0:
            row["efficiency"] = row["one_gpu_ms"] / (world * row["ring_ms"])
            row["one_gpu_tflops"] = 2.5 * FLOPS(1, H, N, 128, True) / row["one_gpu_ms"] / 1e9
            results["backward"].append(row)
            log(rank, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                       if not k.endswith("repeats")})
        del shards
        torch.cuda.empty_cache()
        save()

    # ---- the training step: forward + backward, 1 GPU and rings over the first P GPUs ----
    groups = {P: dist.new_group(list(range(P))) for P in step_counts if 1 < P < world}
    for N in (step_ns if "step" in phases else ()):
        for P in step_counts:
            what = f"step bf16 N={N} on {P} GPU(s)"
            if out_of_time(what):
                continue
            log(rank, what)
            # the same whole inputs (one seed) drawn for each count, and dropped once sharded:
            # a ring rank holds only its shards, as in training
            q, k, v, do = whole(1, 32, N, 128, torch.bfloat16, 11 * N)
            big = N >= 524288
            # one repeat where a step takes most of a minute or more (kernels warm by then)
            reps, warm = (1, 0) if big and (P == 1 or N > 524288) else (2, 0) if big else (3, 1)
            row = dict(dtype="bfloat16", N=N, B=1, H=32, d=128, causal=True, gpus=P)
            ts, gib = [0.0] * reps, 0.0
            if P == 1 and rank == 0:
                def one_gpu_step(q=q, k=k, v=v, do=do):
                    o, lse = nt.attention(q, k, v, causal=True, return_lse=True)
                    return nt.attention_backward(do, q, k, v, o, lse, causal=True)
                try:
                    ts, gib = _timed(one_gpu_step, reps, warm, torch.cuda.synchronize)
                except torch.OutOfMemoryError as e:
                    row["error"] = "OutOfMemoryError: " + str(e).split(".")[0]
                    ts = [-1.0] * reps   # all_reduce's max keeps it below the waiting zeros
                torch.cuda.empty_cache()
            elif P > 1 and rank < P:
                shards = [nd.shard(t, rank, P, seq_dim=2) for t in (q, k, v, do)]
                del q, k, v, do
                torch.cuda.empty_cache()
                ring = nd._Ring(groups.get(P), rank, P, True, 128 ** -0.5, "bhsd", "zigzag", ())

                def ring_step(sh=shards, ring=ring):
                    o, lse = nd._ring_forward(*sh[:3], ring)
                    return nd._ring_backward(sh[3], *sh[:3], o, lse, ring)
                group_sync = (lambda g=groups.get(P): (torch.cuda.synchronize(),
                                                        dist.barrier(group=g)))
                ts, gib = _timed(ring_step, reps, warm, group_sync)
                if step_no_comm:   # the same ring with local copies in place of transfers
                    quiet = dataclasses.replace(ring, communicate=False)
                    no_comm = _timed(partial(ring_step, ring=quiet), reps, warm, group_sync)[0]
                del shards
                torch.cuda.empty_cache()
            if step_no_comm and P > 1:
                no_comm = slowest(no_comm if rank < P else [0.0] * reps)
                if rank == 0:
                    row["no_comm_ms"] = statistics.median(no_comm)
            ts = slowest(ts)   # every rank takes part; waiting ranks gave zeros
            mem = torch.tensor([gib], device=dev)
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            if rank == 0:
                row["ms"], row["repeats"] = statistics.median(ts), ts
                if "error" in row:
                    row["ms"] = float("nan")
                row["peak_gib_per_gpu"] = float(mem)
                row["tflops_per_gpu"] = 3.5 * FLOPS(1, 32, N, 128, True) / row["ms"] / 1e9 / P
                results["step"].append(row)
                _step_efficiency([x for x in results["step"] if x["N"] == N])
                log(rank, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                           if k != "repeats"})
            save()
            q = k = v = do = None
            torch.cuda.empty_cache()

    results["finished"] = time.strftime("%F %T")
    save()
    if rank == 0:
        _markdown(results, os.path.join(out_dir, "ring.md"))
    dist.destroy_process_group()


def _step_efficiency(rows):
    """Each row's efficiency against the smallest GPU count measured at its N: P0 t(P0) / (P t(P))
    (FLOPs of the step: forward 1, backward 2.5 of the forward's)."""
    done = [x for x in rows if x["ms"] == x["ms"]]
    if not done:
        return
    base = min(done, key=lambda x: x["gpus"])
    for x in done:
        x["relative_to"] = base["gpus"]
        x["efficiency"] = base["gpus"] * base["ms"] / (x["gpus"] * x["ms"])


def _markdown(r, path):
    lines = [f"Ring attention, {r['world']} x {r['gpu']}, torch {r['torch']}, {r['started']}", ""]
    for c in r["correctness"]:
        lines.append(f"- correctness {c['what']} N={c['N']} H={c['H']}: "
                     f"{json.dumps({k: v for k, v in c.items() if k not in ('what',)})}")
    for what in ("forward", "backward"):
        if not r[what]:
            continue
        lines += ["", f"{what} (causal, zigzag, d128): ms, median",
                  "| dtype | N | H | 1 GPU | ring | ring, no transfers | efficiency | "
                  "GiB 1 GPU | GiB/GPU ring |", "|---|---|---|---|---|---|---|---|---|"]
        for x in r[what]:
            lines.append(f"| {x['dtype']} | {x['N']} | {x['H']} | {x['one_gpu_ms']:.1f} | "
                         f"{x['ring_ms']:.1f} | {x['ring_no_comm_ms']:.1f} | "
                         f"{x['efficiency']:.3f} | {x['one_gpu_peak_gib']:.2f} | "
                         f"{x['ring_peak_gib_per_gpu']:.2f} |")
    if r.get("step"):
        lines += ["", "training step, forward + backward (bf16, causal, zigzag, B1 H32 d128): ms, "
                  "median; efficiency against the smallest count measured at that N; GiB: "
                  "torch's peak per GPU during the repeats (a ring rank holds its shards only)",
                  "| N | GPUs | ms | no transfers ms | TFLOP/s per GPU | efficiency | vs | "
                  "GiB per GPU |", "|---|---|---|---|---|---|---|---|"]
        for x in r["step"]:
            lines.append(f"| {x['N']} | {x['gpus']} | {x['ms']:.1f} | "
                         f"{x.get('no_comm_ms', float('nan')):.1f} | {x['tflops_per_gpu']:.0f} | "
                         f"{x.get('efficiency', float('nan')):.3f} | {x.get('relative_to', '-')} | "
                         f"{x['peak_gib_per_gpu']:.2f} |" + (f" {x['error']}" if 'error' in x
                                                              else ""))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--phases", default="fit,correctness,forward,backward",
                    help="comma-separated: fit, correctness, forward, backward, step")
    ap.add_argument("--correctness-n", type=int, default=131072)
    ap.add_argument("--step-n", default="131072,524288,1048576", help="N of the step runs")
    ap.add_argument("--step-counts", default="1,2,4",
                    help="GPU counts of the step runs, in the order run (at most --world)")
    ap.add_argument("--step-no-comm", action="store_true",
                    help="also time each ring step with its transfers replaced by local copies")
    ap.add_argument("--backward-heads", type=int, default=2,
                    help="H of the backward runs (numflash's CUDA backward is slow: issue 13)")
    ap.add_argument("--backward-n", default="32768,65536", help="N of the backward runs")
    ap.add_argument("--backward-reps", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=1e9,
                    help="seconds after which the remaining measurements are skipped")
    a = ap.parse_args()
    import torch.multiprocessing as mp
    os.makedirs(a.out, exist_ok=True)
    init_file = tempfile.mktemp(prefix="numflash-ring-bench-")
    try:
        mp.spawn(_worker, args=(a.world, init_file, a.out, a.quick, a.deadline,
                                a.phases.split(","), a.backward_heads,
                                [int(n) for n in a.backward_n.split(",")], a.backward_reps,
                                a.correctness_n, [int(n) for n in a.step_n.split(",")],
                                [int(n) for n in a.step_counts.split(",")], a.step_no_comm),
                 nprocs=a.world)
    finally:
        if os.path.exists(init_file):
            os.remove(init_file)


if __name__ == "__main__":
    main()
