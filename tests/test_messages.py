"""Peer message records (birdnet.messages) and the header-key table (birdnet.wire.HEADER_KEYS):
built from headers as they come off the network, malformed fields rejected, every key a ring
algorithm or the ring worker sends listed in the table."""
from __future__ import annotations

import numpy as np

from birdnet import wire
from birdnet.codecs import RoundContext, get_codec
from birdnet.messages import Abort, Membership, Verdict, extend_batch, verdicts_of_go
from birdnet.ring.dense import ring_allreduce
from birdnet.ring.gather import ring_allgather
from birdnet.ring.merge import merged_allreduce
from birdnet.ring.transport import MemoryRing


def test_verdict_round_trip_and_malformed_counts_fail_the_round():
    v = Verdict("j/1", True, None, "RoundMismatchError", (1, 2, 1))
    go = {"t": "go", **v.go_fields(), "more": [Verdict("j/2", False, "shape differs", "RoundMismatchError",
                                                       (1, 1, 1)).to_wire()]}
    got = verdicts_of_go(go, "j/1", 3, {"j/1", "j/2"})
    assert got == [v, Verdict("j/2", False, "shape differs", "RoundMismatchError", (1, 1, 1))]
    # a round of the batch not waiting here is left out; wrong counts fail the round as a lost peer
    assert [x.key for x in verdicts_of_go(go, "j/1", 3, {"j/1"})] == ["j/1"]
    for counts in ([1, 2], [1, True, 1], [1, -1, 1], [1, 1 << 20, 1], "123", None):
        bad = verdicts_of_go({**go, "counts": counts}, "j/1", 3, {"j/1"})[0]
        assert not bad.ok and bad.error_class == "PeerLostError" and bad.counts == (0, 0, 0)
        assert "malformed go" in bad.error
    # garbage in ``more`` is skipped, never raised on
    assert len(verdicts_of_go({**go, "more": [7, ["j/2"], [3, 1, 2, 3, 4]]}, "j/1", 3, {"j/1", "j/2"})) == 1
    assert len(verdicts_of_go({**go, "more": "x"}, "j/1", 3, {"j/1"})) == 1


def test_extend_batch_keeps_the_ready_prefix():
    more = [["j/2", [[0, {"a": 1}]]], ["j/3", [[0, {}]]], ["j/4", [[0, {}]]]]
    kept = extend_batch(more, {"j/2", "j/4"}, lambda k: [1, {"k": k}])
    assert kept == [["j/2", [[0, {"a": 1}], [1, {"k": "j/2"}]]]]  # j/3 is not ready: stops there
    assert extend_batch("garbage", {"j/2"}, lambda k: [1, {}]) == []
    assert extend_batch([["j/2", "notalist"]], {"j/2"}, lambda k: [1, {}]) == []
    assert more[0] == ["j/2", [[0, {"a": 1}]]]  # the received batch is not modified


def test_abort_header_round_trip_and_forged_fields():
    a = Abort("j/3", "rank 2: lost peer", origin=2, error_class="InputError")
    assert Abort.from_header(a.header()) == a
    assert Abort.from_header(Abort("j/3", "x", retry=True).header()).retry is True
    assert "retry" not in Abort("j/3", "x").header() and "o" not in Abort("j/3", "x").header()
    # a key that is no string cannot name a round: dropped; no key: the round in progress
    assert Abort.from_header({"t": "abort", "k": 5, "reason": "x"}) is None
    assert Abort.from_header({"t": "abort", "reason": "x"}).key is None
    # a bool or a non-int origin, or a class name that is not an error class, is ignored
    forged = Abort.from_header({"t": "abort", "k": "j/1", "o": True, "c": "os.system", "retry": 1})
    assert forged == Abort("j/1", "None", None, None, False)


def test_membership_from_header():
    m = Membership(3, (0, 2, 3), 2, (3,), {"0": "a", "2": "b", "3": "c"})
    assert Membership.from_header(m.fields(), 4) == m
    for bad in ({"S": [2, 0, 3]}, {"S": [0, 0, 2]}, {"S": [0, 4]}, {"S": []}, {"S": [0, True]},
                {"ep": -1}, {"ep": 1.5}, {"ep": True}, {"L": 1}, {"L": "2"}):
        assert Membership.from_header({**m.fields(), **bad}, 4) is None, bad
    assert Membership.from_header({**m.fields(), "J": "x", "I": 5}, 4).joiners == ()


def _ctx(rank, world, n):
    return RoundContext(job="j", name="w", shape=(n,), round_id=0, rank=rank, world=world, seed=1, local_count=1,
                        total_count=world, tensor_round=0, counts=(1,) * world)


def test_every_key_the_ring_algorithms_send_is_in_the_table():
    world, n = 3, 5000
    xs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(world)]
    marsit = get_codec("marsit")
    states = [marsit.new_state(n) for _ in range(world)]

    def fn(t):
        ring_allreduce(t, xs[t.rank].copy(), timeout=10.0, chunk_bytes=4096, tag={"key": "j/0"})
        ring_allreduce(t, xs[t.rank].copy(), timeout=10.0, chunk_bytes=4096, tag={"key": "j/1"}, count=1,
                       mean=True, learned={})
        ring_allgather(t, {"x": 1}, [xs[t.rank][:10]], timeout=10.0, tag={"key": "j/2"})
        merged_allreduce(t, marsit, xs[t.rank], _ctx(t.rank, world, n), states[t.rank], timeout=10.0)

    ring = MemoryRing(world)
    ring.run(fn, timeout=60.0)
    sent = {k for tr in ring.transports for h, _ in tr.messages_sent for k in h}
    assert sent and sent <= set(wire.HEADER_KEYS), sorted(sent - set(wire.HEADER_KEYS))
    # and the ring worker's own messages
    control = [Abort("j/1", "x", 1, "InputError", True).header(), {"t": "go", **Verdict("j/1", True, None, None,
                                                                                            (1,)).go_fields()},
               Membership(1, (0, 1), 0).fields()]
    assert {k for h in control for k in h} <= set(wire.HEADER_KEYS)


def test_an_abort_keeps_the_class_its_origin_failed_the_round_with():
    from birdnet import errors

    mismatch = errors.RoundAborted.of(Abort("j/3", "rank 2: shapes differ", origin=2, error_class="RoundMismatchError"))
    assert (mismatch.origin, mismatch.cls) == (2, "RoundMismatchError")
    assert type(mismatch.as_origin()) is errors.RoundMismatchError
    assert errors.to_wire(mismatch) == {"error": "RoundMismatchError", "message": "rank 2: shapes differ"}
    lost = errors.RoundAborted.of(Abort("j/3", "rank 1: lost peer 2", origin=1))
    assert lost.as_origin() is lost and isinstance(lost, errors.PeerLostError)
    assert errors.to_wire(lost)["error"] == "PeerLostError"
    # a later round of a batch fails with the class of the round before it, also for an abort
    assert type(errors.with_message(lost, "an earlier round failed")) is errors.PeerLostError
    assert type(errors.with_message(mismatch, "an earlier round failed")) is errors.RoundMismatchError
    assert type(errors.rebuild("NoSuchError", "x")) is errors.BirdnetError


def test_a_round_key_whose_call_number_is_not_ascii_digits_is_refused_where_it_arrives():
    """``"²"`` is a digit to str.isdigit() but not to int(): such a key passed check_peer and made
    split_key raise ValueError downstream instead of being dropped as malformed."""
    import pytest

    from birdnet.errors import ProtocolError
    for key in ("j/\u00b2", "j/\u0663", "j/", "j"):
        assert wire.split_key(key) is None
        with pytest.raises(ProtocolError, match="round key"):
            wire.check_peer({"t": "data", "k": key}, 4)
    assert wire.split_key("a/b/12") == ("a/b", 12)
    wire.check_peer({"t": "data", "k": "a/b/12"}, 4)  # a job name may contain "/"
