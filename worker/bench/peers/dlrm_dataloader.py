#!/usr/bin/env python3
"""PyTorch DataLoader peer of `stoker-worker bench dlrm`: `--workers` processes, each reading
its share of the table's row groups with pyarrow (only the model's columns, a row group at a
time: pyarrow reads 2048-row batches at half the speed) and preprocessing each row group with
numpy at once (dlrm_common.py), then handing it on in batches of 2048 as torch tensors. Prints
rows/s per epoch and the best.

    python3 worker/bench/peers/dlrm_dataloader.py --data /tmp/criteo --workers 2
"""

import argparse
import pathlib
import time

import dlrm_common
import pyarrow.parquet as pq
import torch


class RowGroups(torch.utils.data.IterableDataset):
    def __init__(self, files):
        self.groups = [(f, g) for f in files for g in range(pq.ParquetFile(f).num_row_groups)]

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        share = self.groups if info is None else self.groups[info.id :: info.num_workers]
        for file, group in share:
            table = pq.ParquetFile(file).read_row_group(group, columns=dlrm_common.COLUMNS)
            arrays = {k: torch.from_numpy(v) for k, v in dlrm_common.preprocess(table).items()}
            for start in range(0, table.num_rows, dlrm_common.BATCH):
                yield {k: v[start : start + dlrm_common.BATCH] for k, v in arrays.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    files = sorted(str(p) for p in pathlib.Path(args.data).glob("*.parquet"))
    loader = torch.utils.data.DataLoader(
        RowGroups(files), batch_size=None, num_workers=args.workers, persistent_workers=args.workers > 0
    )
    best = None
    for run in range(1, args.repeat + 1):
        start = time.perf_counter()
        rows = sum(int(b["label"].shape[0]) for b in loader)
        secs = time.perf_counter() - start
        print(f"run {run}: {rows} rows in {secs:.2f} s: {rows / secs:.0f} rows/s", flush=True)
        best = secs if best is None else min(best, secs)
    print(f"best: {rows / best:.0f} rows/s, {rows / best / max(args.workers, 1):.0f} rows/s per core")


if __name__ == "__main__":
    main()
