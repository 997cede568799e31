"""Dispatcher mode against fakes (no network): the rows a client holds from a worker that left
the list are acknowledged once, completed splits are not, and completions go promptly; each
epoch streams separately and ends for the caller only once the client has all of it; a restarted
dispatcher is rejoined once with all that arrived, and its predecessor's batches are dropped."""

import queue
import threading
import time

import grpc
import numpy as np
import pytest
from test_wire import (chunk, decode_acknowledge_request, decode_register_request, field, header, round_ref,
                       tensor_meta, varint)

from stoker_client import Client, WorkerError, _wire
from stoker_client._dispatcher import Follower
from stoker_client._following import _Followed


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, trailing_metadata=()):
        self._code, self._trailing_metadata = code, tuple(trailing_metadata)

    def code(self):
        return self._code

    def details(self):
        return ""

    def trailing_metadata(self):
        return self._trailing_metadata


END = object()


class FakeCall:
    """A server stream: yields what the test sends until it ends, fails or is cancelled."""

    def __init__(self, decode=lambda m: m):
        self.decode = decode
        self.items = queue.Queue()
        self.cancelled = False

    def send(self, message: bytes):
        self.items.put(self.decode(message))

    def fail(self, code):
        self.items.put(FakeRpcError(code))

    def end(self):
        """Ends the stream normally (status OK)."""
        self.items.put(END)

    def cancel(self):
        self.cancelled = True
        self.items.put(FakeRpcError(grpc.StatusCode.CANCELLED))

    def __iter__(self):
        while True:
            item = self.items.get()
            if item is END:
                return
            if isinstance(item, Exception):
                raise item
            yield item


class FakeChannel:
    def close(self):
        pass


class FakeClient(Client):
    """A client whose worker streams are `FakeCall`s, the latest per (address, epoch) in
    `streams`, each one opened also in `opened`."""

    def __init__(self, prefetch_next_epoch=True, **options):
        self.streams, self.opened = {}, []
        super().__init__([], "ns", "p", job="j", _follow=True, _prefetch_next_epoch=prefetch_next_epoch, **options)

    def _connect(self, worker, epoch):
        self.streams[(worker, epoch)] = FakeCall(_wire.decode_chunk)
        self.opened.append((worker, epoch))
        return FakeChannel(), self.streams[(worker, epoch)]


def batch(epoch, rows, completes=(), incarnation=0, round=None):
    """A one-chunk batch of `rows` ((split, position)s) with a label per row, of the splits
    dispatcher `incarnation` handed out, dealt in `round` ((worker, index)) in coordinated mode."""
    labels = np.arange(len(rows), dtype="<i8")
    head = header(epoch, rows[0][0] if rows else 0, 0, [tensor_meta("label", 3, [len(rows)], labels.nbytes)] if rows else [])
    head += field(6, b"".join(varint(s << 32 | p) for s, p in rows))
    if completes:
        head += field(5, b"".join(varint(s) for s in completes))
    if incarnation:
        head += _wire._key(7, 0) + varint(incarnation)
    if round is not None:
        head += field(8, round_ref(*round))
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
        assert followed.follow(["a"], 0) == []
        a = client.streams[("a", 0)]
        a.send(batch(0, [(1, 0), (1, 1), (2, 5)]))
        a.send(batch(0, [(1, 2), (2, 6)], completes=[1]))
        assert positions(next(client)) == [(1, 0), (1, 1), (2, 5)]
        assert positions(next(client)) == [(1, 2), (2, 6)]
        assert followed.take_completed() == [(0, 1)]
        # Split 1 is done: only split 2's rows are held.
        assert followed.follow(["b"], 0) == [_wire.Held(0, 2, [5, 6])]
        assert a.cancelled and client.streams[("a", 1)].cancelled
        assert ("b", 0) in client.streams and ("b", 1) in client.streams
        assert followed.follow(["b"], 0) == []


def test_buffered_rows_are_held_and_a_batch_not_buffered_is_neither_held_nor_yielded():
    with FakeClient(prefetch=1) as client:
        followed = _Followed(client)
        followed.follow(["a"], 0)
        a = client.streams[("a", 0)]
        a.send(batch(0, [(3, 0), (3, 1)]))
        a.send(batch(0, [(3, 2)]))
        # The second batch waits for room in the buffer when the worker is dropped.
        eventually(lambda: len(client._held.get("a", {}).get((0, 3), ())) == 2 and a.items.empty())
        time.sleep(0.05)
        assert followed.follow([], 0) == [_wire.Held(0, 3, [0, 1])]
        assert positions(next(client)) == [(3, 0), (3, 1)]
        assert not client._buffers.get(0)


def test_a_failed_stream_is_opened_again_and_its_rows_stay_held_until_the_list_drops_the_worker():
    with FakeClient() as client:
        followed = _Followed(client)
        followed.follow(["a"], 0)
        first = client.streams[("a", 0)]
        first.send(batch(0, [(4, 0)]))
        next(client)
        first.fail(grpc.StatusCode.UNAVAILABLE)
        # Still listed and the epoch not over: opened again for the same epoch after a pause.
        eventually(lambda: client.streams[("a", 0)] is not first)
        client.streams[("a", 0)].send(batch(0, [(5, 1)]))
        next(client)
        assert followed.follow([], 0) == [_wire.Held(0, 4, [0]), _wire.Held(0, 5, [1])]


def test_a_stream_that_ended_normally_is_not_opened_again():
    with FakeClient() as client:
        followed = _Followed(client)
        followed.follow(["a"], 0)
        a = client.streams[("a", 0)]
        a.send(batch(0, [(4, 0)]))
        a.end()
        next(client)
        eventually(lambda: ("a", 0) not in client._pumps)
        time.sleep(0.4)  # longer than the pause before a failed stream opens again
        followed.follow(["a"], 0)  # nor by a new list
        assert client.opened.count(("a", 0)) == 1
        # Its rows are held still: split 4 is not complete.
        assert followed.follow([], 0) == [_wire.Held(0, 4, [0])]


def test_a_fatal_error_is_raised_and_the_stream_not_opened_again():
    with FakeClient() as client:
        followed = _Followed(client)
        followed.follow(["a", "b"], 0)
        client.streams[("a", 0)].fail(grpc.StatusCode.FAILED_PRECONDITION)
        with pytest.raises(WorkerError, match="FAILED_PRECONDITION"):
            next(client)
        time.sleep(0.4)
        assert client.opened.count(("a", 0)) == 1
        # The other streams go on.
        client.streams[("b", 0)].send(batch(0, [(1, 0)]))
        assert positions(next(client)) == [(1, 0)]


def over(client, epoch):
    with client._lock:
        return client._over(epoch)


class Reader:
    """Iterates `client.iter_epoch()` in a thread: batches, then "end", go to `items`."""

    def __init__(self, client):
        self.items = queue.Queue()
        threading.Thread(target=self._read, args=(client.iter_epoch(),), daemon=True).start()

    def _read(self, batches):
        try:
            for b in batches:
                self.items.put(b)
            self.items.put("end")
        except Exception as e:  # noqa: BLE001 - the test sees it
            self.items.put(e)

    def get(self, timeout=5.0):
        return self.items.get(timeout=timeout)

    def nothing_for(self, seconds=0.3):
        time.sleep(seconds)
        assert self.items.empty(), self.items.get()


def test_an_epoch_is_over_only_when_the_job_is_past_it_its_streams_ended_and_all_was_taken():
    with FakeClient() as client:
        followed = _Followed(client)
        followed.follow(["a", "b"], 0)
        assert client.epoch == 0
        a0, b0 = client.streams[("a", 0)], client.streams[("b", 0)]
        a0.send(batch(0, [(1, 0)], completes=[1]))
        b0.send(batch(0, [(2, 0)], completes=[2]))
        a0.end()
        b0.end()
        eventually(lambda: client._finished.get(0) == {"a", "b"})
        assert len(client._buffers[0]) == 2
        assert not over(client, 0), "the job is still at epoch 0, and two batches wait"
        followed.saw_epoch(1)
        assert not over(client, 0), "two batches wait"
        batches = client.iter_epoch()
        assert sorted(positions(next(batches)) + positions(next(batches))) == [(1, 0), (2, 0)]
        assert over(client, 0)
        with pytest.raises(StopIteration):
            next(batches)
        assert client.epoch == 1

        # Epoch 1: the job is past it and nothing waits, but b's stream goes on.
        followed.saw_epoch(2)
        reader = Reader(client)
        client.streams[("a", 1)].end()
        reader.nothing_for()
        assert not over(client, 1)
        client.streams[("b", 1)].send(batch(1, [(7, 0)], completes=[7]))
        assert positions(reader.get()) == [(7, 0)]
        reader.nothing_for()
        client.streams[("b", 1)].end()
        assert reader.get() == "end"
        assert client.epoch == 2

        # Epoch 2: a worker that leaves the list no longer counts.
        followed.saw_epoch(3)
        reader = Reader(client)
        client.streams[("a", 2)].end()
        reader.nothing_for()
        followed.follow(["a"], 3)
        assert client.streams[("b", 2)].cancelled
        assert reader.get() == "end"
        assert client.epoch == 3


def test_the_next_epochs_batches_wait_until_the_current_epoch_is_over():
    with FakeClient(prefetch=1) as client:
        followed = _Followed(client)
        followed.follow(["a"], 0)
        a0, a1 = client.streams[("a", 0)], client.streams[("a", 1)]
        # The next epoch's buffer is full, and one more of its batches waits: the current
        # epoch's batches still come.
        a1.send(batch(1, [(1, 0)]))
        a1.send(batch(1, [(1, 1)], completes=[1]))
        eventually(lambda: len(client._buffers.get(1, ())) == 1 and a1.items.empty())
        a0.send(batch(0, [(3, 0)], completes=[3]))
        b = next(client)
        assert (b.epoch, positions(b)) == (0, [(3, 0)])
        # Epoch 0 is not over (a's stream goes on): epoch 1's batches are not yielded.
        reader = Reader(client)
        reader.nothing_for()
        followed.saw_epoch(1)
        reader.nothing_for()
        a0.end()
        assert reader.get() == "end"
        assert client.epoch == 1
        batches = client.iter_epoch()
        assert [positions(next(batches)), positions(next(batches))] == [[(1, 0)], [(1, 1)]]


def test_next_goes_on_across_epochs():
    with FakeClient() as client:
        followed = _Followed(client)
        followed.follow(["a"], 0)
        client.streams[("a", 1)].send(batch(1, [(2, 0)], completes=[2]))
        client.streams[("a", 0)].send(batch(0, [(1, 0)], completes=[1]))
        assert next(client).epoch == 0
        followed.saw_epoch(1)
        client.streams[("a", 0)].end()
        b = next(client)
        assert (b.epoch, client.epoch) == (1, 1)
        # Streams of epoch 2 opened once epoch 1 is read.
        assert ("a", 2) in client.streams


def test_new_workers_stream_the_current_and_the_next_epoch_and_without_prefetching_only_the_current():
    with FakeClient() as client:
        followed = _Followed(client)
        followed.follow(["a"], 4)
        followed.follow(["a", "b"], 4)
        assert sorted(client.opened) == [("a", 4), ("a", 5), ("b", 4), ("b", 5)]
    with FakeClient(prefetch_next_epoch=False) as client:
        followed = _Followed(client)
        followed.follow(["a"], 0)
        assert client.opened == [("a", 0)]
        followed.saw_epoch(1)
        client.streams[("a", 0)].send(batch(0, [(1, 0)], completes=[1]))
        client.streams[("a", 0)].end()
        assert len(list(client.iter_epoch())) == 1
        time.sleep(0.1)
        # The next epoch's stream opens when the caller asks for it.
        assert client.opened == [("a", 0)]
        reader = Reader(client)
        eventually(lambda: ("a", 1) in client.streams)
        client.streams[("a", 1)].send(batch(1, [(1, 0)]))
        assert reader.get().epoch == 1


def test_reading_starts_at_the_jobs_open_epoch_or_a_later_start_epoch():
    with FakeClient(start_epoch=3) as client:
        _Followed(client).follow(["a"], 2)
        assert client.epoch == 3 and sorted(client.opened) == [("a", 3), ("a", 4)]
    with FakeClient(start_epoch=1) as client:
        _Followed(client).follow(["a"], 2)
        assert client.epoch == 2


def test_completions_alone_are_acknowledged_and_never_yielded():
    with FakeClient() as client:
        followed = _Followed(client)
        followed.follow(["a"], 0)
        a0 = client.streams[("a", 0)]
        a0.send(batch(0, [(1, 0)]))
        a0.send(batch(0, [], completes=[1]))
        a0.end()
        followed.saw_epoch(1)
        assert [positions(b) for b in client.iter_epoch()] == [[(1, 0)]]
        assert followed.take_completed() == [(0, 1)]


def test_iter_epoch_needs_the_dispatcher():
    client = Client(["127.0.0.1:1"], "ns", "p")
    with client, pytest.raises(TypeError, match="needs the dispatcher"):
        client.iter_epoch()


class FakeDispatcher(FakeChannel):
    """A channel to a dispatcher: worker lists sent with `send_list`, acknowledgements decoded
    into `acks`, registrations into `registered`; `not_found` acknowledgements fail as after a
    restart (or, if `incarnation` is still the one the client registered with, as after the
    client went silent too long); `incarnation` (0: not told) is what registrations and
    NOT_FOUND answers name."""

    def __init__(self, epoch=0, incarnation=0):
        self.epoch, self.not_found, self.registrations = epoch, 0, 0
        self.incarnation = incarnation
        self.acks, self.reports, self.registered = queue.Queue(), [], []
        self.watch = FakeCall(_wire.decode_worker_list)
        self.watch_request = None

    def send_list(self, addresses, version, epoch, incarnation=0, clients=0):
        message = b"".join(field(1, a.encode()) for a in addresses)
        message += _wire._key(2, 0) + varint(version) + _wire._key(3, 0) + varint(epoch)
        if incarnation:
            message += _wire._key(5, 0) + varint(incarnation)
        if clients:
            message += _wire._key(6, 0) + varint(clients)
        self.watch.send(message)

    def unary_unary(self, name, request_serializer, response_deserializer):
        handler = getattr(self, name.rsplit("/", 1)[1])
        return lambda request, metadata=None, timeout=None: response_deserializer(handler(request))

    def unary_stream(self, name, request_serializer, response_deserializer):
        def watch(request, metadata=None):
            self.watch_request = request
            return self.watch
        return watch

    def RegisterClient(self, request):
        self.registrations += 1
        self.registered.append(decode_register_request(request))
        response = field(1, b"c-1") + _wire._key(2, 0) + varint(50)
        return response + (_wire._key(4, 0) + varint(self.incarnation) if self.incarnation else b"")

    def ReportWindow(self, request):
        self.reports.append(request)
        return b""

    def Acknowledge(self, request):
        if self.not_found:
            self.not_found -= 1
            raise FakeRpcError(grpc.StatusCode.NOT_FOUND,
                               [("stoker-incarnation", str(self.incarnation))] if self.incarnation else [])
        self.acks.put(decode_acknowledge_request(request))
        return _wire._key(1, 0) + varint(self.epoch)


def test_the_follower_acknowledges_versions_completions_and_held_rows():
    dispatcher = FakeDispatcher()
    with FakeClient() as client:
        Follower(_Followed(client), dispatcher, "fake", "ns", "p", "j", 0, 1.0)
        dispatcher.send_list(["a"], version=1, epoch=0)
        # A version is acknowledged even with nothing to say about it.
        assert dispatcher.acks.get(timeout=5) == {"client_id": "c-1", "completed": [], "list_version": 1, "held": []}
        eventually(lambda: ("a", 0) in client.streams)
        assert client.epoch == 0
        a = client.streams[("a", 0)]
        a.send(batch(0, [(1, 0), (2, 0)]))
        a.send(batch(0, [(1, 1)], completes=[1]))
        next(client), next(client)
        assert dispatcher.acks.get(timeout=5) == {"client_id": "c-1", "completed": [(0, 1)], "list_version": 1, "held": []}

        # "a" dies while the dispatcher restarts: the acknowledgement rejoins first, and the
        # rows it held go no more (epoch 0 is finished: the rejoin has nothing of it).
        dispatcher.not_found, dispatcher.epoch = 1, 1
        dispatcher.send_list(["b"], version=2, epoch=1)
        assert dispatcher.acks.get(timeout=5) == {"client_id": "c-1", "completed": [], "list_version": 2, "held": []}
        assert dispatcher.registrations == 2 and a.cancelled
        assert dispatcher.registered[1] == {"job": "j", "client_id": "c-1", "rejoin": _wire.Rejoin(0, 1, 0, [], [])}
        eventually(lambda: client.open_epoch == 1)
        time.sleep(0.2)
        assert dispatcher.acks.empty(), "nothing more to acknowledge"
        # A completion not acknowledged yet when the client closes goes with the last one.
        with client._lock:
            client._completed.append((0, 3))

    # Closing says so; b's streams were cut, with batches maybe on the way.
    assert dispatcher.acks.get(timeout=5) == {"client_id": "c-1", "completed": [(0, 3)], "list_version": 2,
                                              "held": [], "leaving": True, "discarded": True}

    request = dispatcher.watch_request
    fields = {f: v for f, _, v in _wire._fields(memoryview(request))}
    assert request[fields[2][0]:fields[2][1]] == b"j"
    assert dispatcher.reports, "a window every 50 ms"
    assert all(8 not in [f for f, _, _ in _wire._fields(memoryview(r))] for r in dispatcher.reports)


def test_a_client_closing_after_its_epoch_discarded_nothing():
    dispatcher = FakeDispatcher()
    with FakeClient(prefetch_next_epoch=False) as client:
        Follower(_Followed(client), dispatcher, "fake", "ns", "p", "j", 0, 1.0)
        dispatcher.send_list(["a"], version=1, epoch=0)
        assert dispatcher.acks.get(timeout=5)["list_version"] == 1
        eventually(lambda: ("a", 0) in client.streams)
        client.streams[("a", 0)].send(batch(0, [(1, 0)], completes=[1]))
        client.streams[("a", 0)].end()
        dispatcher.send_list(["a"], version=2, epoch=1)
        assert [positions(b) for b in client.iter_epoch()] == [[(1, 0)]]
        assert client.epoch == 1
    acks = []
    while not acks or not acks[-1].get("leaving"):
        acks.append(dispatcher.acks.get(timeout=5))
    assert "discarded" not in acks[-1]
    assert [c for ack in acks for c in ack["completed"]] == [(0, 1)]


def test_closing_ends_an_epochs_iteration():
    client = FakeClient()
    _Followed(client).follow(["a"], 0)
    reader = Reader(client)
    reader.nothing_for(0.1)
    client.close()
    assert reader.get() == "end"
    with pytest.raises(StopIteration):
        next(client)


def acks_until(dispatcher, completion):
    """The acknowledgements up to the first that carries `completion`."""
    acks = []
    while not acks or completion not in acks[-1]["completed"]:
        acks.append(dispatcher.acks.get(timeout=5))
    return acks


def test_a_dispatcher_that_forgot_the_client_is_rejoined_with_everything_that_arrived():
    dispatcher = FakeDispatcher(incarnation=1)
    with FakeClient() as client:
        Follower(_Followed(client), dispatcher, "fake", "ns", "p", "j", 0, 1.0)
        dispatcher.send_list(["a", "b"], version=1, epoch=0, incarnation=1, clients=3)
        assert dispatcher.acks.get(timeout=5)["list_version"] == 1
        eventually(lambda: {("a", 0), ("b", 0), ("b", 1)} <= set(client.streams))
        a0, b0, b1 = client.streams[("a", 0)], client.streams[("b", 0)], client.streams[("b", 1)]
        # "a" delivers part of split 1 and leaves the list: its rows are acknowledged as held.
        a0.send(batch(0, [(1, 0), (1, 1)], incarnation=1))
        assert positions(next(client)) == [(1, 0), (1, 1)]
        dispatcher.send_list(["b"], version=2, epoch=0, incarnation=1, clients=3)
        assert dispatcher.acks.get(timeout=5) == {"client_id": "c-1", "completed": [], "list_version": 2,
                                                  "held": [(0, 1, [0, 1])]}
        # "b" delivers split 2 whole (taken and acknowledged), the rest of split 1 and part of 4.
        b0.send(batch(0, [(2, 0), (2, 1)], completes=[2], incarnation=1))
        assert positions(next(client)) == [(2, 0), (2, 1)]
        assert dispatcher.acks.get(timeout=5)["completed"] == [(0, 2)]
        b0.send(batch(0, [(1, 2), (4, 1)], incarnation=1))
        assert positions(next(client)) == [(1, 2), (4, 1)]
        # Buffered, not taken yet: split 5's last batch, split 3's (with a row of 4), epoch 1's.
        b0.send(batch(0, [(5, 0)], completes=[5], incarnation=1))
        b0.send(batch(0, [(3, 0), (4, 0)], completes=[3], incarnation=1))
        b1.send(batch(1, [(7, 2)], incarnation=1))
        eventually(lambda: len(client._buffers.get(0, ())) == 2 and len(client._buffers.get(1, ())) == 1)

        # The dispatcher restarts: acknowledging split 5 finds the client forgotten. It rejoins
        # as itself with all that arrived, then acknowledges again without what the rejoin told.
        dispatcher.not_found, dispatcher.incarnation = 1, 2
        assert positions(next(client)) == [(5, 0)]
        assert dispatcher.acks.get(timeout=5) == {"client_id": "c-1", "completed": [], "list_version": 2, "held": []}
        assert dispatcher.not_found == 0 and dispatcher.registrations == 2
        assert dispatcher.registered[1] == {"job": "j", "client_id": "c-1", "rejoin": _wire.Rejoin(
            incarnation=1, open_epoch=0, clients=3, completed=[(0, 2), (0, 3), (0, 5)],
            # Split 1 from both workers (a's rows acknowledged as held before), split 3's not
            # taken yet; not splits 2 and 5, whose completions were taken.
            received=[_wire.Held(0, 1, [0, 1, 2]), _wire.Held(0, 3, [0]), _wire.Held(0, 4, [0, 1]),
                      _wire.Held(1, 7, [2])])}

        # The old dispatcher's batches are dropped as they arrive; the new one's come.
        b0.send(batch(0, [(8, 0)], completes=[8], incarnation=1))
        b0.send(batch(0, [(9, 0)], completes=[9], incarnation=2))
        assert positions(next(client)) == [(3, 0), (4, 0)], "buffered before the rejoin: kept"
        assert positions(next(client)) == [(9, 0)]
        # Split 3's completion was in the rejoin: only split 9's is acknowledged.
        assert [c for ack in acks_until(dispatcher, (0, 9)) for c in ack["completed"]] == [(0, 9)]
        with client._lock:
            assert (0, 8) not in client._received.completed and (0, 8) not in client._received.rows
            assert (0, 8) not in client._held.get("b", {}) and len(client._buffers[1]) == 1
    assert dispatcher.registrations == 2


def test_a_worker_list_from_a_restarted_dispatcher_rejoins_it_without_a_not_found():
    dispatcher = FakeDispatcher(incarnation=1)
    with FakeClient() as client:
        follower = Follower(_Followed(client), dispatcher, "fake", "ns", "p", "j", 0, 1.0)
        dispatcher.send_list(["a"], version=1, epoch=0, incarnation=1, clients=2)
        assert dispatcher.acks.get(timeout=5)["list_version"] == 1
        eventually(lambda: ("a", 0) in client.streams)
        a0 = client.streams[("a", 0)]
        a0.send(batch(0, [(1, 0)], completes=[1], incarnation=1))
        a0.send(batch(0, [(2, 3)], incarnation=1))
        eventually(lambda: len(client._buffers.get(0, ())) == 2)
        assert dispatcher.registrations == 1, "a list of the dispatcher registered with is no restart"

        # The new dispatcher lists the job before the client called it.
        dispatcher.incarnation = 2
        dispatcher.send_list(["a"], version=1, epoch=0, incarnation=2, clients=1)
        eventually(lambda: dispatcher.registrations == 2)
        assert dispatcher.registered[1] == {"job": "j", "client_id": "c-1", "rejoin": _wire.Rejoin(
            1, 0, 2, [(0, 1)], [_wire.Held(0, 1, [0]), _wire.Held(0, 2, [3])])}
        eventually(lambda: follower.incarnation == 2 and follower.clients == 1)

        a0.send(batch(0, [(2, 4)], completes=[2], incarnation=1))
        a0.send(batch(0, [(4, 0)], completes=[4], incarnation=2))
        assert [positions(next(client)) for _ in range(3)] == [[(1, 0)], [(2, 3)], [(4, 0)]]
        assert [c for ack in acks_until(dispatcher, (0, 4)) for c in ack["completed"]] == [(0, 4)]
        assert dispatcher.not_found == 0 and dispatcher.registrations == 2


def test_a_rank_neither_counts_nor_yields_batches_of_a_dispatcher_it_rejoined_away_from():
    with FakeClient(_consumers=2) as client:
        followed = _Followed(client)
        followed.follow(["a"], 0)
        a0 = client.streams[("a", 0)]
        a0.send(batch(0, [(1, 0)], completes=[1], incarnation=3))
        a0.send(batch(0, [(3, 0)], completes=[3], incarnation=3))
        eventually(lambda: 0 in client._rations and client._rations[0].received == 2)
        followed.set_quotas([_wire.EpochQuota(0, 1, False)])
        # Split 1's completion waits to be acknowledged as its batch entered the ration; split
        # 3's batch waits behind the quota. The rejoin tells both, and neither goes again.
        assert positions(next(client)) == [(1, 0)]
        assert followed.rejoin(3, 2) == _wire.Rejoin(3, 0, 2, [(0, 1), (0, 3)],
                                                     [_wire.Held(0, 1, [0]), _wire.Held(0, 3, [0])])
        assert followed.take_completed() == []
        a0.send(batch(0, [(2, 0)], completes=[2], incarnation=3))
        a0.send(batch(0, [(2, 1)], incarnation=4))
        eventually(lambda: client._rations[0].received == 3)
        followed.set_quotas([_wire.EpochQuota(0, 3, False)])
        assert [positions(next(client)) for _ in range(2)] == [[(3, 0)], [(2, 1)]]
        # Split 3's completion went with the rejoin, split 2's never arrived.
        assert followed.take_completed() == []
        assert followed.rank_progress()[0] == _wire.RankProgress(0, 3, False, 0)


class GatedDispatcher(FakeDispatcher):
    """Registrations after the first wait for `gate`, signalling `registering` first; while
    `refuse` is set they fail (UNAVAILABLE) instead."""

    def __init__(self, **options):
        super().__init__(**options)
        self.gate, self.registering = threading.Event(), threading.Event()
        self.refuse = False

    def RegisterClient(self, request):
        if self.registrations:
            self.registering.set()
            assert self.gate.wait(5)
            if self.refuse:
                self.registered.append(decode_register_request(request))
                raise FakeRpcError(grpc.StatusCode.UNAVAILABLE)
        return super().RegisterClient(request)


def test_threads_that_find_the_client_forgotten_together_rejoin_once():
    dispatcher = GatedDispatcher(incarnation=1)
    with FakeClient() as client:
        follower = Follower(_Followed(client), dispatcher, "fake", "ns", "p", "j", 0, 1.0)
        seen = follower.registrations
        dispatcher.incarnation = 2
        restarted = FakeRpcError(grpc.StatusCode.NOT_FOUND, [("stoker-incarnation", "2")])
        threads = [threading.Thread(target=follower.forgotten, args=(restarted, seen)) for _ in range(2)]
        threads.append(threading.Thread(target=follower.rejoin_if_restarted, args=(2,)))
        for thread in threads:
            thread.start()
        assert dispatcher.registering.wait(5)
        dispatcher.gate.set()
        for thread in threads:
            thread.join(5)
        assert dispatcher.registrations == 2 and follower.incarnation == 2
        assert [r["rejoin"].incarnation for r in dispatcher.registered[1:]] == [1]
        # Another restart later is rejoined again.
        dispatcher.incarnation = 3
        follower.rejoin_if_restarted(3)
        assert dispatcher.registrations == 3 and dispatcher.registered[2]["rejoin"].incarnation == 2
        with client._lock:
            assert client._received.retired == {1, 2}


def test_a_rejoin_that_failed_is_sent_again_as_it_was():
    dispatcher = GatedDispatcher(incarnation=1)
    dispatcher.gate.set()
    with FakeClient() as client:
        follower = Follower(_Followed(client), dispatcher, "fake", "ns", "p", "j", 0, 1.0)
        followed = _Followed(client)
        followed.follow(["a"], 0)
        a0 = client.streams[("a", 0)]
        a0.send(batch(0, [(1, 0)], incarnation=1))
        eventually(lambda: len(client._buffers.get(0, ())) == 1)
        dispatcher.incarnation, dispatcher.refuse = 2, True
        with pytest.raises(FakeRpcError):
            follower.rejoin_if_restarted(2)
        assert follower.incarnation == 1 and follower.pending is not None
        # Meanwhile a batch of the new dispatcher arrives: the rejoin sent again does not have it.
        a0.send(batch(0, [(2, 0)], incarnation=2))
        eventually(lambda: len(client._buffers.get(0, ())) == 2)
        dispatcher.refuse = False
        restarted = FakeRpcError(grpc.StatusCode.NOT_FOUND, [("stoker-incarnation", "2")])
        follower.forgotten(restarted, follower.registrations)
        first, again = dispatcher.registered[1:]
        assert first == again == {"job": "j", "client_id": "c-1",
                                  "rejoin": _wire.Rejoin(1, 0, 0, [], [_wire.Held(0, 1, [0])])}
        assert follower.incarnation == 2 and follower.pending is None and follower.rejoins == 1


def test_a_dispatcher_that_only_forgot_a_silent_client_is_registered_with_again_without_a_rejoin():
    dispatcher = FakeDispatcher(incarnation=1)
    with FakeClient() as client:
        Follower(_Followed(client), dispatcher, "fake", "ns", "p", "j", 0, 1.0)
        dispatcher.send_list(["a"], version=1, epoch=0, incarnation=1)
        assert dispatcher.acks.get(timeout=5)["list_version"] == 1
        eventually(lambda: ("a", 0) in client.streams)
        a0 = client.streams[("a", 0)]
        # Forgotten by the same dispatcher (NOT_FOUND names incarnation 1): registered again
        # plainly, and the acknowledgement goes again without the completion (its splits went
        # back to the queue when the client was forgotten).
        dispatcher.not_found = 1
        a0.send(batch(0, [(1, 0)], completes=[1], incarnation=1))
        assert positions(next(client)) == [(1, 0)]
        assert dispatcher.acks.get(timeout=5)["completed"] == []
        assert dispatcher.registered[1:] == [{"job": "j", "client_id": "c-1"}]
        # Nothing retired: its batches still come, and their completions are acknowledged.
        a0.send(batch(0, [(2, 0)], completes=[2], incarnation=1))
        assert positions(next(client)) == [(2, 0)]
        assert [c for ack in acks_until(dispatcher, (0, 2)) for c in ack["completed"]] == [(0, 2)]
        with client._lock:
            assert client._received.retired == set()
