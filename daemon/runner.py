"""The core of a round on one node, with no sockets: the round handed over by the service
(:class:`LocalRound`, one :class:`Contribution` per local process), the codec state kept between
rounds (:class:`StateStore`) and the data phase (:class:`RoundRunner`), which runs the ring
algorithm of the round's codec over whatever transport it is given (the ring worker's ZeroMQ
RoundTransport, or a test's MemoryRing).

A round's codec-state change (error feedback, momentum, compensation, a reset) is prepared during
the data phase and applied only by :meth:`RoundRunner.commit`, once the round's outcome is known to
be a success on every node (the ring worker commits after the ring's commit count).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from birdnet.codecs import Pattern, Payload, RoundContext, get_codec
from birdnet.codecs.base import Codec, begin_round, commit_round, pack_buffers
from birdnet.config import Settings
from birdnet.errors import BirdnetError, CodecError, RoundMismatchError, StateLimitError
from birdnet.requests import ANONYMOUS_PREFIX
from birdnet.ring.dense import ring_allreduce
from birdnet.ring.gather import ring_allgather
from birdnet.ring.small import gathered_allreduce, use_gathered
from birdnet.wire import round_key

log = logging.getLogger("birdnet.engine")


#: fields of a round description that must agree on every node
AGREED = ("kind", "name", "shape", "dtype", "op", "codec", "root")


@dataclasses.dataclass
class Contribution:
    session: bytes
    call: int  #: the client's call id, echoed in the reply
    array: np.ndarray  #: view into the process's shared memory: input, then result
    local_index: int
    global_rank: int


@dataclasses.dataclass
class LocalRound:
    job: str
    seq: int
    kind: str  #: allreduce | broadcast | barrier | reset
    desc: dict[str, Any]
    parts: list[Contribution]
    codec_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: BirdnetError | None = None
    ready_at: float = dataclasses.field(default_factory=time.monotonic)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: (session, call id, slot) of every local process, for the replies
    callers: list[Any] = dataclasses.field(default_factory=list)
    #: calls whose ``done`` went through the process's result doorbell (the service's main thread
    #: sends the others over the client socket)
    delivered: set[int] = dataclasses.field(default_factory=set)
    #: what the round changes in the codec state, applied only once its outcome is known to be a
    #: success everywhere (RoundRunner.commit); a failed round drops it
    commit_state: Callable[[], None] | None = None
    #: (job, seq, key) of the last ``key`` asked: the ring thread asks it a dozen times a round
    _key: tuple[str, int, str] | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def key(self) -> str:
        k = self._key
        if k is None or k[1] != self.seq or k[0] != self.job:  # seq changes (RingWorker._align)
            k = self._key = (self.job, self.seq, round_key(self.job, self.seq))
        return k[2]


@dataclasses.dataclass
class CodecState:
    """One tensor's codec state in the :class:`StateStore`."""

    codec_key: str  #: the codec's description and the tensor's size: a change starts a new state
    state: Any
    rounds: int  #: rounds since the state was made (the codec's ``tensor_round``)
    nbytes: int
    last_use: int  #: StateStore.uses when a round last asked for it (the least recently used goes first)


class StateStore:
    """Codec state per (job, tensor name), with a memory cap (``state_limit_bytes``).

    When a new state would take the total over the cap, the states used least recently are
    dropped (their tensors' next rounds start from empty state, as after ``reset_state``) until it
    fits; only a state larger than the cap alone fails its round (StateLimitError). "Recently" is
    counted in codec rounds run on this daemon, and every node runs the same rounds in the same
    (agreed) order with the same cap (state_limit_bytes is cluster-wide), so every node drops the
    same states at the same round and results stay bit-identical. A node that restarted, or a
    round that failed on some nodes only before its compression, breaks that symmetry as it
    breaks the states themselves (the residuals differ); ``reset_state`` makes them equal again.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.states: dict[tuple[str, str], CodecState] = {}
        #: job -> why its codec state on this node may differ from the other nodes' (a state change
        #: that failed after the round's release): every round of the job fails until a reset
        self.diverged: dict[str, str] = {}
        self.uses = 0  #: codec rounds that asked for state: the clock of "least recently used"
        self.evicted = 0  #: states dropped to stay under the cap
        self.evicted_bytes = 0

    def get(self, job: str, name: str, codec, n: int) -> tuple[Any, int]:
        """The state for this tensor (new if the codec or size changed) and its round count."""
        self.uses += 1
        if name.startswith(ANONYMOUS_PREFIX):
            return codec.new_state(n), 0  # for this round only (the service warns the process)
        key = (job, name)
        ckey = f"{sorted(codec.describe().items())!r}/{n}"
        cur = self.states.get(key)
        if cur is not None and cur.codec_key == ckey:
            cur.last_use = self.uses
            return cur.state, cur.rounds
        state = codec.new_state(n)
        nb = codec.state_nbytes(state)
        if nb > self.limit:
            raise StateLimitError(
                f"codec state for tensor {name!r} of job {job!r} needs {nb} bytes, more than "
                f"state_limit_bytes={self.limit} on its own; raise the limit or use a stateless codec for it")
        self.states.pop(key, None)
        total = self.total_bytes() + nb
        if total > self.limit:
            for old_key, old in sorted(self.states.items(), key=lambda kv: kv[1].last_use):
                del self.states[old_key]
                total -= old.nbytes
                self.evicted += 1
                self.evicted_bytes += old.nbytes
                log.warning("codec state of tensor %r of job %r (%d bytes, unused for %d codec rounds) dropped to "
                            "make room for tensor %r under state_limit_bytes=%d; its next round starts from empty "
                            "state", old_key[1], old_key[0], old.nbytes, self.uses - old.last_use, name, self.limit)
                if total <= self.limit:
                    break
        self.states[key] = CodecState(ckey, state, 0, nb, self.uses)
        return state, 0

    def advance(self, job: str, name: str) -> None:
        if (job, name) in self.states:
            self.states[(job, name)].rounds += 1

    def reset(self, job: str) -> int:
        self.diverged.pop(job, None)  # every node starts the job from empty state again
        keys = [k for k in self.states if k[0] == job]
        for k in keys:
            del self.states[k]
        return len(keys)

    def clear(self) -> int:
        """Drop every state (a new elastic membership epoch); returns how many there were."""
        n = len(self.states)
        self.states.clear()
        self.diverged.clear()
        return n

    def mark_diverged(self, job: str, why: str) -> None:
        """The job's codec state on this node no longer matches the other nodes' (see
        :meth:`RoundRunner.commit_released`): its states here are dropped, and :meth:`divergence`
        names it until the job's state is reset on every node."""
        self.diverged[job] = why
        for k in [k for k in self.states if k[0] == job]:
            del self.states[k]

    def divergence(self, job: str) -> str | None:
        """Why the job's rounds must fail on this node (None: they may run)."""
        return self.diverged.get(job)

    def total_bytes(self) -> int:
        return sum(v.nbytes for v in self.states.values())

    def per_job(self) -> dict[str, dict[str, int]]:
        """job -> {"tensors": how many states, "bytes": their size}, for status."""
        out: dict[str, dict[str, int]] = {}
        for (job, _name), v in list(self.states.items()):  # the ring worker may add one meanwhile
            j = out.setdefault(job, {"tensors": 0, "bytes": 0})
            j["tensors"] += 1
            j["bytes"] += v.nbytes
        return out


def description_digest(desc: dict[str, Any], count: int) -> str:
    """A short digest of what an agreement compares (AGREED) and this node's process count, for
    compressed lane rounds: their payloads are small, and the whole description in every message
    would be a noticeable share of the bytes (a dense lane round's messages carry it in full)."""
    text = repr([desc.get(f) for f in AGREED] + [count])
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def seed_for(cluster_seed: int, job: str, seq: int, name: str) -> int:
    h = hashlib.blake2b(f"{cluster_seed}/{job}/{seq}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class RoundRunner:
    """Executes the data phase of one round on this node, given a transport. Used by the ring
    worker with the ZeroMQ transport and by tests with :class:`MemoryRing`."""

    def __init__(self, settings: Settings, states: StateStore) -> None:
        self.settings, self.states = settings, states

    def run(self, rnd: LocalRound, transport, rank: int, world: int, counts: list[int] | None,
            defer_commit: bool = False) -> None:
        """Run ``rnd``'s data phase. ``counts`` are the agreed process counts per node; a lane round
        (a dense all-reduce started without an agreement, see RingWorker) has none (``None``) and
        learns their total from the ring. ``defer_commit``: the round's codec-state change waits in
        ``rnd.commit_state`` for :meth:`commit` (the ring worker commits once every node holds the
        result); else it is committed here."""
        diverged = self.states.divergence(rnd.job) if rnd.kind != "reset" else None
        if diverged is not None:  # a round agreed before the state diverged (commit_released)
            raise CodecError(diverged)
        self._run(rnd, transport, rank, world, counts)
        if not defer_commit:
            self.commit(rnd)

    @staticmethod
    def commit(rnd: LocalRound) -> None:
        """Apply the round's codec-state change (error feedback, momentum, compensation, a reset)."""
        f, rnd.commit_state = rnd.commit_state, None
        if f is not None:
            f()

    def commit_released(self, rnd: LocalRound, rank: int) -> str | None:
        """Apply the codec-state change of a round whose result every node has released already; the
        reason when it failed (logged here), else None.

        The other nodes applied theirs, so a failure here leaves this node's state of the job
        different from theirs, and every later round of a stateful codec would sum contributions
        compressed against states the nodes do not share: results would differ in silence. Failing
        the job's later rounds keeps every node's results bit-identical: this node fails each of them
        in its description before any agreement (RingWorker._take_inbox), so the leader's verdict
        fails it on every node with the reason, until ``client.reset_state()`` (a round every node
        runs) starts the job's state from empty everywhere. Skipping the change instead, or keeping
        the half-applied state, would let the next rounds succeed with a state no other node has."""
        try:
            self.commit(rnd)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the state unknown
            log.exception("round %s: its codec-state change failed on this node", rnd.key)
            why = (f"the codec state of job {rnd.job!r} on node rank {rank} failed to apply round {rnd.key}'s "
                   f"change after the round's result was released ({exc!r}), so it may differ from the other "
                   "nodes'; every call of the job fails until client.reset_state() resets it on every node")
            self.states.mark_diverged(rnd.job, why)
            return why
        return None

    def _run(self, rnd: LocalRound, transport, rank: int, world: int, counts: list[int] | None) -> None:
        t0 = time.perf_counter()
        c0 = time.process_time()  # the whole daemon process: ring thread, ZeroMQ I/O thread, service
        lane = counts is None
        total = sum(counts) if counts is not None else len(rnd.parts)
        st = rnd.stats
        # monotonic marks (one clock for all the namespaces of a machine): where a round's time goes
        now = time.monotonic()
        st.update(count=total, codec="none", compress_seconds=0.0, bytes_sent=0, bytes_received=0,
                  wait_seconds=now - rnd.ready_at, t_ready=rnd.ready_at, t_data=now)
        if rnd.kind == "reset":
            def reset() -> None:
                st["states_dropped"] = self.states.reset(rnd.job)
            rnd.commit_state = reset
            return
        if rnd.kind == "barrier":
            return
        d = rnd.desc
        dtype = np.dtype(d["dtype"])
        n = math.prod(d["shape"])
        work_dtype = np.dtype(np.float32) if dtype == np.float16 else dtype
        parts = sorted(rnd.parts, key=lambda p: p.local_index)
        # Local reduction, in local-rank order (a fixed order keeps nodes identical run to run).
        if rnd.kind == "broadcast":
            root = [p for p in parts if p.global_rank == d["root"]]
            x = root[0].array.reshape(-1).astype(work_dtype) if root else np.zeros(n, work_dtype)
        elif len(parts) == 1 and work_dtype == dtype:
            x = parts[0].array.reshape(-1)  # in place in the process's shared memory: no copy
        else:
            x = parts[0].array.reshape(-1).astype(work_dtype)
            for p in parts[1:]:
                x += p.array.reshape(-1)
        codec_name = d["codec"]["codec"] if isinstance(d.get("codec"), dict) else "none"
        before_s, before_r = transport.bytes_sent, transport.bytes_received
        mean = d["op"] == "mean" and rnd.kind == "allreduce"
        divided = False
        if lane and codec_name != "none":
            # A compressed lane round (daemon/lane.py lane_eligible): every node has local_size
            # processes (a cluster-wide setting, checked in the handshake), so the counts an
            # agreement would bring are this node's count everywhere; the data carries the
            # description and the count, and the ring checks them as it checks a dense lane round's.
            counts = [len(parts)] * world
            total = st["count"] = sum(counts)
            dst = parts[0].array.reshape(-1) if (len(parts) == 1 and dtype == np.float32) else None
            lane_tag = {"key": rnd.key, "name": d.get("name"), "desc": description_digest(d, len(parts))}
            try:
                out, divided = self._run_codec(rnd, transport, x.astype(np.float32, copy=False), rank, world,
                                               counts, dst, lane_tag=lane_tag, mean=mean)
            except RoundMismatchError as exc:
                raise RoundMismatchError(
                    f"{exc} (a round started without an agreement: the nodes' descriptions of tensor "
                    f"{d.get('name')!r}, i.e. shape, dtype, op, codec and its parameters, and process "
                    "count, differ; every process of the job must make the same call)") from None
        elif lane:
            learned: dict[str, Any] = {}
            out = self._dense(transport, x, world, timeout=self.settings.round_wait_timeout,
                              tag={"key": rnd.key, **{f: d.get(f) for f in AGREED}},
                              count=len(parts), mean=mean, learned=learned)
            divided = mean
            total = st["count"] = int(learned["count"])
        elif codec_name == "none" or rnd.kind == "broadcast":
            # the mean's one division happens inside the ring, on each segment's owner
            divided = mean and dtype.kind == "f"
            out = self._dense(transport, x, world, timeout=self.settings.peer_timeout, tag={"key": rnd.key},
                              divide_by=total if divided else None)
        else:
            # With one local float32 process the result goes straight into its shared memory (the
            # codecs read x only while compressing, and never send from it).
            dst = parts[0].array.reshape(-1) if (len(parts) == 1 and dtype == np.float32
                                                 and rnd.kind == "allreduce") else None
            out, divided = self._run_codec(rnd, transport, x.astype(np.float32, copy=False), rank, world,
                                           counts, dst, mean=mean)
        flush = getattr(transport, "flush", None)
        if flush is not None:  # zero-copy sends must be done before ``out`` is touched again
            flush(self.settings.peer_timeout)
        st["bytes_sent"] = transport.bytes_sent - before_s
        st["bytes_received"] = transport.bytes_received - before_r
        st["codec"] = codec_name
        dense = 2 * (world - 1) / world * n * dtype.itemsize if world > 1 else 0
        st["ratio"] = (dense / st["bytes_sent"]) if st["bytes_sent"] else (1.0 if dense == 0 else float("inf"))
        if mean and not divided:
            # one division by the processes that really contributed, the same IEEE op on every node
            np.divide(out, out.dtype.type(total), out=out)
        for p in parts:
            dst = p.array.reshape(-1)
            if dst.size and not np.shares_memory(dst, out):
                np.copyto(dst, out, casting="unsafe")
        st["seconds"] = time.perf_counter() - t0
        st["cpu_seconds"] = time.process_time() - c0
        st["t_end"] = time.monotonic()

    def _dense(self, transport, x: np.ndarray, world: int, *, inplace: bool = True, **kw: Any) -> np.ndarray:
        """Sum ``x`` over the round's ring: gathered in N-1 hops when it is small enough to gain by
        it (birdnet.ring.small.use_gathered: every node decides alike from the round's agreed size
        and cluster-wide settings), else the chunked ring, in place in ``x`` when ``inplace``. The
        gathered sum is a new array, copied into the processes' memory once the sends are done."""
        s = self.settings
        if use_gathered(x.nbytes, world, s.hop_latency_bytes, s.chunk_bytes):
            return gathered_allreduce(transport, x, **kw)
        return ring_allreduce(transport, x, chunk_bytes=s.chunk_bytes, max_chunk_bytes=s.max_chunk_bytes,
                              inplace=inplace, **kw)

    def _run_codec(self, rnd: LocalRound, transport, x: np.ndarray, rank: int, world: int,
                   counts: list[int], dst: np.ndarray | None = None,
                   lane_tag: dict[str, Any] | None = None, mean: bool = False) -> tuple[np.ndarray, bool]:
        """A compressed round. ``lane_tag``: a lane round's description, carried by every message
        and checked on arrival (no agreement came before it); its waits for data are waits for the
        other nodes' processes too (round_timeout). A lane round given up leaves the codec state as
        it was (nothing is committed before the round completes, StateTxn), so it runs again once
        agreed exactly as if it had never started. ``mean``: the result is to be divided by the
        processes' total; returns the result and whether that division is done already (a gathered
        codec's sum divides in the same pass when the codec keeps no use for the sum, after_round)."""
        d = rnd.desc
        divided = False
        params = {k: v for k, v in d["codec"].items() if k != "codec"}
        codec = get_codec(d["codec"]["codec"], **params)
        committed, tensor_round = self.states.get(rnd.job, d["name"], codec, x.size)
        # the codec changes a scratch view; only a round that completes here commits it (StateTxn)
        state = begin_round(committed)
        ctx = RoundContext(job=rnd.job, name=d["name"], shape=tuple(d["shape"]), round_id=rnd.seq,
                           rank=rank, world=world,
                           seed=seed_for(self.settings.cluster_seed, rnd.job, rnd.seq, d["name"]),
                           local_count=counts[rank], total_count=sum(counts), tensor_round=tensor_round,
                           counts=tuple(counts))
        timeout = self.settings.peer_timeout
        if lane_tag is not None:
            timeout += self.settings.round_timeout
        extra = dict(lane_tag or {})
        tc = time.perf_counter()
        n = x.size
        if codec.pattern == Pattern.SUMMABLE:
            payload = codec.compress(x, ctx, state)
            comp = time.perf_counter() - tc
            values = np.ascontiguousarray(payload.values, dtype=np.float32)
            tag = {**extra, "key": rnd.key, "len": int(values.size), "digest": payload.header.get("digest")}
            wire = codec.wire_format(ctx, state)
            if wire is not None:  # encoded at every hop (lowbit): the ring, whatever the size
                summed = ring_allreduce(transport, values, timeout=timeout, chunk_bytes=self.settings.chunk_bytes,
                                        max_chunk_bytes=self.settings.max_chunk_bytes, wire=wire, tag=tag,
                                        inplace=values is not x)
            elif codec.wire_dtype is None or np.dtype(codec.wire_dtype) == values.dtype:
                summed = self._dense(transport, values, world, timeout=timeout, tag=tag, inplace=False)
            else:  # a narrower wire dtype: the ring rounds partial sums to it as the codec expects
                summed = ring_allreduce(transport, values, timeout=timeout, chunk_bytes=self.settings.chunk_bytes,
                                        max_chunk_bytes=self.settings.max_chunk_bytes, wire_dtype=codec.wire_dtype,
                                        tag=tag)
            tc = time.perf_counter()
            out = dst if dst is not None else np.empty(n, np.float32)
            codec.decompress(Payload(header=payload.header, values=summed), out, ctx, state)
        elif codec.pattern == Pattern.GATHERED:
            payload = codec.compress(x, ctx, state)
            comp = time.perf_counter() - tc
            header, bufs = pack_buffers(payload)
            got = ring_allgather(transport, header, bufs, timeout=timeout, tag={**extra, "key": rnd.key})
            tc = time.perf_counter()
            out = dst if dst is not None else np.empty(n, np.float32)  # decompress_sum writes all of it
            payloads = []
            for r in range(world):  # rank order: the same sum, bit for bit, on every node
                h, b = got[r]
                views = [memoryview(np.ascontiguousarray(a)).cast("B") if isinstance(a, np.ndarray) else a for a in b]
                payloads.append(codec.payload_from_wire(h, views))
            divided = mean and type(codec).after_round is Codec.after_round
            codec.decompress_sum(payloads, out, ctx, divide_by=ctx.total_count if divided else 0)
        elif codec.pattern == Pattern.MERGED:
            # imported here: birdnet.ring.merge compiles its Numba kernels on import, seconds at
            # daemon start that a daemon whose jobs never use a merged codec should not pay
            from birdnet.ring.merge import merged_allreduce
            comp = 0.0
            # merged_allreduce runs the codec's after_round / after_flush itself, and divides as it
            # decodes when the codec keeps no use for the sum
            divided = mean and not codec.needs_result_sum
            out = merged_allreduce(transport, codec, x, ctx, state, timeout=timeout, out=dst, tag=lane_tag,
                                   divide_by=ctx.total_count if divided else 0)
        else:  # pragma: no cover - a codec declaring something else is a programming error
            raise CodecError(f"codec {codec.name!r} declares unknown pattern {codec.pattern!r}")
        if codec.pattern != Pattern.MERGED:
            codec.after_round(state, out, ctx)

        def commit() -> None:
            commit_round(state)
            self.states.advance(rnd.job, d["name"])
        rnd.commit_state = commit
        rnd.stats["compress_seconds"] = comp + (time.perf_counter() - tc)
        rnd.stats["state_bytes"] = self.states.total_bytes()
        return out, divided
