"""What a ring over plain TCP sockets costs in CPU, against Gloo (docs/benchmarks.md, "Where a dense
round's CPU goes").

    python -m birdnet.bench.tools.rawring [--handoff | --zmq] --sizes 100000,1000000,11689512 --calls 400,400,60 --gloo-calls 100 > OUT.json

4 processes on loopback run birdnet's dense ring schedule (reduce-scatter, then all-gather, one
message per step) over plain TCP sockets, no ZeroMQ: the main thread receives each message straight
into its destination with ``recv_into(..., MSG_WAITALL)`` (an all-gather segment lands in the
result, no copy) and adds; a sender thread writes to the right neighbour with ``sendall``. No
headers, no checks, no hand-off from a training process: a floor for what a Python data path on its
own sockets costs, not something to ship. With ``--handoff`` each call first copies the process's own
array into the ring's memory, the one copy a daemon in another process needs (birdnet's client copies
it into shared memory; Gloo reduces the tensor in place): the floor for a separate daemon fed the
process's own arrays. With ``--zmq`` the same schedule runs over a ZeroMQ PUSH/PULL pair per link
and moves data as birdnet's ring does (daemon/links.py, birdnet/ring/dense.py):
messages up to 1 MiB copied into ZeroMQ, larger ones zero-copy with a tracker waited for at the end
of the call; a received frame summed in place and sent on as it is; an all-gather segment copied
from its frame into the result; glibc's malloc told to keep freed buffers, as the daemon does
(birdnet.osutil.keep_freed_buffers). That is ZeroMQ's own cost, without birdnet's headers, checks, poll
loop and hand-off. Prints each process's CPU per call (time.process_time, all its threads, ZeroMQ's
I/O thread too), summed and by thread, against 4 Gloo ranks doing the same sizes back to back
(loopcpu's way). A measuring tool, not part of birdnet.
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

from birdnet.bench.allreduce import thread_cpu_seconds  # noqa: E402
from birdnet.bench.tools.loopcpu import dump, gloo  # noqa: E402
from birdnet.osutil import keep_freed_buffers  # noqa: E402
from birdnet.ring.dense import segment_bounds  # noqa: E402

NODES = 4


def timed(allreduce, k: int) -> dict:
    """CPU and wall time per call over ``k`` calls after 5 warm-ups; the CPU also by thread: ``main``
    (the ring's own thread), ``zmq_io`` (ZeroMQ's I/O thread), ``other`` (the plain ring's sender
    thread; pyzmq's tracker thread)."""
    for _ in range(5):
        allreduce()
    t0 = thread_cpu_seconds(os.getpid())
    c0, w0 = time.process_time(), time.monotonic()
    for _ in range(k):
        allreduce()
    cpu, wall = (time.process_time() - c0) / k, (time.monotonic() - w0) / k
    t1 = thread_cpu_seconds(os.getpid())
    return {"cpu": cpu, "wall": wall, "threads": {t: (t1[t] - t0.get(t, 0.0)) / k for t in t1}}


def zmq_rank_main(r: int, ports: list[int], sizes: list[int], calls: list[int], q, commit: bool = False,
                  headers: bool = False) -> None:
    """rank_main's schedule over ZeroMQ, moving data as birdnet does (the module's docstring).

    ``commit``: after the all-gather, the count birdnet's all-or-nothing rounds end with
    (daemon/transport.py, RoundTransport.await_commit): each node tells its right neighbour how many
    consecutive nodes ending with itself hold the result, 1 + its left's last count, at most world - 1,
    again whenever it grows, and the call returns once its left says world - 1 (world - 1 small
    messages in and out per node). ``headers``: every message carries a small msgpack header (the
    round's key, phase and step) that the receiver decodes and checks, the least a node needs to tell
    one round's messages from another's; no other check, record or poll."""
    import msgpack
    import zmq

    world = len(ports)
    # as the daemon does at start (daemon/main.py): ZeroMQ allocates every received message, and
    # with glibc's defaults the freed memory is handed back and page-faulted in again on every call
    keep_freed_buffers(max(-(-n // world) for n in sizes) * 4)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    pull.setsockopt(zmq.RCVTIMEO, 120_000)  # a lost neighbour ends the run with zmq.Again, never a hang
    pull.bind(f"tcp://127.0.0.1:{ports[r]}")
    push.connect(f"tcp://127.0.0.1:{ports[(r + 1) % world]}")
    copy_below = 1 << 20  # daemon/links.py COPY_BELOW
    trackers = []

    tag = {"k": "w", "p": 0, "s": 0}

    def send(buf, step: int = 0) -> None:
        if headers:
            tag["s"] = step
            push.send(msgpack.packb(tag), zmq.SNDMORE)
        if isinstance(buf, zmq.Frame):
            push.send(buf, copy=False)  # a received frame goes on as it is
            return
        big = buf.nbytes > copy_below
        t = push.send(buf, copy=not big, track=big)
        if big:
            trackers.append(t)

    def recv(step: int = 0) -> tuple[zmq.Frame, np.ndarray]:
        if headers:
            h = msgpack.unpackb(pull.recv())
            if h["k"] != "w" or h["s"] != step:
                raise RuntimeError(f"unexpected message {h} at step {step}")
        f = pull.recv(copy=False)
        return f, np.frombuffer(f.buffer, np.float32)

    def count(c: int) -> None:
        if headers:
            push.send(msgpack.packb({"k": "w", "t": "commit", "c": c}))
        else:
            push.send(c.to_bytes(1, "little"))

    def counted() -> int:
        m = pull.recv()
        return msgpack.unpackb(m)["c"] if headers else m[0]

    # every rank sends first: all connections are up before the first call's data
    push.send(b"hello")
    pull.recv()
    res = {}
    for n, k in zip(sizes, calls):
        x = np.zeros(n, np.float32)
        b = segment_bounds(n, world)

        def allreduce(x: np.ndarray = x, b: list[int] = b) -> None:
            send(x[b[r]:b[r + 1]], 0)
            for s in range(world - 1):
                seg = (r - s - 1) % world
                f, part = recv(s)
                if s < world - 2:
                    np.add(part, x[b[seg]:b[seg + 1]], out=part)
                    send(f, s + 1)
                else:
                    x[b[seg]:b[seg + 1]] += part
                    send(x[b[seg]:b[seg + 1]], s + 1)
            for s in range(world - 1):
                seg = (r - s) % world
                f, part = recv(world - 1 + s)
                x[b[seg]:b[seg + 1]] = part
                if s < world - 2:
                    send(f, world + s)
            if commit:
                left = sent = 0
                while True:
                    c = min(1 + left, world - 1)
                    if c > sent:
                        count(c)
                        sent = c
                    if left >= world - 1:
                        break
                    left = counted()
            for t in trackers:
                t.wait()
            trackers.clear()

        res[n] = timed(allreduce, k)
    push.send(b"bye")  # the left neighbour's last message may still be in flight: wait for it
    pull.recv()
    pull.close()
    push.close(linger=10_000)  # LINGER 0 could drop our bye before the right neighbour has it
    ctx.term()
    q.put((r, res))


def rank_main(r: int, ports: list[int], sizes: list[int], calls: list[int], q, handoff: bool = False) -> None:
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
        user = np.zeros(n, np.float32) if handoff else None

        def allreduce(x: np.ndarray = x, b: list[int] = b, tmp: np.ndarray = tmp, user=user) -> None:
            if user is not None:
                np.copyto(x, user)  # the hand-off: a training process's array into the daemon's memory

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

        res[n] = timed(allreduce, k)
    outq.put(None)
    th.join()
    q.put((r, res))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="100000,1000000,11689512")
    p.add_argument("--calls", default="400,400,60")
    p.add_argument("--gloo-calls", type=int, default=100)
    p.add_argument("--zmq", action="store_true", help="the same schedule over ZeroMQ, as birdnet moves data")
    p.add_argument("--commit", action="store_true",
                   help="--zmq only: end each call with birdnet's commit count round the ring")
    p.add_argument("--headers", action="store_true",
                   help="--zmq only: a small msgpack header on every message, decoded and checked")
    p.add_argument("--handoff", action="store_true",
                   help="plain sockets only: each call first copies the process's own array into the ring's, "
                        "as birdnet's client copies it into shared memory")
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    calls = [int(x) for x in a.calls.split(",")]
    from birdnet.bench.cluster import free_ports

    ports = free_ports(NODES)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    if a.zmq and a.handoff:
        p.error("--handoff is for the plain-socket ring")
    if (a.commit or a.headers) and not a.zmq:
        p.error("--commit and --headers are for the ZeroMQ ring (--zmq)")
    target, extra = (zmq_rank_main, (a.commit, a.headers)) if a.zmq else (rank_main, (a.handoff,))
    procs = [ctx.Process(target=target, args=(r, ports, sizes, calls, q, *extra)) for r in range(NODES)]
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
        row = {"count": n, "calls": calls[sizes.index(n)], "gloo_calls": a.gloo_calls, "zmq": a.zmq, "handoff": a.handoff,
               "commit": a.commit, "headers": a.headers,
               "raw_ms": sum(got[r][n]["cpu"] for r in got) * 1e3,
               "wall_ms": max(got[r][n]["wall"] for r in got) * 1e3, "gloo_ms": g[n] * 1e3}
        row["ratio"] = row["raw_ms"] / row["gloo_ms"]
        for t in ("main", "zmq_io", "other"):
            row[f"{t}_ms"] = sum(got[r][n]["threads"].get(t, 0.0) for r in got) * 1e3
        rows.append(row)
        print(f"{n:>10,} {'bare ZeroMQ' if a.zmq else 'plain-socket'} ring{' + hand-off' if a.handoff else ''}{' + commit' if a.commit else ''}{' + headers' if a.headers else ''} {row['raw_ms']:7.1f} ms (wall {row['wall_ms']:.1f}; "
              f"ring thread {row['main_ms']:.1f}, ZeroMQ I/O {row['zmq_io_ms']:.1f}, other {row['other_ms']:.1f}) Gloo "
              f"{row['gloo_ms']:7.1f} ms: {row['ratio']:.2f}x", file=sys.stderr)
    dump(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
