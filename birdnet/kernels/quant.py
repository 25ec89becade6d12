"""Quantisation kernels: QSGD stochastic levels, EF-signSGD sign bits (packed LSB first).

These paths are local to one node (each node's payload is decoded identically by every receiver
from the payload bytes), so parallel loops are fine; reductions that feed a payload scale are done
sequentially in float64 so a node's result does not depend on its thread count either.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from birdnet.kernels.rng import as_seed, uniform


@njit("float64(float32[::1])", cache=True)
def _l2(x):
    s = 0.0
    for i in range(x.shape[0]):
        s += np.float64(x[i]) * np.float64(x[i])
    return math.sqrt(s)


@njit(cache=True, parallel=True)
def _qsgd_quantise(x, norm, s, seed, offset, out):
    # level = floor(|x|/norm * s + u), u ~ U(0,1): E[level] = |x|/norm * s  (unbiased)
    inv = s / norm
    for i in prange(x.shape[0]):
        r = abs(np.float64(x[i])) * inv
        lv = math.floor(r + uniform(seed, i))
        if lv > s:
            lv = s
        out[i] = (-lv if x[i] < 0 else lv) + offset


@njit(cache=True, parallel=True)
def _dequantise_add(levels, offset, step, out):
    for i in prange(out.shape[0]):
        out[i] += np.float32(np.int64(levels[i]) - offset) * step


def l2_norm(x: np.ndarray) -> float:
    return float(_l2(x))


def qsgd_quantise(x: np.ndarray, s: int, seed: int) -> tuple[float, np.ndarray]:
    """(norm, levels): int8 levels in [-s, s] for s <= 127, else uint16 levels + s in [0, 2s]
    (the wire format allows no int16)."""
    norm = float(_l2(x))
    out = np.empty(x.shape[0], np.int8 if s <= 127 else np.uint16)
    offset = level_offset(s)
    if norm > 0.0 and math.isfinite(norm) and x.shape[0]:
        _qsgd_quantise(x, norm, s, as_seed(seed), offset, out)
    else:
        out[:] = offset
    return norm, out


def level_offset(s: int) -> int:
    return 0 if s <= 127 else s


def dequantise_add(levels: np.ndarray, step: float, out: np.ndarray, offset: int = 0) -> None:
    """out += (levels - offset) * step (step = norm / s, as float32)."""
    if levels.shape[0]:
        _dequantise_add(np.ascontiguousarray(levels), np.int64(offset), np.float32(step), out)


@njit(cache=True)
def _l1_accumulate(x, r, p):
    # p = x + r (error feedback), returns sum |p| in float64, sequential
    s = 0.0
    for i in range(x.shape[0]):
        v = x[i] + r[i]
        p[i] = v
        s += abs(np.float64(v))
    return s


@njit(cache=True, parallel=True)
def _pack_signs(p, bits):
    # bit i (LSB first in byte i//8) = 1 when p[i] >= 0
    n = p.shape[0]
    for j in prange(bits.shape[0]):
        byte = 0
        lo = j * 8
        for t in range(min(8, n - lo)):
            if p[lo + t] >= 0:
                byte |= 1 << t
        bits[j] = np.uint8(byte)


@njit(cache=True, parallel=True)
def _signs_add(bits, scale, out, residual_src, residual):
    # out += ±scale ; when residual_src is non-empty: residual = residual_src - (±scale)
    n = out.shape[0]
    do_r = residual.shape[0] == n
    neg = -scale
    for j in prange(bits.shape[0]):
        byte = bits[j]
        lo = j * 8
        for t in range(min(8, n - lo)):
            v = scale if (byte >> t) & 1 else neg
            if do_r:
                residual[lo + t] = residual_src[lo + t] - v
            else:
                out[lo + t] += v


def ef_sign_compress(x: np.ndarray, residual: np.ndarray | None) -> tuple[float, np.ndarray]:
    """EF-signSGD: p = x + residual, scale = mean |p|, bits = p >= 0; residual <- p - scale*sign.

    Returns (scale as float32-representable float, packed bits uint8[ceil(n/8)])."""
    n = x.shape[0]
    p = np.empty(n, np.float32)
    r = residual if residual is not None else np.zeros(n, np.float32)
    s = _l1_accumulate(x, r, p)
    scale = np.float32(s / n) if n else np.float32(0.0)
    bits = np.empty((n + 7) // 8, np.uint8)
    if n:
        _pack_signs(p, bits)
        if residual is not None:
            _signs_add(bits, scale, p, p, residual)
    return float(scale), bits


def signs_add(bits: np.ndarray, scale: float, out: np.ndarray) -> None:
    """out += scale * (+1 where bit set else -1)."""
    if out.shape[0]:
        _signs_add(np.ascontiguousarray(bits), np.float32(scale), out,
                   np.empty(0, np.float32), np.empty(0, np.float32))
