"""The naive baselines numflash is compared against: softmax(scale q k^T) v with NumPy or CuPy,
the scores held whole (one Nq x Nk matrix a head) in the input dtype."""
import numpy as np


def plain_naive_attention(xp, q, k, v, scale, hidden=None):
    """The textbook expression softmax(scale q k^T) v, each step a new array in the input dtype:
    the "CuPy naive" that the performance issue's own numbers (../shared/device/GPU.md) timed."""
    s = xp.matmul(q, xp.swapaxes(k, -1, -2)) * q.dtype.type(scale)
    if hidden is not None:
        s = xp.where(hidden, s.dtype.type(-np.inf), s)
    s = xp.exp(s - s.max(axis=-1, keepdims=True))
    return xp.matmul(s / s.sum(axis=-1, keepdims=True), v)


def naive_attention(xp, q, k, v, scale, hidden=None, bmm=None):
    """softmax(scale q k^T) v with NumPy or CuPy: S and P held in the input dtype, in place.

    The two matmuls run in the input dtype (BLAS / cuBLAS); the softmax arithmetic is done in
    float32 for float16/float32 inputs (as torch's softmax does on half tensors), with the scale
    applied in float32, and P written back over S in the input dtype. One Nq x Nk matrix is held
    at a time. ``hidden``: (Nq, Nk) bool mask of the scores a causal mask removes, or None.
    ``bmm(a, b, trans_b)``: the batched matmul to use (default ``xp.matmul``).
    """
    if bmm is None:
        def bmm(a, b, trans_b):
            return xp.matmul(a, xp.swapaxes(b, -1, -2) if trans_b else b)
    s = bmm(q, k, True)
    if hidden is not None:
        xp.copyto(s, s.dtype.type(-np.inf), where=hidden)
    m = s.max(axis=-1, keepdims=True)          # max of the unscaled scores (scale > 0)
    if s.dtype in (np.float32, np.float64) and (xp is np or s.dtype == np.float64):
        s -= m
        s *= s.dtype.type(scale)
        xp.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
    elif xp is np:                              # float16 on the CPU
        for i in np.ndindex(s.shape[:-2]):     # one (Nq, Nk) float32 temporary at a time
            p = np.exp((s[i].astype(np.float32) - m[i]) * np.float32(scale))
            p /= p.sum(axis=-1, keepdims=True)
            s[i] = p
    else:
        rowsum, normalize = _cupy_softmax_kernels(xp)
        sc = np.float32(scale)
        mb = xp.broadcast_to(m, s.shape)
        l = rowsum(s, mb, sc, axis=-1, keepdims=True)
        normalize(mb, xp.broadcast_to(l, s.shape), sc, s)
    return bmm(s, v, False)


def cupy_bmm_half(cp, a, b, trans_b):
    """a @ b (b^T when trans_b) over the leading batch dims, float16 in and out, float32 sums.

    CuPy's matmul computes float16 products of > 2-D arrays in float32 (it converts both operands
    and the result), which would make naive float16 attention an fp32 GEMM with three times the
    memory; this calls cuBLAS's strided-batched GEMM on the float16 data directly instead.
    """
    from cupy_backends.cuda.libs import cublas
    a, b = cp.ascontiguousarray(a), cp.ascontiguousarray(b)
    batch_shape = tuple(a.shape[:-2])
    M, K = a.shape[-2:]
    N, Kb = b.shape[-2:] if trans_b else b.shape[-2:][::-1]
    if Kb != K or tuple(b.shape[:-2]) != batch_shape:
        raise ValueError(f"bmm shapes {a.shape} and {b.shape} (trans_b={trans_b}) do not match")
    c = cp.empty(batch_shape + (M, N), dtype=cp.float16)
    batch = int(np.prod(batch_shape, dtype=np.int64))
    one, zero = np.array(1, np.float32), np.array(0, np.float32)
    r16f = cp.cuda.runtime.CUDA_R_16F
    compute = getattr(cublas, "CUBLAS_COMPUTE_32F", cp.cuda.runtime.CUDA_R_32F)
    # Row-major C = A B is column-major C^T = B^T A^T: cuBLAS gets b first.
    cublas.gemmStridedBatchedEx(
        cp.cuda.device.get_cublas_handle(),
        cublas.CUBLAS_OP_T if trans_b else cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N,
        N, M, K, one.ctypes.data,
        b.data.ptr, r16f, K if trans_b else N, N * K,
        a.data.ptr, r16f, K, M * K,
        zero.ctypes.data, c.data.ptr, r16f, N, M * N,
        batch, compute, cublas.CUBLAS_GEMM_DEFAULT)
    return c


_SOFTMAX_KERNELS = {}


def _cupy_softmax_kernels(cp):
    """Row sums of exp(scale (s - m)) in float32, and s <- exp(scale (s - m)) / l in place."""
    if "k" not in _SOFTMAX_KERNELS:
        rowsum = cp.ReductionKernel(
            "T s, T m, float32 scale", "float32 l",
            "expf(((float)s - (float)m) * scale)", "a + b", "l = a", "0",
            "numflash_bench_rowsum")
        normalize = cp.ElementwiseKernel(
            "T m, float32 l, float32 scale", "T s",
            "s = (T)(expf(((float)s - (float)m) * scale) / l)",
            "numflash_bench_softmax")
        _SOFTMAX_KERNELS["k"] = (rowsum, normalize)
    return _SOFTMAX_KERNELS["k"]


def causal_hidden(xp, Nq, Nk):
    """Scores hidden by a top-left causal mask (query i sees keys j <= i)."""
    return ~xp.tri(Nq, Nk, dtype=bool)

