"""Elastic mode (``birdnetd --elastic``): the ring goes on without a lost node.

Size (about 700 lines): ElasticPeerNet and ElasticRingWorker still subclass PeerNet and RingWorker
(membership, leader choice, admission and their own start/go waits); the round transport, the batch
runner, the verdicts and the handshake checks are the base classes'. Turning membership into a
strategy of one engine (issue 23) would leave this module the membership rules alone.

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

import zmq
from birdnet.daemon.engine import MAX_BATCH, LocalRound, RingWorker
from birdnet.daemon.peers import (
    PeerNet,
    RingNeighbours,
    RoundAborted,
    RoundTransport,
    frames_nbytes,
    lost_between,
    lost_text,
    peer_socket,
    reconnect_ivl_max,
    send_frames,
)

from birdnet import PROTOCOL_VERSION, wire
from birdnet.errors import (
    BirdnetError,
    InputError,
    PeerLostError,
    ProtocolError,
    RoundTimeoutError,
    ShutdownError,
)
from birdnet.messages import Abort, Membership, extend_batch, is_int, verdicts_of_go

log = logging.getLogger("birdnet.elastic")


class _Retry(Exception):
    """The round agreement was abandoned because a member of the proposed ring was lost (or the
    leader started the same round again): the round stays waiting and is started again on the
    re-formed ring instead of failing."""


class ElasticPeerNet(PeerNet):
    """PeerNet with a DEALER to every node, direct liveness of every node, and messages tagged with
    the sending rank (``msg["from"]``) instead of being accepted from the left neighbour only."""

    MESSAGE_TYPES = ("start", "go", "abort", "data")  # no dense lane in elastic mode

    def __init__(self, ctx: zmq.Context, settings, peers, rank: int, curve: Any = None,
                 wake: zmq.Socket | None = None) -> None:
        super().__init__(ctx, settings, peers, rank, curve=curve, wake=wake)
        self.dealers: dict[int, zmq.Socket] = {self.right.rank: self.dealer}
        for p in peers:
            if p.rank in self.dealers or p.rank == rank:
                continue
            d = peer_socket(ctx, zmq.DEALER, settings)
            if curve is not None:
                curve.configure_client(d, p)
            d.setsockopt(zmq.IDENTITY, f"r{rank}-{self.incarnation}".encode())
            d.setsockopt(zmq.RECONNECT_IVL, 100)
            d.setsockopt(zmq.RECONNECT_IVL_MAX, reconnect_ivl_max(settings))
            d.connect(p.endpoint())
            self.poller.register(d, zmq.POLLIN)
            self.dealers[p.rank] = d
        self.seen = [0.0] * self.world  #: monotonic time of the last ping, pong or message per rank
        self.info: dict[int, dict[str, Any]] = {}  #: rank -> {"ep", "inc", "want"} from its pings/pongs
        self.identities: dict[bytes, int] = {}  #: accepted DEALER identity -> rank
        self.identity_of: dict[int, bytes] = {}
        #: rank -> neighbour_restarts right after its latest restart was seen (a new identity)
        self.restart_seq: dict[int, int] = {}
        # advertised in pings, written by the ring worker
        self.epoch = 0
        self.want = False
        self.members: list[int] = list(range(self.world))
        self.refused: dict[int, str] = {}
        #: Every message is numbered per destination, as on the fixed ring (PeerNet.sent_q): the
        #: connection from each node is checked on its own, and a jump is kept per sending rank until
        #: a wait for that rank takes it (take_gap_from). Without it a lost ``start`` left the leader
        #: waiting round_timeout for it to come back round the ring.
        self.sent_q_to: dict[int, int] = {}
        self._q_from: dict[int, int | None] = {}
        self._gaps: dict[int, str] = {}
        self.lost_from: dict[int, int] = {}  #: messages lost per sending rank, for metrics

    def close(self) -> None:
        for d in self.dealers.values():
            if d is not self.dealer:
                d.close(0)
        super().close()

    # -- liveness --------------------------------------------------------------------------------
    def heard(self, r: int, now: float | None = None) -> bool:
        """Something from rank ``r`` arrived within peer_timeout (no grace after start-up)."""
        if r == self.rank:
            return True
        if r in self.duplicates:
            return False  # two daemons claim it (its pongs still come, from the one we dial)
        now = time.monotonic() if now is None else now
        return self.seen[r] > 0 and now - self.seen[r] <= self.settings.peer_timeout

    def presumed(self, r: int, now: float | None = None) -> bool:
        """Rank ``r`` is not (yet) counted lost: heard within peer_timeout, or this daemon started
        less than peer_timeout ago."""
        if r == self.rank:
            return True
        if r in self.duplicates:
            return False
        now = time.monotonic() if now is None else now
        return now - max(self.seen[r], self.started) <= self.settings.peer_timeout

    def alive(self) -> set[int]:
        now = time.monotonic()
        return {r for r in range(self.world) if self.heard(r, now)}

    def gone(self, ring: list[int], since: int, now: float | None = None) -> str | None:
        """Why a round on ``ring`` that began when neighbour_restarts was ``since`` cannot go on:
        members counted lost, or restarted since (their new instance knows nothing of the round),
        else None."""
        now = time.monotonic() if now is None else now
        lost = {r for r in ring if not self.presumed(r, now)}
        back = [r for r in ring if self.restart_seq.get(r, 0) > since]
        if not lost and not back:
            return None
        why = [f"lost peer {self.describe_lost(lost)}"] if lost else []
        why += [f"rank {r} ({self.peers[r].address}) restarted" for r in back]
        return "; ".join(why)

    def lost(self) -> set[int]:
        now = time.monotonic()
        own = {r for r in range(self.world) if not self.presumed(r, now)}
        if own != self.own_lost:
            for r in sorted(own - self.own_lost):
                log.warning("peer rank %d (%s) lost: nothing heard for %.1f s", r, self.peers[r].address,
                            self.settings.peer_timeout)
            for r in sorted(self.own_lost - own):
                log.info("peer rank %d (%s) is back", r, self.peers[r].address)
            self.own_lost = own
        return set(own)

    def describe_lost(self, lost) -> str:
        text = ", ".join(f"rank {r} ({self.peers[r].address})" for r in sorted(lost))
        reasons = [f"rank {r}: {self.refused[r]}" for r in sorted(lost) if r in self.refused]
        reasons += [self.duplicates[r] for r in sorted(lost) if r in self.duplicates]
        return text + (f" [{'; '.join(reasons)}]" if reasons else "")

    def peer_states(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        out = []
        for p in self.peers:
            if p.rank == self.rank:
                state = "self"
            elif not self.heard(p.rank, now):
                state = "lost"
            elif p.rank in self.members:
                state = "ok"
            else:
                state = "joining"
            row = {"rank": p.rank, "address": p.address, "state": state}
            if p.rank in self.refused:
                row["state"], row["reason"] = "refused", self.refused[p.rank]
            if p.rank in self.duplicates:
                row["state"], row["reason"] = "refused", self.duplicates[p.rank]
            out.append(row)
        return out

    # -- sending ---------------------------------------------------------------------------------
    def send(self, header: dict[str, Any], buffers: Sequence[Any] = (), track: bool = False, to: int | None = None):
        """Queue a message for rank ``to`` (default: the hosts-file right neighbour)."""
        to = self.right.rank if to is None else to
        q = self.sent_q_to.get(to, 0) + 1
        frames = wire.encode(header, buffers, **self._numbering(to, q))
        try:
            nbytes = frames_nbytes(frames)
            tracker = send_frames(self.dealers[to], frames, track, nbytes)
        except zmq.Again:
            raise PeerLostError(f"cannot send to rank {to} ({self.peers[to].address}): not connected"
                                + (f" [{self.refused[to]}]" if to in self.refused else "")) from None
        self.sent_q_to[to] = q  # only what ZeroMQ took counts (PeerNet.send)
        self._renumber.discard(to)
        self.bytes_sent += nbytes
        return tracker

    def _check_numbering(self, identity: bytes, header: dict[str, Any]) -> None:
        r = self.identities.get(identity)
        if r is None:
            return  # not accepted yet: its first ping starts its numbering (_handle_ping)
        n, self._q_from[r] = lost_between(self._q_from.get(r), header)
        if n:
            self.messages_lost += n
            self.lost_from[r] = self.lost_from.get(r, 0) + n
            self._gaps[r] = lost_text(n, f"rank {r} ({self.peers[r].address})")
            log.warning("%s", self._gaps[r])

    def messages_lost_by_peer(self) -> list[tuple[Any, int]]:
        return [(p, self.lost_from.get(p.rank, 0)) for p in self.peers if p.rank != self.rank]

    def take_gap_from(self, r: int) -> str | None:
        """Why a wait for rank ``r`` must give up (messages from it were lost since the last wait for
        it), once; else None."""
        return self._gaps.pop(r, None)

    def _send_ping(self) -> None:
        h = {"t": "ping", "proto": PROTOCOL_VERSION, "cw": self.cluster_wide, "world": self.world,
             "rank": self.rank, "inc": self.incarnation, "lost": sorted(self.lost()), "ep": self.epoch,
             "want": self.want}
        for r, d in self.dealers.items():
            self._count_ping(r, d, self.peers[r].endpoint())
            try:
                self.send(h, to=r)
            except PeerLostError:
                pass

    # -- receiving -------------------------------------------------------------------------------
    def _drain_replies(self, events: dict) -> None:
        for r, d in self.dealers.items():
            if d in events:
                self._drain_dealer_of(r, d)

    def _drain_dealer_of(self, r: int, d: zmq.Socket) -> None:
        while True:
            try:
                frames = d.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                header, _ = wire.decode(frames, max_bytes=wire.MAX_HEADER_BYTES)
                wire.check_peer(header, self.world)
            except ProtocolError as exc:
                log.warning("dropped a bad reply from rank %d (%s): %s", r, self.peers[r].address, exc)
                continue
            if header["t"] in ("pong", "refuse"):
                self._answered(r)
            if header["t"] == "pong":
                self.seen[r] = time.monotonic()
                self._note_info(r, header)
                if r in self.refused:
                    log.info("rank %d (%s) accepted us", r, self.peers[r].address)
                    self.refused.pop(r, None)
                if r == self.right.rank:
                    self.right_seen = self.seen[r]
                    self.refused_by_right = None
            elif header["t"] == "refuse":
                reason = str(header.get("reason"))
                if reason != self.refused.get(r):
                    log.error("rank %d (%s) refused this node: %s", r, self.peers[r].address, reason)
                self.refused[r] = reason
                if r == self.right.rank:
                    self.refused_by_right = reason

    def _note_info(self, r: int, h: dict[str, Any]) -> None:
        ep = h.get("ep")
        inc = h.get("inc")
        self.info[r] = {"ep": ep if isinstance(ep, int) and not isinstance(ep, bool) and ep >= 0 else 0,
                        "inc": inc if isinstance(inc, str) else None, "want": h.get("want") is True}

    def _recv_router(self) -> dict | None:
        got = self._decode_router()
        if got is None:
            return None
        identity, header, bufs, first = got
        r = self.identities.get(identity)
        if r is None:
            self._not_accepted(identity, header, bufs, first, "a peer")
            return None
        self.seen[r] = time.monotonic()
        if r == self.left.rank:
            self.left_seen = self.seen[r]
        return {"h": header, "b": bufs, "from": r}

    def _handle_ping(self, identity: bytes, h: dict[str, Any], frame: Any = None) -> None:
        r = h.get("rank")
        who = self._peer_of_connection(frame) if self.curve is not None else None
        reason = self._ping_refusal(h, who, r, None if (is_int(r) and 0 <= r < self.world and r != self.rank) else (
            f"the peer claims rank {r!r}, which is not another rank of the {self.world}-node ring"))
        if reason is None:
            reason = self._duplicate_claim(identity, r, h.get("inc"), self.identity_of.get(r))
            if reason and r in self.identity_of:
                # neither is accepted (their messages are held, then dropped): rank r counts as
                # lost after peer_timeout and the ring goes on without it; before, the two
                # displaced each other at every heartbeat, each time as a "restart" of rank r
                self.identities.pop(self.identity_of.pop(r), None)
                self.restart_seq[r] = self.neighbour_restarts
        if reason:
            self._drop(f"ping refused ({reason})")
            self._reply(identity, {"t": "refuse", "reason": reason})
            return
        assert isinstance(r, int)
        if self.identity_of.get(r) != identity:
            old = self.identity_of.get(r)
            if old is not None:
                self.identities.pop(old, None)  # an earlier incarnation: its messages are dropped now
                self._replaced.append(old)
                # a restart: rounds in flight on a ring with r cannot complete (ElasticPeerNet.gone)
                self.neighbour_restarts += 1
                self.restart_seq[r] = self.neighbour_restarts
            log.info("rank %d (%s) connected (incarnation %s)", r, self.peers[r].address, h.get("inc"))
            self.identity_of[r] = identity
            self.identities[identity] = r
            # its numbering starts at this ping (what it sent before is held and released below)
            self._q_from[r] = lost_between(None, h)[1]
            self._gaps.pop(r, None)
            self._release_held(identity, who, {"from": r})
        self.seen[r] = time.monotonic()
        self._note_info(r, h)
        if r == self.left.rank:
            self.left_identity, self.left_seen = identity, self.seen[r]
        self._reply(identity, {"t": "pong", "rank": self.rank, "ep": self.epoch, "inc": self.incarnation,
                               "want": self.want})


class ElasticRingWorker(RingWorker):
    """The ring worker of elastic mode (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = 0
        self.members: list[int] = list(range(self.world))
        self.leader = 0
        self.member_inc: dict[int, str] = {}
        self.offsets: dict[str, int] = {}  #: job -> cluster call number - local call number
        self.join_epoch: int | None = None  #: the epoch this node was last admitted in as a joiner
        self.aligned: set[str] = set()  #: jobs aligned since then
        self.no_quorum_since: float | None = time.monotonic()
        self.applied_at = 0.0  #: when this node applied its membership epoch
        self.next_rank = (self.rank + 1) % self.world
        self.ring: list[int] = list(self.members)  #: the ring of the batch in progress

    # -- plumbing ----------------------------------------------------------------------------------
    def _take_inbox(self, timeout: float = 0.0) -> None:
        import queue
        while self.restarted_jobs:
            self._forget_job(self.restarted_jobs.pop(0))
        try:
            item = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:
                item.seq += self.offsets.get(item.job, 0)  # this node's call numbering -> the cluster's
                self.ready[item.key] = item
                self.order.append(item.key)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _abort(self, key: str, reason: str, origin: int | None = None, cls: str | None = None, *,
               retry: bool = False) -> None:
        """Tell the next live node round ``key`` failed (``retry``: start it again on the re-formed
        ring). Elastic aborts travel the round's ring, without an origin or an error class."""
        try:
            self.net.send(Abort(key, reason, retry=retry).header(), to=self.next_rank)
        except Exception:  # noqa: BLE001
            pass

    def _report(self, key: str, exc: BaseException) -> None:
        """A round failed here (RingWorker._data_phase): tell the next live node (elastic aborts
        carry a reason and no origin)."""
        self._abort(key, f"rank {self.rank}: {exc}")

    def status(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "members": list(self.members), "leader": self.leader}

    # -- membership --------------------------------------------------------------------------------
    def _epoch_of(self, r: int) -> int:
        if r == self.rank:
            return self.epoch
        ep = int(self.net.info.get(r, {}).get("ep", -1))
        if r in self.members and time.monotonic() - self.applied_at < self.settings.peer_timeout:
            # a member of this node's epoch passed the same go; its pings say so a heartbeat later
            ep = max(ep, self.epoch)
        return ep

    def _choose_leader(self, heard: set[int]) -> int | None:
        """The leader as this node sees it: the last go's leader while it is alive and current,
        else the lowest heard rank among those with the highest heard epoch."""
        net = self.net
        if any(r not in net.info for r in heard if r != self.rank):
            return None  # a heard node whose epoch we do not know yet: wait for its ping
        top = max(self._epoch_of(r) for r in heard)
        if net.presumed(self.leader) and (self.leader not in heard or self._epoch_of(self.leader) == top):
            return self.leader
        return min(r for r in heard if self._epoch_of(r) == top)

    def _proposal(self, heard: set[int]) -> tuple[list[int], int, list[int], dict[str, str]]:
        info = self.net.info
        ring, joiners = [], []
        for r in sorted(heard):
            inc = self.net.incarnation if r == self.rank else info.get(r, {}).get("inc")
            same = r in self.members and self.member_inc.get(r) in (None, inc)
            if r == self.rank or same or info.get(r, {}).get("want"):
                ring.append(r)
                if not same and r != self.rank:
                    joiners.append(r)
        incs = {str(r): (self.net.incarnation if r == self.rank else str(info.get(r, {}).get("inc")))
                for r in ring}
        changed = ring != self.members or joiners or self.leader != self.rank or self.epoch == 0
        return ring, self.epoch + 1 if changed else self.epoch, joiners, incs

    def _apply(self, ep: int, ring: list[int], leader: int, incs: Any) -> None:
        if ep != self.epoch:
            # Every member starts the new epoch from the same (empty) codec state: bit-identical.
            dropped = len(self.runner.states.states)
            self.runner.states.states.clear()
            log.info("membership epoch %d: ring %s, leader rank %d (codec states dropped: %d)", ep, ring, leader,
                     dropped)
        self.epoch, self.members, self.leader = ep, list(ring), leader
        self.applied_at = time.monotonic()
        if isinstance(incs, dict):
            self.member_inc = {int(k): str(v) for k, v in incs.items() if str(k).isdigit()}
        self.net.epoch, self.net.members = ep, list(ring)

    # -- main loop ---------------------------------------------------------------------------------
    def _run_ring(self) -> None:
        net = self.net
        while not self.stopping:
            self._take_inbox()
            net.want = bool(self.order)
            heard = net.alive()
            now = time.monotonic()
            quorum = 2 * len(heard) > self.world
            if quorum:
                self.no_quorum_since = None
            elif self.no_quorum_since is None:
                self.no_quorum_since = now
            if not quorum and now - self.no_quorum_since > self.settings.peer_timeout:
                lost = net.lost() or set(range(self.world)) - heard
                for key in list(self.order):
                    self._finish(self.ready[key], PeerLostError(
                        f"lost peer {net.describe_lost(lost)}: elastic mode needs a majority of the "
                        f"{self.world} nodes live, {len(heard)} are; round {key} cannot run"))
            leader = self._choose_leader(heard) if quorum else None
            if (leader == self.rank and self.order
                    and all(self._epoch_of(r) <= self.epoch for r in heard)):
                rnd = self.ready[self.order[0]]
                try:
                    self._lead(rnd, heard)
                except Exception as exc:  # noqa: BLE001
                    log.exception("round %s failed inside the leader", rnd.key)
                    if rnd.key in self.ready:
                        self._finish(rnd, InputError(f"round {rnd.key} failed inside the daemon: {exc!r}"))
                continue
            if leader != self.rank:
                self._expire_unstarted()
            msg = self.pending_start or net.poll(0.05)
            self.pending_start = None
            if msg is not None and msg["h"].get("t") == "start" and msg["h"].get("L") != self.rank:
                self._follow_guarded(self._follow_elastic, msg, msg["h"].get("k"))
            elif leader is not None and leader != self.rank and self.order:
                self._restart_if_start_lost(leader)

    def _wait_elastic(self, want: str, key: str, deadline: float, ring: list[int], prev: int, since: int) -> dict:
        net = self.net
        while True:
            self._take_inbox()
            why = net.gone(ring, since)
            if why:
                raise PeerLostError(f"{why} while round {key} was starting")
            if self.stopping:
                raise ShutdownError("the daemon is shutting down")
            if time.monotonic() > deadline:
                raise RoundTimeoutError(f"round {key} did not start on every node within "
                                        f"round_timeout={self.settings.round_timeout} s")
            self._check_gap_from(prev, key, want)
            msg = net.poll(0.05)
            if msg is None or msg.get("from") not in ring:
                continue
            h = msg["h"]
            a = Abort.from_header(h) if h.get("t") == "abort" else None
            if a is not None and a.key == key:
                if a.retry:
                    raise _Retry(a.reason)
                raise RoundAborted(a.reason)
            if msg["from"] != prev:
                continue
            if h.get("t") == want and h.get("k") == key:
                self._check_gap_from(prev, key, want)  # what was lost may have been this round's
                return h
            if h.get("t") == "start" and want == "go" and h.get("L") != self.rank:
                self.pending_start = msg  # the leader started again (this round or a newer one)
                raise _Retry(f"round {key} was started again by the leader")

    def _restart_if_start_lost(self, leader: int) -> None:
        """This node waits for a ``start`` and messages from its left member were lost: the start may
        have been among them, and the leader would wait round_timeout for it to come back round.
        Ask the leader to start the round again instead (an abort with ``retry``: no call fails; if
        nothing of the round was lost, it costs one more agreement)."""
        if self.rank not in self.members or len(self.members) < 2:
            return
        prev = self.members[self.members.index(self.rank) - 1]
        gap = self.net.take_gap_from(prev)
        if not gap:
            return
        key = self.order[0]
        log.warning("round %s: %s; asking the leader rank %d to start it again", key, gap, leader)
        try:
            self.net.send(Abort(key, f"rank {self.rank}: {gap}", retry=True).header(), to=leader)
        except PeerLostError:
            pass  # the leader is not reachable: its loss is handled as such

    def _check_gap_from(self, prev: int, key: str, want: str) -> None:
        """Messages from ``prev`` were lost (a TCP connection reset). The leader waiting for its
        ``start`` to come back starts the agreement again (a PeerLostError: the caller's retry; no
        node is in the data phase before the leader sends ``go``, so every node retries with it). A
        node waiting for ``go`` fails the round instead (RoundAborted: the caller aborts it round the
        ring without retry): the lost message may have been the ``go`` itself, and the nodes before
        this one would then be in the data phase already, where an abort fails the round; retrying
        here would leave this node waiting for a round the others have given up."""
        gap = self.net.take_gap_from(prev)
        if gap and want == "go":
            raise RoundAborted(f"round {key}: {gap}; this call failed, the next one runs afresh")
        if gap:
            raise PeerLostError(f"round {key}: {gap}")

    def _lead(self, rnd: LocalRound, heard: set[int] | None = None) -> None:
        ring, ep, joiners, incs = self._proposal(self.net.alive() if heard is None else heard)
        key = rnd.key
        if 2 * len(ring) <= self.world:
            # not enough nodes want to take part yet (restarted without their processes): wait
            self._expire_unstarted()
            self.net.poll(0.05)
            return
        pos = ring.index(self.rank)
        order = ring[pos:] + ring[:pos]
        self.ring, self.next_rank = ring, order[1]
        deadline = rnd.ready_at + self.settings.round_timeout
        since = self.net.neighbour_restarts
        extras = [k for k in self.order if k != key and self.ready[k].error is None][:MAX_BATCH - 1]
        member = Membership(ep, tuple(ring), self.rank, tuple(joiners), incs).fields()
        try:
            self.net.send({"t": "start", "k": key, **member, "descs": [[self.rank, self._own_desc(rnd)]],
                           "more": [[k, [[self.rank, self._own_desc(self.ready[k])]]] for k in extras]},
                          to=self.next_rank)
            h = self._wait_elastic("start", key, deadline, ring, order[-1], since)
            verdicts = self._verdicts_of_start(h, key, extras,
                                               lambda descs, k: self._check_ring_descs(descs, k, order))
            self.net.send({"t": "go", **member, **verdicts[0].go_fields(),
                           "more": [v.to_wire() for v in verdicts[1:]]}, to=self.next_rank)
        except (_Retry, PeerLostError) as exc:
            if isinstance(exc, RoundAborted):
                self._abort(key, f"rank {self.rank}: {exc}")
                self._finish(rnd, exc)
                return
            # a member of the proposed ring is gone: start the round again once the ring re-forms
            log.info("round %s: agreement on ring %s abandoned (%s); it will start again", key, ring, exc)
            self._abort(key, f"rank {self.rank}: {exc}", retry=True)
            self.net.poll(0.1)
            return
        except BirdnetError as exc:
            self._abort(key, f"rank {self.rank}: {exc}")
            self._finish(rnd, exc)
            return
        self._apply(ep, ring, self.rank, incs)
        self._run_batch(verdicts, since)

    def _check_ring_descs(self, descs: Any, key: str, order: list[int]) -> list[tuple[int, dict[str, Any]]]:
        if (not isinstance(descs, list) or len(descs) != len(order)
                or not all(isinstance(x, list) and len(x) == 2 and isinstance(x[1], dict) for x in descs)
                or [x[0] for x in descs] != order):
            raise ProtocolError(f"round {key}: malformed start message came back round the ring")
        return sorted(((int(r), d) for r, d in descs), key=lambda x: x[0])  # counts in ring-position order

    def _forget_job(self, job: str) -> None:
        """A job restarted on this node numbers its calls from 0, as it does on the others when the
        whole job restarted: the offset of an earlier alignment no longer applies (kept, it gave this
        node's rounds other numbers than everyone's, each waiting round_timeout). A node whose job
        alone restarted while the others went on aligns again if it is a joiner (_maybe_align)."""
        super()._forget_job(job)
        if self.offsets.pop(job, 0):
            log.info("job %r restarted on this node: its call numbers are its own again", job)
        self.aligned.discard(job)

    def _maybe_align(self, key: str) -> None:
        """A joiner's first rounds: make its lowest waiting round of the job the one the leader started."""
        parsed = wire.split_key(key)
        if self.join_epoch is None or parsed is None or parsed[0] in self.aligned:
            return
        job, seq = parsed
        if key in self.ready:
            self.aligned.add(job)
            return
        mine = sorted((self.ready[k] for k in self.order if self.ready[k].job == job), key=lambda r: r.seq)
        if not mine:
            return
        delta = seq - mine[0].seq
        for rnd in mine:
            old = rnd.key
            rnd.seq += delta
            self.ready[rnd.key] = self.ready.pop(old)
            self.order[self.order.index(old)] = rnd.key
        self.offsets[job] = self.offsets.get(job, 0) + delta
        self.aligned.add(job)
        log.info("joined the ring: job %r call numbers shifted by %+d to the cluster's (call %d is round %s)",
                 job, delta, mine[0].seq - delta, key)

    def _fail_overtaken(self, key: str, leader: int) -> None:
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
            return
        parsed = wire.split_key(key)
        if parsed is None or (self.join_epoch is not None and parsed[0] not in self.aligned):
            return  # a joiner's call numbers are not the cluster's until _maybe_align aligns them
        job, seq = parsed
        for k in [k for k in self.order if self.ready[k].job == job and self.ready[k].seq < seq]:
            self._finish(self.ready[k], RoundAborted(
                f"round {k} will not run: the leader rank {leader} has gone on to round {key} of the job (it "
                f"failed on the nodes it reached, e.g. a member was lost while it started, or this node's "
                f"processes number their calls behind the cluster's, e.g. one restarted alone)"))

    def _follow_elastic(self, msg: dict) -> None:
        h, frm = msg["h"], msg.get("from")
        key, descs = h.get("k"), h.get("descs")
        m = Membership.from_header(h, self.world)
        if (not isinstance(key, str) or not isinstance(descs, list) or m is None or self.rank not in m.ring
                or m.epoch < self.epoch or frm != m.ring[m.ring.index(self.rank) - 1]):
            log.debug("ignored a start from rank %r: %r", frm, {k: h.get(k) for k in ("k", "ep", "S", "L")})
            return
        ring, ep, leader, joiners = list(m.ring), m.epoch, m.leader, m.joiners
        pos = ring.index(self.rank)
        self.ring, self.next_rank = ring, ring[(pos + 1) % len(ring)]
        prev = ring[pos - 1]
        if self.rank in joiners and self.join_epoch != ep:
            self.join_epoch, self.aligned = ep, set()
        deadline = time.monotonic() + self.settings.round_timeout
        since = self.net.neighbour_restarts
        while True:
            self._take_inbox()  # before any wait: see RingWorker._follow
            if key in self.ready:
                break
            self._maybe_align(key)
            if key in self.ready:
                break
            self._fail_overtaken(key, leader)
            if self.stopping:
                return
            if time.monotonic() > deadline:
                descs.append([self.rank, {"error": f"the processes on node rank {self.rank} did not submit "
                                                   f"round {key} within round_timeout"}])
                self.net.send({**h, "descs": descs, "more": []}, to=self.next_rank)
                return
            why = self.net.gone(ring, since)
            if why:
                self._abort(key, why, retry=True)
                return
            gone = self._departed_before(key, self.offsets)
            if gone is not None:
                descs.append([self.rank, {"error": f"node rank {self.rank}: {gone}",
                                          "error_class": "ProcessLostError"}])
                self.net.send({**h, "descs": descs, "more": []}, to=self.next_rank)
                try:
                    g = self._wait_elastic("go", key, time.monotonic() + self.settings.pass_go_timeout, ring, prev,
                                           since)
                except (BirdnetError, _Retry):
                    return
                if self.next_rank != leader:
                    self.net.send(g, to=self.next_rank)
                return
            m = self.net.poll(0.02)
            if m is None or m.get("from") != prev:
                continue
            if m["h"].get("t") == "abort" and m["h"].get("k") == key:
                self._abort(key, str(m["h"].get("reason")), retry=m["h"].get("retry") is True)
                return
            if m["h"].get("t") == "start" and m["h"].get("k") != key:
                self.pending_start = m
                return
        rnd = self.ready[key]
        descs.append([self.rank, self._own_desc(rnd)])
        kept = extend_batch(h.get("more"), self.ready, self._own_entry)
        self.net.send({**h, "descs": descs, "more": kept}, to=self.next_rank)
        try:
            g = self._wait_elastic("go", key, rnd.ready_at + self.settings.round_wait_timeout,
                                   ring, prev, since)
        except (_Retry, PeerLostError) as exc:
            if not isinstance(exc, RoundAborted):
                self._abort(key, f"rank {self.rank}: {exc}", retry=True)
                return  # the round stays waiting for the leader's next start
            self._abort(key, f"rank {self.rank}: {exc}")
            self._finish(rnd, exc)
            return
        except BirdnetError as exc:
            self._abort(key, f"rank {self.rank}: {exc}")
            self._finish(rnd, exc)
            return
        if g.get("ep") != ep or g.get("S") != ring or g.get("L") != leader:
            exc = ProtocolError(f"round {key}: the go message does not match its start")
            self._abort(key, f"rank {self.rank}: {exc}")
            self._finish(rnd, exc)
            return
        if self.next_rank != leader:
            try:
                self.net.send(g, to=self.next_rank)
            except BirdnetError as exc:
                self._finish(rnd, exc)
                return
        self._apply(ep, ring, leader, g.get("I"))
        self._run_batch(verdicts_of_go(g, key, len(ring), self.ready), since)

    def _round_transport(self, key: str, since: int) -> RoundTransport:
        return RoundTransport(self.net, key, since, neighbours=RingNeighbours(self.net, self.ring))

    def _note_contributors(self, rnd: LocalRound, counts: list[int]) -> None:
        rnd.stats["contributors"] = [r for r, c in zip(self.ring, counts) if c > 0]
        rnd.stats["epoch"] = self.epoch
