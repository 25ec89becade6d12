"""The codec interface.

A codec turns one tensor (a flat float32 vector of a node's contribution, with its name and shape
known through :class:`RoundContext`) into a :class:`Payload` and back. What the ring does with the
payload is the codec's declared :class:`Pattern` (GRACE's lesson: say plainly which communicator
works with which compressor):

``SUMMABLE``
    ``payload.values`` (float32, the same length on every node of the round) can be added hop by
    hop, so the ordinary reduce-scatter + all-gather runs on it. Examples: ``none``, ``fp16``,
    ``randomk`` (shared seed), ``birdplus`` in ``shared`` mode. After the ring, ``decompress`` turns
    the summed payload into the dense sum. Any selection that must agree between nodes puts a
    ``"digest"`` into ``payload.header``; the ring compares digests and fails the round on a
    difference instead of summing misaligned values.
``GATHERED``
    Every node's payload travels round the ring (all-gather). Each node calls ``decompress_add``
    for the payloads of rank 0, 1, ..., world-1 **in that order**, so every node ends with
    bit-identical sums. Examples: ``topk``, ``dgc``, ``qsgd``, ``efsign``, ``bird``/``birdplus`` in
    ``local`` mode.
``MERGED``
    Marsit's bitwise merge (birdnet.ring.merge): the codec supplies sign bits and a scale; the ring
    merges bits hop by hop and forwards the merged bits unchanged in the all-gather.

Codecs are stateless objects configured by parameters; per-tensor memory (error feedback,
momentum, compensation) lives in a *state* object that the daemon keeps per (job, tensor name) and
hands to every call. ``state_nbytes`` reports it so the daemon can cap it.

Randomness: ``ctx.seed`` is identical on every node for a given (cluster seed, job, round, tensor
name); ``ctx.local_seed`` additionally mixes in the node's rank. Codecs that must agree across
nodes (shared selections) draw only from ``ctx.seed`` with a counter-based generator.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar

import numpy as np

from birdnet.errors import CodecError


class Pattern(str, enum.Enum):
    SUMMABLE = "summable"
    GATHERED = "gathered"
    MERGED = "merged"


@dataclasses.dataclass(frozen=True)
class RoundContext:
    """What a codec may know about the round it is compressing for."""

    job: str
    name: str
    shape: tuple[int, ...]
    round_id: int
    rank: int  #: this node's rank in the ring
    world: int  #: number of nodes in the ring
    seed: int  #: 63-bit seed shared by all nodes for (cluster seed, job, round, tensor name)
    local_count: int = 1  #: training processes this node's contribution stands for
    total_count: int = 1  #: training processes of the whole job (all nodes)
    #: rounds this (job, tensor) has had since its state was last reset; identical on all nodes
    #: (every round involves every node, and ``reset_state`` is itself a collective round)
    tensor_round: int = 0
    #: every node's ``local_count``, in rank order (for weighted merges)
    counts: tuple[int, ...] = ()

    @property
    def local_seed(self) -> int:
        """A seed that differs between nodes (for draws that need not agree)."""
        return (self.seed * 0x9E3779B97F4A7C15 + self.rank + 1) & ((1 << 63) - 1)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclasses.dataclass
class Payload:
    """A compressed tensor: a small msgpack-able header and raw buffers.

    ``values`` is the float32 vector a SUMMABLE codec's payload is summed on; other codecs put
    everything in ``buffers``. Buffers are sent without copying, so a codec must not modify an
    array after returning it in a payload.
    """

    header: dict[str, Any]
    buffers: list[np.ndarray] = dataclasses.field(default_factory=list)
    values: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        n = sum(int(b.nbytes) for b in self.buffers)
        return n + (int(self.values.nbytes) if self.values is not None else 0)


class Codec:
    """Base class; subclasses live one per file in ``birdnet/codecs`` and register by name."""

    #: registry name, used as ``codec="..."`` by clients and in the daemon's settings
    name: ClassVar[str] = ""
    pattern: ClassVar[Pattern] = Pattern.SUMMABLE
    #: parameter names and defaults; ``__init__`` rejects anything else
    defaults: ClassVar[dict[str, Any]] = {}
    #: the float dtype of ``values`` on the wire for SUMMABLE codecs ("float32" or "float16")
    wire_dtype: ClassVar[str] = "float32"

    def __init__(self, **params: Any) -> None:
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise CodecError(
                f"codec {self.name!r} has no parameter {', '.join(unknown)}; "
                f"its parameters are: {', '.join(sorted(self.defaults)) or '(none)'}")
        merged = {**self.defaults, **params}
        self.params: dict[str, Any] = self.validate(merged)

    # -- configuration -------------------------------------------------------------------------
    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        """Check and normalise parameters; raise :class:`CodecError` naming the bad one."""
        return params

    def describe(self) -> dict[str, Any]:
        """Canonical description (name + parameters) compared between nodes for each round."""
        return {"codec": self.name, **{k: self.params[k] for k in sorted(self.params)}}

    # -- state ---------------------------------------------------------------------------------
    def new_state(self, n: int) -> Any:
        """Per-(job, tensor) state for a tensor of ``n`` elements, or None for stateless codecs."""
        return None

    def state_nbytes(self, state: Any) -> int:
        if state is None:
            return 0
        if isinstance(state, np.ndarray):
            return int(state.nbytes)
        if isinstance(state, dict):
            return sum(int(v.nbytes) for v in state.values() if isinstance(v, np.ndarray))
        return 0

    # -- the work ------------------------------------------------------------------------------
    def compress(self, x: np.ndarray, ctx: RoundContext, state: Any) -> Payload:
        """Compress ``x`` (1-D, contiguous float32, this node's contribution; never modified)."""
        raise NotImplementedError

    def decompress(self, payload: Payload, out: np.ndarray, ctx: RoundContext, state: Any) -> None:
        """SUMMABLE / MERGED: write the dense sum represented by ``payload`` into ``out``."""
        raise NotImplementedError

    def decompress_add(self, payload: Payload, out: np.ndarray, ctx: RoundContext) -> None:
        """GATHERED: add one node's decompressed contribution into ``out`` (float32, length n)."""
        raise NotImplementedError

    def after_round(self, state: Any, result_sum: np.ndarray, ctx: RoundContext) -> None:
        """Called with the dense sum once the round is complete (e.g. global compensation)."""

    def payload_from_wire(self, header: dict[str, Any], buffers: list[memoryview]) -> Payload:
        """Rebuild a GATHERED payload received from a peer. The default takes the buffer dtypes
        from ``header["dtypes"]`` (written by :func:`pack_buffers`); codecs validate sizes here
        because the bytes come from the network."""
        return unpack_buffers(self.name, header, buffers)


def pack_buffers(payload: Payload) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Header + buffers for the wire, recording each buffer's dtype so the receiver can view it."""
    header = dict(payload.header)
    header["dtypes"] = [b.dtype.str for b in payload.buffers]
    return header, [np.ascontiguousarray(b) for b in payload.buffers]


_ALLOWED_DTYPES = {"<f4", "<f2", "<f8", "|u1", "<u2", "<u4", "<i4", "<i8", "<u8", "|i1", "|b1"}


def unpack_buffers(codec_name: str, header: dict[str, Any], buffers: list[memoryview]) -> Payload:
    dtypes = header.get("dtypes")
    if not isinstance(dtypes, list) or len(dtypes) != len(buffers):
        raise CodecError(f"{codec_name}: payload from the network has {len(buffers)} buffers but "
                         f"its header lists dtypes {dtypes!r}")
    arrays = []
    for dt, buf in zip(dtypes, buffers):
        if dt not in _ALLOWED_DTYPES:
            raise CodecError(f"{codec_name}: payload buffer dtype {dt!r} is not allowed")
        d = np.dtype(dt)
        if len(buf) % d.itemsize:
            raise CodecError(f"{codec_name}: payload buffer of {len(buf)} bytes is not a whole number "
                             f"of {dt} items")
        arrays.append(np.frombuffer(buf, dtype=d))
    return Payload(header={k: v for k, v in header.items() if k != "dtypes"}, buffers=arrays)
