"""The client library training code imports: ``from birdnet.client import Client``.

It talks to the local ``birdnetd`` over a Unix socket (ZeroMQ ``ipc://``) and hands tensors over
through shared memory that the daemon creates; the client only attaches. It imports NumPy, pyzmq
and msgpack, never Numba.

Example::

    from birdnet.client import Client
    with Client(job="resnet") as client:
        params = client.broadcast(params, root=0)      # start from identical parameters
        grad = client.allreduce(grad, name="layer1.w")  # mean over all processes of the job

This module is the API (``Client``, ``Handle``); beside it ``_connection.py`` (the socket, the hello,
the doorbells, and how a lost daemon shows), ``_slots.py`` (the shared-memory slots, on
``birdnet.shm.Segment``) and ``_replies.py`` (the reply pump: answers filed by call number).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq
from birdnet.client._connection import Connection
from birdnet.client._connection import default_socket as _default_socket
from birdnet.client._replies import Replies
from birdnet.client._slots import (
    RESULT_SLOTS,  # noqa: F401 - public: birdnet.client.RESULT_SLOTS
    Slot,
    SlotPool,
)

from birdnet.errors import (
    BirdnetError,
    DaemonUnavailableError,
    InputError,
    PeerLostError,
    ProcessLostError,
    RoundMismatchError,
    RoundTimeoutError,
    ShutdownError,
    from_wire,
)
from birdnet.requests import (
    ANONYMOUS_PREFIX,
    FLOAT_DTYPES,
    INT_DTYPES,
    Alloc,
    Bye,
    Request,
    Status,
    Submit,
    Warm,
    anonymous_name,
)

__all__ = ["Client", "Handle", "BirdnetError", "OuterLoop"]


def __getattr__(name: str) -> Any:
    # the slow-link mode's outer loop imports this module: loaded on first use
    if name == "OuterLoop":
        from birdnet.client.diloco import OuterLoop
        return OuterLoop
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: how long to wait for the daemon to answer ``hello`` before saying it is not running. A missing
#: socket fails at once (check_access); one that exists belongs to a daemon that may be busy for
#: a moment (loading a codec's kernels, a loaded board), which at 1 s failed a second job's
#: processes joining while a first job ran its first compressed round
CONNECT_TIMEOUT = 5.0
#: after the daemon went away, how long the next call waits for a restarted daemon to answer
RECONNECT_TIMEOUT = 10.0
#: how long ``close()`` waits for the daemon to confirm that it ended the session
BYE_TIMEOUT = 1.0
#: how long :meth:`Client.recover` keeps trying by default (a stopped node back, a daemon restarted)
RECOVER_TIMEOUT = 120.0
#: errors after which :meth:`Client.recover` tries again: the ring, a daemon or the numbering of the
#: job's calls was not whole yet (a lost process is not among them: its job must be restarted)
_RECOVERABLE = (PeerLostError, RoundTimeoutError, RoundMismatchError, DaemonUnavailableError, ShutdownError)


def _check_dtype(kind: str, dtype: np.dtype, op: str, name: str | None) -> None:
    """The daemons' dtype rule, said with what to pass instead (a fix-it message, before any round)."""
    what = f"tensor {name!r}" if name is not None else "the array"
    if dtype.name in FLOAT_DTYPES or (dtype.name in INT_DTYPES and (kind != "allreduce" or op == "sum")):
        return
    if dtype.name in INT_DTYPES:
        raise InputError(f"{what} is {dtype.name}: integers are reduced with op='sum' only (op={op!r} would "
                         "divide); pass op='sum', or cast to float32 for a mean: array.astype(np.float32)")
    if dtype.kind in "iub":
        raise InputError(f"{what} is {dtype.name}, which birdnet does not reduce (it takes float16, float32, "
                         "float64, and int32/int64 with op='sum'); cast it: array.astype(np.float32), or "
                         "array.astype(np.int64) with op='sum' for an exact integer sum")
    raise InputError(f"{what} has dtype {dtype}, which birdnet does not reduce; pass a float32 array "
                     "(array.astype(np.float32)), or float16/float64, or int32/int64 with op='sum'")


def _retry_recoverable(attempt: Callable[[], None], deadline: float, *, pause: float) -> int:
    """Run ``attempt`` until it succeeds, again after each error the ring recovers from
    (``_RECOVERABLE``) until ``deadline``; a lost process of the job is raised at once (its job must
    be restarted). Returns the number of attempts."""
    attempts = 0
    while True:
        attempts += 1
        try:
            attempt()
            return attempts
        except ProcessLostError:
            raise
        except _RECOVERABLE:
            if time.monotonic() >= deadline:
                raise
            time.sleep(pause)


class Handle:
    """An all-reduce in flight. ``wait()`` returns the result; ``stats`` then holds this node's
    figures of the round: ``bytes_sent`` / ``bytes_received`` at the transport, ``ratio`` (dense
    ring bytes / bytes sent), ``compress_seconds``, ``seconds`` (the data phase), ``cpu_seconds``
    (the daemon's CPU time in it, all threads), ``wait_seconds`` (from all local processes
    submitting to the data phase: the agreement), and ``t_ready`` / ``t_data`` / ``t_end``, the
    same moments on the machine's monotonic clock (``time.monotonic()``)."""

    def __init__(self, client: "Client", call: int, slot: Slot | None, shape, dtype, out, name: str | None) -> None:
        self.client, self.call, self.slot = client, call, slot
        self.shape, self.dtype, self.out, self.name = shape, dtype, out, name
        self.stats: dict[str, Any] = {}
        self._result: Any = None
        self._done = False
        self.generation = client._conn.generation  #: which connection to the daemon the call went out on

    @property
    def contributors(self) -> list[int] | None:
        """After ``wait()``: the node ranks whose processes contributed to the result (elastic mode,
        ``birdnetd --elastic``: the live ring of the round); None when the daemons do not report it."""
        c = self.stats.get("contributors")
        return list(c) if isinstance(c, list) else None

    def done(self) -> bool:
        """True once the result is available (does not block)."""
        if not self._done:
            self.client._replies.pump(0.0)
        return self._arrived()

    def _arrived(self) -> bool:
        # without reading anything: for a thread that pumps the replies itself (torch_dist)
        return self._done or self.client._replies.arrived(self.call)

    def _release(self) -> None:
        # the call is over (or lost with the daemon): its slot may take another
        if self.slot is not None:
            self.slot.busy = False

    def wait(self, timeout: float | None = None) -> np.ndarray | None:
        """Block until the result is there (``timeout`` seconds at most, else RoundTimeoutError)."""
        if self._done:
            return self._result
        try:
            reply = self.client._replies.wait(self.call, timeout, self.name, self.generation)
        except DaemonUnavailableError:
            self._done = True
            self._release()
            raise
        self._done = True
        self._release()
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
        elif self.client._pool.may_hold(self.slot):
            # The result stays where the daemon wrote it, a new array over the slot: no copy out
            # (for 11.7M float32 a 47 MB copy into freshly faulted pages). The slot takes no other
            # call while the array or a view of it lives (Slot.held): a training loop's previous
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
    local_rank : int, optional
        This process's place among the job's processes on this node (``0 .. --local-size - 1``), for
        example a launcher's ``LOCAL_RANK``; the daemon refuses it, naming the holder, when another
        live process of the job has it. None (the default): the lowest free one, so with
        ``--local-size > 1`` local ranks follow the order in which processes connect.
    """

    #: the connection's class (tests replace it with one that sends what an older client would)
    _Connection = Connection

    def __init__(self, socket: str | None = None, job: str = "default", *,
                 connect_timeout: float = CONNECT_TIMEOUT, reconnect_timeout: float = RECONNECT_TIMEOUT,
                 local_rank: int | None = None) -> None:
        if local_rank is not None and (isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0):
            raise InputError(f"local_rank={local_rank!r}: expected a non-negative int (0 .. birdnetd's --local-size - 1) "
                             "or None for the lowest free one")
        self.socket_path = socket or _default_socket()
        self.job = job
        self.connect_timeout = connect_timeout
        self.reconnect_timeout = reconnect_timeout
        self._conn = self._Connection(self.socket_path, job, local_rank)
        self._replies = Replies(self._conn)
        self._pool = SlotPool(self._alloc)
        self._seq = 0
        self._calls = itertools.count(1)
        #: (codec, parameters) already checked by birdnet.codecs.validate in this process
        self._valid_codecs: set[tuple[str, str]] = set()
        self._warned: set[str] = set()  #: the daemon's warnings already shown (each once)
        self._connect()

    # -- connection -------------------------------------------------------------------------------
    def _connect(self, timeout: float | None = None) -> None:
        """Connect and say hello; the daemon must answer within ``timeout`` (default connect_timeout)."""
        welcome = self._conn.connect(self.connect_timeout if timeout is None else timeout)
        self.rank: int = welcome["rank"]
        self.size: int = welcome["size"]
        self.local_rank: int = welcome["local_rank"]
        self.local_size: int = welcome["local_size"]
        self.node: int = welcome["node"]
        self.world: int = welcome["world"]

    def _reconnect(self) -> None:
        """After the daemon went away: connect to the (restarted) daemon, waiting up to
        ``reconnect_timeout``. Shared memory of the earlier daemon is dropped; arrays from
        :meth:`buffer` keep working (their results are copied back into them)."""
        why = self._conn.lost
        self._conn.close()
        self._pool.drop()
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
                    self._conn.lost = why
                    raise DaemonUnavailableError(
                        f"birdnetd at {self.socket_path} went away ({why}) and no daemon answered within "
                        f"reconnect_timeout={self.reconnect_timeout} s: {exc}") from None
                time.sleep(0.2)

    def _ensure_connected(self) -> None:
        if not self._conn.alive:
            self._reconnect()

    def _request(self, request: Request, timeout: float = 10.0) -> dict[str, Any]:
        """A synchronous request answered immediately (alloc, status, warm)."""
        self._ensure_connected()
        call = next(self._calls)
        self._conn.send(dataclasses.replace(request, call=call).header())
        reply = self._replies.wait(call, timeout, generation=self._conn.generation)
        if reply["t"] == "error":
            raise from_wire(reply)
        return reply

    def _alloc(self, slot: int, nbytes: int) -> dict[str, Any]:
        return self._request(Alloc(slot=slot, nbytes=nbytes))

    # -- shared memory ----------------------------------------------------------------------------
    def buffer(self, shape, dtype=np.float32) -> np.ndarray:
        """A shared-memory-backed array: fill it and pass it to ``allreduce`` to skip the copy in;
        the result is written back into it."""
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in np.atleast_1d(np.asarray(shape, dtype=np.int64))) if not isinstance(shape, tuple) else shape
        return self._pool.buffer(shape, dtype)

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
        """Submit one collective call and return its handle (also birdnet.client.torch_dist's way in)."""
        self._ensure_connected()
        seq = self._seq
        tensor: dict[str, Any] = {}  # the submit's tensor fields, for a call that carries an array
        slot = None
        out = None
        shape: tuple[int, ...] = ()
        dtype = np.dtype(np.float32)
        if codec is not None:
            self._check_codec(codec, params)
        if array is not None:
            if not isinstance(array, np.ndarray):
                array = np.asarray(array)
            _check_dtype(kind, array.dtype, op, name)
            shape, dtype = tuple(array.shape), array.dtype
            pool = self._pool
            owned = pool.owner_of(array)
            stale = pool.stale_of(array) if owned is None and pool.stale else None
            if stale is not None:  # a buffer() of an earlier daemon: copy in, copy the result back
                slot, out = pool.take(max(array.nbytes, 1)), array
                np.copyto(slot.view(shape, dtype), array)
            elif owned is not None:
                slot, out = owned, array
                if slot.busy:
                    raise InputError("this shared-memory buffer is already in a call in flight")
                slot.busy = True
            else:
                slot = pool.take(max(array.nbytes, 1))
                np.copyto(slot.view(shape, dtype), array)  # the one copy into shared memory
            if name is not None and name.startswith(ANONYMOUS_PREFIX):
                raise InputError(f"tensor name {name!r}: names starting with {ANONYMOUS_PREFIX!r} are reserved for "
                                 "calls without name=; choose another")
            # Without a name a call cannot say which tensor it is: its name is unique, and a
            # stateful codec keeps no state for it (the daemon refuses codec= with one, and warns
            # when its default codec is one; docs/architecture.md "Tensor names and codec state")
            tensor = dict(name=name if name is not None else anonymous_name(seq), shape=list(shape),
                          dtype=dtype.name, slot=slot.slot, op=op, root=root)
            if codec is not None:
                tensor.update(codec=codec, params=dict(params or {}))
            elif params:
                raise InputError(f"codec parameters {sorted(params)} given without codec=")
        call = next(self._calls)
        # door: its end is open, the daemon may hand the result back that way
        request = Submit(seq=seq, kind=kind, call=call, door=self._conn.door is not None, **tensor)
        self._seq += 1
        try:
            self._conn.submit(request.header())
        except BaseException:
            if slot is not None:
                slot.busy = False
            raise
        return Handle(self, call, slot, shape, dtype, out, name)

    def _check_codec(self, codec: str, params: dict[str, Any] | None) -> None:
        """The daemons' own check of a codec and its parameters (birdnet.codecs.validate), once per
        configuration: a bad one fails here, before any round, with the daemon's message."""
        try:
            key = (codec, repr(sorted((params or {}).items())))
        except TypeError:  # keys of mixed types: validate() names the problem
            key = None
        if key is not None and key in self._valid_codecs:
            return
        from birdnet.codecs import validate
        validate(codec, params)
        if key is not None and len(self._valid_codecs) < 256:
            self._valid_codecs.add(key)

    def recover(self, arrays=(), *, root: int = 0, timeout: float = RECOVER_TIMEOUT) -> int:
        """After a failed call: wait until the ring is whole again, then make ``arrays`` identical on
        every process of the job, in place (process ``root``'s values, rank 0 by default: the lowest
        rank, present on the fixed ring whenever any call can run). A collective: every process of
        the job calls it, with the same arrays' shapes and dtypes, e.g. ::

            try:
                grad = client.allreduce(grad, name="w")
            except (PeerLostError, RoundTimeoutError):
                client.recover([weights, momentum])   # identical replicas again
                continue

        A failed call failed on every process (rounds are all-or-nothing), so the replicas differ
        only by what each process did locally after the error; this puts them back. Calls that fail
        while the ring is still broken are tried again until ``timeout`` (s); the job's call numbers
        realign by themselves (a call that already ended on some node fails at once there). Returns
        the number of attempts. Raises :class:`ProcessLostError` at once (a process of the job is
        gone: restart the job's processes) and the last error after ``timeout``."""
        deadline = time.monotonic() + timeout

        def attempt() -> None:
            self._wait_ring(deadline)
            left = max(1.0, deadline - time.monotonic())
            for i, a in enumerate(arrays):
                if not isinstance(a, np.ndarray):
                    raise InputError(f"recover: arrays[{i}] is a {type(a).__name__}, not a NumPy array")
                np.copyto(a, self.broadcast(a, root=root, name=f"birdnet.recover/{i}", timeout=left))
            self.barrier(timeout=left)  # every process is out of its earlier calls
        return _retry_recoverable(attempt, deadline, pause=0.1)

    def _wait_ring(self, deadline: float) -> None:
        """Until this node's daemon reports no peer lost (or ``deadline``, then the next call says why)."""
        while time.monotonic() < deadline:
            try:
                peers = self.status().get("peers") or []
            except (DaemonUnavailableError, RoundTimeoutError):
                time.sleep(0.2)
                continue
            if not any(isinstance(p, dict) and p.get("state") in ("lost", "refused", "connecting") for p in peers):
                return
            time.sleep(0.1)

    @property
    def connected(self) -> bool:
        """False once the daemon went away (the next call reconnects)."""
        return self._conn.alive

    def status(self) -> dict[str, Any]:
        """The daemon's status (the same figures as ``birdnet status --json``)."""
        return self._request(Status())["status"]

    def warm(self, codec: str, **codec_params: Any) -> bool:
        """Have the local daemon load ``codec``'s kernels (for these parameters) now, in the
        background, so the first call with it does not wait for them (about a second from the
        on-disk cache, longer when they must be compiled). Returns at once: True when they are
        loaded already. Calls with a codec whose kernels are not loaded wait for them whether or
        not this was called; the PyTorch adapter calls it for the codec it switches to after its
        dense warm-up. Raises :class:`InputError` for an unknown codec."""
        return bool(self._request(Warm(codec=codec, params=dict(codec_params)))["ready"])

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is None:  # __init__ failed before the connection existed
            return
        if conn.sock is not None and not conn.lost:
            # Wait for the answer: the socket is closed without lingering, which could drop an
            # unanswered bye, and a process of the job started right after this one exits would
            # then find its place taken until the daemon noticed the exit (up to a second later).
            try:
                call = next(self._calls)
                conn.send(Bye(call=call).header())
                self._replies.wait(call, BYE_TIMEOUT)
            except (zmq.ZMQError, BirdnetError):
                pass
        conn.close()
        self._pool.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
