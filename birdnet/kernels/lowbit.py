"""Block-quantised low-bit encoding (the ``lowbit`` codec's wire format, docs/codecs.md).

A run of ``count`` float32 values is cut into blocks of ``block`` elements (the last may be
shorter). Each block gets one scale ``s`` and each value a signed integer level
``q = rint(x / s)`` in ``[-qmax, qmax]``, ``qmax = 2**(bits-1) - 1`` (127, 7 or 1: symmetric, so
0 is exact and no zero point is sent). The value it stands for is ``float32(q) * s``.

``midrise``: the levels sit between the steps instead, ``q = floor(x / s)`` in
``[-half, half - 1]``, ``half = 2**(bits-1)``, standing for ``(float32(q) + 0.5) * s``, with
``s = absmax / (half - 0.5)``: every code is used (2 bits: four values, +-0.5 s and +-1.5 s, where
the symmetric levels have three, -s, 0, s) and no value rounds to 0, so every value keeps its sign.

``bits=1`` (always midrise: one bit has no level at 0): each value is its sign times the block's
mean |x|, ``s = 2 * mean|x|`` and the levels +-0.5 s. For a sign the mean |x| is the scale of least
squared error (EF-SignSGD, Karimireddy et al. 2019, section 3: the scaled sign
``||x||_1 / d * sign(x)``); the absolute maximum would overshoot every smaller value. Values beyond
the scale are not clipped to it but sent as one level like the rest: the error feedback carries
the difference.

Layout of one encoded run (little-endian, the same on every architecture)::

    bytes [0, 2*nblocks)            the blocks' scales, uint16 each: the upper half of a float32
                                    (bfloat16), rounded *up* from absmax/qmax so |x|/s <= qmax
                                    (midrise: from absmax/(half - 0.5))
    bytes [2*nblocks, nbytes)       the levels, q + qmax (midrise: q + half) as unsigned ``bits``-bit codes, packed
                                    8/bits to a byte, the first element in the lowest bits

Why a bfloat16 scale: float32's exponent range (a block of pseudo-gradients of 1e-9 or of
gradients of 1e4 keeps its scale; float16 would flush the first to 0 and overflow the second) in
2 bytes (half the overhead of a float32 scale: 3% instead of 6% of a 4-bit block of 64).
Rounding it up costs at most 2**-7 of the step.

A block holding a NaN or Inf (or whose scale would overflow float32) gets a NaN scale: all its
values decode to NaN, so a non-finite input surfaces in the result as with the dense ring.

Why the bits are the same on every node and machine: levels come from one correctly rounded
float32 division and ``rint`` (round half to even); a value is one float32 product; a sum with
this node's own value is one float32 addition. No kernel here uses fast-math, so LLVM neither
contracts a product and a sum into an FMA nor reassociates; blocks are independent, so the thread
count does not matter either.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from birdnet.kernels._arrays import check

#: the NaN scale of a block with a NaN or Inf (float32 0x7FC00000's upper half)
NAN_SCALE = 0x7FC0
BITS = (1, 2, 4, 8)


def nbytes(count: int, bits: int, block: int) -> int:
    """Bytes of an encoded run of ``count`` values."""
    return 2 * (-(-count // block)) + -(-count * bits // 8)


@njit(cache=True, parallel=True)
def _absmax(src, block, amax):
    # per block max |x|; NaN for a block holding a NaN or Inf
    n = src.shape[0]
    big = np.float32(3.4028234663852886e38)
    for b in prange(amax.shape[0]):
        m = np.float32(0.0)
        for i in range(b * block, min(n, b * block + block)):
            a = abs(src[i])
            if not a <= big:
                m = np.float32(np.nan)
                break
            if a > m:
                m = a
        amax[b] = m


@njit(cache=True, parallel=True)
def _meanabs(src, block, mabs):
    # per block mean |x| (summed in float64 in element order: the same bits on every machine);
    # NaN for a block holding a NaN or Inf
    n = src.shape[0]
    big = np.float32(3.4028234663852886e38)
    for b in prange(mabs.shape[0]):
        lo = b * block
        hi = min(n, lo + block)
        t = 0.0
        for i in range(lo, hi):
            a = abs(src[i])
            if not a <= big:
                t = np.nan
                break
            t += np.float64(a)
        mabs[b] = np.float32(t / (hi - lo))


@njit(cache=True, parallel=True)
def _quantise(src, bits, block, scales, out, deq, residual, res_off, midrise):
    # out[2*nb:] = packed levels; deq / residual when given (see encode)
    n = src.shape[0]
    nb = scales.shape[0]
    qmax = (1 << (bits - 1)) - 1
    fq = np.float32(qmax)
    lo_q = -fq  # the lowest level; midrise: -half
    off = qmax  # code = level + off
    mid = np.float32(0.0)  # added to the level before the scale; midrise: 0.5
    if midrise:
        lo_q = np.float32(-(qmax + 1))
        off = qmax + 1
        mid = np.float32(0.5)
    per = 8 // bits
    base = 2 * nb
    want_deq = deq.shape[0] == n
    want_res = residual.shape[0] > 0
    for b in prange(nb):
        lo = b * block
        hi = min(n, lo + block)
        s = scales[b]
        usable = s > 0 and s <= np.float32(3.4028234663852886e38)  # not 0, NaN or Inf
        # byte by byte (a block is whole bytes: block % 8 == 0), so no division per element
        for j in range(lo // per, (hi + per - 1) // per):
            byte = 0
            for t in range(per):
                i = j * per + t
                if i >= hi:
                    break
                q = np.float32(0.0)
                if usable:
                    q = np.floor(src[i] / s) if midrise else np.rint(src[i] / s)
                    if q > fq:
                        q = fq
                    elif q < lo_q:
                        q = lo_q
                level = np.int64(q)
                byte |= (level + off) << (t * bits)
                # from the integer, as _dequantise: -0.0 rounds to level 0, +0.0 (adding 0.0 is exact)
                d = (np.float32(level) + mid) * s
                if want_res:
                    residual[res_off + i] = src[i] - d
                if want_deq:
                    deq[i] = d
            out[base + j] = np.uint8(byte)


@njit(cache=True, parallel=True)
def _dequantise(buf, bits, block, scales, own, out, midrise):
    n = out.shape[0]
    nb = scales.shape[0]
    qmax = (1 << (bits - 1)) - 1
    off = qmax + 1 if midrise else qmax
    mid = np.float32(0.5) if midrise else np.float32(0.0)
    per = 8 // bits
    mask = (1 << bits) - 1
    base = 2 * nb
    add = own.shape[0] == n
    for b in prange(nb):
        s = scales[b]
        lo = b * block
        hi = min(n, lo + block)
        for j in range(lo // per, (hi + per - 1) // per):
            byte = np.int64(buf[base + j])
            for t in range(per):
                i = j * per + t
                if i >= hi:
                    break
                d = (np.float32(((byte >> (t * bits)) & mask) - off) + mid) * s
                if add:
                    out[i] = d + own[i]
                else:
                    out[i] = d


def scale_bits(amax: np.ndarray, bits: int, midrise: bool = False) -> np.ndarray:
    """The blocks' scales as bfloat16 bits (uint16): absmax / qmax (midrise: absmax / (half - 0.5);
    bits 1: ``amax`` is the mean |x| and the scale twice it) in float32, rounded up to the next
    bfloat16; NAN_SCALE for a NaN ``amax`` or a scale past float32's range."""
    top = np.float32((1 << (bits - 1)) - 0.5) if midrise or bits == 1 else np.float32((1 << (bits - 1)) - 1)
    with np.errstate(invalid="ignore"):
        s = amax / top
    u = s.view(np.uint32)
    u = np.where(u & 0xFFFF, (u | np.uint32(0xFFFF)) + np.uint32(1), u) >> np.uint32(16)
    u[u >= 0x7F80] = NAN_SCALE  # NaN, or rounded up to Inf
    return u.astype(np.uint16)


def scales_of(sb: np.ndarray) -> np.ndarray:
    """float32 scales from their bfloat16 bits."""
    return (sb.astype(np.uint32) << np.uint32(16)).view(np.float32)


_EMPTY = np.empty(0, np.float32)


def _check_params(bits: int, block: int) -> None:
    if bits not in BITS or block < 8 or block % 8:
        raise ValueError(f"bits must be one of {BITS} and block a positive multiple of 8; got bits={bits}, "
                         f"block={block}")


def encode(src: np.ndarray, bits: int, block: int, *, deq: np.ndarray | None = None,
           residual: np.ndarray | None = None, res_off: int = 0, midrise: bool = False) -> np.ndarray:
    """Encode ``src`` (float32) into a new uint8 array of :func:`nbytes` bytes.

    ``deq``: receives the values the encoding stands for (may be ``src`` itself). ``residual``:
    ``residual[res_off + i] = src[i] - value_i`` (error feedback); NaN where the block is non-finite.
    """
    _check_params(bits, block)
    check(src, np.float32, "src")
    n = src.shape[0]
    if deq is not None:
        check(deq, np.float32, "deq", n)
    if residual is not None:
        check(residual, np.float32, "residual")
        if not 0 <= res_off <= residual.shape[0] - n:
            raise ValueError(f"residual of {residual.shape[0]} elements has no room for {n} at {res_off}")
    out = np.empty(nbytes(n, bits, block), np.uint8)
    if n:
        nb = -(-n // block)
        amax = np.empty(nb, np.float32)
        (_meanabs if bits == 1 else _absmax)(src, block, amax)
        sb = scale_bits(amax, bits, midrise)
        out[:2 * nb] = sb.astype("<u2").view(np.uint8)
        _quantise(src, bits, block, scales_of(sb), out, _EMPTY if deq is None else deq,
                  _EMPTY if residual is None else residual, res_off, bool(midrise) or bits == 1)
    return out


def decode(buf: np.ndarray, bits: int, block: int, out: np.ndarray, own: np.ndarray | None = None,
           midrise: bool = False) -> None:
    """``out`` (float32, the run's length) = the values ``buf`` encodes (+ ``own``, one float32
    addition per element, when given; ``own`` may be ``out``)."""
    _check_params(bits, block)
    check(out, np.float32, "out")
    n = out.shape[0]
    check(buf, np.uint8, "buf", nbytes(n, bits, block))
    if own is not None:
        check(own, np.float32, "own", n)
    if n:
        nb = -(-n // block)
        sb = buf[:2 * nb].view("<u2")
        _dequantise(buf, bits, block, scales_of(sb), _EMPTY if own is None else own, out, bool(midrise) or bits == 1)
