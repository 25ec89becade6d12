"""The ``lowbit`` codec: its kernels against a NumPy reference, its ring (requantised at every hop)
over the in-memory transport for world sizes x lengths x bits, bit-identical on every node, within
stated error bounds, with the bytes it promises; error feedback's invariant over rounds."""
from __future__ import annotations

import numpy as np
import pytest
from _codec_sim import assert_mismatched_wires_fail, wire_ring

from birdnet.codecs import get_codec
from birdnet.codecs.base import RoundContext, begin_round, commit_round
from birdnet.codecs.lowbit import LowbitWire
from birdnet.errors import CodecError, RoundMismatchError
from birdnet.kernels import lowbit as K
from birdnet.ring.dense import ring_allreduce
from birdnet.ring.transport import MemoryRing


# -- NumPy reference of the format (birdnet/kernels/lowbit.py) -------------------------------------
def ref_scale_bits(amax: np.ndarray, bits: int, midrise: bool = False) -> np.ndarray:
    out = []
    top = np.float32(2 ** (bits - 1) - 0.5) if midrise else np.float32(2 ** (bits - 1) - 1)
    for a in amax.astype(np.float32):
        if not np.isfinite(a):
            out.append(K.NAN_SCALE)
            continue
        s = np.float32(a / top)
        u = int(np.array([s], np.float32).view(np.uint32)[0])
        if u & 0xFFFF:
            u = (u | 0xFFFF) + 1
        u >>= 16
        out.append(K.NAN_SCALE if u >= 0x7F80 else u)
    return np.array(out, np.uint16)


def ref_encode(x: np.ndarray, bits: int, block: int, midrise: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, values they stand for), element by element."""
    n = x.shape[0]
    qmax = 2 ** (bits - 1) - 1
    nb = -(-n // block)
    amax = np.array([np.abs(x[b * block:(b + 1) * block]).max() for b in range(nb)], np.float32)
    sb = ref_scale_bits(amax, bits, midrise)
    scales = (sb.astype(np.uint32) << 16).view(np.float32)
    per = 8 // bits
    codes = np.zeros(-(-n * bits // 8), np.uint8)
    deq = np.empty(n, np.float32)
    for i in range(n):
        s = scales[i // block]
        if midrise:
            q = int(np.clip(np.floor(np.float32(x[i] / s)), -qmax - 1, qmax)) if np.isfinite(s) and s > 0 else 0
            codes[i // per] |= (q + qmax + 1) << ((i % per) * bits)
            deq[i] = np.float32(np.float32(q + 0.5) * s)
            continue
        if np.isfinite(s) and s > 0:
            q = int(np.clip(np.rint(np.float32(x[i] / s)), -qmax, qmax))
        else:
            q = 0
        codes[i // per] |= (q + qmax) << ((i % per) * bits)
        deq[i] = np.float32(q) * s
    return np.concatenate([sb.astype("<u2").view(np.uint8), codes]), deq


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * rng.exponential(1.0, n)).astype(np.float32)


@pytest.mark.parametrize("midrise", [False, True])
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("n,block", [(1, 8), (7, 8), (64, 64), (1000, 64), (1003, 128), (5000, 1024)])
def test_encode_decode_match_the_reference(bits, n, block, midrise):
    x = data(n, n)
    x[0] = 0.0
    if n > 3:
        x[3] = -x[3] * 1e-30  # tiny: rounds to level 0 (midrise: to -0.5 step)
    want, want_deq = ref_encode(x, bits, block, midrise)
    deq = np.empty(n, np.float32)
    res = np.full(n + 5, 7.0, np.float32)
    got = K.encode(x, bits, block, deq=deq, residual=res, res_off=5, midrise=midrise)
    np.testing.assert_array_equal(got, want)
    assert got.shape[0] == K.nbytes(n, bits, block)
    np.testing.assert_array_equal(deq.view(np.uint32), want_deq.view(np.uint32))  # -0.0 is never written
    np.testing.assert_array_equal(res[5:], x - want_deq)
    assert np.all(res[:5] == 7.0)
    out = np.empty(n, np.float32)
    K.decode(got, bits, block, out, midrise=midrise)
    np.testing.assert_array_equal(out.view(np.uint32), deq.view(np.uint32))
    own = data(n, 99)
    K.decode(got, bits, block, out, own, midrise=midrise)
    np.testing.assert_array_equal(out, deq + own)
    # one quantisation: each value within half a step, the step within 2**-7 of absmax/qmax
    # (midrise: absmax / (qmax + 0.5)), and midrise never sends a 0 where the block is not all 0
    qmax = 2 ** (bits - 1) - 1 + (0.5 if midrise else 0)
    bmax = np.repeat(np.maximum.reduceat(np.abs(x), np.arange(0, n, block)), block)[:n]
    assert np.all(np.abs(deq - x) <= 0.5 * bmax / qmax * (1 + 2 ** -7) * (1 + 1e-6))
    if midrise:
        assert np.all((deq != 0) == (bmax > 0))


def test_scales_keep_float32_range_and_nonfinite_blocks_decode_to_nan():
    x = np.concatenate([np.full(8, 1e-30, np.float32), np.full(8, 3e38, np.float32), np.ones(8, np.float32),
                        np.zeros(8, np.float32)])
    x[9] = np.nan
    deq = np.empty_like(x)
    K.encode(x, 8, 8, deq=deq)
    np.testing.assert_allclose(deq[:8], 1e-30, rtol=1e-2)  # float16 scales would flush this block to 0
    assert np.isnan(deq[8:16]).all()  # a NaN in the block
    np.testing.assert_allclose(deq[16:24], 1.0, rtol=2 ** -7)  # the scale is rounded up to a bfloat16
    np.testing.assert_array_equal(deq[24:], 0.0)
    y = np.full(8, 3.4e38, np.float32)  # absmax/qmax rounds up past float32: NaN, not Inf levels
    K.encode(y, 2, 8, deq=(d := np.empty(8, np.float32)))
    assert np.isnan(d).all()


def test_kernel_wrappers_reject_bad_arrays():
    with pytest.raises(TypeError, match="float32"):
        K.encode(np.ones(8), 8, 8)
    with pytest.raises(ValueError, match="multiple of 8"):
        K.encode(np.ones(8, np.float32), 8, 12)
    with pytest.raises(ValueError, match="elements"):
        K.decode(np.zeros(3, np.uint8), 8, 8, np.empty(8, np.float32))


# -- the ring ------------------------------------------------------------------------------------
def ring(xs, bits, block, residuals=None, chunk_bytes=256, tag=None, midrise=False):
    wires = [LowbitWire(bits, block, None if residuals is None else residuals[r], midrise) for r in range(len(xs))]
    return wire_ring(xs, wires, chunk_bytes, tag)


@pytest.mark.parametrize("bits,midrise", [(8, False), (4, False), (2, False), (4, True), (2, True)])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [0, 5, 64, 1000, 20_011])
def test_ring_bit_identical_within_the_hop_bound(world, n, bits, midrise):
    block = 64
    xs = [data(n, 10 * r + n) for r in range(world)]
    outs, sent = ring(xs, bits, block, midrise=midrise)
    for o in outs[1:]:
        np.testing.assert_array_equal(o.view(np.uint32), outs[0].view(np.uint32))
    exact = np.sum(np.array(xs, np.float64), axis=0) if n else np.zeros(0)
    # world encodings of a partial sum per element (world-1 hops, the owner's), each off by at most
    # half a step of (1 + 2**-7) * its block's max |partial sum| / qmax <= that of sum |x_r| (+ earlier errors)
    qmax = 2 ** (bits - 1) - 1 + (0.5 if midrise else 0)
    if n:
        big = np.abs(np.array(xs, np.float64)).sum(axis=0)
        bmax = np.repeat(np.maximum.reduceat(big, np.arange(0, n, block)), block)[:n]
        grow = (1 + 0.51 / qmax) ** world
        assert np.all(np.abs(outs[0] - exact) <= world * 0.51 / qmax * bmax * grow + 1e-30)
    if world > 1 and n:
        # bytes: 2(N-1) messages per segment chunk of bits/8 per value + 2 per block (N-1 of them the
        # same chunk bytes forwarded); at most one partial block more per segment boundary
        lo = 2 * (world - 1) / world * n * bits / 8
        hi = lo + 2 * (world - 1) * (2 * (-(-n // block)) / world + 2 * world + 1)
        assert lo <= np.mean(sent) <= hi + 2 * (world - 1), (sent, lo, hi)


@pytest.mark.parametrize("bits,midrise", [(4, False), (2, True)])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_ring_error_feedback_loses_nothing(world, bits, midrise):
    # every node encodes every element once a round: the results plus the residuals are the inputs
    n, block = 3001, 64
    res = [np.zeros(n, np.float32) for _ in range(world)]
    sent_total = np.zeros(n)
    inputs = np.zeros(n)
    for rnd in range(4):
        xs = [data(n, 100 * rnd + r) for r in range(world)]
        inputs += np.sum(np.array(xs, np.float64), axis=0)
        fed = [x + v for x, v in zip(xs, res)]
        new = [np.full(n, np.nan, np.float32) for _ in range(world)]
        outs, _ = ring(fed, bits, block, new, midrise=midrise)
        assert not any(np.isnan(v).any() for v in new), "an element's residual was not written"
        res = new
        sent_total += outs[0]
    left = np.sum(np.array(res, np.float64), axis=0)
    np.testing.assert_allclose(sent_total + left, inputs, atol=1e-5 * np.abs(inputs).max())


def test_ring_tag_mismatch_fails_everywhere():
    xs = [data(1000, r) for r in range(3)]
    with pytest.raises(RoundMismatchError, match="disagree"):
        ring(xs, 8, 64, tag=[{"name": "a"}, {"name": "a"}, {"name": "b"}])


def test_ring_refuses_other_options_with_a_wire_format():
    with pytest.raises(ValueError, match="wire format"):
        MemoryRing(1).run(lambda t: ring_allreduce(t, np.ones(8, np.float32), timeout=1.0,
                                                   wire=LowbitWire(8, 8), divide_by=2))


# -- the codec -----------------------------------------------------------------------------------
def ctx(n, rank=0, world=1):
    return RoundContext(job="j", name="t", shape=(n,), round_id=0, rank=rank, world=world, seed=1)


def test_parameters_are_checked_with_a_fix():
    assert get_codec("lowbit").params == {"bits": 8, "block": 64, "error_feedback": True, "midrise": False}
    for bad, needle in [({"bits": 3}, "8, 4, 2 or 1"), ({"bits": True}, "8, 4, 2 or 1"), ({"block": 12}, "multiple of 8"),
                        ({"block": 1 << 20}, "multiple of 8"), ({"error_feedback": "yes"}, "True or False"),
                        ({"midrise": 1}, "midrise must be True or False"),
                        ({"bitz": 4}, "bits")]:
        with pytest.raises(CodecError, match=needle):
            get_codec("lowbit", **bad)


def test_state_changes_only_with_a_committed_round():
    codec = get_codec("lowbit", bits=4)
    n = 1000
    state = codec.new_state(n)
    assert codec.state_nbytes(state) == 4 * n
    x = data(n)
    for commit in (False, True):
        txn = begin_round(state)
        values = codec.compress(x, ctx(n), txn).values
        wire = codec.wire_format(ctx(n), txn)
        out, = MemoryRing(1).run(lambda t, v=values, w=wire: ring_allreduce(t, v, timeout=5.0, wire=w))
        if commit:
            commit_round(txn)
            np.testing.assert_array_equal(state["v"], x - out)
        else:
            assert not state["v"].any()
    assert get_codec("lowbit", error_feedback=False).new_state(n) is None


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_any_bytes_of_the_right_length_decode_without_harm(bits):
    # bytes from a peer: any scale (NaN, Inf, subnormal) and any code decode to some float32 each
    n, block = 1000, 64
    buf = np.random.default_rng(bits).integers(0, 256, K.nbytes(n, bits, block), dtype=np.uint8)
    out = np.empty(n, np.float32)
    K.decode(buf, bits, block, out)
    K.decode(buf, bits, block, out, out)
    K.decode(buf, bits, block, out, midrise=True)
    assert out.shape == (n,)


def test_a_peer_with_another_encoding_fails_the_round_not_hangs():
    assert_mismatched_wires_fail([data(1000, r) for r in range(3)], [LowbitWire(8, 64), LowbitWire(4, 64), LowbitWire(8, 64)])
