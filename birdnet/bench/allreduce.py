"""``birdnet bench allreduce``: N daemons with one client each; a table in the form of nccl-tests
(size, count, codec, time, algbw, busbw) plus bytes on the wire, compression ratio and error against
the exact mean; optionally in network namespaces with token-bucket links and next to
torch.distributed/Gloo on the same links in the same run.

The loop (the headline): as a training loop and nccl-tests make them, calls back to back after one
barrier, ``--loop-warmup`` warm-up calls then ``--loop-calls`` timed ones; a call's time is the
slowest node's time from its previous result to this result, and the figure is the median over the
timed calls. Once with the training process's own NumPy array (``client.allreduce(g)``: the copy
into shared memory and the new result array are in the time) and once with a ``client.buffer``
array refilled before every call, the refill inside the time. Every codec gets the same input on
every call (a lossy codec's error feedback still moves on, as in training). Around the timed calls
the CPU time of every daemon (all threads, from /proc) and of every training process (its
hand-off: copies in and out, the client's threads) is read, per round and summed over the nodes.

Per call: every measured call starts right after a barrier; a run's time is the slowest node's; each
figure is the median of ``--runs`` runs after ``--warmup`` warm-up calls. Beside it, the *span*: from
the last node's call to the last node's result on the machine's one monotonic clock (network
namespaces share it), which leaves out how far apart the barrier released the nodes. algbw = bytes / time,
busbw = algbw * 2 (N-1) / N (the nccl-tests convention for all-reduce).

Where the time goes: from the marks each daemon puts in a round's stats, the moments after the last
node's call when the last daemon had its process's buffer, began the data phase (the agreement
done), finished it, and when the last process had its result (:func:`phases`); and the CPU time of
one round, all daemons' (every thread, data phase) and all Gloo processes' (the ``all_reduce`` call),
summed over the nodes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from birdnet.bench.specs import label, parse_codecs
from birdnet.cluster import rank_results


def bench_worker(sock: str, node: int, local: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from birdnet.client import Client
    res: dict[str, Any] = {}
    with Client(sock, job="bench") as c:
        for n in cfg["sizes"]:
            x = np.random.default_rng(1000 + c.rank).standard_normal(n).astype(np.float32)
            exact = None
            if c.rank == 0 and cfg["check"]:
                exact = np.zeros(n, np.float64)
                for r in range(c.size):
                    exact += np.random.default_rng(1000 + r).standard_normal(n).astype(np.float32)
                exact /= c.size
            # The gradient lives in a shared-memory buffer (client.buffer), as in a training loop that
            # writes its gradients there: the all-reduce works in place, like Gloo's.
            buf = c.buffer((n,), np.float32)
            for name, params in cfg["codecs"]:
                times, marks, stats, out = [], [], [], None
                c.reset_state()
                # A lossy codec gets the same gradient every run (its result fed back would change
                # run after run). A dense all-reduce of its own result is the same work, so the
                # buffer is not refilled here: a 4-100 MB copy on every node right as the slowest
                # node is still finishing the call before would slow that call down. (The loops
                # below do refill: that is what a training loop pays.)
                refill = name != "none"
                for i in range(cfg["warmup"] + cfg["runs"]):
                    if refill or i == 0:
                        buf[:] = x
                    c.barrier()
                    # one clock for both: CLOCK_MONOTONIC, shared by all network namespaces
                    t0 = time.monotonic()
                    h = c.allreduce_async(buf, name=f"g{n}", codec=name, **params)
                    out = h.wait(900)
                    t1 = time.monotonic()
                    if i >= cfg["warmup"]:
                        times.append(t1 - t0)
                        marks.append([t0, t1])
                        stats.append(h.stats)
                loops = {mode: timed_loop(c, x, buf, mode, f"g{n}", name, params, cfg)
                         for mode in ("own", "buffer")}
                if cfg["check"] and not refill:  # every process: one more call, untimed, of the inputs
                    buf[:] = x
                    out = c.allreduce(buf, name=f"g{n}", codec=name, timeout=900, **params)
                err = None
                if exact is not None and out is not None:
                    err = float(np.linalg.norm(out - exact) / max(np.linalg.norm(exact), 1e-30))
                res[f"{label(name, params)}|{n}"] = {"times": times, "marks": marks, "stats": stats, "error": err,
                                                     "loops": loops}
    return res


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU time of every thread of process ``pid`` by kind (nanosecond resolution: the first field
    of /proc/PID/task/TID/schedstat): ``main`` (the process's first thread), ``ring`` (birdnetd's
    ring worker, named birdnet-ring), ``zmq_io`` (ZeroMQ's I/O threads), ``other``; {} when
    unreadable. /proc is shared by network namespaces."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue
        kind = ("main" if tid == str(pid) else "ring" if name == "birdnet-ring" else
                "zmq_io" if name.startswith("ZMQbg/IO") else "other")
        out[kind] = out.get(kind, 0.0) + ns / 1e9
    return out


def task_cpu_seconds(pid: int) -> float:
    """CPU time of every thread of process ``pid`` (0.0 when unreadable)."""
    return sum(thread_cpu_seconds(pid).values())


def timed_loop(c, x: np.ndarray, buf: np.ndarray, mode: str, tensor: str, codec: str,
               params: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Calls back to back after one barrier, as a training loop makes them. ``mode`` "own": the
    process's own array ``x`` goes in and a new array comes back; "buffer": ``buf`` (a
    client.buffer array) is refilled from ``x`` before every call, inside the time. Returns this
    node's per-call marks [previous result, call, result] and stats of the timed calls, and the CPU
    time over them of this process (its hand-off) and of its daemon (all threads)."""
    warm, calls = cfg["loop_warmup"], cfg["loop_calls"]
    daemon = cfg["daemon_pids"][c.node] if cfg.get("daemon_pids") else None
    marks, stats = [], []
    c.barrier()
    prev = time.monotonic()
    cpu0 = 0.0
    t0s: dict[str, float] = {}
    for i in range(warm + calls):
        if i == warm:
            cpu0, t0s = time.process_time(), (thread_cpu_seconds(daemon) if daemon else {})
        t0 = time.monotonic()
        if mode == "own":
            h = c.allreduce_async(x, name=tensor, codec=codec, **params)
        else:
            buf[:] = x
            h = c.allreduce_async(buf, name=tensor, codec=codec, **params)
        h.wait(900)
        t1 = time.monotonic()
        if i >= warm:
            marks.append([prev, t0, t1])
            stats.append({k: h.stats[k] for k in ("t_ready", "t_data", "t_end", "cpu_seconds") if k in h.stats})
        prev = t1
    client_cpu = (time.process_time() - cpu0) / calls
    threads = {k: (v - t0s.get(k, 0.0)) / calls for k, v in thread_cpu_seconds(daemon).items()} if daemon else {}
    return {"marks": marks, "stats": stats, "client_cpu": client_cpu,
            "daemon_cpu": sum(threads.values()) if daemon else None, "daemon_threads": threads}


def loop_figures(per_node: list[dict[str, Any]]) -> dict[str, Any]:
    """The loop of every node (timed_loop's results) as figures: ``time`` the median over calls of
    the slowest node's time from its previous result to this one; ``times`` those per call;
    ``mean`` the slowest node's average; ``cpu`` / ``daemon_cpu`` / ``client_cpu`` per round,
    summed over nodes, ``daemon_threads`` the daemons' by thread kind; ``phases`` medians over
    nodes and calls of one node's gap (previous result to the call), hand-off in (call to its
    daemon having the input), wait (to the data phase: the agreement, or the lane waiting for the
    other nodes), data phase, hand-off out (to the result)."""
    calls = len(per_node[0]["marks"])
    times = [max(pn["marks"][i][2] - pn["marks"][i][0] for pn in per_node) for i in range(calls)]
    out: dict[str, Any] = {
        "time": statistics.median(times), "times": times,
        "mean": max((pn["marks"][-1][2] - pn["marks"][0][0]) / calls for pn in per_node),
        "client_cpu": sum(pn["client_cpu"] for pn in per_node)}
    dcpu = [pn["daemon_cpu"] for pn in per_node]
    out["daemon_cpu"] = sum(dcpu) if all(d is not None for d in dcpu) else None
    out["cpu"] = out["client_cpu"] + out["daemon_cpu"] if out["daemon_cpu"] is not None else None
    threads: dict[str, float] = {}
    for pn in per_node:
        for k, v in (pn.get("daemon_threads") or {}).items():
            threads[k] = threads.get(k, 0.0) + v
    out["daemon_threads"] = threads
    parts: dict[str, list[float]] = {"gap": [], "in": [], "wait": [], "data": [], "out": []}
    for pn in per_node:
        for (prev, t0, t1), st in zip(pn["marks"], pn["stats"]):
            if not all(k in st for k in ("t_ready", "t_data", "t_end")):
                continue
            parts["gap"].append(t0 - prev)
            parts["in"].append(st["t_ready"] - t0)
            parts["wait"].append(st["t_data"] - st["t_ready"])
            parts["data"].append(st["t_end"] - st["t_data"])
            parts["out"].append(t1 - st["t_end"])
    out["phases"] = {k: statistics.median(v) for k, v in parts.items() if v}
    return out


def spans(marks_per_node: list[list[list[float]]]) -> list[float]:
    """Per run: the last node's end minus the last node's start ([start, end] pairs per node)."""
    return [max(m[i][1] for m in marks_per_node) - max(m[i][0] for m in marks_per_node)
            for i in range(len(marks_per_node[0]))]


def run_gloo(cluster_prefixes, addresses, sizes, runs, warmup, loop_calls, loop_warmup) -> dict[int, dict[str, Any]]:
    """torch.distributed/Gloo on the same nodes: per size, the per-call ``times`` and ``spans``,
    ``cpu`` per call summed over ranks, and the loop's ``loop_times`` (per call, the slowest rank's
    time from its previous result), ``loop`` their median and ``loop_cpu`` per call summed over ranks."""
    port = 29900 + os.getpid() % 50
    cmds = []
    for r in range(len(addresses)):
        cmd = [*cluster_prefixes[r], sys.executable, "-m", "birdnet.bench.gloo_worker", "--rank", str(r),
               "--world", str(len(addresses)), "--master", f"{addresses[0]}:{port}", "--sizes",
               ",".join(map(str, sizes)), "--runs", str(runs), "--warmup", str(warmup),
               "--loop-calls", str(loop_calls), "--loop-warmup", str(loop_warmup)]
        if cluster_prefixes[r]:
            cmd += ["--iface", "eth0"]
        cmds.append(cmd)
    outs = rank_results(cmds, 1800, "gloo")
    res = {}
    for n in sizes:
        k = str(n)
        loop_times = [max(o["loop"][k][i][1] - o["loop"][k][i][0] for o in outs) for i in range(loop_calls)]
        res[n] = {"times": [max(o["times"][k][i] for o in outs) for i in range(runs)],
                  "spans": spans([o["marks"][k] for o in outs]),
                  "cpu": [sum(o["cpu"][k][i] for o in outs) for i in range(runs)],
                  "loop_times": loop_times, "loop": statistics.median(loop_times),
                  "loop_cpu": sum(o["loop_cpu"][k] for o in outs)}
    return res


def phases(marks_per_node: list[list[list[float]]], stats_per_node: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Where a round's time goes, medians over the runs, in seconds from the last node's call
    (one monotonic clock): ``ready`` the last daemon has its process's contribution (the hand-off
    in), ``data_start`` the last daemon begins the data phase (the start/go agreement),
    ``data_end`` the last daemon is done, ``result`` the last process has its result (= span);
    ``data_starts``: per run, when each node began its data phase; ``handoff_in`` / ``handoff_out``:
    medians over nodes and runs of one node's call to its daemon having the buffer, and of its
    daemon's end of the round to the process having the result."""
    out: dict[str, list[float]] = {"ready": [], "data_start": [], "data_end": [], "result": []}
    hand_in: list[float] = []
    hand_out: list[float] = []
    starts: list[list[float]] = []  # per run, when each node (in node order) began its data phase
    for i in range(len(marks_per_node[0])):
        t0 = max(m[i][0] for m in marks_per_node)
        st = [s[i] for s in stats_per_node]
        if not all("t_ready" in x and "t_data" in x and "t_end" in x for x in st):
            return {}
        starts.append([x["t_data"] - t0 for x in st])
        hand_in += [x["t_ready"] - m[i][0] for x, m in zip(st, marks_per_node)]
        hand_out += [m[i][1] - x["t_end"] for x, m in zip(st, marks_per_node)]
        out["ready"].append(max(x["t_ready"] for x in st) - t0)
        out["data_start"].append(max(starts[-1]))
        out["data_end"].append(max(x["t_end"] for x in st) - t0)
        out["result"].append(max(m[i][1] for m in marks_per_node) - t0)
    return {**{k: statistics.median(v) for k, v in out.items()}, "data_starts": starts,
            "handoff_in": statistics.median(hand_in), "handoff_out": statistics.median(hand_out)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="birdnet bench allreduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--sizes", default="1000000,11689512", help="element counts (float32), comma-separated")
    p.add_argument("--codecs", default="none", help="comma-separated; parameters as name:key=value:key=value")
    p.add_argument("--runs", type=int, default=3, help="measured runs per figure (median), default 3")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--loop-calls", type=int, default=7,
                   help="timed calls of the loop (back to back after one barrier; median), default 7")
    p.add_argument("--loop-warmup", type=int, default=2, help="warm-up calls of the loop, default 2")
    p.add_argument("--netns", action="store_true", help="each daemon in its own network namespace (root)")
    p.add_argument("--rate", default=None, help="token-bucket rate of every link with --netns, e.g. 1gbit, 100mbit")
    p.add_argument("--tcp-cc", metavar="NAME", default=None,
                   help="TCP congestion control in every namespace with --netns (e.g. cubic, bbr); "
                        "default: the machine's")
    p.add_argument("--vs-gloo", action="store_true", help="torch.distributed/Gloo on the same links, same run")
    p.add_argument("--no-check", action="store_true", help="skip the error against the exact mean")
    p.add_argument("--chunk-bytes", type=int, default=None)
    p.add_argument("--max-chunk-bytes", type=int, default=None,
                   help="the daemons' --max-chunk-bytes (0: chunks of --chunk-bytes always)")
    p.add_argument("--hop-latency-bytes", type=int, default=None,
                   help="the daemons' --hop-latency-bytes (0: every all-reduce on the ring, none gathered)")
    p.add_argument("--no-dense-lane", action="store_true",
                   help="daemons agree on every round (birdnetd --no-dense-lane), for comparison")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="FILE.png")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    codecs = parse_codecs(a.codecs)
    from birdnet.bench import netns
    from birdnet.bench.progress import bar as progress_bar
    from birdnet.cluster import LocalCluster

    if a.rate and not a.netns:
        p.error("--rate needs --netns")
    if a.tcp_cc and not a.netns:
        p.error("--tcp-cc needs --netns")
    if a.loop_calls < 1 or a.loop_warmup < 0 or a.runs < 1 or a.warmup < 0:
        p.error("--runs and --loop-calls must be at least 1, the warm-ups at least 0")
    cfg = {"sizes": sizes, "codecs": codecs, "runs": a.runs, "warmup": a.warmup, "check": not a.no_check,
           "loop_calls": a.loop_calls, "loop_warmup": a.loop_warmup}
    nsc = None
    results: dict[str, Any] = {}
    gloo: dict[int, dict[str, Any]] = {}
    extra = ["--chunk-bytes", str(a.chunk_bytes)] if a.chunk_bytes else []
    if a.max_chunk_bytes is not None:
        extra += ["--max-chunk-bytes", str(a.max_chunk_bytes)]
    if a.hop_latency_bytes is not None:
        extra += ["--hop-latency-bytes", str(a.hop_latency_bytes)]
    if a.no_dense_lane:
        extra.append("--no-dense-lane")
    slow = {"peer_timeout": 60.0, "heartbeat_interval": 1.0}  # generous: 8 nodes share 2 cores
    with tempfile.TemporaryDirectory(prefix="birdnet-bench-") as tmp:
        try:
            if a.netns:
                ok, why = netns.available()
                if not ok:
                    print(f"birdnet bench: --netns unavailable: {why}", file=sys.stderr)
                    return 2
                try:
                    nsc = netns.NetnsCluster(a.nodes, a.rate, tcp_cc=a.tcp_cc).__enter__()
                except RuntimeError as e:  # what was made is gone again (__enter__ tore it down)
                    print(f"birdnet bench: cannot set up the namespaces: {e}", file=sys.stderr)
                    return 2
                prefixes = [nsc.exec_prefix(i) for i in range(a.nodes)]
                cl = LocalCluster(a.nodes, Path(tmp), addresses=nsc.addresses, prefixes=prefixes, extra=extra, **slow)
            else:
                prefixes = [[] for _ in range(a.nodes)]
                cl = LocalCluster(a.nodes, Path(tmp), extra=extra, **slow)
            total = len(sizes) * len(codecs)
            print(f"birdnet bench allreduce: {a.nodes} nodes, {'netns ' + (a.rate or 'unshaped') if a.netns else 'loopback'}, "
                  f"{total} figures x ({a.warmup}+{a.runs} calls, 2 loops of {a.loop_warmup}+{a.loop_calls})",
                  file=sys.stderr)
            with cl:
                # each worker reads its own daemon's CPU from /proc (one PID namespace for all)
                cfg["daemon_pids"] = [p.pid if p is not None else None for p in cl.procs]
                w = cl.run_async(bench_worker, cfg, per_node=1)
                spinner = progress_bar(None, "  running birdnet", unit="s")  # on a terminal only
                try:
                    while not w.ready():
                        time.sleep(0.5)
                        spinner.update(0.5)
                finally:
                    spinner.close()
                try:
                    per_node = w.get(timeout=10)
                except Exception:
                    for i in range(a.nodes):  # the daemons' side of it, before their directory goes
                        print(f"--- daemon {i}, last lines of its log:\n" + "\n".join(cl.log(i).splitlines()[-8:]),
                              file=sys.stderr)
                    raise
            for key in per_node[0]:
                times = [max(pn[key]["times"][i] for pn in per_node) for i in range(a.runs)]
                stats = per_node[0][key]["stats"]
                span = spans([pn[key]["marks"] for pn in per_node])
                cpu = [sum(float(pn[key]["stats"][i].get("cpu_seconds", 0.0)) for pn in per_node)
                       for i in range(a.runs)]
                results[key] = {"time": statistics.median(times), "times": times,
                                "cpu": statistics.median(cpu),
                                "phases": phases([pn[key]["marks"] for pn in per_node],
                                                 [pn[key]["stats"] for pn in per_node]),
                                "span": statistics.median(span), "spans": span,
                                "bytes_sent": int(statistics.median(s.get("bytes_sent", 0) for s in stats)),
                                "ratio": float(statistics.median(s.get("ratio", 0.0) for s in stats)),
                                "compress_seconds": float(statistics.median(s.get("compress_seconds", 0.0) for s in stats)),
                                "round_seconds": float(statistics.median(s.get("seconds", 0.0) for s in stats)),
                                "error": per_node[0][key]["error"],
                                "loops": {m: loop_figures([pn[key]["loops"][m] for pn in per_node])
                                          for m in ("own", "buffer")},
                                "loop_trace": [pn[key]["loops"]["own"] for pn in per_node]}
            if a.vs_gloo:
                try:
                    import torch  # noqa: F401
                except ImportError:
                    print("birdnet bench: --vs-gloo needs torch (pip install torch==2.13.0)", file=sys.stderr)
                else:
                    print("  running torch.distributed/Gloo on the same links ...", file=sys.stderr)
                    addrs = nsc.addresses if nsc else ["127.0.0.1"] * a.nodes
                    gloo = run_gloo(prefixes, addrs, sizes, a.runs, a.warmup, a.loop_calls, a.loop_warmup)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
        finally:
            if nsc is not None:
                nsc.teardown()
    rows = []
    for n in sizes:
        for name, params in codecs:
            r = results[f"{label(name, params)}|{n}"]
            lo, lb = r["loops"]["own"], r["loops"]["buffer"]
            algbw = n * 4 / r["time"] / 1e9
            row = {"size_bytes": n * 4, "count": n, "codec": label(name, params), "time_s": r["time"],
                   "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (a.nodes - 1) / a.nodes,
                   "wire_bytes_per_node": r["bytes_sent"], "ratio": r["ratio"], "error": r["error"],
                   "compress_s": r["compress_seconds"], "daemon_round_s": r["round_seconds"], "times": r["times"],
                   "span_s": r["span"], "spans": r["spans"],
                   # all daemons' CPU time (every thread) in one round's data phase, summed over nodes
                   "daemon_cpu_s": r["cpu"], "phases_s": r["phases"],
                   # the loop (module docstring): the process's own arrays (the headline) and
                   # client.buffer arrays refilled inside the time
                   "loop_s": lo["time"], "loop_times": lo["times"], "loop_mean_s": lo["mean"],
                   "loop_phases_s": lo["phases"], "loop_vs_call": lo["time"] / r["time"],
                   "loop_buffer_s": lb["time"], "loop_buffer_times": lb["times"],
                   "loop_buffer_phases_s": lb["phases"],
                   # CPU of one round of the loop, summed over nodes: every daemon thread, plus the
                   # training process's hand-off (its copies in and out, the client's threads)
                   "cpu_round_s": lo["cpu"], "cpu_round_daemon_s": lo["daemon_cpu"],
                   "cpu_round_client_s": lo["client_cpu"], "cpu_round_buffer_s": lb["cpu"],
                   # the daemons' part by thread (main, ring, zmq_io, other), summed over nodes
                   "cpu_round_threads_s": lo.get("daemon_threads", {}),
                   "loop_trace": r["loop_trace"]}
            if n in gloo:
                g = gloo[n]
                row["gloo_time_s"] = statistics.median(g["times"])
                row["gloo_times"] = g["times"]  # every measured run, for the spread
                row["vs_gloo"] = r["time"] / row["gloo_time_s"]
                row["speedup_vs_gloo"] = row["gloo_time_s"] / r["time"]
                row["gloo_span_s"] = statistics.median(g["spans"])
                row["gloo_spans"] = g["spans"]
                row["span_vs_gloo"] = r["span"] / row["gloo_span_s"]
                # all Gloo processes' CPU time (every thread) in one all_reduce call, summed over nodes
                row["gloo_cpu_s"] = statistics.median(g["cpu"])
                row["gloo_loop_s"] = g["loop"]
                row["gloo_loop_times"] = g["loop_times"]
                row["gloo_loop_cpu_s"] = g["loop_cpu"]
                row["loop_vs_gloo"] = lo["time"] / g["loop"]
                row["loop_speedup_vs_gloo"] = g["loop"] / lo["time"]
                if lo["cpu"] is not None and g["loop_cpu"] > 0:
                    row["cpu_vs_gloo"] = lo["cpu"] / g["loop_cpu"]
            rows.append(row)
    meta = {"nodes": a.nodes, "mode": "netns" if a.netns else "loopback", "rate": a.rate, "runs": a.runs,
            "warmup": a.warmup, "machine": f"{os.cpu_count()} cores, {os.uname().machine}",
            # what the connections ran with: set, or the machine's (a new namespace's default)
            "tcp_cc": a.tcp_cc or next(iter(netns.ipv4_sysctl("tcp_congestion_control")), None),
            "namespaces": nsc.names if a.netns else [],  # removed again on exit: the tests check so
            "command": "birdnet bench allreduce " + " ".join(argv if argv is not None else sys.argv[1:])}
    if a.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
    else:
        print(f"# {meta['command']}\n# {a.nodes} nodes, {meta['mode']} {a.rate or ''}; {meta['machine']}, all nodes share it")
        print(f"# the loop: {a.loop_calls} calls back to back after {a.loop_warmup} warm-ups, median of the slowest "
              "node's time per call; own = the process's own arrays, buffer = client.buffer refilled each call; "
              "cpu = one round's CPU, all daemon threads + the processes' hand-off, summed over nodes")
        lh = f"{'count':>10} {'codec':<28} {'loop(s)':>8} {'buffer(s)':>9} {'call(s)':>8} {'loop/call':>9} {'cpu ms':>7}"
        if gloo:
            lh += f" {'gloo(s)':>8} {'x gloo':>7} {'g.cpu ms':>8} {'cpu/g':>6}"
        print(lh)
        for r in rows:
            line = (f"{r['count']:>10} {r['codec']:<28} {r['loop_s']:>8.4f} {r['loop_buffer_s']:>9.4f} "
                    f"{r['time_s']:>8.4f} {r['loop_vs_call']:>8.2f}x "
                    + (f"{r['cpu_round_s'] * 1e3:>7.1f}" if r["cpu_round_s"] is not None else f"{'-':>7}"))
            if "gloo_loop_s" in r:
                line += (f" {r['gloo_loop_s']:>8.4f} {r['loop_speedup_vs_gloo']:>6.2f}x {r['gloo_loop_cpu_s'] * 1e3:>8.1f} "
                         + (f"{r['cpu_vs_gloo']:>5.2f}x" if "cpu_vs_gloo" in r else f"{'-':>6}"))
            print(line)
        print("# the loop's time per call, one node's medians (ms): previous result to the call, hand-off in, "
              "wait for the data phase (agreement or lane), data phase, hand-off out")
        print(f"{'count':>10} {'codec':<28} {'gap':>6} {'in':>6} {'wait':>6} {'data':>7} {'out':>6}")
        for r in rows:
            ph = r["loop_phases_s"]
            print(f"{r['count']:>10} {r['codec']:<28} " + " ".join(
                f"{ph.get(k, float('nan')) * 1e3:>{w}.1f}" for k, w in
                (("gap", 6), ("in", 6), ("wait", 6), ("data", 7), ("out", 6))))
        print("# per call (each after a barrier; nccl-tests' columns)")
        hdr = f"{'size(B)':>12} {'count':>10} {'codec':<28} {'time(s)':>9} {'algbw':>7} {'busbw':>7} {'wire B/node':>12} {'ratio':>7} {'error':>9}"
        hdr += f" {'span(s)':>8}"
        if gloo:
            hdr += f" {'gloo(s)':>8} {'x gloo':>7} {'g.span':>8}"
        print(hdr)
        for r in rows:
            line = (f"{r['size_bytes']:>12} {r['count']:>10} {r['codec']:<28} {r['time_s']:>9.4f} {r['algbw_GBps']:>7.3f} "
                    f"{r['busbw_GBps']:>7.3f} {r['wire_bytes_per_node']:>12} {r['ratio']:>7.1f} "
                    f"{(r['error'] if r['error'] is not None else float('nan')):>9.2e}")
            line += f" {r['span_s']:>8.4f}"
            if "gloo_time_s" in r:
                line += f" {r['gloo_time_s']:>8.4f} {r['speedup_vs_gloo']:>6.2f}x {r['gloo_span_s']:>8.4f}"
            print(line)
        print("# where the time goes (ms after the last node's call; medians): hand-off in, agreement, "
              "data phase, hand-off out; one node's hand-offs in and out (medians over nodes and runs); "
              "CPU of one round's data phase summed over all daemons / Gloo processes")
        print(f"{'count':>10} {'codec':<28} {'ready':>7} {'start':>7} {'data end':>9} {'result':>7} {'in':>5} "
              f"{'out':>5} {'cpu ms':>7}" + (f" {'gloo cpu':>9}" if gloo else ""))
        for r in rows:
            ph = r["phases_s"] or {}
            line = (f"{r['count']:>10} {r['codec']:<28} " + " ".join(
                f"{ph.get(k, float('nan')) * 1e3:>{w}.1f}" for k, w in
                (("ready", 7), ("data_start", 7), ("data_end", 9), ("result", 7), ("handoff_in", 5),
                 ("handoff_out", 5)))
                + f" {r['daemon_cpu_s'] * 1e3:>7.1f}")
            if "gloo_cpu_s" in r:
                line += f" {r['gloo_cpu_s'] * 1e3:>9.1f}"
            print(line)
    if a.plot:
        _plot(rows, a.plot, meta)
    return 0


def _plot(rows, path: str, meta) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for codec in dict.fromkeys(r["codec"] for r in rows):
        rs = [r for r in rows if r["codec"] == codec]
        ax.plot([r["count"] for r in rs], [r["time_s"] for r in rs], "o-", label=f"birdnet {codec}")
    gl = {r["count"]: r["gloo_time_s"] for r in rows if "gloo_time_s" in r}
    if gl:
        ax.plot(list(gl), list(gl.values()), "k--s", label="torch.distributed Gloo")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("float32 elements")
    ax.set_ylabel("all-reduce time (s)")
    ax.set_title(f"{meta['nodes']} nodes, {meta['mode']} {meta['rate'] or ''}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
