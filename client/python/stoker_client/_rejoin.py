"""What a client has received of its job's unfinished epochs, kept for a dispatcher that restarts
(Rejoin in api/proto/stoker/v1alpha1/dispatcher.proto).

A restarted dispatcher (or the one of a new leader) has forgotten which splits it handed out and
what came of them. It learns it from the job's clients: each tells it the splits whose completion
it received and the rows it received, whether its training loop has had them yet or not; the
other splits are produced again without those rows. So a client keeps, for the job's open epoch
and after, every completion that arrived and the rows of every batch that arrived, including
rows it already acknowledged as held when their worker left the list: the new dispatcher never
heard of them. From the moment it rejoins, the client drops the batches of the dispatcher before
as they arrive: the rows it had not received when it told what it had are produced again."""

from typing import Dict, Iterable, List, Set, Tuple

from . import _wire

SplitKey = Tuple[int, int]


class Received:
    """Completions and rows that arrived, by (epoch, split), and the dispatchers rejoined away
    from. Not thread-safe: the client calls it under its lock."""

    def __init__(self):
        # The job's open epoch, as the dispatcher last said: nothing before it is kept.
        self.open_epoch = 0
        self.completed: Set[SplitKey] = set()
        self.rows: Dict[SplitKey, Set[int]] = {}
        # Completions a rejoin told the dispatcher: not acknowledged again when the caller
        # takes their batch (or, for a rank, when it enters the ration).
        self.reported: Set[SplitKey] = set()
        # Incarnations of the dispatchers the client rejoined away from.
        self.retired: Set[int] = set()

    def dropped(self, incarnation: int) -> bool:
        """Whether a batch of `incarnation` is dropped as it arrives: its dispatcher is one the
        client rejoined away from, and the new one produces its rows again."""
        return incarnation in self.retired

    def arrived(self, epoch: int, completes: Iterable[int], rows: Dict[SplitKey, List[int]]) -> None:
        """A batch of `epoch` reached the client's buffers: the splits it completes, and its
        rows' positions by (epoch, split)."""
        if epoch < self.open_epoch:
            return  # a straggler of a finished epoch: every split of it is done
        self.completed.update((epoch, split) for split in completes)
        for key, positions in rows.items():
            self.rows.setdefault(key, set()).update(positions)

    def taken(self, done: Iterable[SplitKey]) -> None:
        """A job not read by ranks: the caller took the last batch of these splits, so they are
        done once acknowledged, and their rows need not be told (as rows held from a worker
        that left the list stop being told). A rank keeps them until the epoch is finished."""
        for key in done:
            self.rows.pop(key, None)

    def unreported(self, done: List[SplitKey]) -> List[SplitKey]:
        """Of these completions taken, the ones to acknowledge: not those a rejoin told."""
        return [key for key in done if key not in self.reported]

    def saw_open_epoch(self, epoch: int) -> None:
        """The job's open epoch moved to `epoch`: every split of the epochs before is done."""
        if epoch <= self.open_epoch:
            return
        self.open_epoch = epoch
        self.completed = {key for key in self.completed if key[0] >= epoch}
        self.reported = {key for key in self.reported if key[0] >= epoch}
        for key in [key for key in self.rows if key[0] < epoch]:
            del self.rows[key]

    def rejoin(self, incarnation: int, clients: int) -> _wire.Rejoin:
        """Leaves the dispatcher `incarnation` (its batches are dropped from now on; 0, a
        dispatcher that does not tell its incarnation, cannot be told apart from a standalone
        worker's batches and is not) and says what the client has: every completion that
        arrived (from now on reported) and the rows kept, positions sorted. `clients`: the
        job's clients as that dispatcher last listed them."""
        if incarnation:
            self.retired.add(incarnation)
        self.reported |= self.completed
        received = [_wire.Held(epoch, split, sorted(positions))
                    for (epoch, split), positions in sorted(self.rows.items()) if positions]
        return _wire.Rejoin(incarnation, self.open_epoch, clients, sorted(self.completed), received)
