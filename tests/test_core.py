"""The socket-free core: hosts file, wire format, settings, ring algorithms over MemoryRing."""
from __future__ import annotations

import numpy as np
import pytest

from birdnet import wire
from birdnet.config import Settings, load_settings
from birdnet.errors import ConfigError, ProtocolError, RoundMismatchError, VersionMismatchError
from birdnet.hosts import parse_hosts
from birdnet.ring.dense import CHUNKS_PER_SEGMENT, chunk_elements, ring_allreduce, segment_bounds
from birdnet.ring.gather import ring_allgather
from birdnet.ring.transport import MemoryRing
from birdnet.wire import PROTOCOL_ID as PID  # this build's "birdnet/N"


# -- hosts ------------------------------------------------------------------------------------------
def test_hosts_parse_comments_blank_ipv6():
    peers = parse_hosts("# ring\n\nnode-a:5000  # first\n10.0.0.2:5001\n[fe80::1]:5002\n", "h.txt")
    assert [(p.rank, p.host, p.port) for p in peers] == [(0, "node-a", 5000), (1, "10.0.0.2", 5001), (2, "fe80::1", 5002)]
    assert peers[2].endpoint() == "tcp://[fe80::1]:5002"


@pytest.mark.parametrize("text,needle", [
    ("a:5000\nb\n", "h.txt:2"),
    ("a:5000\nb:x\n", "port 'x'"),
    ("a:70000\n", "outside 1..65535"),
    ("a:5000\nA:5000\n", "duplicates line 1"),
    ("# nothing\n", "no 'host:port'"),
    ("a:1 b:2\n", "h.txt:1"),
])
def test_hosts_errors_name_file_and_line(text, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_hosts(text, "h.txt")


# -- wire -------------------------------------------------------------------------------------------
def test_wire_roundtrip_zero_copy_views():
    a = np.arange(10, dtype=np.float32)
    frames = wire.encode({"t": "data", "x": 1}, [a, b"xy"])
    h, bufs = wire.decode([bytes(f) for f in frames], max_bytes=1000)
    assert h["t"] == "data" and h["x"] == 1 and h["sizes"] == [40, 2]
    assert np.array_equal(np.frombuffer(bufs[0], np.float32), a) and bytes(bufs[1]) == b"xy"


@pytest.mark.parametrize("frames,exc,needle", [
    ([PID], ProtocolError, "at least 2"),
    ([b"birdnet/9", b"\x80"], VersionMismatchError, "birdnet/9"),
    ([b"http/1.1", b"\x80"], ProtocolError, "bad protocol id"),
    ([PID, b"\xc1"], ProtocolError, "msgpack"),
    ([PID, b"\x93\x01\x02\x03"], ProtocolError, "map"),
])
def test_wire_rejects_garbage(frames, exc, needle):
    with pytest.raises(exc, match=needle):
        wire.decode(frames, max_bytes=100)


def test_wire_checks_sizes_before_trusting_them():
    import msgpack
    h = msgpack.packb({"t": "data", "nbuf": 1, "sizes": [10**12]})
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.decode([PID, h, b"x"], max_bytes=1000)
    h = msgpack.packb({"t": "data", "nbuf": 1, "sizes": [5]})
    with pytest.raises(ProtocolError, match="has 1 bytes"):
        wire.decode([PID, h, b"x"], max_bytes=1000)
    with pytest.raises(ProtocolError, match="over the"):
        wire.decode([PID, b"\x00" * (wire.MAX_HEADER_BYTES + 1)], max_bytes=10)
    h = msgpack.packb({"t": "data", "nbuf": 2, "sizes": [1, 1]})
    with pytest.raises(ProtocolError, match="announces 2"):
        wire.decode([PID, h, b"x"], max_bytes=1000)


def test_round_keys_split_at_the_last_slash_and_refuse_what_is_not_one():
    assert wire.split_key(wire.round_key("team/resnet", 12)) == ("team/resnet", 12)
    for bad in ("resnet", "resnet/", "resnet/x1", "resnet/-1", 7, None, ["a/1"]):
        assert wire.split_key(bad) is None, bad


# -- settings ---------------------------------------------------------------------------------------
def test_settings_precedence(tmp_path):
    cfg = tmp_path / "b.toml"
    cfg.write_text('peers = "hosts.txt"\npeer_timeout = 7.0\nlocal_size = 3\ncodec = "topk"\n'
                   'codec_params = { density = 0.01 }\n')
    s = load_settings({"local_size": 2}, config=str(cfg), environ={"BIRDNET_PEER_TIMEOUT": "9"})
    assert s.local_size == 2  # flag over file
    assert s.peer_timeout == 9.0  # environment over file
    assert s.codec == "topk" and s.codec_params == {"density": 0.01}
    assert s.peers == str(tmp_path / "hosts.txt")  # relative to the config file
    assert load_settings({}, environ={}).peer_timeout == Settings().peer_timeout


@pytest.mark.parametrize("kw,needle", [
    ({"local_size": 0}, "local_size"),
    ({"peer_timeout": 1.0, "heartbeat_interval": 0.8}, "half of peer_timeout"),
    ({"nan_policy": "ignore"}, "nan_policy"),
])
def test_settings_validation(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        Settings(**kw)


def test_settings_bad_file_and_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("peers = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings({}, config=str(bad), environ={})
    bad.write_text("perr_timeout = 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'perr_timeout'"):
        load_settings({}, config=str(bad), environ={})
    with pytest.raises(ConfigError, match="BIRDNET_LOCAL_SIZE"):
        load_settings({}, environ={"BIRDNET_LOCAL_SIZE": "two"})


def test_fingerprint_covers_cluster_wide_settings_only():
    assert Settings(codec="topk").fingerprint() != Settings().fingerprint()
    assert Settings(round_timeout=20.0).fingerprint() == Settings().fingerprint()  # timeouts: tests/test_peer_config.py


# -- ring over the in-memory transport -------------------------------------------------------------
@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 3, 1000, 100003])
def test_dense_ring_sum_bit_identical(world, n):
    rng = np.random.default_rng(world * 100003 + n)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    ring = MemoryRing(world)
    res = ring.run(lambda t: ring_allreduce(t, xs[t.rank], timeout=10, chunk_bytes=4096))
    for r in res:
        assert r.dtype == np.float32 and r.shape == (n,)
        assert r.tobytes() == res[0].tobytes()
    ref = np.sum(np.array(xs, dtype=np.float64), axis=0) if n else np.zeros(0)
    assert np.allclose(res[0], ref, atol=1e-5 * world)
    for _x, t in zip(xs, ring.transports):  # the input is left alone
        assert t.bytes_sent == (0 if world == 1 else sum(sz for _, szs in t.messages_sent for sz in szs))
    if world > 1 and n >= world:
        # bandwidth-optimal: each rank sends 2 (world-1)/world of the vector
        assert abs(ring.transports[0].bytes_sent - 2 * (world - 1) * 4 * n / world) <= 8 * world


def test_chunks_grow_with_the_tensor_between_chunk_bytes_and_max_chunk_bytes():
    """The daemons' defaults (1 MiB, 4 MiB): a large tensor's segment travels in CHUNKS_PER_SEGMENT
    chunks instead of one per MiB, a small one in chunks of chunk_bytes, a huge one in 4 MiB ones."""
    s = Settings()
    assert CHUNKS_PER_SEGMENT == 6
    seg4 = segment_bounds(11_689_512, 4)[1]  # 4 nodes, 11.7M float32: 11.7 MB segments
    per = chunk_elements(seg4, 4, s.chunk_bytes, s.max_chunk_bytes)
    assert -(-seg4 // per) == 6 and 1 << 20 < per * 4 <= 4 << 20  # 12 chunks of 1 MiB before
    seg8 = segment_bounds(11_689_512, 8)[1]  # 8 nodes: 5.8 MB segments, still in 1 MiB chunks
    assert chunk_elements(seg8, 4, s.chunk_bytes, s.max_chunk_bytes) == (1 << 20) // 4
    seg4 = segment_bounds(25_557_032, 4)[1]  # 25.6M: 25.6 MB segments, chunks of 4 MiB at most
    assert chunk_elements(seg4, 4, s.chunk_bytes, s.max_chunk_bytes) == (4 << 20) // 4
    assert chunk_elements(250_000, 4, s.chunk_bytes, s.max_chunk_bytes) == (1 << 20) // 4  # 1M on 4 nodes
    assert chunk_elements(10**8, 4, s.chunk_bytes, s.max_chunk_bytes) == (4 << 20) // 4  # at most 4 MiB
    assert chunk_elements(10**8, 2, s.chunk_bytes, s.max_chunk_bytes) == (4 << 20) // 2  # bytes, not elements
    assert chunk_elements(seg4, 4, s.chunk_bytes, 0) == (1 << 20) // 4  # max_chunk_bytes 0: fixed
    assert chunk_elements(seg4, 4, 8 << 20, 4 << 20) == (8 << 20) // 4  # chunk_bytes above it wins


@pytest.mark.parametrize("world", [2, 3, 7])
def test_dense_ring_with_growing_chunks_sends_chunks_per_segment_and_stays_bit_identical(world):
    n = 100_003
    xs = [np.random.default_rng(world + r).standard_normal(n).astype(np.float32) for r in range(world)]
    ring = MemoryRing(world)
    res = ring.run(lambda t: ring_allreduce(t, xs[t.rank], timeout=10, chunk_bytes=4096, max_chunk_bytes=1 << 20))
    assert all(r.tobytes() == res[0].tobytes() for r in res)
    assert np.allclose(res[0], np.sum(np.array(xs, np.float64), axis=0), atol=1e-5 * world)
    # 2(world-1) steps of CHUNKS_PER_SEGMENT messages each (4096-byte chunks: 2(world-1) x 14+)
    assert len(ring.transports[0].messages_sent) == 2 * (world - 1) * CHUNKS_PER_SEGMENT
    assert max(sz for _, szs in ring.transports[0].messages_sent for sz in szs) <= 1 << 20
    fixed = MemoryRing(world)
    fixed.run(lambda t: ring_allreduce(t, xs[t.rank], timeout=10, chunk_bytes=4096))  # the default: no growth
    assert len(fixed.transports[0].messages_sent) == 2 * (world - 1) * -(-segment_bounds(n, world)[1] // 1024)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_dense_ring_integer_sum_exact_and_fp16_wire(world):
    xs = [np.full(1001, r + 1, np.int64) for r in range(world)]
    ring = MemoryRing(world)
    res = ring.run(lambda t: ring_allreduce(t, xs[t.rank], timeout=10, chunk_bytes=4096))
    assert all(np.all(r == world * (world + 1) // 2) for r in res)
    ys = [np.random.default_rng(r).standard_normal(5000).astype(np.float32) for r in range(world)]
    ring = MemoryRing(world)
    res = ring.run(lambda t: ring_allreduce(t, ys[t.rank], timeout=10, chunk_bytes=4096, wire_dtype=np.float16))
    assert all(r.tobytes() == res[0].tobytes() for r in res)
    assert np.allclose(res[0], np.sum(ys, axis=0), atol=0.02 * world)


def test_dense_ring_message_lost_on_the_way_is_named_not_summed_past():
    """A message lost between two nodes (over TCP: a connection that broke and reconnected) makes
    the receiver fail with the step it expected and what that means, instead of adding the wrong
    chunk; the nodes that wait for it fail by their deadline."""
    ring = MemoryRing(3)
    sent = {"n": 0}
    real_send = ring.transports[0].send

    def lossy(header, buffers=()):
        sent["n"] += 1
        if sent["n"] != 3:  # rank 0's third message never arrives
            real_send(header, buffers)
    ring.transports[0].send = lossy
    xs = [np.ones(10_000, np.float32) for _ in range(3)]

    def run(t):
        try:
            return ring_allreduce(t, xs[t.rank], timeout=2, chunk_bytes=4096)
        except Exception as exc:  # noqa: BLE001 - each rank's outcome is looked at below
            return exc
    res = ring.run(run, timeout=30)
    assert isinstance(res[1], ProtocolError)
    assert "ring out of step: expected rs step 0 chunk 2, got 'rs' step 0 chunk 3 from rank 0" in str(res[1])
    assert "TCP connection between the two daemons broke" in str(res[1])
    assert all(isinstance(r, Exception) for r in res), res  # nobody finished with a wrong sum


def test_segment_bounds_alignment():
    b = segment_bounds(1003, 4, align=8)
    assert b[0] == 0 and b[-1] == 1003 and all(x % 8 == 0 for x in b[:-1])
    assert segment_bounds(2, 4) == [0, 1, 2, 2, 2]


def test_dense_ring_tag_mismatch_fails_everywhere_without_hanging():
    ring = MemoryRing(4)
    xs = [np.ones(100, np.float32) for _ in range(4)]
    errors = []

    def fn(t):
        try:
            ring_allreduce(t, xs[t.rank], timeout=5, tag={"digest": 1 if t.rank != 2 else 2})
        except RoundMismatchError as exc:
            errors.append(str(exc))
            return "mismatch"
        return "ok"

    assert ring.run(fn, timeout=20) == ["mismatch"] * 4
    assert all("digest" in e for e in errors)


@pytest.mark.parametrize("world", range(1, 9))
def test_allgather_payloads_in_rank_order(world):
    ring = MemoryRing(world)

    def fn(t):
        return ring_allgather(t, {"who": t.rank}, [np.full(t.rank + 1, t.rank, np.int32)], timeout=5)

    for got in ring.run(fn):
        for r, (h, bufs) in enumerate(got):
            assert h["who"] == r
            assert np.array_equal(np.frombuffer(bufs[0], np.int32) if not isinstance(bufs[0], np.ndarray) else bufs[0],
                                  np.full(r + 1, r, np.int32))


def test_lost_neighbour_is_an_error_not_a_hang():
    from birdnet.errors import PeerLostError
    ring = MemoryRing(3)
    with pytest.raises(PeerLostError, match="rank"):
        # rank 2 never takes part
        ring.run(lambda t: None if t.rank == 2 else ring_allreduce(t, np.ones(10, np.float32), timeout=0.5),
                 timeout=10)


# -- codec registry ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", __import__("birdnet.codecs", fromlist=["names"]).names())
def test_codec_description_rebuilds_the_same_codec(name):
    """The daemon ships ``describe()`` to the peers, which rebuild the codec from it."""
    from birdnet.codecs import get_codec
    d = get_codec(name).describe()
    again = get_codec(d["codec"], **{k: v for k, v in d.items() if k != "codec"})
    assert again.describe() == d


def test_client_import_does_not_import_numba():
    """Training processes must not pay for the JIT (Numba is imported by the kernel modules, at a codec's first use)."""
    import subprocess
    import sys
    code = ("import sys, birdnet, birdnet.client, birdnet.errors, birdnet.wire; "
            "assert 'numba' not in sys.modules, sorted(m for m in sys.modules if 'numba' in m)[:5]")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_birdnet_codecs_shows_the_recommended_settings(capsys):
    """Not only the defaults' momentum=0.0: what SGD(momentum=0.9) runs each codec with through
    the adapter's recipe, and the recipes per optimizer."""
    from birdnet import cli
    assert cli.main(["codecs"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "momentum=0.9 " in rows["marsit"] and "momentum=0.9 " in rows["birdplus"]
    assert "momentum=0.9, error_feedback=True" in rows["randomk"]
    assert "momentum=0.9" not in rows["qsgd"] and "SGD keeps momentum" in rows["fp16"]
    assert "Adam/AdamW:" in out and "momentum_in_codec=None" in out


def test_codec_parameters_are_validated_without_numba():
    """birdnet.codecs.validate: the daemons' own check (the same CodecError), in a training process
    that never imports Numba or compiles a kernel."""
    import subprocess
    import sys
    code = ("import sys\n"
            "from birdnet.codecs import validate, names\n"
            "from birdnet.errors import CodecError\n"
            "assert validate('birdplus', {'density': 0.05})['density'] == 0.05\n"
            "assert all(isinstance(validate(n), dict) for n in names())\n"
            "for name, params, says in [('birdplus', {'density': 2}, 'density must be a number in (0, 1]'),\n"
            "        ('birdplus', {'gamma': 0.3}, 'gamma must be a multiple of 0.25'),\n"
            "        ('marsit', {'densty': 0.1}, 'has no parameter densty'), ('nope', {}, 'unknown codec')]:\n"
            "    try:\n"
            "        validate(name, params)\n"
            "    except CodecError as exc:\n"
            "        assert says in str(exc), exc\n"
            "    else:\n"
            "        raise AssertionError((name, params))\n"
            "assert 'numba' not in sys.modules, sorted(m for m in sys.modules if 'numba' in m)[:5]\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dense_ring_divides_each_segment_once_on_its_owner(world, dtype):
    """``divide_by`` (the mean) gives exactly the bits of dividing the finished sum everywhere."""
    rng = np.random.default_rng(world)
    xs = [rng.standard_normal(10007).astype(dtype) for _ in range(world)]
    ring = MemoryRing(world)
    summed = ring.run(lambda t: ring_allreduce(t, xs[t.rank], timeout=10, chunk_bytes=4096))
    ring = MemoryRing(world)
    mean = ring.run(lambda t: ring_allreduce(t, xs[t.rank], timeout=10, chunk_bytes=4096, divide_by=world + 2))
    expected = np.divide(summed[0], dtype(world + 2))
    for m in mean:
        assert m.dtype == dtype and m.tobytes() == expected.tobytes()
