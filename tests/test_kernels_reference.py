"""Every kernel against a slow NumPy reference (STYLE.md: stumpy/pynndescent lesson)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from _kernel_refs import _weight_pass, floor_mix, shared_probabilities, solve_scale_full, walk_grouped

from birdnet.kernels import blocks as B
from birdnet.kernels import quant as Q
from birdnet.kernels import rng
from birdnet.kernels import select as SEL
from birdnet.kernels import sparse as S
from birdnet.kernels import weights as W

M64 = (1 << 64) - 1


def ref_uniform(seed: int, i: int) -> float:
    z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    z ^= z >> 31
    return (z >> 11) / 2.0 ** 53


def data(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_uniform_matches_pure_python_bit_for_bit():
    out = np.empty(300)
    for seed in (0, 1, 2 ** 63 - 1, 123456789):
        rng.fill_uniform(seed, out)
        assert [float(v) for v in out] == [ref_uniform(seed, i) for i in range(300)]
        assert rng.uniform_scalar(seed, 7) == ref_uniform(seed, 7)


def test_uniform_is_roughly_uniform():
    out = rng.fill_uniform(42, np.empty(100_000))
    assert 0.0 <= out.min() and out.max() < 1.0
    assert abs(out.mean() - 0.5) < 5 * math.sqrt(1 / 12 / out.size)


def test_digest_depends_on_selection():
    a = np.arange(10, dtype=np.int64)
    assert rng.digest(1, a) == rng.digest(1, a.copy())
    assert rng.digest(1, a) != rng.digest(1, a[:-1])
    assert rng.digest(1, a) != rng.digest(2, a)
    assert 0 <= rng.digest(1, a) < 2 ** 63


@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (1000, 10), (1000, 1000), (4099, 1), (50_000, 500)])
def test_topk_matches_argsort(n, k):
    x = data(n, n)
    idx, val = S.topk(x, k)
    ref = np.sort(np.argsort(-np.abs(x), kind="stable")[:k])
    np.testing.assert_array_equal(idx, ref)
    np.testing.assert_array_equal(val, x[ref])


def test_topk_ties_and_zeros_and_nan():
    x = np.zeros(100, np.float32)
    x[[5, 50, 70]] = [1.0, -1.0, 1.0]
    idx, _ = S.topk(x, 2)
    np.testing.assert_array_equal(idx, [5, 50])  # ties in index order
    x[3] = np.nan
    idx, val = S.topk(x, 1)
    assert idx[0] == 3 and np.isnan(val[0])  # NaN ranks highest: it propagates
    assert S.topk(np.empty(0, np.float32), 5)[0].size == 0


def test_topk_rejects_bad_input():
    with pytest.raises(TypeError, match="contiguous float32"):
        S.topk(np.ones(10), 2)
    with pytest.raises(TypeError):
        S.topk(np.ones(20, np.float32)[::2], 2)


def test_threshold_select_reference():
    x = data(20_000, 3)
    k = 200
    idx, val = S.threshold_select(x, k, seed=9, sample=2000)
    thr = np.abs(x[idx]).min()
    # every element at or above the threshold is selected (unless trimmed by exact top-k)
    if idx.size <= 2 * k:
        np.testing.assert_array_equal(idx, np.flatnonzero(np.abs(x) >= thr))
    np.testing.assert_array_equal(val, x[idx])
    assert 0.5 * k < idx.size <= 2 * k


def test_randomk_indexes_reference():
    n, k, seed = 1003, 17, 55
    idx, scale = S.randomk_indexes(seed, n, k)
    for i in range(k):
        lo, hi = i * n // k, (i + 1) * n // k
        assert idx[i] == lo + min(hi - lo - 1, int(ref_uniform(seed, i) * (hi - lo)))
        assert scale[i] == hi - lo
    assert np.all(np.diff(idx) > 0)


def test_scatter_add_reference():
    out = np.ones(10, np.float32)
    S.scatter_add(np.array([1, 3, 3], np.uint32), np.array([1, 2, 3], np.float32), out)
    np.testing.assert_array_equal(out, [1, 2, 1, 6, 1, 1, 1, 1, 1, 1])


def ref_block_norms(x, b):
    m = -(-x.size // b)
    return np.abs(np.pad(x.astype(np.float64), (0, m * b - x.size))).reshape(m, b).sum(1)


@pytest.mark.parametrize("n,b", [(0, 32), (1, 32), (31, 32), (33, 32), (1000, 8), (1001, 7), (4096, 1), (5000, 100)])
def test_block_norms_reference(n, b):
    x = data(n, n)
    np.testing.assert_allclose(B.block_norms(x, b), ref_block_norms(x, b), rtol=1e-5, atol=1e-6)


def test_block_norms_fixed_order_is_exact():
    # the documented order: 8 float32 lanes, tree combine, then the tail
    x = data(45, 1)
    a = np.abs(x)
    lanes = np.zeros(8, np.float32)
    for g in range(5):
        lanes += a[8 * g:8 * g + 8]
    s = np.float32((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + np.float32((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
    for t in a[40:45]:
        s = np.float32(s + t)
    assert B.block_norms(x, 45)[0] == s


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_accumulate_norms_reference(momentum):
    n, b = 1003, 32
    x, u0, v0 = data(n, 1), data(n, 2), data(n, 3)
    u, v = u0.copy(), v0.copy()
    out = np.empty(-(-n // b), np.float32)
    amax = B.norms_max(x, u if momentum else None, v, momentum, b, out, error_feedback=True)
    assert amax == out.max()
    if momentum:
        ru = np.float32(momentum) * u0 + x
        rv = v0 + ru
        np.testing.assert_array_equal(u, ru)
    else:
        rv = v0 + x
    np.testing.assert_array_equal(v, rv)
    np.testing.assert_allclose(out, ref_block_norms(rv, b), rtol=1e-5)


@pytest.mark.parametrize("gamma", [0, 0.25, 0.5, 1, 2, 3, 4, 8, 4.75])
def test_gamma_weights_reference(gamma):
    a = np.abs(data(500, 4))
    a[[3, 9]] = 0.0
    w = B.gamma_weights(a, gamma)
    ref = np.where(a > 0, (a.astype(np.float64) / a.max()) ** gamma, 0.0)
    np.testing.assert_allclose(w, ref, rtol=1e-12)
    assert w[3] == 0 and w[9] == 0


def test_gamma_weights_nonfinite_are_kept():
    a = np.array([1.0, np.nan, np.inf, 0.0, 2.0], np.float32)
    w = B.gamma_weights(a, 2)
    assert w[1] == np.inf and w[2] == np.inf and w[3] == 0 and w[4] == 1.0 and w[0] == 0.25
    with pytest.raises(ValueError):
        B.gamma_quarters(0.3)


def ref_probabilities(w, k):
    # bisection reference for sum min(1, A w) = k
    lo, hi = 0.0, 1e30
    for _ in range(400):
        mid = 0.5 * (lo + hi)
        if np.minimum(1.0, mid * w).sum() < k:
            lo = mid
        else:
            hi = mid
    return np.minimum(1.0, hi * w)


@pytest.mark.parametrize("k", [1, 5, 50, 199])
def test_probabilities_reference(k):
    w = B.gamma_weights(np.abs(data(200, k)), 4)
    p = B.probabilities(w, k)
    np.testing.assert_allclose(p, ref_probabilities(w, k), atol=1e-9)
    assert abs(p.sum() - k) < 1e-9


def test_probabilities_saturated_and_zero():
    w = np.array([0.0, 1.0, 0.5, 0.0])
    np.testing.assert_array_equal(B.probabilities(w, 3), [0, 1, 1, 0])


def ref_systematic(p, k, u):
    c = np.cumsum(p) * (k / p.sum())
    c[-1] = k
    prev = np.concatenate([[0.0], c[:-1]])
    return np.flatnonzero((np.floor(c - u) > np.floor(prev - u)) & (p > 0))


def test_systematic_reference_and_exact_count():
    w = B.gamma_weights(np.abs(data(1000, 8)), 2)
    p = B.probabilities(w, 37)
    for u in (0.0, 0.1, 0.5, 0.999999):
        ids = B.systematic(p, 37, u)
        assert ids.size == 37
        np.testing.assert_array_equal(ids, ref_systematic(p, 37, u))
        assert np.all(p[ids] > 0)
    # blocks with p = 1 are always kept
    p2 = np.array([1.0, 0.5, 0.5, 0.0, 1.0])
    for u in np.linspace(0, 0.99, 7):
        ids = B.systematic(p2, 3, u)
        assert {0, 4} <= set(ids) and 3 not in ids and ids.size == 3


def test_bernoulli_reference():
    p = np.linspace(0, 1, 101)
    ids = B.bernoulli(p, 77)
    ref = [i for i in range(101) if p[i] > 0 and ref_uniform(77, i) < p[i]]
    np.testing.assert_array_equal(ids, ref)


def test_gather_scatter_subtract_reference():
    n, b = 100, 32
    x = data(n, 5)
    ids = np.array([0, 3], np.int64)  # block 3 is partial (96..99)
    scale = np.array([2.0, 0.5], np.float32)
    out = B.gather_blocks(x, b, ids, scale, np.empty(64, np.float32))
    np.testing.assert_array_equal(out[:32], x[:32] * np.float32(2.0))
    np.testing.assert_array_equal(out[32:36], x[96:] * np.float32(0.5))
    assert not out[36:].any()
    dense = np.zeros(n, np.float32)
    B.scatter_blocks(out, b, ids, dense, add=True)
    B.scatter_blocks(out, b, ids, dense, add=True)
    ref = np.zeros(n, np.float32)
    ref[:32] = 2 * out[:32]
    ref[96:] = 2 * out[32:36]
    np.testing.assert_array_equal(dense, ref)
    v = x.copy()
    u = np.ones(n, np.float32)
    B.subtract_sent(v, u, b, ids, out)
    np.testing.assert_array_equal(v[:32], x[:32] - out[:32])
    assert not u[:32].any() and not u[96:].any() and u[32:96].all()
    assert B.distinct_ascending(np.array([1, 2, 5]), 6)
    assert not B.distinct_ascending(np.array([1, 1]), 6) and not B.distinct_ascending(np.array([6]), 6)


def test_importance_fill():
    imp = np.array([-1, 2, -1, 4], np.float32)
    np.testing.assert_array_equal(B.importance(imp), [3, 2, 3, 4])
    np.testing.assert_array_equal(B.importance(np.full(3, -1, np.float32)), [1, 1, 1])


def test_qsgd_reference_and_unbiased():
    x = data(2000, 6)
    norm, lv = Q.qsgd_quantise(x, 8, 123)
    assert norm == pytest.approx(np.linalg.norm(x.astype(np.float64)), rel=1e-12)
    r = np.abs(x.astype(np.float64)) * (8 / norm)
    u = np.array([ref_uniform(123, i) for i in range(x.size)])
    ref = np.minimum(8, np.floor(r + u)) * np.where(x < 0, -1, 1)
    np.testing.assert_array_equal(lv, ref)
    acc = np.zeros(x.size)
    trials = 400
    for t in range(trials):
        norm, lv = Q.qsgd_quantise(x, 8, t)
        o = np.zeros(x.size, np.float32)
        Q.dequantise_add(lv, norm / 8, o)
        acc += o
    step = norm / 8
    assert np.all(np.abs(acc / trials - x) <= 5 * 0.5 * step / math.sqrt(trials) + 1e-6)


def test_efsign_reference():
    x = data(1001, 7)
    r0 = data(1001, 8) * np.float32(0.1)
    r = r0.copy()
    scale, bits = Q.ef_sign_compress(x, r)
    p = x + r0
    assert scale == pytest.approx(np.abs(p.astype(np.float64)).mean(), rel=1e-6)
    np.testing.assert_array_equal(bits, np.packbits(p >= 0, bitorder="little"))
    d = np.where(p >= 0, np.float32(scale), np.float32(-scale)).astype(np.float32)
    np.testing.assert_array_equal(r, p - d)
    o = np.zeros(1001, np.float32)
    Q.signs_add(bits, scale, o)
    np.testing.assert_array_equal(o, d)


# -- norm pass with the finite maximum; candidate solve; fused BIRD+ selection ----------------------

@pytest.mark.parametrize("n,b", [(1, 8), (7, 8), (8, 8), (1003, 8), (70_001, 8), (1001, 7), (5000, 32), (4096, 1)])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_norms_max_matches_block_norms_and_reference(n, b, mode):
    x, u0, v0 = data(n, 1), data(n, 2), data(n, 3)
    if n > 10:
        x[3] = np.nan if mode != 2 else np.inf  # excluded from the maximum
    u, v = u0.copy(), v0.copy()
    out = np.empty(-(-n // b), np.float32)
    amax = B.norms_max(x, u if mode == 2 else None, v if mode else None, 0.9, b, out, error_feedback=mode > 0)
    if mode == 0:
        src = x
    elif mode == 1:
        src = v0 + x
        np.testing.assert_array_equal(v, src)
    else:
        ru = np.float32(0.9) * u0 + x
        src = v0 + ru
        np.testing.assert_array_equal(u, ru)
        np.testing.assert_array_equal(v, src)
    np.testing.assert_array_equal(out, B.block_norms(np.ascontiguousarray(src), b))  # bit-identical
    np.testing.assert_allclose(out, ref_block_norms(src, b), rtol=1e-5, atol=1e-6)
    fin = out[np.isfinite(out)]
    assert amax == (float(fin.max()) if fin.size else 0.0)


@pytest.mark.parametrize("n", [7, 1003, 70_001])
@pytest.mark.parametrize("mode", [1, 2, 3])
def test_norm_pass_into_scratch_equals_in_place(n, mode):
    """u_in/v_in: the accumulators read from the committed state and written whole into a round's
    scratch (garbage before) give bit-for-bit what the in-place update gives, and leave the inputs."""
    x, u0, v0 = data(n, 1), data(n, 2), data(n, 3)
    u, v = u0.copy(), v0.copy()
    su, sv = np.full(n, np.nan, np.float32), np.full(n, 7.0, np.float32)  # scratch: anything before
    out, sout = np.empty(-(-n // 8), np.float32), np.empty(-(-n // 8), np.float32)
    if mode == 3:
        B.momentum_norms(x, u, 0.9, 8, out)
        B.momentum_norms(x, su, 0.9, 8, sout, u_in=u0)
        np.testing.assert_array_equal(su, u)
    else:
        m = B.norms_max(x, u if mode == 2 else None, v, 0.9, 8, out, True)
        sm = B.norms_max(x, su if mode == 2 else None, sv, 0.9, 8, sout, True,
                         u_in=u0 if mode == 2 else None, v_in=v0)
        assert sm == m
        np.testing.assert_array_equal(sv, v)
        if mode == 2:
            np.testing.assert_array_equal(su, u)
    np.testing.assert_array_equal(sout, out)
    np.testing.assert_array_equal(u0, data(n, 2))  # the committed state is read only
    np.testing.assert_array_equal(v0, data(n, 3))


def test_norms_max_no_finite_norm():
    out = np.empty(2, np.float32)
    assert B.norms_max(np.array([np.nan] * 16, np.float32), None, None, 0.0, 8, out, False) == 0.0
    assert B.norms_max(np.zeros(16, np.float32), None, None, 0.0, 8, out, False) == 0.0


@pytest.mark.parametrize("gamma", [0, 0.25, 1, 2, 4, 8, 16, 32, 64, 4.75, 3])
def test_gamma_weights_vectorised_equal_scalar_sequence_bit_for_bit(gamma):
    a = np.abs(data(1000, 9)) * np.float32(3.0)
    a[[1, 2, 3]] = [0.0, np.nan, np.inf]
    w = B.gamma_weights(a, gamma)
    fin = a[np.isfinite(a)]
    amax = float(fin.max())
    q = B.gamma_quarters(gamma)
    ref = [np.inf if not np.isfinite(ai) else (W._pow_quarters(float(ai) / amax, q) if ai > 0 else 0.0) for ai in a]
    np.testing.assert_array_equal(w, ref)


def _adversarial_weights(m, rs):
    """(name, w, k) cases for the water filling; w as gamma_weights produces them (>= 0, +Inf)."""
    cases = []
    base = rs.exponential(1.0, m)
    cases.append(("random g16", (base / base.max()) ** 16, 0.01 * m))
    cases.append(("random g1", base / base.max(), 0.01 * m))
    cases.append(("ties", rs.choice([0.0, 0.25, 0.5, 1.0], m), 0.01 * m))
    w = np.zeros(m)
    w[rs.choice(m, m // 10, replace=False)] = rs.random(m // 10)
    cases.append(("90% zeros", w, 0.01 * m))
    cases.append(("all equal", np.ones(m), 0.01 * m))
    w = np.full(m, 1e-6)
    w[rs.choice(m, min(m, 5), replace=False)] = 1.0
    cases.append(("a few huge", w, 0.01 * m))
    w = rs.random(m)
    w[rs.choice(m, min(m, 7), replace=False)] = np.inf
    cases.append(("Inf", w, 0.01 * m))
    w = np.full(m, 1e-300)
    w[: int(0.01 * m) + 3] = 1.0  # t just above the (k+1)-th weight
    cases.append(("heavy tail", w, 0.01 * m))
    w = np.zeros(m)
    npos = min(m, 50)
    w[rs.choice(m, npos, replace=False)] = rs.random(npos) + 0.01
    cases.append(("k >= positives", w, float(npos)))
    cases.append(("k > positives", w, npos + 30.0))
    cases.append(("non-integer k", rs.random(m), 0.0137 * m))
    return cases


@pytest.mark.parametrize("m", [1, 2, 5, 300, 40_000, 100_003])
def test_candidate_solve_equals_full_solve(m):
    rs = np.random.default_rng(m)
    for name, w, k in _adversarial_weights(m, rs):
        k = max(min(k, float(m)), 0.5)
        full = solve_scale_full(w, k)
        fast = B.solve_scale(w, k)
        if full == np.inf:
            assert fast == np.inf, name
        else:
            assert fast == pytest.approx(full, rel=1e-12, abs=0.0), name
        # the candidate kernel directly, with a bound that holds, one that does not, a tiny buffer
        cap = np.empty(m, np.float64)
        a0 = SEL._solve_scale_candidates(w, k, 0.0, cap)
        assert a0 == full or a0 == pytest.approx(full, rel=1e-12), name
        if 0.0 < full < np.inf and np.isfinite(w).any() and np.nanmax(w[np.isfinite(w)]) * full > 1.0 + 1e-9:
            # a bound above the threshold 1/A: not every capped block is a candidate -> NaN (fall back)
            wl = float(np.max(w[np.isfinite(w)]))
            assert np.isnan(SEL._solve_scale_candidates(w, k, wl * (1 - 1e-15), cap)), name
        if m > 10 and (w[np.isfinite(w)] > 0).sum() > 2:
            assert np.isnan(SEL._solve_scale_candidates(w, k, 0.0, np.empty(1, np.float64))) or full == np.inf, name


def ref_select(a, gamma, k, u):
    """The unfused pipeline: gamma weights, full-pass solve, probabilities, sequential walk."""
    w = B.gamma_weights(a, gamma)
    p = np.empty(a.shape[0])
    W._probabilities(w, solve_scale_full(w, k), p)
    ids = B.walk(p, u)
    return ids, p


def _amax(a):
    fin = a[np.isfinite(a)]
    return float(fin.max()) if fin.size else 0.0


@pytest.mark.parametrize("m", [1, 7, 255, 256, 257, 1000, 40_000, 100_003])
@pytest.mark.parametrize("gamma", [16, 4, 1, 0, 4.75])
def test_birdplus_select_equals_unfused_pipeline(m, gamma):
    rs = np.random.default_rng(m + int(4 * gamma))
    a = (rs.exponential(1.0, m) * rs.exponential(1.0, m)).astype(np.float32)
    a[rs.random(m) < 0.05] = 0.0
    k = max(1, int(np.floor(0.01 * m + 0.5)))
    for u in (0.0, 0.3, 0.999999):
        ids, pk = B.birdplus_select(a, _amax(a), gamma, k, u)
        rids, p = ref_select(a, gamma, k, u)
        assert ids.size == k
        np.testing.assert_allclose(pk, p[ids], rtol=1e-12)
        if u > 0.0:  # (u = 0: the last crossing is at exactly k, decided by rounding in both)
            np.testing.assert_array_equal(ids, rids)  # random data: rounding decides no crossing


@pytest.mark.parametrize("m", [300, 40_000])
def test_birdplus_select_adversarial_norms(m):
    rs = np.random.default_rng(5)
    k = max(1, int(np.floor(0.01 * m + 0.5)))
    cases = {
        "all equal": np.ones(m, np.float32),
        "ties": rs.choice([0.0, 1.0, 2.0], m).astype(np.float32),
        "zeros": np.where(rs.random(m) < 0.9, 0.0, rs.random(m)).astype(np.float32),
        "a few huge": np.where(rs.random(m) < 3.0 / m, 1e30, 1e-3).astype(np.float32),
        "NaN/Inf": np.where(rs.random(m) < 0.002, np.nan, rs.random(m)).astype(np.float32),
        "few positive": np.where(np.arange(m) % (m // 2) == 1, 1.0, 0.0).astype(np.float32),
        "all zero": np.zeros(m, np.float32),
    }
    cases["NaN/Inf"][[0, m - 1]] = np.inf
    for name, a in cases.items():
        for gamma in (16, 1):
            w = B.gamma_weights(a, gamma)
            want = min(k, int((w > 0).sum()))
            for u in (0.25, 0.5):  # (u = 0 puts crossings at exact integers: rounding decides)
                ids, pk = B.birdplus_select(a, _amax(a), gamma, k, u)
                rids, p = ref_select(a, gamma, k, u)
                assert ids.size == rids.size == max(want, int((~np.isfinite(a)).sum())), name
                assert np.all(np.diff(ids) > 0) and np.all(pk > 0), name
                np.testing.assert_allclose(pk, p[ids], rtol=1e-12, err_msg=name)
                assert set(np.flatnonzero(~np.isfinite(a))) <= set(ids.tolist()), name  # NaN/Inf kept


def test_birdplus_select_fallback_paths():
    rs = np.random.default_rng(11)
    m = 50_000
    a = rs.exponential(1.0, m).astype(np.float32)
    k = 500
    rids, p = ref_select(a, 16, k, 0.4)
    amax = _amax(a)
    for kw in ({"bound": float(amax)}, {"bound": float(np.sort(a)[-k // 2])}, {"capacity": 3}, {"bound": 0.0}):
        ids, pk = B.birdplus_select(a, amax, 16, k, 0.4, **kw)
        np.testing.assert_array_equal(ids, rids)
        np.testing.assert_allclose(pk, p[ids], rtol=1e-12)


def test_birdplus_select_inclusion_probabilities():
    # systematic sampling over the fused walk (groups of 8, chunk boundaries): block i is kept with
    # probability p_i; 4000 draws of u (fixed seed), every block within 5 sigma + 1e-3
    rs = np.random.default_rng(3)
    m, k, trials = 2000, 100, 4000
    a = (rs.exponential(1.0, m) ** 2).astype(np.float32)
    _, p = ref_select(a, 1, k, 0.0)
    hits = np.zeros(m)
    for u in rs.random(trials):
        ids, _ = B.birdplus_select(a, _amax(a), 1, k, float(u))
        assert ids.size == k
        hits[ids] += 1
    freq = hits / trials
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / trials) + 1e-3)


def _select_cases(m, rs):
    """Norm arrays for the grouped/fused comparisons: random, ties, zeros, NaN/Inf, huge, equal."""
    cases = {
        "random": (rs.exponential(1.0, m) * rs.exponential(1.0, m)).astype(np.float32),
        "ties": rs.choice([0.0, 1.0, 2.0], m).astype(np.float32),
        "zeros": np.where(rs.random(m) < 0.9, 0.0, rs.random(m)).astype(np.float32),
        "a few huge": np.where(rs.random(m) < 3.0 / m, 1e30, 1e-3).astype(np.float32),
        "NaN/Inf": np.where(rs.random(m) < 0.002, np.nan, rs.random(m)).astype(np.float32),
        "all equal": np.ones(m, np.float32),
        "all zero": np.zeros(m, np.float32),
        "tiny": (rs.random(m) * 1e-30).astype(np.float32),  # weights underflow to 0 at gamma 16
    }
    cases["NaN/Inf"][[0, m - 1]] = np.inf
    cases["random"][rs.random(m) < 0.05] = 0.0
    return cases


@pytest.mark.parametrize("m", [1, 7, 8, 9, 255, 256, 257, 263, 1000, 40_000, 100_003])
def test_birdplus_select_grouped_equals_fused(m):
    # _weight_pass_groups + _walk_groups (per-group weight sums) against _weight_pass + _walk_fused:
    # the same kept blocks (exactly k, NaN/Inf kept), the same p up to float64 rounding
    rs = np.random.default_rng(m + 17)
    for name, a in _select_cases(m, rs).items():
        for gamma in (16, 4, 1, 4.75):
            for k in sorted({1, max(1, int(np.floor(0.01 * m + 0.5))), max(1, m // 5)}):
                w = B.gamma_weights(a, gamma)
                want = max(min(k, int((w > 0).sum())), int((~np.isfinite(a)).sum()))
                for u in (0.2718281828459045, 0.6180339887498949):  # (no exact rational crossings)
                    ids, pk = B.birdplus_select(a, _amax(a), gamma, k, u)
                    fids, fpk = B.birdplus_select(a, _amax(a), gamma, k, u, weight_pass=_weight_pass)
                    msg = f"{name} gamma={gamma} k={k} u={u}"
                    assert ids.size == want, msg
                    np.testing.assert_array_equal(ids, fids, err_msg=msg)
                    # (F in a different order: the fused pass's eight long float64 chains drift
                    # by up to ~m/8 ulp on equal weights)
                    np.testing.assert_allclose(pk, fpk, rtol=1e-10, err_msg=msg)
                    assert set(np.flatnonzero(~np.isfinite(a))) <= set(ids.tolist()), msg


@pytest.mark.parametrize("m", [1, 8, 9, 255, 257, 1000, 40_003])
def test_weight_pass_groups_reference(m):
    # the same candidates (in block order), NaN/Inf count and free weight up to rounding as
    # _weight_pass; gw = the tree sums of the weights of the full groups of 8; npos the lower bound
    # (groups of 8 with a positive weight, plus the tail's positive blocks)
    rs = np.random.default_rng(m)
    for name, a in _select_cases(m, rs).items():
        for gamma in (16, 1, 4.75):
            q = B.gamma_quarters(gamma)
            amax = _amax(a)
            w = B.gamma_weights(a, gamma)
            fin = np.sort(a[np.isfinite(a)])
            for al in {0.0, float(fin[len(fin) // 2]) if fin.size else 0.0, amax}:
                al = min(al, amax)
                wl = W._pow_quarters(al / amax, q) if al > 0.0 else 0.0
                c1 = np.empty(m + 8)
                c2 = np.empty(m + 8)
                gw = np.full(m // 8, -1.0)
                f1, n1, i1, k1 = _weight_pass(a, amax, q, al, c1)
                f2, n2, i2, k2 = SEL._weight_pass_groups(a, amax, q, al, wl, c2, gw)
                msg = f"{name} gamma={gamma} al={al}"
                assert (i1, k1) == (i2, k2), msg
                np.testing.assert_array_equal(c1[:k1], c2[:k2], err_msg=msg)
                assert f2 == pytest.approx(f1, rel=1e-10, abs=0.0), msg
                g8 = 8 * (m // 8)
                lb = int((w[:g8].reshape(-1, 8) > 0).any(axis=1).sum()) + int((w[g8:] > 0).sum())
                assert n1 == int((w > 0).sum()) and n2 == lb <= n1, msg
                ref = [((w[o] + w[o + 1]) + (w[o + 2] + w[o + 3])) + ((w[o + 4] + w[o + 5]) + (w[o + 6] + w[o + 7]))
                       for o in range(0, 8 * (m // 8), 8)]
                np.testing.assert_array_equal(gw, ref, err_msg=msg)
                # an overflowing candidate buffer is reported
                if k2 > 0:
                    assert SEL._weight_pass_groups(a, amax, q, al, wl, np.empty(1), gw)[3] == -1, msg


@pytest.mark.parametrize("m", [1, 5, 8, 9, 1000, 4099])
def test_walk_grouped_reference(m):
    rs = np.random.default_rng(m)
    w = B.gamma_weights(rs.exponential(1.0, m).astype(np.float32), 2)
    w[rs.random(m) < 0.1] = 0.0
    k = max(1, int(np.floor(0.05 * m + 0.5)))
    p = B.probabilities(w, k)
    for u in (0.1, 0.5, 0.999999):
        ids = walk_grouped(p, u)
        assert ids.size == min(k, int((p > 0).sum())) and np.all(p[ids] > 0)
        np.testing.assert_array_equal(ids, B.walk(p, u))  # random data: rounding decides no crossing
    # shared mode's floor mix, in place, bit-identical to probabilities() + floor_mix()
    ref = floor_mix(B.probabilities(w, k), 0.1, k / m)
    got = shared_probabilities(w.copy(), k, 0.1, k / m)
    np.testing.assert_array_equal(got, ref)
    for u in (0.1, 0.7):
        np.testing.assert_array_equal(walk_grouped(got, u), B.walk(ref, u))
    # a sum that is not an integer: floor or ceil of it (natural walk)
    q = rs.random(m) * 0.6 + 0.013
    for u in (0.2, 0.9):
        ids = walk_grouped(q, u)
        assert ids.size in (int(np.floor(q.sum())), int(np.ceil(q.sum())))
        np.testing.assert_array_equal(ids, B.walk(q, u))
    assert walk_grouped(np.zeros(m), 0.5).size == 0


@pytest.mark.parametrize("n,b", [(100, 32), (70_001, 8), (1003, 7)])
def test_gather_subtract_equals_gather_then_subtract(n, b):
    m = -(-n // b)
    x = data(n, 6)
    ids = np.unique(np.random.default_rng(n).integers(0, m, max(2, m // 3)))
    ids[-1] = m - 1  # include the partial last block
    ids = np.unique(ids).astype(np.int64)
    scale = np.random.default_rng(1).random(ids.size).astype(np.float32) + 0.5
    for with_u in (False, True):
        v1, v2 = x.copy(), x.copy()
        u1, u2 = (np.ones(n, np.float32), np.ones(n, np.float32)) if with_u else (None, None)
        out1 = B.gather_blocks(v1, b, ids, scale, np.empty(ids.size * b, np.float32))
        B.subtract_sent(v1, u1, b, ids, out1)
        out2 = B.gather_subtract(v2, u2, b, ids, scale, np.empty(ids.size * b, np.float32))
        np.testing.assert_array_equal(out2, out1)
        np.testing.assert_array_equal(v2, v1)
        if with_u:
            np.testing.assert_array_equal(u2, u1)


def test_sum_blocks_matches_fill_scatter_and_divide():
    """The fused gathered sum (B.sum_blocks) against its definition: zeros, one scatter-add per rank
    in rank order, one division; bit for bit, with shared and lone blocks, a short last block,
    float16 values, NaN, -0.0, no division, ranks with no blocks."""
    from birdnet.kernels import blocks as B
    rng = np.random.default_rng(3)
    for n, b, world, dt, d in ((1001, 8, 4, np.float32, 4.0), (64, 1, 3, np.float32, 0.0),
                               (17, 5, 2, np.float16, 3.0), (0, 4, 2, np.float32, 2.0), (800, 8, 4, np.float32, 7.0)):
        m = -(-n // b)
        ids = [np.sort(rng.choice(m, size=rng.integers(0, m + 1), replace=False)) if m else np.zeros(0, np.int64)
               for _ in range(world)]
        ids[-1] = ids[-1][:0] if world > 2 else ids[-1]  # a rank that kept nothing
        vals = [rng.standard_normal(i.shape[0] * b).astype(dt) for i in ids]
        if n == 800:
            vals[0][:3] = [np.nan, -0.0, np.inf]
        want = np.zeros(n, np.float32)
        for i, v in zip(ids, vals):
            B.scatter_blocks(v, b, i.astype(np.uint32), want, add=True)
        if d:
            np.divide(want, np.float32(d), out=want)
        out = np.full(n, 5.0, np.float32)  # what the round's input left there
        B.sum_blocks(out, b, [i.astype(np.uint32) for i in ids], vals, d)
        assert out.tobytes() == want.tobytes(), (n, b)
    with pytest.raises(ValueError, match="outside"):
        B.sum_blocks(np.zeros(16, np.float32), 8, [np.array([2])], [np.zeros(8, np.float32)], 2)
