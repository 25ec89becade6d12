"""Descriptor passing for processes of another user: the memfd side socket.

A process of the daemon's own user (or root) opens its sealed segment through /proc; a process of
another user (--shm-group) may not, so it fetches the memfd over a Unix seqpacket socket beside the
client socket (SCM_RIGHTS; the client socket is ZeroMQ and cannot pass descriptors), presenting a
one-time token from its alloc's reply. Here too: what the kernel says about the process at the other
end of a connection (SO_PEERCRED, ZMQ_SRCFD), which both this socket and the client socket use.

:class:`FdPassing` is part of :class:`birdnet.daemon.service.Daemon` (its state lives on the daemon:
``fd_listener``, ``fd_tokens``, ``fd_pending``; it reads ``sessions`` and ``poller``).
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import time
from typing import Any

import zmq

from birdnet.requests import MAX_PID
from birdnet.shm import Segment

log = logging.getLogger("birdnet.daemon")

MAX_SOCKET_PATH = 107  #: bytes of a Unix socket path (sun_path minus its terminating NUL, Linux)


class FdPassing:
    """The memfd side socket's part of the daemon."""

    socket_path: str
    sealed: bool
    gid: int | None
    sessions: dict[bytes, Any]
    poller: Any

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
        pid = peer_pid(conn.fileno())
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


def peer_pid(fd: int) -> int | None:
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
