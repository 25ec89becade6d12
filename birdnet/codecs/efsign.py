"""``efsign``: EF-signSGD (Karimireddy et al., 2019) — one bit per element plus one scale.

p = x + residual; scale = mean |p| = ||p||_1 / n; send sign bits of p (packed, LSB first) and the
scale; residual = p - scale * sign(p). GATHERED: ceil(n/8) bytes + the scale in the header
(32x smaller than float32). Per round ||p - C(p)||^2 <= (1 - ||p||_1^2 / (n ||p||_2^2)) ||p||^2;
with error feedback nothing is lost, only delayed. State: the residual, 4n bytes.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from birdnet.codecs import _common as C
from birdnet.codecs.base import Codec, Pattern, Payload, RoundContext
from birdnet.errors import CodecError
from birdnet.kernels import lazy

quant = lazy("quant")


class EFSignCodec(Codec):
    """EF-signSGD. GATHERED. State: residual v (4n bytes) with error feedback."""

    name = "efsign"
    pattern = Pattern.GATHERED
    defaults = {"error_feedback": True, "momentum": 0.0}

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        return C.feedback_params(self.name, params)

    def new_state(self, n: int):
        return C.feedback_state(n, self.params)

    def compress(self, x: np.ndarray, ctx: RoundContext, state=None) -> Payload:
        n = C.check_input(self.name, x, ctx)
        residual = C.require_state(self.name, state, n, ("v",))["v"] if self.params["error_feedback"] else None
        scale, bits = quant.ef_sign_compress(x, residual)
        return Payload(header={"n": n, "scale": scale}, buffers=[bits])

    def _check(self, payload: Payload, ctx: RoundContext | None) -> tuple[float, np.ndarray]:
        h = payload.header
        n = C.check_n(self.name, h, ctx) if ctx is not None else C.header_int(self.name, h, "n", 0, 1 << 62)
        scale = C.header_float(self.name, h, "scale")
        if len(payload.buffers) != 1:
            raise CodecError(f"efsign: payload has {len(payload.buffers)} buffers, expected 1")
        C.expect_buffer(self.name, payload.buffers[0], "sign bits", ("|u1",), (n + 7) // 8)
        return scale, payload.buffers[0]

    def payload_from_wire(self, header: dict[str, Any], buffers: list[memoryview]) -> Payload:
        payload = super().payload_from_wire(header, buffers)
        self._check(payload, None)
        return payload

    def decompress_add(self, payload: Payload, out: np.ndarray, ctx: RoundContext) -> None:
        C.check_out(self.name, out, ctx)
        scale, bits = self._check(payload, ctx)
        quant.signs_add(bits, scale, out)
