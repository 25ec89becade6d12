"""The daemon's main loop: it wires the client socket, the ring worker, the peers and the warm-up
thread together and dispatches what arrives.

Structure after gunicorn's arbiter: signal handlers only record the signal; the loop dispatches to
``handle_*`` methods, then enforces invariants (reap sessions whose process died, ping the systemd
watchdog). Rounds run on the :class:`~birdnet.daemon.engine.RingWorker` thread, which hands finished
rounds back through a queue and wakes this loop with an inproc message.

It is one thread's state machine: every ``handle_*`` reads and changes the same :class:`Daemon`.
Its parts live beside it, one seam each: the requests and their checks in :mod:`birdnet.requests`
(shared with the client), sessions and descriptor accounting in :mod:`birdnet.daemon.sessions`,
calls, local rounds and the warm-up queue in :mod:`birdnet.daemon.calls`, the memfd side socket and
the peer-credential helpers in :mod:`birdnet.daemon.fdpass`.

Client protocol (frames as in :mod:`birdnet.wire`; the client's DEALER talks to our ROUTER; the
requests' fields: :data:`birdnet.requests.REQUESTS`):

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
import grp
import logging
import os
import queue
import signal
import time
from typing import Any

import zmq
from birdnet.daemon import notify
from birdnet.daemon.calls import MAX_WARM_REQUESTS, Calls, _call_of, _nudge
from birdnet.daemon.engine import LocalRound, RingWorker, RoundRunner, StateStore
from birdnet.daemon.fdpass import MAX_SOCKET_PATH, FdServer, peer_credentials, source_fd
from birdnet.daemon.sessions import (
    FDS_PER_SESSION,
    MAX_SESSIONS,
    MAX_SILENT_PER_PROCESS,
    RESERVED_FDS,
    Connections,
    Job,
    Session,
    Sessions,
    session_limits,
)

from birdnet import __version__, wire
from birdnet.config import Settings
from birdnet.errors import BirdnetError, InputError, ProtocolError, ShutdownError, to_wire
from birdnet.hosts import Peer, find_own_rank, load_hosts, unresolved
from birdnet.osutil import release_freed_memory, unix_socket_accepts
from birdnet.requests import REQUESTS, Bye, Hello, Request, Status, Submit, check_request, decode
from birdnet.shm import remove_stale, sealing_available, segment_prefix

log = logging.getLogger("birdnet.daemon")

#: names this module has always offered (tests, tools): they live in the modules of their seam now
__all__ = ["Daemon", "FDS_PER_SESSION", "MAX_SESSIONS", "MAX_SILENT_PER_PROCESS", "MAX_WARM_REQUESTS", "REQUESTS",
           "RESERVED_FDS", "Job", "Session", "check_request", "check_socket_dir", "peer_credentials",
           "session_limits", "source_fd"]


class Daemon(Sessions, Calls):
    """birdnetd: one per node (``birdnetd --peers hosts.txt``); ``serve_forever`` runs it."""

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
        self.fds: FdServer | None = None  #: the memfd side socket (set up with the client socket)
        self.conns: Connections | None = None  #: client connections by descriptor (set up with the socket)
        self.max_sessions, self.max_connections = session_limits(self.world)
        self.warned_jobs: set[str] = set()  #: jobs told that unnamed calls run without error feedback
        #: compiles the codecs' kernels off the ring thread (daemon/warmup.py); submits whose codec is
        #: not warm yet wait in ``parked`` (arrival, identity, request, codec, params), in order
        self.warmer: Any = None
        self.parked: collections.deque[tuple[float, bytes, Submit, Any, Any]] = collections.deque()
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
        self.conns = Connections(self.conn_monitor, self.socket_path, self.max_connections,
                                 self.settings.hello_timeout)
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

    def _open_fd_socket(self) -> None:
        """The memfd side socket (daemon/fdpass.py), opened right after the client socket's bind."""
        self.fds = FdServer(self.socket_path, self.sealed, self.gid)

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
        if self.fds.listener is not None:
            poller.register(self.fds.listener.fileno(), zmq.POLLIN)
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
                if self.fds.listener is not None:
                    self.fds.handle(events, poller, self.sessions.get)
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
                        if self.conns.closed >= 64:  # a burst of them ended
                            self.conns.closed = 0
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
            self.fds.forget(identity)
        hello = header.get("t") == "hello"
        fd = source_fd(frames[1])
        if fd is not None:
            self.conns.spoke(fd, self.handle_connections)
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
                 creds: tuple[int, int, int] | None = None, fd: int | None = None) -> None:
        """A request as received (``allowed``: the types its channel takes), decoded and checked once
        (:func:`birdnet.requests.decode`), then handled; a submit whose codec's kernels are not
        loaded yet waits in the warm-up queue (``_park``) and is handled by ``release_parked``."""
        try:
            t = header.get("t")
            if t not in allowed:
                raise ProtocolError(f"unknown request {t!r}")
            req = decode(header)
            if isinstance(req, Submit) and self._park(identity, req):
                return
            self._handle(identity, req, creds, fd)
        except Exception as exc:  # noqa: BLE001 - a bad request must never take the daemon down
            self._refuse(identity, _call_of(header), exc)

    def handle_request(self, identity: bytes, req: Request) -> None:
        """A request decoded already (a submit let out of the warm-up queue)."""
        try:
            self._handle(identity, req)
        except Exception as exc:  # noqa: BLE001 - a bad request must never take the daemon down
            self._refuse(identity, _call_of(req), exc)

    def _handle(self, identity: bytes, req: Request, creds: tuple[int, int, int] | None = None,
                fd: int | None = None) -> None:
        if isinstance(req, Hello):
            self.handle_hello(identity, req, creds, fd)
        else:
            getattr(self, f"handle_{req.t}")(identity, req)

    def _refuse(self, identity: bytes, call: Any, exc: Exception) -> None:
        """The error reply to a request that failed: its own error when it is one of ours, else an
        InputError saying the daemon failed inside (and the log has the traceback)."""
        if isinstance(exc, BirdnetError):
            log.info("client request refused: %s", exc)
        else:
            log.error("client request failed inside the daemon", exc_info=exc)
            exc = InputError(f"request failed inside birdnetd: {exc!r}")
        self.reply(identity, {"t": "error", "call": call, **to_wire(exc)})

    def handle_status(self, identity: bytes, h: Status) -> None:
        self.reply(identity, {"t": "status", "call": h.call, "status": self.status()})

    def handle_bye(self, identity: bytes, h: Bye) -> None:
        self.handle_bell(identity)  # calls written before the bye come first
        self.end_session(identity, "bye")
        self.reply(identity, {"t": "bye", "call": h.call})


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
            # from peers, whose fields failed their record's checks (birdnet.messages.peer_record)
            "peer_messages_malformed": self.net.malformed if self.net else 0,
            "client_connections": len(self.conns) if self.conns is not None else 0,
            "client_connections_dropped": self.conns.dropped if self.conns is not None else 0,
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
        if self.fds is not None:
            self.fds.close(self.poller)
        try:
            os.unlink(self.socket_path)
        except OSError:
            pass
        self.ctx.term()
        log.info("stopped")
        return 0


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


def raise_config(msg: str) -> None:
    from birdnet.errors import ConfigError
    raise ConfigError(msg)
