"""The merged ring (birdnet.ring.merge) with the marsit and signcascade codecs over MemoryRing:
marsit.md section 4, properties 3-8, bytes per hop, protocol checks.

Statistical checks use fixed seeds and 5-sigma binomial bounds."""
from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest

from birdnet.codecs import RoundContext, get_codec
from birdnet.errors import BirdnetError, CodecError, InputError, ProtocolError, RoundMismatchError
from birdnet.kernels.signbits import nbytes_for
from birdnet.ring.merge import merge_bounds, merged_allreduce
from birdnet.ring.transport import MemoryRing


def ctx_for(rank, world, n, *, counts=None, seed=1, round_id=0, tensor_round=0):
    counts = tuple(counts or (1,) * world)
    return RoundContext(job="job", name="w", shape=(n,), round_id=round_id, rank=rank, world=world, seed=seed,
                        local_count=counts[rank], total_count=sum(counts), tensor_round=tensor_round,
                        counts=counts)


def run_round(codec, xs, *, counts=None, seed=1, round_id=0, tensor_round=0, states=None):
    world, _n = len(xs), xs[0].size
    states = states if states is not None else [codec.new_state(x.size) for x in xs]
    ring = MemoryRing(world)

    def fn(t):
        ctx = ctx_for(t.rank, world, xs[t.rank].size, counts=counts, seed=seed, round_id=round_id,
                      tensor_round=tensor_round)
        return merged_allreduce(t, codec, xs[t.rank], ctx, states[t.rank], timeout=10.0)

    return ring.run(fn, timeout=30.0), ring, states


def bits_of(result: np.ndarray) -> np.ndarray:
    return (result > 0).astype(np.uint8)


def within(k, n, p, sigmas=5.0):
    return abs(k - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1e-9


PURE = dict(compensation="none", flush=0)  # p = x / local_count exactly: the merge alone


CASES = [(m, n) for m in range(1, 9) for n in (0, 1, 7, 13, 1000)] + [(3, 100003), (8, 100003)]


@pytest.mark.parametrize("codec_name", ["marsit", "signcascade"])
@pytest.mark.parametrize("world,n", CASES)
def test_identical_results_and_bytes_per_hop(codec_name, world, n):
    """Properties 5 and 6: bit-identical results everywhere; ceil(L/8) bytes per segment message at
    every hop, a small header that does not grow with the hop count."""
    codec = get_codec(codec_name, flush=0)
    rng = np.random.default_rng(world * 1000 + n)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    res, ring, _ = run_round(codec, xs, seed=world + n)
    for r in res:
        assert r.dtype == np.float32 and r.shape == (n,)
        np.testing.assert_array_equal(r.view(np.uint32), res[0].view(np.uint32))
    bounds = merge_bounds(n, world)
    assert all(b % 8 == 0 or b == n for b in bounds) and bounds[-1] == n
    for t in ring.transports:
        assert len(t.messages_sent) == 2 * (world - 1)
        sizes = []
        for header, bufs in t.messages_sent:
            seg = header["seg"]
            assert bufs == [math.ceil((bounds[seg + 1] - bounds[seg]) / 8)]
            sizes.append(len(msgpack.packb(header)))
        if sizes:
            assert max(sizes) < 200
        assert t.bytes_sent == sum(b[0] for _, b in t.messages_sent) <= 2 * nbytes_for(n)
    if codec_name == "marsit" and n:
        # the sum is v * s with v = sum of the nodes' scales (mean |x| here), rounded once
        v = np.float32(sum(float(np.abs(x.astype(np.float64)).sum() / n) for x in xs))
        assert abs(float(np.abs(res[0][0])) - float(v)) <= 1e-6 * float(v)
        assert set(np.unique(np.abs(res[0]))) == {np.abs(res[0][0])}


def test_bytes_are_a_32nd_of_dense():
    world, n = 4, 100003
    xs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(world)]
    _, ring, _ = run_round(get_codec("marsit", **PURE), xs)
    dense_per_node = 2 * (world - 1) / world * 4 * n  # reduce-scatter + all-gather of float32
    for t in ring.transports:
        assert t.bytes_sent <= dense_per_node / 32 + 2 * world


def patterns(world, n, rng):
    """Worker sign patterns: element i gets a random number of positive workers."""
    return rng.integers(0, 2, size=(world, n)).astype(np.uint8)


@pytest.mark.parametrize("world,counts", [(2, None), (3, None), (4, None), (7, None), (8, None),
                                          (4, (1, 3, 2, 1)), (3, (5, 1, 2))])
def test_unbiased_mean_of_workers_bits(world, counts):
    """Property 3: the mean output bit equals the (process-weighted) mean of the workers' bits."""
    n, seeds = 4099, 12  # 4099 is not divisible by 8 or by any world size here
    counts = counts or (1,) * world
    rng = np.random.default_rng(world)
    B = patterns(world, n, rng)
    xs = [np.where(B[r] == 1, 1.0, -1.0).astype(np.float32) * counts[r] for r in range(world)]
    codec = get_codec("marsit", **PURE)
    ones = np.zeros(n)
    for seed in range(seeds):
        res, _, _ = run_round(codec, xs, counts=counts, seed=1000 + seed)
        ones += bits_of(res[0])
    W = sum(counts)
    q = (np.asarray(counts)[:, None] * B).sum(axis=0) / W  # expected P(bit = 1) per element
    for value in np.unique(q):
        sel = q == value
        k, trials = int(ones[sel].sum()), int(sel.sum()) * seeds
        if value in (0.0, 1.0):
            assert k == trials * value  # unanimous elements never change
        else:
            assert within(k, trials, value), (value, k, trials)


@pytest.mark.parametrize("world,counts", [(2, None), (5, None), (8, None), (4, (2, 1, 1, 4))])
def test_source_worker_uniform_and_unanimous_fixed(world, counts):
    """Property 4: every output bit is some worker's bit; with one positive worker per element, the
    output is 1 exactly when that worker is the source, which happens with probability 1/M
    (w_r / W with unequal counts) for every worker position. Unanimous bits never change."""
    counts = counts or (1,) * world
    n = 8 * 250 * world + 3
    owner = np.arange(n) % world
    xs = []
    for r in range(world):
        x = np.where(owner == r, 1.0, -1.0).astype(np.float32)
        x[-3:] = [1.0, -1.0, 1.0]  # unanimous tail
        xs.append(x)
    codec = get_codec("marsit", **PURE)
    ones = np.zeros(n)
    seeds = 6
    for seed in range(seeds):
        res, _, _ = run_round(codec, xs, counts=counts, seed=77 + seed)
        b = bits_of(res[0])
        np.testing.assert_array_equal(b[-3:], [1, 0, 1])
        ones += b
    W = sum(counts)
    for r in range(world):
        sel = (owner == r)
        sel[-3:] = False
        assert within(int(ones[sel].sum()), int(sel.sum()) * seeds, counts[r] / W), r


@pytest.mark.parametrize("codec_name", ["marsit", "signcascade"])
@pytest.mark.parametrize("n", [0, 1, 13, 1000])
def test_world_of_one_returns_scale_times_sign(codec_name, n):
    """Property 7, through the ring and through compress/decompress standalone."""
    codec = get_codec(codec_name, flush=0)
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    scale = np.float32(np.abs(x.astype(np.float64)).mean()) if n else np.float32(0)
    expect = np.where(x >= 0, scale, -scale).astype(np.float32)
    res, ring, states = run_round(codec, [x])
    np.testing.assert_allclose(res[0], expect, rtol=1e-6)
    assert ring.transports[0].messages_sent == []
    ctx = ctx_for(0, 1, n)
    st = codec.new_state(n)
    payload = codec.compress(x, ctx, st)
    assert payload.buffers[0].nbytes == nbytes_for(n)
    out = np.empty(n, np.float32)
    codec.decompress(payload, out, ctx, st)
    np.testing.assert_array_equal(out, res[0])
    codec.after_round(st, out, ctx)
    np.testing.assert_allclose(st["c"], x - out, atol=1e-6)  # what was not sent is kept


def test_compensation_bookkeeping_weighted():
    """Property 8: sum_r w_r c_r = sum_r w_r p_r - W * out (global compensation)."""
    world, n, counts = 5, 1003, (1, 2, 1, 3, 1)
    rng = np.random.default_rng(8)
    codec = get_codec("marsit", flush=0, compensation="global")
    states = [codec.new_state(n) for _ in range(world)]
    for rnd in range(3):
        xs = [rng.standard_normal(n).astype(np.float32) * counts[r] for r in range(world)]
        c_before = [s["c"].astype(np.float64) for s in states]
        res, _, _ = run_round(codec, xs, counts=counts, round_id=rnd, tensor_round=rnd, states=states)
        W = sum(counts)
        p = [xs[r].astype(np.float64) / counts[r] + c_before[r] for r in range(world)]
        lhs = sum(counts[r] * states[r]["c"].astype(np.float64) for r in range(world))
        rhs = sum(counts[r] * p[r] for r in range(world)) - res[0].astype(np.float64)  # W * out = sum
        np.testing.assert_allclose(lhs, rhs, atol=1e-4 * W)


def test_flush_round_is_dense_and_zeroes_compensation():
    world, n, K = 4, 1001, 3
    rng = np.random.default_rng(9)
    codec = get_codec("marsit", flush=K, momentum=0.5)
    states = [codec.new_state(n) for _ in range(world)]
    for rnd in range(2 * K):
        xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
        # what prepare computes from the state before the round: p = (0.5 u + x) + c
        p = [(np.float32(0.5) * states[r]["u"] + xs[r]) + states[r]["c"] for r in range(world)]
        res, ring, _ = run_round(codec, xs, round_id=rnd, tensor_round=rnd, states=states)
        for r in res:
            np.testing.assert_array_equal(r.view(np.uint32), res[0].view(np.uint32))
        if rnd % K == K - 1:
            for s in states:
                assert not s["c"].any()
            np.testing.assert_allclose(res[0], np.sum(p, axis=0), rtol=1e-5, atol=1e-5)
            assert ring.transports[0].bytes_sent > 4 * n  # full precision on the wire
        else:
            assert any(s["c"].any() for s in states)
            assert ring.transports[0].bytes_sent <= 2 * nbytes_for(n)


def test_local_compensation_variant():
    world, n = 3, 101
    rng = np.random.default_rng(10)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    codec = get_codec("marsit", compensation="local", flush=0)
    _, _, states = run_round(codec, xs)
    for x, s in zip(xs, states):
        sigma = np.float32(np.abs(x.astype(np.float64)).mean())
        np.testing.assert_allclose(s["c"], x - np.where(x >= 0, sigma, -sigma), atol=1e-6)


@pytest.mark.parametrize("codec_name,params", [("marsit", {}), ("marsit", {"scale": "rms", "momentum": 0.5}),
                                               ("signcascade", {"compensation": "local"})])
@pytest.mark.parametrize("world,counts", [(1, (3,)), (2, (1, 2)), (5, (1, 2, 1, 3, 1))])
def test_a_mean_decoded_in_the_ring_is_the_sum_divided_bit_for_bit(codec_name, params, world, counts):
    # The daemon asks the ring for the mean (divide_by) instead of dividing the result in another
    # pass; the bits must be those of the old order: decode the sum, then one float32 division.
    # The codec state after the round (compensation made while the ring waits) must match too.
    n = 1003
    rng = np.random.default_rng(world)
    codec = get_codec(codec_name, flush=0, **params)
    xs = [rng.standard_normal(n).astype(np.float32) * counts[r] for r in range(world)]
    st_sum, st_mean = ([codec.new_state(n) for _ in range(world)] for _ in range(2))
    for rnd in range(3):
        sums, _, _ = run_round(codec, xs, counts=counts, round_id=rnd, tensor_round=rnd, states=st_sum)
        ring = MemoryRing(world)

        def fn(t, rnd=rnd):
            ctx = ctx_for(t.rank, world, n, counts=counts, round_id=rnd, tensor_round=rnd)
            return merged_allreduce(t, codec, xs[t.rank], ctx, st_mean[t.rank], timeout=10.0,
                                    divide_by=sum(counts))

        means = ring.run(fn, timeout=30.0)
        for r in range(world):
            want = sums[r] / np.float32(sum(counts))
            np.testing.assert_array_equal(means[r].view(np.uint32), want.view(np.uint32))
            np.testing.assert_array_equal(st_mean[r]["c"].view(np.uint32), st_sum[r]["c"].view(np.uint32))
    assert np.abs(st_sum[0]["c"]).sum() > 0  # the compensation did run


@pytest.mark.parametrize("phase,step,field,value,error", [
    ("mrs", 1, "src", 2, RoundMismatchError), ("mrs", 2, "scale", "1.0", ProtocolError),
    ("mag", 0, "src", 0, RoundMismatchError), ("mag", 0, "scale", None, ProtocolError)])
def test_a_scale_sent_for_the_wrong_rank_or_not_a_float_fails_the_round(phase, step, field, value, error):
    # Scales ride from reduce-scatter step 1 and in all-gather step 0 (4 nodes: every place one
    # rides); rank 0 tampers with one. Its right neighbour rejects it; no node hangs. A wrong rank
    # completes the schedule and the error rides on, so every other node fails alike (the error
    # cannot come back round to the sender in the all-gather). A malformed field fails the
    # receiver at once; in the daemon the round's abort tells the others, here they time out.
    world, n = 4, 803
    codec = get_codec("marsit", **PURE)
    ring = MemoryRing(world)
    honest = ring.transports[0].send

    def tampered(header, buffers=()):
        if header.get("p") == phase and header.get("s") == step:
            header = {**header, field: value}
        honest(header, buffers)

    ring.transports[0].send = tampered

    def fn(t):
        try:
            return merged_allreduce(t, codec, np.ones(n, np.float32), ctx_for(t.rank, world, n), None, timeout=1.0)
        except BirdnetError as exc:
            return exc

    got = ring.run(fn, timeout=30.0)
    assert isinstance(got[1], error), got[1]
    assert all(isinstance(g, BirdnetError) for g in got[1:]), got
    if error is RoundMismatchError:
        assert all(isinstance(g, RoundMismatchError) for g in got[1:]), got
        assert "scale of rank" in str(got[1])


def test_a_codec_that_needs_the_sum_is_not_handed_the_mean():
    codec = get_codec("marsit", compensation="global")
    assert codec.needs_result_sum and not get_codec("marsit").needs_result_sum
    with pytest.raises(InputError, match="needs the round's sum"):
        merged_allreduce(MemoryRing(1).transports[0], codec, np.ones(8, np.float32), ctx_for(0, 1, 8), None,
                         timeout=1.0, divide_by=2)


def test_nodes_disagreeing_on_length_all_fail_without_hanging():
    codec = get_codec("marsit", **PURE)
    xs = [np.ones(16, np.float32), np.ones(24, np.float32), np.ones(16, np.float32)]
    states = [codec.new_state(x.size) for x in xs]
    with pytest.raises(RoundMismatchError, match="disagree"):
        run_round(codec, xs, states=states)


class ScriptedTransport:
    """Rank 1 of 2; answers every recv with the next scripted message."""

    rank, world = 1, 2

    def __init__(self, script):
        self.script, self.sent = list(script), []

    def send(self, header, buffers=()):
        self.sent.append((header, buffers))

    def recv(self, deadline):
        header, bufs = self.script.pop(0)
        return header, [memoryview(bytes(b)) for b in bufs]


def good_messages(n=20):
    bounds = merge_bounds(n, 2)
    b0, b1 = nbytes_for(bounds[1]), nbytes_for(n) - nbytes_for(bounds[1])
    # at 2 nodes no scale rides in the reduce-scatter's one step (rank 0 packs the rest of its
    # vector while its first segment travels); its scale comes in all-gather step 0
    rs = {"t": "data", "p": "mrs", "s": 0, "seg": 0, "codec": "marsit", "n": n, "w": 1, "meta": {}}
    ag = {"t": "data", "p": "mag", "s": 0, "seg": 1, "codec": "marsit", "n": n, "src": 0, "scale": 0.5,
          "meta": {}}
    return [(rs, [b"\x0f" * b0]), (ag, [b"\xf0" * b1])]


@pytest.mark.parametrize("msg,field,value,error", [
    (0, "s", 1, ProtocolError), (0, "seg", 1, ProtocolError), (0, "p", "rs", ProtocolError),
    (1, "scale", "big", ProtocolError), (1, "scale", None, ProtocolError), (0, "meta", {"s": "x"}, ProtocolError),
    (0, "meta", [1], ProtocolError), (1, "meta", [1], ProtocolError),
    (0, "w", 2, RoundMismatchError), (1, "src", 1, RoundMismatchError), (0, "n", 21, RoundMismatchError),
    (1, "n", 21, RoundMismatchError), (0, "codec", "topk", RoundMismatchError)])
def test_bad_headers_are_rejected(msg, field, value, error):
    codec = get_codec("marsit", **PURE)
    msgs = good_messages()
    msgs[msg][0][field] = value
    t = ScriptedTransport(msgs)
    with pytest.raises(error):
        merged_allreduce(t, codec, np.ones(20, np.float32), ctx_for(1, 2, 20), None, timeout=1.0)


def test_good_script_passes_and_wrong_size_is_rejected():
    codec = get_codec("marsit", **PURE)
    out = merged_allreduce(ScriptedTransport(good_messages()), codec, np.ones(20, np.float32),
                           ctx_for(1, 2, 20), None, timeout=1.0)
    assert out.shape == (20,)
    msgs = good_messages()
    msgs[1] = (msgs[1][0], [b"\x00" * 5])
    with pytest.raises(ProtocolError, match="bytes"):
        merged_allreduce(ScriptedTransport(msgs), codec, np.ones(20, np.float32), ctx_for(1, 2, 20), None,
                         timeout=1.0)


def test_parameters_are_validated():
    with pytest.raises(CodecError, match="compensation"):
        get_codec("marsit", compensation="both")
    with pytest.raises(CodecError, match="flush"):
        get_codec("marsit", flush=-1)
    with pytest.raises(CodecError, match="momentum"):
        get_codec("marsit", momentum=1.0)
    with pytest.raises(CodecError, match="scale"):
        get_codec("marsit", scale="max")
    with pytest.raises(CodecError, match="no parameter"):
        get_codec("signcascade", scale="rms")
    codec = get_codec("marsit")
    assert codec.pattern.value == "merged"
    assert codec.state_nbytes(codec.new_state(10)) == 80
    with pytest.raises(CodecError, match="reset"):
        codec.compress(np.ones(5, np.float32), ctx_for(0, 1, 5), codec.new_state(10))


def test_scale_rules():
    x = np.array([3.0, -4.0, 0.0, 1.0], np.float32)
    for rule, expect in [("mean_abs", 2.0), ("rms", math.sqrt(26 / 4)), ("mean_abs_grad", 2.0), ("fixed", 0.1)]:
        codec = get_codec("marsit", scale=rule, step=0.1, flush=0)
        res, _, _ = run_round(codec, [x])
        np.testing.assert_allclose(np.abs(res[0]), expect, rtol=1e-6)
        np.testing.assert_array_equal(bits_of(res[0]), (x >= 0).astype(np.uint8))
