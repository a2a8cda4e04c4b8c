"""numflash.bench.timing, the one timing helper of the benchmark, the GPU tests and bench/: the
order of events and synchronizes around a call (with a stand-in for CuPy, no GPU needed), warm-up,
repeats over rotating input sets, and on a GPU the events against a kernel of known length."""
import sys
import types

import pytest

from numflash.bench import timing


class FakeTimer:
    """A timer whose k-th call takes times[k] ms (the last one again after the end)."""

    def __init__(self, times):
        self.times, self.calls = list(times), 0

    def __call__(self, fn):
        out = fn()
        ms = self.times[min(self.calls, len(self.times) - 1)]
        self.calls += 1
        return out, ms, ms + 1


def test_event_timer_records_around_the_call_between_synchronizes(monkeypatch):
    log = []

    class Event:
        def record(self):
            log.append(f"record {'start' if self is timer.start else 'end'}")

        def synchronize(self):
            log.append("end.synchronize")
    cuda = types.SimpleNamespace(
        Event=Event, Device=lambda: types.SimpleNamespace(synchronize=lambda: log.append("sync")),
        get_elapsed_time=lambda start, end: 2.5)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    timer = timing.CudaEventTimer()
    out, ms, host_ms = timer(lambda: log.append("call") or "out")
    assert log == ["sync", "record start", "call", "record end", "end.synchronize", "sync"]
    assert (out, ms) == ("out", 2.5) and host_ms >= 0
    assert "CuPy stream" in timer.description
    with pytest.raises(ValueError, match="library"):
        timing.CudaEventTimer("jax")


def test_time_repeats_rotates_sets_keeps_the_first_output_and_revises_the_count():
    seen = []

    def call(i):
        seen.append(i)
        return f"out{i}"
    times, hosts, first = timing.time_repeats(FakeTimer([4.0, 1.0, 2.0]), call, n_sets=3, reps=2,
                                              revise=lambda ms: 5 if ms == 4.0 else 1)
    assert seen == [0, 1, 2, 0, 1] and first == "out0"
    assert times == [4.0, 1.0, 2.0, 2.0, 2.0] and hosts == [5.0, 2.0, 3.0, 3.0, 3.0]
    times, _, _ = timing.time_repeats(FakeTimer([1.0]), call, n_sets=2, reps=3)
    assert len(times) == 3


def test_warm_up_starts_on_set_one_and_stops_after_a_slow_call():
    seen = []
    timing.warm_up(FakeTimer([1.0, 1.0, 1.0]), seen.append, n_sets=2, calls=3)
    assert seen == [1, 0, 1]
    seen.clear()
    timing.warm_up(FakeTimer([5.0, 2000.0, 1.0]), seen.append, n_sets=4, calls=5)
    assert seen == [1, 2]  # the second call took over a second: warm enough
    seen.clear()
    timing.warm_up(FakeTimer([1.0]), seen.append, n_sets=4, calls=0)
    assert seen == [1]  # always at least one


def test_median_ms_and_per_call_ms():
    calls = []
    ms = timing.median_ms(lambda: calls.append(1), reps=3, warmup=2,
                          timer=FakeTimer([9.0, 9.0, 3.0, 1.0, 2.0]))
    assert ms == 2.0 and len(calls) == 5  # the warm-up calls are not in the median
    calls.clear()
    device, host = timing.per_call_ms(FakeTimer([10.0]), lambda: calls.append(1), 4)
    assert (device, host) == (2.5, 2.75) and len(calls) == 4
    _, ms, host_ms = timing.HostTimer()(lambda: None)
    assert ms == host_ms >= 0


@pytest.mark.gpu
@pytest.mark.parametrize("library", ["cupy", "torch"])
def test_gpu_events_time_the_device_not_the_host(library):
    """A kernel that spins for 10^7 clock cycles (several ms): its launch returns at once, yet the
    events see most of the host's time to the synchronize after it, and never more."""
    import cupy as cp
    if library == "torch":
        pytest.importorskip("torch")
    spin = cp.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) {}
    }""", "spin")

    def call():
        spin((1,), (1,), (cp.int64(10 ** 7),))
    timer = timing.CudaEventTimer(library)
    assert 1.0 < timing.median_ms(call, reps=5, timer=timer) < 100.0
    _, event_ms, host_ms = timer(call)
    assert 0.5 * host_ms < event_ms <= 1.01 * host_ms, (event_ms, host_ms)
