"""Tests use the package's local cluster (birdnet.bench.cluster), re-exported here."""
from birdnet.bench.cluster import LocalCluster, Workers, free_ports  # noqa: F401
