"""PyTorch-native paths: the ``torch.distributed`` backend ``"birdnet"`` and a DDP communication hook.

Imported (and the backend registered) by ``birdnet.client.torch`` when ``torch.distributed`` is
available; NVIDIA's Jetson wheels lack it, and there ``birdnet.client.torch`` keeps its optimizer
wrapper only. Needs torch >= 2.1 (a backend creator may return a Python ``ProcessGroup`` subclass;
the optimizer wrapper needs 2.1 too); tested here with 2.13 on CPU only.

Example (one process per ``--local-size`` slot of each node's daemon; no ``MASTER_ADDR``)::

    import birdnet.client.torch as bnt
    bnt.init_process_group(job="cnn")               # rank and world size come from the local birdnetd
    model = torch.nn.parallel.DistributedDataParallel(Net())
    model.register_comm_hook(bnt.HookState(codec="birdplus", codec_params={"density": 0.01}),
                             bnt.comm_hook)           # optional: compressed buckets

How calls travel: each job's connection to the daemon is owned by one thread, to which collectives
are queued and which completes their futures (``birdnet.client._torch_engine``).

Collectives of the backend: ``all_reduce`` with SUM and AVG (the daemon's ``sum`` and ``mean``),
MIN, MAX, PRODUCT, BAND, BOR, BXOR (built from an all-gather, below); ``broadcast``; ``barrier``;
``all_gather`` and ``all_gather_into_tensor`` (and their coalesced forms); ``all_reduce_coalesced``.
Everything travels dense (codec ``none``) whatever the daemons' default codec: compression is
chosen per DDP bucket through :func:`comm_hook`, where the tensors have stable names.

All-gather: the daemon has no all-gather collective. DDP gathers only small tensors (at
construction it checks every rank's parameter shapes), so rank r writes its tensor into row r of a
zero ``(world, n)`` buffer and the buffer is summed: x + 0 is exact for every float and integer, and
every rank gets every row in one dense round (world times the bytes of a real all-gather; -0.0
comes back as +0.0). It is meant for small tensors, not for sharded training.

Not supported (raise :class:`birdnet.errors.UnsupportedError` naming the above): point-to-point
(send/recv), reduce-scatter, all-to-all, gather/scatter/reduce, and subgroups of fewer processes
than the job (``new_group``). CUDA tensors are staged through host memory (copied to the CPU on
the calling thread, the result copied back): **untested**, the development machine has no GPU.
"""
from __future__ import annotations

import os
import zlib
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from birdnet.client import Client, Handle
from birdnet.client._torch_engine import _Engine, _engine, _forget, _Staged, _target
from torch.futures import Future

from birdnet.errors import InputError, UnsupportedError

__all__ = ["BACKEND", "BirdnetProcessGroup", "HookState", "MIN_TORCH", "comm_hook", "init_process_group"]

BACKEND = "birdnet"
MIN_TORCH = "2.1"

SUPPORTED = ("all_reduce (SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR), all_reduce_coalesced, broadcast, "
             "barrier, all_gather, all_gather_into_tensor, all_gather_into_tensor_coalesced, on CPU tensors "
             "(CUDA staged through host memory), in the default group of all processes of the job")

_OP_NAMES = {}


def _op_name(op) -> str:
    if not _OP_NAMES:
        R = dist.ReduceOp
        for n in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
            if hasattr(R, n):
                _OP_NAMES[getattr(R, n)] = n
    op = getattr(op, "op", op)  # a ReduceOp wraps a RedOpType
    for k, v in _OP_NAMES.items():
        if op == k:
            return v
    return str(op)


_GATHERED = {
    "MIN": lambda x: x.amin(0), "MAX": lambda x: x.amax(0), "PRODUCT": lambda x: x.prod(0),
    "BAND": lambda x: _fold(torch.bitwise_and, x), "BOR": lambda x: _fold(torch.bitwise_or, x),
    "BXOR": lambda x: _fold(torch.bitwise_xor, x),
}


def _fold(fn, x: torch.Tensor) -> torch.Tensor:
    out = x[0].clone()
    for row in x[1:]:
        out = fn(out, row)
    return out


# -- the process group ----------------------------------------------------------------------------
class _Work(dist._Work):
    """A collective in flight: ``wait()`` blocks until the daemon's result is in the tensors."""

    def __init__(self, fut: Future) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._fut.wait()  # raises the collective's error; deadlines are the process group's timeout
        return True

    def get_future(self) -> Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001
            return False
        return True

    def exception(self):
        try:
            self._fut.value()
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    def result(self) -> list[torch.Tensor]:
        return self._fut.value()

    def synchronize(self) -> None:
        self._fut.wait()


class BirdnetProcessGroup(dist.ProcessGroup):
    """All processes of one birdnet job as a torch.distributed process group (see the module doc)."""

    def __init__(self, engine: _Engine, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._engine = engine
        self._rank, self._size = rank, size

    # torch asks these of Python process groups
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def getRank(self) -> int:  # noqa: N802
        return self._rank

    def getSize(self) -> int:  # noqa: N802
        return self._size

    def __repr__(self) -> str:
        c = self._engine.client
        return f"BirdnetProcessGroup(job={c.job!r}, rank={self._rank}, size={self._size}, socket={c.socket_path!r})"

    @property
    def client(self) -> Client:
        """The connection to the daemon; it belongs to the process group's thread: do not call it."""
        return self._engine.client

    def _run(self, start, finish, what: str) -> _Work:
        return _Work(self._engine.submit(start, finish, what))

    # -- all-reduce -------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None) -> _Work:
        tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        op = _op_name(opts.reduceOp if hasattr(opts, "reduceOp") else (opts if opts is not None else dist.ReduceOp.SUM))
        if op in _GATHERED:
            return self._gathered_reduce(tensors, op)
        if op not in ("SUM", "AVG"):
            raise UnsupportedError(f"all_reduce with op {op} is not supported by the birdnet backend; supported: {SUPPORTED}")
        staged = [_Staged(t) for t in tensors]
        for st in staged:
            if op == "AVG" and st.wire.kind != "f":
                raise InputError(f"all_reduce AVG of a {st.tensor.dtype} tensor: birdnet averages float tensors only; "
                                 "use SUM and divide, or convert to float")
        wire_op = "mean" if op == "AVG" else "sum"
        handles: list[Handle] = []

        def start(c: Client) -> Handle:
            for st in staged[:-1]:
                handles.append(_target(c.allreduce_async(st.array, op=wire_op, codec="none"), st))
            return _target(c.allreduce_async(staged[-1].array, op=wire_op, codec="none"), staged[-1])

        def finish(h: Handle) -> list[torch.Tensor]:
            for hh, st in zip([*handles, h], staged):
                st.result(hh.wait(0))
            return tensors

        if not staged:
            raise InputError("all_reduce of an empty list of tensors")
        return self._run(start, finish, f"all_reduce {op} of {len(tensors)} tensor(s)")

    def allreduce_coalesced(self, tensors, opts=None) -> _Work:
        tensors = list(tensors)
        op = _op_name(opts.reduceOp if hasattr(opts, "reduceOp") else dist.ReduceOp.SUM)
        if len({t.dtype for t in tensors}) > 1:
            raise InputError("all_reduce_coalesced needs tensors of one dtype")
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in tensors]) if tensors else torch.zeros(0)
        o = dist.AllreduceOptions()
        o.reduceOp = getattr(dist.ReduceOp, op)
        inner = self.allreduce([flat], o)

        def unflatten(fut: Future) -> list[torch.Tensor]:
            fut.value()
            off = 0
            with torch.no_grad():
                for t in tensors:
                    n = t.numel()
                    t.copy_(flat[off:off + n].view(t.shape))
                    off += n
            return tensors

        return _Work(inner.get_future().then(unflatten))

    def _gathered_reduce(self, tensors: list[torch.Tensor], op: str) -> _Work:
        if op.startswith("B") and any(t.is_floating_point() or t.is_complex() for t in tensors):
            raise InputError(f"all_reduce {op} of a {tensors[0].dtype} tensor: bitwise reductions need integer "
                             "or bool tensors")
        works = []
        for t in tensors:
            rows = torch.empty((self._size, *t.shape), dtype=t.dtype)
            works.append((t, rows, self._gather_rows(t, rows, f"all_reduce {op}")))

        def done(fut: Future) -> list[torch.Tensor]:
            for f in fut.value():
                f.value()  # raises a part's error
            with torch.no_grad():
                for t, rows, _w in works:
                    t.copy_(_GATHERED[op](rows.to(t.device)).to(t.dtype))
            return tensors

        return _Work(torch.futures.collect_all([w.get_future() for _t, _r, w in works]).then(done))

    # -- all-gather -------------------------------------------------------------------------------
    def _gather_rows(self, t: torch.Tensor, rows: torch.Tensor, what: str) -> _Work:
        """Every rank's ``t`` into ``rows[r]`` (a contiguous (world, *shape) tensor): a zero-padded
        buffer summed through the daemon (see the module doc for why)."""
        st = _Staged(t)
        n = int(t.numel())
        buf = np.zeros((self._size, n), dtype=st.wire)
        buf[self._rank] = st.array.reshape(-1)

        def start(c: Client) -> Handle:
            return c.allreduce_async(buf, op="sum", codec="none")

        def finish(h: Handle) -> list[torch.Tensor]:
            res = torch.from_numpy(h.wait(0)).view(rows.shape)
            with torch.no_grad():
                rows.copy_(res.to(rows.dtype))
            return [rows]

        return self._run(start, finish, f"{what} of a {tuple(t.shape)} {t.dtype} tensor")

    def allgather(self, output_tensors, input_tensors, opts=None) -> _Work:
        outs = [list(o) for o in output_tensors]
        ins = list(input_tensors)
        if len(outs) != len(ins):
            raise InputError(f"all_gather: {len(outs)} output lists for {len(ins)} input tensors")
        works = []
        for o, t in zip(outs, ins):
            if len(o) != self._size or any(x.numel() != t.numel() for x in o):
                raise InputError(f"all_gather: each output list needs {self._size} tensors of {t.numel()} elements "
                                 f"(one per rank), not {[x.numel() for x in o]}")
            rows = torch.empty((self._size, t.numel()), dtype=t.dtype)
            works.append((o, rows, self._gather_rows(t, rows, "all_gather")))

        def done(fut: Future):
            for f in fut.value():
                f.value()
            with torch.no_grad():
                for o, rows, _w in works:
                    for r, x in enumerate(o):
                        x.copy_(rows[r].view(x.shape))
            return outs

        if not works:
            raise InputError("all_gather of an empty list of tensors")
        return _Work(torch.futures.collect_all([w.get_future() for _o, _r, w in works]).then(done))

    def _allgather_base(self, output, input, opts=None) -> _Work:
        if output.numel() != self._size * input.numel():
            raise InputError(f"all_gather_into_tensor: output has {output.numel()} elements, needs world size "
                             f"{self._size} x {input.numel()}")
        rows = torch.empty((self._size, input.numel()), dtype=input.dtype)
        w = self._gather_rows(input, rows, "all_gather_into_tensor")

        def done(fut: Future):
            fut.value()
            with torch.no_grad():
                output.copy_(rows.view(output.shape))
            return [output]

        return _Work(w.get_future().then(done))

    def all_gather_single(self, output, input, opts=None) -> _Work:
        return self._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> _Work:
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        if not works:
            raise InputError("all_gather_into_tensor_coalesced of no tensors")

        def done(fut: Future):
            for f in fut.value():
                f.value()
            return list(outputs)

        return _Work(torch.futures.collect_all([w.get_future() for w in works]).then(done))

    # -- broadcast, barrier -----------------------------------------------------------------------
    def broadcast(self, tensors, opts=None) -> _Work:
        tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        root = int(getattr(opts, "rootRank", 0) or 0)
        staged = [_Staged(t) for t in tensors]
        handles: list[Handle] = []

        def start(c: Client) -> Handle:
            for st in staged:
                handles.append(_target(c._collective("broadcast", st.array, root=root), st))
            return handles[-1]

        def finish(_h: Handle) -> list[torch.Tensor]:
            for hh, st in zip(handles, staged):
                st.result(hh.wait(0))
            return tensors

        if not staged:
            raise InputError("broadcast of an empty list of tensors")
        return self._run(start, finish, f"broadcast from rank {root}")

    def barrier(self, opts=None) -> _Work:
        def finish(h: Handle) -> list[torch.Tensor]:
            h.wait(0)
            return []

        return self._run(lambda c: c._collective("barrier", None), finish, "barrier")

    # -- what the daemon cannot do ----------------------------------------------------------------
    def _unsupported(self, what: str):
        raise UnsupportedError(f"{what} is not supported by the birdnet backend; supported: {SUPPORTED}. "
                               "For other collectives create a Gloo group beside it (with a store every process "
                               "reaches) or use Gloo with bnt.comm_hook")

    def send(self, *a, **k):
        self._unsupported("send (point-to-point)")

    def recv(self, *a, **k):
        self._unsupported("recv (point-to-point)")

    def recv_anysource(self, *a, **k):
        self._unsupported("recv (point-to-point)")

    def reduce(self, *a, **k):
        self._unsupported("reduce")

    def gather(self, *a, **k):
        self._unsupported("gather")

    def scatter(self, *a, **k):
        self._unsupported("scatter")

    def reduce_scatter(self, *a, **k):
        self._unsupported("reduce_scatter")

    def _reduce_scatter_base(self, *a, **k):
        self._unsupported("reduce_scatter_tensor")

    def reduce_scatter_single(self, *a, **k):
        self._unsupported("reduce_scatter_tensor")

    def reduce_scatter_tensor_coalesced(self, *a, **k):
        self._unsupported("reduce_scatter_tensor")

    def alltoall(self, *a, **k):
        self._unsupported("all_to_all")

    def alltoall_base(self, *a, **k):
        self._unsupported("all_to_all_single")

    def all_to_all_single(self, *a, **k):
        self._unsupported("all_to_all_single")

    def allgather_coalesced(self, *a, **k):
        self._unsupported("all_gather_coalesced")


# -- creation -------------------------------------------------------------------------------------
_requested: dict[str, Any] = {}  #: what init_process_group asked for, read by the creator


def _check_launcher(client: Client) -> None:
    """The daemons number the processes; a launcher's environment must agree with them."""
    want = {"RANK": client.rank, "WORLD_SIZE": client.size, "LOCAL_RANK": client.local_rank,
            "LOCAL_WORLD_SIZE": client.local_size}
    bad = []
    for k, v in want.items():
        got = os.environ.get(k)
        if got is not None and got.strip() != str(v):
            bad.append(f"{k}={got} (birdnetd: {v})")
    if bad:
        raise InputError(
            f"the launcher's environment disagrees with birdnetd at {client.socket_path}: {', '.join(bad)}. "
            f"The daemons number the processes: this is node {client.node} of {client.world}, local rank "
            f"{client.local_rank} of --local-size {client.local_size}, so rank {client.rank} of {client.size}. "
            "Launch one process per --local-size slot on every node of the hosts file (torchrun: --nnodes "
            f"{client.world} --nproc-per-node {client.local_size} --node-rank <the node's line in the hosts file>), "
            "or unset RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE and read dist.get_rank()")


def _create(store, rank: int, size: int, timeout) -> BirdnetProcessGroup:
    """The backend creator torch calls (``Backend.register_backend``, non-extended API)."""
    job = _requested.get("job") or os.environ.get("BIRDNET_JOB", "default")
    socket = _requested.get("socket")
    t = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    e = _engine(job, socket, timeout=t)
    c = e.client
    if size != c.size or rank != c.rank:
        if size < c.size and _default_birdnet_group() is not None:
            raise UnsupportedError(f"a subgroup of {size} of the job's {c.size} processes (new_group) is not supported "
                                   f"by the birdnet backend; supported: {SUPPORTED}")
        raise InputError(f"torch.distributed asked for rank {rank} of {size}, but birdnetd at {c.socket_path} numbers "
                         f"this process rank {c.rank} of {c.size} (node {c.node} of {c.world}, local rank "
                         f"{c.local_rank} of {c.local_size}) for job {job!r}; call birdnet.client.torch."
                         "init_process_group(job=...), which takes both from the daemon, or pass those values")
    if e.timeout is None and t is not None:
        e.timeout = t
    return BirdnetProcessGroup(e, rank, size)


def _default_birdnet_group() -> BirdnetProcessGroup | None:
    if not dist.is_initialized():
        return None
    pg = dist.distributed_c10d._get_default_group()
    return pg if isinstance(pg, BirdnetProcessGroup) else None


def register() -> None:
    """Register the ``"birdnet"`` backend with torch.distributed (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def init_process_group(job: str = "default", socket: str | None = None, timeout: float | None = None) -> BirdnetProcessGroup:
    """Initialise torch.distributed on the ``birdnet`` backend, with this process's rank and the world
    size from its local daemon: no ``MASTER_ADDR``, no rendezvous (the daemons know the ring).

    Parameters
    ----------
    job : str
        The birdnet job (every process of the training run uses the same name).
    socket : str, optional
        The daemon's socket (default ``$BIRDNET_SOCKET``, else the daemon's default path).
    timeout : float, optional
        Seconds a collective may take before it fails with ``RoundTimeoutError``; None = no limit.

    Raises ``InputError`` when a launcher's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` disagree with the
    daemon, saying how to launch instead. Returns the default process group.
    """
    register()
    e = _engine(job, socket, timeout=timeout)
    c = e.client
    try:
        _check_launcher(c)
    except InputError:
        _forget(e)
        e.close()
        raise
    _requested.update(job=job, socket=c.socket_path)
    try:
        kw = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
        # an in-process store: the backend needs none, and init_process_group insists on one (or on
        # MASTER_ADDR); Gloo groups created later need a store all processes reach (see docs)
        dist.init_process_group(BACKEND, rank=c.rank, world_size=c.size, store=dist.HashStore(), **kw)
    finally:
        _requested.clear()
    pg = _default_birdnet_group()
    if pg is None:  # pragma: no cover - torch changed how Python groups are installed
        raise InputError("torch.distributed did not install the birdnet process group as the default group")
    return pg


def destroy(pg: BirdnetProcessGroup | None = None) -> None:
    """Destroy the default birdnet process group and close its connection to the daemon."""
    pg = pg or _default_birdnet_group()
    if dist.is_initialized():
        dist.destroy_process_group()
    if pg is not None:
        _forget(pg._engine)
        pg._engine.close()


# -- the DDP communication hook -------------------------------------------------------------------
class HookState:
    """State of :func:`comm_hook` for ``DistributedDataParallel.register_comm_hook``.

    Parameters
    ----------
    codec, codec_params : optional
        The codec for every bucket (e.g. ``"birdplus"``, ``{"density": 0.01}``); None = the daemons'
        default codec. Buckets under the daemons' ``dense_threshold`` travel dense.
    client : Client, optional
        The connection to use; it then belongs to the hook's thread. Default: the birdnet process
        group's (and its job) when the default group is birdnet's and ``socket``/``job`` name no
        other; else a new one (``socket``, ``job``), shared by the HookStates of that job.
    socket, job : optional
        Where and as what to connect when a new client is made. On Gloo use a job of its own.
    """

    def __init__(self, codec: str | None = None, codec_params: dict[str, Any] | None = None,
                 client: Client | None = None, socket: str | None = None, job: str = "default") -> None:
        if codec is not None:  # a bad codec or parameter fails here, not at DDP's first bucket
            from birdnet.codecs import validate
            validate(codec, dict(codec_params or {}))
        self.codec, self.codec_params = codec, dict(codec_params or {})
        self.client, self.socket, self.job = client, socket, job
        self._engine: _Engine | None = None
        self._own = False
        self._numbers: dict[int, int] = {}  #: id(param) -> its number, in the order buckets first show it
        self._names: dict[tuple[int, ...], str] = {}
        #: figures of the last round of every bucket (by name): bytes, ratio, codec, seconds
        self.last_stats: dict[str, dict[str, Any]] = {}

    def engine(self) -> _Engine:
        if self._engine is None:
            pg = _default_birdnet_group()
            if self.client is not None:
                self._engine = _engine(self.client.job, None, client=self.client)
            elif pg is not None and self.socket is None and self.job in ("default", pg.client.job):
                # DDP on the birdnet backend: the group's connection and job (one per job and process)
                self._engine = pg._engine
            else:
                self._engine = _engine(self.job, self.socket)
                self._engine.users += 1
                self._own = True
        return self._engine

    def close(self) -> None:
        """Close the connection the hook made for itself, once no other HookState of the job uses
        it (a passed client and the process group's are left alone)."""
        e, self._engine = self._engine, None
        if e is not None and self._own:
            self._own = False
            e.users -= 1
            if e.users <= 0:
                _forget(e)
                e.close()

    def bucket_name(self, params: list[torch.Tensor]) -> str:
        """A name for a bucket, the same on every rank, from its parameters: DDP hands buckets over in
        index order and builds them alike on every rank, so numbering parameters in the order buckets
        first show them gives every rank the same numbers. DDP rebuilds its buckets after the first
        iteration; a rebuilt bucket holds other parameters, so it gets another name (and fresh codec
        state in the daemon), and the state of a bucket always belongs to the same parameters."""
        nums = []
        for p in params:
            k = id(p)
            if k not in self._numbers:
                self._numbers[k] = len(self._numbers)
            nums.append(self._numbers[k])
        key = tuple(nums)
        name = self._names.get(key)
        if name is None:
            crc = zlib.crc32(np.asarray(key, np.int64).tobytes())
            name = self._names[key] = f"ddp/{nums[0]}-{nums[-1]}/{len(nums)}/{crc:08x}"
        return name


def comm_hook(state: HookState, bucket) -> Future:
    """DDP communication hook: the bucket is averaged through the local daemon, with ``state``'s
    codec (error feedback and compensation kept per bucket in the daemon, under a name derived from
    the bucket's parameters). Works with DDP on the birdnet backend and on any other (e.g. Gloo):
    the hook talks to the daemon itself. ``ddp.register_comm_hook(HookState(codec=...), comm_hook)``.
    """
    e = state.engine()
    buf = bucket.buffer()
    name = state.bucket_name(list(bucket.parameters()))
    st = _Staged(buf)
    if st.wire.kind != "f":
        raise InputError(f"DDP bucket {name!r} has dtype {buf.dtype}; birdnet averages float gradients")
    codec, params = state.codec, state.codec_params

    def start(c: Client) -> Handle:
        return _target(c.allreduce_async(st.array, op="mean", name=name, codec=codec, **params), st)

    def finish(h: Handle) -> torch.Tensor:
        st.result(h.wait(0))
        state.last_stats[name] = dict(h.stats)
        return buf

    # DDP reads an exception set on the hook's own future as its value ("Unable to cast <message>
    # to Tensor"); raised in a callback, it reaches the training loop with its class and message
    return e.submit(start, finish, f"DDP bucket {name!r}").then(_value)


def _value(fut: Future) -> torch.Tensor:
    return fut.value()



# DDP checks the hook's return annotation against the object itself, which postponed annotations
# (``from __future__ import annotations``) would leave as a string
comm_hook.__annotations__["return"] = Future[torch.Tensor]
