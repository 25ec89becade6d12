"""``qsgd``: stochastic quantisation to s levels (Alistarh et al., 2017).

level_i = floor(|x_i|/||x||_2 * s + u_i), u_i ~ U(0,1) from the node's local seed; the receiver adds
sign * level * ||x|| / s. Unbiased: E[C(x)] = x; variance E||C(x) - x||^2 <= min(n/s^2, sqrt(n)/s) ||x||^2.
GATHERED: int8 levels (s <= 127) or uint16 levels + s (s <= 32767) + the norm in the header. No state. A
non-finite norm (NaN/Inf in x) is sent as such and the receiver adds NaN everywhere.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from birdnet.codecs import _common as C
from birdnet.codecs.base import Codec, Pattern, Payload, RoundContext
from birdnet.errors import CodecError
from birdnet.kernels import lazy

quant = lazy("quant")


class QSGDCodec(Codec):
    """QSGD. GATHERED, unbiased, stateless."""

    name = "qsgd"
    pattern = Pattern.GATHERED
    defaults = {"levels": 127}

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        s = params["levels"]
        if isinstance(s, bool) or not isinstance(s, int) or not (1 <= s <= 32767):
            raise CodecError(f"codec 'qsgd': levels must be an integer in [1, 32767], got {s!r}")
        return params

    def _level_dtype(self) -> str:
        return "|i1" if self.params["levels"] <= 127 else "<u2"

    def compress(self, x: np.ndarray, ctx: RoundContext, state=None) -> Payload:
        n = C.check_input(self.name, x, ctx)
        s = self.params["levels"]
        norm, levels = quant.qsgd_quantise(x, s, ctx.local_seed)
        return Payload(header={"n": n, "norm": float(norm)}, buffers=[levels])

    def _check(self, payload: Payload, ctx: RoundContext | None) -> tuple[float, np.ndarray]:
        h = payload.header
        n = C.check_n(self.name, h, ctx) if ctx is not None else C.header_int(self.name, h, "n", 0, 1 << 62)
        norm = C.header_float(self.name, h, "norm")
        if len(payload.buffers) != 1:
            raise CodecError(f"qsgd: payload has {len(payload.buffers)} buffers, expected 1")
        C.expect_buffer(self.name, payload.buffers[0], "levels", (self._level_dtype(),), n)
        return norm, payload.buffers[0]

    def payload_from_wire(self, header: dict[str, Any], buffers: list[memoryview]) -> Payload:
        payload = super().payload_from_wire(header, buffers)
        self._check(payload, None)
        return payload

    def decompress_add(self, payload: Payload, out: np.ndarray, ctx: RoundContext) -> None:
        C.check_out(self.name, out, ctx)
        norm, levels = self._check(payload, ctx)
        if not math.isfinite(norm):
            out += np.float32(np.nan)
            return
        s = self.params["levels"]
        quant.dequantise_add(levels, norm / s, out, quant.level_offset(s))
