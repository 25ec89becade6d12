"""Block-scaled ternary encoding (the ``ternary`` codec's wire format, docs/codecs.md).

A run of ``count`` float32 values is cut into blocks of ``block`` elements (the last may be
shorter). Each block gets one scale ``s``, ``STEP`` times its mean |x|, and each value a level
``q = rint(x / s)`` clipped to ``[-1, 1]``, standing for ``float32(q) * s``. Three levels take
log2(3) = 1.58 bits: five of them go into one byte as base-3 digits, ``sum (q_k + 1) * 3**k``
(at most 242), so a value costs 1.6 bits plus its share of the scale (1.65 bits at block 320).

Why ``STEP = 1.5``: the three-level quantiser of least squared error for Gaussian values has its
levels at 0 and +-1.224 sigma and its thresholds halfway (Max 1960, table I), and mean|x| is
0.798 sigma, so s = 1.53 mean|x|; a rounded factor, as the scale is rounded anyway. The absolute
maximum as the scale (``lowbit`` bits 2) sends most values of a heavy-tailed block as 0.

Layout of one encoded run (little-endian, the same on every architecture)::

    bytes [0, 2*nblocks)            the blocks' scales, uint16 each: the upper half of a float32
                                    (bfloat16), rounded *up* from STEP * mean|x|
    bytes [2*nblocks, nbytes)       each block's levels, ceil(len / 5) bytes a block, five levels
                                    to a byte (the first element the lowest digit); every block
                                    starts on a new byte

A block holding a NaN or Inf (or whose scale would overflow float32) gets a NaN scale: all its
values decode to NaN. Any byte decodes to three valid levels' digits (the digits of 243-255 are
taken mod 3 like the others), so no peer's bytes can index out of range.

Why the bits are the same on every node: the mean is summed in float64 in element order, a level
comes from one correctly rounded float32 division and ``rint``, a value is one float32 product and
a sum with this node's own value one float32 addition; no fast-math, blocks independent.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from birdnet.kernels._arrays import check
from birdnet.kernels.lowbit import NAN_SCALE, _meanabs, scales_of

#: the scale in units of the block's mean |x| (see the module docstring)
STEP = 1.5
#: levels to a byte
PER = 5


def block_bytes(block: int) -> int:
    """Bytes of one whole block's levels."""
    return -(-block // PER)


def nbytes(count: int, block: int) -> int:
    """Bytes of an encoded run of ``count`` values."""
    full, last = divmod(count, block)
    return 2 * (-(-count // block)) + full * block_bytes(block) + -(-last // PER)


@njit(cache=True, parallel=True)
def _quantise(src, block, scales, out, deq, residual, res_off):
    n = src.shape[0]
    nb = scales.shape[0]
    bpb = (block + 4) // 5
    base = 2 * nb
    want_deq = deq.shape[0] == n
    want_res = residual.shape[0] > 0
    for b in prange(nb):
        lo = b * block
        hi = min(n, lo + block)
        s = scales[b]
        usable = s > 0 and s <= np.float32(3.4028234663852886e38)  # not 0, NaN or Inf
        for j in range((hi - lo + 4) // 5):
            byte = 0
            mul = 1
            for t in range(5):
                i = lo + j * 5 + t
                if i >= hi:
                    break
                q = np.float32(0.0)
                if usable:
                    q = np.rint(src[i] / s)
                    if q > 1:
                        q = np.float32(1.0)
                    elif q < -1:
                        q = np.float32(-1.0)
                level = np.int64(q)
                byte += (level + 1) * mul
                mul *= 3
                d = np.float32(level) * s
                if want_res:
                    residual[res_off + i] = src[i] - d
                if want_deq:
                    deq[i] = d
            out[base + b * bpb + j] = np.uint8(byte)


@njit(cache=True, parallel=True)
def _dequantise(buf, block, scales, own, out):
    n = out.shape[0]
    nb = scales.shape[0]
    bpb = (block + 4) // 5
    base = 2 * nb
    add = own.shape[0] == n
    for b in prange(nb):
        s = scales[b]
        lo = b * block
        hi = min(n, lo + block)
        for j in range((hi - lo + 4) // 5):
            byte = np.int64(buf[base + b * bpb + j])
            for t in range(5):
                i = lo + j * 5 + t
                if i >= hi:
                    break
                d = np.float32(byte % 3 - 1) * s
                byte //= 3
                if add:
                    out[i] = d + own[i]
                else:
                    out[i] = d


def scale_bits(mabs: np.ndarray) -> np.ndarray:
    """The blocks' scales as bfloat16 bits: STEP * mean|x| in float32, rounded up to the next
    bfloat16; NAN_SCALE for a NaN mean or a scale past float32's range."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = (mabs * np.float32(STEP)).astype(np.float32)
    u = s.view(np.uint32)
    u = np.where(u & 0xFFFF, (u | np.uint32(0xFFFF)) + np.uint32(1), u) >> np.uint32(16)
    u[u >= 0x7F80] = NAN_SCALE
    return u.astype(np.uint16)


_EMPTY = np.empty(0, np.float32)


def _check_block(block: int) -> None:
    if block < 8 or block % 8:
        raise ValueError(f"block must be a positive multiple of 8; got block={block}")


def encode(src: np.ndarray, block: int, *, deq: np.ndarray | None = None,
           residual: np.ndarray | None = None, res_off: int = 0) -> np.ndarray:
    """Encode ``src`` (float32) into a new uint8 array of :func:`nbytes` bytes.

    ``deq``: receives the values the encoding stands for (may be ``src`` itself). ``residual``:
    ``residual[res_off + i] = src[i] - value_i`` (error feedback); NaN where the block is non-finite.
    """
    _check_block(block)
    check(src, np.float32, "src")
    n = src.shape[0]
    if deq is not None:
        check(deq, np.float32, "deq", n)
    if residual is not None:
        check(residual, np.float32, "residual")
        if not 0 <= res_off <= residual.shape[0] - n:
            raise ValueError(f"residual of {residual.shape[0]} elements has no room for {n} at {res_off}")
    out = np.zeros(nbytes(n, block), np.uint8)
    if n:
        nb = -(-n // block)
        mabs = np.empty(nb, np.float32)
        _meanabs(src, block, mabs)
        sb = scale_bits(mabs)
        out[:2 * nb] = sb.astype("<u2").view(np.uint8)
        _quantise(src, block, scales_of(sb), out, _EMPTY if deq is None else deq,
                  _EMPTY if residual is None else residual, res_off)
    return out


def decode(buf: np.ndarray, block: int, out: np.ndarray, own: np.ndarray | None = None) -> None:
    """``out`` (float32, the run's length) = the values ``buf`` encodes (+ ``own``, one float32
    addition per element, when given; ``own`` may be ``out``)."""
    _check_block(block)
    check(out, np.float32, "out")
    n = out.shape[0]
    check(buf, np.uint8, "buf", nbytes(n, block))
    if own is not None:
        check(own, np.float32, "own", n)
    if n:
        nb = -(-n // block)
        sb = buf[:2 * nb].view("<u2")
        _dequantise(buf, block, scales_of(sb), _EMPTY if own is None else own, out)
