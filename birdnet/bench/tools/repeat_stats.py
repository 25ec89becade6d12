"""Ratios Gloo / birdnet over repeated `birdnet bench allreduce --vs-gloo` invocations, with a
bootstrap confidence interval of their median: is a gap more than the noise of repeated runs?

    python -m birdnet.bench.tools.repeat_stats RUN_*.json

Each file is one invocation (birdnet's runs, then Gloo's, on the same links); its ratio compares
medians of that invocation, so a machine that slows down between invocations moves both sides. A
measuring tool, not part of birdnet."""
from __future__ import annotations

import json
import random
import statistics
import sys

MEASURES = (("time", "vs_gloo"), ("span", "span_vs_gloo"), ("loop", "loop_vs_gloo"))


def main(paths: list[str], codec: str = "none", resamples: int = 10000) -> None:
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [r for r in json.load(f)["rows"] if r["codec"] == codec and "vs_gloo" in r]
    print(f"{len(rows)} invocations, codec {codec}; ratio Gloo / birdnet (above 1: birdnet faster)")
    rng = random.Random(0)
    for name, key in MEASURES:
        ratios = [1 / r[key] for r in rows if r.get(key)]
        boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
        lo, hi = boots[int(0.025 * resamples)], boots[int(0.975 * resamples)]
        print(f"{name:5s} median {statistics.median(ratios):.3f}  range {min(ratios):.3f}-{max(ratios):.3f}  "
              f"95% bootstrap CI of the median {lo:.3f}-{hi:.3f}  invocations at >= 1.0: "
              f"{sum(x >= 1.0 for x in ratios)}/{len(ratios)}")
    ms = lambda k: statistics.median(r[k] for r in rows) * 1e3  # noqa: E731
    print(f"medians (ms): birdnet time {ms('time_s'):.1f} span {ms('span_s'):.1f} loop {ms('loop_s'):.1f} "
          f"cpu {ms('daemon_cpu_s'):.0f}; Gloo time {ms('gloo_time_s'):.1f} span {ms('gloo_span_s'):.1f} "
          f"loop {ms('gloo_loop_s'):.1f} cpu {ms('gloo_cpu_s'):.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
