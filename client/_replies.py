"""The client's reply pump: the daemon's answers, filed by call number until their call collects them.

Calls run concurrently (``allreduce_async``) and their results come back in any order, through the
result doorbell or over the socket, so whichever call waits reads whatever arrives and files it.
This is also the small interface for a thread that polls the daemon together with its own
descriptors (birdnet.client.torch_dist's engine): :meth:`pollables`, :meth:`read_door`,
:meth:`pump` and :meth:`arrived`.
"""
from __future__ import annotations

import time
from typing import Any

from birdnet.client._connection import Connection

from birdnet.errors import DaemonUnavailableError, RoundTimeoutError, from_wire


class Replies:
    """Messages from ``conn`` by call number."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.received: dict[int, dict[str, Any]] = {}

    def _file(self, h: dict[str, Any]) -> bool:
        if isinstance(h.get("call"), int):
            self.received[h["call"]] = h
            return True
        return False

    def arrived(self, call: int) -> bool:
        return call in self.received

    def clear(self) -> None:
        self.received.clear()

    def pump(self, timeout: float) -> None:
        """File what arrives within ``timeout`` seconds, then whatever is already there."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                h = self.conn.recv(deadline)
            except RoundTimeoutError:
                return
            self._file(h)
            deadline = time.monotonic()

    def wait(self, call: int, timeout: float | None, name: str | None = None,
             generation: int | None = None) -> dict[str, Any]:
        """The reply to ``call``, within ``timeout`` seconds (None: no limit). An error that names
        no call (the daemon refused a message it could not attribute) is raised here.
        ``generation``: the connection the call went out on; once another one replaced it the
        call is lost (the earlier daemon took it with it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while call not in self.received:
            if generation is not None and generation != self.conn.generation:
                raise DaemonUnavailableError(f"call for tensor {name!r} was lost: birdnetd at {self.conn.socket_path} "
                                             "restarted while it was in flight")
            try:
                h = self.conn.recv(deadline)
            except RoundTimeoutError:
                raise RoundTimeoutError(f"call for tensor {name!r} did not complete within {timeout} s") from None
            if not self._file(h) and h.get("t") == "error":
                raise from_wire(h)
        return self.received.pop(call)

    # -- for a thread that polls the daemon itself ------------------------------------------------
    def pollables(self) -> list[Any]:
        """The socket, its monitor and the result doorbell's descriptor, to poll for the daemon."""
        return self.conn.pollables()

    @property
    def door_fd(self) -> int | None:
        return self.conn.door.fd if self.conn.door is not None else None

    def read_door(self) -> bool:
        """File the results waiting in the result doorbell (the usual way results come: read
        without the poll that :meth:`pump` ends with). True when the doorbell reached its end
        (the daemon closed it): then :meth:`pump` hears why."""
        for h in self.conn.read_door():
            self._file(h)
        return self.conn.door is not None and self.conn.door.eof
