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
from pathlib import Path

import _digits  # the data, model, loop and report this example shares with train_torch_cnn.py


def train(sock: str, node: int, local: int, cfg: dict) -> dict:
    """One training process: DDP on its shard of every batch."""
    import birdnet.client.torch as bnt
    import torch
    import torch.distributed as dist
    from birdnet.client import torch_dist

    torch.set_num_threads(1)
    if cfg["backend"] == "birdnet":
        bnt.init_process_group(job=cfg["job"], socket=sock)
    else:  # Gloo needs a rendezvous; the demo's processes share a file (rank from the daemon here)
        from birdnet.client import Client
        with Client(sock, job=cfg["job"] + "-rank") as c:
            rank, size = c.rank, c.size
        dist.init_process_group("gloo", rank=rank, world_size=size, store=dist.FileStore(cfg["store"], size))
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg["seed"] + rank)  # deliberately different: DDP broadcasts rank 0's weights
    model = torch.nn.parallel.DistributedDataParallel(_digits.make_model())
    state = None
    if cfg["codec"] or cfg["backend"] != "birdnet":
        state = bnt.HookState(codec=cfg["codec"], codec_params=cfg["params"], socket=sock,
                              job=cfg["job"] if cfg["backend"] == "birdnet" else cfg["job"] + "-hook")
        model.register_comm_hook(state, bnt.comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    recover = (lambda: bnt.recover(model.module, opt)) if cfg["backend"] == "birdnet" else None
    history, seconds = _digits.fit(model, opt, cfg, rank, size, recover=recover)
    ratios = sorted({round(float(s.get("ratio", 1.0)), 1) for s in (state.last_stats.values() if state else [])})
    if state is not None:
        state.close()
    if cfg["backend"] == "birdnet":
        torch_dist.destroy()
    else:
        dist.destroy_process_group()
    return {"rank": rank, "size": size, "accuracy": history, "seconds": seconds,
            "param_digest": _digits.digest(model), "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _digits.add_arguments(p, job="digits-ddp", epochs=4)
    p.add_argument("--backend", choices=["birdnet", "gloo"], default="birdnet",
                   help="torch.distributed backend; with gloo the buckets go through the hook (demo cluster only)")
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
            from birdnet.cluster import LocalCluster
            with LocalCluster(a.nodes, Path(tmp), local_size=a.local_size) as cl:
                print(f"{a.nodes} daemons on loopback, {a.nodes * a.local_size} training processes, DDP on "
                      f"{a.backend}, codec {a.codec or 'none'}", flush=True)
                res = cl.run(train, cfg, timeout=3600)
    return _digits.report(res, lambda r0: f"; compression ratios of the buckets {r0['ratios']}" if r0["ratios"] else "")


if __name__ == "__main__":
    sys.exit(main())
