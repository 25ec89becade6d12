"""Real local clusters: birdnetd processes (on loopback, or in network namespaces through
``prefixes``) and training processes started with multiprocessing's spawn, all reaped on exit.
Used by ``birdnet demo``, the benchmarks and the tests."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from birdnet.osutil import unix_socket_accepts

START_TIMEOUT = 30.0


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class LocalCluster:
    """``n`` daemons; ``addresses`` default to loopback; ``prefixes[i]`` wraps node i's command
    (e.g. ``ip netns exec NS``)."""

    def __init__(self, n: int, tmp: Path, *, local_size: int = 1, extra: list[str] | None = None,
                 addresses: list[str] | None = None, prefixes: list[list[str]] | None = None,
                 per_node_extra: list[list[str]] | None = None, peer_timeout: float = 4.0,
                 heartbeat_interval: float = 0.25) -> None:
        self.n, self.tmp, self.local_size = n, Path(tmp), local_size
        # short timeouts suit tests (faults are noticed fast); benchmarks pass longer ones
        self.peer_timeout, self.heartbeat_interval = peer_timeout, heartbeat_interval
        self.extra = list(extra or [])
        ports = free_ports(n) if addresses is None else [29600 + i for i in range(n)]
        addresses = addresses or ["127.0.0.1"] * n
        self.hosts = self.tmp / "hosts.txt"
        self.hosts.write_text("# test ring\n" + "".join(f"{a}:{p}\n" for a, p in zip(addresses, ports)))
        self.sockets = [str(self.tmp / f"node{i}.sock") for i in range(n)]
        self.prefixes = prefixes or [[] for _ in range(n)]
        self.per_node_extra = per_node_extra or [[] for _ in range(n)]
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.logs = [self.tmp / f"node{i}.log" for i in range(n)]

    def command(self, i: int) -> list[str]:
        return [*self.prefixes[i], sys.executable, "-m", "birdnet.daemon.main", "--peers", str(self.hosts),
                "--rank", str(i), "--socket", self.sockets[i], "--local-size", str(self.local_size),
                "--peer-timeout", str(self.peer_timeout), "--heartbeat-interval", str(self.heartbeat_interval),
                *self.extra, *self.per_node_extra[i]]

    def start_node(self, i: int, wait: bool = True) -> None:
        env = dict(os.environ)
        # the daemons import the same birdnet as this process (a checkout or an installed copy)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
        # All daemons of a local cluster share this machine's cores: give each its share of
        # Numba threads rather than letting every one start a thread per core (oversubscription).
        env.setdefault("NUMBA_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.n)))
        with open(self.logs[i], "ab") as log:
            self.procs[i] = subprocess.Popen(self.command(i), stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)
        if wait:
            self.wait_ready(i)

    def wait_ready(self, i: int) -> None:
        """Until daemon i accepts connections on its socket (a file left by a killed instance
        does not count)."""
        deadline = time.monotonic() + START_TIMEOUT
        while not unix_socket_accepts(self.sockets[i]):
            p = self.procs[i]
            if p is not None and p.poll() is not None:
                raise RuntimeError(f"daemon {i} exited with {p.returncode}: {self.logs[i].read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon {i} did not open its socket: {self.logs[i].read_text()[-2000:]}")
            time.sleep(0.05)

    def start(self) -> "LocalCluster":
        for i in range(self.n):
            self.start_node(i, wait=False)
        for i in range(self.n):
            self.wait_ready(i)
        return self

    def send_signal(self, i: int, sig: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            os.killpg(p.pid, sig)

    def stop_node(self, i: int, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        p = self.procs[i]
        if p is None:
            return None
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        self.procs[i] = None
        return p.returncode

    def stop(self) -> list[int | None]:
        return [self.stop_node(i) for i in range(self.n)]

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def run(self, fn, *args, per_node: int | None = None, timeout: float = 120.0, nodes=None) -> list:
        return self.run_async(fn, *args, per_node=per_node, nodes=nodes).get(timeout)

    def run_async(self, fn, *args, per_node: int | None = None, nodes=None) -> "Workers":
        """Run ``fn(socket, node, local, *args)`` in one spawned process per training process;
        results ordered by (node, local). Raises the first worker error."""
        """Start ``fn(socket, node, local, *args)`` in one spawned process per training process."""
        per_node = self.local_size if per_node is None else per_node
        nodes = range(self.n) if nodes is None else nodes
        jobs = [(self.sockets[i], i, j) for i in nodes for j in range(per_node)]
        return Workers(fn, jobs, args)


class Workers:
    """Training processes in flight; ``get`` collects results ordered by (node, local) and
    re-raises the first worker error; the pool is always terminated."""

    def __init__(self, fn, jobs, args) -> None:
        self.pool = mp.get_context("spawn").Pool(len(jobs))
        self.results = [self.pool.apply_async(_call, (fn, s, i, j, args)) for s, i, j in jobs]

    def ready(self) -> bool:
        return all(r.ready() for r in self.results)

    def get(self, timeout: float) -> list:
        try:
            deadline = time.monotonic() + timeout
            out = [r.get(max(0.1, deadline - time.monotonic())) for r in self.results]
        finally:
            self.pool.terminate()
            self.pool.join()
        return [o[1] if o[0] == "ok" else _raise(o[1]) for o in out]

    def terminate(self) -> None:
        self.pool.terminate()
        self.pool.join()


def _call(fn, sock, node, local, args):
    try:
        return ("ok", fn(sock, node, local, *args))
    except BaseException as exc:  # noqa: BLE001
        return ("err", exc)


def _raise(exc):
    raise exc
