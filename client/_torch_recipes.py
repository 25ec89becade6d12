"""The optimizer recipes of birdnet.client.torch's DistributedOptimizer (its module docstring,
"Optimizer recipes", and docs/adapters.md say what they do and why).

:class:`_Recipes` is mixed into the wrapped optimizer's class beside the adapter: the adapter moves
gradients (buckets, hooks, the all-reduce); this decides, per param group, where the momentum
lives (SGD's in the codec; Adam's first moment in the codec over a frozen second moment), and turns
each averaged result into what the wrapped optimizer steps on. Every quantity is computed from the
all-reduced results, identical on every process, in the same order.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from birdnet.errors import InputError

#: the longest automatic uncompressed warm-up of Adam / AdamW (10 % of the transformer
#: benchmark's 400 steps); it ends earlier once the second moment has settled:
ADAM_WARMUP_STEPS = 40
#: every this many steps the bias-corrected second moment is compared with the last test's ...
ADAM_WARMUP_WINDOW = 8
#: ... and a relative L1 change of at most this ends the warm-up (on the transformer: 0.69, 0.40,
#: 0.28 at steps 16, 24, 32, so it ends at 32; the change shrinks about as 1/steps)
ADAM_WARMUP_CHANGE = 0.3
#: Adam / AdamW after the warm-up: the frozen second moment is refreshed from a dense all-reduce of
#: the raw gradient (beside the codec's round) at the warm-up's end + R, + 3R, + 7R, ... (intervals
#: doubling, 0/1 Adam's policy, Lu et al. 2022), as a time-weighted average
#: ``v = b2**k v + (1 - b2**k) g**2`` over the k steps since the last sample, so v follows what
#: Adam's would be instead of keeping the warm-up's (larger) early gradients; 0 = never refresh
ADAM_REFRESH_STEPS = 16
#: the codec the refreshes travel with: float16 on the wire, half of float32's bytes ("none":
#: float32). Before it, the raw gradient is multiplied by a power of two (exact; HALF_HEADROOM_LOG2)
ADAM_REFRESH_CODEC = "fp16"
#: the codec of an Adam group's small tensors (under 1024 elements; a dense bucket beside the sign
#: codec's per-tensor buckets) after the warm-up, scaled the same way ("none": float32). On the
#: transformer they are 0.8 % of the parameters but a fifth of marsit's bytes in float32
SMALL_TENSOR_CODEC = "fp16"
#: float16 travel: a tensor's values are multiplied by the power of two that makes its largest RMS
#: gradient, sqrt(max v / bc2) of Adam's second moment (the same on every process), about
#: 2**HALF_HEADROOM_LOG2; float16 then holds values up to ~256 times that largest RMS and down to
#: 2**-32 of it. A coordinate that overflows (Inf, the same on every process) is dropped: a refresh
#: keeps the variance it had, a small tensor's gradient coordinate counts as 0 that step
HALF_HEADROOM_LOG2 = 8

#: codecs with a ``momentum`` parameter (momentum correction kept in the daemon)
MOMENTUM_CODECS = frozenset({"marsit", "signcascade", "topk", "dgc", "randomk", "efsign", "bird", "birdplus"})
#: codecs that compress Adam's gradient in preconditioned units (divided by the frozen denominator):
#: the selecting codecs, which then keep the coordinates with the largest *steps*. The sign codecs
#: do not: on the transformer benchmark marsit reached 2.028 nats/byte preconditioned against 1.957
#: not (dense 1.899), birdplus 2.080 against 2.129 (200 steps, seed 0, docs/adapters.md)
#: Under Adam these codecs keep error feedback only and Adam's first moment stays in the adapter,
#: m = beta1 m + (1 - beta1) result on the average. Momentum correction in a selecting codec
#: clears a block's momentum when the block is sent (DGC's masking), so a block sent every few
#: steps loses most of its displacement: at density 1.0 the step was (1 - beta1) = 0.1 of Adam's. Error feedback alone delivers every gradient in full, later; on
#: the transformer (200 steps, seed 1, dense 1.912) birdplus went 2.132 -> 2.105, and at density
#: 1.0 to 1.882, Adam's with its variance frozen (docs/adapters.md)
_PRECONDITIONED_CODECS = frozenset({"topk", "dgc", "randomk", "bird", "birdplus"})
#: the block-selecting codecs' scale cap under Adam (unless the group sets ``cap``): a kept block
#: travels scaled by 1 / max(p, 1 / cap), its error feedback keeping the excess, so a block that
#: waits ~1 / density steps to be sent moves sooner. Transformer, 400 steps, seeds 0-2 (dense
#: 1.662): cap 10 (the codecs' default) 1.882, cap 30 1.848; at 200 steps cap 100 was worse
ADAM_BLOCK_CAP = 30.0
_CAPPED_CODECS = frozenset({"bird", "birdplus"})
#: codecs that send one sign scale per tensor (per bucket): with Adam each big tensor gets a bucket
#: of its own. On the transformer (200 steps, seed 0) one bucket for the whole model left marsit at
#: 1.964 nats/byte, a bucket per tensor at 1.900, dense's 1.899
_SIGN_CODECS = frozenset({"marsit", "signcascade", "efsign"})
#: after the warm-up the big tensors of such a group travel in one round (up to ``bucket_bytes``),
#: each divided by its own unit (:meth:`_Recipes._sign_unit`) so one scale fits them all, instead of
#: one round each (False: one round each; docs/slowlink.md, "Per-step codecs")
SIGN_MERGE = True
#: Adam groups: the small tensors travel apart, dense (_small_apart)
_SMALL_APART = True
#: SGD groups whose small tensors travel apart too: the block-selecting codecs
_SMALL_APART_SGD = frozenset({"bird", "birdplus"})
#: tensors below this many elements travel dense (the daemons' default ``dense_threshold``)
_SMALL_TENSOR = 1024
#: codecs that change gradients too little to need a recipe (every value travels, rounded)
_PLAIN_CODECS = frozenset({"none", "fp16", "lowbit"})
#: a carry below this weight (momentum ** steps since the switch) is dropped
_CARRY_FLOOR = 1e-6


def _frozen_variance(g: dict[str, Any], st: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Adam's second moment of one parameter (the max with amsgrad) and its bias correction bc2 at
    the step the variance froze at: what the preconditioning denominator and a merged sign round's
    unit are both computed from."""
    v = st["max_exp_avg_sq"] if g.get("amsgrad") else st["exp_avg_sq"]
    return v, 1.0 - float(g["betas"][1]) ** float(st["step"])


class _Recipes:
    """Mixed into the DistributedOptimizer (a subclass of the wrapped optimizer's class): reads
    ``param_groups`` and ``state``, and the adapter's ``_bn_codec``, ``_bn_codec_params``,
    ``_bn_mode``, ``_bn_recipe``, ``_bn_denom``, ``_bn_reset_pending``, ``_bn_warmup`` and ``_bn_vsnap``."""

    def _wrapped_name(self) -> str:
        # the wrapped optimizer's class: the first in the MRO that is not birdnet's mixin
        return next(c.__name__ for c in type(self).__mro__[1:] if not issubclass(c, _Recipes))

    def _kind(self) -> str | None:
        if isinstance(self, torch.optim.SGD):
            return "sgd"
        if isinstance(self, (torch.optim.Adam, torch.optim.AdamW)):
            return "adam"
        return None

    def _arrange(self) -> None:
        """Decide each param group's recipe (module docstring); idempotent, so it runs again after
        ``load_state_dict`` (a checkpoint of the plain optimizer carries its momentum back)."""
        explicit = self._bn_mode is True
        kind = self._kind()
        for gi, g in enumerate(self.param_groups):
            codec = g.get("birdnet_codec", self._bn_codec)
            params = dict(g.get("birdnet_codec_params", self._bn_codec_params) or {})
            if kind == "sgd":
                m = float(g.get("momentum", 0.0) or 0.0)
                if gi in self._bn_recipe:
                    m = m or self._bn_recipe[gi][1]
                if m == 0.0:
                    continue
            what = f"param group {gi} ({self._wrapped_name()})"
            if codec is None or codec in _PLAIN_CODECS:
                if explicit:
                    raise InputError(f"{what}: momentum_in_codec=True needs a momentum-correction codec "
                                     "(codec='marsit', 'topk', 'dgc', 'randomk', 'bird' or 'birdplus'), given as "
                                     "codec= or the group's 'birdnet_codec'")
                continue  # dense, fp16 or the daemons' default: the optimizer runs as it is
            usable = codec in MOMENTUM_CODECS and not (codec == "randomk" and params.get("error_feedback") is False)
            if kind is None or not usable:
                if explicit:
                    raise InputError(f"{what}: momentum_in_codec=True needs torch.optim.SGD, Adam or AdamW and a "
                                     f"codec with a momentum parameter ({', '.join(sorted(MOMENTUM_CODECS))}); "
                                     f"got codec {codec!r}")
                reason = (f"birdnet does not know {self._wrapped_name()}" if kind is None
                          else f"codec {codec!r} has no momentum parameter")
                warnings.warn(f"birdnet DistributedOptimizer, {what}: {reason}, so nothing is arranged: the "
                              f"optimizer steps on the decompressed average of the {codec!r}-compressed gradients "
                              "and builds its momentum/statistics from it, which may converge worse than dense "
                              "(use SGD, Adam or AdamW with a codec that has a momentum parameter for the "
                              "automatic recipe)", stacklevel=4)
                continue
            if kind == "sgd":
                if g.get("nesterov"):
                    raise InputError(f"{what}: nesterov=True cannot move into a compressing codec (the look-ahead "
                                     "needs the dense gradient); use nesterov=False, or momentum_in_codec=False to "
                                     "keep Nesterov momentum in SGD on the decompressed average")
                damp = float(g.get("dampening", 0.0) or 0.0)
                g["momentum"] = 0.0
                self._bn_recipe[gi] = ("sgd", m, damp)
            else:
                beta1 = float(g["betas"][0])
                if not 0.0 < beta1 < 1.0:
                    continue  # no first moment to move
                m = beta1
                self._bn_recipe[gi] = ("adam", beta1, 0.0)
                if codec in _CAPPED_CODECS:
                    params.setdefault("cap", ADAM_BLOCK_CAP)
                if codec in _PRECONDITIONED_CODECS:
                    m = 0.0  # error feedback only (_apply_recipe keeps Adam's m)
                    self._bn_adapter_m.add(gi)
            if codec == "randomk":
                params.setdefault("error_feedback", True)
            if m:
                params["momentum"] = m
            else:
                params.pop("momentum", None)
            g["birdnet_codec"], g["birdnet_codec_params"] = codec, params

    def _send_scale(self, b: Any, p: torch.Tensor) -> torch.Tensor | None:
        """Adam's frozen denominator when this parameter's gradient is to be compressed in
        preconditioned units (module docstring), else None."""
        recipe = self._bn_recipe.get(b.group)
        if recipe is None or recipe[0] != "adam" or p.device.type != "cpu":
            return None  # CUDA: not preconditioned (the bucket is on the host); untested here
        g = self.param_groups[b.group]
        if (g.get("birdnet_codec") not in _PRECONDITIONED_CODECS or self._warming_up(g)
                or "exp_avg_sq" not in self.state.get(p, {})):
            return None
        return self._denominator(g, p)

    def _denominator(self, g: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """sqrt(v / bc2) + eps with v (and bc2) as they were when compression started."""
        denom = self._bn_denom.get(id(p))
        if denom is None:
            v, bc2 = _frozen_variance(g, self.state[p])
            denom = self._bn_denom[id(p)] = (v / bc2).sqrt_().add_(float(g["eps"]))
        return denom

    def _sign_unit(self, g: dict[str, Any], p: torch.Tensor) -> float:
        """The unit ``p``'s gradient travels in when it shares a sign round with other tensors:
        the mean over its coordinates of sqrt(v / bc2), the RMS gradient of Adam's frozen second
        moment, kept in the state (``birdnet_unit``: a checkpoint or a broadcast of the state carries
        it) until a refresh moves v (:meth:`_refresh_variance` drops it). Frozen at the first
        compressed step for the whole run, the units lagged the tensors' gradients as they changed
        apart: tta transformer, loopback, 300 steps, seed 0: 1.811 against 1.774 with a round per
        tensor; following the refreshes 1.762 (the codec's state, in the old unit, is then off by
        the ratio for the few steps its momentum remembers). Summed in float64 by NumPy from
        identical state: the same on every process."""
        st = self.state.get(p)
        if not st or "exp_avg_sq" not in st:
            return 1.0  # no gradient yet (an unused parameter): it sends zeros; Adam's state stays empty
        unit = st.get("birdnet_unit")
        if unit is None:
            v, bc2 = _frozen_variance(g, st)
            r = float(np.sqrt(v.detach().to("cpu", torch.float64).numpy().reshape(-1) / bc2).mean()) if v.numel() else 0.0
            unit = st["birdnet_unit"] = r if r > 0.0 and np.isfinite(r) else 1.0
        return float(unit)

    def _warming_up(self, g: dict[str, Any]) -> bool:
        codec = g.get("birdnet_codec", self._bn_codec)
        if codec in _PLAIN_CODECS:
            return False
        end = self._warmup_end(g)
        return end is None or int(g.get("birdnet_step", 0)) < end

    def _warmup_end(self, g: dict[str, Any]) -> int | None:
        """The step at which compression starts: ``warmup_steps`` when given, else the step the
        automatic warm-up ended at (kept in the group, so checkpoints carry it), None before."""
        if self._bn_warmup is not None:
            return self._bn_warmup
        end = g.get("birdnet_warmup_end")
        return None if end is None else int(end)

    def _refreshing(self, b: Any) -> bool:
        """Whether this step all-reduces ``b``'s raw gradients dense to refresh Adam's frozen second
        moment: at the warm-up's end + R (2**j - 1), j >= 1 (ADAM_REFRESH_STEPS), for a bucket the
        codec compressed last step (the daemons send buckets under their dense_threshold dense)."""
        r = ADAM_REFRESH_STEPS
        recipe = self._bn_recipe.get(b.group)
        if not r or recipe is None or recipe[0] != "adam" or not b.coded:
            return False
        g = self.param_groups[b.group]
        end = self._warmup_end(g)
        if end is None or self._warming_up(g):
            return False
        since = int(g.get("birdnet_step", 0)) - end
        q = since // r + 1
        return since > 0 and since % r == 0 and q & (q - 1) == 0

    def _own_scale(self, gi: int) -> bool:
        """Whether group ``gi``'s tensors each travel in a bucket of their own: an Adam group with a
        sign codec, whose one scale per bucket, divided by each coordinate's denominator, would give
        the tensors with small gradients steps many times Adam's (module docstring)."""
        recipe = self._bn_recipe.get(gi)
        return (recipe is not None and recipe[0] == "adam"
                and self.param_groups[gi].get("birdnet_codec") in _SIGN_CODECS)

    def _small_apart(self, gi: int) -> bool:
        """Whether group ``gi``'s tensors under _SMALL_TENSOR elements travel apart, in dense
        buckets (float16 after the warm-up, SMALL_TENSOR_CODEC): an Adam group with a sign codec
        (each would travel alone anyway, under the daemons' dense_threshold), and an SGD group with
        a block-selecting codec (_SMALL_APART_SGD), whose biases, first convolution and output
        layer would otherwise share density 0.01 with the big tensors."""
        recipe = self._bn_recipe.get(gi)
        if recipe is None or not _SMALL_APART:
            return False
        return self._own_scale(gi) or (recipe[0] == "sgd"
                                       and self.param_groups[gi].get("birdnet_codec") in _SMALL_APART_SGD)

    @property
    def birdnet_warmup_steps(self) -> int:
        """Steps that travel dense before compression starts: ``warmup_steps`` when given; in
        automatic mode the step the warm-up ended at, or, while it still runs, the steps so far."""
        if self._bn_warmup is not None:
            return self._bn_warmup
        ends = [self._warmup_end(self.param_groups[gi]) for gi in self._bn_recipe]
        if ends and all(e is not None for e in ends):
            return max(ends)
        return max(int(g.get("birdnet_step", 0)) for g in self.param_groups)


    @torch.no_grad()
    def _apply_recipe(self, p: torch.Tensor, recipe: tuple[str, float, float], coded: bool,
                      adapter_m: bool = False) -> None:
        """Turn the averaged result in ``p.grad`` into the momentum the wrapped optimizer (SGD)
        or the frozen-variance update (Adam) steps on. Runs on identical inputs on every process."""
        kind, beta, damp = recipe
        st = self.state[p]
        grad = p.grad
        if kind == "sgd":
            key = "birdnet_momentum_buffer"
            if not coded:  # a dense bucket (or the warm-up): the momentum the codec would have applied
                buf = st.get(key)
                if buf is None:
                    buf = st[key] = grad.detach().clone()  # torch's SGD: the first buffer is the gradient
                else:
                    buf.mul_(beta).add_(grad, alpha=1.0 - damp)
                grad.copy_(buf)
                return
            if damp:
                grad.mul_(1.0 - damp)
        else:
            key = "exp_avg"
            if not coded:
                return  # Adam steps on the dense average as usual
            if adapter_m:
                # the codec sent error-feedback gradients: Adam's first moment runs here, from the
                # warm-up's, bias-corrected once at the switch (an average of unbiased estimates
                # stays unbiased), so the frozen update needs no correction of its own
                m = st[key]
                if not st.get("birdnet_coded"):
                    st["birdnet_coded"] = True
                    m.div_(1.0 - beta ** float(st["step"]))
                m.mul_(beta).add_(grad, alpha=1.0 - beta)
                grad.copy_(m)
                return
            grad.mul_(1.0 - beta)
        if not st.get("birdnet_coded"):
            # the switch to compression: the momentum so far keeps decaying beside the codec's,
            # which starts from zero
            st["birdnet_coded"] = True
            est = st.get(key)
            if kind == "adam":
                if est is None or "exp_avg_sq" not in st:
                    raise InputError(f"parameter of shape {tuple(p.shape)} reached the compressed phase without "
                                     "Adam state from a dense warm-up (warmup_steps); a checkpoint of a run that "
                                     "never warmed up cannot be continued compressed")
                est = est / (1.0 - beta ** float(st["step"]))  # bias-corrected first moment
            if est is not None:
                st["birdnet_carry"], st["birdnet_carry_weight"] = est.clone(), 1.0
        carry = st.get("birdnet_carry")
        if carry is not None:
            carry.mul_(beta)
            grad.add_(carry)
            st["birdnet_carry_weight"] = float(st["birdnet_carry_weight"]) * beta
            if st["birdnet_carry_weight"] < _CARRY_FLOOR:
                del st["birdnet_carry"], st["birdnet_carry_weight"]
        # the current momentum estimate: what a checkpoint restarts the carry from
        est = st.get(key)
        if est is None or est.shape != grad.shape:
            st[key] = grad.detach().clone()
        else:
            est.copy_(grad)

    @staticmethod
    def _refresh_codec() -> str:
        return ADAM_REFRESH_CODEC

    def _small_codec(self, b: Any) -> str:
        """The codec of bucket ``b``'s round when it is an Adam group's dense bucket of small
        tensors: float32 during the warm-up, SMALL_TENSOR_CODEC after it; "none" for other buckets.
        A function of state identical on every process, so every process sends the same."""
        recipe = self._bn_recipe.get(b.group)
        if not b.dense or recipe is None or SMALL_TENSOR_CODEC == "none":
            return "none"
        g = self.param_groups[b.group]
        # the statistic the float16 scale is computed from (_half_scale) must exist on every process
        key = "exp_avg_sq" if recipe[0] == "adam" else "birdnet_momentum_buffer"
        if self._warming_up(g) or any(key not in self.state.get(p, {}) for _n, p, _o, _k in b.entries):
            return "none"
        return SMALL_TENSOR_CODEC

    def _half_scale(self, g: dict[str, Any], p: torch.Tensor) -> float:
        """The power of two ``p``'s gradient is multiplied by before it travels in float16
        (HALF_HEADROOM_LOG2): computed from Adam's second moment, identical on every process, so
        the scaled values average exactly as the raw ones would and dividing back is exact."""
        st = self.state[p]
        if "exp_avg_sq" in st:
            v = st["max_exp_avg_sq"] if g.get("amsgrad") else st["exp_avg_sq"]
            bc2 = 1.0 - float(g["betas"][1]) ** float(st["step"])
            top = float(v.max()) / bc2 if v.numel() else 0.0
        else:  # SGD: the momentum buffer, about 1 / (1 - momentum) gradients (more headroom)
            buf = st.get("birdnet_momentum_buffer")
            top = float(buf.abs().max()) ** 2 if buf is not None and buf.numel() else 0.0
        if not top > 0.0 or not np.isfinite(top):
            return 1.0
        e = HALF_HEADROOM_LOG2 - int(np.ceil(0.5 * np.log2(top)))
        return float(2.0 ** max(-100, min(100, e)))

    @torch.no_grad()
    def _refresh_variance(self, g: dict[str, Any], p: torch.Tensor, mean: torch.Tensor,
                          scale: float = 1.0) -> None:
        """A dense sample of the averaged gradient updates the frozen second moment as Adam's
        would have moved over the k steps since its last sample, ``v = b2**k v + (1 - b2**k) g**2``
        (k times the weight of one step: the sample stands for the steps not seen), and Adam's
        step count (its bias correction) moves to this step. ``mean`` arrives multiplied by
        ``scale`` (:meth:`_refresh_scale`); a sample that overflowed float16 (an Inf, identical on
        every process) is dropped: v stays as it is."""
        st = self.state[p]
        if not bool(torch.isfinite(mean).all()):
            return
        t = int(g.get("birdnet_step", 0)) + 1  # Adam's step count once this step is done
        k = t - int(float(st["step"]))
        if k <= 0:
            return
        a = float(g["betas"][1]) ** k
        v = st["exp_avg_sq"]
        mean = mean.to(device=v.device, dtype=v.dtype)
        if scale != 1.0:
            mean = mean / scale  # a power of two: exact
        v.mul_(a).addcmul_(mean, mean, value=1.0 - a)
        if g.get("amsgrad"):
            torch.maximum(st["max_exp_avg_sq"], v, out=st["max_exp_avg_sq"])
        if torch.is_tensor(st["step"]):
            st["step"].fill_(float(t))
        else:
            st["step"] = t
        self._bn_denom.pop(id(p), None)  # the next update divides by the refreshed denominator
        st.pop("birdnet_unit", None)  # and a merged sign round's unit follows it (_sign_unit)

    def _restart_carry(self) -> None:
        """After a restore: the saved momentum estimate becomes the carry, and the daemons' codec
        state is reset before the next submission."""
        for gi, (kind, _beta, _damp) in self._bn_recipe.items():
            g = self.param_groups[gi]
            if self._bn_warmup is None and g.get("birdnet_warmup_end") is None and any(
                    self.state.get(p, {}).get("birdnet_coded") for p in g["params"]):
                # a checkpoint from a fixed warm-up, continued in automatic mode: it is over
                g["birdnet_warmup_end"] = int(g.get("birdnet_step", 0))
            key = "birdnet_momentum_buffer" if kind == "sgd" else "exp_avg"
            for p in self.param_groups[gi]["params"]:
                st = self.state.get(p)
                if st and st.get("birdnet_coded") and st.get(key) is not None:
                    if gi not in self._bn_adapter_m:  # the adapter's own m needs no carry
                        st["birdnet_carry"], st["birdnet_carry_weight"] = st[key].detach().clone(), 1.0
                    self._bn_reset_pending = True
        self._bn_denom.clear()
        self._bn_vsnap.clear()

    @torch.no_grad()
    def _frozen_adam_update(self, g: dict[str, Any], p: torch.Tensor) -> None:
        denom = self._denominator(g, p)
        d = -p.grad if g.get("maximize") else p.grad
        lr, wd = float(g["lr"]), float(g["weight_decay"])
        if wd:
            if isinstance(self, torch.optim.AdamW) or g.get("decoupled_weight_decay"):
                p.mul_(1.0 - lr * wd)
            else:
                d = d + wd * p  # Adam's L2 term, outside the momentum (as for SGD)
        p.addcdiv_(d, denom, value=-lr)

    @torch.no_grad()
    def _decide_warmup(self) -> None:
        """Automatic warm-up: end it once Adam's bias-corrected second moment has settled, its
        relative L1 change over the last ADAM_WARMUP_WINDOW steps below ADAM_WARMUP_CHANGE in every
        Adam group (0/1 Adam's idea of freezing when the variance has stabilised), and after
        ADAM_WARMUP_STEPS steps at the latest. The measure comes from the all-reduced gradients
        and is summed in float64 by NumPy (no thread-dependent order), so every process ends the
        warm-up at the same step; the step is kept in each group (``birdnet_warmup_end``)."""
        groups = [self.param_groups[gi] for gi, r in self._bn_recipe.items() if r[0] == "adam"]
        if not groups or all(g.get("birdnet_warmup_end") is not None for g in groups):
            return
        t = max(int(g.get("birdnet_step", 0)) for g in self.param_groups) + 1  # steps done with this one
        done = t >= ADAM_WARMUP_STEPS
        if not done and t % ADAM_WARMUP_WINDOW == 0:
            change = total = 0.0
            for g in groups:
                bc2 = 1.0 - float(g["betas"][1]) ** t
                for p in g["params"]:
                    st = self.state.get(p)
                    if not st or "exp_avg_sq" not in st:
                        continue
                    v = st["exp_avg_sq"].detach().to("cpu", torch.float64).numpy().reshape(-1) / bc2
                    old = self._bn_vsnap.get(id(p))
                    if old is not None and old.shape == v.shape:
                        change += float(np.abs(v - old).sum())
                        total += float(v.sum())
                    else:
                        total = float("nan")  # no snapshot yet: no verdict this window
                    self._bn_vsnap[id(p)] = v
            done = total > 0 and change <= ADAM_WARMUP_CHANGE * total
        if done:
            for g in self.param_groups:
                g["birdnet_warmup_end"] = t
            self._bn_vsnap.clear()
