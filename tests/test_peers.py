"""PeerNet's handshake rules on real ZeroMQ sockets over loopback, one process: a raw DEALER plays
the left neighbour, so the order of what it sends is exactly the test's."""
from __future__ import annotations

import time

import pytest
import zmq
from birdnet.daemon.peers import HELD_MAX_MESSAGES, PeerNet
from cluster import free_ports

from birdnet import PROTOCOL_VERSION, wire
from birdnet.config import Settings
from birdnet.hosts import Peer


@pytest.fixture
def ring():
    """Rank 0 of a 2-node ring as a real PeerNet; ``left(identity)`` makes a DEALER posing as rank 1."""
    ctx = zmq.Context()
    settings = Settings(peer_timeout=1.0, heartbeat_interval=0.1)
    peers = [Peer(r, "127.0.0.1", p) for r, p in enumerate(free_ports(2))]
    net = PeerNet(ctx, settings, peers, 0)
    socks = []

    def left(identity: bytes) -> zmq.Socket:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.IDENTITY, identity)
        d.connect(peers[0].endpoint())
        socks.append(d)
        return d

    yield net, settings, left
    for s in socks:
        s.close(0)
    net.close()
    ctx.term()


def ping(settings: Settings, inc: str) -> list:
    return wire.encode({"t": "ping", "proto": PROTOCOL_VERSION, "cw": settings.cluster_wide(), "world": 2,
                        "rank": 1, "inc": inc, "lost": []})


def collect(net: PeerNet, seconds: float) -> list[dict]:
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        msg = net.poll(0.05)
        if msg is not None:
            out.append(msg["h"])
    return out


def test_messages_queued_before_a_reconnected_neighbours_first_ping_are_delivered_in_order(ring):
    """A restarted node's neighbour reconnects with a round's ``start`` already queued ahead of its
    next ping; dropping it hung the round (test_daemon_restarted_while_clients_idle)."""
    net, settings, left = ring
    d = left(b"r1-new")
    d.send_multipart(wire.encode({"t": "start", "k": "j:0", "n": 1}))
    d.send_multipart(wire.encode({"t": "go", "k": "j:0"}))
    assert collect(net, 0.3) == []  # not yet accepted: held, not delivered
    d.send_multipart(ping(settings, "new"))
    d.send_multipart(wire.encode({"t": "data", "k": "j:0", "i": 7}))
    got = collect(net, 0.5)
    assert [h["t"] for h in got] == ["start", "go", "data"]
    assert got[0]["n"] == 1 and got[2]["i"] == 7
    assert net.dropped == 0


def test_held_messages_expire_and_an_earlier_incarnations_are_dropped(ring):
    net, settings, left = ring
    old = left(b"r1-old")
    old.send_multipart(ping(settings, "old"))
    assert collect(net, 0.3) == []
    assert net.left_identity == b"r1-old"
    new = left(b"r1-new")
    new.send_multipart(ping(settings, "new"))
    collect(net, 0.3)
    assert net.left_identity == b"r1-new"
    old.send_multipart(wire.encode({"t": "data", "k": "j:0"}))  # a late message of the old instance
    assert collect(net, 0.3) == [] and net.dropped == 1
    # a connection that never pings: its messages are held at most peer_timeout, then dropped
    stranger = left(b"r1-stranger")
    stranger.send_multipart(wire.encode({"t": "start", "k": "j:1"}))
    collect(net, 0.2)
    assert net._held
    time.sleep(settings.peer_timeout + 0.1)
    stranger.send_multipart(wire.encode({"t": "start", "k": "j:2"}))
    collect(net, 0.2)
    assert [m[2]["h"]["k"] for m in net._held[b"r1-stranger"]] == ["j:2"]
    assert net.dropped == 2


def test_held_messages_are_bounded(ring):
    net, settings, left = ring
    d = left(b"r1-flood")
    for i in range(HELD_MAX_MESSAGES + 10):
        d.send_multipart(wire.encode({"t": "data", "k": "j:0", "i": i}))
    collect(net, 0.5)
    assert sum(len(v) for v in net._held.values()) == HELD_MAX_MESSAGES
    assert net.dropped == 10
    d.send_multipart(ping(settings, "flood"))
    got = collect(net, 0.5)
    assert [h["i"] for h in got] == list(range(HELD_MAX_MESSAGES))
    assert net._held_bytes == 0
