//! Under the dispatcher the client streams each epoch separately and queues each separately, so
//! the training loop gets all of an epoch before any of the next, and a next epoch read ahead
//! (bounded) never holds the current one back.
//!
//! An epoch's queue ends once every stream of that epoch has ended and the dispatcher has said
//! the epoch is finished: each stream holds a sender, and the queue keeps one more until the
//! dispatcher's word (`finish_before`). When the queue then reads `None`, everything of the
//! epoch this client will ever get has been read.

use std::collections::BTreeMap;
use std::sync::Mutex;

use stoker_api::Batch;
use tokio::sync::mpsc;

use crate::error::Error;

pub(crate) type Item = Result<Batch, Error>;

struct Slot {
    /// Dropped once the dispatcher says the epoch is finished.
    kept: Option<mpsc::Sender<Item>>,
    /// Taken by the caller's side when it starts reading the epoch.
    rx: Option<mpsc::Receiver<Item>>,
}

pub(crate) struct Epochs {
    slots: Mutex<(BTreeMap<u64, Slot>, u64)>,
    capacity: usize,
}

impl Epochs {
    /// Queues of `capacity` batches each.
    pub(crate) fn new(capacity: usize) -> Self {
        Epochs { slots: Mutex::new((BTreeMap::new(), 0)), capacity }
    }

    fn with_slot<R>(&self, epoch: u64, f: impl FnOnce(&mut Slot) -> R) -> R {
        let mut guard = self.slots.lock().unwrap();
        let (slots, finished_below) = &mut *guard;
        let finished = epoch < *finished_below;
        let slot = slots.entry(epoch).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(self.capacity);
            Slot { kept: (!finished).then_some(tx), rx: Some(rx) }
        });
        f(slot)
    }

    /// A sender for a new stream of `epoch`; None once the epoch is finished (a new stream
    /// would bring nothing: what was still on its way is on the streams already open).
    pub(crate) fn sender(&self, epoch: u64) -> Option<mpsc::Sender<Item>> {
        self.with_slot(epoch, |slot| slot.kept.clone())
    }

    /// The queue of `epoch`, for the caller's side (once).
    pub(crate) fn take_receiver(&self, epoch: u64) -> mpsc::Receiver<Item> {
        self.with_slot(epoch, |slot| slot.rx.take()).expect("each epoch's queue is read once")
    }

    /// The dispatcher says every epoch before `open` is finished.
    pub(crate) fn finish_before(&self, open: u64) {
        let mut guard = self.slots.lock().unwrap();
        let (slots, finished_below) = &mut *guard;
        *finished_below = (*finished_below).max(open);
        for (_, slot) in slots.range_mut(..open) {
            slot.kept = None;
        }
        // Queues read to the end are gone; the caller holds the one it reads.
        slots.retain(|&epoch, slot| epoch >= open || slot.rx.is_some());
    }

    /// Whether any queue not taken by the caller holds batches (read ahead and never used).
    pub(crate) fn any_queued(&self) -> bool {
        let guard = self.slots.lock().unwrap();
        guard.0.values().any(|slot| slot.rx.as_ref().is_some_and(|rx| !rx.is_empty()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_epoch_ends_once_its_streams_ended_and_the_dispatcher_finished_it() {
        let epochs = Epochs::new(4);
        let stream = epochs.sender(0).unwrap();
        let mut rx = epochs.take_receiver(0);
        stream.send(Ok(Batch::default())).await.unwrap();
        drop(stream);
        assert!(rx.recv().await.is_some());
        assert!(rx.try_recv().is_err(), "the dispatcher has not finished it: more may come");
        epochs.finish_before(1);
        assert!(rx.recv().await.is_none(), "finished and no stream left");
        assert!(epochs.sender(0).is_none(), "no new stream of a finished epoch");
    }

    #[tokio::test]
    async fn an_epoch_finished_before_anyone_looked_is_over_at_once() {
        let epochs = Epochs::new(4);
        epochs.finish_before(3);
        assert!(epochs.take_receiver(2).recv().await.is_none());
        assert!(epochs.sender(3).is_some());
    }

    #[tokio::test]
    async fn batches_read_ahead_count_as_queued() {
        let epochs = Epochs::new(4);
        let _current = epochs.take_receiver(0);
        assert!(!epochs.any_queued());
        epochs.sender(1).unwrap().send(Ok(Batch::default())).await.unwrap();
        assert!(epochs.any_queued());
    }
}
