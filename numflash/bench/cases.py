"""What the benchmark measures: its rows (Config), the suites' default sizes, and the models that
turn a row and a time into TFLOP/s and bytes moved (io_model's traffic and peak-memory
predictions)."""
import math
from dataclasses import dataclass

import numpy as np

# ----------------------------------------------------------------------------------------------
# Suites and their default sizes
# ----------------------------------------------------------------------------------------------

MEMORY_N = tuple(1024 * 2 ** i for i in range(9))          # 1024 ... 262144
DEFAULTS = {
    # (backend, suite, quick) -> sizes
    ("cuda", "grid", False): dict(batch=4, heads=16, n=(512, 1024, 2048, 4096, 8192), d=(64, 128),
                                  dtype=("float32", "float16"), causal=(False, True)),
    ("cuda", "grid", True): dict(batch=4, heads=16, n=(1024, 4096), d=(64,),
                                 dtype=("float32", "float16"), causal=(False, True)),
    ("cuda", "memory", False): dict(batch=1, heads=8, n=MEMORY_N, d=(64,), dtype=("float16",),
                                    causal=(False,)),
    ("cuda", "memory", True): dict(batch=1, heads=8, n=(1024, 8192, 65536), d=(64,),
                                   dtype=("float16",), causal=(False,)),
    ("cuda", "decode", False): dict(batch=4, heads=16, nq=(1, 512), n=(512, 2048, 8192, 32768),
                                    d=(64, 128), dtype=("float32", "float16"), causal=(False,)),
    ("cuda", "decode", True): dict(batch=4, heads=16, nq=(1, 512), n=(2048, 32768), d=(64,),
                                   dtype=("float16",), causal=(False,)),
    ("cpu", "grid", False): dict(batch=1, heads=8, n=(512, 1024, 2048, 4096), d=(64,),
                                 dtype=("float32",), causal=(False, True)),
    ("cpu", "grid", True): dict(batch=1, heads=4, n=(256, 512), d=(64,), dtype=("float32",),
                                causal=(False, True)),
    ("cpu", "memory", False): dict(batch=1, heads=8, n=(1024, 2048, 4096, 8192), d=(64,),
                                   dtype=("float32",), causal=(False,)),
    ("cpu", "memory", True): dict(batch=1, heads=8, n=(1024, 2048), d=(64,), dtype=("float32",),
                                  causal=(False,)),
    ("cpu", "decode", False): dict(batch=1, heads=8, nq=(1, 512), n=(512, 2048, 8192, 32768),
                                   d=(64,), dtype=("float32",), causal=(False,)),
    ("cpu", "decode", True): dict(batch=1, heads=8, nq=(1, 512), n=(2048, 8192), d=(64,),
                                  dtype=("float32",), causal=(False,)),
    ("cuda", "backward", False): dict(batch=4, heads=16, n=(1024, 4096), d=(64, 128),
                                      dtype=("float32", "float16"), causal=(False, True)),
    ("cuda", "backward", True): dict(batch=4, heads=16, n=(1024,), d=(64,), dtype=("float32",),
                                     causal=(False, True)),
    ("cpu", "backward", False): dict(batch=1, heads=8, n=(512, 1024, 2048), d=(64,),
                                     dtype=("float32",), causal=(False, True)),
    ("cpu", "backward", True): dict(batch=1, heads=4, n=(256, 512), d=(64,), dtype=("float32",),
                                    causal=(False, True)),
}
# The backward keeps each input set's forward (and a peer's saved tensors) alive: few sets.
BACKWARD_SETS = 3
# FlashAttention-2's backward does 5 matrix products of the forward's 2 sizes: 2.5x its FLOPs.
BACKWARD_FLOPS = 2.5

SUITE_METHOD_DEFAULTS = {
    "grid": {},
    "decode": {},
    # the memory sweep: the algorithm numflash picks by itself, against naive attention
    "memory": {"algorithms": ("auto",), "peers": ("cupy-naive", "numpy-naive")},
    "backward": {},
}


@dataclass(frozen=True)
class Config:
    """One row of a suite: the problem every method of the row runs on."""
    suite: str
    B: int
    H: int
    Nq: int
    Nk: int
    d: int
    dtype: str
    causal: bool

    def label(self):
        n = f"N={self.Nq}" if self.Nq == self.Nk else f"Nq={self.Nq} Nk={self.Nk}"
        return (f"B={self.B} H={self.H} {n} d={self.d} {self.dtype}"
                f"{' causal' if self.causal else ''}")

    @property
    def scale(self):
        return 1.0 / math.sqrt(self.d)

    def set_bytes(self):
        e = np.dtype(self.dtype).itemsize
        return e * self.B * self.H * self.d * (self.Nq + 2 * self.Nk)


def build_configs(backend_name, suite, args):
    """The rows of one suite: its defaults for the backend, overridden by the command line."""
    d = dict(DEFAULTS[(backend_name, suite, bool(args.quick))])
    B = args.batch if args.batch is not None else d["batch"]
    H = args.heads if args.heads is not None else d["heads"]
    ns = tuple(args.n) if args.n else d["n"]
    ds = tuple(args.d) if args.d else d["d"]
    dtypes = tuple(args.dtype) if args.dtype else d["dtype"]
    causals = args.causal if args.causal is not None else d["causal"]
    configs = []
    if suite == "decode":
        nqs = tuple(args.nq) if args.nq else d["nq"]
        for dt in dtypes:
            for dd in ds:
                for nq in nqs:
                    for nk in ns:
                        for c in causals:
                            configs.append(Config(suite, B, H, nq, nk, dd, dt, c))
    else:
        for dt in dtypes:
            for dd in ds:
                for c in causals:
                    for n in ns:
                        configs.append(Config(suite, B, H, n, n, dd, dt, c))
    return configs


# ----------------------------------------------------------------------------------------------
# FLOP and byte models
# ----------------------------------------------------------------------------------------------

def attention_flops(B, H, Nq, Nk, d, causal=False):
    """FLOPs of one attention forward: 4 B H Nq Nk d (two matmuls), halved for causal."""
    flops = 4.0 * B * H * Nq * Nk * d
    return flops / 2 if causal else flops


def tflops(flops, ms):
    """TFLOP/s of ``flops`` done in ``ms`` milliseconds (None for a missing or zero time)."""
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def blocks_from_config(config):
    """(block_rows, block_cols) of a numflash kernel's tile config, or None if it names none."""
    if isinstance(getattr(config, "BR", None), int):  # a numflash kernel's TileConfig
        return config.BR, config.BC
    lower = {str(k).lower(): v for k, v in (config or {}).items()}
    rows = next((lower[k] for k in ("br", "block_q", "block_m", "block_rows", "rows")
                 if k in lower), None)
    cols = next((lower[k] for k in ("bc", "block_k", "block_n", "block_cols") if k in lower), None)
    if isinstance(rows, int) and isinstance(cols, int):
        return rows, cols
    return None


def model_bytes(rec):
    """(bytes, what) the memory-traffic model predicts for one record's method; (None, why)."""
    from ..io_model import io_model
    e = np.dtype(rec["dtype"]).itemsize
    B, H, Nq, Nk, d = rec["B"], rec["H"], rec["Nq"], rec["Nk"], rec["d"]
    if Nq != Nk:
        floor = e * B * H * (2 * Nq * d + 2 * Nk * d)
        return float(floor), "floor: q, k, v read and o written once"
    io = rec.get("io")
    if io == "standard":
        m = io_model(Nq, d, dtype_bytes=e, block_rows=64, block_cols=64, batch=B, heads=H,
                     causal=rec["causal"])
        return float(m["standard_bytes"]), "io_model standard"
    if io == "tiled" and rec.get("blocks"):
        br, bc = rec["blocks"]
        m = io_model(Nq, d, dtype_bytes=e, block_rows=br, block_cols=bc, batch=B, heads=H,
                     causal=rec["causal"])
        return float(m["tiled_bytes"]), f"io_model tiled BR={br} BC={bc}"
    if io == "tiled" and rec.get("sram_bytes"):
        m = io_model(Nq, d, sram_bytes=rec["sram_bytes"], dtype_bytes=e, batch=B, heads=H,
                     causal=rec["causal"])
        return float(m["tiled_bytes"]), f"io_model tiled from {rec['sram_bytes']} B SRAM"
    return None, "no model for this method"


def predicted_peak(rec):
    """io_model's predicted peak extra memory for a square record: naive (S and P) or tiled."""
    from ..io_model import io_model
    if rec["Nq"] != rec["Nk"] or rec.get("io") not in ("standard", "tiled"):
        return None
    m = io_model(rec["Nq"], rec["d"], dtype_bytes=np.dtype(rec["dtype"]).itemsize,
                 block_rows=64, block_cols=64, batch=rec["B"], heads=rec["H"],
                 causal=rec["causal"])
    return float(m["standard_peak_bytes" if rec["io"] == "standard" else "tiled_peak_bytes"])


def predicted_peak_for(rec):
    """io_model's prediction for a record that has no time (an OOM row), by its method family."""
    io = rec.get("io") or ("tiled" if rec["family"] == "numflash" else
                           "standard" if rec["method"].endswith("naive") else None)
    return predicted_peak(dict(rec, io=io)) if io else None

