#!/usr/bin/env python3
"""Trains nothing: iterates epochs of a pipeline from Stoker workers and prints images/s.

    python examples/iterate_epochs.py --namespace team-a --pipeline imagenet 10.0.0.7:50052 10.0.0.8:50052
    python examples/iterate_epochs.py --namespace team-a --pipeline imagenet --dispatcher 127.0.0.1:50051 --epochs 3

Needs `pip install ./client/python`. Counts the first tensor's leading dimension as images.
"""

import argparse
import time

from stoker_client import Client


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workers", nargs="*", help="standalone worker addresses, host:port")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--pipeline", required=True)
    ap.add_argument("--dispatcher", help="the dispatcher's address, host:port (instead of workers)")
    ap.add_argument("--epochs", type=int, default=2, help="with --dispatcher: how many epochs to read")
    args = ap.parse_args()
    if bool(args.workers) == bool(args.dispatcher):
        ap.error("give either worker addresses or --dispatcher")
    if args.dispatcher:
        return through_the_dispatcher(args)

    # Workers may interleave epochs (standalone ones each serve every epoch), so an epoch's
    # rate is its images over the time from the run's start to its last batch.
    epochs = {}  # epoch -> [images, last batch time]
    start = time.perf_counter()
    with Client(args.workers, args.namespace, args.pipeline) as client:
        for batch in client:
            seen = epochs.setdefault(batch.epoch, [0, 0.0])
            seen[0] += next(iter(batch.tensors.values())).shape[0]
            seen[1] = time.perf_counter() - start
        previous = 0.0
        for epoch, (images, done) in sorted(epochs.items()):
            seconds = max(done - previous, 1e-9) if done > previous else done
            print(f"epoch {epoch}: {images} images in {seconds:.2f} s: {images / seconds:.0f} images/s", flush=True)
            previous = max(previous, done)
        total = sum(images for images, _ in epochs.values())
        elapsed = time.perf_counter() - start
        print(f"all: {total} images in {elapsed:.2f} s: {total / elapsed:.0f} images/s")
        w = client.window()
        print(
            f"batches {w.batches}, median batch time {w.median * 1e3:.1f} ms, p90 {w.p90 * 1e3:.1f} ms, "
            f"waiting for data {w.wait_fraction:.0%}"
        )


def through_the_dispatcher(args):
    # Under the dispatcher each epoch ends on its own: iter_epoch() reads one.
    with Client.from_dispatcher(args.dispatcher, args.namespace, args.pipeline) as client:
        for _ in range(args.epochs):
            epoch, images, start = client.epoch, 0, time.perf_counter()
            for batch in client.iter_epoch():
                images += next(iter(batch.tensors.values())).shape[0]
            seconds = max(time.perf_counter() - start, 1e-9)
            print(f"epoch {epoch}: {images} images in {seconds:.2f} s: {images / seconds:.0f} images/s", flush=True)


if __name__ == "__main__":
    main()
