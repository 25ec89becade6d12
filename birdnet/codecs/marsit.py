"""Marsit: one sign bit per element through every hop of the ring (docs/marsit.md).

What is the paper's (Wu et al., DAC 2022, arXiv 2204.06787, as known from its abstract and a
reading note): the bitwise merge with a Bernoulli mask at hop position k, a global compensation
of the compression deviation, and periodic full-precision "flushes" (Marsit-K). What is
birdnet's design: the scale (one float per node per tensor, combined in rank order), the process
count weighting, where the compensation and momentum live, the flush schedule from
``ctx.tensor_round``, and the local-compensation and no-compensation variants.

Per round, for this node (``w = ctx.local_count`` processes, ``x`` their summed gradient)::

    g = x / w                                   # per-process units
    u = momentum * u + g   (if momentum > 0)     # local momentum, kept in the daemon
    p = (u or g) + c                             # c: compensation
    flush round (every ``flush`` rounds): out = dense mean of p over processes; c = 0
    otherwise:  sigma = scale rule of p;  bits = sign(p);  merged over the ring ->  s (+-1)
                out = S * s,  S = sum_r counts[r] * sigma_r / W   (W = total processes)
    compensation "global": c = p - out;  "local": c = p - sigma * sign(p);  "none": c stays 0

The codec hands the ring the **sum** ``W * out`` (the daemon divides by ``total_count`` for a mean).
The merge is unbiased for the (process-weighted) mean of the nodes' signs, not for the mean
gradient; the compensation carries the difference into later rounds.

Parameters (``defaults`` chosen by the measurements in docs/marsit.md):

``compensation``  ``"global"`` | ``"local"`` | ``"none"``
``flush``         K: every K-th round of a tensor (``tensor_round % K == K - 1``) is a dense
                  all-reduce of p and resets c; 0 = never
``momentum``      local momentum in the daemon (0 = off). With momentum > 0 the training code
                  should apply the result with plain SGD (marsit.md section 3)
``scale``         ``"mean_abs"`` (mean |p|) | ``"rms"`` (sqrt(mean p^2)) | ``"mean_abs_grad"``
                  (mean |g|, the raw gradient) | ``"fixed"`` (``step``, the paper's global step)
``step``          the fixed scale for ``scale="fixed"``
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from birdnet.codecs.base import Codec, Pattern, Payload, RoundContext, overwrite, peek
from birdnet.errors import CodecError, ProtocolError
from birdnet.kernels import lazy

sb = lazy("signbits")

_COMPENSATIONS = ("global", "local", "none")
_SCALES = ("mean_abs", "rms", "mean_abs_grad", "fixed")


class SignRingCodec(Codec):
    """What Marsit and the cascading-sign baseline share: state, momentum, compensation, flushes,
    scales, and the hooks :func:`birdnet.ring.merge.merged_allreduce` calls. Subclasses supply
    :meth:`merge_hop`, :meth:`segment_meta` and :meth:`decompress`."""

    pattern: ClassVar[Pattern] = Pattern.MERGED

    # -- configuration -------------------------------------------------------------------------
    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        out = dict(params)
        comp = out.get("compensation")
        if comp not in _COMPENSATIONS:
            raise CodecError(f"{self.name}: compensation={comp!r}; choose one of {', '.join(_COMPENSATIONS)}")
        k = out.get("flush")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise CodecError(f"{self.name}: flush={k!r} must be an integer >= 0 (rounds between flushes, "
                             f"0 = never)")
        mu = out.get("momentum")
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not 0.0 <= float(mu) < 1.0:
            raise CodecError(f"{self.name}: momentum={mu!r} must be a number in [0, 1)")
        out["momentum"] = float(mu)
        if "scale" in out:
            if out["scale"] not in _SCALES:
                raise CodecError(f"{self.name}: scale={out['scale']!r}; choose one of {', '.join(_SCALES)}")
            st = out.get("step")
            if isinstance(st, bool) or not isinstance(st, (int, float)) or not (math.isfinite(st) and st > 0):
                raise CodecError(f"{self.name}: step={st!r} must be a positive finite number")
            out["step"] = float(st)
        return out

    # -- state ---------------------------------------------------------------------------------
    def new_state(self, n: int) -> dict[str, Any]:
        """``c`` (compensation), ``p`` (this round's compensated vector), ``u`` (momentum)."""
        st: dict[str, Any] = {"c": np.zeros(n, np.float32), "p": np.zeros(n, np.float32), "sigma": 0.0}
        if self.params["momentum"] > 0:
            st["u"] = np.zeros(n, np.float32)
        return st

    def _state(self, state: Any, n: int, ctx: RoundContext) -> dict[str, Any]:
        if state is None:
            return self.new_state(n)
        if not isinstance(state, dict) or "c" not in state or not isinstance(peek(state, "c"), np.ndarray) \
                or peek(state, "c").shape != (n,):
            raise CodecError(f"{self.name}: state of tensor {ctx.name!r} does not fit {n} elements; "
                             f"reset the state (client.reset_state()) after changing a tensor's shape")
        if self.params["momentum"] > 0 and "u" not in state:
            state["u"] = np.zeros(n, np.float32)
        return state

    # -- the round -----------------------------------------------------------------------------
    def is_flush_round(self, ctx: RoundContext) -> bool:
        """Every node decides the same from ``ctx.tensor_round`` (rounds since the last reset)."""
        k = self.params["flush"]
        return k > 0 and ctx.tensor_round % k == k - 1

    def prepare(self, x: np.ndarray, ctx: RoundContext, state: Any) -> np.ndarray:
        """``p = g + c`` (or ``u + c`` with momentum) into ``state["p"]``; returns it."""
        n = int(x.shape[0])
        st = self._state(state, n, ctx)
        inv_w = 1.0 / max(1, int(ctx.local_count))
        p = overwrite(st, "p")  # written whole: no copy of the last round's p in a StateTxn
        sb.prepare_p(np.ascontiguousarray(x, np.float32), inv_w, peek(st, "c"), p, self.params["momentum"],
                     st.get("u"))
        return p

    def compress(self, x: np.ndarray, ctx: RoundContext, state: Any) -> Payload:
        """Sign bits of p (``ceil(n/8)`` bytes, birdnet.kernels.signbits order) and sigma."""
        if x.ndim != 1:
            x = x.reshape(-1)
        sc = self.compressor(x, ctx, state)
        bits = np.empty(sb.nbytes_for(sc.n), np.uint8)
        sc.segment(0, sc.n, bits)
        sigma = sc.finish()
        return Payload(header={"scale": sigma, "weight": int(ctx.local_count), "n": sc.n},
                       buffers=[bits])

    def compressor(self, x: np.ndarray, ctx: RoundContext, state: Any) -> SignCompressor:
        """This round's compression, a segment at a time (the ring sends the first segment while
        the others are packed): see :class:`SignCompressor`."""
        x = np.ascontiguousarray(x.reshape(-1), np.float32)
        return SignCompressor(self, x, ctx, self._state(state, int(x.shape[0]), ctx))

    def compensate_early(self, state: Any, ctx: RoundContext) -> bool:
        """The compensation that needs only this node's p and sigma ("local", "none"), done while
        the ring waits on the wire; True when :meth:`after_round` has nothing left to do."""
        comp = self.params["compensation"]
        if comp == "local" and state is not None:
            sb.sub_signs(state["p"], state["sigma"], overwrite(state, "c"))
        return comp != "global"

    @property
    def needs_result_sum(self) -> bool:
        """Whether :meth:`after_round` reads the round's sum (so the ring must not hand back the
        mean in its place)."""
        return self.params["compensation"] == "global"

    def segment_value(self, scales: list[float], meta: dict[str, float], ctx: RoundContext) -> float:
        """The v with which a merged segment's signs decode to the round's dense sum, ``v * s``:
        ``sum_r counts[r] * scale_r`` in rank order in float64 (the same on every node)."""
        counts = tuple(ctx.counts) if ctx.counts else (1,) * len(scales)
        v = 0.0
        for cnt, sc in zip(counts, scales):
            v += float(cnt) * float(sc)
        return v

    def after_round(self, state: Any, result_sum: np.ndarray, ctx: RoundContext) -> None:
        """Update the compensation from this round's dense sum."""
        if state is None:
            return
        comp = self.params["compensation"]
        p = state["p"]
        if comp == "global":  # both kernels write c whole
            sb.sub_scaled(p, np.ascontiguousarray(result_sum, np.float32), 1.0 / max(1, int(ctx.total_count)),
                          overwrite(state, "c"))
        elif comp == "local":
            sb.sub_signs(p, state["sigma"], overwrite(state, "c"))

    def after_flush(self, state: Any, total: np.ndarray, ctx: RoundContext) -> None:
        """A flush round sent p at full precision: nothing is left to compensate."""
        if state is not None:
            overwrite(state, "c").fill(0.0)

    # -- ring hooks (overridden by subclasses) ---------------------------------------------------
    def segment_meta(self, state: Any, lo: int, hi: int, ctx: RoundContext) -> dict[str, float]:
        """Floats that travel with a segment operand from its first node."""
        return {}

    def merge_hop(self, a: np.ndarray, meta_a: dict[str, float], b: np.ndarray, state: Any, lo: int,
                  hi: int, w_a: int, w_b: int, seed: int, ctx: RoundContext
                  ) -> tuple[np.ndarray, dict[str, float]]:
        raise NotImplementedError


class SignCompressor:
    """One round's compression for a :class:`SignRingCodec`, in segments: :meth:`segment` writes
    ``p[lo:hi]`` (momentum and compensation applied) and its sign bits, :meth:`finish` the scale,
    once every element is done. The scale rule's sums are kept per segment and added in index
    order, so the scale does not depend on the order the ring asks for segments."""

    def __init__(self, codec: SignRingCodec, x: np.ndarray, ctx: RoundContext, state: dict[str, Any]) -> None:
        self.codec, self.x, self.ctx, self.state = codec, x, ctx, state
        self.n = int(x.shape[0])
        self.inv_w = 1.0 / max(1, int(ctx.local_count))
        self.rule = codec.params.get("scale", "mean_abs")
        self.c = peek(state, "c")
        self.p = overwrite(state, "p")  # written whole: no copy of the last round's p in a StateTxn
        self.u = state.get("u")
        self.parts: dict[int, float] = {}

    def segment(self, lo: int, hi: int, bits: np.ndarray) -> None:
        """Elements ``lo:hi`` (``lo`` a multiple of 8) into ``bits`` (their ``ceil((hi-lo)/8)`` bytes)."""
        x, c, p, u = self.x[lo:hi], self.c[lo:hi], self.p[lo:hi], self.u
        mu = self.codec.params["momentum"]
        if self.rule == "mean_abs":  # the default: one pass over x, c (and u)
            self.parts[lo] = sb.prepare_pack(x, self.inv_w, c, p, bits, mu, None if u is None else u[lo:hi])
            return
        sb.prepare_p(x, self.inv_w, c, p, mu, None if u is None else u[lo:hi])
        sb.pack_signs(p, bits)
        if self.rule == "rms":
            self.parts[lo] = sb.sq_sum(p)
        elif self.rule == "mean_abs_grad":
            self.parts[lo] = sb.abs_sum(x)

    def finish(self) -> float:
        """This node's per-process scale sigma by the ``scale`` rule (kept in the state)."""
        n = self.n
        total = 0.0
        for lo in sorted(self.parts):
            total += self.parts[lo]
        if self.rule == "fixed":
            sigma = self.codec.params["step"]
        elif n == 0:
            sigma = 0.0
        elif self.rule == "rms":
            sigma = math.sqrt(total / n)
        elif self.rule == "mean_abs_grad":
            sigma = total / n / max(1, int(self.ctx.local_count))
        else:
            sigma = total / n
        self.state["sigma"] = float(sigma)
        return float(sigma)


class MarsitCodec(SignRingCodec):
    """Marsit: unbiased bitwise merge of sign bits at every hop; compensation (local by default,
    global as in the paper's note), optional flushes."""

    name: ClassVar[str] = "marsit"
    # Measured defaults (docs/marsit.md, "Defaults"): local compensation without flushes matched or
    # beat dense on MNIST-1D at 4 and 8 workers; global compensation needs flushes (41.8% at 8
    # workers without, 71.9% with K=100) because each node's own noise is never removed from c.
    defaults: ClassVar[dict[str, Any]] = {
        "compensation": "local",
        "flush": 0,
        "momentum": 0.0,
        "scale": "mean_abs",
        "step": 0.01,
    }

    def merge_hop(self, a, meta_a, b, state, lo, hi, w_a, w_b, seed, ctx):
        """keep the received bit with probability w_a / (w_a + w_b), else the local one."""
        out = np.empty(b.shape[0], np.uint8)
        sb.merge_signbits(a, b, out, w_a, w_b, seed)
        return out, {}

    def decompress(self, payload: Payload, out: np.ndarray, ctx: RoundContext, state: Any) -> None:
        """The dense sum ``v * s``: ``v = sum_r counts[r] * scale_r`` (rank order, float64, rounded
        once to float32) for a merged payload; ``local_count * scale`` for a single node's."""
        n = out.shape[0]
        bits = payload.buffers[0]
        if bits.dtype != np.uint8 or bits.shape[0] != sb.nbytes_for(n):
            raise ProtocolError(f"{self.name}: {bits.shape[0]} bytes of bits for {n} elements")
        h = payload.header
        if "scales" in h:
            counts = tuple(ctx.counts) if ctx.counts else (1,) * len(h["scales"])
            if len(counts) != len(h["scales"]):
                raise ProtocolError(f"{self.name}: {len(h['scales'])} scales for {len(counts)} nodes")
            v = 0.0
            for cnt, sc in zip(counts, h["scales"]):
                v += float(cnt) * float(sc)
        else:
            v = float(h.get("weight", 1)) * float(h["scale"])
        sb.unpack_signs(np.ascontiguousarray(bits), v, out)
