"""The handshake of the peer port: which pings are refused and why, two daemons claiming one rank,
and the messages a connection sends before its first ping passes the checks.

A ping is the handshake (protocol, world size, the rank it claims, cluster-wide settings, with
CURVE the connection's key): :func:`ping_refusal` says why one is refused, the same check on both
rings. Two live daemons claiming one rank are both refused (:class:`DuplicateClaims`). What a
connection sends before it is accepted is held (:class:`HeldMessages`) and delivered once its first
ping passes, or dropped after peer_timeout. PeerNet (peers.py) owns one of each.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Container
from typing import Any

import zmq

from birdnet import PROTOCOL_VERSION

log = logging.getLogger("birdnet.peers")

#: bounds on messages held from a connection whose first ping has not arrived yet (HeldMessages)
HELD_MAX_MESSAGES = 64
HELD_MAX_BYTES = 16 << 20
#: longest refusal reason sent: a ping's cluster-wide map may be 64 KiB, and every difference is named
MAX_REASON_CHARS = 2048


def ping_refusal(h: dict[str, Any], *, world: int, rank: int, cluster_wide: dict[str, Any], curve: bool,
                 who: str | None, claimed: Any, rank_problem: str | None) -> str | None:
    """Why a ping ``h`` reaching node ``rank`` is refused, else None: protocol version, world size,
    the rank it claims (``claimed``; ``rank_problem``: the membership's check of it), cluster-wide
    settings, and with CURVE whether the connection's key (``who``) is that rank's. The one
    handshake check of both rings."""
    if h.get("proto") != PROTOCOL_VERSION:
        return f"protocol version {h.get('proto')!r} != {PROTOCOL_VERSION}"
    if h.get("world") != world:
        return (f"world size differs: the peer's hosts file has {h.get('world')!r} nodes, "
                f"rank {rank}'s has {world}")
    if rank_problem:
        return rank_problem
    if h.get("cw") != cluster_wide:
        theirs = h.get("cw") if isinstance(h.get("cw"), dict) else {}
        diffs = [f"{k}: {theirs.get(k)!r} (peer) vs {cluster_wide.get(k)!r} (rank {rank})"
                 for k in sorted(set(theirs) | set(cluster_wide)) if theirs.get(k) != cluster_wide.get(k)]
        return "cluster-wide settings differ: " + "; ".join(diffs)
    if curve and not (who or "").startswith(f"rank {claimed} "):
        return f"this connection authenticated with the CURVE key of {who or 'nobody'}, but claims rank {claimed}"
    return None


def right_handshake_failure(event: int, value: Any, right: Any, curve: bool) -> str:
    """Why the right neighbour (``right``, a hosts-file Peer) refused this node's connection, from
    the DEALER's socket-monitor ``event`` (ZeroMQ reports handshake failures there, never as
    messages), with the fix."""
    who = f"right neighbour rank {right.rank} ({right.address})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and not curve:
        return f"{who} refused this node's address (status {value}); add it to that node's peer_allowed_networks"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"{who} refused this node's CURVE key or its address (status {value}); add this node's "
                "birdnet.pub to its curve_allowed_keys, or its address to its peer_allowed_networks")
    if not curve:
        return f"handshake with {who} failed: it requires CURVE (curve_secret_key) and this node does not use it"
    return (f"CURVE handshake with {who} failed: it does not use CURVE, or its key is not the one in "
            "curve_allowed_keys")


def left_handshake_failure(event: int, curve: bool) -> str:
    """What a failed handshake on the peer port (the ROUTER's monitor ``event``) means, for the log."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "refused by the authenticator (address or CURVE key)"
    return "no CURVE (plaintext peer) or a protocol error" if curve else "protocol error"


def dealer_identity(rank: int, incarnation: str) -> bytes:
    """The ZeroMQ identity of a daemon's DEALERs: its rank and incarnation, the same for every
    reconnection of one daemon (so a peer's ROUTER hands the name over to the newest connection)."""
    return f"r{rank}-{incarnation}".encode()


def renamed_remnant(identity: bytes, rank: Any, inc: Any, current: bytes | None) -> bool:
    """Whether a ping from ``identity`` claiming ``rank`` and incarnation ``inc`` came over the older
    connection of the daemon already accepted as ``current``: the peer reconnected its DEALER (it
    dropped a queue its silent neighbour never read) and ZeroMQ's handover gave the new connection
    the daemon's identity and the old one a generated name, under which it still delivers what was
    in flight. One daemon, not two: taken for a second claim of the rank, both were refused for
    peer_timeout and the rounds meanwhile failed."""
    if not isinstance(inc, str) or not isinstance(rank, int) or isinstance(rank, bool):
        return False
    own = dealer_identity(rank, inc)
    return identity != own and current == own


class DuplicateClaims:
    """Two live daemons claiming one rank (a --rank given twice, or one hosts-file line used by two
    machines).

    A restarted daemon's new connection replaces the old one, which then falls silent. A replaced
    connection that pings again means both daemons are alive: each would displace the other at
    every heartbeat (every round failing as "restarted"). Instead both are refused, naming the
    rank, until only one has pinged for peer_timeout."""

    def __init__(self, peer_timeout: float, address_of: Callable[[int], str]) -> None:
        self.peer_timeout, self.address_of = peer_timeout, address_of
        #: rank -> identity -> (last accepted-looking ping, incarnation) of connections claiming it
        self._claims: dict[int, dict[bytes, tuple[float, str]]] = {}
        self.duplicates: dict[int, str] = {}  #: rank -> why its connections are refused

    def claim(self, identity: bytes, rank: int, inc: Any, current: bytes | None,
              replaced: Container[bytes]) -> tuple[str | None, bool]:
        """Why a ping that passed the other checks is refused (else None), and whether that refusal
        is new. ``current`` is the identity accepted for ``rank`` now, ``replaced`` the identities
        newer connections replaced; on a refusal the caller accepts neither."""
        now = time.monotonic()
        claims = self._claims.setdefault(rank, {})
        claims[identity] = (now, str(inc))
        while len(claims) > 16:
            claims.pop(next(iter(claims)))
        live = {i: c for i, c in claims.items() if now - c[0] <= self.peer_timeout}
        dup = self.duplicates.get(rank)
        if dup is None:
            if identity == current or identity not in replaced or current is None or current not in live:
                return None, False
            dup = (f"two daemons claim rank {rank} ({self.address_of(rank)}): incarnations "
                   f"{live[current][1]} and {inc}; each node needs its own hosts-file line "
                   "and --rank (a configuration error: stop one of them)")
            log.error("%s", dup)
            self.duplicates[rank] = dup
            return dup, True
        if len(live) < 2:
            log.info("only one daemon claims rank %d now", rank)
            del self.duplicates[rank]
            return None, False
        return dup, False


class HeldMessages:
    """Messages from connections not accepted yet, kept until their first ping.

    A neighbour's DEALER keeps its queue across a reconnection: a message it queued while we were
    restarting (a round's ``start``, say) reaches us before the ping it sends at its next
    heartbeat. Dropping it would leave the round waiting round_timeout for a start that never comes
    round (the restart hang of tests/test_faults.py). So it is held, bounded in count and bytes,
    and delivered in order once that connection's ping passes the checks (:meth:`release`); a
    connection that never passes them has its messages dropped after peer_timeout."""

    def __init__(self, peer_timeout: float, drop: Callable[[str], None]) -> None:
        self.peer_timeout, self.drop = peer_timeout, drop
        #: identity -> [(arrival, CURVE user, message, bytes)]
        self.by_identity: dict[bytes, list[tuple[float, str | None, dict, int]]] = {}
        self.nbytes = 0
        #: held messages released by their connection's first ping; PeerNet.poll returns these first
        self.ready: deque[dict] = deque()

    def hold(self, identity: bytes, who: str | None, msg: dict, nbytes: int) -> None:
        """Keep ``msg`` (``nbytes``, over a connection with CURVE user ``who``) from ``identity``."""
        now = time.monotonic()
        for ident, held in list(self.by_identity.items()):
            # arrival order: the expired ones are a prefix
            stale = sum(1 for m in held if now - m[0] > self.peer_timeout)
            if stale:
                self.nbytes -= sum(m[3] for m in held[:stale])
                self.drop(f"{stale} message(s) from {ident[:40]!r}, which never passed a ping check")
                if stale == len(held):
                    del self.by_identity[ident]
                else:
                    self.by_identity[ident] = held[stale:]
        count = sum(len(v) for v in self.by_identity.values())
        if count >= HELD_MAX_MESSAGES or self.nbytes + nbytes > HELD_MAX_BYTES:
            self.drop(f"{msg['h'].get('t')!r} message from {identity[:40]!r}, which is not an accepted peer "
                      f"(and {count} messages, {self.nbytes} bytes from such connections are held already)")
            return
        self.by_identity.setdefault(identity, []).append((now, who, msg, nbytes))
        self.nbytes += nbytes

    def discard(self, identity: bytes) -> None:
        """Drop what ``identity`` sent (a connection whose messages nobody will use)."""
        held = self.by_identity.pop(identity, ())
        if held:
            self.nbytes -= sum(m[3] for m in held)
            self.drop(f"{len(held)} message(s) from {identity[:40]!r}, an older connection of an accepted peer")

    def release(self, identity: bytes, who: str | None, tag: dict[str, Any], curve: bool) -> None:
        """The connection ``identity`` passed its ping check: what it sent before is ready now, in
        order, with ``tag`` added (with CURVE, only what came over a connection with the same key)."""
        for _t, held_who, msg, nbytes in self.by_identity.pop(identity, ()):
            self.nbytes -= nbytes
            if curve and held_who != who:
                self.drop(f"a held message from {identity[:40]!r} that came with another CURVE key")
                continue
            msg.update(tag)
            self.ready.append(msg)
