"""Peer messages as records: one type per kind, built from a received header in one place
(:func:`peer_record`, called by the peer layer as bytes become a message), so the checks a message
needs live with its type and the round reads named fields instead of header keys (the keys are
listed once, in :data:`birdnet.wire.HEADER_KEYS`; ``c``, say, is :attr:`Abort.error_class` in an
abort and :attr:`Commit.count` in a commit).

==========  ==============  ===========  ===================================================================
kind        direction       record       meaning; fields checked once here (else: the message is dropped)
==========  ==============  ===========  ===================================================================
``ping``    left -> right   (handshake)  heartbeat and handshake (daemon/peers.py, daemon/handshake.py)
``pong``    right -> left   (handshake)  the ping was accepted
``refuse``  right -> left   (handshake)  the ping was refused; ``reason`` says what differs
``start``   left -> right   Start        a round: the leader sends it, every node appends its round
                                         description when its local processes are ready and passes it
                                         on. ``k`` a str, ``descs`` a list (``more`` a list, else empty)
``go``      left -> right   Go           the leader's verdict after the start came back (ok, or the
                                         error). ``k`` a str; ``lane`` ``[str, int]`` or none; its
                                         verdicts are checked against the ring (:func:`verdicts_of_go`)
``abort``   left -> right   Abort        a node failed the round (lost peer, mismatch); passes the reason
                                         on. ``k`` a str or absent; ``o`` an int, ``c`` an error class
``data``    left -> right   Data         ring-algorithm messages of round ``k`` (``ln``: of a lane round,
                                         one started without an agreement). ``k`` a str; a NamedTuple,
                                         built for every chunk, that costs no more than reading two keys
``lane``    left -> right   LaneClose    the leader closes the dense lane before round ``k``; with
                                         ``req``, a node asks the leader to. ``k`` a str, ``req`` text
``commit``  left -> right   Commit       ``c`` consecutive nodes ending with the sender hold round
                                         ``k``'s result (RoundTransport.await_commit). ``c`` an int in
                                         [1, COUNT_LIMIT)
``settle``  any -> any      (settle.py)  a node whose commit cannot finish asks every other node what it
                                         knows of round ``k``, on a connection of its own
``settled`` reply           (settle.py)  the answer: ``st`` (released / aborted / holds / pending), ``kn``
==========  ==============  ===========  ===================================================================

A header from the network is never trusted: :func:`peer_record` returns None when a field has the
wrong type (the peer layer drops the message and counts it) and never raises on bad input. The
records keep the header they came from, which goes on unchanged (a ``go`` forwarded, the data a
ring algorithm reads).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container
from typing import Any, NamedTuple

#: a node's process count in a round is below this (a bound on what a peer may claim)
COUNT_LIMIT = 1 << 20


def is_int(v: Any) -> bool:
    """An int that is not a bool (msgpack gives bools for true/false)."""
    return isinstance(v, int) and not isinstance(v, bool)


def valid_counts(counts: Any, width: int) -> bool:
    """``counts`` is a list of ``width`` process counts, each in [0, COUNT_LIMIT)."""
    return (isinstance(counts, list) and len(counts) == width
            and all(is_int(c) and 0 <= c < COUNT_LIMIT for c in counts))


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """The leader's verdict on one round of a start/go exchange. Travels in a ``go`` as its own
    fields (``k ok err errc counts``) for the first round and as ``[key, ok, err, errc, counts]``
    in ``more`` for the others of the batch."""

    key: str
    ok: bool
    error: Any  #: the message every node fails the round with when not ok (as sent)
    error_class: Any  #: the class it fails with (RoundMismatchError when none is named)
    counts: tuple[int, ...]  #: process count per ring position

    def to_wire(self) -> list[Any]:
        return [self.key, self.ok, self.error, self.error_class, list(self.counts)]

    def go_fields(self) -> dict[str, Any]:
        """The fields of a ``go`` that carry the batch's first verdict."""
        return {"k": self.key, "ok": self.ok, "err": self.error, "errc": self.error_class,
                "counts": list(self.counts)}

    @classmethod
    def checked(cls, key: str, ok: Any, error: Any, error_class: Any, counts: Any, width: int) -> Verdict:
        """A verdict as received: malformed counts fail the round (as a lost peer) on every node that
        receives them, instead of running it with counts nobody agreed."""
        if not valid_counts(counts, width):
            return cls(key, False, f"round {key}: malformed go message", "PeerLostError", (0,) * width)
        return cls(key, bool(ok), error, error_class, tuple(counts))


def verdicts_of_go(h: dict[str, Any], key: str, width: int, ready: Container[str]) -> list[Verdict]:
    """The verdicts a ``go`` for round ``key`` carries: its own round first, then the rounds of the
    batch in ``more`` that are waiting here (``ready``), counts checked against the ring's ``width``."""
    out = [Verdict.checked(key, h.get("ok"), h.get("err"), h.get("errc"), h.get("counts"), width)]
    more = h.get("more")
    for v in more if isinstance(more, list) else []:
        if isinstance(v, list) and len(v) == 5 and isinstance(v[0], str) and v[0] in ready:
            out.append(Verdict.checked(v[0], v[1], v[2], v[3], v[4], width))
    return out


def extend_batch(more: Any, ready: Container[str], entry: Callable[[str], list[Any]]) -> list[list[Any]]:
    """The batch a follower passes on in its ``start``: the prefix of ``more`` (``[[key, descs],
    ...]``) whose rounds are waiting here too, each with this node's ``entry(key)`` appended."""
    kept: list[list[Any]] = []
    for item in more if isinstance(more, list) else []:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], list) or item[0] not in ready):
            break
        kept.append([item[0], item[1] + [entry(item[0])]])
    return kept


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    """A node failed round ``key`` (``abort``). ``origin`` (``o``): the node that failed it first, on
    the fixed ring; the abort travels until it is next to its origin. ``error_class`` (``c``): the
    class the origin failed it with, when it was the round's own error. ``retry`` (elastic mode):
    the round is started again on the re-formed ring instead of failing. ``key`` None: the abort
    names no round (it fails the round in progress)."""

    key: str | None
    reason: str
    origin: int | None = None
    error_class: str | None = None
    retry: bool = False

    def header(self) -> dict[str, Any]:
        h: dict[str, Any] = {"t": "abort", "k": self.key, "reason": self.reason}
        if self.origin is not None:
            h["o"] = self.origin
        if self.error_class:
            h["c"] = self.error_class
        if self.retry:
            h["retry"] = True
        return h

    @classmethod
    def from_header(cls, h: dict[str, Any]) -> Abort | None:
        """None when the key is neither a round key's string nor absent (nothing could match it)."""
        key = h.get("k")
        if key is not None and not isinstance(key, str):
            return None
        o, c = h.get("o"), h.get("c")
        return cls(key, str(h.get("reason")), o if is_int(o) else None,
                   c if isinstance(c, str) and c.isidentifier() and c.endswith("Error") else None,
                   h.get("retry") is True)


@dataclasses.dataclass(frozen=True, slots=True)
class Membership:
    """Who is in a round in elastic mode, carried by its ``start`` and ``go``: the epoch ``ep``, the
    sorted live ring ``S``, its leader ``L``, the joiners ``J`` being admitted and the members'
    incarnations ``I`` (str(rank) -> incarnation)."""

    epoch: int
    ring: tuple[int, ...]
    leader: int
    joiners: tuple[int, ...] = ()
    incarnations: dict[str, str] = dataclasses.field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        return {"ep": self.epoch, "S": list(self.ring), "L": self.leader, "J": list(self.joiners),
                "I": dict(self.incarnations)}

    @classmethod
    def from_header(cls, h: dict[str, Any], world: int) -> Membership | None:
        """None unless ``S`` is a sorted list of distinct ranks of the ``world``-node hosts file,
        ``ep`` a non-negative int and ``L`` one of ``S``."""
        ring, ep, leader = ranks(h.get("S"), world), h.get("ep"), h.get("L")
        if ring is None or not is_int(ep) or ep < 0 or leader not in ring:
            return None
        joiners = h.get("J") if isinstance(h.get("J"), list) else []
        incs = h.get("I") if isinstance(h.get("I"), dict) else {}
        return cls(ep, tuple(ring), leader, tuple(j for j in joiners if is_int(j)),
                   {str(k): str(v) for k, v in incs.items()})


def ranks(x: Any, world: int) -> list[int] | None:
    """A sorted list of distinct ranks of a ``world``-node hosts file, or None."""
    if not isinstance(x, list) or not x or not all(is_int(r) for r in x):
        return None
    if x != sorted(set(x)) or x[0] < 0 or x[-1] >= world:
        return None
    return x


def _text(v: Any) -> str | None:
    return v if isinstance(v, str) else None


@dataclasses.dataclass(frozen=True, slots=True)
class Start:
    """The leader's ``start`` of round ``key``: the descriptions of the nodes it passed
    (``[[rank, description], ...]``), the batch's other rounds in ``more``, and (elastic mode) the
    ring it proposes, read from ``header`` by the membership (Membership.from_header)."""

    key: str
    descs: list[Any]
    more: list[Any]
    leader: Any  #: ``L``: the elastic ring's leader (None on the fixed ring)
    header: dict[str, Any]

    @classmethod
    def from_header(cls, h: dict[str, Any]) -> Start | None:
        key, descs, more = h.get("k"), h.get("descs"), h.get("more")
        if not isinstance(key, str) or not isinstance(descs, list):
            return None
        return cls(key, descs, more if isinstance(more, list) else [], h.get("L"), h)


@dataclasses.dataclass(frozen=True, slots=True)
class Go:
    """The leader's ``go`` for round ``key``: its verdicts (:func:`verdicts_of_go`, checked against
    the ring's width where the ring is known), the lane it opens (``[job, seq]`` or None) and the
    header, forwarded as it came."""

    key: str
    lane: tuple[str, int] | None
    header: dict[str, Any]

    @classmethod
    def from_header(cls, h: dict[str, Any]) -> Go | None:
        key, lane = h.get("k"), h.get("lane")
        if not isinstance(key, str):
            return None
        ok_lane = isinstance(lane, list) and len(lane) == 2 and isinstance(lane[0], str) and is_int(lane[1])
        return cls(key, (lane[0], lane[1]) if ok_lane else None, h)

    def verdicts(self, width: int, ready: Container[str]) -> list[Verdict]:
        return verdicts_of_go(self.header, self.key, width, ready)


@dataclasses.dataclass(frozen=True, slots=True)
class LaneClose:
    """A ``lane`` message: the leader closes the dense lane before round ``key``; with ``request``,
    a node asks the leader to (why)."""

    key: str
    request: str | None = None

    @classmethod
    def from_header(cls, h: dict[str, Any]) -> LaneClose | None:
        key, req = h.get("k"), h.get("req")
        if not isinstance(key, str) or (req is not None and not isinstance(req, str)):
            return None
        return cls(key, req or None)


@dataclasses.dataclass(frozen=True, slots=True)
class Commit:
    """A ``commit`` count: ``count`` consecutive nodes ending with the sender hold round ``key``'s
    result (RoundTransport.await_commit)."""

    key: str
    count: int

    @classmethod
    def from_header(cls, h: dict[str, Any]) -> Commit | None:
        key, c = h.get("k"), h.get("c")
        if not isinstance(key, str) or not is_int(c) or not 0 < c < COUNT_LIMIT:
            return None
        return cls(key, c)


class Data(NamedTuple):
    """A ring algorithm's message of round ``key`` (``lane``: of a lane round, one started without
    an agreement). Its other keys are the algorithm's, read by it from the header (birdnet/ring)."""

    key: str
    lane: bool

    @classmethod
    def from_header(cls, h: dict[str, Any]) -> Data | None:
        key = h.get("k")
        return cls(key, bool(h.get("ln"))) if isinstance(key, str) else None


_new_tuple = tuple.__new__

#: a peer message's kind -> its record's constructor (ping, pong, refuse, settle and settled are
#: the peer layer's own: handshake.py and settle.py check them where they are answered)
RECORDS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "start": Start.from_header, "go": Go.from_header, "abort": Abort.from_header,
    "lane": LaneClose.from_header, "commit": Commit.from_header, "data": Data.from_header}

def peer_record(h: dict[str, Any]) -> Any:
    """The record of a received peer header, or None when its kind has none or a field is malformed.
    Never raises: a header from the network that breaks a check is the sender's fault, not this
    node's (the caller drops it and counts it)."""
    if type(h) is not dict:
        return None
    t = h.get("t")
    if t == "data":  # every chunk of a round: built without a call to the class
        k = h.get("k")
        return _new_tuple(Data, (k, bool(h.get("ln")))) if type(k) is str else None
    make = RECORDS.get(t)
    if make is None:
        return None
    try:
        return make(h)
    except Exception:  # noqa: BLE001 - a check this module missed must not stop the ring thread
        return None


def record_of(msg: dict[str, Any]) -> Any:
    """The record of a message the peer layer returned (``msg["r"]``); one built outside it (a
    test's stand-in net) is decoded here the same way."""
    r = msg.get("r")
    return r if r is not None else peer_record(msg["h"])
