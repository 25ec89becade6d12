"""PeerNet's handshake rules on real ZeroMQ sockets over loopback, one process: a raw DEALER plays
the left neighbour, so the order of what it sends is exactly the test's."""
from __future__ import annotations

import time

import pytest
import zmq
from birdnet.daemon.peers import HELD_MAX_MESSAGES, PeerNet, RoundTransport, lost_between
from cluster import free_ports

from birdnet import PROTOCOL_VERSION, wire
from birdnet.config import Settings
from birdnet.errors import PeerLostError
from birdnet.hosts import Peer
from birdnet.messages import Start


def dealer_to(ctx: zmq.Context, peer: Peer, identity: bytes, socks: list) -> zmq.Socket:
    """A raw DEALER with ``identity`` connected to ``peer`` (closed by the fixture through ``socks``)."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.IDENTITY, identity)
    d.connect(peer.endpoint())
    socks.append(d)
    return d


@pytest.fixture
def ring():
    """Rank 0 of a 2-node ring as a real PeerNet; ``left(identity)`` makes a DEALER posing as rank 1."""
    ctx = zmq.Context()
    settings = Settings(peer_timeout=1.0, heartbeat_interval=0.1)
    peers = [Peer(r, "127.0.0.1", p) for r, p in enumerate(free_ports(2))]
    net = PeerNet(ctx, settings, peers, 0)
    socks = []

    def left(identity: bytes) -> zmq.Socket:
        return dealer_to(ctx, peers[0], identity, socks)

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
    d.send_multipart(wire.encode({"t": "start", "k": "j/0", "n": 1, "descs": []}))
    d.send_multipart(wire.encode({"t": "go", "k": "j/0"}))
    assert collect(net, 0.3) == []  # not yet accepted: held, not delivered
    d.send_multipart(ping(settings, "new"))
    d.send_multipart(wire.encode({"t": "data", "k": "j/0", "i": 7}))
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
    old.send_multipart(wire.encode({"t": "data", "k": "j/0"}))  # a late message of the old instance
    assert collect(net, 0.3) == [] and net.dropped == 1
    # a connection that never pings: its messages are held at most peer_timeout, then dropped
    stranger = left(b"r1-stranger")
    stranger.send_multipart(wire.encode({"t": "start", "k": "j/1", "descs": []}))
    collect(net, 0.2)
    assert net.held.by_identity
    time.sleep(settings.peer_timeout + 0.1)
    stranger.send_multipart(wire.encode({"t": "start", "k": "j/2", "descs": []}))
    collect(net, 0.2)
    assert [m[2]["h"]["k"] for m in net.held.by_identity[b"r1-stranger"]] == ["j/2"]
    assert net.dropped == 2


def test_held_messages_are_bounded(ring):
    net, settings, left = ring
    d = left(b"r1-flood")
    for i in range(HELD_MAX_MESSAGES + 10):
        d.send_multipart(wire.encode({"t": "data", "k": "j/0", "i": i}))
    collect(net, 0.5)
    assert sum(len(v) for v in net.held.by_identity.values()) == HELD_MAX_MESSAGES
    assert net.dropped == 10
    d.send_multipart(ping(settings, "flood"))
    got = collect(net, 0.5)
    assert [h["i"] for h in got] == list(range(HELD_MAX_MESSAGES))
    assert net.held.nbytes == 0


def numbered(h: dict, q: int) -> list:
    return wire.encode({**h, "q": q})


def numbered_ping(settings: Settings, inc: str, q: int) -> list:
    return wire.encode({"t": "ping", "proto": PROTOCOL_VERSION, "cw": settings.cluster_wide(), "world": 2,
                        "rank": 1, "inc": inc, "lost": [], "q": q})


def test_messages_to_the_right_neighbour_are_numbered_pings_too(ring):
    """PeerNet.send numbers every message it hands to ZeroMQ, one more each time; a raw ROUTER
    plays the right neighbour."""
    net, settings, _ = ring
    right = zmq.Context.instance().socket(zmq.ROUTER)
    right.setsockopt(zmq.LINGER, 0)
    try:
        right.bind(net.right.endpoint())
        net.send({"t": "data", "k": "j/0"})
        net._send_ping()
        net.send({"t": "start", "k": "j/1", "descs": []})
        got = []
        poller = zmq.Poller()
        poller.register(right, zmq.POLLIN)
        deadline = time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < deadline:
            if poller.poll(100):
                frames = right.recv_multipart()
                got.append(wire.decode(frames[1:], max_bytes=1 << 20)[0])
        assert [(h["t"], h["q"]) for h in got] == [("data", 1), ("ping", 2), ("start", 3)]
        assert net.sent_q == 3
    finally:
        right.close(0)


def test_a_jump_in_the_left_neighbours_numbering_fails_the_next_round_once(ring):
    """Messages lost on a TCP connection that broke and reconnected (a NAT box, ``ss -K``) show as a
    jump in the numbering, at the next message or the next ping: the round waiting for the left
    neighbour fails at once with a reason, instead of waiting for its timeout (a dense-lane round:
    round_timeout, 600 s by default)."""
    net, settings, left = ring
    d = left(b"r1-a")
    d.send_multipart(numbered({"t": "data", "k": "j/0", "i": 0}, 1))  # before its first ping: held
    d.send_multipart(numbered_ping(settings, "a", 2))
    d.send_multipart(numbered({"t": "data", "k": "j/0", "i": 1}, 3))
    assert [h["i"] for h in collect(net, 0.3)] == [0, 1]
    assert net.take_gap() is None and net.messages_lost == 0  # held ones numbered before the ping: no gap
    # a round waits; the last message of it (q=4) never comes, the neighbour's next ping shows it
    rt = RoundTransport(net, "j/1")
    d.send_multipart(numbered_ping(settings, "a", 5))
    with pytest.raises(PeerLostError, match=r"round j/1: 1 message\(s\) from left neighbour rank 1 .* were lost: "
                                            r"the TCP connection between the two daemons broke"):
        rt.recv(time.monotonic() + 5)
    assert net.messages_lost == 1
    assert net.take_gap() is None  # one failed round per gap
    # a gap while no round runs fails the next round to wait for the left neighbour, at its first message
    d.send_multipart(numbered({"t": "data", "k": "j/2", "i": 2}, 8))
    collect(net, 0.3)
    with pytest.raises(PeerLostError, match=r"2 message\(s\)"):
        RoundTransport(net, "j/2").recv(time.monotonic() + 5)
    # in sequence again: the next round gets its data
    d.send_multipart(numbered({"t": "data", "k": "j/3", "i": 3}, 9))
    h, _ = RoundTransport(net, "j/3").recv(time.monotonic() + 5)
    assert h["i"] == 3 and net.messages_lost == 3


def test_a_restarted_neighbour_numbers_afresh_and_unnumbered_messages_are_not_checked(ring):
    net, settings, left = ring
    old = left(b"r1-old")
    old.send_multipart(numbered_ping(settings, "old", 40))
    old.send_multipart(numbered({"t": "data", "k": "j/0"}, 41))
    assert [h["k"] for h in collect(net, 0.3)] == ["j/0"]
    new = left(b"r1-new")  # a new incarnation starts again from 1
    new.send_multipart(numbered_ping(settings, "new", 1))
    new.send_multipart(numbered({"t": "data", "k": "j/1"}, 2))
    new.send_multipart(wire.encode({"t": "data", "k": "j/2"}))  # a message without a number: not checked
    new.send_multipart(numbered({"t": "data", "k": "j/3"}, 3))
    assert [h["k"] for h in collect(net, 0.5)] == ["j/1", "j/2", "j/3"]
    assert net.take_gap() is None and net.messages_lost == 0


# -- elastic mode: every node has a DEALER to every other, each connection numbered on its own ------

@pytest.fixture
def elastic():
    """Rank 0 of a 3-node elastic ring as a real PeerNet (its membership an ElasticRing);
    ``peer(r, identity)`` makes a DEALER posing as rank r, ``listen(r)`` a ROUTER on rank r's
    address (what rank 0 sends to r)."""
    ctx = zmq.Context()
    # peer_timeout well above the tests' length: a rank that never pings stays "presumed" alive
    settings = Settings(peer_timeout=30.0, heartbeat_interval=0.1, elastic=True)
    peers = [Peer(r, "127.0.0.1", p) for r, p in enumerate(free_ports(3))]
    net = PeerNet(ctx, settings, peers, 0)
    socks = []

    def peer(r: int, identity: bytes) -> zmq.Socket:
        return dealer_to(ctx, peers[0], identity, socks)

    def listen(r: int) -> zmq.Socket:
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(peers[r].endpoint())
        socks.append(s)
        return s

    yield net, settings, peer, listen
    for s in socks:
        s.close(0)
    net.close()
    ctx.term()


def elastic_ping(settings: Settings, r: int, q: int) -> list:
    return wire.encode({"t": "ping", "proto": PROTOCOL_VERSION, "cw": settings.cluster_wide(), "world": 3,
                        "rank": r, "inc": f"i{r}", "lost": [], "ep": 0, "want": False, "q": q})


def received(sock: zmq.Socket, n: int, t: str | None = None) -> list:
    """Headers of the next ``n`` messages on a ROUTER (of type ``t`` only, if given), up to 5 s."""
    got, deadline = [], time.monotonic() + 5
    while len(got) < n and time.monotonic() < deadline:
        if sock.poll(100):
            h = wire.decode(sock.recv_multipart()[1:], max_bytes=1 << 20)[0]
            if t is None or h["t"] == t:
                got.append(h)
    return got


def test_elastic_messages_are_numbered_per_destination(elastic):
    net, settings, _, listen = elastic
    to1, to2 = listen(1), listen(2)
    net.send({"t": "data", "k": "j/0"}, to=1)
    net.send({"t": "start", "k": "j/1", "descs": []}, to=2)
    net._send_ping()  # one to every node
    net.send({"t": "go", "k": "j/1"}, to=1)
    assert [(h["t"], h["q"]) for h in received(to1, 3)] == [("data", 1), ("ping", 2), ("go", 3)]
    assert [(h["t"], h["q"]) for h in received(to2, 2)] == [("start", 1), ("ping", 2)]
    assert net.sent_q_to == {1: 3, 2: 2}


def test_elastic_a_jump_fails_the_round_waiting_for_that_rank_only(elastic):
    """A TCP reset between two live daemons loses what was in flight on that one connection: the
    round waiting for data from that rank fails at once; a gap on another rank's connection is not
    this round's."""
    from birdnet.daemon.peers import RingNeighbours, RoundTransport

    def elastic_transport(net, key, members, restarts_at=None):  # the transport of a round on ring ``members``
        return RoundTransport(net, key, restarts_at, neighbours=RingNeighbours(net, members))

    net, settings, peer, _ = elastic
    left, other = peer(2, b"r2-a"), peer(1, b"r1-a")  # rank 0's left member is rank 2
    left.send_multipart(elastic_ping(settings, 2, 1))
    other.send_multipart(elastic_ping(settings, 1, 1))
    other.send_multipart(elastic_ping(settings, 1, 4))  # two messages from rank 1 lost
    collect(net, 0.3)  # (two connections: no order between them)
    assert net.messages_lost == 2
    left.send_multipart(numbered({"t": "data", "k": "j/0", "i": 0}, 2))
    h, _ = elastic_transport(net, "j/0", [0, 1, 2]).recv(time.monotonic() + 5)
    assert h["i"] == 0  # rank 1's gap is not this round's
    assert "2 message(s) from rank 1" in net.take_gap_from(1)
    # one message from the left member lost: its next data does not complete the round
    left.send_multipart(numbered({"t": "data", "k": "j/1", "i": 1}, 4))
    with pytest.raises(PeerLostError, match=r"round j/1: 1 message\(s\) from rank 2 .* were lost: the TCP "
                                            r"connection between the two daemons broke"):
        elastic_transport(net, "j/1", [0, 1, 2]).recv(time.monotonic() + 5)
    assert net.take_gap_from(2) is None  # one failed round per gap
    left.send_multipart(numbered({"t": "data", "k": "j/2", "i": 2}, 5))
    h, _ = elastic_transport(net, "j/2", [0, 1, 2]).recv(time.monotonic() + 5)
    assert h["i"] == 2 and net.messages_lost == 3
    assert [(p.rank, n) for p, n in net.messages_lost_by_peer()] == [(1, 2), (2, 1)]  # metrics, per sender
    # a restarted rank 2 (new connection) numbers afresh from its first ping
    new = peer(2, b"r2-b")
    new.send_multipart(elastic_ping(settings, 2, 1))
    new.send_multipart(numbered({"t": "data", "k": "j/3", "i": 3}, 2))
    # (the round counts as begun after that restart, which the net sees only when it polls in recv)
    h, _ = elastic_transport(net, "j/3", [0, 1, 2], restarts_at=net.neighbour_restarts + 1).recv(time.monotonic() + 5)
    assert h["i"] == 3 and net.messages_lost == 3


def test_elastic_a_lost_start_makes_the_agreement_start_again(elastic):
    """The agreement's messages travel the ring: a gap from the member before this node means a
    ``start`` or ``go`` may be gone. The leader waiting for its start to come back gives the
    agreement up to start it again (no call fails); a node waiting for ``go`` fails the round (the
    go may be lost with the nodes before it already in the data phase); a node still waiting for a
    start asks the leader to start again, instead of the leader waiting round_timeout for its start
    to come back round."""
    from birdnet.daemon.engine import RingWorker, RoundRunner, StateStore
    from birdnet.daemon.peers import RingNeighbours, RoundAborted
    from birdnet.daemon.rounds import Round
    net, settings, peer, listen = elastic
    to1 = listen(1)
    w = RingWorker(settings, 0, 3, net, RoundRunner(settings, StateStore(1 << 20)), lambda rnd: None)
    ring = RingNeighbours(net, [0, 1, 2])  # rank 0's left member is rank 2
    left = peer(2, b"r2-a")
    left.send_multipart(elastic_ping(settings, 2, 1))
    left.send_multipart(elastic_ping(settings, 2, 3))
    t = time.monotonic()
    with pytest.raises(PeerLostError, match=r"round j/4: 1 message\(s\) from rank 2") as got:
        w._wait_control("start", Round("j/4", ring, net.neighbour_restarts, time.monotonic() + 30))
    assert not isinstance(got.value, RoundAborted)  # the leader's caller retries on this
    assert time.monotonic() - t < 5
    left.send_multipart(elastic_ping(settings, 2, 5))
    with pytest.raises(RoundAborted, match=r"round j/5: 1 message\(s\) from rank 2"):
        w._wait_control("go", Round("j/5", ring, net.neighbour_restarts, time.monotonic() + 30))
    # waiting for a start (a round of its own is ready): the leader, rank 1, is asked to start again
    w.order = ["j/6"]
    left.send_multipart(elastic_ping(settings, 2, 7))
    collect(net, 0.3)
    w.membership.waiting_for_start(w.order[0], leader=1)
    got = received(to1, 1, "abort")
    assert got and got[0]["k"] == "j/6" and got[0]["retry"] is True and "from rank 2" in got[0]["reason"], got
    assert net.take_gap_from(2) is None


def test_elastic_a_round_the_leader_has_gone_past_fails_at_once(elastic):
    """A member lost while a ``go`` travels: the nodes it had passed fail the round in the data
    phase, the others give the agreement up to retry it, and no leader starts it again. When the
    leader starts the job's next round, a node still holding the earlier one fails it at once (not
    after round_timeout) and takes part in the new one; a retried start of the same round, another
    job's round, a joiner whose call numbers are not aligned yet, and a daemon that has not been a
    member of an epoch yet (restarted: a start queued for its previous life) leave held rounds alone."""
    import threading

    from birdnet.daemon.engine import LocalRound, RingWorker, RoundRunner, StateStore
    from birdnet.daemon.peers import RoundAborted
    net, settings, peer, listen = elastic
    to1 = listen(1)
    finished: dict[str, BaseException | None] = {}
    w = RingWorker(settings, 0, 3, net, RoundRunner(settings, StateStore(1 << 20)),
                   lambda rnd: finished.__setitem__(rnd.key, rnd.error))
    m = w.membership  # the ElasticRing
    left = peer(2, b"r2-a")  # ring [0, 1, 2], leader 1: a start reaches rank 0 from rank 2
    left.send_multipart(elastic_ping(settings, 2, 1))
    collect(net, 0.3)

    def held(job: str, seq: int) -> LocalRound:
        rnd = LocalRound(job=job, seq=seq, kind="allreduce", desc={"kind": "allreduce", "name": "g"}, parts=[])
        w.submit(rnd)
        w._take_inbox()
        return rnd

    def start(key: str) -> dict:
        return {"h": {"t": "start", "k": key, "S": [0, 1, 2], "ep": 1, "L": 1, "J": [],
                      "descs": [[1, {"kind": "allreduce", "name": "g", "count": 1}],
                                [2, {"kind": "allreduce", "name": "g", "count": 1}]]}, "from": 2}

    def follow(key: str) -> threading.Thread:
        msg = start(key)
        t = threading.Thread(target=w._follow, args=(Start.from_header(msg["h"]), msg["from"]), daemon=True)
        t.start()
        return t

    held("j", 5)
    held("other", 2)
    # a daemon that has not been a member of an epoch yet (restarted) may get a start queued for its
    # previous life: its numbering is not the leader's, it keeps its rounds
    w.failures.overtaken("j/6", 1)
    assert "j/5" in w.ready and not finished
    m.epoch, m.members = 1, [0, 1, 2]
    t = follow("j/6")
    deadline = time.monotonic() + 5
    while "j/5" not in finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(finished.get("j/5"), RoundAborted), finished
    assert "the leader rank 1 has gone on to round j/6" in str(finished["j/5"])
    assert "other/2" in w.ready and "other/2" not in finished  # another job's round is not touched
    held("j", 6)  # the job's process here submits the next call: this node joins the round
    got = received(to1, 1, "start")
    assert got and got[0]["k"] == "j/6" and [d[0] for d in got[0]["descs"]] == [1, 2, 0], got
    w.stop()  # it now waits for the go; stopping ends that wait
    t.join(10)
    assert not t.is_alive()
    # a start of a held round itself (the leader retried it) fails nothing: only earlier rounds go
    held("j", 8)
    w.failures.overtaken("j/8", 1)
    assert "j/8" in w.ready and "j/8" not in finished
    # a joiner whose call numbers are not aligned with the cluster's yet keeps its rounds
    held("k", 3)
    m.join_epoch, m.aligned = 1, set()
    w.failures.overtaken("k/7", 1)
    assert "k/3" in w.ready and "k/3" not in finished
    m.aligned = {"k"}
    w.failures.overtaken("k/7", 1)
    assert isinstance(finished.get("k/3"), RoundAborted)
    assert "other/2" in w.ready and "j/8" in w.ready


def test_pings_for_a_peer_that_is_down_are_bounded(ring):
    """ZeroMQ keeps a DEALER's queue while its peer is down (SNDHWM 0: a round is never cut), so a
    heartbeat queued a ping for ever and the peer got them all in a burst when it came back. Now
    at most peer_timeout's worth stay queued (PeerNet._count_ping reconnects past that)."""
    net, settings, _ = ring
    ctx = zmq.Context.instance()
    right = ctx.socket(zmq.ROUTER)
    right.setsockopt(zmq.LINGER, 0)
    right.bind(net.right.endpoint())
    collect(net, 0.3)  # connected; pings arrive
    right.close(0)  # the right neighbour is down
    down = 3.0  # 30 heartbeats at 0.1 s; peer_timeout 1 s allows 12 unanswered
    collect(net, down)
    right = ctx.socket(zmq.ROUTER)
    right.setsockopt(zmq.LINGER, 0)
    try:
        right.bind(net.right.endpoint())
        got, deadline = [], time.monotonic() + 1.0  # what was queued comes at once on reconnection
        while time.monotonic() < deadline:
            net.poll(0.02)
            while right.poll(0):
                identity, *frames = right.recv_multipart()
                got.append(wire.decode(frames, max_bytes=1 << 20)[0])
                # answered as a daemon answers: a neighbour that never answered would be dropped again
                # once its count passed max_unanswered inside this window (a second "qr", under load)
                right.send_multipart([identity, *wire.encode({"t": "pong", "rank": 1})])
        # queued while down: at most max_unanswered; then 1 s of fresh heartbeats (about 10)
        assert len(got) <= 12 + 12, len(got)  # max_unanswered: int(peer_timeout / heartbeat_interval) + 2
        # the dropped pings' numbers never arrive: the first message after the drop says numbering
        # restarts, so the neighbour counts no gap (it failed the first round after a link came back)
        last, lost = None, 0
        for h in got:
            n, last = lost_between(last, h)
            lost += n
        assert got and got[0].get("qr") == 1 and lost == 0, [(h["q"], h.get("qr")) for h in got]
        # answered, the count starts again: at most one more drop, when the count stood at max_unanswered
        # and the window's first ping went out before the first pong came back
        assert sum(1 for h in got[1:] if "qr" in h) <= 1, [(h["q"], h.get("qr")) for h in got]
    finally:
        right.close(0)


def test_a_data_phase_waits_on_the_router_alone_and_still_reads_pongs(ring):
    """A round's data phase polls the ROUTER alone (fewer system calls per message) and every socket
    once per DATA_FULL_POLL_INTERVAL: the right neighbour's pongs are still read while it waits, so
    a long data phase does not count a live neighbour lost; its data comes through as before."""
    from birdnet.daemon import peers as peers_module

    net, settings, left = ring
    ctx = zmq.Context.instance()
    right = ctx.socket(zmq.ROUTER)  # rank 1's peer port, answering every ping with a pong
    right.setsockopt(zmq.LINGER, 0)
    right.bind(net.peers[1].endpoint())
    d = left(b"r1-x")
    d.send_multipart(ping(settings, "x"))
    polls = {"all": 0, "data": 0}
    for name, p in (("all", net.poller), ("data", net.data_poller)):
        def counted(timeout=None, _p=p, _poll=p.poll, _name=name):
            polls[_name] += 1
            return _poll(timeout)
        p.poll = counted
    real_zmq_poll = peers_module.zmq_poll

    def router_alone(items, timeout=-1):  # the data phase's own wait on the ROUTER (PeerNet._poll_once)
        assert [s for s, _ in items] == [net.router]
        polls["data"] += 1
        return real_zmq_poll(items, timeout)
    peers_module.zmq_poll = router_alone
    try:
        t0 = time.monotonic()
        pongs = 0
        last_ping = 0.0
        while time.monotonic() < t0 + 1.2:
            if time.monotonic() - last_ping > 0.1:  # the left neighbour (rank 1 too) stays alive
                d.send_multipart(ping(settings, "x"))
                last_ping = time.monotonic()
            while right.poll(0):
                ident, *frames = right.recv_multipart()
                h, _ = wire.decode(frames, max_bytes=1 << 20)
                if h["t"] == "ping":
                    right.send_multipart([ident, *wire.encode({"t": "pong", "rank": 1, "inc": "r", "ep": 0})])
                    pongs += 1
            net.poll(0.05, data=True)
        assert pongs >= 5  # heartbeat_interval 0.1 s: pings kept going out during the data phase
        # read within DATA_FULL_POLL_INTERVAL (0.1 s) and a ping interval of the last pong sent
        assert peers_module.DATA_FULL_POLL_INTERVAL <= 0.1
        assert time.monotonic() - net.live.right_seen < 0.35
        assert polls["data"] > 2 * polls["all"] > 0  # mostly the ROUTER alone, every socket now and then
        d.send_multipart(wire.encode({"t": "data", "k": "j/0", "i": 3}))
        tr = RoundTransport(net, "j/0")
        h, _ = tr.recv(time.monotonic() + 2.0)
        assert h["i"] == 3
    finally:
        peers_module.zmq_poll = real_zmq_poll
        right.close(0)

def test_an_idle_poll_waits_its_time_out_instead_of_spinning(ring, monkeypatch):
    """pyzmq truncates a float timeout to whole milliseconds: the last one before the deadline was
    a loop of polls that returned at once, stolen from training processes on every node. An idle
    net.poll(0.05) now polls a few times, not dozens."""
    net, _settings, _left = ring
    calls = []
    real = net.poller.poll

    def counted(timeout=None):
        calls.append(timeout)
        return real(timeout)
    monkeypatch.setattr(net.poller, "poll", counted)
    for _ in range(20):
        t0 = time.monotonic()
        assert net.poll(0.0105) is None
        assert time.monotonic() - t0 >= 0.0105
    assert len(calls) <= 20 * 3, calls
    assert all(isinstance(c, int) and c >= 1 for c in calls), calls


# -- the commit at the end of a round (RoundTransport.await_commit) ---------------------------------
@pytest.fixture
def committing(ring):
    """The 2-node ring with a raw ROUTER standing in for rank 1's peer port (it receives what rank 0
    sends its right neighbour) and rank 1's handshake done."""
    net, settings, left = ring
    ctx = zmq.Context.instance()
    right = ctx.socket(zmq.ROUTER)
    right.setsockopt(zmq.LINGER, 0)
    right.bind(net.peers[1].endpoint())
    d = left(b"r1-c")
    d.send_multipart(numbered_ping(settings, "c", 1))
    collect(net, 0.2)
    yield net, settings, d, right
    right.close(0)


def sent_to_right(sock: zmq.Socket, t: str, seconds: float = 1.0) -> list[dict]:
    """Headers of type ``t`` that rank 0 sent its right neighbour within ``seconds``."""
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sock.poll(50):
            frames = sock.recv_multipart()
            h = wire.decode(frames[1:], max_bytes=1 << 20)[0]
            if h.get("t") == t:
                out.append(h)
    return out


def test_a_round_is_released_only_once_the_left_neighbour_confirms_every_node_holds_it(committing):
    """The commit count: this node says it holds the result (c=1), and releases the round only when
    its left neighbour says world-1 nodes ending with it hold it too; a count that came during the
    data phase (the left finished first) is kept for the wait. Later rounds' messages that come
    meanwhile are put back in order for their readers."""
    net, settings, d, right = committing
    rt = RoundTransport(net, "j/5")
    d.send_multipart(numbered({"t": "commit", "k": "j/5", "c": 1}, 2))  # before this node's last data
    d.send_multipart(numbered({"t": "data", "k": "j/5", "i": 6}, 3))
    d.send_multipart(numbered({"t": "data", "k": "j/6", "i": 7}, 4))  # the left went on to the next round
    assert rt.recv(time.monotonic() + 2)[0]["i"] == 6  # the data phase keeps the count it passed
    t = time.monotonic()
    rt.await_commit(2.0)
    assert time.monotonic() - t < 0.5
    h, _ = RoundTransport(net, "j/6").recv(time.monotonic() + 2)  # not lost to the commit's wait
    assert h["i"] == 7
    assert [(h["k"], h["c"]) for h in sent_to_right(right, "commit", 0.2)] == [("j/5", 1)]
    assert net.commits == {}  # nothing kept once the round took it


def test_a_late_count_of_a_finished_round_cannot_release_a_later_run_of_its_key(committing):
    """A count that comes after this node released a round (a settlement's world - 1 to a neighbour
    that released already) is dropped, and a new run of the key (a restarted job numbers its calls
    from 0 again) starts with no count: it waits for its own."""
    net, settings, d, right = committing
    d.send_multipart(numbered({"t": "commit", "k": "j/3", "c": 1}, 2))
    RoundTransport(net, "j/3").await_commit(2.0)  # released
    d.send_multipart(numbered({"t": "commit", "k": "j/3", "c": 1}, 3))  # late
    d.send_multipart(numbered({"t": "data", "k": "j/4", "i": 1}, 4))
    assert RoundTransport(net, "j/4").recv(time.monotonic() + 2)[0]["i"] == 1  # the late count was read
    assert "j/3" not in net.commits
    net.settle_book.started("j/3")  # the job's next run reaches the same key
    with pytest.raises(PeerLostError, match="did not all confirm"):
        RoundTransport(net, "j/3").await_commit(0.3)


def test_a_round_whose_commit_never_comes_fails_and_an_abort_fails_it_at_once(committing):
    net, settings, d, right = committing
    with pytest.raises(PeerLostError, match=r"did not all confirm holding the result within 0.3 s"):
        RoundTransport(net, "j/7").await_commit(0.3)
    d.send_multipart(numbered({"t": "abort", "k": "j/8", "reason": "node rank 1: lost peer", "o": 1}, 2))
    t = time.monotonic()
    with pytest.raises(PeerLostError, match="node rank 1: lost peer"):
        RoundTransport(net, "j/8").await_commit(5.0)
    assert time.monotonic() - t < 1.0


def test_a_malformed_control_message_is_dropped_counted_and_the_net_keeps_serving(ring):
    """Headers that pass the wire's checks but not their record's (a commit count that is no count,
    a start without descriptions) are dropped where they arrive and counted; the next good message
    is delivered."""
    net, settings, left = ring
    d = left(b"r1-x")
    d.send_multipart(ping(settings, "x"))
    for h in ({"t": "commit", "k": "j/0", "c": "many"}, {"t": "start", "k": "j/0", "descs": 3},
              {"t": "commit", "k": "j/0", "c": 0}):
        d.send_multipart(wire.encode(h))
    d.send_multipart(wire.encode({"t": "commit", "k": "j/0", "c": 1}))
    got = collect(net, 0.5)
    assert [h["t"] for h in got] == ["commit"] and got[0]["c"] == 1
    assert net.malformed == 3


def test_a_reconnection_under_the_same_identity_takes_over_the_old_connection(ring):
    """A peer's DEALER that drops its queue (PeerNet._count_ping: disconnect, connect) comes back
    under the same identity; if the ROUTER has not yet seen its old connection end, ZeroMQ's default
    (no ZMQ_ROUTER_HANDOVER) ignores the new one: it connects, and everything it sends vanishes until
    the next drop, peer_timeout later. A start lost so, with the drop's renumbering hiding the gap,
    held an elastic rejoin until round_timeout. The newer connection must take the identity over."""
    net, settings, left = ring
    old = left(b"r1-a")
    old.send_multipart(ping(settings, "a"))
    assert collect(net, 0.5) == [] and old.poll(1000)  # accepted: its ping answered
    new = left(b"r1-a")  # the old connection is still up at the ROUTER
    new.send_multipart(ping(settings, "a"))
    new.send_multipart(wire.encode({"t": "start", "k": "j/1", "descs": [], "more": []}))
    got = collect(net, 1.0)
    assert [h["t"] for h in got] == ["start"], got
    assert new.poll(1000), "the new connection's ping was never answered"




def test_the_older_connection_of_a_reconnected_peer_is_not_a_second_daemon(ring):
    """A neighbour that drops its queue (disconnect, connect) while this ROUTER still holds unread
    pings of the old connection: ZeroMQ's handover gives the new connection the neighbour's
    identity and the old one a generated name, under which those pings still arrive (seen when a
    daemon restarted and its neighbours' queued pings reached it; the timing is ZeroMQ's, so here a
    DEALER with a name that is not a daemon's plays the renamed connection). Taken for a second
    daemon claiming the rank (the same incarnation twice), both were refused for peer_timeout and
    an elastic rejoin failed after round_timeout. One incarnation is one daemon: the remnant's
    messages are dropped, the daemon's own connection stays accepted and nothing is refused."""
    net, settings, left = ring
    own = left(b"r1-a")
    own.send_multipart(ping(settings, "a"))
    assert collect(net, 0.3) == [] and net.left_identity == b"r1-a"
    remnant = left(b"\x01renamed")
    remnant.send_multipart(wire.encode({"t": "data", "k": "j/0", "i": 1}))
    remnant.send_multipart(ping(settings, "a"))
    got = collect(net, 0.3)
    for _ in range(3):  # the daemon's own pings after the remnant's
        own.send_multipart(ping(settings, "a"))
        own.send_multipart(wire.encode({"t": "start", "k": "j/1", "descs": [], "more": []}))
        got += collect(net, 0.3)
    assert [h["t"] for h in got] == ["start"] * 3, got
    assert net.claims.duplicates == {} and net.left_identity == b"r1-a"
    answers = []
    while own.poll(200):
        answers.append(wire.decode(own.recv_multipart(), max_bytes=wire.MAX_HEADER_BYTES)[0]["t"])
    assert answers and set(answers) == {"pong"}, answers
    assert not remnant.poll(100)  # the remnant is not answered
    # a second daemon (another incarnation) claiming the rank is still refused
    other = left(b"r1-b")
    other.send_multipart(ping(settings, "b"))
    collect(net, 0.3)
    own.send_multipart(ping(settings, "a"))
    collect(net, 0.3)
    assert "two daemons claim rank 1" in net.claims.duplicates.get(1, ""), net.claims.duplicates
