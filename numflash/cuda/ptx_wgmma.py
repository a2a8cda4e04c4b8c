"""Hopper warpgroup matrix products (``wgmma.mma_async``, sm_90a) and the shared-memory matrix
descriptors they read, for numflash.cuda.wgmma.

A warpgroup (4 consecutive warps, the first one's index a multiple of 4) issues one wgmma
together; every thread must reach it (``.sync.aligned``), so a kernel calls these only under
warpgroup-uniform conditions. Each product is one inline-asm statement: ``wgmma.fence``, its
k-steps and ``commit_group``, then ``wait_group 0`` unless it is left in flight (wait=False);
``wgmma_wait`` then passes its accumulators through the wait as tied operands, so no numba code
touches them before the tensor cores are done. A kernel that calls a subroutine anywhere
(64-bit integer division, IEEE float division or reciprocal have one) gets all its wgmma
serialized by ptxas (warning C7509): ``div_u32`` and ``rcp_approx`` are the inline forms.

Operands (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
- A (64 x 16 per k-step) from shared memory through a descriptor (``wgmma_ss``), or from
  registers (``wgmma_rs``): warp w of the warpgroup gives rows 16 w .. 16 w + 15 in the
  mma.sync m16n8k16 A layout (ptx.py), four packed 16-bit pairs a k-step.
- B (16 x N) always from shared memory through a descriptor.
- D (64 x N, float32): warp w holds rows 16 w + g and 16 w + g + 8; register 4 j + r is
  column 8 j + 2 t + r % 2 of row g (r < 2) or g + 8 (r >= 2): mma.sync's C layout, one n8
  tile after another. So the S = Q K^T accumulators are P's A operand of P V once packed.

Layouts in shared memory (PTX ISA, "Matrix Descriptor Format", "Shared Memory Matrix
Layout"). The descriptor's leading byte offset (LBO) and stride byte offset (SBO):
- No swizzle: 8 x 8 core matrices of 16-bit elements, 128 contiguous bytes each (8 rows of 16
  bytes); LBO is the distance between core matrices adjacent along K, SBO along M / N. Matched
  numpy on the H100 for K-major A and B and MN-major B (session 26); not used by the kernel.
- A from shared memory MN-major (``trans_a``, the backward's dQ = dS K: dS^T stored a key a
  row, its 64 queries in 128 bytes) mirrors MN-major B: SBO the next 8 rows along K, LBO the
  next 64 columns along M.
- 128-byte swizzle (what cuda.wgmma uses): rows of 128 bytes (64 elements), 8 rows a
  1024-byte atom, the 16-byte chunk c of row r stored at chunk c ^ (r % 8) (the hardware XORs
  address bits 4-6 with bits 7-9, so atoms start on 1024 bytes). K-major (Q and K: a row's
  elements along the contraction): SBO = 1024 (the next 8 rows), LBO unused; a k-step of 16
  elements is +32 bytes inside the row. MN-major (V in P V, read transposed,
  ``imm-trans-b`` = 1: a row is one key's 64 columns): SBO = 1024 (the next 8 keys), LBO the
  next 64 columns. The copies of a warp then read whole 128-byte rows and write each row's
  128 bytes across all 32 banks; the no-swizzle layout made them read half rows (8 rows x 64
  bytes an instruction), and the kernel ran 1.6-1.7x slower at d128 (bench/NOTES.md).

None of this runs in numba's simulator; tests/mma_tools.py emulates it for the generated
kernel's source, and the GPU tests run it.
"""
import functools

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
#: the matrix descriptor's fields (PTX ISA, "Matrix Descriptor Format"): start address, LBO and
#: SBO, each in 16-byte units (14 bits from bits 0, 16, 32); bits 62-63 (swizzle) stay 0
START_MASK, LBO_SHIFT, SBO_SHIFT = 0x3FFF, 16, 32


#: the descriptor's layout type (bits 62-63) by swizzle width in bytes
SWIZZLE_MODES = {0: 0, 128: 1, 64: 2, 32: 3}


def descriptor_fields(lbo, sbo, swizzle=0):
    """The LBO / SBO / layout-type bits of a descriptor, for byte offsets ``lbo`` and ``sbo``
    and a swizzle width in bytes (0: none)."""
    assert lbo % 16 == 0 and sbo % 16 == 0 and lbo < 1 << 18 and sbo < 1 << 18
    return (lbo >> 4) << LBO_SHIFT | (sbo >> 4) << SBO_SHIFT | SWIZZLE_MODES[swizzle] << 62


def _instruction(n, kind, a_regs, trans_b, trans_a=False):
    shape = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind}"
    # A from registers takes no imm-trans-a
    assert not (a_regs and trans_a)
    tail = f"1, 1, {int(trans_b)}" if a_regs else f"1, 1, {int(trans_a)}, {int(trans_b)}"
    return shape, tail


def _unpack(builder, value, count):
    return [builder.extract_value(value, i) for i in range(count)]


@functools.lru_cache(maxsize=None)
def wgmma_ss(n, kind, steps, wait=True, trans_a=False, trans_b=False):
    """D = sum over ``steps`` k-steps of A_s B_s, both from shared memory:
    ``wgmma_ss(a_descs, b_descs)`` with two UniTuple(uint64, steps) of descriptors returns the
    warpgroup's 64 x ``n`` float32 D as this thread's n / 2 registers (the first k-step does not
    read D: scale-d false). ``wait=False``: the product is committed as a group and left in
    flight; its registers may be read only after ``wgmma_wait`` has passed them through.
    ``trans_a`` / ``trans_b``: A / B is MN-major (the module docstring's layouts; A's rows of
    128 bytes then run along M)."""
    regs = n // 2
    shape, tail = _instruction(n, kind, False, trans_b, trans_a)
    out = "{" + ",".join(f"${i}" for i in range(regs)) + "}"
    lines = ["{", ".reg .pred first, rest;", "setp.ne.b32 first, 0, 0;",
             "setp.eq.b32 rest, 0, 0;", "wgmma.fence.sync.aligned;"]
    for s in range(steps):
        lines.append(f"{shape} {out}, ${regs + s}, ${regs + steps + s}, "
                     f"{'first' if s == 0 else 'rest'}, {tail};")
    lines += ["wgmma.commit_group.sync.aligned;"] + \
        (["wgmma.wait_group.sync.aligned 0;"] if wait else []) + ["}"]
    text = "\n".join(lines)
    constraints = ",".join(["=f"] * regs + ["l"] * (2 * steps) + ["~{memory}"])

    def product(typingctx, a_descs, b_descs):
        for ty in (a_descs, b_descs):
            if not (isinstance(ty, types.UniTuple) and ty.count == steps
                    and isinstance(ty.dtype, types.Integer)):
                raise TypeError(f"wgmma_ss wants {steps} integer descriptors, got {ty}")
        sig = types.UniTuple(types.float32, regs)(a_descs, b_descs)

        def codegen(context, builder, signature, args):
            ops = [builder.zext(x, _I64) if x.type != _I64 else x
                   for tup in args for x in _unpack(builder, tup, steps)]
            fnty = ir.FunctionType(ir.LiteralStructType([_F32] * regs), [_I64] * (2 * steps))
            res = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), ops)
            return context.make_tuple(builder, signature.return_type, _unpack(builder, res, regs))
        return sig, codegen
    product.__name__ = (f"wgmma_ss_m64n{n}_{kind}_x{steps}{'_ta' if trans_a else ''}"
                        f"{'_tb' if trans_b else ''}{'' if wait else '_async'}")
    return intrinsic(product)


@functools.lru_cache(maxsize=None)
def wgmma_rs(n, kind, steps, trans_b, wait=True):
    """D += sum over ``steps`` k-steps of A_s B_s, A from registers: ``wgmma_rs(acc, a, b_descs)``
    with acc UniTuple(float32, n / 2), a UniTuple(uint32, 4 steps) (packed pairs, k-step by
    k-step) and b_descs UniTuple(uint64, steps); returns the new acc. ``trans_b``: B is
    MN-major (module docstring). ``wait=False``: left in flight, as wgmma_ss's."""
    regs = n // 2
    shape, tail = _instruction(n, kind, True, trans_b)
    out = "{" + ",".join(f"${i}" for i in range(regs)) + "}"
    a0, b0 = 2 * regs, 2 * regs + 4 * steps
    lines = ["{", ".reg .pred rest;", "setp.eq.b32 rest, 0, 0;", "wgmma.fence.sync.aligned;"]
    for s in range(steps):
        a = "{" + ",".join(f"${a0 + 4 * s + r}" for r in range(4)) + "}"
        lines.append(f"{shape} {out}, {a}, ${b0 + s}, rest, {tail};")
    lines += ["wgmma.commit_group.sync.aligned;"] + \
        (["wgmma.wait_group.sync.aligned 0;"] if wait else []) + ["}"]
    text = "\n".join(lines)
    constraints = ",".join(["=f"] * regs + [str(i) for i in range(regs)] + ["r"] * (4 * steps)
                           + ["l"] * steps + ["~{memory}"])

    def product(typingctx, acc, a, b_descs):
        want = ((acc, types.Float, regs), (a, types.Integer, 4 * steps),
                (b_descs, types.Integer, steps))
        for ty, kind_, count in want:
            if not (isinstance(ty, types.UniTuple) and ty.count == count
                    and isinstance(ty.dtype, kind_)):
                raise TypeError(f"wgmma_rs: expected a tuple of {count} {kind_.__name__}, "
                                f"got {ty}")
        sig = types.UniTuple(types.float32, regs)(acc, a, b_descs)

        def codegen(context, builder, signature, args):
            accs = [context.cast(builder, x, signature.args[0].dtype, types.float32)
                    for x in _unpack(builder, args[0], regs)]
            words = [builder.trunc(x, _I32) if x.type.width > 32 else
                     (builder.zext(x, _I32) if x.type.width < 32 else x)
                     for x in _unpack(builder, args[1], 4 * steps)]
            descs = [builder.zext(x, _I64) if x.type != _I64 else x
                     for x in _unpack(builder, args[2], steps)]
            fnty = ir.FunctionType(ir.LiteralStructType([_F32] * regs),
                                   [_F32] * regs + [_I32] * (4 * steps) + [_I64] * steps)
            res = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True),
                               accs + words + descs)
            return context.make_tuple(builder, signature.return_type, _unpack(builder, res, regs))
        return sig, codegen
    product.__name__ = (f"wgmma_rs_m64n{n}_{kind}_x{steps}{'_tb' if trans_b else ''}"
                        f"{'' if wait else '_async'}")
    return intrinsic(product)


@functools.lru_cache(maxsize=None)
def wgmma_wait(regs, pending):
    """``wgmma_wait(acc)``: wait until at most ``pending`` committed product groups are in flight
    (``wgmma.wait_group``), passing the ``regs`` accumulator registers of one of them through
    the statement (tied operands), so that every later use of them is ordered after the wait."""
    text = f"wgmma.wait_group.sync.aligned {pending};"
    constraints = ",".join(["=f"] * regs + [str(i) for i in range(regs)] + ["~{memory}"])

    def wait(typingctx, acc):
        if not (isinstance(acc, types.UniTuple) and acc.count == regs):
            raise TypeError(f"wgmma_wait wants {regs} accumulators, got {acc}")
        sig = types.UniTuple(types.float32, regs)(acc)

        def codegen(context, builder, signature, args):
            accs = [context.cast(builder, x, signature.args[0].dtype, types.float32)
                    for x in _unpack(builder, args[0], regs)]
            fnty = ir.FunctionType(ir.LiteralStructType([_F32] * regs), [_F32] * regs)
            res = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), accs)
            return context.make_tuple(builder, signature.return_type, _unpack(builder, res, regs))
        return sig, codegen
    wait.__name__ = f"wgmma_wait_{pending}_x{regs}"
    return intrinsic(wait)


@intrinsic
def div_u32(typingctx, a, b):
    """a // b as one ``div.u32`` (both truncated to 32 bits): ptxas expands it inline, where a
    64-bit division becomes a subroutine call, and a call anywhere in a kernel makes ptxas
    serialize its wgmma (warning C7509)."""
    if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
        raise TypeError(f"div_u32 takes integers, got {a}, {b}")
    sig = types.uint32(a, b)

    def codegen(context, builder, signature, args):
        ops = [builder.trunc(x, _I32) if x.type.width > 32 else
               (builder.zext(x, _I32) if x.type.width < 32 else x) for x in args]
        asm = ir.InlineAsm(ir.FunctionType(_I32, [_I32, _I32]), "div.u32 $0, $1, $2;", "=r,r,r")
        return builder.call(asm, ops)
    return sig, codegen


@intrinsic
def rcp_approx(typingctx, x):
    """1 / x by ``rcp.approx.ftz.f32`` (at most 1 ulp off; subnormals flushed): the IEEE
    ``rcp.rn`` / ``div.rn`` have a subroutine slow path, which makes ptxas serialize wgmma."""
    sig = types.float32(x)

    def codegen(context, builder, signature, args):
        val = context.cast(builder, args[0], signature.args[0], types.float32)
        asm = ir.InlineAsm(ir.FunctionType(_F32, [_F32]), "rcp.approx.ftz.f32 $0, $1;", "=f,f")
        return builder.call(asm, [val])
    return sig, codegen


@intrinsic
def fence_proxy_async(typingctx):
    """``fence.proxy.async.shared::cta``: this thread's shared-memory writes (cp.async copies
    included) become visible to the tensor cores' (async proxy) reads after the next barrier."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "fence.proxy.async.shared::cta;",
                           "~{memory}", side_effect=True)
        builder.call(asm, [])
        return context.get_dummy_value()
    return sig, codegen
