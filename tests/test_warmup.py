"""Kernel warm-up (daemon/warmup.py): a codec's first round never compiles Numba kernels on the
ring thread, so a node stays alive for its peers while its kernels compile.

The real-daemon test starts from an empty Numba cache, so it pays a cold compilation of birdplus
and marsit (tens of seconds here): marked slow."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import workers
from birdnet.client import Client
from birdnet.daemon import warmup
from birdnet.daemon.engine import Contribution, LocalRound, RoundRunner, StateStore
from cluster import LocalCluster

from birdnet.codecs import get_codec, names
from birdnet.config import Settings
from birdnet.errors import ConfigError
from birdnet.wire import PROTOCOL_ID as PID  # this build's "birdnet/N"


def test_every_codec_with_kernels_is_warmed_at_start():
    warmed = {c for c, _p in warmup.CONFIGURATIONS}
    assert warmed == set(names()) - warmup.NO_KERNELS
    for c, p in warmup.CONFIGURATIONS:
        get_codec(c, **p)  # every listed configuration is a valid one


def test_settings_check_the_warm_up_options():
    with pytest.raises(ConfigError, match="kernel_warmup"):
        Settings(kernel_warmup="some")
    with pytest.raises(ConfigError, match="warmup_timeout"):
        Settings(warmup_timeout=0)


@pytest.mark.parametrize("codec,params,sizes", [
    ("topk", {}, (5000, 100003)), ("marsit", {"momentum": 0.9}, (5000, 100003)),
    ("lowbit", {}, (5000, 100003)),
    # a real model's tensors: block ids past 16 bits (uint32), the sampled-bound selection (>= 32K
    # blocks) and, at 6.6M, the parallel gathers of >= 64K kept values. Before warm() covered
    # them, a first birdplus call of 300,001 elements compiled 550 kernels on the ring thread of
    # each of 4 daemons (30 s without heartbeats: PeerLostError)
    ("birdplus", {}, (600001, 6600001)),
])
def test_a_warmed_configuration_compiles_nothing_more_in_rounds(codec, params, sizes, warm_as=None):
    """After warm(), rounds of other sizes (both sides of the serial/parallel switch) and with two
    local processes compile no kernel: what warm() ran is what rounds run."""
    warmup.warm(codec, params if warm_as is None else warm_as)
    counter = warmup._CompileCounter()
    world = 2
    with counter.counting():
        for n in sizes:
            runners = [RoundRunner(Settings(), StateStore(1 << 30)) for _ in range(world)]

            def node(t, n=n, runners=runners):
                for k in range(3):
                    desc = {"kind": "allreduce", "name": "w", "shape": [n], "dtype": "float32", "op": "mean",
                            "codec": get_codec(codec, **params).describe(), "root": None}
                    parts = [Contribution(b"s", k, np.full(n, t.rank + i + k, np.float32), i, 2 * t.rank + i)
                             for i in range(2)]
                    runners[t.rank].run(LocalRound("j", k, "allreduce", desc, parts), t, t.rank, world, [2, 2])

            warmup._FrameRing(world).run(node, timeout=120)
    assert counter.count == 0, f"rounds compiled {counter.count} kernel(s) warm() had not: {counter.seconds}"


def test_sparseloco_warmed_at_its_defaults_covers_other_chunks_k_and_beta():
    # DiLoCo's setting (k=256 of 4096, offsets) and a bitmap chunk (k=100 of 256) take the kernels
    # the defaults (k=64) compiled: chunk, k and beta are arguments, not types
    test_a_warmed_configuration_compiles_nothing_more_in_rounds(
        "sparseloco", {"k": 256, "beta": 0.9}, (5000, 100003), warm_as={})
    test_a_warmed_configuration_compiles_nothing_more_in_rounds(
        "sparseloco", {"chunk": 256, "k": 100}, (5000,), warm_as={})


def test_lowbit_warmed_at_its_defaults_covers_other_bits_and_no_error_feedback():
    # the start-up list has lowbit once: its kernels take bits, midrise and the residual as arguments
    test_a_warmed_configuration_compiles_nothing_more_in_rounds(
        "lowbit", {"bits": 2, "block": 8, "error_feedback": False}, (5000,), warm_as={})
    test_a_warmed_configuration_compiles_nothing_more_in_rounds("lowbit", {"bits": 4}, (5000,), warm_as={})
    test_a_warmed_configuration_compiles_nothing_more_in_rounds("lowbit", {"bits": 2, "midrise": True}, (5000,),
                                                                warm_as={})


def test_the_warm_up_command_stamps_what_it_compiled(tmp_path):
    """A configuration warmed once is skipped the next time without importing Numba."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    cmd = [sys.executable, "-m", "birdnet.daemon.warmup", "--codec", "qsgd"]
    first = [json.loads(x) for x in subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                                                   check=True).stdout.splitlines()]
    assert first[-1]["t"] == "done" and first[-1]["compiled"] > 0 and first[-1]["failed"] == 0
    t0 = time.monotonic()
    code = "import runpy, sys; sys.argv = ['w', '--codec', 'qsgd']; runpy.run_module('birdnet.daemon.warmup', run_name='__main__')"
    again = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env, capture_output=True,
                           text=True, timeout=120)
    msgs = [json.loads(x) for x in again.stdout.splitlines()]
    assert msgs[1]["t"] == "warmed" and msgs[1]["stamped"] is True
    assert msgs[-1]["compiled"] == 0
    assert "numba" not in again.stderr.split(), "a stamped configuration must not import Numba"
    assert time.monotonic() - t0 < 60


def test_a_call_parked_past_warmup_timeout_fails_with_a_clear_error(tmp_path):
    """Kernels that cannot be ready within warmup_timeout (an empty cache, a 0.2 s limit) fail the
    call with RoundTimeoutError naming the codec and the setting; the daemon keeps serving."""
    env_cache = tmp_path / "numba"
    old = os.environ.get("NUMBA_CACHE_DIR")
    os.environ["NUMBA_CACHE_DIR"] = str(env_cache)
    try:
        with LocalCluster(1, tmp_path, extra=["--warmup-timeout", "0.2"]) as cl:
            with Client(cl.sockets[0], job="t") as c:
                from birdnet.errors import RoundTimeoutError
                with pytest.raises(RoundTimeoutError, match="warmup_timeout=0.2"):
                    c.allreduce(np.ones(5000, np.float32), name="w", codec="qsgd", timeout=60)
                # dense calls still run, and the daemon still answers
                assert c.allreduce(np.ones(10, np.float32), name="d", timeout=60)[0] == 1.0
                assert c.status()["kernels"]["mode"] == "used"
    finally:
        if old is None:
            os.environ.pop("NUMBA_CACHE_DIR", None)
        else:
            os.environ["NUMBA_CACHE_DIR"] = old


def test_a_bad_default_codec_parameter_stops_the_daemon_with_status_2(tmp_path):
    cl = LocalCluster(1, tmp_path, extra=["--codec", "topk", "--codec-params", '{"density": 7}'])
    try:
        cl.start_node(0, wait=False)
        assert cl.procs[0].wait(60) == 2
        assert "density" in cl.logs[0].read_text()
    finally:
        cl.stop()


@pytest.mark.slow
def test_first_marsit_rounds_from_an_empty_cache_lose_no_peer(tmp_path):
    """3 daemons with a 1.5 s peer_timeout and an empty Numba cache: a first compressed round whose
    kernels compiled on the ring thread (11-18 s for marsit here, 37-58 s for birdplus) would stop
    its heartbeats and get the node counted lost. Every node's first calls succeed, no daemon ever
    counts a peer lost, no kernel is compiled or loaded on a ring thread, and all nodes end
    bit-identical. One codec is enough for the property (its compile is already 10x peer_timeout);
    birdplus's longer compile would only add a minute to every CI run."""
    old = os.environ.get("NUMBA_CACHE_DIR")
    os.environ["NUMBA_CACHE_DIR"] = str(tmp_path / "numba")
    specs = [("marsit", {})]
    try:
        with LocalCluster(3, tmp_path, peer_timeout=1.5, heartbeat_interval=0.25) as cl:
            res = cl.run(workers.first_compressed_rounds, specs, 70001, 2, 500.0, timeout=540)
            statuses = []
            for s in cl.sockets:
                with Client(s, job="watch") as c:
                    statuses.append(c.status())
            logs = [log.read_text() for log in cl.logs]  # before the stop (a stopped neighbour is lost)
    finally:
        if old is None:
            os.environ.pop("NUMBA_CACHE_DIR", None)
        else:
            os.environ["NUMBA_CACHE_DIR"] = old
    for r in res:
        assert r["error"] is None, r["error"]
    for i in range(len(res[0]["out"])):
        for r in res[1:]:
            assert r["out"][i][2].tobytes() == res[0]["out"][i][2].tobytes()
    for st in statuses:
        k = st["kernels"]
        assert k["ring_thread_compiles"] == 0, k
        assert "marsit" in k["loaded"], k
        assert st["rounds_failed"] == 0
    for text in logs:
        assert " lost" not in text, text[-3000:]


def test_at_start_every_configuration_is_warmed_by_the_subprocess(tmp_path):
    """kernel_warmup="all": the start-up subprocess goes through every configuration (here all
    stamped as done, as after an earlier start, so nothing compiles) and status says so; a call
    then loads its kernels in the daemon (compiling them there: this cache is really empty, which
    the log names) and works."""
    cache = tmp_path / "numba"
    old = os.environ.get("NUMBA_CACHE_DIR")
    os.environ["NUMBA_CACHE_DIR"] = str(cache)
    try:
        for c, p in warmup.CONFIGURATIONS:
            stamp = warmup._stamp(cache, warmup.config_key(c, p))
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.write_text("{}")
        with LocalCluster(1, tmp_path, kernel_warmup="all") as cl:
            with Client(cl.sockets[0], job="t") as c:
                deadline = time.monotonic() + 60
                while (k := c.status()["kernels"])["process"] != "done" and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert k["process"] == "done" and k["process_done"] == len(warmup.CONFIGURATIONS), k
                x = np.arange(5000, dtype=np.float32)
                out = c.allreduce(x, name="w", codec="qsgd", timeout=300)  # 127 levels: a step of |x|/127
                assert np.abs(out - x).max() <= np.linalg.norm(x) / 127 * 1.001
                k = c.status()["kernels"]
                assert any(s.startswith("qsgd") for s in k["loaded"]) and k["ring_thread_compiles"] == 0, k
            assert "the on-disk cache did not have them" in cl.logs[0].read_text()
    finally:
        if old is None:
            os.environ.pop("NUMBA_CACHE_DIR", None)
        else:
            os.environ["NUMBA_CACHE_DIR"] = old


@pytest.mark.timeout(180)
def test_warm_loads_a_codec_before_its_first_call(tmp_path):
    """Client.warm names a codec about to be used: the daemon loads its kernels in its warm-up
    thread at once, so the later first call does not wait for them. Before, the PyTorch adapter's
    first compressed step after an Adam warm-up stalled ~1.6 s while every daemon loaded marsit.
    An unknown codec is refused by name; the daemon keeps serving."""
    from birdnet.errors import InputError
    with LocalCluster(1, tmp_path, kernel_warmup="used") as cl:
        with Client(cl.sockets[0], job="t") as c:
            label = 'marsit {"momentum": 0.75}'
            assert label not in c.status()["kernels"]["loaded"]
            assert c.warm("marsit", momentum=0.75) is False  # asked for, not loaded yet
            deadline = time.monotonic() + 150  # from the shared on-disk cache: ~1 s; cold: a minute
            while label not in (k := c.status()["kernels"])["loaded"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert label in k["loaded"], k
            assert c.warm("marsit", momentum=0.75) is True
            t0 = time.monotonic()
            out = c.allreduce(np.ones(5000, np.float32), name="w", codec="marsit", momentum=0.75, timeout=60)
            assert out.shape == (5000,) and c.status()["kernels"]["ring_thread_compiles"] == 0
            assert "calls wait for the kernels" not in cl.logs[0].read_text(), time.monotonic() - t0
            with pytest.raises(InputError, match="unknown codec 'marsitt'.*choose one of"):
                c.warm("marsitt")
            assert c.allreduce(np.ones(10, np.float32), name="d", timeout=60)[0] == 1.0


@pytest.mark.timeout(120)
def test_warm_needs_a_session_and_is_bounded(tmp_path):
    """warm is a session's request (like submit), and the configurations it may ask for are capped:
    each is a subprocess and a load, so a process naming endless parameter sets is refused by name
    once MAX_WARM_REQUESTS are asked for. The cap is checked on the handler with a stand-in for the
    daemon's state (reaching it for real would compile 64 configurations)."""
    import types

    import msgpack
    import zmq
    from birdnet.daemon import service

    from birdnet.errors import InputError
    from birdnet.requests import Warm
    with LocalCluster(1, tmp_path, kernel_warmup="used") as cl:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{cl.sockets[0]}")
        s.send_multipart([PID, msgpack.packb({"t": "warm", "call": 1, "codec": "qsgd", "nbuf": 0, "sizes": []})])
        assert s.poll(10000)
        reply = msgpack.unpackb(s.recv_multipart()[-1])
        assert reply["t"] == "error" and "hello" in reply["message"], reply
        s.close(0)
        ctx.term()
        with Client(cl.sockets[0], job="t") as c:
            assert c.warm("fp16") is True  # no kernels: ready at once
            assert not any(k.startswith("qsgd") for k in c.status()["kernels"]["loaded"])  # nothing asked for
            assert c.allreduce(np.ones(10, np.float32), name="d", timeout=60)[0] == 1.0
    replies = []
    asked = {f"k{i}" for i in range(service.MAX_WARM_REQUESTS)}
    fake = types.SimpleNamespace(_session=lambda identity: None, reply=lambda i, r: replies.append(r),
                                 warmer=types.SimpleNamespace(requested=asked, ready=lambda c, p: False))
    with pytest.raises(InputError, match=f"{service.MAX_WARM_REQUESTS} codec configurations were asked for"):
        service.Daemon.handle_warm(fake, b"id", Warm(call=2, codec="qsgd", params={"levels": 3}))
    asked.pop()
    service.Daemon.handle_warm(fake, b"id", Warm(call=3, codec="qsgd", params={"levels": 3}))
    assert replies == [{"t": "warm", "call": 3, "ready": False}]


def test_birdnet_warmup_command_reports_and_stamps(tmp_path):
    """`birdnet warmup` (the documented command the Ansible role runs): a line per configuration with
    its time, a total, and on a second run nothing compiled again."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "birdnet.cli", "warmup", "--codec", "none"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"warming 1 codec configurations into {tmp_path / 'cache'} (0 done already)" in first.stdout
    assert re.search(r"\[ 1/1\] none\s+[\d.]+ s, \d+ kernel\(s\) compiled", first.stdout), first.stdout
    assert re.search(r"^done in [\d.]+ s", first.stdout, re.M), first.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert "(1 done already)" in again.stdout and "cached already" in again.stdout, again.stdout
    bad = subprocess.run([sys.executable, "-m", "birdnet.cli", "warmup", "--codec", 'birdplus:{"density": 2}'],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 1 and "FAILED: CodecError" in bad.stdout and "density" in bad.stdout, bad.stdout
