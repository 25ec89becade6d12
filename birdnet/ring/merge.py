"""Marsit's merged ring pattern: bits are merged hop by hop in the reduce-scatter and forwarded
unchanged in the all-gather (docs/marsit.md; after Marsit, DAC 2022).

Schedule (the standard ring, as in birdnet.ring.dense): the ``ceil(n/8)`` bytes of sign bits are cut
into ``world`` segments whose element boundaries are multiples of 8 (``segment_bounds(n, world,
align=8)``: as equal as possible, the last takes the rest, some may be empty when n is small). In
reduce-scatter step s (0..world-2) rank r sends segment (r-s) mod world to rank r+1 and receives
segment j = (r-s-1) mod world, whose operand stands for ranks j, j+1, .., j+s (``W_a`` processes,
the sum of their counts); rank r is position k = s+2 on j's path and merges with its own operand
(``W_b = counts[r]``) through ``codec.merge_hop`` (Marsit: keep the received bit with probability
``W_a / (W_a + W_b)``, which is (k-1)/k for equal counts). After world-1 steps rank r owns the
finished segment (r+1) mod world; the all-gather forwards finished segments as received.

Messages (``t = "data"``; one buffer of exactly ``ceil(L/8)`` bytes for a segment of L elements,
at every hop; nothing grows with the hop count):

==========  ====================================================================================
key         meaning
==========  ====================================================================================
``p``       ``"mrs"`` (merge reduce-scatter) or ``"mag"`` (merge all-gather)
``s``       step, 0..world-2
``seg``     segment index
``codec``   codec name (must agree)
``n``       tensor length (must agree)
``w``       ``mrs`` only: processes the operand stands for (checked against ``ctx.counts``)
``src``     ``mrs`` steps s >= 1 and ``mag`` step 0: rank whose scale rides along. Rank r sends the
            scale of rank (r-s+1) mod world in ``mrs`` step s and of rank (r+2) mod world in ``mag``
            step 0, so after ``mag`` step 0 every rank has every rank's scale (one float per node).
            Nothing rides in step 0: a node's scale is known only once all its segments are packed,
            which it does while its first segment travels.
``scale``   with ``src``: that rank's scale (float64)
``meta``    the segment operand's small map of floats (Marsit: empty; signcascade: its scale)
``err``     set once a node saw a disagreement; the schedule still completes (nobody hangs) and
            every node raises :class:`~birdnet.errors.RoundMismatchError` at the end
==========  ====================================================================================

Out-of-order steps or segments, wrong buffer sizes and malformed fields raise
:class:`~birdnet.errors.ProtocolError` immediately (never ``assert`` on network input).

Result: the dense float32 **sum**, ``v * s`` per segment with ``s`` the merged +-1 vector and ``v``
from ``codec.segment_value`` (Marsit: ``sum_r counts[r] * scale[r]`` accumulated in rank order in
float64), rounded once to float32, so every node computes the identical array. For a mean the
daemon passes ``divide_by``: the segment decodes to ``+-(v / total)`` in float32, the same bits as
dividing the sum afterwards, without another pass over the result. Flush rounds (``codec.is_flush_round``) are a
full-precision :func:`~birdnet.ring.dense.ring_allreduce` of ``counts[r] * p`` instead.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from birdnet.codecs.base import RoundContext
from birdnet.errors import InputError, ProtocolError, RoundMismatchError
from birdnet.kernels.signbits import nbytes_for, unpack_signs
from birdnet.ring.dense import ring_allreduce, segment_bounds
from birdnet.ring.transport import OUT_OF_STEP_HINT, Transport

__all__ = ["merged_allreduce", "merge_bounds", "hop_seed"]

_MASK64 = (1 << 64) - 1


def merge_bounds(n: int, world: int) -> list[int]:
    """Element boundaries of the ``world`` bit segments (multiples of 8 except the final ``n``)."""
    return segment_bounds(int(n), int(world), align=8)


def _mix64(z: int) -> int:
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def hop_seed(local_seed: int, step: int) -> int:
    """The mask seed of reduce-scatter step ``step`` on this node: a non-linear hash of
    ``(local_seed, step)``. (``local_seed + step`` would give rank r at step s and rank r+1 at step
    s-1 the same stream, correlating the masks of different segments.)"""
    return _mix64(_mix64(local_seed) ^ _mix64((step + 1) * 0x9E3779B97F4A7C15))


def _counts(ctx: RoundContext, world: int) -> tuple[int, ...]:
    counts = tuple(ctx.counts) if ctx.counts else (1,) * world
    if len(counts) != world or any((not isinstance(c, int)) or c < 1 for c in counts):
        raise InputError(f"tensor {ctx.name!r} round {ctx.round_id}: counts {counts!r} must be "
                         f"{world} positive integers (one per node, in rank order)")
    return counts


def _check_meta(meta: Any, where: str) -> dict[str, float]:
    if not isinstance(meta, dict) or len(meta) > 8:
        raise ProtocolError(f"{where}: 'meta' is not a small map")
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, float):
            raise ProtocolError(f"{where}: 'meta' entry {k!r} = {v!r} is not a float")
    return meta


def merged_allreduce(transport: Transport, codec: Any, x: np.ndarray, ctx: RoundContext, state: Any, *,
                     timeout: float, out: np.ndarray | None = None,
                     tag: dict[str, Any] | None = None, divide_by: int = 0) -> np.ndarray:
    """All-reduce ``x`` (this node's contribution: float32, the sum of its local processes'
    gradients) with a MERGED codec; returns the dense float32 sum, bit-identical on every node,
    or with ``divide_by`` the sum divided by it (the same float32 division the caller would make;
    only for a codec whose ``after_round`` does not read the sum, ``codec.needs_result_sum``).

    ``timeout`` is the longest wait for any one message from the left neighbour. ``state`` is the
    codec's per-(job, tensor) state (compensation, momentum), updated in place (this function calls
    the codec's ``after_round`` / ``after_flush`` itself). ``out`` (float32, n) receives the result
    when given (it may be ``x``'s memory: ``x`` is not read after compression). ``tag``:
    fields every node must agree on, carried by every message and compared on arrival (a round
    that started without an agreement); a difference fails the round on every node.

    Where the CPU goes while the wire is busy: the first segment is packed before the first send
    and the rest while it travels (so this node's scale leaves in step 1, not step 0); the local
    compensation is updated then too; each finished segment is decoded into ``out`` while the
    next one travels, once every scale is known (after all-gather step 0).
    """
    if not isinstance(x, np.ndarray) or x.ndim != 1 or x.dtype != np.float32:
        raise InputError(f"tensor {ctx.name!r}: merged all-reduce takes a 1-D float32 vector, got "
                         f"{getattr(x, 'dtype', type(x))} of shape {getattr(x, 'shape', '?')}")
    x = np.ascontiguousarray(x)
    r, world = transport.rank, transport.world
    if ctx.rank != r or ctx.world != world:
        raise InputError(f"tensor {ctx.name!r}: context says rank {ctx.rank} of {ctx.world}, transport "
                         f"is rank {r} of {world}")
    if divide_by and getattr(codec, "needs_result_sum", True):
        raise InputError(f"codec {codec.name!r} with these parameters needs the round's sum; divide after")
    counts = _counts(ctx, world)
    n = int(x.shape[0])
    if state is None:  # no memory kept between rounds (e.g. a one-off call)
        state = codec.new_state(n)
    if out is None:
        out = np.empty(n, np.float32)

    if codec.is_flush_round(ctx):
        p = codec.prepare(x, ctx, state)
        contrib = p * np.float32(counts[r]) if counts[r] != 1 else p.copy()
        total = ring_allreduce(transport, contrib, timeout=timeout, inplace=True,
                               tag={"codec": codec.name, "n": n, "flush": True})
        codec.after_flush(state, total, ctx)
        if divide_by:
            np.divide(total, np.float32(divide_by), out=total)
        np.copyto(out, total)
        return out

    bounds = merge_bounds(n, world)
    bb = [nbytes_for(b) for b in bounds]  # byte boundaries (bounds are multiples of 8 but the last)
    own_bits = np.empty(nbytes_for(n), np.uint8)
    compressor = codec.compressor(x, ctx, state)

    def pack(j: int) -> None:
        compressor.segment(bounds[j], bounds[j + 1], own_bits[bb[j]:bb[j + 1]])

    # Every segment starts as this node's own operand, so that after a disagreement (the received
    # operand ignored) the schedule still has well-formed buffers to forward.
    seg_bits: list[Any] = [own_bits[bb[j]:bb[j + 1]] for j in range(world)]
    seg_meta: list[dict[str, float]] = [{} for _ in range(world)]
    scales: list[float | None] = [None] * world
    pack(r)  # the segment sent first
    seg_meta[r] = codec.segment_meta(state, bounds[r], bounds[r + 1], ctx)
    compensated = False
    error: str | None = None
    left = (r - 1) % world

    def finish_compress() -> None:
        nonlocal compensated
        for k in range(1, world):  # in the order the merges need them
            pack((r - k) % world)
        scales[r] = compressor.finish()
        compensated = codec.compensate_early(state, ctx)

    def weight(first: int, hops: int) -> int:
        return sum(counts[(first + i) % world] for i in range(hops))

    def receive(phase: str, step: int, seg: int) -> tuple[dict[str, Any], np.ndarray | None]:
        nonlocal error
        header, bufs = transport.recv(time.monotonic() + timeout)
        where = (f"tensor {ctx.name!r} round {ctx.round_id}: {phase} step {step} from rank {left} "
                 f"to rank {r}")
        if not isinstance(header, dict) or header.get("p") != phase or header.get("s") != step \
                or header.get("seg") != seg:
            got = (header.get("p"), header.get("s"), header.get("seg")) if isinstance(header, dict) else header
            raise ProtocolError(f"{where}: ring out of step: expected ({phase!r}, {step}, segment {seg}), "
                                f"got {got!r}{OUT_OF_STEP_HINT}")
        if header.get("err") and error is None:
            error = str(header["err"])
        if header.get("codec") != codec.name or header.get("n") != n:
            if error is None:
                error = (f"{where}: nodes disagree: rank {left} has codec {header.get('codec')!r} "
                         f"n={header.get('n')!r}, rank {r} has codec {codec.name!r} n={n}")
            return header, None
        if tag is not None and header.get("tag") != tag:
            if error is None:
                theirs = header.get("tag") if isinstance(header.get("tag"), dict) else {}
                diffs = [f"{k}: rank {left} has {theirs.get(k)!r}, rank {r} has {tag.get(k)!r}"
                         for k in sorted(set(tag) | set(theirs), key=str) if theirs.get(k) != tag.get(k)]
                error = f"{where}: nodes disagree on the round: " + "; ".join(diffs)
            return header, None
        want = bb[seg + 1] - bb[seg]
        if len(bufs) != 1 or bufs[0].nbytes != want:
            raise ProtocolError(f"{where}: segment {seg} must be one buffer of {want} bytes, got "
                                f"{[b.nbytes for b in bufs]}")
        header["meta"] = _check_meta(header.get("meta"), where)
        return header, np.frombuffer(bufs[0], dtype=np.uint8)

    def take_scale(h: dict[str, Any], phase: str, step: int, src: int) -> None:
        """The scale of rank ``src`` that the left neighbour sends in this step."""
        nonlocal error
        if not isinstance(h.get("scale"), float):
            raise ProtocolError(f"tensor {ctx.name!r} round {ctx.round_id}: rank {left} sent scale "
                                f"{h.get('scale')!r} (not a float) in {phase} step {step}")
        if h.get("src") != src:
            if error is None:
                error = (f"tensor {ctx.name!r} round {ctx.round_id}: rank {left} sent the scale of rank "
                         f"{h.get('src')!r} in {phase} step {step}, rank {r} expects rank {src}")
            return
        scales[src] = float(h["scale"])

    def send(h: dict[str, Any], buf: Any) -> None:
        h.update({"t": "data", "codec": codec.name, "n": n})
        if tag is not None:
            h["tag"] = tag
        if error:
            h["err"] = error
        transport.send(h, [buf])

    def with_scale(h: dict[str, Any], src: int) -> dict[str, Any]:
        sc = scales[src]
        h.update({"src": src, "scale": sc if sc is not None else 0.0})
        return h

    if world == 1:
        finish_compress()
    # Reduce-scatter: merge bits hop by hop. Scales travel one per step from step 1 (rank r sends
    # the scale of rank r-s+1) and once more in all-gather step 0 (rank r+2's), so every node has
    # every node's scale after that step.
    for s in range(world - 1):
        sj = (r - s) % world
        h = {"p": "mrs", "s": s, "seg": sj, "w": weight(sj, s + 1), "meta": seg_meta[sj]}
        send(with_scale(h, (r - s + 1) % world) if s else h, seg_bits[sj])
        if s == 0:
            finish_compress()  # while segment r travels
        j = (r - s - 1) % world
        h, a = receive("mrs", s, j)
        if a is None or error:
            continue  # the round has failed: keep the schedule going (own operand) so nobody hangs
        if s:
            take_scale(h, "reduce-scatter", s, (r - s) % world)
        w_a = weight(j, s + 1)
        if h.get("w") != w_a:
            if error is None:
                error = (f"tensor {ctx.name!r} round {ctx.round_id}: rank {left} sent segment {j} "
                         f"standing for w={h.get('w')!r}, rank {r} expects w={w_a} (counts {counts})")
            continue
        lo, hi = bounds[j], bounds[j + 1]
        seg_bits[j], seg_meta[j] = codec.merge_hop(a, h["meta"], own_bits[bb[j]:bb[j + 1]], state, lo, hi,
                                                   w_a, counts[r], hop_seed(ctx.local_seed, s), ctx)

    pending = [(r + 1) % world]  # finished segments not yet decoded into out

    def decode_pending() -> None:
        if error or any(sc is None for sc in scales):
            return
        for j in pending:
            lo, hi = bounds[j], bounds[j + 1]
            if hi > lo:
                v = np.float32(codec.segment_value(scales, seg_meta[j], ctx))
                if divide_by:  # the caller's float32 division of +-v, made once: the same bits
                    v = v / np.float32(divide_by)
                unpack_signs(np.asarray(seg_bits[j], dtype=np.uint8), float(v), out[lo:hi])
        pending.clear()

    # All-gather: forward finished segments unchanged; decode each while the next travels.
    for s in range(world - 1):
        sj = (r + 1 - s) % world
        h = {"p": "mag", "s": s, "seg": sj, "meta": seg_meta[sj]}
        send(with_scale(h, (r + 2) % world) if s == 0 else h, seg_bits[sj])
        decode_pending()
        j = (r - s) % world
        h, a = receive("mag", s, j)
        if a is not None:
            seg_bits[j], seg_meta[j] = a, h["meta"]
            if s == 0 and not error:
                take_scale(h, "all-gather", s, (r + 1) % world)
        pending.append(j)
    if error:
        raise RoundMismatchError(error)
    if any(sc is None for sc in scales):
        raise ProtocolError(f"tensor {ctx.name!r} round {ctx.round_id}: missing scales {scales!r}")
    decode_pending()
    if not compensated:
        codec.after_round(state, out, ctx)
    return out
