"""DLRM's preprocessing of a Criteo-style table (worker/bench/peers/criteo_generate.py) with
pyarrow and numpy, vectorised: what the DLRM peers of `stoker-worker bench dlrm` run.

The counts: nulls to 0, `log1p(max(x, 0))`, the 13 stacked into float32 [n, 13]. The
categoricals: Criteo's are 8-digit hex strings, so the strongest numpy recipe reads them as
integers straight from the Arrow buffer (a lookup table per digit, no Python per value), as
torchrec's Criteo preprocessing does with `int(x, 16)`, modulo the buckets; a null is 0."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

DENSE = [f"i{i}" for i in range(1, 14)]
CATEGORICAL = [f"c{c}" for c in range(1, 27)]
COLUMNS = ["label", *DENSE, *CATEGORICAL]
BUCKETS = 10_000_000
BATCH = 2048

HEX_VALUE = np.zeros(256, dtype=np.uint64)
for i, ch in enumerate(b"0123456789abcdef"):
    HEX_VALUE[ch] = i
POWERS = (16 ** np.arange(7, -1, -1)).astype(np.uint64)


def hex_ids(column):
    """8-digit hex strings (nulls as 0) to integers modulo BUCKETS, uint64 [n]."""
    column = pc.fill_null(column, "00000000")
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    n = len(column)
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32, count=n + 1, offset=4 * column.offset)
    start, end = int(offsets[0]), int(offsets[-1])
    if end - start != 8 * n:
        raise ValueError("the categoricals are not all 8 hex digits")
    digits = np.frombuffer(column.buffers()[2], dtype=np.uint8, count=end - start, offset=start).reshape(n, 8)
    return (HEX_VALUE[digits] @ POWERS) % np.uint64(BUCKETS)


def preprocess(batch):
    """A pyarrow RecordBatch or Table of COLUMNS to the model's numpy arrays: `dense` float32
    [n, 13], `sparse` int64 [n, 26] (one array, not 26: fewer tensors to pass between
    processes) and `label` int64 [n]."""
    dense = np.empty((batch.num_rows, len(DENSE)), dtype=np.float32)
    for j, name in enumerate(DENSE):
        counts = pc.fill_null(batch.column(name), 0).to_numpy()
        dense[:, j] = np.log1p(np.maximum(counts, 0, dtype=np.float64))
    sparse = np.empty((batch.num_rows, len(CATEGORICAL)), dtype=np.int64)
    for j, name in enumerate(CATEGORICAL):
        sparse[:, j] = hex_ids(batch.column(name))
    label = batch.column("label").to_numpy().astype(np.int64)
    return {"dense": dense, "sparse": sparse, "label": label}
