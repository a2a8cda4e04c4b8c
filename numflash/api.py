"""Public entry points: check inputs -> choose a plan -> run it. No kernel code lives here."""
from . import dropout as _dropout
from . import gqa as _gqa
from . import mods as _mods
from . import plan as _plan
from .cuda import fastpath as _fastpath
from .inputs import check_grad_dtype, normalize, normalize_backward

MOD_OPTIONS = ("score_mod", "mask_mod", "mod_args", "score_mod_grad", "window_size", "softcap",
               "alibi_slopes", "attn_bias", "attn_mask", "block_mask", "score_mod_args_grad")


def _with_mods(problem, options, dropout_p=0.0, dropout_seed=None):
    """Attach the call's modifications (numflash.mods) and dropout (numflash.dropout) to its
    problem; checks each option."""
    if options:
        problem.mods = _mods.build(problem.shape, problem.kind, problem.causal_offset,
                                   device_id=problem.q.device.id if problem.on_device else None,
                                   **options)
    problem.dropout = _dropout.build(dropout_p, dropout_seed)
    return problem


def _require_grads(mods):
    """Raise, for a backward, where a score_mod has no derivative (None: no modifications)."""
    if mods is not None and not mods.has_grad:
        raise ValueError(f"the backward needs the derivative of every score_mod: "
                         f"{', '.join(mods.missing_grad())} has none; pass "
                         f"score_mod_grad=f with f(score, b, h, q_idx, kv_idx, *mod_args) = "
                         f"d score_mod / d score")


def _with_bias_grad(problem, return_bias_grad):
    """Ask the backward for attn_bias's gradient: problem.dbias, an array of the bias's shape
    and dtype on the inputs' side, which the kernel writes."""
    if not return_bias_grad:
        return problem
    mods = problem.mods
    if mods is None or mods.bias is None:
        raise ValueError("return_bias_grad=True needs an attn_bias: pass the bias the forward "
                         "added (its gradient has the bias's shape)")
    _, shape, dtype = mods.bias
    problem.dbias = problem.xp.empty(shape, dtype)
    return problem


def _with_mod_args_grad(problem, return_mod_args_grad):
    """Ask the backward for the gradients of the mod_args that score_mod_args_grad
    differentiates: problem.dmod_args, a tuple aligned with mod_args (zeros of each trained
    array's shape and dtype on the inputs' side, which the kernel fills; None for the rest)."""
    if not return_mod_args_grad:
        return problem
    mods = problem.mods
    if mods is None or not mods.arg_grads:
        raise ValueError("return_mod_args_grad=True needs score_mod_args_grad: a tuple aligned "
                         "with mod_args, for each array that takes a gradient a function "
                         "(score, b, h, q_idx, kv_idx, *mod_args) -> (index, d score_mod / d "
                         "mod_args[n][index]), None for the rest (numflash.mods)")
    args = mods.user_args
    trained = dict(mods.arg_grads)
    problem.dmod_args = tuple(problem.xp.zeros(a.shape, a.dtype) if n in trained else None
                              for n, a in enumerate(args))
    return problem


def _mod_options(score_mod, mask_mod, mod_args, score_mod_grad, window_size, softcap,
                 alibi_slopes, attn_bias, attn_mask, block_mask, score_mod_args_grad=None):
    """The modification options that were given (not left at their defaults)."""
    given = dict(score_mod=score_mod, mask_mod=mask_mod, mod_args=mod_args,
                 score_mod_grad=score_mod_grad, window_size=window_size, softcap=softcap,
                 alibi_slopes=alibi_slopes, attn_bias=attn_bias, attn_mask=attn_mask,
                 block_mask=block_mask, score_mod_args_grad=score_mod_args_grad)
    return {k: v for k, v in given.items() if v is not None and not (k == "mod_args" and v == ())}


def attention(q, k, v, *, causal=False, softmax_scale=None, layout="bhsd", backend="auto",
              algorithm="auto", return_lse=False, out=None, precision="auto", score_mod=None,
              mask_mod=None, mod_args=(), score_mod_grad=None, window_size=None, softcap=None,
              alibi_slopes=None, attn_bias=None, attn_mask=None,
              block_mask=None, num_splits=None, dropout_p=0.0, dropout_seed=None,
              score_mod_args_grad=None):
    """Exact attention softmax(softmax_scale * q k^T + mask) v with O(N) memory.

    q: (B, H, Nq, d), k: (B, Hk, Nk, d), v: (B, Hk, Nk, dv) for ``layout="bhsd"``;
    (B, N, H, d) each for ``layout="bshd"``. Hk = H, or a divisor of H (grouped-query
    attention: query head h reads key/value head h // (H // Hk), in place). NumPy arrays run on
    the CPU, CuPy arrays (or any ``__cuda_array_interface__`` object) on the GPU. Strided inputs
    are read in place. torch tensors (CPU or CUDA) give torch tensors back, differentiably
    (:mod:`numflash.torch`).

    causal: False, True / "top_left" (query i sees keys j <= i), or "bottom_right"
        (query i sees keys j <= i + Nk - Nq). A row that sees no key gives zeros and lse = -inf.
    softmax_scale: defaults to 1/sqrt(d).
    backend: "auto" (from the array type), "cpu" or "cuda".
    algorithm: "auto", "block" (block-tiled), "row" (FA1 per-row), "mma" (tensor cores,
        mma.sync) or "wgmma" (Hopper warpgroup products, float16 / bfloat16, forward and
        backward).
    return_lse: also return the (B, H, Nq) natural log of each row's softmax denominator, in
        float32 (float64 for float64 inputs); :func:`attention_backward` takes it.
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

    Modifications (:mod:`numflash.mods`; the CPU path and the tensor-core kernels (cuda.mma)
    take them all, forward and backward, the window by skipping the key tiles outside it; with
    CuPy inputs their arrays are CuPy arrays on q's GPU; cuda.row takes them but a block mask;
    cuda.block refuses them, saying so):
    score_mod(score, b, h, q_idx, kv_idx, *mod_args) -> score, applied to the scaled score;
    mask_mod(b, h, q_idx, kv_idx, *mod_args) -> bool (True = the pair takes part); mod_args: a
    tuple of arrays and scalars both read; score_mod_grad: d score_mod / d score, same signature
    (the backward needs it); score_mod_args_grad: the score_mod's derivatives in trainable
    mod_args, for :func:`attention_backward`'s ``return_mod_args_grad`` (see there; the forward
    only checks it). Built-ins: window_size=(left, right) (-1 = unbounded; distances
    from the causal alignment's diagonal, top-left unless causal="bottom_right"); softcap
    (cap * tanh(score / cap)); alibi_slopes ((H,) or (B, H): score - slope * |i + offset - j|);
    attn_bias (float, broadcastable to (B, H, Nq, Nk), added; never expanded in memory);
    attn_mask (bool, broadcastable, True = take part); block_mask (a numflash.BlockMask from
    :func:`numflash.create_block_mask`: its mask_mod, with the blocks it leaves empty skipped and,
    on cuda.mma, the mask evaluated only in blocks it leaves partly filled). A row that nothing
    is left in gives zeros and lse = -inf.

    dropout_p, dropout_seed: attention dropout after the softmax (:mod:`numflash.dropout`):
        each probability dropped with probability dropout_p, the others scaled by
        1 / (1 - dropout_p); lse stays the undropped softmax's. The mask is drawn from the int
        ``dropout_seed`` (required with dropout_p > 0) by a counter-based generator, the same on
        every backend; :func:`attention_backward` regenerates it from the same two arguments.
        p is applied in steps of 1 / 256 (the share dropped is round(256 p) / 256, the kept
        ones scaled by its complement's inverse). The CPU path and cuda.mma take it (packed
        sequences too, numflash.attention_varlen; not a KV cache).

    num_splits: split-KV, how many shares of the keys each block of queries is split into on
        the GPU (cuda.mma) or the CPU path (runs of whole key blocks, at most one a block),
        their partial results then merged exactly (:func:`merge_partials`'s rule; on the GPU
        one more launch). None: chosen from the GPU's size or the CPU's threads, splitting
        when the query blocks cannot fill them (decoding, few long rows); 1: never; any other
        kernel takes only None or 1. :func:`explain` says the choice.

    Returns the output in q's dtype, array kind and layout; ``(out, lse)`` if ``return_lse``.
    A forced backend or algorithm that cannot run the inputs raises ValueError saying why;
    :func:`explain` shows the choice without running it.
    """
    mod_options = _mod_options(score_mod, mask_mod, mod_args, score_mod_grad, window_size,
                               softcap, alibi_slopes, attn_bias, attn_mask, block_mask,
                               score_mod_args_grad)
    key, replay_mods = None, _fastpath.replay_mods(mod_options)
    if out is None and replay_mods is not None and not dropout_p:  # a repeated CuPy call
        #                                                            replays its recorded launch
        key = _fastpath.signature(q, k, v, _fastpath.call_options(
            causal, softmax_scale, layout, backend, algorithm, return_lse, precision,
            num_splits, replay_mods[0]))
        replay = _fastpath.lookup(key)
        if replay is not None:
            return replay(q, k, v, *replay_mods[1])
    if _is_torch(q):
        from . import torch as _torch
        if num_splits is not None:
            raise TypeError("num_splits is not passed through for torch tensors yet: leave it "
                            "None (cuda.mma chooses), or call with CuPy arrays")
        return _torch.attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                layout=layout, backend=backend, algorithm=algorithm,
                                return_lse=return_lse, out=out, precision=precision,
                                dropout_p=dropout_p, dropout_seed=dropout_seed, **mod_options)
    problem = _with_mods(normalize(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   layout=layout, return_lse=return_lse, out=out,
                                   precision=precision, num_splits=num_splits), mod_options,
                         dropout_p, dropout_seed)
    _, run = _gqa.plan_rows(problem, lambda p: _plan.choose(p, backend, algorithm))
    B, H, Nq, Nk, d, dv = problem.shape
    if B * H * Nq == 0:
        lse = problem.empty_lse()
    elif Nk == 0:  # every row sees no key
        problem.out[...] = 0
        lse = problem.empty_lse()
        lse[...] = -float("inf")
    elif key is not None and problem.on_device:
        with _fastpath.recording() as launches:
            lse = run()
        _fastpath.remember(key, launches, problem, lse, replay_mods[1])
    else:
        lse = run()
    return (problem.result, lse) if return_lse else problem.result


def attention_backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, layout="bhsd",
                       backend="auto", algorithm="auto", precision="auto", deterministic=False,
                       dq=None, dk=None, dv=None, grad_dtype=None, score_mod=None, mask_mod=None,
                       mod_args=(), score_mod_grad=None, window_size=None, softcap=None,
                       alibi_slopes=None, attn_bias=None, attn_mask=None, block_mask=None,
                       dropout_p=0.0, dropout_seed=None, return_bias_grad=False,
                       score_mod_args_grad=None, return_mod_args_grad=False):
    """Gradients (dq, dk, dv) of :func:`attention` for the output gradient ``do``, in O(N) memory.

    ``o`` and ``lse`` are what ``attention(q, k, v, ..., return_lse=True)`` returned for the same
    q, k, v and options (``do`` and ``o`` have the output's shape; ``lse`` is float32, float64 for
    float64 inputs). P is recomputed tile by tile from q, k and lse (FlashAttention-2's backward):
    no Nq x Nk buffer exists. Every option means what it means for :func:`attention`.

    deterministic: True asks for gradients that are equal bit for bit on every run; a kernel
        that cannot promise it refuses. False (the default) lets cuda.wgmma and cuda.mma add
        dQ atomically for 16-bit inputs on sm_90 (faster; dQ's float32 sums then run in an
        order that varies), as FlashAttention-2 and -3 do; every other kernel is deterministic
        either way.
    dq, dk, dv: write the gradients here (shapes, kind and layout of q, k, v, dtype
        ``grad_dtype``); by default new arrays are returned.
    grad_dtype: None (q's dtype), or float32 with float16 / bfloat16 inputs: the gradients as
        the kernels accumulate them, not rounded to 16 bits, for callers that sum partial
        gradients (ring attention's steps, accumulation in float32). Every backward kernel
        takes it.
    precision: as for :func:`attention`: with "auto", float32 gradients of CuPy arrays run on
        cuda.mma as 3xTF32 on compute capability 8.0 / 9.0 with 16-byte rows (head dims up to
        256; its forward takes float32 up to 128); "ieee" keeps them on the FMA units
        (cuda.row); "tf32" has no backward kernel.

    Returns (dq, dk, dv) with the array kind and layout of q, k, v, in ``grad_dtype``. A row
    that sees no key contributes nothing: its dq is zero. :func:`explain` with ``backward=True`` names the
    kernel that would run. Modifications: those the forward had; a score_mod needs its
    derivative (``score_mod_grad``; the built-ins carry theirs). Dropout: the forward's
    ``dropout_p`` and ``dropout_seed`` (its mask is regenerated, not stored).

    return_bias_grad: also return attn_bias's gradient, ``(dq, dk, dv, dbias)``: each pair's
        dS (through the score_mods after the bias) summed over the dims the bias broadcasts
        along, in the bias's shape and dtype (a (B, 1, 1, Nk) or (1, H, Nq, Nk) bias gets a
        gradient of that shape, never an expanded one). No gradient flows to alibi_slopes.
    return_mod_args_grad: also return the gradients of trainable mod_args, last, as a tuple
        aligned with mod_args (each in its array's shape and dtype; None for an argument that
        takes none). ``score_mod_args_grad`` says how the score_mod depends on them: a tuple
        aligned with mod_args of functions ``(score, b, h, q_idx, kv_idx, *mod_args) ->
        (index, derivative)``, the element of mod_args[n] the pair's score_mod reads (an int,
        or a tuple of ints for an array of more dims) and d score_mod / d that element, None
        for arguments that take no gradient. Each visible pair adds dS x derivative there (for
        a relative-position bias table: index = the pair's bucket, derivative 1; an index
        outside the array raises IndexError). The CPU path sums them in float64, one copy a
        task summed in a fixed order (deterministic); cuda.mma by float64 atomic adds (refused
        with ``deterministic=True``; packed sequences: attention_varlen_backward takes them).
    """
    mod_options = _mod_options(score_mod, mask_mod, mod_args, score_mod_grad, window_size,
                               softcap, alibi_slopes, attn_bias, attn_mask, block_mask,
                               score_mod_args_grad)
    key = None
    if dq is None and dk is None and dv is None and not mod_options and \
            type(dropout_p) in (int, float) and dropout_p == 0 and dropout_seed is None and \
            not return_bias_grad and not return_mod_args_grad:
        # a repeated CuPy call replays its recorded launches (what the checks would refuse,
        # such as dropout_p=None, takes the full path)
        key = _fastpath.gradient_signature((do, q, k, v, o, lse), (
            causal, softmax_scale, layout, backend, algorithm, precision, deterministic,
            grad_dtype))
        replay = _fastpath.lookup(key)
        if replay is not None:
            return replay(do, q, k, v, o, lse)
    if _is_torch(q):
        from . import torch as _torch
        return _torch.attention_backward(do, q, k, v, o, lse, causal=causal,
                                         softmax_scale=softmax_scale, layout=layout,
                                         backend=backend, algorithm=algorithm,
                                         precision=precision, deterministic=deterministic,
                                         dq=dq, dk=dk, dv=dv, grad_dtype=grad_dtype,
                                         dropout_p=dropout_p, dropout_seed=dropout_seed,
                                         return_bias_grad=return_bias_grad,
                                         return_mod_args_grad=return_mod_args_grad,
                                         **mod_options)
    problem = _with_mod_args_grad(_with_bias_grad(_with_mods(normalize_backward(
        do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale, layout=layout,
        precision=precision, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
        grad_dtype=grad_dtype), mod_options, dropout_p, dropout_seed), return_bias_grad),
        return_mod_args_grad)
    _require_grads(problem.mods)
    plan = _plan.choose(problem, backend, algorithm)
    B, H, Nq, Nk = problem.shape[:4]
    if Nq == 0 or Nk == 0 or not B * H:  # no query sees a key: every gradient is zero
        for g in (problem.dq, problem.dk, problem.dv, problem.dbias):
            if g is not None:
                g[...] = 0
    elif key is not None and problem.on_device:
        with _fastpath.recording() as launches:
            plan.run(problem)
        _fastpath.remember_gradients(key, launches, (do, q, k, v, o, lse), problem.result)
    else:   # (dmod_args are zeros until a kernel adds into them)
        plan.run(problem)
    return problem.result + ((problem.dbias,) if problem.dbias is not None else ()) + \
        ((problem.dmod_args,) if problem.dmod_args is not None else ())


def _is_torch(x):
    """A torch.Tensor (checked without importing torch): numflash.torch runs it."""
    return type(x).__module__ == "torch" or (type(x).__module__.startswith("torch.")
                                             and type(x).__name__ in ("Tensor", "Parameter"))


def explain(q, k, v, *, causal=False, softmax_scale=None, layout="bhsd", backend="auto",
            algorithm="auto", return_lse=False, out=None, precision="auto", backward=False,
            deterministic=False, grad_dtype=None, score_mod=None, mask_mod=None, mod_args=(),
            score_mod_grad=None, window_size=None, softcap=None, alibi_slopes=None,
            attn_bias=None, attn_mask=None, block_mask=None, num_splits=None, dropout_p=0.0,
            dropout_seed=None, return_bias_grad=False, score_mod_args_grad=None,
            return_mod_args_grad=False):
    """The :class:`numflash.plan.Plan` that :func:`attention` would run for these arguments
    (with ``backward=True``: that :func:`attention_backward` would run for these q, k, v, and
    ``deterministic`` and ``grad_dtype`` as it takes them).

    ``str(plan)`` names the kernel and its tile config and, for every kernel not chosen, why.
    Raises the same errors as :func:`attention` would (``dropout_seed`` may be left out: the
    plan does not depend on it). With ``backward=True``, ``return_bias_grad=True`` plans for
    attn_bias's gradient too (the kernels that compute it, and how), and
    ``return_mod_args_grad=True`` for those of mod_args.
    """
    mod_options = _mod_options(score_mod, mask_mod, mod_args, score_mod_grad, window_size,
                               softcap, alibi_slopes, attn_bias, attn_mask, block_mask,
                               score_mod_args_grad)
    if _is_torch(q):  # the plan for the tensors' memory, seen as NumPy / CuPy arrays
        from . import torch as _torch
        if num_splits is not None:
            raise TypeError("num_splits is not passed through for torch tensors yet: leave it "
                            "None (cuda.mma chooses), or call with CuPy arrays")
        _torch._check_tensors(q=q, k=k, v=v)
        q, k, v = _torch._views(q, k, v)
        out = None if out is None else _torch._views(out)[0]
        # (as arrays: a tensor that trains, attn_bias or a differentiated mod_args one, is
        # read like any other here)
        mod_options = _torch._mod_arrays(_torch._trainable(mod_options)[2])
    if backward and num_splits is not None:
        raise ValueError("num_splits is a forward option (the backward's kernels parallelize "
                         "over keys already): leave it None with backward=True")
    problem = _with_mods(normalize(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   layout=layout, return_lse=return_lse, out=out,
                                   precision=precision, num_splits=num_splits), mod_options,
                         dropout_p, 0 if dropout_seed is None and dropout_p else dropout_seed)
    if backward:
        problem.direction, problem.deterministic = "backward", bool(deterministic)
        problem.grad_dtype = check_grad_dtype(grad_dtype, problem.dtype)
        _with_mod_args_grad(_with_bias_grad(problem, return_bias_grad), return_mod_args_grad)
    elif grad_dtype is not None or return_bias_grad or return_mod_args_grad:
        name = next(n for n, given in (("grad_dtype", grad_dtype is not None),
                                       ("return_bias_grad", return_bias_grad),
                                       ("return_mod_args_grad", return_mod_args_grad)) if given)
        raise ValueError(f"{name} is a backward option: pass backward=True with it")
    return _gqa.plan_rows(problem, lambda p: _plan.choose(p, backend, algorithm))[0]
