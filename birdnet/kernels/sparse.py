"""Per-element sparsification kernels: exact Top-K by radix select, threshold selection (DGC),
stratified Random-K indexes, gather and scatter-add.

Magnitudes are compared as the integer bits of ``|x|`` (float32 with the sign bit cleared): the
order of those integers is the order of the magnitudes, and NaN (bits above +Inf) ranks highest, so
a NaN in the input is always selected and propagates to the result instead of vanishing.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from birdnet.kernels.rng import as_seed, uniform

_ABS = np.uint32(0x7FFFFFFF)


@njit(cache=True)
def _kth_largest_bits(xb, k):
    """(threshold bits t, number of elements with bits > t) for the k-th largest |x| (1 <= k <= n).

    Two histogram passes (top 16 bits, then low 15 bits within the bin): O(n), no sort.
    """
    n = xb.shape[0]
    h1 = np.zeros(65536, np.int64)
    for i in range(n):
        h1[(xb[i] & _ABS) >> np.uint32(15)] += 1
    above = 0
    hi = 65535
    while hi > 0 and above + h1[hi] < k:
        above += h1[hi]
        hi -= 1
    h2 = np.zeros(32768, np.int64)
    uhi = np.uint32(hi)
    for i in range(n):
        a = xb[i] & _ABS
        if (a >> np.uint32(15)) == uhi:
            h2[a & np.uint32(0x7FFF)] += 1
    lo = 32767
    while lo > 0 and above + h2[lo] < k:
        above += h2[lo]
        lo -= 1
    return np.uint32((hi << 15) | lo), above


@njit("int64(float32[::1], int64, int64[::1], float32[::1])", cache=True)
def _topk(x, k, idx_out, val_out):
    # exact Top-K by magnitude; ties at the threshold are taken in index order; output ascending
    n = x.shape[0]
    if k <= 0 or n == 0:
        return 0
    if k >= n:
        for i in range(n):
            idx_out[i] = i
            val_out[i] = x[i]
        return n
    xb = x.view(np.uint32)
    t, above = _kth_largest_bits(xb, k)
    ties = k - above
    j = 0
    for i in range(n):
        a = xb[i] & _ABS
        if a > t or (a == t and ties > 0):
            if a == t:
                ties -= 1
            idx_out[j] = i
            val_out[j] = x[i]
            j += 1
    return j


def topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indexes (ascending, int64) and values of the k largest-magnitude elements of float32 x."""
    _check_f32(x, "topk")
    k = int(max(0, min(k, x.shape[0])))
    idx = np.empty(k, np.int64)
    val = np.empty(k, np.float32)
    got = _topk(x, k, idx, val)
    return idx[:got], val[:got]


@njit(cache=True)
def _sample_threshold_bits(x, seed, s, ks):
    # DGC: the ks-th largest magnitude of s elements drawn uniformly (with replacement)
    n = x.shape[0]
    xb = x.view(np.uint32)
    sample = np.empty(s, np.uint32)
    for j in range(s):
        sample[j] = xb[min(n - 1, np.int64(uniform(seed, j) * n))] & _ABS
    sample.sort()
    return sample[s - ks]


@njit(cache=True)
def _count_at_least(xb, t):
    c = 0
    for i in range(xb.shape[0]):
        if (xb[i] & _ABS) >= t:
            c += 1
    return c


@njit(cache=True)
def _gather_at_least(x, t, idx_out, val_out):
    xb = x.view(np.uint32)
    j = 0
    for i in range(x.shape[0]):
        if (xb[i] & _ABS) >= t:
            idx_out[j] = i
            val_out[j] = x[i]
            j += 1
    return j


def threshold_select(x: np.ndarray, k: int, seed: int, sample: int) -> tuple[np.ndarray, np.ndarray]:
    """DGC selection: threshold estimated on a random sample, then every |x| >= threshold.

    If the estimate lets through more than 2k elements, an exact Top-K of the selected ones trims
    them to k (DGC's hierarchical selection).
    """
    _check_f32(x, "threshold_select")
    n = x.shape[0]
    k = int(max(0, min(k, n)))
    if k == 0:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    s = int(min(n, max(1, sample)))
    ks = int(max(1, min(s, round(k * s / n))))
    t = _sample_threshold_bits(x, as_seed(seed), s, ks)
    c = _count_at_least(x.view(np.uint32), t)
    idx = np.empty(c, np.int64)
    val = np.empty(c, np.float32)
    _gather_at_least(x, t, idx, val)
    if c > 2 * k:
        sub, val = topk(val, k)
        idx = idx[sub]
    return idx, val


@njit(cache=True, parallel=True)
def _randomk_indexes(seed, n, k, idx_out, scale_out):
    # stratum i = [i*n//k, (i+1)*n//k); one uniform pick per stratum; every element is kept with
    # probability 1/len(stratum), so scaling by len(stratum) is exactly unbiased. Integer bounds and
    # one float64 product per pick: identical on every node and thread count.
    for i in prange(k):
        lo = (i * n) // k
        hi = ((i + 1) * n) // k
        w = hi - lo
        idx_out[i] = lo + min(w - 1, np.int64(uniform(seed, i) * w))
        scale_out[i] = np.float32(w)


def randomk_indexes(seed: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Shared Random-K: k ascending indexes in [0, n) and their unbiased scales (stratum sizes)."""
    k = int(max(0, min(k, n)))
    idx = np.empty(k, np.int64)
    scale = np.empty(k, np.float32)
    if k:
        _randomk_indexes(as_seed(seed), np.int64(n), np.int64(k), idx, scale)
    return idx, scale


@njit(cache=True)
def _scatter_add(idx, val, out):
    # sequential: duplicate indexes (only possible in a malformed payload) add in a fixed order
    for j in range(idx.shape[0]):
        out[idx[j]] += np.float32(val[j])


@njit(cache=True)
def _max_index(idx):
    m = -1
    for j in range(idx.shape[0]):
        v = np.int64(idx[j])
        if v > m:
            m = v
    return m


def max_index(idx: np.ndarray) -> int:
    return int(_max_index(idx)) if idx.shape[0] else -1


def scatter_add(idx: np.ndarray, val: np.ndarray, out: np.ndarray) -> None:
    """out[idx[j]] += val[j] in j order (idx must be in range: callers validate payloads first)."""
    _check_f32(out, "scatter_add")
    if idx.shape[0] != val.shape[0]:
        raise ValueError(f"scatter_add: {idx.shape[0]} indexes but {val.shape[0]} values")
    if idx.shape[0]:
        _scatter_add(np.ascontiguousarray(idx), np.ascontiguousarray(val), out)


def _check_f32(x: np.ndarray, what: str) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1 or not x.flags.c_contiguous:
        raise TypeError(f"{what} needs a 1-D C-contiguous float32 array; got "
                        f"{getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')} "
                        "(use np.ascontiguousarray(x, dtype=np.float32).ravel())")
