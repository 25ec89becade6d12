"""Convergence simulator: how gradient compressors affect training, without any network.

W simulated workers train the same MLP data-parallel; each round every tensor of at least 1024
elements goes through the chosen compressor, the results are averaged, and the model is updated.
It is a quick way to try a codec design before building it into birdnet; the training benchmark
through real daemons (`birdnet bench train`) is what counts. What it found: docs/research/findings.md.

usage:
  python -m birdnet.bench.tools.sim --method dense
  python -m birdnet.bench.tools.sim --method blocks --momentum-correction --gamma 4 --block 8
  python -m birdnet.bench.tools.sim --method marsit --flush 100
methods: dense, topk, blocks, marsit, signcascade, efsign
data: mnist1d (generated offline by the `mnist1d` package) or digits (scikit-learn)
"""
from __future__ import annotations

import argparse

import numpy as np


def load(data: str, seed: int):
    if data == "digits":
        from sklearn.datasets import load_digits
        X, y = load_digits(return_X_y=True)
        X, ntest = (X / 16.0).astype(np.float32), 397
    else:
        from mnist1d.data import get_dataset_args, make_dataset
        args = get_dataset_args()
        args.num_samples = 12000
        d = make_dataset(args)
        X = np.concatenate([d["x"], d["x_test"]]).astype(np.float32)
        y = np.concatenate([d["y"], d["y_test"]])
        X, ntest = (X - X.mean(0)) / (X.std(0) + 1e-6), 2000
    perm = np.random.default_rng(seed).permutation(len(X))
    X, y = X[perm], y[perm]
    return X[ntest:], y[ntest:], X[:ntest], y[:ntest]


class MLP:
    def __init__(self, n_in: int, rng, hidden=(512, 512), n_out=10):
        sizes = [n_in, *hidden, n_out]
        self.p = {}
        for i in range(len(sizes) - 1):
            self.p[f"W{i}"] = (rng.standard_normal((sizes[i], sizes[i + 1])) * np.sqrt(2 / sizes[i])).astype(np.float32)
            self.p[f"b{i}"] = np.zeros(sizes[i + 1], np.float32)
        self.layers = len(sizes) - 1

    def forward(self, X):
        hs = [X]
        for i in range(self.layers):
            z = hs[-1] @ self.p[f"W{i}"] + self.p[f"b{i}"]
            hs.append(np.maximum(z, 0) if i < self.layers - 1 else z)
        return hs

    def grads(self, X, y):
        hs = self.forward(X)
        z = hs[-1] - hs[-1].max(1, keepdims=True)
        d = np.exp(z)
        d /= d.sum(1, keepdims=True)
        d[np.arange(len(y)), y] -= 1
        d /= len(y)
        g = {}
        for i in reversed(range(self.layers)):
            g[f"W{i}"], g[f"b{i}"] = hs[i].T @ d, d.sum(0)
            if i:
                d = (d @ self.p[f"W{i}"].T) * (hs[i] > 0)
        return g


def solve_probs(w, k):
    """p_i = min(1, A*w_i) with sum p_i = k (exact water-filling; same as the bisection up to tolerance)."""
    pos = w > 0
    if pos.sum() <= k:
        return pos.astype(np.float64)
    ws = np.sort(w)[::-1]
    tail = np.cumsum(ws[::-1])[::-1]
    j = np.arange(len(ws))
    A = (k - j) / np.maximum(tail, 1e-300)
    ok = (A * ws <= 1) & (j < k)
    A = A[np.argmax(ok)]
    return np.minimum(1.0, A * w)


def gamma_w(a, gamma):
    return np.where(a > 0, (a / max(a.max(), 1e-30)) ** gamma, 0.0)


def systematic(p, u):
    c = np.cumsum(p)
    return np.floor(c - u) > np.floor(np.concatenate([[0.0], c[:-1]]) - u)


def block_l1(f, b):
    n = f.size
    m = -(-n // b)
    if n % b:
        f = np.pad(f, (0, m * b - n))
    return np.abs(f).reshape(m, b).sum(1, dtype=np.float64)


def select_blocks(f, rho, b, gamma, rng):
    """Mask of whole blocks: sampled with probability ~ (L1 norm)^gamma (systematic sampling), or the
    top blocks by L1 norm when gamma is inf. Also returns each element's inclusion probability."""
    n = f.size
    m = -(-n // b)
    a = block_l1(f, b)
    k = max(1, round(rho * m))
    if np.isinf(gamma):
        keep = np.zeros(m, bool)
        keep[np.argpartition(a, m - k)[m - k:]] = True
        return np.repeat(keep, b)[:n], np.ones(n)
    w = np.where(a > 0, (a / max(a.max(), 1e-30)) ** gamma, 0.0)
    lo, hi = 0.0, 1.0
    while np.minimum(1, hi * w).sum() < k and hi < 1e30:
        hi *= 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.minimum(1, mid * w).sum() < k else (lo, mid)
    p = np.minimum(1, hi * w)
    c = np.cumsum(p)
    u = rng.random()
    keep = np.floor(c - u) > np.floor(np.concatenate([[0.0], c[:-1]]) - u)
    return np.repeat(keep, b)[:n], np.repeat(p, b)[:n]


def select_blocks_exact(f, rho, b, gamma, rng):
    n = f.size
    m = -(-n // b)
    a = block_l1(f, b)
    k = max(1, round(rho * m))
    if np.isinf(gamma):
        keep = np.zeros(m, bool)
        keep[np.argpartition(a, m - k)[m - k:]] = True
        return np.repeat(keep, b)[:n], np.ones(n)
    p = solve_probs(gamma_w(a, gamma), k)
    keep = systematic(p, rng.random())
    return np.repeat(keep, b)[:n], np.repeat(p, b)[:n]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="dense")
    ap.add_argument("--data", default="mnist1d", choices=["mnist1d", "digits"])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--gamma", type=float, default=1.0, help="inf = top blocks")
    ap.add_argument("--scale-cap", type=float, default=10.0, help="blocks without momentum correction: scale 1/max(p, 1/cap)")
    ap.add_argument("--momentum-correction", action="store_true", help="DGC-style: momentum and accumulation in the codec")
    ap.add_argument("--flush", type=int, default=0, help="marsit: full-precision round every K rounds")
    ap.add_argument("--warmup-epochs", type=float, default=0, help="dense (full-precision) rounds for the first E epochs")
    ap.add_argument("--warmup-rounds", type=int, default=0, help="dense rounds for the first R rounds")
    ap.add_argument("--ramp-epochs", type=float, default=0, help="blocks/topk: density rho^(t/T) over the first E epochs (DGC-style exponential)")
    ap.add_argument("--ef", action="store_true", help="blocks without momentum correction: error feedback, unscaled values")
    ap.add_argument("--no-mask-u", action="store_true", help="momentum correction without momentum-factor masking")
    ap.add_argument("--bscale", default="none", choices=["none", "cap"], help="blocks+MC: value scale (cap = 1/max(p,1/cap), C keeps p - out)")
    ap.add_argument("--mode", default="local", choices=["local", "prev", "age", "coarse"], help="blocks selection: local or shared (prev/age/coarse)")
    ap.add_argument("--eps", type=float, default=0.1, help="shared mode floor: p = (1-eps) p_imp + eps*rho")
    ap.add_argument("--beta", type=float, default=0.9, help="shared prev/age: running-average factor")
    ap.add_argument("--super", type=int, default=1024, help="shared coarse: super-block size")
    ap.add_argument("--scale", default="mean", choices=["mean", "seg", "l2", "proj", "segproj"], help="marsit scale rule")
    ap.add_argument("--scale-factor", type=float, default=1.0, help="marsit: multiply the scale (e.g. 1/sqrt(W)); 0 = 1/sqrt(W)")
    ap.add_argument("--comp", default="global", choices=["global", "local", "mix", "none"], help="marsit compensation")
    ap.add_argument("--alpha", type=float, default=0.5, help="marsit mix: c = p - (alpha*out + (1-alpha)*s_w*sign(p_w))")
    ap.add_argument("--comp-decay", type=float, default=1.0, help="marsit: c *= decay after update")
    ap.add_argument("--mmom", default="local", choices=["local", "global"], help="marsit momentum: local (p = lr*u + c) or global (applied to the result)")
    ap.add_argument("--merge", default="unbiased", choices=["unbiased", "majority"], help="marsit merge (majority = separate biased variant, not 1-bit)")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    accs = [run(a, int(s)) for s in a.seeds.split(",")]
    print(f"RESULT {a.tag or a.method} | workers={a.workers} seeds={a.seeds} | mean {np.mean(accs):.4f} | {[round(x, 4) for x in accs]}", flush=True)


def run(a, seed: int) -> float:
    Xtr, ytr, Xte, yte = load(a.data, seed)
    rng = np.random.default_rng(seed)
    net = MLP(Xtr.shape[1], rng)
    W = a.workers
    shards = [(Xtr[i::W], ytr[i::W]) for i in range(W)]
    zeros = lambda: [{k: np.zeros_like(v) for k, v in net.p.items()} for _ in range(W)]  # noqa: E731
    U, C = zeros(), zeros()  # per-worker momentum, per-worker accumulation / compensation
    vel = {k: np.zeros_like(v) for k, v in net.p.items()}
    codec_momentum = a.momentum_correction or a.method == "marsit"
    steps, t = len(shards[0][0]) // a.batch, 0
    a.steps = steps
    S = {k: {} for k in net.p}  # shared (cluster-identical) per-tensor state
    for _ in range(a.epochs):
        for s in range(steps):
            t += 1
            gs = [net.grads(x[s * a.batch:(s + 1) * a.batch], y[s * a.batch:(s + 1) * a.batch]) for x, y in shards]
            for k in net.p:
                if a.method == "dense" or gs[0][k].size < 1024:
                    upd = sum(g[k] for g in gs) / W
                elif codec_momentum:
                    net.p[k] -= exchange_with_state(a, k, gs, U, C, t, rng, S[k])
                    continue
                elif (t - 1) < a.warmup_rounds or (t - 1) < a.warmup_epochs * steps:
                    upd = sum(g[k] for g in gs) / W
                else:
                    upd = exchange_plain(a, k, gs, C, rng)
                vel[k] = a.momentum * vel[k] + upd
                net.p[k] -= a.lr * vel[k]
    return float((net.forward(Xte)[-1].argmax(1) == yte).mean())


def exchange_plain(a, k, gs, C, rng):
    """Compressors applied to raw gradients; the optimizer's momentum stays outside."""
    outs = []
    for w, g in enumerate(gs):
        f = g[k].ravel()
        if a.method == "topk":  # with error feedback
            f = f + C[w][k].ravel()
            idx = np.argpartition(np.abs(f), f.size - max(1, int(a.density * f.size)))[-max(1, int(a.density * f.size)):]
            out = np.zeros_like(f)
            out[idx] = f[idx]
            C[w][k] = (f - out).reshape(g[k].shape)
        elif a.method == "blocks" and a.ef:  # error feedback, unscaled, optimizer momentum outside
            f = f + C[w][k].ravel()
            mask, _ = select_blocks(f, a.density, a.block, a.gamma, rng)
            out = np.where(mask, f, 0).astype(np.float32)
            C[w][k] = (f - out).reshape(g[k].shape)
        elif a.method == "blocks":  # no memory, bounded inverse-probability scale
            mask, p = select_blocks(f, a.density, a.block, a.gamma, rng)
            out = np.where(mask, f / np.maximum(p, 1 / a.scale_cap), 0).astype(np.float32)
        elif a.method == "efsign":
            f = f + C[w][k].ravel()
            out = np.abs(f).mean() * np.sign(f)
            C[w][k] = (f - out).reshape(g[k].shape)
        else:
            raise SystemExit(f"{a.method} needs --momentum-correction or is unknown")
        outs.append(out.reshape(g[k].shape))
    return sum(outs) / len(outs)


def exchange_with_state(a, k, gs, U, C, t, rng, S):
    """Momentum moved into the codec: returns the model update (already scaled by lr).
    S: cluster-identical per-tensor state (shared-mode statistics, global momentum)."""
    W = len(gs)
    shape = gs[0][k].shape
    glob_mom = a.method == "marsit" and a.mmom == "global"
    ps = []
    for w, g in enumerate(gs):
        if glob_mom:  # p = lr*g + c; momentum applied to the all-reduced result
            ps.append(a.lr * g[k] + C[w][k])
        else:
            U[w][k] = a.momentum * U[w][k] + g[k]
            ps.append(a.lr * U[w][k] + C[w][k])

    def finish(out):
        if glob_mom:
            S["ug"] = a.momentum * S.get("ug", 0) + out
            return S["ug"]
        return out

    warm = (t - 1) < a.warmup_rounds or (t - 1) < a.warmup_epochs * a.steps
    if warm or (a.flush and t % a.flush == 0):  # full-precision round: mean of p, c reset, momentum kept
        for w in range(W):
            C[w][k] = np.zeros_like(ps[w])
        out = sum(ps) / W
        if a.method == "blocks" and a.mode in ("prev", "age"):
            update_shared_stats(a, S, out.ravel(), np.ones(-(-out.size // a.block), bool), t)
        return finish(out)

    if a.method in ("topk", "blocks"):
        rho = a.density
        if a.ramp_epochs:
            T = a.ramp_epochs * a.steps
            rho = max(a.density, a.density ** min(1.0, (t - 1) / T))
        shared_keep = None
        if a.method == "blocks" and a.mode != "local":
            shared_keep = shared_select(a, S, [p.ravel() for p in ps], rho, t, rng)
        sent = []
        for w, p in enumerate(ps):
            f = p.ravel()
            scl = None
            if a.method == "topk":
                kk = max(1, int(rho * f.size))
                mask = np.zeros(f.size, bool)
                mask[np.argpartition(np.abs(f), f.size - kk)[-kk:]] = True
            elif shared_keep is not None:
                mask = shared_keep
            else:
                mask, pe = select_blocks(f, rho, a.block, a.gamma, rng)
                if a.bscale == "cap":
                    scl = 1.0 / np.maximum(pe, 1.0 / a.scale_cap)
            mask = mask.reshape(p.shape)
            out = np.where(mask, p if scl is None else p * scl.reshape(p.shape), 0).astype(np.float32)
            sent.append(out)
            C[w][k] = p - out
            if not a.no_mask_u:
                U[w][k] = np.where(mask, 0, U[w][k])
        res = sum(sent) / W
        if shared_keep is not None and a.mode in ("prev", "age"):
            update_shared_stats(a, S, res.ravel(), block_any(shared_keep, a.block), t)
        return res

    # ---- sign codecs ----
    n = ps[0].size
    flat = [p.ravel() for p in ps]
    segs = np.array_split(np.arange(n), W)
    if a.scale == "mean":
        scale = np.full(n, np.mean([np.abs(f).mean() for f in flat]))
    elif a.scale == "l2":
        scale = np.full(n, np.mean([np.linalg.norm(f) / np.sqrt(n) for f in flat]))
    elif a.scale in ("seg", "segproj"):
        scale = np.empty(n)
        for sg in segs:
            scale[sg] = np.mean([np.abs(f[sg]).mean() for f in flat])
    else:  # proj: fitted after the merge
        scale = None
    fac = a.scale_factor if a.scale_factor > 0 else 1 / np.sqrt(W)
    if a.method == "marsit":
        if a.merge == "majority":
            cnt = sum(np.where(f >= 0, 1, -1) for f in flat)
            tie = flat[0] >= 0
            bits = np.where(cnt == 0, tie, cnt > 0)
        else:  # keep the received bit with probability (j)/(j+1) at hop j (unbiased)
            bits = flat[0] >= 0
            for j in range(1, W):
                bits = np.where(rng.random(n) < j / (j + 1), bits, flat[j] >= 0)
        s = np.where(bits, 1.0, -1.0)
    else:  # signcascade: decompress, add own, re-sign at every hop
        acc = np.sign(flat[0]) * np.abs(flat[0]).mean()
        for j in range(1, W):
            acc = acc + flat[j]
            acc = np.sign(acc) * np.abs(acc).mean()
        s = np.sign(acc)
    if scale is None:  # proj: least-squares fit of mean(p) on the merged signs (one extra scalar all-reduce)
        scale = np.full(n, max(0.0, np.mean([np.dot(f, s) / n for f in flat])))
    if a.scale == "segproj":
        for sg in segs:
            scale[sg] = max(0.0, np.mean([np.dot(f[sg], s[sg]) / len(sg) for f in flat]))
    out = (fac * scale * s).astype(np.float32)
    for w in range(W):
        if a.comp == "global":
            c = flat[w] - out
        elif a.comp == "local":
            c = flat[w] - fac * np.abs(flat[w]).mean() * np.sign(flat[w])
        elif a.comp == "mix":
            c = flat[w] - (a.alpha * out + (1 - a.alpha) * fac * np.abs(flat[w]).mean() * np.sign(flat[w]))
        else:
            c = np.zeros(n)
        C[w][k] = (a.comp_decay * c).astype(np.float32).reshape(shape)
    return finish(out.reshape(shape))


def block_any(mask, b):
    n = mask.size
    m = -(-n // b)
    return np.pad(mask, (0, m * b - n)).reshape(m, b).any(1)


def update_shared_stats(a, S, res, sent_blocks, t):
    """Cluster-identical statistics from the global result (every node holds the same result)."""
    b = a.block
    an = block_l1(res, b)
    m = an.size
    if a.mode == "prev":  # running average of block L1 norms of the global results
        S["r"] = a.beta * S.get("r", np.zeros(m)) + (1 - a.beta) * an
    else:  # age: per-round rate of each block, updated when the block is sent; importance = rate * age
        last = S.setdefault("last", np.zeros(m))
        r = S.setdefault("r", np.zeros(m))
        age = np.maximum(t - last, 1)
        rate = an / age
        r[sent_blocks] = np.where(r[sent_blocks] > 0, a.beta * r[sent_blocks] + (1 - a.beta) * rate[sent_blocks], rate[sent_blocks])
        last[sent_blocks] = t


def shared_select(a, S, flats, rho, t, rng):
    """Same blocks on every node; one shared uniform."""
    b = a.block
    n = flats[0].size
    m = -(-n // b)
    k = max(1, round(rho * m))
    if a.mode == "coarse":  # all-reduced L1 norms of super-blocks of the current round
        sb = a.super
        tot = sum(block_l1(f, sb) for f in flats)
        per = sb // b
        imp = np.repeat(tot, per)[:m]
    elif a.mode == "prev":
        imp = S.get("r", np.zeros(m))
    else:  # age
        r = S.get("r", np.zeros(m))
        imp = r * (t - S.get("last", np.zeros(m)))
    if imp.max() > 0:
        pimp = solve_probs(gamma_w(imp, a.gamma), k) if not np.isinf(a.gamma) else topmask(imp, k)
    else:
        pimp = np.full(m, k / m)
    eps = a.eps if a.mode != "coarse" else a.eps
    p = (1 - eps) * pimp + eps * k / m
    keep = systematic(p, rng.random())
    return np.repeat(keep, b)[:n]


def topmask(imp, k):
    m = imp.size
    p = np.zeros(m)
    p[np.argpartition(imp, m - k)[m - k:]] = 1.0
    return p


if __name__ == "__main__":
    main()
