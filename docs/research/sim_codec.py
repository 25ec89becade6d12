"""`birdnet bench train`'s MLP task with birdnet's real codecs, in one process (no daemons).

The data, model, shards, batch order, initialisation and optimizer are those of
birdnet/bench/trainlib.py (rank r's parameters are rank 0's, its batches rank r's); each round
runs the codec on W in-process "nodes" as tests/_codec_sim.py does (SUMMABLE: the float32 values
are added in rank order, then every node decompresses the sum; GATHERED: every node adds every
payload in rank order) and divides by W, as the daemon's mean does. Tensors under 1,024 elements
go dense with the optimizer's momentum, as with the daemons' dense_threshold. The ring adds in
another order, so single runs differ from the daemons' in the last bits, not in what they say.

    python docs/research/sim_codec.py --workers 4 --seeds 0,1,2 \
        --codec birdplus --params density=0.01,momentum=0.9,mode=shared
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


def run(a, seed: int) -> float:
    Xtr, ytr, Xte, yte = load("mnist1d", seed)
    W = a.workers
    net = MLP(Xtr.shape[1], np.random.default_rng(seed), (512, 512))
    shards = [(Xtr[r::W], ytr[r::W]) for r in range(W)]
    orders = [np.random.default_rng(seed + r) for r in range(W)]
    steps = len(shards[0][0]) // a.batch
    codec = None if a.codec == "none" else get_codec(a.codec, **parse(a.params))
    mom_in_codec = codec is not None and parse(a.params).get("momentum", 0) > 0
    states = {k: [codec.new_state(v.size) if codec else None for _ in range(W)] for k, v in net.p.items()}
    vel = {k: np.zeros_like(v) for k, v in net.p.items()}
    rnd = {k: 0 for k in net.p}
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
                if codec is None or n < 1024:
                    upd = xs[0].copy()
                    for x in xs[1:]:
                        upd += x
                    upd /= np.float32(W)
                    vel[k] = a.momentum * vel[k] + upd.reshape(net.p[k].shape)
                    net.p[k] -= a.lr * vel[k]
                    continue
                t = rnd[k]
                rnd[k] += 1
                sd = (seed * 1_000_003 + t * 7919 + ti * 104729 + 1) & ((1 << 63) - 1)
                cs = [RoundContext(job="j", name=k, shape=(n,), round_id=t, rank=r, world=W, seed=sd,
                                   tensor_round=t) for r in range(W)]
                pays = [codec.compress(x, c, st) for x, c, st in zip(xs, cs, states[k])]
                if codec.pattern == Pattern.SUMMABLE:
                    tot = np.zeros_like(pays[0].values)
                    for p in pays:
                        v = p.values.astype(np.float16).astype(np.float32) if codec.wire_dtype == "float16" else p.values
                        tot = (tot + v).astype(np.float32)
                    out = np.empty(n, np.float32)
                    for r in range(W):
                        o = out if r == 0 else np.empty(n, np.float32)
                        codec.decompress(Payload(header=dict(pays[0].header), values=tot.copy()), o, cs[r],
                                         states[k][r])
                else:
                    out = np.zeros(n, np.float32)
                    for p in pays:
                        h, bufs = pack_buffers(p)
                        codec.decompress_add(codec.payload_from_wire(dict(h), [memoryview(b.tobytes()) for b in bufs]),
                                             out, cs[0])
                for c, st in zip(cs, states[k]):
                    codec.after_round(st, out, c)
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
