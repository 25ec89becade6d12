"""``birdnet bench tta``'s transformer trained by ``bnt.DiLoCo`` itself, 4 workers in one process, no daemons.

    python -m birdnet.bench.tools.diloco_loop_sim                                     # DiLoCo's defaults
    python -m birdnet.bench.tools.diloco_loop_sim --opts '{"overlap": false}' --steps 400
    python -m birdnet.bench.tools.diloco_loop_sim --codec q8 --block 64 --ef          # a low-bit codec, emulated
    python -m birdnet.bench.tools.diloco_loop_sim --codec auto                        # the codecs bnt.DiLoCo picks
    python -m birdnet.bench.tools.diloco_loop_sim --codec ring                        # ... run by the real codec and ring
    python -m birdnet.bench.tools.diloco_loop_sim --overlap-from-step 64 --codec fp16  # the H=16 syncs overlapped
    python -m birdnet.bench.tools.diloco_loop_sim --ddp --steps 600                   # gradients averaged every step

The task, the batches, the evaluation and the target are ``birdnet bench tta --task lm``'s (``--seed``,
default 0; 4 ranks; target Gloo DDP's loss after 300 steps x 1.02 on the idle VM: 1.7875 for seed 0), and the outer loop
is the real one (``bnt.DiLoCo`` over ``birdnet.client.diloco.OuterLoop``, with ``--opts`` as its
keywords): only the all-reduce is replaced, by an in-process mean of the 4 workers' buffers (one
thread per worker) with the codec emulated in NumPy:

``none``  the exact mean in float32
``fp16``  the ring's float16 partial sums: every hop rounds the running sum to float16
``q8``, ``q4``, ``q2``  block quantisation: each worker's buffer (plus its error-feedback residual with
          ``--ef``) in blocks of ``--block`` values, each block scaled by its absolute maximum and
          rounded to the nearest of 127 (q8), 7 (q4) or 1 (q2: -1, 0, 1) steps a side; the running
          sum is quantised again at every hop of the ring (the worst case of a codec that forwards
          partial sums)
``q2n``   ``lowbit`` bits 2 with ``midrise=True``: +-0.5 and +-1.5 steps, the block's absolute
          maximum at 1.5 (four levels where ``q2`` has three, no zero)
``auto``  each sync with the codec ``bnt.DiLoCo`` names for it (so the warm-up syncs may differ):
          ``none``, ``fp16``, or ``lowbit`` as ``q<bits>`` (``q2n``) with its ``error_feedback``
``ring``  each sync with the codec ``bnt.DiLoCo`` names for it, birdnet's real codec through the
          real ring algorithm (birdnet.ring.dense over an in-memory transport, as the daemons run
          it: for ``lowbit`` every hop's re-encoding and its error feedback, bit for bit; a gathered
          codec such as ``sparseloco`` through birdnet.ring.gather, the payloads summed in rank
          order), the sum divided by 4; bytes per node are the ring's payload bytes as counted by
          the transport

So the steps to the target should be what ``birdnet bench tta`` measures for the same options (up
to the codec's emulation); the time is not measured here (use the bench). Bytes per sync are
estimated from the codec (ring all-reduce, 4 nodes: each node sends 2 x 3/4 of the payload).
Prints one JSON line: the options, steps to target, syncs, estimated MB per node, the curve.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import numpy as np

#: the target of each seed: Gloo DDP's loss after 300 steps x 1.02 (docs/slowlink.md, Time to target)
TARGETS = {0: 1.7875, 1: 1.8049, 2: 1.8005}


class _Handle:
    def __init__(self, coll: "_Collective", key: tuple, rank: int) -> None:
        self.coll, self.key, self.rank = coll, key, rank
        self.stats: dict[str, Any] = {}

    def wait(self, timeout: float | None = None) -> np.ndarray:
        res, nbytes = self.coll.result(self.key, self.rank)
        self.stats = {"bytes_sent": nbytes, "codec": self.key[0]}
        return res


class _Collective:
    """The mean of the workers' buffers of one (name, call) key, computed once all have arrived."""

    def __init__(self, world: int, codec: str, block: int, ef: bool) -> None:
        self.world, self.codec, self.block, self.ef = world, codec, block, ef
        self.cv = threading.Condition()
        self.bufs: dict[tuple, dict[int, np.ndarray]] = {}
        self.done: dict[tuple, tuple[np.ndarray, int]] = {}
        self.residual: dict[tuple[str, int], np.ndarray] = {}
        self.calls: dict[tuple[str, int], int] = {}
        self.spec: dict[str, tuple] = {}  # with codec "auto": each name's (codec, bits, ef) as OuterLoop asked
        self.state: dict[tuple, list] = {}  # with codec "ring": each (name, codec, params)'s state on every node
        self.round = 0

    def start(self, buf: np.ndarray, name: str, rank: int, spec: tuple = ()) -> _Handle:
        with self.cv:
            if spec:
                self.spec[name] = spec
            n = self.calls.get((name, rank), 0)
            self.calls[(name, rank)] = n + 1
            key = (name, n)
            self.bufs.setdefault(key, {})[rank] = buf.copy()
            self.cv.notify_all()
        return _Handle(self, key, rank)

    def result(self, key: tuple, rank: int) -> tuple[np.ndarray, int]:
        with self.cv:
            self.cv.wait_for(lambda: key in self.done or len(self.bufs.get(key, {})) == self.world)
            if key not in self.done:
                self.round = key[1]
                self.done[key] = self._reduce(key[0], [self.bufs[key][r] for r in range(self.world)])
            return self.done[key][0].copy(), self.done[key][1]

    def _q(self, x: np.ndarray, levels: float) -> np.ndarray:
        n = x.size
        pad = (-n) % self.block
        xb = np.concatenate([x, np.zeros(pad, np.float32)]).reshape(-1, self.block)
        if levels < 0:  # "q2n": 4 levels without a zero, +-0.5 and +-1.5 steps, the largest at the block's max
            scale = np.abs(xb).max(axis=1, keepdims=True) / 1.5
            scale[scale == 0] = 1.0
            q = np.clip(np.floor(xb / scale) + 0.5, -1.5, 1.5) * scale
            return q.reshape(-1)[:n].astype(np.float32)
        scale = np.abs(xb).max(axis=1, keepdims=True) / levels
        scale[scale == 0] = 1.0
        q = np.round(xb / scale) * scale
        return q.reshape(-1)[:n].astype(np.float32)

    def _ring(self, name: str, xs: list[np.ndarray]) -> tuple[np.ndarray, int]:
        """The real codec through the real ring algorithm, in memory (birdnet.bench.tools.sim_codec's round)."""
        from birdnet.codecs import Pattern, Payload, RoundContext, get_codec
        from birdnet.ring.dense import ring_allreduce
        from birdnet.ring.transport import MemoryRing

        cname, params = self.spec[name]
        n, W = xs[0].size, self.world
        codec = get_codec(cname, **params)
        if codec.pattern not in (Pattern.SUMMABLE, Pattern.GATHERED):
            raise SystemExit(f"--codec ring runs summable and gathered codecs, not {cname!r} ({codec.pattern.value})")
        t = self.round
        states = self.state.setdefault((name, cname, json.dumps(params, sort_keys=True)),
                                       [codec.new_state(n) for _ in range(W)])
        cs = [RoundContext(job="sim", name=name, shape=(n,), round_id=t, rank=r, world=W, seed=t + 1,
                           tensor_round=t) for r in range(W)]
        pays = [codec.compress(x, c, st) for x, c, st in zip(xs, cs, states)]
        if codec.pattern == Pattern.GATHERED:
            return self._gather(codec, pays, cs, states, n)
        wires = [codec.wire_format(c, st) for c, st in zip(cs, states)]
        ring = MemoryRing(W)
        if wires[0] is not None:
            sums = ring.run(lambda tr: ring_allreduce(tr, pays[tr.rank].values, timeout=600.0, wire=wires[tr.rank]))
        else:
            sums = ring.run(lambda tr: ring_allreduce(tr, pays[tr.rank].values, timeout=600.0,
                                                      wire_dtype=codec.wire_dtype))
        outs = []
        for r in range(W):
            o = np.empty(n, np.float32)
            codec.decompress(Payload(header=dict(pays[r].header), values=sums[r]), o, cs[r], states[r])
            codec.after_round(states[r], o, cs[r])
            outs.append(o)
        if not all(np.array_equal(outs[0], o) for o in outs[1:]):
            raise RuntimeError(f"the ring's results differ between nodes ({name})")
        return (outs[0] / np.float32(W)).astype(np.float32), max(tr.bytes_sent for tr in ring.transports)

    def _gather(self, codec, pays, cs, states, n: int) -> tuple[np.ndarray, int]:
        """A gathered codec's round as the daemons run it: every payload round the ring
        (birdnet.ring.gather), rebuilt from its bytes, summed in rank order and divided by W."""
        from birdnet.codecs.base import pack_buffers
        from birdnet.ring.gather import ring_allgather
        from birdnet.ring.transport import MemoryRing

        W = self.world
        wires = [pack_buffers(p) for p in pays]
        ring = MemoryRing(W)
        got = ring.run(lambda tr: ring_allgather(tr, wires[tr.rank][0], wires[tr.rank][1], timeout=600.0))
        outs = []
        for r in range(W):
            views = [[memoryview(np.ascontiguousarray(a)).cast("B") for a in b] for _h, b in got[r]]
            payloads = [codec.payload_from_wire(dict(h), v) for (h, _b), v in zip(got[r], views)]
            o = np.empty(n, np.float32)
            codec.decompress_sum(payloads, o, cs[r], divide_by=W)
            codec.after_round(states[r], o, cs[r])
            outs.append(o)
        if not all(np.array_equal(outs[0], o) for o in outs[1:]):
            raise RuntimeError("the gathered results differ between nodes")
        return outs[0], max(tr.bytes_sent for tr in ring.transports)

    def _reduce(self, name: str, xs: list[np.ndarray]) -> tuple[np.ndarray, int]:
        n = xs[0].size
        if self.codec == "ring":
            return self._ring(name, xs)
        codec, qbits, ef = self.codec, {"q8": 8, "q4": 4, "q2": 2, "q2n": -2}.get(self.codec, 0), self.ef
        if codec == "auto":
            codec, qbits, ef = self.spec[name]
        if codec == "none":
            s = np.zeros(n, np.float32)
            for x in xs:
                s += x
            bits = 32
        elif codec == "fp16":
            s = xs[0].astype(np.float16).astype(np.float32)
            for x in xs[1:]:
                s = (s + x.astype(np.float16).astype(np.float32)).astype(np.float16).astype(np.float32)
            bits = 16
        else:
            levels = -1.0 if qbits == -2 else float(2 ** (qbits - 1) - 1)
            qs = []
            for r, x in enumerate(xs):
                if ef:
                    e = self.residual.setdefault((name, r), np.zeros(n, np.float32))
                    y = x + e
                    q = self._q(y, levels)
                    e[...] = y - q
                else:
                    q = self._q(x, levels)
                qs.append(q)
            s = qs[0]
            for q in qs[1:]:
                s = self._q(s + q, levels)
            bits = abs(qbits) + 16.0 / self.block  # a 16-bit scale per block
        mean = (s / np.float32(self.world)).astype(np.float32)
        nbytes = int(2 * (self.world - 1) / self.world * n * bits / 8)
        return mean, nbytes


class _Client:
    """What OuterLoop asks of a Client, over the in-process collective."""

    def __init__(self, coll: _Collective, rank: int) -> None:
        self.coll, self.rank = coll, rank

    def buffer(self, shape, dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype)

    def allreduce_async(self, array, *, op="mean", name=None, codec=None, **params) -> _Handle:
        spec: tuple = ()
        if self.coll.codec == "ring":
            spec = (codec or "none", dict(params))
        elif self.coll.codec == "auto":
            if codec in ("none", "fp16"):
                spec = (codec, 0, False)
            elif codec == "lowbit":
                bits = int(params.get("bits", 8))
                if params.get("midrise"):
                    if bits != 2:
                        raise SystemExit("--codec auto emulates lowbit's midrise levels at 2 bits only (q2n)")
                    bits = -2
                spec = ("q", bits, bool(params.get("error_feedback", True)))
            else:
                raise SystemExit(f"--codec auto emulates none, fp16 and lowbit, not {codec!r}")
        return self.coll.start(np.asarray(array, np.float32).reshape(-1), str(name), self.rank, spec)

    def reset_state(self, timeout=None) -> None:
        pass

    def warm(self, codec, **params) -> bool:
        return True  # nothing to load: the codec is emulated


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--opts", default="{}", help="bnt.DiLoCo keywords as JSON (sync_every as a list)")
    ap.add_argument("--set", default="{}", help="birdnet.client.diloco module constants to set first, as JSON")
    ap.add_argument("--codec", default="q8", choices=["auto", "ring", "none", "fp16", "q8", "q4", "q2", "q2n"],
                    help="the emulated codec for every sync; auto: the one bnt.DiLoCo names for each sync "
                    "(none, fp16, or lowbit as qB with its bits and error feedback); ring: that codec itself through the "
                    "real ring algorithm in memory")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--ef", action="store_true", help="error feedback on the workers' quantisation (q8/q4)")
    ap.add_argument("--steps", type=int, default=320)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="the task's seed (data, initial model), as the bench's --seeds")
    ap.add_argument("--target", type=float, default=None, help="default: the seed's (0-2: TARGETS)")
    ap.add_argument("--overlap-from-step", type=int, default=0, help="from this step on, overlap=True (the syncs "
                    "applied half an interval late, mixed): e.g. 64, the default schedule's first H=16 sync on")
    ap.add_argument("--ddp", action="store_true", help="no DiLoCo: the gradients of the 4 shards averaged every step "
                    "(what DDP computes), for the loss at equal steps")
    a = ap.parse_args()
    import torch

    import birdnet.client.diloco as dl
    import birdnet.client.torch as bnt
    from birdnet.bench.torchtasks import make_task

    for k, v in json.loads(a.set).items():
        setattr(dl, k, tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v)
    torch.set_num_threads(1)
    opts = json.loads(a.opts)
    if isinstance(opts.get("sync_every"), list):
        opts["sync_every"] = tuple(tuple(x) if isinstance(x, list) else x for x in opts["sync_every"])
    if a.target is None:
        if a.seed not in TARGETS:
            raise SystemExit(f"--seed {a.seed}: no known target; give --target")
        a.target = TARGETS[a.seed]
    task = make_task("lm", a.seed)
    W = a.world
    if a.ddp:
        ddp(task, a)
        return
    coll = _Collective(W, a.codec, a.block, a.ef)
    models, opts_ = [], []
    for r in range(W):
        torch.manual_seed(a.seed)
        m = task.model()
        inner = task.optimizer(m.parameters(), task.lr)
        models.append(m)
        opts_.append(bnt.DiLoCo(inner, named_parameters=m.named_parameters(), client=_Client(coll, r), **opts))
    torch.manual_seed(a.seed)
    evalm = task.model()
    curve: list[tuple[int, float]] = []
    sent = [0] * W
    barrier = threading.Barrier(W + 1)
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            for step in range(a.steps):
                if a.overlap_from_step and step == a.overlap_from_step:
                    opts_[r].outer_loop.delay = -1  # what overlap=True sets: half the interval in force
                x, y = task.batch(r, W, step)
                opts_[r].zero_grad()
                task.loss(models[r], x, y).backward()
                opts_[r].step()
                if (step + 1) % a.eval_every == 0:
                    barrier.wait()
                    barrier.wait()
            sent[r] = opts_[r].outer_loop.bytes_sent_total
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            barrier.abort()

    t0 = time.time()
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(W)]
    for t in threads:
        t.start()
    for step in range(a.eval_every, a.steps + 1, a.eval_every):
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            break
        outer = opts_[0].outer_loop.outer_parameters()
        same = all(all(np.array_equal(outer[k], v) for k, v in o.outer_loop.outer_parameters().items())
                   for o in opts_[1:])
        with torch.no_grad():
            for k, p in evalm.named_parameters():
                p.copy_(torch.from_numpy(outer[k]))
        curve.append((step, round(task.evaluate(evalm)["val_loss"], 4)))
        if not same:
            errors.append(RuntimeError(f"outer parameters differ at step {step}"))
        barrier.wait()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    hit = next((s for s, v in curve if v <= a.target), None)
    at = {s: v for s, v in curve}
    print(json.dumps({"seed": a.seed, "opts": a.opts, "set": a.set, "codec": a.codec, "block": a.block, "ef": a.ef,
                      "steps_to_target": hit, "syncs": opts_[0].outer_loop.syncs,
                      "mb_per_node": round(max(sent) / 1e6, 2), "loss_300": at.get(300),
                      "loss_at_end": curve[-1][1] if curve else None, "curve": curve,
                      "wall_s": round(time.time() - t0)}))


def ddp(task, a) -> None:
    """One model, each step's gradient the mean of the W shards' (DDP's arithmetic, one process)."""
    import torch
    t0 = time.time()
    torch.manual_seed(a.seed)
    m = task.model()
    opt = task.optimizer(m.parameters(), task.lr)
    curve = []
    for step in range(a.steps):
        opt.zero_grad()
        for r in range(a.world):
            x, y = task.batch(r, a.world, step)
            (task.loss(m, x, y) / a.world).backward()
        opt.step()
        if (step + 1) % a.eval_every == 0:
            curve.append((step + 1, round(task.evaluate(m)["val_loss"], 4)))
    hit = next((s for s, v in curve if v <= a.target), None)
    at = {s: v for s, v in curve}
    print(json.dumps({"ddp": True, "steps_to_target": hit, "loss_300": at.get(300), "loss_at_end": curve[-1][1],
                      "curve": curve, "wall_s": round(time.time() - t0)}))


if __name__ == "__main__":
    main()
