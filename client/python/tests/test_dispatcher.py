"""Dispatcher mode against `stoker local`: the client finds the workers through the dispatcher,
reads whole epochs one after the other, and its batch-time reports reach the autoscaler (the
local view shows them)."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from stoker_client import Client, WorkerError

from conftest import ROOT, images_in, pipeline_file, within, worker_binary


class Local:
    """`stoker local` serving `pipeline` (`args` added to its command line), its output lines
    collected; `url` is set once it listens."""

    def __init__(self, tmp_path, pipeline, args=()):
        stoker = pathlib.Path(os.environ.get("STOKER_BIN", ROOT / "target" / "debug" / "stoker"))
        env = {**os.environ, "STOKER_WORKER_BIN": str(worker_binary()), "STOKER_CACHE": str(tmp_path / "cache")}
        self.process = subprocess.Popen(
            [
                str(stoker),
                "local",
                "-f",
                str(pipeline),
                "--listen",
                "127.0.0.1:0",
                "--window-seconds",
                "1",
                "--seconds",
                "60",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines = []
        self.url = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)
            if re.search(r"https?://\S+", line):
                self.url.set()

    def address(self):
        assert self.url.wait(30), "".join(self.lines)
        return re.search(r"https?://(\S+)", "".join(self.lines)).group(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        self.process.wait(timeout=20)


def test_the_client_follows_the_dispatcher_and_reports_windows(tmp_path, corpus):
    with Local(tmp_path, pipeline_file(tmp_path, corpus, batch_size=4)) as local:
        lines = local.lines
        with Client.from_dispatcher(local.address(), "test", "py") as client:
            batches = [next(client) for _ in range(30)]
            assert all(b["image"].shape[1:] == (64, 64, 3) for b in batches)
            # The view prints the batch time the autoscaler got from this client's reports.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any(
                re.search(r"\d+s\s+\d+\s+[1-9][\d.]* ms", line) for line in lines
            ):
                next(client)
        assert any(re.search(r"\d+s\s+\d+\s+[1-9][\d.]* ms", line) for line in lines), "".join(lines)


def test_completions_without_a_batch_are_reported_and_never_yielded(tmp_path, corpus):
    # 24 images in batches of 5 with the remainder dropped: each epoch's last split completes
    # in a batch without tensors, which the client reports to the dispatcher and skips.
    pipeline = pipeline_file(tmp_path, corpus, batch_size=5, extra="  dropRemainder: true\n")
    with Local(tmp_path, pipeline) as local, Client.from_dispatcher(local.address(), "test", "py") as client:
        epochs = set()
        deadline = time.monotonic() + 40
        while len(epochs) < 4:
            assert time.monotonic() < deadline, f"epochs seen in 40 s: {sorted(epochs)}\n" + "".join(local.lines)
            batch = next(client)
            assert batch["image"].shape == (5, 64, 64, 3), batch.completes
            epochs.add(batch.epoch)


def read_epoch(client):
    """(the epoch read, its batches) from `client.iter_epoch()`."""
    epoch = client.epoch
    return epoch, list(client.iter_epoch())


def check_epoch(epoch, batches, images):
    """Every image of the corpus exactly once, all of `epoch`."""
    assert {b.epoch for b in batches} == {epoch}
    assert sum(b["label"].shape[0] for b in batches) == images
    rows = [r for b in batches for r in b.rows.tolist()]
    assert len(rows) == len(set(rows)) == images, "every row once"


def test_iter_epoch_gives_each_epoch_whole_and_once(tmp_path, corpus):
    images = images_in(corpus)
    with (
        Local(tmp_path, pipeline_file(tmp_path, corpus, batch_size=4)) as local,
        Client.from_dispatcher(local.address(), "test", "py") as client,
    ):
        first, batches = within(60, read_epoch, client)
        check_epoch(first, batches, images)
        assert client.epoch == first + 1
        second, batches = within(60, read_epoch, client)
        check_epoch(second, batches, images)
        assert second == first + 1 and client.epoch == first + 2


def test_next_goes_on_across_epochs_without_prefetching(tmp_path, corpus):
    images = images_in(corpus)
    with (
        Local(tmp_path, pipeline_file(tmp_path, corpus, batch_size=4)) as local,
        Client.from_dispatcher(local.address(), "test", "py", prefetch_next_epoch=False) as client,
    ):
        start = client.epoch
        batches = within(60, lambda: [next(client) for _ in range(2 * images // 4)])
        assert [b.epoch for b in batches] == sorted(b.epoch for b in batches), "epochs in order"
        for epoch in (start, start + 1):
            check_epoch(epoch, [b for b in batches if b.epoch == epoch], images)


def test_iterating_ends_after_the_epochs_declared(tmp_path, corpus):
    images = images_in(corpus)
    with (
        Local(tmp_path, pipeline_file(tmp_path, corpus, batch_size=4)) as local,
        Client.from_dispatcher(local.address(), "test", "py", epochs=2) as client,
    ):
        batches = within(60, lambda: list(client))
        assert sorted({b.epoch for b in batches}) == [0, 1]
        for epoch in (0, 1):
            check_epoch(epoch, [b for b in batches if b.epoch == epoch], images)
        assert client.epoch == 2 and list(client.iter_epoch()) == [], "nothing past the last"
    with pytest.raises(ValueError, match="epochs must be at least 1"):
        Client.from_dispatcher("127.0.0.1:1", "test", "py", epochs=0)


def test_the_example_reads_epochs_through_the_dispatcher(tmp_path, corpus):
    example = ROOT / "examples" / "iterate_epochs.py"
    with Local(tmp_path, pipeline_file(tmp_path, corpus, batch_size=4)) as local:
        out = subprocess.run(
            [
                sys.executable,
                str(example),
                "--namespace",
                "test",
                "--pipeline",
                "py",
                "--dispatcher",
                local.address(),
                "--epochs",
                "2",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    images = images_in(corpus)
    lines = [line for line in out.splitlines() if line.startswith("epoch")]
    assert [line.split(" images in ")[0] for line in lines] == [f"epoch 0: {images}", f"epoch 1: {images}"], out
    assert all(line.endswith("images/s") for line in lines), out


def test_a_wait_for_a_batch_leaves_python_running_and_is_interrupted_by_ctrl_c_and_close(tmp_path, corpus):
    """The client waits for batches without the GIL: another thread runs meanwhile; Ctrl-C
    (SIGINT) interrupts a wait within a fraction of a second, and close() from another thread
    ends one at once."""
    # One batch a second: every next() waits most of a second.
    with (
        Local(tmp_path, pipeline_file(tmp_path, corpus, batch_size=4), args=["--max-batch-rate", "1"]) as local,
        Client.from_dispatcher(local.address(), "test", "py", prefetch=1, prefetch_next_epoch=False) as client,
    ):
        for _ in range(3):  # whatever was made before the first call
            next(client)
        counted, stop = [0], threading.Event()

        def count():
            while not stop.is_set():
                counted[0] += 1

        counter = threading.Thread(target=count)
        counter.start()
        try:
            started = time.monotonic()
            next(client)
            waited = time.monotonic() - started
        finally:
            stop.set()
            counter.join()
        assert waited > 0.3, f"the batch came at once ({waited:.2f} s): no wait to measure"
        assert counted[0] > 10000, f"another thread counted to {counted[0]} in {waited:.2f} s: the GIL was held"

        # Python's own Ctrl-C handler, whatever this process inherited: a process started in the
        # background by a non-interactive shell ignores SIGINT, and the wait would never end.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(0.3, signal.raise_signal, (signal.SIGINT,))
        started = time.monotonic()
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                while True:
                    next(client)
        finally:
            timer.cancel()
            signal.signal(signal.SIGINT, previous)
        assert time.monotonic() - started < 2.0, "Ctrl-C ends the wait"

        closer = threading.Timer(0.3, client.close)
        started = time.monotonic()
        closer.start()
        with pytest.raises(StopIteration):
            while True:
                next(client)
        closer.join()
        assert time.monotonic() - started < 2.5, "close() from another thread ends the wait"


def test_two_jobs_of_a_share_group_each_get_every_epoch_once(tmp_path, corpus):
    images = images_in(corpus)
    with (
        Local(tmp_path, pipeline_file(tmp_path, corpus, batch_size=4)) as local,
        Client.from_dispatcher(local.address(), "test", "py", job="trial-a", share="sweep") as a,
        Client.from_dispatcher(local.address(), "test", "py", job="trial-b", share="sweep") as b,
    ):
        for client in (a, b, a, b):
            epoch, batches = within(60, read_epoch, client)
            check_epoch(epoch, batches, images)
        with pytest.raises(WorkerError, match="share group"):
            Client.from_dispatcher(local.address(), "test", "py", job="trial-a", share="other")


def test_the_sweep_example_runs_the_sweep_sample_as_trials_of_one_share_group(tmp_path, corpus):
    # The sample's spec, its source pointed at the test corpus and its batches made small.
    sample = (ROOT / "manifests" / "samples" / "sweep.yaml").read_text()
    spec = sample.replace("file:///data/train/", f"file://{corpus}/").replace("batchSize: 128", "batchSize: 8")
    spec = spec.replace("[224, 224]", "[32, 32]")
    spec = re.sub(r"\n  workers:\n(    .*\n|      .*\n)*", "\n", spec)
    spec = spec.replace("metadata:\n  name: sweep-input\n", "metadata: {name: sweep-input, namespace: test}\n")
    pipeline = tmp_path / "sweep.yaml"
    pipeline.write_text(spec)
    with Local(tmp_path, pipeline) as local:
        out = subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "sweep.py"),
                "--dispatcher",
                local.address(),
                "--namespace",
                "test",
                "--pipeline",
                "sweep-input",
                "--trials",
                "3",
                "--step-ms",
                "0,0,5",
                "--epochs",
                "2",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=180,
        ).stdout
    print(out)
    images = images_in(corpus)
    lines = sorted(line for line in out.splitlines() if line.startswith("trial-"))
    assert [line.split(" in ")[0] for line in lines] == [
        f"trial-{i}: epochs of {images}, {images} images" for i in range(3)
    ], out
