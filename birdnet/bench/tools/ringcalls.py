"""Python function calls on the daemon's ring thread per dense round, by function (docs/benchmarks.md,
"Where a dense round's CPU goes").

    python -m birdnet.bench.tools.ringcalls --sizes 1000000,11689512 --calls 50 [--chunk-bytes N --max-chunk-bytes 0] > OUT.json

Starts 4 daemons on loopback (one cluster per size), each under a profile hook on its ring thread
(``birdnet-ring``), and makes WARMUP + CALLS + 1 back-to-back ``client.allreduce`` calls per node. The
hook counts every Python function entered on the ring thread (``call`` events) and every C function
called from Python (``c_call``) from the start of round WARMUP + 1 to the start of round
WARMUP + CALLS + 1 (a round starts where ``RoundRunner.run`` is entered), so each counted round is
one whole cycle of the ring thread: its data phase, commit, answer to the processes and the wait for
the next call. Prints per round per node (the mean of the 4 nodes) the calls, and the functions
that make most of them. Unlike CPU time, the counts do not depend on the machine's load (only the
idle polls between calls do, a few per round); the hook slows the daemon, so no time is measured.
A measuring tool, not part of birdnet.
"""
import argparse
import collections
import json
import os
import runpy
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

NODES = 4
RING_THREAD = "birdnet-ring"
#: how long a worker waits for its daemon's counts file after its last call
DUMP_TIMEOUT = 60.0


def _daemon(out: str, warmup: int, calls: int, argv: list[str]) -> None:
    """Run ``birdnetd`` (``argv``: the rest of its command line after ``-m birdnet.daemon.main``) with
    the counting hook on its ring thread; the counts of rounds warmup+1..warmup+calls go to ``out``."""
    from birdnet.daemon.runner import RoundRunner

    start_code = RoundRunner.run.__code__
    py: collections.Counter = collections.Counter()
    cc: collections.Counter = collections.Counter()
    seen = [0]

    def count(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code is start_code:
                seen[0] += 1
                if seen[0] == warmup + 1:
                    py.clear()
                    cc.clear()
                elif seen[0] == warmup + calls + 1:
                    sys.setprofile(None)
                    _write(out, py, cc, calls)
                    return
            py[code] += 1
        elif event == "c_call":
            cc[arg] += 1

    def first(frame, event, arg):
        # threading.setprofile's function is every new thread's: keep counting on the ring thread only
        if threading.current_thread().name == RING_THREAD:
            sys.setprofile(count)
            count(frame, event, arg)
        else:
            sys.setprofile(None)

    threading.setprofile(first)
    sys.argv = ["birdnetd", *argv]
    runpy.run_module("birdnet.daemon.main", run_name="__main__")


def _name(code) -> str:
    path = code.co_filename
    for root in ("birdnet/", "daemon/", "client/"):
        i = path.rfind("/" + root)
        if i >= 0:
            path = path[i + 1:]
            break
    else:
        path = os.path.basename(path)
    return f"{path}:{code.co_firstlineno}:{getattr(code, 'co_qualname', code.co_name)}"


def _write(out: str, py: collections.Counter, cc: collections.Counter, rounds: int) -> None:
    res = {"rounds": rounds, "py": {_name(k): v for k, v in py.items()},
           "c": {getattr(k, "__qualname__", repr(k)): v for k, v in cc.items()}}
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, out)


def worker(sock, node, local, n, warmup, calls, outs):
    from birdnet.client import Client

    with Client(sock) as c:
        g = np.random.default_rng(node).standard_normal(n).astype(np.float32)
        for _ in range(warmup + calls + 1):
            c.allreduce(g, name=f"g{n}")
    deadline = time.monotonic() + DUMP_TIMEOUT
    while not os.path.exists(outs[node]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"node {node}'s daemon wrote no counts to {outs[node]}")
        time.sleep(0.05)
    with open(outs[node]) as f:
        return json.load(f)


def measure(n: int, warmup: int, calls: int, extra: list[str]) -> dict:
    from birdnet.cluster import LocalCluster

    with tempfile.TemporaryDirectory() as tmp:
        outs = [str(Path(tmp) / f"calls{i}.json") for i in range(NODES)]
        prefixes = [[sys.executable, "-m", "birdnet.bench.tools.ringcalls", "--daemon", outs[i],
                     "--warmup", str(warmup), "--calls", str(calls), "--"] for i in range(NODES)]
        with LocalCluster(NODES, Path(tmp), peer_timeout=30, heartbeat_interval=1.0, extra=extra,
                          prefixes=prefixes) as cl:
            per_node = cl.run(worker, n, warmup, calls, outs, per_node=1, timeout=1800)
    py: collections.Counter = collections.Counter()
    cc: collections.Counter = collections.Counter()
    for r in per_node:
        py.update(r["py"])
        cc.update(r["c"])
    k = NODES * calls
    return {"count": n, "calls": calls, "warmup": warmup, "extra": extra,
            "py_calls_per_round": sum(py.values()) / k, "c_calls_per_round": sum(cc.values()) / k,
            "per_node_py": [sum(r["py"].values()) / calls for r in per_node],
            "py": {f: v / k for f, v in py.most_common()}, "c": {f: v / k for f, v in cc.most_common()}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1000000,11689512")
    p.add_argument("--calls", type=int, default=50, help="counted rounds per size")
    p.add_argument("--warmup", type=int, default=5, help="rounds before the counted ones")
    p.add_argument("--top", type=int, default=25, help="functions printed per size")
    p.add_argument("--chunk-bytes", type=int, default=None, help="birdnetd --chunk-bytes (default: its own)")
    p.add_argument("--max-chunk-bytes", type=int, default=None,
                   help="birdnetd --max-chunk-bytes (default: its own; 0: chunks of --chunk-bytes always)")
    p.add_argument("--daemon", default=None, help=argparse.SUPPRESS)  # the wrapped daemon: its counts file
    a, rest = p.parse_known_args()
    if a.daemon is not None:
        # rest: "--", the interpreter, "-m", "birdnet.daemon.main", then birdnetd's own arguments
        argv = rest[1:] if rest[:1] == ["--"] else rest
        i = argv.index("birdnet.daemon.main")
        _daemon(a.daemon, a.warmup, a.calls, argv[i + 1:])
        return 0
    extra = [] if a.chunk_bytes is None else ["--chunk-bytes", str(a.chunk_bytes),
                                                "--max-message-bytes", str(max(2 * a.chunk_bytes, 1 << 26))]
    if a.max_chunk_bytes is not None:
        extra += ["--max-chunk-bytes", str(a.max_chunk_bytes)]
    rows = []
    for n in [int(x) for x in a.sizes.split(",")]:
        row = measure(n, a.warmup, a.calls, extra)
        rows.append(row)
        print(f"{n:>10,}: {row['py_calls_per_round']:.0f} Python calls per round per node "
              f"({', '.join(f'{x:.0f}' for x in row['per_node_py'])} by node), "
              f"{row['c_calls_per_round']:.0f} C calls", file=sys.stderr)
        for f, v in list(row["py"].items())[:a.top]:
            print(f"    {v:8.1f}  {f}", file=sys.stderr)
    json.dump({"meta": {"nodes": NODES, "machine": os.uname().machine, "python": sys.version.split()[0]},
               "rows": rows}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
