"""Dispatcher mode against fakes (no network): the rows a client holds from a worker that left
the list are acknowledged once, completed splits are not, and completions go promptly."""

import queue
import time

import grpc
import numpy as np
from test_wire import chunk, decode_acknowledge_request, field, header, tensor_meta, varint

from stoker_client import Client, _wire
from stoker_client._dispatcher import Follower
from stoker_client.client import _Followed


class FakeRpcError(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return ""


class FakeCall:
    """A server stream: yields what the test sends until it fails or is cancelled."""

    def __init__(self, decode=lambda m: m):
        self.decode = decode
        self.items = queue.Queue()
        self.cancelled = False

    def send(self, message: bytes):
        self.items.put(self.decode(message))

    def fail(self, code):
        self.items.put(FakeRpcError(code))

    def cancel(self):
        self.cancelled = True
        self.items.put(FakeRpcError(grpc.StatusCode.CANCELLED))

    def __iter__(self):
        while True:
            item = self.items.get()
            if isinstance(item, Exception):
                raise item
            yield item


class FakeChannel:
    def close(self):
        pass


class FakeClient(Client):
    """A client whose worker streams are `FakeCall`s, the latest per address in `streams`."""

    def __init__(self, **options):
        self.streams = {}
        super().__init__([], "ns", "p", job="j", _follow=True, **options)

    def _connect(self, worker):
        self.streams[worker] = FakeCall(_wire.decode_chunk)
        return FakeChannel(), self.streams[worker]


def batch(epoch, rows, completes=()):
    """A one-chunk batch of `rows` ((split, position)s) with a label per row."""
    labels = np.arange(len(rows), dtype="<i8")
    head = header(epoch, rows[0][0] if rows else 0, 0, [tensor_meta("label", 3, [len(rows)], labels.nbytes)] if rows else [])
    head += field(6, b"".join(varint(s << 32 | p) for s, p in rows))
    if completes:
        head += field(5, b"".join(varint(s) for s in completes))
    return chunk(head, [labels.tobytes()] if rows else [], last=True)


def positions(b):
    return [(r >> 32, r & 0xFFFFFFFF) for r in b.rows.tolist()]


def eventually(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_rows_of_a_dropped_workers_unfinished_splits_are_held_once():
    with FakeClient() as client:
        followed = _Followed(client)
        assert followed.follow(["a"]) == []
        a = client.streams["a"]
        a.send(batch(0, [(1, 0), (1, 1), (2, 5)]))
        a.send(batch(0, [(1, 2), (2, 6)], completes=[1]))
        assert positions(next(client)) == [(1, 0), (1, 1), (2, 5)]
        assert positions(next(client)) == [(1, 2), (2, 6)]
        assert followed.take_completed() == [(0, 1)]
        # Split 1 is done: only split 2's rows are held.
        assert followed.follow(["b"]) == [_wire.Held(0, 2, [5, 6])]
        assert a.cancelled and "b" in client.streams
        assert followed.follow(["b"]) == []


def test_queued_rows_are_held_and_a_batch_not_queued_is_neither_held_nor_yielded():
    with FakeClient(prefetch=1) as client:
        followed = _Followed(client)
        followed.follow(["a"])
        a = client.streams["a"]
        a.send(batch(0, [(3, 0), (3, 1)]))
        a.send(batch(0, [(3, 2)]))
        # The second batch waits for room in the queue when the worker is dropped.
        eventually(lambda: len(client._held.get("a", {}).get((0, 3), ())) == 3)
        assert followed.follow([]) == [_wire.Held(0, 3, [0, 1])]
        assert positions(next(client)) == [(3, 0), (3, 1)]
        assert client._queue.empty()


def test_a_stream_that_ended_keeps_its_rows_until_the_list_drops_the_worker():
    with FakeClient() as client:
        followed = _Followed(client)
        followed.follow(["a"])
        first = client.streams["a"]
        first.send(batch(0, [(4, 0)]))
        next(client)
        first.fail(grpc.StatusCode.UNAVAILABLE)
        eventually(lambda: "a" not in client._pumps)
        # Still listed: opened again, its rows still held.
        assert followed.follow(["a"]) == []
        assert client.streams["a"] is not first
        client.streams["a"].send(batch(0, [(5, 1)]))
        next(client)
        assert followed.follow([]) == [_wire.Held(0, 4, [0]), _wire.Held(0, 5, [1])]


class FakeDispatcher(FakeChannel):
    """A channel to a dispatcher: worker lists sent with `send_list`, acknowledgements decoded
    into `acks`; `not_found` acknowledgements fail as after a restart."""

    def __init__(self, epoch=0):
        self.epoch, self.not_found, self.registrations = epoch, 0, 0
        self.acks, self.reports = queue.Queue(), []
        self.watch = FakeCall(_wire.decode_worker_list)
        self.watch_request = None

    def send_list(self, addresses, version, epoch):
        message = b"".join(field(1, a.encode()) for a in addresses)
        self.watch.send(message + _wire._key(2, 0) + varint(version) + _wire._key(3, 0) + varint(epoch))

    def unary_unary(self, name, request_serializer, response_deserializer):
        handler = getattr(self, name.rsplit("/", 1)[1])
        return lambda request, metadata=None: response_deserializer(handler(request))

    def unary_stream(self, name, request_serializer, response_deserializer):
        def watch(request, metadata=None):
            self.watch_request = request
            return self.watch
        return watch

    def RegisterClient(self, request):
        self.registrations += 1
        return field(1, b"c-1") + _wire._key(2, 0) + varint(50)

    def ReportWindow(self, request):
        self.reports.append(request)
        return b""

    def Acknowledge(self, request):
        if self.not_found:
            self.not_found -= 1
            raise FakeRpcError(grpc.StatusCode.NOT_FOUND)
        self.acks.put(decode_acknowledge_request(request))
        return _wire._key(1, 0) + varint(self.epoch)


def test_the_follower_acknowledges_versions_completions_and_held_rows():
    dispatcher = FakeDispatcher()
    with FakeClient() as client:
        Follower(_Followed(client), dispatcher, "fake", "ns", "p", "j", 0, 1.0)
        dispatcher.send_list(["a"], version=1, epoch=0)
        # A version is acknowledged even with nothing to say about it.
        assert dispatcher.acks.get(timeout=5) == {"client_id": "c-1", "completed": [], "list_version": 1, "held": []}
        eventually(lambda: "a" in client.streams)
        a = client.streams["a"]
        a.send(batch(0, [(1, 0), (2, 0)]))
        a.send(batch(0, [(1, 1)], completes=[1]))
        next(client), next(client)
        assert dispatcher.acks.get(timeout=5) == {"client_id": "c-1", "completed": [(0, 1)], "list_version": 1, "held": []}

        # "a" dies while the dispatcher restarts: the acknowledgement registers again first.
        dispatcher.not_found, dispatcher.epoch = 1, 1
        dispatcher.send_list(["b"], version=2, epoch=1)
        assert dispatcher.acks.get(timeout=5) == {"client_id": "c-1", "completed": [], "list_version": 2,
                                                  "held": [(0, 2, [0])]}
        assert dispatcher.registrations == 2 and a.cancelled
        eventually(lambda: client.open_epoch == 1)
        time.sleep(0.2)
        assert dispatcher.acks.empty(), "nothing more to acknowledge"

    request = dispatcher.watch_request
    fields = {f: v for f, _, v in _wire._fields(memoryview(request))}
    assert request[fields[2][0]:fields[2][1]] == b"j"
    assert dispatcher.reports, "a window every 50 ms"
    assert all(8 not in [f for f, _, _ in _wire._fields(memoryview(r))] for r in dispatcher.reports)
