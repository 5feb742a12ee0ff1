"""A dependency-free progress bar on stderr."""

from __future__ import annotations

import sys
import time

__all__ = ["ProgressBar", "end_line"]

# Streams on which a bar was drawn and not yet closed: the cursor is at the end of its line.
_open: set[int] = set()


def end_line(stream=None) -> None:
    """Move to a new line if a bar is drawn on ``stream`` (default stderr), so that a message
    printed while it runs (an interrupt, an error) starts a line of its own."""
    stream = stream if stream is not None else sys.stderr
    if id(stream) in _open:
        _open.discard(id(stream))
        stream.write("\n")
        stream.flush()


class ProgressBar:
    """``[#######-------] 12/40 label  key=value ...`` redrawn in place, at most 10 times a
    second; disabled (a no-op) when ``enabled`` is False."""

    def __init__(self, total: int, *, label: str = "", enabled: bool = True, stream=None):
        self.total = max(int(total), 1)
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self._last = 0.0
        self._width = 0

    def update(self, done: int, force: bool = False, **info) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1 and done < self.total:
            return
        self._last = now
        filled = int(28 * min(done, self.total) / self.total)
        extra = "  ".join(f"{k}={v}" for k, v in info.items())
        line = f"{self.label} [{'#' * filled}{'-' * (28 - filled)}] {done}/{self.total}  {extra}"
        pad = max(self._width - len(line), 0)
        self._width = len(line)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        _open.add(id(self.stream))

    def close(self, done: int | None = None, **info) -> None:
        if not self.enabled:
            return
        if done is not None:
            self.update(done, force=True, **info)
        _open.discard(id(self.stream))
        self.stream.write("\n")
        self.stream.flush()
