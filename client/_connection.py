"""The client's connection to its local daemon: the socket, the hello, and the doorbells.

One :class:`Connection` per :class:`birdnet.client.Client`, opened again after the daemon went
away. It owns a ZeroMQ DEALER on the daemon's Unix socket, a monitor of that socket (the only way
to hear that the daemon's end closed: a DEALER reconnects silently and calls in flight would wait
for ever), and the two FIFOs the daemon's welcome may name (``birdnet.door``: results come through
the result doorbell, calls go through the submit FIFO when they fit). ``recv`` returns the next
message from any of them and says when the daemon is gone; what the messages mean is the reply
pump's business (``birdnet.client._replies``).
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any

import zmq

from birdnet import PROTOCOL_VERSION, wire
from birdnet.door import BellWriter, DoorReader
from birdnet.errors import (
    AuthenticationError,
    DaemonUnavailableError,
    ProtocolError,
    RoundTimeoutError,
    SessionLostError,
    from_wire,
)
from birdnet.requests import Hello


def default_socket() -> str:
    from birdnet.config import socket_path
    return socket_path()


def check_access(path: str) -> None:
    """Refuse a socket this process should not talk to, or cannot, saying why and what to do."""
    tmp_default = os.path.join("/tmp", f"birdnet-{os.getuid()}")
    if os.path.dirname(path) == tmp_default:
        # the default without XDG_RUNTIME_DIR: a name anyone can create first, with a daemon
        # of their own behind it that would receive this process's gradients
        try:
            owner = os.stat(tmp_default).st_uid
        except OSError:
            owner = os.getuid()  # not there: the FileNotFoundError below says what to do
        if owner not in (os.getuid(), 0):
            raise AuthenticationError(
                f"{tmp_default} belongs to uid {owner}, not to this user (uid {os.getuid()}): another user may "
                "have made it to receive your gradients; remove it, or set XDG_RUNTIME_DIR / BIRDNET_SOCKET")
    try:
        os.stat(path)
    except PermissionError:
        raise AuthenticationError(
            f"permission denied on {path}: a directory on the way is closed to uid {os.getuid()}; birdnetd "
            "serves only its own user and its --shm-group") from None
    except FileNotFoundError:
        raise DaemonUnavailableError(
            f"no birdnetd at {path}: start it with `birdnetd --peers hosts.txt` "
            "(or `systemctl start birdnetd`), or point to its socket: --socket PATH on the command line, "
            "socket=PATH in Python, or BIRDNET_SOCKET=PATH") from None
    if not os.access(path, os.R_OK | os.W_OK):
        st = os.stat(path)
        raise AuthenticationError(
            f"permission denied on {path} (owner uid {st.st_uid}, group gid {st.st_gid}, mode "
            f"{st.st_mode & 0o777:o}): birdnetd serves only its own user and its --shm-group; run the "
            "training process as one of them")


#: a hello not answered within this many seconds makes the client ask whether anyone listens on
#: the socket file at all (:func:`check_listening`); a live daemon answers well within it
STALE_CHECK_AFTER = 0.5


def check_listening(path: str) -> None:
    """A socket file nobody listens on (left by a daemon that was killed) refuses a connection at
    once; ZeroMQ's ipc connect instead retries quietly, and the hello would wait out its whole
    timeout and say only that the daemon did not answer. One plain connect, closed at once, tells
    the two apart. Only after a hello went unanswered for a moment: a live daemon would see the
    probe as a connection of this process that closed, beside the real one."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except ConnectionRefusedError:
        raise DaemonUnavailableError(
            f"no daemon is listening on {path} (stale socket: its daemon was stopped or killed); start birdnetd "
            "(`birdnetd --peers hosts.txt`, or `systemctl start birdnetd`), or point to the socket of a running "
            "one: --socket PATH on the command line, socket=PATH in Python, or BIRDNET_SOCKET=PATH") from None
    except OSError:
        pass  # anything else (a full backlog, a timeout): the hello says what it finds
    finally:
        probe.close()


class Connection:
    """The socket to the daemon at ``socket_path`` for ``job``, with its monitor and doorbells."""

    def __init__(self, socket_path: str, job: str, local_rank: int | None = None) -> None:
        self.socket_path, self.job = socket_path, job
        self.local_rank = local_rank  #: the local rank asked for in every hello (None: the next free one)
        self._ctx = zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.door: DoorReader | None = None  #: the result doorbell (birdnet.door), if the daemon gave one
        self.bell: BellWriter | None = None  #: the submit FIFO (birdnet.door), likewise
        self.poller = zmq.Poller()
        self.generation = 0  #: bumped on every (re)connection
        self.lost: str | None = None  #: why the connection to the daemon is gone, until reconnected

    @property
    def alive(self) -> bool:
        """Connected and not known to be gone (reads the monitor first)."""
        self.check_monitor()
        return self.sock is not None and not self.lost

    def connect(self, timeout: float) -> dict[str, Any]:
        """Connect and say hello; the daemon must answer within ``timeout``. Returns its welcome."""
        check_access(self.socket_path)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(f"ipc://{self.socket_path}")
        self.sock = sock
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.lost = None
        self.send(Hello(job=self.job, pid=os.getpid(), proto=PROTOCOL_VERSION, door=True,
                        local_rank=self.local_rank).header())
        deadline = time.monotonic() + timeout
        try:
            try:
                reply = self.recv(min(deadline, time.monotonic() + STALE_CHECK_AFTER))
            except RoundTimeoutError:
                check_listening(self.socket_path)  # DaemonUnavailableError for a stale socket, at once
                reply = self.recv(deadline)
        except RoundTimeoutError:
            self.close()
            raise DaemonUnavailableError(
                f"birdnetd at {self.socket_path} did not answer within {timeout:.3g} s; is it running? "
                "(`birdnet status --socket PATH`; start it with `birdnetd --peers hosts.txt`)") from None
        except DaemonUnavailableError:
            self.close()
            raise
        if reply["t"] == "error":
            self.close()
            raise from_wire(reply)
        if isinstance(reply.get("door"), str) and isinstance(reply.get("bell"), str):
            try:
                self.door = DoorReader(reply["door"])
                self.bell = BellWriter(reply["bell"])
                self.poller.register(self.door.fd, zmq.POLLIN)
            except (OSError, ValueError):
                # calls and results go over the socket; calls do not announce the doorbell
                for d in (self.door, self.bell):
                    if d is not None:
                        d.close()
                self.door = self.bell = None
        self.generation += 1
        return reply

    def close(self) -> None:
        if self.door is not None:
            self.door.close()
            self.door = None
        if self.bell is not None:
            self.bell.close()
            self.bell = None
        if self.sock is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.sock.close(0)
            self.sock = None
        if self.monitor is not None:
            self.monitor.close(0)
            self.monitor = None

    def send(self, header: dict[str, Any]) -> None:
        """Over the socket."""
        if self.sock is None:
            raise DaemonUnavailableError(f"client is not connected to birdnetd at {self.socket_path}"
                                         + (f" ({self.lost})" if self.lost else ""))
        self.sock.send_multipart(wire.encode(header))

    def submit(self, header: dict[str, Any]) -> None:
        """A call: through the submit FIFO when there is one and it takes the call (fits in one
        atomic write, the pipe has room), else over the socket."""
        if self.bell is None or not self.bell.send(header):
            self.send(header)

    def pollables(self) -> list[Any]:
        """What to poll for messages from the daemon: the socket, its monitor, the result doorbell."""
        return [s for s in (self.sock, self.monitor, self.door.fd if self.door is not None else None)
                if s is not None]

    def check_monitor(self) -> None:
        if self.monitor is None or self.lost:
            return
        if not self.monitor.get(zmq.EVENTS) & zmq.POLLIN:
            return  # the common case, every call: no event (a failed recv raised zmq.Again, dearer)
        while True:
            try:
                self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.lost = ("the daemon closed the connection (killed or restarted); calls in flight were lost, "
                         "the next call reconnects")

    def gone(self) -> DaemonUnavailableError:
        return DaemonUnavailableError(f"birdnetd at {self.socket_path} went away: {self.lost}")

    def recv(self, deadline: float | None) -> dict[str, Any]:
        """The next message from the daemon (doorbell or socket), waiting until ``deadline``
        (RoundTimeoutError) or for ever; DaemonUnavailableError once the daemon is gone."""
        if self.sock is None:
            raise DaemonUnavailableError(f"client is not connected to birdnetd at {self.socket_path}")
        door = self.door
        while True:
            if door is not None and door.pending:
                return door.pending.popleft()
            self.check_monitor()
            if self.lost:
                raise self.gone()
            wait = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            events = dict(self.poller.poll(int(wait * 1000) + 1))
            if door is not None and door.fd in events:
                door.read()
                if door.eof:  # the daemon closed its end: it exited (the monitor says so too)
                    self.poller.unregister(door.fd)
                    door.close()
                    self.door = door = None
                elif door.pending:
                    return door.pending.popleft()
            if self.sock in events:
                frames = self.sock.recv_multipart()
                try:
                    header, _ = wire.decode(frames, max_bytes=wire.MAX_HEADER_BYTES)
                except ProtocolError:
                    continue  # not from a birdnetd we understand; ignore rather than crash
                if header.get("t") == "error" and isinstance(from_wire(header), SessionLostError):
                    self.lost = "the daemon restarted and no longer knows this process; the next call reconnects"
                    raise self.gone()
                return header
            if self.monitor is not None and self.monitor in events:
                continue
            if deadline is not None and time.monotonic() >= deadline:
                raise RoundTimeoutError("timed out waiting for birdnetd")
            if deadline is None and not os.path.exists(self.socket_path):
                self.lost = "its socket file was removed"
                raise self.gone()

    def read_door(self) -> list[dict[str, Any]]:
        """The results waiting in the result doorbell, read without polling (a caller that polls
        the doorbell itself, as birdnet.client.torch_dist's thread does)."""
        door = self.door
        if door is None:
            return []
        door.read()
        out = list(door.pending)
        door.pending.clear()
        return out
