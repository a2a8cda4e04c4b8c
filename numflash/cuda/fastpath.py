"""Repeated GPU calls replay the recorded launch: no argument checks, planning or packing again.

The first call with a given signature runs the full path: normalize() checks every argument,
plan.choose() picks the kernel, the kernel module packs and launches it. That launch is recorded
(a launch.Recipe) under the call's signature. A later call with the same signature allocates the
output (and the lse if it is returned), patches five data pointers (q, k, v, out, lse) into the
recorded parameters and launches: ~17-22 us of host time a call instead of ~125-135 us on the
full path (bench/NOTES.md, "Launch overhead").

The signature holds everything the checks, the plan and the packed parameters depend on: the
array type, shapes, strides, dtypes, devices and 16-byte alignment of q, k and v, the current
device and every option with its type. So a call that the full path would reject, or plan
differently, never matches a recorded one. (The simulator switch is not in it: numba reads
NUMBA_ENABLE_CUDASIM once, at import, and with it on no CuPy call is ever recorded.) Calls with
``out=`` always take the full path (it must check that ``out`` does not overlap an input).

This module imports nothing heavy: ``import numflash`` must not import numba or CuPy.
"""
import sys
import threading

_recorded = threading.local()
_replays = {}
_MAX_REPLAYS = 1024
_cupy = _cupy_ndarray = _get_device = None  # set once CuPy has been imported by someone


def note_launch(recipe):
    """Called by launch.Kernel for every GPU launch; kept only inside ``recording()``."""
    launches = getattr(_recorded, "launches", None)
    if launches is not None:
        launches.append(recipe)


class recording:
    """Collect the launches made in this thread inside the block."""

    def __enter__(self):
        self.launches = _recorded.launches = []
        return self.launches

    def __exit__(self, *exc):
        _recorded.launches = None


def signature(q, k, v, options):
    """The replay key of a call, or None when it cannot be replayed: not three CuPy arrays, or q
    not on the current device (the full path switches devices; a replay launches as it stands)."""
    global _cupy, _cupy_ndarray, _get_device
    if _cupy_ndarray is None:
        _cupy = sys.modules.get("cupy")
        if _cupy is None:
            return None
        _cupy_ndarray, _get_device = _cupy.ndarray, _cupy.cuda.runtime.getDevice
    t = _cupy_ndarray
    if type(q) is not t or type(k) is not t or type(v) is not t:
        return None
    qd, kd, vd = q.data, k.data, v.data
    if qd.device_id != _get_device():
        return None
    key = (q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, q.dtype, k.dtype, v.dtype,
           qd.device_id, kd.device_id, vd.device_id, qd.ptr % 16, kd.ptr % 16, vd.ptr % 16,
           options, tuple(map(type, options)))  # causal=1 is not causal=True: only True is valid
    try:
        hash(key)  # an unhashable option (which the full path rejects) cannot be a key
    except TypeError:
        return None
    return key


def call_options(causal, softmax_scale, layout, backend, algorithm, return_lse, precision):
    """attention()'s options as they enter the signature."""
    return (causal, softmax_scale, layout, backend, algorithm, bool(return_lse), precision)


_kept = {}


def keep(array):
    """Mark a device array a kernel passes on every launch as living as long as the process, so
    launches that pass it may be replayed (the mma kernel's debug placeholder)."""
    _kept[array.data.ptr] = array
    return array


# An lse nobody asked for goes to one buffer per replay, up to this size, for launches on the
# stream it was allocated on (one allocation less per call). Launches there are ordered, and when
# the replay is dropped, CuPy's pool hands the memory out again on that same stream only.
SCRATCH_LSE_BYTES = 1 << 18


class Replay:
    """A recorded call: allocate out (and lse, if returned) like the full path did, relaunch."""
    __slots__ = ("recipe", "out_shape", "dtype", "lse_shape", "lse_dtype", "return_lse",
                 "scratch_lse", "scratch_stream")

    def __init__(self, recipe, problem, lse):
        self.recipe = recipe
        self.dtype = problem.dtype
        self.out_shape = tuple(problem.result.shape)
        self.lse_shape = tuple(problem.q.shape[:3])
        self.lse_dtype = lse.dtype
        self.return_lse = problem.return_lse
        small = not self.return_lse and lse.nbytes <= SCRATCH_LSE_BYTES
        self.scratch_lse = lse if small else None
        self.scratch_stream = _cupy.cuda.get_current_stream().ptr if small else None

    def __call__(self, q, k, v):
        cupy = _cupy
        stream = cupy.cuda.get_current_stream().ptr
        out = cupy.empty(self.out_shape, self.dtype)
        lse = self.scratch_lse if stream == self.scratch_stream else None
        if lse is None:
            lse = cupy.empty(self.lse_shape, self.lse_dtype)
        self.recipe.launch(stream, (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr,
                                    lse.data.ptr))
        return (out, lse) if self.return_lse else out


def lookup(key):
    return _replays.get(key) if key is not None else None


def replayable(launches, pointers):
    """The recorded launch if a call can be replayed by patching ``pointers`` (q, k, v, out, lse):
    it was one launch, its first array arguments are those, and its other array arguments were
    marked with keep(). None otherwise."""
    if len(launches) != 1:
        return None
    recipe = launches[0]
    n = len(pointers)
    if recipe.pointers[:n] != tuple(pointers) or any(p not in _kept for p in recipe.pointers[n:]):
        return None
    return recipe


def remember(key, launches, problem, lse):
    """Keep the call's launch for replay if :func:`replayable`. Returns the Replay, or None if
    the call cannot be one."""
    recipe = None if key is None else replayable(launches, [
        a.data.ptr for a in (problem.q, problem.k, problem.v, problem.out, lse)])
    if recipe is None:
        return None
    if len(_replays) >= _MAX_REPLAYS:
        _replays.clear()
    replay = _replays[key] = Replay(recipe, problem, lse)
    return replay


def clear():
    _replays.clear()
