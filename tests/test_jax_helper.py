"""birdnet.client.jax.allreduce_tree on nested trees, over real daemons (NumPy trees; JAX trees too
when JAX is installed)."""
from __future__ import annotations

import collections

import numpy as np
import pytest
from cluster import LocalCluster

Pair = collections.namedtuple("Pair", "left right")


def make_tree(rank: int):
    r = float(rank + 1)
    return {
        "dense": {"w": np.full((3, 4), r, np.float32), "b": np.arange(4, dtype=np.float64) * r},
        "layers": [np.full(5, r, np.float16), (np.float32(r), r)],
        "pair": Pair(left=np.full((2, 2), r, np.float32), right=None),
        "empty": {},
        "big": np.full(3000, r, np.float32),
    }


def int_tree(rank: int):
    return {"count": np.array([rank, 1], np.int64), "flags": [np.array([rank == 0, True])]}


def worker(sock, node, local):
    import birdnet.client.jax as bnj
    from birdnet.client import Client
    with Client(sock, job="jax-test") as c:
        out = {
            "mean": bnj.allreduce_tree(c, make_tree(c.rank), name_prefix="grads"),
            "fused": bnj.allreduce_tree(c, make_tree(c.rank), name_prefix="fused", fuse=True),
            "sum": bnj.allreduce_tree(c, int_tree(c.rank), op="sum", name_prefix="ints"),
            "empty": bnj.allreduce_tree(c, {"a": [], "b": None}, name_prefix="nothing"),
        }
        try:
            import jax.numpy as jnp
        except ImportError:
            out["jax"] = None
        else:
            t = {"w": jnp.full((2, 3), c.rank + 1.0, jnp.float32), "h": [jnp.ones(4, jnp.bfloat16) * (c.rank + 1)]}
            res = bnj.allreduce_tree(c, t, name_prefix="jax")
            out["jax"] = {"w": (np.asarray(res["w"]), str(res["w"].dtype), type(res["w"]).__name__),
                          "h": (np.asarray(res["h"][0], np.float32), str(res["h"][0].dtype))}
        return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    with LocalCluster(1, tmp_path_factory.mktemp("jax"), local_size=3) as cl:
        return cl.run(worker, timeout=100)


def check_mean_tree(t):
    mean = 2.0  # ranks 0, 1, 2 contribute 1, 2, 3
    assert set(t) == {"dense", "layers", "pair", "empty", "big"}
    assert t["dense"]["w"].dtype == np.float32 and t["dense"]["w"].shape == (3, 4) and np.all(t["dense"]["w"] == mean)
    assert t["dense"]["b"].dtype == np.float64 and np.allclose(t["dense"]["b"], np.arange(4) * mean)
    assert isinstance(t["layers"], list) and isinstance(t["layers"][1], tuple)
    assert t["layers"][0].dtype == np.float16 and np.all(t["layers"][0] == mean)
    assert isinstance(t["layers"][1][0], np.float32) and t["layers"][1][0] == mean
    assert type(t["layers"][1][1]) is float and t["layers"][1][1] == mean
    assert isinstance(t["pair"], Pair) and t["pair"].right is None and np.all(t["pair"].left == mean)
    assert t["empty"] == {}
    assert t["big"].dtype == np.float32 and np.all(t["big"] == mean)


@pytest.mark.timeout(150)
def test_nested_numpy_tree_mean(results):
    for r in results:
        check_mean_tree(r["mean"])


@pytest.mark.timeout(150)
def test_fused_tree_same_result(results):
    for r in results:
        check_mean_tree(r["fused"])


@pytest.mark.timeout(150)
def test_integer_and_bool_leaves_with_sum(results):
    for r in results:
        s = r["sum"]
        assert s["count"].dtype == np.int64 and s["count"].tolist() == [3, 3]
        assert s["flags"][0].dtype == np.bool_ and s["flags"][0].tolist() == [True, True]
        assert r["empty"] == {"a": [], "b": None}


@pytest.mark.timeout(150)
def test_jax_tree(results):
    if results[0]["jax"] is None:
        pytest.skip("jax is not installed: the NumPy walker was tested instead")
    for r in results:
        w, wdt, wtype = r["jax"]["w"]
        assert wdt == "float32" and np.all(w == 2.0) and "Array" in wtype
        h, hdt = r["jax"]["h"]
        assert hdt == "bfloat16" and np.all(h == 2.0)


def test_flatten_walker_order_and_rebuild():
    import birdnet.client.jax as bnj
    leaves, rebuild = bnj.flatten({"b": [1.0, (2.0,)], "a": np.zeros(2)})
    assert [p for p, _ in leaves] == ["['a']", "['b'][0]", "['b'][1][0]"]  # sorted keys, as jax.tree_util
    back = rebuild([10, 20, 30])
    assert back == {"a": 10, "b": [20, (30,)]}


# -- OuterLoopTree: the slow-link mode on a pytree, functional updates ------------------------------
def start_tree(jnp=None):
    rng = np.random.default_rng(7)  # the same on every process: identical starting parameters
    t = {"dense": {"w": rng.standard_normal((40, 30)).astype(np.float32), "b": rng.standard_normal(30)},
         "extra": [rng.standard_normal(6).astype(np.float16), 0.5]}
    if jnp is not None:
        t = {"dense": {"w": jnp.asarray(t["dense"]["w"]), "b": jnp.asarray(t["dense"]["b"].astype(np.float32))},
             "extra": [jnp.asarray(t["extra"][0].astype(np.float32)).astype(jnp.bfloat16), 0.5]}
    return t


def inner_step(tree, rr, xp=np):
    # a functional update (new leaves, nothing written in place), different on every process
    import birdnet.client.jax as bnj
    leaves, rebuild = bnj.flatten(tree)
    new = []
    for _p, leaf in leaves:
        noise = rr.standard_normal(np.shape(leaf)) * 0.01
        if isinstance(leaf, float):
            new.append(leaf - float(noise))
        else:
            new.append(leaf - xp.asarray(noise).astype(leaf.dtype))
    return rebuild(new)


def _bytes(tree):
    import birdnet.client.jax as bnj
    return [np.asarray(leaf, np.float64).tobytes() for _p, leaf in bnj.flatten(tree)[0]]


def outer_run(c, steps, jnp=None, **options):
    import birdnet.client.jax as bnj
    rr = np.random.default_rng(300 + c.rank)
    params = start_tree(jnp)
    loop = bnj.OuterLoopTree(c, params, timeout=60, **options)
    rec = []
    for _ in range(steps):
        params = inner_step(params, rr, jnp if jnp is not None else np)
        new = loop.step(params)
        rec.append({"same": new is params, "in": params, "out": new, "outer": _bytes(loop.outer_parameters())})
        params = new
    return loop, params, rec


def outer_worker(sock, node, local):
    import birdnet.client.jax as bnj
    from birdnet.client import Client
    out = {}
    with Client(sock, job="jax-outer") as c:
        # plain averaging every 4 steps, fp32: the synced tree is the mean of the trees passed in
        loop, params, rec = outer_run(c, 8, sync_every=4, outer_lr=1.0, outer_momentum=0.0, codec="none")
        mean = bnj.allreduce_tree(c, rec[3]["in"], name_prefix="check", codec="none", timeout=60)
        out["avg"] = {"same": [r["same"] for r in rec], "outer": [r["outer"] for r in rec],
                      "synced": rec[3]["out"], "mean": mean, "syncs": loop.loop.syncs,
                      "types": [type(leaf).__name__ for _p, leaf in bnj.flatten(rec[3]["out"])[0]]}
        # the default codec with Nesterov momentum on a schedule
        loop, params, rec = outer_run(c, 12, sync_every=((1, 2), (2, 4), 4))
        out["sched"] = {"outer": [r["outer"] for r in rec], "syncs": loop.loop.syncs,
                        "flushed": loop.flush(params) is params}  # nothing in flight without overlap
        # two fragments applied late (overlap): the mix keeps the local steps taken meanwhile
        loop, params, rec = outer_run(c, 12, sync_every=4, fragments=2, overlap=True, outer_lr=1.0,
                                      outer_momentum=0.0, codec="none")
        out["late"] = {"rec": [(r["same"], r["in"], r["out"], r["outer"]) for r in rec],
                       "members": [[loop.loop.names[i] for i in f.members] for f in loop.loop.fragments]}
        try:
            import jax.numpy as jnp
        except ImportError:
            out["jax"] = None
        else:
            loop, params, rec = outer_run(c, 8, jnp=jnp, sync_every=4, codec="none")
            out["jax"] = {"outer": [r["outer"] for r in rec], "same": [r["same"] for r in rec],
                          "synced": [(type(leaf).__name__, str(leaf.dtype) if hasattr(leaf, "dtype") else None)
                                     for _p, leaf in bnj.flatten(rec[3]["out"])[0]],
                          "synced_bytes": _bytes(rec[3]["out"])}
        return out


@pytest.fixture(scope="module")
def outer_results(tmp_path_factory):
    with LocalCluster(1, tmp_path_factory.mktemp("jaxouter"), local_size=3) as cl:
        return cl.run(outer_worker, timeout=150)


@pytest.mark.timeout(200)
def test_outer_loop_tree_averages_and_is_identical_everywhere(outer_results):
    a = [r["avg"] for r in outer_results]
    assert a[0]["syncs"] == 2
    # between syncs the caller's own tree comes back, untouched; a sync returns a new one
    assert a[0]["same"] == [True, True, True, False, True, True, True, False]
    assert all(x["outer"] == a[0]["outer"] for x in a)  # bit-identical outer parameters after every step
    assert all(_bytes(x["synced"]) == _bytes(a[0]["synced"]) for x in a)
    s, m = a[0]["synced"], a[0]["mean"]
    assert s["dense"]["w"].dtype == np.float32 and s["dense"]["b"].dtype == np.float64
    assert s["extra"][0].dtype == np.float16 and type(s["extra"][1]) is float
    np.testing.assert_allclose(s["dense"]["w"], m["dense"]["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s["dense"]["b"], m["dense"]["b"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s["extra"][0].astype(np.float32), m["extra"][0].astype(np.float32), atol=2e-3)
    assert abs(s["extra"][1] - m["extra"][1]) < 1e-6
    sched = [r["sched"] for r in outer_results]
    assert sched[0]["syncs"] == 2 + 2 + 1  # H=1 for 2 steps, H=2 for 4, then H=4 over the last 6
    assert all(x["outer"] == sched[0]["outer"] and x["flushed"] for x in sched)


@pytest.mark.timeout(200)
def test_outer_loop_tree_late_results_mix_into_the_current_tree(outer_results):
    import birdnet.client.jax as bnj
    for r in outer_results:
        late = r["late"]
        members = late["members"]
        assert len(members) == 2 and all(members)
        applied = 0
        for same, tin, tout, _outer in late["rec"]:
            if same:
                continue
            applied += 1
            ins = dict(bnj.flatten(tin)[0])
            outs = dict(bnj.flatten(tout)[0])
            changed = [p for p in ins if _bytes(ins[p]) != _bytes(outs[p])]
            # one fragment mixed; every other leaf is the tree passed in (not the copy the sync read)
            assert changed and any(set(changed) <= set(m) for m in members), (changed, members)
            for p in ins:
                if p not in changed:
                    assert _bytes(ins[p]) == _bytes(outs[p])
        assert applied >= 4
    assert all(x["late"]["rec"][-1][3] == outer_results[0]["late"]["rec"][-1][3] for x in outer_results)


@pytest.mark.timeout(200)
def test_outer_loop_tree_with_jax(outer_results):
    if outer_results[0]["jax"] is None:
        pytest.skip("jax is not installed: OuterLoopTree was tested on NumPy trees")
    j = [r["jax"] for r in outer_results]
    assert j[0]["same"] == [True, True, True, False, True, True, True, False]
    assert all(x["outer"] == j[0]["outer"] and x["synced_bytes"] == j[0]["synced_bytes"] for x in j)
    kinds = dict(zip(["b", "w", "h", "s"], j[0]["synced"]))
    assert "Array" in kinds["w"][0] and kinds["w"][1] == "float32"
    assert "Array" in kinds["h"][0] and kinds["h"][1] == "bfloat16" and kinds["s"][0] == "float"


def test_outer_loop_tree_refuses_integer_leaves():
    import birdnet.client.jax as bnj

    from birdnet.errors import InputError
    with pytest.raises(InputError, match=r"leaf \['count'\] has dtype int64"):
        bnj.OuterLoopTree(None, {"w": np.zeros(3, np.float32), "count": np.array(3, np.int64)})
