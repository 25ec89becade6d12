"""``birdnet bench tta``: wall-clock training time to a target validation loss, on N nodes in network
namespaces whose links are shaped (``--rate``), for the ways a PyTorch user can train on them.

Every variant trains the same task (``birdnet.bench.torchtasks``: ``lm``, the byte-level transformer
with AdamW, or ``cnn``, the CNN with momentum SGD) from the same seed with the same global batches,
one training process per node inside that node's namespace (Gloo's traffic crosses the shaped links
like the daemons'). Each rank evaluates every ``--eval-every`` steps with its clock paused, so the
times are training time only.

Variants (``--variants``, comma-separated):

``gloo``                 DDP on Gloo, dense fp32
``gloo-fp16``            DDP on Gloo with torch's ``fp16_compress_hook``
``codecs``               one variant per ``--codecs`` entry (``none``, ``marsit``,
                         ``birdplus:density=0.01``, ...): ``bnt.DistributedOptimizer`` with that codec
``diloco[:key=value...]`` ``bnt.DiLoCo`` with those keywords (``sync_every``, ``outer_lr``,
                         ``outer_momentum``, ``nesterov``, ``fragments``, ``overlap``, ``codec``;
                         ``codec.K=V`` goes to ``codec_params``); bare ``diloco``: its defaults
``solo``                 each rank trains alone, no exchange: the compute-only seconds per step

Any variant takes ``:steps=N`` to train longer than ``--steps`` (a mode may need more steps).

The report: the time to the target (the first evaluation at or below it; default: Gloo DDP's final
validation loss x 1.02), the speed-up against Gloo, the ratio to the compute-only limit (``solo``'s
median seconds per step x the steps Gloo needed to reach the target), bytes sent per node (the
node's interface counter in its namespace: everything its training process and daemon sent; on
loopback the adapter's own count), the validation loss at equal steps, and whether every node ends
with bit-identical parameters. For the CNN also the test accuracy at ``--steps`` and the mean of the
last ``ACCURACY_WINDOW`` evaluations to it, each against Gloo's in points, and with several seeds a
table over the seeds (the paired differences' mean and standard error). ``--plot`` draws validation
loss against seconds and against bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from birdnet.bench.cluster import rank_results
from birdnet.bench.specs import parse_spec
from birdnet.bench.ttareport import (  # noqa: F401 - the report's names, as before the split
    ACCURACY_SLACK,
    ACCURACY_WINDOW,
    SAME_RUN,
    TARGET_SLACK,
    _print_seeds,
    _results_of,
    identical,
    merge_ranks,
    node_bytes,
    plot,
    report,
    report_files,
    seeds_table,
    speedup,
    table,
    time_to_target,
)

KINDS = ("gloo", "gloo-fp16", "codec", "diloco", "solo")
#: DiLoCo keywords a variant may set (``codec.K=V`` goes to codec_params)
DILOCO_KEYS = ("sync_every", "outer_lr", "outer_momentum", "nesterov", "fragments", "overlap", "codec")


# -- variants -------------------------------------------------------------------------------------
def parse_variants(text: str, codecs: str) -> list[dict[str, Any]]:
    """The variants of ``--variants`` (``codecs`` expanded from ``--codecs``) as records
    ``{"label", "kind", "codec", "params", "options", "steps"}``; SystemExit naming a bad one."""
    out: list[dict[str, Any]] = []
    for item in _split_top(text):
        if item == "codecs":
            for c in [c.strip() for c in codecs.split(",") if c.strip()]:
                name, params = parse_spec(c)
                steps = params.pop("steps", None)
                out.append({"label": c, "kind": "codec", "codec": name, "params": params, "options": {},
                            "steps": steps})
            continue
        name, params = parse_spec(item)
        steps = params.pop("steps", None)
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise SystemExit(f"variant {item!r}: steps must be a whole number >= 1")
        if name in ("gloo", "gloo-fp16", "solo"):
            if params:
                raise SystemExit(f"variant {item!r}: {name} takes no parameters but steps=")
            out.append({"label": item, "kind": name, "codec": None, "params": {}, "options": {}, "steps": steps})
        elif name == "diloco":
            options: dict[str, Any] = {}
            cparams: dict[str, Any] = {}
            for k, v in params.items():
                if k.startswith("codec."):
                    cparams[k[len("codec."):]] = v
                elif k in DILOCO_KEYS:
                    options[k] = v
                else:
                    raise SystemExit(f"variant {item!r}: unknown DiLoCo keyword {k!r}; choose from "
                                     f"{', '.join(DILOCO_KEYS)}, codec.NAME=VALUE or steps")
            if cparams:
                options["codec_params"] = cparams
            out.append({"label": item, "kind": "diloco", "codec": None, "params": {}, "options": options,
                        "steps": steps})
        else:
            raise SystemExit(f"unknown variant {item!r}; choose from gloo, gloo-fp16, codecs (the --codecs "
                             "list), diloco[:key=value...], solo")
    labels = [v["label"] for v in out]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"variants repeat: {labels}")
    return out


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets (a JSON value such as DiLoCo's schedule
    ``sync_every=[[1,30],16]`` keeps its own)."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return [i.strip() for i in items if i.strip()]


# -- one training process -------------------------------------------------------------------------
def _tx_bytes(iface: str | None) -> int | None:
    """Bytes the node's interface has sent (its namespace's counter), or None on loopback."""
    if not iface:
        return None
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


def _adapter_bytes(stats: Any) -> int:
    """Bytes a birdnet optimizer's ``last_stats`` reports (a list of rounds or one dict)."""
    if isinstance(stats, dict):
        return int(stats.get("bytes_sent", 0) or 0)
    return sum(int(s.get("bytes_sent", 0) or 0) for s in stats or [])


def worker(v: dict[str, Any]) -> dict[str, Any]:
    """One rank of variant ``v`` (the driver's record plus rank, world, master, socket, job, iface,
    task, seed, steps, lr, eval_every); returns its curve, step times, bytes and parameter digest."""
    if v["iface"]:
        os.environ["GLOO_SOCKET_IFNAME"] = v["iface"]
    import torch
    import torch.distributed as dist

    import birdnet.client.torch as bnt
    from birdnet.bench.ddp import wrap_ddp
    from birdnet.bench.torchtasks import make_task, params_digest, train_steps
    from birdnet.client import Client

    torch.set_num_threads(1)
    task = make_task(v["task"], v["seed"])
    steps, lr, kind = int(v["steps"]), float(v["lr"] or task.lr), v["kind"]
    torch.manual_seed(v["seed"])
    model = task.model()
    client = None
    rank, world = v["rank"], v["world"]
    if kind in ("gloo", "gloo-fp16"):
        from datetime import timedelta
        dist.init_process_group("gloo", init_method=f"tcp://{v['master']}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        net, _ = wrap_ddp(model, "fp16" if kind == "gloo-fp16" else "gloo", steps=steps, seed=v["seed"])
        opt = task.optimizer(net.parameters(), lr)
    elif kind == "solo":
        net, opt = model, task.optimizer(model.parameters(), lr)
    else:
        client = Client(v["socket"], job=v["job"])
        if (client.rank, client.size) != (rank, world):
            raise SystemExit(f"daemon says rank {client.rank} of {client.size}, {rank} of {world} expected")
        net = model
        inner = task.optimizer(model.parameters(), lr)
        if kind == "codec":
            opt = bnt.DistributedOptimizer(inner, named_parameters=model.named_parameters(), client=client,
                                           codec=v["codec"], codec_params=v["params"] or None, timeout=600)
        else:
            opt = bnt.DiLoCo(inner, named_parameters=model.named_parameters(), client=client, **v["options"])
        bnt.broadcast_parameters(model.state_dict(), root_rank=0, client=client)
    # only a node's own namespace has an interface of its own to count (lo is the machine's)
    counter = v["iface"] if v["iface"] != "lo" else None
    tx0 = _tx_bytes(counter)
    sent = 0

    def count_bytes() -> None:
        nonlocal sent
        sent = _sent_so_far(opt, sent)

    def evaluate() -> dict[str, Any]:
        tx = _tx_bytes(counter)
        return {"wire_bytes": None if tx is None or tx0 is None else tx - tx0,
                "adapter_bytes": sent if client is not None else None, **_evaluate(task, model, opt)}

    history, step_times = train_steps(task, net, opt, rank, world, steps, v["eval_every"], evaluate=evaluate,
                                      after_step=count_bytes if client is not None else None)
    if hasattr(opt, "flush"):
        opt.flush()  # DiLoCo with overlap: the syncs in flight applied, as at the end of training
    out = {"rank": rank, "history": history, "step_times": step_times,
           "digest": _outer_digest(opt) if hasattr(opt, "outer_loop") else params_digest(model)}
    if hasattr(opt, "outer_loop"):
        out["settings"] = opt.outer_loop.settings()  # the defaults as resolved, kept with the row
        # seconds bnt.DiLoCo waited at construction (before the clock) for the daemon's codec kernels
        out["kernels_seconds"] = opt.outer_loop.kernels_seconds
    if client is not None:
        client.close()
    elif kind != "solo":
        dist.destroy_process_group()
    return out


def _sent_so_far(opt: Any, sent: int) -> int:
    """Bytes this process's optimizer has sent so far: DiLoCo keeps the total (its ``last_stats``
    describe the last sync, possibly several steps ago); DistributedOptimizer's describe this step."""
    stats = getattr(opt, "last_stats", None)
    if isinstance(stats, dict) and "bytes_sent_total" in stats:
        return int(stats["bytes_sent_total"])
    return sent + _adapter_bytes(stats)


def _evaluate(task, model, opt) -> dict[str, float]:
    """The task's metrics; for DiLoCo those of the outer parameters (identical on every node, what
    training hands over), with the rank's own local model's as ``local_*``."""
    loop = getattr(opt, "outer_loop", None)
    if loop is None:
        return task.evaluate(model)
    import torch
    local = {k: v.detach().clone() for k, v in model.named_parameters()}
    out = {f"local_{k}": v for k, v in task.evaluate(model).items() if k != "test_images"}
    with torch.no_grad():
        for k, v in loop.outer_parameters().items():
            dict(model.named_parameters())[k].copy_(torch.from_numpy(v))
        out.update(task.evaluate(model))
        for k, v in model.named_parameters():
            v.copy_(local[k])
    return out


def _outer_digest(opt) -> str:
    """sha256 over DiLoCo's outer parameters, in name order (the parameters every node must agree on;
    the local ones differ between syncs by design)."""
    import hashlib
    h = hashlib.sha256()
    for k, v in sorted(opt.outer_loop.outer_parameters().items()):
        h.update(k.encode())
        h.update(v.tobytes())
    return h.hexdigest()


# -- the report's arithmetic ----------------------------------------------------------------------
def run_variant(a, v: dict[str, Any], seed: int, prefixes, addresses, sockets, k: int, iface: str | None):
    port = 29500 + (os.getpid() + k) % 400
    cmds = []
    for r in range(a.nodes):
        spec = dict(v, rank=r, world=a.nodes, master=f"{addresses[0]}:{port}", socket=sockets[r],
                    job=f"tta-{k}", iface=iface, task=a.task, seed=seed, steps=v["steps"] or a.steps, lr=a.lr,
                    eval_every=a.eval_every)
        cmds.append([*prefixes[r], sys.executable, "-m", "birdnet.bench.tta", "--worker", json.dumps(spec)])
    outs = rank_results(cmds, a.variant_timeout, v["label"])
    return merge_ranks(sorted(outs, key=lambda o: o["rank"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="birdnet bench tta", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--task", default="lm", choices=["lm", "cnn"])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate", default="20mbit", help="token-bucket rate of every node's link (20mbit, 100mbit, 1gbit)")
    p.add_argument("--variants", default="gloo,gloo-fp16,codecs,diloco,solo")
    p.add_argument("--codecs", default="marsit", help="the per-step codecs of variant 'codecs' (name:key=value,...)")
    p.add_argument("--steps", type=int, default=300, help="steps of every variant (and Gloo's, whose final loss sets the target)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; each gets its own target from its Gloo run")
    p.add_argument("--lr", type=float, default=0.0, help="0: the task's")
    p.add_argument("--eval-every", type=int, default=10, help="evaluate every K steps, the clock paused")
    p.add_argument("--target", type=float, help="the validation loss to reach (default: Gloo's final x 1.02)")
    p.add_argument("--loopback", action="store_true",
                   help="no namespaces: every node on 127.0.0.1, links unshaped (what runs without root)")
    p.add_argument("--variant-timeout", type=float, default=1800.0, help="seconds one variant's ranks may take")
    p.add_argument("--json", metavar="FILE", help="write the results (one object per seed) here")
    p.add_argument("--plot", metavar="FILE.png", help="plot validation loss against seconds and bytes")
    p.add_argument("--reuse", metavar="FILE", help="take the rows of variants already in this --json result (or its "
                   ".partial) of the same task, nodes, rate, steps and seed instead of running them again (the "
                   "report says which)")
    p.add_argument("--rerun", default="", metavar="NAMES", help="with --reuse: run these variants even if the file "
                   "has them (comma-separated labels or kinds: gloo, gloo-fp16, codecs, diloco, solo), e.g. "
                   "--rerun diloco to measure new DiLoCo defaults against the same Gloo, codec and solo rows")
    p.add_argument("--report", nargs="+", metavar="FILE", help="run nothing: one table per seed (and --json, --plot) "
                   "from the rows of earlier results (--json files or their .partial) of one task and links")
    p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))), flush=True)
        return 0
    if a.report:
        return report_files(a)
    if a.rerun and not a.reuse:
        p.error("--rerun only makes sense with --reuse FILE")
    variants = parse_variants(a.variants, a.codecs)
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, not {a.seeds!r}")
    if a.nodes < 2 or a.steps < 1 or a.eval_every < 1:
        p.error("--nodes must be >= 2, --steps and --eval-every >= 1")
    if a.target is None and not any(v["kind"] == "gloo" for v in variants):
        p.error("without the gloo variant there is no default target: give --target")
    from birdnet.bench import netns
    from birdnet.bench.cluster import LocalCluster
    from birdnet.config import Settings
    if not a.loopback:
        ok, why = netns.available()
        if not ok:
            print(f"birdnet bench tta: network namespaces unavailable ({why}); use --loopback", file=sys.stderr)
            return 2
    cmd = "birdnet bench tta " + " ".join(sys.argv[1:] if argv is None else argv)
    results: list[dict[str, Any]] = []
    for seed in seeds:
        rows: list[dict[str, Any]] = []
        reused = reusable(a, seed) if a.reuse else {}
        meta = {"command": cmd, "task": a.task, "nodes": a.nodes, "rate": "loopback (unshaped)" if a.loopback else a.rate,
                "steps": a.steps, "seed": seed, "eval_every": a.eval_every, "bytes": "adapter's count" if a.loopback
                else "interface tx counter of each node's namespace (training process + daemon)"}
        with tempfile.TemporaryDirectory(prefix="birdnet-tta-") as tmp, \
                (netns.NetnsCluster(a.nodes, a.rate) if not a.loopback else _Nothing()) as nsc:
            prefixes = [nsc.exec_prefix(i) for i in range(a.nodes)] if nsc else [[] for _ in range(a.nodes)]
            addresses = nsc.addresses if nsc else ["127.0.0.1"] * a.nodes
            d = Settings()
            with LocalCluster(a.nodes, Path(tmp), addresses=addresses if nsc else None, prefixes=prefixes,
                              peer_timeout=d.peer_timeout, heartbeat_interval=d.heartbeat_interval) as cl:
                for k, v in enumerate(variants):
                    if v["label"] in reused:
                        rows.append(dict(reused[v["label"]], reused_from=a.reuse))
                        print(f"[seed {seed} {k + 1}/{len(variants)}] {v['label']}: from {a.reuse}", file=sys.stderr)
                        continue
                    t0 = time.monotonic()
                    print(f"[seed {seed} {k + 1}/{len(variants)}] {v['label']} ...", end="", file=sys.stderr, flush=True)
                    try:
                        row = run_variant(a, v, seed, prefixes, addresses, cl.sockets, k,
                                          "eth0" if nsc else ("lo" if v["kind"].startswith("gloo") else None))
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        detail = f"{exc}\n{getattr(exc, 'output', None) or ''}"
                        print(f" FAILED: {detail[-4000:]}", file=sys.stderr)
                        rows.append({"label": v["label"], "kind": v["kind"], "error": detail[-3000:]})
                        continue
                    row.update(label=v["label"], kind=v["kind"], steps=v["steps"] or a.steps)
                    rows.append(row)
                    if a.json:  # what is done so far (every seed's) survives a later failure or Ctrl-C
                        Path(a.json + ".partial").write_text(json.dumps([*results, {"meta": meta, "rows": rows}]))
                    print(f" val loss {row['curve'][-1]['val_loss']:.4f}, {row['median_step_s']:.3f} s/step "
                          f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
        failed = [r for r in rows if "error" in r]
        rows = [r for r in rows if "error" not in r]
        # on loopback Gloo's own interface counter counts everything on lo: no bytes for it there
        target, summary = report(rows, a.target, a.steps)
        meta["machine"] = f"{os.cpu_count()} cores shared by all nodes, load average {os.getloadavg()[0]:.1f} at the end"
        print(f"\n{a.task}, {a.nodes} nodes, {meta['rate']}, {a.steps} steps, seed {seed} ({meta['machine']})")
        print(table(rows, summary, a.steps))
        for r in failed:
            print(f"{r['label']}: failed: {r['error'][-300:]}")
        results.append({"meta": meta, "summary": summary, "rows": rows, "failed": failed})
    _print_seeds(results)
    if a.json:
        Path(a.json).write_text(json.dumps(results if len(results) > 1 else results[0], indent=1))
    if a.plot:
        plot(results, a.plot)
    return 0 if all(not r["failed"] for r in results) else 1


def reusable(a, seed: int) -> dict[str, dict[str, Any]]:
    """The rows of ``a.reuse`` for ``seed`` by label, if that run trained the same thing on the same
    links (else SystemExit naming what differs), less those ``a.rerun`` names (labels or kinds)."""
    rerun = {x.strip() for x in a.rerun.split(",") if x.strip()}
    if "codecs" in rerun:
        rerun.add("codec")
    for res in _results_of(a.reuse):
        m = res.get("meta")
        if m is None:
            raise SystemExit(f"--reuse {a.reuse}: it names no run (a .partial of an older version); "
                             "join it with --report instead")
        if m["seed"] != seed:
            continue
        want = {"task": a.task, "nodes": a.nodes, "steps": a.steps, "eval_every": a.eval_every,
                "rate": "loopback (unshaped)" if a.loopback else a.rate}
        bad = {k: (m.get(k), v) for k, v in want.items() if m.get(k) != v}
        if bad:
            raise SystemExit(f"--reuse {a.reuse}: its run differs ({', '.join(f'{k}: {x} there, {y} here' for k, (x, y) in bad.items())})")
        return {r["label"]: r for r in res["rows"] if r["label"] not in rerun and r["kind"] not in rerun}
    return {}


class _Nothing:
    """Stands in for the namespace cluster on loopback."""

    def __enter__(self):
        return None

    def __exit__(self, *exc) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
