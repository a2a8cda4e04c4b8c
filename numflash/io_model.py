"""HBM traffic of naive vs tiled attention, after the FlashAttention paper's IO analysis.

Per (batch, head), with N queries and keys, head dim d, element size e bytes:
- standard attention writes S = Q K^T (N^2), reads it for the softmax, writes P (N^2), reads P for
  P V, and reads Q, K, V and writes O once: e * (4 N d + 4 N^2) bytes when done in e-byte floats;
- the tiled algorithm reads Q once, streams K and V once per query block of block_rows rows, and
  writes O once: e * (2 N d + 2 N d * ceil(N / block_rows)) bytes, plus the lse (4 N bytes).
With block sizes left out, they follow from the on-chip memory M as in FlashAttention:
block_cols = ceil(M / (4 d e)), block_rows = min(block_cols, d).
"""
import math
import numbers


def io_model(N, d, sram_bytes=None, dtype_bytes=4, block_rows=None, block_cols=None, *,
             batch=1, heads=1, causal=False):
    """Predicted bytes moved through device memory, and predicted peak extra memory, as a dict.

    Keys: standard_bytes, tiled_bytes, ratio (standard / tiled), block_rows, block_cols,
    kv_passes (how many times K and V are read), standard_peak_bytes (S and P held at once),
    tiled_peak_bytes (output and lse). Causal halves the score traffic and the K/V re-reads.
    """
    if N <= 0 or d <= 0:
        raise ValueError(f"N and d must be positive; got N={N}, d={d}")
    for name, val in (("N", N), ("d", d), ("dtype_bytes", dtype_bytes), ("block_rows", block_rows),
                      ("block_cols", block_cols), ("batch", batch), ("heads", heads)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, numbers.Integral)
                                or val <= 0):
            raise ValueError(f"{name} must be a positive integer; got {val!r}")
    if sram_bytes is not None and not sram_bytes > 0:
        raise ValueError(f"sram_bytes must be positive; got {sram_bytes!r}")
    if block_cols is None:
        if sram_bytes is None:
            raise ValueError("give block_rows and block_cols, or sram_bytes to derive them")
        block_cols = max(1, math.ceil(sram_bytes / (4 * d * dtype_bytes)))
    if block_rows is None:
        block_rows = min(block_cols, d)
    e, bh = dtype_bytes, batch * heads
    frac = 0.5 if causal else 1.0
    kv_passes = math.ceil(N / block_rows) * frac
    standard = bh * e * (4 * N * d + 4 * N * N * frac)
    tiled = bh * (e * (2 * N * d + 2 * N * d * max(1.0, kv_passes)) + 4 * N)
    return {
        "standard_bytes": standard,
        "tiled_bytes": tiled,
        "ratio": standard / tiled,
        "block_rows": block_rows,
        "block_cols": block_cols,
        "kv_passes": kv_passes,
        "standard_peak_bytes": bh * 2 * N * N * e + bh * N * d * e,
        "tiled_peak_bytes": bh * N * d * e + bh * 4 * N,
    }
