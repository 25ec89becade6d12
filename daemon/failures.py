"""How a round's failure travels the ring, on the ring worker's thread: the aborts this node starts
or passes on, what it remembers of rounds failed elsewhere (daemon/ledger.py), and the rounds
waiting here that such an abort fails.

On the fixed ring every abort names its origin and travels until it is next to it, through nodes
that are not (or no longer) in the round too, so a node that has not reached the round yet learns
of it; an elastic abort travels the round's ring. A process lost without a goodbye is announced the
same way (``ProcessLostError``), so every node fails the job's later calls at once. The ring worker
(engine.py) owns one :class:`RoundFailures` and hands it the table of its waiting rounds.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from birdnet.daemon.agreement import MAX_BATCH
from birdnet.daemon.lane import DenseLane
from birdnet.daemon.ledger import AbortOutbox, RoundLedger
from birdnet.daemon.runner import LocalRound

from birdnet.errors import BirdnetError, PeerLostError, ProcessLostError, RoundAborted, RoundTimeoutError, ShutdownError
from birdnet.messages import Abort
from birdnet.wire import round_key, split_key


class RoundFailures:
    """The failure side of the ring worker (see the module docstring). ``ready`` and ``order`` are
    the worker's waiting rounds (key -> round, and their order); ``finish`` fails one of them."""

    def __init__(self, rank: int, world: int, alone: bool, membership: Any, ledger: RoundLedger,
                 outbox: AbortOutbox, lane: DenseLane, ready: dict[str, LocalRound], order: list[str],
                 finish: Callable[[LocalRound, BirdnetError | None], None]) -> None:
        self.rank, self.world = rank, world
        self.alone = alone  #: no ring to tell (a one-node ring, or a test without a net)
        self.membership, self.ledger, self.outbox, self.lane = membership, ledger, outbox, lane
        self.ready, self.order, self.finish = ready, order, finish

    def announce_departure(self, job: str, first: int) -> None:
        """Tell the ring that a process of ``job`` was lost on this node before its call ``first``:
        every node then fails the job's later calls at once (ProcessLostError) until the job's
        processes are restarted. Without it, a node whose processes waited for a start the leader
        never sends (the leader's own process was the one lost) waited round_timeout. Only for a
        process lost without a goodbye: a job that ends normally leaves nothing behind that could
        meet its next run."""
        if self.alone or job not in self.ledger.departed:
            return
        key = round_key(job, first + self.membership.offsets.get(job, 0))
        reason = f"node rank {self.rank}: {self.ledger.departed[job][0]}"
        self.ledger.remember_failed(key, "ProcessLostError", reason)
        self.abort(key, reason, cls="ProcessLostError")

    def note_departure_elsewhere(self, key: str, reason: str) -> None:
        """A ``ProcessLostError`` abort of round ``key``: a process of its job left another node at
        that call, so no later call of the job can complete either. Applied only while this node's
        processes of the job are at that call or past it, so a stale abort of a run that ended
        cannot doom a new run of the same job (which numbers its calls from 0 again)."""
        parsed = split_key(key)
        if parsed is None:
            return
        job, seq = parsed
        if not self.ledger.note_departed_elsewhere(job, seq, reason, MAX_BATCH):
            return
        for k in list(self.order):
            r = self.ready[k]
            if r.job == job and r.seq > seq:
                self.finish(r, ProcessLostError(reason))

    def fail_alone(self, rnd: LocalRound, error: BirdnetError) -> None:
        """Fail a round on this node before the leader's verdict, and tell the ring: a node that
        holds (or will hold) the same round fails it too instead of waiting for its agreement."""
        self.finish(rnd, error)
        self.ledger.remember_failed(rnd.key, type(error).__name__, str(error))
        self.abort(rnd.key, f"node rank {self.rank}: {error}", origin=self.rank,
                   cls=None if isinstance(error, PeerLostError) else type(error).__name__)

    def on_abort_elsewhere(self, a: Abort | None) -> None:
        """An ``abort`` (naming its origin) of a round this node is not running: remember it,
        fail the round if it is waiting here, pass the abort on."""
        if a is None or a.key is None or a.origin is None or a.origin == self.rank:
            return
        key = a.key
        parsed = split_key(key)
        if self.lane.at is not None and parsed is not None and parsed[0] == self.lane.at[0]:
            self.lane.close()  # the node that failed it closed its lane: it will want an agreement
        self.ledger.remember_failed(key, a.error_class or "PeerLostError", a.reason)
        if key in self.ready:
            self.finish(self.ready[key], RoundAborted.of(a))
        if a.error_class == "ProcessLostError":
            self.note_departure_elsewhere(key, a.reason)
        self.abort(key, a.reason, origin=a.origin, cls=a.error_class)

    def abort(self, key: str, reason: str, origin: int | None = None, cls: str | None = None, *,
              retry: bool = False) -> None:
        """Tell the ring round ``key`` failed. On the fixed ring every abort names its origin
        (default: this node) and travels until it is next to it, through nodes that are not (or no
        longer) in the round too, so a node that has not reached the round yet learns of it
        (RingWorker.aborted); an elastic abort travels the round's ring (``retry``: start the round
        again on the re-formed ring). The membership says which."""
        abort = self.membership.abort_of(key, reason, origin, cls, retry)
        self.outbox.send(abort, keep=not retry and self.world > 1)

    def repeat_aborts(self) -> None:
        """This node's processes wait for the leader to start a round, and this node failed an
        earlier round of their job (alone, before any verdict): tell the ring again, once a second.
        The first abort can be lost with a connection that was being re-made (the leader stopped,
        its left neighbour's socket reconnecting): the leader would then wait round_timeout for its
        start of that round to come back, holding every round of the ring."""
        now = time.monotonic()
        for key in self.order[:1]:
            rnd = self.ready[key]
            for seq in range(max(0, rnd.seq - MAX_BATCH), rnd.seq):
                k = round_key(rnd.job, seq)
                t = self.ledger.aborted.get(k)
                if t is None or not self.outbox.due_again(k, t.at, now):
                    continue
                self.abort(k, t.message, cls=None if t.error_class == "PeerLostError" else t.error_class)

    def report(self, key: str, exc: BaseException) -> None:
        """Abort round ``key`` after it failed here with ``exc``: pass on an abort that came from
        upstream (keeping its origin and reason), else start one."""
        if isinstance(exc, RoundAborted) and exc.origin is not None:
            if exc.origin != self.rank:
                self.ledger.remember_failed(key, exc.cls or "PeerLostError", exc.reason)
                self.abort(key, exc.reason, origin=exc.origin, cls=exc.cls)
        elif isinstance(exc, RoundAborted):
            self.abort(key, f"rank {self.rank}: {exc}")
        else:
            # the class goes along only for errors that are the round's own (a mismatch, bad input):
            # a node that merely lost its neighbour says so in the reason, and others stay PeerLostError
            cls = None if isinstance(exc, (PeerLostError, ShutdownError)) else type(exc).__name__
            self.abort(key, f"rank {self.rank}: {exc}", cls=cls)

    def check_liveness(self) -> bool:
        """Whether rounds may run now (the membership's answer); the rounds waiting here fail now
        when it says they must."""
        lv = self.membership.check_liveness(bool(self.order))
        if lv.failure is not None:
            self.lane.close()  # every node learns of the loss; rounds start with an agreement after it
            for key in list(self.order):
                rnd = self.ready[key]
                err = PeerLostError(lv.failure(key, rnd.desc.get("name")))
                if lv.tell_ring:
                    self.fail_alone(rnd, err)
                else:
                    self.finish(rnd, err)
        return lv.live

    def overtaken(self, key: str, leader: int) -> None:
        """The leader started round ``key``: the rounds held here that it has gone past fail."""
        waiting = [self.ready[k] for k in self.order]
        for o in self.membership.overtaken(key, leader, waiting, self.lane.running):
            if o.remember is not None:
                self.ledger.remember_failed(o.key, "PeerLostError", o.remember)
            if o.key in self.ready:
                self.finish(self.ready[o.key], o.error)

    def expire_unstarted(self, settings: Any) -> None:
        """A follower's round the leader never starts (its job's processes on another node never
        submitted it) fails after round_timeout instead of waiting forever."""
        limit = settings.round_wait_timeout
        now = time.monotonic()
        for key in list(self.order):
            rnd = self.ready[key]
            if now - rnd.ready_at > limit:
                self.finish(rnd, RoundTimeoutError(
                    f"round {key} for tensor {rnd.desc.get('name')!r} was never started by the leader "
                    f"within round_timeout={settings.round_timeout} s: the job's processes on some other "
                    "node did not submit it"))
