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
//! is kept until more than the window and two messages of later batches were sent after it,
//! not counting the newest (which may be the one half sent).
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

use super::{Batches, Subscription};

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
    /// Sent and perhaps not received, oldest first, each numbered and with the generation it
    /// was sent in; `bytes` is their size.
    sent: VecDeque<(u64, Batch<Stacked>)>,
    bytes: u64,
    /// Taken from the source or lost with a connection, and not sent (again) yet.
    unsent: VecDeque<(u64, Batch<Stacked>)>,
    /// The number the next new batch gets.
    next_seq: u64,
    /// The client's window (within `MAX_WINDOW_BYTES`) and its largest message.
    window: u64,
    max_message: u64,
    /// The largest message sent so far: a batch in one, or a chunk of one.
    largest_message: u64,
    /// Since when no connection serves it.
    idle_since: Option<Instant>,
    /// Its source ended: every batch of it was sent.
    finished: bool,
    /// It gave up what it kept (the cap on idle streams).
    gave_up: bool,
}

impl Kept {
    /// A batch goes out: numbered if new, kept until enough came after it.
    fn sent(&mut self, generation: u64, mut batch: Batch<Stacked>) -> Batch<Stacked> {
        if batch.stream_seq == 0 {
            batch.stream_seq = self.next_seq;
            self.next_seq += 1;
        }
        self.bytes += size(&batch);
        self.largest_message = self.largest_message.max(size(&batch).min(self.max_message));
        // What may be in flight beyond what the client read: its window and two messages.
        let bound = self.window + 2 * self.largest_message;
        self.sent.push_back((generation, batch.clone()));
        while self.sent.len() > 2 {
            let (front, newest) = (size(&self.sent[0].1), size(&self.sent.back().expect("three or more").1));
            if self.bytes - front - newest <= bound {
                break;
            }
            self.sent.pop_front();
            self.bytes -= front;
        }
        batch
    }
}

/// A batch's bytes on the wire, near enough: its payload and its header's row and split ids.
fn size(batch: &Batch<Stacked>) -> u64 {
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
            k.sent.clear();
            k.bytes = 0;
            k.gave_up = true;
        }
    }

    /// `batches` as the resumable stream `resume` names: a new one, or one whose connection
    /// broke, its batches after `resume.received` first.
    pub fn stream(
        self: &Arc<Self>,
        subscription: &Subscription,
        resume: &StreamResume,
        max_message_bytes: usize,
        batches: Batches,
    ) -> Result<Batches, Status> {
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
                let lost: Vec<_> = k.sent.drain(..).filter(|(_, b)| b.stream_seq > resume.received).collect();
                if lost.first().is_some_and(|(_, b)| b.stream_seq != resume.received + 1) && !k.gave_up {
                    // Cannot happen within the bound; said loudly if it ever does.
                    tracing::error!(
                        stream = resume.stream,
                        received = resume.received,
                        kept_from = lost[0].1.stream_seq,
                        "a resumed stream lost batches beyond what was kept"
                    );
                }
                k.bytes = 0;
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
                    unsent: VecDeque::new(),
                    next_seq: 1,
                    window: resume.window_bytes.min(MAX_WINDOW_BYTES),
                    max_message: max_message_bytes as u64,
                    largest_message: 0,
                    idle_since: None,
                    finished: false,
                    gave_up: false,
                }));
                streams.insert(key, kept.clone());
                (kept, 1)
            }
        };
        drop(streams);
        Ok(Resumed { resumes: self.clone(), kept, owner, batches: Some(batches) }.boxed())
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
    type Item = Result<Batch<Stacked>, Status>;

    fn poll_next(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Option<Self::Item>> {
        let generation = self.resumes.generation();
        {
            let mut kept = self.kept.lock().unwrap();
            if kept.owner != self.owner {
                return Poll::Ready(None);
            }
            while let Some((sent_in, batch)) = kept.unsent.pop_front() {
                if sent_in == generation {
                    return Poll::Ready(Some(Ok(kept.sent(generation, batch))));
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
            Some(Ok(batch)) if kept.owner != self.owner => {
                // Taken over meanwhile: the batch is the new connection's to send.
                kept.unsent.push_back((generation, batch));
                Poll::Ready(None)
            }
            Some(Ok(batch)) => Poll::Ready(Some(Ok(kept.sent(generation, batch)))),
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
        let tensor = Stacked { dtype: DType::Uint8, shape: vec![bytes], parts: vec![Bytes::from(vec![0u8; bytes])] };
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
        futures::stream::iter(range.map(move |n| Ok(batch(n, bytes)))).boxed()
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
                    Some(Ok(b)) => got.push((b.stream_seq, b.sequence)),
                    other => panic!("{other:?}"),
                }
            }
            got
        })
    }

    #[test]
    fn a_resumed_stream_sends_what_the_client_did_not_get_then_goes_on() {
        let resumes = Arc::new(Resumes::default());
        let mut first = resumes.stream(&subscription(), &resume(7, 0), 100, source(0..10, 100)).unwrap();
        assert_eq!(take(&mut first, 4), [(1, 0), (2, 1), (3, 2), (4, 3)]);
        drop(first);
        // The client got two whole: batches 3 and 4 come again, then the source's next.
        let mut second = resumes.stream(&subscription(), &resume(7, 2), 100, source(10..20, 100)).unwrap();
        assert_eq!(take(&mut second, 4), [(3, 2), (4, 3), (5, 10), (6, 11)]);
    }

    #[test]
    fn a_new_connection_takes_over_one_still_open_and_loses_nothing_it_took() {
        let resumes = Arc::new(Resumes::default());
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let mut old = resumes.stream(&subscription(), &resume(7, 0), 100, rx.boxed()).unwrap();
        tx.unbounded_send(Ok(batch(0, 100))).unwrap();
        assert_eq!(take(&mut old, 1), [(1, 0)]);
        // The old connection waits on its source when the new one takes over; woken, it
        // stops without taking the source's next batch (the next stream of the hand gets it).
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(old.poll_next_unpin(&mut cx).is_pending());
        let mut new = resumes.stream(&subscription(), &resume(7, 0), 100, source(10..20, 100)).unwrap();
        tx.unbounded_send(Ok(batch(1, 100))).unwrap();
        assert!(block_on(old.next()).is_none(), "the old connection stops");
        assert_eq!(tx.len(), 1, "and left the batch where it was");
        assert_eq!(take(&mut new, 2), [(1, 0), (2, 10)], "what it sent is sent again, then the new source's");
    }

    #[test]
    fn what_is_kept_is_bounded_by_the_window_and_two_messages() {
        let resumes = Arc::new(Resumes::default());
        let mut stream = resumes.stream(&subscription(), &resume(9, 0), 100, source(0..100, 420)).unwrap();
        take(&mut stream, 50);
        drop(stream);
        let key = (None, 9);
        let kept = resumes.streams.lock().unwrap()[&key].clone();
        let kept = kept.lock().unwrap();
        let seqs: Vec<u64> = kept.sent.iter().map(|(_, b)| b.stream_seq).collect();
        // 484 bytes each: a batch goes once three (1452 bytes, over 1000 + 2 * 100) came after
        // it besides the newest.
        assert_eq!(seqs, [47, 48, 49, 50]);
        drop(kept);
        let err = resumes.stream(&subscription(), &resume(9, 60), 100, source(0..1, 1)).err().unwrap();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "more received than sent");
        // Batches smaller than the largest message the client takes are each one message: two
        // of them bound what is in flight beyond the window, not two of the largest (a
        // worker's budget held by six streams' kept batches was mostly that difference).
        let mut stream = resumes.stream(&subscription(), &resume(10, 0), 1 << 20, source(0..100, 420)).unwrap();
        take(&mut stream, 50);
        let kept = resumes.streams.lock().unwrap()[&(None, 10)].clone();
        let seqs: Vec<u64> = kept.lock().unwrap().sent.iter().map(|(_, b)| b.stream_seq).collect();
        // A batch goes once five (2420 bytes, over 1000 + 2 * 484) came after it besides the
        // newest.
        assert_eq!(seqs, [45, 46, 47, 48, 49, 50]);
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
