"""What a consumer's training loop has been handed of the epoch it reads, kept so that the client
can give its state after any batch (`Client.state`): saved with a checkpoint, it restarts the
job there, on any dispatcher and with any number of workers, without repeating or skipping a row
(the dispatcher leaves out the rows every rank had yielded).

A state is a dict that survives JSON: {"job", "epoch", "batches", "consumers",
"consumer_index", "yielded": [[split, [positions, sorted]], ...]} (ResumeState in
api/proto/stoker/v1alpha1/dispatcher.proto)."""

from typing import List

import numpy as np

_KEYS = ("job", "epoch", "batches", "consumers", "consumer_index", "yielded")


def check(state: dict, job: str, consumers: int, consumer_index: int) -> None:
    """Raises ValueError unless `state` is a resume state of this consumer of `job` (0 and 1
    consumers are the same: a job not read by ranks)."""
    missing = [key for key in _KEYS if key not in state]
    if missing:
        raise ValueError(f"not a resume state (Client.state()): it lacks {', '.join(missing)}")
    if state["job"] != job:
        raise ValueError(f"the resume state is of job {state['job']!r}, not {job!r}")
    if (max(state["consumers"], 1), state["consumer_index"]) != (max(consumers, 1), consumer_index):
        raise ValueError(f"the resume state is of consumer {state['consumer_index']} of {state['consumers']}, "
                         f"not {consumer_index} of {consumers}")


class Yielded:
    """The epoch read, the data batches of it handed to the caller and their rows. Not
    thread-safe: the client calls it under its lock."""

    def __init__(self, epoch: int, batches: int = 0, rows: List[np.ndarray] = ()):
        self.epoch, self.batches = epoch, batches
        # Row ids (split << 32 | position), an array per batch: recording one is cheap, the
        # grouping by split is left to `state()`.
        self._rows = list(rows)

    @classmethod
    def resumed(cls, state: dict) -> "Yielded":
        """Goes on from a saved state: a later state of the same epoch covers both runs."""
        rows = [np.uint64(split) << np.uint64(32) | np.asarray(positions, dtype=np.uint64)
                for split, positions in state["yielded"]]
        return cls(state["epoch"], state["batches"], rows)

    def record(self, rows: np.ndarray) -> None:
        """The caller got a data batch with these row ids."""
        self.batches += 1
        if len(rows):
            self._rows.append(rows)

    def next_epoch(self, epoch: int) -> None:
        """The caller moves on to `epoch`."""
        self.epoch, self.batches, self._rows = epoch, 0, []

    def state(self, job: str, consumers: int, consumer_index: int) -> dict:
        rows = np.zeros(0, dtype=np.uint64)
        if self._rows:
            # Kept sorted for the next call (a loader may ask after every batch): timsort then
            # merges the new rows into one long run instead of sorting everything again.
            rows = np.sort(np.concatenate(self._rows), kind="stable")
            self._rows = [rows]
        splits = rows >> np.uint64(32)
        starts = np.flatnonzero(np.diff(splits)) + 1
        yielded = [[int(group[0] >> np.uint64(32)), (group & np.uint64(0xFFFFFFFF)).tolist()]
                   for group in np.split(rows, starts) if len(group)]
        return {"job": job, "epoch": self.epoch, "batches": self.batches, "consumers": consumers,
                "consumer_index": consumer_index, "yielded": yielded}
