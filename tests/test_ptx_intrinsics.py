"""Each inline-PTX intrinsic of numflash/cuda/ptx.py alone on the GPU, against NumPy.

The tensor-core kernels are built from these; a wrong fragment layout, rounding mode or address
shows here as the element that is wrong, where a kernel test would only show a kernel that is off.
Covered: the mma forms (f16 and bf16 m16n8k16, tf32 m16n8k8, both float64 forms) on fragments laid
out as the PTX ISA says, the f16x2 / bf16x2 packs and the tf32 rounding bit for bit, ex2,
ldmatrix (plain and transposed) from shared memory, and cp.async with zero-fill. (These checks were
the units, tf32 and f64 sections of bench/mma_probe.py.) Needs a GPU (``-m gpu``): inline PTX does
not run in numba's simulator.
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


# ----------------------------------------------------------------------------------------------
# NumPy twins of the conversions
# ----------------------------------------------------------------------------------------------

def bf16_bits(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def tf32_bits(x):
    """cvt.rna.tf32.f32: round to nearest, ties away from zero, to a 10-bit mantissa."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x1000) & 0xFFFFE000).astype(np.uint32)


# ----------------------------------------------------------------------------------------------
# One warp running one intrinsic
# ----------------------------------------------------------------------------------------------

def launch_elementwise(intrinsic, x, out):
    """out[i] = intrinsic(x[i]), one thread an element."""
    from numba import cuda

    @cuda.jit
    def kern(x, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = intrinsic(x[i])
    kern[(out.size + 127) // 128, 128](x, out)
    return out


def launch_pairwise(intrinsic, x, out):
    """out[i] = intrinsic(x[2i], x[2i+1]), one thread a pair."""
    from numba import cuda

    @cuda.jit
    def kern(x, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = intrinsic(x[2 * i], x[2 * i + 1])
    kern[(out.size + 127) // 128, 128](x, out)
    return out


def c_fragments(C):
    """The 32 x 4 per-lane registers of a 16 x 8 C (or D) matrix: lane 4g + t holds C[g, 2t],
    C[g, 2t+1], C[g+8, 2t], C[g+8, 2t+1]."""
    cf = np.zeros((32, 4), C.dtype)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        cf[lane] = [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]
    return cf


def run_mma(intrinsic, af, bf, cf):
    """One warp-wide mma on per-lane fragments (af: 32 x 4 A registers, bf: 32 x 2 B registers,
    cf: 32 x 4 C values); returns D as the 16 x 8 matrix of the C/D layout."""
    from numba import cuda

    @cuda.jit
    def kern(a, b, c, out):
        t = cuda.threadIdx.x
        r = intrinsic(a[t, 0], a[t, 1], a[t, 2], a[t, 3], b[t, 0], b[t, 1],
                      c[t, 0], c[t, 1], c[t, 2], c[t, 3])
        out[t, 0] = r[0]
        out[t, 1] = r[1]
        out[t, 2] = r[2]
        out[t, 3] = r[3]
    out = np.zeros((32, 4), cf.dtype)
    kern[1, 32](af, bf, cf, out)
    D = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1] = out[lane]
    return D


def run_mma_16x8x8(intrinsic, A, Bm, C):
    """D = A @ Bm + C through a 16x8x8 mma (mma_tf32, mma_f64_*): lane 4g + t holds
    a = A[g|g+8, t|t+4] and b = Bm[t|t+4, g]."""
    af, bf = np.zeros((32, 4), A.dtype), np.zeros((32, 2), Bm.dtype)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        af[lane] = [A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4]]
        bf[lane] = [Bm[t, g], Bm[t + 4, g]]
    return run_mma(intrinsic, af, bf, c_fragments(C))


def m16n8k16_fragments(Ab, Bb):
    """A (16 x 16) and B (16 x 8) halves (uint16 bits) packed two a register, low half first:
    a = A[g|g+8, 2t:2t+2 | 2t+8:2t+10], b = B[2t:2t+2 | 2t+8:2t+10, g]."""
    def pair(lo, hi):
        return int(lo) | (int(hi) << 16)
    af, bf = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        af[lane] = [pair(Ab[r, c], Ab[r, c + 1])
                    for r, c in ((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))]
        bf[lane] = [pair(Bb[2 * t, g], Bb[2 * t + 1, g]), pair(Bb[2 * t + 8, g], Bb[2 * t + 9, g])]
    return af, bf


# ----------------------------------------------------------------------------------------------
# mma
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_gpu_mma_m16n8k16_adds_c(rng, kind):
    from numflash.cuda import ptx
    A, Bm = (rng.standard_normal(s).astype(np.float32) for s in ((16, 16), (16, 8)))
    C = rng.standard_normal((16, 8)).astype(np.float32)
    if kind == "f16":
        Ab, Bb = (x.astype(np.float16).view(np.uint16) for x in (A, Bm))
        Av, Bv = (x.view(np.float16).astype(np.float64) for x in (Ab, Bb))
    else:
        Ab, Bb = bf16_bits(A), bf16_bits(Bm)
        Av, Bv = (bf16_value(x).astype(np.float64) for x in (Ab, Bb))
    D = run_mma(getattr(ptx, f"mma_{kind}"), *m16n8k16_fragments(Ab, Bb), c_fragments(C))
    err = np.abs(D - (Av @ Bv + C)).max()
    assert err < 1e-3, f"max abs err {err:.2e}"


def test_gpu_mma_tf32_adds_c(rng):
    from numflash.cuda import ptx
    A, Bm, C = (rng.standard_normal(s).astype(np.float32) for s in ((16, 8), (8, 8), (16, 8)))
    Ab, Bb = tf32_bits(A), tf32_bits(Bm)
    D = run_mma_16x8x8(ptx.mma_tf32, Ab, Bb, C)
    want = Ab.view(np.float32).astype(np.float64) @ Bb.view(np.float32).astype(np.float64) + C
    err = np.abs(D - want).max()
    assert err < 1e-4, f"max abs err {err:.2e} (against the tf32-rounded operands)"


@pytest.mark.parametrize("form", ["mma_f64_m16n8k8", "mma_f64_m8n8k4x4"])
def test_gpu_mma_f64_is_exact_to_rounding(rng, form):
    import cupy
    from numflash.cuda import ptx
    if form == "mma_f64_m16n8k8" and cupy.cuda.Device().compute_capability < "90":
        pytest.skip("m16n8k8 .f64 needs sm_90")
    A, Bm, C = (rng.standard_normal(s) for s in ((16, 8), (8, 8), (16, 8)))
    D = run_mma_16x8x8(getattr(ptx, form), A, Bm, C)
    assert np.abs(D - (A @ Bm + C)).max() < 1e-13


# ----------------------------------------------------------------------------------------------
# Conversions and ex2
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_gpu_pack_x2_rounds_to_nearest_even_low_half_first(rng, kind):
    from numflash.cuda import ptx
    x = np.concatenate([rng.standard_normal(1000) * 10,
                        [0.0, -0.0, 65504.0, 1e-8, 3.3e38, -np.inf]]).astype(np.float32)
    out = launch_pairwise(getattr(ptx, f"pack_{kind}x2"), x, np.zeros(x.size // 2, np.uint32))
    with np.errstate(over="ignore"):  # 3.3e38 is inf in float16
        want = x.astype(np.float16).view(np.uint16) if kind == "f16" else bf16_bits(x)
    got = np.stack([out & 0xFFFF, out >> 16], axis=1).reshape(-1).astype(np.uint16)
    assert np.array_equal(got, want), f"{int((got != want).sum())} of {x.size} halves differ"


def test_gpu_to_tf32_rounds_half_away_from_zero(rng):
    from numflash.cuda import ptx
    x = np.r_[rng.standard_normal(4093).astype(np.float32), 1 + 2.0 ** -11, -(1 + 2.0 ** -11),
              1 + 3 * 2.0 ** -11].astype(np.float32)  # the last three are ties
    out = launch_elementwise(ptx.to_tf32, x, np.zeros(x.size, np.uint32))
    bad = int((out != tf32_bits(x)).sum())
    assert bad == 0, f"{bad} of {x.size} differ from NumPy's round-half-away"


def test_gpu_ex2_is_exp2_and_exact_at_the_ends():
    from numflash.cuda import ptx
    x = np.concatenate([np.linspace(-30, 10, 4000), [-np.inf, 0.0]]).astype(np.float32)
    out = launch_elementwise(ptx.ex2, x, np.zeros_like(x))
    want = np.exp2(x[:-2].astype(np.float64))
    rel = float((np.abs(out[:-2] - want) / want).max())
    assert rel < 1e-5, f"max rel err {rel:.2e}"
    assert out[-2] == 0 and out[-1] == 1


# ----------------------------------------------------------------------------------------------
# Shared memory: ldmatrix and cp.async
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("trans", [False, True], ids=["ldmatrix_x4", "ldmatrix_x4_trans"])
def test_gpu_ldmatrix_gives_each_lane_its_fragment(trans):
    """A 16 x 16 matrix of halves in shared memory (rows padded to 12 words), read as four 8 x 8
    matrices: lane 4g + t gets row g, halves 2t and 2t+1 of each (column g with trans)."""
    from numba import cuda, uint32
    from numflash.cuda import ptx
    M = np.arange(256, dtype=np.uint16).reshape(16, 16) + 1000
    words = np.zeros(16 * 12, np.uint32)
    for r in range(16):
        for w in range(8):
            words[r * 12 + w] = int(M[r, 2 * w]) | (int(M[r, 2 * w + 1]) << 16)
    load = ptx.ldmatrix_x4_trans if trans else ptx.ldmatrix_x4

    @cuda.jit
    def kern(src, out):
        sm = cuda.shared.array(192, uint32)
        t = cuda.threadIdx.x
        for i in range(t, 192, 32):
            sm[i] = src[i]
        cuda.syncthreads()
        # matrix i = rows 8 (i % 2).., columns 8 (i // 2)..: lane l gives row l % 8 of matrix l // 8
        mi = t // 8
        row = (mi % 2) * 8 + t % 8
        r = load(ptx.shared_addr(sm, row * 12 + (mi // 2) * 4))
        out[t, 0] = r[0]
        out[t, 1] = r[1]
        out[t, 2] = r[2]
        out[t, 3] = r[3]
    out = np.zeros((32, 4), np.uint32)
    kern[1, 32](words, out)
    want = np.zeros_like(out)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(4):
            sub = M[(i % 2) * 8:(i % 2) * 8 + 8, (i // 2) * 8:(i // 2) * 8 + 8]
            lo, hi = (sub[2 * t, g], sub[2 * t + 1, g]) if trans else (sub[g, 2 * t],
                                                                         sub[g, 2 * t + 1])
            want[lane, i] = int(lo) | (int(hi) << 16)
    assert np.array_equal(out, want), f"{int((out != want).sum())} of 128 registers differ"


def test_gpu_cp_async_copies_16_bytes_and_zero_fills():
    """cp.async of 16-byte chunks from global (global_addr2) to shared (shared_addr), then commit
    and wait_group 0: chunks 0-2 of each row copied, chunk 3 (source size 0) zero-filled."""
    from numba import cuda, uint32
    from numflash.cuda import ptx
    src = (np.arange(8 * 24, dtype=np.uint16) + 7).reshape(8, 24)

    @cuda.jit
    def kern(src, out):
        sm = cuda.shared.array(128, uint32)
        t = cuda.threadIdx.x  # 32 threads: row t // 4, 16-byte chunk t % 4
        r = t // 4
        c = (t % 4) * 8
        n = 16 if c < 24 else 0
        ptx.cp_async_16(ptx.shared_addr(sm, r * 16 + c // 2),
                        ptx.global_addr2(src, r, c if c < 24 else 0), n)
        ptx.cp_async_commit()
        ptx.cp_async_wait_0()
        cuda.syncthreads()
        for i in range(t, 128, 32):
            out[i] = sm[i]
    out = np.full(128, 0xDEADBEEF, np.uint32)
    kern[1, 32](src, out)
    got = out.view(np.uint16).reshape(8, 32)
    want = np.zeros((8, 32), np.uint16)
    want[:, :24] = src
    assert np.array_equal(got, want), f"{int((got != want).sum())} of 256 halves differ"
