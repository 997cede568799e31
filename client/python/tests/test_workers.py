"""The client against real standalone workers, and the example script."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from stoker_client import Client, StatusCode, WorkerError

from conftest import Worker, manifest

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "iterate_epochs.py"


def test_two_workers_deliver_every_image_of_both_epochs(two_workers):
    with Client(two_workers, "test", "py") as client:
        batches = list(client)
        stats = client.window()
    # Standalone workers each serve every split: 2 workers x 2 epochs x 24 images.
    images = sum(b["image"].shape[0] for b in batches)
    assert images == 2 * 2 * 24
    assert {b.epoch for b in batches} == {0, 1}
    for b in batches:
        assert b["image"].dtype == np.float32 and b["image"].shape[1:] == (64, 64, 3)
        assert b["label"].dtype == np.int64 and b["label"].shape == b["image"].shape[:1]
        assert np.isfinite(b["image"]).all()
    labels = np.concatenate([b["label"] for b in batches])
    assert sorted(set(labels.tolist())) == [0, 1, 2]
    # The call that found the end closes the last batch's interval too.
    assert stats.batches == len(batches), "every interval between next() calls is measured"
    assert 0.0 <= stats.wait_fraction <= 1.0 and stats.p90 >= stats.median > 0


def test_an_unreachable_worker_is_an_error_naming_it(two_workers):
    # The constructor connects: a wrong address fails there, not mid-training.
    with pytest.raises(WorkerError, match="127.0.0.1:1") as failed:
        Client([two_workers[0], "127.0.0.1:1"], "test", "py")
    assert failed.value.code == StatusCode.UNAVAILABLE


def test_epochs_and_states_need_the_dispatcher(two_workers):
    with Client(two_workers, "test", "py") as client:
        with pytest.raises(TypeError, match="needs the dispatcher"):
            client.iter_epoch()
        with pytest.raises(TypeError, match="needs the dispatcher"):
            client.state()


def test_a_state_is_checked_against_the_consumer():
    state = {"job": "job", "epoch": 1, "batches": 2, "consumers": 2, "consumer_index": 1, "yielded": [[0, [3]]]}

    def resume(**o):
        return Client.from_dispatcher("127.0.0.1:1", "ns", "p", connect_timeout=0.5, **o)

    with pytest.raises(ValueError, match='of job "job", not "other"'):
        resume(job="other", consumers=2, consumer_index=1, resume=state)
    with pytest.raises(ValueError, match="of consumer 1 of 2, not 0 of 2"):
        resume(job="job", consumers=2, consumer_index=0, resume=state)
    with pytest.raises(ValueError, match="of consumer 1 of 2, not 1 of 4"):
        resume(job="job", consumers=4, consumer_index=1, resume=state)
    with pytest.raises(ValueError, match="lacks batches, yielded"):
        resume(
            job="job",
            consumers=2,
            consumer_index=1,
            resume={"job": "job", "epoch": 1, "consumers": 2, "consumer_index": 1},
        )
    with pytest.raises(ValueError, match="start_epoch 0 is not the resume state's epoch 1"):
        resume(job="job", consumers=2, consumer_index=1, resume=state, start_epoch=0)
    # A valid state gets as far as the dispatcher, which is not there.
    with pytest.raises(WorkerError, match="127.0.0.1:1"):
        resume(job="job", consumers=2, consumer_index=1, resume=state)


def test_bad_options_are_refused():
    with pytest.raises(ValueError):
        Client([], "test", "py")
    with pytest.raises(ValueError):
        Client(["127.0.0.1:1"], "test", "py", max_message_bytes=10)


def test_the_example_iterates_epochs_and_prints_images_per_second(two_workers):
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--namespace", "test", "--pipeline", "py", *two_workers],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    lines = [line for line in out.splitlines() if line.startswith("epoch")]
    assert len(lines) == 2, out
    for line in lines:
        # Two standalone workers each serve the 24 images of every epoch.
        assert "images/s" in line and ": 48 images" in line, out


def test_echo_copies_are_numbered_per_row_and_augmented_apart(tmp_path, corpus):
    pipeline = tmp_path / "echo.yaml"
    pipeline.write_text(
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {name: py, namespace: test}\nspec:\n"
        f"  source: {{uri: 'file://{corpus}/', format: imageFolder}}\n"
        "  transforms:\n"
        "  - decodeImage: {channels: 3}\n"
        "  - echo: {factor: 2}\n"
        "  - randomResizedCrop: {size: [16, 16]}\n"
        "  batchSize: 8\n"
    )
    worker = Worker(pipeline, tmp_path / "worker.log", epochs=1)
    try:
        with Client([worker.address], "test", "py") as client:
            batches = list(client)
    finally:
        worker.stop()
    copies = np.concatenate([b.echo_copies for b in batches])
    rows = np.concatenate([b.rows for b in batches])
    images = np.concatenate([b["image"] for b in batches])
    # 24 images, each twice: copy 0 and copy 1, the copy in the position's bits 24-31.
    assert sorted(copies.tolist()) == [0] * 24 + [1] * 24
    assert ((rows & 0xFFFFFFFF) >> 24).tolist() == copies.tolist()
    element = rows & ~np.uint64(0xFF << 24)
    by_copy = {int(c): {int(e): images[i] for i, (e, c2) in enumerate(zip(element, copies)) if c2 == c} for c in (0, 1)}
    assert by_copy[0].keys() == by_copy[1].keys() and len(by_copy[0]) == 24
    differing = sum(not np.array_equal(by_copy[0][e], by_copy[1][e]) for e in by_copy[0])
    assert differing == 24, f"each copy cropped on its own draws: {differing} of 24 differ"


def test_rows_without_echo_are_all_copy_0(two_workers):
    with Client(two_workers[:1], "test", "py") as client:
        batch = next(client)
    assert batch.echo_copies.tolist() == [0] * len(batch.rows)


@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_pipeline_that_fails_raises_its_reason_in_the_client(tmp_path, shared_memory):
    # Lists of different lengths with neither padValue nor jagged: the worker cannot batch
    # them. The client must raise why, not take the end of its batches for an empty epoch.
    data = tmp_path / "data"
    data.mkdir()
    (data / "0.jsonl").write_text('{"x": [1, 2]}\n{"x": [1, 2, 3]}\n')
    pipeline = manifest(tmp_path, f"  source: {{uri: 'file://{data}/', format: jsonl}}\n  batchSize: 2\n")
    worker = Worker(pipeline, tmp_path / "worker.log", epochs=1)
    try:
        with pytest.raises(WorkerError, match="pipeline failed.*shapes \\[2\\] and \\[3\\].*padValue") as failed:
            with Client([worker.address], "test", "py", shared_memory=shared_memory) as client:
                list(client)
        assert failed.value.code == StatusCode.INTERNAL
    finally:
        worker.stop()
