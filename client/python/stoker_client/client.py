"""The client: streams from workers, each read by a thread into a bounded prefetch buffer.

With a fixed list of workers (standalone workers), one stream per worker carries every epoch
into one buffer. Under the dispatcher, each worker streams each epoch separately: a stream for
the epoch the caller reads and, when prefetching, one for the next, each into that epoch's own
buffer, so that the next epoch filling up never holds the current one back."""

import collections
import threading
import time
from typing import Deque, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import grpc

from . import _wire
from ._dispatcher import Follower
from ._ration import Ration, Step, rows_in
from .batch import DEFAULT_MAX_BATCH_BYTES, Batch, Reassembler
from .errors import ProtocolError, WorkerError
from .stats import Meter, WindowStats

STREAM_METHOD = "/stoker.v1alpha1.BatchStream/Stream"
# Codes after which a stream from a worker under the dispatcher is not retried but raised.
FATAL_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
               grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION)
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
MIN_MAX_MESSAGE_BYTES = 64 << 10
MAX_MAX_MESSAGE_BYTES = 256 << 20
# How long dropping a worker the dispatcher no longer lists waits for its streams' threads.
STOP_TIMEOUT = 10.0
# Under the dispatcher, how long a stream that failed waits before it is opened again.
REOPEN_PAUSE = 0.25

# What the caller's next item is when the epoch it read ended (dispatcher mode).
_EPOCH_END = object()


class _Pump:
    """A worker's stream (of one epoch, under the dispatcher) and the thread reading it."""

    __slots__ = ("worker", "epoch", "channel", "call", "thread", "stop")

    def __init__(self, worker: str, epoch: Optional[int]):
        self.worker, self.epoch = worker, epoch
        self.channel = self.call = self.thread = None
        # Set when the worker is dropped or the client closes: what the thread has not
        # buffered yet is discarded, and the stream is not opened again.
        self.stop = threading.Event()


def _rows_by_split(batch: Batch) -> Dict[Tuple[int, int], List[int]]:
    """The positions of a batch's rows by (epoch, split)."""
    out: Dict[Tuple[int, int], List[int]] = {}
    for row in batch.rows.tolist():
        out.setdefault((batch.epoch, row >> 32), []).append(row & 0xFFFFFFFF)
    return out


def _target(worker: str) -> str:
    return worker.split("://", 1)[1] if "://" in worker else worker


class Client:
    """Streams batches from one or more workers; iterate it for `Batch`es.

    >>> with Client(["127.0.0.1:50052"], "team-a", "imagenet") as client:
    ...     for batch in client:
    ...         images = batch["image"]   # numpy array, no copy

    With a fixed list of workers, iteration ends when every worker's stream has ended.

    Under the dispatcher (`Client.from_dispatcher`) iteration never runs dry: it reads one
    epoch after the other. `client.epoch` is the epoch being read, and `client.iter_epoch()`
    iterates just its batches, stopping at its end (the next call iterates the next epoch).
    `open_epoch` is the job's open epoch as the dispatcher last said: every split of the
    epochs before it is done. Always 0 with a fixed list of workers. An epoch ends for the
    client once the job is past it, every listed worker's stream of it has ended and the
    caller took all it received. A worker's stream that fails is opened again (it may be
    restarting; if it died, the dispatcher drops it from the list), except after an error no
    retry fixes (a refused request, a failed pipeline): that is raised once, and the epoch
    then ends without that worker's stream.

    A job read by ranks (`from_dispatcher(consumers=N)`, N > 1) hands every rank the same
    number of batches per epoch: a rank yields no more than the dispatcher's quota (the fewest
    any rank received), and once the quota is final drops what it received beyond it;
    `dropped_rows` counts the rows dropped so, over all epochs. A rank acknowledges a batch's
    completions as it arrives rather than when the caller takes it: the quota is final only
    once the epoch ended, which needs every rank's completions, including those of batches
    the quota holds back.
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
        max_message_bytes: int = 64 << 20,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        token: Optional[str] = None,
        _follow: bool = False,
        _prefetch_next_epoch: bool = True,
        _consumers: int = 0,
    ):
        workers = list(workers)
        if not workers and not _follow:
            raise ValueError("no worker addresses given")
        if prefetch < 1:
            raise ValueError("prefetch must be at least 1")
        if not MIN_MAX_MESSAGE_BYTES <= max_message_bytes <= MAX_MAX_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes {max_message_bytes} is outside [{MIN_MAX_MESSAGE_BYTES}, {MAX_MAX_MESSAGE_BYTES}]")
        if start_epoch is not None and start_epoch < 0:
            raise ValueError("start_epoch must not be negative")
        self._names = (namespace, pipeline, job, consumer_index)
        self._start_epoch = start_epoch
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._max_message_bytes, self._max_batch_bytes = max_message_bytes, max_batch_bytes
        self._prefetch = prefetch
        self._meter = Meter()
        self._call_start: Optional[float] = None
        # Under the dispatcher the set of workers changes and iteration never runs dry.
        self._follow = _follow
        self._prefetch_next_epoch = _prefetch_next_epoch
        self._closed = threading.Event()
        self._lock = threading.Lock()
        # Signalled whenever a buffer, a stream or an epoch changes.
        self._changed = threading.Condition(self._lock)
        # Channels and calls that close() closes besides the streams' (the dispatcher's).
        self._channels: List[grpc.Channel] = []
        self._calls = []
        # Live streams by (worker, epoch); the epoch is None with a fixed list of workers.
        self._pumps: Dict[Tuple[str, Optional[int]], _Pump] = {}
        # Received batches (and errors, with a fixed list) not yet taken by the caller, by the
        # epoch of the stream they came in (None with a fixed list).
        self._buffers: Dict[Optional[int], Deque] = {}
        # Fixed list: streams not ended yet.
        self._live = len(workers)
        self._last_epoch = start_epoch or 0
        # Dispatcher mode: the workers listed, the epoch the caller reads (None until the
        # first list), the last epoch streams may be open for, the workers whose stream of an
        # epoch is over (ended normally, or failed with a fatal code), errors to raise.
        self._listed: Dict[str, None] = {}
        self._current: Optional[int] = None
        self._open_through = -1
        self._finished: Dict[int, Set[str]] = {}
        self._errors: Deque[Exception] = collections.deque()
        # Dispatcher mode: called by close() with whether batches were discarded.
        self._on_close = None
        # Workers a batch came from: the worker count reported to the autoscaler, since a
        # worker that just started is listed before it produces.
        self._delivering = set()
        # Dispatcher mode: (epoch, split)s whose last batch reached the caller, to acknowledge,
        # and wakes the acknowledging thread.
        self._completed: List[Tuple[int, int]] = []
        self._wake = threading.Event()
        # Dispatcher mode: positions of the rows each worker delivered (buffered for the
        # caller) by (epoch, split), for unfinished splits: if the worker leaves the list, the
        # dispatcher has them skipped when it hands the split out again.
        self._held: Dict[str, Dict[Tuple[int, int], Set[int]]] = {}
        # Dispatcher mode: the job's open epoch, as the dispatcher last said.
        self.open_epoch = 0
        # A job read by ranks (dispatcher mode, more than one consumer): each epoch's batches
        # as this rank may hand them out (the one read, the one read ahead, and the one read
        # last, until its final counts went to the dispatcher), and the dispatcher's latest
        # quota by epoch, for rations made after it came.
        self._consumers = _consumers
        self._rations: Dict[int, Ration] = {}
        self._quotas: Dict[int, _wire.EpochQuota] = {}
        # Rows dropped to keep the ranks' counts equal, over all epochs.
        self.dropped_rows = 0
        with self._lock:
            for worker in workers:
                self._start(worker, None)

    @classmethod
    def from_dispatcher(cls, url: str, namespace: str, pipeline: str, job: str = "default", consumer_index: int = 0,
                        connect_timeout: float = 10.0, prefetch_next_epoch: bool = True,
                        start_epoch: Optional[int] = None, consumers: int = 0, **options) -> "Client":
        """Registers with the dispatcher at `url` (host:port), streams from the pipeline's
        workers as they come and go, acknowledges what it received (every batch is delivered
        once, even when a worker dies mid-split), and reports a batch-time window every second
        for the autoscaler. Raises `WorkerError` only if the dispatcher refuses, stays
        unreachable or sends no worker list within `connect_timeout`; afterwards a worker that
        goes away is dropped quietly.

        Reading starts at the job's open epoch, or at `start_epoch` if that is later (the
        epochs between are left to the job's other consumers). With `prefetch_next_epoch`
        each worker's next epoch streams alongside the current one (up to `prefetch` batches
        of it wait in the client); without, the next epoch's streams open once the caller
        asks for its first batch. `client.open_epoch` follows the job's open epoch.

        `consumers` > 1: the job is read by that many ranks (e.g. a DDP job's processes, every
        one saying the same), `consumer_index` being this one's; each epoch every rank gets
        the same number of batches (see the class). 0 or 1: the job's consumers share its
        batches first come, first served, in unequal counts."""
        if consumers > 1 and not 0 <= consumer_index < consumers:
            raise ValueError(f"consumer_index {consumer_index} is outside {consumers} consumers")
        client = cls([], namespace, pipeline, job=job, consumer_index=consumer_index, start_epoch=start_epoch,
                     _follow=True, _prefetch_next_epoch=prefetch_next_epoch, _consumers=consumers, **options)
        target = _target(url)
        Follower(_Followed(client), grpc.insecure_channel(target), target, namespace, pipeline, job,
                 consumer_index, connect_timeout, consumers=consumers)
        if not client._wait_for_list(connect_timeout):
            client.close()
            raise WorkerError(target, grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"no worker list from the dispatcher within {connect_timeout} s")
        return client

    def _wait_for_list(self, timeout: Optional[float]) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._current is not None or self._closed.is_set(), timeout) \
                and self._current is not None

    # Streams.

    def _connect(self, worker: str, epoch: Optional[int]):
        """(channel, call) of a stream from `worker` (of `epoch`, under the dispatcher)."""
        namespace, pipeline, job, index = self._names
        if self._follow:
            request = _wire.encode_stream_request(namespace, pipeline, job, index, None, self._max_message_bytes, epoch,
                                                  self._consumers)
        else:
            request = _wire.encode_stream_request(namespace, pipeline, job, index, self._start_epoch,
                                                  self._max_message_bytes)
        # Room for the chunk's own framing beyond the payload limit.
        options = [("grpc.max_receive_message_length", self._max_message_bytes + (1 << 20))]
        channel = grpc.insecure_channel(_target(worker), options=options)
        stream = channel.unary_stream(STREAM_METHOD, request_serializer=lambda r: r, response_deserializer=_wire.decode_chunk)
        return channel, stream(request, metadata=self._metadata)

    def _start(self, worker: str, epoch: Optional[int]) -> None:
        """Opens a stream and starts its thread. Called with the lock held."""
        pump = _Pump(worker, epoch)
        pump.channel, pump.call = self._connect(worker, epoch)
        pump.thread = threading.Thread(target=self._run, args=(pump,), daemon=True,
                                       name=f"stoker-{worker}" + ("" if epoch is None else f"-e{epoch}"))
        self._pumps[(worker, epoch)] = pump
        pump.thread.start()

    def _ensure_streams(self) -> None:
        """Under the dispatcher, starts the streams missing for the epochs being read: every
        listed worker's, unless its stream of that epoch is over. Called with the lock held."""
        if not self._follow or self._current is None or self._closed.is_set():
            return
        for epoch in range(self._current, self._open_through + 1):
            finished = self._finished.get(epoch, ())
            for worker in self._listed:
                if (worker, epoch) not in self._pumps and worker not in finished:
                    self._start(worker, epoch)

    def _run(self, pump: _Pump) -> None:
        """A stream's thread: reads it into its buffer; under the dispatcher, opens it again
        after a failure that is not fatal (the worker still has batches of the epoch)."""
        outcome = "stopped"
        try:
            while True:
                try:
                    outcome = self._read(pump)
                finally:
                    pump.channel.close()
                if outcome != "retry" or pump.stop.wait(REOPEN_PAUSE):
                    break
                with self._lock:
                    if self._closed.is_set() or pump.stop.is_set():
                        outcome = "stopped"
                        break
                    pump.channel, pump.call = self._connect(pump.worker, pump.epoch)
        finally:
            with self._changed:
                if self._pumps.get((pump.worker, pump.epoch)) is pump:
                    del self._pumps[(pump.worker, pump.epoch)]
                if self._follow:
                    if outcome in ("ended", "fatal"):
                        self._finished.setdefault(pump.epoch, set()).add(pump.worker)
                        self._progressed()
                    if not any(w == pump.worker for w, _ in self._pumps):
                        self._delivering.discard(pump.worker)
                    # A worker dropped and listed again before this thread was out.
                    self._ensure_streams()
                else:
                    self._live -= 1
                    self._delivering.discard(pump.worker)
                self._changed.notify_all()

    def _read(self, pump: _Pump) -> str:
        """Reads a stream to its end: "ended" (normally), "retry" (failed, may be opened
        again), "fatal" (failed, the error goes to the caller) or "stopped"."""
        reassembler = Reassembler(self._max_batch_bytes)
        worker = pump.worker
        try:
            for chunk in pump.call:
                batch = reassembler.push(chunk)
                if batch is not None and not self._deliver(pump, batch):
                    return "stopped"
            reassembler.finish()
            return "ended"
        except grpc.RpcError as e:
            if self._closed.is_set() or pump.stop.is_set():
                return "stopped"
            if self._follow and e.code() not in FATAL_CODES:
                # The worker may be restarting; if it died, the dispatcher drops it from the list.
                return "retry"
            self._fail(pump, WorkerError(worker, e.code(), e.details() or ""))
            return "fatal"
        except (ProtocolError, _wire.WireError) as e:
            pump.call.cancel()
            self._fail(pump, ProtocolError(f"worker {worker}: {e}"))
            # Under the dispatcher the stream's epoch still needs the rest of its batches.
            return "retry" if self._follow else "fatal"

    def _wait_for_room(self, pump: _Pump) -> Optional[Deque]:
        """The buffer of the pump's epoch once it has room, or None if the pump must stop.
        Called with the lock held."""
        while True:
            if self._closed.is_set() or pump.stop.is_set():
                return None
            buffer = self._buffers.setdefault(pump.epoch, collections.deque())
            if len(buffer) < self._prefetch:
                return buffer
            self._changed.wait(0.5)

    def _deliver(self, pump: _Pump, batch: Batch) -> bool:
        """Buffers a batch for the caller, waiting for room; whether it was. Under the
        dispatcher its rows are recorded as held from the worker at the same time, so that
        what is recorded is exactly what the caller gets."""
        rows = _rows_by_split(batch) if self._follow else None
        with self._changed:
            buffer = self._wait_for_room(pump)
            if buffer is None:
                return False
            if rows:
                held = self._held.setdefault(pump.worker, {})
                for key, positions in rows.items():
                    held.setdefault(key, set()).update(positions)
            if batch.tensors:
                self._delivering.add(pump.worker)
                if self._consumers > 1:
                    self._ration(pump.epoch).received += 1
                    self._progressed()
            buffer.append(batch)
            self._changed.notify_all()
        return True

    def _fail(self, pump: _Pump, error: Exception) -> None:
        """Hands a stream's error to the caller: with a fixed list in order with the batches,
        under the dispatcher ahead of them."""
        with self._changed:
            if self._follow:
                self._errors.append(error)
            else:
                buffer = self._wait_for_room(pump)
                if buffer is None:
                    return
                buffer.append(error)
            self._changed.notify_all()

    # Epochs (dispatcher mode).

    def _ended(self, epoch: int) -> bool:
        """Whether no more of `epoch` comes: the job is past it and every listed worker's
        stream of it is over (a worker's that left the list was cut). Called with the lock held."""
        if self.open_epoch <= epoch:
            return False
        finished = self._finished.get(epoch, ())
        return all(worker in finished for worker in self._listed)

    def _over(self, epoch: int) -> bool:
        """Whether this client has everything of `epoch`: it `_ended` and the caller took all
        it buffered. Called with the lock held."""
        return self._ended(epoch) and not self._buffers.get(epoch)

    def _advance(self) -> None:
        """The current epoch is over: read the next. Called with the lock held."""
        done = self._current
        self._buffers.pop(done, None)
        self._finished.pop(done, None)
        # The epoch just read stays until the next advance: its final counts still go to the
        # dispatcher with the next acknowledgements.
        for epoch in [e for e in self._rations if e < done]:
            del self._rations[epoch]
        for epoch in [e for e in self._quotas if e < done]:
            del self._quotas[epoch]
        self._current = done + 1
        if self._prefetch_next_epoch:
            self._open_through = max(self._open_through, self._current + 1)
        self._ensure_streams()
        self._changed.notify_all()

    @property
    def epoch(self) -> int:
        """Under the dispatcher, the epoch being read (the next `iter_epoch()` iterates it).
        With a fixed list of workers, the epoch of the last batch returned (`start_epoch` or 0
        before the first): standalone workers may interleave epochs."""
        if not self._follow:
            return self._last_epoch
        self._wait_for_list(None)
        return self._current if self._current is not None else 0

    def _next_item(self):
        """The next batch the caller gets, or `_EPOCH_END` when the epoch it read ended."""
        now = time.perf_counter()
        if self._call_start is None:
            self._meter.call_started(now)
            self._call_start = now
        while True:
            item = self._take()
            if item is _EPOCH_END:
                return item
            if isinstance(item, Exception):
                self._call_start = None
                raise item
            if self._follow and self._consumers <= 1 and item.completes:
                # A rank acknowledged them as the batch arrived (`_take_rationed`).
                self._complete([(item.epoch, s) for s in item.completes])
            if not item.tensors:
                # Only completions (splits whose last elements were filtered or dropped as the
                # remainder): acknowledged, not a batch the caller waited for.
                continue
            self._last_epoch = item.epoch
            start, self._call_start = self._call_start, None
            self._meter.delivered(start, time.perf_counter())
            return item

    def _take(self):
        """The next buffered item, waiting for one; `_EPOCH_END` (dispatcher mode) once the
        current epoch is over. Raises StopIteration when there is nothing more."""
        with self._changed:
            while True:
                if self._closed.is_set():
                    self._call_start = None
                    raise StopIteration
                if not self._follow:
                    buffer = self._buffers.get(None)
                    if buffer:
                        item = buffer.popleft()
                        self._changed.notify_all()
                        return item
                    if self._live == 0:
                        self._call_start = None
                        raise StopIteration
                elif self._errors:
                    return self._errors.popleft()
                elif self._current is not None:
                    if self._open_through < self._current:
                        # Without prefetching, an epoch's streams open when it is asked for.
                        self._open_through = self._current
                        self._ensure_streams()
                    if self._consumers > 1:
                        item = self._take_rationed(self._current)
                        if item is not None:
                            return item
                    else:
                        buffer = self._buffers.get(self._current)
                        if buffer:
                            item = buffer.popleft()
                            self._changed.notify_all()
                            return item
                        if self._over(self._current):
                            self._advance()
                            return _EPOCH_END
                self._changed.wait(1.0)

    # A job read by ranks.

    def _ration(self, epoch: int) -> Ration:
        """The epoch's ration, made with the latest quota on first use. Called with the lock held."""
        ration = self._rations.get(epoch)
        if ration is None:
            ration = self._rations[epoch] = Ration()
            quota = self._quotas.get(epoch)
            if quota is not None:
                ration.set_quota(quota.batches, quota.complete)
        return ration

    def _take_rationed(self, epoch: int):
        """The next item of `epoch` the caller may take (a data batch within the quota, or
        completions only), `_EPOCH_END` once the epoch is over, or None to wait. Meanwhile
        moves what arrived into the epoch's FIFO, so that the streams keep flowing while the
        quota holds the caller back, acknowledging the completions of what it moves (the
        epoch, and so the final quota, waits for them), and drops what is beyond the final
        quota. Called with the lock held."""
        ration = self._ration(epoch)
        buffer = self._buffers.get(epoch)
        while True:
            step, batch = ration.step()
            if step is Step.YIELD or step is Step.PASS:
                return batch
            if step is Step.DROP:
                self.dropped_rows += rows_in(batch)
                self._progressed()
            elif step is Step.DONE:
                self._advance()
                return _EPOCH_END
            elif buffer:
                batch = buffer.popleft()
                ration.push(batch)
                self._record_completed([(batch.epoch, s) for s in batch.completes])
                self._changed.notify_all()
            elif not ration.ended and self._ended(epoch):
                ration.end()
                self._progressed()
            else:
                return None

    def _progressed(self) -> None:
        """For a job read by ranks, what this rank received (or dropped) may have changed:
        the follower tells the dispatcher. Called with the lock held."""
        if self._consumers > 1:
            self._wake.set()

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        """The next batch from any worker. An error ends that worker's stream only; it is
        raised here once, and the other workers keep delivering. Under the dispatcher, the
        end of an epoch just moves on to the next."""
        while True:
            item = self._next_item()
            if item is not _EPOCH_END:
                return item

    def iter_epoch(self) -> Iterator[Batch]:
        """The batches of the epoch being read (`client.epoch`), stopping at its end; the next
        call iterates the next epoch. Needs the dispatcher (standalone workers interleave
        epochs): raises TypeError with a fixed list of workers."""
        if not self._follow:
            raise TypeError("iter_epoch needs the dispatcher")

        def batches():
            while True:
                try:
                    item = self._next_item()
                except StopIteration:  # closed (a generator must not let it through)
                    return
                if item is _EPOCH_END:
                    # The time until the next epoch is asked for is not a batch's.
                    self._call_start = None
                    return
                yield item

        return batches()

    def _complete(self, done: List[Tuple[int, int]]) -> None:
        """The caller took the last batch of these (epoch, split)s."""
        with self._lock:
            self._record_completed(done)

    def _record_completed(self, done: List[Tuple[int, int]]) -> None:
        """These (epoch, split)s' last batches were taken (or, for a job read by ranks,
        arrived): acknowledged as done, and their rows are no longer held from any worker.
        Called with the lock held. A rank keeps holding them until the epoch is finished: the
        split is done only once every rank acknowledged it, and if its worker dies before, it
        is produced again without the rows any rank holds."""
        if not done:
            return
        self._completed.extend(done)
        if self._consumers <= 1:
            for held in self._held.values():
                for key in done:
                    held.pop(key, None)
        self._wake.set()

    def _saw_open_epoch(self, epoch: int) -> None:
        """The job's open epoch is `epoch` (or later already). For a job read by ranks, the
        rows held of the epochs before it go: all their splits are done. Called with the lock held."""
        if epoch <= self.open_epoch:
            return
        self.open_epoch = epoch
        if self._consumers > 1:
            for held in self._held.values():
                for key in [k for k in held if k[0] < epoch]:
                    del held[key]
            self._progressed()
        self._changed.notify_all()

    def window(self) -> WindowStats:
        """Batch-time statistics since the last reset: batches, median, p90 (seconds), wait fraction."""
        return self._meter.window()

    def reset_window(self) -> None:
        self._meter.reset()

    def close(self) -> None:
        """Stops every stream. Under the dispatcher, tells it the client is leaving (with
        what is left to acknowledge, and whether batches were received that the caller never
        took), so that it stops waiting for this client at once."""
        with self._changed:
            if self._closed.is_set():
                return
            self._closed.set()
            pumps = list(self._pumps.values())
            # Batches the caller never got, or streams cut with batches maybe on the way.
            discarded = any(self._buffers.values()) or any(r.held for r in self._rations.values()) or bool(pumps)
            for pump in pumps:
                pump.stop.set()
                if pump.call is not None:
                    pump.call.cancel()
            calls, channels = list(self._calls), list(self._channels)
            self._changed.notify_all()
        for call in calls:
            call.cancel()
        if self._on_close is not None:
            self._on_close(discarded)
        for pump in pumps:
            if pump.channel is not None:
                pump.channel.close()
        for channel in channels:
            channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Followed:
    """The client as its dispatcher follower sees it (`_dispatcher.Followed`): the follower
    starts and stops streams into the client and reports what the client measured and received."""

    def __init__(self, client: Client):
        self._client = client
        self.metadata = client._metadata
        self.wake = client._wake

    def closed(self) -> bool:
        return self._client._closed.is_set()

    def wait_closed(self, timeout: float) -> bool:
        return self._client._closed.wait(timeout)

    def add_channel(self, channel: grpc.Channel) -> None:
        with self._client._lock:
            self._client._channels.append(channel)

    def add_call(self, call) -> None:
        with self._client._lock:
            self._client._calls.append(call)

    def on_close(self, leave) -> None:
        self._client._on_close = leave

    def follow(self, addresses: Iterable[str], epoch: int) -> List[_wire.Held]:
        client = self._client
        listed = dict.fromkeys(addresses)
        with client._changed:
            client._listed = listed
            gone = [pump for (worker, _), pump in client._pumps.items() if worker not in listed]
            for pump in gone:
                pump.stop.set()
                if pump.call is not None:
                    pump.call.cancel()
            client._changed.notify_all()
        # Once their threads are out, everything a dropped worker buffered is recorded.
        deadline = time.monotonic() + STOP_TIMEOUT
        for pump in gone:
            pump.thread.join(max(0.0, deadline - time.monotonic()))
        held = []
        with client._changed:
            # Including workers whose streams had already ended on their own.
            for worker in [w for w in client._held if w not in listed]:
                for (e, split), positions in sorted(client._held.pop(worker).items()):
                    if positions:
                        held.append(_wire.Held(e, split, sorted(positions)))
            for worker in [w for w in client._delivering if w not in listed]:
                client._delivering.discard(worker)
            client._saw_open_epoch(epoch)
            if client._current is None:
                # The first list: reading starts at the job's open epoch.
                client._current = max(epoch, client._start_epoch or 0)
                client._open_through = client._current + (1 if client._prefetch_next_epoch else 0)
            client._ensure_streams()
            client._changed.notify_all()
        return held

    def take_report(self) -> Tuple[WindowStats, int]:
        client = self._client
        window = client._meter.window()
        client._meter.reset()
        with client._lock:
            workers = len(client._delivering)
        return window, workers

    def take_completed(self) -> List[Tuple[int, int]]:
        client = self._client
        with client._lock:
            completed, client._completed = client._completed, []
        return completed

    def restore_completed(self, completed: List[Tuple[int, int]]) -> None:
        with self._client._lock:
            self._client._completed.extend(completed)

    def saw_epoch(self, epoch: int) -> None:
        client = self._client
        with client._changed:
            client._saw_open_epoch(epoch)

    def set_quotas(self, quotas: List[_wire.EpochQuota]) -> None:
        client = self._client
        if client._consumers <= 1 or not quotas:
            return
        with client._changed:
            for quota in quotas:
                client._quotas[quota.epoch] = quota
                ration = client._rations.get(quota.epoch)
                if ration is not None:
                    ration.set_quota(quota.batches, quota.complete)
            client._changed.notify_all()

    def rank_progress(self) -> List[_wire.RankProgress]:
        client = self._client
        if client._consumers <= 1:
            return []
        with client._lock:
            if client._current is None:
                return []
            current = client._current
            epochs = sorted({e for e in client._rations if e < current} | set(range(current, client._open_through + 1)))
            progress = []
            for epoch in epochs:
                ration = client._rations.get(epoch)
                received, dropped = (ration.received, ration.dropped_rows) if ration is not None else (0, 0)
                # An epoch before the one read is over.
                progress.append(_wire.RankProgress(epoch, received, epoch < current or client._ended(epoch), dropped))
            return progress
