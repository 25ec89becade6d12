"""The daemon's main loop: client sessions, shared memory, local rounds, signals.

Structure after gunicorn's arbiter: signal handlers only record the signal; the loop dispatches to
``handle_*`` methods, then enforces invariants (reap sessions whose process died, ping the systemd
watchdog). Rounds run on the :class:`~birdnet.daemon.engine.RingWorker` thread, which hands finished
rounds back through a queue and wakes this loop with an inproc message.

It is one thread's state machine: every ``handle_*`` reads and changes the same :class:`Daemon`
(sessions, jobs, slots, doorbells, connections). Apart from it stand the request field table and
``check_request``, the memfd side socket (``_open_fd_socket`` .. ``_forget_tokens``) and the
peer-credential helpers.

Client protocol (frames as in :mod:`birdnet.wire`; the client's DEALER talks to our ROUTER):

==========  ===================================================================================
request     reply
==========  ===================================================================================
``hello``   ``welcome`` {rank, size, local_rank, local_size, node, world, version, door, bell} — or
            ``error`` (``door`` and ``bell``, when the hello asked with ``door: true``: the names of
            the result FIFO and the submit FIFO under /dev/shm; see :mod:`birdnet.door`). A hello
            with ``local_rank`` gets that local rank or an error naming who holds it; without, the
            lowest free one
``alloc``   ``shm`` {slot, name, nbytes}: a segment the daemon created for this session
``submit``  later ``done`` {call, stats} (the result is in the slot) or ``error`` {call, error, message};
            a submit may come through the submit FIFO instead (only submits are taken there), and
            ``done`` goes through the result FIFO once a submit said ``door: true``
``status``  ``status`` {...}
``bye``     ``bye`` {call}: the session has ended, its segments are unlinked
==========  ===================================================================================
"""
from __future__ import annotations

import collections
import dataclasses
import grp
import logging
import math
import os
import queue
import secrets
import signal
import socket
import struct
import time
from collections import deque
from typing import Any, NamedTuple

import numpy as np
import zmq
from birdnet.daemon import notify
from birdnet.daemon.engine import ANONYMOUS_PREFIX, Contribution, LocalRound, RingWorker, RoundRunner, StateStore

from birdnet import PROTOCOL_VERSION, __version__, wire
from birdnet.config import Settings
from birdnet.door import Bell, Door
from birdnet.errors import (
    BirdnetError,
    CodecError,
    InputError,
    ProcessLostError,
    ProtocolError,
    RoundTimeoutError,
    SessionLostError,
    ShutdownError,
    to_wire,
)
from birdnet.hosts import Peer, find_own_rank, load_hosts, unresolved
from birdnet.osutil import pid_alive, release_freed_memory, unix_socket_accepts
from birdnet.shm import Segment, new_name, remove_stale, sealing_available, segment_prefix

log = logging.getLogger("birdnet.daemon")

KINDS = ("allreduce", "broadcast", "barrier", "reset")
OPS = ("mean", "sum")
FLOAT_DTYPES = ("float16", "float32", "float64")
SUM_DTYPES = FLOAT_DTYPES + ("int32", "int64")
MAX_SEGMENT_BYTES = 1 << 34
MAX_SLOTS = 256  #: shared-memory slots per client session
MAX_SESSIONS = 1024  #: client sessions per daemon
MAX_DEPARTED = 1024  #: jobs remembered as broken by a departed process
#: descriptors one session may hold: its connection, its two FIFOs, one memfd until it is mapped,
#: and one spare (a second connection of the same process: birdnet status from a training script)
FDS_PER_SESSION = 5
#: descriptors kept for everything else: peer links (a few per peer), metrics, ZeroMQ's own
RESERVED_FDS = 256
#: A process whose connections were dropped for saying nothing SILENT_STRIKES times within
#: SILENT_STRIKE_WINDOW seconds may hold at most MAX_SILENT_PER_PROCESS connections that have said
#: nothing; beyond that its new ones are dropped at once (a ZeroMQ DEALER reconnects by itself after
#: each drop, so without this such a process kept as many connections as it had sockets)
SILENT_STRIKES = 16
SILENT_STRIKE_WINDOW = 60.0
MAX_SILENT_PER_PROCESS = 16
#: ``warm`` requests load at most this many codec configurations into the daemon (each is a
#: subprocess and a load; a job uses a few)
MAX_WARM_REQUESTS = 64
MAX_SOCKET_PATH = 107  #: bytes of a Unix socket path (sun_path minus its terminating NUL, Linux)
MAX_PENDING_CALLS = 1024  #: a job's calls waiting on this node for some of its processes
MAX_EXPIRED = 4096  #: a job's call numbers remembered as timed out
MAX_PID = 2**22  #: Linux's largest pid_max (a pid above cannot exist; os.kill would overflow a C int)
MAX_SEQ = 2**62  #: call numbers: far beyond any run, well inside the int64 the wire carries
MAX_NAME = 16384  #: characters of a tensor name
MAX_DIMS = 32
#: call numbers below a process's highest one by more than this are refused as already used (the
#: window bounds what a session remembers; calls can arrive out of order only between the socket
#: and the submit FIFO, a few calls at most)
SEQ_WINDOW = 4096


def _int(lo: int, hi: int):
    def check(v: Any) -> str | None:
        if not isinstance(v, int) or isinstance(v, bool):
            return f"is {type(v).__name__}, expected an integer {lo}..{hi}"
        return None if lo <= v <= hi else f"is {v}, outside {lo}..{hi}"
    return check


def _str(lo: int, hi: int):
    def check(v: Any) -> str | None:
        if not isinstance(v, str):
            return f"is {type(v).__name__}, expected a string"
        return None if lo <= len(v) <= hi else f"has {len(v)} characters, expected {lo}..{hi}"
    return check


def _one_of(choices: tuple[str, ...]):
    def check(v: Any) -> str | None:
        return None if isinstance(v, str) and v in choices else f"is {v!r}, expected one of {', '.join(choices)}"
    return check


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else f"is {type(v).__name__}, expected true or false"


def _map(v: Any) -> str | None:
    return None if isinstance(v, dict) else f"is {type(v).__name__}, expected a map"


def _codec(v: Any) -> str | None:
    return None if v is None or (isinstance(v, str) and 0 < len(v) <= 64) else f"is {v!r}, expected a codec name"


def _any_size(name: Any) -> bool:
    """Whether a call that names codec ``name`` gets it under dense_threshold too
    (``Codec.any_size``: fp16, which is dense itself). An unknown name is no error here: a small
    tensor travels dense whatever codec it names, as it always did."""
    if not isinstance(name, str):
        return False
    from birdnet.codecs import codec_class, names  # imported here: the daemon starts without codecs
    if name not in names():
        return False
    try:
        return bool(codec_class(name).any_size)
    except CodecError:  # registered but not loadable: the small tensor travels dense, as before
        return False


def _shape(v: Any) -> str | None:
    if not isinstance(v, list) or len(v) > MAX_DIMS:
        return f"is {type(v).__name__ if not isinstance(v, list) else f'a list of {len(v)}'}, expected a list of at " \
               f"most {MAX_DIMS} non-negative integers"
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v):
        return f"{v!r} is not a list of non-negative integers"
    if math.prod(v) * 8 > MAX_SEGMENT_BYTES:  # Python ints: a huge shape cannot overflow
        return f"{v!r} has {math.prod(v)} elements, more than any shared-memory segment holds"
    return None


_CALL = ("call", _int(-2**63, 2**63 - 1), False)
#: every field of every client request: (key, check, required). Checked once, where bytes become a
#: request (Daemon.dispatch), so handlers trust types and ranges; what needs the daemon's state
#: (a slot that exists, a root within the job) the handlers check.
REQUESTS: dict[str, tuple[tuple[str, Any, bool], ...]] = {
    "hello": (_CALL, ("job", _str(1, 200), True), ("pid", _int(1, MAX_PID), True), ("door", _bool, False),
              ("local_rank", _int(0, 2**31 - 1), False)),
    "alloc": (_CALL, ("slot", _int(0, MAX_SLOTS - 1), True), ("nbytes", _int(0, MAX_SEGMENT_BYTES), True)),
    "submit": (("call", _int(-2**63, 2**63 - 1), True), ("seq", _int(0, MAX_SEQ), True),
               ("kind", _one_of(KINDS), True), ("door", _bool, False),
               ("name", _str(0, MAX_NAME), False), ("shape", _shape, False),
               ("dtype", _one_of(SUM_DTYPES), False), ("slot", _int(0, MAX_SLOTS - 1), False),
               ("op", _one_of(OPS), False), ("codec", _codec, False), ("params", _map, False),
               ("root", _int(0, 2**31 - 1), False)),
    "status": (_CALL,),
    "warm": (_CALL, ("codec", _codec, True), ("params", _map, False)),
    "bye": (_CALL,),
}
#: fields a submit of these kinds must carry
TENSOR_FIELDS = ("name", "shape", "dtype", "slot")


def check_request(header: dict[str, Any]) -> None:
    """Raise :class:`InputError` naming the first field of ``header`` (a client request, its type
    known) that is missing, of the wrong type or out of range."""
    t = header["t"]
    for key, check, required in REQUESTS[t]:
        if key not in header:
            if required or (t == "submit" and key in TENSOR_FIELDS and header.get("kind") in ("allreduce", "broadcast")):
                raise InputError(f"{t}: field {key!r} is missing")
            continue
        why = check(header[key])
        if why is not None:
            raise InputError(f"{t}: field {key!r} {why}")


@dataclasses.dataclass
class Session:
    identity: bytes
    pid: int
    job: str
    local_index: int
    segments: dict[int, Segment] = dataclasses.field(default_factory=dict)
    #: slot -> the call using it. By call, not just slot: a result that went through the doorbell
    #: lets the process use the slot again before this thread has seen that round finish
    inflight: dict[int, int] = dataclasses.field(default_factory=dict)
    #: the result doorbell and the submit FIFO (birdnet.door), when the process asked in its hello
    door: Door | None = None
    bell: Bell | None = None
    last_seq: int = -1  #: the highest call number this process submitted
    #: call numbers this process used within SEQ_WINDOW below last_seq: a number used again is refused
    #: (a round's key twice in the ring worker's order killed the worker)
    used_seqs: set[int] = dataclasses.field(default_factory=set)
    started: float = dataclasses.field(default_factory=time.monotonic)
    uid: int | None = None  #: the process's user, from the kernel (None: not known)
    #: the sealed segment of the last alloc while the daemon still holds its descriptor (at most
    #: one per session: the process opens it before it sends anything else over the socket)
    unmapped: Segment | None = None


class PendingCall(NamedTuple):
    """One process's part of a call that is still collecting the job's other local processes."""

    desc: dict
    contribution: Contribution | None  #: None for a barrier or reset (no data)
    call: int  #: the process's call id, echoed in the reply
    slot: int | None  #: the shared-memory slot the call uses, if any


@dataclasses.dataclass
class Job:
    name: str
    sessions: dict[int, Session] = dataclasses.field(default_factory=dict)  # local_index -> session
    #: call number -> local_index -> that process's part
    pending: dict[int, dict[int, PendingCall]] = dataclasses.field(default_factory=dict)
    #: call number -> when its first process submitted it (round_timeout runs from there)
    pending_since: dict[int, float] = dataclasses.field(default_factory=dict)
    #: call numbers that timed out here waiting for a process -> why; a late submit of one fails at
    #: once (bounded: MAX_EXPIRED, oldest forgotten first)
    expired: dict[int, str] = dataclasses.field(default_factory=dict)


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        if settings.peers:
            self.peers = load_hosts(settings.peers)
            self.rank = settings.rank if settings.rank is not None else find_own_rank(self.peers, settings.peers)
            #: rank -> why its hosts-file name did not resolve at start (log and status say so)
            self.unresolved = {r: why for r, why in unresolved(self.peers).items() if r != self.rank}
            for why in self.unresolved.values():
                log.error("%s: the ring cannot reach it until it does", why)
            if self.rank >= len(self.peers):
                raise_config(f"--rank {self.rank} is outside the {len(self.peers)} entries of {settings.peers}")
        else:
            self.peers = [Peer(0, "127.0.0.1", 0)]
            self.unresolved = {}
            self.rank = 0
        self.world = len(self.peers)
        self.socket_path = settings.socket_path
        self.shm_prefix = segment_prefix(self.socket_path)
        self.gid = grp.getgrnam(settings.shm_group).gr_gid if settings.shm_group else None
        self.ctx = zmq.Context()
        self.sessions: dict[bytes, Session] = {}
        self.bells: dict[int, bytes] = {}  #: submit FIFO descriptor -> its session's identity
        self.poller: zmq.Poller | None = None
        self.jobs: dict[str, Job] = {}
        self.finished: queue.Queue[LocalRound] = queue.Queue()
        self.signals: list[int] = []
        self.states = StateStore(settings.state_limit_bytes)
        self.started = time.time()
        self.bytes_sent_total = 0
        self.stopping = False
        self.net = None
        self.worker: RingWorker | None = None
        self.metrics = None
        from birdnet.daemon.metrics import RoundFigures
        self.figures = RoundFigures()
        self.zap = None  #: the peer port's ZAP handler (CURVE keys and/or peer_allowed_networks)
        self.sealed = sealing_available()  #: hand out sealed memfds (birdnet.shm.Segment.sealed)
        self.max_sessions, self.max_connections = session_limits(self.world)
        self.warned_jobs: set[str] = set()  #: jobs told that unnamed calls run without error feedback
        #: compiles the codecs' kernels off the ring thread (daemon/warmup.py); submits whose codec is
        #: not warm yet wait in ``parked`` (arrival, identity, header, codec, params), in order
        self.warmer: Any = None
        self.parked: collections.deque[tuple[float, bytes, dict[str, Any], Any, Any]] = collections.deque()
        self.fatal: str | None = None  #: a start-up error found after start (a bad default codec): exit 2

    # -- start-up ---------------------------------------------------------------------------------
    def setup(self) -> None:
        removed = remove_stale(self.shm_prefix)
        if removed:
            log.info("removed %d shared-memory segment(s) left by an earlier instance", len(removed))
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise_config(f"socket path {self.socket_path} is {len(os.fsencode(self.socket_path))} bytes; a Unix socket "
                         f"path holds at most {MAX_SOCKET_PATH}: pass a shorter --socket (e.g. under /run or "
                         "$XDG_RUNTIME_DIR)")
        sock_dir = os.path.dirname(self.socket_path) or "."
        if not os.path.isdir(sock_dir):
            try:
                os.makedirs(sock_dir, mode=0o750 if self.gid is not None else 0o700, exist_ok=True)
                if self.gid is not None:
                    os.chown(sock_dir, -1, self.gid)
            except OSError as exc:
                raise_config(f"cannot create the socket directory {sock_dir}: {exc.strerror}; pass --socket PATH "
                             "in a directory this user may write")
        check_socket_dir(sock_dir)
        if os.path.exists(self.socket_path):
            if unix_socket_accepts(self.socket_path):
                raise_config(f"another birdnetd already serves {self.socket_path}; stop it or pass --socket")
            os.unlink(self.socket_path)
        self.clients = self.ctx.socket(zmq.ROUTER)
        self.clients.setsockopt(zmq.LINGER, 0)
        self.clients.setsockopt(zmq.MAXMSGSIZE, wire.MAX_HEADER_BYTES + 1024)
        self.clients.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # Every connection as the kernel sees it (accepted / gone, by descriptor): a process's
        # sessions end when its last connection closes (a FIFO pair each, held for ever before),
        # a connection that says no hello within hello_timeout is dropped, and beyond
        # max_connections new ones are dropped at once. Watched before the bind: a process that
        # connects the moment the socket file appears (a launcher started with the daemon) was
        # accepted unreported, and its hello was taken for one whose connection had closed.
        self.conn_monitor = self.clients.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        old = os.umask(0o117 if self.gid is not None else 0o177)
        try:
            self.clients.bind(f"ipc://{self.socket_path}")
        except zmq.ZMQError as exc:
            raise_config(f"cannot listen on the client socket {self.socket_path}: {exc}; pass --socket PATH in a "
                         "directory this user may write")
        finally:
            os.umask(old)
        self._open_fd_socket()
        #: descriptor -> [peer pid or None, accepted at, has said something (a message came over it)]
        self.connections: dict[int, list[Any]] = {}
        #: pid -> times its connections were dropped for saying nothing (SILENT_STRIKES)
        self.silent_strikes: dict[int, deque[float]] = {}
        #: whether libzmq names the descriptor a message came over (ZMQ_SRCFD, source_fd); without
        #: it a connection counts as speaking once its process has a session
        self.fd_of_messages = False
        self.connections_closed = 0  #: since malloc last handed memory back
        self.connections_dropped = 0  #: by this daemon (idle, or over max_connections)
        self._drop_logged, self._drops_at_log = 0.0, 0
        if self.gid is not None:
            os.chown(self.socket_path, -1, self.gid)
        self.wake_rx = self.ctx.socket(zmq.PULL)
        self.wake_rx.bind(f"inproc://birdnet-wake-{id(self)}")
        self.wake_tx = self.ctx.socket(zmq.PUSH)
        self.wake_tx.connect(f"inproc://birdnet-wake-{id(self)}")
        import threading
        self._wake_lock = threading.Lock()
        self._finish_lock = threading.Lock()
        if self.world > 1:
            from birdnet.daemon.peers import PeerNet
            curve = None
            if self.settings.curve_secret_key:
                from birdnet.daemon.security import Curve
                curve = self.zap = Curve.from_settings(self.settings, self.ctx, self.peers)
            elif self.settings.peer_allowed_networks:
                from birdnet.daemon.security import ZapHandler, read_allowed_networks
                # bound before the peer ROUTER exists: it asks the handler about every connection
                self.zap = ZapHandler(self.ctx, read_allowed_networks(self.settings.peer_allowed_networks,
                                                                         self.peers))
            self.ring_wake_rx = self.ctx.socket(zmq.PULL)
            self.ring_wake_rx.bind(f"inproc://birdnet-ring-wake-{id(self)}")
            self.ring_wake_tx = self.ctx.socket(zmq.PUSH)
            self.ring_wake_tx.connect(f"inproc://birdnet-ring-wake-{id(self)}")
            # the membership (fixed ring, or --elastic) is the net's, shared with the ring worker
            self.net = PeerNet(self.ctx, self.settings, self.peers, self.rank, curve=curve, wake=self.ring_wake_rx)
        self.worker = RingWorker(self.settings, self.rank, self.world, self.net,
                                 RoundRunner(self.settings, self.states), self._round_finished)
        if self.settings.metrics_port is not None:
            from birdnet.daemon.metrics import MetricsServer
            self.metrics = MetricsServer(self, self.settings.metrics_host, self.settings.metrics_port)
            self.metrics.start()
        self._start_warmup()
        self.worker.start()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda s, _f: self.signals.append(s))
        log.info("birdnetd %s: rank %d of %d, clients on %s", __version__, self.rank, self.world, self.socket_path)

    def _start_warmup(self) -> None:
        """Kernels compile in a subprocess and load in a warm-up thread, never on the ring thread
        (daemon/warmup.py); the default codec first. Its parameters are checked there too: importing
        a codec here would compile its kernel module on this thread."""
        from birdnet.daemon.warmup import KernelWarmer

        from birdnet.codecs import names
        if self.settings.codec != "none" and self.settings.codec not in names():
            raise_config(f"default codec {self.settings.codec!r} is unknown; choose one of: {', '.join(names())}")
        self.warmer = KernelWarmer(self.settings.kernel_warmup, wake=self._wake)
        self.warmer.start([(self.settings.codec, self.settings.codec_params)])

    def _check_default_codec(self) -> None:
        """A default codec whose parameters the warm-up refused is a configuration error (exit 2)."""
        from birdnet.daemon.warmup import config_key

        from birdnet.errors import CodecError
        exc = self.warmer.failed.get(config_key(self.settings.codec, self.settings.codec_params))
        if isinstance(exc, CodecError):
            self.fatal = f"default codec {self.settings.codec!r}: {exc}"

    # -- the loop ---------------------------------------------------------------------------------
    def serve_forever(self) -> int:
        self.setup()
        notify.notify("READY=1", f"STATUS={self._status_line()}")
        self.poller = poller = zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.wake_rx, zmq.POLLIN)
        poller.register(self.conn_monitor, zmq.POLLIN)
        if self.fd_listener is not None:
            poller.register(self.fd_listener.fileno(), zmq.POLLIN)
        watchdog = notify.watchdog_interval()
        last_watchdog = last_reap = 0.0
        last_status = ""
        try:
            while True:
                while self.signals:
                    sig = self.signals.pop(0)
                    if sig == signal.SIGHUP:
                        self.handle_hup()
                    else:
                        log.info("signal %s: stopping", signal.Signals(sig).name)
                        notify.notify("STOPPING=1")
                        return self.shutdown()
                events = dict(poller.poll(200))
                if self.clients in events:
                    for _ in range(256):
                        try:
                            frames = self.clients.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self.handle_client(frames)
                if self.conn_monitor in events:
                    self.handle_connections()
                if self.fd_listener is not None:
                    self.handle_fd_requests(events)
                for fd in [e for e in events if isinstance(e, int) and e in self.bells]:
                    self.handle_bell(self.bells[fd])
                if self.wake_rx in events:
                    while True:
                        try:
                            self.wake_rx.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                self.handle_finished()
                if self.parked:
                    self.release_parked()
                now = time.monotonic()
                if now - last_reap > 1.0:
                    last_reap = now
                    if self.warmer is not None and self.settings.codec != "none":
                        self._check_default_codec()
                        if self.fatal:
                            log.error("%s", self.fatal)
                            self.shutdown()
                            return 2
                    try:
                        self.reap_sessions()
                        self.expire_pending()
                        self.drop_idle_connections()
                        if self.connections_closed >= 64:  # a burst of them ended
                            self.connections_closed = 0
                            release_freed_memory()
                    except Exception:  # noqa: BLE001 - a bad session must not stop the loop serving the others
                        log.exception("reaping client sessions failed")
                    line = self._status_line()
                    if line != last_status:
                        notify.notify(f"STATUS={line}")
                        last_status = line
                if watchdog and now - last_watchdog > watchdog:
                    last_watchdog = now
                    if self.worker is not None and self.worker.is_alive():
                        notify.notify("WATCHDOG=1")
                if self.worker is not None and not self.worker.is_alive() and not self.stopping:
                    log.error("ring worker stopped unexpectedly; exiting so the service manager restarts us")
                    self.shutdown()
                    return 1
        finally:
            if not self.stopping:
                self.shutdown()

    def _status_line(self) -> str:
        kernels = self.warmer.status_line() if self.warmer is not None else ""
        kernels = f", {kernels}" if kernels else ""
        if self.net is None:
            return f"rank 0 of 1 (single node), {len(self.sessions)} client(s){kernels}"
        lost = self.net.lost()
        ok = self.world - 1 - len(lost)
        return (f"rank {self.rank} of {self.world}, peers reachable {ok}/{self.world - 1}, "
                f"{len(self.sessions)} client(s){kernels}")

    def handle_hup(self) -> None:
        """Re-read the hosts file. Ring membership cannot change under a running ring, so a changed
        file is reported (restart to apply), an unchanged one is a no-op."""
        notify.notify("RELOADING=1")
        try:
            if self.settings.peers:
                new = load_hosts(self.settings.peers)
                if [p.address for p in new] != [p.address for p in self.peers]:
                    log.warning("hosts file %s changed; restart birdnetd to apply the new ring", self.settings.peers)
                else:
                    log.info("SIGHUP: hosts file unchanged")
        except BirdnetError as exc:
            log.error("SIGHUP: %s", exc)
        notify.notify("READY=1")

    def _wake(self) -> None:
        with self._wake_lock:
            _nudge(self.wake_tx)

    # -- client messages --------------------------------------------------------------------------
    def reply(self, identity: bytes, header: dict[str, Any]) -> None:
        try:
            self.clients.send_multipart([identity, *wire.encode(header)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("reply to a gone client dropped: %s", exc)

    def handle_client(self, frames: list) -> None:
        if len(frames) < 2:
            return
        identity = frames[0].bytes
        try:
            header, _ = wire.decode(frames[1:], max_bytes=wire.MAX_HEADER_BYTES)
        except BirdnetError as exc:
            log.info("client request refused: %s", exc)
            self.reply(identity, {"t": "error", "call": None, **to_wire(exc)})
            return
        s = self.sessions.get(identity)
        if s is not None and s.unmapped is not None:
            # The process sends nothing between an alloc's reply and opening the segment, and the
            # socket keeps order, so by its next message here it has it open: the daemon's
            # descriptor can go. (Not at a message from the submit FIFO: one written before the
            # alloc may be read after it.)
            s.unmapped.release_fd()
            s.unmapped = None
            self._forget_tokens(identity)
        hello = header.get("t") == "hello"
        fd = source_fd(frames[1])
        if fd is not None:
            self.fd_of_messages = True
            if fd not in self.connections:
                self.handle_connections()  # its accept is reported before its first message: take it
            conn = self.connections.get(fd)
            if conn is not None:
                conn[2] = True  # it has said something (drop_idle_connections)
        creds = peer_credentials(frames[1]) if hello else None
        self.dispatch(identity, header, ("hello", "alloc", "submit", "status", "warm", "bye"), creds,
                      fd if hello else None)

    def handle_bell(self, identity: bytes) -> None:
        """Calls a process wrote into its submit FIFO (birdnet.door.Bell); errors go back over the
        socket, as for calls that came that way."""
        s = self.sessions.get(identity)
        if s is None or s.bell is None:
            return
        for header in s.bell.read():  # maps with string keys only (Bell.read counts the rest as garbage)
            self.dispatch(identity, header, ("submit",))
        if s.bell.garbage:
            # Whatever was in the pipe with the garbage is gone with it: say so to the process (its
            # waiting call fails with this error rather than waiting for ever). Others are unaffected.
            s.bell.garbage = 0
            err = ProtocolError(f"undecodable bytes in the submit FIFO of pid {s.pid}: they and the calls read with "
                                "them were dropped; only birdnet.client writes there")
            log.warning("%s", err)
            self.reply(identity, {"t": "error", "call": None, **to_wire(err)})

    def dispatch(self, identity: bytes, header: dict[str, Any], allowed: tuple[str, ...],
                 creds: tuple[int, int, int] | None = None, fd: int | None = None, parked: bool = False) -> None:
        try:
            t = header.get("t")
            handler = getattr(self, f"handle_{t}", None) if t in allowed else None
            if handler is None:
                raise ProtocolError(f"unknown request {t!r}")
            check_request(header)
            if t == "submit" and not parked and self._park(identity, header):
                return
            if t == "hello":
                self.handle_hello(identity, header, creds, fd)
            else:
                handler(identity, header)
        except BirdnetError as exc:
            log.info("client request refused: %s", exc)
            self.reply(identity, {"t": "error", "call": _call_of(header), **to_wire(exc)})
        except Exception as exc:  # noqa: BLE001 - a bad request must never take the daemon down
            log.exception("client request failed inside the daemon")
            err = InputError(f"request failed inside birdnetd: {exc!r}")
            self.reply(identity, {"t": "error", "call": _call_of(header), **to_wire(err)})

    def _codec_of(self, h: dict[str, Any]) -> tuple[Any, Any]:
        """The codec and parameters a submit asks for (as handle_submit reads them)."""
        if h.get("kind") != "allreduce":
            return "none", {}
        if h.get("codec"):
            return h.get("codec"), h.get("params") or {}
        return self.settings.codec, self.settings.codec_params

    def _park(self, identity: bytes, h: dict[str, Any]) -> bool:
        """Keep a submit back while its codec's kernels are not in this process yet (and every
        submit after it, so calls are taken in the order they came). A round then never reaches
        the ring thread before its kernels: compiling there stopped the heartbeats."""
        if self.warmer is None:
            return False
        codec, params = self._codec_of(h)
        if self.warmer.ready(codec, params) and not self.parked:
            return False
        if not self.parked:
            log.info("calls wait for the kernels of codec %s to be compiled and loaded", codec)
        self.parked.append((time.monotonic(), identity, h, codec, params))
        return True

    def release_parked(self) -> None:
        """Take the parked submits whose kernels are ready, in order; fail those parked longer than
        warmup_timeout."""
        now = time.monotonic()
        while self.parked:
            since, identity, h, codec, params = self.parked[0]
            if self.warmer.ready(codec, params):
                self.parked.popleft()
                self.dispatch(identity, h, ("submit",), parked=True)
            elif now - since > self.settings.warmup_timeout:
                self.parked.popleft()
                err = RoundTimeoutError(
                    f"call {h.get('seq')} of pid {getattr(self.sessions.get(identity), 'pid', '?')}: the kernels of codec "
                    f"{codec!r} were not compiled within warmup_timeout={self.settings.warmup_timeout} s "
                    f"({self.warmer.describe(codec, params)}); on a slow board raise warmup_timeout, or warm the "
                    "cache before starting training (`birdnet warmup`)")
                log.warning("%s", err)
                self.reply(identity, {"t": "error", "call": _call_of(h), **to_wire(err)})
            else:
                break

    def handle_hello(self, identity: bytes, h: dict[str, Any], creds: tuple[int, int, int] | None = None,
                     fd: int | None = None) -> None:
        """``creds``: the kernel's (uid, gid, pid) of the connection; ``fd``: the daemon's descriptor
        of the connection the hello came through (None where libzmq does not say)."""
        if h.get("proto") != PROTOCOL_VERSION:
            from birdnet.errors import VersionMismatchError
            raise VersionMismatchError(f"client speaks protocol {h.get('proto')!r}, birdnetd {__version__} speaks "
                                       f"{PROTOCOL_VERSION}; install the same birdnet version for both")
        job = wire.field(h, "job", str, "hello")
        pid = wire.field(h, "pid", int, "hello")
        if not job or len(job) > 200:
            raise InputError("job name must be 1..200 characters")
        # Connections accepted before this hello was read are in the monitor's queue by now (an
        # accept is reported before the connection can carry a message): take them first, so a
        # disconnect of this process's previous connection cannot end the session made here.
        drained = self.handle_connections()
        if pid > MAX_PID:  # check_request bounds it; os.kill and the reaper need a C int
            raise InputError(f"hello: field 'pid' is {pid}, outside 1..{MAX_PID}")
        uid = None
        if creds is not None:
            # The kernel's word (SO_PEERCRED of the connection) replaces the hello's: a process
            # can then neither end another process's session ("reconnected" below) nor have the
            # reaper watch a pid that is not its own. They differ legitimately only for a
            # process in another pid namespace (a container), whose own pid means nothing here.
            uid, _gid, kernel_pid = creds
            if kernel_pid != pid:
                log.info("hello of job %r says pid %d, the kernel says pid %d (uid %d): taking the kernel's",
                         job, pid, kernel_pid, uid)
            pid = kernel_pid
        conn = self.connections.get(fd) if fd is not None else None
        if drained and fd is not None and (conn is None or conn[0] not in (None, pid)):
            # the connection closed before its hello was read (the process gave up waiting,
            # connect_timeout): a session now could never hear from it again, and the disconnect
            # that would have ended it has been taken already (a number reused since: another's)
            log.info("hello of pid %d for job %r came after its connection closed: no session", pid, job)
            return
        if identity in self.sessions:
            self.end_session(identity, "re-hello")
        same = [x for x in self.sessions.values() if x.job == job and x.pid == pid]
        for other in same:
            # the same process on a new connection (its old one was dropped): it takes its place
            self.end_session(other.identity, "reconnected")
        if len(self.sessions) >= self.max_sessions:
            raise InputError(f"birdnetd already serves {self.max_sessions} client sessions (its limit, from "
                             f"{self.max_sessions} x {FDS_PER_SESSION} file descriptors within LimitNOFILE)")
        full = self.jobs.get(job)
        if full is not None and len(full.sessions) >= self.settings.local_size:
            # a process of the job that exited without a bye (killed, and restarted at once by its
            # launcher) may not be reaped yet: look now rather than refuse its successor
            for other in list(full.sessions.values()):
                if not pid_alive(other.pid):
                    self.end_session(other.identity, "process exited")
        j = self.jobs.setdefault(job, Job(job))
        if not j.sessions and not same and self.worker is not None:
            # a new incarnation of the job on this node may number its rounds from 0 again: the
            # ring worker forgets the job's aborted rounds (RingWorker.aborted)
            self.worker.restarted_jobs.append(job)
        ls = self.settings.local_size
        want = h.get("local_rank")  # a launcher's LOCAL_RANK (Client(local_rank=)); else the next free one
        if want is not None:
            if want >= ls:
                raise InputError(f"job {job!r} asked for local rank {want}, but birdnetd runs with --local-size {ls} "
                                 f"(local ranks 0..{ls - 1}); launch {ls} process(es) per node, or start birdnetd "
                                 f"with --local-size {want + 1} or more on every node")
            holder = j.sessions.get(want)
            if holder is not None and not pid_alive(holder.pid):
                self.end_session(holder.identity, "process exited")
                holder = None
            if holder is not None:
                raise InputError(f"job {job!r}: local rank {want} on this node is taken by pid {holder.pid}; give "
                                 f"each of the node's processes its own local rank (0..{ls - 1}), or use another "
                                 "job name")
            idx = want
        else:
            free = [i for i in range(ls) if i not in j.sessions]
            if not free:
                raise InputError(f"job {job!r} already has {ls} process(es) on this node "
                                 f"(pids {sorted(s.pid for s in j.sessions.values())}); start birdnetd with "
                                 "--local-size N for N training processes per node, or use another job name")
            idx = free[0]
        if self.worker is not None:
            self.worker.departed.pop(job, None)  # the job is whole again on this node
            self.worker.departed_elsewhere.pop(job, None)  # a new run (the whole job restarted)
        s = Session(identity, pid, job, idx, uid=uid)
        if h.get("door") is True:
            mode = 0o660 if self.gid is not None else 0o600
            try:
                s.door = Door(new_name(self.shm_prefix), mode=mode, gid=self.gid)
                s.bell = Bell(new_name(self.shm_prefix), mode=mode, gid=self.gid)
            except OSError as exc:  # the socket still works: calls and results go that way
                log.warning("no doorbells for pid %d: %s", pid, exc)
                for d in (s.door, s.bell):
                    if d is not None:
                        d.close()
                s.door = s.bell = None
        self.sessions[identity] = s
        j.sessions[idx] = s
        log.info("client pid %d joined job %r as local rank %d", pid, job, idx)
        welcome = {"t": "welcome", "rank": self.rank * ls + idx, "size": self.world * ls, "local_rank": idx,
                   "local_size": ls, "node": self.rank, "world": self.world, "version": __version__}
        if s.door is not None and s.bell is not None:
            welcome["door"], welcome["bell"] = s.door.name, s.bell.name
            if self.poller is not None and s.bell.fd is not None:
                self.poller.register(s.bell.fd, zmq.POLLIN)
                self.bells[s.bell.fd] = identity
        self.reply(identity, welcome)

    def _session(self, identity: bytes) -> Session:
        s = self.sessions.get(identity)
        if s is None:
            raise SessionLostError("no session: send hello first (the daemon may have restarted)")
        return s

    def handle_alloc(self, identity: bytes, h: dict[str, Any]) -> None:
        s = self._session(identity)
        slot = wire.field(h, "slot", int, "alloc")
        nbytes = wire.field(h, "nbytes", int, "alloc")
        if not 0 <= slot < MAX_SLOTS:
            raise InputError(f"slot {slot} is outside 0..{MAX_SLOTS - 1}")
        if not 0 <= nbytes <= min(MAX_SEGMENT_BYTES, self.settings.max_message_bytes * 4):
            raise InputError(f"alloc: field 'nbytes' is {nbytes}, outside 0.."
                             f"{min(MAX_SEGMENT_BYTES, self.settings.max_message_bytes * 4)} (4 x max_message_bytes)")
        self.handle_finished()  # a result that went through the doorbell frees its slot here first
        if slot in s.inflight:
            raise InputError(f"slot {slot} is in use by a call in flight")
        old = s.segments.pop(slot, None)
        if old is not None:
            old.unlink()
            old.close()
        token = None
        if self.sealed and s.uid is not None and s.uid in (os.getuid(), 0):
            # a memfd the process cannot shrink, grow or unlink (birdnet.shm.Segment.sealed); it
            # opens it through /proc, which the kernel allows its own user and root
            seg = Segment.sealed(nbytes)
            s.unmapped = seg
        elif self.sealed and s.uid is not None and self.fd_listener is not None:
            # a process of another user (--shm-group): /proc/<our pid>/fd is closed to it, so it
            # fetches the memfd through the side socket (SCM_RIGHTS), with a one-time token
            seg = Segment.sealed(nbytes)
            s.unmapped = seg
            token = secrets.token_hex(16)
            self.fd_tokens[token] = (identity, seg)
        else:  # no sealing, no peer credentials: a named file
            seg = Segment(new_name(self.shm_prefix), nbytes, create=True,
                          mode=0o660 if self.gid is not None else 0o600, gid=self.gid)
        s.segments[slot] = seg
        reply = {"t": "shm", "call": h.get("call"), "slot": slot, "name": seg.name, "nbytes": nbytes}
        if token is not None:
            reply["fdsock"], reply["token"], reply["inode"] = self.fd_socket_path, token, seg.inode
        elif seg.fd is not None:
            reply["path"], reply["inode"] = seg.path, seg.inode
        self.reply(identity, reply)

    def handle_submit(self, identity: bytes, h: dict[str, Any]) -> None:
        s = self._session(identity)
        call, seq, kind = h["call"], h["seq"], h["kind"]  # types and ranges: check_request
        if seq in s.used_seqs or seq < s.last_seq - SEQ_WINDOW:
            raise InputError(f"call {seq} was already submitted by this process (pid {s.pid}); call numbers are "
                             "used once (only birdnet.client numbers calls)")
        gone = None
        if self.worker is not None:
            gone = self.worker.departed.get(s.job)
            elsewhere = self.worker.departed_elsewhere.get(s.job)
            if elsewhere is not None and (gone is None or elsewhere[1] < gone[1]):
                gone = elsewhere
        if gone is not None and seq >= gone[1]:
            raise ProcessLostError(f"job {s.job!r} cannot run call {seq} on node rank {self.rank}: {gone[0]}")
        root = h.get("root", 0)
        if not root < self.world * self.settings.local_size:
            raise InputError(f"submit: field 'root' is {root}, not a rank of this job "
                             f"(0..{self.world * self.settings.local_size - 1})")
        desc: dict[str, Any] = {"kind": kind, "name": None, "shape": [], "dtype": None, "op": None,
                                "codec": None, "root": None}
        array = None
        if kind in ("allreduce", "broadcast"):
            name = wire.field(h, "name", str, "submit")
            shape = wire.field(h, "shape", list, "submit")
            dtype = wire.field(h, "dtype", str, "submit")
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape) or len(shape) > 32:
                raise InputError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
            op = h.get("op", "mean") if kind == "allreduce" else "sum"
            if op not in OPS:
                raise InputError(f"tensor {name!r}: op {op!r} is not supported; use 'mean' or 'sum'")
            allowed = FLOAT_DTYPES if op == "mean" else SUM_DTYPES
            if dtype not in allowed:
                raise InputError(f"tensor {name!r}: dtype {dtype} cannot be reduced with op={op!r}; "
                                 f"convert to one of {', '.join(allowed)}")
            n = math.prod(shape)  # Python ints: a huge shape cannot overflow into a small size
            dt = np.dtype(dtype)
            slot = wire.field(h, "slot", int, "submit")
            seg = s.segments.get(slot)
            if seg is None or seg.size < n * dt.itemsize:
                raise InputError(f"tensor {name!r}: slot {slot} is missing or too small for {n} x {dtype}")
            array = np.frombuffer(seg.buf, dtype=dt, count=n).reshape(shape)
            desc.update(name=name, shape=shape, dtype=dtype, op=op)
            codec_name = h.get("codec") or self.settings.codec
            params = h.get("params") if h.get("codec") else self.settings.codec_params
            if not isinstance(codec_name, str) or not isinstance(params, dict):
                raise InputError("codec must be a name and its parameters a map")
            small = n < self.settings.dense_threshold and not _any_size(h.get("codec"))
            if kind == "broadcast" or small or dt.kind != "f":
                desc["codec"] = {"codec": "none"}
            else:
                from birdnet.codecs import get_codec
                codec = get_codec(codec_name, **params)  # CodecError names the problem
                desc["codec"] = codec.describe()
                if name.startswith(ANONYMOUS_PREFIX) and h.get("codec") and codec.new_state(1) is not None:
                    # An unnamed call cannot say which tensor it is, so its state could never be
                    # used again: refuse rather than drop error feedback silently (or leak it).
                    raise InputError(
                        f"call {seq}: codec {codec_name!r} keeps error-feedback state per tensor, and a call without "
                        f"name= has no tensor to keep it for (each call would start from nothing and lose what "
                        f"the compression dropped); pass the same name for the same tensor every step, e.g. "
                        f"client.allreduce(grad, name='layer1.weight', codec={codec_name!r}, ...)")
            if kind == "broadcast":
                desc["root"] = root
            if slot in s.inflight:
                self.handle_finished()  # a result that went through the doorbell frees its slot here first
            if slot in s.inflight:
                # two rounds writing one segment would give both a wrong result, silently
                raise InputError(f"tensor {name!r}: slot {slot} is in use by call {s.inflight[slot]}, still in flight")
        j = self.jobs[s.job]
        if seq in j.expired:
            raise RoundTimeoutError(j.expired[seq])
        if seq not in j.pending and len(j.pending) >= MAX_PENDING_CALLS:
            # a process far ahead of its siblings (or numbering calls they never use) must not
            # grow the daemon without bound
            raise InputError(f"job {s.job!r} has {len(j.pending)} calls on node rank {self.rank} waiting for some of its "
                             f"{self.settings.local_size} local processes; call {seq} of pid {s.pid} cannot wait too "
                             "(do all processes of the job make the same calls?)")
        # Everything is checked: from here on the submit is taken, and the session records it.
        if h.get("door") is True and s.door is not None and not s.door.armed:
            s.door.armed = True  # the process has its ends open: results may go this way now
            s.door.unlink()
            if s.bell is not None:
                s.bell.unlink()
        s.used_seqs.add(seq)
        if seq > s.last_seq:
            s.last_seq = seq
            if len(s.used_seqs) > SEQ_WINDOW:
                s.used_seqs = {q for q in s.used_seqs if q >= seq - SEQ_WINDOW}
        if array is not None:
            s.inflight[slot] = call
        if seq not in j.pending:
            j.pending_since[seq] = time.monotonic()
        pend = j.pending.setdefault(seq, {})
        contribution = None
        if array is not None:
            contribution = Contribution(identity, call, array, s.local_index,
                                        self.rank * self.settings.local_size + s.local_index)
        pend[s.local_index] = PendingCall(desc, contribution, call, slot if array is not None else None)
        if len(pend) == self.settings.local_size:
            self._launch(j, seq)

    def expire_pending(self) -> None:
        """Calls some local processes of a job submitted and a sibling did not within round_timeout
        fail for those that did (a sibling that never submits hung them for ever). The round goes to
        the ring worker with the error, so the other nodes fail it too (as a mismatch) instead of
        waiting; the sibling's late submit of it fails at once (Job.expired)."""
        limit = time.monotonic() - self.settings.round_timeout
        for j in list(self.jobs.values()):
            expired = 0
            for seq in [q for q, t in j.pending_since.items() if t < limit]:
                if seq not in j.pending:
                    del j.pending_since[seq]
                    continue
                have = sorted(j.pending[seq])
                missing = [i for i in range(self.settings.local_size) if i not in have]
                pids = [j.sessions[i].pid for i in missing if i in j.sessions]
                why = (f"call {seq} of job {j.name!r} timed out on node rank {self.rank}: local rank(s) "
                       f"{', '.join(map(str, missing))}" + (f" (pid {', '.join(map(str, pids))})" if pids else "")
                       + f" did not submit it within round_timeout={self.settings.round_timeout} s, local rank(s) "
                       f"{', '.join(map(str, have))} did; do all processes of the job make the same calls?")
                expired += 1
                if expired == 1:
                    log.warning("%s", why)  # one line per job and second, however many calls
                j.expired[seq] = why
                while len(j.expired) > MAX_EXPIRED:
                    j.expired.pop(next(iter(j.expired)))
                self._launch(j, seq, RoundTimeoutError(why))
            if expired > 1:
                log.warning("job %r: %d more calls timed out the same way on node rank %d", j.name, expired - 1,
                            self.rank)

    def _launch(self, j: Job, seq: int, error: BirdnetError | None = None) -> None:
        j.pending_since.pop(seq, None)
        pend = j.pending.pop(seq)
        entries = [pend[i] for i in sorted(pend)]
        desc0 = entries[0][0]
        rnd = LocalRound(job=j.name, seq=seq, kind=desc0["kind"], desc=desc0,
                         parts=[e[1] for e in entries if e[1] is not None])
        rnd.callers = [(j.sessions.get(i), pend[i][2], pend[i][3]) for i in sorted(pend)]
        codec = desc0.get("codec")
        if (isinstance(desc0.get("name"), str) and desc0["name"].startswith(ANONYMOUS_PREFIX)
                and isinstance(codec, dict) and codec.get("codec") not in (None, "none")):
            self._warn_anonymous(j.name, rnd, codec)
        for i, (d, _c, _call, _slot) in zip(sorted(pend), entries):
            diffs = [f"{k}: {desc0.get(k)!r} (local rank {sorted(pend)[0]}) vs {d.get(k)!r} (local rank {i})"
                     for k in desc0 if d.get(k) != desc0.get(k)]
            if diffs:
                rnd.error = InputError(f"call {seq} of job {j.name!r} does not match between processes on node "
                                       f"rank {self.rank}: " + "; ".join(diffs))
                break
        if error is not None:
            rnd.error = error
        if rnd.error is None and self.settings.nan_policy == "reject" and rnd.kind == "allreduce":
            for p in rnd.parts:
                if p.array.dtype.kind == "f" and not np.isfinite(p.array).all():
                    rnd.error = InputError(f"tensor {desc0['name']!r} from local rank {p.local_index} on node rank "
                                           f"{self.rank} contains NaN or Inf (nan_policy='reject')")
                    break
        assert self.worker is not None
        self.worker.submit(rnd)
        if self.net is not None:
            # after the round went to the worker nothing may fail this call: an error reply now
            # would free a slot the round still writes (zmq.Again once 1000 wake-ups are queued)
            _nudge(self.ring_wake_tx)

    def _warn_anonymous(self, job: str, rnd: LocalRound, desc: dict[str, Any]) -> None:
        """A call without name= under the daemon's default codec (an explicit stateful codec is
        refused in handle_submit): if that codec keeps state, the round runs with state for this
        round only (StateStore.get), and the process is told so with its result (the client warns
        once); the log says it once per job."""
        from birdnet.codecs import get_codec
        try:
            stateful = get_codec(desc["codec"], **{k: v for k, v in desc.items() if k != "codec"}).new_state(1) is not None
        except BirdnetError:
            return
        if not stateful:
            return
        msg = (f"calls without name= run the cluster's default codec {desc['codec']!r} without error feedback (its "
               "state needs a tensor name that stays the same from step to step); pass name= to keep it")
        rnd.stats["warning"] = msg
        if job not in self.warned_jobs:
            if len(self.warned_jobs) >= MAX_DEPARTED:
                self.warned_jobs.clear()
            self.warned_jobs.add(job)
            log.warning("job %r: %s", job, msg)

    def _round_finished(self, rnd: LocalRound) -> None:
        """Called on the ring worker thread: a result goes straight to the processes that have a
        doorbell (one thread wake instead of four); this thread does the rest."""
        with self._finish_lock:
            # Queued under the lock that handle_finished takes: whatever a process sends after it
            # had its result finds the round finished here (its slot free), not still in flight.
            if rnd.error is None:
                stats = None
                for session, call, _slot in rnd.callers:
                    if session is not None and session.door is not None and session.door.armed:
                        stats = stats or _plain(rnd.stats)
                        if session.door.send({"t": "done", "call": call, "stats": stats}):
                            rnd.delivered.add(call)
            self.finished.put(rnd)
        self._wake()

    def handle_finished(self) -> None:
        with self._finish_lock:
            rounds = []
            while True:
                try:
                    rounds.append(self.finished.get_nowait())
                except queue.Empty:
                    break
        for rnd in rounds:
            self.bytes_sent_total += int(rnd.stats.get("bytes_sent", 0) or 0)
            self.figures.observe(rnd)
            for session, call, slot in rnd.callers:
                if session is None or self.sessions.get(session.identity) is not session:
                    continue  # the process is gone
                if slot is not None and session.inflight.get(slot) == call:
                    del session.inflight[slot]
                if call in rnd.delivered:
                    continue
                if rnd.error is not None:
                    self.reply(session.identity, {"t": "error", "call": call, **to_wire(rnd.error)})
                else:
                    self.reply(session.identity, {"t": "done", "call": call, "stats": _plain(rnd.stats)})

    def handle_status(self, identity: bytes, h: dict[str, Any]) -> None:
        self.reply(identity, {"t": "status", "call": h.get("call"), "status": self.status()})

    def handle_warm(self, identity: bytes, h: dict[str, Any]) -> None:
        """A process names a codec it is about to use (the PyTorch adapter, for the codec it
        switches to after its dense warm-up): its kernels are loaded now, in the warm-up thread,
        so the first call with it does not wait the second or so that loading takes. The reply says
        whether they are loaded already; calls with the codec park until they are either way."""
        from birdnet.codecs import names
        self._session(identity)
        codec, params = h["codec"], h.get("params") or {}
        if codec not in names():
            raise InputError(f"warm: unknown codec {codec!r}; choose one of: {', '.join(names())}")
        if self.warmer is not None and len(self.warmer.requested) >= MAX_WARM_REQUESTS:
            # each new configuration costs a subprocess and a load: a process naming endless
            # parameter sets must not keep the daemon compiling (its calls still warm what they use)
            raise InputError(f"warm: {MAX_WARM_REQUESTS} codec configurations were asked for already; "
                             "calls load the kernels they need by themselves")
        ready = self.warmer is None or self.warmer.ready(codec, params)
        self.reply(identity, {"t": "warm", "call": h.get("call"), "ready": bool(ready)})

    def handle_bye(self, identity: bytes, h: dict[str, Any]) -> None:
        self.handle_bell(identity)  # calls written before the bye come first
        self.end_session(identity, "bye")
        self.reply(identity, {"t": "bye", "call": h.get("call")})

    # -- the memfd side socket ----------------------------------------------------------------------
    def _open_fd_socket(self) -> None:
        """A Unix seqpacket socket beside the client socket (same mode and group) through which a
        process of another user fetches its sealed segments (SCM_RIGHTS; the client socket is
        ZeroMQ and cannot pass descriptors). Without it such processes get named files."""
        self.fd_listener: socket.socket | None = None
        self.fd_tokens: dict[str, tuple[bytes, Segment]] = {}  #: one-time token -> (session, segment)
        self.fd_pending: dict[int, tuple[socket.socket, float]] = {}  #: accepted, token not read yet
        self.fd_socket_path = self.socket_path + ".shm"
        if not self.sealed or len(os.fsencode(self.fd_socket_path)) > MAX_SOCKET_PATH:
            return
        try:
            if os.path.exists(self.fd_socket_path):
                os.unlink(self.fd_socket_path)
            lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            old = os.umask(0o117 if self.gid is not None else 0o177)
            try:
                lst.bind(self.fd_socket_path)
            finally:
                os.umask(old)
            if self.gid is not None:
                os.chown(self.fd_socket_path, -1, self.gid)
            lst.listen(64)
            lst.setblocking(False)
            self.fd_listener = lst
        except OSError as exc:
            log.warning("no memfd side socket at %s (%s): processes of other users get named segments",
                        self.fd_socket_path, exc)

    def handle_fd_requests(self, events: dict) -> None:
        lst = self.fd_listener
        if lst.fileno() in events:
            for _ in range(64):
                try:
                    conn, _addr = lst.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break
                if len(self.fd_pending) >= 256:  # a flood: the oldest waiting one goes
                    self._close_fd_conn(next(iter(self.fd_pending)))
                conn.setblocking(False)
                self.fd_pending[conn.fileno()] = (conn, time.monotonic() + 2.0)
                self.poller.register(conn.fileno(), zmq.POLLIN)
        now = time.monotonic()
        for fd in list(self.fd_pending):
            conn, deadline = self.fd_pending[fd]
            if fd in events:
                try:
                    token = conn.recv(64).decode("ascii", "replace")
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    token = ""
                self._send_memfd(conn, token)
                self._close_fd_conn(fd)
            elif now > deadline:
                self._close_fd_conn(fd)

    def _send_memfd(self, conn: socket.socket, token: str) -> None:
        entry = self.fd_tokens.pop(token, None)
        if entry is None:
            return
        identity, seg = entry
        s = self.sessions.get(identity)
        pid = _peer_pid(conn.fileno())
        if s is None or seg.fd is None or pid != s.pid:  # only to the session's own process
            log.info("memfd request refused: token of pid %s presented by pid %s", s.pid if s else None, pid)
            return
        try:
            socket.send_fds(conn, [b"ok"], [seg.fd])
        except OSError as exc:
            log.info("memfd for pid %d not sent: %s", s.pid, exc)
            return
        seg.release_fd()  # the process has its own descriptor now
        if s.unmapped is seg:
            s.unmapped = None

    def _close_fd_conn(self, fd: int) -> None:
        conn, _ = self.fd_pending.pop(fd)
        try:
            self.poller.unregister(fd)
        except KeyError:
            pass
        conn.close()

    def _forget_tokens(self, identity: bytes) -> None:
        for t in [t for t, (i, _seg) in self.fd_tokens.items() if i == identity]:
            del self.fd_tokens[t]

    # -- connections ------------------------------------------------------------------------------
    def handle_connections(self) -> bool:
        """Take the client socket's accepts and disconnects (4096 at most); True when none is left."""
        from zmq.utils.monitor import recv_monitor_message
        for _ in range(4096):
            try:
                ev = recv_monitor_message(self.conn_monitor, zmq.NOBLOCK)
            except zmq.Again:
                return True
            fd = ev.get("value")
            if not isinstance(fd, int):
                continue
            if ev["event"] == zmq.EVENT_ACCEPTED:
                pid = _peer_pid(fd)
                self.connections[fd] = [pid, time.monotonic(), False]
                if len(self.connections) > self.max_connections:
                    self._drop_connection(fd, f"over the limit of {self.max_connections} connections")
                elif pid is not None and self._silent_process(pid):
                    self._drop_connection(fd, f"its process holds {MAX_SILENT_PER_PROCESS} connections that said "
                                              f"nothing, and {SILENT_STRIKES} or more of its connections were dropped "
                                              f"for saying nothing in the last {SILENT_STRIKE_WINDOW:.0f} s")
                    self._strike(pid)
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                self.connections_closed += 1
                gone = self.connections.pop(fd, None)
                pid = gone[0] if gone is not None else None
                if pid is not None and not any(c[0] == pid for c in self.connections.values()):
                    # the process has no connection left: its sessions cannot hear anything again
                    for identity, s in list(self.sessions.items()):
                        if s.pid == pid:
                            self.end_session(identity, "connection closed")
        return False

    def drop_idle_connections(self) -> None:
        """Connections that said nothing within hello_timeout (a real client says hello at once) are
        dropped: each holds a descriptor. Where libzmq does not say which connection a message came
        over, only those of processes without a session (a process with one was exempt, and its
        silent connections stayed)."""
        now = time.monotonic()
        limit = now - self.settings.hello_timeout
        pids = {s.pid for s in self.sessions.values()}
        for fd, (pid, since, spoke) in list(self.connections.items()):
            if pid is None or since >= limit:  # (None: the kernel did not say; _drop_connection needs it)
                continue
            if (not spoke) if self.fd_of_messages else pid not in pids:
                self._drop_connection(fd, f"no hello within {self.settings.hello_timeout} s")
                self.connections[fd][1] = now  # once; the disconnect removes it
                self._strike(pid)
        for pid in [p for p, times in self.silent_strikes.items() if not times or times[-1] < now - SILENT_STRIKE_WINDOW]:
            del self.silent_strikes[pid]

    def _strike(self, pid: int) -> None:
        times = self.silent_strikes.get(pid)
        if times is None:
            if len(self.silent_strikes) >= MAX_SESSIONS:  # bounded: forget the oldest process
                self.silent_strikes.pop(next(iter(self.silent_strikes)))
            times = self.silent_strikes[pid] = deque(maxlen=SILENT_STRIKES)
        times.append(time.monotonic())

    def _silent_process(self, pid: int) -> bool:
        """Whether process ``pid`` has had SILENT_STRIKES connections dropped for silence within
        SILENT_STRIKE_WINDOW and holds MAX_SILENT_PER_PROCESS silent ones besides its newest."""
        times = self.silent_strikes.get(pid)
        if times is None or len(times) < SILENT_STRIKES or times[0] < time.monotonic() - SILENT_STRIKE_WINDOW:
            return False
        silent = sum(1 for c in self.connections.values() if c[0] == pid and not c[2])
        return silent > MAX_SILENT_PER_PROCESS

    def _drop_connection(self, fd: int, why: str) -> None:
        """Shut a client connection down under ZeroMQ (which then closes it, as when the process
        goes). Only if descriptor ``fd`` is still that connection: a Unix socket of our path
        whose peer is the process recorded at accept (a descriptor number can be reused)."""
        c = self.connections.get(fd)
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return
        try:
            if (sock.family == socket.AF_UNIX and sock.getsockname() == self.socket_path
                    and c is not None and _peer_pid(sock.fileno()) == c[0]):
                sock.shutdown(socket.SHUT_RDWR)
                self.connections_dropped += 1
                now = time.monotonic()
                if now - self._drop_logged > 1.0:  # a flood of them is one line a second
                    log.warning("dropped %d client connection(s), the last of pid %s: %s",
                                self.connections_dropped - self._drops_at_log, c[0], why)
                    self._drop_logged, self._drops_at_log = now, self.connections_dropped
        except OSError:
            pass
        finally:
            sock.close()

    # -- sessions ---------------------------------------------------------------------------------
    def end_session(self, identity: bytes, why: str) -> None:
        s = self.sessions.pop(identity, None)
        if s is None:
            return
        j = self.jobs.get(s.job)
        if j is not None and why != "daemon shutting down" and self.worker is not None and s.last_seq >= 0:
            # The job's later rounds cannot complete on this node: say so to every node at once
            # instead of letting them wait for round_timeout.
            if len(self.worker.departed) >= MAX_DEPARTED:
                self.worker.departed.pop(next(iter(self.worker.departed)))
            self.worker.departed[s.job] = (f"process pid {s.pid} (local rank {s.local_index}) of job {s.job!r} "
                                           f"on node rank {self.rank} left ({why}) after call {s.last_seq}; "
                                           "restart the job's processes", s.last_seq + 1)
            if why in ("process exited", "connection closed"):
                self.worker.lost_processes.append((s.job, s.last_seq + 1))
        if j is not None:
            j.sessions.pop(s.local_index, None)
            # Rounds still collecting on this node can never complete: fail them for the others.
            for seq in list(j.pending):
                pend = j.pending[seq]
                pend.pop(s.local_index, None)
                err = InputError(f"process pid {s.pid} (local rank {s.local_index}) of job {s.job!r} left "
                                 f"({why}) before call {seq} completed")
                for idx, (_d, _c, call, slot) in list(pend.items()):
                    other = j.sessions.get(idx)
                    if other is not None:
                        other.inflight.pop(slot, None)
                        self.reply(other.identity, {"t": "error", "call": call, **to_wire(err)})
                del j.pending[seq]
                j.pending_since.pop(seq, None)
            if not j.sessions:
                del self.jobs[s.job]
        if hasattr(self, "fd_tokens"):
            self._forget_tokens(identity)
        for seg in s.segments.values():
            seg.unlink()
            seg.close()
        if s.door is not None:
            s.door.close()
        if s.bell is not None:
            if self.bells.pop(s.bell.fd, None) is not None and self.poller is not None:
                self.poller.unregister(s.bell.fd)  # registered together with its entry in bells
            s.bell.close()
        log.info("client pid %d left job %r (%s)", s.pid, s.job, why)

    def reap_sessions(self) -> None:
        for identity, s in list(self.sessions.items()):
            if not pid_alive(s.pid):
                self.end_session(identity, "process exited")

    # -- status -----------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        w = self.worker
        peers = self.net.peer_states() if self.net is not None else [{"rank": 0, "address": "(single node)", "state": "self"}]
        for row in peers:
            why = getattr(self, "unresolved", {}).get(row["rank"])
            if why and row["state"] not in ("ok", "connected") and "reason" not in row:
                row["reason"] = why
        return {
            "version": __version__, "rank": self.rank, "world": self.world, "local_size": self.settings.local_size,
            "socket": self.socket_path, "cluster": self.settings.cluster, "codec": self.settings.codec,
            "peers": peers,
            "jobs": {name: {"processes": [{"local_rank": i, "pid": s.pid, "last_call": s.last_seq}
                                          for i, s in sorted(j.sessions.items())]}
                     for name, j in self.jobs.items()},
            "rounds_done": w.rounds_done if w else 0, "rounds_failed": w.rounds_failed if w else 0,
            "round_agreements": w.agreements if w else 0,
            "lane_rounds": w.lane_rounds if w else 0, "lane_rounds_given_up": w.lanes_given_up if w else 0,
            "last_round_seconds": w.last_round_seconds if w else 0.0,
            **self.figures.snapshot(),
            "bytes_sent": self.net.bytes_sent if self.net else 0,
            "bytes_received": self.net.bytes_received if self.net else 0,
            # from the left neighbour (elastic mode: any peer), on TCP connections that broke (PeerNet.take_gap)
            "messages_lost": self.net.messages_lost if self.net else 0,
            "client_connections": len(getattr(self, "connections", ())),
            "client_connections_dropped": getattr(self, "connections_dropped", 0),
            "max_sessions": self.max_sessions,
            "state_bytes": self.states.total_bytes(),
            # codec state per job (tensors, bytes) and what the cap made room for (StateStore)
            "states": self.states.per_job(),
            "states_evicted": self.states.evicted, "states_evicted_bytes": self.states.evicted_bytes,
            "uptime_seconds": time.time() - self.started,
            "kernels": {**(self.warmer.status() if self.warmer is not None else {}), "parked_calls": len(self.parked)},
            # elastic mode's epoch, members and leader (the membership's; nothing on a fixed ring)
            **({"elastic": ms} if w is not None and (ms := w.status()) is not None else {}),
        }

    # -- shutdown ---------------------------------------------------------------------------------
    def shutdown(self) -> int:
        if self.stopping:
            return 0
        self.stopping = True
        if self.worker is not None and self.worker.is_alive():
            self.worker.stop()
            self.worker.join(timeout=max(5.0, self.settings.peer_timeout))
        self.handle_finished()
        for j in self.jobs.values():
            for _seq, pend in j.pending.items():
                for idx, (_d, _c, call, _slot) in pend.items():
                    s = j.sessions.get(idx)
                    if s is not None:
                        self.reply(s.identity, {"t": "error", "call": call,
                                                **to_wire(ShutdownError("birdnetd is shutting down"))})
            j.pending.clear()
        while self.parked:
            _since, identity, h, _codec, _params = self.parked.popleft()
            self.reply(identity, {"t": "error", "call": _call_of(h), **to_wire(ShutdownError("birdnetd is shutting down"))})
        if self.warmer is not None:
            self.warmer.stop()
        for identity in list(self.sessions):
            self.end_session(identity, "daemon shutting down")
        if self.metrics is not None:
            self.metrics.stop()
        if self.net is not None:
            self.net.close()
        if self.zap is not None:
            self.zap.close()
        for sock in ("conn_monitor", "clients", "wake_rx", "wake_tx", "ring_wake_rx", "ring_wake_tx"):
            if hasattr(self, sock):
                getattr(self, sock).close(0)
        if getattr(self, "fd_listener", None) is not None:
            for fd in list(self.fd_pending):
                self._close_fd_conn(fd)
            self.fd_listener.close()
            try:
                os.unlink(self.fd_socket_path)
            except OSError:
                pass
        try:
            os.unlink(self.socket_path)
        except OSError:
            pass
        self.ctx.term()
        log.info("stopped")
        return 0


def session_limits(world: int) -> tuple[int, int]:
    """(sessions, connections) this daemon accepts, so that they fit its descriptor limit: the soft
    RLIMIT_NOFILE is raised to the hard one first (the systemd unit sets LimitNOFILE=8192, which
    fits the 1024-session cap: 1024 x 5 + 256 + peers)."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 1 << 16
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    except (ImportError, ValueError, OSError):
        soft = 1024
    budget = (soft if soft != -1 else 1 << 16) - RESERVED_FDS - 8 * world
    sessions = max(1, min(MAX_SESSIONS, budget // FDS_PER_SESSION))
    return sessions, sessions + 64


def check_socket_dir(path: str) -> None:
    """Refuse a socket directory another user could have prepared (the default under /tmp when
    XDG_RUNTIME_DIR is unset is a name anyone can create first): it must belong to this user or
    root, and nobody else may write to it unless it is sticky (as /tmp)."""
    import stat
    st = os.stat(path)
    if st.st_uid not in (os.getuid(), 0):
        raise_config(f"socket directory {path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}) or "
                     "root: another user may have made it to receive your training processes' gradients; "
                     "remove it, or pass --socket / set XDG_RUNTIME_DIR")
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise_config(f"socket directory {path} is writable by every user (mode {st.st_mode & 0o7777:o}): anyone "
                     "could replace the socket; use a directory only this user (and --shm-group) may write")


def _peer_pid(fd: int) -> int | None:
    """The pid at the other end of Unix socket descriptor ``fd`` (SO_PEERCRED), or None."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
        return pid if pid > 0 else None
    except (OSError, AttributeError):
        return None
    finally:
        sock.close()


def source_fd(frame: Any) -> int | None:
    """The daemon's descriptor of the connection a message came through (libzmq's ZMQ_SRCFD), or
    None where libzmq does not report it."""
    try:
        fd = frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


def peer_credentials(frame: Any) -> tuple[int, int, int] | None:
    """(uid, gid, pid) of the process at the other end of a client connection, as the kernel
    reports it (SO_PEERCRED): libzmq puts them into an IPC message's "Peer-Address" property as
    ``...:uid:gid:pid``. None where that is not available (no SO_PEERCRED, an old libzmq)."""
    try:
        addr = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError):
        return None
    parts = addr.rsplit(":", 3) if isinstance(addr, str) else []
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    uid, gid, pid = (int(p) for p in parts[1:])
    return (uid, gid, pid) if 0 < pid <= MAX_PID else None


def _nudge(sock: zmq.Socket) -> None:
    """Wake the thread reading ``sock`` (an inproc PUSH). A full queue (zmq.Again) means wake-ups
    are already waiting there, which is all a wake-up is for: nothing is lost."""
    try:
        sock.send(b"", zmq.NOBLOCK)
    except zmq.Again:
        pass


def _call_of(header: Any) -> Any:
    call = header.get("call") if isinstance(header, dict) else None
    return call if isinstance(call, int) and not isinstance(call, bool) else None


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    out = {k: (float(v) if isinstance(v, (np.floating, float)) else int(v) if isinstance(v, (np.integer, int)) else v)
           for k, v in d.items() if isinstance(v, (int, float, str, np.integer, np.floating))}
    for k, v in d.items():  # lists of ranks (elastic mode's contributors)
        if isinstance(v, list) and all(isinstance(x, (int, np.integer)) for x in v):
            out[k] = [int(x) for x in v]
    return out


def raise_config(msg: str) -> None:
    from birdnet.errors import ConfigError
    raise ConfigError(msg)
