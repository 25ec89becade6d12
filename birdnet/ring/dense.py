"""Chunked, pipelined ring reduce-scatter + all-gather (the dense all-reduce).

Schedule (Patarasuk & Yuan's bandwidth-optimal ring, as in Gloo and NCCL): the vector is cut into
``world`` segments; in reduce-scatter step s (0..world-2) rank r sends segment (r-s) mod world to
rank r+1 and adds the segment (r-s-1) mod world it receives from rank r-1 into its own. After
world-1 steps rank r holds the finished sum of segment (r+1) mod world; the all-gather then
forwards finished segments round the ring. Each segment is cut into chunks (:func:`chunk_elements`:
``chunk_bytes``, or larger ones up to ``max_chunk_bytes`` for a large tensor) and a chunk is passed
on as soon as it is reduced, so a large tensor keeps every link busy.

Why the result is bit-identical on every node: each element is summed exactly once, on one node, in
one fixed order (along the ring, starting at the segment's owner), and then copied everywhere. IEEE
addition is commutative, and nothing here reassociates. A wire dtype narrower than the data (fp16)
is applied to the finished segment on its owner too, so the owner does not keep extra precision.

Every message carries ``tag`` (the round's agreed fields, e.g. a selection digest) and an ``err``
flag: a node that sees a tag different from its own keeps the schedule going (so nobody hangs) but
marks the round failed, and the flag reaches every node before the schedule ends.
"""
from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

from birdnet.errors import ProtocolError, RoundMismatchError
from birdnet.ring.transport import OUT_OF_STEP_HINT, Transport


def segment_bounds(n: int, world: int, align: int = 1) -> list[int]:
    """Boundaries of ``world`` contiguous segments covering ``n`` elements, as equal as possible,
    each boundary a multiple of ``align`` (the last segment takes the rest)."""
    units = -(-n // align) if align > 1 else n
    base, extra = divmod(units, world)
    bounds = [0]
    for i in range(world):
        bounds.append(min(n, bounds[-1] + (base + (1 if i < extra else 0)) * align))
    bounds[-1] = n
    return bounds


#: a large tensor's segment travels in about this many chunks (chunk_elements). Each message costs
#: the ring thread about the same whatever its size (its wait, Python, system calls: 4 netns nodes,
#: 11.7M float32, 1 Gbit/s, the ring threads' CPU 150-177 ms per round with 1 MiB chunks, 12 per
#: segment, 97-114 ms with 4), while too few chunks make a call slower: 8 nodes at 100 Mbit/s, 11.7M,
#: per call 7.80 s with 2 chunks per segment (4 MiB), 7.44-7.51 s with 4, 7.20-7.36 s with 6 (1 MiB;
#: CHANGELOG.md). With 6, 8 nodes keep 1 MiB chunks at 11.7M, 4 nodes send half the messages.
CHUNKS_PER_SEGMENT = 6


def chunk_elements(segment: int, itemsize: int, chunk_bytes: int, max_chunk_bytes: int = 0) -> int:
    """Elements per chunk of a ring segment of ``segment`` elements of ``itemsize`` bytes: a
    CHUNKS_PER_SEGMENT-th of the segment, at least ``chunk_bytes`` and at most ``max_chunk_bytes``
    (``max_chunk_bytes`` at or below ``chunk_bytes``: ``chunk_bytes`` always). Every node computes it
    from the same agreed size, world and cluster-wide settings, so all cut alike."""
    lo = max(1, chunk_bytes // itemsize)
    hi = max(lo, max_chunk_bytes // itemsize)
    return min(hi, max(lo, -(-segment // CHUNKS_PER_SEGMENT)))


def chunk_bounds(start: int, stop: int, chunk: int) -> list[tuple[int, int]]:
    """Chunks of at most ``chunk`` elements; always at least one (possibly empty) chunk, so every
    step sends at least one message and the schedule stays the same for any n."""
    if stop <= start:
        return [(start, start)]
    return [(a, min(stop, a + chunk)) for a in range(start, stop, chunk)]


class WireFormat(Protocol):
    """How a codec's chunks travel instead of a plain ``wire_dtype`` (the ``lowbit`` codec's
    block-quantised levels): every hop decodes the incoming partial sum, adds its own values in
    float32 and encodes again, as the float16 wire rounds at every hop; the all-gather forwards the
    finished chunks' bytes, which every node decodes alike.

    ``align``: segment and chunk boundaries are multiples of it (an encoding's blocks never
    straddle two messages). ``encode(src, start, deq)`` returns the bytes for ``src`` (float32,
    elements ``start..`` of the tensor: a codec that keeps its own encoding error, error feedback,
    stores it there) and, with ``deq``, writes the values they stand for into it.
    ``decode(buf, out, own)``: ``out`` = the values of ``buf`` (+ ``own``, one float32 addition).
    """

    align: int

    def nbytes(self, count: int) -> int: ...

    def elements(self, nbytes: int) -> int: ...

    def encode(self, src: np.ndarray, start: int, deq: np.ndarray | None = None) -> np.ndarray: ...

    def decode(self, buf: np.ndarray, out: np.ndarray, own: np.ndarray | None = None) -> None: ...


class _Checker:
    """Compares each received header with what this node expects, and remembers the first
    disagreement so the round fails everywhere instead of producing garbage."""

    def __init__(self, tag: dict[str, Any], rank: int, world: int) -> None:
        self.tag, self.rank, self.world = tag, rank, world
        self.error: str | None = None

    def check(self, header: dict[str, Any], phase: str, step: int, chunk: int) -> None:
        if header.get("p") != phase or header.get("s") != step or header.get("c") != chunk:
            if header.get("tag") != self.tag:
                # nodes that disagree on a round's size may also run different schedules for it
                # (small vectors go gathered, birdnet.ring.small): name the difference
                self._compare(header.get("tag"))
                raise RoundMismatchError(self.error or "nodes disagree on the round")
            raise ProtocolError(
                f"ring out of step: expected {phase} step {step} chunk {chunk}, got "
                f"{header.get('p')!r} step {header.get('s')!r} chunk {header.get('c')!r} from rank "
                f"{(self.rank - 1) % self.world}{OUT_OF_STEP_HINT}")
        err = header.get("err")
        if err and self.error is None:
            self.error = str(err)
        if self.error is None and header.get("tag") != self.tag:  # _compare's test, without its call
            self._compare(header.get("tag"))

    def _compare(self, their: Any) -> None:
        if self.error is None and their != self.tag:
            left = (self.rank - 1) % self.world
            diffs = [f"{k}: rank {left} has {(their or {}).get(k)!r}, rank {self.rank} has {self.tag.get(k)!r}"
                     for k in sorted(set(self.tag) | set(their or {}))
                     if (their or {}).get(k) != self.tag.get(k)]
            what = f" for tensor {self.tag['name']!r}" if "name" in self.tag else ""
            self.error = f"nodes disagree on the round{what}: " + "; ".join(diffs)

    def header(self, phase: str, step: int, chunk: int, n: int | None = None) -> dict[str, Any]:
        """A data message's header; ``n``: the processes summed so far (a lane round)."""
        h: dict[str, Any] = {"t": "data", "p": phase, "s": step, "c": chunk, "tag": self.tag}
        if self.error:
            h["err"] = self.error
        if n is not None:
            h["n"] = n
        return h


def ring_allreduce(transport: Transport, x: np.ndarray, *, timeout: float, chunk_bytes: int = 1 << 20,
                   max_chunk_bytes: int = 0, wire_dtype: Any = None, inplace: bool = False, tag: dict[str, Any] | None = None,
                   divide_by: int | None = None, count: int | None = None, mean: bool = False,
                   learned: dict[str, Any] | None = None, wire: WireFormat | None = None) -> np.ndarray:
    """Sum ``x`` (1-D) over all ranks of the ring; the same bits on every rank.

    ``timeout`` is the longest wait for any one message (a sign of life of the left neighbour).
    ``wire_dtype`` (e.g. float16) is the dtype chunks travel in; sums are kept in ``x.dtype``.
    ``wire`` (float32 ``x`` only): chunks travel encoded by it instead (:class:`WireFormat`); the
    result is what the finished chunks' encodings stand for, on every node including their owner.
    Chunks are ``chunk_bytes``, or larger up to ``max_chunk_bytes`` for a large ``x``
    (:func:`chunk_elements`); every node must pass the same two.
    With ``inplace`` the result overwrites ``x``. ``divide_by`` (for a mean) divides each finished
    segment once, on the node that finished it, before the all-gather copies it everywhere: the
    same bits on every node, and each node divides 1/world of the vector instead of all of it.
    Raises :class:`RoundMismatchError` when nodes disagree on ``tag``,
    :class:`~birdnet.errors.PeerLostError` when a neighbour stays silent.

    Rounds that start without an agreement (the daemon's dense lane) do not know how many processes
    contribute: with ``count`` (this node's processes) every reduce-scatter message carries the
    processes summed into it so far, so each segment's owner learns the total before it finishes
    the segment (``mean`` then divides by it), and the all-gather passes the total on; it is stored
    in ``learned["count"]``.

    ``x`` is first written when a segment is finished here, which needs a message that has passed
    through every other node: the partial sums of the reduce-scatter go into the received buffer
    (or a new one), not into ``x``. So until every node has joined the round, it can be given up and
    run again with ``x`` as it was. It also saves a copy: a received ZeroMQ frame, summed in place,
    goes on as it is (RoundTransport.send).
    """
    if x.ndim != 1:
        raise ValueError("ring_allreduce takes a 1-D array")
    out = x if inplace else x.copy()
    if wire is not None:
        if out.dtype != np.float32 or wire_dtype is not None or count is not None or divide_by is not None:
            raise ValueError("ring_allreduce with a wire format takes float32 and none of wire_dtype, count, "
                             "divide_by")
        return _encoded_allreduce(transport, out, wire, timeout=timeout, chunk_bytes=chunk_bytes,
                                  max_chunk_bytes=max_chunk_bytes, tag=tag)
    r, world = transport.rank, transport.world
    if count is not None and world == 1:
        divide_by = count if mean else divide_by
    div = out.dtype.type(divide_by) if divide_by is not None else None
    if learned is not None and count is not None:
        learned["count"] = count
    if world == 1:
        if wire_dtype is not None and np.dtype(wire_dtype) != out.dtype:
            out[:] = out.astype(wire_dtype)
        if div is not None:
            np.divide(out, div, out=out)
        return out
    wdt = np.dtype(wire_dtype) if wire_dtype is not None else out.dtype
    narrow = wdt != out.dtype
    bounds = segment_bounds(out.size, world)
    per_chunk = chunk_elements(bounds[1] - bounds[0], wdt.itemsize, chunk_bytes, max_chunk_bytes)
    chunks = [chunk_bounds(bounds[i], bounds[i + 1], per_chunk) for i in range(world)]
    checker = _Checker(dict(tag or {}), r, world)

    def encode(a: int, b: int) -> np.ndarray:
        return out[a:b].astype(wdt) if narrow else out[a:b]

    my_tag = checker.tag

    def receive(phase: str, step: int, ci: int, a: int, b: int) -> tuple[int | None, np.ndarray]:
        """The next chunk, checked, and (with ``count``) the processes summed into it so far."""
        header, bufs = transport.recv(time.monotonic() + timeout)
        # the checker is asked only when the header is not the expected one in step with the same
        # tag and no error (a call per message, a tenth of a large round's calls on the ring thread)
        if (header.get("p") != phase or header.get("s") != step or header.get("c") != ci
                or "err" in header or header.get("tag") != my_tag):
            checker.check(header, phase, step, ci)
        if len(bufs) != 1 or bufs[0].nbytes != (b - a) * wdt.itemsize:
            if checker.error:  # e.g. another shape: say so, not just that the sizes differ
                raise RoundMismatchError(checker.error)
            raise ProtocolError(f"ring {phase} step {step} chunk {ci}: expected {(b - a) * wdt.itemsize} "
                                f"bytes from rank {(r - 1) % world}, got {[v.nbytes for v in bufs]}")
        n = None
        if count is not None:
            n = header.get("n")
            if type(n) is not int or not 0 <= n < 1 << 30:  # type(): not a bool either
                raise ProtocolError(f"ring {phase} step {step}: bad process count {n!r} from rank {(r - 1) % world}")
        return n, np.frombuffer(bufs[0], dtype=wdt)

    header = checker.header

    total = None
    # Reduce-scatter. Step 0 sends this rank's own segment right away (ZeroMQ queues it).
    for ci, (a, b) in enumerate(chunks[r]):
        transport.send(header("rs", 0, ci, count), [encode(a, b)])
    for s in range(world - 1):
        seg = (r - s - 1) % world
        for ci, (a, b) in enumerate(chunks[seg]):
            n, incoming = receive("rs", s, ci, a, b)
            if n is not None:
                n += count
            if s < world - 2:
                # the partial sum, out + incoming (the same bits either way round: IEEE addition
                # commutes), goes into the received buffer when it is writable, else a new one
                if narrow:
                    acc = np.add(out[a:b], incoming.astype(out.dtype)).astype(wdt)
                elif incoming.flags.writeable:
                    acc = np.add(incoming, out[a:b], out=incoming)
                else:
                    acc = np.add(incoming, out[a:b])
                transport.send(header("rs", s + 1, ci, n), [acc])
                continue
            # segment finished here: round to the wire dtype so all ranks agree, then gather
            if narrow:
                out[a:b] += incoming.astype(out.dtype)
            else:
                out[a:b] += incoming
            if n is not None:
                total = n
                if mean:
                    div = out.dtype.type(n)
            if div is not None:
                np.divide(out[a:b], div, out=out[a:b])
            if narrow:
                out[a:b] = out[a:b].astype(wdt)
            transport.send(header("ag", 0, ci, total), [encode(a, b)])
    # All-gather: receive finished segments and pass them on.
    for s in range(world - 1):
        seg = (r - s) % world
        for ci, (a, b) in enumerate(chunks[seg]):
            n, incoming = receive("ag", s, ci, a, b)
            if n != total:
                # every segment's owner summed the same nodes' counts; a difference is a broken peer
                raise ProtocolError(f"ring ag step {s}: rank {(r - 1) % world} counted {n!r} "
                                    f"processes, this node {total}")
            out[a:b] = incoming
            if s < world - 2:
                transport.send(header("ag", s + 1, ci, total), [incoming])
    if learned is not None and total is not None:
        learned["count"] = total
    if checker.error:
        raise RoundMismatchError(checker.error)
    return out


def _encoded_allreduce(transport: Transport, out: np.ndarray, wire: WireFormat, *, timeout: float,
                       chunk_bytes: int, max_chunk_bytes: int, tag: dict[str, Any] | None) -> np.ndarray:
    """ring_allreduce's schedule with chunks encoded by ``wire`` (in place in ``out``). Each element
    is encoded exactly once on every node: in the reduce-scatter step that sends its segment on,
    or, on the segment's owner, once finished (so a codec's error feedback sees every element)."""
    r, world = transport.rank, transport.world
    if world == 1:
        wire.encode(out, 0, out)
        return out
    align = max(1, int(wire.align))
    bounds = segment_bounds(out.size, world, align)
    per_chunk = chunk_elements(max(bounds[i + 1] - bounds[i] for i in range(world)), 1,
                               wire.elements(chunk_bytes), wire.elements(max_chunk_bytes))
    per_chunk = -(-per_chunk // align) * align
    chunks = [chunk_bounds(bounds[i], bounds[i + 1], per_chunk) for i in range(world)]
    checker = _Checker(dict(tag or {}), r, world)
    scratch = np.empty(per_chunk, np.float32)

    def receive(phase: str, step: int, ci: int, a: int, b: int) -> np.ndarray:
        header, bufs = transport.recv(time.monotonic() + timeout)
        checker.check(header, phase, step, ci)
        want = wire.nbytes(b - a)
        if len(bufs) != 1 or bufs[0].nbytes != want:
            if checker.error:
                raise RoundMismatchError(checker.error)
            raise ProtocolError(f"ring {phase} step {step} chunk {ci}: expected {want} bytes from rank "
                                f"{(r - 1) % world}, got {[v.nbytes for v in bufs]}")
        return np.frombuffer(bufs[0], dtype=np.uint8)

    for ci, (a, b) in enumerate(chunks[r]):
        transport.send(checker.header("rs", 0, ci), [wire.encode(out[a:b], a)])
    for s in range(world - 1):
        seg = (r - s - 1) % world
        for ci, (a, b) in enumerate(chunks[seg]):
            incoming = receive("rs", s, ci, a, b)
            if s < world - 2:
                acc = scratch[:b - a]
                wire.decode(incoming, acc, out[a:b])
                transport.send(checker.header("rs", s + 1, ci), [wire.encode(acc, a)])
                continue
            # segment finished here: its owner keeps what the encoding stands for, as every node will
            wire.decode(incoming, out[a:b], out[a:b])
            transport.send(checker.header("ag", 0, ci), [wire.encode(out[a:b], a, out[a:b])])
    for s in range(world - 1):
        seg = (r - s) % world
        for ci, (a, b) in enumerate(chunks[seg]):
            incoming = receive("ag", s, ci, a, b)
            wire.decode(incoming, out[a:b])
            if s < world - 2:
                transport.send(checker.header("ag", s + 1, ci), [incoming])
    if checker.error:
        raise RoundMismatchError(checker.error)
    return out
