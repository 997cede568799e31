"""PyTorch adaptor: an IterableDataset of dicts of tensors, read through the dispatcher, one
epoch per pass. Needs torch (`pip install torch`).

    dataset = StokerIterableDataset("stoker-dispatcher.stoker-system.svc:50051", "team-a", "imagenet-train")
    loader = DataLoader(dataset, batch_size=None)     # batches are already made by the workers
    for epoch in range(10):
        for batch in loader:                           # one epoch of the job
            images, labels = batch["image"], batch["label"]

Epochs: each `iter(dataset)` (each pass over the DataLoader) yields one epoch of the job
(`Client.iter_epoch`). The client is made on the first pass in a process and kept, so the next
pass reads the next epoch. A pass left early (`break`) leaves the rest of its epoch to the next
pass. Tensors are made with `torch.from_numpy` over the received bytes (no copy); they are
read-only views, so clone one before writing to it in place.

Ranks and loader processes: `rank` and `world_size` default to `torch.distributed`'s when it is
initialised, else 0 and 1. Each copy of the dataset (one per rank, and per DataLoader worker
process with `num_workers > 0`) connects as its own consumer of the job, consumer index
`rank * num_workers + loader worker id` of `world_size * num_workers`, so together they read
each epoch once instead of each reading all of it. With more than one consumer, each gets the
same number of batches per epoch (DDP's collectives would hang on a step only some ranks take):
the rows a consumer received beyond the count all could reach are dropped, and
`dataset.dropped_rows` counts those of this process's client (a loader process's are its own).

Coordinated mode (`coordinated=True`, every rank passing it; needs more than one consumer):
batch k of every consumer comes from the same round of the same worker, so batches the pipeline
buckets by length line up across ranks (see `Client.from_dispatcher`). With loader processes,
the DataLoader takes their batches round-robin, so step k of every rank is batch
k // num_workers of its loader process k % num_workers: still the same round at every rank. At
an epoch's end each worker's last, incomplete round (and what a killed worker sent only some
consumers) goes unaligned, as does an epoch read across an operator restart; every row once and
equal steps hold throughout.

Prefetching the next epoch: in the main process the next epoch streams in alongside the current
one (`prefetch_next_epoch=True`). In a DataLoader worker process the default is False: without
`persistent_workers=True` the process and its client are discarded after every epoch, and what
it had fetched of the next epoch would be discarded with it (the dispatcher then produces the
job's in-flight splits again, so rows may repeat). With `persistent_workers=True`, pass
`prefetch_next_epoch=True`.

Checkpoints: `state_dict()` is `{"epoch": the epoch the next pass reads, "job": job}`, and in
the middle of an epoch also `"resume"`: the client's state (`Client.state()`: the batches and
rows of the epoch handed out so far). `load_state_dict(state)` makes the next client go on from
there: with "resume", the rest of that epoch (every rank loads the state it saved at the same
step; the job goes on as a new run, with any number of workers, after an operator restart
too); without, the epoch, or the job's open epoch if the job is already past it. To resume with
another number of ranks (after a preemption onto other nodes), every new rank loads the one
state `StokerIterableDataset.merge_state_dicts` makes of every old rank's. With
`DataLoader(num_workers=0)` the main process reads, and its dataset holds the state. With loader
processes each one's dataset holds its own (it is its own consumer): torchdata's
`StatefulDataLoader` collects and restores them through these same two methods; the main
process's dataset sees no pass and says only what was loaded into it.
"""

try:
    import torch
    from torch.utils.data import IterableDataset, get_worker_info
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError("stoker_client.torch needs PyTorch: pip install torch") from e

import multiprocessing.util
import os
import warnings

import numpy as np

from ._core import merge_states
from .batch import Jagged
from .client import Client


def _tensor(array):
    # Text (object arrays of bytes) has no tensor form: it stays a numpy array.
    return array if array.dtype == object else torch.from_numpy(array)


def _tensors(batch, keyed_jagged=None):
    """The batch's tensors as torch tensors; a jagged field as the pair (values, lengths), or,
    with `keyed_jagged` a name, every jagged field in one `KeyedJaggedTensor` under it."""
    with warnings.catch_warnings():
        # from_numpy warns on read-only arrays; ours are views of received bytes.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        out = {}
        for name, t in batch.items():
            if isinstance(t, Jagged):
                if keyed_jagged is None:
                    out[name] = (_tensor(t.values), torch.from_numpy(t.lengths))
                continue
            out[name] = _tensor(t)
        if keyed_jagged is not None and any(isinstance(t, Jagged) for t in batch.tensors.values()):
            out[keyed_jagged] = keyed_jagged_tensor(batch)
        return out


def keyed_jagged_inputs(batch, keys=None):
    """(keys, values, lengths) of the batch's jagged fields (all, in name order, or `keys` in
    that order), as torchrec's `KeyedJaggedTensor` takes them: the values of the first key's
    rows, then the next key's; the lengths likewise (key-major). One copy of the values, which
    a `KeyedJaggedTensor` needs in one buffer."""
    if keys is None:
        keys = [name for name, t in batch.items() if isinstance(t, Jagged)]
    keys = list(keys)
    if not keys:
        raise ValueError("the batch has no jagged fields: list them in the pipeline's spec.jagged")
    fields = []
    for key in keys:
        t = batch[key]
        if not isinstance(t, Jagged):
            raise ValueError(f"field {key!r} is not jagged: list it in the pipeline's spec.jagged")
        fields.append(t)
    if len({t.values.dtype for t in fields}) != 1:
        raise ValueError(f"the jagged fields {keys} are of different types; cast them to one")
    return keys, np.concatenate([t.values for t in fields]), np.concatenate([t.lengths for t in fields])


def keyed_jagged_tensor(batch, keys=None):
    """The batch's jagged fields as one torchrec `KeyedJaggedTensor` (DLRM's sparse input);
    needs torchrec."""
    try:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError as e:
        raise ImportError("keyed_jagged_tensor needs torchrec: pip install torchrec") from e
    keys, values, lengths = keyed_jagged_inputs(batch, keys)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.from_numpy(values), lengths=torch.from_numpy(lengths)
    )


class StokerIterableDataset(IterableDataset):
    """One epoch of a job per pass, through the dispatcher at `dispatcher` (host:port).
    `coordinated`: coordinated mode, batch k of every rank from the same round (see the
    module; its consumers are `world_size * num_workers`). Jagged fields (the pipeline's
    `spec.jagged`) come as the pair `(values, lengths)`, or with `keyed_jagged` a name (DLRM's
    is `"sparse_features"`), all of them as one torchrec `KeyedJaggedTensor` under it (needs
    torchrec). `client_options` go to `Client.from_dispatcher` (prefetch, max_message_bytes,
    token, ...)."""

    def __init__(
        self,
        dispatcher,
        namespace,
        pipeline,
        job="default",
        rank=None,
        world_size=None,
        prefetch_next_epoch=None,
        coordinated=False,
        keyed_jagged=None,
        **client_options,
    ):
        super().__init__()
        if not isinstance(dispatcher, str):
            raise TypeError("StokerIterableDataset reads through the dispatcher: pass its address (host:port)")
        if rank is not None and world_size is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.dispatcher = dispatcher
        self.namespace, self.pipeline, self.job = namespace, pipeline, job
        self.rank, self.world_size = rank, world_size
        self.prefetch_next_epoch = prefetch_next_epoch
        self.coordinated = coordinated
        self.keyed_jagged = keyed_jagged
        self.client_options = client_options
        # Where the next client starts reading (load_state_dict): the epoch (None: the job's
        # open epoch), or mid-epoch, the client state to resume from (once).
        self._start_epoch = None
        self._resume = None
        # This process's client, made on the first pass.
        self._client = None
        self._pid = None

    def __getstate__(self):
        # Copies (DataLoader worker processes) make their own client.
        state = self.__dict__.copy()
        state["_client"] = state["_pid"] = None
        return state

    def _rank(self):
        """(rank, world size)."""
        rank, world_size = self.rank, self.world_size
        distributed = torch.distributed
        if (rank is None or world_size is None) and distributed.is_available() and distributed.is_initialized():
            rank = distributed.get_rank() if rank is None else rank
            world_size = distributed.get_world_size() if world_size is None else world_size
        return (0 if rank is None else rank), (1 if world_size is None else world_size)

    def client(self) -> Client:
        """This process's client, made on first use."""
        if self._client is not None and self._pid == os.getpid():
            return self._client
        info = get_worker_info()
        loaders, loader = (info.num_workers, info.id) if info is not None else (1, 0)
        rank, world_size = self._rank()
        prefetch = self.prefetch_next_epoch if self.prefetch_next_epoch is not None else info is None
        client = Client.from_dispatcher(
            self.dispatcher,
            self.namespace,
            self.pipeline,
            job=self.job,
            consumer_index=rank * loaders + loader,
            prefetch_next_epoch=prefetch,
            start_epoch=self._start_epoch,
            consumers=world_size * loaders,
            resume=self._resume,
            coordinated=self.coordinated,
            **self.client_options,
        )
        # The state is spent: a later client (after close()) reads the job as named, from its epoch.
        self._resume = None
        # Tell the dispatcher when the process ends (a loader process too: atexit does not run
        # there, multiprocessing's finalizers do), rather than leave it to time the client out.
        multiprocessing.util.Finalize(None, client.close, exitpriority=10)
        self._client, self._pid = client, os.getpid()
        return client

    def __iter__(self):
        for batch in self.client().iter_epoch():
            yield _tensors(batch, self.keyed_jagged)

    @property
    def dropped_rows(self):
        """Rows this process's client dropped to keep the consumers' batch counts equal."""
        if self._client is not None and self._pid == os.getpid():
            return self._client.dropped_rows
        return 0

    def state_dict(self):
        """{"epoch": the epoch this process's next pass reads (None: wherever the job is),
        "job": job}, with "resume": its client's state (JSON-serialisable) when the caller got
        batches of that epoch. Only the process that reads knows: with loader processes,
        torchdata's `StatefulDataLoader` calls this in each."""
        if self._client is not None and self._pid == os.getpid():
            state = {"epoch": self._client.epoch, "job": self.job}
            resume = self._client.state()
            if resume["batches"]:
                state["resume"] = resume
            return state
        state = {"epoch": self._start_epoch, "job": self.job}
        if self._resume is not None:
            state["resume"] = self._resume
        return state

    def load_state_dict(self, state):
        """The next client made (in this process, or in loader processes started afterwards)
        goes on from `state["resume"]` if there is one (the rest of its epoch; it must be this
        consumer's: the same rank of as many), else reads `state["epoch"]`, or the job's open
        epoch if the job is already past it."""
        if state.get("job", self.job) != self.job:
            raise ValueError(f"the state is of job {state['job']!r}, not {self.job!r}")
        self._start_epoch = state.get("epoch")
        self._resume = state.get("resume")
        if self._client is not None and self._pid == os.getpid():
            self._client.close()
        self._client = self._pid = None

    @staticmethod
    def merge_state_dicts(state_dicts):
        """One state from the `state_dict()`s every consumer of the job saved at the same step
        (every rank's; with loader processes every loader process's): loaded into every
        dataset of a job read by any number of ranks, it goes on from there (2 ranks' states
        resume 4 ranks, or 1). Raises ValueError unless they are of one job and one step."""
        state_dicts = list(state_dicts)
        if not state_dicts:
            raise ValueError("no states to merge")
        jobs = {state.get("job") for state in state_dicts}
        if len(jobs) != 1:
            raise ValueError(f"the states are of different jobs: {sorted(map(str, jobs))}")
        resumes = [state["resume"] for state in state_dicts if "resume" in state]
        if not resumes:
            epochs = {state.get("epoch") for state in state_dicts}
            if len(epochs) != 1:
                raise ValueError(f"the states are of different epochs: {sorted(map(str, epochs))}")
            return dict(state_dicts[0])
        if len(resumes) != len(state_dicts):
            raise ValueError("some states were saved in the middle of an epoch and some not: not one step")
        merged = merge_states(resumes)
        return {"epoch": merged["epoch"], "job": state_dicts[0].get("job"), "resume": merged}

    def close(self):
        """Closes this process's client (also done when the process ends)."""
        if self._client is not None and self._pid == os.getpid():
            self._client.close()
        self._client = self._pid = None
