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
import time
from typing import Any

import numpy as np
import zmq

from birdnet import PROTOCOL_VERSION, wire
from birdnet.errors import (BirdnetError, DaemonUnavailableError, InputError, ProtocolError,
                            RoundTimeoutError, from_wire)

__all__ = ["Client", "Handle", "BirdnetError"]

#: how long to wait for the daemon to answer ``hello`` before saying it is not running
CONNECT_TIMEOUT = 1.0


def _default_socket() -> str:
    env = os.environ.get("BIRDNET_SOCKET")
    if env:
        return env
    from birdnet.config import default_socket_path
    return default_socket_path()


class _Slot:
    """A shared-memory segment created by the daemon for this client, mapped here."""

    def __init__(self, slot: int, name: str, nbytes: int) -> None:
        self.slot, self.name, self.nbytes = slot, name, nbytes
        fd = os.open(os.path.join("/dev/shm", name), os.O_RDWR)
        try:
            self.mmap = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self.busy = False

    def view(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        n = int(np.prod(shape)) if shape else 1
        return np.frombuffer(self.mmap, dtype=dtype, count=n).reshape(shape)

    def close(self) -> None:
        try:
            self.mmap.close()
        except BufferError:
            pass  # arrays still reference it; the mapping goes with them


class Handle:
    """An all-reduce in flight. ``wait()`` returns the result; ``stats`` then holds the round's
    figures (bytes sent and received at the transport, compression ratio, compress time)."""

    def __init__(self, client: "Client", call: int, slot: _Slot | None, shape, dtype, out, name: str | None) -> None:
        self.client, self.call, self.slot = client, call, slot
        self.shape, self.dtype, self.out, self.name = shape, dtype, out, name
        self.stats: dict[str, Any] = {}
        self._result: Any = None
        self._done = False

    def done(self) -> bool:
        """True once the result is available (does not block)."""
        if not self._done:
            self.client._pump(0.0)
        return self._done or self.call in self.client._replies

    def wait(self, timeout: float | None = None) -> np.ndarray | None:
        """Block until the result is there (``timeout`` seconds at most, else RoundTimeoutError)."""
        if self._done:
            return self._result
        reply = self.client._await(self.call, timeout, self.name)
        self._done = True
        if self.slot is not None:
            self.slot.busy = False
        if reply["t"] == "error":
            raise from_wire(reply)
        self.stats = dict(reply.get("stats") or {})
        if self.slot is None:
            return None
        res = self.slot.view(self.shape, self.dtype)
        if self.out is not None:
            if not np.shares_memory(self.out, res):
                np.copyto(self.out, res)
            self._result = self.out
        else:
            self._result = res.copy()
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
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.socket_path = socket or _default_socket()
        self.job = job
        self.connect_timeout = connect_timeout
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._seq = 0
        self._calls = itertools.count(1)
        self._replies: dict[int, dict] = {}
        self._slots: dict[int, _Slot] = {}
        self._owned: dict[int, _Slot] = {}  # id(array) -> slot, for arrays from buffer()
        self._connect()

    # -- connection -------------------------------------------------------------------------------
    def _connect(self) -> None:
        if not os.path.exists(self.socket_path):
            raise DaemonUnavailableError(
                f"no birdnetd at {self.socket_path}: start it with `birdnetd --peers hosts.txt` "
                "(or `systemctl start birdnetd`), or pass socket=/ set BIRDNET_SOCKET to its --socket path")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{self.socket_path}")
        self._sock = sock
        self._send({"t": "hello", "proto": PROTOCOL_VERSION, "job": self.job, "pid": os.getpid()})
        try:
            reply = self._recv(time.monotonic() + self.connect_timeout)
        except RoundTimeoutError:
            self._close_socket()
            raise DaemonUnavailableError(
                f"birdnetd at {self.socket_path} did not answer within {self.connect_timeout} s; is it running? "
                "(`birdnet status --socket PATH`; start it with `birdnetd --peers hosts.txt`)") from None
        if reply["t"] == "error":
            self._close_socket()
            raise from_wire(reply)
        self.rank: int = reply["rank"]
        self.size: int = reply["size"]
        self.local_rank: int = reply["local_rank"]
        self.local_size: int = reply["local_size"]
        self.node: int = reply["node"]
        self.world: int = reply["world"]

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def _send(self, header: dict[str, Any]) -> None:
        if self._sock is None:
            raise DaemonUnavailableError("client is closed")
        self._sock.send_multipart(wire.encode(header))

    def _recv(self, deadline: float | None) -> dict[str, Any]:
        assert self._sock is not None
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if wait is not None and not self._sock.poll(int(wait * 1000) + 1):
                raise RoundTimeoutError("timed out waiting for birdnetd")
            if wait is None and not self._sock.poll(1000):
                if not os.path.exists(self.socket_path):
                    raise DaemonUnavailableError(f"birdnetd at {self.socket_path} went away")
                continue
            frames = self._sock.recv_multipart()
            header, _ = wire.decode(frames, max_bytes=wire.MAX_HEADER_BYTES)
            return header

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

    def _await(self, call: int, timeout: float | None, name: str | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while call not in self._replies:
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
        call = next(self._calls)
        header = {**header, "call": call}
        self._send(header)
        reply = self._await(call, timeout)
        if reply["t"] == "error":
            raise from_wire(reply)
        return reply

    # -- shared memory ----------------------------------------------------------------------------
    def _slot_for(self, nbytes: int) -> _Slot:
        for s in self._slots.values():
            if not s.busy and s.nbytes >= nbytes and id(s) not in {id(o) for o in self._owned.values()}:
                s.busy = True
                return s
        free = [k for k, s in self._slots.items() if not s.busy and s not in self._owned.values()]
        slot_id = free[0] if free else len(self._slots)
        if slot_id in self._slots:
            self._slots[slot_id].close()
        reply = self._request({"t": "alloc", "slot": slot_id, "nbytes": int(nbytes)})
        s = _Slot(slot_id, reply["name"], reply["nbytes"])
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

    # -- collectives ------------------------------------------------------------------------------
    def allreduce(self, array, *, op: str = "mean", name: str | None = None, timeout: float | None = None,
                  codec: str | None = None, **codec_params: Any) -> np.ndarray:
        """Average (``op="mean"``) or sum (``op="sum"``) ``array`` over all processes of the job.

        Returns a new array of the same shape and dtype (float16 is reduced in float32; float64 in
        float64). ``codec`` and its parameters (e.g. ``codec="birdplus", density=0.01``) override the
        cluster default for this call; stateful codecs need a stable ``name`` per tensor.
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
        seq = self._seq
        header: dict[str, Any] = {"t": "submit", "seq": seq, "kind": kind}
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
            if owned is not None:
                slot, out = owned, array
                if slot.busy:
                    raise InputError("this shared-memory buffer is already in a call in flight")
                slot.busy = True
            else:
                slot = self._slot_for(max(array.nbytes, 1))
                np.copyto(slot.view(shape, dtype), array)  # the one copy into shared memory
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
            self._send(header)
        except BaseException:
            if slot is not None:
                slot.busy = False
            raise
        return Handle(self, call, slot, shape, dtype, out, name)

    def status(self) -> dict[str, Any]:
        """The daemon's status (the same figures as ``birdnet status --json``)."""
        return self._request({"t": "status"})["status"]

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self._sock is not None:
            try:
                self._send({"t": "bye"})
            except (zmq.ZMQError, BirdnetError):
                pass
        self._close_socket()
        for s in self._slots.values():
            s.close()
        self._slots.clear()
        self._owned.clear()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
