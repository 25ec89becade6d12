"""Sign-bit kernels for Marsit and the cascading-sign baseline (docs/marsit.md).

Bit order (fixed; part of the wire format)
------------------------------------------
Element ``i`` of a float vector is bit ``i % 8`` (least significant bit first) of byte ``i // 8``.
The bit is **1 when the element is non-negative** (``x >= 0``, so ``+0.0`` and ``-0.0`` give 1)
and 0 when it is negative or NaN. A vector of ``n`` elements packs into ``ceil(n / 8)`` bytes; the
padding bits of the last byte are always 0, and every kernel here keeps them 0. This is
``np.packbits(x >= 0, bitorder="little")``.

The merge (marsit.md section 1, "note"; section 2 for the weights)
------------------------------------------------------------------
At the k-th worker on a segment's path, with received bits ``a`` and local bits ``b``::

    out = keep ? a : b        keep ~ Bernoulli(W_a / (W_a + W_b)), fresh for every bit

with ``W_a`` the number of processes the received operand stands for and ``W_b`` the receiver's
(equal counts: ``W_a = k - 1``, ``W_b = 1``, so P(keep) = (k-1)/k). The paper's form
``(a AND b) OR ((a XOR b) AND v)`` is the same thing with ``v = keep XOR b`` (tests/test_signbits.py
checks the equivalence with that form written in NumPy).

How the mask is drawn: a bit is kept when a uniform U in [0, 1) is below
``T = floor(P(keep) * 2**64) / 2**64`` (T from exact integer arithmetic on the counts). 64 lanes
are decided together: the binary digits of the 64 lanes' U are the bits of successive counter-based
random words (splitmix64 of ``(seed, 64 * word + t)``), compared with T's digits from the most
significant end; a lane is decided at its first digit that differs from T's, so a word costs about
8 random words instead of 64 (lanes where ``a == b`` are not waited for: their mask does not change
the output). The draw is exact to 2**-64. Masks need not agree between nodes (every node merges a
different segment at a different step), so ``seed`` is the node's local seed plus the hop.

Kernels are private ``@njit`` functions with explicit signatures taking preallocated outputs; the
public wrappers check dtypes, contiguity and lengths. tests/test_signbits.py checks each against a
NumPy reference.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types

from birdnet.kernels.rng import hash64 as _rand

__all__ = [
    "nbytes_for", "pack_signs", "unpack_signs", "unpack_signs_add", "keep_threshold",
    "bernoulli_mask", "merge_signbits", "prepare_p", "prepare_pack", "abs_sum", "sq_sum",
    "sub_signs", "sub_scaled", "cascade_hop",
]

_U8 = types.uint8[::1]
_U8R = types.Array(types.uint8, 1, "C", readonly=True)
_F4 = types.float32[::1]
_F4R = types.Array(types.float32, 1, "C", readonly=True)

_ZERO = np.uint64(0)
_ONE = np.uint64(1)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_B8 = np.uint64(0xFF)


def nbytes_for(n: int) -> int:
    """Bytes needed for the sign bits of ``n`` elements: ``ceil(n / 8)``."""
    return (int(n) + 7) // 8


# --------------------------------------------------------------------------------------------
# random words: rng.hash64(seed, ctr), the counter-based splitmix64 every kernel draws from
@njit(cache=True, inline="always")
def _keep_word(seed, word, thresh, undecided):
    """64 Bernoulli(thresh / 2**64) lanes of word ``word``; only ``undecided`` lanes are waited for."""
    keep = _ZERO
    base = np.uint64(word) * np.uint64(64)
    t = 0
    while undecided != _ZERO and t < 64:
        r = _rand(seed, base + np.uint64(t))
        if (thresh >> np.uint64(63 - t)) & _ONE:
            keep |= undecided & ~r  # U's digit 0 < T's digit 1: U < T, keep
            undecided &= r
        else:
            undecided &= ~r  # U's digit 1 > T's digit 0: U > T, do not keep
        t += 1
    return keep  # lanes still undecided have U == T (to 64 digits): not kept


# --------------------------------------------------------------------------------------------
# pack / unpack
@njit([types.void(_F4, _U8), types.void(_F4R, _U8)], cache=True, nogil=True)
def _pack(x, out):
    n = x.shape[0]
    full = n // 8
    for i in range(full):
        j = 8 * i
        v = np.uint8(0)
        for b in range(8):
            v |= np.uint8(x[j + b] >= 0) << np.uint8(b)
        out[i] = v
    rest = n - 8 * full
    if rest:
        v = np.uint8(0)
        for b in range(rest):
            v |= np.uint8(x[8 * full + b] >= 0) << np.uint8(b)
        out[full] = v


@njit([types.void(_U8, types.float32, _F4), types.void(_U8R, types.float32, _F4)], cache=True, nogil=True)
def _unpack(bits, v, out):
    n = out.shape[0]
    for i in range(n):
        out[i] = v if (bits[i >> 3] >> (i & 7)) & 1 else -v


@njit([types.void(_U8, types.float32, _F4), types.void(_U8R, types.float32, _F4)], cache=True, nogil=True)
def _unpack_add(bits, v, out):
    n = out.shape[0]
    for i in range(n):
        out[i] += v if (bits[i >> 3] >> (i & 7)) & 1 else -v


# --------------------------------------------------------------------------------------------
# merge
@njit([types.void(_U8, _U8, _U8, types.uint64, types.uint64),
       types.void(_U8R, _U8, _U8, types.uint64, types.uint64),
       types.void(_U8R, _U8R, _U8, types.uint64, types.uint64)], cache=True, nogil=True)
def _merge(a, b, out, thresh, seed):
    nb = a.shape[0]
    words = (nb + 7) // 8
    for w in range(words):
        start = 8 * w
        cnt = min(8, nb - start)
        aw = _ZERO
        bw = _ZERO
        for i in range(cnt):
            sh = np.uint64(8 * i)
            aw |= np.uint64(a[start + i]) << sh
            bw |= np.uint64(b[start + i]) << sh
        diff = aw ^ bw
        ow = bw
        if diff != _ZERO:
            ow = bw ^ (diff & _keep_word(seed, w, thresh, diff))
        for i in range(cnt):
            out[start + i] = np.uint8((ow >> np.uint64(8 * i)) & _B8)


@njit(types.void(types.uint64, types.uint64, _U8), cache=True, nogil=True)
def _mask(thresh, seed, out):
    nb = out.shape[0]
    words = (nb + 7) // 8
    for w in range(words):
        start = 8 * w
        cnt = min(8, nb - start)
        m = _keep_word(seed, w, thresh, _ALL)
        for i in range(cnt):
            out[start + i] = np.uint8((m >> np.uint64(8 * i)) & _B8)


# --------------------------------------------------------------------------------------------
# float kernels of the codecs (compensation, momentum, scale, cascade hop)
@njit([types.void(_F4, types.float32, _F4, _F4), types.void(_F4R, types.float32, _F4, _F4)], cache=True, nogil=True)
def _prepare(x, inv_w, c, p):
    for i in range(x.shape[0]):
        p[i] = x[i] * inv_w + c[i]


@njit([types.void(_F4, types.float32, types.float32, _F4, _F4, _F4),
       types.void(_F4R, types.float32, types.float32, _F4, _F4, _F4)], cache=True, nogil=True)
def _prepare_momentum(x, inv_w, mu, u, c, p):
    for i in range(x.shape[0]):
        ui = mu * u[i] + x[i] * inv_w
        u[i] = ui
        p[i] = ui + c[i]


@njit(inline="always")
def _pack_tail_sum(p, bits, start, n, m, s0, s1, s2, s3):
    # the elements from ``start`` (a multiple of 8) to n: their bits, and |p| into the accumulators
    # _abs_sum would use (i % 4 below m = n - n % 4, s0 from there)
    v = np.uint8(0)
    for i in range(start, n):
        a = abs(np.float64(p[i]))
        r = i % 4
        if i >= m or r == 0:
            s0 += a
        elif r == 1:
            s1 += a
        elif r == 2:
            s2 += a
        else:
            s3 += a
        v |= np.uint8(p[i] >= 0) << np.uint8(i - start)
    if n > start:
        bits[start // 8] = v
    return (s0 + s1) + (s2 + s3)


# _prepare / _prepare_momentum, _abs_sum and _pack in one pass over memory: the same float32
# operations and the same four accumulators in the same order, so p, the sum and the bits equal the
# three kernels' bit for bit (tests/test_signbits.py), and a round reads x, c (and u) once.
@njit([types.float64(_F4, types.float32, _F4, _F4, _U8), types.float64(_F4R, types.float32, _F4, _F4, _U8)],
      cache=True, nogil=True)
def _prepare_pack(x, inv_w, c, p, bits):
    n = x.shape[0]
    full = n // 8
    s0 = s1 = s2 = s3 = 0.0
    for k in range(full):
        j = 8 * k
        for b in range(0, 8, 4):
            i = j + b
            q0 = x[i] * inv_w + c[i]
            q1 = x[i + 1] * inv_w + c[i + 1]
            q2 = x[i + 2] * inv_w + c[i + 2]
            q3 = x[i + 3] * inv_w + c[i + 3]
            p[i] = q0
            p[i + 1] = q1
            p[i + 2] = q2
            p[i + 3] = q3
            s0 += abs(np.float64(q0))
            s1 += abs(np.float64(q1))
            s2 += abs(np.float64(q2))
            s3 += abs(np.float64(q3))
        v = np.uint8(0)
        for b in range(8):
            v |= np.uint8(p[j + b] >= 0) << np.uint8(b)
        bits[k] = v
    for i in range(8 * full, n):
        p[i] = x[i] * inv_w + c[i]
    return _pack_tail_sum(p, bits, 8 * full, n, n - n % 4, s0, s1, s2, s3)


@njit([types.float64(_F4, types.float32, types.float32, _F4, _F4, _F4, _U8),
       types.float64(_F4R, types.float32, types.float32, _F4, _F4, _F4, _U8)], cache=True, nogil=True)
def _prepare_pack_momentum(x, inv_w, mu, u, c, p, bits):
    n = x.shape[0]
    full = n // 8
    s0 = s1 = s2 = s3 = 0.0
    for k in range(full):
        j = 8 * k
        for b in range(0, 8, 4):
            i = j + b
            u0 = mu * u[i] + x[i] * inv_w
            u1 = mu * u[i + 1] + x[i + 1] * inv_w
            u2 = mu * u[i + 2] + x[i + 2] * inv_w
            u3 = mu * u[i + 3] + x[i + 3] * inv_w
            u[i] = u0
            u[i + 1] = u1
            u[i + 2] = u2
            u[i + 3] = u3
            q0 = u0 + c[i]
            q1 = u1 + c[i + 1]
            q2 = u2 + c[i + 2]
            q3 = u3 + c[i + 3]
            p[i] = q0
            p[i + 1] = q1
            p[i + 2] = q2
            p[i + 3] = q3
            s0 += abs(np.float64(q0))
            s1 += abs(np.float64(q1))
            s2 += abs(np.float64(q2))
            s3 += abs(np.float64(q3))
        v = np.uint8(0)
        for b in range(8):
            v |= np.uint8(p[j + b] >= 0) << np.uint8(b)
        bits[k] = v
    for i in range(8 * full, n):
        ui = mu * u[i] + x[i] * inv_w
        u[i] = ui
        p[i] = ui + c[i]
    return _pack_tail_sum(p, bits, 8 * full, n, n - n % 4, s0, s1, s2, s3)


@njit([types.float64(_F4), types.float64(_F4R)], cache=True, nogil=True)
def _abs_sum(x):
    # Four independent accumulators break the add-latency chain (~3x faster); the combination order
    # is fixed, so the result is the same on every run. (Only this node uses it: the scales of the
    # nodes are combined in rank order by the ring.)
    n = x.shape[0]
    s0 = s1 = s2 = s3 = 0.0
    m = n - n % 4
    for i in range(0, m, 4):
        s0 += abs(np.float64(x[i]))
        s1 += abs(np.float64(x[i + 1]))
        s2 += abs(np.float64(x[i + 2]))
        s3 += abs(np.float64(x[i + 3]))
    for i in range(m, n):
        s0 += abs(np.float64(x[i]))
    return (s0 + s1) + (s2 + s3)


@njit([types.float64(_F4), types.float64(_F4R)], cache=True, nogil=True)
def _sq_sum(x):
    n = x.shape[0]
    s0 = s1 = s2 = s3 = 0.0
    m = n - n % 4
    for i in range(0, m, 4):
        v0 = np.float64(x[i])
        v1 = np.float64(x[i + 1])
        v2 = np.float64(x[i + 2])
        v3 = np.float64(x[i + 3])
        s0 += v0 * v0
        s1 += v1 * v1
        s2 += v2 * v2
        s3 += v3 * v3
    for i in range(m, n):
        v = np.float64(x[i])
        s0 += v * v
    return (s0 + s1) + (s2 + s3)


@njit(types.void(_F4, types.float32, _F4), cache=True, nogil=True)
def _sub_signs(p, v, out):
    for i in range(p.shape[0]):
        out[i] = p[i] - v if p[i] >= 0 else p[i] + v


@njit(types.void(_F4, _F4, types.float32, _F4), cache=True, nogil=True)
def _sub_scaled(p, r, f, out):
    for i in range(p.shape[0]):
        out[i] = p[i] - r[i] * f


@njit([types.float64(_U8, types.float32, _F4, types.float32, _U8),
       types.float64(_U8R, types.float32, _F4, types.float32, _U8)], cache=True, nogil=True)
def _cascade_hop(a, va, p, wb, out):
    n = p.shape[0]
    total = 0.0
    for i in range(n >> 3 << 3, n):  # the partial last byte is rebuilt from scratch
        out[i >> 3] = 0
    for i in range(n):
        e = (va if (a[i >> 3] >> (i & 7)) & 1 else -va) + wb * p[i]
        total += abs(np.float64(e))
        byte = i >> 3
        bit = np.uint8(e >= 0) << np.uint8(i & 7)
        if (i & 7) == 0:
            out[byte] = bit
        else:
            out[byte] |= bit
    return total


# --------------------------------------------------------------------------------------------
# public wrappers
def _f32(name: str, x: np.ndarray, n: int | None = None) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1 or not x.flags.c_contiguous:
        raise TypeError(f"{name} must be a 1-D C-contiguous float32 array "
                        f"(got {getattr(x, 'dtype', type(x))}); use np.ascontiguousarray(x, np.float32)")
    if n is not None and x.shape[0] != n:
        raise ValueError(f"{name} has {x.shape[0]} elements, expected {n}")


def _u8(name: str, x: np.ndarray, nb: int | None = None, writable: bool = False) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 1 or not x.flags.c_contiguous:
        raise TypeError(f"{name} must be a 1-D C-contiguous uint8 array (got {getattr(x, 'dtype', type(x))})")
    if nb is not None and x.shape[0] != nb:
        raise ValueError(f"{name} has {x.shape[0]} bytes, expected {nb}")
    if writable and not x.flags.writeable:
        raise ValueError(f"{name} must be writable")


def pack_signs(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Sign bits of float32 ``x`` (1 = non-negative), ``ceil(n/8)`` bytes, LSB-first."""
    _f32("x", x)
    nb = nbytes_for(x.shape[0])
    if out is None:
        out = np.empty(nb, np.uint8)
    _u8("out", out, nb, writable=True)
    _pack(x, out)
    return out


def unpack_signs(bits: np.ndarray, value: float, out: np.ndarray) -> np.ndarray:
    """``out[i] = +value`` where bit i is 1, ``-value`` where it is 0 (``len(out)`` elements)."""
    _f32("out", out)
    _u8("bits", bits, nbytes_for(out.shape[0]))
    _unpack(bits, np.float32(value), out)
    return out


def unpack_signs_add(bits: np.ndarray, value: float, out: np.ndarray) -> np.ndarray:
    """``out[i] += +-value`` by the sign bits (in place)."""
    _f32("out", out)
    _u8("bits", bits, nbytes_for(out.shape[0]))
    _unpack_add(bits, np.float32(value), out)
    return out


def keep_threshold(w_a: int, w_b: int) -> int:
    """``floor(2**64 * w_a / (w_a + w_b))``: the kernels keep ``a`` where U < this / 2**64."""
    w_a, w_b = int(w_a), int(w_b)
    if w_a < 1 or w_b < 1:
        raise ValueError(f"merge weights must be positive process counts, got {w_a} and {w_b}")
    return (w_a << 64) // (w_a + w_b)


def bernoulli_mask(nbytes: int, w_a: int, w_b: int, seed: int) -> np.ndarray:
    """The keep mask :func:`merge_signbits` uses for these arguments (bits set with probability
    ``w_a / (w_a + w_b)``; padding bits included), for tests and the paper-form equivalence."""
    out = np.empty(int(nbytes), np.uint8)
    _mask(np.uint64(keep_threshold(w_a, w_b)), np.uint64(int(seed) & ((1 << 64) - 1)), out)
    return out


def merge_signbits(a: np.ndarray, b: np.ndarray, out: np.ndarray, w_a: int, w_b: int,
                   seed: int) -> np.ndarray:
    """Marsit's per-hop merge: ``out = keep ? a : b`` bitwise, keep ~ Bernoulli(w_a/(w_a+w_b)).

    ``a``: received bits (may be read-only, e.g. a network buffer); ``b``: local bits; ``out`` may
    be ``b`` itself. Equal bits pass unchanged for every draw. Deterministic for a given ``seed``.
    """
    _u8("a", a)
    nb = a.shape[0]
    _u8("b", b, nb)
    _u8("out", out, nb, writable=True)
    if not b.flags.writeable:
        b = np.array(b)
    _merge(a, b, out, np.uint64(keep_threshold(w_a, w_b)), np.uint64(int(seed) & ((1 << 64) - 1)))
    return out


def prepare_p(x: np.ndarray, inv_w: float, c: np.ndarray, p: np.ndarray, momentum: float = 0.0,
              u: np.ndarray | None = None) -> np.ndarray:
    """``p = x * inv_w + c``, or with momentum ``u = momentum * u + x * inv_w; p = u + c``."""
    _f32("x", x)
    n = x.shape[0]
    _f32("c", c, n)
    _f32("p", p, n)
    if u is None:
        _prepare(x, np.float32(inv_w), c, p)
    else:
        _f32("u", u, n)
        _prepare_momentum(x, np.float32(inv_w), np.float32(momentum), u, c, p)
    return p


def prepare_pack(x: np.ndarray, inv_w: float, c: np.ndarray, p: np.ndarray, bits: np.ndarray,
                 momentum: float = 0.0, u: np.ndarray | None = None) -> float:
    """:func:`prepare_p`, then ``pack_signs(p, bits)``, returning ``abs_sum(p)``: one pass, the same
    results bit for bit."""
    _f32("x", x)
    n = x.shape[0]
    _f32("c", c, n)
    _f32("p", p, n)
    _u8("bits", bits, nbytes_for(n), writable=True)
    if u is None:
        return float(_prepare_pack(x, np.float32(inv_w), c, p, bits))
    _f32("u", u, n)
    return float(_prepare_pack_momentum(x, np.float32(inv_w), np.float32(momentum), u, c, p, bits))


def abs_sum(x: np.ndarray) -> float:
    """Sum of |x| accumulated in float64, in index order."""
    _f32("x", x)
    return float(_abs_sum(x))


def sq_sum(x: np.ndarray) -> float:
    """Sum of x**2 accumulated in float64, in index order."""
    _f32("x", x)
    return float(_sq_sum(x))


def sub_signs(p: np.ndarray, value: float, out: np.ndarray) -> np.ndarray:
    """``out = p - value * sign1(p)`` with sign1 = +1 for p >= 0 (local compensation)."""
    _f32("p", p)
    _f32("out", out, p.shape[0])
    _sub_signs(p, np.float32(value), out)
    return out


def sub_scaled(p: np.ndarray, r: np.ndarray, factor: float, out: np.ndarray) -> np.ndarray:
    """``out = p - r * factor`` (global compensation: factor = 1 / total_count)."""
    _f32("p", p)
    _f32("r", r, p.shape[0])
    _f32("out", out, p.shape[0])
    _sub_scaled(p, r, np.float32(factor), out)
    return out


def cascade_hop(a: np.ndarray, value_a: float, p: np.ndarray, w_b: float, out: np.ndarray) -> float:
    """The cascading-sign hop: ``e = +-value_a (by a's bits) + w_b * p``; ``out`` = sign bits of
    ``e``; returns ``sum |e|`` (float64) for the next scale."""
    _f32("p", p)
    nb = nbytes_for(p.shape[0])
    _u8("a", a, nb)
    _u8("out", out, nb, writable=True)
    return float(_cascade_hop(a, np.float32(value_a), p, np.float32(w_b), out))
