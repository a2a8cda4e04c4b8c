"""cuda.wgmma: the forward on Hopper's warpgroup matrix products (wgmma, sm_90a), float16 and
bfloat16, head dims that are multiples of 8 up to 128 (zero-padded to 64 or 128), causal in
both alignments, GQA, packed sequences in one launch (attention_varlen: VARLEN, as cuda.mma
runs them), sliding windows (WINDOW: cuda.mma's row bounds; a warpgroup computes only the key
tiles its rows' windows reach), block masks (cuda.mma's walk over each block row's listed
blocks; "auto" leaves those at d64 to cuda.mma: auto_passes), score / mask
modifications (cuda.mma's composition, applied to each tile's S registers, on half-width key
tiles: HALF_TILES). The
kernel (forward.py) is generated as Python source per config from cuda.mma's pieces (row
bounds, masking, modifications, online softmax, epilogue); the products and their descriptors
are ptx_wgmma's. "auto" takes it for a 16-bit forward on compute capability 9.0 wherever it
runs, but for unpacked calls whose query blocks do not fill the GPU (auto_passes).

The backward's key pass (backward.py, the operator in gradients.py) is FlashAttention-3's
backward loop on the same products, after cuda.mma's delta pass, with dQ added into a float32
accumulator; windows and modifications but a block mask too (gradients.py).

Not yet here (explain says so, and cuda.mma runs them): modifications of packed
sequences but a window (in the backward not even that), dropout, split-KV, KV caches,
strided or misaligned rows, odd head dims, head dims past 128, a deterministic backward. wgmma
exists on compute capability 9.0 only: not on 8.x, and not on 10.x / 12.x.
"""
import math

from ...device import Unsupported
from .forward import kernel_source, make_kernel
from .tiles import (HEAD_DIMS, HALF_TILES, NAME, TILES, WgmmaConfig, check_hopper,
                    head_dim_pad, shared_bytes)

__all__ = ["NAME", "HEAD_DIMS", "WgmmaConfig", "config", "auto_passes", "run", "compiled_kernels",
           "notes", "kernel_source", "make_kernel", "shared_bytes"]

def config(problem, device):
    """The WgmmaConfig for ``problem`` on ``device`` (what the operator's declarations admit);
    raises Unsupported saying why not."""
    from ..mma.config import (check_block_tiles, check_packed, modifications, padded_dims,
                              vector_ok)
    check_hopper(device, "cuda.mma")
    B, H, Nq, Nk, d, dv = problem.shape
    window = padded_dims(problem)[2]   # (and refuses query heads that do not divide)
    if not problem.on_device or vector_ok(problem) is not None:
        raise Unsupported(f"{NAME} stages rows with 16-byte cp.async only, and "
                          f"{vector_ok(problem) if problem.on_device else 'these are not device arrays'}"
                          f": cuda.mma takes it")
    D, DV = head_dim_pad(d), head_dim_pad(dv)
    packed = int(getattr(problem, "varlen", None) is not None)
    token = modifications(problem)
    # half-width key tiles where the full ones spill (tiles.py)
    NWG, BC = (HALF_TILES if token or (packed and window) else TILES)[max(D, DV)]
    if packed:
        check_packed(problem, NAME)
        if token:
            raise Unsupported(f"{NAME} does not take modifications on packed sequences yet "
                              f"({problem.mods}): cuda.mma does")
    cfg = WgmmaConfig(D, DV, NWG, BC, "bf16" if problem.dtype_name == "bfloat16" else "f16",
                      VARLEN=packed, MODS=token, WINDOW=int(window))
    check_block_tiles(problem, ((cfg.BR, cfg.BC, "forward"),), NAME)
    need = shared_bytes(cfg)
    if device.smem_per_block_optin is not None and need > device.smem_per_block_optin:
        raise Unsupported(f"{NAME}: needs {need} bytes of shared memory for d={d}, dv={dv}, more "
                          f"than the {device.smem_per_block_optin} a block may use on "
                          f"{device.name}")
    return cfg


def auto_passes(problem, device):
    """Why "auto" should take cuda.mma although this kernel runs the problem, or None: a block
    mask at head dims up to 64, or a call whose query blocks do not fill the GPU (decoding,
    short queries), which cuda.mma splits over more blocks (split-KV) where this kernel would
    leave SMs idle. The split rule is not timed against this kernel at those shapes; the block
    mask's is (bench/NOTES.md, session 38). Never for packed sequences: cuda.mma does not split
    theirs."""
    B, H, Nq, Nk, d, dv = problem.shape
    pad = head_dim_pad(max(d, dv))
    if getattr(getattr(problem, "mods", None), "block", None) is not None and pad == 64:
        return ("a block mask at d64 runs on 32-key tiles here, no faster than cuda.mma on the "
                "H200 (0.92-1.14x its time in three runs, bench/NOTES.md): algorithm='wgmma' "
                "runs it")
    if device.sm_count is None or getattr(problem, "num_splits", None) is not None or \
            getattr(problem, "varlen", None) is not None:
        return None
    NWG = TILES[pad][0]
    blocks = -(-Nq // (64 * NWG)) * B * H
    if blocks >= device.sm_count:
        return None
    return (f"{blocks} query blocks for {device.sm_count} SMs: cuda.mma splits the keys over "
            f"more blocks (split-KV)")


def compiled_kernels(cfg, dtype):
    """[(Kernel, numba argument types)] that run() launches (cuda.mma's argument list)."""
    from .. import launch
    from ..mma import signature
    return [(launch.get_kernel(NAME, make_kernel, cfg),
             signature(dtype, bool(cfg.WINDOW), cfg.MODS, varlen=bool(cfg.VARLEN)))]


def run(problem, cfg, device):
    """Launch; returns lse."""
    from ...mods import compile_errors
    from ..mma import _as_bits as bits, mods, no_debug_dump
    p = problem
    B, H, Nq, Nk, d, dv = p.shape
    kernel = compiled_kernels(cfg, p.dtype_name)[0][0]
    lse = p.empty_lse()
    grid, causal_offset, packed = (-(-Nq // cfg.BR), B * H), int(p.causal_offset), ()
    window = tuple(int(w) for w in p.mods.window) if cfg.WINDOW else ()
    if cfg.VARLEN:   # the alignment in causal_offset's place, then cu_q, cu_k
        grid = p.varlen.grid(cfg.BR, H)
        causal_offset, packed = p.varlen.arguments()
    with compile_errors(p.mods, NAME):
        kernel(grid, (cfg.NT,), shared_bytes(cfg),
               (bits(p.q), bits(p.k), bits(p.v), bits(p.out), lse, no_debug_dump(p.q.device.id),
                float(p.scale * math.log2(math.e)), float(p.scale), int(p.causal),
                causal_offset) + window + packed + (mods.arguments(p.mods) if cfg.MODS else ()),
               device)
    return lse


def notes(problem, cfg, device):
    """What explain adds about this config: packed sequences' one launch; the half-width key
    tiles of a modified call or a window on packed sequences."""
    from ..mma import packed_note
    out = [packed_note(problem, cfg.BR)] if cfg.VARLEN else []
    if cfg.BC < TILES[max(cfg.D, cfg.DV)][1]:
        what = "modifications" if cfg.MODS else "a window on packed sequences"
        out.append(f"key tiles: {cfg.BC} keys with {what} (half the plain kernel's, on which "
                   f"ptxas spills their indices and arguments)")
    return out
