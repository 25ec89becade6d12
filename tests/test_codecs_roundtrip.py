"""Every codec through a simulated 4-node round, payload validation, edge cases."""
from __future__ import annotations

import math

import numpy as np
import pytest
from _codec_sim import contexts, sim_round

from birdnet.codecs import Pattern, get_codec
from birdnet.codecs.base import pack_buffers
from birdnet.errors import CodecError, RoundMismatchError

ALL = [
    ("none", {}), ("fp16", {}), ("topk", {}), ("topk", {"error_feedback": False}),
    ("topk", {"momentum": 0.9}), ("randomk", {}), ("randomk", {"error_feedback": True, "scale": False}),
    ("dgc", {}), ("dgc", {"momentum": 0.9}), ("qsgd", {}), ("qsgd", {"levels": 1000}), ("efsign", {}),
    ("efsign", {"error_feedback": False}),
    ("bird", {}), ("bird", {"mode": "shared"}), ("bird", {"error_feedback": False, "scale": "capped"}),
    ("birdplus", {}), ("birdplus", {"mode": "shared"}), ("birdplus", {"value_dtype": "float16"}),
    ("birdplus", {"mode": "shared", "value_dtype": "float16", "momentum": 0.9}),
    ("birdplus", {"error_feedback": False, "scale": "exact", "gamma": 1}),
    ("lowbit", {}), ("lowbit", {"bits": 4}), ("lowbit", {"bits": 2, "block": 8}),
    ("lowbit", {"bits": 8, "error_feedback": False}), ("lowbit", {"bits": 4, "error_feedback": False, "block": 128}),
    ("lowbit", {"bits": 2, "midrise": True}),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in p.items())}" for n, p in ALL]


def xs_for(n, world=4, seed=0):
    scale = np.random.default_rng(99).exponential(1.0, n).astype(np.float32)
    return [np.random.default_rng(seed + r).standard_normal(n).astype(np.float32) * scale for r in range(world)]


def feedback_total(states):
    return sum(s["v"].astype(np.float64) for s in states) if states[0] is not None and "v" in states[0] else 0.0


@pytest.mark.parametrize("name,params", ALL, ids=IDS)
@pytest.mark.parametrize("n", [1, 33, 1000, 20_011])
def test_simulated_round_error_bound(name, params, n):
    codec = get_codec(name, **params)
    states = [codec.new_state(n) for _ in range(4)]
    for rnd in range(3):
        xs = xs_for(n, seed=10 * rnd)
        exact = sum(x.astype(np.float64) for x in xs)
        before = feedback_total(states)
        vs = [s["v"].copy() for s in states] if states[0] is not None and "v" in states[0] else None
        moms = [s["u"].copy() for s in states] if states[0] is not None and "u" in states[0] else None
        out, pays = sim_round(codec, xs, states, rnd)
        assert out.dtype == np.float32 and out.shape == (n,)
        norm = np.linalg.norm(exact)
        if vs is not None:
            # error feedback: nothing is lost, only delayed. result + residuals = inputs + old residuals;
            # with a low-pass filter (beta < 1: v += beta (x - sent)) beta x result + residuals =
            # beta x inputs + old residuals
            beta = codec.params.get("feedback_lowpass", 1.0)
            fed = [x + (np.float32(codec.params["momentum"]) * u if moms else 0) for x, u in
                   zip(xs, moms or [0] * 4)] if moms else xs
            want = beta * sum(f.astype(np.float64) for f in fed) + before
            got = beta * out.astype(np.float64) + feedback_total(states)
            tol = 2e-3 if codec.params.get("value_dtype") == "float16" else 1e-5
            np.testing.assert_allclose(got, want, atol=tol * (np.abs(want).max() + 1))
        elif name == "none":
            np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-5)
        elif name == "fp16":
            np.testing.assert_allclose(out, exact, rtol=4e-3, atol=4e-3 * np.abs(exact).max())
        elif name == "qsgd":
            s = codec.params["levels"]
            bound = math.sqrt(sum(min(n / s**2, math.sqrt(n) / s) * np.dot(x, x) for x in xs))
            assert np.linalg.norm(out - exact) <= 4 * bound + 1e-6
        elif name == "efsign":
            assert np.linalg.norm(out - exact) <= sum(np.linalg.norm(x) for x in xs) + 1e-6
        elif name == "topk":
            k = pays[0].header["k"]
            assert np.linalg.norm(out - exact) <= sum(math.sqrt(1 - k / n) * np.linalg.norm(x) for x in xs) + 1e-5
        elif name == "lowbit":
            # every hop rounds each element by at most half a step, a step at most
            # (1 + 2**-7) * (the block's max |partial sum|) / qmax: bounded by the block's max of sum |x_r|
            qmax = 2 ** (codec.params["bits"] - 1) - 1 + (0.5 if codec.params["midrise"] else 0)
            b = codec.params["block"]
            big = np.abs(np.array(xs, np.float64)).sum(axis=0)
            blockmax = np.repeat(np.maximum.reduceat(big, np.arange(0, n, b)), b)[:n]
            assert np.all(np.abs(out - exact) <= 4 * 0.51 / qmax * blockmax * 1.01 + 1e-30)
        elif name in ("randomk", "bird", "birdplus"):
            assert np.all(np.isfinite(out))  # unbiased, large variance: checked statistically elsewhere
        else:  # pragma: no cover
            raise AssertionError(name)
        if codec.pattern == Pattern.SUMMABLE:
            assert len({p.values.shape[0] for p in pays}) == 1
        del norm


@pytest.mark.parametrize("name,params", ALL, ids=IDS)
def test_empty_tensor(name, params):
    codec = get_codec(name, **params)
    out, pays = sim_round(codec, [np.empty(0, np.float32)] * 4, [codec.new_state(0) for _ in range(4)])
    assert out.shape == (0,)


@pytest.mark.parametrize("name,params", [p for p in ALL if p[0] != "randomk"],
                         ids=[i for i, p in zip(IDS, ALL) if p[0] != "randomk"])
def test_nan_and_inf_propagate(name, params):
    # randomk is excluded: it keeps a fixed random subset and cannot see a NaN it does not sample
    # (bird's shared mode keeps a random number of blocks: n large enough that it keeps some; with
    # none kept the NaN stays in the error-feedback residual and surfaces in a later round)
    codec = get_codec(name, **params)
    n = 20_000
    for bad in (np.nan, np.inf):
        xs = xs_for(n)
        xs[1][517] = bad
        out, _ = sim_round(codec, xs, [codec.new_state(n) for _ in range(4)])
        assert not np.all(np.isfinite(out)), f"{name}: {bad} vanished"


@pytest.mark.parametrize("name,params", ALL, ids=IDS)
def test_zero_tensor_gives_zeros(name, params):
    codec = get_codec(name, **params)
    n = 777
    out, _ = sim_round(codec, [np.zeros(n, np.float32)] * 4, [codec.new_state(n) for _ in range(4)])
    if name == "efsign":
        assert np.all(np.isfinite(out)) and not out.any()
    else:
        assert not out.any()


@pytest.mark.parametrize("name", ["none", "topk", "qsgd", "birdplus"])
def test_bad_inputs_are_rejected_with_a_fix(name):
    codec = get_codec(name)
    ctx = contexts(10)[0]
    st = codec.new_state(10)
    with pytest.raises(CodecError, match="float32"):
        codec.compress(np.ones(10, np.float16), ctx, st)
    with pytest.raises(CodecError, match="contiguous"):
        codec.compress(np.ones(20, np.float32)[::2], ctx, st)
    with pytest.raises(CodecError, match="elements"):
        codec.compress(np.ones(11, np.float32), ctx, st)


def test_bad_parameters():
    for name, params in [("topk", {"density": 0}), ("topk", {"density": 2}), ("topk", {"nope": 1}),
                         ("birdplus", {"gamma": 0.3}), ("birdplus", {"mode": "x"}), ("birdplus", {"block": 0}),
                         ("birdplus", {"scale": "huge"}), ("birdplus", {"value_dtype": "int8"}),
                         ("birdplus", {"error_feedback": False, "momentum": 0.9}), ("qsgd", {"levels": 0}),
                         ("dgc", {"error_feedback": False}), ("bird", {"sample": 2}),
                         ("lowbit", {"bits": 3}), ("lowbit", {"block": 12}), ("lowbit", {"block": 0}),
                         ("lowbit", {"error_feedback": 1})]:
        with pytest.raises(CodecError):
            get_codec(name, **params)


def test_pattern_is_per_instance():
    assert get_codec("birdplus").pattern == Pattern.GATHERED
    assert get_codec("birdplus", mode="shared").pattern == Pattern.SUMMABLE
    assert get_codec("birdplus", mode="shared", value_dtype="float16").wire_dtype == "float16"
    assert get_codec("birdplus").pattern == Pattern.GATHERED  # the class default is untouched


GATHERED = [("topk", {}), ("dgc", {}), ("qsgd", {}), ("efsign", {}), ("bird", {}), ("birdplus", {}),
            ("birdplus", {"value_dtype": "float16"})]


@pytest.mark.parametrize("name,params", GATHERED)
def test_payload_from_wire_rejects_malformed(name, params):
    codec = get_codec(name, **params)
    n = 5000
    ctx = contexts(n)[0]
    x = xs_for(n)[0]
    h, bufs = pack_buffers(codec.compress(x, ctx, codec.new_state(n)))
    raw = [b.tobytes() for b in bufs]

    def wire(header, bs):
        return codec.payload_from_wire(dict(header), [memoryview(b) for b in bs])

    wire(h, raw)  # the honest payload is accepted
    with pytest.raises(CodecError):
        wire(h, raw[:-1])  # a buffer missing
    with pytest.raises(CodecError):
        wire(h, [raw[0][:-1]] + raw[1:])  # truncated
    with pytest.raises(CodecError):
        wire({**h, "n": -1}, raw)
    with pytest.raises(CodecError):
        wire({**h, "n": "5000"}, raw)
    with pytest.raises(CodecError):
        wire({**h, "dtypes": ["<f8"] * len(raw)}, raw)
    if "k" in h:
        with pytest.raises(CodecError):
            wire({**h, "k": h["k"] + 1}, raw)
        ids = np.frombuffer(raw[0], dtype=np.dtype(h["dtypes"][0])).copy()
        if ids.size:
            ids[-1] = np.iinfo(ids.dtype).max  # out of range
            with pytest.raises(CodecError):
                wire(h, [ids.tobytes()] + raw[1:])
    # a payload for another tensor size is refused by decompress_add
    p = wire(h, raw)
    with pytest.raises(CodecError):
        codec.decompress_add(p, np.zeros(n + 1, np.float32), contexts(n + 1)[0])


@pytest.mark.parametrize("name,params", [("randomk", {}), ("birdplus", {"mode": "shared"}),
                                         ("bird", {"mode": "shared"})])
def test_shared_digest_mismatch_is_an_error(name, params):
    codec = get_codec(name, **params)
    n = 4000
    ctx = contexts(n)[0]
    st = codec.new_state(n)
    p = codec.compress(xs_for(n)[0], ctx, st)
    p.header["digest"] ^= 1
    with pytest.raises(RoundMismatchError):
        codec.decompress(p, np.empty(n, np.float32), ctx, st)


def test_topk_error_feedback_matches_reference_with_momentum():
    n, k, mom = 300, 3, 0.9
    codec = get_codec("topk", density=k / n, momentum=mom)
    st = codec.new_state(n)
    u = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    for r in range(6):
        x = np.random.default_rng(r).standard_normal(n).astype(np.float32)
        p = codec.compress(x, contexts(n)[0], st)
        u = np.float32(mom) * u + x
        v = v + u
        idx = np.sort(np.argsort(-np.abs(v), kind="stable")[:k])
        np.testing.assert_array_equal(p.buffers[0], idx)
        np.testing.assert_array_equal(p.buffers[1], v[idx])
        v[idx] = 0
        u[idx] = 0
        np.testing.assert_array_equal(st["v"], v)
        np.testing.assert_array_equal(st["u"], u)


def test_state_memory_is_reported():
    n = 1000
    assert get_codec("topk", error_feedback=False).new_state(n) is None
    c = get_codec("topk", momentum=0.5)
    assert c.state_nbytes(c.new_state(n)) == 8 * n
    c = get_codec("efsign")
    assert c.state_nbytes(c.new_state(n)) == 4 * n


# -- a non-finite value never enters codec state -------------------------------------------------
# Every registry codec (and the momentum/compensation variants that keep more state) through the
# daemon's own round runner (StateTxn, commit) on an in-memory ring of 2 nodes.
NAN_SPECS = [(n, {}) for n in sorted(__import__("birdnet.codecs", fromlist=["names"]).names())] + [
    ("topk", {"momentum": 0.9}), ("dgc", {"momentum": 0.9}), ("birdplus", {"momentum": 0.9}),
    ("marsit", {"momentum": 0.9}), ("marsit", {"compensation": "global"}), ("efsign", {"momentum": 0.9}),
    ("randomk", {"error_feedback": True, "momentum": 0.9})]
NAN_N = 5003  # above the daemons' dense_threshold, so every codec compresses


def run_rounds(codec, params, calls, world=2):
    """``calls``: list of (seq, [x per node]); returns each call's result (node 0's; every node's
    must be bit-identical)."""
    from birdnet.daemon.engine import Contribution, LocalRound, RoundRunner, StateStore
    from birdnet.daemon.warmup import _FrameRing

    from birdnet.config import Settings
    desc_codec = get_codec(codec, **params).describe()
    runners = [RoundRunner(Settings(), StateStore(1 << 30)) for _ in range(world)]
    outs = [[None] * len(calls) for _ in range(world)]

    def node(t):
        for i, (seq, xs) in enumerate(calls):
            desc = {"kind": "allreduce", "name": "w", "shape": [NAN_N], "dtype": "float32", "op": "mean",
                    "codec": desc_codec, "root": None}
            part = Contribution(b"s", seq, xs[t.rank].copy(), 0, t.rank)
            runners[t.rank].run(LocalRound(job="j", seq=seq, kind="allreduce", desc=desc, parts=[part]),
                                t, t.rank, world, [1] * world)
            outs[t.rank][i] = part.array.copy()

    _FrameRing(world).run(node, timeout=120.0)
    for r in range(1, world):
        for a, b in zip(outs[0], outs[r]):
            np.testing.assert_array_equal(a, b)
    return outs[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,params", NAN_SPECS, ids=[f"{n}-{p}" for n, p in NAN_SPECS])
def test_a_nan_call_leaves_no_trace_in_the_calls_after_it(name, params):
    rng = np.random.default_rng(5)
    clean = [(seq, [rng.standard_normal(NAN_N).astype(np.float32) for _ in range(2)]) for seq in range(6)]
    reference = run_rounds(name, params, clean)
    # a step whose gradients blew up whole (an overflow: every element NaN on every node), then one
    # NaN element on node 0 (the common case): that call's result may carry NaN (nan_policy
    # "propagate"); the calls after it are finite and of the same size as without it. After the
    # blown call they are the same calls but for the elements that call "sent" (a NaN sent clears
    # that element's residual, a finite state value: error feedback loses what it held there).
    one = [rng.standard_normal(NAN_N).astype(np.float32) for _ in range(2)]
    one[0][17] = np.nan
    for bad, alike in (([np.full(NAN_N, np.nan, np.float32) for _ in range(2)], 0.9), (one, None)):
        after = run_rounds(name, params, clean[:2] + [(1000, bad)] + clean[2:])
        for i in range(2, 6):
            assert np.isfinite(after[i + 1]).all(), \
                f"call {i} after the NaN call has {np.count_nonzero(~np.isfinite(after[i + 1]))} NaN/Inf"
            ratio = np.linalg.norm(after[i + 1]) / np.linalg.norm(reference[i])
            assert 0.5 < ratio < 2.0, (i, ratio)
            if alike is not None:
                same = np.count_nonzero(after[i + 1] == reference[i]) / NAN_N
                assert same >= alike, (i, same)
