"""Common machinery of ``bird`` and ``birdplus``: block sampling with index sharing.

See docs/codecs.md and ../shared/papers/bird.md section 2. What the abstracts state (index sharing
over blocks, two random stages, expectation invariance, Gamma correction, uniform-distribution
sampling) is the papers'; the concrete sampling (threshold from a block sample, systematic sampling,
the shared selection mode, bounded scaling, error feedback and momentum correction options) is
birdnet's design.

Compression of a tensor of n elements with blocks of b (m = ceil(n/b) blocks):

1. one pass over memory: block L1 norms a_i (fused with ``v += x`` / momentum when error feedback
   is on) — birdnet.kernels.blocks;
2. O(m) work on the norms only: probabilities p_i, then the selection (subclass);
3. gather of the kept blocks, scaled by ``exact`` 1/p_i, ``capped`` 1/max(p_i, 1/cap) or ``none``.

Modes:
``local``  GATHERED; payload = block ids (uint16 when m <= 65536, else uint32) + values
           (k*b float32 or float16, last block zero-padded). Stateless without error feedback.
``shared`` SUMMABLE; all nodes select the same blocks from state they hold identically: the
           running importance ``imp`` (the last observed global L1 norm of each block, updated in
           ``after_round`` from the round's dense sum; m float32) and ``ctx.seed``. Probabilities
           p = (1 - eps) * p_importance + eps * k/m. No ids on the wire; ``header["digest"]`` hashes
           the selection so a disagreement fails the round.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from birdnet.codecs import _common as C
from birdnet.codecs.base import Codec, Pattern, Payload, RoundContext
from birdnet.codecs.topk import density_param
from birdnet.errors import CodecError, RoundMismatchError
from birdnet.kernels import blocks as B
from birdnet.kernels import rng

_SCALES = ("exact", "capped", "none")


def kept_blocks(density: float, m: int) -> int:
    """K = round(density * m), at least 1 for a non-empty tensor (bird.md 2; see docs for rho*m < 1)."""
    return 0 if m == 0 else max(1, min(m, int(np.floor(density * m + 0.5))))


class BlockSamplingCodec(Codec):
    pattern = Pattern.GATHERED  # instances in ``shared`` mode set SUMMABLE in validate

    common_defaults: dict[str, Any] = {
        # Measured (docs/codecs.md, "Choosing the defaults"): blocks of 8 and a scale capped at 10x
        # reached dense accuracy on MNIST-1D at 4 and 8 workers with momentum correction; blocks
        # of 32 lost 7-8 points, an uncapped scale diverged, no scale lost 3-4 points at 8 workers.
        "density": 0.01, "block": 8, "mode": "local", "value_dtype": "float32",
        "scale": "capped", "cap": 10.0, "error_feedback": True, "momentum": 0.0, "eps": 0.1,
    }

    # -- configuration ---------------------------------------------------------------------------
    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        name = self.name
        params["density"] = density_param(name, params)
        b = params["block"]
        if isinstance(b, bool) or not isinstance(b, int) or not (1 <= b <= 1 << 20):
            raise CodecError(f"codec {name!r}: block must be an integer in [1, 1048576], got {b!r}")
        if params["mode"] not in ("local", "shared"):
            raise CodecError(f"codec {name!r}: mode must be 'local' or 'shared', got {params['mode']!r}")
        if params["value_dtype"] not in ("float32", "float16"):
            raise CodecError(f"codec {name!r}: value_dtype must be 'float32' or 'float16', "
                             f"got {params['value_dtype']!r}")
        if params["scale"] not in _SCALES:
            raise CodecError(f"codec {name!r}: scale must be one of {', '.join(_SCALES)}, got {params['scale']!r}")
        cap = params["cap"]
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not float(cap) >= 1.0:
            raise CodecError(f"codec {name!r}: cap must be a number >= 1, got {cap!r}")
        params["cap"] = float(cap)
        eps = params["eps"]
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0.0 < float(eps) <= 1.0):
            raise CodecError(f"codec {name!r}: eps (shared-mode floor) must be in (0, 1], got {eps!r}")
        params["eps"] = float(eps)
        params = C.feedback_params(name, params)
        shared = params["mode"] == "shared"
        # instance attributes: the daemon reads codec.pattern / codec.wire_dtype from the instance
        self.pattern = Pattern.SUMMABLE if shared else Pattern.GATHERED
        self.wire_dtype = params["value_dtype"] if shared else "float32"
        return params

    # -- state -----------------------------------------------------------------------------------
    def new_state(self, n: int):
        st = C.feedback_state(n, self.params) or {}
        if self.params["mode"] == "shared":
            st["imp"] = np.full(-(-n // self.params["block"]), -1.0, np.float32)
        return st or None

    # -- selection (subclasses) ------------------------------------------------------------------
    def _local_selection(self, norms: np.ndarray, amax: float,
                         ctx: RoundContext) -> tuple[np.ndarray, np.ndarray]:
        """(p of the kept blocks: float64, ascending kept ids: int64) from this node's block norms
        (``amax``: the largest finite norm)."""
        raise NotImplementedError

    def _shared_selection(self, weights_src: np.ndarray, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(p of the kept blocks, ids) from the shared importance: must be bit-identical on every node."""
        raise NotImplementedError

    def _shared(self, state: Any, m: int, ctx: RoundContext) -> tuple[np.ndarray, np.ndarray, int]:
        st = C.require_state(self.name, state, m, ("imp",))
        pk, ids = self._shared_selection(B.importance(st["imp"]), m, ctx.seed)
        return pk, ids, rng.digest(ctx.seed, ids)

    # -- the work --------------------------------------------------------------------------------
    def compress(self, x: np.ndarray, ctx: RoundContext, state=None) -> Payload:
        n = C.check_input(self.name, x, ctx)
        prm = self.params
        b = prm["block"]
        m = -(-n // b)
        shared = prm["mode"] == "shared"
        norms = np.empty(m, np.float32)
        st = None
        amax = 0.0
        if prm["error_feedback"]:
            st = C.require_state(self.name, state, n, ("v",))
            src = st["v"]
            amax = B.norms_max(x, st.get("u"), src, prm["momentum"], b, norms, error_feedback=True)
        else:
            src = x
            if not shared:
                amax = B.norms_max(x, None, None, 0.0, b, norms, error_feedback=False)
        if shared:
            pk, ids, dig = self._shared(state, m, ctx)
        else:
            pk, ids = self._local_selection(norms, amax, ctx)
        k = int(ids.shape[0])
        scale = self._scales(pk)
        vals = np.empty(k * b, np.float32)
        f16 = prm["value_dtype"] == "float16"
        if st is not None and not f16:  # gather and error-feedback update in one visit per block
            B.gather_subtract(src, st.get("u"), b, ids, scale, vals)
        else:
            B.gather_blocks(src, b, ids, scale, vals)
        wire = vals
        if f16:
            wire16 = vals.astype(np.float16)
            vals = wire16.astype(np.float32)  # what the receivers get (own rounding, for EF)
            wire = vals if shared else wire16
            if st is not None:
                B.subtract_sent(st["v"], st.get("u"), b, ids, vals)
        if shared:
            # the shared selection ignores this round's data, so a NaN/Inf outside the kept blocks
            # would not reach the result: poison the summed values so it does (order-independent)
            bad = float(np.sum(norms, dtype=np.float64)) if prm["error_feedback"] else float(np.sum(x))
            if not np.isfinite(bad) and k:
                vals[0] = vals[0] + np.float32(bad)
            return Payload(header={"n": n, "b": b, "k": k, "digest": dig}, values=vals)
        return Payload(header={"n": n, "b": b, "k": k},
                       buffers=[ids.astype(C.index_dtype(m)), wire])

    def _scales(self, pk: np.ndarray) -> np.ndarray:
        # pk: the selection probabilities of the kept blocks
        how = self.params["scale"]
        if how == "none" or pk.shape[0] == 0:
            return np.ones(pk.shape[0], np.float32)
        if how == "capped":
            pk = np.maximum(pk, 1.0 / self.params["cap"])
        return (1.0 / pk).astype(np.float32)

    # -- shared mode ---------------------------------------------------------------------------------
    def decompress(self, payload: Payload, out: np.ndarray, ctx: RoundContext, state=None) -> None:
        C.check_out(self.name, out, ctx)
        if self.params["mode"] != "shared":
            raise CodecError(f"codec {self.name!r} in local mode is GATHERED: use decompress_add")
        n = ctx.size
        b = self.params["block"]
        m = -(-n // b)
        _, ids, dig = self._shared(state, m, ctx)
        got = payload.header.get("digest")
        if got != dig:
            raise RoundMismatchError(
                f"{self.name}, tensor {ctx.name!r}, round {ctx.round_id}: shared selection digest "
                f"{got!r} differs from this node's {dig} (importance state or seed disagree)")
        vals = payload.values
        if vals is None or vals.shape[0] != ids.shape[0] * b:
            raise CodecError(f"{self.name}: summed payload has "
                             f"{None if vals is None else vals.shape[0]} values, expected {ids.shape[0] * b}")
        out[:] = 0.0
        B.scatter_blocks(np.ascontiguousarray(vals, dtype=np.float32), b, ids, out, add=False)

    def after_round(self, state: Any, result_sum: np.ndarray, ctx: RoundContext) -> None:
        if self.params["mode"] != "shared" or state is None or "imp" not in state:
            return
        # importance (b): the last observed global L1 norm of each block. result_sum is identical on
        # every node and the norm kernel is order-fixed, so imp stays identical everywhere.
        a = B.block_norms(np.ascontiguousarray(result_sum, dtype=np.float32), self.params["block"])
        seen = (a > 0.0) & np.isfinite(a)
        state["imp"][seen] = a[seen]

    # -- local mode --------------------------------------------------------------------------------
    def _check_local(self, payload: Payload, ctx: RoundContext | None) -> tuple[np.ndarray, np.ndarray, int]:
        name = self.name
        h = payload.header
        n = C.check_n(name, h, ctx) if ctx is not None else C.header_int(name, h, "n", 0, 1 << 62)
        b = C.header_int(name, h, "b", 1, 1 << 20)
        if b != self.params["block"]:
            raise CodecError(f"{name}: payload block size {b} differs from this codec's {self.params['block']}")
        m = -(-n // b)
        k = C.header_int(name, h, "k", 0, m)
        if len(payload.buffers) != 2:
            raise CodecError(f"{name}: payload has {len(payload.buffers)} buffers, expected 2 (ids, values)")
        ids, vals = payload.buffers
        C.expect_buffer(name, ids, "block ids", (np.dtype(C.index_dtype(m)).str,), k)
        C.expect_buffer(name, vals, "values", ("<f2" if self.params["value_dtype"] == "float16" else "<f4",), k * b)
        if not B.distinct_ascending(ids, m):
            raise CodecError(f"{name}: payload block ids are not distinct, ascending and below m={m}")
        return ids, vals, b

    def payload_from_wire(self, header: dict[str, Any], buffers: list[memoryview]) -> Payload:
        if self.params["mode"] == "shared":
            raise CodecError(f"codec {self.name!r} in shared mode is SUMMABLE; nothing to rebuild")
        payload = super().payload_from_wire(header, buffers)
        self._check_local(payload, None)
        return payload

    def decompress_add(self, payload: Payload, out: np.ndarray, ctx: RoundContext) -> None:
        C.check_out(self.name, out, ctx)
        ids, vals, b = self._check_local(payload, ctx)
        B.scatter_blocks(vals, b, ids, out, add=True)
