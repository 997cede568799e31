"""What the tf.data peers share: TensorFlow limited to the benchmark's threads, and the image
folder listed as Stoker lists it (class folders in name order, files in name order)."""

import os


def tensorflow(threads):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    return tf


def image_folder(corpus):
    classes = sorted(d for d in os.listdir(corpus) if os.path.isdir(os.path.join(corpus, d)))
    paths, labels = [], []
    for label, c in enumerate(classes):
        for f in sorted(os.listdir(os.path.join(corpus, c))):
            if f.lower().endswith((".jpg", ".jpeg", ".png")):
                paths.append(os.path.join(corpus, c, f))
                labels.append(label)
    return paths, labels
