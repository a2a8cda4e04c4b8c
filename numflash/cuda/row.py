"""The FA1 per-row kernel: one thread owns one query row.

The thread keeps its (pre-scaled) q row and its output accumulator in registers; the block's threads
load each K/V tile into shared memory together (coalesced, one element per thread per step), then
every thread runs the online-softmax update over the tile's keys one by one. When a key does not
raise the running max (the common case after the first few), the accumulator needs no rescale.
Grid: (batch x head, query chunk of ROWS rows), so any sequence length fits.
"""
import math

from numba import cuda

from . import launch
from .common import NEG_INF, compute_type, element_size, exp_for, head_dim_bucket, key_end

NAME = "cuda.row"
ROWS = 128


def make_kernel(D, DV, BC, ROWS, acc):
    """Kernel for head dims padded to D (q, k) and DV (v), BC keys a tile, ROWS threads a block."""
    ACC = compute_type(acc)
    exp = exp_for(acc)

    def row_attention(q, k, v, out, lse, scale, causal, causal_offset):
        H, Nq, d = q.shape[1], q.shape[2], q.shape[3]
        Nk, dv = k.shape[2], v.shape[3]
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x // H
        h = cuda.blockIdx.x % H
        block_first = cuda.blockIdx.y * ROWS
        i = block_first + tid
        smem = cuda.shared.array(0, ACC)
        vs = BC * D  # V tile starts after the K tile

        qr = cuda.local.array(D, ACC)
        acc_o = cuda.local.array(DV, ACC)
        for c in range(D):
            qr[c] = ACC(q[b, h, i, c]) * scale if i < Nq and c < d else ACC(0)
        for c in range(DV):
            acc_o[c] = 0
        m = ACC(NEG_INF)
        l = ACC(0)

        row_keys = key_end(i, Nk, causal, causal_offset) if i < Nq else 0
        block_keys = key_end(min(Nq, block_first + ROWS) - 1, Nk, causal, causal_offset)
        for j0 in range(0, block_keys, BC):
            cuda.syncthreads()  # the previous tile is no longer read
            for idx in range(tid, BC * D, ROWS):
                j = idx // D
                c = idx - j * D
                smem[idx] = ACC(k[b, h, j0 + j, c]) if j0 + j < Nk and c < d else ACC(0)
            for idx in range(tid, BC * DV, ROWS):
                j = idx // DV
                c = idx - j * DV
                smem[vs + idx] = ACC(v[b, h, j0 + j, c]) if j0 + j < Nk and c < dv else ACC(0)
            cuda.syncthreads()
            for j in range(min(BC, row_keys - j0)):
                s = ACC(0)
                for c in range(D):
                    s += qr[c] * smem[j * D + c]
                if s > m:  # new max: rescale what was accumulated, this key's weight is 1
                    alpha = exp(m - s)
                    l = l * alpha + 1
                    for c in range(DV):
                        acc_o[c] = acc_o[c] * alpha + smem[vs + j * DV + c]
                    m = s
                else:
                    p = exp(s - m)
                    l += p
                    for c in range(DV):
                        acc_o[c] += p * smem[vs + j * DV + c]

        if i < Nq:
            if l > 0:
                inv = 1 / l
                for c in range(DV):
                    if c < dv:
                        out[b, h, i, c] = acc_o[c] * inv
                lse[b, h, i] = m + math.log(l)
            else:  # the row sees no key
                for c in range(DV):
                    if c < dv:
                        out[b, h, i, c] = 0
                lse[b, h, i] = NEG_INF

    return row_attention


def config(problem, device):
    B, H, Nq, Nk, d, dv = problem.shape
    acc = "float64" if problem.dtype.name == "float64" else "float32"
    D, DV = head_dim_bucket(d), head_dim_bucket(dv)
    rows = 32 if device.simulator else ROWS
    # Largest power-of-two tile (8..64 keys) whose K and V fit the 48 KB every GPU gives a block.
    bc = 64
    while bc > 8 and bc * (D + DV) * element_size(acc) > 48 * 1024:
        bc //= 2
    return {"D": D, "DV": DV, "BC": bc, "ROWS": rows, "acc": acc}


def run(problem, cfg, device):
    p = problem
    B, H, Nq, Nk, d, dv = p.shape
    kernel = launch.get_kernel(NAME, make_kernel, cfg)
    lse = p.empty_lse()
    acc_type = compute_type(cfg["acc"])
    grid = (B * H, -(-Nq // cfg["ROWS"]))
    smem = cfg["BC"] * (cfg["D"] + cfg["DV"]) * element_size(cfg["acc"])
    kernel(grid, (cfg["ROWS"],), smem,
           (p.q, p.k, p.v, p.out, lse, acc_type(p.scale), int(p.causal), int(p.causal_offset)),
           device)
    return lse
