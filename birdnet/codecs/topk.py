"""``topk``: exact Top-K by magnitude with per-element indexes (the baseline BIRD+ is measured against).

Selection is a two-pass radix select on the magnitude bits (birdnet.kernels.sparse), O(n), no sort.
GATHERED: payload = uint32 indexes + float32 values (8 bytes per kept element).
Error bound per round without error feedback: ||x - C(x)||^2 <= (1 - k/n) ||x||^2; with error
feedback nothing is lost, only delayed (the residual keeps the unsent part).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from birdnet.codecs import _common as C
from birdnet.codecs.base import Codec, Pattern, Payload, RoundContext
from birdnet.errors import CodecError
from birdnet.kernels import lazy

sparse = lazy("sparse")


def density_param(codec: str, params: dict[str, Any]) -> float:
    d = params.get("density")
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not (0.0 < float(d) <= 1.0):
        raise CodecError(f"codec {codec!r}: density must be a number in (0, 1], got {d!r}")
    return float(d)


def count_for(density: float, n: int) -> int:
    """Kept count: round(density*n), at least 1 for a non-empty tensor."""
    return 0 if n == 0 else max(1, min(n, int(np.floor(density * n + 0.5))))


class TopKCodec(Codec):
    """Top-K sparsification. GATHERED. State: v (and u with momentum) = 4n (8n) bytes with error
    feedback, none without."""

    name = "topk"
    pattern = Pattern.GATHERED
    defaults = {"density": 0.01, "error_feedback": True, "momentum": 0.0}

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        params["density"] = density_param(self.name, params)
        return C.feedback_params(self.name, params)

    def new_state(self, n: int):
        return C.feedback_state(n, self.params)

    def compress(self, x: np.ndarray, ctx: RoundContext, state=None) -> Payload:
        n = C.check_input(self.name, x, ctx)
        k = count_for(self.params["density"], n)
        if self.params["error_feedback"]:
            st = C.require_state(self.name, state, n, ("v",))
            src = C.accumulate(x, st, self.params["momentum"])
        else:
            src = x
        idx, val = sparse.topk(src, k)
        if self.params["error_feedback"]:
            st["v"][idx] = 0.0  # sent exactly (float32)
            if "u" in st:
                st["u"][idx] = 0.0
        return Payload(header={"n": n, "k": int(idx.shape[0])}, buffers=[idx.astype(np.uint32), val])

    def payload_from_wire(self, header: dict[str, Any], buffers: list[memoryview]) -> Payload:
        payload = super().payload_from_wire(header, buffers)
        _validated_sparse(self.name, payload, None)
        return payload

    def decompress_add(self, payload: Payload, out: np.ndarray, ctx: RoundContext) -> None:
        C.check_out(self.name, out, ctx)
        idx, val = _validated_sparse(self.name, payload, ctx)
        sparse.scatter_add(idx, val, out)


def _validated_sparse(codec: str, payload: Payload,
                      ctx: RoundContext | None) -> tuple[np.ndarray, np.ndarray]:
    """(indexes, values) of an index+value payload, every size checked against the header and, when
    ctx is given, against the round's n (``payload_from_wire`` has no ctx; ``decompress_add`` has)."""
    h = payload.header
    n = C.check_n(codec, h, ctx) if ctx is not None else C.header_int(codec, h, "n", 0, 1 << 62)
    k = C.header_int(codec, h, "k", 0, n)
    if len(payload.buffers) != 2:
        raise CodecError(f"{codec}: payload has {len(payload.buffers)} buffers, expected 2 (indexes, values)")
    idx, val = payload.buffers
    C.expect_buffer(codec, idx, "indexes", ("<u4",), k)
    C.expect_buffer(codec, val, "values", ("<f4",), k)
    if k and sparse.max_index(idx) >= n:
        raise CodecError(f"{codec}: payload index {sparse.max_index(idx)} is out of range for n={n}")
    return idx, val
