"""What a ring over plain TCP sockets costs in CPU, against Gloo (docs/benchmarks.md, "Where a dense
round's CPU goes").

    python docs/results/rawring.py --sizes 100000,1000000,11689512 --calls 400,400,60 --gloo-calls 100 > OUT.json

4 processes on loopback run birdnet's dense ring schedule (reduce-scatter, then all-gather, one
message per step) over plain TCP sockets, no ZeroMQ: the main thread receives each message straight
into its destination with ``recv_into(..., MSG_WAITALL)`` (an all-gather segment lands in the
result, no copy) and adds; a sender thread writes to the right neighbour with ``sendall``. No
headers, no checks, no hand-off from a training process: a floor for what a Python data path on its
own sockets costs, not something to ship. Prints each process's CPU per call (time.process_time,
all its threads), summed, against 4 Gloo ranks doing the same sizes back to back
(docs/results/loopcpu.py's way). A measuring tool, not part of birdnet.
"""
import argparse
import multiprocessing as mp
import os
import queue
import socket
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loopcpu import dump, gloo  # noqa: E402

from birdnet.ring.dense import segment_bounds  # noqa: E402

NODES = 4


def rank_main(r: int, ports: list[int], sizes: list[int], calls: list[int], q) -> None:
    world = len(ports)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", ports[r]))
    srv.listen(1)
    right = socket.socket()
    for _ in range(200):
        try:
            right.connect(("127.0.0.1", ports[(r + 1) % world]))
            break
        except OSError:
            time.sleep(0.05)
    left, _ = srv.accept()
    for s in (right, left):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    outq: queue.Queue = queue.Queue()

    def sender() -> None:
        while True:
            m = outq.get()
            if m is None:
                return
            right.sendall(m)
            outq.task_done()

    th = threading.Thread(target=sender, daemon=True)
    th.start()

    def recv_into(view: memoryview) -> None:
        got = 0
        while got < len(view):
            k = left.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
            if k == 0:
                raise ConnectionError("left neighbour closed")
            got += k

    res = {}
    for n, k in zip(sizes, calls):
        x = np.zeros(n, np.float32)  # sums of zeros stay finite over hundreds of calls; adds cost the same
        b = segment_bounds(n, world)
        tmp = np.empty(b[1] - b[0] + 1, np.float32)

        def allreduce(x: np.ndarray = x, b: list[int] = b, tmp: np.ndarray = tmp) -> None:
            def seg_of(i: int) -> memoryview:
                return memoryview(x[b[i]:b[i + 1]]).cast("B")

            outq.put(seg_of(r))
            for s in range(world - 1):
                seg = (r - s - 1) % world
                part = tmp[:b[seg + 1] - b[seg]]
                recv_into(memoryview(part).cast("B"))
                x[b[seg]:b[seg + 1]] += part
                outq.put(seg_of(seg))
            for s in range(world - 1):
                seg = (r - s) % world
                recv_into(seg_of(seg))  # a finished segment lands in the result: no copy
                if s < world - 2:
                    outq.put(seg_of(seg))
            outq.join()

        for _ in range(5):
            allreduce()
        c0, w0 = time.process_time(), time.monotonic()
        for _ in range(k):
            allreduce()
        res[n] = {"cpu": (time.process_time() - c0) / k, "wall": (time.monotonic() - w0) / k}
    outq.put(None)
    th.join()
    q.put((r, res))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="100000,1000000,11689512")
    p.add_argument("--calls", default="400,400,60")
    p.add_argument("--gloo-calls", type=int, default=100)
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    calls = [int(x) for x in a.calls.split(",")]
    from birdnet.bench.cluster import free_ports

    ports = free_ports(NODES)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, ports, sizes, calls, q)) for r in range(NODES)]
    for pr in procs:
        pr.start()
    got = dict(q.get(timeout=3600) for _ in procs)
    for pr in procs:
        pr.join(60)
        if pr.is_alive():
            pr.kill()
    g = gloo(sizes, a.gloo_calls)
    rows = []
    for n in sizes:
        row = {"count": n, "calls": calls[sizes.index(n)], "gloo_calls": a.gloo_calls,
               "raw_ms": sum(got[r][n]["cpu"] for r in got) * 1e3,
               "wall_ms": max(got[r][n]["wall"] for r in got) * 1e3, "gloo_ms": g[n] * 1e3}
        row["ratio"] = row["raw_ms"] / row["gloo_ms"]
        rows.append(row)
        print(f"{n:>10,} plain-socket ring {row['raw_ms']:7.1f} ms (wall {row['wall_ms']:.1f}) Gloo "
              f"{row['gloo_ms']:7.1f} ms: {row['ratio']:.2f}x", file=sys.stderr)
    dump(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
