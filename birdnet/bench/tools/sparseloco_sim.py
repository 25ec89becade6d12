"""SparseLoCo-style pseudo-gradients (arXiv 2508.15706) on DiLoCo's syncs, emulated in NumPy
(docs/slowlink.md, Bytes against steps). Runs ``diloco_loop_sim --codec ring`` with a sync whose codec
is ``sparseloco`` computed here instead of by birdnet's ``sparseloco`` codec (the same kept positions
and values: tests/test_bench_tools.py; this emulation also sends the kept values in float32 or as
1 bit, ``vbits``), every other sync (e.g. ``lowbit`` in the warm-up) by birdnet's real codec and
ring; ``diloco_loop_sim --codec ring`` alone runs the real ``sparseloco`` codec::

    python -m birdnet.bench.tools.sparseloco_sim --steps 400 --eval-every 20 --set '{
        "DEFAULT_CODEC": "sparseloco", "DEFAULT_CODEC_PARAMS": {"chunk": 4096, "k": 256, "vbits": 2, "beta": 0.95},
        "DEFAULT_WARMUP_CODEC": "lowbit", "DEFAULT_WARMUP_CODEC_PARAMS": {"bits": 1, "block": 256}}' \\
        --opts '{"outer_lr": 1.0, "outer_momentum": 0.0}'

Each worker r keeps an error-feedback accumulator ``e_r`` per (fragment, parameters), as the
daemons would per tensor: ``e_r = beta * e_r + delta_r``; per chunk of ``chunk`` values (the flat
fragment cut in order) the ``k`` largest |e_r| are kept and quantised, ``c_r``; ``e_r -= c_r``; the
sync's result is ``sum_r c_r / W`` (summed in rank order in float32, bit-identical everywhere). With
``outer_lr`` 1 and ``outer_momentum`` 0 after the warm-up this is SparseLoCo (the accumulator in
place of the outer momentum); any other outer optimizer may be set with ``--opts``.

Parameters of ``sparseloco`` (``--set`` ... ``_CODEC_PARAMS``):

``chunk``  values per chunk (default 4096)
``k``      kept values per chunk (default 64)
``vbits``  the kept values' code: 32 float32; 2 their sign and one magnitude bit, the magnitude the
           mean |x| of the chunk's kept values below or above their mean |x| (two bfloat16 scales a
           chunk; near Lloyd-Max for two levels a side); 1 their sign times the chunk's mean |x| of
           the kept values (one bfloat16 scale)
``beta``   the accumulator's decay (default 1: plain error feedback)

Bytes (what one node sends per sync): the chunks' index sets (``k`` offsets of ceil(log2(chunk))
bits, or a bitmap of ``chunk`` bits, whichever is smaller), the values (``vbits`` each) and the
scales (2 bytes each), rounded up to whole bytes per chunk, times ``W - 1``: the index sets differ
between nodes, so the exchange is a gather (each node's payload reaches every other node; in a ring
each node forwards W-1 payloads), where a dense code in a ring sends 2(W-1)/W of its payload.
The other arguments are ``diloco_loop_sim``'s (its ``--codec`` is ``ring``). Prints its JSON line,
with ``"sparseloco_bytes_per_sync"`` added per codec parameters.
"""
from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np

DEFAULTS: dict[str, Any] = {"chunk": 4096, "k": 64, "vbits": 2, "beta": 1.0}


def params_of(p: dict[str, Any]) -> dict[str, Any]:
    out = dict(DEFAULTS)
    unknown = set(p) - set(DEFAULTS)
    if unknown:
        raise SystemExit(f"sparseloco: unknown parameters {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    out.update(p)
    if not (isinstance(out["chunk"], int) and out["chunk"] >= 2 and isinstance(out["k"], int)
            and 1 <= out["k"] <= out["chunk"]):
        raise SystemExit(f"sparseloco: chunk {out['chunk']!r} and k {out['k']!r}: need ints, 1 <= k <= chunk")
    if out["vbits"] not in (1, 2, 32):
        raise SystemExit(f"sparseloco: vbits {out['vbits']!r}: one of 1, 2, 32")
    if not 0.0 <= float(out["beta"]) <= 1.0:
        raise SystemExit(f"sparseloco: beta {out['beta']!r}: in [0, 1]")
    return out


def payload_bytes(n: int, p: dict[str, Any]) -> int:
    """One node's encoded fragment of n values: per chunk, indexes + values + scales."""
    chunk, k, vbits = p["chunk"], p["k"], p["vbits"]
    total = 0
    for start in range(0, n, chunk):
        c = min(chunk, n - start)
        kk = min(k, c)
        idx_bits = min(kk * max(1, math.ceil(math.log2(c))), c)
        scales = {32: 0, 2: 2, 1: 1}[vbits]
        total += -(-(idx_bits + kk * vbits) // 8) + 2 * scales
    return total


def _bf16(v: np.ndarray) -> np.ndarray:
    """Round to the nearest bfloat16 (the scales travel as bfloat16)."""
    u = np.asarray(v, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def compress(e: np.ndarray, p: dict[str, Any]) -> np.ndarray:
    """The dense values a node sends (zero where not kept), per chunk top-k of |e|, quantised."""
    n, chunk, k = e.shape[0], p["chunk"], p["k"]
    full = n - n % chunk
    if full < n:  # the last chunk, shorter, keeps min(k, its length) as the codec does
        tail = compress(e[full:], {**p, "chunk": n - full})
        return np.concatenate([compress(e[:full], p), tail]) if full else tail
    x = e.reshape(-1, chunk)
    kk = min(k, chunk)
    idx = np.argpartition(-np.abs(x), kk - 1, axis=1)[:, :kk]
    v = np.take_along_axis(x, idx, axis=1)
    a = np.abs(v).astype(np.float64)
    if p["vbits"] == 1:
        q = np.sign(v) * _bf16(a.mean(axis=1, keepdims=True).astype(np.float32))
    elif p["vbits"] == 2:
        m = a.mean(axis=1, keepdims=True)
        big = a > m
        nbig = big.sum(axis=1, keepdims=True)
        hi = np.where(big, a, 0).sum(axis=1, keepdims=True) / np.maximum(nbig, 1)
        lo = np.where(big, 0, a).sum(axis=1, keepdims=True) / np.maximum(kk - nbig, 1)
        hi, lo = _bf16(hi.astype(np.float32)), _bf16(lo.astype(np.float32))
        q = np.sign(v) * np.where(big, hi, lo)
    else:
        q = v
    out = np.zeros_like(x)
    np.put_along_axis(out, idx, q.astype(np.float32), axis=1)
    return out.reshape(-1)[:n]


def install() -> None:
    """Add ``sparseloco`` to diloco_loop_sim's ring mode and to DiLoCo's codec check."""
    import birdnet.client.diloco as dl
    from birdnet.bench.tools import diloco_loop_sim as sim

    check = dl.check_codec

    def check_codec(codec: str, codec_params: dict[str, Any]) -> None:
        if codec == "sparseloco":
            params_of(codec_params)
        else:
            check(codec, codec_params)

    dl.check_codec = check_codec
    base = sim._Collective

    class Collective(base):
        bytes_per_sync: dict[str, int] = {}

        def _ring(self, name: str, xs: list[np.ndarray]) -> tuple[np.ndarray, int]:
            cname, params = self.spec[name]
            if cname != "sparseloco":
                return super()._ring(name, xs)
            p = params_of(params)
            key = json.dumps(p, sort_keys=True)
            s = np.zeros(xs[0].shape[0], np.float32)
            for r, x in enumerate(xs):
                e = self.residual.setdefault((name + key, r), np.zeros(x.shape[0], np.float32))
                e *= np.float32(p["beta"])
                e += x
                c = compress(e, p)
                e -= c
                s += c
            nbytes = (self.world - 1) * payload_bytes(xs[0].shape[0], p)
            Collective.bytes_per_sync[key] = nbytes
            return (s / np.float32(self.world)).astype(np.float32), nbytes

    sim._Collective = Collective


def main() -> None:
    install()
    from birdnet.bench.tools import diloco_loop_sim as sim
    sys.argv = [sys.argv[0], "--codec", "ring"] + sys.argv[1:]
    sim.main()
    print(json.dumps({"sparseloco_bytes_per_sync": sim._Collective.bytes_per_sync}))


if __name__ == "__main__":
    main()
