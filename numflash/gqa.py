"""Grouped-query decode as query rows: one query row per head (decoding) against K/V heads shared
by G = H / Hk query heads is the same attention as G query rows per K/V head, a (B, Hk, G)
multi-head call. flash-attn's decode path makes the same swap. The kernel then reads each
K/V row once for G rows instead of once per query head, and the G rows share each tile.

Only where the swap changes nothing a score sees: one query row, which sees every key (not
causal, or causal aligned so that row 0 reaches key Nk - 1: bottom-right), no modification but
a softcap (the others read the query row or head index, which the swap renumbers), no dropout
(its mask is drawn by (b, h, i, j)). The views are of the caller's memory: q's and out's head
axis, split into (Hk, G), becomes the (head, row) pair; lse (B, Hk, G) is (B, H, 1).

Where: the CPU path (cpu.tiled) -- on this project's 2-core CPU, B1 H32 Hk8 d128 float32 at
Nk 32768 / 131072 took 0.33x / 0.32x the time of the per-head call, float16 H32 Hk4 0.18x,
H8 Hk1 0.37x (bench/NOTES.md, session 39). Its tasks are (batch, head, query block): the swap
leaves B * Hk where there were B * H, so where the per-head call fills the threads in fewer
rounds the swap is not taken (:func:`worth_it`, which leaves out the runs of keys cpu.tiled
deals out where its tasks are fewer than the threads). The CUDA kernels always take it: a block's
K/V tiles are the same for G rows as for one (G <= 16 of a tensor-core tile's rows, or G
threads of cuda.row's), so the swap leaves G times fewer blocks, each of the same cost, and
cuda.mma's split-KV fills the GPU from the swapped call's blocks. On the H100, B1 H32 Hk8
Nk131072 d128 float16, the swap made by hand (bench/decode.py's "heads as rows" column) took
0.254 ms against the per-head call's 0.664 (bench/NOTES.md, session 41)."""
import dataclasses

#: cost of a task of G rows against one of a single row, per extra row (a rough fit to the
#: measurements above, which give a G-row task 1.32x a one-row task's time at G = 4, 1.48x at
#: G = 8: 1.25x and 1.58x by this)
ROW_COST = 1 / 12


def rows_of(problem):
    """G, the query heads a K/V head's rows would take, where ``problem`` (a normalized forward
    Problem) may run as query rows; None where the swap would change the attention."""
    B, H, Nq, Nk, d, dv = problem.shape
    Hk = problem.k.shape[1]
    if problem.direction != "forward" or Hk == H or Nq != 1 or Nk == 0 or B * H == 0:
        return None
    if problem.causal and problem.causal_offset < Nk - 1:   # the row misses some keys
        return None
    if problem.dropout is not None or problem.kvcache is not None or \
            problem.varlen is not None:
        return None
    if problem.mods is not None and problem.mods.kinds != {"softcap"}:
        return None
    return H // Hk


def worth_it(problem, threads):
    """Whether the CPU path's ``threads`` finish the swapped call in no more time, counting rounds
    of tasks: ceil(B Hk / threads) tasks of G rows (each 1 + ROW_COST (G - 1) a one-row task)
    against ceil(B H / threads) one-row tasks."""
    B, H = problem.q.shape[:2]
    Hk = problem.k.shape[1]
    G = H // Hk
    return -(-B * Hk // threads) * (1 + ROW_COST * (G - 1)) <= -(-B * H // threads)


def as_rows(problem):
    """``problem`` with each K/V head's query heads as its query rows: q and out as (B, Hk, G, .)
    views of the same memory, not causal (the one row saw every key). Its lse is (B, Hk, G):
    reshaped, the same memory is the per-head call's (B, H, 1)."""
    Hk = problem.k.shape[1]
    return dataclasses.replace(problem, q=_heads_as_rows(problem.q, Hk, problem.xp),
                               out=_heads_as_rows(problem.out, Hk, problem.xp), causal=False,
                               causal_offset=0)


def plan_rows(problem, choose):
    """(plan, run) for ``problem``: ``choose(problem)`` and run() -> its lse, or, where the swap
    applies (and, on the CPU path, is worth it), the swapped problem's plan (with explain's
    note) and a run() that gives its lse back as ``problem``'s (B, H, 1), the same memory."""
    plan = choose(problem)
    if rows_of(problem) is None:
        return plan, lambda: plan.run(problem)
    import numba
    if plan.kernel == "cpu.tiled" and not worth_it(problem, numba.get_num_threads()):
        return plan, lambda: plan.run(problem)
    swapped = as_rows(problem)
    chosen = choose(swapped)
    chosen = dataclasses.replace(chosen, notes=[*chosen.notes, note(problem)])
    return chosen, lambda: chosen.run(swapped).reshape(problem.q.shape[:3])


def note(problem):
    """What explain says of the swap."""
    B, H = problem.q.shape[:2]
    Hk = problem.k.shape[1]
    return (f"grouped-query decode: each K/V head's {H // Hk} query heads run as its "
            f"{H // Hk} query rows (a ({B}, {Hk}, {H // Hk}) multi-head call on the same "
            "memory): each key and value row is read once, not once per query head")


def _heads_as_rows(x, Hk, xp):
    """(B, H, 1, n) -> (B, Hk, H / Hk, n), a view: head h = hk G + g at h's stride."""
    B, H, _, n = x.shape
    G = H // Hk
    sb, sh, _, sn = x.strides
    return xp.lib.stride_tricks.as_strided(x, shape=(B, Hk, G, n), strides=(sb, G * sh, sh, sn))
