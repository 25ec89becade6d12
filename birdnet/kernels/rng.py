"""Counter-based random numbers with integer operations only (splitmix64 finaliser).

``uniform(seed, i)`` is a pure function of (seed, i): no state, any order, any thread count, and the
same bits on x86 and ARM (64-bit integer multiply/xor/shift, then an exact conversion of a 53-bit
integer to float64). This is what lets every node of a cluster draw the same shared selection.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
_ONE = np.uint64(1)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53, exact
MASK63 = (1 << 63) - 1


@njit(cache=True, inline="always")
def mix64(z):
    """splitmix64 finaliser of a uint64."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True, inline="always")
def hash64(seed, i):
    """uint64 hash of (seed: uint64, i: int) — the i-th output of splitmix64 seeded with seed."""
    return mix64(seed + (np.uint64(i) + _ONE) * _GOLDEN)


@njit(cache=True, inline="always")
def uniform(seed, i):
    """Uniform float64 in [0, 1) from (seed: uint64, i): 53 random bits, exact on every platform."""
    return np.float64(hash64(seed, i) >> _S11) * _INV53


@njit("void(uint64, float64[::1])", cache=True, parallel=True)
def _fill_uniform(seed, out):
    # order-independent: element i depends only on (seed, i)
    for i in prange(out.shape[0]):
        out[i] = uniform(seed, i)


@njit(cache=True)
def _digest(seed, ids):
    # sequential fold: the digest depends on the order of ids, which is ascending by construction
    h = mix64(seed ^ np.uint64(ids.shape[0]))
    for i in range(ids.shape[0]):
        h = mix64(h ^ np.uint64(ids[i])) + _GOLDEN
    return h >> _ONE


def as_seed(seed: int) -> np.uint64:
    """A Python int seed (any size, any sign) as the uint64 the kernels take."""
    return np.uint64(int(seed) & ((1 << 64) - 1))


def fill_uniform(seed: int, out: np.ndarray) -> np.ndarray:
    """Fill float64 ``out`` with ``uniform(seed, i)`` for i = 0..len-1."""
    if out.dtype != np.float64 or out.ndim != 1 or not out.flags.c_contiguous:
        raise TypeError("fill_uniform needs a 1-D contiguous float64 output array")
    _fill_uniform(as_seed(seed), out)
    return out


def digest(seed: int, ids: np.ndarray) -> int:
    """63-bit digest of a selection (a sequence of non-negative integer ids), as a Python int."""
    return int(_digest(as_seed(seed), np.ascontiguousarray(ids)))


def uniform_scalar(seed: int, i: int) -> float:
    return float(uniform(as_seed(seed), i))
