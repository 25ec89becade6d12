"""Markdown tables for docs/benchmarks.md from the JSON that `birdnet bench allreduce --json` and
`birdnet bench train --json` write: `python -m birdnet.bench.tools.tables ar|time|loop|release|train FILE.json`."""
import json
import sys


def ar(path):
    d = json.load(open(path))
    m = d["meta"]
    out = [f"`{m['command']}` — {m['nodes']} nodes, {m['mode']} {m['rate'] or ''}, median of {m['runs']} runs "
           f"after {m['warmup']} warm-up", "",
           "| size (B) | count | codec | time (s) | algbw (GB/s) | busbw (GB/s) | wire B/node | ratio | rel. error "
           "| Gloo (s) | speed-up vs Gloo |",
           "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        g = f"{r['gloo_time_s']:.4f}" if "gloo_time_s" in r else "—"
        sp = f"{r['speedup_vs_gloo']:.2f}x" if "speedup_vs_gloo" in r else "—"
        err = f"{r['error']:.1e}" if r.get("error") is not None else "—"
        out.append(f"| {r['size_bytes']:,} | {r['count']:,} | {r['codec']} | {r['time_s']:.4f} | {r['algbw_GBps']:.3f} "
                   f"| {r['busbw_GBps']:.3f} | {r['wire_bytes_per_node']:,} | {r['ratio']:.1f} | {err} | {g} | {sp} |")
    return "\n".join(out)


def time_split(path, count=11689512):
    d = json.load(open(path))
    cpu = any("daemon_cpu_s" in r for r in d["rows"])
    out = ["| count | codec | client time (s) | daemon round (s) | of which codec (s) | runs (s) | Gloo runs (s) |"
           + (" agreement done (ms) | CPU, all daemons / all Gloo (s) |" if cpu else ""),
           "|---:|---|---:|---:|---:|---|---|" + ("---:|---|" if cpu else "")]
    for r in d["rows"]:
        if r["count"] != count:
            continue
        runs = ", ".join(f"{t:.3f}" for t in r.get("times", []))
        gl = ", ".join(f"{t:.3f}" for t in r.get("gloo_times", [])) or "—"
        line = (f"| {r['count']:,} | {r['codec']} | {r['time_s']:.4f} | {r['daemon_round_s']:.4f} "
                f"| {r['compress_s']:.4f} | {runs} | {gl} |")
        if cpu:
            ph = r.get("phases_s") or {}
            start = f"{ph['data_start'] * 1e3:.1f}" if "data_start" in ph else "—"
            g = f"{r['gloo_cpu_s']:.3f}" if "gloo_cpu_s" in r else "—"
            line += f" {start} | {r['daemon_cpu_s']:.3f} / {g} |"
        out.append(line)
    return "\n".join(out)


def train(path):
    d = json.load(open(path))
    m = d["meta"]
    out = [f"`{m['command']}` — {m['nodes']} workers, {m['data']}, {m['epochs']} epochs, batch {m['batch']}/worker, "
           f"lr {m['lr']}, momentum {m['momentum']}, seeds {m['seeds']}", "",
           "| codec | accuracy (mean ± half-range) | per seed | final loss | MB sent/worker | wall s/run | nodes identical |",
           "|---|---:|---|---:|---:|---:|---|"]
    for s in d["summary"]:
        out.append(f"| {s['codec']} | {s['acc_mean'] * 100:.2f} ± {s['acc_spread'] * 100:.2f} | "
                   f"{', '.join(f'{a * 100:.1f}' for a in s['accs'])} | {s['loss_mean']:.3f} | "
                   f"{s['mb_sent_per_worker']:.1f} | {s['seconds_mean']:.0f} | "
                   f"{'yes' if s['identical_on_all_nodes'] else 'NO'} |")
    return "\n".join(out)


def loop(path):
    """The loop (bench allreduce's headline): per row the loop time with the process's own arrays
    and with client.buffer, the per-call time, Gloo's loop, the ratio, one round's CPU (all
    daemon threads + the processes' hand-off, summed over nodes) against Gloo's, and the loop's
    phases on one node (medians, ms): hand-off in, wait for the data phase, data phase, hand-off out."""
    d = json.load(open(path))
    out = ["| count | codec | loop (s) | client.buffer loop (s) | per call (s) | loop / call | Gloo loop (s) "
           "| speed-up vs Gloo | CPU per round, birdnet / Gloo (ms) | in / wait / data / out (ms) |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in d["rows"]:
        g = f"{r['gloo_loop_s']:.4f}" if "gloo_loop_s" in r else "—"
        sp = f"**{r['loop_speedup_vs_gloo']:.2f}x**" if "loop_speedup_vs_gloo" in r else "—"
        cpu = f"{r['cpu_round_s'] * 1e3:.0f}" if r.get("cpu_round_s") is not None else "—"
        if "gloo_loop_cpu_s" in r:
            cpu += f" / {r['gloo_loop_cpu_s'] * 1e3:.0f}"
        ph = r["loop_phases_s"]
        phs = " / ".join(f"{ph[k] * 1e3:.1f}" for k in ("in", "wait", "data", "out"))
        out.append(f"| {r['count']:,} | {r['codec']} | {r['loop_s']:.4f} | {r['loop_buffer_s']:.4f} | {r['time_s']:.4f} "
                   f"| {r['loop_vs_call']:.2f}x | {g} | {sp} | {cpu} | {phs} |")
    return "\n".join(out)


def release(path):
    """Where a loop call's end goes: per row, the medians over the loop's calls of the spread of the
    nodes' data-phase ends and of the time from the last node's data-phase end to the first node's
    result (the commit count, the codec state's commit and the hand-off out; negative when a node
    released before another finished, as nothing made it wait), ms, from the JSON's loop_trace."""
    import statistics

    d = json.load(open(path))
    out = ["| count | codec | loop (s) | data ends spread (ms) | last data end to first result (ms) |",
           "|---:|---|---:|---:|---:|"]
    for r in d["rows"]:
        tr = r.get("loop_trace")
        if not tr:
            continue
        calls = range(len(tr[0]["stats"]))
        ends = [[node["stats"][i]["t_end"] for node in tr] for i in calls]
        results = [[node["marks"][i][2] for node in tr] for i in calls]
        spread = statistics.median(max(e) - min(e) for e in ends) * 1e3
        lag = statistics.median(min(res) - max(e) for e, res in zip(ends, results)) * 1e3
        out.append(f"| {r['count']:,} | {r['codec']} | {r['loop_s']:.4f} | {spread:.1f} | {lag:.1f} |")
    return "\n".join(out)


if __name__ == "__main__":
    kind, path = sys.argv[1], sys.argv[2]
    print({"ar": ar, "time": time_split, "loop": loop, "release": release, "train": train}[kind](path))

