"""Choosing a tensor-core config for a problem on a device, or refusing it with the reason.

What the operator declares (numflash.kernels: dtypes, compute capability, no simulator, tf32 and
precision="ieee") is checked before config() is asked; here only this kernel's own limits."""
from ...device import Unsupported
from . import mods
from .tiles import NAME, X3_CCS, MmaConfig, choose_tile, head_dim_pad, shared_bytes

#: float32 (3xTF32, or tf32 with precision="tf32") takes head dims up to this (d=256 would keep
#: 128 O accumulators per thread and spill).
TF32_MAX_HEAD_DIM = 128
#: float64 takes head dims up to these, by mma form: its fragments take two registers per value,
#: so d=256 would keep 256 registers of O per thread; on sm_80 (four m8n8k4 per product) ptxas
#: spills already at dv=128.
F64_MAX_HEAD_DIM = {"m16n8k8": 128, "m8n8k4": 64}


def vector_ok(problem, names=("q", "k", "v")):
    """None if 16-byte cp.async can read every row of the problem's arrays ``names``, else why
    not (then VEC=0)."""
    for name in names:
        a = getattr(problem, name)
        item = a.itemsize
        if a.strides[-1] != item and a.shape[-1] > 1:
            return f"{name}'s last axis is strided"
        if a.shape[-1] % (16 // item):  # a 16-byte chunk never straddles the row's end
            return f"{name}'s head dim {a.shape[-1]} is not a multiple of {16 // item}"
        if a.data.ptr % 16:
            return f"{name} is not 16-byte aligned"
        for n, st in zip(a.shape[:-1], a.strides[:-1]):
            if n > 1 and st % 16:
                return f"{name} has a row stride of {st} bytes, not a multiple of 16"
    return None


def padded_dims(problem):
    """(D, DV, window) of a problem for the tensor-core kernels, forward and backward: the
    padded head dims and whether a sliding window is compiled in; raises Unsupported if the
    query heads do not divide into the K/V heads."""
    B, H, Nq, Nk, d, dv = problem.shape
    if problem.k.shape[1] == 0 or H % problem.k.shape[1]:
        raise Unsupported(f"{NAME}: {H} query heads do not divide into {problem.k.shape[1]} "
                          "K/V heads")
    given = getattr(problem, "mods", None)
    return head_dim_pad(d), head_dim_pad(dv), given is not None and given.window is not None


def modifications(problem):
    """The MODS token of a problem's score / mask modifications ("" without; see mods.py)."""
    return mods.token_for(getattr(problem, "mods", None))


def dropped(problem):
    """Whether a problem has attention dropout (MmaConfig.DROP)."""
    return getattr(problem, "dropout", None) is not None


def check_block_tiles(problem, tiles, name=NAME):
    """Raise Unsupported when a block mask's blocks are not made of whole tiles of the kernels:
    ``tiles``: ((query rows, key columns, which kernel), ...) of a tile each (a kernel's tile
    loop visits a block's tiles, so a tile may not straddle two blocks); ``name``: the
    operator's."""
    block = getattr(getattr(problem, "mods", None), "block", None)
    for rows, cols, what in tiles if block else ():
        bq, bk = block.bq, block.bk
        if bq % rows or bk % cols:
            raise Unsupported(f"{name}: the block mask's {bq} x {bk} blocks are not whole tiles "
                              f"of the {what} ({rows} queries x {cols} keys): create it with "
                              f"block_size=128 or a multiple of 128, which every {name} tile "
                              f"divides (the CPU path takes any block size)")


#: split-KV: a call whose query blocks fill fewer than this many of the GPU's SMs' block slots
#: splits each block's keys, into at most MAX_SPLITS shares of at least MIN_SPLIT_TILES tiles
SPLIT_SLOTS_PER_SM = 4
MAX_SPLITS = 128
MIN_SPLIT_TILES = 4


def split_count(problem, cfg, device, in_use=True):
    """How many shares of its keys each query block of ``problem`` takes (1: no split): the
    call's ``num_splits`` if given (at most one share per key tile), else as many as the GPU's
    block slots (SPLIT_SLOTS_PER_SM a multiprocessor) hold in one wave while every share keeps
    MIN_SPLIT_TILES key tiles, up to MAX_SPLITS -- flash-attn's num_splits idea (one query block
    cannot fill a GPU, decoding most of all). One wave, not one more share: at B1 H32 on the
    H100 (528 slots) 17 shares left 16 blocks to a second wave and ran 1.7-4.2% slower than 16
    (bench/NOTES.md, "Split count"). A KV cache counts its longest entry's keys, not its
    capacity, unless ``in_use`` is False: config() plans the split variant from the capacity,
    so that a plan (memoized without the lengths) stays right as a decode loop's cache fills,
    and each launch takes the shares its longest entry needs, one included. A block mask counts
    its keys as the others do (its shares deal out the listed blocks; with fewer listed than
    shares the rest are empty). Never for a GPU of unknown size."""
    B, H, Nq, Nk, d, dv = problem.shape
    if getattr(problem, "varlen", None) is not None:   # config() refuses num_splits > 1
        return 1
    cache = getattr(problem, "kvcache", None)
    if cache is not None and in_use:   # a KV cache's capacity may far exceed the keys in use
        Nk = cache.max_len
    return share_count(B, H, Nq, Nk, getattr(problem, "num_splits", None), cfg, device)


def share_count(B, H, Nq, Nk, forced, cfg, device):
    """split_count's rule on the numbers it reads (the KV cache's replay asks it each call)."""
    tiles = -(-Nk // cfg.BC)
    if forced is not None:   # a share per key tile at most
        return max(1, min(forced, tiles))
    if device.sm_count is None:
        return 1
    blocks = -(-Nq // cfg.BR) * B * H
    slots = SPLIT_SLOTS_PER_SM * device.sm_count
    if blocks >= slots:
        return 1
    return max(1, min(MAX_SPLITS, slots // blocks, tiles // MIN_SPLIT_TILES))


#: CUDA's limit on grid y, which the packed kernels give each sequence's heads
MAX_GRID_Y = 65535


#: the modifications the one-launch kernels of packed sequences take: a window's key range and
#: ALiBi read the sequence's own causal offset (mods.emit_locals), the softcap none; a user's
#: functions see b = the sequence (attention_varlen takes no others)
PACKED_MODS = frozenset({"window_size", "softcap", "alibi_slopes", "score_mod", "mask_mod"})


def check_packed(problem, name=NAME):
    """Raise Unsupported for what the one-launch kernels of packed sequences (VARLEN) do not
    take yet: modifications besides PACKED_MODS, a forced split, more sequences x heads than
    grid y holds (``name``: the kernel the message names; cuda.wgmma's packed kernels share
    these limits)."""
    count, H = problem.varlen.count, problem.shape[1]
    if count * H > MAX_GRID_Y:
        raise Unsupported(f"{name} runs packed sequences in one launch with a grid row per "
                          f"sequence's head, at most {MAX_GRID_Y}; {count} sequences x {H} "
                          f"heads is more (attention_varlen runs one call per sequence)")
    mods = getattr(problem, "mods", None)
    other = sorted(mods.kinds - PACKED_MODS) if mods is not None else []
    if other:
        raise Unsupported(f"{name} runs packed sequences in one launch with "
                          f"{', '.join(sorted(PACKED_MODS))} only, not {', '.join(other)}; "
                          f"attention_varlen runs those one call per sequence")
    splits = getattr(problem, "num_splits", None)
    if splits is not None and splits > 1:
        raise Unsupported(f"{name} does not split the keys (num_splits={splits}) of packed "
                          f"sequences: their blocks fill the GPU by sequence")


def config(problem, device):
    """The MmaConfig for ``problem`` on ``device`` (one the operator's declarations admit);
    raises Unsupported saying why not."""
    dt = problem.dtype.name
    precision = getattr(problem, "precision", "auto")
    B, H, Nq, Nk, d, dv = problem.shape
    D, DV, window = padded_dims(problem)
    token = modifications(problem)
    vector = problem.on_device and vector_ok(problem) is None
    form = None
    if dt == "float32":
        DT = "tf32" if precision == "tf32" else "3xtf32"
        if max(D, DV) > TF32_MAX_HEAD_DIM:
            raise Unsupported(f"{NAME} takes float32 head dims up to {TF32_MAX_HEAD_DIM}; got "
                              f"d={d}, dv={dv} (with precision='auto' cuda.block takes float32 "
                              "up to d=256)")
        if DT == "3xtf32" and device.cc is not None and device.cc not in X3_CCS:
            raise Unsupported(
                f"{NAME} runs float32 as 3xTF32 (three tf32 mma per product) only on compute "
                f"capability 8.0 / 9.0, where tf32 tensor cores outrun the FMA units ~8x; on "
                f"{device.name} cuda.block is faster (precision='tf32' takes the tensor cores "
                "with one tf32 mma per product)")
        if DT == "3xtf32" and not vector:
            raise Unsupported(
                f"{NAME} runs float32 (3xTF32) only with 16-byte cp.async staging, and "
                f"{vector_ok(problem) or 'these are not device arrays'}: staged with scalar "
                "loads it is slower than cuda.block (a contiguous last axis, d and dv multiples "
                "of 4 and 16-byte aligned rows take the tensor cores)")
        VEC = int(DT == "3xtf32")  # tf32 rounds its operands on the way into shared memory
    elif dt == "float64":
        form = "m16n8k8" if device.cc is not None and device.cc >= (9, 0) else "m8n8k4"
        limit = F64_MAX_HEAD_DIM[form]
        if max(D, DV) > limit:
            raise Unsupported(f"{NAME} takes float64 head dims up to {limit} on {device.name} "
                              f"(mma {form}); got d={d}, dv={dv} (cuda.block takes float64 up to "
                              "d=256)")
        if window and max(D, DV) > 64:
            raise Unsupported(f"{NAME} takes a float64 window_size up to head dim 64: at d={d}, "
                              f"dv={dv} the window's bounds spill registers (the CPU path takes "
                              "it)")
        DT, VEC = "f64", int(vector)
        tile = choose_tile(D, DV, DT, device.smem_per_block_optin, VEC, device.cc, window,
                           bool(token))
        if VEC and shared_bytes(MmaConfig(D, DV, *tile, DT, 1)) > device.smem_per_block_optin:
            VEC = 0  # double-buffered cp.async does not fit: stage with scalar loads instead
    else:
        DT = "bf16" if dt == "bfloat16" else "f16"
        VEC = int(vector)
    NW, BC, HOLDQ = choose_tile(D, DV, DT, device.smem_per_block_optin, VEC, device.cc, window,
                                bool(token))
    cfg = MmaConfig(D, DV, NW, BC, HOLDQ, DT, VEC, MMA=form, WINDOW=int(window), MODS=token,
                    DROP=int(dropped(problem)))
    check_block_tiles(problem, ((cfg.BR, cfg.BC, "forward"),))
    cache = getattr(problem, "kvcache", None)
    if cache is not None:
        if not VEC:
            raise Unsupported(f"{NAME} reads a KV cache with 16-byte cp.async only, and "
                              f"{vector_ok(problem) or 'these are not device arrays'}")
        cfg = MmaConfig(**{**dict(cfg), "KVLEN": 1, "PAGE": cache.page or 0})
    if getattr(problem, "varlen", None) is not None:
        check_packed(problem)
        cfg = MmaConfig(**{**dict(cfg), "VARLEN": 1})
    if split_count(problem, cfg, device, in_use=False) > 1:
        cfg = MmaConfig(**{**dict(cfg), "SPLIT": 1})
    need = shared_bytes(cfg)
    if need > device.smem_per_block_optin:
        raise Unsupported(f"{NAME}: needs {need} bytes of shared memory for d={d}, dv={dv}, more "
                          f"than the {device.smem_per_block_optin} a block may use on "
                          f"{device.name}")
    return cfg
