"""``birdnet bench train``: N workers train a model data-parallel through real birdnet daemons,
once per codec and per seed; a table of the final metric (mean and spread over seeds), bytes sent
per worker and wall time, whether every node ended with identical parameters, and plots of the
metric against steps (epochs) and against bytes sent.

``--task mlp`` (the default) is a NumPy MLP; ``--task cnn`` and ``--task lm`` train PyTorch models
(birdnet.bench.torchtasks: a small CNN on 16x16 digits with momentum SGD, a small causal
transformer on Python's own sources with AdamW) through ``birdnet.client.torch.DistributedOptimizer``
with only ``codec=`` set, as a user would (``--adapter JSON`` passes further keywords).

The main task is MNIST-1D (generated offline by the ``mnist1d`` package): a 2x512 MLP reaches about
75% dense and naive sparsification loses ~20 points, so compressors can be told apart;
scikit-learn's digits (``--data digits``) is too easy to discriminate.

Codecs are given as ``name:key=value:...``; with a ``momentum`` parameter the codec carries the
momentum (momentum correction) and the workers apply its result with plain SGD; otherwise the
workers apply momentum SGD to the average.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="birdnet bench train", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="mlp", choices=["mlp", "cnn", "lm"],
                   help="mlp: NumPy MLP on --data (default); cnn, lm: PyTorch through the adapter")
    p.add_argument("--nodes", type=int, default=4, help="daemons, one worker each (default 4)")
    p.add_argument("--data", default="mnist1d", choices=["mnist1d", "digits"], help="--task mlp only")
    p.add_argument("--codecs", default="none", help="comma-separated codec specs (see birdnet bench allreduce)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=int, default=15, help="--task mlp")
    p.add_argument("--steps", type=int, default=None, help="--task cnn/lm (default: the task's, 300 / 400)")
    p.add_argument("--eval-every", type=int, default=None, help="--task cnn/lm: steps between evaluations")
    p.add_argument("--adapter", default="{}", help="--task cnn/lm: JSON of extra DistributedOptimizer keywords")
    p.add_argument("--restore-at", type=int, default=None, metavar="STEP",
                   help="--task cnn/lm: before STEP, restore the optimizer from its state_dict() into a fresh one")
    p.add_argument("--lr", type=float, default=None, help="default: 0.05 (mlp), the task's (cnn 0.05, lm 2e-3)")
    p.add_argument("--momentum", type=float, default=0.9, help="--task mlp: momentum for codecs without their own")
    p.add_argument("--batch", type=int, default=None, help="per worker (default: mlp 32, cnn 32, lm 16)")
    p.add_argument("--hidden", default="512,512", help="--task mlp")
    p.add_argument("--json", metavar="FILE", help="write all results (histories included) here")
    p.add_argument("--plot", metavar="PREFIX", help="write PREFIX_epochs.png and PREFIX_bytes.png")
    a = p.parse_args(argv)
    if a.task != "mlp":
        return _torch_main(a, argv)
    a.lr = 0.05 if a.lr is None else a.lr
    a.batch = 32 if a.batch is None else a.batch
    from birdnet.bench.specs import label, parse_codecs
    from birdnet.bench.trainlib import load, one_thread_per_worker, train_worker

    one_thread_per_worker()

    codecs = parse_codecs(a.codecs)
    seeds = [int(s) for s in a.seeds.split(",")]
    t_all = time.monotonic()
    data = {seed: load(a.data, seed) for seed in seeds}  # generated once, shared by the workers

    def config(name: str, params: dict[str, Any], seed: int, job: str) -> dict[str, Any]:
        return {"data": a.data, "seed": seed, "epochs": a.epochs, "lr": a.lr, "momentum": a.momentum,
                "batch": a.batch, "hidden": tuple(int(h) for h in a.hidden.split(",")),
                "codec": None if name == "none" else name, "params": params, "job": job, "arrays": data[seed]}

    runs = _run_all(a.nodes, codecs, seeds, train_worker, config,
                    lambda r0: {"acc": r0["acc"], "loss": r0["loss"], "bytes_sent": r0["bytes_sent"],
                                "comm_seconds": r0["comm_seconds"], "history": r0["history"]},
                    lambda r0: f"accuracy {r0['acc']:.4f}, {r0['bytes_sent'] / 1e6:.1f} MB/worker")
    if runs is None:
        return 130
    meta = {"nodes": a.nodes, "data": a.data, "epochs": a.epochs, "lr": a.lr, "momentum": a.momentum,
            "batch": a.batch, "hidden": a.hidden, "seeds": seeds, "machine": f"{os.cpu_count()} cores, {os.uname().machine}",
            "command": "birdnet bench train " + " ".join(argv if argv is not None else sys.argv[1:]),
            "wall_seconds": time.monotonic() - t_all}
    summary = []
    for name, params in codecs:
        rs = [r for r in runs if r["codec"] == label(name, params)]
        accs = [r["acc"] for r in rs]
        summary.append({"codec": label(name, params), "acc_mean": statistics.mean(accs),
                        "acc_spread": (max(accs) - min(accs)) / 2, "accs": accs,
                        "loss_mean": statistics.mean(r["loss"] for r in rs),
                        "mb_sent_per_worker": statistics.mean(r["bytes_sent"] for r in rs) / 1e6,
                        "seconds_mean": statistics.mean(r["seconds"] for r in rs),
                        "identical_on_all_nodes": all(r["identical_on_all_nodes"] for r in rs)})
    print(f"# {meta['command']}\n# {a.nodes} workers, {a.data}, {a.epochs} epochs, batch {a.batch}/worker, "
          f"lr {a.lr}, momentum {a.momentum}; {meta['machine']} shared by all nodes")
    print(f"{'codec':<44} {'accuracy':>17} {'loss':>7} {'MB/worker':>10} {'wall s':>7}  per seed")
    for s in summary:
        print(f"{s['codec']:<44} {s['acc_mean'] * 100:>8.2f} +-{s['acc_spread'] * 100:>5.2f}% {s['loss_mean']:>7.3f} "
              f"{s['mb_sent_per_worker']:>10.1f} {s['seconds_mean']:>7.0f}  {[round(x * 100, 1) for x in s['accs']]}"
              f"{'' if s['identical_on_all_nodes'] else '  NODES DIFFER'}")
    _save(a, meta, summary, runs, _plot)
    return 0


def run_job(codec_label: str, seed: int, taken: AbstractSet[str] = frozenset()) -> str:
    """The job name of one run: a function of the codec and the seed, not of the run's place in
    the list, because the job name seeds the codecs' random draws (daemon/runner.py ``seed_for``):
    a configuration re-run alone then trains exactly as it did beside others. A repeat of the same
    configuration and seed in one invocation gets a suffix (each run needs fresh codec state)."""
    base = f"train-{hashlib.sha256(codec_label.encode()).hexdigest()[:12]}-s{seed}"
    job, i = base, 1
    while job in taken:
        i += 1
        job = f"{base}-{i}"
    return job


def _run_all(nodes: int, codecs, seeds: list[int], worker, config, fields, progress) -> list[dict[str, Any]] | None:
    """Every codec at every seed, one after another, on one local cluster of ``nodes`` daemons:
    ``config(name, params, seed, job)`` is the workers' configuration, ``fields(r0)`` what a run
    keeps of rank 0's result, ``progress(r0)`` what the progress line says of it. A run records
    whether every node ended with the same parameters. None when interrupted (Ctrl-C)."""
    from birdnet.bench.specs import label
    from birdnet.cluster import LocalCluster

    runs: list[dict[str, Any]] = []
    total = len(codecs) * len(seeds)
    with tempfile.TemporaryDirectory(prefix="birdnet-train-") as tmp:
        cl = LocalCluster(nodes, Path(tmp), peer_timeout=60.0, heartbeat_interval=1.0)
        try:
            with cl:
                k = 0
                jobs: set[str] = set()
                for name, params in codecs:
                    for seed in seeds:
                        k += 1
                        print(f"[{k}/{total}] {label(name, params)} seed {seed} ...", end="", file=sys.stderr, flush=True)
                        job = run_job(label(name, params), seed, jobs)
                        jobs.add(job)
                        cfg = config(name, params, seed, job)
                        t0 = time.monotonic()
                        res = cl.run(worker, cfg, timeout=7200)
                        seconds = time.monotonic() - t0
                        same = len({r["params_digest"] for r in res}) == 1
                        runs.append({"codec": label(name, params), "seed": seed, **fields(res[0]), "seconds": seconds,
                                     "identical_on_all_nodes": same})
                        print(f" {progress(res[0])}, {seconds:.0f} s{'' if same else ', NODES DIFFER'}", file=sys.stderr)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return None
    return runs


def _save(a, meta: dict[str, Any], summary: list[dict[str, Any]], runs: list[dict[str, Any]], plot) -> None:
    """--json FILE: everything (histories included); --plot PREFIX: ``plot(runs, PREFIX, meta)``."""
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    if a.plot:
        plot(runs, a.plot, meta)


def _torch_main(a, argv) -> int:
    """--task cnn / lm: every codec at the same steps and seeds through the PyTorch adapter."""
    from birdnet.bench.specs import label, parse_codecs
    from birdnet.bench.torchtasks import make_task, train_worker
    from birdnet.bench.trainlib import one_thread_per_worker

    one_thread_per_worker()
    codecs = parse_codecs(a.codecs)
    seeds = [int(s) for s in a.seeds.split(",")]
    adapter = json.loads(a.adapter)
    task = make_task(a.task, seeds[0], batch_per_rank=a.batch)
    steps, lr = a.steps or task.steps, a.lr or task.lr
    t_all = time.monotonic()

    def config(name: str, params: dict[str, Any], seed: int, job: str) -> dict[str, Any]:
        return {"task": a.task, "seed": seed, "steps": steps, "lr": lr, "batch_per_rank": a.batch,
                "codec": None if name == "none" else name, "params": params, "adapter": adapter,
                "eval_every": a.eval_every, "restore_at": a.restore_at, "job": job}

    runs = _run_all(a.nodes, codecs, seeds, train_worker, config,
                    lambda r0: {**r0["final"], "bytes_sent": r0["bytes_sent"], "warmup_steps": r0["warmup_steps"],
                                "warmup_bytes": r0["warmup_bytes"], "history": r0["history"],
                                "bytes_after_warmup_by_kind": r0.get("bytes_after_warmup_by_kind", {})},
                    lambda r0: f"{task.metric} {r0['final'][task.metric]:.4f}, {r0['bytes_sent'] / 1e6:.2f} MB/worker")
    if runs is None:
        return 130
    meta = {"task": a.task, "nodes": a.nodes, "steps": steps, "lr": lr, "batch": task.batch_per_rank,
            "adapter": adapter, "restore_at": a.restore_at, "seeds": seeds, "metric": task.metric,
            "machine": f"{os.cpu_count()} cores, {os.uname().machine}",
            "command": "birdnet bench train " + " ".join(argv if argv is not None else sys.argv[1:]),
            "wall_seconds": time.monotonic() - t_all}
    summary = []
    for name, params in codecs:
        rs = [r for r in runs if r["codec"] == label(name, params)]
        vals = [r[task.metric] for r in rs]
        after = [(r["bytes_sent"] - r["warmup_bytes"]) / max(1, steps - r["warmup_steps"]) for r in rs]
        summary.append({"codec": label(name, params), "metric_mean": statistics.mean(vals),
                        "metric_spread": (max(vals) - min(vals)) / 2, "values": vals,
                        "mb_sent_per_worker": statistics.mean(r["bytes_sent"] for r in rs) / 1e6,
                        "bytes_per_step_after_warmup": statistics.mean(after),
                        "warmup_steps": statistics.mean(r["warmup_steps"] for r in rs),
                        "seconds_mean": statistics.mean(r["seconds"] for r in rs),
                        "identical_on_all_nodes": all(r["identical_on_all_nodes"] for r in rs)})
    dense = next((s for s in summary if s["codec"] == "none"), None)
    pct = task.metric == "accuracy"
    print(f"# {meta['command']}\n# task {a.task}, {a.nodes} workers, {steps} steps, batch {task.batch_per_rank}/worker, "
          f"lr {lr}, adapter {adapter or 'defaults'}; {meta['machine']} shared by all nodes")
    print(f"{'codec':<36} {task.metric:>17} {'vs dense':>9} {'MB/worker':>10} {'x fewer':>8} {'warm-up':>8} "
          f"{'x fewer after':>13} {'wall s':>7}  per seed")
    for s in summary:
        m, sp = (s["metric_mean"] * 100, s["metric_spread"] * 100) if pct else (s["metric_mean"], s["metric_spread"])
        if dense is None:
            rel = whole = after = "-"
        else:
            d = dense["metric_mean"]
            rel = (f"{(s['metric_mean'] - d) * 100:+.2f}pt" if pct else f"{(s['metric_mean'] / d - 1) * 100:+.2f}%")
            whole = f"{dense['mb_sent_per_worker'] / s['mb_sent_per_worker']:.1f}"
            after = f"{dense['bytes_per_step_after_warmup'] / s['bytes_per_step_after_warmup']:.1f}"
        per_seed = [round(v * 100, 1) if pct else round(v, 4) for v in s["values"]]
        print(f"{s['codec']:<36} {m:>9.3f} +-{sp:>5.3f} {rel:>9} {s['mb_sent_per_worker']:>10.2f} {whole:>8} "
              f"{s['warmup_steps']:>8.0f} {after:>13} {s['seconds_mean']:>7.0f}  {per_seed}"
              f"{'' if s['identical_on_all_nodes'] else '  NODES DIFFER'}")
    _save(a, meta, summary, runs, _plot_torch)
    return 0


def _plot_torch(runs, prefix: str, meta) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    metric = meta["metric"]
    ylabel = "test accuracy (%)" if metric == "accuracy" else "validation loss (nats/byte)"
    for xkey, fname, xlabel in (("step", "steps", "step"), ("bytes_sent", "bytes", "MB sent per worker")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for codec in dict.fromkeys(r["codec"] for r in runs):
            hs = [r["history"] for r in runs if r["codec"] == codec]
            y = np.mean([[h[metric] for h in hist] for hist in hs], axis=0) * (100 if metric == "accuracy" else 1)
            x = np.mean([[h[xkey] for h in hist] for hist in hs], axis=0)
            if xkey == "bytes_sent":
                x = x / 1e6
            ax.plot(x, y, "o-", ms=3, label=codec)
        if xkey == "bytes_sent":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{meta['task']}, {meta['nodes']} workers (mean over seeds {meta['seeds']})")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(f"{prefix}_{fname}.png", dpi=110)


def _plot(runs, prefix: str, meta) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    for xkey, fname, xlabel in (("epoch", "epochs", "epoch"), ("bytes_sent", "bytes", "MB sent per worker")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for codec in dict.fromkeys(r["codec"] for r in runs):
            hs = [r["history"] for r in runs if r["codec"] == codec]
            acc = np.mean([[h["acc"] for h in hist] for hist in hs], axis=0)
            x = np.mean([[h[xkey] for h in hist] for hist in hs], axis=0)
            if xkey == "bytes_sent":
                x = x / 1e6
            ax.plot(x, acc * 100, "o-", ms=3, label=codec)
        if xkey == "bytes_sent":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{meta['data']}, {meta['nodes']} workers (mean over seeds {meta['seeds']})")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(f"{prefix}_{fname}.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
