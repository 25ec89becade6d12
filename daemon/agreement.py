"""The start/go agreement's decisions, with no sockets: what a node contributes to a ``start``
(its description of a round) and the leader's verdicts on the descriptions that came back round
the ring (the ring worker sends and waits; daemon/engine.py).

Across nodes, the order of rounds is the leader's (rank 0 on the fixed ring): it sends a ``start``
naming the round; each node appends its description once its own processes are ready and passes it
on; when the start is back, the leader compares the descriptions and sends ``go`` with its verdict.
Every node therefore runs the same rounds in the same order, and a disagreement (shape, codec, a
process that never came) fails the round everywhere with one message instead of hanging. One
exchange agrees up to ``MAX_BATCH`` rounds (each follower keeps the prefix ready on its node).
"""
from __future__ import annotations

from collections.abc import Container
from typing import Any

from birdnet.daemon.membership import check_descs
from birdnet.daemon.runner import AGREED, LocalRound

from birdnet.errors import ProtocolError
from birdnet.messages import COUNT_LIMIT, Verdict, is_int

#: rounds agreed in one start/go exchange at most (a training step's tensors, typically)
MAX_BATCH = 32


def description(rank: int, rnd: LocalRound) -> dict[str, Any]:
    """What node ``rank`` puts in a ``start`` for ``rnd``: its description, its process count and,
    when it failed the round alone already, the error and its class."""
    d = dict(rnd.desc)
    d["count"] = len(rnd.parts)
    if rnd.error is not None:
        d["error"] = str(rnd.error)
        d["error_class"] = type(rnd.error).__name__
    return d


def error_class(descs: list[tuple[int, dict[str, Any]]]) -> str:
    """The error class a failed round is reported with: the first node's own error class (e.g.
    InputError for NaN under nan_policy='reject'), else a mismatch."""
    for _r, d in descs:
        if d.get("error"):
            return str(d.get("error_class") or "InputError")
    return "RoundMismatchError"


def describe_difference(descs: list[tuple[int, dict[str, Any]]]) -> str | None:
    """None when all descriptions agree; else a message naming the tensor, ranks and fields."""
    errors = [f"node rank {r}: {d['error']}" for r, d in descs if d.get("error")]
    if errors:
        return "; ".join(errors)
    r0, d0 = descs[0]
    diffs = []
    for r, d in descs[1:]:
        for f in AGREED:
            if d.get(f) != d0.get(f):
                diffs.append(f"{f} is {d0.get(f)!r} on node rank {r0} but {d.get(f)!r} on node rank {r}")
    if not diffs:
        return None
    return f"round for tensor {d0.get('name')!r} does not match across nodes: " + "; ".join(diffs)


def verdict_of(key: str, descs: list[tuple[int, dict[str, Any]]]) -> Verdict:
    """The leader's verdict on one round of a start, from every node's description."""
    problem = describe_difference(descs)
    counts = [d.get("count", 0) for _, d in descs]
    if not all(is_int(c) and 0 <= c < COUNT_LIMIT for c in counts):
        raise ProtocolError(f"round {key}: bad process counts {counts!r} came back round the ring")
    return Verdict(key, problem is None, problem, error_class(descs), tuple(counts))


def verdicts_of_start(h: dict[str, Any], key: str, extras: Container[str], ring: Any) -> list[Verdict]:
    """The leader's verdicts on the rounds of its ``start`` ``h`` that came back round ``ring``:
    round ``key`` and the prefix of ``extras`` (rounds waiting here) the followers kept (each
    round's descriptions checked: one per member, in the order of the ring)."""
    verdicts = [verdict_of(key, check_descs(h.get("descs"), key, ring))]
    more = h.get("more") if isinstance(h.get("more"), list) else []
    for item in more:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                or item[0] not in extras):
            raise ProtocolError(f"round {key}: malformed batch in the start message")
        verdicts.append(verdict_of(item[0], check_descs(item[1], item[0], ring)))
    return verdicts
