"""attention_with_kvcache (numflash/kvcache.py): appends land in the cache rows (contiguous) or
page rows (paged) they belong to and nothing else changes; the output is the attention over each
sequence's cached rows (float64 reference by the accuracy rule, causal bottom-right); a paged
cache gives the contiguous cache's bits; bad lengths, pages and shapes raise naming the
argument before anything is written. CPU here, the simulator for backend="cuda", the GPU
marked."""
import numpy as np
import pytest

import numflash
from numflash.testing import check


def _cache(rng, B, S, Hk, d, dtype=np.float32):
    return tuple(rng.standard_normal((B, S, Hk, d)).astype(dtype) for _ in range(2))


def _paged(k_cache, v_cache, page, rng, spare=3):
    """The same rows laid out in pages of ``page`` rows in a shuffled order (with unused pages
    between them), and the block table that finds them."""
    B, S, Hk, d = k_cache.shape
    per = -(-S // page)
    n_pages = B * per + spare
    order = rng.permutation(n_pages)[:B * per].reshape(B, per)
    kp = np.full((n_pages, page, Hk, d), np.nan, k_cache.dtype)
    vp = np.full_like(kp, np.nan)
    for b in range(B):
        for p in range(per):
            rows = slice(p * page, min(S, (p + 1) * page))
            n = rows.stop - rows.start
            kp[order[b, p], :n] = k_cache[b, rows]
            vp[order[b, p], :n] = v_cache[b, rows]
    return kp, vp, order.astype(np.int32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Nq, new", [(1, 1), (4, 4), (3, 0)])
def test_append_then_attend_matches_the_reference(rng, causal, Nq, new):
    B, S, H, Hk, d = 3, 40, 4, 2, 16
    k_cache, v_cache = _cache(rng, B, S, Hk, d)
    before = (k_cache.copy(), v_cache.copy())
    lengths = np.array([0, 7, 40 - new], np.int32)
    q = rng.standard_normal((B, Nq, H, d)).astype(np.float32)
    k, v = (_cache(rng, B, new, Hk, d) if new else (None, None))
    out, lse = numflash.attention_with_kvcache(q, k_cache, v_cache, k, v, lengths,
                                               causal=causal, return_lse=True)
    assert out.shape == (B, Nq, H, d) and lse.shape == (B, H, Nq)
    for b in range(B):
        start, end = int(lengths[b]), int(lengths[b]) + new
        if new:   # the new rows landed at the sequence's length; nothing else moved
            np.testing.assert_array_equal(k_cache[b, start:end], k[b])
            np.testing.assert_array_equal(v_cache[b, start:end], v[b])
        for cache, old in zip((k_cache, v_cache), before):
            np.testing.assert_array_equal(cache[b, :start], old[b, :start])
            np.testing.assert_array_equal(cache[b, end:], old[b, end:])
        rep = check(out[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :end], v_cache[b:b + 1, :end],
                    lse=lse[b:b + 1], layout="bshd", causal="bottom_right" if causal else False)
        assert rep.ok, f"batch {b}: {rep}"
    assert (out[0] == 0).all() == (new == 0) and np.isneginf(lse[0]).all() == (new == 0)


@pytest.mark.parametrize("page", [16, 5])
def test_paged_cache_gives_the_contiguous_caches_bits(rng, page):
    B, S, H, Hk, d = 2, 48, 2, 1, 8
    k_cache, v_cache = _cache(rng, B, S, Hk, d)
    kp, vp, table = _paged(k_cache, v_cache, page, rng)
    lengths = np.array([9, 30], np.int64)
    q = rng.standard_normal((B, 2, H, d)).astype(np.float32)
    k, v = _cache(rng, B, 2, Hk, d)
    want = numflash.attention_with_kvcache(q, k_cache, v_cache, k, v, lengths, causal=True)
    got = numflash.attention_with_kvcache(q, kp, vp, k, v, lengths, table, causal=True)
    np.testing.assert_array_equal(got, want)
    for b in range(B):   # the appended rows are in their pages
        for r in range(int(lengths[b]), int(lengths[b]) + 2):
            np.testing.assert_array_equal(kp[table[b, r // page], r % page], k_cache[b, r])
            np.testing.assert_array_equal(vp[table[b, r // page], r % page], v_cache[b, r])


def test_cache_without_lengths_and_options_pass_through(rng):
    B, S, H, d = 2, 20, 2, 8
    k_cache, v_cache = _cache(rng, B, S, H, d)
    q = rng.standard_normal((B, 1, H, d)).astype(np.float32)
    out = numflash.attention_with_kvcache(q, k_cache, v_cache, softcap=5.0, window_size=(6, 0),
                                          causal=True)
    rep = check(out, q, k_cache, v_cache, layout="bshd", causal="bottom_right", softcap=5.0,
                window_size=(6, 0))
    assert rep.ok, str(rep)


@pytest.mark.parametrize("table", ["shared", "per-entry"])
@pytest.mark.parametrize("page", [None, 8])
def test_alibi_counts_distances_from_each_entrys_newest_rows(rng, table, page):
    """alibi_slopes, (H,) or (B, H) with row b for entry b: each entry against the float64
    reference of its own cached rows with its slopes, bottom-right aligned (flash-attn's
    distances), contiguous and paged; refused without causal, and with a row count that is not
    the batch's, before anything is written."""
    B, S, H, Hk, d = 3, 32, 4, 2, 16
    k_cache, v_cache = _cache(rng, B, S, Hk, d)
    slopes = rng.random((B, H)) if table == "per-entry" else rng.random(H)
    lengths = np.array([0, 9, 29], np.int32)
    q = rng.standard_normal((B, 3, H, d)).astype(np.float32)
    k, v = _cache(rng, B, 3, Hk, d)
    caches, extra = (k_cache, v_cache), ()
    if page is not None:
        kp, vp, pages = _paged(k_cache, v_cache, page, rng)
        caches, extra = (kp, vp), (pages,)
    out, lse = numflash.attention_with_kvcache(q, *caches, k, v, lengths, *extra, causal=True,
                                               alibi_slopes=slopes, return_lse=True)
    for b in range(B):
        end = int(lengths[b]) + 3
        if page is None:
            keys, values = (c[b:b + 1, :end] for c in (k_cache, v_cache))
        else:   # the rows in their pages (k_cache itself did not see this append)
            keys, values = (np.stack([c[pages[b, r // page], r % page] for r in range(end)])[None]
                            for c in caches)
        rep = check(out[b:b + 1], q[b:b + 1], keys, values, lse=lse[b:b + 1], layout="bshd",
                    causal="bottom_right", alibi_slopes=slopes[b] if slopes.ndim == 2 else slopes)
        assert rep.ok, f"entry {b}: {rep}"
    plain = numflash.attention_with_kvcache(q, *caches, None, None, lengths + 3, *extra,
                                            causal=True)
    assert not np.allclose(plain, out)
    before = [c.copy() for c in caches]
    with pytest.raises(ValueError, match="alibi_slopes with causal=True"):
        numflash.attention_with_kvcache(q, *caches, k, v, lengths, *extra, alibi_slopes=slopes)
    for bad in (np.ones((2, H)), np.ones(H + 1)):
        with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(H,\) = \(4,\) "
                                             r"for every batch entry, or \(B, H\) "
                                             r"= \(3, 4\)"):
            numflash.attention_with_kvcache(q, *caches, k, v, lengths, *extra, causal=True,
                                            alibi_slopes=bad)
    with pytest.raises(ValueError, match="alibi_slopes"):   # the entries' call checks the rest
        numflash.attention_with_kvcache(q, *caches, k, v, lengths, *extra, causal=True,
                                        alibi_slopes=np.ones(H, np.int32))
    for c, old in zip(caches, before):
        np.testing.assert_array_equal(c, old)


def test_empty_queries_still_append(rng):
    B, S, H, d = 2, 10, 1, 8
    k_cache, v_cache = _cache(rng, B, S, H, d)
    k, v = _cache(rng, B, 1, H, d)
    out, lse = numflash.attention_with_kvcache(np.zeros((B, 0, H, d), np.float32), k_cache,
                                               v_cache, k, v, 3, return_lse=True)
    assert out.shape == (B, 0, H, d) and lse.shape == (B, H, 0)
    np.testing.assert_array_equal(k_cache[:, 3], k[:, 0])


def test_simulator_runs_the_cuda_kernels(rng):
    B, S, H, d = 2, 33, 2, 16
    k_cache, v_cache = _cache(rng, B, S, H, d)
    q = rng.standard_normal((B, 1, H, d)).astype(np.float32)
    k, v = _cache(rng, B, 1, H, d)
    got = numflash.attention_with_kvcache(q, k_cache, v_cache, k, v, [5, 20], backend="cuda")
    for b, n in ((0, 6), (1, 21)):
        rep = check(got[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n],
                    layout="bshd")
        assert rep.ok, str(rep)


def test_bad_input_names_the_argument_and_writes_nothing(rng):
    B, S, H, d = 2, 16, 2, 8
    k_cache, v_cache = _cache(rng, B, S, H, d)
    q = rng.standard_normal((B, 1, H, d)).astype(np.float32)
    k, v = _cache(rng, B, 1, H, d)
    kept = k_cache.copy()
    call = numflash.attention_with_kvcache
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 16 plus 1 new rows"):
        call(q, k_cache, v_cache, k, v, [3, 16])
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = -1"):
        call(q, k_cache, v_cache, k, v, [-1, 2])
    with pytest.raises(ValueError, match="cache_seqlens must be an int or a \\(2,\\)"):
        call(q, k_cache, v_cache, k, v, [1, 2, 3])
    with pytest.raises(ValueError, match="k and v must be given together"):
        call(q, k_cache, v_cache, k, None, [1, 2])
    with pytest.raises(TypeError, match="k has dtype float64"):
        call(q, k_cache, v_cache, k.astype(np.float64), v, [1, 2])
    with pytest.raises(ValueError, match="k must have shape"):
        call(q, k_cache, v_cache, k[:, :, :1], v, [1, 2])
    with pytest.raises(TypeError, match="does not take attn_bias"):
        call(q, k_cache, v_cache, attn_bias=np.zeros((1, 1, 1, 1)))
    with pytest.raises(ValueError, match="cache_seqlens is needed"):   # None: the cache is full
        call(q, k_cache, v_cache, k, v)
    with pytest.raises(ValueError, match="window_size with causal=True"):
        call(q, k_cache, v_cache, k, v, [1, 2], window_size=(4, 0))
    with pytest.raises(ValueError, match="softcap"):          # options before any write
        call(q, k_cache, v_cache, k, v, [1, 2], softcap=-1.0)
    with pytest.raises(ValueError, match="num_splits"):
        call(q, k_cache, v_cache, k, v, [1, 2], num_splits=0)
    kp, vp, table = _paged(k_cache, v_cache, 4, rng)
    bad = table.copy()
    bad[1, 0] = kp.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[1\] names page"):
        call(q, kp, vp, k, v, [3, 5], bad)
    with pytest.raises(ValueError, match="cache_seqlens is needed"):
        call(q, kp, vp, k, v, None, table)
    with pytest.raises(ValueError, match="block_table must be"):
        call(q, kp, vp, k, v, [3, 5], table[:1])
    np.testing.assert_array_equal(k_cache, kept)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 256])
def test_gpu_paged_decode_matches_contiguous(rng, monkeypatch, page):
    """One cuda.mma launch for the batch (no per-entry attention call), paged and contiguous
    alike, against the reference; with the same shares the paged result has the contiguous
    one's bits."""
    cupy = pytest.importorskip("cupy")
    from numflash import api
    per_entry = []
    original = api.attention
    monkeypatch.setattr(api, "attention", lambda *a, **kw: per_entry.append(1) or
                        original(*a, **kw))
    B, S, H, Hk, d = 3, 2048, 8, 2, 128
    k_cache, v_cache = _cache(rng, B, S, Hk, d, np.float16)
    kp, vp, table = _paged(k_cache, v_cache, page, rng)
    lengths = np.array([0, 700, 2047], np.int32)
    q = rng.standard_normal((B, 1, H, d)).astype(np.float16)
    k, v = _cache(rng, B, 1, Hk, d, np.float16)
    dev = [cupy.asarray(a) for a in (q, k_cache, v_cache, k, v, kp, vp, table, lengths)]
    q_, kc, vc, k_, v_, kp_, vp_, table_, len_ = dev
    # the same shares (a split count is chosen from the cache's capacity, which differs)
    want = numflash.attention_with_kvcache(q_, kc, vc, k_, v_, len_, causal=True, num_splits=4)
    got = numflash.attention_with_kvcache(q_, kp_, vp_, k_, v_, len_, table_, causal=True,
                                          num_splits=4)
    cupy.testing.assert_array_equal(got, want)
    assert per_entry == []
    auto = numflash.attention_with_kvcache(q_, kp_, vp_, None, None, len_ + 1, table_,
                                           causal=True)
    for b in range(B):
        n = int(lengths[b]) + 1
        rep = check(auto[b:b + 1], q_[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n],
                    layout="bshd")
        assert rep.ok, str(rep)
    for b in range(B):
        n = int(lengths[b]) + 1
        rep = check(want[b:b + 1], q_[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], layout="bshd")
        assert rep.ok, str(rep)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 16])
def test_gpu_alibi_runs_in_one_launch_and_is_never_replayed(rng, monkeypatch, page):
    """CuPy caches (contiguous and paged) with alibi_slopes: one cuda.mma launch for the batch
    (no per-entry attention call), each entry's distances from its own newest row; a call with
    other slopes is planned again (never the launch recorded for the same call without them,
    nor one with the first slopes); each entry meets the rule."""
    cupy = pytest.importorskip("cupy")
    from numflash import api, kvcache
    from numflash.cuda import fastpath
    monkeypatch.setattr(kvcache, "_recorded", {})
    monkeypatch.setattr(fastpath, "_replays", {})
    calls = []
    original = api.attention
    monkeypatch.setattr(api, "attention", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    B, S, H, Hk, d = 3, 512, 8, 2, 64
    k_cache, v_cache = _cache(rng, B, S, Hk, d, np.float16)
    q = rng.standard_normal((B, 1, H, d)).astype(np.float16)
    lengths = np.array([1, 300, 512], np.int32)
    extra = ()
    if page:
        kp, vp, table = _paged(k_cache, v_cache, page, rng)
        caches = (cupy.asarray(kp), cupy.asarray(vp))
        extra = (cupy.asarray(table),)
    else:
        caches = (cupy.asarray(k_cache), cupy.asarray(v_cache))
    q_ = cupy.asarray(q)
    for _ in range(2):   # the second plain call is a replay
        plain = numflash.attention_with_kvcache(q_, *caches, None, None, lengths, *extra,
                                                causal=True)
    for slopes in (rng.random((B, H)).astype(np.float32), rng.random(H).astype(np.float32)):
        got = numflash.attention_with_kvcache(q_, *caches, None, None, lengths, *extra,
                                              causal=True, alibi_slopes=cupy.asarray(slopes))
        assert not cupy.allclose(plain, got)
        for b in range(B):
            n = int(lengths[b])
            rep = check(got[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n],
                        layout="bshd", causal="bottom_right",
                        alibi_slopes=slopes[b] if slopes.ndim == 2 else slopes)
            assert rep.ok, f"entry {b}: {rep}"
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("metadata", ["cupy", "numpy"])
def test_gpu_decode_loop_replays_with_each_calls_lengths(rng, monkeypatch, page, metadata):
    """A decode loop: the same call signature with lengths that grow by one a step. Only the
    first call and the one where the longest entry's keys first take two shares plan (the
    others replay the recorded launch, numflash.cuda.fastpath, with that call's lengths and
    table); every step's rows land in the cache and its output meets the accuracy rule against
    the reference of the rows cached so far. Bad lengths or pages still raise after the
    recording, writing nothing."""
    cupy = pytest.importorskip("cupy")
    from numflash import kvcache
    from numflash.cuda import fastpath
    planned = []
    original = kvcache._one_launch_plan
    monkeypatch.setattr(kvcache, "_one_launch_plan", lambda *a: planned.append(1) or
                        original(*a))
    monkeypatch.setattr(kvcache, "_recorded", {})   # nothing recorded by an earlier test
    monkeypatch.setattr(fastpath, "_replays", {})
    B, S, H, Hk, d = 2, 1024, 8, 2, 128
    k_cache, v_cache = _cache(rng, B, S, Hk, d, np.float16)
    kc, vc = cupy.asarray(k_cache), cupy.asarray(v_cache)   # the reference's contiguous rows
    if page is None:
        caches, table = (kc, vc), None
    else:
        kp, vp, table = _paged(k_cache, v_cache, page, rng)
        caches = (cupy.asarray(kp), cupy.asarray(vp))
    as_kind = cupy.asarray if metadata == "cupy" else np.asarray
    table_ = None if table is None else as_kind(table)
    lengths = np.array([5, 440], np.int32)   # 441 .. 456 keys: 7 tiles of 64, then 8 (2 shares)
    shares = []
    for step in range(16):
        q = cupy.asarray(rng.standard_normal((B, 1, H, d)).astype(np.float16))
        k, v = (cupy.asarray(a) for a in _cache(rng, B, 1, Hk, d, np.float16))
        out = numflash.attention_with_kvcache(q, *caches, k, v, as_kind(lengths), table_,
                                              causal=True)
        known = kvcache._recorded.get(kvcache._replay_key(q, *caches, k, v, table_, True,
                                                          False, {}))
        assert known is not None, "the call was not recorded for replay"
        shares.append(known.shares(lengths + 1))
        for b in range(B):
            n = int(lengths[b]) + 1
            if page is None:
                cupy.testing.assert_array_equal(kc[b, n - 1], k[b, 0])
            else:   # the row landed in its page; the reference gets its copy
                row = int(table[b, (n - 1) // page]) * page + (n - 1) % page
                cupy.testing.assert_array_equal(caches[0].reshape((-1, Hk, d))[row], k[b, 0])
                cupy.testing.assert_array_equal(caches[1].reshape((-1, Hk, d))[row], v[b, 0])
                kc[b, n - 1], vc[b, n - 1] = k[b, 0], v[b, 0]
            rep = check(out[b:b + 1], q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n],
                        layout="bshd")
            assert rep.ok, (step, b, str(rep))
        lengths = lengths + 1
    assert shares[0] == 1 and shares[-1] == 2 and sorted(shares) == shares, shares
    assert len(planned) == 2, planned   # the first call, and the first with two shares
    before = [c.copy() for c in caches]
    with pytest.raises(ValueError, match="cache_seqlens"):
        numflash.attention_with_kvcache(q, *caches, k, v, as_kind(np.array([5, S], np.int32)),
                                        table_, causal=True)
    if table is not None:
        bad = table.copy()
        bad[1, 0] = -1
        with pytest.raises(ValueError, match="block_table"):
            numflash.attention_with_kvcache(q, *caches, k, v, as_kind(lengths), as_kind(bad),
                                            causal=True)
    for c, b in zip(caches, before):
        cupy.testing.assert_array_equal(c, b)


def _emulated_cache(rng, DT, page):
    """q (B, H, Nq, d), the caches, the keys and values the emulated KVLEN / PAGE kernel reads
    (a paged cache's pages shuffled, every page's rows with the batch axis broadcast), its
    kvcache argument and the entries' key counts."""
    dtype = np.float16 if DT == "f16" else np.float64
    B, S, H, Hk, Nq, d = 2, 80, 2, 1, 3, 32
    k_cache, v_cache = _cache(rng, B, S, Hk, d, dtype)
    q = rng.standard_normal((B, H, Nq, d)).astype(dtype)
    ends = np.array([5, 70], np.int32)
    if page:
        kp, vp, table = _paged(k_cache, v_cache, page, rng)
        keys, values = (np.broadcast_to(c.reshape(-1, Hk, d)[None], (B, c.shape[0] * page, Hk, d))
                        .transpose(0, 2, 1, 3) for c in (kp, vp))
        cache = (ends, table, page)
    else:
        keys, values = (c.transpose(0, 2, 1, 3) for c in (k_cache, v_cache))
        cache = (ends, None, 0)
    return q, k_cache, v_cache, keys, values, cache, ends


@pytest.mark.parametrize("DT, page, tile", [("f16", 16, (2, 32, 1)), ("f64", 32, (2, 16, 0)),
                                           ("f16", 0, (2, 32, 1))])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_source_emulated_on_cpu(rng, DT, page, tile, causal):
    """cuda.mma's KVLEN / PAGE variant under the warp emulator: each entry's key count from
    kv_lens, causal aligned bottom-right per entry, a paged cache's rows through the block table
    (pages shuffled, a tile spanning pages or a page spanning tiles; page 0: contiguous)."""
    from mma_tools import run_forward_kernel
    q, k_cache, v_cache, keys, values, cache, ends = _emulated_cache(rng, DT, page)
    out, lse = run_forward_kernel(q, keys, values, DT, causal, 0, VEC=1, tile=tile,
                                  kvcache=cache)
    for b in range(len(ends)):
        n = int(ends[b])
        kb, vb = (c[b:b + 1, :n].transpose(0, 2, 1, 3) for c in (k_cache, v_cache))
        rep = check(out[b:b + 1], q[b:b + 1], kb, vb, lse=lse[b:b + 1],
                    causal="bottom_right" if causal else False)
        assert rep.ok, f"entry {b}: {rep}"


@pytest.mark.parametrize("DT, page", [("f64", 16), ("f16", 0)])
def test_kvcache_alibi_emulated_in_one_launch(rng, DT, page):
    """The one launch with ALiBi ((B, H) slopes, causal): the kernel measures each entry's
    distances from its own newest row (its causal offset kv_lens[b] - Nq), so each entry
    meets the rule against the float64 reference with its row of slopes, though the slopes
    were built for the launch's shape (the cache's capacity as Nk, offset 0)."""
    from mma_tools import run_forward_kernel
    from numflash import mods
    q, k_cache, v_cache, keys, values, cache, ends = _emulated_cache(rng, DT, page)
    slopes = rng.random(q.shape[:2])
    launch_mods = mods.build(q.shape[:3] + (keys.shape[2],), "numpy", 0, alibi_slopes=slopes)
    out, lse = run_forward_kernel(q, keys, values, DT, True, 0, VEC=1, tile=(2, 16, 0),
                                  kvcache=cache, mods=launch_mods)
    for b in range(len(ends)):
        n = int(ends[b])
        kb, vb = (c[b:b + 1, :n].transpose(0, 2, 1, 3) for c in (k_cache, v_cache))
        rep = check(out[b:b + 1], q[b:b + 1], kb, vb, lse=lse[b:b + 1], causal="bottom_right",
                    alibi_slopes=slopes[b])
        assert rep.ok, f"entry {b}: {rep}"


def test_torch_flash_attn_with_kvcache(rng):
    """numflash.torch.flash_attn_with_kvcache: flash-attn's signature on torch tensors, appending
    into the tensors' memory, the same result as the array function; refusals name the
    argument."""
    torch = pytest.importorskip("torch")
    from numflash.torch import flash_attn_with_kvcache
    B, S, H, Hk, d = 2, 24, 4, 2, 16
    k_np, v_np = _cache(rng, B, S, Hk, d)
    q_np = rng.standard_normal((B, 1, H, d)).astype(np.float32)
    new_k, new_v = _cache(rng, B, 1, Hk, d)
    want, want_lse = numflash.attention_with_kvcache(q_np, k_np.copy(), v_np.copy(), new_k, new_v,
                                                     [4, 11], causal=True, softcap=3.0,
                                                     return_lse=True)
    kc, vc = torch.from_numpy(k_np.copy()), torch.from_numpy(v_np.copy())
    out, lse = flash_attn_with_kvcache(torch.from_numpy(q_np), kc, vc, torch.from_numpy(new_k),
                                       torch.from_numpy(new_v),
                                       cache_seqlens=torch.tensor([4, 11], dtype=torch.int32),
                                       causal=True, softcap=3.0, return_softmax_lse=True)
    assert isinstance(out, torch.Tensor) and out.shape == (B, 1, H, d)
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    assert torch.equal(kc[1, 11], torch.from_numpy(new_k[1, 0]))   # appended in place
    slopes = rng.random((B, H))
    want = numflash.attention_with_kvcache(q_np, kc.numpy(), vc.numpy(), None, None, [5, 12],
                                           causal=True, alibi_slopes=slopes)
    got = flash_attn_with_kvcache(torch.from_numpy(q_np), kc, vc, cache_seqlens=[5, 12],
                                  causal=True, alibi_slopes=torch.from_numpy(slopes))
    np.testing.assert_array_equal(got.numpy(), want)
    with pytest.raises(NotImplementedError, match="rotary_cos"):
        flash_attn_with_kvcache(torch.from_numpy(q_np), kc, vc, rotary_cos=torch.zeros(1))


@pytest.mark.gpu
def test_gpu_torch_flash_attn_with_kvcache_pages(rng):
    """The torch entry on CUDA tensors, a paged cache on torch's stream: one cuda.mma launch,
    against the reference of each entry's rows."""
    torch = pytest.importorskip("torch")
    from numflash.torch import flash_attn_with_kvcache
    B, S, H, Hk, d, page = 2, 512, 4, 2, 64, 16
    k_np, v_np = _cache(rng, B, S, Hk, d, np.float16)
    kp, vp, table = _paged(k_np, v_np, page, rng)
    q = torch.from_numpy(rng.standard_normal((B, 1, H, d)).astype(np.float16)).cuda()
    kpt, vpt = torch.from_numpy(kp).cuda(), torch.from_numpy(vp).cuda()
    lens = torch.tensor([100, 511], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, kpt, vpt, cache_seqlens=lens,
                                  block_table=torch.from_numpy(table).cuda(), causal=True)
    torch.cuda.synchronize()
    for b, n in ((0, 100), (1, 511)):
        rep = check(out[b:b + 1].cpu().numpy(), q[b:b + 1].cpu().numpy(), k_np[b:b + 1, :n],
                    v_np[b:b + 1, :n], layout="bshd", causal="bottom_right")
        assert rep.ok, str(rep)
