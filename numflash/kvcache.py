"""Attention over a KV cache (flash-attn's ``flash_attn_with_kvcache`` conventions): new keys and
values appended in place at each sequence's length, then the queries attend to everything
cached, from a contiguous cache or a paged one (vLLM's layout: pages of ``page_size`` rows
picked by a block table).

On the GPU the tensor-core forward reads the cache in one launch (cuda.mma's KVLEN / PAGE
variant: each batch entry's key count from ``kv_lens``, a paged cache's rows through the block
table, in place; split-KV when the query rows cannot fill the GPU). Everywhere else (the CPU,
cuda.block / cuda.row, page sizes that are not powers of two, rows cp.async cannot read) it runs
one :func:`numflash.attention` call per batch entry on the cached rows: views of a contiguous
cache, a gather of a paged cache's pages. The lengths and the block table are checked on the
host before anything is written (one copy of each to the host: given as NumPy arrays, they need
no synchronization).

A repeated one-launch call with the same arrays' shapes, strides, dtypes and options replays the
recorded launch (numflash.cuda.fastpath) with the new lengths and block table instead of
normalizing and planning again (not with alibi_slopes: the recorded launch would keep the first
call's slopes); the checks of the lengths and the table run every call.
"""
from dataclasses import dataclass

import numpy as np

from .inputs import array_kind, host_values, lse_dtype

__all__ = ["attention_with_kvcache"]


@dataclass
class KVCache:
    """What cuda.mma's KV-cache variant reads besides q, k, v (Problem.kvcache): each entry's key
    count after the append (int32 (B,)), and for a paged cache its block table (int32 (B,
    max_pages)) and rows a page (None: contiguous), and the longest entry's key count."""
    lens: object
    block_table: object = None
    page: int = None
    max_len: int = None   # the longest entry's keys (what split-KV shares out)

#: the attention() options that pass through unchanged (per-batch arrays would need slicing)
PASSED_OPTIONS = ("softmax_scale", "backend", "algorithm", "precision", "window_size",
                  "softcap", "num_splits")


def _host_ints(name, a, B):
    """An int, a list or a (B,) integer array (NumPy or CuPy) as a host int64 array of B
    entries."""
    if isinstance(a, (int, np.integer)) and not isinstance(a, bool):
        return np.full(B, int(a), np.int64)
    a = host_values(name, a, "an int, a list or a (B,) integer array")
    if a.shape != (B,) or a.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an int or a ({B},) integer array; got shape {a.shape}, "
                         f"dtype {a.dtype}")
    return a.astype(np.int64)


def _check(q, k_cache, v_cache, k, v, block_table):
    """The arrays' kinds, devices, dims, dtypes and shapes; returns (B, page or None, capacity
    per sequence)."""
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    arrays.update({n: a for n, a in (("k", k), ("v", v)) if a is not None})
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values) or not at all")
    kinds = {}
    for name, a in arrays.items():
        kinds[name] = array_kind(a)
        if kinds[name] not in ("numpy", "cupy"):
            raise TypeError(f"{name} must be a NumPy or CuPy array; got {type(a).__name__}")
        if getattr(a, "ndim", None) != 4:
            axes = "B, N, H, d" if name in ("q", "k", "v") else "B, S, Hk, d; paged: pages, " \
                "page_size, Hk, d"
            raise ValueError(f"{name} must be 4-D ({axes}); got shape "
                             f"{tuple(getattr(a, 'shape', ()))}")
    if len(set(kinds.values())) > 1:
        raise TypeError("q, k_cache, v_cache (and k, v) must all be NumPy arrays or all CuPy "
                        "arrays on one GPU")
    devices = {name: a.device.id for name, a in arrays.items() if kinds[name] == "cupy"}
    if len(set(devices.values())) > 1:
        raise ValueError(f"the arrays are on different GPUs: {devices}")
    dtype = np.dtype(q.dtype)
    for name, a in arrays.items():
        if np.dtype(a.dtype) != dtype:
            raise TypeError(f"{name} has dtype {a.dtype}, q has {dtype}")
    B, Nq, H, d = q.shape
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         f"differ in their first three axes")
    Hk = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache's head dim {k_cache.shape[3]} is not q's {d}")
    if Hk == 0 or H % Hk:
        raise ValueError(f"q's {H} heads do not divide into the cache's {Hk} K/V heads")
    for name, a, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if a is not None and (a.shape[0] != B or a.shape[2:] != cache.shape[2:]
                              or a.shape[1] != k.shape[1]):
            raise ValueError(f"{name} must have shape (B={B}, N_new, {cache.shape[2]}, "
                             f"{cache.shape[3]}) like {name}_cache's rows (and k's N_new); got "
                             f"{tuple(a.shape)}")
    if block_table is None:
        if k_cache.shape[0] != B:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, q has batch {B} (a "
                             f"paged cache needs block_table)")
        return B, None, k_cache.shape[1]
    if array_kind(block_table) not in (None, "numpy", kinds["q"]):
        raise TypeError("block_table must be a NumPy array, or a CuPy array with CuPy inputs")
    if array_kind(block_table) == "cupy" and block_table.device.id != q.device.id:
        raise ValueError(f"block_table is on GPU {block_table.device.id}, q on GPU "
                         f"{q.device.id}")
    if array_kind(block_table) is None or getattr(block_table, "ndim", None) != 2 \
            or block_table.shape[0] != B or np.dtype(block_table.dtype).kind not in "iu":
        raise ValueError(f"block_table must be a (B={B}, max_pages) integer array; got "
                         f"{getattr(block_table, 'shape', type(block_table).__name__)}")
    return B, k_cache.shape[1], block_table.shape[1] * k_cache.shape[1]


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                           block_table=None, *, causal=False, return_lse=False,
                           alibi_slopes=None, **options):
    """Append ``k``, ``v`` to the cache at each sequence's length, then attend ``q`` to the
    cached keys and values; flash-attn's ``flash_attn_with_kvcache`` conventions (bshd layout).

    q: (B, Nq, H, d). k_cache, v_cache: (B, S, Hk, d) / (B, S, Hk, dv), or paged (pages,
    page_size, Hk, d) with ``block_table`` (B, max_pages) integers: sequence b's row j lives in
    page block_table[b, j // page_size], row j % page_size. k, v: (B, N_new, Hk, d) new rows
    written into the caches in place at rows cache_seqlens[b] ... + N_new (decode: N_new = Nq =
    1; chunked or speculative prefill: more). cache_seqlens: an int or (B,) integers, the rows
    cached before the append (None: every row of a contiguous cache is in use, nothing is
    appended). Sequence b attends to its first cache_seqlens[b] + N_new rows; ``causal=True``
    aligns the queries with the last of them (bottom-right: the query rows are the newest
    positions). Options: softmax_scale, backend, algorithm, precision, window_size (with
    causal=True), softcap, num_splits, as for :func:`numflash.attention`, and alibi_slopes (with
    causal=True: each score less slope x its key's distance from the query's aligned row, the
    output flash-attn's; (H,), or (B, H) with row b for entry b); all are checked before
    anything is written.

    CuPy arrays run as one cuda.mma launch that reads the cache in place when that kernel takes
    the call (power-of-two page sizes, rows cp.async can read; with alibi_slopes too, each
    entry's distances from its own newest row, but such a call is planned every time, never
    replayed: the recorded launches would keep the first call's slopes); otherwise, and for
    NumPy arrays, one :func:`numflash.attention` call per batch entry (a paged cache's pages
    gathered).

    Returns the output (B, Nq, H, dv) in q's dtype and kind, and with ``return_lse`` the
    (B, H, Nq) lse.
    """
    from .api import attention
    unknown = sorted(set(options) - set(PASSED_OPTIONS))
    if unknown:
        raise TypeError(f"attention_with_kvcache does not take {', '.join(unknown)} yet; it "
                        f"takes {', '.join(PASSED_OPTIONS)}, alibi_slopes, causal and "
                        f"return_lse")
    key = None if alibi_slopes is not None else _replay_key(q, k_cache, v_cache, k, v,
                                                             block_table, causal, return_lse,
                                                             options)
    known = _recorded.get(key) if key is not None else None
    if known is not None:   # the arrays' checks passed with this signature before
        B, page, capacity = known.B, known.page, known.capacity
    else:
        B, page, capacity = _check(q, k_cache, v_cache, k, v, block_table)
    if alibi_slopes is not None:   # (never recorded: a replay would keep the first slopes)
        _check_alibi(alibi_slopes, B, q.shape[2], causal)
    new = 0 if k is None else k.shape[1]
    if options.get("window_size") is not None and not causal:
        raise ValueError("attention_with_kvcache takes window_size with causal=True (the window "
                         "measured from the newest rows); a window without causal is not "
                         "supported yet")
    lengths = _lengths(cache_seqlens, B, new, capacity, block_table)
    ends = lengths + new
    pages = None if page is None else _pages(block_table, ends, page, k_cache.shape[0])
    if known is not None:
        replay = known.replay(ends)
        if replay is not None:
            return _replayed(replay, known, q, k_cache, v_cache, k, v, lengths, ends, pages,
                             block_table)
    xp = np if array_kind(q) == "numpy" else __import__("cupy")
    flat = None if page is None else _flat_pages(k_cache, v_cache)
    # every option checked (a plan chosen) before anything is written
    one = _one_launch_plan(xp, q, k_cache, v_cache, flat, ends, pages, page, block_table,
                           causal, return_lse, options, alibi_slopes)
    if one is None:
        from .api import explain
        explain(q[:1], k_cache[:1], v_cache[:1], layout="bshd", return_lse=return_lse,
                causal="bottom_right" if causal else False, **options,
                **_entry_alibi(alibi_slopes, 0))
    if new:
        _append(xp, k_cache, v_cache, flat, k, v, lengths, pages, page)
    Nq, H = q.shape[1], q.shape[2]
    out = xp.empty((B, Nq, H, v_cache.shape[3]), q.dtype)
    lse = xp.empty((B, H, Nq), lse_dtype(q.dtype)) if return_lse else None
    if B * Nq * H == 0:   # nothing to attend with (a launch would have an empty grid)
        return (out, lse) if return_lse else out
    if one is not None:
        problem, plan = one
        lse = _run_and_record(key, problem, plan, q, k_cache, v_cache, options, capacity)
        return (problem.result, lse) if return_lse else problem.result
    for b in range(B):
        end = int(lengths[b]) + new
        if page is None:
            keys, values = k_cache[b:b + 1, :end], v_cache[b:b + 1, :end]
        else:
            used = pages[b, :-(-end // page)]
            keys, values = (c[xp.asarray(used)].reshape((1, -1) + c.shape[2:])[:, :end]
                            for c in (k_cache, v_cache))
        res = attention(q[b:b + 1], keys, values, layout="bshd",
                        causal="bottom_right" if causal else False, out=out[b:b + 1],
                        return_lse=return_lse, **options, **_entry_alibi(alibi_slopes, b))
        if return_lse:
            lse[b] = res[1][0]
    return (out, lse) if return_lse else out


def _check_alibi(alibi_slopes, B, H, causal):
    """What attention() cannot check on one entry's call: the alignment, and a row per entry."""
    from .mods import split_alibi_rows
    if not causal:
        raise ValueError("attention_with_kvcache takes alibi_slopes with causal=True (distances "
                         "measured from the newest rows, as flash-attn does); without causal "
                         "they would be measured from the first row")
    split_alibi_rows(alibi_slopes, B, H, "batch entry")


def _entry_alibi(alibi_slopes, b):
    """Entry b's alibi_slopes option ({} without): row b of a (B, H) table."""
    from .mods import row_options
    return {} if alibi_slopes is None else row_options({"alibi_slopes": alibi_slopes}, b)


def _lengths(cache_seqlens, B, new, capacity, block_table):
    """cache_seqlens as host int64 (B,) lengths, checked to leave room for ``new`` rows."""
    if cache_seqlens is None:
        if block_table is not None or new:
            raise ValueError("cache_seqlens is needed with a paged cache (block_table) and to "
                             "append k, v (None means every row of the cache is in use)")
        return np.full(B, capacity, np.int64)
    lengths = _host_ints("cache_seqlens", cache_seqlens, B)
    if (lengths < 0).any() or (lengths + new > capacity).any():
        b = int(np.argmax((lengths < 0) | (lengths + new > capacity)))
        raise ValueError(f"cache_seqlens[{b}] = {int(lengths[b])} plus {new} new rows does not "
                         f"fit the cache's {capacity} rows a sequence")
    return lengths


def _pages(block_table, ends, page, n_pages):
    """The block table as host int64, checked: every page an entry's first ``ends[b]`` rows use
    names one of the cache's ``n_pages`` pages."""
    pages = (block_table.get() if array_kind(block_table) == "cupy"
             else np.asarray(block_table)).astype(np.int64)
    used = np.arange(pages.shape[1])[None, :] < -(-ends[:, None] // page)
    bad = used & ((pages < 0) | (pages >= n_pages))
    if bad.any():
        b, j = np.argwhere(bad)[0]
        raise ValueError(f"block_table[{b}] names page {int(pages[b, j])}, outside the "
                         f"cache's {n_pages} pages")
    return pages


def _flat_pages(k_cache, v_cache):
    """Every page's rows of each cache as one axis: views, so appends land in place."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.strides[0] != c.shape[1] * c.strides[1]:
            raise ValueError(f"{name}'s pages must be contiguous along their rows (stride "
                             f"of axis 0 = page_size x stride of axis 1) to be read in place")
    return tuple(c.reshape((-1,) + c.shape[2:]) for c in (k_cache, v_cache))


def _append(xp, k_cache, v_cache, flat, k, v, lengths, pages, page):
    """Write the new rows k[b], v[b] at rows lengths[b] ... of entry b's cache (its pages), in
    one scatter per array."""
    B, new = k.shape[:2]
    rows = lengths[:, None] + np.arange(new)[None, :]          # (B, new), checked to fit
    if page is None:
        at = (xp.asarray(np.repeat(np.arange(B), new).reshape(B, new)), xp.asarray(rows))
        k_cache[at] = k
        v_cache[at] = v
    else:
        at = xp.asarray(pages[np.arange(B)[:, None], rows // page] * page + rows % page)
        flat[0][at] = k
        flat[1][at] = v


def _one_launch_plan(xp, q, k_cache, v_cache, flat, ends, pages, page, block_table, causal,
                     return_lse, options, alibi_slopes):
    """(problem, plan) running the whole batch in one cuda.mma launch that reads the cache in
    place, or None where that kernel does not take the call (NumPy arrays, a page size that is
    not a power of two, anything cuda.mma refuses: then one call per entry runs). ALiBi: the
    kernel measures each entry's distances from its own causal offset (kv_lens[b] - Nq)."""
    from . import plan as _plan
    from .api import _with_mods
    from .inputs import normalize
    if xp is np or (page is not None and page & (page - 1)):
        return None
    B = q.shape[0]
    if flat is None:
        keys, values = k_cache, v_cache
    else:   # (B, pages x page_size, Hk, d) views of every page's rows, the batch axis stride 0
        keys, values = (xp.broadcast_to(c[None], (B,) + c.shape) for c in flat)
    mods = {n: options[n] for n in ("window_size", "softcap") if options.get(n) is not None}
    if alibi_slopes is not None:
        mods["alibi_slopes"] = alibi_slopes
    try:
        problem = _with_mods(normalize(
            q, keys, values, causal=bool(causal), softmax_scale=options.get("softmax_scale"),
            layout="bshd", return_lse=return_lse, precision=options.get("precision", "auto"),
            num_splits=options.get("num_splits")), mods)
        with xp.cuda.Device(q.device.id):   # where the kernel reads them
            problem.kvcache = KVCache(
                xp.asarray(ends.astype(np.int32)),
                None if page is None else _device_table(xp, block_table, pages), page,
                int(ends.max()) if ends.size else 0)
        plan = _plan.choose(problem, options.get("backend", "auto"),
                            options.get("algorithm", "auto"))
    except ValueError:
        return None
    return problem, plan


def _device_table(xp, block_table, pages):
    """The block table the kernel reads: the caller's own CuPy array when it is int32 and
    C-contiguous (no copy), else the checked host table copied over as int32."""
    if array_kind(block_table) == "cupy" and block_table.dtype == np.int32 \
            and block_table.flags.c_contiguous:
        return block_table
    return xp.asarray(pages.astype(np.int32))


# ---- replaying a repeated call (numflash.cuda.fastpath) ----

#: replay key (without the share count) -> _Recorded, for signatures whose arrays passed _check
_recorded = {}
_MAX_RECORDED = 1024


@dataclass
class _Recorded:
    """What a replayed call needs besides the launches: the checked arrays' facts and what the
    share count (split-KV, which grows with the longest entry's keys) is computed from."""
    key: tuple
    B: int
    page: object
    capacity: int
    cfg: object
    device: object
    num_splits: object

    def shares(self, ends):
        from .cuda.mma.config import share_count
        if not self.cfg.SPLIT:
            return 1
        B, Nq, H = self.key[0]   # q's (B, Nq, H)
        return share_count(B, H, Nq, int(ends.max()), self.num_splits, self.cfg, self.device)

    def replay(self, ends):
        from .cuda import fastpath
        return fastpath.lookup(self.key + (self.shares(ends),))


def _signature(a):
    """An optional array's part of the replay key: its type, shape, strides, dtype, device."""
    if a is None:
        return None
    device = a.data.device_id if array_kind(a) == "cupy" else None
    return type(a), a.shape, a.strides, np.dtype(a.dtype), device


def _replay_key(q, k_cache, v_cache, k, v, block_table, causal, return_lse, options):
    """The call's replay key (fastpath.signature of q and the caches, with everything else the
    checks and the plan read), or None where a call cannot be replayed."""
    from .cuda import fastpath
    if any(a is not None and array_kind(a) != "cupy" for a in (k, v)) or \
            (block_table is not None and array_kind(block_table) not in ("numpy", "cupy")):
        return None   # the full path's checks say what is wrong
    rest = ("kvcache", causal, type(causal), bool(return_lse),
            tuple(sorted((name, o, type(o)) for name, o in options.items())),
            _signature(k), _signature(v), _signature(block_table))
    key = fastpath.signature(q, k_cache, v_cache, rest)
    return None if key is None else (q.shape[:3],) + key


def _run_and_record(key, problem, plan, q, k_cache, v_cache, options, capacity):
    """Run the one-launch plan; record its launches for replay when the kernel read the
    caller's own arrays (a copy made by the checks could not be patched in)."""
    from .cuda import fastpath
    from .cuda.mma.config import split_count
    if key is None or plan.kernel != "cuda.mma":
        return plan.run(problem)
    with fastpath.recording() as launches:
        lse = plan.run(problem)
    if any(a.data.ptr != b.data.ptr for a, b in ((problem.q, q), (problem.k, k_cache),
                                                 (problem.v, v_cache))):
        return lse
    cache, cfg = problem.kvcache, plan.config
    n = split_count(problem, cfg, plan.device) if cfg.SPLIT else 1
    inputs = (cache.lens,) + (() if cache.block_table is None else (cache.block_table,))
    if fastpath.remember(key + (n,), launches, problem, lse, inputs) is not None:
        if len(_recorded) >= _MAX_RECORDED:
            _recorded.clear()
        _recorded[key] = _Recorded(key, q.shape[0], cache.page, capacity, cfg, plan.device,
                                   options.get("num_splits"))
    return lse


def _replayed(replay, known, q, k_cache, v_cache, k, v, lengths, ends, pages, block_table):
    """A recorded call again: the checked lengths (and table) to the GPU, the append, the
    launches with their new arrays."""
    import cupy
    inputs = (cupy.asarray(ends.astype(np.int32)),)
    flat = None
    if known.page is not None:
        inputs += (_device_table(cupy, block_table, pages),)
        flat = _flat_pages(k_cache, v_cache)
    if k is not None and k.shape[1]:   # rows to append
        _append(cupy, k_cache, v_cache, flat, k, v, lengths, pages, known.page)
    return replay(q, k_cache, v_cache, *inputs)
