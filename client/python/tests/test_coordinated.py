"""Coordinated mode against `stoker local` with two workers: two ranks of one job, each its own
client in its own thread taking steps of random length, read epoch by epoch. Each epoch both get
the same number of batches, no row twice, every batch names its round, both workers' rounds
come, and batch k of both ranks is of the same round, but for the few at the epoch's end that
no round of the order took (each worker's last, incomplete round). In arrival order the ranks
line up for a few batches only: they receive the workers' rounds interleaved differently."""

import random
import time

import pytest

from stoker_client import Client

from conftest import read_together, records_pipeline_file, within
from test_dispatcher import Local

RANKS = 2
EPOCHS = 2
# Records of padded JSON lines: cheap to produce, so the workers outpace the ranks, whose
# streams then race for the ranks' buffers (as in training): arrival order differs by rank.
FILES = 8
LINES = 100
BATCH_SIZE = 5
# What the order may leave to the end of an epoch: per worker its last, incomplete round, and
# what arrived too late for the order before the quota was final.
UNALIGNED = 8
# Each rank's training step, a random time up to this, drawn differently at each rank.
STEP_SECONDS = 0.01


@pytest.fixture
def records_pipeline(tmp_path):
    """A pipeline of FILES jsonl files of LINES records each, read by two workers."""
    return records_pipeline_file(tmp_path, FILES, LINES, BATCH_SIZE, pad=200)


def read_epochs(client, steps: random.Random):
    """Per epoch, (the epoch, its batches' rounds, its rows, rows dropped), taking a step of
    random length after each batch."""
    out = []
    for _ in range(EPOCHS):
        epoch, dropped = client.epoch, client.dropped_rows
        batches = []
        for batch in client.iter_epoch():
            batches.append(batch)
            time.sleep(steps.uniform(0, STEP_SECONDS))
        assert {b.epoch for b in batches} == {epoch}
        out.append(
            (
                epoch,
                [b.round for b in batches],
                [r for b in batches for r in b.rows.tolist()],
                client.dropped_rows - dropped,
            )
        )
    return out


def read_as_ranks(url, job):
    """What each rank read (`read_epochs`), the ranks reading at the same time."""
    clients = [
        Client.from_dispatcher(
            url, "test", "py", job=job, consumers=RANKS, consumer_index=rank, coordinated=True, prefetch=2
        )
        for rank in range(RANKS)
    ]
    return read_together(clients, lambda rank, client: read_epochs(client, random.Random(rank)))


def test_coordinated_ranks_get_each_round_at_the_same_step(tmp_path, records_pipeline):
    with Local(tmp_path, records_pipeline) as local:
        got = within(120, read_as_ranks, local.address(), "coordinated")
    for (epoch, a, a_rows, a_dropped), (other, b, b_rows, b_dropped) in zip(*got):
        assert epoch == other
        assert len(a) == len(b), f"epoch {epoch}: {len(a)} and {len(b)} batches"
        rows = a_rows + b_rows
        assert len(rows) == len(set(rows)), f"epoch {epoch}: a row yielded twice"
        assert len(rows) + a_dropped + b_dropped == FILES * LINES, f"epoch {epoch}: {len(rows)} rows yielded"
        assert all(r is not None for r in a + b), f"epoch {epoch}: every batch names its round"
        workers = {worker for worker, _ in a + b}
        assert len(workers) == 2, f"epoch {epoch}: rounds of both workers: {workers}"
        aligned = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"epoch {epoch}: {aligned} of {len(a)} batches from the same round at both ranks")
        assert aligned >= len(a) - UNALIGNED, f"epoch {epoch}: only {aligned} of {len(a)} batches lined up:\n{a}\n{b}"
