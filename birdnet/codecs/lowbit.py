"""``lowbit``: dense, block-quantised to 8, 4, 2 or 1 bits on the wire, summed hop by hop.

Every value travels, as a signed integer level of ``bits`` bits with one scale per ``block``
values (symmetric, round half to even: birdnet.kernels.lowbit has the format). SUMMABLE through
the dense ring's wire-format hook (birdnet.ring.dense.WireFormat): in the reduce-scatter each hop
decodes the incoming partial sum, adds its own values in float32 and encodes the sum again (as
``fp16`` rounds at every hop); each segment's owner encodes the finished sum once more and the
all-gather forwards those bytes, which every node, the owner too, decodes alike. So a node sends
2(N-1)/N of the vector at ``bits``/8 bytes a value plus 2 bytes a block: at 8 bits about half of
``fp16``'s bytes, at 4 bits a quarter.

``midrise=True`` puts the levels between the steps (birdnet.kernels.lowbit): no value rounds to
0, so every coordinate sends its sign each round; at 2 bits each value is one of four (+-0.5 and
+-1.5 steps) instead of three (-1, 0, 1 step, most values rounding to 0). Its squared error is
lower on near-Gaussian blocks and higher on heavy-tailed ones (RMS 0.71x and 1.8x of the
symmetric levels' on random data), but with error feedback on DiLoCo's pseudo-gradients it keeps
2 bits close to 4 (docs/slowlink.md).

``bits=1``: each value's sign times its block's mean |x| (the scaled sign of EF-SignSGD, the
least-squares magnitude for a sign; birdnet.kernels.lowbit), always with midrise levels. With
``block=64`` that is 1.25 bits a value with the scale, 1.06 at ``block=256``. Every hop
requantises the partial sum to signs again, so without error feedback the sum loses most of its
magnitude information; keep ``error_feedback`` on.

Each node encodes every element exactly once a round (its own segment, the segments it passes on,
the one it finishes), so with ``error_feedback`` the node keeps what its encodings lost,
``state["v"]`` (one float32 per element), and adds it to its next contribution: over rounds the
sum of the results plus the nodes' residuals equals the sum of the inputs (EF-SGD's invariant).

What the papers do: Streaming DiLoCo (arXiv 2501.18512) sends 4-bit pseudo-gradients and
INTELLECT-1 int8 ones, each node's payload gathered and summed in higher precision, with no error
feedback. Here the sum itself is requantised at every hop (the ring's bytes, not N-1 gathered
payloads) and the encoding error can be fed back.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from birdnet.codecs import _common as C
from birdnet.codecs.base import Pattern, RoundContext
from birdnet.errors import CodecError
from birdnet.kernels import lazy

K = lazy("lowbit")

BITS = (1, 2, 4, 8)


class LowbitWire:
    """The ring's :class:`~birdnet.ring.dense.WireFormat` for one round: ``bits``-bit levels in
    blocks of ``block`` values; the encoding error of every element goes into ``residual`` (the
    round's error-feedback array) when one is given."""

    def __init__(self, bits: int, block: int, residual: np.ndarray | None = None, midrise: bool = False) -> None:
        # one bit has no level at 0: its two levels always sit between the steps
        self.bits, self.block, self.residual, self.midrise = bits, block, residual, midrise or bits == 1
        self.align = block

    def nbytes(self, count: int) -> int:
        return K.nbytes(count, self.bits, self.block)

    def elements(self, nbytes: int) -> int:
        return max(self.block, nbytes * 8 // self.bits)

    def encode(self, src: np.ndarray, start: int, deq: np.ndarray | None = None) -> np.ndarray:
        return K.encode(src, self.bits, self.block, deq=deq, residual=self.residual, res_off=start,
                        midrise=self.midrise)

    def decode(self, buf: np.ndarray, out: np.ndarray, own: np.ndarray | None = None) -> None:
        K.decode(buf, self.bits, self.block, out, own, midrise=self.midrise)


class LowbitCodec(C.HopRequantised):
    """Block-quantised low-bit values. SUMMABLE (requantised at every hop); optional error feedback."""

    name = "lowbit"
    pattern = Pattern.SUMMABLE
    defaults = {"bits": 8, "block": 64, "error_feedback": True, "midrise": False}

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        bits, block, ef = params["bits"], params["block"], params["error_feedback"]
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
            raise CodecError(f"codec 'lowbit': bits must be 8, 4, 2 or 1, got {bits!r} (8 keeps fp16's quality at "
                             "half its bytes; 4 is a quarter; 1 sends signs with the block's mean |x|)")
        if isinstance(block, bool) or not isinstance(block, int) or not (8 <= block <= 1 << 16) or block % 8:
            raise CodecError(f"codec 'lowbit': block must be a multiple of 8 in [8, 65536] (values per scale), "
                             f"got {block!r}; e.g. block=64")
        if not isinstance(ef, bool):
            raise CodecError(f"codec 'lowbit': error_feedback must be True or False, got {ef!r}")
        if not isinstance(params["midrise"], bool):
            raise CodecError(f"codec 'lowbit': midrise must be True or False, got {params['midrise']!r} (True: "
                             "levels between the steps, no exact 0; at 2 bits four values instead of three; bits=1 "
                             "always has them)")
        return params

    def wire_format(self, ctx: RoundContext, state: Any = None) -> LowbitWire:
        return LowbitWire(self.params["bits"], self.params["block"], self.residual(state), self.params["midrise"])
