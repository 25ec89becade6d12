"""``python -m birdnet.bench.ddp``: time to a target accuracy (or loss) under PyTorch DDP, on 4 nodes
in network namespaces with shaped links; DDP on Gloo (dense, PowerSGD hook, fp16 hook), DDP on the
birdnet backend (dense, and compressed through ``bnt.comm_hook``) and the optimizer wrapper.

Every configuration trains the same task (``birdnet.bench.torchtasks``: the CNN on 16x16 digits with
momentum SGD, or the byte-level transformer with AdamW) from the same seed, with the same batches
and steps, one training process per node inside that node's namespace (so Gloo's traffic crosses the
shaped links like the daemons'). Each rank evaluates every ``--eval-every`` steps; the clock stops
while it does, so times are training time. Needs root (ip netns), torch and scikit-learn.

Configurations (``--configs``, comma-separated):

``gloo``        DDP on Gloo
``powersgdN``   DDP on Gloo with PyTorch's PowerSGD hook of rank N (``powersgd1``, ``powersgd2``,
              ``powersgd4``; ``powersgd``: ``--powersgd-rank``), from 10 % of the steps, one bucket
``fp16``        DDP on Gloo with PyTorch's fp16 compression hook
``birdnet``     DDP on the birdnet backend, dense
``hook``        DDP on the birdnet backend with ``bnt.comm_hook`` and ``--codec``
``optimizer``   ``bnt.DistributedOptimizer`` (no DDP) with ``--codec``
``local``       no communication: each rank trains its own copy on its own batches; its step time
              is the compute of a step with all ranks sharing the machine, the floor of the others
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from birdnet.cluster import rank_results

CONFIGS = ("gloo", "powersgd1", "powersgd2", "powersgd4", "fp16", "birdnet", "hook", "optimizer", "local")
GLOO_CONFIGS = ("gloo", "fp16")


def powersgd_rank(cfg: str, default: int) -> int | None:
    """PowerSGD's matrix approximation rank of configuration ``cfg`` ("powersgd4": 4; "powersgd":
    ``default``), or None if ``cfg`` is no PowerSGD configuration."""
    if not cfg.startswith("powersgd"):
        return None
    tail = cfg[len("powersgd"):]
    if not tail:
        return default
    if not tail.isdigit() or int(tail) < 1:
        raise ValueError(f"configuration {cfg!r}: PowerSGD's rank must be a whole number >= 1, e.g. powersgd2")
    return int(tail)


def check_configs(configs: list[str]) -> list[str]:
    """The configurations of ``configs`` that are not known (empty: all are)."""
    bad = []
    for c in configs:
        try:
            known = c in CONFIGS or powersgd_rank(c, 2) is not None
        except ValueError:
            known = False
        if not known:
            bad.append(c)
    return bad


def wrap_ddp(model, cfg: str, *, steps: int, seed: int, powersgd_default_rank: int = 2, hook_state=None):
    """``model`` in DDP as configuration ``cfg`` has it (a Gloo or birdnet process group must be
    initialised), and the hook state it registered (None without one).

    PowerSGD gets a single bucket. Its hook chains three all-reduces per bucket through
    ``Future.then``; each callback starts the next all-reduce and blocks in ``wait()`` on the
    thread that completed the last one, one of ProcessGroupGloo's two worker threads. With two
    buckets (from its second step DDP splits the LM's 1.9 MB of gradients at its first bucket's
    1 MiB cap: 1.19 + 0.69 MB) two callbacks can hold both
    worker threads, each waiting for an all-reduce queued behind it that no thread is left to run:
    every rank waits, and Gloo's timeout, which guards operations that run, does not end it
    (py-spy after 150 s, on all 4 ranks: the main thread in backward, the two worker threads in
    ``compute_qs`` and ``unpack_uncompressed_tensors_and_allreduce_ps``). Or the two buckets'
    chains issue their all-reduces in different orders on different ranks, and Gloo, which matches
    collectives by the order they were issued, fails with "op.preamble.length <= op.nbytes. 1536 vs
    768 ... collective mismatch". An explicit ``bucket_cap_mb`` caps the first bucket as well (DDP
    uses its 1 MiB first bucket only when no cap is given), so every model below 1 GiB is one
    bucket here: one chain per step, one worker thread blocked, the same order on every rank.
    """
    import torch
    rank = powersgd_rank(cfg, powersgd_default_rank)
    if rank is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024)
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                 start_powerSGD_iter=max(2, steps // 10), random_seed=seed)
        net.register_comm_hook(state, ps.powerSGD_hook)
        return net, state
    net = torch.nn.parallel.DistributedDataParallel(model)
    if cfg == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif cfg == "hook":
        import birdnet.client.torch as bnt
        net.register_comm_hook(hook_state, bnt.comm_hook)
    return net, hook_state if cfg == "hook" else None


# -- one training process -------------------------------------------------------------------------
def worker(a: argparse.Namespace) -> dict[str, Any]:
    if a.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = a.iface
    import torch
    import torch.distributed as dist

    import birdnet.client.torch as bnt
    from birdnet.bench.specs import parse_spec
    from birdnet.bench.torchtasks import make_task, params_digest, train_steps
    from birdnet.client import Client, torch_dist

    torch.set_num_threads(1)
    task = make_task(a.task, a.seed)
    steps = a.steps or task.steps
    lr = a.lr or task.lr
    codec, params = parse_spec(a.codec)
    codec = None if codec == "none" else codec
    torch.manual_seed(a.seed)
    model = task.model()
    client = state = None
    cfg = a.config
    if cfg in GLOO_CONFIGS or powersgd_rank(cfg, a.powersgd_rank) is not None:
        from datetime import timedelta
        dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world,
                                timeout=timedelta(seconds=600))
    elif cfg in ("birdnet", "hook"):
        bnt.init_process_group(job=a.job, socket=a.socket, timeout=600)
    elif cfg == "optimizer":
        client = Client(a.socket, job=a.job)
    if cfg == "local":
        rank, world = a.rank, a.world
    elif client is not None:
        rank, world = client.rank, client.size
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
    if rank != a.rank:
        raise SystemExit(f"rank {rank} from the process group, {a.rank} expected")
    if cfg == "local":
        net, opt = model, task.optimizer(model.parameters(), lr)
    elif client is None:
        hook_state = bnt.HookState(codec=codec, codec_params=params) if cfg == "hook" else None
        net, state = wrap_ddp(model, cfg, steps=steps, seed=a.seed, powersgd_default_rank=a.powersgd_rank,
                              hook_state=hook_state)
        opt = task.optimizer(net.parameters(), lr)
    else:
        net = model
        opt = bnt.DistributedOptimizer(task.optimizer(model.parameters(), lr), named_parameters=model.named_parameters(),
                                       client=client, codec=codec, codec_params=params, timeout=600)
        bnt.broadcast_parameters(model.state_dict(), root_rank=0, client=client)
    history, step_times = train_steps(task, net, opt, rank, world, steps, a.eval_every,
                                      evaluate=lambda: task.evaluate(model))
    out = {"rank": rank, "history": history, "step_times": step_times, "digest": params_digest(model)}
    if client is not None:
        client.close()
    elif cfg in ("birdnet", "hook"):
        torch_dist.destroy()
    elif cfg != "local":
        dist.destroy_process_group()
    return out


# -- the driver -----------------------------------------------------------------------------------
def run_config(a, cfg: str, prefixes, addresses, sockets, k: int) -> list[dict[str, Any]]:
    port = 29500 + (os.getpid() + k) % 400
    cmds = []
    for r in range(a.nodes):
        cmd = [*prefixes[r], sys.executable, "-m", "birdnet.bench.ddp", "--worker", "--config", cfg,
               "--rank", str(r), "--world", str(a.nodes), "--master", f"{addresses[0]}:{port}",
               "--socket", sockets[r], "--job", f"ddp-{cfg}-{k}", "--task", a.task, "--seed", str(a.seed),
               "--steps", str(a.steps), "--lr", str(a.lr), "--eval-every", str(a.eval_every),
               "--codec", a.codec, "--powersgd-rank", str(a.powersgd_rank)]
        if prefixes[r]:
            cmd += ["--iface", "eth0"]
        cmds.append(cmd)
    outs = rank_results(cmds, a.config_timeout, cfg)
    return sorted(outs, key=lambda o: o["rank"])


def summarise(cfg: str, outs: list[dict[str, Any]], metric: str, target: float, higher: bool) -> dict[str, Any]:
    h0 = outs[0]["history"]
    # wall time: the slowest rank's training time at each evaluation
    secs = [max(o["history"][i]["seconds"] for o in outs) for i in range(len(h0))]
    hit = next((i for i, e in enumerate(h0) if (e[metric] >= target if higher else e[metric] <= target)), None)
    steps = [max(o["step_times"][s] for o in outs) for s in range(len(outs[0]["step_times"]))]
    steady = steps[min(5, len(steps) - 1):]
    return {"config": cfg, "final": h0[-1][metric], "best": (max if higher else min)(e[metric] for e in h0),
            "time_to_target_s": None if hit is None else secs[hit], "step_at_target": None if hit is None else h0[hit]["step"],
            "total_s": secs[-1], "median_step_s": statistics.median(steady), "step_s": steps,
            "identical": len({o["digest"] for o in outs}) == 1,
            "curve": [{"step": e["step"], "seconds": s, metric: e[metric], "train_loss": e["train_loss"]}
                      for e, s in zip(h0, secs)]}


def plot(results: list[dict[str, Any]], out: str) -> None:
    """The metric against training seconds, one line per configuration, one panel per result file."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results):
        m = res["meta"]
        for r in res["rows"]:
            ax.plot([c["seconds"] for c in r["curve"]], [c[m["metric"]] for c in r["curve"]], marker=".", label=r["config"])
        ax.axhline(m["target"], color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(f"{m['task']}, {m['nodes']} netns nodes, {m['rate']}")
        ax.set_xlabel("training seconds (slowest rank)")
        ax.set_ylabel(m["metric"])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m birdnet.bench.ddp", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate", default="1gbit", help="token-bucket rate of every link (e.g. 1gbit, 100mbit)")
    p.add_argument("--task", default="cnn", choices=["cnn", "lm"])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--codec", default="birdplus:density=0.01", help="codec spec of 'hook' and 'optimizer'")
    p.add_argument("--powersgd-rank", type=int, default=2, help="the rank of configuration 'powersgd'")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.0, help="0: the task's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--target", type=float, required=False, help="accuracy (cnn) or validation loss (lm) to reach")
    p.add_argument("--config-timeout", type=float, default=1200.0)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for k in ("config", "master", "socket", "job", "iface"):
        p.add_argument(f"--{k}", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--plot", nargs="+", metavar="FILE", help="OUT.png RESULT.json...: plot earlier results, run nothing")
    a = p.parse_args(argv)
    if a.plot:
        plot([json.loads(Path(f).read_text()) for f in a.plot[1:]], a.plot[0])
        return 0
    if a.worker:
        print(json.dumps(worker(a)), flush=True)
        return 0
    from birdnet.bench import netns
    from birdnet.cluster import LocalCluster
    from birdnet.config import Settings
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = check_configs(configs)
    if bad:
        p.error(f"unknown configuration(s) {bad}; choose from {', '.join(CONFIGS)} (powersgdN: any rank N >= 1)")
    ok, why = netns.available()
    if not ok:
        print(f"birdnet.bench.ddp: network namespaces unavailable: {why}", file=sys.stderr)
        return 2
    metric, higher = ("accuracy", True) if a.task == "cnn" else ("val_loss", False)
    target = a.target if a.target is not None else (0.9 if a.task == "cnn" else 2.5)
    rows = []
    with tempfile.TemporaryDirectory(prefix="birdnet-ddp-") as tmp, netns.NetnsCluster(a.nodes, a.rate) as nsc:
        prefixes = [nsc.exec_prefix(i) for i in range(a.nodes)]
        # birdnetd's own timeouts: its kernels compile off the ring thread (daemon/warmup.py), so a
        # codec's first round no longer silences a daemon for a minute (this needed 600 s before)
        d = Settings()
        with LocalCluster(a.nodes, Path(tmp), addresses=nsc.addresses, prefixes=prefixes,
                          peer_timeout=d.peer_timeout, heartbeat_interval=d.heartbeat_interval) as cl:
            for k, cfg in enumerate(configs):
                t0 = time.monotonic()
                print(f"[{k + 1}/{len(configs)}] {cfg} ...", end="", file=sys.stderr, flush=True)
                try:
                    outs = run_config(a, cfg, prefixes, nsc.addresses, cl.sockets, k)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    # one configuration failing (e.g. a timeout on an overloaded machine) leaves the
                    # others' rows; a timeout's output holds the hung ranks' stacks
                    detail = f"{exc}\n{getattr(exc, 'output', None) or ''}"
                    print(f" FAILED: {detail[-6000:]}", file=sys.stderr)
                    for i in range(a.nodes):
                        print(f"--- daemon {i}:\n{cl.log(i)[-1500:]}", file=sys.stderr)
                    rows.append({"config": cfg, "error": detail[-3000:]})
                    continue
                row = summarise(cfg, outs, metric, target, higher)
                rows.append(row)
                print(f" {metric} {row['final']:.3f}, to target {row['time_to_target_s']}, step "
                      f"{row['median_step_s'] * 1e3:.0f} ms ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    base = next((r for r in rows if r["config"] == "gloo"), None)
    for r in rows:
        if base is not None:
            r["step_speed_vs_gloo"] = base["median_step_s"] / r["median_step_s"]
            if base["time_to_target_s"] and r["time_to_target_s"]:
                r["speedup_to_target_vs_gloo"] = base["time_to_target_s"] / r["time_to_target_s"]
    meta = {"command": "python -m birdnet.bench.ddp " + " ".join(sys.argv[1:] if argv is None else argv), "nodes": a.nodes, "rate": a.rate, "task": a.task, "steps": a.steps, "seed": a.seed,
            "codec": a.codec, "powersgd_rank": a.powersgd_rank, "eval_every": a.eval_every, "metric": metric,
            "target": target, "machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end"}
    print(f"\n{a.task}, {a.nodes} netns nodes, {a.rate}, {a.steps} steps, target {metric} "
          f"{'>=' if higher else '<='} {target} ({meta['machine']})")
    print(f"{'config':<10} {'final':>7} {'to target (s)':>13} {'at step':>7} {'total (s)':>9} {'ms/step':>8} "
          f"{'x gloo/step':>11} {'x gloo to target':>16} {'identical':>9}")
    for r in rows:
        tt = f"{r['time_to_target_s']:.1f}" if r["time_to_target_s"] is not None else "-"
        st = f"{r['step_at_target']}" if r["step_at_target"] is not None else "-"
        sp = f"{r.get('step_speed_vs_gloo', float('nan')):.2f}"
        tg = f"{r['speedup_to_target_vs_gloo']:.2f}" if "speedup_to_target_vs_gloo" in r else "-"
        print(f"{r['config']:<10} {r['final']:>7.3f} {tt:>13} {st:>7} {r['total_s']:>9.1f} "
              f"{r['median_step_s'] * 1e3:>8.1f} {sp:>11} {tg:>16} {str(r['identical']):>9}")
    for r in failed:
        print(f"{r['config']:<10} failed: {r['error'][-200:]}")
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "rows": rows, "failed": failed}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
