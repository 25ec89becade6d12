"""A round as the control plane sees it, and the one place that says what each peer message does to
it in each phase: a state machine with no sockets.

The ring worker makes one per agreement (the leader in ``_lead``, a follower in ``_follow``) and one
per round it runs (``_run_batch``, a lane round in ``_run_lane``); the round's transport and the
worker's waits hand every message they receive to :meth:`Round.handle`, which dispatches its record
(birdnet.messages, decoded once by the peer layer) to ``handle_start``, ``handle_go``,
``handle_data``, ``handle_lane``, ``handle_abort`` or ``handle_commit``. Each returns a
:class:`Step` (what the caller does with the message) or raises the error that ends the round here
(RoundAborted, RoundRetry, LaneGivenUp).

============  ===========================================================================
phase         meaning
============  ===========================================================================
starting      a follower waits for its processes to submit the round the leader started
agreeing      this node passed its part on and waits for the agreement to come back (the
              leader for its start, a follower for the leader's go)
running       the data phase (an agreed round with its verdict, or a lane round)
committing    the data phase is over here; the round waits for the ring's commit count
done          completed here
failed        failed here (and aborted round the ring)
retry         the agreement was abandoned (elastic mode): the round waits for a new start
given-up      a lane round given up, to run once agreed
============  ===========================================================================

What each message does (``left``: it came from the member before this node on the round's ring;
"stale" messages are dropped; "later" ones are put back for the next reader):

============  ==================  ====================  =====================  =================
message       starting            agreeing              running                committing
============  ==================  ====================  =====================  =================
start         another round's,    the leader's own      from left: the round   later
              from left: FOLLOW   back: TAKE; a          was abandoned
                                  follower's: FOLLOW    (LaneGivenUp in a
                                                        lane, else aborted)
go            stale               follower, this        stale (an earlier      later
                                  round's: TAKE         agreement's)
data          stale               stale                 this round's, from     later
                                                        left: TAKE
lane          stale               stale                 lane round: closed at  stale
                                                        it: LaneGivenUp; a
                                                        request at the leader:
                                                        aborted
abort         this round's, from  this round's: fails   this round's (or no    this round's:
              left: ABORTED       it (RoundRetry if      round's): fails it;    fails it; other:
              (origin) or PASS_ON  ``retry``); another   another's: told to     later
                                  with origin, from     ``on_other_abort``
                                  left: ELSEWHERE
commit        stale               stale                 from left: COUNT       from left: COUNT
============  ==================  ====================  =====================  =================
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from typing import Any

from birdnet.daemon.membership import LaneGivenUp, RoundRetry

from birdnet.errors import RoundAborted
from birdnet.messages import Abort, Commit, Data, Go, LaneClose, Start, Verdict, record_of
from birdnet.wire import split_key

log = logging.getLogger("birdnet.engine")


class Phase(str, enum.Enum):
    STARTING = "starting"
    AGREEING = "agreeing"
    RUNNING = "running"
    COMMITTING = "committing"
    DONE = "done"
    FAILED = "failed"
    RETRY = "retry"
    GIVEN_UP = "given-up"


class Step(enum.Enum):
    """What the caller does with a message :meth:`Round.handle` looked at."""

    STALE = "stale"  #: nothing for this round: dropped
    TAKE = "take"  #: the message the round waits for (its data; its start or go back)
    FOLLOW = "follow"  #: a new start: kept in ``Round.interrupt``, followed once this round is over
    LATER = "later"  #: another round's message during the commit: put back for the next reader
    COUNT = "count"  #: a commit count from the left: kept for its round (transport.note_commit)
    ELSEWHERE = "elsewhere"  #: an abort (with its origin) of another round: remembered, passed on
    ABORTED = "aborted"  #: starting: this round was aborted elsewhere (remembered, the wait ends)
    PASS_ON = "pass-on"  #: starting: an elastic abort of this round, passed on (the wait ends)


def _earlier_of_job(other: Any, key: str) -> bool:
    """Whether round key ``other`` is an earlier round of the same job as ``key`` ("job/seq")."""
    a, b = split_key(other), split_key(key)
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[1]


@dataclasses.dataclass
class Round:
    """One round on this node's control plane (see the module docstring)."""

    key: str
    ring: Any  #: the round's neighbours (membership.FixedNeighbours or RingNeighbours)
    since: int  #: net.neighbour_restarts when its agreement began: a change fails the round
    deadline: float = float("inf")  #: monotonic time the current wait gives up at
    lane: bool = False  #: started without an agreement (the dense lane)
    phase: Phase = Phase.STARTING
    verdict: Verdict | None = None  #: the leader's verdict, once the go came (its counts run the round)
    leading: bool = False  #: this node started the agreement (it waits for its start, not a go)
    #: a ``start`` of another round that arrived while this one ran (the worker follows it next)
    interrupt: dict[str, Any] | None = None
    #: told of an abort (naming its origin) of another round while this one runs (the fixed ring)
    on_other_abort: Callable[[Abort], None] | None = None

    def wait_until(self, deadline: float, phase: Phase | None = None) -> Round:
        """The next wait gives up at ``deadline`` (and the round moves to ``phase``)."""
        self.deadline = deadline
        if phase is not None:
            self.phase = phase
        return self

    @property
    def counts(self) -> list[int] | None:
        """The agreed process count per ring position (None: a lane round, which learns the total
        from the ring)."""
        return None if self.verdict is None else list(self.verdict.counts)

    # -- the one dispatch of a peer message to a round ----------------------------------------------
    def handle(self, msg: dict[str, Any]) -> Step:
        """What ``msg`` (as the peer layer returned it: record ``r``, sender ``from``) does to this
        round now; raises the error that ends the round here."""
        if not self.ring.accepts(msg):
            return Step.STALE  # a node outside the round's ring (elastic mode)
        rec = msg.get("r")
        if rec is None:
            rec = record_of(msg)
        if type(rec) is Data:  # every chunk of a round: no table lookup
            return self.handle_data(rec, msg)
        handler = _HANDLERS.get(type(rec))
        return Step.STALE if handler is None else handler(self, rec, msg)

    def handle_start(self, rec: Start, msg: dict[str, Any]) -> Step:
        phase, left = self.phase, self.ring.from_left(msg)
        if phase is Phase.COMMITTING:
            return Step.LATER
        if not left:
            return Step.STALE
        if phase is Phase.AGREEING and self.leading:
            return Step.TAKE if rec.key == self.key else Step.STALE
        if phase is Phase.AGREEING or (phase is Phase.STARTING and rec.key != self.key):
            # the leader moved on (it abandoned this round, or started it again): follow the newer
            # one (in agreeing, the caller asks the membership whether it follows it)
            return Step.FOLLOW
        if phase is Phase.RUNNING:
            self.interrupt = msg  # this round was abandoned upstream (a lane round: never joined)
            if self.lane:
                raise LaneGivenUp(self.key)
            raise RoundAborted(f"round {self.key} was abandoned upstream (a new round started)")
        return Step.STALE

    def handle_go(self, rec: Go, msg: dict[str, Any]) -> Step:
        if self.phase is Phase.COMMITTING:
            return Step.LATER
        if (self.phase is Phase.AGREEING and not self.leading and rec.key == self.key
                and self.ring.from_left(msg)):
            return Step.TAKE
        return Step.STALE  # in a data phase: an earlier agreement's, passed on late

    def handle_data(self, rec: Data, msg: dict[str, Any]) -> Step:
        phase = self.phase
        if phase is Phase.RUNNING:
            # anything else is stale: a message of an earlier, failed round, or of a lane round given up
            ok = rec.key == self.key and rec.lane == self.lane and self.ring.from_left(msg)
            return Step.TAKE if ok else Step.STALE
        return Step.LATER if phase is Phase.COMMITTING else Step.STALE

    def handle_lane(self, rec: LaneClose, msg: dict[str, Any]) -> Step:
        """The lane's own state changed as the peer layer received the message (DenseLane.on_message);
        here only what it does to a lane round in its data phase."""
        if self.phase is not Phase.RUNNING or not self.lane or not self.ring.from_left(msg):
            return Step.STALE
        if rec.request and self.ring.rank == 0:
            # a node asks the leader to close the lane while the leader is in the round already
            raise RoundAborted(f"round {self.key} cannot run without an agreement: {rec.request}")
        if rec.key == self.key and not rec.request:
            raise LaneGivenUp(self.key)  # the leader closed the lane at this round
        return Step.STALE

    def handle_abort(self, a: Abort, msg: dict[str, Any]) -> Step:
        phase, mine = self.phase, a.key == self.key
        if phase is Phase.STARTING:
            if not mine or not self.ring.from_left(msg):
                return Step.STALE
            return Step.ABORTED if a.origin is not None else Step.PASS_ON
        if phase is Phase.AGREEING:
            if mine:
                raise RoundRetry(a.reason) if a.retry else RoundAborted.of(a)
            return Step.ELSEWHERE if a.origin is not None and self.ring.from_left(msg) else Step.STALE
        if phase in (Phase.RUNNING, Phase.COMMITTING):
            if mine or a.key is None:
                raise RoundAborted.of(a)
            if phase is Phase.COMMITTING:
                return Step.LATER
            if a.origin is not None and self.ring.other_aborts and self.on_other_abort is not None:
                self.on_other_abort(a)
                if self.lane and _earlier_of_job(a.key, self.key):
                    # An earlier round of this job failed somewhere. The node that failed it closed
                    # its lane and joins this round only once it is agreed, so no node can finish a
                    # segment of it: give it up and run it agreed (the job loses no second call).
                    # (A later one's failure is only remembered: this round can still complete.)
                    raise LaneGivenUp(self.key)
        return Step.STALE

    def handle_commit(self, rec: Commit, msg: dict[str, Any]) -> Step:
        """A count from the left is kept even before this node reads its last data: the left
        neighbour may finish a round and count first."""
        if self.phase in (Phase.RUNNING, Phase.COMMITTING) and self.ring.from_left(msg):
            return Step.COUNT
        return Step.STALE


#: record type -> Round.handle_* (the one table of what a round does with each kind of message)
_HANDLERS: dict[type, Callable[[Round, Any, dict[str, Any]], Step]] = {
    Start: Round.handle_start, Go: Round.handle_go, Data: Round.handle_data, LaneClose: Round.handle_lane,
    Abort: Round.handle_abort, Commit: Round.handle_commit}


class StallLog:
    """Says once per round and place, at INFO, that a round has waited longer than ``after`` seconds
    there, with what the node knows: a wait that ends only at round_timeout (600 s by default)
    otherwise leaves no trace of where the ring stopped (a leader that never starts, a start that
    never comes back, a joiner whose processes' calls were never matched)."""

    MAX_KEPT = 1024  #: bounded: the places said are forgotten past this many

    def __init__(self, after: float) -> None:
        self.after = after
        self._said: set[tuple[str, str]] = set()

    def check(self, key: str, where: str, since: float, describe: Callable[[], str]) -> None:
        waited = time.monotonic() - since
        if waited < self.after or (key, where) in self._said:
            return
        if len(self._said) >= self.MAX_KEPT:
            self._said.clear()
        self._said.add((key, where))
        try:
            what = describe()
        except Exception as exc:  # noqa: BLE001 - a diagnostic must never fail the round it describes
            what = f"(not described: {exc!r})"
        log.info("round %s has waited %.1f s %s: %s", key, waited, where, what)
