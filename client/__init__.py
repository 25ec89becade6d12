"""The client library training code imports: ``from birdnet.client import Client``.

It talks to the local ``birdnetd`` over a Unix socket (ZeroMQ ``ipc://``) and hands tensors over
through shared memory that the daemon creates; the client only attaches. It imports NumPy, pyzmq
and msgpack, never Numba.

Example::

    from birdnet.client import Client
    with Client(job="resnet") as client:
        params = client.broadcast(params, root=0)      # start from identical parameters
        grad = client.allreduce(grad, name="layer1.w")  # mean over all processes of the job
"""
from __future__ import annotations

import itertools
import mmap
import os
import sys
import time
import warnings
from typing import Any

import numpy as np
import zmq

from birdnet import PROTOCOL_VERSION, wire
from birdnet.door import BellWriter, DoorReader
from birdnet.errors import (
    AuthenticationError,
    BirdnetError,
    DaemonUnavailableError,
    InputError,
    ProtocolError,
    RoundTimeoutError,
    from_wire,
)

__all__ = ["Client", "Handle", "BirdnetError"]

#: how long to wait for the daemon to answer ``hello`` before saying it is not running
CONNECT_TIMEOUT = 1.0
#: after the daemon went away, how long the next call waits for a restarted daemon to answer
RECONNECT_TIMEOUT = 10.0
#: how long ``close()`` waits for the daemon to confirm that it ended the session
BYE_TIMEOUT = 1.0
#: shared-memory slots whose memory results returned by ``allreduce`` may hold at once; beyond
#: that a result is copied out of its slot (see ``_Slot.held``)
RESULT_SLOTS = 8


def _default_socket() -> str:
    env = os.environ.get("BIRDNET_SOCKET")
    if env:
        return env
    from birdnet.config import default_socket_path
    return default_socket_path()


class _Slot:
    """A shared-memory segment created by the daemon for this client, mapped here."""

    def __init__(self, slot: int, name: str, nbytes: int, path: str | None = None, inode: int | None = None,
                 fdsock: str | None = None, token: str | None = None) -> None:
        self.slot, self.name, self.nbytes = slot, name, nbytes
        #: a sealed memfd of the daemon (``/proc/<pid>/fd/<n>``, or fetched through ``fdsock`` by a
        #: process of another user), else the named file under /dev/shm
        self.path = path or fdsock or os.path.join("/dev/shm", name)
        try:
            fd = _fetch_memfd(fdsock, token) if fdsock and token else os.open(self.path, os.O_RDWR)
        except OSError as exc:
            raise DaemonUnavailableError(f"cannot open the shared memory birdnetd made for this process "
                                         f"({self.path}): {exc}; a process in another pid namespace or of "
                                         "another user needs birdnetd --shm-group") from None
        try:
            st = os.fstat(fd)
            if (inode is not None and st.st_ino != inode) or st.st_size < nbytes:
                raise DaemonUnavailableError(f"{self.path} is not the segment birdnetd made for this process")
            self.mmap = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self.busy = False
        # References to the mapping while no array views it: this object's attribute and
        # getrefcount's argument. Every NumPy array over the slot's memory (a result handed to the
        # caller, any view of it, a tensor made from it) leads to the mapping through its base.
        self._refs = sys.getrefcount(self.mmap)

    def held(self) -> bool:
        """True while an array over this slot's memory is alive (a result the caller still has):
        the slot must not take another call, which would overwrite that result."""
        return sys.getrefcount(self.mmap) > self._refs

    def view(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        n = int(np.prod(shape)) if shape else 1
        return np.frombuffer(self.mmap, dtype=dtype, count=n).reshape(shape)

    def close(self) -> None:
        try:
            self.mmap.close()
        except BufferError:
            pass  # arrays still reference it; the mapping goes with them


def _fetch_memfd(path: str, token: str, timeout: float = 5.0) -> int:
    """The sealed segment the daemon made for this process, passed over its side socket."""
    import socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.send(token.encode())
        _msg, fds, _flags, _addr = socket.recv_fds(s, 16, 1)
    if not fds:
        raise OSError(f"the daemon sent no descriptor through {path}")
    return fds[0]


class Handle:
    """An all-reduce in flight. ``wait()`` returns the result; ``stats`` then holds this node's
    figures of the round: ``bytes_sent`` / ``bytes_received`` at the transport, ``ratio`` (dense
    ring bytes / bytes sent), ``compress_seconds``, ``seconds`` (the data phase), ``cpu_seconds``
    (the daemon's CPU time in it, all threads), ``wait_seconds`` (from all local processes
    submitting to the data phase: the agreement), and ``t_ready`` / ``t_data`` / ``t_end``, the
    same moments on the machine's monotonic clock (``time.monotonic()``)."""

    def __init__(self, client: "Client", call: int, slot: _Slot | None, shape, dtype, out, name: str | None) -> None:
        self.client, self.call, self.slot = client, call, slot
        self.shape, self.dtype, self.out, self.name = shape, dtype, out, name
        self.stats: dict[str, Any] = {}
        self._result: Any = None
        self._done = False
        self.generation = client._generation  #: which connection to the daemon the call went out on

    @property
    def contributors(self) -> list[int] | None:
        """After ``wait()``: the node ranks whose processes contributed to the result (elastic mode,
        ``birdnetd --elastic``: the live ring of the round); None when the daemons do not report it."""
        c = self.stats.get("contributors")
        return list(c) if isinstance(c, list) else None

    def done(self) -> bool:
        """True once the result is available (does not block)."""
        if not self._done:
            self.client._pump(0.0)
        return self._done or self.call in self.client._replies

    def wait(self, timeout: float | None = None) -> np.ndarray | None:
        """Block until the result is there (``timeout`` seconds at most, else RoundTimeoutError)."""
        if self._done:
            return self._result
        try:
            reply = self.client._await(self.call, timeout, self.name, self.generation)
        except DaemonUnavailableError:
            self._done = True
            if self.slot is not None:
                self.slot.busy = False
            raise
        self._done = True
        if self.slot is not None:
            self.slot.busy = False
        if reply["t"] == "error":
            raise from_wire(reply)
        self.stats = dict(reply.get("stats") or {})
        warning = self.stats.get("warning")
        if isinstance(warning, str) and warning not in self.client._warned:
            self.client._warned.add(warning)
            warnings.warn(f"birdnet: {warning}", stacklevel=3)
        if self.slot is None:
            return None
        if self.out is not None:
            res = self.slot.view(self.shape, self.dtype)
            if not np.shares_memory(self.out, res):
                np.copyto(self.out, res)
            self._result = self.out
        elif self.client._may_hold(self.slot):
            # The result stays where the daemon wrote it, a new array over the slot: no copy out
            # (for 11.7M float32 a 47 MB copy into freshly faulted pages). The slot takes no other
            # call while the array or a view of it lives (_Slot.held): a training loop's previous
            # result is dropped by the next, so two slots take turns.
            self._result = self.slot.view(self.shape, self.dtype)
        else:
            self._result = self.slot.view(self.shape, self.dtype).copy()
        return self._result


class Client:
    """A training process's connection to its local daemon.

    Parameters
    ----------
    socket : str, optional
        The daemon's Unix socket (default: ``$BIRDNET_SOCKET``, else the daemon's default path).
    job : str
        The training run this process belongs to; all its processes use the same name.
    """

    def __init__(self, socket: str | None = None, job: str = "default", *,
                 connect_timeout: float = CONNECT_TIMEOUT, reconnect_timeout: float = RECONNECT_TIMEOUT) -> None:
        self.socket_path = socket or _default_socket()
        self.job = job
        self.connect_timeout = connect_timeout
        self.reconnect_timeout = reconnect_timeout
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._door: DoorReader | None = None  #: the result doorbell (birdnet.door), if the daemon gave one
        self._bell: BellWriter | None = None  #: the submit FIFO (birdnet.door), likewise
        self._poller = zmq.Poller()
        self._generation = 0  #: bumped on every (re)connection
        self._lost: str | None = None  #: why the connection to the daemon is gone, until reconnected
        self._stale: dict[int, _Slot] = {}  #: buffer() slots of an earlier daemon instance
        self._seq = 0
        self._calls = itertools.count(1)
        self._replies: dict[int, dict] = {}
        self._slots: dict[int, _Slot] = {}
        self._owned: dict[int, _Slot] = {}  # id(array) -> slot, for arrays from buffer()
        self._warned: set[str] = set()  #: the daemon's warnings already shown (each once)
        self._connect()

    # -- connection -------------------------------------------------------------------------------
    def _check_access(self) -> None:
        path = self.socket_path
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
                "(or `systemctl start birdnetd`), or pass socket=/ set BIRDNET_SOCKET to its --socket path") from None
        if not os.access(path, os.R_OK | os.W_OK):
            st = os.stat(path)
            raise AuthenticationError(
                f"permission denied on {path} (owner uid {st.st_uid}, group gid {st.st_gid}, mode "
                f"{st.st_mode & 0o777:o}): birdnetd serves only its own user and its --shm-group; run the "
                "training process as one of them")

    def _connect(self, timeout: float | None = None) -> None:
        """Connect and say hello; the daemon must answer within ``timeout`` (default connect_timeout)."""
        timeout = self.connect_timeout if timeout is None else timeout
        self._check_access()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # The monitor tells when the daemon's end of the socket closes (daemon killed or restarted);
        # without it a DEALER would silently reconnect and calls in flight would wait forever.
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(f"ipc://{self.socket_path}")
        self._sock = sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._lost = None
        self._send({"t": "hello", "proto": PROTOCOL_VERSION, "job": self.job, "pid": os.getpid(), "door": True})
        try:
            reply = self._recv(time.monotonic() + timeout)
        except RoundTimeoutError:
            self._close_socket()
            raise DaemonUnavailableError(
                f"birdnetd at {self.socket_path} did not answer within {timeout:.3g} s; is it running? "
                "(`birdnet status --socket PATH`; start it with `birdnetd --peers hosts.txt`)") from None
        except DaemonUnavailableError:
            self._close_socket()
            raise
        if reply["t"] == "error":
            self._close_socket()
            raise from_wire(reply)
        if isinstance(reply.get("door"), str) and isinstance(reply.get("bell"), str):
            try:
                self._door = DoorReader(reply["door"])
                self._bell = BellWriter(reply["bell"])
                self._poller.register(self._door.fd, zmq.POLLIN)
            except (OSError, ValueError):
                # calls and results go over the socket; calls do not announce the doorbell
                for d in (self._door, self._bell):
                    if d is not None:
                        d.close()
                self._door = self._bell = None
        self._generation += 1
        self.rank: int = reply["rank"]
        self.size: int = reply["size"]
        self.local_rank: int = reply["local_rank"]
        self.local_size: int = reply["local_size"]
        self.node: int = reply["node"]
        self.world: int = reply["world"]

    def _close_socket(self) -> None:
        if self._door is not None:
            self._door.close()
            self._door = None
        if self._bell is not None:
            self._bell.close()
            self._bell = None
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._sock.close(0)
            self._sock = None
        if self._monitor is not None:
            self._monitor.close(0)
            self._monitor = None

    def _send(self, header: dict[str, Any]) -> None:
        if self._sock is None:
            raise DaemonUnavailableError(f"client is not connected to birdnetd at {self.socket_path}"
                                         + (f" ({self._lost})" if self._lost else ""))
        self._sock.send_multipart(wire.encode(header))

    def _check_monitor(self) -> None:
        if self._monitor is None or self._lost:
            return
        while True:
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._lost = ("the daemon closed the connection (killed or restarted); calls in flight were lost, "
                          "the next call reconnects")

    def _gone(self) -> DaemonUnavailableError:
        return DaemonUnavailableError(f"birdnetd at {self.socket_path} went away: {self._lost}")

    def _recv(self, deadline: float | None) -> dict[str, Any]:
        if self._sock is None:
            raise DaemonUnavailableError(f"client is not connected to birdnetd at {self.socket_path}")
        door = self._door
        while True:
            if door is not None and door.pending:
                return door.pending.popleft()
            self._check_monitor()
            if self._lost:
                raise self._gone()
            wait = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            events = dict(self._poller.poll(int(wait * 1000) + 1))
            if door is not None and door.fd in events:
                door.read()
                if door.eof:  # the daemon closed its end: it exited (the monitor says so too)
                    self._poller.unregister(door.fd)
                    door.close()
                    self._door = door = None
                elif door.pending:
                    return door.pending.popleft()
            if self._sock in events:
                frames = self._sock.recv_multipart()
                try:
                    header, _ = wire.decode(frames, max_bytes=wire.MAX_HEADER_BYTES)
                except ProtocolError:
                    continue  # not from a birdnetd we understand; ignore rather than crash
                if header.get("t") == "error" and str(header.get("message", "")).startswith("no session"):
                    self._lost = "the daemon restarted and no longer knows this process; the next call reconnects"
                    raise self._gone()
                return header
            if self._monitor is not None and self._monitor in events:
                continue
            if deadline is not None and time.monotonic() >= deadline:
                raise RoundTimeoutError("timed out waiting for birdnetd")
            if deadline is None and not os.path.exists(self.socket_path):
                self._lost = "its socket file was removed"
                raise self._gone()

    def _reconnect(self) -> None:
        """After the daemon went away: connect to the (restarted) daemon, waiting up to
        ``reconnect_timeout``. Shared memory of the earlier daemon is dropped; arrays from
        :meth:`buffer` keep working (their results are copied back into them)."""
        why = self._lost
        self._close_socket()
        for _sid, s in self._slots.items():
            if s in self._owned.values():
                self._stale[id(s)] = s
            else:
                s.close()
        self._slots.clear()
        self._owned.clear()
        self._replies.clear()
        deadline = time.monotonic() + self.reconnect_timeout
        while True:
            try:
                # each attempt waits only for what is left of reconnect_timeout, so the call's whole
                # wait stays within it (a daemon still starting would otherwise add connect_timeout)
                self._connect(min(self.connect_timeout, max(0.2, deadline - time.monotonic())))
                return
            except DaemonUnavailableError as exc:
                if time.monotonic() >= deadline:
                    self._lost = why
                    raise DaemonUnavailableError(
                        f"birdnetd at {self.socket_path} went away ({why}) and no daemon answered within "
                        f"reconnect_timeout={self.reconnect_timeout} s: {exc}") from None
                time.sleep(0.2)

    def _ensure_connected(self) -> None:
        self._check_monitor()
        if self._lost or self._sock is None:
            self._reconnect()

    def _pump(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                h = self._recv(deadline)
            except RoundTimeoutError:
                return
            if isinstance(h.get("call"), int):
                self._replies[h["call"]] = h
            timeout = 0.0
            deadline = time.monotonic()

    def _await(self, call: int, timeout: float | None, name: str | None = None,
               generation: int | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while call not in self._replies:
            if generation is not None and generation != self._generation:
                raise DaemonUnavailableError(f"call for tensor {name!r} was lost: birdnetd at {self.socket_path} "
                                             "restarted while it was in flight")
            try:
                h = self._recv(deadline)
            except RoundTimeoutError:
                raise RoundTimeoutError(f"call for tensor {name!r} did not complete within {timeout} s") from None
            c = h.get("call")
            if isinstance(c, int):
                self._replies[c] = h
            elif h.get("t") == "error":
                raise from_wire(h)
        return self._replies.pop(call)

    def _request(self, header: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        """A synchronous request answered immediately (alloc, status)."""
        self._ensure_connected()
        call = next(self._calls)
        header = {**header, "call": call}
        self._send(header)
        reply = self._await(call, timeout, generation=self._generation)
        if reply["t"] == "error":
            raise from_wire(reply)
        return reply

    # -- shared memory ----------------------------------------------------------------------------
    def _may_hold(self, slot: _Slot) -> bool:
        """Whether a result may stay in ``slot`` (fewer than RESULT_SLOTS other slots hold one)."""
        owned = {id(o) for o in self._owned.values()}
        return sum(1 for s in self._slots.values()
                   if s is not slot and id(s) not in owned and s.held()) < RESULT_SLOTS

    def _slot_for(self, nbytes: int) -> _Slot:
        owned = {id(o) for o in self._owned.values()}
        for s in self._slots.values():
            if not s.busy and s.nbytes >= nbytes and id(s) not in owned and not s.held():
                s.busy = True
                return s
        free = [k for k, s in self._slots.items() if not s.busy and id(s) not in owned and not s.held()]
        slot_id = free[0] if free else len(self._slots)
        if slot_id in self._slots:
            self._slots[slot_id].close()
        reply = self._request({"t": "alloc", "slot": slot_id, "nbytes": int(nbytes)})
        s = _Slot(slot_id, reply["name"], reply["nbytes"], reply.get("path"), reply.get("inode"),
                  reply.get("fdsock"), reply.get("token"))
        self._slots[slot_id] = s
        s.busy = True
        return s

    def buffer(self, shape, dtype=np.float32) -> np.ndarray:
        """A shared-memory-backed array: fill it and pass it to ``allreduce`` to skip the copy in;
        the result is written back into it."""
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in np.atleast_1d(np.asarray(shape, dtype=np.int64))) if not isinstance(shape, tuple) else shape
        nbytes = int(np.prod(shape)) * dtype.itemsize if shape else dtype.itemsize
        s = self._slot_for(nbytes)
        s.busy = False
        arr = s.view(shape, dtype)
        self._owned[id(s)] = s
        return arr

    def _owner_slot(self, array: np.ndarray) -> _Slot | None:
        for s in self._owned.values():
            if np.shares_memory(array, np.frombuffer(s.mmap, dtype=np.uint8)):
                base = np.frombuffer(s.mmap, dtype=np.uint8)
                if array.__array_interface__["data"][0] == base.__array_interface__["data"][0] and array.flags.c_contiguous:
                    return s
        return None

    def _stale_slot(self, array: np.ndarray) -> _Slot | None:
        for s in self._stale.values():
            base = np.frombuffer(s.mmap, dtype=np.uint8)
            if np.shares_memory(array, base) and array.flags.c_contiguous:
                return s
        return None

    # -- collectives ------------------------------------------------------------------------------
    def allreduce(self, array, *, op: str = "mean", name: str | None = None, timeout: float | None = None,
                  codec: str | None = None, **codec_params: Any) -> np.ndarray:
        """Average (``op="mean"``) or sum (``op="sum"``) ``array`` over all processes of the job.

        Returns a new array of the same shape and dtype (float16 is reduced in float32; float64 in
        float64). ``codec`` and its parameters (e.g. ``codec="birdplus", density=0.01``) override the
        cluster default for this call. Stateful codecs (error feedback) need a stable ``name`` per
        tensor, the same every step: with ``codec=`` one and no name the call raises InputError; under
        the daemon's default codec an unnamed call runs without error feedback (a warning says so once).
        """
        return self.allreduce_async(array, op=op, name=name, codec=codec, **codec_params).wait(timeout)

    def allreduce_async(self, array, *, op: str = "mean", name: str | None = None, codec: str | None = None,
                        **codec_params: Any) -> Handle:
        """Start an all-reduce and return a :class:`Handle`; the array may be reused once
        this returns (its contents were copied into shared memory)."""
        return self._collective("allreduce", array, op=op, name=name, codec=codec, params=codec_params)

    def broadcast(self, array, root: int = 0, *, name: str | None = None, timeout: float | None = None) -> np.ndarray:
        """``array`` of process ``root`` on every process (so training starts from identical parameters)."""
        return self._collective("broadcast", array, root=root, name=name).wait(timeout)

    def barrier(self, timeout: float | None = None) -> None:
        """Return once every process of the job has called ``barrier``."""
        self._collective("barrier", None).wait(timeout)

    def reset_state(self, timeout: float | None = None) -> None:
        """Drop the daemons' codec state (error feedback, compensation) for this job on every node.
        A collective call: every process of the job calls it (e.g. after restoring a checkpoint)."""
        self._collective("reset", None).wait(timeout)

    def _collective(self, kind: str, array, *, op: str = "mean", name: str | None = None, codec: str | None = None,
                    params: dict[str, Any] | None = None, root: int = 0) -> Handle:
        self._ensure_connected()
        seq = self._seq
        header: dict[str, Any] = {"t": "submit", "seq": seq, "kind": kind}
        if self._door is not None:
            header["door"] = True  # its end is open: the daemon may hand the result back that way
        slot = None
        out = None
        shape: tuple[int, ...] = ()
        dtype = np.dtype(np.float32)
        if array is not None:
            if not isinstance(array, np.ndarray):
                array = np.asarray(array)
            if array.dtype == object or array.dtype.kind not in "fiu":
                raise InputError(f"cannot reduce an array of dtype {array.dtype}; pass a numeric NumPy array "
                                 "(float16/32/64, or int32/int64 with op='sum')")
            shape, dtype = tuple(array.shape), array.dtype
            owned = self._owner_slot(array)
            stale = self._stale_slot(array) if owned is None and self._stale else None
            if stale is not None:  # a buffer() of an earlier daemon: copy in, copy the result back
                slot, out = self._slot_for(max(array.nbytes, 1)), array
                np.copyto(slot.view(shape, dtype), array)
            elif owned is not None:
                slot, out = owned, array
                if slot.busy:
                    raise InputError("this shared-memory buffer is already in a call in flight")
                slot.busy = True
            else:
                slot = self._slot_for(max(array.nbytes, 1))
                np.copyto(slot.view(shape, dtype), array)  # the one copy into shared memory
            if name is not None and name.startswith("anonymous/"):
                raise InputError(f"tensor name {name!r}: names starting with 'anonymous/' are reserved for calls "
                                 "without name=; choose another")
            # Without a name a call cannot say which tensor it is: its name is unique, and a
            # stateful codec keeps no state for it (the daemon refuses codec= with one, and warns
            # when its default codec is one; docs/architecture.md "Tensor names and codec state")
            tensor = name if name is not None else f"anonymous/{seq}"
            header.update(name=tensor, shape=list(shape), dtype=dtype.name, slot=slot.slot, op=op, root=root)
            if codec is not None:
                header["codec"] = codec
                header["params"] = dict(params or {})
            elif params:
                raise InputError(f"codec parameters {sorted(params)} given without codec=")
        call = next(self._calls)
        header["call"] = call
        self._seq += 1
        try:
            # the submit FIFO when there is one and it takes the call; else (too large, full) the socket
            if self._bell is None or not self._bell.send(header):
                self._send(header)
        except BaseException:
            if slot is not None:
                slot.busy = False
            raise
        return Handle(self, call, slot, shape, dtype, out, name)

    @property
    def connected(self) -> bool:
        """False once the daemon went away (the next call reconnects)."""
        self._check_monitor()
        return self._sock is not None and not self._lost

    def status(self) -> dict[str, Any]:
        """The daemon's status (the same figures as ``birdnet status --json``)."""
        return self._request({"t": "status"})["status"]

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self._sock is not None and not self._lost:
            # Wait for the answer: the socket is closed without lingering, which could drop an
            # unanswered bye, and a process of the job started right after this one exits would
            # then find its place taken until the daemon noticed the exit (up to a second later).
            try:
                call = next(self._calls)
                self._send({"t": "bye", "call": call})
                self._await(call, BYE_TIMEOUT)
            except (zmq.ZMQError, BirdnetError):
                pass
        self._close_socket()
        for s in self._slots.values():
            s.close()
        self._slots.clear()
        self._owned.clear()
        self._stale.clear()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
