"""CURVE peer authentication with real daemons, ``birdnet keygen``, and the local side: the client
socket and shared memory are closed to other users (a real second user when run as root)."""
from __future__ import annotations

import grp
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import fault_workers
import pytest
import workers
import zmq
from cluster import LocalCluster

pytestmark = pytest.mark.heavy  # CI runs it on the default Python only (.ci/run)


def keygen(d: Path) -> str:
    r = subprocess.run([sys.executable, "-m", "birdnet.cli", "keygen", "--out", str(d)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return (d / "birdnet.pub").read_text().strip()


def curve_args(d: Path, allowed: Path) -> list[str]:
    return ["--curve-secret-key", str(d / "birdnet.key"), "--curve-allowed-keys", str(allowed)]


@pytest.mark.timeout(60)
def test_keygen_writes_a_private_secret_and_a_public_key(tmp_path):
    pub = keygen(tmp_path / "k")
    key = tmp_path / "k" / "birdnet.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    secret = key.read_text().strip().encode()
    assert zmq.curve_public(secret).decode() == pub and len(pub) == 40
    again = subprocess.run([sys.executable, "-m", "birdnet.cli", "keygen", "--out", str(tmp_path / "k")],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "exists" in again.stderr  # never overwrites a key silently


def test_allowed_keys_formats_and_errors(tmp_path):
    from birdnet.daemon.security import read_allowed_keys, read_secret_key

    from birdnet.errors import ConfigError
    from birdnet.hosts import parse_hosts
    peers = parse_hosts("10.0.0.1:7000\n10.0.0.2:7000\n")
    k = [zmq.curve_keypair()[0].decode() for _ in range(2)]
    f = tmp_path / "a"
    f.write_text(f"# ring order\n{k[0]}\n{k[1]}\n")
    assert read_allowed_keys(str(f), peers) == {0: k[0].encode(), 1: k[1].encode()}
    f.write_text(f"10.0.0.2:7000 {k[1]}\n10.0.0.1:7000 {k[0]}\n")
    assert read_allowed_keys(str(f), peers) == {0: k[0].encode(), 1: k[1].encode()}
    for text, msg in [(f"{k[0]}\n", "1 bare key"), (f"10.0.0.9:1 {k[0]}\n10.0.0.2:7000 {k[1]}\n", "not an entry"),
                      (f"{k[0]}\n10.0.0.2:7000 {k[1]}\n", "mix"), ("short\nkeys\n", "Z85"),
                      (f"10.0.0.1:7000 {k[0]}\n", "no key for 10.0.0.2:7000")]:
        f.write_text(text)
        with pytest.raises(ConfigError, match=msg):
            read_allowed_keys(str(f), peers)
    keygen(tmp_path / "k")
    os.chmod(tmp_path / "k" / "birdnet.key", 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        read_secret_key(str(tmp_path / "k" / "birdnet.key"))


def _curve_cluster(tmp_path, n, rogue: int | None = None, plaintext: int | None = None):
    pubs = [keygen(tmp_path / f"k{i}") for i in range(n)]
    cl = LocalCluster(n, tmp_path)
    addrs = [line for line in cl.hosts.read_text().splitlines() if not line.startswith("#")]
    extra = []
    for i in range(n):
        allowed = tmp_path / f"allowed{i}.txt"
        if i == 0:  # 'host:port KEY' form, shuffled
            allowed.write_text("".join(f"{addrs[j]} {pubs[j]}\n" for j in reversed(range(n))))
        else:  # bare keys in ring order, as the Ansible role writes them
            allowed.write_text("# peers\n" + "".join(f"{p}\n" for p in pubs))
        keydir = tmp_path / f"k{i}"
        if i == rogue:  # a node whose key pair nobody listed
            keydir = tmp_path / "rogue"
            keygen(keydir)
        extra.append([] if i == plaintext else curve_args(keydir, allowed))
    cl.per_node_extra = extra
    return cl


@pytest.mark.timeout(120)
def test_curve_ring_sums_exactly(tmp_path):
    with _curve_cluster(tmp_path, 3) as cl:
        res = cl.run(workers.fill_sum, [0, 1, 1000, 100003])
        for per in res:
            assert all((out == 6.0).all() for out in per)
        st = subprocess.run([sys.executable, "-m", "birdnet.cli", "status", "--socket", cl.sockets[0], "--json"],
                            capture_output=True, text=True, timeout=30)
        assert '"connected"' in st.stdout
    for i in range(3):
        assert "refused" not in cl.log(i)


@pytest.mark.timeout(120)
def test_unknown_key_is_refused_and_clients_get_a_clear_error(tmp_path):
    with _curve_cluster(tmp_path, 3, rogue=1) as cl:
        res = cl.run(fault_workers.try_round, 1000, 30.0)
    for cls, msg, secs in res:
        assert cls == "PeerLostError", (cls, msg)
        assert "rank 1" in msg or "rank 2" in msg
        assert secs < 4 + 4  # peer_timeout plus slack, never a hang
    # node 1's client hears why: its right neighbour refused its key
    assert "refused this node's CURVE key" in res[1][1]
    assert "not in the allow-list" in cl.log(2)
    assert "refused" in cl.log(1)


@pytest.mark.timeout(120)
def test_plaintext_peer_is_refused_by_a_curve_daemon(tmp_path):
    with _curve_cluster(tmp_path, 2, plaintext=1) as cl:
        res = cl.run(fault_workers.try_round, 1000, 30.0)
    for cls, msg, secs in res:
        assert cls == "PeerLostError", (cls, msg)
        assert secs < 8
    assert "it requires CURVE" in res[1][1]
    assert "plaintext" in cl.log(0)


def test_raw_plaintext_message_never_reaches_a_curve_daemon(tmp_path):
    """A plaintext socket sending a well-formed ping gets no answer (refused in the handshake)."""
    with _curve_cluster(tmp_path, 2) as cl:
        port = int(cl.hosts.read_text().splitlines()[1].rsplit(":", 1)[1])
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port}")
        from birdnet import PROTOCOL_VERSION, wire
        s.send_multipart(wire.encode({"t": "ping", "proto": PROTOCOL_VERSION, "rank": 1, "world": 2}))
        assert not s.poll(1500)
        s.close(0)
        ctx.term()
        assert cl.run(fault_workers.try_round, 10, 30.0)[0][0] == "ok"


# -- the local side ----------------------------------------------------------------------------------
ROOT = os.geteuid() == 0


def _throwaway_user(name: str, group: str | None = None) -> int:
    subprocess.run(["userdel", name], capture_output=True)
    cmd = ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name]
    if group:
        cmd[1:1] = ["-G", group]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"useradd failed: {r.stderr.strip()}")
    return pwd.getpwnam(name).pw_uid


DROP = """
import os
os.setgroups(os.getgrouplist({name!r}, {gid}))
os.setgid({gid})
os.setuid({uid})
assert os.getuid() == {uid} and os.geteuid() == {uid}
"""


def _run_as(uid: int, code: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run ``code`` as ``uid``. The interpreter and the libraries are loaded as root first (the
    test's venv may sit in a directory other users cannot read), then the process drops to ``uid``
    for good before it touches the daemon's socket or shared memory."""
    pw = pwd.getpwuid(uid)
    imports, _, body = code.partition("#--drop--")
    script = imports + DROP.format(name=pw.pw_name, gid=pw.pw_gid, uid=uid) + body
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "HOME": "/tmp"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd="/")


CLIENT_CODE = """
import sys, os, numpy as np
from birdnet.client import Client
from birdnet.errors import BirdnetError
import birdnet.config, birdnet.wire, zmq.utils.monitor
#--drop--
try:
    with Client(%r) as c:
        print("OK", c.allreduce(np.ones(3, np.float32), op="sum").tolist())
except BirdnetError as exc:
    print("ERR", type(exc).__name__, exc)
for name in os.listdir("/dev/shm"):
    if name.startswith(%r):
        try:
            os.open("/dev/shm/" + name, os.O_RDWR)
            print("SHM-OPENED", name)
        except PermissionError:
            print("SHM-DENIED", name)
"""


def _shared_tmp(name: str) -> Path:
    d = Path("/tmp") / f"{name}-{os.getpid()}"
    subprocess.run(["rm", "-rf", str(d)])
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    return d


def _prefix(sock: str) -> str:
    from birdnet.shm import segment_prefix
    return segment_prefix(sock)


@pytest.mark.timeout(90)
@pytest.mark.skipif(not ROOT, reason="needs root to create a throw-away user and switch to it")
def test_other_user_can_neither_attach_nor_submit():
    d = _shared_tmp("bn-perm")
    user = f"bnt{os.getpid() % 100000}"
    uid = _throwaway_user(user)
    try:
        with LocalCluster(1, d) as cl:
            # the owner's process holds a segment, so there is something to try to attach to
            import numpy as np
            from birdnet.client import Client
            with Client(cl.sockets[0]) as own:
                own.buffer((1000,), np.float32)
                assert stat.S_IMODE(os.stat(cl.sockets[0]).st_mode) == 0o600
                r = _run_as(uid, CLIENT_CODE % (cl.sockets[0], _prefix(cl.sockets[0])))
        out = r.stdout + r.stderr
        assert "ERR AuthenticationError permission denied" in out, out
        assert "SHM-DENIED" in out and "SHM-OPENED" not in out, out
    finally:
        subprocess.run(["userdel", user], capture_output=True)
        subprocess.run(["rm", "-rf", str(d)])


@pytest.mark.timeout(90)
@pytest.mark.skipif(not ROOT, reason="needs root to create a throw-away user and group")
def test_shm_group_member_can_use_the_daemon():
    d = _shared_tmp("bn-grp")
    group, user = f"bng{os.getpid() % 100000}", f"bnu{os.getpid() % 100000}"
    subprocess.run(["groupdel", group], capture_output=True)
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    uid = _throwaway_user(user, group)
    outsider = _throwaway_user(user + "x")
    try:
        cl = LocalCluster(1, d, extra=["--shm-group", group])
        cl.sockets = [str(d / "run" / "node0.sock")]  # a directory the daemon creates (0750, its group)
        with cl:
            st = os.stat(cl.sockets[0])
            assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == grp.getgrnam(group).gr_gid
            assert stat.S_IMODE(os.stat(d / "run").st_mode) == 0o750
            ok = _run_as(uid, CLIENT_CODE % (cl.sockets[0], _prefix(cl.sockets[0])))
            no = _run_as(outsider, CLIENT_CODE % (cl.sockets[0], _prefix(cl.sockets[0])))
        assert "OK [1.0, 1.0, 1.0]" in ok.stdout, ok.stdout + ok.stderr
        assert "ERR AuthenticationError" in no.stdout, no.stdout + no.stderr
    finally:
        for u in (user, user + "x"):
            subprocess.run(["userdel", u], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)
        subprocess.run(["rm", "-rf", str(d)])
