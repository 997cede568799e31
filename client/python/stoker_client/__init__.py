"""Python client of Stoker: streams preprocessed batches from Stoker workers as numpy arrays.

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

PyTorch: `stoker_client.torch.StokerIterableDataset`.
"""

from .batch import Batch
from .client import Client
from .errors import ProtocolError, TlsError, WorkerError
from .stats import WindowStats

__all__ = ["Batch", "Client", "ProtocolError", "TlsError", "WindowStats", "WorkerError"]
