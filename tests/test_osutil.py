"""birdnet.osutil: the daemon's malloc policy, measured in page faults of a real process."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

import pytest

# The pattern of a daemon's ring: a few 1 MiB message buffers allocated, filled and freed, over
# and over. Each run is a fresh interpreter, so its malloc starts from glibc's defaults.
CHURN = r"""
import ctypes, json, resource, sys
from birdnet.osutil import keep_freed_buffers
said = keep_freed_buffers(1 << 20) if sys.argv[1] == "tune" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def churn(rounds):
    for _ in range(rounds):
        bufs = [libc.malloc(1 << 20) for _ in range(4)]
        for b in bufs:
            ctypes.memset(b, 1, 1 << 20)
        for b in bufs:
            libc.free(b)
churn(5)  # the heap grows to its working size once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn(50)
print(json.dumps({"said": said, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the policy is glibc's mallopt")


def churn(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, timeout=60,
                         env={**clean, **env}, check=True)
    return json.loads(out.stdout)


@glibc_only
def test_freed_message_buffers_are_reused_without_page_faults():
    base = churn("base")
    tuned = churn("tune")
    # glibc's defaults trim the 4 MiB freed at the top of the heap each round (the trim threshold is
    # twice the largest recent allocation), so each round faults ~1,000 pages back in; with the
    # policy the memory stays and is reused. Deterministic (same allocation sequence each time).
    assert base["faults"] > 20 * 50, base
    assert tuned["faults"] <= 50, tuned
    assert "mmap_threshold 4096 KiB" in tuned["said"] and "trim_threshold 16384 KiB" in tuned["said"], tuned


@glibc_only
@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_an_operators_own_malloc_tuning_is_left_alone(env):
    tuned = churn("tune", **env)
    assert tuned["said"] == "malloc left alone (tuned through the environment)"
    assert tuned["faults"] > 20 * 50, tuned  # the operator's small trim threshold is in force


def test_the_daemon_logs_its_malloc_policy(tmp_path):
    from birdnet.cluster import LocalCluster

    with LocalCluster(1, tmp_path) as cl:
        log = cl.log(0)
    tuned_here = any(k.startswith("MALLOC_") for k in os.environ) or "malloc" in os.environ.get("GLIBC_TUNABLES", "")
    expected = "malloc keeps freed buffers" if platform.libc_ver()[0] == "glibc" and not tuned_here else "malloc left alone"
    assert expected in log, log[-2000:]


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names through prctl are Linux's")


def _thread_names(pid: int | str = "self") -> list[str]:
    base = f"/proc/{pid}/task"
    names = []
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


@linux_only
def test_a_thread_is_named_where_top_and_ps_look():
    import threading

    from birdnet.osutil import name_os_thread

    result = {}

    def body():
        result["set"] = name_os_thread("birdnet-a-very-long-name")
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            result["comm"] = f.read().strip()

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert result == {"set": True, "comm": "birdnet-a-very-"}  # the kernel keeps 15 bytes
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        assert f.read().strip() != "birdnet-a-very-"  # only the thread that asked was named


@linux_only
def test_the_daemons_threads_carry_their_names(tmp_path):
    from birdnet.cluster import LocalCluster, free_ports

    port = free_ports(1)[0]
    with LocalCluster(1, tmp_path, extra=["--metrics-port", str(port)]) as cl:
        names = []
        deadline = time.monotonic() + 10  # the threads start while the daemon comes up
        while time.monotonic() < deadline and not {"birdnet-ring", "birdnet-metrics"} <= set(names):
            names = _thread_names(cl.procs[0].pid)
            time.sleep(0.05)
    assert {"birdnet-ring", "birdnet-metrics"} <= set(names), names
    assert any(n.startswith("ZMQbg/IO") for n in names), names  # ZeroMQ names its own
