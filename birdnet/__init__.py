"""birdnet: compressed gradient all-reduce for clusters of edge boxes.

The package is layered (see docs/architecture.md):

* ``birdnet`` (this package) is the core: codecs, kernels, the ring algorithms, the wire format,
  settings and errors. Nothing here opens a socket.
* ``birdnet.daemon`` is the service (``birdnetd``): ZeroMQ transport, peers, client sessions,
  shared memory, metrics, systemd glue.
* ``birdnet.client`` is the small library training code imports. Importing it (or this package)
  never imports Numba: training processes should not pay for the JIT.
"""
from __future__ import annotations

__version__ = "0.1.0"

#: Wire protocol version; peers and clients refuse a different one (see birdnet.wire). 2: a merged
#: (Marsit) round's scales ride from reduce-scatter step 1 and in all-gather step 0. 3: rounds end
#: with a ``commit`` count round the ring (every node holds the result before any releases it). 4: a
#: commit that cannot finish is settled among the surviving nodes (``settle`` / ``settled``). 5: a
#: fixed ring's pongs carry the incarnation (a node sees its right neighbour's restart too).
PROTOCOL_VERSION = 5

from birdnet.errors import BirdnetError  # noqa: E402

__all__ = ["BirdnetError", "PROTOCOL_VERSION", "__version__"]
