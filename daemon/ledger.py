"""What a node remembers of rounds by key beyond those waiting on it: rounds aborted anywhere in the
ring (tombstones), the jobs whose processes left (here or on another node) and the highest call
number each job's processes submitted here; and the aborts this node could not send yet
(:class:`AbortOutbox`). No sockets (the outbox sends through the membership it is given): the ring worker asks it, on its one thread,
whether a round can still run here or must fail at once, so no node waits round_timeout for an
agreement that cannot come.

The service thread writes ``departed`` (a local process left) with single dict operations, atomic
under the GIL.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Container, Mapping
from typing import NamedTuple

from birdnet.errors import PeerLostError
from birdnet.messages import Abort
from birdnet.wire import split_key

#: rounds remembered as aborted at most (the oldest go first)
MAX_TOMBSTONES = 4096
#: aborts kept for a right neighbour that cannot take them yet (AbortOutbox)
MAX_UNSENT_ABORTS = 256
#: seconds between two repeats of the same abort (RingWorker._repeat_aborts)
REPEAT_ABORT_INTERVAL = 1.0
#: jobs remembered as having lost a process on another node at most
MAX_DEPARTED_ELSEWHERE = 1024


class Tombstone(NamedTuple):
    """A round aborted somewhere in the ring (RoundLedger.aborted)."""

    error_class: str
    message: str
    at: float  #: monotonic time it was remembered: forgotten after round_wait_timeout


class RoundLedger:
    """Tombstones, departures and call numbers of this node's rounds (see the module docstring).
    ``forget_after``: seconds a tombstone is kept (round_wait_timeout)."""

    def __init__(self, forget_after: float) -> None:
        self.forget_after = forget_after
        #: job -> (why, first call affected): its rounds cannot complete on this node (a local
        #: process left); written by the service thread
        self.departed: dict[str, tuple[str, int]] = {}
        #: job -> (why, first call affected) for a process of the job lost on *another* node (a
        #: ``ProcessLostError`` abort): the job's later calls here fail at once instead of waiting
        #: for a leader that will never start them. Cleared like ``departed`` (a new process joins)
        self.departed_elsewhere: dict[str, tuple[str, int]] = {}
        #: job -> the highest call number this node's processes submitted (the cluster's numbering):
        #: a start for a lower number that is not waiting here names a call that already ended here
        self.submitted: dict[str, int] = {}
        #: rounds aborted anywhere in the ring, also those this node has not reached yet (a node that
        #: alone saw a peer lost, a neighbour restarted, a failed data phase). A round with such a
        #: key fails at once when it is submitted or started here.
        self.aborted: dict[str, Tombstone] = {}

    def note_submitted(self, job: str, seq: int) -> None:
        if seq > self.submitted.get(job, -1):
            self.submitted[job] = seq

    def tombstone(self, key: str) -> Tombstone | None:
        """How round ``key`` was aborted, if it was (and not too long ago)."""
        t = self.aborted.get(key)
        if t is not None and time.monotonic() - t.at > self.forget_after:
            del self.aborted[key]
            return None
        return t

    def remember_failed(self, key: str, cls: str, message: str) -> None:
        self.aborted.pop(key, None)
        self.aborted[key] = Tombstone(cls, message, time.monotonic())
        while len(self.aborted) > MAX_TOMBSTONES:
            self.aborted.pop(next(iter(self.aborted)))

    def departed_before(self, key: str, offsets: Mapping[str, int]) -> str | None:
        """Why this node's processes of round ``key``'s job can never submit it (they left before
        that call), else None. Call numbers are the cluster's: the membership's ``offsets`` (an
        elastic joiner's) say how far they are from this node's."""
        parsed = split_key(key)
        if parsed is None:
            return None
        gone = self.departed.get(parsed[0])
        if gone is not None and parsed[1] - offsets.get(parsed[0], 0) >= gone[1]:
            return gone[0]
        gone = self.departed_elsewhere.get(parsed[0])
        if gone is not None and parsed[1] >= gone[1]:
            return gone[0]
        return None

    def ended_here(self, key: str, waiting: Container[str], restarted_jobs: Container[str]) -> bool:
        """Whether round ``key`` already ended on this node (completed or failed): it is not
        ``waiting`` here and this node's processes submitted a later call of its job. A start for it
        means the numbering drifted apart (calls that failed on some nodes only, while a node was
        stopped or cut off): answering at once lets every node fail it and catch up, instead of
        waiting round_timeout for processes that have gone on."""
        parsed = split_key(key)
        # not while the job's processes here have left (departed): its next run, numbering
        # from 0 again, may be about to join, and this start may be its first call
        return (parsed is not None and key not in waiting and parsed[0] not in self.departed
                and parsed[0] not in restarted_jobs and self.submitted.get(parsed[0], -1) > parsed[1])

    def doomed(self, key: str, rank: int, waiting: Container[str], restarted_jobs: Container[str],
               offsets: Mapping[str, int]) -> tuple[str, str] | None:
        """Why node ``rank`` can never give its part of round ``key`` (not ``waiting`` there), as
        (message, error class) for its description in the leader's start, else None: it failed the
        round already (alone, before any verdict), its processes of the job left before it, or they
        went past it (:meth:`ended_here`)."""
        t = self.tombstone(key)
        if t is not None:
            return t.message, t.error_class
        gone = self.departed_before(key, offsets)
        if gone is not None:
            return f"node rank {rank}: {gone}", "ProcessLostError"
        if self.ended_here(key, waiting, restarted_jobs):
            return (f"call {key} already ended on node rank {rank} (it failed there while the ring was broken; "
                    f"its processes went on to call {self.submitted[split_key(key)[0]]})"), "PeerLostError"
        return None

    def note_departed_elsewhere(self, job: str, seq: int, reason: str, slack: int) -> bool:
        """A process of ``job`` left another node at call ``seq``. Applied (True) only while this
        node's processes of the job are at that call or past it (``slack`` calls of a batch
        before), so a stale abort of a run that ended cannot doom a new run of the same job (which
        numbers its calls from 0 again)."""
        if job not in self.submitted or self.submitted[job] < seq - 1 - slack:
            return False
        cur = self.departed_elsewhere.get(job)
        if cur is None or cur[1] > seq:
            if len(self.departed_elsewhere) >= MAX_DEPARTED_ELSEWHERE:
                self.departed_elsewhere.pop(next(iter(self.departed_elsewhere)))
            self.departed_elsewhere[job] = (reason, seq)
        return True

    def forget_job(self, job: str) -> None:
        """The job's processes on this node all left and a new one came: its call numbering starts
        again, so what is remembered of its rounds by number goes."""
        self.submitted.pop(job, None)
        self.departed_elsewhere.pop(job, None)
        prefix = job + "/"
        for k in [k for k in self.aborted if k.startswith(prefix)]:
            del self.aborted[k]


class AbortOutbox:
    """The aborts this node sends round the ring, through ``send`` (the membership's). An abort the
    right neighbour cannot take yet (its socket reconnecting: its queue was dropped while it did not
    answer, e.g. a stopped node) is kept and sent once it connects, for ``keep_for`` seconds
    (round_wait_timeout), or a node still waiting for the round (the leader for its start) would
    wait round_timeout."""

    def __init__(self, send: Callable[[Abort], None], keep_for: float) -> None:
        self._send, self.keep_for = send, keep_for
        self.unsent: list[tuple[Abort, float]] = []  #: with when each was first sent
        self._repeated: dict[str, float] = {}  #: round key -> when :meth:`due_again` last said yes

    def send(self, abort: Abort, keep: bool) -> None:
        """Send ``abort``; ``keep`` it for later when the right neighbour cannot take it now."""
        try:
            self._send(abort)
        except PeerLostError:
            if keep:
                if len(self.unsent) >= MAX_UNSENT_ABORTS:
                    self.unsent.pop(0)
                self.unsent.append((abort, time.monotonic()))
        except Exception:  # noqa: BLE001 - a send that cannot happen must not stop the ring thread
            pass

    def resend(self) -> None:
        """Send the aborts that could not go out, oldest first, while they matter."""
        keep: list[tuple[Abort, float]] = []
        now = time.monotonic()
        for i, (abort, at) in enumerate(self.unsent):
            if now - at > self.keep_for:
                continue
            try:
                self._send(abort)
            except PeerLostError:
                keep = [x for x in self.unsent[i:] if now - x[1] <= self.keep_for]
                break
            except Exception:  # noqa: BLE001
                continue
        self.unsent = keep

    def due_again(self, key: str, since: float, now: float) -> bool:
        """Whether round ``key``'s abort (first sent at ``since``) is to be told again now: once a
        second at most (RingWorker._repeat_aborts)."""
        if now - self._repeated.get(key, since) < REPEAT_ABORT_INTERVAL:
            return False
        self._repeated[key] = now
        if len(self._repeated) > MAX_UNSENT_ABORTS:
            self._repeated.pop(next(iter(self._repeated)))
        return True
