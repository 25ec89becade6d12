"""Tests use the package's local cluster (birdnet.cluster), re-exported here, and helpers
that wait on a daemon."""
import time

from birdnet.client import Client

from birdnet.cluster import LocalCluster, Workers, free_ports  # noqa: F401


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


def wait_ring_ok(cl: LocalCluster, timeout: float = 20.0) -> float:
    """Seconds until every daemon reports every peer reachable (not lost, connecting or refused)."""
    t0 = time.monotonic()
    while True:
        states = []
        for s in cl.sockets:
            try:
                with Client(s, job="__test_status__", connect_timeout=2) as c:
                    states += [p["state"] for p in c.status()["peers"]]
            except Exception as exc:  # noqa: BLE001 - a restarting daemon
                states.append(repr(exc))
        if all(st in ("self", "connected", "ok") for st in states):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"ring did not recover within {timeout} s: {states}")
        time.sleep(0.25)
