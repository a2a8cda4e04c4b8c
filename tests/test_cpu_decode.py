"""The CPU path's key-major decode loop (numflash.cpu.tiled.keymajor_forward).

Few query rows over K/V laid out as a KV cache, (B, N, Hk, d) C-contiguous (layout "bshd"): a
task reads a run of keys for every head at once, in memory order, instead of one head's rows
out of every key. Each case runs it (explain's config says so) against the float64 reference by
the accuracy rule, lse included, and against the head-major loop on a contiguous copy; the
choice between the loops, the runs (forced splits, more runs than blocks, rows that see no
key) and non-finite values are covered too."""
import numpy as np
import pytest

import numflash
from numflash import reference, testing
from numflash.block_mask import create_block_mask
from numflash.mods import document_mask


def _cache_layout(*arrays):
    """(B, H, N, d) arrays as C-contiguous (B, N, H, d) ones (a KV cache's layout)."""
    return tuple(np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in arrays)


def _relative_bias(score, b, h, i, j, table):
    return score + table[h, i - j + table.shape[1] // 2]


def _document_block_mask(Nq, Nk):
    """Keys in 3 documents; query row 0 in the middle one, the others in the last: the first
    document's key blocks are empty for every row (skipped) and the rest partial."""
    ids = np.repeat(np.arange(3), -(-Nk // 3))[:Nk].astype(np.int32)[None]
    mask_mod, args = document_mask(np.array([[1] + [2] * (Nq - 1)], np.int32), ids)
    return create_block_mask(mask_mod, None, None, Nq, Nk, args, block_size=(16, 128))


CASES = [  # (id, dtype, B, H, Hk, Nq, Nk, d, options(rng, B, H, Nq, Nk))
    ("f32-one-row", np.float32, 1, 4, 4, 1, 1300, 64, lambda r, B, H, Nq, Nk: {}),
    ("f64-gqa-two-entries-odd-d", np.float64, 2, 4, 2, 3, 700, 59,
     lambda r, B, H, Nq, Nk: dict(causal="bottom_right")),
    ("f16-gqa-top-left", np.float16, 1, 8, 2, 2, 600, 16,
     lambda r, B, H, Nq, Nk: dict(causal=True)),
    ("f32-rows-seeing-no-key-d1", np.float32, 1, 2, 2, 5, 3, 1,
     lambda r, B, H, Nq, Nk: dict(causal="bottom_right")),
    ("f32-sixteen-rows-two-keys", np.float32, 1, 2, 2, 16, 2, 8, lambda r, B, H, Nq, Nk: {}),
    ("f32-window-softcap-alibi", np.float32, 1, 4, 2, 2, 1100, 32,
     lambda r, B, H, Nq, Nk: dict(causal="bottom_right", window_size=(300, 0), softcap=3.0,
                                  alibi_slopes=r.uniform(0.01, 0.1, H))),
    ("f64-bias-and-key-padding", np.float64, 2, 2, 2, 4, 900, 16,
     lambda r, B, H, Nq, Nk: dict(attn_bias=r.standard_normal((B, 1, 1, Nk)),
                                  attn_mask=np.arange(Nk) < np.array([Nk, 600])[:, None, None,
                                                                                None])),
    ("f32-user-mods-block-mask", np.float32, 1, 2, 2, 3, 1200, 16,
     lambda r, B, H, Nq, Nk: dict(
         score_mod=_relative_bias, block_mask=_document_block_mask(Nq, Nk),
         mod_args=(r.standard_normal((H, 2 * Nk)),))),
    ("f32-dropout", np.float32, 1, 2, 2, 1, 1500, 16,
     lambda r, B, H, Nq, Nk: dict(dropout_p=0.3, dropout_seed=5)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_key_major_meets_the_rule_and_equals_the_head_major_loop(rng, case):
    _, dtype, B, H, Hk, Nq, Nk, d, options = case
    q = rng.standard_normal((B, H, Nq, d)).astype(dtype)
    k, v = (rng.standard_normal((B, Hk, Nk, d)).astype(dtype) for _ in range(2))
    opts = options(rng, B, H, Nq, Nk)
    qc, kc, vc = _cache_layout(q, k, v)
    plan = numflash.explain(qc, kc, vc, layout="bshd", **opts)
    assert plan.config["order"] == "key-major", str(plan)
    out, lse = numflash.attention(qc, kc, vc, layout="bshd", return_lse=True, **opts)
    rep = testing.check(out, qc, kc, vc, lse=lse, layout="bshd", **opts)
    assert rep.ok, str(rep)
    assert numflash.explain(q, k, v, **opts).config["order"] == "head-major"
    ref, ref_lse = numflash.attention(q, k, v, return_lse=True, **opts)
    tol = 1e-12 if dtype == np.float64 else (2e-3 if dtype == np.float16 else 2e-6)
    np.testing.assert_allclose(out.transpose(0, 2, 1, 3).astype(np.float64),
                               ref.astype(np.float64), atol=tol)
    np.testing.assert_allclose(lse, ref_lse, atol=tol)


@pytest.mark.parametrize("splits", [1, 3, 16])   # 16: more runs than the 5 key blocks
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_key_major_runs_merge_to_one_run(rng, splits, causal):
    q, k, v = (rng.standard_normal((2, N, 4, 24)) for N in (2, 1100, 1100))
    plan = numflash.explain(q, k, v, layout="bshd", causal=causal, num_splits=splits)
    # float64: 256-key blocks, 5 of them
    assert plan.config["order"] == "key-major" and plan.config["splits"] == min(splits, 5)
    out, lse = numflash.attention(q, k, v, layout="bshd", causal=causal, num_splits=splits,
                                  return_lse=True)
    assert testing.check(out, q, k, v, lse=lse, layout="bshd", causal=causal).ok
    one = numflash.attention(q, k, v, layout="bshd", causal=causal, num_splits=1)
    np.testing.assert_allclose(out, one, atol=1e-12)


def test_the_loop_order_follows_the_layout_and_the_rows(rng):
    def order(Nq, H, Hk, k_form):
        q = np.zeros((1, Nq, H, 16), np.float32)
        k = k_form(np.zeros((1, 64, Hk, 16), np.float32))
        return numflash.explain(q, k, k, layout="bshd").config["order"]

    cache = lambda a: a   # noqa: E731
    assert order(1, 8, 8, cache) == "key-major"
    assert order(16, 8, 2, cache) == "key-major"           # GQA: 64 query rows per K/V head
    assert order(17, 2, 2, cache) == "head-major"          # matrix products pay
    assert order(1, 8, 1, cache) == "head-major"           # one K/V head: bhsd is contiguous
    assert order(1, 8, 8, lambda a: a[:, ::2]) == "head-major"   # rows not packed
    # a B > 1 cache read up to a length leaves gaps between entries: head-major
    big = np.zeros((2, 100, 4, 16), np.float32)
    q = np.zeros((2, 1, 4, 16), np.float32)
    assert numflash.explain(q, big[:, :64], big[:, :64],
                            layout="bshd").config["order"] == "head-major"
    assert numflash.explain(q[:1], big[:1, :64], big[:1, :64],
                            layout="bshd").config["order"] == "key-major"
    assert "order=key-major" in str(numflash.explain(q[:1], big[:1, :64], big[:1, :64],
                                                     layout="bshd"))


def test_kv_cache_decode_takes_the_key_major_loop(rng):
    """attention_with_kvcache on the CPU reads each entry's cache in place, key-major."""
    B, H, Hk, d, cap = 2, 4, 2, 16, 900
    k_cache, v_cache = (rng.standard_normal((B, cap, Hk, d)).astype(np.float32)
                        for _ in range(2))
    q = rng.standard_normal((B, 1, H, d)).astype(np.float32)
    lengths = np.array([700, 300], np.int32)
    out = numflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    for b, n in enumerate(lengths):
        keys, values = k_cache[b:b + 1, :n], v_cache[b:b + 1, :n]
        assert numflash.explain(q[b:b + 1], keys, values,
                                layout="bshd").config["order"] == "key-major"
        assert testing.check(out[b:b + 1], q[b:b + 1], keys, values, layout="bshd").ok


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_bad_value_in_a_kv_cache_reaches_exactly_its_readers(rng, dtype, value):
    """A non-finite v at a key that the first rows do not see (bottom-right causal): only the
    rows that see it get it, never through a zero weight; a NaN key poisons its readers."""
    q = rng.standard_normal((1, 2, 4, 8)).astype(dtype)
    k, v = (rng.standard_normal((1, 2, 40, 8)).astype(dtype) for _ in range(2))
    v[0, 1, 38, 2] = value   # rows 2, 3 of head 1 see key 38
    k[0, 0, 39, 5] = np.nan   # row 3 of head 0 sees key 39
    qc, kc, vc = _cache_layout(q, k, v)
    assert numflash.explain(qc, kc, vc, layout="bshd",
                            causal="bottom_right").config["order"] == "key-major"
    out = numflash.attention(qc, kc, vc, layout="bshd", causal="bottom_right")
    got = out.transpose(0, 2, 1, 3).astype(np.float64)
    ref = reference.attention(q, k, v, causal="bottom_right")
    assert np.array_equal(np.isfinite(got), np.isfinite(ref))
    assert not np.isfinite(ref[0, 1, 2:, 2]).any() and np.isnan(ref[0, 0, 3]).all()
    seen = np.isfinite(ref)
    assert np.abs(got[seen] - ref[seen]).max() < (2e-3 if dtype == np.float16 else 1e-5)
