"""Kernel warm-up: Numba compiles a codec's kernels before a round needs them, never on the ring thread.

Why. The codecs' kernels (birdnet/kernels, ``@njit(cache=True)``) are compiled the first time they
run, and a kernel module with explicit signatures compiles at import. On the ring thread that took
tens of seconds cold (minutes on a Raspberry Pi); the ring thread is the one that sends and answers
the heartbeats, so the node's neighbours declared it lost and the user's first compressed call
failed with PeerLostError. Numba's global compiler lock is taken for a cache *load* too, so a ring
thread that even touches a kernel another thread is compiling stalls as long.

What the daemon does (docs/architecture.md, "Kernel warm-up"):

1. Compilation happens in subprocesses, ``python -m birdnet.daemon.warmup``: at start one for
   every configuration of :data:`CONFIGURATIONS` (every registry codec that has kernels, and the
   variants people use; setting ``kernel_warmup = "all"``), and one for the configuration a call
   needs when no subprocess has compiled it yet. Each runs the configuration through the daemon's
   own round runner on an in-memory ring, so Numba fills its on-disk cache (``NUMBA_CACHE_DIR``,
   else ``__pycache__`` beside the kernels) with the very kernels and argument types a round uses.
   The compilation never holds the daemon's GIL, and LLVM's memory (hundreds of MB) goes when the
   subprocess exits. A stamp per configuration (for these sources, this Numba, this CPU) lets a
   later start skip it without importing Numba; a lock per configuration lets daemons of one
   machine share the work (a local cluster compiles once, not N times).
2. In the daemon, a warm-up thread (:class:`KernelWarmer`) then runs the configuration once
   in-process: a cache load (a second, against tens of seconds to compile), or, when no
   subprocess can run or the cache is not usable, the compilation itself. Meanwhile the ring
   thread keeps sending and answering heartbeats.
3. The service thread parks a submit whose codec configuration is not loaded yet
   (:meth:`KernelWarmer.ready`), and every later submit behind it, so no round reaches the ring
   thread before its kernels are in the process. To the other nodes the node looks like one whose
   training processes are late: they wait (round_timeout), they do not declare it lost. A call
   parked longer than ``warmup_timeout`` fails with RoundTimeoutError naming the codec.

A listener on Numba's compiler lock counts entries from the ring thread (status
``kernels.ring_thread_compiles``; a warning names the round): it stays 0 unless warming missed a
path, which tests/test_warmup.py checks.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from birdnet.ring.transport import MemoryRing, MemoryTransport

log = logging.getLogger("birdnet.warmup")

#: codecs whose rounds run no Numba kernel (NumPy only): always ready
NO_KERNELS = frozenset({"none", "fp16"})
#: tensor sizes warmed: one below and one above the kernels' serial/parallel switch
#: (birdnet.kernels.blocks.SERIAL_BELOW = 65536), both above the default dense_threshold
SIZES = (3001, 70001)
#: rounds per size: state-dependent paths (shared mode's proposals, a flush round) need the second
ROUNDS = 3
WORLD = 2
#: the thread name the ring worker runs under (engine.RingWorker)
RING_THREAD = "birdnet-ring"


def config_key(codec: str, params: dict[str, Any] | None) -> str:
    """One string per (codec, parameters): the unit of warming and of readiness."""
    return json.dumps([codec, params or {}], sort_keys=True, separators=(",", ":"))


#: What the subprocess warms at start, in this order (the codecs people start with first): every
#: registry codec with kernels at its defaults, then the variants that take other kernel paths
#: (momentum in the codec, as the PyTorch adapter sets it for momentum SGD; shared mode; float16
#: values; global compensation with flush rounds; the block-age accumulator). Written out rather
#: than derived from the codec classes, so reading it imports no kernel module (that compiles).
#: A configuration not listed is warmed, the same way, at its first call.
CONFIGURATIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("birdplus", {}), ("birdplus", {"momentum": 0.9}), ("birdplus", {"mode": "shared"}),
    ("birdplus", {"mode": "shared", "momentum": 0.9}), ("birdplus", {"mode": "shared", "value_dtype": "float16"}),
    ("birdplus", {"accumulator": "block_age", "momentum": 0.9}),
    ("marsit", {}), ("marsit", {"momentum": 0.9}), ("marsit", {"compensation": "global", "flush": 2}),
    ("topk", {}), ("topk", {"momentum": 0.9}),
    ("bird", {}), ("bird", {"momentum": 0.9}), ("bird", {"mode": "shared"}),
    ("randomk", {}), ("randomk", {"error_feedback": True, "momentum": 0.9}),
    ("dgc", {}), ("dgc", {"momentum": 0.9}),
    ("qsgd", {}),
    ("efsign", {}), ("efsign", {"momentum": 0.9}),
    ("signcascade", {}), ("signcascade", {"flush": 2}),
    ("lowbit", {}), ("lowbit", {"bits": 1}),
    ("ternary", {}),
    ("sparseloco", {}),
)


def configurations() -> list[tuple[str, dict[str, Any]]]:
    return [(c, dict(p)) for c, p in CONFIGURATIONS]


def _warm_params(params: dict[str, Any]) -> dict[str, Any]:
    """The parameters a configuration is warmed with: its own, except a flush period, which runs
    every 2nd round here (a flush round's kernels are the same for any period; K=100 would need 100
    rounds to reach one)."""
    p = dict(params)
    if isinstance(p.get("flush"), int) and not isinstance(p.get("flush"), bool) and p["flush"] > 2:
        p["flush"] = 2
    return p


class _CompileCounter:
    """Counts Numba compilations (not cache loads) while installed, and times each kernel's
    (inclusive of what it compiled on the way: the functions it calls or inlines)."""

    def __init__(self) -> None:
        from numba.core import event
        counter = self
        self.count = 0
        self.seconds: dict[str, float] = {}  #: outermost compilations only: they add up to the total
        self._stack: dict[int, list[float]] = {}

        class _L(event.Listener):
            def on_start(self, ev: Any) -> None:
                counter.count += 1
                counter._stack.setdefault(threading.get_ident(), []).append(time.perf_counter())

            def on_end(self, ev: Any) -> None:
                stack = counter._stack.get(threading.get_ident())
                if not stack:
                    return
                t = stack.pop()
                if stack:
                    return  # nested in a kernel being compiled: its time is that kernel's
                f = getattr((ev.data or {}).get("dispatcher"), "py_func", None)
                key = f"{(getattr(f, '__module__', '') or '').rsplit('.', 1)[-1]}.{getattr(f, '__qualname__', '?')}"
                counter.seconds[key] = counter.seconds.get(key, 0.0) + time.perf_counter() - t

        self.listener = _L()

    @contextlib.contextmanager
    def counting(self):
        from numba.core import event
        with event.install_listener("numba:compile", self.listener):
            yield self


class _FrameTransport(MemoryTransport):
    def recv(self, deadline: float) -> tuple[dict[str, Any], list[memoryview]]:
        header, views = super().recv(deadline)
        return header, [memoryview(bytearray(v)) for v in views]


class _FrameRing(MemoryRing):
    """A MemoryRing whose received buffers are writable, as ZeroMQ frames are (MemoryTransport's
    are read-only bytes). Numba compiles a kernel once per array mutability: warmed with read-only
    buffers, the daemon's own argument types would still compile on the ring thread."""

    def __init__(self, world: int) -> None:
        super().__init__(world)
        self.transports = [_FrameTransport(self, r) for r in range(world)]


def _lowered(node: Callable[[Any], None]) -> Callable[[Any], None]:
    """``node`` run with every size threshold lowered on its own thread (each node of the in-memory
    ring runs on a thread of its own)."""
    from birdnet.kernels._paths import lowered

    def run(t: Any) -> None:
        with lowered(SERIAL_BELOW=0, CANDIDATES_FROM=1024):
            node(t)
    return run


def warm(codec: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``codec`` with ``params`` through the daemon's round runner on an in-memory ring of
    WORLD nodes, ROUNDS rounds at each of SIZES, as the daemon's rounds run (same kernels, same
    argument types), so every kernel it uses is compiled, or loaded from the cache, in this
    process. Returns seconds taken and the number of compilations. Raises CodecError for a codec
    or parameters that do not exist."""
    from birdnet.daemon.engine import Contribution, LocalRound, RoundRunner, StateStore

    from birdnet.codecs import get_codec
    from birdnet.config import Settings

    t0 = time.perf_counter()
    settings = Settings()
    counter = _CompileCounter()
    with counter.counting():
        # inside the count: a kernel module with explicit signatures compiles at its import
        desc_codec = get_codec(codec, **_warm_params(params or {})).describe()  # CodecError: bad parameter
        # then once more with the size thresholds lowered on this thread, and at a size whose block
        # ids no longer fit in 16 bits (payloads carry them as uint32 then): the variants a round
        # of a large tensor takes (the parallel gathers of >= 64K kept values, the sampled-bound
        # selection from 32K blocks on, uint32 ids) compile here too, not on the ring thread at a
        # user's first call with a real model (birdnet.kernels._paths)
        # at a size whose block ids no longer fit in 16 bits (payloads carry them as uint32 then)
        big = 65536 * int(desc_codec.get("block", 8)) + 1
        for n, lower in [(n, False) for n in SIZES] + [(big, True)]:
            runners = [RoundRunner(settings, StateStore(1 << 30)) for _ in range(WORLD)]
            rng = np.random.default_rng(n)
            xs = [rng.standard_normal((ROUNDS, n)).astype(np.float32) for _ in range(WORLD)]

            def node(t: Any, n: int = n, runners: list = runners, xs: list = xs) -> None:
                for k in range(ROUNDS):
                    desc = {"kind": "allreduce", "name": "warmup", "shape": [n], "dtype": "float32", "op": "mean",
                            "codec": desc_codec, "root": None}
                    part = Contribution(b"warmup", k, xs[t.rank][k].copy(), 0, t.rank)
                    rnd = LocalRound(job="warmup", seq=k, kind="allreduce", desc=desc, parts=[part])
                    runners[t.rank].run(rnd, t, t.rank, WORLD, [1] * WORLD)

            if lower:
                _FrameRing(WORLD).run(_lowered(node), timeout=3600.0)
            else:
                _FrameRing(WORLD).run(node, timeout=3600.0)
    return {"seconds": time.perf_counter() - t0, "compiled": counter.count,
            "kernels": {k: round(v, 3) for k, v in sorted(counter.seconds.items())}}


# -- the on-disk cache: where it is, whether a warm-up is complete, who warms now -------------------
def cache_dir() -> Path | None:
    """Where Numba keeps birdnet's compiled kernels: NUMBA_CACHE_DIR, else the ``__pycache__``
    beside birdnet/kernels when it is writable; None when neither is usable (Numba then falls back
    to a per-user directory, or caches nothing: the daemon then compiles in its warm-up thread)."""
    env = os.environ.get("NUMBA_CACHE_DIR")
    if env:
        return Path(env)
    import birdnet.kernels
    d = Path(birdnet.kernels.__file__).resolve().parent / "__pycache__"
    if os.access(d if d.exists() else d.parent, os.W_OK):
        return d
    return None


def _cpu() -> str:
    """What Numba's cache index is specific to besides the sources: the machine and its CPU."""
    lines = []
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                k = line.split(":", 1)[0].strip()
                if k in ("model name", "CPU part", "CPU implementer", "Hardware", "flags", "Features"):
                    lines.append(line.strip())
                if not line.strip() and lines:
                    break  # the first processor's block is enough
    return platform.machine() + "\n" + "\n".join(lines)


@functools.lru_cache(maxsize=1)
def stamp_key() -> str:
    """A digest of everything that decides whether Numba's cache holds every kernel of
    :func:`configurations`: the kernel sources as Numba sees them (mtime and size, its own cache
    index key), Python, Numba and llvmlite versions, the CPU, the Numba options that change code,
    and the list of configurations itself."""
    import birdnet.kernels
    from birdnet import __version__
    parts = [__version__, sys.version, _cpu(), repr(configurations()), repr(SIZES), str(ROUNDS),
             "large-tensor pass 1"]  # what warm() runs besides SIZES: a change must re-warm
    for dist in ("numba", "llvmlite", "numpy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            parts.append(f"{dist}={importlib.metadata.version(dist)}")
    for k in sorted(os.environ):
        if k.startswith("NUMBA_") and k not in ("NUMBA_NUM_THREADS", "NUMBA_CACHE_DIR"):
            parts.append(f"{k}={os.environ[k]}")
    for f in sorted(Path(birdnet.kernels.__file__).resolve().parent.glob("*.py")):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_mtime_ns}:{st.st_size}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _stamp(d: Path, key: str) -> Path:
    """The file that says configuration ``key`` is in the cache ``d`` for these sources, this
    Numba and this CPU (:func:`stamp_key`), and the lock file of its warming beside it."""
    return d / f"birdnet-warm-{stamp_key()}" / hashlib.sha256(key.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _exclusive(path: Path | None):
    """One process at a time warms a configuration (per cache directory): a daemon of the same
    machine that comes second then loads what the first compiled instead of compiling it again."""
    if path is None:
        yield
        return
    import fcntl
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path.with_suffix(".lock"), "a+b")  # noqa: SIM115 - closed below
    except OSError:
        yield
        return
    try:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield
    finally:
        fh.close()


# -- the subprocess ---------------------------------------------------------------------------------
def _emit(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """``python -m birdnet.daemon.warmup``: put every configuration (or the ones named) into Numba's
    on-disk cache, one JSON line per configuration on stdout. A configuration stamped as done is
    skipped without importing Numba, so a start with a warm cache costs a fraction of a second."""
    p = argparse.ArgumentParser(prog="python -m birdnet.daemon.warmup",
                                description="compile birdnet's codec kernels into Numba's on-disk cache "
                                            "(NUMBA_CACHE_DIR, else __pycache__ beside birdnet/kernels)")
    p.add_argument("--codec", action="append", default=[], metavar="NAME[:JSON]",
                   help="warm only this codec (with these parameters, a JSON object); repeatable; "
                        "default: every configuration birdnetd warms at start")
    p.add_argument("--force", action="store_true", help="run every configuration even if stamped as done")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    d = cache_dir()
    plan = []
    for spec in a.codec:
        name, _, js = spec.partition(":")
        plan.append((name, json.loads(js) if js else {}))
    plan = plan or configurations()
    keys = [config_key(c, q) for c, q in plan]
    stamps = {k: (_stamp(d, k) if d is not None else None) for k in keys}
    cached = [k for k in keys if not a.force and stamps[k] is not None and stamps[k].exists()]
    _emit({"t": "plan", "configurations": len(plan), "keys": keys, "cached": len(cached),
           "cache_dir": str(d) if d else None})
    compiled = failed = 0
    for i, ((codec, params), k) in enumerate(zip(plan, keys), 1):
        stamp = stamps[k]
        msg = {"key": k, "codec": codec, "params": params, "i": i, "of": len(plan)}
        if k in cached:
            _emit({"t": "warmed", **msg, "seconds": 0.0, "compiled": 0, "stamped": True})
            continue
        try:
            with _exclusive(stamp):
                if stamp is not None and stamp.exists() and not a.force:  # done while this one waited
                    _emit({"t": "warmed", **msg, "seconds": 0.0, "compiled": 0, "stamped": True})
                    continue
                r = warm(codec, params)
                if stamp is not None:
                    with contextlib.suppress(OSError):
                        stamp.write_text(json.dumps({"seconds": r["seconds"], "compiled": r["compiled"]}))
            compiled += r["compiled"]
            _emit({"t": "warmed", **msg, "seconds": round(r["seconds"], 3), "compiled": r["compiled"],
                   "kernels": r["kernels"]})
        except Exception as exc:  # noqa: BLE001 - one codec's failure must not stop the others
            failed += 1
            _emit({"t": "failed", **msg, "error": f"{type(exc).__name__}: {exc}"})
    _emit({"t": "done", "seconds": round(time.perf_counter() - t0, 3), "compiled": compiled, "failed": failed})
    return 0 if failed == 0 else 1


# -- in the daemon ----------------------------------------------------------------------------------
class _RingCompileWatch:
    """Counts entries into Numba's compiler lock from the ring thread (a compile or a cache load
    there: the heartbeats stop meanwhile). Installed once per process."""

    def __init__(self) -> None:
        from numba.core import event
        self.count = 0
        watch = self

        class _L(event.Listener):
            def on_start(self, ev: Any) -> None:
                if threading.current_thread().name == RING_THREAD:
                    watch.count += 1
                    if watch.count == 1:
                        log.warning("a Numba kernel is being compiled or loaded on the ring thread (the warm-up "
                                    "missed it): this node sends no heartbeats until it is done")

            def on_end(self, ev: Any) -> None:
                pass

        event.register("numba:compiler_lock", _L())


_watch: _RingCompileWatch | None = None
_watch_lock = threading.Lock()


def _install_watch() -> None:
    global _watch
    with _watch_lock:
        if _watch is None:
            try:
                _watch = _RingCompileWatch()
            except Exception as exc:  # noqa: BLE001 - a diagnostic; the warm-up works without it
                log.debug("no compiler-lock watch: %r", exc)


def ring_thread_compiles() -> int:
    return _watch.count if _watch is not None else 0


def _label(k: str) -> str:
    codec, params = json.loads(k)
    return codec + (" " + json.dumps(params, sort_keys=True) if params else "")


class KernelWarmer:
    """The daemon's side of the warm-up: the subprocesses, the in-process warm-up thread and the
    readiness the service thread asks before it takes a submit (module docstring).

    ``mode``: "all" (a subprocess warms every configuration at start) or "used" (nothing at start).
    Either way the configuration a call needs is compiled in a subprocess of its own, unless one
    has done it already, and then loaded here; it compiles in this process only when no
    subprocess can run. ``wake`` is called (from the warm-up thread) when a configuration became
    ready, so the service loop takes the calls it parked."""

    def __init__(self, mode: str = "all", wake: Callable[[], None] | None = None) -> None:
        self.mode, self.wake = mode, wake or (lambda: None)
        self.lock = threading.Lock()
        self._cond = threading.Condition(self.lock)
        self.ready_keys: set[str] = set()
        self.failed: dict[str, Exception] = {}  #: key -> error: taken as ready (the call reports it)
        self.requested: set[str] = set()
        self.requests: queue.Queue[str | None] = queue.Queue()
        self.procs: list[subprocess.Popen] = []
        self.plan_state = "off" if mode != "all" else "not started"  #: compiling | done | exited ... | cannot start
        self.plan_keys: set[str] = set()
        self.on_disk: set[str] = set()  #: keys a subprocess has put into the cache (or found stamped)
        self.current: str | None = None
        self.stopping = False
        self.loads = 0  #: configurations warmed in this process
        self.load_seconds = 0.0
        self.no_subprocess = False
        self._thread: threading.Thread | None = None

    # -- control ----------------------------------------------------------------------------------
    def start(self, first: list[tuple[str, dict[str, Any]]] | None = None) -> None:
        if self.mode == "all":
            self._spawn([], plan=True)
        self._thread = threading.Thread(target=self._run, name="birdnet-warmup", daemon=True)
        self._thread.start()
        for codec, params in first or []:
            self.ready(codec, params)

    def stop(self) -> None:
        self.stopping = True
        self.requests.put(None)
        with self.lock:
            self._cond.notify_all()
            procs = list(self.procs)
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self._thread is not None:
            # briefly: a load in progress ends with the process (the thread is a daemon thread)
            self._thread.join(1.0)

    def _spawn(self, args: list[str], plan: bool = False) -> subprocess.Popen | None:
        """Start a warming subprocess (its stderr is the daemon's: Numba's warnings reach the log)."""
        if self.no_subprocess:
            return None
        try:
            proc = subprocess.Popen([sys.executable, "-m", "birdnet.daemon.warmup", *args],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        except OSError as exc:
            log.warning("cannot start the kernel warm-up process (%s): kernels compile in the daemon's "
                        "warm-up thread instead", exc)
            self.no_subprocess = True
            if plan:
                self.plan_state = "cannot start"
            return None
        with self.lock:
            self.procs = [p for p in self.procs if p.poll() is None] + [proc]
            if plan:
                self.plan_state = "compiling"
        threading.Thread(target=self._read, args=(proc, plan), name="birdnet-warmup-reader", daemon=True).start()
        return proc

    def _read(self, proc: subprocess.Popen, plan: bool) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            with self.lock:
                t = msg.get("t")
                if t == "plan" and plan:
                    self.plan_keys = set(msg.get("keys") or ())
                elif t in ("warmed", "failed"):
                    self.on_disk.add(msg.get("key"))
                    if t == "failed":
                        log.warning("kernel warm-up of %s failed: %s", _label(msg.get("key")), msg.get("error"))
                    elif not msg.get("stamped"):
                        log.info("kernels of %s compiled into the cache (%d of %d, %.1f s, %d compiled)",
                                 _label(msg.get("key")), msg.get("i", 0), msg.get("of", 0), msg.get("seconds", 0.0),
                                 msg.get("compiled", 0))
                elif t == "done" and plan and msg.get("compiled"):
                    log.info("kernel warm-up process done: %d configurations in %.1f s (%d kernels compiled)",
                             len(self.plan_keys), float(msg.get("seconds", 0.0)), msg.get("compiled", 0))
                self._cond.notify_all()
        proc.stdout.close()  # the daemon's descriptors go back to what they were
        rc = proc.wait()
        with self.lock:
            self.procs = [p for p in self.procs if p is not proc]
            if plan:
                self.plan_state = "done" if rc == 0 else f"exited with status {rc}"
            self._cond.notify_all()

    # -- readiness (service thread) -------------------------------------------------------------------
    def ready(self, codec: Any, params: Any) -> bool:
        """Whether a call with this codec may be taken now; if not, its warm-up is asked for."""
        if not isinstance(codec, str) or codec in NO_KERNELS or not isinstance(params, dict):
            return True
        from birdnet.codecs import names
        if codec not in names():
            return True  # handle_submit names the unknown codec
        k = config_key(codec, params)
        with self.lock:
            if k in self.ready_keys or k in self.failed:
                return True
            if k in self.requested:
                return False
            self.requested.add(k)
        self.requests.put(k)
        return False

    def describe(self, codec: str, params: dict[str, Any]) -> str:
        """Where a parked call's warm-up is, for its error message."""
        k = config_key(codec, params)
        with self.lock:
            if self.current == k:
                return "its kernels were being loaded into birdnetd"
            if k not in self.on_disk:
                return "a warm-up process was still compiling them"
            return f"the warm-up thread was busy with {_label(self.current) if self.current else 'nothing'}"

    # -- the warm-up thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopping:
            k = self.requests.get()
            if k is None:
                return
            _install_watch()  # here, not at start: a daemon whose calls are all dense never imports Numba
            codec, params = json.loads(k)
            self._compile_elsewhere(k, codec, params)
            if self.stopping:
                return
            with self.lock:
                self.current = k
            try:
                r = warm(codec, params)
                with self.lock:
                    self.loads += 1
                    self.load_seconds += r["seconds"]
                    self.ready_keys.add(k)
                if r["compiled"]:
                    log.warning("kernels of %s compiled in birdnetd's warm-up thread (%.1f s, %d kernels): the "
                                "on-disk cache did not have them; is NUMBA_CACHE_DIR writable?", _label(k),
                                r["seconds"], r["compiled"])
                else:
                    log.info("kernels of %s loaded in %.2f s", _label(k), r["seconds"])
            except Exception as exc:  # noqa: BLE001 - the call then runs and reports the error itself
                with self.lock:
                    self.failed[k] = exc
                log.info("warm-up of %s failed (%s); its calls go on and report it", _label(k), exc)
            finally:
                with self.lock:
                    self.current = None
            self.wake()

    def _compile_elsewhere(self, k: str, codec: str, params: dict[str, Any]) -> None:
        """Have ``k`` compiled into the cache by a subprocess of its own, unless one did it already,
        and wait for it. It does not wait for the start-up plan: that may be busy with another
        codec for a minute; the per-configuration lock lets the two share the work."""
        with self.lock:
            if k in self.on_disk:
                return
        proc = self._spawn(["--codec", f"{codec}:{json.dumps(params)}"])
        if proc is None:
            return
        with self.lock:
            while not self.stopping and k not in self.on_disk and proc.poll() is None:
                self._cond.wait(0.5)

    # -- status -------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self.lock:
            return {
                "mode": self.mode,
                "process": self.plan_state,
                "process_configurations": len(self.plan_keys),
                "process_done": len(self.on_disk & self.plan_keys),
                "loaded": sorted(_label(k) for k in self.ready_keys),
                "loading": _label(self.current) if self.current else None,
                "waiting": self.requests.qsize(),
                "load_seconds": round(self.load_seconds, 3),
                "ring_thread_compiles": ring_thread_compiles(),
            }

    def status_line(self) -> str:
        """For systemd's STATUS=: "" once nothing is compiling or loading."""
        with self.lock:
            if self.plan_state == "compiling" and self.plan_keys:
                return f"compiling kernels: {len(self.on_disk & self.plan_keys)} of {len(self.plan_keys)}"
            if self.current:
                return f"loading kernels of {_label(self.current)}"
        return ""


if __name__ == "__main__":
    sys.exit(main())
