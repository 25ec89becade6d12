"""bird / birdplus: the properties docs/codecs.md states (unbiased in expectation, the density kept, error
feedback that loses nothing), fixed seeds, stated tolerances."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _codec_sim import contexts

from birdnet.codecs import get_codec
from birdnet.errors import CodecError

BOTH = ["bird", "birdplus"]


def grad(n, seed=0, b=8):
    # heterogeneous block magnitudes, like a real gradient
    rs = np.random.default_rng(seed)
    scale = np.repeat(rs.exponential(1.0, -(-n // b)), b)[:n]
    return (rs.standard_normal(n) * scale).astype(np.float32)


def decompress_one(codec, x, ctx, state=None):
    p = codec.compress(x, ctx, state)
    out = np.zeros(x.shape[0], np.float32)
    codec.decompress_add(p, out, ctx)
    return out, p


def plain(name, **kw):
    # the paper's form: no error feedback, exact 1/p scaling
    return get_codec(name, **{"error_feedback": False, "scale": "exact", **kw})


@pytest.mark.parametrize("name", BOTH)
def test_density_one_is_exact_and_zero_gives_zero(name):
    n = 1001
    c = plain(name, density=1.0, block=8)
    x = grad(n)
    out, _ = decompress_one(c, x, contexts(n)[0])
    np.testing.assert_array_equal(out, x)
    out, p = decompress_one(c, np.zeros(n, np.float32), contexts(n)[0])
    assert not out.any() and p.header["k"] == 0 and np.all(np.isfinite(out))


@pytest.mark.parametrize("name", BOTH)
def test_whole_blocks_only_and_zero_blocks_never_kept(name):
    n, b = 4000, 8
    c = plain(name, density=0.2, block=b)
    x = grad(n)
    x[: n // 2] = 0.0  # half the blocks are zero
    for s in range(20):
        out, p = decompress_one(c, x, contexts(n, seed=s)[0])
        ids = p.buffers[0].astype(np.int64)
        assert np.all(ids >= (n // 2) // b)
        kept = np.zeros(n, bool)
        for i in ids:
            kept[i * b:(i + 1) * b] = True
        assert not out[~kept].any()
        np.testing.assert_allclose(out[kept] / x[kept], np.repeat(out[kept][::b] / x[kept][::b], b), rtol=1e-5)


@pytest.mark.parametrize("name", BOTH)
def test_unbiased_with_exact_scaling(name):
    # property 3: per block, mean over trials within 5 sigma of the truth (sigma from the sample)
    n, b, trials = 256, 8, 1500
    c = plain(name, density=0.25, block=b, **({"gamma": 1.0} if name == "birdplus" else {}))
    x = grad(n, 3, b)
    acc = np.zeros(n)
    acc2 = np.zeros(n)
    for t in range(trials):
        out, _ = decompress_one(c, x, contexts(n, seed=1000 + t)[0])
        acc += out
        acc2 += out.astype(np.float64) ** 2
    mean = acc / trials
    sd = np.sqrt(np.maximum(acc2 / trials - mean**2, 0.0) / trials)
    assert np.all(np.abs(mean - x) <= 5 * sd + 1e-5 * np.abs(x).max())
    # L1 invariance (property 4): mean L1 within 5 sigma
    l1s = []
    for t in range(trials):
        out, _ = decompress_one(c, x, contexts(n, seed=9000 + t)[0])
        l1s.append(np.abs(out.astype(np.float64)).sum())
    l1s = np.array(l1s)
    l1 = np.abs(x.astype(np.float64)).sum()
    # (+ float32 rounding: birdplus with gamma 1 keeps the L1 norm almost exactly on every draw)
    assert abs(l1s.mean() - l1) <= 5 * l1s.std() / np.sqrt(trials) + 1e-6 * l1


def test_bird_density_within_15_percent():
    n, b, rho = 400_000, 8, 0.01
    c = get_codec("bird", density=rho, block=b, error_feedback=False)
    m = n // b
    for s in range(5):
        _, p = decompress_one(c, grad(n, s, b), contexts(n, seed=s)[0])
        assert abs(p.header["k"] - rho * m) <= 0.15 * rho * m, p.header["k"]


@pytest.mark.parametrize("n,b,rho", [(100_000, 32, 0.01), (1001, 8, 0.05), (5, 32, 0.01), (65, 32, 0.001),
                                     (64 * 1000, 64, 0.3)])
def test_birdplus_exactly_k_blocks(n, b, rho):
    c = get_codec("birdplus", density=rho, block=b, error_feedback=False)
    m = -(-n // b)
    want = max(1, int(np.floor(rho * m + 0.5)))
    for s in range(5):
        _, p = decompress_one(c, grad(n, s, b), contexts(n, seed=s)[0])
        assert p.header["k"] == want


def test_payload_size_formula_and_ratio_vs_topk():
    b, m, rho = 4, 70_000, 0.01  # m > 65536: uint32 ids
    n = b * m
    x = grad(n, 1, b)
    c = get_codec("birdplus", density=rho, block=b, error_feedback=False)
    _, p = decompress_one(c, x, contexts(n)[0])
    k = p.header["k"]
    assert p.nbytes == k * 4 + k * b * 4
    t = get_codec("topk", density=rho, error_feedback=False).compress(x, contexts(n)[0], None)
    assert t.nbytes / p.nbytes == pytest.approx(2 * b / (b + 1), rel=0.01)
    # small tensors use uint16 ids, float16 halves the values
    c16 = get_codec("birdplus", density=0.1, block=32, value_dtype="float16", error_feedback=False)
    p16 = c16.compress(grad(3200), contexts(3200)[0], None)
    assert p16.buffers[0].dtype == np.uint16 and p16.nbytes == 10 * 2 + 10 * 32 * 2


@pytest.mark.parametrize("name", BOTH)
@pytest.mark.parametrize("mode", ["local", "shared"])
def test_same_seed_identical_and_no_residual_state(name, mode):
    n = 10_000
    c = get_codec(name, mode=mode, error_feedback=False)
    st = c.new_state(n)
    if mode == "local":
        assert st is None
    else:  # the selection only: no per-element or per-block state
        assert set(st) == {"ids", "round"} and c.state_nbytes(st) == 8
    x = grad(n)
    p1 = c.compress(x, contexts(n)[0], st)
    p2 = c.compress(x, contexts(n)[0], st)
    if mode == "local":
        for a, b in zip(p1.buffers, p2.buffers):
            np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_array_equal(p1.values, p2.values)
        assert p1.header == p2.header
    np.testing.assert_array_equal(x, grad(n))  # input untouched


def ring_rounds(codec, world, n, rounds, seed=0, inputs=None):
    """``rounds`` rounds of a SUMMABLE codec over MemoryRing (the real ring algorithm, threads as
    nodes): per round, every node's output and state, and what each node sent (its accumulator on
    the kept blocks, read before compress)."""
    from birdnet.ring.dense import ring_allreduce
    from birdnet.ring.transport import MemoryRing

    states = [codec.new_state(n) for _ in range(world)]
    hist = []
    for rnd in range(rounds):
        xs = inputs(rnd) if inputs else [grad(n, seed + 100 * rnd + r) for r in range(world)]
        cs = contexts(n, world, rnd)
        before = [codec.new_state(n) if s is None else {k: v.copy() for k, v in s.items()} for s in states]

        def node(t, xs=xs, cs=cs):
            r = t.rank
            p = codec.compress(xs[r], cs[r], states[r])
            tag = {"len": int(p.values.size), "digest": p.header.get("digest")}
            summed = ring_allreduce(t, p.values, timeout=30, wire_dtype=codec.wire_dtype, tag=tag)
            out = np.empty(n, np.float32)
            codec.decompress(type(p)(header=p.header, values=summed), out, cs[r], states[r])
            return out, int(p.values.size), p.header["k"]

        res = MemoryRing(world).run(node, timeout=60)
        hist.append((xs, before, res, [{k: v.copy() for k, v in s.items()} for s in states]))
    return hist


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("proposers", ["every", "rotating"])
def test_shared_mode_sums_over_the_ring_bit_identically(world, proposers):
    # the summable property: payloads of equal length add up hop by hop, every node ends with the
    # same bits and the same next selection, and the sum on the kept blocks is what the nodes sent
    n, b = 20_011, 8
    c = get_codec("birdplus", mode="shared", momentum=0.9, proposers=proposers, density=0.02)
    m = -(-n // b)
    k = max(1, round(0.02 * m))
    for xs, before, res, after in ring_rounds(c, world, n, 4):
        outs = [r[0] for r in res]
        for o in outs[1:]:
            assert o.tobytes() == outs[0].tobytes()
        for s in after[1:]:
            np.testing.assert_array_equal(s["ids"], after[0]["ids"])
        # bytes per node do not grow with the world: K blocks of b values + K proposal ids
        assert {r[1] for r in res} == {res[0][2] * b + c._tail_len(m, world)}
        assert c._tail_len(m, world) <= k and res[0][2] <= k
        sent = np.zeros(n, np.float64)
        for r in range(world):  # what each node sent: its accumulator after this round's momentum
            u = 0.9 * before[r]["u"] + xs[r]
            sent += before[r]["v"] + u
        nz = outs[0] != 0
        np.testing.assert_allclose(outs[0][nz], sent[nz], rtol=1e-5, atol=1e-6)
        assert np.count_nonzero(nz) <= res[0][2] * b


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [3, 8])
def test_shared_mode_with_feedback_lowpass_identical_on_every_node(world):
    # the filter changes only each node's accumulator: sums, results and next selections stay
    # bit-identical everywhere, and what is sent is still the accumulator after this round's momentum
    n = 20_011
    c = get_codec("birdplus", mode="shared", momentum=0.9, density=0.02, feedback_lowpass=0.5)
    for xs, before, res, after in ring_rounds(c, world, n, 4):
        assert len({r[0].tobytes() for r in res}) == 1
        for s in after[1:]:
            np.testing.assert_array_equal(s["ids"], after[0]["ids"])
        sent = sum(before[r]["v"].astype(np.float64) + 0.9 * before[r]["u"] + xs[r] for r in range(world))
        nz = res[0][0] != 0
        np.testing.assert_allclose(res[0][0][nz], sent[nz], rtol=1e-5, atol=1e-6)
        # no state beyond v, u and the selection (8 bytes per id + its round)
        assert c.state_nbytes(after[0]) == 8 * n + 8 * after[0]["ids"].shape[0] + 8


@pytest.mark.parametrize("proposers", ["every", "rotating"])
def test_shared_mode_float16_wire_carries_the_ids_exactly(proposers):
    n = 300_000  # m = 37,500 blocks > 2**11: ids need two float16 digits
    c = get_codec("birdplus", mode="shared", momentum=0.9, value_dtype="float16", proposers=proposers)
    hist = ring_rounds(c, 3, n, 3)
    for _, _, res, after in hist:
        assert len({r[0].tobytes() for r in res}) == 1
        # ids above 2**11 need the second digit: the selection spans the whole tensor
        assert 2048 < int(after[0]["ids"].max()) < -(-n // 8)
    # the proposal is exactly the proposers' top blocks: decode what the last round's tail said
    assert all(s["round"][0] == 3 for s in hist[-1][3])


def test_shared_mode_sees_every_nodes_accumulator():
    # the design point (docs/research/findings.md): a block that only one node needs is sent within
    # one round ("every") or within world rounds ("rotating"), instead of growing unseen
    n, b, world = 8000, 8, 4
    big = 777  # a block only node 2 has, 1000x larger than anything else
    def inputs(rnd):
        xs = [grad(n, 50 * rnd + r) * np.float32(1e-3) for r in range(world)]
        if rnd == 0:
            xs[2][big * b:(big + 1) * b] = 1.0
        return xs
    # with the default low-pass filter (beta 0.5) half of the block reaches the accumulator
    for lowpass, reach in ((1.0, 0.9), ("auto", 0.45)):
        for proposers, within in (("every", 2), ("rotating", world + 1)):
            c = get_codec("birdplus", mode="shared", momentum=0.0, proposers=proposers, density=0.01,
                          feedback_lowpass=lowpass)
            hist = ring_rounds(c, world, n, within, inputs=inputs)
            sent_at = [r for r, (_, _, res, _) in enumerate(hist) if abs(res[0][0][big * b]) > reach]
            assert sent_at and sent_at[0] < within, (lowpass, proposers, sent_at)


def test_shared_mode_rejects_a_damaged_proposal():
    n = 4000
    c = get_codec("birdplus", mode="shared")
    ctx = contexts(n)[0]
    st = c.new_state(n)
    p = c.compress(grad(n), ctx, st)
    k = p.header["k"]
    for bad in (0.5, -1.0, float(1 << 24), np.nan, float(-(-n // 8) + 1)):
        v = p.values.copy()
        v[k * 8] = bad
        with pytest.raises(CodecError, match="proposal"):
            c.decompress(type(p)(header=p.header, values=v), np.empty(n, np.float32), ctx, st)
    v = p.values[:-1].copy()
    with pytest.raises(CodecError, match="expected"):
        c.decompress(type(p)(header=p.header, values=v), np.empty(n, np.float32), ctx, st)
    assert st["round"][0] == -1  # a failed decompress leaves the selection as it was


def test_error_feedback_carries_the_remainder():
    n, b = 1024, 8
    c = get_codec("birdplus", density=0.1, block=b, scale="none")  # error feedback, no scaling
    st = c.new_state(n)
    x = grad(n, 5, b)
    total = np.zeros(n, np.float32)
    zero = np.zeros(n, np.float32)
    for r in range(12):  # K = 13 of 128 blocks per round: everything is sent within 10 rounds
        out, _ = decompress_one(c, x if r == 0 else zero, contexts(n, rnd=r)[0], st)
        total += out
        np.testing.assert_allclose(total + st["v"], x, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(total, x)
    assert not st["v"].any()


def test_momentum_correction_reference():
    n, b, mom = 512, 8, 0.9
    c = get_codec("birdplus", density=0.25, block=b, momentum=mom, scale="none")
    st = c.new_state(n)
    u = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    for r in range(5):
        x = grad(n, r, b)
        out, p = decompress_one(c, x, contexts(n, rnd=r)[0], st)
        u = np.float32(mom) * u + x
        v = v + u
        kept = out != 0
        np.testing.assert_array_equal(out[kept], v[kept])
        v[kept] = 0
        u[kept] = 0
        np.testing.assert_array_equal(st["v"], v)
        np.testing.assert_array_equal(st["u"], u)


@pytest.mark.parametrize("mode", ["local", "shared"])
def test_feedback_lowpass_reference(mode):
    # ScaleCom's low-pass filter on the error feedback: v <- (1 - beta) v + beta (v + u - sent); a
    # kept block keeps (1 - beta) of its old accumulator, an unsent one takes beta of the momentum
    n, b, mom, beta = 512, 8, 0.9, 0.3
    c = get_codec("birdplus", density=0.25, block=b, momentum=mom, scale="none", mode=mode,
                  feedback_lowpass=beta)
    st = c.new_state(n)
    u = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    for r in range(5):
        x = grad(n, r, b)
        if mode == "shared":  # one node: its payload is the sum
            ctx = contexts(n, world=1, rnd=r)[0]
            p = c.compress(x, ctx, st)
            out = np.empty(n, np.float32)
            c.decompress(type(p)(header=p.header, values=p.values.copy()), out, ctx, st)
        else:
            out, p = decompress_one(c, x, contexts(n, rnd=r)[0], st)
        u = np.float32(mom) * u + x
        full = v + u
        kept = np.zeros(n, bool)
        nz = np.flatnonzero(out)
        for i in np.unique(nz // b):
            kept[i * b:(i + 1) * b] = True
        np.testing.assert_array_equal(out[kept], full[kept])
        sent = np.where(kept, full, np.float32(0))
        v = np.float32(beta) * (full - sent) + np.float32(1 - beta) * v
        u[kept] = 0
        np.testing.assert_allclose(st["v"], v, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(st["u"], u)
    for bad in (0.0, 1.5, True, "x"):
        with pytest.raises(CodecError, match="feedback_lowpass"):
            get_codec("birdplus", feedback_lowpass=bad)
    # "auto" (the default): the filter in shared mode, where it was measured to help, off elsewhere
    assert get_codec("birdplus", mode="shared").params["feedback_lowpass"] == 0.5
    assert get_codec("bird", mode="shared").params["feedback_lowpass"] == 0.5
    assert get_codec("birdplus").params["feedback_lowpass"] == 1.0
    assert get_codec("birdplus", mode="shared", accumulator="block_age").params["feedback_lowpass"] == 1.0
    assert get_codec("birdplus", mode="shared", error_feedback=False).params["feedback_lowpass"] == 1.0
    with pytest.raises(CodecError, match="feedback_lowpass"):
        get_codec("birdplus", feedback_lowpass=0.5, accumulator="block_age")


def test_edge_cases_small_and_dominant():
    c = get_codec("birdplus", density=0.01, block=32, error_feedback=False)
    for n in (1, 5, 31, 33, 97):
        x = grad(n)
        out, p = decompress_one(c, x, contexts(n)[0])
        assert p.header["k"] == 1 and out.shape == (n,)
    n = 32 * 100
    x = np.full(n, 1e-3, np.float32)
    x[32 * 41: 32 * 42] = 100.0  # one dominant block is kept (gamma 4 makes the others negligible)
    for s in range(10):
        _, p = decompress_one(c, x, contexts(n, seed=s)[0])
        assert list(p.buffers[0]) == [41]


_THREADS_SCRIPT = textwrap.dedent("""
    import json, sys, numpy as np, numba
    sys.path.insert(0, {tests!r})
    from _codec_sim import contexts
    from birdnet.codecs import get_codec
    res = {{"threads": numba.get_num_threads()}}
    n = 300_003
    x = (np.random.default_rng(1).standard_normal(n) * np.repeat(np.random.default_rng(2).exponential(1, n // 32 + 1), 32)[:n]).astype(np.float32)
    for name in ("bird", "birdplus"):
        c = get_codec(name, mode="shared", error_feedback=True, momentum=0.5)
        st = c.new_state(n)
        digests = []
        for r in range(3):
            p = c.compress(x, contexts(n, rnd=r)[0], st)
            digests.append(p.header["digest"])
            out = np.empty(n, np.float32)
            c.decompress(p, out, contexts(n, rnd=r)[0], st)
        res[name] = [digests, st["ids"].tolist(), float(np.abs(st["v"]).sum())]
    print(json.dumps(res))
""")


def test_shared_selection_identical_across_thread_counts():
    import birdnet
    root = os.path.dirname(os.path.dirname(birdnet.__file__))
    script = _THREADS_SCRIPT.format(tests=os.path.dirname(__file__))
    results = []
    for threads in ("1", "2"):
        env = {**os.environ, "NUMBA_NUM_THREADS": threads,
               "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert results[0]["threads"] == 1 and results[1]["threads"] == 2
    for name in ("bird", "birdplus"):
        assert results[0][name] == results[1][name]


def test_the_shared_payload_format_is_in_the_cluster_fingerprint():
    # daemons from before the proposal tail would sum payloads of another length: they must refuse
    # each other at the handshake, naming the key
    from birdnet.config import Settings
    cw = Settings().cluster_wide()
    assert cw["codec_formats"]["birdplus.shared"] == 2 and cw["codec_formats"]["bird.shared"] == 2
    old = {k: v for k, v in cw.items() if k != "codec_formats"}
    assert old != cw


def test_block_age_accumulator_reference_and_state_bytes():
    # error feedback in 2 bytes per block (n/4 at blocks of 8): the accumulator of a block unsent
    # for `age` rounds is estimated as min(age, age_cap) x the momentum now (NumPy reference)
    n, b, mom, cap = 4000, 8, 0.9, 3
    c = get_codec("birdplus", density=0.05, block=b, momentum=mom, accumulator="block_age", age_cap=cap,
                  scale="none")
    st = c.new_state(n)
    m = -(-n // b)
    assert set(st) == {"u", "age"} and st["age"].nbytes == 2 * m == n // 4 and st["u"].nbytes == 4 * n
    u = np.zeros(n, np.float32)
    age = np.zeros(m, np.int64)
    for r in range(6):
        x = grad(n, r, b)
        out, p = decompress_one(c, x, contexts(n, rnd=r)[0], st)
        u = np.float32(mom) * u + x
        age += 1
        ids = p.buffers[0].astype(np.int64)
        w = np.repeat(np.minimum(age, cap).astype(np.float32), b)[:n]
        kept = np.zeros(n, bool)
        for i in ids:
            kept[i * b:(i + 1) * b] = True
        np.testing.assert_array_equal(out[kept], (u * w)[kept])
        assert not out[~kept].any()
        age[ids] = 0
        np.testing.assert_array_equal(st["age"], age)
        np.testing.assert_array_equal(st["u"], u)  # plain momentum: not cleared on send
    with pytest.raises(CodecError, match="age_cap"):
        get_codec("birdplus", accumulator="block_age", age_cap=0)
    with pytest.raises(CodecError, match="accumulator"):
        get_codec("birdplus", accumulator="bits")


@pytest.mark.timeout(120)
def test_block_age_shared_mode_identical_ages_on_every_node():
    # in shared mode every node resets the same blocks: the ages are the same everywhere
    n = 30_000
    c = get_codec("birdplus", mode="shared", momentum=0.9, accumulator="block_age")
    for _, _, res, after in ring_rounds(c, 5, n, 4):
        assert len({r[0].tobytes() for r in res}) == 1
        for s in after[1:]:
            np.testing.assert_array_equal(s["age"], after[0]["age"])
        assert c.state_nbytes(after[0]) - after[0]["u"].nbytes <= n // 4 + 8 * after[0]["ids"].shape[0] + 8


def test_proposal_kernels_against_numpy():
    from birdnet.kernels import blocks as B
    rs = np.random.default_rng(4)
    a = rs.exponential(1.0, 5000).astype(np.float32)
    a[rs.integers(0, 5000, 300)] = 0.0
    a[17], a[4000] = np.inf, np.nan
    key = (a.view(np.uint32) & np.uint32(0x7FFFFFFF)).astype(np.int64)  # NaN > Inf > finite
    for k in (1, 2, 50, 4800, 5000):
        ref = np.sort(np.argsort(-key, kind="stable")[:k])
        np.testing.assert_array_equal(B.top_blocks(a, k), ref[a[ref] != 0])
    for m, base in ((5000, 1 << 24), (40_000, 1 << 11), (5_000_000, 1 << 11)):
        d = 1 if m < base else (2 if m < base * base else 3)
        ids = np.sort(rs.choice(m, 37, replace=False))
        t = np.zeros(40 * d, np.float32)
        B.encode_ids(ids, base, d, t)
        np.testing.assert_array_equal(B.decode_ids(t, base, d, m), ids)
    x = rs.standard_normal(70_001).astype(np.float32)
    u = rs.standard_normal(70_001).astype(np.float32)
    ref_u = np.float32(0.9) * u + x
    out = np.empty(-(-70_001 // 8), np.float32)
    B.momentum_norms(x, u, 0.9, 8, out)
    np.testing.assert_array_equal(u, ref_u)
    np.testing.assert_array_equal(out, B.block_norms(ref_u, 8))


@pytest.mark.parametrize("params", [{}, {"momentum": 0.9}, {"accumulator": "block_age", "momentum": 0.9},
                                    {"value_dtype": "float16"}, {"momentum": 0.9, "feedback_lowpass": 0.5},
                                    {"momentum": 0.9, "feedback_lowpass": 0.5, "mode": "shared"}])
def test_birdplus_round_in_a_state_txn_equals_in_place(params):
    """The daemon runs each round on a StateTxn (committed only when the round completes): the norm
    pass writes the accumulators into the round's scratch instead of updating a copy. Payloads and
    committed state must be bit-for-bit what the in-place update gives, and an uncommitted round
    must leave the state as it was."""
    from birdnet.codecs.base import StateTxn
    n = 70_001
    codec = get_codec("birdplus", density=0.01, **params)
    plain, txn_state = codec.new_state(n), codec.new_state(n)
    rng = np.random.default_rng(5)
    for rnd in range(4):
        x = rng.standard_normal(n).astype(np.float32)
        ctx = contexts(n, rnd=rnd)[1]
        a = codec.compress(x, ctx, plain)
        before = {k: np.array(v, copy=True) for k, v in txn_state.items()}
        dropped = StateTxn(txn_state)
        codec.compress(x, ctx, dropped)  # a round that fails: never committed
        for k, v in before.items():
            np.testing.assert_array_equal(txn_state[k], v)
        txn = StateTxn(txn_state)
        b = codec.compress(x, ctx, txn)
        txn.commit()
        assert a.header == b.header
        for pa, pb in zip(a.buffers, b.buffers):
            np.testing.assert_array_equal(np.asarray(pa), np.asarray(pb))
        for k in plain:
            np.testing.assert_array_equal(txn_state[k], plain[k])
