"""The codec interface.

A codec turns one tensor (a flat float32 vector of a node's contribution, with its name and shape
known through :class:`RoundContext`) into a :class:`Payload` and back. What the ring does with the
payload is the codec's declared :class:`Pattern` (GRACE's lesson: say plainly which communicator
works with which compressor):

``SUMMABLE``
    ``payload.values`` (float32, the same length on every node of the round) can be added hop by
    hop, so the ordinary reduce-scatter + all-gather runs on it, the values travelling as
    ``wire_dtype`` or encoded by the codec's :meth:`Codec.wire_format` (``lowbit``). Examples: ``none``, ``fp16``,
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

State changes only with a round that completes: the round runner hands a codec a
:class:`StateTxn` over the tensor's state, not the state itself. Whatever the codec changes (in
place, as codecs always did) goes into scratch copies made on first access; the runner commits
them once the round has completed on this node, and a round that fails leaves the state as it was
(error-feedback residuals are not lost with the failed call; shared-mode importance does not move
on one node only). Codecs that overwrite a whole array take :meth:`StateTxn.fresh` instead, which
skips the copy and reads the old values from :meth:`StateTxn.original` (``_common.accumulate`` does, for every error-feedback codec). No second copy of
the state is kept between rounds: only the arrays of the round in flight exist twice.

Randomness: ``ctx.seed`` is identical on every node for a given (cluster seed, job, round, tensor
name); ``ctx.local_seed`` additionally mixes in the node's rank. Codecs that must agree across
nodes (shared selections) draw only from ``ctx.seed`` with a counter-based generator.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import threading
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
    #: True: a call that names this codec gets it for a tensor under the daemons' dense_threshold
    #: too. Only for a codec that is dense itself (``fp16``: it selects and remembers nothing, so a
    #: small tensor loses nothing by it that it would not lose at any size); every other codec
    #: leaves small tensors to travel dense, as ``none``
    any_size: ClassVar[bool] = False

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

    def wire_format(self, ctx: RoundContext, state: Any) -> Any:
        """SUMMABLE: how the ring encodes ``payload.values`` at every hop instead of casting them to
        ``wire_dtype`` (a :class:`birdnet.ring.dense.WireFormat`), or None. Called after
        :meth:`compress`, with the same state (the format may write the round's error feedback)."""
        return None

    def decompress(self, payload: Payload, out: np.ndarray, ctx: RoundContext, state: Any) -> None:
        """SUMMABLE / MERGED: write the dense sum represented by ``payload`` into ``out``."""
        raise NotImplementedError

    def decompress_add(self, payload: Payload, out: np.ndarray, ctx: RoundContext) -> None:
        """GATHERED: add one node's decompressed contribution into ``out`` (float32, length n)."""
        raise NotImplementedError

    def decompress_sum(self, payloads: list[Payload], out: np.ndarray, ctx: RoundContext,
                       divide_by: float = 0.0) -> None:
        """GATHERED: ``out`` = the sum of every node's (validated) payload, ``payloads[r]`` being
        rank r's, divided by ``divide_by`` unless it is 0. This default is the definition: zero
        ``out``, ``decompress_add`` in rank order, one ``np.divide``; a codec may do the same in
        fewer passes if its result has the same bits (the round runner calls this)."""
        out.fill(0.0)
        for p in payloads:
            self.decompress_add(p, out, ctx)
        if divide_by:
            np.divide(out, out.dtype.type(divide_by), out=out)

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


#: scratch arrays kept for the next rounds' StateTxn (arrays a commit replaced): without them every
#: round's scratch arrays were new memory, and faulting 47 MB of fresh pages in cost more than the
#: copy (11.7M float32, topk: +35-60 ms a call on this machine)
SPARE_BYTES = 256 << 20
SPARE_ARRAYS = 64


class _Spares:
    """Arrays a commit replaced, reused as scratch (a round ago at least, so no send still reads them)."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.nbytes = 0
        self.lock = threading.Lock()

    def take(self, like: np.ndarray) -> np.ndarray:
        with self.lock:
            for i in range(len(self.arrays) - 1, -1, -1):
                a = self.arrays[i]
                if a.shape == like.shape and a.dtype == like.dtype:
                    del self.arrays[i]
                    self.nbytes -= a.nbytes
                    return a
        return np.empty_like(like)

    def give(self, a: np.ndarray) -> None:
        if a.nbytes > SPARE_BYTES or not a.flags.owndata:
            return
        with self.lock:
            self.arrays.append(a)
            self.nbytes += a.nbytes
            while self.nbytes > SPARE_BYTES or len(self.arrays) > SPARE_ARRAYS:
                self.nbytes -= self.arrays.pop(0).nbytes


_spares = _Spares()


class StateTxn(dict):
    """A round's view of one tensor's codec state (a dict of arrays and scalars): reads see the
    committed state; the first access to an array copies it into a scratch array that the codec may
    change in place; :meth:`commit` puts the round's arrays and values into the state. Without a
    commit (the round failed) the state is untouched and the scratch arrays are simply dropped (not
    reused: a send of the failed round may still read them). A dict subclass, so codecs that check
    ``isinstance(state, dict)`` work unchanged."""

    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__(state)
        self._state = state
        self._touched: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        v = dict.__getitem__(self, key)
        if key not in self._touched and isinstance(v, np.ndarray):
            copy = _spares.take(v)
            np.copyto(copy, v)
            v = copy
            dict.__setitem__(self, key, v)
            self._touched.add(key)
        return v

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __setitem__(self, key: str, value: Any) -> None:
        dict.__setitem__(self, key, value)
        self._touched.add(key)

    def original(self, key: str) -> Any:
        """``key`` as it was before this round (read only: it is the committed state)."""
        return self._state[key]

    def fresh(self, key: str) -> np.ndarray:
        """An uninitialised scratch array for ``key`` (same shape and dtype) that the caller fills
        whole (from :meth:`original`, say) instead of a copy it would overwrite anyway."""
        new = _spares.take(dict.__getitem__(self, key))
        dict.__setitem__(self, key, new)
        self._touched.add(key)
        return new

    def commit(self) -> None:
        for key in self._touched:
            old = self._state.get(key)
            new = finite_state(dict.__getitem__(self, key), old)
            self._state[key] = new
            if isinstance(old, np.ndarray) and old is not new:
                _spares.give(old)
        self._touched.clear()


def _all_finite(a: np.ndarray) -> bool:
    """True when ``a`` holds no NaN or Inf. One summing pass (NaN and Inf carry through a sum; it
    costs half of ``np.isfinite(a).all()``); a sum that overflowed is checked element by element."""
    if a.size == 0:
        return True
    acc = np.float64 if a.dtype == np.float64 else np.float32
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.add.reduce(a.reshape(-1), dtype=acc)):
            return True
    return bool(np.isfinite(a).all())


def finite_state(new: Any, old: Any) -> Any:
    """What a round commits for one state entry: ``new``, except where it is NaN or Inf, which keep
    the committed value ``old`` (0 for an entry the round created). Error feedback, momentum and
    compensation are sums over rounds: a non-finite value that entered them (a NaN in one call's
    gradient, or in another node's contribution through the result) would come out of every later
    call, under any nan_policy. So the elements a round made non-finite are left as they were; the
    round's own result still carries the NaN (nan_policy="propagate"), later calls do not.
    The same on every node for state derived from the round's result (shared-mode selections)."""
    if isinstance(new, np.ndarray):
        if new.dtype.kind != "f" or _all_finite(new):
            return new
        keep = old if isinstance(old, np.ndarray) and old.shape == new.shape and old.dtype == new.dtype else 0
        return np.where(np.isfinite(new), new, keep).astype(new.dtype, copy=False)
    if isinstance(new, float) and not math.isfinite(new):
        return old if isinstance(old, (int, float)) and math.isfinite(old) else 0.0
    return new


def peek(state: dict[str, Any], key: str) -> Any:
    """``state[key]`` to read only: in a round's StateTxn, without the copy a first access makes."""
    return dict.__getitem__(state, key) if isinstance(state, StateTxn) else state[key]


def overwrite(state: dict[str, Any], key: str) -> np.ndarray:
    """``state[key]`` for a caller that writes every element (a round's scratch without the copy)."""
    return state.fresh(key) if isinstance(state, StateTxn) else state[key]


def begin_round(state: Any) -> Any:
    """What a round's codec calls get instead of ``state`` (see :class:`StateTxn`)."""
    return StateTxn(state) if isinstance(state, dict) else state


def commit_round(txn: Any) -> None:
    if isinstance(txn, StateTxn):
        txn.commit()
