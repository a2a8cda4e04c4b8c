"""The CUDA kernels (numba.cuda, launched on CuPy arrays) and what launches them; imported only
when a CUDA plan runs, so numflash works without numba-cuda."""
