"""Bytes one sync of the slow-link mode sends per node, by codec (docs/slowlink.md, Bytes per sync).

    python -m birdnet.bench.tools.diloco_bytes

4 daemons on loopback; each process all-reduces one flat float32 array of 470,784 elements (the
transformer's parameters, as one fragment) three times per codec under a stable name, and node 0's
``bytes_sent`` of the third call is printed (the codec's state settled).
"""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests"))
from cluster import LocalCluster  # noqa: E402

SPECS = [("none", {}), ("fp16", {}), ("marsit", {}), ("topk", {"density": 0.02}), ("birdplus", {}),
         ("topk", {"density": 0.01}), ("lowbit", {}), ("lowbit", {"bits": 4}),
         ("lowbit", {"bits": 2, "midrise": True}), ("lowbit", {"bits": 2, "midrise": True, "block": 256}),
         ("lowbit", {"bits": 1}), ("lowbit", {"bits": 1, "block": 256}), ("ternary", {}), ("ternary", {"block": 256})]


def worker(sock, node, local):
    import numpy as np

    from birdnet.client import Client
    out = {}
    with Client(sock, job="diloco-bytes") as c:
        x = np.random.default_rng(c.rank).standard_normal(470784).astype(np.float32) * 1e-3
        for name, p in SPECS:
            for _ in range(3):
                h = c.allreduce_async(x, name=f"b/{name}/{p}", codec=name, **p)
                h.wait(300)
            out[f"{name} {p}"] = h.stats.get("bytes_sent")
    return out


if __name__ == "__main__":
    with LocalCluster(4, tempfile.mkdtemp()) as cl:
        print(json.dumps(cl.run(worker, timeout=900)[0]))
