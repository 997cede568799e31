#!/usr/bin/env python3
"""A Criteo-style Parquet table for the DLRM benchmarks (docs/performance.md): a `label`, 13
integer counts i1-i13 and 26 categorical features c1-c26 (8-digit hex strings, as the Criteo
Kaggle and Terabyte files hold them), each column with the null rate and the cardinality of
its Criteo Kaggle counterpart (the counts long-tailed, i2 with Criteo's negative values),
and `--unused` columns the model does not read (u0, u1, ...: a production table holds many
more features than one model uses), written by pyarrow with its defaults (snappy,
dictionary pages) in row groups of 131,072 rows.

    python3 worker/bench/peers/criteo_generate.py --out /tmp/criteo --rows 2000000 --files 8
"""

import argparse
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

# Criteo Kaggle's share of nulls per column, and (categoricals) its number of distinct values.
DENSE_NULLS = [0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22]
CAT_NULLS = [
    0.0,
    0.0,
    0.034,
    0.034,
    0.0,
    0.12,
    0.0,
    0.0,
    0.0,
    0.0,
    0.0,
    0.034,
    0.0,
    0.0,
    0.0,
    0.034,
    0.0,
    0.0,
    0.44,
    0.44,
    0.034,
    0.76,
    0.0,
    0.034,
    0.44,
    0.44,
]
CAT_DISTINCT = [
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
]
HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def with_nulls(array, rate, rng):
    if rate == 0:
        return array
    return pc.if_else(pa.array(rng.random(len(array)) < rate), pa.nulls(len(array), array.type), array)


def hex_strings(values):
    """8-digit lowercase hex of uint32 values, built as one buffer (no Python per row)."""
    shifts = np.arange(28, -4, -4, dtype=np.uint32)
    digits = HEX[(values[:, None] >> shifts) & 0xF].astype(np.uint8).reshape(-1)
    offsets = np.arange(0, 8 * len(values) + 1, 8, dtype=np.int32)
    return pa.StringArray.from_buffers(len(values), pa.py_buffer(offsets), pa.py_buffer(digits))


def table(rows, unused, rng):
    columns = {"label": pa.array((rng.random(rows) < 0.256).astype(np.int32))}
    for i, rate in enumerate(DENSE_NULLS, start=1):
        counts = np.floor(rng.lognormal(mean=1.5, sigma=1.8, size=rows)).astype(np.int32)
        if i == 2:
            counts -= 2 * (rng.random(rows) < 0.1)
        columns[f"i{i}"] = with_nulls(pa.array(counts), rate, rng)
    for c, (rate, distinct) in enumerate(zip(CAT_NULLS, CAT_DISTINCT), start=1):
        # Zipf-like ids over the column's distinct values, each id a fixed random 32-bit code.
        ids = np.minimum(np.floor(distinct ** rng.random(rows)), distinct - 1).astype(np.uint64)
        codes = ((ids * np.uint64(2654435761) + np.uint64(c * 97)) % np.uint64(2**32)).astype(np.uint32)
        columns[f"c{c}"] = with_nulls(hex_strings(codes), rate, rng)
    # Features this model does not use, as a production table holds (half counts, half ids).
    for u in range(unused):
        values = rng.integers(0, 2**31, size=rows, dtype=np.int64)
        columns[f"u{u}"] = pa.array(values) if u % 2 else hex_strings(values.astype(np.uint32))
    return pa.table(columns)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--unused", type=int, default=40, help="extra columns the model does not read")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    per_file = args.rows // args.files
    for f in range(args.files):
        rows = per_file if f < args.files - 1 else args.rows - per_file * (args.files - 1)
        pq.write_table(table(rows, args.unused, rng), out / f"part-{f:05d}.parquet", row_group_size=131_072)
    print(f"{args.rows} rows in {args.files} files under {out}")


if __name__ == "__main__":
    main()
