"""How a torch tensor's dtype travels through birdnet (birdnet.client.torch and torch_dist).

The daemon reduces float16/32/64, and int32/int64 with ``op="sum"``. NumPy has no bfloat16:
float32 holds every bfloat16 exactly; small integer types and bool travel as int32.
"""
from __future__ import annotations

import numpy as np
import torch

from birdnet.errors import InputError

#: torch dtype -> the NumPy dtype it travels as
WIRE = {
    torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
    torch.bfloat16: np.float32, torch.int64: np.int64, torch.int32: np.int32,
    torch.int16: np.int32, torch.int8: np.int32, torch.uint8: np.int32, torch.bool: np.int32,
}
#: the torch dtypes that travel as themselves: a NumPy view of the tensor needs no conversion
NATIVE = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
          torch.int64: np.int64, torch.int32: np.int32}
NUMPY_TO_TORCH = {np.dtype(v): k for k, v in NATIVE.items()}


def wire_dtype(t: torch.Tensor, what: str = "a tensor") -> np.dtype:
    dt = WIRE.get(t.dtype)
    if dt is None:
        raise InputError(f"{what} has dtype {t.dtype}, which birdnet cannot reduce; use a float or integer tensor")
    return np.dtype(dt)
