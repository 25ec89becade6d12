"""Real local clusters: birdnetd processes (on loopback, or in network namespaces through
``prefixes``) and training processes started with multiprocessing's spawn, all reaped on exit.
Used by ``birdnet demo``, the benchmarks, the examples and the tests, and importable by users'
own tests: it needs only birdnet's core (no benchmark code, torch or scikit-learn).

    from birdnet.cluster import LocalCluster

    with tempfile.TemporaryDirectory() as tmp, LocalCluster(2, Path(tmp)) as cl:
        results = cl.run(my_worker, config)   # my_worker(socket, node, local, config)
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from birdnet.osutil import unix_socket_accepts
from birdnet.shm import remove_stale, segment_prefix

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


def rank_results(cmds: list[list[str]], timeout: float, what: str, *,
                 grace_timeout: float = 15.0, poll_interval: float = 0.2) -> list[dict]:
    """Start one process per command (a rank of a torch.distributed run) and return, in order, the
    JSON object each prints as its last line.

    No run can hang: ``timeout`` seconds is one deadline for all ranks together, and once a rank
    has failed the others get ``grace_timeout`` seconds to end (they usually wait in a collective
    the failed rank will never join). Then every rank still running is killed and the call raises:
    ``RuntimeError`` naming ``what`` with the failed ranks' stderr, first to fail first (the first
    is usually the cause, the others' "connection reset" its echo), or
    ``subprocess.TimeoutExpired`` with the stacks of the ranks still running (``py-spy dump``,
    where py-spy is installed) and their stderr. Output goes to files, not pipes: a rank that
    writes more than a pipe holds while the driver waits on another would block in ``write``.
    """
    import tempfile
    with tempfile.TemporaryDirectory(prefix="birdnet-ranks-") as tmp:
        files = [(open(Path(tmp) / f"{i}.out", "w+"), open(Path(tmp) / f"{i}.err", "w+"))
                 for i in range(len(cmds))]
        procs: list[subprocess.Popen] = []
        try:
            for cmd, (out, err) in zip(cmds, files):
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, text=True))
            deadline = time.monotonic() + timeout
            failed: list[int] = []
            while True:
                for i, p in enumerate(procs):
                    if i not in failed and p.poll() is not None and p.returncode != 0:
                        failed.append(i)
                running = [i for i, p in enumerate(procs) if p.poll() is None]
                if not running:
                    break
                now = time.monotonic()
                if failed:
                    deadline = min(deadline, now + grace_timeout)
                if now >= deadline:
                    if failed:
                        break
                    stacks = "".join(f"--- rank {i} (pid {procs[i].pid}), still running:\n"
                                     f"{_py_spy_dump(procs[i].pid)}{_tail(files[i][1], 1500)}\n"
                                     for i in running)
                    raise subprocess.TimeoutExpired(f"{what}: ranks {running}", timeout,
                                                    output=stacks)
                time.sleep(poll_interval)
            if failed:
                raise RuntimeError(f"{what}: rank(s) {failed} failed (first to fail first):\n" + "".join(
                    f"--- rank {i}, exit status {procs[i].returncode}:\n{_tail(files[i][1], 3000)}\n"
                    for i in failed))
            outs = []
            for i, (out, _) in enumerate(files):
                out.seek(0)
                lines = out.read().strip().splitlines()
                if not lines:
                    raise RuntimeError(f"{what}: rank {i} exited 0 but printed no result")
                outs.append(json.loads(lines[-1]))
            return outs
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for out, err in files:
                out.close()
                err.close()


def _tail(f, n: int) -> str:
    f.flush()
    f.seek(0)
    return f.read()[-n:]


def _py_spy_dump(pid: int, dump_timeout: float = 30.0) -> str:
    """The Python stacks of process ``pid`` from py-spy, or "" where py-spy is not installed:
    what a hung rank was waiting for, before it is killed."""
    import shutil
    exe = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if exe is None:
        return ""
    try:
        r = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                           timeout=dump_timeout)
    except subprocess.TimeoutExpired:
        return f"(py-spy dump took over {dump_timeout:.0f} s)\n"
    return r.stdout[-6000:] + r.stderr[-500:]


class LocalCluster:
    """``n`` daemons; ``addresses`` default to loopback; ``prefixes[i]`` wraps node i's command
    (e.g. ``ip netns exec NS``)."""

    def __init__(self, n: int, tmp: Path, *, local_size: int = 1, extra: list[str] | None = None,
                 addresses: list[str] | None = None, prefixes: list[list[str]] | None = None,
                 per_node_extra: list[list[str]] | None = None, peer_timeout: float = 4.0,
                 heartbeat_interval: float = 0.25, kernel_warmup: str = "used") -> None:
        self.n, self.tmp, self.local_size = n, Path(tmp), local_size
        # short timeouts suit tests (faults are noticed fast); benchmarks pass longer ones
        self.peer_timeout, self.heartbeat_interval = peer_timeout, heartbeat_interval
        # "used": the daemons compile only the codecs their calls use (daemon/warmup.py); "all", the
        # daemon's default, would compile every codec in the background, loading the shared cores
        # under timing-sensitive tests and measured benchmarks
        self.kernel_warmup = kernel_warmup
        self.extra = list(extra or [])
        ports = free_ports(n) if addresses is None else [29600 + i for i in range(n)]
        addresses = addresses or ["127.0.0.1"] * n
        self.hosts = self.tmp / "hosts.txt"
        self.hosts.write_text("# test ring\n" + "".join(f"[{a}]:{p}\n" if ":" in a else f"{a}:{p}\n"
                                                                 for a, p in zip(addresses, ports)))
        self.sockets = [str(self.tmp / f"node{i}.sock") for i in range(n)]
        self.prefixes = prefixes or [[] for _ in range(n)]
        self.per_node_extra = per_node_extra or [[] for _ in range(n)]
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.logs = [self.tmp / f"node{i}.log" for i in range(n)]
        self.killed: set[int] = set()  #: nodes whose daemon ended by a signal (see stop)

    def command(self, i: int) -> list[str]:
        return [*self.prefixes[i], sys.executable, "-m", "birdnet.daemon.main", "--peers", str(self.hosts),
                "--rank", str(i), "--socket", self.sockets[i], "--local-size", str(self.local_size),
                "--peer-timeout", str(self.peer_timeout), "--heartbeat-interval", str(self.heartbeat_interval),
                "--kernel-warmup", self.kernel_warmup, *self.extra, *self.per_node_extra[i]]

    def start_node(self, i: int, wait: bool = True) -> None:
        env = dict(os.environ)
        # the daemons import the same birdnet as this process (a checkout or an installed copy)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
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
        # ``with cluster:`` does not call __exit__ when __enter__ raises: a daemon that fails to
        # come up must not leave the others running behind it
        try:
            for i in range(self.n):
                self.start_node(i, wait=False)
            for i in range(self.n):
                self.wait_ready(i)
        except BaseException:
            self.stop()
            raise
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
        if p.returncode is not None and p.returncode < 0:
            self.killed.add(i)
        return p.returncode

    def stop(self) -> list[int | None]:
        codes = [self.stop_node(i) for i in range(self.n)]
        # A daemon killed by a signal (a fault test's SIGKILL) could not unlink its shared memory;
        # a restarted one removes what it left (remove_stale), one never restarted would leave it in
        # /dev/shm for good. Daemons that shut down cleanly are left alone: their own clean-up is what
        # tests check.
        for i in sorted(self.killed):
            remove_stale(segment_prefix(self.sockets[i]))
        self.killed.clear()
        return codes

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
        per_node = self.local_size if per_node is None else per_node
        nodes = range(self.n) if nodes is None else nodes
        jobs = [(self.sockets[i], i, j) for i in nodes for j in range(per_node)]
        return Workers(fn, jobs, args)


class Workers:
    """Training processes in flight, one spawned process each (not a Pool: a pool's workers and
    its result thread do not survive a Ctrl-C reliably). Workers ignore SIGINT, so a Ctrl-C reaches
    only the parent, which then ends them with :meth:`terminate`. ``get`` collects results ordered
    by (node, local) and re-raises the first worker error; the processes are always reaped."""

    def __init__(self, fn, jobs, args) -> None:
        ctx = mp.get_context("spawn")
        self.queue = ctx.Queue()
        self.results: dict[int, tuple] = {}
        self.procs = [ctx.Process(target=_child, args=(fn, s, i, j, args, self.queue, k), daemon=True)
                      for k, (s, i, j) in enumerate(jobs)]
        for p in self.procs:
            p.start()

    def _collect(self, timeout: float) -> None:
        import queue as _queue
        try:
            k, res = self.queue.get(timeout=timeout)
        except _queue.Empty:
            return
        self.results[k] = res

    def ready(self) -> bool:
        while len(self.results) < len(self.procs):
            before = len(self.results)
            self._collect(0.0)
            if len(self.results) == before:
                break
        return len(self.results) == len(self.procs)

    def get(self, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        try:
            while len(self.results) < len(self.procs):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self.procs) - len(self.results)} worker(s) did not finish within {timeout} s")
                dead = [k for k, p in enumerate(self.procs) if k not in self.results and p.exitcode not in (None, 0)]
                if dead and not self.queue.qsize():
                    raise RuntimeError(f"worker {dead[0]} died with exit code {self.procs[dead[0]].exitcode}")
                self._collect(min(left, 0.5))
        finally:
            self.terminate()
        out = [self.results[k] for k in range(len(self.procs))]
        return [o[1] if o[0] == "ok" else _raise(o[1]) for o in out]

    def terminate(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def _child(fn, sock, node, local, args, q, k):
    import signal as _signal
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    q.put((k, _call(fn, sock, node, local, args)))


def _call(fn, sock, node, local, args):
    try:
        return ("ok", fn(sock, node, local, *args))
    except BaseException as exc:  # noqa: BLE001
        return ("err", exc)


def _raise(exc):
    raise exc
