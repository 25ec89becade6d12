"""``bird``: BIRD — bi-random block sampling with index sharing.

As described in the BIRD abstract (ICCD 2023); the sampling details are birdnet's design
(docs/codecs.md):

1. random stage 1: draw s = max(``sample``, m/100) block norms uniformly (with replacement) and solve
   on the sample only for tau with sum_j min(1, a_j/tau) = density * s — no sort of the tensor;
2. random stage 2: keep block i independently when u_i < p_i = min(1, a_i/tau);
3. kept blocks scaled by 1/p_i (``scale="exact"``: E[decompressed] = x and E[L1] = L1(x)), or a
   bounded scale / none (see bird.md section 4 and docs/codecs.md for why the default differs).

The number of kept blocks is random: density * m within about +-15% for s >= 4096.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from birdnet.codecs._blocksampling import BlockSamplingCodec
from birdnet.codecs.base import RoundContext
from birdnet.errors import CodecError
from birdnet.kernels import lazy

B = lazy("blocks")

_STAGE2 = 0x5DEECE66D  # separates the stage-2 stream from the stage-1 stream of the same seed


class BirdCodec(BlockSamplingCodec):
    """BIRD. GATHERED (mode=local) or SUMMABLE (mode=shared)."""

    name = "bird"
    defaults = {**BlockSamplingCodec.common_defaults, "sample": 4096}

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        s = params["sample"]
        if isinstance(s, bool) or not isinstance(s, int) or s < 16:
            raise CodecError(f"codec 'bird': sample must be an integer >= 16, got {s!r}")
        return super().validate(params)

    def _select(self, a: np.ndarray, seed: int):
        m = a.shape[0]
        s = int(max(self.params["sample"], m // 100))
        w = B.gamma_weights(a, 1.0)  # a / max a; NaN/Inf blocks get +Inf (kept)
        sw = B.sample_norms(w, seed, s)
        inv_tau = B.solve_scale(sw, self.params["density"] * s)
        p = B.probabilities_for(w, inv_tau)
        return p, seed

    def _local_selection(self, norms: np.ndarray, amax: float, ctx: RoundContext):
        p, seed = self._select(norms, ctx.local_seed)
        ids = B.bernoulli(p, seed ^ _STAGE2)
        return p[ids], ids
