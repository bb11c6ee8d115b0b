"""A tiny progress bar for long simulations (no dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """Call it with the fraction done (0..1); it redraws one line on ``stream``.

    On a terminal the line is redrawn in place at most 10 times a second; elsewhere a line
    is printed at each 10% step. :meth:`close` ends the line.

    :param label: text before the bar
    :param stream: where to draw (default: standard error)
    :param enabled: ``False`` draws nothing
    """

    def __init__(self, label: str, stream: TextIO | None = None, *, enabled: bool = True) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = time.monotonic()
        self._last = 0.0
        self._step = -1
        self._fraction = 0.0

    def __call__(self, fraction: float) -> None:
        self._fraction = min(max(fraction, 0.0), 1.0)
        if not self.enabled:
            return
        now = time.monotonic()
        if self._tty:
            if now - self._last < 0.1 and self._fraction < 1.0:
                return
            self._last = now
            self.stream.write("\r" + self._line(now))
            self.stream.flush()
        else:
            step = int(self._fraction * 10)
            if step > self._step:
                self._step = step
                self.stream.write(self._line(now) + "\n")
                self.stream.flush()

    def close(self) -> None:
        """Finish the line."""
        if self.enabled and self._tty:
            self.stream.write("\r" + self._line(time.monotonic()) + "\n")
            self.stream.flush()

    def _line(self, now: float) -> str:
        width = 30
        filled = int(self._fraction * width)
        elapsed = now - self._start
        eta = ""
        if 0 < self._fraction < 1:
            eta = f", ~{elapsed * (1 - self._fraction) / self._fraction:.0f} s left"
        bar = "#" * filled + "." * (width - filled)
        return f"{self.label} [{bar}] {self._fraction:4.0%} {elapsed:.0f} s{eta}"
