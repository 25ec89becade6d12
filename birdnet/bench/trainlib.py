"""Data-parallel training of a small NumPy MLP through real birdnet daemons (the demo and
``birdnet bench train``).

Each worker process holds the whole model, trains on its shard (rank::size) and averages every
gradient tensor through its daemon with ``client.allreduce_async`` (all tensors of a step in
flight at once). Optimizer: momentum SGD; for codecs that carry the momentum themselves
(momentum correction, ``momentum=...`` codec parameter) the worker applies plain SGD to the
tensors that went through such a codec, as docs/codecs.md explains.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

#: codecs with a ``momentum`` parameter, which can carry SGD's momentum themselves (momentum
#: correction; the PyTorch adapter's MOMENTUM_CODECS). Named here rather than read from the codec
#: classes, whose modules compile Numba kernels at import; tests/test_demo.py checks the two agree.
MOMENTUM_CODECS = frozenset({"marsit", "signcascade", "topk", "dgc", "randomk", "efsign", "bird", "birdplus"})


def recipe(codec: str | None, params: dict[str, Any], momentum: float) -> dict[str, Any]:
    """``params`` with the SGD recipe of the NumPy path: a codec with a momentum parameter carries
    the momentum (``momentum`` added unless given; :func:`train_worker` then applies plain SGD to
    its result), as the PyTorch adapter arranges for ``torch.optim.SGD``. A ``momentum`` of 0 given
    in ``params`` keeps the momentum in the workers, on the decompressed average."""
    if codec in (None, "none") or codec not in MOMENTUM_CODECS or not momentum:
        return dict(params)
    return {**params, "momentum": params.get("momentum", momentum)}


def one_thread_per_worker() -> None:
    """All workers and daemons of a local cluster share this machine's cores: keep each worker's
    BLAS to one thread (inherited by the spawned workers) instead of oversubscribing the cores."""
    import os
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")


def load(data: str, seed: int):
    """(X_train, y_train, X_test, y_test) float32/int; both sets are generated or shipped offline."""
    if data == "digits":
        from sklearn.datasets import load_digits
        X, y = load_digits(return_X_y=True)
        X, ntest = (X / 16.0).astype(np.float32), 397
    elif data == "mnist1d":
        from mnist1d.data import get_dataset_args, make_dataset
        args = get_dataset_args()
        args.num_samples = 12000
        d = make_dataset(args)
        X = np.concatenate([d["x"], d["x_test"]]).astype(np.float32)
        y = np.concatenate([d["y"], d["y_test"]])
        X, ntest = (X - X.mean(0)) / (X.std(0) + 1e-6), 2000
    else:
        raise ValueError(f"unknown data set {data!r}; use 'digits' or 'mnist1d'")
    perm = np.random.default_rng(seed).permutation(len(X))
    X, y = X[perm], y[perm]
    return X[ntest:], y[ntest:].astype(np.int64), X[:ntest], y[:ntest].astype(np.int64)


class MLP:
    """ReLU MLP with softmax cross-entropy; parameters in a dict of float32 arrays."""

    def __init__(self, n_in: int, rng, hidden=(512, 512), n_out: int = 10) -> None:
        sizes = [n_in, *hidden, n_out]
        self.p: dict[str, np.ndarray] = {}
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

    def loss_acc(self, X, y) -> tuple[float, float]:
        z = self.forward(X)[-1]
        z = z - z.max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        return float(-logp[np.arange(len(y)), y].mean()), float((z.argmax(1) == y).mean())

    def grads(self, X, y) -> dict[str, np.ndarray]:
        hs = self.forward(X)
        z = hs[-1] - hs[-1].max(1, keepdims=True)
        d = np.exp(z)
        d /= d.sum(1, keepdims=True)
        d[np.arange(len(y)), y] -= 1
        d /= len(y)
        g = {}
        for i in reversed(range(self.layers)):
            g[f"W{i}"], g[f"b{i}"] = (hs[i].T @ d).astype(np.float32), d.sum(0).astype(np.float32)
            if i:
                d = (d @ self.p[f"W{i}"].T) * (hs[i] > 0)
        return g


def train_worker(sock: str, node: int, local: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One training process. ``cfg``: data, seed, epochs, lr, momentum, batch, hidden, codec,
    params, job, progress (a multiprocessing queue or None)."""
    from birdnet.client import Client

    # the parent may have generated the data set once for all workers
    Xtr, ytr, Xte, yte = cfg["arrays"] if cfg.get("arrays") is not None else load(cfg["data"], cfg["seed"])
    t0 = time.perf_counter()
    with Client(sock, job=cfg.get("job", "train")) as c:
        net = MLP(Xtr.shape[1], np.random.default_rng(cfg["seed"] + 1000 * c.rank), tuple(cfg.get("hidden", (512, 512))))
        for k in sorted(net.p):  # everyone starts from rank 0's parameters
            net.p[k] = c.broadcast(net.p[k], root=0, name=f"init/{k}")
        X, y = Xtr[c.rank::c.size], ytr[c.rank::c.size]
        batch, lr, mom = cfg["batch"], cfg["lr"], cfg["momentum"]
        steps = len(X) // batch
        vel = {k: np.zeros_like(v) for k, v in net.p.items()}
        codec = cfg.get("codec")
        params = dict(cfg.get("params") or {})
        history, bytes_sent, comm_s = [], 0, 0.0
        order = np.random.default_rng(cfg["seed"] + c.rank)
        for epoch in range(cfg["epochs"]):
            perm = order.permutation(len(X))
            for s in range(steps):
                idx = perm[s * batch:(s + 1) * batch]
                g = net.grads(X[idx], y[idx])
                tc = time.perf_counter()
                handles = {k: c.allreduce_async(g[k], name=k, codec=codec, **params) for k in g}
                for k, h in handles.items():
                    upd = h.wait(600)
                    bytes_sent += int(h.stats.get("bytes_sent", 0))
                    if h.stats.get("codec") not in (None, "none") and params.get("momentum"):
                        net.p[k] -= lr * upd  # the codec applied the momentum already
                    else:
                        vel[k] = mom * vel[k] + upd
                        net.p[k] -= lr * vel[k]
                comm_s += time.perf_counter() - tc
            loss, acc = net.loss_acc(Xte, yte)
            history.append({"epoch": epoch + 1, "acc": acc, "loss": loss, "bytes_sent": bytes_sent,
                            "seconds": time.perf_counter() - t0})
            q = cfg.get("progress")
            if q is not None and c.rank == 0:
                q.put(history[-1])
        digest = __import__("hashlib").sha256(b"".join(net.p[k].tobytes() for k in sorted(net.p))).hexdigest()
        return {"rank": c.rank, "history": history, "acc": history[-1]["acc"] if history else None,
                "loss": history[-1]["loss"] if history else None, "bytes_sent": bytes_sent,
                "seconds": time.perf_counter() - t0, "comm_seconds": comm_s, "params_digest": digest}
