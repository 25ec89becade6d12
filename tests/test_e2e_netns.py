"""Daemons in separate network namespaces joined by veth pairs and a bridge (needs root and
``ip netns``; skipped with the reason otherwise)."""
from __future__ import annotations

import numpy as np
import pytest
import workers
from cluster import LocalCluster

from birdnet.bench import netns

ok, why = netns.available()
pytestmark = [pytest.mark.heavy, pytest.mark.netns, pytest.mark.skipif(not ok, reason=f"network namespaces unavailable: {why}")]

SIZES = [0, 1, 3, 1000, 100003, 11689512]


@pytest.fixture
def four_hosts():
    with netns.NetnsCluster(4) as nc:
        yield nc


def _cluster(nc, tmp_path, **kw):
    return LocalCluster(4, tmp_path, addresses=nc.addresses, prefixes=[nc.exec_prefix(i) for i in range(4)], **kw)


@pytest.mark.timeout(300)
def test_four_namespaces_exact_sum_and_bit_identical(four_hosts, tmp_path):
    with _cluster(four_hosts, tmp_path) as cl:
        sums = cl.run(workers.fill_sum, SIZES, timeout=240)
        rand = cl.run(workers.random_mean, 100003, 3, "float32", 2, timeout=120)
    for per_proc in sums:
        for n, out in zip(SIZES, per_proc):
            assert out.shape == (n,) and np.all(out == 10.0)  # 1 + 2 + 3 + 4
    for k in range(2):
        assert len({r["outs"][k].tobytes() for r in rand}) == 1


@pytest.mark.timeout(300)
def test_four_namespaces_two_processes_per_node(four_hosts, tmp_path):
    with _cluster(four_hosts, tmp_path, local_size=2) as cl:
        res = cl.run(workers.fill_sum, [0, 1, 1000, 100003], timeout=240)
    assert len(res) == 8
    for per_proc in res:
        for out in per_proc:
            assert np.all(out == 36.0)  # 1 + ... + 8
