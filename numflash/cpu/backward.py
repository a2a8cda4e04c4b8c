"""The CPU backward: FlashAttention-2's gradient loop, compiled with numba.njit.

It shares the forward's tile loads, exp2 and single-threaded BLAS (cpu/tiled.py). D = rowsum(dO * O)
is computed first; then each parallel task owns one (batch, key/value head) and a set of key
blocks. For a key block it walks the query blocks that can see it (of every query head that reads
the key/value head, under grouped-query attention), recomputes P = exp(scale * q k^T - lse) tile
by tile (nothing of size Nq x Nk exists), and accumulates dK and dV for the block in the task's
own buffers, one BLAS product per tile; dQ contributions go to the task's own float accumulator.

dQ without atomics or races: when there are fewer (batch, head) pairs than threads, the key blocks
of one head are dealt round-robin to a few splits, each with its own dQ accumulator, and the
splits are summed in a fixed order at the end (extra memory: splits x Nq x d per head, splits
<= 4 x threads). The result is the same bit for bit on every run with the same thread count, so
``deterministic=True`` costs nothing here.
"""
import numba
import numpy as np
from numba import njit, prange

from ..device import Unsupported
from ..mods import bias_grad_accumulator, compile_errors
from .tiled import FASTMATH, LOG2E, _exp2, _load_block, _SingleThreadedBlas, all_finite, \
    apply_dropout, dropout_arguments, half_table, run_tasks, uncached, visible_keys

NAME = "cpu.tiled"
BLOCK_Q = 256
BLOCK_K = 256
MIN_BLOCK_K = 32


@njit(fastmath=FASTMATH, cache=True)
def _masked_products(p, ds, qr, dor, kc, t_v, t_k, t_q, b, h, i0, j0, cols, causal, causal_offset,
                     lse2_rows, zero, dropout, z, mod_visible, mod_args):
    """t_v = P^T dO, t_k = dS^T Q, t_q = dS K over visible (row, key) pairs only (t_v also
    over the pairs dropout keeps only: with ``dropout``, z[r, c] = 0 where dropped)."""
    rows = qr.shape[0]
    t_v[:cols] = zero
    t_k[:cols] = zero
    t_q[:rows] = zero
    for r in range(rows):
        if lse2_rows[r] == -np.inf:  # the row sees no key
            continue
        for c in range(visible_keys(i0 + r, j0, cols, causal, causal_offset)):
            if mod_visible is not None and not mod_visible(b, h, i0 + r, j0 + c, mod_args):
                continue
            if dropout is None or z[r, c] != 0:
                for x in range(dor.shape[1]):
                    t_v[c, x] += p[r, c] * dor[r, x]
            for x in range(qr.shape[1]):
                t_k[c, x] += ds[r, c] * qr[r, x]
                t_q[r, x] += ds[r, c] * kc[c, x]


@njit(fastmath=FASTMATH, cache=True)
def _key_block_gradients(q, k, v, do, lse2, delta, dq_acc, dk, dv, b, hk, group, j0, cols, c2,
                         scale, causal, causal_offset, block_q, lut, kj, vj, qi, doi, s_buf,
                         dp_buf, dk_acc, dv_acc, t_k, t_v, t_q, g_buf, gb_buf, z_buf, dropout,
                         dbias, mod, mod_visible, mod_live, mod_args, xa_buf, add_arg_grads,
                         arg_accs, task):
    """dK and dV for keys j0:j0+cols of key/value head (b, hk), summed over the `group` query
    heads that read it (grouped-query attention), and their dQ contributions into dq_acc.

    ``mod`` (None, or numflash.mods' compiled apply_backward): each tile of raw scores becomes
    the modified scaled scores (then c2 = log2(e)) and g_buf the score_mod's derivative, which
    dS picks up by the chain rule; gb_buf that of the score_mods after attn_bias. ``dbias``
    (None, or mods.bias_grad_accumulator's (B, H, Nq, Nk) view): each pair's P (dP - D) * gb
    is added to dbias[b, h, i, j]. ``add_arg_grads`` (None, or the compiled composition's):
    each pair's P (dP - D) goes into this ``task``'s accumulators ``arg_accs`` of mod_args'
    gradients (xa_buf keeps the scores entering the user's score_mod, which its derivatives
    read). Query blocks that ``mod_live`` says a block mask empties
    for these keys are skipped. ``dropout`` (None, or tiled.dropout_arguments' tuple): its
    factors Z (numflash.dropout) go to z_buf, and P Z takes P's place in dV, Z dP dP's in
    dS."""
    Nq = q.shape[2]
    d = q.shape[3]
    dvd = v.shape[3]
    zero = dk.dtype.type(0)
    _load_block(k, b, hk, j0, cols, lut, kj)
    _load_block(v, b, hk, j0, cols, lut, vj)
    kc, vc = kj[:cols], vj[:cols]
    kv_finite = all_finite(kc) and all_finite(vc)
    dk_acc[:cols] = zero
    dv_acc[:cols] = zero
    # Query rows before the first that sees key j0 contribute nothing (causal tile skipping).
    i_first = max(0, j0 - causal_offset) if causal else 0
    first = (i_first // block_q) * block_q
    blocks = max(0, (Nq - first + block_q - 1) // block_q)
    for step in range(group * blocks):  # each query block of each query head of the group
        h = hk * group + step % group
        i0 = first + (step // group) * block_q
        rows = min(block_q, Nq - i0)
        if mod is not None and not mod_live(b, h, i0, rows, j0, cols, mod_args):
            continue
        _load_block(q, b, h, i0, rows, lut, qi)
        _load_block(do, b, h, i0, rows, lut, doi)
        qr, dor = qi[:rows], doi[:rows]
        s = s_buf[:rows * cols].reshape((rows, cols))
        dp = dp_buf[:rows * cols].reshape((rows, cols))
        np.dot(qr, kc.T, s)
        np.dot(dor, vc.T, dp)
        g = s  # the score_mod's derivatives, with a modification (stand-ins without)
        gb = s
        xa = s
        if mod is not None:  # compiled away without a modification
            g = g_buf[:rows * cols].reshape((rows, cols))
            gb = gb_buf[:rows * cols].reshape((rows, cols))
            if add_arg_grads is not None:
                xa = xa_buf[:rows * cols].reshape((rows, cols))
            mod(s, g, gb, xa, b, h, i0, j0, scale, mod_args)
        z = s  # dropout's factors (a stand-in without)
        if dropout is not None:  # compiled away without dropout
            z = z_buf[:rows * cols].reshape((rows, cols))
            z[:] = 1
            apply_dropout(z, b, h, i0, j0, *dropout)
        # P = exp(scale s - lse) = 2**(c2 s - lse2); dS = scale P (dP - D), in place over s.
        for r in range(rows):
            i = i0 + r
            m = lse2[b, h, i]
            last = visible_keys(i, j0, cols, causal, causal_offset)
            if m == -np.inf:  # the row sees no key: P = 0 (and 2**(x - -inf) would be inf)
                last = 0
            dr = delta[b, h, i]
            for c in range(last):
                p = _exp2(s[r, c] * c2 - m)
                s[r, c] = p
                # with dropout dV takes P Z, dS = P (Z dP - D): a dropped pair's dP is not read
                if dropout is not None:
                    s[r, c] = p * z[r, c]
                    dp[r, c] = dp[r, c] * z[r, c] if z[r, c] != 0 else zero
                if mod is None:
                    dp[r, c] = p * (dp[r, c] - dr) * scale
                elif mod_visible(b, h, i, j0 + c, mod_args):  # chain rule through score_mod
                    ds = p * (dp[r, c] - dr)  # d loss / d(the modified score)
                    dp[r, c] = ds * scale * g[r, c]
                    if dbias is not None:
                        dbias[b, h, i, j0 + c] += ds * gb[r, c]
                    if add_arg_grads is not None:
                        add_arg_grads(ds, xa[r, c], b, h, i, j0 + c, mod_args, arg_accs, task)
                else:  # masked by a mask_mod: nothing flows (not even 0 * NaN)
                    s[r, c] = zero
                    dp[r, c] = zero
            for c in range(last, cols):
                s[r, c] = zero
                dp[r, c] = zero
        if kv_finite and all_finite(qr) and all_finite(dor):
            np.dot(s.T, dor, t_v[:cols])       # P^T dO
            np.dot(dp.T, qr, t_k[:cols])       # dS^T Q
            np.dot(dp, kc, t_q[:rows])         # dS K
        else:  # non-finite inputs: sum over the (row, key) pairs that see each other only, so
            #    a NaN never reaches a gradient through a masked (zero) P or dS: 0 * NaN
            _masked_products(s, dp, qr, dor, kc, t_v, t_k, t_q, b, h, i0, j0, cols, causal,
                             causal_offset, lse2[b, h, i0:i0 + rows], zero, dropout, z,
                             mod_visible, mod_args)
        for c in range(cols):
            for x in range(dvd):
                dv_acc[c, x] += t_v[c, x]
            for x in range(d):
                dk_acc[c, x] += t_k[c, x]
        for r in range(rows):
            for x in range(d):
                dq_acc[b, h, i0 + r, x] += t_q[r, x]
    for c in range(cols):
        for x in range(d):
            dk[b, hk, j0 + c, x] = dk_acc[c, x]
        for x in range(dvd):
            dv[b, hk, j0 + c, x] = dv_acc[c, x]


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def tiled_backward(q, k, v, do, lse2, delta, dq_parts, dk, dv, c2, scale, causal, causal_offset,
                   block_q, block_k, lut, dropout, dbias, share_b, share_h, mod, mod_visible,
                   mod_live, mod_args, add_arg_grads, arg_accs, task_first, task_step):
    """dk, dv (compute dtype) and dq_parts[split] (zeroed; summed by the caller) for every head.

    q, k, v, do: (B, H, N, .) of any strides (float32, float64, or float16 bits as uint16);
    lse2 = lse * log2(e) and delta = rowsum(dO * O): (B, H, Nq) in the compute dtype.
    With a modification (mod, mod_visible, mod_live, mod_args, add_arg_grads from
    numflash.mods; None, None, None, (), None without)
    c2 = log2(e): the kernel scales and modifies the scores itself. ``dropout``: the forward's
    (tiled.dropout_arguments; None without). ``dbias``: attn_bias's gradient accumulator (see
    _key_block_gradients; None without); a bias shared by every batch entry (``share_b``) or
    head (``share_h``) makes each task walk all of them, so that no two tasks add into one
    element. ``arg_accs``: mod_args' gradient accumulators, (tasks, ...) each (() without).
    Runs tasks task_first,
    task_first + task_step, ... (0, 1: all; tiled.run_tasks spreads them over threads).
    """
    splits, B, H, Nq, d = dq_parts.shape
    Hk = k.shape[1]
    group = H // Hk  # grouped-query attention: key/value head hk serves query heads hk*group...
    Nk = k.shape[2]
    dvd = v.shape[3]
    nkb = (Nk + block_k - 1) // block_k
    dt = dk.dtype
    tasks_b = 1 if share_b else B
    tasks_h = 1 if share_h else Hk
    for n in prange((tasks_b * tasks_h * splits - task_first + task_step - 1) // task_step):
        task = task_first + n * task_step
        bh = task // splits
        split = task % splits
        kj = np.empty((block_k, d), dt)
        vj = np.empty((block_k, dvd), dt)
        qi = np.empty((block_q, d), dt)
        doi = np.empty((block_q, dvd), dt)
        s_buf = np.empty(block_q * block_k, dt)
        dp_buf = np.empty(block_q * block_k, dt)
        dk_acc = np.empty((block_k, d), dt)
        dv_acc = np.empty((block_k, dvd), dt)
        t_k = np.empty((block_k, d), dt)
        t_v = np.empty((block_k, dvd), dt)
        t_q = np.empty((block_q, d), dt)
        g_buf = np.empty(block_q * block_k if mod is not None else 0, dt)
        gb_buf = np.empty(block_q * block_k if mod is not None else 0, dt)
        z_buf = np.empty(block_q * block_k if dropout is not None else 0, dt)
        xa_buf = np.empty(block_q * block_k if add_arg_grads is not None else 0, dt)
        for shared in range((B if share_b else 1) * (Hk if share_h else 1)):
            b = shared // (Hk if share_h else 1) if share_b else bh // tasks_h
            hk = shared % Hk if share_h else bh % tasks_h
            # Round-robin key blocks: under a causal mask later blocks have less work, so
            # dealing them out keeps the splits even.
            for jb in range(split, nkb, splits):
                j0 = jb * block_k
                _key_block_gradients(q, k, v, do, lse2, delta, dq_parts[split], dk, dv, b, hk,
                                     group, j0, min(block_k, Nk - j0), c2, scale, causal,
                                     causal_offset, block_q, lut, kj, vj, qi, doi, s_buf, dp_buf,
                                     dk_acc, dv_acc, t_k, t_v, t_q, g_buf, gb_buf, z_buf,
                                     dropout, dbias, mod, mod_visible, mod_live, mod_args,
                                     xa_buf, add_arg_grads, arg_accs, task)


_MOD_KERNELS = {}


def _backward_with_mods():
    """The backward's non-cached copies for modifications (see tiled.uncached)."""
    if "backward" not in _MOD_KERNELS:
        products = uncached(_masked_products)
        block = uncached(_key_block_gradients, _masked_products=products)
        _MOD_KERNELS["backward"] = uncached(tiled_backward, _key_block_gradients=block)
    return _MOD_KERNELS["backward"]


def _bias_sharing(problem):
    """(share_b, share_h, share_j): whether attn_bias's gradient (when asked for) broadcasts
    along the batch, the heads or the keys, i.e. whether tasks that own different batch
    entries, heads or key blocks would add into one of its elements."""
    if problem.dbias is None:
        return False, False, False
    full = problem.shape[:4]
    shape4 = (1,) * (4 - problem.dbias.ndim) + tuple(problem.dbias.shape)
    b, h, _, j = (n == 1 and f > 1 for n, f in zip(shape4, full))
    return b, h, j


#: the most memory that mod_args' gradient accumulators (one a task) may take
ARG_GRAD_BYTES = 1 << 30


def _mod_args_accumulators(problem, tasks):
    """Zeros for each trained mod_args array, one float64 copy a task ((tasks,) + its shape):
    tasks add into their own copy, summed in a fixed order afterwards. () when not asked."""
    if problem.dmod_args is None:
        return ()
    return tuple(np.zeros((tasks,) + g.shape) for g in problem.dmod_args if g is not None)


def config(problem, device):
    B, H, Nq, Nk, d, dv = problem.shape
    share_b, share_h, share_j = _bias_sharing(problem)
    # tasks own key/value heads (all of them, or all batch entries, where a bias's gradient is
    # shared along that dim)
    heads = 1 if share_h else problem.k.shape[1]
    batch = 1 if share_b else B
    threads = numba.get_num_threads()
    block_k = BLOCK_K
    while block_k > MIN_BLOCK_K and batch * heads * -(-Nk // block_k) < 4 * threads:
        block_k //= 2
    nkb = -(-Nk // block_k)
    splits = 1 if share_j else max(1, min(nkb, -(-4 * threads // max(1, batch * heads))))
    if problem.dmod_args is not None:  # each task keeps its own copy of the gradients
        size = max(1, sum(g.size for g in problem.dmod_args if g is not None))
        splits = max(1, min(splits, ARG_GRAD_BYTES // (8 * size * batch * heads)))
        if batch * heads * splits * size * 8 > ARG_GRAD_BYTES:
            raise Unsupported(f"{NAME} keeps one float64 copy of the trained mod_args' {size} "
                              f"elements a task, {batch * heads} tasks here: more than "
                              f"{ARG_GRAD_BYTES >> 30} GiB; a table that large is better an "
                              f"attn_bias (return_bias_grad=True adds in place)")
    return {"block_q": BLOCK_Q, "block_k": block_k, "splits": splits, "share_b": share_b,
            "share_h": share_h}


def run(problem, config, device=None):
    """Fill problem.dq, dk, dv for a normalized NumPy backward problem."""
    p = problem
    compute = np.float64 if p.dtype == np.float64 else np.float32
    lut = half_table()
    q, k, v, do = p.q, p.k, p.v, p.do
    if p.dtype == np.float16:
        q, k, v, do = (a.view(np.uint16) for a in (q, k, v, do))
    B, H, Nq, Nk, d, dv = p.shape
    # D = rowsum(dO * O) from O as stored, as FlashAttention-2's preprocessing pass does.
    delta = np.einsum("bhnd,bhnd->bhn", p.do.astype(compute), p.o.astype(compute))
    lse2 = np.ascontiguousarray(p.lse, dtype=compute) * compute(LOG2E)
    dq_parts = np.zeros((config["splits"], B, H, Nq, d), compute)
    dk = p.dk if p.dk.dtype == compute else np.empty(p.dk.shape, compute)
    dvo = p.dv if p.dv.dtype == compute else np.empty(p.dv.shape, compute)
    dbias = acc = None
    if p.dbias is not None:
        # float64 sums: a bias shared along many pairs sums as many dS terms, which cancel
        acc, dbias = bias_grad_accumulator(np, p.dbias, (B, H, Nq, Nk), np.float64)
    args = (q, k, v, do, lse2, delta, dq_parts, dk, dvo, compute(p.scale * LOG2E),
            compute(p.scale), p.causal, p.causal_offset, config["block_q"], config["block_k"],
            lut, dropout_arguments(p, compute), dbias, config["share_b"], config["share_h"])
    tasks = ((1 if config["share_b"] else B) * (1 if config["share_h"] else k.shape[1]) *
             config["splits"])
    chunk = numba.set_parallel_chunksize(1)
    arg_accs = ()
    try:
        with _SingleThreadedBlas(), compile_errors(p.mods):
            no_mods = (None, None, None, (), None, ())
            if p.mods is None and p.dropout is None:
                tiled_backward(*args, *no_mods, 0, 1)
            elif p.mods is None:  # numba's parallel loops take no tuple: run_tasks' threads
                run_tasks(_backward_with_mods(), args + no_mods, tasks)
            else:  # scores are scaled and modified in the kernel
                _, apply_backward, visible, live, add_arg_grads = p.mods.compiled()
                args = args[:9] + (compute(LOG2E),) + args[10:] + (apply_backward, visible,
                                                                  live, p.mods.args)
                arg_accs = _mod_args_accumulators(p, tasks)
                args += (add_arg_grads if arg_accs else None, arg_accs)
                run_tasks(_backward_with_mods(), args, tasks)
    finally:
        numba.set_parallel_chunksize(chunk)
    dq = dq_parts[0]
    for split in range(1, config["splits"]):  # a fixed order: bitwise reproducible
        dq += dq_parts[split]
    p.dq[...] = dq
    if dk is not p.dk:
        p.dk[...] = dk
    if dvo is not p.dv:
        p.dv[...] = dvo
    if acc is not None and not np.may_share_memory(acc, p.dbias):
        p.dbias[...] = acc.reshape(p.dbias.shape)
    if arg_accs:
        trained = [g for g in p.dmod_args if g is not None]
        for g, task_sums in zip(trained, arg_accs):
            g[...] = task_sums.sum(axis=0)  # a fixed order: bitwise reproducible
