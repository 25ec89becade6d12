"""The ring worker: the one thread that owns the peer sockets and runs rounds, one at a time.

The data phase of a round runs in daemon/runner.py (a core without sockets); this module schedules
rounds: their agreement, batches and the dense lane's rounds, on the worker's one thread. What a
peer message does to a round in each phase is the round's state machine (daemon/rounds.py); how a
failure travels the ring (aborts, departures, rounds a lost peer fails) is daemon/failures.py.
One RingWorker runs both rings: who is in a round, who leads, what travels on
start / go, liveness and joins are its membership (daemon/membership.py: FixedRing;
daemon/elastic.py: ElasticRing).

Rounds reach it from the service thread once every local process of the job has submitted
(:class:`LocalRound`); across nodes the leader orders them with a start/go agreement
(daemon/agreement.py).

The dense lane (daemon/lane.py): after an agreed round, the leader's ``go`` may let the job's next
round start on every node without an agreement; the worker runs it in its main loop
(_lane_step) and gives it up, to run once agreed, when the leader closes the lane.

Every round on the fixed ring ends with a commit (RoundTransport.await_commit): a node answers its
processes and applies the round's codec-state change only once its left neighbour's ``commit``
count says every node holds the result, so no node releases a result another will fail
(docs/reliability.md, "All-or-nothing rounds").
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from birdnet.daemon import settle
from birdnet.daemon.agreement import MAX_BATCH, description, verdicts_of_start  # noqa: F401 - MAX_BATCH as before
from birdnet.daemon.failures import RoundFailures
from birdnet.daemon.lane import DenseLane, lane_eligible
from birdnet.daemon.ledger import AbortOutbox, RoundLedger
from birdnet.daemon.membership import FixedRing, LaneGivenUp, MembershipStrategy, RoundRetry
from birdnet.daemon.rounds import Phase, Round, StallLog, Step
from birdnet.daemon.runner import (  # noqa: F401 - the runner's names, importable from here as before
    AGREED,
    CodecState,
    Contribution,
    LocalRound,
    RoundRunner,
    StateStore,
    description_digest,
    seed_for,
)
from birdnet.daemon.transport import RoundTransport, pop_commit

from birdnet.config import Settings
from birdnet.errors import (
    BirdnetError,
    CodecError,
    InputError,
    PeerLostError,
    ProtocolError,
    RoundAborted,
    RoundTimeoutError,
    ShutdownError,
    rebuild,
    with_message,
)
from birdnet.messages import Abort, Go, Start, Verdict, extend_batch, record_of
from birdnet.osutil import name_os_thread
from birdnet.ring.transport import MemoryRing
from birdnet.wire import round_key, split_key

log = logging.getLogger("birdnet.engine")

class RingWorker(threading.Thread):
    """Owns the :class:`~birdnet.daemon.peers.PeerNet` (or runs alone in a one-node ring). One
    engine for both rings: who is in a round, who leads and what travels on start / go is the
    net's ``membership`` (daemon/membership.py: FixedRing, or elastic.py's ElasticRing)."""

    def __init__(self, settings: Settings, rank: int, world: int, net, runner: RoundRunner,
                 done: Callable[[LocalRound], None]) -> None:
        super().__init__(name="birdnet-ring", daemon=True)
        self.settings, self.rank, self.world, self.net = settings, rank, world, net
        membership = getattr(net, "membership", None)
        if membership is None:  # a one-node ring, or a test's stand-in net
            membership = FixedRing(settings, rank, world)
            membership.bind(net)
        self.membership: MembershipStrategy = membership
        self.runner, self.done = runner, done
        #: rounds from the service thread; a SimpleQueue (C): the ring thread looks at it several
        #: times a round, where queue.Queue's Python locking was a dozen calls a round
        self.inbox: queue.SimpleQueue[LocalRound | None] = queue.SimpleQueue()
        self.ready: dict[str, LocalRound] = {}
        self.order: list[str] = []
        self.stopping = False
        self.rounds_done = 0
        self.rounds_failed = 0
        self.agreements = 0  #: start/go exchanges this node took part in (several rounds each)
        self.last_round_seconds = 0.0
        self.pending_start: dict | None = None
        #: tombstones, departures and call numbers (daemon/ledger.py); its tables are also reachable
        #: under their old names, which the service thread writes (departed) and reads
        self.ledger = RoundLedger(settings.round_wait_timeout)
        self.departed = self.ledger.departed
        self.departed_elsewhere = self.ledger.departed_elsewhere
        self.submitted = self.ledger.submitted
        self.aborted = self.ledger.aborted
        #: (job, first call affected) of processes lost here without saying goodbye (killed, crashed),
        #: appended by the service thread: told to the ring once (_announce_departure)
        self.lost_processes: list[tuple[str, int]] = []
        #: the aborts this node sends, kept while the right neighbour cannot take them (daemon/ledger.py)
        self.outbox = AbortOutbox(membership.send_abort, settings.round_wait_timeout)
        #: jobs whose processes on this node all left and came back (a new incarnation may number its
        #: rounds from 0 again): their aborted keys are dropped. Appended by the service thread.
        self.restarted_jobs: list[str] = []
        #: the dense lane (daemon/lane.py): the round that may start here without an agreement
        self.lane = DenseLane(net, rank, world, membership.lane_allowed())
        #: the aborts this node starts or passes on, and the rounds waiting here they fail (failures.py)
        self.failures = RoundFailures(rank, world, net is None or world == 1, membership, self.ledger,
                                      self.outbox, self.lane, self.ready, self.order, self._finish)
        if net is not None and self.lane.allowed:
            net.on_lane = self.lane.on_message
        #: rounds end with a commit (RoundTransport.await_commit): every node holds the result before
        #: any releases it. The fixed ring only (elastic mode re-forms its ring instead)
        self.commits = "commit" in getattr(membership, "message_types", ()) and hasattr(net, "commits")
        #: a round that settled its commit among the surviving nodes (settlement hook, _open_lane)
        self.settled_at: str | None = None
        #: the main loop's handlers of control messages between rounds, by record type (a ``lane``
        #: message is handled as PeerNet.poll receives it, DenseLane.on_message; data between rounds
        #: is stale); a round's messages go to its Round (rounds.py)
        self._handlers: dict[type, Callable[[Any, dict[str, Any]], bool]] = {
            Start: self.handle_start, Abort: self.handle_abort}
        #: where a round waits for long (logged once): a hang then names the place it stopped
        self.stalls = StallLog(max(3 * settings.peer_timeout, 10.0))

    @property
    def lane_rounds(self) -> int:
        """Rounds run in the dense lane on this node."""
        return self.lane.rounds

    @property
    def lanes_given_up(self) -> int:
        """Lane rounds given up here because the leader closed the lane."""
        return self.lane.given_up

    # -- plumbing ---------------------------------------------------------------------------------
    def submit(self, rnd: LocalRound) -> None:
        self.inbox.put(rnd)

    def stop(self) -> None:
        self.stopping = True
        if self.net is not None:
            self.net.stopping = True  # a round in its data phase stops waiting for the ring
        self.inbox.put(None)

    def status(self) -> dict[str, Any] | None:
        """The membership's part of ``birdnet status`` (elastic mode's epoch, members, leader)."""
        return self.membership.status()

    def _take_inbox(self, timeout: float = 0.0) -> None:
        while self.restarted_jobs:
            self._forget_job(self.restarted_jobs.pop(0))
        while self.lost_processes:
            self.failures.announce_departure(*self.lost_processes.pop(0))
        if self.outbox.unsent:
            self.outbox.resend()
        if timeout <= 0 and self.inbox.empty():
            return
        try:
            item = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        offsets = self.membership.offsets
        while True:
            if item is not None:
                item.seq += offsets.get(item.job, 0)  # this node's call numbering -> the cluster's
            if item is not None and item.key in self.ready:
                # The service refuses a call number used twice; should one get here anyway, the
                # round already held must not be overwritten (its key twice in order: KeyError).
                item.error = InputError(f"round {item.key} is already in flight on node rank {self.rank}")
                self.rounds_failed += 1
                self.done(item)
            elif item is not None:
                self.ready[item.key] = item
                self.order.append(item.key)
                self.ledger.note_submitted(item.job, item.seq)
                t = self.ledger.tombstone(item.key)
                if t is not None:
                    self._finish(item, rebuild(t.error_class, t.message))
                elif item.kind != "reset" and item.error is None:
                    diverged = self.runner.states.divergence(item.job)
                    if diverged is not None:  # failed in its description: every node fails it
                        item.error = CodecError(diverged)
            if self.inbox.empty():
                return
            item = self.inbox.get_nowait()  # only this thread takes: what empty() saw is there

    def _forget_job(self, job: str) -> None:
        """The job's processes on this node all left and a new one came: its call numbering starts
        again, so what this node remembers of its rounds by number goes."""
        self.ledger.forget_job(job)
        if self.lane.at is not None and self.lane.at[0] == job:
            self.lane.close()  # its numbering starts again: the leader agrees its next round
        self.membership.forget_job(job)

    # -- what the membership decides, applied to this worker's tables ----------------------------------
    def _align(self, key: str) -> None:
        """Shift the call numbers of this node's waiting rounds of ``key``'s job as the membership
        says (an elastic joiner's become the cluster's at its first start)."""
        parsed = split_key(key)
        delta = self.membership.align(key, [self.ready[k] for k in self.order])
        if not delta or parsed is None:
            return
        for rnd in sorted((self.ready[k] for k in self.order if self.ready[k].job == parsed[0]), key=lambda r: r.seq):
            old = rnd.key
            rnd.seq += delta
            self.ready[rnd.key] = self.ready.pop(old)
            self.order[self.order.index(old)] = rnd.key

    def _applied(self, ring: Any, go: Go | None) -> None:
        """An agreement passed: its membership becomes this node's; a new epoch starts every member
        from empty codec state."""
        if self.membership.applied(ring, go):
            log.info("codec states dropped for the new membership epoch: %d", self.runner.states.clear())

    def _finish(self, rnd: LocalRound, error: BirdnetError | None = None) -> None:
        if isinstance(error, RoundAborted) and error.cls:
            error = error.as_origin()  # the class its origin saw
        self.ready.pop(rnd.key, None)
        if rnd.key in self.order:
            self.order.remove(rnd.key)
        if error is not None:
            rnd.error = error
            self.rounds_failed += 1
            log.warning("round %s failed: %s", rnd.key, error)
        else:
            self.rounds_done += 1
            self.last_round_seconds = rnd.stats.get("seconds", 0.0)
        self.done(rnd)

    # -- the dense lane ---------------------------------------------------------------------------
    def _lane_step(self) -> bool:
        """Run the lane's round if it is ready here; True when something was done."""
        assert self.lane.at is not None
        job, seq = self.lane.at
        key = round_key(job, seq)
        restarted = self.net.restarted_since(self.lane.since)
        if restarted:
            # The restarted neighbour knows nothing of the lane and waits for an agreement. Only
            # the leader may close the lane (it knows whether it joined the round): ask it.
            self.lane.close()
            self.lane.request_close(key, restarted)
            return True
        gone = self.ledger.departed_before(key, self.membership.offsets)
        if gone is not None and key not in self.ready:
            # This node's processes of the job left, so the round cannot complete. Fail it everywhere
            # once another node is in it (its data is here), not before: when the whole job ended
            # nobody waits, and an abort would outlive the job's next run on some node (which
            # numbers its calls from 0 again) and fail that run's call of the same number.
            if not self.net.has_early(key):
                return False
            why = f"node rank {self.rank}: {gone}"
            self.lane.close()
            self.ledger.remember_failed(key, "ProcessLostError", why)
            self.failures.abort(key, why, cls="ProcessLostError")
            return True
        rnd = self.ready.get(key)
        if rnd is None:
            return False
        if rnd.error is not None:  # e.g. NaN under nan_policy='reject': fail it everywhere
            self.lane.close()
            self.failures.fail_alone(rnd, rnd.error)
            return True
        if not lane_eligible(rnd):
            return False  # it waits for the leader, which closes the lane and starts it
        self._run_lane(rnd, job, seq)
        return True

    def _run_lane(self, rnd: LocalRound, job: str, seq: int) -> None:
        transport = RoundTransport(self.net, rnd.key, self.lane.since, lane=True)
        self.lane.running = rnd.key
        try:
            failed = self._data_phase(rnd, transport)
        except LaneGivenUp:
            # nothing of the round was written here (see the module docstring): run it once agreed
            transport.round.phase = Phase.GIVEN_UP
            self.lane.close()
            self.lane.given_up += 1
            rnd.stats.clear()
            if transport.interrupt is not None:
                self.pending_start = transport.interrupt
            return
        finally:
            self.lane.running = None
        if failed is not None:
            self.lane.close()
            return
        if self.lane.closed_at == round_key(job, seq + 1):
            self.lane.close()  # the leader closed the lane at the next round while this one ran
        else:
            self._open_lane(job, seq + 1, self.lane.since)

    # -- main loop --------------------------------------------------------------------------------
    def run(self) -> None:
        name_os_thread(self.name)
        try:
            if self.world == 1:
                self._run_alone()
            else:
                self._run_ring()
        except Exception:  # noqa: BLE001 - a bug here must not leave clients hanging silently
            log.exception("ring worker crashed")
            for key in list(self.ready):
                self._finish(self.ready[key], ShutdownError("the daemon's ring worker crashed; see its log"))
            raise
        finally:
            for key in list(self.ready):
                self._finish(self.ready[key], ShutdownError("the daemon is shutting down"))

    def _run_alone(self) -> None:
        ring = MemoryRing(1)
        while not self.stopping:
            self._take_inbox(timeout=0.5)
            while self.order and not self.stopping:
                rnd = self.ready[self.order[0]]
                if rnd.error is not None:
                    self._finish(rnd, rnd.error)
                    continue
                self._execute(rnd, ring.transports[0], [len(rnd.parts)])

    def _execute(self, rnd: LocalRound, transport, counts: list[int]) -> None:
        try:
            self.runner.run(rnd, transport, self.rank, self.world, counts)
        except BirdnetError as exc:
            self._finish(rnd, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a bad round must not take the daemon down
            log.exception("round %s raised", rnd.key)
            self._finish(rnd, InputError(f"round {rnd.key} failed inside the daemon: {exc!r}"))
            return
        self._finish(rnd)

    def _run_ring(self) -> None:
        net, m = self.net, self.membership
        while not self.stopping:
            self._take_inbox()
            live = self.failures.check_liveness()  # fails what cannot run (a lost peer, no majority)
            if self.lane.at is not None and live and self._lane_step():
                continue
            leader = m.leader(live)
            if leader == self.rank and self.order and live and m.may_lead():
                if self.lane.at is not None:
                    # something other than the lane's round is next: close the lane ahead of the start
                    self.lane.leader_close(round_key(*self.lane.at))
                rnd = self.ready[self.order[0]]
                try:
                    self._lead(rnd)
                except Exception as exc:  # noqa: BLE001 - bad bytes from the ring must not stop it
                    log.exception("round %s failed inside the leader", rnd.key)
                    if rnd.key in self.ready:
                        self._finish(rnd, InputError(f"round {rnd.key} failed inside the daemon: {exc!r}"))
                continue
            if leader != self.rank:
                self.failures.expire_unstarted(self.settings)
            if self.order:
                first = self.ready[self.order[0]]
                self.stalls.check(first.key, "here for a start", first.ready_at, lambda leader=leader, live=live: (
                    f"the leader as this node sees it is {leader!r} (live {live}); {m.describe_wait()}"))
            msg = self.pending_start or net.poll(0.05)
            self.pending_start = None
            rec = record_of(msg) if msg is not None else None
            handler = self._handlers.get(type(rec))
            followed = handler(rec, msg) if handler is not None else False
            if not followed and leader is not None and leader != self.rank and self.order:
                m.waiting_for_start(self.order[0], leader)
                if isinstance(m, FixedRing):
                    self.failures.repeat_aborts()

    # -- control messages between rounds, by type (as the service's main loop dispatches clients') --
    def handle_start(self, st: Start, msg: dict[str, Any]) -> bool:
        """A leader's ``start``: follow it (True). Only followers act on one; the leader's own
        starts come back inside _lead."""
        if not self.membership.follows(st):
            return False
        self._follow_guarded(st, msg.get("from"))
        return True

    def handle_abort(self, a: Abort, msg: dict[str, Any]) -> bool:
        """An ``abort`` of a round this node is not running: remembered and passed on."""
        self.failures.on_abort_elsewhere(a)
        return False

    def _follow_guarded(self, st: Start, sender: int | None) -> None:
        """A follower's part of round ``st.key``; whatever goes wrong in it fails that round here
        only (e.g. the right neighbour is not connected), never the ring thread."""
        key = st.key
        try:
            self._follow(st, sender)
        except Exception as exc:  # noqa: BLE001
            if not isinstance(exc, BirdnetError):
                log.exception("round %r failed inside a follower", key)
                exc = InputError(f"round {key!r} failed inside the daemon: {exc!r}")
            log.warning("round %s: %s", key, exc)
            if isinstance(key, str) and key in self.ready:
                self._finish(self.ready[key], exc)

    def _wait_control(self, want: str, rd: Round) -> Any:
        """Wait until ``rd.deadline`` for the control message ``want`` of round ``rd`` from the member
        before this node on its ring (its record: the leader's start back, or the go)."""
        net = self.net
        key, deadline, ring, since = rd.key, rd.deadline, rd.ring, rd.since
        rd.phase = Phase.AGREEING  # what the round takes now (Round.handle)
        rd.leading = want == "start"  # the leader waits for its start to come back, a follower for the go
        t0 = time.monotonic()
        while True:
            self._take_inbox()
            self.stalls.check(key, f"for its {want}", t0, lambda: (
                f"from {ring.describe_left()} on ring {list(ring.members)}, led by rank {ring.leader}; "
                f"{self.membership.describe_wait()}"))
            why = ring.gone(net, since)
            if why:
                raise PeerLostError(f"{why} while round {key} was starting")
            if self.stopping:
                raise ShutdownError("the daemon is shutting down")
            if time.monotonic() > deadline:
                raise RoundTimeoutError(f"round {key} did not start on every node within "
                                        f"round_timeout={self.settings.round_timeout} s")
            # The message waited for may be among lost ones. Checked before the poll, so a message
            # the poll returns (a start of another round, say) is handled before the round fails.
            err = ring.gap_error(net, key, want)
            if err is not None:
                raise err
            msg = net.poll(0.05)
            step = rd.handle(msg) if msg is not None else Step.STALE  # raises on this round's abort
            if step is Step.TAKE:
                err = ring.gap_error(net, key, want)  # what was lost may have been this round's
                if err is not None:
                    raise err
                return record_of(msg)
            if step is Step.ELSEWHERE:
                self.failures.on_abort_elsewhere(record_of(msg))  # another round
            elif step is Step.FOLLOW and self.membership.follows(record_of(msg)):
                self.pending_start = msg  # the leader moved on (or started again)
                raise self.membership.on_new_start(key)
            # anything else is stale (an earlier, failed round)

    def _lead(self, rnd: LocalRound) -> None:
        """Start ``rnd`` and, in the same start/go exchange, up to ``MAX_BATCH - 1`` more rounds
        that are ready here; each follower keeps the prefix of them that is ready on its node too, so
        a training step's many tensors cost one agreement instead of one each. The membership
        proposes the ring (and what its start and go carry)."""
        m, net = self.membership, self.net
        ring = m.propose()
        if ring is None:
            # not enough nodes want to take part yet (elastic: restarted without their processes)
            self.failures.expire_unstarted(self.settings)
            net.poll(0.05)
            return
        key = rnd.key
        rd = Round(key, ring, net.neighbour_restarts, rnd.ready_at + self.settings.round_timeout, leading=True)
        extras = [k for k in self.order if k != key and self.ready[k].error is None][:MAX_BATCH - 1]
        lane = None
        try:
            ring.send(net, {"t": "start", "k": key, **ring.fields, "descs": [[self.rank, description(self.rank, rnd)]],
                            "more": [[k, [[self.rank, description(self.rank, self.ready[k])]]] for k in extras]})
            rd.phase = Phase.AGREEING
            back = self._wait_control("start", rd)
            verdicts = verdicts_of_start(back.header, key, [k for k in extras if k in self.ready], ring)
            rd.verdict = verdicts[0]
            go = {"t": "go", **ring.fields, **verdicts[0].go_fields(), "more": [v.to_wire() for v in verdicts[1:]]}
            lane = self.lane.grant(verdicts)
            if lane is not None:
                go["lane"] = lane
                self.lane.expect(lane[0], lane[1])
            ring.send(net, go)
        except (BirdnetError, RoundRetry) as exc:
            if m.retries(exc):
                # a member of the proposed ring is gone: start the round again once the ring re-forms
                log.info("round %s: agreement on ring %s abandoned (%s); it will start again", key,
                         list(ring.members), exc)
                rd.phase = Phase.RETRY
                self.failures.abort(key, f"rank {self.rank}: {exc}", retry=True)
                net.poll(0.1)
                return
            rd.phase = Phase.FAILED
            self.lane.close()
            self.failures.report(key, exc)
            self._finish(rnd, exc)
            return
        self._applied(ring, None)
        self._granted(self._run_batch(verdicts, rd), lane, rd.since)

    def _run_batch(self, verdicts: list[Verdict], agreed: Round) -> bool:
        """Run the rounds of agreement ``agreed`` in order on its ring. Once one fails in its data
        phase the rest of the batch is failed here and aborted downstream, so no node waits for data
        that will not come. True when every round of the batch ran here without an error."""
        self.agreements += 1
        failed: BirdnetError | None = None
        all_ok = True
        for v in verdicts:
            rnd = self.ready.get(v.key)
            if rnd is None:
                all_ok = False
                continue
            if not v.ok:
                all_ok = False
                self._finish(rnd, rebuild(v.error_class or "RoundMismatchError", v.error))
            elif failed is not None:
                self.failures.abort(v.key, f"rank {self.rank}: an earlier round of the batch failed: {failed}")
                self._finish(rnd, with_message(failed, f"an earlier round of the same batch failed: {failed}"))
            else:
                self.membership.note_contributors(rnd, list(v.counts), agreed.ring)
                rd = Round(v.key, agreed.ring, agreed.since, phase=Phase.RUNNING, verdict=v)
                failed = self._data_phase(rnd, RoundTransport(self.net, v.key, round=rd))
        agreed.phase = Phase.DONE if all_ok and failed is None else Phase.FAILED
        return all_ok and failed is None

    def _follow(self, st: Start, sender: int | None = None) -> None:
        """A follower's part of the agreement the leader's start ``st`` (from rank ``sender``)
        began: its description once its processes submitted the round, then the leader's ``go``."""
        key, descs = st.key, list(st.descs)
        m, net = self.membership, self.net
        ring = m.ring_of_start(st, sender)
        if ring is None:
            return
        self.lane.close()  # a start: the leader is not in the lane (it closed it, or never opened it)
        if settle.fault_at("exit-on-start", self.rank, key):  # a test's fault point
            settle.exit_now()
        start = {"t": "start", "k": key, **ring.fields}
        rd = Round(key, ring, net.neighbour_restarts, time.monotonic() + self.settings.round_timeout)
        since, t0 = rd.since, time.monotonic()
        # Wait until this node's processes have submitted the round the leader chose. The inbox is
        # read before every wait: the service thread's wake-up may already have been consumed by
        # the poll that delivered this start, and waiting on it again would add a whole poll period.
        while True:
            self._take_inbox()
            if key not in self.ready:
                self._align(key)  # an elastic joiner's call numbers become the cluster's
            if key in self.ready:
                break
            self.failures.overtaken(key, ring.leader)
            if self.stopping:
                return
            self.stalls.check(key, "for this node's processes to submit it", t0, lambda: (
                f"rank {ring.leader} started it on ring {list(ring.members)}; waiting here: {self.order[:4]}; "
                f"{m.describe_wait()}"))
            if time.monotonic() > rd.deadline:
                descs.append([self.rank, {"error": f"the processes on node rank {self.rank} did not submit "
                                                   f"round {key} within round_timeout"}])
                ring.send(net, {**start, "descs": descs, "more": []})
                return
            why = ring.gone(net, since)
            if why is not None:
                why = f"{why} while round {key} was starting"
                if m.retries(PeerLostError(why)):
                    self.failures.abort(key, why, retry=True)  # it starts again on the re-formed ring
                else:
                    self.ledger.remember_failed(key, "PeerLostError", why)
                    self.failures.abort(key, why)
                return
            doomed = self.ledger.doomed(key, self.rank, self.ready, self.restarted_jobs, self.membership.offsets)
            if doomed is not None:
                # this node cannot take part (it failed the round already, alone, before any verdict;
                # its processes of the job left, or went past it): fail the round everywhere now
                descs.append([self.rank, {"error": doomed[0], "error_class": doomed[1]}])
                ring.send(net, {**start, "descs": descs, "more": []})
                self._pass_go(rd)
                return
            msg = net.poll(0.02)
            step = rd.handle(msg) if msg is not None else Step.STALE
            if step is Step.ABORTED:
                # remembered, so the round fails at once when this node's processes submit it
                self.failures.on_abort_elsewhere(record_of(msg))
                return
            if step is Step.PASS_ON:
                a = record_of(msg)
                self.failures.abort(key, a.reason, retry=a.retry)  # an elastic abort: on along the ring
                return
            if step is Step.FOLLOW:
                self.pending_start = msg  # the leader moved on (it abandoned this round)
                return
        rnd = self.ready[key]
        descs.append([self.rank, description(self.rank, rnd)])
        kept = extend_batch(st.more, self.ready, lambda k: [self.rank, description(self.rank, self.ready[k])])
        ring.send(net, {**start, "descs": descs, "more": kept})
        try:
            g = self._wait_control("go", rd.wait_until(rnd.ready_at + self.settings.round_wait_timeout,
                                                       Phase.AGREEING))
            if not ring.matches_go(g):
                raise ProtocolError(f"round {key}: the go message does not match its start")
        except (BirdnetError, RoundRetry) as exc:
            if m.retries(exc):
                rd.phase = Phase.RETRY
                self.failures.abort(key, f"rank {self.rank}: {exc}", retry=True)
                return  # the round stays waiting for the leader's next start
            rd.phase = Phase.FAILED
            self.failures.report(key, exc)
            self._finish(rnd, exc)
            return
        if ring.right_rank != ring.leader:
            try:
                ring.send(net, g.header)
            except BirdnetError as exc:
                self._finish(rnd, exc)
                return
        self._applied(ring, g)
        verdicts = g.verdicts(ring.world, self.ready)
        rd.verdict = verdicts[0]
        lane = g.lane if self.lane.allowed else None
        if lane is not None:
            self.lane.expect(lane[0], lane[1])  # before the batch runs: see DenseLane.expect
        self._granted(self._run_batch(verdicts, rd), lane, rd.since)

    def _granted(self, batch_ok: bool, lane: Any, since: int | None = None) -> None:
        """After an agreed batch: open the lane its ``go`` granted, if every round ran here
        (``since``: net.neighbour_restarts when its agreement began: a restart since closes it)."""
        self.lane.closed_at = None
        if lane is not None and batch_ok:
            self._open_lane(lane[0], lane[1], since)
        else:
            self.lane.close()

    def _open_lane(self, job: str, seq: int, since: int | None = None) -> None:
        if self.settled_at is not None:
            # settlement hook: after a round settled among the surviving nodes the lane stays
            # closed, here and (asked) at the leader, which may have opened it before the fault
            self.settled_at = None
            self.lane.close()
            self.lane.request_close(round_key(job, seq), "a round before it was settled among the surviving nodes")
            return
        self.lane.open(job, seq, since)

    def _pass_go(self, rd: Round) -> None:
        """Forward the leader's verdict on round ``rd``, which this node has no local part in."""
        try:
            g = self._wait_control("go", rd.wait_until(time.monotonic() + self.settings.pass_go_timeout,
                                                       Phase.AGREEING))
        except (BirdnetError, RoundRetry):
            return
        finally:
            rd.phase = Phase.FAILED  # this node's part of the round was an error description
        if rd.ring.right_rank != rd.ring.leader:
            rd.ring.send(self.net, g.header)

    def _data_phase(self, rnd: LocalRound, transport) -> BirdnetError | None:
        """Run one round (agreed: its round's verdict has the counts; a lane round has none);
        returns its error (already reported) or None. A lane round given up raises LaneGivenUp
        (RingWorker._run_lane)."""
        rd: Round | None = getattr(transport, "round", None)
        if rd is not None:
            rd.on_other_abort = self.failures.on_abort_elsewhere
        counts = rd.counts if rd is not None else None
        if self.commits:  # settlement hook (daemon/settle.py): what is known of an earlier run's same key goes
            self.net.settle_book.started(rnd.key)
            pop_commit(self.net, rnd.key)  # and any count of it (no count of this run can have come yet)
        try:
            # the transport's rank and world: positions in the live ring in elastic mode
            self.runner.run(rnd, transport, transport.rank, transport.world, counts, defer_commit=True)
            if self.commits and isinstance(transport, RoundTransport):
                # a stopped node may hold up the count for long: as long as a round may wait
                transport.await_commit(max(self.settings.peer_timeout, self.settings.round_timeout))
                if transport.settled_after_restart:
                    # settlement hook (daemon/settle.py): the left neighbour restarted in the commit,
                    # so the lane this round would open cannot run on every node (_open_lane)
                    self.settled_at = rnd.key
        except LaneGivenUp:
            raise
        except BirdnetError as exc:
            if rd is not None:
                rd.phase = Phase.FAILED
            if self.commits:  # settlement hook (daemon/settle.py): askers learn this node failed it
                self.net.settle_book.aborted(rnd.key)
            self.failures.report(rnd.key, exc)
            if getattr(transport, "interrupt", None):
                self.pending_start = transport.interrupt
            self._finish(rnd, exc)
            return exc
        except Exception as exc:  # noqa: BLE001
            log.exception("round %s raised", rnd.key)
            if self.commits:  # settlement hook (daemon/settle.py), as above
                self.net.settle_book.aborted(rnd.key)
            self.failures.abort(rnd.key, f"rank {self.rank}: internal error {exc!r}")
            if rd is not None:
                rd.phase = Phase.FAILED
            err = InputError(f"round {rnd.key} failed inside the daemon: {exc!r}")
            self._finish(rnd, err)
            return err
        if rd is not None:
            rd.phase = Phase.DONE
        if counts is None:
            # counted before the processes hear of the result: a status they ask for next shows it
            self.lane.rounds += 1
        self._finish(rnd)
        # The codec state's change once the processes have the result: every node holds it, and
        # this thread applies the change before it runs any later round. Its finite check is a pass
        # over each state array; before the release, it ran on every node at once (all are released
        # by the count within a few hops) and held back every node's result.
        # A failure here marks the job's state diverged (RoundRunner.commit_released): its next
        # rounds fail on every node, loudly, instead of running with a state only this node has.
        diverged = self.runner.commit_released(rnd, self.rank)
        for k in self.order if diverged is not None else ():
            other = self.ready[k]
            if other.job == rnd.job and other.kind != "reset" and other.error is None:
                other.error = CodecError(diverged)  # fails in its description, on every node
        return None
