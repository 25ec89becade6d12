"""All-reduce of a small vector in N-1 hops: every node's whole vector goes round the ring once,
and every node sums them in rank order (the latency-optimised counterpart of dense.py).

The ring of dense.py is bandwidth-optimal: each node sends 2(N-1)/N of the vector, but in 2(N-1)
hops one after the other. For a small vector the hops are the cost, not the bytes: on a daemon each
hop is a message through the sender's ring thread, two ZeroMQ I/O threads and the receiver's ring
thread, and a DDP bucket, a LayerNorm's parameters, a barrier or a broadcast pays 2(N-1) of them every
step. Here each node sends its own vector at step 0 and forwards what it received at every later step
(the schedule of gather.py), so after N-1 hops every node holds every node's vector and adds them
in rank order: ``((x_0 + x_1) + x_2) + ...``. Every node does the same IEEE operations in the same
order, so the result is bit-identical everywhere (it is not the ring's bits: the ring starts each
segment's sum at its owner). The cost: N-1 whole vectors per node on the wire instead of 2(N-1)/N
of one, and N-1 additions of the whole vector. :func:`use_gathered` says when that pays.

Messages carry what the ring's do (``tag`` and ``err``, checked by dense._Checker, and with ``count``
the number of processes behind the vector, so a lane round learns the total), plus ``src``, whose
vector it is.

Nothing here writes ``x``: the sum goes into a new array, which the caller copies where it
belongs once the round's sends are done (RoundRunner does). So a round given up before it ends
(the daemon's dense lane) leaves ``x`` as it was, as dense.py's ring does.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from birdnet.errors import ProtocolError, RoundMismatchError
from birdnet.ring.dense import _Checker
from birdnet.ring.transport import Transport

#: the phase name of this algorithm's messages (the ring's are "rs" and "ag")
PHASE = "sum"


def use_gathered(nbytes: int, world: int, hop_latency_bytes: int, max_bytes: int) -> bool:
    """Whether a vector of ``nbytes`` all-reduces faster gathered (N-1 hops of the whole vector)
    than on the ring (2(N-1) hops of 1/N of it), on a link that moves ``hop_latency_bytes`` in the
    time one hop costs beyond its bytes (a daemon's thread hand-offs; Settings.hop_latency_bytes).

    With per-hop latency a and link bandwidth B the ring takes 2(N-1)(a + nbytes/(N B)) and the
    gather (N-1)(a + nbytes/B); the gather is faster when nbytes (N-2) < a B N. At two nodes it
    always is (the same bytes in one hop instead of two), up to ``max_bytes`` (one message per hop,
    and the N-1 vectors a node holds at once stay small). Every node must decide alike: the
    arguments are the round's agreed size, the ring's size and cluster-wide settings. A
    ``hop_latency_bytes`` of 0 means the ring always."""
    if world < 2 or nbytes > max_bytes or hop_latency_bytes <= 0:
        return False
    return nbytes * (world - 2) <= hop_latency_bytes * world


def gathered_allreduce(transport: Transport, x: np.ndarray, *, timeout: float, tag: dict[str, Any] | None = None,
                       divide_by: int | None = None, count: int | None = None, mean: bool = False,
                       learned: dict[str, Any] | None = None) -> np.ndarray:
    """Sum ``x`` (1-D) over all ranks; the same bits on every rank, in a new array (``x`` is
    only read). The keywords mean what they mean for :func:`birdnet.ring.dense.ring_allreduce`:
    ``timeout`` is the longest wait for one message, ``divide_by`` a divisor applied to the sum,
    ``count`` this node's processes when no agreement told the total (``mean`` then divides by the
    total, stored in ``learned["count"]``). Raises :class:`RoundMismatchError` when nodes disagree
    on ``tag``, :class:`~birdnet.errors.PeerLostError` when a neighbour stays silent."""
    if x.ndim != 1:
        raise ValueError("gathered_allreduce takes a 1-D array")
    r, world = transport.rank, transport.world
    checker = _Checker(dict(tag or {}), r, world)
    left = (r - 1) % world
    vectors: list[Any] = [None] * world
    counts: list[int | None] = [None] * world
    vectors[r], counts[r] = x, count
    for s in range(world - 1):
        src = (r - s) % world
        h = checker.header(PHASE, s, 0)
        h["src"] = src
        if counts[src] is not None:
            h["n"] = counts[src]
        transport.send(h, [vectors[src]])
        expect = (r - s - 1) % world
        rh, bufs = transport.recv(time.monotonic() + timeout)
        checker.check(rh, PHASE, s, 0)
        if rh.get("src") != expect:
            raise ProtocolError(f"gathered all-reduce step {s}: expected the vector of rank {expect} from rank "
                                f"{left}, got that of {rh.get('src')!r}")
        if len(bufs) != 1 or bufs[0].nbytes != x.nbytes:
            if checker.error:  # e.g. another shape: say so, not just that the sizes differ
                raise RoundMismatchError(checker.error)
            raise ProtocolError(f"gathered all-reduce step {s}: expected {x.nbytes} bytes from rank {left}, "
                                f"got {[v.nbytes for v in bufs]}")
        if count is not None:
            n = rh.get("n")
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < 1 << 30:
                raise ProtocolError(f"gathered all-reduce step {s}: bad process count {n!r} from rank {left}")
            counts[expect] = n
        # the received frame as it is: forwarded at the next step without a copy (RoundTransport)
        vectors[expect] = bufs[0]
    if checker.error:
        raise RoundMismatchError(checker.error)
    out = np.array(_view(vectors[0], x.dtype), dtype=x.dtype)  # a copy: rank 0's vector starts the sum
    for v in vectors[1:]:
        np.add(out, _view(v, x.dtype), out=out)
    div = divide_by
    if count is not None:
        total = sum(c for c in counts if c is not None)
        if learned is not None:
            learned["count"] = total
        if mean:
            div = total
    if div is not None:
        np.divide(out, out.dtype.type(div), out=out)
    return out


def _view(v: Any, dtype: np.dtype) -> np.ndarray:
    return v if isinstance(v, np.ndarray) else np.frombuffer(v, dtype=dtype)
