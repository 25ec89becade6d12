"""BIRD+ selection from the block norms without full passes over float64 weights (docs/codecs.md):
the water-filling scale on candidates above a sampled bound, then one walk over per-group weight
sums. Same result as ``weights``' probabilities and walk up to the order of float64 sums. The
public functions are the block codecs' API through ``birdnet.kernels.blocks``.
"""
from __future__ import annotations

import math
import threading

import numpy as np
from numba import njit

from birdnet.kernels._arrays import check as _check
from birdnet.kernels._paths import threshold as _threshold
from birdnet.kernels.rng import uniform
from birdnet.kernels.weights import (
    _WCHUNK,
    _finish,
    _pow_quarters,
    _probabilities,
    _solve_scale,
    _tree8,
    _tree8_prefix,
    _weights_chunk,
    gamma_quarters,
    gamma_weights,
    walk,
)

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
def _weight_pass_groups(a, amax, q, al, wl, cand, gw):
    """The weight pass (its simple form, ``_weight_pass``, is the tests' reference: one pass over
    the float32 norms for the candidates' weights, the free weight F of the others and the number
    of positive weights) that also writes the tree sum of the weights of every full group of 8
    blocks into gw (m // 8 entries, for _walk_groups) and works per group: a group holds a candidate
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


def solve_scale(w: np.ndarray, k: float) -> float:
    """A with sum_i min(1, A*w_i) = k. Large inputs: water filling on the candidates above a
    sampled bound (:func:`_solve_scale_candidates`), else / on failure the full-pass solve."""
    _check(w, np.float64, "solve_scale w")
    k = float(k)
    m = w.shape[0]
    if m >= _threshold("CANDIDATES_FROM", CANDIDATES_FROM):
        a = float(_solve_scale_candidates(w, k, float(_sample_bound(w, k)),
                                          np.empty(_candidate_capacity(m, k), np.float64)))
        if not np.isnan(a):
            return a
    return float(_solve_scale(w, k))


def probabilities(w: np.ndarray, k: float) -> np.ndarray:
    """p_i = min(1, A*w_i) with sum p = k (A from :func:`solve_scale`)."""
    a = solve_scale(w, k)
    p = np.empty(w.shape[0], np.float64)
    _probabilities(w, a, p)
    return p


def birdplus_select(a: np.ndarray, amax: float, gamma: float, k: float, u: float,
                    bound: float | None = None, capacity: int | None = None,
                    weight_pass=None) -> tuple[np.ndarray, np.ndarray]:
    """BIRD+ selection from float32 block norms ``a`` (``amax`` = their largest finite value, as
    returned by :func:`norms_max`): p_i = min(1, A*w_i) with w = gamma_weights(a, gamma) and
    sum p = k, then systematic sampling with ``u``. Returns (kept ids int64 ascending, their p
    float64). Same result as probabilities() + systematic walk up to the order of float64 sums,
    without materialising w or p: one pass over the norms for the candidates and the free weight,
    the water filling on the candidates, one walk over the per-group weight sums (weights
    recomputed only in the groups with a crossing or a capped block). ``bound`` / ``capacity``
    override the sampled candidate bound and the candidate buffer size (tests: force the fallback);
    ``weight_pass(a, amax, q, al, cand) -> (F, npos, ninf, nc)`` replaces :func:`_weight_pass_groups`
    and :func:`_walk_groups` by that pass and :func:`_walk_fused` (every weight computed again in
    the walk): tests pass their reference pass (tests/test_kernels_reference.py) and check that
    the selection is the same up to float64 rounding."""
    _check(a, np.float32, "birdplus_select a")
    m = a.shape[0]
    q = gamma_quarters(gamma)
    k = float(k)
    if m == 0:
        return np.empty(0, np.int64), np.empty(0, np.float64)
    al = 0.0
    cap = m
    if m >= _threshold("CANDIDATES_FROM", CANDIDATES_FROM):
        al = min(float(_sample_bound(a, k)), amax)
        cap = _candidate_capacity(m, k)
    if bound is not None:
        al = min(float(bound), amax)
    if capacity is not None:
        cap = int(capacity)
    cand = np.empty(cap, np.float64)
    wl = float(_pow_quarters(al / amax, np.int64(q))) if al > 0.0 else 0.0
    grouped = weight_pass is None
    if grouped:
        gw = _scratch(m // 8)
        free, npos, ninf, nc = _weight_pass_groups(a, np.float64(amax), np.int64(q), np.float64(al),
                                                   np.float64(wl), cand, gw)
        if npos <= k:  # a lower bound: only k >= npos matters, so count exactly only then
            npos = int(np.count_nonzero(gamma_weights(a, gamma) > 0.0))
    else:
        free, npos, ninf, nc = weight_pass(a, np.float64(amax), np.int64(q), np.float64(al), cand)
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
