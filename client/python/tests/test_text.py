"""Text for language models through a real worker: `tokenize` gives the ids the Python
`tokenizers` package gives for the same tokenizer.json (a BPE trained here on a generated
corpus, with special tokens and truncation), and text cast to `bytes` arrives as text (an
object array of the original byte strings), also through a `python` op."""

import json
import os
import random
import sys

import numpy as np
import pytest
import tokenizers  # noqa: F401 - `make venv` installs it: a missing one fails, never skips

from stoker_client import Client

from conftest import Worker, manifest, within

os.environ.setdefault("STOKER_PYTHON", sys.executable)

WORDS = [
    "the",
    "data",
    "loader",
    "stalls",
    "while",
    "gpus",
    "wait",
    "ünïcode",
    "日本語",
    "tokens",
    "pack",
    "mix",
    "stoker",
    "feeds",
    "accelerators",
    "quickly",
    "and",
    "again",
    "🙂",
    "x",
]


def corpus(n, seed=3):
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 60))) + rng.choice(["", ".", "!\n"]) for _ in range(n)
    ]


def train(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<s>", "</s>"])
    tok.train_from_iterator(corpus(500, seed=1), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    tok.save(str(path))
    return Tokenizer.from_file(str(path))


def serve(tmp_path, data, rest):
    """Every row of one epoch of a JSONL pipeline (`rest`: its transforms and batching) served
    by a standalone worker: {row: {field: value}}."""
    pipeline = manifest(tmp_path, f"  source: {{uri: 'file://{data}/', format: jsonl}}\n  transforms:\n{rest}")
    worker = Worker(pipeline, tmp_path / "worker.log", epochs=1)
    try:
        return within(120, read_all, worker.address)
    finally:
        worker.stop()


def read_all(address):
    rows = {}
    with Client([address], "test", "py") as client:
        for batch in client:
            for i, row in enumerate(batch.rows.tolist()):
                rows[row] = {name: t[i] for name, t in batch.tensors.items()}
    return rows


@pytest.mark.parametrize("max_length", [None, 16])
def test_tokenize_equals_the_python_tokenizers_package(tmp_path, max_length):
    tok = train(tmp_path / "tokenizer.json")
    if max_length:
        tok.enable_truncation(max_length)
    texts = corpus(120)
    data = tmp_path / "data"
    data.mkdir()
    for f in range(3):
        (data / f"{f}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[f * 40 : (f + 1) * 40]))
    truncation = f", maxLength: {max_length}" if max_length else ""
    rows = serve(
        tmp_path,
        data,
        f"  - tokenize: {{tokenizer: '{tmp_path / 'tokenizer.json'}'{truncation}}}\n"
        "  - cast: {field: text, dtype: bytes}\n"
        "  batchSize: 8\n"
        "  padValue: -1\n",
    )
    assert len(rows) == len(texts)
    for row, element in rows.items():
        split, position = row >> 32, row & 0xFFFFFFFF
        text = texts[split * 40 + position]
        assert element["text"] == text.encode(), "text stays text, byte for byte"
        want = tok.encode(text).ids
        ids = element["input_ids"]
        assert ids.dtype == np.int32
        assert ids[: len(want)].tolist() == want, text
        assert (ids[len(want) :] == -1).all(), "the rest is the batch's padding"
        assert want[0] == 1 and (max_length or want[-1] == 2), "special tokens added"
        if max_length:
            assert len(want) <= max_length


def test_text_reaches_a_python_op_and_comes_back_as_text(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "words.py").write_text(
        "def split(element, rng):\n"
        "    text = element['text']\n"
        "    assert isinstance(text, bytes), type(text)\n"
        "    return {'words': text.decode().split()[:3] + ['']*(3 - len(text.decode().split()[:3])), 'n': len(text)}\n"
    )
    data = tmp_path / "data"
    data.mkdir()
    texts = corpus(30)
    (data / "0.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    rows = serve(
        tmp_path,
        data,
        "  - cast: {field: text, dtype: bytes}\n"
        f"  - python: {{module: words, function: split, path: '{code}'}}\n"
        "  batchSize: 4\n",
    )
    assert len(rows) == len(texts)
    for row, element in rows.items():
        text = texts[row & 0xFFFFFFFF]
        words = (text.split()[:3] + [""] * 3)[:3]
        assert element["words"].dtype == object and element["words"].tolist() == [w.encode() for w in words]
        assert element["n"] == len(text.encode())


def test_tokenize_and_pack_lose_no_token_and_mark_documents(tmp_path):
    tok = train(tmp_path / "tokenizer.json")
    texts = corpus(90, seed=5)
    data = tmp_path / "data"
    data.mkdir()
    per_file = 30
    for f in range(3):
        (data / f"{f}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in texts[f * per_file : (f + 1) * per_file])
        )
    length = 32
    rows = serve(
        tmp_path,
        data,
        f"  - tokenize: {{tokenizer: '{tmp_path / 'tokenizer.json'}', addSpecialTokens: false}}\n"
        f"  - pack: {{length: {length}, separator: 2, padId: -1}}\n"
        "  batchSize: 4\n",
    )
    # Without shuffle each split is read in its file's order: its rows, in position order,
    # hold its documents' tokens in order, each followed by the separator, then padding.
    by_split = {}
    for row, element in rows.items():
        assert set(element) == {"input_ids", "segment_ids", "position_ids"}
        assert all(element[k].dtype == np.int32 and element[k].shape == (length,) for k in element)
        by_split.setdefault(row >> 32, []).append((row & 0xFFFFFFFF, element))
    assert sorted(by_split) == [0, 1, 2]
    for split, packed in by_split.items():
        packed.sort(key=lambda p: p[0])
        assert [p for p, _ in packed] == list(range(len(packed))), "positions number the packed rows"
        docs = [tok.encode(t, add_special_tokens=False).ids for t in texts[split * per_file : (split + 1) * per_file]]
        want = [t for d in docs for t in d + ([2] if not d or d[-1] != 2 else [])]
        ids = np.concatenate([e["input_ids"] for _, e in packed])
        segments = np.concatenate([e["segment_ids"] for _, e in packed])
        assert ids[segments > 0].tolist() == want, "every token once, in order"
        assert (ids[segments == 0] == -1).all() and (segments == 0).sum() < length, "only the last row is padded"
        for _, e in packed:
            # Each segment's positions count from 0; a new segment starts where positions do.
            starts = np.flatnonzero(e["position_ids"] == 0)
            real = e["segment_ids"] > 0
            assert (np.diff(e["segment_ids"][real]) >= 0).all()
            assert all(e["segment_ids"][i] != e["segment_ids"][i - 1] for i in starts if i > 0 and real[i])
