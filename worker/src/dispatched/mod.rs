//! Running under the dispatcher: the worker registers, heartbeats its progress (`link`), and
//! for each job with a consumer attached pulls splits one at a time (dynamic sharding), one
//! producer per epoch, which stops when nobody has read its epoch for a while. Each batch names
//! the splits whose last element it holds; the client that receives it tells the dispatcher,
//! so a split is done only once its data has arrived (what a dying worker had sent but the
//! client never got is produced again). The worker itself reports only splits that produced
//! no batch at all.
//!
//! The dispatcher may restart or move (leader change): every call retries, and an unknown-id
//! answer makes the worker register again under the same id. Clients see a pause, not an error.

mod link;
mod readers;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use stoker_api::proto::next_split_response::Next;
use stoker_api::{Batch, JobName, JobShape};
use tonic::Status;

use crate::deal::{Deal, Queued};
use crate::engine::{Assigned, Engine, Ready};
use crate::stream::{BatchSource, Batches, Outgoing, Subscription};
use link::{Handed, fnv1a};
pub use link::{Link, plan_digest};
pub use readers::DispatcherReaders;

/// One epoch of a job's ready batches for one rank (or for all its consumers), each naming the
/// splits it completes.
type EpochBatches = Arc<tokio::sync::Mutex<Hand>>;

/// One rank's queue of an epoch, and the item a stream took from it and left for the next
/// stream (see `DispatchedSource::subscribe`).
struct Hand {
    queue: tokio::sync::mpsc::Receiver<Queued>,
    pending: Option<Queued>,
}

impl Hand {
    /// Drops the batches queued before this worker registered again (`generation`), up to the
    /// first made since: no stream would send them (see `DispatchedSource::subscribe`).
    fn drop_stale(&mut self, generation: u64) {
        if self.pending.as_ref().is_some_and(|q| !q.stale(generation)) {
            return;
        }
        self.pending = None;
        while let Ok(queued) = self.queue.try_recv() {
            if !queued.stale(generation) {
                self.pending = Some(queued);
                return;
            }
        }
    }
}

/// (job, epoch)
type EpochKey = (JobName, u64);

/// The epochs of each job this worker's producers are busy with: from the first split handed
/// out until a run has ended and the dispatcher has nothing more of the epoch. A producer waits while an earlier epoch of its job is busy, so the
/// next epoch is made with what the current one leaves idle (its last splits held elsewhere)
/// and never takes a core from it.
#[derive(Default)]
struct Busy(Mutex<HashMap<JobName, BTreeSet<u64>>>);

impl Busy {
    fn set(&self, job: &JobName, epoch: u64, busy: bool) {
        let mut jobs = self.0.lock().unwrap();
        let epochs = jobs.entry(job.clone()).or_default();
        if busy {
            epochs.insert(epoch);
        } else {
            epochs.remove(&epoch);
        }
    }

    fn earlier(&self, job: &JobName, epoch: u64) -> bool {
        self.0.lock().unwrap().get(job).is_some_and(|epochs| epochs.range(..epoch).next().is_some())
    }
}

struct EpochJob {
    /// By rank; one queue when the job's consumers share its batches.
    batches: Vec<EpochBatches>,
    /// The job's ranks as its first consumer here declared (1: shared), and whether they are
    /// dealt rounds (coordinated mode).
    shape: JobShape,
    /// When the job's next batch may go out, under `--max-batch-rate`: shared by its epochs,
    /// so reading the next epoch ahead does not double the rate.
    next_send: Arc<tokio::sync::Mutex<tokio::time::Instant>>,
    /// Streams reading the epoch now, and since when none has (None while one does).
    attached: Mutex<(usize, Option<std::time::Instant>)>,
}

impl EpochJob {
    /// How long no stream has read the epoch; None while one does.
    fn unread_for(&self) -> Option<Duration> {
        self.attached.lock().unwrap().1.map(|since| since.elapsed())
    }

    /// With no stream reading the epoch, drops what its producer made before this worker
    /// registered again (`generation`). A producer waiting for room behind such batches (made
    /// before the worker was frozen past its timeout, say) would otherwise wait until the epoch
    /// is abandoned when its client has finished the epoch and opens no stream to take them:
    /// a minute, with the job's next epoch on this worker waiting behind it (`Busy`), never
    /// told that it was over, and the client's stream of that next epoch, so the client's end
    /// of it, held open as long.
    fn drop_stale(&self, generation: u64) {
        if self.unread_for().is_none() {
            // A stream reading it drops them itself.
            return;
        }
        for hand in &self.batches {
            if let Ok(mut hand) = hand.try_lock() {
                hand.drop_stale(generation);
            }
        }
    }

    /// Ends the epoch's queues: its producer's sends fail, its run ends, and so does it.
    fn close(&self) {
        for rx in &self.batches {
            rx.blocking_lock().queue.close();
        }
    }
}

/// A stream reading an epoch; the epoch counts it until it is dropped.
struct Attached(Arc<EpochJob>);

impl Attached {
    fn new(epoch_job: Arc<EpochJob>) -> Self {
        {
            let mut attached = epoch_job.attached.lock().unwrap();
            attached.0 += 1;
            attached.1 = None;
        }
        Attached(epoch_job)
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        let mut attached = self.0.attached.lock().unwrap();
        attached.0 -= 1;
        if attached.0 == 0 {
            attached.1 = Some(std::time::Instant::now());
        }
    }
}

/// The engine as a batch source under the dispatcher: each epoch of each job has its own
/// producer, started by its first consumer and ended when the dispatcher says the epoch is
/// finished, so a job's next epoch never waits behind this one's stragglers, nor this one
/// behind a consumer that is not reading the next yet.
pub struct DispatchedSource {
    engine: Arc<Engine>,
    link: Arc<Link>,
    /// Least time between two batches of a job, from `--max-batch-rate`.
    min_interval: Option<Duration>,
    epochs: Arc<Mutex<HashMap<EpochKey, Arc<EpochJob>>>>,
    busy: Arc<Busy>,
    /// Per job: when its next batch may go out.
    next_sends: Mutex<HashMap<JobName, Arc<tokio::sync::Mutex<tokio::time::Instant>>>>,
    /// The first fatal engine error, for heartbeats (and so the DataPipeline status).
    pub errors: Arc<Mutex<Option<String>>>,
}

/// How long an epoch's producer goes on with no stream reading it before it stops, returning
/// the splits it held to the dispatcher's queue: longer than the dispatcher's client timeout
/// (30 s by default), so a client that reconnects within it finds its epoch where it was. A job whose clients left would otherwise keep a blocked
/// producer, its memory reservations and a thread on every worker for good.
pub const ABANDONED_AFTER: Duration = Duration::from_secs(60);
/// The most epochs this worker produces at once, over all jobs: a job reads two at most (the
/// current and the next), so this is room for 32 jobs. Each is a thread and its queues; a
/// reader naming ever new jobs or epochs gets RESOURCE_EXHAUSTED instead of more.
pub const MAX_EPOCH_PRODUCERS: usize = 64;

impl DispatchedSource {
    /// `max_batch_rate` caps the batches per second this worker sends per job and epoch; an
    /// epoch no stream has read for `abandoned_after` stops, and one no stream reads loses its
    /// batches made before this worker registered again (within a second).
    pub fn new(engine: Arc<Engine>, link: Arc<Link>, max_batch_rate: Option<f64>, abandoned_after: Duration) -> Self {
        let min_interval = max_batch_rate.filter(|r| *r > 0.0).map(|r| Duration::from_secs_f64(1.0 / r));
        let epochs: Arc<Mutex<HashMap<EpochKey, Arc<EpochJob>>>> = Arc::default();
        let watched = Arc::downgrade(&epochs);
        let registered = link.clone();
        std::thread::Builder::new()
            .name("stoker-abandoned".into())
            .spawn(move || {
                while let Some(epochs) = watched.upgrade() {
                    let abandoned: Vec<(EpochKey, Arc<EpochJob>)> = {
                        let mut epochs = epochs.lock().unwrap();
                        let generation = registered.generation();
                        epochs.values().for_each(|e| e.drop_stale(generation));
                        let keys: Vec<EpochKey> = epochs
                            .iter()
                            .filter(|(_, e)| e.unread_for().is_some_and(|d| d >= abandoned_after))
                            .map(|(k, _)| k.clone())
                            .collect();
                        keys.into_iter().filter_map(|k| epochs.remove(&k).map(|e| (k, e))).collect()
                    };
                    drop(epochs);
                    for ((job, epoch), epoch_job) in abandoned {
                        tracing::info!(%job, epoch, "no consumer read the epoch for {abandoned_after:?}: its producer stops");
                        epoch_job.close();
                    }
                    std::thread::sleep((abandoned_after / 4).clamp(Duration::from_millis(100), Duration::from_secs(1)));
                }
            })
            .expect("spawning the abandoned-epoch watcher");
        DispatchedSource {
            engine,
            link,
            min_interval,
            epochs,
            next_sends: Mutex::default(),
            busy: Arc::default(),
            errors: Arc::new(Mutex::new(None)),
        }
    }

    /// Each epoch in production: its job, its number, and the batches made and not yet taken
    /// by a stream (summed over ranks), for the metrics. An epoch a stream is taking a batch
    /// from at this moment counts what it can see.
    pub fn queue_depths(&self) -> Vec<(JobName, u64, usize)> {
        let epochs = self.epochs.lock().unwrap();
        let mut depths: Vec<(JobName, u64, usize)> = epochs
            .iter()
            .map(|((job, epoch), e)| {
                let queued = (e.batches.iter())
                    .filter_map(|hand| hand.try_lock().ok().map(|h| h.queue.len() + usize::from(h.pending.is_some())))
                    .sum();
                (job.clone(), *epoch, queued)
            })
            .collect();
        depths.sort();
        depths
    }

    fn epoch(&self, key: EpochKey, shape: JobShape) -> Result<Arc<EpochJob>, Status> {
        let mut epochs = self.epochs.lock().unwrap();
        if let Some(epoch_job) = epochs.get(&key) {
            return Ok(epoch_job.clone());
        }
        if epochs.len() >= MAX_EPOCH_PRODUCERS {
            return Err(Status::resource_exhausted(format!(
                "this worker already produces {} epochs (jobs read two at most); job {:?} epoch {} must wait for one to end",
                epochs.len(),
                key.0.as_str(),
                key.1
            )));
        }
        let next_send = {
            let mut next_sends = self.next_sends.lock().unwrap();
            // Only jobs with an epoch in production keep their pace.
            next_sends.retain(|job, _| *job == key.0 || epochs.keys().any(|(j, _)| j == job));
            next_sends
                .entry(key.0.clone())
                .or_insert_with(|| Arc::new(tokio::sync::Mutex::new(tokio::time::Instant::now())))
                .clone()
        };
        // Workers begin dealing at different ranks, and each epoch at another one.
        let first = fnv1a(self.link.registration.address.as_bytes()).wrapping_add(key.1);
        let (mut deal, hands) = if shape.coordinated {
            Deal::in_rounds(shape.ranks, 1, self.link.id())
        } else {
            Deal::new(shape.ranks, 1, first)
        };
        let batches =
            hands.into_iter().map(|queue| Arc::new(tokio::sync::Mutex::new(Hand { queue, pending: None }))).collect();
        let epoch_job = Arc::new(EpochJob {
            batches,
            shape,
            next_send,
            attached: Mutex::new((0, Some(std::time::Instant::now()))),
        });
        let this = Arc::downgrade(&epoch_job);
        let (engine, link, errors, registry, busy) =
            (self.engine.clone(), self.link.clone(), self.errors.clone(), self.epochs.clone(), self.busy.clone());
        // Busy until its first answer: a later epoch's producer started at the same
        // moment must not take the splits first.
        busy.set(&key.0, key.1, true);
        // A reader names the job: only its plain characters go into the thread's name (a
        // NUL would fail the spawn; Linux shows 15 bytes of it anyway).
        let plain: String =
            key.0.as_str().chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').take(32).collect();
        let thread = format!("stoker-job-{plain}-{}", key.1);
        let key_in_thread = key.clone();
        std::thread::Builder::new()
            .name(thread)
            .spawn(move || {
                let key = key_in_thread;
                let (job, epoch) = (&key.0, key.1);
                let taken = Mutex::new(BTreeSet::new());
                let result = produce(&engine, &link, &busy, job, epoch, &mut deal, &taken);
                busy.set(job, epoch, false);
                let undelivered: Vec<u64> = taken.into_inner().unwrap().into_iter().collect();
                if deal.is_closed() && !undelivered.is_empty() {
                    // Stopped as abandoned: the splits it held go back to the queue.
                    if let Err(e) = link.return_splits(job, epoch, undelivered) {
                        tracing::warn!(%job, epoch, error = %e, "returning the splits of a stopped producer failed");
                    }
                }
                if let Err(e) = result {
                    let message = format!("{e:#}");
                    tracing::error!(%job, epoch, error = %message, "the job's producer stopped");
                    errors.lock().unwrap().get_or_insert(message.clone());
                    deal.fail(Status::failed_precondition(format!("the pipeline failed: {message}")));
                }
                // Consumers arriving later start a producer that learns the epoch is over
                // (unless this one was stopped as abandoned and another runs already).
                let mut epochs = registry.lock().unwrap();
                if epochs.get(&key).is_some_and(|e| std::ptr::eq(Arc::as_ptr(e), this.as_ptr())) {
                    epochs.remove(&key);
                }
            })
            .map_err(|e| {
                self.busy.set(&key.0, key.1, false);
                Status::resource_exhausted(format!("this worker cannot start another producer now: {e}"))
            })?;
        epochs.insert(key, epoch_job.clone());
        Ok(epoch_job)
    }
}

impl BatchSource for DispatchedSource {
    fn subscribe(&self, subscription: &Subscription) -> Result<Batches, Status> {
        let Some(epoch) = subscription.epoch else {
            return Err(Status::invalid_argument(
                "under the dispatcher a stream is of one epoch: set StreamRequest.epoch",
            ));
        };
        let reading = subscription.reading;
        tracing::info!(job = %subscription.job, epoch, ?reading, "consumer attached");
        let epoch_job = self.epoch((subscription.job.clone(), epoch), reading.shape())?;
        if epoch_job.shape != reading.shape() {
            return Err(Status::invalid_argument(format!(
                "job {} is read by {} on this worker, but this stream declares {}: every consumer of a job must declare the same",
                subscription.job,
                epoch_job.shape,
                reading.shape()
            )));
        }
        let rank = reading.rank() as usize;
        let min_interval = self.min_interval;
        // A stream serves the worker's registration it opened under. Once the dispatcher forgot
        // this worker (it restarted, or took the worker for dead) a stream opened before may be
        // one its client already dropped (a client drops the streams of workers missing from a
        // new dispatcher's list): a batch it took would be lost on the way while the rest of its
        // split reached the client on a new stream, completing the split without it. So it
        // ends (UNAVAILABLE: the client opens another) and leaves what it took to the next.
        let (link, subscribed) = (self.link.clone(), self.link.generation());
        let state = (Attached::new(epoch_job), false);
        Ok(futures::stream::unfold(state, move |(epoch_job, ended)| {
            let link = link.clone();
            async move {
                if ended {
                    return None;
                }
                let hands = epoch_job.0.batches[rank].clone();
                let mut hand = hands.lock().await;
                let next = {
                    loop {
                        if link.generation() != subscribed {
                            break None;
                        }
                        // None once the producer is done with the epoch: the stream ends.
                        let queued = match hand.pending.take() {
                            Some(queued) => queued,
                            None => hand.queue.recv().await?,
                        };
                        let now = link.generation();
                        if queued.stale(now) {
                            tracing::debug!(epoch, "dropped a batch made before this worker registered again");
                            continue;
                        }
                        if now != subscribed {
                            hand.pending = Some(queued);
                            break None;
                        }
                        break Some(queued);
                    }
                };
                let Some(next) = next else {
                    let status = Status::unavailable(
                        "this worker registered with the dispatcher again since the stream opened: open another",
                    );
                    return Some((Err(status), (epoch_job, true)));
                };
                // Rate-limited once a batch is in hand, so a stream waiting for its epoch's
                // batches takes no turns from the job's other epoch. Meanwhile the batch is
                // back in the hand: a stream dropped while it waits (its connection broke)
                // leaves it to the next, where it would otherwise be lost with the stream.
                let next = match min_interval {
                    Some(interval) => {
                        hand.pending = Some(next);
                        let mut next_send = epoch_job.0.next_send.lock().await;
                        tokio::time::sleep_until(*next_send).await;
                        *next_send = tokio::time::Instant::now().max(*next_send) + interval;
                        hand.pending.take().expect("held under the hand's lock")
                    }
                    None => next,
                };
                drop(hand);
                // The batch names the splits it completes; the client that receives it reports them.
                let Queued { item, unsent, .. } = next;
                Some((item.map(|batch| Outgoing { batch, unsent }), (epoch_job, false)))
            }
        })
        .boxed())
    }
}

/// Pulls one epoch's splits of a job and runs them through the engine until the dispatcher
/// says the epoch is finished. Each stretch of splits handed out without a pause is one engine
/// run (one shuffle buffer); a pause (the epoch's last splits are held by other workers) ends
/// the run, so no split's rows wait in the buffer while the epoch waits for its completion.
/// `taken` holds the splits handed out whose completion has not gone to a consumer yet.
fn produce(
    engine: &Engine,
    link: &Link,
    busy: &Busy,
    job: &JobName,
    epoch: u64,
    out: &mut Deal,
    taken: &Mutex<BTreeSet<u64>>,
) -> anyhow::Result<()> {
    let split = |id: u64| {
        engine
            .mix()
            .split(epoch, id)
            .ok_or_else(|| anyhow::anyhow!("the dispatcher handed out split {id}, beyond this worker's plan"))
    };
    // Asks for the next split once no earlier epoch of the job keeps this worker busy.
    let ask = || -> anyhow::Result<Handed> {
        while busy.earlier(job, epoch) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let next = link.next_split(job, epoch)?;
        if let Next::Split(s) = &next.next {
            busy.set(job, epoch, true);
            taken.lock().unwrap().insert(s.split);
        }
        Ok(next)
    };
    // The epoch's runs are one producer: a run's rows wait for the batches the runs before
    // it made that no stream took yet.
    let producer = engine.producer();
    let mut next = ask()?;
    loop {
        let first = match next {
            Handed { next: Next::Finished(_), .. } => return Ok(()),
            Handed { next: Next::Draining(d), .. } => {
                // Idle until the epoch's last splits are done elsewhere: the next epoch may
                // use this worker meanwhile (busy again when a dead worker's split comes back).
                busy.set(job, epoch, false);
                std::thread::sleep(Duration::from_millis(u64::from(d.retry_ms)));
                if out.is_closed() {
                    return Ok(());
                }
                next = ask()?;
                continue;
            }
            Handed { next: Next::Split(s), cache, skip, echo, shared, incarnation } => {
                anyhow::ensure!(s.epoch == epoch, "asked for a split of epoch {epoch}, got one of {}", s.epoch);
                (Assigned { split: split(s.split)?, cache, skip, echo, shared }, incarnation)
            }
        };
        let (first, incarnation) = first;
        // The epoch's splits, pulled as the engine asks, until a pause or the epoch's end; the
        // dispatcher forgetting this worker ends the run too: what it handed out before went
        // to others, so the run's batches are stale and must not join fresh splits' in a batch.
        let generation = link.generation();
        out.tag(generation);
        let stale = || link.generation() != generation;
        let mut after: Option<Handed> = None;
        let mut failed: Option<anyhow::Error> = None;
        let pulled = std::iter::once(first).chain(std::iter::from_fn(|| {
            // While an earlier epoch keeps this worker busy (at the start, or when a dead
            // worker's split of it came back), `ask` waits: the run pauses, its rows held, and
            // goes on afterwards without a partial batch.
            if after.is_some() || failed.is_some() || stale() {
                return None;
            }
            match ask().and_then(|n| match n {
                // A split of another dispatcher starts a run of its own: its batches carry the
                // incarnation of their run's first split (a registration again between handing
                // out the first split and reading the generation would otherwise let one run
                // mix both, and the client refuse the new one's rows with the old one's).
                Handed { next: Next::Split(s), cache, skip, echo, shared, incarnation: from }
                    if !stale() && from == incarnation =>
                {
                    split(s.split).map(|split| Some(Assigned { split, cache, skip, echo, shared }))
                }
                other => {
                    after = Some(other);
                    Ok(None)
                }
            }) {
                Ok(s) => s,
                Err(e) => {
                    failed = Some(e);
                    None
                }
            }
        }));
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<Ready>(1);
        let leftover = std::thread::scope(|scope| {
            scope.spawn(|| {
                for ready in ready_rx {
                    if stale() {
                        // Dropped: another worker produces these splits now.
                        tracing::debug!(%job, epoch, rows = ready.batch.rows.len(), completes = ?ready.completes, "dropped a batch of a stale run");
                        continue;
                    }
                    let Ready { mut batch, completes, unsent } = ready;
                    batch.completes = completes.clone();
                    // Every split of a run comes from one dispatcher: a new one (it restarted)
                    // means a new generation, which ends the run.
                    batch.incarnation = incarnation;
                    if out.send(batch, Some(unsent)).is_err() {
                        break;
                    }
                    let mut taken = taken.lock().unwrap();
                    for split in completes {
                        taken.remove(&split);
                    }
                }
            });
            let result = engine.run_splits_as(&producer, epoch, pulled, &ready_tx);
            drop(ready_tx);
            result
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
        // Splits that completed with no batch to carry them (all filtered, or their tail dropped
        // as the remainder) go to the client in a batch without tensors, behind the batches
        // holding their elements: reported by the worker, they could be done while one of
        // those batches was still on its way, and lost with it if the worker died.
        if !leftover.is_empty() && !stale() {
            let completions = Batch { incarnation, ..Batch::completions(epoch, leftover.clone()) };
            if out.send(completions, None).is_err() {
                return Ok(());
            }
            let mut taken = taken.lock().unwrap();
            for split in leftover {
                taken.remove(&split);
            }
        }
        if out.is_closed() {
            return Ok(());
        }
        next = match after {
            Some(n) => n,
            None => ask()?,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queued(generation: u64, ok: bool) -> Queued {
        let item = if ok { Ok(Batch::completions(0, vec![generation])) } else { Err(Status::internal("failed")) };
        Queued { generation, item, unsent: None }
    }

    fn hand(items: Vec<Queued>, pending: Option<Queued>) -> Hand {
        let (tx, queue) = tokio::sync::mpsc::channel(items.len().max(1));
        items.into_iter().for_each(|q| tx.try_send(q).unwrap());
        Hand { queue, pending }
    }

    fn generations(hand: &mut Hand) -> Vec<(u64, bool)> {
        let pending = hand.pending.take().into_iter();
        let queued = std::iter::from_fn(|| hand.queue.try_recv().ok());
        pending.chain(queued).map(|q| (q.generation, q.item.is_ok())).collect()
    }

    #[test]
    fn batches_made_before_registering_again_are_dropped_up_to_the_first_made_since() {
        let mut h = hand(vec![queued(1, true), queued(1, true), queued(2, true), queued(1, true)], None);
        h.drop_stale(2);
        assert_eq!(generations(&mut h), [(2, true), (1, true)], "the first fresh one and what follows it stay");
        // A failure is never stale: every stream must see it.
        let mut h = hand(vec![queued(1, true), queued(1, false)], Some(queued(1, true)));
        h.drop_stale(2);
        assert_eq!(generations(&mut h), [(1, false)]);
        // A fresh batch held for the next stream stays, and so does what is behind it.
        let mut h = hand(vec![queued(1, true)], Some(queued(2, true)));
        h.drop_stale(2);
        assert_eq!(generations(&mut h), [(2, true), (1, true)]);
    }
}
