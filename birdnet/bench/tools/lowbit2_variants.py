"""Two-bit codes with less squared error than ``lowbit``'s midrise levels, on DiLoCo's syncs at H=16
(docs/slowlink.md, Bytes against steps). Runs ``diloco_loop_sim --codec ring`` with the ``lowbit``
kernels' 2-bit midrise encoding (``block`` >= 128) replaced by a NumPy emulation of one variant;
every other sync (1 bit, 4 bits) and the ring itself are the real ones:

    python -m birdnet.bench.tools.lowbit2_variants --variant mean --steps 400 --eval-every 20 \\
        --set '{"DEFAULT_CODEC_PARAMS": {"bits": 2, "midrise": true, "block": 256},
               "DEFAULT_WARMUP_CODEC_PARAMS": {"bits": 1, "block": 256}}'

``mean``    the step ``1.4 x`` the block's mean |x| (rounded up to a bfloat16) instead of absmax/1.5,
            levels +-0.5 and +-1.5 steps, values beyond the outer level clipped (error feedback
            carries the rest): near Max's optimal uniform 4-level quantiser for a Gaussian.
``twomag``  per block a threshold ``1.25 x`` mean|x|; each value its sign times the mean |x| of its
            group (below or above the threshold; least squares for the partition): near the
            Lloyd-Max 4-level quantiser. Two bfloat16 scales a block (2 more bytes a block).

Relative squared error on blocks of 256 (lowbit midrise absmax / mean / twomag): Gaussian 0.36 /
0.12 / 0.12, Laplacian 1.10 / 0.20 / 0.18. The other arguments are ``diloco_loop_sim``'s (its
``--codec`` is ``ring``). Prints its JSON line.
"""
from __future__ import annotations

import sys

import numpy as np

import birdnet.kernels.lowbit as L

MEAN_STEP = 1.4
TWOMAG_THRESHOLD = 1.25
_encode, _decode, _nbytes = L.encode, L.decode, L.nbytes


def _bf16_up(v: np.ndarray) -> np.ndarray:
    u = np.asarray(v, np.float32).view(np.uint32)
    return (np.where(u & 0xFFFF, (u | np.uint32(0xFFFF)) + np.uint32(1), u) >> np.uint32(16)).astype(np.uint16)


def _blocks(n: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    starts = np.arange(0, n, block)
    cnt = np.diff(np.append(starts, n))
    return starts, cnt, np.repeat(np.arange(starts.shape[0]), cnt)


def _pack(code: np.ndarray) -> np.ndarray:
    cp = np.concatenate([code, np.zeros((-code.shape[0]) % 4, np.uint8)]).reshape(-1, 4)
    return cp[:, 0] | (cp[:, 1] << 2) | (cp[:, 2] << 4) | (cp[:, 3] << 6)


def _unpack(by: np.ndarray, n: int) -> np.ndarray:
    return np.stack([(by >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(-1)[:n]


class Variant:
    """One emulated 2-bit code: ``nbytes``, ``encode`` -> (bytes, values), ``decode`` -> values."""

    scales = 1

    def nbytes(self, n: int, block: int) -> int:
        return 2 * self.scales * (-(-n // block)) + -(-n * 2 // 8)


class Mean(Variant):
    def encode(self, src, block):
        n = src.shape[0]
        starts, cnt, bid = _blocks(n, block)
        mabs = (np.add.reduceat(np.abs(src).astype(np.float64), starts) / cnt).astype(np.float32)
        sb = _bf16_up(mabs * np.float32(MEAN_STEP))
        s = L.scales_of(sb)[bid]
        with np.errstate(invalid="ignore", divide="ignore"):
            q = np.where(s > 0, np.clip(np.floor(src / s), -2, 1), 0).astype(np.int64)
        d = ((q.astype(np.float32) + np.float32(0.5)) * s).astype(np.float32)
        return np.concatenate([sb.astype("<u2").view(np.uint8), _pack((q + 2).astype(np.uint8))]), d

    def decode(self, buf, n, block):
        nb = -(-n // block)
        s = L.scales_of(buf[:2 * nb].view("<u2"))[_blocks(n, block)[2]]
        q = _unpack(buf[2 * nb:], n).astype(np.int64) - 2
        return ((q.astype(np.float32) + np.float32(0.5)) * s).astype(np.float32)


class TwoMagnitudes(Variant):
    scales = 2

    def encode(self, src, block):
        n = src.shape[0]
        starts, cnt, bid = _blocks(n, block)
        ax = np.abs(src).astype(np.float64)
        tot = np.add.reduceat(ax, starts)
        big = ax > TWOMAG_THRESHOLD * (tot / cnt)[bid]
        nbig = np.add.reduceat(big.astype(np.float64), starts)
        sbig = np.add.reduceat(np.where(big, ax, 0.0), starts)
        a = (tot - sbig) / np.maximum(cnt - nbig, 1)
        b = np.where(nbig > 0, sbig / np.maximum(nbig, 1), a)
        sa, sb = _bf16_up(a.astype(np.float32)), _bf16_up(b.astype(np.float32))
        code = np.where(src < 0, np.where(big, 0, 1), np.where(big, 3, 2)).astype(np.uint8)
        head = np.concatenate([sa.astype("<u2").view(np.uint8), sb.astype("<u2").view(np.uint8)])
        return np.concatenate([head, _pack(code)]), self._values(code, L.scales_of(sa)[bid], L.scales_of(sb)[bid])

    @staticmethod
    def _values(code, a, b):
        mag = np.where((code == 0) | (code == 3), b, a)
        return np.where(code >= 2, mag, -mag).astype(np.float32)

    def decode(self, buf, n, block):
        nb = -(-n // block)
        bid = _blocks(n, block)[2]
        a, b = (L.scales_of(buf[k * 2 * nb:(k + 1) * 2 * nb].view("<u2"))[bid] for k in (0, 1))
        return self._values(_unpack(buf[4 * nb:], n), a, b)


VARIANTS = {"mean": Mean, "twomag": TwoMagnitudes}


def install(variant: Variant) -> None:
    """Replace lowbit's 2-bit midrise kernels (block >= 128) by ``variant``'s, everything else as it is."""

    def on(bits, block, midrise=True):
        return bits == 2 and midrise and block >= 128

    def nbytes(count, bits, block):
        return variant.nbytes(count, block) if on(bits, block) else _nbytes(count, bits, block)

    def encode(src, bits, block, *, deq=None, residual=None, res_off=0, midrise=False):
        if not on(bits, block, midrise):
            return _encode(src, bits, block, deq=deq, residual=residual, res_off=res_off, midrise=midrise)
        if src.shape[0] == 0:
            return np.zeros(0, np.uint8)
        buf, d = variant.encode(src, block)
        if residual is not None:
            residual[res_off:res_off + src.shape[0]] = src - d
        if deq is not None:
            deq[:] = d
        return buf

    def decode(buf, bits, block, out, own=None, midrise=False):
        if not on(bits, block, midrise):
            return _decode(buf, bits, block, out, own, midrise=midrise)
        if out.shape[0]:
            d = variant.decode(buf, out.shape[0], block)
            out[:] = d + own if own is not None else d

    L.nbytes, L.encode, L.decode = nbytes, encode, decode


def main() -> None:
    args = sys.argv[1:]
    if "--variant" not in args or args.index("--variant") + 1 >= len(args):
        raise SystemExit(f"--variant {{{','.join(VARIANTS)}}} is required")
    i = args.index("--variant")
    name = args[i + 1]
    if name not in VARIANTS:
        raise SystemExit(f"--variant {name!r}: one of {', '.join(VARIANTS)}")
    install(VARIANTS[name]())
    from birdnet.bench.tools import diloco_loop_sim
    sys.argv = [sys.argv[0], "--codec", "ring"] + args[:i] + args[i + 2:]
    diloco_loop_sim.main()


if __name__ == "__main__":
    main()
