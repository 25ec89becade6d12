"""The dense lane (daemon/engine.py): a job's dense all-reduces after an agreed round start without
an agreement. Real daemons on loopback; every result is checked against the mean computed here and
for bit-identity across nodes; the daemons' counters say which rounds ran in the lane."""
from __future__ import annotations

import numpy as np
import pytest
import workers
from cluster import LocalCluster

from birdnet.errors import PeerLostError, ProtocolError
from birdnet.ring.dense import ring_allreduce
from birdnet.ring.transport import MemoryRing

pytestmark = pytest.mark.heavy  # CI runs it on the default Python only (.ci/run)


def expected_mean(i: int, size: int, n: int) -> np.ndarray:
    """What lane_rounds' call ``i`` averages: seeded data of every global rank, summed in float64."""
    acc = np.zeros(n, np.float64)
    for r in range(size):
        acc += np.random.default_rng([i, r]).standard_normal(n).astype(np.float32)
    return acc / size


def check_results(res, plan, size, n, skip=()):
    outs = [out for out, _status in res]
    for i, what in enumerate(plan):
        if what == "barrier" or i in skip:
            continue
        first = outs[0][i]
        assert first[0] == "ok", first
        for o in outs[1:]:  # bit-identical on every node and process
            assert o[i][0] == "ok", o[i]
            assert np.array_equal(o[i][1], first[1])
        if what == "dense":
            np.testing.assert_allclose(first[1], expected_mean(i, size, n), rtol=0, atol=1e-5)


def test_counts_travel_with_the_data_and_the_mean_is_the_agreed_one():
    """ring_allreduce with ``count`` (no agreement) gives the same bits as with the agreed total."""
    world, n = 4, 10_007
    xs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(world)]
    counts = [1, 3, 2, 2]
    learned = [dict() for _ in range(world)]
    ring = MemoryRing(world)
    got = ring.run(lambda t: ring_allreduce(t, xs[t.rank].copy(), timeout=10, chunk_bytes=4096, count=counts[t.rank],
                                            mean=True, learned=learned[t.rank]))
    ring = MemoryRing(world)
    agreed = ring.run(lambda t: ring_allreduce(t, xs[t.rank].copy(), timeout=10, chunk_bytes=4096,
                                               divide_by=sum(counts)))
    for r in range(world):
        assert learned[r]["count"] == sum(counts)
        assert np.array_equal(got[r], agreed[r])


@pytest.mark.parametrize("phase, n, needle", [
    ("rs", -1, "ring rs step 0: bad process count -1 from rank 0"),
    ("rs", True, "ring rs step 0: bad process count True from rank 0"),
    ("ag", 3, "ring ag step 0: rank 0 counted 3 processes, this node 2"),
])
def test_a_bad_or_different_count_is_refused(phase, n, needle):
    """A count that is no count, or an all-gather total other than the one this node summed, fails
    the round on the node that receives it (the other waits, then gives up), naming the numbers."""
    ring = MemoryRing(2)
    real_send = ring.transports[0].send
    ring.transports[0].send = lambda h, b=(): real_send({**h, "n": n} if h.get("p") == phase else h, b)

    def node(t):
        try:
            ring_allreduce(t, np.ones(5000, np.float32), timeout=2.0, chunk_bytes=4096, count=1, mean=True)
        except (ProtocolError, PeerLostError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"
    got = ring.run(node, timeout=30)
    assert got[1] == f"ProtocolError: {needle}", got


def test_a_round_writes_nothing_until_every_node_has_joined():
    """Without rank 0 the others cannot finish a segment, so their buffers stay as they were
    (what makes giving a lane round up safe), though they exchange partial sums among themselves."""
    world, n = 4, 4096
    xs = [np.full(n, float(r + 1), np.float32) for r in range(world)]
    ring = MemoryRing(world)

    def node(t):
        if t.rank == 0:
            return None  # the leader never joins
        try:
            ring_allreduce(t, xs[t.rank], timeout=1.0, chunk_bytes=1024, inplace=True, count=1)
        except PeerLostError:
            return "timed out"
    assert ring.run(node, timeout=30) == [None, "timed out", "timed out", "timed out"]
    assert sum(len(t.messages_sent) for t in ring.transports) > world  # partial sums did travel
    for r in range(world):
        assert np.all(xs[r] == r + 1)


@pytest.mark.timeout(180)
def test_a_jobs_dense_rounds_run_in_the_lane(tmp_path):
    plan = ["dense"] * 8
    # 2 processes per node (the counts travel with the data); small chunks: many messages per
    # segment, so a fast neighbour's next-round data arrives early and must be kept for it
    with LocalCluster(3, tmp_path, local_size=2, extra=["--chunk-bytes", "65536"]) as cl:
        res = cl.run(workers.lane_rounds, plan, 100_000)
    check_results(res, plan, 6, 100_000)
    for _out, st in res:
        # the first round is agreed, it opens the lane
        assert (st["lane_rounds"], st["round_agreements"], st["rounds_failed"]) == (len(plan) - 1, 1, 0), st


@pytest.mark.timeout(180)
def test_the_lane_closes_for_other_rounds_and_opens_again(tmp_path):
    plan = ["dense", "dense", "barrier", "dense", "marsit", "dense", "dense"]
    with LocalCluster(3, tmp_path) as cl:
        res = cl.run(workers.lane_rounds, plan, 5000)
    check_results(res, plan, 3, 5000)
    for _out, st in res:
        # agreed: calls 0 and 2 (barrier); each opens the lane for the next call, and marsit runs
        # in the lane like a dense round (test_compressed_rounds_run_in_the_lane_...)
        assert (st["lane_rounds"], st["round_agreements"]) == (5, 2), st


@pytest.mark.timeout(180)
def test_no_dense_lane_agrees_every_round(tmp_path):
    plan = ["dense"] * 4
    with LocalCluster(3, tmp_path, extra=["--no-dense-lane"]) as cl:
        res = cl.run(workers.lane_rounds, plan, 5000)
    check_results(res, plan, 3, 5000)
    for _out, st in res:
        assert st["lane_rounds"] == 0
        assert st["round_agreements"] == len(plan)


@pytest.mark.timeout(180)
def test_a_mismatch_in_the_lane_fails_on_every_node_and_the_next_round_is_agreed(tmp_path):
    plan = ["dense"] * 4
    with LocalCluster(3, tmp_path) as cl:
        res = cl.run(workers.lane_rounds, plan, 5000, "default", None, (2, 1))
    check_results(res, plan, 3, 5000, skip={1})
    for out, st in res:
        kind, msg = out[1]
        assert kind == "RoundMismatchError", out[1]
        assert "shape" in msg and "default-w" in msg
        assert st["rounds_failed"] == 1


@pytest.mark.timeout(180)
def test_a_lane_round_given_up_for_another_job_runs_later_with_its_inputs_intact(tmp_path):
    """Nodes 1 and 2 start job A's call 1 in the lane; the leader's process of A comes 1.5 s
    late, and job B's round is ready at the leader first: the leader closes the lane, nodes 1 and
    2 give the round up, B runs, then A's call 1 is agreed; its result is the mean of the inputs
    as they were (nothing of the abandoned attempt was written into them)."""
    import time
    plan = ["dense", "dense", "dense"]
    with LocalCluster(3, tmp_path) as cl:
        a = cl.run_async(workers.lane_rounds, plan, 20_000, "A", (0, 1, 1.5))
        time.sleep(0.8)
        b = cl.run_async(workers.lane_rounds, ["dense", "dense"], 3000, "B")
        res_b = b.get(60)
        res_a = a.get(60)
    check_results(res_a, plan, 3, 20_000)
    check_results(res_b, ["dense", "dense"], 3, 3000)
    given_up = [st["lane_rounds_given_up"] for _o, st in res_a]
    assert given_up[0] == 0 and given_up[1] >= 1 and given_up[2] >= 1, given_up


@pytest.mark.timeout(180)
def test_a_lane_round_a_process_never_submits_times_out_everywhere(tmp_path):
    """Node 2's process is 9 s late for call 1; the others are in the lane round and give up
    after round_timeout (2 s here) + peer_timeout (4 s), with RoundTimeoutError; node 2's late
    call fails at once with the same error (the round was aborted everywhere)."""
    plan = ["dense", "dense"]
    with LocalCluster(3, tmp_path, extra=["--round-timeout", "2"]) as cl:
        res = cl.run(workers.lane_rounds, plan, 5000, "default", (2, 1, 9.0))
    for node, (out, _st) in enumerate(res):
        kind, msg = out[1]
        assert kind == "RoundTimeoutError" and "round_timeout" in msg, (node, out[1])
    check_results(res, plan, 3, 5000, skip={1})


class _StubNet:
    """What RoundTransport reads of a PeerNet, with scripted messages (the real one is exercised by
    the tests above; this pins the transport's reactions one message at a time)."""

    def __init__(self, msgs, early=None):
        from collections import deque

        from birdnet.config import Settings
        self.msgs, self.early = deque(msgs), {k: deque(v) for k, v in (early or {}).items()}
        self.stopping, self.neighbour_restarts, self.rank, self.world = False, 0, 1, 3
        self.bytes_received = self.bytes_sent = 0
        self.reading = None
        self.settings = Settings(round_timeout=1.0)
        self.gaps = {}  # no message lost (PeerNet.gaps)

    def lost(self):
        return set()

    def restarted_since(self, since):
        return None

    def take_gap(self):  # no message lost (PeerNet.take_gap)
        return None

    def poll(self, timeout, data=False):
        return self.msgs.popleft() if self.msgs else None

    def take_early(self, key):
        q = self.early.get(key)
        return q.popleft() if q else None


def _data(key, lane=True):
    h = {"t": "data", "k": key, "p": "rs", "s": 0, "c": 0}
    if lane:
        h["ln"] = 1
    return {"h": h, "b": [memoryview(b"\0" * 8)]}


def test_lane_transport_reactions():
    import time

    from birdnet.daemon.peers import LaneGivenUp, RoundAborted, RoundTransport

    from birdnet.errors import RoundTimeoutError
    soon = time.monotonic() + 5
    # kept early data first; a later round's abort is passed on, not fatal; stale agreed data of
    # the same key is skipped
    seen = []
    net = _StubNet([{"h": {"t": "abort", "k": "J/6", "o": 2, "reason": "x"}, "b": []}, _data("J/5", lane=False),
                    _data("J/5")], early={"J/5": [_data("J/5")]})
    t = RoundTransport(net, "J/5", lane=True)
    t.on_other_abort = seen.append
    assert t.recv(soon)[0]["k"] == "J/5"  # the early one
    h, _ = t.recv(soon)
    assert h.get("ln") == 1 and [a.key for a in seen] == ["J/6"]
    # an earlier round of the job failed: the node that failed it will not join this one in the
    # lane, so it is given up (and run once agreed), after the abort was handed on
    t = RoundTransport(_StubNet([{"h": {"t": "abort", "k": "J/4", "o": 2, "reason": "x"}, "b": []}]), "J/5", lane=True)
    t.on_other_abort = seen.append
    with pytest.raises(LaneGivenUp):
        t.recv(soon)
    assert seen[-1].key == "J/4"
    # an abort of this very round still fails it
    t = RoundTransport(_StubNet([{"h": {"t": "abort", "k": "J/5", "o": 2, "reason": "x"}, "b": []}]), "J/5", lane=True)
    with pytest.raises(RoundAborted, match="x"):
        t.recv(soon)
    # the leader closes the lane at this round, or starts an agreement: give it up
    t = RoundTransport(_StubNet([{"h": {"t": "lane", "k": "J/6"}, "b": []}, {"h": {"t": "lane", "k": "J/5"}, "b": []}]),
                       "J/5", lane=True)
    with pytest.raises(LaneGivenUp):
        t.recv(soon)
    start = {"h": {"t": "start", "k": "K/0", "descs": []}, "b": []}
    t = RoundTransport(_StubNet([start]), "J/5", lane=True)
    with pytest.raises(LaneGivenUp):
        t.recv(soon)
    assert t.interrupt is start and t.round.interrupt is start  # the round object keeps it
    # an agreed round never takes lane data, and a lane round waits round_timeout, not peer_timeout
    t = RoundTransport(_StubNet([_data("J/5"), _data("J/5", lane=False)]), "J/5")
    assert "ln" not in t.recv(soon)[0]
    t = RoundTransport(_StubNet([]), "J/5", lane=True)
    with pytest.raises(RoundTimeoutError, match="round_timeout"):
        t.recv(time.monotonic() + 0.05)


@pytest.mark.timeout(240)
def test_a_job_that_ends_with_the_lane_open_and_runs_again_is_not_hit_by_it(tmp_path):
    """Each run's processes leave with the lane open at their next call; the daemons reap them (the
    job "departed") while the next run of the job, numbering its calls from 0, is starting on other
    nodes. Nobody is in that lane round, so it must not be aborted: such an abort outlived the job's
    restart on some node and failed the next run's call of the same number (found by the soak test)."""
    plan = ["dense"] * 6
    with LocalCluster(3, tmp_path) as cl:
        for _run in range(3):
            res = cl.run(workers.lane_rounds, plan, 2000)
            check_results(res, plan, 3, 2000)
            for _out, st in res:
                assert st["rounds_failed"] == 0


def _compressed_results(tmp_path, plan, n, extra=(), bad_codec=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    with LocalCluster(3, tmp_path, extra=list(extra)) as cl:
        return cl.run(workers.lane_rounds, plan, n, "C", None, None, bad_codec)


@pytest.mark.timeout(240)
def test_compressed_rounds_run_in_the_lane_with_the_agreed_results(tmp_path):
    """Compressed all-reduces start without an agreement too, and give the same bits as agreed
    rounds (a cluster with --no-dense-lane, the same seeds): the codec's state, seed and counts are
    what the agreement would have given. A codec with flush rounds is agreed."""
    plan = ["dense", "birdplus", "birdplus", "marsit", "marsit", "birdplus_shared", "birdplus_shared",
            "marsit_flush", "birdplus", "marsit"]
    lane = _compressed_results(tmp_path / "lane", plan, 20_000)
    agreed = _compressed_results(tmp_path / "agreed", plan, 20_000, extra=["--no-dense-lane"])
    check_results(lane, plan, 3, 20_000)
    for (out_l, st_l), (out_a, st_a) in zip(lane, agreed):
        for i, (a, b) in enumerate(zip(out_l, out_a)):
            assert a[0] == b[0] == "ok", (i, a, b)
            assert np.array_equal(a[1], b[1]), f"call {i} ({plan[i]}) differs between lane and agreement"
        # agreed: call 0 and the marsit with flushes (7); the others in the lane
        assert (st_l["lane_rounds"], st_l["round_agreements"], st_l["rounds_failed"]) == (8, 2, 0), st_l
        assert st_a["lane_rounds"] == 0 and st_a["round_agreements"] == len(plan)


@pytest.mark.timeout(180)
def test_a_compressed_mismatch_in_the_lane_fails_on_every_node(tmp_path):
    plan = ["dense", "birdplus", "marsit", "marsit"]
    res = _compressed_results(tmp_path, plan, 5000, bad_codec=(2, 1))
    check_results(res, plan, 3, 5000, skip={1})
    for out, st in res:
        kind, msg = out[1]
        assert kind == "RoundMismatchError", out[1]
        assert "C-birdplus" in msg and "codec and its parameters" in msg, msg
        assert st["rounds_failed"] == 1


@pytest.mark.parametrize("codec,params", [("birdplus", {"density": 0.05}),
                                          ("birdplus", {"density": 0.05, "mode": "shared"}), ("marsit", {})])
def test_a_compressed_lane_round_given_up_runs_again_as_if_it_never_started(codec, params):
    """A lane round given up after compressing (the leader closed the lane while the others
    waited for its data) runs again once agreed; its first attempt must have left the codec state
    as it was (error feedback fed the input twice otherwise). Two rounds given up once each give
    the same bits and leave the same codec state as two rounds that never were (RoundRunner over an
    in-memory ring; the daemon's part, LaneGivenUp from the transport, is mimicked by a transport
    that raises it at its first receive, after the first sends have gone out)."""
    from birdnet.daemon.engine import Contribution, LocalRound, RoundRunner, StateStore
    from birdnet.daemon.peers import LaneGivenUp

    from birdnet.codecs import get_codec
    from birdnet.config import Settings

    world, n = 3, 6000
    xs = [[np.random.default_rng([k, r]).standard_normal(n).astype(np.float32) for r in range(world)]
          for k in range(2)]

    def rnd(k, r):
        desc = {"kind": "allreduce", "name": "t", "shape": [n], "dtype": "float32", "op": "mean",
                "codec": get_codec(codec, **params).describe(), "root": None}
        return LocalRound(job="j", seq=k + 1, kind="allreduce", desc=desc,
                          parts=[Contribution(b"s", 0, xs[k][r].copy(), 0, r)])

    class GivesUp:
        def __init__(self, t):
            self.t, self.rank, self.world = t, t.rank, t.world
            self.bytes_sent = self.bytes_received = 0

        def send(self, header, buffers=()):
            self.t.send(header, buffers)

        def recv(self, deadline):
            raise LaneGivenUp("the leader closed the lane")

    def run(give_up):
        runners = [RoundRunner(Settings(), StateStore(1 << 30)) for _ in range(world)]
        outs = [[None, None] for _ in range(world)]
        for k in range(2):
            rounds = [rnd(k, r) for r in range(world)]
            if give_up:
                def attempt(t, rounds=rounds):
                    with pytest.raises(LaneGivenUp):
                        runners[t.rank].run(rounds[t.rank], GivesUp(t), t.rank, world, None)
                MemoryRing(world).run(attempt)
                for r in rounds:
                    r.stats.clear()

            def agreed(t, rounds=rounds, k=k):
                runners[t.rank].run(rounds[t.rank], t, t.rank, world, [1] * world)
                outs[t.rank][k] = rounds[t.rank].parts[0].array.copy()
            MemoryRing(world).run(agreed)
        return outs, runners

    plain, plain_runners = run(False)
    again, again_runners = run(True)
    for r in range(world):
        for k in range(2):
            assert again[r][k].tobytes() == plain[r][k].tobytes() == plain[0][k].tobytes(), (r, k)
        a, b = (x.states.states[("j", "t")].state for x in (plain_runners[r], again_runners[r]))
        for key in a:
            if isinstance(a[key], np.ndarray):
                assert a[key].tobytes() == b[key].tobytes(), key


class _LaneNet:
    """What DenseLane uses of a PeerNet: its sends, the lane keys, the restart counter."""

    neighbour_restarts = 0

    def __init__(self):
        self.sent, self.lane_keys = [], ()

    def send(self, h):
        self.sent.append(h)

    def set_lane_keys(self, keys):
        self.lane_keys = keys


def test_a_close_request_that_reaches_the_leader_before_its_lane_opens_keeps_it_closed():
    """A node that settled a round because its neighbour restarted asks the leader to close the lane
    the round's go granted. When the request came while the leader was still in that round's commit
    (its lane not open yet) it was dropped: the leader then opened the lane, ran the next round in
    it alone and waited round_timeout for it (RoundTimeoutError) while the others waited for a start."""
    from birdnet.daemon.lane import DenseLane

    from birdnet.messages import LaneClose
    net = _LaneNet()
    lane = DenseLane(net, 0, 3, True)
    lane.on_message(LaneClose("J/5", "rank 2: a round before it was settled"))  # leader in J/4's commit
    assert lane.at is None and net.sent == []
    lane.open("J", 5, since=0)
    assert lane.at is None and net.sent == [{"t": "lane", "k": "J/5"}]  # closed on every node
    lane.open("J", 6, since=0)  # the request held for one round only
    assert lane.at == ("J", 6)
    # a request while the lane is open and idle closes it at once, as before
    net.sent.clear()
    lane.on_message(LaneClose("J/6", "x"))
    assert lane.at is None and net.sent == [{"t": "lane", "k": "J/6"}]
    # a follower passes requests on towards the leader and keeps none
    f_net = _LaneNet()
    follower = DenseLane(f_net, 1, 3, True)
    follower.on_message(LaneClose("J/7", "x"))
    follower.open("J", 7)
    assert follower.at == ("J", 7) and f_net.sent == [{"t": "lane", "k": "J/7", "req": "x"}]


def test_a_lane_opens_with_the_restart_count_of_its_agreement():
    """A neighbour that restarted during the agreed rounds that granted the lane (seen after this
    node released them) closes the lane before its first round: the lane keeps the count from when
    the agreement began, not from when it opened."""
    from birdnet.daemon.lane import DenseLane
    net = _LaneNet()
    lane = DenseLane(net, 1, 3, True)
    net.neighbour_restarts = 3
    lane.open("J", 2, since=2)
    assert lane.since == 2
    lane.open("J", 3)
    assert lane.since == 3
