"""Where a dense round's CPU goes, per daemon thread (docs/benchmarks.md).

    python -m birdnet.bench.tools.threadcpu --nodes 8 --calls 200 --rate 1gbit > OUT.json
    python -m birdnet.bench.tools.threadcpu --nodes 4 --calls 20 --size 11689512 --chunk-bytes 4194304 > OUT.json

Starts NODES daemons, each in its own network namespace with a token-bucket link (root), one
process per node, and times CALLS back-to-back dense all-reduces of 1,000,000 float32 in shared
memory after 5 warm-up calls. Around the timed calls it reads every daemon thread's CPU time and
minor page faults and context switches from /proc (main thread, the ring thread, ZeroMQ's I/O
thread, others) and the machine's CPU time from /proc/stat, and prints them per call in ms (faults
and switches per call), summed over this run's daemons (not other daemons on the machine). To compare with glibc's malloc defaults, run it once with
GLIBC_TUNABLES=glibc.malloc.perturb=0 in the environment (any malloc tunable makes birdnetd leave
malloc alone; perturb=0 is glibc's default). A measuring tool, not part of birdnet.
"""
import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from birdnet.bench import netns
from birdnet.bench.cluster import LocalCluster

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def snapshot(pids: list[int]) -> dict:
    """(pid, tid, thread kind) -> (user ticks, system ticks, minor faults, context switches) of
    every thread of this run's daemons ``pids`` (only those: other daemons on a shared machine are
    not this run's)."""
    out = {}
    for pid in map(str, pids):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                st = open(f"/proc/{pid}/task/{tid}/stat").read()
                status = open(f"/proc/{pid}/task/{tid}/status").read()
            except OSError:
                continue
            # voluntary + involuntary switches: how often the thread slept and woke (per message?)
            switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
            name = st[st.index("(") + 1:st.rindex(")")]
            f = st[st.rindex(")") + 2:].split()
            # the main thread is the process. birdnetd names its ring thread (birdnet.osutil.name_os_thread);
            # before it did, every Python thread had the interpreter's name and counted as "ring" here
            # (the JSONs of 2026-12-01 made before that change); now other Python threads (pyzmq's
            # garbage collector, the metrics server) count as "other".
            kind = "main" if tid == pid else ("zmq_io" if name.startswith("ZMQbg/IO") else
                                              "zmq_reaper" if name.startswith("ZMQbg") else
                                              "ring" if name == "birdnet-ring" else "other")
            out[(pid, tid, kind)] = (int(f[11]), int(f[12]), int(f[7]), switches)
    return out


def machine() -> list[int]:
    return [int(x) for x in open("/proc/stat").readline().split()[1:8]]


def worker(sock, node, local, cfg):
    from birdnet.client import Client
    with Client(sock, job="threadcpu") as c:
        buf = c.buffer((cfg["n"],), np.float32)
        buf[:] = np.random.default_rng(c.rank).standard_normal(cfg["n"]).astype(np.float32)
        for _ in range(5):
            c.allreduce_async(buf, name="g").wait(60)
        c.barrier()
        before = (snapshot(cfg["pids"]), machine()) if c.rank == 0 else None
        c.barrier()
        t0 = time.monotonic()
        for _ in range(cfg["calls"]):
            c.allreduce_async(buf, name="g").wait(60)
        loop = (time.monotonic() - t0) / cfg["calls"]
        c.barrier()
        if c.rank != 0:
            return {"loop_ms": loop * 1e3}
        s1, m1 = snapshot(cfg["pids"]), machine()
        s0, m0 = before
        per = collections.Counter()
        for k, (u, s, flt, sw) in s1.items():
            if k in s0:
                per[f"{k[2]}_switches"] += (sw - s0[k][3]) / cfg["calls"]
                per[f"{k[2]}_user_ms"] += (u - s0[k][0]) * TICK_MS / cfg["calls"]
                per[f"{k[2]}_system_ms"] += (s - s0[k][1]) * TICK_MS / cfg["calls"]
                per[f"{k[2]}_faults"] += (flt - s0[k][2]) / cfg["calls"]
        names = ["user", "nice", "system", "idle", "iowait", "irq", "softirq"]
        return {"loop_ms": loop * 1e3, "daemons_per_call": {k: round(v, 2) for k, v in sorted(per.items())},
                "machine_ms_per_call": {n: round((b - a) * TICK_MS / cfg["calls"], 2) for n, a, b in zip(names, m0, m1)}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--size", type=int, default=1_000_000)
    p.add_argument("--chunk-bytes", type=int, default=None, help="birdnetd --chunk-bytes (default: its own)")
    p.add_argument("--max-chunk-bytes", type=int, default=None,
                   help="birdnetd --max-chunk-bytes (default: its own; 0: chunks of --chunk-bytes always)")
    a = p.parse_args()
    extra = [] if a.chunk_bytes is None else ["--chunk-bytes", str(a.chunk_bytes),
                                                "--max-message-bytes", str(max(2 * a.chunk_bytes, 1 << 26))]
    if a.max_chunk_bytes is not None:
        extra += ["--max-chunk-bytes", str(a.max_chunk_bytes)]
    with tempfile.TemporaryDirectory() as tmp, netns.NetnsCluster(a.nodes, a.rate) as nsc:
        prefixes = [nsc.exec_prefix(i) for i in range(a.nodes)]
        with LocalCluster(a.nodes, Path(tmp), addresses=nsc.addresses, prefixes=prefixes,
                          peer_timeout=60.0, heartbeat_interval=1.0, extra=extra) as cl:
            pids = [p.pid for p in cl.procs if p is not None]  # `ip netns exec` execs: the daemon's own pid
            res = cl.run(worker, {"n": a.size, "calls": a.calls, "pids": pids}, per_node=1, timeout=900)
    node0 = next(r for r in res if "daemons_per_call" in r)
    json.dump({"nodes": a.nodes, "rate": a.rate, "size": a.size, "calls": a.calls, "chunk_bytes": a.chunk_bytes,
               "max_chunk_bytes": a.max_chunk_bytes,
               "load_average": os.getloadavg(),
               "malloc_env": os.environ.get("GLIBC_TUNABLES", ""), "machine": f"{os.cpu_count()} cores",
               "loop_ms_slowest": round(max(r["loop_ms"] for r in res), 2), **node0}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
