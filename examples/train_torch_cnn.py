"""Train a small CNN on scikit-learn's 8x8 handwritten digits, data-parallel through birdnet.

Two ways to run it:

* a local demo cluster (this script starts N daemons on loopback and one training process per
  daemon, and stops them at the end)::

      python examples/train_torch_cnn.py --nodes 2 --epochs 8
      python examples/train_torch_cnn.py --nodes 2 --codec marsit

  The adapter's recipe for the codec is on by default (``momentum_in_codec=None``: SGD's momentum
  moves into a codec that has a momentum parameter); ``--no-momentum-in-codec`` turns it off,
  ``--momentum-in-codec`` makes a codec without one an error.

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
from pathlib import Path

import _digits  # the data, model, loop and report this example shares with train_torch_ddp.py


def train(sock: str, node: int, local: int, cfg: dict) -> dict:
    """One training process: its shard of every batch, gradients averaged through the daemon."""
    import birdnet.client.torch as bnt
    import torch
    from birdnet.client import Client

    torch.set_num_threads(1)
    with Client(sock, job=cfg["job"]) as client:
        torch.manual_seed(cfg["seed"] + client.rank)  # deliberately different: the broadcast fixes it
        model = _digits.make_model()
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        opt = bnt.DistributedOptimizer(opt, named_parameters=model.named_parameters(), client=client,
                                       codec=cfg["codec"], codec_params=cfg["params"],
                                       momentum_in_codec=cfg["momentum_in_codec"])
        bnt.broadcast_parameters(model.state_dict(), root_rank=0, client=client)
        bnt.broadcast_optimizer_state(opt, root_rank=0, client=client)
        sent = [0]

        def count_bytes() -> None:
            sent[0] += sum(int(s.get("bytes_sent", 0)) for s in opt.last_stats)

        history, seconds = _digits.fit(model, opt, cfg, client.rank, client.size, count_bytes,
                                       recover=lambda: bnt.recover(model, opt, client=client))
        return {"rank": client.rank, "size": client.size, "accuracy": history, "seconds": seconds,
                "bytes_sent": sent[0], "param_digest": _digits.digest(model)}


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    """The command line and the training configuration it makes."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _digits.add_arguments(p, job="digits-cnn", epochs=8)
    p.add_argument("--codec", default=None)
    p.add_argument("--codec-params", default="{}", help="JSON")
    p.add_argument("--momentum-in-codec", action=argparse.BooleanOptionalAction, default=None,
                   help="the adapter's recipe: SGD's momentum moves into the codec (default: automatic, on for "
                        "a codec with a momentum parameter; --momentum-in-codec requires it, "
                        "--no-momentum-in-codec turns it off)")
    a = p.parse_args(argv)
    return a, {"job": a.job, "epochs": a.epochs, "batch": a.batch, "lr": a.lr, "seed": a.seed, "codec": a.codec,
               "params": json.loads(a.codec_params) if a.codec else None,
               "momentum_in_codec": a.momentum_in_codec, "progress": True}


def main(argv: list[str] | None = None) -> int:
    a, cfg = parse(argv)
    if a.socket:
        res = [train(a.socket, -1, -1, cfg)]
    else:
        from birdnet.cluster import LocalCluster
        with tempfile.TemporaryDirectory(prefix="birdnet-cnn-") as tmp, \
                LocalCluster(a.nodes, Path(tmp), local_size=a.local_size) as cl:
            print(f"{a.nodes} daemons on loopback, {a.nodes * a.local_size} training processes, "
                  f"codec {a.codec or 'none'}", flush=True)
            res = cl.run(train, cfg, timeout=3600)
    return _digits.report(res, lambda r0: f", {r0['bytes_sent'] / 2**20:.1f} MiB sent by rank 0")


if __name__ == "__main__":
    sys.exit(main())
