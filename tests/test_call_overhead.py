"""The host cost of a repeated GPU call (skipped without a GPU).

A repeated call replays its recorded launch (numflash/cuda/fastpath.py); bench/NOTES.md ("Launch
overhead") measured it at 12-15 us of host time over a bare CuPy RawKernel launch on an H100, and
the full path, which every new signature takes once, at 125-134 us. The bound here is loose on
purpose: it catches a replay that stopped replaying or grew a slow step, not a few microseconds.
(This was the per-call overhead section of bench/gpu_probe.py.)
"""
import statistics

import numpy as np
import pytest

import numflash
from numflash.bench.timing import CudaEventTimer, per_call_ms

pytestmark = pytest.mark.gpu

BATCHES, CALLS = 30, 100  # far fewer calls a batch than the launch queue holds
BOUND_US = 60.0


def test_gpu_repeated_call_costs_little_over_a_bare_launch(rng):
    import cupy as cp
    q = cp.asarray(rng.standard_normal((1, 1, 128, 64)).astype(np.float32))
    empty = cp.RawKernel('extern "C" __global__ void e(float* x){}', "e")
    calls = {"numflash.attention": lambda: numflash.attention(q, q, q),
             "bare RawKernel": lambda: empty((1,), (32,), (q,))}
    timer = CudaEventTimer()
    for call in calls.values():  # compile, record the launch
        call()
    host_us = {name: [] for name in calls}
    for _ in range(BATCHES):  # taking turns, so that a drift of the machine hits both alike
        for name, call in calls.items():
            host_us[name].append(per_call_ms(timer, call, CALLS)[1] * 1e3)
    median = {name: statistics.median(us) for name, us in host_us.items()}
    over = median["numflash.attention"] - median["bare RawKernel"]
    assert over < BOUND_US, f"{over:.1f} us a call over a bare launch (median host us: {median})"
