#!/usr/bin/env python3
"""Ray Data peer of `stoker-worker bench dlrm`: `ray.data.read_parquet` of the model's columns,
`map_batches` of the same numpy preprocessing (dlrm_common.py) on pyarrow batches of 2048, read
by `iter_batches` on a Ray of `--cpus` CPUs. Prints rows/s per epoch and the best.

    python3 worker/bench/peers/dlrm_ray.py --data /tmp/criteo --cpus 2
"""

import argparse
import time

import dlrm_common
import ray


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="ERROR")
    best = None
    for run in range(1, args.repeat + 1):
        start = time.perf_counter()
        ds = ray.data.read_parquet(args.data, columns=dlrm_common.COLUMNS).map_batches(
            dlrm_common.preprocess, batch_format="pyarrow", batch_size=dlrm_common.BATCH
        )
        rows = sum(len(b["label"]) for b in ds.iter_batches(batch_size=dlrm_common.BATCH, batch_format="numpy"))
        secs = time.perf_counter() - start
        print(f"run {run}: {rows} rows in {secs:.2f} s: {rows / secs:.0f} rows/s", flush=True)
        best = secs if best is None else min(best, secs)
    print(f"best: {rows / best:.0f} rows/s, {rows / best / args.cpus:.0f} rows/s per core")


if __name__ == "__main__":
    main()
