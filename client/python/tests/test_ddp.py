"""DDP from one job against `stoker local`: two ranks (gloo on CPU, each its own process) train
through the dispatcher, and every step all-reduces the gradients, so a rank with a step more
than the other would hang. Each epoch the ranks take equal steps, no row comes twice, and the
rows yielded plus those the clients dropped (to keep the counts equal) are the corpus; also when
a worker dies in the middle of the first epoch, and when the ranks stop in the middle of an
epoch and resume from their saved states on another operator with another worker count.

Run as a script, this file is one rank (the tests start two)."""

import datetime
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import pipeline_file, worker_binary
from test_dispatcher import Local

WORLD = 2
EPOCHS = 2
# More images than the session's corpus: several splits for each of two workers, so the
# ranks receive unequal counts.
IMAGES = 96
# A rank waits this long in a collective before it fails (a rank with a step more hangs in
# one); the test waits this long for both ranks to finish.
COLLECTIVE_SECONDS = 30
RUN_SECONDS = 60
TWO_WORKERS = "  workers: {min: 2, max: 2}\n  autoscaling: {mode: Fixed, replicas: 2}\n"
ONE_WORKER = "  workers: {min: 1, max: 1}\n  autoscaling: {mode: Fixed, replicas: 1}\n"


def run_rank(rank: int, world: int, port: int, dispatcher: str, job: str, out: pathlib.Path, plan: dict) -> None:
    """Trains a linear model on the flattened images for EPOCHS passes (one epoch each); writes,
    per pass, the epochs its batches were of, its steps, the rows it yielded and the rows its
    client dropped. Touches `out`.started after its first step and `out`.first-epoch after its
    first pass. `plan`: "steps", the last pass stops after that many; "load" and "save", the
    path ({rank} filled in) of the dataset state loaded before the first pass, saved after the
    last; "checkpoint", the last pass saves the state and writes the record (the checkpoint)
    after "steps", then trains on and touches `out`.killable after two more steps, waiting to
    be killed."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from test_torch import RowsDataset

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_SECONDS),
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64 * 64 * 3, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # Rank and world size from torch.distributed: `world` consumers of the job.
    dataset = RowsDataset(dispatcher, "test", "py", job=job)
    if "load" in plan:
        dataset.load_state_dict(json.loads(pathlib.Path(plan["load"].format(rank=rank)).read_text()))
    loader = DataLoader(dataset, batch_size=None)
    record, dropped_before = [], 0
    for index in range(EPOCHS):
        epochs, steps, rows = set(), 0, []
        for batch in loader:
            loss = torch.nn.functional.cross_entropy(model(batch["image"].flatten(1)), batch["label"])
            optimizer.zero_grad()
            loss.backward()  # all-reduces the gradients with the other rank
            optimizer.step()
            steps += 1
            epochs.add(int(batch["epoch"]))
            rows.extend(batch["rows"].tolist())
            if index == 0 and steps == 1:
                pathlib.Path(f"{out}.started").touch()
            if index == EPOCHS - 1 and steps == plan.get("steps"):
                if not plan.get("checkpoint"):
                    break
                pathlib.Path(plan["save"].format(rank=rank)).write_text(json.dumps(dataset.state_dict()))
                out.write_text(
                    json.dumps(
                        record
                        + [
                            {
                                "epochs": sorted(epochs),
                                "steps": steps,
                                "rows": rows,
                                "dropped_rows": dataset.dropped_rows - dropped_before,
                            }
                        ]
                    )
                )
            if index == EPOCHS - 1 and steps == plan.get("steps", -3) + 2 and plan.get("checkpoint"):
                pathlib.Path(f"{out}.killable").touch()
                time.sleep(3600)
        record.append(
            {
                "epochs": sorted(epochs),
                "steps": steps,
                "rows": rows,
                "dropped_rows": dataset.dropped_rows - dropped_before,
            }
        )
        dropped_before = dataset.dropped_rows
        if index == 0:
            pathlib.Path(f"{out}.first-epoch").touch()
    if "save" in plan:
        pathlib.Path(plan["save"].format(rank=rank)).write_text(json.dumps(dataset.state_dict()))
    dataset.close()
    dist.destroy_process_group()
    out.write_text(json.dumps(record))


@pytest.fixture(scope="module")
def ddp_corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp-corpus")
    subprocess.run(
        [str(worker_binary()), "corpus", "--out", str(out), "--images", str(IMAGES), "--classes", "3"],
        check=True,
        capture_output=True,
    )
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """The `world` rank processes of one job, their output in `tmp_path`; `plan` as in
    `run_rank`."""

    def __init__(self, tmp_path: pathlib.Path, dispatcher: str, job: str, plan=None, world: int = WORLD):
        port = free_port()
        # The ranks import what this process imports (the tests' directory, this client).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.outs = [tmp_path / f"rank-{rank}.json" for rank in range(world)]
        self.logs = [tmp_path / f"rank-{rank}.log" for rank in range(world)]
        self.processes = []
        for rank in range(world):
            with open(self.logs[rank], "w") as log:
                self.processes.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            str(rank),
                            str(world),
                            str(port),
                            dispatcher,
                            job,
                            str(self.outs[rank]),
                            json.dumps(plan or {}),
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=pathlib.Path(__file__).parent,
                    )
                )
        self.deadline = time.monotonic() + RUN_SECONDS

    def output(self) -> str:
        return "\n".join(f"--- rank {rank}:\n{log.read_text()}" for rank, log in enumerate(self.logs))

    def wait_for(self, path: pathlib.Path) -> None:
        while not path.exists():
            if time.monotonic() > self.deadline or any(p.poll() is not None for p in self.processes):
                self.kill()
                pytest.fail(f"{path.name} never appeared\n{self.output()}")
            time.sleep(0.05)

    def records(self):
        """Each rank's record, once both finished; fails the test on a hang or a failed rank."""
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"the ranks did not finish within {RUN_SECONDS} s (unequal steps hang)\n{self.output()}")
        assert all(p.returncode == 0 for p in self.processes), self.output()
        return [json.loads(out.read_text()) for out in self.outs]

    def kill(self):
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def check(records):
    """Per epoch: both ranks read the same one, with equal steps; no row twice across the
    ranks; yielded rows plus dropped rows are the corpus."""
    first = records[0][0]["epochs"]
    assert len(first) == 1, records[0][0]["epochs"]
    check_steps(records, first[0])
    for index in range(EPOCHS):
        check_whole(f"epoch {index}", [r[index] for r in records])


def check_steps(records, first: int) -> None:
    """Each pass of a run: every rank read epoch `first` + its index, with equal steps."""
    for index in range(EPOCHS):
        epochs = [r[index] for r in records]
        assert all(e["epochs"] == [first + index] for e in epochs), [e["epochs"] for e in epochs]
        assert len({e["steps"] for e in epochs}) == 1, f"pass {index}: steps {[e['steps'] for e in epochs]}"


def check_whole(label: str, epochs) -> None:
    """`epochs`: the ranks' records of one epoch, of one run or of two (resumed): no row twice
    among them; yielded rows plus dropped rows are the corpus."""
    rows = [row for e in epochs for row in e["rows"]]
    assert len(rows) == len(set(rows)), f"{label}: a row yielded twice"
    dropped = sum(e["dropped_rows"] for e in epochs)
    assert len(rows) + dropped == IMAGES, f"{label}: {len(rows)} rows yielded, {dropped} dropped"


def check_resumed(first, second) -> None:
    """A run that read epoch 0 and 3 steps of epoch 1 (`first`), and one resumed from there
    (`second`) that read the rest of epoch 1 and epoch 2: equal steps in each, every row of
    each epoch once across both."""
    check_steps(first, 0)
    assert [r[1]["steps"] for r in first] == [3] * len(first)
    check_steps(second, 1)
    check_whole("epoch 0", [r[0] for r in first])
    check_whole("epoch 1", [r[1] for r in first] + [r[0] for r in second])
    check_whole("epoch 2", [r[1] for r in second])


def test_two_ranks_take_equal_steps_and_read_each_row_once(tmp_path, ddp_corpus):
    pipeline = pipeline_file(tmp_path, ddp_corpus, batch_size=4, extra=TWO_WORKERS)
    with Local(tmp_path, pipeline) as local:
        check(Ranks(tmp_path, local.address(), "ddp").records())


def worker_pids(parent: int):
    """The worker processes `stoker local` (pid `parent`) runs."""
    pids = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == parent and b"--dispatcher" in command:
            pids.append(int(stat.parent.name))
    return pids


def test_equal_steps_and_every_row_once_when_a_worker_dies_mid_epoch(tmp_path, ddp_corpus):
    pipeline = pipeline_file(tmp_path, ddp_corpus, batch_size=4, extra=TWO_WORKERS)
    # Slow workers: an epoch lasts seconds, so the kill lands in the middle of the first.
    with Local(tmp_path, pipeline, args=["--max-batch-rate", "4"]) as local:
        ranks = Ranks(tmp_path, local.address(), "ddp-kill")
        ranks.wait_for(pathlib.Path(f"{ranks.outs[0]}.started"))
        pids = worker_pids(local.process.pid)
        assert len(pids) == 2, pids
        os.kill(pids[0], signal.SIGKILL)
        assert not pathlib.Path(f"{ranks.outs[0]}.first-epoch").exists(), "the first epoch ended before the kill"
        check(ranks.records())


def test_ranks_killed_after_a_checkpoint_resume_from_it_on_the_same_operator(tmp_path, ddp_corpus):
    """A consumer killed: the ranks checkpoint at step 3 of epoch 1, train on two more steps
    (rows their saved states do not hold) and are killed with SIGKILL, saying nothing to the
    dispatcher; new ranks resume from the checkpoint on the same operator, whose workers still
    hold the killed run's batches. Epoch 1 across the checkpoint and the resumed run holds
    every row once: what the killed ranks read after the checkpoint is read again, as the
    training steps it fed are lost with them."""
    states = str(tmp_path / "state-{rank}.json")
    runs = [tmp_path / "killed", tmp_path / "resumed"]
    for run in runs:
        run.mkdir()
    with Local(tmp_path, pipeline_file(tmp_path, ddp_corpus, batch_size=4, extra=TWO_WORKERS)) as local:
        killed = Ranks(runs[0], local.address(), "ddp-killed", {"steps": 3, "save": states, "checkpoint": True})
        for out in killed.outs:
            killed.wait_for(pathlib.Path(f"{out}.killable"))
        for process in killed.processes:
            process.send_signal(signal.SIGKILL)
            process.wait()
        first = [json.loads(out.read_text()) for out in killed.outs]
        second = Ranks(runs[1], local.address(), "ddp-killed", {"load": states}).records()
    check_resumed(first, second)


def test_ranks_resume_mid_epoch_on_a_new_operator_with_another_worker_count(tmp_path, ddp_corpus):
    states = str(tmp_path / "state-{rank}.json")
    runs = [tmp_path / "first", tmp_path / "second"]
    for run in runs:
        run.mkdir()
    # Epoch 0 whole and 3 steps of epoch 1; the ranks save their states and exit, and the
    # operator (its dispatcher is in-process) stops.
    with Local(tmp_path, pipeline_file(tmp_path, ddp_corpus, batch_size=4, extra=TWO_WORKERS)) as local:
        first = Ranks(runs[0], local.address(), "ddp-resume", {"steps": 3, "save": states}).records()
    # Another operator with one worker: the ranks read the rest of epoch 1, then epoch 2.
    with Local(tmp_path, pipeline_file(tmp_path, ddp_corpus, batch_size=4, extra=ONE_WORKER)) as local:
        second = Ranks(runs[1], local.address(), "ddp-resume", {"load": states}).records()
    check_resumed(first, second)


@pytest.mark.parametrize("world", [3, 1])
def test_two_ranks_states_merged_resume_the_job_read_by_another_number_of_ranks(tmp_path, ddp_corpus, world):
    """Elastic resume: two ranks stop 3 steps into epoch 1 and save their states; the states
    merged into one (`merge_state_dicts`) resume the job read by `world` ranks, each loading
    it, on a new operator. Epoch 1 across both runs holds every row once, and the new ranks
    take equal steps."""
    from stoker_client.torch import StokerIterableDataset

    states = str(tmp_path / "state-{rank}.json")
    merged = tmp_path / "merged.json"
    runs = [tmp_path / "first", tmp_path / "second"]
    for run in runs:
        run.mkdir()
    with Local(tmp_path, pipeline_file(tmp_path, ddp_corpus, batch_size=4, extra=TWO_WORKERS)) as local:
        first = Ranks(runs[0], local.address(), "ddp-elastic", {"steps": 3, "save": states}).records()
    saved = [json.loads(pathlib.Path(states.format(rank=rank)).read_text()) for rank in range(WORLD)]
    merged.write_text(json.dumps(StokerIterableDataset.merge_state_dicts(saved)))
    with Local(tmp_path, pipeline_file(tmp_path, ddp_corpus, batch_size=4, extra=TWO_WORKERS)) as local:
        second = Ranks(runs[1], local.address(), "ddp-elastic", {"load": str(merged)}, world=world).records()
    check_resumed(first, second)


if __name__ == "__main__":
    rank_, world_, port_, dispatcher_, job_, out_, plan_ = sys.argv[1:]
    run_rank(int(rank_), int(world_), int(port_), dispatcher_, job_, pathlib.Path(out_), json.loads(plan_))
