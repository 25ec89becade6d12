"""A long-lived training-process stand-in driven over stdin/stdout, so a test can keep one client
alive across daemon kills and restarts: ``python client_driver.py SOCKET [JOB]``; each stdin line
is a command (``round N``, ``buffer N``, ``delay S round N``, ``within S round N`` (the
call's own timeout, else 60 s), ``status``, ``quit``), each answer one JSON line
``{"ok": ..., "error": class, "message": ..., "seconds": ...}``."""
from __future__ import annotations

import json
import sys
import time

import numpy as np
from birdnet.client import Client


def main() -> None:
    sock, job = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "default")
    c = Client(sock, job=job, connect_timeout=5.0)
    buffers: dict[int, np.ndarray] = {}
    print(json.dumps({"ready": True, "rank": c.rank}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        t = time.monotonic()
        ans: dict = {}
        within = 60.0
        try:
            if words[0] == "delay":
                time.sleep(float(words[1]))
                words = words[2:]
            if words[0] == "within":
                within = float(words[1])
                words = words[2:]
            if words[0] == "round":
                n = int(words[1])
                out = c.allreduce(np.full(n, c.rank + 1, np.float32), op="sum", name="t", timeout=within)
                ans["ok"] = float(out[0]) if n else None
            elif words[0] == "buffer":
                n = int(words[1])
                if n not in buffers:
                    buffers[n] = c.buffer((n,), np.float32)
                b = buffers[n]
                b[:] = c.rank + 1
                out = c.allreduce(b, op="sum", name="b", timeout=within)
                ans["ok"] = float(out[0])
                ans["same"] = bool(np.shares_memory(out, b))
            elif words[0] == "status":
                ans["ok"] = c.status()
        except Exception as exc:  # noqa: BLE001
            ans["error"] = type(exc).__name__
            ans["message"] = str(exc)
        ans["seconds"] = time.monotonic() - t
        print(json.dumps(ans), flush=True)
    c.close()


if __name__ == "__main__":
    main()
