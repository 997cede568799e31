//! The dispatcher's fuzz inputs (sequences of calls with values biased towards the ones that
//! break things) and a harness that runs them against an in-process `Dispatcher`, checking each
//! answer against a small model of who is registered.

#![allow(dead_code)] // the wire target uses only the inputs

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use proptest::prelude::*;
use stoker_api::proto::dispatcher_server::Dispatcher as _;
use stoker_api::proto::{self, next_split_response::Next};
use stoker_operator::dispatcher::{Dispatcher, DispatcherService, MAX_ID_BYTES, MAX_SPLITS, Timeouts};
use stoker_operator::key::PipelineKey;
use tonic::{Code, Request, Status};

use crate::fuzz_support;

/// The pipelines calls name (valid ones from here, so the harness can count what each holds).
pub const PIPELINES: [(&str, &str); 3] = [("ns", "p"), ("ns", "q"), ("other", "p")];
const JOBS: [&str; 3] = ["j", "k", "j~run"];
/// Worker addresses: few, so registrations replace one another.
const ADDRESSES: [&str; 3] = ["10.0.0.1:7000", "10.0.0.2:7000", ""];
/// Longer than any id the dispatcher accepts.
fn long() -> String {
    "x".repeat(MAX_ID_BYTES + 1)
}

/// Numbers: mostly small (so calls meet: splits of a plan, epochs of a job), else the edges.
fn num() -> impl Strategy<Value = u64> + Clone {
    prop_oneof![
        8 => 0..4u64,
        1 => Just(u64::MAX),
        1 => Just(u64::MAX - 1),
        1 => Just(1 << 32),
        1 => any::<u64>(),
    ]
}

fn count() -> impl Strategy<Value = u32> + Clone {
    prop_oneof![6 => 0..4u32, 1 => Just(u32::MAX), 1 => Just(65_536), 1 => Just(65_537), 1 => any::<u32>()]
}

fn text() -> impl Strategy<Value = String> + Clone {
    prop_oneof![3 => Just(String::new()), 3 => "[a-z]{1,3}", 1 => "\\PC{0,12}", 1 => Just(long())]
}

/// Who a call says it is.
#[derive(Clone, Debug)]
pub enum Id {
    /// One handed out earlier (by index, modulo how many).
    Seen(usize),
    /// An id no registration ever returned.
    Never,
    Empty,
    Long,
}

fn id() -> impl Strategy<Value = Id> {
    prop_oneof![8 => any::<usize>().prop_map(Id::Seen), 1 => Just(Id::Never), 1 => Just(Id::Empty), 1 => Just(Id::Long)]
}

/// The id a registration asks to keep.
#[derive(Clone, Debug)]
pub enum Kept {
    Fresh,
    Seen(usize),
    /// One from another dispatcher (a restart).
    Elsewhere(u8),
    Long,
}

fn kept() -> impl Strategy<Value = Kept> {
    prop_oneof![
        4 => Just(Kept::Fresh),
        3 => any::<usize>().prop_map(Kept::Seen),
        2 => (0..3u8).prop_map(Kept::Elsewhere),
        1 => Just(Kept::Long),
    ]
}

fn pipeline() -> impl Strategy<Value = Option<proto::PipelineRef>> {
    let r = |ns: &str, name: &str| Some(proto::PipelineRef { namespace: ns.into(), name: name.into() });
    prop_oneof![
        8 => (0..PIPELINES.len()).prop_map(move |i| r(PIPELINES[i].0, PIPELINES[i].1)),
        1 => Just(None),
        1 => Just(r("", "p")),
        1 => Just(r("ns", "")),
    ]
}

/// A job: a usual name, a resumed run handed out earlier, or any text.
#[derive(Clone, Debug)]
pub enum Job {
    Named(&'static str),
    Run(usize),
    Text(String),
}

fn job() -> impl Strategy<Value = Job> {
    prop_oneof![
        6 => (0..JOBS.len()).prop_map(|i| Job::Named(JOBS[i])),
        2 => any::<usize>().prop_map(Job::Run),
        1 => text().prop_map(Job::Text),
    ]
}

fn splits() -> impl Strategy<Value = Vec<proto::SplitRef>> {
    let one = (num(), num()).prop_map(|(epoch, split)| proto::SplitRef { epoch, split });
    prop_oneof![
        8 => proptest::collection::vec(one, 0..6),
        // A repeated field near the message limit.
        1 => Just((0..200_000).map(|s| proto::SplitRef { epoch: 0, split: s % 5 }).collect()),
    ]
}

fn positions() -> impl Strategy<Value = Vec<u32>> {
    prop_oneof![
        8 => proptest::collection::vec(prop_oneof![0..8u32, any::<u32>()], 0..6),
        1 => Just((0..500_000).collect()),
    ]
}

fn held() -> impl Strategy<Value = Vec<proto::HeldRows>> {
    let one =
        (num(), num(), positions()).prop_map(|(epoch, split, positions)| proto::HeldRows { epoch, split, positions });
    proptest::collection::vec(one, 0..3)
}

fn rounds() -> impl Strategy<Value = std::collections::HashMap<String, u64>> {
    let worker = prop_oneof![4 => Just("w-a".to_string()), 2 => Just("w-b".to_string()), 1 => text()];
    proptest::collection::hash_map(worker, num(), 0..3)
}

fn received() -> impl Strategy<Value = Vec<proto::RankProgress>> {
    let one = (num(), num(), any::<bool>(), num(), rounds(), num()).prop_map(
        |(epoch, batches, ended, dropped_rows, rounds, position)| proto::RankProgress {
            epoch,
            batches,
            ended,
            dropped_rows,
            rounds,
            position,
        },
    );
    proptest::collection::vec(one, 0..3)
}

fn seconds() -> impl Strategy<Value = f64> {
    prop_oneof![6 => 0.0..2.0f64, 1 => Just(f64::NAN), 1 => Just(f64::INFINITY), 1 => Just(-1.0), 1 => Just(f64::MAX)]
}

/// One call, or the clock jumping past every timeout (the expiry timer's work).
#[derive(Clone, Debug)]
pub enum Op {
    RegisterWorker { r: proto::RegisterWorkerRequest, id: Kept },
    Heartbeat { r: proto::WorkerHeartbeatRequest, id: Id },
    NextSplit { r: proto::NextSplitRequest, id: Id, job: Job },
    ReturnSplits { r: proto::ReturnSplitsRequest, id: Id, job: Job },
    RegisterClient { r: proto::RegisterClientRequest, id: Kept, job: Job, resume_job: Option<Job> },
    WatchWorkers { r: proto::WatchWorkersRequest, job: Job },
    ReportWindow { r: proto::ReportWindowRequest, id: Id },
    Acknowledge { r: proto::AcknowledgeRequest, id: Id },
    AuthorizeReader { r: proto::AuthorizeReaderRequest },
    Expire,
}

fn register_worker() -> impl Strategy<Value = Op> {
    let splits = prop_oneof![8 => 1..6u64, 1 => Just(0), 1 => Just(MAX_SPLITS + 1), 1 => Just(u64::MAX)];
    let hint = (count(), prop_oneof![Just("f1".to_string()), text()], any::<bool>())
        .prop_map(|(at, fingerprint, complete)| proto::CacheHint { at, fingerprint, complete });
    // The modes, and numbers no mode has.
    let mode = prop_oneof![0..4i32, proptest::num::i32::ANY];
    (
        pipeline(),
        0..ADDRESSES.len(),
        count(),
        splits,
        prop_oneof![Just("d".to_string()), text()],
        kept(),
        proptest::collection::vec(hint, 0..3),
        mode,
        proptest::option::of(num()),
    )
        .prop_map(|(pipeline, a, threads, splits, plan_digest, id, cache_hints, cache_mode, shuffle_seed)| {
            let r = proto::RegisterWorkerRequest {
                pipeline,
                address: ADDRESSES[a].into(),
                threads,
                splits,
                plan_digest,
                cache_hints,
                cache_mode,
                shuffle_seed,
                ..Default::default()
            };
            Op::RegisterWorker { r, id }
        })
}

fn heartbeat() -> impl Strategy<Value = Op> {
    let hint = (count(), num(), num()).prop_map(|(at, elements, bytes)| proto::HintBytes { at, elements, bytes });
    let cache = (
        proptest::collection::vec(hint, 0..3),
        seconds(),
        seconds(),
        proptest::collection::vec(prop_oneof![Just("f1".to_string()), text()], 0..3),
        text(),
        num(),
        num(),
    )
        .prop_map(|(hints, write, read, complete, corrupt, splits_measured, elements_read)| proto::CacheProgress {
            hints,
            write_bytes_per_second: write,
            read_bytes_per_second: read,
            complete,
            corrupt,
            splits_measured,
            elements_read,
            ..Default::default()
        });
    let progress = (num(), num(), proptest::collection::vec(seconds(), 0..4), text(), proptest::option::of(cache))
        .prop_map(|(records, elements, op_seconds, error, cache)| proto::WorkerProgress {
            records,
            elements,
            op_seconds,
            error,
            cache,
            ..Default::default()
        });
    (id(), proptest::option::of(progress)).prop_map(|(id, progress)| Op::Heartbeat {
        r: proto::WorkerHeartbeatRequest { worker_id: String::new(), progress },
        id,
    })
}

fn register_client() -> impl Strategy<Value = Op> {
    let rejoin = (num(), num(), count(), splits(), held()).prop_map(
        |(incarnation, open_epoch, clients, completed, received)| proto::Rejoin {
            incarnation,
            open_epoch,
            clients,
            completed,
            received,
        },
    );
    let resume = (num(), num(), count(), count(), held(), count()).prop_map(
        |(epoch, batches, consumers, consumer_index, yielded, merged_ranks)| proto::ResumeState {
            job: String::new(),
            epoch,
            batches,
            consumers,
            consumer_index,
            yielded,
            merged_ranks,
        },
    );
    (
        pipeline(),
        job(),
        count(),
        count(),
        any::<bool>(),
        kept(),
        proptest::option::of(rejoin),
        proptest::option::weighted(0.2, (resume, proptest::option::weighted(0.8, job()))),
    )
        .prop_map(|(pipeline, job, consumer_index, consumers, coordinated, id, rejoin, resume)| {
            let (resume, resume_job) = match resume {
                Some((state, job)) => (Some(state), job),
                None => (None, None),
            };
            let r = proto::RegisterClientRequest {
                pipeline,
                consumer_index,
                consumers,
                coordinated,
                rejoin,
                resume,
                ..Default::default()
            };
            Op::RegisterClient { r, id, job, resume_job }
        })
}

pub fn ops() -> impl Strategy<Value = Op> {
    let next_split = (id(), job(), splits(), num()).prop_map(|(id, job, completed, epoch)| Op::NextSplit {
        r: proto::NextSplitRequest { completed, epoch, ..Default::default() },
        id,
        job,
    });
    let return_splits =
        (id(), job(), num(), proptest::collection::vec(num(), 0..5)).prop_map(|(id, job, epoch, splits)| {
            Op::ReturnSplits { r: proto::ReturnSplitsRequest { epoch, splits, ..Default::default() }, id, job }
        });
    let watch = (pipeline(), job()).prop_map(|(pipeline, job)| Op::WatchWorkers {
        r: proto::WatchWorkersRequest { pipeline, job: String::new() },
        job,
    });
    let window = (id(), num(), seconds(), seconds(), seconds(), count(), seconds()).prop_map(
        |(id, batches, median_seconds, p90_seconds, wait_fraction, workers, mean_seconds)| Op::ReportWindow {
            r: proto::ReportWindowRequest {
                batches,
                median_seconds,
                p90_seconds,
                wait_fraction,
                workers,
                mean_seconds,
                ..Default::default()
            },
            id,
        },
    );
    let acknowledge = (id(), splits(), num(), held(), any::<bool>(), any::<bool>(), received()).prop_map(
        |(id, completed, list_version, held, leaving, discarded, received)| Op::Acknowledge {
            r: proto::AcknowledgeRequest {
                completed,
                list_version,
                held,
                leaving,
                discarded,
                received,
                ..Default::default()
            },
            id,
        },
    );
    let authorize = (pipeline(), text())
        .prop_map(|(pipeline, token)| Op::AuthorizeReader { r: proto::AuthorizeReaderRequest { pipeline, token } });
    prop_oneof![
        3 => register_worker(),
        1 => authorize,
        2 => heartbeat(),
        4 => next_split,
        1 => return_splits,
        3 => register_client(),
        1 => watch,
        1 => window,
        4 => acknowledge,
        1 => Just(Op::Expire),
    ]
}

/// Names handed out so far, for calls that use them again.
#[derive(Default)]
pub struct Seen {
    /// Worker id -> its address, while registered.
    pub workers: BTreeMap<String, String>,
    pub clients: BTreeMap<String, ()>,
    /// Every id ever handed out, live or not.
    pub ever: Vec<String>,
    pub runs: Vec<String>,
}

impl Seen {
    fn id(&self, id: &Id, live: &[&String]) -> String {
        match id {
            Id::Seen(i) if !live.is_empty() => live[i % live.len()].clone(),
            Id::Seen(i) if !self.ever.is_empty() => self.ever[i % self.ever.len()].clone(),
            Id::Seen(_) | Id::Never => "never-registered".into(),
            Id::Empty => String::new(),
            Id::Long => long(),
        }
    }

    pub fn worker(&self, id: &Id) -> String {
        self.id(id, &self.workers.keys().collect::<Vec<_>>())
    }

    pub fn client(&self, id: &Id) -> String {
        self.id(id, &self.clients.keys().collect::<Vec<_>>())
    }

    pub fn kept(&self, id: &Kept) -> String {
        match id {
            Kept::Fresh => String::new(),
            Kept::Seen(i) if !self.ever.is_empty() => self.ever[i % self.ever.len()].clone(),
            Kept::Seen(_) => String::new(),
            Kept::Elsewhere(n) => format!("w-elsewhere-{n}"),
            Kept::Long => long(),
        }
    }

    pub fn job(&self, job: &Job) -> String {
        match job {
            Job::Named(name) => name.to_string(),
            Job::Run(i) if !self.runs.is_empty() => self.runs[i % self.runs.len()].clone(),
            Job::Run(_) => "j".into(),
            Job::Text(t) => t.clone(),
        }
    }
}

/// A valid pipeline of ours.
fn ours(p: &Option<proto::PipelineRef>) -> bool {
    p.as_ref().is_some_and(|p| !p.namespace.is_empty() && !p.name.is_empty())
}

/// The call's request with the names filled in from what was seen, and its gRPC method.
pub fn request(op: &Op, seen: &Seen) -> Option<(&'static str, Vec<u8>)> {
    use prost::Message;
    let path = |m: &str| -> &'static str {
        match m {
            "RegisterWorker" => "/stoker.v1alpha1.Dispatcher/RegisterWorker",
            "WorkerHeartbeat" => "/stoker.v1alpha1.Dispatcher/WorkerHeartbeat",
            "NextSplit" => "/stoker.v1alpha1.Dispatcher/NextSplit",
            "ReturnSplits" => "/stoker.v1alpha1.Dispatcher/ReturnSplits",
            "RegisterClient" => "/stoker.v1alpha1.Dispatcher/RegisterClient",
            "WatchWorkers" => "/stoker.v1alpha1.Dispatcher/WatchWorkers",
            "ReportWindow" => "/stoker.v1alpha1.Dispatcher/ReportWindow",
            "AuthorizeReader" => "/stoker.v1alpha1.Dispatcher/AuthorizeReader",
            _ => "/stoker.v1alpha1.Dispatcher/Acknowledge",
        }
    };
    Some(match filled(op, seen)? {
        Filled::RegisterWorker(r) => (path("RegisterWorker"), r.encode_to_vec()),
        Filled::Heartbeat(r) => (path("WorkerHeartbeat"), r.encode_to_vec()),
        Filled::NextSplit(r) => (path("NextSplit"), r.encode_to_vec()),
        Filled::ReturnSplits(r) => (path("ReturnSplits"), r.encode_to_vec()),
        Filled::RegisterClient(r) => (path("RegisterClient"), r.encode_to_vec()),
        Filled::WatchWorkers(r) => (path("WatchWorkers"), r.encode_to_vec()),
        Filled::ReportWindow(r) => (path("ReportWindow"), r.encode_to_vec()),
        Filled::Acknowledge(r) => (path("Acknowledge"), r.encode_to_vec()),
        Filled::AuthorizeReader(r) => (path("AuthorizeReader"), r.encode_to_vec()),
    })
}

pub enum Filled {
    RegisterWorker(proto::RegisterWorkerRequest),
    Heartbeat(proto::WorkerHeartbeatRequest),
    NextSplit(proto::NextSplitRequest),
    ReturnSplits(proto::ReturnSplitsRequest),
    RegisterClient(proto::RegisterClientRequest),
    WatchWorkers(proto::WatchWorkersRequest),
    ReportWindow(proto::ReportWindowRequest),
    Acknowledge(proto::AcknowledgeRequest),
    AuthorizeReader(proto::AuthorizeReaderRequest),
}

/// The request with its names resolved; None for the clock.
pub fn filled(op: &Op, seen: &Seen) -> Option<Filled> {
    Some(match op.clone() {
        Op::RegisterWorker { mut r, id } => {
            r.worker_id = seen.kept(&id);
            Filled::RegisterWorker(r)
        }
        Op::Heartbeat { mut r, id } => {
            r.worker_id = seen.worker(&id);
            Filled::Heartbeat(r)
        }
        Op::NextSplit { mut r, id, job } => {
            (r.worker_id, r.job) = (seen.worker(&id), seen.job(&job));
            Filled::NextSplit(r)
        }
        Op::ReturnSplits { mut r, id, job } => {
            (r.worker_id, r.job) = (seen.worker(&id), seen.job(&job));
            Filled::ReturnSplits(r)
        }
        Op::RegisterClient { mut r, id, job, resume_job } => {
            (r.client_id, r.job) = (seen.kept(&id), seen.job(&job));
            if let Some(resume) = r.resume.as_mut() {
                // Mostly the state of the job it registers for; else a lie.
                resume.job = resume_job.map_or_else(|| r.job.clone(), |j| seen.job(&j));
            }
            Filled::RegisterClient(r)
        }
        Op::WatchWorkers { mut r, job } => {
            r.job = seen.job(&job);
            Filled::WatchWorkers(r)
        }
        Op::ReportWindow { mut r, id } => {
            r.client_id = seen.client(&id);
            Filled::ReportWindow(r)
        }
        Op::Acknowledge { mut r, id } => {
            r.client_id = seen.client(&id);
            Filled::Acknowledge(r)
        }
        Op::AuthorizeReader { r } => Filled::AuthorizeReader(r),
        Op::Expire => return None,
    })
}

#[path = "harness.rs"]
mod harness;
#[allow(unused_imports)] // the wire target has no use for it
pub use harness::Harness;
