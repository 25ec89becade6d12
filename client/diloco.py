"""Slow-link mode: synchronise every H steps with compressed pseudo-gradients (DiLoCo), NumPy only.

``from birdnet.client.diloco import OuterLoop`` (also ``birdnet.client.OuterLoop``). Each process
trains its own copy of the model (the *inner* steps: any optimizer, any framework). Every H steps it
computes the *pseudo-gradient* ``outer - local`` (how far its parameters moved since the last sync),
the processes average it through the daemons with a codec, an outer optimizer (Nesterov SGD,
``outer_lr``, ``outer_momentum``) steps the *outer* parameters on the average, and the local
parameters restart from them (Douillard et al., DiLoCo, arXiv 2311.08105).

Example (the arrays are the model's parameters, updated in place by the inner optimizer)::

    params = {"w": w, "b": b}                             # NumPy arrays, float32
    client.broadcast(...)                                 # identical starting parameters first
    loop = OuterLoop(client, params.items())              # takes the outer copy now
    for x, y in data:
        inner_step(params, x, y)                          # local training, in place
        loop.step()                                       # a sync when due; params restart from the outer

Every quantity of the outer loop is computed from the all-reduced average, which is bit-identical
on every process, with the same NumPy ufuncs in the same order (no fused or reordered reductions):
every process holds bit-identical outer parameters (and outer momentum) after every sync.

Schedule
--------
``sync_every`` is an int H, or a schedule: a sequence of ``(H, steps)`` pairs, each H used for that
many steps, and a last int H used from then on. The default (``DEFAULT_SCHEDULE``) warms up with
frequent cheap syncs (H = 1, 2, 4, 8) before the long interval: DiLoCo starts from a trained
model in the paper; from scratch, the first steps move the parameters far and a long interval then
loses quality (docs/slowlink.md has the measurement). Syncs whose H is below the schedule's last
are plain averaging of the parameters (outer lr 1, no momentum: ``WARMUP_OUTER_LR``); from the
last H on the outer optimizer is the one configured.

Fragments and overlap (Streaming DiLoCo, arXiv 2501.18512)
----------------------------------------------------------
``fragments=F`` splits the parameters into F groups of about equal size (whole tensors, in order);
syncs happen every ``max(1, H // F)`` steps, each of one fragment in turn, so every fragment syncs
every H steps and each sync sends about 1/F of the bytes. ``overlap=True`` (or an int d) starts a
fragment's all-reduce and applies its result d inner steps later (True: half the interval between
syncs, at least 1), so the wire time hides behind that compute; on arrival the outer fragment
steps as above and the local fragment becomes ``MIX_ALPHA * local + (1 - MIX_ALPHA) * outer``
(the paper's mixing: the d local steps taken meanwhile are kept in part instead of discarded).
The outer parameters stay bit-identical; the local ones, as always between syncs, differ.

Codec and names
---------------
Each fragment travels as one flat float32 array in shared memory under a stable name
(``diloco/<codec>/<k>of<F>/<first tensor>``), so a codec with error feedback keeps one residual per
fragment in the daemon, carried from sync to sync (the pseudo-gradient's error feedback, as in
SparseLoCo arXiv 2508.15706). ``DEFAULT_CODEC`` was chosen by quality per byte (docs/slowlink.md).

Memory
------
In the process, beside the model: the outer parameters (float32, 4 bytes per parameter), the outer
momentum (float32, 4 bytes; none with ``outer_momentum=0``, the lean setting) and the shared-memory
send buffer (4 bytes). In the daemon: the codec's state per fragment (docs/slowlink.md, Memory).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from birdnet.client import Client, Handle

from birdnet.errors import InputError, ProtocolError

__all__ = ["ADAM_CODEC", "ADAM_DEFAULTS", "ADAM_CODEC_PARAMS", "ADAM_OUTER_LR", "ADAM_OUTER_MOMENTUM", "ADAM_WARMUP_CODEC",
           "ADAM_WARMUP_CODEC_PARAMS", "DEFAULT_CODEC", "DEFAULT_CODEC_PARAMS", "DEFAULT_SCHEDULE", "DEFAULT_WARMUP_CODEC", "MIX_ALPHA", "OUTER_LR", "OUTER_MOMENTUM",
           "OuterLoop", "Schedule", "check_codec"]

#: the outer optimizer of DiLoCo (arXiv 2311.08105, section 3): Nesterov SGD, lr 0.7, momentum 0.9
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
#: warm-up syncs (H below the schedule's last) average the parameters: outer lr 1, no momentum
WARMUP_OUTER_LR = 1.0
#: the default schedule: (H, steps) pairs, then the H kept (docs/slowlink.md, Defaults)
DEFAULT_SCHEDULE: tuple[Any, ...] = ((1, 8), (2, 8), (4, 16), (8, 32), 16)
#: the pseudo-gradient's default codec and parameters (docs/slowlink.md, Codecs)
DEFAULT_CODEC = "lowbit"
DEFAULT_CODEC_PARAMS: dict[str, Any] = {"bits": 4, "error_feedback": True}
#: with codec=None, the warm-up syncs (H below the schedule's last) use this codec instead
DEFAULT_WARMUP_CODEC = "lowbit"
DEFAULT_WARMUP_CODEC_PARAMS: dict[str, Any] = {"bits": 4, "error_feedback": True}
#: False: Adam-type inner optimizers get the DEFAULT_* codecs and DiLoCo's outer optimizer, as
#: every other (how the measurements before the ADAM_* defaults ran: their commands set it)
ADAM_DEFAULTS = True
#: the defaults with an Adam-type inner optimizer (the PyTorch adapter's, by the optimizer it wraps;
#: docs/slowlink.md, Defaults): 7 % of each chunk of 256 values, two bits each, with error feedback
#: in the daemon (SparseLoCo-style), the warm-up syncs at one bit a value, and an outer SGD step of
#: 3 without momentum on the sparse average (the error feedback stands in for the momentum)
ADAM_CODEC = "sparseloco"
ADAM_CODEC_PARAMS: dict[str, Any] = {"chunk": 256, "k": 18, "beta": 0.95}
ADAM_WARMUP_CODEC = "lowbit"
ADAM_WARMUP_CODEC_PARAMS: dict[str, Any] = {"bits": 1, "block": 256, "error_feedback": True}
ADAM_OUTER_LR = 3.0
ADAM_OUTER_MOMENTUM = 0.0
#: the longest the constructor waits for the local daemon to load the codecs' kernels (beyond it the
#: first sync waits for them instead)
KERNELS_TIMEOUT = 300.0
#: Streaming DiLoCo's mixing factor for a fragment applied late (overlap): local = a*local + (1-a)*outer
MIX_ALPHA = 0.5
#: key of the outer state inside a framework optimizer's state_dict
STATE_KEY = "birdnet_diloco"


def check_codec(codec: str, codec_params: dict[str, Any]) -> None:
    """The daemons' own check of a codec and its parameters (:func:`birdnet.codecs.validate`, which
    loads no Numba), so a bad name or parameter fails at construction, not at the first sync."""
    from birdnet.codecs import validate
    validate(codec, codec_params)


class Schedule:
    """Which H applies at a step: ``(H, steps)`` pairs in turn, then the last H for ever."""

    def __init__(self, sync_every: int | Sequence[Any]) -> None:
        if isinstance(sync_every, bool):
            raise InputError(f"sync_every={sync_every!r}: expected an int >= 1 or a schedule")
        if isinstance(sync_every, (int, np.integer)):
            parts: list[Any] = [int(sync_every)]
        elif isinstance(sync_every, Sequence) and not isinstance(sync_every, str) and len(sync_every) > 0:
            parts = list(sync_every)
        else:
            raise InputError(f"sync_every={sync_every!r}: expected an int >= 1 or a schedule such as "
                             "((1, 8), (4, 16), 16): (H, steps) pairs, then the H kept")
        self.phases: list[tuple[int, int]] = []
        for p in parts[:-1]:
            ok = (isinstance(p, (tuple, list)) and len(p) == 2
                  and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1 for v in p))
            if not ok:
                raise InputError(f"sync_every: schedule entry {p!r} must be a pair (H, steps) of ints >= 1")
            self.phases.append((int(p[0]), int(p[1])))
        last = parts[-1]
        if isinstance(last, bool) or not isinstance(last, (int, np.integer)) or last < 1:
            raise InputError(f"sync_every: the schedule's last entry {last!r} must be an int H >= 1 (the H kept)")
        self.final = int(last)

    def at(self, step: int) -> int:
        """H in force after ``step`` inner steps (0-based count of steps taken)."""
        end = 0
        for h, n in self.phases:
            end += n
            if step < end:
                return h
        return self.final

    def describe(self) -> list[Any]:
        return [list(p) for p in self.phases] + [self.final]


class _Fragment:
    """A group of whole tensors synced together: its outer copy, momentum and send buffer."""

    def __init__(self, index: int, count: int, members: list[int], names: list[str], sizes: list[int]) -> None:
        self.index, self.members = index, members
        self.offsets: list[int] = []
        n = 0
        for i in members:
            self.offsets.append(n)
            n += sizes[i]
        self.numel = n
        self.label = f"{index}of{count}/{names[members[0]]}" if members else f"{index}of{count}/"
        self.outer = np.zeros(max(n, 1), np.float32)
        self.momentum: np.ndarray | None = None
        self.buf: np.ndarray | None = None  # shared memory, made at the first sync
        self.handle: Handle | None = None
        self.apply_at = -1  # the step count at which the result in flight is applied
        self.pending: np.ndarray | None = None  # a result already received (waited for by state_dict)
        self.pending_lr = 0.0
        self.pending_m = 0.0


class OuterLoop:
    """The DiLoCo outer loop over NumPy arrays updated in place by local training.

    Parameters
    ----------
    client : Client
        The connection to the local daemon.
    named_arrays : iterable of (str, ndarray)
        The local parameters: writable, C-contiguous, float32 or float64 arrays the inner steps
        update in place; the order and names must be the same on every process.
    sync_every : int or schedule
        H, or ``((H, steps), ..., H)`` (see Schedule in the module docstring); None: ``DEFAULT_SCHEDULE``.
    outer_lr, outer_momentum, nesterov
        The outer optimizer (SGD on the averaged pseudo-gradient). ``outer_momentum=0`` keeps no
        momentum buffer (4 bytes per parameter less).
    fragments : int
        Sync the parameters in this many groups in turn (Streaming DiLoCo).
    overlap : bool or int
        False: a sync waits for its all-reduce. True or d >= 1: the result is applied d inner steps
        later (True: half the interval between syncs, at least 1).
    codec, codec_params
        The pseudo-gradient's codec for every sync; None: ``DEFAULT_CODEC`` (``DEFAULT_CODEC_PARAMS``)
        for the syncs at the schedule's last H and ``DEFAULT_WARMUP_CODEC`` for the warm-up syncs.
    warmup_codec, warmup_codec_params
        The warm-up syncs' codec when ``codec`` is given (None: ``codec`` for every sync).
    timeout : float, optional
        Seconds a sync waits for its all-reduce (RoundTimeoutError beyond); None: no limit. Also the
        longest the constructor waits for the local daemon to load the codecs' kernels (None:
        ``KERNELS_TIMEOUT``); ``kernels_seconds`` says how long it did.
    pull, push : callable, optional
        For frameworks whose parameters the arrays only mirror: ``pull()`` refreshes the arrays from
        the model before a sync reads them, ``push()`` writes them back after a sync changed them.
    """

    def __init__(self, client: Client, named_arrays: Iterable[tuple[str, np.ndarray]], *,
                 sync_every: int | Sequence[Any] | None = None, outer_lr: float = OUTER_LR,
                 outer_momentum: float = OUTER_MOMENTUM, nesterov: bool = True, fragments: int = 1,
                 overlap: bool | int = False, codec: str | None = None, codec_params: dict[str, Any] | None = None,
                 timeout: float | None = None, pull: Callable[[], None] | None = None,
                 push: Callable[[], None] | None = None, warmup_codec: str | None = None,
                 warmup_codec_params: dict[str, Any] | None = None) -> None:
        self.client = client
        items = list(named_arrays)
        if not items:
            raise InputError("OuterLoop: no parameters given (named_arrays is empty)")
        self.names = [str(n) for n, _a in items]
        if len(set(self.names)) != len(self.names):
            raise InputError("OuterLoop: parameter names repeat; each tensor needs its own name")
        self.arrays: list[np.ndarray] = []
        for n, a in items:
            if not isinstance(a, np.ndarray) or a.dtype not in (np.float32, np.float64):
                raise InputError(f"parameter {n!r}: expected a float32 or float64 NumPy array, not "
                                 f"{getattr(a, 'dtype', type(a).__name__)}")
            if not a.flags.c_contiguous or not a.flags.writeable:
                raise InputError(f"parameter {n!r}: the array must be C-contiguous and writable (it is updated in place)")
            self.arrays.append(a)
        self.schedule = Schedule(DEFAULT_SCHEDULE if sync_every is None else sync_every)
        for label, v in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                raise InputError(f"{label}={v!r}: expected a finite number >= 0")
        if outer_momentum >= 1:
            raise InputError(f"outer_momentum={outer_momentum!r}: must be below 1")
        self.outer_lr, self.outer_momentum, self.nesterov = float(outer_lr), float(outer_momentum), bool(nesterov)
        if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= len(items):
            raise InputError(f"fragments={fragments!r}: expected an int from 1 to the number of tensors ({len(items)})")
        if isinstance(overlap, bool):
            self.delay = -1 if overlap else 0  # -1: automatic, from the interval in force
        elif isinstance(overlap, int) and overlap >= 0:
            self.delay = int(overlap)
        else:
            raise InputError(f"overlap={overlap!r}: expected True, False or a number of steps >= 0")
        if warmup_codec_params is not None and warmup_codec is None:
            raise InputError("warmup_codec_params given without warmup_codec=; name the codec they belong to")
        if codec is None:
            if codec_params is not None:
                raise InputError("codec_params given without codec=; name the codec they belong to")
            if warmup_codec is not None:
                raise InputError("warmup_codec given without codec=; name both (or neither: the defaults)")
            codec, codec_params = DEFAULT_CODEC, dict(DEFAULT_CODEC_PARAMS)
            warm_codec, warm_params = DEFAULT_WARMUP_CODEC, dict(DEFAULT_WARMUP_CODEC_PARAMS)
        else:
            codec_params = dict(codec_params or {})
            warm_codec, warm_params = ((codec, codec_params) if warmup_codec is None
                                       else (warmup_codec, dict(warmup_codec_params or {})))
        check_codec(codec, codec_params)
        check_codec(warm_codec, warm_params)
        #: seconds the constructor waited for the daemon's codec kernels (0 when they were loaded)
        self.kernels_seconds = _load_kernels(client, [(codec, codec_params), (warm_codec, warm_params)],
                                             KERNELS_TIMEOUT if timeout is None else timeout)
        self.codec, self.codec_params = codec, codec_params
        self.warmup_codec, self.warmup_codec_params = warm_codec, warm_params
        self.timeout = timeout
        self.pull, self.push = pull, push
        sizes = [a.size for a in self.arrays]
        self.fragments = [_Fragment(k, fragments, m, self.names, sizes) for k, m in enumerate(_split(sizes, fragments))]
        self.step_count = 0  #: inner steps taken
        self.syncs = 0  #: syncs started
        self.slot = 0  #: which fragment syncs next (round robin)
        self.next_sync = 0  #: the step count at which the next sync starts (set by snapshot)
        self.bytes_sent_total = 0
        self.last_stats: dict[str, Any] = {"bytes_sent": 0, "syncs": 0, "step": 0}
        self._started = False
        self.snapshot()

    def settings(self) -> dict[str, Any]:
        """The settings in force with every default resolved (the codec of the warm-up syncs and of
        the later ones, the schedule, the outer optimizer): what a log or a benchmark record should
        keep, since "the defaults" change between releases."""
        return {"sync_every": self.schedule.describe(), "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum, "nesterov": self.nesterov,
                "fragments": len(self.fragments), "overlap": {-1: True, 0: False}.get(self.delay, self.delay),
                "codec": self.codec, "codec_params": dict(self.codec_params),
                "warmup_codec": self.warmup_codec, "warmup_codec_params": dict(self.warmup_codec_params)}

    # -- state ------------------------------------------------------------------------------------
    def snapshot(self) -> None:
        """Take the current arrays as the outer parameters (after the processes made them identical,
        e.g. by a broadcast). The constructor calls it; call it again if the arrays were broadcast
        after the loop was made and no step was taken yet."""
        if self.pull is not None:
            self.pull()
        for f in self.fragments:
            for i, off in zip(f.members, f.offsets):
                f.outer[off:off + self.arrays[i].size] = self.arrays[i].reshape(-1)
            if f.momentum is not None:
                f.momentum[...] = 0
        self.next_sync = self._interval(0)

    def _interval(self, step: int) -> int:
        return max(1, self.schedule.at(step) // len(self.fragments))

    def _delay(self, step: int) -> int:
        if self.delay >= 0:
            return self.delay
        return max(1, self._interval(step) // 2)

    # -- the loop ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Count one inner step; apply results that are due and start (or run) a sync when one is
        due. Returns True when a sync started at this step."""
        self.step_count += 1
        t = self.step_count
        for f in self.fragments:
            if f.handle is not None or f.pending is not None:
                if f.apply_at <= t:
                    self._finish(f, mix=True)
        if t < self.next_sync:
            return False
        f = self.fragments[self.slot % len(self.fragments)]
        if f.handle is not None or f.pending is not None:  # the previous sync of this fragment: first
            self._finish(f, mix=True)
        h_now = self.schedule.at(t - 1)
        warm = h_now < self.schedule.final
        lr = WARMUP_OUTER_LR if warm else self.outer_lr
        m = 0.0 if warm else self.outer_momentum
        self._start(f, lr, m, warm)
        self.slot += 1
        self.syncs += 1
        self.next_sync = t + self._interval(t)
        d = self._delay(t - 1)
        f.apply_at = t + d
        if d == 0:
            self._finish(f, mix=False)
        return True

    def _start(self, f: _Fragment, lr: float, m: float, warm: bool = False) -> None:
        if self.pull is not None:
            self.pull()
        if f.buf is None:
            f.buf = self.client.buffer((max(f.numel, 1),), np.float32)
            f.buf[...] = 0
        buf = f.buf
        for i, off in zip(f.members, f.offsets):
            a = self.arrays[i].reshape(-1)
            np.subtract(f.outer[off:off + a.size], a, out=buf[off:off + a.size], casting="same_kind")
        codec, params = (self.warmup_codec, self.warmup_codec_params) if warm else (self.codec, self.codec_params)
        # One name per fragment whatever the codec: the daemon keeps codec state per name
        # (StateStore), so the first sync after the warm-up replaces the warm-up codec's state
        # (its error feedback, 4 bytes per parameter) instead of keeping it for the whole job.
        name = f"diloco/{f.label}"
        f.handle = self.client.allreduce_async(buf, op="mean", name=name, codec=codec, **params)
        f.pending_lr, f.pending_m = lr, m

    def _receive(self, f: _Fragment) -> None:
        h = f.handle
        if h is None:
            return
        f.handle = None
        res = h.wait(self.timeout)
        f.pending = res if res is not None else f.buf
        st = dict(h.stats)
        sent = int(st.get("bytes_sent", 0) or 0)
        self.bytes_sent_total += sent
        self.last_stats = {"bytes_sent": sent, "bytes_received": int(st.get("bytes_received", 0) or 0),
                           "syncs": self.syncs, "step": self.step_count, "fragment": f.index,
                           "sync_every": self.schedule.at(max(0, self.step_count - 1)),
                           "codec": st.get("codec", self.codec), "seconds": float(st.get("seconds", 0.0) or 0.0),
                           "bytes_sent_total": self.bytes_sent_total,
                           "state_bytes": int(st.get("state_bytes", 0) or 0)}

    def _finish(self, f: _Fragment, mix: bool) -> None:
        self._receive(f)
        avg = f.pending
        if avg is None:
            return
        f.pending = None
        n = f.numel
        lr, m = f.pending_lr, f.pending_m
        outer = f.outer[:n]
        avg = avg[:n]
        # The same ufuncs in the same order on every process, on bit-identical inputs: the outer
        # parameters (and momentum) stay bit-identical.
        if m > 0:
            if f.momentum is None:
                f.momentum = np.zeros(max(n, 1), np.float32)
            mom = f.momentum[:n]
            np.multiply(mom, np.float32(m), out=mom)
            np.add(mom, avg, out=mom)
            if self.nesterov:
                upd = np.multiply(mom, np.float32(m))
                np.add(upd, avg, out=upd)
            else:
                upd = mom.copy()
        else:
            upd = np.array(avg, dtype=np.float32, copy=True)
        np.multiply(upd, np.float32(lr), out=upd)
        np.subtract(outer, upd, out=outer)
        late = mix and self.delay != 0
        if late and self.pull is not None:
            # mirrored arrays were last refreshed when this sync started: the mix must keep the local
            # steps taken since, not overwrite them with that older copy
            self.pull()
        for i, off in zip(f.members, f.offsets):
            a = self.arrays[i].reshape(-1)
            o = outer[off:off + a.size]
            if late:
                # Streaming DiLoCo's mixing: keep part of the local steps taken while the result travelled
                a *= MIX_ALPHA
                a += (1.0 - MIX_ALPHA) * o
            else:
                a[...] = o
        if self.push is not None:
            self.push()

    def flush(self) -> None:
        """Wait for every all-reduce in flight and apply its result now (e.g. before evaluating the
        outer parameters at the end of training)."""
        for f in self.fragments:
            self._finish(f, mix=True)

    def outer_parameters(self) -> dict[str, np.ndarray]:
        """Copies of the outer parameters by name (bit-identical on every process after a sync)."""
        out = {}
        for f in self.fragments:
            for i, off in zip(f.members, f.offsets):
                a = self.arrays[i]
                out[self.names[i]] = f.outer[off:off + a.size].reshape(a.shape).copy()
        return out

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The outer parameters, momentum, counters and any result in flight (waited for and kept,
        to be applied at the same step after a restore): plain NumPy arrays and ints."""
        for f in self.fragments:
            self._receive(f)
        frags = []
        for f in self.fragments:
            frags.append({"outer": f.outer[:f.numel].copy(),
                          "momentum": None if f.momentum is None else f.momentum[:f.numel].copy(),
                          "pending": None if f.pending is None else np.array(f.pending[:f.numel], np.float32),
                          "apply_at": f.apply_at, "lr": f.pending_lr, "m": f.pending_m})
        return {"version": 1, "names": list(self.names), "step": self.step_count, "syncs": self.syncs,
                "slot": self.slot, "next_sync": self.next_sync, "bytes_sent_total": self.bytes_sent_total,
                "fragments": frags, "schedule": self.schedule.describe(), "codec": self.codec}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s outer state. The daemons' codec state (error feedback) belongs to
        another history: the job's is reset, a collective call, so every process loads at the same
        point. The local arrays are not changed (load the model's own checkpoint for them)."""
        if not isinstance(sd, dict) or sd.get("version") != 1:
            raise InputError("OuterLoop.load_state_dict: not a state of OuterLoop.state_dict() (version 1)")
        if list(sd.get("names", [])) != self.names or len(sd["fragments"]) != len(self.fragments):
            raise InputError("OuterLoop.load_state_dict: the saved state has other tensors or fragments "
                             f"({len(sd.get('names', []))} tensors, {len(sd.get('fragments', []))} fragments) than "
                             f"this loop ({len(self.names)}, {len(self.fragments)})")
        for f in self.fragments:  # results in flight belong to the history being replaced
            if f.handle is not None:
                f.handle.wait(self.timeout)
                f.handle = None
        for f, s in zip(self.fragments, sd["fragments"]):
            if np.asarray(s["outer"]).size != f.numel:
                raise InputError(f"OuterLoop.load_state_dict: fragment {f.index} has {np.asarray(s['outer']).size} "
                                 f"elements saved, {f.numel} here")
            f.outer[:f.numel] = np.asarray(s["outer"], np.float32)
            if s.get("momentum") is None:
                f.momentum = None
            else:
                f.momentum = np.zeros(max(f.numel, 1), np.float32)
                f.momentum[:f.numel] = np.asarray(s["momentum"], np.float32)
            f.pending = None if s.get("pending") is None else np.asarray(s["pending"], np.float32).copy()
            f.apply_at, f.pending_lr, f.pending_m = int(s["apply_at"]), float(s["lr"]), float(s["m"])
        self.step_count, self.syncs, self.slot = int(sd["step"]), int(sd["syncs"]), int(sd["slot"])
        self.next_sync, self.bytes_sent_total = int(sd["next_sync"]), int(sd.get("bytes_sent_total", 0))
        self.client.reset_state(self.timeout)

    def rejoin(self, root: int = 0) -> None:
        """Every process of the job calls this together (a collective): the outer state of process
        ``root`` (a survivor) goes to all, and every process's local parameters restart from the
        outer ones. A process restarted mid-run uses it to rejoin; results in flight are applied first."""
        for f in self.fragments:
            if f.handle is not None:
                f.handle.wait(self.timeout)
                f.handle = None
            f.pending = None
        counters = np.array([self.step_count, self.syncs, self.slot, self.next_sync], np.int64)
        counters = self.client.broadcast(counters, root=root, name="diloco/rejoin/counters", timeout=self.timeout)
        self.step_count, self.syncs, self.slot, self.next_sync = (int(v) for v in counters)
        for f in self.fragments:
            f.outer[...] = self.client.broadcast(f.outer, root=root, name=f"diloco/rejoin/{f.label}",
                                                 timeout=self.timeout)
            has_m = self.client.broadcast(np.array([0 if f.momentum is None else 1], np.int64), root=root,
                                          name=f"diloco/rejoin/m/{f.label}", timeout=self.timeout)
            if int(has_m[0]):
                mom = f.momentum if f.momentum is not None else np.zeros(max(f.numel, 1), np.float32)
                f.momentum = np.array(self.client.broadcast(mom, root=root, name=f"diloco/rejoin/mom/{f.label}",
                                                            timeout=self.timeout), np.float32)
            else:
                f.momentum = None
            for i, off in zip(f.members, f.offsets):
                a = self.arrays[i].reshape(-1)
                a[...] = f.outer[off:off + a.size]
        if self.push is not None:
            self.push()
        self.client.reset_state(self.timeout)


def _load_kernels(client: Client, configs: list[tuple[str, dict[str, Any]]], kernels_timeout: float) -> float:
    """Have the local daemon load the codecs' kernels and wait until it has. A daemon started with
    ``kernel_warmup = "used"`` loads a codec's kernels at its first call (seconds from Numba's cache,
    longer to compile), and DiLoCo's first sync comes after the first step: the training loop would
    stall there, every process waiting for the slowest daemon. With ``"all"`` (the daemon's
    default) they are loaded already and this returns at once. Returns the seconds waited."""
    t0 = time.monotonic()
    deadline = t0 + kernels_timeout
    pending = {(c, repr(sorted(p.items()))): (c, p) for c, p in configs}
    while pending:
        try:
            pending = {k: (c, p) for k, (c, p) in pending.items() if not client.warm(c, **p)}
        except ProtocolError:
            break  # a daemon older than the request: the first sync waits for the kernels instead
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return time.monotonic() - t0


def _split(sizes: list[int], count: int) -> list[list[int]]:
    """Whole tensors, in order, into ``count`` non-empty groups of about equal total size."""
    total = max(sum(sizes), 1)
    groups: list[list[int]] = [[] for _ in range(count)]
    acc = 0
    for i, s in enumerate(sizes):
        groups[min(count - 1, (acc + s // 2) * count // total)].append(i)
        acc += s
    if all(groups):
        return groups
    n = len(sizes)  # a few large tensors: fall back to equal counts of tensors
    return [list(range(k * n // count, (k + 1) * n // count)) for k in range(count)]
