"""The local cluster helper's former place: it is :mod:`birdnet.cluster` now (importable without
the benchmarks); this name stays so code written against it keeps working."""
from birdnet.cluster import (  # noqa: F401
    START_TIMEOUT,
    LocalCluster,
    Workers,
    free_ports,
    rank_results,
)

__all__ = ["START_TIMEOUT", "LocalCluster", "Workers", "free_ports", "rank_results"]
