"""The round transport: what a ring algorithm sees of the peer links for one round.

:class:`RoundTransport` implements :class:`birdnet.ring.transport.Transport` over a PeerNet for one
:class:`~birdnet.daemon.rounds.Round`: it tags the round's messages, returns the round's data and
nothing else, and hands every message that arrives meanwhile to its round (Round.handle: what each
message does in each phase is said there once).
One class for both rings: who the round's neighbours are is its round's ring (membership.py).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import zmq
from birdnet.daemon import settle
from birdnet.daemon.links import as_frame
from birdnet.daemon.membership import FixedNeighbours, RingNeighbours
from birdnet.daemon.rounds import Phase, Round, Step

from birdnet.errors import PeerLostError, RoundAborted, RoundTimeoutError, ShutdownError
from birdnet.messages import Commit, Data, record_of


class RoundTransport:
    """The :class:`~birdnet.ring.transport.Transport` a ring algorithm sees for one round: tags
    messages with the round key and returns the round's data, nothing else. The messages that
    arrive meanwhile go to its round's state machine (Round.handle: an abort of this round fails it,
    a new start or a lane close gives it up, the rest is stale or another round's). Its :class:`~birdnet.daemon.rounds.Round` says which round, on which ring (``neighbours``:
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
        self.began = time.monotonic()  #: a stall of this node after this (PeerNet.stalled_at) voids the count
        self.trackers: list[Any] = []
        #: set when the round's commit was settled (daemon/settle.py) because the left neighbour
        #: restarted: its new instance knows nothing of a lane granted before (RingWorker._open_lane)
        self.settled_after_restart: str | None = None
        #: the net's gaps not yet taken (Numbering.gaps, the same dict)
        self._gaps = net.gaps
        #: only the left neighbour's messages reach this node (the fixed ring): a data message is
        #: the round's when its key and lane match (Round.handle_data's answer, taken inline)
        self._left_only = getattr(self.neighbours, "left_only", False)
        #: where a restart of a neighbour is counted (PeerLiveness.neighbour_restarts)
        self._live = getattr(net, "live", net)
        self._check_at = 0.0  #: when _recv next asks whether the round's peers are gone
    @property
    def interrupt(self) -> dict | None:
        """A ``start`` of another round that arrived meanwhile (the ring worker follows it next)."""
        return self.round.interrupt

    @property
    def on_other_abort(self) -> Any:
        """Called with an ``abort`` of another round (RingWorker._on_abort_elsewhere; Round.handle_abort)."""
        return self.round.on_other_abort

    @on_other_abort.setter
    def on_other_abort(self, f: Any) -> None:
        self.round.on_other_abort = f

    def send(self, header: dict[str, Any], buffers: Sequence[Any] = ()) -> None:
        h = dict(header)
        h["k"] = self.key
        if self.lane:
            h["ln"] = 1
        net = self.net
        before = net.bytes_sent
        frames = list(map(as_frame, buffers))
        # the fixed ring's right neighbour is the net's (FixedNeighbours.send, without its call)
        tracker = net.send(h, frames, True) if self._left_only else self.neighbours.send(net, h, frames, True)
        if tracker is not None:
            self.trackers.append(tracker)
        self.bytes_sent += net.bytes_sent - before

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
        nb, net, rd, key, lane = self.neighbours, self.net, self.round, self.key, self.lane
        if lane:
            if self._gaps:
                self._check_gap()  # early data may have come after lost messages
            # nothing kept (EarlyLaneData.messages 0), the common case, asked without a call
            early = net.take_early(key) if getattr(net.early, "messages", 1) else None
            if early is not None:
                self.bytes_received += sum(b.nbytes for b in early["b"])
                return early["h"], early["b"]
            net.reading = key  # this round's lane data is returned, not kept as early (PeerNet.poll)
        try:
            while True:
                if net.stopping:
                    raise ShutdownError(f"round {key} aborted: birdnetd on rank {net.rank} is shutting down")
                now = time.monotonic()
                # Peers counted lost change at peer_timeout's pace: asked at most every
                # LIVENESS_CHECK_INTERVAL while messages come (the questions were a third of the Python
                # calls of a dense round); a restarted neighbour is noticed at once, as before.
                if now >= self._check_at or self._live.neighbour_restarts != self.restarts_at:
                    why = nb.why_gone(net, key, self.restarts_at)
                    if why:
                        raise PeerLostError(why)
                    self._check_at = now + LIVENESS_CHECK_INTERVAL
                if self._gaps:
                    self._check_gap()
                if now >= deadline:
                    if self.lane:
                        raise RoundTimeoutError(
                            f"round {self.key} did not complete within round_timeout={net.settings.round_timeout} "
                            "s: the job's processes on some node did not submit it")
                    raise PeerLostError(
                        f"no data from {nb.describe_left()} for round {self.key} within "
                        f"{self.net.settings.peer_timeout} s")
                before = net.bytes_received
                msg = net.poll(min(deadline - now, net.settings.heartbeat_interval), data=True)
                if msg is None:
                    continue
                rec = msg.get("r")
                if self._left_only and type(rec) is Data and rd.phase is Phase.RUNNING:
                    if rec.key != key or rec.lane != lane:
                        continue  # stale: of an earlier, failed round, or of a lane round given up
                else:
                    step = rd.handle(msg)
                    if step is not Step.TAKE:
                        if step is Step.COUNT:
                            note_commit(net, record_of(msg))
                        continue
                # data that came after lost messages is not used; control messages are handled first
                # (a start or an abort of another round must not be lost with this one)
                if self._gaps:
                    self._check_gap()
                self.bytes_received += net.bytes_received - before
                return msg["h"], msg["b"]
        finally:
            if lane:
                net.reading = None

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
        failure of its data phase; raises like :meth:`recv`. A peer counted lost (nothing heard
        for peer_timeout) settles the round at once when the nodes still heard are a majority of
        the ring (a minority, e.g. a node whose own link is down, cannot tell a dead peer from its
        own isolation: it waits for the others to be heard again, or for ``timeout``). Once a
        peer was counted lost, or this node itself did not run for long (stopped: the others may
        have settled the round without it), the count alone is not trusted: the round is settled.
        Messages of later rounds that come meanwhile (the left neighbour released the round and
        went on) are put back for the next reader in order."""
        need = self.world - 1
        if need < 1:
            return
        net, nb, key = self.net, self.neighbours, self.key
        book = net.settle_book  # settlement (daemon/settle.py): what this node tells askers
        book.holding(key)
        if settle.FAULT_POINT and settle.fault_at("stop-in-commit", net.rank, key):  # a test's fault point
            settle.stop_now()
        deadline = time.monotonic() + timeout
        sent = 0
        later: list[dict] = []

        def take(msg: dict) -> None:
            """A message that came during the commit (Round.handle, phase committing): a count is
            kept, an abort of this round fails it (its origin never held the result, or settled the
            round as failed), other rounds' messages wait."""
            try:
                step = rd.handle(msg)
            except RoundAborted:
                book.aborted(key)
                raise
            if step is Step.COUNT:
                note_commit(net, record_of(msg))
            elif step is Step.LATER:
                later.append(msg)

        rd = self.round
        rd.phase = Phase.COMMITTING
        #: why the count alone is no longer trusted (a peer counted lost, this node stalled)
        unsure: str | None = None
        #: a settlement left the round undecided (a silent node may have released it): settle again
        #: once every peer is heard, a neighbour restarts, or at the deadline
        undecided = False
        # book.frozen(key) as of book.changes (asked again only when the book changed: an answer to
        # a question, a settlement); the peers counted lost as of ``check_at`` (asked at most every
        # LIVENESS_CHECK_INTERVAL while counts come, as a wait for data asks, and after every poll
        # that brought nothing). Both were half the Python calls of a commit, every round.
        seen_changes, frozen = -1, False
        lost: set[int] = set()
        check_at = 0.0
        live, counts = self._live, net.commits

        try:
            while True:
                if book.changes != seen_changes:
                    seen_changes, frozen = book.changes, book.frozen(key)
                have = counts.get(key, 0)  # commit_count, inline
                c = min(need, 1 + have)
                # a node whose answer is frozen passes no count on: the answer says how far its
                # counts can have gone (settle.abort_safe)
                if c > sent and not frozen:
                    # a test's fault point
                    if c == need and settle.FAULT_POINT and settle.exit_in_commit(net.rank, key):
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
                # This node stalled since the round began (stopped, starved: no ping went out for
                # long, PeerNet.maybe_ping): the others may have counted it lost and settled the
                # round without it, so a count read now (perhaps queued before) is not trusted.
                net.maybe_ping()
                if unsure is None and getattr(net, "stalled_at", 0.0) > self.began:
                    unsure = (f"birdnetd on rank {net.rank} did not run for {net.stalled_for:.1f} s (stopped?): "
                              "the others may have settled the round without it")
                now = time.monotonic()
                # Past the deadline the count is not trusted alone (this node may have been stopped
                # while the others settled without it), nor once a node asked this one to settle,
                # nor once a peer was counted lost or this node stalled (``unsure``).
                if have >= need and now < deadline and not frozen and unsure is None:
                    book.released(key)
                    return
                # A restarted neighbour cannot complete the count (its new instance knows nothing of
                # the round), lost messages may have been counts, a lost peer may never send its
                # own: the surviving nodes settle the round together. A lost peer settles it at once
                # when the nodes still heard are a majority; a minority (this node may be the one cut
                # off) waits until they are heard again, or the deadline.
                cause, error = None, PeerLostError
                restarted = (net.restarted_since(self.restarts_at)
                             if live.neighbour_restarts != self.restarts_at else None)
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
                elif frozen and not undecided:
                    cause = "another node asked to settle it"
                elif undecided and have >= need:
                    cause = "a count of world - 1 came (a node settled it as a success)"
                else:
                    if now >= check_at:
                        lost, check_at = net.lost(), now + LIVENESS_CHECK_INTERVAL
                    if lost:
                        why = f"lost peer {net.describe_lost(lost)} during its commit"
                        unsure = unsure or why
                        if 2 * (self.world - len(lost)) > self.world and not undecided:
                            cause = why
                    elif unsure is not None or undecided:
                        cause = f"{unsure or 'a silent peer'}; every peer is heard again"
                if cause is not None:
                    if restarted:
                        self.restarts_at = net.neighbour_restarts  # seen: settle again only on another
                    # before the deadline an abort a silent node's release could contradict waits
                    may_wait = now < deadline and error is PeerLostError
                    if self._settle(cause, take, error, restarted=bool(restarted) and error is PeerLostError,
                                    may_wait=may_wait):
                        return
                    undecided, check_at = True, 0.0
                    continue
                msg = net.poll(min(deadline - now, net.settings.heartbeat_interval), data=True)
                if msg is not None:
                    take(msg)
                else:
                    check_at = 0.0  # nothing came: the next pass asks who is lost
        finally:
            pop_commit(net, key)
            if later:
                net.held.ready.extendleft(reversed(later))

    def _settle(self, cause: str, take: Any, error: type[Exception] = PeerLostError, restarted: bool = False,
                may_wait: bool = False) -> bool:
        """Settle the round with the other nodes (daemon/settle.py): True to release it, raise
        ``error`` to fail it, False when it is not decided yet (``may_wait``: a silent node may
        have released it; the commit wait goes on). A commit passes world - 1 on, so the nodes
        after this one that wait for the count release too (or, asked already, settle and find
        this node's release)."""
        net, key = self.net, self.key
        book = net.settle_book
        commit, why = settle.settle(net, key, net.settings.peer_timeout, take, may_wait=may_wait)
        if restarted:
            self.settled_after_restart = f"{cause}: {why}"
        if commit is None:
            return False
        if commit:
            book.released(key)
            try:
                self.neighbours.send(net, {"t": "commit", "k": key, "c": self.world - 1})
            except PeerLostError:
                pass  # the right neighbour is gone: it settles or restarts
            return True
        book.aborted(key)
        raise error(f"round {key} cannot complete: {cause}; the surviving nodes settled it as failed ({why})")


#: how often (s) at most a round's wait for data asks whether its peers are gone (lost, or shut down)
#: while messages come; a wait with none asks at every heartbeat_interval-long poll
LIVENESS_CHECK_INTERVAL = 0.1

#: commit counts kept per net for rounds not finished here yet (a few: the rounds in flight)
MAX_COMMITS_KEPT = 256


def note_commit(net: Any, rec: Commit | None) -> None:
    """Keep the ``commit`` count ``rec`` from the left neighbour (the highest per round)."""
    if not isinstance(rec, Commit):
        return
    key, c = rec.key, rec.count
    kept = getattr(net, "commits", None)
    if kept is None:
        return
    book = getattr(net, "settle_book", None)
    if book is not None and book.finished(key):
        # late: a count after this node released the round (a settlement's world - 1, sent to a
        # right neighbour that may have released already; a count sent again after a queue drop), or
        # after it failed it. Kept, it would release a later run of the same key (a restarted job
        # numbers its calls from 0 again) before every node holds that run's result.
        return
    if c > kept.get(key, 0):
        if key not in kept and len(kept) >= MAX_COMMITS_KEPT:
            kept.pop(next(iter(kept)))
        kept[key] = c


def commit_count(net: Any, key: str) -> int:
    return net.commits.get(key, 0)


def pop_commit(net: Any, key: str) -> None:
    net.commits.pop(key, None)
