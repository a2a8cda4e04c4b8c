"""Vector reductions into global memory (``red.global.add.v4.f32``, sm_90 / PTX 8.1), for the
backward key pass's dQ adds (numflash/cuda/mma/backward.py, MmaConfig.DQADD).

Kept apart from ptx.py: ptx.py's source digest enters every cuda.mma kernel's identity (the
shipped PTX's keys), this file only the identities of the kernels that call it. Measured on the
lent H100 (bench/NOTES.md, "dQ by adds"): in the mma C layout (a thread's two adjacent columns
of rows g and g + 8) two-float ``red.v2`` adds ran at ~456 G floats/s against ~232 G for scalar
``atomicAdd``; four-float adds (a warp's lanes on 512 contiguous bytes) and bulk reductions
from shared memory at ~600-700 G.
Not runnable in numba's simulator (inline PTX); the warp emulator (tests/mma_tools.py) has it.
"""
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from .ptx import _check_int, _f32, _i64

_F32 = ir.FloatType()
_I64 = ir.IntType(64)


def _make_red_add_f32x4():
    text = "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};"

    def red_add_f32x4(typingctx, addr, a, b, c, d):
        _check_int(addr)
        sig = types.void(addr, a, b, c, d)

        def codegen(context, builder, signature, args):
            tys = signature.args
            ops = [_i64(context, builder, args[0], tys[0])] + [
                _f32(context, builder, v, t) for v, t in zip(args[1:], tys[1:])]
            fnty = ir.FunctionType(ir.VoidType(), [_I64] + [_F32] * 4)
            builder.call(ir.InlineAsm(fnty, text, "l,f,f,f,f,~{memory}", side_effect=True), ops)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(red_add_f32x4)


#: red_add_f32x4(address, a, b, c, d): the four float32 at address (ptx.global_addr2 of a
#: float32 array's element, 16-byte aligned) += a, b, c, d, each add atomic.
red_add_f32x4 = _make_red_add_f32x4()
