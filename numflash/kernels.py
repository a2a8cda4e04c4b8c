"""Every kernel numflash has, as an operator that declares what it supports (like xformers' fmha
operators): dtypes, head dims, compute capability, simulator, tf32, modifications, direction.

The planner (plan.py) walks FORWARD or BACKWARD in order -- for "auto" the first operator of the
backend that takes the problem wins -- and asks each why it cannot take a problem before its
module is imported or anything compiled, so ``explain`` can give every reason in words. An
operator's ``config`` checks those declarations first, then asks its kernel module for the tile
config (which refuses only for kernel-specific reasons: shared memory, layouts). A kernel module
provides config(problem, device), run(problem, config, device) and, on CUDA,
compiled_kernels(config, dtype). Adding a kernel is one module plus its entry here.

The modules load on first use: the CUDA ones need numba-cuda, which a CPU-only install lacks.
"""
from dataclasses import dataclass

from .device import Unsupported
from .inputs import IEEE_REASON


@dataclass(frozen=True)
class Operator:
    name: str
    backend: str
    algorithm: str
    load: object                      # () -> the kernel module, imported on first use
    dtypes: tuple
    direction: str = "forward"        # "backward": run() fills problem.dq, dk, dv
    max_head_dim: int = None          # for both d and dv
    min_cc: tuple = None
    min_cc_why: str = ""              # what the kernel uses that older GPUs lack
    runs_in_simulator: bool = True
    tf32: bool = False                # float32 on tensor cores: 3xTF32, or one tf32 mma per
    #                                   product with precision="tf32"; not precision="ieee"
    mods: object = ()                 # the modification kinds it takes (numflash.mods.Mods
    #                                   kinds, e.g. ("window_size",)), or "all"
    splits: bool = False              # splits the keys over blocks (num_splits > 1)
    kvcache: bool = False             # reads a KV cache in one launch (attention_with_kvcache)
    varlen: bool = False              # runs packed sequences in one launch (attention_varlen)
    dropout: bool = False             # attention dropout (dropout_p > 0, numflash.dropout)
    bias_grad: bool = False           # the backward returns attn_bias's gradient
    mod_args_grad: bool = False       # the backward returns trainable mod_args' gradients
    auto_passes: object = None        # (problem, device) -> why "auto" takes the next operator
    #                                   although this one runs the problem (where it is the
    #                                   slower), or None
    summary: str = ""

    @property
    def module(self):
        return self.load()

    def why_not(self, problem, device):
        """None if the declarations admit the problem on the device, else the reason in words."""
        dt = problem.dtype_name
        mods = getattr(problem, "mods", None)
        refused = [] if mods is None or self.mods == "all" else sorted(mods.kinds - set(self.mods))
        if refused and not self.mods:
            return (f"{self.name} does not take score/mask modifications yet ({mods}); the CPU "
                    f"path (cpu.tiled, NumPy arrays) does")
        if refused:
            return (f"{self.name} takes {', '.join(self.mods)} of the modifications, not "
                    f"{', '.join(refused)}; the CPU path (cpu.tiled, NumPy arrays) takes them all")
        if getattr(problem, "dropout", None) is not None and not self.dropout:
            return (f"{self.name} has no dropout ({problem.dropout}); the CPU path (cpu.tiled) "
                    f"and cuda.mma (CuPy arrays, compute capability >= 8.0) take it")
        if getattr(problem, "dbias", None) is not None and not self.bias_grad:
            return (f"{self.name} does not compute attn_bias's gradient; the CPU path (cpu.tiled) "
                    f"and cuda.mma (CuPy arrays, compute capability >= 8.0) do")
        if getattr(problem, "dmod_args", None) is not None and not self.mod_args_grad:
            return (f"{self.name} does not compute mod_args' gradients (score_mod_args_grad); "
                    f"the CPU path (cpu.tiled) and cuda.mma (CuPy arrays, compute capability "
                    f">= 8.0) do")
        if getattr(problem, "kvcache", None) is not None and not self.kvcache:
            return (f"{self.name} does not read a KV cache in one launch; cuda.mma's forward "
                    f"does (CuPy arrays, compute capability >= 8.0), and "
                    f"attention_with_kvcache runs one call per batch entry elsewhere")
        if getattr(problem, "varlen", None) is not None and not self.varlen:
            return (f"{self.name} does not run packed sequences in one launch; cuda.mma does "
                    f"(CuPy arrays, compute capability >= 8.0; cuda.wgmma on 9.0), and "
                    f"attention_varlen runs one call per sequence elsewhere")
        splits = getattr(problem, "num_splits", None)
        if splits is not None and splits > 1 and not self.splits:
            return (f"{self.name} does not split the keys (num_splits={splits}); cuda.mma's "
                    f"forward does (CuPy arrays, compute capability >= 8.0), as does the CPU "
                    f"path (NumPy arrays), and num_splits=None or 1 runs anywhere")
        precision = getattr(problem, "precision", "auto")
        if precision == "tf32" and not self.tf32 and self.direction == "backward":
            return (f"{self.name} computes in exact {dt}; no backward kernel takes "
                    f"precision='tf32': pass precision='auto' (3xTF32 on cuda.mma) or 'ieee'")
        if precision == "tf32" and not self.tf32:
            return (f"{self.name} computes in exact {dt}; precision='tf32' runs on cuda.mma only "
                    f"(CuPy float32 arrays, compute capability >= 8.0)")
        if self.tf32 and dt == "float32" and precision == "ieee":
            return IEEE_REASON
        if dt not in self.dtypes:
            return f"{self.name} takes {', '.join(self.dtypes)}, not {dt}"
        B, H, Nq, Nk, d, dv = problem.shape
        if self.max_head_dim is not None and max(d, dv) > self.max_head_dim:
            return (f"{self.name} takes head dims up to {self.max_head_dim} (d={d}, dv={dv}); "
                    f"the CPU path takes any head dim")
        if self.backend == "cuda":
            if device.simulator and not self.runs_in_simulator:
                return (f"{self.name} uses inline PTX, which numba's CUDA simulator cannot run; "
                        f"unset NUMBA_ENABLE_CUDASIM and run on a GPU, or use algorithm='block'")
            if self.min_cc and device.cc is not None and device.cc < self.min_cc:
                why = f" ({self.min_cc_why})" if self.min_cc_why else ""
                return (f"{self.name} needs compute capability >= {self.min_cc[0]}.{self.min_cc[1]}"
                        f"{why}; {device.name} is {device.cc[0]}.{device.cc[1]}")
        return None

    def config(self, problem, device):
        """The kernel's config for the problem on the device; raises Unsupported saying why not
        (the declarations first, then the kernel's own limits)."""
        why = self.why_not(problem, device)
        if why is not None:
            raise Unsupported(why)
        return self.module.config(problem, device)


def _cpu_tiled():
    from .cpu import tiled
    return tiled


def _cpu_backward():
    from .cpu import backward
    return backward


def _cuda_mma():
    from .cuda import mma
    return mma


def _cuda_wgmma():
    from .cuda import wgmma
    return wgmma


def _wgmma_passes(problem, device):
    from .cuda.wgmma import auto_passes
    return auto_passes(problem, device)


def _cuda_block():
    from .cuda import block
    return block


def _cuda_row():
    from .cuda import row
    return row


def _cuda_mma_backward():
    from .cuda.mma import gradients
    return gradients


def _cuda_wgmma_backward():
    from .cuda.wgmma import gradients
    return gradients


def _cuda_row_backward():
    from .cuda import row_backward
    return row_backward


#: the modification kinds cuda.row's forward takes (any GPU it runs on: Turing and Volta too)
ROW_MODS = ("window_size", "attn_mask", "mask_mod", "softcap", "alibi_slopes", "attn_bias",
            "score_mod")

FORWARD = (
    Operator("cuda.wgmma", "cuda", "wgmma", _cuda_wgmma,
             dtypes=("float16", "bfloat16"), max_head_dim=128, min_cc=(9, 0),
             min_cc_why="Hopper's wgmma, sm_90a", runs_in_simulator=False,
             auto_passes=_wgmma_passes, varlen=True, mods=ROW_MODS + ("block_mask",),
             summary="FlashAttention-3's forward loop on Hopper warpgroup products: wgmma "
                     "m64nNk16 with S = Q K^T from shared memory and P V with P from "
                     "registers, the softmax of one key tile overlapped with the P V of the "
                     "one before, K/V in three cp.async buffers in the 128-byte swizzled "
                     "layout; sliding windows and block masks (the tiles outside them "
                     "skipped), score / mask modifications (cuda.mma's device functions on the "
                     "S registers); packed sequences in "
                     "one launch; compute capability 9.0 only; "
                     "'auto' takes it for the 16-bit "
                     "forward where it runs, but for calls whose query blocks do not fill the "
                     "GPU (cuda.mma splits their keys) and block masks at d64"),
    Operator("cuda.mma", "cuda", "mma", _cuda_mma,
             dtypes=("float16", "bfloat16", "float32", "float64"), max_head_dim=256,
             min_cc=(8, 0), min_cc_why="mma.sync bf16 / f64, cp.async", runs_in_simulator=False,
             tf32=True, mods="all", splits=True, kvcache=True, varlen=True, dropout=True,
             summary="FlashAttention-2 on tensor cores: mma.sync m16n8k16, register online "
                     "softmax, cp.async double-buffered K/V, ldmatrix; float64 (d <= 128, 64 on "
                     "sm_8x) on float64 mma.sync; float32 (d <= 128, cc 8.0 / 9.0) as 3xTF32 "
                     "on m16n8k8 tf32, or one tf32 mma per product with precision='tf32'; "
                     "sliding windows skip the key tiles outside them, other modifications are "
                     "device functions applied score by score; split-KV (the keys of a query "
                     "block over several blocks, merged by cuda.merge) when the query blocks "
                     "cannot fill the GPU"),
    Operator("cpu.tiled", "cpu", "block", _cpu_tiled,
             dtypes=("float16", "float32", "float64"), mods="all", dropout=True, splits=True,
             summary="numba.njit block-tiled online softmax, parallel over (batch, head, query "
                     "block), and over runs of key blocks where those are fewer than the "
                     "threads (decoding; num_splits forces a count), merged exactly; up to 16 "
                     "query rows over K/V in a KV cache's (B, N, Hk, d) layout run key-major "
                     "(a task reads a run of keys for every head at once; config's order)"),
    Operator("cuda.block", "cuda", "block", _cuda_block,
             dtypes=("float16", "float32", "float64"), max_head_dim=256,
             summary="block-tiled: Q blocks across the grid, K/V tiles in shared memory, "
                     "register micro-tiles, online softmax per row"),
    Operator("cuda.row", "cuda", "row", _cuda_row,
             dtypes=("float16", "float32", "float64"), max_head_dim=256,
             mods=ROW_MODS,
             summary="FA1 per-row: one thread owns one query row, K/V tiles in shared memory; "
                     "modifications (not a block mask) applied score by score as cuda.mma's "
                     "device functions, a window as each row's key range"),
)

BACKWARD = (
    Operator("cpu.tiled", "cpu", "block", _cpu_backward,
             dtypes=("float16", "float32", "float64"), direction="backward", mods="all",
             dropout=True, bias_grad=True, mod_args_grad=True,
             summary="numba.njit FlashAttention-2 backward: parallel over (batch, head, key-block "
                     "split), P recomputed from lse tile by tile, dQ per split summed in a "
                     "fixed order (always deterministic)"),
    Operator("cuda.wgmma", "cuda", "wgmma", _cuda_wgmma_backward,
             dtypes=("float16", "bfloat16"), max_head_dim=128, direction="backward",
             min_cc=(9, 0), min_cc_why="Hopper's wgmma, sm_90a", runs_in_simulator=False,
             varlen=True, mods=ROW_MODS,
             summary="FlashAttention-3's backward loop on Hopper warpgroup products: a block "
                     "of 128 keys holds K and V in shared memory while the query tiles stream "
                     "past (two cp.async buffers, 128-byte swizzled); per tile S^T, dP^T, "
                     "dV += P^T dO, dK += dS^T Q and dQ = dS K on wgmma m64nNk16, dQ added "
                     "into a float32 accumulator (red.global.add.v4.f32), delta from "
                     "cuda.mma's query pass; packed sequences in one launch; sliding windows and "
                     "score / mask modifications with their derivatives (not on packed "
                     "sequences; 'auto' takes it for them); "
                     "compute capability 9.0 only; not deterministic=True (cuda.mma's two "
                     "passes are)"),
    Operator("cuda.mma", "cuda", "mma", _cuda_mma_backward,
             dtypes=("float16", "bfloat16", "float32", "float64"), max_head_dim=256,
             direction="backward", min_cc=(8, 0), min_cc_why="mma.sync bf16 / f64, cp.async",
             runs_in_simulator=False, tf32=True, mods="all", varlen=True, dropout=True,
             bias_grad=True, mod_args_grad=True,
             summary="FlashAttention-2 backward on tensor cores (mma.sync m16n8k16, ldmatrix, "
                     "cp.async double buffering; float32 as 3xTF32 on m16n8k8 tf32, float64 "
                     "on float64 mma.sync): a query pass (dQ) and a key pass (dK, dV, GQA "
                     "groups summed in registers), P recomputed from lse, no atomics "
                     "(deterministic; a broadcast attn_bias's gradient is summed by atomic "
                     "adds); 16-bit on sm_90 without deterministic=True: the key pass adds dQ "
                     "into a float32 accumulator and the query pass computes delta only (5 "
                     "products, not 7); head dims past 128 (float64: 64) split the gradients' "
                     "columns over the grid; sliding windows skip the tiles outside them, "
                     "other modifications and their derivatives are applied score by score, "
                     "attn_bias's and mod_args' gradients added from the key pass"),
    Operator("cuda.row", "cuda", "row", _cuda_row_backward,
             dtypes=("float16", "bfloat16", "float32", "float64"), max_head_dim=256,
             direction="backward", mods=ROW_MODS,
             summary="FMA FlashAttention-2 backward, one thread a row: a key pass (dK, dV) and a "
                     "query pass (dQ) that recomputes S, no atomics (always deterministic); "
                     "modifications as cuda.row's forward takes them, with their derivatives"),
)

_BY_NAME = {"forward": {op.name: op for op in FORWARD},
            "backward": {op.name: op for op in BACKWARD}}


def operators(direction="forward"):
    """{name: Operator} of one direction, in the order "auto" tries them."""
    return _BY_NAME[direction]
