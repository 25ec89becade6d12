"""One torch.distributed (Gloo) rank for ``birdnet bench allreduce --vs-gloo``; prints its times as
JSON on stdout. Run inside the node's network namespace, like the birdnet daemon it is compared to."""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="host:port of rank 0")
    p.add_argument("--iface", default=None, help="GLOO_SOCKET_IFNAME")
    p.add_argument("--sizes", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--loop-calls", type=int, default=7)
    p.add_argument("--loop-warmup", type=int, default=2)
    a = p.parse_args(argv)
    import os
    if a.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = a.iface
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world,
                            timeout=__import__("datetime").timedelta(seconds=120))
    out, spans, cpus, loops, loop_cpu = {}, {}, {}, {}, {}
    for n in [int(x) for x in a.sizes.split(",")]:
        t = torch.randn(n, generator=torch.Generator().manual_seed(a.rank))
        times, marks, cpu = [], [], []
        for i in range(a.warmup + a.runs):
            dist.barrier()
            c0 = time.process_time()  # this process and its threads (Gloo's I/O loop is one)
            t0 = time.monotonic()  # the clock birdnet's benchmark uses
            dist.all_reduce(t)
            t1 = time.monotonic()
            if i >= a.warmup:
                times.append(t1 - t0)
                marks.append([t0, t1])
                cpu.append(time.process_time() - c0)
        out[str(n)] = times
        spans[str(n)] = marks
        cpus[str(n)] = cpu
        # as nccl-tests and a training loop: the calls back to back after one barrier; per call the
        # time from the previous result, and the CPU of this process over the timed calls
        dist.barrier()
        prev = time.monotonic()
        ends = []
        for i in range(a.loop_warmup + a.loop_calls):
            if i == a.loop_warmup:
                c0 = time.process_time()
            dist.all_reduce(t)
            t1 = time.monotonic()
            if i >= a.loop_warmup:
                ends.append([prev, t1])
            prev = t1
        loops[str(n)] = ends
        loop_cpu[str(n)] = (time.process_time() - c0) / a.loop_calls
    dist.destroy_process_group()
    print(json.dumps({"rank": a.rank, "times": out, "marks": spans, "cpu": cpus, "loop": loops,
                      "loop_cpu": loop_cpu}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
