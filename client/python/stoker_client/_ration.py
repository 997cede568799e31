"""Equal batch counts per rank: one rank's side of an epoch of a job read by ranks.

The workers deal an epoch's batches round-robin among the ranks, so ranks receive counts that
differ by about a batch per worker; a rank whose training loop took a step more than the others
would hang the collectives of that step. So a rank yields only as many data batches as the
dispatcher's quota allows (the fewest any rank received so far); what it cannot yield yet waits
in a FIFO behind which its streams keep flowing. Once the quota is final, what a rank received
beyond it is dropped: the training loop never sees it, and its rows are counted as dropped.
(The client acknowledges completions as batches enter the FIFO, not here: see `Client`.)

In coordinated mode each worker deals in rounds (one batch per rank, from rank 0) and tags each
batch with its round; the rank counts the rounds of each worker it received without a gap, the
dispatcher orders the rounds every rank has, and the quota carries that order. The rank yields
its batch of each round in the order, wherever it is in the FIFO, so its k-th batch is every
rank's k-th round; once the quota is final, what no round of the order took (a worker's last,
incomplete round; what a dead worker sent only some ranks) goes as above, in arrival order. An
epoch whose quota has no order is not coordinated (it was being read when the dispatcher
restarted, and the order its ranks followed is gone): it goes in arrival order throughout."""

import collections
import enum
from typing import Deque, Dict, Optional, Set, Tuple

from ._wire import RoundOrder, RoundRef
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
    with the oldest (in coordinated mode, first with the one of the next round of the order).
    Not thread-safe: the client calls it under its lock."""

    def __init__(self):
        self.held: Deque[Batch] = collections.deque()
        # Data batches of the epoch that reached the client, counted as they arrive (before
        # the caller moves them here), and in coordinated mode by worker the rounds received
        # without a gap from round 0: what the rank tells the dispatcher.
        self.received = 0
        self.rounds: Dict[str, int] = {}
        # Workers whose rounds came with a gap (a batch lost with a broken stream, or dropped
        # as a restarted dispatcher's predecessor's): their count stops there, so the order
        # takes no round this rank lacks; what comes after is yielded after the order.
        self.gapped: Set[str] = set()
        self.quota = 0
        # Whether `quota` is the epoch's final count.
        self.complete = False
        # Coordinated mode: the order of the epoch's rounds, (position of its first listed
        # round, the rounds), None when the epoch is not coordinated.
        self.order: Optional[RoundOrder] = None
        # Every stream of the epoch ended: nothing more will be pushed.
        self.ended = False
        self.yielded = 0
        # Coordinated mode: rounds of the order yielded.
        self.position = 0
        self.dropped_rows = 0

    def arrived(self, round_ref: Optional[RoundRef]) -> None:
        """A data batch of the epoch reached the client, dealt in `round_ref` in coordinated mode."""
        self.received += 1
        if round_ref is None:
            return
        worker, index = round_ref
        count = self.rounds.setdefault(worker, 0)
        if index == count and worker not in self.gapped:
            self.rounds[worker] = count + 1
        else:
            self.gapped.add(worker)

    def push(self, batch: Batch) -> None:
        self.held.append(batch)

    def end(self) -> None:
        self.ended = True

    def set_quota(self, batches: int, complete: bool, order: Optional[RoundOrder] = None) -> None:
        """The dispatcher's latest quota for the epoch (a restarted one may say less for a
        while: the rank then waits until it relearned the counts), and its order of rounds."""
        self.quota, self.complete, self.order = batches, complete, order

    def _ordered(self) -> Optional[RoundRef]:
        """The round of the order at `position`, if the order has reached it."""
        if self.order is None:
            return None
        base, rounds = self.order
        offset = self.position - base
        return rounds[offset] if 0 <= offset < len(rounds) else None

    def step(self) -> Tuple[Step, Optional[Batch]]:
        """What to do with the next held batch, taking it unless the step is WAIT or DONE: the
        round the order has next, else the oldest."""
        if self.held and not self.held[0].tensors:
            return Step.PASS, self.held.popleft()
        next_round = self._ordered()
        if next_round is not None:
            at = next((i for i, b in enumerate(self.held) if b.round == next_round), None)
            if at is None:
                # Every rank has reported this round: it is on its way.
                return Step.WAIT, None
            batch = self.held[at]
            del self.held[at]
            self.position += 1
            self.yielded += 1
            return Step.YIELD, batch
        if self.order is not None and not self.complete:
            # The order goes on growing until the quota is final; what it did not take comes after.
            return (Step.DONE if not self.held and self.ended else Step.WAIT), None
        if not self.held:
            # Everything received went out: whatever the final quota, it is not above that.
            return (Step.DONE if self.ended else Step.WAIT), None
        batch = self.held[0]
        if self.yielded < self.quota:
            self.yielded += 1
            step = Step.YIELD
        elif self.complete:
            self.dropped_rows += rows_in(batch)
            step = Step.DROP
        else:
            return Step.WAIT, None
        self.held.popleft()
        return step, batch
