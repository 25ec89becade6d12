"""A short chaos run on real daemons and processes (birdnet.bench.chaos; ``birdnet bench chaos`` is
the long one): 3 daemons on loopback, one training process each calling allreduce in a loop and
calling Client.recover after an error, while a daemon is stopped (SIGSTOP for longer than
peer_timeout, then SIGCONT), a training process is killed (the job is restarted) and a daemon is
killed and restarted; and (in network namespaces, where root) a node's link taken down and up.
Fixed seeds; about a minute each."""
from __future__ import annotations

import pytest

from birdnet.bench import netns
from birdnet.bench.chaos import FAIL_FAST, run_chaos, verdict

pytestmark = pytest.mark.heavy  # CI runs it on the default Python only (.ci/run)


@pytest.mark.timeout(240)
def test_faults_at_random_points_split_no_call_and_the_loop_recovers(tmp_path):
    res = run_chaos(nodes=3, floats=20_000, codec="none", faults=["stop-daemon", "kill-process", "kill-daemon"],
                    stop_seconds=6.0, seed=3, peer_timeout=4.0, call_timeout=20.0, recover_timeout=40.0,
                    rounds_between=(1.0, 2.0), tmp=tmp_path)
    # every call has one outcome on every process, every result is the exact sum, the replicas'
    # parameters agree after every successful call, no call outlived its timeout
    assert verdict(res) == [], res
    assert res["faults"] == 3 and res["calls"] > 50, res
    assert res["failed_calls"] >= 1, res  # the faults did hit calls: the test proves something
    by_kind = {e["fault"]: e for e in res["events"]}
    # calls work again soon after the fault ends, without restarting anyone (the stopped daemon)
    assert by_kind["stop-daemon"]["recovery_seconds"] < 15, res["events"]
    assert by_kind["kill-daemon"]["recovery_seconds"] < 15, res["events"]
    # a killed training process: the others' calls fail at once until the job is restarted
    ff = by_kind["kill-process"]["fail_fast"]
    assert ff["calls"] > 0 and ff["slowest"] <= FAIL_FAST, ff


ok_ns, why_ns = netns.available()


@pytest.mark.timeout(240)
@pytest.mark.netns
@pytest.mark.skipif(not ok_ns, reason=f"network namespaces unavailable: {why_ns} (the link fault needs them)")
def test_a_link_taken_down_and_up_splits_no_call_and_the_loop_recovers(tmp_path):
    # one cut shorter than peer_timeout, one longer: the daemons live in network namespaces
    res = run_chaos(nodes=3, floats=20_000, codec="none", faults=["cut-link", "cut-link"], seed=5,
                    peer_timeout=4.0, call_timeout=20.0, recover_timeout=40.0, link_seconds=8.0,
                    rounds_between=(1.0, 2.0), tmp=tmp_path)
    assert res["network"] == "namespaces" and not res["skipped"], res
    assert verdict(res) == [], res
    assert res["faults"] == 2 and res["failed_calls"] >= 1, res
    assert all(e["recovery_seconds"] < 15 for e in res["events"]), res["events"]
