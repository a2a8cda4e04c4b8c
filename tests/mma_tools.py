"""Test tools for the tensor-core kernel (numflash.cuda.mma), shared by tests/test_mma_*.py and
tests/test_gqa.py:

- ``tile_config``: the MmaConfig the planner's tile tables give a kind, head dims and GPU.
- ``compile_variant`` / ``assert_register_resident``: compile one variant to a cubin with no GPU
  and read its PTX and ptxas report.
- ``run_forward_kernel`` / ``run_backward_kernels``: run the generated source of any operand kind
  (16-bit with ldmatrix, tf32, 3xTF32, float64) on the CPU under an emulator of the warp
  (``Emu``), with the PTX ISA fragment layouts; ``tf32_bits``,
  ``split_tf32_bits``, ``tf32_operand``: the emulator's tf32 roundings, bit for bit.
- ``run_forced_config``: run a config other than the planner's on whatever GPU runs the tests.
- ``run_wgmma_forward`` / ``compile_wgmma_variant``: the same for cuda.wgmma (the emulator's
  warpgroup products read the descriptors' swizzled layouts; byte-offset pointers for its
  copies).
"""
import ctypes
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
    parts += ["varlen"] if cfg.VARLEN else []
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
    args += (types.Array(types.int32, 1, "A"),) * 2 if cfg.get("VARLEN") else ()  # cu_q, cu_k
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


_COMPILE_WGMMA = textwrap.dedent("""
    import json, re, sys
    import numpy as np
    from numflash.cuda import launch, wgmma
    from numflash.cuda.mma import signature
    from numflash.cuda.wgmma.tiles import blocks_per_sm
    cfg, mods_name = json.loads(sys.argv[1]), sys.argv[2]
    if mods_name:   # test_mma_mods' named modifications, as the token of a 2 x 4 x 128 call
        sys.path.insert(0, sys.argv[3])
        from test_mma_mods import _options
        from numflash import mods
        from numflash.cuda.mma import mods as kernel_mods
        d = cfg["D"]
        opts = _options(mods_name, 2, 4, 128, 128, np.random.default_rng(0))
        cfg["MODS"] = kernel_mods.token_for(mods.build((2, 4, 128, 128, d, d), "numpy", 0,
                                                       **opts))
    fn = wgmma.make_kernel(**cfg)
    dtype = "float16" if cfg["DT"] == "f16" else "bfloat16"
    cubin, entry, ptx, res = launch.compile_to_cubin(
        fn, signature(dtype, bool(cfg.get("WINDOW")), cfg.get("MODS", ""),
                      varlen=bool(cfg.get("VARLEN"))), (9, 0))
    ops = {m: ptx.count(m) for m in set(re.findall(r"wgmma\\.mma_async[\\w.]+", ptx))}
    ops.update({op: ptx.count(op) for op in ("ld.local", "st.local")})
    print(json.dumps({"resources": res, "ops": ops, "cubin_bytes": len(cubin),
                      "target": re.search(r"^\\.target \\S+", ptx, re.M).group(0),
                      "serialized": str(res.get("wgmma_serialized", "")),
                      "blocks_per_sm": blocks_per_sm(wgmma.WgmmaConfig(**cfg))}))
""")


def compile_wgmma_variant(cfg, mods_name=""):
    """Compile one cuda.wgmma variant (a mapping of WgmmaConfig's fields; ``mods_name``: one of
    test_mma_mods.MODS, compiled in as MODS) for sm_90a in a subprocess: ptxas's resources, the
    PTX target, how often each wgmma and ld / st.local occur, ptxas's wgmma-serialization
    code ("" when it serializes nothing) and the blocks an SM the config is sized for."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _COMPILE_WGMMA, json.dumps(dict(cfg)), mods_name,
                          str(ROOT / "tests")], env=env, capture_output=True, text=True,
                         timeout=900)
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


class DeviceView:
    """A NumPy array as planning sees a device array: shape, dtype, strides and a pointer
    (nothing is launched)."""

    def __init__(self, a, ptr=0):
        self.shape, self.dtype, self.strides, self.itemsize = a.shape, a.dtype, a.strides, \
            a.itemsize
        self.data = type("Pointer", (), {"ptr": ptr})()


class _Ptr:
    """A byte address inside a NumPy array (the emulator's global pointers)."""

    def __init__(self, array, off):
        self.array, self.off = array, int(off)
        # the bytes from the array's first element to one past its last
        self.extent = sum((n - 1) * st for n, st in zip(array.shape, array.strides)) + \
            array.itemsize

    def __add__(self, n):
        return _Ptr(self.array, self.off + int(n))

    __radd__ = __add__


class Emu:
    """One Python thread per CUDA thread: the warp-collective 16x8x8 mma (tf32 or float64, one
    fragment layout) and shfl go through per-warp barriers, syncthreads through a block barrier,
    cp.async through per-thread commit groups."""

    def __init__(self, NT, grid, shared_bytes, word=np.uint32):
        self.NT, self.grid, self.shared_bytes, self.word = NT, grid, shared_bytes, word
        self.tls = threading.local()
        self.atomic_lock = threading.Lock()

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
            def array(n, dtype):   # every dynamic shared array aliases one buffer
                return emu.smem.view(dtype)
        return S

    def syncthreads(self):
        self.bar.wait()

    @property
    def atomic(self):
        emu = self

        class A:
            @staticmethod
            def add(array, index, value):
                with emu.atomic_lock:
                    old = array[index]
                    array[index] = old + value
                return old
        return A

    def red_add_f32x4(self, addr, *values):
        """ptx_reduce.red_add_f32x4: four float32 adds at (array, row, column) or at a byte
        pointer (global_ptr) into a 2-d float32 array, as one atomic."""
        if isinstance(addr, _Ptr):
            array = addr.array
            i, j = divmod(addr.off, array.strides[0])
            assert j % array.strides[1] == 0
            addr = array, i, j // array.strides[1]
        array, i, j = addr
        assert (i * array.strides[0] + j * array.strides[1]) % 16 == 0, "red.v4 misaligned"
        with self.atomic_lock:
            for c, x in enumerate(values):
                array[i, j + c] += np.float32(x)

    def _exchange(self, value):
        w = self.tls.tid // 32
        slots = self.wslots[w]
        slots[self.tls.tid % 32] = value
        self.wbar[w].wait()
        got = list(slots)
        self.wbar[w].wait()
        return got

    def shfl_sync(self, mask, value, src_lane):
        return self._exchange(value)[int(src_lane) % 32]

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

    def _mma_16x8x16(self, half, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """mma.sync.m16n8k16 with 16-bit operands packed two to a register (low half = lower
        index), float32 accumulators (the PTX ISA's fragment layout)."""
        got = self._exchange((a0, a1, a2, a3, b0, b1))
        A = np.zeros((16, 16)); Bm = np.zeros((16, 8))
        for lane, (x0, x1, x2, x3, y0, y1) in enumerate(got):
            g, t = lane // 4, lane % 4
            for (row, col), word in zip(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                         (g + 8, 2 * t + 8)), (x0, x1, x2, x3)):
                A[row, col], A[row, col + 1] = half(word)
            Bm[2 * t, g], Bm[2 * t + 1, g] = half(y0)
            Bm[2 * t + 8, g], Bm[2 * t + 9, g] = half(y1)
        lane = self.tls.tid % 32
        g, t = lane // 4, lane % 4
        D = A @ Bm
        return (np.float32(c0 + D[g, 2 * t]), np.float32(c1 + D[g, 2 * t + 1]),
                np.float32(c2 + D[g + 8, 2 * t]), np.float32(c3 + D[g + 8, 2 * t + 1]))

    def mma_f16(self, *args):
        return self._mma_16x8x16(f16_halves, *args)

    def mma_bf16(self, *args):
        return self._mma_16x8x16(bf16_halves, *args)

    # ldmatrix.x4: lane 8m + r gives the byte address of row r of 8x8 matrix m (16-bit
    # elements); lane (g, t) receives word t of row g of each matrix, or with .trans the
    # elements (2t, g) and (2t + 1, g)
    def ldmatrix_x4(self, addr):
        rows = self._exchange(int(addr))
        lane = self.tls.tid % 32
        words = self.smem.view(np.uint32)
        for r in rows:
            assert r % 16 == 0, f"ldmatrix row address {r} is not 16-byte aligned"
        return tuple(np.uint32(words[rows[8 * m + lane // 4] // 4 + lane % 4]) for m in range(4))

    def ldmatrix_x4_trans(self, addr):
        rows = self._exchange(int(addr))
        lane = self.tls.tid % 32
        halves = self.smem.view(np.uint16)
        g, t = lane // 4, lane % 4
        out = []
        for m in range(4):
            lo = int(halves[rows[8 * m + 2 * t] // 2 + g])
            hi = int(halves[rows[8 * m + 2 * t + 1] // 2 + g])
            out.append(np.uint32(lo | hi << 16))
        return tuple(out)

    # wgmma (numflash.cuda.ptx_wgmma): a warpgroup's product, operands in shared memory through
    # descriptors (_desc_matrix: no swizzle or 128-byte swizzle) or A in registers (mma.sync's
    # A layout, warp w giving rows 16 w ..); the warpgroup's first thread computes D (float64
    # sums rounded to float32 once) and each thread takes its C-layout part
    def _wg_exchange(self, value):
        wg = self.tls.tid // 128
        slots = self.gslots[wg]
        slots[self.tls.tid % 128] = value
        self.gbar[wg].wait()
        got = list(slots)
        self.gbar[wg].wait()
        return got

    def _desc_matrix(self, desc, rows, cols, halves, mn_major=False):
        """The rows x cols 16-bit matrix a descriptor addresses (K-major: rows along M / N, cols
        along K; ``mn_major``: rows along K, cols along N). No swizzle: 8 x 8 core matrices of
        128 contiguous bytes (LBO: the next one along K, SBO: along M / N). 128-byte swizzle:
        128-byte rows (K-major: a row's elements along K; MN-major: along N), 8 rows an atom
        (SBO: the next atom along M / N, K-major, or along K, MN-major; LBO: MN-major's next
        64 columns), each 16-byte chunk at chunk ^ (address bits 7-9), absolute addresses."""
        desc = int(desc)
        start, lbo, sbo = (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, \
            ((desc >> 32) & 0x3FFF) << 4
        mode = desc >> 62
        assert mode in (0, 1), "the emulator reads no-swizzle and 128-byte swizzled layouts"
        i, j = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        if mode == 1 and mn_major:   # i: k, j: n
            byte = start + (i // 8) * sbo + (i % 8) * 128 + (j // 64) * lbo + (j % 64) * 2
        elif mode == 1:              # i: m / n, j: k (one k-step stays inside a 128-byte row)
            assert cols * 2 + start % 128 <= 128
            byte = start + (i // 8) * sbo + (i % 8) * 128 + j * 2
        elif mn_major:
            byte = start + (j // 8) * sbo + (j % 8) * 2 + (i // 8) * lbo + (i % 8) * 16
        else:
            byte = start + (i // 8) * sbo + (i % 8) * 16 + (j // 8) * lbo + (j % 8) * 2
        if mode == 1:
            byte = byte ^ (((byte >> 7) & 7) << 4)
        assert byte.max() + 2 <= self.smem.nbytes, "a descriptor reads past shared memory"
        bits = self.smem.view(np.uint16)[byte // 2]
        return halves(bits)

    def _wg_fragment(self, D):
        w, lane = (self.tls.tid % 128) // 32, self.tls.tid % 32
        g, t = lane // 4, lane % 4
        out = []
        for j in range(D.shape[1] // 8):
            for row, col in ((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)):
                out.append(np.float32(D[16 * w + row, 8 * j + col]))
        return tuple(out)

    def wgmma_ss(self, n, halves, trans_a=False, trans_b=False):
        def a_matrix(a):
            return self._desc_matrix(a, 16, 64, halves, True).T if trans_a else \
                self._desc_matrix(a, 64, 16, halves)

        def b_matrix(b):
            return self._desc_matrix(b, 16, n, halves, True) if trans_b else \
                self._desc_matrix(b, n, 16, halves).T

        def product(a_descs, b_descs):
            D = None
            if self.tls.tid % 128 == 0:
                D = sum(a_matrix(a) @ b_matrix(b) for a, b in zip(a_descs, b_descs))
            return self._wg_fragment(self._wg_exchange(D)[0])
        return product

    def wgmma_rs(self, n, halves, trans_b):
        def product(acc, a, b_descs):
            got = self._wg_exchange(tuple(a))
            D = None
            if self.tls.tid % 128 == 0:
                steps = len(b_descs)
                A = np.zeros((64, 16 * steps))
                for tid, words in enumerate(got):
                    w, lane = tid // 32, tid % 32
                    g, t = lane // 4, lane % 4
                    for s in range(steps):
                        for r, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t),
                                                        (g, 2 * t + 8), (g + 8, 2 * t + 8))):
                            lo, hi = halves(np.array([int(words[4 * s + r])], np.uint32)
                                            .view(np.uint16))
                            A[16 * w + row, 16 * s + col:16 * s + col + 2] = lo, hi
                B = np.concatenate([self._desc_matrix(b, 16, n, halves, trans_b)
                                    if trans_b else self._desc_matrix(b, n, 16, halves).T
                                    for b in b_descs])
                D = A @ B
            D = self._wg_exchange(D)[0]
            mine = self._wg_fragment(D)
            return tuple(np.float32(np.float64(c) + x) for c, x in zip(acc, mine))
        return product

    # cp.async: a copy reads its source when issued and lands in shared memory only when a
    # cp_async_wait lets its commit group complete (per thread), as on the GPU; addresses are
    # (array, row, column) and shared byte addresses, both checked for 16-byte alignment
    def shared_addr(self, smem, i):
        return int(i) * smem.itemsize

    @staticmethod
    def global_addr2(a, i, j):
        return a, int(i), int(j)

    @staticmethod
    def global_ptr(a, i, j):
        """global_addr2 as an address that takes byte offsets (cuda.wgmma's staging)."""
        return _Ptr(a, int(i) * a.strides[0] + int(j) * a.strides[1])

    def cp_async_16(self, dst, src, nbytes):
        if isinstance(src, _Ptr):
            assert dst % 16 == 0 and src.off % 16 == 0, "cp.async misaligned"
            raw = np.zeros(16, np.uint8)
            if int(nbytes):
                assert 0 <= src.off and src.off + 16 <= src.extent, "cp.async reads past the array"
                raw[:] = np.frombuffer(ctypes.string_at(src.array.ctypes.data + src.off, 16),
                                       np.uint8)
            self.tls.pending.append((dst // self.smem.itemsize, raw.view(self.smem.dtype)))
            return
        a, i, j = src
        assert dst % 16 == 0, f"cp.async destination byte {dst} is not 16-byte aligned"
        assert (i * a.strides[0] + j * a.strides[1]) % 16 == 0, "cp.async source misaligned"
        raw = np.zeros(16, np.uint8)
        got = int(nbytes) // a.itemsize
        raw[:got * a.itemsize] = np.ascontiguousarray(a[i, j:j + got]).view(np.uint8)
        self.tls.pending.append((dst // self.smem.itemsize, raw.view(self.smem.dtype)))

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
        gx, gy, gz = (tuple(self.grid) + (1,))[:3]
        self.grid_dim = _Dim(gx)
        self.grid_dim.y, self.grid_dim.z = gy, gz
        for by, bz in ((y, z) for z in range(gz) for y in range(gy)):
            for bx in range(gx):
                fill = 0xDEADBEEF if self.word is np.uint32 else np.nan
                self.smem = np.full(self.shared_bytes // np.dtype(self.word).itemsize, fill,
                                    self.word)
                self.bar = threading.Barrier(self.NT)
                nw = self.NT // 32
                self.wbar = [threading.Barrier(32) for _ in range(nw)]
                self.wslots = [[None] * 32 for _ in range(nw)]
                ng = max(1, self.NT // 128)   # warpgroups (wgmma's unit)
                self.gbar = [threading.Barrier(min(128, self.NT)) for _ in range(ng)]
                self.gslots = [[None] * 128 for _ in range(ng)]
                errs = []
                blk = _Dim(bx); blk.y, blk.z = by, bz

                def body(tid):
                    self.tls.tid, self.tls.block = tid, blk
                    self.tls.pending, self.tls.groups = [], []
                    try:
                        fn(*args)
                    except Exception:  # noqa: BLE001 - reported after the join
                        import traceback
                        errs.append(traceback.format_exc())
                        self.bar.abort()
                        for b in self.wbar + self.gbar:
                            b.abort()
                ths = [threading.Thread(target=body, args=(i,)) for i in range(self.NT)]
                for th in ths:
                    th.start()
                for th in ths:
                    th.join()
                if errs:
                    raise RuntimeError(errs[0])


def f16_halves(word):
    """The two float16 values of a packed register (low half first)."""
    return tuple(float(x) for x in np.array([int(word)], np.uint32).view(np.float16))


def f16_values(bits):
    """float16 bit patterns (uint16 array) -> float64 values."""
    return np.asarray(bits, np.uint16).view(np.float16).astype(np.float64)


def bf16_values(bits):
    return (np.asarray(bits, np.uint32) << 16).view(np.float32).astype(np.float64)


def bf16_halves(word):
    w = int(word)
    return tuple(float(np.array([x << 16], np.uint32).view(np.float32)[0])
                 for x in (w & 0xFFFF, w >> 16))


def pack_f16x2(a, b):
    """cvt.rn.f16x2.f32 as numflash.cuda.ptx.pack_f16x2 uses it: a in the low half."""
    lo, hi = np.array([a, b], np.float32).astype(np.float16).view(np.uint16)
    return np.uint32(int(lo) | int(hi) << 16)


def _bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even (NaN kept NaN)."""
    bits = int(np.array([x], np.float32).view(np.uint32)[0])
    if np.isnan(x):
        return (bits >> 16) | 0x40
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def pack_bf16x2(a, b):
    return np.uint32(_bf16_bits(a) | _bf16_bits(b) << 16)


def emulator_namespace(emu, DT):
    """The names generated cuda.mma source calls, bound to the emulator for operand kind DT."""
    from numflash.cuda.common import key_end
    f64 = DT == "f64"
    real = np.float64 if f64 else np.float32
    return {"cuda": emu, "math": math, "U": np.uint64, "I": np.int64, "uint32": np.uint32,
            "uint16": np.uint16, "float32": np.float32, "float64": np.float64,
            "ZERO": real(0), "ONE": real(1), "NEG_INF": real(-np.inf), "INF": real(np.inf),
            "LOG2E": real(np.log2(np.e)), "FULL": 0xFFFFFFFF,
            "key_end": getattr(key_end, "py_func", key_end),
            "kv_head": lambda h, H, Hkv: h // (H // Hkv),
            "mma_tf32": emu.mma_tf32, "mma_f64": emu.mma_f64, "mma_f16": emu.mma_f16,
            "mma_bf16": emu.mma_bf16, "to_tf32": tf32_bits, "split_tf32": split_tf32_bits,
            "pack_f16x2": pack_f16x2, "pack_bf16x2": pack_bf16x2,
            "ldmatrix_x4": emu.ldmatrix_x4, "ldmatrix_x4_trans": emu.ldmatrix_x4_trans,
            "shared_addr": emu.shared_addr, "global_addr2": emu.global_addr2,
            "red_add_f32x4": emu.red_add_f32x4,
            "cp_async_16": emu.cp_async_16, "cp_async_commit": emu.cp_async_commit,
            "cp_async_wait_0": lambda: emu.cp_async_wait(0),
            "cp_async_wait_1": lambda: emu.cp_async_wait(1),
            "ex2": np.exp2 if f64 else (lambda x: np.float32(np.exp2(np.float32(x))))}


def as_kernel_array(a, DT):
    """An input as the kernel of kind DT reads it (16-bit kinds: the uint16 bits)."""
    return a.view(np.uint16) if DT in ("f16", "bf16") else a


def with_mods(ns, token, DT):
    """An emulator namespace with the modifications of MODS token ``token`` as plain Python."""
    if token:
        from numflash.cuda.mma import mods
        ns.update(mods.namespace(token, np.float64 if DT == "f64" else np.float32))
    return ns


def _mods_setup(mods, window):
    """(token, window, extra kernel arguments) of a numflash.mods.Mods (or None) and a window."""
    from numflash.cuda.mma import mods as kernel_mods
    if mods is not None and window is None:
        window = mods.window
    token = kernel_mods.token_for(mods)
    extra = list(window or ()) + list(kernel_mods.arguments(mods) if token else ())
    return token, window, extra


def _packed_setup(varlen):
    """(cu_q, cu_k, the causal_offset argument, longest query and key run) of run_*'s
    ``varlen``."""
    cu_q, cu_k, bottom_right = varlen
    return (np.asarray(cu_q, np.int32), np.asarray(cu_k, np.int32), int(bottom_right),
            int(np.diff(cu_q).max()), int(np.diff(cu_k).max()))


def with_dropout(ns, cfg):
    """An emulator namespace with a DROP variant's generator as plain Python (NumPy uint64)."""
    from numflash.cuda.mma import dropout
    ns.update(dropout.namespace(cfg))
    return ns


def _dropout_arguments(dropout):
    """The kernel's dropout arguments of a numflash.dropout.Dropout (or None: none)."""
    return list(dropout.arguments()) if dropout is not None else []


def run_backward_kernels(q, k, v, do, o, lse, DT, causal=False, causal_offset=0, scale=None,
                         tiles=None, window=None, mods=None, chunks=0, varlen=None, grad32=False,
                         dropout=None, bias_grad=None, dqadd="", mod_args_grad=False):
    """Run cuda.mma's generated backward source of kind DT (both passes) under the emulator;
    q, k, v, do, o in the kind's dtype (16-bit as float16 or ml_dtypes.bfloat16), lse as
    attention returns it. ``tiles``: {"queries": (NW, BC), "keys": (NW, BC[, SUB])}. Returns dq,
    dk, dv in the inputs' dtype (``grad32``: the GRAD32 variant's float32). ``window``: a
    sliding window's (left, right) (WINDOW variants);
    ``mods``: a numflash.mods.Mods (its window, and the MODS variant for the rest); ``chunks``:
    the CHUNKS variant's column slices (grid z); ``varlen``: (cu_q, cu_k, bottom_right) for the
    VARLEN variant (the arrays then hold the packed rows, batch 1); ``dropout``: a
    numflash.dropout.Dropout (the DROP variant); ``bias_grad``: the key pass's DBIAS mode
    (backward.BIAS_MODES; ``mods`` has an attn_bias): attn_bias's gradient, in its shape, is
    returned fourth. ``dqadd``: the DQADD variants (the key pass adds dQ into a float32
    accumulator, the query pass computes delta only). ``mod_args_grad``: the MARGS key pass
    (``mods`` has score_mod_args_grad): mod_args' gradients are returned last, a tuple aligned
    with the user's mod_args (float64; None where none is taken)."""
    token, window, extra = _mods_setup(mods, window)
    from numflash.cuda.mma import mods as kernel_mods
    arg_token = kernel_mods.arg_grad_token(mods) if mod_args_grad else ""
    extra += _dropout_arguments(dropout)
    if varlen is not None:   # after the window's arguments, before the mods'
        cu_q, cu_k, causal_offset, max_q, max_k = _packed_setup(varlen)
        extra[len(window or ()):len(window or ())] = [cu_q, cu_k]
    from numflash.cuda.mma import MmaConfig, backward, head_dim_pad
    B, H, Nq, d = q.shape
    Hkv, Nk, dv = k.shape[1], k.shape[2], v.shape[3]
    D, DV = head_dim_pad(d), head_dim_pad(dv)
    scale = 1 / math.sqrt(d) if scale is None else scale
    real = np.float64 if DT == "f64" else np.float32
    delta = np.full((B, H, Nq), np.nan, real)   # the query pass writes rowsum(dO * O)
    word = {"f64": np.float64, "3xtf32": np.float32}.get(DT, np.uint32)
    grads = {name: np.full(shape, np.nan, np.float32 if grad32 else q.dtype) for name, shape in
             (("dq", q.shape), ("dk", k.shape), ("dv", v.shape))}
    form = "m16n8k8" if DT == "f64" else None
    for kernel in ("queries", "keys"):
        NW, BC, *sub = (tiles or {}).get(kernel, (2, 32))
        cfg = MmaConfig(D, DV, NW, BC, 0, DT, 1, MMA=form, SUB=sub[0] if sub else 0,
                        WINDOW=int(window is not None), MODS=token, CHUNKS=chunks,
                        VARLEN=int(varlen is not None), GRAD32=int(grad32),
                        DROP=int(dropout is not None),
                        DBIAS=bias_grad if kernel == "keys" and bias_grad else "",
                        DQADD=dqadd, MARGS=arg_token if kernel == "keys" else "")
        src = backward.SOURCES[kernel](cfg)
        rows = Nq if kernel == "queries" else Nk
        count = B
        if varlen is not None:   # grid y: each sequence's heads, x: the longest's blocks
            rows, count = (max_q if kernel == "queries" else max_k), len(cu_q) - 1
        grid = (-(-rows // cfg.BR), count * (H if kernel == "queries" else Hkv))
        emu = Emu(cfg.NT, grid + ((chunks,) if chunks else ()),
                  backward.shared_bytes(cfg, kernel), word)
        ns = with_dropout(with_mods(emulator_namespace(emu, DT), token, DT), cfg)
        if cfg.DBIAS or cfg.MARGS:
            ns.update(kernel_mods.grad_namespace(token, real, bias=bool(cfg.DBIAS),
                                                 args=bool(cfg.MARGS)))
        if cfg.MARGS:
            ns.update(kernel_mods.arg_grad_namespace(arg_token))
        exec(compile(src, f"<{DT} backward {kernel} emu>", "exec"), ns)
        outs = [grads["dq"]] if kernel == "queries" else [grads["dk"], grads["dv"]]
        inputs = (q, k, v, do, o) if kernel == "queries" else (q, k, v, do)
        args = [as_kernel_array(a, DT) for a in inputs] + [lse.astype(real), delta]
        args += [g if grad32 else as_kernel_array(g, DT) for g in outs]
        args += [scale * math.log2(math.e), scale, int(causal), int(causal_offset)]
        args += extra
        if cfg.DBIAS:
            from numflash.mods import bias_grad_accumulator
            acc_dtype = np.dtype(backward.bias_accumulator_type(bias_grad, DT))
            acc, view = bias_grad_accumulator(np, np.empty(mods.bias[1], acc_dtype),
                                              (B, H, Nq, Nk), acc_dtype)
            args.append(view)
        if cfg.MARGS:
            user_args = mods.user_args
            trained = dict(mods.arg_grads)
            arg_accs = [np.zeros(np.shape(a)) if n in trained else None
                        for n, a in enumerate(user_args)]
            bad = np.zeros(1, np.int32)
            args += [a for a in arg_accs if a is not None] + [bad]
        if dqadd and kernel == "keys":
            dq_acc = np.zeros(q.shape[:3] + (D,), np.float32)
            args.append(dq_acc)
        with np.errstate(all="ignore"):
            emu.run(ns[backward.KERNEL_NAMES[kernel]], tuple(args))
    if dqadd:
        grads["dq"][...] = dq_acc[..., :d].astype(grads["dq"].dtype)
    out = (grads["dq"], grads["dk"], grads["dv"])
    if bias_grad:
        out += (acc.reshape(mods.bias[1]),)
    if mod_args_grad:
        if bad[0]:
            raise IndexError("the MARGS key pass flagged an index outside a mod_args array")
        out += (tuple(arg_accs),)
    return out


def run_forward_kernel(q, k, v, DT, causal=False, causal_offset=0, scale=None, VEC=0, tile=None,
                       window=None, mods=None, splits=None, kvcache=None, varlen=None,
                       dropout=None):
    """Run mma.kernel_source of operand kind DT under the emulator: "tf32" / "3xtf32" (float32
    q, k, v), "f64" (float64), "f16" / "bf16" (float16 / ml_dtypes.bfloat16); returns (out,
    lse). VEC=1 runs the cp.async / double-buffered staging (16-bit kinds: with ldmatrix);
    ``tile`` (NW, BC, HOLDQ) overrides the default tile; ``window``: a sliding window's (left,
    right) (the WINDOW variant); ``mods``: a numflash.mods.Mods (its window, and the MODS
    variant for the rest); ``splits``: run the split-KV variant (SPLIT) with this many shares
    and return its partials, (splits, B, H, Nq, dv) and (splits, B, H, Nq), in float32 (float64
    for f64); ``kvcache``: (kv_lens, block_table or None, page or 0) for the KVLEN / PAGE
    variant (k, v then hold every page's rows, the batch axis broadcast); ``varlen``: (cu_q,
    cu_k, bottom_right) for the VARLEN variant (q, k, v hold the packed rows, batch 1);
    ``dropout``: a numflash.dropout.Dropout (the DROP variant)."""
    from numflash.cuda import mma
    token, window, extra = _mods_setup(mods, window)
    extra += _dropout_arguments(dropout)
    if kvcache is not None:   # the cache's arguments come after the window's
        lens, table, page = kvcache
        at = len(window or ())
        extra[at:at] = [lens] + ([table] if page else [])
    if varlen is not None:   # then packed sequences' offsets
        cu_q, cu_k, causal_offset, max_q, _ = _packed_setup(varlen)
        at = len(window or ())
        extra[at:at] = [cu_q, cu_k]
    B, H, Nq, d = q.shape
    dv = v.shape[3]
    D, DV = mma.head_dim_pad(d), mma.head_dim_pad(dv)
    NW, BC, HOLDQ = tile or mma.choose_tile(D, DV, DT)
    cfg = mma.MmaConfig(D, DV, NW, BC, HOLDQ, DT, VEC, WINDOW=int(window is not None),
                        MODS=token, SPLIT=int(splits is not None),
                        KVLEN=int(kvcache is not None), PAGE=kvcache[2] if kvcache else 0,
                        VARLEN=int(varlen is not None), DROP=int(dropout is not None))
    src = mma.kernel_source(cfg)
    real = np.float64 if DT == "f64" else np.float32
    word = {"f64": np.float64, "3xtf32": np.float32}.get(DT, np.uint32)
    grid = (-(-Nq // cfg.BR), B * H) + ((splits,) if splits is not None else ())
    if varlen is not None:
        grid = (-(-max_q // cfg.BR), (len(cu_q) - 1) * H)
    emu = Emu(cfg.NT, grid, mma.shared_bytes(cfg), word)
    ns = with_dropout(with_mods(emulator_namespace(emu, DT), token, DT), cfg)
    exec(compile(src, f"<{DT} emu>", "exec"), ns)
    if splits is not None:   # the partials, written as floats
        out = np.full((splits, B, H, Nq, dv), np.nan, real)
        lse = np.full((splits, B, H, Nq), np.nan, real)
        scale = 1 / math.sqrt(d) if scale is None else scale
        args = tuple(as_kernel_array(a, DT) for a in (q, k, v)) + (out,)
        with np.errstate(all="ignore"):
            emu.run(ns["mma_attention"], args + (lse, None, scale * math.log2(math.e), scale,
                                                 int(causal), int(causal_offset)) + tuple(extra))
        return out, lse
    out = np.full((B, H, Nq, dv), np.nan, q.dtype if DT in ("f16", "bf16") else real)
    lse = np.full((B, H, Nq), np.nan, real)  # numflash's lse is float64 for float64 inputs
    scale = 1 / math.sqrt(d) if scale is None else scale
    args = tuple(as_kernel_array(a, DT) for a in (q, k, v, out))
    with np.errstate(all="ignore"):
        emu.run(ns["mma_attention"], args + (lse, None, scale * math.log2(math.e), scale,
                                             int(causal), int(causal_offset)) + tuple(extra))
    return out, lse


def run_wgmma_forward(q, k, v, causal=False, causal_offset=0, scale=None, tile=(1, 32),
                      varlen=None, mods=None):
    """Run cuda.wgmma's generated forward source under the emulator (wgmma as Emu.wgmma_*,
    in-flight products computed at issue); q, k, v float16 or ml_dtypes.bfloat16; ``tile``:
    (NWG, BC); ``varlen``: (cu_q, cu_k, bottom_right) for the VARLEN variant (the arrays hold
    the packed rows, batch 1); ``mods``: a numflash.mods.Mods (the MODS variant for its
    modifications, WINDOW for its window). Returns (out, lse)."""
    from numflash.cuda.wgmma import WgmmaConfig, kernel_source, shared_bytes
    from numflash.cuda.wgmma.tiles import head_dim_pad
    B, H, Nq, d = q.shape
    dv = v.shape[3]
    DT = "f16" if q.dtype == np.float16 else "bf16"
    token, window, extra = _mods_setup(mods, None)
    window = list(window or ())   # (the window's sizes lead extra: they precede cu_q, cu_k)
    cfg = WgmmaConfig(head_dim_pad(d), head_dim_pad(dv), *tile, DT,
                      VARLEN=int(varlen is not None), MODS=token, WINDOW=int(bool(window)))
    scale = 1 / math.sqrt(d) if scale is None else scale
    grid, packing = (-(-Nq // cfg.BR), B * H), ()
    if varlen is not None:   # grid y: each sequence's heads, x: the longest's query blocks
        cu_q, cu_k, causal_offset, max_q, _ = _packed_setup(varlen)
        grid, packing = (-(-max_q // cfg.BR), (len(cu_q) - 1) * H), (cu_q, cu_k)
    emu = Emu(cfg.NT, grid, shared_bytes(cfg))
    ns = with_mods(emulator_namespace(emu, DT), token, DT)
    halves = f16_values if DT == "f16" else bf16_values
    ns.update(wgmma_qk=emu.wgmma_ss(cfg.BC, halves), wgmma_pv=emu.wgmma_rs(cfg.DV, halves, True),
              wgmma_qk_async=emu.wgmma_ss(cfg.BC, halves),
              wgmma_pv_async=emu.wgmma_rs(cfg.DV, halves, True),
              wgmma_wait_s=tuple, wgmma_wait_o=tuple, fence_proxy_async=lambda: None,
              div_u32=lambda a, b: np.uint32(int(a) // int(b)), global_addr2=emu.global_ptr,
              rcp_approx=lambda x: np.float32(1) / np.float32(x))
    exec(compile(kernel_source(cfg), f"<wgmma {DT} emu>", "exec"), ns)
    out = np.full((B, H, Nq, dv), np.nan, q.dtype)
    lse = np.full((B, H, Nq), np.nan, np.float32)
    with np.errstate(all="ignore"):
        emu.run(ns["wgmma_attention"], (as_kernel_array(q, DT), as_kernel_array(k, DT),
                                        as_kernel_array(v, DT), as_kernel_array(out, DT), lse,
                                        np.zeros((1, 1, 1, 1), np.float32),
                                        scale * math.log2(math.e), scale, int(causal),
                                        int(causal_offset)) + tuple(window) + packing +
                tuple(extra[len(window):]))
    return out, lse


def run_wgmma_backward(do, q, k, v, o, lse, causal=False, causal_offset=0, scale=None, NWG=2,
                       DQ=None, varlen=None, mods=None):
    """Run cuda.wgmma's generated key pass (dQ by adds) under the emulator: delta = rowsum(dO O)
    in float32 (the delta pass's), a zeroed float32 dQ accumulator, then dQ rounded to the
    inputs' dtype as the operator's copy rounds it. ``varlen``: (cu_q, cu_k, bottom_right) for
    the VARLEN variant (the arrays hold the packed rows, batch 1); ``mods``: a numflash.mods.Mods
    (its window: the WINDOW variant; the MODS variant for the rest). Returns (dq, dk, dv)."""
    from numflash.cuda.wgmma.backward import WgmmaBackwardConfig, kernel_source, shared_bytes
    from numflash.cuda.wgmma.tiles import head_dim_pad
    B, H, Nq, d = q.shape
    Hkv, Nk, dv = k.shape[1], k.shape[2], v.shape[3]
    DT = "f16" if q.dtype == np.float16 else "bf16"
    D, DV = head_dim_pad(d), head_dim_pad(dv)
    DQ = DQ or ("split" if D == 128 else "alternate")
    token, window, extra = _mods_setup(mods, None)   # (the window's sizes lead extra)
    cfg = WgmmaBackwardConfig(D, DV, NWG, 64, DT, DQ, VARLEN=int(varlen is not None),
                              MODS=token, WINDOW=int(window is not None))
    scale = 1 / math.sqrt(d) if scale is None else scale
    grid, packing = (-(-Nk // cfg.BR), B * Hkv), ()
    if varlen is not None:   # grid y: each sequence's K/V heads, x: the longest's key blocks
        cu_q, cu_k, causal_offset, _, max_k = _packed_setup(varlen)
        grid, packing = (-(-max_k // cfg.BR), (len(cu_q) - 1) * Hkv), (cu_q, cu_k)
    emu = Emu(cfg.NT, grid, shared_bytes(cfg))
    ns = with_mods(emulator_namespace(emu, DT), token, DT)
    halves = f16_values if DT == "f16" else bf16_values
    ns.update(wgmma_s=emu.wgmma_ss(cfg.BC, halves), wgmma_dp=emu.wgmma_ss(cfg.BC, halves),
              wgmma_dv=emu.wgmma_rs(cfg.DV, halves, True),
              wgmma_dk=emu.wgmma_rs(cfg.D, halves, True),
              wgmma_dq=emu.wgmma_ss(cfg.dq_columns, halves, True, True),
              fence_proxy_async=lambda: None, global_addr2=emu.global_ptr,
              div_u32=lambda a, b: np.uint32(int(a) // int(b)),
              **{name: tuple for name in ("wait_s", "wait_dp", "wait_dp_0", "wait_dv_2",
                                          "wait_dv_1", "wait_dk_1", "wait_dk_0", "wait_dq")})
    exec(compile(kernel_source(cfg), f"<wgmma backward {DT} emu>", "exec"), ns)
    delta = (do.astype(np.float32) * o.astype(np.float32)).sum(-1, dtype=np.float32)
    dq_acc = np.zeros((B, H, Nq, D), np.float32)
    dk = np.full(k.shape, np.nan, q.dtype)
    dvv = np.full(v.shape, np.nan, q.dtype)
    with np.errstate(all="ignore"):
        emu.run(ns["wgmma_backward_keys"], tuple(as_kernel_array(a, DT) for a in (q, k, v, do)) + (
            lse.astype(np.float32), delta, as_kernel_array(dk, DT), as_kernel_array(dvv, DT),
            scale * math.log2(math.e), scale, int(causal), int(causal_offset)) +
            tuple(extra[:len(window or ())]) + packing + tuple(extra[len(window or ()):]) +
            (dq_acc,))
    return dq_acc[..., :d].astype(q.dtype), dk, dvv
