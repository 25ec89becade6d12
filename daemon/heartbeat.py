"""The peer net's heartbeat and handshake: what :class:`~birdnet.daemon.peers.PeerNet` does with
pings, pongs, refusals and its sockets' monitor events, apart from the rounds' messages.

A ping goes to every rank the node links to each ``heartbeat_interval`` (:meth:`Heartbeats.maybe_ping`):
it carries the protocol, the cluster-wide settings, world, rank, incarnation and the ranks the
sender believes lost, and it numbers the link (numbering.py). The receiver checks it
(handshake.py: refused with the reason, or answered with a pong) and, from a new connection,
accepts the connection as the rank it claims; what that connection sent before is held until then
(handshake.HeldMessages). Pongs tell the sender that its right neighbour hears it, and on the fixed
ring that the neighbour restarted (a new incarnation). A mixin of PeerNet: it reads and writes the
net's tables (identities, seen, info, refused) and is not used on its own.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import zmq
from birdnet.daemon.handshake import (
    MAX_REASON_CHARS,
    left_handshake_failure,
    ping_refusal,
    renamed_remnant,
    right_handshake_failure,
)

from birdnet import PROTOCOL_VERSION, wire
from birdnet.errors import PeerLostError, ProtocolError

log = logging.getLogger("birdnet.peers")


class Heartbeats:
    """PeerNet's pings, pongs, refusals and handshake events (this module's docstring)."""

    # -- handshake events (the socket monitors) ----------------------------------------------------
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
            reason = right_handshake_failure(event, value, self.right, self.curve is not None)
            if reason != self.refused_by_right:
                log.error("%s", reason)
            self.refused_by_right = reason
        elif self.handshake_failures <= 20 or self.handshake_failures % 1000 == 0:
            log.warning("refused a connection on the peer port: %s (event %d, value %s; %d so far)",
                        left_handshake_failure(event, self.curve is not None), event, value, self.handshake_failures)

    # -- pings out, on every DEALER; pongs and refusals back ------------------------------------------
    def maybe_ping(self) -> None:
        now = time.monotonic()
        if now - self.last_ping < self.settings.heartbeat_interval:
            return
        if self.last_ping and now - self.last_ping > self.stall_limit:
            # no ping went out for long (this process was stopped or starved): the others may have
            # counted this node lost meanwhile (RoundTransport.await_commit does not trust its count)
            self.stalled_at, self.stalled_for = now, now - self.last_ping
            log.warning("no ping went out for %.1f s (this daemon was stopped or starved)", self.stalled_for)
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
        if self.numbering.count_ping(rank):
            if self.numbering.first_drop(rank):  # once per silence: a dead peer drops every peer_timeout
                log.info("rank %d answered none of the last %d pings: what was queued for it is dropped "
                         "(its socket reconnects)", rank, self.numbering.max_unanswered)
            try:
                sock.disconnect(endpoint)
            except zmq.ZMQError:
                pass
            sock.connect(endpoint)
            # the last commit counts sent it may have been among what was dropped: a stopped
            # neighbour that continues still needs them to release its round (await_commit)
            for h in [h for r, h in self.recent_commits if r == rank]:
                try:
                    self.send(h, to=rank)
                except Exception:  # noqa: BLE001 - not connected yet: ZeroMQ queues from here on
                    pass

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
                self.numbering.answered(r)
            if header["t"] == "pong":
                self.seen[r] = time.monotonic()
                self._note_pong(r, header)
                self._note_info(r, header)
                if r == self.right.rank:
                    self.live.right_seen = self.seen[r]
                if self.refused.pop(r, None) is not None:
                    log.info("%s accepted us", who)
            elif header["t"] == "refuse":
                reason = str(header.get("reason"))
                if reason != self.refused.get(r):
                    log.error("%s refused this node: %s", who, reason)
                self.refused[r] = reason

    def _note_pong(self, r: int, h: dict[str, Any]) -> None:
        """A pong from the right neighour ``r``: on the fixed ring, a new incarnation in it is a
        restart seen from this side too (the left side sees it at its first ping). Without it a node
        whose right neighbour restarted within peer_timeout waited round_timeout for a round the
        new instance knows nothing of (a leader for its start, sent to the old instance; a lane
        round the new instance never joins)."""
        if not getattr(self.membership, "restarts_by_pong", False):
            return
        inc, old = h.get("inc"), self.info.get(r, {}).get("inc")
        if isinstance(inc, str) and isinstance(old, str) and inc != old:
            self.live.note_restart(r, f"rank {r} ({self.peers[r].address}) restarted (incarnation {inc})")

    def _note_info(self, r: int, h: dict[str, Any]) -> None:
        """What a ping or pong says of its sender's membership (elastic mode's epoch, incarnation, want)."""
        ep = h.get("ep")
        inc = h.get("inc")
        self.info[r] = {"ep": ep if isinstance(ep, int) and not isinstance(ep, bool) and ep >= 0 else 0,
                        "inc": inc if isinstance(inc, str) else None, "want": h.get("want") is True}

    # -- pings in, on the ROUTER: the handshake ------------------------------------------------------
    def _handle_ping(self, identity: bytes, h: dict[str, Any], frame: Any = None) -> None:
        """A ping: the handshake (refused with the reason, or answered with a pong) and, from a new
        connection, its acceptance as the rank it claims."""
        m = self.membership
        r = h.get("rank")
        who = self._peer_of_connection(frame) if self.curve is not None else None
        reason = ping_refusal(h, world=self.world, rank=self.rank, cluster_wide=self.cluster_wide,
                              curve=self.curve is not None, who=who, claimed=r, rank_problem=m.rank_problem(self, r))
        if reason is None and renamed_remnant(identity, r, h.get("inc"), self.identity_of.get(r)):
            # what it still delivers was sent before the peer dropped its queue on purpose (numbering
            # restarts with "qr" on the new connection): dropped, as that queue was
            if identity not in self._replaced:  # it pings every heartbeat until ZeroMQ closes it
                self._replaced.append(identity)
            self.held.discard(identity)
            return
        if reason is None:
            reason, new = self.claims.claim(identity, r, h.get("inc"), self.identity_of.get(r), self._replaced)
            if new:
                self.live.note_restart(None, reason)  # rounds in flight with either of them cannot complete
            if reason and r in self.identity_of:
                # neither is accepted (their messages are held, then dropped): rank r counts as
                # lost after peer_timeout and the ring goes on without it; before, the two
                # displaced each other at every heartbeat, each time as a "restart" of rank r
                self.identities.pop(self.identity_of.pop(r), None)
                self.live.restart_seq[r] = self.live.neighbour_restarts
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
                # a restart: rounds in flight with r cannot complete (restarted_since, gone); on a
                # two-node ring its pong may have told already (_note_pong)
                if self.info.get(r, {}).get("inc") != h.get("inc") or not isinstance(h.get("inc"), str):
                    self.live.note_restart(r, f"rank {r} ({self.peers[r].address}) restarted "
                                              f"(incarnation {h.get('inc')})")
            self.identity_of[r] = identity
            self.identities[identity] = r
            # its numbering starts at this ping (what it sent before is held and released below)
            self.numbering.restart(r, h)
            self.held.release(identity, who, {"from": r}, self.curve is not None)
        self.seen[r] = time.monotonic()
        self._note_info(r, h)
        if r == self.left.rank:
            self.live.left_seen = self.seen[r]
            lost = h.get("lost")
            if m.relays_lost:
                self.live.left_reports = ({x for x in lost if isinstance(x, int) and 0 <= x < self.world}
                                     if isinstance(lost, list) else set())
        self._reply(identity, {"t": "pong", "rank": self.rank, **m.pong_fields(self)})

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
