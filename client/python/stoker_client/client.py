"""The client: one stream per worker, each read by a thread into one bounded prefetch queue."""

import queue
import threading
import time
from typing import Iterable, List, Optional, Tuple

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


class _End:
    """A worker's stream ended."""


def _target(worker: str) -> str:
    return worker.split("://", 1)[1] if "://" in worker else worker


class Client:
    """Streams batches from one or more workers; iterate it for `Batch`es.

    >>> with Client(["127.0.0.1:50052"], "team-a", "imagenet") as client:
    ...     for batch in client:
    ...         images = batch["image"]   # numpy array, no copy
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
        self._streaming = set()
        # Workers a batch came from: the worker count reported to the autoscaler, since a
        # worker that just started is listed before it produces.
        self._delivering = set()
        # Dispatcher mode: (epoch, split)s whose last batch reached the caller, to report.
        self._completed = []
        for worker in workers:
            self._open(worker)

    def _open(self, worker: str) -> None:
        # Room for the chunk's own framing beyond the payload limit.
        options = [("grpc.max_receive_message_length", self._max_message_bytes + (1 << 20))]
        channel = grpc.insecure_channel(_target(worker), options=options)
        stream = channel.unary_stream(STREAM_METHOD, request_serializer=lambda r: r, response_deserializer=_wire.decode_chunk)
        call = stream(self._request, metadata=self._metadata)
        with self._lock:
            self._channels.append(channel)
            self._calls.append(call)
            self._streaming.add(worker)
        thread = threading.Thread(target=self._pump, args=(worker, call, self._max_batch_bytes), daemon=True, name=f"stoker-{worker}")
        thread.start()

    @classmethod
    def from_dispatcher(cls, url: str, namespace: str, pipeline: str, job: str = "default", consumer_index: int = 0,
                        connect_timeout: float = 10.0, **options) -> "Client":
        """Registers with the dispatcher at `url` (host:port), streams from the pipeline's
        workers as they come and go, and reports a batch-time window every second for the
        autoscaler. Raises `WorkerError` only if the dispatcher refuses or stays unreachable
        for `connect_timeout`; afterwards a worker that goes away is dropped quietly."""
        client = cls([], namespace, pipeline, job=job, consumer_index=consumer_index, _follow=True, **options)
        client._follower = Follower(_Followed(client), _target(url), namespace, pipeline, job, consumer_index,
                                    connect_timeout)
        return client

    def _put(self, item) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _pump(self, worker: str, call, max_batch_bytes: int) -> None:
        reassembler = Reassembler(max_batch_bytes)
        try:
            for chunk in call:
                batch = reassembler.push(chunk)
                if batch is None:
                    continue
                if batch.tensors:
                    self._delivering.add(worker)
                if not self._put(batch):
                    return
            reassembler.finish()
        except grpc.RpcError as e:
            if self._closed.is_set():
                return
            if self._follow and e.code() not in FATAL_CODES:
                # The dispatcher hands a lost worker's splits to the others.
                return
            self._put(WorkerError(worker, e.code(), e.details() or ""))
        except (ProtocolError, _wire.WireError) as e:
            call.cancel()
            self._put(ProtocolError(f"worker {worker}: {e}"))
        finally:
            with self._lock:
                self._streaming.discard(worker)
                self._delivering.discard(worker)
            if not self._follow:
                self._put(_End())

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
                with self._lock:
                    self._completed.extend((item.epoch, s) for s in item.completes)
            if not item.tensors:
                # Only completions (splits whose last elements were filtered or dropped as the
                # remainder): reported, not a batch the caller waited for.
                continue
            start, self._call_start = self._call_start, None
            self._meter.delivered(start, time.perf_counter())
            return item

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
    starts streams into the client and reports what the client measured and received."""

    def __init__(self, client: Client):
        self._client = client
        self.metadata = client._metadata

    def closed(self) -> bool:
        return self._client._closed.is_set()

    def wait_closed(self, timeout: float) -> bool:
        return self._client._closed.wait(timeout)

    def add_channel(self, channel: grpc.Channel) -> None:
        self._client._channels.append(channel)

    def add_call(self, call) -> None:
        self._client._calls.append(call)

    def stream_from(self, addresses: Iterable[str]) -> None:
        client = self._client
        with client._lock:
            new = [a for a in addresses if a not in client._streaming]
        for address in new:
            client._open(address)

    def take_report(self) -> Tuple[WindowStats, int, List[Tuple[int, int]]]:
        client = self._client
        window = client._meter.window()
        client._meter.reset()
        with client._lock:
            workers = len(client._delivering)
            completed, client._completed = client._completed, []
        return window, workers, completed

    def restore_completed(self, completed: List[Tuple[int, int]]) -> None:
        with self._client._lock:
            self._client._completed.extend(completed)
