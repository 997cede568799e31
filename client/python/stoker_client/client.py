"""The client: a thin wrapper over the Rust client (`stoker_client._core`, built from
client/python/src), which streams from the workers, follows the dispatcher and keeps the
exactly-once accounting; here only Python's names and numpy arrays are made."""

from collections.abc import Iterable, Iterator
from typing import Optional

from . import _core, _malloc
from .batch import DEFAULT_MAX_BATCH_BYTES, Batch
from .stats import WindowStats

# What this client asks for. Larger messages save a copy only for batches that fit in one
# (docs/clients.md).
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20


class Client:
    """Streams batches from one or more workers; iterate it for `Batch`es.

    >>> with Client(["127.0.0.1:50052"], "team-a", "imagenet") as client:
    ...     for batch in client:
    ...         images = batch["image"]   # numpy array, no copy

    With a fixed list of workers, iteration ends when every worker's stream has ended; a worker
    that cannot be reached or refuses the request fails the constructor, so configuration
    mistakes surface there rather than mid-training.

    A worker on the same host, running as the same user, hands batches over through shared
    memory (`/dev/shm`): it writes each batch once to a file there and the client maps it,
    instead of the batch crossing a socket in messages. `shared_memory=False` asks for
    messages only; workers elsewhere always send messages.

    Under the dispatcher (`Client.from_dispatcher`) iteration never runs dry: it reads one
    epoch after the other. `client.epoch` is the epoch being read, and `client.iter_epoch()`
    iterates just its batches, stopping at its end (the next call iterates the next epoch).
    `open_epoch` is the job's open epoch as the dispatcher last said: every split of the
    epochs before it is done. Always 0 with a fixed list of workers. An epoch ends for the
    client once the job is past it, every listed worker's stream of it has ended and the
    caller took all it received. A worker's stream that breaks is opened again and goes on
    where it broke, nothing lost or repeated (the worker numbers the stream's batches and
    sends again what the broken connection took with it); if the worker died, the dispatcher
    drops it from the list and its splits go to the others. An error no retry fixes (a
    refused request, a broken protocol) is raised once, and the epoch then ends without that
    worker's stream. A dispatcher that restarts (or a new leader's)
    forgets the client: it rejoins as itself, telling the new one what it received of the job's
    unfinished epochs (taken by the caller or not), and from then on drops the batches of the
    dispatcher before, whose rows the new one has produced again: nothing is lost or repeated.

    A job read by ranks (`from_dispatcher(consumers=N)`, N > 1) hands every rank the same
    number of batches per epoch: a rank yields no more than the dispatcher's quota (the fewest
    any rank received), and once the quota is final drops what it received beyond it;
    `dropped_rows` counts the rows dropped so, over all epochs. A rank acknowledges a batch's
    completions as it arrives rather than when the caller takes it: the quota is final only
    once the epoch ended, which needs every rank's completions, including those of batches
    the quota holds back.

    Coordinated mode (`from_dispatcher(consumers=N, coordinated=True)`) lines the ranks' batches
    up as well: batch k of every rank comes from the same round of the same worker (each worker
    deals one batch per rank per round, `Batch.round`), so batches a pipeline buckets by length
    line up across ranks. A rank yields its batches in the order the dispatcher makes of the
    rounds every rank has received: it waits for a round of the order that has not arrived
    yet, and holds one that has arrived but is not in the order yet.

    Under the dispatcher `client.state()` says where the consumer is, after any batch: saved
    with a checkpoint, `from_dispatcher(resume=state)` goes on from there mid-epoch.
    """

    def __init__(
        self,
        workers: Iterable[str],
        namespace: str,
        pipeline: str,
        job: str = "default",
        consumer_index: int = 0,
        start_epoch: Optional[int] = None,
        prefetch: int = 8,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        token: Optional[str] = None,
        ca_file: Optional[str] = None,
        tls_server_name: Optional[str] = None,
        shared_memory: bool = True,
    ):
        workers = list(workers)
        if not workers:
            raise ValueError("no worker addresses given")
        self._start(
            namespace,
            pipeline,
            workers=workers,
            job=job,
            consumer_index=consumer_index,
            start_epoch=start_epoch,
            prefetch=prefetch,
            max_message_bytes=max_message_bytes,
            max_batch_bytes=max_batch_bytes,
            token=token,
            ca_file=ca_file,
            tls_server_name=tls_server_name,
            shared_memory=shared_memory,
        )

    def _start(self, namespace: str, pipeline: str, **options) -> None:
        _malloc.tune()
        for name, least in (
            ("prefetch", 1),
            ("start_epoch", 0),
            ("epochs", 1),
            ("consumer_index", 0),
            ("consumers", 0),
        ):
            if options.get(name) is not None and options[name] < least:
                raise ValueError(f"{name} must be at least {least}, not {options[name]}")
        self._core = _core.Client(namespace, pipeline, **options)
        # With a fixed list: the epoch of the last batch returned.
        self._last_epoch = options.get("start_epoch") or 0

    @classmethod
    def from_dispatcher(
        cls,
        url: str,
        namespace: str,
        pipeline: str,
        job: str = "default",
        consumer_index: int = 0,
        connect_timeout: float = 10.0,
        prefetch_next_epoch: bool = True,
        start_epoch: Optional[int] = None,
        epochs: Optional[int] = None,
        consumers: int = 0,
        resume: Optional[dict] = None,
        coordinated: bool = False,
        share: Optional[str] = None,
        **options,
    ) -> "Client":
        """Registers with the dispatcher at `url` (host:port, or https://host:port with a CA),
        streams from the pipeline's workers as they come and go, acknowledges what it received
        (every batch is delivered once, even when a worker dies mid-split or a connection
        breaks), and reports a batch-time window every second for the autoscaler. Raises
        `WorkerError` only if the dispatcher refuses, stays unreachable or sends no worker list
        within `connect_timeout`; afterwards a worker that goes away is dropped quietly.

        Reading starts at the job's open epoch, or at `start_epoch` if that is later (the
        epochs between are left to the job's other consumers). With `prefetch_next_epoch`
        each worker's next epoch streams alongside the current one (up to `prefetch` batches
        of it wait in the client); without, the next epoch's streams open once the caller
        asks for its first batch. `client.open_epoch` follows the job's open epoch.
        `epochs`: the epoch the job stops before (the training script's number of epochs):
        no stream opens for an epoch past its last, so no worker makes one nobody reads, and
        iterating the client ends after it (`iter_epoch()` past it yields nothing).

        `consumers` > 1: the job is read by that many ranks (e.g. a DDP job's processes, every
        one saying the same), `consumer_index` being this one's; each epoch every rank gets
        the same number of batches (see the class). 0 or 1: the job's consumers share its
        batches, first come, first served. `coordinated`: coordinated mode (see the class).

        `share`: a share group of the pipeline (e.g. a hyperparameter sweep's name): the jobs
        naming it take their splits from one production, each still getting every element of
        each of its epochs once, at its own pace (docs/reuse.md). Every consumer of the job
        names the same.

        `resume`: a state `client.state()` gave (saved with a checkpoint): the rest of its
        epoch, without what any rank had yielded, on any dispatcher and with any number of
        workers. `options` are the constructor's (prefetch, max_message_bytes, token,
        ca_file, tls_server_name, shared_memory, ...)."""
        client = cls.__new__(cls)
        client._start(
            namespace,
            pipeline,
            dispatcher=url,
            job=job,
            consumer_index=consumer_index,
            connect_timeout=connect_timeout,
            prefetch_next_epoch=prefetch_next_epoch,
            start_epoch=start_epoch,
            epochs=epochs,
            consumers=consumers,
            resume=resume,
            coordinated=coordinated,
            share=share,
            **options,
        )
        return client

    @property
    def epoch(self) -> int:
        """Under the dispatcher, the epoch being read (the next `iter_epoch()` iterates it).
        With a fixed list of workers, the epoch of the last batch returned (`start_epoch` or 0
        before the first): standalone workers may interleave epochs."""
        return self._core.epoch if self._core.dispatched else self._last_epoch

    @property
    def open_epoch(self) -> int:
        """Under the dispatcher, the job's open epoch: every split of the epochs before it is
        done. Always 0 with a fixed list of workers."""
        return self._core.open_epoch

    @property
    def dropped_rows(self) -> int:
        """Rows dropped to keep the ranks' counts equal, over all epochs."""
        return self._core.dropped_rows

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        """The next batch from any worker. An error ends that worker's stream only; it is
        raised here once, and the other workers keep delivering. Under the dispatcher, the
        end of an epoch just moves on to the next."""
        parts = self._core.next(False)
        if parts is None:
            raise StopIteration
        batch = Batch._from_core(parts)
        self._last_epoch = batch.epoch
        return batch

    def iter_epoch(self) -> Iterator[Batch]:
        """The batches of the epoch being read (`client.epoch`), stopping at its end; the next
        call iterates the next epoch. Needs the dispatcher (standalone workers interleave
        epochs): raises TypeError with a fixed list of workers."""
        if not self._core.dispatched:
            raise TypeError("iter_epoch needs the dispatcher")

        def batches():
            while True:
                parts = self._core.next(True)
                if parts is None:
                    return
                yield Batch._from_core(parts)

        return batches()

    def state(self) -> dict:
        """Under the dispatcher, where this consumer is after the last batch returned: the
        epoch it reads, how many data batches of it the caller got and their rows by split, as
        a dict that survives JSON: {"job", "epoch", "batches", "consumers", "consumer_index",
        "yielded": [[split, [positions, sorted]], ...]}. Every rank saves it at the same step;
        `from_dispatcher(resume=state)` goes on from there. Raises TypeError with a fixed list
        of workers (standalone workers know no job to resume)."""
        return self._core.state()

    def window(self) -> WindowStats:
        """Batch-time statistics since the last reset: batches, median, p90 (seconds), wait
        fraction. Under the dispatcher the window restarts after each report to it."""
        return WindowStats(*self._core.window())

    def reset_window(self) -> None:
        self._core.reset_window()

    def close(self) -> None:
        """Stops every stream. Under the dispatcher, tells it the client is leaving (with what
        is left to acknowledge, and whether batches were received that the caller never
        took), so that it stops waiting for this client at once."""
        self._core.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
