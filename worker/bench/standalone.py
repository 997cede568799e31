"""A standalone `stoker-worker` serving one pipeline for the benchmark scripts beside it."""

import contextlib
import os
import pathlib
import re
import subprocess
import tempfile
import time


def address(log_path: str, process: subprocess.Popen, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log_path) as f:
            match = re.search(r"listen\S*?=(127\.0\.0\.1:\d+)", re.sub(r"\x1b\[[0-9;]*m", "", f.read()))
        if match:
            return match.group(1)
        if process.poll() is not None:
            raise RuntimeError(f"the worker exited; see {log_path}")
        time.sleep(0.05)
    raise TimeoutError(f"the worker did not listen within {timeout} s; see {log_path}")


@contextlib.contextmanager
def serve(worker_bin, spec, epochs, threads, env=None):
    """Yields the address of a worker serving `epochs` epochs of the DataPipeline whose spec
    (the lines under `spec:`, indented) is `spec`; stops it afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = pathlib.Path(tmp) / "pipeline.yaml"
        pipeline.write_text(
            "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\n"
            "metadata: {name: bench, namespace: bench}\nspec:\n" + spec
        )
        log_path = pathlib.Path(tmp) / "worker.log"
        with open(log_path, "w") as log:
            worker = subprocess.Popen(
                [
                    worker_bin,
                    "--standalone",
                    "--pipeline",
                    str(pipeline),
                    "--listen",
                    "127.0.0.1:0",
                    "--epochs",
                    str(epochs),
                    "--threads",
                    str(threads),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "NO_COLOR": "1", "RUST_LOG": "info", **(env or {})},
            )
            try:
                yield address(str(log_path), worker, timeout=60.0)
            finally:
                worker.terminate()
                worker.wait(timeout=30)
