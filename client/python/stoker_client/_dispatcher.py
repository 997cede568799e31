"""Dispatcher mode: register as a consumer, follow the worker list, report windows."""

import threading
import time
from typing import Iterable, List, Optional, Protocol, Tuple

import grpc

from . import _wire
from .errors import WorkerError
from .stats import WindowStats

DISPATCHER = "/stoker.v1alpha1.Dispatcher/"
RETRY = 0.25
RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND)


class Followed(Protocol):
    """What the follower needs from the client it streams into and reports for."""

    metadata: Optional[Tuple[Tuple[str, str], ...]]
    """Sent with every call to the dispatcher (the bearer token)."""

    def closed(self) -> bool: ...

    def wait_closed(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for the client to close; whether it has."""

    def add_channel(self, channel: grpc.Channel) -> None:
        """Closed when the client closes."""

    def add_call(self, call) -> None:
        """Cancelled when the client closes."""

    def stream_from(self, addresses: Iterable[str]) -> None:
        """Opens a stream to each worker listed that the client does not stream from yet."""

    def take_report(self) -> Tuple[WindowStats, int, List[Tuple[int, int]]]:
        """The batch-time window (restarting it), how many workers delivered, and the
        (epoch, split)s completed since the last take."""

    def restore_completed(self, completed: List[Tuple[int, int]]) -> None:
        """Completions a failed report carried: they go with the next one."""


class Follower:
    def __init__(self, client: Followed, target, namespace, pipeline, job, consumer_index, connect_timeout):
        self.client = client
        self.channel = grpc.insecure_channel(target)
        unary = lambda name, decode: self.channel.unary_unary(
            DISPATCHER + name, request_serializer=lambda r: r, response_deserializer=decode)
        self.register_rpc = unary("RegisterClient", _wire.decode_register_client)
        self.report_rpc = unary("ReportWindow", lambda m: m)
        self.watch_rpc = self.channel.unary_stream(DISPATCHER + "WatchWorkers",
                                                   request_serializer=lambda r: r, response_deserializer=_wire.decode_worker_list)
        self.args = (namespace, pipeline, job, consumer_index)
        self.client_id, self.window = "", 1.0
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                self.register()
                break
            except grpc.RpcError as e:
                if e.code() not in RETRIED or time.monotonic() > deadline:
                    raise WorkerError(target, e.code(), e.details() or "") from None
                time.sleep(RETRY)
        client.add_channel(self.channel)
        threading.Thread(target=self.watch, daemon=True, name="stoker-watch").start()
        threading.Thread(target=self.report, daemon=True, name="stoker-report").start()

    def register(self):
        namespace, pipeline, job, index = self.args
        self.client_id, window_ms = self.register_rpc(
            _wire.encode_register_client(namespace, pipeline, job, index, self.client_id), metadata=self.client.metadata)
        if window_ms:
            self.window = window_ms / 1000.0

    def watch(self):
        namespace, pipeline, _, _ = self.args
        while not self.client.closed():
            try:
                call = self.watch_rpc(_wire.encode_watch_workers(namespace, pipeline), metadata=self.client.metadata)
                self.client.add_call(call)
                for addresses in call:
                    self.client.stream_from(addresses)
            except grpc.RpcError:
                pass
            time.sleep(RETRY)  # the dispatcher went away (leader change): watch again

    def report(self):
        while not self.client.wait_closed(self.window):
            # Completed: splits whose last batch arrived; the dispatcher marks them done.
            w, workers, completed = self.client.take_report()
            mean = w.total_batch_time / w.batches if w.batches else 0.0
            sent = False
            for _ in range(2):
                try:
                    self.report_rpc(_wire.encode_report_window(self.client_id, w.batches, w.median, w.p90, w.wait_fraction,
                                                               workers, mean, completed), metadata=self.client.metadata)
                    sent = True
                    break
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.NOT_FOUND:
                        try:
                            self.register()  # the dispatcher restarted: same id again
                        except grpc.RpcError:
                            break
                    else:
                        break
            if not sent:
                self.client.restore_completed(completed)
