"""Who is in a round: the membership strategy of the one round engine.

A fixed ring and an elastic ring run the same engine (``RingWorker`` in engine.py, ``PeerNet`` and
``RoundTransport`` in peers.py). Where they differ, the engine asks its membership object
(:class:`MembershipStrategy`), which answers and returns decisions and never changes the worker's
tables:

============================  ==============================  ======================================
question                      :class:`FixedRing`              ``ElasticRing`` (elastic.py)
============================  ==============================  ======================================
who is in a round             every node of the hosts file    the agreed live ring ``S``
who leads                     rank 0                          the last go's leader while alive, else
                                                              the lowest heard rank of the newest
                                                              epoch, with a majority heard
who the neighbours are        the hosts file's left, right    the members before and after this node
what travels on start / go    nothing more                    ``ep S L J I`` (:class:`Membership`)
which sockets, which pings    a DEALER to the right           a DEALER to every node; any rank's
                              neighbour; pings from the left  pings are accepted
liveness                      the neighbours heard, plus what every node heard directly
                              the left reports lost
a lost peer                   fails the rounds waiting        an agreement in progress starts again
                                                              on the re-formed ring
joins                         none (a restarted neighbour     a joiner aligns its call numbers with
                              fails the rounds in flight)     the cluster's at its first start
============================  ==============================  ======================================

A round's own view of its ring (rank and world as positions, left and right, the fields its start
and go carry) is a neighbours object, :class:`FixedNeighbours` or :class:`RingNeighbours`, which the
membership hands out per agreement and which the round's transport and the agreement's waits ask
(no sockets here: the neighbours send and read through the PeerNet they are given).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from birdnet.errors import PeerLostError, ProtocolError, RoundAborted, RoundTimeoutError  # noqa: F401 - RoundAborted: importable from here as before
from birdnet.messages import Abort, Go, Start
from birdnet.wire import split_key

log = logging.getLogger("birdnet.membership")


class RoundRetry(Exception):
    """The round agreement was abandoned because a member of the proposed ring was lost (or the
    leader started the same round again): the round stays waiting and is started again on the
    re-formed ring instead of failing (elastic mode). Internal to the daemon."""


class LaneGivenUp(Exception):
    """A lane round this node started is not going to run as one (the leader closed the lane, or
    started an agreement). No node can have written the round's buffers yet: the ring worker puts
    it back and runs it again when the leader starts it. Internal to the daemon."""


@dataclasses.dataclass(frozen=True)
class Liveness:
    """A membership's answer, each main-loop step, to "may rounds run now?"."""

    live: bool
    #: (round key, tensor name) -> why a round waiting here fails now; None: they wait
    failure: Callable[[str, Any], str] | None = None
    #: each failure is told round the ring (an abort naming this node as its origin)
    tell_ring: bool = False


LIVE = Liveness(True)


@dataclasses.dataclass(frozen=True)
class Overtaken:
    """A round held here that the leader has gone past (Membership.overtaken): it fails with
    ``error``; ``remember``: remembered as aborted with that reason, so a start of it fails at once."""

    key: str
    error: BaseException
    remember: str | None = None


class MembershipStrategy(Protocol):
    """What the ring worker asks its membership (FixedRing, elastic.py's ElasticRing) about rounds.
    A strategy answers from what it is handed and returns decisions; the worker applies them to its
    own tables (the peer net asks it other questions: sockets, pings, liveness of peers)."""

    offsets: dict[str, int]  #: job -> how far the cluster's call numbers are from this node's

    def check_liveness(self, want: bool) -> Liveness: ...
    def leader(self, live: bool) -> int | None: ...
    def may_lead(self) -> bool: ...
    def follows(self, st: Start) -> bool: ...
    def propose(self) -> Any: ...
    def ring_of_start(self, st: Start, sender: int | None) -> Any: ...
    def retries(self, exc: BaseException) -> bool: ...
    def on_new_start(self, key: str) -> BaseException: ...
    def abort_of(self, key: str, reason: str, origin: int | None, cls: str | None, retry: bool) -> Abort: ...
    def send_abort(self, abort: Abort) -> None: ...
    def applied(self, ring: Any, go: Go | None) -> bool: ...
    def align(self, key: str, waiting: Sequence[Any]) -> int: ...
    def overtaken(self, key: str, leader: int, waiting: Sequence[Any], running: str | None) -> list[Overtaken]: ...
    def waiting_for_start(self, key: str, leader: int) -> None: ...
    def forget_job(self, job: str) -> None: ...
    def note_contributors(self, rnd: Any, counts: list[int], ring: Any) -> None: ...
    def lane_allowed(self) -> bool: ...
    def status(self) -> dict[str, Any] | None: ...
    def describe_wait(self) -> str: ...


# -- a round's ring ---------------------------------------------------------------------------------
class FixedNeighbours:
    """A round's ring on the fixed ring: the hosts file's left and right neighbours, every node in
    every round, rank 0 leading. A round fails when any peer is lost or a neighbour restarted;
    aborts of other rounds pass through every node (they travel until next to their origin,
    RingWorker._abort)."""

    other_aborts = True
    fields: dict[str, Any] = {}  # nothing travels on start / go besides the round's own fields
    leader = 0
    #: only the accepted left neighbour's messages reach the ROUTER's reader: accepts and
    #: from_left are always True (RoundTransport skips asking, per data message)
    left_only = True

    def __init__(self, net: Any) -> None:
        self.net = net
        self.rank, self.world = net.rank, net.world
        self.members = tuple(range(self.world))
        self.right_rank = (self.rank + 1) % self.world

    def send(self, net: Any, header: dict[str, Any], buffers: Sequence[Any] = (), track: bool = False):
        return net.send(header, buffers, track=track)

    def gone(self, net: Any, since: int) -> str | None:
        """Why a round that began when net.neighbour_restarts was ``since`` cannot go on, else None."""
        lost = net.lost()
        if lost:
            return f"lost peer {net.describe_lost(lost)}"
        return net.restarted_since(since)

    def why_gone(self, net: Any, key: str, since: int) -> str | None:
        lost = net.lost()
        if lost:
            return f"lost peer {net.describe_lost(lost)} during round {key}"
        restarted = net.restarted_since(since)
        return f"round {key} cannot complete: {restarted} during it" if restarted else None

    def take_gap(self, net: Any, key: str) -> str | None:
        gap = net.take_gap()
        return f"round {key}: {gap}" if gap else None

    def gap_error(self, net: Any, key: str, want: str) -> BaseException | None:
        """The error of an agreement waiting for ``want`` after messages from the left were lost."""
        gap = net.take_gap()
        return PeerLostError(f"round {key} could not start: {gap}") if gap else None

    def accepts(self, msg: dict[str, Any]) -> bool:
        return True  # only the accepted left neighbour's messages reach the ROUTER's reader

    def from_left(self, msg: dict[str, Any]) -> bool:
        return True

    def matches_go(self, go: Go) -> bool:
        return True

    def describe_left(self) -> str:
        return f"left neighbour rank {self.net.left.rank} ({self.net.left.address})"

    def describe_right(self) -> str:
        return f"right neighbour rank {self.net.right.rank} ({self.net.right.address})"


class RingNeighbours:
    """A round's ring on an elastic ring ``members`` (sorted ranks of the hosts file): rank and
    world are positions in it, the neighbours the members before and after this node, ``leader``
    the rank that started the agreement and ``fields`` the membership its start and go carry. A
    round fails when a member is lost or restarted; messages from nodes outside the ring are
    ignored, and aborts of other rounds are not this round's business (they travel the ring of their
    own round)."""

    other_aborts = False

    def __init__(self, net: Any, members: Sequence[int], leader: int | None = None,
                 fields: dict[str, Any] | None = None) -> None:
        self.members = tuple(members)
        pos = self.members.index(net.rank)
        self.rank, self.world = pos, len(self.members)
        self.right_rank = self.members[(pos + 1) % len(self.members)]
        self.left_rank = self.members[(pos - 1) % len(self.members)]
        self.left, self.right = net.peers[self.left_rank], net.peers[self.right_rank]
        self.leader = self.members[0] if leader is None else leader
        self.fields = dict(fields or {})

    def send(self, net: Any, header: dict[str, Any], buffers: Sequence[Any] = (), track: bool = False):
        return net.send(header, buffers, track=track, to=self.right_rank)

    def gone(self, net: Any, since: int) -> str | None:
        return net.gone(list(self.members), since)

    def why_gone(self, net: Any, key: str, since: int) -> str | None:
        why = self.gone(net, since)
        return f"{why} during round {key}" if why else None

    def take_gap(self, net: Any, key: str) -> str | None:
        gap = net.take_gap_from(self.left_rank)
        return f"round {key}: {gap}; this call failed, the next one runs afresh" if gap else None

    def gap_error(self, net: Any, key: str, want: str) -> BaseException | None:
        """Messages from the member before this one were lost. The leader waiting for its ``start``
        to come back starts the agreement again (a PeerLostError: its caller retries; no node is in
        the data phase before the leader sends ``go``, so every node retries with it). A node waiting
        for ``go`` fails the round instead (RoundAborted: aborted round the ring without retry): the
        lost message may have been the ``go`` itself, and the nodes before this one would then be in
        the data phase already, where an abort fails the round; retrying here would leave this node
        waiting for a round the others have given up."""
        gap = net.take_gap_from(self.left_rank)
        if gap and want == "go":
            return RoundAborted(f"round {key}: {gap}; this call failed, the next one runs afresh")
        return PeerLostError(f"round {key}: {gap}") if gap else None

    def accepts(self, msg: dict[str, Any]) -> bool:
        return msg.get("from") in self.members

    def from_left(self, msg: dict[str, Any]) -> bool:
        return msg.get("from") == self.left_rank

    def matches_go(self, go: Go) -> bool:
        """The go carries the membership of the start it answers."""
        return all(go.header.get(k) == v for k, v in self.fields.items() if k in ("ep", "S", "L"))

    def describe_left(self) -> str:
        return f"rank {self.left_rank} ({self.left.address})"

    def describe_right(self) -> str:
        return f"rank {self.right_rank} ({self.right.address})"


def check_descs(descs: Any, key: str, ring: FixedNeighbours | RingNeighbours) -> list[tuple[int, dict[str, Any]]]:
    """The descriptions of a ``start`` back at its leader: one ``[rank, description]`` per member, in
    ring order from the leader; returned in rank order (= ring position order, members are sorted)."""
    pos = ring.members.index(ring.leader)
    order = list(ring.members[pos:] + ring.members[:pos])
    if (not isinstance(descs, list) or len(descs) != len(order)
            or not all(isinstance(x, list) and len(x) == 2 and isinstance(x[1], dict) for x in descs)
            or [x[0] for x in descs] != order):
        raise ProtocolError(f"round {key}: malformed start message came back round the ring")
    return sorted(((int(r), d) for r, d in descs), key=lambda x: x[0])


# -- the fixed ring ---------------------------------------------------------------------------------
class FixedRing:
    """Membership of the fixed ring (the default): every node of the hosts file is in every round,
    rank 0 leads, a node talks to its hosts-file neighbours only, and a lost peer stops every round
    until it is back."""

    #: what a peer may send besides pings (anything else is dropped and logged)
    message_types: tuple[str, ...] = ("start", "go", "abort", "data", "lane", "commit")
    #: pings carry the ranks the sender counts lost, and a node adds what its left neighbour reports
    relays_lost = True
    #: pongs carry the incarnation, so a node sees its right neighbour's restart too (PeerNet._note_pong)
    restarts_by_pong = True

    def __init__(self, settings: Any, rank: int, world: int) -> None:
        self.settings, self.rank, self.world = settings, rank, world
        self.net: Any = None
        #: job -> the cluster's call number minus this node's (elastic joins; always 0 here)
        self.offsets: dict[str, int] = {}

    def bind(self, net: Any) -> None:
        self.net = net

    # -- what the peer net asks ----------------------------------------------------------------------
    def dealer_ranks(self, net: Any) -> list[int]:
        """The ranks this node keeps a DEALER to (the first is the hosts-file right neighbour's)."""
        return [net.right.rank]

    def senders(self, net: Any) -> list[int]:
        """The ranks whose messages this node accepts on its ROUTER."""
        return [net.left.rank]

    def rank_problem(self, net: Any, r: Any) -> str | None:
        """Why a ping claiming rank ``r`` is refused for its rank, else None."""
        if r == net.left.rank:
            return None
        return (f"the peer claims rank {r!r}, but rank {net.rank}'s left neighbour is rank {net.left.rank} "
                f"({net.left.address}); check the order of the hosts files")

    def ping_fields(self) -> dict[str, Any]:
        """What this node's pings carry besides the handshake."""
        return {}

    def pong_fields(self, net: Any) -> dict[str, Any]:
        """What this node's pongs carry besides its rank: its incarnation, by which the left
        neighbour sees it restarted (a leader whose start or lane data went to the old instance
        would otherwise wait round_timeout for it)."""
        return {"inc": net.incarnation}

    def describe_peer(self, net: Any, r: int, side: str) -> str:
        """Rank ``r`` in messages, as the ``side`` ("left" or "right") neighbour it is to this node."""
        return f"{side} neighbour rank {r} ({net.peers[r].address})"

    def silent(self, net: Any, now: float) -> set[int]:
        """Ranks this node itself counts lost: a neighbour not heard within peer_timeout (the left
        by its messages and pings, the right by its pongs)."""
        own: set[int] = set()
        grace = self.settings.peer_timeout
        if now - max(net.live.left_seen, net.live.started) > grace:
            own.add(net.left.rank)
        if now - max(net.live.right_seen, net.live.started) > grace:
            own.add(net.right.rank)
        return own

    def describe_lost(self, net: Any, lost: set[int]) -> str:
        text = ", ".join(f"rank {r} ({net.peers[r].address})" for r in sorted(lost))
        if net.refused_by_right and net.right.rank in lost:
            text += f" [{net.refused_by_right}]"
        if net.left.rank in net.duplicates and net.left.rank in lost:
            text += f" [{net.duplicates[net.left.rank]}]"
        return text

    def peer_states(self, net: Any) -> list[dict[str, Any]]:
        lost = net.lost()
        out = []
        for p in net.peers:
            if p.rank == net.rank:
                state = "self"
            elif p.rank in lost:
                state = "lost"
            elif p.rank in (net.left.rank, net.right.rank):
                state = "connected" if net.handshaken(p.rank) else "connecting"
            else:
                state = "ok"
            out.append({"rank": p.rank, "address": p.address, "state": state})
        if net.refused_by_right:
            out[net.right.rank]["state"] = "refused"
            out[net.right.rank]["reason"] = net.refused_by_right
        if net.left.rank in net.duplicates:
            out[net.left.rank]["state"] = "refused"
            out[net.left.rank]["reason"] = net.duplicates[net.left.rank]
        return out

    # -- what the ring worker asks -------------------------------------------------------------------
    def lane_allowed(self) -> bool:
        return bool(self.settings.dense_lane) and self.world > 1

    def check_liveness(self, want: bool) -> Liveness:
        """Each main-loop step (``want``: rounds wait here): whether rounds may run now. Rounds
        cannot run while a peer is lost: the waiting ones fail now, naming the peer, and the ring
        hears it from this node's abort."""
        lost = self.net.lost()
        if not lost:
            return LIVE
        who = self.net.describe_lost(lost)
        return Liveness(False, lambda key, name: (f"lost peer {who}: round {key} for tensor {name!r} cannot run; "
                                                  "it will once the peer is back"), tell_ring=True)

    def leader(self, live: bool) -> int | None:
        return 0

    def may_lead(self) -> bool:
        return True

    def follows(self, st: Start) -> bool:
        """Whether the main loop follows this ``start`` (the leader's own come back inside _lead)."""
        return self.rank != 0

    def on_new_start(self, key: str) -> BaseException:
        """The error of a follower's agreement waiting for ``go`` when a new ``start`` came instead."""
        return RoundTimeoutError(f"round {key} was abandoned by the leader")

    def propose(self) -> FixedNeighbours | None:
        """The ring of the leader's next agreement (None: not now)."""
        return FixedNeighbours(self.net)

    def ring_of_start(self, st: Start, sender: int | None) -> FixedNeighbours | None:
        """The ring of a follower's agreement for start ``st`` (None: ignore the start)."""
        return FixedNeighbours(self.net)

    def retries(self, exc: BaseException) -> bool:
        """Whether an agreement that failed with ``exc`` leaves its round waiting for a new start."""
        return False

    def send_abort(self, abort: Abort) -> None:
        """Tell the ring a round failed. Every abort names its origin and travels until it is next to
        it, through nodes that are not (or no longer) in the round too, so a node that has not
        reached the round yet learns of it (RingWorker.aborted)."""
        if (self.rank + 1) % self.world == abort.origin:
            return
        self.net.send(abort.header())

    def abort_of(self, key: str, reason: str, origin: int | None, cls: str | None, retry: bool) -> Abort:
        return Abort(key, reason, self.rank if origin is None else origin, cls)

    def applied(self, ring: Any, go: Go | None) -> bool:
        """An agreement passed (its go sent or received). True: a new membership epoch began, and
        every member starts it from empty codec state."""
        return False

    def align(self, key: str, waiting: Sequence[Any]) -> int:
        """A follower waits for its processes to submit round ``key``: by how much to shift the call
        numbers of the ``waiting`` rounds of its job (an elastic joiner's become the cluster's)."""
        return 0

    def overtaken(self, key: str, leader: int, waiting: Sequence[Any], running: str | None) -> list[Overtaken]:
        """The leader started ``key``: every earlier round of its job is over at the leader (it starts
        a job's rounds in call order). One still ``waiting`` here failed on the other nodes while this
        node was stopped or cut off (their processes went on): it fails now, so this node's processes
        get the same error and submit the round the leader started, instead of both sides waiting
        round_timeout for each other with their call numbers apart for good. The lane round
        ``running`` here is not touched (the lane's own close gives it up)."""
        parsed = split_key(key)
        if parsed is None:
            return []
        job, seq = parsed
        return [Overtaken(r.key, RoundAborted(
            f"round {r.key} will not run: the leader rank {leader} has gone on to round {key} of the job (the "
            "call failed on the other nodes while this node was stopped or cut off)"),
            remember=f"the leader rank {leader} has gone on to round {key}")
            for r in waiting if r.job == job and r.seq < seq and r.key != running]

    def waiting_for_start(self, key: str, leader: int) -> None:
        """A follower with round ``key`` first waiting, and no start this poll."""

    def forget_job(self, job: str) -> None:
        """The job's processes here all left and a new one came: its numbering starts again."""

    def note_contributors(self, rnd: Any, counts: list[int], ring: Any) -> None:
        """Stats a round's reply carries about who took part (elastic mode names the members)."""

    def status(self) -> dict[str, Any] | None:
        return None

    def describe_wait(self) -> str:
        """What this node knows of the ring, for a round that waits for long (StallLog)."""
        lost = getattr(self.net, "lost", None)
        return f"lost {sorted(lost())}" if lost is not None else "no peer net"

