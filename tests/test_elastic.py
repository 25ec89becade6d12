"""Elastic mode on real daemons (``birdnetd --elastic``): 4 nodes, one killed with SIGKILL; after
about peer_timeout the survivors' rounds succeed again on a 3-node ring (mean over their processes,
contributors without the dead node, bit-identical results); the node restarted with a fresh
training process rejoins and rounds include it again. Also the leader (rank 0) killed."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cluster import LocalCluster

pytestmark = pytest.mark.heavy  # CI runs it on the default Python only (.ci/run)

HERE = Path(__file__).resolve().parent
PEER_TIMEOUT = 4.0  # LocalCluster's --peer-timeout
N = 3000  # above the dense threshold, so codecs compress


class Driver:
    """A training process (tests/elastic_driver.py) steered over stdin/stdout."""

    def __init__(self, sock: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, str(HERE / "elastic_driver.py"), sock], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert self.read(30).get("ready")

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

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


@pytest.fixture
def drivers():
    started: list[Driver] = []

    def make(sock: str) -> Driver:
        d = Driver(sock)
        started.append(d)
        return d

    yield make
    for d in started:
        d.kill()


def together(ds: list[Driver], cmd: str, timeout: float = 40) -> list[dict]:
    for d in ds:
        d.send(cmd)
    return [d.read(timeout) for d in ds]


def node_vector(node: int) -> np.ndarray:
    return np.random.default_rng(node).standard_normal(N).astype(np.float32) + np.float32(node + 1)


def check(res: list[dict], nodes: list[int], exact: bool = True) -> None:
    """Every process got the same bytes, the mean over exactly ``nodes``' processes (its value
    checked for the dense codec; a sparse codec's first element may be zero)."""
    assert all("ok" in r for r in res), res
    assert all(r["contributors"] == nodes and r["count"] == len(nodes) for r in res), res
    assert len({r["digest"] for r in res}) == 1, res  # bit-identical on every participating node
    expect = np.mean([node_vector(i) for i in nodes], axis=0)[0]
    assert not exact or abs(res[0]["ok"] - expect) < 1e-4, (res[0], expect)


def until_ok(ds: list[Driver], cmd: str, limit: float) -> tuple[list[dict], float, list[list[dict]]]:
    """Run ``cmd`` on every driver until a round succeeds everywhere; failed attempts must fail
    on every driver alike with a lost-peer error (never hang)."""
    t0 = time.monotonic()
    failures = []
    while True:
        res = together(ds, cmd, timeout=PEER_TIMEOUT + 20)
        if all("ok" in r for r in res):
            return res, time.monotonic() - t0, failures
        # a round in its data phase when the node died fails (on a node that had already received
        # everything it may have succeeded); a round still being agreed is started again instead
        assert all("ok" in r or r.get("error") in ("PeerLostError", "RoundAborted") for r in res), res
        failures.append(res)
        assert time.monotonic() - t0 < limit, failures
        time.sleep(0.2)


def elastic_status(cl: LocalCluster, i: int) -> dict:
    from birdnet.client import Client
    with Client(cl.sockets[i], job="__status__", connect_timeout=2) as c:
        return c.status()


def wait_heard(cl: LocalCluster, by: list[int], node: int, timeout: float = 15) -> None:
    """Until every node of ``by`` hears ``node`` again."""
    deadline = time.monotonic() + timeout
    while True:
        states = [elastic_status(cl, i)["peers"][node]["state"] for i in by]
        if all(s != "lost" for s in states):
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.2)


def rejoin_logs(cl: LocalCluster, marks: list[int], per_node: int = 3000) -> str:
    """Each node's log since ``marks`` (offsets), without the status clients' lines, shortened."""
    out = []
    for i, m in enumerate(marks):
        lines = [ln.split(" birdnetd ", 1)[-1][:300] for ln in cl.log(i)[m:].splitlines()
                 if "__status__" not in ln]
        text = "\n".join(lines)
        out.append(f"--- node {i}: " + (text if len(text) <= per_node else text[:per_node // 2] + "\n[...]\n"
                                         + text[-per_node // 2:]))
    return "\n".join(out)


def kill(cl: LocalCluster, i: int) -> None:
    cl.send_signal(i, signal.SIGKILL)
    cl.procs[i].wait(10)


def lose_and_regain(cl: LocalCluster, drivers, dead: int) -> None:
    d = [drivers(s) for s in cl.sockets]
    for codec in ("none", "topk"):  # dense ring and a gathered codec with error feedback
        check(together(d, f"round {N} {codec}"), [0, 1, 2, 3], exact=codec == "none")
    live = [i for i in range(4) if i != dead]
    # power loss on node `dead`: its daemon and its training process go
    kill(cl, dead)
    d[dead].kill()
    t_kill = time.monotonic()
    res, _took, failures = until_ok([d[i] for i in live], f"round {N} none", limit=PEER_TIMEOUT + 15)
    check(res, live)
    assert time.monotonic() - t_kill < PEER_TIMEOUT + 8, failures
    for f in failures:  # the failures name the lost node
        assert all(f"rank {dead}" in r["message"] for r in f if "error" in r), f
    for _ in range(2):
        check(together([d[i] for i in live], f"round {N} topk"), live, exact=False)
    st = elastic_status(cl, live[0])["elastic"]
    assert st["members"] == live and st["leader"] == live[0], st
    # the node comes back with a fresh training process (call numbering from 0)
    marks = [len(cl.log(i)) for i in range(4)]
    cl.start_node(dead)
    d[dead] = drivers(cl.sockets[dead])
    wait_heard(cl, live, dead)
    d[dead].send(f"round {N} none")  # its process is waiting first, so the leader admits the node
    time.sleep(1.0)
    for i in live:
        d[i].send(f"round {N} none")
    try:
        res = [d[i].read(40) if i != dead else None for i in range(4)]
        res[dead] = d[dead].read(40)
        check(res, [0, 1, 2, 3])
    except (AssertionError, TimeoutError) as exc:
        # a rejoin that fails under load is hard to reproduce: what each daemon logged since the
        # restart says where it stopped (first, and short: CI shows the start of a failure)
        raise AssertionError(f"the rejoin round failed:\n{rejoin_logs(cl, marks)}\n{exc}") from exc
    for codec in ("topk", "none"):
        check(together(d, f"round {N} {codec}"), [0, 1, 2, 3], exact=codec == "none")
    for i in range(4):
        st = elastic_status(cl, i)["elastic"]
        assert st["members"] == [0, 1, 2, 3] and st["leader"] == live[0], (i, st)
    assert "joined the ring" in cl.log(dead)
    return d


@pytest.mark.timeout(120)
def test_elastic_node_lost_then_rejoins(tmp_path, drivers):
    """... and then the job restarts on every node (fresh processes, calls numbered from 0): the
    rejoined node's call-number offset was never reset, so its rounds carried other numbers than
    everyone else's and waited round_timeout. Now a job that restarts on a node drops its offset."""
    with LocalCluster(4, tmp_path, extra=["--elastic", "--round-timeout", "20"]) as cl:
        d = lose_and_regain(cl, drivers, dead=2)
        for x in d:
            x.kill()
        time.sleep(0.5)  # the daemons see the processes leave (bye or reaped)
        d = [drivers(s) for s in cl.sockets]
        t0 = time.monotonic()
        check(together(d, f"round {N} none", timeout=40), [0, 1, 2, 3])
        assert time.monotonic() - t0 < 10


@pytest.mark.timeout(90)
def test_elastic_leader_lost_then_rejoins(tmp_path, drivers):
    with LocalCluster(4, tmp_path, extra=["--elastic"]) as cl:
        lose_and_regain(cl, drivers, dead=0)


# A node killed while a round is being agreed and back before anyone counts it lost: its new
# instance knows nothing of the round. Every node sees the new incarnation in its pings and the
# agreement starts again on the ring without it, at once (not after round_timeout); node 2's process
# is 2 s late, so the round is mid-agreement when node 1 dies. Its process rejoins later.
@pytest.mark.timeout(120)
def test_elastic_node_restarted_mid_agreement_before_it_counts_as_lost(tmp_path, drivers):
    with LocalCluster(4, tmp_path, extra=["--elastic"]) as cl:
        d = [drivers(s) for s in cl.sockets]
        check(together(d, f"round {N} none"), [0, 1, 2, 3])
        for i in (0, 1, 3):
            d[i].send(f"round {N} none")
        d[2].send(f"delay 2 round {N} none")
        time.sleep(0.5)
        marks = [len(cl.log(i)) for i in range(4)]
        t = time.monotonic()
        kill(cl, 1)
        cl.start_node(1)
        assert time.monotonic() - t < PEER_TIMEOUT - 1, "the restart must beat peer_timeout for this test"
        try:
            assert d[1].read(10)["error"] == "DaemonUnavailableError"
            res = [d[i].read(PEER_TIMEOUT + 10) for i in (0, 2, 3)]
            check(res, [0, 2, 3])
            assert all(r["seconds"] < 2 + 3 for r in res), res  # the late process's 2 s, not a timeout
        except (AssertionError, TimeoutError) as exc:
            raise AssertionError(f"the round without node 1 failed:\n{rejoin_logs(cl, marks)}\n{exc}") from exc
        # node 1's process (reconnected by itself) waits first, so the leader admits it
        d[1].send(f"round {N} none")
        time.sleep(1.0)
        for i in (0, 2, 3):
            d[i].send(f"round {N} none")
        check([d[i].read(40) for i in range(4)], [0, 1, 2, 3])
        check(together(d, f"round {N} none"), [0, 1, 2, 3])


@pytest.mark.timeout(60)
def test_elastic_without_a_majority_fails_clearly(tmp_path, drivers):
    with LocalCluster(3, tmp_path, extra=["--elastic"]) as cl:
        d = [drivers(s) for s in cl.sockets]
        assert all("ok" in r for r in together(d, "round 10 none"))
        kill(cl, 1)
        kill(cl, 2)
        t = time.monotonic()
        r = together([d[0]], "round 10 none", timeout=PEER_TIMEOUT + 15)[0]
        assert r.get("error") == "PeerLostError" and "majority" in r["message"], r
        assert time.monotonic() - t < 2 * PEER_TIMEOUT + 4


def test_elastic_setting():
    from birdnet.config import Settings, load_settings
    assert "elastic" not in Settings().cluster_wide()  # off: the handshake fingerprint is unchanged
    assert Settings(elastic=True).cluster_wide()["elastic"] is True
    assert Settings(elastic=True).fingerprint() != Settings().fingerprint()
    assert load_settings({}, environ={"BIRDNET_ELASTIC": "yes"}).elastic is True
    assert load_settings({"elastic": None}, environ={}).elastic is False


def test_a_start_for_an_earlier_incarnation_is_ignored():
    """A neighbour's DEALER queues what it sends to a dead node and delivers it when the restarted
    daemon is reachable again: a start of the old life (its ``I`` names the old incarnation) must
    not hold the new daemon in a round nobody runs any more."""
    from types import SimpleNamespace

    from birdnet.daemon.elastic import ElasticRing

    from birdnet.messages import Membership, Start
    m = ElasticRing(None, rank=2, world=4)
    m.bind(SimpleNamespace(rank=2, incarnation="new", peers=list(range(4))))
    incs = {"0": "a", "1": "b", "3": "d"}
    stale = Membership(1, (0, 1, 2, 3), 0, (), {**incs, "2": "old"}).fields()
    assert m.ring_of_start(Start.from_header({"t": "start", "k": "job/2", "descs": [], **stale}), sender=1) is None
    current = Membership(3, (0, 1, 2, 3), 0, (2,), {**incs, "2": "new"}).fields()
    ring = m.ring_of_start(Start.from_header({"t": "start", "k": "job/5", "descs": [], **current}), sender=1)
    assert ring is not None and ring.members == (0, 1, 2, 3) and m.join_epoch == 3
