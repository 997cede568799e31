"""The data and the reference of worker/tests/features_numpy.rs.

Writes, with pyarrow, Parquet files of a few thousand rows of varied types (integers of every width
with nulls, floats with nulls, NaN and infinities, plain, dictionary-encoded and large strings,
binary, lists with null lists and null items, several row groups in two files of different codecs),
two vocabulary files, and the output each feature op should give on those rows, computed here with
numpy, pyarrow and xxhash from docs/transforms.md ("Feature ops"), never by Stoker.

Usage: features_reference.py DIR. Writes DIR/data/part-{0,1}.parquet, DIR/vocab_strings.txt,
DIR/vocab_ints.txt and DIR/expected.json:

    {"rows": N, "file_order": [the ids in the files' order],
     "inputs": {column: [the value of row id, as text]},
     "expected": {"op.column": {"kind": ..., "input": column, "values": [the output of row id]}}}

Every output is indexed by the row's `id` (0 to N - 1), so the order rows arrive in does not matter.
Kinds: "i64" (integers), "f32" and "f64" (the floats' IEEE bits, so NaN and -0.0 survive JSON),
"bytes" (hex), "list_i64", "list_bytes" and "vec_f32" (a concat's vector, bits). A null an op lets
through is filled by the pipeline afterwards; the values here are after that fill. The pipelines'
parameters are features_numpy.rs's, repeated here.
"""

import json
import math
import sys
from pathlib import Path

try:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError as e:
    sys.exit(f"features_reference.py needs numpy and pyarrow ({e}); `make venv` installs them")
try:
    import xxhash
except ImportError:
    sys.exit(
        "features_reference.py needs the xxhash package (hashBucket's and cross's reference); `make venv` installs it"
    )

N = 4000
rng = np.random.default_rng(20250611)

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
U64_MAX = 2**64 - 1

# The pipelines' parameters (as features_numpy.rs gives them).
FILL_VALUE = -1.5
FILL_TEXT = "(missing)"
AFTER = -1  # what each pipeline fills the nulls an op let through with
MEAN, STD = 3.25, 1.7
BOUNDARIES = [-10.0, -1.0, 0.0, 0.5, 2.0, 3.25, 100.0, 10000.0]
LIST_BOUNDARIES = [0.0, 10.0, 1000.0]
STRING_BUCKETS, INT_BUCKETS, LIST_BUCKETS = 1000003, 97, 2**40
STRINGS_OOV = 1000
U64_MEAN, U64_STD = 1e19, 1e18
U64_BOUNDARIES = [10.0, 2.0**63, 1.8e19]

# ---------------------------------------------------------------------------------------------
# The data, each column indexed by id: numeric columns as (values, null mask), the others as lists
# of Python values (None for a null).


def inject(values: np.ndarray, specials: list, copies: int = 5) -> None:
    """Puts each special value at `copies` random rows."""
    at = rng.choice(N, size=len(specials) * copies, replace=False)
    values[at] = np.tile(np.array(specials, dtype=values.dtype), copies)


def mask(p: float) -> np.ndarray:
    return rng.random(N) < p


numeric: dict = {}

i8 = rng.integers(-128, 128, N).astype(np.int8)
inject(i8, [-128, 127, -10, -1, 0, 2, 100, -100, 0])
numeric["i8"] = (i8, mask(0.1))

i16 = rng.integers(-(2**15), 2**15, N).astype(np.int16)
inject(i16, [-32768, 32767, 3, 0, -1])
numeric["i16"] = (i16, mask(0.1))

i32 = np.where(rng.random(N) < 0.7, rng.integers(-12, 120, N), rng.integers(-(2**31), 2**31, N)).astype(np.int32)
inject(i32, [-(2**31), 2**31 - 1, -10, -6, -5, -4, 0, 2, 3, 100, 10000])
numeric["i32"] = (i32, mask(0.12))

# Criteo-like counts (-2 and up, a long tail), some huge values and the extremes.
counts = rng.geometric(0.05, N) - 3
huge = rng.integers(-(2**62), 2**62, N)
i64 = np.where(rng.random(N) < 0.75, counts, huge).astype(np.int64)
inject(i64, [I64_MIN, I64_MAX, -101, -100, 1000, 1001, 0, -1, 7, 42, 2**53 + 1])
numeric["i64"] = (i64, mask(0.15))

u32 = np.where(rng.random(N) < 0.5, rng.integers(0, 20, N), rng.integers(0, 2**32, N)).astype(np.uint32)
inject(u32, [0, 2**32 - 1, 2**31, 3000000000, 3000000001, 2999999999, 100])
numeric["u32"] = (u32, mask(0.1))

u64 = np.where(
    rng.random(N) < 0.4,
    rng.integers(0, 20, N, dtype=np.uint64),
    rng.integers(0, U64_MAX, N, dtype=np.uint64, endpoint=True),
).astype(np.uint64)
inject(u64, [0, 10, 2**63 - 1, 2**63, 2**63 + 1, U64_MAX, U64_MAX - 1, 7, 42])
numeric["u64"] = (u64, mask(0.1))

f32 = (rng.standard_normal(N) * 50).astype(np.float32)
f32_specials = [np.nan, np.inf, -np.inf, -0.0, 0.0, -5.5, -10, -1, 0.5, 2, 3.25, 100, 10000, 1e-45]
inject(f32, [*f32_specials, float(np.finfo(np.float32).max), -float(np.finfo(np.float32).max)])
numeric["f32"] = (f32, mask(0.1))

f64 = np.where(rng.random(N) < 0.5, rng.lognormal(2, 2, N), rng.standard_normal(N) * 1e3)
f64_specials = [np.nan, np.inf, -np.inf, -0.0, 1e300, -1e300, 5e-324, -100.25, 1000.75, -1, 0.5, 3.25, 10000]
inject(f64, f64_specials)
numeric["f64"] = (f64, mask(0.1))

flag = rng.random(N) < 0.3
numeric["flag"] = (flag, mask(0.1))

# Categorical strings: 8-hex-digit ids as Criteo has them, and some harder ones (empty, non-ASCII,
# longer than XXH64's 32-byte stripe, spaces).
TOKENS = [f"{int(v):08x}" for v in rng.integers(0, 2**32, 60)]
TOKENS += ["", "café", "東京", "naïve résumé", "🙂", "a" * 40, "x" * 33 + "é", "Straße", "tab\tsep", "trailing "]
weights = 1 / np.arange(1, len(TOKENS) + 1)
weights /= weights.sum()


def draw_tokens(p_null: float) -> list:
    picks = rng.choice(len(TOKENS), size=N, p=weights)
    nulls = mask(p_null)
    return [None if nulls[i] else TOKENS[picks[i]] for i in range(N)]


strings = {"s": draw_tokens(0.1), "sd": draw_tokens(0.15), "sl": draw_tokens(0.05)}
# Longer text in the large strings.
for i in rng.choice(N, size=200, replace=False):
    if strings["sl"][i] is not None:
        strings["sl"][i] = " ".join(rng.choice(TOKENS[:60], size=int(rng.integers(2, 30))))


def draw_binary() -> list:
    out: list = []
    for _ in range(N):
        r = rng.random()
        if r < 0.08:
            out.append(None)
        elif r < 0.5:
            out.append(TOKENS[int(rng.integers(0, len(TOKENS)))].encode())
        else:
            out.append(rng.bytes(int(rng.integers(0, 48))))
    return out


binary = draw_binary()
binary[int(rng.integers(0, N))] = b"\x00"
binary[int(rng.integers(0, N))] = b"\xff\xfe"


def int_lists(p_null_list: float, p_null_item: float) -> list:
    out: list = []
    for _ in range(N):
        if rng.random() < p_null_list:
            out.append(None)
            continue
        n = int(min(rng.geometric(0.25) - 1, 14))
        items: list = []
        for _ in range(n):
            if rng.random() < p_null_item:
                items.append(None)
            elif rng.random() < 0.9:
                items.append(int(rng.integers(-3, 60)))
            else:
                items.append(int(rng.integers(-(2**62), 2**62)))
        out.append(items)
    return out


def string_lists(p_null_list: float, p_null_item: float) -> list:
    out: list = []
    for _ in range(N):
        if rng.random() < p_null_list:
            out.append(None)
            continue
        n = int(rng.integers(0, 9))
        out.append(
            [None if rng.random() < p_null_item else TOKENS[int(rng.integers(0, len(TOKENS)))] for _ in range(n)]
        )
    return out


lists = {
    "lst": int_lists(0.08, 0.0),
    "lstn": int_lists(0.05, 0.1),
    "big": int_lists(0.08, 0.0),
    "bigf": int_lists(0.0, 0.0),
}
for name in lists:
    lists[name][int(rng.integers(0, N))] = [0, 10, 1000, -1, 999, 9, 11]  # at the list boundaries
tags = string_lists(0.07, 0.05)

# Coverage the checks rely on: the values at stake are there, and not null.
for name, specials in [("f32", f32_specials), ("f64", f64_specials), ("u64", [2**63, U64_MAX])]:
    values, nulls = numeric[name]
    for v in specials:
        hit = np.isnan(values[~nulls]) if isinstance(v, float) and math.isnan(v) else values[~nulls] == v
        assert hit.any(), f"{name} lacks {v}"

# ---------------------------------------------------------------------------------------------
# The files: rows in a shuffled order (so `id` is not the position), two files of different codecs
# and row group sizes.

arrays = {"id": pa.array(np.arange(N, dtype=np.int64))}
for name, (values, nulls) in numeric.items():
    arrays[name] = pa.array(values, mask=nulls)
arrays["s"] = pa.array(strings["s"], type=pa.string())
arrays["sd"] = pa.array(strings["sd"], type=pa.string()).dictionary_encode()
arrays["sl"] = pa.array(strings["sl"], type=pa.large_string())
arrays["b"] = pa.array(binary, type=pa.binary())
arrays["lst"] = pa.array(lists["lst"], type=pa.list_(pa.int64()))
arrays["lstn"] = pa.array(lists["lstn"], type=pa.list_(pa.int64()))
arrays["big"] = pa.array(lists["big"], type=pa.large_list(pa.int64()))
arrays["bigf"] = pa.array(lists["bigf"], type=pa.large_list(pa.int64()))
arrays["tags"] = pa.array(tags, type=pa.list_(pa.string()))
table = pa.table(arrays)
assert pa.types.is_dictionary(table.schema.field("sd").type)

out = Path(sys.argv[1])
(out / "data").mkdir(parents=True, exist_ok=True)
order = rng.permutation(N)
shuffled = table.take(pa.array(order))
cut = 2500
pq.write_table(shuffled.slice(0, cut), out / "data" / "part-0.parquet", row_group_size=600, compression="snappy")
pq.write_table(
    shuffled.slice(cut),
    out / "data" / "part-1.parquet",
    row_group_size=1000,
    compression="zstd",
    data_page_version="2.0",
)
for part, groups in [("part-0", 5), ("part-1", 2)]:
    assert pq.ParquetFile(out / "data" / f"{part}.parquet").metadata.num_row_groups == groups

# ---------------------------------------------------------------------------------------------
# The vocabulary files: duplicates (the first counts), a CRLF line, an empty line, entries no row
# has, and in the integers' file lines that are no integer.

STRING_LINES = [*TOKENS[:20], "", TOKENS[3], "not-in-the-data", "café", "東京", TOKENS[25], "trailing", TOKENS[40]]
CRLF_AT = 23  # "café\r": a value the rows have
string_file = "".join(line + ("\r\n" if i == CRLF_AT else "\n") for i, line in enumerate(STRING_LINES))
(out / "vocab_strings.txt").write_bytes(string_file.encode())

INT_LINES = ["0", "1", "-1", "2", "-10", "100", "7", "2", "abc", "42", "-2", "3000000000", "15"]
INT_LINES += [str(I64_MAX), str(I64_MIN), str(U64_MAX), "", "3", "9"]
int_file = "".join(line + ("\r\n" if line == "7" else "\n") for line in INT_LINES)
(out / "vocab_ints.txt").write_bytes(int_file.encode())


def vocabulary(data: bytes) -> tuple:
    """(bytes -> id, int -> id, entries) as docs/transforms.md reads a vocabulary file."""
    if data.endswith(b"\n"):
        data = data[:-1]
    lines = [line[:-1] if line.endswith(b"\r") else line for line in data.split(b"\n")] if data else []
    by_bytes: dict = {}
    by_int: dict = {}
    for i, line in enumerate(lines):
        by_bytes.setdefault(line, i)
        try:
            by_int.setdefault(int(line.decode()), i)
        except ValueError:
            pass
    return by_bytes, by_int, len(lines)


string_ids, _, _ = vocabulary(string_file.encode())
_, int_ids, int_entries = vocabulary(int_file.encode())

# ---------------------------------------------------------------------------------------------
# The reference outputs.

expected: dict = {}
inputs: dict = {}


def f32_bits(values: np.ndarray) -> list:
    return values.astype(np.float32).view(np.uint32).tolist()


def f64_bits(values: np.ndarray) -> list:
    return values.astype(np.float64).view(np.uint64).tolist()


def put(key: str, kind: str, column: str, values: list) -> None:
    assert len(values) == N, key
    expected[key] = {"kind": kind, "input": column, "values": values}


def as_f64(name: str) -> np.ndarray:
    """A numeric column's values as f64 (an unsigned 64-bit value as the number it is)."""
    return numeric[name][0].astype(np.float64)


def fill(values: np.ndarray, nulls: np.ndarray, value) -> np.ndarray:
    return np.where(nulls, np.array(value, dtype=values.dtype), values)


def signed(v: int) -> int:
    """An integer as an int64: an unsigned 64-bit value above 2^63 wraps."""
    return v - 2**64 if v > I64_MAX else v


def xxh64(data: bytes) -> int:
    return xxhash.xxh64_intdigest(data, seed=0)


def hash_of(v) -> int:
    """The xxh64 hashBucket and cross take of a value: bytes as they are, integers (and booleans)
    as 8 bytes of a little-endian int64."""
    if isinstance(v, str):
        return xxh64(v.encode())
    if isinstance(v, bytes):
        return xxh64(v)
    return xxh64(signed(int(v)).to_bytes(8, "little", signed=True))


def scalar(name: str, i: int):
    """Row i's value of any scalar column as a Python value, None for a null."""
    if name in numeric:
        values, nulls = numeric[name]
        return None if nulls[i] else values[i].item()
    if name in strings:
        return strings[name][i]
    assert name == "b"
    return binary[i]


with np.errstate(over="ignore", invalid="ignore"):
    # fillNull: numbers get the value cast to the column's type (toward zero, saturating at the
    # type's bounds: -1.5 is -1 for signed integers, 0 for unsigned ones), strings and binary
    # the text, a null list an empty list (its null items the value or text).
    for name, (values, nulls) in numeric.items():
        if values.dtype.kind == "f":
            kind = "f32" if values.dtype == np.float32 else "f64"
            filled = fill(values, nulls, FILL_VALUE)
            put(f"fill.{name}", kind, name, f32_bits(filled) if kind == "f32" else f64_bits(filled))
        else:
            # In the batch as int64: the uint64 above 2^63 wrap.
            if values.dtype.kind == "b":
                value = int(bool(FILL_VALUE))  # a boolean column: any value but 0 is true
            else:
                info = np.iinfo(values.dtype)
                value = min(max(int(FILL_VALUE), info.min), info.max)
            ints = values.astype(np.int64)
            put(f"fill.{name}", "i64", name, np.where(nulls, value, ints).tolist())
    for name, column in strings.items():
        put(f"fill.{name}", "bytes", name, [(FILL_TEXT if v is None else v).encode().hex() for v in column])
    put("fill.b", "bytes", "b", [(FILL_TEXT.encode() if v is None else v).hex() for v in binary])
    for name in ["lst", "lstn"]:
        filled_lists = [[int(FILL_VALUE) if x is None else x for x in (v or [])] for v in lists[name]]
        put(f"fill.{name}", "list_i64", name, filled_lists)
    filled_tags = [[(FILL_TEXT if x is None else x).encode().hex() for x in (v or [])] for v in tags]
    put("fill.tags", "list_bytes", "tags", filled_tags)
    put("fill.big", "list_i64", "big", [v or [] for v in lists["big"]])

    # log1p: ln(1 + max(x, 0)) in f64, stored as float32; NaN stays NaN (numpy's maximum).
    for name in ["i8", "i16", "i32", "i64", "u32", "u64", "f32", "f64", "flag"]:
        out_ = np.log1p(np.maximum(as_f64(name), 0.0)).astype(np.float32)
        put(f"log1p.{name}", "f32", name, f32_bits(fill(out_, numeric[name][1], AFTER)))

    # standardize: (x - mean) / std in f64, stored as float32.
    for name in ["i16", "i32", "i64", "u32", "f32", "f64"]:
        out_ = ((as_f64(name) - MEAN) / STD).astype(np.float32)
        put(f"standardize.{name}", "f32", name, f32_bits(fill(out_, numeric[name][1], AFTER)))
    out_ = ((as_f64("u64") - U64_MEAN) / U64_STD).astype(np.float32)
    put("standardize.u64", "f32", "u64", f32_bits(fill(out_, numeric["u64"][1], AFTER)))

    # clip: floats keep their type (the bounds in that type), integers become int64 and take the
    # bounds rounded inwards.
    def clip(name: str, lo, hi) -> None:
        values, nulls = numeric[name]
        if values.dtype.kind == "f":
            t = values.dtype.type
            low = t(-np.inf if lo is None else lo)
            high = t(np.inf if hi is None else hi)
            out_ = np.minimum(np.maximum(values, low), high)  # NaN stays NaN
            kind = "f32" if values.dtype == np.float32 else "f64"
            out_ = fill(out_, nulls, AFTER)
            put(f"clip.{name}", kind, name, f32_bits(out_) if kind == "f32" else f64_bits(out_))
        else:
            low = I64_MIN if lo is None else math.ceil(lo)
            high = I64_MAX if hi is None else math.floor(hi)
            clipped = [AFTER if nulls[i] else min(max(int(values[i]), low), high) for i in range(N)]
            put(f"clip.{name}", "i64", name, clipped)

    for name in ["i32", "f32"]:
        clip(name, -5.5, None)
    for name in ["i8", "i64", "f64"]:
        clip(name, -100.25, 1000.75)
    clip("u32", None, 3000000000.5)
    clip("u64", 10, 1000)

    # bucketize: numpy.digitize(x, boundaries); NaN is past the last. Lists item by item.
    for name in ["i8", "i32", "i64", "u32", "f32", "f64"]:
        out_ = np.digitize(numeric[name][0], BOUNDARIES).astype(np.int64)
        put(f"bucketize.{name}", "i64", name, fill(out_, numeric[name][1], AFTER).tolist())
    out_ = np.digitize(numeric["u64"][0], U64_BOUNDARIES).astype(np.int64)
    put("bucketize.u64", "i64", "u64", fill(out_, numeric["u64"][1], AFTER).tolist())
    bucketed = [np.digitize(np.array(v, dtype=np.int64), LIST_BOUNDARIES).tolist() if v else [] for v in lists["lst"]]
    put("bucketize.lst", "list_i64", "lst", bucketed)

    # hashBucket: xxh64(value) % buckets; nulls (filled after) pass through, lists item by item.
    for names, buckets in [
        (["s", "sd", "sl", "b", "flag"], STRING_BUCKETS),
        (["i8", "i16", "i32", "i64", "u32", "u64"], INT_BUCKETS),
    ]:
        for name in names:
            hashed = [AFTER if (v := scalar(name, i)) is None else hash_of(v) % buckets for i in range(N)]
            put(f"hash.{name}", "i64", name, hashed)
    put("hash.lst", "list_i64", "lst", [[hash_of(x) % INT_BUCKETS for x in v or []] for v in lists["lst"]])
    hashed_lists = [[AFTER if x is None else hash_of(x) % LIST_BUCKETS for x in v or []] for v in lists["lstn"]]
    put("hash.lstn", "list_i64", "lstn", hashed_lists)
    put(
        "hash.tags",
        "list_i64",
        "tags",
        [[AFTER if x is None else hash_of(x) % STRING_BUCKETS for x in v or []] for v in tags],
    )
    put("hash.bigf", "list_i64", "bigf", [[hash_of(x) % INT_BUCKETS for x in v] for v in lists["bigf"]])

    # vocabulary: the line's index (the first of duplicates), else oovId (unset: the entries).
    for name in ["s", "sd", "sl", "b"]:
        ids = []
        for i in range(N):
            v = scalar(name, i)
            key = v.encode() if isinstance(v, str) else v
            ids.append(AFTER if v is None else string_ids.get(key, STRINGS_OOV))
        put(f"vocabulary.{name}", "i64", name, ids)
    vocab_tags = [[AFTER if x is None else string_ids.get(x.encode(), STRINGS_OOV) for x in v or []] for v in tags]
    put("vocabulary.tags", "list_i64", "tags", vocab_tags)
    for name in ["i8", "i32", "i64", "u32", "u64"]:
        ids = [AFTER if (v := scalar(name, i)) is None else int_ids.get(int(v), int_entries) for i in range(N)]
        put(f"vocabulary.{name}", "i64", name, ids)
    put("vocabulary.lst", "list_i64", "lst", [[int_ids.get(x, int_entries) for x in v or []] for v in lists["lst"]])

    # truncate: the first (or last) `length` items; nulls then filled (lists empty, items AFTER).
    def cut(v, length: int, keep: str) -> list:
        v = v or []
        return v[:length] if keep == "first" else v[max(len(v) - length, 0) :]

    put("truncate.lst", "list_i64", "lst", [cut(v, 3, "first") for v in lists["lst"]])
    put(
        "truncate.lstn",
        "list_i64",
        "lstn",
        [[AFTER if x is None else x for x in cut(v, 4, "last")] for v in lists["lstn"]],
    )
    truncated_tags = [[(FILL_TEXT if x is None else x).encode().hex() for x in cut(v, 2, "first")] for v in tags]
    put("truncate.tags", "list_bytes", "tags", truncated_tags)
    put("truncate.bigf", "list_i64", "bigf", [cut(v, 2, "last") for v in lists["bigf"]])

    # cross: xxh64 of the fields' xxh64s as 8 little-endian bytes each, % buckets; null (filled
    # after) when any field is.
    def cross(key: str, names: list, buckets: int) -> None:
        crossed = []
        for i in range(N):
            values = [scalar(name, i) for name in names]
            if any(v is None for v in values):
                crossed.append(AFTER)
            else:
                joined = b"".join(hash_of(v).to_bytes(8, "little") for v in values)
                crossed.append(xxh64(joined) % buckets)
        put(key, "i64", ",".join(names), crossed)

    cross("cross.s_x_i32", ["s", "i32"], 1000)
    cross("cross.x4", ["sd", "u64", "b", "flag"], 2**31)
    cross("cross.i64_x_sl", ["i64", "sl"], 1000003)

    # concat (after fillNull 0 and log1p of f64): each field's value as float32, in the order named.
    dense_columns = [np.log1p(np.maximum(fill(as_f64("f64"), numeric["f64"][1], 0.0), 0.0))]
    dense_columns += [fill(as_f64(name), numeric[name][1], 0.0) for name in ["i16", "u32", "f32", "i8"]]
    dense = np.stack(dense_columns, axis=1).astype(np.float32)
    put("concat.dense", "vec_f32", "f64,i16,u32,f32,i8", dense.view(np.uint32).tolist())
    u64_dense = fill(as_f64("u64"), numeric["u64"][1], 0.0).astype(np.float32).reshape(N, 1)
    put("concat.u64", "vec_f32", "u64", u64_dense.view(np.uint32).tolist())

# The inputs as text, for the test's messages.
for name, (values, nulls) in numeric.items():
    inputs[name] = ["null" if nulls[i] else str(values[i]) for i in range(N)]
for name, column in [*strings.items(), ("b", binary), *lists.items(), ("tags", tags)]:
    inputs[name] = ["null" if v is None else repr(v) for v in column]

reference = {"rows": N, "file_order": order.tolist(), "inputs": inputs, "expected": expected}
(out / "expected.json").write_text(json.dumps(reference))
