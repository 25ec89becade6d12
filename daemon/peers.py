"""The peer net: a node's sockets to the other nodes, and what it knows of them.

:class:`PeerNet` owns the sockets and the poll loop, accepts connections, keeps liveness and the
lane's early data. Its parts, by concern, are their own modules: the sockets and frames
(links.py), the handshake's checks, duplicate claims and held messages (handshake.py), liveness
(liveness.py), the numbering of messages and its gaps (numbering.py), the lane's early data
(lane.py) and the round transport a ring algorithm sees (transport.py). One PeerNet serves both rings: where they differ (which ranks it links to, whose
pings it accepts, what pings carry, who counts lost) it asks its membership (membership.py).

Each daemon binds one ROUTER socket on its hosts-file address (its left neighbour connects there)
and connects one DEALER socket to its right neighbour (elastic mode: one to every node). Everything
a ring algorithm sends goes out on a DEALER; everything it receives comes in on the ROUTER. Only
this module's owner thread (the ring worker) touches these sockets.

Message types (header field ``t``): the table in :mod:`birdnet.messages`, with the record each
becomes as it is received here (:func:`~birdnet.messages.peer_record`: a message whose fields fail
its record's checks is dropped and counted, ``malformed``); the frame layout in :mod:`birdnet.wire`.
``ping`` is the heartbeat and the handshake: protocol, cluster-wide settings, world, rank,
incarnation and the ranks the sender believes lost, sent every ``heartbeat_interval``; the receiver
checks it (handshake.py) and answers ``pong`` or ``refuse``; messages from a DEALER identity that
has not passed the check are held until it does (handshake.HeldMessages).

Liveness (who is heard, lost, restarted): liveness.py.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq
from birdnet.daemon import settle
from birdnet.daemon.elastic import ElasticRing
from birdnet.daemon.handshake import (
    HELD_MAX_MESSAGES,
    DuplicateClaims,
    HeldMessages,
    dealer_identity,
)
from birdnet.daemon.heartbeat import Heartbeats
from birdnet.daemon.lane import EarlyLaneData
from birdnet.daemon.links import peer_socket, reconnect_ivl_max, recv_frames, resolve_host, send_frames
from birdnet.daemon.liveness import PeerLiveness
from birdnet.daemon.membership import FixedRing, LaneGivenUp, RingNeighbours
from birdnet.daemon.numbering import Numbering, lost_between
from birdnet.daemon.transport import RoundTransport
from zmq import zmq_poll

from birdnet import wire
from birdnet.config import Settings
from birdnet.errors import ConfigError, PeerLostError, ProtocolError, RoundAborted
from birdnet.hosts import Peer
from birdnet.messages import Data, LaneClose, peer_record
from birdnet.osutil import release_freed_memory

#: what other modules and tests import from here (the module was one file before the split)
__all__ = ["HELD_MAX_MESSAGES", "LaneGivenUp", "PeerNet", "RingNeighbours", "RoundAborted", "RoundTransport",
           "lost_between", "membership_for"]

log = logging.getLogger("birdnet.peers")

#: how often (s) a round's data phase polls every socket, not only the peer sockets (PeerNet.data_poller)
DATA_FULL_POLL_INTERVAL = 0.1


def membership_for(settings: Settings, rank: int, world: int) -> FixedRing | ElasticRing:
    """The membership strategy the settings ask for (``elastic``: an elastic ring)."""
    return ElasticRing(settings, rank, world) if settings.elastic else FixedRing(settings, rank, world)


class PeerNet(Heartbeats):
    """The sockets of a ring node plus liveness bookkeeping, for both rings: which ranks it links
    to, whose pings it accepts, what its pings carry and how it counts peers lost is its
    ``membership`` (daemon/membership.py; by default the one the settings ask for), shared with the
    ring worker."""

    def __init__(self, ctx: zmq.Context, settings: Settings, peers: list[Peer], rank: int,
                 curve: Any = None, wake: zmq.Socket | None = None,
                 membership: FixedRing | ElasticRing | None = None) -> None:
        self.settings, self.peers, self.rank = settings, peers, rank
        self.world = len(peers)
        self.membership = membership_for(settings, rank, self.world) if membership is None else membership
        self.membership.bind(self)
        #: what a peer may send besides pings (anything else is dropped and logged)
        self.message_types = self.membership.message_types
        self.left = peers[(rank - 1) % self.world]
        self.right = peers[(rank + 1) % self.world]
        self.incarnation = f"{os.getpid()}-{time.time_ns() % 10**9}"
        self.cluster_wide = settings.cluster_wide()
        self.bytes_sent = 0
        self.bytes_received = 0
        #: accepted DEALER identity -> rank, and back (the fixed ring accepts its left neighbour only)
        self.identities: dict[bytes, int] = {}
        self.identity_of: dict[int, bytes] = {}
        self.info: dict[int, dict[str, Any]] = {}  #: rank -> {"ep", "inc", "want"} from its pings/pongs
        self.refused: dict[int, str] = {}  #: rank -> why it refused this node's pings
        self.last_ping = 0.0
        #: a gap between two pings longer than this is a stall of this node (maybe_ping): half of
        #: peer_timeout, before the others can count it lost
        self.stall_limit = max(settings.peer_timeout / 2, 4 * settings.heartbeat_interval)
        self.stalled_at = 0.0  #: monotonic time the last stall ended (0: none)
        self.stalled_for = 0.0  #: how long it lasted (s)
        self.dropped = 0
        #: messages dropped because a field of theirs failed their record's checks (messages.peer_record)
        self.malformed = 0
        #: messages from connections not accepted yet, until their first ping (handshake.py)
        self.held = HeldMessages(settings.peer_timeout, self._drop)
        #: round key -> the highest ``commit`` count from the left not yet taken by its round
        #: (RoundTransport.await_commit); bounded by transport.MAX_COMMITS_KEPT
        self.commits: dict[str, int] = {}
        #: what this node tells a node that settles a round with it (daemon/settle.py): the rounds it
        #: released, aborted or holds, and the commit counts above
        self.settle_book = settle.SettleBook(rank, self.world, lambda k: self.commits.get(k, 0))
        #: (rank, header) of the last commit counts sent, sent again after a queue drop (_count_ping)
        self.recent_commits: deque[tuple[int, dict[str, Any]]] = deque(maxlen=4)
        #: identities of connections replaced by a newer one (an earlier incarnation): dropped, not held
        self._replaced: deque[bytes] = deque(maxlen=16)
        #: two live daemons claiming one rank: both refused (handshake.py)
        self.claims = DuplicateClaims(settings.peer_timeout, lambda r: self.peers[r].address)
        #: when each peer was last heard, restarts, lost ranks (liveness.py)
        self.live = PeerLiveness(peers, rank, settings.peer_timeout, self.claims.duplicates)
        self.seen = self.live.seen
        self.stopping = False  #: set by the ring worker on shutdown: rounds stop waiting for data
        #: every message is numbered per destination; gaps per sender (numbering.py)
        self.numbering = Numbering(settings.peer_timeout, settings.heartbeat_interval)
        #: senders whose lost messages a round has not taken yet (Numbering.gaps; empty as a rule)
        self.gaps = self.numbering.gaps
        #: lane rounds (RingWorker) whose data may come before this node runs them: a left neighbour
        #: that finished a lane round goes on to the next at once. Their messages wait here.
        self.early = EarlyLaneData(settings.max_message_bytes)
        #: the round a RoundTransport is reading (its own lane data is not put aside)
        self.reading: str | None = None
        #: called with a ``lane`` message as it arrives (the ring worker closes its lane, passes it on)
        self.on_lane: Any = None
        self.router = peer_socket(ctx, zmq.ROUTER, settings)
        self.curve = curve
        if curve is not None:
            curve.configure_server(self.router)
        #: a DEALER per rank this node sends to (the first, ``dealer``, is the right neighbour's)
        self.dealers: dict[int, zmq.Socket] = {}
        for r in self.membership.dealer_ranks(self):
            d = peer_socket(ctx, zmq.DEALER, settings)
            if curve is not None:
                curve.configure_client(d, peers[r])
            d.setsockopt(zmq.IDENTITY, dealer_identity(rank, self.incarnation))
            d.setsockopt(zmq.RECONNECT_IVL, 100)
            d.setsockopt(zmq.RECONNECT_IVL_MAX, reconnect_ivl_max(settings))
            self.dealers[r] = d
        self.dealer = self.dealers[self.right.rank]
        # Handshake failures (a CURVE key refused, CURVE on one side only) never reach the
        # application as messages; the socket monitors turn them into a reason we can report.
        failed = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self.dealer_monitor = self.dealer.get_monitor_socket(failed | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        # and disconnections: a connection that ends may leave malloc holding what libzmq kept of
        # it (a multipart message without end: everything it sent, docs/security.md)
        self.router_monitor = self.router.get_monitor_socket(failed | zmq.EVENT_DISCONNECTED)
        self._trim_at = 0.0  #: when to hand freed memory back to the kernel (0: nothing to do)
        self.handshake_failures = 0
        me = peers[rank]
        host = resolve_host(me.host)
        host = f"[{host}]" if ":" in host else host
        self._bind_router(f"tcp://{host}:{me.port}")
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        for r, d in self.dealers.items():
            d.connect(peers[r].endpoint())
            self.poller.register(d, zmq.POLLIN)
        self.poller.register(self.dealer_monitor, zmq.POLLIN)
        self.poller.register(self.router_monitor, zmq.POLLIN)
        # The service thread pokes ``wake`` when it hands over a round, so a waiting poll returns
        # at once instead of at its next timeout.
        self.wake = wake
        if wake is not None:
            self.poller.register(wake, zmq.POLLIN)
        # What a round's data phase waits on: the ROUTER, its data. zmq_poll asks every ZeroMQ
        # socket in it for its events, each a poll() and a getpid() system call in libzmq, before
        # and after it sleeps: with all five sockets that was ~26 system calls per received message
        # on the ring thread (perf trace, 4 nodes, 11.7M float32), 6 with the ROUTER alone. The
        # DEALERs (pongs: the right neighbour's liveness), the monitors and the service's wake-up
        # are looked at every DATA_FULL_POLL_INTERVAL in a data phase (see _poll_once).
        self.data_poller = zmq.Poller()
        self.data_poller.register(self.router, zmq.POLLIN)
        self._full_poll_at = 0.0  #: when a data phase's poll next includes every socket
        self._router_in = [(self.router, zmq.POLLIN)]  #: zmq.zmq_poll's list for the ROUTER alone

    def _bind_router(self, endpoint: str) -> None:
        """Listen on this node's hosts-file address; a port that cannot be bound is a ConfigError
        naming the address and the fix, not a ZMQError traceback."""
        try:
            self.router.bind(endpoint)
        except zmq.ZMQError as exc:
            me = self.peers[self.rank]
            self.close()
            if exc.errno == zmq.EADDRINUSE:
                why = "another process listens there (another birdnetd?): stop it, or give this node another port"
            else:
                why = ("it is not an address of this machine: check the hosts file and --rank "
                       f"(this node is rank {self.rank})")
            raise ConfigError(f"cannot listen for peers on {me.address} (rank {self.rank} of the hosts file, "
                              f"port {me.port}): {exc.strerror}; {why}") from None

    def close(self) -> None:
        for d in self.dealers.values():
            if d is not self.dealer:
                d.close(0)
        for sock, mon in ((self.router, self.router_monitor), (self.dealer, self.dealer_monitor)):
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close(0)
            sock.close(0)

    # -- who is accepted ---------------------------------------------------------------------------
    @property
    def left_identity(self) -> bytes | None:
        """The DEALER identity accepted as the left neighbour's (its first ping passed the checks)."""
        return self.identity_of.get(self.left.rank)

    @left_identity.setter
    def left_identity(self, identity: bytes | None) -> None:
        old = self.identity_of.pop(self.left.rank, None)
        if old is not None:
            self.identities.pop(old, None)
        if identity is not None:
            self.identity_of[self.left.rank] = identity
            self.identities[identity] = self.left.rank

    @property
    def refused_by_right(self) -> str | None:
        """Why the right neighbour refuses this node (its refusal, or a failed CURVE handshake)."""
        return self.refused.get(self.right.rank)

    @refused_by_right.setter
    def refused_by_right(self, reason: str | None) -> None:
        if reason is None:
            self.refused.pop(self.right.rank, None)
        else:
            self.refused[self.right.rank] = reason

    @property
    def sent_q(self) -> int:
        """The number of the last message to the right neighbour."""
        return self.numbering.sent_q_to.get(self.right.rank, 0)

    @property
    def sent_q_to(self) -> dict[int, int]:
        return self.numbering.sent_q_to

    @property
    def messages_lost(self) -> int:
        """Messages from peers lost on TCP connections that broke, for status."""
        return self.numbering.messages_lost

    @property
    def duplicates(self) -> dict[int, str]:
        """rank -> why its connections are refused (two live daemons claim it)."""
        return self.claims.duplicates

    # -- liveness (liveness.py) --------------------------------------------------------------------
    @property
    def neighbour_restarts(self) -> int:
        """Restarts of peers seen so far (PeerLiveness.neighbour_restarts)."""
        return self.live.neighbour_restarts

    def lost(self) -> set[int]:
        """Ranks believed lost: this node's own observations (membership.silent), plus on the fixed
        ring what the left neighbour reports."""
        return self.live.update_lost(self.membership.silent(self, time.monotonic()))

    def heard(self, r: int, now: float | None = None) -> bool:
        return self.live.heard(r, now)

    def presumed(self, r: int, now: float | None = None) -> bool:
        return self.live.presumed(r, now)

    def alive(self) -> set[int]:
        return self.live.alive()

    def gone(self, ring: list[int], since: int, now: float | None = None) -> str | None:
        return self.live.gone(ring, since, self.describe_lost, now)

    def restarted_since(self, since: int) -> str | None:
        return self.live.restarted_since(since)

    def describe_lost(self, lost: set[int]) -> str:
        return self.membership.describe_lost(self, lost)

    def peer_states(self) -> list[dict[str, Any]]:
        return self.membership.peer_states(self)

    def handshaken(self, rank: int) -> bool:
        """Whether the neighbour ``rank`` passed a real handshake: the left one's ping was accepted, the
        right one answered ours with a pong (before that a peer is "connecting", even within peer_timeout
        of the start, when it is not counted lost yet)."""
        ok = True
        if rank == self.left.rank:
            ok = self.left_identity is not None and self.live.left_seen > 0
        if rank == self.right.rank:
            ok = ok and self.live.right_seen > 0
        return ok

    # -- sending ---------------------------------------------------------------------------------
    def send(self, header: dict[str, Any], buffers: Sequence[Any] = (), track: bool = False,
             to: int | None = None):
        """Queue a message for rank ``to`` (default: the hosts-file right neighbour). Buffers go out
        without copying; with ``track`` the returned MessageTracker tells when ZeroMQ no longer needs
        them."""
        to = self.right.rank if to is None else to
        numbering = self.numbering
        # the next number, as Numbering.fields and .sent give it, inline while no queue was dropped
        # (every message of a round comes here)
        plain = not numbering.renumber
        if plain:
            q = numbering.sent_q_to.get(to, 0) + 1
            frames = wire.encode(header, buffers, q=q)
        else:
            numbers = numbering.fields(to)
            frames = wire.encode(header, buffers, **numbers)
        try:
            # NOBLOCK: without a connection (the peer refused us, or never came) a blocking send
            # would stall this thread for good; ZeroMQ queues while a connection exists.
            nbytes = sum(map(len, frames))  # frames_nbytes, inline
            tracker = send_frames(self.dealers[to], frames, track, nbytes)
        except zmq.Again:
            raise PeerLostError(
                f"cannot send to {self.membership.describe_peer(self, to, 'right')}: not connected"
                + (f" [{self.refused[to]}]" if to in self.refused else "")) from None
        if plain:
            numbering.sent_q_to[to] = q
        else:
            numbering.sent(to, numbers)
        self.bytes_sent += nbytes
        return tracker

    # -- receiving -------------------------------------------------------------------------------
    @property
    def lane_keys(self) -> tuple[str, ...]:
        return self.early.keys

    def set_lane_keys(self, keys: tuple[str, ...]) -> None:
        """Lane rounds whose early data is kept from now on (EarlyLaneData.set_keys)."""
        self.early.set_keys(keys)

    def has_early(self, key: str) -> bool:
        return self.early.has(key)

    def take_early(self, key: str) -> dict | None:
        return self.early.take(key)

    def poll(self, timeout: float, data: bool = False) -> dict | None:
        """Wait up to ``timeout`` s for one message that matters to the caller (start, go, abort,
        data, lane, commit) and return ``{"h": header, "b": buffers, "r": its record, "from": rank}``
        (the record: birdnet.messages, checked once where it was received); pings, pongs and garbage
        are handled here, and a lane round's data that came before this node runs the round is kept
        for it.
        ``data``: the caller is a round's data phase (RoundTransport), which waits on the peer
        sockets only and looks at the socket monitors and the service's wake-up less often."""
        now = time.monotonic()
        if (data and now < self._full_poll_at and now - self.last_ping < self.settings.heartbeat_interval
                and not self._trim_at and not self.held.ready):
            # A data phase between its polls of every socket, with no ping due: the ROUTER
            # alone, and None after one message that is nothing for the caller or at the next
            # whole poll (the callers loop until their deadline). zmq_poll (not zmq.Poller's
            # Python) returns at once when a message is there; a read that finds none would
            # raise zmq.Again (three Python calls in pyzmq's error classes), and ZMQ_EVENTS is
            # asked through its option enum (two). A data message costs a handful of calls here.
            wait = min(timeout, self._full_poll_at - now)
            if not zmq_poll(self._router_in, math.ceil(max(0.0, wait) * 1000)):
                return None
            try:
                msg = self._recv_router(recv_frames(self.router))
            except zmq.Again:
                return None
            if msg is None:
                if not self.held.ready:
                    return None
                msg = self.held.ready.popleft()
        else:
            msg = self._poll_once(timeout, data)
            if msg is None:
                return None
        rec = msg["r"]
        if type(rec) is Data and rec.lane:
            if rec.key != self.reading:
                why = self.early.keep(rec.key, msg)
                if why:
                    self._drop(why)
                # Return rather than wait on: the same poll may have taken the service thread's
                # wake-up (a round handed over), which the caller must see now, not a poll later.
                return None
        elif type(rec) is LaneClose and self.on_lane is not None:
            self.on_lane(rec)
        return msg

    def _poll_once(self, timeout: float, data: bool = False) -> dict | None:
        deadline = time.monotonic() + timeout
        while True:
            poller = self.poller
            wait = self.settings.heartbeat_interval
            if data:
                # a data phase polls every socket once per DATA_FULL_POLL_INTERVAL (and waits on the
                # ROUTER alone no longer than that): a pong or a monitor's event (a handshake
                # failure, a disconnection) waits that long at most, against heartbeat_interval
                # (0.5 s by default) and peer_timeout; the service's wake-up (a round handed over)
                # is for after the round anyway
                now = time.monotonic()
                if now < self._full_poll_at:
                    poller, wait = self.data_poller, min(wait, self._full_poll_at - now)
                else:
                    self._full_poll_at = now + DATA_FULL_POLL_INTERVAL
            self.maybe_ping()
            if self._trim_at and time.monotonic() >= self._trim_at:
                self._trim_at = 0.0
                release_freed_memory()
            if self.held.ready:
                return self.held.ready.popleft()
            remaining = deadline - time.monotonic()
            # whole milliseconds, rounded up: pyzmq truncates a float timeout, so the last
            # millisecond before the deadline was a loop of polls that return at once (an idle
            # wait of the ring thread, on every node while the training processes compute)
            events = dict(poller.poll(math.ceil(max(0.0, min(remaining, wait)) * 1000)))
            if self.dealer_monitor in events or self.router_monitor in events:
                self._drain_monitors()
            self._drain_replies(events)
            if self.wake is not None and self.wake in events:
                while True:
                    try:
                        self.wake.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                if self.router not in events:
                    return None
            if self.router in events:
                msg = self._recv_router()
                if msg is not None:
                    return msg
                if self.held.ready:
                    return self.held.ready.popleft()
            if time.monotonic() >= deadline:
                return None

    def _decode_router(self, frames: list[Any] | None = None) -> tuple[bytes, dict[str, Any], list[memoryview], Any, Any] | None:
        """The next message on the ROUTER (or ``frames``, one read already) as (identity, header,
        buffers, header frame, record); None when there is none, or it was a ping (answered here) or
        garbage (dropped, the sender told; a header whose fields fail its record's checks is dropped
        and counted in ``malformed``)."""
        if frames is None:
            try:
                frames = recv_frames(self.router)
            except zmq.Again:
                return None
        if len(frames) < 1:
            return None
        identity = frames[0].bytes
        try:
            header, bufs = wire.decode(frames[1:], max_bytes=self.settings.max_message_bytes)
            wire.check_peer(header, self.world)
        except ProtocolError as exc:
            self._drop(f"from {identity[:40]!r}: {exc}")
            if identity and frames[1:2] and frames[1].bytes.startswith(b"birdnet/"):
                self._reply(identity, {"t": "refuse", "reason": str(exc)})
            return None
        # buffers are byte-cast (len: bytes), as is a frame (no generator frames per message)
        self.bytes_received += sum(map(len, bufs)) + len(frames[1])
        # the next number in order from an accepted sender is noted here; anything else (a gap, a
        # restart of the numbering, no number) goes through Numbering.received
        q_from = self.numbering.q_from
        r = self.identities.get(identity)
        q = header.get("q")
        last = q_from.get(r) if r is not None else None
        if type(q) is int and last is not None and q == last + 1 and "qr" not in header:
            q_from[r] = q
        else:
            self._check_numbering(identity, header)
        t = header["t"]
        if t == "ping":
            self._handle_ping(identity, header, frames[1])
            return None
        if t == "settle":
            # settlement hook (daemon/settle.py): any node of the ring may ask, on a connection of its
            # own that never pings, so the question is answered here, before acceptance
            settle.answer(self, identity, header, self._peer_of_connection(frames[1]) if self.curve is not None else None)
            return None
        if t not in self.message_types:
            self._drop(f"unknown message type {t!r} from {identity[:40]!r}")
            return None
        rec = peer_record(header)
        if rec is None:
            self.malformed += 1
            self._drop(f"malformed {t!r} message from {identity[:40]!r} ({self.malformed} malformed so far)")
            return None
        return identity, header, bufs, frames[1], rec

    def _check_numbering(self, identity: bytes, header: dict[str, Any]) -> None:
        """Notice messages from an accepted sender that never arrived (see ``sent_q_to``)."""
        r = self.identities.get(identity)
        if r is None:
            return  # not accepted yet: its first ping starts its numbering (_handle_ping)
        gap = self.numbering.received(r, header, lambda: self.membership.describe_peer(self, r, "left"))
        if gap:
            log.warning("%s", gap)

    def messages_lost_by_peer(self) -> list[tuple[Peer, int]]:
        """Messages lost per sending peer, for metrics (the fixed ring's only sender is the left neighbour)."""
        lost = self.numbering.lost_from
        return [(self.peers[r], lost.get(r, 0)) for r in sorted(self.membership.senders(self))]

    def take_gap_from(self, r: int) -> str | None:
        """Why a wait for rank ``r`` must give up (messages from it were lost since the last wait for
        it), once; else None."""
        return self.numbering.take_gap(r)

    def take_gap(self) -> str | None:
        """Why the caller's round must fail (messages from the left neighbour were lost since the last
        call), once; None when nothing was lost. The lost messages belong to the round in flight or to
        one this node has not begun (rounds pass a link in order), so the first round to wait for the
        left neighbour after a gap takes it: at worst one call fails that could have completed (a lost
        control message of another round), where without it a round waited for its timeout."""
        gap = self.take_gap_from(self.left.rank)
        return f"{gap}; this call failed, the next one runs afresh" if gap else None

    def _recv_router(self, frames: list[Any] | None = None) -> dict | None:
        got = self._decode_router(frames)
        if got is None:
            return None
        identity, header, bufs, first, rec = got
        r = self.identities.get(identity)
        if r is None:
            self._not_accepted(identity, header, bufs, first, "the peer", rec)
            return None
        self.seen[r] = time.monotonic()
        if r == self.left.rank:
            self.live.left_seen = self.seen[r]
        return {"h": header, "b": bufs, "from": r, "r": rec}

    def _not_accepted(self, identity: bytes, header: dict[str, Any], bufs: list[memoryview], first: Any,
                      whose: str, rec: Any) -> None:
        """A message from a connection not accepted (yet): dropped if it is an earlier incarnation of
        ``whose``, else held until its first ping (a queue that overtook the handshake)."""
        if identity in self._replaced:
            self._drop(f"{header['t']!r} message from {identity[:40]!r}, an earlier incarnation of {whose}")
        else:
            who = self._peer_of_connection(first) if self.curve is not None else None
            self.held.hold(identity, who, {"h": header, "b": bufs, "r": rec},
                           len(first.bytes) + sum(b.nbytes for b in bufs))

    def _drop(self, why: str) -> None:
        self.dropped += 1
        if self.dropped <= 20 or self.dropped % 1000 == 0:
            log.warning("dropped message %s (%d dropped so far)", why, self.dropped)
