"""signcascade: the cascading one-bit baseline Marsit is measured against (docs/marsit.md).

This is what the Marsit paper (DAC 2022) warns against: at every hop the
node decompresses the received signs to ``+-scale``, adds its own vector, takes the sign again and
forwards 1 bit per element plus one float (the new scale of that segment). The sign error compounds
with every hop, so it converges worse than Marsit, more so with more nodes.

It runs on the same merged ring (birdnet.ring.merge) and shares Marsit's state, momentum,
compensation and flush options (:class:`~birdnet.codecs.marsit.SignRingCodec`), so a comparison
isolates the per-hop operation. The scale is always per segment: the first node of a segment's
path sends ``mean |p|`` over the segment; a hop with a received operand ``(bits a, scale sigma_a)``
standing for ``W_a`` processes and its own ``p`` (``W_b`` processes) forms the sum estimate
``e = W_a * sigma_a * sign(a) + W_b * p``, forwards ``sign(e)`` and ``sigma = mean |e| / (W_a + W_b)``.
The result is ``W * sigma_j * s`` on segment j. Defaults: no flush, global compensation.
"""
from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from birdnet.codecs.base import Payload, RoundContext
from birdnet.codecs.marsit import SignRingCodec
from birdnet.errors import ProtocolError
from birdnet.kernels import lazy

sb = lazy("signbits")


class SignCascadeCodec(SignRingCodec):
    """Decompress, add, re-sign at every hop (the baseline that shows the problem)."""

    name: ClassVar[str] = "signcascade"
    defaults: ClassVar[dict[str, Any]] = {
        "compensation": "global",
        "flush": 0,
        "momentum": 0.0,
    }

    def segment_meta(self, state: Any, lo: int, hi: int, ctx: RoundContext) -> dict[str, float]:
        p = state["p"][lo:hi]
        return {"s": sb.abs_sum(p) / (hi - lo) if hi > lo else 0.0}

    def merge_hop(self, a, meta_a, b, state, lo, hi, w_a, w_b, seed, ctx):
        sigma_a = meta_a.get("s")
        if not isinstance(sigma_a, float):
            raise ProtocolError(f"{self.name}: tensor {ctx.name!r} round {ctx.round_id}: segment operand "
                                f"without its scale (meta {meta_a!r})")
        out = np.empty(b.shape[0], np.uint8)
        total = sb.cascade_hop(a, w_a * sigma_a, state["p"][lo:hi], float(w_b), out)
        return out, {"s": total / (hi - lo) / (w_a + w_b) if hi > lo else 0.0}

    def segment_value(self, scales: list[float], meta: dict[str, float], ctx: RoundContext) -> float:
        """``W * sigma_j`` for segment j (its scale rides in the segment's meta)."""
        sigma = meta.get("s")
        if not isinstance(sigma, float):
            raise ProtocolError(f"{self.name}: tensor {ctx.name!r} round {ctx.round_id}: finished segment "
                                f"without its scale (meta {meta!r})")
        total = float(sum(ctx.counts)) if ctx.counts else float(len(scales))
        return total * sigma

    def decompress(self, payload: Payload, out: np.ndarray, ctx: RoundContext, state: Any) -> None:
        """Segment j of the dense sum is ``W * sigma_j * s_j`` (W = all processes of the round)."""
        n = out.shape[0]
        bits = np.ascontiguousarray(payload.buffers[0])
        if bits.dtype != np.uint8 or bits.shape[0] != sb.nbytes_for(n):
            raise ProtocolError(f"{self.name}: {bits.shape[0]} bytes of bits for {n} elements")
        h = payload.header
        if "metas" not in h:  # a single node's payload (world of 1)
            sb.unpack_signs(bits, float(h.get("weight", 1)) * float(h["scale"]), out)
            return
        bounds, metas = h["bounds"], h["metas"]
        total = float(sum(ctx.counts)) if ctx.counts else float(len(metas))
        for j, meta in enumerate(metas):
            lo, hi = bounds[j], bounds[j + 1]
            if hi > lo:
                sb.unpack_signs(bits[lo // 8:sb.nbytes_for(hi)], total * float(meta["s"]), out[lo:hi])
