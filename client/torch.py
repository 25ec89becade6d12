"""PyTorch adapter, in the style of Horovod: ``import birdnet.client.torch as bnt``.

Torch is imported here and in the modules beside it (``_torch_*.py``, ``torch_dist.py``), nowhere else
in birdnet; ``birdnet.client`` itself does not need it. The optimizer recipes are in
``_torch_recipes.py``, the broadcasts in ``_torch_broadcast.py``, the buckets in ``_torch_buckets.py``.

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
parameter name), so compressing codecs keep their error-feedback state per bucket (the buckets of
a sign-codec Adam group travel merged, under the merged round's name: Optimizer recipes).

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

Optimizer recipes (``momentum_in_codec=None``, automatic)
---------------------------------------------------------
Compressing a gradient and then letting the optimizer build its momentum (and Adam's second
moment) from the decompressed average loses quality: a sparse or 1-bit average is a poor input
to a running average of squares, and momentum built *after* the compression cannot carry what
error feedback delays. So, for a compressing codec with a ``momentum`` parameter (``marsit``,
``signcascade``, ``topk``, ``dgc``, ``randomk`` (error feedback turned on), ``efsign``, ``bird``,
``birdplus``), the adapter recognises torch's optimizers and arranges, per param group:

``torch.optim.SGD`` with ``momentum > 0``
    The momentum moves into the codec (its ``momentum`` parameter; the daemon keeps it per
    tensor, accumulated *before* compression, DGC's momentum correction, Lin et al. 2018 section
    3.2) and the group's ``momentum`` becomes 0: SGD steps on the codec's result. ``dampening`` d
    is applied exactly (the result times 1 - d); ``nesterov=True`` is refused (a compressed
    Nesterov look-ahead would need the dense gradient the codec does not send). With ``bird`` or
    ``birdplus`` the tensors under 1024 elements travel apart, in a dense bucket (float16 from
    the second step).
``torch.optim.Adam`` / ``AdamW``
    In the spirit of 1-bit Adam (Tang et al. 2021) and 0/1 Adam (Lu et al. 2022): the first
    ``warmup_steps`` steps travel dense and Adam runs as usual; then the second moment is frozen
    (``exp_avg_sq`` stops changing, its bias correction stays that of the last warm-up step),
    refreshed from an all-reduce of the raw gradient in float16 (``ADAM_REFRESH_CODEC``, scaled by a
    power of two from the second moment) at the warm-up's end + 16, + 48, + 112, ... steps (``ADAM_REFRESH_STEPS``; time-weighted, ``v = b2**k v + (1 - b2**k) g**2`` over the k
    steps since the last sample, the bias correction moved to that step); the adapter updates
    ``p -= lr * m / (sqrt(v_frozen / bc2) + eps)``. With a sign codec the first moment moves into
    the codec (``momentum`` = beta1, kept with Marsit's compensation or the codec's error
    feedback) and ``m = (1 - beta1) * result + carry``. With a selecting codec the codec keeps
    error feedback only and the adapter keeps Adam's ``m = beta1 * m + (1 - beta1) * result``
    (a selecting codec's momentum correction clears a block's momentum when the block is sent, so
    a block sent often lost most of its step: at density 1.0, all but 1 - beta1 of it).
    Automatic warm-up (``warmup_steps=None``): dense until the bias-corrected second moment has
    settled (its relative L1 change over 8 steps at most 0.3), 40 steps at most. With a sign codec
    (``marsit``, ``signcascade``, ``efsign``: one scale per round) each tensor of >= 1024
    elements has a bucket of its own, since one scale for tensors of different gradient size,
    divided by each coordinate's denominator, steps the ones with small gradients many times
    Adam's step; the small ones share a dense bucket, float16 after the warm-up
    (``SMALL_TENSOR_CODEC``). The buckets still travel together: during the warm-up all of them
    in one dense round, after it the big ones in one round of the codec (up to ``bucket_bytes``),
    each divided by its own unit, the mean RMS gradient of its frozen second moment
    (``birdnet_unit``, recomputed after each refresh), and multiplied back, so one scale fits
    them all (``SIGN_MERGE``; the codec's state in the daemon is that round's, named
    ``sign/<k>/<first tensor>``). A step then costs two rounds, not one per tensor.
    Weight decay: decoupled for AdamW (``p *= 1 - lr * wd``), added to ``m`` for Adam. For the
    selecting codecs (``topk``, ``dgc``, ``randomk``, ``bird``, ``birdplus``) the gradient enters
    the codec divided by the frozen denominator and leaves multiplied by it (linear, because the
    denominator is frozen): they then keep the coordinates with the largest steps, not the
    largest raw gradients.

Momentum accumulated before the switch (warm-up, or a restored checkpoint) is not lost: it is the
*carry*, decaying by the momentum factor each step and added to the codec's result, since the
codec's own momentum starts from zero. Buckets smaller than the daemons' ``dense_threshold``
travel dense (codec ``none``, no momentum): SGD's momentum is applied by the adapter on the
averaged gradient, and Adam steps on them as usual. Weight decay stays in SGD and is added after
the reduction (outside the momentum), unlike torch's SGD with momentum. Other optimizers, and
codecs without a ``momentum`` parameter, are left as they are, with a warning that the optimizer
steps on the decompressed average. ``momentum_in_codec=False``: nothing is arranged (the optimizer
steps on the decompressed average; ``warmup_steps`` still applies when given).
``momentum_in_codec=True``: the same as automatic, but a group without a usable codec is an error.

Every quantity above is computed from the all-reduced results, which are bit-identical on every
process, in the same order: every process ends with bit-identical parameters.

Checkpoints: ``state_dict()`` holds the frozen second moment (``exp_avg_sq``), the current first
moment or SGD momentum estimate (``exp_avg`` / ``birdnet_momentum_buffer``), the carry and each
group's ``birdnet_step``. The codec state in the daemon (its momentum, error-feedback residual,
compensation) is not in it: after ``load_state_dict`` (or when a restored state is wrapped) the
adapter resets the job's codec state on its first submission (a collective round) and restarts
the carry from the saved momentum estimate; only the residual not yet sent is lost.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from birdnet.client import Client
from birdnet.client._torch_broadcast import broadcast_optimizer_state, broadcast_parameters, recover
from birdnet.client._torch_buckets import _Bucket, _MemberHandle, _Merged
from birdnet.client._torch_diloco import DiLoCo
from birdnet.client._torch_dtypes import NUMPY_TO_TORCH, wire_dtype
from birdnet.client._torch_recipes import (  # noqa: F401 - the constants: public
    _SIGN_CODECS,
    _SMALL_TENSOR,
    ADAM_REFRESH_CODEC,
    ADAM_REFRESH_STEPS,
    ADAM_WARMUP_CHANGE,
    ADAM_WARMUP_STEPS,
    ADAM_WARMUP_WINDOW,
    MOMENTUM_CODECS,
    SIGN_MERGE,
    _Recipes,
)

from birdnet.errors import InputError, ProtocolError

__all__ = [
    "BUCKET_BYTES",
    "DiLoCo",
    "DistributedOptimizer",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "init",
    "recover",
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


def _validate_codecs(optimizer: torch.optim.Optimizer, codec: str | None, codec_params: Mapping[str, Any] | None) -> None:
    """Every codec the optimizer's groups will use, checked as the daemons check it
    (birdnet.codecs.validate) before anything is arranged or connected: a bad parameter fails here,
    not at the first compressed step on every rank, and an unknown codec is not first warned about."""
    from birdnet.codecs import validate
    for g in optimizer.param_groups:
        name = g.get("birdnet_codec", codec)
        params = g.get("birdnet_codec_params", codec_params)
        if name is not None:
            validate(name, dict(params or {}))


class _DistributedOptimizer(_Recipes):
    """Mixed into a subclass of the wrapped optimizer's class; see :func:`DistributedOptimizer`."""

    def _birdnet_setup(self, named_parameters, codec, codec_params, bucket_bytes, client: Client,
                       momentum_in_codec: bool | None, warmup_steps: int | None,
                       backward_passes_per_step: int, timeout: float | None, overlap: bool) -> None:
        self._bn_client = client
        self._bn_codec, self._bn_codec_params = codec, dict(codec_params or {})
        self._bn_timeout = timeout
        self._bn_passes = int(backward_passes_per_step)
        if self._bn_passes < 1:
            raise InputError(f"backward_passes_per_step must be at least 1, not {backward_passes_per_step}")
        self._bn_lock = threading.RLock()
        if momentum_in_codec not in (None, True, False):
            raise InputError(f"momentum_in_codec must be None (automatic), True or False, not {momentum_in_codec!r}")
        if warmup_steps is not None and (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int)
                                         or warmup_steps < 0):
            raise InputError(f"warmup_steps must be None (automatic) or an integer >= 0, not {warmup_steps!r}")
        self._bn_mode = momentum_in_codec
        #: group index -> ("sgd" | "adam", momentum or beta1, dampening) for the arranged groups
        self._bn_recipe: dict[int, tuple[str, float, float]] = {}
        #: Adam groups whose first moment the adapter keeps (a selecting codec: _recipes._arrange)
        self._bn_adapter_m: set[int] = set()
        if momentum_in_codec is not False:
            self._arrange()
        adam = any(r[0] == "adam" for r in self._bn_recipe.values())
        if warmup_steps == 0 and adam:
            raise InputError("Adam/AdamW with a compressing codec needs an uncompressed warm-up to estimate its "
                             "second moment before it is frozen: warmup_steps must be at least 1 "
                             "(None = automatic: until the second moment settles, at most "
                             f"{ADAM_WARMUP_STEPS} steps)")
        #: the fixed warm-up in steps, or None: automatic (Adam/AdamW groups arranged), decided
        #: while it runs (:meth:`_decide_warmup`)
        self._bn_warmup: int | None = (None if adam else 0) if warmup_steps is None else int(warmup_steps)
        self._bn_vsnap: dict[int, np.ndarray] = {}  # id(param) -> the second moment a window ago
        #: True while the last synchronize() sent the compressing groups dense (the warm-up)
        self.birdnet_warming_up = False
        self._bn_synced = False
        self._bn_reset_pending = False
        self._bn_denom: dict[int, torch.Tensor] = {}  # id(param) -> sqrt(v_frozen / bc2) + eps
        names = self._parameter_names(named_parameters)
        self._bn_buckets = self._make_buckets(names, int(bucket_bytes))
        self._bn_of: dict[int, _Bucket] = {}
        for b in self._bn_buckets:
            b.allocate(client)
            for _n, p, _o, _k in b.entries:
                self._bn_of[id(p)] = b
        #: bucket index -> the merged round it joins while its group warms up (_Merged)
        self._bn_merge_of: dict[int, _Merged] = self._make_merges(int(bucket_bytes))
        #: bucket index -> the merged round its big tensor travels in with the sign codec after the warm-up
        self._bn_sign_of: dict[int, _Merged] = self._make_merges(int(bucket_bytes), "sign") if SIGN_MERGE else {}
        for m in {id(m): m for d in (self._bn_merge_of, self._bn_sign_of) for m in d.values()}.values():
            m.allocate(client)
        self._bn_counts: dict[int, int] = {}
        self._bn_next = 0  # index of the next bucket to submit
        self._bn_hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                          for b in self._bn_buckets for _n, p, _o, _k in b.entries] if overlap else []
        #: per-bucket round figures of the last step (bytes, ratio, codec, seconds)
        self.last_stats: list[dict[str, Any]] = []
        self._warm_codecs()

    def _warm_codecs(self) -> None:
        """Ask the daemon to load the groups' codec kernels now: loading them at the first
        compressed call (after an Adam warm-up: step 33 of the transformer) stalled that step by
        ~1.6 s, all processes waiting for the slowest daemon."""
        seen: set[str] = set()
        for g in self.param_groups:
            codec = g.get("birdnet_codec", self._bn_codec)
            params = dict(g.get("birdnet_codec_params", self._bn_codec_params) or {})
            key = repr((codec, sorted(params.items())))
            if codec is None or key in seen:
                continue
            seen.add(key)
            try:
                self._bn_client.warm(codec, **params)
            except ProtocolError:
                pass  # a daemon older than the request: the first call waits for the kernels instead

    # -- construction -----------------------------------------------------------------------------
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
        small: list[tuple[int, torch.nn.Parameter, np.dtype]] = []
        for gi, p in reversed(params):  # backward meets the last layers first
            dt = wire_dtype(p, f"parameter {names[id(p)]!r}")
            if dt.kind != "f":
                raise InputError(f"parameter {names[id(p)]!r} has dtype {p.dtype}; gradients must be floating point")
            if self._small_apart(gi) and p.numel() < _SMALL_TENSOR:
                small.append((gi, p, dt))
                continue
            if self._own_scale(gi):
                b = _Bucket(len(buckets), gi, dt, p.device)  # its own sign scale
                buckets.append(b)
                b.add(names[id(p)], p)
                continue
            self._fill(buckets, open_, (gi, dt, p.device), names[id(p)], p, bucket_bytes)
        # the small tensors of a group that keeps them apart (_small_apart), in buckets that travel
        # dense (fp16 once the scale's statistic exists; last: the first layers' small gradients
        # come last in backward anyway)
        open_.clear()
        for gi, p, dt in small:
            b = self._fill(buckets, open_, (gi, dt, p.device), names[id(p)], p, bucket_bytes)
            b.dense = True
        return buckets

    def _make_merges(self, bucket_bytes: int, kind: str = "warm") -> dict[int, _Merged]:
        """Runs of consecutive buckets of one sign-codec Adam group (same dtype and device), at most
        ``bucket_bytes`` each, that travel as one round (:class:`_Merged`): ``"warm"``, dense
        during the warm-up, all of the group's buckets; ``"sign"``, with the codec after it, the
        big tensors' buckets (not the small tensors' dense one)."""
        runs: list[list[_Bucket]] = []
        for b in self._bn_buckets:
            if not self._own_scale(b.group) or (kind == "warm" and self._bn_warmup == 0) or (kind == "sign" and b.dense):
                continue
            last = runs[-1] if runs else None
            if (last is not None and last[-1].index == b.index - 1 and last[-1].group == b.group
                    and last[-1].dtype == b.dtype and last[-1].device == b.device
                    and (sum(x.numel for x in last) + b.numel) * b.dtype.itemsize <= bucket_bytes):
                last.append(b)
            else:
                runs.append([b])
        out: dict[int, _Merged] = {}
        for k, run in enumerate(runs):
            if len(run) < 2:
                continue
            m = _Merged(k, run, kind)
            for b in run:
                out[b.index] = m
        return out

    @staticmethod
    def _fill(buckets: list[_Bucket], open_: dict[tuple, _Bucket], key: tuple, name: str,
              p: torch.nn.Parameter, bucket_bytes: int) -> _Bucket:
        """Add ``p`` to the open bucket of ``key`` (group, dtype, device), or a new one when full."""
        b = open_.get(key)
        if b is not None and b.entries and (b.numel + p.numel()) * key[1].itemsize > bucket_bytes:
            b = None
        if b is None:
            b = _Bucket(len(buckets), key[0], key[1], key[2])
            buckets.append(b)
            open_[key] = b
        b.add(name, p)
        return b

    # -- backward ---------------------------------------------------------------------------------
    def _grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: runs right after autograd wrote ``p.grad``."""
        with self._bn_lock:
            self._bn_synced = False
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
            if self._refreshing(b):
                b.allocate_var(self._bn_client)
                b.var_views[id(p)].zero_()
                b.refresh = True
            return
        if g.is_sparse:
            raise InputError(f"gradient of {self._name_of(b, p)!r} is sparse; birdnet reduces dense tensors")
        if g.device.type == "cuda":  # pragma: no cover - untested here (no GPU)
            if self._small_codec(b) == "fp16":
                g = g * b.half_scale.setdefault(id(p), self._half_scale(self.param_groups[b.group], p))
            view.copy_(g, non_blocking=True)
            if self._refreshing(b):
                b.allocate_var(self._bn_client)
                sc = b.var_scale[id(p)] = (self._half_scale(self.param_groups[b.group], p)
                                           if self._refresh_codec() == "fp16" else 1.0)
                b.var_views[id(p)].copy_(g * sc, non_blocking=True)
                b.refresh = True
            ev = torch.cuda.Event()
            ev.record()
            b.events.append(ev)
            return
        if g.data_ptr() != view.data_ptr():
            view.copy_(g)
        if self._refreshing(b):
            b.allocate_var(self._bn_client)
            sc = b.var_scale[id(p)] = (self._half_scale(self.param_groups[b.group], p)
                                       if self._refresh_codec() == "fp16" else 1.0)
            b.var_views[id(p)].copy_(view).mul_(sc)  # the raw gradient (before the codec's scaling)
            b.refresh = True
        if self._small_codec(b) == "fp16":
            sc = b.half_scale[id(p)] = self._half_scale(self.param_groups[b.group], p)
            view.mul_(sc)
        denom = self._send_scale(b, p)
        if denom is not None:
            view.div_(denom)
            b.scaled.add(id(p))

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
        if self._bn_reset_pending:
            # a restored state: the daemons' codec state (momentum, residuals) belongs to another
            # history; every process submits its first bucket after load_state_dict, so this
            # collective round is called by all of them at the same point
            self._bn_reset_pending = False
            self._bn_client.reset_state(self._bn_timeout)
        g = self.param_groups[b.group]
        m = self._bn_merge_of.get(b.index)
        if m is not None and self._warming_up(g):
            np.copyto(m.slice(b), b.array)
            b.handle = _MemberHandle(m, b)  # type: ignore[assignment]
            if b is m.members[-1]:  # buckets are submitted in order: every member is in
                m.waited = False
                m.handle = self._bn_client.allreduce_async(m.array, op="mean", name=m.name, codec="none")
            return
        codec = g.get("birdnet_codec", self._bn_codec)
        params = dict(g.get("birdnet_codec_params", self._bn_codec_params) or {}) if codec is not None else {}
        if self._warming_up(g) or b.dense:
            codec, params = self._small_codec(b), {}
        s = self._bn_sign_of.get(b.index)
        if s is not None and codec in _SIGN_CODECS:
            # one sign round for the run, each member in its own unit (_Merged)
            unit = self._sign_unit(g, b.entries[0][1])
            np.divide(b.array, b.dtype.type(unit), out=s.slice(b))
            b.handle = _MemberHandle(s, b, unit)  # type: ignore[assignment]
            if b.refresh:  # the raw gradient (its own power-of-two scale), not divided by the unit
                s.allocate_var(self._bn_client)
                np.copyto(s.slice(b, var=True), b.var_array)
                b.var_handle = _MemberHandle(s, b, var=True)  # type: ignore[assignment]
            if b is s.members[-1]:
                s.waited = False
                s.handle = self._bn_client.allreduce_async(s.array, op="mean", name=s.name, codec=codec, **params)
                if any(x.refresh for x in s.members):  # every member refreshes at the same step
                    s.var_waited = False
                    s.var_handle = self._bn_client.allreduce_async(s.var_array, op="mean", name=s.var_name,
                                                                   codec=self._refresh_codec())
            return
        b.handle = self._bn_client.allreduce_async(b.array, op="mean", name=b.name, codec=codec, **params)
        if b.refresh:  # right after the codec's round, in the same order on every process
            b.var_handle = self._bn_client.allreduce_async(b.var_array, op="mean", name="var" + b.name[4:],
                                                           codec=self._refresh_codec())

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
                self.birdnet_warming_up = any(self._warming_up(g) for g in self.param_groups)
                for b in self._bn_buckets:
                    h = b.handle
                    if h is None:  # pragma: no cover - every bucket was staged above
                        raise InputError(f"bucket {b.name!r} was never submitted")
                    h.wait(self._bn_timeout)
                    b.handle = None
                    stats.append(dict(h.stats, name=b.name))
                    recipe = self._bn_recipe.get(b.group)
                    coded = b.coded = h.stats.get("codec") not in (None, "none", "fp16")
                    for _n, p, _o, _k in b.entries:
                        self._unstage(b, p)
                        sc = b.half_scale.get(id(p))
                        if sc is not None and p.grad is not None:
                            # back from float16's scale; an overflowed coordinate counts as 0
                            p.grad.div_(sc).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
                        if id(p) in b.scaled and p.grad is not None:
                            p.grad.mul_(self._bn_denom[id(p)])  # back to gradient units
                        if recipe is not None and p.grad is not None:
                            self._apply_recipe(p, recipe, coded, b.group in self._bn_adapter_m)
                    vh = b.var_handle
                    if vh is not None:
                        vh.wait(self._bn_timeout)
                        b.var_handle = None
                        stats.append(dict(vh.stats, name="var" + b.name[4:]))
                        g = self.param_groups[b.group]
                        for _n, p, _o, _k in b.entries:
                            if self.state.get(p, {}).get("birdnet_coded"):
                                self._refresh_variance(g, p, b.var_views[id(p)], b.var_scale.get(id(p), 1.0))
                self.last_stats = stats
                self._bn_synced = True
            finally:
                self._reset_step()

    def _reset_step(self) -> None:
        """Forget this step's bookkeeping; after a failed round, collect what is still in flight
        (the daemons fail a round everywhere, so these waits end) so the next step starts clean."""
        from birdnet.errors import BirdnetError
        for b in self._bn_buckets:
            for h in (b.handle, b.var_handle):
                if h is not None:
                    try:
                        h.wait(self._bn_timeout)
                    except BirdnetError:
                        pass
            b.handle = b.var_handle = None
            b.refresh = False
            b.ready.clear()
            b.scaled.clear()
            b.var_scale.clear()
            b.half_scale.clear()
            b.events.clear()
        for d in (self._bn_merge_of, self._bn_sign_of):
            for m in d.values():
                m.handle = m.var_handle = None
        self._bn_counts.clear()
        self._bn_next = 0

    def _unstage(self, b: _Bucket, p: torch.Tensor) -> None:
        view = b.views[id(p)]
        g = p.grad
        if g is not None and g.device == view.device and g.data_ptr() == view.data_ptr():
            return  # autograd accumulated straight into shared memory; the result is already there
        if p.device.type == "cpu" and NUMPY_TO_TORCH.get(b.dtype) == p.dtype and p.is_contiguous():
            p.grad = view  # no copy: .grad is the bucket slice
        elif g is None:
            p.grad = view.to(device=p.device, dtype=p.dtype, copy=True)
        else:
            g.copy_(view, non_blocking=p.device.type == "cuda")

    def load_state_dict(self, state_dict) -> None:
        """The wrapped optimizer's ``load_state_dict``, then the recipe is arranged again and the
        carry restarted from the saved momentum (see Checkpoints in the module docstring)."""
        super().load_state_dict(state_dict)
        if self._bn_mode is not False:
            self._arrange()
        self._restart_carry()

    def step(self, closure=None):
        """Wait for the gradients' all-reduce (unless :meth:`synchronize` was called since the
        last backward, e.g. to clip the averaged gradients), then step the wrapped optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._bn_synced:
            self.synchronize()
        self._bn_synced = False
        frozen = [(gi, p) for gi, (kind, _b, _d) in self._bn_recipe.items() if kind == "adam"
                  for p in self.param_groups[gi]["params"]
                  if p.grad is not None and self.state.get(p, {}).get("birdnet_coded")]
        grads = [p.grad for _gi, p in frozen]
        for _gi, p in frozen:
            p.grad = None  # Adam skips them: the frozen-variance update below is theirs
        try:
            super().step()
        finally:
            for (_gi, p), gr in zip(frozen, grads):
                p.grad = gr
        for gi, p in frozen:
            self._frozen_adam_update(self.param_groups[gi], p)
        if self._bn_warmup is None:
            self._decide_warmup()
        for g in self.param_groups:
            g["birdnet_step"] = int(g.get("birdnet_step", 0)) + 1
        return loss

    def remove_hooks(self) -> None:
        """Detach from the parameters (the optimizer then no longer all-reduces)."""
        for h in self._bn_hooks:
            h.remove()
        self._bn_hooks = []


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         codec: str | None = None, codec_params: Mapping[str, Any] | None = None, *,
                         bucket_bytes: int = BUCKET_BYTES, client: Client | None = None,
                         socket: str | None = None, job: str = "default", momentum_in_codec: bool | None = None,
                         warmup_steps: int | None = None, backward_passes_per_step: int = 1, timeout: float | None = None,
                         overlap: bool = True) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so gradients are averaged over all processes of the job before each step.

    The result is an instance of a subclass of ``type(optimizer)`` sharing its ``param_groups`` and
    ``state`` (so LR schedulers and checkpoints work as before), with :meth:`synchronize` and
    :meth:`remove_hooks` added.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        Any optimizer; torch's SGD, Adam and AdamW get the automatic recipe (module docstring).
    named_parameters : iterable of (str, Tensor), optional
        ``model.named_parameters()``: gives every bucket a stable, readable name (the daemon keys
        codec state by name). Without it parameters are named by group and position.
    codec, codec_params : optional
        Default codec for groups without ``"birdnet_codec"`` / ``"birdnet_codec_params"``; None = the
        daemons' default.
    bucket_bytes : int
        Largest bucket in bytes (a single larger parameter gets a bucket of its own). An Adam/AdamW
        group with a sign codec (``marsit``, ``signcascade``, ``efsign``) gives each parameter of at
        least 1024 elements a bucket of its own (its own unit, so one sign scale fits), its smaller
        ones share dense buckets; its buckets travel together in rounds of at most ``bucket_bytes``.
    client : Client, optional
        The connection to use; else one from :func:`init` (``socket``, ``job``).
    momentum_in_codec : bool or None
        None (default): automatic, the recipe for SGD, Adam and AdamW with a compressing codec that
        has a momentum parameter, a warning for other optimizers. True: the same, and an error
        where no recipe applies. False: nothing arranged (the optimizer steps on the decompressed
        average).
    warmup_steps : int or None
        Steps whose gradients travel dense before compression starts (counted per param group in
        ``"birdnet_step"``, which checkpoints carry). None: automatic; when an Adam/AdamW group is
        arranged, until its second moment has settled (relative L1 change of at most
        ``ADAM_WARMUP_CHANGE`` over ``ADAM_WARMUP_WINDOW`` steps), ``ADAM_WARMUP_STEPS`` (40) at
        most, the step kept in each group as ``"birdnet_warmup_end"``; else 0.
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
    _validate_codecs(optimizer, codec, codec_params)
    if client is None:
        client = Client(socket, job=job) if socket is not None else init(job=job)
    cls = type(f"Distributed{type(optimizer).__name__}", (_DistributedOptimizer, type(optimizer)), {})
    dist = cls.__new__(cls)
    dist.__dict__.update(optimizer.__dict__)  # the same param_groups and state objects, not copies
    dist._birdnet_setup(named_parameters, codec, codec_params, bucket_bytes, client, momentum_in_codec,
                        warmup_steps, backward_passes_per_step, timeout, overlap)
    dist._restart_carry()  # a restored state wrapped: its codec state is not in the daemons
    return dist


# The torch.distributed backend "birdnet" and the DDP hook (birdnet.client.torch_dist), only where
# torch.distributed exists: NVIDIA's Jetson wheels lack it, and there this module is the wrapper alone.
if torch.distributed.is_available():
    from birdnet.client.torch_dist import HookState, comm_hook, init_process_group
    from birdnet.client.torch_dist import register as _register_backend

    _register_backend()
    __all__ += ["HookState", "comm_hook", "init_process_group"]
