"""Device helpers shared by the CUDA kernels: the masking rule, exp, and lane-group reductions.

The same kernel source runs on the GPU and in numba's CUDA simulator. The simulator has no warp
shuffles and no libdevice, so the two helpers that need them have a simulator twin with the same
meaning; everything else is one definition.
"""
import math

import numpy as np

from numba import cuda, float32, float64, int64

from ..device import simulator_enabled

# fastmath=True would set LLVM's 'ninf'/'nnan' flags and let the compiler delete the -inf checks
# that fully masked rows rely on; the one place speed needs approximation (exp) asks for it.
FASTMATH = False

NEG_INF = -math.inf


def _uses_cuda(code):
    """Whether a function's code (or code nested in it) names the cuda module."""
    return "cuda" in code.co_names or any(
        _uses_cuda(c) for c in code.co_consts if hasattr(c, "co_names"))


def device_function(fn, inline=False):
    """``fn`` as a device function (``inline``: forced inline, so the local arrays it fills
    stay in registers).

    In numba's simulator a function that does not name the cuda module stays a plain Python
    function, which the simulator would run the same way. As a simulated device function every
    call would take two locks (to swap a fake cuda module into the function's globals), and with
    16-128 simulated threads calling vector_load and exp in their inner loops those locks
    convoyed: one simulator test took 1 s or 60 s from run to run. Compiled code is unchanged.
    """
    if simulator_enabled():
        return cuda.jit(device=True)(fn) if _uses_cuda(fn.__code__) else fn
    return cuda.jit(device=True, forceinline=True)(fn) if inline else cuda.jit(device=True)(fn)


def forward_signature(dtype):
    """cuda.block's and cuda.row's argument types: q, k, v, out, lse, scale, causal,
    causal_offset (arrays read through their strides)."""
    from numba import types
    from ..inputs import lse_dtype
    from .launch import array_type
    arr = array_type(dtype)
    return (arr, arr, arr, arr, array_type(lse_dtype(dtype), 3), types.float64, types.int64,
            types.int64)


def compute_type(dtype_name):
    """Accumulator type: float64 for float64 inputs, float32 for everything narrower."""
    return float64 if dtype_name == "float64" else float32


@device_function
def key_end(row, nk, causal, causal_offset):
    """Exclusive end of the keys query `row` sees: j < key_end  <=>  j <= row + offset (causal).

    Signed on purpose: the offset may be negative, and kernels index with unsigned integers.
    """
    n = int64(nk)
    if causal:
        return min(n, max(int64(0), int64(row) + causal_offset + 1))
    return n


@device_function
def tile_needs_mask(first_row, first_key, tile_keys, nk, causal, causal_offset):
    """Whether a tile of keys [first_key, first_key + tile_keys) has any key some row of the block
    starting at first_row cannot see (past Nk, or above the causal diagonal)."""
    last_key = int64(first_key) + tile_keys - 1
    return last_key >= int64(nk) or (causal and last_key > int64(first_row) + causal_offset)


if simulator_enabled():
    SMEM_ALIGN = None  # the simulator refuses alignment requests; NumPy buffers are aligned anyway

    @device_function
    def vector_load(array, index, width):
        """array[index : index + width] as a tuple (one 16-byte load on the GPU)."""
        assert index % width == 0, "a vector access on the GPU needs width-aligned indices"
        return tuple(array[index + w] for w in range(width))

    @device_function
    def vector_store(array, index, src, src_index, width):
        """array[index : index + width] = src[src_index : src_index + width] (one 16-byte store
        on the GPU)."""
        assert index % width == 0, "a vector access on the GPU needs width-aligned indices"
        for w in range(width):
            array[index + w] = src[src_index + w]

    @device_function
    def exp_f32(x):
        return math.exp(x)

    @cuda.jit(device=True)
    def group_max(x, width, scratch, tid):
        """Max of x over the `width` consecutive threads of tid's group (simulator: via scratch)."""
        cuda.syncthreads()
        scratch[tid] = x
        cuda.syncthreads()
        base = tid - tid % width
        r = scratch[base]
        for i in range(1, width):
            r = max(r, scratch[base + i])
        cuda.syncthreads()
        return r

    @cuda.jit(device=True)
    def group_sum(x, width, scratch, tid):
        cuda.syncthreads()
        scratch[tid] = x
        cuda.syncthreads()
        base = tid - tid % width
        r = scratch[base]
        for i in range(1, width):
            r += scratch[base + i]
        cuda.syncthreads()
        return r
else:
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.cuda.extending import intrinsic
    from numba.cuda import libdevice

    SMEM_ALIGN = 16  # shared tiles are read with 16-byte vector loads

    @intrinsic
    def vector_load(typingctx, array, index, width):
        """array[index : index + width] as a tuple, in one vector load (ld.shared.v4.f32 for four
        floats). The caller guarantees index * itemsize is a multiple of width * itemsize."""
        if not (isinstance(array, types.Array) and array.ndim == 1
                and isinstance(width, types.IntegerLiteral)):
            return None
        n = width.literal_value
        result = types.UniTuple(array.dtype, n)

        def codegen(context, builder, sig, args):
            arrty = sig.args[0]
            ary = context.make_array(arrty)(context, builder, value=args[0])
            ptr = cgutils.get_item_pointer(context, builder, arrty, ary, [args[1]],
                                           wraparound=False)
            elem = context.get_value_type(arrty.dtype)
            vec = builder.load(builder.bitcast(ptr, ir.VectorType(elem, n).as_pointer()),
                               align=n * arrty.dtype.bitwidth // 8)
            items = [builder.extract_element(vec, ir.Constant(ir.IntType(32), i))
                     for i in range(n)]
            return context.make_tuple(builder, result, items)

        return result(array, index, width), codegen

    @intrinsic
    def vector_store(typingctx, array, index, src, src_index, width):
        """array[index : index + width] = src[src_index : src_index + width] in one vector store
        (st.shared.v4.f32 for four floats); src is a local array. The caller guarantees
        index * itemsize is a multiple of width * itemsize."""
        if not (isinstance(array, types.Array) and array.ndim == 1 and isinstance(src, types.Array)
                and src.ndim == 1 and src.dtype == array.dtype
                and isinstance(width, types.IntegerLiteral)):
            return None
        n = width.literal_value

        def codegen(context, builder, sig, args):
            arrty, _, srcty, _, _ = sig.args
            ary = context.make_array(arrty)(context, builder, value=args[0])
            ptr = cgutils.get_item_pointer(context, builder, arrty, ary, [args[1]],
                                           wraparound=False)
            src_ary = context.make_array(srcty)(context, builder, value=args[2])
            elem = context.get_value_type(arrty.dtype)
            vec = ir.Constant(ir.VectorType(elem, n), ir.Undefined)
            for i in range(n):
                at = builder.add(args[3], ir.Constant(args[3].type, i))
                item = builder.load(cgutils.get_item_pointer(context, builder, srcty, src_ary,
                                                             [at], wraparound=False))
                vec = builder.insert_element(vec, item, ir.Constant(ir.IntType(32), i))
            builder.store(vec, builder.bitcast(ptr, ir.VectorType(elem, n).as_pointer()),
                          align=n * arrty.dtype.bitwidth // 8)
            return context.get_dummy_value()

        return types.void(array, index, src, src_index, width), codegen

    @cuda.jit(device=True)
    def exp_f32(x):
        return libdevice.fast_expf(x)  # ex2.approx: ~2 ulp, and exp(-inf) = 0

    @cuda.jit(device=True)
    def group_max(x, width, scratch, tid):
        """Max of x over `width` (a power of two <= 32) consecutive lanes, by xor shuffles."""
        off = width // 2
        while off > 0:
            x = max(x, cuda.shfl_xor_sync(0xFFFFFFFF, x, off))
            off //= 2
        return x

    @cuda.jit(device=True)
    def group_sum(x, width, scratch, tid):
        off = width // 2
        while off > 0:
            x += cuda.shfl_xor_sync(0xFFFFFFFF, x, off)
            off //= 2
        return x


@device_function
def exp_f64(x):
    return math.exp(x)


def exp_for(acc_name):
    return exp_f64 if acc_name == "float64" else exp_f32


def head_dim_bucket(n):
    """Compile-time head-dim size for n: loops over it unroll and arrays size from it.

    Multiples of 16 up to 128, of 32 up to 256: at most ~2x padding for tiny d, under 1.25x above 64.
    """
    if n <= 16:
        return 16
    if n <= 128:
        return -(-n // 16) * 16
    return -(-n // 32) * 32


def element_size(acc_name):
    return 8 if acc_name == "float64" else 4


def inlined_device(fn):
    """A device function inlined into its caller, so local arrays it fills stay in registers."""
    return device_function(fn, inline=True)


# 32-bit words of a tile a thread loads at once when tiles are staged synchronously: enough loads
# in flight to cover memory latency, few enough registers to leave the accumulators alone.
STAGE_CHUNK = 16


def stage_chunk(acc):
    """STAGE_CHUNK in elements of the compute type."""
    return STAGE_CHUNK // (element_size(acc) // 4)


def stage_parts(rows, cols, threads, chunk=None):
    """(elements per part, parts) in which each thread stages its share of a rows x cols tile."""
    per_thread = -(-rows * cols // threads)
    size = per_thread if chunk is None else max(1, min(chunk, per_thread))
    return size, -(-per_thread // size)


def tile_stager(rows, cols, threads, acc, transposed, pitch, chunk=None, interleave=1):
    """Device functions that move a rows x cols tile from global to shared memory through
    registers, in parts of at most `chunk` elements per thread (all of its share if None).

    Returns (fetch, store, stage, part_size, parts):
    fetch(src, r0, nr, nc, regs, tid, part): regs[w] <- src[r0 + r, c] for element w of this
        thread's part (zero past nr rows or nc columns). The loads are independent, so all of a
        part is in flight at once; a kernel fetching tile j+1 before it computes on tile j (one
        part) hides the memory latency behind the compute.
    store(smem, base, regs, tid, part): to smem[base + r * pitch + c], or [base + c * pitch + r]
        if `transposed`. Consecutive threads take consecutive columns: coalesced global reads.
        With `interleave` = n, row r is stored at position (r % n) * (rows / n) + r // n, so that
        the rows r = i * n + t (i = 0, 1, ...) a thread t owns lie next to each other.
    stage(src, r0, nr, nc, regs, smem, base, tid): the whole tile, synchronously: fetch then
        store each part in turn.
    """
    assert rows % interleave == 0 and pitch >= (rows if transposed else cols)  # no overlap
    ACC = compute_type(acc)
    u = np.uint64
    per_thread = -(-rows * cols // threads)
    size, parts = stage_parts(rows, cols, threads, chunk)
    total, uC, uP, uT, uS = u(rows * cols), u(cols), u(pitch), u(threads), u(size)
    uI, uRI = u(interleave), u(rows // interleave)
    exact = rows * cols % threads == 0 and per_thread % size == 0

    @inlined_device
    def fetch(src, r0, nr, nc, regs, tid, part):
        for w in range(size):
            idx = tid + (part * uS + u(w)) * uT
            r = idx // uC
            c = idx - r * uC
            regs[w] = ACC(src[r0 + r, c]) if (exact or idx < total) and r0 + r < nr and c < nc \
                else ACC(0)

    @inlined_device
    def store(smem, base, regs, tid, part):
        for w in range(size):
            idx = tid + (part * uS + u(w)) * uT
            if exact or idx < total:
                r = idx // uC
                c = idx - r * uC
                if interleave > 1:
                    r = (r % uI) * uRI + r // uI
                smem[base + (c * uP + r if transposed else r * uP + c)] = regs[w]

    @inlined_device
    def stage(src, r0, nr, nc, regs, smem, base, tid):
        for part in range(u(parts)):
            fetch(src, r0, nr, nc, regs, tid, part)
            store(smem, base, regs, tid, part)

    return fetch, store, stage, size, parts
