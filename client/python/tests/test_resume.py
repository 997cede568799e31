"""A consumer's resume state against fakes (no network): the batches and rows of the epoch read
that reached the caller (not those a rank holds back or drops, nor completions), reset at each
epoch; a resumed client registers with its state once, then streams, watches and registers
again as the run the dispatcher named, and goes on counting from the state."""

import json

import numpy as np
import pytest
from test_follow import FakeClient, FakeDispatcher, Reader, batch, eventually, positions
from test_wire import decode_register_request, field

from stoker_client import Client, _wire
from stoker_client._dispatcher import Follower
from stoker_client._following import _Followed
from stoker_client._resume import Yielded, check


def row_ids(pairs):
    return np.array([s << 32 | p for s, p in pairs], dtype=np.uint64)


def test_the_state_groups_the_rows_by_split_and_a_resumed_one_goes_on_from_it():
    yielded = Yielded(2)
    yielded.record(row_ids([(1, 5), (0, 3)]))
    yielded.record(row_ids([]))  # a worker that sends no row ids: a batch all the same
    yielded.record(row_ids([(1, 2)]))
    state = yielded.state("job", 2, 1)
    assert state == {"job": "job", "epoch": 2, "batches": 3, "consumers": 2, "consumer_index": 1,
                     "yielded": [[0, [3]], [1, [2, 5]]]}
    assert json.loads(json.dumps(state)) == state
    yielded.record(row_ids([(0, 0)]))
    assert yielded.state("job", 2, 1)["yielded"] == [[0, [0, 3]], [1, [2, 5]]], "sorted again"

    resumed = Yielded.resumed(json.loads(json.dumps(state)))
    resumed.record(row_ids([(1, 0), (4, 1)]))
    later = resumed.state("job", 2, 1)
    assert (later["epoch"], later["batches"]) == (2, 4)
    assert later["yielded"] == [[0, [3]], [1, [0, 2, 5]], [4, [1]]], "both runs' rows"
    resumed.next_epoch(3)
    assert resumed.state("job", 2, 1) == {**state, "epoch": 3, "batches": 0, "yielded": []}


def test_a_state_is_checked_against_the_consumer():
    state = Yielded(1).state("job", 2, 1)
    check(state, "job", 2, 1)
    with pytest.raises(ValueError, match="of job 'job', not 'other'"):
        check(state, "other", 2, 1)
    with pytest.raises(ValueError, match="of consumer 1 of 2, not 0 of 2"):
        check(state, "job", 2, 0)
    with pytest.raises(ValueError, match="of consumer 1 of 2, not 1 of 4"):
        check(state, "job", 4, 1)
    # 0 and 1 consumers both mean a job not read by ranks.
    check(Yielded(1).state("job", 0, 0), "job", 1, 0)
    with pytest.raises(ValueError, match="lacks batches, yielded"):
        check({"job": "job", "epoch": 1, "consumers": 2, "consumer_index": 1}, "job", 2, 1)
    with pytest.raises(ValueError, match="of consumer 1 of 2"):
        Client.from_dispatcher("127.0.0.1:1", "ns", "p", job="job", consumers=2, consumer_index=0, resume=state)
    with pytest.raises(ValueError, match="start_epoch 0 is not the resume state's epoch 1"):
        Client.from_dispatcher("127.0.0.1:1", "ns", "p", job="job", consumers=2, consumer_index=1, resume=state,
                               start_epoch=0)


def test_only_batches_a_rank_yields_count_and_each_epoch_starts_empty():
    with FakeClient(_consumers=2) as client:
        followed = _Followed(client)
        followed.follow(["a"], 0)
        assert client.state() == {"job": "j", "epoch": 0, "batches": 0, "consumers": 2, "consumer_index": 0,
                                  "yielded": []}
        a0 = client.streams[("a", 0)]
        a0.send(batch(0, [(1, 0), (1, 1)]))
        a0.send(batch(0, [(2, 0)]))
        a0.send(batch(0, [], completes=[1, 2]))
        a0.send(batch(0, [(3, 0)], completes=[3]))
        reader = Reader(client)
        followed.set_quotas([_wire.EpochQuota(0, 1, False)])
        assert positions(reader.get()) == [(1, 0), (1, 1)]
        reader.nothing_for()
        # Received but held back by the quota: not the caller's.
        assert (client.state()["batches"], client.state()["yielded"]) == (1, [[1, [0, 1]]])
        # The final quota: one more, then the completions pass and the last batch is dropped.
        a0.end()
        followed.saw_epoch(1)
        followed.set_quotas([_wire.EpochQuota(0, 2, True)])
        assert positions(reader.get()) == [(2, 0)]
        assert reader.get() == "end"
        assert client.dropped_rows == 1
        assert client.state() == {"job": "j", "epoch": 1, "batches": 0, "consumers": 2, "consumer_index": 0,
                                  "yielded": []}


def test_state_needs_the_dispatcher():
    with Client(["127.0.0.1:1"], "ns", "p") as client, pytest.raises(TypeError, match="needs the dispatcher"):
        client.state()


class RunDispatcher(FakeDispatcher):
    """Answers registrations with the name of a resumed job's run; keeps their requests."""

    def __init__(self, epoch):
        super().__init__(epoch)
        self.requests = []

    def RegisterClient(self, request):
        self.requests.append(decode_register_request(request))
        return super().RegisterClient(request) + field(3, b"j~run-1")


def test_a_resumed_client_registers_with_its_state_once_and_goes_on_as_the_run():
    state = {"job": "j", "epoch": 1, "batches": 2, "consumers": 0, "consumer_index": 0,
             "yielded": [[3, [0, 4]], [5, [1]]]}
    dispatcher = RunDispatcher(epoch=1)
    with FakeClient(_resume=state, start_epoch=1) as client:
        Follower(_Followed(client), dispatcher, "fake", "ns", "p", "j", 0, 1.0, resume=state)
        assert dispatcher.requests == [{"job": "j", "client_id": "", "resume": state}]
        assert client._stream_job == "j~run-1"
        # The run's list reports the state's epoch as open.
        dispatcher.send_list(["a"], version=1, epoch=1)
        assert dispatcher.acks.get(timeout=5)["list_version"] == 1
        eventually(lambda: ("a", 1) in client.streams)
        assert client.epoch == 1 and client.state() == state
        request = dispatcher.watch_request
        watched = {f: v for f, _, v in _wire._fields(memoryview(request))}
        assert request[watched[2][0]:watched[2][1]] == b"j~run-1"

        # The dispatcher restarts: the client rejoins as the run's, without the state; the
        # rejoin, not the acknowledgement, tells the completion.
        dispatcher.not_found = 1
        a1 = client.streams[("a", 1)]
        a1.send(batch(1, [(5, 0), (2, 7)], completes=[5]))
        assert positions(next(client)) == [(5, 0), (2, 7)]
        assert dispatcher.acks.get(timeout=5)["completed"] == []
        rejoin = _wire.Rejoin(0, 1, 0, [(1, 5)], [_wire.Held(1, 2, [7])])
        assert dispatcher.requests[1:] == [{"job": "j~run-1", "client_id": "c-1", "rejoin": rejoin}]
        assert client.state() == {**state, "batches": 3, "yielded": [[2, [7]], [3, [0, 4]], [5, [0, 1]]]}
