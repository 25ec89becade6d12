"""IPv6 end to end: hosts-file syntax (brackets, link-local scope ids), a ring on ``::1``, and rings
between network namespaces on unique local addresses, on names that resolve to them, and on
link-local addresses with their interface."""
from __future__ import annotations

import re
import time

import fault_workers
import pytest
from birdnet.client import Client
from cluster import LocalCluster, free_ports

from birdnet.bench import netns
from birdnet.errors import ConfigError
from birdnet.hosts import parse_hosts

pytestmark = pytest.mark.timeout(120)


def test_hosts_file_ipv6_syntax():
    peers = parse_hosts("[fd00:bd::1]:29500\n[fe80::12%eth0]:29501\n[fd00::3]:29502\nnode-a:29503\n")
    assert [p.host for p in peers] == ["fd00:bd::1", "fe80::12%eth0", "fd00::3", "node-a"]
    assert [p.endpoint() for p in peers] == ["tcp://[fd00:bd::1]:29500", "tcp://[fe80::12%eth0]:29501",
                                             "tcp://[fd00::3]:29502", "tcp://node-a:29503"]
    assert peers[1].address == "[fe80::12%eth0]:29501"
    with pytest.raises(ConfigError, match="not an IPv6 address"):
        parse_hosts("[node-a]:29500\n")
    with pytest.raises(ConfigError, match="not an IPv6 address"):
        parse_hosts("[fe80::12%]:29500\n")
    with pytest.raises(ConfigError, match="in brackets"):
        parse_hosts("fe80:zz::1:29500\n")
    with pytest.raises(ConfigError, match=re.escape("write an IPv6 address in brackets, [::1]:29631")):
        parse_hosts("::1:29631\n")  # the README's way to write it is [::1]:29631


def _states(cl: LocalCluster) -> list[str]:
    out = []
    for s in cl.sockets:
        with Client(s, job="probe") as c:
            out += [p["state"] for p in c.status()["peers"] if p["state"] != "self"]
    return out


def _ring_works(cl: LocalCluster) -> None:
    deadline = time.monotonic() + 15
    while set(_states(cl)) != {"connected"}:
        assert time.monotonic() < deadline, (_states(cl), cl.log(0)[-2000:])
        time.sleep(0.1)
    res = cl.run(fault_workers.try_round, 1000, 20.0)
    assert [r[:2] for r in res] == [("ok", float(sum(range(1, cl.n + 1))))] * cl.n, res


def test_ring_on_ipv6_loopback(tmp_path):
    """Before: only the ROUTER had ZMQ_IPV6; the DEALERs could not connect, while status said
    "connected" and every round failed with PeerLostError."""
    cl = LocalCluster(2, tmp_path)
    cl.hosts.write_text("".join(f"[::1]:{p}\n" for p in free_ports(2)))
    with cl:
        _ring_works(cl)


ok, why = netns.available()


@pytest.fixture(scope="module")
def hosts6():
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    with netns.NetnsCluster(2) as nc:
        yield nc


@pytest.mark.netns
@pytest.mark.parametrize("kind", ["ula", "name", "link-local"])
def test_ring_between_namespaces_on_ipv6(hosts6, tmp_path, kind):
    nc = hosts6
    addresses = {"ula": nc.ipv6, "name": nc.host_names,
                 "link-local": [f"{a}%eth0" for a in nc.link_local]}[kind]
    cl = LocalCluster(2, tmp_path, addresses=addresses, prefixes=[nc.exec_prefix(i) for i in range(2)])
    with cl:
        _ring_works(cl)
