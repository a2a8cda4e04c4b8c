"""The FA1 per-row kernel: one thread owns one query row.

The thread keeps its q row and its output accumulator in registers; the block's threads
load each K/V tile into shared memory together (coalesced, one element per thread per step), then
every thread runs the online-softmax update over the tile's keys one by one. When a key does not
raise the running max (the common case after the first few), the accumulator needs no rescale.
Grid: (batch x head, query chunk of ROWS rows), so any sequence length fits.
"""
import math

import numpy as np
from numba import cuda

from . import launch
from .common import NEG_INF, STAGE_CHUNK, compute_type, element_size, exp_for, head_dim_bucket, \
    key_end, tile_stager

NAME = "cuda.row"
ROWS = 128


def make_kernel(D, DV, BC, ROWS, acc):
    """Kernel for head dims padded to D (q, k) and DV (v), BC keys a tile, ROWS threads a block.

    Shared-memory indices are uint64 (with uint64 constants) so numba emits no negative-index
    wraparound code in the inner loops.
    """
    ACC = compute_type(acc)
    exp = exp_for(acc)
    u = np.uint64
    uD, uDV, uBC, uROWS = u(D), u(DV), u(BC), u(ROWS)
    V_OFF = u(BC * D)  # V tile starts after the K tile
    zero = u(0)
    chunk = STAGE_CHUNK // (element_size(acc) // 4)
    stage_k, store_k, STAGE_REGS, K_PARTS = tile_stager(BC, D, ROWS, acc, False, D, chunk)
    stage_v, store_v, V_REGS, V_PARTS = tile_stager(BC, DV, ROWS, acc, False, DV, chunk)
    STAGE_REGS = max(STAGE_REGS, V_REGS)

    def row_attention(q, k, v, out, lse, scale, causal, causal_offset):
        H = q.shape[1]
        Nq, d, Nk, dv = u(q.shape[2]), u(q.shape[3]), u(k.shape[2]), u(v.shape[3])
        sc = ACC(scale)
        tid = u(cuda.threadIdx.x)
        b = u(cuda.blockIdx.x // H)
        h = u(cuda.blockIdx.x % H)
        block_first = u(cuda.gridDim.y - 1 - cuda.blockIdx.y) * uROWS  # longest (causal) first
        i = block_first + tid
        smem = cuda.shared.array(0, ACC)
        kbh, vbh = k[b, h], v[b, h]
        regs = cuda.local.array(STAGE_REGS, ACC)

        qr = cuda.local.array(D, ACC)
        acc_o = cuda.local.array(DV, ACC)
        for c in range(uD):
            qr[c] = ACC(q[b, h, i, c]) if i < Nq and c < d else ACC(0)
        for c in range(uDV):
            acc_o[c] = 0
        m = ACC(NEG_INF)  # running max of the scaled scores
        l = ACC(0)

        row_keys = u(key_end(i, Nk, causal, causal_offset)) if i < Nq else zero
        block_keys = u(key_end(min(Nq, block_first + uROWS) - u(1), Nk, causal, causal_offset))
        for j0 in range(zero, block_keys, uBC):
            cuda.syncthreads()  # the previous tile is no longer read
            for part in range(u(K_PARTS)):
                stage_k(kbh, j0, Nk, d, regs, tid, part)
                store_k(smem, zero, regs, tid, part)
            for part in range(u(V_PARTS)):
                stage_v(vbh, j0, Nk, dv, regs, tid, part)
                store_v(smem, V_OFF, regs, tid, part)
            cuda.syncthreads()
            keys = min(uBC, row_keys - j0) if row_keys > j0 else zero
            for j in range(keys):
                kj = j * uD
                vj = V_OFF + j * uDV
                dot = ACC(0)
                for c in range(uD):
                    dot += qr[c] * smem[kj + c]
                s = dot * sc  # scale the score, not q: pre-scaling would round q once more
                if s > m:  # new max: rescale what was accumulated, this key's weight is 1
                    alpha = exp(m - s)
                    l = l * alpha + 1
                    for c in range(uDV):
                        acc_o[c] = acc_o[c] * alpha + smem[vj + c]
                    m = s
                else:
                    p = exp(s - m)
                    l += p
                    for c in range(uDV):
                        acc_o[c] += p * smem[vj + c]

        if i < Nq:
            inv = 1 / l if l > 0 else ACC(0)  # a row that sees no key gives zeros
            for c in range(uDV):
                if c < dv:
                    out[b, h, i, c] = acc_o[c] * inv
            lse[b, h, i] = m + math.log(l) if l > 0 else NEG_INF

    return row_attention


def config(problem, device):
    B, H, Nq, Nk, d, dv = problem.shape
    acc = "float64" if problem.dtype_name == "float64" else "float32"
    D, DV = head_dim_bucket(d), head_dim_bucket(dv)
    rows = 32 if device.simulator else ROWS
    # Largest power-of-two tile (8..64 keys) whose K and V fit the 48 KB every GPU gives a block.
    bc = 64
    while bc > 8 and bc * (D + DV) * element_size(acc) > 48 * 1024:
        bc //= 2
    return {"D": D, "DV": DV, "BC": bc, "ROWS": rows, "acc": acc}


def shared_bytes(cfg):
    return cfg["BC"] * (cfg["D"] + cfg["DV"]) * element_size(cfg["acc"])


def run(problem, cfg, device):
    p = problem
    B, H, Nq, Nk, d, dv = p.shape
    kernel = launch.get_kernel(NAME, make_kernel, cfg)
    lse = p.empty_lse()
    grid = (B * H, -(-Nq // cfg["ROWS"]))
    kernel(grid, (cfg["ROWS"],), shared_bytes(cfg),
           (p.q, p.k, p.v, p.out, lse, float(p.scale), int(p.causal), int(p.causal_offset)),
           device)
    return lse
