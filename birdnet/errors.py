"""One error hierarchy for the whole system.

Every class says, in its docstring, how the system reacts when it is raised. Classes that have a
natural builtin counterpart also subclass it (a timeout is also a ``TimeoutError``), so callers can
catch either. Errors cross the client socket as ``{"error": class name, "message": text}`` and are
rebuilt on the client side by :func:`from_wire`.
"""
from __future__ import annotations

from typing import Any


class BirdnetError(Exception):
    """Base class. Reaction: depends on the subclass; never leaves the daemon in a bad state."""


class ConfigError(BirdnetError, ValueError):
    """Bad settings, hosts file or command line. Reaction: fatal at start-up (exit status 2);
    the message names the file, line or option and how to fix it."""


class ProtocolError(BirdnetError):
    """A peer or client sent bytes that do not follow the wire format (bad frame count, size over a
    limit, wrong header types). Reaction: the message is logged and dropped; the sender is not
    trusted further for that round; the daemon keeps serving everyone else."""


class VersionMismatchError(ProtocolError):
    """The other side speaks another protocol version or belongs to another cluster / settings
    fingerprint. Reaction: the connection is refused and the difference is logged; clients get
    this error instead of hanging."""


class SessionLostError(ProtocolError):
    """The daemon has no session for the connection a request came on: it restarted since the
    process said hello (ZeroMQ reconnected the socket underneath), or the process never said it.
    Reaction: the request is refused; birdnet.client drops the connection and the shared memory of
    the earlier daemon, fails the call with DaemonUnavailableError, and the next call reconnects."""


class InputError(BirdnetError, ValueError):
    """A training process handed over something the daemon cannot reduce (object dtype, shapes
    that differ between participants, unknown op or codec, NaN with ``nan_policy="reject"``).
    Reaction: the round fails for every participant with this message; the daemon keeps serving."""


class RoundMismatchError(InputError):
    """Participants of one round disagree (tensor name, shape, dtype, op, codec or its parameters,
    or a shared selection digest). Reaction: the round fails for all of them with a message naming
    the tensor, the ranks and what differs; the next round proceeds normally."""


class CodecError(BirdnetError, ValueError):
    """Unknown codec, bad codec parameter, or codec state over its memory cap. Reaction: the round
    fails with this message; other tensors and rounds are unaffected."""


class StateLimitError(CodecError, MemoryError):
    """Codec state (error feedback, compensation) would exceed ``state_limit_bytes``. Reaction: the
    round fails; ``client.reset_state()`` or a larger limit fixes it."""


class DaemonUnavailableError(BirdnetError, ConnectionError):
    """The client cannot reach its local daemon (not running, wrong socket path, permission).
    Reaction: raised to the training code within about a second, with how to start the daemon."""


class PeerLostError(BirdnetError, ConnectionError):
    """A peer did not answer within ``peer_timeout`` during a round, or its connection closed.
    Reaction: the round fails on every node that notices, naming the peer; the daemon keeps
    running, reconnects, and the next round succeeds once the peer is back."""


class ProcessLostError(PeerLostError):
    """A training process of the job exited (killed, crashed, or closed its client) on some node, so
    the job's rounds cannot complete there. Reaction: the job's rounds fail at once on every node,
    naming the process, until a process joins the job on that node again (restart the job)."""


class RoundTimeoutError(BirdnetError, TimeoutError):
    """A round did not complete within its deadline (a local process never submitted, or the caller's
    ``timeout`` expired). Reaction: the round is abandoned; participants get this error."""


class AuthenticationError(BirdnetError, PermissionError):
    """A peer's CURVE key is unknown or missing, or a local process lacks permission.
    Reaction: the connection is refused and logged; nothing from it is used."""


class ShutdownError(BirdnetError):
    """The daemon is stopping (SIGTERM). Reaction: rounds in flight are aborted cleanly and their
    participants get this error; shared memory is unlinked."""


class UnsupportedError(InputError, NotImplementedError):
    """A call the birdnet path does not implement (a torch.distributed collective such as send/recv
    or a subgroup on the ``birdnet`` backend); the message names what is supported. Reaction:
    raised in the calling process before anything is sent; the daemons and other jobs are unaffected."""



class RoundAborted(PeerLostError):
    """The round was aborted elsewhere in the ring (the reason names where). Reaction: the round
    fails on this node too and the abort is passed on (keeping ``origin``, the node that failed it
    first) until it is back next to its origin; the next round starts normally. ``cls`` is the
    error class the origin failed the round with, when it was not a lost peer (a lane round whose
    descriptions differ fails with RoundMismatchError on every node): :meth:`as_origin` is the
    error the round's processes get. Internal to the daemon: it reaches a client as its origin's
    class, else as PeerLostError."""

    def __init__(self, reason: str, origin: int | None = None, cls: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.origin, self.cls = reason, origin, cls

    @classmethod
    def of(cls, abort: Any) -> RoundAborted:
        """The error of a round that an ``abort`` message (birdnet.messages.Abort) failed."""
        return cls(abort.reason, abort.origin, abort.error_class)

    def as_origin(self) -> BirdnetError:
        """The error with the class its origin failed the round with (itself when none is named)."""
        return rebuild(self.cls, self.reason) if self.cls else self


_BY_NAME = {cls.__name__: cls for cls in [
    BirdnetError, ConfigError, ProtocolError, VersionMismatchError, SessionLostError, InputError, RoundMismatchError,
    CodecError, StateLimitError, DaemonUnavailableError, PeerLostError, ProcessLostError, RoundTimeoutError,
    AuthenticationError, ShutdownError, UnsupportedError,
]}


def known_name(exc: BaseException) -> str:
    """The name of the nearest class of ``exc`` the other side knows (a RoundAborted's origin's
    class, else PeerLostError)."""
    if isinstance(exc, RoundAborted):
        exc = exc.as_origin()
    return next((c.__name__ for c in type(exc).__mro__ if _BY_NAME.get(c.__name__) is c), "BirdnetError")


def to_wire(exc: BaseException) -> dict:
    """Encode an exception for the client socket."""
    return {"error": known_name(exc), "message": str(exc)}


def with_message(exc: BaseException, message: str) -> BirdnetError:
    """An error of ``exc``'s class (:func:`known_name`) saying ``message`` instead."""
    return rebuild(known_name(exc), message)


def rebuild(name: Any, message: Any) -> BirdnetError:
    """The error of class ``name`` (as a node of the ring named it: an abort's or a verdict's error
    class) with ``message``; unknown names become ``BirdnetError``."""
    return _BY_NAME.get(str(name), BirdnetError)(str(message))


def from_wire(d: dict) -> BirdnetError:
    """Rebuild an exception sent by :func:`to_wire`; unknown names become ``BirdnetError``."""
    return rebuild(d.get("error"), d.get("message", ""))
