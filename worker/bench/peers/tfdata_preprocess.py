#!/usr/bin/env python3
"""tf.data peer of `stoker-worker bench preprocess`: ResNet-50 training transforms (decode,
random-resized-crop 224, horizontal flip, normalize to float32) over the same image folder,
with map(num_parallel_calls=AUTOTUNE), batched by 64. Prints images/s and images/s per core.

    python3 worker/bench/peers/tfdata_preprocess.py --corpus /tmp/bench-corpus [--threads 2]
"""

import argparse
import os

import epochs
import tfdata_common


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--decode-and-crop",
        action="store_true",
        help="use tf.image.decode_and_crop_jpeg (decodes only the crop window)",
    )
    args = ap.parse_args()

    tf = tfdata_common.tensorflow(args.threads)
    paths, labels = tfdata_common.image_folder(args.corpus)

    mean = tf.constant([0.485, 0.456, 0.406]) * 255.0
    std = tf.constant([0.229, 0.224, 0.225]) * 255.0

    def load(path, label):
        data = tf.io.read_file(path)
        shape = tf.image.extract_jpeg_shape(data)
        begin, size = tfdata_common.crop_window(tf, shape)
        if args.decode_and_crop:
            window = tf.stack([begin[0], begin[1], size[0], size[1]])
            image = tf.image.decode_and_crop_jpeg(data, window, channels=3)
        else:
            image = tf.slice(tf.io.decode_jpeg(data, channels=3), begin, size)
        image = tf.image.resize(image, [224, 224], method="bilinear")
        image = tf.image.random_flip_left_right(image)
        image = (image - mean) / std
        return image, label

    ds = (
        tf.data.Dataset.from_tensor_slices((paths, labels))
        .map(load, num_parallel_calls=tf.data.AUTOTUNE)
        .batch(64)
        .prefetch(tf.data.AUTOTUNE)
    )
    epochs.best_of(args.repeat, lambda: ds, args.threads)


if __name__ == "__main__":
    main()
