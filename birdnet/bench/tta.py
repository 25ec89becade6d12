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
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from birdnet.bench.cluster import rank_results
from birdnet.bench.specs import parse_spec

KINDS = ("gloo", "gloo-fp16", "codec", "diloco", "solo")
#: DiLoCo keywords a variant may set (``codec.K=V`` goes to codec_params)
DILOCO_KEYS = ("sync_every", "outer_lr", "outer_momentum", "nesterov", "fragments", "overlap", "codec")
#: how much above Gloo's final loss the default target lies
TARGET_SLACK = 1.02
#: tasks measured by accuracy (the CNN): the accuracy target lies this far below Gloo's at --steps
#: (half a point: "within 0.5 points of dense accuracy")
ACCURACY_SLACK = 0.005
#: accuracy at --steps is also reported as the mean of this many evaluations ending there (with
#: --eval-every 10: steps 260-300 of 300), which the accuracy target and the comparison use
ACCURACY_WINDOW = 5


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
def time_to_target(curve: list[dict[str, Any]], target: float, metric: str = "val_loss",
                   higher: bool = False) -> dict[str, Any] | None:
    """The first point of ``curve`` (dicts with ``step``, ``seconds`` and ``metric``, in step
    order) whose ``metric`` is at or below ``target`` (at or above with ``higher``), or None."""
    for e in curve:
        if e.get(metric) is not None and (e[metric] >= target if higher else e[metric] <= target):
            return e
    return None


def speedup(base_s: float | None, s: float | None) -> float | None:
    """How many times faster ``s`` is than ``base_s`` (None where either did not reach the target)."""
    if base_s is None or s is None or s <= 0:
        return None
    return base_s / s


def identical(digests: list[str]) -> bool:
    """True when every rank's parameter digest is the same (and there is at least one)."""
    return len(digests) > 0 and len(set(digests)) == 1


def merge_ranks(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """One curve from the ranks' results: at each evaluation the slowest rank's training seconds,
    the mean of the ranks' validation metrics (one model's on DDP, where they are equal), the
    largest bytes of a node; the slowest rank's time per step; whether the parameters agree."""
    n = min(len(o["history"]) for o in outs)
    curve = []
    for i in range(n):
        es = [o["history"][i] for o in outs]
        e = {"step": es[0]["step"], "seconds": max(x["seconds"] for x in es),
             "train_loss": statistics.fmean(x["train_loss"] for x in es)}
        for k in es[0]:
            if k in e or k == "train_loss":
                continue
            vals = [x[k] for x in es]
            if all(x is None for x in vals):
                e[k] = None
            elif k.endswith("bytes"):
                e[k] = max(x for x in vals if x is not None)
            else:
                e[k] = statistics.fmean(vals)
        curve.append(e)
    steps = [max(o["step_times"][s] for o in outs) for s in range(min(len(o["step_times"]) for o in outs))]
    steady = steps[min(5, len(steps) - 1):] if steps else [float("nan")]
    merged = {"curve": curve, "median_step_s": statistics.median(steady), "mean_step_s": statistics.fmean(steady),
              "identical": identical([o["digest"] for o in outs]),
              # the slowest rank's seconds of every step: where a mode's time goes (DiLoCo's syncs)
              "step_s": [round(x, 5) for x in steps]}
    if "settings" in outs[0]:
        merged["settings"] = outs[0]["settings"]
    if all("kernels_seconds" in o for o in outs):
        merged["kernels_seconds"] = max(o["kernels_seconds"] for o in outs)
    return merged


def node_bytes(e: dict[str, Any]) -> int | None:
    """The bytes a curve point says a node sent: the interface's count, else the adapter's."""
    return e["wire_bytes"] if e.get("wire_bytes") is not None else e.get("adapter_bytes")


def report(rows: list[dict[str, Any]], target: float | None, steps: int) -> tuple[float | None, dict[str, Any]]:
    """Fill each row with its time to target, speed-ups and ratios (in place); returns the target used
    and the summary figures (Gloo's time and steps to target, the compute-only limit)."""
    gloo = next((r for r in rows if r["kind"] == "gloo"), None)
    if target is None and gloo is not None:
        at = [e for e in gloo["curve"] if e["step"] <= steps]
        target = at[-1]["val_loss"] * TARGET_SLACK if at else None
    solo = next((r for r in rows if r["kind"] == "solo"), None)
    for r in rows:
        hit = time_to_target(r["curve"], target) if target is not None else None
        r["time_to_target_s"] = hit["seconds"] if hit else None
        r["step_at_target"] = hit["step"] if hit else None
        last = r["curve"][-1]
        r["final_val_loss"] = last["val_loss"]
        eq = [e for e in r["curve"] if e["step"] <= steps]
        r["val_loss_at_steps"] = eq[-1]["val_loss"] if eq else None
        b = node_bytes(last)
        r["bytes_per_node"] = b
        r["bytes_per_step"] = None if b is None else b / last["step"]
    summary: dict[str, Any] = {"target": target}
    g_tt = gloo["time_to_target_s"] if gloo else None
    g_steps = gloo["step_at_target"] if gloo else None
    limit = solo["median_step_s"] * g_steps if solo and g_steps else None
    summary.update(gloo_time_to_target_s=g_tt, gloo_steps_to_target=g_steps, compute_limit_s=limit,
                   solo_step_s=solo["median_step_s"] if solo else None)
    for r in rows:
        r["speedup_vs_gloo"] = speedup(g_tt, r["time_to_target_s"]) if r["kind"] != "solo" else None
        r["x_limit"] = (r["time_to_target_s"] / limit if limit and r["time_to_target_s"] is not None
                        and r["kind"] != "solo" else None)
        gl = gloo["val_loss_at_steps"] if gloo else None
        r["val_loss_vs_gloo"] = (r["val_loss_at_steps"] / gl - 1 if gl and r["val_loss_at_steps"] is not None
                                 else None)
        gb = gloo["bytes_per_step"] if gloo else None
        r["fewer_bytes_per_step_than_gloo"] = (gb / r["bytes_per_step"] if gb and r["bytes_per_step"]
                                               else None)
    _report_accuracy(rows, gloo, steps, summary)
    return target, summary


def _report_accuracy(rows: list[dict[str, Any]], gloo: dict[str, Any] | None, steps: int,
                     summary: dict[str, Any]) -> None:
    """For a task measured by accuracy (the CNN): each row's accuracy at ``steps`` and the mean of its
    last ``ACCURACY_WINDOW`` evaluations up to ``steps``, their differences from Gloo's in points, the
    binomial standard error of one evaluation (where the curve says how many test images), and the
    time to Gloo's windowed accuracy minus ``ACCURACY_SLACK``.

    One evaluation of a model on a few hundred images moves by a point between neighbouring steps
    (each image is 0.25 points of 397); the window averages that out, it does not change what is
    compared: the accuracy of the models training has produced by ``steps``."""
    if not any("accuracy" in r["curve"][-1] for r in rows):
        return
    for r in rows:
        eq = [e for e in r["curve"] if e["step"] <= steps and e.get("accuracy") is not None]
        r["accuracy_at_steps"] = eq[-1]["accuracy"] if eq else None
        win = eq[-ACCURACY_WINDOW:]
        r["accuracy_window"] = statistics.fmean(e["accuracy"] for e in win) if win else None
        r["accuracy_window_steps"] = [e["step"] for e in win]
        n = eq[-1].get("test_images") if eq else None
        p = r["accuracy_at_steps"]
        r["accuracy_se_points"] = None if not n or p is None else 100 * math.sqrt(p * (1 - p) / n)
    g_acc = gloo.get("accuracy_at_steps") if gloo else None
    g_win = gloo.get("accuracy_window") if gloo else None
    target = None if g_win is None else g_win - ACCURACY_SLACK
    summary["accuracy_target"] = target
    for r in rows:
        hit = time_to_target(r["curve"], target, "accuracy", higher=True) if target is not None else None
        r["time_to_accuracy_s"] = hit["seconds"] if hit else None
        r["step_at_accuracy"] = hit["step"] if hit else None
        r["accuracy_vs_gloo_points"] = (100 * (r["accuracy_at_steps"] - g_acc)
                                        if g_acc is not None and r["accuracy_at_steps"] is not None else None)
        r["accuracy_window_vs_gloo_points"] = (100 * (r["accuracy_window"] - g_win)
                                               if g_win is not None and r["accuracy_window"] is not None else None)
    summary["gloo_time_to_accuracy_s"] = gloo.get("time_to_accuracy_s") if gloo else None


def table(rows: list[dict[str, Any]], summary: dict[str, Any], steps: int) -> str:
    """The report as a markdown table; a task measured by accuracy gets five more columns: the
    accuracy at ``steps`` and the mean of the last ``ACCURACY_WINDOW`` evaluations, each with its
    difference from Gloo's in points, and the time to the accuracy target."""
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)
    acc = "accuracy_target" in summary
    head = (f"| variant | time to target (s) | at step | vs Gloo | x limit | s/step | MB/node | "
            f"bytes/step vs Gloo | val loss @{steps} | vs Gloo |")
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    if acc:
        head += (f" accuracy @{steps} | vs Gloo (points) | mean of last {ACCURACY_WINDOW} | vs Gloo (points) | "
                 "time to accuracy (s) |")
        rule += "---:|---:|---:|---:|---:|"
    lines = [head + " identical |", rule + "---|"]
    for r in rows:
        mb = None if r["bytes_per_node"] is None else r["bytes_per_node"] / 1e6
        line = (f"| {r['label']} | {f(r['time_to_target_s'], '.1f')} | {f(r['step_at_target'], 'd')} | "
                f"{f(r['speedup_vs_gloo'], '.2f')}x | {f(r['x_limit'], '.2f')} | {r['median_step_s']:.3f} | "
                f"{f(mb, '.1f')} | {f(r['fewer_bytes_per_step_than_gloo'], '.0f')}x | "
                f"{f(r['val_loss_at_steps'], '.4f')} | {f(None if r['val_loss_vs_gloo'] is None else 100 * r['val_loss_vs_gloo'], '+.2f')}% |")
        if acc:
            pct = None if r.get("accuracy_at_steps") is None else 100 * r["accuracy_at_steps"]
            win = None if r.get("accuracy_window") is None else 100 * r["accuracy_window"]
            line += (f" {f(pct, '.2f')}% | {f(r.get('accuracy_vs_gloo_points'), '+.2f')} | {f(win, '.2f')}% | "
                     f"{f(r.get('accuracy_window_vs_gloo_points'), '+.2f')} | {f(r.get('time_to_accuracy_s'), '.1f')} |")
        lines.append(line + f" {'yes' if r['identical'] else 'NO' if r['kind'] != 'solo' else '-'} |")
    lines.append(f"target val loss {f(summary['target'], '.4f')}; compute-only limit "
                 f"{f(summary['compute_limit_s'], '.1f')} s (solo {f(summary['solo_step_s'], '.3f')} s/step x "
                 f"Gloo's {f(summary['gloo_steps_to_target'], 'd')} steps)")
    if acc:
        t = summary["accuracy_target"]
        se = next((r["accuracy_se_points"] for r in rows if r["kind"] == "gloo" and r.get("accuracy_se_points")), None)
        lines.append(f"accuracy target {f(None if t is None else 100 * t, '.2f')}% (Gloo's mean of its last "
                     f"{ACCURACY_WINDOW} evaluations to step {steps} minus {100 * ACCURACY_SLACK:.1f} points)"
                     + ("" if se is None else f"; binomial standard error of one evaluation of Gloo's: {se:.2f} points"))
    return "\n".join(lines)


def seeds_table(results: list[dict[str, Any]]) -> str | None:
    """For a task measured by accuracy run with several seeds: per variant (those in every seed's
    rows), the accuracy at ``steps`` and the windowed accuracy, each as the mean over the seeds with
    their range and its difference from Gloo's of the same seed (the same test images, batches and
    initialisation) as the mean over the seeds with its standard error; None for
    one seed or a task without accuracy. Each seed draws its own 1400/397 split, so the mean over k
    seeds rests on k x 397 test evaluations."""
    if len(results) < 2 or not all(r["rows"] and "accuracy_window" in r["rows"][0] for r in results):
        return None
    steps = results[0]["meta"]["steps"]
    labels = [r["label"] for r in results[0]["rows"] if all(r["label"] in {x["label"] for x in res["rows"]}
                                                            for res in results)]
    seeds = [res["meta"]["seed"] for res in results]

    def pts(xs: list[float]) -> str:
        return f"{100 * statistics.fmean(xs):.2f}% ({100 * min(xs):.2f}-{100 * max(xs):.2f})"

    lines = [f"| variant (seeds {', '.join(map(str, seeds))}) | accuracy @{steps}: mean (range) | vs Gloo (points): "
             f"mean +- s.e. | mean of last {ACCURACY_WINDOW}: mean (range) | vs Gloo (points): mean +- s.e. | "
             f"val loss @{steps}: mean |",
             "|---|---:|---:|---:|---:|---:|"]

    def paired(rs: list[dict[str, Any]], key: str) -> str:
        d = [x[key] for x in rs if x.get(key) is not None]
        return "-" if len(d) < len(rs) else f"{statistics.fmean(d):+.2f} +- {statistics.stdev(d) / math.sqrt(len(d)):.2f}"

    for label in labels:
        rs = [next(x for x in res["rows"] if x["label"] == label) for res in results]
        if any(x.get("accuracy_window") is None or x.get("accuracy_at_steps") is None for x in rs):
            continue
        vl = [x["val_loss_at_steps"] for x in rs if x.get("val_loss_at_steps") is not None]
        lines.append(f"| {label} | {pts([x['accuracy_at_steps'] for x in rs])} | "
                     f"{paired(rs, 'accuracy_vs_gloo_points')} | {pts([x['accuracy_window'] for x in rs])} | "
                     f"{paired(rs, 'accuracy_window_vs_gloo_points')} | "
                     f"{'-' if not vl else format(statistics.fmean(vl), '.4f')} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], out: str) -> None:
    """Validation loss against training seconds and against MB sent per node, one line per variant
    (seed of each result file), the target dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), 2, figsize=(11, 4 * len(results)), squeeze=False)
    for (ax_t, ax_b), res in zip(axes, results):
        m = res["meta"]
        for r in res["rows"]:
            if r["kind"] == "solo":
                continue
            xs = [e["seconds"] for e in r["curve"]]
            ys = [e["val_loss"] for e in r["curve"]]
            ax_t.plot(xs, ys, marker=".", label=r["label"])
            bs = [node_bytes(e) for e in r["curve"]]
            if all(b is not None for b in bs):
                ax_b.plot([max(b, 1) / 1e6 for b in bs], ys, marker=".", label=r["label"])
        for ax in (ax_t, ax_b):
            if res["summary"]["target"] is not None:
                ax.axhline(res["summary"]["target"], color="grey", linestyle="--", linewidth=0.8)
            ax.set_ylabel("validation loss")
            ax.legend(fontsize=7)
        ax_t.set_title(f"{m['task']}, {m['nodes']} nodes, {m['rate']}, seed {m['seed']}")
        ax_t.set_xlabel("training seconds (slowest rank)")
        ax_b.set_xscale("log")
        ax_b.set_xlabel("MB sent per node")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


# -- the driver -----------------------------------------------------------------------------------
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


def _print_seeds(results: list[dict[str, Any]]) -> None:
    text = seeds_table(sorted(results, key=lambda r: r["meta"]["seed"]))
    if text:
        print(f"\nover seeds (windowed accuracy: the mean of the last {ACCURACY_WINDOW} evaluations to each run's "
              "--steps; the standard error is the seeds' spread of the paired difference / sqrt(seeds))")
        print(text)


#: what two results must share for their rows to stand in one table
SAME_RUN = ("task", "nodes", "rate", "steps", "eval_every")


def _results_of(path: str) -> list[dict[str, Any]]:
    """The per-seed results a ``--json`` file or its ``.partial`` holds (one object or a list)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: not a readable tta result ({exc})") from None
    return data if isinstance(data, list) else [data]


def _seed_of(res: dict[str, Any]) -> int | None:
    return res["meta"]["seed"] if "meta" in res else res.get("seed")


def report_files(a) -> int:
    """``--report``: the rows of several result files in one table per seed (each seed's meta from
    the first file that has it; within a seed a label seen twice keeps its first row), with the
    target, speed-ups and limit computed over all. Files of another task, node count, link rate,
    step count or evaluation interval are refused."""
    groups: dict[Any, dict[str, Any]] = {}
    first: tuple[str, dict[str, Any]] | None = None
    for f in a.report:
        for res in _results_of(f):
            m = res.get("meta")
            if m is not None:
                if first is None:
                    first = (f, m)
                bad = {k: (first[1].get(k), m.get(k)) for k in SAME_RUN if m.get(k) != first[1].get(k)}
                if bad:
                    raise SystemExit(f"--report: {f} is another run than {first[0]} ("
                                     + ", ".join(f"{k}: {y} there, {x} in {first[0]}" for k, (x, y) in bad.items())
                                     + "); give files of one task and links")
            g = groups.setdefault(_seed_of(res), {"meta": None, "rows": [], "files": []})
            if g["meta"] is None and m is not None:
                g["meta"] = dict(m)
            if f not in g["files"]:
                g["files"].append(f)
            for r in res["rows"]:
                if r["label"] not in {x["label"] for x in g["rows"]}:
                    g["rows"].append(dict(r, source=f))
    results = []
    for seed, g in groups.items():
        meta = g["meta"]
        if meta is None:
            raise SystemExit(f"--report: no file has the meta of seed {seed}'s run (give a finished --json result "
                             "or a .partial written by this version first)")
        steps = meta["steps"]
        target, summary = report(g["rows"], a.target, steps)
        meta.update(command=meta["command"] + " (rows from " + ", ".join(g["files"]) + ")",
                    report_command="birdnet bench tta --report " + " ".join(a.report))
        print(f"{meta['task']}, {meta['nodes']} nodes, {meta['rate']}, {steps} steps, seed {meta['seed']} ({meta['machine']})"
              if "machine" in meta else f"{meta['task']}, {meta['nodes']} nodes, {meta['rate']}, {steps} steps, seed {meta['seed']}")
        print(table(g["rows"], summary, steps))
        results.append({"meta": meta, "summary": summary, "rows": g["rows"], "failed": []})
    _print_seeds(results)
    if a.json:
        Path(a.json).write_text(json.dumps(results if len(results) > 1 else results[0], indent=1))
    if a.plot:
        plot(results, a.plot)
    return 0


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
