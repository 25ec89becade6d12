"""Where a ``DistributedOptimizer`` training step's time goes (docs/slowlink.md, "Per-step codecs").

    python -m birdnet.bench.tools.stepprofile --rate 20mbit --steps 80 --sign-merge 1,0 > OUT.json
    python -m birdnet.bench.tools.stepprofile --loopback --steps 80 --sign-merge 1,0 > OUT.json

Runs ``birdnet bench tta``'s LM task (4 nodes; network namespaces with ``--rate``, or loopback) on
``bnt.DistributedOptimizer`` with ``--codec`` and times, per step and rank, the phases of the
loop: forward, backward (the hooks stage and submit buckets while it runs), the wait in
``synchronize()`` for the last round plus the recipe, and ``step()``. From every round's
``Handle.stats`` (the daemon's monotonic marks) it adds: rounds per step, the agreement wait
(``t_data - t_ready``), the data phases (``t_end - t_data``, summed; they run one after another
on a node), the codec kernels (``compress_seconds``), the bytes the daemon sent, and the time from
the end of backward to the last round's end (``compress_seconds`` is left out: for a merged codec
it is the whole data phase). It prints medians over the warm-up steps and over the compressed
steps (refresh steps apart), slowest rank per step, and the final validation loss. ``--sign-merge
1,0`` runs the sign codec's big tensors in one round, then one round each, on the same daemons
one after the other. A measuring tool, not part of birdnet.
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


def worker(v: dict[str, Any]) -> dict[str, Any]:
    import torch

    import birdnet.client.torch as bnt
    from birdnet.bench.torchtasks import make_task, params_digest
    from birdnet.client import Client

    torch.set_num_threads(1)
    bnt.SIGN_MERGE = bool(v["sign_merge"])
    task = make_task("lm", v["seed"])
    torch.manual_seed(v["seed"])
    model = task.model()
    client = Client(v["socket"], job=v["job"])
    opt = bnt.DistributedOptimizer(task.optimizer(model.parameters(), task.lr),
                                   named_parameters=model.named_parameters(), client=client,
                                   codec=v["codec"], timeout=600, **v["adapter"])
    bnt.broadcast_parameters(model.state_dict(), root_rank=0, client=client)
    rows = []
    for step in range(v["steps"]):
        x, y = task.batch(v["rank"], v["world"], step)
        t0 = time.monotonic()
        opt.zero_grad()
        loss = task.loss(model, x, y)
        t1 = time.monotonic()
        loss.backward()
        t2 = time.monotonic()
        opt.synchronize()
        t3 = time.monotonic()
        opt.step()
        t4 = time.monotonic()
        st = [s for s in opt.last_stats if "t_data" in s]
        rows.append({
            "step": step, "warm": bool(opt.birdnet_warming_up),
            "refresh": any(str(s.get("name", "")).startswith("var") for s in opt.last_stats),
            "total": t4 - t0, "forward": t1 - t0, "backward": t2 - t1, "sync": t3 - t2, "opt_step": t4 - t3,
            "rounds": len(st),
            "agree": sum(s["t_data"] - s["t_ready"] for s in st),
            "data": sum(s["t_end"] - s["t_data"] for s in st),
            "after_backward": (max(s["t_end"] for s in st) - t2) if st else 0.0,
            "first_submit_to_end": (max(s["t_end"] for s in st) - min(s["t_ready"] for s in st)) if st else 0.0,
            "bytes": sum(int(s.get("bytes_sent", 0) or 0) for s in opt.last_stats),
            "val": float(loss.detach()),
        })
    out = {"rank": v["rank"], "rows": rows, "digest": params_digest(model),
           "eval": task.evaluate(model)}
    client.close()
    return out


KEYS = ("total", "forward", "backward", "sync", "opt_step", "rounds", "agree", "data",
        "after_backward", "first_submit_to_end", "bytes")


def summarise(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step the slowest rank's total (and that rank's phases); medians per kind of step."""
    steps = len(outs[0]["rows"])
    per_step = []
    for i in range(steps):
        rs = [o["rows"][i] for o in outs]
        per_step.append(max(rs, key=lambda r: r["total"]))
    kinds = {"warm-up": [r for r in per_step[2:] if r["warm"]],
             "compressed": [r for r in per_step if not r["warm"] and not r["refresh"]],
             "refresh": [r for r in per_step if not r["warm"] and r["refresh"]]}
    out: dict[str, Any] = {}
    for kind, rs in kinds.items():
        if rs:
            out[kind] = {"steps": len(rs), **{k: statistics.median(r[k] for r in rs) for k in KEYS}}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m birdnet.bench.tools.stepprofile", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate", default="20mbit")
    p.add_argument("--loopback", action="store_true")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec", default="marsit")
    p.add_argument("--adapter", default="{}", help="extra DistributedOptimizer keywords, as JSON")
    p.add_argument("--sign-merge", default="1", help="comma-separated: 1, a sign codec's big tensors in one "
                   "round after the warm-up (SIGN_MERGE), 0: one round each; each runs in turn on the same daemons")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))), flush=True)
        return 0
    from birdnet.bench import netns
    from birdnet.cluster import LocalCluster, rank_results
    from birdnet.config import Settings
    d = Settings()
    nsc = None if a.loopback else netns.NetnsCluster(a.nodes, a.rate)
    with tempfile.TemporaryDirectory(prefix="birdnet-stepprofile-") as tmp:
        try:
            if nsc is not None:
                nsc.__enter__()
            prefixes = [nsc.exec_prefix(i) for i in range(a.nodes)] if nsc else [[] for _ in range(a.nodes)]
            with LocalCluster(a.nodes, Path(tmp), addresses=nsc.addresses if nsc else None, prefixes=prefixes,
                              peer_timeout=d.peer_timeout, heartbeat_interval=d.heartbeat_interval) as cl:
                results = {}
                for k, merge in enumerate(int(x) for x in a.sign_merge.split(",")):
                    cmds = []
                    for r in range(a.nodes):
                        spec = {"rank": r, "world": a.nodes, "socket": cl.sockets[r], "job": f"profile-{k}",
                                "seed": a.seed, "steps": a.steps, "codec": a.codec, "adapter": json.loads(a.adapter),
                                "sign_merge": merge}
                        cmds.append([*prefixes[r], sys.executable, "-m", "birdnet.bench.tools.stepprofile",
                                     "--worker", json.dumps(spec)])
                    outs = sorted(rank_results(cmds, 1800, "stepprofile"), key=lambda o: o["rank"])
                    results[f"{k}: sign_merge={merge}"] = (outs, os.getloadavg()[0])
        finally:
            if nsc is not None:
                nsc.__exit__(None, None, None)
    report = {}
    for label, (outs, load) in results.items():
        summary = summarise(outs)
        print(f"{label} (load average {load:.1f}), final validation loss {outs[0]['eval']}", file=sys.stderr)
        for kind, s in summary.items():
            print(f"{kind:>10} ({s['steps']} steps): step {s['total'] * 1e3:.0f} ms = forward {s['forward'] * 1e3:.0f} + "
                  f"backward {s['backward'] * 1e3:.0f} + sync {s['sync'] * 1e3:.0f} + step {s['opt_step'] * 1e3:.0f}; "
                  f"{s['rounds']:.0f} rounds: agreement wait {s['agree'] * 1e3:.0f}, data phases {s['data'] * 1e3:.0f}, "
                  f"last round ends {s['after_backward'] * 1e3:.0f} ms after backward; {s['bytes'] / 1e3:.0f} kB sent",
                  file=sys.stderr)
        report[label] = {"load_average": load, "identical": len({o["digest"] for o in outs}) == 1,
                         "eval": outs[0]["eval"], "summary": summary}
    json.dump({"meta": {"command": "python -m birdnet.bench.tools.stepprofile " + " ".join(sys.argv[1:] if argv is None else argv),
                        "rate": "loopback" if a.loopback else a.rate, "cpus": os.cpu_count()}, "runs": report},
              sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
