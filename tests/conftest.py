"""Test setup: on a machine without a usable GPU, the CUDA kernels run in numba's simulator.

The switch must happen before numba.cuda is first imported, so it lives here.
"""
import os


def _gpu_available():
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return False
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _gpu_available()
if not HAS_GPU:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
    skip_sim = pytest.mark.skip(reason="simulator tests run on machines without a GPU")
    for item in items:
        if item.get_closest_marker("gpu") and not HAS_GPU:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("simulator") and HAS_GPU:
            item.add_marker(skip_sim)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name: fresh inputs per test, reproducible per run."""
    import zlib
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
