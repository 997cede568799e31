"""Batch-time statistics of a window (the Rust client measures them: client/src/stats.rs)."""

from typing import NamedTuple


class WindowStats(NamedTuple):
    """Batch time is the interval between consecutive `next()` calls; a call's wait (time it
    blocked for data) belongs to the interval it starts."""

    batches: int
    median: float  # seconds, nearest rank
    p90: float
    total_batch_time: float
    total_wait: float
    wait_fraction: float
