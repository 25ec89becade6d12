"""``birdnet bench tta``'s report: the time to the target on each variant's curve, the speed-ups,
the ratio to the compute-only limit, bytes per node, the losses (and the CNN's accuracies) at equal
steps, the tables (one per seed, and over the seeds), the plot, and ``--report``, which joins the
rows of earlier runs. Pure arithmetic on the runs' results (birdnet/bench/tta.py runs them).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

#: how much above Gloo's final loss the default target lies
TARGET_SLACK = 1.02
#: tasks measured by accuracy (the CNN): the accuracy target lies this far below Gloo's at --steps
#: (half a point: "within 0.5 points of dense accuracy")
ACCURACY_SLACK = 0.005
#: accuracy at --steps is also reported as the mean of this many evaluations ending there (with
#: --eval-every 10: steps 260-300 of 300), which the accuracy target and the comparison use
ACCURACY_WINDOW = 5


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
