"""The result doorbell (birdnet.door): a FIFO from the daemon's ring worker to one process.

Real FIFOs under /dev/shm and a real birdnetd (one node; the doorbell does not depend on peers)."""
from __future__ import annotations

import os
import stat
import time

import numpy as np
import pytest
from birdnet.client import Client
from birdnet.client._connection import Connection
from cluster import LocalCluster

from birdnet.door import ATOMIC_BYTES, Bell, BellWriter, Door, DoorReader
from birdnet.errors import ProtocolError
from birdnet.shm import SHM_DIR, new_name


@pytest.fixture
def door():
    d = Door(new_name("bntestdoor-"))
    r = DoorReader(d.name)
    yield d, r
    r.close()
    d.close()


def test_headers_arrive_in_order_and_whole(door):
    d, r = door
    assert stat.S_ISFIFO(os.stat(os.path.join(SHM_DIR, d.name)).st_mode)
    assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, d.name)).st_mode) == 0o600
    for i in range(100):
        assert d.send({"t": "done", "call": i, "stats": {"seconds": 0.5, "key": "x" * (i % 7)}})
    r.read()
    assert [h["call"] for h in r.pending] == list(range(100))
    assert r.pending[3]["stats"] == {"seconds": 0.5, "key": "xxx"}


def test_what_the_pipe_cannot_take_is_refused_not_lost(door):
    d, r = door
    # larger than one atomic write: refused (the daemon replies over the socket instead)
    assert not d.send({"t": "done", "call": 1, "stats": {"s": "x" * ATOMIC_BYTES}})
    # a process that stops reading: the pipe fills, then send says no instead of blocking
    sent = 0
    while d.send({"t": "done", "call": sent, "stats": {"pad": "y" * 200}}):
        sent += 1
        assert sent < 10_000, "a pipe is 64 KiB by default: it must fill"
    assert sent > 50
    r.read()
    assert [h["call"] for h in r.pending] == list(range(sent))  # every accepted one arrives whole
    d.close()
    assert not d.send({"t": "done", "call": 0})  # closed: refused, no write to a reused descriptor
    r.read()
    assert r.eof  # the daemon's end went away: the process stops polling it
    assert not os.path.exists(os.path.join(SHM_DIR, d.name))


def test_garbage_is_dropped(door):
    d, r = door
    os.write(d._fd, b"\xc1\xc1\xc1")  # never-used msgpack bytes
    r.read()
    assert not r.pending
    os.write(d._fd, b"\x01")  # valid msgpack, not a map
    assert d.send({"t": "done", "call": 7})
    r.read()
    assert [h["call"] for h in r.pending] == [7]


def _shm_names(sock: str) -> set[str]:
    from birdnet.shm import segment_prefix
    prefix = segment_prefix(sock)
    return {f for f in os.listdir(SHM_DIR) if f.startswith(prefix)}


@pytest.mark.timeout(120)
def test_results_come_through_the_doorbell_and_the_slot_is_free_at_once(tmp_path):
    """With the doorbell the process has its result before the daemon's main thread has seen the
    round finish, and may at once reuse or grow the slot; here every call needs a bigger segment
    than the last (an ``alloc`` of the same slot right after each result)."""
    with LocalCluster(1, tmp_path) as cl:
        sock = cl.sockets[0]
        with Client(sock, job="door") as c:
            assert c._conn.door is not None
            assert c._conn.door.name in _shm_names(sock)  # until the first call announces it
            got = 0
            for i in range(200):
                x = np.full(100 + i, float(i), np.float32)
                out = c.allreduce(x, name="g", timeout=30)
                assert out.tolist() == x.tolist()
                got += 1
            # the FIFO's name is gone once the process announced it; both ends stay open
            assert c._conn.door.name not in _shm_names(sock) and c._conn.door.fd is not None
        assert got == 200
        deadline = time.monotonic() + 5
        while _shm_names(sock) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _shm_names(sock) == set()  # segments and doorbell removed when the process left


class _Counting(DoorReader):
    received = 0

    def read(self) -> None:
        before = len(self.pending)
        super().read()
        _Counting.received += len(self.pending) - before


@pytest.mark.timeout(120)
def test_which_way_results_come(tmp_path, monkeypatch):
    import birdnet.client._connection as connection_mod
    monkeypatch.setattr(connection_mod, "DoorReader", _Counting)

    class OldConnection(Connection):  # an older client: its hello does not ask for a doorbell
        def send(self, header):
            super().send({k: v for k, v in header.items() if k != "door"})

    class NoDoor(Client):
        _Connection = OldConnection

    class UnannouncedConnection(Connection):  # has the doorbells, never says so in a call (nor uses the submit FIFO)
        def connect(self, timeout):
            welcome = super().connect(timeout)
            if self.bell is not None:
                self.bell.send = lambda header: False
            return welcome

        def send(self, header):
            super().send({k: v for k, v in header.items() if not (k == "door" and header["t"] == "submit")})

    class Unannounced(Client):
        _Connection = UnannouncedConnection

    with LocalCluster(1, tmp_path) as cl:
        sock = cl.sockets[0]
        _Counting.received = 0
        with Client(sock, job="a") as c:
            for i in range(5):
                assert c.allreduce(np.full(10, i, np.float32), timeout=30).tolist() == [i] * 10
        assert _Counting.received == 5  # all five through the doorbell
        _Counting.received = 0
        with NoDoor(sock, job="b") as c:
            assert c._conn.door is None
            for i in range(5):
                assert c.allreduce(np.full(10, i, np.float32), timeout=30).tolist() == [i] * 10
        with Unannounced(sock, job="c") as c:
            assert c._conn.door is not None
            for i in range(5):
                assert c.allreduce(np.full(10, i, np.float32), timeout=30).tolist() == [i] * 10
        assert _Counting.received == 0  # the daemon wrote nothing a process did not say it reads
        # errors still come over the socket, with their class
        with Client(sock, job="d") as c:
            with pytest.raises(ValueError, match="keeps error-feedback state"):  # the daemon's InputError
                c.allreduce(np.ones(5000, np.float32), codec="topk", timeout=30)


def test_submit_fifo_carries_maps_and_survives_garbage():
    b = Bell(new_name("bntestbell-"))
    w = BellWriter(b.name)
    try:
        assert all(w.send({"t": "submit", "seq": i}) for i in range(50))
        assert [m["seq"] for m in b.read()] == list(range(50))
        assert not w.send({"t": "submit", "name": "x" * ATOMIC_BYTES})  # too large: the socket takes it
        os.write(w.fd, b"\xc1")
        assert b.read() == [] and b.garbage == 1
        assert w.send({"t": "submit", "seq": 50})
        assert [m["seq"] for m in b.read()] == [50]  # the stream starts over after garbage
    finally:
        w.close()
        b.close()
    assert not os.path.exists(os.path.join(SHM_DIR, b.name))


@pytest.mark.timeout(120)
def test_calls_through_the_submit_fifo_and_what_the_daemon_does_with_bad_ones(tmp_path):
    with LocalCluster(1, tmp_path) as cl:
        with Client(cl.sockets[0], job="bell") as c:
            assert c._conn.bell is not None
            sent = []
            orig = c._conn.bell.send
            c._conn.bell.send = lambda h: sent.append(h["t"]) or orig(h)
            c.barrier(timeout=30)
            assert c.allreduce(np.arange(5, dtype=np.float32), timeout=30).tolist() == [0, 1, 2, 3, 4]
            assert sent == ["submit", "submit"]  # both calls went through the FIFO
            # a map that is not a call, a call with a bad field: refused over the socket, by call number
            orig({"t": "status", "call": 900001})
            orig({"t": "submit", "call": 900002, "seq": "x", "kind": "allreduce"})
            deadline = time.monotonic() + 20
            while not {900001, 900002} <= set(c._replies.received) and time.monotonic() < deadline:
                c._replies.pump(0.1)
            assert c._replies.received[900001]["t"] == "error" and "unknown request" in c._replies.received[900001]["message"]
            assert c._replies.received[900002]["t"] == "error" and "seq" in c._replies.received[900002]["message"]
            # bytes that are not msgpack: the process hears it (not a silent loss), then goes on
            os.write(c._conn.bell.fd, b"\xc1\xc1")
            with pytest.raises(ProtocolError, match="undecodable bytes in the submit FIFO"):
                c._replies.wait(-1, 20)
            assert c.allreduce(np.ones(3, np.float32), timeout=30).tolist() == [1.0] * 3
        assert "undecodable" in cl.log(0)


def test_submit_fifo_reader_never_raises_on_random_bytes():
    """Whatever a process writes into its submit FIFO, reading it returns messages or counts
    garbage; it never raises into the daemon's main loop (seeded random blobs)."""
    rng = np.random.default_rng(7)
    b = Bell(new_name("bntestbell-"))
    try:
        for _ in range(300):
            blob = rng.integers(0, 256, int(rng.integers(1, 600)), dtype=np.uint8).tobytes()
            os.write(b.fd, blob)
            assert isinstance(b.read(), list)
        assert b.garbage > 0
    finally:
        b.close()


@pytest.mark.timeout(240)
def test_calls_split_between_fifo_and_socket_run_in_call_order(tmp_path):
    """A call whose header is too large for the submit FIFO goes over the socket; calls before and
    after it go through the FIFO and may reach the daemon first. Every node must still run the
    job's rounds as numbered (a round matched with another call's on a neighbour would fail or
    hang), so every result is the exact sum of that call's inputs."""
    import workers
    count = 30
    with LocalCluster(3, tmp_path) as cl:
        for _ in range(3):
            res = cl.run(workers.mixed_paths, count, timeout=200)
            for firsts, paths in res:
                assert firsts == [3.0 * i for i in range(count)]
                assert paths == {"fifo": count - 10, "socket": 10}
