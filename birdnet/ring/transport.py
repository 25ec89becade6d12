"""The transport interface the ring algorithms talk to, and an in-memory implementation.

Gloo's lesson: the algorithm (who sends what to whom) never knows how bytes move. A ring algorithm
only ever sends to its right neighbour and receives from its left neighbour, in FIFO order, so
this is all it needs:

* ``send(header, buffers)``: queue a message for the right neighbour. Buffers go out without
  copying, so the caller must not modify them afterwards (within the round).
* ``recv(deadline)``: the next message from the left neighbour, as ``(header, [memoryview, ...])``;
  raises :class:`~birdnet.errors.PeerLostError` when ``time.monotonic()`` passes ``deadline``.

The daemon's ZeroMQ transport (birdnet.daemon.transport.RoundTransport) adds round ids, drops stale messages and
counts bytes; :class:`MemoryRing` does the same between threads for tests.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from birdnet.errors import PeerLostError

#: What an out-of-step message means in practice, for the errors that report one. Messages between
#: two daemons travel in order over one ZeroMQ connection, which loses them only when its TCP
#: connection breaks and reconnects (a NAT box, a flapping link, ``ss -K``) while both stay up.
OUT_OF_STEP_HINT = ("; a message from the left neighbour was lost, most likely because the TCP connection "
                    "between the two daemons broke and reconnected: this call failed, the next one runs afresh")


class Transport(Protocol):
    rank: int
    world: int

    def send(self, header: dict[str, Any], buffers: Sequence[Any] = ()) -> None: ...

    def recv(self, deadline: float) -> tuple[dict[str, Any], list[memoryview]]: ...


class MemoryTransport:
    """One node's end of a :class:`MemoryRing`. Counts bytes like the real transport does."""

    def __init__(self, ring: "MemoryRing", rank: int) -> None:
        self.ring, self.rank, self.world = ring, rank, ring.world
        self.bytes_sent = 0
        self.bytes_received = 0
        self.messages_sent: list[tuple[dict[str, Any], list[int]]] = []  # (header, buffer sizes)

    def send(self, header: dict[str, Any], buffers: Sequence[Any] = ()) -> None:
        # Copy, as the network would: the receiver must never alias the sender's memory.
        bufs = [bytes(memoryview(np.ascontiguousarray(b) if isinstance(b, np.ndarray) else b).cast("B"))
                for b in buffers]
        n = sum(len(b) for b in bufs)
        self.bytes_sent += n
        self.messages_sent.append((dict(header), [len(b) for b in bufs]))
        self.ring.queues[(self.rank + 1) % self.world].put((dict(header), bufs))

    def recv(self, deadline: float) -> tuple[dict[str, Any], list[memoryview]]:
        timeout = max(0.0, deadline - time.monotonic())
        try:
            header, bufs = self.ring.queues[self.rank].get(timeout=timeout)
        except queue.Empty:
            left = (self.rank - 1) % self.world
            raise PeerLostError(f"no message from rank {left} within the deadline") from None
        self.bytes_received += sum(len(b) for b in bufs)
        return header, [memoryview(b) for b in bufs]


class MemoryRing:
    """``world`` in-memory transports joined in a ring; :meth:`run` runs one function per rank
    on its own thread (as real nodes would run concurrently) and returns their results."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.queues: list[queue.Queue] = [queue.Queue() for _ in range(world)]
        self.transports = [MemoryTransport(self, r) for r in range(world)]

    def run(self, fn, *, timeout: float = 60.0) -> list[Any]:
        """Call ``fn(transport)`` for every rank concurrently; re-raise the first error."""
        results: list[Any] = [None] * self.world
        errors: list[BaseException | None] = [None] * self.world

        def target(r: int) -> None:
            try:
                results[r] = fn(self.transports[r])
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller below
                errors[r] = exc

        threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(self.world)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"ring of {self.world} did not finish within {timeout} s")
        for e in errors:
            if e is not None:
                raise e
        return results
