"""Settings that must agree across the ring, and configurations that used to flap instead of failing:
each fails with a configuration error naming the setting, the ranks and the fix."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from birdnet.client import Client
from cluster import LocalCluster

from birdnet.config import Settings
from birdnet.errors import ConfigError
from birdnet.hosts import parse_hosts

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(120)]


def test_timeouts_are_cluster_wide():
    """A node pinging every 2 s next to one whose peer_timeout is 3 s is declared lost while alive;
    both settings are in the handshake fingerprint, so such nodes refuse each other by name."""
    cw = Settings().cluster_wide()
    assert cw["heartbeat_interval"] == 0.5 and cw["peer_timeout"] == 10.0
    assert Settings(peer_timeout=20.0).fingerprint() != Settings().fingerprint()
    assert Settings(heartbeat_interval=1.0).fingerprint() != Settings().fingerprint()
    assert Settings(round_timeout=5.0).fingerprint() == Settings().fingerprint()  # local: may differ


def test_max_message_bytes_below_chunk_bytes_is_refused():
    with pytest.raises(ConfigError, match=r"max_message_bytes \(65536\) is below chunk_bytes \(1048576\)"):
        Settings(max_message_bytes=65536)
    # chunks grow up to max_chunk_bytes (4 MiB by default): a message of that size must be accepted
    with pytest.raises(ConfigError, match=r"max_message_bytes \(1048576\) is below max_chunk_bytes \(4194304\).*"
                       r"0: chunks of chunk_bytes, 1048576, always"):
        Settings(max_message_bytes=1 << 20)
    Settings(max_message_bytes=4 << 20)  # equal is enough: a dense message is one chunk
    Settings(max_message_bytes=1 << 20, max_chunk_bytes=0)  # fixed chunks of chunk_bytes
    assert Settings(max_chunk_bytes=0).largest_chunk_bytes == 1 << 20
    assert Settings(chunk_bytes=8 << 20).largest_chunk_bytes == 8 << 20  # chunk_bytes above the maximum wins
    with pytest.raises(ConfigError, match="max_chunk_bytes is -1"):
        Settings(max_chunk_bytes=-1)
    assert Settings(max_chunk_bytes=0).fingerprint() != Settings().fingerprint()  # cluster-wide


def test_one_curve_key_for_two_ranks_is_refused(tmp_path):
    from birdnet.daemon.security import read_allowed_keys
    zmq = pytest.importorskip("zmq")
    a, b = (zmq.curve_keypair()[0].decode() for _ in range(2))
    peers = parse_hosts("10.0.0.1:1\n10.0.0.2:1\n10.0.0.3:1\n")
    f = tmp_path / "allowed"
    f.write_text(f"{a}\n{b}\n{a}\n")
    with pytest.raises(ConfigError, match=r"same CURVE key for rank 0 \(10.0.0.1:1\) and rank 2 \(10.0.0.3:1\)"):
        read_allowed_keys(str(f), peers)
    f.write_text(f"10.0.0.2:1 {b}\n10.0.0.1:1 {b}\n10.0.0.3:1 {a}\n")
    with pytest.raises(ConfigError, match=r"rank 0 .* and rank 1 "):
        read_allowed_keys(str(f), peers)


def _peer_lines(log: str, rank: int) -> int:
    return log.count(f"left neighbour rank {rank} (")


def test_peer_is_connected_only_after_a_handshake(tmp_path):
    """Within peer_timeout of the start a neighbour that never answered is not counted lost yet;
    status called it "connected" all the same. It is "connecting" until a real handshake."""
    cl = LocalCluster(2, tmp_path, peer_timeout=30.0, heartbeat_interval=0.25)
    try:
        cl.start_node(0)
        with Client(cl.sockets[0], job="probe") as c:
            assert [p["state"] for p in c.status()["peers"]] == ["self", "connecting"]
        cl.start_node(1)
        deadline = time.monotonic() + 10
        while True:
            with Client(cl.sockets[0], job="probe") as c:
                states = [p["state"] for p in c.status()["peers"]]
            if states == ["self", "connected"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert states == ["self", "connected"]
    finally:
        cl.stop()


def _second_rank0(cl: LocalCluster, tmp_path, extra: list[str]) -> subprocess.Popen:
    """Another daemon with --rank 0, on 127.0.0.2 and the same port (its own hosts file)."""
    lines = cl.hosts.read_text().splitlines()[1:]
    hosts2 = tmp_path / "hosts2"
    hosts2.write_text(lines[0].replace("127.0.0.1", "127.0.0.2") + "\n" + "".join(x + "\n" for x in lines[1:]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with open(tmp_path / "other.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "birdnet.daemon.main", "--peers", str(hosts2), "--rank", "0",
                                 "--socket", str(tmp_path / "other.sock"), "--peer-timeout", str(cl.peer_timeout),
                                 "--heartbeat-interval", str(cl.heartbeat_interval), *extra],
                                stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_for_log(cl: LocalCluster, node: int, start: int, text: str, other: subprocess.Popen, tmp_path) -> None:
    deadline = time.monotonic() + 30  # the second daemon starts slowly on a loaded machine
    while text not in cl.log(node)[start:]:
        assert other.poll() is None, (tmp_path / "other.log").read_text()[-2000:]
        assert time.monotonic() < deadline, cl.log(node)[start:][-3000:]
        time.sleep(0.2)


def test_two_daemons_with_one_rank_are_refused_by_name(tmp_path):
    """A second daemon started with --rank 0 (here on 127.0.0.2, the same port) made node 1 take
    whichever of the two pinged last as its left neighbour, at every heartbeat: every round failed
    as "restarted". Now node 1 refuses both, naming the rank, until one of them stops."""
    cl = LocalCluster(2, tmp_path)
    cl.start()
    other = None
    try:
        other = _second_rank0(cl, tmp_path, [])
        start = len(cl.log(1))
        _wait_for_log(cl, 1, start, "two daemons claim rank 0", other, tmp_path)
        time.sleep(2.0)  # 8 heartbeats: the two would each have taken the rank again by now
        log1 = cl.log(1)[start:]
        assert _peer_lines(log1, 0) <= 2, log1[-3000:]  # no flapping
        with Client(cl.sockets[1], job="probe") as c:
            row = c.status()["peers"][0]
        assert row["state"] == "refused" and "two daemons claim rank 0" in row["reason"], row
        other.terminate()
        other.wait(15)
        other = None
        import fault_workers
        time.sleep(cl.peer_timeout + 1.0)
        res = cl.run(fault_workers.try_round, 1000, 20.0)
        assert [r[:2] for r in res] == [("ok", 3.0)] * 2, res
    finally:
        if other is not None:
            other.kill()
            other.wait(5)
        cl.stop()


def test_two_daemons_with_one_rank_are_refused_by_name_in_elastic_mode(tmp_path):
    """The same in elastic mode, where every node pings every other: nodes 1 and 2 took whichever
    rank-0 daemon pinged last, at every heartbeat, each time as a restart of rank 0 (a log line per
    heartbeat, every round on a ring with rank 0 failing as "restarted"). Now both are refused by
    name, rank 0 counts as lost and the ring goes on without it; once one of them stops, rank 0 is
    taken back and rounds include it again."""
    import fault_workers
    cl = LocalCluster(3, tmp_path, extra=["--elastic", "--round-timeout", "20"])
    cl.start()
    other = None
    try:
        other = _second_rank0(cl, tmp_path, ["--elastic", "--round-timeout", "20"])
        starts = [len(cl.log(i)) for i in range(3)]
        for i in (1, 2):
            _wait_for_log(cl, i, starts[i], "two daemons claim rank 0", other, tmp_path)
        time.sleep(2.0)  # 8 heartbeats: the two would each have taken the rank again by now
        for i in (1, 2):
            log_i = cl.log(i)[starts[i]:]
            connects = re.findall(r"rank 0 \([^)]*\) connected", log_i)
            assert len(connects) <= 2, log_i[-3000:]  # no flapping: no new connection per heartbeat
            with Client(cl.sockets[i], job="probe") as c:
                row = c.status()["peers"][0]
            assert row["state"] == "refused" and "two daemons claim rank 0" in row["reason"], (i, row)
        # rank 0 is lost for nodes 1 and 2 after peer_timeout: a 2-node ring of the 3 (a majority) works
        time.sleep(cl.peer_timeout + 1.0)
        res = cl.run(fault_workers.try_round, 1000, 20.0, nodes=[1, 2])
        assert [r[0] for r in res] == ["ok", "ok"] and res[0][1] == res[1][1], res
        other.terminate()
        other.wait(15)
        other = None
        time.sleep(cl.peer_timeout + 1.0)
        for i in (1, 2):
            assert "only one daemon claims rank 0 now" in cl.log(i)[starts[i]:], cl.log(i)[-3000:]
        # node 0's process waits first, so the leader admits it (tests/test_elastic.py: a node
        # comes back into the ring at a round its process is waiting for)
        back = cl.run_async(fault_workers.try_round, 1000, 20.0, nodes=[0])
        time.sleep(1.5)
        rest = cl.run_async(fault_workers.try_round, 1000, 20.0, nodes=[1, 2])
        res = back.get(40) + rest.get(40)
        assert [r[:2] for r in res] == [("ok", 6.0)] * 3, res
    finally:
        if other is not None:
            other.kill()
            other.wait(5)
        cl.stop()


def test_cli_rough_edges(tmp_path):
    """A hosts-file name that does not resolve is named in the log and in `birdnet status`;
    `birdnet status` into a closed pipe prints no traceback; the socket a killed daemon left fails
    at once as stale; --help of both commands shows the default socket the client uses."""
    from cluster import free_ports

    from birdnet.errors import DaemonUnavailableError
    env = {k: v for k, v in os.environ.items() if k not in ("BIRDNET_SOCKET", "XDG_RUNTIME_DIR")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    default = subprocess.run([sys.executable, "-c", "from birdnet.client._connection import default_socket as d; "
                              "print(d())"], capture_output=True, text=True, env=env, timeout=60).stdout.strip()
    assert default
    for cmd in (["birdnet.daemon.main", "--help"], ["birdnet.cli", "status", "--help"]):
        text = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, env=env, timeout=60).stdout
        assert f"default here: {default};" in " ".join(text.split()), text

    p0, p1 = free_ports(2)
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1:{p0}\nno-such-host.invalid:{p1}\n")
    sock = str(tmp_path / "d.sock")
    with open(tmp_path / "d.log", "wb") as log:
        d = subprocess.Popen([sys.executable, "-m", "birdnet.daemon.main", "--peers", str(hosts), "--rank", "0",
                              "--socket", sock, "--kernel-warmup", "used"], stdout=log, stderr=subprocess.STDOUT,
                             env=env)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            assert d.poll() is None and time.monotonic() < deadline, (tmp_path / "d.log").read_text()[-3000:]
            time.sleep(0.1)
        assert "'no-such-host.invalid' (rank 1) does not resolve" in (tmp_path / "d.log").read_text()
        out = subprocess.run([sys.executable, "-m", "birdnet.cli", "status", "--socket", sock], capture_output=True,
                             text=True, env=env, timeout=60)
        assert "no-such-host.invalid" in out.stdout and "does not resolve" in out.stdout, out.stdout + out.stderr
        for _ in range(3):  # the reader gone before the first line: a write into a broken pipe
            r, w = os.pipe()
            os.close(r)
            try:
                st = subprocess.run([sys.executable, "-m", "birdnet.cli", "status", "--socket", sock], stdout=w,
                                    stderr=subprocess.PIPE, text=True, env=env, timeout=60)
            finally:
                os.close(w)
            assert "BrokenPipeError" not in st.stderr and "Traceback" not in st.stderr, st.stderr
    finally:
        d.kill()
        d.wait(15)
    assert os.path.exists(sock)  # SIGKILL: nobody removed it
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match=re.escape(f"no daemon is listening on {sock} (stale socket")):
        Client(sock, job="x", connect_timeout=5.0)
    assert time.monotonic() - t0 < 2.0  # not the 5 s hello timeout
    out = subprocess.run([sys.executable, "-m", "birdnet.cli", "status", "--socket", sock], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 1 and "stale socket" in out.stderr and "--socket PATH" in out.stderr, out.stderr
    os.unlink(sock)
