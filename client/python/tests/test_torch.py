"""The PyTorch adaptor, where torch is installed."""

# `make python` installs torch: a missing torch is a setup error here, not a reason to skip.
import torch


def test_the_dataset_yields_dicts_of_tensors(two_workers):
    from torch.utils.data import DataLoader

    from stoker_client.torch import StokerIterableDataset

    loader = DataLoader(StokerIterableDataset(two_workers, "test", "py"), batch_size=None)
    batches = list(loader)
    assert sum(b["image"].shape[0] for b in batches) == 2 * 2 * 24
    assert batches[0]["image"].dtype == torch.float32 and batches[0]["label"].dtype == torch.int64


def test_loader_processes_share_the_stream_as_consumers_of_one_job(two_workers):
    from torch.utils.data import DataLoader

    from stoker_client.torch import StokerIterableDataset

    # Two loader processes, each its own consumer: every batch reaches exactly one of them.
    loader = DataLoader(StokerIterableDataset(two_workers, "test", "py"), batch_size=None, num_workers=2)
    batches = list(loader)
    assert sum(b["label"].shape[0] for b in batches) == 2 * 2 * 24
    assert all(b["image"].shape[1:] == batches[0]["image"].shape[1:] for b in batches)
