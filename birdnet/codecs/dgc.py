"""``dgc``: Deep Gradient Compression (Lin et al., 2018) — threshold from a random sample.

The magnitude threshold is the k_s-th largest of a uniform sample (``sample`` fraction of n, at least
1024 elements) drawn with the node's local seed; every element at or above it is sent; if the
estimate lets through more than 2k elements, an exact Top-K of those trims to k. Error feedback is
always on (it is part of DGC); momentum correction with ``momentum`` > 0 (then apply the result with
plain SGD). GATHERED: uint32 indexes + float32 values. Nothing is lost, only delayed.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from birdnet.codecs import _common as C
from birdnet.codecs.base import Codec, Pattern, Payload, RoundContext
from birdnet.codecs.topk import _validated_sparse, count_for, density_param
from birdnet.errors import CodecError
from birdnet.kernels import lazy

sparse = lazy("sparse")


class DGCCodec(Codec):
    """DGC. GATHERED. State: v (4n bytes), plus u (4n) with momentum correction."""

    name = "dgc"
    pattern = Pattern.GATHERED
    defaults = {"density": 0.01, "sample": 0.01, "momentum": 0.0, "error_feedback": True}

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        params["density"] = density_param(self.name, params)
        s = params["sample"]
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (0.0 < float(s) <= 1.0):
            raise CodecError(f"codec 'dgc': sample must be a fraction in (0, 1], got {s!r}")
        if params["error_feedback"] is not True:
            raise CodecError("codec 'dgc': error feedback is part of DGC; use topk or randomk without it")
        params["sample"] = float(s)
        return C.feedback_params(self.name, params)

    def new_state(self, n: int):
        return C.feedback_state(n, self.params)

    def compress(self, x: np.ndarray, ctx: RoundContext, state=None) -> Payload:
        n = C.check_input(self.name, x, ctx)
        st = C.require_state(self.name, state, n, ("v",))
        v = C.accumulate(x, st, self.params["momentum"])
        k = count_for(self.params["density"], n)
        s = max(1024, int(self.params["sample"] * n))
        idx, val = sparse.threshold_select(v, k, ctx.local_seed, s)
        v[idx] = 0.0
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
