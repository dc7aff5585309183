"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def seconds(fn: Callable[[], object]) -> float:
    """Wall time of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `repeats` calls after one warm-up call (threads started, caches filled)."""
    fn()
    return statistics.median(seconds(fn) for _ in range(repeats))
