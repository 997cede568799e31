"""Jagged tensors through a real worker: the pipeline's `jagged` fields arrive as `Jagged`
(values and lengths, offsets from 0), each row's list as the source held it (after the ops),
through shared memory and over the stream alike, from the columnar path (Parquet and feature
ops) and from the element path (JSONL); the torch adaptor gives torch pairs, and the inputs of
torchrec's `KeyedJaggedTensor` are the fields' values and lengths key-major."""

import json
import os
import random
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from stoker_client import Client, Jagged
from stoker_client.torch import _tensors, keyed_jagged_inputs, keyed_jagged_tensor

from conftest import Worker, manifest, within

os.environ.setdefault("STOKER_PYTHON", sys.executable)

ROWS_PER_FILE = 300


def lists(rng, n, longest, values):
    return [[rng.choice(values) for _ in range(rng.randint(0, longest))] for _ in range(n)]


def serve(tmp_path, source, rest, shared_memory):
    """Every row of one epoch, by provenance: {row: {field: value}}."""
    spec = f"  source: {source}\n  batchSize: 64\n  shuffle: {{bufferSize: 200}}\n{rest}"
    pipeline = manifest(tmp_path, spec, name="jagged")
    worker = Worker(pipeline, tmp_path / "worker.log", epochs=1)
    try:
        return within(120, read_all, worker.address, shared_memory)
    finally:
        worker.stop()


def read_all(address, shared_memory):
    rows, batches = {}, []
    with Client([address], "test", "jagged", shared_memory=shared_memory) as client:
        for batch in client:
            batches.append(batch)
            for i, row in enumerate(batch.rows.tolist()):
                assert row not in rows, "each row once"
                rows[row] = {
                    name: t.row(i).tolist() if isinstance(t, Jagged) else t[i].tolist()
                    for name, t in batch.tensors.items()
                }
    return rows, batches


def check_layout(batch, name, dtype):
    t = batch[name]
    assert isinstance(t, Jagged), f"{name} is {type(t)}"
    values, lengths = t  # a pair
    assert values.dtype == dtype and lengths.dtype == np.int64
    assert t.offsets[0] == 0 and t.offsets[-1] == len(values) and len(t.offsets) == len(batch.rows) + 1
    assert (np.diff(t.offsets) == lengths).all()
    assert t.nbytes == values.nbytes + t.offsets.nbytes


@pytest.mark.parametrize("shared_memory", [True, False])
def test_parquet_id_lists_arrive_jagged_through_feature_ops(tmp_path, shared_memory):
    rng = random.Random(7)
    data = tmp_path / "data"
    data.mkdir()
    expected = {}
    for f in range(2):
        ids = lists(rng, ROWS_PER_FILE, 9, range(-5, 10**12, 977))
        weights = lists(rng, ROWS_PER_FILE, 4, [0.5, 1.25, -2.0])
        label = [rng.randint(0, 1) for _ in range(ROWS_PER_FILE)]
        table = pa.table(
            {
                "ids": pa.array(ids, pa.list_(pa.int64())),
                "weights": pa.array(weights, pa.list_(pa.float32())),
                "label": pa.array(label, pa.int32()),
                "key": pa.array(range(f * ROWS_PER_FILE, (f + 1) * ROWS_PER_FILE), pa.int64()),
            }
        )
        pq.write_table(table, data / f"{f}.parquet", row_group_size=100)
        for i in range(ROWS_PER_FILE):
            key = f * ROWS_PER_FILE + i
            expected[key] = {"ids": ids[i][-5:], "weights": weights[i], "label": label[i], "key": key}
    rows, batches = serve(
        tmp_path,
        f"{{uri: 'file://{data}/', format: parquet}}",
        "  jagged: [ids, weights]\n"
        "  transforms:\n"
        "  - truncate: {fields: [ids], length: 5, keep: last}\n"
        "  - clip: {fields: [label], min: 0, max: 1}\n",
        shared_memory,
    )
    assert len(rows) == len(expected)
    assert sorted(got["key"] for got in rows.values()) == sorted(expected), "every row once"
    for row, got in rows.items():
        assert got == expected[got["key"]], row
    for batch in batches:
        check_layout(batch, "ids", np.int64)
        check_layout(batch, "weights", np.float32)
        assert batch["label"].shape == (len(batch.rows),)
    assert any((batch["ids"].lengths == 0).any() for batch in batches), "empty lists are rows too"

    batch = batches[0]
    keys, values, lengths = keyed_jagged_inputs(batch, ["ids"])
    assert keys == ["ids"] and (values == batch["ids"].values).all() and (lengths == batch["ids"].lengths).all()
    with pytest.raises(ValueError, match="different types"):
        keyed_jagged_inputs(batch)
    with pytest.raises(ValueError, match="not jagged"):
        keyed_jagged_inputs(batch, ["label"])

    tensors = _tensors(batch)
    values, lengths = tensors["ids"]
    assert torch.equal(values, torch.from_numpy(batch["ids"].values.copy()))
    assert torch.equal(lengths, torch.from_numpy(batch["ids"].lengths))
    assert tensors["label"].shape == (len(batch.rows),)


def test_jsonl_lists_arrive_jagged_on_the_element_path(tmp_path):
    rng = random.Random(11)
    data = tmp_path / "data"
    data.mkdir()
    ids = lists(rng, 400, 6, range(1000))
    more = lists(rng, 400, 3, range(7))
    (data / "0.jsonl").write_text("".join(json.dumps({"ids": a, "more": b}) + "\n" for a, b in zip(ids, more)))
    rows, batches = serve(
        tmp_path,
        f"{{uri: 'file://{data}/', format: jsonl}}",
        "  jagged: [ids, more]\n  transforms:\n  - cast: {field: more, dtype: int64}\n",
        True,
    )
    assert len(rows) == 400
    for row, got in rows.items():
        assert got == {"ids": ids[row & 0xFFFFFFFF], "more": more[row & 0xFFFFFFFF]}
    batch = batches[0]
    keys, values, lengths = keyed_jagged_inputs(batch)
    assert keys == ["ids", "more"]
    assert values.tolist() == batch["ids"].values.tolist() + batch["more"].values.tolist()
    assert lengths.tolist() == batch["ids"].lengths.tolist() + batch["more"].lengths.tolist()
    try:
        import torchrec  # noqa: F401
    except ImportError:
        # torchrec's own library (fbgemm_gpu) needs the torch it was built for; where it is
        # missing, the error says what to install.
        with pytest.raises(ImportError, match="pip install torchrec"):
            keyed_jagged_tensor(batch)
    else:
        kjt = keyed_jagged_tensor(batch)
        assert kjt.keys() == ["ids", "more"]
        assert kjt["ids"].values().tolist() == batch["ids"].values.tolist()
        assert kjt["more"].lengths().tolist() == batch["more"].lengths.tolist()
