"""The doorbells: named pipes (FIFOs) between the daemon and one training process, for results
(:class:`Door`, written by the ring worker) and for calls (:class:`Bell`, read by the main thread).

A result handed back through the client socket wakes four threads one after the other: the
daemon's main thread, its ZeroMQ I/O thread, the client's I/O thread and the client's thread. On a
machine whose cores are busy (the ring of the other nodes still running, or every node of a local
cluster on one box) each wake waits for a core, so the hand-off back grows with the load (the
measured figures are in CHANGELOG.md, "History of measurements"). Through the doorbell the ring
worker writes the ``done`` header itself, the moment the result is in shared memory, and only the waiting process
wakes. Everything else (requests, errors, and ``done`` when the doorbell cannot take it) still goes
through the socket: the client matches replies by call number, whichever way they came.

The daemon creates the FIFO under /dev/shm next to the process's shared-memory segments, with
their name prefix and mode (so a restarted daemon removes what a killed one left), and opens it
read-write: a write then never fails for want of a reader, and the process can open its end at any
time. The process says in its calls (``door: true`` in a submit) that it has its end open; only
then does the daemon use the doorbell, and it unlinks the name.
Each message is one msgpack map of at most ``PIPE_BUF`` bytes, so a write is atomic and messages
never interleave; a full pipe (a process that stopped reading) makes ``send`` return False and the
reply goes through the socket instead.
"""
from __future__ import annotations

import os
import select
import threading
from collections import deque
from typing import Any

import msgpack

from birdnet.shm import SHM_DIR

#: a write of at most this many bytes to a pipe is atomic (POSIX PIPE_BUF; 4096 on Linux)
ATOMIC_BYTES = select.PIPE_BUF
#: what one Bell.read takes from the pipe at most (the rest waits for the next poll)
MAX_BELL_READ = 1 << 20


class _Fifo:
    """A FIFO under /dev/shm that the daemon creates (mode and group as its segments) and holds
    open read-write: opening does not wait for the other end, a write never fails for want of a
    reader, and a read never sees end-of-file when the process goes."""

    def __init__(self, name: str, *, mode: int = 0o600, gid: int | None = None) -> None:
        if "/" in name or not name:
            raise ValueError(f"bad doorbell name {name!r}")
        self.name = name
        self.path: str | None = os.path.join(SHM_DIR, name)
        os.mkfifo(self.path, mode)
        try:
            os.chmod(self.path, mode)  # the umask must not narrow what the group may do
            if gid is not None:
                os.chown(self.path, -1, gid)
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        except BaseException:
            self.unlink()
            raise

    @property
    def fd(self) -> int | None:
        return self._fd

    def unlink(self) -> None:
        """Remove the name (the open ends keep working)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.unlink()


class Door(_Fifo):
    """The daemon's end of the result FIFO. ``send`` may be called from the ring worker while the
    main thread closes the door (the process left): a lock keeps a write from landing on a reused
    descriptor."""

    def __init__(self, name: str, *, mode: int = 0o600, gid: int | None = None) -> None:
        super().__init__(name, mode=mode, gid=gid)
        self._lock = threading.Lock()
        #: set once the process said (in a submit) that it has its end open; before that nothing
        #: is written, so a process that could not open it loses no result
        self.armed = False
        self._packer = msgpack.Packer(use_bin_type=True)

    def send(self, header: dict[str, Any]) -> bool:
        """Write ``header``; False when it did not go (door closed, pipe full, too large)."""
        with self._lock:
            return _write(self._fd, self._packer, header)

    def close(self) -> None:
        with self._lock:
            super().close()


class DoorReader:
    """The training process's end: ``fd`` goes into its poller; ``read`` returns the headers that
    arrived (maps only; anything else is dropped)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fd: int | None = _open(name, os.O_RDONLY)
        self._unpacker = _unpacker()
        self.pending: deque[dict[str, Any]] = deque()
        #: the daemon closed its end (it exited): the caller closes this one and stops polling it
        self.eof = False

    def read(self) -> None:
        """Move what the pipe holds into ``pending``."""
        if self.fd is None:
            return
        try:
            self.eof = _drain(self.fd, self._unpacker)
            for obj in self._unpacker:
                if isinstance(obj, dict) and isinstance(obj.get("t"), str):
                    self.pending.append(obj)
        except (ValueError, msgpack.UnpackException):  # garbage: start over rather than stall
            self._unpacker = _unpacker()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Bell(_Fifo):
    """The daemon's end of a process's *submit* FIFO (the other direction): the process writes its
    ``submit`` headers here instead of through the client socket, so a call reaches the daemon's
    main thread with one thread wake instead of three (the client's and the daemon's ZeroMQ I/O
    threads are skipped). Only the main thread touches it."""

    def __init__(self, name: str, *, mode: int = 0o600, gid: int | None = None) -> None:
        super().__init__(name, mode=mode, gid=gid)
        self._unpacker = _unpacker()
        #: bytes that were not msgpack (the stream was dropped and restarted), for the log
        self.garbage = 0

    def read(self) -> list[Any]:
        """The maps with string keys the pipe holds (the caller checks their fields).
        Never raises on what a process wrote: bytes that are not msgpack, or an object announced
        larger than any call (``MAX_BELL_BUFFER``), drop the stream read so far (``garbage``
        counts it) and reading starts over. At most ``MAX_BELL_READ`` bytes per call, so a
        process that writes without pause cannot hold the daemon's main thread."""
        if self.fd is None:
            return []
        out: list[Any] = []
        budget = MAX_BELL_READ
        while budget > 0:
            try:
                data = os.read(self.fd, min(1 << 16, budget))
            except BlockingIOError:
                break
            if not data:
                break
            budget -= len(data)
            try:
                self._unpacker.feed(data)
                for obj in self._unpacker:
                    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
                        out.append(obj)
                    else:  # a bare 0 byte is msgpack too: counted, not handed on (or logged) one by one
                        self.garbage += 1
            except (ValueError, msgpack.UnpackException):
                # not msgpack, or over the buffer limit (BufferFull is no ValueError): drop the
                # stream, keep serving
                self.garbage += 1
                self._unpacker = _unpacker()
            if len(data) < 1 << 16:
                break
        return out


class BellWriter:
    """The process's end of its submit FIFO: ``send`` returns False when the header did not go (too
    large, pipe full, daemon gone); the caller then sends it through the socket."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fd: int | None = _open(name, os.O_WRONLY)
        self._packer = msgpack.Packer(use_bin_type=True)

    def send(self, header: dict[str, Any]) -> bool:
        return _write(self.fd, self._packer, header)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _open(name: str, flags: int) -> int:
    """The process's end of the FIFO the daemon named ``name`` (never blocks)."""
    if "/" in name or not name:
        raise ValueError(f"bad doorbell name {name!r}")
    return os.open(os.path.join(SHM_DIR, name), flags | os.O_NONBLOCK)


def _write(fd: int | None, packer: msgpack.Packer, header: dict[str, Any]) -> bool:
    """Write ``header`` as one atomic message; False when it did not go: no descriptor, larger than
    ATOMIC_BYTES, or the write failed (BlockingIOError: the reader is not reading; BrokenPipeError:
    the daemon exited)."""
    if fd is None:
        return False
    data = packer.pack(header)
    if len(data) > ATOMIC_BYTES:
        return False
    try:
        return os.write(fd, data) == len(data)
    except OSError:
        return False


def _drain(fd: int, unpacker: msgpack.Unpacker) -> bool:
    """Feed what the pipe holds to ``unpacker``; True at end-of-file (no writer left)."""
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not data:
            return True
        unpacker.feed(data)
        if len(data) < 1 << 16:
            return False


def _unpacker() -> msgpack.Unpacker:
    # read_size is the buffer allocated up front (it grows to max_buffer_size as needed): msgpack's
    # default took ~40 KB resident per doorbell, 40 MB for a daemon with 1024 sessions
    return msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=1 << 20, read_size=ATOMIC_BYTES)
