"""``none``: the dense float32 ring (the baseline every compression ratio is measured against)."""
from __future__ import annotations

import numpy as np

from birdnet.codecs._common import check_input, check_out
from birdnet.codecs.base import Codec, Pattern, Payload, RoundContext


class NoneCodec(Codec):
    """No compression. SUMMABLE; exact up to float32 summation order. No state."""

    name = "none"
    pattern = Pattern.SUMMABLE
    defaults: dict = {}
    wire_dtype = "float32"

    def compress(self, x: np.ndarray, ctx: RoundContext, state=None) -> Payload:
        check_input(self.name, x, ctx)
        # a copy: the ring sums into ``values`` and x belongs to the caller
        return Payload(header={}, values=x.copy())

    def decompress(self, payload: Payload, out: np.ndarray, ctx: RoundContext, state=None) -> None:
        check_out(self.name, out, ctx)
        out[:] = payload.values
