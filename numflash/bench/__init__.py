"""``python -m numflash.bench``: numflash against naive attention and torch SDPA, on one machine.

On a GPU (CuPy importable and a device present) every numflash CUDA algorithm that accepts the
inputs runs against CuPy naive attention (matmul, softmax, matmul in the input dtype) and, when
torch is importable, torch SDPA with each backend that accepts them (flash, efficient, cuDNN,
math), all on the same inputs in the same run (torch sees the CuPy arrays through DLPack, zero
copy). Without a GPU the numba CPU path runs against NumPy naive attention (and torch SDPA on the
CPU when torch is importable) at sizes that finish in about a minute.

Suites: the main grid (default), ``--backward`` (gradients: attention_backward against torch
SDPA's backward and the naive backward), ``--memory`` (long-sequence time and peak memory, naive
shown as OOM where it fails) and ``--decode`` (decode Nq=1 and cross-attention Nq != Nk rows).

How it measures: a warm-up first, then the median (with min and max) of at least 10 timed repeats
(fewer only where 10 calls would take longer than ``--cap`` seconds; the ``reps`` column says how
many), with CUDA events around each call on the GPU and ``time.perf_counter`` on the CPU. Inputs are
drawn fresh for every row and rotated among several input sets, enough to overflow the last-level
cache. Every timed output goes through :func:`numflash.testing.check` (float64 reference, on a
sample of heads and query rows for big shapes); a method that fails it is shown as FAIL.
TFLOP/s = 4 B H Nq Nk d / time (halved for causal). Each numflash time is given as a speedup
against every peer of the same row (peer time / numflash time: > 1 means numflash is faster).

Results: a markdown table on stdout, and ``<date>_<device>.md`` / ``.json`` / ``_<suite>.png``
under ``--out`` (default ./numflash-bench, which git ignores in a clone of numflash; the
curated runs in bench/results were written with ``--out bench/results``).

The package, one module a concern: cli (the command line), cases (rows, suites, FLOP and byte
models), timing (the timing helper that numflash's GPU tests and bench/ scripts share too),
methods (numflash's methods), baselines and peers (naive attention and torch SDPA: what numflash is
compared against), backends (CPU and CUDA), checks (accuracy of every timed output), runner
(measure a row, compare), report (markdown, JSON, versions) and plots.
"""
from .cli import main, run

__all__ = ["main", "run"]
