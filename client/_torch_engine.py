"""The thread that owns a job's client for birdnet.client.torch_dist, and how tensors are staged.

A ``Client`` is not thread-safe and DDP waits for its buckets' futures inside C++, so something
other than the training thread must complete them. Each job's connection to the daemon is owned by
one thread (``_Engine``, named ``birdnet-torch``): a collective queues a request and wakes the
thread through a pipe; the thread submits it (the one copy into shared memory), polls the daemon's
socket, its result doorbell and the wake pipe together, and completes the request's
``torch.futures.Future`` when the result is back (the copy out, straight into the tensor). That
is the same hand-off Gloo makes to its worker threads.

The engine reaches the client through its small internal interface: ``Client._collective`` (submit
one call), ``Client._replies`` (the reply pump: ``pollables``, ``read_door``, ``pump``) and
``Handle._arrived`` / ``Handle._release``.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import zmq
from birdnet.client import Client, Handle
from birdnet.client._connection import default_socket
from birdnet.client._torch_dtypes import NATIVE, wire_dtype
from torch.futures import Future

from birdnet.errors import BirdnetError, DaemonUnavailableError, InputError, RoundTimeoutError


# -- the thread that owns a job's client ----------------------------------------------------------
@dataclasses.dataclass
class _Request:
    start: Callable[[Client], Handle]        #: runs on the engine thread: submits, returns the handle
    finish: Callable[[Handle], Any]           #: runs there once the result is back: the future's value
    future: Future
    what: str
    deadline: float | None
    handle: Handle | None = None


class _Engine:
    """One client, driven by one thread; collectives are queued to it and complete futures."""

    def __init__(self, client: Client, timeout: float | None = None) -> None:
        self.client = client
        self.timeout = timeout
        self._queue: collections.deque[_Request] = collections.deque()
        self._inflight: list[_Request] = []
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._closing = False
        self.users = 0  #: HookStates that made this engine and close it (HookState.close)
        self._idle_poller = zmq.Poller()
        self._idle_poller.register(self._rfd, zmq.POLLIN)
        self._thread = threading.Thread(target=self._run, name="birdnet-torch", daemon=True)
        self._thread.start()

    def submit(self, start, finish, what: str, timeout: float | None = None) -> Future:
        if self._closing:
            raise DaemonUnavailableError(f"{what}: the birdnet process group was destroyed")
        timeout = self.timeout if timeout is None else timeout
        fut: Future = Future()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._queue.append(_Request(start, finish, fut, what, deadline))
        self._wake()
        return fut

    def _start_queued(self) -> None:
        while self._queue:
            req = self._queue.popleft()
            try:
                req.handle = req.start(self.client)
            except BaseException as exc:  # noqa: BLE001 - the caller hears it through its future
                req.future.set_exception(exc)
                continue
            self._inflight.append(req)

    def _wake(self) -> None:
        try:
            os.write(self._wfd, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the thread is awake anyway

    def close(self, close_client: bool = True) -> None:
        """Finish what is queued and in flight, then stop the thread (and close the client)."""
        if self._closing:
            return
        self._closing = True
        self._wake()
        self._thread.join(60)
        os.close(self._rfd)
        os.close(self._wfd)
        if close_client:
            self.client.close()

    # -- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._start_queued()
            self._finish_ready()
            if self._closing and not self._queue and not self._inflight:
                return
            if self._inflight:
                self._poll_daemon()
                continue
            if dict(self._idle_poller.poll(1000)).get(self._rfd):
                self._drain_pipe()

    def _drain_pipe(self) -> None:
        try:
            while os.read(self._rfd, 4096):
                pass
        except BlockingIOError:
            pass

    def _poll_daemon(self) -> None:
        replies = self.client._replies
        poller = zmq.Poller()
        poller.register(self._rfd, zmq.POLLIN)
        daemon = replies.pollables()
        for s in daemon:
            poller.register(s, zmq.POLLIN)
        wait = 1.0
        deadlines = [r.deadline for r in self._inflight if r.deadline is not None]
        if deadlines:
            wait = max(0.0, min(wait, min(deadlines) - time.monotonic()))
        events = dict(poller.poll(int(wait * 1000) + 1))
        if self._rfd in events:
            self._drain_pipe()
        door = replies.door_fd
        door_ended = door is not None and door in events and replies.read_door()
        if any(s in events for s in daemon if s is not door) or not events or door_ended:
            try:
                replies.pump(0.0)  # the socket and the monitor: errors, results too big for the doorbell, a lost daemon
            except BirdnetError as exc:
                self._fail_all(exc)
        self._expire()

    def _finish_ready(self) -> None:
        keep = []
        for req in self._inflight:
            h = req.handle
            if h is not None and h._arrived():
                try:
                    req.future.set_result(req.finish(h))
                except BaseException as exc:  # noqa: BLE001
                    if not req.future.done():
                        req.future.set_exception(exc)
            else:
                keep.append(req)
        self._inflight = keep

    def _expire(self) -> None:
        now = time.monotonic()
        for req in [r for r in self._inflight if r.deadline is not None and now >= r.deadline]:
            self._inflight.remove(req)
            # the slot stays busy: the daemon may still write the late result into it
            req.future.set_exception(RoundTimeoutError(
                f"{req.what} did not complete within the process group's timeout; a process of the job "
                "may not have called it (birdnet status shows the job's processes)"))

    def _fail_all(self, exc: BaseException) -> None:
        for req in self._inflight:
            if req.handle is not None:
                req.handle._release()
            req.future.set_exception(type(exc)(f"{req.what}: {exc}"))
        self._inflight = []


_engines: dict[tuple[str, str], _Engine] = {}   #: (socket, job) -> engine, one per process
_engines_lock = threading.Lock()


def _engine(job: str, socket: str | None, client: Client | None = None, timeout: float | None = None) -> _Engine:
    if client is not None:
        key = (client.socket_path, client.job)
        with _engines_lock:
            e = _engines.get(key)
            if e is None:
                e = _engines[key] = _Engine(client, timeout)
            elif e.client is not client:
                raise InputError(f"job {client.job!r} already has a connection to birdnetd at {client.socket_path} "
                                 "in this process (the birdnet process group's or a HookState's); pass that one, or none")
            return e
    path = socket or default_socket()
    with _engines_lock:
        e = _engines.get((path, job))
        if e is None:
            e = _engines[(path, job)] = _Engine(Client(path, job=job, local_rank=launcher_local_rank()), timeout)
        return e


def launcher_local_rank() -> int | None:
    """A launcher's ``LOCAL_RANK`` (torchrun sets it), asked of the daemon so that its numbering and
    the launcher's agree with ``--local-size > 1`` too; None when it is not set."""
    raw = os.environ.get("LOCAL_RANK")
    if raw is None or not raw.strip():
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InputError(f"LOCAL_RANK={raw!r} is not a non-negative integer; unset it or let the launcher set it")
    return value


def _forget(e: _Engine) -> None:
    with _engines_lock:
        for k, v in list(_engines.items()):
            if v is e:
                del _engines[k]


# -- staging --------------------------------------------------------------------------------------
class _Staged:
    """A tensor as the client sees it: a NumPy array of its wire dtype (a view when possible) and how
    the result gets back into the tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.wire = wire_dtype(t)
        native = NATIVE.get(t.dtype) == self.wire.type and t.device.type == "cpu" and t.is_contiguous()
        self.view: np.ndarray | None = t.detach().numpy() if native else None
        if self.view is not None:
            self.array = self.view
        else:  # another dtype or layout, or a CUDA tensor (untested here): a host copy
            as_wire = next(k for k, v in NATIVE.items() if v == self.wire.type)
            self.array = t.detach().to("cpu", as_wire, copy=True).contiguous().numpy()

    def result(self, res: np.ndarray) -> None:
        if self.view is not None and np.shares_memory(res, self.view):
            return
        src = torch.from_numpy(np.ascontiguousarray(res)).view(self.tensor.shape)
        with torch.no_grad():
            self.tensor.copy_(src.to(self.tensor.dtype))


def _target(h: Handle, st: _Staged) -> Handle:
    # the client writes the result into ``out``: straight into the tensor's memory when it is a view
    if st.view is not None:
        h.out = st.view
    return h
