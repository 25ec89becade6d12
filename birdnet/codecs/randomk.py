"""``randomk``: Random-K with a seed shared by the cluster — indexes never travel.

Every node derives the same k indexes from ``ctx.seed`` (stratified: one uniform pick in each of k
equal strata, counter-based generator, integer bounds), so the kept values are aligned and the
payload is SUMMABLE. ``header["digest"]`` is a hash of the selection; the ring compares it.
With ``scale=True`` values are multiplied by the stratum size (~n/k): exactly unbiased,
E[C(x)] = x, variance per element x_i^2 (n/k - 1). With ``scale=False`` (recommended with error
feedback) the bound is ||x - C(x)||^2 <= ||x||^2 per round and error feedback keeps the rest.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from birdnet.codecs import _common as C
from birdnet.codecs.base import Codec, Pattern, Payload, RoundContext
from birdnet.codecs.topk import count_for, density_param
from birdnet.errors import CodecError, RoundMismatchError
from birdnet.kernels import lazy

rng, sparse = lazy("rng"), lazy("sparse")


class RandomKCodec(Codec):
    """Shared-seed Random-K. SUMMABLE. State: none, or v (+u) with error feedback."""

    name = "randomk"
    pattern = Pattern.SUMMABLE
    defaults = {"density": 0.01, "scale": True, "error_feedback": False, "momentum": 0.0}

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        params["density"] = density_param(self.name, params)
        if not isinstance(params["scale"], bool):
            raise CodecError(f"codec 'randomk': scale must be True or False, got {params['scale']!r}")
        return C.feedback_params(self.name, params)

    def new_state(self, n: int):
        return C.feedback_state(n, self.params)

    def _selection(self, n: int, ctx: RoundContext) -> tuple[np.ndarray, np.ndarray, int]:
        idx, scale = sparse.randomk_indexes(ctx.seed, n, count_for(self.params["density"], n))
        return idx, scale, rng.digest(ctx.seed, idx)

    def compress(self, x: np.ndarray, ctx: RoundContext, state=None) -> Payload:
        n = C.check_input(self.name, x, ctx)
        idx, scale, dig = self._selection(n, ctx)
        ef = self.params["error_feedback"]
        src = C.accumulate(x, C.require_state(self.name, state, n, ("v",)), self.params["momentum"]) if ef else x
        vals = src[idx]
        if self.params["scale"]:
            vals *= scale
        if ef:
            state["v"][idx] -= vals
            if "u" in state:
                state["u"][idx] = 0.0
        return Payload(header={"n": n, "k": int(idx.shape[0]), "digest": dig}, values=vals)

    def decompress(self, payload: Payload, out: np.ndarray, ctx: RoundContext, state=None) -> None:
        C.check_out(self.name, out, ctx)
        n = ctx.size
        idx, _, dig = self._selection(n, ctx)
        if payload.header.get("digest") != dig:
            raise RoundMismatchError(f"randomk, tensor {ctx.name!r}, round {ctx.round_id}: selection "
                                     f"digest {payload.header.get('digest')!r} != local {dig}")
        if payload.values is None or payload.values.shape[0] != idx.shape[0]:
            raise CodecError(f"randomk: summed payload has the wrong number of values for k={idx.shape[0]}")
        out[:] = 0.0
        out[idx] = payload.values
