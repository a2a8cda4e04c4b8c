"""cuda.wgmma without a GPU: its generated source run on the CPU under the warp emulator
(tests/mma_tools.py: wgmma from 128-byte swizzled shared memory, the cp.async copies, the
warpgroup products) against the float64 reference; its PTX for sm_90a (wgmma present, nothing
in local memory, no spills, no subroutine that would make ptxas serialize the products); and
what the planner does with it (auto on compute capability 9.0, the refusals and their reasons).
On the GPU: tests/test_wgmma_gpu.py."""
import dataclasses
import re

import numpy as np
import pytest

import numflash
from numflash.device import Device
from numflash.testing import check

HOPPER = Device("h100", cc=(9, 0), smem_per_block_optin=227 * 1024, sm_count=132)


def _inputs(rng, B, H, Hkv, Nq, Nk, d, dv, dtype):
    q = rng.standard_normal((B, H, Nq, d)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Nk, d)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Nk, dv)).astype(dtype)
    return q, k, v


EMULATED = [  # B, H, Hkv, Nq, Nk, d, dv, causal, (NWG, BC)
    (1, 1, 1, 70, 100, 64, 64, False, (1, 32)),         # a partial last key tile
    (1, 2, 2, 33, 70, 40, 64, "bottom_right", (1, 32)),  # d padded to 64
    (1, 1, 1, 150, 90, 64, 64, "top_left", (2, 32)),     # two warpgroups; rows past Nk's end
    (1, 1, 1, 200, 75, 128, 64, "bottom_right", (3, 32)),  # rows that see no key; three
    (2, 2, 1, 1, 37, 72, 128, False, (1, 48)),          # one query row, GQA, dv padded to 128
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", EMULATED, ids=lambda c: "B{}H{}Hkv{}-{}x{}-d{}dv{}-{}-{}".format(
    *c[:7], c[7], "x".join(map(str, c[8]))))
def test_emulated_wgmma_forward_is_accurate(rng, case, dtype):
    from mma_tools import run_wgmma_forward
    B, H, Hkv, Nq, Nk, d, dv, causal, tile = case
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
        if case != EMULATED[1]:   # bfloat16 shares the source but for the pack: one case
            pytest.skip("bfloat16 runs one case")
    q, k, v = _inputs(rng, B, H, Hkv, Nq, Nk, d, dv, dtype)
    offset = Nk - Nq if causal == "bottom_right" else 0
    out, lse = run_wgmma_forward(q, k, v, bool(causal), offset, tile=tile)
    rep = check(out, q, k, v, lse=lse, causal=causal)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("name, dtype, causal, Hkv, tile", [
    ("all-but-window", "float16", "bottom_right", 1, (1, 32)),   # GQA
    pytest.param("all-builtins", "bfloat16", True, 2, (2, 32),     # and a window
                 marks=pytest.mark.extended),
    pytest.param("user-document-and-relative-bias", "float16", True, 2, (2, 32),
                 marks=pytest.mark.extended),
    pytest.param("mask-softcap", "bfloat16", False, 2, (1, 64), marks=pytest.mark.extended),
])
def test_emulated_wgmma_forward_with_modifications(rng, name, dtype, causal, Hkv, tile):
    """cuda.mma's modifications compiled into the wgmma forward (applied to each tile's S
    registers after the bounds, the softmax then in log2(e) units): output and lse meet the
    accuracy rule against the reference with the same modifications."""
    from mma_tools import run_wgmma_forward
    from test_mma_mods import _options
    from numflash import mods
    from numflash.inputs import parse_causal
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    B, H, Nq, Nk, d = 2, 2, 40, 50, 64
    q, k, v = _inputs(rng, B, H, Hkv, Nq, Nk, d, d, dtype)
    opts = _options(name, B, H, Nq, Nk, rng)
    is_causal, off = parse_causal(causal, Nq, Nk)
    built = mods.build((B, H, Nq, Nk, d, d), "numpy", off, **opts)
    out, lse = run_wgmma_forward(q, k, v, is_causal, off, tile=tile, mods=built)
    rep = check(out, q, k, v, lse=lse, causal=causal, **opts)
    assert rep.ok, str(rep)


WINDOWED = [  # Nq, Nk, d, causal, window_size, dtype, (NWG, BC)
    # the second block's tiles start at 3 (t_first), its second warpgroup skips the first one
    (150, 300, 64, False, (20, 10), "float16", (2, 32)),
    # a right edge only, causal top-left: rows past Nk's end; d padded to 128
    pytest.param((200, 75, 96, True, (-1, 4), "bfloat16", (2, 64)), marks=pytest.mark.extended),
    # bottom-right with Nq > Nk: the first rows see no key (zeros, lse -inf)
    (130, 60, 64, "bottom_right", (7, 0), "float16", (1, 32)),
]


@pytest.mark.parametrize("case", WINDOWED, ids=lambda c: "{}x{}-d{}-{}-w{}-{}-{}".format(
    *c[:4], "_".join(map(str, c[4])), c[5], "x".join(map(str, c[6]))))
def test_emulated_wgmma_forward_with_a_window(rng, case):
    """A sliding window on the wgmma forward: the block starts at the tile of its first row's
    first key, each warpgroup computes the tiles its rows' windows reach; output and lse meet
    the rule against the reference with the same window (rows without keys included)."""
    from mma_tools import run_wgmma_forward
    from numflash import mods
    from numflash.inputs import parse_causal
    Nq, Nk, d, causal, window, dtype, tile = case
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    q, k, v = _inputs(rng, 1, 2, 1, Nq, Nk, d, d, dtype)
    is_causal, off = parse_causal(causal, Nq, Nk)
    built = mods.build((1, 2, Nq, Nk, d, d), "numpy", off, window_size=window)
    out, lse = run_wgmma_forward(q, k, v, is_causal, off, tile=tile, mods=built)
    rep = check(out, q, k, v, lse=lse, causal=causal, window_size=window)
    assert rep.ok, str(rep)
    if causal == "bottom_right":   # rows before Nq - Nk: even the diagonal key is before 0
        assert np.isneginf(lse[:, :, :Nq - Nk]).all() and not out[:, :, :Nq - Nk].any()
        assert np.isfinite(lse[:, :, Nq - Nk:]).all()


@pytest.mark.parametrize("Nq, Nk, causal, window, block, tile, alibi", [
    # 64 x 64 blocks of 32-key tiles: PARTIAL blocks, a FULL one, an EMPTY one, a last partial;
    # ALiBi beside it (a FULL block's tiles run it without the mask_mod)
    (200, 190, False, None, 64, (1, 32), True),
    # two warpgroups, 128 x 128 blocks of 64-key tiles with a window, bottom-right: rows
    # before Nq - Nk see no key, blocks outside the window are not listed past its start
    pytest.param(300, 260, "bottom_right", (70, 9), 128, (2, 64), False,
                 marks=pytest.mark.extended),
])
def test_emulated_wgmma_forward_with_a_block_mask(rng, Nq, Nk, causal, window, block, tile,
                                                  alibi):
    """A block mask on the wgmma forward (cuda.mma's walk over each block row's listed blocks;
    the mask_mod on PARTIAL blocks only): output and lse meet the rule against the reference
    with the dense mask the blocks' states describe (doctored FULL and EMPTY blocks included,
    so a skipped tile or an unmasked FULL one would show)."""
    from mma_tools import run_wgmma_forward
    from test_block_mask import _doctored, _stripes
    from numflash import block_mask, mods
    from numflash.inputs import parse_causal
    B, H, Hkv, d = 1, 2, 1, 64
    q, k, v = _inputs(rng, B, H, Hkv, Nq, Nk, d, d, np.float16)
    bm, dense = _doctored(_stripes, (5, 3), B, H, Nq, Nk, block, {
        (1, 1): block_mask.FULL, (0, 2): block_mask.EMPTY})
    opts = {"window_size": window} if window else {}
    if alibi:
        opts["alibi_slopes"] = rng.uniform(0.05, 0.5, H).astype(np.float32)
    is_causal, off = parse_causal(causal, Nq, Nk)
    built = mods.build((B, H, Nq, Nk, d, d), "numpy", off, block_mask=bm, **opts)
    out, lse = run_wgmma_forward(q, k, v, is_causal, off, tile=tile, mods=built)
    rep = check(out, q, k, v, lse=lse, causal=causal, attn_mask=dense, **opts)
    assert rep.ok, str(rep)
    assert np.isneginf(lse).any() == (causal == "bottom_right")


@pytest.mark.parametrize("d, causal, tile, window", [
    (64, "bottom_right", (1, 32), None),
    pytest.param(128, True, (2, 64), None, marks=pytest.mark.extended),
    (64, False, (2, 32), (30, 6)),   # WINDOW: each sequence's own window and alignment
])
def test_emulated_wgmma_forward_of_packed_sequences(rng, d, causal, tile, window):
    """The VARLEN forward (one launch over packed sequences: one without queries, one without
    keys, Nq != Nk both ways, a sequence of several query blocks and key tiles, GQA) under the
    warp emulator gives each sequence bit for bit what the plain kernel gives it alone (with a
    window: the same window); rows of a sequence without keys get zeros and lse -inf."""
    from mma_tools import run_wgmma_forward
    from numflash import mods
    from numflash.inputs import parse_causal
    lens_q, lens_k = [5, 0, 150, 40], [7, 12, 200, 0]
    cq, ck = (np.concatenate([[0], np.cumsum(n)]) for n in (lens_q, lens_k))
    q, k, v = _inputs(rng, 1, 2, 1, cq[-1], ck[-1], d, d, np.float16)

    def windowed(Nq, Nk, offset):   # the window's Mods (only its sizes reach the kernel)
        return window and mods.build((1, 2, Nq, Nk, d, d), "numpy", offset, window_size=window)
    out, lse = run_wgmma_forward(q, k, v, bool(causal), tile=tile,
                                 varlen=(cq, ck, causal == "bottom_right"),
                                 mods=windowed(cq[-1], ck[-1], 0))
    for b in range(4):
        s, e, sk, ek = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if e == s:
            continue
        if ek == sk:
            assert not out[:, :, s:e].any() and np.isneginf(lse[:, :, s:e]).all()
            continue
        is_causal, offset = parse_causal(causal, e - s, ek - sk)
        one, one_lse = run_wgmma_forward(q[:, :, s:e], k[:, :, sk:ek], v[:, :, sk:ek],
                                         is_causal, offset, tile=tile,
                                         mods=windowed(e - s, ek - sk, offset))
        np.testing.assert_array_equal(out[:, :, s:e], one)
        np.testing.assert_array_equal(lse[:, :, s:e], one_lse)
        rep = check(one, q[:, :, s:e], k[:, :, sk:ek], v[:, :, sk:ek], lse=one_lse,
                    causal=causal, **({"window_size": window} if window else {}))
        assert rep.ok, str(rep)


def test_emulated_swizzle_is_what_the_descriptor_reads(rng):
    """The copies' swizzled placement and the emulator's descriptor decoding are written apart:
    one product of a staged tile against the plain matrix product."""
    from mma_tools import Emu, f16_values
    from numflash.cuda.wgmma.tiles import ATOM, SWIZZLE
    from numflash.cuda.ptx_wgmma import descriptor_fields
    a = rng.standard_normal((64, 128)).astype(np.float16)   # two 64-column slabs
    b = rng.standard_normal((32, 128)).astype(np.float16)
    emu = Emu(128, (1,), 64 * 256 + 32 * 256)
    emu.smem = np.zeros(emu.shared_bytes // 4, np.uint32)
    halves = emu.smem.view(np.uint16)

    def place(x, base):   # row r, chunk c of slab s -> r * 128 + ((c ^ r % 8) * 16)
        rows = x.shape[0]
        for r in range(rows):
            for col in range(x.shape[1]):
                slab, c, e = col // 64, (col % 64) // 8, col % 8
                byte = base + slab * rows * SWIZZLE + r * SWIZZLE + ((c ^ (r % 8)) * 16) + 2 * e
                halves[byte // 2] = x[r, col].view(np.uint16)
    place(a, 0)
    place(b, 64 * 256)
    fields = descriptor_fields(16, ATOM, swizzle=SWIZZLE)
    total = 0
    for kk in range(8):   # k-steps of 16 columns: 32 bytes a step, a slab every 4
        off = kk // 4 * 64 * SWIZZLE + kk % 4 * 32
        off_b = kk // 4 * 32 * SWIZZLE + kk % 4 * 32
        total = total + emu._desc_matrix((off >> 4) | fields, 64, 16, f16_values) @ \
            emu._desc_matrix(((64 * 256 + off_b) >> 4) | fields, 32, 16, f16_values).T
    assert np.allclose(total, a.astype(np.float64) @ b.astype(np.float64).T)


# ------------------------------------------------------------------------------- compiled PTX

def _compile(cfg):
    from mma_tools import compile_wgmma_variant
    return compile_wgmma_variant(cfg)


@pytest.mark.parametrize("cfg, blocks", [   # blocks: how many must share an SM's registers
    pytest.param(dict(D=64, DV=64, NWG=2, BC=64, DT="f16"), 2, id="f16-d64"),
    pytest.param(dict(D=128, DV=128, NWG=2, BC=128, DT="bf16"), 1, id="bf16-d128",
                 marks=pytest.mark.extended),
    pytest.param(dict(D=128, DV=64, NWG=2, BC=128, DT="f16"), 1, id="f16-d128-dv64",
                 marks=pytest.mark.extended),
    # packed sequences in one launch (VARLEN): each block's sequence bounds from cu_seqlens
    pytest.param(dict(D=128, DV=128, NWG=2, BC=128, DT="f16", VARLEN=1), 1, id="varlen-f16-d128",
                 marks=pytest.mark.extended),
    pytest.param(dict(D=64, DV=64, NWG=2, BC=64, DT="bf16", VARLEN=1), 2, id="varlen-bf16-d64",
                 marks=pytest.mark.extended),
])
def test_wgmma_compiles_for_sm90a_without_spills_or_serialization(cfg, blocks):
    got = _compile(cfg)
    assert got["target"] == ".target sm_90a"
    # each product twice: the steady state's asynchronous one, the first tile's S and the
    # last tile's P V waited for at once
    kind = "f16" if cfg["DT"] == "f16" else "bf16"
    want = {}
    for n, steps in ((cfg["BC"], cfg["D"] // 16), (cfg["DV"], cfg["BC"] // 16)):
        op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind}"
        want[op] = want.get(op, 0) + 2 * steps
    assert {op: n for op, n in got["ops"].items() if op.startswith("wgmma")} == want, got["ops"]
    assert got["ops"]["ld.local"] == 0 and got["ops"]["st.local"] == 0
    res = got["resources"]
    assert res.get("spill_store_bytes", 0) == 0 and res.get("stack_bytes", 0) == 0, res
    assert not got["serialized"], "ptxas serializes the wgmma (C7509): " + got["serialized"]
    # 128 threads a warpgroup: the block's warpgroups (d64: two blocks' worth, the reason its
    # tile is BC=64) must fit the register file
    assert res["registers"] * 128 * cfg["NWG"] * blocks <= 65536, res


@pytest.mark.parametrize("cfg, name", [
    (dict(D=64, DV=64, NWG=2, BC=32, DT="f16"), "all-but-window"),
    pytest.param(dict(D=128, DV=128, NWG=2, BC=64, DT="f16"), "user-document-and-relative-bias",
                 marks=pytest.mark.extended),
    pytest.param(dict(D=128, DV=128, NWG=2, BC=64, DT="f16"), "all-but-window",
                 marks=pytest.mark.extended),
    # sliding windows: alone on the full tiles (d64 capped at 128 registers), with the other
    # modifications or on packed sequences on the half-width ones (tiles.HALF_TILES)
    (dict(D=64, DV=64, NWG=2, BC=64, DT="f16", WINDOW=1), ""),
    pytest.param(dict(D=128, DV=128, NWG=2, BC=128, DT="bf16", WINDOW=1), "",
                 marks=pytest.mark.extended),
    pytest.param(dict(D=64, DV=64, NWG=2, BC=32, DT="f16", WINDOW=1), "all-but-window",
                 marks=pytest.mark.extended),
    pytest.param(dict(D=64, DV=64, NWG=2, BC=32, DT="bf16", WINDOW=1, VARLEN=1), "",
                 marks=pytest.mark.extended),
    # block masks: the walk over the listed blocks, alone (d64: two blocks an SM), with ALiBi
    # (d64: one, uncapped) and with a window (d128, extended)
    (dict(D=64, DV=64, NWG=2, BC=32, DT="f16"), "document-block-mask"),
    (dict(D=64, DV=64, NWG=2, BC=32, DT="f16"), "document-block-mask-alibi"),
    pytest.param(dict(D=128, DV=128, NWG=2, BC=64, DT="bf16", WINDOW=1),
                 "document-block-mask-alibi", marks=pytest.mark.extended),
], ids=lambda x: "-".join(f"{k}{v}" for k, v in x.items()) if isinstance(x, dict) else x)
def test_wgmma_with_modifications_compiles_without_spills_or_serialization(cfg, name):
    """The modified and windowed forwards (on the tiles config() gives them) keep every
    register resident and their wgmma asynchronous: an IEEE division among the modifications
    (the softcap once divided by its cap) made ptxas serialize every wgmma of the kernel
    (C7509); d64 stays at two blocks an SM (its register cap)."""
    from mma_tools import compile_wgmma_variant
    got = compile_wgmma_variant(cfg, name)
    res = got["resources"]
    assert not got["serialized"], "ptxas serializes the wgmma (C7509): " + got["serialized"]
    assert got["ops"]["ld.local"] == 0 and got["ops"]["st.local"] == 0, got["ops"]
    assert res.get("spill_store_bytes", 0) == 0 and res.get("stack_bytes", 0) == 0, res
    # two blocks an SM at d64 (one with a block mask and other modifications: uncapped)
    blocks = 2 if cfg["D"] == 64 and name != "document-block-mask-alibi" else 1
    assert got["blocks_per_sm"] == blocks
    assert res["registers"] * 128 * cfg["NWG"] * blocks <= 65536, res
    # the tile compiled is the one config() plans for such a call
    opts = dict(window_size=(40, 0)) if cfg.get("WINDOW") else {}
    if "block-mask" in name:
        opts.update(block_mask=128, algorithm="wgmma")   # ("auto" leaves it to cuda.mma)
    elif name:
        opts.update(softcap=5.0)
    planned = _plan(np.random.default_rng(0), d=cfg["D"], **opts,
                    **(_packed() if cfg.get("VARLEN") else {}))
    assert planned.kernel == "cuda.wgmma", str(planned)
    assert (planned.config.NWG, planned.config.BC) == (cfg["NWG"], cfg["BC"]), str(planned)


def test_the_packed_d64_forward_is_capped_to_two_blocks_an_sm():
    """Only the packed, modified or windowed d64 forward carries a register cap (128: two
    256-thread blocks an SM), written into its PTX as .maxnreg and named in its code identity
    (a cached or shipped kernel compiled without it is never taken for it); a block mask with
    other modifications has none (one block an SM: tiles.blocks_per_sm)."""
    from test_mma_mods import _options
    from numflash import mods
    from numflash.cuda import launch
    from numflash.cuda.mma.mods import token_for
    from numflash.cuda.wgmma import forward
    from numflash.cuda.wgmma.tiles import WgmmaConfig, register_cap

    def token(name):
        shape = (2, 4, 128, 128, 64, 64)
        return token_for(mods.build(shape, "numpy", 0, **_options(name, *shape[:4],
                                                                  np.random.default_rng(0))))
    packed = dict(D=64, DV=64, NWG=2, BC=64, DT="f16", VARLEN=1)
    assert register_cap(WgmmaConfig(**packed)) == 128
    assert register_cap(WgmmaConfig(**dict(packed, VARLEN=0))) is None
    for name, cap in (("all-but-window", 128), ("document-block-mask", 128),
                      ("document-block-mask-alibi", None)):
        assert register_cap(WgmmaConfig(**dict(packed, VARLEN=0, MODS=token(name)))) == cap
    assert register_cap(WgmmaConfig(**dict(packed, VARLEN=0, WINDOW=1))) == 128
    assert register_cap(WgmmaConfig(**dict(packed, D=128, DV=128, BC=128))) is None
    assert forward.make_kernel(**packed).max_registers == 128
    assert forward.code_identity(**packed).endswith("-maxnreg128")
    assert not forward.code_identity(**dict(packed, VARLEN=0)).endswith("-maxnreg128")
    ptx = ".version 8.0\n.target sm_90\n.visible .entry k(\n .param .u64 a\n)\n{\n ret;\n}\n"
    assert ".entry k(\n .param .u64 a\n)\n.maxnreg 128\n\n{" in launch.cap_registers(ptx, 128)


# ------------------------------------------------------------------------------- planning

def _plan(rng, device=HOPPER, dtype=np.float16, B=4, H=16, Nq=4096, Nk=4096, d=64, dv=None,
          algorithm="auto", strided=False, varlen=None, **opts):
    from mma_tools import DeviceView
    from numflash import plan as planner
    from numflash.api import _with_mods
    from numflash.inputs import normalize
    q, k, v = (np.zeros((B, H, n, w), dtype) for n, w in ((Nq, d), (Nk, d), (Nk, dv or d)))
    if strided:
        q = np.repeat(q, 2, axis=-1)[..., ::2]
    mods = {name: opts.pop(name) for name in ("softcap", "window_size", "alibi_slopes")
            if name in opts}
    if "block_mask" in opts:   # causal, in blocks of the size given
        from numflash.block_mask import create_block_mask
        mods["block_mask"] = create_block_mask(lambda b, h, i, j: j <= i, B, H, Nq, Nk,
                                               block_size=opts.pop("block_mask"))
    p = _with_mods(normalize(q, k, v, **opts), mods)
    p = dataclasses.replace(p, kind="cupy", q=DeviceView(p.q), k=DeviceView(p.k),
                            v=DeviceView(p.v), out=DeviceView(p.out))
    p.varlen = varlen   # (numflash.varlen.Packed: packed sequences)
    return planner._choose(p, "cuda", algorithm, device)


def _packed():
    """_plan's arguments for two packed sequences (5 x 7 and 40 x 3), bottom-right aligned."""
    from numflash.varlen import Packed
    return dict(B=1, H=4, Nq=45, Nk=10, causal="bottom_right",
                varlen=Packed(np.array([0, 5, 45]), np.array([0, 7, 10]), 40, 7, True))


@pytest.mark.parametrize("d, dv, want", [(64, 64, (64, 64)), (40, 72, (64, 128)),
                                         (128, 128, (128, 128))])
def test_auto_takes_wgmma_for_16_bit_on_compute_capability_9(rng, d, dv, want):
    plan = _plan(rng, d=d, dv=dv, causal=True)
    assert plan.kernel == "cuda.wgmma", str(plan)
    assert (plan.config.D, plan.config.DV) == want
    from numflash.cuda.wgmma import shared_bytes
    assert shared_bytes(plan.config) <= HOPPER.smem_per_block_optin
    assert "cuda.wgmma" in str(plan)


def test_auto_takes_wgmma_with_modifications_but_not_on_packed_sequences(rng):
    plan = _plan(rng, causal=True, softcap=30.0, alibi_slopes=np.full(16, 0.1, np.float32))
    assert plan.kernel == "cuda.wgmma" and plan.config.MODS, str(plan)
    assert plan.config.BC == 32 and "key tiles: 32 keys with modifications" in str(plan)
    packed = _plan(rng, softcap=30.0, **_packed())
    assert packed.kernel == "cuda.mma", str(packed)
    assert "modifications on packed sequences" in packed.rejected["cuda.wgmma"]


@pytest.mark.parametrize("d", [64, 128])
def test_wgmma_runs_a_block_mask_on_half_width_tiles_and_auto_takes_it_from_d128(rng, d):
    from numflash.cuda.wgmma.tiles import HALF_TILES
    plan = _plan(rng, d=d, block_mask=128, algorithm="wgmma")
    assert plan.kernel == "cuda.wgmma" and plan.config.MODS, str(plan)
    assert (plan.config.NWG, plan.config.BC) == HALF_TILES[d]
    windowed = _plan(rng, d=d, block_mask=256, window_size=(300, 0), algorithm="wgmma")
    assert windowed.kernel == "cuda.wgmma" and windowed.config.WINDOW, str(windowed)
    auto = _plan(rng, d=d, block_mask=128)
    if d == 128:
        assert auto.kernel == "cuda.wgmma" and auto.config == plan.config, str(auto)
    else:
        assert auto.kernel == "cuda.mma", str(auto)
        assert "a block mask at d64 runs on 32-key tiles" in auto.rejected["cuda.wgmma"]


@pytest.mark.parametrize("d", [64, 128])
def test_auto_takes_wgmma_with_a_window_on_the_full_tiles_but_packed_on_half_ones(rng, d):
    from numflash.cuda.wgmma.tiles import HALF_TILES, TILES
    plan = _plan(rng, d=d, causal=True, window_size=(256, 0))
    assert plan.kernel == "cuda.wgmma" and plan.config.WINDOW and not plan.config.MODS, str(plan)
    assert (plan.config.NWG, plan.config.BC) == TILES[d] and "key tiles: " not in str(plan)
    both = _plan(rng, d=d, window_size=(256, 8), softcap=30.0)
    assert both.kernel == "cuda.wgmma" and both.config.WINDOW and both.config.MODS, str(both)
    assert (both.config.NWG, both.config.BC) == HALF_TILES[d]
    packed = _plan(rng, d=d, window_size=(3, 0), **_packed())
    assert packed.kernel == "cuda.wgmma", str(packed)
    assert packed.config.WINDOW and packed.config.VARLEN and not packed.config.MODS
    assert (packed.config.NWG, packed.config.BC) == HALF_TILES[d]
    assert f"key tiles: {HALF_TILES[d][1]} keys with a window on packed sequences" in str(packed)


def test_auto_passes_wgmma_over_where_cuda_mma_splits_the_keys(rng):
    plan = _plan(rng, B=1, H=8, Nq=1, Nk=8192)   # decoding: 8 query blocks for 132 SMs
    assert plan.kernel == "cuda.mma" and plan.config.SPLIT == 1, str(plan)
    assert "'auto' passes it over: 8 query blocks for 132 SMs" in plan.rejected["cuda.wgmma"]
    forced = _plan(rng, B=1, H=8, Nq=1, Nk=8192, algorithm="wgmma")   # asked for, it runs
    assert forced.kernel == "cuda.wgmma"


@pytest.mark.parametrize("device, opts, match", [
    (Device("a100", cc=(8, 0), smem_per_block_optin=163 * 1024), {},
     "needs compute capability >= 9.0 .Hopper's wgmma, sm_90a."),
    (Device("b200", cc=(10, 0), smem_per_block_optin=227 * 1024), {},
     "wgmma runs on compute capability 9.0 only"),
    (HOPPER, {"d": 256}, "cuda.wgmma takes head dims up to 128"),
    (HOPPER, {"d": 59}, "head dim 59 is not a multiple of 8: cuda.mma takes it"),
    (HOPPER, {"strided": True}, "q's last axis is strided"),
    (HOPPER, {"dtype": np.float32}, "cuda.wgmma takes float16, bfloat16, not float32"),
    (HOPPER, {"block_mask": 64}, "cuda.wgmma: the block mask's 64 x 64 blocks are not whole "
     "tiles of the forward .128 queries x 32 keys.: create it with block_size=128"),
    (HOPPER, {"num_splits": 4}, "cuda.wgmma does not split the keys"),
])
def test_wgmma_refuses_with_the_reason_and_auto_takes_another(rng, device, opts, match):
    with pytest.raises(ValueError, match=match):
        _plan(rng, device, algorithm="wgmma", **opts)
    plan = _plan(rng, device, **opts)
    assert plan.kernel != "cuda.wgmma"
    assert re.search(match, plan.rejected["cuda.wgmma"])


def test_the_simulator_never_plans_wgmma(rng):
    q = rng.standard_normal((1, 2, 64, 64)).astype(np.float16)
    with pytest.raises(ValueError, match="inline PTX, which numba's CUDA simulator cannot run"):
        numflash.explain(q, q, q, backend="cuda", algorithm="wgmma")


# ------------------------------------------------------------------------------- the backward

BACKWARD_EMULATED = [  # B, H, Hkv, Nq, Nk, d, dv, causal, NWG, DQ
    pytest.param(1, 2, 1, 150, 200, 64, 64, True, 2, "alternate", id="gqa-causal-d64-alternate"),
    pytest.param(1, 1, 1, 100, 70, 128, 128, "bottom_right", 2, "split",
                 id="rows-without-keys-d128-split"),
    pytest.param(1, 1, 1, 97, 130, 40, 72, "top_left", 2, "split", id="padded-d40-dv72-split32",
                 marks=pytest.mark.extended),
    pytest.param(2, 2, 2, 1, 37, 64, 64, False, 2, "alternate", id="one-query",
                 marks=pytest.mark.extended),
    pytest.param(1, 1, 1, 70, 100, 64, 64, False, 1, "split", id="one-warpgroup",
                 marks=pytest.mark.extended),
    # key blocks no query tile reaches (their dK, dV are zeros), GQA
    pytest.param(1, 2, 1, 64, 300, 64, 64, "top_left", 2, "alternate", id="keys-no-query-sees",
                 marks=pytest.mark.extended),
]


@pytest.mark.parametrize("B, H, Hkv, Nq, Nk, d, dv, causal, NWG, DQ", BACKWARD_EMULATED)
def test_emulated_wgmma_backward_is_accurate(rng, B, H, Hkv, Nq, Nk, d, dv, causal, NWG, DQ):
    """The key pass's generated source under the warp emulator (its wgmma from the swizzled
    tiles, dS^T through shared memory as dQ's MN-major A, the dQ adds): dQ, dK and dV against
    the float64 reference by the accuracy rule, rows that see no key included."""
    from mma_tools import run_wgmma_backward
    from numflash.testing import check_backward
    q, k, v = _inputs(rng, B, H, Hkv, Nq, Nk, d, dv, np.float16)
    do = rng.standard_normal((B, H, Nq, dv)).astype(np.float16)
    o, lse = numflash.reference.attention(q, k, v, causal=causal, return_lse=True)
    offset = Nk - Nq if causal == "bottom_right" else 0
    grads = run_wgmma_backward(do, q, k, v, o.astype(np.float16), lse, bool(causal), offset,
                               NWG=NWG, DQ=DQ)
    rep = check_backward(grads, do, q, k, v, causal=causal)
    assert rep.ok, str(rep)
    if causal == "bottom_right" and Nq > Nk:   # the first Nq - Nk rows see no key
        assert (grads[0][:, :, :Nq - Nk] == 0).all()


@pytest.mark.parametrize("d, causal", [(64, "bottom_right"),
                                       pytest.param(128, True, marks=pytest.mark.extended)])
def test_emulated_wgmma_backward_of_packed_sequences(rng, d, causal):
    """The VARLEN key pass (one launch over packed sequences: one without queries, one without
    keys, Nq != Nk both ways, a sequence of more than one key block, GQA) under the warp
    emulator gives each sequence bit for bit what the plain key pass gives it alone (the
    delta and lse rows being that sequence's), and keys no query sees get zero dK, dV."""
    from mma_tools import run_wgmma_backward
    from numflash.inputs import parse_causal
    from numflash.testing import check_backward
    lens_q, lens_k = [5, 0, 150, 40], [7, 12, 200, 0]
    cq, ck = (np.concatenate([[0], np.cumsum(n)]) for n in (lens_q, lens_k))
    q, k, v = _inputs(rng, 1, 2, 1, cq[-1], ck[-1], d, d, np.float16)
    do = rng.standard_normal(q.shape).astype(np.float16)
    o = np.zeros(q.shape, np.float16)
    lse = np.full((1, 2, cq[-1]), -np.inf, np.float32)
    for b in range(4):   # each sequence's forward from the reference
        s, e, sk, ek = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if e > s and ek > sk:
            ob, lb = numflash.reference.attention(q[:, :, s:e], k[:, :, sk:ek], v[:, :, sk:ek],
                                                  causal=causal, return_lse=True)
            o[:, :, s:e], lse[:, :, s:e] = ob, lb
    grads = run_wgmma_backward(do, q, k, v, o, lse, bool(causal),
                               varlen=(cq, ck, causal == "bottom_right"))
    for b in range(4):
        s, e, sk, ek = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if e == s:
            assert not grads[1][:, :, sk:ek].any() and not grads[2][:, :, sk:ek].any()
            continue
        if ek == sk:
            assert not grads[0][:, :, s:e].any()
            continue
        seq = (do[:, :, s:e], q[:, :, s:e], k[:, :, sk:ek], v[:, :, sk:ek], o[:, :, s:e])
        is_causal, offset = parse_causal(causal, e - s, ek - sk)
        alone = run_wgmma_backward(*seq, lse[:, :, s:e], is_causal, offset)
        for got, want, lo, hi in zip(grads, alone, (s, sk, sk), (e, ek, ek)):
            np.testing.assert_array_equal(got[:, :, lo:hi], want)
        rep = check_backward(alone, *seq[:4], causal=causal)
        assert rep.ok, str(rep)


@pytest.mark.parametrize("name, dtype, d, causal, Hkv, Nq, Nk", [
    ("all-but-window", "float16", 64, "bottom_right", 1, 150, 100),
    # the window (20, 3) with the rest: three key blocks, each skipping the query tiles outside
    # its windows
    ("all-builtins", "float16", 64, False, 1, 200, 260),
    pytest.param("user-document-and-relative-bias", "float16", 128, True, 2, 150, 100,
                 marks=pytest.mark.extended),
    pytest.param("mask-softcap", "bfloat16", 64, False, 1, 150, 100,
                 marks=pytest.mark.extended),
    # a right edge only (a user's softcap beside), top-left causal: rows past Nk's end
    pytest.param("user-tanh-softcap-causal-window", "bfloat16", 64, True, 1, 300, 200,
                 marks=pytest.mark.extended),
    # a window alone (the plain scores)
    pytest.param("sliding-window", "float16", 64, "bottom_right", 2, 260, 400,
                 marks=pytest.mark.extended),
])
def test_emulated_wgmma_backward_with_modifications(rng, name, dtype, d, causal, Hkv, Nq, Nk):
    """cuda.mma's modifications and their derivatives in the wgmma key pass (dP^T waited for
    before the scores are modified, dS^T = P^T (dP^T - delta) times each score's derivative),
    and sliding windows (the key pass's query range clipped): dQ, dK and dV meet the accuracy
    rule against the reference with the same modifications, GQA and rows without keys
    included."""
    from mma_tools import run_wgmma_backward
    from test_mma_mods import _options
    from numflash import mods
    from numflash.inputs import parse_causal
    from numflash.testing import check_backward
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    B, H = 2, 2
    q, k, v = _inputs(rng, B, H, Hkv, Nq, Nk, d, d, dtype)
    do = rng.standard_normal((B, H, Nq, d)).astype(dtype)
    opts = _options(name, B, H, Nq, Nk, rng)
    o, lse = numflash.reference.attention(q, k, v, causal=causal, return_lse=True, **opts)
    is_causal, off = parse_causal(causal, Nq, Nk)
    built = mods.build((B, H, Nq, Nk, d, d), "numpy", off, **opts)
    grads = run_wgmma_backward(do, q, k, v, o.astype(dtype), lse, is_causal, off, mods=built)
    rep = check_backward(grads, do, q, k, v, causal=causal, **opts)
    assert rep.ok, str(rep)


def test_emulated_wgmma_backward_in_bfloat16(rng):
    """bfloat16 shares the source but for the packing of P^T and dS^T: one causal GQA case."""
    from mma_tools import run_wgmma_backward
    from numflash.testing import check_backward
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    q, k, v = _inputs(rng, 1, 2, 1, 100, 90, 64, 64, bf16)
    do = rng.standard_normal((1, 2, 100, 64)).astype(bf16)
    o, lse = numflash.reference.attention(q, k, v, causal="bottom_right", return_lse=True)
    grads = run_wgmma_backward(do, q, k, v, o.astype(bf16), lse, True, 90 - 100)
    rep = check_backward(grads, do, q, k, v, causal="bottom_right")
    assert rep.ok, str(rep)


def _product_order(src):
    """[(kind, name)] of the wgmma issues ("issue", group) and waits ("wait", group, pending)
    in a generated kernel's source, in order (straight-line source: no branch around them)."""
    waits = {"wait_s": ("s", 1), "wait_dp": ("dp", 1), "wait_dp_0": ("dp", 0),
             "wait_dv_2": ("dv", 2),
             "wait_dv_1": ("dv", 1), "wait_dk_1": ("dk", 1), "wait_dk_0": ("dk", 0),
             "wait_dq": ("dq", 0)}
    out = []
    for line in src.splitlines():
        m = re.search(r"= (wgmma_(s|dp|dv|dk|dq)|wait_\w+)\(", line)
        if m and m.group(2):
            out.append(("issue", m.group(2)))
        elif m:
            out.append(("wait",) + waits[m.group(1)])
        elif "cuda.syncthreads()" in line:
            out.append(("barrier",))
    return out


@pytest.mark.parametrize("modified", [False, True])
def test_the_key_pass_waits_for_each_product_before_reading_it_and_before_the_barrier(
        rng, modified):
    """The emulator computes every wgmma at issue, so it cannot see a wait in the wrong place:
    this reads the generated order instead. Each wait_group N must leave the product it passes
    through complete (at most N groups committed after it), and none may be in flight at the
    tile loop's first barrier (the next tile's copies then overwrite the buffers they read).
    With modifications (a softcap) dP^T is waited for before the scores are modified."""
    from numflash.cuda.wgmma.backward import WgmmaBackwardConfig, kernel_source
    cfg = WgmmaBackwardConfig(128, 128, 2, 64, "f16", "split")
    if modified:
        cfg = _backward_plan(rng, d=128, softcap=30.0, algorithm="wgmma").config["keys"]
        assert cfg.MODS and (cfg.D, cfg.DQ) == (128, "split")
    order = _product_order(kernel_source(cfg))
    issued, done = [], set()
    for step in order:
        if step[0] == "issue":
            issued.append(step[1])
        elif step[0] == "wait":
            group, pending = step[1], step[2]
            assert group in issued, step
            assert len(issued) - 1 - issued.index(group) <= pending, (step, issued)
            done.update(issued[:len(issued) - pending])
        elif "dq" not in issued and issued:   # the barrier before dQ's product reads dS^T
            assert {"s", "dp"} <= done, (issued, done)
    assert issued == ["s", "dp", "dv", "dk", "dq"]
    # the tile loop's body ends here: the next tile's first barrier follows, then its copies
    assert set(issued) <= done, (issued, done)


_COMPILE_BACKWARD = """
import json, re, sys
import numpy as np
from numflash.cuda import launch
from numflash.cuda.mma.gradients import signature
from numflash.cuda.wgmma.backward import make_kernel
cfg, mods_name = json.loads(sys.argv[1]), sys.argv[2]
if mods_name:   # test_mma_mods' named modifications, as the token of a 2 x 4 x 128 call
    sys.path.insert(0, sys.argv[3])
    from test_mma_mods import _options
    from numflash import mods
    from numflash.cuda.mma import mods as kernel_mods
    opts = _options(mods_name, 2, 4, 128, 128, np.random.default_rng(0))
    cfg["MODS"] = kernel_mods.token_for(mods.build((2, 4, 128, 128, cfg["D"], cfg["DV"]),
                                                   "numpy", 0, **opts))
dtype = "float16" if cfg["DT"] == "f16" else "bfloat16"
cubin, entry, ptx, res = launch.compile_to_cubin(
    make_kernel(**cfg), signature(dtype, "keys", bool(cfg.get("WINDOW")), cfg.get("MODS", ""),
                                  varlen=bool(cfg.get("VARLEN")), dq_adds=True), (9, 0))
ops = {m: ptx.count(m) for m in set(re.findall(r"wgmma\\.mma_async[\\w.]+", ptx))}
ops.update({op: ptx.count(op) for op in ("ld.local", "st.local", "red.global.add.v4.f32")})
print(json.dumps({"resources": res, "ops": ops,
                  "target": re.search(r"^\\.target \\S+", ptx, re.M).group(0),
                  "serialized": str(res.get("wgmma_serialized", ""))}))
"""


#: spill-store bytes of the packed d128 key pass (this machine's nvJitLink, sm_90a, session 32):
#: unpacked it sits at 254 registers; the sequence's offsets, counts and row views (which
#: kernel parameters give the unpacked pass for free) push it over, as they push cuda.mma's
#: packed d128 key pass (test_mma_backward.PACKED_SPILLS); d64 packed: 249 registers, no spill
VARLEN_SPILLS = 68
#: and of the d128 key pass with all the built-in modifications wgmma takes (session 38: 255
#: registers, 12 bytes stored, 20 loaded); a user's document mask and bias table fit in 254,
#: and at d64 all the built-ins in 252 (the plain d64 pass: 203, one block an SM either way)
MODS_SPILLS = 12


@pytest.mark.parametrize("cfg, mods_name", [
    pytest.param(dict(D=128, DV=128, NWG=2, BC=64, DT="f16", DQ="split"), "",
                 id="f16-d128-split"),
    pytest.param(dict(D=64, DV=64, NWG=2, BC=64, DT="bf16", DQ="alternate"), "",
                 id="bf16-d64-alternate", marks=pytest.mark.extended),
    pytest.param(dict(D=64, DV=128, NWG=2, BC=64, DT="f16", DQ="split"), "", id="f16-d64-dv128",
                 marks=pytest.mark.extended),
    # packed sequences (VARLEN; d128: VARLEN_SPILLS): the sequence's offsets, counts and views
    pytest.param(dict(D=128, DV=128, NWG=2, BC=64, DT="f16", DQ="split", VARLEN=1), "",
                 id="varlen-f16-d128-split", marks=pytest.mark.extended),
    pytest.param(dict(D=64, DV=64, NWG=2, BC=64, DT="f16", DQ="alternate", VARLEN=1), "",
                 id="varlen-f16-d64-alternate", marks=pytest.mark.extended),
    # modifications (test_mma_mods.MODS; d128 with the built-ins: MODS_SPILLS)
    pytest.param(dict(D=64, DV=64, NWG=2, BC=64, DT="f16", DQ="alternate"), "all-but-window",
                 id="mods-f16-d64-alternate"),
    pytest.param(dict(D=128, DV=128, NWG=2, BC=64, DT="f16", DQ="split"), "all-but-window",
                 id="mods-f16-d128-split", marks=pytest.mark.extended),
    pytest.param(dict(D=128, DV=128, NWG=2, BC=64, DT="bf16", DQ="split"),
                 "user-document-and-relative-bias", id="user-mods-bf16-d128-split",
                 marks=pytest.mark.extended),
    # sliding windows: alone, and with the other built-ins (d128: MODS_SPILLS)
    pytest.param(dict(D=64, DV=64, NWG=2, BC=64, DT="f16", DQ="alternate", WINDOW=1), "",
                 id="window-f16-d64-alternate", marks=pytest.mark.extended),
    pytest.param(dict(D=128, DV=128, NWG=2, BC=64, DT="f16", DQ="split", WINDOW=1),
                 "all-builtins", id="window-mods-f16-d128-split", marks=pytest.mark.extended),
])
def test_wgmma_backward_compiles_for_sm90a_without_spills_or_serialization(cfg, mods_name):
    """ptxas fits the key pass in 255 registers a thread with nothing in local memory (but the
    spills VARLEN_SPILLS and MODS_SPILLS measured), and serializes none of its wgmma: each
    product appears once, at its k-steps' count."""
    import json
    import os
    import subprocess
    import sys
    from mma_tools import ROOT
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _COMPILE_BACKWARD, json.dumps(cfg), mods_name,
                          str(ROOT / "tests")], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["target"] == ".target sm_90a"
    from numflash.cuda.wgmma.backward import WgmmaBackwardConfig
    c = WgmmaBackwardConfig(**cfg)
    kind = cfg["DT"]
    want = {}
    for n, steps in ((c.BC, c.D // 16), (c.BC, c.DV // 16), (c.DV, c.BC // 16),
                     (c.D, c.BC // 16), (c.dq_columns, c.BR // 16)):
        op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind}"
        want[op] = want.get(op, 0) + steps
    assert {op: n for op, n in got["ops"].items() if op.startswith("wgmma")} == want, got["ops"]
    assert got["ops"]["red.global.add.v4.f32"] > 0
    assert not got["serialized"], "ptxas serializes the wgmma (C7509): " + got["serialized"]
    res = got["resources"]
    if cfg["D"] == 128 and (cfg.get("VARLEN") or mods_name in ("all-but-window",
                                                               "all-builtins")):
        assert res.get("spill_store_bytes", 0) <= (
            VARLEN_SPILLS if cfg.get("VARLEN") else MODS_SPILLS), res
        return
    assert got["ops"]["ld.local"] == 0 and got["ops"]["st.local"] == 0
    assert res.get("spill_store_bytes", 0) == 0 and res.get("stack_bytes", 0) == 0, res


def _backward_plan(rng, device=HOPPER, algorithm="auto", **opts):
    from numflash import plan as planner
    return planner._choose(_backward_problem(rng, **opts), "cuda", algorithm, device)


def _backward_problem(rng, dtype=np.float16, B=4, H=16, Hkv=None, Nq=4096, Nk=4096, d=64,
                      dv=None, **opts):
    """A normalized backward problem on zero arrays that plans as CuPy arrays would."""
    from mma_tools import DeviceView
    from numflash.api import _with_mods
    from numflash.inputs import normalize_backward
    mods = {name: opts.pop(name) for name in ("softcap", "window_size") if name in opts}
    strided = opts.pop("strided", False)
    q, k, v = (np.zeros((B, h, n, w), dtype) for h, n, w in
               ((H, Nq, d), (Hkv or H, Nk, d), (Hkv or H, Nk, dv or d)))
    if strided:
        q = np.repeat(q, 2, axis=-1)[..., ::2]
    do, o = np.zeros((B, H, Nq, dv or d), dtype), np.zeros((B, H, Nq, dv or d), dtype)
    lse = np.zeros((B, H, Nq), np.float32)
    p = _with_mods(normalize_backward(do, q, k, v, o, lse, **opts), mods)
    views = {name: DeviceView(getattr(p, name)) for name in ("q", "k", "v", "do", "o", "lse",
                                                             "dq", "dk", "dv")}
    return dataclasses.replace(p, kind="cupy", **views)


@pytest.mark.parametrize("d, dv, want", [(64, 64, (64, 64, "alternate")),
                                         (128, 128, (128, 128, "split")),
                                         (40, 72, (64, 128, "split"))])
def test_auto_takes_the_wgmma_backward_for_16_bit_on_compute_capability_9(rng, d, dv, want):
    plan = _backward_plan(rng, d=d, dv=dv, causal=True)
    assert plan.kernel == "cuda.wgmma" and plan.direction == "backward", str(plan)
    keys = plan.config["keys"]
    assert (keys.D, keys.DV, keys.DQ) == want
    assert plan.config["queries"].DQADD == "red4"   # cuda.mma's delta pass
    from numflash.cuda.wgmma.backward import shared_bytes
    assert shared_bytes(keys) <= HOPPER.smem_per_block_optin
    assert "adds it into a float32 accumulator" in str(plan)


def test_auto_takes_wgmma_for_packed_sequences(rng):
    """Packed 16-bit sequences on compute capability 9.0: cuda.wgmma's VARLEN forward, and its
    VARLEN key pass after cuda.mma's VARLEN delta pass, explain saying so; with a forced split
    each refuses, naming the reason, as cuda.mma does."""
    from numflash import plan as planner
    from numflash.varlen import Packed
    packing = Packed(np.array([0, 5, 45]), np.array([0, 7, 10]), 40, 7, True)
    forward = _plan(rng, B=1, H=4, Nq=45, Nk=10, causal="bottom_right", varlen=packing)
    assert forward.kernel == "cuda.wgmma" and forward.config.VARLEN, str(forward)
    assert "packed sequences: 2 in one launch" in str(forward)
    with pytest.raises(ValueError, match="does not split the keys"):
        _plan(rng, B=1, H=4, Nq=45, Nk=10, causal="bottom_right", varlen=packing,
              algorithm="wgmma", num_splits=4)
    p = _backward_problem(rng, B=1, H=4, Hkv=2, Nq=45, Nk=10, causal="bottom_right")
    p.varlen = Packed(np.array([0, 5, 45]), np.array([0, 7, 10]), 40, 7, True)
    plan = planner._choose(p, "cuda", "auto", HOPPER)
    assert plan.kernel == "cuda.wgmma", str(plan)
    assert plan.config["keys"].VARLEN and plan.config["queries"].VARLEN
    assert "packed sequences: 2 in one launch per pass" in str(plan)
    p.num_splits = 4
    with pytest.raises(ValueError, match="does not split the keys"):
        planner._choose(p, "cuda", "wgmma", HOPPER)


@pytest.mark.parametrize("opts", [dict(softcap=30.0), dict(window_size=(64, 0)),
                                  dict(softcap=30.0, window_size=(64, 0))])
def test_the_wgmma_backward_takes_modifications_forced_and_under_auto(rng, opts):
    """Windows and modifications compile into both passes; "auto" takes cuda.wgmma for them
    (faster than cuda.mma in every row timed on the H200, bench/NOTES.md session 39); packed
    sequences with them are refused."""
    from numflash import plan as planner
    from numflash.varlen import Packed
    token = "score:softcap_score/softcap_grad[f,f]" if "softcap" in opts else ""
    window = int("window_size" in opts)
    for algorithm in ("wgmma", "auto"):
        plan = _backward_plan(rng, causal=True, algorithm=algorithm, **opts)
        assert plan.kernel == "cuda.wgmma", str(plan)
        assert plan.config["keys"].MODS == plan.config["queries"].MODS == token
        assert plan.config["keys"].WINDOW == plan.config["queries"].WINDOW == window
    p = _backward_problem(rng, B=1, H=4, Nq=45, Nk=10, causal="bottom_right", **opts)
    p.varlen = Packed(np.array([0, 5, 45]), np.array([0, 7, 10]), 40, 7, True)
    with pytest.raises(ValueError, match="no window or other modification on packed sequences"):
        planner._choose(p, "cuda", "wgmma", HOPPER)


@pytest.mark.parametrize("device, opts, match", [
    (Device("a100", cc=(8, 0), smem_per_block_optin=163 * 1024), {},
     "needs compute capability >= 9.0 .Hopper's wgmma, sm_90a."),
    (Device("b200", cc=(10, 0), smem_per_block_optin=227 * 1024), {},
     "wgmma runs on compute capability 9.0 only"),
    (HOPPER, {"strided": True}, "16-byte cp.async, and q's last axis is strided"),
    (HOPPER, {"deterministic": True}, "deterministic=True takes cuda.mma's two passes"),
    (HOPPER, {"grad_dtype": "float32"}, "grad_dtype float32 takes cuda.mma's backward"),
    (HOPPER, {"d": 256}, "cuda.wgmma takes head dims up to 128"),
    (HOPPER, {"dtype": np.float32}, "cuda.wgmma takes float16, bfloat16, not float32"),
])
def test_the_wgmma_backward_refuses_with_the_reason_and_auto_takes_another(rng, device, opts,
                                                                         match):
    with pytest.raises(ValueError, match=match):
        _backward_plan(rng, device, algorithm="wgmma", **dict(opts))
    plan = _backward_plan(rng, device, **dict(opts))
    assert plan.kernel == ("cuda.row" if "strided" in opts else "cuda.mma"), str(plan)
    assert re.search(match, plan.rejected["cuda.wgmma"])
