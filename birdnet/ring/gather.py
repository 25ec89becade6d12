"""Ring all-gather of per-node payloads (for GATHERED codecs such as Top-K or BIRD+ local mode).

In step s (0..world-2) rank r forwards the payload of rank (r-s) mod world to its right neighbour
and receives the payload of rank (r-s-1) mod world. Payloads are forwarded as received (the
memoryviews of the incoming frames), so each hop copies nothing. The caller decompresses the
payloads in rank order, which is what keeps the sums bit-identical on every node.
"""
from __future__ import annotations

import time
from typing import Any

from birdnet.errors import ProtocolError, RoundMismatchError
from birdnet.ring.transport import OUT_OF_STEP_HINT, Transport


def ring_allgather(transport: Transport, header: dict[str, Any], buffers: list[Any], *, timeout: float,
                   tag: dict[str, Any] | None = None) -> list[tuple[dict[str, Any], list[Any]]]:
    """Every rank's ``(header, buffers)``, indexed by rank. ``tag`` must agree on every rank."""
    r, world = transport.rank, transport.world
    tag = dict(tag or {})
    got: list[Any] = [None] * world
    got[r] = (header, list(buffers))
    error: str | None = None
    for s in range(world - 1):
        src = (r - s) % world
        h, bufs = got[src]
        msg = {"t": "data", "p": "gather", "s": s, "src": src, "tag": tag, "h": h}
        if error:
            msg["err"] = error
        transport.send(msg, bufs)
        expect = (r - s - 1) % world
        rh, rbufs = transport.recv(time.monotonic() + timeout)
        if rh.get("p") != "gather" or rh.get("s") != s or rh.get("src") != expect:
            raise ProtocolError(f"all-gather out of step: expected step {s} payload of rank {expect}, got "
                                f"{rh.get('p')!r} step {rh.get('s')!r} src {rh.get('src')!r}{OUT_OF_STEP_HINT}")
        if rh.get("err") and error is None:
            error = str(rh["err"])
        if error is None and rh.get("tag") != tag:
            error = (f"nodes disagree on the round: rank {(r - 1) % world} sent {rh.get('tag')!r}, "
                     f"rank {r} has {tag!r}")
        inner = rh.get("h")
        if not isinstance(inner, dict):
            raise ProtocolError(f"all-gather payload header of rank {expect} is not a map")
        got[expect] = (inner, rbufs)
    if error:
        raise RoundMismatchError(error)
    return got
