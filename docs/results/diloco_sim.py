"""Steps a DiLoCo schedule needs to reach a target validation loss, simulated in one process (docs/slowlink.md).

    python docs/results/diloco_sim.py --warm 60 --sched 16                       # 60 averaged steps, then H=16
    python docs/results/diloco_sim.py --sched 1x8,2x8,4x16,8x32,16               # birdnet's default schedule
    python docs/results/diloco_sim.py --sched 1x8,2x8,4x16,8x32,16 --codec signflat --steps 325

The byte-level transformer with AdamW (2 layers, d=128, context 64, 470,784 parameters, text of the
local CPython standard library, batch 16 per worker), 4 workers in one process, no network; every 25
steps the outer parameters are evaluated. --warm W averages gradients every step for the first W steps
(what DDP computes). --sched "H1xS1,...,H": H1 for S1 steps, ..., then H; syncs whose H is below the
last average the parameters (--warm-lr 1, --warm-m 0), later ones step Nesterov SGD (--outer-lr 0.7,
--outer-m 0.9) on the mean pseudo-gradient. --codec compresses each worker's pseudo-gradient with
error feedback before the mean: none, fp16, sign (sign x mean |x| per tensor), signflat (one scale
for the whole model, as marsit on one flat fragment; marsit's merge through the ring is approximated
by the mean of the workers' signs), topk (--density, float32 values), topk2 (top-k with 2-bit values).
--warm-codec: another codec for the syncs before the last H.
The target (--target, default 2.033) is 1.02x the loss that 300 averaged steps reach on 4 workers.
Prints one JSON line: steps_to_target, syncs, the curve.
"""

import argparse
import copy
import glob
import json
import os
import sysconfig
import time

import numpy as np
import torch

torch.set_num_threads(1)
ap = argparse.ArgumentParser()
ap.add_argument("--mode", default="dp")
ap.add_argument("--H", type=int, default=16)
ap.add_argument("--outer-lr", type=float, default=0.7)
ap.add_argument("--outer-m", type=float, default=0.9)
ap.add_argument("--steps", type=int, default=600)
ap.add_argument("--warm", type=int, default=0)
ap.add_argument("--sched", default="")
ap.add_argument("--codec", default="none")
ap.add_argument("--warm-codec", default="")
ap.add_argument("--density", type=float, default=0.02)
ap.add_argument("--warm-lr", type=float, default=1.0)
ap.add_argument("--warm-m", type=float, default=0.0)
ap.add_argument("--target", type=float, default=2.03308)
ap.add_argument("--world", type=int, default=4)
a = ap.parse_args()
torch.manual_seed(0)
files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
text = b"".join(open(f, "rb").read() for f in files)[:3_000_000]
data = torch.tensor(np.frombuffer(text, np.uint8).astype(np.int64))
ntr = int(len(data) * 0.95)
tr, va = data[:ntr], data[ntr:]
C, D = 64, 128


class LM(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = torch.nn.Embedding(256, D)
        s.pos = torch.nn.Parameter(torch.zeros(C, D))
        layer = torch.nn.TransformerEncoderLayer(D, 4, 4 * D, dropout=0.0, batch_first=True, norm_first=True)
        s.enc = torch.nn.TransformerEncoder(layer, 2)
        s.ln = torch.nn.LayerNorm(D)
        s.out = torch.nn.Linear(D, 256)
        s.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(C))

    def forward(s, x):
        return s.out(s.ln(s.enc(s.emb(x) + s.pos, mask=s.mask, is_causal=True)))


def batch(src, gen, bs=16):
    ix = torch.randint(0, len(src) - C - 1, (bs,), generator=gen)
    return torch.stack([src[i : i + C] for i in ix]), torch.stack([src[i + 1 : i + C + 1] for i in ix])


def evaluate(m):
    gv = torch.Generator().manual_seed(7)
    tot = 0.0
    with torch.no_grad():
        for _ in range(20):
            x, y = batch(va, gv, 32)
            tot += float(torch.nn.functional.cross_entropy(m(x).reshape(-1, 256), y.reshape(-1)))
    return tot / 20


W = a.world
gens = [torch.Generator().manual_seed(1000 + r) for r in range(W)]
base = LM()
rec, hit = [], None
t0 = time.time()
# schedule: "H1xS1,H2xS2,...,Hlast": H_i used for S_i steps, last H forever. grad-averaging warm-up via --warm
sched = []
for part in (a.sched or str(a.H)).split(","):
    if "x" in part:
        h, s = part.split("x")
        sched.append((int(h), int(s)))
    else:
        sched.append((int(part), 10**9))


def H_at(k):  # H for a sync starting at local step k (steps after warm)
    acc = 0
    for h, s in sched:
        if k < acc + s:
            return h, (acc + s)
        acc += s
    return sched[-1][0], 10**9


reps = [copy.deepcopy(base) for _ in range(W)]
opts = [torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.01) for m in reps]
outer = [p.detach().clone() for p in base.parameters()]
mom = [torch.zeros_like(p) for p in outer]
ef = [[torch.zeros_like(p) for p in outer] for _ in range(W)]
sent_bits = 0.0
SCALE = [0.0]


def compress(x, e, codec=None):
    codec = codec or a.codec
    if codec == "none":
        return x.clone()
    y = x + e
    if codec == "fp16":
        q = y.half().float()
    elif codec == "sign":
        q = torch.sign(y) * y.abs().mean()
    elif codec == "signflat":
        q = torch.sign(y) * SCALE[0]
    elif codec == "topk":
        k = max(1, int(a.density * y.numel()))
        f = y.flatten()
        idx = f.abs().topk(k).indices
        q = torch.zeros_like(f)
        q[idx] = f[idx]
        q = q.view_as(y)
    elif codec == "topk2":  # top-k with 2-bit values (sign * per-tensor mean |kept|, SparseLoCo-like)
        k = max(1, int(a.density * y.numel()))
        f = y.flatten()
        idx = f.abs().topk(k).indices
        v = f[idx]
        lv = v.abs()
        s = lv.mean()
        qv = torch.sign(v) * torch.where(lv > s, 1.5 * s, 0.5 * s)
        q = torch.zeros_like(f)
        q[idx] = qv
        q = q.view_as(y)
    e.copy_(y - q)
    return q


next_sync = None
cur_H = None
last = a.warm
nsync = 0
for step in range(1, a.steps + 1):
    for r in range(W):
        x, y = batch(tr, gens[r])
        opts[r].zero_grad()
        torch.nn.functional.cross_entropy(reps[r](x).reshape(-1, 256), y.reshape(-1)).backward()
    if step <= a.warm:
        for ps in zip(*[m.parameters() for m in reps]):
            gm = sum(p.grad for p in ps) / W
            for p in ps:
                p.grad = gm.clone()
    for o in opts:
        o.step()
    if step <= a.warm:
        with torch.no_grad():
            for po, pr in zip(outer, reps[0].parameters()):
                po.copy_(pr)
        continue
    k = step - a.warm
    h, _ = H_at(last - a.warm)
    if k - (last - a.warm) >= h:
        lr, m = (a.outer_lr, a.outer_m) if h >= sched[-1][0] else (a.warm_lr, a.warm_m)
        cod = a.warm_codec if (a.warm_codec and h < sched[-1][0]) else a.codec
        with torch.no_grad():
            if cod == "signflat":  # one scale for the whole model per worker (birdnet marsit on one flat fragment)
                scales = []
                for r in range(W):
                    tot = sum(float((po - p + e).abs().sum()) for po, p, e in zip(outer, reps[r].parameters(), ef[r]))
                    scales.append(tot / sum(po.numel() for po in outer))
            for i, po in enumerate(outer):
                d = 0
                for r in range(W):
                    if cod == "signflat":
                        SCALE[0] = scales[r]
                    d = d + compress(po - list(reps[r].parameters())[i], ef[r][i], cod)
                d = d / W
                if m > 0:
                    mom[i].mul_(m).add_(d)
                    upd = d + m * mom[i]
                else:
                    upd = d
                po.sub_(lr * upd)
            for mm in reps:
                for po, p in zip(outer, mm.parameters()):
                    p.copy_(po)
        last = step
        nsync += 1
    if step % 25 == 0:
        with torch.no_grad():
            for po, p in zip(outer, base.parameters()):
                p.copy_(po)
        v = evaluate(base)
        rec.append((step, v))
        if hit is None and v <= a.target:
            hit = step
print(
    json.dumps(
        {
            "sched": a.sched,
            "codec": a.codec,
            "warm_codec": a.warm_codec,
            "density": a.density,
            "outer_lr": a.outer_lr,
            "outer_m": a.outer_m,
            "warm": a.warm,
            "warm_lr": a.warm_lr,
            "warm_m": a.warm_m,
            "syncs": nsync,
            "steps_to_target": hit,
            "curve": [(s, round(v, 4)) for s, v in rec],
            "wall_s": round(time.time() - t0),
        }
    )
)
