"""All-reduce of a pytree of arrays (JAX gradients, or nested dict/list/tuple of NumPy arrays).

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
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from birdnet.client import Client

from birdnet.errors import InputError

__all__ = ["allreduce_tree", "flatten", "unflatten"]

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
    out = result if result.dtype == dtype else result.astype(dtype)
    if jax is not None and isinstance(like, jax.Array):
        return jax.numpy.asarray(out)
    if isinstance(like, (bool, int, float)) and not isinstance(like, np.generic):
        return type(like)(out.reshape(()).item())
    if isinstance(like, np.generic):
        return out.reshape(())[()]
    return out


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
