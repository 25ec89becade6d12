"""Tests use the package's local cluster (birdnet.bench.cluster), re-exported here, and helpers
that wait on a daemon."""
import time

from birdnet.client import Client

from birdnet.bench.cluster import LocalCluster, Workers, free_ports  # noqa: F401


def wait_warm(sock: str, timeout: float = 180.0) -> None:
    """Until the daemon's kernel warm-up (daemon/warmup.py) has nothing compiling or loading: its
    subprocesses hold descriptors (and memory) while they run, which baselines must not count.
    Quick when Numba's cache is warm; minutes when the kernels' sources changed on a loaded machine."""
    deadline = time.monotonic() + timeout
    while True:
        with Client(sock, job="__warm__", connect_timeout=10.0) as c:
            k = c.status().get("kernels", {})
        if k.get("process") not in ("not started", "compiling") and not k.get("loading") and not k.get("waiting"):
            return
        assert time.monotonic() < deadline, f"kernel warm-up still busy after {timeout} s: {k}"
        time.sleep(0.5)
