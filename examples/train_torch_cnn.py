"""Train a small CNN on scikit-learn's 8x8 handwritten digits, data-parallel through birdnet.

Two ways to run it:

* a local demo cluster (this script starts N daemons on loopback and one training process per
  daemon, and stops them at the end)::

      python examples/train_torch_cnn.py --nodes 2 --epochs 8
      python examples/train_torch_cnn.py --nodes 2 --codec topk --codec-params '{"density": 0.1}' --momentum-in-codec

* real daemons (``birdnetd --peers hosts.txt`` on every node): run the same command on every node,
  pointing at the local daemon; add ``--local-size K`` processes per node to match the daemons'
  ``--local-size``::

      python examples/train_torch_cnn.py --socket /run/birdnet/birdnetd.sock --job digits

Needs torch and scikit-learn (``pip install torch scikit-learn``).
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
    """One training process: its shard of every batch, gradients averaged through the daemon."""
    import birdnet.client.torch as bnt
    import numpy as np
    import torch
    from birdnet.client import Client
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    xtr, ytr, xte, yte = map(torch.from_numpy, (xtr, ytr, xte, yte))

    with Client(sock, job=cfg["job"]) as client:
        torch.manual_seed(cfg["seed"] + client.rank)  # deliberately different: the broadcast fixes it
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        opt = bnt.DistributedOptimizer(opt, named_parameters=model.named_parameters(), client=client,
                                       codec=cfg["codec"], codec_params=cfg["params"],
                                       momentum_in_codec=cfg["momentum_in_codec"])
        bnt.broadcast_parameters(model.state_dict(), root_rank=0, client=client)
        bnt.broadcast_optimizer_state(opt, root_rank=0, client=client)
        gen = torch.Generator().manual_seed(cfg["seed"])  # the same permutation on every process
        per = cfg["batch"] // client.size
        history = []
        t0 = time.perf_counter()
        sent = 0
        for epoch in range(cfg["epochs"]):
            model.train()
            perm = torch.randperm(len(xtr), generator=gen)
            for start in range(0, len(perm) - cfg["batch"] + 1, cfg["batch"]):
                idx = perm[start + client.rank * per: start + (client.rank + 1) * per]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
                opt.step()
                sent += sum(int(s.get("bytes_sent", 0)) for s in opt.last_stats)
            model.eval()
            with torch.no_grad():
                acc = (model(xte).argmax(1) == yte).float().mean().item()
            history.append(acc)
            if client.rank == 0 and cfg["progress"]:
                print(f"epoch {epoch + 1:>3}/{cfg['epochs']}  test accuracy {acc:.3f}", flush=True)
        digest = float(sum(p.detach().double().sum() for p in model.parameters()))
        return {"rank": client.rank, "size": client.size, "accuracy": history, "seconds": time.perf_counter() - t0,
                "bytes_sent": sent, "param_digest": digest}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2, help="daemons of the local demo cluster (default 2)")
    p.add_argument("--local-size", type=int, default=1, help="training processes per node")
    p.add_argument("--socket", help="use the running daemon at this socket instead of a demo cluster")
    p.add_argument("--job", default="digits-cnn")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=64, help="global batch, split over the processes")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec", default=None)
    p.add_argument("--codec-params", default="{}", help="JSON")
    p.add_argument("--momentum-in-codec", action="store_true", help="move SGD's momentum into the codec")
    a = p.parse_args(argv)
    cfg = {"job": a.job, "epochs": a.epochs, "batch": a.batch, "lr": a.lr, "seed": a.seed, "codec": a.codec,
           "params": json.loads(a.codec_params) if a.codec else None, "momentum_in_codec": a.momentum_in_codec,
           "progress": True}
    if a.socket:
        res = [train(a.socket, -1, -1, cfg)]
    else:
        from birdnet.bench.cluster import LocalCluster
        with tempfile.TemporaryDirectory(prefix="birdnet-cnn-") as tmp, \
                LocalCluster(a.nodes, Path(tmp), local_size=a.local_size) as cl:
            print(f"{a.nodes} daemons on loopback, {a.nodes * a.local_size} training processes, "
                  f"codec {a.codec or 'none'}", flush=True)
            res = cl.run(train, cfg, timeout=3600)
    res.sort(key=lambda r: r["rank"])
    r0 = res[0]
    print(f"final test accuracy {r0['accuracy'][-1]:.3f} after {len(r0['accuracy'])} epochs, "
          f"{r0['seconds']:.1f} s, {r0['bytes_sent'] / 2**20:.1f} MiB sent by rank 0")
    if len(res) > 1:
        same = len({r["param_digest"] for r in res}) == 1
        print("parameters identical on every process" if same else "WARNING: parameters differ between processes")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
