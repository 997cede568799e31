"""One rank's ration of an epoch: data batches go out up to the quota, completions pass in
order, and once the quota is final what is beyond it is dropped and counted. In coordinated
mode the rounds go out in the dispatcher's order first, and the rank counts the rounds it
received of each worker without a gap."""

import numpy as np

from stoker_client._ration import Ration, Step, rows_in
from stoker_client.batch import Batch


def data(split, rows, completes=()):
    return Batch({"label": np.zeros(rows, dtype="<i8")}, 0, split, 0, completes, [split << 32 | p for p in range(rows)])


def dealt(split, worker, index, rows=2):
    """A data batch of a coordinated job, dealt in round `index` of `worker`."""
    batch = data(split, rows)
    batch.round = (worker, index)
    return batch


def completions(*splits):
    return Batch({}, 0, splits[0], 0, splits)


def steps(ration):
    """(step, batch) until the ration waits or is done, the last one included."""
    out = []
    while True:
        step, batch = ration.step()
        out.append((step, batch))
        if step in (Step.WAIT, Step.DONE):
            return out


def test_data_batches_go_out_up_to_the_quota_then_wait():
    ration = Ration()
    batches = [data(1, 4), data(1, 4), data(2, 4)]
    for b in batches:
        ration.push(b)
    assert steps(ration) == [(Step.WAIT, None)], "no quota yet"
    ration.set_quota(2, complete=False)
    assert steps(ration) == [(Step.YIELD, batches[0]), (Step.YIELD, batches[1]), (Step.WAIT, None)]
    assert ration.yielded == 2 and list(ration.held) == [batches[2]]


def test_a_rising_quota_lets_the_next_batch_go():
    ration = Ration()
    ration.set_quota(1, complete=False)
    first, second = data(1, 4), data(1, 4)
    ration.push(first)
    ration.push(second)
    assert steps(ration) == [(Step.YIELD, first), (Step.WAIT, None)]
    ration.set_quota(2, complete=False)
    assert steps(ration) == [(Step.YIELD, second), (Step.WAIT, None)]


def test_completions_pass_in_order_without_counting():
    ration = Ration()
    ration.set_quota(1, complete=False)
    first, done, held, late = data(1, 4), completions(1), data(2, 4), completions(2)
    for b in (first, done, held, late):
        ration.push(b)
    # `late` waits behind `held`: completions are taken strictly in arrival order.
    assert steps(ration) == [(Step.YIELD, first), (Step.PASS, done), (Step.WAIT, None)]
    assert ration.yielded == 1 and list(ration.held) == [held, late]
    ration.set_quota(2, complete=False)
    assert steps(ration) == [(Step.YIELD, held), (Step.PASS, late), (Step.WAIT, None)]
    assert ration.yielded == 2


def test_a_complete_quota_drops_the_rest_and_counts_their_rows():
    ration = Ration()
    kept, extra, done, last = data(1, 4), data(2, 3, completes=[2]), completions(1), data(3, 2)
    for b in (kept, extra, done, last):
        ration.push(b)
    ration.set_quota(1, complete=True)
    ration.end()
    assert steps(ration) == [(Step.YIELD, kept), (Step.DROP, extra), (Step.PASS, done), (Step.DROP, last),
                             (Step.DONE, None)]
    assert (ration.yielded, ration.dropped_rows) == (1, 5)


def test_done_only_once_ended_and_nothing_is_held():
    ration = Ration()
    assert ration.step() == (Step.WAIT, None)
    ration.set_quota(0, complete=False)
    only = completions(4)
    ration.push(only)
    ration.end()
    assert steps(ration) == [(Step.PASS, only), (Step.DONE, None)]
    # Ended with a batch beyond a quota that is not final yet: it waits for the final one.
    ration = Ration()
    beyond = data(1, 2)
    ration.push(beyond)
    ration.end()
    assert steps(ration) == [(Step.WAIT, None)]
    ration.set_quota(0, complete=True)
    assert steps(ration) == [(Step.DROP, beyond), (Step.DONE, None)]


def test_rows_come_from_the_row_ids_or_the_tensors():
    assert rows_in(data(1, 5)) == 5
    assert rows_in(Batch({"x": np.zeros((3, 2))}, 0, 0, 0)) == 3
    assert rows_in(completions(1)) == 0


def test_coordinated_rounds_go_out_in_the_order_whatever_order_they_arrived_in():
    ration = Ration()
    a0, a1, b0 = dealt(1, "a", 0), dealt(1, "a", 1), dealt(2, "b", 0)
    for b in (a0, a1, b0):
        ration.push(b)
    ration.set_quota(3, False, (0, [("b", 0), ("a", 0)]))
    assert steps(ration) == [(Step.YIELD, b0), (Step.YIELD, a0), (Step.WAIT, None)], \
        "a's round 1 is not in the order yet, though within the quota"
    assert (ration.position, ration.yielded, list(ration.held)) == (2, 2, [a1])


def test_a_round_in_the_order_not_held_yet_is_waited_for():
    ration = Ration()
    a0, b0 = dealt(1, "a", 0), dealt(2, "b", 0)
    ration.push(a0)
    ration.set_quota(2, False, (0, [("a", 0), ("b", 0)]))
    assert steps(ration) == [(Step.YIELD, a0), (Step.WAIT, None)], "b's round 0 is on its way"
    # The dispatcher forgot the round every rank yielded: the order starts at position 1.
    ration.set_quota(2, False, (1, [("b", 0)]))
    assert steps(ration) == [(Step.WAIT, None)]
    ration.push(b0)
    assert steps(ration) == [(Step.YIELD, b0), (Step.WAIT, None)]
    assert ration.position == 2


def test_an_order_with_nothing_at_the_position_waits_until_the_quota_is_final_even_within_it():
    ration = Ration()
    a0 = dealt(1, "a", 0)
    ration.push(a0)
    ration.set_quota(5, False, (0, []))
    assert steps(ration) == [(Step.WAIT, None)], "coordinated, nothing ordered yet"
    ration.end()
    assert steps(ration) == [(Step.WAIT, None)], "the order may still take it"
    ration.set_quota(5, True, (0, [("a", 0)]))
    assert steps(ration) == [(Step.YIELD, a0), (Step.DONE, None)]
    # Ended with nothing held: done, whatever the quota says.
    ration = Ration()
    ration.set_quota(0, False, (0, []))
    ration.end()
    assert steps(ration) == [(Step.DONE, None)]


def test_after_the_order_a_final_quota_takes_the_rest_in_arrival_order_then_drops():
    ration = Ration()
    a0, a1, dead4, b2 = dealt(1, "a", 0), dealt(1, "a", 1), dealt(3, "dead", 4), dealt(2, "b", 2, rows=3)
    for b in (a0, a1, dead4, b2):
        ration.push(b)
    ration.end()
    ration.set_quota(3, True, (0, [("a", 0)]))
    assert steps(ration) == [(Step.YIELD, a0), (Step.YIELD, a1), (Step.YIELD, dead4), (Step.DROP, b2),
                             (Step.DONE, None)], "the order first, then in arrival order within the quota"
    assert (ration.position, ration.yielded, ration.dropped_rows) == (1, 3, 3)


def test_completions_pass_in_a_coordinated_epoch_too():
    ration = Ration()
    done, a0 = completions(1), dealt(1, "a", 0)
    ration.push(done)
    ration.push(a0)
    ration.set_quota(1, False, (0, [("a", 0)]))
    assert steps(ration) == [(Step.PASS, done), (Step.YIELD, a0), (Step.WAIT, None)]


def test_an_epoch_without_an_order_goes_in_arrival_order():
    ration = Ration()
    a1, a0 = dealt(1, "a", 1), dealt(1, "a", 0)
    ration.push(a1)
    ration.push(a0)
    ration.set_quota(2, False)
    assert steps(ration) == [(Step.YIELD, a1), (Step.YIELD, a0), (Step.WAIT, None)], \
        "read across a dispatcher restart: not coordinated"
    assert ration.position == 0


def test_a_workers_rounds_count_without_a_gap_from_round_0():
    ration = Ration()
    for index in (0, 1, 3, 4, 2):
        ration.arrived(("a", index))
    ration.arrived(("b", 0))
    ration.arrived(("c", 1))
    ration.arrived(None)
    assert ration.rounds == {"a": 2, "b": 1, "c": 0}, "a's round 2 came late and c's round 0 never: they stop"
    assert ration.received == 8
