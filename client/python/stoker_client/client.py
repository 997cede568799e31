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

from . import _malloc, _shared, _wire
from ._dispatcher import Follower
from ._following import EPOCH_END, Following, _Followed
from ._ration import Ration
from ._rejoin import Received
from ._tls import Tls
from ._token import TokenSource
from ._resume import Yielded
from ._resume import check as check_resume
from .batch import DEFAULT_MAX_BATCH_BYTES, Batch, Reassembler
from .errors import ProtocolError, TlsError, WorkerError
from .stats import Meter, WindowStats

STREAM_METHOD = "/stoker.v1alpha1.BatchStream/Stream"
# Codes after which a stream from a worker under the dispatcher is not retried but raised.
FATAL_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
               grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION)
MIN_MAX_MESSAGE_BYTES = 64 << 10
# What this client asks for. Larger messages save a copy only for batches that fit in one, and
# a message over 32 MiB (what glibc serves from its heap at most) is mmapped by grpc for each
# batch and page-faulted in: on 38 MB batches, 150 page faults and ~0.1 ms of CPU per image
# more than 16 MiB chunks copied into one array (docs/clients.md).
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
MAX_MAX_MESSAGE_BYTES = 256 << 20
# Under the dispatcher, how long a stream that failed waits before it is opened again.
REOPEN_PAUSE = 0.25


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
    """Where to connect for a worker: its key without the worker id (`WorkerList.keys`)."""
    worker = worker.split("#", 1)[0]
    return worker.split("://", 1)[1] if "://" in worker else worker


class Client(Following):
    """Streams batches from one or more workers; iterate it for `Batch`es.

    >>> with Client(["127.0.0.1:50052"], "team-a", "imagenet") as client:
    ...     for batch in client:
    ...         images = batch["image"]   # numpy array, no copy

    With a fixed list of workers, iteration ends when every worker's stream has ended.

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
    caller took all it received. A worker's stream that fails is opened again (it may be
    restarting; if it died, the dispatcher drops it from the list), except after an error no
    retry fixes (a refused request, a failed pipeline): that is raised once, and the epoch
    then ends without that worker's stream. A dispatcher that restarts (or a new leader's)
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
        _follow: bool = False,
        _prefetch_next_epoch: bool = True,
        _consumers: int = 0,
        _coordinated: bool = False,
        _resume: Optional[dict] = None,
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
        _malloc.tune()
        self._names = (namespace, pipeline, job, consumer_index)
        self._start_epoch = start_epoch
        self._token = TokenSource(token)
        # TLS: the CA (ca_file, else STOKER_CA_FILE) and, under the dispatcher, the name the
        # listed workers' certificates are for (None: a fixed list, each address's own rule).
        self._tls = Tls(ca_file, tls_server_name)
        self._tls_name: Optional[str] = None
        self._max_message_bytes, self._max_batch_bytes = max_message_bytes, max_batch_bytes
        # Where a worker on this host may put batches for us (see _shared); None: messages only.
        self._shared_memory = _shared.identity() if shared_memory else None
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
        # Dispatcher mode: the completions and rows that arrived of the job's unfinished
        # epochs, for a dispatcher that restarts, and the dispatchers whose batches are dropped.
        self._received = Received()
        # Dispatcher mode: the job's open epoch, as the dispatcher last said.
        self.open_epoch = 0
        # A job read by ranks (dispatcher mode, more than one consumer): each epoch's batches
        # as this rank may hand them out (the one read, the one read ahead, and the one read
        # last, until its final counts went to the dispatcher), and the dispatcher's latest
        # quota by epoch, for rations made after it came.
        self._consumers = _consumers
        # Coordinated mode: the workers deal this job's ranks in rounds.
        self._coordinated = _coordinated
        self._rations: Dict[int, Ration] = {}
        self._quotas: Dict[int, _wire.EpochQuota] = {}
        # Rows dropped to keep the ranks' counts equal, over all epochs.
        self.dropped_rows = 0
        # Dispatcher mode: the job streams go as (the job, or the run a resumed job goes on
        # as), the state reading resumes from, and what the caller has been handed of the
        # epoch it reads (for `state()`, from the first list on).
        self._stream_job = job
        self._resume = _resume
        self._yielded: Optional[Yielded] = None
        with self._lock:
            for worker in workers:
                self._start(worker, None)

    @classmethod
    def from_dispatcher(cls, url: str, namespace: str, pipeline: str, job: str = "default", consumer_index: int = 0,
                        connect_timeout: float = 10.0, prefetch_next_epoch: bool = True,
                        start_epoch: Optional[int] = None, consumers: int = 0, resume: Optional[dict] = None,
                        coordinated: bool = False, **options) -> "Client":
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
        batches first come, first served, in unequal counts.

        `coordinated` (with `consumers` > 1, every rank saying the same; ValueError otherwise):
        batch k of every rank of an epoch comes from the same round of the same worker
        (`Batch.round`), so batches the pipeline buckets by length line up across ranks (see
        the class). What comes after the order at an epoch's end, each worker's last, incomplete
        round and the rounds a killed worker sent to only some ranks, is yielded unaligned
        within the equal quota; so is an epoch being read across an operator restart (the
        order its ranks followed is gone). Every row once and equal counts per rank hold
        throughout.

        `resume`: a state `client.state()` gave, of this consumer of the job (ValueError
        otherwise). Every consumer of the job (all its ranks) resumes from the state it saved
        at the same step: the job goes on as a new run, on any dispatcher and with any number
        of workers, reading the rest of the state's epoch (without the rows any of them had
        yielded) and the epochs after it; it hands out nothing until every rank's state is in.
        `start_epoch` is then the state's epoch, and `state()` of that epoch covers both runs."""
        if consumers > 1 and not 0 <= consumer_index < consumers:
            raise ValueError(f"consumer_index {consumer_index} is outside {consumers} consumers")
        if coordinated and consumers < 2:
            raise ValueError("coordinated mode lines up the batches of a job's ranks: declare consumers (2 or more)")
        if resume is not None:
            check_resume(resume, job, consumers, consumer_index)
            if start_epoch not in (None, resume["epoch"]):
                raise ValueError(f"start_epoch {start_epoch} is not the resume state's epoch {resume['epoch']}")
            start_epoch = resume["epoch"]
        client = cls([], namespace, pipeline, job=job, consumer_index=consumer_index, start_epoch=start_epoch,
                     _follow=True, _prefetch_next_epoch=prefetch_next_epoch, _consumers=consumers,
                     _coordinated=coordinated, _resume=resume, **options)
        try:
            channel, target = client._tls.dispatcher_channel(url)
            Follower(_Followed(client), channel, target, namespace, pipeline, job,
                     consumer_index, connect_timeout, consumers=consumers, resume=resume, coordinated=coordinated)
        except BaseException:
            client.close()
            raise
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
            request = _wire.encode_stream_request(namespace, pipeline, self._stream_job, index, None,
                                                  self._max_message_bytes, epoch, self._consumers, self._coordinated,
                                                  self._shared_memory)
        else:
            request = _wire.encode_stream_request(namespace, pipeline, job, index, self._start_epoch,
                                                  self._max_message_bytes, shared_memory=self._shared_memory)
        # Room for the chunk's own framing beyond the payload limit.
        options = [("grpc.max_receive_message_length", self._max_message_bytes + (1 << 20))]
        channel, _ = self._tls.channel(worker.split("#", 1)[0], options, self._tls_name)
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
        reassembler = Reassembler(self._max_batch_bytes, self._shared_memory is not None)
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
            problem = self._tls.problem(e)
            if problem is not None:
                # The CA or the worker's certificate is wrong: no retry fixes it.
                self._fail(pump, TlsError(worker, problem))
                return "fatal"
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
        """Buffers a batch for the caller, waiting for room; whether the stream goes on. Under
        the dispatcher its rows and completions are recorded at the same time (its rows as held
        from the worker, and both for a rejoin), so that what is recorded is exactly what the
        caller gets; a batch of a dispatcher the client rejoined away from is dropped instead."""
        rows = _rows_by_split(batch) if self._follow else None
        with self._changed:
            buffer = self._wait_for_room(pump)
            if buffer is None:
                return False
            if self._follow:
                if self._received.dropped(batch.incarnation):
                    return True
                self._received.arrived(batch.epoch, batch.completes, rows)
            if rows:
                held = self._held.setdefault(pump.worker, {})
                for key, positions in rows.items():
                    held.setdefault(key, set()).update(positions)
            if batch.tensors:
                self._delivering.add(pump.worker)
                if self._consumers > 1:
                    self._ration(pump.epoch).arrived(batch.round)
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

    @property
    def _metadata(self):
        """Sent with every call (the bearer token, read again as the kubelet rotates it)."""
        return self._token.metadata()

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
        """The next batch the caller gets, or `EPOCH_END` when the epoch it read ended."""
        now = time.perf_counter()
        if self._call_start is None:
            self._meter.call_started(now)
            self._call_start = now
        while True:
            item = self._take()
            if item is EPOCH_END:
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
            if self._follow:
                with self._lock:
                    self._yielded.record(item.rows)
            self._last_epoch = item.epoch
            start, self._call_start = self._call_start, None
            self._meter.delivered(start, time.perf_counter())
            return item

    def _take(self):
        """The next buffered item, waiting for one; `EPOCH_END` (dispatcher mode) once the
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
                    item = self._take_current()
                    if item is not None:
                        return item
                self._changed.wait(1.0)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        """The next batch from any worker. An error ends that worker's stream only; it is
        raised here once, and the other workers keep delivering. Under the dispatcher, the
        end of an epoch just moves on to the next."""
        while True:
            item = self._next_item()
            if item is not EPOCH_END:
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
                if item is EPOCH_END:
                    # The time until the next epoch is asked for is not a batch's.
                    self._call_start = None
                    return
                yield item

        return batches()

    def state(self) -> dict:
        """Under the dispatcher, where this consumer is after the last batch returned: the
        epoch it reads, how many data batches of it the caller got and their rows by split,
        as a dict that survives JSON (see `_resume`). Every rank saves it at the same step;
        `from_dispatcher(resume=state)` goes on from there. Raises TypeError with a fixed
        list of workers (standalone workers know no job to resume)."""
        if not self._follow:
            raise TypeError("state needs the dispatcher")
        self._wait_for_list(None)
        _, _, job, index = self._names
        with self._lock:
            return self._yielded.state(job, self._consumers, index)

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

