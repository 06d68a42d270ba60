"""numba kernels, each next to a plain-Python reference that the tests compare it with."""
