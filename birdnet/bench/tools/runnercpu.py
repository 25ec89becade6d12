"""CPU of one round's data phase per node, without sockets (docs/benchmarks.md, CHANGELOG.md).

    python -m birdnet.bench.tools.runnercpu --codec birdplus --size 11689512 --rounds 10 [--op sum] [--lane]

WORLD RoundRunners over MemoryRing (one thread per node, as birdnet.daemon.warmup runs them), one
local process per node, its buffer refilled before every round outside the timing; prints the
median over ROUNDS (after 2 warm-ups) of the RoundRunner.run CPU time (time.thread_time) summed
over the nodes, and per node. Less sensitive to other work on the machine than a cluster's wall
time, and it runs any checkout (PYTHONPATH), so two commits can be compared alternately. Run with
NUMBA_NUM_THREADS=1 for the daemons' setting on 4 nodes of a 2-core machine. A measuring tool, not
part of birdnet.
"""
import argparse
import json
import os
import statistics
import time

import numpy as np

from birdnet.codecs import get_codec
from birdnet.config import Settings
from birdnet.daemon.engine import Contribution, LocalRound, RoundRunner, StateStore
from birdnet.ring.transport import MemoryRing


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--size", type=int, default=11_689_512)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--codec", default="birdplus")
    p.add_argument("--op", default="mean")
    p.add_argument("--lane", action="store_true", help="counts as a lane round learns them (None)")
    a = p.parse_args()
    world, n = a.world, a.size
    codec = get_codec(a.codec, **({"density": 0.01} if a.codec.startswith("bird") else {}))
    desc = {"kind": "allreduce", "name": "g", "shape": [n], "dtype": "float32", "op": a.op,
            "codec": codec.describe(), "root": None}
    runners = [RoundRunner(Settings(), StateStore(1 << 34)) for _ in range(world)]
    xs = [np.random.default_rng(1000 + r).standard_normal(n).astype(np.float32) for r in range(world)]
    bufs = [x.copy() for x in xs]
    cpu: list[list[float]] = [[] for _ in range(world)]
    for i in range(a.rounds + 2):
        for r in range(world):
            bufs[r][:] = xs[r]

        def node(t, i=i):
            rnd = LocalRound(job="j", seq=i, kind="allreduce", desc=dict(desc),
                             parts=[Contribution(b"s", i, bufs[t.rank], 0, t.rank)])
            c0 = time.thread_time()
            runners[t.rank].run(rnd, t, t.rank, world, None if a.lane else [1] * world)
            return time.thread_time() - c0

        res = MemoryRing(world).run(node, timeout=300)
        if i >= 2:
            for r in range(world):
                cpu[r].append(res[r])
    tot = [sum(cpu[r][i] for r in range(world)) for i in range(a.rounds)]
    print(json.dumps({"codec": a.codec, "op": a.op, "size": n, "world": world,
                      "sum_ms_median": round(statistics.median(tot) * 1e3, 1), "sum_ms_min": round(min(tot) * 1e3, 1),
                      "per_node_ms_median": round(statistics.median(tot) / world * 1e3, 2),
                      "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
