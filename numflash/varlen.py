"""Packed sequences (flash-attn's varlen convention) and the merge of partial results.

:func:`attention_varlen` and :func:`attention_varlen_backward` take sequences of different lengths
packed along one axis, q (total_q, H, d) and k, v (total_k, Hk, d), with cumulative lengths
``cu_seqlens_q`` / ``cu_seqlens_k`` (B + 1 integers from 0 to the total). No padding is computed
and nothing is copied. On the GPU the tensor-core kernels (cuda.mma, compute capability >= 8.0)
run every sequence in one launch per pass (MmaConfig.VARLEN: grid y walks the sequences' heads,
each block finds its sequence's rows in cu_seqlens), forward and backward, with a window, a
softcap, ALiBi, a user's score_mod / mask_mod (b is then the sequence, q_idx / kv_idx
positions in it) and dropout (each sequence under its own seed,
numflash.dropout.packed_seed); on compute capability 9.0 plain 16-bit calls run cuda.wgmma's
packed kernels (the backward's key pass after cuda.mma's packed delta pass). Everywhere else
(the CPU, cuda.block / cuda.row, inputs cuda.mma refuses) it runs one
:func:`numflash.attention` call per sequence on views of the packed arrays, writing into views
of the packed outputs (a user's functions then see the sequence's index
through numflash.mods.at_batch, on the CPU path only).

:func:`merge_partials` combines results computed over disjoint sets of keys (split-KV, cascade or
shared-prefix attention, sequence parallelism) into the result over all of them, exactly.
"""
from dataclasses import dataclass

import numpy as np

from .inputs import array_kind, host_values, lse_dtype

__all__ = ["attention_varlen", "attention_varlen_backward", "explain_varlen", "merge_partials"]


@dataclass
class Packed:
    """What the one-launch kernels of packed sequences read besides the packed arrays
    (Problem.varlen): the cumulative lengths as int32 device arrays, the longest sequence's
    query and key rows (they size the grid) and the causal alignment."""
    cu_q: object
    cu_k: object
    max_q: int
    max_k: int
    bottom_right: bool

    @property
    def count(self):
        return int(self.cu_q.size) - 1

    def key(self):
        """What a memoized plan depends on (explain's notes name the count and the longest)."""
        return ("varlen", self.count, self.max_q, self.max_k, self.bottom_right)

    def grid(self, block_rows, heads, keys=False):
        """A one-launch grid: x the blocks of ``block_rows`` the longest sequence's query rows
        (``keys``: its keys) take, y each sequence's ``heads``; a shorter sequence's extra
        blocks return at once."""
        return (-(-(self.max_k if keys else self.max_q) // block_rows), self.count * heads)

    def arguments(self):
        """What the kernels take in causal_offset's place (the alignment: 0 top-left, 1
        bottom-right per sequence) and after any window's sizes (cu_q, cu_k)."""
        return int(self.bottom_right), (self.cu_q, self.cu_k)

    def note(self, causal, blocks, passes=False):
        """explain's line: ``blocks`` says what the blocks own (``passes``: of the backward's
        each pass)."""
        align = ("; causal aligned " + ("bottom-right" if self.bottom_right else "top-left") +
                 " per sequence") if causal else ""
        per = " per pass" if passes else ""
        return (f"packed sequences: {self.count} in one launch{per} (grid y: each sequence's "
                f"heads), {blocks}; a shorter sequence's extra blocks return at once{align}")


def _host_lengths(name, cu, total, batch=None):
    """cu_seqlens as a host int64 array, checked: 1-D, integer, starts at 0, non-decreasing,
    ends at the packed total."""
    cu = host_values(name, cu, "a 1-D integer array (NumPy or CuPy) or a list")
    if cu.ndim != 1 or cu.size < 1:
        raise ValueError(f"{name} must be 1-D with B + 1 entries; got shape {cu.shape}")
    if cu.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32 or int64); got {cu.dtype}")
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0; got {int(cu[0])}")
    steps = np.diff(cu)
    if (steps < 0).any():
        at = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must be non-decreasing; it goes from {int(cu[at])} to "
                         f"{int(cu[at + 1])} at entry {at}")
    if cu[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}; it ends at {int(cu[-1])}")
    if batch is not None and cu.size != batch + 1:
        raise ValueError(f"{name} has {cu.size - 1} sequences, cu_seqlens_q has {batch}")
    return cu


def _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  torch_ok=False):
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not torch_ok and type(a).__module__.startswith("torch"):
            raise TypeError(f"{name} is a torch tensor: use numflash.torch.flash_attn_varlen_func "
                            f"(differentiable) for torch tensors")
        if getattr(a, "ndim", None) != 3:
            raise ValueError(f"{name} must be 3-D (total, heads, head dim) for attention_varlen; "
                             f"got shape {tuple(getattr(a, 'shape', ()))}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same packed length; got {k.shape[0]} and "
                         f"{v.shape[0]}")
    cq = _host_lengths("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ck = _host_lengths("cu_seqlens_k", cu_seqlens_k, k.shape[0], batch=cq.size - 1)
    for name, given, cu in (("max_seqlen_q", max_seqlen_q, cq), ("max_seqlen_k", max_seqlen_k, ck)):
        longest = int(np.diff(cu).max()) if cu.size > 1 else 0
        if given is not None and int(given) < longest:
            raise ValueError(f"{name}={given} is shorter than the longest sequence ({longest})")
    return cq, ck


#: the packed totals the int32 offsets of the one-launch kernels can address
_MAX_ROWS = 2 ** 31 - 1


def _device_offsets(given, host, q):
    """cu_seqlens as the int32 CuPy array on q's GPU the kernels read: the user's own when it is
    one already, else a copy of the checked host values."""
    import cupy
    if (array_kind(given) == "cupy" and given.dtype == np.int32 and given.ndim == 1
            and given.flags.c_contiguous and given.device.id == q.device.id):
        return given
    with cupy.cuda.Device(q.device.id):
        return cupy.asarray(host.astype(np.int32))


def _one_launch(problem, cq, ck, cu_seqlens_q, cu_seqlens_k, causal, backend, algorithm):
    """(plan, None): the plan that runs every sequence of a packed ``problem`` (1, H, total, .)
    in one launch per pass, with problem.varlen set; or (None, why not) where no such kernel
    takes it (NumPy arrays, an empty side, totals past int32, kernels or options that refuse:
    then one call per sequence runs)."""
    from . import plan as _plan
    if not problem.on_device:
        return None, "NumPy arrays: the CPU path runs one call per sequence"
    if cq[-1] == 0 or ck[-1] == 0 or problem.q.shape[1] == 0:
        return None, "no query rows, no keys or no heads"
    if max(cq[-1], ck[-1]) > _MAX_ROWS:
        return None, f"more than {_MAX_ROWS} packed rows (int32 offsets)"
    problem.varlen = Packed(_device_offsets(cu_seqlens_q, cq, problem.q),
                            _device_offsets(cu_seqlens_k, ck, problem.q),
                            int(np.diff(cq).max()), int(np.diff(ck).max()),
                            causal == "bottom_right")
    try:
        return _plan.choose(problem, backend, algorithm), None
    except ValueError as e:
        problem.varlen = None
        return None, str(e)


#: a user's modifications: they see b as the packed sequence's index and q_idx / kv_idx as
#: positions within the sequence
USER_MODS = ("score_mod", "mask_mod")


def _packed_options(q, cq, dropout_p, dropout_seed, alibi_slopes):
    """A packed call's dropout (a Dropout, None without; sequence b draws its mask under
    numflash.dropout.packed_seed(seed, b), in the one launch as in its own call), after the
    check packing adds to alibi_slopes: (H,) for every sequence or (B, H), sequence b reading
    row b (numflash.mods.row_options). The other modification options are checked on the
    packed problem (_packed_mods)."""
    from .dropout import build
    from .mods import split_alibi_rows
    drop = build(dropout_p, dropout_seed)
    split_alibi_rows(alibi_slopes, cq.size - 1, q.shape[1], "packed sequence")
    return drop


def _packed_mods(problem, mods, count, drop):
    """Attach the modifications and dropout ``drop`` to the packed ``problem``, the
    modifications built for ``count`` sequences as the batch (the one launch's kernels call them
    with b = the sequence, q_idx / kv_idx within it, and ALiBi with each sequence's own offset):
    every option is checked here, before anything runs, whichever path then runs the call."""
    problem.dropout = drop
    if mods:
        from .mods import build
        B, H, Nq, Nk = problem.shape[:4]
        problem.mods = build((count, H, Nq, Nk), problem.kind, problem.causal_offset,
                             device_id=problem.q.device.id if problem.on_device else None,
                             **mods)
    return problem


def _no_user_mods_per_call(problem, mods, why, cq, ck):
    """Raise where a user's score_mod / mask_mod on device arrays would run in the calls of
    one sequence each: those calls run on the CPU path only (numflash.mods.at_batch), so name
    why the one launch does not take this call and what would. Nothing is raised where no
    sequence has both queries and keys (no call would run the functions)."""
    runs = cq.size > 1 and bool(((np.diff(cq) > 0) & (np.diff(ck) > 0)).any())
    if problem.on_device and runs and problem.q.shape[1] and \
            any(name in mods for name in USER_MODS):
        raise ValueError(f"a score_mod / mask_mod on packed device arrays runs in cuda.mma's one "
                         f"launch (compute capability >= 8.0, 16-byte aligned rows), which does "
                         f"not take this call: {why}. NumPy arrays take it (the CPU path runs "
                         f"one call per sequence)")


def explain_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                   *, causal=False, softmax_scale=None, backend="auto", algorithm="auto",
                   precision="auto", backward=False, deterministic=False, dropout_p=0.0,
                   score_mod=None, mask_mod=None, mod_args=(), score_mod_grad=None,
                   window_size=None, softcap=None, alibi_slopes=None, score_mod_args_grad=None,
                   return_mod_args_grad=False):
    """The :class:`numflash.plan.Plan` that :func:`attention_varlen` (``backward=True``:
    :func:`attention_varlen_backward`, with its ``deterministic`` and ``return_mod_args_grad``)
    would run for these arguments: the one launch for every sequence, or else the plan of the
    per-sequence call for the longest sequence, with a note saying that one call per sequence
    runs, and why."""
    import dataclasses
    from . import plan as _plan
    from .api import _mod_options, _with_mod_args_grad, _with_mods
    from .inputs import normalize
    from .mods import row_options
    cq, ck = _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    mods = _mod_options(score_mod, mask_mod, mod_args, score_mod_grad, window_size, softcap,
                        alibi_slopes, None, None, None, score_mod_args_grad)
    drop = _packed_options(q, cq, dropout_p, 0 if dropout_p else None, alibi_slopes)
    options = dict(causal=causal, softmax_scale=softmax_scale, layout="bshd",
                   precision=precision)
    problem = _packed_mods(normalize(q[None], k[None], v[None], **options), mods,
                           cq.size - 1, drop)
    if backward:
        problem.direction, problem.deterministic = "backward", deterministic
        _with_mod_args_grad(problem, return_mod_args_grad)
    plan, why = _one_launch(problem, cq, ck, cu_seqlens_q, cu_seqlens_k, causal, backend,
                            algorithm)
    if plan is not None:
        return plan
    _no_user_mods_per_call(problem, mods, why, cq, ck)
    b = int(np.argmax(np.diff(cq))) if cq.size > 1 else 0
    sq, eq, sk, ek = (int(cq[b]), int(cq[min(b + 1, cq.size - 1)]), int(ck[b]),
                      int(ck[min(b + 1, ck.size - 1)]))
    one = _with_mods(normalize(q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], **options),
                     row_options(mods, b) if cq.size > 1 else {})
    if backward:
        one.direction, one.deterministic = "backward", deterministic
    one.dropout = drop
    plan = _plan.choose(one, backend, algorithm)
    return dataclasses.replace(plan, notes=plan.notes + [
        f"packed sequences: one call per sequence ({cq.size - 1} calls; this is the longest's "
        f"plan), not one launch: {why}"])


def _xp(a):
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     *, causal=False, softmax_scale=None, backend="auto", algorithm="auto",
                     return_lse=False, out=None, precision="auto", dropout_p=0.0,
                     dropout_seed=None, score_mod=None, mask_mod=None, mod_args=(),
                     score_mod_grad=None, window_size=None, softcap=None, alibi_slopes=None,
                     score_mod_args_grad=None):
    """Attention over packed sequences: sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]
    against k, v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]], flash-attn's ``flash_attn_varlen_func``
    layout: q (total_q, H, d), k (total_k, Hk, d), v (total_k, Hk, dv). ``causal`` applies per
    sequence, in either alignment. ``max_seqlen_q/k`` are optional and checked when given.

    Returns the packed output (total_q, H, dv) in q's dtype and kind (or ``out``), and with
    ``return_lse`` the lse as (H, total_q) (flash-attn's varlen layout).

    ``dropout_p`` and ``dropout_seed``: attention dropout as :func:`numflash.attention` applies
    it, sequence b drawing its mask as a batch of one under the seed
    ``numflash.dropout.packed_seed(dropout_seed, b)`` (so its attention call alone, with that
    seed, gives the same result, and so does the one launch).

    ``score_mod``, ``mask_mod``, ``mod_args``, ``score_mod_grad``: :func:`numflash.attention`'s
    (numflash.mods), per sequence: the functions see b = the sequence's index (so mod_args
    arrays hold a row per sequence where they read b), q_idx and kv_idx = positions within the
    sequence. ``window_size``, ``softcap`` and ``alibi_slopes``: the built-in modifications,
    applied within each sequence (a window and ALiBi's distances from each sequence's causal
    diagonal; ``alibi_slopes`` (H,) for every sequence, or (B, H) with row b for sequence b).
    ``score_mod_args_grad`` is checked here and used by :func:`attention_varlen_backward`.

    CuPy arrays run in one launch (cuda.mma's, or cuda.wgmma's for plain 16-bit calls on
    Hopper) where those kernels take them (see the module's text); :func:`explain_varlen` says
    which kernel runs and how.
    """
    from .api import _mod_options, attention
    from .inputs import normalize
    from .mods import row_options
    cq, ck = _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    mods = _mod_options(score_mod, mask_mod, mod_args, score_mod_grad, window_size, softcap,
                        alibi_slopes, None, None, None, score_mod_args_grad)
    drop = _packed_options(q, cq, dropout_p, dropout_seed, alibi_slopes)
    xp = _xp(q)
    if out is None:
        out = xp.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype)
    elif tuple(out.shape) != (q.shape[0], q.shape[1], v.shape[2]):
        raise ValueError(f"out must have shape (total_q, H, dv) = "
                         f"{(q.shape[0], q.shape[1], v.shape[2])}; got {tuple(out.shape)}")
    problem = _packed_mods(normalize(q[None], k[None], v[None], causal=causal,
                                     softmax_scale=softmax_scale, layout="bshd",
                                     return_lse=True, out=out[None], precision=precision),
                           mods, cq.size - 1, drop)
    plan, why = _one_launch(problem, cq, ck, cu_seqlens_q, cu_seqlens_k, causal, backend,
                            algorithm)
    if plan is not None:
        lse = plan.run(problem)[0]
        return (out, lse) if return_lse else out
    _no_user_mods_per_call(problem, mods, why, cq, ck)
    lse = xp.empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q.dtype)) if return_lse else None
    for b in range(cq.size - 1):
        sq, eq, sk, ek = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if eq == sq:
            continue
        res = attention(q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], causal=causal,
                        softmax_scale=softmax_scale, layout="bshd", backend=backend,
                        algorithm=algorithm, return_lse=return_lse, out=out[None, sq:eq],
                        precision=precision, **_sequence_dropout(drop, b),
                        **row_options(mods, b))
        if return_lse:
            lse[:, sq:eq] = res[1][0]
    return (out, lse) if return_lse else out


def _sequence_dropout(drop, b):
    """The dropout options of packed sequence b's own call ({} without dropout)."""
    if drop is None:
        return {}
    from .dropout import packed_seed
    return {"dropout_p": drop.p, "dropout_seed": packed_seed(drop.seed, b)}


def attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                              max_seqlen_k=None, *, causal=False, softmax_scale=None,
                              backend="auto", algorithm="auto", precision="auto",
                              deterministic=False, dq=None, dk=None, dv=None, dropout_p=0.0,
                              dropout_seed=None, score_mod=None, mask_mod=None, mod_args=(),
                              score_mod_grad=None, window_size=None, softcap=None,
                              alibi_slopes=None, score_mod_args_grad=None,
                              return_mod_args_grad=False):
    """Gradients (dq, dk, dv) of :func:`attention_varlen`, packed like q, k and v; ``o`` and
    ``lse`` are what it returned (lse as (H, total_q)), ``dropout_p``, ``dropout_seed`` and the
    modifications what it was given (a score_mod needs its score_mod_grad). With
    ``return_mod_args_grad`` (and ``score_mod_args_grad``, as :func:`numflash.attention_backward`
    takes them) a fourth result: mod_args' gradients summed over every sequence, a tuple aligned
    with mod_args (None where none is taken). CuPy arrays run in one launch per pass where
    cuda.mma's backward (or on Hopper cuda.wgmma's) takes them; otherwise one
    :func:`numflash.attention_backward` call per sequence, on views, into views of the packed
    gradients."""
    from .api import _mod_options, _require_grads, _with_mod_args_grad, attention_backward
    from .inputs import normalize_backward
    from .mods import row_options
    cq, ck = _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    mods = _mod_options(score_mod, mask_mod, mod_args, score_mod_grad, window_size, softcap,
                        alibi_slopes, None, None, None, score_mod_args_grad)
    drop = _packed_options(q, cq, dropout_p, dropout_seed, alibi_slopes)
    xp = _xp(q)
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise ValueError(f"lse must have shape (H, total_q) = {(q.shape[1], q.shape[0])} (what "
                         f"attention_varlen(..., return_lse=True) returns); got "
                         f"{tuple(lse.shape)}")
    out_shape = (q.shape[0], q.shape[1], v.shape[2])
    for name, a in (("do", do), ("o", o)):
        if tuple(a.shape) != out_shape:
            raise ValueError(f"{name} must have the output's shape (total_q, H, dv) = {out_shape}; "
                             f"got {tuple(a.shape)}")
    inputs = (("q", q), ("k", k), ("v", v), ("do", do), ("o", o), ("lse", lse))
    for name, given, src in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if given is None:
            continue
        if tuple(given.shape) != tuple(src.shape):
            raise ValueError(f"{name} must have the shape of {name[1]} {tuple(src.shape)}; got "
                             f"{tuple(given.shape)}")
        for other, a in inputs:   # checked before anything is written
            if a is not None and xp.may_share_memory(given, a):
                raise ValueError(f"{name} overlaps {other}: pass a separate output array")
        inputs += ((name, given),)
    problem = _packed_mods(normalize_backward(
        do[None], q[None], k[None], v[None], o[None], lse[None], causal=causal,
        softmax_scale=softmax_scale, layout="bshd", precision=precision,
        deterministic=deterministic, **{name: None if g is None else g[None] for name, g in
                                        (("dq", dq), ("dk", dk), ("dv", dv))}), mods,
        cq.size - 1, drop)
    _require_grads(problem.mods)
    _with_mod_args_grad(problem, return_mod_args_grad)
    plan, why = _one_launch(problem, cq, ck, cu_seqlens_q, cu_seqlens_k, causal, backend,
                            algorithm)
    # the given buffers themselves, else the ones normalize_backward made
    grads = [r[0] if given is None else given for given, r in zip((dq, dk, dv), problem.result)]
    if plan is not None:   # every row of every gradient is written: no zeroing
        plan.run(problem)
        return tuple(grads) + ((problem.dmod_args,) if return_mod_args_grad else ())
    _no_user_mods_per_call(problem, mods, why, cq, ck)
    for g in grads:   # keys no query sees get zero gradients: start from zeros
        g[...] = 0
    totals = None   # mod_args' gradients, summed over the sequences in float64
    for b in range(cq.size - 1):
        sq, eq, sk, ek = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if eq == sq or ek == sk:
            continue
        lse_b = xp.ascontiguousarray(lse[:, sq:eq])[None]
        res = attention_backward(do[None, sq:eq], q[None, sq:eq], k[None, sk:ek],
                                 v[None, sk:ek], o[None, sq:eq], lse_b, causal=causal,
                                 softmax_scale=softmax_scale, layout="bshd", backend=backend,
                                 algorithm=algorithm, precision=precision,
                                 deterministic=deterministic, dq=grads[0][None, sq:eq],
                                 dk=grads[1][None, sk:ek], dv=grads[2][None, sk:ek],
                                 return_mod_args_grad=return_mod_args_grad,
                                 **_sequence_dropout(drop, b), **row_options(mods, b))
        if return_mod_args_grad:   # (row_options put the sequence index first: no gradient)
            parts = res[-1][1:]
            totals = [None if g is None else g.astype(np.float64) + (0 if t is None else t)
                      for g, t in zip(parts, totals or [None] * len(parts))]
    if not return_mod_args_grad:
        return tuple(grads)
    args = mods.get("mod_args", ())
    trained = {n for n, fn in enumerate(score_mod_args_grad) if fn is not None}
    dmod = tuple(None if n not in trained else
                 (totals[n] if totals is not None else xp.zeros(a.shape)).astype(a.dtype)
                 for n, a in enumerate(args))
    return tuple(grads) + (dmod,)


def merge_partials(outs, lses):
    """The attention result over the union of disjoint key sets, from the results over each.

    outs: a sequence of outputs of the same shape (..., Nq, dv), each normalized over its own keys
    (what :func:`numflash.attention` returns); lses: their lse, (..., Nq). Returns (out, lse) with
    lse = log(sum_i exp(lse_i)) and out = sum_i exp(lse_i - lse) out_i, computed in float32
    (float64 for float64 inputs). A row that sees no key in any part gets zeros and lse = -inf; a
    NaN lse in any part makes its row NaN. NumPy or CuPy arrays, all of one kind: CuPy arrays
    are merged in one launch of cuda.merge (the kernel split-KV's shares use), NumPy arrays by
    the formula below. numflash.torch.merge_partials takes torch tensors.
    """
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge_partials needs as many outs as lses, at least one; got "
                         f"{len(outs)} outs and {len(lses)} lses")
    kinds = {array_kind(a) for a in outs + lses}
    if None in kinds or len({k in ("cupy", "cuda") for k in kinds}) > 1:
        raise TypeError("outs and lses must all be NumPy arrays or all device (CuPy) arrays")
    shape, dtype = tuple(outs[0].shape), np.dtype(outs[0].dtype)
    if len(shape) < 2:
        raise ValueError(f"outs must be (..., Nq, dv) arrays, at least 2-D; outs[0] has shape "
                         f"{shape}")
    for i, (o, s) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != shape or np.dtype(o.dtype) != dtype:
            raise ValueError(f"outs[{i}] has shape {tuple(o.shape)} and dtype {o.dtype}; outs[0] "
                             f"has {shape} and {dtype}")
        if tuple(s.shape) != shape[:-1]:
            raise ValueError(f"lses[{i}] must have shape {shape[:-1]} (the outs' without the last "
                             f"axis); got {tuple(s.shape)}")
    xp = _xp(outs[0])
    if xp is not np:
        from .cuda import merge
        from .plan import device_of
        return merge.merge_arrays(outs, lses, device_of(xp.asarray(outs[0])))
    work = lse_dtype(dtype)
    lse_all = xp.stack([xp.asarray(s, dtype=work) for s in lses])
    top = lse_all.max(axis=0)
    top_safe = xp.where(xp.isfinite(top), top, 0)  # rows with no key anywhere: all -inf
    with np.errstate(invalid="ignore", over="ignore"):
        weights = xp.exp(lse_all - top_safe)         # (parts, ..., Nq); NaN stays NaN
        total = weights.sum(axis=0)
        lse = xp.where(total > 0, xp.log(xp.where(total > 0, total, 1)) + top_safe, -xp.inf)
        lse = xp.where(xp.isnan(total), xp.nan, lse)
        scale = weights / xp.where(total > 0, total, 1)
        out = sum(scale[i][..., None] * xp.asarray(o, dtype=work) for i, o in enumerate(outs))
    return out.astype(dtype), lse.astype(lse_dtype(dtype))
