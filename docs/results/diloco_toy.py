"""The outer optimizer and codec of the slow-link mode on a small task, 2 real daemons (docs/slowlink.md).

    python docs/results/diloco_toy.py

The teacher task of tests/test_diloco_torch.py (an MLP of 2,632 parameters, a fixed random teacher
labels Gaussian inputs, batch 32 per process, 160 steps, the default schedule): the held-out loss of
the outer parameters and this node's bytes for each variant, against one process on both processes'
batches (per-step averaging).
"""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from cluster import LocalCluster  # noqa: E402

VARIANTS = [("sgd", {}), ("sgd", {"outer_lr": 0.7, "outer_momentum": 0.9}), ("sgd", {"codec": "none"}),
            ("sgd", {"codec": "topk", "codec_params": {"density": 0.05}}),
            ("adamw", {}), ("adamw", {"codec": "none"}), ("adamw", {"codec": "topk", "codec_params": {"density": 0.05}}),
            ("adamw", {"codec": "birdplus"}), ("adamw", {"codec": "topk", "codec_params": {"density": 0.01}}),
            ("adamw", {"codec": "fp16"}), ("sgd", {"codec": "birdplus"})]


def worker(sock, node, local):
    import torch
    torch.set_num_threads(1)
    import birdnet.client.torch as bnt
    import test_diloco_torch as T
    from birdnet.client import Client
    out = []
    with Client(sock, job="diloco-toy") as client:
        x, y, xv, yv = T.teacher_data(client.rank, T.QUALITY_STEPS)
        for inner, o in VARIANTS:
            model, opt = T.make(bnt, client, 50, inner=inner, **o)
            T.train(model, opt, x, y, T.QUALITY_STEPS)
            opt.flush()
            for n, p in model.named_parameters():
                p.data.copy_(torch.from_numpy(opt.outer_loop.outer_parameters()[n]))
            out.append({"inner": inner, "options": o, "loss": round(T.held_out(model, xv, yv), 4),
                        "bytes": opt.last_stats["bytes_sent_total"]})
    return out


if __name__ == "__main__":
    import test_diloco_torch as T
    print(json.dumps({"per_step": {k: round(T.per_step_reference(k)[0], 4) for k in ("sgd", "adamw")}}))
    with LocalCluster(2, tempfile.mkdtemp()) as cl:
        for r in cl.run(worker, timeout=900)[0]:
            print(json.dumps(r))
