//! Streams that outlive their connection (`StreamResume`). A connection can break while both
//! ends stay up (a reset by a proxy, a conntrack flush, a flaky link): the batches the stream
//! had sent into it are gone, though the worker took them from its queue. So a resumable
//! stream numbers its batches and keeps those its client may not have read; when the client
//! asks again under the same id with the count it received whole, the ones after are sent
//! first, with their numbers, and the stream goes on from the source.
//!
//! What a broken connection can take is bounded: HTTP/2 sends no more than the client's window
//! beyond what the client has read, the worker buffers at most one message beyond what flow
//! control allows (`body.rs` pulls the next chunk only once the last one is taken), and the
//! client holds at most one message in its decoder and one batch in reassembly. So a batch
//! is kept until the body has taken more than the window and two messages after it (`Pulled`
//! counts what it takes, message by message).
//!
//! A kept batch is memory its producer's budget does not wait for (`budget`: that wait could be
//! circular). With batches as large as the window, keeping one whole while the next goes out,
//! and the producer making a third meanwhile, held three (154 MB batches: 715 MB in the
//! slow-client benchmark against its 468 MB target). So while the batches kept before the
//! newest are ones the newest's own bytes will release, the stream holds the newest's place in
//! its producer's budget (`Kept::hold`), and lets it go once they are released, once the body
//! asks for the next batch, or when the connection ends: never waiting on a batch not made.
//!
//! A new connection under a stream's id takes the stream over, even while the old one still
//! looks open (the worker's end of a broken connection can take a while to notice): the old
//! one then stops at its next batch and leaves what it took from the source to the new one.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use stoker_api::proto::StreamResume;
use stoker_api::{Batch, Stacked};
use tonic::Status;

use super::{Batches, Outgoing, Subscription};
use crate::budget::Unsent;

/// How long a stream with no connection is kept for its client to come back.
pub const KEEP_FOR: Duration = Duration::from_secs(300);
/// How long a stream whose source ended is kept after its connection closed: only a client
/// that lost the stream's last batches with the connection comes back for it, at once.
pub const KEEP_FINISHED_FOR: Duration = Duration::from_secs(30);
/// The most streams kept at once: a client naming ever new ids gets RESOURCE_EXHAUSTED.
pub const MAX_STREAMS: usize = 1024;
/// The largest client window believed: a client cannot make the worker keep more than this.
pub const MAX_WINDOW_BYTES: u64 = 64 << 20;

/// A stream as its client names it: the caller (when authenticated) and the client's id.
type StreamKey = (Option<String>, u64);
type Streams = HashMap<StreamKey, Arc<Mutex<Kept>>>;

/// The resumable streams of a worker, by (caller, id).
pub struct Resumes {
    streams: Mutex<Streams>,
    /// The most bytes of batches kept for streams without a connection (they hold memory
    /// budget): past it, the oldest give theirs up, finished streams first.
    idle_cap: u64,
    /// Under the dispatcher: how often the worker registered. Batches sent before it
    /// registered again are never sent again: the dispatcher forgot the worker, its splits
    /// went to others (or, restarted, to nobody yet), and its clients were told to expect their
    /// rows from them.
    generation: Option<Generation>,
}

/// How often the worker registered with the dispatcher.
pub type Generation = Box<dyn Fn() -> u64 + Send + Sync>;

impl Default for Resumes {
    fn default() -> Self {
        Resumes::new(256 << 20)
    }
}

struct Kept {
    /// What the stream is of (its caller's token aside): a resume must ask for the same.
    of: Subscription,
    /// The connection serving the stream now (the count of connections it had).
    owner: u64,
    /// Sent and perhaps not received, oldest first; `bytes` is their size and `pulled` what
    /// the body took of them.
    sent: VecDeque<Sent>,
    bytes: u64,
    pulled: u64,
    /// Taken from the source or lost with a connection, and not sent (again) yet.
    unsent: VecDeque<(u64, Batch<Stacked>)>,
    /// The number the next new batch gets.
    next_seq: u64,
    /// The client's window (within `MAX_WINDOW_BYTES`) and its largest message.
    window: u64,
    max_message: u64,
    /// The largest message sent so far: a batch in one, or a chunk of one.
    largest_message: u64,
    /// The newest batch's place in its producer's budget, held until `sent` is down to
    /// `hold_until` batches (the module's doc says why).
    hold: Option<Unsent>,
    hold_until: usize,
    /// Since when no connection serves it.
    idle_since: Option<Instant>,
    /// Its source ended: every batch of it was sent.
    finished: bool,
    /// It gave up what it kept (the cap on idle streams).
    gave_up: bool,
}

/// A batch sent: the generation it was sent in, and how much of it the body took.
struct Sent {
    generation: u64,
    batch: Batch<Stacked>,
    pulled: u64,
}

impl Kept {
    /// What may be in flight beyond what the client read: its window and two messages.
    fn bound(&self) -> u64 {
        self.window + 2 * self.largest_message
    }

    /// A batch goes out: numbered if new, kept until enough was taken after it.
    fn sent(&mut self, generation: u64, mut batch: Batch<Stacked>, unsent: Option<Unsent>) -> Batch<Stacked> {
        if batch.stream_seq == 0 {
            batch.stream_seq = self.next_seq;
            self.next_seq += 1;
        }
        let size = size(&batch);
        // How many kept batches this one's bytes will release: from the front, each with more
        // than the bound taken after it once this one is.
        let mut after = self.pulled + size;
        let releases = self
            .sent
            .iter()
            .take_while(|s| {
                after -= s.pulled;
                after > self.bound()
            })
            .count();
        self.hold = unsent.filter(|_| releases > 0);
        self.hold_until = self.sent.len() - releases + 1;
        self.bytes += size;
        self.sent.push_back(Sent { generation, batch: batch.clone(), pulled: 0 });
        batch
    }

    /// The body took `bytes` of the newest batch: the batches before it that the client has
    /// certainly read go.
    fn pulled(&mut self, bytes: u64) {
        let Some(newest) = self.sent.back_mut() else { return };
        newest.pulled += bytes;
        self.pulled += bytes;
        self.largest_message = self.largest_message.max(bytes.min(self.max_message));
        while self.sent.len() > 1 && self.pulled - self.sent[0].pulled > self.bound() {
            let front = self.sent.pop_front().expect("two or more");
            self.pulled -= front.pulled;
            self.bytes -= size(&front.batch);
        }
        if self.sent.len() <= self.hold_until {
            self.hold = None;
        }
    }

    /// Forgets what was sent (handed back to send again, or given up).
    fn clear_sent(&mut self) -> VecDeque<Sent> {
        (self.bytes, self.pulled, self.hold) = (0, 0, None);
        std::mem::take(&mut self.sent)
    }
}

/// A batch's bytes on the wire, near enough: its payload and its header's row and split ids.
pub(super) fn size(batch: &Batch<Stacked>) -> u64 {
    batch.payload_bytes() as u64 + 8 * (batch.rows.len() + batch.completes.len()) as u64 + 64
}

impl Resumes {
    /// Keeping at most `idle_cap` bytes for streams without a connection.
    pub fn new(idle_cap: u64) -> Self {
        Resumes { streams: Mutex::default(), idle_cap, generation: None }
    }

    /// Sending nothing again that was sent before the worker registered again.
    pub fn with_generation(mut self, generation: Generation) -> Self {
        self.generation = Some(generation);
        self
    }

    fn generation(&self) -> u64 {
        self.generation.as_ref().map_or(0, |g| g())
    }

    /// Forgets streams kept too long, and past the cap the batches of the oldest idle ones.
    fn tidy(&self, streams: &mut Streams, now: Instant) {
        streams.retain(|_, kept| {
            let k = kept.lock().unwrap();
            let keep_for = if k.finished { KEEP_FINISHED_FOR } else { KEEP_FOR };
            k.idle_since.is_none_or(|since| now - since < keep_for)
        });
        let mut idle: Vec<(bool, Instant, Arc<Mutex<Kept>>)> = streams
            .values()
            .filter_map(|kept| {
                let k = kept.lock().unwrap();
                Some((!k.finished, k.idle_since?, kept.clone())).filter(|_| k.bytes > 0)
            })
            .collect();
        let mut bytes: u64 = idle.iter().map(|(.., kept)| kept.lock().unwrap().bytes).sum();
        // Finished first (false sorts first), then the longest idle.
        idle.sort_by_key(|(unfinished, since, _)| (*unfinished, *since));
        for (.., kept) in idle {
            if bytes <= self.idle_cap {
                break;
            }
            let mut k = kept.lock().unwrap();
            tracing::warn!(of = ?k.of, bytes = k.bytes, "too much kept for broken streams: the oldest gives up its batches");
            bytes -= k.bytes;
            k.clear_sent();
            k.gave_up = true;
        }
    }

    /// `batches` as the resumable stream `resume` names: a new one, or one whose connection
    /// broke, its batches after `resume.received` first; and where its body tells what it took.
    pub fn stream(
        self: &Arc<Self>,
        subscription: &Subscription,
        resume: &StreamResume,
        max_message_bytes: usize,
        batches: Batches,
    ) -> Result<(Batches, Pulled), Status> {
        if resume.stream == 0 {
            return Err(Status::invalid_argument("StreamResume.stream: 0 is not a stream id"));
        }
        let key = (subscription.caller.username.clone(), resume.stream);
        let of = Subscription { caller: Default::default(), ..subscription.clone() };
        let mut streams = self.streams.lock().unwrap();
        self.tidy(&mut streams, Instant::now());
        let (kept, owner) = match streams.get(&key) {
            Some(kept) => {
                let mut k = kept.lock().unwrap();
                if k.of != of {
                    return Err(Status::invalid_argument(format!(
                        "stream {} is of {:?}, not of {:?}: a resumed stream asks for what it asked for first",
                        resume.stream, k.of, of
                    )));
                }
                if resume.received >= k.next_seq {
                    return Err(Status::invalid_argument(format!(
                        "stream {}: {} batches received, but {} were sent",
                        resume.stream,
                        resume.received,
                        k.next_seq - 1
                    )));
                }
                let lost: Vec<_> = k
                    .clear_sent()
                    .into_iter()
                    .map(|s| (s.generation, s.batch))
                    .filter(|(_, b)| b.stream_seq > resume.received)
                    .collect();
                if lost.first().is_some_and(|(_, b)| b.stream_seq != resume.received + 1) && !k.gave_up {
                    // Cannot happen within the bound; said loudly if it ever does.
                    tracing::error!(
                        stream = resume.stream,
                        received = resume.received,
                        kept_from = lost[0].1.stream_seq,
                        "a resumed stream lost batches beyond what was kept"
                    );
                }
                k.gave_up = false;
                for batch in lost.into_iter().rev() {
                    k.unsent.push_front(batch);
                }
                k.owner += 1;
                k.idle_since = None;
                tracing::info!(
                    stream = resume.stream,
                    received = resume.received,
                    again = k.unsent.len(),
                    "stream resumed"
                );
                (kept.clone(), k.owner)
            }
            None => {
                if resume.received > 0 {
                    return Err(Status::not_found(format!(
                        "this worker has no stream {} to resume: it never served it, or forgot it {KEEP_FOR:?} after its connection broke",
                        resume.stream
                    )));
                }
                if streams.len() >= MAX_STREAMS {
                    return Err(Status::resource_exhausted(format!(
                        "this worker keeps {MAX_STREAMS} resumable streams already"
                    )));
                }
                let kept = Arc::new(Mutex::new(Kept {
                    of,
                    owner: 1,
                    sent: VecDeque::new(),
                    bytes: 0,
                    pulled: 0,
                    unsent: VecDeque::new(),
                    next_seq: 1,
                    window: resume.window_bytes.min(MAX_WINDOW_BYTES),
                    max_message: max_message_bytes as u64,
                    largest_message: 0,
                    hold: None,
                    hold_until: 0,
                    idle_since: None,
                    finished: false,
                    gave_up: false,
                }));
                streams.insert(key, kept.clone());
                (kept, 1)
            }
        };
        drop(streams);
        let pulled = Pulled { kept: kept.clone(), owner };
        Ok((Resumed { resumes: self.clone(), kept, owner, batches: Some(batches) }.boxed(), pulled))
    }
}

/// Where a resumable stream's connection tells what its body took: each message's bytes, as
/// it takes them.
#[derive(Clone)]
pub struct Pulled {
    kept: Arc<Mutex<Kept>>,
    owner: u64,
}

impl Pulled {
    pub fn pulled(&self, bytes: u64) {
        let mut kept = self.kept.lock().unwrap();
        if kept.owner == self.owner {
            kept.pulled(bytes);
        }
    }
}

/// One connection's side of a resumable stream.
struct Resumed {
    resumes: Arc<Resumes>,
    kept: Arc<Mutex<Kept>>,
    owner: u64,
    /// The source's stream; None once it ended.
    batches: Option<Batches>,
}

impl Stream for Resumed {
    type Item = Result<Outgoing, Status>;

    fn poll_next(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Option<Self::Item>> {
        let generation = self.resumes.generation();
        {
            let mut kept = self.kept.lock().unwrap();
            if kept.owner != self.owner {
                return Poll::Ready(None);
            }
            // The body asks for the next batch: it took the newest whole.
            kept.hold = None;
            while let Some((sent_in, batch)) = kept.unsent.pop_front() {
                if sent_in == generation {
                    return Poll::Ready(Some(Ok(kept.sent(generation, batch, None).into())));
                }
                tracing::debug!(
                    seq = batch.stream_seq,
                    "not sending again a batch of before this worker registered again"
                );
            }
        }
        let Some(batches) = self.batches.as_mut() else { return Poll::Ready(None) };
        let next = std::task::ready!(batches.poll_next_unpin(cx));
        let mut kept = self.kept.lock().unwrap();
        match next {
            Some(Ok(outgoing)) if kept.owner != self.owner => {
                // Taken over meanwhile: the batch is the new connection's to send.
                kept.unsent.push_back((generation, outgoing.batch));
                Poll::Ready(None)
            }
            Some(Ok(Outgoing { batch, unsent })) => Poll::Ready(Some(Ok(kept.sent(generation, batch, unsent).into()))),
            Some(Err(status)) => Poll::Ready(Some(Err(status))),
            None => {
                kept.finished = true;
                drop(kept);
                self.batches = None;
                Poll::Ready(None)
            }
        }
    }
}

impl Drop for Resumed {
    fn drop(&mut self) {
        let mut kept = self.kept.lock().unwrap();
        if kept.owner != self.owner {
            return;
        }
        kept.idle_since = Some(Instant::now());
        kept.hold = None;
        drop(kept);
        let mut streams = self.resumes.streams.lock().unwrap();
        self.resumes.tidy(&mut streams, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use bytes::Bytes;
    use futures::executor::block_on;
    use stoker_api::DType;

    use super::*;

    fn batch(n: u64, bytes: usize) -> Batch<Stacked> {
        let tensor = Stacked::dense(DType::Uint8, vec![bytes], vec![Bytes::from(vec![0u8; bytes])]);
        Batch { tensors: BTreeMap::from([("x".to_string(), tensor)]), sequence: n, ..Batch::default() }
    }

    fn subscription() -> Subscription {
        Subscription {
            namespace: "ns".into(),
            pipeline: "p".into(),
            job: "j".into(),
            reading: stoker_api::Reading::Shared,
            start_epoch: None,
            epoch: Some(3),
            caller: Default::default(),
        }
    }

    fn source(range: std::ops::Range<u64>, bytes: usize) -> Batches {
        futures::stream::iter(range.map(move |n| Ok(batch(n, bytes).into()))).boxed()
    }

    fn open(resumes: &Arc<Resumes>, resume: StreamResume, max_message: usize, batches: Batches) -> Batches {
        resumes.stream(&subscription(), &resume, max_message, batches).unwrap().0
    }

    fn resume(stream: u64, received: u64) -> StreamResume {
        StreamResume { stream, received, window_bytes: 1000 }
    }

    /// (stream_seq, source sequence) of what a stream sends next, `n` of them.
    fn take(stream: &mut Batches, n: usize) -> Vec<(u64, u64)> {
        block_on(async {
            let mut got = Vec::new();
            for _ in 0..n {
                match stream.next().await {
                    Some(Ok(Outgoing { batch: b, .. })) => got.push((b.stream_seq, b.sequence)),
                    Some(Err(status)) => panic!("{status}"),
                    None => panic!("the stream ended"),
                }
            }
            got
        })
    }

    /// Sends `n` batches whole, each in one message, as the body would take them.
    fn send(stream: &mut (Batches, Pulled), n: usize) {
        for _ in 0..n {
            match block_on(stream.0.next()) {
                Some(Ok(Outgoing { batch, .. })) => stream.1.pulled(size(&batch)),
                _ => panic!("no batch"),
            }
        }
    }

    fn kept(resumes: &Resumes, stream: u64) -> Vec<u64> {
        let kept = resumes.streams.lock().unwrap()[&(None, stream)].clone();
        kept.lock().unwrap().sent.iter().map(|s| s.batch.stream_seq).collect()
    }

    #[test]
    fn a_resumed_stream_sends_what_the_client_did_not_get_then_goes_on() {
        let resumes = Arc::new(Resumes::default());
        let mut first = open(&resumes, resume(7, 0), 100, source(0..10, 100));
        assert_eq!(take(&mut first, 4), [(1, 0), (2, 1), (3, 2), (4, 3)]);
        drop(first);
        // The client got two whole: batches 3 and 4 come again, then the source's next.
        let mut second = open(&resumes, resume(7, 2), 100, source(10..20, 100));
        assert_eq!(take(&mut second, 4), [(3, 2), (4, 3), (5, 10), (6, 11)]);
    }

    #[test]
    fn a_new_connection_takes_over_one_still_open_and_loses_nothing_it_took() {
        let resumes = Arc::new(Resumes::default());
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let mut old = open(&resumes, resume(7, 0), 100, rx.boxed());
        tx.unbounded_send(Ok(batch(0, 100).into())).unwrap();
        assert_eq!(take(&mut old, 1), [(1, 0)]);
        // The old connection waits on its source when the new one takes over; woken, it
        // stops without taking the source's next batch (the next stream of the hand gets it).
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(old.poll_next_unpin(&mut cx).is_pending());
        let mut new = open(&resumes, resume(7, 0), 100, source(10..20, 100));
        tx.unbounded_send(Ok(batch(1, 100).into())).unwrap();
        assert!(block_on(old.next()).is_none(), "the old connection stops");
        assert_eq!(tx.len(), 1, "and left the batch where it was");
        assert_eq!(take(&mut new, 2), [(1, 0), (2, 10)], "what it sent is sent again, then the new source's");
    }

    #[test]
    fn what_is_kept_is_bounded_by_the_window_and_two_messages() {
        let resumes = Arc::new(Resumes::default());
        let mut stream = resumes.stream(&subscription(), &resume(9, 0), 100, source(0..100, 420)).unwrap();
        send(&mut stream, 50);
        drop(stream);
        // 484 bytes each, in messages of at most 100: a batch goes once three (1452 bytes,
        // over 1000 + 2 * 100) were taken after it.
        assert_eq!(kept(&resumes, 9), [48, 49, 50]);
        let err = resumes.stream(&subscription(), &resume(9, 60), 100, source(0..1, 1)).err().unwrap();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "more received than sent");
        // Batches smaller than the largest message the client takes are each one message: two
        // of them bound what is in flight beyond the window, not two of the largest (a
        // worker's budget held by six streams' kept batches was mostly that difference).
        let mut stream = resumes.stream(&subscription(), &resume(10, 0), 1 << 20, source(0..100, 420)).unwrap();
        send(&mut stream, 50);
        // A batch goes once five (2420 bytes, over 1000 + 2 * 484) were taken after it.
        assert_eq!(kept(&resumes, 10), [46, 47, 48, 49, 50]);
        // Half a batch taken counts: a batch goes as soon as enough of the next went.
        let mut stream = resumes.stream(&subscription(), &resume(11, 0), 100, source(0..100, 1200)).unwrap();
        send(&mut stream, 1);
        take(&mut stream.0, 1);
        assert_eq!(kept(&resumes, 11), [1, 2]);
        stream.1.pulled(1200);
        assert_eq!(kept(&resumes, 11), [1, 2], "1200 taken after batch 1: not over 1000 + 2 * 100");
        stream.1.pulled(1);
        assert_eq!(kept(&resumes, 11), [2]);
    }

    /// A producer whose batches are as large as the client's window waits, over its budget,
    /// while the stream keeps the batch before the one going out, and no longer: the stream
    /// lets go once that one is released, when the body asks for the next, or when the
    /// connection ends.
    #[test]
    fn a_stream_holds_its_producers_budget_while_it_keeps_a_batch_the_newest_will_release() {
        let budget = Arc::new(crate::budget::MemoryBudget::new(100));
        let mut producer = budget.producer();
        let batches: Vec<_> = (0..4)
            .map(|n| {
                let (_, unsent) = producer.into_batch(0, 10);
                Ok(Outgoing { batch: batch(n, 1500), unsent: Some(unsent) })
            })
            .collect();
        // Over the limit, the producer's rows wait while it has batches a stream holds (or
        // none took yet): 10 bytes each here.
        let waiting = |_: &Arc<crate::budget::MemoryBudget>| producer.unsent();
        let resumes = Arc::new(Resumes::default());
        let mut stream =
            resumes.stream(&subscription(), &resume(3, 0), 100, futures::stream::iter(batches).boxed()).unwrap();
        send(&mut stream, 1);
        // Batch 2 goes out while batch 1 is kept: its bytes will release batch 1.
        take(&mut stream.0, 1);
        assert_eq!((kept(&resumes, 3), waiting(&budget)), (vec![1, 2], 30), "2 held; 3 and 4 not taken yet");
        stream.1.pulled(1201);
        assert_eq!((kept(&resumes, 3), waiting(&budget)), (vec![2], 20), "batch 1 released, and 2 let go");
        // Batch 3 takes its predecessor's release with it; the body asking for batch 4 lets
        // 3 go whatever was counted.
        take(&mut stream.0, 1);
        assert_eq!(waiting(&budget), 20);
        take(&mut stream.0, 1);
        assert_eq!(waiting(&budget), 10, "3 let go, 4 held");
        drop(stream);
        assert_eq!(waiting(&budget), 0, "the connection ended: 4 let go");
    }

    #[test]
    fn a_resume_must_name_a_stream_this_worker_has_and_ask_for_the_same() {
        let resumes = Arc::new(Resumes::default());
        let err = resumes.stream(&subscription(), &resume(5, 3), 100, source(0..1, 1)).err().unwrap();
        assert_eq!(err.code(), tonic::Code::NotFound);
        drop(resumes.stream(&subscription(), &resume(5, 0), 100, source(0..1, 1)).unwrap());
        let other = Subscription { epoch: Some(4), ..subscription() };
        let err = resumes.stream(&other, &resume(5, 0), 100, source(0..1, 1)).err().unwrap();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
        let stranger = Subscription {
            caller: crate::stream::Caller { username: Some("b".into()), token: None },
            ..subscription()
        };
        let err = resumes.stream(&stranger, &resume(5, 1), 100, source(0..1, 1)).err().unwrap();
        assert_eq!(err.code(), tonic::Code::NotFound, "another caller's ids are not this one's");
    }
}
