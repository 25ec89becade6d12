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

import torch

from birdnet.errors import InputError

#: automatic uncompressed warm-up of Adam / AdamW: the steps whose averaged gradients estimate the
#: second moment before it is frozen (32 steps: the relative error of a mean of squares of 32
#: samples, about 25 %, becomes about 12 % in the step size through the square root)
ADAM_WARMUP_STEPS = 32

#: codecs with a ``momentum`` parameter (momentum correction kept in the daemon)
MOMENTUM_CODECS = frozenset({"marsit", "signcascade", "topk", "dgc", "randomk", "efsign", "bird", "birdplus"})
#: codecs that compress Adam's gradient in preconditioned units (divided by the frozen denominator):
#: the selecting codecs, which then keep the coordinates with the largest *steps*. The sign codecs
#: do not: on the transformer benchmark marsit reached 2.028 nats/byte preconditioned against 1.957
#: not (dense 1.899), birdplus 2.080 against 2.129 (200 steps, seed 0, docs/adapters.md)
_PRECONDITIONED_CODECS = frozenset({"topk", "dgc", "randomk", "bird", "birdplus"})
#: codecs that change gradients too little to need a recipe
_PLAIN_CODECS = frozenset({"none", "fp16"})
#: a carry below this weight (momentum ** steps since the switch) is dropped
_CARRY_FLOOR = 1e-6


class _Recipes:
    """Mixed into the DistributedOptimizer (a subclass of the wrapped optimizer's class): reads
    ``param_groups`` and ``state``, and the adapter's ``_bn_codec``, ``_bn_codec_params``,
    ``_bn_mode``, ``_bn_recipe``, ``_bn_denom``, ``_bn_reset_pending`` and ``birdnet_warmup_steps``."""

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
            if codec == "randomk":
                params.setdefault("error_feedback", True)
            params["momentum"] = m
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
            st = self.state[p]
            v = st["max_exp_avg_sq"] if g.get("amsgrad") else st["exp_avg_sq"]
            bc2 = 1.0 - float(g["betas"][1]) ** float(st["step"])  # the step the variance froze at
            denom = self._bn_denom[id(p)] = (v / bc2).sqrt_().add_(float(g["eps"]))
        return denom

    def _warming_up(self, g: dict[str, Any]) -> bool:
        codec = g.get("birdnet_codec", self._bn_codec)
        return codec not in _PLAIN_CODECS and int(g.get("birdnet_step", 0)) < self.birdnet_warmup_steps

    @torch.no_grad()
    def _apply_recipe(self, p: torch.Tensor, recipe: tuple[str, float, float], coded: bool) -> None:
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

    def _restart_carry(self) -> None:
        """After a restore: the saved momentum estimate becomes the carry, and the daemons' codec
        state is reset before the next submission."""
        for gi, (kind, _beta, _damp) in self._bn_recipe.items():
            key = "birdnet_momentum_buffer" if kind == "sgd" else "exp_avg"
            for p in self.param_groups[gi]["params"]:
                st = self.state.get(p)
                if st and st.get("birdnet_coded") and st.get(key) is not None:
                    st["birdnet_carry"], st["birdnet_carry_weight"] = st[key].detach().clone(), 1.0
                    self._bn_reset_pending = True
        self._bn_denom.clear()

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
