"""Numbering of peer messages: how a node notices messages lost on a TCP connection that broke.

Every message to a peer carries ``q``, one more than the last to that peer (pings too). ZeroMQ
delivers a connection's messages in order and loses none unless the TCP connection breaks (a NAT
box, a flapping link, ``ss -K``): then what was in flight on it is gone, and the next message from
that sender, or its next ping (one heartbeat later), shows a jump. Without this, a lost *last*
message of a round, or a lost control message, was only noticed by the timeouts (a dense-lane
round: round_timeout, 600 s by default). Pings never answered are counted too: past
peer_timeout's worth the queue for that peer is dropped and the numbering restarts (``qr``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def lost_between(last: int | None, header: dict[str, Any]) -> tuple[int, int | None]:
    """How many numbered messages of one connection went missing before ``header`` (its ``q``), when
    the one before had number ``last``; and the number to remember. A message without a number
    (garbage, or a peer that does not number) changes nothing."""
    q = header.get("q")
    if not isinstance(q, int) or isinstance(q, bool):
        return 0, last
    if header.get("qr"):
        return 0, q  # the sender dropped its queue on purpose (Numbering.count_ping): numbering restarts
    return (q - last - 1 if last is not None and q > last + 1 else 0), q


def lost_text(n: int, sender: str) -> str:
    return (f"{n} message(s) from {sender} were lost: the TCP connection between the two daemons broke and "
            "reconnected while they were in flight")


class Numbering:
    """The numbers of one node's peer messages, per peer: what it sent, what it received, the gaps
    seen and not yet taken by a wait, and the pings each peer left unanswered."""

    def __init__(self, peer_timeout: float, heartbeat_interval: float) -> None:
        self.sent_q_to: dict[int, int] = {}  #: rank -> the number of the last message to it
        #: the last ``q`` from each accepted sender (PeerNet._decode_router notes the next one in
        #: order itself, received() the rest)
        self.q_from: dict[int, int | None] = {}
        #: per sending rank, why the round that next waits for it must fail (take_gap). Never
        #: rebound: a reader may keep it and test it before calling take_gap (RoundTransport)
        self.gaps: dict[int, str] = {}
        self.messages_lost = 0  #: messages lost on broken connections, for status
        self.lost_from: dict[int, int] = {}  #: messages lost per sending rank, for metrics
        #: rank -> pings sent since its last pong or refusal, and the most kept queued (count_ping)
        self._unanswered: dict[int, int] = {}
        self.max_unanswered = int(peer_timeout / heartbeat_interval) + 2
        #: ranks whose queue count_ping dropped: the next message to each carries ``qr`` (lost_between;
        #: PeerNet.send numbers a message itself while this is empty, fields() and sent() otherwise)
        self.renumber: set[int] = set()
        self._quiet: set[int] = set()  #: ranks whose queue was dropped since their last answer

    # -- sending ---------------------------------------------------------------------------------
    def fields(self, rank: int) -> dict[str, int]:
        """The numbering fields of the next message to ``rank``: its number, and ``qr`` when the
        queue before it was dropped (count_ping)."""
        q = self.sent_q_to.get(rank, 0) + 1
        return {"q": q, "qr": 1} if rank in self.renumber else {"q": q}

    def sent(self, rank: int, fields: dict[str, int]) -> None:
        """ZeroMQ took the message with ``fields``: only what it took counts (the receiver expects no
        gap otherwise)."""
        self.sent_q_to[rank] = fields["q"]
        self.renumber.discard(rank)

    def count_ping(self, rank: int) -> bool:
        """Count a ping about to go to ``rank``; True when peer_timeout's worth of pings went
        unanswered and the caller must drop what is queued for it (reconnect its socket). What the
        queue held had numbers the peer will never see: the next message says the numbering
        restarts, or the peer's first round after it comes back would fail on a gap of dropped pings."""
        n = self._unanswered.get(rank, 0) + 1
        drop = n > self.max_unanswered
        if drop:
            self.renumber.add(rank)
            n = 1
        self._unanswered[rank] = n
        return drop

    def answered(self, rank: int) -> None:
        self._unanswered[rank] = 0
        self._quiet.discard(rank)

    def first_drop(self, rank: int) -> bool:
        """True at the first queue drop for ``rank`` since its last answer (for the log)."""
        first = rank not in self._quiet
        self._quiet.add(rank)
        return first

    # -- receiving -------------------------------------------------------------------------------
    def restart(self, rank: int, header: dict[str, Any]) -> None:
        """A new connection of ``rank`` was accepted at ``header`` (its first ping): its numbering
        starts there, and a gap of its old connection is forgotten."""
        self.q_from[rank] = lost_between(None, header)[1]
        self.gaps.pop(rank, None)

    def received(self, rank: int, header: dict[str, Any], sender: Callable[[], str]) -> str | None:
        """Note ``header`` from accepted ``rank`` (``sender()`` names it: called only for a gap, as
        this runs for every message); the gap text when messages before it were lost, else None."""
        n, self.q_from[rank] = lost_between(self.q_from.get(rank), header)
        if not n:
            return None
        self.messages_lost += n
        self.lost_from[rank] = self.lost_from.get(rank, 0) + n
        self.gaps[rank] = lost_text(n, sender())
        return self.gaps[rank]

    def take_gap(self, rank: int) -> str | None:
        """Why a wait for ``rank`` must give up (messages from it were lost since the last wait for
        it), once; else None."""
        return self.gaps.pop(rank, None)
