"""Small questions to the operating system, shared by the daemon, the shared-memory janitor and
the local-cluster helper."""
from __future__ import annotations

import os
import socket


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


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
