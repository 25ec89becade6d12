"""Soak: 4 daemons, many rounds of mixed sizes and codecs, with client sessions coming and going
between phases. After a warm-up phase (every size x codec once, so Numba has compiled everything
and buffers are at their high-water mark), the daemons' resident memory, open file descriptors
and /dev/shm entries must not grow.

Bounded to about a minute by default; ``BIRDNET_SOAK_SECONDS=600`` for a longer run (CI uses the
default). Tolerances: RSS may grow by at most 16 MiB + 10 % over the whole measured run (allocator
noise and Python's free lists; a leak of one tensor per round would be hundreds of MiB), file
descriptors by at most 2, /dev/shm entries of the daemons not at all (0 when no client is attached).
"""
from __future__ import annotations

import os
import time

import fault_workers
import pytest
from cluster import LocalCluster

from birdnet.shm import segment_prefix

pytestmark = pytest.mark.heavy  # CI runs it on the default Python only (.ci/run)

SECONDS = float(os.environ.get("BIRDNET_SOAK_SECONDS", "36"))
SIZES = [0, 1, 1000, 5000, 100003, 400000]
CODECS = ["none", "fp16", "topk", "randomk", "qsgd", "marsit"]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def shm_entries(sockets: list[str]) -> int:
    prefixes = tuple(segment_prefix(s) for s in sockets)
    return sum(1 for f in os.listdir("/dev/shm") if f.startswith(prefixes))


def snapshot(cl: LocalCluster) -> dict:
    time.sleep(1.5)  # sessions of the phase's clients are reaped (bye is immediate; exit within 1 s)
    return {"rss": [rss_bytes(p.pid) for p in cl.procs], "fds": [fds(p.pid) for p in cl.procs],
            "shm": shm_entries(cl.sockets)}


@pytest.mark.timeout(max(180, int(SECONDS * 3) + 120))
def test_soak_memory_fds_and_shm_do_not_grow(tmp_path):
    with LocalCluster(4, tmp_path) as cl:
        warm = cl.run(fault_workers.mixed_rounds, 1.0, SIZES, CODECS, 1, timeout=300)
        assert warm[0] >= len(SIZES) * len(CODECS)
        base = snapshot(cl)
        assert base["shm"] == 0
        rounds = 0
        phases = 3
        for k in range(phases):
            try:
                res = cl.run(fault_workers.mixed_rounds, SECONDS / phases, SIZES, CODECS, 100 + k,
                             timeout=SECONDS + 120)
            except Exception as exc:  # a rare failure must say what the daemons saw
                tails = "\n".join(f"--- node {i}, end of its log:\n{cl.log(i)[-4000:]}" for i in range(4))
                raise AssertionError(f"phase {k}: {exc!r}\n{tails}") from exc
            assert len(set(res)) == 1  # every process ran the same rounds
            rounds += res[0]
        end = snapshot(cl)
    print(f"soak: {rounds} rounds x 4 nodes; base {base}; end {end}")
    assert rounds > 100
    for i in range(4):
        assert end["rss"][i] <= base["rss"][i] * 1.10 + (16 << 20), (i, base, end)
        assert end["fds"][i] <= base["fds"][i] + 2, (i, base, end)
    assert end["shm"] == 0
