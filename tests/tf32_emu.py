"""Emulates the generated tf32 kernel source on the CPU (no GPU): one Python thread per
CUDA thread; the warp-collective m16n8k8 tf32 mma and shfl go through per-warp barriers with the
PTX ISA fragment layouts, syncthreads through a block barrier, cvt.rna.tf32 bit-exactly."""
import math
import threading

import numpy as np


def tf32_bits(x):
    b = np.asarray(x, np.float32).reshape(()).view(np.uint32)
    b = np.uint32((int(b) + 0x1000) & 0xFFFFE000) if np.isfinite(np.float32(x)) else b
    return np.uint32(b)


def _f(bits):
    return float(np.asarray(np.uint32(bits)).view(np.float32))


class _Dim:
    def __init__(self, x):
        self.x, self.y, self.z = x, 0, 0


class Emu:
    def __init__(self, NT, grid, smem_bytes):
        self.NT, self.grid, self.smem_bytes = NT, grid, smem_bytes
        self.tls = threading.local()

    # ---- the fake cuda module
    @property
    def threadIdx(self):
        return _Dim(self.tls.tid)

    @property
    def blockIdx(self):
        return self.tls.block

    @property
    def gridDim(self):
        return self.grid_dim

    @property
    def shared(self):
        emu = self

        class S:
            @staticmethod
            def array(n, dtype):
                return emu.smem
        return S

    def syncthreads(self):
        self.bar.wait()

    def _exchange(self, value):
        w = self.tls.tid // 32
        slots = self.wslots[w]
        slots[self.tls.tid % 32] = value
        self.wbar[w].wait()
        got = list(slots)
        self.wbar[w].wait()
        return got

    def shfl_xor_sync(self, mask, value, lane_mask):
        got = self._exchange(value)
        return got[(self.tls.tid % 32) ^ lane_mask]

    def mma_tf32(self, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        got = self._exchange((a0, a1, a2, a3, b0, b1))
        A = np.zeros((16, 8)); Bm = np.zeros((8, 8))
        for lane, (x0, x1, x2, x3, y0, y1) in enumerate(got):
            g, t = lane // 4, lane % 4
            A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] = map(_f, (x0, x1, x2, x3))
            Bm[t, g], Bm[t + 4, g] = _f(y0), _f(y1)
        lane = self.tls.tid % 32
        g, t = lane // 4, lane % 4
        D = A @ Bm
        return (np.float32(c0 + D[g, 2 * t]), np.float32(c1 + D[g, 2 * t + 1]),
                np.float32(c2 + D[g + 8, 2 * t]), np.float32(c3 + D[g + 8, 2 * t + 1]))

    def run(self, fn, args):
        gx, gy = self.grid
        self.grid_dim = _Dim(gx)
        for by in range(gy):
            for bx in range(gx):
                self.smem = np.full(self.smem_bytes // 4, 0xDEADBEEF, np.uint32)
                self.bar = threading.Barrier(self.NT)
                nw = self.NT // 32
                self.wbar = [threading.Barrier(32) for _ in range(nw)]
                self.wslots = [[None] * 32 for _ in range(nw)]
                errs = []
                blk = _Dim(bx); blk.y = by

                def body(tid):
                    self.tls.tid, self.tls.block = tid, blk
                    try:
                        fn(*args)
                    except Exception as e:  # noqa
                        import traceback
                        errs.append(traceback.format_exc())
                        self.bar.abort()
                        for b in self.wbar:
                            b.abort()
                ths = [threading.Thread(target=body, args=(i,)) for i in range(self.NT)]
                for th in ths:
                    th.start()
                for th in ths:
                    th.join()
                if errs:
                    raise RuntimeError(errs[0])


def run_tf32(q, k, v, causal=False, causal_offset=0, scale=None):
    from numflash.cuda import mma
    from numflash.cuda.common import key_end
    B, H, Nq, d = q.shape
    Nk, dv = k.shape[2], v.shape[3]
    D, DV = mma.head_dim_pad(d), mma.head_dim_pad(dv)
    NW, BC, HOLDQ = mma._tile(D, DV, "tf32")
    cfg = {"D": D, "DV": DV, "NW": NW, "BC": BC, "HOLDQ": HOLDQ, "DT": "tf32", "VEC": 0}
    src = mma.kernel_source_tf32(D, DV, NW, BC, HOLDQ)
    emu = Emu(32 * NW, (-(-Nq // (16 * NW)), B * H), mma.smem_bytes(cfg))
    ns = {"cuda": emu, "math": math, "U": np.uint64, "I": np.int64, "uint32": np.uint32,
          "float32": np.float32, "ZERO": np.float32(0), "ONE": np.float32(1),
          "NEG_INF": np.float32(-np.inf), "FULL": 0xFFFFFFFF,
          "key_end": getattr(key_end, "py_func", key_end),
          "kv_head": lambda h, H, Hkv: h // (H // Hkv),
          "mma_tf32": emu.mma_tf32, "to_tf32": tf32_bits,
          "ex2": lambda x: np.float32(np.exp2(np.float32(x)))}
    exec(compile(src, "<tf32 emu>", "exec"), ns)
    out = np.full((B, H, Nq, dv), np.nan, np.float32)
    lse = np.full((B, H, Nq), np.nan, np.float32)
    scale = 1 / math.sqrt(d) if scale is None else scale
    with np.errstate(all="ignore"):
        emu.run(ns["mma_attention"], (q, k, v, out, lse, None, scale * math.log2(math.e), scale,
                                      int(causal), int(causal_offset)))
    return out, lse
