//! What a client under the dispatcher has received, for its acknowledgements: the splits whose
//! last batch reached the training loop (which makes them done), and the rows of unfinished
//! splits by the worker they came from, so that when a worker leaves the list the rows it
//! delivered are reported and its split is produced again without them.
//!
//! It also keeps what a restarted dispatcher needs to go on without repeating anything
//! (`rejoin`): the completions and rows received of the unfinished epochs, even those already
//! reported, and from then on it refuses batches of the dispatcher it had (their rows are
//! produced again). A batch on its way into the queue (recorded, waiting for room) is not yet
//! received: a rejoin leaves it out and it is refused when room comes, for a stream stopped
//! meanwhile would drop it, and rows the new dispatcher was told of would never come.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use stoker_api::proto::RoundRef;
use stoker_api::ranks::Received;
use stoker_api::{Batch, WorkerId, row_origin};
use tokio::sync::Notify;

use crate::worker_stream::WorkerKey;

/// (epoch, split)
pub(crate) type SplitId = (u64, u64);

/// Rows of an unfinished split a client received from a worker that left the list.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Held {
    pub split: SplitId,
    pub positions: Vec<u32>,
}

/// What an acknowledgement carries (see `AcknowledgeRequest`).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Acknowledgement {
    pub completed: Vec<SplitId>,
    /// Completions an acknowledgement carried whose answer never came: the dispatcher may
    /// have applied them, and must not count them as repeats then.
    pub completed_again: Vec<SplitId>,
    pub held: Vec<Held>,
}

#[derive(Default)]
struct Inner {
    completed: Vec<SplitId>,
    /// Completions a failed acknowledgement carried, for the next one.
    completed_again: Vec<SplitId>,
    /// Positions received of each unfinished split, by worker.
    rows: HashMap<SplitId, HashMap<WorkerKey, Vec<u32>>>,
    /// Positions of unfinished splits already reported as held (their worker left the list).
    reported: HashMap<SplitId, Vec<u32>>,
    /// Splits of unfinished epochs whose completion arrived, and whether a rejoin reported it
    /// (then it is not acknowledged again).
    arrived: BTreeMap<SplitId, bool>,
    /// Splits of unfinished epochs whose completion the loop took: a split is acknowledged as
    /// done once, however many batches complete it (a dead worker's last batch still in the
    /// queue, and the empty production of its rows, all held, by the worker after it).
    done: BTreeSet<SplitId>,
    /// The job's open epoch as the dispatcher last said: every split of the epochs before it is
    /// done, so a batch completing one of them completes nothing (the second of two batches
    /// above, when the first finished the epoch and `done` forgot it).
    open: u64,
    /// Dispatchers this client rejoined another after: their batches are refused.
    retired: BTreeSet<u64>,
    /// Batches recorded and not yet in the queue: per (split, worker), where their positions
    /// start in `rows` (a worker's stream has one batch on its way at a time).
    in_flight: HashMap<(SplitId, WorkerKey), usize>,
    /// Completions recorded and not yet in the queue.
    arriving: BTreeSet<SplitId>,
    /// Held rows a failed acknowledgement carried, for the next one.
    held: Vec<Held>,
    /// A job read by ranks: what this rank received of each recent epoch.
    received: BTreeMap<u64, Received>,
    /// Coordinated mode: (epoch, worker) whose rounds came with a gap (a batch lost with a
    /// broken stream, or refused): their count stops there, so the order takes no round this
    /// rank lacks; what comes after is yielded after the order.
    gapped: BTreeSet<(u64, WorkerId)>,
}

/// Shared by the worker streams (which record rows), the caller's side of the client (which
/// records completions as batches are taken) and the follower (which acknowledges).
#[derive(Clone, Default)]
pub(crate) struct Delivery {
    inner: Arc<Mutex<Inner>>,
    /// A job read by ranks.
    ranked: bool,
    /// Woken when there is something to acknowledge.
    pub(crate) changed: Arc<Notify>,
}

/// Rows and completions recorded for a batch on its way into the client's queue: undone when
/// dropped before `keep` (the batch never got in, so it will not be yielded and must be
/// produced again).
pub(crate) struct Recorded<'d> {
    delivery: &'d Delivery,
    worker: WorkerKey,
    /// The dispatcher the batch was made under.
    incarnation: u64,
    /// Each split the batch had rows of, and how many of its positions were recorded before.
    before: Vec<(SplitId, usize)>,
    /// The completions it recorded as arrived.
    arrived: Vec<SplitId>,
}

impl Recorded<'_> {
    /// Call with room in the queue for the batch: true if it goes in (its rows and completions
    /// now count as received), false if it is refused (a rejoin retired its dispatcher while it
    /// waited, and did not count it) and is undone.
    pub(crate) fn keep(mut self) -> bool {
        let mut inner = self.delivery.inner.lock().unwrap();
        if inner.retired.contains(&self.incarnation) {
            drop(inner);
            return false;
        }
        for (split, _) in &self.before {
            inner.in_flight.remove(&(*split, self.worker.clone()));
        }
        for split in &self.arrived {
            inner.arriving.remove(split);
        }
        drop(inner);
        self.before.clear();
        self.arrived.clear();
        true
    }
}

impl Drop for Recorded<'_> {
    fn drop(&mut self) {
        if self.before.is_empty() && self.arrived.is_empty() {
            return;
        }
        let mut inner = self.delivery.inner.lock().unwrap();
        for (split, len) in &self.before {
            inner.in_flight.remove(&(*split, self.worker.clone()));
            if let Some(positions) = inner.rows.get_mut(split).and_then(|w| w.get_mut(&self.worker)) {
                positions.truncate(*len);
            }
        }
        for split in &self.arrived {
            inner.arriving.remove(split);
            inner.arrived.remove(split);
        }
    }
}

/// What a client tells a restarted dispatcher it has (`Delivery::rejoin`).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Had {
    pub completed: Vec<SplitId>,
    pub received: Vec<Held>,
}

impl Delivery {
    /// Records the rows and completions of `batch` from `worker` before it enters the queue;
    /// None if it is refused (made under a dispatcher this client rejoined another after).
    pub(crate) fn record<'d>(&'d self, worker: &WorkerKey, batch: &Batch) -> Option<Recorded<'d>> {
        let mut before: Vec<(SplitId, usize)> = Vec::new();
        let mut inner = self.inner.lock().unwrap();
        if inner.retired.contains(&batch.incarnation) {
            tracing::debug!(%worker, epoch = batch.epoch, rows = batch.rows.len(), completes = ?batch.completes, "refused a batch of a retired dispatcher");
            return None;
        }
        let mut arrived = Vec::new();
        for &split in &batch.completes {
            let id = (batch.epoch, split);
            if let std::collections::btree_map::Entry::Vacant(e) = inner.arrived.entry(id) {
                e.insert(false);
                arrived.push(id);
                inner.arriving.insert(id);
            }
        }
        for &row in &batch.rows {
            let (split, position) = row_origin(row);
            let id = (batch.epoch, split);
            let positions = inner.rows.entry(id).or_default().entry(worker.clone()).or_default();
            if !before.iter().any(|(s, _)| *s == id) {
                before.push((id, positions.len()));
            }
            positions.push(position);
        }
        for (id, len) in &before {
            inner.in_flight.insert((*id, worker.clone()), *len);
        }
        Some(Recorded { delivery: self, worker: worker.clone(), incarnation: batch.incarnation, before, arrived })
    }

    /// For a job read by ranks.
    pub(crate) fn ranked() -> Self {
        Delivery { ranked: true, ..Delivery::default() }
    }

    /// The training loop has `batch` (or it was dropped): the splits it completes are done, and
    /// unless other ranks must report them too, their rows forgotten.
    pub(crate) fn taken(&self, batch: &Batch) {
        if batch.completes.is_empty() {
            return;
        }
        let mut inner = self.inner.lock().unwrap();
        for &split in &batch.completes {
            let id = (batch.epoch, split);
            if !self.ranked {
                inner.rows.remove(&id);
                inner.reported.remove(&id);
            }
            // A rejoin told the dispatcher already, or an earlier batch did, or the epoch is over.
            if id.0 >= inner.open && inner.arrived.get(&id) != Some(&true) && inner.done.insert(id) {
                inner.completed.push(id);
            }
        }
        drop(inner);
        self.changed.notify_one();
    }

    /// A job read by ranks: a batch with tensors of `epoch` entered the queue, dealt in `round`
    /// in coordinated mode.
    pub(crate) fn received(&self, epoch: u64, round: Option<&RoundRef>) {
        if !self.ranked {
            return;
        }
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        let got = inner.received.entry(epoch).or_default();
        got.batches += 1;
        if let Some(round) = round {
            let worker = WorkerId::new(round.worker.as_str());
            let count = got.rounds.entry(worker.clone()).or_default();
            let key = (epoch, worker);
            if round.index == *count && !inner.gapped.contains(&key) {
                *count += 1;
            } else {
                inner.gapped.insert(key);
            }
        }
        drop(guard);
        self.changed.notify_one();
    }

    /// Coordinated mode: this rank has yielded `position` rounds of `epoch`'s order.
    pub(crate) fn yielded_rounds(&self, epoch: u64, position: u64) {
        self.update(epoch, |r| r.position = position);
    }

    /// A job read by ranks: every batch of `epoch` this rank gets has arrived.
    pub(crate) fn ended(&self, epoch: u64) {
        self.update(epoch, |r| r.ended = true);
    }

    /// A job read by ranks: `rows` of `epoch` dropped beyond its final quota.
    pub(crate) fn dropped(&self, epoch: u64, rows: u64) {
        self.update(epoch, |r| r.dropped_rows += rows);
    }

    fn update(&self, epoch: u64, f: impl FnOnce(&mut Received)) {
        if !self.ranked {
            return;
        }
        f(self.inner.lock().unwrap().received.entry(epoch).or_default());
        self.changed.notify_one();
    }

    /// Every epoch before `open` is finished: every rank reported each of its splits, so their
    /// rows will not be asked for, and the dispatcher has this rank's last counts of them but the
    /// last one (kept: another rank may need it for its final quota).
    pub(crate) fn finished_before(&self, open: u64) {
        let mut inner = self.inner.lock().unwrap();
        inner.open = inner.open.max(open);
        inner.rows.retain(|(epoch, _), _| *epoch >= open);
        inner.reported.retain(|(epoch, _), _| *epoch >= open);
        inner.arrived.retain(|(epoch, _), _| *epoch >= open);
        inner.done.retain(|(epoch, _)| *epoch >= open);
        while inner.received.len() > 1 && inner.received.keys().next().is_some_and(|&e| e + 1 < open) {
            inner.received.pop_first();
        }
        let oldest = inner.received.keys().next().copied().unwrap_or(open);
        inner.gapped.retain(|(epoch, _)| *epoch >= oldest);
    }

    /// Whether this client rejoined another dispatcher after `incarnation`: what it says is
    /// stale (a list it sent before it went, still buffered on the way).
    pub(crate) fn retired(&self, incarnation: u64) -> bool {
        self.inner.lock().unwrap().retired.contains(&incarnation)
    }

    /// What this rank received of its recent epochs (all of them each time: a restarted
    /// dispatcher learns them again from the next acknowledgement).
    pub(crate) fn progress(&self) -> Vec<(u64, Received)> {
        self.inner.lock().unwrap().received.iter().map(|(&e, r)| (e, r.clone())).collect()
    }

    /// What the next acknowledgement carries: the completions since the last, and the rows
    /// received from workers not in `listed` (forgotten here: a split is reported once).
    pub(crate) fn take(&self, listed: &BTreeSet<WorkerKey>) -> Acknowledgement {
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        let mut held = std::mem::take(&mut inner.held);
        for (split, by_worker) in inner.rows.iter_mut() {
            let gone: Vec<WorkerKey> = by_worker.keys().filter(|w| !listed.contains(*w)).cloned().collect();
            let mut positions: Vec<u32> = gone.iter().flat_map(|w| by_worker.remove(w).unwrap_or_default()).collect();
            if !positions.is_empty() {
                positions.sort_unstable();
                inner.reported.entry(*split).or_default().extend(&positions);
                held.push(Held { split: *split, positions });
            }
        }
        inner.rows.retain(|_, by_worker| !by_worker.is_empty());
        if !held.is_empty() {
            tracing::debug!(held = ?held.iter().map(|h| (h.split, h.positions.len())).collect::<Vec<_>>(), "rows of workers that left the list");
        }
        Acknowledgement {
            completed: std::mem::take(&mut inner.completed),
            completed_again: std::mem::take(&mut inner.completed_again),
            held,
        }
    }

    /// The dispatcher `incarnation` forgot this client: from now on its batches are refused,
    /// and what arrived of the epochs from `open` on is what the new one is told (the
    /// acknowledgements it had not taken go with it).
    pub(crate) fn rejoin(&self, incarnation: u64, open: u64) -> Had {
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        // 0 tags nothing to refuse: a standalone worker's batches, or a dispatcher before
        // incarnations.
        if incarnation != 0 {
            inner.retired.insert(incarnation);
        }
        inner.completed.clear();
        inner.held.clear();
        let mut completed = Vec::new();
        for (split, reported) in inner.arrived.range_mut((open, 0)..) {
            if !inner.arriving.contains(split) {
                *reported = true;
                completed.push(*split);
            }
        }
        let mut rows: BTreeMap<SplitId, Vec<u32>> = BTreeMap::new();
        for (split, by_worker) in inner.rows.iter().filter(|((e, _), _)| *e >= open) {
            for (worker, positions) in by_worker {
                let queued = inner.in_flight.get(&(*split, worker.clone())).copied().unwrap_or(positions.len());
                rows.entry(*split).or_default().extend(&positions[..queued]);
            }
        }
        for (split, positions) in inner.reported.iter().filter(|((e, _), _)| *e >= open) {
            rows.entry(*split).or_default().extend(positions);
        }
        let received = rows
            .into_iter()
            .filter(|(_, p)| !p.is_empty())
            .map(|(split, mut positions)| {
                positions.sort_unstable();
                positions.dedup();
                Held { split, positions }
            })
            .collect::<Vec<Held>>();
        tracing::debug!(
            incarnation,
            open,
            ?completed,
            received = ?received.iter().map(|h| (h.split, h.positions.len())).collect::<Vec<_>>(),
            "rejoining with what arrived"
        );
        Had { completed, received }
    }

    /// What a failed acknowledgement carried: it goes with the next (but what a rejoin told
    /// the dispatcher meanwhile), its completions as sent again.
    pub(crate) fn restore(&self, ack: Acknowledgement) {
        let mut inner = self.inner.lock().unwrap();
        let completed = ack.completed_again.into_iter().chain(ack.completed);
        let untold: Vec<SplitId> = completed.filter(|s| inner.arrived.get(s) != Some(&true)).collect();
        inner.completed_again.extend(untold);
        inner.held.extend(ack.held);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(epoch: u64, rows: &[(u64, u64)], completes: &[u64]) -> Batch {
        let rows = rows.iter().map(|&(s, p)| stoker_api::row(s, p)).collect();
        Batch { epoch, rows, completes: completes.to_vec(), ..Batch::default() }
    }

    fn listed(workers: &[&str]) -> BTreeSet<WorkerKey> {
        workers.iter().map(|&w| w.into()).collect()
    }

    #[test]
    fn rows_from_a_worker_that_left_are_reported_once_and_done_splits_not_at_all() {
        let d = Delivery::default();
        d.record(&"a".into(), &batch(0, &[(1, 0), (2, 5), (1, 3)], &[])).unwrap().keep();
        d.record(&"b".into(), &batch(0, &[(1, 1)], &[])).unwrap().keep();
        d.record(&"a".into(), &batch(0, &[(2, 6)], &[2])).unwrap().keep();
        d.taken(&batch(0, &[(2, 6)], &[2]));
        let Acknowledgement { completed, held, .. } = d.take(&listed(&["b"]));
        assert_eq!(completed, [(0, 2)]);
        assert_eq!(held, [Held { split: (0, 1), positions: vec![0, 3] }], "split 2 is done; b is still listed");
        assert_eq!(d.take(&listed(&["b"])), Acknowledgement::default(), "reported once");
        assert_eq!(d.take(&listed(&[])).held, [Held { split: (0, 1), positions: vec![1] }]);
    }

    #[test]
    fn a_split_completed_by_two_batches_is_acknowledged_once() {
        // Worker a died with the split's last batch in the queue; every row of it was held, so
        // b made it again with every position left out and completed it in an empty batch.
        let d = Delivery::default();
        d.record(&"a".into(), &batch(2, &[(2, 0), (2, 1)], &[2])).unwrap().keep();
        assert_eq!(d.take(&listed(&["b"])).held, [Held { split: (2, 2), positions: vec![0, 1] }]);
        d.record(&"b".into(), &batch(2, &[], &[2])).unwrap().keep();
        d.taken(&batch(2, &[(2, 0), (2, 1)], &[2]));
        assert_eq!(d.take(&listed(&["b"])).completed, [(2, 2)]);
        d.taken(&batch(2, &[], &[2]));
        assert_eq!(d.take(&listed(&["b"])), Acknowledgement::default(), "done once");
    }

    #[test]
    fn a_split_completed_again_after_its_epoch_finished_is_not_acknowledged() {
        // As above, but the first batch finished epoch 2: the client heard epoch 3 is open (and
        // forgot epoch 2's splits) before the empty production came.
        let d = Delivery::default();
        d.record(&"a".into(), &batch(2, &[(2, 0), (2, 1)], &[2])).unwrap().keep();
        d.taken(&batch(2, &[(2, 0), (2, 1)], &[2]));
        assert_eq!(d.take(&listed(&["a"])).completed, [(2, 2)]);
        d.finished_before(3);
        d.record(&"b".into(), &batch(2, &[], &[2])).unwrap().keep();
        d.taken(&batch(2, &[], &[2]));
        assert_eq!(d.take(&listed(&["b"])), Acknowledgement::default(), "epoch 2 is over");
        // An older open epoch heard late moves nothing back.
        d.finished_before(1);
        d.taken(&batch(2, &[], &[2]));
        assert_eq!(d.take(&listed(&["b"])), Acknowledgement::default());
    }

    #[test]
    fn a_batch_that_never_entered_the_queue_is_not_held() {
        let d = Delivery::default();
        d.record(&"a".into(), &batch(3, &[(1, 0)], &[])).unwrap().keep();
        drop(d.record(&"a".into(), &batch(3, &[(1, 1), (1, 2)], &[])));
        assert_eq!(d.take(&listed(&[])).held, [Held { split: (3, 1), positions: vec![0] }]);
    }

    #[test]
    fn a_failed_acknowledgement_goes_with_the_next_its_completions_as_sent_again() {
        let d = Delivery::default();
        d.record(&"a".into(), &batch(0, &[(4, 2)], &[])).unwrap().keep();
        d.taken(&batch(0, &[], &[7]));
        let first = d.take(&listed(&[]));
        assert_eq!((first.completed.as_slice(), first.held.len()), (&[(0, 7)][..], 1));
        d.restore(first.clone());
        d.taken(&batch(0, &[], &[8]));
        let again = Acknowledgement { completed: vec![(0, 8)], completed_again: first.completed, held: first.held };
        assert_eq!(d.take(&listed(&[])), again, "the dispatcher may have applied the first: it is told");
        d.restore(again.clone());
        let third = d.take(&listed(&[]));
        assert_eq!((third.completed, third.completed_again), (vec![], vec![(0, 7), (0, 8)]), "failed twice");
    }

    #[test]
    fn a_rank_keeps_a_completed_splits_rows_until_its_epoch_is_finished_and_counts_what_it_got() {
        let d = Delivery::ranked();
        d.record(&"a".into(), &batch(0, &[(1, 0), (1, 1)], &[1])).unwrap().keep();
        d.taken(&batch(0, &[(1, 0), (1, 1)], &[1]));
        d.received(0, None);
        d.received(0, None);
        d.dropped(0, 5);
        d.ended(0);
        d.received(1, None);
        let Acknowledgement { completed, held, .. } = d.take(&listed(&[]));
        assert_eq!(completed, [(0, 1)]);
        assert_eq!(held, [Held { split: (0, 1), positions: vec![0, 1] }], "other ranks may not have reported it");
        assert_eq!(
            d.progress(),
            [
                (0, Received { batches: 2, ended: true, dropped_rows: 5, ..Received::default() }),
                (1, Received { batches: 1, ..Received::default() })
            ]
        );
        d.record(&"a".into(), &batch(0, &[(2, 0)], &[])).unwrap().keep();
        d.finished_before(1);
        assert_eq!(d.take(&listed(&[])).held, [], "epoch 0 is finished");
        d.finished_before(3);
        assert_eq!(d.progress().len(), 1, "the last epoch's counts stay");
    }

    #[test]
    fn a_rejoin_tells_everything_that_arrived_of_the_open_epochs_and_refuses_the_old_dispatchers_batches() {
        let d = Delivery::default();
        d.record(&"a".into(), &batch(4, &[(1, 0), (1, 3)], &[])).unwrap().keep();
        d.record(&"b".into(), &batch(4, &[(1, 1), (2, 0)], &[2])).unwrap().keep();
        d.record(&"b".into(), &batch(5, &[(0, 8)], &[])).unwrap().keep();
        d.record(&"b".into(), &batch(3, &[(6, 1)], &[6])).unwrap().keep();
        assert_eq!(d.take(&listed(&["b"])).held, [Held { split: (4, 1), positions: vec![0, 3] }], "a left");
        let had = d.rejoin(7, 4);
        assert_eq!(had.completed, [(4, 2)], "arrived, not yet taken; epoch 3 is finished");
        assert_eq!(
            had.received,
            [
                Held { split: (4, 1), positions: vec![0, 1, 3] },
                Held { split: (4, 2), positions: vec![0] },
                Held { split: (5, 0), positions: vec![8] },
            ],
            "a's rows though already reported, and the next epoch's"
        );
        let old = Batch { incarnation: 7, ..batch(4, &[(3, 0)], &[3]) };
        assert!(d.record(&"b".into(), &old).is_none(), "the old dispatcher's batches are refused");
        let new = Batch { incarnation: 8, ..batch(4, &[(3, 0)], &[]) };
        d.record(&"b".into(), &new).unwrap().keep();
        d.taken(&batch(4, &[(2, 0)], &[2]));
        assert_eq!(d.take(&listed(&["b"])).completed, [], "the rejoin told the completion already");
        d.restore(Acknowledgement { completed: vec![(4, 2)], ..Acknowledgement::default() });
        assert_eq!(
            d.take(&listed(&["b"])),
            Acknowledgement::default(),
            "nor does a failed acknowledgement bring it back"
        );
        let again = d.rejoin(8, 4);
        assert_eq!(again.completed, [(4, 2)]);
        assert_eq!(again.received[1], Held { split: (4, 3), positions: vec![0] }, "the new dispatcher's rows too");
        let zero = batch(4, &[(3, 1)], &[]);
        assert!(d.record(&"b".into(), &zero).is_some(), "0 is never refused");
    }

    /// Found on real pods: a batch of the old dispatcher waiting for room in the queue when
    /// the client rejoined was told to the new one as received, then dropped with its stream
    /// (its worker was not listed yet): the new dispatcher never had those rows produced.
    #[test]
    fn a_batch_waiting_for_room_at_a_rejoin_is_left_out_and_refused() {
        let d = Delivery::default();
        let old = |rows: &[(u64, u64)], completes: &[u64]| Batch { incarnation: 7, ..batch(4, rows, completes) };
        assert!(d.record(&"a".into(), &old(&[(1, 0), (1, 1)], &[])).unwrap().keep());
        let waiting = d.record(&"a".into(), &old(&[(1, 2), (2, 0)], &[1])).unwrap();
        let dropped = d.record(&"b".into(), &old(&[(3, 0)], &[3])).unwrap();
        let had = d.rejoin(7, 4);
        assert_eq!(had.received, [Held { split: (4, 1), positions: vec![0, 1] }], "only what is in the queue");
        assert_eq!(had.completed, [], "a completion not yet in the queue has not arrived");
        assert!(!waiting.keep(), "refused when room comes: the new dispatcher has its rows produced");
        drop(dropped);
        let again = d.rejoin(8, 4);
        assert_eq!(again.received, had.received, "the refused and the dropped batch left nothing behind");
        assert_eq!(again.completed, []);
        let new = Batch { incarnation: 9, ..batch(4, &[(1, 2)], &[1]) };
        assert!(d.record(&"a".into(), &new).unwrap().keep(), "the new dispatcher's batches go in");
    }

    /// What the accounting costs per batch, as the client does it: rows recorded as a batch is
    /// queued, a split completed every 10 batches, an acknowledgement taken then. By hand:
    /// `cargo test --release -p stoker-client --lib accounting -- --ignored --nocapture`
    #[test]
    fn a_ranks_rounds_count_without_a_gap() {
        let d = Delivery::ranked();
        let round = |worker: &str, index| RoundRef { worker: worker.into(), index };
        for index in [0, 1, 3, 4] {
            d.received(2, Some(&round("a", index)));
        }
        d.received(2, Some(&round("b", 0)));
        d.yielded_rounds(2, 1);
        let (_, got) = d.progress().pop().unwrap();
        let rounds: Vec<(&str, u64)> = got.rounds.iter().map(|(w, &n)| (w.as_str(), n)).collect();
        assert_eq!(rounds, [("a", 2), ("b", 1)], "a's round 2 never came: its count stops at 2");
        assert_eq!((got.batches, got.position), (5, 1));
    }

    #[test]
    #[ignore = "benchmark: run by hand in release"]
    fn accounting_cost_per_batch() {
        for rows in [14u64, 256] {
            let batches: Vec<Batch> = (0..20_000u64)
                .map(|i| {
                    let split = i / 10;
                    let origins: Vec<(u64, u64)> = (0..rows).map(|r| (split, (i % 10) * rows + r)).collect();
                    let completes = if i % 10 == 9 { vec![split] } else { vec![] };
                    batch(0, &origins, &completes)
                })
                .collect();
            let d = Delivery::default();
            let listed = listed(&["w"]);
            let start = std::time::Instant::now();
            for b in &batches {
                d.record(&"w".into(), b).unwrap().keep();
                d.taken(b);
                if !b.completes.is_empty() {
                    d.take(&listed);
                }
            }
            let per_batch = start.elapsed().as_nanos() as f64 / batches.len() as f64;
            println!(
                "{rows} rows per batch: {:.0} ns per batch ({:.1} ns per row)",
                per_batch,
                per_batch / rows as f64
            );
        }
    }
}
