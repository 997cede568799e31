"""What a client keeps for a dispatcher that restarts: every completion and row that arrived of
the job's unfinished epochs, told once in a Rejoin, after which the batches of the dispatcher
before are dropped and the completions told are not acknowledged again."""

from stoker_client._rejoin import Received
from stoker_client._wire import Held, Rejoin


def test_a_rejoin_tells_every_completion_and_row_that_arrived_merged_and_sorted():
    received = Received()
    # Two workers delivered rows of split 1, in any order; split 2 completed.
    received.arrived(0, [], {(0, 1): [7, 3]})
    received.arrived(0, [2], {(0, 1): [5], (0, 2): [0]})
    received.arrived(1, [], {(1, 4): [2]})
    assert received.rejoin(9, 3) == Rejoin(9, 0, 3, [(0, 2)], [Held(0, 1, [3, 5, 7]), Held(0, 2, [0]), Held(1, 4, [2])])


def test_a_taken_completion_drops_its_splits_rows_but_stays_told():
    received = Received()
    received.arrived(0, [1], {(0, 1): [0, 1], (0, 2): [4]})
    received.taken([(0, 1)])
    assert received.rejoin(1, 0) == Rejoin(1, 0, 0, [(0, 1)], [Held(0, 2, [4])])


def test_epochs_before_the_open_one_are_forgotten_and_their_stragglers_not_kept():
    received = Received()
    received.arrived(0, [1], {(0, 1): [0]})
    received.arrived(1, [2], {(1, 2): [0], (1, 3): [1]})
    received.saw_open_epoch(1)
    received.saw_open_epoch(0)  # an older answer changes nothing
    received.arrived(0, [5], {(0, 5): [0]})
    assert received.rejoin(1, 2) == Rejoin(1, 1, 2, [(1, 2)], [Held(1, 2, [0]), Held(1, 3, [1])])
    received.saw_open_epoch(2)
    assert received.reported == set()
    assert received.rejoin(2, 2) == Rejoin(2, 2, 2, [], [])


def test_after_a_rejoin_its_dispatchers_batches_are_dropped_and_its_completions_not_acknowledged():
    received = Received()
    received.arrived(0, [1], {(0, 1): [0]})
    assert not received.dropped(4)
    received.rejoin(4, 1)
    assert received.dropped(4) and not received.dropped(5) and not received.dropped(0)
    # Split 1's completion was told; split 2's arrives after, from the new dispatcher.
    received.arrived(0, [2], {(0, 2): [0]})
    assert received.unreported([(0, 1), (0, 2)]) == [(0, 2)]
    # A second restart: the new rejoin tells everything still kept, both told before and not.
    assert received.rejoin(5, 1) == Rejoin(5, 0, 1, [(0, 1), (0, 2)], [Held(0, 1, [0]), Held(0, 2, [0])])
    assert received.dropped(4) and received.dropped(5)
    assert received.unreported([(0, 2)]) == []


def test_a_dispatcher_that_does_not_tell_its_incarnation_is_not_retired():
    received = Received()
    assert received.rejoin(0, 0) == Rejoin(0, 0, 0, [], [])
    assert not received.dropped(0), "a standalone worker's batches, or an untelling dispatcher's, still come"
