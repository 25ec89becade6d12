"""A round as the control plane sees it: key, ring, deadline, phase and verdict in one record.

The ring worker makes one per agreement (the leader in ``_lead``, a follower in ``_follow``) and one
per round it runs (``_run_batch``, a lane round in ``_run_lane``); the agreement's waits and the
round's transport read it instead of a key, a restart count and a deadline passed separately. Its
phase says where the round is on this node:

============  ===========================================================================
phase         meaning
============  ===========================================================================
starting      the agreement began here: the leader sent its start, or a follower waits for
              its processes to submit the round
agreeing      this node passed its part on and waits for the agreement to come back (the
              leader for its start, a follower for the leader's go)
running       the data phase (an agreed round with its verdict, or a lane round)
done          completed here
failed        failed here (and aborted round the ring)
retry         the agreement was abandoned (elastic mode): the round waits for a new start
given-up      a lane round given up, to run once agreed
============  ===========================================================================
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

from birdnet.messages import Verdict


class Phase(str, enum.Enum):
    STARTING = "starting"
    AGREEING = "agreeing"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    RETRY = "retry"
    GIVEN_UP = "given-up"


@dataclasses.dataclass
class Round:
    """One round on this node's control plane (see the module docstring)."""

    key: str
    ring: Any  #: the round's neighbours (membership.FixedNeighbours or RingNeighbours)
    since: int  #: net.neighbour_restarts when its agreement began here: a change fails the round
    deadline: float = float("inf")  #: monotonic time the current wait gives up at
    lane: bool = False  #: started without an agreement (the dense lane)
    phase: Phase = Phase.STARTING
    verdict: Verdict | None = None  #: the leader's verdict, once the go came
    #: a ``start`` of another round that arrived while this one ran (the worker follows it next)
    interrupt: dict[str, Any] | None = None

    def wait_until(self, deadline: float, phase: Phase | None = None) -> Round:
        """The next wait gives up at ``deadline`` (and the round moves to ``phase``)."""
        self.deadline = deadline
        if phase is not None:
            self.phase = phase
        return self
