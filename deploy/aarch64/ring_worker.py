"""One training process of the mixed-architecture ring (deploy/aarch64/mixed_ring.py starts one per
node, on x86_64 with the host's Python, on aarch64 under the emulator with the guest venv's).

It talks to its node's daemon through birdnet.client only, so the same file runs on both
architectures. For every (codec configuration, tensor size, round) of the plan it builds this rank's
input with integer arithmetic and exact float32 scaling (no libm, no BLAS: the same bits on every
CPU, so a difference in the result comes from birdnet, not from the inputs), all-reduces it and
records the SHA-256 of the input and of the result. Then it trains the plan's small MLP through the
ring (birdnet.bench.trainlib.train_worker) and records the digest of the final parameters.

    python ring_worker.py --socket S --plan plan.json --out result.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
import traceback

import numpy as np


def portable_input(seed: int, rank: int, rnd: int, n: int) -> np.ndarray:
    """float32 values sign * m * 2**e with m a 24-bit fraction and e in [-12, 3]: a spread of
    magnitudes (so top-k, block norms and scales have work to do), from PCG64's integer stream only,
    which NumPy defines bit for bit on every platform. Every 97th value is an exact 0."""
    g = np.random.Generator(np.random.PCG64([seed, rank, rnd, n]))
    bits = g.integers(0, 1 << 63, size=n, dtype=np.int64).view(np.uint64)
    m = ((bits >> np.uint64(39)) & np.uint64(0xFFFFFF)).astype(np.float32) * np.float32(2.0 ** -24)
    e = ((bits >> np.uint64(4)) & np.uint64(15)).astype(np.int32) - 12
    x = np.ldexp(m, e).astype(np.float32)  # exact: a power-of-two scaling of a 24-bit value
    x[(bits & np.uint64(1)) == 1] *= np.float32(-1)
    x[::97] = 0
    return x


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def run_codecs(client, plan: dict, log) -> list[dict]:
    rows = []
    for cfg in plan["configs"]:
        for n in plan["sizes"]:
            for rnd in range(plan["rounds"]):
                x = portable_input(plan["seed"], client.rank, rnd, n)
                t0 = time.perf_counter()
                row = {"config": cfg["label"], "size": n, "round": rnd, "input": sha(x)}
                try:
                    y = client.allreduce(x, name=f"{cfg['label']}/{n}", codec=cfg["codec"],
                                         timeout=plan["call_timeout"], **cfg["params"])
                    row.update(output=sha(y), dtype=str(y.dtype), finite=bool(np.isfinite(y).all()),
                               first=[float(v) for v in y[:3]])
                except Exception as exc:  # noqa: BLE001 - reported per call; the driver fails on it
                    row.update(error=f"{type(exc).__name__}: {exc}")
                row["seconds"] = round(time.perf_counter() - t0, 3)
                rows.append(row)
                log(f"{cfg['label']:<28} n={n:<8} round {rnd}: {row.get('output', row.get('error'))[:16]} "
                    f"{row['seconds']:.2f} s")
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--plan", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    plan = json.loads(open(a.plan).read())
    arch = platform.machine()

    def log(msg: str) -> None:
        print(f"[{arch}] {msg}", flush=True)

    from importlib import metadata
    out: dict = {"arch": arch, "python": sys.version.split()[0], "numpy": np.__version__,
                 "numba": metadata.version("numba"), "llvmlite": metadata.version("llvmlite")}
    try:
        from birdnet.client import Client
        with Client(a.socket, job=plan.get("job", "mixed")) as c:
            out["rank"], out["size"] = c.rank, c.size
            out["codecs"] = run_codecs(c, plan, log)
        train = plan.get("train")
        if train:
            from birdnet.bench.trainlib import train_worker
            out["train"] = []
            for t in train:
                cfg = {**t, "progress": None, "hidden": tuple(t["hidden"])}
                r = train_worker(a.socket, out["rank"], 0, cfg)
                out["train"].append({"label": t["job"], "params_digest": r["params_digest"], "acc": r["acc"],
                                     "loss": r["loss"], "seconds": round(r["seconds"], 1)})
                log(f"training {t['job']}: accuracy {r['acc']:.3f}, parameters {r['params_digest'][:16]}")
    except Exception:  # noqa: BLE001 - the driver reads the traceback from the result file
        out["fatal"] = traceback.format_exc()
        log(out["fatal"])
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 1 if "fatal" in out else 0


if __name__ == "__main__":
    sys.exit(main())
