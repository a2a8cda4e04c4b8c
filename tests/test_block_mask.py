"""Block masks (numflash/block_mask.py): the blocks' states and lists against a brute-force
evaluation, the CPU filler against the GPU one (in numba's simulator here), calls with a block
mask against calls with its mask_mod and the float64 reference, forward and backward, and that
the kernels honour the lists: with a state doctored to disagree with the mask (a block marked
EMPTY where pairs take part, FULL where some do not), the CPU path and the generated cuda.mma
source (under the warp emulator) give exactly the attention of the mask the state describes.
Bad input names ``block_mask`` or the argument. GPU tests at real sizes are marked."""
import numpy as np
import pytest

import numflash
from numflash import mods, testing
from numflash.block_mask import EMPTY, FULL, PARTIAL, BlockMask, create_block_mask
from numflash.inputs import parse_causal


def _stripes(b, h, i, j, period, keep):
    """A mask that leaves every block PARTIAL: keys whose (i + j) % period < keep."""
    return (i + j + b + h) % period < keep


def _brute_state(visible, B, H, Nq, Nk, bq, bk):
    """States of each block from a dense (B, H, Nq, Nk) boolean array."""
    nqb, nkb = -(-Nq // bq), -(-Nk // bk)
    state = np.empty((B, H, nqb, nkb), np.int8)
    for qb in range(nqb):
        for kb in range(nkb):
            blk = visible[:, :, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
            state[:, :, qb, kb] = np.where(blk.all((2, 3)), FULL,
                                           np.where(blk.any((2, 3)), PARTIAL, EMPTY))
    return state


def _dense(mask_mod, args, B, H, Nq, Nk):
    return np.array([[[[bool(mask_mod(b, h, i, j, *args)) for j in range(Nk)]
                       for i in range(Nq)] for h in range(H)] for b in range(B)])


def _doc_mask(rng, B, N, docs=4):
    ids = np.sort(rng.integers(0, docs, (B, N)), axis=1).astype(np.int32)
    return mods.document_mask(ids)


@pytest.mark.parametrize("B, H, Nq, Nk, block, docs", [(2, None, 70, 45, 16, 4),
                                                      (1, 3, 33, 64, (32, 16), 2)])
def test_states_and_lists_match_a_brute_force_evaluation(rng, B, H, Nq, Nk, block, docs):
    m, args = _doc_mask(rng, B, max(Nq, Nk), docs)
    args = (args[0][:, :Nq], args[1][:, :Nk])
    bm = create_block_mask(m, B, H, Nq, Nk, args, block_size=block)
    bq, bk = bm.block_size
    want = _brute_state(_dense(m, args, B, H or 1, Nq, Nk), B, H or 1, Nq, Nk, bq, bk)
    np.testing.assert_array_equal(bm.state, want)
    assert set(np.unique(want)) == {EMPTY, PARTIAL, FULL}   # the shapes exercise all three
    # the lists: the non-empty blocks of each row / column, ascending
    # the lists: the non-empty blocks of each row / column, ascending, as 2 * index + FULL
    for b, h, r in np.ndindex(*bm.kv_count.shape):
        cols = np.flatnonzero(want[b, h, r] != EMPTY)
        assert bm.kv_count[b, h, r] == cols.size
        np.testing.assert_array_equal(bm.kv_blocks[b, h, r, :cols.size],
                                      2 * cols + (want[b, h, r, cols] == FULL))
    for b, h, c in np.ndindex(*bm.q_count.shape):
        rows = np.flatnonzero(want[b, h, :, c] != EMPTY)
        assert bm.q_count[b, h, c] == rows.size
        np.testing.assert_array_equal(bm.q_blocks[b, h, c, :rows.size],
                                      2 * rows + (want[b, h, rows, c] == FULL))
    assert bm.counts() == tuple(int((want == s).sum()) for s in (EMPTY, PARTIAL, FULL))
    assert "empty" in repr(bm) and bm.kind == "numpy"


def test_the_gpu_filler_gives_the_cpu_fillers_states(rng):
    """The CUDA filler (one thread block per block, threads voting with syncthreads_or / _and)
    on host arrays (numba copies them): in numba's simulator here, on the GPU there."""
    from numflash import block_mask
    B, H, Nq, Nk, bq, bk = 1, 2, 37, 50, 16, 32
    args = (7, 3)
    cpu = np.full((B, H, 3, 2), -1, np.int8)
    block_mask._fill_on_cpu(_stripes, args, cpu, Nq, Nk, bq, bk)
    gpu = np.full_like(cpu, -1)
    block_mask._filler(_stripes, 2, True)[(2, 3, B * H), 128](gpu, Nq, Nk, bq, bk, *args)
    np.testing.assert_array_equal(gpu, cpu)
    want = _brute_state(_dense(_stripes, args, B, H, Nq, Nk), B, H, Nq, Nk, bq, bk)
    np.testing.assert_array_equal(cpu, want)


@pytest.mark.parametrize("by_key_block", [False, True])
def test_the_gpu_list_builder_gives_the_cpu_lists(rng, by_key_block):
    """The lists' CUDA builder (a thread per row; the same function as the CPU's) on host
    arrays: in the simulator here, on the GPU there; both against a NumPy construction."""
    from numflash import block_mask
    state = rng.choice(np.array([EMPTY, PARTIAL, FULL], np.int8), (2, 3, 5, 7))
    count, entries = block_mask._block_lists(state, by_key_block)
    rows = state.shape[3] if by_key_block else state.shape[2]
    others = state.shape[2] if by_key_block else state.shape[3]
    gpu_count = np.full_like(count, -1)
    gpu_entries = np.full_like(entries, -1)
    block_mask._lister(True)[1, 128](state, gpu_count, gpu_entries, count.size, by_key_block)
    np.testing.assert_array_equal(gpu_count, count)
    np.testing.assert_array_equal(gpu_entries, entries)
    marks = np.swapaxes(state, 2, 3) if by_key_block else state
    assert count.shape == (2, 3, rows) and entries.shape == (2, 3, rows, others)
    for b, h, r in np.ndindex(2, 3, rows):
        kept = np.flatnonzero(marks[b, h, r] != EMPTY)
        assert count[b, h, r] == kept.size
        np.testing.assert_array_equal(entries[b, h, r, :kept.size],
                                      2 * kept + (marks[b, h, r, kept] == FULL))
        assert not entries[b, h, r, kept.size:].any()


def test_bad_input_names_the_argument(rng):
    m, args = _doc_mask(rng, 2, 40)
    with pytest.raises(ValueError, match="block_size entries must be positive multiples of 16"):
        create_block_mask(m, 2, None, 40, 40, args, block_size=24)
    with pytest.raises(ValueError, match="block_size must be an int or"):
        create_block_mask(m, 2, None, 40, 40, args, block_size="big")
    with pytest.raises(ValueError, match="B must be a positive integer or None"):
        create_block_mask(m, 0, None, 40, 40, args)
    with pytest.raises(ValueError, match="Nq must be a non-negative integer"):
        create_block_mask(m, 2, None, 4.5, 40, args)
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        create_block_mask("causal", 2, None, 40, 40)
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda'"):
        create_block_mask(m, 2, None, 40, 40, args, device="tpu")
    with pytest.raises(TypeError, match="numba cannot compile the modifications"):
        create_block_mask(lambda b, h, i, j: i in [object()], 1, 1, 8, 8)
    bm = create_block_mask(m, 2, None, 40, 40, args)
    q = rng.standard_normal((2, 2, 40, 16))
    with pytest.raises(ValueError, match=r"block_mask was made for \(B, H, Nq, Nk\) = "
                                         r"\(2, 1, 40, 40\).*\(2, 2, 40, 30\)"):
        numflash.attention(q, q[:, :, :30], q[:, :, :30], block_mask=bm)
    with pytest.raises(ValueError, match="block_mask was made for"):
        numflash.attention(q[:1], q[:1], q[:1], block_mask=create_block_mask(m, 2, 2, 40, 40,
                                                                              args))
    with pytest.raises(TypeError, match="block_mask must be a numflash.BlockMask"):
        numflash.attention(q, q, q, block_mask=np.ones((2, 2, 40, 40), bool))
    with pytest.raises(TypeError, match="block_mask lives on the CPU but q is a CuPy array: "
                                        "create it with device='cuda'"):
        mods.build((2, 2, 40, 40, 16, 16), "cupy", 0, device_id=0, block_mask=bm)


@pytest.mark.extended
def test_torch_calls_take_a_block_mask_with_gradients(rng):
    """numflash.torch.attention (and numflash.attention with tensors) pass the block mask
    through, forward and backward, with the mask_mod call's results."""
    torch = pytest.importorskip("torch")
    import numflash.torch as nt
    B, H, N, d = 1, 2, 200, 16
    m, args = _doc_mask(rng, B, N)
    bm = create_block_mask(m, B, None, N, N, args, block_size=64)
    q, k, v = (torch.randn(B, H, N, d, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    got = nt.attention(q, k, v, block_mask=bm)
    want = nt.attention(q, k, v, mask_mod=m, mod_args=args)
    assert torch.equal(got, want) and torch.equal(numflash.attention(q, k, v, block_mask=bm), got)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)),
                    torch.autograd.grad(want.sum(), (q, k, v))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype, causal, H, Hkv", [
    # 20 s on 2 cores: extended; the fast tier's block-mask tests run the CPU path's tile skips
    pytest.param(np.float64, "bottom_right", 4, 2, marks=pytest.mark.extended),
    pytest.param(np.float32, False, 2, 2, marks=pytest.mark.extended),
    pytest.param(np.float16, True, 2, 1, marks=pytest.mark.extended),
])
def test_cpu_calls_equal_the_mask_mod_call_and_meet_the_rule(rng, dtype, causal, H, Hkv):
    """The CPU path with a block mask: the same result, bit for bit, as with its mask_mod (the
    skipped tiles would add nothing), forward and backward, within the rule."""
    B, Nq, Nk, d = 2, 150, 230, 24
    m, args = _doc_mask(rng, B, Nk, docs=5)
    args = (args[0][:, :Nq], args[1])
    bm = create_block_mask(m, B, None, Nq, Nk, args, block_size=32)
    assert bm.counts()[0] > 0
    q = rng.standard_normal((B, H, Nq, d)).astype(dtype)
    k, v = (rng.standard_normal((B, Hkv, Nk, d)).astype(dtype) for _ in range(2))
    do = rng.standard_normal((B, H, Nq, d)).astype(dtype)
    o1, l1 = numflash.attention(q, k, v, causal=causal, block_mask=bm, return_lse=True)
    o2, l2 = numflash.attention(q, k, v, causal=causal, mask_mod=m, mod_args=args,
                                return_lse=True)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)
    rep = testing.check(o1, q, k, v, lse=l1, causal=causal, mask_mod=m, mod_args=args)
    assert rep.ok, rep
    ref = numflash.reference.attention(q, k, v, causal=causal, block_mask=bm)
    np.testing.assert_array_equal(ref, numflash.reference.attention(q, k, v, causal=causal,
                                                                    mask_mod=m, mod_args=args))
    g1 = numflash.attention_backward(do, q, k, v, o1, l1, causal=causal, block_mask=bm)
    g2 = numflash.attention_backward(do, q, k, v, o2, l2, causal=causal, mask_mod=m,
                                     mod_args=args)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(a, b)
    testing.assert_gradients_accurate(g1, do, q, k, v, causal=causal, mask_mod=m, mod_args=args)
    plan = str(numflash.explain(q, k, v, causal=causal, block_mask=bm))
    assert "block_mask=_document_mask (32x32 blocks)" in plan and "EMPTY blocks are skipped" in plan


def _doctored(mask_mod, args, B, H, Nq, Nk, block, changes):
    """A BlockMask of ``mask_mod`` whose state has ``changes`` {(qb, kb): state} applied for
    every (b, h), and the dense mask that state describes (EMPTY: no pair, FULL: every pair,
    PARTIAL: the mask_mod's)."""
    bm = create_block_mask(mask_mod, B, H, Nq, Nk, args, block_size=block)
    state = bm.state.copy()
    for (qb, kb), st in changes.items():
        state[:, :, qb, kb] = st
    doctored = BlockMask(mask_mod, args, bm.shape, bm.block_size, state)
    dense = _dense(mask_mod, args, *bm.shape)
    bq, bk = bm.block_size
    for (qb, kb), st in changes.items():
        if st != PARTIAL:
            dense[:, :, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk] = st == FULL
    return doctored, dense


def test_the_cpu_path_skips_the_tiles_of_empty_blocks(rng):
    """A CPU tile covering only blocks marked EMPTY is skipped even where pairs would take part:
    the result is that of the mask with those blocks empty (so the skip is real)."""
    B, H, N, d = 1, 2, 1024, 16
    bm, dense = _doctored(_stripes, (5, 4), B, H, N, N, 512, {(0, 1): EMPTY})
    q, k, v = (rng.standard_normal((B, H, N, d)) for _ in range(3))
    out = numflash.attention(q, k, v, block_mask=bm)
    want = numflash.reference.attention(q, k, v, attn_mask=dense)
    assert np.abs(out - want).max() < 1e-12


def _emulated(DT, causal, extra, VEC=1, wide=False, fast=False):
    return pytest.param(DT, causal, extra, VEC, wide,
                        id=f"{DT}-{causal}-{'-'.join(extra) or 'alone'}-VEC{VEC}"
                           f"{'-wide-blocks' if wide else ''}",
                        marks=() if fast else pytest.mark.extended)


# wide: 32 x 32 blocks of two 16-key tiles (the sub-tile counter and the next tile inside a
# block) and a key pass of 32-query tiles read 16 at a time
@pytest.mark.parametrize("DT, causal, extra, VEC, wide", [
    _emulated("f64", "bottom_right", (), fast=True),
    _emulated("f64", False, ("softcap",), VEC=0),
    _emulated("f16", True, ("softcap", "window")),
    _emulated("f64", "bottom_right", ("window",), wide=True),
])
def test_mma_source_visits_the_listed_blocks_and_skips_the_mask_in_full_ones(rng, DT, causal,
                                                                             extra, VEC, wide):
    """The generated cuda.mma forward (double-buffered, VEC=1, or staged between barriers) and
    both backward passes (warp emulator) with a doctored block mask: a block marked EMPTY is
    never visited, one marked FULL takes every pair (its mask_mod is not evaluated), PARTIAL
    ones evaluate it; causal bounds and windows clip the lists. The result is attention with the
    mask the state describes (float64: to 1e-12)."""
    from mma_tools import run_backward_kernels, run_forward_kernel
    from test_mma_mods import _inputs
    B, H, Nq, Nk, d = 1, 2, 40, 56, 16
    if wide:
        B, Nq, Nk = 2, 70, 100
    bm, dense = _doctored(_stripes, (5, 3), B, H, Nq, Nk, 32 if wide else 16,
                          {(0, 1): EMPTY, (1, 2): FULL, (2, 0): EMPTY, (2, 3): FULL})
    opts = {"softcap": 4.0} if "softcap" in extra else {}
    if "window" in extra:
        opts["window_size"] = (30, 2)
    q, k, v, do = _inputs(rng, DT, B, H, H, Nq, Nk, d)
    is_causal, off = parse_causal(causal, Nq, Nk)
    built = mods.build((B, H, Nq, Nk, d, d), "numpy", off, block_mask=bm, **opts)
    out, lse = run_forward_kernel(q, k, v, DT, is_causal, off, VEC=VEC,
                                  tile=(2 if wide else 1, 16, 0), mods=built)
    want, want_lse = numflash.reference.attention(q, k, v, causal=causal, return_lse=True,
                                                  attn_mask=dense, **opts)
    rep = testing.check(out, q, k, v, lse=lse, causal=causal, attn_mask=dense, **opts)
    assert rep.ok, rep
    assert (np.isneginf(lse) == np.isneginf(want_lse)).all()
    grads = run_backward_kernels(q, k, v, do, want.astype(q.dtype),
                                 want_lse.astype(lse.dtype), DT, is_causal, off,
                                 tiles={"queries": (1, 16), "keys": (2, 32, 16) if wide
                                        else (1, 16)}, mods=built)
    rep = testing.assert_gradients_accurate(grads, do, q, k, v, causal=causal, attn_mask=dense,
                                            **opts)
    if DT == "f64":
        finite = np.isfinite(want_lse)
        assert np.abs(out - want).max() < 1e-12
        assert np.abs(lse[finite] - want_lse[finite]).max() < 1e-12
        assert max(rep.errors.values()) < 1e-12, rep


def test_block_mask_tokens_and_tiles_that_straddle_blocks_are_refused(rng):
    """The MODS token names the block mask's function and its arrays' types; a kernel tile that
    does not divide the blocks is refused with the reason (and block_size=128 suggested)."""
    from numflash.cuda.mma import mods as kernel_mods
    from test_mma_backward import HOPPER, _OnDevice, _plan, _problem
    m, args = _doc_mask(rng, 1, 256)
    bm = create_block_mask(m, 1, None, 256, 256, args, block_size=16)
    built = mods.build((1, 4, 256, 256, 64, 64), "numpy", 0, block_mask=bm, softcap=2.0)
    token = kernel_mods.token_for(built)
    assert token == ("score:softcap_score/softcap_grad[f,f]+block:document_mask"
                     "[i4/2,i4/2,i4/3,i4/4,i4/3,i4/4,i,i]")
    assert kernel_mods.sparse(token) and kernel_mods.cacheable(token)
    assert len(kernel_mods.arguments(built)) == 2 + 2 + 6   # softcap: cap and 1 / cap
    p = _OnDevice(_problem(rng, np.float16, 64, Nq=256, Nk=256, H=4))
    p.mods = built
    with pytest.raises(ValueError, match=r"block mask's 16 x 16 blocks are not whole tiles"):
        _plan(p, HOPPER, algorithm="mma")
    p.mods = mods.build((1, 4, 256, 256, 64, 64), "numpy", 0, block_mask=create_block_mask(
        m, 1, None, 256, 256, args))
    plan = _plan(p, HOPPER)
    assert plan.kernel == "cuda.mma" and "FULL blocks its mask_mod is not evaluated" in str(plan)


# ---------------------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_block_mask_equals_its_mask_mod_at_real_sizes(rng, dtype):
    """On the GPU: create_block_mask's CUDA filler gives the CPU filler's states; attention and
    its gradients with the block mask equal those with its mask_mod (same arithmetic, fewer
    tiles) and meet the rule, causal and not, with a document mask (8 documents) and GQA."""
    cupy = pytest.importorskip("cupy")
    from test_mma_backward import _kind_dtype
    B, H, Hkv, N, d = 2, 4, 2, 2048, 64
    m, (ids, _) = _doc_mask(rng, B, N, docs=8)
    dev_ids = cupy.asarray(ids)
    bm = create_block_mask(m, B, None, N, N, (dev_ids, dev_ids))
    host = create_block_mask(m, B, None, N, N, (ids, ids))
    np.testing.assert_array_equal(cupy.asnumpy(bm.state), host.state)
    assert bm.kind == "cupy" and bm.sparsity() > 0.5
    kind = _kind_dtype("bf16") if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v, do = (rng.standard_normal(s).astype(kind) for s in
                   ((B, H, N, d), (B, Hkv, N, d), (B, Hkv, N, d), (B, H, N, d)))
    qg, kg, vg, dog = (cupy.asarray(a) for a in (q, k, v, do))
    rows = np.linspace(0, N - 1, 64).astype(int)
    for causal in (False, True):
        # cuda.mma named: "auto" may take cuda.wgmma for the block mask and cuda.mma for the
        # mask_mod, whose tiles differ. num_splits=1: one share of the keys each, so the same
        # sums in the same order (split-KV deals out a block mask's listed blocks and a
        # mask_mod call's key tiles; split apart, their outputs differed in the last bits on
        # the H100, session 22)
        o1, l1 = numflash.attention(qg, kg, vg, causal=causal, block_mask=bm, return_lse=True,
                                    num_splits=1, algorithm="mma")
        o2, l2 = numflash.attention(qg, kg, vg, causal=causal, mask_mod=m, num_splits=1,
                                    mod_args=(dev_ids, dev_ids), return_lse=True,
                                    algorithm="mma")
        assert bool((o1 == o2).all()) and bool((l1 == l2).all())
        # the reference takes the GPU block mask itself (BlockMask.to_host); "auto"'s kernel too
        auto, l3 = numflash.attention(qg, kg, vg, causal=causal, block_mask=bm, return_lse=True)
        for o, lse in ((o1, l1), (auto, l3)):
            rep = testing.check(o.get(), q, k, v, lse=lse.get(), causal=causal, block_mask=bm,
                                rows=rows)
            assert rep.ok, rep
        if dtype == "float32":
            continue   # cuda.mma's backward takes 16-bit inputs
        # deterministic=True: the default adds dQ atomically, in an order that varies
        g1 = numflash.attention_backward(dog, qg, kg, vg, o1, l1, causal=causal, block_mask=bm,
                                         deterministic=True)
        g2 = numflash.attention_backward(dog, qg, kg, vg, o1, l1, causal=causal, mask_mod=m,
                                         mod_args=(dev_ids, dev_ids), deterministic=True)
        assert all(bool((a == b).all()) for a, b in zip(g1, g2))


@pytest.mark.extended
def test_block_mask_variants_compile_with_no_spills():
    """The forward and the query pass with a block mask (key padding's lists, sm_90): the list
    walk adds no spill and no per-tile 64-bit division (one at setup: the sub-tiles a block
    holds)."""
    from test_cuda_compile import run_without_simulator
    out = run_without_simulator("""
        import dataclasses, json
        import numpy as np
        from numflash import mods
        from numflash.block_mask import create_block_mask
        from numflash.cuda import launch, mma
        from numflash.cuda.mma import gradients, mods as kernel_mods

        def key_padding(b, h, i, j, lengths):
            return j < lengths[b]
        bm = create_block_mask(key_padding, 2, None, 256, 256, (np.array([200, 100]),))
        token = kernel_mods.token_for(mods.build((2, 4, 256, 256, 64, 64), "numpy", 0,
                                                 block_mask=bm))
        cfg = mma.MmaConfig(64, 64, *mma.choose_tile(64, 64, "f16", 227 * 1024, 1, (9, 0),
                                                     mods=True), "f16", 1, MODS=token)
        back = {k: dataclasses.replace(c, DT="f16", MODS=token) for k, c in
                gradients.tiles(64, 64, 227 * 1024, mods=True).items()}
        rows = []
        for kernel, sig in (mma.compiled_kernels(cfg, "float16") +
                            gradients.compiled_kernels(back, "float16")[:1]):
            cubin, entry, ptx, res = launch.compile_to_cubin(kernel.pyfunc, sig, (9, 0))
            rows.append([kernel.name, res.get("spill_store_bytes", 0) +
                         res.get("spill_load_bytes", 0), res.get("stack_bytes", 0),
                         ptx.count("ld.local") + ptx.count("st.local"),
                         ptx.count("div.s64") + ptx.count("rem.s64")])
        print(json.dumps(rows))
    """)
    import json
    rows = json.loads(out.splitlines()[-1])
    assert [r[0] for r in rows] == ["cuda.mma", "cuda.mma.backward_queries"], rows
    for name, spills, stack, local, divisions in rows:
        assert spills == stack == local == 0 and divisions <= 1, rows
