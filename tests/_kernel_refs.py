"""Reference-only block kernels the tests check birdnet.kernels against: they were in
birdnet/kernels (blocks.py) but nothing there runs them. The slow, simple forms stay here beside
the tests that use them (tests/test_kernels_reference.py)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from birdnet.kernels._arrays import check as _check
from birdnet.kernels.select import solve_scale
from birdnet.kernels.weights import _WCHUNK, _solve_scale, _tree8, _tree8_prefix, _weights_chunk


@njit("void(float64[::1], float64, float64)", cache=True)
def _floor_mix(p, eps, floor):
    # shared mode: p = (1 - eps) * p_importance + eps * floor, so every block keeps a chance
    for i in range(p.shape[0]):
        p[i] = (1.0 - eps) * p[i] + eps * floor


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


def solve_scale_full(w: np.ndarray, k: float) -> float:
    """The full-pass water filling (one sequential pass per iteration): what ``solve_scale``'s
    candidate solve must agree with, and the fallback it takes when the bound does not hold."""
    _check(w, np.float64, "solve_scale w")
    return float(_solve_scale(w, float(k)))


def walk_grouped(p: np.ndarray, u: float) -> np.ndarray:
    """``walk`` with the cumulative sum built per group of 8 (see :func:`_walk_grouped`)."""
    _check(p, np.float64, "walk p")
    out = np.empty(int(np.ceil(p.shape[0])) + 1, np.int64)
    j = _walk_grouped(p, float(u), out)
    return out[:j]


def shared_probabilities(w: np.ndarray, k: float, eps: float, floor: float) -> np.ndarray:
    """In place (w becomes p): p = (1 - eps) * min(1, A*w) + eps * floor with sum min(1, A*w) = k."""
    _probabilities_mix(w, solve_scale(w, k), float(eps), float(floor))
    return w


def floor_mix(p: np.ndarray, eps: float, floor: float) -> np.ndarray:
    _check(p, np.float64, "floor_mix p")
    _floor_mix(p, float(eps), float(floor))
    return p
