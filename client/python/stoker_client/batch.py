"""Batches and their reassembly from chunks: numpy arrays over the received bytes."""

from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from . import _shared
from ._wire import Chunk, Header
from .errors import ProtocolError

# stoker.v1alpha1.Dtype -> numpy (little-endian on the wire).
DTYPES = {
    1: np.dtype("u1"),
    2: np.dtype("<i4"),
    3: np.dtype("<i8"),
    4: np.dtype("<f2"),
    5: np.dtype("<f4"),
    6: np.dtype("<f8"),
    # Text: offsets then the strings (see _strings); arrives as an object array of `bytes`.
    7: np.dtype("u1"),
}
BYTES = 7

DEFAULT_MAX_BATCH_BYTES = 16 << 30


def _strings(meta, data: np.ndarray) -> np.ndarray:
    """A text tensor's bytes (count + 1 little-endian uint64 offsets, then the strings) as an
    object array of `bytes` of its shape; `.astype(str)` or `[s.decode() ...]` for text."""
    count = int(np.prod(meta.shape, dtype=np.int64))
    head = (count + 1) * 8
    offsets = data[:head].view("<u8").astype(np.int64)
    if offsets[0] != 0 or np.any(np.diff(offsets) < 0) or head + offsets[-1] != len(data):
        raise ProtocolError(f"tensor {meta.name!r}: its string offsets do not match its {len(data)} bytes")
    payload = data[head:].tobytes()
    out = np.empty(count, dtype=object)
    out[:] = [payload[offsets[i]:offsets[i + 1]] for i in range(count)]
    return out.reshape(meta.shape)


class Batch:
    """Named tensors (`dict[str, numpy.ndarray]`) and where they came from.

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

    `round`: in coordinated mode (`Client.from_dispatcher(coordinated=True)`), the round the
    worker dealt the batch in, `(worker id, index)` with rounds counted from 0 in each epoch;
    None otherwise."""

    __slots__ = ("tensors", "epoch", "split", "sequence", "completes", "rows", "incarnation", "round")

    def __init__(self, tensors: Dict[str, np.ndarray], epoch: int, split: int, sequence: int, completes=(), rows=(),
                 incarnation: int = 0, round: Optional[Tuple[str, int]] = None):
        self.tensors = tensors
        self.epoch = epoch
        self.split = split
        self.sequence = sequence
        # Splits whose last element is in this batch (under the dispatcher).
        self.completes = list(completes)
        self.rows = np.asarray(rows, dtype=np.uint64)
        self.incarnation = incarnation
        self.round = round

    def __getitem__(self, name: str) -> np.ndarray:
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
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self.tensors.items())
        return f"Batch(epoch={self.epoch}, split={self.split}, sequence={self.sequence}, {shapes})"


class Reassembler:
    """Turns a stream of chunks into batches, checking everything a worker declares."""

    def __init__(self, max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES, shared_memory: bool = False):
        self.max_batch_bytes = max_batch_bytes
        # The stream asked for batches through shared memory (`_shared`).
        self.shared_memory = shared_memory
        self._header: Optional[Header] = None
        self._declared = 0
        self._received = 0
        self._pieces: List[Tuple[int, memoryview]] = []

    def push(self, chunk: Chunk) -> Optional[Batch]:
        if chunk.header is not None:
            if self._header is not None:
                raise ProtocolError("a header arrived in the middle of a batch")
            self._start(chunk.header)
        elif self._header is None:
            raise ProtocolError("a chunk without a header started a batch")
        if chunk.shared_file:
            return self._shared(chunk)
        for piece in chunk.pieces:
            if self._received + len(piece) > self._declared:
                raise ProtocolError(f"more payload than the header declared ({self._declared} bytes)")
            self._pieces.append((self._received, piece))
            self._received += len(piece)
        if not chunk.last:
            return None
        if self._received != self._declared:
            raise ProtocolError(f"batch ended after {self._received} of {self._declared} payload bytes")
        batch = self._finish()
        self._header, self._pieces, self._declared, self._received = None, [], 0, 0
        return batch

    def _shared(self, chunk: Chunk) -> Batch:
        """A batch whose payload is in a file of the shared-memory directory: arrays over the
        file mapped read-only, no copy."""
        try:
            if not self.shared_memory:
                raise ProtocolError("a batch in shared memory, which this stream did not ask for")
            if chunk.header is None or chunk.pieces or not chunk.last:
                raise ProtocolError("a batch in shared memory comes whole in one chunk")
            try:
                mapped = _shared.take(chunk.shared_file, self._declared, reuse=chunk.reuse_shared_file)
            except (OSError, ValueError) as e:
                raise ProtocolError(f"the batch's shared-memory file: {e}") from e
            self._pieces, self._received = [(0, memoryview(mapped)[:self._declared])], self._declared
            return self._finish()
        finally:
            self._header, self._pieces, self._declared, self._received = None, [], 0, 0

    def finish(self) -> None:
        """The stream ended: it must not be in the middle of a batch."""
        if self._header is not None:
            raise ProtocolError("the stream ended in the middle of a batch")

    def _start(self, header: Header) -> None:
        names = set()
        total = 0
        for t in header.tensors:
            if t.name in names:
                raise ProtocolError(f"tensor {t.name!r} appears twice")
            names.add(t.name)
            dtype = DTYPES.get(t.dtype)
            if dtype is None:
                raise ProtocolError(f"tensor {t.name!r} has unknown dtype {t.dtype}")
            count = 1
            for dim in t.shape:
                count *= dim
            if t.dtype == BYTES:
                if (count + 1) * 8 > t.byte_length:
                    raise ProtocolError(f"tensor {t.name!r}: {t.byte_length} bytes cannot hold {count} strings")
            elif count * dtype.itemsize != t.byte_length:
                raise ProtocolError(f"tensor {t.name!r}: shape {t.shape} does not match its {t.byte_length} bytes")
            total += t.byte_length
        if total > self.max_batch_bytes:
            raise ProtocolError(f"batch of {total} bytes is over the client's limit of {self.max_batch_bytes}")
        self._header, self._declared = header, total

    def _finish(self) -> Batch:
        header = self._header
        tensors = {}
        offset = 0
        pieces = self._pieces
        index = 0
        for t in header.tensors:
            dtype = DTYPES[t.dtype]
            end = offset + t.byte_length
            # Skip pieces that end before this tensor starts.
            while index < len(pieces) and pieces[index][0] + len(pieces[index][1]) <= offset and t.byte_length:
                index += 1
            start_at, piece = pieces[index] if index < len(pieces) else (offset, memoryview(b""))
            if t.byte_length == 0:
                data = np.empty(0, dtype=dtype)
            elif start_at <= offset and end <= start_at + len(piece):
                # In one piece: a view of the received message, no copy.
                data = np.frombuffer(piece[offset - start_at:end - start_at], dtype=dtype)
            else:
                # Spread over pieces: the one copy, into a fresh buffer.
                buf = np.empty(t.byte_length, dtype=np.uint8)
                filled, i = 0, index
                while filled < t.byte_length:
                    p_start, p = pieces[i]
                    lo = max(offset + filled, p_start) - p_start
                    hi = min(end, p_start + len(p)) - p_start
                    n = hi - lo
                    buf[filled:filled + n] = np.frombuffer(p[lo:hi], dtype=np.uint8)
                    filled += n
                    i += 1
                data = buf.view(dtype)
            tensors[t.name] = _strings(t, data) if t.dtype == BYTES else data.reshape(t.shape)
            offset = end
        return Batch(tensors, header.epoch, header.split, header.sequence, header.completes, header.rows,
                     header.incarnation, header.round)
