"""The client: one stream per worker, each read by a thread into one bounded prefetch queue."""

import queue
import threading
import time
from typing import Dict, Iterable, List, Optional, Set, Tuple

import grpc

from . import _wire
from ._dispatcher import Follower
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
# How long dropping a worker the dispatcher no longer lists waits for its stream's thread.
STOP_TIMEOUT = 10.0


class _End:
    """A worker's stream ended."""


class _Pump:
    """A stream from a worker and the thread reading it into the queue."""

    __slots__ = ("channel", "call", "thread", "stop")

    def __init__(self, channel, call):
        self.channel, self.call, self.thread = channel, call, None
        # Set when the worker is dropped: what the thread has not queued yet is discarded.
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

    Under the dispatcher (`Client.from_dispatcher`), `open_epoch` is the job's open epoch as
    the dispatcher last said: every split of the epochs before it is done. Informational; 0
    until the dispatcher says, and always 0 with a fixed list of workers.
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
    ):
        workers = list(workers)
        if not workers and not _follow:
            raise ValueError("no worker addresses given")
        if prefetch < 1:
            raise ValueError("prefetch must be at least 1")
        if not MIN_MAX_MESSAGE_BYTES <= max_message_bytes <= MAX_MAX_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes {max_message_bytes} is outside [{MIN_MAX_MESSAGE_BYTES}, {MAX_MAX_MESSAGE_BYTES}]")
        self._request = _wire.encode_stream_request(namespace, pipeline, job, consumer_index, start_epoch, max_message_bytes)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._max_message_bytes, self._max_batch_bytes = max_message_bytes, max_batch_bytes
        self._queue: "queue.Queue" = queue.Queue(maxsize=prefetch)
        self._meter = Meter()
        self._call_start: Optional[float] = None
        # Under the dispatcher the set of workers changes and iteration never runs dry.
        self._follow = _follow
        self._live = len(workers)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._channels: List[grpc.Channel] = []
        self._calls = []
        self._pumps: Dict[str, _Pump] = {}
        # Workers a batch came from: the worker count reported to the autoscaler, since a
        # worker that just started is listed before it produces.
        self._delivering = set()
        # Dispatcher mode: (epoch, split)s whose last batch reached the caller, to acknowledge,
        # and wakes the acknowledging thread.
        self._completed: List[Tuple[int, int]] = []
        self._wake = threading.Event()
        # Dispatcher mode: positions of the rows each worker delivered (queued for the caller)
        # by (epoch, split), for unfinished splits: if the worker leaves the list, the
        # dispatcher has them skipped when it hands the split out again.
        self._held: Dict[str, Dict[Tuple[int, int], Set[int]]] = {}
        # Dispatcher mode: the job's open epoch, as the dispatcher last said.
        self.open_epoch = 0
        for worker in workers:
            self._open(worker)

    def _connect(self, worker: str):
        """(channel, call) of a stream from `worker`."""
        # Room for the chunk's own framing beyond the payload limit.
        options = [("grpc.max_receive_message_length", self._max_message_bytes + (1 << 20))]
        channel = grpc.insecure_channel(_target(worker), options=options)
        stream = channel.unary_stream(STREAM_METHOD, request_serializer=lambda r: r, response_deserializer=_wire.decode_chunk)
        return channel, stream(self._request, metadata=self._metadata)

    def _open(self, worker: str) -> None:
        pump = _Pump(*self._connect(worker))
        pump.thread = threading.Thread(target=self._pump, args=(worker, pump), daemon=True, name=f"stoker-{worker}")
        with self._lock:
            self._channels.append(pump.channel)
            self._calls.append(pump.call)
            self._pumps[worker] = pump
        pump.thread.start()

    @classmethod
    def from_dispatcher(cls, url: str, namespace: str, pipeline: str, job: str = "default", consumer_index: int = 0,
                        connect_timeout: float = 10.0, **options) -> "Client":
        """Registers with the dispatcher at `url` (host:port), streams from the pipeline's
        workers as they come and go, acknowledges what it received (every batch is delivered
        once, even when a worker dies mid-split), and reports a batch-time window every second
        for the autoscaler. Raises `WorkerError` only if the dispatcher refuses or stays
        unreachable for `connect_timeout`; afterwards a worker that goes away is dropped quietly.
        `client.open_epoch` follows the job's open epoch."""
        client = cls([], namespace, pipeline, job=job, consumer_index=consumer_index, _follow=True, **options)
        target = _target(url)
        client._follower = Follower(_Followed(client), grpc.insecure_channel(target), target, namespace, pipeline, job,
                                    consumer_index, connect_timeout)
        return client

    def _put(self, item, stop: threading.Event) -> bool:
        while not self._closed.is_set() and not stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _deliver(self, worker: str, batch: Batch, stop: threading.Event) -> bool:
        """Queues a batch. Under the dispatcher its rows are recorded as held from `worker`
        first, and forgotten again if it was not queued (closed, or the worker dropped), so
        that what is recorded is exactly what the caller gets."""
        if not self._follow:
            return self._put(batch, stop)
        rows = _rows_by_split(batch)
        with self._lock:
            held = self._held.setdefault(worker, {})
            for key, positions in rows.items():
                held.setdefault(key, set()).update(positions)
        if self._put(batch, stop):
            return True
        with self._lock:
            held = self._held.get(worker, {})
            for key, positions in rows.items():
                held.get(key, set()).difference_update(positions)
        return False

    def _pump(self, worker: str, pump: _Pump) -> None:
        reassembler = Reassembler(self._max_batch_bytes)
        try:
            for chunk in pump.call:
                batch = reassembler.push(chunk)
                if batch is None:
                    continue
                if batch.tensors:
                    self._delivering.add(worker)
                if not self._deliver(worker, batch, pump.stop):
                    return
            reassembler.finish()
        except grpc.RpcError as e:
            if self._closed.is_set() or pump.stop.is_set():
                return
            if self._follow and e.code() not in FATAL_CODES:
                # The dispatcher hands a lost worker's splits to the others.
                return
            self._put(WorkerError(worker, e.code(), e.details() or ""), pump.stop)
        except (ProtocolError, _wire.WireError) as e:
            pump.call.cancel()
            self._put(ProtocolError(f"worker {worker}: {e}"), pump.stop)
        finally:
            with self._lock:
                if self._pumps.get(worker) is pump:
                    del self._pumps[worker]
                self._delivering.discard(worker)
            if not self._follow:
                self._put(_End(), pump.stop)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        """The next batch from any worker. An error ends that worker's stream only; it is
        raised here once, and the other workers keep delivering."""
        now = time.perf_counter()
        if self._call_start is None:
            self._meter.call_started(now)
            self._call_start = now
        while True:
            if self._live == 0 and not self._follow:
                self._call_start = None
                raise StopIteration
            item = self._queue.get()
            if isinstance(item, _End):
                self._live -= 1
                continue
            if isinstance(item, Exception):
                self._call_start = None
                raise item
            if self._follow and item.completes:
                self._complete([(item.epoch, s) for s in item.completes])
            if not item.tensors:
                # Only completions (splits whose last elements were filtered or dropped as the
                # remainder): acknowledged, not a batch the caller waited for.
                continue
            start, self._call_start = self._call_start, None
            self._meter.delivered(start, time.perf_counter())
            return item

    def _complete(self, done: List[Tuple[int, int]]) -> None:
        """The caller took the last batch of these (epoch, split)s: acknowledged as done, and
        their rows are no longer held from any worker."""
        with self._lock:
            self._completed.extend(done)
            for held in self._held.values():
                for key in done:
                    held.pop(key, None)
        self._wake.set()

    def window(self) -> WindowStats:
        """Batch-time statistics since the last reset: batches, median, p90 (seconds), wait fraction."""
        return self._meter.window()

    def reset_window(self) -> None:
        self._meter.reset()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            calls, channels = list(self._calls), list(self._channels)
        for call in calls:
            call.cancel()
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
        self._client._channels.append(channel)

    def add_call(self, call) -> None:
        self._client._calls.append(call)

    def follow(self, addresses: Iterable[str]) -> List[_wire.Held]:
        client = self._client
        listed = dict.fromkeys(addresses)
        with client._lock:
            gone = [pump for worker, pump in client._pumps.items() if worker not in listed]
        for pump in gone:
            pump.stop.set()
            pump.call.cancel()
        # Once its thread is out, everything a dropped worker queued is recorded.
        deadline = time.monotonic() + STOP_TIMEOUT
        for pump in gone:
            pump.thread.join(max(0.0, deadline - time.monotonic()))
            pump.channel.close()
        held = []
        with client._lock:
            new = [a for a in listed if a not in client._pumps]
            # Including workers whose stream had already ended on its own.
            for worker in [w for w in client._held if w not in listed]:
                for (epoch, split), positions in sorted(client._held.pop(worker).items()):
                    if positions:
                        held.append(_wire.Held(epoch, split, sorted(positions)))
        for address in new:
            client._open(address)
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
        self._client.open_epoch = epoch
