"""The local protocol's requests as records: one type per request a process sends its daemon, built
by the client (``header()``) and decoded by the daemon (:func:`decode`), so the two sides share one
schema, one set of limits and one spelling of the names they agree on (:data:`ANONYMOUS_PREFIX`).

A request from a process is not trusted: :func:`decode` checks every field once, where bytes become
a request, and raises :class:`~birdnet.errors.InputError` naming the first field that is missing, of
the wrong type or out of range (``submit: field 'seq' is str, expected an integer 0..2**62``); the
daemon's handlers then trust types and ranges and check only what needs the daemon's state (a slot
that exists, a root within the job). Records the client builds are not checked again on its side:
the daemon's check is the one that counts, and a client of another version meets it too.

This module is imported by the client: it must not import NumPy, ZeroMQ or Numba.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

from birdnet.errors import InputError, ProtocolError

#: tensor names the client gives calls made without ``name=`` (``anonymous/<call number>``): no later
#: call can name the same tensor, so their codec state lives for the round only (StateStore.get)
ANONYMOUS_PREFIX = "anonymous/"

KINDS = ("allreduce", "broadcast", "barrier", "reset")
OPS = ("mean", "sum")
FLOAT_DTYPES = ("float16", "float32", "float64")
INT_DTYPES = ("int32", "int64")
SUM_DTYPES = FLOAT_DTYPES + INT_DTYPES
MAX_SEGMENT_BYTES = 1 << 34
MAX_SLOTS = 256  #: shared-memory slots per client session
MAX_JOB = 200  #: characters of a job name
MAX_PID = 2**22  #: Linux's largest pid_max (a pid above cannot exist; os.kill would overflow a C int)
MAX_SEQ = 2**62  #: call numbers: far beyond any run, well inside the int64 the wire carries
MAX_NAME = 16384  #: characters of a tensor name
MAX_DIMS = 32
CALL_RANGE = (-2**63, 2**63 - 1)  #: a request's ``call`` (the client's reply id): any int64

Check = Callable[[Any], str | None]


def _int(lo: int, hi: int) -> Check:
    def check(v: Any) -> str | None:
        if not isinstance(v, int) or isinstance(v, bool):
            return f"is {type(v).__name__}, expected an integer {lo}..{hi}"
        return None if lo <= v <= hi else f"is {v}, outside {lo}..{hi}"
    return check


def _str(lo: int, hi: int) -> Check:
    def check(v: Any) -> str | None:
        if not isinstance(v, str):
            return f"is {type(v).__name__}, expected a string"
        return None if lo <= len(v) <= hi else f"has {len(v)} characters, expected {lo}..{hi}"
    return check


def _one_of(choices: tuple[str, ...]) -> Check:
    def check(v: Any) -> str | None:
        return None if isinstance(v, str) and v in choices else f"is {v!r}, expected one of {', '.join(choices)}"
    return check


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else f"is {type(v).__name__}, expected true or false"


def _map(v: Any) -> str | None:
    return None if isinstance(v, dict) else f"is {type(v).__name__}, expected a map"


def _codec(v: Any) -> str | None:
    return None if v is None or (isinstance(v, str) and 0 < len(v) <= 64) else f"is {v!r}, expected a codec name"


def _shape(v: Any) -> str | None:
    if not isinstance(v, list) or len(v) > MAX_DIMS:
        return f"is {type(v).__name__ if not isinstance(v, list) else f'a list of {len(v)}'}, expected a list of at " \
               f"most {MAX_DIMS} non-negative integers"
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v):
        return f"{v!r} is not a list of non-negative integers"
    if math.prod(v) * 8 > MAX_SEGMENT_BYTES:  # Python ints: a huge shape cannot overflow
        return f"{v!r} has {math.prod(v)} elements, more than any shared-memory segment holds"
    return None


_CALL = ("call", _int(*CALL_RANGE), False)
#: every field of every request: (key, check, required), in the order they are checked
REQUESTS: dict[str, tuple[tuple[str, Check, bool], ...]] = {
    "hello": (_CALL, ("job", _str(1, MAX_JOB), True), ("pid", _int(1, MAX_PID), True), ("door", _bool, False),
              ("local_rank", _int(0, 2**31 - 1), False)),
    "alloc": (_CALL, ("slot", _int(0, MAX_SLOTS - 1), True), ("nbytes", _int(0, MAX_SEGMENT_BYTES), True)),
    "submit": (("call", _int(*CALL_RANGE), True), ("seq", _int(0, MAX_SEQ), True),
               ("kind", _one_of(KINDS), True), ("door", _bool, False),
               ("name", _str(0, MAX_NAME), False), ("shape", _shape, False),
               ("dtype", _one_of(SUM_DTYPES), False), ("slot", _int(0, MAX_SLOTS - 1), False),
               ("op", _one_of(OPS), False), ("codec", _codec, False), ("params", _map, False),
               ("root", _int(0, 2**31 - 1), False)),
    "status": (_CALL,),
    "warm": (_CALL, ("codec", _codec, True), ("params", _map, False)),
    "bye": (_CALL,),
}
#: fields a submit of the kinds that carry a tensor (allreduce, broadcast) must have
TENSOR_FIELDS = ("name", "shape", "dtype", "slot")


def check_request(header: dict[str, Any]) -> None:
    """Raise :class:`InputError` naming the first field of ``header`` (a request, its type known)
    that is missing, of the wrong type or out of range."""
    t = header["t"]
    for key, check, required in REQUESTS[t]:
        if key not in header:
            if required or (t == "submit" and key in TENSOR_FIELDS and header.get("kind") in ("allreduce", "broadcast")):
                raise InputError(f"{t}: field {key!r} is missing")
            continue
        why = check(header[key])
        if why is not None:
            raise InputError(f"{t}: field {key!r} {why}")


class _Request:
    """What every request record shares: its type name ``t`` and the header it travels as."""

    t: ClassVar[str]

    def header(self) -> dict[str, Any]:
        """The request as sent: its type, then its fields that are set (None: absent; ``door``
        only when true), so a request is as small as the one written by hand before."""
        h: dict[str, Any] = {"t": self.t}
        for name in _FIELDS[type(self)]:
            v = getattr(self, name)
            if v is None or (name == "door" and v is False):
                continue
            h[name] = v
        return h

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> Any:
        """The record of a header already checked by :func:`check_request` (fields not in the
        schema are ignored, as before)."""
        return cls(**{k: header[k] for k in _FIELDS[cls] if k in header})


@dataclasses.dataclass(frozen=True)
class Hello(_Request):
    """A process joins ``job`` (``door``: it wants the result and submit FIFOs; ``local_rank``:
    this one, else the lowest free). ``proto`` is checked by the daemon against its own
    PROTOCOL_VERSION, with a message naming both versions."""

    t: ClassVar[str] = "hello"
    job: str
    pid: int
    proto: Any = None
    door: bool = False
    local_rank: int | None = None
    call: int | None = None


@dataclasses.dataclass(frozen=True)
class Alloc(_Request):
    """A shared-memory segment of ``nbytes`` for ``slot`` (the reply names it)."""

    t: ClassVar[str] = "alloc"
    slot: int
    nbytes: int
    call: int | None = None


@dataclasses.dataclass(frozen=True)
class Submit(_Request):
    """One process's part of collective call ``seq`` (its ``kind``): for allreduce and broadcast the
    tensor (``name``, ``shape``, ``dtype``) in shared-memory ``slot``, reduced with ``op``, under
    ``codec``/``params`` when given (else the daemon's default), from ``root`` for a broadcast.
    ``door``: the process has its result FIFO open. ``call`` is the reply id."""

    t: ClassVar[str] = "submit"
    seq: int
    kind: str
    call: int | None = None
    door: bool = False
    name: str | None = None
    shape: list[int] | None = None
    dtype: str | None = None
    slot: int | None = None
    op: str | None = None
    root: int | None = None
    codec: str | None = None
    params: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Status(_Request):
    """The daemon's status."""

    t: ClassVar[str] = "status"
    call: int | None = None


@dataclasses.dataclass(frozen=True)
class Warm(_Request):
    """Load ``codec``'s kernels (for ``params``) now, in the background."""

    t: ClassVar[str] = "warm"
    codec: str
    params: dict[str, Any] | None = None
    call: int | None = None


@dataclasses.dataclass(frozen=True)
class Bye(_Request):
    """The process ends its session (its segments are unlinked)."""

    t: ClassVar[str] = "bye"
    call: int | None = None


Request = Hello | Alloc | Submit | Status | Warm | Bye
RECORDS: dict[str, type] = {cls.t: cls for cls in (Hello, Alloc, Submit, Status, Warm, Bye)}
#: each record's field names, in order (dataclasses.fields is slow enough to show per request)
_FIELDS: dict[type, tuple[str, ...]] = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in RECORDS.values()}


def decode(header: dict[str, Any]) -> Request:
    """The record of a request header from a process, every field checked once: ProtocolError for
    an unknown request type, InputError naming the first bad field."""
    cls = RECORDS.get(header.get("t")) if isinstance(header.get("t"), str) else None
    if cls is None:
        raise ProtocolError(f"unknown request {header.get('t')!r}")
    check_request(header)
    return cls.from_header(header)


def anonymous_name(seq: int) -> str:
    """The tensor name of call ``seq`` made without ``name=``."""
    return f"{ANONYMOUS_PREFIX}{seq}"
