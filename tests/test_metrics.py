"""``birdnetd --metrics-port``: the /metrics endpoint read by Prometheus' own text parser."""
from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
import workers
from cluster import LocalCluster, free_ports

parser = pytest.importorskip("prometheus_client.parser",
                             reason="prometheus-client (test extra) is needed to parse /metrics")


def wait_listening(port: int, timeout: float = 20.0) -> None:
    """The daemon binds its client socket (what LocalCluster waits for) just before the metrics port."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).close()
            return
        except urllib.error.URLError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def scrape(port: int) -> dict[str, dict]:
    """{family name: {(sample name, sorted labels): value}} and the family types under '__type__'."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out: dict[str, dict] = {"__type__": {}}
    for fam in parser.text_string_to_metric_families(text):
        out["__type__"][fam.name] = fam.type
        for s in fam.samples:
            out.setdefault(fam.name, {})[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, family: str, sample: str | None = None, **labels) -> float:
    want = tuple(sorted((k, str(v)) for k, v in labels.items()))
    return m[family][(sample or family, want)]


@pytest.mark.timeout(120)
def test_metrics_endpoint_parsed_by_prometheus(tmp_path):
    ports = free_ports(2)
    cl = LocalCluster(2, tmp_path, per_node_extra=[["--metrics-port", str(p)] for p in ports])
    with cl:
        for p in ports:
            wait_listening(p)
        before = scrape(ports[0])
        assert value(before, "birdnet_rounds", "birdnet_rounds_total") == 0
        assert value(before, "birdnet_clients") == 0
        sizes = [1000, 5000, 200000]
        cl.run(workers.fill_sum, sizes)
        # the codec path as well (error-feedback state shows up in birdnet_codec_state_bytes)
        cl.run(workers.random_mean, 50000, 3, "float32", 2, "topk", {"density": 0.05})
        ms = [scrape(p) for p in ports]
        hosts = [line.strip() for line in cl.hosts.read_text().splitlines() if line and not line.startswith("#")]
        log = cl.log(0)
    for rank, m in enumerate(ms):
        types = m["__type__"]
        assert types["birdnet_rounds"] == "counter" and types["birdnet_round_seconds"] == "histogram"
        assert types["birdnet_peer_up"] == "gauge"
        assert all(name.startswith("birdnet_") for name in types)
        assert value(m, "birdnet_rounds", "birdnet_rounds_total") == 5, log
        assert value(m, "birdnet_rounds_failed", "birdnet_rounds_failed_total") == 0
        # fill_sum's 2nd and 3rd dense calls ran in the lane (its 1st was agreed and opened it), and
        # so did the 2nd topk call: compressed codecs without flush rounds take the lane too
        assert value(m, "birdnet_lane_rounds", "birdnet_lane_rounds_total") == 3
        assert value(m, "birdnet_lane_given_up", "birdnet_lane_given_up_total") == 0
        info = next(iter(m["birdnet_info"]))
        assert dict(info[1])["rank"] == str(rank) and dict(info[1])["world"] == "2"
        # bytes per peer: a ring node sends to its right neighbour and receives from its left one
        peer = 1 - rank
        sent = value(m, "birdnet_bytes_sent", "birdnet_bytes_sent_total", rank=peer, address=hosts[peer])
        recv = value(m, "birdnet_bytes_received", "birdnet_bytes_received_total", rank=peer, address=hosts[peer])
        assert sent >= sum(sizes) * 4 / 2  # dense ring, world 2: half of each tensor each way at least
        assert recv >= sum(sizes) * 4 / 2
        # every message numbered on the way got there (PeerNet.take_gap): nothing lost
        assert value(m, "birdnet_peer_messages_lost", "birdnet_peer_messages_lost_total", rank=peer,
                     address=hosts[peer]) == 0
        # histogram: every successful round observed, buckets cumulative, +Inf = count
        buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in m["birdnet_round_seconds"].items()
                          if k[0] == "birdnet_round_seconds_bucket"))
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == float("inf")
        assert value(m, "birdnet_round_seconds", "birdnet_round_seconds_count") == 5 == buckets[-1][1]
        assert value(m, "birdnet_round_seconds", "birdnet_round_seconds_sum") > 0
        # topk at 5 % density: far fewer bytes than the dense ring
        assert value(m, "birdnet_compression_ratio") > 2
        assert value(m, "birdnet_codec_state_bytes") >= 50000 * 4  # error-feedback memory of tensor "w"
        assert value(m, "birdnet_compress_seconds", "birdnet_compress_seconds_total") > 0
        assert value(m, "birdnet_peer_up", rank=0, address=hosts[0]) == 1
        assert value(m, "birdnet_peer_up", rank=1, address=hosts[1]) == 1
        assert value(m, "birdnet_clients") == 0  # the training processes have left
        assert value(m, "birdnet_uptime_seconds") > 0


@pytest.mark.timeout(120)
def test_metrics_peer_down_and_unknown_path(tmp_path):
    (port,) = free_ports(1)
    cl = LocalCluster(2, tmp_path, per_node_extra=[["--metrics-port", str(port)], []])
    with cl:
        wait_listening(port)
        hosts = [line.strip() for line in cl.hosts.read_text().splitlines() if line and not line.startswith("#")]
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=10)
        assert err.value.code == 404
        cl.stop_node(1)
        deadline = time.monotonic() + 15
        while True:
            m = scrape(port)
            if value(m, "birdnet_peer_up", rank=1, address=hosts[1]) == 0:
                break
            assert time.monotonic() < deadline, "peer 1 still reported up 15 s after it stopped"
            time.sleep(0.5)
        assert value(m, "birdnet_peer_up", rank=0, address=hosts[0]) == 1
