"""io_model against hand-computed numbers, and its qualitative claims."""
import math

import pytest

from numflash import io_model


def test_small_case_by_hand():
    # N=4, d=2, 4-byte floats, 2x2 blocks, one (batch, head):
    # standard = 4 * (4*4*2 + 4*4*4)            = 4 * (32 + 64)       = 384
    # kv_passes = ceil(4 / 2)                   = 2
    # tiled    = 4 * (2*4*2 + 2*4*2*2) + 4*4    = 4 * (16 + 32) + 16  = 208
    # peaks: standard 2*4*4*4 + 4*2*4 = 128 + 32 = 160; tiled 4*2*4 + 4*4 = 32 + 16 = 48
    r = io_model(4, 2, dtype_bytes=4, block_rows=2, block_cols=2)
    assert r["standard_bytes"] == 384
    assert r["tiled_bytes"] == 208
    assert r["ratio"] == pytest.approx(384 / 208)
    assert r["kv_passes"] == 2
    assert (r["block_rows"], r["block_cols"]) == (2, 2)
    assert r["standard_peak_bytes"] == 160
    assert r["tiled_peak_bytes"] == 48


def test_causal_case_by_hand():
    # N=8, d=2, 2-byte floats, 2x2 blocks, causal (half the scores, half the K/V passes):
    # standard = 2 * (4*8*2 + 4*64*0.5)          = 2 * (64 + 128)      = 384
    # kv_passes = ceil(8/2) * 0.5                = 2
    # tiled    = 2 * (2*8*2 + 2*8*2*2) + 4*8     = 2 * (32 + 64) + 32  = 224
    r = io_model(8, 2, dtype_bytes=2, block_rows=2, block_cols=2, causal=True)
    assert r["standard_bytes"] == 384
    assert r["kv_passes"] == 2
    assert r["tiled_bytes"] == 224
    assert r["standard_peak_bytes"] == 2 * 64 * 2 + 8 * 2 * 2
    assert r["tiled_peak_bytes"] == 8 * 2 * 2 + 4 * 8


def test_single_block_reads_kv_once_even_when_causal():
    # N <= block_rows: one pass; causal would make it 0.5 but K/V are still read once.
    r = io_model(3, 4, dtype_bytes=4, block_rows=4, block_cols=4, causal=True)
    assert r["kv_passes"] == 0.5
    assert r["tiled_bytes"] == 4 * (2 * 3 * 4 + 2 * 3 * 4 * 1) + 4 * 3


def test_blocks_derived_from_sram():
    # block_cols = ceil(M / (4 d e)), block_rows = min(block_cols, d)
    r = io_model(256, 16, sram_bytes=4096, dtype_bytes=4)
    assert r["block_cols"] == 16 and r["block_rows"] == 16
    r = io_model(256, 16, sram_bytes=1000, dtype_bytes=4)
    assert r["block_cols"] == math.ceil(1000 / 256) == 4 and r["block_rows"] == 4
    r = io_model(256, 8, sram_bytes=100 * 1024, dtype_bytes=2)
    assert r["block_cols"] == 1600 and r["block_rows"] == 8
    # an explicit block_rows wins over the derived one
    r = io_model(256, 8, sram_bytes=100 * 1024, dtype_bytes=2, block_rows=4)
    assert r["block_rows"] == 4 and r["kv_passes"] == 64


def test_batch_and_heads_scale_linearly():
    one = io_model(64, 8, dtype_bytes=2, block_rows=8, block_cols=16)
    many = io_model(64, 8, dtype_bytes=2, block_rows=8, block_cols=16, batch=2, heads=3)
    for key in ("standard_bytes", "tiled_bytes", "standard_peak_bytes", "tiled_peak_bytes"):
        assert many[key] == 6 * one[key]
    assert many["ratio"] == pytest.approx(one["ratio"])
    assert many["kv_passes"] == one["kv_passes"]


@pytest.mark.parametrize("d,e", [(64, 2), (128, 2), (64, 4)])
def test_tiled_moves_less_than_standard_for_long_sequences(d, e):
    for N in (1024, 4096, 16384):
        r = io_model(N, d, sram_bytes=100 * 1024, dtype_bytes=e)
        assert r["tiled_bytes"] < r["standard_bytes"]
        assert r["ratio"] > 1
        assert r["tiled_peak_bytes"] < r["standard_peak_bytes"]


@pytest.mark.parametrize("causal", [False, True])
def test_ratio_grows_with_n(causal):
    ratios = [io_model(N, 64, sram_bytes=100 * 1024, dtype_bytes=2, causal=causal)["ratio"]
              for N in (128, 256, 512, 1024, 2048, 4096, 8192)]
    assert all(a < b for a, b in zip(ratios, ratios[1:])), ratios


def test_peak_memory_quadratic_vs_linear():
    small = io_model(1024, 64, dtype_bytes=2, block_rows=64, block_cols=128)
    big = io_model(2048, 64, dtype_bytes=2, block_rows=64, block_cols=128)
    assert big["tiled_peak_bytes"] == 2 * small["tiled_peak_bytes"]
    # S and P dominate: nearly 4x when N doubles
    assert 3.9 < big["standard_peak_bytes"] / small["standard_peak_bytes"] <= 4


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(N=0, d=8, block_rows=4, block_cols=4), r"N and d must be positive"),
    (dict(N=-5, d=8, block_rows=4, block_cols=4), r"N and d must be positive"),
    (dict(N=16, d=0, block_rows=4, block_cols=4), r"N and d must be positive"),
    (dict(N=16, d=8), r"give block_rows and block_cols, or sram_bytes"),
    (dict(N=16, d=8, block_rows=4), r"give block_rows and block_cols, or sram_bytes"),
    (dict(N=16, d=8, block_rows=0, block_cols=4), r"block_rows must be a positive integer"),
    (dict(N=16, d=8, block_rows=-2, block_cols=4), r"block_rows must be a positive integer"),
    (dict(N=16, d=8, block_rows=4, block_cols=0), r"block_cols must be a positive integer"),
    (dict(N=16, d=8, block_rows=4, block_cols=4, dtype_bytes=0), r"dtype_bytes must be"),
    (dict(N=16, d=8, block_rows=4, block_cols=4, batch=0), r"batch must be a positive integer"),
    (dict(N=16, d=8, block_rows=4, block_cols=4, heads=-1), r"heads must be a positive integer"),
    (dict(N=16.5, d=8, block_rows=4, block_cols=4), r"N must be a positive integer"),
    (dict(N=16, d=8, sram_bytes=0), r"sram_bytes must be positive"),
    (dict(N=16, d=8, sram_bytes=-1024), r"sram_bytes must be positive"),
])
def test_bad_arguments_raise(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        io_model(**kwargs)
