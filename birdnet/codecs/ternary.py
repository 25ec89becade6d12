"""``ternary``: dense, three levels a value (-s, 0, s) with a scale per block, summed hop by hop.

Every value travels as one of three levels, five to a byte, with one bfloat16 scale per ``block``
values, 1.5 times the block's mean |x| (birdnet.kernels.ternary has the format and why 1.5): 1.65
bits a value at the default block of 320, between ``lowbit``'s 1 bit (signs only: every value
±mean|x|) and its 2 bits (2.25 at block 64). The scale from the mean |x| keeps the values of
ordinary size away from 0, where ``lowbit``'s symmetric 2 bits, scaled by the block's maximum,
send most values of a heavy-tailed block as 0.

It travels as ``lowbit`` does (SUMMABLE through the dense ring's wire-format hook,
birdnet.ring.dense.WireFormat): each hop decodes the incoming partial sum, adds its own values
in float32 and encodes the sum again; each segment's owner encodes the finished sum once more and
the all-gather forwards those bytes, which every node decodes alike. Each node encodes every
element exactly once a round, so with ``error_feedback`` (the default) it keeps what its
encodings lost, ``state["v"]``, and adds it to its next contribution: the results of all rounds
plus the nodes' residuals are the sum of the inputs.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from birdnet.codecs import _common as C
from birdnet.codecs.base import Pattern, RoundContext
from birdnet.errors import CodecError
from birdnet.kernels import lazy

K = lazy("ternary")


class TernaryWire:
    """The ring's :class:`~birdnet.ring.dense.WireFormat` for one round: three levels a value in
    blocks of ``block``; the encoding error of every element goes into ``residual`` when given."""

    def __init__(self, block: int, residual: np.ndarray | None = None) -> None:
        self.block, self.residual = block, residual
        self.align = block

    def nbytes(self, count: int) -> int:
        return K.nbytes(count, self.block)

    def elements(self, nbytes: int) -> int:
        return max(self.block, nbytes * 5)  # five levels a byte

    def encode(self, src: np.ndarray, start: int, deq: np.ndarray | None = None) -> np.ndarray:
        return K.encode(src, self.block, deq=deq, residual=self.residual, res_off=start)

    def decode(self, buf: np.ndarray, out: np.ndarray, own: np.ndarray | None = None) -> None:
        K.decode(buf, self.block, out, own)


class TernaryCodec(C.HopRequantised):
    """Block-scaled ternary values. SUMMABLE (requantised at every hop); optional error feedback."""

    name = "ternary"
    pattern = Pattern.SUMMABLE
    defaults = {"block": 320, "error_feedback": True}

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        block, ef = params["block"], params["error_feedback"]
        if isinstance(block, bool) or not isinstance(block, int) or not (8 <= block <= 1 << 16) or block % 8:
            raise CodecError(f"codec 'ternary': block must be a multiple of 8 in [8, 65536] (values per scale), "
                             f"got {block!r}; e.g. block=320 (a multiple of 5 wastes no byte)")
        if not isinstance(ef, bool):
            raise CodecError(f"codec 'ternary': error_feedback must be True or False, got {ef!r}")
        return params

    def wire_format(self, ctx: RoundContext, state: Any = None) -> TernaryWire:
        return TernaryWire(self.params["block"], self.residual(state))
