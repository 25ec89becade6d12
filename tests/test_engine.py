"""The daemon's round runner (local reduction + codec + ring) over the in-memory ring: no sockets."""
from __future__ import annotations

import numpy as np
import pytest
from birdnet.daemon.engine import Contribution, LocalRound, RoundRunner, StateStore

from birdnet.codecs import get_codec
from birdnet.config import Settings
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
        st = runners[r].states.states[("j", "w")][1]
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
