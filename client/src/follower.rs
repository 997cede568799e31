//! Dispatcher mode's background loop: follow the pipeline's live worker list and stream the
//! epoch the caller reads (and the next, read ahead) from every worker on it; acknowledge what
//! arrived (completed splits at once; when a worker leaves the list, the rows it delivered, so
//! its split is produced again without them); report a batch-time window every few seconds
//! (the autoscaler's input).
//!
//! Failures here are the cluster's business, not the training loop's: the dispatcher being
//! unreachable or changing leader is retried, and a worker that dies is dropped because the
//! dispatcher hands its unfinished splits to the others. Only a refusal (bad request, not
//! allowed, a failed pipeline) reaches the caller.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::task::AtomicWaker;
use stoker_api::proto;
use stoker_api::ranks::Quota;
use stoker_api::token::TokenSource;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::task::JoinHandle;
use tonic::Code;

use crate::delivery::Delivery;
use crate::epochs::{Epochs, Item};
use crate::error::Error;
use crate::options::ClientOptions;
use crate::registration::{RETRY, Registration};
use crate::stats::Meter;
use crate::tasks::Tasks;
use crate::tls::WorkerTls;
use crate::worker_stream::{Cursor, WorkerKey, open, pump};

/// A worker and an epoch: one stream.
type StreamKey = (WorkerKey, u64);

/// One stream: its task, and whether a batch has come from its worker yet. Only workers that
/// delivered count in the reported worker count: a worker that just started is listed before
/// it produces, and windows from then would show the old count's speed as the new.
struct Streaming {
    task: JoinHandle<()>,
    delivered: Arc<AtomicBool>,
    /// The stream's batches received when this connection of it opened.
    received_before: u64,
}

/// How a stream ended: normally (its worker made all of the epoch it will), or not; and
/// whether the worker had forgotten it (a resume it cannot serve).
struct Ended {
    key: StreamKey,
    /// The task that streamed: a stream of the key started since (the first one stopped
    /// because its worker left the list, then listed again) is not the one that ended.
    task: tokio::task::Id,
    finished: bool,
    forgotten: bool,
}

/// What the client and its follower share.
#[derive(Clone)]
pub(crate) struct Shared {
    pub epochs: Arc<Epochs>,
    pub delivery: Delivery,
    pub meter: Arc<Mutex<Meter>>,
    /// The job's open epoch, as the dispatcher last said.
    pub open_epoch: Arc<AtomicU64>,
    /// The job's live clients, as the dispatcher last listed them.
    pub clients: Arc<AtomicU32>,
    /// The epoch the caller reads; `switched` wakes the follower when it moves on.
    pub reading: Arc<AtomicU64>,
    pub switched: Arc<Notify>,
    /// A job read by ranks: the dispatcher's quotas by epoch; `quota_changed` wakes the caller.
    pub quotas: Arc<Mutex<BTreeMap<u64, Quota>>>,
    pub quota_changed: Arc<AtomicWaker>,
    /// Rows this rank dropped beyond the epochs' final quotas.
    pub dropped_rows: Arc<AtomicU64>,
}

pub(crate) struct Follower {
    pub link: Registration,
    pub options: ClientOptions,
    pub shared: Shared,
    pub tasks: Tasks,
    /// The watch opened at registration, and its first list.
    pub watch: Option<tonic::Streaming<proto::WorkerList>>,
    pub first: Option<proto::WorkerList>,
    /// The client is closing: acknowledge a last time (whether it discarded batches) and stop.
    pub leave: oneshot::Receiver<bool>,
}

struct State {
    listed: BTreeSet<WorkerKey>,
    version: u64,
    streams: HashMap<StreamKey, Streaming>,
    /// Streams that ended normally: their worker made all of that epoch it will.
    finished: HashSet<StreamKey>,
    /// The streams of listed workers, resumed under the same cursor after their connection
    /// broke.
    cursors: HashMap<StreamKey, Arc<Cursor>>,
    /// Streams to open again after a pause: their last connection delivered nothing.
    paused: HashSet<StreamKey>,
    /// Workers whose stream delivered and ended since the last window was reported: they
    /// count in its worker count too. Counting only the streams open at the report left out a
    /// worker between two epochs' streams: with epochs shorter than a window (48 images) most
    /// windows said 0 workers, were dropped, and the autoscaler judged nothing for 20 s.
    delivered_and_ended: HashSet<WorkerKey>,
    ended: mpsc::UnboundedSender<Ended>,
    /// How to dial the listed workers, as the newest list says.
    tls: WorkerTls,
}

impl State {
    fn new(ended: mpsc::UnboundedSender<Ended>) -> Self {
        State {
            listed: BTreeSet::new(),
            version: 0,
            streams: HashMap::new(),
            finished: HashSet::new(),
            cursors: HashMap::new(),
            paused: HashSet::new(),
            delivered_and_ended: HashSet::new(),
            ended,
            tls: WorkerTls::Plaintext,
        }
    }

    /// The stream that `ended`, if it is the one streaming its key: removed, with whether this
    /// connection of it delivered. None when stale: the stream that ended had been stopped (its
    /// worker left the list) and the key streams again since. Taking that for the new stream's
    /// end forgot the new one without stopping it and started a third beside it: two
    /// connections of one stream, each delivering the same batches (150 rows of an epoch
    /// twice, with three copies of `dispatcher_restart` at once on two cores).
    fn take_ended(&mut self, ended: &Ended) -> Option<bool> {
        if self.streams.get(&ended.key).is_none_or(|s| s.task.id() != ended.task) {
            return None;
        }
        let stream = self.streams.remove(&ended.key)?;
        if stream.delivered.load(Ordering::Relaxed) {
            self.delivered_and_ended.insert(ended.key.0.clone());
        }
        Some(self.cursors.get(&ended.key).is_some_and(|c| c.received() > stream.received_before))
    }
}

impl Follower {
    pub(crate) async fn run(mut self) {
        let (ended_tx, mut ended_rx) = mpsc::unbounded_channel::<Ended>();
        let mut state = State::new(ended_tx);
        let mut report = tokio::time::interval(self.link.window);
        report.tick().await;
        let mut watch = self.watch.take();
        if let Some(first) = self.first.take() {
            self.apply(&mut state, first).await;
        }
        // Set when there is something to acknowledge that a failed attempt left behind.
        let mut unacknowledged = false;
        // The batch times of a window whose report failed.
        let mut unreported: Option<crate::stats::BatchTimes> = None;
        loop {
            if watch.is_none() {
                match self.link.watch().await {
                    Ok(w) => watch = Some(w),
                    Err(s) => {
                        tracing::debug!(status = %s, "watching workers: retrying");
                        tokio::time::sleep(RETRY).await;
                        continue;
                    }
                }
            }
            let updates = watch.as_mut().expect("opened above");
            let retry = tokio::time::sleep(if unacknowledged { RETRY } else { Duration::from_secs(3600) });
            tokio::select! {
                update = updates.next() => match update {
                    // Lists the dispatcher sent before it went and this client rejoined a new
                    // one: taken for news, each made the client rejoin again, refusing the new
                    // one's batches (a rank stalled for good that way), and their quotas are
                    // the old dispatcher's. Its stream is stale: watch the new one.
                    Some(Ok(list)) if self.shared.delivery.retired(list.incarnation) => {
                        tracing::debug!(incarnation = list.incarnation, "a list from a dispatcher this client left: watching again");
                        watch = None;
                    }
                    Some(Ok(list)) => unacknowledged = !self.apply(&mut state, list).await,
                    // The dispatcher went away (leader change): watch again.
                    _ => watch = None,
                },
                Some(ended) = ended_rx.recv() => {
                    let Some(progressed) = state.take_ended(&ended) else { continue };
                    if ended.finished || ended.forgotten {
                        state.cursors.remove(&ended.key);
                    }
                    if ended.finished {
                        state.finished.insert(ended.key);
                    } else if state.listed.contains(&ended.key.0) {
                        // Still alive as far as the dispatcher knows: resume the stream, at once
                        // if this connection of it delivered (it broke on the way), else after
                        // a pause (the worker does not answer yet, or is gone).
                        if !progressed {
                            state.paused.insert(ended.key.clone());
                        }
                        self.stream_all(&mut state);
                    }
                }
                _ = self.shared.switched.notified() => {
                    let reading = self.shared.reading.load(Ordering::Relaxed);
                    state.finished.retain(|(_, epoch)| *epoch >= reading);
                    state.cursors.retain(|(_, epoch), _| *epoch >= reading);
                    self.stream_all(&mut state);
                }
                _ = self.shared.delivery.changed.notified() => {
                    unacknowledged = !self.acknowledge(&state, None).await;
                }
                _ = retry => {
                    unacknowledged = !self.acknowledge(&state, None).await;
                }
                _ = report.tick() => {
                    let mut times = self.shared.meter.lock().unwrap().take();
                    // A window whose report failed (the dispatcher unreachable, the connection
                    // reset) goes with this one; only the last: older figures would mislead.
                    if let Some(failed) = unreported.take() {
                        times.merge_earlier(failed);
                    }
                    // Workers, not streams: a worker streams two epochs at once, and one
                    // epoch's stream may have ended before the next delivered. Those that left
                    // the list do not count: the window is of the workers still there.
                    let ended = std::mem::take(&mut state.delivered_and_ended);
                    let delivering: HashSet<&WorkerKey> = state
                        .streams
                        .iter()
                        .filter(|(_, s)| s.delivered.load(Ordering::Relaxed))
                        .map(|((worker, _), _)| worker)
                        .chain(ended.iter().filter(|w| state.listed.contains(*w)))
                        .collect();
                    let delivering = delivering.len();
                    if let Err(s) = self.link.report(times.window(), delivering).await {
                        tracing::debug!(status = %s, "reporting a batch-time window failed; it goes with the next");
                        unreported = Some(times);
                    }
                }
                discarded = &mut self.leave => {
                    // Best effort: the dispatcher forgets this client after its timeout anyway.
                    // A stream still open may have had batches on the way (a completion too).
                    let discarded = discarded.unwrap_or(true) || !state.streams.is_empty();
                    let _ = tokio::time::timeout(Duration::from_secs(1), self.acknowledge(&state, Some(discarded))).await;
                    for (_, s) in state.streams.drain() {
                        s.task.abort();
                    }
                    return;
                }
            }
        }
    }

    /// A new worker list: stop streaming from the workers that left (waiting until they have
    /// stopped, so every row they queued is recorded and nothing more comes from them), stream
    /// from the new ones, and acknowledge. Returns whether the acknowledgement went.
    async fn apply(&mut self, state: &mut State, list: proto::WorkerList) -> bool {
        // A list from a dispatcher this client is not registered with: it restarted.
        // If that fails, the acknowledgement below is refused (NOT_FOUND) and rejoins again.
        if let Err(s) = self.link.rejoin(Some(list.incarnation)).await {
            tracing::debug!(status = %s, "rejoining the restarted dispatcher failed; retrying");
        }
        self.shared.clients.store(list.clients, Ordering::Relaxed);
        if !list.same_workers {
            let ids = list.workers.iter().map(Some).chain(std::iter::repeat(None));
            state.listed =
                list.addresses.into_iter().zip(ids).map(|(address, id)| WorkerKey::listed(address, id)).collect();
        }
        state.version = list.version;
        state.tls = WorkerTls::listed(&list.tls_server_name);
        self.saw_epoch(list.epoch);
        if !list.quotas.is_empty() {
            let mut quotas = self.shared.quotas.lock().unwrap();
            quotas.extend(list.quotas.iter().map(Quota::from_proto));
            // Only the epochs read and read ahead matter; the dispatcher keeps a few more.
            while quotas.len() > 4 {
                quotas.pop_first();
            }
            drop(quotas);
            self.shared.quota_changed.wake();
        }
        let gone: Vec<StreamKey> = state.streams.keys().filter(|(a, _)| !state.listed.contains(a)).cloned().collect();
        for key in gone {
            let stream = state.streams.remove(&key).expect("listed above");
            stream.task.abort();
            let _ = stream.task.await;
        }
        // The cursors of workers no longer listed stay: a list can be stale (it left out a
        // worker that registered a moment later), and a worker listed again resumes its stream
        // where the abort broke it; one that truly left sends nothing again.
        self.stream_all(state);
        self.acknowledge(state, None).await
    }

    fn saw_epoch(&self, open: u64) {
        self.shared.open_epoch.fetch_max(open, Ordering::Relaxed);
        self.shared.epochs.finish_before(open);
        self.shared.delivery.finished_before(open);
    }

    /// Opens the streams missing: every listed worker, for the epoch the caller reads and the
    /// next (when reading ahead), unless that stream ended normally, the epoch is finished or
    /// it is past the job's last.
    fn stream_all(&self, state: &mut State) {
        let reading = self.shared.reading.load(Ordering::Relaxed);
        let ahead = if self.options.prefetch_next_epoch { reading + 1 } else { reading };
        let last = self.options.epochs.map_or(ahead, |end| ahead.min(end.saturating_sub(1)));
        for epoch in reading..=last {
            for worker in &state.listed {
                let key = (worker.clone(), epoch);
                if state.streams.contains_key(&key) || state.finished.contains(&key) {
                    continue;
                }
                let Some(tx) = self.shared.epochs.sender(epoch) else { continue };
                let delivered = Arc::new(AtomicBool::new(false));
                let cursor = state.cursors.entry(key.clone()).or_insert_with(|| Arc::new(Cursor::new())).clone();
                let received_before = cursor.received();
                let pause = if state.paused.remove(&key) { RETRY } else { Duration::ZERO };
                let stream = stream_from(
                    key.clone(),
                    (self.options.clone(), state.tls.clone(), self.link.token().clone()),
                    (tx, pause),
                    state.ended.clone(),
                    delivered.clone(),
                    (self.shared.delivery.clone(), cursor),
                );
                let task = self.tasks.spawn_joinable(stream);
                state.streams.insert(key, Streaming { task, delivered, received_before });
            }
        }
    }

    /// Sends what there is to acknowledge; false when it failed (it is kept for the next try).
    async fn acknowledge(&mut self, state: &State, leaving: Option<bool>) -> bool {
        let ack = self.shared.delivery.take(&state.listed);
        let received = self.shared.delivery.progress();
        match self.link.acknowledge(&ack, state.version, &received, leaving).await {
            Ok(epoch) => {
                self.saw_epoch(epoch);
                true
            }
            Err(s) => {
                tracing::debug!(dispatcher = %self.link.url(), status = %s, "acknowledging failed; retrying");
                self.shared.delivery.restore(ack);
                false
            }
        }
    }
}

/// Streams one epoch of one worker's batches into the epoch's queue; tells `ended` when the
/// stream stops for any reason but a fatal one, which goes to the caller instead.
async fn stream_from(
    key: StreamKey,
    (options, tls, token): (ClientOptions, WorkerTls, TokenSource),
    (tx, pause): (mpsc::Sender<Item>, Duration),
    ended: mpsc::UnboundedSender<Ended>,
    delivered: Arc<AtomicBool>,
    (delivery, cursor): (Delivery, Arc<Cursor>),
) {
    tokio::time::sleep(pause).await;
    let worker = key.0.clone();
    let failure = match open(&worker.address, (&options, &token), Some(key.1), &tls, Some(&cursor)).await {
        Ok(stream) => {
            let on_batch = || delivered.store(true, Ordering::Relaxed);
            let accounts = (Some(&delivery), Some(cursor.as_ref()));
            pump(worker.clone(), stream, &tx, options.reassembler(), accounts, on_batch).await
        }
        Err(e) => Some(e),
    };
    // The worker no longer has the stream to resume (it forgot it after a long break): what
    // it had sent into the broken connection is gone, and a new stream starts.
    let forgotten = matches!(&failure, Some(Error::Status { status, .. }) if status.code() == Code::NotFound);
    if forgotten {
        tracing::error!(%worker, epoch = key.1, "the worker forgot a broken stream: batches sent into it may be lost");
    }
    match failure {
        Some(e) if e.is_fatal() => {
            tracing::error!(error = %e, "worker refused the stream");
            let _ = tx.send(Err(e)).await;
        }
        other => {
            if let Some(e) = &other {
                tracing::info!(error = %e, "worker stream ended; the dispatcher reassigns its splits");
            }
            let _ = ended.send(Ended { key, task: tokio::task::id(), finished: other.is_none(), forgotten });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_end_of_a_stream_stopped_before_is_not_taken_for_its_successors() {
        let (ended, _) = mpsc::unbounded_channel();
        let mut state = State::new(ended);
        let key: StreamKey = (WorkerKey::listed("10.0.0.5:50052".into(), Some(&"w-1".into())), 3);
        let streaming = |task: JoinHandle<()>| Streaming { task, delivered: Arc::default(), received_before: 0 };
        // The first stream ended (and said so) while its worker was off the list; the key
        // streams again under a second task.
        let first = tokio::spawn(async {});
        let first_id = first.id();
        first.await.unwrap();
        let second = tokio::spawn(std::future::pending::<()>());
        let second_id = second.id();
        state.streams.insert(key.clone(), streaming(second));
        let end = |task| Ended { key: key.clone(), task, finished: false, forgotten: false };
        assert_eq!(state.take_ended(&end(first_id)), None, "the first stream's end is stale");
        assert!(state.streams.contains_key(&key), "the second streams on, the only one");
        assert_eq!(state.take_ended(&end(second_id)), Some(false), "its own end is taken");
        assert!(!state.streams.contains_key(&key));
        assert_eq!(state.take_ended(&end(second_id)), None, "and only once");
    }

    #[test]
    fn a_new_process_at_an_address_is_another_worker_reached_at_the_same_address() {
        let (old, new) = (
            WorkerKey::listed("10.0.0.5:50052".into(), Some(&"w-1".into())),
            WorkerKey::listed("10.0.0.5:50052".into(), Some(&"w-2".into())),
        );
        assert_ne!(old, new, "rows of the old one are held rows once it leaves the list");
        assert_eq!((old.address.as_str(), new.address.as_str()), ("10.0.0.5:50052", "10.0.0.5:50052"));
        let unnamed = WorkerKey::listed("10.0.0.5:50052".into(), Some(&String::new()));
        assert_eq!(unnamed, WorkerKey::from("10.0.0.5:50052"), "a dispatcher that names no ids: the address alone");
        assert_eq!(old.to_string(), "10.0.0.5:50052#w-1", "as logs name it");
    }
}
