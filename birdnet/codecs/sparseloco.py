"""``sparseloco``: per-chunk Top-k of an error-feedback accumulator, two bits a kept value (SparseLoCo,
arXiv 2508.15706), for DiLoCo's pseudo-gradients.

Each node keeps an accumulator ``v`` per tensor (``state["v"]``); a round computes
``e = beta * v + x``, sends in every chunk of ``chunk`` values its ``k`` largest |e| as two bits each
(sign, and which of the chunk's two magnitudes: birdnet.kernels.chunktopk has the format) and keeps
``v = e - sent``. With ``beta = 1`` that is error feedback: the results of all rounds plus the
nodes' accumulators are the sum of the inputs. With ``beta < 1`` the accumulator decays (SparseLoCo's
replacement of the outer momentum).

GATHERED: the kept positions differ between nodes, so every node's payload goes round the ring and
each node adds them in rank order (the same sum, bit for bit, everywhere). A node sends ``world - 1``
payloads a round (its own and the ones it forwards), where a dense code in a ring sends
``2 (world - 1) / world`` of one: this code pays when its payload is below about ``2 / world`` of
a dense one. Payload per chunk of c values: ``ceil((min(k b, c) + 2 k) / 8)`` bytes (the positions
as offsets of ``b = ceil(log2 c)`` bits, or a bitmap of c bits, whichever is smaller; then the
values) and two bfloat16 scales. Chunks of 4096, k = 256: 452 bytes per 4096 values, 0.88 bits a
value.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from birdnet.codecs import _common as C
from birdnet.codecs.base import Codec, Pattern, Payload, RoundContext, overwrite, peek
from birdnet.errors import CodecError
from birdnet.kernels import lazy

K = lazy("chunktopk")

#: the largest chunk (offsets within it fit 16 bits)
MAX_CHUNK = 1 << 16


class SparseLoCoCodec(Codec):
    """Per-chunk Top-k, two-bit values, an error-feedback accumulator with decay ``beta``. GATHERED.
    State: v = 4n bytes."""

    name = "sparseloco"
    pattern = Pattern.GATHERED
    defaults = {"chunk": 4096, "k": 64, "beta": 1.0}

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        chunk, k, beta = params["chunk"], params["k"], params["beta"]
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 2 <= chunk <= MAX_CHUNK:
            raise CodecError(f"codec 'sparseloco': chunk must be an int in [2, {MAX_CHUNK}] (values per chunk), "
                             f"got {chunk!r}; e.g. chunk=4096")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= chunk:
            raise CodecError(f"codec 'sparseloco': k must be an int in [1, chunk={chunk}] (values kept per chunk), "
                             f"got {k!r}; e.g. k=64 (1.6 % of 4096)")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= float(beta) <= 1.0:
            raise CodecError(f"codec 'sparseloco': beta must be a number in [0, 1] (the accumulator's decay; "
                             f"1: plain error feedback), got {beta!r}")
        params["beta"] = float(beta)
        return params

    def new_state(self, n: int) -> Any:
        return {"v": np.zeros(n, np.float32)}

    def compress(self, x: np.ndarray, ctx: RoundContext, state: Any = None) -> Payload:
        n = C.check_input(self.name, x, ctx)
        C.require_state(self.name, state, n, ("v",))
        old = peek(state, "v")
        e = overwrite(state, "v")  # every element written below
        np.multiply(old, np.float32(self.params["beta"]), out=e)
        np.add(e, x, out=e)
        sent = np.empty(n, np.float32)
        scales, body = K.encode(e, self.params["chunk"], self.params["k"], sent)
        np.subtract(e, sent, out=e)
        return Payload(header={"n": n}, buffers=[scales, body])

    def payload_from_wire(self, header: dict[str, Any], buffers: list[memoryview]) -> Payload:
        payload = super().payload_from_wire(header, buffers)
        n, scales, body = self._checked(payload, None)
        self._raise_if_bad(K.check(scales, body, n, self.params["chunk"], self.params["k"]), None)
        return payload

    @staticmethod
    def _raise_if_bad(rc: int, ctx: RoundContext | None) -> None:
        if rc:
            what = "an offset out of its chunk or out of order" if rc == K.BAD_OFFSET else "a bitmap without k bits"
            where = f" for tensor {ctx.name!r} (round {ctx.round_id})" if ctx is not None else ""
            raise CodecError(f"sparseloco: payload{where} has {what}")

    def _checked(self, payload: Payload, ctx: RoundContext | None) -> tuple[int, np.ndarray, np.ndarray]:
        """(n, scales, body), every size checked against the header (and the round's n with ctx)."""
        h = payload.header
        n = C.check_n(self.name, h, ctx) if ctx is not None else C.header_int(self.name, h, "n", 0, 1 << 62)
        if len(payload.buffers) != 2:
            raise CodecError(f"sparseloco: payload has {len(payload.buffers)} buffers, expected 2 (scales, body)")
        scales, body = payload.buffers
        ns, nb = K.nbytes(n, self.params["chunk"], self.params["k"])
        C.expect_buffer(self.name, scales, "scales", ("<u2",), ns)
        C.expect_buffer(self.name, body, "body", ("|u1",), nb)
        return n, scales, body

    def decompress_add(self, payload: Payload, out: np.ndarray, ctx: RoundContext) -> None:
        C.check_out(self.name, out, ctx)
        _n, scales, body = self._checked(payload, ctx)
        self._raise_if_bad(K.decode_add(scales, body, self.params["chunk"], self.params["k"], out), ctx)
