"""The daemon's round runner (local reduction + codec + ring) over the in-memory ring: no sockets."""
from __future__ import annotations

import numpy as np
import pytest
from birdnet.daemon.engine import Contribution, LocalRound, RoundRunner, StateStore

from birdnet.codecs import get_codec
from birdnet.config import Settings
from birdnet.errors import PeerLostError
from birdnet.messages import Start
from birdnet.ring.transport import MemoryRing


def _round(seq, name, arrays, codec, params, op="mean"):
    n = arrays[0].size
    desc = {"kind": "allreduce", "name": name, "shape": [n], "dtype": "float32", "op": op,
            "codec": get_codec(codec, **params).describe(), "root": None}
    parts = [Contribution(b"s", 0, a, i, i) for i, a in enumerate(arrays)]
    return LocalRound(job="j", seq=seq, kind="allreduce", desc=desc, parts=parts)


def _run(world, rounds_by_rank, runners):
    ring = MemoryRing(world)

    def fn(t):
        for rnd in rounds_by_rank[t.rank]:
            runners[t.rank].run(rnd, t, t.rank, world, [len(rnd.parts)] * world)
        return [r.parts[0].array.copy() for r in rounds_by_rank[t.rank]]

    return ring.run(fn, timeout=60)


def test_flush_round_through_the_runner_resets_global_compensation():
    world, n = 3, 4099
    runners = [RoundRunner(Settings(), StateStore(1 << 30)) for _ in range(world)]
    rng = np.random.default_rng(0)
    rounds = [[_round(k, "w", [rng.standard_normal(n).astype(np.float32)], "marsit",
                      {"compensation": "global", "flush": 2}) for k in range(2)] for _ in range(world)]
    [[r.parts[0].array.copy() for r in rr] for rr in rounds]
    outs = _run(world, rounds, runners)
    for r in range(world):
        st = runners[r].states.states[("j", "w")].state
        assert not st["c"].any(), "a flush round must leave no compensation"
        assert outs[r][1].tobytes() == outs[0][1].tobytes()
    # round 1 (the flush) is the exact mean of p = x + c (c from round 0)
    assert np.max(np.abs(outs[0][0])) > 0
    assert len(np.unique(np.abs(outs[0][0]))) == 1  # round 0: one scale times signs


@pytest.mark.parametrize("codec,params", [("topk", {"density": 0.05}), ("birdplus", {"density": 0.05}),
                                          ("birdplus", {"density": 0.05, "mode": "shared"}),
                                          ("marsit", {}), ("fp16", {})])
def test_result_written_in_place_matches_a_separate_buffer(codec, params):
    """With one local process the runner writes the result straight into its shared memory; with
    two it reduces into a separate buffer first. Both must give the same bits."""
    world, n = 2, 5000
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    one = _run(world, [[_round(0, "t", [xs[r].copy()], codec, params, op="sum")] for r in range(world)],
               [RoundRunner(Settings(), StateStore(1 << 30)) for _ in range(world)])
    # the same contribution split over two local processes (x and zeros) takes the copying path
    two = _run(world, [[_round(0, "t", [xs[r].copy(), np.zeros(n, np.float32)], codec, params, op="sum")]
                       for r in range(world)],
               [RoundRunner(Settings(), StateStore(1 << 30)) for _ in range(world)])
    for r in range(world):
        assert one[r][0].tobytes() == one[0][0].tobytes()
        if codec != "marsit":  # marsit's random merge masks depend on the process counts
            assert one[r][0].tobytes() == two[r][0].tobytes()


class _NetStandIn:
    """Just enough of PeerNet for RingWorker._follow, recording what the follower waits on.

    A stand-in (not real sockets) because what it pins down, a follower that had its round already
    and still waited one poll period (20 ms a round; the wake-up had been consumed by the poll that
    delivered the leader's start), cannot be provoked deterministically through ZeroMQ."""

    def __init__(self, worker_ref, go):
        self.rank, self.world, self.stopping = 1, 2, False
        self.neighbour_restarts = 0
        self.bytes_sent = self.bytes_received = 0
        self.worker_ref, self.go = worker_ref, go
        self.sent, self.polls_while_queued = [], 0
        self.gaps = {}  # no message lost (PeerNet.gaps)

    def lost(self):
        return set()

    def restarted_since(self, since):
        return None

    def take_gap(self):  # no message lost (PeerNet.take_gap)
        return None

    def send(self, header, buffers=(), track=False):
        self.sent.append(header)

    def poll(self, timeout, data=False):
        w = self.worker_ref[0]
        if not self.sent and (not w.inbox.empty() or w.ready):
            self.polls_while_queued += 1  # waiting for the round although it is already here
        return {"h": self.go} if self.sent else None


def _follow_barrier(net_class, go, key):
    """Rank 1 of 2 with a barrier queued follows the leader's start of ``key`` over a stand-in net;
    returns (net, finished rounds, the barrier)."""
    from birdnet.daemon.engine import RingWorker

    ref = []
    net = net_class(ref, go)
    done = []
    w = RingWorker(Settings(), 1, 2, net, RoundRunner(Settings(), StateStore(1 << 20)), done.append)
    ref.append(w)
    barrier = LocalRound(job="j", seq=0, kind="barrier", desc={"kind": "barrier"}, parts=[])
    w.submit(barrier)
    w._follow(Start.from_header({"t": "start", "k": key, "descs": [[0, {"kind": "barrier", "count": 1}]], "more": []}))
    return net, done, barrier


def test_follower_takes_a_queued_round_before_waiting():
    key = "j/0"
    go = {"t": "go", "k": key, "ok": True, "err": None, "errc": None, "counts": [1, 1], "more": []}
    # the barrier is queued by the service thread; its wake-up was already consumed
    net, done, barrier = _follow_barrier(_NetStandIn, go, key)
    assert net.polls_while_queued == 0
    assert net.sent[0]["t"] == "start" and net.sent[0]["descs"][1][0] == 1
    assert done == [barrier] and barrier.error is None


def test_a_gap_in_the_left_neighbours_messages_fails_the_round_being_agreed():
    """Messages lost on a reset connection (PeerNet.take_gap) may include the ``go`` the follower
    waits for: it fails the round at once, names the cause and tells the ring, instead of waiting
    round_timeout."""
    class GapNet(_NetStandIn):
        gap = "1 message(s) from left neighbour rank 0 (127.0.0.1:1) were lost: the TCP connection broke"

        def take_gap(self):
            gap, self.gap = self.gap, None
            return gap

        def poll(self, timeout, data=False):
            return None  # the go was among the lost messages

    key = "j/0"
    net, done, barrier = _follow_barrier(GapNet, None, key)
    assert done == [barrier]
    assert isinstance(barrier.error, PeerLostError), barrier.error
    assert f"round {key} could not start: 1 message(s)" in str(barrier.error)
    assert [h["t"] for h in net.sent] == ["start", "abort"]  # its part of the agreement, then the failure
    assert net.gap is None  # taken once


class _BrokenLink:
    """A transport whose neighbour is gone: the round fails in its data phase, after the codec compressed."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.bytes_sent = self.bytes_received = 0

    def send(self, header, buffers=()):
        raise PeerLostError("test: the right neighbour is gone")

    def recv(self, deadline):
        raise PeerLostError("test: the left neighbour is gone")

    def flush(self, timeout):
        pass


def _state_bytes(runner: RoundRunner) -> dict:
    st = runner.states.states[("j", "t")].state
    return {k: (v.tobytes() if isinstance(v, np.ndarray) else v) for k, v in st.items()}


@pytest.mark.parametrize("codec,params", [
    ("topk", {"density": 0.05}), ("topk", {"density": 0.05, "momentum": 0.9}), ("dgc", {"density": 0.05}),
    ("randomk", {"density": 0.05, "error_feedback": True}), ("efsign", {}), ("bird", {"density": 0.05}),
    ("birdplus", {"density": 0.05}), ("birdplus", {"density": 0.05, "mode": "shared"}), ("marsit", {})])
def test_a_failed_round_leaves_codec_state_as_it_was(codec, params):
    """Codecs changed their state (error-feedback residuals, shared-mode importance) while they
    compressed, before the round completed: a round failing in its data phase lost residuals (the
    next call's feedback held this call's gradient, which was never sent) or left nodes with
    different importance. Now the state changes only with a round that completes: after a failed
    round it is bit for bit what it was, and running the call again gives exactly what a run that
    never failed gives."""
    world, n = 2, 5000
    rng = np.random.default_rng(7)
    xs = [[rng.standard_normal(n).astype(np.float32) for _ in range(world)] for _ in range(3)]

    def rounds(k):
        return [[_round(k, "t", [xs[k][r].copy()], codec, params)] for r in range(world)]

    failing = [RoundRunner(Settings(), StateStore(1 << 30)) for _ in range(world)]
    clean = [RoundRunner(Settings(), StateStore(1 << 30)) for _ in range(world)]
    _run(world, rounds(0), failing)
    _run(world, rounds(0), clean)
    before = [_state_bytes(r) for r in failing]
    for r in range(world):
        with pytest.raises(PeerLostError):
            failing[r].run(rounds(1)[r][0], _BrokenLink(r, world), r, world, [1] * world)
    assert [_state_bytes(r) for r in failing] == before
    for k in (1, 2):
        got, want = _run(world, rounds(k), failing), _run(world, rounds(k), clean)
        assert [g[0].tobytes() for g in got] == [w[0].tobytes() for w in want]
    assert [_state_bytes(r) for r in failing] == [_state_bytes(r) for r in clean]


@pytest.mark.parametrize("params", [{"density": 0.05}, {"density": 0.02, "block": 3},
                                    {"density": 0.05, "value_dtype": "float16"}])
def test_a_gathered_mean_divides_only_the_written_blocks_with_the_same_bits(params):
    """The runner divides a gathered round's mean only in the blocks the payloads wrote
    (Codec.touched_blocks): the result must be, bit for bit, the whole sum divided by the count, on
    every node, over several rounds of error feedback (n not a multiple of the block: a short last
    block)."""
    world, n = 4, 20_003
    rng = np.random.default_rng(7)
    xs = [[rng.standard_normal(n).astype(np.float32) for _ in range(3)] for _ in range(world)]
    runs = {}
    for op in ("sum", "mean"):
        runs[op] = _run(world, [[_round(k, "t", [xs[r][k].copy()], "birdplus", params, op=op) for k in range(3)]
                                for r in range(world)],
                        [RoundRunner(Settings(), StateStore(1 << 30)) for _ in range(world)])
    for r in range(world):
        for k in range(3):
            want = np.divide(runs["sum"][0][k], np.float32(world))
            assert runs["mean"][r][k].tobytes() == want.tobytes()
    assert np.count_nonzero(runs["mean"][0][0]) < n // 2  # the sparse case the fast path is for


def test_a_codec_state_change_failing_after_release_fails_the_jobs_next_calls_until_reset():
    """A node whose codec-state change fails after every node released the round's result holds a
    state the others do not: its job's next call fails (CodecError, naming the cause and the fix)
    in the node's description, so the leader's verdict fails it on every node, instead of summing
    contributions compressed against different states in silence; a reset starts it again."""
    from birdnet.daemon.agreement import description
    from birdnet.daemon.engine import RingWorker

    from birdnet.errors import CodecError

    world, n = 2, 3000
    rng = np.random.default_rng(3)
    runners = [RoundRunner(Settings(), StateStore(1 << 30)) for _ in range(world)]
    rounds = [[_round(0, "t", [rng.standard_normal(n).astype(np.float32)], "topk", {"density": 0.05})]
              for _ in range(world)]
    ring = MemoryRing(world)
    ring.run(lambda t: runners[t.rank].run(rounds[t.rank][0], t, t.rank, world, [1] * world, defer_commit=True),
             timeout=60)
    assert runners[0].commit_released(rounds[0][0], 0) is None

    def broken():
        raise MemoryError("test: the state change could not be applied")

    rounds[1][0].commit_state = broken
    why = runners[1].commit_released(rounds[1][0], 1)
    assert why is not None and "reset_state" in why and "node rank 1" in why
    assert ("j", "t") not in runners[1].states.states  # the half-applied state is not kept

    # the data path refuses a round agreed before the divergence
    nxt = _round(1, "t", [rng.standard_normal(n).astype(np.float32)], "topk", {"density": 0.05})
    with pytest.raises(CodecError, match="reset_state"):
        runners[1].run(nxt, _BrokenLink(1, world), 1, world, [1] * world)

    # a call handed over later fails in its description: every node's verdict fails it
    done = []
    w = RingWorker(Settings(), 1, world, _NetStandIn([], None), runners[1], done.append)
    w.submit(nxt)
    reset = LocalRound(job="j", seq=2, kind="reset", desc={"kind": "reset"}, parts=[])
    w.submit(reset)
    w._take_inbox()
    d = description(1, w.ready[nxt.key])
    assert d["error_class"] == "CodecError" and "reset_state" in d["error"]
    assert w.ready[reset.key].error is None  # the way back is not refused

    # the reset (run on every node) ends the divergence
    runners[1].run(reset, _BrokenLink(1, world), 1, world, [1] * world)
    assert runners[1].states.divergence("j") is None
