"""CPU per dense round on loopback, birdnet by thread against Gloo, over many calls (docs/benchmarks.md,
"Where a dense round's CPU goes").

    python -m birdnet.bench.tools.loopcpu --sizes 100000,1000000,11689512 --calls 1500,400,60 --gloo-calls 100 > OUT.json

Starts 4 daemons on loopback (no link shaping: CPU, not the wire, is measured), one process per
node, and times CALLS back-to-back ``client.allreduce`` calls of each size with the process's own
array (the user's path: the copy into shared memory included) after 5 warm-up calls. Around them it
reads every daemon thread's CPU time from /proc (birdnet.bench.allreduce.thread_cpu_seconds) and the
processes' own CPU (the hand-off), and prints per round, summed over the 4 nodes, in ms. Then 4
torch.distributed/Gloo ranks (birdnet.bench.gloo_worker) do the same sizes GLOO_CALLS times back to
back; their processes' CPU per call, summed. Far more calls than ``birdnet bench allreduce``'s 7:
on this 2-core VM Gloo's CPU over 7 calls varied 1.5-2.4x between runs of the same code. With
``--buffer`` the calls pass a ``client.buffer`` array, filled once: no copy into shared memory, as
Gloo reduces its tensor in place (the round's result is written back into the buffer).
``--chunk-bytes`` and ``--max-chunk-bytes`` are the daemons' (one message per ring step, as the
bare ring sends: ``--chunk-bytes`` above a segment's bytes and ``--max-chunk-bytes 0``). A
measuring tool, not part of birdnet.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from birdnet.bench.allreduce import thread_cpu_seconds
from birdnet.bench.cluster import LocalCluster, free_ports

NODES = 4


def worker(sock, node, local, sizes, calls, pids, buffer=False):
    from birdnet.client import Client

    c = Client(sock)
    out = {}
    for n, k in zip(sizes, calls):
        g = np.random.default_rng(node).standard_normal(n).astype(np.float32)
        if buffer:  # a client.buffer array, not refilled: no hand-off copy (Gloo's tensor is reduced in place too)
            b = c.buffer(n)
            b[:] = g
            g = b
        for _ in range(5):
            c.allreduce(g, name=f"g{n}")
        c.barrier()
        t0, c0, w0 = thread_cpu_seconds(pids[node]), time.process_time(), time.monotonic()
        for _ in range(k):
            c.allreduce(g, name=f"g{n}")
        wall = (time.monotonic() - w0) / k
        t1, client = thread_cpu_seconds(pids[node]), (time.process_time() - c0) / k
        out[n] = {"wall": wall, "client": client, **{t: (t1[t] - t0.get(t, 0.0)) / k for t in t1}}
        c.barrier()
    c.close()
    return out


def gloo(sizes: list[int], calls: int) -> dict[int, float]:
    port = free_ports(1)[0]
    cmds = [[sys.executable, "-m", "birdnet.bench.gloo_worker", "--rank", str(r), "--world", str(NODES),
             "--master", f"127.0.0.1:{port}", "--sizes", ",".join(map(str, sizes)), "--runs", "1",
             "--warmup", "1", "--loop-calls", str(calls), "--loop-warmup", "5"] for r in range(NODES)]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for c in cmds]
    try:
        outs = [json.loads(p.communicate(timeout=1800)[0]) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return {n: sum(o["loop_cpu"][str(n)] for o in outs) for n in sizes}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="100000,1000000,11689512")
    p.add_argument("--calls", default="1500,400,60", help="timed birdnet calls per size")
    p.add_argument("--gloo-calls", type=int, default=100)
    p.add_argument("--buffer", action="store_true",
                   help="call with a client.buffer array (never refilled) instead of the process's own array")
    p.add_argument("--chunk-bytes", type=int, default=None, help="birdnetd --chunk-bytes (default: its own)")
    p.add_argument("--max-chunk-bytes", type=int, default=None,
                   help="birdnetd --max-chunk-bytes (default: its own; 0: chunks of --chunk-bytes always)")
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    calls = [int(x) for x in a.calls.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        extra = [] if a.chunk_bytes is None else ["--chunk-bytes", str(a.chunk_bytes),
                                                    "--max-message-bytes", str(max(2 * a.chunk_bytes, 1 << 26))]
        if a.max_chunk_bytes is not None:
            extra += ["--max-chunk-bytes", str(a.max_chunk_bytes)]
        with LocalCluster(NODES, Path(tmp), peer_timeout=30, heartbeat_interval=1.0, extra=extra) as cl:
            pids = [pr.pid for pr in cl.procs]
            per_node = cl.run(worker, sizes, calls, pids, a.buffer, per_node=1, timeout=3600)
    g = gloo(sizes, a.gloo_calls)
    rows = []
    for n in sizes:
        row = {"count": n, "calls": calls[sizes.index(n)], "gloo_calls": a.gloo_calls, "buffer": a.buffer,
               "chunk_bytes": a.chunk_bytes, "max_chunk_bytes": a.max_chunk_bytes,
               "wall_ms": statistics.median(pn[n]["wall"] for pn in per_node) * 1e3}
        for kind in ("client", "main", "ring", "zmq_io", "other"):
            row[f"{kind}_ms"] = sum(pn[n].get(kind, 0.0) for pn in per_node) * 1e3
        row["birdnet_ms"] = sum(row[f"{k}_ms"] for k in ("client", "main", "ring", "zmq_io", "other"))
        row["gloo_ms"] = g[n] * 1e3
        row["ratio"] = row["birdnet_ms"] / row["gloo_ms"]
        rows.append(row)
        print(f"{n:>10,} birdnet {row['birdnet_ms']:7.1f} ms (client {row['client_ms']:.1f}, main {row['main_ms']:.1f}, "
              f"ring {row['ring_ms']:.1f}, ZeroMQ I/O {row['zmq_io_ms']:.1f}) Gloo {row['gloo_ms']:7.1f} ms: "
              f"{row['ratio']:.2f}x", file=sys.stderr)
    dump(rows)
    return 0


def dump(rows: list[dict]) -> None:
    """The rows as JSON on stdout, with the machine and the time (rawring.py's too)."""
    json.dump({"meta": {"nodes": NODES, "machine": os.uname().machine, "cpus": os.cpu_count(),
                        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, "rows": rows},
              sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    sys.exit(main())
