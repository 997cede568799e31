"""Batches through shared memory from a real worker on this host: the arrays map the worker's
file (no copy) and hold what messages would have carried; the worker writes later batches into
files whose arrays are gone, never into one still read; it keeps at most two files waiting for
a slow reader; none is left behind; a worker told not to, or a client that does not ask, uses
messages."""

import gc
import os
import time

import numpy as np
import pytest

from stoker_client import Client

from conftest import Worker, images_in, pipeline_file, within

DIRECTORY = "/dev/shm"

pytestmark = pytest.mark.skipif(not os.path.isdir(DIRECTORY), reason="no /dev/shm on this machine")


def mapping(array: np.ndarray):
    """(path, inode) of the file mapping the array's memory is in, or None (a received
    message's memory): what /proc/self/maps says of its address."""
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                path = fields[5].strip() if len(fields) > 5 else ""
                return (path, int(fields[4])) if path.startswith(DIRECTORY + "/") else None
    return None


def mapped(array: np.ndarray) -> bool:
    """Whether the array's memory is a worker's mapped file (not a received message)."""
    found = mapping(array)
    return found is not None and os.path.basename(found[0]).startswith("stoker-")


def files_of(worker: Worker, waiting_only=False):
    """The worker's files: all, or those not taken yet (no `.held`/`.free` suffix)."""
    return [
        n
        for n in os.listdir(DIRECTORY)
        if n.startswith(f"stoker-{worker.process.pid}-") and not (waiting_only and "." in n)
    ]


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
        # The client maps a file as its chunk arrives, so one waits while the client holds
        # the batch before it; the worker writes ahead of the reader.
        assert max(seen) >= 1, f"the worker did not write ahead of the reader: {seen}"
        assert until_no_files_of(worker) == []
    finally:
        worker.stop()


def read_recording_files(address, keep_every):
    """{(epoch, row): image} read keeping the arrays of every `keep_every`-th batch to the end
    (the others dropped as the loop goes on), and the inode of the file each batch came in."""
    inodes, kept, rows = [], [], {}
    with Client([address], "test", "py", shared_memory=True, prefetch=2) as client:
        for n, batch in enumerate(client):
            found = mapping(batch["image"])
            # `.held (deleted)` once the worker stopped waiting for a file kept this long.
            assert found is not None and ".held" in found[0], f"this worker takes its files back: {found}"
            inodes.append(found[1])
            if n % keep_every == 0:
                kept.append(batch)
    for batch in kept:
        for i, row in enumerate(batch.rows.tolist()):
            rows[(batch.epoch, row)] = batch["image"][i].copy()
    return rows, inodes, len(kept)


def test_files_whose_arrays_are_gone_hold_later_batches_and_held_ones_keep_theirs(tmp_path, corpus):
    pipeline = pipeline_file(tmp_path, corpus, batch_size=2, extra="  seed: 5\n")
    keep_all, keep_some, messages = (
        Worker(pipeline, tmp_path / f"{name}.log", epochs=2) for name in ("all", "some", "messages")
    )
    try:
        every, inodes, kept = within(120, read_recording_files, keep_all.address, 1)
        assert len(every) == 2 * images_in(corpus) and kept == len(inodes)
        assert len(set(inodes)) == len(inodes), "every batch kept: a file each"
        some, inodes, kept = within(120, read_recording_files, keep_some.address, 4)
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


def test_a_file_goes_back_when_the_taker_drops_it_not_when_a_forked_child_does(tmp_path, corpus):
    worker = Worker(pipeline_file(tmp_path, corpus, batch_size=2), tmp_path / "worker.log", epochs=1)
    try:
        with Client([worker.address], "test", "py", prefetch=1) as client:
            image = next(client)["image"]
            path = mapping(image)[0]
            assert path.endswith(".held"), path
            child = os.fork()
            if child == 0:
                del image
                gc.collect()
                os._exit(0 if os.path.exists(path) else 1)
            assert os.waitpid(child, 0)[1] == 0, "the child gave the file back"
            assert os.path.exists(path) and mapped(image)
            del image
            gc.collect()
            assert not os.path.exists(path) and os.path.exists(path[: -len(".held")] + ".free")
    finally:
        worker.stop()


def test_a_client_carried_across_a_fork_fails_clearly_and_the_parent_goes_on(tmp_path, corpus):
    worker = Worker(pipeline_file(tmp_path, corpus, batch_size=2), tmp_path / "worker.log", epochs=1)
    try:
        with Client([worker.address], "test", "py", prefetch=1) as client:
            first = next(client)
            read, write = os.pipe()
            child = os.fork()
            if child == 0:
                os.close(read)
                try:
                    next(client)
                    said = b"no error"
                except RuntimeError as e:
                    said = str(e).encode()
                client.close()  # the parent's streams are the parent's
                os.write(write, said)
                os._exit(0)
            os.close(write)
            assert os.waitpid(child, 0)[1] == 0
            with os.fdopen(read, "rb") as pipe:
                said = pipe.read().decode()
            assert "carried into process" in said and "make a new client" in said, said
            rest = list(client)
        assert 2 * (1 + len(rest)) == images_in(corpus) and first.rows.size == 2
    finally:
        worker.stop()


def test_a_worker_without_a_shared_memory_directory_sends_messages(tmp_path, corpus):
    worker = Worker(
        pipeline_file(tmp_path, corpus), tmp_path / "worker.log", epochs=1, env={"STOKER_SHARED_MEMORY_DIR": "none"}
    )
    try:
        rows, _, any_mapped = within(120, read_all, worker.address, True)
        assert len(rows) == images_in(corpus) and not any_mapped
    finally:
        worker.stop()
