"""Tokenize + pack: Stoker's `tokenize` and `pack` beside Hugging Face `datasets.map`.

    cargo build --release -p stoker-worker
    pip install datasets tokenizers ./client/python
    python worker/bench/tokenize-pack.py [--docs 40000] [--rounds 2] [--format jsonl|parquet]

The corpus: `--docs` generated JSONL documents (English-like words of varied lengths and some
non-ASCII, 40-400 words each) in 8 files, and a byte-level BPE tokenizer (vocabulary 32000)
trained on it with the `tokenizers` package and saved as tokenizer.json. Both sides turn every
document into token ids with that tokenizer and pack them into rows of 2048 tokens with an
end-of-document id between documents:

- Stoker: a standalone `stoker-worker --threads 2` (`tokenize` then `pack: {length: 2048}`,
  batches of 16 rows) read by `stoker_client.Client` in this process; an epoch after a warm-up
  epoch, timed from the end of the one before.
- Hugging Face, its documented recipe (run_clm's): `load_dataset("json")`, then
  `map(tokenize, batched=True)` with the fast tokenizer (`Tokenizer.encode_batch`) and
  `map(group_texts, batched=True)` into 2048-token blocks, both `keep_in_memory=True`; timed
  from the loaded dataset to the packed one. Its best of two ways of using the 2 cores: one
  process with the tokenizer's own threads, or `num_proc=2` with them off.

With `--format parquet` the same documents are Parquet files (a `text` column and an `id`
column no side reads, written by pyarrow): Stoker reads only the `text` column (derived from
its ops), Hugging Face `load_dataset("parquet")` with `columns=["text"]`.

Prints tokens per second for each, alternating rounds.
"""

import argparse
import json
import os
import pathlib
import random
import sys
import time

from standalone import serve

ROOT = pathlib.Path(__file__).resolve().parents[2]
LENGTH = 2048
EOS = 2


def words(rng):
    base = [
        "data",
        "input",
        "pipeline",
        "training",
        "accelerator",
        "stall",
        "worker",
        "batch",
        "token",
        "model",
        "language",
        "the",
        "a",
        "of",
        "and",
        "to",
        "in",
        "is",
        "that",
        "for",
        "it",
        "with",
        "as",
        "on",
        "was",
        "naïve",
        "café",
        "日本語",
        "données",
        "преобразование",
        "x86",
        "2048",
        "GPU's",
        "(note)",
        "e.g.",
    ]
    extra = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 12))) for _ in range(3000)]
    return base + extra


def write_corpus(directory, docs, seed=7):
    rng = random.Random(seed)
    vocab = words(rng)
    files = [open(directory / f"{i}.jsonl", "w") for i in range(8)]
    for n in range(docs):
        text = " ".join(rng.choice(vocab) for _ in range(rng.randint(40, 400)))
        files[n % 8].write(json.dumps({"text": text}) + "\n")
    for f in files:
        f.close()


def write_parquet(jsonl, directory):
    """The JSONL corpus's documents, file for file, as Parquet: `text` and an unread `id`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    for path in sorted(jsonl.glob("*.jsonl")):
        texts = [json.loads(line)["text"] for line in open(path)]
        table = pa.table({"id": pa.array(range(len(texts)), pa.int64()), "text": pa.array(texts)})
        pq.write_table(table, directory / (path.stem + ".parquet"))


def train_tokenizer(directory, path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=["<pad>", "<s>", "</s>"])
    texts = (json.loads(line)["text"] for f in sorted(directory.glob("*.jsonl")) for line in open(f))
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))


def stoker_tokens_per_second(worker_bin, data, tokenizer, threads, fmt):
    from stoker_client import Client

    spec = (
        f"  source: {{uri: 'file://{data}/', format: {fmt}}}\n"
        "  transforms:\n"
        f"  - tokenize: {{tokenizer: '{tokenizer}', addSpecialTokens: false}}\n"
        f"  - pack: {{length: {LENGTH}, separator: {EOS}}}\n"
        "  batchSize: 16\n"
    )
    with serve(worker_bin, spec, 2, threads) as address:
        end, tokens = {}, {}
        with Client([address], "bench", "bench", max_message_bytes=64 << 20) as client:
            for batch in client:
                end[batch.epoch] = time.perf_counter()
                tokens[batch.epoch] = tokens.get(batch.epoch, 0) + int((batch["segment_ids"] > 0).sum())
        return tokens[1] / (end[1] - end[0]), tokens[1]


def hf_tokens_per_second(data, tokenizer_path, num_proc, fmt):
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    os.environ["TOKENIZERS_PARALLELISM"] = "false" if num_proc > 1 else "true"
    files = sorted(str(p) for p in pathlib.Path(data).glob(f"*.{fmt}"))
    if fmt == "parquet":
        raw = datasets.load_dataset("parquet", data_files=files, columns=["text"], split="train", keep_in_memory=True)
    else:
        raw = datasets.load_dataset("json", data_files=files, split="train", keep_in_memory=True)
    tok = Tokenizer.from_file(str(tokenizer_path))

    def tokenize(batch):
        return {"input_ids": [e.ids + [EOS] for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}

    def group_texts(batch):
        ids = [t for row in batch["input_ids"] for t in row]
        whole = len(ids) // LENGTH * LENGTH
        return {"input_ids": [ids[i : i + LENGTH] for i in range(0, whole, LENGTH)]}

    start = time.perf_counter()
    tokenized = raw.map(
        tokenize,
        batched=True,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=["text"],
        keep_in_memory=True,
    )
    packed = tokenized.map(group_texts, batched=True, num_proc=num_proc if num_proc > 1 else None, keep_in_memory=True)
    elapsed = time.perf_counter() - start
    tokens = len(packed) * LENGTH
    return tokens / elapsed, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=40000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="Stoker worker threads; HF uses the same cores")
    ap.add_argument("--dir", default="/tmp/stoker-bench-text")
    ap.add_argument("--worker-bin", default=str(ROOT / "target" / "release" / "stoker-worker"))
    ap.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    args = ap.parse_args()
    directory = pathlib.Path(args.dir)
    data, tokenizer = directory / "data", directory / "tokenizer.json"
    if not tokenizer.exists():
        data.mkdir(parents=True, exist_ok=True)
        write_corpus(data, args.docs)
        train_tokenizer(data, tokenizer)
    if args.format == "parquet":
        if not (directory / "parquet").exists():
            write_parquet(data, directory / "parquet")
        data = directory / "parquet"
    size = sum(p.stat().st_size for p in data.glob(f"*.{args.format}"))
    what = f"{args.docs} documents, {size / 1e6:.1f} MB of {args.format}"
    print(f"machine: {os.cpu_count()} cores; {what}; rows of {LENGTH}")
    for round in range(1, args.rounds + 1):
        rate, tokens = stoker_tokens_per_second(args.worker_bin, data, tokenizer, args.threads, args.format)
        print(f"round {round} stoker:           {rate / 1e6:6.2f} M tokens/s ({tokens} tokens)")
        for num_proc in (1, args.threads):
            rate, tokens = hf_tokens_per_second(data, tokenizer, num_proc, args.format)
            print(f"round {round} datasets.map x{num_proc}:  {rate / 1e6:6.2f} M tokens/s ({tokens} tokens)")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
