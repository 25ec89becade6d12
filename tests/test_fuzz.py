"""Hostile input against a real daemon's peer port and client socket (property-based, bounded):
random bytes, truncated and oversized frames, wrong protocol versions, stale and future round ids,
headers with wrong types, a peer claiming another rank. Afterwards every daemon is alive and a
normal round still gives the exact sum."""
from __future__ import annotations

import time

import fault_workers
import msgpack
import pytest
import zmq
from cluster import LocalCluster, wait_ring_ok
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from birdnet import PROTOCOL_VERSION
from birdnet.config import Settings
from birdnet.wire import PROTOCOL_ID as PID  # this build's "birdnet/N"

pytestmark = pytest.mark.heavy  # CI runs it on the default Python only (.ci/run)

MAX_MESSAGE = 1 << 20  # the fuzzed cluster's --max-message-bytes: oversized frames are cheap to make
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
# chunks of chunk_bytes (1 MiB) only: growing ones would not fit under MAX_MESSAGE
EXTRA = ["--max-message-bytes", str(MAX_MESSAGE), "--max-chunk-bytes", "0", "--round-timeout", "3"]
CW = Settings(peer_timeout=4.0, heartbeat_interval=0.25, max_chunk_bytes=0).cluster_wide()  # LocalCluster's timeouts


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    cl = LocalCluster(2, tmp_path_factory.mktemp("fuzz"), extra=EXTRA)
    cl.start()
    ports = [int(line.rsplit(":", 1)[1]) for line in cl.hosts.read_text().splitlines() if not line.startswith("#")]
    ctx = zmq.Context()
    yield cl, ports, ctx
    ctx.destroy(0)
    codes = cl.stop()
    assert codes == [0, 0], [cl.log(i)[-3000:] for i in range(2)]


def _alive_and_working(cl: LocalCluster) -> None:
    for i, p in enumerate(cl.procs):
        assert p is not None and p.poll() is None, f"daemon {i} died: {cl.log(i)[-3000:]}"
    for i in range(2):
        assert "Traceback" not in cl.log(i), cl.log(i)[-3000:]
    time.sleep(3.5)  # let bogus rounds started by the fuzzer expire (round_timeout 3 s)
    # A fuzzed ping that passed the handshake claiming a rank makes two daemons claim it: both are
    # refused until one has been silent for peer_timeout (4 s; daemon/handshake.py DuplicateClaims)
    wait_ring_ok(cl, timeout=20.0)
    res = cl.run(fault_workers.try_round, 1000, 20.0)
    assert [r[:2] for r in res] == [("ok", 3.0)] * 2, res


def _drain(sock: zmq.Socket) -> None:
    while sock.poll(0):
        sock.recv_multipart()


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**62, 2**62), st.sampled_from([2**63 - 1, -2**63, 2**64 - 1]), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                      max_leaves=10)
keys = st.one_of(st.just("default/0"), st.just("default/999999999"), st.just("default/-1"),
                 st.text(max_size=12), st.integers(-2**63, 2**64 - 1), st.none())  # what msgpack can carry


@st.composite
def peer_messages(draw):
    kind = draw(st.sampled_from(["bytes", "header", "header", "valid-ping-then", "sizes", "oversized"]))
    pid = draw(st.sampled_from([PID, PID, b"birdnet/9", b"birdnet/", b"", b"xyz"]))
    if kind == "bytes":
        return draw(st.lists(st.binary(max_size=300), min_size=0, max_size=5))
    t = draw(st.sampled_from(["ping", "pong", "refuse", "start", "go", "abort", "data", "junk", 7, None]))
    h = {"t": t, "k": draw(keys)}
    h.update(draw(st.dictionaries(st.sampled_from(["proto", "world", "rank", "cw", "lost", "inc", "descs", "ok",
                                                    "err", "errc", "counts", "reason", "nbuf", "sizes"]),
                                  values, max_size=6)))
    bufs = draw(st.lists(st.binary(max_size=64), max_size=3))
    if kind == "valid-ping-then":
        # a peer that passes the handshake as the receiver's left neighbour (without CURVE anyone
        # can), then sends rounds that do not exist, with stale or future ids and odd fields
        ping = {"t": "ping", "proto": PROTOCOL_VERSION, "cw": CW, "world": 2, "rank": draw(st.sampled_from([0, 1, 5, -1])),
                "inc": "fuzz", "lost": draw(st.sampled_from([[], [0], [1], [99], "x"])), "nbuf": 0, "sizes": []}
        return [[pid, msgpack.packb(ping)], [PID, msgpack.packb({**h, "nbuf": len(bufs),
                                                           "sizes": [len(b) for b in bufs]}), *bufs]]
    if kind == "sizes":
        h["nbuf"] = draw(st.one_of(st.integers(-3, 100), values))
        h["sizes"] = draw(st.one_of(st.lists(st.integers(-5, 2**40), max_size=4), values))
    elif kind == "oversized":
        h["nbuf"], h["sizes"] = 1, [MAX_MESSAGE * 2]
        return [pid, msgpack.packb(h), b"\0" * (MAX_MESSAGE + 4096)]
    else:
        h["nbuf"], h["sizes"] = len(bufs), [len(b) for b in bufs]
    raw = msgpack.packb(h, use_bin_type=draw(st.booleans()))
    if draw(st.booleans()):
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]  # truncated header
    return [pid, raw, *bufs]


@pytest.mark.timeout(120)
def test_fuzz_peer_port(ring):
    cl, ports, ctx = ring
    socks = []
    for port in ports:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port}")
        socks.append(s)

    @FUZZ
    @given(node=st.integers(0, 1), msg=peer_messages())
    def fuzz(node, msg):
        msgs = msg if msg and isinstance(msg[0], list) else [msg]
        for m in msgs:
            if m:
                socks[node].send_multipart(m)
        _drain(socks[node])

    fuzz()
    for s in socks:
        s.close(0)
    _alive_and_working(cl)


@st.composite
def client_requests(draw):
    t = draw(st.sampled_from(["hello", "alloc", "submit", "submit", "status", "warm", "bye", "junk", 3]))
    h = {"t": t, "call": draw(st.one_of(st.integers(-5, 10), values))}
    if t == "hello":
        h.update(proto=draw(st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 2, "1", None])),
                 job="fz" + draw(st.text(max_size=8)), pid=draw(st.one_of(st.just(1), st.integers(-5, 2**40), values)))
    elif t == "alloc":
        h.update(slot=draw(st.one_of(st.integers(-3, 300), values)),
                 nbytes=draw(st.one_of(st.integers(-10, 1 << 40), values)))
    elif t == "warm":
        # codecs without kernels (or none at all): one with kernels would start a compile process per
        # new parameter set, which test_warmup covers
        h.update(codec=draw(st.sampled_from(["none", "fp16", "nope", 3, None])),
                 params=draw(st.one_of(st.dictionaries(st.text(max_size=8), values, max_size=3), values)))
    elif t == "submit":
        h.update(seq=draw(st.one_of(st.integers(-3, 2**62), values)),
                 kind=draw(st.sampled_from(["allreduce", "broadcast", "barrier", "reset", "nope", 1])),
                 name=draw(st.one_of(st.text(max_size=8), values)),
                 shape=draw(st.one_of(st.lists(st.integers(-2, 2**62), max_size=4), values)),
                 dtype=draw(st.sampled_from(["float32", "float16", "int64", "object", "V8", "<f4", 5])),
                 slot=draw(st.one_of(st.integers(-1, 3), values)),
                 op=draw(st.sampled_from(["mean", "sum", "max", None])),
                 root=draw(st.one_of(st.integers(-2, 5), values)))
        if draw(st.booleans()):
            h.update(codec=draw(st.sampled_from(["none", "fp16", "topk", "nope", 3])),
                     params=draw(st.one_of(st.dictionaries(st.text(max_size=8), values, max_size=3), values)))
    h.update(draw(st.dictionaries(st.text(max_size=5), values, max_size=2)))
    h["nbuf"], h["sizes"] = 0, []
    pid = draw(st.sampled_from([PID, PID, PID, b"birdnet/0", b"??"]))
    frames = [pid, msgpack.packb(h, use_bin_type=True)]
    if draw(st.integers(0, 9)) == 0:
        frames = draw(st.lists(st.binary(max_size=100), max_size=4))
    elif draw(st.integers(0, 19)) == 0:
        frames.append(b"\0" * 70000)  # over the client socket's message limit
    return frames


@pytest.mark.timeout(120)
def test_fuzz_client_socket(ring):
    cl, _ports, ctx = ring
    socks = []
    for _ in range(3):  # a few identities: sessions come and go
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{cl.sockets[1]}")
        socks.append(s)

    import os

    @FUZZ
    @given(who=st.integers(0, 2), frames=client_requests(), hello=st.booleans())
    def fuzz(who, frames, hello):
        job = f"fz{who}"
        if hello:  # most requests need a session to get past the first check
            socks[who].send_multipart([PID, msgpack.packb(
                {"t": "hello", "proto": PROTOCOL_VERSION, "job": job, "pid": os.getpid(), "nbuf": 0, "sizes": []})])
            socks[who].poll(200)
            _drain(socks[who])
            socks[who].send_multipart([PID, msgpack.packb(
                {"t": "alloc", "slot": 0, "nbytes": 4096, "call": 0, "nbuf": 0, "sizes": []})])
        if frames:
            socks[who].send_multipart(frames)
        socks[who].poll(5)
        _drain(socks[who])

    fuzz()
    for s in socks:
        s.send_multipart([PID, msgpack.packb({"t": "bye", "nbuf": 0, "sizes": []})])
        s.close(0)
    _alive_and_working(cl)
