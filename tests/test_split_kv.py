"""Split-KV: cuda.mma's SPLIT variant (each query block's key tiles dealt out over grid z, partial
results written as floats) and cuda.merge (the partials combined in one launch).

The generated SPLIT source runs under the warp emulator here, its partials merged by
numflash.merge_partials (an independent NumPy implementation of the merge rule) and checked
against the float64 reference by the accuracy rule, with shares left empty by causal masking,
windows and more shares than tiles. The merge kernel's source runs in numba's simulator against
merge_partials, -inf and NaN shares included. The split count's choice, explain's line, the
option's checks and refusals run on the CPU; GPU tests at decode sizes are marked."""
import math

import numpy as np
import pytest

import numflash
from numflash.inputs import parse_causal
from numflash.testing import check

SPLIT_CASES = [  # (DT, B, H, Hk, Nq, Nk, d, causal, window, splits, VEC, tile, empty shares)
    pytest.param("f16", 1, 2, 1, 5, 150, 64, "bottom_right", None, 3, 1, (2, 32, 1), False,
                 id="f16-decode-gqa-bottom_right"),
    # one warp a block (BR 16): the decode tile bench/decode.py --tiles times against (4, 64, 1)
    pytest.param("f16", 1, 2, 2, 1, 300, 128, False, None, 3, 1, (1, 64, 1), False,
                 id="f16-decode-d128-one-warp", marks=pytest.mark.extended),   # ~65 s
    pytest.param("f64", 1, 1, 1, 40, 90, 32, True, None, 4, 0, (2, 16, 0), True,
                 id="f64-causal-empty-shares"),
    pytest.param("3xtf32", 1, 1, 1, 33, 100, 32, False, (20, 5), 7, 1, (2, 16, 0), True,
                 id="3xtf32-window-more-shares-than-tiles"),
]


def _inputs(rng, DT, B, H, Hk, Nq, Nk, d):
    dtype = {"f16": np.float16, "f64": np.float64}.get(DT, np.float32)
    q = rng.standard_normal((B, H, Nq, d)).astype(dtype)
    k, v = (rng.standard_normal((B, Hk, Nk, d)).astype(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("DT, B, H, Hk, Nq, Nk, d, causal, window, splits, VEC, tile, empty_shares",
                         SPLIT_CASES)
def test_split_source_emulated_on_cpu(rng, DT, B, H, Hk, Nq, Nk, d, causal, window, splits, VEC,
                                      tile, empty_shares):
    """Each share's partial is the attention over its keys; merged, they are the attention over
    all keys (accuracy rule against the float64 reference, lse too), equal to the unsplit
    kernel's result to rounding."""
    from mma_tools import run_forward_kernel
    from numflash.reference import attention as ref
    q, k, v = _inputs(rng, DT, B, H, Hk, Nq, Nk, d)
    is_causal, off = parse_causal(causal, Nq, Nk)
    part, part_lse = run_forward_kernel(q, k, v, DT, is_causal, off, VEC=VEC, tile=tile,
                                        window=window, splits=splits)
    assert not np.isnan(part).any() and not np.isnan(part_lse).any()   # every share wrote
    assert np.isneginf(part_lse).any() == empty_shares   # shares no key of a row falls in
    out, lse = numflash.merge_partials(list(part), list(part_lse))
    opts = {} if window is None else {"window_size": window}
    rep = check(out.astype(q.dtype), q, k, v, causal=causal, **opts)
    assert rep.ok, str(rep)
    _, ref_lse = ref(q, k, v, causal=causal, return_lse=True, **opts)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty)
    assert np.allclose(lse[~empty], ref_lse[~empty], rtol=1e-5, atol=1e-5)
    whole, whole_lse = run_forward_kernel(q, k, v, DT, is_causal, off, VEC=VEC, tile=tile,
                                          window=window)
    tol = 2e-3 if DT == "f16" else (1e-12 if DT == "f64" else 1e-5)
    np.testing.assert_allclose(out.astype(np.float64), whole.astype(np.float64), atol=tol)


@pytest.mark.parametrize("causal, window, VEC, block, tile, splits", [
    pytest.param("bottom_right", None, 1, 32, (2, 16, 0), 3,
                 id="double-buffered-two-tiles-a-block"),
    pytest.param(False, (40, 10), 0, 16, (1, 16, 0), 9,
                 id="staged-window-more-shares-than-blocks"),
])
def test_split_source_deals_out_a_block_masks_listed_blocks(rng, causal, window, VEC, block,
                                                            tile, splits):
    """With a block mask each share walks a run of the listed blocks, whole (a block is never
    cut between shares): EMPTY blocks unvisited, FULL ones unmasked, PARTIAL ones through the
    mask_mod; a window clips the list; merged, the shares give the unsplit kernel's result
    (float64: to 1e-12) and the attention with the mask the state describes (a row seeing
    nothing: zeros, lse -inf)."""
    from mma_tools import run_forward_kernel
    from numflash import mods
    from numflash.block_mask import EMPTY, FULL
    from test_block_mask import _doctored, _stripes
    B, H, Nq, Nk, d = 2, 2, 70, 100, 16
    q, k, v = _inputs(rng, "f64", B, H, H, Nq, Nk, d)
    changes = {(0, 1): EMPTY, (1, 2): FULL, (2, 0): EMPTY, (1, 0): EMPTY}
    bm, dense = _doctored(_stripes, (5, 3), B, H, Nq, Nk, block, changes)
    is_causal, off = parse_causal(causal, Nq, Nk)
    opts = {} if window is None else {"window_size": window}
    built = mods.build((B, H, Nq, Nk, d, d), "numpy", off, block_mask=bm, **opts)
    part, part_lse = run_forward_kernel(q, k, v, "f64", is_causal, off, VEC=VEC, tile=tile,
                                        mods=built, splits=splits)
    assert not np.isnan(part).any() and not np.isnan(part_lse).any()   # every share wrote
    if splits > -(-Nk // block):   # shares past the listed blocks: empty for every row
        assert np.isneginf(part_lse[-1]).all()
    out, lse = numflash.merge_partials(list(part), list(part_lse))
    whole, whole_lse = run_forward_kernel(q, k, v, "f64", is_causal, off, VEC=VEC, tile=tile,
                                          mods=built)
    assert np.abs(out - whole).max() < 1e-12
    assert np.array_equal(np.isneginf(lse), np.isneginf(whole_lse))
    finite = np.isfinite(whole_lse)
    assert np.abs(lse[finite] - whole_lse[finite]).max() < 1e-12
    rep = check(out, q, k, v, lse=lse, causal=causal, attn_mask=dense, **opts)
    assert rep.ok, str(rep)


def test_split_source_is_a_separate_variant():
    """SPLIT=0 is left out of the config's mapping (the plain kernel's cache keys and shipped
    PTX stay); SPLIT=1 writes partials indexed by blockIdx.z over a run of the key tiles."""
    from numflash.cuda.mma import MmaConfig, kernel_source
    plain = MmaConfig(64, 64, 4, 64, 1, "f16", 1)
    split = MmaConfig(64, 64, 4, 64, 1, "f16", 1, SPLIT=1)
    assert "SPLIT" not in dict(plain) and dict(split)["SPLIT"] == 1
    assert "blockIdx.z" not in kernel_source(plain)
    src = kernel_source(split)
    for piece in ("oh = out[U(cuda.blockIdx.z), b, h]", "lse[U(cuda.blockIdx.z), b, h, ru]",
                  "split_per = (split_tiles + split_n - 1) // split_n",
                  "t_first = split_first // 64"):
        assert piece in src, piece


# ---------------------------------------------------------------------------- the merge kernel

def _merge_in_simulator(part, part_lse, OUT):
    """cuda.merge's generated source run by numba's simulator, with the emulator's conversions
    for 16-bit outputs (the PTX ones run on the GPU)."""
    from mma_tools import pack_bf16x2, pack_f16x2
    from numba import cuda
    from numflash.cuda import merge
    real = np.float64 if OUT == "f64" else np.float32
    ns = {"cuda": cuda, "math": math, "I": np.int64, "U": np.uint64, "uint16": np.uint16,
          "ZERO": real(0), "NEG_INF": real(-np.inf), "NAN": real(np.nan),
          "pack_f16x2": pack_f16x2, "pack_bf16x2": pack_bf16x2}
    exec(merge.kernel_source(OUT), ns)  # noqa: S102 - the package's generated source
    S, B, H, Nq, dv = part.shape
    bits = OUT in ("f16", "bf16")
    out = np.full((B, H, Nq, dv), 0xFFFF if bits else np.nan, np.uint16 if bits else real)
    lse = np.full((B, H, Nq), 7.0, real)
    n = out.size
    cuda.jit(ns["merge_splits"])[(n + 63) // 64, 64](part, part_lse, out, lse)
    return out, lse


@pytest.mark.parametrize("OUT", ["f32", "f64", "f16", "bf16"])
def test_merge_kernel_follows_merge_partials(rng, OUT):
    """Per row: ordinary shares, a share with no key (-inf), a row no share saw (zeros, -inf),
    a share with a NaN lse (the row NaN), and lse values far apart (no overflow)."""
    real = np.float64 if OUT == "f64" else np.float32
    S, B, H, Nq, dv = 3, 1, 2, 5, 6
    part = rng.standard_normal((S, B, H, Nq, dv)).astype(real)
    part_lse = rng.standard_normal((S, B, H, Nq)).astype(real)
    part_lse[1, 0, 0, 1] = -np.inf                 # one share empty
    part_lse[:, 0, 0, 2] = -np.inf                 # the row saw no key
    part[:, 0, 0, 2] = 0
    part_lse[2, 0, 1, 3] = np.nan                  # a NaN score in one share
    part_lse[:, 0, 1, 4] = (700.0, -50.0, 699.0)   # exp(lse) would overflow float32
    out, lse = _merge_in_simulator(part, part_lse, OUT)
    want, want_lse = numflash.merge_partials(list(part), list(part_lse))
    if OUT == "f16":
        out, want = out.view(np.float16), want.astype(np.float16)
    elif OUT == "bf16":
        ml = pytest.importorskip("ml_dtypes")
        out, want = out.view(ml.bfloat16), want.astype(ml.bfloat16)
    rtol = 1e-12 if OUT == "f64" else 1e-6
    np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64), rtol=rtol,
                               atol=rtol)
    np.testing.assert_allclose(lse, want_lse, rtol=rtol)
    assert np.isnan(out[0, 1, 3]).all() and np.isnan(lse[0, 1, 3])
    assert (out[0, 0, 2] == 0).all() and np.isneginf(lse[0, 0, 2])


# ------------------------------------------------------------------ the choice and the option

def _problem(B, H, Nq, Nk, d=128, dtype=np.float16, num_splits=None, **mods):
    from numflash.api import _with_mods
    from numflash.inputs import normalize
    q = np.zeros((B, H, Nq, d), dtype)
    k = np.zeros((B, H, Nk, d), dtype)
    return _with_mods(normalize(q, k, k, num_splits=num_splits), mods)


def _h100():
    from numflash.device import Device
    return Device(name="H100 (planning)", cc=(9, 0), smem_per_block_optin=227 * 1024,
                  sm_count=132)


@pytest.mark.parametrize("B, H, Nq, Nk, want", [
    (1, 32, 1, 131072, "split"),       # decode: 32 query blocks for 528 block slots
    (1, 32, 16, 131072, "split"),
    (1, 40, 1, 131072, "split"),       # 13 shares: 520 blocks; 14 would leave a second wave
    (8, 32, 1, 4096, "split"),          # 256 blocks < 528 slots, 64 key tiles
    (4, 32, 4096, 4096, 1),             # training sizes fill the GPU
    (1, 1, 1, 100, 1),                  # too few key tiles to share
])
def test_split_count_fills_the_gpu(B, H, Nq, Nk, want):
    from numflash.cuda.mma import config
    from numflash.cuda.mma.config import (MAX_SPLITS, MIN_SPLIT_TILES, SPLIT_SLOTS_PER_SM,
                                          split_count)
    dev = _h100()
    p = _problem(B, H, Nq, Nk)
    cfg = config(p, dev)
    n = split_count(p, cfg, dev)
    if want == 1:
        assert n == 1 and not cfg.SPLIT
    else:
        blocks = -(-Nq // cfg.BR) * B * H
        assert cfg.SPLIT and 1 < n <= MAX_SPLITS
        assert n * blocks >= 2 * dev.sm_count or n == -(-Nk // cfg.BC) // MIN_SPLIT_TILES
        slots = SPLIT_SLOTS_PER_SM * dev.sm_count   # one wave: no share left to a second
        assert n * blocks <= slots < (n + 1) * blocks or n == MAX_SPLITS \
            or n == -(-Nk // cfg.BC) // MIN_SPLIT_TILES
        assert -(-Nk // cfg.BC) // n >= MIN_SPLIT_TILES


def test_a_kv_cache_plans_its_split_from_the_capacity():
    """config() decides on the split variant from a KV cache's capacity (plans are memoized
    without the lengths, and a decode loop's cache fills), while each launch's share count
    follows the longest entry's keys: one share for a short cache, as many as fill the GPU for a
    full one."""
    from numflash.cuda.mma import config
    from numflash.cuda.mma.config import split_count
    from numflash.kvcache import KVCache
    dev = _h100()
    p = _problem(1, 32, 1, 131072)
    cfg = config(p, dev)
    full = split_count(p, cfg, dev)
    assert cfg.SPLIT and full > 1
    for max_len, want in ((100, 1), (131072, full)):
        p.kvcache = KVCache(np.array([max_len], np.int32), None, None, max_len)
        assert split_count(p, cfg, dev) == want
        assert split_count(p, cfg, dev, in_use=False) == full


def test_forced_and_refused_splits():
    """num_splits forces the count (1: never; at most a share per key tile); a GPU of unknown
    size never splits on its own; a block mask splits like the rest."""
    from numflash.cuda.mma import config
    from numflash.cuda.mma.config import split_count
    from numflash.device import Device
    dev = _h100()
    for forced in (1, 5, 300):   # 4096 keys: 64 tiles, a share per tile at most
        p = _problem(1, 2, 1, 4096, num_splits=forced)
        cfg = config(p, dev)
        assert split_count(p, cfg, dev) == min(forced, 64) and bool(cfg.SPLIT) == (forced > 1)
    unknown = Device(name="sm_90", cc=(9, 0), smem_per_block_optin=227 * 1024)
    p = _problem(1, 2, 1, 131072)
    assert split_count(p, config(p, unknown), unknown) == 1
    # a block mask splits as the others do (its shares deal out the listed blocks)
    bm = numflash.create_block_mask(lambda b, h, i, j: j <= i + 200, None, None, 1, 4096)
    p = _problem(1, 2, 1, 4096, block_mask=bm)
    assert config(p, dev).SPLIT and split_count(p, config(p, dev), dev) > 1
    assert config(_problem(1, 2, 1, 4096, num_splits=2, block_mask=bm), dev).SPLIT


def test_explain_says_the_split():
    from numflash.plan import _choose
    dev = _h100()
    plan = _choose(_problem(1, 32, 1, 131072), "cuda", "auto", device=dev)
    text = str(plan)
    assert plan.config["SPLIT"] == 1 and "split-KV: each query block's keys in" in text
    assert "32 query blocks for 132 SMs" in text
    plan = _choose(_problem(1, 32, 1, 131072, num_splits=3), "cuda", "auto", device=dev)
    assert "in 3 shares (num_splits was given)" in str(plan)
    assert "split-KV" not in str(_choose(_problem(4, 32, 4096, 4096), "cuda", "auto",
                                         device=dev))
    bm = numflash.create_block_mask(lambda b, h, i, j: j <= i + 200, None, None, 1, 131072)
    plan = _choose(_problem(1, 32, 1, 131072, block_mask=bm), "cuda", "auto", device=dev)
    assert plan.kernel == "cuda.mma" and plan.config["SPLIT"] == 1, str(plan)
    assert "with the block mask each share takes a run of the listed blocks" in str(plan)


# ---- the CPU path's split (numflash.cpu.tiled: key blocks in runs over the threads)

CPU_SPLIT_CASES = [  # (dtype, H, Hk, Nq, Nk, d, options): runs of 512 (float64: 256) keys
    (np.float32, 1, 1, 1, 3000, 64, {}),
    (np.float64, 4, 2, 1, 2000, 59, dict(causal="bottom_right")),
    (np.float16, 2, 1, 3, 1500, 16, dict(causal=True)),             # runs past row 2's keys
    (np.float32, 2, 2, 2, 2100, 32, dict(window_size=(700, 0), causal="bottom_right",
                                          softcap=4.0)),              # the modification path
    (np.float32, 1, 1, 1, 1800, 8, dict(dropout_p=0.25, dropout_seed=3)),   # run_tasks' threads
]


@pytest.mark.parametrize("case", CPU_SPLIT_CASES, ids=lambda c: f"{np.dtype(c[0]).name}-"
                         f"H{c[1]}-Hk{c[2]}-Nq{c[3]}-{'-'.join(c[6]) or 'plain'}")
@pytest.mark.parametrize("splits", [3, 16])   # 16: more runs than key blocks, some empty
def test_cpu_split_runs_meet_the_rule_and_equal_one_run(rng, monkeypatch, case, splits):
    from numflash import plan
    from numflash.cpu import tiled
    dtype, H, Hk, Nq, Nk, d, opts = case
    q = rng.standard_normal((1, H, Nq, d)).astype(dtype)
    k, v = (rng.standard_normal((1, Hk, Nk, d)).astype(dtype) for _ in range(2))
    outs = {}
    for n in (1, splits):
        monkeypatch.setattr(tiled, "split_count", lambda tasks, blocks, threads, n=n: n)
        plan._plans.clear()
        assert numflash.explain(q, k, v, **opts).config["splits"] == n
        outs[n] = numflash.attention(q, k, v, return_lse=True, **opts)
    plan._plans.clear()
    if "dropout_p" not in opts:
        rep = check(outs[splits][0], q, k, v, lse=outs[splits][1], **opts)
        assert rep.ok, str(rep)
    tol = 1e-12 if dtype == np.float64 else (2e-3 if dtype == np.float16 else 1e-5)
    for one, split in zip(outs[1], outs[splits]):
        np.testing.assert_allclose(split.astype(np.float64), one.astype(np.float64), atol=tol)


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_split_with_batches_and_query_blocks(rng, causal):
    """Forced runs on a call of two batch entries and several query blocks each (causal: the
    blocks' key ranges differ): every (entry, head, block, run) lands where the merge reads
    it, equal to one run and within the rule."""
    q = rng.standard_normal((2, 3, 300, 16))
    k, v = (rng.standard_normal((2, 3, 1100, 16)) for _ in range(2))
    assert numflash.explain(q, k, v, causal=causal, num_splits=3).config["block_q"] < 300
    one = numflash.attention(q, k, v, causal=causal, num_splits=1, return_lse=True)
    three = numflash.attention(q, k, v, causal=causal, num_splits=3, return_lse=True)
    assert check(three[0], q, k, v, lse=three[1], causal=causal).ok
    for a, b in zip(one, three):
        np.testing.assert_allclose(b, a, atol=1e-12)


def test_cpu_split_count_gives_each_thread_two_tasks():
    from numflash.cpu.tiled import split_count
    assert split_count(tasks=1, key_blocks=128, threads=2) == 4
    assert split_count(tasks=3, key_blocks=128, threads=16) == 11
    assert split_count(tasks=1, key_blocks=2, threads=8) == 2   # a run a block at most
    assert split_count(tasks=2, key_blocks=128, threads=2) == 1   # the threads are full
    assert split_count(tasks=0, key_blocks=128, threads=2) == 1   # no query rows


def test_num_splits_checks_and_other_backends(rng):
    q = rng.standard_normal((1, 2, 3, 16)).astype(np.float32)
    for bad, err in ((0, ValueError), (70000, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(err, match="num_splits"):
            numflash.attention(q, q, q, num_splits=bad)
    with pytest.raises(ValueError, match="cuda.block does not split the keys"):
        numflash.explain(q, q, q, num_splits=2, backend="cuda", algorithm="block")
    long = rng.standard_normal((1, 2, 1500, 16)).astype(np.float32)
    for n, runs in ((2, 2), (7, 3)):   # the CPU path: at most a run a key block (of 512)
        assert numflash.explain(q, long, long, num_splits=n).config["splits"] == runs
        assert check(numflash.attention(q, long, long, num_splits=n), q, long, long).ok
    with pytest.raises(ValueError, match="forward option"):
        numflash.explain(q, q, q, backward=True, num_splits=2)
    out = numflash.attention(q, q, q, num_splits=1)   # 1 runs anywhere
    assert check(out, q, q, q).ok


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_gpu_split_kv_at_decode_sizes(rng, dtype):
    """Decode (Nq 1 and 16, GQA) and a causal prefill chunk on the GPU, split automatically and
    forced (1, 3, 64 shares, and more shares than key tiles), against the float64 reference;
    a NaN in one key poisons exactly the rows that see it."""
    cupy = pytest.importorskip("cupy")
    dt = np.dtype(pytest.importorskip("ml_dtypes").bfloat16) if dtype == "bfloat16" else dtype
    d = 64 if dtype == "float64" else 128
    for (B, H, Hk, Nq, Nk, causal) in ((2, 8, 2, 1, 20000, False),
                                       (1, 4, 4, 16, 9000, "bottom_right"),
                                       (1, 2, 1, 100, 3000, True)):
        q = cupy.asarray(rng.standard_normal((B, H, Nq, d)).astype(dt))
        k, v = (cupy.asarray(rng.standard_normal((B, Hk, Nk, d)).astype(dt)) for _ in range(2))
        for splits in (None, 1, 3, 64, 4096):
            plan = numflash.explain(q, k, v, causal=causal, num_splits=splits)
            # one share is no split: on sm_90 the 16-bit forward is cuda.wgmma's then
            assert plan.kernel == "cuda.mma" or splits == 1, str(plan)
            out, lse = numflash.attention(q, k, v, causal=causal, num_splits=splits,
                                          return_lse=True)
            rep = check(out, q, k, v, lse=lse, causal=causal)
            assert rep.ok, f"{(B, H, Nq, Nk, causal, splits)}: {rep}"
    q = cupy.asarray(rng.standard_normal((2, 4, 1, d)).astype(dt))
    k, v = (cupy.asarray(rng.standard_normal((2, 2, 5000, d)).astype(dt)) for _ in range(2))
    k[0, 0, 123, 0] = np.nan   # batch 0, K/V head 0: its query heads 0 and 1 read it
    out = numflash.attention(q, k, v, num_splits=8).get().astype(np.float64)
    assert np.isnan(out[0, :2]).all() and not np.isnan(out[0, 2:]).any()
    assert not np.isnan(out[1]).any()


def _key_padding(b, h, i, j, lengths):
    return j < lengths[b]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_gpu_split_kv_with_a_block_mask_at_decode_sizes(rng, dtype):
    """Decode with a key-padding block mask (each batch entry's own length, blocks of 128 and
    256): split automatically and forced, against the float64 reference with the same mask and
    the unsplit call (to rounding)."""
    cupy = pytest.importorskip("cupy")
    B, H, Hk, Nk, d = 3, 8, 2, 20000, 64
    lengths = np.array([20000, 12345, 300])
    for Nq, causal, block in ((1, False, 128), (16, "bottom_right", 256)):
        q = cupy.asarray(rng.standard_normal((B, H, Nq, d)).astype(dtype))
        k, v = (cupy.asarray(rng.standard_normal((B, Hk, Nk, d)).astype(dtype))
                for _ in range(2))
        bm = numflash.create_block_mask(_key_padding, B, None, Nq, Nk,
                                        (cupy.asarray(lengths),), block_size=block)
        whole = numflash.attention(q, k, v, causal=causal, block_mask=bm, num_splits=1)
        for splits in (None, 5, 4096):
            plan = numflash.explain(q, k, v, causal=causal, block_mask=bm, num_splits=splits)
            assert plan.kernel == "cuda.mma" and plan.config.SPLIT, str(plan)
            out, lse = numflash.attention(q, k, v, causal=causal, block_mask=bm,
                                          num_splits=splits, return_lse=True)
            rep = check(out, q, k, v, lse=lse, causal=causal, block_mask=bm)
            assert rep.ok, f"{(Nq, causal, block, splits)}: {rep}"
            tol = 1e-12 if dtype == "float64" else 8e-3   # float16: two ulps below 8
            assert float(abs(out.astype(np.float64) - whole.astype(np.float64)).max()) < tol


@pytest.mark.gpu
def test_gpu_split_kv_calls_replay(rng, monkeypatch):
    """A repeated split-KV call replays both launches (cuda/fastpath.py), reusing its partials
    on the recording's stream and allocating new ones on another: every result is right."""
    cupy = pytest.importorskip("cupy")
    from numflash import api
    shape = ((1, 8, 2, 128), (1, 8, 7000, 128))

    def inputs():
        q = cupy.asarray(rng.standard_normal(shape[0]).astype(np.float16))
        return (q,) + tuple(cupy.asarray(rng.standard_normal(shape[1]).astype(np.float16))
                            for _ in range(2))
    numflash.attention(*inputs(), num_splits=6)
    full_path = []
    original = api.normalize
    monkeypatch.setattr(api, "normalize",
                        lambda *a, **kw: full_path.append(1) or original(*a, **kw))
    calls = [inputs() for _ in range(3)]
    outs = [numflash.attention(*qkv, num_splits=6) for qkv in calls]
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    with stream:
        outs.append(numflash.attention(*calls[0], num_splits=6))
    stream.synchronize()
    assert full_path == []
    for out, (q, k, v) in zip(outs, calls + calls[:1]):
        rep = check(out, q, k, v)
        assert rep.ok, str(rep)
