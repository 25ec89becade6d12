"""The client's shared-memory slots: segments the daemon made for this process, mapped here.

A slot is a :class:`birdnet.shm.Segment` attached on the client's side (the daemon creates and
removes it; the client only maps it) and the state the client keeps about it: whether a call is in
flight in it (``busy``), whether the caller still holds a result in its memory (``held``), whether
it backs an array from :meth:`Client.buffer` (the pool's ``owned``).
"""
from __future__ import annotations

import math
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from birdnet.errors import DaemonUnavailableError
from birdnet.shm import Segment

#: shared-memory slots whose memory results returned by ``allreduce`` may hold at once; beyond
#: that a result is copied out of its slot (see :meth:`Slot.held`)
RESULT_SLOTS = 8


def _fetch_memfd(path: str, token: str, timeout: float = 5.0) -> int:
    """The sealed segment the daemon made for this process, passed over its side socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.send(token.encode())
        _msg, fds, _flags, _addr = socket.recv_fds(s, 16, 1)
    if not fds:
        raise OSError(f"the daemon sent no descriptor through {path}")
    return fds[0]


class Slot:
    """One segment the daemon made for this client (its ``alloc`` reply), mapped here."""

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
            self.segment = Segment.attach(fd, max(nbytes, 1), self.path, inode)
        except ValueError:
            raise DaemonUnavailableError(f"{self.path} is not the segment birdnetd made for this process") from None
        finally:
            os.close(fd)
        self.busy = False
        #: every array over the slot's memory is made from this one (see :meth:`view`), so each of
        #: them, and every view of one (NumPy points a view's base at the first array that owns
        #: or wraps the memory, this one) or tensor made from one, holds a reference to it
        self.memory = np.frombuffer(self.segment.buf, dtype=np.uint8)
        # References while no array views the slot: this attribute and getrefcount's argument.
        self._refs = sys.getrefcount(self.memory)

    def held(self) -> bool:
        """True while an array over this slot's memory is alive (a result the caller still has):
        the slot must not take another call, which would overwrite that result."""
        return sys.getrefcount(self.memory) > self._refs

    def view(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        n = math.prod(shape)  # a Python int: np.prod costs 5-10 us a call (and wraps at 2**63)
        return self.memory[:n * dtype.itemsize].view(dtype).reshape(shape)

    def starts(self, array: np.ndarray) -> bool:
        """Whether ``array`` is C-contiguous and starts at this slot's first byte."""
        return (array.flags.c_contiguous and np.shares_memory(array, self.memory)
                and array.__array_interface__["data"][0] == self.memory.__array_interface__["data"][0])

    def close(self) -> None:
        # arrays over the memory keep the mapping until they go (Segment.close never unmaps under them)
        self.segment.close()


class SlotPool:
    """The client's slots by slot number, and which of them back arrays from ``buffer()``.

    ``alloc(slot, nbytes)`` asks the daemon for a segment (its ``alloc`` reply). A slot takes a
    call when no call is in flight in it, it backs no ``buffer()`` array and no result the caller
    still holds lives in it."""

    def __init__(self, alloc: Callable[[int, int], dict[str, Any]]) -> None:
        self._alloc = alloc
        self.slots: dict[int, Slot] = {}
        self.owned: dict[int, Slot] = {}  #: id(slot) -> slot, for arrays from buffer()
        self.stale: dict[int, Slot] = {}  #: buffer() slots of an earlier daemon instance

    def _free(self, s: Slot, owned: set[int]) -> bool:
        return not s.busy and id(s) not in owned and not s.held()

    def may_hold(self, slot: Slot) -> bool:
        """Whether a result may stay in ``slot`` (fewer than RESULT_SLOTS other slots hold one)."""
        owned = set(self.owned)
        return sum(1 for s in self.slots.values()
                   if s is not slot and id(s) not in owned and s.held()) < RESULT_SLOTS

    def take(self, nbytes: int) -> Slot:
        """A free slot of at least ``nbytes``, marked busy: a free one that is large enough, else
        a free slot number (or a new one) the daemon allocates anew."""
        owned = set(self.owned)
        for s in self.slots.values():
            if s.nbytes >= nbytes and self._free(s, owned):
                s.busy = True
                return s
        free = [k for k, s in self.slots.items() if self._free(s, owned)]
        slot_id = free[0] if free else len(self.slots)
        if slot_id in self.slots:
            self.slots[slot_id].close()
        reply = self._alloc(slot_id, int(nbytes))
        s = Slot(slot_id, reply["name"], reply["nbytes"], reply.get("path"), reply.get("inode"),
                 reply.get("fdsock"), reply.get("token"))
        self.slots[slot_id] = s
        s.busy = True
        return s

    def buffer(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = math.prod(shape) * dtype.itemsize
        s = self.take(nbytes)
        s.busy = False
        arr = s.view(shape, dtype)
        self.owned[id(s)] = s
        return arr

    def owner_of(self, array: np.ndarray) -> Slot | None:
        """The slot of the ``buffer()`` array ``array``, if it is one (whole, from its start)."""
        for s in self.owned.values():
            if s.starts(array):
                return s
        return None

    def stale_of(self, array: np.ndarray) -> Slot | None:
        """The slot of an earlier daemon instance that ``array`` (a ``buffer()`` of it) lies in."""
        for s in self.stale.values():
            if np.shares_memory(array, s.memory) and array.flags.c_contiguous:
                return s
        return None

    def drop(self) -> None:
        """The daemon went away: its segments are no longer shared with it. ``buffer()`` arrays
        keep their memory (they become stale: calls copy in and out of them); the rest is closed."""
        for s in self.slots.values():
            if id(s) in self.owned:
                self.stale[id(s)] = s
            else:
                s.close()
        self.slots.clear()
        self.owned.clear()

    def close(self) -> None:
        for s in self.slots.values():
            s.close()
        self.slots.clear()
        self.owned.clear()
        self.stale.clear()
