"""cuda.wgmma's backward operator: cuda.mma's delta pass, then the wgmma key pass
(backward.py), which computes dK and dV and adds dQ into a float32 accumulator, then
cuda.dq_round's launch, which rounds that into dQ.

float16 / bfloat16, head dims up to 128 (zero-padded to 64 or 128), causal in both alignments,
GQA, packed sequences in one launch (attention_varlen: VARLEN, as cuda.mma runs them), sliding
windows and score / mask modifications (cuda.mma's composition and derivatives, per score) on
unpacked calls, on compute capability 9.0. dQ's adds come in an order that varies from run to
run, so ``deterministic=True`` is cuda.mma's (its two passes). Not yet here (explain says so,
and cuda.mma runs them): block masks, windows and modifications of packed sequences, dropout,
attn_bias's and mod_args' gradients, float32 gradients of 16-bit inputs (grad_dtype); strided
rows and head dims that are not multiples of 8 run on cuda.row.
"""
import dataclasses

from ...device import Unsupported
from .. import dq_round
from ..mma import gradients as mma_gradients
from ..mma.backward import shared_bytes as mma_shared_bytes
from .backward import WgmmaBackwardConfig, make_kernel, shared_bytes
from .tiles import NAME, check_hopper, head_dim_pad

#: (NWG, DQ) by the larger padded head dim: two warpgroups (128 keys a block, half the dQ adds
#: of 64). d128: each takes half of dQ's columns (254 registers, no spill; ptxas sm_90a). d64:
#: the warpgroups take dQ's whole product in turn, which the H100 timed at 2.92 ms against
#: 3.15 for halves of 32 columns (B4 H16 N4096 float16, non-causal; causal 1.81 / 1.83 ms;
#: bench/NOTES.md "cuda.wgmma's backward")
TILES = {64: (2, "alternate"), 128: (2, "split")}


def config(problem, device):
    """{"queries": cuda.mma's delta pass, "keys": WgmmaBackwardConfig} for a backward problem;
    raises Unsupported saying why not."""
    from ..mma.config import check_packed, modifications, padded_dims
    check_hopper(device, "cuda.mma's backward")
    if getattr(problem, "deterministic", False):
        raise Unsupported(f"{NAME}'s backward adds dQ into a float32 accumulator atomically, "
                          f"in an order that varies from run to run: deterministic=True takes "
                          f"cuda.mma's two passes (dQ in its own pass, no atomics)")
    if str(getattr(problem, "grad_dtype", None)) == "float32":
        raise Unsupported(f"{NAME}'s backward stores 16-bit gradients; grad_dtype float32 "
                          f"takes cuda.mma's backward")
    window = padded_dims(problem)[2]   # (refuses query heads that do not divide the K/V heads)
    why = mma_gradients.staging_refusal(problem)
    if why:
        raise Unsupported(f"{NAME}'s backward stages q, k, v, dO and O with 16-byte cp.async, "
                          f"and {why}: cuda.row's backward takes any layout")
    B, H, Nq, Nk, d, dv = problem.shape
    D, DV = head_dim_pad(d), head_dim_pad(dv)
    DT = mma_gradients.KINDS[problem.dtype_name]
    packed = int(getattr(problem, "varlen", None) is not None)
    if packed:
        check_packed(problem, NAME)
    token = modifications(problem)
    if (token or window) and packed:
        raise Unsupported(f"{NAME}'s backward takes no window or other modification on packed "
                          f"sequences yet: cuda.mma's backward runs them in one launch")
    NWG, form = TILES[max(D, DV)]
    if not dq_round.fits(B * H * Nq, D):
        raise Unsupported(f"{NAME}'s backward adds dQ into a float32 accumulator of "
                          f"{B * H * Nq * D} words, past the 2**34 cuda.dq_round indexes: "
                          f"cuda.mma's backward takes it (two passes, no accumulator)")
    keys = WgmmaBackwardConfig(D, DV, NWG, 64, DT, form, VARLEN=packed, MODS=token,
                               WINDOW=int(window))
    # (the delta pass carries the window and the token: launch_passes hands both passes the
    # arguments its config names)
    queries = dataclasses.replace(mma_gradients.with_dq_adds(
        mma_gradients.tiles(D, DV, device.smem_per_block_optin, window, bool(token), DT,
                            device.cc), "red4",
        device.smem_per_block_optin)["queries"], VARLEN=packed, MODS=token)
    for what, need in (("key pass", shared_bytes(keys)),
                       ("delta pass", mma_shared_bytes(queries, "queries"))):
        if device.smem_per_block_optin is not None and need > device.smem_per_block_optin:
            raise Unsupported(f"{NAME}'s backward {what} needs {need} bytes of shared memory "
                              f"for d={d}, dv={dv}, more than the {device.smem_per_block_optin}"
                              f" a block may use on {device.name}")
    return {"queries": queries, "keys": keys}


def compiled_kernels(cfg, dtype):
    """[(Kernel, numba argument types)] run() launches: cuda.mma's delta pass, the wgmma key
    pass, then cuda.dq_round's."""
    from .. import launch
    return [mma_gradients.query_pass_kernel(cfg["queries"], dtype),
            (launch.get_kernel(NAME + ".backward_keys", make_kernel, cfg["keys"]),
             mma_gradients.signature(dtype, "keys", bool(cfg["keys"].WINDOW), cfg["keys"].MODS,
                                     varlen=bool(cfg["keys"].VARLEN), dq_adds=True))] + \
        mma_gradients.dq_round_kernel(cfg, dtype)


def run(problem, cfg, device):
    """Fill problem.dq, dk, dv for a normalized CuPy problem."""
    mma_gradients.launch_passes(problem, cfg, device,
                                [kernel for kernel, _ in
                                 compiled_kernels(cfg, problem.dtype_name)[:2]],
                                (mma_shared_bytes(cfg["queries"], "queries"),
                                 shared_bytes(cfg["keys"])))


def notes(problem, cfg, device):
    """What explain adds about this backward's config."""
    who = ("each warpgroup half of its columns" if cfg["keys"].DQ == "split" else
           "one warpgroup a query tile, in turn")
    lines = [f"dQ: the wgmma key pass multiplies dS by K ({who}) and adds it into a float32 "
             "accumulator (red.global.add.v4.f32); cuda.mma's query pass computes delta only; "
             "the adds' order varies from run to run (deterministic=True takes cuda.mma's two "
             "passes)"]
    if cfg["keys"].VARLEN:
        lines.append(mma_gradients.packed_note(problem))
    return lines
