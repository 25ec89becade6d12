"""What a node knows of its peers' liveness, with no sockets: when each was last heard, which count
as lost and which restarted since a round began.

The left neighbour is alive while anything from it arrived within ``peer_timeout``; the right
neighbour while pongs arrive. A node that loses a neighbour reports it in its pings, and every node
adds what its left neighbour reports (fixed ring), so within a few heartbeats every node knows which
peer is lost, names it in the errors its clients see, and forgets it when it is back. PeerNet owns
one (``net.live``) and notes there what its poll loop hears; who counts as silent is the
membership's answer (membership.py ``silent``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger("birdnet.peers")


class PeerLiveness:
    """Last-heard times, restarts and lost ranks of one node's peers (see the module docstring)."""

    def __init__(self, peers: Sequence[Any], rank: int, peer_timeout: float, duplicates: Mapping[int, str]) -> None:
        self.peers, self.rank, self.world = peers, rank, len(peers)
        self.peer_timeout = peer_timeout
        #: rank -> why its connections are refused (two live daemons claim it): never counted heard
        self.duplicates = duplicates
        self.started = time.monotonic()
        self.seen = [0.0] * self.world  #: monotonic time of the last ping, pong or message per rank
        self.left_seen = 0.0  #: the last message from the left neighbour
        self.right_seen = 0.0  #: the last pong from the right neighbour
        #: bumped when a neighbour comes back as a new incarnation (a restarted daemon): a round in
        #: flight here then cannot complete (the new instance knows nothing of it), see
        #: FixedNeighbours.gone. Its first ping is a precise cut: what it sends before that ping is
        #: held (HeldMessages), what the old instance sent after it is dropped (PeerNet._replaced). The
        #: right-hand side learns a little later, from the new incarnation in a pong (PeerNet._note_pong):
        #: a round of its own the new instance never saw (a leader's start, a lane round) then
        #: fails at once instead of at round_timeout.
        self.neighbour_restarts = 0
        self.last_restart = ""  #: which neighbour restarted last, for error messages
        #: rank -> neighbour_restarts right after its latest restart was seen (a new identity)
        self.restart_seq: dict[int, int] = {}
        self.own_lost: set[int] = set()
        self.left_reports: set[int] = set()  #: the ranks the left neighbour's pings say are lost

    def note_restart(self, r: int | None, why: str) -> None:
        """A restart (or a second daemon claiming rank ``r``): rounds in flight with it cannot complete."""
        self.neighbour_restarts += 1
        if r is not None:
            self.restart_seq[r] = self.neighbour_restarts
        self.last_restart = why

    def update_lost(self, own: set[int]) -> set[int]:
        """Ranks believed lost: this node's own observations ``own`` (logged as they change), plus on
        the fixed ring what the left neighbour reports."""
        if own != self.own_lost:
            for r in sorted(own - self.own_lost):
                log.warning("peer rank %d (%s) lost: nothing heard for %.1f s", r, self.peers[r].address,
                            self.peer_timeout)
            for r in sorted(self.own_lost - own):
                log.info("peer rank %d (%s) is back", r, self.peers[r].address)
            self.own_lost = own
        return (own | self.left_reports) - {self.rank}

    def heard(self, r: int, now: float | None = None) -> bool:
        """Something from rank ``r`` arrived within peer_timeout (no grace after start-up)."""
        if r == self.rank:
            return True
        if r in self.duplicates:
            return False  # two daemons claim it (its pongs still come, from the one we dial)
        now = time.monotonic() if now is None else now
        return self.seen[r] > 0 and now - self.seen[r] <= self.peer_timeout

    def presumed(self, r: int, now: float | None = None) -> bool:
        """Rank ``r`` is not (yet) counted lost: heard within peer_timeout, or this daemon started
        less than peer_timeout ago."""
        if r == self.rank:
            return True
        if r in self.duplicates:
            return False
        now = time.monotonic() if now is None else now
        return now - max(self.seen[r], self.started) <= self.peer_timeout

    def alive(self) -> set[int]:
        """The ranks heard within peer_timeout (this node's own included)."""
        now = time.monotonic()
        return {r for r in range(self.world) if self.heard(r, now)}

    def gone(self, ring: list[int], since: int, describe_lost: Callable[[set[int]], str],
             now: float | None = None) -> str | None:
        """Why a round on ``ring`` that began when neighbour_restarts was ``since`` cannot go on:
        members counted lost, or restarted since (their new instance knows nothing of the round),
        else None."""
        now = time.monotonic() if now is None else now
        lost = {r for r in ring if not self.presumed(r, now)}
        back = [r for r in ring if self.restart_seq.get(r, 0) > since]
        if not lost and not back:
            return None
        why = [f"lost peer {describe_lost(lost)}"] if lost else []
        why += [f"rank {r} ({self.peers[r].address}) restarted" for r in back]
        return "; ".join(why)

    def restarted_since(self, since: int) -> str | None:
        """Which neighbour restarted (for an error message) if one did after neighbour_restarts was
        ``since``, else None."""
        return f"neighbour {self.last_restart}" if self.neighbour_restarts != since else None
