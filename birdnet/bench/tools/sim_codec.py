"""`birdnet bench train`'s MLP task with birdnet's real codecs, in one process (no daemons).

The data, model, shards, batch order, initialisation and optimizer are those of
birdnet/bench/trainlib.py (rank r's parameters are rank 0's, its batches rank r's); each round
runs the codec on W in-process "nodes" as tests/_codec_sim.py does (SUMMABLE: the float32 values
are added in rank order, or for a codec with a wire format (lowbit) summed by the real ring over an
in-memory transport, then every node decompresses the sum; GATHERED: every node adds every
payload in rank order) and divides by W, as the daemon's mean does. Tensors under 1,024 elements
go dense with the optimizer's momentum, as with the daemons' dense_threshold. The ring adds in
another order, so single runs differ from the daemons' in the last bits, not in what they say.

    python -m birdnet.bench.tools.sim_codec --workers 4 --seeds 0,1,2 \
        --codec birdplus --params density=0.01,momentum=0.9,mode=shared

``--codec oracle --params density=D[,gamma=16][,norms=...]`` selects from every node's whole
accumulator, which no codec can: what a summable selection could reach (oracle_round).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from birdnet.bench.trainlib import MLP, load
from birdnet.codecs import Pattern, Payload, RoundContext, get_codec
from birdnet.codecs.base import pack_buffers


def parse(s: str) -> dict:
    out = {}
    for kv in filter(None, s.split(",")):
        k, v = kv.split("=")
        for conv in (int, float):
            try:
                v = conv(v)
                break
            except ValueError:
                pass
        if v in ("true", "false"):
            v = v == "true"
        out[k] = v
    return out


def codec_round(codec, xs, states, n: int, t: int, ti: int, seed: int, name: str) -> np.ndarray:
    """One round of a birdnet codec on W in-process nodes: the sum of what they send."""
    W = len(xs)
    sd = (seed * 1_000_003 + t * 7919 + ti * 104729 + 1) & ((1 << 63) - 1)
    cs = [RoundContext(job="j", name=name, shape=(n,), round_id=t, rank=r, world=W, seed=sd,
                       tensor_round=t) for r in range(W)]
    pays = [codec.compress(x, c, st) for x, c, st in zip(xs, cs, states)]
    wires = [codec.wire_format(c, st) for c, st in zip(cs, states)] if codec.pattern == Pattern.SUMMABLE else []
    if wires and wires[0] is not None:  # encoded at every hop (lowbit): the real ring, in memory
        from birdnet.ring.dense import ring_allreduce
        from birdnet.ring.transport import MemoryRing
        sums = MemoryRing(W).run(lambda tr: ring_allreduce(tr, pays[tr.rank].values, timeout=60.0,
                                                            wire=wires[tr.rank]))
        out = np.empty(n, np.float32)
        for r in range(W):
            o = out if r == 0 else np.empty(n, np.float32)
            codec.decompress(Payload(header=dict(pays[0].header), values=sums[r]), o, cs[r], states[r])
    elif codec.pattern == Pattern.SUMMABLE:
        tot = np.zeros_like(pays[0].values)
        for p in pays:
            v = p.values.astype(np.float16).astype(np.float32) if codec.wire_dtype == "float16" else p.values
            tot = (tot + v).astype(np.float32)
        out = np.empty(n, np.float32)
        for r in range(W):
            o = out if r == 0 else np.empty(n, np.float32)
            codec.decompress(Payload(header=dict(pays[0].header), values=tot.copy()), o, cs[r],
                             states[r])
    else:
        out = np.zeros(n, np.float32)
        for p in pays:
            h, bufs = pack_buffers(p)
            codec.decompress_add(codec.payload_from_wire(dict(h), [memoryview(b.tobytes()) for b in bufs]),
                                 out, cs[0])
    for c, st in zip(cs, states):
        codec.after_round(st, out, c)
    return out


def oracle_round(xs, acc, op: dict, rng: np.random.Generator, memo: dict) -> np.ndarray:
    """A summable selection made from what no codec has (every node's whole accumulator), to
    bound what a summable codec could reach (docs/research/findings.md).

    Each node keeps error feedback v (with ``momentum``: u = m u + x, v += u, u cleared where
    sent, as the codecs' momentum correction; without it the optimizer's momentum acts on the
    result). Blocks of ``block`` elements are ranked by ``norms``:

    - ``sum`` (default): the L1 norms of the sum V of all nodes' v;
    - ``sumabs``: the sum of each node's own norms (summable);
    - ``proj``: one random +-1 projection of each block, summed (summable);
    - ``rot``: ``sumabs`` for every ``refresh``-th block in turn, sent blocks' residuals exactly;
    - ``agerate``: nothing sent: rounds unsent x the block's last sent norm per round.

    ``stale=1`` takes the norms after the previous round's send (what a summable tail of this
    round's payload could carry). The top ``density`` of the blocks are kept, or with ``gamma`` a
    sample as birdplus draws it (p ~ norm^gamma, K expected), scaled by 1/max(p, 1/``cap``). Every
    node sends its v there (they add up to V there, times the scale) and keeps the rest."""
    m, b = float(op.get("momentum", 0.0)), int(op.get("block", 8))
    n = xs[0].size
    for x, (u, v) in zip(xs, acc):
        if m > 0:
            u *= np.float32(m)
            u += x
            v += u
        else:
            v += x
    tot = acc[0][1].copy()
    for _, v in acc[1:]:
        tot += v
    nb = -(-n // b)
    if op.get("norms") == "agerate":
        # zero bytes: what every node knows alike, each block's rounds unsent x its last sent L1 per round
        age = memo.setdefault("age", np.zeros(nb, np.float64))
        rate = memo.setdefault("rate", np.zeros(nb, np.float64))
        age += 1
        known = rate > 0
        fill = rate[known].mean() if known.any() else 1.0
        norms = np.where(known, rate, fill) * age
    elif op.get("norms") == "rot":
        # what a summable tail of m/R norms per round could carry: each node's own block norms,
        # summed, for every R-th block in turn (after the last send); sent blocks' residuals exactly
        if "est" not in memo:
            memo["est"], memo["t"] = global_norms(acc, b, {"norms": "sumabs"}), 0
        norms = memo["est"]
    else:  # the sum V is at hand: its norms without adding the accumulators up again
        norms = block_l1(tot, b) if op.get("norms", "sum") == "sum" else global_norms(acc, b, op)
    if op.get("stale") and "norms" in memo:
        norms = memo["norms"]  # of the accumulators after the last round's send, as a tail could carry them
    k = max(1, int(np.ceil(float(op.get("density", 0.01)) * nb)))
    scale = np.ones(nb, np.float32)
    if op.get("gamma"):  # sampled as birdplus samples (p ~ norm^gamma, K in expectation), capped 1/p
        w = (norms / norms.max()) ** float(op["gamma"]) if norms.max() > 0 else np.ones(nb)
        lo, hi = 0.0, 1e30
        for _ in range(200):  # water filling, sum of min(1, A w) = k: double A until past it, then bisect
            mid = (lo + hi) / 2 if hi < 1e30 else max(1.0, lo * 2)
            lo, hi = (mid, hi) if np.minimum(1.0, mid * w).sum() < k else (lo, mid)
        p = np.minimum(1.0, hi * w)
        c = np.cumsum(p)
        u0 = rng.random()
        blocks = np.unique(np.searchsorted(c, u0 + np.arange(int(np.ceil(c[-1] - u0)))))
        blocks = blocks[blocks < nb]
        scale = (1.0 / np.maximum(p, 1.0 / float(op.get("cap", 10)))).astype(np.float32)
    else:
        blocks = np.argpartition(norms, nb - k)[nb - k:]
    idx = (blocks[:, None] * b + np.arange(b)).reshape(-1)
    idx = idx[idx < n]
    sc = scale[idx // b]
    out = np.zeros(n, np.float32)
    out[idx] = tot[idx] * sc
    for u, v in acc:
        v[idx] -= v[idx] * sc
        u[idx] = 0
    if op.get("stale"):
        memo["norms"] = global_norms(acc, b, op)
    if op.get("norms") == "rot":
        est, R = memo["est"], int(op.get("refresh", 8))
        est[blocks] = block_l1(out, b)[blocks] * np.abs(1 - scale[blocks]) / scale[blocks]
        memo["t"] += 1
        fresh = np.arange(memo["t"] % R, nb, R)
        est[fresh] = global_norms(acc, b, {"norms": "sumabs"})[fresh]
    if op.get("norms") == "agerate":
        sent = block_l1(out, b)[blocks] / scale[blocks]
        beta = float(op.get("rate_keep", 0.0))
        memo["rate"][blocks] = beta * memo["rate"][blocks] + (1 - beta) * sent / memo["age"][blocks]
        memo["age"][blocks] = 0
    return out


def block_l1(x: np.ndarray, b: int) -> np.ndarray:
    nb = -(-x.size // b)
    pad = np.zeros(nb * b, np.float32)
    pad[:x.size] = np.abs(x)
    return pad.reshape(nb, b).sum(axis=1)


def global_norms(acc, b: int, op: dict) -> np.ndarray:
    """Block L1 norms of the sum of the nodes' accumulators (``norms=sum``), or the sum of each
    node's own block norms (``norms=sumabs``: summable, so a ring can add them up), or one random
    +-1 projection of each block, summed (``norms=proj``: summable too)."""
    if op.get("norms", "sum") == "sum":
        tot = acc[0][1].copy()
        for _, v in acc[1:]:
            tot += v
        return block_l1(tot, b)
    if op["norms"] == "proj":
        # one random +-1 projection per block, summed over nodes (summable): |<r, V_block>| sees the
        # nodes' signs cancel, and its square is an unbiased estimate of the block's squared L2 norm
        n = acc[0][1].size
        nb = -(-n // b)
        r = np.where(np.random.default_rng(len(op.setdefault("_draws", [])) + 7).random(nb * b) < 0.5, -1.0, 1.0)
        op["_draws"].append(0)
        tot = np.zeros(nb * b, np.float32)
        for _, v in acc:
            tot[:n] += v
        return np.abs((tot * r).reshape(nb, b).sum(axis=1)).astype(np.float32)
    return sum(block_l1(v, b) for _, v in acc)


def run(a, seed: int) -> float:
    Xtr, ytr, Xte, yte = load("mnist1d", seed)
    W = a.workers
    net = MLP(Xtr.shape[1], np.random.default_rng(seed), (512, 512))
    shards = [(Xtr[r::W], ytr[r::W]) for r in range(W)]
    orders = [np.random.default_rng(seed + r) for r in range(W)]
    steps = len(shards[0][0]) // a.batch
    oracle = a.codec == "oracle"
    op = parse(a.params)
    codec = None if a.codec in ("none", "oracle") else get_codec(a.codec, **op)
    mom_in_codec = a.codec != "none" and op.get("momentum", 0) > 0
    # the oracle's accumulators per tensor and node: [u (momentum), v (error feedback)]
    acc = {k: [[np.zeros(v.size, np.float32), np.zeros(v.size, np.float32)] for _ in range(W)]
           for k, v in net.p.items()}
    states = {k: [codec.new_state(v.size) if codec else None for _ in range(W)] for k, v in net.p.items()}
    vel = {k: np.zeros_like(v) for k, v in net.p.items()}
    rnd = {k: 0 for k in net.p}
    orng = np.random.default_rng(seed + 99)
    memos = {k: {} for k in net.p}
    for _ in range(a.epochs):
        perms = [o.permutation(len(shards[r][0])) for r, o in enumerate(orders)]
        for s in range(steps):
            gs = []
            for r in range(W):
                idx = perms[r][s * a.batch:(s + 1) * a.batch]
                gs.append(net.grads(shards[r][0][idx], shards[r][1][idx]))
            for ti, k in enumerate(sorted(net.p)):
                n = net.p[k].size
                xs = [g[k].reshape(-1) for g in gs]
                if (codec is None and not oracle) or n < 1024:
                    upd = xs[0].copy()
                    for x in xs[1:]:
                        upd += x
                    upd /= np.float32(W)
                    vel[k] = a.momentum * vel[k] + upd.reshape(net.p[k].shape)
                    net.p[k] -= a.lr * vel[k]
                    continue
                if oracle:
                    out = oracle_round(xs, acc[k], op, orng, memos[k])
                else:
                    out = codec_round(codec, xs, states[k], n, rnd[k], ti, seed, k)
                rnd[k] += 1
                out /= np.float32(W)
                if mom_in_codec:
                    net.p[k] -= a.lr * out.reshape(net.p[k].shape)
                else:
                    vel[k] = a.momentum * vel[k] + out.reshape(net.p[k].shape)
                    net.p[k] -= a.lr * vel[k]
    return net.loss_acc(Xte, yte)[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec", default="birdplus")
    ap.add_argument("--params", default="density=0.01,momentum=0.9")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    accs = []
    for s in a.seeds.split(","):
        t0 = time.monotonic()
        accs.append(run(a, int(s)))
        print(f"  seed {s}: {100 * accs[-1]:.2f} ({time.monotonic() - t0:.0f} s)", flush=True)
    print(f"{a.codec}:{a.params} W={a.workers}: mean {100 * np.mean(accs):.2f} "
          f"{[round(100 * x, 2) for x in accs]}", flush=True)


if __name__ == "__main__":
    main()
