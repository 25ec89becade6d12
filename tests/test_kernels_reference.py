"""Every kernel against a slow NumPy reference (STYLE.md: stumpy/pynndescent lesson)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from birdnet.kernels import blocks as B
from birdnet.kernels import quant as Q
from birdnet.kernels import rng
from birdnet.kernels import sparse as S

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
    B.accumulate_norms(x, u if momentum else None, v, momentum, b, out)
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
