"""The PyTorch adaptor against `stoker local`: one epoch per pass, every image once per epoch,
also across loader processes."""

# `make python` installs torch: a missing torch is a setup error here, not a reason to skip.
import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

from stoker_client.torch import StokerIterableDataset

from conftest import images_in, pipeline_file, within
from test_dispatcher import Local


@pytest.fixture
def local(tmp_path, corpus):
    with Local(tmp_path, pipeline_file(tmp_path, corpus, batch_size=4)) as local:
        yield local


class RowsDataset(StokerIterableDataset):
    """Adds each batch's epoch, rows and loader process to its dict, to check them (across
    loader processes)."""

    def __iter__(self):
        info = get_worker_info()
        for batch in self.client().iter_epoch():
            out = {name: torch.from_numpy(array.copy()) for name, array in batch.items()}
            out["epoch"] = torch.tensor(batch.epoch)
            out["rows"] = torch.from_numpy(batch.rows.astype("int64"))
            out["loader"] = torch.tensor(info.id if info is not None else 0)
            yield out


def check_passes(passes, images):
    """Each pass one epoch, the next one each time, with every row of the corpus once; the
    epochs."""
    epochs = []
    for batches in passes:
        (epoch,) = {int(b["epoch"]) for b in batches}
        rows = [r for b in batches for r in b["rows"].tolist()]
        assert len(rows) == len(set(rows)) == images, f"epoch {epoch}: every row once"
        assert sum(b["label"].shape[0] for b in batches) == images
        epochs.append(epoch)
    assert epochs == list(range(epochs[0], epochs[0] + len(passes)))
    return epochs


def test_each_pass_is_one_epoch_with_every_image_once(local, corpus):
    images = images_in(corpus)
    dataset = StokerIterableDataset(local.address(), "test", "py")
    loader = DataLoader(dataset, batch_size=None)
    for _ in range(2):
        batches = within(90, list, loader)
        assert all(set(b) == {"image", "label"} for b in batches)
        assert batches[0]["image"].dtype == torch.float32 and batches[0]["label"].dtype == torch.int64
        assert sum(b["label"].shape[0] for b in batches) == images
    assert dataset.state_dict() == {"epoch": 2, "job": "default"}
    dataset.close()

    # The rows (the same dataset, adding them to the dicts), on another job of the pipeline.
    dataset = RowsDataset(local.address(), "test", "py", job="rows")
    loader = DataLoader(dataset, batch_size=None)
    epochs = check_passes([within(90, list, loader) for _ in range(2)], images)
    assert dataset.state_dict() == {"epoch": epochs[1] + 1, "job": "rows"}
    dataset.close()


def test_two_persistent_loader_processes_read_each_epoch_once_between_them(local, corpus):
    images = images_in(corpus)
    # Each loader process is its own consumer of the job (one of two: they get equal batch
    # counts); persistent, so it may prefetch.
    dataset = RowsDataset(local.address(), "test", "py", prefetch_next_epoch=True)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True)
    epochs = []
    for batches in [within(120, list, loader) for _ in range(2)]:
        (epoch,) = {int(b["epoch"]) for b in batches}
        loaders = [int(b["loader"]) for b in batches]
        assert loaders.count(0) == loaders.count(1), f"epoch {epoch}: equal counts"
        rows = [r for b in batches for r in b["rows"].tolist()]
        # What a process received beyond the other's count was dropped (in the process).
        assert len(rows) == len(set(rows)) <= images, f"epoch {epoch}: no row twice"
        epochs.append(epoch)
    assert epochs[1] == epochs[0] + 1
    del loader  # the loader processes end, and their clients leave the job


def test_a_checkpoint_resumes_at_the_next_epoch(local, corpus):
    images = images_in(corpus)
    # Not prefetching: the first client has nothing of the next epoch when it closes.
    dataset = RowsDataset(local.address(), "test", "py", job="resume", prefetch_next_epoch=False)
    (first,) = check_passes([within(90, list, DataLoader(dataset, batch_size=None))], images)
    state = dataset.state_dict()
    dataset.close()
    # A new process's dataset, from the checkpoint: the job is at the saved epoch.
    resumed = RowsDataset(local.address(), "test", "py", job="resume")
    resumed.load_state_dict(state)
    assert resumed.state_dict() == {"epoch": first + 1, "job": "resume"}
    (second,) = check_passes([within(90, list, DataLoader(resumed, batch_size=None))], images)
    assert second == first + 1
    resumed.close()


def test_the_dataset_refuses_a_list_of_workers():
    with pytest.raises(TypeError, match="dispatcher"):
        StokerIterableDataset(["127.0.0.1:50052"], "test", "py")
    with pytest.raises(ValueError, match="rank 2"):
        StokerIterableDataset("127.0.0.1:50051", "test", "py", rank=2, world_size=2)


class Recorded:
    """Stands in for `Client.from_dispatcher`: records its arguments, serves no epoch."""

    def __init__(self):
        self.calls = []

    def __call__(self, url, namespace, pipeline, **options):
        self.calls.append(options)
        return self

    def iter_epoch(self):
        return iter(())

    def close(self):
        pass


def test_the_consumer_index_and_prefetching_default_from_rank_and_process(monkeypatch):
    import stoker_client.torch as adaptor

    recorded = Recorded()
    monkeypatch.setattr(adaptor.Client, "from_dispatcher", recorded)
    list(StokerIterableDataset("d:1", "test", "py"))
    list(StokerIterableDataset("d:1", "test", "py", rank=3, prefetch=2))
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 5)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 8)
    dataset = StokerIterableDataset("d:1", "test", "py")
    list(dataset), list(dataset)
    # A loader process: rank * loader processes + its id, no prefetching of the next epoch.
    monkeypatch.setattr(adaptor, "get_worker_info", lambda: type("Info", (), {"num_workers": 4, "id": 1})())
    list(StokerIterableDataset("d:1", "test", "py"))
    calls = [(c["consumer_index"], c["consumers"], c["prefetch_next_epoch"]) for c in recorded.calls]
    # Of world size * loader processes consumers: ranks read equal counts.
    assert calls == [(0, 1, True), (3, 1, True), (5, 8, True), (21, 32, False)], "one client per dataset and process"
    assert recorded.calls[1]["prefetch"] == 2 and recorded.calls[0]["start_epoch"] is None


def test_coordinated_mode_goes_to_the_client(monkeypatch):
    import stoker_client.torch as adaptor

    recorded = Recorded()
    monkeypatch.setattr(adaptor.Client, "from_dispatcher", recorded)
    list(StokerIterableDataset("d:1", "test", "py", rank=1, world_size=2, coordinated=True))
    list(StokerIterableDataset("d:1", "test", "py", rank=1, world_size=2))
    assert [(c["consumers"], c["coordinated"]) for c in recorded.calls] == [(2, True), (2, False)]


def test_a_loaded_mid_epoch_state_goes_to_the_next_client_only(monkeypatch):
    import stoker_client.torch as adaptor

    recorded = Recorded()
    monkeypatch.setattr(adaptor.Client, "from_dispatcher", recorded)
    resume = {"job": "j", "epoch": 4, "batches": 3, "consumers": 1, "consumer_index": 0, "yielded": [[2, [0, 1]]]}
    dataset = StokerIterableDataset("d:1", "test", "py", job="j")
    dataset.load_state_dict({"epoch": 4, "job": "j", "resume": resume})
    # Before a client reads, the state is what was loaded.
    assert dataset.state_dict() == {"epoch": 4, "job": "j", "resume": resume}
    list(dataset)
    dataset.close()
    list(dataset)
    assert [(c["start_epoch"], c["resume"]) for c in recorded.calls] == [(4, resume), (4, None)]
