"""The FA1 per-row kernel: one thread owns one query row.

The thread keeps its q row and its output accumulator in registers; the block's threads
load each K/V tile into shared memory together (coalesced, staged through registers), then
every thread runs the online-softmax update over the tile's keys one by one. When a key does not
raise the running max (the common case after the first few), the accumulator needs no rescale.
Grid: (batch x head, query chunk of BR rows, output column chunk), so any sequence length fits.

Large head dims do not fit in registers (q and the accumulator are one word each per element,
255 registers a thread). Past REG_WORDS the output columns split across blocks (grid z), each
block recomputing the scores for its DV columns, while q still fits beside them in at most
MAX_SPLITS splits; beyond that q moves to shared memory (transposed, so a warp's threads read 32
consecutive words: no bank conflicts) and the accumulator takes ACC_WORDS. ptxas then reports no
spills for any head dim up to 256, float32 or float64, on sm_75/80/90 (tests/test_cuda_compile.py).
On the H100 this beat keeping everything in registers and letting ptxas spill 0.3-0.5 KB: float32
d=128 45.4 against 47.0 ms, float64 d=64 39.6 against 43.5 ms (bench/NOTES.md).
"""
import hashlib
import inspect
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, int64

from .. import mods as user_mods
from ..device import Unsupported
from . import launch
from .config import SIMT_ACC, SimtConfig, simt_dt
from .common import NEG_INF, SMEM_ALIGN, compute_type, device_function, element_size, exp_for, \
    forward_signature, head_dim_bucket, inlined_device, key_end, stage_chunk, tile_stager, \
    vector_load
from .mma import mods
from .mma.emit import Source

NAME = "cuda.row"
REG_WORDS = 160   # 32-bit words of q row + accumulator a thread keeps in registers (no spills)
MAX_SPLITS = 2    # output column splits (score recomputations) before q goes to shared memory
ACC_WORDS = 128   # accumulator words per thread once q is in shared memory (no spills)
KV_TILE_BYTES = 48 * 1024  # K and V tiles of one block


@dataclass(frozen=True)
class RowConfig(SimtConfig):
    """One compile-time variant of cuda.row's forward (cuda.config's naming scheme).

    D: q / k's padded head dim; DV: the output columns a block computes (grid z covers the rest).
    BR query rows a block, one thread each (NT = BR); BC keys a K / V tile. HOLDQ: each thread's
    q row stays in registers (else it lives in shared memory, transposed). DT: "f32" or "f64",
    the accumulators' type.
    """
    D: int
    DV: int
    BR: int
    BC: int
    HOLDQ: int
    DT: str
    MODS: str = ""    # the modifications applied score by score (cuda.mma.mods' token)
    WINDOW: int = 0   # a sliding window: each row's keys, and the block's tiles, limited to it


def make_kernel(D, DV, BR, BC, HOLDQ, DT, MODS="", WINDOW=0):
    """Kernel for q/k head dims padded to D, DV output columns a block, BR query rows (threads) a
    block, BC keys a tile; HOLDQ: the q row stays in registers, else in shared memory. With
    MODS, each scaled score goes through the call's composed modifications (cuda.mma.mods: the
    device functions the tensor-core kernels call; a refused pair's -inf skips the key), their
    arguments passed after the others; with WINDOW, each row's key range is cut to the window
    (numflash.mods.window_key_range) and the block visits only the tiles its rows' ranges meet.

    Shared-memory indices are uint64 (with uint64 constants) so numba emits no negative-index
    wraparound code in the inner loops.
    """
    acc = SIMT_ACC[DT]
    ACC = compute_type(acc)
    exp = exp_for(acc)
    u = np.uint64
    uD, uDV, uBR, uBC = u(D), u(DV), u(BR), u(BC)
    V_OFF = u(BC * D)             # V tile after the K tile
    Q_OFF = u(BC * (D + DV))      # then Qt[c][row], unless HOLDQ
    zero = u(0)
    chunk = stage_chunk(acc)
    _, _, stage_k, K_REGS, _ = tile_stager(BC, D, BR, acc, False, D, chunk)
    _, _, stage_v, V_REGS, _ = tile_stager(BC, DV, BR, acc, False, DV, chunk)
    STAGE_REGS = max(K_REGS, V_REGS)
    Q_REGS = D if HOLDQ else 1
    VW = 16 // element_size(acc)  # elements per 16-byte load; D and DV are multiples of 16
    uVW = u(VW)

    mod_score = mod_functions(MODS, acc)

    @inlined_device
    def row_attention(q, k, v, out, lse, scale, causal, causal_offset, window_left,
                      window_right, margs):
        H = q.shape[1]
        Nq, d, Nk, dv = u(q.shape[2]), u(q.shape[3]), u(k.shape[2]), u(v.shape[3])
        sc = ACC(scale)
        tid = u(cuda.threadIdx.x)
        b = u(cuda.blockIdx.x // H)
        h = u(cuda.blockIdx.x % H)
        block_first = u(cuda.gridDim.y - 1 - cuda.blockIdx.y) * uBR  # longest (causal) first
        col0 = u(cuda.blockIdx.z) * uDV   # this block's output columns: col0 .. col0 + DV
        i = block_first + tid
        smem = cuda.shared.array(0, ACC, alignment=SMEM_ALIGN)
        hk = h // u(H // k.shape[1])  # grouped-query attention: the key/value head h reads
        kbh, vbh = k[b, hk], v[b, hk, :, col0:]
        cols = dv - col0 if dv > col0 else zero
        regs = cuda.local.array(STAGE_REGS, ACC)

        qr = cuda.local.array(Q_REGS, ACC)
        for c in range(uD):
            x = ACC(q[b, h, i, c]) if i < Nq and c < d else ACC(0)
            if not HOLDQ:
                smem[Q_OFF + c * uBR + tid] = x  # only this thread reads it back
            else:
                qr[c] = x
        acc_o = cuda.local.array(DV, ACC)
        dots = cuda.local.array(VW, ACC)
        for c in range(uDV):
            acc_o[c] = 0
        m = ACC(NEG_INF)  # running max of the scaled scores
        l = ACC(0)

        row_keys = u(key_end(i, Nk, causal, causal_offset)) if i < Nq else zero
        last_row = min(Nq, block_first + uBR) - u(1)
        block_keys = u(key_end(last_row, Nk, causal, causal_offset))
        row_first = zero
        block_start = zero
        if WINDOW:
            row_first, row_keys, block_keys, block_start = window_keys(
                i, last_row, block_first, Nk, row_keys, block_keys, window_left, window_right,
                causal_offset, uBC)
        for j0 in range(block_start, block_keys, uBC):
            cuda.syncthreads()  # the previous tile is no longer read
            stage_k(kbh, j0, Nk, d, regs, smem, zero, tid)
            stage_v(vbh, j0, Nk, cols, regs, smem, V_OFF, tid)
            cuda.syncthreads()
            keys = min(uBC, row_keys - j0) if row_keys > j0 else zero
            skip = row_first - j0 if WINDOW and row_first > j0 else zero
            for j in range(skip, keys):  # K and V rows: 16-byte loads, broadcast to every thread
                kj = j * uD
                vj = V_OFF + j * uDV
                for w in range(uVW):  # VW partial sums: VW independent FMA chains, not one
                    dots[w] = 0
                for c in range(zero, uD, uVW):
                    t = vector_load(smem, kj + c, VW)
                    for w in range(uVW):
                        dots[w] += (qr[c + w] if HOLDQ else smem[Q_OFF + (c + w) * uBR + tid]) * t[w]
                dot = dots[0]
                for w in range(u(1), uVW):
                    dot += dots[w]
                s = dot * sc  # scale the score, not q: pre-scaling would round q once more
                if MODS:
                    s = mod_score(s, int64(b), int64(h), int64(i), int64(j0 + j), *margs)
                    if s == NEG_INF:  # a refused pair: the key takes no part
                        continue
                if s > m:  # new max: rescale what was accumulated, this key's weight is 1
                    alpha = exp(m - s)
                    l = l * alpha + 1
                    for c in range(zero, uDV, uVW):
                        t = vector_load(smem, vj + c, VW)
                        for w in range(uVW):
                            acc_o[c + w] = acc_o[c + w] * alpha + t[w]
                    m = s
                else:
                    p = exp(s - m)
                    l += p
                    for c in range(zero, uDV, uVW):
                        t = vector_load(smem, vj + c, VW)
                        for w in range(uVW):
                            acc_o[c + w] += p * t[w]

        if i < Nq:
            inv = 1 / l if l != 0 else ACC(0)  # no key: zeros; a NaN score: NaN, as the reference
            for c in range(uDV):
                if c < cols:
                    out[b, h, i, col0 + c] = acc_o[c] * inv
            if col0 == zero:
                lse[b, h, i] = m + math.log(l) if l != 0 else NEG_INF

    return entry("row_attention", row_attention, FORWARD_PARAMETERS, MODS, WINDOW, acc)


FORWARD_PARAMETERS = "q, k, v, out, lse, scale, causal, causal_offset"

window_range = device_function(user_mods.window_key_range)


@inlined_device
def window_keys(i, last_row, block_first, nk, row_keys, block_keys, left, right, offset, tile):
    """A window's cut of the keys a thread's row i and its block visit (the forward's and the
    dQ pass's): (row_first, row_keys, block_keys, block_start), row_keys and block_keys the
    causal / Nk ends before it; the block's tiles start at its first row's first key (a
    window's edges only move right from row to row), rounded down to a ``tile``."""
    first, end = window_range(int64(i), int64(nk), left, right, offset)
    row_first = np.uint64(first)
    row_keys = min(row_keys, np.uint64(max(first, end)))
    first, end = window_range(int64(last_row), int64(nk), left, right, offset)
    block_keys = min(block_keys, np.uint64(max(first, end)))
    first, end = window_range(int64(block_first), int64(nk), left, right, offset)
    return row_first, row_keys, block_keys, np.uint64(first) // tile * tile


def mod_functions(token, acc, name="mod_score"):
    """The composed modification function ``name`` (cuda.mma.mods.namespace's mod_score, or
    mod_score_grad for a backward) of a MODS token, or None without."""
    if not token:
        return None
    return mods.namespace(token, np.dtype(acc).type, device_function)[name]


def entry(name, body, parameters, token, window, acc):
    """The kernel ``name``: ``parameters``, then (``window``) the window's left and right, then
    (``token``) the modifications' arguments; it calls ``body`` with ``parameters``, the
    window's edges (0, 0 without) and the modifications' arguments as a tuple (floats in the
    compute type, as the tensor-core kernels take them). Generated, since a kernel's arguments
    are its signature's: cuda.row's forward and backward kernels are such entries."""
    s = Source()
    params = parameters + (", window_left, window_right" if window else "") + \
        mods.parameters(token)
    s(f"def {name}({params}):")
    with s.block():
        if token:
            mods.emit_locals(s, token, acc)
        margs = mods.composition(token).locals if token else ""
        s(f"body({parameters}, {'window_left, window_right' if window else '0, 0'}, "
          f"({margs}{',' if margs else ''}))")
    ns = {"body": body, acc: mods._real_type(np.dtype(acc).type, device_function)}
    exec(compile(s.text(), f"<{NAME} {name}>", "exec"), ns)  # noqa: S102 - generated here
    return ns[name]


def identity(module_name, token):
    """A cuda.row variant's code: its module's sources and, with modifications, their
    functions'."""
    digest = launch.source_digest(module_name)
    if not token:
        return digest
    h = hashlib.sha256(digest.encode())
    for fn in mods.identity_functions(token):
        h.update(inspect.getsource(fn).encode())
    return h.hexdigest()[:16]


make_kernel.code_identity = lambda **config: identity(__name__, config.get("MODS", ""))
make_kernel.cacheable = lambda **config: mods.cacheable(config.get("MODS", ""))


def config(problem, device):
    B, H, Nq, Nk, d, dv = problem.shape
    DT = simt_dt(problem.dtype_name)
    acc = SIMT_ACC[DT]
    esize = element_size(acc)
    words = esize // 4
    D, DV = head_dim_bucket(d), head_dim_bucket(dv)
    q_shared = False
    if (D + DV) * words > REG_WORDS:
        # The output columns split across blocks (each recomputing the scores) to fit beside q;
        # past MAX_SPLITS splits q moves to shared memory and leaves the registers to them.
        room = max(0, REG_WORDS // words - D) // 16 * 16
        q_shared = room == 0 or -(-DV // room) > MAX_SPLITS
        DV = min(DV, ACC_WORDS // words if q_shared else room)
    limit = None if device.simulator else device.smem_per_block_optin
    mod = getattr(problem, "mods", None)
    token = mods.token_for(mod)   # (the window and a block mask are not in it)
    window = int(bool(getattr(mod, "window", None)))
    # The most rows a block (q in shared memory costs BR x D words), then the largest
    # power-of-two key tile (8..64) whose K and V fit KV_TILE_BYTES and the device's limit.
    for rows in ((32,) if device.simulator else (128, 64, 32, 16)):
        for bc in (64, 32, 16, 8):
            cfg = RowConfig(D, DV, rows, bc, int(not q_shared), DT, token, window)
            if bc * (D + DV) * esize <= KV_TILE_BYTES and (
                    limit is None or shared_bytes(cfg) <= limit):
                return cfg
    raise Unsupported(f"{NAME}: its smallest block needs {shared_bytes(cfg)} bytes of shared "
                      f"memory for d={d}, dv={dv} in {acc}, more than the {limit} a block may "
                      f"use on {device.name}; the CPU path can take it")


def shared_bytes(cfg):
    words = cfg.BC * (cfg.D + cfg.DV) + (0 if cfg.HOLDQ else cfg.BR * cfg.D)
    return words * element_size(cfg.acc)


def compiled_kernels(cfg, dtype):
    """What run() launches for this config and input dtype: [(Kernel, numba argument types)],
    for `numflash.precompile` and `explain`'s cache status."""
    from numba import types
    return [(launch.get_kernel(NAME, make_kernel, cfg), forward_signature(dtype) +
             (types.int64,) * (2 * cfg.WINDOW) + mods.argument_types(cfg.MODS))]


def run(problem, cfg, device):
    p = problem
    B, H, Nq, Nk, d, dv = p.shape
    (kernel, _), = compiled_kernels(cfg, p.dtype_name)
    lse = p.empty_lse()
    grid = (B * H, -(-Nq // cfg.BR), -(-dv // cfg.DV))
    extra = tuple(int(w) for w in p.mods.window) if cfg.WINDOW else ()
    if cfg.MODS:
        extra += mods.arguments(p.mods)
    with user_mods.compile_errors(p.mods, NAME):
        kernel(grid, (cfg.NT,), shared_bytes(cfg),
               (p.q, p.k, p.v, p.out, lse, float(p.scale), int(p.causal),
                int(p.causal_offset)) + extra, device)
    return lse
