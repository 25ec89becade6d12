"""Helpers shared by birdnet's own codecs: input checks, payload validation, error-feedback state.

Error feedback and momentum correction (bird.md section 4, DGC style) use the same state layout in
every codec that offers them::

    state["v"]  float32[n]  accumulator / residual (what was not sent yet)
    state["u"]  float32[n]  momentum (only when momentum > 0)

    with momentum:    u = momentum*u + x ; v = v + u ; send part of v ; clear sent part from v and u
    without:          v = v + x ; send part of v ; keep the rest in v

With momentum correction the ring's result is the mean of what was sent and the training code
applies it with plain SGD (params -= lr * result): the momentum lives in the codec state.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from birdnet.codecs.base import Codec, Payload, RoundContext, StateTxn, overwrite, peek
from birdnet.errors import CodecError


def check_input(codec: str, x: np.ndarray, ctx: RoundContext) -> int:
    """Validate a node's contribution; return n. A fix-it message names the problem."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1 or not x.flags.c_contiguous:
        raise CodecError(
            f"codec {codec!r}, tensor {ctx.name!r}: input must be a 1-D C-contiguous float32 array, got "
            f"{getattr(x, 'dtype', type(x).__name__)} with shape {getattr(x, 'shape', '?')} "
            "(convert with np.ascontiguousarray(x, dtype=np.float32).ravel())")
    n = ctx.size
    if x.shape[0] != n:
        raise CodecError(f"codec {codec!r}, tensor {ctx.name!r}: input has {x.shape[0]} elements but "
                         f"the round's shape {ctx.shape} has {n}")
    return n


def check_out(codec: str, out: np.ndarray, ctx: RoundContext) -> None:
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 1
            or not out.flags.c_contiguous or out.shape[0] != ctx.size):
        raise CodecError(f"codec {codec!r}, tensor {ctx.name!r}: output must be a 1-D C-contiguous "
                         f"float32 array of {ctx.size} elements")


def header_int(codec: str, header: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = header.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not (lo <= v <= hi):
        raise CodecError(f"{codec}: payload header {key}={v!r} is not an integer in [{lo}, {hi}]")
    return v


def header_float(codec: str, header: dict[str, Any], key: str) -> float:
    v = header.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise CodecError(f"{codec}: payload header {key}={v!r} is not a number")
    return float(v)


def expect_buffer(codec: str, buf: np.ndarray, what: str, dtypes: tuple[str, ...], length: int) -> None:
    if buf.dtype.str not in dtypes:
        raise CodecError(f"{codec}: payload {what} has dtype {buf.dtype.str}, expected {' or '.join(dtypes)}")
    if buf.shape[0] != length:
        raise CodecError(f"{codec}: payload {what} has {buf.shape[0]} items, the header implies {length}")


def check_n(codec: str, header: dict[str, Any], ctx: RoundContext) -> int:
    n = header_int(codec, header, "n", 0, 1 << 62)
    if n != ctx.size:
        raise CodecError(f"{codec}: payload for tensor {ctx.name!r} has n={n}, the round's shape "
                         f"{ctx.shape} has {ctx.size} elements")
    return n


def index_dtype(n: int) -> type:
    """Smallest unsigned index type for ids in [0, n)."""
    return np.uint16 if n <= 1 << 16 else np.uint32


def feedback_params(codec: str, params: dict[str, Any]) -> dict[str, Any]:
    """Validate the shared ``error_feedback`` / ``momentum`` parameters."""
    ef = params.get("error_feedback")
    if not isinstance(ef, bool):
        raise CodecError(f"codec {codec!r}: error_feedback must be True or False, got {ef!r}")
    mom = params.get("momentum", 0.0)
    if isinstance(mom, bool) or not isinstance(mom, (int, float)) or not (0.0 <= float(mom) < 1.0):
        raise CodecError(f"codec {codec!r}: momentum must be a number in [0, 1), got {mom!r}")
    params["momentum"] = float(mom)
    if params["momentum"] > 0.0 and not ef:
        raise CodecError(f"codec {codec!r}: momentum correction accumulates what was not sent, so it "
                         "needs error_feedback=True")
    return params


def feedback_state(n: int, params: dict[str, Any]) -> dict[str, np.ndarray] | None:
    if not params.get("error_feedback"):
        return None
    st = {"v": np.zeros(n, np.float32)}
    if params.get("momentum", 0.0) > 0.0:
        st["u"] = np.zeros(n, np.float32)
    return st


def accumulate(x: np.ndarray, state: dict[str, np.ndarray], momentum: float) -> np.ndarray:
    """v (+)= x, with momentum correction when the state has u. Returns v (modified in place; in a
    round's StateTxn, written into a fresh array: the same float32 operations, no copy first)."""
    if isinstance(state, StateTxn):
        v = state.fresh("v")
        if "u" in state:
            u = state.fresh("u")
            np.multiply(state.original("u"), np.float32(momentum), out=u)
            u += x
            np.add(state.original("v"), u, out=v)
        else:
            np.add(state.original("v"), x, out=v)
        return v
    v = state["v"]
    if "u" in state:
        u = state["u"]
        u *= np.float32(momentum)
        u += x
        v += u
    else:
        v += x
    return v


def require_state(codec: str, state: Any, n: int, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    if not isinstance(state, dict) or any(k not in state or peek(state, k).shape[0] != n for k in keys):
        raise CodecError(f"codec {codec!r}: missing or mis-sized state (expected {', '.join(keys)} of "
                         f"{n} elements); create it with codec.new_state(n)")
    return state


class HopRequantised(Codec):
    """A SUMMABLE codec whose wire format re-encodes the partial sum at every hop (``lowbit``,
    ``ternary``): the values go to the ring as they are (plus the residual with
    ``params["error_feedback"]``), and the wire format writes each element's encoding error into
    ``state["v"]`` as the ring encodes it (every element once a round on every node)."""

    def new_state(self, n: int) -> Any:
        return {"v": np.zeros(n, np.float32)} if self.params["error_feedback"] else None

    def compress(self, x: np.ndarray, ctx: RoundContext, state: Any = None) -> Payload:
        n = check_input(self.name, x, ctx)
        if self.params["error_feedback"]:
            require_state(self.name, state, n, ("v",))
            return Payload(header={}, values=np.add(x, peek(state, "v")))
        return Payload(header={}, values=x.copy())

    def residual(self, state: Any) -> np.ndarray | None:
        """The array the round's wire format writes the encoding errors into (None without error
        feedback). It starts uninitialised: the ring writes every element's residual once."""
        return overwrite(state, "v") if self.params["error_feedback"] else None

    def decompress(self, payload: Payload, out: np.ndarray, ctx: RoundContext, state: Any = None) -> None:
        check_out(self.name, out, ctx)
        out[:] = payload.values
