#!/usr/bin/env python3
"""A hyperparameter sweep on one pipeline: trials that share its preprocessing.

    python examples/sweep.py --dispatcher 127.0.0.1:50051 --namespace ml --pipeline imagenet-sweep \\
        --trials 4 --step-ms 0,0,10,25 --epochs 2

Each trial is its own job (`trial-<i>`), a `StokerIterableDataset` in a PyTorch DataLoader,
reading `--epochs` epochs with a training step of its own length (`--step-ms`, one per trial:
the slower trials are the larger models). All name the share group `--share`: each split is
made once for every trial that waits for it, and each trial still gets every image of each of
its epochs once, at its own pace (docs/reuse.md). Trials run as threads here; in a real sweep
each is its own process or pod, naming the same group. Prints each trial's epochs and time.
Needs `pip install './client/python[torch]'`.
"""

import argparse
import threading
import time

from torch.utils.data import DataLoader

from stoker_client.torch import StokerIterableDataset


def trial(args, index, step_seconds, results):
    # `epochs`: the trial's last epoch is its last, so no worker makes one more for it.
    dataset = StokerIterableDataset(
        args.dispatcher, args.namespace, args.pipeline, job=f"trial-{index}", share=args.share, epochs=args.epochs
    )
    start, epochs = time.perf_counter(), []
    for _ in range(args.epochs):
        images = 0
        # batch_size=None: Stoker's workers batch already.
        for batch in DataLoader(dataset, batch_size=None):
            images += next(iter(batch.values())).shape[0]
            time.sleep(step_seconds)
        epochs.append(images)
    dataset.close()
    results[index] = (epochs, time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dispatcher", required=True, help="the dispatcher's address, host:port")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--pipeline", required=True)
    ap.add_argument("--share", default="sweep", help="the share group the trials name")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--step-ms", default="0", help="each trial's step time, comma-separated (the last repeats)")
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    steps = [float(ms) / 1e3 for ms in args.step_ms.split(",")]
    steps += [steps[-1]] * (args.trials - len(steps))
    results = {}
    threads = [threading.Thread(target=trial, args=(args, i, steps[i], results)) for i in range(args.trials)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for index in range(args.trials):
        if index not in results:
            raise SystemExit(f"trial-{index} failed")
        epochs, seconds = results[index]
        per_epoch = ", ".join(str(images) for images in epochs)
        print(f"trial-{index}: epochs of {per_epoch} images in {seconds:.2f} s", flush=True)


if __name__ == "__main__":
    main()
