"""The benchmark commands a user runs (`birdnet bench allreduce|train|codecs`), end to end on real
daemons, at sizes small enough for CI. They check what the commands report, not speed."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from birdnet.bench import netns

pytestmark = pytest.mark.heavy  # CI runs it on the default Python only (.ci/run)

ROOT = Path(__file__).resolve().parent.parent


def birdnet(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "birdnet.cli", *args], capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.mark.timeout(300)
def test_bench_allreduce_loopback_reports_every_figure(tmp_path):
    p = birdnet("bench", "allreduce", "--nodes", "2", "--sizes", "1000,50000", "--codecs",
                "none,marsit,birdplus:density=0.05", "--runs", "2", "--warmup", "1", "--loop-calls", "3",
                "--loop-warmup", "1", "--json")
    assert "\r" not in p.stdout + p.stderr  # output to pipes, as to a log: no progress bar drawn
    out = json.loads(p.stdout)
    assert out["meta"]["nodes"] == 2 and out["meta"]["mode"] == "loopback"
    rows = {(r["count"], r["codec"]): r for r in out["rows"]}
    assert set(rows) == {(n, c) for n in (1000, 50000) for c in ("none", "marsit", "birdplus:density=0.05")}
    for r in rows.values():
        assert len(r["times"]) == 2 and len(r["spans"]) == 2
        assert 0 < r["span_s"] <= r["time_s"] + 1e-9  # the span leaves out barrier skew, never adds
        assert r["wire_bytes_per_node"] > 0
        # where the time goes: each phase ends no earlier than the one before it (per run, hence
        # in the medians), the last one is the span, and the data phase used some CPU
        ph = r["phases_s"]
        assert 0 <= ph["ready"] <= ph["data_start"] <= ph["data_end"] <= ph["result"]
        assert ph["result"] == pytest.approx(r["span_s"])
        # per run and node; the last node's start of each run is what the median above is taken of
        assert len(ph["data_starts"]) == 2 and all(len(run) == 2 for run in ph["data_starts"])
        assert ph["data_start"] == pytest.approx(statistics.median(max(run) for run in ph["data_starts"]))
        assert 0 <= ph["handoff_in"] <= ph["result"] and 0 <= ph["handoff_out"] <= ph["result"]
        assert r["daemon_cpu_s"] > 0
        # the loop, for every codec: calls back to back, the median of the slowest node's time from
        # its previous result to this one, with the process's own arrays and with client.buffer
        assert len(r["loop_times"]) == 3 and r["loop_s"] == pytest.approx(statistics.median(r["loop_times"]))
        assert len(r["loop_buffer_times"]) == 3 and r["loop_buffer_s"] > 0
        assert r["loop_vs_call"] == pytest.approx(r["loop_s"] / r["time_s"])
        # no call ends sooner than the data phase it waited for: the phases add up to at most a call
        lp = r["loop_phases_s"]
        assert set(lp) == {"gap", "in", "wait", "data", "out"} and all(v >= 0 for v in lp.values())
        assert lp["data"] <= max(r["loop_times"])
        # per node and call: [previous result, call, result], in that order
        assert len(r["loop_trace"]) == 2
        for node in r["loop_trace"]:
            assert all(a <= b <= c for a, b, c in node["marks"])
        # one round's CPU: every daemon thread (from /proc) and the processes' hand-off
        assert r["cpu_round_daemon_s"] > 0 and r["cpu_round_client_s"] > 0
        assert r["cpu_round_s"] == pytest.approx(r["cpu_round_daemon_s"] + r["cpu_round_client_s"])
        threads = r["cpu_round_threads_s"]  # the daemons by thread: the ring thread does the work
        assert threads["ring"] > 0 and sum(threads.values()) == pytest.approx(r["cpu_round_daemon_s"])
    # dense is exact (the mean of two float32 vectors, bit-identical everywhere)
    assert rows[(50000, "none")]["error"] < 1e-6
    # compressed codecs send fewer bytes than dense, and report a (finite) error: they are lossy
    for c in ("marsit", "birdplus:density=0.05"):
        assert rows[(50000, c)]["wire_bytes_per_node"] * 4 < rows[(50000, "none")]["wire_bytes_per_node"]
        assert 0 < rows[(50000, c)]["error"] < 100


@pytest.mark.timeout(300)
def test_bench_allreduce_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "ar.png"
    birdnet("bench", "allreduce", "--nodes", "2", "--sizes", "1000,20000", "--codecs", "none,marsit",
            "--runs", "1", "--warmup", "0", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(400)
@pytest.mark.skipif(not netns.available()[0], reason="network namespaces need root and iproute2")
def test_bench_allreduce_netns_shaped_vs_gloo():
    pytest.importorskip("torch")
    p = birdnet("bench", "allreduce", "--nodes", "2", "--sizes", "2000000", "--codecs", "none", "--runs", "1",
                "--warmup", "1", "--loop-calls", "2", "--loop-warmup", "1", "--netns", "--rate", "1gbit",
                "--vs-gloo", "--json", timeout=360)
    out = json.loads(p.stdout)
    (row,) = out["rows"]
    assert out["meta"]["mode"] == "netns" and out["meta"]["rate"] == "1gbit"
    assert out["meta"]["tcp_cc"] == netns.ipv4_sysctl("tcp_congestion_control")[0]  # the machine's
    assert row["gloo_time_s"] > 0 and row["gloo_span_s"] > 0 and row["vs_gloo"] > 0
    assert row["gloo_cpu_s"] > 0 and row["daemon_cpu_s"] > 0
    # In a 2-node ring each node sends the whole 8 MB once: at 1 Gbit/s 64 ms, less what the token
    # bucket's 512 KB burst lets through at once; unshaped loopback would take a few ms
    assert row["time_s"] > 0.055 and row["gloo_time_s"] > 0.055
    # back to back (nccl-tests' way), the link is the limit too
    assert row["loop_s"] > 0.055 and row["gloo_loop_s"] > 0.055 and row["loop_vs_gloo"] > 0
    assert row["loop_speedup_vs_gloo"] == pytest.approx(1 / row["loop_vs_gloo"])
    assert len(row["gloo_loop_times"]) == 2 and row["gloo_loop_cpu_s"] > 0 and row["cpu_vs_gloo"] > 0
    # its own namespaces only: other benchmarks on the machine may have theirs up meanwhile
    mine = out["meta"]["namespaces"]
    assert len(mine) == 2
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert not after & set(mine), "the benchmark left network namespaces behind"


def _ns_cc(ns: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-n", "net.ipv4.tcp_congestion_control"],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not netns.available()[0], reason="network namespaces need root and iproute2")
def test_netns_cluster_sets_the_tcp_congestion_control_or_says_why_not():
    allowed = netns.ipv4_sysctl("tcp_allowed_congestion_control")
    machine = netns.ipv4_sysctl("tcp_congestion_control")
    # one the namespaces may take, other than the machine's when there is one (reno is built in)
    others = [c for c in allowed if c not in machine] or allowed
    if not others:
        pytest.skip("no congestion control is allowed in namespaces here")
    with netns.NetnsCluster(2, tcp_cc=others[0]) as nsc:
        assert [_ns_cc(ns) for ns in nsc.names] == [others[0]] * 2
    with netns.NetnsCluster(1) as nsc:  # without: the machine's
        assert _ns_cc(nsc.names[0]) == machine[0]
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    with pytest.raises(RuntimeError, match="'no-such-cc' is not available in this kernel"):
        netns.NetnsCluster(2, tcp_cc="no-such-cc").__enter__()
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert after <= before, "a failed setup left namespaces behind"
    # the command says so and exits 2; without --netns it refuses the flag
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for extra in (["--netns"], []):
        p = subprocess.run([sys.executable, "-m", "birdnet.cli", "bench", "allreduce", "--nodes", "2", "--sizes",
                            "1000", "--runs", "1", "--tcp-cc", "no-such-cc", *extra],
                           capture_output=True, text=True, timeout=60, env=env)
        assert p.returncode == 2
        assert ("not available in this kernel" if extra else "--tcp-cc needs --netns") in p.stderr


@pytest.mark.timeout(400)
def test_bench_train_writes_results_per_codec_and_seed(tmp_path):
    pytest.importorskip("sklearn")
    res = tmp_path / "train.json"
    p = birdnet("bench", "train", "--nodes", "2", "--data", "digits", "--codecs", "none,marsit", "--seeds", "0,1",
                "--epochs", "2", "--json", str(res), timeout=360)
    assert "marsit" in p.stdout and "none" in p.stdout
    data = json.loads(res.read_text())
    assert sorted((r["codec"], r["seed"]) for r in data["runs"]) == [("marsit", 0), ("marsit", 1), ("none", 0),
                                                                      ("none", 1)]
    for r in data["runs"]:
        assert r["identical_on_all_nodes"], r["codec"]  # every node ends with the same model bits
        assert len(r["history"]) >= 2 and r["bytes_sent"] > 0
    summary = {s["codec"]: s for s in data["summary"]}
    # digits has 10 classes: two epochs of data-parallel SGD are far above chance (0.1) with both
    assert summary["none"]["acc_mean"] > 0.5 and summary["marsit"]["acc_mean"] > 0.5
    assert summary["marsit"]["mb_sent_per_worker"] < summary["none"]["mb_sent_per_worker"] / 4


@pytest.mark.timeout(400)
def test_bench_train_run_alone_trains_as_in_a_list(tmp_path):
    """The job name seeds a codec's random draws: a configuration must train the same whether it
    runs alone or second in a list (before, jobs were numbered by their place in the list)."""
    pytest.importorskip("sklearn")
    finals = []
    for codecs in ("birdplus:density=0.05", "none,birdplus:density=0.05"):
        res = tmp_path / f"{len(finals)}.json"
        birdnet("bench", "train", "--nodes", "2", "--data", "digits", "--codecs", codecs, "--seeds", "0",
                "--epochs", "1", "--json", str(res), timeout=360)
        run = next(r for r in json.loads(res.read_text())["runs"] if r["codec"] == "birdplus:density=0.05")
        finals.append((run["acc"], run["loss"], [h["loss"] for h in run["history"]]))
    assert finals[0] == finals[1]  # bit for bit (bytes sent differ by a few header bytes: round numbers)


def test_bench_train_job_names_follow_the_configuration():
    from birdnet.bench.train import run_job
    a = run_job("birdplus:density=0.01", 0)
    assert a == run_job("birdplus:density=0.01", 0, {"train-x"})  # not the place in the list
    assert len({a, run_job("birdplus:density=0.01", 1), run_job("birdplus:density=0.01:cap=30", 0)}) == 3
    assert run_job("birdplus:density=0.01", 0, {a}) not in (a, "")  # a repeat gets fresh codec state
    assert len(run_job("x" * 500, 10**9)) <= 200  # the daemon's limit on job names


@pytest.mark.timeout(400)
@pytest.mark.parametrize("task,codecs", [("cnn", "none,marsit"), ("lm", "birdplus:density=0.01")])
def test_bench_train_torch_tasks_smoke(tmp_path, task, codecs):
    """--task cnn / lm: a few steps through the PyTorch adapter (the smoke CI runs; the real
    benchmark is minutes per configuration)."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    res = tmp_path / "train.json"
    p = birdnet("bench", "train", "--task", task, "--nodes", "2", "--codecs", codecs, "--seeds", "0",
                "--steps", "4", "--eval-every", "2", "--adapter", '{"warmup_steps": 2}', "--json", str(res),
                "--plot", str(tmp_path / "p"), timeout=360)
    data = json.loads(res.read_text())
    metric = "accuracy" if task == "cnn" else "val_loss"
    assert data["meta"]["metric"] == metric and metric in p.stdout
    for r in data["runs"]:
        assert r["identical_on_all_nodes"], r["codec"]
        assert [h["step"] for h in r["history"]] == [2, 4] and r["bytes_sent"] > 0
        assert np_isfinite(r[metric])
        if r["codec"] != "none":
            assert r["warmup_steps"] == 2 and 0 < r["warmup_bytes"] < r["bytes_sent"]
    assert (tmp_path / "p_steps.png").exists() and (tmp_path / "p_bytes.png").exists()


def np_isfinite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


@pytest.mark.timeout(300)
def test_bench_codecs_reports_ratio_and_error():
    p = birdnet("bench", "codecs", "--sizes", "100000", "--densities", "0.01", "--codecs", "topk,birdplus,marsit",
                "--threads", "single", "--repeat", "2", "--no-baselines", "--json")
    res = {r["codec"]: r for r in json.loads(p.stdout)["results"]}
    assert set(res) == {"topk", "birdplus", "marsit"}
    for r in res.values():
        assert r["n"] == 100000 and r["compress_s"] > 0 and r["payload_bytes"] > 0
        assert r["ratio"] == pytest.approx(400000 / r["payload_bytes"])
    # density 0.01: Top-K sends 1,000 (index, value) pairs; BIRD+ shares block ids, so fewer bytes
    assert res["topk"]["payload_bytes"] == 8000
    assert res["birdplus"]["payload_bytes"] < res["topk"]["payload_bytes"]
    assert res["marsit"]["ratio"] > 25  # one sign bit per element plus a scale


@pytest.mark.timeout(300)
def test_bench_overlap_times_the_three_modes():
    pytest.importorskip("torch")
    p = birdnet("bench", "overlap", "--nodes", "2", "--hidden", "256", "--layers", "2", "--steps", "3", "--blocks",
                "1", "--json")
    out = json.loads(p.stdout[p.stdout.index("{"):])
    assert out["config"]["nodes"] == 2 and out["parameters"] > 0 and out["buckets"] >= 1
    # every step all-reduces every gradient once (float32, dense): at least the model's bytes
    assert out["bytes_sent_per_step"] >= out["parameters"] * 4
    for mode in ("local", "after", "overlap"):
        assert out["median_step_seconds"]["slowest"][mode] > 0


@pytest.mark.timeout(120)
def test_local_cluster_that_fails_to_start_leaves_no_daemon_behind(tmp_path):
    """``with LocalCluster(...)`` never reaches __exit__ when a daemon fails to come up: start()
    itself must stop the daemons it already started (seen as stray daemons after a failed run)."""
    from birdnet.cluster import LocalCluster
    cl = LocalCluster(3, tmp_path, per_node_extra=[[], [], ["--no-such-flag"]])
    with pytest.raises(RuntimeError, match="daemon 2 exited"):
        with cl:
            pass
    assert cl.procs == [None, None, None]
    # nothing of this cluster is still running (each daemon was its own session, reaped by pid)
    out = subprocess.run(["pgrep", "-f", str(cl.hosts)], capture_output=True, text=True).stdout
    assert out.strip() == ""
