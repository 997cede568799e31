"""Batches: named numpy arrays over the bytes the Rust client received (no copy)."""

from collections.abc import Iterator
from typing import Optional, Union

import numpy as np

from .errors import ProtocolError

DEFAULT_MAX_BATCH_BYTES = 16 << 30


def _strings(shape, data: np.ndarray) -> np.ndarray:
    """A text tensor's bytes (count + 1 little-endian uint64 offsets, then the strings) as an
    object array of `bytes` of its shape; `.astype(str)` or `[s.decode() ...]` for text. The
    Rust client checked the offsets."""
    count = int(np.prod(shape, dtype=np.int64))
    head = (count + 1) * 8
    offsets = data[:head].view("<u8").astype(np.int64)
    if head + offsets[-1] != len(data):
        raise ProtocolError(f"a text tensor's offsets do not match its {len(data)} bytes")
    payload = data[head:].tobytes()
    out = np.empty(count, dtype=object)
    out[:] = [payload[offsets[i] : offsets[i + 1]] for i in range(count)]
    return out.reshape(shape)


class Jagged(tuple):
    """A jagged tensor: one list per row, each of its own length (a sparse id list per row),
    as the pipeline's `jagged` fields arrive. It unpacks as the pair `values, lengths`:
    `values` holds every row's values one after another (a read-only view of the received
    bytes), `lengths[i]` is row i's count (int64). `offsets` (int64, rows + 1, from 0) says
    where each row starts: row i is `values[offsets[i]:offsets[i + 1]]`, also `row(i)`."""

    offsets: np.ndarray

    def __new__(cls, values: np.ndarray, offsets: np.ndarray) -> "Jagged":
        self = super().__new__(cls, (values, np.diff(offsets)))
        self.offsets = offsets
        return self

    @property
    def values(self) -> np.ndarray:
        return self[0]

    @property
    def lengths(self) -> np.ndarray:
        return self[1]

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.offsets.nbytes

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def __repr__(self) -> str:
        return f"Jagged({self.values.dtype}, rows={self.rows}, values={len(self.values)})"


Tensor = Union[np.ndarray, Jagged]


def _array(source, text_shape, offsets) -> Tensor:
    if offsets is not None:
        return Jagged(np.asarray(source), np.asarray(offsets))
    if text_shape is not None:
        return _strings(text_shape, np.asarray(source))
    return np.asarray(source)


class Batch:
    """Named tensors (`dict[str, numpy.ndarray]`, a `Jagged` for each of the pipeline's
    `jagged` fields) and where they came from.

    Arrays are read-only views of the received message where a tensor arrived in one piece,
    or of the shared memory a worker on the same host wrote the batch to (no copy); `.copy()`
    one to write to it.

    `rows` says where each row came from, in row order: a numpy uint64 array of
    `split << 32 | position`, the position being the element's index in its split's source
    order (record or file index) whatever the shuffle did. A split produced again after its
    worker died yields the same positions, so `(epoch, row)` names a row whichever attempt
    delivered it. Empty when the worker sends none.

    `incarnation`: under the dispatcher, the dispatcher's start that handed out the splits of
    the rows (0 from a standalone worker).

    `echo_copies`: where the pipeline has an `echo` op, each row's copy number (numpy uint8,
    row order): 0 for the element's first row, 1 to factor - 1 for the rows echoing it; zeros
    otherwise. Each copy is a row of its own everywhere else: its position in `rows` carries
    the copy, so exactly-once and resume hold per copy.

    `round`: in coordinated mode (`Client.from_dispatcher(coordinated=True)`), the round the
    worker dealt the batch in, `(worker id, index)` with rounds counted from 0 in each epoch;
    None otherwise."""

    __slots__ = ("tensors", "epoch", "split", "sequence", "completes", "rows", "incarnation", "round", "_copies")

    def __init__(
        self,
        tensors: dict[str, Tensor],
        epoch: int,
        split: int,
        sequence: int,
        completes=(),
        rows=(),
        incarnation: int = 0,
        round: Optional[tuple[str, int]] = None,
        echo_copies=None,
    ):
        self.tensors = tensors
        self.epoch = epoch
        self.split = split
        self.sequence = sequence
        # Splits whose last element is in this batch (under the dispatcher).
        self.completes = list(completes)
        self.rows = np.asarray(rows, dtype=np.uint64)
        self.incarnation = incarnation
        self.round = round
        self._copies = None if echo_copies is None else np.asarray(echo_copies, dtype=np.uint8)

    @classmethod
    def _from_core(cls, parts) -> "Batch":
        """A batch as the Rust client hands it over (client/python/src/convert.rs `batch`)."""
        tensors, epoch, split, sequence, completes, rows, incarnation, round, copies = parts
        arrays = {name: _array(source, text_shape, offsets) for name, source, text_shape, offsets in tensors}
        copies = None if copies is None else np.asarray(copies)
        return cls(arrays, epoch, split, sequence, completes, np.asarray(rows), incarnation, round, copies)

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def keys(self):
        return self.tensors.keys()

    def items(self):
        return self.tensors.items()

    @property
    def echo_copies(self) -> np.ndarray:
        if self._copies is None:
            return np.zeros(len(self.rows), dtype=np.uint8)
        return self._copies

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{k}: {v!r}" if isinstance(v, Jagged) else f"{k}: {v.dtype}{list(v.shape)}"
            for k, v in self.tensors.items()
        )
        return f"Batch(epoch={self.epoch}, split={self.split}, sequence={self.sequence}, {shapes})"
