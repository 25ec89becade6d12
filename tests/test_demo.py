"""``birdnet demo`` end to end, and Ctrl-C leaves nothing behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("sklearn")


def _segments_of(sockets) -> set[str]:
    """Shared-memory segments of the daemons serving ``sockets`` (their names carry a prefix
    derived from the socket path; other tests running at the same time have other prefixes)."""
    from birdnet.shm import segment_prefix
    prefixes = [segment_prefix(s) for s in sockets]
    return {f for f in os.listdir("/dev/shm") if any(f.startswith(p) for p in prefixes)}


def _birdnet_processes(workdir: str) -> set[int]:
    """Daemons started by the demo whose working directory is ``workdir`` (other tests may run
    demos at the same time)."""
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"birdnet.daemon.main" in cmd and workdir.encode() in cmd:
                out.add(int(pid))
    return out


@pytest.mark.timeout(240)
def test_demo_trains_and_cleans_up():
    r = subprocess.run([sys.executable, "-m", "birdnet.cli", "demo", "--nodes", "3", "--epochs", "4", "--json"],
                       capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["accuracy"] > 0.85  # digits, 4 epochs: ~0.93 in practice
    assert res["identical_parameters_on_all_nodes"] and res["daemon_exit_codes"] == [0, 0, 0]
    assert res["bytes_sent_per_worker"] > 0
    assert not _birdnet_processes(os.path.dirname(res["sockets"][0]))
    assert _segments_of(res["sockets"]) == set()


@pytest.mark.timeout(120)
def test_demo_ctrl_c_leaves_nothing():
    # As from a terminal: SIGINT not ignored. (A shell starting a background job, as a CI runner may,
    # makes its children ignore SIGINT, and Python then keeps ignoring it.)
    p = subprocess.Popen([sys.executable, "-m", "birdnet.cli", "demo", "--nodes", "2", "--epochs", "5000"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 90
        seen = ""
        while "epoch" not in seen and time.monotonic() < deadline:
            seen += p.stdout.read(1) or ""
            if p.poll() is not None:
                break
        assert "epoch" in seen, seen
        os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        p.wait(60)
    finally:
        if p.poll() is None:  # the demo did not stop: kill it, and its daemons (their own sessions)
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            if "hosts file " in seen:
                for pid in _birdnet_processes(os.path.dirname(seen.split("hosts file ", 1)[1].split(")", 1)[0])):
                    os.kill(pid, signal.SIGKILL)
    assert p.returncode == 130, seen  # 130: interrupted (the run is far too long to finish first)
    time.sleep(0.5)
    hosts = seen.split("hosts file ", 1)[1].split(")", 1)[0]
    assert not _birdnet_processes(os.path.dirname(hosts))
    sockets = [os.path.join(os.path.dirname(hosts), f"node{i}.sock") for i in range(2)]
    assert _segments_of(sockets) == set()
    assert not os.path.exists(os.path.dirname(hosts))  # the demo's working directory is gone too
