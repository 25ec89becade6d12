"""Sign-bit kernels against NumPy references (birdnet.kernels.signbits; marsit.md section 4,
properties 1 and 2). Statistical checks use fixed seeds and 5-sigma binomial bounds (a false
failure has probability ~6e-7 per check)."""
from __future__ import annotations

import numpy as np
import pytest

from birdnet.kernels import signbits as sb

LENGTHS = [0, 1, 7, 8, 9, 13, 64, 65, 1000, 100003]


def ref_pack(x: np.ndarray) -> np.ndarray:
    return np.packbits(x >= 0, bitorder="little")


def ref_unpack(bits: np.ndarray, v: float, n: int) -> np.ndarray:
    s = np.unpackbits(bits, bitorder="little", count=n).astype(bool)
    return np.where(s, np.float32(v), np.float32(-v)).astype(np.float32)


def ref_merge_paper(a: np.ndarray, b: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The paper's form of the merge (marsit.md section 1): ``(a AND b) OR ((a XOR b) AND v)``."""
    return (a & b) | ((a ^ b) & v)


def within(k: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    """k successes out of n are within ``sigmas`` standard deviations of Binomial(n, p)."""
    return abs(k - n * p) <= sigmas * np.sqrt(n * p * (1 - p)) + 1e-9


def readonly(a: np.ndarray) -> np.ndarray:
    return np.frombuffer(a.tobytes(), dtype=a.dtype)  # like a received network frame


@pytest.mark.parametrize("n", LENGTHS)
def test_pack_unpack_match_reference(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    if n >= 8:
        x[:6] = [0.0, -0.0, np.nan, np.inf, -np.inf, -1e-38]
    bits = sb.pack_signs(x)
    assert bits.shape == (sb.nbytes_for(n),) == ((n + 7) // 8,)
    np.testing.assert_array_equal(bits, ref_pack(x))
    if n % 8:
        assert bits[-1] >> (n % 8) == 0, "padding bits must be 0"
    out = np.full(n, 9.0, np.float32)
    sb.unpack_signs(readonly(bits), 0.75, out)
    np.testing.assert_array_equal(out, ref_unpack(bits, 0.75, n))
    acc = rng.standard_normal(n).astype(np.float32)
    expect = acc + ref_unpack(bits, 0.5, n)
    sb.unpack_signs_add(bits, 0.5, acc)
    np.testing.assert_array_equal(acc, expect)


def test_bit_order_is_documented_one():
    x = np.array([1, -1, -1, -1, -1, -1, -1, -1, -1, 1], np.float32)
    np.testing.assert_array_equal(sb.pack_signs(x), [0b00000001, 0b00000010])
    # +0.0 and -0.0 are non-negative (bit 1); NaN is bit 0
    np.testing.assert_array_equal(sb.pack_signs(np.array([0.0, -0.0, np.nan], np.float32)), [0b011])


@pytest.mark.parametrize("w_a,w_b", [(1, 1), (2, 1), (3, 1), (7, 1), (1, 3), (5, 2)])
def test_mask_frequency_and_lanes(w_a, w_b):
    p = w_a / (w_a + w_b)
    m = np.unpackbits(sb.bernoulli_mask(20001, w_a, w_b, seed=1234 + w_a), bitorder="little")
    assert within(int(m.sum()), m.size, p)
    lanes = m[: m.size // 64 * 64].reshape(-1, 64)
    for lane in range(64):  # every lane of the 64-wide draw is Bernoulli(p)
        assert within(int(lanes[:, lane].sum()), lanes.shape[0], p)
    # neighbouring bits are independent: P(both set) = p^2
    both = m[:-1] & m[1:]
    assert within(int(both.sum()), both.size, p * p, sigmas=6)


def test_mask_deterministic_per_seed_and_fresh_across_seeds():
    a = sb.bernoulli_mask(1000, 3, 1, seed=5)
    np.testing.assert_array_equal(a, sb.bernoulli_mask(1000, 3, 1, seed=5))
    assert not np.array_equal(a, sb.bernoulli_mask(1000, 3, 1, seed=6))


def test_keep_threshold_exact():
    assert sb.keep_threshold(1, 1) == 1 << 63
    assert sb.keep_threshold(3, 1) == 3 << 62
    with pytest.raises(ValueError):
        sb.keep_threshold(0, 1)


@pytest.mark.parametrize("nbytes", [0, 1, 5, 8, 13, 1251])
@pytest.mark.parametrize("w_a,w_b", [(1, 1), (3, 1), (2, 5)])
def test_merge_equals_keep_form_and_paper_form(nbytes, w_a, w_b):
    """Property 2: with the same mask, keep ? a : b and (a&b)|((a^b)&v), v = mask^b, agree."""
    rng = np.random.default_rng(nbytes * 31 + w_a)
    a = rng.integers(0, 256, nbytes, dtype=np.uint8)
    b = rng.integers(0, 256, nbytes, dtype=np.uint8)
    out = np.empty(nbytes, np.uint8)
    sb.merge_signbits(readonly(a), b, out, w_a, w_b, seed=99)
    mask = sb.bernoulli_mask(nbytes, w_a, w_b, seed=99)
    keep_form = (a & mask) | (b & ~mask)
    np.testing.assert_array_equal(out, keep_form)
    np.testing.assert_array_equal(ref_merge_paper(a, b, mask ^ b), keep_form)
    # out may alias b
    b2 = b.copy()
    sb.merge_signbits(a, b2, b2, w_a, w_b, seed=99)
    np.testing.assert_array_equal(b2, keep_form)


def test_paper_v_has_the_papers_distribution():
    """v = keep ^ b is Bernoulli((k-1)/k) where b = 0 and Bernoulli(1/k) where b = 1."""
    k = 4
    rng = np.random.default_rng(3)
    b = rng.integers(0, 256, 40000, dtype=np.uint8)
    v = sb.bernoulli_mask(b.size, k - 1, 1, seed=8) ^ b
    bb, vv = np.unpackbits(b), np.unpackbits(v)
    assert within(int(vv[bb == 0].sum()), int((bb == 0).sum()), (k - 1) / k)
    assert within(int(vv[bb == 1].sum()), int((bb == 1).sum()), 1 / k)


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_merge_property_1(k):
    """Where a == b the output is a for every draw; where they differ P(out == a) = (k-1)/k."""
    rng = np.random.default_rng(k)
    n = 8 * 4001 + 5  # not a multiple of 8
    xa, xb = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    xb[: n // 2] = xa[: n // 2]  # half the elements agree
    a, b = sb.pack_signs(xa), sb.pack_signs(xb)
    ua, ub = (np.unpackbits(z, bitorder="little", count=n) for z in (a, b))
    same, diff = ua == ub, ua != ub
    kept = 0
    for seed in range(5):
        out = np.empty_like(a)
        sb.merge_signbits(a, b, out, k - 1, 1, seed=seed)
        uo = np.unpackbits(out, bitorder="little")
        assert not uo[n:].any(), "padding bits stay 0"
        uo = uo[:n]
        np.testing.assert_array_equal(uo[same], ua[same])
        kept += int((uo[diff] == ua[diff]).sum())
    assert within(kept, 5 * int(diff.sum()), (k - 1) / k)


@pytest.mark.parametrize("n", [0, 1, 7, 13, 1000, 4099])
def test_float_kernels_match_reference(n):
    rng = np.random.default_rng(n + 1)
    x, c, u = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    p = np.empty(n, np.float32)
    sb.prepare_p(x, 0.5, c, p)
    np.testing.assert_array_equal(p, x * np.float32(0.5) + c)
    u0 = u.copy()
    sb.prepare_p(x, 0.5, c, p, 0.9, u)
    np.testing.assert_allclose(u, np.float32(0.9) * u0 + x * np.float32(0.5), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(p, u + c)
    assert sb.abs_sum(x) == pytest.approx(float(np.abs(x.astype(np.float64)).sum()), rel=1e-12)
    assert sb.sq_sum(x) == pytest.approx(float((x.astype(np.float64) ** 2).sum()), rel=1e-12)
    out = np.empty(n, np.float32)
    sb.sub_signs(x, 0.25, out)
    np.testing.assert_array_equal(out, np.where(x >= 0, x - np.float32(0.25), x + np.float32(0.25)))
    sb.sub_scaled(x, c, 0.25, out)
    np.testing.assert_array_equal(out, x - c * np.float32(0.25))


@pytest.mark.parametrize("n", [0, 1, 7, 13, 1000])
def test_cascade_hop_matches_reference(n):
    rng = np.random.default_rng(n + 2)
    a = sb.pack_signs(rng.standard_normal(n).astype(np.float32))
    p = rng.standard_normal(n).astype(np.float32)
    out = np.full(sb.nbytes_for(n), 0xFF, np.uint8)
    total = sb.cascade_hop(readonly(a), 1.5, p, 2.0, out)
    e = ref_unpack(a, 1.5, n) + np.float32(2.0) * p
    np.testing.assert_array_equal(out, ref_pack(e))
    assert total == pytest.approx(float(np.abs(e.astype(np.float64)).sum()), rel=1e-6)


def test_wrappers_reject_bad_input():
    with pytest.raises(TypeError, match="float32"):
        sb.pack_signs(np.zeros(8, np.float64))
    with pytest.raises(TypeError, match="contiguous"):
        sb.pack_signs(np.zeros(16, np.float32)[::2])
    with pytest.raises(ValueError, match="bytes"):
        sb.unpack_signs(np.zeros(1, np.uint8), 1.0, np.zeros(9, np.float32))
    with pytest.raises(ValueError, match="bytes"):
        sb.merge_signbits(np.zeros(2, np.uint8), np.zeros(3, np.uint8), np.zeros(2, np.uint8), 1, 1, 0)
    with pytest.raises(ValueError, match="writable"):
        sb.merge_signbits(np.zeros(2, np.uint8), np.zeros(2, np.uint8), readonly(np.zeros(2, np.uint8)),
                          1, 1, 0)


@pytest.mark.parametrize("n", [0, 1, 3, 7, 8, 13, 1000, 4099])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fused_prepare_pack_equals_the_three_kernels_bit_for_bit(n, momentum):
    # Marsit's compress runs the fused kernel; nodes stay identical only if it is the same
    # arithmetic as prepare_p + abs_sum + pack_signs (the tail of n % 8 and n % 4 included).
    rng = np.random.default_rng(100 + n)
    x, c, u = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    x[:: 5] = 0.0
    if n > 2:
        x[2], c[2] = -0.0, 0.0  # -0 + 0 = +0 in p; the sign bit of p decides, as in pack_signs
    u_ref, u_fused = u.copy(), u.copy()
    p_ref, p_fused = np.empty(n, np.float32), np.full(n, np.nan, np.float32)
    bits = np.full(sb.nbytes_for(n), 0xAA, np.uint8)
    if momentum:
        sb.prepare_p(x, 0.25, c, p_ref, momentum, u_ref)
        total = sb.prepare_pack(readonly(x), 0.25, c, p_fused, bits, momentum, u_fused)
        np.testing.assert_array_equal(u_fused, u_ref)
    else:
        sb.prepare_p(x, 0.25, c, p_ref)
        total = sb.prepare_pack(readonly(x), 0.25, c, p_fused, bits)
        np.testing.assert_array_equal(u_fused, u)  # untouched without momentum
    np.testing.assert_array_equal(p_fused, p_ref)
    np.testing.assert_array_equal(bits, sb.pack_signs(p_ref))
    assert total == sb.abs_sum(p_ref)  # the same accumulators in the same order: equal, not close
