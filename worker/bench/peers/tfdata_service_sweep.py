#!/usr/bin/env python3
"""tf.data service peer of Stoker's sweep (`local/tests/shared_jobs.rs`,
`a_sweeps_trials_each_get_every_epoch_once_from_about_one_jobs_production`, with
`STOKER_SWEEP_DATA=images`), run by `worker/bench/sweep-vs-tfdata.sh`.

    python3 worker/bench/peers/tfdata_service_sweep.py --corpus DIR [--cache-mib 64]

One image pipeline (tf.io.read_file, extract_jpeg_shape, sample_distorted_bounding_box,
decode_and_crop_jpeg, resize to 64x64, random_flip_left_right, uint8, shuffle buffer 64, batches
of 8) served by a dispatcher and two worker servers, each a process of its own, in three
scenarios, each on fresh servers:

- alone: trial-a reads 3 "epochs" of 60 batches (480 images) as job `trial-a`;
- shared: four trainers in one job (`sweep`) with the cross-trainer cache
  (`ShardingPolicy.OFF`, an infinite dataset): trial-a (step 20 ms per batch), trial-c (0.7x),
  trial-d (0.4x, a process of its own killed with SIGKILL half-way through its second epoch) and
  trial-b (1x, starting when trial-a begins its second epoch);
- unshared: the same four, each its own job, without the cache.

It prints, per scenario, the worker processes' CPU-seconds over the scenario (utime+stime of
/proc/<pid>/stat, all threads, from just before the trainers start to 1.5 s after the last one
ends: TensorFlow's import in the workers is left out, where Stoker's figure counts its workers
from their start), a lower bound on the elements made (the highest sequence number the trainers
got, per worker stream), trial-a's wait (time inside next() over its time reading), the
wall time, and per trainer and epoch the distinct images it got, the ones it got more than once
(extra copies) and the ones it missed, and the batches the cross-trainer cache made it skip
(gaps in the per-worker sequence number each batch carries). Then one summary line in the
shape of Stoker's.

Every element carries its image's index, the worker's stream (a random id drawn once per worker
iteration) and its sequence number in that stream. Compression is off (`compression=None`) and
the transfer protocol is gRPC (the only one between processes). Each worker process runs the
dataset with one private thread, intra-op parallelism 1, no autotuning and no injected prefetch,
and TensorFlow's own pools at 1 thread; the worker server's gRPC threads and its per-task
prefetch thread cannot be limited from Python, so their CPU counts too. The cross-trainer cache
is capped at `--cache-mib` (Stoker's workers' memory budget in the sweep, 64 MiB) through the
WorkerConfig proto field that the Python WorkerConfig does not expose.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import tfdata_common

EPOCHS = 3
BATCH = 8
STEP_MS = 20.0
SHUFFLE = 64
# The trainers and their speeds (a step of STEP_MS / speed per batch).
PLAN = [("trial-a", 1.0), ("trial-b", 1.0), ("trial-c", 0.7), ("trial-d", 0.4)]


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads, living and gone)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def trainers_tensorflow() -> Any:
    """TensorFlow for the trainers in this process, its thread pools left as they are."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    return tf


def worker(dispatcher_port: int, cache_bytes: int, ready: Any) -> None:
    tf = tfdata_common.tensorflow(1)
    from tensorflow.core.protobuf import service_config_pb2

    service = tf.data.experimental.service
    defaults = service.WorkerConfig(dispatcher_address=f"localhost:{dispatcher_port}")
    config = service_config_pb2.WorkerConfig(
        dispatcher_address=defaults.dispatcher_address,
        worker_address=defaults.worker_address,
        protocol=defaults.protocol,
        data_transfer_address=defaults.data_transfer_address,
        # Stoker's workers heartbeat every second (tf.data's default is left to its runtime).
        heartbeat_interval_ms=1000,
        cross_trainer_cache_size_bytes=cache_bytes,
    )
    server = service.WorkerServer(config)
    ready.set()
    server.join()


def pipeline(tf: Any, paths: list[str], labels: list[int]) -> Any:
    """The infinite stream of batches one worker makes: ((images, labels, indices), seq, stream)."""

    def load(path: Any, label: Any, index: Any) -> tuple[Any, Any, Any]:
        data = tf.io.read_file(path)
        shape = tf.image.extract_jpeg_shape(data)
        begin, size = tfdata_common.crop_window(tf, shape)
        window = tf.stack([begin[0], begin[1], size[0], size[1]])
        image = tf.image.decode_and_crop_jpeg(data, window, channels=3)
        image = tf.image.resize(image, [64, 64], method="bilinear")
        image = tf.image.random_flip_left_right(image)
        return tf.cast(tf.round(image), tf.uint8), label, index

    indices = list(range(len(paths)))
    batches = (
        tf.data.Dataset.from_tensor_slices((paths, labels, indices))
        .shuffle(SHUFFLE, reshuffle_each_iteration=True)
        .map(load)
        .batch(BATCH, drop_remainder=True)
        .repeat()
    )
    # Seeds of 0 are drawn when the worker builds the dataset: one id per worker, fixed while
    # it repeats.
    stream = tf.data.Dataset.random().take(1).repeat()
    ds = tf.data.Dataset.zip((batches, tf.data.Dataset.counter(), stream))
    options = tf.data.Options()
    options.threading.private_threadpool_size = 1
    options.threading.max_intra_op_parallelism = 1
    options.autotune.enabled = False
    options.experimental_optimization.map_parallelization = False
    options.experimental_optimization.inject_prefetch = False
    return ds.with_options(options)


@dataclass
class Epoch:
    seen: Counter[int] = field(default_factory=Counter)
    batches: int = 0
    skipped: int = 0
    waited: float = 0.0
    took: float = 0.0

    def summary(self, images: int) -> str:
        distinct = len(self.seen)
        extra = sum(self.seen.values()) - distinct
        return f"{distinct} distinct, {extra} extra copies, {images - distinct} missed, {self.skipped} batches skipped"


@dataclass
class Trainer:
    job: str
    speed: float
    shared: bool
    port: int
    epochs: list[Epoch] = field(default_factory=list)
    # Per worker stream: the sequence number of the first batch it got, and of the last.
    starts: dict[int, int] = field(default_factory=dict)
    lasts: dict[int, int] = field(default_factory=dict)
    # Building the dataset and its iterator (registering it with the dispatcher), reading.
    setup: float = 0.0
    seconds: float = 0.0
    # When it read its last batch (time.time()).
    done: float = 0.0
    error: str | None = None


def read(
    tf: Any,
    trainer: Trainer,
    paths: list[str],
    labels: list[int],
    began: threading.Event | None = None,
    tell: Any = None,
) -> None:
    """Reads EPOCHS epochs of len(paths) // BATCH batches as `trainer`. Sets `began` when the
    second epoch begins; calls `tell("half", trainer, partial_epoch)` half-way through it and
    `tell("epoch", trainer, None)` at each epoch's end."""
    began_setup = time.perf_counter()
    service = tf.data.experimental.service
    cache = service.CrossTrainerCache(trainer.job) if trainer.shared else None
    ds = pipeline(tf, paths, labels).apply(
        service.distribute(
            processing_mode=service.ShardingPolicy.OFF,
            service=f"grpc://localhost:{trainer.port}",
            job_name="sweep" if trainer.shared else trainer.job,
            compression=None,
            cross_trainer_cache=cache,
        )
    )
    per_epoch = len(paths) // BATCH
    step = STEP_MS / trainer.speed / 1e3
    last = trainer.lasts
    batches = iter(ds)
    began_reading = time.perf_counter()
    trainer.setup = began_reading - began_setup
    for index in range(EPOCHS):
        if index == 1 and began is not None:
            began.set()
        e = Epoch()
        started = time.perf_counter()
        for _ in range(per_epoch):
            asked = time.perf_counter()
            (_, _, ids), seq, stream = next(batches)
            e.waited += time.perf_counter() - asked
            seq, stream = int(seq), int(stream)
            if stream in last:
                e.skipped += max(0, seq - last[stream] - 1)
            else:
                trainer.starts[stream] = seq
            last[stream] = seq
            e.seen.update(ids.numpy().tolist())
            e.batches += 1
            if index == 1 and e.batches == per_epoch // 2 and tell is not None:
                e.took = time.perf_counter() - started
                trainer.seconds = time.perf_counter() - began_reading
                trainer.done = time.time()
                tell("half", trainer, e)
            time.sleep(step)
        e.took = time.perf_counter() - started
        trainer.epochs.append(e)
        trainer.seconds = time.perf_counter() - began_reading
        trainer.done = time.time()
        if tell is not None:
            tell("epoch", trainer, None)


def killed_trainer(port: int, shared: bool, speed: float, corpus: str, go: Any, out: Any) -> None:
    """trial-d in a process of its own: imports TensorFlow, waits for `go`, reads, and sends its
    epochs to `out` (the parent kills it when it says it is half-way through epoch 1)."""
    tf = tfdata_common.tensorflow(1)
    paths, labels = tfdata_common.image_folder(corpus)
    trainer = Trainer("trial-d", speed, shared, port)
    out.put(("ready", None))
    go.wait()

    def tell(what: str, t: Trainer, partial: Epoch | None) -> None:
        out.put((what, (t.epochs + ([partial] if partial else []), t.starts, t.lasts, t.setup, t.seconds, t.done)))

    try:
        read(tf, trainer, paths, labels, tell=tell)
    except Exception as error:  # reported to the parent
        out.put(("error", repr(error)))


@dataclass
class Run:
    name: str
    cpu_seconds: float
    dispatcher_cpu_seconds: float
    seconds: float
    reading: float
    wait: float
    trainers: list[Trainer]
    worker_threads: list[int]
    made: int
    streams: int


def scenario(name: str, corpus: str, cache_bytes: int, timeout: float) -> Run:
    """One scenario (`alone`, `shared` or `unshared`) on fresh servers."""
    context = multiprocessing.get_context("spawn")
    port, servers = tfdata_common.start_service(context, worker, cache_bytes)
    shared = name == "shared"
    all_four = name != "alone"
    child = None
    go = context.Event()
    out = context.Queue()
    if all_four:
        child = context.Process(target=killed_trainer, args=(port, shared, PLAN[3][1], corpus, go, out), daemon=True)
        child.start()
        if out.get(timeout=120)[0] != "ready":
            raise SystemExit(f"{name}: trial-d did not start")
    tf = trainers_tensorflow()
    paths, labels = tfdata_common.image_folder(corpus)
    workers = [p.pid for p in servers[1:]]
    time.sleep(2)  # the workers' first heartbeats
    cpu_before = sum(cpu_seconds(pid) for pid in workers)
    dispatcher_before = cpu_seconds(servers[0].pid)
    started = time.perf_counter()
    started_at = time.time()

    a_began = threading.Event()

    def run(trainer: Trainer, began: threading.Event | None = None, after: threading.Event | None = None) -> None:
        try:
            if after is not None:
                after.wait()
            read(tf, trainer, paths, labels, began=began)
        except Exception as error:  # reported with the numbers
            trainer.error = repr(error)
        finally:
            if began is not None:
                began.set()

    a, b, c, d = (Trainer(job, speed, shared, port) for job, speed in PLAN)
    threads_ = [threading.Thread(target=run, args=(a, a_began), daemon=True)]
    if all_four:
        # trial-b starts when trial-a begins its second epoch; trial-d is the child process.
        threads_.append(threading.Thread(target=run, args=(c,), daemon=True))
        threads_.append(threading.Thread(target=run, args=(b, None, a_began), daemon=True))
        go.set()
    for thread in threads_:
        thread.start()
    if child is not None:
        # trial-d: killed half-way through its second epoch.
        deadline = time.perf_counter() + timeout
        while True:
            try:
                what, said = out.get(timeout=max(1.0, deadline - time.perf_counter()))
            except queue.Empty:
                d.error = "no word from trial-d before the timeout"
                break
            if what == "error":
                d.error = said
                break
            d.epochs, d.starts, d.lasts, d.setup, d.seconds, d.done = said
            if what == "half":
                child.kill()  # SIGKILL
                break
        child.join(10)
    for thread in threads_:
        thread.join(max(1.0, timeout - (time.perf_counter() - started)))
        if thread.is_alive():
            behind = [tr.job for tr in (a, b, c) if len(tr.epochs) < EPOCHS]
            raise SystemExit(f"{name}: {behind} did not finish within {timeout} s")
    seconds = time.perf_counter() - started
    time.sleep(1.5)  # as Stoker's sweep waits for its workers' last heartbeats
    cpu = sum(cpu_seconds(pid) for pid in workers) - cpu_before
    dispatcher_cpu = cpu_seconds(servers[0].pid) - dispatcher_before
    worker_threads = [threads(pid) for pid in workers]
    for p in servers:
        p.terminate()
    for p in servers:
        p.join(10)
    wait = sum(e.waited for e in a.epochs) / max(1e-9, sum(e.took for e in a.epochs))
    listed = [a, b, c, d] if all_four else [a]
    reading = max(t.done for t in listed) - started_at
    # Batches the workers made, at least: the highest sequence number a trainer got, per stream.
    made: dict[int, int] = {}
    for trainer in listed:
        for stream, seq in trainer.lasts.items():
            made[stream] = max(made.get(stream, 0), seq + 1)
    return Run(name, cpu, dispatcher_cpu, seconds, reading, wait, listed, worker_threads, sum(made.values()), len(made))


def report(run: Run, images: int) -> None:
    print(
        f"{run.name}: worker CPU-seconds {run.cpu_seconds:.1f} (dispatcher {run.dispatcher_cpu_seconds:.1f}) "
        f"in {run.seconds:.1f} s (the last batch read at {run.reading:.1f} s); trial-a waited {100 * run.wait:.1f}%; "
        f"at least {run.made * BATCH} elements made "
        f"({run.made} batches in {run.streams} worker streams); worker threads at the end {run.worker_threads}",
        flush=True,
    )
    for t in run.trainers:
        starts = ", ".join(f"{seq}" for seq in sorted(t.starts.values()))
        note = f" error: {t.error}" if t.error else ""
        print(
            f"  {t.job} ({t.speed}x): set up in {t.setup:.1f} s, read for {t.seconds:.1f} s, started at batch "
            f"{starts} of its workers' streams{note}"
        )
        for i, e in enumerate(t.epochs):
            part = "" if e.batches == images // BATCH else f" ({e.batches} batches)"
            print(f"    epoch {i}{part}: {e.summary(images)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="an image folder (stoker-worker corpus --images 480 --classes 4)")
    ap.add_argument("--cache-mib", type=int, default=64, help="each worker's cross-trainer cache")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a scenario may take")
    ap.add_argument("--scenarios", default="alone,shared,unshared")
    args = ap.parse_args()
    images = len(tfdata_common.image_folder(args.corpus)[0])
    runs = {}
    for name in args.scenarios.split(","):
        runs[name] = scenario(name, args.corpus, args.cache_mib << 20, args.timeout)
        report(runs[name], images)
    if {"alone", "shared", "unshared"} <= runs.keys():
        alone, shared, unshared = runs["alone"], runs["shared"], runs["unshared"]
        print(
            f"tf.data service: {EPOCHS} epochs of {images} images, trainers 1x 1x 0.7x 0.4x: worker CPU-seconds "
            f"alone {alone.cpu_seconds:.1f}, shared {shared.cpu_seconds:.1f} "
            f"({shared.cpu_seconds / alone.cpu_seconds:.2f}x), unshared {unshared.cpu_seconds:.1f} "
            f"({unshared.cpu_seconds / alone.cpu_seconds:.2f}x); trial-a waited {100 * alone.wait:.1f}% alone, "
            f"{100 * shared.wait:.1f}% shared, {100 * unshared.wait:.1f}% unshared; runs of "
            f"{alone.seconds:.0f} / {shared.seconds:.0f} / {unshared.seconds:.0f} s"
        )


if __name__ == "__main__":
    main()
