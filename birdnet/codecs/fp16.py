"""``fp16``: dense, half-precision on the wire.

Values stay float32 in memory; the ring converts to float16 at the wire (``wire_dtype``), so partial
sums are rounded to float16 at every hop. Relative error per element ~ 2**-11 per hop; magnitudes
above 65504 become Inf (a gradient that large is already a problem worth surfacing).
"""
from __future__ import annotations

import numpy as np

from birdnet.codecs._common import check_input, check_out
from birdnet.codecs.base import Codec, Pattern, Payload, RoundContext


class Fp16Codec(Codec):
    """Dense float16 on the wire. SUMMABLE; no state."""

    name = "fp16"
    pattern = Pattern.SUMMABLE
    defaults: dict = {}
    wire_dtype = "float16"
    any_size = True  # named by a call, it applies under dense_threshold too (Codec.any_size)

    def compress(self, x: np.ndarray, ctx: RoundContext, state=None) -> Payload:
        check_input(self.name, x, ctx)
        return Payload(header={}, values=x.copy())

    def decompress(self, payload: Payload, out: np.ndarray, ctx: RoundContext, state=None) -> None:
        check_out(self.name, out, ctx)
        out[:] = payload.values
