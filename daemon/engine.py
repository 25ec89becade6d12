"""The ring worker: the one thread that owns the peer sockets and runs rounds, one at a time.

The round runner, the codec-state store and the ring worker's agreement, batches, aborts and dense
lane live together because they share the worker's round table (ready, order, aborted, lane) and run
on its one thread. One RingWorker runs both rings: who is in a round, who leads, what travels on
start / go, liveness and joins are its membership (daemon/membership.py: FixedRing;
daemon/elastic.py: ElasticRing).

Rounds reach it from the service thread once every local process of the job has submitted
(:class:`LocalRound`). Across nodes, the order of rounds is the leader's (rank 0 on the fixed
ring): it sends a ``start`` naming the round; each node appends its description once its own
processes are ready and passes it on; when the start is back, the leader compares the descriptions
and sends ``go`` with its verdict. Every node therefore runs the same rounds in the same order, and a disagreement (shape,
codec, a process that never came) fails the round everywhere with one message instead of hanging.

The dense lane. The agreement costs two trips round the ring before any data moves (3-5 ms on
4-8 nodes here), which Gloo, whose processes simply start sending, does not pay. So after a job's
round was agreed, the leader's ``go`` opens a lane for the job's next round: each node starts it the
moment its processes submit it, if it is an all-reduce, dense or compressed (a codec without
flush rounds: RingWorker._lane_eligible), and the data carries what the agreement would have (the
description, checked by the ring; the process counts, summed by it, or for a compressed round
``local_size`` on every node, a cluster-wide setting, carried and checked too). A compressed lane
round given up changed no codec state (only a completed round commits it), so it runs again once
agreed as if it had never started. The lane moves on with every lane round. It
closes when the leader wants anything else (another job's round, or this job's next round is a
barrier, a broadcast or a codec with flush rounds): a ``lane`` message naming the
round goes round the ring ahead of the leader's next ``start``, and a node already in that round
gives it up and runs it again once it is agreed. That is safe because a round writes a node's
buffers only when a message that passed through every node arrives (ring_allreduce keeps its
partial sums out of them; the compressed rings write the result once every node's part is
there), and the leader sends no data for a round it closed the lane before. Any failure, a
lost peer or a restarted neighbour closes the lane too; a lane round in progress that learns of
the failure of an earlier round of its job is given up and agreed like the others
(docs/architecture.md, "The dense lane").

Every round on the fixed ring ends with a commit (RoundTransport.await_commit): a node answers its
processes and applies the round's codec-state change only once its left neighbour's ``commit``
count says every node holds the result, so no node releases a result another will fail
(docs/reliability.md, "All-or-nothing rounds").
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from birdnet.daemon import settle
from birdnet.daemon.membership import FixedRing, LaneGivenUp, RoundAborted, RoundRetry, check_descs
from birdnet.daemon.rounds import Phase, Round
from birdnet.daemon.transport import RoundTransport

from birdnet.codecs import Pattern, Payload, RoundContext, get_codec
from birdnet.codecs.base import Codec, begin_round, commit_round, pack_buffers
from birdnet.config import Settings
from birdnet.errors import (
    BirdnetError,
    CodecError,
    InputError,
    PeerLostError,
    ProtocolError,
    RoundMismatchError,
    RoundTimeoutError,
    ShutdownError,
    StateLimitError,
    from_wire,
)
from birdnet.messages import Abort, Verdict, extend_batch, is_int, verdicts_of_go
from birdnet.osutil import name_os_thread
from birdnet.requests import ANONYMOUS_PREFIX
from birdnet.ring.dense import ring_allreduce
from birdnet.ring.gather import ring_allgather
from birdnet.ring.small import gathered_allreduce, use_gathered
from birdnet.ring.transport import MemoryRing
from birdnet.wire import round_key, split_key

log = logging.getLogger("birdnet.engine")

#: rounds agreed in one start/go exchange at most (a training step's tensors, typically)
MAX_BATCH = 32
#: aborts kept for a right neighbour that cannot take them yet (RingWorker._abort)
MAX_UNSENT_ABORTS = 256

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

    @property
    def key(self) -> str:
        return round_key(self.job, self.seq)


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
        keys = [k for k in self.states if k[0] == job]
        for k in keys:
            del self.states[k]
        return len(keys)

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


def error_class(descs: list[tuple[int, dict[str, Any]]]) -> str:
    """The error class a failed round is reported with: the first node's own error class (e.g.
    InputError for NaN under nan_policy='reject'), else a mismatch."""
    for _r, d in descs:
        if d.get("error"):
            return str(d.get("error_class") or "InputError")
    return "RoundMismatchError"


def describe_difference(descs: list[tuple[int, dict[str, Any]]]) -> str | None:
    """None when all descriptions agree; else a message naming the tensor, ranks and fields."""
    errors = [f"node rank {r}: {d['error']}" for r, d in descs if d.get("error")]
    if errors:
        return "; ".join(errors)
    r0, d0 = descs[0]
    diffs = []
    for r, d in descs[1:]:
        for f in AGREED:
            if d.get(f) != d0.get(f):
                diffs.append(f"{f} is {d0.get(f)!r} on node rank {r0} but {d.get(f)!r} on node rank {r}")
    if not diffs:
        return None
    return f"round for tensor {d0.get('name')!r} does not match across nodes: " + "; ".join(diffs)


def description_digest(desc: dict[str, Any], count: int) -> str:
    """A short digest of what an agreement compares (AGREED) and this node's process count, for
    compressed lane rounds: their payloads are small, and the whole description in every message
    would be a noticeable share of the bytes (a dense lane round's messages carry it in full)."""
    import hashlib
    text = repr([desc.get(f) for f in AGREED] + [count])
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def seed_for(cluster_seed: int, job: str, seq: int, name: str) -> int:
    h = hashlib.blake2b(f"{cluster_seed}/{job}/{seq}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class Tombstone(NamedTuple):
    """A round aborted somewhere in the ring (RingWorker.aborted)."""

    error_class: str
    message: str
    at: float  #: monotonic time it was remembered: forgotten after round_wait_timeout


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
        self._run(rnd, transport, rank, world, counts)
        if not defer_commit:
            self.commit(rnd)

    @staticmethod
    def commit(rnd: LocalRound) -> None:
        """Apply the round's codec-state change (error feedback, momentum, compensation, a reset)."""
        f, rnd.commit_state = rnd.commit_state, None
        if f is not None:
            f()

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
            # A compressed lane round (RingWorker._lane_eligible): every node has local_size
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
            if codec.wire_dtype is None or np.dtype(codec.wire_dtype) == values.dtype:
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


class RingWorker(threading.Thread):
    """Owns the :class:`~birdnet.daemon.peers.PeerNet` (or runs alone in a one-node ring). One
    engine for both rings: who is in a round, who leads and what travels on start / go is the
    net's ``membership`` (daemon/membership.py: FixedRing, or elastic.py's ElasticRing)."""

    def __init__(self, settings: Settings, rank: int, world: int, net, runner: RoundRunner,
                 done: Callable[[LocalRound], None]) -> None:
        super().__init__(name="birdnet-ring", daemon=True)
        self.settings, self.rank, self.world, self.net = settings, rank, world, net
        membership = getattr(net, "membership", None)
        if membership is None:  # a one-node ring, or a test's stand-in net
            membership = FixedRing(settings, rank, world)
            membership.bind(net)
        self.membership = membership
        self.runner, self.done = runner, done
        self.inbox: queue.Queue[LocalRound | None] = queue.Queue()
        self.ready: dict[str, LocalRound] = {}
        self.order: list[str] = []
        self.stopping = False
        self.rounds_done = 0
        self.rounds_failed = 0
        self.agreements = 0  #: start/go exchanges this node took part in (several rounds each)
        self.last_round_seconds = 0.0
        self.pending_start: dict | None = None
        #: job -> why its rounds cannot complete on this node (a local process left); written by the
        #: service thread, read here (single dict operations, atomic under the GIL)
        self.departed: dict[str, tuple[str, int]] = {}  # job -> (why, first call affected)
        #: job -> (why, first call affected) for a process of the job lost on *another* node (a
        #: ``ProcessLostError`` abort): the job's later calls here fail at once instead of waiting
        #: for a leader that will never start them. Cleared like ``departed`` (a new process joins)
        self.departed_elsewhere: dict[str, tuple[str, int]] = {}
        #: (job, first call affected) of processes lost here without saying goodbye (killed, crashed),
        #: appended by the service thread: told to the ring once (_announce_departure)
        self.lost_processes: list[tuple[str, int]] = []
        #: aborts the right neighbour could not take yet (its socket reconnecting), with when
        self._unsent_aborts: list[tuple[Abort, float]] = []
        #: round key -> when _repeat_aborts last told the ring again
        self._repeated: dict[str, float] = {}
        #: job -> the highest call number this node's processes submitted (the cluster's numbering):
        #: a start for a lower number that is not waiting here names a call that already ended here
        self.submitted: dict[str, int] = {}
        #: rounds aborted anywhere in the ring, also those this node has not reached yet (a node that
        #: alone saw a peer lost, a neighbour restarted, a failed data phase): key -> (error class,
        #: message, monotonic time). A round with such a key fails at once when it is submitted or
        #: started here, so no node waits round_timeout for an agreement that cannot come.
        self.aborted: dict[str, Tombstone] = {}
        #: jobs whose processes on this node all left and came back (a new incarnation may number its
        #: rounds from 0 again): their aborted keys are dropped. Appended by the service thread.
        self.restarted_jobs: list[str] = []
        #: (job, seq) of the round that may start here without an agreement (the module docstring)
        self.lane: tuple[str, int] | None = None
        self.lane_since = 0  #: net.neighbour_restarts when the lane opened: a restart closes it
        self.lane_allowed = membership.lane_allowed()
        self.lane_rounds = 0  #: rounds run in the lane
        self.lanes_given_up = 0  #: lane rounds given up here because the leader closed the lane
        self.lane_running: str | None = None  #: the lane round in its data phase here
        self.lane_closed_at: Any = None  #: the round key of the leader's last ``lane`` close seen here
        #: a round that settled its commit among the surviving nodes (settlement hook, _open_lane)
        self.settled_at: str | None = None
        if net is not None and self.lane_allowed:
            net.on_lane = self._on_lane_message
        #: rounds end with a commit (RoundTransport.await_commit): every node holds the result before
        #: any releases it. The fixed ring only (elastic mode re-forms its ring instead)
        self.commits = "commit" in getattr(membership, "message_types", ()) and hasattr(net, "commits")
        #: the main loop's handlers of control messages between rounds (a ``lane`` message is
        #: handled as PeerNet.poll receives it, _on_lane_message; data between rounds is stale)
        self._handlers: dict[str, Callable[[dict[str, Any]], bool]] = {
            "start": self.handle_start, "abort": self.handle_abort}

    # -- plumbing ---------------------------------------------------------------------------------
    def submit(self, rnd: LocalRound) -> None:
        self.inbox.put(rnd)

    def stop(self) -> None:
        self.stopping = True
        if self.net is not None:
            self.net.stopping = True  # a round in its data phase stops waiting for the ring
        self.inbox.put(None)

    def status(self) -> dict[str, Any] | None:
        """The membership's part of ``birdnet status`` (elastic mode's epoch, members, leader)."""
        return self.membership.status()

    def _take_inbox(self, timeout: float = 0.0) -> None:
        while self.restarted_jobs:
            self._forget_job(self.restarted_jobs.pop(0))
        while self.lost_processes:
            self._announce_departure(*self.lost_processes.pop(0))
        if self._unsent_aborts:
            self._resend_aborts()
        try:
            item = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        offsets = self.membership.offsets
        while True:
            if item is not None:
                item.seq += offsets.get(item.job, 0)  # this node's call numbering -> the cluster's
            if item is not None and item.key in self.ready:
                # The service refuses a call number used twice; should one get here anyway, the
                # round already held must not be overwritten (its key twice in order: KeyError).
                item.error = InputError(f"round {item.key} is already in flight on node rank {self.rank}")
                self.rounds_failed += 1
                self.done(item)
            elif item is not None:
                self.ready[item.key] = item
                self.order.append(item.key)
                if item.seq > self.submitted.get(item.job, -1):
                    self.submitted[item.job] = item.seq
                t = self._tombstone(item.key)
                if t is not None:
                    self._finish(item, from_wire({"error": t.error_class, "message": t.message}))
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _announce_departure(self, job: str, first: int) -> None:
        """Tell the ring that a process of ``job`` was lost on this node before its call ``first``:
        every node then fails the job's later calls at once (ProcessLostError) until the job's
        processes are restarted. Without it, a node whose processes waited for a start the leader
        never sends (the leader's own process was the one lost) waited round_timeout. Only for a
        process lost without a goodbye: a job that ends normally leaves nothing behind that could
        meet its next run."""
        if self.net is None or self.world == 1 or job not in self.departed:
            return
        key = round_key(job, first + self.membership.offsets.get(job, 0))
        reason = f"node rank {self.rank}: {self.departed[job][0]}"
        self._remember_failed(key, "ProcessLostError", reason)
        self._abort(key, reason, cls="ProcessLostError")

    def _note_departure_elsewhere(self, key: str, reason: str) -> None:
        """A ``ProcessLostError`` abort of round ``key``: a process of its job left another node at
        that call, so no later call of the job can complete either. Applied only while this node's
        processes of the job are at that call or past it, so a stale abort of a run that ended
        cannot doom a new run of the same job (which numbers its calls from 0 again)."""
        parsed = split_key(key)
        if parsed is None:
            return
        job, seq = parsed
        if job not in self.submitted or self.submitted[job] < seq - 1 - MAX_BATCH:
            return
        cur = self.departed_elsewhere.get(job)
        if cur is None or cur[1] > seq:
            if len(self.departed_elsewhere) >= 1024:
                self.departed_elsewhere.pop(next(iter(self.departed_elsewhere)))
            self.departed_elsewhere[job] = (reason, seq)
        for k in list(self.order):
            r = self.ready[k]
            if r.job == job and r.seq > seq:
                self._finish(r, from_wire({"error": "ProcessLostError", "message": reason}))

    def _forget_job(self, job: str) -> None:
        """The job's processes on this node all left and a new one came: its call numbering starts
        again, so what this node remembers of its rounds by number goes."""
        self.submitted.pop(job, None)
        self.departed_elsewhere.pop(job, None)
        prefix = job + "/"
        for k in [k for k in self.aborted if k.startswith(prefix)]:
            del self.aborted[k]
        if self.lane is not None and self.lane[0] == job:
            self._close_lane()  # its numbering starts again: the leader agrees its next round
        self.membership.forget_job(job)

    def _tombstone(self, key: str) -> Tombstone | None:
        t = self.aborted.get(key)
        if t is not None and time.monotonic() - t.at > self.settings.round_wait_timeout:
            del self.aborted[key]
            return None
        return t

    def _remember_failed(self, key: str, cls: str, message: str) -> None:
        self.aborted.pop(key, None)
        self.aborted[key] = Tombstone(cls, message, time.monotonic())
        while len(self.aborted) > 4096:
            self.aborted.pop(next(iter(self.aborted)))

    def _departed_before(self, key: str) -> str | None:
        """Why this node's processes of round ``key``'s job can never submit it (they left before
        that call), else None. Call numbers are the cluster's: the membership's offsets (an elastic
        joiner's) say how far they are from this node's."""
        parsed = split_key(key)
        if parsed is None:
            return None
        gone = self.departed.get(parsed[0])
        if gone is not None and parsed[1] - self.membership.offsets.get(parsed[0], 0) >= gone[1]:
            return gone[0]
        gone = self.departed_elsewhere.get(parsed[0])
        if gone is not None and parsed[1] >= gone[1]:
            return gone[0]
        return None

    def _ended_here(self, key: str) -> bool:
        """Whether round ``key`` already ended on this node (completed or failed): it is not waiting
        here and this node's processes submitted a later call of its job. A start for it means the
        numbering drifted apart (calls that failed on some nodes only, while a node was stopped or
        cut off): answering at once lets every node fail it and catch up, instead of waiting
        round_timeout for processes that have gone on."""
        parsed = split_key(key)
        # not while the job's processes here have left (self.departed): its next run, numbering
        # from 0 again, may be about to join, and this start may be its first call
        return (parsed is not None and key not in self.ready and parsed[0] not in self.departed
                and parsed[0] not in self.restarted_jobs and self.submitted.get(parsed[0], -1) > parsed[1])

    def _fail_alone(self, rnd: LocalRound, error: BirdnetError) -> None:
        """Fail a round on this node before the leader's verdict, and tell the ring: a node that
        holds (or will hold) the same round fails it too instead of waiting for its agreement."""
        self._finish(rnd, error)
        self._remember_failed(rnd.key, type(error).__name__, str(error))
        self._abort(rnd.key, f"node rank {self.rank}: {error}", origin=self.rank,
                    cls=None if isinstance(error, PeerLostError) else type(error).__name__)

    def _on_abort_elsewhere(self, a: Abort | None) -> None:
        """An ``abort`` (naming its origin) of a round this node is not running: remember it,
        fail the round if it is waiting here, pass the abort on."""
        if a is None or a.key is None or a.origin is None or a.origin == self.rank:
            return
        key = a.key
        parsed = split_key(key)
        if self.lane is not None and parsed is not None and parsed[0] == self.lane[0]:
            self._close_lane()  # the node that failed it closed its lane: it will want an agreement
        self._remember_failed(key, a.error_class or "PeerLostError", a.reason)
        if key in self.ready:
            self._finish(self.ready[key], RoundAborted.of(a))
        if a.error_class == "ProcessLostError":
            self._note_departure_elsewhere(key, a.reason)
        self._abort(key, a.reason, origin=a.origin, cls=a.error_class)

    def _finish(self, rnd: LocalRound, error: BirdnetError | None = None) -> None:
        if isinstance(error, RoundAborted) and error.cls:
            error = from_wire({"error": error.cls, "message": error.reason})  # the class its origin saw
        self.ready.pop(rnd.key, None)
        if rnd.key in self.order:
            self.order.remove(rnd.key)
        if error is not None:
            rnd.error = error
            self.rounds_failed += 1
            log.warning("round %s failed: %s", rnd.key, error)
        else:
            self.rounds_done += 1
            self.last_round_seconds = rnd.stats.get("seconds", 0.0)
        self.done(rnd)

    def _own_entry(self, key: str) -> list[Any]:
        """This node's ``[rank, description]`` for round ``key`` of a start's batch."""
        return [self.rank, self._own_desc(self.ready[key])]

    def _own_desc(self, rnd: LocalRound) -> dict[str, Any]:
        d = dict(rnd.desc)
        d["count"] = len(rnd.parts)
        if rnd.error is not None:
            d["error"] = str(rnd.error)
            d["error_class"] = type(rnd.error).__name__
        return d

    # -- the dense lane ---------------------------------------------------------------------------
    def _expect_lane(self, job: str, seq: int) -> None:
        """Keep lane data of round ``job/seq`` (and the one after) that comes before this node runs
        it: the left neighbour may finish the round before (an agreed batch, or the previous lane
        round) first and start the lane round at once. Dropping that data would leave this node
        waiting for it."""
        self.net.set_lane_keys((round_key(job, seq), round_key(job, seq + 1)))

    def _open_lane(self, job: str, seq: int) -> None:
        if self.settled_at is not None:
            # settlement hook: after a round settled among the surviving nodes the lane stays
            # closed, here and (asked) at the leader, which may have opened it before the fault
            self.settled_at = None
            self._close_lane()
            self._request_close(round_key(job, seq), "a round before it was settled among the surviving nodes")
            return
        self.lane = (job, seq)
        self.lane_since = self.net.neighbour_restarts
        self._expect_lane(job, seq)

    def _close_lane(self) -> None:
        self.lane = None
        if self.net is not None and getattr(self.net, "lane_keys", ()):
            self.net.set_lane_keys(())

    def _request_close(self, key: str, why: str) -> None:
        """Ask the leader to close the lane at round ``key`` (a ``lane`` message with ``req``)."""
        if self.rank == 0:
            self._leader_close(key)
            return
        try:
            self.net.send({"t": "lane", "k": key, "req": why})
        except BirdnetError:
            pass

    def _leader_close(self, key: str) -> None:
        self._close_lane()
        try:
            self.net.send({"t": "lane", "k": key})
        except BirdnetError:
            pass  # the right neighbour is lost: its rounds fail by that

    def _on_lane_message(self, h: dict[str, Any]) -> None:
        """A ``lane`` message, as PeerNet.poll receives it. The leader closed the lane: no round
        starts here without an agreement until a ``go`` opens it again; pass it on. A request to
        close it (``req``) travels to the leader, which closes the lane if it has not joined the
        round yet (if it has, its RoundTransport fails the round: a node will not join it)."""
        if h.get("req"):
            if self.rank != 0:
                try:
                    self.net.send({"t": "lane", "k": h.get("k"), "req": h.get("req")})
                except BirdnetError:
                    pass
            elif self.lane is not None and self.lane_running is None:
                self._leader_close(round_key(*self.lane))
            return
        self._close_lane()
        # it may name the round after the one this node is still running in the lane: that round
        # must not reopen the lane when it completes
        self.lane_closed_at = h.get("k")
        if self.rank != self.world - 1:
            try:
                self.net.send({"t": "lane", "k": h.get("k")})
            except BirdnetError:
                pass  # the right neighbour is lost: its rounds fail by that

    @staticmethod
    def _lane_eligible(rnd: LocalRound) -> bool:
        """A dense all-reduce, or a compressed one whose description the data can carry and whose
        ring writes the result only once every node's part has come (the codec patterns below; a
        codec with flush rounds is not: a flush round is run differently on the rounds it falls on)."""
        codec = rnd.desc.get("codec")
        if not (rnd.kind == "allreduce" and rnd.error is None and bool(rnd.parts) and isinstance(codec, dict)):
            return False
        if codec.get("codec") == "none":
            return True
        try:
            c = get_codec(codec["codec"], **{k: v for k, v in codec.items() if k != "codec"})
        except BirdnetError:
            return False
        if c.pattern == Pattern.MERGED:
            return not c.params.get("flush")
        return c.pattern in (Pattern.SUMMABLE, Pattern.GATHERED)

    def _grant(self, verdicts: list[Verdict]) -> list[Any] | None:
        """The lane the leader's ``go`` opens: the next round of the job of an agreed batch."""
        if not self.lane_allowed or not verdicts or not all(v.ok for v in verdicts):
            return None
        keys = [split_key(v.key) for v in verdicts]
        if any(k is None for k in keys) or len({k[0] for k in keys}) != 1:
            return None
        return [keys[0][0], max(k[1] for k in keys) + 1]

    def _lane_step(self) -> bool:
        """Run the lane's round if it is ready here; True when something was done."""
        assert self.lane is not None
        job, seq = self.lane
        key = round_key(job, seq)
        restarted = self.net.restarted_since(self.lane_since)
        if restarted:
            # The restarted neighbour knows nothing of the lane and waits for an agreement. Only
            # the leader may close the lane (it knows whether it joined the round): ask it.
            self._close_lane()
            self._request_close(key, restarted)
            return True
        gone = self._departed_before(key)
        if gone is not None and key not in self.ready:
            # This node's processes of the job left, so the round cannot complete. Fail it everywhere
            # once another node is in it (its data is here), not before: when the whole job ended
            # nobody waits, and an abort would outlive the job's next run on some node (which
            # numbers its calls from 0 again) and fail that run's call of the same number.
            if not self.net.has_early(key):
                return False
            why = f"node rank {self.rank}: {gone}"
            self._close_lane()
            self._remember_failed(key, "ProcessLostError", why)
            self._abort(key, why, cls="ProcessLostError")
            return True
        rnd = self.ready.get(key)
        if rnd is None:
            return False
        if rnd.error is not None:  # e.g. NaN under nan_policy='reject': fail it everywhere
            self._close_lane()
            self._fail_alone(rnd, rnd.error)
            return True
        if not self._lane_eligible(rnd):
            return False  # it waits for the leader, which closes the lane and starts it
        self._run_lane(rnd, job, seq)
        return True

    def _run_lane(self, rnd: LocalRound, job: str, seq: int) -> None:
        transport = RoundTransport(self.net, rnd.key, self.lane_since, lane=True)
        self.lane_running = rnd.key
        try:
            failed = self._data_phase(rnd, transport, None)
        except LaneGivenUp:
            # nothing of the round was written here (see the module docstring): run it once agreed
            transport.round.phase = Phase.GIVEN_UP
            self._close_lane()
            self.lanes_given_up += 1
            rnd.stats.clear()
            if transport.interrupt is not None:
                self.pending_start = transport.interrupt
            return
        finally:
            self.lane_running = None
        if failed is not None:
            self._close_lane()
            return
        if self.lane_closed_at == round_key(job, seq + 1):
            self._close_lane()  # the leader closed the lane at the next round while this one ran
        else:
            self._open_lane(job, seq + 1)

    # -- main loop --------------------------------------------------------------------------------
    def run(self) -> None:
        name_os_thread(self.name)
        try:
            if self.world == 1:
                self._run_alone()
            else:
                self._run_ring()
        except Exception:  # noqa: BLE001 - a bug here must not leave clients hanging silently
            log.exception("ring worker crashed")
            for key in list(self.ready):
                self._finish(self.ready[key], ShutdownError("the daemon's ring worker crashed; see its log"))
            raise
        finally:
            for key in list(self.ready):
                self._finish(self.ready[key], ShutdownError("the daemon is shutting down"))

    def _run_alone(self) -> None:
        ring = MemoryRing(1)
        while not self.stopping:
            self._take_inbox(timeout=0.5)
            while self.order and not self.stopping:
                rnd = self.ready[self.order[0]]
                if rnd.error is not None:
                    self._finish(rnd, rnd.error)
                    continue
                self._execute(rnd, ring.transports[0], [len(rnd.parts)])

    def _execute(self, rnd: LocalRound, transport, counts: list[int]) -> None:
        try:
            self.runner.run(rnd, transport, self.rank, self.world, counts)
        except BirdnetError as exc:
            self._finish(rnd, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a bad round must not take the daemon down
            log.exception("round %s raised", rnd.key)
            self._finish(rnd, InputError(f"round {rnd.key} failed inside the daemon: {exc!r}"))
            return
        self._finish(rnd)

    def _run_ring(self) -> None:
        net, m = self.net, self.membership
        while not self.stopping:
            self._take_inbox()
            live = m.check_liveness(self)  # fails what cannot run (a lost peer, no majority)
            if self.lane is not None and live and self._lane_step():
                continue
            leader = m.leader(live)
            if leader == self.rank and self.order and live and m.may_lead():
                if self.lane is not None:
                    # something other than the lane's round is next: close the lane ahead of the start
                    self._leader_close(round_key(*self.lane))
                rnd = self.ready[self.order[0]]
                try:
                    self._lead(rnd)
                except Exception as exc:  # noqa: BLE001 - bad bytes from the ring must not stop it
                    log.exception("round %s failed inside the leader", rnd.key)
                    if rnd.key in self.ready:
                        self._finish(rnd, InputError(f"round {rnd.key} failed inside the daemon: {exc!r}"))
                continue
            if leader != self.rank:
                self._expire_unstarted()
            msg = self.pending_start or net.poll(0.05)
            self.pending_start = None
            handler = self._handlers.get(msg["h"].get("t")) if msg is not None else None
            followed = handler(msg) if handler is not None else False
            if not followed and leader is not None and leader != self.rank and self.order:
                m.waiting_for_start(self, leader)
                if isinstance(m, FixedRing):
                    self._repeat_aborts()

    # -- control messages between rounds, by type (as the service's main loop dispatches clients') --
    def handle_start(self, msg: dict[str, Any]) -> bool:
        """A leader's ``start``: follow it (True). Only followers act on one; the leader's own
        starts come back inside _lead."""
        h = msg["h"]
        if not self.membership.follows(h):
            return False
        self._follow_guarded(self._follow, msg, h.get("k"))
        return True

    def handle_abort(self, msg: dict[str, Any]) -> bool:
        """An ``abort`` of a round this node is not running: remembered and passed on."""
        self._on_abort_elsewhere(Abort.from_header(msg["h"]))
        return False

    def _follow_guarded(self, follow: Callable[[Any], None], msg: Any, key: Any) -> None:
        """A follower's part of round ``key``; whatever goes wrong in it fails that round here only
        (e.g. the right neighbour is not connected), never the ring thread."""
        try:
            follow(msg["h"], msg.get("from"))
        except Exception as exc:  # noqa: BLE001
            if not isinstance(exc, BirdnetError):
                log.exception("round %r failed inside a follower", key)
                exc = InputError(f"round {key!r} failed inside the daemon: {exc!r}")
            log.warning("round %s: %s", key, exc)
            if isinstance(key, str) and key in self.ready:
                self._finish(self.ready[key], exc)

    def _expire_unstarted(self) -> None:
        """A follower's round the leader never starts (its job's processes on another node never
        submitted it) fails after round_timeout instead of waiting forever."""
        limit = self.settings.round_wait_timeout
        now = time.monotonic()
        for key in list(self.order):
            rnd = self.ready[key]
            if now - rnd.ready_at > limit:
                self._finish(rnd, RoundTimeoutError(
                    f"round {key} for tensor {rnd.desc.get('name')!r} was never started by the leader "
                    f"within round_timeout={self.settings.round_timeout} s: the job's processes on some other "
                    "node did not submit it"))

    def _wait_control(self, want: str, rd: Round) -> dict:
        """Wait until ``rd.deadline`` for a control message ``want`` of round ``rd`` from the member
        before this node on its ring."""
        net = self.net
        key, deadline, ring, since = rd.key, rd.deadline, rd.ring, rd.since
        while True:
            self._take_inbox()
            why = ring.gone(net, since)
            if why:
                raise PeerLostError(f"{why} while round {key} was starting")
            if self.stopping:
                raise ShutdownError("the daemon is shutting down")
            if time.monotonic() > deadline:
                raise RoundTimeoutError(f"round {key} did not start on every node within "
                                        f"round_timeout={self.settings.round_timeout} s")
            # The message waited for may be among lost ones. Checked before the poll, so a message
            # the poll returns (a start of another round, say) is handled before the round fails.
            err = ring.gap_error(net, key, want)
            if err is not None:
                raise err
            msg = net.poll(0.05)
            if msg is None or not ring.accepts(msg):
                continue
            h = msg["h"]
            a = Abort.from_header(h) if h.get("t") == "abort" else None
            if a is not None and a.key == key:
                if a.retry:
                    raise RoundRetry(a.reason)
                raise RoundAborted.of(a)
            if not ring.from_left(msg):
                continue
            if h.get("t") == want and h.get("k") == key:
                err = ring.gap_error(net, key, want)  # what was lost may have been this round's
                if err is not None:
                    raise err
                return h
            if a is not None and a.origin is not None:
                self._on_abort_elsewhere(a)  # another round
                continue
            if h.get("t") == "start" and want == "go" and self.membership.follows(h):
                self.pending_start = msg  # the leader moved on (or started again)
                raise self.membership.on_new_start(key)
            # anything else is stale (an earlier, failed round)

    def _abort(self, key: str, reason: str, origin: int | None = None, cls: str | None = None, *,
               retry: bool = False) -> None:
        """Tell the ring round ``key`` failed. On the fixed ring every abort names its origin
        (default: this node) and travels until it is next to it, through nodes that are not (or no
        longer) in the round too, so a node that has not reached the round yet learns of it
        (RingWorker.aborted); an elastic abort travels the round's ring (``retry``: start the round
        again on the re-formed ring). The membership says which."""
        m = self.membership
        abort = m.abort_of(key, reason, origin, cls, retry)
        try:
            m.send_abort(abort)
        except PeerLostError:
            # the right neighbour's socket is reconnecting (its queue was dropped while it did not
            # answer, e.g. a stopped node): keep the abort and send it once it connects, or a node
            # still waiting for the round (the leader for its start) would wait round_timeout
            if not retry and self.world > 1:
                if len(self._unsent_aborts) >= MAX_UNSENT_ABORTS:
                    self._unsent_aborts.pop(0)
                self._unsent_aborts.append((abort, time.monotonic()))
        except Exception:  # noqa: BLE001
            pass

    def _repeat_aborts(self) -> None:
        """This node's processes wait for the leader to start a round, and this node failed an
        earlier round of their job (alone, before any verdict): tell the ring again, once a second.
        The first abort can be lost with a connection that was being re-made (the leader stopped,
        its left neighbour's socket reconnecting): the leader would then wait round_timeout for its
        start of that round to come back, holding every round of the ring."""
        now = time.monotonic()
        for key in self.order[:1]:
            rnd = self.ready[key]
            for seq in range(max(0, rnd.seq - MAX_BATCH), rnd.seq):
                k = round_key(rnd.job, seq)
                t = self.aborted.get(k)
                if t is None or now - self._repeated.get(k, t.at) < 1.0:
                    continue
                self._repeated[k] = now
                if len(self._repeated) > MAX_UNSENT_ABORTS:
                    self._repeated.pop(next(iter(self._repeated)))
                self._abort(k, t.message, cls=None if t.error_class == "PeerLostError" else t.error_class)

    def _resend_aborts(self) -> None:
        """Send the aborts that could not go out (see _abort), oldest first, while they matter."""
        keep = []
        limit = self.settings.round_wait_timeout
        now = time.monotonic()
        for i, (abort, at) in enumerate(self._unsent_aborts):
            if now - at > limit:
                continue
            try:
                self.membership.send_abort(abort)
            except PeerLostError:
                keep = [x for x in self._unsent_aborts[i:] if now - x[1] <= limit]
                break
            except Exception:  # noqa: BLE001
                continue
        self._unsent_aborts = keep

    def _report(self, key: str, exc: BaseException) -> None:
        """Abort round ``key`` after it failed here with ``exc``: pass on an abort that came from
        upstream (keeping its origin and reason), else start one."""
        if isinstance(exc, RoundAborted) and exc.origin is not None:
            if exc.origin != self.rank:
                self._remember_failed(key, exc.cls or "PeerLostError", exc.reason)
                self._abort(key, exc.reason, origin=exc.origin, cls=exc.cls)
        elif isinstance(exc, RoundAborted):
            self._abort(key, f"rank {self.rank}: {exc}")
        else:
            # the class goes along only for errors that are the round's own (a mismatch, bad input):
            # a node that merely lost its neighbour says so in the reason, and others stay PeerLostError
            cls = None if isinstance(exc, (PeerLostError, ShutdownError)) else type(exc).__name__
            self._abort(key, f"rank {self.rank}: {exc}", cls=cls)

    def _lead(self, rnd: LocalRound) -> None:
        """Start ``rnd`` and, in the same start/go exchange, up to ``MAX_BATCH - 1`` more rounds
        that are ready here; each follower keeps the prefix of them that is ready on its node too, so
        a training step's many tensors cost one agreement instead of one each. The membership
        proposes the ring (and what its start and go carry)."""
        m, net = self.membership, self.net
        ring = m.propose(self)
        if ring is None:
            # not enough nodes want to take part yet (elastic: restarted without their processes)
            self._expire_unstarted()
            net.poll(0.05)
            return
        key = rnd.key
        rd = Round(key, ring, net.neighbour_restarts, rnd.ready_at + self.settings.round_timeout)
        extras = [k for k in self.order if k != key and self.ready[k].error is None][:MAX_BATCH - 1]
        lane = None
        try:
            ring.send(net, {"t": "start", "k": key, **ring.fields, "descs": [[self.rank, self._own_desc(rnd)]],
                            "more": [[k, [[self.rank, self._own_desc(self.ready[k])]]] for k in extras]})
            rd.phase = Phase.AGREEING
            h = self._wait_control("start", rd)
            verdicts = self._verdicts_of_start(h, key, extras, ring)
            rd.verdict = verdicts[0]
            go = {"t": "go", **ring.fields, **verdicts[0].go_fields(), "more": [v.to_wire() for v in verdicts[1:]]}
            lane = self._grant(verdicts)
            if lane is not None:
                go["lane"] = lane
                self._expect_lane(lane[0], lane[1])
            ring.send(net, go)
        except (BirdnetError, RoundRetry) as exc:
            if m.retries(exc):
                # a member of the proposed ring is gone: start the round again once the ring re-forms
                log.info("round %s: agreement on ring %s abandoned (%s); it will start again", key,
                         list(ring.members), exc)
                rd.phase = Phase.RETRY
                self._abort(key, f"rank {self.rank}: {exc}", retry=True)
                net.poll(0.1)
                return
            rd.phase = Phase.FAILED
            self._close_lane()
            self._report(key, exc)
            self._finish(rnd, exc)
            return
        m.applied(self, ring, None)
        self._granted(self._run_batch(verdicts, rd), lane)

    def _verdicts_of_start(self, h: dict[str, Any], key: str, extras: list[str], ring: Any) -> list[Verdict]:
        """The leader's verdicts on the rounds of its ``start`` ``h`` that came back round ``ring``:
        round ``key`` and the prefix of ``extras`` the followers kept (each round's descriptions
        checked: one per member, in the order of the ring)."""
        verdicts = [self._verdict(key, check_descs(h.get("descs"), key, ring))]
        more = h.get("more") if isinstance(h.get("more"), list) else []
        for item in more:
            if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                    or item[0] not in self.ready or item[0] not in extras):
                raise ProtocolError(f"round {key}: malformed batch in the start message")
            verdicts.append(self._verdict(item[0], check_descs(item[1], item[0], ring)))
        return verdicts

    def _verdict(self, key: str, descs: list[tuple[int, dict[str, Any]]]) -> Verdict:
        """The leader's verdict on one round of a start, from every node's description."""
        problem = describe_difference(descs)
        counts = [d.get("count", 0) for _, d in descs]
        if not all(is_int(c) and 0 <= c < 1 << 20 for c in counts):
            raise ProtocolError(f"round {key}: bad process counts {counts!r} came back round the ring")
        return Verdict(key, problem is None, problem, error_class(descs), tuple(counts))

    def _run_batch(self, verdicts: list[Verdict], agreed: Round) -> bool:
        """Run the rounds of agreement ``agreed`` in order on its ring. Once one fails in its data
        phase the rest of the batch is failed here and aborted downstream, so no node waits for data
        that will not come. True when every round of the batch ran here without an error."""
        self.agreements += 1
        failed: BirdnetError | None = None
        all_ok = True
        for v in verdicts:
            rnd = self.ready.get(v.key)
            if rnd is None:
                all_ok = False
                continue
            if not v.ok:
                all_ok = False
                self._finish(rnd, from_wire({"error": v.error_class or "RoundMismatchError", "message": str(v.error)}))
            elif failed is not None:
                self._abort(v.key, f"rank {self.rank}: an earlier round of the batch failed: {failed}")
                self._finish(rnd, from_wire({"error": type(failed).__name__,
                                             "message": f"an earlier round of the same batch failed: {failed}"}))
            else:
                counts = list(v.counts)
                self.membership.note_contributors(rnd, counts, agreed.ring)
                rd = Round(v.key, agreed.ring, agreed.since, phase=Phase.RUNNING, verdict=v)
                failed = self._data_phase(rnd, RoundTransport(self.net, v.key, round=rd), counts)
        agreed.phase = Phase.DONE if all_ok and failed is None else Phase.FAILED
        return all_ok and failed is None

    def _follow(self, h: dict[str, Any], sender: int | None = None) -> None:
        """A follower's part of the agreement the leader's ``start`` ``h`` (from rank ``sender``)
        began: its description once its processes submitted the round, then the leader's ``go``."""
        key = h.get("k")
        descs = h.get("descs")
        if not isinstance(key, str) or not isinstance(descs, list):
            return
        m, net = self.membership, self.net
        ring = m.ring_of_start(self, h, sender)
        if ring is None:
            return
        self._close_lane()  # a start: the leader is not in the lane (it closed it, or never opened it)
        start = {"t": "start", "k": key, **ring.fields}
        rd = Round(key, ring, net.neighbour_restarts, time.monotonic() + self.settings.round_timeout)
        since = rd.since
        # Wait until this node's processes have submitted the round the leader chose. The inbox is
        # read before every wait: the service thread's wake-up may already have been consumed by
        # the poll that delivered this start, and waiting on it again would add a whole poll period.
        while True:
            self._take_inbox()
            if key not in self.ready:
                m.align(self, key)  # an elastic joiner's call numbers become the cluster's
            if key in self.ready:
                break
            m.overtaken(self, key, ring.leader)
            if self.stopping:
                return
            if time.monotonic() > rd.deadline:
                descs.append([self.rank, {"error": f"the processes on node rank {self.rank} did not submit "
                                                   f"round {key} within round_timeout"}])
                ring.send(net, {**start, "descs": descs, "more": []})
                return
            why = ring.gone(net, since)
            if why is not None:
                why = f"{why} while round {key} was starting"
                if m.retries(PeerLostError(why)):
                    self._abort(key, why, retry=True)  # it starts again on the re-formed ring
                else:
                    self._remember_failed(key, "PeerLostError", why)
                    self._abort(key, why)
                return
            t = self._tombstone(key)
            if t is not None:
                # this node failed the round already (alone, before any verdict): fail it everywhere
                descs.append([self.rank, {"error": t.message, "error_class": t.error_class}])
                ring.send(net, {**start, "descs": descs, "more": []})
                self._pass_go(rd)
                return
            gone = self._departed_before(key)
            if gone is not None:
                # This node's processes of the job can never submit: fail the round everywhere now.
                descs.append([self.rank, {"error": f"node rank {self.rank}: {gone}",
                                          "error_class": "ProcessLostError"}])
                ring.send(net, {**start, "descs": descs, "more": []})
                self._pass_go(rd)
                return
            if self._ended_here(key):
                descs.append([self.rank, {"error": (
                    f"call {key} already ended on node rank {self.rank} (it failed there while the ring "
                    f"was broken; its processes went on to call {self.submitted[split_key(key)[0]]})"),
                    "error_class": "PeerLostError"}])
                ring.send(net, {**start, "descs": descs, "more": []})
                self._pass_go(rd)
                return
            msg = net.poll(0.02)
            if msg is None or not ring.from_left(msg):
                continue
            mh = msg["h"]
            if mh.get("t") == "abort" and mh.get("k") == key:
                a = Abort.from_header(mh)
                if a is not None and a.origin is not None:
                    # remembered, so the round fails at once when this node's processes submit it
                    self._on_abort_elsewhere(a)
                elif a is not None:
                    self._abort(key, a.reason, retry=a.retry)  # an elastic abort: on along the ring
                return
            if mh.get("t") == "start" and mh.get("k") != key:
                # the leader moved on (it abandoned this round): follow the newer one
                self.pending_start = msg
                return
        rnd = self.ready[key]
        descs.append([self.rank, self._own_desc(rnd)])
        kept = extend_batch(h.get("more"), self.ready, self._own_entry)
        ring.send(net, {**start, "descs": descs, "more": kept})
        try:
            g = self._wait_control("go", rd.wait_until(rnd.ready_at + self.settings.round_wait_timeout,
                                                       Phase.AGREEING))
            if not ring.matches_go(g):
                raise ProtocolError(f"round {key}: the go message does not match its start")
        except (BirdnetError, RoundRetry) as exc:
            if m.retries(exc):
                rd.phase = Phase.RETRY
                self._abort(key, f"rank {self.rank}: {exc}", retry=True)
                return  # the round stays waiting for the leader's next start
            rd.phase = Phase.FAILED
            self._report(key, exc)
            self._finish(rnd, exc)
            return
        if ring.right_rank != ring.leader:
            try:
                ring.send(net, g)
            except BirdnetError as exc:
                self._finish(rnd, exc)
                return
        m.applied(self, ring, g)
        verdicts = verdicts_of_go(g, key, ring.world, self.ready)
        rd.verdict = verdicts[0]
        lane = g.get("lane")
        if not (self.lane_allowed and isinstance(lane, list) and len(lane) == 2 and isinstance(lane[0], str)
                and is_int(lane[1])):
            lane = None
        if lane is not None:
            self._expect_lane(lane[0], lane[1])  # before the batch runs: see _expect_lane
        self._granted(self._run_batch(verdicts, rd), lane)

    def _granted(self, batch_ok: bool, lane: list[Any] | None) -> None:
        """After an agreed batch: open the lane its ``go`` granted, if every round ran here."""
        self.lane_closed_at = None
        if lane is not None and batch_ok:
            self._open_lane(lane[0], lane[1])
        else:
            self._close_lane()

    def _pass_go(self, rd: Round) -> None:
        """Forward the leader's verdict on round ``rd``, which this node has no local part in."""
        try:
            g = self._wait_control("go", rd.wait_until(time.monotonic() + self.settings.pass_go_timeout,
                                                       Phase.AGREEING))
        except (BirdnetError, RoundRetry):
            return
        finally:
            rd.phase = Phase.FAILED  # this node's part of the round was an error description
        if rd.ring.right_rank != rd.ring.leader:
            rd.ring.send(self.net, g)

    def _data_phase(self, rnd: LocalRound, transport, counts: list[int] | None) -> BirdnetError | None:
        """Run one round (agreed, or a lane round: ``counts`` None); returns its error (already
        reported) or None. A lane round given up raises LaneGivenUp (RingWorker._run_lane)."""
        if hasattr(transport, "on_other_abort"):
            transport.on_other_abort = self._on_abort_elsewhere
        rd: Round | None = getattr(transport, "round", None)
        if self.commits:  # settlement hook (daemon/settle.py): what is known of an earlier run's same key goes
            settle.book_of(self.net).started(rnd.key)
        try:
            # the transport's rank and world: positions in the live ring in elastic mode
            self.runner.run(rnd, transport, transport.rank, transport.world, counts, defer_commit=True)
            if self.commits and isinstance(transport, RoundTransport):
                # a stopped node may hold up the count for long: as long as a round may wait
                transport.await_commit(max(self.settings.peer_timeout, self.settings.round_timeout))
                if transport.settled_after_restart:
                    # settlement hook (daemon/settle.py): the left neighbour restarted in the commit,
                    # so the lane this round would open cannot run on every node (_open_lane)
                    self.settled_at = rnd.key
            self.runner.commit(rnd)
        except LaneGivenUp:
            raise
        except BirdnetError as exc:
            if rd is not None:
                rd.phase = Phase.FAILED
            if self.commits:  # settlement hook (daemon/settle.py): askers learn this node failed it
                settle.book_of(self.net).aborted(rnd.key)
            self._report(rnd.key, exc)
            if getattr(transport, "interrupt", None):
                self.pending_start = transport.interrupt
            self._finish(rnd, exc)
            return exc
        except Exception as exc:  # noqa: BLE001
            log.exception("round %s raised", rnd.key)
            if self.commits:  # settlement hook (daemon/settle.py), as above
                settle.book_of(self.net).aborted(rnd.key)
            self._abort(rnd.key, f"rank {self.rank}: internal error {exc!r}")
            if rd is not None:
                rd.phase = Phase.FAILED
            err = InputError(f"round {rnd.key} failed inside the daemon: {exc!r}")
            self._finish(rnd, err)
            return err
        if rd is not None:
            rd.phase = Phase.DONE
        if counts is None:
            # counted before the processes hear of the result: a status they ask for next shows it
            self.lane_rounds += 1
        self._finish(rnd)
        return None
