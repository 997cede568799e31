"""A job read by ranks against fakes (no network): a rank yields up to the dispatcher's quota,
holds the rest while its streams go on, acknowledges a batch's completions as it arrives (the
epoch must end for the quota to be final), drops what is beyond the final quota (counted), and
tells the dispatcher what it received of each epoch; in coordinated mode, also the rounds it
received of each worker without a gap and its position in the order, yielding in the order."""

import queue
import time

import grpc
import pytest
from test_follow import FakeClient, FakeDispatcher, Reader, batch, eventually, positions
from test_wire import field, round_ref, varint

from stoker_client import Client, _wire
from stoker_client._dispatcher import Follower
from stoker_client._following import _Followed


def progress(epoch, batches, ended=False, dropped_rows=0, rounds=None, position=0):
    return _wire.RankProgress(epoch, batches, ended, dropped_rows, rounds or {}, position)


def held(client, epoch):
    with client._lock:
        return [positions(b) for b in client._rations[epoch].held]


def test_a_rank_yields_up_to_the_quota_and_drops_what_is_beyond_the_final_one():
    with FakeClient(_consumers=2) as client:
        followed = _Followed(client)
        followed.follow(["a"], 0)
        a0 = client.streams[("a", 0)]
        a0.send(batch(0, [(1, 0)]))
        a0.send(batch(0, [(1, 1)], completes=[1]))
        a0.send(batch(0, [(2, 0)]))
        a0.send(batch(0, [], completes=[2]))
        eventually(lambda: followed.rank_progress()[0].batches == 3)
        # Every tracked epoch, the one read ahead too: a rank that got nothing says so.
        assert followed.rank_progress() == [progress(0, 3), progress(1, 0)]

        reader = Reader(client)
        reader.nothing_for()  # no quota yet
        # Out of the prefetch buffer (the streams go on), their completions acknowledged: the
        # epoch must be able to end while the quota holds them back.
        assert held(client, 0) == [[(1, 0)], [(1, 1)], [(2, 0)], []] and not client._buffers[0]
        assert followed.take_completed() == [(0, 1), (0, 2)]
        followed.set_quotas([_wire.EpochQuota(0, 1, False)])
        assert positions(reader.get()) == [(1, 0)]
        reader.nothing_for()
        followed.set_quotas([_wire.EpochQuota(0, 2, False), _wire.EpochQuota(1, 5, False)])
        assert positions(reader.get()) == [(1, 1)]
        reader.nothing_for()

        # The epoch ends (the job is past it, a's stream ended): the count is final.
        a0.end()
        followed.saw_epoch(1)
        eventually(lambda: followed.rank_progress()[0] == progress(0, 3, ended=True))
        reader.nothing_for()
        followed.set_quotas([_wire.EpochQuota(0, 2, True)])
        assert reader.get() == "end"
        assert (client.dropped_rows, client.epoch) == (1, 1)
        assert followed.take_completed() == []
        # The epoch just read goes on being reported, with its dropped rows.
        assert followed.rank_progress() == [progress(0, 3, True, 1), progress(1, 0), progress(2, 0)]

        # A quota that came before the epoch was read applies once it is.
        client.streams[("a", 1)].send(batch(1, [(1, 0)], completes=[1]))
        assert positions(next(iter(client.iter_epoch()))) == [(1, 0)]


def test_a_quota_already_reached_holds_the_caller_while_the_streams_go_on():
    with FakeClient(_consumers=2, prefetch=1) as client:
        followed = _Followed(client)
        followed.follow(["a"], 0)
        followed.set_quotas([_wire.EpochQuota(0, 1, False)])
        a0 = client.streams[("a", 0)]
        for split in range(4):
            a0.send(batch(0, [(split, 0)], completes=[split]))
        reader = Reader(client)
        assert positions(reader.get()) == [(0, 0)]
        # A prefetch buffer of one does not stop the stream: the caller holds what it may not yield.
        eventually(lambda: followed.rank_progress()[0].batches == 4 and len(held(client, 0)) == 3)
        assert followed.take_completed() == [(0, 0), (0, 1), (0, 2), (0, 3)]
        followed.set_quotas([_wire.EpochQuota(0, 3, False)])
        assert [positions(reader.get()) for _ in range(2)] == [[(1, 0)], [(2, 0)]]
        reader.nothing_for()


def test_a_rank_holds_the_rows_of_splits_it_completed_until_their_epoch_is_finished():
    with FakeClient(_consumers=2) as client:
        followed = _Followed(client)
        followed.follow(["a"], 0)
        followed.set_quotas([_wire.EpochQuota(0, 1, False)])
        client.streams[("a", 0)].send(batch(0, [(1, 0), (1, 1)], completes=[1]))
        assert positions(next(client)) == [(1, 0), (1, 1)]
        assert followed.take_completed() == [(0, 1)]
        # Another rank may not have reported split 1: if "a" dies, it is produced again
        # without the rows this rank has.
        assert followed.follow(["b"], 0) == [_wire.Held(0, 1, [0, 1])]
        client.streams[("b", 0)].send(batch(0, [(2, 0)], completes=[2]))
        eventually(lambda: followed.rank_progress()[0].batches == 2)
        followed.saw_epoch(1)  # every split of epoch 0 is done
        assert followed.follow([], 1) == []


def ack_where(dispatcher, condition, timeout=5.0):
    """Whether an acknowledgement meeting `condition` comes within `timeout` seconds (those
    before it are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition(dispatcher.acks.get(timeout=max(0.0, deadline - time.monotonic()))):
                return True
        except queue.Empty:
            return False


class RankDispatcher(FakeDispatcher):
    """Records registrations; lists may carry quotas."""

    def __init__(self):
        super().__init__()
        self.rank_fields = []

    def RegisterClient(self, request):
        self.rank_fields.append({f: v for f, t, v in _wire._fields(memoryview(request)) if t == 0})
        return super().RegisterClient(request)

    def send_quotas(self, addresses, version, quotas):
        """`quotas`: (epoch, batches, complete) or, coordinated, (epoch, batches, complete, (base, rounds))."""
        message = b"".join(field(1, a.encode()) for a in addresses) + _wire._key(2, 0) + varint(version)
        for epoch, batches, complete, *order in quotas:
            quota = _wire._key(1, 0) + varint(epoch) + _wire._key(2, 0) + varint(batches)
            quota += _wire._key(3, 0) + varint(1) if complete else b""
            for base, rounds in order:
                quota += field(4, _wire._key(1, 0) + varint(base) + b"".join(field(2, round_ref(*r)) for r in rounds))
            message += field(4, quota)
        self.watch.send(message)


def test_the_follower_registers_as_a_rank_applies_quotas_and_acknowledges_progress():
    dispatcher = RankDispatcher()
    with FakeClient(_consumers=2) as client:
        Follower(_Followed(client), dispatcher, "fake", "ns", "p", "j", 1, 1.0, consumers=2)
        assert dispatcher.rank_fields == [{3: 1, 6: 2}]
        dispatcher.send_quotas(["a"], 1, [])
        assert dispatcher.acks.get(timeout=5) == {"client_id": "c-1", "completed": [], "list_version": 1, "held": [],
                                                  "received": [progress(0, 0), progress(1, 0)]}
        eventually(lambda: ("a", 0) in client.streams)
        client.streams[("a", 0)].send(batch(0, [(1, 0)], completes=[1]))
        assert ack_where(dispatcher, lambda a: a["received"][0] == progress(0, 1))
        reader = Reader(client)
        assert ack_where(dispatcher, lambda a: a["completed"] == [(0, 1)]), "acknowledged as it arrived"
        reader.nothing_for()
        dispatcher.send_quotas(["a"], 1, [(0, 1, False)])
        assert positions(reader.get()) == [(1, 0)]
        time.sleep(0.1)
        assert dispatcher.acks.empty(), "nothing changed"
        # A restarted dispatcher (a new watch) hears the progress again, even unchanged.
        dispatcher.watch.fail(grpc.StatusCode.UNAVAILABLE)
        dispatcher.send_quotas(["a"], 1, [(0, 1, False)])
        assert dispatcher.acks.get(timeout=5)["received"] == [progress(0, 1), progress(1, 0)]


def test_a_job_not_read_by_ranks_sends_no_progress():
    dispatcher = RankDispatcher()
    with FakeClient() as client:
        Follower(_Followed(client), dispatcher, "fake", "ns", "p", "j", 0, 1.0)
        assert dispatcher.rank_fields == [{}]
        dispatcher.send_quotas(["a"], 1, [(0, 0, False)])
        assert dispatcher.acks.get(timeout=5) == {"client_id": "c-1", "completed": [], "list_version": 1, "held": []}
        eventually(lambda: ("a", 0) in client.streams)
        client.streams[("a", 0)].send(batch(0, [(1, 0)]))
        assert positions(next(client)) == [(1, 0)], "a quota means nothing to it"


def test_a_coordinated_rank_reports_its_rounds_counted_without_a_gap_and_yields_in_the_order():
    with FakeClient(_consumers=2, _coordinated=True) as client:
        followed = _Followed(client)
        followed.follow(["a", "b"], 0)
        a0, b0 = client.streams[("a", 0)], client.streams[("b", 0)]
        # w-a's round 2 is missing (lost with a broken stream): its count stops at 2.
        for index in (0, 1, 3):
            a0.send(batch(0, [(1, index)], round=("w-a", index)))
        b0.send(batch(0, [(2, 0)], round=("w-b", 0)))
        eventually(lambda: followed.rank_progress()[0].batches == 4)
        assert followed.rank_progress()[0] == progress(0, 4, rounds={"w-a": 2, "w-b": 1})
        a0.send(batch(0, [(1, 2)], round=("w-a", 2)))
        b0.send(batch(0, [(2, 1)], round=("w-b", 1)))
        eventually(lambda: followed.rank_progress()[0].batches == 6)
        assert followed.rank_progress()[0].rounds == {"w-a": 2, "w-b": 2}, "w-a's round 2 came late: never counted"

        reader = Reader(client)
        followed.set_quotas([_wire.EpochQuota(0, 6, False, (0, [("w-b", 0), ("w-a", 0)]))])
        assert [positions(reader.get()) for _ in range(2)] == [[(2, 0)], [(1, 0)]], "in the order, not as they came"
        reader.nothing_for()  # within the quota, but the order has no more
        assert followed.rank_progress()[0] == progress(0, 6, rounds={"w-a": 2, "w-b": 2}, position=2)
        # The dispatcher forgot the rounds every rank yielded.
        followed.set_quotas([_wire.EpochQuota(0, 6, False, (2, [("w-a", 1)]))])
        assert positions(reader.get()) == [(1, 1)]
        assert followed.rank_progress()[0].position == 3


def test_a_coordinated_follower_registers_so_and_acknowledges_its_rounds_and_position():
    dispatcher = RankDispatcher()
    with FakeClient(_consumers=2, _coordinated=True) as client:
        Follower(_Followed(client), dispatcher, "fake", "ns", "p", "j", 1, 1.0, consumers=2, coordinated=True)
        assert dispatcher.rank_fields == [{3: 1, 6: 2, 9: 1}]
        dispatcher.send_quotas(["a"], 1, [])
        eventually(lambda: ("a", 0) in client.streams)
        client.streams[("a", 0)].send(batch(0, [(1, 0)], round=("w-a", 0)))
        assert ack_where(dispatcher, lambda a: a["received"][0] == progress(0, 1, rounds={"w-a": 1}))
        reader = Reader(client)
        dispatcher.send_quotas(["a"], 1, [(0, 1, False, (0, [("w-a", 0)]))])
        assert positions(reader.get()) == [(1, 0)]
        assert ack_where(dispatcher, lambda a: a["received"][0] == progress(0, 1, rounds={"w-a": 1}, position=1)), \
            "the position goes to the dispatcher once yielded"


@pytest.mark.parametrize("consumers", [0, 1])
def test_coordinated_mode_needs_a_job_read_by_ranks(consumers):
    with pytest.raises(ValueError, match=r"declare consumers \(2 or more\)"):
        Client.from_dispatcher("127.0.0.1:1", "ns", "p", consumers=consumers, coordinated=True)
