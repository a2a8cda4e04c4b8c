"""How numflash times a call: the benchmark, the GPU tests and the scripts in bench/ all use this.

One place, because the details decide what a number means:

- device work is timed by a pair of CUDA events on the current stream (CuPy's or torch's), so the
  time is the GPU's, not the host's queueing and Python; each timed call starts after a device
  synchronize, so it never absorbs the tail of the call before, and the host time up to a device
  synchronize after it is kept alongside;
- CPU work is timed by ``time.perf_counter`` (NumPy and numba calls return when they are done);
- warm-up calls run first (compiles, memory pools, library handles), then the repeats, whose
  median (with min and max) is reported; calls rotate over several input sets, so that a repeat
  does not find its inputs in the last-level cache;
- on a shared CPU, the share of the machine that other processes used while a row was timed is
  measured, so that a slow time can be told from a busy machine.

Quick use (a GPU test or a one-off script): ``median_ms(lambda: f(x))``.
"""
import math
import statistics
import time

# Timing policy per backend: min/max repeats, the seconds one method may spend timing one row
# before its repeats drop below min_reps (never below floor_reps), warm-up calls.
POLICY = {
    "cuda": dict(warmup=3, min_reps=10, max_reps=50, budget_s=0.5, cap_s=30.0, floor_reps=3),
    "cpu": dict(warmup=1, min_reps=10, max_reps=10, budget_s=0.0, cap_s=3.0, floor_reps=3),
}

BUSY_SHARE = 0.2  # CPU path: flag rows timed while other processes used more of the CPUs


# ----------------------------------------------------------------------------------------------
# Timers: one call, (output, time in ms, host time in ms)
# ----------------------------------------------------------------------------------------------

class HostTimer:
    """time.perf_counter around each call: for the CPU, where a call returns when it is done."""
    description = "time.perf_counter around each call (NumPy and numba calls return when done)"

    def __call__(self, fn):
        t0 = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t0) * 1e3
        return out, ms, ms


class CudaEventTimer:
    """CUDA events on the current stream around each call, after a device synchronize; the host
    time up to a device synchronize after the call is returned alongside (work on other streams
    shows there). ``library``: "cupy" (CuPy's current stream) or "torch" (torch's)."""

    def __init__(self, library="cupy"):
        if library == "cupy":
            import cupy
            self._sync = lambda: cupy.cuda.Device().synchronize()
            self._elapsed = cupy.cuda.get_elapsed_time
            self.start, self.end = cupy.cuda.Event(), cupy.cuda.Event()
        elif library == "torch":
            import torch
            self._sync = torch.cuda.synchronize
            self._elapsed = lambda start, end: start.elapsed_time(end)
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        else:
            raise ValueError(f"library must be 'cupy' or 'torch', not {library!r}")
        stream = "CuPy" if library == "cupy" else "torch"
        self.description = (f"CUDA events recorded on the current {stream} stream around each "
                            f"call (host time after a device synchronize kept alongside)")

    def __call__(self, fn):
        self._sync()
        t0 = time.perf_counter()
        self.start.record()
        out = fn()
        self.end.record()
        self.end.synchronize()
        self._sync()  # work on any other stream too, for the host time
        host_ms = (time.perf_counter() - t0) * 1e3
        return out, self._elapsed(self.start, self.end), host_ms


# ----------------------------------------------------------------------------------------------
# Warm-up, repeats, statistics
# ----------------------------------------------------------------------------------------------

def warm_up(timer, call, n_sets, calls, enough_ms=1000.0):
    """``calls`` warm-up calls (at least one) of ``call(i)`` on input sets 1, 2, ... (mod n_sets);
    one call slower than ``enough_ms`` is warm-up enough."""
    for w in range(max(1, calls)):
        out, ms, _ = timer(lambda: call((w + 1) % n_sets))
        del out
        if ms > enough_ms:
            break


def time_repeats(timer, call, n_sets, reps, revise=None):
    """Time ``call(i % n_sets)`` for i = 0, 1, ...: ``reps`` calls, or, when ``revise`` is given,
    ``revise(ms of the first call)`` calls. Returns (times ms, host times ms, the first call's
    output); no other output is kept alive while the next call runs."""
    times, hosts, first = [], [], None
    i = 0
    while i < reps:
        out, ms, host = timer(lambda: call(i % n_sets))
        if i == 0:
            first = out
            if revise is not None:
                reps = revise(ms)
        del out
        times.append(ms)
        hosts.append(host)
        i += 1
    return times, hosts, first


def median_ms(fn, reps=10, warmup=2, timer=None):
    """Median milliseconds of ``fn()`` over ``reps`` timed calls after ``warmup`` untimed ones;
    by CUDA events on CuPy's current stream unless another timer is given."""
    timer = timer or CudaEventTimer()
    for _ in range(warmup):
        out, _, _ = timer(fn)
        del out
    times, _, _ = time_repeats(timer, lambda i: fn(), 1, reps)
    return float(statistics.median(times))


def per_call_ms(timer, fn, calls):
    """(device ms, host ms) per call of ``calls`` back-to-back calls timed as one, outputs
    dropped: at a size where the GPU keeps up, the host time is the per-call overhead."""
    def back_to_back():
        for _ in range(calls):
            fn()
    _, ms, host_ms = timer(back_to_back)
    return ms / calls, host_ms / calls


def summarize(times_ms):
    """Median, min, max and count of a list of times."""
    if not times_ms:
        raise ValueError("no times to summarize")
    return {"median": float(statistics.median(times_ms)), "min": float(min(times_ms)),
            "max": float(max(times_ms)), "n": len(times_ms)}


def choose_repeats(est_s, min_reps=10, max_reps=50, budget_s=0.5, cap_s=30.0, floor_reps=3):
    """How many timed repeats for a call that takes about ``est_s`` seconds.

    As many as fit in ``budget_s`` (between min_reps and max_reps); but when that many would take
    longer than ``cap_s``, as many as fit in ``cap_s``, never fewer than ``floor_reps``.
    """
    reps = min_reps if est_s <= 0 or budget_s <= 0 else int(budget_s / est_s)
    reps = max(min_reps, min(max_reps, reps))
    if est_s > 0 and est_s * reps > cap_s:
        reps = max(floor_reps, min(reps, int(cap_s / est_s)))
    return reps


def n_input_sets(set_bytes, cache_bytes, lo=3, hi=8):
    """Input sets to rotate: enough that together they exceed twice the last-level cache."""
    if set_bytes <= 0:
        return lo
    return max(lo, min(hi, math.ceil(2 * cache_bytes / set_bytes)))


# ----------------------------------------------------------------------------------------------
# How busy the (shared) CPU was while a row was timed
# ----------------------------------------------------------------------------------------------

def proc_jiffies():
    """(busy jiffies of all CPUs, all jiffies of all CPUs, this process's jiffies) or None."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total = sum(vals)
        return total - vals[3] - vals[4], total, int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def others_cpu_share(before, after):
    """Share of all CPUs' time that other processes (and steal) used between two proc_jiffies."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    busy = after[0] - before[0]
    own = after[2] - before[2]
    return max(0.0, min(1.0, (busy - own) / (after[1] - before[1])))
