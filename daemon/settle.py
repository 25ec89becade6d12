"""Settlement: the surviving daemons decide a round's outcome together when its commit cannot finish.

A round ends with a commit count round the ring (RoundTransport.await_commit): a node releases the
result once its left neighbour says every other node holds it. When a node dies inside that window
(world - 1 hops of a small message), some survivors may have released and others wait for a count
that will not come. Instead of failing on their own, they settle: the node whose commit cannot
finish (its left neighbour restarted, messages from it were lost, or no count within the commit's
timeout) asks every other node of the ring directly, on its peer port, what it knows of the round,
and every node decides with the same rule (:func:`decide`) over the same answers:

1. a node released the round: commit (a release proves every node held the result);
2. else a node aborted it (it never held the result, or a settlement there decided so): abort;
3. else the nodes that answered, with the ranks their commit counts vouch for, cover the whole
   ring (every node held the result at some time): commit;
4. else abort (nobody can have released: a release needs that same proof).

Why they decide alike. A node's answer is frozen at the first question (or when it starts settling
itself): from then on it never releases on the count alone, it settles too, and it gives every asker
the same answer. A node that already decided answers with its decision, which rules 1 and 2 carry
over. So two settlers that hear from the same nodes decide the same, and a node that released before
anyone asked makes every settler commit. A settler waits for every node's answer up to
``settle_timeout`` (peer_timeout): a node that does not answer (dead, or stopped) is left out.

What goes on the wire (protocol 4): ``settle`` (asker -> any node's peer port, on a DEALER opened
for the settlement and closed after it) with the round key ``k``, the asker's ``rank`` and ``inc``;
``settled`` back with ``st`` (released / aborted / holds / pending) and ``kn`` (the ranks the
answerer knows hold the result). Nothing of this runs while rounds succeed: the good path only
records each released round in a small table (:class:`SettleBook`).

The decision is :func:`decide` (pure, tested over every case in tests/test_settle.py); the rest is
the book of what this node knows, the answer to a question (:func:`answer`, called by the peer
net's receive loop) and the asking (:func:`settle`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zmq

from birdnet import wire
from birdnet.errors import ProtocolError

log = logging.getLogger("birdnet.settle")

RELEASED, ABORTED, HOLDS, PENDING = "released", "aborted", "holds", "pending"
STATES = (RELEASED, ABORTED, HOLDS, PENDING)

#: rounds whose state a node keeps for questions (the rounds in flight are a few; a settlement
#: happens within round_timeout + peer_timeout of a round's commit)
MAX_ROUNDS_KEPT = 256
#: entries made by questions about rounds this node has not run (a hostile peer cannot push the
#: rounds it ran out of the book with questions about made-up rounds)
MAX_ASKED_KEPT = 64
#: how often (s) a settler looks at its peer sockets (heartbeats, others' questions) while it waits
SETTLE_POLL_INTERVAL = 0.01


@dataclasses.dataclass(frozen=True)
class Report:
    """What one node says of a round: its state and the ranks it knows held the result (itself when
    it holds it, and those its left neighbour's commit count vouches for)."""

    state: str
    known: frozenset[int] = frozenset()

    def to_wire(self) -> dict[str, Any]:
        return {"st": self.state, "kn": sorted(self.known)}

    @classmethod
    def from_header(cls, h: Mapping[str, Any], world: int) -> "Report":
        """The report in a ``settled`` header; ProtocolError naming the field when it is malformed."""
        st, kn = h.get("st"), h.get("kn")
        if st not in STATES:
            raise ProtocolError(f"'settled' message: state {str(st)[:40]!r} is not one of {', '.join(STATES)}")
        if (not isinstance(kn, list) or len(kn) > world
                or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world for r in kn)):
            raise ProtocolError(f"'settled' message: 'kn' must be a list of ranks of the {world}-node ring")
        return cls(st, frozenset(kn))


def chain(rank: int, world: int, count: int) -> frozenset[int]:
    """The ranks a commit count ``count`` from ``rank``'s left neighbour vouches for: the ``count``
    consecutive nodes ending with that neighbour."""
    return frozenset((rank - 1 - j) % world for j in range(max(0, min(count, world - 1))))


def decide(reports: Mapping[int, Report], world: int) -> tuple[bool, str]:
    """The settlement rule (module docstring): (commit?, why) over the reports of the nodes that
    answered, the settler's own included. Every node that settles a round calls this on the same
    reports, so every node decides the same."""
    released = sorted(r for r, p in reports.items() if p.state == RELEASED)
    if released:
        return True, f"rank {released[0]} had released it"
    aborted = sorted(r for r, p in reports.items() if p.state == ABORTED)
    if aborted:
        return False, f"rank {aborted[0]} had failed it"
    known: set[int] = set()
    for p in reports.values():
        known |= p.known
    missing = sorted(set(range(world)) - known)
    if not missing:
        return True, "every node held the result"
    return False, (f"no node had released it and no node knew whether rank(s) {', '.join(map(str, missing))} "
                   "held the result")


def final(reports: Mapping[int, Report]) -> bool:
    """Whether the decision is known before every node answered (a release or an abort decides it)."""
    return any(p.state in (RELEASED, ABORTED) for p in reports.values())


@dataclasses.dataclass
class _Entry:
    state: str
    #: the answer given to the first question (or this node's own settlement): kept for good
    frozen: Report | None = None


class SettleBook:
    """What this node knows of the rounds it ran (held, released, aborted) and the answers it gave.
    Bounded: the rounds it ran (MAX_ROUNDS_KEPT) and the rounds it was asked about and never ran
    (MAX_ASKED_KEPT), oldest out first."""

    def __init__(self, rank: int, world: int, count: Callable[[str], int]) -> None:
        self.rank, self.world, self._count = rank, world, count
        self._ran: OrderedDict[str, _Entry] = OrderedDict()
        self._asked: OrderedDict[str, _Entry] = OrderedDict()
        self.settlements = 0  #: settlements this node ran (for status and tests)
        self.answers = 0  #: questions this node answered
        #: grows whenever an entry changes state or freezes: a commit wait asks :meth:`frozen` again
        #: only then (RoundTransport.await_commit; the question was 15 calls a round)
        self.changes = 0

    def _get(self, key: str) -> _Entry | None:
        return self._ran.get(key) or self._asked.get(key)

    def _set(self, key: str, state: str) -> _Entry:
        e = self._asked.pop(key, None) or self._ran.pop(key, None) or _Entry(state)
        e.state = state
        self.changes += 1
        self._ran[key] = e
        while len(self._ran) > MAX_ROUNDS_KEPT:
            self._ran.popitem(last=False)
        return e

    def started(self, key: str) -> None:
        """Round ``key`` begins its data phase here: a decision kept under the same key is an earlier
        run's (a job whose processes were restarted numbers its calls from 0 again), forgotten."""
        e = self._ran.get(key)
        if e is not None and e.state in (RELEASED, ABORTED):
            del self._ran[key]

    def holding(self, key: str) -> None:
        """This node holds round ``key``'s whole result and waits for the commit count."""
        e = self._get(key)
        if e is None or e.state in (PENDING, HOLDS):
            self._set(key, HOLDS)

    def released(self, key: str) -> None:
        self._set(key, RELEASED)

    def aborted(self, key: str) -> None:
        """This node failed round ``key`` (its processes get the error): never overrides a release."""
        e = self._get(key)
        if e is None or e.state != RELEASED:
            self._set(key, ABORTED)

    def finished(self, key: str) -> bool:
        """Whether this node released or failed round ``key`` (its commit counts are late from then
        on: transport.note_commit drops them)."""
        e = self._ran.get(key)
        return e is not None and e.state in (RELEASED, ABORTED)

    def frozen(self, key: str) -> bool:
        """Whether this node answered a question on round ``key`` (it must settle, not release on the count)."""
        e = self._get(key)
        return e is not None and e.frozen is not None and e.state in (PENDING, HOLDS)

    def report(self, key: str) -> Report:
        """This node's answer on round ``key``, frozen at the first call (module docstring)."""
        e = self._get(key)
        if e is None:
            e = _Entry(PENDING)
            self._asked[key] = e
            while len(self._asked) > MAX_ASKED_KEPT:
                self._asked.popitem(last=False)
        if e.state in (RELEASED, ABORTED):
            return Report(e.state)
        if e.frozen is None:
            known = chain(self.rank, self.world, self._count(key))
            e.frozen = Report(e.state, known | {self.rank} if e.state == HOLDS else known)
            self.changes += 1
        return e.frozen


def book_of(net: Any) -> SettleBook:
    """The settlement book of ``net`` (PeerNet.settle_book: the peer net owns it, as it owns the
    commit counts the book reads and the socket questions are answered on)."""
    return net.settle_book


# -- answering a question (on the peer net's receive loop) -------------------------------------------
def answer(net: Any, identity: bytes, h: dict[str, Any], who: str | None = None) -> None:
    """Answer a ``settle`` question ``h`` (checked by wire.check_peer) that came on the ROUTER from
    ``identity``. A question from no rank of the ring, or (with CURVE) from a connection no ring key
    authenticated, is dropped; the daemon never raises on one."""
    r, key = h.get("rank"), h.get("k")
    if not isinstance(key, str) or not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < net.world \
            or r == net.rank:
        net._drop(f"settle question for round {str(key)[:80]!r} from no other rank of the ring ({r!r})")
        return
    if getattr(net, "curve", None) is not None and who is None:
        net._drop(f"settle question for round {key!r} from a connection no ring key authenticated")
        return
    book = book_of(net)
    rep = book.report(key)
    book.answers += 1
    net._reply(identity, {"t": "settled", "k": key, "rank": net.rank, **rep.to_wire()})


# -- asking ---------------------------------------------------------------------------------------
def settle(net: Any, key: str, timeout: float, on_message: Callable[[dict], None],
           may_wait: bool = False) -> tuple[bool | None, str]:
    """Settle round ``key`` with every other node of the ring: ask each on its peer port, wait up to
    ``timeout`` for the answers (stopping early once one decides it), and return :func:`decide`'s
    (commit?, why). The peer net keeps being served meanwhile (heartbeats, others' questions);
    what its poll returns goes to ``on_message``, which may raise to end the settlement.
    ``may_wait`` (before the commit's deadline): an abort that a silent node's release could
    contradict (:func:`abort_safe`) is not decided: (None, why), and the caller waits on."""
    book = book_of(net)
    book.settlements += 1
    reports: dict[int, Report] = {net.rank: book.report(key)}
    socks: dict[zmq.Socket, int] = {}
    poller = zmq.Poller()
    try:
        for r in range(net.world):
            if r == net.rank:
                continue
            s = _dealer(net, r)
            socks[s] = r
            poller.register(s, zmq.POLLIN)
            try:
                s.send_multipart(wire.encode({"t": "settle", "k": key, "rank": net.rank, "inc": net.incarnation}),
                                 zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # not connected yet and nothing queued: counts as no answer
        deadline = time.monotonic() + timeout
        while len(reports) < net.world and not final(reports) and time.monotonic() < deadline:
            for s, _ in poller.poll(0):
                r = socks[s]
                rep = _read_answer(s, net.world, key, r)
                if rep is not None and r not in reports:
                    reports[r] = rep
            if len(reports) == net.world or final(reports) or _rest_lost(net, reports):
                break
            msg = net.poll(SETTLE_POLL_INTERVAL, data=True)
            if msg is not None:
                on_message(msg)
    finally:
        for s in socks:
            s.close(0)
    commit, why = decide(reports, net.world)
    silent = sorted(set(range(net.world)) - set(reports))
    detail = f"{why}; answers from rank(s) {', '.join(map(str, sorted(reports)))}" + (
        f", none from {', '.join(map(str, silent))}" if silent else "")
    if may_wait and not commit and not abort_safe(reports, net.world, silent):
        log.warning("round %s not settled yet: a silent node may have released it (%s); waiting for it", key, detail)
        return None, detail
    log.warning("round %s settled among the surviving nodes: %s (%s)", key, "commit" if commit else "abort", detail)
    return commit, detail


def abort_safe(reports: Mapping[int, Report], world: int, silent: Sequence[int]) -> bool:
    """Whether no silent rank can have released the round, by what its left neighbour answered: a
    node releases only on a count of world - 1 from its left, which its left sends only once it
    knows world - 1 nodes held the result (itself included); a node whose answer is frozen passes
    no count on (RoundTransport.await_commit). A left neighbour that is silent too, or knows that
    many, leaves the silent node's release possible: the survivors then wait for it (it may be
    stopped, or cut off, with its proof in flight) instead of failing a call it may have returned."""
    for x in silent:
        left = reports.get((x - 1) % world)
        if left is None:
            return False
        if left.state in (RELEASED, ABORTED):
            continue
        if left.state == HOLDS and len(left.known) >= world - 1:
            return False
    return True


def _rest_lost(net: Any, reports: Mapping[int, Report]) -> bool:
    """Whether the ranks that have not answered are all counted lost (nothing heard from them for
    peer_timeout) and the answers are from a majority of the ring: waiting longer for the lost
    would only make the settlement last peer_timeout more. A minority waits (this node may be the
    one cut off, or its view of who is lost may be stale after it was stopped)."""
    lost = net.lost() if hasattr(net, "lost") else set()
    return bool(lost) and 2 * len(reports) > net.world and set(range(net.world)) - set(reports) <= lost


def _dealer(net: Any, r: int) -> zmq.Socket:
    from birdnet.daemon.links import peer_socket
    s = peer_socket(net.router.context, zmq.DEALER, net.settings)
    if getattr(net, "curve", None) is not None:
        net.curve.configure_client(s, net.peers[r])
    s.setsockopt(zmq.IDENTITY, f"s{net.rank}-{net.incarnation}-{os.urandom(4).hex()}".encode())
    s.connect(net.peers[r].endpoint())
    return s


def _read_answer(s: zmq.Socket, world: int, key: str, r: int) -> Report | None:
    """The first well-formed answer from rank ``r`` waiting on ``s`` (the rest is dropped, logged)."""
    while True:
        try:
            frames = s.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            h, _ = wire.decode(frames, max_bytes=wire.MAX_HEADER_BYTES)
            wire.check_peer(h, world)
            if h.get("t") != "settled" or h.get("k") != key or h.get("rank") != r:
                raise ProtocolError(f"not an answer of rank {r} on round {key}")
            return Report.from_header(h, world)
        except ProtocolError as exc:
            log.warning("dropped a bad settlement answer from rank %d: %s", r, exc)


# -- fault points for tests ---------------------------------------------------------------------------
#: ``BIRDNET_FAULT_POINT=exit-in-commit:RANK:KEY``: the daemon of rank RANK exits (status 9) in round
#: KEY's commit after it passed a count on and before it passes on the count that releases the next
#: node: the window this module settles. ``exit-on-start:RANK:KEY``: it exits as the leader's start
#: of round KEY reaches it, before passing it on (a start lost with a daemon killed and restarted).
#: ``stop-in-commit:RANK:KEY``: it stops itself (SIGSTOP; the test continues it) as round KEY's commit
#: begins there, before it passes any count on. Read once; tests only.
FAULT_ENV = "BIRDNET_FAULT_POINT"
FAULT_EXIT_STATUS = 9
_fault = os.environ.get(FAULT_ENV, "")
#: whether a fault point is set at all (hot paths look at it before asking which one)
FAULT_POINT = bool(_fault)


def exit_in_commit(rank: int, key: str) -> bool:
    """Whether the test fault point names this node and round (see FAULT_ENV)."""
    return fault_at("exit-in-commit", rank, key)


def fault_at(point: str, rank: int, key: str) -> bool:
    """Whether the test fault point ``point`` names this node and round (see FAULT_ENV)."""
    return bool(_fault) and _fault == f"{point}:{rank}:{key}"


def stop_now() -> None:
    log.warning("fault point %s: stopping (SIGSTOP)", _fault)
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.5)  # the stop takes the whole process a moment: this thread sends nothing before it


def exit_now() -> None:
    time.sleep(0.3)  # the count passed on before goes out first (ZeroMQ's I/O thread)
    log.warning("fault point %s: exiting", _fault)
    os._exit(FAULT_EXIT_STATUS)
