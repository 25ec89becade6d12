"""Peer links: the sockets and frames of the peer port (no ring logic here).

How a message goes on a socket and comes off one, on the path every message of a round takes:
small ones copied, large ones zero-copy and tracked, received frames sent on as they are, and
plain loops instead of pyzmq's multipart helpers (every microsecond here is paid per message on
every node). The sockets' options (peer_socket) and the address to bind (resolve_host).
"""
from __future__ import annotations

import socket as pysocket
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from birdnet.config import Settings

#: messages up to this many bytes are copied into ZeroMQ instead of sent zero-copy (see send)
COPY_BELOW = 1 << 20


#: replies (pong, refuse) queued at most for one connection; more are dropped (PeerNet._reply)
REPLY_HWM = 64

_NOWAIT = int(zmq.NOBLOCK)
_MORE_NOWAIT = int(zmq.SNDMORE | zmq.NOBLOCK)
#: pyzmq's compiled send, under the Python override of zmq.Socket.send (which only adds routing_id
#: and group, for socket types birdnet does not use): one Python frame less per frame sent, three
#: per message
_send = zmq.backend.Socket.send


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Bytes in ``frames`` as wire.encode makes them: bytes, byte-cast memoryviews and ZeroMQ frames,
    whose len() is their size in bytes (summed by map(), without a Python frame per part)."""
    return sum(map(len, frames))


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
        _send(sock, f, _MORE_NOWAIT, copy)
    # a zmq.Frame (a received one, sent on: see RoundTransport.send) goes without a copy either way,
    # and needs no tracker: ZeroMQ owns its memory and counts its references
    tracked = not copy and track and len(frames) > 2 and not isinstance(frames[last], zmq.Frame)
    tracker = _send(sock, frames[last], _NOWAIT, copy, tracked)
    return tracker if tracked else None


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame]:
    """One whole multipart message without blocking (zmq.Again when none is there): the loop that
    recv_multipart runs, without its per-part option lookups (3.6 us a message instead of 6.7)."""
    parts = [sock.recv(_NOWAIT, copy=False)]
    while parts[-1].more:
        parts.append(sock.recv(_NOWAIT, copy=False))
    return parts


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
    if kind == zmq.ROUTER:
        # A peer DEALER that drops its queue (PeerNet._count_ping: disconnect, connect) comes back
        # under the same identity (rank and incarnation). ZeroMQ's default ignores a connection whose
        # identity is still held by one the ROUTER has not yet seen end: it stays connected and all it
        # sends vanishes until the next drop, peer_timeout later, a start among it holding the ring
        # until round_timeout. The newer connection is the peer's live one: it takes the identity over.
        s.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if kind == zmq.ROUTER and settings.peer_allowed_networks:
        from birdnet.daemon.security import configure_zap
        configure_zap(s)  # the daemon's ZAP handler refuses addresses outside them, before any message
    return s


def resolve_host(host: str) -> str:
    """The address to bind for hosts-file ``host``: an IPv6 literal as it is (the resolver drops
    a link-local address's ``%interface``), a name as it resolves first."""
    if ":" in host:
        return host
    try:
        return pysocket.getaddrinfo(host, None, type=pysocket.SOCK_STREAM)[0][4][0]
    except pysocket.gaierror:
        return host


def as_frame(b: Any) -> Any:
    """The received ZeroMQ frame a numpy array views whole (the ring sums into received buffers
    and forwards them), else the array itself. A frame is sent on without a copy (send_frames):
    all but two of a node's 2(N-1) messages of a dense round are such (500 KB each for 1M float32
    on 8 nodes). A received frame's own memoryview (a gathered payload forwarded as it came: 2 of a
    node's 3 messages of a 4-node BIRD+ round) is sent on as its frame too."""
    if isinstance(b, memoryview):
        obj = b.obj
        if isinstance(obj, zmq.Frame) and b.nbytes == obj.buffer.nbytes and b.c_contiguous:
            return obj
        return b
    base = getattr(b, "base", None)
    if isinstance(b, np.ndarray) and isinstance(base, memoryview) and isinstance(base.obj, zmq.Frame):
        if b.nbytes == base.nbytes == base.obj.buffer.nbytes and b.flags.c_contiguous:
            return base.obj
    return b
