#!/usr/bin/env python3
"""tf.data service peer of `worker/bench/python_read.py` (`worker/bench/stream-clients.sh`): one
Python consumer reading ready
batches from two tf.data service workers on loopback, counting the tensors' bytes for
`--seconds` after a warm-up, as numpy arrays (what Stoker's Python client hands over).

    python3 worker/bench/peers/tfdata_service_stream.py [--seconds 5] [--compression none|auto]

The dispatcher and the two workers run in separate processes, as Stoker's workers do. Each
batch is 14 float16 224x224x3 images of random values plus 14 int64 labels (4.02 MiB, Stoker's
synthetic batch), made once and repeated, so the workers do no preprocessing.
`--compression auto` is tf.data service's default (snappy); `none` is its fastest setting.
"""

import argparse
import multiprocessing
import os
import time

import tfdata_common


def tensorflow():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    return tf


def worker(dispatcher_port, ready):
    tf = tensorflow()
    server = tf.data.experimental.service.WorkerServer(
        tf.data.experimental.service.WorkerConfig(dispatcher_address=f"localhost:{dispatcher_port}")
    )
    ready.set()
    server.join()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--images", type=int, default=14)
    ap.add_argument("--compression", choices=["none", "auto"], default="none")
    args = ap.parse_args()

    context = multiprocessing.get_context("spawn")
    port, servers = tfdata_common.start_service(context, worker)
    try:
        tf = tensorflow()
        import numpy as np

        rng = np.random.default_rng(7)
        images = rng.standard_normal((args.images, 224, 224, 3), dtype=np.float32).astype(np.float16)
        labels = rng.integers(0, 1000, args.images, dtype=np.int64)
        dataset = tf.data.Dataset.from_tensors((images, labels)).repeat()
        dataset = dataset.apply(
            tf.data.experimental.service.distribute(
                processing_mode="parallel_epochs",
                service=f"grpc://localhost:{port}",
                compression=None if args.compression == "none" else "AUTO",
            )
        )
        batches = iter(dataset)
        for _ in range(50):
            next(batches)
        nbytes = count = 0
        start = time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            x, y = next(batches)
            nbytes += x.numpy().nbytes + y.numpy().nbytes
            count += 1
        secs = time.perf_counter() - start
        print(
            f"tf.data service, compression {args.compression}: {nbytes / secs / 1e9:.2f} GB/s of tensor payload, "
            f"{count / secs:.0f} batches/s"
        )
    finally:
        for p in servers:
            p.terminate()


if __name__ == "__main__":
    main()
