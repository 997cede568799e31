"""Exactly once through connection faults, from Python: `stoker local` with two workers, 4000
JSONL records an epoch, read three epochs while every 1.5 s this process's connections to the
workers are reset (`ss -K` on the test's own sockets, as a proxy, a conntrack flush or a flaky
link would), and every third time its connection to the dispatcher too. Every process stays
up. Every epoch reaches the loop exactly once and nothing is raised into it, through gRPC
messages, through shared memory, and for two ranks (equal counts); a run with faults takes at
most 1.5x one without. Before the client was the
Rust one bound to Python, the shared-memory path raised after two resets and the message path
lost 120-160 rows an epoch."""

import os
import subprocess
import threading
import time
from collections import Counter

import pytest

from stoker_client import Client

from conftest import Worker, read_together, records_pipeline_file, within
from test_dispatcher import Local
from test_shared_memory import mapped

FILES = 4
LINES = 1000
EPOCHS = 3
EVERY = 1.5


@pytest.fixture
def records_pipeline(tmp_path):
    return records_pipeline_file(tmp_path, FILES, LINES, batch_size=20, pad=100)


def own_connections():
    """(local port, remote port) of this process's established TCP connections."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and fields[9] in inodes:  # 01: ESTABLISHED
                    found.append((int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)))
    return found


def reset(local_ports):
    """Resets the connections from these local ports (a reset goes to the other end too); how
    many sockets were closed."""
    if not local_ports:
        return 0
    filter = " or ".join(f"sport = :{p}" for p in local_ports)
    out = subprocess.run(
        ["ss", "-K", "-t", "-n", "state", "established", f"( {filter} )"], capture_output=True, text=True, check=True
    ).stdout
    return len([line for line in out.splitlines()[1:] if line.strip()])


class Resetter:
    """Resets this process's connections every EVERY seconds until stopped: those to the
    workers each time, the one to the dispatcher every third time."""

    def __init__(self, dispatcher_port: int):
        self.dispatcher_port = dispatcher_port
        self.closed = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        round = 0
        while not self.stop.wait(EVERY):
            round += 1
            ports = [local for local, remote in own_connections() if remote != self.dispatcher_port or round % 3 == 0]
            self.closed += reset(ports)

    def finish(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.closed


def read(url: str, job: str, ranks: int, shared_memory: bool):
    """Each consumer's (rows, batches, dropped rows, batches sampled that came through shared
    memory) per epoch, read at the same time."""
    clients = [
        Client.from_dispatcher(
            url, "test", "py", job=job, consumers=ranks, consumer_index=rank, shared_memory=shared_memory, prefetch=4
        )
        for rank in range(max(ranks, 1))
    ]

    def epochs(_rank, client):
        out = []
        for _ in range(EPOCHS):
            rows, batches, dropped, shared = [], 0, client.dropped_rows, 0
            for batch in client.iter_epoch():
                rows.extend(batch.rows.tolist())
                batches += 1
                shared += batches % 10 == 1 and mapped(batch["pad"])
            out.append((rows, batches, client.dropped_rows - dropped, shared))
        return out

    return read_together(clients, epochs)


def run(tmp_path, pipeline, job, ranks=0, shared_memory=False, faults=True):
    """(what each consumer read, seconds, sockets reset) for three epochs."""
    with Local(tmp_path, pipeline, args=["--max-batch-rate", "40"]) as local:
        url = local.address()
        resetter = Resetter(int(url.rsplit(":", 1)[1])) if faults else None
        started = time.monotonic()
        try:
            got = within(240, read, url, job, ranks, shared_memory)
        finally:
            closed = resetter.finish() if resetter else 0
        return got, time.monotonic() - started, closed


def check_exactly_once(got):
    for epoch in range(EPOCHS):
        seen = Counter(row for consumer in got for row in consumer[epoch][0])
        dropped = sum(consumer[epoch][2] for consumer in got)
        twice = [row for row, n in seen.items() if n > 1]
        assert not twice, f"epoch {epoch}: {len(twice)} rows reached the loop twice"
        assert len(seen) + dropped == FILES * LINES, f"epoch {epoch}: {len(seen)} rows, {dropped} dropped"


@pytest.mark.parametrize("shared_memory", [False, True], ids=["messages", "shared-memory"])
def test_connection_resets_lose_and_repeat_nothing(tmp_path, records_pipeline, shared_memory):
    calm, calm_seconds, _ = run(tmp_path, records_pipeline, "calm", shared_memory=shared_memory, faults=False)
    check_exactly_once(calm)
    got, seconds, closed = run(tmp_path, records_pipeline, "resets", shared_memory=shared_memory)
    print(
        f"three epochs: {calm_seconds:.1f} s without faults, {seconds:.1f} s with {closed} sockets reset "
        f"({seconds / calm_seconds:.2f}x)"
    )
    assert closed >= 6, f"the resets closed {closed} sockets: the faults did not happen"
    check_exactly_once(got)
    assert seconds <= 1.5 * calm_seconds, f"{seconds:.1f} s with faults, {calm_seconds:.1f} s without"
    shared = sum(epoch[3] for epoch in got[0])
    assert (shared > 0) == shared_memory, f"{shared} batches sampled came through shared memory"


def test_ranks_keep_equal_counts_through_resets(tmp_path, records_pipeline):
    got, seconds, closed = run(tmp_path, records_pipeline, "ranks", ranks=2, shared_memory=True)
    print(f"two ranks, three epochs: {seconds:.1f} s with {closed} sockets reset")
    assert closed >= 6, f"the resets closed {closed} sockets: the faults did not happen"
    check_exactly_once(got)
    assert all(epoch[3] > 0 for rank in got for epoch in rank), "through shared memory"
    for epoch in range(EPOCHS):
        assert got[0][epoch][1] == got[1][epoch][1], f"epoch {epoch}: the ranks' batch counts differ"


@pytest.mark.parametrize("shared_memory", [False, True], ids=["messages", "shared-memory"])
def test_streams_from_fixed_workers_resume_through_resets(tmp_path, shared_memory):
    """A fixed list of standalone workers (no dispatcher): each serves every record of every
    epoch; reading them slowly while the connections are reset every 1.5 s, every (epoch, row)
    arrives once from each worker, and nothing is raised."""
    # Wide records: a worker's HTTP/2 window holds few batches, so it cannot send all of its
    # epochs ahead of the slow reader and close its connection before the resets end.
    pipeline = records_pipeline_file(tmp_path, FILES, LINES, batch_size=20, pad=2000)
    workers = [Worker(pipeline, tmp_path / f"worker-{i}.log", epochs=EPOCHS) for i in range(2)]
    try:
        resetter = Resetter(dispatcher_port=0)
        seen = Counter()
        try:
            with Client([w.address for w in workers], "test", "py", shared_memory=shared_memory, prefetch=2) as client:

                def read():
                    for batch in client:
                        seen.update((batch.epoch, row) for row in batch.rows.tolist())
                        time.sleep(0.01)  # a training step: the streams outlive several resets

                within(240, read)
        finally:
            closed = resetter.finish()
        print(f"fixed workers: {closed} sockets reset")
        assert closed >= 6, f"the resets closed {closed} sockets: the faults did not happen"
        assert len(seen) == EPOCHS * FILES * LINES, f"{len(seen)} (epoch, row)s of {EPOCHS * FILES * LINES}"
        wrong = {key: n for key, n in seen.items() if n != 2}
        assert not wrong, f"{len(wrong)} (epoch, row)s did not arrive once from each worker"
    finally:
        for w in workers:
            w.stop()
