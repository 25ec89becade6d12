"""Numba kernels behind the codecs, one module per family.

Each module keeps its ``@njit`` kernels private (``_name``), taking preallocated outputs, behind
small public wrappers that check dtype and contiguity. Every kernel has a slow NumPy reference in
``tests/test_kernels_*.py``. Kernels on a path that must agree bit for bit between nodes (shared
selections, block norms feeding them, the counter-based generator) use no fast-math at all and a
fixed evaluation order; elsewhere fast-math flags never include ``nnan``/``ninf``/``reassoc``.
"""
