"""``birdplus``: BIRD+ — Gamma correction and uniform-distribution (systematic) block sampling.

As described in the BIRD+ abstract (IEEE TPDS 35(11), 2024); the sampling details are birdnet's
design (docs/codecs.md):

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
from birdnet.kernels import lazy

B = lazy("blocks")
rng = lazy("rng")


class BirdPlusCodec(BlockSamplingCodec):
    """BIRD+. GATHERED (mode=local) or SUMMABLE (mode=shared)."""

    name = "birdplus"
    # gamma 16 (four squarings, exact on every CPU): the sharpest selection measured was the best one in
    # the training benchmark (docs/research/findings.md)
    defaults = {**BlockSamplingCodec.common_defaults, "gamma": 16.0}

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        g = params["gamma"]
        # the kernels' own check (birdnet.kernels.weights.gamma_quarters), here without importing them
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 <= g * 4.0 <= 256.0 \
                or g * 4.0 != int(g * 4.0):
            raise CodecError(f"codec 'birdplus': gamma must be a multiple of 0.25 in [0, 64] (computed "
                             f"with multiplications and square roots only), got {g!r}")
        params["gamma"] = float(g)
        return super().validate(params)

    def _local_selection(self, norms: np.ndarray, amax: float, ctx: RoundContext):
        # fused: no float64 weights or probabilities over all m blocks (B.birdplus_select)
        k = kept_blocks(self.params["density"], norms.shape[0])
        ids, pk = B.birdplus_select(norms, amax, self.params["gamma"], k,
                                    rng.uniform_scalar(ctx.local_seed, 0))
        return pk, ids
