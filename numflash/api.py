"""Public entry points: check inputs -> choose a plan -> run it. No kernel code lives here."""
from . import plan as _plan
from .cuda import fastpath as _fastpath
from .inputs import normalize


def attention(q, k, v, *, causal=False, softmax_scale=None, layout="bhsd", backend="auto",
              algorithm="auto", return_lse=False, out=None, precision="auto"):
    """Exact attention softmax(softmax_scale * q k^T + mask) v with O(N) memory.

    q: (B, H, Nq, d), k: (B, H, Nk, d), v: (B, H, Nk, dv) for ``layout="bhsd"``;
    (B, N, H, d) each for ``layout="bshd"``. NumPy arrays run on the CPU, CuPy arrays (or any
    ``__cuda_array_interface__`` object) on the GPU. Strided inputs are read in place.

    causal: False, True / "top_left" (query i sees keys j <= i), or "bottom_right"
        (query i sees keys j <= i + Nk - Nq). A row that sees no key gives zeros and lse = -inf.
    softmax_scale: defaults to 1/sqrt(d).
    backend: "auto" (from the array type), "cpu" or "cuda".
    algorithm: "auto", "block" (block-tiled), "row" (FA1 per-row) or "mma" (tensor cores).
    return_lse: also return the float32 (B, H, Nq) natural log of each row's softmax denominator.
    out: write the result here (q's dtype and kind, shape of the result in ``layout``).
    precision: "auto": float32-level accuracy for float32 inputs. On compute capability 8.0
        and 9.0 (data-center parts whose tf32 tensor cores run ~8x the FMA rate; timed on the
        H100, while on slow-tf32 parts such as the H20 "ieee" is likely faster), float32 with
        head dims up to 128 and 16-byte rows runs on cuda.mma as 3xTF32: each operand split
        into two tf32 values, each product three tf32 mma, held to the same accuracy rule as the
        FMA kernels (error within 2x that of naive float32 attention). "ieee": float32 only on
        the FMA units (cuda.block, cuda.row, CPU). "tf32": float32 on cuda.mma with one tf32
        mma per product (10-bit mantissa products, fp32 accumulation; relative error ~1e-3),
        needs CuPy arrays on a GPU of compute capability >= 8.0; any other dtype or backend with
        "tf32" raises ValueError. Other dtypes ignore "auto" / "ieee".

    Returns the output in q's dtype, array kind and layout; ``(out, lse)`` if ``return_lse``.
    A forced backend or algorithm that cannot run the inputs raises ValueError saying why;
    :func:`explain` shows the choice without running it.
    """
    key = None
    if out is None:  # a repeated CuPy call replays its recorded launch (cuda/fastpath.py)
        key = _fastpath.signature(q, k, v, _fastpath.call_options(
            causal, softmax_scale, layout, backend, algorithm, return_lse, precision))
        replay = _fastpath.lookup(key)
        if replay is not None:
            return replay(q, k, v)
    problem = normalize(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout,
                        return_lse=return_lse, out=out, precision=precision)
    plan = _plan.choose(problem, backend, algorithm)
    B, H, Nq, Nk, d, dv = problem.shape
    if B * H * Nq == 0:
        lse = problem.empty_lse()
    elif Nk == 0:  # every row sees no key
        problem.out[...] = 0
        lse = problem.empty_lse()
        lse[...] = -float("inf")
    elif key is not None and problem.on_device:
        with _fastpath.recording() as launches:
            lse = plan.run(problem)
        _fastpath.remember(key, launches, problem, lse)
    else:
        lse = plan.run(problem)
    return (problem.result, lse) if return_lse else problem.result


def explain(q, k, v, *, causal=False, softmax_scale=None, layout="bhsd", backend="auto",
            algorithm="auto", return_lse=False, out=None, precision="auto"):
    """The :class:`numflash.plan.Plan` that :func:`attention` would run for these arguments.

    ``str(plan)`` names the kernel and its tile config and, for every kernel not chosen, why.
    Raises the same errors as :func:`attention` would.
    """
    problem = normalize(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout,
                        return_lse=return_lse, out=out, precision=precision)
    return _plan.choose(problem, backend, algorithm)
