"""attention_varlen / attention_varlen_backward against per-sequence reference calls (lengths 0,
1, odd and long; GQA; causal both ways; CPU and the CUDA kernels in the simulator), merge_partials
against one call over all keys, and the checks on cu_seqlens."""
import numpy as np
import pytest

import numflash
from numflash import reference, testing


def packed(rng, lens_q, lens_k, H=4, Hk=2, d=24, dv=16, dtype=np.float64):
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cq[-1], H, d)).astype(dtype)
    k = rng.standard_normal((ck[-1], Hk, d)).astype(dtype)
    v = rng.standard_normal((ck[-1], Hk, dv)).astype(dtype)
    do = rng.standard_normal((cq[-1], H, dv)).astype(dtype)
    return q, k, v, do, cq, ck


LENGTHS = [([5, 0, 1, 97, 33], [7, 4, 1, 97, 60]),   # empty, single, odd, Nq != Nk both ways
           ([300], [300]), ([1, 1, 1], [0, 3, 1])]


@pytest.mark.parametrize("lengths", LENGTHS, ids=["mixed", "one-long", "tiny"])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cpu_matches_each_sequence_alone(rng, lengths, causal, dtype):
    q, k, v, do, cq, ck = packed(rng, *lengths, dtype=dtype)
    out, lse = numflash.attention_varlen(q, k, v, cq, ck, max(lengths[0]), max(lengths[1]),
                                         causal=causal, return_lse=True)
    assert out.shape == (q.shape[0], 4, 16) and lse.shape == (4, q.shape[0])
    grads = numflash.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, causal=causal)
    for b in range(len(cq) - 1):
        s, e, sk, ek = cq[b], cq[b + 1], ck[b], ck[b + 1]
        seq = [a[None, lo:hi] for a, lo, hi in ((q, s, e), (k, sk, ek), (v, sk, ek))]
        if e > s:
            testing.assert_accurate(out[None, s:e], *seq, lse=lse[None, :, s:e], causal=causal,
                                    layout="bshd")
            testing.assert_gradients_accurate([grads[0][None, s:e], grads[1][None, sk:ek],
                                               grads[2][None, sk:ek]], do[None, s:e], *seq,
                                              causal=causal, layout="bshd")
        else:  # keys of a sequence without queries get no gradient
            assert not grads[1][sk:ek].any() and not grads[2][sk:ek].any()


@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_dropout_draws_each_sequence_its_own_mask_forward_and_backward(rng, causal):
    """Sequence b runs as a batch of one under packed_seed(seed, b): against the float64
    reference with that mask, forward and gradients; two equal sequences get different masks."""
    from numflash.dropout import packed_seed
    q, k, v, do, cq, ck = packed(rng, [20, 0, 33, 20], [25, 3, 33, 25], dtype=np.float64)
    q[53:73], k[61:86], v[61:86] = q[:20], k[:25], v[:25]   # sequence 3 repeats sequence 0
    opts = dict(causal=causal, dropout_p=0.25, dropout_seed=2 ** 40 + 5)
    out, lse = numflash.attention_varlen(q, k, v, cq, ck, return_lse=True, **opts)
    grads = numflash.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, **opts)
    for b in (0, 2, 3):
        s, e, sk, ek = cq[b], cq[b + 1], ck[b], ck[b + 1]
        seq = [a[None, lo:hi] for a, lo, hi in ((q, s, e), (k, sk, ek), (v, sk, ek))]
        mine = dict(causal=causal, dropout_p=0.25,
                    dropout_seed=packed_seed(opts["dropout_seed"], b))
        testing.assert_accurate(out[None, s:e], *seq, lse=lse[None, :, s:e], layout="bshd",
                                **mine)
        testing.assert_gradients_accurate([grads[0][None, s:e], grads[1][None, sk:ek],
                                           grads[2][None, sk:ek]], do[None, s:e], *seq,
                                          layout="bshd", **mine)
    assert not np.array_equal(out[:20], out[53:73])      # dropped differently
    plain = numflash.attention_varlen(q, k, v, cq, ck, causal=causal)
    assert np.array_equal(plain[:20], plain[53:73])     # the same sequence without dropout
    # dropout leaves lse alone; the plain call runs another compiled kernel (numba's parallel
    # one, fastmath reassociation allowed), which CI once saw differ in the last bit
    np.testing.assert_allclose(lse, numflash.attention_varlen(q, k, v, cq, ck, causal=causal,
                                                              return_lse=True)[1],
                               rtol=4 * np.finfo(np.float64).eps, atol=0)
    assert len({packed_seed(7, b) for b in range(1000)}) == 1000


def test_dropout_on_packed_sequences_is_explained_and_checked(rng):
    q, k, v, do, cq, ck = packed(rng, [5, 6], [5, 6])
    plan = numflash.explain_varlen(q, k, v, cq, ck, dropout_p=0.1)
    assert "one call per sequence" in str(plan) and "dropout" in str(plan)
    with pytest.raises(ValueError, match="dropout_p > 0 needs dropout_seed"):
        numflash.attention_varlen(q, k, v, cq, ck, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        numflash.attention_varlen(q, k, v, cq, ck, dropout_p=1.5, dropout_seed=1)
    out, lse = numflash.attention_varlen(q, k, v, cq, ck, return_lse=True)
    with pytest.raises(ValueError, match="dropout_p > 0 needs dropout_seed"):
        numflash.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, dropout_p=0.1)


def _check_each_sequence(out, lse, grads, q, k, v, do, cq, ck, causal, mods):
    """Each sequence of a packed result against the float64 reference of that sequence alone,
    forward and gradients, with its own modifications (row b of a 2-D alibi_slopes)."""
    for b in range(len(cq) - 1):
        s, e, sk, ek = cq[b], cq[b + 1], ck[b], ck[b + 1]
        mine = dict(mods)
        if getattr(mine.get("alibi_slopes"), "ndim", 0) == 2:
            mine["alibi_slopes"] = mine["alibi_slopes"][b]
        seq = [a[None, lo:hi] for a, lo, hi in ((q, s, e), (k, sk, ek), (v, sk, ek))]
        if e > s:
            testing.assert_accurate(out[None, s:e], *seq, lse=lse[None, :, s:e], causal=causal,
                                    layout="bshd", **mine)
            testing.assert_gradients_accurate([grads[0][None, s:e], grads[1][None, sk:ek],
                                               grads[2][None, sk:ek]], do[None, s:e], *seq,
                                              causal=causal, layout="bshd", **mine)
        else:  # keys of a sequence without queries get no gradient
            assert not grads[1][sk:ek].any() and not grads[2][sk:ek].any()


@pytest.mark.parametrize("mods", [
    dict(window_size=(3, 1)), dict(softcap=2.5), dict(alibi_slopes="per-sequence"),
    dict(window_size=(5, 0), softcap=3.0, alibi_slopes="shared")],
    ids=["window", "softcap", "alibi-per-sequence", "all-shared-alibi"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_modifications_apply_within_each_sequence(rng, mods, causal, dtype):
    """window_size, softcap and alibi_slopes ((H,), or (B, H): row b for sequence b) as each
    sequence's own call applies them, forward and backward; one call per sequence, explained."""
    q, k, v, do, cq, ck = packed(rng, [5, 0, 1, 37, 20], [7, 4, 1, 37, 29], dtype=dtype)
    slopes = {"per-sequence": rng.random((5, 4)), "shared": rng.random(4)}
    mods = {n: slopes[m] if n == "alibi_slopes" else m for n, m in mods.items()}
    out, lse = numflash.attention_varlen(q, k, v, cq, ck, causal=causal, return_lse=True, **mods)
    grads = numflash.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, causal=causal,
                                               **mods)
    _check_each_sequence(out, lse, grads, q, k, v, do, cq, ck, causal, mods)
    plan = str(numflash.explain_varlen(q, k, v, cq, ck, causal=causal, **mods))
    assert "one call per sequence" in plan
    for name in mods:
        assert name in plan
    plain = numflash.attention_varlen(q, k, v, cq, ck, causal=causal)
    assert not np.allclose(plain, out)   # the modifications changed something


def _as_sequence(fn, b):
    """A reference's view of a user's function for packed sequence b alone (batch 0): the
    function as attention_varlen shows it sequence b."""
    if fn is _sequence_mask:
        return lambda _, h, i, j, table: fn(b, h, i, j, table)
    return lambda x, _, h, i, j, table: fn(x, b, h, i, j, table)


@pytest.mark.parametrize("extra", [{}, dict(window_size=(6, 1), softcap=3.0),
                                   dict(alibi_slopes="per-sequence")],
                         ids=["user", "with-window-softcap", "with-alibi"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_user_mods_see_the_sequence_index_and_positions_within_it(rng, extra, causal):
    """A user's score_mod and mask_mod on packed sequences (NumPy: one call per sequence) see b
    = the sequence's index and q_idx / kv_idx within the sequence, forward and backward, alone
    and with the built-ins, against each sequence's float64 reference."""
    q, k, v, do, cq, ck = packed(rng, [5, 0, 1, 37, 20], [7, 4, 1, 37, 29])
    table = rng.standard_normal((5, 4))
    mods = dict(score_mod=_sequence_bias, score_mod_grad=_unit_grad, mask_mod=_sequence_mask,
                mod_args=(table,), **extra)
    if extra.get("alibi_slopes"):
        mods["alibi_slopes"] = rng.random((5, 4))
    out, lse = numflash.attention_varlen(q, k, v, cq, ck, causal=causal, return_lse=True, **mods)
    grads = numflash.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, causal=causal,
                                               **mods)
    for b in range(5):
        s, e, sk, ek = cq[b], cq[b + 1], ck[b], ck[b + 1]
        mine = dict(mods, score_mod=_as_sequence(_sequence_bias, b),
                    mask_mod=_as_sequence(_sequence_mask, b))
        if "alibi_slopes" in mine:
            mine["alibi_slopes"] = mine["alibi_slopes"][b]
        seq = [a[None, lo:hi] for a, lo, hi in ((q, s, e), (k, sk, ek), (v, sk, ek))]
        if e == s:
            assert not grads[1][sk:ek].any() and not grads[2][sk:ek].any()
            continue
        testing.assert_accurate(out[None, s:e], *seq, lse=lse[None, :, s:e], causal=causal,
                                layout="bshd", **mine)
        testing.assert_gradients_accurate([grads[0][None, s:e], grads[1][None, sk:ek],
                                           grads[2][None, sk:ek]], do[None, s:e], *seq,
                                          causal=causal, layout="bshd", **mine)
    # the functions saw b: with every sequence reading row 0 of the table the result differs
    same = numflash.attention_varlen(q, k, v, cq, ck, causal=causal,
                                     **dict(mods, mod_args=(np.repeat(table[:1], 5, 0),)))
    assert not np.allclose(same[cq[3]:cq[4]], out[cq[3]:cq[4]])
    plan = str(numflash.explain_varlen(q, k, v, cq, ck, causal=causal, **mods))
    assert "one call per sequence" in plan and "score_mod=_sequence_bias" in plan, plan


# (_sequence_bias adds one constant to a whole row, which the softmax cancels: its table's exact
# gradient is zero, so the gradient tests train a per-sequence slope on the distance instead)
def _sequence_distance(x, b, h, i, j, table):   # reads b: a slope per sequence and head
    return x - 0.02 * table[b, h] * abs(i - j)


def _distance_at(x, b, h, i, j, table):   # score_mod_args_grad of _sequence_distance
    return (b, h), -0.02 * abs(i - j)


def _expected_table_gradient(q, k, v, do, cq, ck, causal, table, mods=None):
    """d loss / d table of _sequence_distance on packed sequences: each sequence's float64
    reference gradient (its functions shown b), summed."""
    total = np.zeros_like(table, np.float64)
    for b in range(len(cq) - 1):
        s, e, sk, ek = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if e == s or ek == sk:
            continue
        seq = [a[None, lo:hi] for a, lo, hi in ((q, s, e), (k, sk, ek), (v, sk, ek),
                                                (do, s, e))]
        own = dict(mods or {}, score_mod=_as_sequence(_sequence_distance, b),
                   score_mod_grad=_unit_grad, mod_args=(table,),
                   score_mod_args_grad=(_as_sequence(_distance_at, b),))
        total += reference.attention_backward(seq[3], *seq[:3], causal=causal, layout="bshd",
                                              return_mod_args_grad=True, **own)[-1][0]
    return total


@pytest.mark.parametrize("causal", [True, "bottom_right"])
def test_mod_args_gradients_sum_over_the_packed_sequences(rng, causal):
    """return_mod_args_grad on packed sequences (NumPy: one call per sequence, each showing the
    functions its index): the trained table's gradient is the sum of every sequence's, as the
    float64 reference gives it, in the table's dtype; dq, dk, dv the same to rounding."""
    q, k, v, do, cq, ck = packed(rng, [5, 0, 1, 37, 20], [7, 4, 1, 37, 29])
    table = rng.standard_normal((5, 4)).astype(np.float32)
    mods = dict(score_mod=_sequence_distance, score_mod_grad=_unit_grad, mod_args=(table,),
                softcap=6.0)
    out, lse = numflash.attention_varlen(q, k, v, cq, ck, causal=causal, return_lse=True,
                                         **mods)
    *grads, (dtable,) = numflash.attention_varlen_backward(
        do, q, k, v, out, lse, cq, ck, causal=causal, score_mod_args_grad=(_distance_at,),
        return_mod_args_grad=True, **mods)
    assert dtable.dtype == np.float32 and dtable.shape == table.shape
    want = _expected_table_gradient(q, k, v, do, cq, ck, causal, table, dict(softcap=6.0))
    assert np.abs(want).max() > 1e-2   # a gradient to compare
    np.testing.assert_allclose(dtable, want, rtol=1e-5, atol=1e-6)
    assert not dtable[1].any()   # the sequence without queries
    plain = numflash.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, causal=causal,
                                               **mods)
    for a, b in zip(grads, plain):   # (the MARGS kernel rounds a little differently)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="return_mod_args_grad=True needs score_mod_args_grad"):
        numflash.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, causal=causal,
                                           return_mod_args_grad=True, **mods)


def test_mod_args_gradients_of_the_emulated_one_launch(rng):
    """cuda.mma's VARLEN key pass with MARGS under the warp emulator (float64): the table's
    gradient added atomically by every sequence's blocks (b = the sequence) equals the sum of
    the sequences' float64 reference gradients."""
    from mma_tools import run_backward_kernels
    from numflash import mods as _mods
    q, k, v, do, cq, ck = packed(rng, *SHORT, H=2, Hk=1, d=24, dv=16)
    table = rng.standard_normal((len(cq) - 1, 2))
    opts = dict(score_mod=_sequence_distance, score_mod_grad=_unit_grad, mod_args=(table,),
                score_mod_args_grad=(_distance_at,))
    built = _mods.build((len(cq) - 1, 2, cq[-1], ck[-1]), "numpy", 0, **opts)
    out, lse = numflash.attention_varlen(q, k, v, cq, ck, causal="bottom_right",
                                         return_lse=True, **opts)
    *_, (dtable,) = run_backward_kernels(*map(_heads_first, (q, k, v, do, out)), lse[None],
                                         "f64", True, tiles={"queries": (2, 32),
                                                             "keys": (2, 32)},
                                         varlen=(cq, ck, True), mods=built, mod_args_grad=True)
    want = _expected_table_gradient(q, k, v, do, cq, ck, "bottom_right", table)
    assert np.abs(want).max() > 1e-2   # a gradient to compare
    np.testing.assert_allclose(dtable, want, rtol=1e-10, atol=1e-12)


def test_user_mods_on_packed_sequences_are_checked_before_anything_is_written(rng):
    q, k, v, do, cq, ck = packed(rng, [4, 6], [5, 5])
    out, lse = numflash.attention_varlen(q, k, v, cq, ck, return_lse=True)
    dq = np.full_like(q, 7.0)
    with pytest.raises(ValueError, match="score_mod_grad=f"):   # no derivative: no backward
        numflash.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, dq=dq,
                                           score_mod=_sequence_bias, mod_args=(np.ones((2, 4)),))
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        numflash.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, dq=dq, mask_mod=3)
    with pytest.raises(ValueError, match="mod_args were given without"):
        numflash.attention_varlen(q, k, v, cq, ck, mod_args=(np.ones(3),))
    for extra in ({}, dict(dropout_p=0.1, dropout_seed=1)):   # one rule, both paths
        with pytest.raises(TypeError, match=r"mod_args must be a tuple \(of arrays and "
                                            r"scalars\); got list"):
            numflash.attention_varlen(q, k, v, cq, ck, score_mod=_sequence_bias,
                                      mod_args=[np.ones((2, 4))], **extra)
    assert (dq == 7).all()
    with pytest.raises(TypeError, match="unexpected keyword argument 'attn_bias'"):
        numflash.attention_varlen(q, k, v, cq, ck, attn_bias=np.ones((1, 4, 10, 10)))
    plan = numflash.explain_varlen(q, k, v, cq, ck, backward=True, deterministic=True,
                                   score_mod=_sequence_bias, score_mod_grad=_unit_grad,
                                   mod_args=(np.ones((2, 4)),), score_mod_args_grad=(_distance_at,),
                                   return_mod_args_grad=True)
    assert plan.kernel == "cpu.tiled" and "one call per sequence" in str(plan)


def test_device_calls_with_user_mods_raise_only_where_a_sequence_would_run_them():
    """On device arrays a user's functions cannot run in per-sequence calls: the refusal names
    why the one launch did not take the call, unless no sequence has both queries and keys
    (then no call runs them, and nothing is refused)."""
    from types import SimpleNamespace
    from numflash.varlen import _no_user_mods_per_call
    problem = SimpleNamespace(on_device=True, q=np.zeros((1, 4, 3, 8)))
    cu = np.array([0, 2, 3])
    with pytest.raises(ValueError, match="which does not take this call: because"):
        _no_user_mods_per_call(problem, {"mask_mod": len}, "because", cu, cu)
    for cq, ck in ((cu, np.array([0, 0, 0])), (np.array([0]), np.array([0])),
                   (np.array([0, 0, 3]), np.array([0, 2, 2]))):
        _no_user_mods_per_call(problem, {"mask_mod": len}, "because", cq, ck)
    _no_user_mods_per_call(problem, {"softcap": 2.0}, "because", cu, cu)   # built-ins run
    problem.on_device = False
    _no_user_mods_per_call(problem, {"mask_mod": len}, "because", cu, cu)


def test_a_packed_alibi_table_needs_a_row_per_sequence_before_anything_is_written(rng):
    q, k, v, do, cq, ck = packed(rng, [4, 6], [5, 5])
    dq = np.full_like(q, 7.0)
    for fn in (lambda s: numflash.attention_varlen(q, k, v, cq, ck, alibi_slopes=s),
               lambda s: numflash.explain_varlen(q, k, v, cq, ck, alibi_slopes=s),
               lambda s: numflash.attention_varlen_backward(do, q, k, v, q[..., :16], np.zeros(
                   (4, 10)), cq, ck, alibi_slopes=s, dq=dq)):
        for bad in (np.ones((3, 4)), np.ones(3), np.ones((2, 3))):
            with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(H,\) = "
                                                 r"\(4,\) for every packed sequence, or "
                                                 r"\(B, H\) = \(2, 4\) with "
                                                 r"a row per packed sequence; got shape"):
                fn(bad)
    with pytest.raises(ValueError, match="alibi_slopes"):   # each call checks the rest
        numflash.attention_varlen(q, k, v, cq, ck, alibi_slopes=np.ones(4, np.int32))
    out, lse = numflash.attention_varlen(q, k, v, cq, ck, return_lse=True)
    for bad in (dict(softcap=-1.0), dict(window_size=(-3, 0)),
                dict(alibi_slopes=np.ones(4, np.int32))):   # checked before dq is zeroed
        with pytest.raises(ValueError, match=next(iter(bad))):
            numflash.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, dq=dq, **bad)
    assert (dq == 7).all()


@pytest.mark.simulator
def test_simulated_cuda_kernels(rng):
    q, k, v, do, cq, ck = packed(rng, [9, 0, 20], [13, 2, 17], d=8, dv=8)
    for algorithm in ("block", "row"):
        out, lse = numflash.attention_varlen(q, k, v, cq, ck, causal="bottom_right",
                                             backend="cuda", algorithm=algorithm,
                                             return_lse=True)
        ref, ref_lse = numflash.attention_varlen(q, k, v, cq, ck, causal="bottom_right",
                                                 backend="cpu", return_lse=True)
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-12)
    got = numflash.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, causal="bottom_right",
                                             backend="cuda")
    want = numflash.attention_varlen_backward(do, q, k, v, out, lse, cq, ck,
                                              causal="bottom_right", backend="cpu")
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-11)


def test_out_and_gradient_buffers_are_written_in_place(rng):
    q, k, v, do, cq, ck = packed(rng, [4, 6], [5, 3])
    out = np.full((10, 4, 16), np.nan)
    res = numflash.attention_varlen(q, k, v, cq, ck, out=out)
    assert res is out and np.isfinite(out).all()
    _, lse = numflash.attention_varlen(q, k, v, cq, ck, return_lse=True)
    bufs = [np.full(a.shape, np.nan) for a in (q, k, v)]
    got = numflash.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, dq=bufs[0],
                                             dk=bufs[1], dv=bufs[2])
    assert all(a is b for a, b in zip(got, bufs)) and all(np.isfinite(b).all() for b in bufs)


@pytest.mark.parametrize("cu, match", [
    ([0, 5, 3, 10], r"must be non-decreasing; it goes from 5 to 3 at entry 1"),
    ([1, 5, 10], "must start at 0"),
    ([0, 5, 9], "must end at the packed length 10; it ends at 9"),
    ([[0, 10]], r"must be 1-D with B \+ 1 entries"),
    (np.array([0.0, 10.0]), "must hold integers"),
    ("0,10", "must be a 1-D integer array"),
])
def test_bad_cu_seqlens_name_the_argument(rng, cu, match):
    q, k, v, _, _, ck = packed(rng, [4, 6], [5, 5])
    with pytest.raises((ValueError, TypeError), match="cu_seqlens_q " + match):
        numflash.attention_varlen(q, k, v, cu, [0, 5, 10])


def test_other_bad_inputs(rng):
    q, k, v, _, cq, ck = packed(rng, [4, 6], [5, 5])
    with pytest.raises(ValueError, match="cu_seqlens_k has 1 sequences, cu_seqlens_q has 2"):
        numflash.attention_varlen(q, k, v, cq, [0, 10])
    with pytest.raises(ValueError, match=r"max_seqlen_q=5 is shorter than the longest "
                                         r"sequence \(6\)"):
        numflash.attention_varlen(q, k, v, cq, ck, 5, 5)
    with pytest.raises(ValueError, match="q must be 3-D"):
        numflash.attention_varlen(q[None], k, v, cq, ck)
    with pytest.raises(ValueError, match="k and v must have the same packed length"):
        numflash.attention_varlen(q, k, v[:9], cq, ck)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_partials_equals_one_call_over_all_keys(rng, dtype):
    q = rng.standard_normal((2, 3, 40, 16)).astype(dtype)
    k = rng.standard_normal((2, 3, 90, 16)).astype(dtype)
    v = rng.standard_normal((2, 3, 90, 8)).astype(dtype)
    cuts = [0, 10, 11, 55, 90]
    # causal over the full key range (bottom right): the later parts see no key for early rows
    parts = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        offset = 90 - 40 - a  # query i sees keys j <= i + 50, i.e. j - a <= i + offset
        sq = reference.naive(q.astype(np.float64), k[:, :, a:b].astype(np.float64),
                             v[:, :, a:b].astype(np.float64), scale=0.25, causal=True,
                             causal_offset=offset)
        parts.append((sq[0].astype(dtype), sq[1].astype(np.float64 if dtype == np.float64
                                                        else np.float32)))
    out, lse = numflash.merge_partials([p[0] for p in parts], [p[1] for p in parts])
    assert out.dtype == dtype
    testing.assert_accurate(out, q, k, v, lse=lse, causal="bottom_right", softmax_scale=0.25)


def test_merge_partials_rows_without_keys_and_nan(rng):
    o = rng.standard_normal((1, 1, 3, 4))
    lse_a = np.array([[[-np.inf, 0.5, np.nan]]])
    lse_b = np.array([[[-np.inf, -np.inf, 0.1]]])
    out, lse = numflash.merge_partials([o, 2 * o], [lse_a, lse_b])
    assert (out[0, 0, 0] == 0).all() and lse[0, 0, 0] == -np.inf   # no key anywhere
    np.testing.assert_allclose(out[0, 0, 1], o[0, 0, 1])          # only part a has keys
    assert lse[0, 0, 1] == 0.5
    assert np.isnan(out[0, 0, 2]).all() and np.isnan(lse[0, 0, 2])  # a NaN part poisons its row


def test_merge_partials_bad_input(rng):
    o = rng.standard_normal((1, 1, 3, 4))
    lse = np.zeros((1, 1, 3))
    with pytest.raises(ValueError, match="as many outs as lses"):
        numflash.merge_partials([o, o], [lse])
    with pytest.raises(ValueError, match=r"lses\[1\] must have shape \(1, 1, 3\)"):
        numflash.merge_partials([o, o], [lse, lse[..., :2]])
    with pytest.raises(ValueError, match=r"outs\[1\] has shape"):
        numflash.merge_partials([o, o.astype(np.float32)], [lse, lse])
    with pytest.raises(TypeError, match="all be NumPy arrays"):
        numflash.merge_partials([o, [1]], [lse, lse])
    with pytest.raises(ValueError, match=r"at least 2-D; outs\[0\] has shape \(4,\)"):
        numflash.merge_partials([o[0, 0, 0]], [lse[0, 0, :1]])


def _merge_parts(rng, shape, dtype, xp=np):
    """Three parts of a merge: outputs of ``shape`` in ``dtype``, float lses with rows no part
    sees (all -inf), rows only one part sees and a NaN lse in one part."""
    outs = [rng.standard_normal(shape).astype(dtype) for _ in range(3)]
    lses = [rng.standard_normal(shape[:-1]).astype(testing.lse_dtype(dtype)) * 3
            for _ in range(3)]
    for lse in lses:
        lse[..., 0] = -np.inf                      # no key anywhere
    lses[1][..., 1] = lses[2][..., 1] = -np.inf    # only part 0 sees row 1
    lses[2][..., 2] = np.nan                       # part 2 poisons row 2
    return [xp.asarray(a) for a in outs], [xp.asarray(a) for a in lses]


def test_torch_merge_partials_is_numflash_merge_on_views(rng):
    """numflash.torch.merge_partials runs numflash.merge_partials on the tensors' memory: the
    same bits, any leading axes (here a bshd-ordered (B, N, H, d) output with its lse viewed
    as (B, N, H)), and its refusals name the argument."""
    torch = pytest.importorskip("torch")
    from numflash import torch as nt
    outs, lses = _merge_parts(rng, (2, 5, 3, 8), np.float32)
    want, want_lse = numflash.merge_partials(outs, lses)
    bhs = [torch.from_numpy(np.ascontiguousarray(s.transpose(0, 2, 1))) for s in lses]
    got, got_lse = nt.merge_partials([torch.from_numpy(o) for o in outs],
                                     [s.transpose(1, 2) for s in bhs])
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(got_lse.numpy(), want_lse)
    assert (got[..., 0, :] == 0).all() and torch.isnan(got[..., 2, :]).all()
    with pytest.raises(TypeError, match=r"lses\[1\] must be a torch.Tensor"):
        nt.merge_partials([torch.from_numpy(o) for o in outs[:2]], [bhs[0], lses[1]])
    with pytest.raises(ValueError, match="as many outs as lses"):
        nt.merge_partials([torch.from_numpy(outs[0])], [])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_gpu_merge_partials_runs_the_merge_kernel(rng, monkeypatch, dtype):
    """On CuPy arrays merge_partials is one cuda.merge launch, and it gives what the NumPy
    formula gives (to the last bits of exp / log), with rows no part sees, rows one part sees
    and a NaN part, for 3-, 4- and 5-D outputs; numflash.torch.merge_partials gives the same
    on CUDA tensors, on torch's current stream."""
    cupy = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    from numflash import torch as nt
    from numflash.cuda import merge
    dtype = (np.dtype(pytest.importorskip("ml_dtypes").bfloat16) if dtype == "bfloat16"
             else np.dtype(dtype))
    launches = []
    original = merge.run
    monkeypatch.setattr(merge, "run", lambda *a: launches.append(1) or original(*a))
    tol = 1e-12 if dtype == np.float64 else 1e-5 if dtype == np.float32 else 1e-2
    for shape in ((7, 33, 24), (2, 3, 97, 64), (2, 2, 3, 40, 16)):
        outs, lses = _merge_parts(rng, shape, dtype)
        want, want_lse = numflash.merge_partials(outs, lses)
        dev_outs, dev_lses = [cupy.asarray(o) for o in outs], [cupy.asarray(s) for s in lses]
        out, lse = numflash.merge_partials(dev_outs, dev_lses)
        assert out.dtype == dtype and out.shape == shape and lse.shape == shape[:-1]
        np.testing.assert_allclose(out.get().astype(np.float64), want.astype(np.float64),
                                   rtol=tol, atol=tol)
        np.testing.assert_allclose(lse.get(), want_lse, rtol=tol, atol=tol)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            t_out, t_lse = nt.merge_partials([torch.from_dlpack(o) for o in dev_outs],
                                             [torch.from_dlpack(s) for s in dev_lses])
        stream.synchronize()
        for t, a in ((t_out, out), (t_lse, lse)):   # the same bits, NaN rows included
            np.testing.assert_array_equal(cupy.from_dlpack(t).get().astype(np.float64),
                                          a.get().astype(np.float64))
    assert len(launches) == 6


def test_torch_flash_attn_varlen_func_is_differentiable(rng):
    torch = pytest.importorskip("torch")
    import numflash.torch as nt
    q, k, v, do, cq, ck = packed(rng, [5, 0, 31], [7, 3, 20])
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    out, lse, probs = nt.flash_attn_varlen_func(tq, tk, tv, torch.tensor(cq), torch.tensor(ck),
                                                31, 20, causal=True, return_attn_probs=True)
    assert probs is None and lse.shape == (4, 36)
    want, want_lse = numflash.attention_varlen(q, k, v, cq, ck, causal="bottom_right",
                                               return_lse=True)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=0, atol=1e-13)
    grads = torch.autograd.grad(out, (tq, tk, tv), torch.tensor(do))
    ref = numflash.attention_varlen_backward(do, q, k, v, want, want_lse, cq, ck,
                                             causal="bottom_right")
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g.numpy(), r, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):  # checked as ever
        nt.flash_attn_varlen_func(tq, tk, tv, cq, ck, dropout_p=1.5)


def test_backward_checks_come_before_any_write(rng):
    q, k, v, do, cq, ck = packed(rng, [4, 6], [5, 5])
    out, lse = numflash.attention_varlen(q, k, v, cq, ck, return_lse=True)
    q_before = q.copy()
    with pytest.raises(ValueError, match="dq overlaps q"):
        numflash.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, dq=q)
    np.testing.assert_array_equal(q, q_before)  # nothing was zeroed
    with pytest.raises(ValueError, match=r"do must have the output's shape"):
        numflash.attention_varlen_backward(do[:9], q, k, v, out, lse, cq, ck)


def test_torch_tensors_are_pointed_to_the_torch_entry_point(rng):
    torch = pytest.importorskip("torch")
    q, k, v, _, cq, ck = packed(rng, [4, 6], [5, 5])
    with pytest.raises(TypeError, match="flash_attn_varlen_func"):
        numflash.attention_varlen(torch.tensor(q), k, v, cq, ck)


# ------------------------------------------------------- cuda.mma's one launch (VARLEN)

def _kind(DT):
    return {"f64": np.float64, "3xtf32": np.float32, "f16": np.float16}[DT]


def _heads_first(a):
    """A packed (total, H, d) array as the (1, H, total, d) view the kernels take."""
    return a.transpose(1, 0, 2)[None]


SHORT = ([5, 0, 20, 9], [7, 12, 17, 0])   # a block and a key tile each
LONG = ([5, 0, 70, 9], [7, 12, 75, 0])    # 3 blocks and 3 key tiles for the long one


def _sequence_bias(x, b, h, i, j, table):   # reads b: a row of its table per sequence
    return x + table[b, h] - 0.05 * abs(i - j)


def _unit_grad(x, b, h, i, j, table):
    return 1.0


def _sequence_mask(b, h, i, j, table):   # every third pair, where the table's sequence row says
    return (i + 2 * j) % 3 != 0 or table[b, h] > 0


def _packed_mods(which, shape, offset, table):
    """numflash.mods.Mods of the emulated one-launch cases: None, or a window, a softcap, ALiBi
    and a user's score_mod and mask_mod that read the sequence index b (through ``table``'s
    rows, which are also the sequences' ALiBi slopes)."""
    if which is None:
        return None
    from numflash import mods
    return mods.build(shape, "numpy", offset, **_mod_options(table))


def _mod_options(table):
    return dict(window_size=(9, 2), softcap=4.0, alibi_slopes=np.abs(table),
                score_mod=_sequence_bias, score_mod_grad=_unit_grad, mask_mod=_sequence_mask,
                mod_args=(table,))


@pytest.mark.parametrize("DT, causal, lengths, d, chunks, mods, drop", [
    ("f64", "bottom_right", SHORT, 24, 0, None, 0),
    ("f64", "bottom_right", SHORT, 24, 0, "mods", 0),
    ("f64", True, SHORT, 24, 0, "mods", 0.25),
    pytest.param("f64", True, LONG, 24, 0, None, 0, marks=pytest.mark.extended),
    pytest.param("f64", "bottom_right", SHORT, 96, 2, None, 0,
                 marks=pytest.mark.extended),  # slices
    pytest.param("f16", False, LONG, 24, 0, None, 0, marks=pytest.mark.extended),
    pytest.param("f16", True, LONG, 24, 0, "mods", 0, marks=pytest.mark.extended),
    pytest.param("f16", "bottom_right", LONG, 24, 0, None, 0.4, marks=pytest.mark.extended),
    pytest.param("3xtf32", "bottom_right", SHORT, 24, 0, None, 0, marks=pytest.mark.extended),
], ids=lambda x: "long" if x is LONG else "short" if x is SHORT else None)
def test_one_launch_kernels_emulated_equal_each_sequence_alone(rng, DT, causal, lengths, d,
                                                               chunks, mods, drop):
    """cuda.mma's VARLEN forward and backward under the warp emulator: one launch over packed
    sequences (one without queries, one without keys, Nq != Nk both ways, GQA; LONG: blocks
    past a shorter sequence's rows return, K/V and query tiles double-buffered; column slices;
    ``mods``: a window, a softcap, ALiBi and a user's score_mod and mask_mod that read b: each
    sequence's window and ALiBi distances from its own diagonal; ``drop``: dropout, each
    sequence under its packed_seed, derived in the kernel) gives, bit for bit, what the plain
    kernels give each sequence alone (as batch 0, the functions' table cut to the sequence's
    row, so that they see what the one launch shows them as sequence b; dropout under the
    sequence's own seed), and rows of an empty side get zeros (lse -inf; keys no query sees get
    zero dK, dV)."""
    from mma_tools import run_backward_kernels, run_forward_kernel
    from numflash.dropout import build, packed_seed
    from numflash.inputs import parse_causal
    seed = 2 ** 63 + 12345   # both seed words used
    dropout = build(drop, seed)
    q, k, v, do, cq, ck = packed(rng, *lengths, H=2, Hk=1, d=d, dv=16, dtype=_kind(DT))
    real = np.float64 if DT == "f64" else np.float32
    table = rng.standard_normal((len(cq) - 1, 2))
    packing = (cq, ck, causal == "bottom_right")
    tile, tiles = (2, 32, 0), {"queries": (2, 32), "keys": (2, 32)}
    all_mods = _packed_mods(mods, (len(cq) - 1, 2, cq[-1], ck[-1]), 0, table)
    out, lse = run_forward_kernel(*map(_heads_first, (q, k, v)), DT, causal=bool(causal),
                                  VEC=1, tile=tile, varlen=packing, mods=all_mods,
                                  dropout=dropout)
    grads = run_backward_kernels(*map(_heads_first, (q, k, v, do, out[0].transpose(1, 0, 2))),
                                 lse.astype(real), DT, bool(causal), tiles=tiles,
                                 varlen=packing, chunks=chunks, mods=all_mods, dropout=dropout)
    assert not np.isnan(out).any() and not any(np.isnan(g).any() for g in grads)
    for b in range(len(cq) - 1):
        s, e, sk, ek = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if e == s:   # keys no query sees
            assert not grads[1][0, :, sk:ek].any() and not grads[2][0, :, sk:ek].any()
            continue
        if ek == sk:   # rows that see no key
            assert not out[0, :, s:e].any() and np.isneginf(lse[0, :, s:e]).all()
            assert not grads[0][0, :, s:e].any()
            continue
        seq = [_heads_first(a[lo:hi]) for a, lo, hi in ((q, s, e), (k, sk, ek), (v, sk, ek))]
        is_causal, offset = parse_causal(causal, e - s, ek - sk)
        own = _packed_mods(mods, (1, 2, e - s, ek - sk), offset, table[b:b + 1])
        own_drop = build(drop, packed_seed(seed, b))
        one, one_lse = run_forward_kernel(*seq, DT, is_causal, offset, VEC=1, tile=tile,
                                          mods=own, dropout=own_drop)
        np.testing.assert_array_equal(out[:, :, s:e], one)
        np.testing.assert_array_equal(lse[:, :, s:e], one_lse)
        one_grads = run_backward_kernels(*seq, _heads_first(do[s:e]), one, one_lse, DT,
                                         is_causal, offset, tiles=tiles, chunks=chunks, mods=own,
                                         dropout=own_drop)
        for got, want, lo, hi in zip(grads, one_grads, (s, sk, sk), (e, ek, ek)):
            np.testing.assert_array_equal(got[:, :, lo:hi], want)
    s, e, sk, ek = cq[2], cq[3], ck[2], ck[3]   # and the kernel meets the accuracy rule
    seq = [_heads_first(a[lo:hi]) for a, lo, hi in ((q, s, e), (k, sk, ek), (v, sk, ek))]
    opts = {} if mods is None else _mod_options(table[2:3])
    if drop:
        opts.update(dropout_p=drop, dropout_seed=packed_seed(seed, 2))
    testing.assert_accurate(out[:, :, s:e], *seq, lse=lse[:, :, s:e], causal=causal, **opts)
    if opts:   # (the plain kernels' gradients were compared with the rule before)
        testing.assert_gradients_accurate([g[:, :, lo:hi] for g, lo, hi in zip(
            grads, (s, sk, sk), (e, ek, ek))], _heads_first(do[s:e]), *seq, causal=causal,
            **opts)

def test_one_launch_is_planned_for_packed_problems_and_refuses_what_it_lacks(rng):
    """cuda.mma's config turns packed problems into VARLEN variants (forward and both backward
    passes, never split; with a window, a softcap, a user's functions and dropout too), refuses an
    attn_bias, a forced split and more sequences x heads
    than grid y holds with the reason, and the other kernels decline packed problems saying
    what runs them."""
    from numflash import dropout, kernels, mods
    from numflash.cuda import mma
    from numflash.cuda.mma import gradients
    from numflash.device import Device, Unsupported
    from numflash.inputs import normalize, normalize_backward
    from numflash.varlen import Packed
    h100 = Device(name="H100", cc=(9, 0), smem_per_block_optin=227 * 1024, sm_count=132)
    q, k, v, do, cq, ck = packed(rng, [5, 40], [7, 3], H=4, Hk=2, d=64, dv=64,
                                 dtype=np.float16)
    packing = Packed(cq, ck, 40, 7, True)
    problem = normalize(q[None], k[None], v[None], causal="bottom_right", layout="bshd")
    problem.varlen = packing
    cfg = mma.config(problem, h100)
    assert cfg.VARLEN == 1 and not cfg.SPLIT and not cfg.KVLEN
    assert "packed sequences: 2 in one launch" in " ".join(mma.notes(problem, cfg, h100))
    assert len(mma.signature("float16", varlen=True)) == len(mma.signature("float16")) + 2
    o = np.zeros_like(do)
    lse = np.zeros((1, 4, q.shape[0]), np.float32)
    back = normalize_backward(do[None], q[None], k[None], v[None], o[None], lse,
                              causal="bottom_right", layout="bshd")
    back.varlen = packing
    with pytest.raises(Unsupported, match="16-byte cp.async"):
        gradients.config(back, h100)   # NumPy arrays: the backward stages with cp.async only
    problem.varlen = Packed(np.zeros(20000, np.int32), ck, 40, 7, True)   # 19999 x 4 heads
    with pytest.raises(Unsupported, match="at most 65535; 19999 sequences x 4 heads"):
        mma.config(problem, h100)
    problem.varlen = packing
    problem.num_splits = 4
    with pytest.raises(Unsupported, match="does not split the keys"):
        mma.config(problem, h100)
    problem.num_splits = None
    problem.mods = mods.build(problem.shape, problem.kind, problem.causal_offset,
                              attn_bias=np.ones((1, 4, 45, 10)))
    with pytest.raises(Unsupported, match="alibi_slopes, mask_mod, score_mod, softcap, "
                                          "window_size only, not attn_bias"):
        mma.config(problem, h100)
    problem.mods = mods.build(problem.shape, problem.kind, problem.causal_offset, softcap=5.0,
                              window_size=(8, 0), score_mod=_sequence_bias,
                              mask_mod=_sequence_mask, mod_args=(np.ones((2, 4)),))
    cfg = mma.config(problem, h100)   # the one launch's mods: a key range, the rest compiled in
    assert cfg.VARLEN and cfg.WINDOW and "sequence_bias" in cfg.MODS and "softcap" in cfg.MODS
    problem.dropout = dropout.build(0.1, 5)   # each block derives its sequence's seed
    cfg = mma.config(problem, h100)
    assert cfg.VARLEN and cfg.DROP and cfg.MODS
    assert "packed_seed_words(drop_lo, drop_hi, U(b))" in mma.kernel_source(cfg)
    problem.mods = problem.dropout = None
    for op in kernels.FORWARD + kernels.BACKWARD:
        why = op.why_not(problem, h100)
        if op.name in ("cuda.mma", "cuda.wgmma"):
            assert why is None or "packed" not in why
        else:
            assert "does not run packed sequences in one launch" in why, (op.name, why)


def _dtype_and_per_sequence_calls(monkeypatch, dtype):
    """The NumPy dtype named ``dtype`` (bfloat16 from ml_dtypes), and a list that gains an entry
    for every numflash.attention / attention_backward call (a per-sequence call) made."""
    from numflash import api
    dtype = (np.dtype(pytest.importorskip("ml_dtypes").bfloat16) if dtype == "bfloat16"
             else np.dtype(dtype))
    calls = []
    for name in ("attention", "attention_backward"):
        original = getattr(api, name)
        monkeypatch.setattr(api, name, lambda *a, _f=original, **kw: calls.append(1) or
                            _f(*a, **kw))
    return dtype, calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_gpu_one_launch_meets_the_rule_for_every_sequence(rng, monkeypatch, dtype):
    """On the GPU, attention_varlen and its backward run every sequence in one launch per pass
    (cuda.mma; 16-bit on Hopper cuda.wgmma, the backward's key pass after cuda.mma's delta pass;
    no per-sequence attention call; explain_varlen says so), for lengths 0, 1, odd and
    1025, Nq != Nk both ways, GQA, every causal mode, and each sequence's rows and gradients meet
    the accuracy rule; two runs with deterministic=True give the same bits (by default 16-bit
    dQ is added atomically on sm_90, in an order that varies)."""
    cupy = pytest.importorskip("cupy")
    dtype, calls = _dtype_and_per_sequence_calls(monkeypatch, dtype)
    lens_q, lens_k = [1, 0, 97, 1025, 300, 64], [5, 13, 97, 1025, 150, 0]
    q, k, v, do, cq, ck = packed(rng, lens_q, lens_k, H=8, Hk=2, d=64, dv=64, dtype=dtype)
    dev = [cupy.asarray(a) for a in (q, k, v, do, cq, ck)]
    # cuda.wgmma's packed kernels for 16-bit on Hopper (the backward's key pass after cuda.mma's
    # delta pass), else cuda.mma's
    hopper = cupy.cuda.Device().compute_capability == "90"
    kernel = "cuda.wgmma" if hopper and dtype.itemsize == 2 else "cuda.mma"
    for causal in (False, True, "bottom_right"):
        for backward in (False, True):
            plan = numflash.explain_varlen(*dev[:3], *dev[4:], causal=causal, backward=backward)
            assert plan.kernel == kernel and "6 in one launch" in str(plan), str(plan)
        out, lse = numflash.attention_varlen(*dev[:3], *dev[4:], causal=causal, return_lse=True)
        grads = numflash.attention_varlen_backward(dev[3], *dev[:3], out, lse, *dev[4:],
                                                   causal=causal)
        runs = [numflash.attention_varlen_backward(dev[3], *dev[:3], out, lse, *dev[4:],
                                                   causal=causal, deterministic=True)
                for _ in range(2)]
        assert all(bool((a == b).all()) for a, b in zip(*runs))
        assert calls == []
        out, lse, grads = out.get(), lse.get(), [g.get() for g in grads]
        for b in range(len(cq) - 1):
            s, e, sk, ek = cq[b], cq[b + 1], ck[b], ck[b + 1]
            if e == s:
                assert not grads[1][sk:ek].any() and not grads[2][sk:ek].any()
                continue
            seq = [a[None, lo:hi] for a, lo, hi in ((q, s, e), (k, sk, ek), (v, sk, ek))]
            testing.assert_accurate(out[None, s:e], *seq, lse=lse[None, :, s:e],
                                    causal=causal, layout="bshd")
            if ek > sk:
                testing.assert_gradients_accurate(
                    [grads[0][None, s:e], grads[1][None, sk:ek], grads[2][None, sk:ek]],
                    do[None, s:e], *seq, causal=causal, layout="bshd")
            else:
                assert not grads[0][s:e].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("user_mods", [False, True])
def test_gpu_dropout_on_packed_sequences_runs_in_one_launch(rng, monkeypatch, dtype,
                                                            user_mods):
    """CuPy packed sequences with dropout (``user_mods``: and a user's score_mod and mask_mod
    reading b, the sequence): one cuda.mma launch per pass (no per-sequence call; explain says
    so), sequence b drawing under packed_seed(seed, b) in the kernel, forward and gradients
    against the float64 reference with that mask; each sequence's own call (a batch of one
    under that seed) gives the same rows to rounding."""
    import cupy
    from numflash.dropout import packed_seed
    dtype, calls = _dtype_and_per_sequence_calls(monkeypatch, dtype)
    q, k, v, do, cq, ck = packed(rng, [100, 1, 257, 0], [90, 5, 300, 7], H=4, Hk=2, d=64,
                                 dv=64, dtype=dtype)
    table = rng.standard_normal((4, 4))
    opts = dict(causal="bottom_right", dropout_p=0.2, dropout_seed=2 ** 63 + 99)
    if user_mods:
        opts.update(score_mod=_sequence_bias, score_mod_grad=_unit_grad,
                    mask_mod=_sequence_mask)
    dev = [cupy.asarray(a) for a in (q, k, v, do, cq, ck)]
    dev_args = dict(mod_args=(cupy.asarray(table),)) if user_mods else {}
    plan = numflash.explain_varlen(*dev[:3], *dev[4:], backward=True,
                                   **{n: x for n, x in opts.items() if n != "dropout_seed"},
                                   **dev_args)
    assert plan.kernel == "cuda.mma" and "4 in one launch" in str(plan), str(plan)
    assert plan.dropout, str(plan)
    out, lse = numflash.attention_varlen(*dev[:3], *dev[4:], return_lse=True, **opts,
                                         **dev_args)
    grads = [g.get() for g in numflash.attention_varlen_backward(dev[3], *dev[:3], out, lse,
                                                                 *dev[4:], **opts, **dev_args)]
    assert calls == []
    out, lse = out.get(), lse.get()
    for b in range(3):
        s, e, sk, ek = cq[b], cq[b + 1], ck[b], ck[b + 1]
        seq = [a[None, lo:hi] for a, lo, hi in ((q, s, e), (k, sk, ek), (v, sk, ek))]
        mine = dict(opts, dropout_seed=packed_seed(opts["dropout_seed"], b))
        if user_mods:
            mine.update(score_mod=_as_sequence(_sequence_bias, b),
                        mask_mod=_as_sequence(_sequence_mask, b), mod_args=(table,))
        testing.assert_accurate(out[None, s:e], *seq, lse=lse[None, :, s:e], layout="bshd",
                                **mine)
        testing.assert_gradients_accurate([grads[0][None, s:e], grads[1][None, sk:ek],
                                           grads[2][None, sk:ek]], do[None, s:e], *seq,
                                          layout="bshd", **mine)
        if not user_mods:   # the sequence's own call on the GPU draws the same mask (its
            # kernel may split the keys: equal to rounding; another mask would differ by ~0.1)
            own = numflash.attention(*(cupy.asarray(a) for a in seq), layout="bshd",
                                     **mine).get()
            np.testing.assert_allclose(out[None, s:e].astype(np.float64), own, rtol=0,
                                       atol=4e-3 if dtype.itemsize == 2 else 1e-5)
    sk, ek = ck[3], ck[4]   # the keys of the sequence without queries: no gradient
    assert not grads[1][sk:ek].any() and not grads[2][sk:ek].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_modifications_on_packed_sequences_meet_the_rule_for_every_sequence(rng, dtype):
    """CuPy packed sequences with a window, softcap and per-sequence ALiBi: one cuda.mma launch
    per pass (each sequence's window and ALiBi distances from its own diagonal), forward and
    backward against each sequence's float64 reference; the same through
    flash_attn_varlen_func on CUDA tensors."""
    import cupy
    q, k, v, do, cq, ck = packed(rng, [100, 1, 257], [90, 5, 300], H=4, Hk=2, d=64, dv=64,
                                 dtype=np.dtype(dtype))
    slopes = rng.random((3, 4))
    mods = dict(window_size=(40, 0), softcap=3.0, alibi_slopes=slopes)
    dev = [cupy.asarray(a) for a in (q, k, v, do, cq, ck)]
    dev_mods = dict(mods, alibi_slopes=cupy.asarray(slopes))
    plan = numflash.explain_varlen(*dev[:3], *dev[4:], causal="bottom_right", **dev_mods)
    assert plan.kernel == "cuda.mma" and "3 in one launch" in str(plan), str(plan)
    out, lse = numflash.attention_varlen(*dev[:3], *dev[4:], causal="bottom_right",
                                         return_lse=True, **dev_mods)
    grads = numflash.attention_varlen_backward(dev[3], *dev[:3], out, lse, *dev[4:],
                                               causal="bottom_right", **dev_mods)
    host = [a.get() for a in (out, lse, *grads)]
    _check_each_sequence(host[0], host[1], host[2:], q, k, v, do, cq, ck, "bottom_right", mods)
    torch = pytest.importorskip("torch")
    import numflash.torch as nt
    tq, tk, tv = (torch.from_dlpack(a).requires_grad_() for a in dev[:3])
    t_out = nt.flash_attn_varlen_func(tq, tk, tv, torch.from_dlpack(dev[4]),
                                      torch.from_dlpack(dev[5]), causal=True,
                                      alibi_slopes=torch.from_dlpack(dev_mods["alibi_slopes"]),
                                      window_size=(40, 0), softcap=3.0, deterministic=True)
    t_grads = torch.autograd.grad(t_out, (tq, tk, tv), torch.from_dlpack(dev[3]))
    grads = numflash.attention_varlen_backward(dev[3], *dev[:3], out, lse, *dev[4:],
                                               causal="bottom_right", deterministic=True,
                                               **dev_mods)   # (no dQ adds: bitwise runs)
    for got, want in zip((t_out, *t_grads), (out, *grads)):   # the same calls, the same bits
        np.testing.assert_array_equal(got.detach().cpu().numpy(), want.get())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_gpu_user_mods_on_packed_sequences_run_in_one_launch(rng, monkeypatch, dtype):
    """CuPy packed sequences with a user's score_mod and mask_mod (reading b, the sequence),
    a window, a softcap and per-sequence ALiBi: one cuda.mma launch per pass (no per-sequence
    call; explain says so), each sequence's rows and gradients meet the rule against its
    float64 reference (with dropout: test_gpu_dropout_on_packed_sequences_runs_in_one_launch)."""
    cupy = pytest.importorskip("cupy")
    dtype, calls = _dtype_and_per_sequence_calls(monkeypatch, dtype)
    lens_q, lens_k = [1, 0, 97, 300, 64], [5, 13, 97, 150, 0]
    q, k, v, do, cq, ck = packed(rng, lens_q, lens_k, H=4, Hk=2, d=64, dv=64, dtype=dtype)
    table = rng.standard_normal((5, 4))
    opts = dict(causal="bottom_right", window_size=(60, 0), softcap=5.0,
                score_mod=_sequence_bias, score_mod_grad=_unit_grad, mask_mod=_sequence_mask)
    dev = [cupy.asarray(a) for a in (q, k, v, do, cq, ck)]
    mod_args = (cupy.asarray(table),)
    opts["alibi_slopes"] = cupy.asarray(np.abs(table))
    plan = numflash.explain_varlen(*dev[:3], *dev[4:], backward=True, mod_args=mod_args, **opts)
    assert plan.kernel == "cuda.mma" and "5 in one launch" in str(plan), str(plan)
    out, lse = numflash.attention_varlen(*dev[:3], *dev[4:], return_lse=True,
                                         mod_args=mod_args, **opts)
    grads = numflash.attention_varlen_backward(dev[3], *dev[:3], out, lse, *dev[4:],
                                               mod_args=mod_args, **opts)
    assert calls == []
    out, lse, grads = out.get(), lse.get(), [g.get() for g in grads]
    for b in range(len(cq) - 1):
        s, e, sk, ek = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if e == s or ek == sk:
            continue
        mine = dict(opts, score_mod=_as_sequence(_sequence_bias, b),
                    mask_mod=_as_sequence(_sequence_mask, b), mod_args=(table,),
                    alibi_slopes=np.abs(table[b]))
        seq = [a[None, lo:hi] for a, lo, hi in ((q, s, e), (k, sk, ek), (v, sk, ek))]
        testing.assert_accurate(out[None, s:e], *seq, lse=lse[None, :, s:e], layout="bshd",
                                **mine)
        testing.assert_gradients_accurate([grads[0][None, s:e], grads[1][None, sk:ek],
                                           grads[2][None, sk:ek]], do[None, s:e], *seq,
                                          layout="bshd", **mine)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_mod_args_gradients_on_packed_sequences(rng, dtype):
    """CuPy packed sequences: the one launch's key pass adds the trained table's gradient
    (b = the sequence) atomically; it matches the sum of the sequences' float64 reference
    gradients; deterministic=True refuses with the reason (the per-sequence calls would need the
    CPU path)."""
    cupy = pytest.importorskip("cupy")
    q, k, v, do, cq, ck = packed(rng, [1, 0, 97, 300], [5, 13, 97, 150], H=4, Hk=2, d=64,
                                 dv=64, dtype=np.dtype(dtype))
    table = rng.standard_normal((4, 4))
    opts = dict(causal="bottom_right", score_mod=_sequence_distance, score_mod_grad=_unit_grad,
                score_mod_args_grad=(_distance_at,))
    dev = [cupy.asarray(a) for a in (q, k, v, do, cq, ck)]
    mod_args = (cupy.asarray(table),)
    out, lse = numflash.attention_varlen(*dev[:3], *dev[4:], return_lse=True,
                                         mod_args=mod_args, **opts)
    *_, (dtable,) = numflash.attention_varlen_backward(dev[3], *dev[:3], out, lse, *dev[4:],
                                                       mod_args=mod_args,
                                                       return_mod_args_grad=True, **opts)
    want = _expected_table_gradient(*(a.astype(np.float64) for a in (q, k, v, do)), cq, ck,
                                    "bottom_right", table)
    got = dtable.get()
    assert np.abs(want).max() > 1e-2   # a gradient to compare
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max() + 1e-6, (got, want)
    with pytest.raises(ValueError, match="deterministic=True"):
        numflash.attention_varlen_backward(dev[3], *dev[:3], out, lse, *dev[4:],
                                           mod_args=mod_args, return_mod_args_grad=True,
                                           deterministic=True, **opts)


@pytest.mark.gpu
def test_gpu_torch_flash_attn_varlen_func_runs_one_launch_on_torch_stream(rng, monkeypatch):
    """flash_attn_varlen_func on CUDA tensors (on a non-default torch stream) runs
    attention_varlen's one launch and its backward, not one call per sequence; outputs and
    gradients (both deterministic=True) equal numflash.attention_varlen's on the same memory
    and meet the rule."""
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    import numflash.torch as nt
    from numflash import api
    calls = []
    for name in ("attention", "attention_backward"):
        original = getattr(api, name)
        monkeypatch.setattr(api, name, lambda *a, _f=original, **kw: calls.append(1) or
                            _f(*a, **kw))
    q, k, v, do, cq, ck = packed(rng, [100, 0, 777, 64], [300, 5, 777, 1], H=8, Hk=4, d=64,
                                 dv=64, dtype=np.float16)
    tq, tk, tv = (torch.tensor(a, device="cuda", requires_grad=True) for a in (q, k, v))
    tcq, tck = (torch.tensor(c, device="cuda") for c in (cq, ck))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out, lse, _ = nt.flash_attn_varlen_func(tq, tk, tv, tcq, tck, causal=True,
                                                return_attn_probs=True, deterministic=True)
        grads = torch.autograd.grad(out, (tq, tk, tv), torch.tensor(do, device="cuda"))
    stream.synchronize()
    assert calls == []
    dev = [cupy.asarray(a) for a in (q, k, v, cq, ck)]
    want, want_lse = numflash.attention_varlen(*dev, causal="bottom_right", return_lse=True)
    assert bool((cupy.from_dlpack(out.detach()) == want).all())
    assert bool((cupy.from_dlpack(lse) == want_lse).all())
    ref = numflash.attention_varlen_backward(cupy.asarray(do), *dev[:3], want, want_lse,
                                             *dev[3:], causal="bottom_right", deterministic=True)
    for g, r in zip(grads, ref):
        assert bool((cupy.from_dlpack(g) == r).all())
    s, e, sk, ek = cq[2], cq[3], ck[2], ck[3]
    testing.assert_gradients_accurate(
        [g[lo:hi][None].cpu().numpy() for g, lo, hi in zip(grads, (s, sk, sk), (e, ek, ek))],
        do[None, s:e], q[None, s:e], k[None, sk:ek], v[None, sk:ek], causal="bottom_right",
        layout="bshd")


def test_bench_draws_lengths_that_sum_to_the_total():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "varlen.py"
    spec = importlib.util.spec_from_file_location("bench_varlen", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for seed in range(5):
        lengths = bench.draw_lengths(np.random.default_rng(seed), 65536)
        assert sum(lengths) == 65536 and all(0 < n <= 8192 for n in lengths)
        assert all(n >= 128 for n in lengths[:-1])   # only the last is trimmed


@pytest.mark.extended
def test_bench_cpu_table_runs_and_reports_each_pass(tmp_path):
    """bench/varlen.py --cpu at a tiny size: one row a pass, every cell a number."""
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "bench" / "varlen.py"), "--cpu", "--total",
                          "600", "--max", "300", "--heads", "2", "--d", "16", "--reps", "1"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines()
            if line.startswith("| 16 |")]
    assert [r[1].strip() for r in rows] == ["forward", "fwd+bwd"], run.stdout
    for r in rows:
        assert all(float(c) > 0 for c in r[2:4]), r
