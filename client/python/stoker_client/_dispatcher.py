"""Dispatcher mode: register as a consumer, follow the worker list, report windows."""

import threading
import time

import grpc

from . import _wire

RETRY = 0.25
RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND)


class Follower:
    def __init__(self, client, target, namespace, pipeline, job, consumer_index, connect_timeout):
        from .client import WorkerError
        self.client = client
        self.channel = grpc.insecure_channel(target)
        unary = lambda name, decode: self.channel.unary_unary(
            "/stoker.v1alpha1.Dispatcher/" + name, request_serializer=lambda r: r, response_deserializer=decode)
        self.register_rpc = unary("RegisterClient", _wire.decode_register_client)
        self.report_rpc = unary("ReportWindow", lambda m: m)
        self.watch_rpc = self.channel.unary_stream("/stoker.v1alpha1.Dispatcher/WatchWorkers",
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
        client._channels.append(self.channel)
        threading.Thread(target=self.watch, daemon=True, name="stoker-watch").start()
        threading.Thread(target=self.report, daemon=True, name="stoker-report").start()

    def register(self):
        namespace, pipeline, job, index = self.args
        self.client_id, window_ms = self.register_rpc(
            _wire.encode_register_client(namespace, pipeline, job, index, self.client_id), metadata=self.client._metadata)
        if window_ms:
            self.window = window_ms / 1000.0

    def watch(self):
        namespace, pipeline, _, _ = self.args
        while not self.client._closed.is_set():
            try:
                call = self.watch_rpc(_wire.encode_watch_workers(namespace, pipeline), metadata=self.client._metadata)
                self.client._calls.append(call)
                for addresses in call:
                    with self.client._lock:
                        new = [a for a in addresses if a not in self.client._streaming]
                    for address in new:
                        self.client._open(address)
            except grpc.RpcError:
                pass
            time.sleep(RETRY)  # the dispatcher went away (leader change): watch again

    def report(self):
        while not self.client._closed.wait(self.window):
            meter = self.client._meter
            w = meter.window()
            meter.reset()
            with self.client._lock:
                workers = len(self.client._delivering)
                # Splits whose last batch arrived: the dispatcher marks them done.
                completed, self.client._completed = self.client._completed, []
            mean = w.total_batch_time / w.batches if w.batches else 0.0
            sent = False
            for _ in range(2):
                try:
                    self.report_rpc(_wire.encode_report_window(self.client_id, w.batches, w.median, w.p90, w.wait_fraction,
                                                               workers, mean, completed), metadata=self.client._metadata)
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
                with self.client._lock:
                    self.client._completed.extend(completed)
