"""numflash: exact FlashAttention in Python, on NVIDIA GPUs (numba.cuda + CuPy) and on the CPU."""
from . import reference
from .api import attention, attention_backward, explain
from .io_model import io_model

__all__ = ["attention", "attention_backward", "explain", "reference", "io_model"]
__version__ = "0.1.0"
