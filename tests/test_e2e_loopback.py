"""Real birdnetd processes on loopback with real training processes (spawned)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import workers
from cluster import LocalCluster

from birdnet.errors import DaemonUnavailableError

SIZES = [0, 1, 3, 1000, 100003]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nodes,local", [(2, 1), (3, 2), (4, 1), (2, 3)])
def test_sum_of_ranks_is_exact(tmp_path, nodes, local):
    with LocalCluster(nodes, tmp_path, local_size=local) as cl:
        results = cl.run(workers.fill_sum, SIZES)
    total = nodes * local
    expected = total * (total + 1) / 2
    for per_proc in results:
        for n, out in zip(SIZES, per_proc):
            assert out.shape == (n,) and out.dtype == np.float32
            assert np.all(out == expected)


@pytest.mark.timeout(180)
def test_random_mean_bit_identical_and_accurate(tmp_path):
    with LocalCluster(3, tmp_path) as cl:
        res = cl.run(workers.random_mean, 100003, 7, "float32", 3)
    for k in range(3):
        ref = np.mean([r["inputs"][k].astype(np.float64) for r in res], axis=0)
        for r in res:
            assert r["outs"][k].tobytes() == res[0]["outs"][k].tobytes()
        assert np.max(np.abs(res[0]["outs"][k] - ref)) < 1e-5
    st = res[0]["stats"][0]
    # dense ring: each node sends 2(N-1)/N of the tensor, counted at the transport
    assert st["bytes_sent"] >= 2 * 2 / 3 * 100003 * 4
    assert st["count"] == 3


@pytest.mark.timeout(240)
def test_large_tensor_zero_copy_chunks_bit_identical_and_accurate(tmp_path):
    """3M float32 on 3 nodes: segments of 4 MB, so full 1 MiB chunks go out zero-copy from the
    processes' shared memory while the ring keeps writing into the same array (architecture note,
    step 5); results must still be the same bits everywhere and the exact mean within float32."""
    n = 3_000_003
    with LocalCluster(3, tmp_path) as cl:
        res = cl.run(workers.random_mean, n, 11, "float32", 3, timeout=200)
    for k in range(3):
        ref = np.mean([r["inputs"][k].astype(np.float64) for r in res], axis=0)
        for r in res:
            assert r["outs"][k].tobytes() == res[0]["outs"][k].tobytes()
        assert np.max(np.abs(res[0]["outs"][k] - ref)) < 1e-5
    assert res[0]["stats"][0]["bytes_sent"] >= 2 * 2 / 3 * n * 4


@pytest.mark.timeout(180)
def test_collectives_dtypes_async_buffer(tmp_path):
    with LocalCluster(2, tmp_path, local_size=2) as cl:
        res = cl.run(workers.collectives)
    for r in res:
        assert r["size"] == 4
        assert r["b"].dtype == np.float64 and np.all(r["b"] == 3.0)  # root = rank 3
        assert r["f16"].dtype == np.float16 and np.all(r["f16"] == np.float16(1.5))
        assert r["f64"].dtype == np.float64 and np.all(r["f64"] == 6.0)
        assert r["i64"].dtype == np.int64 and r["i64"].tolist() == [0, 4, 8, 12]
        assert np.all(r["buf"] == 6.0) and r["buf_same_memory"]
        assert [a[0] for a in r["asyncs"]] == [0.0, 4.0, 8.0]
        assert r["status"]["world"] == 2 and r["status"]["rounds_done"] >= 8
    assert sorted(r["rank"] for r in res) == [0, 1, 2, 3]


@pytest.mark.timeout(180)
def test_shape_mismatch_is_reported_everywhere_and_daemon_keeps_serving(tmp_path):
    with LocalCluster(3, tmp_path) as cl:
        res = cl.run(workers.expect_error, [(10,), (10,), (11,)])
    for err, ok in res:
        assert err is not None and err[0] == "RoundMismatchError"
        assert "shape" in err[1] and "'x'" in err[1] and "rank 2" in err[1]
        assert ok == [3.0] * 5


@pytest.mark.timeout(120)
def test_nodes_with_different_local_sizes_refuse_each_other_by_name(tmp_path):
    """Global ranks are node rank x local_size + local rank: nodes that disagree on local_size
    would hand out colliding ranks. The handshake refuses them; a call fails with the reason
    within peer_timeout (4 s here), never a hang."""
    import fault_workers
    with LocalCluster(2, tmp_path, per_node_extra=[[], ["--local-size", "2"]]) as cl:
        (cls, msg, secs), = cl.run(fault_workers.try_round, 100, 30.0, nodes=[0])
        assert cls == "PeerLostError", (cls, msg)
        assert "local_size: 1 (peer) vs 2" in msg, msg  # the process hears why
        assert secs < 4 + 4
        for i in range(2):
            assert "local_size: 2 (peer) vs 1" in cl.log(i) or "local_size: 1 (peer) vs 2" in cl.log(i), cl.log(i)


@pytest.mark.timeout(180)
def test_dtype_mismatch_within_node(tmp_path):
    with LocalCluster(1, tmp_path, local_size=2) as cl:
        # both processes on node 0; the second one sends float64
        res = cl.run(_mismatch_local)
    for err, ok in res:
        assert err is not None and err[0] in ("InputError", "RoundMismatchError") and "dtype" in err[1]
        assert ok == [2.0] * 5


def _mismatch_local(sock, node, local):
    """Two processes on one node; the second submits float64 where the first submits float32."""
    from birdnet.client import Client
    with Client(sock) as c:
        try:
            c.allreduce(np.ones(10, "float32" if c.local_rank == 0 else "float64"), name="x", timeout=30)
            err = None
        except Exception as exc:  # noqa: BLE001
            err = (type(exc).__name__, str(exc))
        ok = c.allreduce(np.ones(5, np.float32), op="sum", name="after", timeout=30)
        return err, ok.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["propagate", "reject"])
def test_nan_policy(tmp_path, policy):
    with LocalCluster(2, tmp_path, extra=["--nan-policy", policy]) as cl:
        res = cl.run(workers.nan_round)
    for r in res:
        if policy == "propagate":
            assert r == ("ok", True, 1.0)
        else:
            assert r[0] == "error" and r[1] == "InputError" and "grad.nan" in r[2] and "NaN" in r[2]


def test_daemon_not_running_fails_fast(tmp_path):
    from birdnet.client import Client
    t = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match="birdnetd"):
        Client(str(tmp_path / "nothing.sock"))
    assert time.monotonic() - t < 2.0


def test_bad_input_rejected_client_side(tmp_path):
    with LocalCluster(1, tmp_path) as cl:
        from birdnet.client import Client

        from birdnet.errors import CodecError, InputError
        with Client(cl.sockets[0]) as c:
            with pytest.raises(InputError, match="dtype object"):
                c.allreduce(np.array([object()]))
            with pytest.raises(InputError, match="op"):
                c.allreduce(np.ones(3, np.float32), op="max")
            with pytest.raises(InputError, match="int64"):
                c.allreduce(np.ones(3, np.int64), op="mean")
            with pytest.raises(CodecError, match="unknown codec"):
                c.allreduce(np.ones(5000, np.float32), codec="nope")
            assert c.allreduce(np.ones(3, np.float32)).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.timeout(120)
def test_status_command(tmp_path):
    with LocalCluster(2, tmp_path) as cl:
        cl.run(workers.fill_sum, [10, 20])
        out = subprocess.run([sys.executable, "-m", "birdnet.cli", "status", "--socket", cl.sockets[1], "--json"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        assert st["rank"] == 1 and st["world"] == 2 and st["rounds_done"] >= 1
        assert [p["state"] for p in st["peers"]] == ["connected", "self"]
        assert st["bytes_sent"] > 0 and st["messages_lost"] == 0
        assert st["last_ratio"] is not None and st["round_seconds_count"] >= 1  # figures also without metrics
        text = subprocess.run([sys.executable, "-m", "birdnet.cli", "status", "--socket", cl.sockets[0]],
                              capture_output=True, text=True, timeout=30)
        assert "rank 0 of 2" in text.stdout
        assert "start/go agreements 1, in the dense lane 1 (given up 0)" in text.stdout  # the 2nd call
        assert "messages lost" not in text.stdout  # said only when some were
    missing = subprocess.run([sys.executable, "-m", "birdnet.cli", "status", "--socket", str(tmp_path / "x.sock")],
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode == 1 and "no birdnetd" in missing.stderr


@pytest.mark.timeout(120)
def test_sigterm_exits_zero_and_cleans_shared_memory(tmp_path):
    import os
    cl = LocalCluster(2, tmp_path).start()
    try:
        cl.run(workers.fill_sum, [1000])
    finally:
        codes = cl.stop()
    assert codes == [0, 0]
    for i in range(2):
        assert not os.path.exists(cl.sockets[i])
    from birdnet.shm import segment_prefix
    prefixes = [segment_prefix(s) for s in cl.sockets]
    leftovers = [f for f in os.listdir("/dev/shm") if any(f.startswith(p) for p in prefixes)]
    assert leftovers == []


@pytest.mark.timeout(180)
def test_rounds_in_flight_are_agreed_in_batches_and_a_bad_one_fails_alone(tmp_path):
    with LocalCluster(3, tmp_path) as cl:
        res = cl.run(workers.batch_of_async_rounds, 24, 7)
    for out, status in res:
        for i, (kind, value) in enumerate(out):
            if i == 7:
                assert kind == "RoundMismatchError" and "'b7'" in value and "shape" in value
            else:
                assert (kind, value) == ("ok", 3.0 * i)
        # 24 rounds (+1 barrier) in flight at once need far fewer start/go exchanges than rounds
        assert status["round_agreements"] < status["rounds_done"] + status["rounds_failed"]


@pytest.mark.timeout(120)
def test_a_job_restarted_at_once_finds_its_place_free(tmp_path):
    """A process's place in its job (one per node by default) is free again when ``close()``
    returns (the daemon confirms the bye), and when a process was killed without one, its successor
    is not refused while the daemon has not reaped it yet (it looks when the job is full)."""
    import os
    import signal

    from birdnet.client import Client
    with LocalCluster(1, tmp_path) as cl:
        sock = cl.sockets[0]
        with Client(sock, job="watch") as watcher:
            for _ in range(20):
                c = Client(sock, job="restarted")
                assert c.allreduce(np.ones(3, np.float32), timeout=30).tolist() == [1.0] * 3
                c.close()
                assert "restarted" not in watcher.status()["jobs"]  # the session ended before close returned
            code = ("import os, signal, sys\nfrom birdnet.client import Client\n"
                    f"c = Client({sock!r}, job='killed')\nprint('joined', flush=True)\n"
                    "os.kill(os.getpid(), signal.SIGKILL)\n")
            for _ in range(5):
                p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
                assert p.returncode == -signal.SIGKILL and "joined" in p.stdout, p.stderr
                # the daemon ends a session when its process's last connection closes (or, at the
                # latest, at the reaper's next look a second later): the successor may come before
                # either, and must not be refused
                with Client(sock, job="killed") as successor:
                    assert successor.local_rank == 0
                    assert successor.allreduce(np.ones(2, np.float32), timeout=30).tolist() == [1.0, 1.0]
            # close() waits for the daemon's answer, but never longer than BYE_TIMEOUT
            from birdnet.client import BYE_TIMEOUT
            c = Client(sock, job="stopped")
            cl.send_signal(0, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                c.close()
                waited = time.monotonic() - t0
            finally:
                cl.send_signal(0, signal.SIGCONT)
            assert BYE_TIMEOUT - 0.05 <= waited < BYE_TIMEOUT + 2.0
            assert os.getpid() in [x["pid"] for x in watcher.status()["jobs"]["watch"]["processes"]]


@pytest.mark.timeout(180)
def test_results_stay_in_shared_memory_while_the_caller_holds_them(tmp_path):
    """allreduce hands back its result where the daemon wrote it (no copy out); a slot whose result
    (or a view of it) is alive takes no other call, and past RESULT_SLOTS held results are copied.
    Every held result keeps its exact value through later calls."""
    n, kept = 1000, 11
    with LocalCluster(2, tmp_path) as cl:
        res = cl.run(workers.held_results, n, kept)
    for r in res:
        size, cap = r["size"], r["result_slots"]
        assert kept > cap
        for i, v in enumerate(r["views"]):
            # the sum over ranks of (rank + 1 + 10 i)
            assert np.all(v == size * (size + 1) / 2 + size * 10 * i), i
        assert r["in_slot"] == [True] * cap + [False] * (kept - cap)
        assert r["slots_after_held"] == cap + 1  # cap holding results, one copied out and free again
        # a loop that drops each result at the next call: two slots take turns, none is added
        assert r["slots_after_loop"] <= r["slots_after_held"] + 1
        assert r["loop_value"] == size * (size + 1) / 2 + size * 10 * (kept + 5)


def _ask_local_rank(sock, node, local):
    """The first process asks for local rank 1, the second for 0: the reverse of any order."""
    from birdnet.client import Client
    want = 1 - local
    with Client(sock, local_rank=want) as c:
        out = c.allreduce(np.full(4, float(c.rank), np.float32), op="sum", name="x", timeout=30)
        return want, c.local_rank, c.rank, out.tolist()


def _hold_local_rank(sock, local_rank, job):
    from birdnet.client import Client

    from birdnet.errors import InputError
    try:
        with Client(sock, job=job, local_rank=local_rank):
            return None
    except InputError as exc:
        return str(exc)


@pytest.mark.timeout(120)
def test_a_local_rank_asked_for_is_given_and_one_taken_or_too_high_is_refused_by_name(tmp_path):
    import multiprocessing as mp
    import os

    from birdnet.client import Client

    from birdnet.errors import InputError
    with LocalCluster(1, tmp_path, local_size=2) as cl:
        res = cl.run(_ask_local_rank)
        for want, got, rank, out in res:
            assert got == want and rank == want  # one node: rank = local rank
            assert out == [1.0] * 4  # ranks 0 + 1
        sock = cl.sockets[0]
        with pytest.raises(InputError, match=r"local rank 2, but birdnetd runs with --local-size 2"):
            Client(sock, job="held", local_rank=2)
        with pytest.raises(InputError, match="expected a non-negative int"):
            Client(sock, job="held", local_rank=-1)
        with Client(sock, job="held", local_rank=0) as holder:
            assert holder.local_rank == 0
            with mp.get_context("spawn").Pool(1) as pool:
                why = pool.apply_async(_hold_local_rank, (sock, 0, "held")).get(60)
                assert why is not None and f"local rank 0 on this node is taken by pid {os.getpid()}" in why, why
                # the other local rank is free
                assert pool.apply_async(_hold_local_rank, (sock, 1, "held")).get(60) is None
            # and the refused process took nothing from the holder
            (proc,) = holder.status()["jobs"]["held"]["processes"]
            assert proc["local_rank"] == 0 and proc["pid"] == os.getpid()
