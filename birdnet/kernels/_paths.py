"""The size thresholds that choose between two variants of a kernel, overridable on one thread.

Why. Which variant runs depends on the size of an array: the parallel or the serial kernel
(``blocks.SERIAL_BELOW``, counted on the payload for gathers and scatters, so a tensor of 6.5M
elements at density 0.01 before the parallel gather runs), the sampled-bound selection
(``select.CANDIDATES_FROM`` blocks). The kernel warm-up (birdnet.daemon.warmup) must compile every
variant, but warming at sizes past every threshold would need arrays of hundreds of MB. So it lowers
the thresholds for its own thread while it runs small rounds (:func:`lowered`), and only its own: a
round on another thread of the same process (the daemon's ring thread) sees the real thresholds.
Every variant gives the same bits; only the speed differs.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_local = threading.local()


def threshold(name: str, value: int) -> int:
    """``value``, the threshold ``name``, unless this thread lowered it (:func:`lowered`)."""
    return getattr(_local, name, value)


@contextlib.contextmanager
def lowered(**thresholds: int) -> Iterator[None]:
    """On this thread only, run with these thresholds (e.g. ``SERIAL_BELOW=0``)."""
    old = {k: getattr(_local, k, None) for k in thresholds}
    for k, v in thresholds.items():
        setattr(_local, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                delattr(_local, k)
            else:
                setattr(_local, k, v)
