"""Broadcasts of birdnet.client.torch: parameters and optimizer state from one process to all, and
``recover`` (after a failed step, every replica made root's again)."""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
import torch
from birdnet.client import RECOVER_TIMEOUT, Client, _retry_recoverable
from birdnet.client._torch_dtypes import wire_dtype

from birdnet.errors import InputError


def _client(client: Client | None) -> Client:
    if client is not None:
        return client
    from birdnet.client.torch import init  # the adapter's own connection (bnt.init), made once
    return init()


def _broadcast_tensors(tensors: list[tuple[str, torch.Tensor]], root_rank: int, client: Client, prefix: str) -> None:
    """Overwrite every tensor with root's values: one broadcast round per wire dtype."""
    groups: dict[np.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in tensors:
        groups.setdefault(wire_dtype(t, f"tensor {name!r}"), []).append((name, t))
    for dt in sorted(groups, key=lambda d: d.name):  # the same order on every process
        items = groups[dt]
        total = sum(t.numel() for _n, t in items)
        # a plain array (one copy into shared memory): client.buffer() would hold a segment for good
        buf = np.zeros(max(total, 1), dt)
        flat = torch.from_numpy(buf)
        off = 0
        for _n, t in items:
            n = t.numel()
            flat[off:off + n].copy_(t.detach().reshape(-1))
            off += n
        flat = torch.from_numpy(client.broadcast(buf, root=root_rank, name=f"{prefix}/{dt.name}"))
        off = 0
        with torch.no_grad():
            for _n, t in items:
                n = t.numel()
                t.copy_(flat[off:off + n].view(t.shape))
                off += n


def broadcast_parameters(params, root_rank: int = 0, client: Client | None = None) -> None:
    """Overwrite ``params`` on every process with those of ``root_rank``, in place.

    ``params`` is a ``state_dict()`` (parameters and buffers), ``named_parameters()``, or a list of
    tensors; every process passes the same structure.
    """
    client = _client(client)
    if isinstance(params, Mapping):
        items = list(params.items())
    else:
        items = []
        for i, x in enumerate(params):
            items.append(x if isinstance(x, tuple) else (f"tensor{i}", x))
    items = [(n, t) for n, t in items if torch.is_tensor(t)]
    _broadcast_tensors(items, root_rank, client, "broadcast/parameters")


_T, _TUPLE = "\x00tensor", "\x00tuple"


def _skeleton(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with tensors replaced by placeholders, in a form msgpack carries faithfully."""
    if torch.is_tensor(obj):
        tensors.append(obj)
        return {_T: len(tensors) - 1, "shape": list(obj.shape), "dtype": str(obj.dtype).replace("torch.", "")}
    if isinstance(obj, dict):
        return {k: _skeleton(v, tensors) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return {_TUPLE: [_skeleton(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_skeleton(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise InputError(f"optimizer state holds a {type(obj).__name__}, which broadcast_optimizer_state cannot send")


def _rebuild(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if _T in obj:
            return tensors[obj[_T]]
        if _TUPLE in obj:
            return tuple(_rebuild(v, tensors) for v in obj[_TUPLE])
        return {k: _rebuild(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, tensors) for v in obj]
    return obj


def _tensors_in(obj: Any, shapes: list[tuple[int, list[int], str]]) -> None:
    if isinstance(obj, dict):
        if _T in obj:
            shapes.append((obj[_T], obj["shape"], obj["dtype"]))
            return
        for v in obj.values():
            _tensors_in(v, shapes)
    elif isinstance(obj, list):
        for v in obj:
            _tensors_in(v, shapes)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              client: Client | None = None) -> None:
    """Give every process ``root_rank``'s optimizer state and hyper-parameters (e.g. after root
    restored a checkpoint). Works when the other processes have no state yet.

    Root's ``state_dict()`` travels as a msgpack skeleton (numbers, strings, nesting) followed by its
    tensors, one broadcast per dtype; every process then calls ``load_state_dict``.
    """
    client = _client(client)
    tensors: list[torch.Tensor] = []
    blob = b""
    if client.rank == root_rank:
        blob = msgpack.packb(_skeleton(optimizer.state_dict(), tensors), use_bin_type=True)
    size = client.broadcast(np.array([len(blob)], np.int64), root=root_rank, name="broadcast/optimizer/size")
    nbytes = int(size[0])
    padded = np.zeros((nbytes + 3) // 4 * 4, np.uint8)
    padded[: len(blob)] = np.frombuffer(blob, np.uint8)
    got = client.broadcast(padded.view(np.int32), root=root_rank, name="broadcast/optimizer/skeleton")
    skeleton = msgpack.unpackb(got.view(np.uint8)[:nbytes].tobytes(), raw=False, strict_map_key=False)
    shapes: list[tuple[int, list[int], str]] = []
    _tensors_in(skeleton, shapes)
    if client.rank != root_rank:
        tensors = [torch.empty(0)] * len(shapes)
        for i, shape, dtype in shapes:
            tensors[i] = torch.zeros(shape, dtype=getattr(torch, dtype))
    else:
        tensors = [t.detach().cpu().clone() for t in tensors]
    _broadcast_tensors([(f"state{i}", tensors[i]) for i, _s, _d in sorted(shapes)], root_rank, client,
                       "broadcast/optimizer")
    state = _rebuild(skeleton, tensors)
    # msgpack keeps int keys, but ``state`` keys must be ints and param_groups' ``params`` lists
    state["state"] = {int(k): v for k, v in state["state"].items()}
    optimizer.load_state_dict(state)


def recover(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, root_rank: int = 0,
            client: Client | None = None, timeout: float = RECOVER_TIMEOUT) -> int:
    """After a failed step: wait until the ring is whole again, then give every process ``root_rank``'s
    parameters and buffers (``model.state_dict()``) and, with ``optimizer``, its optimizer state,
    so the replicas are identical again. A collective (every process of the job calls it)::

        try:
            loss_fn(model(x), y).backward()
            opt.step()
        except (PeerLostError, RoundTimeoutError):
            bnt.recover(model, opt)   # identical replicas again; the batch is skipped
        opt.zero_grad()

    The client is ``client``, else the :class:`DistributedOptimizer`'s, else :func:`init`'s. Under
    DDP on the birdnet process group (``init_process_group``) pass the model (``ddp.module``) and
    the optimizer: the broadcasts then go through the process group. Calls that fail while the
    ring is still broken are tried again until ``timeout`` (s); returns the number of attempts.
    :class:`~birdnet.errors.ProcessLostError` is raised at once (restart the job's processes)."""
    deadline = time.monotonic() + timeout
    if client is None:
        client = getattr(optimizer, "_bn_client", None)
    pg = None
    if client is None:
        from birdnet.client.torch_dist import _default_birdnet_group
        pg = _default_birdnet_group()
    reset_step = getattr(optimizer, "_reset_step", None)  # a DistributedOptimizer's (only it has one)
    if reset_step is not None:
        reset_step()  # what the failed step left in flight (its waits end: the round failed)

    def attempt() -> None:
        if pg is not None:
            _recover_through_group(model, optimizer, root_rank)
            return
        c = _client(client)
        c._wait_ring(deadline)
        broadcast_parameters(model.state_dict(), root_rank=root_rank, client=c)
        if optimizer is not None:
            broadcast_optimizer_state(optimizer, root_rank=root_rank, client=c)
        c.barrier(timeout=max(1.0, deadline - time.monotonic()))
    return _retry_recoverable(attempt, deadline, pause=0.2)


def _recover_through_group(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, root_rank: int) -> None:
    """recover's broadcasts on the birdnet process group (DDP): every tensor of the model's state
    and of the optimizer's state, in a fixed order, in place."""
    import torch.distributed as dist
    tensors = [t for _k, t in sorted(model.state_dict().items())]
    if optimizer is not None:
        for p in (q for g in optimizer.param_groups for q in g["params"]):
            st = optimizer.state.get(p, {})
            tensors += [st[k] for k in sorted(st) if isinstance(st[k], torch.Tensor)]
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t, src=root_rank)
    dist.barrier()
