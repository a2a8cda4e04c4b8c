"""The numba.njit CPU path: the tiled forward and its backward."""
