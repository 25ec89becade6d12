"""Peer links: the ZeroMQ side of the ring.

Size (about 1,000 lines): sockets, handshake, liveness, numbering, held messages, lane early data
and the round transport are one module because PeerNet's state (the accepted identities, the
numbering, the held queue) is read by all of them on the ring thread; splitting it by concern
(links, handshake, liveness) is the next step of issue 23. One PeerNet serves both rings: where
they differ (which ranks it links to, whose pings it accepts, what pings carry, who counts lost) it
asks its membership (daemon/membership.py).

Each daemon binds one ROUTER socket on its hosts-file address (its left neighbour connects there)
and connects one DEALER socket to its right neighbour (elastic mode: one to every node). Everything
a ring algorithm sends goes out on a DEALER; everything it receives comes in on the ROUTER. Only
this module's owner thread (the ring worker) touches these sockets.

Message types (header field ``t``; frame layout in :mod:`birdnet.wire`):

==========  ==============  =======================================================================
type        direction       meaning
==========  ==============  =======================================================================
``ping``    left -> right   heartbeat *and* handshake: protocol, cluster-wide settings, world, rank,
                            incarnation, and the ranks the sender believes lost. Sent every
                            ``heartbeat_interval``. The receiver checks it and answers ``pong`` or
                            ``refuse``; messages from a DEALER identity that has not passed the
                            check are held until it does (PeerNet._hold).
``pong``    right -> left   the ping was accepted.
``refuse``  right -> left   the ping was refused; ``reason`` says what differs.
``start``   left -> right   a round: the leader (rank 0) sends it, every node appends its round
                            description when its local processes are ready and passes it on.
``go``      left -> right   the leader's verdict after the start came back (ok, or the error).
``abort``   left -> right   a node failed the round (lost peer, mismatch); passes the reason on.
``data``    left -> right   ring-algorithm messages, tagged with the round key ``k`` (and ``ln``
                            in a lane round, one started without an agreement).
``lane``    left -> right   the leader closes the dense lane before round ``k``: no node starts it
                            without an agreement; a node already in it gives it up (RingWorker).
==========  ==============  =======================================================================

Liveness: the left neighbour is alive while anything from it arrived within ``peer_timeout``; the
right neighbour while pongs arrive. A node that loses a neighbour reports it in its pings, and every
node adds what its left neighbour reports, so within a few heartbeats every node knows which peer
is lost, names it in the errors its clients see, and forgets it when it is back.
"""
from __future__ import annotations

import logging
import os
import socket as pysocket
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq
from birdnet.daemon.elastic import ElasticRing
from birdnet.daemon.membership import (  # noqa: F401 - RoundAborted, LaneGivenUp: re-exported
    FixedNeighbours,
    FixedRing,
    LaneGivenUp,
    RingNeighbours,
    RoundAborted,
)
from birdnet.daemon.rounds import Phase, Round

from birdnet import PROTOCOL_VERSION, wire
from birdnet.config import Settings
from birdnet.errors import ConfigError, PeerLostError, ProtocolError, RoundTimeoutError, ShutdownError
from birdnet.hosts import Peer
from birdnet.messages import Abort
from birdnet.osutil import release_freed_memory

log = logging.getLogger("birdnet.peers")


#: messages up to this many bytes are copied into ZeroMQ instead of sent zero-copy (see send)
COPY_BELOW = 1 << 20
#: bounds on messages held from a connection whose first ping has not arrived yet (PeerNet._hold)
HELD_MAX_MESSAGES = 64
HELD_MAX_BYTES = 16 << 20


#: replies (pong, refuse) queued at most for one connection; more are dropped (PeerNet._reply)
REPLY_HWM = 64
#: longest refusal reason sent: a ping's cluster-wide map may be 64 KiB, and every difference is named
MAX_REASON_CHARS = 2048

_NOWAIT = int(zmq.NOBLOCK)
_MORE_NOWAIT = int(zmq.SNDMORE | zmq.NOBLOCK)


def frames_nbytes(frames: Sequence[Any]) -> int:
    return sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)


def reconnect_ivl_max(settings: Settings) -> int:
    """ZeroMQ's reconnect back-off cap (ms) for peer DEALERs: one heartbeat interval (100 ms to
    1 s), so a neighbour restarted quickly is reconnected before its absence can add up to
    peer_timeout (a one-sided "lost" right after it is back)."""
    return max(100, min(1000, int(settings.heartbeat_interval * 1000)))


def send_frames(sock: zmq.Socket, frames: list[Any], track: bool, nbytes: int):
    """Send ``frames`` (``nbytes`` in all) without blocking; a small message is copied, a large one
    goes out zero-copy (with a MessageTracker when ``track``: the caller must not touch the buffers
    until it is done).

    Copying up to COPY_BELOW bytes costs less than pyzmq's zero-copy bookkeeping (a tracker, and a
    hand-back through pyzmq's garbage-collector thread, which takes the GIL, per frame): with 256 KiB
    chunks, 8 nodes on this 2-core machine all-reduced 11.7M float32 in 0.73 s instead of 0.81 s."""
    # A loop with plain int flags instead of send_multipart: pyzmq's version combines enum flags for
    # every part, which cost 7 us a message against 2.6 us here (its Python, not ZeroMQ's work). A
    # multipart message is atomic in ZeroMQ: once the first part is queued, the rest are too.
    copy = nbytes <= COPY_BELOW
    last = len(frames) - 1
    for f in frames[:last]:
        sock.send(f, _MORE_NOWAIT, copy=copy)
    # a zmq.Frame (a received one, sent on: see RoundTransport.send) goes without a copy either way,
    # and needs no tracker: ZeroMQ owns its memory and counts its references
    tracked = not copy and track and len(frames) > 2 and not isinstance(frames[last], zmq.Frame)
    tracker = sock.send(frames[last], _NOWAIT, copy=copy, track=tracked)
    return tracker if tracked else None


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame]:
    """One whole multipart message without blocking (zmq.Again when none is there): the loop that
    recv_multipart runs, without its per-part option lookups (3.6 us a message instead of 6.7)."""
    parts = [sock.recv(_NOWAIT, copy=False)]
    while parts[-1].more:
        parts.append(sock.recv(_NOWAIT, copy=False))
    return parts


def lost_between(last: int | None, header: dict[str, Any]) -> tuple[int, int | None]:
    """How many numbered messages of one connection went missing before ``header`` (its ``q``), when
    the one before had number ``last``; and the number to remember. A message without a number
    (garbage, or a peer that does not number) changes nothing."""
    q = header.get("q")
    if not isinstance(q, int) or isinstance(q, bool):
        return 0, last
    if header.get("qr"):
        return 0, q  # the sender dropped its queue on purpose (PeerNet._count_ping): numbering restarts
    return (q - last - 1 if last is not None and q > last + 1 else 0), q


def lost_text(n: int, sender: str) -> str:
    return (f"{n} message(s) from {sender} were lost: the TCP connection between the two daemons broke and "
            "reconnected while they were in flight")


def peer_socket(ctx: zmq.Context, kind: int, settings: Settings) -> zmq.Socket:
    """A ROUTER or DEALER of the peer port with the options every one needs. ZMQ_IPV6 always: without
    it a DEALER cannot connect to an IPv6 address or to a name that resolves to one (IPv4 still works
    with it on); only the ROUTER had it, so a ring of IPv6 addresses never formed."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IPV6, 1)
    s.setsockopt(zmq.MAXMSGSIZE, settings.max_message_bytes)
    # A DEALER carries rounds: nothing may be dropped (a full queue means a lost neighbour, noticed
    # by peer_timeout; queued pings are bounded by PeerNet._count_ping). The ROUTER only answers
    # pings: a connection that never reads must not queue pongs and refusals without limit.
    s.setsockopt(zmq.SNDHWM, REPLY_HWM if kind == zmq.ROUTER else 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.setsockopt(zmq.TCP_KEEPALIVE, 1)
    if kind == zmq.ROUTER and settings.peer_allowed_networks:
        from birdnet.daemon.security import configure_zap
        configure_zap(s)  # the daemon's ZAP handler refuses addresses outside them, before any message
    return s


def _resolve(host: str) -> str:
    """The address to bind for hosts-file ``host``: an IPv6 literal as it is (the resolver drops
    a link-local address's ``%interface``), a name as it resolves first."""
    if ":" in host:
        return host
    try:
        return pysocket.getaddrinfo(host, None, type=pysocket.SOCK_STREAM)[0][4][0]
    except pysocket.gaierror:
        return host


def membership_for(settings: Settings, rank: int, world: int) -> FixedRing | ElasticRing:
    """The membership strategy the settings ask for (``elastic``: an elastic ring)."""
    return ElasticRing(settings, rank, world) if settings.elastic else FixedRing(settings, rank, world)


class PeerNet:
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
        self.started = time.monotonic()
        self.cluster_wide = settings.cluster_wide()
        self.bytes_sent = 0
        self.bytes_received = 0
        #: accepted DEALER identity -> rank, and back (the fixed ring accepts its left neighbour only)
        self.identities: dict[bytes, int] = {}
        self.identity_of: dict[int, bytes] = {}
        self.left_seen = 0.0  # monotonic time of the last message from the left neighbour
        self.right_seen = 0.0  # last pong from the right neighbour
        self.seen = [0.0] * self.world  #: monotonic time of the last ping, pong or message per rank
        self.info: dict[int, dict[str, Any]] = {}  #: rank -> {"ep", "inc", "want"} from its pings/pongs
        self.refused: dict[int, str] = {}  #: rank -> why it refused this node's pings
        #: bumped when the left neighbour comes back as a new incarnation (a restarted daemon): a
        #: round in flight here then cannot complete (the new instance knows nothing of it), see
        #: FixedNeighbours.gone. Its first ping is a precise cut: what it sends before that
        #: ping is held (_hold), what the old instance sent after it is dropped (_replaced). The
        #: right-hand side would learn later (after its reconnection and a pong), so only this side
        #: looks; its abort reaches every node.
        self.neighbour_restarts = 0
        self.last_restart = ""  #: which neighbour restarted last, for error messages
        #: rank -> neighbour_restarts right after its latest restart was seen (a new identity)
        self.restart_seq: dict[int, int] = {}
        self.own_lost: set[int] = set()
        self.left_reports: set[int] = set()
        self.last_ping = 0.0
        self.dropped = 0
        #: identity -> [(arrival, CURVE user, message, bytes)] from connections not yet accepted (_hold)
        self._held: dict[bytes, list[tuple[float, str | None, dict, int]]] = {}
        self._held_bytes = 0
        #: held messages released by their connection's first ping; poll() returns these first
        self._ready: deque[dict] = deque()
        #: identities of connections replaced by a newer one (an earlier incarnation): dropped, not held
        self._replaced: deque[bytes] = deque(maxlen=16)
        #: rank -> identity -> (last accepted-looking ping, incarnation) of connections claiming
        #: that rank, and per rank why they are refused while two are alive (_duplicate_claim)
        self._claims: dict[int, dict[bytes, tuple[float, str]]] = {}
        self.duplicates: dict[int, str] = {}
        self.stopping = False  #: set by the ring worker on shutdown: rounds stop waiting for data
        #: rank -> pings sent since its last pong or refusal, and the most kept queued (_count_ping)
        self._unanswered: dict[int, int] = {}
        self.max_unanswered = int(settings.peer_timeout / settings.heartbeat_interval) + 2
        #: ranks whose queue _count_ping dropped: the next message to each carries ``qr`` (lost_between)
        self._renumber: set[int] = set()
        #: Every message to a peer carries ``q``, one more than the last to that peer (pings too).
        #: ZeroMQ delivers a connection's messages in order and loses none unless the TCP connection
        #: breaks (a NAT box, a flapping link, ``ss -K``): then what was in flight on it is gone, and
        #: the next message from that sender, or its next ping (one heartbeat later), shows a jump.
        #: Without this, a lost *last* message of a round, or a lost control message, was only
        #: noticed by the timeouts (a dense-lane round: round_timeout, 600 s by default).
        self.sent_q_to: dict[int, int] = {}
        self._q_from: dict[int, int | None] = {}  #: the last ``q`` from each accepted sender
        #: per sending rank, why the round that next waits for it must fail (take_gap_from)
        self._gaps: dict[int, str] = {}
        self.messages_lost = 0  #: messages lost this way, for status
        self.lost_from: dict[int, int] = {}  #: messages lost per sending rank, for metrics
        #: lane rounds (RingWorker) whose data may come before this node runs them: a left neighbour
        #: that finished a lane round goes on to the next at once. Their messages wait here.
        self.lane_keys: tuple[str, ...] = ()
        self._early: dict[str, deque[dict]] = {}
        self._early_bytes = 0  #: bounded by max_message_bytes (a left neighbour is one round ahead at most)
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
            d.setsockopt(zmq.IDENTITY, f"r{rank}-{self.incarnation}".encode())
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
        host = _resolve(me.host)
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
        return self.sent_q_to.get(self.right.rank, 0)

    # -- handshake events --------------------------------------------------------------------------
    def _drain_monitors(self) -> None:
        from zmq.utils.monitor import recv_monitor_message
        for mon, side in ((self.dealer_monitor, "dealer"), (self.router_monitor, "router")):
            while True:
                try:
                    ev = recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.Again:
                    break
                except (zmq.ZMQError, ValueError):  # a malformed event must not stop the ring
                    break
                self._handshake_event(side, ev["event"], ev.get("value"), ev.get("endpoint", b""))

    def _handshake_event(self, side: str, event: int, value: Any, endpoint: Any) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return
        if event == zmq.EVENT_DISCONNECTED:
            # libzmq's I/O thread frees the connection's pipe just after it reports this
            self._trim_at = time.monotonic() + 0.5
            return
        self.handshake_failures += 1
        if side == "dealer":
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and self.curve is None:
                reason = (f"right neighbour rank {self.right.rank} ({self.right.address}) refused this node's "
                          f"address (status {value}); add it to that node's peer_allowed_networks")
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                reason = (f"right neighbour rank {self.right.rank} ({self.right.address}) refused this node's CURVE "
                          f"key or its address (status {value}); add this node's birdnet.pub to its "
                          "curve_allowed_keys, or its address to its peer_allowed_networks")
            elif self.curve is None:
                reason = (f"handshake with right neighbour rank {self.right.rank} ({self.right.address}) failed: "
                          "it requires CURVE (curve_secret_key) and this node does not use it")
            else:
                reason = (f"CURVE handshake with right neighbour rank {self.right.rank} ({self.right.address}) "
                          "failed: it does not use CURVE, or its key is not the one in curve_allowed_keys")
            if reason != self.refused_by_right:
                log.error("%s", reason)
            self.refused_by_right = reason
        elif self.handshake_failures <= 20 or self.handshake_failures % 1000 == 0:
            why = "refused by the authenticator (address or CURVE key)" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else (
                "no CURVE (plaintext peer) or a protocol error" if self.curve is not None else "protocol error")
            log.warning("refused a connection on the peer port: %s (event %d, value %s; %d so far)", why, event,
                        value, self.handshake_failures)

    # -- liveness --------------------------------------------------------------------------------
    def lost(self) -> set[int]:
        """Ranks believed lost: this node's own observations (membership.silent), plus on the fixed
        ring what the left neighbour reports."""
        now = time.monotonic()
        own = self.membership.silent(self, now)
        if own != self.own_lost:
            for r in sorted(own - self.own_lost):
                log.warning("peer rank %d (%s) lost: nothing heard for %.1f s", r, self.peers[r].address,
                            self.settings.peer_timeout)
            for r in sorted(self.own_lost - own):
                log.info("peer rank %d (%s) is back", r, self.peers[r].address)
            self.own_lost = own
        return (own | self.left_reports) - {self.rank}

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
        """The ranks heard within peer_timeout (this node's own included)."""
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

    def restarted_since(self, since: int) -> str | None:
        """Which neighbour restarted (for an error message) if one did after neighbour_restarts was
        ``since``, else None."""
        return f"neighbour {self.last_restart}" if self.neighbour_restarts != since else None

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
            ok = self.left_identity is not None and self.left_seen > 0
        if rank == self.right.rank:
            ok = ok and self.right_seen > 0
        return ok

    # -- sending ---------------------------------------------------------------------------------
    def send(self, header: dict[str, Any], buffers: Sequence[Any] = (), track: bool = False,
             to: int | None = None):
        """Queue a message for rank ``to`` (default: the hosts-file right neighbour). Buffers go out
        without copying; with ``track`` the returned MessageTracker tells when ZeroMQ no longer needs
        them."""
        to = self.right.rank if to is None else to
        q = self.sent_q_to.get(to, 0) + 1
        frames = wire.encode(header, buffers, **self._numbering(to, q))
        try:
            # NOBLOCK: without a connection (the peer refused us, or never came) a blocking send
            # would stall this thread for good; ZeroMQ queues while a connection exists.
            nbytes = frames_nbytes(frames)
            tracker = send_frames(self.dealers[to], frames, track, nbytes)
        except zmq.Again:
            raise PeerLostError(
                f"cannot send to {self.membership.describe_peer(self, to, 'right')}: not connected"
                + (f" [{self.refused[to]}]" if to in self.refused else "")) from None
        self.sent_q_to[to] = q  # only a message ZeroMQ took counts: the receiver expects no gap otherwise
        self._renumber.discard(to)
        self.bytes_sent += nbytes
        return tracker

    def maybe_ping(self) -> None:
        now = time.monotonic()
        if now - self.last_ping < self.settings.heartbeat_interval:
            return
        self.last_ping = now
        try:
            self._send_ping()
        except PeerLostError:
            pass  # the right neighbour's liveness (no pongs) reports this

    def _count_ping(self, rank: int, sock: zmq.Socket, endpoint: str) -> None:
        """Count a ping about to go to ``rank``; past peer_timeout's worth of pings it never answered,
        drop what is queued for it by reconnecting ``sock``. ZeroMQ keeps a DEALER's queue while the
        peer is down or does not read (SNDHWM 0, so a round is never cut): without this, every heartbeat
        queued a ping for ever, delivered in a burst when the peer came back. A reconnection drops nothing
        the peer could still use: it has been counted lost for as long (rounds with it failed)."""
        n = self._unanswered.get(rank, 0) + 1
        if n > self.max_unanswered:
            try:
                sock.disconnect(endpoint)
            except zmq.ZMQError:
                pass
            sock.connect(endpoint)
            # what the queue held had numbers the peer will never see: without saying so, the peer's
            # first round after it comes back would fail on a gap of dropped pings
            self._renumber.add(rank)
            n = 1
        self._unanswered[rank] = n

    def _numbering(self, rank: int, q: int) -> dict[str, int]:
        """The numbering fields of the next message to ``rank``: its number, and ``qr`` when the
        queue before it was dropped (_count_ping)."""
        return {"q": q, "qr": 1} if rank in self._renumber else {"q": q}

    def _answered(self, rank: int) -> None:
        self._unanswered[rank] = 0

    def _send_ping(self) -> None:
        """A ping to every rank this node links to (the handshake, liveness and numbering)."""
        h = {"t": "ping", "proto": PROTOCOL_VERSION, "cw": self.cluster_wide, "world": self.world,
             "rank": self.rank, "inc": self.incarnation, "lost": sorted(self.lost()),
             **self.membership.ping_fields()}
        for r, d in self.dealers.items():
            self._count_ping(r, d, self.peers[r].endpoint())
            try:
                self.send(h, to=r)
            except PeerLostError:
                pass  # that peer's liveness (no pongs) reports this

    # -- receiving -------------------------------------------------------------------------------
    def set_lane_keys(self, keys: tuple[str, ...]) -> None:
        """Lane rounds whose early data is kept from now on; what was kept for others is dropped."""
        self.lane_keys = keys
        for k in [k for k in self._early if k not in keys]:
            self._early_bytes -= sum(sum(b.nbytes for b in m["b"]) for m in self._early.pop(k))

    def has_early(self, key: str) -> bool:
        return bool(self._early.get(key))

    def take_early(self, key: str) -> dict | None:
        q = self._early.get(key)
        if not q:
            return None
        msg = q.popleft()
        self._early_bytes -= sum(b.nbytes for b in msg["b"])
        return msg

    def poll(self, timeout: float) -> dict | None:
        """Wait up to ``timeout`` s for one message that matters to the caller (start, go, abort,
        data, lane) and return ``{"h": header, "b": buffers}``; pings, pongs and garbage are handled
        here, and a lane round's data that came before this node runs the round is kept for it."""
        msg = self._poll_once(timeout)
        if msg is None:
            return None
        h = msg["h"]
        if h.get("t") == "data" and h.get("ln"):
            k = h.get("k")
            if k != self.reading:
                nbytes = sum(b.nbytes for b in msg["b"])
                if k in self.lane_keys and self._early_bytes + nbytes <= self.settings.max_message_bytes:
                    self._early.setdefault(k, deque()).append(msg)
                    self._early_bytes += nbytes
                elif k in self.lane_keys:
                    self._drop(f"early data of lane round {k!r}: over max_message_bytes kept")
                # else: a lane round this node gave up or never had (dropped, like stale data).
                # Return rather than wait on: the same poll may have taken the service thread's
                # wake-up (a round handed over), which the caller must see now, not a poll later.
                return None
        elif h.get("t") == "lane" and self.on_lane is not None:
            self.on_lane(h)
        return msg

    def _poll_once(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while True:
            self.maybe_ping()
            if self._trim_at and time.monotonic() >= self._trim_at:
                self._trim_at = 0.0
                release_freed_memory()
            if self._ready:
                return self._ready.popleft()
            remaining = deadline - time.monotonic()
            events = dict(self.poller.poll(max(0, min(remaining, self.settings.heartbeat_interval)) * 1000))
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
                if self._ready:
                    return self._ready.popleft()
            if time.monotonic() >= deadline:
                return None

    def _drain_replies(self, events: dict) -> None:
        """Pongs and refusals on the DEALER side."""
        for r, d in self.dealers.items():
            if d in events:
                self._drain_dealer_of(r, d)

    def _drain_dealer_of(self, r: int, d: zmq.Socket) -> None:
        who = self.membership.describe_peer(self, r, "right")
        while True:
            try:
                frames = d.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                header, _ = wire.decode(frames, max_bytes=wire.MAX_HEADER_BYTES)
                wire.check_peer(header, self.world)
            except ProtocolError as exc:
                log.warning("dropped a bad reply from %s: %s", who, exc)
                continue
            if header["t"] in ("pong", "refuse"):
                self._answered(r)
            if header["t"] == "pong":
                self.seen[r] = time.monotonic()
                self._note_info(r, header)
                if r == self.right.rank:
                    self.right_seen = self.seen[r]
                if self.refused.pop(r, None) is not None:
                    log.info("%s accepted us", who)
            elif header["t"] == "refuse":
                reason = str(header.get("reason"))
                if reason != self.refused.get(r):
                    log.error("%s refused this node: %s", who, reason)
                self.refused[r] = reason

    def _note_info(self, r: int, h: dict[str, Any]) -> None:
        """What a ping or pong says of its sender's membership (elastic mode's epoch, incarnation, want)."""
        ep = h.get("ep")
        inc = h.get("inc")
        self.info[r] = {"ep": ep if isinstance(ep, int) and not isinstance(ep, bool) and ep >= 0 else 0,
                        "inc": inc if isinstance(inc, str) else None, "want": h.get("want") is True}

    def _decode_router(self) -> tuple[bytes, dict[str, Any], list[memoryview], Any] | None:
        """The next message on the ROUTER as (identity, header, buffers, header frame); None when
        there is none, or it was a ping (answered here) or garbage (dropped, the sender told)."""
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
        self.bytes_received += sum(b.nbytes for b in bufs) + sum(len(f.bytes) for f in frames[1:2])
        self._check_numbering(identity, header)
        t = header["t"]
        if t == "ping":
            self._handle_ping(identity, header, frames[1])
            return None
        if t not in self.message_types:
            self._drop(f"unknown message type {t!r} from {identity[:40]!r}")
            return None
        return identity, header, bufs, frames[1]

    def _check_numbering(self, identity: bytes, header: dict[str, Any]) -> None:
        """Notice messages from an accepted sender that never arrived (see ``sent_q_to``)."""
        r = self.identities.get(identity)
        if r is None:
            return  # not accepted yet: its first ping starts its numbering (_handle_ping)
        n, self._q_from[r] = lost_between(self._q_from.get(r), header)
        if n:
            self.messages_lost += n
            self.lost_from[r] = self.lost_from.get(r, 0) + n
            self._gaps[r] = lost_text(n, self.membership.describe_peer(self, r, "left"))
            log.warning("%s", self._gaps[r])

    def messages_lost_by_peer(self) -> list[tuple[Peer, int]]:
        """Messages lost per sending peer, for metrics (the fixed ring's only sender is the left neighbour)."""
        return [(self.peers[r], self.lost_from.get(r, 0)) for r in sorted(self.membership.senders(self))]

    def take_gap_from(self, r: int) -> str | None:
        """Why a wait for rank ``r`` must give up (messages from it were lost since the last wait for
        it), once; else None."""
        return self._gaps.pop(r, None)

    def take_gap(self) -> str | None:
        """Why the caller's round must fail (messages from the left neighbour were lost since the last
        call), once; None when nothing was lost. The lost messages belong to the round in flight or to
        one this node has not begun (rounds pass a link in order), so the first round to wait for the
        left neighbour after a gap takes it: at worst one call fails that could have completed (a lost
        control message of another round), where without it a round waited for its timeout."""
        gap = self.take_gap_from(self.left.rank)
        return f"{gap}; this call failed, the next one runs afresh" if gap else None

    def _recv_router(self) -> dict | None:
        got = self._decode_router()
        if got is None:
            return None
        identity, header, bufs, first = got
        r = self.identities.get(identity)
        if r is None:
            self._not_accepted(identity, header, bufs, first, "the peer")
            return None
        self.seen[r] = time.monotonic()
        if r == self.left.rank:
            self.left_seen = self.seen[r]
        return {"h": header, "b": bufs, "from": r}

    def _not_accepted(self, identity: bytes, header: dict[str, Any], bufs: list[memoryview], first: Any,
                      whose: str) -> None:
        """A message from a connection not accepted (yet): dropped if it is an earlier incarnation of
        ``whose``, else held until its first ping (a queue that overtook the handshake)."""
        if identity in self._replaced:
            self._drop(f"{header['t']!r} message from {identity[:40]!r}, an earlier incarnation of {whose}")
        else:
            self._hold(identity, first, {"h": header, "b": bufs}, len(first.bytes) + sum(b.nbytes for b in bufs))

    def _hold(self, identity: bytes, frame: Any, msg: dict, nbytes: int) -> None:
        """Keep a message from a connection that has not been accepted yet, until its first ping.

        A neighbour's DEALER keeps its queue across a reconnection: a message it queued while we
        were restarting (a round's ``start``, say) reaches us before the ping it sends at its next
        heartbeat. Dropping it would leave the round waiting round_timeout for a start that never
        comes round (the restart hang of tests/test_faults.py). So it is held, bounded in count
        and bytes, and delivered in order once that connection's ping passes the checks
        (:meth:`_release_held`); a connection that never passes them has its messages dropped
        after peer_timeout."""
        now = time.monotonic()
        for ident, held in list(self._held.items()):
            # arrival order: the expired ones are a prefix
            stale = sum(1 for m in held if now - m[0] > self.settings.peer_timeout)
            if stale:
                self._held_bytes -= sum(m[3] for m in held[:stale])
                self._drop(f"{stale} message(s) from {ident[:40]!r}, which never passed a ping check")
                if stale == len(held):
                    del self._held[ident]
                else:
                    self._held[ident] = held[stale:]
        count = sum(len(v) for v in self._held.values())
        if count >= HELD_MAX_MESSAGES or self._held_bytes + nbytes > HELD_MAX_BYTES:
            self._drop(f"{msg['h'].get('t')!r} message from {identity[:40]!r}, which is not an accepted peer "
                       f"(and {count} messages, {self._held_bytes} bytes from such connections are held already)")
            return
        who = self._peer_of_connection(frame) if self.curve is not None else None
        self._held.setdefault(identity, []).append((now, who, msg, nbytes))
        self._held_bytes += nbytes

    def _release_held(self, identity: bytes, who: str | None, tag: dict[str, Any]) -> None:
        """The connection ``identity`` passed its ping check: what it sent before is delivered now,
        in order, with ``tag`` added (with CURVE, only what came over a connection with the same key)."""
        for _t, held_who, msg, nbytes in self._held.pop(identity, ()):
            self._held_bytes -= nbytes
            if self.curve is not None and held_who != who:
                self._drop(f"a held message from {identity[:40]!r} that came with another CURVE key")
                continue
            msg.update(tag)
            self._ready.append(msg)

    def _drop(self, why: str) -> None:
        self.dropped += 1
        if self.dropped <= 20 or self.dropped % 1000 == 0:
            log.warning("dropped message %s (%d dropped so far)", why, self.dropped)

    def _duplicate_claim(self, identity: bytes, rank: int, inc: Any, current: bytes | None) -> str | None:
        """Why a ping that passed the checks is refused because two live daemons claim ``rank`` (a
        --rank given twice, or one hosts-file line used by two machines), else None. ``current`` is
        the identity accepted for ``rank`` now; on a refusal the caller accepts neither.

        A restarted daemon's new connection replaces the old one, which then falls silent. A
        replaced connection that pings again means both daemons are alive: each would displace the
        other at every heartbeat (every round failing as "restarted"). Instead both are refused,
        naming the rank, until only one has pinged for peer_timeout."""
        now = time.monotonic()
        claims = self._claims.setdefault(rank, {})
        claims[identity] = (now, str(inc))
        while len(claims) > 16:
            claims.pop(next(iter(claims)))
        live = {i: c for i, c in claims.items() if now - c[0] <= self.settings.peer_timeout}
        dup = self.duplicates.get(rank)
        if dup is None:
            if identity == current or identity not in self._replaced or current is None or current not in live:
                return None
            dup = (f"two daemons claim rank {rank} ({self.peers[rank].address}): incarnations "
                   f"{live[current][1]} and {inc}; each node needs its own hosts-file line "
                   "and --rank (a configuration error: stop one of them)")
            log.error("%s", dup)
            self.duplicates[rank] = dup
            self.neighbour_restarts += 1
            self.last_restart = dup
        elif len(live) < 2:
            log.info("only one daemon claims rank %d now", rank)
            del self.duplicates[rank]
            return None
        return dup

    def _reply(self, identity: bytes, header: dict[str, Any]) -> None:
        if "reason" in header:
            header["reason"] = wire.printable(header["reason"], MAX_REASON_CHARS)
        try:
            self.router.send_multipart([identity, *wire.encode(header)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _peer_of_connection(self, frame: Any) -> str | None:
        """With CURVE, the ring node whose key authenticated this connection (set by the ZAP handler)."""
        try:
            user = frame.get("User-Id")
        except (zmq.ZMQError, AttributeError, KeyError, TypeError):
            return None
        return user.decode(errors="replace") if isinstance(user, bytes) else user

    def _ping_refusal(self, h: dict[str, Any], who: str | None, rank: Any, rank_problem: str | None) -> str | None:
        """Why a ping is refused, else None: protocol version, world size, the rank it claims
        (``rank_problem``: the caller's check of ``rank``), cluster-wide settings, and with CURVE
        whether the connection's key (``who``) is that rank's. The one handshake check of both rings."""
        if h.get("proto") != PROTOCOL_VERSION:
            return f"protocol version {h.get('proto')!r} != {PROTOCOL_VERSION}"
        if h.get("world") != self.world:
            return (f"world size differs: the peer's hosts file has {h.get('world')!r} nodes, "
                    f"rank {self.rank}'s has {self.world}")
        if rank_problem:
            return rank_problem
        if h.get("cw") != self.cluster_wide:
            theirs = h.get("cw") if isinstance(h.get("cw"), dict) else {}
            diffs = [f"{k}: {theirs.get(k)!r} (peer) vs {self.cluster_wide.get(k)!r} (rank {self.rank})"
                     for k in sorted(set(theirs) | set(self.cluster_wide)) if theirs.get(k) != self.cluster_wide.get(k)]
            return "cluster-wide settings differ: " + "; ".join(diffs)
        if self.curve is not None and not (who or "").startswith(f"rank {rank} "):
            return f"this connection authenticated with the CURVE key of {who or 'nobody'}, but claims rank {rank}"
        return None

    def _handle_ping(self, identity: bytes, h: dict[str, Any], frame: Any = None) -> None:
        """A ping: the handshake (refused with the reason, or answered with a pong) and, from a new
        connection, its acceptance as the rank it claims."""
        m = self.membership
        r = h.get("rank")
        who = self._peer_of_connection(frame) if self.curve is not None else None
        reason = self._ping_refusal(h, who, r, m.rank_problem(self, r))
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
        assert isinstance(r, int)  # rank_problem checked it
        # The newest connection that passes the checks is the rank's, so a restarted peer is taken
        # back at its first ping. Without CURVE anyone who can reach this port could pose as it
        # (docs/security.md); with CURVE the key must be that rank's.
        if self.identity_of.get(r) != identity:
            old = self.identity_of.get(r)
            log.info("%s connected (incarnation %s)", m.describe_peer(self, r, "left"), h.get("inc"))
            if old is not None:
                self.identities.pop(old, None)  # an earlier incarnation: its messages are dropped now
                self._replaced.append(old)
                # a restart: rounds in flight with r cannot complete (restarted_since, gone)
                self.neighbour_restarts += 1
                self.restart_seq[r] = self.neighbour_restarts
                self.last_restart = f"rank {r} ({self.peers[r].address}) restarted (incarnation {h.get('inc')})"
            self.identity_of[r] = identity
            self.identities[identity] = r
            # its numbering starts at this ping (what it sent before is held and released below)
            self._q_from[r] = lost_between(None, h)[1]
            self._gaps.pop(r, None)
            self._release_held(identity, who, {"from": r})
        self.seen[r] = time.monotonic()
        self._note_info(r, h)
        if r == self.left.rank:
            self.left_seen = self.seen[r]
            lost = h.get("lost")
            if m.relays_lost:
                self.left_reports = ({x for x in lost if isinstance(x, int) and 0 <= x < self.world}
                                     if isinstance(lost, list) else set())
        self._reply(identity, {"t": "pong", "rank": self.rank, **m.pong_fields(self)})


def _as_frame(b: Any) -> Any:
    """The received ZeroMQ frame a numpy array views whole (the ring sums into received buffers
    and forwards them), else the array itself. A frame is sent on without a copy (send_frames):
    all but two of a node's 2(N-1) messages of a dense round are such (500 KB each for 1M float32
    on 8 nodes)."""
    base = getattr(b, "base", None)
    if isinstance(b, np.ndarray) and isinstance(base, memoryview) and isinstance(base.obj, zmq.Frame):
        if b.nbytes == base.nbytes == base.obj.buffer.nbytes and b.flags.c_contiguous:
            return base.obj
    return b


def _earlier_of_job(other: Any, key: str) -> bool:
    """Whether round key ``other`` is an earlier round of the same job as ``key`` ("job/seq")."""
    a, b = wire.split_key(other), wire.split_key(key)
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[1]


class RoundTransport:
    """The :class:`~birdnet.ring.transport.Transport` a ring algorithm sees for one round: tags
    messages with the round key and returns the round's data, nothing else. The control messages
    that arrive meanwhile are dispatched by type to the ``handle_*`` methods (an abort of this
    round fails it, a new start or a lane close gives it up, the rest is stale or another round's).
    Its :class:`~birdnet.daemon.rounds.Round` says which round, on which ring (``neighbours``:
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
        self.trackers: list[Any] = []
        #: called with an ``abort`` of another round (RingWorker._on_abort_elsewhere)
        self.on_other_abort: Any = None
        self._handlers = {"data": self.handle_data, "abort": self.handle_abort, "start": self.handle_start,
                          "lane": self.handle_lane, "go": self.handle_go}

    @property
    def interrupt(self) -> dict | None:
        """A ``start`` of another round that arrived meanwhile (the ring worker follows it next)."""
        return self.round.interrupt

    def send(self, header: dict[str, Any], buffers: Sequence[Any] = ()) -> None:
        h = dict(header)
        h["k"] = self.key
        if self.lane:
            h["ln"] = 1
        before = self.net.bytes_sent
        tracker = self.neighbours.send(self.net, h, [_as_frame(b) for b in buffers], True)
        if tracker is not None:
            self.trackers.append(tracker)
        self.bytes_sent += self.net.bytes_sent - before

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
        gap = self.neighbours.take_gap(self.net, self.key)
        if gap:
            raise PeerLostError(gap)

    def recv(self, deadline: float) -> tuple[dict[str, Any], list[memoryview]]:
        if self.lane:
            self._check_gap()  # early data may have come after lost messages
            early = self.net.take_early(self.key)
            if early is not None:
                self.bytes_received += sum(b.nbytes for b in early["b"])
                return early["h"], early["b"]
            self.net.reading = self.key
            try:
                return self._recv(deadline)
            finally:
                self.net.reading = None
        return self._recv(deadline)

    def _recv(self, deadline: float) -> tuple[dict[str, Any], list[memoryview]]:
        nb = self.neighbours
        while True:
            if self.net.stopping:
                raise ShutdownError(f"round {self.key} aborted: birdnetd on rank {self.net.rank} is shutting down")
            why = nb.why_gone(self.net, self.key, self.restarts_at)
            if why:
                raise PeerLostError(why)
            self._check_gap()
            now = time.monotonic()
            if now >= deadline:
                if self.lane:
                    raise RoundTimeoutError(
                        f"round {self.key} did not complete within round_timeout="
                        f"{self.net.settings.round_timeout} s: the job's processes on some node did not submit it")
                raise PeerLostError(
                    f"no data from {nb.describe_left()} for round {self.key} within "
                    f"{self.net.settings.peer_timeout} s")
            before = self.net.bytes_received
            msg = self.net.poll(min(deadline - now, self.net.settings.heartbeat_interval))
            if msg is None or not nb.accepts(msg):
                continue
            handler = self._handlers.get(msg["h"].get("t"))
            if handler is None or not handler(msg):
                continue
            # data that came after lost messages is not used; control messages are handled first
            # (a start or an abort of another round must not be lost with this one)
            self._check_gap()
            self.bytes_received += self.net.bytes_received - before
            return msg["h"], msg["b"]

    # -- the round's messages, by type (each True only for data this round takes) -----------------
    def handle_data(self, msg: dict[str, Any]) -> bool:
        """This round's data from the left; anything else is stale (a message of an earlier,
        failed round, or of a lane round given up)."""
        h = msg["h"]
        return self.neighbours.from_left(msg) and h.get("k") == self.key and bool(h.get("ln")) == self.lane

    def handle_abort(self, msg: dict[str, Any]) -> bool:
        """An abort of this round fails it; one of another round (fixed ring: it names its origin)
        is the ring worker's to remember and pass on."""
        a = Abort.from_header(msg["h"])
        if a is None:
            return False
        if a.key in (self.key, None):
            raise RoundAborted.of(a)
        if a.origin is not None and self.neighbours.other_aborts and self.on_other_abort is not None:
            self.on_other_abort(a)
            if self.lane and _earlier_of_job(a.key, self.key):
                # An earlier round of this job failed somewhere. The node that failed it closed
                # its lane and joins this round only once it is agreed, so no node can finish a
                # segment of it: give it up and run it agreed (the job loses no second call).
                # (A later one's failure is only remembered: this round can still complete.)
                raise LaneGivenUp(self.key)
        return False

    def handle_start(self, msg: dict[str, Any]) -> bool:
        """The leader started an agreement: this round was abandoned upstream (a lane round: the
        leader never joined it). The start is kept for the ring worker to follow."""
        if not self.neighbours.from_left(msg):
            return False
        self.round.interrupt = msg
        if self.lane:
            raise LaneGivenUp(self.key)
        raise RoundAborted(f"round {self.key} was abandoned upstream (a new round started)")

    def handle_lane(self, msg: dict[str, Any]) -> bool:
        """The leader closes the lane at this round (a lane round gives it up), or a node asks the
        leader to close it while the leader is in the round already (it fails)."""
        h = msg["h"]
        if not self.neighbours.from_left(msg) or not self.lane:
            return False
        if h.get("req") and self.rank == 0:
            raise RoundAborted(f"round {self.key} cannot run without an agreement: {h.get('req')}")
        if h.get("k") == self.key and not h.get("req"):
            raise LaneGivenUp(self.key)
        return False

    def handle_go(self, msg: dict[str, Any]) -> bool:
        """A go during a data phase is an earlier agreement's, passed on late: stale."""
        return False
