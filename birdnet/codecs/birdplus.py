"""``birdplus``: BIRD+ — Gamma correction and uniform-distribution (systematic) block sampling.

As described in the BIRD+ abstract (IEEE TPDS 35(11), 2024); the sampling details are birdnet's
design (../shared/papers/bird.md section 2, docs/codecs.md):

1. w_i = (a_i / max a)^gamma (w_i = 0 where a_i = 0), gamma a multiple of 0.25 computed with
   multiplications and square roots only (no libm pow: identical on x86 and ARM);
2. p_i = min(1, A w_i) with A solved by water filling so that sum p = K = round(density * m);
3. one u ~ U(0,1), systematic walk over the float64 cumulative sum: exactly K blocks, block i kept
   with probability p_i.

Payload size (local mode): K * (ids bytes + b * value bytes), ids uint16 when m <= 65536.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from birdnet.codecs._blocksampling import BlockSamplingCodec, kept_blocks
from birdnet.codecs.base import RoundContext
from birdnet.errors import CodecError
from birdnet.kernels import blocks as B
from birdnet.kernels import rng


class BirdPlusCodec(BlockSamplingCodec):
    """BIRD+. GATHERED (mode=local) or SUMMABLE (mode=shared)."""

    name = "birdplus"
    # gamma 16 (four squarings, exact on every CPU): the sharpest selection measured was the best one in
    # the training benchmark (docs/benchmarks.md: 79.6% vs dense 79.4%; gamma 4: 77.2%, gamma 8: 78.5%)
    defaults = {**BlockSamplingCodec.common_defaults, "gamma": 16.0}

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        g = params["gamma"]
        try:
            B.gamma_quarters(g) if not isinstance(g, bool) else B.gamma_quarters("x")
        except (ValueError, TypeError):
            raise CodecError(f"codec 'birdplus': gamma must be a multiple of 0.25 in [0, 64] (computed "
                             f"with multiplications and square roots only), got {g!r}") from None
        params["gamma"] = float(g)
        return super().validate(params)

    def _probabilities(self, a: np.ndarray, k: int) -> np.ndarray:
        return B.probabilities(B.gamma_weights(a, self.params["gamma"]), k)

    def _local_selection(self, norms: np.ndarray, ctx: RoundContext):
        m = norms.shape[0]
        k = kept_blocks(self.params["density"], m)
        p = self._probabilities(norms, k)
        return p, _walk(p, rng.uniform_scalar(ctx.local_seed, 0))

    def _shared_selection(self, imp: np.ndarray, m: int, seed: int):
        k = kept_blocks(self.params["density"], m)
        p = self._probabilities(imp, k)
        B.floor_mix(p, self.params["eps"], k / m if m else 0.0)
        return p, _walk(p, rng.uniform_scalar(seed, 0))


def _walk(p: np.ndarray, u: float) -> np.ndarray:
    """Systematic sampling; when sum p is an integer (up to rounding) exactly that many blocks."""
    s = float(np.sum(p)) if p.shape[0] else 0.0
    k = float(np.floor(s + 0.5))
    if k > 0 and abs(s - k) <= 1e-9 * max(1.0, k):
        return B.systematic(p, int(k), u)
    return B.systematic_natural(p, u)
