"""Client sessions and the descriptors they hold: one :class:`Session` per process of a job, its
shared-memory segments and doorbells, the job's calls still collecting its local processes, and the
accounting of client connections by descriptor (accepted, silent, dropped) that keeps the daemon
within its descriptor limit whatever processes do.

:class:`Sessions` is part of :class:`birdnet.daemon.service.Daemon`: it handles ``hello`` and
``alloc`` and ends sessions; the daemon's main loop calls ``handle_connections``,
``drop_idle_connections`` and ``reap_sessions``. :class:`Connections` is the descriptor accounting
(the daemon's ``conns``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import zmq
from birdnet.daemon.engine import Contribution
from birdnet.daemon.fdpass import peer_pid

from birdnet import PROTOCOL_VERSION, __version__
from birdnet.door import Bell, Door
from birdnet.errors import InputError, SessionLostError, to_wire
from birdnet.osutil import pid_alive
from birdnet.requests import MAX_SEGMENT_BYTES, Alloc, Hello
from birdnet.shm import Segment, new_name

log = logging.getLogger("birdnet.daemon")

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
#: call numbers below a process's highest one by more than this are refused as already used (the
#: window bounds what a session remembers; calls can arrive out of order only between the socket
#: and the submit FIFO, a few calls at most)
SEQ_WINDOW = 4096


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
    #: call numbers this process used, at least those within SEQ_WINDOW below last_seq (up to two
    #: windows: see use_seq): a number used again is refused (a round's key twice in the ring
    #: worker's order killed the worker)
    used_seqs: set[int] = dataclasses.field(default_factory=set)
    started: float = dataclasses.field(default_factory=time.monotonic)
    uid: int | None = None  #: the process's user, from the kernel (None: not known)
    #: the sealed segment of the last alloc while the daemon still holds its descriptor (at most
    #: one per session: the process opens it before it sends anything else over the socket)
    unmapped: Segment | None = None

    def seq_used(self, seq: int) -> bool:
        """Whether call number ``seq`` was submitted before (or is too old to tell)."""
        return seq in self.used_seqs or seq < self.last_seq - SEQ_WINDOW

    def use_seq(self, seq: int) -> None:
        """Note call number ``seq`` as submitted. The set is trimmed to the last window once it
        holds two: one rebuild every SEQ_WINDOW calls. Trimmed at one window, it was rebuilt on
        every submit past the first 4,096 calls of a process (0.3 ms of the main thread each)."""
        self.used_seqs.add(seq)
        if seq > self.last_seq:
            self.last_seq = seq
            if len(self.used_seqs) > 2 * SEQ_WINDOW:
                self.used_seqs = {q for q in self.used_seqs if q >= seq - SEQ_WINDOW}


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


class Sessions:
    """Sessions, jobs and client connections: the daemon's part that knows processes."""

    # of the Daemon (daemon/service.py) this is part of: what it reads and changes
    settings: Any
    rank: int
    world: int
    gid: int | None
    shm_prefix: str
    sealed: bool
    max_sessions: int
    sessions: dict[bytes, Session]
    jobs: dict[str, Job]
    bells: dict[int, bytes]
    poller: Any
    worker: Any
    fds: Any
    conns: Connections | None
    reply: Callable[[bytes, dict[str, Any]], None]
    handle_finished: Callable[[], None]

    def handle_hello(self, identity: bytes, h: Hello, creds: tuple[int, int, int] | None = None,
                     fd: int | None = None) -> None:
        """``creds``: the kernel's (uid, gid, pid) of the connection; ``fd``: the daemon's descriptor
        of the connection the hello came through (None where libzmq does not say)."""
        if h.proto != PROTOCOL_VERSION:
            from birdnet.errors import VersionMismatchError
            raise VersionMismatchError(f"client speaks protocol {h.proto!r}, birdnetd {__version__} speaks "
                                       f"{PROTOCOL_VERSION}; install the same birdnet version for both")
        job, pid = h.job, h.pid  # types and ranges: birdnet.requests.decode
        # Connections accepted before this hello was read are in the monitor's queue by now (an
        # accept is reported before the connection can carry a message): take them first, so a
        # disconnect of this process's previous connection cannot end the session made here.
        drained = self.handle_connections()
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
        conn = self.conns.get(fd) if fd is not None else None
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
        want = h.local_rank  # a launcher's LOCAL_RANK (Client(local_rank=)); else the next free one
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
        if h.door is True:
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

    def handle_alloc(self, identity: bytes, h: Alloc) -> None:
        s = self._session(identity)
        slot, nbytes = h.slot, h.nbytes  # types, and the slot's range: birdnet.requests.decode
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
        elif self.sealed and s.uid is not None and self.fds.listener is not None:
            # a process of another user (--shm-group): /proc/<our pid>/fd is closed to it, so it
            # fetches the memfd through the side socket (SCM_RIGHTS), with a one-time token
            seg = Segment.sealed(nbytes)
            s.unmapped = seg
            token = self.fds.offer(identity, seg)
        else:  # no sealing, no peer credentials: a named file
            seg = Segment(new_name(self.shm_prefix), nbytes, create=True,
                          mode=0o660 if self.gid is not None else 0o600, gid=self.gid)
        s.segments[slot] = seg
        reply = {"t": "shm", "call": h.call, "slot": slot, "name": seg.name, "nbytes": nbytes}
        if token is not None:
            reply["fdsock"], reply["token"], reply["inode"] = self.fds.path, token, seg.inode
        elif seg.fd is not None:
            reply["path"], reply["inode"] = seg.path, seg.inode
        self.reply(identity, reply)

    def handle_connections(self) -> bool:
        """Take the client socket's accepts and disconnects (4096 at most); True when none is left.
        A process with no connection left loses its sessions: they cannot hear anything again."""
        return self.conns.take_events(self._process_gone)

    def _process_gone(self, pid: int) -> None:
        for identity, s in list(self.sessions.items()):
            if s.pid == pid:
                self.end_session(identity, "connection closed")

    def drop_idle_connections(self) -> None:
        self.conns.drop_idle({s.pid for s in self.sessions.values()})

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
        if self.fds is not None:
            self.fds.forget(identity)
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


class Connections:
    """Client connections by descriptor, as the kernel sees them (a monitor of the client socket:
    accepted, gone): which process holds each, since when, and whether it has said anything. A
    connection that says no hello within ``hello_timeout`` is dropped, beyond ``max_connections``
    new ones are dropped at once, and a process whose silent connections keep being dropped may
    hold only MAX_SILENT_PER_PROCESS of them: every connection holds one of the daemon's
    descriptors, whatever a process does."""

    def __init__(self, monitor: Any, socket_path: str, max_connections: int, hello_timeout: float) -> None:
        self.monitor, self.socket_path = monitor, socket_path
        self.max_connections, self.hello_timeout = max_connections, hello_timeout
        #: descriptor -> [peer pid or None, accepted at, has said something (a message came over it)]
        self.by_fd: dict[int, list[Any]] = {}
        #: pid -> times its connections were dropped for saying nothing (SILENT_STRIKES)
        self.silent_strikes: dict[int, deque[float]] = {}
        #: whether libzmq names the descriptor a message came over (ZMQ_SRCFD, source_fd); without
        #: it a connection counts as speaking once its process has a session
        self.fd_of_messages = False
        self.closed = 0  #: since malloc last handed memory back (the daemon's loop resets it)
        self.dropped = 0  #: by this daemon (idle, or over max_connections)
        self._drop_logged, self._drops_at_log = 0.0, 0

    def __len__(self) -> int:
        return len(self.by_fd)

    def get(self, fd: int) -> list[Any] | None:
        return self.by_fd.get(fd)

    def spoke(self, fd: int, take_events: Callable[[], Any]) -> None:
        """A message came over descriptor ``fd`` (``take_events``: the daemon's handle_connections,
        for a connection whose accept is still in the monitor's queue)."""
        self.fd_of_messages = True
        if fd not in self.by_fd:
            take_events()  # its accept is reported before its first message: take it
        conn = self.by_fd.get(fd)
        if conn is not None:
            conn[2] = True  # it has said something (drop_idle)

    def take_events(self, process_gone: Callable[[int], None]) -> bool:
        """Take the monitor's accepts and disconnects (4096 at most); True when none is left.
        ``process_gone(pid)``: a process's last connection closed."""
        from zmq.utils.monitor import recv_monitor_message
        for _ in range(4096):
            try:
                ev = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return True
            fd = ev.get("value")
            if not isinstance(fd, int):
                continue
            if ev["event"] == zmq.EVENT_ACCEPTED:
                pid = peer_pid(fd)
                self.by_fd[fd] = [pid, time.monotonic(), False]
                if len(self.by_fd) > self.max_connections:
                    self._drop(fd, f"over the limit of {self.max_connections} connections")
                elif pid is not None and self._silent_process(pid):
                    self._drop(fd, f"its process holds {MAX_SILENT_PER_PROCESS} connections that said "
                                   f"nothing, and {SILENT_STRIKES} or more of its connections were dropped "
                                   f"for saying nothing in the last {SILENT_STRIKE_WINDOW:.0f} s")
                    self._strike(pid)
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                self.closed += 1
                gone = self.by_fd.pop(fd, None)
                pid = gone[0] if gone is not None else None
                if pid is not None and not any(c[0] == pid for c in self.by_fd.values()):
                    process_gone(pid)
        return False

    def drop_idle(self, pids_with_session: set[int]) -> None:
        """Connections that said nothing within hello_timeout (a real client says hello at once) are
        dropped: each holds a descriptor. Where libzmq does not say which connection a message came
        over, only those of processes without a session (a process with one was exempt, and its
        silent connections stayed)."""
        now = time.monotonic()
        limit = now - self.hello_timeout
        for fd, (pid, since, spoke) in list(self.by_fd.items()):
            if pid is None or since >= limit:  # (None: the kernel did not say; _drop needs it)
                continue
            if (not spoke) if self.fd_of_messages else pid not in pids_with_session:
                self._drop(fd, f"no hello within {self.hello_timeout} s")
                self.by_fd[fd][1] = now  # once; the disconnect removes it
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
        silent = sum(1 for c in self.by_fd.values() if c[0] == pid and not c[2])
        return silent > MAX_SILENT_PER_PROCESS

    def _drop(self, fd: int, why: str) -> None:
        """Shut a client connection down under ZeroMQ (which then closes it, as when the process
        goes). Only if descriptor ``fd`` is still that connection: a Unix socket of our path
        whose peer is the process recorded at accept (a descriptor number can be reused)."""
        c = self.by_fd.get(fd)
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return
        try:
            if (sock.family == socket.AF_UNIX and sock.getsockname() == self.socket_path
                    and c is not None and peer_pid(sock.fileno()) == c[0]):
                sock.shutdown(socket.SHUT_RDWR)
                self.dropped += 1
                now = time.monotonic()
                if now - self._drop_logged > 1.0:  # a flood of them is one line a second
                    log.warning("dropped %d client connection(s), the last of pid %s: %s",
                                self.dropped - self._drops_at_log, c[0], why)
                    self._drop_logged, self._drops_at_log = now, self.dropped
        except OSError:
            pass
        finally:
            sock.close()


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
