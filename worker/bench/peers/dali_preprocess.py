#!/usr/bin/env python3
"""NVIDIA DALI peer of `stoker-worker bench preprocess`: its CPU pipeline for ResNet-50
training (the recipe of DALI's ResNet-50 example, on the CPU: `decoders.image_random_crop`,
which decodes only the random crop's region, `resize` to 224 with antialiasing,
`crop_mirror_normalize` with a random mirror, float32 HWC) over the same image folder,
`num_threads` = cores, batches of 64, no GPU (`device_id=None`). Prints images/s and images/s
per core.

    pip install nvidia-dali-cuda120      # from PyPI; runs CPU-only without a GPU or CUDA
    python3 worker/bench/peers/dali_preprocess.py --corpus /tmp/stoker-bench-corpus [--threads 2]
"""

import argparse
import math
import os

import epochs


class Count:
    """What `epochs.best_of` reads of a batch: how many images it has. DALI keeps the batch
    in its own buffers; nothing is copied out to count it."""

    def __init__(self, n):
        self.shape = (n,)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()

    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=args.batch, num_threads=args.threads, device_id=None)
    def resnet50_training():
        jpegs, labels = fn.readers.file(file_root=args.corpus, name="reader")
        images = fn.decoders.image_random_crop(
            jpegs,
            device="cpu",
            output_type=types.RGB,
            random_area=[0.08, 1.0],
            random_aspect_ratio=[3 / 4, 4 / 3],
            num_attempts=10,
        )
        images = fn.resize(images, resize_x=224, resize_y=224, antialias=True)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="HWC",
            mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
            std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
            mirror=fn.random.coin_flip(),
        )
        return images, labels

    pipeline = resnet50_training()
    pipeline.build()
    size = pipeline.epoch_size("reader")

    def epoch():
        # The reader runs on across epochs; an epoch is its size in images, the last batch
        # counted for the images of this epoch it holds.
        for i in range(math.ceil(size / args.batch)):
            _, labels = pipeline.run()
            yield Count(min(len(labels), size - i * args.batch)), None

    epochs.best_of(args.repeat, epoch, args.threads)


if __name__ == "__main__":
    main()
