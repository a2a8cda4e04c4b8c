"""Attention dropout (numflash.dropout): the Philox-4x32-10 generator against Random123's
published answers, one mask on every backend and in the reference, its statistics (keep rate,
the 1 / (1 - p) scale), forward and backward against the float64 reference with the same mask
(the accuracy rule) on the CPU path, cuda.mma's generated source under the warp emulator and on
a GPU, the torch / flash-attn / SDPA / transformers layers, and the refusals."""
import math

import numpy as np
import pytest

import numflash
from numflash import dropout as rule
from numflash import testing
from numflash.inputs import parse_causal

U = np.uint64

# Random123's kat_vectors: philox4x32 10, counter (4 words), key (2 words) -> 4 words
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


def _inputs(rng, dtype, B, H, Hk, Nq, Nk, d, dv=None):
    dv = dv or d
    return (rng.standard_normal((B, H, Nq, d)).astype(dtype),
            rng.standard_normal((B, Hk, Nk, d)).astype(dtype),
            rng.standard_normal((B, Hk, Nk, dv)).astype(dtype),
            rng.standard_normal((B, H, Nq, dv)).astype(dtype))


# ------------------------------------------------------------------------------- the generator

@pytest.mark.parametrize("how", ["python", "numpy-arrays", "njit"])
def test_philox_gives_random123s_known_answers(how):
    if how == "njit":
        from numba import njit
        philox = rule.compiled(njit)["philox4x32_10"]
    else:
        philox = rule.philox4x32_10
    for counter, key, want in KNOWN_ANSWERS:
        args = [U(x) for x in counter + key]
        if how == "numpy-arrays":   # the reference's form: every argument an array
            args = [np.full(3, a, np.uint64) for a in args]
        got = philox(*args)
        assert [int(np.ravel(w)[-1]) for w in got] == list(want)


def test_the_mask_is_the_documented_bytes_of_philox_calls():
    """Pair (b, h, i, j) is kept when byte ((i >> 3) & 1) * 8 + ((j >> 3) & 7) of the Philox
    call at counter (j >> 6, i >> 4, h * 64 + (i & 7) * 8 + (j & 7), b), keyed by the seed's two
    words, is >= round(256 p) (numflash.dropout's docstring, written out here by hand)."""
    d = rule.build(0.37, (123 << 32) + 45)
    assert d.threshold == 95 and d.applied_p == 95 / 256 and d.scale == 256 / 161
    shape = (2, 3, 40, 150)
    mask = rule.keep_mask(d, shape)
    rng = np.random.default_rng(3)
    for _ in range(200):
        b, h, i, j = (int(rng.integers(n)) for n in shape)
        words = rule.philox4x32_10(U(j >> 6), U(i >> 4), U(h * 64 + (i & 7) * 8 + (j & 7)), U(b),
                                   U(45), U(123))
        k = ((i >> 3) & 1) * 8 + ((j >> 3) & 7)
        byte = (int(words[k // 4]) >> (8 * (k % 4))) & 255
        assert mask[b, h, i, j] == (byte >= 95), (b, h, i, j)


def test_the_cpu_tiles_and_the_compiled_keep_draw_the_reference_mask():
    """cpu.tiled's apply_dropout on tiles at any offsets and sizes, and the njit-compiled
    elementwise keep, drop exactly the pairs of the reference's keep_mask."""
    from numba import njit
    from numflash.cpu.tiled import apply_dropout
    d = rule.build(0.3, 12345)
    B, H, N, M = 2, 3, 70, 150
    mask = rule.keep_mask(d, (B, H, N, M))
    lo, hi, thr, scale = d.arguments()
    for i0, j0, rows, cols in [(0, 0, 70, 150), (5, 3, 20, 100), (16, 64, 30, 17), (7, 130, 1, 20)]:
        for b in range(B):
            for h in range(H):
                x = np.ones((rows, cols))
                apply_dropout(x, b, h, i0, j0, U(lo), U(hi), U(thr), scale)
                np.testing.assert_array_equal(x != 0, mask[b, h, i0:i0 + rows, j0:j0 + cols])
                assert set(np.unique(x)) <= {0.0, scale}
    keep = rule.compiled(njit)["keep"]
    for b, h, i, j in [(1, 2, 69, 149), (0, 0, 0, 0), (1, 0, 8, 63), (0, 1, 15, 64)]:
        assert bool(keep(U(lo), U(hi), U(thr), b, h, i, j)) == mask[b, h, i, j]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 3 / 256])
def test_keep_rate_is_one_minus_p_and_pairs_are_independent(p):
    """Over 2 x 4 x 256 x 256 pairs the kept share is 1 - p within 5 standard deviations (p is
    a multiple of 1 / 256 here); so is it among the pairs next to a kept one (same row, same
    column, and 8 apart: pairs whose bytes come from one call); each (b, h) slice differs."""
    m = rule.keep_mask(rule.build(p, 2024), (2, 4, 256, 256))
    p = rule.build(p, 2024).applied_p
    n = m.size
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(m.mean() - (1 - p)) < 5 * sigma
    for a, b in ((m[..., :, :-1], m[..., :, 1:]), (m[..., :-1, :], m[..., 1:, :]),
                 (m[..., :, :-8], m[..., :, 8:]), (m[..., :-8, :], m[..., 8:, :])):
        both = (a & b).sum() / a.sum()
        assert abs(both - (1 - p)) < 5 * math.sqrt(p * (1 - p) / a.sum())
    assert not np.array_equal(m[0, 0], m[0, 1]) and not np.array_equal(m[0, 0], m[1, 0])


def test_kept_probabilities_are_scaled_so_the_output_is_unbiased():
    """Uniform attention (q = 0) over keys whose values are 1: each output is the row's mean of
    Z = keep / (1 - p), so its mean over many rows is 1 (the 1 / (1 - p) scale) within 5 standard
    errors, while lse is the undropped log(Nk)."""
    B, H, N, p = 1, 4, 512, 0.3
    q = np.zeros((B, H, N, 8), np.float32)
    v = np.ones((B, H, N, 1), np.float32)
    out, lse = numflash.attention(q, q, v, dropout_p=p, dropout_seed=99, return_lse=True)
    p = rule.build(p, 99).applied_p   # 77 / 256
    rows = out[..., 0].astype(np.float64)
    se = math.sqrt(p / (1 - p) / N / rows.size)   # var(Z) = p / (1 - p), N keys a row
    assert abs(rows.mean() - 1) < 5 * se
    assert 0 < rows.std() < 1   # dropped: rows differ
    np.testing.assert_allclose(lse, math.log(N), rtol=1e-6)


def test_the_same_seed_gives_the_same_output_and_other_seeds_other_masks():
    rng = np.random.default_rng(0)
    q, k, v, _ = _inputs(rng, np.float32, 1, 2, 2, 40, 40, 16)
    run = (lambda seed, p=0.2: numflash.attention(q, k, v, dropout_p=p, dropout_seed=seed))
    a = run(5)
    np.testing.assert_array_equal(a, run(5))
    assert not np.allclose(a, run(6))
    assert not np.allclose(a, run(5 + (1 << 32)))      # the seed's high word counts
    assert not np.allclose(a, numflash.attention(q, k, v))


# ------------------------------------------------------------------------------- the CPU path

CPU_CASES = [  # (dtype, B, H, Hk, Nq, Nk, d, causal, p)
    pytest.param(np.float32, 2, 3, 3, 97, 65, 59, False, 0.3, id="f32-97x65-d59"),
    pytest.param(np.float64, 1, 4, 2, 33, 50, 16, "bottom_right", 0.5, id="f64-gqa-bottom-right"),
    pytest.param(np.float16, 1, 2, 1, 130, 97, 32, True, 0.1, id="f16-mqa-causal"),
    pytest.param(np.float64, 1, 2, 2, 1, 1, 1, True, 0.5, id="f64-1x1-d1"),
    pytest.param(np.float32, 1, 1, 1, 1025, 97, 111, "bottom_right", 0.25,
                 id="f32-1025x97-d111", marks=pytest.mark.extended),
    pytest.param(np.float64, 1, 2, 2, 97, 1025, 256, True, 0.75, id="f64-97x1025-d256",
                 marks=pytest.mark.extended),
]


@pytest.mark.parametrize("dtype, B, H, Hk, Nq, Nk, d, causal, p", CPU_CASES)
def test_cpu_forward_and_backward_meet_the_rule_with_the_same_mask(rng, dtype, B, H, Hk, Nq, Nk,
                                                                  d, causal, p):
    q, k, v, do = _inputs(rng, dtype, B, H, Hk, Nq, Nk, d)
    opts = dict(causal=causal, dropout_p=p, dropout_seed=int(rng.integers(2 ** 63)))
    out, lse = numflash.attention(q, k, v, return_lse=True, **opts)
    testing.assert_accurate(out, q, k, v, lse=lse, **opts)
    grads = numflash.attention_backward(do, q, k, v, out, lse, **opts)
    testing.assert_gradients_accurate(grads, do, q, k, v, **opts)
    # and it did drop: without dropout the result is another one
    if Nk > 1:
        assert np.abs(out.astype(np.float64) - numflash.attention(q, k, v, causal=causal)).max() > 0.01


def test_dropout_combines_with_modifications_and_a_window_on_the_cpu(rng):
    B, H, Nq, Nk, d = 2, 2, 40, 50, 16
    q, k, v, do = _inputs(rng, np.float32, B, H, H, Nq, Nk, d)
    opts = dict(causal=True, dropout_p=0.5, dropout_seed=7, softcap=3.0, window_size=(10, 2),
                attn_mask=rng.random((B, 1, Nq, Nk)) > 0.2)
    out, lse = numflash.attention(q, k, v, return_lse=True, **opts)
    testing.assert_accurate(out, q, k, v, lse=lse, **opts)
    grads = numflash.attention_backward(do, q, k, v, out, lse, **opts)
    testing.assert_gradients_accurate(grads, do, q, k, v, **opts)


def test_a_nan_in_a_dropped_pairs_value_reaches_only_the_rows_that_keep_it(rng):
    """v's row j holds a NaN: a query row that drops pair (i, j) gets no NaN from it (no
    0 * NaN), one that keeps it is NaN, as the reference gives; the backward likewise."""
    B, H, N, d = 1, 1, 24, 8
    q, k, v, do = _inputs(rng, np.float64, B, H, H, N, N, d)
    v[0, 0, 5, 3] = np.nan
    opts = dict(dropout_p=0.5, dropout_seed=11)
    out, lse = numflash.attention(q, k, v, return_lse=True, **opts)
    want = numflash.reference.attention(q, k, v, **opts)
    kept = rule.keep_mask(rule.build(0.5, 11), (B, H, N, N))[0, 0, :, 5]
    assert 0 < kept.sum() < N   # some rows keep key 5, some drop it
    np.testing.assert_array_equal(np.isnan(out[0, 0, :, 3]), kept)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_allclose(out[finite], want[finite], rtol=0, atol=1e-12)
    grads = numflash.attention_backward(do, q, k, v, out, lse, **opts)
    ref = numflash.reference.attention_backward(do, q, k, v, **opts)
    for g, r in zip(grads, ref):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(r))


# ------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(dropout_p=1.0, dropout_seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=-0.1, dropout_seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=float("nan"), dropout_seed=1), ValueError, r"dropout_p must be in"),
    (dict(dropout_p="x", dropout_seed=1), TypeError, "dropout_p must be a number"),
    (dict(dropout_p=0.001, dropout_seed=1), ValueError, "in steps of 1 / 256"),
    (dict(dropout_p=0.999, dropout_seed=1), ValueError, "rounds to 256 / 256"),
    (dict(dropout_p=0.1), ValueError, "dropout_p > 0 needs dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=-1), ValueError, r"dropout_seed must be in \[0, 2\*\*64\)"),
    (dict(dropout_p=0.1, dropout_seed=2 ** 64), ValueError, "dropout_seed must be in"),
    (dict(dropout_p=0.1, dropout_seed=1.5), TypeError, "dropout_seed must be an int"),
    (dict(dropout_p=0.1, dropout_seed=True), TypeError, "dropout_seed must be an int"),
])
def test_bad_dropout_arguments_raise_naming_them(kwargs, error, match):
    q = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(error, match=match):
        numflash.attention(q, q, q, **kwargs)
    with pytest.raises(error, match=match):
        numflash.attention_backward(q, q, q, q, q, np.zeros((1, 1, 4), np.float32), **kwargs)


def test_kernels_without_dropout_refuse_it_and_explain_says_so():
    """cuda.block and cuda.row have no dropout: they refuse it by name (never run without
    it); cuda.mma and the CPU path declare it; explain's plan says the mask is regenerated."""
    from numflash.kernels import operators
    from test_mma_config import _gpu, _Problem
    p = _Problem("float16", 64)
    p.dropout = rule.build(0.1, 3)
    dev = _gpu((9, 0))
    for direction, name in (("forward", "cuda.block"), ("forward", "cuda.row"),
                            ("backward", "cuda.row")):
        why = operators(direction)[name].why_not(p, dev)
        assert "has no dropout" in why and "cuda.mma" in why and "cpu.tiled" in why
    assert operators()["cuda.mma"].why_not(p, dev) is None
    assert operators("backward")["cuda.mma"].why_not(p, dev) is None
    q = np.zeros((1, 2, 64, 64), np.float32)
    plan = numflash.explain(q, q, q, dropout_p=0.1, backward=True)   # no seed needed to plan
    assert "dropout" in str(plan) and "regenerated" in str(plan)
    assert "dropout" not in str(numflash.explain(q, q, q))


# ------------------------------------------------------------------------------- cuda.mma

def _emulated_case(DT, causal, Hkv, p, mods=None, tiles=None, fast=False):
    return pytest.param(DT, causal, Hkv, p, mods, tiles, id=f"{DT}-{causal}-hkv{Hkv}-p{p}"
                        + (f"-{mods}" if mods else "") + ("-tiles" if tiles else ""),
                        marks=() if fast else pytest.mark.extended)


@pytest.mark.parametrize("DT, causal, Hkv, p, mods, tiles", [
    _emulated_case("f64", "bottom_right", 1, 0.25, fast=True),
    # 128-key forward tiles (two 64-key groups), 64-key query tiles, key sub-tiles of 16
    _emulated_case("f16", False, 2, 0.5, tiles={"forward": (2, 128, 0), "queries": (2, 64),
                                                "keys": (2, 64, 16)}),
    _emulated_case("bf16", True, 1, 0.1, "softcap-mask"),
    # key sub-tiles of 8 queries: each query's bytes drawn alone (not paired with q + 8)
    _emulated_case("3xtf32", "bottom_right", 2, 0.25, tiles={"keys": (2, 32, 8)}),
    _emulated_case("f64", True, 2, 0.6, "softcap-mask"),
])
def test_mma_dropout_source_under_the_warp_emulator(rng, DT, causal, Hkv, p, mods, tiles):
    """cuda.mma's DROP variants (forward; both backward passes, the key pass through the
    elementwise path) run by the warp emulator: the accuracy rule against the reference with the
    same mask (float64 to 1e-12, the algebra exactly)."""
    from mma_tools import run_backward_kernels, run_forward_kernel
    from test_mma_backward import _kind_dtype
    B, H, Nq, Nk, d = 1, 2, 33, 45, 32
    dtype = _kind_dtype(DT) if DT in ("f16", "bf16", "f64") else np.dtype(np.float32)
    q, k, v, do = _inputs(rng, dtype, B, H, Hkv, Nq, Nk, d)
    drop = rule.build(p, int(rng.integers(2 ** 63)))
    opts = dict(causal=causal, dropout_p=p, dropout_seed=drop.seed)
    built = None
    is_causal, off = parse_causal(causal, Nq, Nk)
    if mods:
        from numflash import mods as _mods
        mod_opts = dict(softcap=4.0, attn_mask=rng.random((B, 1, Nq, Nk)) > 0.2)
        built = _mods.build((B, H, Nq, Nk, d, d), "numpy", off, **mod_opts)
        opts.update(mod_opts)
    tiles = tiles or {}
    out, lse = run_forward_kernel(q, k, v, DT, is_causal, off, VEC=1, mods=built, dropout=drop,
                                  tile=tiles.get("forward"))
    rep = testing.check(out, q, k, v, lse=lse, **opts)
    assert rep.ok, rep
    o, ref_lse = numflash.reference.attention(q, k, v, return_lse=True, **opts)
    lse_dtype = np.float64 if DT == "f64" else np.float32
    grads = run_backward_kernels(q, k, v, do, o.astype(q.dtype), ref_lse.astype(lse_dtype), DT,
                                 is_causal, off, mods=built, dropout=drop,
                                 tiles={n: t for n, t in tiles.items() if n != "forward"} or None)
    grep = testing.assert_gradients_accurate(grads, do, q, k, v, **opts)
    if DT == "f64":
        assert rep.max_err < 1e-12 and max(grep.errors.values()) < 1e-12, (rep, grep)


def test_mma_config_and_signatures_carry_drop():
    """A problem with dropout gets DROP variants (forward; both backward passes), whose
    argument types end in the seed's words, the threshold and the scale; without dropout the
    configs are those of before (DROP left out of the mapping, so the cache keys stay)."""
    from numba import types
    from numflash.cuda import mma
    from numflash.cuda.mma import gradients
    from test_mma_config import _gpu, _Problem
    dev = _gpu((9, 0))
    p = _Problem("float16", 64)
    p.dropout = rule.build(0.1, 3)
    cfg = mma.config(p, dev)
    assert cfg.DROP == 1 and cfg["DROP"] == 1
    assert mma.signature("float16", drop=True)[-4:] == (types.int64, types.int64, types.int64,
                                                         types.float64)
    back = gradients.config(p, dev)
    assert back["queries"].DROP == back["keys"].DROP == 1
    assert gradients.signature("float16", "keys", drop=True)[-1] == types.float64
    p.dropout = None
    plain = mma.config(p, dev)
    assert plain.DROP == 0 and "DROP" not in dict(plain)


@pytest.mark.extended
def test_mma_dropout_variants_compile_with_no_spills():
    """The DROP variants the planner picks (sm_90 float16 d64 / d128 forward, sm_80 bfloat16
    d64 forward) and the d64 backward's two passes (what sm_90 takes with deterministic=True;
    without, its key pass adds dQ, whose spills bench/NOTES.md "dQ by adds with the options"
    lists), and the same d64 forward and backward of packed sequences in one launch (VARLEN):
    no spill, stack or local memory; the generator is inlined (its multiplier appears once a
    round: twice 10 in the forward's tile loop, and packed, up to 10 more in the prologue, where
    each block derives its sequence's seed)."""
    import json
    from test_cuda_compile import run_without_simulator
    code = """
        import dataclasses, json
        from numflash.cuda import launch, mma
        from numflash.cuda.mma import gradients
        SMEM = {(9, 0): 227 * 1024, (8, 0): 163 * 1024}
        rows = []
        for cc, direction, DT, d, packed in (((9, 0), "forward", "f16", 64, 0),
                                             ((9, 0), "forward", "f16", 128, 0),
                                             ((9, 0), "backward", "f16", 64, 0),
                                             ((8, 0), "forward", "bf16", 64, 0),
                                             ((9, 0), "forward", "f16", 64, 1),
                                             ((9, 0), "backward", "f16", 64, 1)):
            dtype = {"f16": "float16", "bf16": "bfloat16"}[DT]
            if direction == "backward":
                cfg = {k: dataclasses.replace(c, DT=DT, DROP=1, VARLEN=packed) for k, c in
                       gradients.tiles(d, d, SMEM[cc], False, mods=True, DT=DT, cc=cc).items()}
                kernels = gradients.compiled_kernels(cfg, dtype)
            else:
                tile = mma.choose_tile(d, d, DT, SMEM[cc], 1, cc, False)
                kernels = mma.compiled_kernels(mma.MmaConfig(d, d, *tile, DT, 1, DROP=1,
                                                             VARLEN=packed), dtype)
            for kernel, sig in kernels:
                cubin, entry, ptx, res = launch.compile_to_cubin(kernel.pyfunc, sig, cc)
                rows.append([kernel.name, d, res.get("registers", 0),
                             res.get("spill_store_bytes", 0) + res.get("spill_load_bytes", 0),
                             res.get("stack_bytes", 0),
                             ptx.count("ld.local") + ptx.count("st.local"),
                             ptx.count("3528531795")])   # Philox's first multiplier
        print(json.dumps(rows))
    """
    rows = json.loads(run_without_simulator(code).strip().splitlines()[-1])
    assert len(rows) == 8, rows
    for name, d, regs, spills, stack, local, rounds in rows:
        assert 0 < regs <= 255 and spills == stack == local == 0, rows
        assert rounds > 0, rows   # the generator is compiled in
    # the forward of 64-key tiles draws twice a tile (16 scores a call): 2 calls x 10 rounds;
    # packed, one more call derives the sequence's seed in the prologue (29 seen with NVVM of
    # numba-cuda 0.30: its first product, of a 32-bit index, is written another way)
    assert rows[0][-1] == 20 and 20 < rows[5][-1] <= 30, rows


#: spill-store bytes ptxas (this machine's nvJitLink, sm_90) gives the f16 d64 dropout key pass
#: with dQ adds, what sm_90 runs without deterministic=True: unpacked 64 (bench/NOTES.md "dQ by
#: adds with the options" saw 128 on the H100's), packed (VARLEN) 120 (session 32); the adds
#: were still faster than the two passes with dropout (1.21-1.39x, H100)
DQADD_DROP_SPILLS = {0: 64, 1: 120}


@pytest.mark.extended
def test_mma_dropout_key_pass_with_dq_adds_compiles_within_its_known_spills():
    """The dropout key pass sm_90 runs by default (dQ added by the key pass), unpacked and
    packed: the generator compiled in, spills no more than DQADD_DROP_SPILLS records."""
    import json
    from test_cuda_compile import run_without_simulator
    code = """
        import dataclasses, json
        from numflash.cuda import launch
        from numflash.cuda.mma import gradients
        SMEM = 227 * 1024
        rows = []
        for packed in (0, 1):
            cfg = {k: dataclasses.replace(c, DT="f16", DROP=1, VARLEN=packed) for k, c in
                   gradients.tiles(64, 64, SMEM, False, mods=True, DT="f16", cc=(9, 0)).items()}
            cfg = gradients.with_dq_adds(cfg, "red4", SMEM)
            kernel, sig = gradients.compiled_kernels(cfg, "float16")[1]   # the key pass
            cubin, entry, ptx, res = launch.compile_to_cubin(kernel.pyfunc, sig, (9, 0))
            rows.append([packed, res.get("registers", 0), res.get("spill_store_bytes", 0),
                         ptx.count("red.global.add.v4.f32"), ptx.count("3528531795")])
        print(json.dumps(rows))
    """
    rows = json.loads(run_without_simulator(code).strip().splitlines()[-1])
    assert len(rows) == 2, rows
    for packed, regs, spills, adds, rounds in rows:
        assert 0 < regs <= 255 and adds > 0 and rounds > 0, rows
        assert spills <= DQADD_DROP_SPILLS[packed], rows


GPU_CASES = [  # (dtype, B, H, Hk, Nq, Nk, d, causal, p)
    ("float16", 2, 8, 8, 1024, 1024, 64, True, 0.1),
    ("bfloat16", 1, 8, 2, 777, 1025, 128, "bottom_right", 0.3),
    ("float32", 1, 4, 4, 513, 700, 64, False, 0.5),
    ("float64", 1, 4, 2, 300, 257, 64, True, 0.2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, B, H, Hk, Nq, Nk, d, causal, p", GPU_CASES)
def test_gpu_mma_dropout_forward_and_backward_at_real_sizes(dtype, B, H, Hk, Nq, Nk, d, causal,
                                                           p):
    """On the GPU: cuda.mma forward and backward with dropout against the reference with the
    same mask (the accuracy rule), the plan being cuda.mma's DROP variants, the same result
    for the same seed, and the CPU path's mask (the output of both within the rule)."""
    import cupy
    from test_mma_backward import _kind_dtype
    rng = np.random.default_rng(1)
    dt = _kind_dtype("bf16") if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v, do = _inputs(rng, dt, B, H, Hk, Nq, Nk, d)
    opts = dict(causal=causal, dropout_p=p, dropout_seed=int(rng.integers(2 ** 63)))
    dq_, dk_, dv_, ddo = (cupy.asarray(a) for a in (q, k, v, do))
    plan = numflash.explain(dq_, dk_, dv_, **opts)
    assert plan.kernel == "cuda.mma" and plan.config.DROP == 1
    out, lse = numflash.attention(dq_, dk_, dv_, return_lse=True, **opts)
    again = numflash.attention(dq_, dk_, dv_, **opts)
    assert bool((out == again).all())
    testing.assert_accurate(out, q, k, v, lse=lse, **opts)
    grads = numflash.attention_backward(ddo, dq_, dk_, dv_, out, lse, **opts)
    testing.assert_gradients_accurate([g.get() for g in grads], do, q, k, v, **opts)
