"""systemd readiness, status and watchdog notifications (``sd_notify``) without libsystemd.

The service manager passes the address of a datagram socket in ``$NOTIFY_SOCKET``; the daemon
sends newline-separated ``KEY=VALUE`` assignments to it (``READY=1``, ``STATUS=...``,
``WATCHDOG=1``, ``RELOADING=1``, ``STOPPING=1``). See sd_notify(3) and sd_watchdog_enabled(3).

Outside systemd (a terminal, a container, a test) ``$NOTIFY_SOCKET`` is unset and every call is a
no-op that returns ``False``. A notification is never worth crashing the daemon for, so
:func:`notify` never raises: a missing, refusing or stalled socket only makes it return ``False``.

The unit uses ``NotifyAccess=main``: systemd accepts messages only from the main PID, which it
checks from the kernel's ``SCM_CREDENTIALS`` of each datagram. Send from the daemon process itself,
not from a forked helper.
"""

from __future__ import annotations

import os
import socket

__all__ = ["notify", "watchdog_interval"]

#: Upper bound on how long one notification may block the caller's main loop. The datagram queue of
#: the notify socket is only full when the service manager itself is stuck; then a lost ping is the
#: right outcome (the watchdog fires, which is what it is for), not a stuck daemon.
send_timeout = 1.0


def _address() -> str | bytes | None:
    """Return the socket address from ``$NOTIFY_SOCKET`` or ``None`` if unset or unsupported."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return None
    if path[0] == "@":
        # Abstract namespace: '@' stands for the leading NUL byte (systemd's convention).
        return b"\0" + os.fsencode(path[1:])
    if path[0] == "/":
        return path
    # systemd >= 253 also passes "vsock:CID:PORT" to virtual machines; birdnet runs on bare metal
    # boards, so anything else is treated as "no service manager".
    return None


def notify(*assignments: str) -> bool:
    """Send state assignments to the service manager.

    Parameters
    ----------
    *assignments
        ``KEY=VALUE`` strings such as ``"READY=1"`` or ``"STATUS=peers connected 3/3"``. They are
        sent together in one datagram, so systemd applies them atomically.

    Returns
    -------
    bool
        ``True`` if the datagram was handed to the socket; ``False`` if ``$NOTIFY_SOCKET`` is unset
        or unsupported, an assignment is malformed (not a string, no ``=``, or a newline that would
        smuggle in another assignment), or sending failed. Never raises.
    """
    try:
        address = _address()
        if address is None or not assignments:
            return False
        for item in assignments:
            if not isinstance(item, str) or "=" not in item or "\n" in item:
                return False
        payload = "\n".join(assignments).encode("utf-8")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(send_timeout)
            sock.sendto(payload, address)
        return True
    except Exception:  # noqa: BLE001 - a notification must never take the daemon down
        return False


def watchdog_interval() -> float | None:
    """Return how often to send ``WATCHDOG=1``, in seconds, or ``None`` if no watchdog is armed.

    Follows sd_watchdog_enabled(3): the watchdog is armed when ``$WATCHDOG_USEC`` is a positive
    integer and ``$WATCHDOG_PID`` is either unset or this process's PID (so a child that inherited
    the environment does not think it owns the watchdog). The result is half of ``WatchdogSec=``, the
    interval systemd recommends, leaving a whole half-period of slack for a slow loop iteration.
    Malformed values count as "not armed".
    """
    usec_text = os.environ.get("WATCHDOG_USEC")
    if not usec_text:
        return None
    try:
        usec = int(usec_text, 10)
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid_text = os.environ.get("WATCHDOG_PID")
    if pid_text:
        try:
            pid = int(pid_text, 10)
        except ValueError:
            return None
        if pid <= 0 or pid != os.getpid():
            return None
    return usec / 2_000_000
