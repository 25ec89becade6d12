"""How far a Python ring over ZeroMQ can go on this machine: birdnet's dense all-reduce against Gloo
and a bare 20-line ring on the same links.

    python -m birdnet.bench.tools.pyring --nodes 8 --calls 200 --size 1000000 > OUT.json

In one run, on the same network namespaces and token-bucket links (root), times CALLS back-to-back
all-reduces of SIZE float32 after 5 warm-up calls, three ways:

* ``birdnet``: birdnetd, one process per node handing its buffer over in shared memory (the dense lane);
* ``gloo``: torch.distributed's Gloo all-reduce, one process per node (needs torch);
* ``bare``: the same ring schedule as birdnet's dense all-reduce (reduce-scatter, then all-gather, one
  message per step) in about 20 lines of Python and pyzmq, one process per node, with none of what
  a daemon needs around it: no header checks, no message numbering, no liveness, no aborts, no
  hand-off from a training process. Not something to ship; a floor for what the interpreter costs.

For each it prints the loop time per call (the slowest node's) and, from /proc/stat around the timed
calls, the machine's CPU time per call in ms (user, system, softirq, idle; all processes) and its
context switches per call. A measuring tool, not part of birdnet.
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

import numpy as np

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
WARMUP = 5


def machine() -> dict:
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            p = line.split()
            if p[0] == "cpu":
                out["cpu"] = [int(x) for x in p[1:8]]
            elif p[0] == "ctxt":
                out["ctxt"] = int(p[1])
    return out


def per_call(a: dict, b: dict, calls: int) -> dict:
    names = ["user", "nice", "system", "idle", "iowait", "irq", "softirq"]
    d = {n: round((y - x) * TICK_MS / calls, 2) for n, x, y in zip(names, a["cpu"], b["cpu"])
         if n in ("user", "system", "idle", "softirq")}
    d["busy"] = round(d["user"] + d["system"] + d["softirq"], 2)
    d["ctxt"] = round((b["ctxt"] - a["ctxt"]) / calls, 1)
    return d


def birdnet_worker(sock, node, local, cfg):
    from birdnet.client import Client
    with Client(sock, job="pyring") as c:
        buf = c.buffer((cfg["n"],), np.float32)
        buf[:] = 1.0
        for _ in range(WARMUP):
            c.allreduce_async(buf, name="g").wait(60)
        c.barrier()
        m0 = machine() if c.rank == 0 else None
        t0 = time.monotonic()
        for _ in range(cfg["calls"]):
            c.allreduce_async(buf, name="g").wait(60)
        loop = time.monotonic() - t0
        m1 = machine() if c.rank == 0 else None
        c.barrier()
        out = {"loop_ms": loop * 1e3 / cfg["calls"]}
        if c.rank == 0:
            out.update(per_call(m0, m1, cfg["calls"]))
        return out


def gloo_rank(a) -> dict:
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    import datetime

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{a.addresses.split(',')[0]}:29955", rank=a.rank,
                            world_size=a.nodes, timeout=datetime.timedelta(seconds=120))
    t = torch.ones(a.size)
    for _ in range(WARMUP):
        dist.all_reduce(t)
    dist.barrier()
    m0 = machine()
    t0 = time.monotonic()
    for _ in range(a.calls):
        dist.all_reduce(t)
    loop = time.monotonic() - t0
    m1 = machine()
    dist.barrier()
    dist.destroy_process_group()
    return {"loop_ms": loop * 1e3 / a.calls, **per_call(m0, m1, a.calls)}


def bare_rank(a) -> dict:
    import struct

    import zmq
    rank, world, addrs = a.rank, a.nodes, a.addresses.split(",")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://{addrs[rank]}:29877")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://{addrs[(rank + 1) % world]}:29877")
    b = [round(i * a.size / world) for i in range(world + 1)]
    step = struct.Struct("<II")

    def recv() -> np.ndarray:
        frames = router.recv_multipart(copy=False)  # identity, step, data
        return np.frombuffer(frames[2], np.float32)

    def allreduce(x: np.ndarray) -> None:
        r = rank
        dealer.send_multipart([step.pack(0, 0), x[b[r]:b[r + 1]]], copy=False)
        for s in range(world - 1):
            seg = slice(b[(r - s - 1) % world], b[(r - s - 1) % world + 1])
            inc = recv()
            if s < world - 2:
                acc = np.add(inc, x[seg], out=inc) if inc.flags.writeable else inc + x[seg]
                dealer.send_multipart([step.pack(0, s + 1), acc], copy=False)
            else:
                x[seg] += inc
                dealer.send_multipart([step.pack(1, 0), x[seg]], copy=False)
        for s in range(world - 1):
            seg = slice(b[(r - s) % world], b[(r - s) % world + 1])
            inc = recv()
            x[seg] = inc
            if s < world - 2:
                dealer.send_multipart([step.pack(1, s + 1), inc], copy=False)

    x = np.ones(a.size, np.float32)
    time.sleep(1.0)  # every node bound and connected (ZeroMQ queues until then anyway)
    for _ in range(WARMUP):
        x[:] = 1.0
        allreduce(x)
    if not np.all(x == world):
        raise SystemExit(f"bare ring: wrong sum on rank {rank}")
    m0 = machine()
    t0 = time.monotonic()
    for _ in range(a.calls):
        allreduce(x)
    loop = time.monotonic() - t0
    m1 = machine()
    time.sleep(0.5)  # let the right neighbour take the last message before the sockets go
    router.close(0)
    dealer.close(0)
    ctx.term()
    return {"loop_ms": loop * 1e3 / a.calls, **per_call(m0, m1, a.calls)}


def run_ranks(role: str, prefixes, a, addresses) -> dict:
    procs = [subprocess.Popen([*prefixes[r], sys.executable, os.path.abspath(__file__), "--role", role, "--rank",
                               str(r), "--nodes", str(a.nodes), "--addresses", ",".join(addresses),
                               "--size", str(a.size), "--calls", str(a.calls)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for r in range(a.nodes)]
    try:
        outs = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {**outs[0], "loop_ms": round(max(o["loop_ms"] for o in outs), 2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--size", type=int, default=1_000_000)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--only", choices=["birdnet", "gloo", "bare"], help="run one of the three (A/B runs of birdnet)")
    p.add_argument("--role", choices=["gloo", "bare"], help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--addresses", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role:
        print(json.dumps(gloo_rank(a) if a.role == "gloo" else bare_rank(a)))
        return
    from birdnet.bench import netns
    from birdnet.bench.cluster import LocalCluster
    out = {"nodes": a.nodes, "rate": a.rate, "size": a.size, "calls": a.calls, "machine": f"{os.cpu_count()} cores",
           "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as tmp, netns.NetnsCluster(a.nodes, a.rate) as nsc:
        prefixes = [nsc.exec_prefix(i) for i in range(a.nodes)]
        if a.only in (None, "birdnet"):
            with LocalCluster(a.nodes, Path(tmp), addresses=nsc.addresses, prefixes=prefixes,
                              peer_timeout=60.0, heartbeat_interval=1.0) as cl:
                res = cl.run(birdnet_worker, {"n": a.size, "calls": a.calls}, per_node=1, timeout=900)
            out["birdnet"] = {**next(r for r in res if "busy" in r),
                              "loop_ms": round(max(r["loop_ms"] for r in res), 2)}
        for role in ("gloo", "bare"):
            if a.only in (None, role):
                out[role] = run_ranks(role, prefixes, a, nsc.addresses)
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
