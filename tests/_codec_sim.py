"""A simulated round on in-process "nodes" (no network): GATHERED payloads go through
pack_buffers -> bytes -> payload_from_wire -> decompress_add in rank order; SUMMABLE values are
summed (rounded to float16 at the wire when the codec says so), or, for a codec with a wire
format (lowbit), summed by the real ring over an in-memory transport, and decompressed."""
from __future__ import annotations

import numpy as np
import pytest

from birdnet.codecs import Pattern, Payload, RoundContext
from birdnet.codecs.base import pack_buffers
from birdnet.errors import BirdnetError, ProtocolError
from birdnet.ring.dense import ring_allreduce
from birdnet.ring.transport import MemoryRing


def contexts(n, world=4, rnd=0, seed=1234, shape=None):
    return [RoundContext(job="j", name="t", shape=shape or (n,), round_id=rnd, rank=r, world=world,
                         seed=seed + 7919 * rnd, tensor_round=rnd) for r in range(world)]


def sim_round(codec, xs, states, rnd=0, seed=1234):
    n = xs[0].shape[0]
    cs = contexts(n, len(xs), rnd, seed)
    pays = [codec.compress(x, c, s) for x, c, s in zip(xs, cs, states)]
    outs = []
    wires = [codec.wire_format(c, s) for c, s in zip(cs, states)] if codec.pattern == Pattern.SUMMABLE else []
    if wires and wires[0] is not None:
        sums = MemoryRing(len(xs)).run(lambda t: ring_allreduce(t, pays[t.rank].values, timeout=30.0,
                                                                 wire=wires[t.rank], chunk_bytes=4096))
        for c, s, tot in zip(cs, states, sums):
            out = np.empty(n, np.float32)
            codec.decompress(Payload(header=dict(pays[0].header), values=tot), out, c, s)
            outs.append(out)
    elif codec.pattern == Pattern.SUMMABLE:
        tot = np.zeros_like(pays[0].values)
        for p in pays:
            v = p.values.astype(np.float16).astype(np.float32) if codec.wire_dtype == "float16" else p.values
            tot = (tot + v).astype(np.float32)
        for c, s in zip(cs, states):
            out = np.empty(n, np.float32)
            codec.decompress(Payload(header=dict(pays[0].header), values=tot.copy()), out, c, s)
            outs.append(out)
    else:
        wire = []
        for p in pays:
            h, bufs = pack_buffers(p)
            wire.append((h, [b.tobytes() for b in bufs]))
        for c in cs:
            out = np.zeros(n, np.float32)
            for h, bufs in wire:
                codec.decompress_add(codec.payload_from_wire(dict(h), [memoryview(b) for b in bufs]), out, c)
            outs.append(out)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])  # every node bit-identical
    for c, s in zip(cs, states):
        codec.after_round(s, outs[0], c)
    return outs[0], pays


def wire_ring(xs, wires, chunk_bytes=256, tags=None):
    """Sum ``xs`` (one array per rank) through the real ring over an in-memory transport, each
    rank with its own wire format; returns (results, bytes sent by each rank)."""
    world = len(xs)
    mr = MemoryRing(world)
    tags = tags or [{}] * world
    outs = mr.run(lambda t: ring_allreduce(t, xs[t.rank], timeout=30.0, wire=wires[t.rank],
                                           chunk_bytes=chunk_bytes, tag=tags[t.rank]))
    return outs, [t.bytes_sent for t in mr.transports]


def assert_mismatched_wires_fail(xs, wires):
    """A rank whose wire format differs from its neighbours' fails the round with a ProtocolError
    about the bytes (every rank raises; none hangs)."""
    errors = []

    def node(t):
        try:
            return ring_allreduce(t, xs[t.rank], timeout=2.0, wire=wires[t.rank])
        except BirdnetError as exc:
            errors.append(exc)
            raise

    with pytest.raises(BirdnetError):
        MemoryRing(len(xs)).run(node, timeout=30.0)
    assert any(isinstance(e, ProtocolError) and "bytes" in str(e) for e in errors)
