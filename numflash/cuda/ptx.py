"""Inline-PTX intrinsics for the tensor-core kernel, one small function each.

numba-cuda has no tensor-core or async-copy API, so each instruction is emitted as LLVM inline
assembly from a numba ``@intrinsic`` (see /work/shared/examples/mma_sync_inline_ptx.py). Integer
operands are taken as any numba integer type and truncated/extended to the 32- or 64-bit register
the instruction wants, floats are converted to f32 (f64 for the float64 mma), so callers need not
fight numba's integer promotion rules. Packed 16-bit halves are carried as uint32 (low half = lower
index).

None of these run in numba's CUDA simulator (the kernel that uses them is declared
``runs_in_simulator=False``). Each is unit-tested alone on the GPU by the tensor-core tests
(tests/test_mma_*.py).

Fragment layouts of ``mma.sync.aligned.m16n8k16.row.col`` (lane = 4 g + t, g in 0..7, t in 0..3;
each register holds two consecutive halves, the lower column/row index in the low 16 bits):
  A (16x16, row-major): a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2], a2 = A[g, 2t+8:2t+10],
                        a3 = A[g+8, 2t+8:2t+10]
  B (16x8, "col"):      b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g]
  C/D (16x8, f32):      c0, c1 = C[g, 2t], C[g, 2t+1]; c2, c3 = C[g+8, 2t], C[g+8, 2t+1]
"""
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

try:  # numba-cuda >= 0.2x vendors numba's core
    from numba.cuda import cgutils
except ImportError:  # pragma: no cover
    from numba.core import cgutils

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()


def _check_int(*tys):
    for ty in tys:
        if not isinstance(ty, types.Integer):
            raise TypeError(f"expected an integer operand, got {ty}")


def _i32(context, builder, val, ty):
    width = ty.bitwidth
    if width == 32:
        return val
    if width > 32:
        return builder.trunc(val, _I32)
    return builder.sext(val, _I32) if ty.signed else builder.zext(val, _I32)


def _i64(context, builder, val, ty):
    if ty.bitwidth == 64:
        return val
    return builder.sext(val, _I64) if ty.signed else builder.zext(val, _I64)


def _f32(context, builder, val, ty):
    return context.cast(builder, val, ty, types.float32)


def _tuple(context, builder, rettype, res, n):
    return context.make_tuple(builder, rettype, [builder.extract_value(res, i) for i in range(n)])


# ---------------------------------------------------------------------------- mma.sync m16n8k16

def _make_mma(kind, shape="m16n8k16"):
    asm_text = (f"mma.sync.aligned.{shape}.row.col.f32.{kind}.{kind}.f32 "
                "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")

    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        _check_int(a0, a1, a2, a3, b0, b1)
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, signature, args):
            tys = signature.args
            ops = [_i32(context, builder, v, t) for v, t in zip(args[:6], tys[:6])]
            ops += [_f32(context, builder, v, t) for v, t in zip(args[6:], tys[6:])]
            fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4)
            asm = ir.InlineAsm(fnty, asm_text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                               side_effect=False)
            return _tuple(context, builder, signature.return_type, builder.call(asm, ops), 4)
        return sig, codegen
    mma.__name__ = f"mma_{shape}_{kind}"
    return intrinsic(mma)


#: D = A @ B + C for packed float16 A (4 regs), B (2 regs); fp32 C/D (4 floats each).
mma_f16 = _make_mma("f16")
#: The same for bfloat16 (sm_80+).
mma_bf16 = _make_mma("bf16")
#: D = A @ B + C for m16n8k8 with tf32 operands (each register one tf32 value, see to_tf32):
#: A (16x8) 4 regs, B (8x8) 2 regs, fp32 C/D (4 floats each); sm_80+. Fragments (g = lane >> 2,
#: t = lane & 3): a0 = A[g, t], a1 = A[g+8, t], a2 = A[g, t+4], a3 = A[g+8, t+4];
#: b0 = B[t, g], b1 = B[t+4, g]; C/D as for m16n8k16.
mma_tf32 = _make_mma("tf32", "m16n8k8")


# ---------------------------------------------------------------------------- mma.sync float64

_F64 = ir.DoubleType()


def _f64(context, builder, val, ty):
    return context.cast(builder, val, ty, types.float64)


def _make_mma_f64(native):
    """D = A @ B + C for a 16x8x8 float64 product with the fragment layout of mma_tf32 (a0..a3,
    b0, b1, c0..c3 each one float64). sm_90 has it as one instruction (m16n8k8 .f64, PTX 7.8);
    sm_80 issues four m8n8k4: rows g (a0, a2) and g+8 (a1, a3) against k-halves t (b0) and t+4
    (b1), since an m8n8k4 fragment is a = A[g, t], b = B[t, g], c = C[g, 2t:2t+2]."""
    if native:
        text = ("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 "
                "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")
    else:
        text = ("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 "
                "{$0,$1}, {$2}, {$3}, {$4,$5};")

    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = types.UniTuple(types.float64, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, signature, args):
            a0, a1, a2, a3, b0, b1, c0, c1, c2, c3 = (
                _f64(context, builder, v, t) for v, t in zip(args, signature.args))
            if native:
                fnty = ir.FunctionType(ir.LiteralStructType([_F64] * 4), [_F64] * 10)
                asm = ir.InlineAsm(fnty, text, "=d,=d,=d,=d,d,d,d,d,d,d,d,d,d,d",
                                   side_effect=False)
                res = builder.call(asm, [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3])
                return _tuple(context, builder, signature.return_type, res, 4)
            fnty = ir.FunctionType(ir.LiteralStructType([_F64] * 2), [_F64] * 4)
            asm = ir.InlineAsm(fnty, text, "=d,=d,d,d,d,d", side_effect=False)

            def step(a, b, x, y):
                r = builder.call(asm, [a, b, x, y])
                return builder.extract_value(r, 0), builder.extract_value(r, 1)
            # rows g and g+8 are independent chains: interleave them
            c0, c1 = step(a0, b0, c0, c1)
            c2, c3 = step(a1, b0, c2, c3)
            c0, c1 = step(a2, b1, c0, c1)
            c2, c3 = step(a3, b1, c2, c3)
            return context.make_tuple(builder, signature.return_type, [c0, c1, c2, c3])
        return sig, codegen
    mma.__name__ = "mma_f64_m16n8k8" if native else "mma_f64_m8n8k4x4"
    return intrinsic(mma)


#: float64 16x8x8 product on sm_90+ (one mma.sync.m16n8k8.f64).
mma_f64_m16n8k8 = _make_mma_f64(native=True)
#: The same product on sm_80+ as four mma.sync.m8n8k4.f64.
mma_f64_m8n8k4x4 = _make_mma_f64(native=False)


# ---------------------------------------------------------------------------- conversions

def _make_pack(kind):
    asm_text = f"cvt.rn.{kind}x2.f32 $0, $1, $2;"

    def pack(typingctx, lo, hi):
        sig = types.uint32(lo, hi)

        def codegen(context, builder, signature, args):
            lo_v = _f32(context, builder, args[0], signature.args[0])
            hi_v = _f32(context, builder, args[1], signature.args[1])
            fnty = ir.FunctionType(_I32, [_F32, _F32])
            # cvt.rn.f16x2.f32 d, a, b puts a in the upper half and b in the lower half
            return builder.call(ir.InlineAsm(fnty, asm_text, "=r,f,f"), [hi_v, lo_v])
        return sig, codegen
    pack.__name__ = f"pack_{kind}x2"
    return intrinsic(pack)


#: uint32 holding (float16(hi) << 16) | float16(lo), round to nearest even.
pack_f16x2 = _make_pack("f16")
#: uint32 holding (bfloat16(hi) << 16) | bfloat16(lo), round to nearest even (sm_80+).
pack_bf16x2 = _make_pack("bf16")


@intrinsic
def to_tf32(typingctx, x):
    """float32 -> tf32 bits in a uint32 (cvt.rna.tf32.f32: round to nearest, ties away from zero,
    10-bit mantissa; the low 13 bits are zero), the operand format of mma_tf32 (sm_80+)."""
    sig = types.uint32(x)

    def codegen(context, builder, signature, args):
        v = _f32(context, builder, args[0], signature.args[0])
        fnty = ir.FunctionType(_I32, [_F32])
        return builder.call(ir.InlineAsm(fnty, "cvt.rna.tf32.f32 $0, $1;", "=r,f"), [v])
    return sig, codegen


@intrinsic
def split_tf32(typingctx, x):
    """float32 x -> (hi, lo) tf32 operands with x = hi + lo to 2**-21 |x|, the operand pair of a
    3xTF32 product A B ~ A_h B_h + A_h B_l + A_l B_h (sm_80+). A tf32 mma reads only an
    operand's top 19 bits, so hi = x's bits + 0x1000 is x rounded half away from zero as the
    mma reads it, and lo = x - (hi & ~0x1fff) is exact and read truncated: 3 instructions
    (cvt.rna.tf32.f32 alone is ~4 on sm_90). A NaN whose bits wrap in the add leaves a NaN lo,
    so NaN still reaches the product; |x| >= 3.40256e38 splits into inf and -inf (NaN)."""
    sig = types.UniTuple(types.uint32, 2)(x)

    def codegen(context, builder, signature, args):
        v = _f32(context, builder, args[0], signature.args[0])
        fnty = ir.FunctionType(ir.LiteralStructType([_I32, _I32]), [_F32])
        asm = ir.InlineAsm(fnty, "{ .reg .b32 t; mov.b32 t, $2; add.u32 $0, t, 0x1000; "
                                 "and.b32 t, $0, 0xFFFFE000; sub.f32 $1, $2, t; }",
                           "=r,=r,f")
        return _tuple(context, builder, signature.return_type, builder.call(asm, [v]), 2)
    return sig, codegen


@intrinsic
def ex2(typingctx, x):
    """2**x by ex2.approx.ftz.f32 (2 ulp; ex2(-inf) = +0)."""
    sig = types.float32(x)

    def codegen(context, builder, signature, args):
        v = _f32(context, builder, args[0], signature.args[0])
        fnty = ir.FunctionType(_F32, [_F32])
        return builder.call(ir.InlineAsm(fnty, "ex2.approx.ftz.f32 $0, $1;", "=f,f"), [v])
    return sig, codegen


# ---------------------------------------------------------------------------- addresses

def _item_pointer(context, builder, aryty, ary_val, idx_vals, idx_tys):
    ary = context.make_array(aryty)(context, builder, ary_val)
    inds = [context.cast(builder, v, t, types.intp) for v, t in zip(idx_vals, idx_tys)]
    return cgutils.get_item_pointer(context, builder, aryty, ary, inds, wraparound=False)


@intrinsic
def shared_addr(typingctx, ary, i):
    """32-bit shared-window address of ary[i] (ary: a 1-D shared array), for ldmatrix/cp.async."""
    if not isinstance(ary, types.Array) or ary.ndim != 1:
        raise TypeError("shared_addr takes a 1-D shared array")
    _check_int(i)
    sig = types.uint32(ary, i)

    def codegen(context, builder, signature, args):
        ptr = _item_pointer(context, builder, signature.args[0], args[0], [args[1]],
                            [signature.args[1]])
        gen = builder.ptrtoint(ptr, _I64)
        fnty = ir.FunctionType(_I32, [_I64])
        asm = ir.InlineAsm(fnty, "{ .reg .u64 t; cvta.to.shared.u64 t, $1; cvt.u32.u64 $0, t; }",
                           "=r,l")
        return builder.call(asm, [gen])
    return sig, codegen


@intrinsic
def global_addr2(typingctx, ary, i, j):
    """64-bit generic address of ary[i, j] (ary: a 2-D array in global memory)."""
    if not isinstance(ary, types.Array) or ary.ndim != 2:
        raise TypeError("global_addr2 takes a 2-D array")
    _check_int(i, j)
    sig = types.uint64(ary, i, j)

    def codegen(context, builder, signature, args):
        ptr = _item_pointer(context, builder, signature.args[0], args[0], args[1:],
                            signature.args[1:])
        return builder.ptrtoint(ptr, _I64)
    return sig, codegen


# ---------------------------------------------------------------------------- ldmatrix

def _make_ldmatrix(trans):
    text = ("ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "") +
            ".shared.b16 {$0,$1,$2,$3}, [$4];")

    def ldmatrix(typingctx, addr):
        _check_int(addr)
        sig = types.UniTuple(types.uint32, 4)(addr)

        def codegen(context, builder, signature, args):
            a = _i32(context, builder, args[0], signature.args[0])
            fnty = ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I32])
            # reads shared memory written by other threads: keep it ordered (side effect, memory)
            asm = ir.InlineAsm(fnty, text, "=r,=r,=r,=r,r,~{memory}", side_effect=True)
            return _tuple(context, builder, signature.return_type, builder.call(asm, [a]), 4)
        return sig, codegen
    ldmatrix.__name__ = "ldmatrix_x4_trans" if trans else "ldmatrix_x4"
    return intrinsic(ldmatrix)


#: Four 8x8 b16 matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix i;
#: register i of lane 4g+t holds row g, columns 2t, 2t+1 of matrix i.
ldmatrix_x4 = _make_ldmatrix(False)
#: The same, transposed: register i of lane 4g+t holds rows 2t, 2t+1 of column g of matrix i.
ldmatrix_x4_trans = _make_ldmatrix(True)


# ---------------------------------------------------------------------------- cp.async

@intrinsic
def cp_async_16(typingctx, dst, src, src_bytes):
    """Copy 16 bytes global -> shared asynchronously (cp.async.cg, L2 only); bytes of the 16
    past src_bytes (0 or 16) are zero-filled. dst: shared_addr(...), src: global_addr2(...)."""
    _check_int(dst, src, src_bytes)
    sig = types.void(dst, src, src_bytes)

    def codegen(context, builder, signature, args):
        d = _i32(context, builder, args[0], signature.args[0])
        s = _i64(context, builder, args[1], signature.args[1])
        n = _i32(context, builder, args[2], signature.args[2])
        fnty = ir.FunctionType(ir.VoidType(), [_I32, _I64, _I32])
        asm = ir.InlineAsm(fnty, "cp.async.cg.shared.global [$0], [$1], 16, $2;",
                           "r,l,r,~{memory}", side_effect=True)
        builder.call(asm, [d, s, n])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def cp_async_commit(typingctx):
    """Close the group of cp.async issued by this thread since the last commit."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.VoidType(), [])
        builder.call(ir.InlineAsm(fnty, "cp.async.commit_group;", "~{memory}",
                                  side_effect=True), [])
        return context.get_dummy_value()
    return sig, codegen


def _make_wait(n):
    def wait(typingctx):
        sig = types.void()

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(ir.InlineAsm(fnty, f"cp.async.wait_group {n};", "~{memory}",
                                      side_effect=True), [])
            return context.get_dummy_value()
        return sig, codegen
    wait.__name__ = f"cp_async_wait_{n}"
    return intrinsic(wait)


#: Wait until at most 0 / 1 of this thread's committed cp.async groups are still in flight
#: (then __syncthreads() makes the data visible to the block).
cp_async_wait_0 = _make_wait(0)
cp_async_wait_1 = _make_wait(1)
