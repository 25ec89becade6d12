"""How close can a sparsifier at a given density come to dense AdamW on the ``lm`` task?
(docs/adapters.md, "Where the transformer's gap came from"; docs/benchmarks.md)

    python -m birdnet.bench.tools.sparse_oracle --mode dense --seed 0
    python -m birdnet.bench.tools.sparse_oracle --mode codec --codec birdplus:density=0.01:cap=30 --seed 0
    python -m birdnet.bench.tools.sparse_oracle --mode oracle --density 0.04 --seed 0
    python -m birdnet.bench.tools.sparse_oracle --mode oracle --density 0.01 --sample-gamma 16 --cap 10 --seed 0

One process, no daemons: the ``lm`` task of ``birdnet bench train`` (the same model, data, seed,
batches of 4 workers x 16, 400 steps), each worker's gradient computed in turn on one copy of the
model (every node's copy is identical in the real run). The first ``--warmup`` steps (32: where the
automatic warm-up ends on this task) run torch's AdamW on the averaged gradient; then Adam's recipe
for a selecting codec (client/_torch_recipes.py): the variance frozen and refreshed at the
same steps, the gradient in preconditioned units (divided by the frozen denominator), Adam's first
moment on the average, AdamW's decoupled weight decay. What travels:

``codec``   each worker's gradient through a birdnet codec in process (its own error-feedback
            state per worker, the payloads summed in rank order as the daemons' gathered rounds
            do): reproduces the real benchmark (birdplus density 0.01, seed 0: 1.859 here, 1.845
            through 4 daemons; dense 1.658 against 1.657; a run moves by about 0.01-0.02 with
            the last bits of the arithmetic, which the daemons' ring sums in another order).
``oracle``  no codec: one error-feedback accumulator of the *averaged* gradient, of which the
            exact top ``density`` fraction of elements by magnitude is applied each step, the
            rest kept for later. A selection as good as a shared selection can be (it sees the
            sum of every worker's residual, element by element, with no block or index cost),
            at any density: what a shared (summable) codec at that density can approach, not
            pass. A gathered codec's N selections move up to N times as many coordinates a
            step, which is why birdplus at 0.01 lands between the 1 % and the 4 % oracle.
            With ``--sample-gamma G`` the oracle draws blocks of 8 as birdplus does instead
            (p ~ (block norm)^G, capped 1/p scale ``--cap``): on MNIST-1D that draw beat the exact
            top (docs/research/findings.md), here it does not (1.927 against 1.889, seeds 0-2).

Prints the validation loss every 100 steps and a JSON line at the end. A measuring tool, not part
of birdnet; 2 shared cores: about 3.5 minutes for dense or oracle, 7 for codec (two at a time).
"""
import argparse
import json
import time

import numpy as np
import torch

from birdnet.bench.specs import parse_spec
from birdnet.bench.torchtasks import make_task
from birdnet.client._torch_recipes import ADAM_REFRESH_STEPS
from birdnet.codecs import get_codec
from birdnet.codecs.base import RoundContext, begin_round, commit_round


def refresh_steps(warmup: int, steps: int) -> set[int]:
    """The steps whose averaged gradient refreshes the frozen variance (the recipe's policy)."""
    out, j = set(), 1
    while ADAM_REFRESH_STEPS and warmup + ADAM_REFRESH_STEPS * (2 ** j - 1) < steps:
        out.add(warmup + ADAM_REFRESH_STEPS * (2 ** j - 1))
        j += 1
    return out


def sampled_blocks(acc: torch.Tensor, density: float, gamma: float, cap: float,
                   gen: torch.Generator, b: int = 8) -> torch.Tensor:
    """``--sample-gamma``: blocks of ``b`` drawn as birdplus draws them, from the L1 norms of the
    accumulator (p = min(1, A (norm / max)^gamma), density x blocks expected, one systematic walk),
    each sent block scaled by 1 / max(p, 1 / cap); the accumulator keeps what was not sent (a
    scaled block overshoots, and error feedback gives the overshoot back)."""
    n = acc.numel()
    nb = -(-n // b)
    pad = torch.zeros(nb * b)
    pad[:n] = acc
    norms = pad.view(nb, b).abs().sum(1).double()
    w = (norms / norms.max()) ** gamma if norms.max() > 0 else torch.ones(nb, dtype=torch.float64)
    k = max(1.0, density * nb)
    lo, hi = 0.0, 1.0
    while torch.clamp(hi * w, max=1.0).sum() < k and hi < 1e300:
        hi *= 2
    for _ in range(100):  # water filling: sum of min(1, A w) = k
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if torch.clamp(mid * w, max=1.0).sum() < k else (lo, mid)
    p = torch.clamp(hi * w, max=1.0)
    c = torch.cumsum(p, 0)
    u0 = float(torch.rand(1, generator=gen, dtype=torch.float64))
    blocks = torch.unique(torch.searchsorted(c, u0 + torch.arange(int(np.ceil(float(c[-1]) - u0)), dtype=torch.float64)))
    blocks = blocks[blocks < nb]
    scale = (1.0 / torch.clamp(p[blocks], min=1.0 / cap)).float()
    sent = torch.zeros(nb, b)
    sent[blocks] = pad.view(nb, b)[blocks] * scale[:, None]
    result = sent.view(-1)[:n].clone()
    acc -= result
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("dense", "codec", "oracle"), default="oracle")
    ap.add_argument("--codec", default="birdplus:density=0.01:cap=30")
    ap.add_argument("--density", type=float, default=0.01, help="oracle: fraction of elements applied per step")
    ap.add_argument("--sample-gamma", type=float, default=0.0,
                    help="oracle: blocks of 8 sampled as birdplus samples them, with this gamma (0: exact top)")
    ap.add_argument("--cap", type=float, default=10.0, help="oracle with --sample-gamma: the 1/p scale's cap")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--world", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    task = make_task("lm", a.seed)
    torch.manual_seed(a.seed)
    gen = torch.Generator().manual_seed(1000 + a.seed)  # the oracle's sampling only
    model = task.model()
    opt = task.optimizer(model.parameters(), task.lr)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    g0 = opt.param_groups[0]
    (b1, b2), eps, wd, lr = g0["betas"], g0["eps"], g0["weight_decay"], task.lr
    name, cparams = parse_spec(a.codec)
    codec = get_codec(name, **cparams) if a.mode == "codec" else None
    states = [codec.new_state(n) if codec else None for _ in range(a.world)]
    refresh = refresh_steps(a.warmup, a.steps)
    hist, sent, t0 = [], 0, time.time()
    denom = m = v = acc = None
    v_step = 0

    def flat(ts):
        return torch.cat([t.reshape(-1) for t in ts])

    for step in range(a.steps):
        grads = []
        for r in range(a.world):
            x, y = task.batch(r, a.world, step)
            model.zero_grad()
            task.loss(model, x, y).backward()
            grads.append(flat([p.grad for p in params]).clone())
        avg = sum(grads) / a.world
        if a.mode == "dense" or step < a.warmup:
            o = 0
            for p in params:
                p.grad = avg[o:o + p.numel()].view_as(p).clone()
                o += p.numel()
            opt.step()
        else:
            if denom is None:  # the switch: the variance freezes, the first moment is bias-corrected
                v_step = int(float(opt.state[params[0]]["step"]))
                v = flat([opt.state[p]["exp_avg_sq"] for p in params]).clone()
                m = flat([opt.state[p]["exp_avg"] for p in params]) / (1 - b1 ** v_step)
                denom = (v / (1 - b2 ** v_step)).sqrt() + eps
                acc = torch.zeros(n)
            if step in refresh:  # v = b2**k v + (1 - b2**k) g**2 over the k steps since the last
                k = step + 1 - v_step
                v = b2 ** k * v + (1 - b2 ** k) * avg * avg
                v_step = step + 1
                denom = (v / (1 - b2 ** v_step)).sqrt() + eps
            if a.mode == "codec":
                payloads, txns = [], []
                for r in range(a.world):
                    ctx = RoundContext("sim", "bucket", (n,), step, r, a.world, 1 + step, tensor_round=step)
                    txn = begin_round(states[r])
                    payloads.append(codec.compress(np.ascontiguousarray((grads[r] / denom).numpy()), ctx, txn))
                    txns.append(txn)
                    sent += payloads[-1].nbytes
                out = np.zeros(n, np.float32)
                codec.decompress_sum(payloads, out, RoundContext("sim", "bucket", (n,), step, 0, a.world, 1 + step,
                                                                 tensor_round=step), divide_by=a.world)
                for txn in txns:
                    commit_round(txn)
                result = torch.from_numpy(out)
            else:
                acc += avg / denom
                if a.sample_gamma:
                    result = sampled_blocks(acc, a.density, a.sample_gamma, a.cap, gen)
                else:
                    idx = acc.abs().topk(max(1, int(a.density * n))).indices
                    result = torch.zeros(n)
                    result[idx] = acc[idx]
                    acc[idx] = 0.0
            m = b1 * m + (1 - b1) * (result * denom)
            with torch.no_grad():
                o = 0
                for p in params:
                    size = p.numel()
                    p.mul_(1 - lr * wd).add_((m[o:o + size] / denom[o:o + size]).view_as(p), alpha=-lr)
                    o += size
        if (step + 1) % 100 == 0 or step + 1 == a.steps:
            hist.append((step + 1, round(task.evaluate(model)["val_loss"], 4)))
            print(*hist[-1], f"{time.time() - t0:.0f} s", flush=True)
    print(json.dumps({"mode": a.mode, "codec": a.codec if codec else None,
                      "density": a.density if a.mode == "oracle" else None,
                      "sample_gamma": a.sample_gamma or None, "cap": a.cap if a.sample_gamma else None, "seed": a.seed,
                      "warmup": a.warmup, "val_loss": hist[-1][1], "history": hist,
                      "codec_bytes_per_worker": sent // a.world}))


if __name__ == "__main__":
    main()
