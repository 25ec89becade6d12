"""Common machinery of ``bird`` and ``birdplus``: block sampling with index sharing.

See docs/codecs.md (after BIRD, ICCD 2023, and BIRD+, IEEE TPDS 2024). What the abstracts state (index sharing
over blocks, two random stages, expectation invariance, Gamma correction, uniform-distribution
sampling) is the papers'; the concrete sampling (threshold from a block sample, systematic sampling,
the shared selection mode, bounded scaling, error feedback and momentum correction options) is
birdnet's design.

Compression of a tensor of n elements with blocks of b (m = ceil(n/b) blocks):

1. one pass over memory: block L1 norms a_i (fused with ``v += x`` / momentum when error feedback
   is on) — birdnet.kernels.blocks;
2. O(m) work on the norms only: probabilities p_i, then the selection (subclass);
3. gather of the kept blocks, scaled by ``exact`` 1/p_i, ``capped`` 1/max(p_i, 1/cap) or ``none``.

Modes:
``local``  GATHERED; payload = block ids (uint16 when m <= 65536, else uint32) + values
           (k*b float32 or float16, last block zero-padded). Stateless without error feedback.
``shared`` SUMMABLE; every node keeps the same blocks, so the values add up hop by hop in a
           reduce-scatter and the bytes per node do not grow with the number of nodes. The
           blocks of round t+1 are *proposed* in round t: the proposer(s) (``proposers="rotating"``:
           the node of rank (t+1) mod world, ScaleCom's cyclic local selection;
           ``"every"``: every node, density/world of the blocks each) write the ids of the top
           blocks of their own accumulator, after this round's send, into a tail of the summed
           values; the other nodes write zeros there, so the sum carries the ids exactly and every
           node decodes the same selection from the round's result. No protocol step is added;
           ``header["digest"]`` hashes the selection so a disagreement fails the round.

``feedback_lowpass`` (beta; 1 = off; default "auto": 0.5 in shared mode, 1 in local): ScaleCom's low-pass filter on the error feedback
(Chen et al., NeurIPS 2020), v <- (1 - beta) v + beta (v + x - sent). It bounds what a block
that is not selected can pile up (beta x per round instead of x), which is what hurt the shared
mode, whose selection cannot see every node's accumulator (docs/research/findings.md). State and
payload are unchanged; one more pass over v per round.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from birdnet.codecs import _common as C
from birdnet.codecs.base import Codec, Pattern, Payload, RoundContext, overwrite, peek
from birdnet.codecs.topk import density_param
from birdnet.errors import CodecError, RoundMismatchError
from birdnet.kernels import lazy

B = lazy("blocks")
rng = lazy("rng")

_SCALES = ("exact", "capped", "none")


def kept_blocks(density: float, m: int) -> int:
    """K = round(density * m), at least 1 for a non-empty tensor (bird.md 2; see docs for rho*m < 1)."""
    return 0 if m == 0 else max(1, min(m, int(np.floor(density * m + 0.5))))


_PROPOSERS = ("rotating", "every")
_ACCUMULATORS = ("elements", "block_age")


def id_digits(m: int, wire_dtype: str) -> tuple[int, int]:
    """(base, digits): a block id + 1 in [1, m] travels as ``digits`` floats of base ``base``, each
    an integer the wire dtype holds exactly (float16: 2**11, float32: 2**24), so x + 0 = x at every
    hop and the sum carries the proposer's ids bit for bit."""
    base = 1 << (11 if wire_dtype == "float16" else 24)
    d, top = 1, base
    while top < m + 1:
        d, top = d + 1, top * base
    return base, d


class BlockSamplingCodec(Codec):
    pattern = Pattern.GATHERED  # instances in ``shared`` mode set SUMMABLE in validate

    common_defaults: dict[str, Any] = {
        # Measured (docs/codecs.md, "Choosing the defaults"): blocks of 8 and a scale capped at 10x
        # reached dense accuracy on MNIST-1D at 4 and 8 workers with momentum correction; blocks
        # of 32 lost 7-8 points, an uncapped scale diverged, no scale lost 3-4 points at 8 workers.
        "density": 0.01, "block": 8, "mode": "local", "value_dtype": "float32",
        "scale": "capped", "cap": 10.0, "error_feedback": True, "momentum": 0.0,
        # shared mode: who proposes the next round's blocks (docs/codecs.md, "shared mode")
        "proposers": "every",
        # error feedback's memory: "elements" (v, 4 bytes per element) or "block_age" (2 bytes per
        # block: rounds since the block was last sent; the accumulator is estimated as
        # min(age, age_cap) x the momentum, docs/codecs.md "Error feedback in n/4 bytes")
        "accumulator": "elements", "age_cap": 10,
        # ScaleCom's low-pass filter on the error feedback (Chen et al., NeurIPS 2020):
        # v <- (1 - beta) v + beta (v + x - sent); 1.0 = plain error feedback. "auto": 0.5 in
        # shared mode with the element accumulator (through real daemons it trained better at 4
        # and 8 workers, docs/benchmarks.md), 1.0 otherwise (in local mode it lost 20 points)
        "feedback_lowpass": "auto",
    }

    # -- configuration ---------------------------------------------------------------------------
    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        name = self.name
        params["density"] = density_param(name, params)
        b = params["block"]
        if isinstance(b, bool) or not isinstance(b, int) or not (1 <= b <= 1 << 20):
            raise CodecError(f"codec {name!r}: block must be an integer in [1, 1048576], got {b!r}")
        if params["mode"] not in ("local", "shared"):
            raise CodecError(f"codec {name!r}: mode must be 'local' or 'shared', got {params['mode']!r}")
        if params["value_dtype"] not in ("float32", "float16"):
            raise CodecError(f"codec {name!r}: value_dtype must be 'float32' or 'float16', "
                             f"got {params['value_dtype']!r}")
        if params["scale"] not in _SCALES:
            raise CodecError(f"codec {name!r}: scale must be one of {', '.join(_SCALES)}, got {params['scale']!r}")
        cap = params["cap"]
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not float(cap) >= 1.0:
            raise CodecError(f"codec {name!r}: cap must be a number >= 1, got {cap!r}")
        params["cap"] = float(cap)
        if params["proposers"] not in _PROPOSERS:
            raise CodecError(f"codec {name!r}: proposers (who picks the shared mode's next blocks) must be "
                             f"one of {', '.join(_PROPOSERS)}, got {params['proposers']!r}")
        if params["accumulator"] not in _ACCUMULATORS:
            raise CodecError(f"codec {name!r}: accumulator must be one of {', '.join(_ACCUMULATORS)}, "
                             f"got {params['accumulator']!r}")
        ac = params["age_cap"]
        if isinstance(ac, bool) or not isinstance(ac, int) or not (1 <= ac <= 65535):
            raise CodecError(f"codec {name!r}: age_cap (rounds of momentum a block-age accumulator stands "
                             f"for at most) must be an integer in [1, 65535], got {ac!r}")
        lp = params["feedback_lowpass"]
        if lp == "auto":
            lp = 0.5 if (params["mode"] == "shared" and params["error_feedback"] is True
                         and params["accumulator"] == "elements") else 1.0
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not (0.0 < float(lp) <= 1.0):
            raise CodecError(f"codec {name!r}: feedback_lowpass (the beta of ScaleCom's low-pass filter on "
                             f"the error feedback; 1 = off) must be a number in (0, 1] or 'auto', got {lp!r}")
        params["feedback_lowpass"] = float(lp)
        if params["feedback_lowpass"] < 1.0 and (not params["error_feedback"]
                                                 or params["accumulator"] != "elements"):
            raise CodecError(f"codec {name!r}: feedback_lowpass filters the element accumulator: it needs "
                             "error_feedback=True and accumulator='elements'")
        params = C.feedback_params(name, params)
        shared = params["mode"] == "shared"
        # instance attributes: the daemon reads codec.pattern / codec.wire_dtype from the instance
        self.pattern = Pattern.SUMMABLE if shared else Pattern.GATHERED
        self.wire_dtype = params["value_dtype"] if shared else "float32"
        return params

    # -- state -----------------------------------------------------------------------------------
    def new_state(self, n: int):
        prm = self.params
        if prm["error_feedback"] and prm["accumulator"] == "block_age":
            st = {"age": np.zeros(-(-n // prm["block"]), np.uint16)}
            if prm["momentum"] > 0.0:
                st["u"] = np.zeros(n, np.float32)
        else:
            st = C.feedback_state(n, prm) or {}
        if self.params["mode"] == "shared":
            # this round's selection, decoded from the last round's result (identical on every
            # node); "round" says which tensor_round it is for, -1 = none yet
            st["ids"] = np.empty(0, np.int64)
            st["round"] = np.full(1, -1, np.int64)
        return st or None

    # -- selection (subclasses) ------------------------------------------------------------------
    def _local_selection(self, norms: np.ndarray, amax: float,
                         ctx: RoundContext) -> tuple[np.ndarray, np.ndarray]:
        """(p of the kept blocks: float64, ascending kept ids: int64) from this node's block norms
        (``amax``: the largest finite norm)."""
        raise NotImplementedError

    # -- shared mode: the selection of this round and the proposal for the next ------------------
    def _slots(self, m: int, world: int) -> tuple[int, int]:
        """(proposal slots per proposer, proposers): K in total, identical on every node."""
        k = kept_blocks(self.params["density"], m)
        if self.params["proposers"] == "rotating" or world <= 1:
            return k, 1
        return (max(1, k // world) if k else 0), world

    def _tail_len(self, m: int, world: int) -> int:
        per, nprop = self._slots(m, world)
        return per * nprop * id_digits(m, self.wire_dtype)[1]

    def _current(self, state: Any, m: int, ctx: RoundContext) -> tuple[np.ndarray, int]:
        """(ascending ids kept this round, digest). The ids proposed in the previous round, or, when
        there were none (the tensor's first round, or a round missed), K blocks drawn uniformly from
        the cluster seed: the same on every node either way."""
        st = C.require_state(self.name, state, 0, ())
        if "ids" not in st or "round" not in st:
            raise CodecError(f"codec {self.name!r}: shared-mode state lacks its selection; create it "
                             "with codec.new_state(n)")
        if int(st["round"][0]) == ctx.tensor_round:
            ids = st["ids"]
        else:
            k = kept_blocks(self.params["density"], m)
            ids = np.sort(B.uniform_blocks(ctx.seed, m, k))
        return ids, rng.digest(ctx.seed, ids)

    def _propose(self, post: np.ndarray, tail: np.ndarray, m: int, ctx: RoundContext) -> None:
        """Write this node's proposal (ids + 1 in digits) into its slots of ``tail`` (zeros else)."""
        per, nprop = self._slots(m, ctx.world)
        tail[:] = 0.0
        if per == 0:
            return
        nxt = (ctx.tensor_round + 1) % ctx.world
        if nprop == 1 and ctx.rank != nxt:
            return
        slot = 0 if nprop == 1 else (ctx.rank - nxt) % ctx.world  # slot order rotates too
        ids = B.top_blocks(post, per)
        base, d = id_digits(m, self.wire_dtype)
        B.encode_ids(ids, base, d, tail[slot * per * d:(slot + 1) * per * d])

    def _decode(self, tail: np.ndarray, m: int, ctx: RoundContext) -> np.ndarray:
        base, d = id_digits(m, self.wire_dtype)
        ids = B.decode_ids(tail, base, d, m)
        if ids is None:
            raise CodecError(f"{self.name}, tensor {ctx.name!r}, round {ctx.round_id}: the summed proposal "
                             f"of the next blocks is not a set of whole ids in [1, {m}] (a node sent "
                             "something else there, or the payload was damaged)")
        return ids

    # -- the work --------------------------------------------------------------------------------
    def compress(self, x: np.ndarray, ctx: RoundContext, state=None) -> Payload:
        n = C.check_input(self.name, x, ctx)
        prm = self.params
        b = prm["block"]
        m = -(-n // b)
        shared = prm["mode"] == "shared"
        norms = np.empty(m, np.float32)
        st = None
        age_w = None
        if prm["error_feedback"] and prm["accumulator"] == "block_age":
            # the accumulator a block would have after `age` rounds unsent, estimated from the
            # momentum now: the same renewal count as error feedback, 2 bytes per block
            ast = C.require_state(self.name, state, 0, ())
            age = ast.get("age")
            if age is None or age.shape[0] != m or ("u" in ast) != (prm["momentum"] > 0.0):
                raise CodecError(f"codec {self.name!r}: missing or mis-sized block-age state; create it "
                                 "with codec.new_state(n)")
            if "u" in ast:
                C.require_state(self.name, state, n, ("u",))
                u_in = peek(ast, "u")
                src = overwrite(ast, "u")  # written whole from u_in: no copy of the committed u first
                B.momentum_norms(x, src, prm["momentum"], b, norms, u_in=u_in)
            else:
                src = x
                B.block_norms(x, b, norms)
            np.add(age, np.uint16(1), out=age, where=age < np.uint16(65535))  # saturating
            age_w = np.minimum(age, np.uint16(prm["age_cap"])).astype(np.float32)
            norms *= age_w
            amax = B.finite_max(norms)
        elif prm["error_feedback"]:
            st = C.require_state(self.name, state, n, ("v",))
            # the accumulators are read from the committed state and written whole into the round's
            # scratch (a StateTxn): no 4n-byte copy of each before the pass (it cost 3-6 ms at 11.7M)
            v_in, u_in = peek(st, "v"), (peek(st, "u") if "u" in st else None)
            src = overwrite(st, "v")
            if prm["feedback_lowpass"] < 1.0 and np.shares_memory(src, v_in):
                v_in = v_in.copy()  # outside a round's StateTxn v is updated in place; the filter needs the old v
            u = overwrite(st, "u") if u_in is not None else None
            amax = B.norms_max(x, u, src, prm["momentum"], b, norms, error_feedback=True, u_in=u_in, v_in=v_in)
        else:
            src = x
            amax = B.norms_max(x, None, None, 0.0, b, norms, error_feedback=False)
        if shared:
            ids, dig = self._current(state, m, ctx)
            # shared mode sends the accumulator itself: a scale on one node's proposal would
            # extrapolate every other node's values (measured: capped scaling lost 6 points)
            scale = np.ones(ids.shape[0], np.float32)
        else:
            pk, ids = self._local_selection(norms, amax, ctx)
            scale = self._scales(pk)
        k = int(ids.shape[0])
        if age_w is not None:
            scale = scale * age_w[ids]
            state["age"][ids] = 0
        f16 = prm["value_dtype"] == "float16"
        tail_len = self._tail_len(m, ctx.world) if shared else 0
        buf = np.empty(k * b + tail_len, np.float32)
        vals = buf[:k * b]
        if st is not None and not f16:  # gather and error-feedback update in one visit per block
            B.gather_subtract(src, st.get("u"), b, ids, scale, vals)
        else:
            B.gather_blocks(src, b, ids, scale, vals)
        wire = vals
        if f16:
            wire16 = vals.astype(np.float16)
            vals[:] = wire16.astype(np.float32)  # what the receivers get (own rounding, for EF)
            wire = vals if shared else wire16
            if st is not None:
                B.subtract_sent(st["v"], st.get("u"), b, ids, vals)
        lowpass = st is not None and prm["feedback_lowpass"] < 1.0
        if lowpass:
            # ScaleCom's filter: v_new = (1 - beta) v_old + beta (v_old + x - sent). src holds
            # v_old + x - sent now; a kept block keeps (1 - beta) of its old value, an unsent one
            # takes beta of the new gradient, so no accumulator grows without bound between sends
            beta = np.float32(prm["feedback_lowpass"])
            src *= beta
            src += np.float32(1.0 - beta) * v_in
        if shared:
            # what is left on this node after the send: the sent blocks are (close to) zero
            # (a block-age block is empty once sent: its age restarts)
            if lowpass:
                B.block_norms(src, b, norms)
            else:
                B.residual_norms(norms, ids, scale if age_w is None else np.ones(k, np.float32))
            self._propose(norms, buf[k * b:], m, ctx)
            # the selection was fixed before this round's data, so a NaN/Inf outside the kept
            # blocks would not reach the result: poison the summed values so it does
            bad = float(np.sum(norms, dtype=np.float64))
            if not np.isfinite(bad) and k:
                vals[0] = vals[0] + np.float32(bad)
            return Payload(header={"n": n, "b": b, "k": k, "digest": dig}, values=buf)
        return Payload(header={"n": n, "b": b, "k": k},
                       buffers=[ids.astype(C.index_dtype(m)), wire])

    def _scales(self, pk: np.ndarray) -> np.ndarray:
        # pk: the selection probabilities of the kept blocks
        how = self.params["scale"]
        if how == "none" or pk.shape[0] == 0:
            return np.ones(pk.shape[0], np.float32)
        if how == "capped":
            pk = np.maximum(pk, 1.0 / self.params["cap"])
        return (1.0 / pk).astype(np.float32)

    # -- shared mode ---------------------------------------------------------------------------------
    def decompress(self, payload: Payload, out: np.ndarray, ctx: RoundContext, state=None) -> None:
        C.check_out(self.name, out, ctx)
        if self.params["mode"] != "shared":
            raise CodecError(f"codec {self.name!r} in local mode is GATHERED: use decompress_add")
        n = ctx.size
        b = self.params["block"]
        m = -(-n // b)
        ids, dig = self._current(state, m, ctx)
        got = payload.header.get("digest")
        if got != dig:
            raise RoundMismatchError(
                f"{self.name}, tensor {ctx.name!r}, round {ctx.round_id}: shared selection digest "
                f"{got!r} differs from this node's {dig} (selection state or seed disagree)")
        vals = payload.values
        k = ids.shape[0]
        want = k * b + self._tail_len(m, ctx.world)
        if vals is None or vals.shape[0] != want:
            raise CodecError(f"{self.name}: summed payload has "
                             f"{None if vals is None else vals.shape[0]} values, expected {want} "
                             f"({k} blocks of {b} and the next round's proposal)")
        vals = np.ascontiguousarray(vals, dtype=np.float32)
        nxt = self._decode(vals[k * b:], m, ctx)
        out[:] = 0.0
        B.scatter_blocks(vals[:k * b], b, ids, out, add=False)
        # only now, with the round's result complete on this node, the next selection
        state["ids"] = nxt
        state["round"][0] = ctx.tensor_round + 1

    # -- local mode --------------------------------------------------------------------------------
    def _check_local(self, payload: Payload, ctx: RoundContext | None) -> tuple[np.ndarray, np.ndarray, int]:
        name = self.name
        h = payload.header
        n = C.check_n(name, h, ctx) if ctx is not None else C.header_int(name, h, "n", 0, 1 << 62)
        b = C.header_int(name, h, "b", 1, 1 << 20)
        if b != self.params["block"]:
            raise CodecError(f"{name}: payload block size {b} differs from this codec's {self.params['block']}")
        m = -(-n // b)
        k = C.header_int(name, h, "k", 0, m)
        if len(payload.buffers) != 2:
            raise CodecError(f"{name}: payload has {len(payload.buffers)} buffers, expected 2 (ids, values)")
        ids, vals = payload.buffers
        C.expect_buffer(name, ids, "block ids", (np.dtype(C.index_dtype(m)).str,), k)
        C.expect_buffer(name, vals, "values", ("<f2" if self.params["value_dtype"] == "float16" else "<f4",), k * b)
        if not B.distinct_ascending(ids, m):
            raise CodecError(f"{name}: payload block ids are not distinct, ascending and below m={m}")
        return ids, vals, b

    def payload_from_wire(self, header: dict[str, Any], buffers: list[memoryview]) -> Payload:
        if self.params["mode"] == "shared":
            raise CodecError(f"codec {self.name!r} in shared mode is SUMMABLE; nothing to rebuild")
        payload = super().payload_from_wire(header, buffers)
        self._check_local(payload, None)
        return payload

    def decompress_sum(self, payloads: list[Payload], out: np.ndarray, ctx: RoundContext,
                       divide_by: float = 0.0) -> None:
        # one sweep over out instead of a fill, a scatter per node and a division (B.sum_blocks:
        # the same additions in the same order, so the same bits as Codec.decompress_sum)
        C.check_out(self.name, out, ctx)
        checked = [self._check_local(p, ctx) for p in payloads]
        B.sum_blocks(out, self.params["block"], [c[0] for c in checked], [c[1] for c in checked], divide_by)

    def decompress_add(self, payload: Payload, out: np.ndarray, ctx: RoundContext) -> None:
        C.check_out(self.name, out, ctx)
        ids, vals, b = self._check_local(payload, ctx)
        B.scatter_blocks(vals, b, ids, out, add=True)
