"""All-reduce of a pytree of arrays (JAX gradients, or nested dict/list/tuple of NumPy arrays), and
the slow-link mode (DiLoCo) on a pytree of parameters.

``import birdnet.client.jax as bnj``; JAX is optional. With JAX importable, trees are flattened with
``jax.tree_util`` (so any registered pytree node works, e.g. flax ``FrozenDict`` or optax states)
and JAX leaves come back as JAX arrays; without it, a small walker handles dict, list, tuple,
namedtuple and None, and leaves come back as NumPy arrays (Python scalars as Python scalars).

Example::

    grads = jax.grad(loss)(params, batch)
    grads = bnj.allreduce_tree(client, grads)                 # mean over all processes of the job
    params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)

Every leaf is its own tensor named ``name_prefix + "/" + path`` (e.g. ``grads/['dense']['w']``),
all started before the first is waited for; ``fuse=True`` instead packs the leaves of each dtype
into one array (one round per dtype: far fewer rounds for many small leaves, but a compressing
codec then sees one tensor). Leaf dtypes are kept; bfloat16 travels as float32, and integer leaves
need ``op="sum"``.

Slow-link mode (:class:`OuterLoopTree`, the framework-free :class:`birdnet.client.diloco.OuterLoop`
on a pytree). JAX arrays are immutable, so the loop takes the parameters each step and returns the
tree to continue from::

    params = ...                                              # identical on every process
    loop = bnj.OuterLoopTree(client, params)                  # OuterLoop's keywords: sync_every=, codec=, ...
    for batch in data:
        params, opt_state = inner_step(params, opt_state, batch)
        params = loop.step(params)                            # the same tree, or the synced one
    params = loop.flush(params)
    outer = loop.outer_parameters()                           # bit-identical on every process
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from birdnet.client import Client
from birdnet.client.diloco import OuterLoop

from birdnet.errors import InputError

__all__ = ["OuterLoopTree", "allreduce_tree", "flatten", "unflatten"]

try:  # pragma: no cover - depends on the environment
    import jax
    from jax import tree_util as _tu
except ImportError:  # pragma: no cover
    jax = None
    _tu = None


# -- flattening -----------------------------------------------------------------------------------
def _walk(tree: Any, path: str, leaves: list[tuple[str, Any]]) -> Callable[[list[Any]], Any]:
    """Collect leaves depth-first; return a function rebuilding the tree from new leaves (consumed
    from the front of the list). Dict keys are visited sorted, as jax.tree_util does."""
    if tree is None:
        return lambda it: None
    if isinstance(tree, dict):
        keys = sorted(tree, key=lambda k: (type(k).__name__, k))
        builders = [(k, _walk(tree[k], f"{path}[{k!r}]", leaves)) for k in keys]
        cls = type(tree)

        def build_dict(it):
            out = {k: b(it) for k, b in builders}
            return out if cls is dict else cls(out)
        return build_dict
    if isinstance(tree, (list, tuple)):
        builders = [_walk(v, f"{path}[{i}]", leaves) for i, v in enumerate(tree)]
        cls = type(tree)
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
            return lambda it: cls(*[b(it) for b in builders])
        return lambda it: cls([b(it) for b in builders])
    leaves.append((path, tree))
    return lambda it: it.pop(0)


def flatten(tree: Any) -> tuple[list[tuple[str, Any]], Callable[[list[Any]], Any]]:
    """``([(path, leaf), ...], rebuild)`` where ``rebuild(new_leaves)`` gives a tree of the same
    structure. Uses jax.tree_util when JAX is importable."""
    if _tu is not None:
        with_path, treedef = _tu.tree_flatten_with_path(tree)
        return ([(_tu.keystr(p), leaf) for p, leaf in with_path],
                lambda new: _tu.tree_unflatten(treedef, list(new)))
    leaves: list[tuple[str, Any]] = []
    build = _walk(tree, "", leaves)
    return leaves, lambda new: build(list(new))


def unflatten(rebuild: Callable[[list[Any]], Any], leaves: list[Any]) -> Any:
    return rebuild(leaves)


# -- leaves ---------------------------------------------------------------------------------------
def _to_numpy(leaf: Any, path: str) -> tuple[np.ndarray, np.dtype]:
    """A NumPy array the daemon can reduce, and the dtype the result must have."""
    arr = np.asarray(leaf)
    dtype = arr.dtype
    if dtype.kind not in "fiub":
        if dtype.name == "bfloat16":  # ml_dtypes' bfloat16 (what JAX hands NumPy)
            return arr.astype(np.float32), dtype
        raise InputError(f"leaf {path or '(root)'} has dtype {dtype}, which cannot be all-reduced")
    if dtype.kind == "b":
        return arr.astype(np.int32), dtype
    return arr, dtype


def _from_numpy(result: np.ndarray, like: Any, dtype: np.dtype) -> Any:
    return _as_kind(result, _kind(like), dtype, copy=False)


# -- the collective -------------------------------------------------------------------------------
def allreduce_tree(client: Client, tree: Any, op: str = "mean", name_prefix: str = "tree", *,
                   fuse: bool = False, timeout: float | None = None, codec: str | None = None,
                   **codec_params: Any) -> Any:
    """Average (or sum) every leaf of ``tree`` over all processes of the job.

    Parameters
    ----------
    client : Client
        This process's connection to its daemon.
    tree : pytree
        Nested dict/list/tuple (any JAX pytree when JAX is installed) of arrays or scalars; every
        process passes the same structure, shapes and dtypes.
    op : {"mean", "sum"}
    name_prefix : str
        Prefix of the tensor names; give each tree that you reduce a different one (codec state is
        kept per name).
    fuse : bool
        Pack the leaves of each dtype into one tensor (one round per dtype).
    timeout : float, optional
        Seconds to wait for each round.
    codec, codec_params :
        As for :meth:`Client.allreduce`.

    Returns
    -------
    A tree of the same structure whose leaves keep their dtypes (and their kind: JAX array, NumPy
    array, NumPy scalar or Python scalar).
    """
    leaves, rebuild = flatten(tree)
    prepared = [(path, leaf, *_to_numpy(leaf, path)) for path, leaf in leaves]
    results: list[np.ndarray | None] = [None] * len(prepared)
    kw = dict(op=op, codec=codec, **codec_params)
    if not fuse:
        handles = [client.allreduce_async(arr, name=f"{name_prefix}/{path}", **kw)
                   for path, _leaf, arr, _dt in prepared]
        for i, h in enumerate(handles):
            results[i] = h.wait(timeout)
    else:
        by_dtype: dict[np.dtype, list[int]] = {}
        for i, (_p, _l, arr, _dt) in enumerate(prepared):
            by_dtype.setdefault(arr.dtype, []).append(i)
        order = sorted(by_dtype, key=lambda d: d.name)  # the same on every process
        flats = []
        for dt in order:
            idx = by_dtype[dt]
            flat = np.concatenate([prepared[i][2].reshape(-1) for i in idx]) if idx else np.zeros(0, dt)
            flats.append(client.allreduce_async(flat, name=f"{name_prefix}/fused/{dt.name}", **kw))
        for dt, h in zip(order, flats):
            flat = h.wait(timeout)
            off = 0
            for i in by_dtype[dt]:
                arr = prepared[i][2]
                results[i] = flat[off:off + arr.size].reshape(arr.shape)
                off += arr.size
    new = [_from_numpy(r, leaf, dt) for r, (_p, leaf, _a, dt) in zip(results, prepared)]
    return rebuild(new)


# -- the slow-link mode on a pytree ---------------------------------------------------------------
def _kind(leaf: Any) -> Any:
    """What a leaf is, to hand a synced value back as the same kind (see :func:`_as_kind`)."""
    if jax is not None and isinstance(leaf, jax.Array):
        return "jax"
    if isinstance(leaf, np.generic):
        return "generic"
    if isinstance(leaf, (bool, int, float)):
        return type(leaf)
    return "numpy"


def _as_kind(arr: np.ndarray, kind: Any, dtype: np.dtype, copy: bool = True) -> Any:
    """``arr`` as a leaf of ``kind`` and ``dtype``; a fresh copy unless ``copy=False`` (the outer
    loop's arrays change at the next sync; a leaf handed out must not)."""
    out = arr.astype(dtype, copy=copy)
    if kind == "jax":
        return jax.numpy.asarray(out)
    if kind == "generic":
        return out.reshape(())[()]
    if kind == "numpy":
        return out
    return kind(out.reshape(()).item())


class OuterLoopTree:
    """DiLoCo's outer loop (:class:`~birdnet.client.diloco.OuterLoop`) on a pytree of parameters
    whose leaves cannot be updated in place (JAX arrays), or need not be (NumPy trees).

    The loop keeps a NumPy array per leaf (float32; float64 leaves keep float64): the outer loop
    works on those. :meth:`step` takes the tree the inner step produced and returns the tree to
    continue from: the same object between syncs (nothing is copied then), a new tree after a
    sync changed the parameters (new leaves of the same kind and dtype: JAX arrays stay JAX arrays,
    bfloat16 stays bfloat16). The leaves are copied into the loop's arrays only when a sync reads
    them (and before a late result is mixed in, with ``overlap``), not every step.

    Every process holds bit-identical outer parameters after every sync (OuterLoop's guarantee);
    without ``overlap`` the tree returned by a sync is the outer parameters in each leaf's dtype,
    so it is bit-identical on every process as well.

    Parameters
    ----------
    client : Client
        This process's connection to its daemon.
    params : pytree
        The parameters, identical on every process (e.g. from the same seed, or broadcast first);
        every process passes the same structure. Leaves: floating arrays or Python floats (float16,
        bfloat16, float32, float64). Each leaf is a tensor named by its path (``['dense']['w']``).
    **options
        :class:`~birdnet.client.diloco.OuterLoop`'s keywords: ``sync_every``, ``outer_lr``,
        ``outer_momentum``, ``nesterov``, ``fragments``, ``overlap``, ``codec``, ``codec_params``,
        ``timeout``; unset ones take its defaults.

    Attributes
    ----------
    loop : OuterLoop
        The loop underneath (its schedule, counters, ``last_stats``, ``state_dict()``).
    """

    def __init__(self, client: Client, params: Any, **options: Any) -> None:
        leaves, self._rebuild = flatten(params)
        if not leaves:
            raise InputError("OuterLoopTree: the parameter tree has no leaves")
        self._paths = [p for p, _leaf in leaves]
        self._kinds, self._dtypes, arrays = [], [], []
        for path, leaf in leaves:
            arr = np.asarray(leaf)
            if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
                raise InputError(f"OuterLoopTree: leaf {path or '(root)'} has dtype {arr.dtype}; the outer loop "
                                 "averages floating parameters only (keep counters and integer state outside the tree)")
            self._kinds.append(_kind(leaf))
            self._dtypes.append(arr.dtype)
            arrays.append(np.array(arr, dtype=np.float64 if arr.dtype == np.float64 else np.float32, order="C"))
        self._arrays = arrays
        self._current: Any = params
        self._changed = False
        self.loop = OuterLoop(client, list(zip(self._paths, arrays)), pull=self._pull, push=self._push, **options)
        self._current = None  # hold no reference to the caller's tree between steps

    # -- the loop's hooks: the tree in, the arrays out ----------------------------------------------
    def _pull(self) -> None:
        leaves, _ = flatten(self._current)
        paths = [p for p, _leaf in leaves]
        if paths != self._paths:
            raise InputError(f"OuterLoopTree: the tree's structure changed ({len(paths)} leaves, "
                             f"{len(self._paths)} when the loop was made); pass the tree of the same model each step")
        for (path, leaf), a in zip(leaves, self._arrays):
            v = np.asarray(leaf)
            if v.shape != a.shape:
                raise InputError(f"OuterLoopTree: leaf {path} has shape {v.shape}, {a.shape} when the loop was made")
            a[...] = v

    def _push(self) -> None:
        self._changed = True

    def _tree(self, arrays: list[np.ndarray]) -> Any:
        return self._rebuild([_as_kind(a, k, dt) for a, k, dt in zip(arrays, self._kinds, self._dtypes)])

    def _run(self, params: Any, call: Any) -> Any:
        self._current, self._changed = params, False
        try:
            call()
        finally:
            self._current = None
        return self._tree(self._arrays) if self._changed else params

    # -- the public loop ----------------------------------------------------------------------------
    def step(self, params: Any) -> Any:
        """Count one inner step taken to ``params``; a sync when one is due. Returns the tree to
        continue from: ``params`` itself, or a new tree after a sync changed the parameters."""
        return self._run(params, self.loop.step)

    def flush(self, params: Any) -> Any:
        """Apply every sync still in flight (``overlap``) to ``params``; returns the tree to continue from."""
        return self._run(params, self.loop.flush)

    def rejoin(self, params: Any, root: int = 0) -> Any:
        """Collective: process ``root``'s outer state goes to every process; returns the outer
        parameters as the tree to continue from (see :meth:`OuterLoop.rejoin`)."""
        return self._run(params, lambda: self.loop.rejoin(root))

    def outer_parameters(self) -> Any:
        """The outer parameters as a tree like ``params`` (bit-identical on every process after a sync)."""
        outer = self.loop.outer_parameters()
        return self._tree([outer[p] for p in self._paths])

    @property
    def last_stats(self) -> dict[str, Any]:
        """The last sync's figures (:attr:`OuterLoop.last_stats`: bytes, syncs, step, codec, ...)."""
        return dict(self.loop.last_stats)

    def state_dict(self) -> dict[str, Any]:
        """The outer state (:meth:`OuterLoop.state_dict`: NumPy arrays and ints)."""
        return self.loop.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Collective: restore :meth:`state_dict`'s outer state (:meth:`OuterLoop.load_state_dict`)."""
        self.loop.load_state_dict(sd)
