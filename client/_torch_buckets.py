"""The PyTorch adapter's buckets (``birdnet.client.torch``): the flat shared-memory arrays that
gradients are copied into by the hooks (:class:`_Bucket`), and the rounds that carry several of
them (:class:`_Merged`, seen by each member through :class:`_MemberHandle`). How they are used:
the adapter's module docstring, "How gradients travel"."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from birdnet.client import Client, Handle


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
        self.scaled: set[int] = set()  # params sent divided by Adam's frozen denominator this step
        self.handle: Handle | None = None
        #: a variance refresh (ADAM_REFRESH_STEPS): the raw gradients, all-reduced dense beside the codec
        self.var: torch.Tensor | None = None
        self.var_array: np.ndarray | None = None
        self.var_views: dict[int, torch.Tensor] = {}
        self.var_scale: dict[int, float] = {}  # id(param) -> the refresh's power of two (_half_scale)
        self.half_scale: dict[int, float] = {}  # id(param) -> its power of two when ``dense`` travels in fp16
        self.var_handle: Handle | None = None
        self.refresh = False  # this step's raw gradients are staged in ``var``
        self.coded = False  # the codec compressed this bucket last step (not the dense threshold)
        #: always dense: the small tensors of a group whose big ones travel alone. Not padded: the
        #: daemons honour a call's fp16 under their dense_threshold (Codec.any_size)
        self.dense = False
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

    def allocate_var(self, client: Client) -> None:
        """The refresh buffer, made at the first refresh (most runs never need one)."""
        if self.var_array is None:
            self.var_array = client.buffer((max(self.numel, 1),), self.dtype)
            self.var_array[...] = 0
            self.var = torch.from_numpy(self.var_array)
            for _name, p, off, n in self.entries:
                self.var_views[id(p)] = self.var[off:off + n].view(p.shape)


class _Merged:
    """One round carrying several buckets of a sign-codec Adam group (runs of them, at most
    ``bucket_bytes``): the members are copied into one shared-memory array, reduced in one round,
    and copied back (:class:`_MemberHandle`).

    During the warm-up (``kind="warm"``) they travel dense: one round per tensor would cost a round
    trip of the ring per tensor, each small enough that the daemons send it gathered (N-1 copies
    of the whole tensor instead of the ring's 2(N-1)/N): at 4 nodes twice the ring's bytes.

    After it (``kind="sign"``, the big tensors only) they travel with the sign codec in one round
    instead of one per tensor: on a node every round runs its own ring schedule after the
    previous one (2(N-1) hops and a commit), so a step of 11 tensors cost 11 of them. The codec
    has one scale per round, and one scale for tensors of different gradient size would step the
    ones with small gradients many times Adam's step; so each member travels divided by its own
    unit, the mean RMS gradient of its frozen second moment (``birdnet_unit`` in the optimizer
    state, the same on every process, recomputed after each variance refresh), and is multiplied
    by it on the way back: one scale for a round whose members are all of about unit size. The
    codec's state (momentum, compensation) is the round's, under its name, in those units."""

    def __init__(self, index: int, members: list[_Bucket], kind: str = "warm") -> None:
        self.members = members
        self.offsets: dict[int, int] = {}
        n = 0
        for b in members:
            self.offsets[b.index] = n
            n += max(b.numel, 1)
        self.numel = n
        self.array: np.ndarray | None = None
        self.handle: Handle | None = None
        self.waited = False  # the round's result is in ``array``
        self.name = f"{kind}/{index}/{members[0].entries[0][0]}"
        #: the members' variance refreshes (_Bucket.var), in one round too; made at the first
        self.var_array: np.ndarray | None = None
        self.var_handle: Handle | None = None
        self.var_waited = False
        self.var_name = f"var-{kind}/{index}/{members[0].entries[0][0]}"

    def allocate(self, client: Client) -> None:
        self.array = client.buffer((self.numel,), self.members[0].dtype)
        self.array[...] = 0

    def allocate_var(self, client: Client) -> None:
        if self.var_array is None:
            self.var_array = client.buffer((self.numel,), self.members[0].dtype)
            self.var_array[...] = 0

    def slice(self, b: _Bucket, var: bool = False) -> np.ndarray:
        off = self.offsets[b.index]
        return (self.var_array if var else self.array)[off:off + max(b.numel, 1)]


class _MemberHandle:
    """A member bucket's view of a :class:`_Merged` round: ``wait()`` waits for the round (once)
    and copies the member's part back into its own array (times ``unit``, the member's travel
    unit, when it is not 1); the round's figures are the last member's (the others report 0
    bytes, so summing ``last_stats`` counts the round once)."""

    def __init__(self, merged: _Merged, b: _Bucket, unit: float = 1.0, var: bool = False) -> None:
        self.merged, self.b, self.unit, self.var = merged, b, unit, var
        self.stats: dict[str, Any] = {}

    def wait(self, timeout: float | None = None) -> None:
        m, b = self.merged, self.b
        h = m.var_handle if self.var else m.handle
        if h is not None and not (m.var_waited if self.var else m.waited):
            h.wait(timeout)
            if self.var:
                m.var_waited = True
            else:
                m.waited = True
        dst = b.var_array if self.var else b.array
        if self.unit != 1.0:
            np.multiply(m.slice(b, self.var), b.dtype.type(self.unit), out=dst)
        else:
            np.copyto(dst, m.slice(b, self.var))
        st = h.stats if h is not None else {}
        name = m.var_name if self.var else m.name
        last = b is m.members[-1]
        self.stats = dict(st, merged_into=name) if last else {
            "codec": st.get("codec", "none"), "bytes_sent": 0, "merged_into": name}


def _pin(t: torch.Tensor) -> None:  # pragma: no cover - CUDA path, untested here
    """Page-lock shared memory so device-to-host copies into it can be asynchronous."""
    try:
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(getattr(rc, "value", rc)) != 0:
            raise RuntimeError(f"cudaHostRegister returned {rc}")
    except Exception:  # noqa: BLE001 - pageable memory still works, only synchronously
        pass
