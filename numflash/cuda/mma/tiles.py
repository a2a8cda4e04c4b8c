"""Tile configurations of the tensor-core kernels: the frozen config every piece reads, the tile
tables (chosen by measurement, cited below), and the shared memory a config occupies."""
from dataclasses import dataclass

from ...device import Unsupported
from ..config import TileConfig

NAME = "cuda.mma"
#: head dims are zero-padded up to the next of these
HEAD_DIMS = (32, 64, 96, 128, 256)


def head_dim_pad(n):
    for size in HEAD_DIMS:
        if n <= size:
            return size
    raise Unsupported(f"{NAME} takes head dims up to {HEAD_DIMS[-1]}; got {n}")


@dataclass(frozen=True)
class MmaConfig(TileConfig):
    """One compile-time variant of a tensor-core kernel.

    D, DV: padded head dims of q/k and v. NW warps a block, each owning 16 query rows (BR = 16 NW
    rows, NT = 32 NW threads); BC keys a K/V tile. HOLDQ: Q's A fragments stay in registers (K/V
    then reuse Q's shared memory). DT: the operand kind ("f16", "bf16", "tf32", "3xtf32", "f64").
    VEC: 16-byte cp.async staging with double-buffered K/V (else scalar loads). MMA: float64's
    instruction ("m16n8k8" on sm_90, "m8n8k4" on sm_80). DBG: dump key tile 0's masked scores.
    WINDOW: a sliding window's key range per row (its two sizes are run-time arguments), the key
    tiles outside every row's range of a block skipped. SUB: the backward's key pass takes its
    staged tile of BC queries SUB at a time (0: all BC at once). MODS: the score / mask
    modifications computed score by score (mods.py's token; "" for none). SPLIT: the forward
    splits each block's key range over gridDim.z blocks (split-KV), each writing its rows'
    normalized partial O and lse in float32 (float64 for float64) for cuda.merge to combine.
    KVLEN: the keys of batch entry b are the first kv_lens[b] rows (a KV cache), the causal and
    window alignment bottom-right per entry. PAGE: K and V rows come through block_table (a paged
    cache of PAGE rows a page; k, v are views of all pages' rows). CHUNKS: the backward splits
    the gradients' head-dim columns into CHUNKS slices over gridDim.z, each block recomputing S
    and dP for its slice (past 128 columns, float64 64: what one block's registers hold).
    VARLEN: packed sequences (flash-attn's varlen layout) in one launch: q, k, v, out (dq, dk,
    dv) are (1, heads, total rows, .) views, and grid y's "batch" index b is the sequence, whose
    rows are cu_q[b] ... cu_q[b + 1] (keys: cu_k); blocks past their sequence's rows return at
    once. The run-time causal_offset argument then says the alignment (0: top-left, else
    bottom-right per sequence), and lse / delta are (1, heads, total query rows). GRAD32: the
    16-bit backward writes dQ, dK, dV in float32 as accumulated (attention_backward's
    grad_dtype), not rounded to 16 bits. DROP: attention dropout (dropout.py), its seed,
    threshold and scale run-time arguments. DBIAS: the backward's key pass also adds each
    pair's dS (through the score mods after attn_bias) into attn_bias's gradient, an
    accumulator broadcast like the bias: "store" (float32, a full bias: one write an element),
    "f32" or "f64" (atomic adds of that float type). DQADD: dQ by adds (FlashAttention-2's
    default): the key pass also multiplies its dS by K and adds the products into a float32
    dQ accumulator ("red4": red.global.add.v4.f32, sm_90), and the query pass computes delta
    only; "" (the two-pass form) keeps dQ in the query pass, bit-for-bit reproducible.
    MARGS: the key pass also adds each pair's dS, times score_mod_args_grad's derivative, into
    float64 accumulators of the trained mod_args arrays (mods.py's arg_grad_token; "" none).

    The fields D, DV, BR (derived), BC, NT (derived), HOLDQ and DT follow cuda.config's naming
    scheme shared with the SIMT kernels; the mapping (cuda.config.TileConfig) leaves out MMA,
    DBG, WINDOW, SUB, MODS, SPLIT, KVLEN, PAGE, CHUNKS, VARLEN, GRAD32, DROP, DBIAS, DQADD
    and MARGS while unset.
    """
    D: int
    DV: int
    NW: int
    BC: int
    HOLDQ: int
    DT: str
    VEC: int
    MMA: str = None
    DBG: int = 0
    WINDOW: int = 0
    SUB: int = 0
    MODS: str = ""
    SPLIT: int = 0
    KVLEN: int = 0
    PAGE: int = 0
    CHUNKS: int = 0
    VARLEN: int = 0
    GRAD32: int = 0
    DROP: int = 0
    DBIAS: str = ""
    DQADD: str = ""
    MARGS: str = ""

    @property
    def BR(self):
        return 16 * self.NW

    @property
    def NT(self):
        return 32 * self.NW


def shared_bytes(cfg):
    """Dynamic shared memory of a config (an MmaConfig or a mapping of its fields), in bytes."""
    from .operands import operands_for
    ops = operands_for(cfg if isinstance(cfg, MmaConfig) else MmaConfig(**cfg))
    return ops.word_bytes * ops.lay.total


#: float64 tiles (NW, BC, HOLDQ) by largest head dim, fastest first, from the f64 tile sweep on an
#: H200 (B4 H16 N4096: d=64 9.8 / 10.5 ms, d=128 18.3 / 29.2 ms; bench/NOTES.md); the second is
#: for less shared memory (d=64: the 99 KB a block gets on sm_86/89). A float64 fragment takes two
#: registers per value, so ~250 registers a thread allow one 8-warp block per SM: 8 warps share
#: each K/V tile.
F64_TILES = {64: ((8, 64, 0), (8, 32, 1)), 128: ((8, 16, 0), (4, 16, 0))}
#: Where 3xTF32 can beat the FMA units: tf32 mma.sync at >= 8x the fp32 FMA rate on the A100 /
#: H100 class (timed on the H100 only); on sm_86 / 89 / 12x tf32 tensor cores run at about the
#: FMA rate, so three mma per product lose.
X3_CCS = ((8, 0), (9, 0))


def _first_that_fits(tiles, D, DV, DT, VEC, smem_limit):
    """The first (NW, BC, HOLDQ) of ``tiles`` whose shared memory fits ``smem_limit``; else the
    last, which config() then refuses, naming the shared memory it needs."""
    for NW, BC, HOLDQ in tiles:
        need = shared_bytes(MmaConfig(D, DV, NW, BC, HOLDQ, DT, VEC))
        if smem_limit is None or need <= smem_limit:
            return NW, BC, HOLDQ
    return tiles[-1]


def _x3_tiles(D, DV, cc):
    """3xTF32 tiles, widest first. Timed on the H100 (x3 tile sweep, B4 H16 N4096): d=64
    (8, 64, 0) 6.05 ms, d=128 (8, 64, 0) 11.86 ms, (8, 32, 0) 13.42 ms. 8 warps share each K/V
    tile; Q is re-read from shared memory (held, its hi / lo halves would take D/2 more
    registers). Each thread holds O (DV/2), S (2 x BC/2) and the split P (BC) in registers, so the
    wide tile is kept to head dims where ptxas fits it in 255 with no spill (checked by the
    compile tests): BC=64 spills 12-24 bytes at d=96 or DV > D on sm_90, BC=32 at d=96 / dv=128
    on sm_90, and on sm_80 ptxas needs more registers than on sm_90 for the same source (BC=32
    spills at dv=128 there; BC=16 does not). d=128 (8, 64, 0) also needs the 202 KB of sm_90."""
    tiles = []
    if max(D, DV) <= 64 or D == DV == 128:
        tiles.append((8, 64, 0))
    wide_v = DV == 128 and (D != DV or (cc is not None and cc < (9, 0)))
    tiles.append((8, 16, 0) if wide_v else (8, 32, 0))
    return tiles


#: A sliding window (WINDOW=1) keeps a few more integers live through the tile loop; this tile,
#: register-tight without one, spills with it (ptxas on sm_90, session 10), so a windowed call
#: takes the next one: 3xTF32 d=128 (8, 32, 0) compiles spill-free with a window. (float64 at
#: d=128 spills 52 bytes with either of its tiles: config() refuses that window.)
WINDOW_SPILLS = {("3xtf32", 128): (8, 64, 0)}
#: Score modifications (MODS) keep their arguments and each score's indices live too, so with
#: modifications these tiles replace the usual ones, by (kind, largest padded head dim, sm_90 or
#: not). From the compile sweep with every built-in compiled in (ptxas, session 12,
#: bench/NOTES.md "cuda.mma with modifications"): spill-free on sm_90; on sm_80, where ptxas
#: needs more registers for the same source, the 16-bit tiles are the least-spilling ones found
#: (d64 56 bytes, d128 80 bytes, against 256 / 1460 with Q held) and float64 spills 152 bytes.
MODS_TILES = {("3xtf32", 64, False): ((8, 32, 0),), ("3xtf32", 128, True): ((8, 32, 0),),
              ("f64", 64, True): ((8, 32, 0),), ("f64", 64, False): ((8, 16, 0),),
              ("16-bit", 64, False): ((4, 64, 0),), ("16-bit", 128, False): ((4, 32, 0),)}


def choose_tile(D, DV, DT=None, smem_limit=None, VEC=0, cc=None, window=False, mods=False):
    """(NW, BC, HOLDQ) for padded head dims, chosen for registers: O (DV/2 floats), S (BC/2) and,
    when HOLDQ, Q (D/4 words; tf32: D/2) per thread. float64 takes the first of F64_TILES whose
    shared memory fits smem_limit (sm_80 allows 163 KB a block, sm_86/89 99 KB); 3xTF32 the first
    of ``_x3_tiles``, which also depend on the compute capability ``cc``; with a ``window``
    never one of WINDOW_SPILLS; with ``mods`` one of MODS_TILES where it names some."""
    if mods:
        kind = "16-bit" if DT in ("f16", "bf16", None) else DT
        size = 64 if max(D, DV) <= 64 else 128
        tiles = MODS_TILES.get((kind, size, cc is None or cc >= (9, 0)))
        if tiles:
            return _first_that_fits(tiles, D, DV, DT or "f16", VEC, smem_limit)

    def usable(tiles):
        spills = WINDOW_SPILLS.get((DT, max(D, DV))) if window else None
        return [tile for tile in tiles if tile != spills] or tiles
    if DT == "tf32":
        return (4, 64, 1) if max(D, DV) <= 64 else (4, 64, 0)
    if DT == "3xtf32":
        return _first_that_fits(usable(_x3_tiles(D, DV, cc)), D, DV, DT, 1, smem_limit)
    if DT == "f64":
        return _first_that_fits(usable(F64_TILES[64 if max(D, DV) <= 64 else 128]), D, DV, DT,
                                VEC, smem_limit)
    if max(D, DV) <= 128:
        return 4, 64, 1
    return 4, 32, 0
