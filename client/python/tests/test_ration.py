"""One rank's ration of an epoch: data batches go out up to the quota, completions pass in
order, and once the quota is final what is beyond it is dropped and counted."""

import numpy as np

from stoker_client._ration import Ration, Step, rows_in
from stoker_client.batch import Batch


def data(split, rows, completes=()):
    return Batch({"label": np.zeros(rows, dtype="<i8")}, 0, split, 0, completes, [split << 32 | p for p in range(rows)])


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
