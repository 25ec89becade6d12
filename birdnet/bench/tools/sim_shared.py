"""BIRD+ shared-mode designs, simulated (the setting of birdnet.bench.tools.sim: MNIST-1D, MLP 2x512, batch 32 per worker, 15 epochs, momentum 0.9, lr 0.05, tensors < 1024
dense, density 0.01, blocks of 8).

--sel local      each worker selects from its own accumulator (gathered, birdplus local mode)
--sel leader     the rotating leader's selection (ids from its accumulator after round t's send),
                 used by every worker in round t+1 (summable)
--sel vote       every worker proposes K/W ids (slots), union used in round t+1 (summable)
--ef full        DGC momentum correction: u, v (4n + 4n); v[sent] = 0, u[sent] = 0
--ef age         u (momentum, kept) and an age per block; sends age*u; age[sent] = 0 (n/4 bytes)
--ef decay D     full, but v *= D each round (low-pass)
"""
from __future__ import annotations

import argparse

import numpy as np

from birdnet.bench.tools.sim import MLP, load  # noqa: E402


def block_norms(f, b):
    n = f.size
    m = -(-n // b)
    return np.abs(np.pad(f, (0, m * b - n))).reshape(m, b).sum(1)


def probs(a, k, gamma):
    m = a.size
    if np.isinf(gamma):
        p = np.zeros(m)
        p[np.argpartition(a, m - k)[m - k:]] = 1.0
        return p
    mx = a.max()
    if not mx > 0:
        return np.full(m, k / m)
    w = (a / mx) ** gamma
    # water filling: sum min(1, A w) = k
    lo, hi = 0.0, 1.0
    while np.minimum(1, hi * w).sum() < k and hi < 1e300:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.minimum(1, mid * w).sum() < k else (lo, mid)
    return np.minimum(1, hi * w)


def systematic(p, rng):
    c = np.cumsum(p)
    u = rng.random()
    keep = np.floor(c - u) > np.floor(np.concatenate([[0.0], c[:-1]]) - u)
    return np.nonzero(keep)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sel", default="local")
    ap.add_argument("--ef", default="full")
    ap.add_argument("--decay", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--gamma", type=float, default=16.0)
    ap.add_argument("--cap", type=float, default=10.0)
    ap.add_argument("--agecap", type=float, default=0.0, help="age EF: cap on the age (0 = none)")
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="leader: select on the current round (oracle, not summable)")
    ap.add_argument("--mix", type=float, default=0.0, help="vote: share of K from the leader, rest split")
    ap.add_argument("--own-scale", action="store_true",
                    help="vote/leader, finite gamma: each proposer samples its slots with its own gamma "
                         "probabilities and, next round, scales only its own proposals by its own "
                         "1/max(p, 1/cap); every other value travels unscaled (summable, no extra bytes)")
    ap.add_argument("--mask", default="sent", choices=["sent", "none", "own"],
                    help="momentum-factor masking: u = 0 on every sent block, never, or only on own "
                         "proposals (with --own-scale; without it \"own\" is \"sent\")")
    ap.add_argument("--lowpass", type=float, default=1.0,
                    help="ScaleCom low-pass on the memory: v = (1-beta) v_old + beta (residual)")
    ap.add_argument("--slots", type=float, default=1.0,
                    help="vote: proposal slots per node = slots*K/W; the union keeps the K ids proposed "
                         "by most nodes (then best rank)")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    accs = []
    for s in a.seeds.split(","):
        accs.append(run(a, int(s)))
        print(f"  seed {s}: {100*accs[-1]:.2f} union/K {np.mean(UNION) if UNION else 0:.3f}", flush=True)
        UNION.clear()
    name = "dense" if a.dense else (f"sel={a.sel} ef={a.ef} decay={a.decay} g={a.gamma} b={a.block} d={a.density} "
                                    f"cap={a.cap} agecap={a.agecap} fresh={a.fresh} mix={a.mix} own={a.own_scale} "
                                    f"mask={a.mask} lowpass={a.lowpass} slots={a.slots}")
    print(f"{a.tag} {name} W={a.workers}: mean {100*np.mean(accs):.2f} {[round(100*x, 2) for x in accs]}", flush=True)


UNION: list = []
LAST: dict = {}
OWN: dict = {}  # (worker, tensor) -> {block id: own scale} of that worker's last proposal


def run(a, seed):
    OWN.clear()
    LAST.clear()
    Xtr, ytr, Xte, yte = load("mnist1d", seed)
    rng = np.random.default_rng(seed)
    net = MLP(Xtr.shape[1], rng)
    W = a.workers
    shards = [(Xtr[i::W], ytr[i::W]) for i in range(W)]
    keys = list(net.p)
    U = [{k: np.zeros(net.p[k].size, np.float32) for k in keys} for _ in range(W)]
    V = [{k: np.zeros(net.p[k].size, np.float32) for k in keys} for _ in range(W)]
    b = a.block
    AGE = [{k: np.zeros(-(-net.p[k].size // b)) for k in keys} for _ in range(W)]
    nxt = {k: None for k in keys}  # shared: ids (and p) for the next round, from round t's result
    vel = {k: np.zeros_like(v) for k, v in net.p.items()}
    steps, t = len(shards[0][0]) // a.batch, 0
    for _ in range(a.epochs):
        for s in range(steps):
            gs = [net.grads(x[s * a.batch:(s + 1) * a.batch], y[s * a.batch:(s + 1) * a.batch]) for x, y in shards]
            for k in keys:
                if a.dense or gs[0][k].size < 1024:
                    upd = sum(g[k] for g in gs) / W
                    vel[k] = a.momentum * vel[k] + upd
                    net.p[k] -= a.lr * vel[k]
                    continue
                net.p[k] -= exchange(a, k, [g[k].ravel() for g in gs], U, V, AGE, nxt, t, rng).reshape(net.p[k].shape)
            t += 1
    return float((net.forward(Xte)[-1].argmax(1) == yte).mean())


def exchange(a, k, gs, U, V, AGE, nxt, t, rng):
    W = len(gs)
    b = a.block
    n = gs[0].size
    m = -(-n // b)
    K = max(1, round(a.density * m))
    acc = []  # each worker's (virtual) accumulator, lr inside
    for w in range(W):
        U[w][k] = a.momentum * U[w][k] + gs[w]
        if a.ef == "full":
            V[w][k] = a.decay * V[w][k] + a.lr * U[w][k]
            acc.append(V[w][k])
        elif a.ef == "age":
            AGE[w][k] += 1
            ag = AGE[w][k] if a.agecap <= 0 else np.minimum(AGE[w][k], a.agecap)
            acc.append(a.lr * U[w][k] * np.repeat(ag, b)[:n])
        else:
            raise SystemExit(a.ef)

    def scales(p):
        return 1.0 / np.maximum(p, 1.0 / a.cap)

    out = np.zeros(n, np.float32)
    if a.sel == "local":
        for w in range(W):
            p = probs(block_norms(acc[w], b), K, a.gamma)
            ids = systematic(p, rng) if not np.isinf(a.gamma) else np.nonzero(p)[0]
            sc = scales(p[ids]) if not np.isinf(a.gamma) else np.ones(len(ids))
            send(a, k, w, acc[w], ids, sc, out, U, V, AGE, b, n)
        return out / W
    # shared: the selection of this round was fixed at the end of the last one
    if nxt[k] is None or a.fresh:
        if a.fresh:
            L = t % W
            ids, sc = propose(a, acc[L], K, rng, b)
        else:
            ids = np.sort(rng.choice(m, K, replace=False))
            sc = np.ones(K)
    else:
        ids, sc = nxt[k]
    for w in range(W):
        if a.own_scale:
            own = OWN.get((w, k), {})
            scw = np.array([own.get(int(i), 1.0) for i in ids])
            mine = np.array([int(i) in own for i in ids], bool)
        else:
            scw, mine = sc, np.ones(len(ids), bool)
        send(a, k, w, acc[w], ids, scw, out, U, V, AGE, b, n, mine)
        if a.lowpass < 1.0:  # ScaleCom: v = (1-beta) v_prev + beta (residual); v_prev before the gradient
            V[w][k] = ((1 - a.lowpass) * LAST.get((w, k), 0.0) + a.lowpass * V[w][k]).astype(np.float32)
            LAST[(w, k)] = V[w][k].copy()
    UNION.append(len(ids) / K)
    # proposals for the next round, from accumulators after this round's send
    post = []
    for w in range(W):
        if a.ef == "full":
            post.append(V[w][k])
        else:
            ag = AGE[w][k] + 1
            ag = ag if a.agecap <= 0 else np.minimum(ag, a.agecap)
            post.append(a.lr * U[w][k] * np.repeat(ag, b)[:n])
    if a.sel == "leader":
        L = (t + 1) % W
        nxt[k] = propose(a, post[L], K, rng, b)
    elif a.sel == "vote":
        kl = int(round(a.mix * K))
        share = (K - kl) // W
        idl, scl = [], []
        if kl:
            i, sc2 = propose(a, post[(t + 1) % W], kl, rng, b)
            idl.append(i)
            scl.append(sc2)
        if a.slots != 1.0:
            per = max(1, int(round(a.slots * K / W)))
            cnt, best = {}, {}
            for w in range(W):
                top = np.argsort(-block_norms(post[w], b), kind="stable")[:per]
                for r, i in enumerate(top):
                    i = int(i)
                    cnt[i] = cnt.get(i, 0) + 1
                    best[i] = min(best.get(i, r), r)
            order = sorted(cnt, key=lambda i: (-cnt[i], best[i], i))[:K]
            nxt[k] = (np.sort(np.array(order)), np.ones(len(order)))
            return out / W
        for w in range(W):
            i, sc2 = propose(a, post[w], max(1, share), rng, b)
            idl.append(i)
            scl.append(sc2)
            if a.own_scale:
                OWN[(w, k)] = {int(j): float(x) for j, x in zip(i, sc2)}
        ids = np.concatenate(idl)
        sc = np.concatenate(scl)
        ids, first = np.unique(ids, return_index=True)
        nxt[k] = (ids, sc[first])
    elif a.sel == "sum":  # oracle: sum of all workers' block norms (n/b floats extra)
        a2 = sum(block_norms(p_, b) for p_ in post)
        p = probs(a2, K, a.gamma)
        ids = systematic(p, rng) if not np.isinf(a.gamma) else np.nonzero(p)[0]
        nxt[k] = (ids, scales(p[ids]) if not np.isinf(a.gamma) else np.ones(len(ids)))
    else:
        raise SystemExit(a.sel)
    return out / W


def propose(a, f, K, rng, b):
    p = probs(block_norms(f, b), K, a.gamma)
    if np.isinf(a.gamma):
        ids = np.nonzero(p)[0]
        return ids, np.ones(len(ids))
    ids = systematic(p, rng)
    return ids, 1.0 / np.maximum(p[ids], 1.0 / a.cap)


def send(a, k, w, f, ids, sc, out, U, V, AGE, b, n, mine=None):
    idx = (ids[:, None] * b + np.arange(b)).ravel()
    if mine is None:
        mine = np.ones(len(ids), bool)
    midx = (ids[mine][:, None] * b + np.arange(b)).ravel()
    midx = midx[midx < n]
    ok = idx < n
    idx = idx[ok]
    s = np.repeat(sc, b)[ok]
    vals = f[idx] * s
    out[idx] += vals
    if a.ef == "full":
        V[w][k][idx] -= vals
        if a.mask == "sent":
            U[w][k][idx] = 0.0
        elif a.mask == "own":
            U[w][k][midx] = 0.0
    else:
        AGE[w][k][ids] = 0.0
        # age scheme: u is plain momentum (not masked); the cap scale beyond 1 is extrapolation


if __name__ == "__main__":
    main()
