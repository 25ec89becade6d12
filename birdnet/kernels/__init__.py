"""Numba kernels behind the codecs, one module per family.

Each module keeps its ``@njit`` kernels private (``_name``), taking preallocated outputs, behind
small public wrappers that check dtype and contiguity. Every kernel has a slow NumPy reference in
``tests/test_kernels_*.py``. Kernels on a path that must agree bit for bit between nodes (shared
selections, block norms feeding them, the counter-based generator) use no fast-math at all and a
fixed evaluation order; elsewhere fast-math flags never include ``nnan``/``ninf``/``reassoc``.
"""
from __future__ import annotations

import importlib
import threading
from typing import Any


class _LazyModule:
    """A kernel module imported at its first attribute lookup. Codec modules hold their kernels
    through it, so importing a codec (to check its parameters in a training process, say) neither
    imports Numba nor compiles a kernel: that happens where the codec first runs. After the first
    lookup an attribute sits in the instance's dict and costs what a module attribute costs."""

    def __init__(self, name: str) -> None:
        self.__dict__["_name"] = name
        self.__dict__["_lock"] = threading.Lock()

    def __getattr__(self, attr: str) -> Any:
        with self._lock:  # one thread imports (compiles); the others wait for its result
            value = getattr(importlib.import_module(self._name), attr)
            self.__dict__[attr] = value
        return value

    def __repr__(self) -> str:
        return f"<kernel module {self._name} (imported at first use)>"


def lazy(module: str) -> Any:
    """``birdnet.kernels.<module>``, imported at its first attribute lookup."""
    return _LazyModule(f"{__name__}.{module}")
