"""How much of a real pseudo-gradient each codec loses (docs/codecs.md, "lowbit").

    python -m birdnet.bench.tools.lowbit_error [--syncs 8] [--every 16] [--workers 4]
    python -m birdnet.bench.tools.lowbit_error --closed [--syncs 12]

One process: ``--workers`` copies of the benchmark transformer (birdnet.bench.torchtasks, task
"lm", seed 0, AdamW) train on their own batches; every ``--every`` steps their pseudo-gradients
(outer minus local parameters, one flat float32 vector of 470,784) are averaged exactly and the
outer parameters take DiLoCo's Nesterov step (lr 0.7, momentum 0.9), so every codec sees the same
pseudo-gradients. Each codec configuration averages them too, on ``--workers`` in-memory nodes
through the real ring (birdnet.bench.tools.sim_codec.codec_round), keeping its own state between
syncs. Printed per configuration: the relative L2 error of one sync's average,
||avg - exact|| / ||exact||, its mean over the syncs, and that of the sum over all syncs (what error
feedback gives back later counts there), with the bytes a node sends per sync at that world size
(the ring's 2(N-1)/N of the encoded vector). ``gathered`` rows quantise each node's vector once and
sum in float32 (what Streaming DiLoCo and INTELLECT-1 send), to show what the ring's requantisation
at every hop costs.

``--closed``: each configuration of CLOSED trains its own workers, the outer step taking that
codec's average (what a run with it does), and the held-out loss of the outer parameters after the
last sync is printed.
"""
from __future__ import annotations

import argparse

import numpy as np

from birdnet.bench.tools.sim_codec import codec_round
from birdnet.codecs import get_codec
from birdnet.kernels import lowbit as K

CONFIGS = [("fp16", {}),
           ("lowbit", {"bits": 8}), ("lowbit", {"bits": 8, "error_feedback": False}),
           ("lowbit", {"bits": 8, "block": 256}),
           ("lowbit", {"bits": 4, "block": 32}), ("lowbit", {"bits": 4}), ("lowbit", {"bits": 4, "block": 128}),
           ("lowbit", {"bits": 4, "error_feedback": False}),
           ("lowbit", {"bits": 2}), ("lowbit", {"bits": 2, "error_feedback": False}),
           ("gathered", {"bits": 8}), ("gathered", {"bits": 4})]
CLOSED = [("fp16", {}), ("lowbit", {"bits": 8}), ("lowbit", {"bits": 8, "error_feedback": False}),
          ("lowbit", {"bits": 4}), ("lowbit", {"bits": 4, "error_feedback": False})]


def ring_bytes(name: str, p: dict, n: int, world: int) -> float:
    if name == "fp16":
        return 2 * (world - 1) / world * 2 * n
    if name == "gathered":
        return (world - 1) * K.nbytes(n, p["bits"], 64)
    return 2 * (world - 1) / world * K.nbytes(n, p.get("bits", 8), p.get("block", 64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--syncs", type=int, default=8)
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--closed", action="store_true", help="each configuration trains on its own averages")
    a = ap.parse_args()
    if a.closed:
        rows = [(name, p, closed_loop(name, p, a)) for name, p in CLOSED]
        print(f"\n{a.workers} workers, every {a.every} steps, {a.syncs} syncs: held-out loss of the outer parameters")
        for name, p, loss in rows:
            label = name + (" " + ", ".join(f"{k}={v}" for k, v in p.items()) if p else "")
            print(f"{label:<44} {loss:.4f}")
        return
    task, models, opts, flat, outer, mom, n = _workers(a)
    codecs = [(name, p, get_codec(name if name != "gathered" else "lowbit", **p)) for name, p in CONFIGS]
    states = [[c.new_state(n) for _ in range(a.workers)] for _, _, c in codecs]
    errs = [[] for _ in CONFIGS]
    sums = [np.zeros(n) for _ in CONFIGS]
    exact_sum = np.zeros(n)
    step = 0
    for t in range(a.syncs):
        step = _inner(task, models, opts, a, step)
        xs = [(outer - flat(m)).astype(np.float32) for m in models]
        exact = np.mean(np.array(xs, np.float64), axis=0)
        exact_sum += exact
        for i, (name, p, c) in enumerate(codecs):
            if name == "gathered":
                got = np.zeros(n, np.float32)
                for x in xs:
                    d = np.empty(n, np.float32)
                    K.encode(x, p["bits"], 64, deq=d)
                    got += d
            else:
                got = codec_round(c, xs, states[i], n, t, 0, 0, "pg")
            avg = got.astype(np.float64) / a.workers
            errs[i].append(np.linalg.norm(avg - exact) / np.linalg.norm(exact))
            sums[i] += avg
        # DiLoCo's outer step on the exact average; every worker restarts from the outer parameters
        mom = 0.9 * mom + exact
        outer = outer - 0.7 * (exact + 0.9 * mom)
        _restart(models, outer)
        print(f"sync {t + 1}/{a.syncs}: step {step}, val_loss {task.evaluate(models[0])['val_loss']:.3f}", flush=True)
    print(f"\n{a.workers} workers, every {a.every} steps, {a.syncs} syncs, {n:,} elements")
    print(f"{'configuration':<44} {'bytes/sync/node':>15} {'rel.err/sync':>12} {'max':>7} {'of the sum':>10}")
    for (name, p, _c), e, s in zip(codecs, errs, sums):
        label = name + (" " + ", ".join(f"{k}={v}" for k, v in p.items()) if p else "")
        tot = np.linalg.norm(s - exact_sum) / np.linalg.norm(exact_sum)
        print(f"{label:<44} {ring_bytes(name, p, n, a.workers):>15,.0f} {np.mean(e):>12.4f} {np.max(e):>7.4f} {tot:>10.4f}")



def _workers(a):
    """The bench transformer's workers from one start: task, models, optimizers, a flattener, the
    outer parameters (float64), their momentum and the parameter count."""
    import torch

    from birdnet.bench.torchtasks import make_task
    torch.set_num_threads(1)
    task = make_task("lm", 0)
    torch.manual_seed(0)
    models = [task.model() for _ in range(a.workers)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = [task.optimizer(m.parameters(), task.lr) for m in models]

    def flat(m):
        return torch.cat([q.detach().reshape(-1) for q in m.parameters()]).numpy().astype(np.float32)
    outer = flat(models[0]).astype(np.float64)
    return task, models, opts, flat, outer, np.zeros_like(outer), outer.size


def _restart(models, outer) -> None:
    """Every worker's parameters from the outer parameters."""
    import torch
    with torch.no_grad():
        for m in models:
            torch.nn.utils.vector_to_parameters(torch.from_numpy(outer.astype(np.float32)), m.parameters())


def _inner(task, models, opts, a, step: int) -> int:
    """``a.every`` inner steps of every worker on its own batches; the step count after them."""
    for _ in range(a.every):
        for r, (m, o) in enumerate(zip(models, opts)):
            x, y = task.batch(r, a.workers, step)
            o.zero_grad()
            task.loss(m, x, y).backward()
            o.step()
        step += 1
    return step

def closed_loop(name: str, p: dict, a) -> float:
    """DiLoCo with this codec's average in the outer step; the final held-out loss."""
    task, models, opts, flat, outer, mom, n = _workers(a)
    codec = get_codec(name, **p)
    states = [codec.new_state(n) for _ in range(a.workers)]
    step = 0
    for t in range(a.syncs):
        step = _inner(task, models, opts, a, step)
        xs = [(outer - flat(m)).astype(np.float32) for m in models]
        avg = codec_round(codec, xs, states, n, t, 0, 0, "pg").astype(np.float64) / a.workers
        mom = 0.9 * mom + avg
        outer = outer - 0.7 * (avg + 0.9 * mom)
        _restart(models, outer)
    loss = task.evaluate(models[0])["val_loss"]
    print(f"{name} {p}: {loss:.4f}", flush=True)
    return loss


if __name__ == "__main__":
    main()
