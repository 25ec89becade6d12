"""The check every block kernel wrapper makes of its arrays before a kernel sees them."""
from __future__ import annotations

import numpy as np


def check(x: np.ndarray, dtype, what: str, length: int | None = None) -> None:
    """TypeError unless ``x`` is a 1-D C-contiguous array of ``dtype``; ValueError unless it has
    ``length`` elements (when given). The message names the argument and what it got."""
    if not isinstance(x, np.ndarray) or x.dtype != dtype or x.ndim != 1 or not x.flags.c_contiguous:
        raise TypeError(f"{what} must be a 1-D C-contiguous {np.dtype(dtype).name} array; got "
                        f"{getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')}")
    if length is not None and x.shape[0] != length:
        raise ValueError(f"{what} must have {length} elements, has {x.shape[0]}")
