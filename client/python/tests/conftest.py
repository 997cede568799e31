"""Fixtures that run real `stoker-worker --standalone` processes on a generated corpus."""

import os
import pathlib
import queue
import re
import subprocess
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


def worker_binary() -> pathlib.Path:
    path = pathlib.Path(os.environ.get("STOKER_WORKER_BIN", ROOT / "target" / "debug" / "stoker-worker"))
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `cargo build --workspace --bins` first (or set STOKER_WORKER_BIN)")
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    subprocess.run(
        [str(worker_binary()), "corpus", "--out", str(out), "--images", "24", "--classes", "3"],
        check=True,
        capture_output=True,
    )
    return out


def manifest(directory: pathlib.Path, spec: str, name: str = "py") -> pathlib.Path:
    """`directory`/pipeline.yaml: a DataPipeline `name` in namespace test of `spec` (its
    lines, indented by two)."""
    path = directory / "pipeline.yaml"
    path.write_text(
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\n"
        f"metadata: {{name: {name}, namespace: test}}\nspec:\n{spec}"
    )
    return path


def pipeline_file(directory: pathlib.Path, corpus: pathlib.Path, batch_size: int = 8, extra: str = "") -> pathlib.Path:
    return manifest(
        directory,
        f"  source: {{uri: 'file://{corpus}/', format: imageFolder}}\n"
        "  transforms:\n"
        "  - decodeImage: {channels: 3}\n"
        "  - centerCrop: {size: [64, 64]}\n"
        "  - normalize: {mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}\n"
        f"  batchSize: {batch_size}\n"
        f"{extra}",
    )


def records_pipeline_file(directory: pathlib.Path, files: int, lines: int, batch_size: int, pad: int) -> pathlib.Path:
    """A pipeline of `files` JSONL files of `lines` records each (an "id" and `pad` floats:
    cheap to produce), read by two workers."""
    import json

    data = directory / "records"
    data.mkdir()
    padding = [0.5] * pad
    for file in range(files):
        records = (json.dumps({"id": file * lines + i, "pad": padding}) for i in range(lines))
        (data / f"{file}.jsonl").write_text("\n".join(records) + "\n")
    return manifest(
        directory,
        f"  source: {{uri: 'file://{data}/', format: jsonl}}\n"
        f"  batchSize: {batch_size}\n"
        "  workers: {min: 2, max: 2}\n  autoscaling: {mode: Fixed, replicas: 2}\n",
    )


def read_together(clients, read):
    """`read(rank, client)` for every client at once, each in its own thread; what each
    returned. The first error is raised once all are done; it closes every client first, as
    the other ranks would wait for this one's counts forever."""
    got, errors = [None] * len(clients), []

    def run(rank, client):
        try:
            got[rank] = read(rank, client)
        except Exception as e:  # noqa: BLE001 - raised below
            errors.append(e)
            for c in clients:
                c.close()

    threads = [threading.Thread(target=run, args=(rank, c), daemon=True) for rank, c in enumerate(clients)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for c in clients:
            c.close()
    if errors:
        raise errors[0]
    return got


def images_in(corpus: pathlib.Path) -> int:
    return sum(1 for p in corpus.rglob("*.jpg"))


def within(seconds: float, fn, *args):
    """fn(*args), failing the test if it takes longer than `seconds` (it goes on in the
    background: a hung stream cannot hang the suite)."""
    out = queue.Queue()

    def run():
        try:
            out.put((True, fn(*args)))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test
            out.put((False, e))

    threading.Thread(target=run, daemon=True).start()
    try:
        ok, value = out.get(timeout=seconds)
    except queue.Empty:
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not finish within {seconds} s")
    if not ok:
        raise value
    return value


class Worker:
    """A standalone worker process; its address is read from its log once it listens."""

    def __init__(self, pipeline: pathlib.Path, log: pathlib.Path, epochs: int, env: dict = None):
        self.log = log
        self._file = open(log, "w")
        self.process = subprocess.Popen(
            [
                str(worker_binary()),
                "--standalone",
                "--pipeline",
                str(pipeline),
                "--listen",
                "127.0.0.1:0",
                "--metrics-addr",
                "127.0.0.1:0",
                "--epochs",
                str(epochs),
                "--threads",
                "1",
            ],
            stdout=self._file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "NO_COLOR": "1", "RUST_LOG": "info", **(env or {})},
        )
        self.address = self._wait_for_address()

    def _wait_for_address(self, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        pattern = re.compile(r"listen\S*?=(127\.0\.0\.1:\d+)")
        while time.monotonic() < deadline:
            match = pattern.search(re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text()))
            if match:
                return match.group(1)
            if self.process.poll() is not None:
                raise RuntimeError(f"the worker exited: {self.log.read_text()}")
            time.sleep(0.05)
        raise TimeoutError(f"the worker did not listen within {timeout} s: {self.log.read_text()}")

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._file.close()


@pytest.fixture
def two_workers(tmp_path, corpus):
    pipeline = pipeline_file(tmp_path, corpus)
    workers = [Worker(pipeline, tmp_path / f"worker-{i}.log", epochs=2) for i in range(2)]
    yield [w.address for w in workers]
    for w in workers:
        w.stop()
