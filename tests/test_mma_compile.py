"""cuda.mma variants compiled to cubins for sm_80 and sm_90 with no GPU (in a subprocess, since
conftest turns numba's simulator on in this one): the PTX holds each operand kind's mma, one per
product (three for 3xTF32, four m8n8k4 for float64 on sm_80), and its staging instructions, and
ptxas keeps every fragment in registers. Each compile takes up to a minute on 2 cores: the fast
tier compiles a few, the extended tier the rest."""
import dataclasses

import pytest

from mma_tools import assert_register_resident, compile_variant, config_id, tile_config

MMA_TF32 = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"
MMA_F64 = "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64"
MMA_F64_SM80 = "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64"
LDMATRIX = "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
LDMATRIX_TRANS = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"
CP_ASYNC, CP_ASYNC_WAIT = "cp.async.cg.shared.global", "cp.async.wait_group"
CVT_TF32 = "cvt.rna.tf32.f32"
INSTRUCTIONS = (MMA_TF32, MMA_F64, MMA_F64_SM80, LDMATRIX, LDMATRIX_TRANS, CP_ASYNC,
                CP_ASYNC_WAIT, CVT_TF32, "mma.sync.aligned.m16n8k16", "ex2.approx",
                "mma.sync.aligned.m16n8k16.row.col.f32.f16",
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16")
WHY = {"ex2.approx": "float64 must not go through the float32 ex2.approx",
       CVT_TF32: "3xTF32 operands are split by integer add and mask"}


def expected_instructions(cfg, cc):
    """What a variant's PTX must hold: ({instruction: exact count}, {instructions it must hold at
    least once})."""
    k = 16 if cfg.DT in ("f16", "bf16") else 8  # contraction length of one mma
    # one product per (k-step, key tile) of S = Q K^T and per (key k-step, column tile) of P V
    products = (cfg.D // k) * (cfg.BC // 8) + (cfg.BC // k) * (cfg.DV // 8)
    if cfg.DT in ("f16", "bf16"):
        exact = {f"mma.sync.aligned.m16n8k16.row.col.f32.{cfg.DT}": products}
        if cfg.VEC:
            return exact, {LDMATRIX, LDMATRIX_TRANS, CP_ASYNC, CP_ASYNC_WAIT}
        return dict(exact, **{CP_ASYNC: 0}), set()
    if cfg.DT == "tf32":
        return {MMA_TF32: products, "mma.sync.aligned.m16n8k16": 0}, {CVT_TF32}
    if cfg.DT == "3xtf32":  # three tf32 mma per product
        return {MMA_TF32: 3 * products, CVT_TF32: 0}, {CP_ASYNC}
    # float64: m16n8k8 on sm_90; sm_80 has no m16n8k8 .f64, so four m8n8k4 each
    exact = {MMA_F64: products, MMA_F64_SM80: 0} if cc >= (9, 0) else \
        {MMA_F64: 0, MMA_F64_SM80: 4 * products}
    exact["ex2.approx"] = 0
    if cfg.VEC:
        return exact, {CP_ASYNC}
    return dict(exact, **{CP_ASYNC: 0}), set()


def _variant(DT, D, DV=None, cc=(9, 0), VEC=None, DBG=0, fast=False, xfail=None, WINDOW=0,
             VARLEN=0):
    cfg = dataclasses.replace(tile_config(DT, D, DV, cc, VEC, DBG, WINDOW), VARLEN=VARLEN)
    marks = [] if fast else [pytest.mark.extended]
    if xfail:
        marks.append(pytest.mark.xfail(reason=xfail, strict=True))
    return pytest.param(cfg, cc, id=config_id(cfg, cc), marks=marks)


SM80, SM90 = (8, 0), (9, 0)
VARIANTS = [
    # float16 / bfloat16: 4 warps, the default tile of each head dim
    _variant("f16", 32, cc=SM80, VEC=1),   # extended (CI time); f16 d64 and d128 stay fast
    _variant("f16", 64, cc=SM80, VEC=1),
    _variant("bf16", 64, cc=SM90, VEC=1),
    _variant("f16", 64, cc=SM90, VEC=0, fast=True),
    _variant("bf16", 96, cc=SM80, VEC=1),
    _variant("f16", 128, cc=SM90, VEC=1),
    _variant("bf16", 128, cc=SM80, VEC=0),
    _variant("f16", 64, cc=SM80, VEC=1, DBG=1),
    _variant("bf16", 256, cc=SM90, VEC=1),
    _variant("f16", 256, cc=SM80, VEC=0, xfail=(
        "d=256 keeps 128 O accumulators per thread: on sm_80 ptxas spills (372 bytes, "
        "bench/NOTES.md); sm_90 compiles it spill-free")),
    # tf32: scalar staging (operands are rounded as they are staged)
    _variant("tf32", 64, cc=SM80, fast=True),
    _variant("tf32", 128, cc=SM90),
    _variant("tf32", 32, cc=SM90),
    _variant("tf32", 96, cc=SM80),
    # float64: the tile that fits each architecture's shared memory, cp.async or scalar staging
    _variant("f64", 64, cc=SM90, VEC=1),
    _variant("f64", 64, cc=SM80, VEC=1, fast=True),
    _variant("f64", 128, cc=SM90, VEC=1),
    _variant("f64", 128, cc=SM90, VEC=0),   # extended (13 s); f64 d64 on sm_80 stays fast
    _variant("f64", 32, 128, cc=SM90, VEC=0),
    _variant("f64", 32, 64, cc=SM80, VEC=0),
    # 3xTF32: the tiles the planner picks (d32-dv96 compiles in 18 s on 2 cores, d64 in 53-62 s;
    # the shipped sm_90 3xTF32 PTX is linked in the fast tier too: tests/test_precompile.py)
    _variant("3xtf32", 64, cc=SM90),
    _variant("3xtf32", 128, cc=SM90),
    _variant("3xtf32", 96, cc=SM90),
    _variant("3xtf32", 96, 128, cc=SM90),
    _variant("3xtf32", 128, cc=SM80),
    _variant("3xtf32", 64, 128, cc=SM80),
    _variant("3xtf32", 32, 96, cc=SM80),   # extended (18 s): the README tier links the shipped
    #                                       3xTF32 PTX (test_precompile), current by its key
    # a sliding window (WINDOW=1): five more integers live through the tile loop, on the
    # tiles with the least register room of each kind (3xTF32 d=128 takes its narrower tile)
    _variant("f16", 128, cc=SM90, VEC=1, WINDOW=1, fast=True),
    _variant("bf16", 256, cc=SM90, VEC=1, WINDOW=1),
    _variant("f64", 64, cc=SM90, VEC=1, WINDOW=1),
    _variant("3xtf32", 128, cc=SM90, WINDOW=1),   # (d64's window: no spill, left out: CI time)
    # packed sequences in one launch (VARLEN): each block's sequence bounds from cu_seqlens
    _variant("f16", 128, cc=SM90, VEC=1, VARLEN=1),
    _variant("bf16", 64, cc=SM80, VEC=1, VARLEN=1),
    # (the packed 3xTF32 d128 forward sits at 255 registers and spills 52 bytes, bench/NOTES.md
    # "Packed sequences in one launch"; its 96 s compile is left out for CI time)
    _variant("f64", 64, cc=SM90, VEC=1, VARLEN=1),
]


@pytest.mark.parametrize("cfg, cc", VARIANTS)
def test_variant_compiles_to_its_mma_with_no_spills(cfg, cc):
    """PTX has the kind's mma (one per product) and staging instructions; ptxas: no spills, no
    local memory."""
    got = compile_variant(cfg, cc, INSTRUCTIONS)
    ops = got["ops"]
    exact, present = expected_instructions(cfg, cc)
    for op, n in exact.items():
        assert ops[op] == n, f"{op}: {ops[op]}, want {n}. {WHY.get(op, '')}"
    assert all(ops[op] > 0 for op in present), {op: ops[op] for op in present}
    assert_register_resident(got)
