"""The peer message records (birdnet.messages.peer_record) and the round's state machine
(daemon/rounds.py): pure, no sockets."""
from __future__ import annotations

import itertools

import pytest
from birdnet.daemon.membership import LaneGivenUp, RingNeighbours, RoundRetry
from birdnet.daemon.rounds import Phase, Round, Step

from birdnet.errors import RoundAborted
from birdnet.hosts import Peer
from birdnet.messages import RECORDS, Abort, Commit, Data, Go, LaneClose, Start, peer_record

GOOD = {
    "start": {"t": "start", "k": "j/1", "descs": [], "more": []},
    "go": {"t": "go", "k": "j/1", "ok": True, "counts": [1, 1], "lane": ["j", 2]},
    "abort": {"t": "abort", "k": "j/1", "reason": "x", "o": 1, "c": "InputError"},
    "lane": {"t": "lane", "k": "j/1"},
    "commit": {"t": "commit", "k": "j/1", "c": 1},
    "data": {"t": "data", "k": "j/1", "ln": 1, "c": 3},
}
#: values of the wrong type a peer may send in any field
JUNK = [None, True, -1, 1 << 70, 1.5, "", "x" * 300, b"\xff", [], [1, [2]], {"a": 1}, {1: 2}]


def test_every_kind_has_a_record_and_the_good_headers_decode():
    assert set(GOOD) == set(RECORDS)
    recs = {t: peer_record(h) for t, h in GOOD.items()}
    assert isinstance(recs["start"], Start) and recs["start"].key == "j/1"
    assert isinstance(recs["go"], Go) and recs["go"].lane == ("j", 2)
    assert isinstance(recs["abort"], Abort) and recs["abort"].error_class == "InputError"
    assert recs["lane"] == LaneClose("j/1") and recs["commit"] == Commit("j/1", 1)
    assert recs["data"] == Data("j/1", True)
    # ``c`` means a different thing in each kind: the records name it
    assert recs["abort"].error_class == "InputError" and recs["commit"].count == 1


@pytest.mark.parametrize("kind", sorted(GOOD))
def test_malformed_headers_of_every_kind_never_raise(kind):
    """Every field of every kind replaced by junk (and removed): a record or None, never an
    exception; a malformed key, count or start is rejected (None)."""
    good = GOOD[kind]
    for field, junk in itertools.product([f for f in good if f != "t"] + ["L", "req", "more"], JUNK + ["<drop>"]):
        h = dict(good)
        if junk == "<drop>":
            h.pop(field, None)
        else:
            h[field] = junk
        rec = peer_record(h)  # must not raise
        if field == "k" and kind != "abort" and not isinstance(junk, str):  # a str: wire.check_peer's
            assert rec is None, (kind, junk)
        if rec is not None:
            assert isinstance(rec.key, str) or (kind == "abort" and rec.key is None)
    assert peer_record({"t": kind}) is None or kind == "abort"
    assert peer_record({"t": "commit", "k": "j/1", "c": 0}) is None
    assert peer_record({"t": "commit", "k": "j/1", "c": True}) is None
    assert peer_record({"t": "go", "k": "j/1", "lane": ["j", "2"]}).lane is None
    assert peer_record({"t": "start", "k": "j/1"}) is None  # no descriptions
    assert peer_record({"t": "lane", "k": "j/1", "req": 5}) is None


def test_headers_that_are_not_maps_or_have_no_record_give_none():
    for h in [None, [], "start", {"t": 5}, {"t": "ping"}, {"t": "settle", "k": "j/1"}, {}]:
        assert peer_record(h) is None


class _Ring:
    """A round's neighbours without a net: the member before this node is rank 0."""

    def __init__(self, rank: int = 1, other_aborts: bool = True) -> None:
        self.rank, self.world, self.other_aborts = rank, 3, other_aborts

    def accepts(self, msg):
        return msg.get("from") in (0, 1, 2)

    def from_left(self, msg):
        return msg.get("from") == 0


def _msg(h, sender=0):
    return {"h": h, "b": [], "from": sender, "r": peer_record(h)}


def _round(phase, *, leading=False, lane=False, ring=None, seen=None):
    rd = Round("j/5", ring or _Ring(), 0, phase=phase, leading=leading, lane=lane)
    if seen is not None:
        rd.on_other_abort = seen.append
    return rd


START_OTHER = {"t": "start", "k": "j/6", "descs": []}
START_SAME = {"t": "start", "k": "j/5", "descs": []}
GO_SAME = {"t": "go", "k": "j/5", "ok": True, "counts": [1, 1, 1]}
DATA = {"t": "data", "k": "j/5"}
DATA_LANE = {"t": "data", "k": "j/5", "ln": 1}
ABORT = {"t": "abort", "k": "j/5", "reason": "gone", "o": 2}
ABORT_RETRY = {"t": "abort", "k": "j/5", "reason": "gone", "retry": True}
ABORT_OTHER = {"t": "abort", "k": "j/4", "reason": "gone", "o": 2}
COMMIT = {"t": "commit", "k": "j/5", "c": 2}
LANE_HERE = {"t": "lane", "k": "j/5"}


def test_starting_follower():
    rd = _round(Phase.STARTING)
    assert rd.handle(_msg(START_OTHER)) is Step.FOLLOW
    assert rd.handle(_msg(START_OTHER, sender=2)) is Step.STALE  # not from the left
    assert rd.handle(_msg(START_SAME)) is Step.STALE
    assert rd.handle(_msg(ABORT)) is Step.ABORTED
    assert rd.handle(_msg(ABORT_RETRY)) is Step.PASS_ON
    for h in (GO_SAME, DATA, COMMIT, LANE_HERE, ABORT_OTHER):
        assert rd.handle(_msg(h)) is Step.STALE, h


def test_agreeing_leader_and_follower():
    leader = _round(Phase.AGREEING, leading=True)
    assert leader.handle(_msg(START_SAME)) is Step.TAKE
    assert leader.handle(_msg(START_OTHER)) is Step.STALE
    assert leader.handle(_msg(GO_SAME)) is Step.STALE
    follower = _round(Phase.AGREEING)
    assert follower.handle(_msg(GO_SAME)) is Step.TAKE
    assert follower.handle(_msg(GO_SAME, sender=2)) is Step.STALE
    assert follower.handle(_msg(START_OTHER)) is Step.FOLLOW and follower.handle(_msg(START_SAME)) is Step.FOLLOW
    for rd in (leader, follower):
        assert rd.handle(_msg(ABORT_OTHER)) is Step.ELSEWHERE
        assert rd.handle(_msg(ABORT_OTHER, sender=2)) is Step.STALE
        for h in (DATA, COMMIT, LANE_HERE):
            assert rd.handle(_msg(h)) is Step.STALE
        with pytest.raises(RoundAborted, match="gone"):
            rd.handle(_msg(ABORT, sender=2))  # an abort of the round fails it, whoever passed it
        with pytest.raises(RoundRetry):
            rd.handle(_msg(ABORT_RETRY))


def test_running_agreed_round():
    seen = []
    rd = _round(Phase.RUNNING, seen=seen)
    assert rd.handle(_msg(DATA)) is Step.TAKE
    assert rd.handle(_msg(DATA_LANE)) is Step.STALE  # an agreed round never takes lane data
    assert rd.handle(_msg({"t": "data", "k": "j/4"})) is Step.STALE
    assert rd.handle(_msg(DATA, sender=2)) is Step.STALE
    assert rd.handle(_msg(GO_SAME)) is Step.STALE
    assert rd.handle(_msg(COMMIT)) is Step.COUNT and rd.handle(_msg(COMMIT, sender=2)) is Step.STALE
    assert rd.handle(_msg(LANE_HERE)) is Step.STALE  # not a lane round
    assert rd.handle(_msg(ABORT_OTHER)) is Step.STALE and [a.key for a in seen] == ["j/4"]
    with pytest.raises(RoundAborted):
        rd.handle(_msg(ABORT))
    with pytest.raises(RoundAborted, match="abandoned upstream"):
        rd.handle(_msg(START_OTHER))
    assert rd.interrupt is not None and rd.interrupt["h"] is START_OTHER


def test_running_lane_round():
    seen = []
    rd = _round(Phase.RUNNING, lane=True, seen=seen)
    assert rd.handle(_msg(DATA_LANE)) is Step.TAKE and rd.handle(_msg(DATA)) is Step.STALE
    with pytest.raises(LaneGivenUp):
        rd.handle(_msg(ABORT_OTHER))  # an earlier round of the job failed: given up, after being told
    assert [a.key for a in seen] == ["j/4"]
    assert _round(Phase.RUNNING, lane=True, seen=[]).handle(
        _msg({"t": "abort", "k": "j/9", "reason": "x", "o": 2})) is Step.STALE  # a later one: remembered only
    with pytest.raises(LaneGivenUp):
        rd.handle(_msg(LANE_HERE))
    assert rd.handle(_msg({"t": "lane", "k": "j/6"})) is Step.STALE
    with pytest.raises(RoundAborted, match="without an agreement"):
        _round(Phase.RUNNING, lane=True, ring=_Ring(rank=0)).handle(_msg({"t": "lane", "k": "j/5", "req": "why"}))
    with pytest.raises(LaneGivenUp):
        rd.handle(_msg(START_OTHER))


def test_committing():
    rd = _round(Phase.COMMITTING)
    assert rd.handle(_msg(COMMIT)) is Step.COUNT
    for h in (START_OTHER, GO_SAME, {"t": "data", "k": "j/6"}, ABORT_OTHER):
        assert rd.handle(_msg(h)) is Step.LATER, h
    assert rd.handle(_msg(LANE_HERE)) is Step.STALE
    with pytest.raises(RoundAborted):
        rd.handle(_msg(ABORT))


@pytest.mark.parametrize("phase", [Phase.DONE, Phase.FAILED, Phase.RETRY, Phase.GIVEN_UP])
def test_a_finished_round_takes_nothing(phase):
    rd = _round(phase)
    for h in (START_OTHER, GO_SAME, DATA, COMMIT, LANE_HERE, ABORT, ABORT_OTHER):
        assert rd.handle(_msg(h)) is Step.STALE


def test_an_elastic_round_ignores_nodes_outside_its_ring_and_other_rounds_aborts():
    class Net:
        rank = 1
        peers = [Peer(r, "127.0.0.1", 1) for r in range(4)]

    ring = RingNeighbours(Net(), [0, 1, 2])
    seen = []
    rd = _round(Phase.RUNNING, ring=ring, seen=seen)
    assert rd.handle(_msg(DATA, sender=3)) is Step.STALE
    assert rd.handle(_msg(DATA, sender=0)) is Step.TAKE
    assert rd.handle(_msg(ABORT_OTHER)) is Step.STALE and seen == []  # it travels its own round's ring


def test_the_verdict_gives_the_counts():
    from birdnet.messages import Verdict

    rd = _round(Phase.RUNNING)
    assert rd.counts is None  # a lane round learns the total from the ring
    rd.verdict = Verdict("j/5", True, None, None, (2, 1, 1))
    assert rd.counts == [2, 1, 1]


def test_a_long_wait_is_logged_once_per_round_and_place(caplog):
    """A round stuck until round_timeout must leave a line naming where it waits (StallLog)."""
    import logging
    import time

    from birdnet.daemon.rounds import StallLog
    stalls, calls = StallLog(after=5.0), []

    def describe():
        calls.append(1)
        return "what the node knows"
    now = time.monotonic()
    with caplog.at_level(logging.INFO, logger="birdnet.engine"):
        stalls.check("j/1", "for its start", now, describe)  # not long yet: nothing, not even described
        for _ in range(3):
            stalls.check("j/1", "for its start", now - 6.0, describe)
        stalls.check("j/1", "for its go", now - 6.0, describe)
    lines = [r.getMessage() for r in caplog.records if r.name == "birdnet.engine"]
    assert len(lines) == 2 and len(calls) == 2, lines
    assert lines[0].startswith("round j/1 has waited 6.0 s for its start: what the node knows"), lines
    for i in range(StallLog.MAX_KEPT + 1):  # bounded: the places said are forgotten past MAX_KEPT
        stalls.check(f"j/{i + 2}", "here", now - 6.0, describe)
    assert len(stalls._said) <= StallLog.MAX_KEPT
    with caplog.at_level(logging.INFO, logger="birdnet.engine"):
        stalls.check("j/0", "here", now - 6.0, lambda: 1 / 0)  # never raises into the round
    assert "not described: ZeroDivisionError" in caplog.records[-1].getMessage()


def test_the_memberships_describe_what_a_long_wait_knows():
    from types import SimpleNamespace

    from birdnet.daemon.elastic import ElasticRing
    from birdnet.daemon.membership import FixedRing
    m = ElasticRing(None, rank=1, world=4)
    m.bind(SimpleNamespace(rank=1, info={0: {"ep": 0, "want": True}, 2: {"ep": 2, "want": False}}))
    text = m.describe_wait()
    assert "epoch 0" in text and "{0: (0, True), 2: (2, False)}" in text, text
    f = FixedRing(None, 0, 2)
    f.bind(SimpleNamespace(lost=lambda: {1}))
    assert f.describe_wait() == "lost [1]"
