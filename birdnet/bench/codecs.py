"""``birdnet bench codecs``: compression throughput, payload size and round-trip error per codec.

For each codec and density: compress and decompress(-add) throughput in GB/s of float32 input (best
of ``--repeat``), payload bytes and the ratio against the dense float32 tensor, and the relative
error ||C(x) - x|| / ||x|| of one round trip on one node (first round, fresh state). Baselines at the
same density: NumPy ``argpartition`` Top-K and ``torch.topk`` (when torch is importable).
``--threads single|all|both`` sets Numba's thread count (numba.set_num_threads), and torch's for
the torch.topk baseline (NumPy's argpartition is single-threaded).

The input is a synthetic gradient: normal values times a per-32-block exponential magnitude.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from birdnet.bench.specs import parse_spec

DEFAULT_SIZES = (11_689_512, 100_000_000)
DEFAULT_CODECS = ("none", "fp16", "topk", "randomk", "dgc", "qsgd", "efsign", "bird", "birdplus",
                  "birdplus:mode=shared", "birdplus:value_dtype=float16", "marsit", "lowbit", "lowbit:bits=4")
DENSITY_CODECS = {"topk", "randomk", "dgc", "bird", "birdplus"}


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _gradient(n: int, seed: int = 0) -> np.ndarray:
    rs = np.random.default_rng(seed)
    x = rs.standard_normal(n, dtype=np.float32)
    x *= np.repeat(rs.exponential(1.0, -(-n // 32)).astype(np.float32), 32)[:n]
    return x


def bench_codec(spec: str, density: float | None, x: np.ndarray, repeat: int) -> dict[str, Any]:
    from birdnet.codecs import Pattern, RoundContext, get_codec

    name, params = parse_spec(spec)
    if density is not None and name in DENSITY_CODECS:
        params["density"] = density
    codec = get_codec(name, **params)
    n = x.shape[0]
    ctx = RoundContext(job="bench", name="g", shape=(n,), round_id=0, rank=0, world=1, seed=12345)
    state = codec.new_state(n)
    codec.compress(x[: min(n, 4096)].copy(), RoundContext(job="b", name="w", shape=(min(n, 4096),),
                   round_id=0, rank=0, world=1, seed=1), codec.new_state(min(n, 4096)))  # JIT warm-up
    # error of one round trip from a fresh state
    payload = codec.compress(x, ctx, state)
    out = np.zeros(n, np.float32)
    wire_format = codec.wire_format(ctx, state) if codec.pattern == Pattern.SUMMABLE else None
    if wire_format is not None:  # lowbit: the values a one-node ring's encoding stands for
        encoded = wire_format.encode(payload.values, 0, payload.values)
    if codec.pattern in (Pattern.SUMMABLE, Pattern.MERGED):  # a one-node round: decompress the own payload
        codec.decompress(payload, out, ctx, state)
        decomp = lambda: codec.decompress(payload, out, ctx, state)  # noqa: E731
    else:
        codec.decompress_add(payload, out, ctx)
        decomp = lambda: codec.decompress_add(payload, out, ctx)  # noqa: E731
    err = float(np.linalg.norm((out - x).astype(np.float64)) / max(np.linalg.norm(x.astype(np.float64)), 1e-30))
    wire = payload.nbytes
    if codec.pattern == Pattern.SUMMABLE and getattr(codec, "wire_dtype", "float32") == "float16":
        wire = payload.values.nbytes // 2
    if wire_format is not None:
        wire = encoded.nbytes
    comp = lambda: codec.compress(x, ctx, state)  # noqa: E731
    if wire_format is not None:  # the work is the encoding (on the ring: every hop's)
        comp = lambda: wire_format.encode(codec.compress(x, ctx, state).values, 0)  # noqa: E731
        decomp = lambda: wire_format.decode(encoded, out)  # noqa: E731
    tc = _best(comp, repeat)
    td = _best(decomp, repeat)
    return {"codec": spec, "density": params.get("density"), "pattern": codec.pattern.value,
            "compress_s": tc, "compress_gbps": 4 * n / tc / 1e9, "decompress_s": td,
            "decompress_gbps": 4 * n / td / 1e9, "payload_bytes": int(wire),
            "ratio": 4 * n / max(wire, 1), "rel_error": err, "state_bytes": codec.state_nbytes(state)}


def bench_argpartition(x: np.ndarray, density: float, repeat: int) -> dict[str, Any]:
    n = x.shape[0]
    k = max(1, int(density * n))

    def run():
        idx = np.argpartition(np.abs(x), n - k)[n - k:]
        return idx, x[idx]

    t = _best(run, repeat)
    return {"codec": "numpy-argpartition-topk", "density": density, "compress_s": t,
            "compress_gbps": 4 * n / t / 1e9, "payload_bytes": 8 * k, "ratio": 4 * n / (8 * k)}


def bench_torch(x: np.ndarray, density: float, repeat: int, threads: int | None = None) -> dict[str, Any] | None:
    try:
        import torch
    except Exception:  # not installed, or a broken / half-installed wheel: no baseline
        return None
    n = x.shape[0]
    k = max(1, int(density * n))
    tx = torch.from_numpy(x)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)  # the same thread count as the Numba kernels
    try:
        t = _best(lambda: torch.topk(tx.abs(), k, sorted=False), repeat)
    finally:
        threads = torch.get_num_threads()
        torch.set_num_threads(before)
    return {"codec": "torch.topk", "density": density, "compress_s": t, "compress_gbps": 4 * n / t / 1e9,
            "payload_bytes": 8 * k, "ratio": 4 * n / (8 * k), "torch_threads": threads}


def _fmt(rows: list[dict[str, Any]]) -> str:
    head = f"{'codec':32} {'dens':>6} {'comp GB/s':>9} {'comp ms':>8} {'dec GB/s':>8} {'payload':>11} {'ratio':>8} {'rel.err':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        d = r.get("density")
        lines.append(
            f"{r['codec'][:32]:32} {'' if d is None else f'{d:g}':>6} {r['compress_gbps']:9.2f} "
            f"{1e3 * r['compress_s']:8.1f} {r.get('decompress_gbps', float('nan')):8.2f} "
            f"{r['payload_bytes']:11d} {r['ratio']:8.1f} {r.get('rel_error', float('nan')):8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="birdnet bench codecs", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                    help="comma-separated element counts (default: %(default)s)")
    ap.add_argument("--densities", default="0.01,0.001", help="comma-separated densities (default: %(default)s)")
    ap.add_argument("--codecs", default=",".join(DEFAULT_CODECS),
                    help="comma-separated codec specs, each NAME or NAME:key=value:key=value")
    ap.add_argument("--threads", choices=("single", "all", "both"), default="both")
    ap.add_argument("--repeat", type=int, default=5, help="timing repetitions, best kept (default 5)")
    ap.add_argument("--no-baselines", action="store_true", help="skip argpartition / torch.topk")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)

    import numba

    sizes = [int(float(s)) for s in args.sizes.split(",") if s]
    densities = [float(d) for d in args.densities.split(",") if d]
    specs = [s.strip() for s in args.codecs.split(",") if s.strip()]
    threads = {"single": [1], "all": [numba.config.NUMBA_NUM_THREADS],
               "both": [1, numba.config.NUMBA_NUM_THREADS]}[args.threads]
    results: list[dict[str, Any]] = []
    for n in sizes:
        x = _gradient(n)
        for t in threads:
            numba.set_num_threads(t)
            rows: list[dict[str, Any]] = []
            for spec in specs:
                name = spec.partition(":")[0]
                for d in (densities if name in DENSITY_CODECS else [None]):
                    rows.append(bench_codec(spec, d, x, args.repeat))
            if not args.no_baselines:
                for d in densities:
                    rows.append(bench_argpartition(x, d, max(1, args.repeat // 2)))
                    tr = bench_torch(x, d, max(1, args.repeat // 2), t)
                    if tr:
                        rows.append(tr)
            for r in rows:
                r.update(n=n, threads=t)
            results.extend(rows)
            if not args.json:
                print(f"\n== n = {n:,} float32 ({4 * n / 1e6:.1f} MB), numba threads = {t} ==")
                print(_fmt(rows))
                sys.stdout.flush()
        del x
    if args.json:
        print(json.dumps({"results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
