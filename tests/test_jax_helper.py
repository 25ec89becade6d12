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
