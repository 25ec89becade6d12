"""Faults on real processes: daemons killed (SIGKILL) and restarted, clients killed, SIGTERM in a
round, stale shared memory, a link cut and restored (network namespaces). LocalCluster passes
--peer-timeout 4 --heartbeat-interval 0.25, so "within the timeout" means about 4 s."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import LocalCluster, wait_ring_ok

from birdnet.bench import netns
from birdnet.hosts import load_hosts

pytestmark = pytest.mark.heavy  # CI runs it on the default Python only (.ci/run)

PEER_TIMEOUT = 4.0
SLACK = 3.0  # detection runs on heartbeats (0.25 s) and the loops' poll intervals
HERE = Path(__file__).resolve().parent


class Driver:
    """A long-lived training process (tests/client_driver.py) that survives daemon restarts."""

    def __init__(self, sock: str, job: str = "default") -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, str(HERE / "client_driver.py"), sock, job], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.ready = self.read(30)
        assert self.ready.get("ready"), self.ready

    def send(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 30) -> dict:
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            raise TimeoutError(f"no answer from the client within {timeout} s (a hang)")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"client exited: {self.proc.stderr.read()[-2000:]}")
        return json.loads(line)

    def call(self, cmd: str, timeout: float = 30) -> dict:
        self.send(cmd)
        return self.read(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass


def together(ds: list[Driver], cmd: str, timeout: float = 30) -> list[dict]:
    """Every driver runs ``cmd`` (a collective: all must be sent before any answer can come)."""
    for x in ds:
        x.send(cmd)
    return [x.read(timeout) for x in ds]


@pytest.fixture
def drivers():
    started: list[Driver] = []

    def make(sock: str, job: str = "default") -> Driver:
        d = Driver(sock, job)
        started.append(d)
        return d

    yield make
    for d in started:
        d.kill()


def shm_prefix(sock: str) -> str:
    from birdnet.shm import segment_prefix
    return segment_prefix(sock)


def segments(sock: str) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(shm_prefix(sock)))


def memfds(cl: LocalCluster, i: int) -> int:
    """Sealed segments (memfds, birdnet.shm.Segment.sealed) node ``i``'s daemon has mapped."""
    with open(f"/proc/{cl.procs[i].pid}/maps") as f:
        return sum("/memfd:birdnet" in line for line in f)


@pytest.mark.timeout(120)
def test_sigkill_mid_round_names_the_peer_then_restart_recovers(tmp_path, drivers):
    # The ring path: a gathered round (under --hop-latency-bytes) whose every vector already
    # reached the survivors completes there with the exact sum, so it would not show the loss.
    with LocalCluster(3, tmp_path, extra=["--hop-latency-bytes", "0"]) as cl:
        d = [drivers(s) for s in cl.sockets]
        for x in d:
            x.send("buffer 1000")
        assert [x.read()["ok"] for x in d] == [6.0] * 3
        # its segment is a sealed memfd (birdnet.shm.Segment.sealed): nothing named in /dev/shm
        assert segments(cl.sockets[1]) == []
        # A long round: node 2's process is late, so nodes 0 and 1 wait in the round.
        d[0].send("round 1000")
        d[1].send("round 1000")
        d[2].send("delay 2 round 1000")
        time.sleep(0.5)
        t_kill = time.monotonic()
        cl.send_signal(1, signal.SIGKILL)
        cl.procs[1].wait(10)
        r0, r1, r2 = d[0].read(PEER_TIMEOUT + 10), d[1].read(10), d[2].read(PEER_TIMEOUT + 10)
        waited = time.monotonic() - t_kill
        # the killed node's own process learns it at once; the others name the lost peer
        assert r1["error"] == "DaemonUnavailableError" and r1["seconds"] < 3, r1
        for r in (r0, r2):
            assert r.get("error") == "PeerLostError" and "rank 1" in r["message"], r
        assert waited < PEER_TIMEOUT + SLACK, waited
        # the killed instance's memfds went with it; named files it left (doorbells of processes
        # that never submitted, --shm-group segments) the next start removes (remove_stale)
        assert segments(cl.sockets[1]) == []
        cl.start_node(1)
        wait_ring_ok(cl)
        # nobody else restarted: node 1's process reconnects by itself; call numbers still agree
        for cmd in ("round 1000", "buffer 1000"):
            for x in d:
                x.send(cmd)
            res = [x.read() for x in d]
            assert [r.get("ok") for r in res] == [6.0] * 3, res
        assert res[1]["same"]  # a buffer() array of the old daemon still gets its result in place


@pytest.mark.timeout(60)
def test_a_killed_daemon_never_restarted_leaves_no_shared_memory_after_the_harness(tmp_path, drivers):
    """LocalCluster (tests, `birdnet bench`) removes what a daemon killed by a signal left in
    /dev/shm when the cluster stops, as a restarted daemon would; a daemon that shut down cleanly
    is left to clean up after itself (tests check that)."""
    with LocalCluster(2, tmp_path) as cl:
        d = [drivers(s) for s in cl.sockets]
        for x in d:
            x.send("buffer 1000")
        assert [x.read()["ok"] for x in d] == [3.0] * 2
        # Segments are memfds and a process's doorbells are unlinked once it uses them: what stays
        # named is the doorbells of a process that said hello and never called.
        import zmq

        from birdnet import PROTOCOL_VERSION, wire
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.connect(f"ipc://{cl.sockets[1]}")
        raw.send_multipart(wire.encode({"t": "hello", "proto": PROTOCOL_VERSION, "job": "idle", "pid": os.getpid(),
                                        "door": True}))
        assert raw.poll(5000)
        raw.recv_multipart()
        assert len(segments(cl.sockets[1])) == 2
        cl.send_signal(1, signal.SIGKILL)
        cl.procs[1].wait(10)
        raw.close(0)
        ctx.term()
        assert len(segments(cl.sockets[1])) == 2, "a killed daemon cannot unlink its files"
    assert segments(cl.sockets[1]) == []
    assert segments(cl.sockets[0]) == []


# A daemon killed in a round and back before anyone counts it lost (systemd restarts it in well
# under peer_timeout): its new instance knows nothing of the round. Its neighbours see the new
# incarnation (in its first ping, or in its pongs) and fail the round, and the abort travels round
# the ring, so every call fails at once instead of waiting round_timeout (600 s) for an agreement
# or data that cannot come. Node `late`'s process is 2 s late, so the round is mid-agreement.
@pytest.mark.timeout(120)
@pytest.mark.parametrize("killed,late", [(0, 2), (1, 2), (2, 1)], ids=["leader", "middle", "last"])
def test_daemon_restarted_mid_round_before_it_counts_as_lost(tmp_path, drivers, killed, late):
    with LocalCluster(3, tmp_path) as cl:
        d = [drivers(s) for s in cl.sockets]
        assert [r.get("ok") for r in together(d, "round 1000")] == [6.0] * 3
        for i, x in enumerate(d):
            x.send("delay 2 round 1000" if i == late else "round 1000")
        time.sleep(0.5)
        t = time.monotonic()
        cl.send_signal(killed, signal.SIGKILL)
        cl.procs[killed].wait(10)
        cl.start_node(killed)
        restart = time.monotonic() - t
        assert restart < PEER_TIMEOUT - 1, "the restart must beat peer_timeout for this test"
        for i, x in enumerate(d):
            r = x.read(PEER_TIMEOUT + 10)
            if i == killed:
                assert r["error"] == "DaemonUnavailableError", r
            else:
                # failed by the restart itself (the new incarnation), not by a timeout
                assert r["error"] == "PeerLostError" and f"neighbour rank {killed}" in r["message"], r
                assert "restarted" in r["message"], r
                # as soon as the new instance is up (the call began 0.5 s before the kill), or (the
                # late one) as soon as its process submits: never after a timeout. The restart's
                # own time is the machine's (1-2.5 s under load), so it is measured, not assumed.
                assert r["seconds"] < (2 if i == late else 0) + 0.5 + restart + SLACK, (r, restart)
        for _ in range(2):
            assert [r.get("ok") for r in together(d, "round 1000")] == [6.0] * 3


@pytest.mark.timeout(120)
def test_client_killed_mid_round_frees_its_session_and_others_go_on(tmp_path, drivers):
    with LocalCluster(3, tmp_path) as cl:
        d = [drivers(s) for s in cl.sockets]
        assert [r.get("ok") for r in together(d, "round 100000")] == [6.0] * 3
        assert memfds(cl, 1)  # the session's segment
        d[1].send("round 100000")  # submitted; the round waits for nodes 0 and 2
        time.sleep(0.5)
        d[1].kill()
        t = time.monotonic()
        # whichever the daemon sees first: its connection closing, or the pid gone (the reaper)
        left = ("left job 'default' (connection closed)", "left job 'default' (process exited)")
        while not any(m in cl.log(1) for m in left) and time.monotonic() - t < 5:
            time.sleep(0.1)
        assert any(m in cl.log(1) for m in left)  # session and its segments freed
        assert segments(cl.sockets[1]) == []
        # the killed process's contribution was handed over: the round in flight completes
        assert [r.get("ok") for r in together([d[0], d[2]], "round 100000")] == [6.0, 6.0]
        # the job's next round cannot complete on node 1: a fast, clear error, not a round_timeout wait
        d[0].send("round 10")
        d[2].send("round 10")
        for r in (d[0].read(15), d[2].read(15)):
            assert r["error"] == "ProcessLostError" and "node rank 1" in r["message"], r
            assert r["seconds"] < 3
        # other jobs and nodes go on
        e = [drivers(s, job="second") for s in cl.sockets]
        assert [r.get("ok") for r in together(e, "round 10")] == [6.0] * 3


@pytest.mark.timeout(120)
def test_daemon_restarted_while_clients_idle(tmp_path, drivers):
    with LocalCluster(2, tmp_path) as cl:
        d = [drivers(s) for s in cl.sockets]
        assert [r.get("ok") for r in together(d, "round 10")] == [3.0, 3.0]
        t = time.monotonic()
        assert cl.stop_node(1) == 0
        cl.start_node(1)
        down = time.monotonic() - t
        took = wait_ring_ok(cl)
        assert took < PEER_TIMEOUT + SLACK
        next_call_after_restart(d, down)
        # killed while idle, restarted: the same
        t = time.monotonic()
        cl.send_signal(0, signal.SIGKILL)
        cl.procs[0].wait(10)
        cl.start_node(0)
        down = time.monotonic() - t
        wait_ring_ok(cl)
        next_call_after_restart(d, down)


def next_call_after_restart(d: list[Driver], down: float) -> None:
    """The first call on every node after a daemon was restarted while its clients were idle: it
    works. Only when the restart itself took about peer_timeout (a loaded machine) may the node
    that stayed up count the peer lost for a moment after it is back (it counts from the old
    instance's last pong): then that call fails with PeerLostError on every node, at once, and the
    next one works. Never a hang (Driver.read raises after 30 s)."""
    res = together(d, "round 10")
    if down > PEER_TIMEOUT - 2 and all(r.get("error") == "PeerLostError" for r in res):
        res = together(d, "round 10")
    assert [r.get("ok") for r in res] == [3.0, 3.0], res


def peer_lost_on(cl: LocalCluster, i: int, rank: int, timeout: float = 15.0) -> None:
    """Until daemon i reports peer ``rank`` lost."""
    from birdnet.client import Client
    deadline = time.monotonic() + timeout
    while True:
        with Client(cl.sockets[i], job="__test_status__", connect_timeout=2) as c:
            if c.status()["peers"][rank]["state"] == "lost":
                return
        assert time.monotonic() < deadline, f"daemon {i} never reported rank {rank} lost"
        time.sleep(0.2)


# A restart that takes about peer_timeout is seen as a loss by one node only, for a moment (the
# survivor counts from the old instance's last pong and reconnects with a back-off). A call made
# in that moment fails on that node alone; the same call on the other node must fail too, at once,
# instead of waiting round_timeout (600 s) for an agreement that cannot come: that was the hang of
# test_daemon_restarted_while_clients_idle. Pausing a daemon (SIGSTOP) makes the one-sided loss
# deterministic.
@pytest.mark.timeout(120)
@pytest.mark.parametrize("paused", [0, 1], ids=["leader_paused", "follower_paused"])
def test_a_round_failed_on_one_node_alone_fails_on_the_others(tmp_path, drivers, paused):
    other = 1 - paused
    with LocalCluster(2, tmp_path) as cl:
        d = [drivers(s) for s in cl.sockets]
        assert [r.get("ok") for r in together(d, "round 10")] == [3.0, 3.0]
        cl.send_signal(paused, signal.SIGSTOP)
        try:
            peer_lost_on(cl, other, paused)
            r = d[other].call("within 20 round 10")  # fails here alone: the peer is lost
            assert r.get("error") == "PeerLostError" and f"rank {paused}" in r["message"], r
        finally:
            cl.send_signal(paused, signal.SIGCONT)
        wait_ring_ok(cl)
        # the same call on the paused node: a clear error within a few heartbeats, not a wait
        r = d[paused].call("within 20 round 10", 30)
        assert r.get("error") == "PeerLostError" and r["seconds"] < PEER_TIMEOUT + SLACK, r
        assert f"rank {paused}" in r["message"], r
        # call numbering still agrees: the next call works everywhere
        assert [r.get("ok") for r in together(d, "round 10")] == [3.0, 3.0]
        # a new run of the job numbers its calls from 0 again: the failed call's number is no
        # longer doomed (each daemon forgets what it failed alone when a job comes back)
        for x in d:
            x.kill()
        t = time.monotonic()
        while any(segments(s) for s in cl.sockets) and time.monotonic() - t < 10:
            time.sleep(0.1)  # until both daemons have noticed the exits and ended the sessions
        e = [drivers(s) for s in cl.sockets]
        for _ in range(3):
            assert [r.get("ok") for r in together(e, "round 10")] == [3.0, 3.0]


@pytest.mark.timeout(60)
def test_next_call_without_a_daemon_fails_clearly(tmp_path, drivers):
    with LocalCluster(1, tmp_path) as cl:
        d = drivers(cl.sockets[0])
        assert d.call("round 10")["ok"] == 1.0
        cl.stop_node(0)
        r = d.call("round 10", 30)
        assert r["error"] == "DaemonUnavailableError" and "went away" in r["message"], r
        assert r["seconds"] < 12  # reconnect_timeout (10 s) at most
        cl.start_node(0)
        assert d.call("round 10")["ok"] == 1.0


@pytest.mark.timeout(90)
def test_sigterm_during_a_round_aborts_cleanly(tmp_path, drivers):
    with LocalCluster(2, tmp_path) as cl:
        d = [drivers(s) for s in cl.sockets]
        assert [r.get("ok") for r in together(d, "round 1000")] == [3.0, 3.0]
        d[0].send("round 1000")  # node 1's process is not coming: the round waits
        time.sleep(0.5)
        assert memfds(cl, 0)
        t = time.monotonic()
        code = cl.stop_node(0, signal.SIGTERM)
        assert code == 0 and time.monotonic() - t < 8
        r = d[0].read(10)
        assert r["error"] in ("ShutdownError", "DaemonUnavailableError"), r
        assert segments(cl.sockets[0]) == [] and not os.path.exists(cl.sockets[0])
        assert "stopped" in cl.log(0)
        # a round in its data phase: a large tensor on both nodes, SIGTERM while it runs
        cl.start_node(0)
        wait_ring_ok(cl)
        for x in d:
            x.send("round 20000000")
        time.sleep(0.3)
        code = cl.stop_node(1, signal.SIGTERM)
        assert code == 0
        res = [x.read(PEER_TIMEOUT + 10) for x in d]
        assert all(("ok" in r and r["ok"] == 3.0) or r.get("error") in ("ShutdownError", "PeerLostError",
                                                                          "DaemonUnavailableError", "RoundAborted")
                   for r in res), res
        assert segments(cl.sockets[1]) == []


def _reset_connections_until(cl, port: int, done, job) -> int:
    """Reset (``ss -K``) the TCP connections to ``port`` every 0.3 s while ``job`` (a run_async of
    workers.steady_calls) runs, until ``done(cl)`` or 30 resets; skips the test where ss cannot kill
    sockets. Returns the number of resets that hit an established connection."""
    kills = tries = 0
    while kills < 30 and tries < 100 and not done(cl):
        tries += 1
        r = subprocess.run(["ss", "-K", "dport", "=", str(port)], capture_output=True, text=True)
        if r.returncode != 0 or (kills == 0 and tries > 20):
            job.terminate()
            pytest.skip(f"cannot reset TCP connections here (ss -K: {r.stderr.strip()[:200] or 'nothing killed'})")
        kills += "ESTAB" in r.stdout  # none while ZeroMQ is reconnecting: try again
        time.sleep(0.3)
    return kills


def _check_steady_calls(res: list, calls: int) -> set[int]:
    """Every node made every call; each is right (3.0 on 3 nodes) or failed as a lost message fails a
    round, and none waited for a timeout (not round_timeout, not even peer_timeout). Returns the
    failed call numbers; the calls after the last of them all worked."""
    failed = set()
    for node, out in enumerate(res):
        assert len(out) == calls
        for i, (what, value, took) in enumerate(out):
            if what == "ok":
                assert value == 3.0, (node, i, value)
            else:
                assert what in ("ProtocolError", "PeerLostError", "RoundAborted"), (node, i, what, value)
                failed.add(i)
            assert took < PEER_TIMEOUT, (node, i, what, value, took)
    if failed:
        assert max(failed) < calls - 20, failed
        assert all(out[i][0] == "ok" for out in res for i in range(max(failed) + 1, calls))
    return failed


def _status_text(sock: str) -> str:
    r = subprocess.run([sys.executable, "-m", "birdnet.cli", "status", "--socket", sock], capture_output=True,
                       text=True, timeout=30)
    return r.stdout + r.stderr


@pytest.mark.timeout(300)
def test_tcp_connection_reset_mid_round_fails_that_round_fast_and_the_next_works(tmp_path):
    """A TCP connection between two daemons that both stay up is reset (``ss -K``, as a NAT box or
    a flapping link would) while rounds run: ZeroMQ reconnects at once, the messages that were in
    flight are lost, and the jump in the numbering of the left neighbour's messages (at its next
    message, or its next ping when the lost one was a round's last) fails the round on the node that
    misses them, within a fraction of a second; the abort fails it wherever it has not finished. No
    result is ever wrong, and the calls after the last reset all work. Before the numbering a lost
    last message was noticed only by the timeouts (a lane round waited round_timeout, then
    peer_timeout; found in CI): round_timeout is 10 s here so that a regression fails within the
    test, and every call must end well before it."""
    import workers
    if subprocess.run(["ss", "-V"], capture_output=True).returncode != 0:
        pytest.skip("needs iproute2's ss")
    calls = 300

    def lost_one(cl) -> bool:
        return any(re.search(r"round default/\d+ failed", cl.log(i)) for i in range(3))

    with LocalCluster(3, tmp_path, extra=["--round-timeout", "10"]) as cl:
        port1 = load_hosts(cl.hosts)[1].port  # node 1's peer port: only node 0 connects to it
        w = cl.run_async(workers.steady_calls, calls, 4_000_000)
        time.sleep(2.0)
        kills = _reset_connections_until(cl, port1, lost_one, w)
        res = w.get(timeout=240)
        assert lost_one(cl), f"{kills} resets and no round lost a message: the test proves nothing"
        node1_log = cl.log(1)
        status = _status_text(cl.sockets[1])
        assert re.search(r"messages lost from the left neighbour: [1-9]", status), status
    assert _check_steady_calls(res, calls)
    # the node that missed a message says what that means, and counts what it lost
    messages = [value for out in res for what, value, _ in out if what != "ok"]
    assert any("TCP connection between the two daemons broke" in m for m in messages), messages[:5]
    assert re.search(r"message\(s\) from left neighbour rank 0 .* were lost", node1_log), node1_log[-3000:]


@pytest.mark.timeout(300)
def test_elastic_tcp_connection_reset_costs_at_most_the_round_in_flight(tmp_path):
    """The same resets in elastic mode, where every node connects to every other: each connection is
    numbered on its own, the losses are noticed and counted, no result is wrong, and no call waits
    for a timeout (round_timeout is 10 s here, every call must end before peer_timeout). A lost data
    message or ``go`` fails that round at once; a lost ``start`` makes the agreement start again.
    The case the numbering exists for, a lost ``start`` (the leader waited round_timeout for it to
    come back round), needs a reset at one precise moment and is pinned down on sockets in
    tests/test_peers.py; resets alone rarely hit it, and lost data is caught at the next message by
    the ring's step check even without the numbering, so this test guards the counting and the
    absence of waits rather than that case."""
    import workers
    if subprocess.run(["ss", "-V"], capture_output=True).returncode != 0:
        pytest.skip("needs iproute2's ss")
    calls = 200

    def noticed(cl) -> bool:
        return any(re.search(r"message\(s\) from rank \d .* were lost", cl.log(i)) for i in range(3))

    with LocalCluster(3, tmp_path, extra=["--elastic", "--round-timeout", "10"]) as cl:
        port1 = load_hosts(cl.hosts)[1].port  # nodes 0 and 2 connect to it
        w = cl.run_async(workers.steady_calls, calls, 4_000_000)
        time.sleep(2.0)
        kills = _reset_connections_until(cl, port1, noticed, w)
        res = w.get(timeout=240)
        assert noticed(cl), f"{kills} resets and no lost message noticed: the test proves nothing"
        statuses = [_status_text(sock) for sock in cl.sockets]
        assert any(re.search(r"messages lost from peers: [1-9]", st) for st in statuses), statuses
    _check_steady_calls(res, calls)  # a lost start fails no call: maybe none failed


ok_ns, why_ns = netns.available()


@pytest.mark.timeout(150)
@pytest.mark.netns
@pytest.mark.skipif(not ok_ns, reason=f"network namespaces unavailable: {why_ns}")
def test_link_cut_times_out_then_recovers(tmp_path, drivers):
    with netns.NetnsCluster(3) as nc:
        cl = LocalCluster(3, tmp_path, addresses=nc.addresses, prefixes=[nc.exec_prefix(i) for i in range(3)])
        with cl:
            d = [drivers(s) for s in cl.sockets]
            assert [r.get("ok") for r in together(d, "round 1000")] == [6.0] * 3
            nc.link(1, False)
            t = time.monotonic()
            for x in d:
                x.send("round 1000")
            res = [x.read(PEER_TIMEOUT + 15) for x in d]
            for r in res:
                assert r.get("error") == "PeerLostError" and "rank" in r["message"], r
            assert time.monotonic() - t < PEER_TIMEOUT + SLACK
            nc.link(1, True)
            took = wait_ring_ok(cl, timeout=30)
            for x in d:
                x.send("round 1000")
            res = [x.read(30) for x in d]
            assert [r.get("ok") for r in res] == [6.0] * 3, (res, took)
