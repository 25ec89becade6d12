"""``birdnet demo`` end to end (its table of codecs, on loopback and in network namespaces), its
recipe and progress bar, and Ctrl-C leaves nothing behind."""
from __future__ import annotations

import fcntl
import importlib.util
import json
import math
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from birdnet.bench import netns

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


#: the short mode the tests run: 2 nodes, 3 epochs, a small MLP (seconds per codec, not minutes)
SHORT = ["--nodes", "2", "--epochs", "3", "--hidden", "64,64", "--seed", "0"]
#: test accuracy every codec clears in the short mode at seed 0 (digits, 10 classes: chance is 0.1).
#: Measured 0.914 dense, 0.884 marsit, 0.783 birdplus (density 0.01, 3 epochs is few for it)
FLOOR = 0.7


def _demo(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    # stdout and stderr are pipes here, as in a log: no progress bar, so no carriage return
    return subprocess.run([sys.executable, "-m", "birdnet.cli", "demo", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(450)  # a cold Numba cache compiles marsit's and birdplus's kernels first
def test_demo_table_of_three_codecs_on_loopback():
    r = _demo(*SHORT, "--network", "loopback", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "\r" not in r.stdout + r.stderr  # output to a pipe: no progress bar drawn into it
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["network"] == "loopback" and res["namespaces"] == []
    assert "loopback has no bandwidth limit" in r.stdout  # says why the compressed codecs are not faster
    rows = {row["codec"]: row for row in res["rows"]}
    assert list(rows) == ["none", "marsit", "birdplus"]
    # the recipe: the compressed codecs carry SGD's momentum themselves
    assert rows["marsit"]["params"] == {"momentum": 0.9}
    assert rows["birdplus"]["params"] == {"density": 0.01, "momentum": 0.9}
    for name, row in rows.items():
        assert math.isfinite(row["accuracy"]) and row["accuracy"] > FLOOR, (name, row)
        assert math.isfinite(row["loss"]) and row["identical_parameters_on_all_nodes"], (name, row)
        assert row["seconds"] > 0 and row["bytes_sent_per_worker"] > 0
    assert rows["none"]["ratio_to_dense"] == 1.0
    for name in ("marsit", "birdplus"):  # fewer bytes (the biases, under 1024 elements, travel dense)
        assert rows[name]["ratio_to_dense"] > 4
        assert rows[name]["ratio_to_dense"] == pytest.approx(
            rows["none"]["bytes_sent_per_worker"] / rows[name]["bytes_sent_per_worker"])
    assert res["identical_parameters_on_all_nodes"] and res["daemon_exit_codes"] == [0, 0]
    assert not _birdnet_processes(os.path.dirname(res["sockets"][0]))
    assert _segments_of(res["sockets"]) == set()

    from birdnet.demo import table
    lines = table(res).splitlines()  # what the demo prints without --json: a header, a row per codec, a note
    assert len(lines) == 5 and lines[0].split()[:2] == ["codec", "accuracy"]
    assert [ln.split()[0] for ln in lines[1:4]] == ["dense", "marsit:momentum=0.9", "birdplus:density=0.01:momentum=0.9"]
    assert all(ln.endswith("yes") for ln in lines[1:4]) and "loopback" in lines[4]


@pytest.mark.netns
@pytest.mark.timeout(450)
@pytest.mark.skipif(not netns.available()[0], reason="network namespaces need root and iproute2")
def test_demo_in_network_namespaces_on_shaped_links():
    r = _demo("--nodes", "2", "--epochs", "1", "--hidden", "64,64", "--codecs", "dense,marsit", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["network"] == "netns" and res["rate"] == "100mbit"  # the default as root
    assert "loopback has no bandwidth limit" not in r.stdout
    assert [row["codec"] for row in res["rows"]] == ["none", "marsit"]
    assert all(row["identical_parameters_on_all_nodes"] and row["accuracy"] > 0.3 for row in res["rows"])
    assert len(res["namespaces"]) == 2
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert not after & set(res["namespaces"]), "the demo left network namespaces behind"
    assert not _birdnet_processes(os.path.dirname(res["sockets"][0]))


def test_demo_refuses_an_unknown_codec_at_once():
    r = _demo("--codec", "marsti", timeout=60)
    assert r.returncode == 2 and "unknown codec 'marsti'" in r.stderr and "marsit" in r.stderr


def test_the_recipe_moves_the_momentum_into_codecs_that_have_one():
    from birdnet.demo import recipe
    assert recipe("none", {}) == {}
    assert recipe("marsit", {}) == {"momentum": 0.9}
    assert recipe("birdplus", {"density": 0.05}) == {"density": 0.05, "momentum": 0.9}
    assert recipe("marsit", {"momentum": 0}) == {"momentum": 0}  # turned off, as the docstring says
    assert recipe("qsgd", {}) == {}  # no momentum parameter: the workers keep the momentum


def test_momentum_codecs_are_those_with_a_momentum_parameter():
    """trainlib names them rather than importing every codec (which compiles kernels): the list
    must match the codecs' own parameters, and the PyTorch adapter's."""
    code = ("import json; from birdnet.codecs import codec_class, names; "
            "print(json.dumps(sorted(n for n in names() if 'momentum' in codec_class(n).defaults)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, NUMBA_DISABLE_JIT="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    from birdnet.bench.trainlib import MOMENTUM_CODECS
    assert sorted(MOMENTUM_CODECS) == json.loads(r.stdout)
    if importlib.util.find_spec("torch") is not None:
        from birdnet.client._torch_recipes import MOMENTUM_CODECS as adapter
        assert adapter == MOMENTUM_CODECS


def test_progress_bar_draws_on_a_terminal_only():
    from birdnet.bench.progress import bar
    r, w = os.pipe()
    with os.fdopen(w, "w") as f:  # a pipe, as a log: nothing drawn
        b = bar(3, "pipe", file=f)
        assert b.disable
        b.update(3)
        b.close()
    with os.fdopen(r) as f:
        assert f.read() == ""
    master, slave = pty.openpty()  # a terminal: the bar redraws its line with carriage returns
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # 80 columns, as a terminal has
    drawn = b""
    with os.fdopen(slave, "w") as f:
        b = bar(3, "tty", file=f)
        assert not b.disable
        for _ in range(3):
            b.update(1)
        b.close()
        f.flush()
        # read while this end is open (once it closes, Linux drops what the other end holds)
        while select.select([master], [], [], 0.5)[0]:
            chunk = os.read(master, 65536)
            if not chunk:
                break
            drawn += chunk
    os.close(master)
    assert b"\r" in drawn and b"tty" in drawn


@pytest.mark.timeout(120)
def test_demo_ctrl_c_leaves_nothing():
    # As from a terminal: SIGINT not ignored. (A shell starting a background job, as a CI runner may,
    # makes its children ignore SIGINT, and Python then keeps ignoring it.)
    p = subprocess.Popen([sys.executable, "-m", "birdnet.cli", "demo", "--nodes", "2", "--epochs", "5000",
                          "--codec", "dense", "--network", "loopback"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 90
        seen = ""
        while "dense: training" not in seen and time.monotonic() < deadline:
            seen += p.stdout.read(1) or ""
            if p.poll() is not None:
                break
        assert "dense: training" in seen, seen
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
