"""Small questions to the operating system, shared by the daemon, the shared-memory janitor and
the local-cluster helper."""
from __future__ import annotations

import os
import socket
import sys


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (also when it belongs to another user). A pid that
    cannot be a process (0 and negatives name process groups to os.kill; one over a C int overflows)
    is not alive."""
    if not isinstance(pid, int) or not 0 < pid < 2**31:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False


def unix_socket_accepts(path: str, timeout: float = 0.5) -> bool:
    """True if something accepts connections on the Unix socket ``path`` (a socket file left by a
    killed process does not)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


#: prctl option that names the calling thread (linux/prctl.h); the kernel keeps 15 bytes of it
_PR_SET_NAME = 15


def name_os_thread(name: str) -> bool:
    """Give the calling thread ``name`` (its first 15 bytes) where the kernel keeps thread names, so
    ``top -H``, ``ps -L``, /proc/PID/task/TID/comm, perf and py-spy show what each thread of a busy
    birdnetd is (``birdnet-ring`` beside ZeroMQ's ``ZMQbg/IO/0``) instead of the interpreter's name
    for all of them: Python before 3.14 names its threads only for itself. Returns whether the name
    was set; off Linux, or without prctl, nothing happens (a name is a convenience, never needed)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        return prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: environment variables through which an operator tunes glibc's malloc; when one is set, we do not
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_buffers(largest_buffer: int) -> str:
    """Ask glibc's malloc to keep freed buffers of up to ``largest_buffer`` bytes for reuse instead of
    handing their pages back to the kernel; returns what was done, for the log.

    Why: ZeroMQ allocates every received message (up to chunk_bytes each, 14 of them per node in a
    dense round on 8 nodes) and the ring frees it a moment later. With glibc's defaults the freed
    memory at the top of a heap is trimmed once it exceeds twice the largest recent allocation, so
    the next messages page-fault the same memory back in, zero-filled by the kernel, on every call
    (figures in CHANGELOG.md, "History of measurements"). Buffers are served from the heap below
    ``mmap_threshold`` and up to ``trim_threshold`` of free memory stays in the process: a
    bounded, steady footprint, which a daemon that does the same round over and over wants.

    Left alone when an operator tunes malloc through its environment variables or GLIBC_TUNABLES,
    and off glibc (musl has no such knobs)."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return "malloc left alone (not glibc)"
    if any(os.environ.get(v) for v in _MALLOC_ENV) or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "malloc left alone (tuned through the environment)"
    # glibc caps the mmap threshold at HEAP_MAX_SIZE / 2: 32 MiB on 64-bit, 512 KiB on 32-bit
    cap = 32 << 20 if ctypes.sizeof(ctypes.c_void_p) == 8 else 512 << 10
    mmap_threshold = min(cap, max(4 << 20, 2 * largest_buffer))
    trim_threshold = 4 * mmap_threshold
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
    except (OSError, AttributeError) as exc:
        return f"malloc left alone ({exc})"
    if not ok:
        return "malloc left alone (mallopt refused)"
    return f"malloc keeps freed buffers: mmap_threshold {mmap_threshold >> 10} KiB, trim_threshold {trim_threshold >> 10} KiB"


def release_freed_memory() -> bool:
    """Hand memory that malloc holds free back to the kernel (glibc's malloc_trim, all arenas):
    after a burst of client connections ended (libzmq allocates ~70 KB per connection, on its I/O
    thread's arena) the daemon's resident size stays up otherwise. False off glibc."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False
