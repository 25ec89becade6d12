"""The dense lane: rounds that start without an agreement.

The agreement costs two trips round the ring before any data moves (3-5 ms on
4-8 nodes here), which Gloo, whose processes simply start sending, does not pay. So after a job's
round was agreed, the leader's ``go`` opens a lane for the job's next round: each node starts it the
moment its processes submit it, if it is an all-reduce, dense or compressed (a codec without
flush rounds: :func:`lane_eligible`), and the data carries what the agreement would have (the
description, checked by the ring; the process counts, summed by it, or for a compressed round
``local_size`` on every node, a cluster-wide setting, carried and checked too). A compressed lane
round given up changed no codec state (only a completed round commits it), so it runs again once
agreed as if it had never started. The lane moves on with every lane round. It
closes when the leader wants anything else (another job's round, or this job's next round is a
barrier, a broadcast or a codec with flush rounds): a ``lane`` message naming the
round goes round the ring ahead of the leader's next ``start``, and a node already in that round
gives it up and runs it again once it is agreed. That is safe because a round writes a node's
buffers only when a message that passed through every node arrives (ring_allreduce keeps its
partial sums out of them; the compressed rings write the result once every node's part is
there), and the leader sends no data for a round it closed the lane before. Any failure, a
lost peer or a restarted neighbour closes the lane too; a lane round in progress that learns of
the failure of an earlier round of its job is given up and agreed like the others
(docs/architecture.md, "The dense lane").

:class:`DenseLane` holds this node's view of the lane (which round may start, since when, the
leader's last close) and handles the ``lane`` messages; the ring worker runs the lane's rounds.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from birdnet.codecs import Pattern, get_codec
from birdnet.errors import BirdnetError
from birdnet.messages import LaneClose, Verdict
from birdnet.wire import round_key, split_key

if TYPE_CHECKING:
    from birdnet.daemon.runner import LocalRound


def lane_eligible(rnd: LocalRound) -> bool:
    """A dense all-reduce, or a compressed one whose description the data can carry and whose
    ring writes the result only once every node's part has come (the codec patterns below; a
    codec with flush rounds is not: a flush round is run differently on the rounds it falls on)."""
    codec = rnd.desc.get("codec")
    if not (rnd.kind == "allreduce" and rnd.error is None and bool(rnd.parts) and isinstance(codec, dict)):
        return False
    if codec.get("codec") == "none":
        return True
    try:
        c = get_codec(codec["codec"], **{k: v for k, v in codec.items() if k != "codec"})
    except BirdnetError:
        return False
    if c.pattern == Pattern.MERGED:
        return not c.params.get("flush")
    return c.pattern in (Pattern.SUMMABLE, Pattern.GATHERED)


class DenseLane:
    """This node's lane: the round ``at`` (job, seq) that may start here without an agreement, or
    None while the lane is closed. Sends only ``lane`` messages, through the worker's net."""

    def __init__(self, net: Any, rank: int, world: int, allowed: bool) -> None:
        self.net, self.rank, self.world = net, rank, world
        self.allowed = allowed  #: the membership allows a lane (the fixed ring, dense_lane on)
        #: (job, seq) of the round that may start here without an agreement (the module docstring)
        self.at: tuple[str, int] | None = None
        self.since = 0  #: net.neighbour_restarts when the lane opened: a restart closes it
        self.rounds = 0  #: rounds run in the lane
        self.given_up = 0  #: lane rounds given up here because the leader closed the lane
        self.running: str | None = None  #: the lane round in its data phase here
        self.closed_at: Any = None  #: the round key of the leader's last ``lane`` close seen here
        #: the leader: a request to close the lane at this round key that came while its lane was
        #: not open yet (it was in the commit of the round before, or settling it). The lane must
        #: not open at that round: the node that asked will not run it without an agreement, and
        #: the leader would wait round_timeout for it in the lane.
        self.refused: str | None = None

    def expect(self, job: str, seq: int) -> None:
        """Keep lane data of round ``job/seq`` (and the one after) that comes before this node runs
        it: the left neighbour may finish the round before (an agreed batch, or the previous lane
        round) first and start the lane round at once. Dropping that data would leave this node
        waiting for it."""
        self.net.set_lane_keys((round_key(job, seq), round_key(job, seq + 1)))

    def open(self, job: str, seq: int, since: int | None = None) -> None:
        """Open the lane at round ``job/seq``. ``since``: net.neighbour_restarts when the agreement
        that granted it began (default: now), so a restart during that agreement's rounds closes it
        before its first round (RingWorker._lane_step)."""
        key, refused, self.refused = round_key(job, seq), self.refused, None
        if refused == key:
            self.leader_close(key)  # asked before it opened: it stays closed on every node
            return
        self.at = (job, seq)
        self.since = self.net.neighbour_restarts if since is None else since
        self.expect(job, seq)

    def close(self) -> None:
        self.at = None
        if self.net is not None and getattr(self.net, "lane_keys", ()):
            self.net.set_lane_keys(())

    def request_close(self, key: str, why: str) -> None:
        """Ask the leader to close the lane at round ``key`` (a ``lane`` message with ``req``)."""
        if self.rank == 0:
            self.leader_close(key)
            return
        try:
            self.net.send({"t": "lane", "k": key, "req": why})
        except BirdnetError:
            pass

    def leader_close(self, key: str) -> None:
        self.close()
        try:
            self.net.send({"t": "lane", "k": key})
        except BirdnetError:
            pass  # the right neighbour is lost: its rounds fail by that

    def on_message(self, rec: LaneClose) -> None:
        """A ``lane`` message, as PeerNet.poll receives it. The leader closed the lane: no round
        starts here without an agreement until a ``go`` opens it again; pass it on. A request to
        close it (``req``) travels to the leader, which closes the lane if it has not joined the
        round yet (if it has, its RoundTransport fails the round: a node will not join it)."""
        if rec.request:
            if self.rank != 0:
                try:
                    self.net.send({"t": "lane", "k": rec.key, "req": rec.request})
                except BirdnetError:
                    pass
            elif self.at is not None and self.running is None:
                self.leader_close(round_key(*self.at))
            elif self.at is None:
                self.refused = rec.key  # the lane may be about to open at it (see ``refused``)
            return
        self.close()
        # it may name the round after the one this node is still running in the lane: that round
        # must not reopen the lane when it completes
        self.closed_at = rec.key
        if self.rank != self.world - 1:
            try:
                self.net.send({"t": "lane", "k": rec.key})
            except BirdnetError:
                pass  # the right neighbour is lost: its rounds fail by that

    def grant(self, verdicts: list[Verdict]) -> list[Any] | None:
        """The lane the leader's ``go`` opens: the next round of the job of an agreed batch."""
        if not self.allowed or not verdicts or not all(v.ok for v in verdicts):
            return None
        keys = [split_key(v.key) for v in verdicts]
        if any(k is None for k in keys) or len({k[0] for k in keys}) != 1:
            return None
        return [keys[0][0], max(k[1] for k in keys) + 1]


class EarlyLaneData:
    """The data of lane rounds that came before this node runs them (a left neighbour that finished a
    lane round goes on to the next at once), kept for their round; PeerNet owns one. Only the rounds
    the lane may run next (``keys``, DenseLane.expect / open) are kept, within ``max_bytes`` in all (a
    left neighbour is one round ahead at most)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.keys: tuple[str, ...] = ()
        self._queues: dict[str, deque[dict]] = {}
        self._bytes = 0
        self.messages = 0  #: messages kept (a reader that finds 0 need not ask take)

    def set_keys(self, keys: tuple[str, ...]) -> None:
        """Lane rounds whose early data is kept from now on; what was kept for others is dropped."""
        self.keys = keys
        for k in [k for k in self._queues if k not in keys]:
            q = self._queues.pop(k)
            self.messages -= len(q)
            self._bytes -= sum(sum(b.nbytes for b in m["b"]) for m in q)

    def keep(self, key: str, msg: dict) -> str | None:
        """Keep ``msg`` (data of lane round ``key``) for its round; why not when it is dropped instead
        (over the bound), else None. Data of a round not in ``keys`` (given up, or never had) is
        dropped in silence, like stale data."""
        if key not in self.keys:
            return None
        nbytes = sum(b.nbytes for b in msg["b"])
        if self._bytes + nbytes > self.max_bytes:
            return f"early data of lane round {key!r}: over max_message_bytes kept"
        self._queues.setdefault(key, deque()).append(msg)
        self._bytes += nbytes
        self.messages += 1
        return None

    def has(self, key: str) -> bool:
        return bool(self._queues.get(key))

    def take(self, key: str) -> dict | None:
        q = self._queues.get(key)
        if not q:
            return None
        msg = q.popleft()
        self.messages -= 1
        self._bytes -= sum(b.nbytes for b in msg["b"])
        return msg
