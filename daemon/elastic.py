"""Elastic mode (``birdnetd --elastic``): the ring goes on without a lost node.

This module holds the membership rules alone: :class:`ElasticRing`, the membership strategy the one
round engine asks (daemon/membership.py says which questions; the fixed ring's answers are
:class:`~birdnet.daemon.membership.FixedRing`). The sockets, the handshake, the agreement's waits,
the batches and the round transport are the engine's, the same for both rings.

Without it (the default), a lost node stops every round of the cluster until it is back. With it:

* **Liveness, directly.** Every node keeps a DEALER to *every* other node (not only its right
  neighbour) and pings all of them each ``heartbeat_interval``; a node is *heard* while a ping or
  pong from it arrived within ``peer_timeout``. Pings carry the sender's membership epoch, its
  incarnation and ``want`` (it has rounds waiting).
* **Membership.** The live ring is a sorted list ``S`` of node ranks agreed with an epoch number:
  every ``start`` and ``go`` carries ``ep``, ``S``, the leader ``L``, the joiners ``J`` being
  admitted, and the incarnations ``I`` of the members. A node applies the membership of a ``go``
  when it passes (the leader when it sends it). Rounds run on ``S``: the ring algorithms see
  rank = position in ``S`` and world = ``len(S)``; ``counts`` hold the members' process counts only,
  so ``mean`` divides by the processes that contributed, and the reply's ``stats["contributors"]``
  lists the node ranks that contributed.
* **Leader.** The leader of the last ``go`` stays the leader while it is alive; once it is lost, the
  lowest heard rank whose epoch is the highest heard takes over. A node leads only when a majority
  of the hosts file is heard (no split brain) and no heard node has a newer epoch than its own (a
  restarted or partitioned node never leads before it is admitted again).
* **Admission.** The leader's proposal is itself plus every heard node that is a member with the
  same incarnation, or that wants to join (has rounds waiting). A node that is new, restarted (new
  incarnation) or was dropped is a *joiner*: at its first ``start`` it aligns its processes' call
  numbering with the cluster's (its lowest waiting round of the job becomes the round the leader
  started), so a returning node's processes may keep their numbering or start from zero.
* **Lost messages.** Each connection numbers its messages (``q``, as on the fixed ring): a TCP
  connection that broke and reconnected shows as a jump from that sender. The data phase, or a
  node waiting for ``go``, fails the round on a jump from the member before it (the abort fails it
  everywhere); the leader waiting for its ``start`` to come back starts the agreement again; a node
  waiting for a ``start`` asks the leader to start again (the start may be among the lost).
* **Codec state** (error feedback, compensation) is dropped on every member when the epoch changes,
  so all members start the epoch from the same state and stay bit-identical; a returning node does
  not keep the residual it had before it left.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from birdnet.daemon.membership import Liveness, Overtaken, RingNeighbours, RoundRetry

from birdnet import wire
from birdnet.errors import PeerLostError, RoundAborted
from birdnet.messages import Abort, Go, Membership, Start, is_int

log = logging.getLogger("birdnet.elastic")


class ElasticRing:
    """Membership of an elastic ring (see the module docstring). One object per daemon, shared by
    its PeerNet (what pings and pongs carry, which ranks it links to, status) and its RingWorker
    (who is in a round, who leads, joins), so the epoch and members live in one place."""

    message_types: tuple[str, ...] = ("start", "go", "abort", "data")  # no dense lane in elastic mode
    relays_lost = False  # every node hears every other directly

    def __init__(self, settings: Any, rank: int, world: int) -> None:
        self.settings, self.rank, self.world = settings, rank, world
        self.net: Any = None
        self.epoch = 0
        self.members: list[int] = list(range(world))
        self.leader_rank = 0  #: the leader of the last go
        self.member_inc: dict[int, str] = {}
        self.offsets: dict[str, int] = {}  #: job -> cluster call number - local call number
        self.join_epoch: int | None = None  #: the epoch this node was last admitted in as a joiner
        self.aligned: set[str] = set()  #: jobs aligned since then
        self.no_quorum_since: float | None = time.monotonic()
        self.applied_at = 0.0  #: when this node applied its membership epoch
        self.want = False  #: this node has rounds waiting (its pings say so)
        self.heard: set[int] = {rank}  #: the ranks heard at the last main-loop step
        self.current: RingNeighbours | None = None  #: the ring of the batch in progress

    def bind(self, net: Any) -> None:
        self.net = net

    @property
    def next_rank(self) -> int:
        """Where this node's aborts go: the next member of the batch in progress."""
        return self.current.right_rank if self.current is not None else (self.rank + 1) % self.world

    # -- what the peer net asks ----------------------------------------------------------------------
    def dealer_ranks(self, net: Any) -> list[int]:
        return [net.right.rank] + [p.rank for p in net.peers if p.rank not in (net.right.rank, self.rank)]

    def senders(self, net: Any) -> list[int]:
        return [p.rank for p in net.peers if p.rank != self.rank]

    def rank_problem(self, net: Any, r: Any) -> str | None:
        if is_int(r) and 0 <= r < self.world and r != self.rank:
            return None
        return f"the peer claims rank {r!r}, which is not another rank of the {self.world}-node ring"

    def ping_fields(self) -> dict[str, Any]:
        return {"ep": self.epoch, "want": self.want}

    def pong_fields(self, net: Any) -> dict[str, Any]:
        return {"ep": self.epoch, "inc": net.incarnation, "want": self.want}

    def describe_peer(self, net: Any, r: int, side: str) -> str:
        return f"rank {r} ({net.peers[r].address})"

    def silent(self, net: Any, now: float) -> set[int]:
        return {r for r in range(self.world) if not net.presumed(r, now)}

    def describe_lost(self, net: Any, lost: set[int]) -> str:
        text = ", ".join(f"rank {r} ({net.peers[r].address})" for r in sorted(lost))
        reasons = [f"rank {r}: {net.refused[r]}" for r in sorted(lost) if r in net.refused]
        reasons += [net.duplicates[r] for r in sorted(lost) if r in net.duplicates]
        return text + (f" [{'; '.join(reasons)}]" if reasons else "")

    def peer_states(self, net: Any) -> list[dict[str, Any]]:
        now = time.monotonic()
        out = []
        for p in net.peers:
            if p.rank == self.rank:
                state = "self"
            elif not net.heard(p.rank, now):
                state = "lost"
            elif p.rank in self.members:
                state = "ok"
            else:
                state = "joining"
            row = {"rank": p.rank, "address": p.address, "state": state}
            if p.rank in net.refused:
                row["state"], row["reason"] = "refused", net.refused[p.rank]
            if p.rank in net.duplicates:
                row["state"], row["reason"] = "refused", net.duplicates[p.rank]
            out.append(row)
        return out

    # -- what the ring worker asks: liveness and the leader ------------------------------------------
    def lane_allowed(self) -> bool:
        return False

    def check_liveness(self, want: bool) -> Liveness:
        """A majority of the hosts file must be heard for rounds to start; without one for
        peer_timeout, the rounds waiting here (``want``) fail."""
        net = self.net
        self.want = want
        heard = self.heard = net.alive()
        now = time.monotonic()
        quorum = 2 * len(heard) > self.world
        if quorum:
            self.no_quorum_since = None
        elif self.no_quorum_since is None:
            self.no_quorum_since = now
        if not quorum and now - self.no_quorum_since > self.settings.peer_timeout:
            who = net.describe_lost(net.lost() or set(range(self.world)) - heard)
            return Liveness(False, lambda key, name: (
                f"lost peer {who}: elastic mode needs a majority of the {self.world} nodes live, "
                f"{len(heard)} are; round {key} cannot run"))
        return Liveness(quorum)

    def _epoch_of(self, r: int) -> int:
        if r == self.rank:
            return self.epoch
        ep = int(self.net.info.get(r, {}).get("ep", -1))
        if r in self.members and time.monotonic() - self.applied_at < self.settings.peer_timeout:
            # a member of this node's epoch passed the same go; its pings say so a heartbeat later
            ep = max(ep, self.epoch)
        return ep

    def leader(self, live: bool) -> int | None:
        """The leader as this node sees it: the last go's leader while it is alive and current,
        else the lowest heard rank among those with the highest heard epoch (None without a quorum,
        or while a heard node's epoch is not known yet)."""
        if not live:
            return None
        net, heard = self.net, self.heard
        if any(r not in net.info for r in heard if r != self.rank):
            return None  # a heard node whose epoch we do not know yet: wait for its ping
        top = max(self._epoch_of(r) for r in heard)
        if net.presumed(self.leader_rank) and (self.leader_rank not in heard or self._epoch_of(self.leader_rank) == top):
            return self.leader_rank
        return min(r for r in heard if self._epoch_of(r) == top)

    def may_lead(self) -> bool:
        """No heard node has a newer epoch (a restarted or partitioned node never leads before it is
        admitted again)."""
        return all(self._epoch_of(r) <= self.epoch for r in self.heard)

    def follows(self, st: Start) -> bool:
        return st.leader != self.rank

    def on_new_start(self, key: str) -> BaseException:
        """The error of an agreement waiting for ``go`` when the leader started again."""
        return RoundRetry(f"round {key} was started again by the leader")

    # -- who is in a round ---------------------------------------------------------------------------
    def _proposal(self, heard: set[int]) -> tuple[list[int], int, list[int], dict[str, str]]:
        """The leader's proposal: itself plus every heard node that is a member with the same
        incarnation, or that wants to join (has rounds waiting)."""
        net = self.net
        info = net.info
        ring, joiners = [], []
        for r in sorted(heard):
            inc = net.incarnation if r == self.rank else info.get(r, {}).get("inc")
            same = r in self.members and self.member_inc.get(r) in (None, inc)
            if r == self.rank or same or info.get(r, {}).get("want"):
                ring.append(r)
                if not same and r != self.rank:
                    joiners.append(r)
        incs = {str(r): (net.incarnation if r == self.rank else str(info.get(r, {}).get("inc"))) for r in ring}
        changed = ring != self.members or joiners or self.leader_rank != self.rank or self.epoch == 0
        return ring, self.epoch + 1 if changed else self.epoch, joiners, incs

    def propose(self) -> RingNeighbours | None:
        ring, ep, joiners, incs = self._proposal(self.heard)
        if 2 * len(ring) <= self.world:
            return None  # not enough nodes want to take part yet (restarted without their processes)
        member = Membership(ep, tuple(ring), self.rank, tuple(joiners), incs)
        self.current = RingNeighbours(self.net, ring, self.rank, member.fields())
        return self.current

    def ring_of_start(self, st: Start, sender: int | None) -> RingNeighbours | None:
        """The ring a start names, if this node is in it, the epoch is not older than its own and the
        start came from the member before it; a joiner notes the epoch it is admitted in."""
        h = st.header  # the membership fields are checked here: their bounds are this ring's world
        m = Membership.from_header(h, self.world)
        if (m is None or self.rank not in m.ring or m.epoch < self.epoch
                or sender != m.ring[m.ring.index(self.rank) - 1]):
            # INFO: a start ignored here holds the whole ring until round_timeout if it was meant for it
            log.info("ignored a start from rank %r (this node: epoch %d): %r", sender, self.epoch,
                     {k: h.get(k) for k in ("k", "ep", "S", "L")})
            return None
        mine = m.incarnations.get(str(self.rank))
        if mine not in (None, "None") and mine != self.net.incarnation:
            # A start for this node's previous life: a neighbour's DEALER queued it while this
            # daemon was down and delivered it once the connection came back. Followed, it held
            # this node in a round no leader runs any more for up to round_timeout
            log.info("ignored a start of round %r for an earlier incarnation of this node (%s)", h.get("k"), mine)
            return None
        if self.rank in m.joiners and self.join_epoch != m.epoch:
            self.join_epoch, self.aligned = m.epoch, set()
        self.current = RingNeighbours(self.net, m.ring, m.leader, m.fields())
        return self.current

    def retries(self, exc: BaseException) -> bool:
        """A member of the proposed ring is gone (or the leader started again): the round stays
        waiting and starts again once the ring re-forms; an abort (RoundAborted) fails it."""
        return isinstance(exc, RoundRetry) or (isinstance(exc, PeerLostError) and not isinstance(exc, RoundAborted))

    def abort_of(self, key: str, reason: str, origin: int | None, cls: str | None, retry: bool) -> Abort:
        """Elastic aborts travel the round's ring, without an origin or an error class; ``retry``:
        start the round again on the re-formed ring."""
        return Abort(key, reason, retry=retry)

    def send_abort(self, abort: Abort) -> None:
        self.net.send(abort.header(), to=self.next_rank)

    def applied(self, ring: RingNeighbours, go: Go | None) -> bool:
        """The membership of an agreement that passed becomes this node's (the leader's when it sent
        the go, a follower's when the go passed). True when its epoch is new: every member then
        starts it from the same (empty) codec state, so results stay bit-identical."""
        f = ring.fields
        ep, members, leader = f["ep"], list(f["S"]), f["L"]
        incs = f.get("I") if go is None else go.header.get("I")
        new_epoch = ep != self.epoch
        if new_epoch:
            log.info("membership epoch %d: ring %s, leader rank %d (codec states dropped)", ep, members, leader)
        self.epoch, self.members, self.leader_rank = ep, members, leader
        self.applied_at = time.monotonic()
        if isinstance(incs, dict):
            self.member_inc = {int(k): str(v) for k, v in incs.items() if str(k).isdigit()}
        return new_epoch

    def note_contributors(self, rnd: Any, counts: list[int], ring: Any) -> None:
        rnd.stats["contributors"] = [r for r, c in zip(ring.members, counts) if c > 0]
        rnd.stats["epoch"] = self.epoch

    def status(self) -> dict[str, Any] | None:
        return {"epoch": self.epoch, "members": list(self.members), "leader": self.leader_rank}

    def describe_wait(self) -> str:
        """What this node knows of the membership, for a round that waits for long (StallLog)."""
        info = {r: (i.get("ep"), i.get("want")) for r, i in sorted(getattr(self.net, "info", {}).items())}
        return (f"epoch {self.epoch}, members {self.members}, leader rank {self.leader_rank}, joined in "
                f"epoch {self.join_epoch}, heard {sorted(self.heard)}, (epoch, want) heard per rank {info}")

    # -- joins ---------------------------------------------------------------------------------------
    def forget_job(self, job: str) -> None:
        """A job restarted on this node numbers its calls from 0, as it does on the others when the
        whole job restarted: the offset of an earlier alignment no longer applies (kept, it gave this
        node's rounds other numbers than everyone's, each waiting round_timeout). A node whose job
        alone restarted while the others went on aligns again if it is a joiner (align)."""
        if self.offsets.pop(job, 0):
            log.info("job %r restarted on this node: its call numbers are its own again", job)
        self.aligned.discard(job)

    def align(self, key: str, waiting: Sequence[Any]) -> int:
        """A joiner's first rounds: by how much to shift the call numbers of its ``waiting`` rounds
        of the job so that its lowest is the one the leader started (0: none)."""
        parsed = wire.split_key(key)
        if self.join_epoch is None or parsed is None or parsed[0] in self.aligned:
            return 0
        job, seq = parsed
        if any(r.key == key for r in waiting):
            self.aligned.add(job)
            return 0
        mine = sorted(r.seq for r in waiting if r.job == job)
        if not mine:
            return 0
        delta = seq - mine[0]
        self.offsets[job] = self.offsets.get(job, 0) + delta
        self.aligned.add(job)
        log.info("joined the ring: job %r call numbers shifted by %+d to the cluster's (call %d is round %s)",
                 job, delta, mine[0], key)
        return delta

    def overtaken(self, key: str, leader: int, waiting: Sequence[Any], running: str | None) -> list[Overtaken]:
        """The leader started round ``key``: every earlier round of its job is over at the leader (it
        starts a job's rounds in call order, and a round it completed had every member in it). One
        still held here failed elsewhere while this node waited to run it again: a member was lost
        while the ``go`` travelled, so the nodes the go had passed failed the round in the data
        phase and the nodes still waiting for it gave the agreement up to retry, a retry no leader
        starts. Fail it now, not after round_timeout: the job's process here gets its error (the
        same round failed on the other nodes) and submits the round the leader started."""
        if self.epoch == 0 or self.rank not in self.members:
            # not a member of an epoch yet (a daemon just restarted): the start may be one queued for
            # its previous life, delivered when the connection came back, and its call numbers are
            # not the leader's until it joins
            return []
        parsed = wire.split_key(key)
        if parsed is None or (self.join_epoch is not None and parsed[0] not in self.aligned):
            return []  # a joiner's call numbers are not the cluster's until align aligns them
        job, seq = parsed
        return [Overtaken(r.key, RoundAborted(
            f"round {r.key} will not run: the leader rank {leader} has gone on to round {key} of the job (it "
            f"failed on the nodes it reached, e.g. a member was lost while it started, or this node's "
            f"processes number their calls behind the cluster's, e.g. one restarted alone)"))
            for r in waiting if r.job == job and r.seq < seq]

    def waiting_for_start(self, key: str, leader: int) -> None:
        """This node waits for a ``start`` (of round ``key``, its first waiting) and messages from its left member were lost: the start may
        have been among them, and the leader would wait round_timeout for it to come back round.
        Ask the leader to start the round again instead (an abort with ``retry``: no call fails; if
        nothing of the round was lost, it costs one more agreement)."""
        if self.rank not in self.members or len(self.members) < 2:
            return
        prev = self.members[self.members.index(self.rank) - 1]
        gap = self.net.take_gap_from(prev)
        if not gap:
            return
        log.warning("round %s: %s; asking the leader rank %d to start it again", key, gap, leader)
        try:
            self.net.send(Abort(key, f"rank {self.rank}: {gap}", retry=True).header(), to=leader)
        except PeerLostError:
            pass  # the leader is not reachable: its loss is handled as such

