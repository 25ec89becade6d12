"""Collective calls on this node: submits checked against the session and collected per job until
every local process of the job has made the call, then launched as one
:class:`~birdnet.daemon.engine.LocalRound` on the ring worker; finished rounds answered; and the
warm-up queue, where submits wait (in order) until their codec's kernels are loaded.

:class:`Calls` is part of :class:`birdnet.daemon.service.Daemon` (it reads its sessions, jobs,
worker and settings); the main loop calls ``handle_finished``, ``release_parked`` and
``expire_pending``.
"""
from __future__ import annotations

import logging
import math
import queue
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq
from birdnet.daemon.engine import Contribution, LocalRound
from birdnet.daemon.sessions import MAX_DEPARTED, Job, PendingCall

from birdnet.errors import BirdnetError, CodecError, InputError, ProcessLostError, RoundTimeoutError, to_wire
from birdnet.requests import ANONYMOUS_PREFIX, FLOAT_DTYPES, OPS, SUM_DTYPES, Submit, Warm

log = logging.getLogger("birdnet.daemon")

#: ``warm`` requests load at most this many codec configurations into the daemon (each is a
#: subprocess and a load; a job uses a few)
MAX_WARM_REQUESTS = 64
MAX_PENDING_CALLS = 1024  #: a job's calls waiting on this node for some of its processes
MAX_EXPIRED = 4096  #: a job's call numbers remembered as timed out


def _any_size(name: Any) -> bool:
    """Whether a call that names codec ``name`` gets it under dense_threshold too
    (``Codec.any_size``: fp16, which is dense itself). An unknown name is no error here: a small
    tensor travels dense whatever codec it names, as it always did."""
    if not isinstance(name, str):
        return False
    from birdnet.codecs import codec_class, names  # imported here: the daemon starts without codecs
    if name not in names():
        return False
    try:
        return bool(codec_class(name).any_size)
    except CodecError:  # registered but not loadable: the small tensor travels dense, as before
        return False


class Calls:
    """Submits, local rounds and their results, and the warm-up queue: the daemon's part that
    knows calls."""

    # of the Daemon (daemon/service.py) this is part of: what it reads and changes
    settings: Any
    rank: int
    world: int
    sessions: dict[bytes, Any]
    jobs: dict[str, Job]
    worker: Any
    net: Any
    warmer: Any
    parked: Any
    warned_jobs: set[str]
    finished: queue.Queue[LocalRound]
    figures: Any
    bytes_sent_total: int
    ring_wake_tx: Any
    _finish_lock: Any
    reply: Callable[[bytes, dict[str, Any]], None]
    _session: Callable[[bytes], Any]
    _wake: Callable[[], None]
    handle_request: Callable[[bytes, Any], None]

    def _codec_of(self, h: Submit) -> tuple[Any, Any]:
        """The codec and parameters a submit asks for (as handle_submit reads them)."""
        if h.kind != "allreduce":
            return "none", {}
        if h.codec:
            return h.codec, h.params or {}
        return self.settings.codec, self.settings.codec_params

    def _park(self, identity: bytes, h: Submit) -> bool:
        """Keep a submit back while its codec's kernels are not in this process yet (and every
        submit after it, so calls are taken in the order they came). A round then never reaches
        the ring thread before its kernels: compiling there stopped the heartbeats."""
        if self.warmer is None:
            return False
        codec, params = self._codec_of(h)
        if self.warmer.ready(codec, params) and not self.parked:
            return False
        if not self.parked:
            log.info("calls wait for the kernels of codec %s to be compiled and loaded", codec)
        self.parked.append((time.monotonic(), identity, h, codec, params))
        return True

    def release_parked(self) -> None:
        """Take the parked submits whose kernels are ready, in order; fail those parked longer than
        warmup_timeout."""
        now = time.monotonic()
        while self.parked:
            since, identity, h, codec, params = self.parked[0]
            if self.warmer.ready(codec, params):
                self.parked.popleft()
                self.handle_request(identity, h)
            elif now - since > self.settings.warmup_timeout:
                self.parked.popleft()
                err = RoundTimeoutError(
                    f"call {h.seq} of pid {getattr(self.sessions.get(identity), 'pid', '?')}: the kernels of codec "
                    f"{codec!r} were not compiled within warmup_timeout={self.settings.warmup_timeout} s "
                    f"({self.warmer.describe(codec, params)}); on a slow board raise warmup_timeout, or warm the "
                    "cache before starting training (`birdnet warmup`)")
                log.warning("%s", err)
                self.reply(identity, {"t": "error", "call": _call_of(h), **to_wire(err)})
            else:
                break

    def handle_submit(self, identity: bytes, h: Submit) -> None:
        s = self._session(identity)
        call, seq, kind = h.call, h.seq, h.kind  # types and ranges: birdnet.requests.decode
        if s.seq_used(seq):
            raise InputError(f"call {seq} was already submitted by this process (pid {s.pid}); call numbers are "
                             "used once (only birdnet.client numbers calls)")
        gone = None
        if self.worker is not None:
            gone = self.worker.departed.get(s.job)
            elsewhere = self.worker.departed_elsewhere.get(s.job)
            if elsewhere is not None and (gone is None or elsewhere[1] < gone[1]):
                gone = elsewhere
        if gone is not None and seq >= gone[1]:
            raise ProcessLostError(f"job {s.job!r} cannot run call {seq} on node rank {self.rank}: {gone[0]}")
        root = h.root if h.root is not None else 0
        if not root < self.world * self.settings.local_size:
            raise InputError(f"submit: field 'root' is {root}, not a rank of this job "
                             f"(0..{self.world * self.settings.local_size - 1})")
        desc: dict[str, Any] = {"kind": kind, "name": None, "shape": [], "dtype": None, "op": None,
                                "codec": None, "root": None}
        array = None
        if kind in ("allreduce", "broadcast"):
            name, shape, dtype = h.name, h.shape, h.dtype  # present and typed: birdnet.requests.decode
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape) or len(shape) > 32:
                raise InputError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
            op = (h.op if h.op is not None else "mean") if kind == "allreduce" else "sum"
            if op not in OPS:
                raise InputError(f"tensor {name!r}: op {op!r} is not supported; use 'mean' or 'sum'")
            allowed = FLOAT_DTYPES if op == "mean" else SUM_DTYPES
            if dtype not in allowed:
                raise InputError(f"tensor {name!r}: dtype {dtype} cannot be reduced with op={op!r}; "
                                 f"convert to one of {', '.join(allowed)}")
            n = math.prod(shape)  # Python ints: a huge shape cannot overflow into a small size
            dt = np.dtype(dtype)
            slot = h.slot
            seg = s.segments.get(slot)
            if seg is None or seg.size < n * dt.itemsize:
                raise InputError(f"tensor {name!r}: slot {slot} is missing or too small for {n} x {dtype}")
            array = np.frombuffer(seg.buf, dtype=dt, count=n).reshape(shape)
            desc.update(name=name, shape=shape, dtype=dtype, op=op)
            codec_name = h.codec or self.settings.codec
            params = h.params if h.codec else self.settings.codec_params
            if not isinstance(codec_name, str) or not isinstance(params, dict):
                raise InputError("codec must be a name and its parameters a map")
            small = n < self.settings.dense_threshold and not _any_size(h.codec)
            if kind == "broadcast" or small or dt.kind != "f":
                desc["codec"] = {"codec": "none"}
            else:
                from birdnet.codecs import get_codec
                codec = get_codec(codec_name, **params)  # CodecError names the problem
                desc["codec"] = codec.describe()
                if name.startswith(ANONYMOUS_PREFIX) and h.codec and codec.new_state(1) is not None:
                    # An unnamed call cannot say which tensor it is, so its state could never be
                    # used again: refuse rather than drop error feedback silently (or leak it).
                    raise InputError(
                        f"call {seq}: codec {codec_name!r} keeps error-feedback state per tensor, and a call without "
                        f"name= has no tensor to keep it for (each call would start from nothing and lose what "
                        f"the compression dropped); pass the same name for the same tensor every step, e.g. "
                        f"client.allreduce(grad, name='layer1.weight', codec={codec_name!r}, ...)")
            if kind == "broadcast":
                desc["root"] = root
            if slot in s.inflight:
                self.handle_finished()  # a result that went through the doorbell frees its slot here first
            if slot in s.inflight:
                # two rounds writing one segment would give both a wrong result, silently
                raise InputError(f"tensor {name!r}: slot {slot} is in use by call {s.inflight[slot]}, still in flight")
        j = self.jobs[s.job]
        if seq in j.expired:
            raise RoundTimeoutError(j.expired[seq])
        if seq not in j.pending and len(j.pending) >= MAX_PENDING_CALLS:
            # a process far ahead of its siblings (or numbering calls they never use) must not
            # grow the daemon without bound
            raise InputError(f"job {s.job!r} has {len(j.pending)} calls on node rank {self.rank} waiting for some of its "
                             f"{self.settings.local_size} local processes; call {seq} of pid {s.pid} cannot wait too "
                             "(do all processes of the job make the same calls?)")
        # Everything is checked: from here on the submit is taken, and the session records it.
        if h.door is True and s.door is not None and not s.door.armed:
            s.door.armed = True  # the process has its ends open: results may go this way now
            s.door.unlink()
            if s.bell is not None:
                s.bell.unlink()
        s.use_seq(seq)
        if array is not None:
            s.inflight[slot] = call
        if seq not in j.pending:
            j.pending_since[seq] = time.monotonic()
        pend = j.pending.setdefault(seq, {})
        contribution = None
        if array is not None:
            contribution = Contribution(identity, call, array, s.local_index,
                                        self.rank * self.settings.local_size + s.local_index)
        pend[s.local_index] = PendingCall(desc, contribution, call, slot if array is not None else None)
        if len(pend) == self.settings.local_size:
            self._launch(j, seq)

    def expire_pending(self) -> None:
        """Calls some local processes of a job submitted and a sibling did not within round_timeout
        fail for those that did (a sibling that never submits hung them for ever). The round goes to
        the ring worker with the error, so the other nodes fail it too (as a mismatch) instead of
        waiting; the sibling's late submit of it fails at once (Job.expired)."""
        limit = time.monotonic() - self.settings.round_timeout
        for j in list(self.jobs.values()):
            expired = 0
            for seq in [q for q, t in j.pending_since.items() if t < limit]:
                if seq not in j.pending:
                    del j.pending_since[seq]
                    continue
                have = sorted(j.pending[seq])
                missing = [i for i in range(self.settings.local_size) if i not in have]
                pids = [j.sessions[i].pid for i in missing if i in j.sessions]
                why = (f"call {seq} of job {j.name!r} timed out on node rank {self.rank}: local rank(s) "
                       f"{', '.join(map(str, missing))}" + (f" (pid {', '.join(map(str, pids))})" if pids else "")
                       + f" did not submit it within round_timeout={self.settings.round_timeout} s, local rank(s) "
                       f"{', '.join(map(str, have))} did; do all processes of the job make the same calls?")
                expired += 1
                if expired == 1:
                    log.warning("%s", why)  # one line per job and second, however many calls
                j.expired[seq] = why
                while len(j.expired) > MAX_EXPIRED:
                    j.expired.pop(next(iter(j.expired)))
                self._launch(j, seq, RoundTimeoutError(why))
            if expired > 1:
                log.warning("job %r: %d more calls timed out the same way on node rank %d", j.name, expired - 1,
                            self.rank)

    def _launch(self, j: Job, seq: int, error: BirdnetError | None = None) -> None:
        j.pending_since.pop(seq, None)
        pend = j.pending.pop(seq)
        entries = [pend[i] for i in sorted(pend)]
        desc0 = entries[0][0]
        rnd = LocalRound(job=j.name, seq=seq, kind=desc0["kind"], desc=desc0,
                         parts=[e[1] for e in entries if e[1] is not None])
        rnd.callers = [(j.sessions.get(i), pend[i][2], pend[i][3]) for i in sorted(pend)]
        codec = desc0.get("codec")
        if (isinstance(desc0.get("name"), str) and desc0["name"].startswith(ANONYMOUS_PREFIX)
                and isinstance(codec, dict) and codec.get("codec") not in (None, "none")):
            self._warn_anonymous(j.name, rnd, codec)
        for i, (d, _c, _call, _slot) in zip(sorted(pend), entries):
            diffs = [f"{k}: {desc0.get(k)!r} (local rank {sorted(pend)[0]}) vs {d.get(k)!r} (local rank {i})"
                     for k in desc0 if d.get(k) != desc0.get(k)]
            if diffs:
                rnd.error = InputError(f"call {seq} of job {j.name!r} does not match between processes on node "
                                       f"rank {self.rank}: " + "; ".join(diffs))
                break
        if error is not None:
            rnd.error = error
        if rnd.error is None and self.settings.nan_policy == "reject" and rnd.kind == "allreduce":
            for p in rnd.parts:
                if p.array.dtype.kind == "f" and not np.isfinite(p.array).all():
                    rnd.error = InputError(f"tensor {desc0['name']!r} from local rank {p.local_index} on node rank "
                                           f"{self.rank} contains NaN or Inf (nan_policy='reject')")
                    break
        assert self.worker is not None
        self.worker.submit(rnd)
        if self.net is not None:
            # after the round went to the worker nothing may fail this call: an error reply now
            # would free a slot the round still writes (zmq.Again once 1000 wake-ups are queued)
            _nudge(self.ring_wake_tx)

    def _warn_anonymous(self, job: str, rnd: LocalRound, desc: dict[str, Any]) -> None:
        """A call without name= under the daemon's default codec (an explicit stateful codec is
        refused in handle_submit): if that codec keeps state, the round runs with state for this
        round only (StateStore.get), and the process is told so with its result (the client warns
        once); the log says it once per job."""
        from birdnet.codecs import get_codec
        try:
            stateful = get_codec(desc["codec"], **{k: v for k, v in desc.items() if k != "codec"}).new_state(1) is not None
        except BirdnetError:
            return
        if not stateful:
            return
        msg = (f"calls without name= run the cluster's default codec {desc['codec']!r} without error feedback (its "
               "state needs a tensor name that stays the same from step to step); pass name= to keep it")
        rnd.stats["warning"] = msg
        if job not in self.warned_jobs:
            if len(self.warned_jobs) >= MAX_DEPARTED:
                self.warned_jobs.clear()
            self.warned_jobs.add(job)
            log.warning("job %r: %s", job, msg)

    def _round_finished(self, rnd: LocalRound) -> None:
        """Called on the ring worker thread: a result goes straight to the processes that have a
        doorbell (one thread wake instead of four); this thread does the rest."""
        with self._finish_lock:
            # Queued under the lock that handle_finished takes: whatever a process sends after it
            # had its result finds the round finished here (its slot free), not still in flight.
            if rnd.error is None:
                stats = None
                for session, call, _slot in rnd.callers:
                    if session is not None and session.door is not None and session.door.armed:
                        stats = stats or _plain(rnd.stats)
                        if session.door.send({"t": "done", "call": call, "stats": stats}):
                            rnd.delivered.add(call)
            self.finished.put(rnd)
        self._wake()

    def handle_finished(self) -> None:
        with self._finish_lock:
            rounds = []
            while True:
                try:
                    rounds.append(self.finished.get_nowait())
                except queue.Empty:
                    break
        for rnd in rounds:
            self.bytes_sent_total += int(rnd.stats.get("bytes_sent", 0) or 0)
            self.figures.observe(rnd)
            for session, call, slot in rnd.callers:
                if session is None or self.sessions.get(session.identity) is not session:
                    continue  # the process is gone
                if slot is not None and session.inflight.get(slot) == call:
                    del session.inflight[slot]
                if call in rnd.delivered:
                    continue
                if rnd.error is not None:
                    self.reply(session.identity, {"t": "error", "call": call, **to_wire(rnd.error)})
                else:
                    self.reply(session.identity, {"t": "done", "call": call, "stats": _plain(rnd.stats)})

    def handle_warm(self, identity: bytes, h: Warm) -> None:
        """A process names a codec it is about to use (the PyTorch adapter, for the codec it
        switches to after its dense warm-up): its kernels are loaded now, in the warm-up thread,
        so the first call with it does not wait the second or so that loading takes. The reply says
        whether they are loaded already; calls with the codec park until they are either way."""
        from birdnet.codecs import names
        self._session(identity)
        codec, params = h.codec, h.params or {}
        if codec not in names():
            raise InputError(f"warm: unknown codec {codec!r}; choose one of: {', '.join(names())}")
        if self.warmer is not None and len(self.warmer.requested) >= MAX_WARM_REQUESTS:
            # each new configuration costs a subprocess and a load: a process naming endless
            # parameter sets must not keep the daemon compiling (its calls still warm what they use)
            raise InputError(f"warm: {MAX_WARM_REQUESTS} codec configurations were asked for already; "
                             "calls load the kernels they need by themselves")
        ready = self.warmer is None or self.warmer.ready(codec, params)
        self.reply(identity, {"t": "warm", "call": h.call, "ready": bool(ready)})


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    out = {k: (float(v) if isinstance(v, (np.floating, float)) else int(v) if isinstance(v, (np.integer, int)) else v)
           for k, v in d.items() if isinstance(v, (int, float, str, np.integer, np.floating))}
    for k, v in d.items():  # lists of ranks (elastic mode's contributors)
        if isinstance(v, list) and all(isinstance(x, (int, np.integer)) for x in v):
            out[k] = [int(x) for x in v]
    return out


def _call_of(header: Any) -> Any:
    call = header.get("call") if isinstance(header, dict) else getattr(header, "call", None)
    return call if isinstance(call, int) and not isinstance(call, bool) else None


def _nudge(sock: Any) -> None:
    """Wake the thread reading ``sock`` (an inproc PUSH). A full queue (zmq.Again) means wake-ups
    are already waiting there, which is all a wake-up is for: nothing is lost."""
    try:
        sock.send(b"", zmq.NOBLOCK)
    except zmq.Again:
        pass
