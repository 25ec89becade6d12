"""The slow-link mode (birdnet.client.diloco.OuterLoop, birdnet.client.torch.DiLoCo) on real daemons:
bit-identical outer parameters on every process, the schedule honoured, fragments and overlap, every
codec on pseudo-gradients, checkpoints that resume identically, rejoining, and training quality."""
from __future__ import annotations

import numpy as np
import pytest
from birdnet.client.diloco import OuterLoop, Schedule
from cluster import LocalCluster

from birdnet.errors import InputError

# -- NumPy: a linear model trained locally with SGD ---------------------------------------------------
D_IN, D_OUT = 48, 40  # the weight has 1920 elements: above the daemons' dense threshold (1024)


def _problem(rank: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w_true = rng.standard_normal((D_IN, D_OUT)).astype(np.float32)
    rr = np.random.default_rng(1000 + rank)
    return w_true, rr


def _local_sgd(params, w_true, rr, lr=0.05):
    x = rr.standard_normal((16, D_IN)).astype(np.float32)
    y = x @ w_true
    err = x @ params["w"] + params["b"] - y
    params["w"] -= lr * (x.T @ err) / len(x)
    params["b"] -= lr * err.mean(0)


params_box: list = [None]  # the current run's parameters, for a pull hook made before they exist


def _numpy_run(client, steps, timeout=60, **options):
    w_true, rr = _problem(client.rank)
    rng = np.random.default_rng(100 + client.rank)  # different on purpose: the broadcast fixes it
    params = {"w": rng.standard_normal((D_IN, D_OUT)).astype(np.float32), "b": np.zeros(D_OUT, np.float32)}
    params_box[0] = params
    for k in params:
        params[k][...] = client.broadcast(params[k], root=0, name=f"init/{k}", timeout=60)
    loop = OuterLoop(client, params.items(), timeout=timeout, **options)
    outer, stats = [], []
    for _ in range(steps):
        _local_sgd(params, w_true, rr)
        loop.step()
        outer.append({k: v.tobytes() for k, v in loop.outer_parameters().items()})
        stats.append(dict(loop.last_stats))
    loop.flush()
    return loop, params, outer, stats


def numpy_worker(sock, node, local):
    from birdnet.client import Client

    from birdnet.codecs import names
    out = {}
    with Client(sock, job="diloco-np") as client:
        out["rank"] = client.rank
        # plain averaging (lr 1, no momentum, codec none): the outer parameters are the locals' mean
        loop, params, outer, stats = _numpy_run(client, 8, sync_every=4, outer_lr=1.0, outer_momentum=0.0,
                                                codec="none")
        pre = {k: v.copy() for k, v in params.items()}
        out["mean"] = {"outer": outer, "stats": stats, "momentum": loop.fragments[0].momentum is not None}
        # the same by hand: the locals just before the sync (the pull hook sees them), averaged
        seen = []
        loop2, params2, outer2, _ = _numpy_run(client, 4, sync_every=4, outer_lr=1.0, outer_momentum=0.0, codec="none",
                                               pull=lambda: seen.append({k: v.copy() for k, v in params_box[0].items()}))
        out["mean"]["by_hand"] = {k: client.allreduce(v, name=f"check/{k}", codec="none", timeout=60) for k, v
                                  in seen[-1].items()}
        out["mean"]["outer4"] = loop2.outer_parameters()
        # the constructor returns once the daemon has the default codec's kernels (the daemons of
        # LocalCluster load a codec's kernels at its first use)
        from birdnet.client.diloco import DEFAULT_CODEC, DEFAULT_CODEC_PARAMS
        ready_before = client.warm(DEFAULT_CODEC, **DEFAULT_CODEC_PARAMS)
        probe = OuterLoop(client, {"p": np.zeros(4, np.float32)}.items())
        out["kernels"] = {"before": ready_before, "after": client.warm(DEFAULT_CODEC, **DEFAULT_CODEC_PARAMS),
                          "seconds": probe.kernels_seconds}
        # the schedule and the default codec with Nesterov momentum
        loop, params, outer, stats = _numpy_run(client, 12, sync_every=((1, 2), (2, 4), 4))
        out["sched"] = {"outer": outer, "stats": stats, "syncs": loop.syncs,
                        "momentum": loop.fragments[0].momentum is not None}
        # fragments with overlap
        loop, params, outer, stats = _numpy_run(client, 16, sync_every=4, fragments=2, overlap=True, codec="topk",
                                                codec_params={"density": 0.1})
        out["frag"] = {"outer": outer, "stats": stats, "final": {k: v.tobytes() for k, v in params.items()},
                       "outer_final": {k: v.tobytes() for k, v in loop.outer_parameters().items()}}
        # every codec accepted on pseudo-gradients
        out["codecs"] = {}
        for name in names():
            loop, params, outer, stats = _numpy_run(client, 3, sync_every=1, codec=name,
                                                     timeout=400)  # a first use may compile its kernels
            out["codecs"][name] = {"outer": outer[-1], "bytes": stats[-1]["bytes_sent"],
                                   "finite": bool(all(np.isfinite(v).all() for v in params.values()))}
        # a warm-up codec of its own: the first sync after the warm-up replaces its state (one
        # tensor name per fragment), the daemon does not keep both
        client.reset_state(timeout=60)
        loop, params, outer, stats = _numpy_run(client, 10, sync_every=((1, 4), 4), codec="sparseloco",
                                                codec_params={"chunk": 256, "k": 18},
                                                warmup_codec="lowbit", warmup_codec_params={"bits": 1, "block": 256})
        out["warm"] = {"codec": [s.get("codec") for s in stats], "state": [s.get("state_bytes") for s in stats],
                       "numel": sum(v.size for v in params.values())}
        del pre
    return out


@pytest.fixture(scope="module")
def np_results(tmp_path_factory):
    with LocalCluster(3, tmp_path_factory.mktemp("diloco-np")) as cl:
        res = cl.run(numpy_worker, timeout=500)
    return sorted(res, key=lambda r: r["rank"])


def _identical(runs, key):
    for s, snap in enumerate(runs[0][key]["outer"]):
        for r in runs[1:]:
            for k, v in snap.items():
                assert r[key]["outer"][s][k] == v, f"{key}: step {s + 1}: outer {k!r} differs between processes"


def test_the_warmup_codecs_state_is_dropped_after_the_warmup(np_results):
    from birdnet.codecs import get_codec as get

    for r in np_results:
        w = r["warm"]
        assert w["codec"][0] == "lowbit" and w["codec"][-1] == "sparseloco", w["codec"]
        n = w["numel"]
        # both codecs keep 4 bytes per element (error feedback; the accumulator): one state at a time
        lowbit = get("lowbit", bits=1, block=256)
        sparse = get("sparseloco", chunk=256, k=18)
        warm_bytes = lowbit.state_nbytes(lowbit.new_state(n))
        steady_bytes = sparse.state_nbytes(sparse.new_state(n))
        assert warm_bytes > 0 and steady_bytes > 0
        assert w["state"][0] == warm_bytes, w["state"]
        assert w["state"][-1] == steady_bytes, (w["state"], warm_bytes, steady_bytes)


@pytest.mark.timeout(600)
def test_numpy_outer_parameters_bit_identical_and_schedule(np_results):
    for key in ("mean", "sched", "frag"):
        _identical(np_results, key)
    # sync_every=4 over 8 steps: syncs at steps 4 and 8, bytes only then
    st = np_results[0]["mean"]["stats"]
    assert [s["syncs"] for s in st] == [0, 0, 0, 1, 1, 1, 1, 2]
    assert st[3]["bytes_sent"] > 0 and st[3]["step"] == 4 and st[7]["step"] == 8
    # outer unchanged between syncs
    o = np_results[0]["mean"]["outer"]
    assert o[0] == o[1] == o[2] and o[3] == o[4] == o[5] == o[6] and o[3] != o[7]
    # ((1, 2), (2, 4), 4) over 12 steps: syncs after steps 1, 2 (H=1), 4, 6 (H=2), 10 (H=4): five
    assert np_results[0]["sched"]["syncs"] == 5
    # plain averaging with codec none: the outer parameters are the mean of the locals at the sync
    for r in np_results:
        for k, v in r["mean"]["by_hand"].items():
            np.testing.assert_allclose(r["mean"]["outer4"][k], v, rtol=0, atol=1e-6)
    # the lean setting (outer_momentum=0) keeps no momentum buffer; the default keeps one
    assert not np_results[0]["mean"]["momentum"] and np_results[0]["sched"]["momentum"]
    # the default codec (4-bit lowbit) sends about a quarter of fp16's bytes per sync (plus a scale per 64
    # values and the frames' headers, a larger share of this small model)
    sched_bytes = np_results[0]["sched"]["stats"][-1]["bytes_sent"]
    fp16_bytes = np_results[0]["codecs"]["fp16"]["bytes"]
    assert 0.2 * fp16_bytes < sched_bytes < 0.45 * fp16_bytes, (sched_bytes, fp16_bytes)


@pytest.mark.timeout(600)
def test_constructor_waits_for_codec_kernels(np_results):
    for r in np_results:
        k = r["kernels"]
        assert k["after"] is True, "OuterLoop returned before the daemon had loaded the default codec's kernels"
        assert k["seconds"] >= 0 and (k["before"] or k["seconds"] > 0)


@pytest.mark.timeout(600)
def test_numpy_fragments_overlap_identical(np_results):
    for r in np_results[1:]:
        assert r["frag"]["outer_final"] == np_results[0]["frag"]["outer_final"]
    frags = [s.get("fragment") for s in np_results[0]["frag"]["stats"] if s["syncs"]]
    assert set(frags) == {0, 1}, "both fragments synced"
    # the locals differ between processes (local steps after the last mixing), the outer do not
    assert any(r["frag"]["final"] != np_results[0]["frag"]["final"] for r in np_results[1:])


@pytest.mark.timeout(600)
def test_every_codec_on_pseudo_gradients(np_results):
    from birdnet.codecs import names
    assert sorted(np_results[0]["codecs"]) == names()
    for name, r0 in np_results[0]["codecs"].items():
        assert r0["finite"], f"{name}: non-finite parameters"
        assert r0["bytes"] > 0, f"{name}: no bytes sent"
        for r in np_results[1:]:
            assert r["codecs"][name]["outer"] == r0["outer"], f"{name}: outer parameters differ between processes"


def test_schedule_and_bad_settings():
    s = Schedule(((1, 2), (2, 4), 8))
    assert [s.at(t) for t in (0, 1, 2, 5, 6, 100)] == [1, 1, 2, 2, 8, 8]
    for bad in (0, True, "16", (), ((1, 0), 4), ((1, 2), 0), ((1,), 4)):
        with pytest.raises(InputError):
            Schedule(bad)


@pytest.mark.parametrize("codec, params", [("nope", {}), ("birdplus", {"density": 2}), ("marsit", "x")])
def test_bad_pseudo_gradient_codecs_fail_at_construction(codec, params):
    from birdnet.client.diloco import check_codec

    from birdnet.errors import CodecError
    with pytest.raises(CodecError):
        check_codec(codec, params)
