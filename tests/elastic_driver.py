"""A long-lived training-process stand-in for tests/test_elastic.py: ``python elastic_driver.py
SOCKET``; each stdin line ``round N CODEC`` (or ``delay S round N CODEC``) runs allreduce(mean) of this node's own random vector
(seeded by the node rank) and answers one JSON line with the first value, a digest of the result's
bytes, the contributors and the process count; errors as ``{"error": class, "message": ...}``."""
from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np
from birdnet.client import Client


def main() -> None:
    c = Client(sys.argv[1], job="elastic", connect_timeout=5.0)
    print(json.dumps({"ready": True, "rank": c.rank, "node": c.node}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        t = time.monotonic()
        ans: dict = {}
        try:
            if words[0] == "delay":  # "delay S round N CODEC": a process that comes late to the round
                time.sleep(float(words[1]))
                words = words[2:]
            n, codec = int(words[1]), words[2]
            x = np.random.default_rng(c.node).standard_normal(n).astype(np.float32) + np.float32(c.node + 1)
            h = c.allreduce_async(x, op="mean", name=f"t-{codec}", codec=None if codec == "default" else codec)
            out = h.wait(60)
            ans.update(ok=float(out[0]), digest=hashlib.sha1(out.tobytes()).hexdigest(),
                       contributors=h.contributors, count=h.stats.get("count"), epoch=h.stats.get("epoch"))
        except Exception as exc:  # noqa: BLE001
            ans.update(error=type(exc).__name__, message=str(exc))
        ans["seconds"] = time.monotonic() - t
        print(json.dumps(ans), flush=True)
    c.close()


if __name__ == "__main__":
    main()
