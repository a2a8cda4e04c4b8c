"""numflash.distributed: ring attention across processes, against one call on the whole sequence.

The multi-process runs live in tests/ring_worker.py (spawned as a script, gloo over CPU tensors; on
a machine with two GPUs also NCCL); the sharding helpers and the refusals that need no ring are
tested here in-process.
"""
import datetime
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import numflash  # noqa: E402
from numflash import distributed as nd  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "ring_worker.py")


def _run_worker(tmp_path_factory, world, backend, cases):
    out = tmp_path_factory.mktemp(f"ring{world}{backend}") / "report.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(  # numflash first, the rest kept
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, WORKER, "--world", str(world), "--backend", backend,
                           "--cases", cases, "--out", str(out)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert out.exists(), \
        f"the ring worker wrote no report (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    errors = [c["error"] for c in report["cases"] if "error" in c]
    assert not errors and proc.returncode == 0, "\n".join(errors) or proc.stderr[-4000:]
    return report


@pytest.fixture(scope="module", params=[
    2, 3,
    # issue 19's rank counts, on gloo (the GPU runs: bench/ring_scaling.py)
    pytest.param(4, marks=pytest.mark.extended), pytest.param(8, marks=pytest.mark.extended),
], ids=["world2", "world3", "world4", "world8"])
def gloo_report(request, tmp_path_factory):
    return _run_worker(tmp_path_factory, request.param, "gloo", "cpu")


@pytest.fixture(scope="module")
def gloo_refusals_report(tmp_path_factory):
    """Two ranks running the bad-input cases alone (the full runs above also end with them)."""
    return _run_worker(tmp_path_factory, 2, "gloo", "none")


def _assert_cases(report):
    assert report["cases"], "the worker ran no case"
    for c in report["cases"]:
        where = f"{c['case']} on {report['world']} ranks ({report['backend']})"
        assert c["finite"], where
        if c["forward_ok"] is not None:  # the accuracy rule against the float64 reference
            assert c["forward_ok"], f"{where}: {c['forward']}"
            assert c["backward_ok"], f"{where}: {c['backward']}"
            for name, bound in c["bounds"].items():  # and as close to one whole-sequence call
                assert c["vs_single"][name] <= bound, (where, name, c["vs_single"], bound)
        else:  # bfloat16 (no NumPy reference): as close to the single call as bf16 rounding
            for name, diff in c["vs_single"].items():
                assert diff <= 2 ** -6 * max(1.0, c["single_max"][name]), (where, name, diff)
        assert c["lse_diff"] <= 1e-4, (where, c["lse_diff"])


def test_ring_matches_one_call_on_the_whole_sequence(gloo_report):
    """Forward and backward on 2, 3, 4 and 8 CPU processes: causal and not, zigzag and
    contiguous, odd shard lengths, float16/32/64, bshd, GQA, Nq != Nk, d = 1 and 59, head chunks;
    then the bad-input cases on as many ranks."""
    _assert_cases(gloo_report)
    _assert_refusals(gloo_report)
    names = {c["case"] for c in gloo_report["cases"]}
    assert {"zigzag-causal-f32", "contiguous-causal-f32-odd", "zigzag-causal-gqa-f32",
            "contiguous-cross-f32", "zigzag-causal-f64-bshd-d59",
            "zigzag-causal-gqa-headchunks-f32", "contiguous-plain-bshd-headchunks-f64"} <= names


EXPECTED_REFUSALS = {  # (the error every rank raises, what its message says)
    "unequal shards": ("ValueError", "differs from rank 0 in q shape"),
    "mismatched causal": ("ValueError", "differs from rank 0 in causal"),
    "mismatched sharding": ("ValueError", "differs from rank 0 in sharding"),
    "one rank's bad shape": ("ValueError", ""),  # that rank: its own error; others: "refused"
    "odd zigzag shard": ("ValueError", "must be even"),
    "mismatched head_chunks": ("ValueError", "differs from rank 0 in head_chunks"),
    "head_chunks not dividing": ("ValueError",
                                 "head_chunks must be a positive integer dividing the 2 K/V"),
    "bad causal on one rank": ("ValueError", ""),
    "mismatched precision": ("ValueError", "differs from rank 0 in options"),
    "GQA heads not dividing": ("ValueError", "heads"),
    "bfloat16 on the CPU": ("TypeError", "bfloat16"),  # numflash's own refusal, on every rank
}


def test_bad_input_raises_on_every_rank_without_hanging(gloo_refusals_report):
    """Refused before any transfer, on every rank alike (or, for one rank's bad argument, its
    own error there and "refused" on the others), within seconds; the group stays usable."""
    assert gloo_refusals_report["cases"] == []  # the refusals alone
    _assert_refusals(gloo_refusals_report)


def _assert_refusals(report):
    world = report["world"]
    every = report["bad_every_rank"]
    assert len(every) == world
    for rank, got in enumerate(every):
        for name, (kind, text) in EXPECTED_REFUSALS.items():
            r = got[name]
            assert r["raised"] == kind, (rank, name, r)
            assert text in r["message"], (rank, name, r["message"])
            assert r["seconds"] < 10, (rank, name, r["seconds"])  # no wait for a timeout
        for name, own in (("one rank's bad shape", "q must be 4-D"),
                          ("bad causal on one rank", "causal must be one of")):
            msg = got[name]["message"]
            assert own in msg if rank == world - 1 else \
                f"rank(s) [{world - 1}] were refused" in msg, (rank, name, msg)
        assert got["good call after"] == {"raised": None, "finite": True}


@pytest.mark.gpu
def test_ring_on_two_gpus_over_nccl(tmp_path_factory):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    report = _run_worker(tmp_path_factory, 2, "nccl", "gpu")
    _assert_cases(report)


# ---- in-process: the helpers and the refusals before any ring ----

@pytest.mark.parametrize("sharding", nd.SHARDINGS)
@pytest.mark.parametrize("seq_dim", [1, 2])
def test_shard_unshard_round_trip_and_positions(sharding, seq_dim):
    world, n = 3, 18
    x = torch.arange(2 * 4 * n * 5).reshape(2, n, 4, 5) if seq_dim == 1 else \
        torch.arange(2 * 4 * n * 5).reshape(2, 4, n, 5)
    shards = [nd.shard(x, r, world, sharding=sharding, seq_dim=seq_dim) for r in range(world)]
    assert torch.equal(nd.unshard(shards, sharding=sharding, seq_dim=seq_dim), x)
    for r, s in enumerate(shards):
        pos = nd.shard_positions(n, r, world, sharding=sharding)
        assert torch.equal(s, x.index_select(seq_dim, pos))
    got = torch.cat([nd.shard_positions(n, r, world, sharding=sharding) for r in range(world)])
    assert sorted(got.tolist()) == list(range(n))


def test_zigzag_gives_every_rank_the_same_causal_work():
    """Counted from the step plan the ring runs: zigzag balances the visible (query, key) pairs
    per rank and per step; contiguous leaves the last rank P times the first rank's work."""
    world, n = 4, 8

    def work(sharding):
        per_rank = []
        for rank in range(world):
            ring = nd._Ring(None, rank, world, True, 1.0, "bhsd", sharding, ())
            steps = []
            for step in range(world):
                src = (rank - step) % world
                pairs = 0
                for (q0, nq), (k0, nk), causal in nd._pieces(ring, src, n, n):
                    pairs += nq * (nq + 1) // 2 if causal else nq * nk
                steps.append(pairs)
            per_rank.append(steps)
        return np.array(per_rank)

    zig, cont = work("zigzag"), work("contiguous")
    total = world * n * (world * n + 1) // 2  # the causal pairs of the whole sequence
    assert zig.sum() == cont.sum() == total
    assert len(set(zig[:, 1:].ravel())) == 1          # off-diagonal steps: equal everywhere
    assert len(set(zig.sum(axis=1))) == 1             # and equal totals per rank
    assert cont.sum(axis=1)[-1] > 3 * cont.sum(axis=1)[0]


def test_helpers_refuse_bad_arguments():
    x = torch.zeros(1, 1, 10, 4)
    with pytest.raises(ValueError, match="does not split into 4 equal chunks"):
        nd.shard(x, 0, 2, sharding="zigzag")
    with pytest.raises(ValueError, match="sharding must be one of"):
        nd.shard(x, 0, 2, sharding="striped")
    with pytest.raises(ValueError, match="rank must be in"):
        nd.shard(x, 2, 2, sharding="contiguous")
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        nd.shard_positions(10, 0, 0)
    with pytest.raises(ValueError, match="one shard per rank, all of the same length"):
        nd.unshard([x, x[:, :, :4]], sharding="contiguous")


def test_ring_attention_needs_an_initialized_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    x = torch.zeros(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        nd.ring_attention(x, x, x)


def test_one_rank_ring_is_plain_attention(tmp_path):
    """A group of one: the ring has no neighbour and is one numflash call (in this process)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(1, 2, 9, 16, generator=g, requires_grad=True) for _ in range(3))
        out = nd.ring_attention(q, k, v, causal=True, sharding="contiguous")
        out.sum().backward()
        ring_grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        one = numflash.torch.attention(q, k, v, causal=True)
        one.sum().backward()
        torch.testing.assert_close(out, one, rtol=0, atol=1e-6)
        for a, t in zip(ring_grads, (q, k, v)):
            torch.testing.assert_close(a, t.grad, rtol=0, atol=1e-6)
        with pytest.raises(ValueError, match="sharding must be one of"):
            nd.ring_attention(q, k, v, sharding="striped")
        with pytest.raises(TypeError, match="unexpected options"):
            nd.ring_attention(q, k, v, dropout_p=0.1)
        out = nd.ring_attention(q, k, v, causal=True, sharding="contiguous")
        with pytest.raises(RuntimeError, match="no double backward"):
            torch.autograd.grad(out.sum(), q, create_graph=True)
        if torch.cuda.is_available():
            with pytest.raises(ValueError, match="need a process group with the nccl backend"):
                nd.ring_attention(q.cuda(), k.cuda(), v.cuda())
    finally:
        dist.destroy_process_group()

