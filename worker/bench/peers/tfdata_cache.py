#!/usr/bin/env python3
"""tf.data peer of `stoker-worker bench cache`: decode, resize to a shorter side of 256, then
`Dataset.cache(FILE)` there, then the random part of the ResNet-50 recipe (random-resized-crop
224, horizontal flip, normalize to float32), batched by 64. One epoch without the cache, one
writing it, then epochs reading it, each after dropping the cache files from the page cache.

    python3 worker/bench/peers/tfdata_cache.py --corpus /tmp/bench-corpus [--volume DIR]
"""

import argparse
import glob
import os
import shutil
import time

import tfdata_common


def drop_page_cache(prefix):
    for path in glob.glob(prefix + "*"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--volume", default="/tmp/stoker-bench-cache-tfdata")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--gets", type=int, default=2)
    args = ap.parse_args()

    tf = tfdata_common.tensorflow(args.threads)
    paths, labels = tfdata_common.image_folder(args.corpus)

    mean = tf.constant([0.485, 0.456, 0.406]) * 255.0
    std = tf.constant([0.229, 0.224, 0.225]) * 255.0

    def prefix(path, label):
        image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
        shape = tf.cast(tf.shape(image)[:2], tf.float32)
        size = tf.cast(tf.round(shape * 256.0 / tf.reduce_min(shape)), tf.int32)
        image = tf.cast(tf.round(tf.image.resize(image, size, method="bilinear")), tf.uint8)
        return image, label

    def augment(image, label):
        begin, size = tfdata_common.crop_window(tf, tf.shape(image))
        image = tf.image.resize(tf.slice(image, begin, size), [224, 224], method="bilinear")
        image = tf.image.random_flip_left_right(image)
        return (image - mean) / std, label

    shutil.rmtree(args.volume, ignore_errors=True)
    os.makedirs(args.volume)
    cache_file = os.path.join(args.volume, "resnet-prefix")
    source = tf.data.Dataset.from_tensor_slices((paths, labels)).map(prefix, num_parallel_calls=tf.data.AUTOTUNE)

    def finish(ds):
        return ds.map(augment, num_parallel_calls=tf.data.AUTOTUNE).batch(64).prefetch(tf.data.AUTOTUNE)

    def epoch(what, ds):
        start = time.perf_counter()
        n = 0
        for images, _ in ds:
            n += int(images.shape[0])
        secs = time.perf_counter() - start
        print(f"{what}: {n} images in {secs:.2f} s: {n / secs:.0f} images/s ({args.threads} threads)", flush=True)
        return secs

    compute = epoch("compute (no cache)", finish(source))
    cached = finish(source.cache(cache_file))
    epoch("put (computing, writing the cache)", cached)
    size = sum(os.path.getsize(p) for p in glob.glob(cache_file + "*"))
    print(f"entry: {size / 1e6:.0f} MB, {size / 1e3 / len(paths):.0f} KB per image")
    gets = []
    for i in range(args.gets):
        drop_page_cache(cache_file)
        gets.append(epoch(f"get {i + 1} (reading the cache, page cache dropped)", cached))
    print(f"best get: {compute / min(gets):.2f}x the compute epoch's speed")


if __name__ == "__main__":
    main()
