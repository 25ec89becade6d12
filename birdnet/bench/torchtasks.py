"""PyTorch training tasks for the benchmarks (``birdnet bench train --task cnn|lm``), reusable by
other benchmarks (e.g. the same task under torch.distributed).

Both tasks run offline, with no download at run time:

``cnn``
    scikit-learn's 8x8 handwritten digits upsampled (bilinear) to 16x16, a 2-conv CNN (38,282
    parameters), momentum SGD; metric: test accuracy on the 397 images the seed holds out (one image
    is 0.25 points; the binomial standard error of one evaluation near 98% is about 0.7 points).
``lm``
    a byte-level causal transformer (2 layers, d=128, 4 heads, context 64, about 430k parameters)
    on a fixed list of Python standard library source files (text shipped with every Python),
    AdamW; metric: validation loss in nats per byte.

:func:`make_task` returns a :class:`Task`: a model factory, the batch a rank trains on at a step,
the evaluation, and the default steps, learning rate and optimizer. Every rank of a run builds the
same task from the same seed; :func:`Task.batch` gives each rank its own shard of a global batch.
:func:`train_worker` is one training process through ``birdnet.client.torch.DistributedOptimizer``
(what ``birdnet bench train`` runs on each daemon of a local cluster).
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

TASKS = ("cnn", "lm")

#: standard-library modules whose source is the language model's corpus (about 0.9 MB; fixed so a
#: run reads the same bytes on every rank; sizes differ a little between Python versions)
LM_MODULES = ("argparse", "difflib", "inspect", "textwrap", "pydoc", "typing", "dataclasses",
              "functools", "pathlib", "subprocess")
CONTEXT = 64


@dataclasses.dataclass(frozen=True)
class Task:
    """One training task; everything derived from ``seed`` is identical on every rank."""

    name: str
    seed: int
    #: a fresh model (call ``torch.manual_seed`` first for a given initialisation)
    model: Callable[[], Any]
    #: ``batch(rank, world, step) -> (x, y)``: this rank's shard of the global batch of ``step``
    batch: Callable[[int, int, int], tuple[Any, Any]]
    #: ``loss(model, x, y) -> scalar tensor`` (the training loss)
    loss: Callable[[Any, Any, Any], Any]
    #: ``evaluate(model) -> {"metric": float, ...}`` on held-out data
    evaluate: Callable[[Any], dict[str, float]]
    #: ``optimizer(params, lr) -> torch.optim.Optimizer`` with the task's hyper-parameters
    optimizer: Callable[[Any, float], Any]
    steps: int
    lr: float
    metric: str  #: "accuracy" (higher is better) or "val_loss" (lower is better)
    batch_per_rank: int

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "accuracy"


def make_task(name: str, seed: int = 0, *, batch_per_rank: int | None = None) -> Task:
    """The task ``name`` ("cnn" or "lm") for ``seed`` (the data split and the batch order)."""
    if name == "cnn":
        return _cnn(seed, batch_per_rank or 32)
    if name == "lm":
        return _lm(seed, batch_per_rank or 16)
    raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")


# -- cnn ------------------------------------------------------------------------------------------
def digits16(seed: int):
    """(x_train, y_train, x_test, y_test): digits upsampled to 1x16x16 float32, 1400 / 397 split."""
    import torch
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x = torch.from_numpy((x / 16.0).astype(np.float32)).reshape(-1, 1, 8, 8)
    x = torch.nn.functional.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False)
    x = (x - 0.3) / 0.4
    perm = np.random.default_rng(seed).permutation(len(x))
    x, y = x[perm], torch.from_numpy(y[perm].astype(np.int64))
    return x[397:], y[397:], x[:397], y[:397]


def cnn_model():
    import torch
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),              # 16 x 8 x 8
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),             # 32 x 4 x 4
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def _cnn(seed: int, per: int) -> Task:
    import torch
    xtr, ytr, xte, yte = digits16(seed)

    def batch(rank: int, world: int, step: int):
        # the global batch of a step is drawn from (seed, step) alone: the same on every rank
        g = np.random.default_rng([seed, step])
        idx = torch.from_numpy(g.choice(len(xtr), per * world, replace=False))
        mine = idx[rank * per:(rank + 1) * per]
        return xtr[mine], ytr[mine]

    def loss(model, x, y):
        return torch.nn.functional.cross_entropy(model(x), y)

    def evaluate(model):
        model.eval()
        with torch.no_grad():
            out = model(xte)
            acc = float((out.argmax(1) == yte).float().mean())
            val = float(torch.nn.functional.cross_entropy(out, yte))
        model.train()
        # test_images: what the accuracy's binomial standard error needs (birdnet bench tta reports it)
        return {"accuracy": acc, "val_loss": val, "test_images": len(yte)}

    def optimizer(params, lr):
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)

    return Task("cnn", seed, cnn_model, batch, loss, evaluate, optimizer, steps=300, lr=0.05,
                metric="accuracy", batch_per_rank=per)


# -- lm -------------------------------------------------------------------------------------------
def corpus() -> bytes:
    """The language model's text: the sources of :data:`LM_MODULES`, concatenated."""
    import importlib
    import inspect
    parts = []
    for m in LM_MODULES:
        path = inspect.getsourcefile(importlib.import_module(m))
        with open(path, "rb") as f:
            parts.append(f.read())
    return b"\n".join(parts)


class TinyLM:
    """Factory of the causal transformer: byte embedding + learned positions, ``layers``
    pre-norm encoder layers with a causal mask, a final LayerNorm and an untied byte head."""

    def __new__(cls, d: int = 128, layers: int = 2, heads: int = 4, context: int = CONTEXT):
        import torch
        nn = torch.nn

        class LM(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.tok = nn.Embedding(256, d)
                self.pos = nn.Embedding(context, d)
                layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                                   norm_first=True)
                self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
                self.norm = nn.LayerNorm(d)
                self.head = nn.Linear(d, 256)
                self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context),
                                     persistent=False)

            def forward(self, x):
                t = x.shape[1]
                h = self.tok(x) + self.pos.weight[:t]
                h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
                return self.head(self.norm(h))

        return LM()


def _lm(seed: int, per: int) -> Task:
    import torch
    data = torch.from_numpy(np.frombuffer(corpus(), np.uint8).astype(np.int64))
    cut = int(len(data) * 0.9)
    train, val = data[:cut], data[cut:]
    # a fixed validation set: 128 windows evenly spaced over the held-out tail
    starts = np.linspace(0, len(val) - CONTEXT - 2, 128).astype(np.int64)
    vx = torch.stack([val[s:s + CONTEXT] for s in starts])
    vy = torch.stack([val[s + 1:s + CONTEXT + 1] for s in starts])

    def batch(rank: int, world: int, step: int):
        g = np.random.default_rng([seed, step])
        starts = g.integers(0, len(train) - CONTEXT - 1, per * world)[rank * per:(rank + 1) * per]
        x = torch.stack([train[s:s + CONTEXT] for s in starts])
        y = torch.stack([train[s + 1:s + CONTEXT + 1] for s in starts])
        return x, y

    def loss(model, x, y):
        return torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))

    def evaluate(model):
        model.eval()
        with torch.no_grad():
            val_loss = float(loss(model, vx, vy))
        model.train()
        return {"val_loss": val_loss}

    def optimizer(params, lr):
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.01)

    return Task("lm", seed, TinyLM, batch, loss, evaluate, optimizer, steps=400, lr=2e-3,
                metric="val_loss", batch_per_rank=per)


# -- one training process -------------------------------------------------------------------------
def train_steps(task: Task, net: Any, opt: Any, rank: int, world: int, steps: int, eval_every: int, *,
                evaluate: Callable[[], dict[str, Any]], after_step: Callable[[], None] | None = None
                ) -> tuple[list[dict[str, Any]], list[float]]:
    """``steps`` training steps of ``task`` on this rank's shard of each global batch: the loop the
    distributed benchmarks time (``birdnet bench tta``, ``python -m birdnet.bench.ddp``).

    ``net`` is what computes the loss (the model, or DDP around it), ``opt`` the optimizer (torch's
    or a birdnet wrapper). Only the step itself is timed: the batch, ``zero_grad``, forward, backward
    and ``opt.step()``. Every ``eval_every`` steps and after the last, ``evaluate()`` (its clock paused)
    adds its fields to a history entry with ``step``, ``seconds`` (training seconds so far) and
    ``train_loss`` (the mean since the previous entry); ``after_step()`` runs, untimed, after each step
    (e.g. to read byte counters). Returns ``(history, step_times)``.
    """
    history: list[dict[str, Any]] = []
    step_times: list[float] = []
    train_s, loss_sum, loss_n = 0.0, 0.0, 0
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = task.batch(rank, world, step)
        opt.zero_grad()
        loss = task.loss(net, x, y)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        # outside the clock: the hook and the running loss (a .item() waits for nothing on CPU)
        step_times.append(dt)
        train_s += dt
        if after_step is not None:
            after_step()
        loss_sum, loss_n = loss_sum + float(loss.detach()), loss_n + 1
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            history.append({"step": step + 1, "seconds": train_s, "train_loss": loss_sum / loss_n, **evaluate()})
            loss_sum, loss_n = 0.0, 0
    return history, step_times


def params_digest(model) -> str:
    """sha256 over every parameter and buffer, in state_dict order (bit-identity across ranks)."""
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train_worker(sock: str, node: int, local: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One training process on a daemon. ``cfg``: task, seed, steps, lr, codec, params, job,
    eval_every, and optionally adapter (extra DistributedOptimizer keywords), batch_per_rank and
    restore_at (a step before which the optimizer goes through ``state_dict()`` into a fresh
    DistributedOptimizer, as a restart from a checkpoint would).
    Returns the history (step, train loss, the task's metrics, bytes sent so far), bytes sent
    during and after the uncompressed warm-up, and a digest of the final parameters."""
    import torch

    import birdnet.client.torch as bnt
    from birdnet.client import Client

    torch.set_num_threads(1)
    task = make_task(cfg["task"], cfg["seed"], batch_per_rank=cfg.get("batch_per_rank"))
    steps, lr = int(cfg.get("steps") or task.steps), float(cfg.get("lr") or task.lr)
    every = int(cfg.get("eval_every") or max(1, steps // 10))
    t0 = time.perf_counter()
    with Client(sock, job=cfg.get("job", f"train-{task.name}")) as client:
        torch.manual_seed(cfg["seed"])
        model = task.model()

        def wrapped():
            return bnt.DistributedOptimizer(task.optimizer(model.parameters(), lr),
                                            named_parameters=model.named_parameters(), client=client,
                                            codec=cfg.get("codec"), codec_params=cfg.get("params") or None,
                                            timeout=600, **dict(cfg.get("adapter") or {}))

        opt = wrapped()
        bnt.broadcast_parameters(model.state_dict(), root_rank=0, client=client)
        history: list[dict[str, Any]] = []
        sent = warm_sent = 0
        after: dict[str, int] = {}  # bytes sent after the warm-up, by kind of round
        loss_sum, loss_n = 0.0, 0
        for step in range(steps):
            if step == cfg.get("restore_at"):
                saved = opt.state_dict()
                opt.remove_hooks()
                opt = wrapped()
                opt.load_state_dict(saved)
            x, y = task.batch(client.rank, client.size, step)
            opt.zero_grad()
            loss = task.loss(model, x, y)
            loss.backward()
            opt.step()
            nb = sum(int(s.get("bytes_sent", 0)) for s in opt.last_stats)
            sent += nb
            if getattr(opt, "birdnet_warming_up", False):
                warm_sent += nb
            else:
                for s in opt.last_stats:
                    kind = ("refresh" if str(s.get("name", "")).startswith("var") else
                            "dense" if s.get("codec") in (None, "none", "fp16") else "coded")
                    after[kind] = after.get(kind, 0) + int(s.get("bytes_sent", 0))
            loss_sum, loss_n = loss_sum + loss.item(), loss_n + 1
            if (step + 1) % every == 0 or step + 1 == steps:
                history.append({"step": step + 1, "train_loss": loss_sum / loss_n, "bytes_sent": sent,
                                **task.evaluate(model), "seconds": time.perf_counter() - t0})
                loss_sum, loss_n = 0.0, 0
        warm = getattr(opt, "birdnet_warmup_steps", 0)
        return {"rank": client.rank, "history": history, "final": history[-1], "bytes_sent": sent,
                "warmup_steps": warm, "warmup_bytes": warm_sent, "bytes_after_warmup_by_kind": after,
                "seconds": time.perf_counter() - t0,
                "params_digest": params_digest(model)}
