"""What the tf.data peers share: TensorFlow limited to the benchmark's threads, the image
folder listed as Stoker lists it (class folders in name order, files in name order), the
official ResNet crop window, and a tf.data service (a dispatcher and two workers, each a
process of its own)."""

import os
import socket


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


def crop_window(tf, shape):
    """The official ResNet (Inception) random crop of an image of `shape`: 8-100% of its area,
    aspect ratio 3/4-4/3, as `sample_distorted_bounding_box` draws it; (begin, size)."""
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        shape,
        bounding_boxes=tf.zeros([1, 0, 4]),
        min_object_covered=0.0,
        aspect_ratio_range=(3 / 4, 4 / 3),
        area_range=(0.08, 1.0),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    return begin, size


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dispatcher(port, ready):
    """A tf.data service dispatcher on `port` (run in a process of its own)."""
    tf = tensorflow(1)
    service = tf.data.experimental.service
    server = service.DispatchServer(service.DispatcherConfig(port=port))
    ready.set()
    server.join()


def start_service(context, worker, *worker_args):
    """A dispatcher and two workers, each a process of `context` (`worker(dispatcher_port,
    *worker_args, ready)`), once each is serving; (the dispatcher's port, [dispatcher, workers])."""
    port = free_port()
    servers = []
    for target, args in [(dispatcher, (port,)), (worker, (port, *worker_args)), (worker, (port, *worker_args))]:
        ready = context.Event()
        servers.append(context.Process(target=target, args=(*args, ready), daemon=True))
        servers[-1].start()
        ready.wait(60)
    return port, servers
