"""Train a small CNN on scikit-learn's 8x8 digits with PyTorch DDP on the torch.distributed backend "birdnet".

The training loop is plain DDP; birdnet adds two lines: ``bnt.init_process_group(job=...)`` (rank
and world size come from the local daemon: no MASTER_ADDR, no rendezvous server) and, for
compression, ``model.register_comm_hook(bnt.HookState(codec=...), bnt.comm_hook)``.

* a local demo cluster (this script starts N daemons on loopback and one training process per
  daemon, and stops them at the end)::

      python examples/train_torch_ddp.py --nodes 2 --epochs 4
      python examples/train_torch_ddp.py --nodes 2 --codec topk --codec-params '{"density": 0.1}'
      python examples/train_torch_ddp.py --nodes 2 --backend gloo --codec topk   # the hook on Gloo

* real daemons (``birdnetd --peers hosts.txt`` on every node): run the same command on every node
  (``--local-size`` processes per node, as the daemons' ``--local-size``)::

      python examples/train_torch_ddp.py --socket /run/birdnet/birdnetd.sock --job digits

Needs torch (with torch.distributed) and scikit-learn.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def make_model():
    import torch
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def train(sock: str, node: int, local: int, cfg: dict) -> dict:
    """One training process: DDP on its shard of every batch."""
    import birdnet.client.torch as bnt
    import numpy as np
    import torch
    import torch.distributed as dist
    from birdnet.client import torch_dist
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    xtr, ytr, xte, yte = map(torch.from_numpy, (xtr, ytr, xte, yte))

    if cfg["backend"] == "birdnet":
        bnt.init_process_group(job=cfg["job"], socket=sock)
    else:  # Gloo needs a rendezvous; the demo's processes share a file (rank from the daemon here)
        from birdnet.client import Client
        with Client(sock, job=cfg["job"] + "-rank") as c:
            rank, size = c.rank, c.size
        dist.init_process_group("gloo", rank=rank, world_size=size, store=dist.FileStore(cfg["store"], size))
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg["seed"] + rank)  # deliberately different: DDP broadcasts rank 0's weights
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    state = None
    if cfg["codec"] or cfg["backend"] != "birdnet":
        state = bnt.HookState(codec=cfg["codec"], codec_params=cfg["params"], socket=sock,
                              job=cfg["job"] if cfg["backend"] == "birdnet" else cfg["job"] + "-hook")
        model.register_comm_hook(state, bnt.comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    gen = torch.Generator().manual_seed(cfg["seed"])  # the same permutation on every process
    per = cfg["batch"] // size
    history = []
    t0 = time.perf_counter()
    for epoch in range(cfg["epochs"]):
        model.train()
        perm = torch.randperm(len(xtr), generator=gen)
        for start in range(0, len(perm) - cfg["batch"] + 1, cfg["batch"]):
            idx = perm[start + rank * per: start + (rank + 1) * per]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        history.append(acc)
        if rank == 0 and cfg["progress"]:
            print(f"epoch {epoch + 1:>3}/{cfg['epochs']}  test accuracy {acc:.3f}", flush=True)
    seconds = time.perf_counter() - t0
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    ratios = sorted({round(float(s.get("ratio", 1.0)), 1) for s in (state.last_stats.values() if state else [])})
    if state is not None:
        state.close()
    if cfg["backend"] == "birdnet":
        torch_dist.destroy()
    else:
        dist.destroy_process_group()
    return {"rank": rank, "size": size, "accuracy": history, "seconds": seconds, "param_digest": digest,
            "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2, help="daemons of the local demo cluster (default 2)")
    p.add_argument("--local-size", type=int, default=1, help="training processes per node")
    p.add_argument("--socket", help="use the running daemon at this socket instead of a demo cluster")
    p.add_argument("--job", default="digits-ddp")
    p.add_argument("--backend", choices=["birdnet", "gloo"], default="birdnet",
                   help="torch.distributed backend; with gloo the buckets go through the hook (demo cluster only)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="global batch, split over the processes")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec", default=None, help="compress DDP's buckets with this codec (through bnt.comm_hook)")
    p.add_argument("--codec-params", default="{}", help="JSON")
    a = p.parse_args(argv)
    if a.socket and a.backend != "birdnet":
        p.error("--backend gloo is for the demo cluster (it rendezvouses through a local file)")
    with tempfile.TemporaryDirectory(prefix="birdnet-ddp-") as tmp:
        cfg = {"job": a.job, "epochs": a.epochs, "batch": a.batch, "lr": a.lr, "seed": a.seed, "codec": a.codec,
               "params": json.loads(a.codec_params) if a.codec else None, "backend": a.backend,
               "store": str(Path(tmp) / "gloo.store"), "progress": True}
        if a.socket:
            res = [train(a.socket, -1, -1, cfg)]
        else:
            from birdnet.bench.cluster import LocalCluster
            with LocalCluster(a.nodes, Path(tmp), local_size=a.local_size) as cl:
                print(f"{a.nodes} daemons on loopback, {a.nodes * a.local_size} training processes, DDP on "
                      f"{a.backend}, codec {a.codec or 'none'}", flush=True)
                res = cl.run(train, cfg, timeout=3600)
    res.sort(key=lambda r: r["rank"])
    r0 = res[0]
    print(f"final test accuracy {r0['accuracy'][-1]:.3f} after {len(r0['accuracy'])} epochs, {r0['seconds']:.1f} s"
          + (f"; compression ratios of the buckets {r0['ratios']}" if r0["ratios"] else ""))
    if len(res) > 1:
        same = len({r["param_digest"] for r in res}) == 1
        print("parameters identical on every process" if same else "WARNING: parameters differ between processes")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
