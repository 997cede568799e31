"""Batches through shared memory from a real worker on this host: the arrays map the worker's
file (no copy) and hold what messages would have carried; the worker writes later batches into
files whose arrays are gone, never into one still read; it keeps at most two files waiting for
a slow reader; none is left behind; a worker told not to, or a client that does not ask, uses
messages."""

import gc
import mmap
import os
import time

import numpy as np
import pytest

from conftest import Worker, images_in, pipeline_file, within
from stoker_client import Client
from stoker_client import _shared

pytestmark = pytest.mark.skipif(_shared.identity() is None, reason="no /dev/shm on this machine")


def mapped(array: np.ndarray) -> bool:
    """Whether the array's memory is a mapped file (not a received message)."""
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)


def files_of(worker: Worker, waiting_only=False):
    """The worker's files: all, or those not taken yet (no `.held`/`.free` suffix)."""
    return [n for n in os.listdir(_shared.DIRECTORY) if n.startswith(f"stoker-{worker.process.pid}-")
            and not (waiting_only and "." in n)]


def until_no_files_of(worker: Worker, seconds=10.0):
    """Waits for the worker to remove its files (its stream ends just after the client's)."""
    deadline = time.monotonic() + seconds
    while files_of(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return files_of(worker)


def read_all(address, shared_memory, pause=0.0):
    """{(epoch, row): image} and whether every image array was mapped."""
    rows, all_mapped, any_mapped = {}, True, False
    with Client([address], "test", "py", shared_memory=shared_memory) as client:
        for batch in client:
            image = batch["image"]
            all_mapped &= mapped(image)
            any_mapped |= mapped(image)
            for i, row in enumerate(batch.rows.tolist()):
                rows[(batch.epoch, row)] = image[i].copy()
            time.sleep(pause)
    return rows, all_mapped, any_mapped


def test_batches_map_the_workers_file_and_equal_the_messages(tmp_path, corpus):
    pipeline = pipeline_file(tmp_path, corpus, extra="  seed: 3\n")
    shared = Worker(pipeline, tmp_path / "shared.log", epochs=2)
    messages = Worker(pipeline, tmp_path / "messages.log", epochs=2)
    try:
        by_file, all_mapped, _ = within(120, read_all, shared.address, True)
        by_message, _, any_mapped = within(120, read_all, messages.address, False)
        assert all_mapped, "every batch through shared memory"
        assert not any_mapped, "shared_memory=False: messages only"
        assert len(by_file) == 2 * images_in(corpus) and by_file.keys() == by_message.keys()
        for key, image in by_file.items():
            np.testing.assert_array_equal(image, by_message[key])
        assert until_no_files_of(shared) == [], "every file removed once the stream ended"
    finally:
        shared.stop()
        messages.stop()
    assert "shared_memory=true" in shared.log.read_text()


def test_a_slow_reader_has_at_most_two_files_waiting(tmp_path, corpus):
    worker = Worker(pipeline_file(tmp_path, corpus, batch_size=2), tmp_path / "worker.log", epochs=1)
    seen = []
    try:
        with Client([worker.address], "test", "py", prefetch=1) as client:
            for _ in client:
                seen.append(len(files_of(worker, waiting_only=True)))
                time.sleep(0.1)
        assert len(seen) == images_in(corpus) // 2
        assert max(seen) <= 2, seen
        assert max(seen) == 2, f"the worker wrote ahead of the reader: {seen}"
        assert until_no_files_of(worker) == []
    finally:
        worker.stop()


def read_recording_files(address, keep_every, monkeypatch):
    """{(epoch, row): image} read keeping the arrays of every `keep_every`-th batch to the end
    (the others dropped as the loop goes on), and the inode of the file each batch came in."""
    inodes, kept, rows = [], [], {}
    take = _shared.take

    def recording(name, size, directory=_shared.DIRECTORY, reuse=False):
        inodes.append(os.stat(os.path.join(directory, name)).st_ino)
        assert reuse, "this worker takes its files back"
        return take(name, size, directory, reuse)

    monkeypatch.setattr(_shared, "take", recording)
    with Client([address], "test", "py", shared_memory=True, prefetch=2) as client:
        for n, batch in enumerate(client):
            if n % keep_every == 0:
                kept.append(batch)
    for batch in kept:
        for i, row in enumerate(batch.rows.tolist()):
            rows[(batch.epoch, row)] = batch["image"][i].copy()
    return rows, inodes, len(kept)


def test_files_whose_arrays_are_gone_hold_later_batches_and_held_ones_keep_theirs(tmp_path, corpus, monkeypatch):
    pipeline = pipeline_file(tmp_path, corpus, batch_size=2, extra="  seed: 5\n")
    keep_all, keep_some, messages = (Worker(pipeline, tmp_path / f"{name}.log", epochs=2)
                                     for name in ("all", "some", "messages"))
    try:
        every, inodes, kept = within(120, read_recording_files, keep_all.address, 1, monkeypatch)
        assert len(every) == 2 * images_in(corpus) and kept == len(inodes)
        assert len(set(inodes)) == len(inodes), "every batch kept: a file each"
        some, inodes, kept = within(120, read_recording_files, keep_some.address, 4, monkeypatch)
        # Kept batches hold their files; the others come back, a few at a time in flight.
        assert len(set(inodes)) <= kept + 6, (len(set(inodes)), kept, len(inodes))
        assert len(set(inodes)) < len(inodes)
        by_message, _, _ = within(120, read_all, messages.address, False)
        for key, image in every.items():
            np.testing.assert_array_equal(image, by_message[key])
        assert some.keys() <= by_message.keys() and len(some) == 2 * kept
        for key, image in some.items():
            np.testing.assert_array_equal(image, by_message[key], err_msg=f"kept batch's row {key} was overwritten")
        assert until_no_files_of(keep_all) == [] and until_no_files_of(keep_some) == []
    finally:
        for worker in (keep_all, keep_some, messages):
            worker.stop()


def test_a_file_goes_back_when_the_taker_drops_it_not_when_a_forked_child_does():
    name = f"stoker-{os.getpid()}-{os.urandom(8).hex()}-0"
    path = os.path.join(_shared.DIRECTORY, name)
    with open(path, "wb") as f:
        f.write(b"batch")
    try:
        mapped = _shared.take(name, 5, reuse=True)
        view = np.frombuffer(mapped, dtype=np.uint8)
        del mapped
        assert not os.path.exists(path) and os.path.exists(path + ".held")
        child = os.fork()
        if child == 0:
            del view
            gc.collect()
            os._exit(0 if os.path.exists(path + ".held") else 1)
        assert os.waitpid(child, 0)[1] == 0, "the child gave the file back"
        assert os.path.exists(path + ".held") and bytes(view) == b"batch"
        del view
        gc.collect()
        assert os.path.exists(path + ".free") and not os.path.exists(path + ".held")
    finally:
        for suffix in ("", ".held", ".free"):
            if os.path.exists(path + suffix):
                os.unlink(path + suffix)


def test_a_worker_without_a_shared_memory_directory_sends_messages(tmp_path, corpus):
    worker = Worker(pipeline_file(tmp_path, corpus), tmp_path / "worker.log", epochs=1,
                    env={"STOKER_SHARED_MEMORY_DIR": "none"})
    try:
        rows, _, any_mapped = within(120, read_all, worker.address, True)
        assert len(rows) == images_in(corpus) and not any_mapped
    finally:
        worker.stop()


def test_a_file_that_is_not_a_workers_is_refused(tmp_path):
    for name in ["../etc/passwd", "stoker-1/../../x", "other", ".."]:
        with pytest.raises(ValueError):
            _shared.take(name, 1)
