"""Training-process stand-ins for the reliability, security and soak tests (module-level so that
multiprocessing's spawn can import them)."""
from __future__ import annotations

import time

import numpy as np
from birdnet.client import Client


def try_round(sock, node, local, n=1000, timeout=60.0, job="default", delay=0.0):
    """One allreduce(sum); returns ("ok", first value, seconds) or (error class, message, seconds)."""
    with Client(sock, job=job) as c:
        time.sleep(delay)
        t = time.monotonic()
        try:
            out = c.allreduce(np.full(n, c.rank + 1, np.float32), op="sum", name="t", timeout=timeout)
            return ("ok", float(out[0]) if n else None, time.monotonic() - t)
        except Exception as exc:  # noqa: BLE001
            return (type(exc).__name__, str(exc), time.monotonic() - t)


def mixed_rounds(sock, node, local, seconds, sizes, codecs, seed=0):
    """Rounds of mixed sizes and codecs for ``seconds``; every node must run the same sequence,
    so the sequence comes from ``seed`` and the round count is agreed by an allreduce."""
    rng = np.random.default_rng(seed)
    done = 0
    combos = [(n, c) for n in sizes for c in codecs]  # every combination first (JIT warm-up), then random
    with Client(sock, job="soak") as c:
        deadline = time.monotonic() + seconds
        while True:
            more = done < len(combos) or time.monotonic() < deadline
            go_on = c.allreduce(np.array([1.0 if more else 0.0], np.float32),
                                op="sum", name="go", timeout=60)
            if go_on[0] < c.size:
                break
            if done < len(combos):
                n, codec = combos[done]
            else:
                n, codec = int(rng.choice(sizes)), str(rng.choice(codecs))
            x = np.full(n, c.rank + 1, np.float32)
            out = c.allreduce(x, op="sum", name=f"s{n}-{codec}", codec=codec, timeout=60)
            if codec == "none" and n and out[0] != c.size * (c.size + 1) / 2:
                raise AssertionError(f"round {done}: {out[0]}")
            done += 1
    return done
