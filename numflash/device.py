"""Facts about where a kernel runs, below both the planner and the kernels: the Device, whether
numba's CUDA simulator is on, and the exception a kernel's config() raises to refuse a problem."""
from dataclasses import dataclass
import os


def simulator_enabled():
    """True when numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


class Unsupported(ValueError):
    """A kernel module's config() cannot serve the problem on the device; the message says why."""


@dataclass(frozen=True)
class Device:
    """Where a CUDA kernel would run: a real GPU, or numba's simulator (cc None)."""
    name: str
    cc: tuple = None
    smem_per_block_optin: int = 48 * 1024
    simulator: bool = False
