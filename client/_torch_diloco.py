"""``birdnet.client.torch.DiLoCo``: the slow-link mode (birdnet.client.diloco) for a PyTorch optimizer.

Example::

    opt = bnt.DiLoCo(torch.optim.AdamW(model.parameters(), lr=2e-3),
                     named_parameters=model.named_parameters(), client=client)
    bnt.broadcast_parameters(model.state_dict(), root_rank=0, client=client)
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()   # inner step; a sync when due

The returned object is an instance of a subclass of the wrapped optimizer's class sharing its
``param_groups`` and ``state`` (LR schedulers work as before); ``step()`` is the inner step followed
by the outer loop's (a sync when due). The outer parameters are taken at the first ``step()``, so
the broadcast may come after the wrapping. ``state_dict()`` holds the inner optimizer's state and,
under ``"birdnet_diloco"``, the outer parameters, outer momentum and counters (torch tensors, so
``torch.load(weights_only=True)`` reads it). CPU float32/float64 parameters are used in place
(``Tensor.numpy()`` shares their memory); others (CUDA, half precision) are mirrored in float32
and copied around each sync.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import birdnet.client.diloco as _dl
import numpy as np
import torch
from birdnet.client import Client
from birdnet.client.diloco import OUTER_LR, OUTER_MOMENTUM, STATE_KEY, WARMUP_OUTER_LR, OuterLoop

from birdnet.errors import InputError

__all__ = ["DiLoCo", "outer_defaults"]


def _to_torch(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return torch.from_numpy(np.array(v, copy=True))
    if isinstance(v, dict):
        return {k: _to_torch(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_to_torch(x) for x in v]
    return v


def _to_numpy(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().numpy()
    if isinstance(v, dict):
        return {k: _to_numpy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_to_numpy(x) for x in v]
    return v


class _DiLoCo:
    """Mixed into a subclass of the wrapped optimizer's class; see :func:`DiLoCo`."""

    _bn_loop: OuterLoop

    def _birdnet_setup(self, named_parameters, client: Client, options: dict[str, Any]) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        ids = {id(p) for p in params}
        names: dict[int, str] = {}
        if named_parameters is not None:
            for n, p in named_parameters:
                if id(p) in ids and id(p) not in names:
                    names[id(p)] = str(n)
        arrays: list[tuple[str, np.ndarray]] = []
        self._bn_mirrors: list[tuple[torch.Tensor, np.ndarray]] = []
        for gi, g in enumerate(self.param_groups):
            for i, p in enumerate(g["params"]):
                name = names.get(id(p), f"group{gi}.{i}")
                if p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64) and p.is_contiguous():
                    arrays.append((name, p.detach().numpy()))
                else:  # mirrored: CUDA or half precision
                    a = np.zeros(tuple(p.shape), np.float32)
                    self._bn_mirrors.append((p, a))
                    arrays.append((name, a))
        pull = self._bn_pull if self._bn_mirrors else None
        push = self._bn_push if self._bn_mirrors else None
        self._bn_loop = OuterLoop(client, arrays, pull=pull, push=push, **options)
        self._bn_started = False

    def _bn_pull(self) -> None:
        with torch.no_grad():
            for p, a in self._bn_mirrors:
                a[...] = p.detach().to(device="cpu", dtype=torch.float32).numpy()

    def _bn_push(self) -> None:
        with torch.no_grad():
            for p, a in self._bn_mirrors:
                p.copy_(torch.from_numpy(a))

    @property
    def last_stats(self) -> dict[str, Any]:
        """This process's figures of the last sync: ``bytes_sent`` / ``bytes_received`` (this node's,
        at the transport), ``syncs`` (started so far), ``step`` (inner steps so far), ``fragment``,
        ``sync_every`` (H in force), ``codec``, ``seconds`` (the round's data phase),
        ``bytes_sent_total`` (every sync so far) and ``state_bytes`` (the codec state the local
        daemon holds, all tensors)."""
        return dict(self._bn_loop.last_stats)

    @property
    def outer_loop(self) -> OuterLoop:
        """The framework-free outer loop (its outer parameters: ``outer_loop.outer_parameters()``)."""
        return self._bn_loop

    def step(self, closure=None):
        """The inner optimizer's step, then the outer loop's: a sync when one is due."""
        with torch.no_grad():
            if not self._bn_started:
                # the outer parameters are the ones the first step starts from: after the broadcast
                self._bn_loop.snapshot()
                self._bn_started = True
        loss = super().step(closure)
        with torch.no_grad():
            self._bn_loop.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        if not self._bn_started:
            self._bn_loop.snapshot()
            self._bn_started = True
        sd[STATE_KEY] = _to_torch(self._bn_loop.state_dict())
        return sd

    def load_state_dict(self, state_dict) -> None:
        """The inner optimizer's state, then the outer state (a collective call: it resets the job's
        codec state in the daemons, so every process loads at the same step)."""
        state_dict = dict(state_dict)
        outer = state_dict.pop(STATE_KEY, None)
        super().load_state_dict(state_dict)
        if outer is None:
            raise InputError("DiLoCo.load_state_dict: the state has no outer state ('birdnet_diloco'); "
                             "save it with the DiLoCo optimizer's state_dict(), or load it into the inner "
                             "optimizer before wrapping")
        with torch.no_grad():
            self._bn_loop.load_state_dict(_to_numpy(outer))
        self._bn_started = True

    def rejoin(self, root_rank: int = 0) -> None:
        """Collective: every process takes process ``root_rank``'s outer parameters, momentum and
        counters, and its model restarts from the outer parameters. A process restarted mid-run
        calls it once it is up, the others at the same point of their loop (docs/slowlink.md)."""
        with torch.no_grad():
            self._bn_loop.rejoin(root_rank)
        self._bn_started = True

    def flush(self) -> None:
        """Apply every sync in flight now (``overlap``): the model then holds the outer parameters
        mixed in, as at the end of training."""
        with torch.no_grad():
            self._bn_loop.flush()


_ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW)


def _adam_type(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the ADAM_* defaults apply (read from birdnet.client.diloco at each call, so a
    benchmark may set them)."""
    return _dl.ADAM_DEFAULTS and isinstance(optimizer, _ADAM_TYPES)


def outer_defaults(optimizer: torch.optim.Optimizer, codec: str | None = None) -> tuple[float, float]:
    """The outer (lr, momentum) for an inner optimizer and the pseudo-gradient's codec (None: the
    default one): for Adam and AdamW with the default codec, SGD lr 3 without momentum on the sparse
    average (``ADAM_OUTER_LR``); with another codec DiLoCo's Nesterov SGD (0.7, 0.9; the paper's);
    plain averaging (1, 0) for the other optimizers (docs/slowlink.md, Defaults)."""
    if _adam_type(optimizer) and (codec is None or codec == _dl.ADAM_CODEC):
        return _dl.ADAM_OUTER_LR, _dl.ADAM_OUTER_MOMENTUM
    if isinstance(optimizer, _ADAM_TYPES):
        return OUTER_LR, OUTER_MOMENTUM
    return WARMUP_OUTER_LR, 0.0


def DiLoCo(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None, *,
           client: Client | None = None, sync_every: Any = None, outer_lr: float | None = None,
           outer_momentum: float | None = None, nesterov: bool = True, fragments: int = 1,
           overlap: bool | int = False, codec: str | None = None, codec_params: Mapping[str, Any] | None = None,
           timeout: float | None = None, socket: str | None = None, job: str = "default") -> torch.optim.Optimizer:
    """Wrap ``optimizer`` as the inner optimizer of DiLoCo: local steps, a sync every H steps.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The inner optimizer (any; AdamW and SGD with momentum are the measured ones).
    named_parameters : iterable of (str, Tensor), optional
        ``model.named_parameters()``: stable names for the daemons' codec state and checkpoints.
    client : Client, optional
        The connection; else one from ``birdnet.client.torch.init`` (``socket``, ``job``).
    sync_every : int or schedule, optional
        H, or ``((H, steps), ..., H)``; None: ``birdnet.client.diloco.DEFAULT_SCHEDULE``.
    outer_lr, outer_momentum, nesterov
        The outer optimizer. None (default): chosen by the inner optimizer and the codec
        (``outer_defaults``): for Adam/AdamW with the default codec SGD lr 3 without momentum, with
        another codec DiLoCo's Nesterov SGD (lr 0.7, momentum 0.9); for SGD and others plain
        averaging of the parameters (lr 1, momentum 0: Local SGD), which the measurements in
        docs/slowlink.md found better with momentum SGD inside. ``outer_momentum=0`` is the lean
        setting (no momentum buffer: 4 bytes per parameter less).
    fragments, overlap
        Streaming DiLoCo: sync in ``fragments`` groups in turn; apply results ``overlap`` steps late.
    codec, codec_params
        The pseudo-gradient's codec; None: chosen by the inner optimizer: for Adam/AdamW
        ``ADAM_CODEC`` (``sparseloco``: 7 % of the values, two bits each, error feedback), its warm-up
        syncs ``ADAM_WARMUP_CODEC`` (one-bit ``lowbit``); for the others ``DEFAULT_CODEC`` (4-bit
        ``lowbit``), all in ``birdnet.client.diloco``.
    timeout : float, optional
        Seconds a sync waits for its all-reduce; None: no limit.

    Returns an instance of a subclass of ``type(optimizer)`` with ``last_stats``, ``outer_loop``,
    ``rejoin(root_rank)`` and ``flush()`` added.
    """
    if isinstance(optimizer, _DiLoCo):
        raise InputError("this optimizer is already wrapped by DiLoCo")
    if type(optimizer).__name__.startswith("Distributed") and hasattr(optimizer, "synchronize"):
        raise InputError("DiLoCo wraps a plain optimizer, not a DistributedOptimizer (it would all-reduce "
                         "every step's gradients as well)")
    if client is None:
        from birdnet.client.torch import init
        client = Client(socket, job=job) if socket is not None else init(job=job)
    lr0, m0 = outer_defaults(optimizer, codec)
    outer_lr = lr0 if outer_lr is None else outer_lr
    outer_momentum = m0 if outer_momentum is None else outer_momentum
    warm: dict[str, Any] = {}
    if codec is None and _adam_type(optimizer):
        if codec_params is not None:
            raise InputError("codec_params given without codec=; name the codec they belong to")
        codec, codec_params = _dl.ADAM_CODEC, dict(_dl.ADAM_CODEC_PARAMS)
        warm = dict(warmup_codec=_dl.ADAM_WARMUP_CODEC, warmup_codec_params=dict(_dl.ADAM_WARMUP_CODEC_PARAMS))
    options = dict(sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
                   fragments=fragments, overlap=overlap, codec=codec,
                   codec_params=None if codec_params is None else dict(codec_params), timeout=timeout, **warm)
    cls = type(f"DiLoCo{type(optimizer).__name__}", (_DiLoCo, type(optimizer)), {})
    opt = cls.__new__(cls)
    opt.__dict__.update(optimizer.__dict__)  # the same param_groups and state objects, not copies
    opt._birdnet_setup(named_parameters, client, options)
    return opt
