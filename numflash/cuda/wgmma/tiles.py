"""The wgmma forward's compile-time config, its tiles and its shared memory."""
from collections import namedtuple
from dataclasses import dataclass

from ..config import TileConfig

NAME = "cuda.wgmma"
#: head dims are zero-padded up to the next of these
HEAD_DIMS = (64, 128)


def check_hopper(device, instead):
    """Raise Unsupported unless ``device`` is compute capability 9.0 (or not known yet), naming
    what runs the call ``instead``."""
    from ...device import Unsupported
    if device.cc is not None and tuple(device.cc) != (9, 0):
        raise Unsupported(f"{NAME}: wgmma runs on compute capability 9.0 only (sm_90a: H100, "
                          f"H200, GH200); {device.name} is {device.cc[0]}.{device.cc[1]}: "
                          f"{instead} runs it")


def head_dim_pad(n):
    """The padded head dim of ``n`` (<= 128: the operator declares the limit)."""
    return next(size for size in HEAD_DIMS if n <= size)


#: the swizzled layout (numflash.cuda.ptx_wgmma): rows of 128 bytes (64 16-bit elements), 8 of
#: them a 1024-byte atom
SWIZZLE = 128
ATOM = 8 * SWIZZLE


def region_bytes(rows, width):
    """Bytes of a rows x width tile of 16-bit elements: width / 64 column slabs of rows x 128
    bytes."""
    return rows * width * 2


class Warpgroups:
    """What a wgmma kernel's config derives from NWG (warpgroups a block, 64 rows each) and DT:
    its warps, rows, threads and the 16-bit pack function of its generated source."""

    @property
    def NW(self):
        return 4 * self.NWG

    @property
    def BR(self):
        return 64 * self.NWG

    @property
    def NT(self):
        return 128 * self.NWG

    @property
    def pack(self):
        """The generated source's f32 pair -> packed 16-bit pair function."""
        return f"pack_{self.DT}x2"


@dataclass(frozen=True)
class WgmmaConfig(Warpgroups, TileConfig):
    """One compile-time variant of the wgmma forward.

    D, DV: padded head dims of q / k and v. NWG warpgroups a block, each owning 64 query rows
    (BR = 64 NWG, NT = 128 NWG threads); BC keys a K/V tile (the N of S = Q K^T's wgmma and the
    contraction of P V's). DT: "f16" or "bf16". VARLEN: packed sequences in one launch
    (cuda.mma's VARLEN: grid y walks the sequences' heads, each block finds its sequence's rows
    in cu_q / cu_k and views them). MODS: score / mask modifications, cuda.mma's token and
    device functions (cuda.mma.mods), applied to each tile's S registers. WINDOW: a sliding
    window's key range per row (cuda.mma's WINDOW: its two sizes are run-time arguments; the
    tiles outside a block's rows' ranges are not loaded, a warpgroup's not computed)."""
    D: int
    DV: int
    NWG: int
    BC: int
    DT: str
    VARLEN: int = 0
    MODS: str = ""
    WINDOW: int = 0


#: Shared memory in bytes: the Q tile (kept: wgmma reads it from shared memory every tile), one
#: K + V buffer (three rotate), the whole block with the padding that aligns the tiles to 1024
#: bytes.
SharedLayout = namedtuple("SharedLayout", "q_bytes kv_bytes total")


def layout(cfg):
    q_bytes = region_bytes(cfg.BR, cfg.D)
    kv_bytes = region_bytes(cfg.BC, cfg.D) + region_bytes(cfg.BC, cfg.DV)
    return SharedLayout(q_bytes, kv_bytes, ATOM + q_bytes + 3 * kv_bytes)


def shared_bytes(cfg):
    return layout(cfg).total


#: (NWG, BC) by the larger padded head dim, from the H100 sweeps (bench/NOTES.md, "cuda.wgmma"):
#: one warpgroup a block (NWG=1) ran 1.3-1.6x slower than two in the no-swizzle layout. d64 takes
#: 64-key tiles: 124 registers a thread (167 with BC=128) let two 8-warp blocks share an SM, and
#: each block's barriers then stall only its own warpgroups (1.08x median over 10 shapes). d128
#: with BC=128 fills 226 of the 227 KB a block may use.
TILES = {64: (2, 64), 128: (2, 128)}
#: with modifications: half the keys a tile. Their indices and arguments live beside S and the
#: P in flight; on the full tiles ptxas spilled (sm_90a: ALiBi at d64 20 bytes under the cap,
#: an attn_bias at d128 116 bytes), on these it does not (tests/test_wgmma.py). A window on
#: packed sequences takes them too: at d64 the full tile spilled 16 bytes under the cap (123
#: registers on the half one; a window alone fits the full tile in 128)
HALF_TILES = {64: (2, 32), 128: (2, 64)}
#: blocks an SM each padded head dim's tile is sized for (65536 registers an SM)
BLOCKS_PER_SM = {64: 2, 128: 1}


def blocks_per_sm(cfg):
    """Blocks an SM ``cfg``'s forward is sized for: BLOCKS_PER_SM, but one for a block mask with
    other modifications at d64. Their walk (the list, its block and sub-tile counters, the next
    entry) and the other modifications' arguments took 168 registers uncapped, and at the
    128-register cap ptxas spilled 196 bytes (sm_90a, document block mask + ALiBi); a block mask
    alone fits in 128."""
    from ..mma import mods
    D = max(cfg.D, cfg.DV)
    if D == 64 and mods.sparse(cfg.MODS) and mods.composition(cfg.MODS).dense:
        return 1
    return BLOCKS_PER_SM[D]


def register_cap(cfg):
    """The registers a thread of ``cfg``'s forward may use (ptxas's .maxnreg), or None: packed
    sequences (VARLEN) keep their counts and offsets in registers, 139 a thread at d64 where the
    unpacked kernel takes 124 (ptxas sm_90a, bench/NOTES.md), which would leave one block an SM
    instead of the two the tile is sized for; capped at 128 it fits in 126 without a spill
    (tests/test_wgmma.py checks both). Modifications (MODS) and windows (WINDOW) are capped
    alike: their arguments, each score's indices and the window's row bounds live through the
    loop too (a window alone took 140 at d64)."""
    cap = 65536 // (cfg.NT * blocks_per_sm(cfg))
    return cap if (cfg.VARLEN or cfg.MODS or cfg.WINDOW) and cap < 255 else None
