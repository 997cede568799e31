"""The client: one stream per worker, each read by a thread into one bounded prefetch queue."""

import queue
import threading
import time
from typing import Iterable, List, Optional

import grpc

from . import _wire
from .batch import DEFAULT_MAX_BATCH_BYTES, Batch, ProtocolError, Reassembler
from .stats import Meter, WindowStats

STREAM_METHOD = "/stoker.v1alpha1.BatchStream/Stream"
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
MIN_MAX_MESSAGE_BYTES = 64 << 10
MAX_MAX_MESSAGE_BYTES = 256 << 20


class WorkerError(Exception):
    """A worker answered with a gRPC error (or could not be reached)."""

    def __init__(self, worker: str, code: grpc.StatusCode, details: str):
        super().__init__(f"worker {worker}: {code.name}: {details}")
        self.worker, self.code, self.details = worker, code, details


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
    ):
        workers = list(workers)
        if not workers:
            raise ValueError("no worker addresses given")
        if prefetch < 1:
            raise ValueError("prefetch must be at least 1")
        if not MIN_MAX_MESSAGE_BYTES <= max_message_bytes <= MAX_MAX_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes {max_message_bytes} is outside [{MIN_MAX_MESSAGE_BYTES}, {MAX_MAX_MESSAGE_BYTES}]")
        request = _wire.encode_stream_request(namespace, pipeline, job, consumer_index, start_epoch, max_message_bytes)
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._queue: "queue.Queue" = queue.Queue(maxsize=prefetch)
        self._meter = Meter()
        self._call_start: Optional[float] = None
        self._live = len(workers)
        self._closed = threading.Event()
        self._channels: List[grpc.Channel] = []
        self._calls = []
        for worker in workers:
            # Room for the chunk's own framing beyond the payload limit.
            options = [("grpc.max_receive_message_length", max_message_bytes + (1 << 20))]
            channel = grpc.insecure_channel(_target(worker), options=options)
            stream = channel.unary_stream(STREAM_METHOD, request_serializer=lambda r: r, response_deserializer=_wire.decode_chunk)
            call = stream(request, metadata=metadata)
            self._channels.append(channel)
            self._calls.append(call)
            thread = threading.Thread(target=self._pump, args=(worker, call, max_batch_bytes), daemon=True, name=f"stoker-{worker}")
            thread.start()

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
                if batch is not None and not self._put(batch):
                    return
            reassembler.finish()
        except grpc.RpcError as e:
            if not self._closed.is_set():
                self._put(WorkerError(worker, e.code(), e.details() or ""))
        except (ProtocolError, _wire.WireError) as e:
            call.cancel()
            self._put(ProtocolError(f"worker {worker}: {e}"))
        finally:
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
            if self._live == 0:
                self._call_start = None
                raise StopIteration
            item = self._queue.get()
            if isinstance(item, _End):
                self._live -= 1
                continue
            start, self._call_start = self._call_start, None
            if isinstance(item, Exception):
                raise item
            self._meter.delivered(start, time.perf_counter())
            return item

    def window(self) -> WindowStats:
        """Batch-time statistics since the last reset: batches, median, p90 (seconds), wait fraction."""
        return self._meter.window()

    def reset_window(self) -> None:
        self._meter.reset()

    def close(self) -> None:
        self._closed.set()
        for call in self._calls:
            call.cancel()
        for channel in self._channels:
            channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
