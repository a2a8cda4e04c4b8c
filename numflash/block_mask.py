"""Block masks: a mask_mod evaluated once per tile of the (query, key) plane, so that kernels skip
the tiles in which no pair takes part and stop evaluating the mask in those in which every pair
does (FlexAttention's ``create_block_mask`` idea).

    bm = numflash.create_block_mask(mask_mod, B, H, Nq, Nk, mod_args=(...))
    out = numflash.attention(q, k, v, block_mask=bm)   # the mask is bm's mask_mod

A :class:`BlockMask` marks each block of ``block_size`` queries by ``block_size`` keys EMPTY
(no pair takes part), FULL (every pair does) or PARTIAL, per batch entry and head (B or H of
None: one mask for all, made from b = 0 / h = 0). It is made once and reused by every call and
layer with the same shape, and by the backward. A call with a block mask applies its mask_mod
(and the call's other options, causal and windows included), so the result is that of
``mask_mod=bm.mask_mod, mod_args=bm.mod_args`` -- provided the marks are the mask's: a mask
made with B (or H) None whose mask_mod does depend on b (or h), for example a document mask
with other documents in each batch entry, gives wrong rows where the entries differ (the
kernels trust the marks; nothing can check this without evaluating the mask again). Only the
cost changes:

- cuda.mma (forward and both backward passes) visits only the non-empty blocks of a row (or of
  a key column) through the lists below, and evaluates the mask_mod only in PARTIAL blocks;
- the CPU path skips its tiles that cover only EMPTY blocks and evaluates the mask elsewhere.

Built on the GPU (a CUDA kernel evaluates the mask_mod at every pair, block by block) for CuPy
mod_args or ``device="cuda"``, on the CPU (numba, parallel) otherwise; it must live where the
call's q lives.
"""
from typing import NamedTuple

import numpy as np

__all__ = ["BlockMask", "create_block_mask", "EMPTY", "PARTIAL", "FULL"]

EMPTY, PARTIAL, FULL = 0, 1, 2


class BlockArrays(NamedTuple):
    """What the kernels read of a block mask for one call (BlockMask.structure): the states
    and the lists, broadcast to the call's (B, H), and the block sizes."""
    state: object
    kv_count: object
    kv_blocks: object
    q_count: object
    q_blocks: object
    bq: int
    bk: int


class BlockMask:
    """Which blocks of the (query, key) plane a mask_mod leaves EMPTY, PARTIAL or FULL.

    state: (B, H, Nq / bq, Nk / bk) int8 (B, H are 1 where the mask is broadcast);
    kv_count, kv_blocks: per query block, the number of non-empty key blocks and their entries
    in ascending order, each 2 * block index + 1 if the block is FULL (one load gives the kernel
    both; the rest of the row is padding); q_count, q_blocks: the same per key block, for the
    backward's key pass. NumPy arrays for a CPU mask, CuPy arrays for a GPU one."""

    def __init__(self, mask_mod, mod_args, shape, block_size, state):
        self.mask_mod = mask_mod
        self.mod_args = tuple(mod_args)
        self.shape = tuple(int(n) for n in shape)   # (B, H, Nq, Nk); B, H = 1 when broadcast
        self.block_size = tuple(int(n) for n in block_size)
        self.state = state
        self.kv_count, self.kv_blocks = _block_lists(state, by_key_block=False)
        self.q_count, self.q_blocks = _block_lists(state, by_key_block=True)

    @property
    def kind(self):
        """'numpy' or 'cupy': where the mask lives (the call's q must live there too)."""
        return "numpy" if isinstance(self.state, np.ndarray) else "cupy"

    def to_host(self):
        """This mask on the CPU (NumPy state and mod_args; itself if it is there already): what
        the float64 reference takes for a GPU call's mask."""
        if self.kind == "numpy":
            return self
        args = tuple(a.get() if hasattr(a, "get") else a for a in self.mod_args)
        return BlockMask(self.mask_mod, args, self.shape, self.block_size, self.state.get())

    def counts(self):
        """(empty, partial, full) numbers of blocks, over every (batch, head) the mask holds."""
        st = self.state
        return tuple(int((st == v).sum()) for v in (EMPTY, PARTIAL, FULL))

    def sparsity(self):
        """The fraction of blocks that are EMPTY (skipped by the kernels)."""
        return self.counts()[0] / max(1, self.state.size)

    def __repr__(self):
        e, p, f = self.counts()
        name = getattr(self.mask_mod, "__name__", "mask_mod")
        return (f"BlockMask({name}, shape={self.shape}, block_size={self.block_size}, "
                f"{e} empty / {p} partial / {f} full blocks)")

    def structure(self, B, H, Nq, Nk, kind, device_id):
        """The :class:`BlockArrays` the kernels read, zero-copy views broadcast to the call's B
        and H; checked against the call (the errors name ``block_mask``)."""
        mB, mH, mNq, mNk = self.shape
        if (mNq, mNk) != (Nq, Nk) or mB not in (1, B) or mH not in (1, H):
            raise ValueError(f"block_mask was made for (B, H, Nq, Nk) = {self.shape} (B, H of 1 "
                             f"broadcast) but the call has {(B, H, Nq, Nk)}: create it for "
                             f"this shape")
        if self.kind != ("cupy" if kind == "cupy" else "numpy"):
            where = "the GPU" if self.kind == "cupy" else "the CPU"
            raise TypeError(f"block_mask lives on {where} but q is a "
                            f"{'CuPy' if kind == 'cupy' else 'NumPy'} array: create it with "
                            f"device={'cuda' if kind == 'cupy' else 'cpu'!r}")
        if kind == "cupy" and self.state.device.id != device_id:
            raise ValueError(f"block_mask is on GPU {self.state.device.id} but q is on GPU "
                             f"{device_id}")
        xp = _xp(self.state)

        def wide(a):
            return xp.broadcast_to(a, (B, H) + a.shape[2:])
        return BlockArrays(wide(self.state), wide(self.kv_count), wide(self.kv_blocks),
                           wide(self.q_count), wide(self.q_blocks), *self.block_size)


def _xp(a):
    return np if isinstance(a, np.ndarray) else __import__("cupy")


def _list_blocks(state, count, entries, row, by_key_block):
    """Write one list: for row ``row`` of the flattened (B, H, blocks) rows (a query block's
    row of the states, or with ``by_key_block`` a key block's column), the number of its
    non-EMPTY blocks into ``count`` and, in ascending order, 2 * block index + (1 if FULL) of
    each into ``entries``, then zeros (padding a kernel never reads). Compiled for the CPU
    and as a CUDA device function: the same code builds both."""
    Hm = state.shape[1]
    rows = state.shape[3] if by_key_block else state.shape[2]
    others = state.shape[2] if by_key_block else state.shape[3]
    b = row // (Hm * rows)
    h = (row // rows) % Hm
    r = row % rows
    n = 0
    for x in range(others):
        mark = state[b, h, x, r] if by_key_block else state[b, h, r, x]
        if mark != EMPTY:
            entries[b, h, r, n] = 2 * x + (1 if mark == FULL else 0)
            n += 1
    count[b, h, r] = n
    for x in range(n, others):
        entries[b, h, r, x] = 0


_LISTERS = {}   # "cpu" / "gpu" -> the compiled list builder; kept for the process


def _lister(gpu):
    """The list builder over every row: a parallel loop on the CPU, a thread per row on the
    GPU (numba compiles it once per process; CuPy's sort and reductions, used before, compiled
    new kernels for every new shape: seconds per mask on a fresh process)."""
    key = "gpu" if gpu else "cpu"
    if key not in _LISTERS:
        if gpu:   # generated as the fillers are, so numba's simulator sees its cuda module
            from numba import cuda
            env = {"cuda": cuda, "one": cuda.jit(device=True)(_list_blocks)}
            exec(_BUILD_ON_GPU, env)  # noqa: S102 - generated here
            _LISTERS[key] = cuda.jit(env["build"])
        else:
            from numba import njit, prange
            env = {"prange": prange, "one": njit(_list_blocks)}
            exec(_BUILD_ON_CPU, env)  # noqa: S102 - generated here
            _LISTERS[key] = njit(parallel=True)(env["build"])
    return _LISTERS[key]


_BUILD_ON_GPU = """
def build(state, count, entries, n_rows, by_key_block):
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if row < n_rows:
        one(state, count, entries, row, by_key_block)
"""
_BUILD_ON_CPU = """
def build(state, count, entries, n_rows, by_key_block):
    for row in prange(n_rows):
        one(state, count, entries, row, by_key_block)
"""


def _block_lists(state, by_key_block):
    """(count, entries), int32, of every query block's row of the states (or, with
    ``by_key_block``, every key block's column): see _list_blocks."""
    Bm, Hm, nqb, nkb = state.shape
    rows, others = (nkb, nqb) if by_key_block else (nqb, nkb)
    if isinstance(state, np.ndarray):
        count = np.empty((Bm, Hm, rows), np.int32)
        entries = np.empty((Bm, Hm, rows, others), np.int32)
        if count.size and others:
            _lister(False)(state, count, entries, count.size, by_key_block)
        elif count.size:
            count[...] = 0
        return count, entries
    import cupy
    from numba import cuda
    with cupy.cuda.Device(state.device.id):
        count = cupy.zeros((Bm, Hm, rows), np.int32)
        entries = cupy.empty((Bm, Hm, rows, others), np.int32)
        if count.size and others:
            stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)
            _lister(True)[(count.size + 127) // 128, 128, stream](state, count, entries,
                                                                  count.size, by_key_block)
    return count, entries


def create_block_mask(mask_mod, B, H, Nq, Nk, mod_args=(), *, block_size=128, device=None):
    """A :class:`BlockMask` of ``mask_mod(b, h, q_idx, kv_idx, *mod_args) -> bool`` (True = the
    pair takes part) for calls of shape (B, H, Nq, Nk).

    B, H: None only where the mask is the same for every batch entry / head (it is then
    evaluated with b = 0 / h = 0 and broadcast; a mask_mod that depends on b or h needs B or H
    given, or its marks are wrong for the other entries and so is the attention). block_size: an int or (queries, keys), multiples of 16;
    128 (the default, as FlexAttention's) suits every cuda.mma tile (a kernel tile that does not
    divide the block is refused with the reason by ``numflash.explain``). device: "cpu", "cuda"
    (the current GPU) or a GPU number; by default the GPU of a CuPy array among mod_args, else
    the CPU. ``numflash.mods.document_mask(...)`` and ``prefix_lm_mask(...)`` give (mask_mod,
    mod_args) pairs for it. Costs one mask evaluation per (query, key) pair.
    """
    from . import mods as _mods
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function; got {type(mask_mod).__name__}")
    dims = {}
    for name, n, optional in (("B", B, True), ("H", H, True), ("Nq", Nq, False),
                              ("Nk", Nk, False)):
        if n is None and optional:
            n = 1
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < (0 if name in (
                "Nq", "Nk") else 1):
            raise ValueError(f"{name} must be a {'positive' if optional else 'non-negative'} "
                             f"integer{' or None' if optional else ''}; got {n!r}")
        dims[name] = int(n)
    try:
        bq, bk = (block_size, block_size) if np.ndim(block_size) == 0 else block_size
        bq, bk = int(bq), int(bk)
    except (TypeError, ValueError):
        raise ValueError(f"block_size must be an int or (queries, keys); got {block_size!r}") \
            from None
    if bq <= 0 or bk <= 0 or bq % 16 or bk % 16:
        raise ValueError(f"block_size entries must be positive multiples of 16; got "
                         f"{block_size!r}")
    kind, device_id = _where(device, mod_args)
    args = _mods._user_args(tuple(mod_args) if isinstance(mod_args, list) else mod_args,
                            kind, device_id)
    shape = (dims["B"], dims["H"], -(-dims["Nq"] // bq), -(-dims["Nk"] // bk))
    if kind == "cupy":
        import cupy
        with cupy.cuda.Device(device_id):
            state = cupy.empty(shape, np.int8)
            _fill_on_gpu(mask_mod, args, state, dims["Nq"], dims["Nk"], bq, bk)
    else:
        state = np.empty(shape, np.int8)
        _fill_on_cpu(mask_mod, args, state, dims["Nq"], dims["Nk"], bq, bk)
    return BlockMask(mask_mod, args, (dims["B"], dims["H"], dims["Nq"], dims["Nk"]), (bq, bk),
                     state)


def _where(device, mod_args):
    """("numpy", None) or ("cupy", GPU number) for the ``device`` option."""
    if device is None:
        for a in mod_args:
            if type(a).__module__.split(".")[0] == "cupy" or hasattr(a, "__cuda_array_interface__"):
                import cupy
                return "cupy", cupy.asarray(a).device.id
        return "numpy", None
    if device == "cpu":
        return "numpy", None
    if device == "cuda" or (isinstance(device, (int, np.integer)) and not isinstance(device, bool)
                            and device >= 0):
        import cupy
        return "cupy", (cupy.cuda.Device().id if device == "cuda" else int(device))
    raise ValueError(f"device must be 'cpu', 'cuda', a GPU number or None; got {device!r}")


# ---- filling the state: one evaluation per pair, a block's verdict from all of them ----

def _fill_source(n_args, gpu):
    """Source of the filler of ``state`` for a mask ``m`` with ``n_args`` arguments: on the CPU a
    parallel loop over (b, h, query block) rows, leaving a block as soon as it has seen a pair
    in and a pair out; on the GPU one thread block per (key block, query block, b * h), whose
    threads vote (syncthreads_or / _and). Pairs past Nq or Nk do not vote: the kernels mask
    them by bounds."""
    a = "".join(f", a{n}" for n in range(n_args))
    if gpu:
        return f"""
def fill(state, Nq, Nk, bq, bk{a}):
    kb = cuda.blockIdx.x
    qb = cuda.blockIdx.y
    Hm = state.shape[1]
    b = cuda.blockIdx.z // Hm
    h = cuda.blockIdx.z % Hm
    i0 = qb * bq
    j0 = kb * bk
    rows = min(Nq, i0 + bq) - i0
    cols = min(Nk, j0 + bk) - j0
    some = 0
    every = 1
    p = cuda.threadIdx.x
    while p < rows * cols:
        if m(b, h, i0 + p // cols, j0 + p % cols{a}):
            some = 1
        else:
            every = 0
        p += cuda.blockDim.x
    some = cuda.syncthreads_or(some)
    every = cuda.syncthreads_and(every)
    if cuda.threadIdx.x == 0:
        state[b, h, qb, kb] = {FULL} if every else ({PARTIAL} if some else {EMPTY})
"""
    return f"""
def fill(state, Nq, Nk, bq, bk{a}):
    Bm, Hm, nqb, nkb = state.shape
    for t in prange(Bm * Hm * nqb):
        b = t // (Hm * nqb)
        h = (t // nqb) % Hm
        qb = t % nqb
        for kb in range(nkb):
            some = False
            every = True
            for i in range(qb * bq, min(Nq, qb * bq + bq)):
                for j in range(kb * bk, min(Nk, kb * bk + bk)):
                    if m(b, h, i, j{a}):
                        some = True
                    else:
                        every = False
                if some and not every:
                    break
            state[b, h, qb, kb] = {FULL} if every else ({PARTIAL} if some else {EMPTY})
"""


_FILLERS = {}   # (mask function, on the GPU) -> compiled filler; kept for the process


def _filler(mask_mod, n_args, gpu):
    key = (mask_mod, n_args, gpu)
    if key not in _FILLERS:
        fn = getattr(mask_mod, "py_func", mask_mod)
        if gpu:
            from numba import cuda
            env = {"cuda": cuda, "m": cuda.jit(device=True)(fn)}
            exec(_fill_source(n_args, True), env)  # noqa: S102 - generated here
            _FILLERS[key] = cuda.jit(env["fill"])
        else:
            from numba import njit, prange
            env = {"prange": prange, "m": njit(fn), "min": min}
            exec(_fill_source(n_args, False), env)  # noqa: S102 - generated here
            _FILLERS[key] = njit(parallel=True)(env["fill"])
    return _FILLERS[key]


def _compile_errors(mask_mod, what):
    from .mods import compile_errors
    return compile_errors(f"mask_mod={getattr(mask_mod, '__name__', 'fn')}", what)


def _fill_on_cpu(mask_mod, args, state, Nq, Nk, bq, bk):
    if state.size == 0:
        return
    with _compile_errors(mask_mod, "the block mask's CPU filler"):
        _filler(mask_mod, len(args), False)(state, Nq, Nk, bq, bk, *args)


def _fill_on_gpu(mask_mod, args, state, Nq, Nk, bq, bk):
    if state.size == 0:
        return
    Bm, Hm, nqb, nkb = state.shape
    if nqb > 65535 or Bm * Hm > 65535:
        raise ValueError(f"the block mask has {nqb} query blocks and {Bm * Hm} (batch, head) "
                         f"pairs; a GPU fill takes at most 65535 of each: use a larger "
                         f"block_size or broadcast B / H")
    import cupy
    from numba import cuda
    # on CuPy's current stream, where the lists are then built from the states (numba's default
    # stream would not order them under a non-blocking CuPy stream)
    stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)
    with _compile_errors(mask_mod, "the block mask's GPU filler"):
        _filler(mask_mod, len(args), True)[(nkb, nqb, Bm * Hm), 128, stream](
            state, Nq, Nk, bq, bk, *args)
