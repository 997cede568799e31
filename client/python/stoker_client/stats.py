"""Batch-time accounting, as the Rust client does it (client/src/stats.rs): batch time is the
interval between consecutive `next()` calls; a call's wait (time it blocked for data) belongs to
the interval it starts."""

import math
from typing import List, NamedTuple, Optional, Tuple

MAX_SAMPLES = 1 << 16


class WindowStats(NamedTuple):
    batches: int
    median: float  # seconds, nearest rank
    p90: float
    total_batch_time: float
    total_wait: float
    wait_fraction: float


def _nearest_rank(sorted_samples: List[float], q: float) -> float:
    if not sorted_samples:
        return 0.0
    rank = math.ceil(q * len(sorted_samples))
    return sorted_samples[min(max(rank, 1), len(sorted_samples)) - 1]


class Meter:
    def __init__(self):
        self._open: Optional[Tuple[float, float]] = None
        self.reset()

    def reset(self) -> None:
        """A new window; the batch being processed counts in it."""
        self._samples: List[float] = []
        self._batches = 0
        self._total = 0.0
        self._wait = 0.0

    def call_started(self, now: float) -> None:
        if self._open is not None:
            start, wait = self._open
            self._open = None
            if len(self._samples) == MAX_SAMPLES:
                self._samples.pop(0)
            self._samples.append(now - start)
            self._batches += 1
            self._total += now - start
            self._wait += wait

    def delivered(self, start: float, now: float) -> None:
        self._open = (start, now - start)

    def window(self) -> WindowStats:
        s = sorted(self._samples)
        return WindowStats(
            self._batches,
            _nearest_rank(s, 0.5),
            _nearest_rank(s, 0.9),
            self._total,
            self._wait,
            self._wait / self._total if self._total > 0 else 0.0,
        )
