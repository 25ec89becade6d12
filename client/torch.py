"""PyTorch adapter, in the style of Horovod: ``import birdnet.client.torch as bnt``.

Torch is imported here and nowhere else in birdnet; ``birdnet.client`` itself does not need it.

Example::

    import torch
    import birdnet.client.torch as bnt

    client = bnt.init(job="cnn")                      # or Client(socket, job) and pass client=
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * client.size, momentum=0.9)
    opt = bnt.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    bnt.broadcast_parameters(model.state_dict(), root_rank=0)
    bnt.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # all-reduces start while backward still runs
        opt.step()                         # waits for them, then the wrapped optimizer steps

How gradients travel
--------------------
At construction the parameters are split into *buckets* (``bucket_bytes`` each at most; one
parameter group, dtype and device per bucket), in reverse registration order because backward
produces gradients roughly last layer first. Each bucket is a flat array in shared memory obtained
from :meth:`Client.buffer`, seen from torch through ``torch.from_numpy`` (no copy). A
post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``, torch >= 2.1) copies each
gradient into its slice of the bucket as soon as autograd has it; when a bucket is full it is handed
to the daemon with :meth:`Client.allreduce_async` under a stable name (the bucket's index and first
parameter name), so compressing codecs keep their error-feedback state per bucket.

Buckets are submitted in a fixed order (bucket *k* only after buckets 0..k-1), whatever order the
hooks fire in: the daemon matches calls across processes by their sequence number, so every
process must submit the same tensors in the same order.

After the reduction, a CPU parameter's ``.grad`` *is* its slice of the bucket (a view, when dtype and
layout allow). If the training loop zeroes gradients in place (``zero_grad(set_to_none=False)``)
autograd then accumulates straight into shared memory and the hook has nothing to copy; with the
default ``set_to_none=True`` there is exactly one copy per gradient per step.

CUDA (Jetson): **untested here** (the development machine has no GPU). A CUDA gradient is copied
device-to-host into the bucket, which is registered as pinned (page-locked) memory with
``cudaHostRegister`` when possible so the copy can be asynchronous; the bucket is submitted after
the copy's CUDA event completes, and the result is copied back host-to-device into ``.grad``.

Codec per parameter group
-------------------------
A param group may carry ``"birdnet_codec"`` (a codec name, e.g. ``"topk"``) and
``"birdnet_codec_params"`` (a dict); otherwise the ``codec`` / ``codec_params`` given to
:func:`DistributedOptimizer` apply, and if those are None the daemons' default codec. The keys are
read each time a bucket is submitted, so a schedule may change them between steps (e.g. dense
warm-up, then compression), on every process alike.

Momentum in the codec
---------------------
Momentum-correction codecs (``dgc``, ``topk``, ``randomk``, ``bird``, ``birdplus`` with
``momentum=...``) keep the momentum in the daemon's codec state, per tensor, accumulated *before*
sparsification (Lin et al., DGC, section 3.2). The wrapped optimizer must then run plain SGD. With
``momentum_in_codec=True`` the adapter does that for you: for every SGD group with ``momentum > 0``
it passes the momentum as the codec's ``momentum`` parameter and sets the group's ``momentum`` to 0.
Buckets smaller than the daemon's ``dense_threshold`` travel dense (codec ``none``, which has no
momentum); for those the adapter applies the same momentum locally, on the averaged gradient, so no
tensor silently loses its momentum. Weight decay stays in SGD and is therefore added after the
reduction (outside the momentum), unlike torch's SGD with momentum; Nesterov and dampening are
refused.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import msgpack
import numpy as np
import torch
from birdnet.client import Client, Handle

from birdnet.errors import InputError

__all__ = [
    "BUCKET_BYTES",
    "DistributedOptimizer",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "init",
]

#: default bucket size: large enough to amortise a round's fixed cost (a start/go exchange round
#: the ring), small enough that the first bucket is ready early in backward
BUCKET_BYTES = 4 << 20

_default_client: Client | None = None


def init(socket: str | None = None, job: str = "default") -> Client:
    """Connect this process to its local daemon (once) and return the client the functions of this
    module use when none is passed."""
    global _default_client
    if _default_client is None:
        _default_client = Client(socket, job=job)
    return _default_client


def _client(client: Client | None) -> Client:
    return client if client is not None else init()


# -- dtype mapping --------------------------------------------------------------------------------
#: how a torch dtype travels: the daemon reduces float16/32/64 (and int32/int64 with op="sum")
_WIRE = {
    torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
    torch.bfloat16: np.float32,  # NumPy has no bfloat16; float32 holds every bfloat16 exactly
    torch.int64: np.int64, torch.int32: np.int32,
    torch.int16: np.int32, torch.int8: np.int32, torch.uint8: np.int32, torch.bool: np.int32,
}
_NUMPY_TO_TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                   np.dtype(np.float16): torch.float16, np.dtype(np.int64): torch.int64,
                   np.dtype(np.int32): torch.int32}


def _wire_dtype(t: torch.Tensor, what: str) -> np.dtype:
    dt = _WIRE.get(t.dtype)
    if dt is None:
        raise InputError(f"{what} has dtype {t.dtype}, which birdnet cannot reduce; "
                         "use a float or integer tensor")
    return np.dtype(dt)


# -- buckets --------------------------------------------------------------------------------------
class _Bucket:
    """One flat shared-memory array holding the gradients of several parameters."""

    def __init__(self, index: int, group: int, dtype: np.dtype, device: torch.device) -> None:
        self.index, self.group, self.dtype, self.device = index, group, dtype, device
        self.entries: list[tuple[str, torch.nn.Parameter, int, int]] = []  # name, param, offset, numel
        self.numel = 0
        self.array: np.ndarray | None = None
        self.flat: torch.Tensor | None = None
        self.views: dict[int, torch.Tensor] = {}  # id(param) -> view shaped like the param
        self.ready: set[int] = set()
        self.handle: Handle | None = None
        self.events: list[Any] = []  # CUDA events of device-to-host copies still running
        self.name = ""

    def add(self, name: str, p: torch.nn.Parameter) -> None:
        self.entries.append((name, p, self.numel, p.numel()))
        self.numel += p.numel()

    def allocate(self, client: Client) -> None:
        # the whole segment is passed to allreduce_async: that is how the client recognises its
        # own shared memory and skips the copy in (and a bucket of empty tensors still has 1 element)
        self.array = client.buffer((max(self.numel, 1),), self.dtype)
        self.array[...] = 0
        self.flat = torch.from_numpy(self.array)
        if self.device.type == "cuda":  # pragma: no cover - no GPU on the development machine
            _pin(self.flat)
        for _name, p, off, n in self.entries:
            self.views[id(p)] = self.flat[off:off + n].view(p.shape)
        self.name = f"grad/{self.index}/{self.entries[0][0]}"


def _pin(t: torch.Tensor) -> None:  # pragma: no cover - CUDA path, untested here
    """Page-lock shared memory so device-to-host copies into it can be asynchronous."""
    try:
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(getattr(rc, "value", rc)) != 0:
            raise RuntimeError(f"cudaHostRegister returned {rc}")
    except Exception:  # noqa: BLE001 - pageable memory still works, only synchronously
        pass


class _DistributedOptimizer:
    """Mixed into a subclass of the wrapped optimizer's class; see :func:`DistributedOptimizer`."""

    def _birdnet_setup(self, named_parameters, codec, codec_params, bucket_bytes, client: Client,
                       momentum_in_codec: bool, backward_passes_per_step: int, timeout: float | None,
                       overlap: bool) -> None:
        self._bn_client = client
        self._bn_codec, self._bn_codec_params = codec, dict(codec_params or {})
        self._bn_timeout = timeout
        self._bn_passes = int(backward_passes_per_step)
        if self._bn_passes < 1:
            raise InputError(f"backward_passes_per_step must be at least 1, not {backward_passes_per_step}")
        self._bn_lock = threading.RLock()
        self._bn_local_momentum: dict[int, float] = {}  # group index -> momentum for dense buckets
        if momentum_in_codec:
            self._move_momentum_into_codec()
        names = self._parameter_names(named_parameters)
        self._bn_buckets = self._make_buckets(names, int(bucket_bytes))
        self._bn_of: dict[int, _Bucket] = {}
        for b in self._bn_buckets:
            b.allocate(client)
            for _n, p, _o, _k in b.entries:
                self._bn_of[id(p)] = b
        self._bn_counts: dict[int, int] = {}
        self._bn_next = 0  # index of the next bucket to submit
        self._bn_hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                          for b in self._bn_buckets for _n, p, _o, _k in b.entries] if overlap else []
        #: per-bucket round figures of the last step (bytes, ratio, codec, seconds)
        self.last_stats: list[dict[str, Any]] = []

    # -- construction -----------------------------------------------------------------------------
    def _move_momentum_into_codec(self) -> None:
        for gi, g in enumerate(self.param_groups):
            m = float(g.get("momentum", 0.0) or 0.0)
            if m == 0.0:
                continue
            if g.get("nesterov") or g.get("dampening", 0.0):
                raise InputError(f"param group {gi}: momentum_in_codec supports plain momentum only "
                                 "(nesterov=False, dampening=0)")
            codec = g.get("birdnet_codec", self._bn_codec)
            if codec is None:
                raise InputError(f"param group {gi}: momentum_in_codec=True needs a momentum-correction codec "
                                 "(codec='dgc', 'topk', 'randomk', 'bird' or 'birdplus'), given as codec= or "
                                 "the group's 'birdnet_codec'")
            params = dict(g.get("birdnet_codec_params", self._bn_codec_params) or {})
            params["momentum"] = m
            g["birdnet_codec"], g["birdnet_codec_params"] = codec, params
            g["momentum"] = 0.0
            self._bn_local_momentum[gi] = m

    def _parameter_names(self, named_parameters) -> dict[int, str]:
        names: dict[int, str] = {}
        if named_parameters is not None:
            for n, p in named_parameters:
                if id(p) in names:
                    continue  # a shared parameter keeps its first name
                names[id(p)] = n
            if len(set(names.values())) != len(names):
                raise InputError("named_parameters has duplicate names; the daemon needs one name per tensor")
        for gi, g in enumerate(self.param_groups):
            for pi, p in enumerate(g["params"]):
                if id(p) not in names:
                    if named_parameters is not None:
                        raise InputError(f"parameter {pi} of param group {gi} (shape {tuple(p.shape)}) is not in "
                                         "named_parameters; pass model.named_parameters() of the whole model")
                    names[id(p)] = f"group{gi}.param{pi}"
        return names

    def _make_buckets(self, names: dict[int, str], bucket_bytes: int) -> list[_Bucket]:
        params = []
        seen: set[int] = set()
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if id(p) in seen:
                    raise InputError(f"parameter {names[id(p)]!r} appears in more than one param group")
                seen.add(id(p))
                if p.requires_grad:
                    params.append((gi, p))
        buckets: list[_Bucket] = []
        open_: dict[tuple, _Bucket] = {}
        for gi, p in reversed(params):  # backward meets the last layers first
            dt = _wire_dtype(p, f"parameter {names[id(p)]!r}")
            if dt.kind != "f":
                raise InputError(f"parameter {names[id(p)]!r} has dtype {p.dtype}; gradients must be floating point")
            key = (gi, dt, p.device)
            b = open_.get(key)
            if b is not None and b.entries and (b.numel + p.numel()) * dt.itemsize > bucket_bytes:
                b = None
            if b is None:
                b = _Bucket(len(buckets), gi, dt, p.device)
                buckets.append(b)
                open_[key] = b
            b.add(names[id(p)], p)
        return buckets

    # -- backward ---------------------------------------------------------------------------------
    def _grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: runs right after autograd wrote ``p.grad``."""
        with self._bn_lock:
            b = self._bn_of[id(p)]
            c = self._bn_counts.get(id(p), 0) + 1
            self._bn_counts[id(p)] = c
            if c < self._bn_passes:
                return
            if b.handle is not None or id(p) in b.ready:
                raise InputError(f"gradient of {self._name_of(b, p)!r} was computed more than "
                                 f"backward_passes_per_step={self._bn_passes} times before step(); call step() "
                                 "(or synchronize()) after each backward, or raise backward_passes_per_step")
            self._stage(b, p)
            b.ready.add(id(p))
            self._submit_ready()

    def _stage(self, b: _Bucket, p: torch.Tensor) -> None:
        view = b.views[id(p)]
        g = p.grad
        if g is None:
            view.zero_()
            return
        if g.is_sparse:
            raise InputError(f"gradient of {self._name_of(b, p)!r} is sparse; birdnet reduces dense tensors")
        if g.device.type == "cuda":  # pragma: no cover - untested here (no GPU)
            view.copy_(g, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            b.events.append(ev)
        elif g.data_ptr() != view.data_ptr():
            view.copy_(g)

    def _submit_ready(self) -> None:
        while self._bn_next < len(self._bn_buckets):
            b = self._bn_buckets[self._bn_next]
            if len(b.ready) < len(b.entries):
                return
            self._submit(b)
            self._bn_next += 1

    def _submit(self, b: _Bucket) -> None:
        for ev in b.events:  # pragma: no cover - CUDA only
            ev.synchronize()
        b.events.clear()
        g = self.param_groups[b.group]
        codec = g.get("birdnet_codec", self._bn_codec)
        params = dict(g.get("birdnet_codec_params", self._bn_codec_params) or {}) if codec is not None else {}
        b.handle = self._bn_client.allreduce_async(b.array, op="mean", name=b.name, codec=codec, **params)

    @staticmethod
    def _name_of(b: _Bucket, p: torch.Tensor) -> str:
        return next(n for n, q, _o, _k in b.entries if q is p)

    # -- step -------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Submit what backward did not (unused parameters count as zero gradients), wait for every
        bucket, and put the averaged gradients into ``.grad``. ``step()`` calls it."""
        with self._bn_lock:
            for b in self._bn_buckets[self._bn_next:]:
                for _n, p, _o, _k in b.entries:
                    if id(p) not in b.ready:
                        self._stage(b, p)
                        b.ready.add(id(p))
            try:
                self._submit_ready()
                stats = []
                for b in self._bn_buckets:
                    h = b.handle
                    if h is None:  # pragma: no cover - every bucket was staged above
                        raise InputError(f"bucket {b.name!r} was never submitted")
                    h.wait(self._bn_timeout)
                    b.handle = None
                    stats.append(dict(h.stats, name=b.name))
                    m = self._bn_local_momentum.get(b.group) if h.stats.get("codec") == "none" else None
                    for _n, p, _o, _k in b.entries:
                        self._unstage(b, p, m)
                self.last_stats = stats
            finally:
                self._reset_step()

    def _reset_step(self) -> None:
        """Forget this step's bookkeeping; after a failed round, collect what is still in flight
        (the daemons fail a round everywhere, so these waits end) so the next step starts clean."""
        from birdnet.errors import BirdnetError
        for b in self._bn_buckets:
            if b.handle is not None:
                try:
                    b.handle.wait(self._bn_timeout)
                except BirdnetError:
                    pass
                b.handle = None
            b.ready.clear()
            b.events.clear()
        self._bn_counts.clear()
        self._bn_next = 0

    def _unstage(self, b: _Bucket, p: torch.Tensor, momentum: float | None) -> None:
        view = b.views[id(p)]
        if momentum is not None:
            # a dense bucket of a momentum_in_codec group: the momentum the codec would have applied
            st = self.state[p]
            buf = st.get("birdnet_momentum_buffer")
            if buf is None:
                buf = st["birdnet_momentum_buffer"] = view.detach().to(p.device, p.dtype, copy=True)
            else:
                buf.mul_(momentum).add_(view.to(buf.device, buf.dtype))
            view.copy_(buf)
        g = p.grad
        if g is not None and g.device == view.device and g.data_ptr() == view.data_ptr():
            return  # autograd accumulated straight into shared memory; the result is already there
        if p.device.type == "cpu" and _NUMPY_TO_TORCH.get(b.dtype) == p.dtype and p.is_contiguous():
            p.grad = view  # no copy: .grad is the bucket slice
        elif g is None:
            p.grad = view.to(device=p.device, dtype=p.dtype, copy=True)
        else:
            g.copy_(view, non_blocking=p.device.type == "cuda")

    def step(self, closure=None):
        """Wait for the gradients' all-reduce, then step the wrapped optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        super().step()
        return loss

    def remove_hooks(self) -> None:
        """Detach from the parameters (the optimizer then no longer all-reduces)."""
        for h in self._bn_hooks:
            h.remove()
        self._bn_hooks = []


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         codec: str | None = None, codec_params: Mapping[str, Any] | None = None, *,
                         bucket_bytes: int = BUCKET_BYTES, client: Client | None = None,
                         socket: str | None = None, job: str = "default", momentum_in_codec: bool = False,
                         backward_passes_per_step: int = 1, timeout: float | None = None,
                         overlap: bool = True) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so gradients are averaged over all processes of the job before each step.

    The result is an instance of a subclass of ``type(optimizer)`` sharing its ``param_groups`` and
    ``state`` (so LR schedulers and checkpoints work as before), with :meth:`synchronize` and
    :meth:`remove_hooks` added.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        Any optimizer; with ``momentum_in_codec`` an SGD-style one (param groups with ``momentum``).
    named_parameters : iterable of (str, Tensor), optional
        ``model.named_parameters()``: gives every bucket a stable, readable name (the daemon keys
        codec state by name). Without it parameters are named by group and position.
    codec, codec_params : optional
        Default codec for groups without ``"birdnet_codec"`` / ``"birdnet_codec_params"``; None = the
        daemons' default.
    bucket_bytes : int
        Largest bucket in bytes (a single larger parameter gets a bucket of its own).
    client : Client, optional
        The connection to use; else one from :func:`init` (``socket``, ``job``).
    momentum_in_codec : bool
        Move SGD momentum into the codec (see the module docstring).
    backward_passes_per_step : int
        Backward passes accumulated locally before the all-reduce (gradient accumulation).
    timeout : float, optional
        Seconds ``step()`` waits for a bucket before raising ``RoundTimeoutError``; None = no limit.
    overlap : bool
        True: all-reduce each bucket as soon as backward has filled it. False: register no hooks and
        all-reduce every bucket in ``step()``, after backward (for comparison: ``birdnet.bench.overlap``;
        ``backward_passes_per_step`` then does not apply: every step reduces what ``.grad`` holds).
    """
    if isinstance(optimizer, _DistributedOptimizer):
        raise InputError("this optimizer is already a DistributedOptimizer")
    if client is None:
        client = Client(socket, job=job) if socket is not None else init(job=job)
    cls = type(f"Distributed{type(optimizer).__name__}", (_DistributedOptimizer, type(optimizer)), {})
    dist = cls.__new__(cls)
    dist.__dict__.update(optimizer.__dict__)  # the same param_groups and state objects, not copies
    dist._birdnet_setup(named_parameters, codec, codec_params, bucket_bytes, client, momentum_in_codec,
                        backward_passes_per_step, timeout, overlap)
    return dist


# -- broadcasts -----------------------------------------------------------------------------------
def _broadcast_tensors(tensors: list[tuple[str, torch.Tensor]], root_rank: int, client: Client, prefix: str) -> None:
    """Overwrite every tensor with root's values: one broadcast round per wire dtype."""
    groups: dict[np.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in tensors:
        groups.setdefault(_wire_dtype(t, f"tensor {name!r}"), []).append((name, t))
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


# The torch.distributed backend "birdnet" and the DDP hook (birdnet.client.torch_dist), only where
# torch.distributed exists: NVIDIA's Jetson wheels lack it, and there this module is the wrapper alone.
if torch.distributed.is_available():
    from birdnet.client.torch_dist import HookState, comm_hook, init_process_group
    from birdnet.client.torch_dist import register as _register_backend

    _register_backend()
    __all__ += ["HookState", "comm_hook", "init_process_group"]
