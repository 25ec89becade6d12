"""``python -m birdnet.bench.overlap``: time per training step with and without overlapping the
all-reduce with backward, on a local cluster (N daemons on loopback, one training process each).

Three modes train identical models on identical data, in interleaved blocks so that drift in the
machine's load hits all of them alike:

* ``local``   forward + backward + SGD step, no communication (the compute floor);
* ``after``   :func:`birdnet.client.torch.DistributedOptimizer` with ``overlap=False``: every bucket
  is all-reduced in ``step()``, after backward finished;
* ``overlap`` the same optimizer with its hooks: a bucket is all-reduced as soon as backward filled it.

Figures are medians over all timed steps of each mode (per process; the table shows rank 0 and the
slowest rank). ``comm`` = mode - local is the communication time the step does not hide.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("local", "after", "overlap")


def build(cfg: dict[str, Any]):
    import torch
    layers: list[Any] = [torch.nn.Flatten()]
    width = 64
    for _ in range(cfg["layers"]):
        layers += [torch.nn.Linear(width, cfg["hidden"]), torch.nn.ReLU()]
        width = cfg["hidden"]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


def worker(sock: str, node: int, local: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    torch.set_num_threads(cfg["threads"])
    import birdnet.client.torch as bnt
    from birdnet.client import Client
    with Client(sock, job="overlap-bench") as c:
        g = torch.Generator().manual_seed(1 + c.rank)
        x = torch.randn(cfg["batch"], 1, 8, 8, generator=g)
        y = torch.randint(0, 10, (cfg["batch"],), generator=g)
        opts, models = {}, {}
        for mode in MODES:
            torch.manual_seed(0)
            models[mode] = build(cfg)
            opt = torch.optim.SGD(models[mode].parameters(), lr=0.01, momentum=0.9)
            if mode != "local":
                opt = bnt.DistributedOptimizer(opt, named_parameters=models[mode].named_parameters(), client=c,
                                               bucket_bytes=cfg["bucket_kb"] * 1024, codec=cfg["codec"],
                                               codec_params=cfg["params"], overlap=(mode == "overlap"))
            opts[mode] = opt
        times: dict[str, list[float]] = {m: [] for m in MODES}
        stats: dict[str, Any] = {}
        for block in range(cfg["blocks"] + 1):  # block 0 warms up (shared memory, kernels, caches)
            for mode in MODES:
                model, opt = models[mode], opts[mode]
                c.barrier(timeout=60)
                for _ in range(cfg["steps"]):
                    t0 = time.perf_counter()
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                    if block:
                        times[mode].append(time.perf_counter() - t0)
                if mode != "local":
                    stats[mode] = getattr(opt, "last_stats", [])
        n_params = sum(p.numel() for p in models["local"].parameters())
        return {"rank": c.rank, "times": times, "params": n_params,
                "buckets": len(stats.get("overlap", [])),
                "bytes_sent": sum(int(s.get("bytes_sent", 0)) for s in stats.get("overlap", []))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m birdnet.bench.overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2, help="daemons, one training process each (default 2)")
    p.add_argument("--hidden", type=int, default=1024, help="width of the MLP's hidden layers")
    p.add_argument("--layers", type=int, default=3, help="hidden layers")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="steps per block")
    p.add_argument("--blocks", type=int, default=5, help="timed blocks per mode (after one warm-up block)")
    p.add_argument("--bucket-kb", type=int, default=1024, help="bucket size in KiB")
    p.add_argument("--threads", type=int, default=1, help="torch threads per training process")
    p.add_argument("--codec", default=None, help="codec for the gradients (default: the daemons', none)")
    p.add_argument("--codec-params", default="{}", help="JSON parameters of --codec")
    p.add_argument("--netns", action="store_true", help="each daemon in its own network namespace (root)")
    p.add_argument("--rate", default=None, help="token-bucket rate of every link with --netns, e.g. 100mbit")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    a = p.parse_args(argv)
    if a.rate and not a.netns:
        p.error("--rate needs --netns")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("the overlap benchmark needs torch: pip install torch", file=sys.stderr)
        return 2
    from birdnet.bench import netns
    from birdnet.cluster import LocalCluster
    cfg = {"hidden": a.hidden, "layers": a.layers, "batch": a.batch, "steps": a.steps, "blocks": a.blocks,
           "bucket_kb": a.bucket_kb, "threads": a.threads, "codec": a.codec,
           "params": json.loads(a.codec_params) if a.codec else None}
    slow = {"peer_timeout": 60.0, "heartbeat_interval": 1.0}
    with tempfile.TemporaryDirectory(prefix="birdnet-overlap-") as tmp:
        if a.netns:
            ok, why = netns.available()
            if not ok:
                print(f"birdnet bench overlap: --netns unavailable: {why}", file=sys.stderr)
                return 2
            # the training processes stay outside: their Unix sockets reach the daemons' namespaces
            with netns.NetnsCluster(a.nodes, a.rate) as nsc:
                prefixes = [nsc.exec_prefix(i) for i in range(a.nodes)]
                with LocalCluster(a.nodes, Path(tmp), addresses=nsc.addresses, prefixes=prefixes, **slow) as cl:
                    res = cl.run(worker, cfg, timeout=3600)
        else:
            with LocalCluster(a.nodes, Path(tmp), **slow) as cl:
                res = cl.run(worker, cfg, timeout=3600)
    res.sort(key=lambda r: r["rank"])
    med = [{m: statistics.median(r["times"][m]) for m in MODES} for r in res]
    slowest = {m: max(x[m] for x in med) for m in MODES}
    out = {"config": {**cfg, "nodes": a.nodes, "link": f"netns {a.rate or 'unshaped'}" if a.netns else "loopback"}, "parameters": res[0]["params"], "buckets": res[0]["buckets"],
           "bytes_sent_per_step": res[0]["bytes_sent"],
           "median_step_seconds": {"rank0": med[0], "slowest": slowest},
           "hidden_fraction": _hidden(slowest)}
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{a.nodes} nodes x 1 process, MLP 64-{'-'.join([str(a.hidden)] * a.layers)}-10 "
          f"({res[0]['params']} parameters, {res[0]['params'] * 4 / 2**20:.1f} MiB of gradients), batch {a.batch}, "
          f"{res[0]['buckets']} buckets of <= {a.bucket_kb} KiB, codec {a.codec or 'none'}, "
          f"link {out['config']['link']}")
    print(f"{'mode':<9} {'rank 0 ms/step':>15} {'slowest ms/step':>16} {'comm ms':>8}")
    for m in MODES:
        comm = "" if m == "local" else f"{(slowest[m] - slowest['local']) * 1e3:8.1f}"
        print(f"{m:<9} {med[0][m] * 1e3:15.1f} {slowest[m] * 1e3:16.1f} {comm:>8}")
    h = out["hidden_fraction"]
    print(f"overlap hides {h * 100:.0f} % of the communication time of 'after'" if h is not None else "")
    return 0


def _hidden(t: dict[str, float]) -> float | None:
    comm_after = t["after"] - t["local"]
    if comm_after <= 0:
        return None
    return (t["after"] - t["overlap"]) / comm_after


if __name__ == "__main__":
    sys.exit(main())
