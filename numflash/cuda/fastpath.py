"""Repeated GPU calls replay the recorded launch: no argument checks, planning or packing again.

The first call with a given signature runs the full path: normalize() checks every argument,
plan.choose() picks the kernel, the kernel module packs and launches it. Those launches are
recorded (launch.Recipe each) under the call's signature. A later call with the same signature
allocates the output (and the lse if it is returned), patches the data pointers of q, k, v, out
and lse into the recorded parameters and launches (a split-KV call launches twice and passes
scratch partials between them, reused on the recording's stream): ~17-22 us of host time a call instead of ~125-135 us on the
full path (bench/NOTES.md, "Launch overhead").

The signature holds everything the checks, the plan and the packed parameters depend on: the
array type, shapes, strides, dtypes, devices and 16-byte alignment of q, k and v, the current
device and every option with its type, the modifications a replay takes included (a window, a
softcap; ALiBi slopes, a bias, a mask as arrays: see replay_mods). So a call that the full path
would reject, or plan differently, never matches a recorded one. (The simulator switch is not in
it: numba reads NUMBA_ENABLE_CUDASIM once, at import, and with it on no CuPy call is ever
recorded.) Calls with other modifications (functions, block masks), with dropout or with
``out=`` always take the full path (``out`` must be checked not to overlap an input).

A backward call (``attention_backward`` on CuPy arrays, the torch operator's body) without
modifications, dropout, given gradients or bias / mod_args gradients is recorded the same way
under its six arrays' signature and its options (:class:`GradientReplay`): several launches,
scratch made anew each call (zero-filled where the launches add into it), and nothing else; a
kernel module that does other GPU work in a call says so (``note_unreplayable``), and that call
is never replayed (bench/NOTES.md, "The backward's host time").

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


def note_scratch(array, zeroed=False):
    """Called by a kernel module for a work array that only its own launches read (split-KV's
    partials, the backward's delta and dQ accumulator). A forward replay reuses it on the
    recording's stream and allocates a new one on another; a gradient replay allocates a new
    one each call. ``zeroed``: the launches expect it filled with zeros (made by cupy.zeros):
    a gradient replay zero-fills it before them, and a forward call that noted one is not
    remembered (its replay reuses scratch as the launches left it)."""
    launches = getattr(_recorded, "launches", None)
    if launches is not None:
        launches.scratch.append(array)
        launches.zeroed.append(bool(zeroed))
    return array


def note_unreplayable(why):
    """Called by a kernel module for GPU work of a call that is not a recorded launch (a CuPy
    operation on its outputs): a call that did some is never replayed."""
    launches = getattr(_recorded, "launches", None)
    if launches is not None:
        launches.unreplayable.append(why)


class Launches(list):
    """The launches recorded in a call, the scratch arrays they pass (note_scratch) and what
    made the call unreplayable (note_unreplayable)."""

    def __init__(self):
        super().__init__()
        self.scratch = []
        self.zeroed = []
        self.unreplayable = []


class recording:
    """Collect the launches made in this thread inside the block."""

    def __enter__(self):
        self.launches = _recorded.launches = Launches()
        return self.launches

    def __exit__(self, *exc):
        _recorded.launches = None


def _found_cupy():
    """Whether CuPy has been imported (by anyone); binds what the keys read of it."""
    global _cupy, _cupy_ndarray, _get_device
    if _cupy_ndarray is None:
        _cupy = sys.modules.get("cupy")
        if _cupy is None:
            return False
        _cupy_ndarray, _get_device = _cupy.ndarray, _cupy.cuda.runtime.getDevice
    return True


def signature(q, k, v, options):
    """The replay key of a call, or None when it cannot be replayed: not three CuPy arrays, or q
    not on the current device (the full path switches devices; a replay launches as it stands)."""
    if not _found_cupy():
        return None
    t = _cupy_ndarray
    if type(q) is not t or type(k) is not t or type(v) is not t:
        return None
    qd, kd, vd = q.data, k.data, v.data
    if qd.device_id != _get_device():
        return None
    key = (q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, q.dtype, k.dtype, v.dtype,
           qd.device_id, kd.device_id, vd.device_id, qd.ptr % 16, kd.ptr % 16, vd.ptr % 16,
           options, tuple(map(type, options)))  # causal=1 is not causal=True: only True is valid
    return _hashable(key)


def _hashable(key):
    try:
        hash(key)  # an unhashable option (which the full path rejects) cannot be a key
    except TypeError:
        return None
    return key


def gradient_signature(arrays, options):
    """The replay key of a backward call on ``arrays`` (do, q, k, v, o, lse), as
    :func:`signature` is a forward's: None unless they are all CuPy arrays and q is on the
    current device."""
    if not _found_cupy():
        return None
    t = _cupy_ndarray
    if any(type(a) is not t for a in arrays):
        return None
    if arrays[1].data.device_id != _get_device():
        return None
    return _hashable(("backward",) + tuple(
        (a.shape, a.strides, a.dtype, a.data.device_id, a.data.ptr % 16) for a in arrays) +
        (options, tuple(map(type, options))))


def call_options(causal, softmax_scale, layout, backend, algorithm, return_lse, precision,
                 num_splits=None, mods=()):
    """attention()'s options as they enter the signature (``mods``: replay_mods' part)."""
    return (causal, softmax_scale, layout, backend, algorithm, bool(return_lse), precision,
            num_splits, mods)


#: the modifications a replay takes. Scalars are recorded in the launch's parameters as the
#: full path packed them (a window's sizes, a softcap and its inverse); the arrays reach the
#: kernels as zero-copy views (numflash.mods), so a replay patches their data pointers as it
#: does q's. Any other (functions, block masks, mod_args) sends the call down the full path.
REPLAY_SCALARS = ("softcap", "window_size")
REPLAY_ARRAYS = ("alibi_slopes", "attn_bias", "attn_mask")


def replay_mods(mod_options):
    """(the signature's part, the arrays a replay takes after q, k, v) for attention()'s given
    modifications ``mod_options`` (name -> value), in name order, or None when the call cannot
    be replayed. A scalar enters with its value, its type and its elements' types (a window
    (1, 2) is not (1.0, 2)); an array (a CuPy array only) with what q enters with."""
    part, arrays = [], []
    for name, value in sorted(mod_options.items()):
        if name in REPLAY_SCALARS:
            part.append((name, value, type(value),
                         tuple(map(type, value)) if isinstance(value, tuple) else ()))
        elif name in REPLAY_ARRAYS and _found_cupy() and type(value) is _cupy_ndarray:
            part.append((name, value.shape, value.strides, value.dtype, value.data.device_id,
                         value.data.ptr % 16))
            arrays.append(value)
        else:
            return None
    return tuple(part), tuple(arrays)


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


#: a call whose launches pass more scratch than this is not replayed (a replay keeps its
#: scratch for as long as it is remembered)
SCRATCH_BYTES = 64 << 20


class Replay:
    """A recorded call: allocate out (and lse, if returned) like the full path did, relaunch.

    ``steps``: (recipe, mapping) per launch, in order; mapping gives for each of the recipe's
    array arguments where its pointer comes from: an index into (q, k, v, out, lse, inputs...,
    scratch...) or None (an array kept for the process). ``inputs``: the count of further
    arrays each call passes after q, k, v (a KV cache's lengths and block table)."""
    __slots__ = ("steps", "out_shape", "dtype", "lse_shape", "lse_dtype", "return_lse",
                 "scratch_lse", "scratch_stream", "scratch", "scratch_thread", "inputs")

    def __init__(self, steps, problem, lse, scratch=(), inputs=0):
        self.steps = steps
        self.inputs = inputs
        self.dtype = problem.dtype
        self.out_shape = tuple(problem.result.shape)
        self.lse_shape = tuple(problem.q.shape[:3])
        self.lse_dtype = lse.dtype
        self.return_lse = problem.return_lse
        stream = _cupy.cuda.get_current_stream().ptr
        small = not self.return_lse and lse.nbytes <= SCRATCH_LSE_BYTES
        self.scratch_lse = lse if small else None
        self.scratch = tuple(scratch)
        self.scratch_stream = stream if small or self.scratch else None
        self.scratch_thread = threading.get_ident()

    def __call__(self, q, k, v, *inputs):
        cupy = _cupy
        stream = cupy.cuda.get_current_stream().ptr
        out = cupy.empty(self.out_shape, self.dtype)
        same_stream = stream == self.scratch_stream
        lse = self.scratch_lse if same_stream else None
        if lse is None:
            lse = cupy.empty(self.lse_shape, self.lse_dtype)
        if len(inputs) != self.inputs:
            raise TypeError(f"this replay takes {self.inputs} arrays after q, k, v; got "
                            f"{len(inputs)}")
        pointers = [q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr]
        pointers += [a.data.ptr for a in inputs]
        if self.scratch:   # reused only by the recording's thread on its stream: another
            # thread's launches on the same stream could fall between this call's two
            scratch = self.scratch if same_stream and \
                threading.get_ident() == self.scratch_thread else \
                [cupy.empty(a.shape, a.dtype) for a in self.scratch]
            pointers += [a.data.ptr for a in scratch]
        for recipe, mapping in self.steps:
            recipe.launch(stream, [None if m is None else pointers[m] for m in mapping])
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


def replay_steps(launches, pointers, scratch=(), own_positions=True):
    """[(recipe, mapping)] replaying ``launches`` with new ``pointers`` (q, k, v, out, lse and
    any further inputs) and ``scratch`` arrays (see Replay), or None if some launch passes an
    array that is none of those and not kept, or a pointer that could be two of them (q is k)
    anywhere but in its own position (``own_positions``: a launch's first array arguments are
    ``pointers`` in order, as a forward kernel's are; otherwise anywhere at all)."""
    known = list(pointers) + [a.data.ptr for a in scratch]
    steps = []
    for recipe in launches:
        mapping = []
        for position, p in enumerate(recipe.pointers):
            where = [i for i, x in enumerate(known) if x == p]
            if len(where) == 1 or (own_positions and position in where):
                mapping.append(where[0] if len(where) == 1 else position)
            elif not where and p in _kept:
                mapping.append(None)
            else:
                return None
        steps.append((recipe, tuple(mapping)))
    return steps


def remember(key, launches, problem, lse, inputs=()):
    """Keep the call's launches for replay if they can be (replay_steps; scratch up to
    SCRATCH_BYTES, none of it zero-filled; no GPU work noted unreplayable). ``inputs``: the
    further arrays the call passed after q, k, v, which a replay takes anew each call. Returns
    the Replay, or None if the call cannot be one."""
    if key is None or not launches:
        return None
    scratch = getattr(launches, "scratch", ())
    if sum(a.nbytes for a in scratch) > SCRATCH_BYTES or any(getattr(launches, "zeroed", ())) \
            or getattr(launches, "unreplayable", ()):
        return None
    steps = replay_steps(launches, [a.data.ptr for a in (problem.q, problem.k, problem.v,
                                                          problem.out, lse, *inputs)], scratch)
    if steps is None:
        return None
    if len(_replays) >= _MAX_REPLAYS:
        _replays.clear()
    replay = _replays[key] = Replay(steps, problem, lse, scratch, len(inputs))
    return replay


class GradientReplay:
    """A recorded backward call: new gradients and scratch each call, the recorded launches on
    their pointers.

    ``steps`` as for :class:`Replay`, indexing (do, q, k, v, o, lse, dq, dk, dv, scratch...).
    The gradients are made as the full path made them (C-contiguous, their shapes and dtype);
    the scratch memory anew each call from the caller's stream-ordered allocator (no memory is
    held between calls), what the launches add into zero-filled first (cudaMemsetAsync)."""
    __slots__ = ("steps", "grads", "scratch")

    def __init__(self, steps, grads, scratch, zeroed):
        assert len(scratch) == len(zeroed)
        self.steps = steps
        self.grads = tuple((tuple(g.shape), g.dtype) for g in grads)
        self.scratch = tuple((a.nbytes, z) for a, z in zip(scratch, zeroed))

    def launch(self, stream, pointers, allocate):
        """The launches on ``stream`` for arrays at ``pointers`` (do, q, k, v, o, lse, dq, dk,
        dv), the scratch from ``allocate(nbytes) -> (owner, pointer)`` (memory ordered on that
        stream: CuPy's pool with it current, torch's caching allocator); returns the owners,
        which the caller keeps until the launches are queued."""
        owners, pointers = [], list(pointers)
        runtime = sys.modules["cupy"].cuda.runtime   # (the recording imported CuPy)
        for nbytes, zeroed in self.scratch:
            owner, ptr = allocate(nbytes)
            if zeroed:
                runtime.memsetAsync(ptr, 0, nbytes, stream)
            owners.append(owner)
            pointers.append(ptr)
        for recipe, mapping in self.steps:
            recipe.launch(stream, [None if m is None else pointers[m] for m in mapping])
        return owners

    def __call__(self, *arrays):
        """(dq, dk, dv) for CuPy arrays (do, q, k, v, o, lse) of the recorded signature, on
        CuPy's current stream."""
        cupy = _cupy   # (bound by gradient_signature, which made the key)
        grads = tuple(cupy.empty(shape, dtype) for shape, dtype in self.grads)
        self.launch(cupy.cuda.get_current_stream().ptr,
                    [a.data.ptr for a in arrays] + [g.data.ptr for g in grads], _cupy_bytes)
        return grads


def _cupy_bytes(nbytes):
    a = _cupy.empty(nbytes, _cupy.uint8)
    return a, a.data.ptr


def gradient_replay(launches, pointers, grads):
    """A GradientReplay of a backward call's ``launches``, or None where it cannot be one: some
    GPU operation of the call was not a recorded launch (note_unreplayable), a gradient is not
    C-contiguous, or a launch passes an array that is not at ``pointers`` (do, q, k, v, o, lse,
    dq, dk, dv), not noted scratch and not kept (replay_steps)."""
    if not launches or launches.unreplayable or \
            not all(g.is_contiguous() if hasattr(g, "is_contiguous") else g.flags.c_contiguous
                    for g in grads):
        return None
    steps = replay_steps(launches, pointers, launches.scratch, own_positions=False)
    if steps is None:
        return None
    return GradientReplay(steps, grads, launches.scratch, launches.zeroed)


def remember_gradients(key, launches, arrays, grads):
    """Keep a backward call on CuPy ``arrays`` (do, q, k, v, o, lse) that made new ``grads``
    for replay under ``key`` if it can be (:func:`gradient_replay`); returns it, or None."""
    if key is None:
        return None
    replay = gradient_replay(launches, [a.data.ptr for a in (*arrays, *grads)], grads)
    if replay is not None:
        if len(_replays) >= _MAX_REPLAYS:
            _replays.clear()
        _replays[key] = replay
    return replay


def clear():
    _replays.clear()
