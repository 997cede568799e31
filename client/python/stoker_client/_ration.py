"""Equal batch counts per rank: one rank's side of an epoch of a job read by ranks.

The workers deal an epoch's batches round-robin among the ranks, so ranks receive counts that
differ by about a batch per worker; a rank whose training loop took a step more than the others
would hang the collectives of that step. So a rank yields only as many data batches as the
dispatcher's quota allows (the fewest any rank received so far); what it cannot yield yet waits
in a FIFO behind which its streams keep flowing. Once the quota is final, what a rank received
beyond it is dropped: the training loop never sees it, and its rows are counted as dropped.
(The client acknowledges completions as batches enter the FIFO, not here: see `Client`.)"""

import collections
import enum
from typing import Deque, Optional, Tuple

from .batch import Batch


class Step(enum.Enum):
    YIELD = "yield"
    """A data batch within the quota: hand it to the training loop."""
    PASS = "pass"
    """Completions only: neither yielded nor counted."""
    DROP = "drop"
    """A data batch beyond the final quota: never yielded, its rows counted as dropped."""
    WAIT = "wait"
    """Nothing may go until another batch arrives, the quota rises or the epoch ends."""
    DONE = "done"
    """The epoch is over for the training loop: it ended and nothing is held."""


def rows_in(batch: Batch) -> int:
    """A batch's rows: its row ids, or (a worker that sends none) its tensors' first dimension."""
    if len(batch.rows):
        return len(batch.rows)
    return next((len(t) for t in batch.tensors.values()), 0)


class Ration:
    """One epoch's batches for one rank, in the order they arrived; `step()` says what to do
    with the oldest. Not thread-safe: the client calls it under its lock."""

    def __init__(self):
        self.held: Deque[Batch] = collections.deque()
        # Data batches of the epoch that reached the client, counted as they arrive (before
        # the caller moves them here): what the rank tells the dispatcher.
        self.received = 0
        self.quota = 0
        # Whether `quota` is the epoch's final count.
        self.complete = False
        # Every stream of the epoch ended: nothing more will be pushed.
        self.ended = False
        self.yielded = 0
        self.dropped_rows = 0

    def push(self, batch: Batch) -> None:
        self.held.append(batch)

    def end(self) -> None:
        self.ended = True

    def set_quota(self, batches: int, complete: bool) -> None:
        """The dispatcher's latest quota for the epoch (a restarted one may say less for a
        while: the rank then waits until it relearned the counts)."""
        self.quota, self.complete = batches, complete

    def step(self) -> Tuple[Step, Optional[Batch]]:
        """What to do with the oldest held batch, taking it unless the step is WAIT or DONE."""
        if not self.held:
            return (Step.DONE if self.ended else Step.WAIT), None
        batch = self.held[0]
        if not batch.tensors:
            step = Step.PASS
        elif self.yielded < self.quota:
            self.yielded += 1
            step = Step.YIELD
        elif self.complete:
            self.dropped_rows += rows_in(batch)
            step = Step.DROP
        else:
            return Step.WAIT, None
        self.held.popleft()
        return step, batch
