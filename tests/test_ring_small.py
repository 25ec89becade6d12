"""The gathered all-reduce of small vectors (birdnet/ring/small.py) over the in-memory transport,
and the choice between it and the ring (use_gathered); through real daemons: test_lane.py and
test_e2e_loopback.py run rounds on both sides of the choice."""
from __future__ import annotations

import numpy as np
import pytest
import workers
from cluster import LocalCluster

from birdnet.config import Settings
from birdnet.errors import PeerLostError, ProtocolError, RoundMismatchError
from birdnet.ring.dense import ring_allreduce
from birdnet.ring.small import gathered_allreduce, use_gathered
from birdnet.ring.transport import MemoryRing


def rank_order_sum(xs: list[np.ndarray]) -> np.ndarray:
    """((x_0 + x_1) + x_2) + ...: the operations every node makes, one after the other."""
    out = xs[0].copy()
    for x in xs[1:]:
        out = out + x
    return out


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 3, 1000, 38282])
def test_every_node_gets_the_rank_order_sum_bit_for_bit(world, n):
    rng = np.random.default_rng(world * 100003 + n)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    before = [x.copy() for x in xs]
    ring = MemoryRing(world)
    res = ring.run(lambda t: gathered_allreduce(t, xs[t.rank], timeout=10))
    expected = rank_order_sum(xs).tobytes()
    for r, x, b in zip(res, xs, before):
        assert r.dtype == np.float32 and r.shape == (n,)
        assert r.tobytes() == expected
        assert not np.shares_memory(r, x) and x.tobytes() == b.tobytes()  # the input is only read
    for t in ring.transports:  # N-1 hops, each the whole vector
        assert len(t.messages_sent) == world - 1
        assert t.bytes_sent == (world - 1) * 4 * n


@pytest.mark.parametrize("world", [2, 4, 7])
def test_the_sum_is_the_same_whichever_rank_an_input_sits_on(world):
    """IEEE addition commutes: starting the sum at rank 0 on every node is what makes the nodes
    agree; the same vectors on other ranks in the same order give the same bits."""
    xs = [np.random.default_rng(r).standard_normal(5000).astype(np.float32) for r in range(world)]
    res = MemoryRing(world).run(lambda t: gathered_allreduce(t, xs[t.rank], timeout=10))
    assert all(r.tobytes() == res[0].tobytes() for r in res)
    # within float tolerance of the ring's sum (whose order differs per segment)
    ring = MemoryRing(world).run(lambda t: ring_allreduce(t, xs[t.rank], timeout=10, chunk_bytes=4096))
    np.testing.assert_allclose(res[0], ring[0], rtol=0, atol=1e-5 * world)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_divide_and_integer_sums(dtype):
    world = 5
    xs = [(np.arange(1001) * (r + 1)).astype(dtype) for r in range(world)]
    summed = MemoryRing(world).run(lambda t: gathered_allreduce(t, xs[t.rank], timeout=10))
    assert all(np.array_equal(s, np.arange(1001) * 15) for s in summed)
    if dtype != np.int64:
        mean = MemoryRing(world).run(lambda t: gathered_allreduce(t, xs[t.rank], timeout=10, divide_by=7))
        expected = np.divide(rank_order_sum(xs), dtype(7))
        assert all(m.dtype == dtype and m.tobytes() == expected.tobytes() for m in mean)


def test_counts_travel_with_the_vectors_and_the_mean_is_the_agreed_one():
    """A lane round (no agreement): each vector carries its node's process count, every node adds
    them up and divides by the total, the same bits as dividing by the agreed total."""
    world, counts = 4, [1, 3, 2, 2]
    xs = [np.random.default_rng(r).standard_normal(999).astype(np.float32) for r in range(world)]
    learned = [dict() for _ in range(world)]
    got = MemoryRing(world).run(lambda t: gathered_allreduce(t, xs[t.rank], timeout=10, count=counts[t.rank],
                                                             mean=True, learned=learned[t.rank]))
    agreed = MemoryRing(world).run(lambda t: gathered_allreduce(t, xs[t.rank], timeout=10, divide_by=sum(counts)))
    for r in range(world):
        assert learned[r]["count"] == 8
        assert got[r].tobytes() == agreed[r].tobytes()


def test_a_bad_count_is_refused():
    ring = MemoryRing(2)
    real_send = ring.transports[0].send
    ring.transports[0].send = lambda h, b=(): real_send({**h, "n": -1}, b)

    def fn(t):
        try:
            return gathered_allreduce(t, np.ones(10, np.float32), timeout=2, count=1, mean=True)
        except ProtocolError as exc:
            return str(exc)
    assert "bad process count -1 from rank 0" in ring.run(fn, timeout=20)[1]


def test_a_node_that_never_joins_leaves_the_others_inputs_alone():
    """What makes giving a lane round up safe: without rank 0 no node writes its buffer."""
    world = 4
    xs = [np.full(4096, float(r + 1), np.float32) for r in range(world)]

    def node(t):
        if t.rank == 0:
            return None
        try:
            gathered_allreduce(t, xs[t.rank], timeout=1.0, count=1)
        except PeerLostError:
            return "timed out"
    assert MemoryRing(world).run(node, timeout=30) == [None, "timed out", "timed out", "timed out"]
    for r in range(world):
        assert np.all(xs[r] == r + 1)


def test_a_tag_mismatch_fails_every_node_without_hanging():
    ring = MemoryRing(4)
    errors = []

    def fn(t):
        try:
            gathered_allreduce(t, np.ones(100, np.float32), timeout=5, tag={"digest": 1 if t.rank != 2 else 2})
        except RoundMismatchError as exc:
            errors.append(str(exc))
            return "mismatch"
        return "ok"
    assert ring.run(fn, timeout=20) == ["mismatch"] * 4
    assert all("digest" in e for e in errors)


def test_nodes_that_chose_different_schedules_say_how_the_round_differs():
    """Nodes that disagree on a lane round's shape may pick different algorithms for it (one small,
    one large): the node that receives the other schedule's message names the difference
    (RoundMismatchError), not a lost message (its abort then fails the others: the daemons)."""
    world = 3
    sizes = [10, 10, 300_000]

    def fn(t):
        tag = {"shape": [sizes[t.rank]]}
        x = np.ones(sizes[t.rank], np.float32)
        try:
            if sizes[t.rank] < 1000:
                gathered_allreduce(t, x, timeout=1.0, tag=tag)
            else:
                ring_allreduce(t, x, timeout=1.0, tag=tag, chunk_bytes=1 << 20)
        except RoundMismatchError as exc:
            return str(exc)
        except PeerLostError:
            return "timed out"
        return "ok"
    res = MemoryRing(world).run(fn, timeout=30)
    assert "shape" in res[0] and "rank 2 has [300000]" in res[0], res
    assert "shape" in res[2] and "rank 1 has [10]" in res[2], res
    assert "ok" not in res


def test_when_the_gather_is_chosen():
    """The cost model (use_gathered's docstring): gathered when nbytes (N-2) <= hop_latency_bytes N,
    never past max_bytes, always at 2 nodes below it, never at 1 node or with hop_latency_bytes 0."""
    s = Settings()
    h, cap = s.hop_latency_bytes, s.chunk_bytes
    # the defaults on 4 nodes: the CNN's DDP bucket (38,282 float32) gathered, 1 MiB on the ring
    assert use_gathered(38_282 * 4, 4, h, cap)
    assert not use_gathered(262_144 * 4, 4, h, cap)
    assert not use_gathered(1_000_000 * 4, 4, h, cap)
    for world in (3, 4, 8, 16):
        edge = h * world // (world - 2)
        assert use_gathered(edge, world, h, cap) == (edge <= cap)
        assert not use_gathered(edge + 1, world, h, cap)
    assert use_gathered(cap, 2, h, cap) and not use_gathered(cap + 1, 2, h, cap)
    assert not use_gathered(4, 1, h, cap)
    assert not use_gathered(4, 2, 0, cap) and not use_gathered(4, 4, 0, cap)


def test_hop_latency_bytes_is_cluster_wide_and_checked():
    from birdnet.errors import ConfigError
    assert Settings(hop_latency_bytes=0).fingerprint() != Settings().fingerprint()
    with pytest.raises(ConfigError, match="hop_latency_bytes is -1"):
        Settings(hop_latency_bytes=-1)


@pytest.mark.timeout(180)
def test_small_rounds_through_real_daemons_go_gathered_with_the_rank_order_bits(tmp_path):
    """3 daemons: the first call agreed, the next two in the dense lane; each node sends N-1 whole
    vectors (the ring would send 2(N-1)/N of one) and every node has the bits of
    ((x_0 + x_1) + x_2) / 3 computed here."""
    n, world = 2000, 3
    with LocalCluster(world, tmp_path) as cl:
        res = cl.run(workers.random_mean, n, 7, "float32", 3)
    res.sort(key=lambda r: r["rank"])
    for i in range(3):
        expected = np.divide(rank_order_sum([r["inputs"][i] for r in res]), np.float32(world))
        for r in res:
            assert r["outs"][i].tobytes() == expected.tobytes(), (i, r["rank"])
            assert (world - 1) * 4 * n <= r["stats"][i]["bytes_sent"] < (world - 1) * 4 * n + 2048, r["stats"][i]
