"""Descriptor passing for processes of another user: the memfd side socket.

A process of the daemon's own user (or root) opens its sealed segment through /proc; a process of
another user (--shm-group) may not, so it fetches the memfd over a Unix seqpacket socket beside the
client socket (SCM_RIGHTS; the client socket is ZeroMQ and cannot pass descriptors), presenting a
one-time token from its alloc's reply. Here too: what the kernel says about the process at the other
end of a connection (SO_PEERCRED, ZMQ_SRCFD), which both this socket and the client socket use.

:class:`FdServer` is the daemon's ``fds``; the daemon's loop polls its descriptors.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import zmq

from birdnet.requests import MAX_PID
from birdnet.shm import Segment

log = logging.getLogger("birdnet.daemon")

MAX_SOCKET_PATH = 107  #: bytes of a Unix socket path (sun_path minus its terminating NUL, Linux)


class FdServer:
    """The memfd side socket: a Unix seqpacket socket beside the client socket (same mode and
    group) through which a process of another user fetches its sealed segments (SCM_RIGHTS; the
    client socket is ZeroMQ and cannot pass descriptors), one token per segment. ``listener`` is
    None where it could not be opened (no sealing, a path too long): such processes get named
    files. The daemon's loop polls ``listener`` and the accepted connections (:meth:`handle`)."""

    def __init__(self, socket_path: str, sealed: bool, gid: int | None) -> None:
        self.listener: socket.socket | None = None
        self.tokens: dict[str, tuple[bytes, Segment]] = {}  #: one-time token -> (session, segment)
        self.pending: dict[int, tuple[socket.socket, float]] = {}  #: accepted, token not read yet
        self.path = socket_path + ".shm"
        if not sealed or len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
            return
        try:
            if os.path.exists(self.path):
                os.unlink(self.path)
            lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            old = os.umask(0o117 if gid is not None else 0o177)
            try:
                lst.bind(self.path)
            finally:
                os.umask(old)
            if gid is not None:
                os.chown(self.path, -1, gid)
            lst.listen(64)
            lst.setblocking(False)
            self.listener = lst
        except OSError as exc:
            log.warning("no memfd side socket at %s (%s): processes of other users get named segments",
                        self.path, exc)

    def offer(self, identity: bytes, seg: Segment) -> str:
        """The one-time token with which session ``identity``'s process fetches ``seg``."""
        token = secrets.token_hex(16)
        self.tokens[token] = (identity, seg)
        return token

    def forget(self, identity: bytes) -> None:
        """Session ``identity`` ended, or its process has its segment open: its tokens go."""
        for t in [t for t, (i, _seg) in self.tokens.items() if i == identity]:
            del self.tokens[t]

    def handle(self, events: dict, poller: Any, session_of: Callable[[bytes], Any]) -> None:
        """Accept what ``events`` (of ``poller``) says is waiting, answer the tokens that came, close
        connections that sent none within 2 s. ``session_of``: the session of an identity, or None."""
        lst = self.listener
        if lst is None:
            return
        if lst.fileno() in events:
            for _ in range(64):
                try:
                    conn, _addr = lst.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break
                if len(self.pending) >= 256:  # a flood: the oldest waiting one goes
                    self._close_conn(next(iter(self.pending)), poller)
                conn.setblocking(False)
                self.pending[conn.fileno()] = (conn, time.monotonic() + 2.0)
                poller.register(conn.fileno(), zmq.POLLIN)
        now = time.monotonic()
        for fd in list(self.pending):
            conn, deadline = self.pending[fd]
            if fd in events:
                try:
                    token = conn.recv(64).decode("ascii", "replace")
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    token = ""
                self._send_memfd(conn, token, session_of)
                self._close_conn(fd, poller)
            elif now > deadline:
                self._close_conn(fd, poller)

    def close(self, poller: Any) -> None:
        """Close the connections waiting and the listener, and remove the socket file."""
        if self.listener is None:
            return
        for fd in list(self.pending):
            self._close_conn(fd, poller)
        self.listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _send_memfd(self, conn: socket.socket, token: str, session_of: Callable[[bytes], Any]) -> None:
        entry = self.tokens.pop(token, None)
        if entry is None:
            return
        identity, seg = entry
        s = session_of(identity)
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

    def _close_conn(self, fd: int, poller: Any) -> None:
        conn, _ = self.pending.pop(fd)
        if poller is not None:
            try:
                poller.unregister(fd)
            except KeyError:
                pass
        conn.close()


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
