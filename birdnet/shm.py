"""POSIX shared memory as files under /dev/shm, without Python's resource tracker.

``multiprocessing.shared_memory`` registers every attached segment with a resource tracker that
unlinks it when the *attaching* process exits (bpo-39959), which would let a training process
destroy the daemon's segments. birdnet therefore maps /dev/shm files directly: the daemon creates
and unlinks (mode 0660, so a configured group can attach and nobody else can), the client only
attaches. Names carry a per-daemon prefix so a restarted daemon can find and remove what an
earlier, killed instance left behind.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import secrets

from birdnet.osutil import pid_alive

SHM_DIR = "/dev/shm"


class Segment:
    """One mapped segment. ``buf`` is a writable memoryview of ``size`` bytes."""

    def __init__(self, name: str, size: int, *, create: bool, mode: int = 0o660, gid: int | None = None) -> None:
        if "/" in name or not name:
            raise ValueError(f"bad shared-memory name {name!r}")
        self.name, self.size = name, size
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
            self._mmap = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)[:size]

    def close(self) -> None:
        if self._mmap is None:
            return
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            # numpy views of the buffer are still alive; the mapping goes when they do
            pass
        self._mmap = None

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


def segment_prefix(socket_path: str) -> str:
    """The prefix of every segment the daemon serving ``socket_path`` creates: one per daemon, so a
    restarted daemon (or a test harness, birdnet.bench.cluster) finds what a killed one left."""
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
