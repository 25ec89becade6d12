"""Per-chunk Top-k with two-bit values (the ``sparseloco`` codec; SparseLoCo, arXiv 2508.15706, section 3).

The input is cut in order into chunks of ``chunk`` values (the last one shorter). In each chunk of
``c`` values the ``kk = min(k, c)`` largest magnitudes are kept (ties at the threshold in index
order); each kept value travels as two bits, its sign and whether its magnitude is above the mean
magnitude of the chunk's kept values, and decodes to the mean magnitude of its group (``lo`` or
``hi``, the two bfloat16 scales of the chunk, rounded to nearest): the least-squares pair of
magnitudes for that split, near the Lloyd-Max quantiser with two levels a side.

Format (all little-endian):

``scales``  uint16[2 * chunks]: each chunk's ``lo`` then ``hi`` as bfloat16 bits
``body``    per chunk, byte-aligned, ``ceil((index_bits + 2 * kk) / 8)`` bytes, bits LSB-first:
            the kept positions, either as ``kk`` offsets in the chunk of ``b = max(1, ceil(log2 c))``
            bits each, ascending (when ``kk * b < c``), or as a bitmap of ``c`` bits (otherwise,
            whichever is smaller); then each kept value's two bits in position order, the sign
            (1: negative) and the group (1: ``hi``)

Magnitudes are compared as the integer bits of ``|x|`` (NaN ranks highest, so it is kept and
propagates through the chunk's scales). The sums are float64 in index order, the same on every
node. Decoding checks every offset (in the chunk, strictly ascending) and the bitmap's count, and
reports a malformed body instead of writing out of bounds.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_ABS = np.uint32(0x7FFFFFFF)
#: what a chunk's decode reports when its body is malformed
BAD_OFFSET, BAD_BITMAP = -1, -2


def index_bits(c: int) -> int:
    """Bits of one offset in a chunk of c values."""
    return max(1, int(c - 1).bit_length())


def chunk_body_bytes(c: int, k: int) -> int:
    """Bytes of one chunk's body (c values, k kept)."""
    kk = min(k, c)
    return -(-(min(kk * index_bits(c), c) + 2 * kk) // 8)


def nbytes(n: int, chunk: int, k: int) -> tuple[int, int]:
    """(scale count, body bytes) of an encoding of n values."""
    full, rest = divmod(n, chunk)
    body = full * chunk_body_bytes(chunk, k) + (chunk_body_bytes(rest, k) if rest else 0)
    return 2 * (full + (1 if rest else 0)), body


@njit(cache=True)
def _index_bits(c):
    """index_bits in the kernels."""
    b = 1
    while (1 << b) < c:
        b += 1
    return b


@njit(cache=True)
def _body_bytes(c, kk, b):
    """chunk_body_bytes in the kernels (``b``: _index_bits(c))."""
    return (min(kk * b, c) + 2 * kk + 7) // 8


@njit(cache=True)
def _bf16_nearest(v):
    a = np.empty(1, np.float32)
    a[0] = v
    u = a.view(np.uint32)[0]
    if (u & _ABS) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    r = (np.uint64(u) + np.uint64(0x7FFF) + ((np.uint64(u) >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return np.uint16(r)


@njit(cache=True)
def _put(body, pos, value, nb):
    for j in range(nb):
        if (value >> j) & 1:
            body[(pos + j) >> 3] |= np.uint8(1 << ((pos + j) & 7))
    return pos + nb


@njit(cache=True)
def _get(body, pos, nb):
    v = 0
    for j in range(nb):
        v |= ((np.int64(body[(pos + j) >> 3]) >> ((pos + j) & 7)) & 1) << j
    return v


@njit(cache=True)
def _scale(sb):
    return np.array([np.uint32(sb) << np.uint32(16)], np.uint32).view(np.float32)[0]


@njit(cache=True)
def _encode(e, chunk, k, scales, body, sent):
    """Encode e chunk by chunk into scales / body (body zeroed by the caller); ``sent`` gets the
    value each element decodes to (0 where not kept)."""
    n = e.shape[0]
    eb = e.view(np.uint32)
    start = 0
    ci = 0
    off = 0
    keys = np.empty(min(chunk, max(n, 1)), np.uint32)
    while start < n:
        c = min(chunk, n - start)
        kk = min(k, c)
        for i in range(c):
            keys[i] = eb[start + i] & _ABS
        t = np.partition(keys[:c], c - kk)[c - kk]  # the kk-th largest magnitude's bits
        above = 0
        for i in range(c):
            if (eb[start + i] & _ABS) > t:
                above += 1
        ties = kk - above
        tot = 0.0
        for i in range(c):
            a = eb[start + i] & _ABS
            if a > t or (a == t and ties > 0):
                if a == t:
                    ties -= 1
                keys[i] = np.uint32(1)  # reused as the kept flag
                tot += abs(np.float64(e[start + i]))
            else:
                keys[i] = np.uint32(0)
        m = tot / kk
        slo = 0.0
        shi = 0.0
        nhi = 0
        for i in range(c):
            if keys[i]:
                a = abs(np.float64(e[start + i]))
                if a > m:
                    shi += a
                    nhi += 1
                else:
                    slo += a
        lo16 = _bf16_nearest(slo / max(kk - nhi, 1))
        hi16 = _bf16_nearest(shi / nhi if nhi > 0 else slo / max(kk - nhi, 1))
        scales[2 * ci] = lo16
        scales[2 * ci + 1] = hi16
        lo = _scale(lo16)
        hi = _scale(hi16)
        b = _index_bits(c)
        pos = off * 8
        use_offsets = kk * b < c
        if use_offsets:
            for i in range(c):
                if keys[i]:
                    pos = _put(body, pos, i, b)
        else:
            for i in range(c):
                if keys[i]:
                    body[(pos + i) >> 3] |= np.uint8(1 << ((pos + i) & 7))
            pos += c
        for i in range(c):
            x = e[start + i]
            if keys[i]:
                big = abs(np.float64(x)) > m
                neg = x < 0
                code = (1 if neg else 0) | (2 if big else 0)
                pos = _put(body, pos, code, 2)
                mag = hi if big else lo
                sent[start + i] = -mag if neg else mag
            else:
                sent[start + i] = 0.0
        off += _body_bytes(c, kk, b)
        start += c
        ci += 1
    return off


@njit(cache=True)
def _decode_add(scales, body, n, chunk, k, out, write):
    """out += the decoded values (with ``write``; without, only the checks); returns 0, or
    BAD_OFFSET / BAD_BITMAP."""
    start = 0
    ci = 0
    off = 0
    pos_buf = np.empty(min(chunk, max(n, 1)), np.int64)
    while start < n:
        c = min(chunk, n - start)
        kk = min(k, c)
        b = _index_bits(c)
        lo = _scale(scales[2 * ci])
        hi = _scale(scales[2 * ci + 1])
        pos = off * 8
        if kk * b < c:
            prev = -1
            for j in range(kk):
                i = _get(body, pos, b)
                pos += b
                if i >= c or i <= prev:
                    return BAD_OFFSET
                pos_buf[j] = i
                prev = i
        else:
            got = 0
            for i in range(c):
                if (body[(pos + i) >> 3] >> ((pos + i) & 7)) & 1:
                    if got == kk:
                        return BAD_BITMAP
                    pos_buf[got] = i
                    got += 1
            if got != kk:
                return BAD_BITMAP
            pos += c
        if write:
            for j in range(kk):
                code = _get(body, pos, 2)
                pos += 2
                mag = hi if code & 2 else lo
                out[start + pos_buf[j]] += -mag if code & 1 else mag
        off += _body_bytes(c, kk, b)
        start += c
        ci += 1
    return 0


def _check(a: np.ndarray, dtype: type, what: str) -> None:
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 1 or not a.flags.c_contiguous:
        raise TypeError(f"chunktopk: {what} must be a 1-D C-contiguous {np.dtype(dtype).name} array "
                        f"(np.ascontiguousarray(a, dtype=np.{np.dtype(dtype).name}).ravel())")


def encode(e: np.ndarray, chunk: int, k: int, sent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scales, body) of float32 ``e``; ``sent`` (float32, len n) gets the decoded values."""
    _check(e, np.float32, "input")
    _check(sent, np.float32, "sent")
    n = e.shape[0]
    ns, nb = nbytes(n, chunk, k)
    scales = np.empty(ns, np.uint16)
    body = np.zeros(nb, np.uint8)
    if n:
        _encode(e, int(chunk), int(k), scales, body, sent)
    return scales, body


def check(scales: np.ndarray, body: np.ndarray, n: int, chunk: int, k: int) -> int:
    """0 when every chunk's positions are well formed (offsets in the chunk and ascending, a bitmap
    with its k bits), else BAD_OFFSET / BAD_BITMAP; the sizes must match :func:`nbytes` already.
    Run on a peer's payload before any of it is added, so a bad one changes nothing."""
    _check(scales, np.uint16, "scales")
    _check(body, np.uint8, "body")
    if n == 0:
        return 0
    return int(_decode_add(scales, body, int(n), int(chunk), int(k), np.empty(0, np.float32), False))


def decode_add(scales: np.ndarray, body: np.ndarray, chunk: int, k: int, out: np.ndarray) -> int:
    """``out`` += the decoded values; 0, or BAD_OFFSET / BAD_BITMAP for a malformed body (the sizes
    must have been checked against :func:`nbytes`; :func:`check` first leaves ``out`` untouched)."""
    _check(out, np.float32, "out")
    _check(scales, np.uint16, "scales")
    _check(body, np.uint8, "body")
    if out.shape[0] == 0:
        return 0
    return int(_decode_add(scales, body, out.shape[0], int(chunk), int(k), out, True))
