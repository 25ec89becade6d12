"""POSIX shared memory as files under /dev/shm, without Python's resource tracker.

``multiprocessing.shared_memory`` registers every attached segment with a resource tracker that
unlinks it when the *attaching* process exits (bpo-39959), which would let a training process
destroy the daemon's segments. birdnet therefore maps /dev/shm files directly: the daemon creates
and unlinks (mode 0660, so a configured group can attach and nobody else can), the client only
attaches. Names carry a per-daemon prefix so a restarted daemon can find and remove what an
earlier, killed instance left behind. Where the kernel has sealed memfds, segments for clients of
the daemon are memfds instead, which no client can truncate (:meth:`Segment.sealed`).
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import mmap
import operator
import os
import secrets
import weakref
from typing import Any

from birdnet.osutil import pid_alive

SHM_DIR = "/dev/shm"


#: seals of a segment a client cannot shrink or grow (fcntl(2) F_ADD_SEALS): a mapping the daemon
#: reads can then never lose pages under it (a truncated file made its next access SIGBUS)
_SEALS = ("F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_SEAL")


def sealing_available() -> bool:
    """True where sealed memfds exist (Linux 3.17+, Python 3.8+)."""
    return hasattr(os, "memfd_create") and all(hasattr(fcntl, n) for n in ("F_ADD_SEALS", *_SEALS))


class Segment:
    """One mapped segment. ``buf`` is a writable memoryview of ``size`` bytes.

    Two kinds. :meth:`sealed` (what the daemon hands out where it can): a memfd with
    F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL; it has no name anyone could unlink and no size
    anyone could change; a client opens it as ``path`` (``/proc/<daemon pid>/fd/<n>``, which the
    kernel lets only processes that may ptrace-read the daemon open: its own user and root) while
    the daemon holds the descriptor (:meth:`release_fd` closes it once the client has it mapped),
    or a process of another user receives it over the daemon's side socket (SCM_RIGHTS).
    Named (``Segment(name, ...)``): a file under /dev/shm, only where sealing is unavailable; such
    a file can be truncated by whoever may write it."""

    fd: int | None = None  #: the memfd, until release_fd (sealed segments only)

    @classmethod
    def sealed(cls, size: int) -> "Segment":
        fd = os.memfd_create("birdnet", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, max(size, 1))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, functools.reduce(operator.or_, (getattr(fcntl, n) for n in _SEALS)))
            seg = cls.__new__(cls)
            seg._mmap = _map_shared(fd, max(size, 1))
        except BaseException:
            os.close(fd)
            raise
        seg.name, seg.size, seg.fd = "", size, fd
        seg.inode = os.fstat(fd).st_ino
        seg.path = f"/proc/{os.getpid()}/fd/{fd}"
        seg.buf = memoryview(seg._mmap)[:size]
        return seg

    @classmethod
    def attach(cls, fd: int, size: int, path: str, inode: int | None = None) -> "Segment":
        """The client's side: map ``size`` bytes of a segment the daemon made, from the open
        descriptor ``fd`` (the caller closes it; the mapping holds none). ValueError when the file
        is smaller than ``size`` or is not the inode ``inode`` the daemon named: a file put in the
        segment's place. Never unlinks (no name): the daemon removes its segments."""
        st = os.fstat(fd)
        if (inode is not None and st.st_ino != inode) or st.st_size < size:
            raise ValueError(f"{path} is not the segment expected ({st.st_size} bytes, inode {st.st_ino}; "
                             f"expected at least {size} bytes, inode {inode})")
        seg = cls.__new__(cls)
        seg._mmap = _map_shared(fd, max(size, 1))
        seg.name, seg.size, seg.path, seg.inode = "", size, path, st.st_ino
        seg.buf = memoryview(seg._mmap)[:size]
        return seg

    def release_fd(self) -> None:
        """Close the memfd's descriptor (the mapping stays): the client has opened it by now."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __init__(self, name: str, size: int, *, create: bool, mode: int = 0o660, gid: int | None = None) -> None:
        if "/" in name or not name:
            raise ValueError(f"bad shared-memory name {name!r}")
        self.name, self.size = name, size
        self.path = os.path.join(SHM_DIR, name)
        self.inode = 0
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, mode)
        try:
            if create:
                os.fchmod(fd, mode)  # the umask must not narrow what the group may do
                if gid is not None:
                    os.fchown(fd, -1, gid)
                os.ftruncate(fd, max(size, 1))
            else:
                actual = os.fstat(fd).st_size
                if actual < size:
                    raise ValueError(f"shared memory {name} has {actual} bytes, {size} expected")
            self._mmap = _map_shared(fd, max(size, 1))
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)[:size]

    def close(self) -> None:
        self.release_fd()
        if self._mmap is None:
            return
        try:
            self.buf.release()
            if isinstance(self._mmap, mmap.mmap):
                self._mmap.close()
        except BufferError:
            # numpy views of the buffer are still alive; the mapping goes when they do
            pass
        self._mmap = None  # a _map_shared mapping is unmapped once nothing refers to it

    def unlink(self) -> None:
        if not self.name:
            return  # a memfd has no name
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


def _map_shared(fd: int, size: int) -> Any:
    """A shared read-write mapping of ``fd`` that holds no file descriptor: Python's mmap keeps a
    dup of the descriptor per mapping (until 3.13's trackfd=False), one per segment of every
    session, which a process could multiply up to the daemon's descriptor limit. libc's mmap
    through ctypes does not; the mapping is unmapped once the returned object and every view of
    it (numpy arrays of a round) are gone, never under a live view."""
    try:
        libc = _libc()
    except (OSError, AttributeError):
        return mmap.mmap(fd, size)
    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes: {os.strerror(err)}")
    buf = (ctypes.c_char * size).from_address(addr)
    # not at exit: a thread may still hold a view then; the kernel unmaps with the process
    weakref.finalize(buf, libc.munmap, ctypes.c_void_p(addr), ctypes.c_size_t(size)).atexit = False
    return memoryview(buf).cast("B")


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def segment_prefix(socket_path: str) -> str:
    """The prefix of every segment the daemon serving ``socket_path`` creates: one per daemon, so a
    restarted daemon (or a test harness, birdnet.cluster) finds what a killed one left."""
    digest = hashlib.blake2b(os.path.abspath(socket_path).encode(), digest_size=4).hexdigest()
    return f"bn{digest}-"


def new_name(prefix: str) -> str:
    return f"{prefix}{os.getpid()}-{secrets.token_hex(6)}"


def remove_stale(prefix: str) -> list[str]:
    """Unlink segments named ``prefix*`` whose creating process is gone (an earlier, killed
    instance of this daemon). Returns the names removed."""
    removed = []
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        pid_s = entry[len(prefix):].split("-", 1)[0]
        if pid_s.isdigit() and int(pid_s) != os.getpid() and pid_alive(int(pid_s)):
            continue
        if pid_s.isdigit() and int(pid_s) == os.getpid():
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, entry))
            removed.append(entry)
        except OSError:
            pass
    return removed
