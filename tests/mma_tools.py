"""Test tools for the tensor-core kernel (numflash.cuda.mma), shared by tests/test_mma_*.py and
tests/test_gqa.py:

- ``tile_config``: the MmaConfig the planner's tile tables give a kind, head dims and GPU.
- ``compile_variant`` / ``assert_register_resident``: compile one variant to a cubin with no GPU
  and read its PTX and ptxas report.
- ``run_word_kernel``: run the generated tf32 / 3xTF32 / float64 source on the CPU under an
  emulator of the warp (``Emu``), with the PTX ISA fragment layouts; ``tf32_bits``,
  ``split_tf32_bits``, ``tf32_operand``: the emulator's tf32 roundings, bit for bit.
- ``run_forced_config``: run a config other than the planner's on whatever GPU runs the tests.
"""
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: the shared memory one block may opt into (cuda.mma's tile tables shrink to fit it)
SMEM_LIMIT = {(9, 0): 227 * 1024, (8, 0): 163 * 1024}


# ------------------------------------------------------------------------------- configs

def tile_config(DT, D, DV=None, cc=(9, 0), VEC=None, DBG=0, WINDOW=0):
    """The MmaConfig of operand kind DT for padded head dims D, DV on compute capability ``cc``
    with the tile ``choose_tile`` picks there. VEC defaults to what the planner prefers (tf32:
    0, the rest 1); float64 gets its mma form by ``cc``."""
    from numflash.cuda.mma import MmaConfig, choose_tile
    DV = DV or D
    VEC = int(DT != "tf32") if VEC is None else VEC
    tile = choose_tile(D, DV, DT, SMEM_LIMIT[cc], VEC, cc, bool(WINDOW))
    form = ("m16n8k8" if cc >= (9, 0) else "m8n8k4") if DT == "f64" else None
    return MmaConfig(D, DV, *tile, DT, VEC, MMA=form, DBG=DBG, WINDOW=WINDOW)


def config_id(cfg, cc=None):
    """A short test id: kind, head dims, tile, staging, mma form, architecture."""
    parts = [cfg.DT, f"d{cfg.D}" + (f"-dv{cfg.DV}" if cfg.DV != cfg.D else ""),
             f"NW{cfg.NW}-BC{cfg.BC}-HOLDQ{cfg.HOLDQ}", "cp.async" if cfg.VEC else "scalar"]
    parts += [cfg.MMA] if cfg.MMA else []
    parts += ["dbg"] if cfg.DBG else []
    parts += ["window"] if cfg.WINDOW else []
    parts += [f"sm{cc[0]}{cc[1]}"] if cc else []
    return "-".join(parts)


# ------------------------------------------------------------------------------- compiling

# the element type the kernel reads q, k, v, out as (16-bit kernels take the bits)
ELEMENT = {"f16": "uint16", "bf16": "uint16", "tf32": "float32", "3xtf32": "float32",
           "f64": "float64"}

_COMPILE = textwrap.dedent("""
    import json, sys
    from numba import types
    from numflash.cuda import launch, mma
    cfg, cc, ops, elem = (json.loads(a) for a in sys.argv[1:5])
    A = types.Array(getattr(types, elem), 4, "A")
    lse = types.Array(types.float64 if elem == "float64" else types.float32, 3, "A")
    args = (A, A, A, A, lse, types.Array(types.float32, 4, "A"),
            types.float64, types.float64, types.int64, types.int64)
    args += (types.int64, types.int64) if cfg.get("WINDOW") else ()  # the window's sizes
    cubin, entry, ptx, res = launch.compile_to_cubin(mma.make_kernel(**cfg), args, tuple(cc))
    print(json.dumps({"resources": res, "ops": {op: ptx.count(op) for op in ops},
                      "cubin_bytes": len(cubin)}))
""")


def compile_variant(cfg, cc, ops=()):
    """Compile one variant (an MmaConfig or a mapping of its fields) for architecture ``cc`` in a
    subprocess (conftest turns numba's simulator on in this one): ptxas's resources and how often
    each of ``ops`` (and ld.local / st.local) occurs in the PTX."""
    ops = list(ops) + ["ld.local", "st.local"]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [json.dumps(x) for x in (dict(cfg), list(cc), ops, ELEMENT[cfg["DT"]])]
    run = subprocess.run([sys.executable, "-c", _COMPILE, *argv], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def assert_register_resident(got):
    """Fragments stayed in registers: no local memory in the PTX, no spills or stack in ptxas."""
    ops, res = got["ops"], got["resources"]
    assert ops["ld.local"] == 0 and ops["st.local"] == 0, "fragments fell into local memory"
    assert res.get("spill_store_bytes", 0) == 0 and res.get("spill_load_bytes", 0) == 0, res
    assert res.get("stack_bytes", 0) == 0, res
    assert got["cubin_bytes"] > 0


# ------------------------------------------------------------------------------- forcing a config

def run_forced_config(q, k, v, causal, skip=None, **override):
    """mma.config for these inputs with ``override`` applied, run through mma.run; returns
    (config, AccuracyReport). Skips when ``skip(device)`` gives a reason, or when the config needs
    more shared memory than the device has."""
    from numflash import plan as planner
    from numflash.cuda import mma
    from numflash.inputs import normalize
    from numflash.testing import check
    p = normalize(q, k, v, causal=causal)
    dev = planner._cuda_device(p)
    why = skip(dev) if skip else None
    if why:
        pytest.skip(why)
    cfg = dataclasses.replace(mma.config(p, dev), **override)
    if mma.shared_bytes(cfg) > dev.smem_per_block_optin:
        pytest.skip(f"{cfg} needs more shared memory than {dev.name} has")
    lse = mma.run(p, cfg, dev)
    return cfg, check(p.out, q, k, v, lse=lse, causal=causal)


# ------------------------------------------------------------------------------- the warp emulator

def tf32_bits(x):
    """cvt.rna.tf32.f32: round to nearest (ties away) at 10 mantissa bits."""
    b = np.asarray(x, np.float32).reshape(()).view(np.uint32)
    b = np.uint32((int(b) + 0x1000) & 0xFFFFE000) if np.isfinite(np.float32(x)) else b
    return np.uint32(b)


def split_tf32_bits(x):
    """ptx.split_tf32: hi = x's bits + 0x1000 (wrapping), lo = x - (hi & ~0x1fff); the mma reads
    both truncated (tf32_operand)."""
    b = int(np.asarray(x, np.float32).reshape(()).view(np.uint32))
    hi = (b + 0x1000) & 0xFFFFFFFF
    with np.errstate(invalid="ignore"):
        lo = np.float32(x) - np.float32(_f(hi & 0xFFFFE000))
    return np.uint32(hi), np.asarray(lo, np.float32).reshape(()).view(np.uint32)


def tf32_operand(bits):
    """The value a tf32 mma reads from a 32-bit register: its low 13 bits are ignored."""
    return _f(int(bits) & 0xFFFFE000)


def _f(bits):
    return float(np.asarray(np.uint32(bits)).view(np.float32))


class _Dim:
    def __init__(self, x):
        self.x, self.y, self.z = x, 0, 0


class Emu:
    """One Python thread per CUDA thread: the warp-collective 16x8x8 mma (tf32 or float64, one
    fragment layout) and shfl go through per-warp barriers, syncthreads through a block barrier,
    cp.async through per-thread commit groups."""

    def __init__(self, NT, grid, shared_bytes, word=np.uint32):
        self.NT, self.grid, self.shared_bytes, self.word = NT, grid, shared_bytes, word
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

    def _mma_16x8x8(self, operand, real, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        got = self._exchange((a0, a1, a2, a3, b0, b1))
        A = np.zeros((16, 8)); Bm = np.zeros((8, 8))
        for lane, (x0, x1, x2, x3, y0, y1) in enumerate(got):
            g, t = lane // 4, lane % 4
            A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] = map(operand, (x0, x1, x2, x3))
            Bm[t, g], Bm[t + 4, g] = operand(y0), operand(y1)
        lane = self.tls.tid % 32
        g, t = lane // 4, lane % 4
        D = A @ Bm
        return (real(c0 + D[g, 2 * t]), real(c1 + D[g, 2 * t + 1]),
                real(c2 + D[g + 8, 2 * t]), real(c3 + D[g + 8, 2 * t + 1]))

    def mma_tf32(self, *args):
        return self._mma_16x8x8(tf32_operand, np.float32, *args)

    def mma_f64(self, *args):
        return self._mma_16x8x8(float, np.float64, *args)

    # cp.async: a copy reads its source when issued and lands in shared memory only when a
    # cp_async_wait lets its commit group complete (per thread), as on the GPU; addresses are
    # (array, row, column) and shared-array indices, both checked for 16-byte alignment
    @staticmethod
    def shared_addr(smem, i):
        return int(i)

    @staticmethod
    def global_addr2(a, i, j):
        return a, int(i), int(j)

    def cp_async_16(self, dst, src, nbytes):
        a, i, j = src
        n = 16 // self.smem.itemsize
        assert dst % n == 0, f"cp.async destination word {dst} is not 16-byte aligned"
        assert (i * a.strides[0] + j * a.strides[1]) % 16 == 0, "cp.async source misaligned"
        data = np.zeros(n, self.smem.dtype)
        got = int(nbytes) // a.itemsize
        data[:got] = a[i, j:j + got]
        self.tls.pending.append((dst, data))

    def cp_async_commit(self):
        self.tls.groups.append(self.tls.pending)
        self.tls.pending = []

    def cp_async_wait(self, n):
        groups = self.tls.groups
        for group in groups[:len(groups) - n]:
            for dst, data in group:
                self.smem[dst:dst + data.size] = data
        self.tls.groups = groups[len(groups) - n:]

    def run(self, fn, args):
        gx, gy = self.grid
        self.grid_dim = _Dim(gx)
        for by in range(gy):
            for bx in range(gx):
                fill = 0xDEADBEEF if self.word is np.uint32 else np.nan
                self.smem = np.full(self.shared_bytes // np.dtype(self.word).itemsize, fill,
                                    self.word)
                self.bar = threading.Barrier(self.NT)
                nw = self.NT // 32
                self.wbar = [threading.Barrier(32) for _ in range(nw)]
                self.wslots = [[None] * 32 for _ in range(nw)]
                errs = []
                blk = _Dim(bx); blk.y = by

                def body(tid):
                    self.tls.tid, self.tls.block = tid, blk
                    self.tls.pending, self.tls.groups = [], []
                    try:
                        fn(*args)
                    except Exception:  # noqa: BLE001 - reported after the join
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


def run_word_kernel(q, k, v, DT, causal=False, causal_offset=0, scale=None, VEC=0, tile=None,
                    window=None):
    """Run mma.kernel_source of operand kind DT "tf32" / "3xtf32" (float32 q, k, v) or "f64"
    (float64) under the emulator; returns (out, lse). VEC=1 runs the cp.async /
    double-buffered staging; ``tile`` (NW, BC, HOLDQ) overrides the default tile; ``window``:
    a sliding window's (left, right) (the WINDOW variant)."""
    from numflash.cuda import mma
    from numflash.cuda.common import key_end
    B, H, Nq, d = q.shape
    dv = v.shape[3]
    D, DV = mma.head_dim_pad(d), mma.head_dim_pad(dv)
    NW, BC, HOLDQ = tile or mma.choose_tile(D, DV, DT)
    cfg = mma.MmaConfig(D, DV, NW, BC, HOLDQ, DT, VEC, WINDOW=int(window is not None))
    src = mma.kernel_source(cfg)
    f64 = DT == "f64"
    real = np.float64 if f64 else np.float32
    word = {"f64": np.float64, "3xtf32": np.float32}.get(DT, np.uint32)
    emu = Emu(cfg.NT, (-(-Nq // cfg.BR), B * H), mma.shared_bytes(cfg), word)
    ns = {"cuda": emu, "math": math, "U": np.uint64, "I": np.int64, "uint32": np.uint32,
          "float32": np.float32, "float64": np.float64,
          "ZERO": real(0), "ONE": real(1), "NEG_INF": real(-np.inf), "FULL": 0xFFFFFFFF,
          "key_end": getattr(key_end, "py_func", key_end),
          "kv_head": lambda h, H, Hkv: h // (H // Hkv),
          "mma_tf32": emu.mma_tf32, "mma_f64": emu.mma_f64, "to_tf32": tf32_bits,
          "split_tf32": split_tf32_bits,
          "shared_addr": emu.shared_addr, "global_addr2": emu.global_addr2,
          "cp_async_16": emu.cp_async_16, "cp_async_commit": emu.cp_async_commit,
          "cp_async_wait_0": lambda: emu.cp_async_wait(0),
          "cp_async_wait_1": lambda: emu.cp_async_wait(1),
          "ex2": np.exp2 if f64 else (lambda x: np.float32(np.exp2(np.float32(x))))}
    exec(compile(src, f"<{DT} emu>", "exec"), ns)
    out = np.full((B, H, Nq, dv), np.nan, real)
    lse = np.full((B, H, Nq), np.nan, real)  # numflash's lse is float64 for float64 inputs
    scale = 1 / math.sqrt(d) if scale is None else scale
    with np.errstate(all="ignore"):
        emu.run(ns["mma_attention"], (q, k, v, out, lse, None, scale * math.log2(math.e), scale,
                                      int(causal), int(causal_offset)) + tuple(window or ()))
    return out, lse
