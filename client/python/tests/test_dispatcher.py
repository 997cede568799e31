"""Dispatcher mode against `stoker local`: the client finds the workers through the dispatcher
and its batch-time reports reach the autoscaler (the local view shows them)."""

import os
import pathlib
import re
import subprocess
import threading
import time

from conftest import ROOT, pipeline_file, worker_binary

from stoker_client import Client


def test_the_client_follows_the_dispatcher_and_reports_windows(tmp_path, corpus):
    stoker = pathlib.Path(os.environ.get("STOKER_BIN", ROOT / "target" / "debug" / "stoker"))
    pipeline = pipeline_file(tmp_path, corpus, batch_size=4)
    env = {**os.environ, "STOKER_WORKER_BIN": str(worker_binary()), "STOKER_CACHE": str(tmp_path / "cache")}
    local = subprocess.Popen([str(stoker), "local", "-f", str(pipeline), "--listen", "127.0.0.1:0", "--window-seconds", "1",
                              "--seconds", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    url = threading.Event()
    reader = threading.Thread(target=lambda: [lines.append(l) or (re.search(r"http://\S+", l) and url.set()) for l in local.stdout],
                              daemon=True)
    reader.start()
    try:
        assert url.wait(30), "".join(lines)
        address = re.search(r"http://(\S+)", "".join(lines)).group(1)
        with Client.from_dispatcher(address, "test", "py") as client:
            batches = [next(client) for _ in range(30)]
            assert all(b["image"].shape[1:] == (64, 64, 3) for b in batches)
            # The view prints the batch time the autoscaler got from this client's reports.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any(re.search(r"\d+s\s+\d+\s+[1-9][\d.]* ms", l) for l in lines):
                next(client)
        assert any(re.search(r"\d+s\s+\d+\s+[1-9][\d.]* ms", l) for l in lines), "".join(lines)
    finally:
        local.terminate()
        local.wait(timeout=20)
