"""numflash: exact FlashAttention in Python, on NVIDIA GPUs (numba.cuda + CuPy) and on the CPU."""
import importlib

from . import reference
from .api import attention, attention_backward, explain
from .block_mask import BlockMask, create_block_mask
from .io_model import io_model
from .kvcache import attention_with_kvcache
from .varlen import attention_varlen, attention_varlen_backward, explain_varlen, merge_partials

__all__ = ["attention", "attention_backward", "explain", "create_block_mask", "BlockMask",
           "attention_varlen", "attention_varlen_backward", "explain_varlen", "merge_partials",
           "attention_with_kvcache", "reference", "io_model"]
__version__ = "0.1.0"

# The framework layers import their framework: loaded on first use (numflash.torch,
# numflash.distributed, ...), so that numflash itself imports without torch, transformers or JAX.
_FRAMEWORK_MODULES = ("torch", "transformers", "jax", "distributed")


def __getattr__(name):
    if name in _FRAMEWORK_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
