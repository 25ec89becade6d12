"""What the two digit examples (train_torch_cnn.py, train_torch_ddp.py) share: the data, the model,
the training loop, the command line and the closing report. Each example says only how its
gradients travel."""
from __future__ import annotations

import argparse
import time


def add_arguments(p: argparse.ArgumentParser, job: str, epochs: int) -> None:
    p.add_argument("--nodes", type=int, default=2, help="daemons of the local demo cluster (default 2)")
    p.add_argument("--local-size", type=int, default=1, help="training processes per node")
    p.add_argument("--socket", help="use the running daemon at this socket instead of a demo cluster")
    p.add_argument("--job", default=job)
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--batch", type=int, default=64, help="global batch, split over the processes")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)


def make_model():
    import torch
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def load():
    """scikit-learn's 8x8 digits as tensors: (x_train, y_train, x_test, y_test), the same split everywhere."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    return tuple(map(torch.from_numpy, (xtr, ytr, xte, yte)))


def fit(model, opt, cfg: dict, rank: int, size: int, after_step=None, recover=None) -> tuple[list[float], float]:
    """``cfg["epochs"]`` epochs, each process on its shard of every global batch (the same
    permutation on every process), the test accuracy after each; ``after_step()`` runs after every
    optimizer step. A step whose all-reduce failed (a lost or stopped node: it fails on every process
    alike) runs ``recover()`` (``bnt.recover``: identical replicas again) and skips its batch.
    Returns (accuracies, seconds)."""
    import torch

    from birdnet.errors import PeerLostError, RoundTimeoutError

    xtr, ytr, xte, yte = load()
    gen = torch.Generator().manual_seed(cfg["seed"])
    per = cfg["batch"] // size
    history = []
    t0 = time.perf_counter()
    for epoch in range(cfg["epochs"]):
        model.train()
        perm = torch.randperm(len(xtr), generator=gen)
        for start in range(0, len(perm) - cfg["batch"] + 1, cfg["batch"]):
            idx = perm[start + rank * per: start + (rank + 1) * per]
            opt.zero_grad()
            try:
                torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
                opt.step()
            except (PeerLostError, RoundTimeoutError) as exc:
                if recover is None:
                    raise
                print(f"rank {rank}: step failed ({exc}); recovering", flush=True)
                recover()
                continue
            if after_step is not None:
                after_step()
        model.eval()
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        history.append(acc)
        if rank == 0 and cfg["progress"]:
            print(f"epoch {epoch + 1:>3}/{cfg['epochs']}  test accuracy {acc:.3f}", flush=True)
    return history, time.perf_counter() - t0


def digest(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def report(res: list[dict], details) -> int:
    """Rank 0's final accuracy (and ``details(r0)``); with several processes, 1 unless every one
    ended with the same parameters."""
    res.sort(key=lambda r: r["rank"])
    r0 = res[0]
    print(f"final test accuracy {r0['accuracy'][-1]:.3f} after {len(r0['accuracy'])} epochs, "
          f"{r0['seconds']:.1f} s{details(r0)}")
    if len(res) > 1:
        same = len({r["param_digest"] for r in res}) == 1
        print("parameters identical on every process" if same else "WARNING: parameters differ between processes")
        return 0 if same else 1
    return 0
