"""sd_notify and watchdog glue, tested against a real AF_UNIX datagram socket the test listens on.

These machines do not run systemd as PID 1, so the test plays the service manager: it binds the
socket, puts its address into ``$NOTIFY_SOCKET`` and reads what the daemon side sends, including the
kernel-attested sender PID that ``NotifyAccess=main`` relies on.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from birdnet.daemon import notify as sdnotify
from birdnet.daemon.notify import notify, watchdog_interval

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="AF_UNIX + SO_PASSCRED are Linux")

RECV_TIMEOUT = 5.0


@pytest.fixture
def short_tmp():
    """A short directory: AF_UNIX paths are limited to 107 bytes, pytest's tmp_path can exceed that."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bn-", dir="/tmp") as d:
        yield d


@pytest.fixture
def listener(short_tmp, monkeypatch):
    """A datagram socket playing systemd's notify socket, with sender credentials enabled."""
    path = os.path.join(short_tmp, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.bind(path)
    sock.settimeout(RECV_TIMEOUT)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    try:
        yield sock
    finally:
        sock.close()


def receive(sock: socket.socket) -> tuple[list[str], int | None]:
    """Return the assignments of one datagram and the sender PID from SCM_CREDENTIALS."""
    data, ancdata, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
    pid = None
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid, _uid, _gid = struct.unpack("3i", payload[: struct.calcsize("3i")])
    return data.decode("utf-8").split("\n"), pid


def test_no_socket_is_a_noop(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert notify("READY=1") is False


def test_ready_and_status_in_one_datagram_from_this_pid(listener):
    assert notify("READY=1", "STATUS=listening; peers connected 0/3") is True
    lines, pid = receive(listener)
    assert lines == ["READY=1", "STATUS=listening; peers connected 0/3"]
    assert pid == os.getpid()


def test_lifecycle_sequence_arrives_in_order(listener):
    sent = [
        ("READY=1", "STATUS=peers connected 0/3"),
        ("STATUS=peers connected 3/3",),
        ("WATCHDOG=1",),
        ("RELOADING=1",),
        ("READY=1", "STATUS=hosts file reloaded"),
        ("STOPPING=1",),
    ]
    for assignments in sent:
        assert notify(*assignments)
    for assignments in sent:
        assert receive(listener)[0] == list(assignments)


def test_utf8_status(listener):
    assert notify("STATUS=pairs ok — 3/3 ✓")
    assert receive(listener)[0] == ["STATUS=pairs ok — 3/3 ✓"]


def test_abstract_namespace(monkeypatch):
    name = f"birdnet-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(RECV_TIMEOUT)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("READY=1")
        assert sock.recv(4096) == b"READY=1"


@pytest.mark.parametrize(
    "assignments",
    [
        (),
        ("READY",),
        ("STATUS=ok\nREADY=1",),  # a newline would smuggle in a second assignment
        (b"READY=1",),
        (None,),
    ],
)
def test_malformed_assignments_are_refused_not_raised(listener, assignments):
    assert notify(*assignments) is False
    listener.settimeout(0.05)
    with pytest.raises(TimeoutError):
        listener.recv(4096)


@pytest.mark.parametrize("value", ["/nonexistent/birdnet/notify", "relative/notify", "vsock:2:1234", "@"])
def test_unreachable_or_unsupported_socket_returns_false(monkeypatch, value):
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert notify("READY=1") is False


def test_listener_gone_returns_false(short_tmp, monkeypatch):
    path = os.path.join(short_tmp, "gone")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.close()  # the path stays, nobody listens: ECONNREFUSED
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert notify("WATCHDOG=1") is False


def test_full_queue_does_not_block_forever(listener, monkeypatch):
    # Nobody reads the socket: once its queue is full, sendto blocks; send_timeout bounds that.
    monkeypatch.setattr(sdnotify, "send_timeout", 0.05)
    results = []
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        results.append(notify("STATUS=" + "x" * 2000))
        if not results[-1]:
            break
    assert results[0] is True
    assert results[-1] is False, "queue never filled within 10 s"


# --- watchdog ---------------------------------------------------------------------------------


@pytest.fixture
def clean_watchdog_env(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    return monkeypatch


def test_watchdog_disabled_without_env(clean_watchdog_env):
    assert watchdog_interval() is None


def test_watchdog_interval_is_half_the_period(clean_watchdog_env):
    clean_watchdog_env.setenv("WATCHDOG_USEC", "30000000")  # WatchdogSec=30
    assert watchdog_interval() == pytest.approx(15.0)


def test_watchdog_for_this_pid(clean_watchdog_env):
    clean_watchdog_env.setenv("WATCHDOG_USEC", "2000000")
    clean_watchdog_env.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval() == pytest.approx(1.0)


def test_watchdog_meant_for_another_pid(clean_watchdog_env):
    clean_watchdog_env.setenv("WATCHDOG_USEC", "2000000")
    clean_watchdog_env.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert watchdog_interval() is None


@pytest.mark.parametrize(
    ("usec", "pid"),
    [("0", None), ("-5", None), ("abc", None), ("1.5", None), ("2000000", "abc"), ("2000000", "0")],
)
def test_watchdog_malformed_env_means_disabled(clean_watchdog_env, usec, pid):
    clean_watchdog_env.setenv("WATCHDOG_USEC", usec)
    if pid is not None:
        clean_watchdog_env.setenv("WATCHDOG_PID", pid)
    assert watchdog_interval() is None


def test_watchdog_pings_from_a_separate_process(listener):
    """A process shaped like the daemon's main loop pings at the interval, from its own PID.

    WATCHDOG_USEC=400000 means WatchdogSec=0.4 s, so pings are due every 0.2 s; systemd would kill
    the service if 0.4 s passed without one. The test checks the cadence stays inside that window.
    """
    loop = textwrap.dedent(
        """
        import os, time
        from birdnet.daemon.notify import notify, watchdog_interval
        interval = watchdog_interval()
        assert interval is not None
        notify("READY=1", f"STATUS=pid {os.getpid()}")
        for _ in range(5):
            time.sleep(interval)
            notify("WATCHDOG=1")
        notify("STOPPING=1")
        """
    )
    env = dict(os.environ, WATCHDOG_USEC="400000")
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen([sys.executable, "-c", loop], env=env)
    try:
        lines, pid = receive(listener)
        assert lines[0] == "READY=1"
        assert pid == proc.pid
        stamps = []
        for _ in range(5):
            lines, pid = receive(listener)
            assert lines == ["WATCHDOG=1"] and pid == proc.pid
            stamps.append(time.monotonic())
        assert receive(listener)[0] == ["STOPPING=1"]
        assert proc.wait(timeout=RECV_TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    # Shared 2-core CI boxes jitter: allow slack, but never a whole period (0.4 s) between pings.
    assert all(0.1 < g < 0.4 for g in gaps), gaps
