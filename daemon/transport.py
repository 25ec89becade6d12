"""The round transport: what a ring algorithm sees of the peer links for one round.

:class:`RoundTransport` implements :class:`birdnet.ring.transport.Transport` over a PeerNet for one
:class:`~birdnet.daemon.rounds.Round`: it tags the round's messages, returns the round's data and
nothing else, and dispatches the control messages that arrive meanwhile by type (``handle_*``).
One class for both rings: who the round's neighbours are is its round's ring (membership.py).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import zmq
from birdnet.daemon import settle
from birdnet.daemon.links import as_frame
from birdnet.daemon.membership import FixedNeighbours, LaneGivenUp, RingNeighbours
from birdnet.daemon.rounds import Phase, Round

from birdnet import wire
from birdnet.errors import PeerLostError, RoundAborted, RoundTimeoutError, ShutdownError
from birdnet.messages import Abort


def _earlier_of_job(other: Any, key: str) -> bool:
    """Whether round key ``other`` is an earlier round of the same job as ``key`` ("job/seq")."""
    a, b = wire.split_key(other), wire.split_key(key)
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[1]


class RoundTransport:
    """The :class:`~birdnet.ring.transport.Transport` a ring algorithm sees for one round: tags
    messages with the round key and returns the round's data, nothing else. The control messages
    that arrive meanwhile are dispatched by type to the ``handle_*`` methods (an abort of this
    round fails it, a new start or a lane close gives it up, the rest is stale or another round's).
    Its :class:`~birdnet.daemon.rounds.Round` says which round, on which ring (``neighbours``:
    FixedNeighbours by default, RingNeighbours in elastic mode) and since when; the rest is the same
    on both rings."""

    def __init__(self, net: Any, key: str, restarts_at: int | None = None, lane: bool = False,
                 neighbours: FixedNeighbours | RingNeighbours | None = None, round: Round | None = None) -> None:
        if round is None:
            round = Round(key, FixedNeighbours(net) if neighbours is None else neighbours,
                          net.neighbour_restarts if restarts_at is None else restarts_at, lane=lane,
                          phase=Phase.RUNNING)
        self.net, self.round = net, round
        self.key, self.neighbours = round.key, round.ring
        #: a lane round (started without an agreement): its messages say so, and waiting for data
        #: is waiting for the other nodes' processes too (round_timeout, not peer_timeout)
        self.lane = round.lane
        #: net.neighbour_restarts when the round's agreement began: a change fails the round
        self.restarts_at = round.since
        self.rank, self.world = self.neighbours.rank, self.neighbours.world
        self.bytes_sent = 0
        self.bytes_received = 0
        self.trackers: list[Any] = []
        #: set when the round's commit was settled (daemon/settle.py) because the left neighbour
        #: restarted: its new instance knows nothing of a lane granted before (RingWorker._open_lane)
        self.settled_after_restart: str | None = None
        #: the net's gaps not yet taken (Numbering.gaps, the same dict)
        self._gaps = net.gaps
        #: called with an ``abort`` of another round (RingWorker._on_abort_elsewhere)
        self.on_other_abort: Any = None
        self._handlers = {"data": self.handle_data, "abort": self.handle_abort, "start": self.handle_start,
                          "lane": self.handle_lane, "go": self.handle_go, "commit": self.handle_commit}

    @property
    def interrupt(self) -> dict | None:
        """A ``start`` of another round that arrived meanwhile (the ring worker follows it next)."""
        return self.round.interrupt

    def send(self, header: dict[str, Any], buffers: Sequence[Any] = ()) -> None:
        h = dict(header)
        h["k"] = self.key
        if self.lane:
            h["ln"] = 1
        before = self.net.bytes_sent
        tracker = self.neighbours.send(self.net, h, [as_frame(b) for b in buffers], True)
        if tracker is not None:
            self.trackers.append(tracker)
        self.bytes_sent += self.net.bytes_sent - before

    def flush(self, timeout: float) -> None:
        """Wait until ZeroMQ has handed every buffer sent in this round to the kernel, so the
        caller may modify or release them (they are sent without copying, often straight out of
        a training process's shared memory)."""
        deadline = time.monotonic() + timeout
        for tr in self.trackers:
            while not tr.done:
                if time.monotonic() > deadline or self.net.stopping:
                    raise PeerLostError(f"round {self.key}: {self._right()} did not take our data within {timeout} s")
                try:
                    tr.wait(min(0.05, max(0.001, deadline - time.monotonic())))
                except zmq.NotDone:
                    pass
                self.net.maybe_ping()
        self.trackers.clear()

    def _right(self) -> str:
        return self.neighbours.describe_right()

    def _check_gap(self) -> None:
        if not self._gaps:
            return  # nothing lost: the common case, up to three times per message, without calls
        gap = self.neighbours.take_gap(self.net, self.key)
        if gap:
            raise PeerLostError(gap)

    def recv(self, deadline: float) -> tuple[dict[str, Any], list[memoryview]]:
        if self.lane:
            self._check_gap()  # early data may have come after lost messages
            early = self.net.take_early(self.key)
            if early is not None:
                self.bytes_received += sum(b.nbytes for b in early["b"])
                return early["h"], early["b"]
            self.net.reading = self.key
            try:
                return self._recv(deadline)
            finally:
                self.net.reading = None
        return self._recv(deadline)

    def _recv(self, deadline: float) -> tuple[dict[str, Any], list[memoryview]]:
        nb = self.neighbours
        while True:
            if self.net.stopping:
                raise ShutdownError(f"round {self.key} aborted: birdnetd on rank {self.net.rank} is shutting down")
            why = nb.why_gone(self.net, self.key, self.restarts_at)
            if why:
                raise PeerLostError(why)
            self._check_gap()
            now = time.monotonic()
            if now >= deadline:
                if self.lane:
                    raise RoundTimeoutError(
                        f"round {self.key} did not complete within round_timeout="
                        f"{self.net.settings.round_timeout} s: the job's processes on some node did not submit it")
                raise PeerLostError(
                    f"no data from {nb.describe_left()} for round {self.key} within "
                    f"{self.net.settings.peer_timeout} s")
            before = self.net.bytes_received
            msg = self.net.poll(min(deadline - now, self.net.settings.heartbeat_interval), data=True)
            if msg is None or not nb.accepts(msg):
                continue
            handler = self._handlers.get(msg["h"].get("t"))
            if handler is None or not handler(msg):
                continue
            # data that came after lost messages is not used; control messages are handled first
            # (a start or an abort of another round must not be lost with this one)
            self._check_gap()
            self.bytes_received += self.net.bytes_received - before
            return msg["h"], msg["b"]

    # -- the round's messages, by type (each True only for data this round takes) -----------------
    def handle_data(self, msg: dict[str, Any]) -> bool:
        """This round's data from the left; anything else is stale (a message of an earlier,
        failed round, or of a lane round given up)."""
        h = msg["h"]
        return self.neighbours.from_left(msg) and h.get("k") == self.key and bool(h.get("ln")) == self.lane

    def handle_abort(self, msg: dict[str, Any]) -> bool:
        """An abort of this round fails it; one of another round (fixed ring: it names its origin)
        is the ring worker's to remember and pass on."""
        a = Abort.from_header(msg["h"])
        if a is None:
            return False
        if a.key in (self.key, None):
            raise RoundAborted.of(a)
        if a.origin is not None and self.neighbours.other_aborts and self.on_other_abort is not None:
            self.on_other_abort(a)
            if self.lane and _earlier_of_job(a.key, self.key):
                # An earlier round of this job failed somewhere. The node that failed it closed
                # its lane and joins this round only once it is agreed, so no node can finish a
                # segment of it: give it up and run it agreed (the job loses no second call).
                # (A later one's failure is only remembered: this round can still complete.)
                raise LaneGivenUp(self.key)
        return False

    def handle_start(self, msg: dict[str, Any]) -> bool:
        """The leader started an agreement: this round was abandoned upstream (a lane round: the
        leader never joined it). The start is kept for the ring worker to follow."""
        if not self.neighbours.from_left(msg):
            return False
        self.round.interrupt = msg
        if self.lane:
            raise LaneGivenUp(self.key)
        raise RoundAborted(f"round {self.key} was abandoned upstream (a new round started)")

    def handle_lane(self, msg: dict[str, Any]) -> bool:
        """The leader closes the lane at this round (a lane round gives it up), or a node asks the
        leader to close it while the leader is in the round already (it fails)."""
        h = msg["h"]
        if not self.neighbours.from_left(msg) or not self.lane:
            return False
        if h.get("req") and self.rank == 0:
            raise RoundAborted(f"round {self.key} cannot run without an agreement: {h.get('req')}")
        if h.get("k") == self.key and not h.get("req"):
            raise LaneGivenUp(self.key)
        return False

    def handle_go(self, msg: dict[str, Any]) -> bool:
        """A go during a data phase is an earlier agreement's, passed on late: stale."""
        return False

    def handle_commit(self, msg: dict[str, Any]) -> bool:
        """A ``commit`` count from the left (see :meth:`await_commit`), kept for the round it names:
        the left neighbour may finish a round and count before this node has read its last data."""
        if self.neighbours.from_left(msg):
            note_commit(self.net, msg["h"])
        return False

    # -- the commit: a round's result is released only once every node of the ring holds it ------
    def await_commit(self, timeout: float) -> None:
        """After this node's data phase: wait until every node of the ring holds the round's whole
        result, so that no node releases a result another node will fail (an all-or-nothing round).

        Each node sends its right neighbour ``commit`` with ``c``, how many consecutive nodes ending
        with itself are known to hold the result: 1 + what its left neighbour last said, at most
        world - 1, sent again whenever it grows. A node knows every node holds the result once its
        left neighbour says world - 1. That costs at most world - 1 small messages per node and
        world - 1 hops after the last node finished. A failure before then (a restarted neighbour,
        an abort, a gap in the numbering, ``timeout`` without the count) fails the round here like a
        failure of its data phase; raises like :meth:`recv`. A peer merely counted lost is waited
        for (up to ``timeout``): every node may hold the result and one may have released it, and a
        stopped node that continues completes the count. Messages of later rounds that
        come meanwhile (the left neighbour released the round and went on) are put back for the
        next reader in order."""
        need = self.world - 1
        if need < 1:
            return
        net, nb, key = self.net, self.neighbours, self.key
        book = settle.book_of(net)  # settlement (daemon/settle.py): what this node tells askers
        book.holding(key)
        deadline = time.monotonic() + timeout
        sent = 0
        later: list[dict] = []

        def take(msg: dict) -> None:
            """A message that came during the commit: a count is kept, an abort of this round fails
            it (its origin never held the result, or settled the round as failed), the rest waits."""
            if not nb.accepts(msg):
                return
            h = msg["h"]
            t = h.get("t")
            if t == "commit":
                if nb.from_left(msg):
                    note_commit(net, h)
            elif t == "abort":
                a = Abort.from_header(h)
                if a is not None and a.key in (key, None):
                    book.aborted(key)
                    raise RoundAborted.of(a)
                later.append(msg)
            elif t != "lane":  # a lane message was handled as the poll received it
                later.append(msg)

        try:
            while True:
                have = commit_count(net, key)
                c = min(need, 1 + have)
                if c > sent:
                    if c == need and settle.exit_in_commit(net.rank, key):  # a test's fault point
                        if sent == 0 and need > 1:
                            c = need - 1  # pass a smaller count on first: the ring is mid-commit
                        else:
                            settle.exit_now()
                    h = {"t": "commit", "k": key, "c": c}
                    nb.send(net, h)
                    sent = c
                    recent = getattr(net, "recent_commits", None)
                    if recent is not None:
                        recent.append((nb.right_rank, h))
                now = time.monotonic()
                # Past the deadline the count is not trusted alone (this node may have been stopped
                # while the others settled without it), nor once a node asked this one to settle.
                if have >= need and now < deadline and not book.frozen(key):
                    book.released(key)
                    return
                # A peer merely silent (lost) is waited for: this node holds the result, and so may
                # every other, one of which may have released it already; a stopped node that
                # continues completes the count. A restarted neighbour cannot (its new instance
                # knows nothing of the round), lost messages may have been counts, and at the
                # deadline the wait ends: then the surviving nodes settle the round together.
                cause, error = None, PeerLostError
                restarted = net.restarted_since(self.restarts_at)
                if net.stopping:
                    # settled, not aborted: another node may have released the round already
                    cause, error = f"birdnetd on rank {net.rank} is shutting down", ShutdownError
                elif restarted:
                    cause = f"{restarted} during its commit"
                elif self._gaps and (gap := nb.take_gap(net, key)):
                    cause = gap
                elif now >= deadline:
                    why = nb.why_gone(net, key, self.restarts_at)
                    cause = (f"the nodes did not all confirm holding the result within {timeout} s (the commit "
                             f"stopped at {nb.describe_left()})" + (f"; {why}" if why else ""))
                elif book.frozen(key):
                    cause = "another node asked to settle it"
                if cause is not None:
                    self._settle(cause, take, error, restarted=bool(restarted) and error is PeerLostError)
                    return
                msg = net.poll(min(deadline - now, net.settings.heartbeat_interval), data=True)
                if msg is not None:
                    take(msg)
        finally:
            pop_commit(net, key)
            if later:
                net.held.ready.extendleft(reversed(later))

    def _settle(self, cause: str, take: Any, error: type[Exception] = PeerLostError, restarted: bool = False) -> None:
        """Settle the round with the other nodes (daemon/settle.py): return to release it, raise
        ``error`` to fail it. A commit passes world - 1 on, so the nodes after this one that
        wait for the count release too (or, asked already, settle and find this node's release)."""
        net, key = self.net, self.key
        book = settle.book_of(net)
        commit, why = settle.settle(net, key, net.settings.peer_timeout, take)
        if restarted:
            self.settled_after_restart = f"{cause}: {why}"
        if commit:
            book.released(key)
            try:
                self.neighbours.send(net, {"t": "commit", "k": key, "c": self.world - 1})
            except PeerLostError:
                pass  # the right neighbour is gone: it settles or restarts
            return
        book.aborted(key)
        raise error(f"round {key} cannot complete: {cause}; the surviving nodes settled it as failed ({why})")


#: commit counts kept per net for rounds not finished here yet (a few: the rounds in flight)
MAX_COMMITS_KEPT = 256


def note_commit(net: Any, h: dict[str, Any]) -> None:
    """Keep the ``commit`` count ``h`` from the left neighbour (the highest per round)."""
    key, c = h.get("k"), h.get("c")
    if not isinstance(key, str) or not isinstance(c, int) or isinstance(c, bool) or not 0 < c < 1 << 20:
        return
    kept = getattr(net, "commits", None)
    if kept is None:
        return
    if c > kept.get(key, 0):
        if key not in kept and len(kept) >= MAX_COMMITS_KEPT:
            kept.pop(next(iter(kept)))
        kept[key] = c


def commit_count(net: Any, key: str) -> int:
    return net.commits.get(key, 0)


def pop_commit(net: Any, key: str) -> None:
    net.commits.pop(key, None)
