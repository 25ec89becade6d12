"""Progress bars of the tools (``birdnet demo``, ``birdnet bench``): tqdm's, on a terminal only.

``disable=None`` is tqdm's "only when the stream is a terminal": with output to a file or a pipe
(a log, CI) nothing is drawn, so no carriage return reaches the log. tqdm comes with the ``demo``
and ``bench`` extras; without it the tools run the same, with no bar.
"""
from __future__ import annotations

from typing import Any, TextIO


class _NoBar:
    """What the tools use of a tqdm bar, doing nothing (tqdm not installed)."""

    disable = True
    n = 0

    def update(self, k: float = 1) -> None:
        self.n += k

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def bar(total: float | None, desc: str, unit: str = "it", file: TextIO | None = None) -> Any:
    """A bar of ``total`` steps (None: a counter with the time elapsed) on ``file`` (stderr), shown
    only when ``file`` is a terminal; ``bar.disable`` says whether it is hidden. Removed from the
    screen when closed: the tools print their results as lines of their own."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, file=file, leave=False, disable=None)
