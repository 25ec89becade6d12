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
import threading

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


@njit(cache=True, inline="always")
def _block_l1_8(x, lo):
    # _block_l1 for a full block of 8 (bit-identical: 0 + |x| = |x|), unrolled so LLVM vectorises it
    s0 = abs(x[lo])
    s1 = abs(x[lo + 1])
    s2 = abs(x[lo + 2])
    s3 = abs(x[lo + 3])
    s4 = abs(x[lo + 4])
    s5 = abs(x[lo + 5])
    s6 = abs(x[lo + 6])
    s7 = abs(x[lo + 7])
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


# Kernels below loop from 0 over slices: with a loop index that LLVM can prove non-negative,
# Numba's negative-index wraparound disappears and the loops vectorise (2-10x faster).

_INF_BITS = np.int32(0x7F800000)


@njit(cache=True)
def _norms_chunk(xs, u0s, us, v0s, vs, momentum, b, mode, out):
    """Block norms of one chunk (xs, u0s/us, v0s/vs: its elements; out: its blocks). The
    accumulators are read from u0s/v0s and written to us/vs (the same arrays to update in place; a
    round's scratch otherwise, so its committed state needs no copy first). mode 0: out = L1(x);
    1: v = v0 + x, out = L1(v); 2: u = momentum*u0 + x, v = v0 + u, out = L1(v); 3: u = momentum*u0
    + x, out = L1(u) (the block-age accumulator, which keeps no v). Returns the largest finite
    norm as int32 bits (for non-negative floats the bit order is the value order; NaN/Inf excluded).
    Full blocks of 8 take an unrolled path with the same arithmetic as _block_l1."""
    n = xs.shape[0]
    nb = out.shape[0]
    j0 = 0
    if b == 8:
        jf = min(nb, n // 8)
        if mode == 0:
            for j in range(jf):
                out[j] = _block_l1_8(xs, 8 * j)
        elif mode == 1:
            for j in range(jf):
                lo = 8 * j
                for i in range(8):
                    vs[lo + i] = v0s[lo + i] + xs[lo + i]
                out[j] = _block_l1_8(vs, lo)
        elif mode == 2:
            for j in range(jf):
                lo = 8 * j
                for i in range(8):
                    us[lo + i] = momentum * u0s[lo + i] + xs[lo + i]
                    vs[lo + i] = v0s[lo + i] + us[lo + i]
                out[j] = _block_l1_8(vs, lo)
        else:
            for j in range(jf):
                lo = 8 * j
                for i in range(8):
                    us[lo + i] = momentum * u0s[lo + i] + xs[lo + i]
                out[j] = _block_l1_8(us, lo)
        j0 = jf
    for j in range(j0, nb):
        lo = j * b
        hi = min(n, lo + b)
        if mode == 0:
            out[j] = _block_l1(xs, lo, hi)
        elif mode == 3:
            for i in range(lo, hi):
                us[i] = momentum * u0s[i] + xs[i]
            out[j] = _block_l1(us, lo, hi)
        else:
            if mode == 1:
                for i in range(lo, hi):
                    vs[i] = v0s[i] + xs[i]
            else:
                for i in range(lo, hi):
                    us[i] = momentum * u0s[i] + xs[i]
                    vs[i] = v0s[i] + us[i]
            out[j] = _block_l1(vs, lo, hi)
    bits = out.view(np.int32)
    mx = np.int32(0)
    for j in range(nb):
        t = bits[j]
        t = np.int32(0) if t >= _INF_BITS else t
        mx = max(mx, t)
    return mx


#: blocks per parallel chunk of the norm pass
_NORM_CHUNK = 8192


@njit(cache=True, inline="always")
def _norms_one_chunk(x, u0, u, v0, v, momentum, b, mode, out, c):
    n = x.shape[0]
    j0 = c * _NORM_CHUNK
    j1 = min(out.shape[0], j0 + _NORM_CHUNK)
    lo = j0 * b
    hi = min(n, j1 * b)
    hu = mode >= 2
    hv = mode in (1, 2)
    return _norms_chunk(x[lo:hi], u0[lo:hi] if hu else u0, u[lo:hi] if hu else u,
                        v0[lo:hi] if hv else v0, v[lo:hi] if hv else v, momentum, b, mode, out[j0:j1])


_NORMS_SIG = ("int32(float32[::1], float32[::1], float32[::1], float32[::1], float32[::1], float32, int64, "
              "int64, float32[::1])")


@njit(_NORMS_SIG, cache=True, parallel=True)
def _norms_pass(x, u0, u, v0, v, momentum, b, mode, out):
    # chunks of blocks in parallel; the per-block arithmetic does not depend on the thread count
    nch = -(-out.shape[0] // _NORM_CHUNK)
    cmax = np.zeros(nch, np.int32)
    for c in prange(nch):
        cmax[c] = _norms_one_chunk(x, u0, u, v0, v, momentum, b, mode, out, c)
    mx = np.int32(0)
    for c in range(nch):
        mx = max(mx, cmax[c])
    return mx


@njit(_NORMS_SIG, cache=True)
def _norms_pass_serial(x, u0, u, v0, v, momentum, b, mode, out):
    # same arithmetic as _norms_pass without a thread launch (small tensors)
    mx = np.int32(0)
    for c in range(-(-out.shape[0] // _NORM_CHUNK)):
        mx = max(mx, _norms_one_chunk(x, u0, u, v0, v, momentum, b, mode, out, c))
    return mx


def _block_norms(x, b, out):
    e = np.empty(0, np.float32)
    _norms_pass(x, e, e, e, e, np.float32(0.0), b, np.int64(0), out)


def _block_norms_serial(x, b, out):
    e = np.empty(0, np.float32)
    _norms_pass_serial(x, e, e, e, e, np.float32(0.0), b, np.int64(0), out)


#: below this many elements the serial kernels win (a parallel launch costs ~0.1-0.3 ms)
SERIAL_BELOW = 1 << 16


def block_norms(x: np.ndarray, b: int, out: np.ndarray | None = None) -> np.ndarray:
    """L1 norm of every block of ``b`` elements of float32 ``x`` (float32, length ceil(n/b))."""
    _check(x, np.float32, "block_norms x")
    m = -(-x.shape[0] // b)
    if out is None:
        out = np.empty(m, np.float32)
    _check(out, np.float32, "block_norms out", m)
    (_block_norms if x.shape[0] >= SERIAL_BELOW else _block_norms_serial)(x, np.int64(b), out)
    return out


def norms_max(x: np.ndarray, u: np.ndarray | None, v: np.ndarray | None, momentum: float, b: int,
              out: np.ndarray, error_feedback: bool, u_in: np.ndarray | None = None,
              v_in: np.ndarray | None = None) -> float:
    """One pass over memory: block L1 norms into ``out`` (of ``x``, or of ``v`` after the error
    feedback update ``u = momentum*u + x; v += u`` / ``v += x`` when ``error_feedback``); returns
    the largest finite norm (0.0 when there is none). Norms are bit-identical to :func:`block_norms`.
    With ``u_in``/``v_in`` the update reads the accumulators from them and writes ``u``/``v`` whole
    (a round's scratch filled without copying the committed state into it first)."""
    n = x.shape[0]
    _check(x, np.float32, "norms x")
    _check(out, np.float32, "norms out", -(-n // b))
    e = np.empty(0, np.float32)
    mode = 0
    if error_feedback:
        _check(v, np.float32, "accumulate v", n)
        v_in = v if v_in is None else v_in
        _check(v_in, np.float32, "accumulate v_in", n)
        mode = 1
        if u is not None:
            _check(u, np.float32, "accumulate u", n)
            u_in = u if u_in is None else u_in
            _check(u_in, np.float32, "accumulate u_in", n)
            mode = 2
    kern = _norms_pass if n >= SERIAL_BELOW else _norms_pass_serial
    uu = e if mode != 2 else u
    vv = e if mode == 0 else v
    bits = kern(x, e if mode != 2 else u_in, uu, e if mode == 0 else v_in, vv, np.float32(momentum),
                np.int64(b), np.int64(mode), out)
    return float(np.array([bits], np.int32).view(np.float32)[0])


def momentum_norms(x: np.ndarray, u: np.ndarray, momentum: float, b: int, out: np.ndarray,
                   u_in: np.ndarray | None = None) -> None:
    """One pass: ``u = momentum*u + x`` and the block L1 norms of u into ``out`` (the block-age
    accumulator of docs/codecs.md keeps the momentum only; the same per-block arithmetic as
    :func:`norms_max`, so the same for any thread count). With ``u_in`` the momentum is read from
    it and ``u`` written whole."""
    n = x.shape[0]
    _check(x, np.float32, "momentum_norms x")
    _check(u, np.float32, "momentum_norms u", n)
    u_in = u if u_in is None else u_in
    _check(u_in, np.float32, "momentum_norms u_in", n)
    _check(out, np.float32, "momentum_norms out", -(-n // b))
    kern = _norms_pass if n >= SERIAL_BELOW else _norms_pass_serial
    e = np.empty(0, np.float32)
    kern(x, u_in, u, e, e, np.float32(momentum), np.int64(b), np.int64(3), out)


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


@njit("int64(float64[::1], float64, int64[::1])", cache=True)
def _walk_grouped(p, u, out):
    """walk() (systematic sampling, exactly round(sum p) blocks when sum p is an integer up to
    1e-9 relative) with the cumulative sum built per group of 8: C advances by each group's
    tree sum and inside a group C_i = C_g + (partial tree sums, _tree8_prefix), so C is
    monotone, p = 0 never crosses and groups without a crossing are skipped. Sequential,
    fixed order, float64: the same result on every machine and for any thread count.
    (Loops run over chunk slices from 0 so that the group sums vectorise.)"""
    m = p.shape[0]
    ng = m // 8
    gs = np.empty(ng, np.float64)
    pre = np.empty(8, np.float64)
    fls = np.empty(8, np.float64)
    cg = _WCHUNK // 8  # groups per chunk
    for g0 in range(0, ng, cg):
        pc = p[8 * g0:8 * min(ng, g0 + cg)]
        gc = gs[g0:min(ng, g0 + cg)]
        for g in range(gc.shape[0]):
            gc[g] = _tree8(pc, 8 * g)
    total = 0.0
    for g in range(ng):
        total = total + gs[g]
    for i in range(8 * ng, m):
        total = total + p[i]
    if not (total > 0.0):
        return 0
    k = math.floor(total + 0.5)
    if not (k > 0.0 and abs(total - k) <= 1e-9 * max(1.0, k)):
        k = total  # natural walk: floor(total) or ceil(total) blocks
    f = k / total
    c = 0.0
    last = math.floor(-u)
    j = 0
    for g0 in range(0, ng, cg):
        pc = p[8 * g0:8 * min(ng, g0 + cg)]
        gc = gs[g0:min(ng, g0 + cg)]
        for g in range(gc.shape[0]):
            ce = c + gc[g]
            end = 8 * (g0 + g) + 7 == m - 1
            cs = k if end else min(ce * f, k)
            if math.floor(cs - u) > last:
                _tree8_prefix(pc, 8 * g, pre)
                for i in range(8):
                    fls[i] = math.floor(min((c + pre[i]) * f, k) - u)
                if end:
                    fls[7] = math.floor(k - u)
                # floor values are monotone in i (and >= last): a branch-free scan; out has room
                # for one unconditional store past the kept blocks
                for i in range(8):
                    out[j] = 8 * (g0 + g) + i
                    j += (fls[i] > last) & (pc[8 * g + i] > 0.0)
                    last = fls[i]
            c = ce
    for i in range(8 * ng, m):
        c = c + p[i]
        cs = k if i == m - 1 else min(c * f, k)
        fl = math.floor(cs - u)
        if fl > last:
            if p[i] > 0.0:
                out[j] = i
                j += 1
            last = fl
    return j


@njit("void(float64[::1], float64, float64, float64)", cache=True)
def _probabilities_mix(w, a, eps, floor):
    # in place: w becomes p = (1 - eps) * min(1, a*w) + eps * floor, the same operations as
    # _probabilities followed by _floor_mix (bit-identical), one pass and no second array
    for i in range(w.shape[0]):
        wi = w[i]
        if wi > 0.0:
            x = a * wi if a < np.inf else 1.0
            pi = x if x < 1.0 else 1.0
        else:
            pi = 0.0
        w[i] = (1.0 - eps) * pi + eps * floor


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


# -- BIR+ selection without full passes over float64 weights -----------------------------------------
#
# The water-filling scale A (sum_i min(1, A w_i) = k) caps the blocks with w_i >= t = 1/A, and
# t > w_(floor(k)+1) (the (floor(k)+1)-th largest weight: capping that many would exceed k). A
# bound L estimated from a fixed, seed-independent sample of the weights (or norms) splits the
# blocks: those above L are candidates (a few times k of them), those below only contribute their
# sum F to the free weight. The water filling runs on the candidates with F added; when its
# solution satisfies A*L < 1, no block below L is capped, so it is the solution of the full
# problem (the same iterates as _solve_scale, up to the order of the float64 sums). Otherwise
# (or when the candidates overflow their buffer) the callers fall back to the full-pass solve.

_BOUND_SEED = np.uint64(0x6A09E667F3BCC909)  # fixed: the bound must not depend on the round
_BOUND_SAMPLE = 4096
#: below this many blocks the full-pass solve is cheap enough
CANDIDATES_FROM = 32768


@njit(cache=True)
def _sample_bound(a, k):
    """A value L meant to lie below the (floor(k)+1)-th largest of ``a`` with ~1.25k..2k values
    above it, from a fixed pseudo-random sample (NaN counts as +Inf); 0.0 when the sample is too
    small to be useful. Only the speed depends on it, never the result."""
    m = a.shape[0]
    s = _BOUND_SAMPLE
    frac = (math.floor(k) + 1.0) / m
    r = np.int64(math.ceil(1.25 * s * frac + 4.0 * math.sqrt(s * frac) + 2.0))
    if r >= s // 2:
        return 0.0
    samp = np.empty(s, np.float64)
    for j in range(s):
        v = np.float64(a[min(m - 1, np.int64(uniform(_BOUND_SEED, j) * m))])
        samp[j] = v if v < np.inf else np.inf
    samp.sort()
    return samp[s - r]


def _candidate_capacity(m: int, k: float) -> int:
    frac = (np.floor(k) + 1.0) / m
    r = np.ceil(1.25 * _BOUND_SAMPLE * frac + 4.0 * np.sqrt(_BOUND_SAMPLE * frac) + 2.0)
    return int(min(m, 3.0 * m * r / _BOUND_SAMPLE + 4096))


@njit(cache=True)
def _water_fill(cand, nc, free0, ninf, npos, k):
    """(A, sum of the p_i) for sum_i min(1, A w_i) = k over the finite candidate weights cand[:nc]
    plus ``ninf`` infinite weights (always capped) and a free weight ``free0`` that is never capped.
    The iteration of _solve_scale; A = +Inf when k >= npos (every positive weight kept)."""
    if k >= npos:
        return np.inf, np.float64(npos)
    a = 0.0
    capped = -1
    c = ninf
    free = free0
    for _ in range(nc + 2):
        c = ninf
        free = free0
        for i in range(nc):
            wi = cand[i]
            if a > 0.0 and a * wi >= 1.0:
                c += 1
            else:
                free += wi
        if c == capped:
            break
        capped = c
        if free <= 0.0 or k - c <= 0.0:
            break
        a = (k - c) / free
    return a, c + a * free


@njit("float64(float64[::1], float64, float64, float64[::1])", cache=True)
def _solve_scale_candidates(w, k, wl, cand):
    """_solve_scale with the candidates w > wl; NaN when the bound does not hold (fall back)."""
    npos = 0
    ninf = 0
    nc = 0
    free = 0.0
    cap = cand.shape[0]
    for i in range(w.shape[0]):  # one sequential pass, fixed order
        wi = w[i]
        if wi > 0.0:
            npos += 1
        if wi == np.inf:
            ninf += 1
        elif wi > wl:
            if nc == cap:
                return np.nan
            cand[nc] = wi
            nc += 1
        else:
            free += wi
    a, _ = _water_fill(cand, nc, free, ninf, npos, k)
    if a < np.inf and not (a * wl < 1.0):
        return np.nan
    return a


@njit(cache=True, error_model="numpy")
def _weight_pass(a, amax, q, al, cand):
    """One pass over the float32 norms for the fused BIRD+ selection: the candidates' weights
    (norm > al; NaN/Inf counted apart), the free weight F of the others (eight float64 lanes,
    fixed order), the number of positive weights. Returns (F, npos, ninf, nc); nc = -1 on overflow."""
    m = a.shape[0]
    cap = cand.shape[0]
    r = np.empty(_WCHUNK, np.float64)
    pw = np.empty(_WCHUNK, np.float64)
    w = np.empty(_WCHUNK, np.float64)
    fr = np.zeros(_WCHUNK, np.float64)
    fc = np.zeros(_WCHUNK, np.float64)
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    npos = 0
    ninf = 0
    nc = 0
    for j0 in range(0, m, _WCHUNK):
        aa = a[j0:min(m, j0 + _WCHUNK)]
        nn = aa.shape[0]
        _weights_chunk(aa, amax, q, 0.0, 0, r, pw, w)
        for i in range(nn):
            wi = w[i]
            npos += wi > 0.0
            isc = not (np.float64(aa[i]) <= al)  # above the bound, or NaN
            fc[i] = 1.0 if isc else 0.0
            fr[i] = 0.0 if isc else wi
        for i in range(nn, _WCHUNK):
            fr[i] = 0.0
            fc[i] = 0.0
        for g in range(0, _WCHUNK, 8):
            s0 += fr[g]
            s1 += fr[g + 1]
            s2 += fr[g + 2]
            s3 += fr[g + 3]
            s4 += fr[g + 4]
            s5 += fr[g + 5]
            s6 += fr[g + 6]
            s7 += fr[g + 7]
        # candidates are rare: visit only the groups of 8 that hold one, compact them without
        # data-dependent branches (cand has room for the unconditional store)
        for g in range(_WCHUNK // 8):
            if _tree8(fc, 8 * g) > 0.0:
                if nc + 8 > cap:
                    return 0.0, 0, 0, -1
                for i in range(8 * g, 8 * g + 8):
                    isc = fc[i] > 0.0
                    isinf = w[i] == np.inf
                    cand[nc] = w[i]
                    nc += isc & (not isinf)
                    ninf += isc & isinf
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), npos, ninf, nc


@njit(cache=True, error_model="numpy")
def _weight_pass_groups(a, amax, q, al, wl, cand, gw):
    """_weight_pass that also writes the tree sum of the weights of every full group of 8 blocks
    into gw (m // 8 entries, for _walk_groups) and works per group: a group holds a candidate
    (norm > al, or NaN) only if its sum is >= wl = the weight of al (weights are monotone in the
    norm), so only those groups are visited block by block; the others add their sum to the free
    weight F whole (eight float64 lanes over the groups, fixed order; F differs from
    _weight_pass's only by the order of the float64 additions). Same returns, except that npos
    is a lower bound (the groups with a positive weight): exact when <= the count of groups."""
    m = a.shape[0]
    cap = cand.shape[0]
    r = np.empty(_WCHUNK, np.float64)
    pw = np.empty(_WCHUNK, np.float64)
    w = np.empty(_WCHUNK, np.float64)
    gf = np.zeros(_WCHUNK // 8, np.float64)
    gl = np.zeros(_WCHUNK // 8 + 1, np.int64)
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    fx = 0.0  # free weight of the visited groups (sequential)
    npos = 0
    ninf = 0
    nc = 0
    for j0 in range(0, m, _WCHUNK):
        aa = a[j0:min(m, j0 + _WCHUNK)]
        nn = aa.shape[0]
        _weights_chunk(aa, amax, q, 0.0, 0, r, pw, w)
        ngc = nn // 8
        gwc = gw[j0 // 8:j0 // 8 + ngc]
        for g in range(ngc):
            gwc[g] = _tree8(w, 8 * g)
        # groups that may hold a candidate: listed branch-free; the others' sums are free weight
        ngl = 0
        for g in range(ngc):
            t = gwc[g]
            vis = t >= wl
            npos += t > 0.0
            gf[g] = 0.0 if vis else t
            gl[ngl] = g
            ngl += vis
        for g in range(ngc, _WCHUNK // 8):
            gf[g] = 0.0
        for g in range(0, _WCHUNK // 8, 8):
            s0 += gf[g]
            s1 += gf[g + 1]
            s2 += gf[g + 2]
            s3 += gf[g + 3]
            s4 += gf[g + 4]
            s5 += gf[g + 5]
            s6 += gf[g + 6]
            s7 += gf[g + 7]
        if ngc < _WCHUNK // 8 and 8 * ngc < nn:  # the last 1..7 blocks: visited
            gl[ngl] = ngc
            ngl += 1
            for i in range(8 * ngc, nn):
                npos += w[i] > 0.0
        if nc + 8 * ngl > cap:
            return 0.0, 0, 0, -1
        # visited groups: compact their candidates without data-dependent branches (cand has
        # room for the unconditional store), the other blocks' weights are free weight
        for t in range(ngl):
            g = gl[t]
            for i in range(8 * g, min(nn, 8 * g + 8)):
                isc = not (np.float64(aa[i]) <= al)  # above the bound, or NaN
                wi = w[i]
                isinf = wi == np.inf
                cand[nc] = wi
                nc += isc & (not isinf)
                ninf += isc & isinf
                fx += 0.0 if isc else wi
    return (((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))) + fx, npos, ninf, nc


@njit(cache=True, inline="always")
def _gap(val):
    # distance of val to the nearest integer (how far a floor decision is from flipping)
    fl = math.floor(val)
    return min(val - fl, fl + 1.0 - val)


@njit(cache=True, error_model="numpy")
def _walk_fused(a, amax, q, scale, k, f, u, ids, pk):
    """Systematic sampling (as _systematic) over p_i = min(1, scale * w_i) computed on the fly from
    the float32 norms (w_i as _gamma_weights). The cumulative sum C advances per group of 8 blocks
    by the group's tree sum (one float64 add per group on the chain), a group is skipped when
    floor(f*C - u) does not change over it, and inside a crossing group C_i = C_g + the partial
    tree sums of _tree8_prefix, so C is monotone and a block with p = 0 never crosses. f*C_i is clamped to k and forced to k at the last block, so
    at most k blocks are kept (exactly k when k is an integer and the last crossing is on a block
    with p > 0). Writes the kept ids and their p. Returns (number kept, final C, smallest distance
    of a floor decision from an integer): the caller re-walks with f = k / C when a different f
    could have moved a decision."""
    m = a.shape[0]
    r = np.empty(_WCHUNK, np.float64)
    pw = np.empty(_WCHUNK, np.float64)
    w = np.empty(_WCHUNK, np.float64)
    gs = np.empty(_WCHUNK // 8, np.float64)
    pre = np.empty(8, np.float64)
    fls = np.empty(8, np.float64)
    fin = scale < np.inf
    c = 0.0
    last = math.floor(-u)
    j = 0
    dmin = np.inf
    for j0 in range(0, m, _WCHUNK):
        aa = a[j0:min(m, j0 + _WCHUNK)]
        nn = aa.shape[0]
        _weights_chunk(aa, amax, q, 0.0, 0, r, pw, w)  # (a literal pmode: no branch in the loop)
        if fin:
            for i in range(nn):
                t = w[i]
                x = scale * t
                x = x if x < 1.0 else 1.0
                w[i] = x if t > 0.0 else 0.0
        else:
            for i in range(nn):
                w[i] = 1.0 if w[i] > 0.0 else 0.0
        if j0 + nn < m:  # not the last chunk (nn == _WCHUNK): groups of 8
            for g in range(_WCHUNK // 8):
                gs[g] = _tree8(w, 8 * g)
            for g in range(_WCHUNK // 8):
                ce = c + gs[g]
                val = min(ce * f, k) - u
                dmin = min(dmin, _gap(val))
                if math.floor(val) > last:
                    _tree8_prefix(w, 8 * g, pre)  # pre[7] == gs[g]: C at the group's end is ce
                    for i in range(8):
                        val = min((c + pre[i]) * f, k) - u
                        dmin = min(dmin, _gap(val))
                        fls[i] = math.floor(val)
                    # floor values are monotone in i (and >= last): a branch-free scan; ids and
                    # pk have room for one unconditional store past the kept blocks
                    for i in range(8):
                        ids[j] = j0 + 8 * g + i
                        pk[j] = w[8 * g + i]
                        j += (fls[i] > last) & (w[8 * g + i] > 0.0)
                        last = fls[i]
                c = ce
        else:
            for i in range(nn):
                p = w[i]
                c = c + p
                if j0 + i == m - 1:
                    val = k - u  # forced: does not depend on f
                else:
                    val = min(c * f, k) - u
                    dmin = min(dmin, _gap(val))
                fl = math.floor(val)
                if fl > last:
                    if p > 0.0:
                        ids[j] = j0 + i
                        pk[j] = p
                        j += 1
                    last = fl
    return j, c, dmin


@njit(cache=True, inline="always")
def _group_p(a, amax, q, scale, o, r, pw, w):
    # p = min(1, scale * w) of the 8 blocks from o, exactly as _walk_fused computes them (scale finite)
    if q == 64:  # the default gamma 16 without the generic chunk code (same operations)
        for i in range(8):
            ad = np.float64(a[o + i])
            t = ad / amax
            t = t * t
            t = t * t
            t = t * t
            t = t * t
            w[i] = _finish(ad, t, 0.0, 0)
    else:
        _weights_chunk(a[o:o + 8], amax, q, 0.0, 0, r, pw, w)
    for i in range(8):
        t = w[i]
        x = scale * t
        x = x if x < 1.0 else 1.0
        w[i] = x if t > 0.0 else 0.0


@njit(cache=True, error_model="numpy")
def _walk_groups(a, amax, q, scale, k, f, u, gw, ids, pk):
    """_walk_fused (finite scale) without recomputing every weight: the cumulative sum C advances
    per group of 8 by scale * gw[g] (gw: the groups' weight sums from _weight_pass_groups; when it is
    < 1 no block of the group is capped, so it is the group's sum of p up to rounding). Only a
    group whose approximate sum is >= 1 (a capped or NaN/Inf block) or whose end crosses an
    integer has its 8 p computed exactly; then C advances by their exact tree sum (_tree8_prefix,
    pre[7]) instead and the crossing is located inside the group as in _walk_fused. C stays
    monotone, ``last`` is always floor(f*C - u) of the C walked, and a block with p = 0 never
    crosses, so the count of kept blocks is that of _walk_fused. The last 1..8 blocks are walked
    one by one (the last forced to k). Same returns as _walk_fused."""
    m = a.shape[0]
    r = np.empty(8, np.float64)
    pw = np.empty(8, np.float64)
    w = np.empty(8, np.float64)
    pre = np.empty(8, np.float64)
    fls = np.empty(8, np.float64)
    ngw = (m - 1) // 8  # groups walked as groups; the rest one by one
    c = 0.0
    last = np.floor(-u)
    j = 0
    dmin = np.inf
    g = 0
    while g < ngw:
        # the common case in a tight loop: groups without a capped block and without a crossing
        while g < ngw:
            s = scale * gw[g]
            ce = c + s
            val = min(ce * f, k) - u
            fl = np.floor(val)
            if not (s < 1.0) or fl > last:
                break
            d = min(val - fl, fl + 1.0 - val)
            dmin = d if d < dmin else dmin
            c = ce
            g += 1
        if g == ngw:
            break
        # group g: its 8 p exactly, C advances by their tree sum
        _group_p(a, amax, q, scale, 8 * g, r, pw, w)
        _tree8_prefix(w, 0, pre)  # pre[7] == _tree8(w, 0)
        for i in range(8):
            val = min((c + pre[i]) * f, k) - u
            fl = np.floor(val)
            d = min(val - fl, fl + 1.0 - val)
            dmin = d if d < dmin else dmin
            fls[i] = fl
        # floor values are monotone in i (and >= last): a branch-free scan; ids and pk have
        # room for one unconditional store past the kept blocks
        for i in range(8):
            ids[j] = 8 * g + i
            pk[j] = w[i]
            j += (fls[i] > last) & (w[i] > 0.0)
            last = fls[i]
        c = c + pre[7]
        g += 1
    j0 = 8 * ngw
    nn = m - j0
    _weights_chunk(a[j0:m], amax, q, 0.0, 0, r, pw, w)
    for i in range(nn):
        t = w[i]
        x = scale * t
        x = x if x < 1.0 else 1.0
        p = x if t > 0.0 else 0.0
        c = c + p
        if j0 + i == m - 1:
            val = k - u  # forced: does not depend on f
        else:
            val = min(c * f, k) - u
            dmin = min(dmin, _gap(val))
        fl = math.floor(val)
        if fl > last:
            if p > 0.0:
                ids[j] = j0 + i
                pk[j] = p
                j += 1
            last = fl
    return j, c, dmin


# -- gather / scatter / clear (O(kept blocks)) ----------------------------------------------------

# Loops index 0-based slices (see _norms_chunk): Numba then drops the negative-index checks and a
# block's loads are independent, so the cache misses of the (scattered) kept blocks overlap.

@njit(cache=True, inline="always")
def _gather_one(x, b, ids, scale, out, j):
    n = x.shape[0]
    lo = ids[j] * b
    s = np.float32(scale[j])
    o = out[j * b:(j + 1) * b]
    if lo + b <= n:
        src = x[lo:lo + b]
        for i in range(b):
            o[i] = src[i] * s
    else:
        src = x[lo:n]
        for i in range(src.shape[0]):
            o[i] = src[i] * s
        for i in range(src.shape[0], b):
            o[i] = 0.0


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
    src = vals[j * b:j * b + (hi - lo)]
    dst = out[lo:hi]
    if add:
        for i in range(dst.shape[0]):
            dst[i] += np.float32(src[i])
    else:
        for i in range(dst.shape[0]):
            dst[i] = np.float32(src[i])


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
        src = sent[j * b:j * b + (hi - lo)]
        dst = v[lo:hi]
        for i in range(dst.shape[0]):
            dst[i] = dst[i] - np.float32(src[i])
        if use_u:
            uu = u[lo:hi]
            for i in range(uu.shape[0]):
                uu[i] = 0.0


@njit(cache=True, inline="always")
def _gather_sub_one(v, u, use_u, b, ids, scale, out, j):
    # _gather_one then _subtract_sent of the same block with what was just gathered (the same
    # float32 operations as the two kernels), touching the scattered block once
    n = v.shape[0]
    lo = ids[j] * b
    hi = min(n, lo + b)
    s = np.float32(scale[j])
    o = out[j * b:(j + 1) * b]
    src = v[lo:hi]
    for i in range(src.shape[0]):
        t = src[i] * s
        o[i] = t
        src[i] = src[i] - t
    for i in range(src.shape[0], b):
        o[i] = 0.0
    if use_u:
        uu = u[lo:hi]
        for i in range(uu.shape[0]):
            uu[i] = 0.0


@njit(cache=True, parallel=True)
def _gather_subtract(v, u, b, ids, scale, out):
    use_u = u.shape[0] == v.shape[0]
    for j in prange(ids.shape[0]):
        _gather_sub_one(v, u, use_u, b, ids, scale, out, j)


@njit(cache=True)
def _gather_subtract_serial(v, u, b, ids, scale, out):
    use_u = u.shape[0] == v.shape[0]
    for j in range(ids.shape[0]):
        _gather_sub_one(v, u, use_u, b, ids, scale, out, j)


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
    """A with sum_i min(1, A*w_i) = k. Large inputs: water filling on the candidates above a
    sampled bound (:func:`_solve_scale_candidates`), else / on failure the full-pass solve."""
    _check(w, np.float64, "solve_scale w")
    k = float(k)
    m = w.shape[0]
    if m >= CANDIDATES_FROM:
        a = float(_solve_scale_candidates(w, k, float(_sample_bound(w, k)),
                                          np.empty(_candidate_capacity(m, k), np.float64)))
        if not np.isnan(a):
            return a
    return float(_solve_scale(w, k))


def solve_scale_full(w: np.ndarray, k: float) -> float:
    """The reference full-pass water filling (one sequential pass per iteration)."""
    _check(w, np.float64, "solve_scale w")
    return float(_solve_scale(w, float(k)))


def probabilities(w: np.ndarray, k: float) -> np.ndarray:
    """p_i = min(1, A*w_i) with sum p = k (A from :func:`solve_scale`)."""
    a = solve_scale(w, k)
    p = np.empty(w.shape[0], np.float64)
    _probabilities(w, a, p)
    return p


def birdplus_select(a: np.ndarray, amax: float, gamma: float, k: float, u: float,
                    bound: float | None = None, capacity: int | None = None,
                    grouped: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """BIRD+ selection from float32 block norms ``a`` (``amax`` = their largest finite value, as
    returned by :func:`norms_max`): p_i = min(1, A*w_i) with w = gamma_weights(a, gamma) and
    sum p = k, then systematic sampling with ``u``. Returns (kept ids int64 ascending, their p
    float64). Same result as probabilities() + systematic walk up to the order of float64 sums,
    without materialising w or p: one pass over the norms for the candidates and the free weight,
    the water filling on the candidates, one walk over the per-group weight sums (weights
    recomputed only in the groups with a crossing or a capped block). ``bound`` / ``capacity``
    override the sampled candidate bound and the candidate buffer size (tests: force the fallback);
    ``grouped=False`` runs :func:`_weight_pass` and :func:`_walk_fused` (every weight computed
    again in the walk) instead of :func:`_weight_pass_groups` and :func:`_walk_groups` (tests:
    the reference; the same selection up to float64 rounding)."""
    _check(a, np.float32, "birdplus_select a")
    m = a.shape[0]
    q = gamma_quarters(gamma)
    k = float(k)
    if m == 0:
        return np.empty(0, np.int64), np.empty(0, np.float64)
    al = 0.0
    cap = m
    if m >= CANDIDATES_FROM:
        al = min(float(_sample_bound(a, k)), amax)
        cap = _candidate_capacity(m, k)
    if bound is not None:
        al = min(float(bound), amax)
    if capacity is not None:
        cap = int(capacity)
    cand = np.empty(cap, np.float64)
    wl = float(_pow_quarters(al / amax, np.int64(q))) if al > 0.0 else 0.0
    if grouped:
        gw = _scratch(m // 8)
        free, npos, ninf, nc = _weight_pass_groups(a, np.float64(amax), np.int64(q), np.float64(al),
                                                   np.float64(wl), cand, gw)
        if npos <= k:  # a lower bound: only k >= npos matters, so count exactly only then
            npos = int(np.count_nonzero(gamma_weights(a, gamma) > 0.0))
    else:
        free, npos, ninf, nc = _weight_pass(a, np.float64(amax), np.int64(q), np.float64(al), cand)
    scale = np.nan
    if nc >= 0:
        scale, total = _water_fill(cand, np.int64(nc), free, np.int64(ninf), np.int64(npos), k)
        if scale < np.inf and not (scale * wl < 1.0):
            scale = np.nan
    if np.isnan(scale):  # the bound did not hold: full-pass solve on materialised weights
        w = gamma_weights(a, gamma)
        p = np.empty(m, np.float64)
        _probabilities(w, _solve_scale(w, k), p)
        ids = walk(p, u)
        return ids, p[ids]
    kk = float(np.floor(total + 0.5))
    natural = False  # as walk(): exactly kk blocks when sum p is the integer kk up to rounding
    if kk > 0 and abs(total - kk) <= 1e-9 * max(1.0, kk):
        kw, f = kk, kk / total
    elif total > 0.0:
        kw, f, natural = total, 1.0, True
    else:
        return np.empty(0, np.int64), np.empty(0, np.float64)
    nmax = int(np.ceil(kw)) + 1
    ids = np.empty(nmax, np.int64)
    pk = np.empty(nmax, np.float64)
    args = (a, np.float64(amax), np.int64(q), np.float64(scale))
    if grouped and scale < np.inf:  # per-group weight sums from the weight pass
        walker = lambda kw, f: _walk_groups(*args, np.float64(kw), np.float64(f), np.float64(u),  # noqa: E731
                                            gw, ids, pk)
    else:
        walker = lambda kw, f: _walk_fused(*args, np.float64(kw), np.float64(f), np.float64(u),  # noqa: E731
                                           ids, pk)
    j, c, dmin = walker(kw, f)
    # f came from the analytic sum of p, not from the walk's own sum c: if rescaling by kw / c
    # instead could move a decision (the smallest distance of one from an integer is within the
    # difference, plus rounding), walk again with the walk's own sum (as _systematic does).
    if not dmin > abs(c * f - kw) + 8 * np.finfo(np.float64).eps * max(1.0, kw):
        if not c > 0.0:
            return np.empty(0, np.int64), np.empty(0, np.float64)
        if natural:
            kw = c
        else:
            f = kw / c
        j, _, _ = walker(kw, f)
    return ids[:j], pk[:j]


_tls = threading.local()


def _scratch(n: int) -> np.ndarray:
    # a per-thread float64 buffer reused across calls (birdplus_select's group sums): a fresh
    # 1.5 MB array per compression costs page faults on every call
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.shape[0] < n:
        buf = _tls.buf = np.empty(max(n, 1), np.float64)
    return buf[:n]


def walk_grouped(p: np.ndarray, u: float) -> np.ndarray:
    """:func:`walk` with the cumulative sum built per group of 8 (see :func:`_walk_grouped`)."""
    _check(p, np.float64, "walk p")
    out = np.empty(int(np.ceil(p.shape[0])) + 1, np.int64)
    j = _walk_grouped(p, float(u), out)
    return out[:j]


def shared_probabilities(w: np.ndarray, k: float, eps: float, floor: float) -> np.ndarray:
    """In place (w becomes p): p = (1 - eps) * min(1, A*w) + eps * floor with sum min(1, A*w) = k."""
    _probabilities_mix(w, solve_scale(w, k), float(eps), float(floor))
    return w


def walk(p: np.ndarray, u: float) -> np.ndarray:
    """Systematic sampling; when sum p is an integer (up to rounding) exactly that many blocks."""
    s = float(np.sum(p)) if p.shape[0] else 0.0
    k = float(np.floor(s + 0.5))
    if k > 0 and abs(s - k) <= 1e-9 * max(1.0, k):
        return systematic(p, int(k), u)
    return systematic_natural(p, u)


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


def gather_subtract(v: np.ndarray, u: np.ndarray | None, b: int, ids: np.ndarray, scale: np.ndarray,
                    out: np.ndarray) -> np.ndarray:
    """:func:`gather_blocks` from the error-feedback accumulator ``v`` followed by
    :func:`subtract_sent` of the float32 values gathered (v keeps v - sent, u is cleared on the
    sent blocks), in one visit of each kept block; bit-identical to the two calls."""
    _check(v, np.float32, "gather_subtract v")
    _check(out, np.float32, "gather_subtract out", ids.shape[0] * b)
    if u is None:
        u = np.empty(0, np.float32)
    if ids.shape[0]:
        kern = _gather_subtract if out.shape[0] >= SERIAL_BELOW else _gather_subtract_serial
        kern(v, u, np.int64(b), ids, scale, out)
    return out


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


# -- shared mode: the proposal of the next round's blocks (docs/codecs.md, "shared mode") -----------
# These run on K (about 1% of m) values or once over the m norms, on the proposing node only
# (top_blocks) or on every node with identical inputs (decode_ids, uniform_blocks): NumPy and the
# radix select of birdnet.kernels.sparse, no new Numba kernels.

def top_blocks(a: np.ndarray, k: int) -> np.ndarray:
    """Ascending ids of the ``k`` largest block norms of float32 ``a`` (ties by lower id; NaN ranks
    above +Inf above every finite norm, as in the local selection), zero norms never."""
    from birdnet.kernels import sparse

    _check(a, np.float32, "top_blocks a")
    ids, vals = sparse.topk(a, int(k))
    return ids[vals != 0.0]


def residual_norms(norms: np.ndarray, ids: np.ndarray, scale: np.ndarray) -> None:
    """In place: the norms of the kept blocks after ``v -= scale * v`` (|1 - scale| times theirs),
    i.e. what is left on this node after the send (NaN/Inf stay non-finite)."""
    _check(norms, np.float32, "residual_norms norms")
    if ids.shape[0]:
        norms[ids] = norms[ids] * np.abs(np.float32(1.0) - scale.astype(np.float32))


def encode_ids(ids: np.ndarray, base: int, digits: int, out: np.ndarray) -> None:
    """out[j*digits + i] = digit i (least significant first, base ``base``) of ids[j] + 1 as float32;
    slots after len(ids) are 0 (empty). Every digit is an integer below ``base``, exact in the wire
    dtype, so adding the zeros of the other nodes keeps it."""
    _check(out, np.float32, "encode_ids out")
    nslot = out.shape[0] // digits
    if ids.shape[0] > nslot:
        raise ValueError(f"encode_ids: {ids.shape[0]} ids for {nslot} slots")
    out[:] = 0.0
    v = ids.astype(np.int64) + 1
    o = out.reshape(nslot, digits)
    for i in range(digits):
        o[:v.shape[0], i] = (v % base).astype(np.float32)
        v //= base


def decode_ids(tail: np.ndarray, base: int, digits: int, m: int) -> np.ndarray | None:
    """The distinct ascending ids encoded by :func:`encode_ids` in the summed ``tail`` (empty slots
    skipped), or None when it holds anything but whole digits below ``base`` or ids beyond ``m``
    (the bytes come from the network)."""
    if tail.shape[0] % digits:
        return None
    d = tail.reshape(-1, digits).astype(np.float64)
    if not np.all(np.isfinite(d)) or np.any(d < 0) or np.any(d >= base) or np.any(d != np.floor(d)):
        return None
    v = np.zeros(d.shape[0], np.int64)
    for i in reversed(range(digits)):
        v = v * base + d[:, i].astype(np.int64)
    v = v[v != 0]
    if v.shape[0] and int(v.max()) > m:
        return None
    return np.unique(v - 1)


def uniform_blocks(seed: int, m: int, k: int) -> np.ndarray:
    """``k`` ascending block ids, one drawn uniformly in each of k equal strata of [0, m), from the
    cluster seed: the shared selection of a tensor's first round, identical on every node."""
    from birdnet.kernels import sparse

    return sparse.randomk_indexes(seed, m, k)[0]


def finite_max(a: np.ndarray) -> float:
    """The largest finite value of non-negative float32 ``a`` (0.0 when there is none)."""
    _check(a, np.float32, "finite_max a")
    return float(_finite_max_any(a))
