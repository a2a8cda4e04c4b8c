"""What every CUDA kernel's tile config shares: one naming scheme and the mapping behaviour.

Each kernel module defines its config as a frozen dataclass deriving from :class:`TileConfig`
(cuda.mma's MmaConfig, cuda.block's BlockConfig, cuda.row's RowConfig and RowBackwardConfig).
The fields they have in common mean the same everywhere:

- D, DV: the padded head dims of q / k and of the output (or gradient) columns a block computes.
- BR: the rows a block owns (query rows in a forward or dQ pass, key rows in a dK / dV pass);
  BC: the rows of the other operand a tile (keys in a forward or dQ pass, queries in a dK / dV
  pass). NT (derived): the threads a block.
- DT: the operand kind: "f16", "bf16", "tf32", "3xtf32", "f64" on tensor cores; "f32", "f64"
  on the FMA (SIMT) kernels, whose accumulators are that float type.
- HOLDQ: the block's own q rows stay in registers (else they are re-read from shared memory).

Kernel-specific fields follow them (block: TM, TN, PF, SP; mma: NW, VEC, ...), each explained
in its class. A config is a read-only mapping too (``cfg["D"]``, ``dict(cfg)``, ``f(**cfg)``)
for code that treats every kernel's config alike (the launcher's cache key, ``explain``); an
optional field (one with a default) is left out of it while unset (falsy), so adding one does
not change the keys of the variants that do not use it.
"""
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields

#: the SIMT kernels' DT by the accumulators' float type, and back
SIMT_DT = {"float32": "f32", "float64": "f64"}
SIMT_ACC = {dt: acc for acc, dt in SIMT_DT.items()}


def simt_dt(dtype_name):
    """The SIMT kernels' DT for inputs of ``dtype_name``: float64 in float64, the rest (float16,
    bfloat16 staged as float32, float32) in float32."""
    return "f64" if dtype_name == "float64" else "f32"


@dataclass(frozen=True)
class TileConfig(Mapping):
    """Base of every kernel's frozen config: the mapping of its set fields (see the module)."""

    def _items(self):
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.default is MISSING or getattr(self, f.name)}

    def __getitem__(self, key):
        return self._items()[key]

    def __str__(self):
        return "(" + ", ".join(f"{k}={v}" for k, v in self._items().items()) + ")"

    def __iter__(self):
        return iter(self._items())

    def __len__(self):
        return len(self._items())


@dataclass(frozen=True)
class SimtConfig(TileConfig):
    """Base of the FMA (SIMT) kernels' configs: DT is "f32" or "f64"; one thread a row (NT = BR)
    unless the kernel says otherwise."""

    @property
    def acc(self):
        """The accumulators' float type name."""
        return SIMT_ACC[self.DT]

    @property
    def NT(self):
        return self.BR
