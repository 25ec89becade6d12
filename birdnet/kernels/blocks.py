"""Block kernels for BIRD / BIRD+ (docs/codecs.md, ../shared/papers/bird.md section 2).

A tensor of n elements is m = ceil(n/b) contiguous blocks of b elements (the last one padded
virtually with zeros). Compression is one pass over memory (block L1 norms, fused with the error
feedback / momentum accumulation when enabled), then O(m) work on the norms only (weights,
probabilities, sampling), then a gather of the kept blocks.

Determinism: everything here uses no fast-math and a fixed evaluation order. A block's L1 norm is
computed by one thread with eight partial sums combined in a fixed tree, so it is the same for any
thread count and on any IEEE machine; the O(m) probability and sampling kernels are sequential and
use float64. This is what the ``shared`` selection mode relies on.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from birdnet.kernels.rng import as_seed, uniform


@njit(cache=True, inline="always")
def _block_l1(x, lo, hi):
    # fixed order: 8 lanes over full groups of 8, tree combine, then the tail sequentially
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
    i = lo
    while i + 8 <= hi:
        s0 += abs(x[i])
        s1 += abs(x[i + 1])
        s2 += abs(x[i + 2])
        s3 += abs(x[i + 3])
        s4 += abs(x[i + 4])
        s5 += abs(x[i + 5])
        s6 += abs(x[i + 6])
        s7 += abs(x[i + 7])
        i += 8
    s = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    while i < hi:
        s += abs(x[i])
        i += 1
    return s


@njit("void(float32[::1], int64, float32[::1])", cache=True, parallel=True)
def _block_norms(x, b, out):
    n = x.shape[0]
    for j in prange(out.shape[0]):
        out[j] = _block_l1(x, j * b, min(n, (j + 1) * b))


@njit("void(float32[::1], int64, float32[::1])", cache=True)
def _block_norms_serial(x, b, out):
    # same per-block arithmetic as _block_norms (bit-identical); no thread launch for small tensors
    n = x.shape[0]
    for j in range(out.shape[0]):
        out[j] = _block_l1(x, j * b, min(n, (j + 1) * b))


#: below this many elements the serial kernels win (a parallel launch costs ~0.1-0.3 ms)
SERIAL_BELOW = 1 << 16


@njit("void(float32[::1], float32[::1], float32[::1], float32, int64, float32[::1])",
      cache=True, parallel=True)
def _accumulate_norms(x, u, v, momentum, b, out):
    # error feedback fused with the norm pass (DGC momentum correction when u is non-empty):
    #   u = momentum*u + x ; v = v + u      (or v = v + x without momentum)
    n = x.shape[0]
    use_u = u.shape[0] == n
    for j in prange(out.shape[0]):
        lo = j * b
        hi = min(n, lo + b)
        if use_u:
            for i in range(lo, hi):
                u[i] = momentum * u[i] + x[i]
                v[i] = v[i] + u[i]
        else:
            for i in range(lo, hi):
                v[i] = v[i] + x[i]
        out[j] = _block_l1(v, lo, hi)


def block_norms(x: np.ndarray, b: int, out: np.ndarray | None = None) -> np.ndarray:
    """L1 norm of every block of ``b`` elements of float32 ``x`` (float32, length ceil(n/b))."""
    _check(x, np.float32, "block_norms x")
    m = -(-x.shape[0] // b)
    if out is None:
        out = np.empty(m, np.float32)
    _check(out, np.float32, "block_norms out", m)
    (_block_norms if x.shape[0] >= SERIAL_BELOW else _block_norms_serial)(x, np.int64(b), out)
    return out


def accumulate_norms(x: np.ndarray, u: np.ndarray | None, v: np.ndarray, momentum: float, b: int,
                     out: np.ndarray) -> np.ndarray:
    """In place: ``u = momentum*u + x; v += u`` (or ``v += x`` when u is None); out = block L1 of v."""
    n = x.shape[0]
    _check(x, np.float32, "accumulate x")
    _check(v, np.float32, "accumulate v", n)
    if u is None:
        u = np.empty(0, np.float32)
    else:
        _check(u, np.float32, "accumulate u", n)
    _check(out, np.float32, "accumulate out", -(-n // b))
    _accumulate_norms(x, u, v, np.float32(momentum), np.int64(b), out)
    return out


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


@njit("void(float32[::1], int64, float64[::1])", cache=True)
def _gamma_weights(a, q, w):
    # Gamma correction (bird.md 2, BIRD+ step 1): w = (a/max a)^gamma, gamma = q/4; w = 0 where a = 0
    # (also for gamma = 0); a non-finite norm (NaN/Inf in the block) gets w = +Inf: kept for sure,
    # so the NaN/Inf propagates to the result instead of being silently dropped.
    amax = 0.0
    for i in range(a.shape[0]):
        ai = np.float64(a[i])
        if ai > amax and ai < np.inf:
            amax = ai
    for i in range(a.shape[0]):
        ai = np.float64(a[i])
        if not (ai < np.inf):  # NaN or +Inf
            w[i] = np.inf
        elif ai > 0.0:
            w[i] = _pow_quarters(ai / amax, q)
        else:
            w[i] = 0.0


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


@njit("void(float64[::1], float64, float64)", cache=True)
def _floor_mix(p, eps, floor):
    # shared mode: p = (1 - eps) * p_importance + eps * floor, so every block keeps a chance
    for i in range(p.shape[0]):
        p[i] = (1.0 - eps) * p[i] + eps * floor


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


# -- gather / scatter / clear (O(kept blocks)) ----------------------------------------------------

@njit(cache=True, inline="always")
def _gather_one(x, b, ids, scale, out, j):
    n = x.shape[0]
    lo = ids[j] * b
    hi = min(n, lo + b)
    s = np.float32(scale[j])
    base = j * b
    for i in range(lo, hi):
        out[base + i - lo] = x[i] * s
    for i in range(hi - lo, b):
        out[base + i] = 0.0


@njit(cache=True, parallel=True)
def _gather_blocks(x, b, ids, scale, out):
    for j in prange(ids.shape[0]):
        _gather_one(x, b, ids, scale, out, j)


@njit(cache=True)
def _gather_blocks_serial(x, b, ids, scale, out):
    for j in range(ids.shape[0]):
        _gather_one(x, b, ids, scale, out, j)


@njit(cache=True, inline="always")
def _scatter_one(vals, b, ids, out, add, j):
    n = out.shape[0]
    lo = np.int64(ids[j]) * b
    hi = min(n, lo + b)
    base = j * b
    if add:
        for i in range(lo, hi):
            out[i] += np.float32(vals[base + i - lo])
    else:
        for i in range(lo, hi):
            out[i] = np.float32(vals[base + i - lo])


@njit(cache=True, parallel=True)
def _scatter_blocks(vals, b, ids, out, add):
    # ids are distinct (validated) so parallel writes never collide
    for j in prange(ids.shape[0]):
        _scatter_one(vals, b, ids, out, add, j)


@njit(cache=True)
def _scatter_blocks_serial(vals, b, ids, out, add):
    for j in range(ids.shape[0]):
        _scatter_one(vals, b, ids, out, add, j)


@njit(cache=True, parallel=True)
def _subtract_sent(v, u, b, ids, sent):
    # error feedback: v keeps what was not sent (v - sent); momentum u is cleared on sent blocks
    n = v.shape[0]
    use_u = u.shape[0] == n
    for j in prange(ids.shape[0]):
        lo = ids[j] * b
        hi = min(n, lo + b)
        base = j * b
        for i in range(lo, hi):
            v[i] = v[i] - np.float32(sent[base + i - lo])
            if use_u:
                u[i] = 0.0


@njit(cache=True)
def _distinct_ascending(ids, m):
    last = -1
    for j in range(ids.shape[0]):
        v = np.int64(ids[j])
        if v <= last or v >= m:
            return False
        last = v
    return True


# -- public wrappers --------------------------------------------------------------------------------

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


def solve_scale(w: np.ndarray, k: float) -> float:
    _check(w, np.float64, "solve_scale w")
    return float(_solve_scale(w, float(k)))


def probabilities(w: np.ndarray, k: float) -> np.ndarray:
    """p_i = min(1, A*w_i) with sum p = k (A from :func:`solve_scale`)."""
    a = solve_scale(w, k)
    p = np.empty(w.shape[0], np.float64)
    _probabilities(w, a, p)
    return p


def floor_mix(p: np.ndarray, eps: float, floor: float) -> np.ndarray:
    _check(p, np.float64, "floor_mix p")
    _floor_mix(p, float(eps), float(floor))
    return p


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


def gather_blocks(x: np.ndarray, b: int, ids: np.ndarray, scale: np.ndarray,
                  out: np.ndarray) -> np.ndarray:
    """out[j*b:(j+1)*b] = x[block ids[j]] * scale[j], zero-padded past n."""
    _check(x, np.float32, "gather_blocks x")
    _check(out, np.float32, "gather_blocks out", ids.shape[0] * b)
    if ids.shape[0]:
        kern = _gather_blocks if out.shape[0] >= SERIAL_BELOW else _gather_blocks_serial
        kern(x, np.int64(b), ids, scale, out)
    return out


def scatter_blocks(vals: np.ndarray, b: int, ids: np.ndarray, out: np.ndarray, add: bool) -> None:
    """out[block ids[j]] (+)= vals[j*b:...]; ids must be distinct and < m (validate payloads first)."""
    _check(out, np.float32, "scatter_blocks out")
    if vals.shape[0] != ids.shape[0] * b:
        raise ValueError(f"scatter_blocks: {vals.shape[0]} values for {ids.shape[0]} blocks of {b}")
    if ids.shape[0]:
        if vals.dtype != np.float32:  # Numba has no float16 arrays: widen the (small) payload
            vals = vals.astype(np.float32)
        kern = _scatter_blocks if vals.shape[0] >= SERIAL_BELOW else _scatter_blocks_serial
        kern(np.ascontiguousarray(vals), np.int64(b), np.ascontiguousarray(ids), out, add)


def subtract_sent(v: np.ndarray, u: np.ndarray | None, b: int, ids: np.ndarray, sent: np.ndarray) -> None:
    if u is None:
        u = np.empty(0, np.float32)
    if ids.shape[0]:
        _subtract_sent(v, u, np.int64(b), ids, np.ascontiguousarray(sent))


def distinct_ascending(ids: np.ndarray, m: int) -> bool:
    return bool(_distinct_ascending(np.ascontiguousarray(ids), np.int64(m)))


def _check(x: np.ndarray, dtype, what: str, length: int | None = None) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != dtype or x.ndim != 1 or not x.flags.c_contiguous:
        raise TypeError(f"{what} must be a 1-D C-contiguous {np.dtype(dtype).name} array; got "
                        f"{getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')}")
    if length is not None and x.shape[0] != length:
        raise ValueError(f"{what} must have {length} elements, has {x.shape[0]}")


@njit("void(float32[::1], float32[::1])", cache=True)
def _importance(imp, out):
    # shared mode: blocks never observed (imp < 0) count as the mean of the observed ones
    # (1 when none is observed yet: uniform). Sequential float64 sum: identical on every node.
    s = 0.0
    c = 0
    for i in range(imp.shape[0]):
        if imp[i] >= 0.0:
            s += np.float64(imp[i])
            c += 1
    fill = np.float32(s / c) if c > 0 else np.float32(1.0)
    if c > 0 and not (fill > 0.0):
        fill = np.float32(1.0)
    for i in range(imp.shape[0]):
        out[i] = imp[i] if imp[i] >= 0.0 else fill


def importance(imp: np.ndarray) -> np.ndarray:
    _check(imp, np.float32, "importance imp")
    out = np.empty(imp.shape[0], np.float32)
    _importance(imp, out)
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
