"""BIRD / BIRD+ O(m) kernels on the block norms: gamma weights, water-filling probabilities,
systematic and Bernoulli sampling (docs/codecs.md; BIRD+: IEEE TPDS 2024). Sequential,
float64, no fast-math, a fixed order: the same result on every machine and for any thread count.
The public functions are the block codecs' API through ``birdnet.kernels.blocks``.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from birdnet.kernels._arrays import check as _check
from birdnet.kernels.rng import as_seed, uniform

#: the bits of float32 +Inf: a non-negative float32's bits at or above it are Inf or NaN
_INF_BITS = np.int32(0x7F800000)

# -- weights and probabilities (O(m), sequential, float64) -----------------------------------------

@njit(cache=True)
def _pow_quarters(r, q):
    # r ** (q/4) with q a non-negative integer: repeated multiplication and square roots only (both
    # correctly rounded in IEEE 754), in a fixed order — no libm pow, identical on x86 and ARM.
    w = 1.0
    e = q >> 2
    p = r
    while e > 0:  # binary exponentiation, fixed sequence for a given q
        if e & 1:
            w = w * p
        p = p * p
        e >>= 1
    if q & 2:
        w = w * math.sqrt(r)
    if q & 1:
        w = w * math.sqrt(math.sqrt(r))
    return w


#: blocks per chunk of the vectorised weight computation (_weights_chunk)
_WCHUNK = 256


@njit(cache=True, inline="always")
def _finish(ad, t, scale, pmode):
    # weight t of a block of norm ad: 0 where ad = 0, +Inf where ad is NaN/Inf (always kept);
    # pmode 0: the weight, 1: p = min(1, scale*w) (0 where w = 0), 2: p for scale = +Inf
    t = t if ad > 0.0 else 0.0
    t = t if ad < np.inf else np.inf
    if pmode == 0:
        return t
    if pmode == 1:
        x = scale * t
        x = x if x < 1.0 else 1.0
        return x if t > 0.0 else 0.0
    return 1.0 if t > 0.0 else 0.0


@njit(cache=True, inline="always")
def _weights_chunk(aa, amax, q, scale, pmode, r, pw, w):
    """w[i] = gamma weight of block norm aa[i] (or its probability, see _finish): exactly
    _pow_quarters(aa[i]/amax, q), the same IEEE operations in the same order, but evaluated so that
    LLVM vectorises across blocks: one loop per gamma in 1, 2, 4, ..., 64 (w = r^(2^s) by repeated
    squaring, which is the sequence _pow_quarters performs for q = 4*2^s), otherwise one operation
    at a time over the chunk."""
    nn = aa.shape[0]
    if q == 4:
        for i in range(nn):
            ad = np.float64(aa[i])
            t = ad / amax
            w[i] = _finish(ad, t, scale, pmode)
    elif q == 8:
        for i in range(nn):
            ad = np.float64(aa[i])
            t = ad / amax
            t = t * t
            w[i] = _finish(ad, t, scale, pmode)
    elif q == 16:
        for i in range(nn):
            ad = np.float64(aa[i])
            t = ad / amax
            t = t * t
            t = t * t
            w[i] = _finish(ad, t, scale, pmode)
    elif q == 32:
        for i in range(nn):
            ad = np.float64(aa[i])
            t = ad / amax
            t = t * t
            t = t * t
            t = t * t
            w[i] = _finish(ad, t, scale, pmode)
    elif q == 64:
        for i in range(nn):
            ad = np.float64(aa[i])
            t = ad / amax
            t = t * t
            t = t * t
            t = t * t
            t = t * t
            w[i] = _finish(ad, t, scale, pmode)
    elif q == 128:
        for i in range(nn):
            ad = np.float64(aa[i])
            t = ad / amax
            t = t * t
            t = t * t
            t = t * t
            t = t * t
            t = t * t
            w[i] = _finish(ad, t, scale, pmode)
    elif q == 256:
        for i in range(nn):
            ad = np.float64(aa[i])
            t = ad / amax
            t = t * t
            t = t * t
            t = t * t
            t = t * t
            t = t * t
            t = t * t
            w[i] = _finish(ad, t, scale, pmode)
    else:
        for i in range(nn):
            ri = np.float64(aa[i]) / amax
            r[i] = ri
            pw[i] = ri
            w[i] = 1.0
        e = q >> 2
        while e > 0:
            if e & 1:
                for i in range(nn):
                    w[i] = w[i] * pw[i]
            e >>= 1
            if e > 0:
                for i in range(nn):
                    pw[i] = pw[i] * pw[i]
        if q & 2:
            for i in range(nn):
                w[i] = w[i] * math.sqrt(r[i])
        if q & 1:
            for i in range(nn):
                w[i] = w[i] * math.sqrt(math.sqrt(r[i]))
        for i in range(nn):
            w[i] = _finish(np.float64(aa[i]), w[i], scale, pmode)


@njit(cache=True)
def _finite_max_any(a):
    # the largest finite value of non-negative float32 a (0.0 when none): int32 bit order
    bits = a.view(np.int32)
    mx = np.int32(0)
    for i in range(bits.shape[0]):
        t = bits[i]
        t = np.int32(0) if t >= _INF_BITS else t
        mx = max(mx, t)
    return np.float64(np.array([mx], np.int32).view(np.float32)[0])


@njit("void(float32[::1], int64, float64[::1])", cache=True, error_model="numpy")
def _gamma_weights(a, q, w):
    # Gamma correction (bird.md 2, BIRD+ step 1): w = (a/max a)^gamma, gamma = q/4; w = 0 where a = 0
    # (also for gamma = 0); a non-finite norm (NaN/Inf in the block) gets w = +Inf: kept for sure,
    # so the NaN/Inf propagates to the result instead of being silently dropped.
    amax = _finite_max_any(a)
    r = np.empty(_WCHUNK, np.float64)
    pw = np.empty(_WCHUNK, np.float64)
    for j0 in range(0, a.shape[0], _WCHUNK):
        j1 = min(a.shape[0], j0 + _WCHUNK)
        _weights_chunk(a[j0:j1], amax, q, 0.0, 0, r, pw, w[j0:j1])


@njit("float64(float64[::1], float64)", cache=True)
def _solve_scale(w, k):
    """A such that sum_i min(1, A*w_i) = k (water filling; w = 0 gets p = 0, w = Inf gets p = 1).

    Returns +Inf when k covers every positive weight. Each iteration is one sequential pass; the
    capped set only grows, so it stops after at most a handful of passes in practice.
    """
    npos = 0
    for i in range(w.shape[0]):
        if w[i] > 0.0:
            npos += 1
    if k >= npos:
        return np.inf
    a = 0.0
    capped = -1
    for _ in range(w.shape[0] + 2):
        c = 0
        free = 0.0
        for i in range(w.shape[0]):
            wi = w[i]
            if wi == np.inf or (a > 0.0 and a * wi >= 1.0):
                c += 1
            else:
                free += wi
        if c == capped:
            break
        capped = c
        if free <= 0.0 or k - c <= 0.0:
            break
        a = (k - c) / free
    return a


@njit("void(float64[::1], float64, float64[::1])", cache=True)
def _probabilities(w, a, p):
    for i in range(w.shape[0]):
        wi = w[i]
        if wi > 0.0:
            x = a * wi if a < np.inf else 1.0
            p[i] = x if x < 1.0 else 1.0
        else:
            p[i] = 0.0


@njit("int64(float64[::1], float64, float64, int64[::1])", cache=True)
def _systematic(p, k, u, out):
    """Uniform-distribution (systematic) sampling (bird.md 2, BIRD+ step 3).

    One u in [0,1); walk the float64 cumulative sum C_i of p (rescaled so the total is exactly k)
    and keep block i when floor(C_i - u) > floor(C_{i-1} - u). Block i is kept with probability
    p_i; exactly k blocks are kept when k is an integer. Sequential: same result everywhere.
    """
    m = p.shape[0]
    total = 0.0
    for i in range(m):
        total += p[i]
    if total <= 0.0:
        return 0
    if k < 0.0:  # natural walk: no rescaling, floor(total) or ceil(total) blocks
        k = total
    f = k / total
    c = 0.0
    last = math.floor(-u)  # C_{-1} = 0
    j = 0
    for i in range(m):
        c += p[i]
        cs = k if i == m - 1 else (c * f if f != 1.0 else c)
        fl = math.floor(cs - u)
        if fl > last:
            if p[i] > 0.0:
                out[j] = i
                j += 1
            last = fl
    return j


@njit(cache=True, inline="always")
def _tree8(p, o):
    # the sum of p[o:o+8] in a fixed tree (vectorises across groups)
    return ((p[o] + p[o + 1]) + (p[o + 2] + p[o + 3])) + ((p[o + 4] + p[o + 5]) + (p[o + 6] + p[o + 7]))


@njit(cache=True, inline="always")
def _tree8_prefix(p, o, pre):
    # partial sums consistent with _tree8: monotone (each one adds non-negative terms to a
    # sub-sum of the next), pre[i] == pre[i-1] exactly when p[o+i] == 0, pre[7] == _tree8(p, o)
    s01 = p[o] + p[o + 1]
    s03 = s01 + (p[o + 2] + p[o + 3])
    s45 = p[o + 4] + p[o + 5]
    pre[0] = p[o]
    pre[1] = s01
    pre[2] = s01 + p[o + 2]
    pre[3] = s03
    pre[4] = s03 + p[o + 4]
    pre[5] = s03 + s45
    pre[6] = s03 + (s45 + p[o + 6])
    pre[7] = s03 + (s45 + (p[o + 6] + p[o + 7]))


@njit("int64(float64[::1], uint64, int64[::1])", cache=True)
def _bernoulli(p, seed, out):
    # BIRD stage 2: keep block i when u_i < p_i, u_i = uniform(seed, i) independent per block
    j = 0
    for i in range(p.shape[0]):
        if p[i] > 0.0 and uniform(seed, i) < p[i]:
            out[j] = i
            j += 1
    return j


@njit("void(float64[::1], uint64, int64, float64[::1])", cache=True)
def _sample_norms(a, seed, s, out):
    m = a.shape[0]
    for j in range(s):
        out[j] = a[min(m - 1, np.int64(uniform(seed, j) * m))]


def gamma_weights(a: np.ndarray, gamma: float) -> np.ndarray:
    """(a / max a) ** gamma as float64 with gamma a multiple of 0.25 (see :func:`_pow_quarters`)."""
    _check(a, np.float32, "gamma_weights a")
    w = np.empty(a.shape[0], np.float64)
    _gamma_weights(a, np.int64(gamma_quarters(gamma)), w)
    return w


def gamma_quarters(gamma: float) -> int:
    q = float(gamma) * 4.0
    if not (0.0 <= q <= 256.0) or q != int(q):
        raise ValueError(f"gamma must be a multiple of 0.25 in [0, 64], got {gamma!r}")
    return int(q)


def walk(p: np.ndarray, u: float) -> np.ndarray:
    """Systematic sampling; when sum p is an integer (up to rounding) exactly that many blocks."""
    s = float(np.sum(p)) if p.shape[0] else 0.0
    k = float(np.floor(s + 0.5))
    if k > 0 and abs(s - k) <= 1e-9 * max(1.0, k):
        return systematic(p, int(k), u)
    return systematic_natural(p, u)


def systematic(p: np.ndarray, k: int, u: float) -> np.ndarray:
    _check(p, np.float64, "systematic p")
    out = np.empty(p.shape[0], np.int64)
    j = _systematic(p, float(k), float(u), out)
    return out[:j]


def bernoulli(p: np.ndarray, seed: int) -> np.ndarray:
    _check(p, np.float64, "bernoulli p")
    out = np.empty(p.shape[0], np.int64)
    j = _bernoulli(p, as_seed(seed), out)
    return out[:j]


def sample_norms(a: np.ndarray, seed: int, s: int) -> np.ndarray:
    _check(a, np.float64, "sample_norms a")
    out = np.empty(s, np.float64)
    if s and a.shape[0]:
        _sample_norms(a, as_seed(seed), np.int64(s), out)
    return out


def probabilities_for(w: np.ndarray, a: float) -> np.ndarray:
    """p_i = min(1, a*w_i) for a given scale a (BIRD: a = 1/tau from the sample)."""
    _check(w, np.float64, "probabilities_for w")
    p = np.empty(w.shape[0], np.float64)
    _probabilities(w, float(a), p)
    return p


def systematic_natural(p: np.ndarray, u: float) -> np.ndarray:
    """Systematic sampling without rescaling the total: floor(S) or ceil(S) blocks for S = sum p."""
    _check(p, np.float64, "systematic p")
    out = np.empty(p.shape[0], np.int64)
    j = _systematic(p, -1.0, float(u), out)
    return out[:j]
