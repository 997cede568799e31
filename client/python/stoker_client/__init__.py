"""Python client of Stoker: streams preprocessed batches from Stoker workers as numpy arrays.

The client is the Rust client (`stoker-client`) bound to Python (`stoker_client._core`);
this package adds Python's names, numpy arrays and the PyTorch adaptor.

    from stoker_client import Client
    with Client(["10.0.0.7:50052", "10.0.0.8:50052"], "team-a", "imagenet-train") as client:
        for batch in client:
            images, labels = batch["image"], batch["label"]   # numpy arrays, no copies
        print(client.window())

Under the dispatcher, epoch by epoch:

    client = Client.from_dispatcher("stoker-dispatcher.stoker-system.svc:50051", "team-a", "imagenet-train")
    for epoch in range(10):
        for batch in client.iter_epoch():   # the batches of `client.epoch`, each row once
            ...

With TLS, give the CA the dispatcher's and workers' certificates chain to (or set STOKER_CA_FILE):

    client = Client.from_dispatcher("https://stoker-dispatcher.stoker-system.svc:50051", "team-a",
                                    "imagenet-train", ca_file="/etc/stoker/ca.crt")

Resuming with another number of ranks (2 -> 4 GPUs after a preemption): every new rank passes
`resume=merge_states(states)`, the one state made of every old rank's `client.state()`.

A client works in the process that made it: a forked child (a DataLoader worker process) makes
its own, and one carried across a fork raises RuntimeError there.

PyTorch: `stoker_client.torch.StokerIterableDataset`.
"""

from ._core import merge_states
from .batch import Batch, Jagged
from .client import Client
from .errors import ProtocolError, StatusCode, TlsError, WorkerError
from .stats import WindowStats

__all__ = [
    "Batch",
    "Client",
    "Jagged",
    "ProtocolError",
    "StatusCode",
    "TlsError",
    "WindowStats",
    "WorkerError",
    "merge_states",
]
