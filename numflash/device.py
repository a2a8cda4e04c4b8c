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
    sm_count: int = None   # multiprocessors (split-KV fills them); None when not known

    @classmethod
    def of_arch(cls, cc):
        """A GPU of compute capability ``cc`` as the planner sees it, for planning and compiling
        without one (numflash.precompile, numflash.inspect): the shared memory one block may opt
        into on each architecture (CUDA programming guide)."""
        cc = tuple(cc)
        optin = {(7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024,
                 (8, 9): 99 * 1024, (9, 0): 227 * 1024}.get(cc, 99 * 1024)
        return cls(name=f"sm_{cc[0]}{cc[1]}", cc=cc, smem_per_block_optin=optin)
