"""PyTorch adaptor: an IterableDataset of dicts of tensors. Needs torch (`pip install torch`).

Use it with `DataLoader(dataset, batch_size=None)`: batches are already made by the workers.
With `num_workers > 0`, DataLoader would run one copy of the dataset per loader process; each
copy here connects as its own consumer (`consumer_index` + loader worker id) of the same job,
so together they share the job's stream instead of each receiving every batch. Tensors are
made with `torch.from_numpy` over the received bytes (no copy); they are read-only views, so
clone one before writing to it in place.
"""

try:
    import torch
    from torch.utils.data import IterableDataset, get_worker_info
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError("stoker_client.torch needs PyTorch: pip install torch") from e

import warnings

from .client import Client


class StokerIterableDataset(IterableDataset):
    def __init__(self, workers, namespace, pipeline, job="default", consumer_index=0, **client_options):
        super().__init__()
        self.workers = list(workers)
        self.namespace, self.pipeline, self.job = namespace, pipeline, job
        self.consumer_index = consumer_index
        self.client_options = client_options

    def __iter__(self):
        info = get_worker_info()
        index = self.consumer_index + (info.id if info is not None else 0)
        client = Client(self.workers, self.namespace, self.pipeline, job=self.job, consumer_index=index, **self.client_options)
        with client, warnings.catch_warnings():
            # from_numpy warns on read-only arrays; ours are views of received bytes.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for batch in client:
                yield {name: torch.from_numpy(array) for name, array in batch.items()}
