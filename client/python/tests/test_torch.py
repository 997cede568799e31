"""The PyTorch adaptor, where torch is installed."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (it is not on this machine's package index); "
                                           "the adaptor is tested wherever `pip install torch` works")


def test_the_dataset_yields_dicts_of_tensors(two_workers):
    from torch.utils.data import DataLoader

    from stoker_client.torch import StokerIterableDataset

    loader = DataLoader(StokerIterableDataset(two_workers, "test", "py"), batch_size=None)
    batches = list(loader)
    assert sum(b["image"].shape[0] for b in batches) == 2 * 2 * 24
    assert batches[0]["image"].dtype == torch.float32 and batches[0]["label"].dtype == torch.int64
