"""One collector for every figure the engine reports.

The scheduler, the KV cache manager and the engine loop count events into it (``count``),
keep maxima (``peak``) and add up time (``add_time``); components that own a gauge (pages
in use, sequences waiting, the compiled programs) register a ``source``: a function called
when a snapshot is taken. :attr:`jaxattn.engine.Engine.stats` is one :meth:`snapshot`, so
no caller reaches into the pool or the cache for a number.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable

__all__ = ["StatsCollector"]


class StatsCollector:
    """Counters, peaks, timers and gauge sources."""

    def __init__(self, counters: tuple[str, ...] = (), timers: tuple[str, ...] = ()):
        self._counter_keys, self._timer_keys = counters, timers
        self._sources: list[Callable[[], dict]] = []
        self.reset()

    def reset(self) -> None:
        """Zero every counter, peak and timer (sources stay)."""
        self.counters: collections.Counter = collections.Counter({k: 0 for k in self._counter_keys})
        self.peaks: dict[str, float] = {}
        self.timers: dict[str, float] = {k: 0.0 for k in self._timer_keys}

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] += n

    def peak(self, key: str, value) -> None:
        if value > self.peaks.get(key, value - 1):
            self.peaks[key] = value

    def add_time(self, key: str, seconds: float) -> None:
        self.timers[key] = self.timers.get(key, 0.0) + seconds

    @contextlib.contextmanager
    def timer(self, key: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(key, time.perf_counter() - t0)

    def add_source(self, source: Callable[[], dict]) -> None:
        """``source()`` -> gauges merged into every snapshot (later sources win)."""
        self._sources.append(source)

    def snapshot(self) -> dict:
        """Counters, timers, peaks, then every source's gauges, in one dict."""
        out: dict = {k: int(v) for k, v in self.counters.items()}
        out.update(self.timers)
        out.update(self.peaks)
        for source in self._sources:
            out.update(source())
        return out
