//! What the fuzz targets (`operator/tests/fuzz_dispatcher*.rs`) found: values a caller may
//! send that panicked or sized an allocation, each as the smallest call sequence.

use super::*;
use crate::dispatcher::cache::CacheProgress;
use crate::dispatcher::cache::HintSeen;
use stoker_api::CacheMode;
use stoker_api::proto::HintBytes;

fn registration(address: &str, splits: u64) -> WorkerRegistration {
    WorkerRegistration {
        pipeline: PipelineKey::new("ns", "p"),
        address: address.into(),
        threads: 1,
        splits,
        plan_digest: "d".into(),
        worker_id: None,
        cache_mode: CacheMode::Auto,
        cache_hints: vec![HintSeen { at: 1, fingerprint: "f".into(), complete: false }],
        shuffle_seed: None,
    }
}

fn client(job: &str) -> ClientRegistration {
    ClientRegistration {
        pipeline: PipelineKey::new("ns", "p"),
        job: job.into(),
        consumer_index: 0,
        consumers: 0,
        coordinated: false,
        client_id: None,
        rejoin: None,
        resume: None,
        share: None,
    }
}

fn invalid<T: std::fmt::Debug>(r: Result<T, DispatchError>) -> bool {
    matches!(r, Err(DispatchError::Invalid(_)))
}

#[test]
fn a_plan_of_more_than_max_splits_and_an_overlong_id_are_refused() {
    let t = Instant::now();
    let mut s = DispatcherState::new("i", Timeouts::default());
    // u64::MAX splits made every job's queue a Vec of 2^64 entries (capacity overflow panic, a
    // poisoned mutex); 2^32 one of 32 GiB.
    assert!(invalid(s.register_worker(registration("a:1", u64::MAX), t)));
    assert!(invalid(s.register_worker(registration("a:1", MAX_SPLITS + 1), t)));
    let long = "w".repeat(MAX_ID_BYTES + 1);
    let worker_id = Some(WorkerId::new(long.as_str()));
    assert!(invalid(s.register_worker(WorkerRegistration { worker_id, ..registration("a:1", 1) }, t)));
    assert!(invalid(s.register_client(ClientRegistration { client_id: Some(long.into()), ..client("j") }, t)));
    let kept = Some(WorkerId::new("w".repeat(MAX_ID_BYTES)));
    assert_eq!(
        s.register_worker(WorkerRegistration { worker_id: kept.clone(), ..registration("a:1", MAX_SPLITS) }, t).ok(),
        kept
    );
}

#[test]
fn epochs_at_u64_max_do_not_overflow() {
    let t = Instant::now();
    let mut s = DispatcherState::new("i", Timeouts::default());
    let w = s.register_worker(registration("a:1", 1), t).unwrap();
    // A job resumed at epoch u64::MAX: completing it moves on from the last epoch there is
    // (`epoch + 1` in the ledger panicked in debug builds, with the state's mutex held).
    let resume = Resume {
        job: "r".into(),
        epoch: u64::MAX,
        batches: 1,
        consumers: 0,
        consumer_index: 0,
        yielded: vec![],
        merged: false,
    };
    let run = s.register_client(ClientRegistration { resume: Some(resume), ..client("r") }, t).unwrap().job;
    let first = s.next_split(&w, &run, &[], u64::MAX, t);
    assert_eq!(first, Ok(Assignment::Split { epoch: u64::MAX, split: 0, skip: vec![], echo: 0 }));
    s.next_split(&w, &run, &[(u64::MAX, 0)], u64::MAX, t).unwrap();
    // A rank rejoining with u64::MAX as its open epoch (`open + 1` in `Ranks::rejoined`).
    let rejoin = Rejoin { incarnation: 7, open_epoch: u64::MAX, clients: 1, ..Rejoin::default() };
    s.register_client(ClientRegistration { consumers: 2, rejoin: Some(rejoin), ..client("k") }, t).unwrap();
}

#[test]
fn workers_reporting_u64_max_counts_do_not_overflow_the_sums() {
    let t = Instant::now();
    let mut s = DispatcherState::new("i", Timeouts::default());
    let huge = Progress {
        elements: u64::MAX,
        cache: CacheProgress {
            hints: vec![HintBytes { at: 1, elements: u64::MAX, bytes: u64::MAX }],
            splits_measured: u64::MAX,
            write_bytes_per_second: 1.0,
            read_bytes_per_second: 1.0,
            ..CacheProgress::default()
        },
        ..Progress::default()
    };
    for address in ["a:1", "b:1"] {
        let w = s.register_worker(registration(address, 1), t).unwrap();
        // The second worker's report is summed with the first's (`+` panicked in debug builds).
        s.heartbeat(&w, huge.clone(), t).unwrap();
    }
}
