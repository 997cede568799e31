//! The dispatcher's bookkeeping driven by a moving clock: hand-out, failures, recoveries,
//! windows and clients.

use std::time::Duration;

use super::*;
use stoker_api::{CacheMode, WorkersReport};

use crate::dispatcher::ledger::Held;
use crate::dispatcher::ranks::Received;

fn split(epoch: u64, split: u64) -> Assignment {
    Assignment::Split { epoch, split, skip: Vec::new(), echo: 0 }
}

pub(super) fn key() -> PipelineKey {
    PipelineKey::new("ns", "p")
}

pub(super) fn registration(address: &str, splits: u64) -> WorkerRegistration {
    WorkerRegistration {
        pipeline: key(),
        address: address.into(),
        threads: 2,
        splits,
        plan_digest: format!("d{splits}"),
        worker_id: None,
        cache_mode: CacheMode::Never,
        cache_hints: Vec::new(),
        shuffle_seed: None,
    }
}

pub(super) fn client(job: &str, consumer_index: u32, consumers: u32) -> ClientRegistration {
    ClientRegistration {
        pipeline: key(),
        job: job.into(),
        consumer_index,
        consumers,
        coordinated: false,
        client_id: None,
        rejoin: None,
        resume: None,
        share: None,
    }
}

/// An acknowledgement with nothing sent again.
fn ack(completed: &[(u64, u64)], version: u64, held: &[Held], received: &[(u64, Received)]) -> Acknowledgement {
    Acknowledgement {
        completed: completed.to_vec(),
        version,
        held: held.to_vec(),
        received: received.to_vec(),
        ..Acknowledgement::default()
    }
}

/// Takes and completes splits until the dispatcher answers with something else, which is
/// returned beside the splits done.
fn work(state: &mut DispatcherState, worker: &WorkerId, job: &str, epoch: u64, now: Instant) -> (Vec<u64>, Assignment) {
    let (mut got, mut completed, job) = (Vec::new(), Vec::new(), JobName::from(job));
    loop {
        match state.next_split(worker, &job, &completed, 0, now).unwrap() {
            Assignment::Split { epoch: e, split, .. } if e == epoch => {
                got.push(split);
                completed = vec![(e, split)];
            }
            other => return (got, other),
        }
    }
}

#[test]
fn one_worker_gets_every_split_once_then_the_next_epoch() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    s.register_client(client("job", 0, 0), t).unwrap();
    let w = s.register_worker(registration("a:1", 3), t).unwrap();
    let (got, next) = work(&mut s, &w, "job", 0, t);
    assert_eq!(got, vec![0, 1, 2]);
    assert_eq!(next, Assignment::Finished { epoch: 0 });
    assert_eq!(s.jobs(&key())[0].epoch, 1);
    assert_eq!(s.next_split(&w, &"job".into(), &[], 1, t).unwrap(), split(1, 0));
}

#[test]
fn a_worker_with_nothing_left_in_an_epoch_starts_the_next_but_not_the_one_after() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    s.register_client(client("j", 0, 0), t).unwrap();
    let a = s.register_worker(registration("a:1", 2), t).unwrap();
    let b = s.register_worker(registration("b:1", 2), t).unwrap();
    assert_eq!(s.next_split(&a, &"j".into(), &[], 0, t).unwrap(), split(0, 0));
    assert_eq!(s.next_split(&b, &"j".into(), &[], 0, t).unwrap(), split(0, 1));
    // Nothing left in epoch 0 for a (b holds the last split, and may die): a starts epoch 1.
    assert_eq!(s.next_split(&a, &"j".into(), &[(0, 0)], 0, t).unwrap(), Assignment::Draining { epoch: 0 });
    assert_eq!(s.next_split(&a, &"j".into(), &[], 1, t).unwrap(), split(1, 0));
    assert_eq!(s.next_split(&a, &"j".into(), &[(1, 0)], 1, t).unwrap(), split(1, 1));
    // b still holds epoch 0's split 1: a may not run two epochs ahead of it.
    assert_eq!(s.next_split(&a, &"j".into(), &[(1, 1)], 2, t).unwrap(), Assignment::Draining { epoch: 2 });
    assert_eq!(s.jobs(&key())[0].epoch, 0);
    // b finishes epoch 0; epoch 1 is done too, and the job moves on to epoch 2.
    assert_eq!(s.next_split(&b, &"j".into(), &[(0, 1)], 0, t).unwrap(), Assignment::Finished { epoch: 0 });
    assert_eq!(s.jobs(&key())[0].epoch, 1);
    assert_eq!(s.next_split(&a, &"j".into(), &[], 2, t).unwrap(), split(2, 0));
    assert_eq!(s.jobs(&key())[0].epoch, 2);
}

#[test]
fn a_dead_workers_splits_of_the_next_epoch_come_back_too() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(30) });
    let c = s.register_client(client("j", 0, 0), t).unwrap().client_id;
    let a = s.register_worker(registration("a:1", 2), t).unwrap();
    let b = s.register_worker(registration("b:1", 2), t).unwrap();
    assert_eq!(s.next_split(&a, &"j".into(), &[], 0, t).unwrap(), split(0, 0));
    assert_eq!(s.next_split(&b, &"j".into(), &[], 0, t).unwrap(), split(0, 1));
    assert_eq!(s.next_split(&b, &"j".into(), &[], 1, t).unwrap(), split(1, 0));
    let later = t + Duration::from_secs(6);
    s.heartbeat(&a, Progress::default(), later).unwrap();
    s.expire(later);
    // The client stopped streaming from the dead worker, holding nothing of it.
    s.acknowledge(&c, ack(&[], s.listing(&key()).version, &[], &[]), later).unwrap();
    assert_eq!(s.jobs(&key())[0].requeued, 2);
    assert_eq!(s.next_split(&a, &"j".into(), &[(0, 0)], 0, later).unwrap(), split(0, 1));
    assert_eq!(s.next_split(&a, &"j".into(), &[(0, 1)], 1, later).unwrap(), split(1, 0));
}

#[test]
fn jobs_each_get_whole_epochs() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    s.register_client(client("x", 0, 0), t).unwrap();
    s.register_client(client("y", 0, 0), t).unwrap();
    let w = s.register_worker(registration("a:1", 4), t).unwrap();
    assert_eq!(work(&mut s, &w, "x", 0, t).0, vec![0, 1, 2, 3]);
    assert_eq!(work(&mut s, &w, "y", 0, t).0, vec![0, 1, 2, 3]);
}

#[test]
fn a_dead_workers_unfinished_splits_go_to_the_others() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(30) });
    let c = s.register_client(client("j", 0, 0), t).unwrap().client_id;
    let a = s.register_worker(registration("a:1", 4), t).unwrap();
    let b = s.register_worker(registration("b:1", 4), t).unwrap();
    assert_eq!(s.next_split(&a, &"j".into(), &[], 0, t).unwrap(), split(0, 0));
    assert_eq!(s.next_split(&a, &"j".into(), &[(0, 0)], 0, t).unwrap(), split(0, 1));
    // a dies holding split 1; b keeps heartbeating.
    let later = t + Duration::from_secs(6);
    s.heartbeat(&b, Progress::default(), later).unwrap();
    assert_eq!(s.expire(later), BTreeSet::from([key()]));
    // The client stopped streaming from the dead worker, holding nothing of it.
    s.acknowledge(&c, ack(&[], s.listing(&key()).version, &[], &[]), later).unwrap();
    assert_eq!(s.worker_addresses(&key()), vec!["b:1".to_string()]);
    let (mut got, _) = work(&mut s, &b, "j", 0, later);
    got.sort_unstable();
    assert_eq!(got, vec![1, 2, 3], "split 0 was done by a before it died; 1 comes back");
    let job = &s.jobs(&key())[0];
    assert_eq!((job.epoch, job.requeued, job.repeats), (1, 1, 0));
    // The dead worker's id is unknown now: it must register again.
    assert!(matches!(s.next_split(&a, &"j".into(), &[], 0, later), Err(DispatchError::Unknown { .. })));
}

/// Found on real pods: a worker pod's IP went to its replacement (and a crashed container
/// came back at its pod's address) before the dead worker's heartbeats ran out. The list kept
/// the same address, so the client never saw the dead worker leave, never told its rows, and
/// its split came again whole: 10 rows twice.
#[test]
fn a_new_worker_at_a_live_workers_address_replaces_it_at_once() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(30) });
    let c = s.register_client(client("j", 0, 0), t).unwrap().client_id;
    let old = s.register_worker(registration("a:1", 2), t).unwrap();
    assert_eq!(s.next_split(&old, &"j".into(), &[], 0, t).unwrap(), split(0, 0));
    let before = s.listing(&key());
    // A new process at the same address, well within the old one's heartbeat timeout.
    let new = s.register_worker(registration("a:1", 2), t + Duration::from_secs(1)).unwrap();
    assert_ne!(new, old);
    let after = s.listing(&key());
    assert_eq!(*after.workers, vec![("a:1".to_string(), new.clone())]);
    assert!(after.version > before.version, "the list changed: the client drops the old worker");
    assert!(
        matches!(s.next_split(&old, &"j".into(), &[], 0, t), Err(DispatchError::Unknown { .. })),
        "the old one is gone"
    );
    // Its split comes back without the rows the client says it got from it.
    s.acknowledge(&c, ack(&[], after.version, &[held(0, 0, &[0, 1])], &[]), t).unwrap();
    assert_eq!(
        s.next_split(&new, &"j".into(), &[], 0, t).unwrap(),
        Assignment::Split { epoch: 0, split: 0, skip: vec![0, 1], echo: 0 }
    );
    // Re-registering under its own id is not a new worker.
    let again = WorkerRegistration { worker_id: Some(new.clone()), ..registration("a:1", 2) };
    assert_eq!(s.register_worker(again, t).unwrap(), new);
    assert_eq!(s.listing(&key()).version, after.version);
}

#[test]
fn a_late_completion_of_a_requeued_split_counts_as_a_repeat() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(30) });
    let c = s.register_client(client("j", 0, 0), t).unwrap().client_id;
    let a = s.register_worker(registration("a:1", 2), t).unwrap();
    let b = s.register_worker(registration("b:1", 2), t).unwrap();
    assert_eq!(s.next_split(&a, &"j".into(), &[], 0, t).unwrap(), split(0, 0));
    let later = t + Duration::from_secs(6);
    s.heartbeat(&b, Progress::default(), later).unwrap();
    s.expire(later);
    // The client stopped streaming from the dead worker, holding nothing of it.
    s.acknowledge(&c, ack(&[], s.listing(&key()).version, &[], &[]), later).unwrap();
    assert_eq!(s.next_split(&b, &"j".into(), &[], 0, later).unwrap(), split(0, 0));
    // a was only slow: it comes back and reports split 0 as well.
    let a2 =
        s.register_worker(WorkerRegistration { worker_id: Some(a.clone()), ..registration("a:1", 2) }, later).unwrap();
    assert_eq!(a2, a, "re-registration keeps the id");
    assert_eq!(s.next_split(&b, &"j".into(), &[(0, 0)], 0, later).unwrap(), split(0, 1));
    s.next_split(&a, &"j".into(), &[(0, 0)], 0, later).unwrap();
    assert_eq!(s.jobs(&key())[0].repeats, 1);
}

/// A client rejoining a restarted dispatcher (incarnation 99 before) with what it has.
fn rejoining(id: &str, completed: Vec<(u64, u64)>, received: Vec<Held>) -> ClientRegistration {
    let rejoin = Rejoin { incarnation: 99, open_epoch: 7, clients: 2, completed, received };
    ClientRegistration { client_id: Some(id.into()), rejoin: Some(rejoin), ..client("j", 0, 0) }
}

fn held(epoch: u64, split: u64, positions: &[u32]) -> Held {
    Held { epoch, split, positions: positions.to_vec() }
}

#[test]
fn a_restarted_dispatcher_hands_out_nothing_of_a_job_until_its_clients_rejoined_then_skips_what_they_have() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t2", Timeouts::default());
    let w = s
        .register_worker(WorkerRegistration { worker_id: Some("w-t1-1".into()), ..registration("a:1", 4) }, t)
        .unwrap();
    assert_eq!(w, "w-t1-1", "the worker keeps its id");
    // The worker's producer asks before any client is back: its batches would repeat rows.
    assert_eq!(s.next_split(&w, &"j".into(), &[], 7, t).unwrap(), Assignment::Draining { epoch: 7 });
    let first = s.register_client(rejoining("c-t1-1", vec![(7, 0)], vec![held(7, 1, &[0, 2])]), t).unwrap();
    assert_eq!((first.client_id.as_str(), first.incarnation), ("c-t1-1", s.incarnation()));
    assert_ne!(s.incarnation(), 99);
    assert_eq!(s.listing(&key()).epochs[&JobName::from("j")], 7, "the job's open epoch, from the rejoin");
    assert_eq!(
        s.next_split(&w, &"j".into(), &[], 7, t).unwrap(),
        Assignment::Draining { epoch: 7 },
        "one of two clients"
    );
    s.register_client(rejoining("c-t1-2", vec![(7, 3)], vec![held(7, 1, &[1]), held(8, 0, &[5])]), t).unwrap();
    assert_eq!(
        s.next_split(&w, &"j".into(), &[], 7, t).unwrap(),
        Assignment::Split { epoch: 7, split: 1, skip: vec![0, 1, 2], echo: 0 }
    );
    assert_eq!(s.next_split(&w, &"j".into(), &[], 7, t).unwrap(), split(7, 2), "splits 0 and 3 are done");
    assert_eq!(s.next_split(&w, &"j".into(), &[], 7, t).unwrap(), Assignment::Draining { epoch: 7 });
    assert_eq!(
        s.next_split(&w, &"j".into(), &[], 8, t).unwrap(),
        Assignment::Split { epoch: 8, split: 0, skip: vec![5], echo: 0 }
    );
    let job = &s.jobs(&key())[0];
    assert_eq!((job.epoch, job.done, job.repeats, job.unacknowledged), (7, 2, 0, 0));
}

/// Found restarting the dispatcher near an epoch's end: the clients had every split of the
/// open epoch and waited to be told it was over; the workers, their queues of the next epoch
/// full, waited for the clients to read on and asked for nothing. A job that started only when
/// a worker asked never started.
#[test]
fn a_rejoined_job_starts_once_its_clients_are_in_without_a_worker_asking() {
    let t = Instant::now();
    let all_of_7 = vec![(7, 0), (7, 1)];
    for worker_first in [true, false] {
        let mut s = DispatcherState::new("t2", Timeouts::default());
        let rejoin = |id: &str| {
            let rejoin =
                Rejoin { incarnation: 99, open_epoch: 7, clients: 1, completed: all_of_7.clone(), received: vec![] };
            ClientRegistration { client_id: Some(id.into()), rejoin: Some(rejoin), ..client("j", 0, 0) }
        };
        if worker_first {
            s.register_worker(registration("a:1", 2), t).unwrap();
            s.register_client(rejoin("c-t1-1"), t).unwrap();
        } else {
            // The plan comes with the first worker: the job starts then.
            s.register_client(rejoin("c-t1-1"), t).unwrap();
            assert_eq!(s.listing(&key()).epochs[&JobName::from("j")], 7, "no plan yet: the job waits");
            s.register_worker(registration("a:1", 2), t).unwrap();
        }
        assert_eq!(s.listing(&key()).epochs[&JobName::from("j")], 8, "worker first: {worker_first}: epoch 7 is over");
        assert_eq!(s.acknowledge(&"c-t1-1".into(), ack(&[], 0, &[], &[]), t).unwrap(), 8);
    }
}

#[test]
fn a_rejoin_goes_on_without_a_client_that_never_came_back_and_a_late_one_is_acknowledged() {
    let t = Instant::now();
    let mut s =
        DispatcherState::new("t2", Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(30) });
    let w = s.register_worker(registration("a:1", 2), t).unwrap();
    let c = s.register_client(rejoining("c-t1-1", vec![], vec![held(7, 0, &[4])]), t).unwrap().client_id;
    let soon = t + Duration::from_secs(29);
    s.heartbeat(&w, Progress::default(), soon).unwrap();
    s.report_window(
        &c,
        Window { batches: 1, median_s: 0.1, p90_s: 0.1, mean_s: 0.1, wait_fraction: 0.0, workers: 1 },
        soon,
    )
    .unwrap();
    s.expire(soon);
    assert_eq!(
        s.next_split(&w, &"j".into(), &[], 7, soon).unwrap(),
        Assignment::Draining { epoch: 7 },
        "c-t1-2 may come"
    );
    let later = t + Duration::from_secs(31);
    s.heartbeat(&w, Progress::default(), later).unwrap();
    s.expire(later);
    assert_eq!(
        s.next_split(&w, &"j".into(), &[], 7, later).unwrap(),
        Assignment::Split { epoch: 7, split: 0, skip: vec![4], echo: 0 }
    );
    assert_eq!(s.jobs(&key())[0].unacknowledged, 1, "counted: rows the missing client had may repeat");
    // It comes back after all, with split 1's rows: they are left out of it.
    s.register_client(rejoining("c-t1-2", vec![], vec![held(7, 1, &[0])]), later).unwrap();
    assert_eq!(
        s.next_split(&w, &"j".into(), &[], 7, later).unwrap(),
        Assignment::Split { epoch: 7, split: 1, skip: vec![0], echo: 0 }
    );
    // A client registering again with the dispatcher it had lost nothing: plain re-registration.
    let same = Rejoin { incarnation: s.incarnation(), open_epoch: 9, ..Rejoin::default() };
    let again = ClientRegistration { client_id: Some(c), rejoin: Some(same), ..client("j", 0, 0) };
    s.register_client(again, later).unwrap();
    assert_eq!(s.jobs(&key())[0].epoch, 7);
}

/// A job's life has one place: a client late to a rejoin whose gathering went on without it
/// (the client timeout passed), but before the plan was known (no worker yet), adds what it
/// has to the gathered job. Before, with a map per phase, its rows went into a second
/// gathering the job never read, and came again.
#[test]
fn a_client_late_for_a_gathering_before_the_plan_is_known_still_counts() {
    let t = Instant::now();
    let mut s =
        DispatcherState::new("t2", Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(30) });
    s.register_client(rejoining("c-t1-1", vec![], vec![held(7, 0, &[4])]), t).unwrap();
    let later = t + Duration::from_secs(31);
    s.expire(later);
    assert_eq!(s.listing(&key()).epochs[&JobName::from("j")], 7, "gathered, waiting for the plan");
    s.register_client(rejoining("c-t1-2", vec![], vec![held(7, 1, &[0])]), later).unwrap();
    let w = s.register_worker(registration("a:1", 2), later).unwrap();
    assert_eq!(
        s.next_split(&w, &"j".into(), &[], 7, later).unwrap(),
        Assignment::Split { epoch: 7, split: 0, skip: vec![4], echo: 0 }
    );
    assert_eq!(
        s.next_split(&w, &"j".into(), &[], 7, later).unwrap(),
        Assignment::Split { epoch: 7, split: 1, skip: vec![0], echo: 0 }
    );
}

#[test]
fn workers_with_a_different_listing_are_refused_while_the_old_ones_live() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(30) });
    s.register_worker(registration("a:1", 2), t).unwrap();
    let err = s.register_worker(registration("b:1", 3), t).unwrap_err();
    assert!(err.to_string().contains("listing differs"), "{err}");
    // Once the old workers are gone, the new listing wins.
    let later = t + Duration::from_secs(6);
    s.expire(later);
    s.register_worker(registration("b:1", 3), later).unwrap();
    assert_eq!(s.jobs(&key()), vec![]);
}

#[test]
fn windows_are_grouped_by_job_and_taken_once() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    let c0 = s.register_client(client("j", 0, 0), t).unwrap().client_id;
    let c1 = s.register_client(client("j", 1, 0), t).unwrap().client_id;
    let window = Window { batches: 10, median_s: 0.1, p90_s: 0.2, mean_s: 0.12, wait_fraction: 0.5, workers: 1 };
    s.report_window(&c0, window.clone(), t).unwrap();
    s.report_window(&c1, window.clone(), t).unwrap();
    let bad = Window { median_s: f64::NAN, ..window.clone() };
    assert!(matches!(s.report_window(&c1, bad, t), Err(DispatchError::Invalid(_))));
    let taken = s.take_windows();
    assert_eq!(taken.len(), 1);
    assert_eq!((taken[0].consumers, taken[0].windows.len()), (2, 2));
    assert!(s.take_windows()[0].windows.is_empty());
    assert_eq!(s.consumers(&key(), &"j".into()), vec![0, 1]);
}

#[test]
fn clients_complete_splits_and_a_silent_one_gets_its_splits_redone() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts { worker: Duration::from_secs(60), client: Duration::from_secs(5) });
    let w = s.register_worker(registration("a:1", 2), t).unwrap();
    let c = s.register_client(client("j", 0, 0), t).unwrap().client_id;
    assert_eq!(s.next_split(&w, &"j".into(), &[], 0, t).unwrap(), split(0, 0));
    assert_eq!(s.next_split(&w, &"j".into(), &[], 0, t).unwrap(), split(0, 1));
    // The worker has sent both; only the client's report makes them done.
    assert_eq!(s.jobs(&key())[0].in_flight, 2);
    s.acknowledge(&c, ack(&[(0, 0)], 0, &[], &[]), t).unwrap();
    assert_eq!(s.jobs(&key())[0].done, 1);
    // The client goes silent holding split 1's last batch: split 1 is produced again.
    s.expire(t + Duration::from_secs(6));
    assert_eq!(s.jobs(&key())[0].requeued, 1);
    // Without a client nothing goes out; with one, split 1 again.
    assert_eq!(s.next_split(&w, &"j".into(), &[], 0, t).unwrap(), Assignment::Draining { epoch: 0 });
    let c2 = s.register_client(client("j", 0, 0), t + Duration::from_secs(6)).unwrap().client_id;
    assert_eq!(s.next_split(&w, &"j".into(), &[], 0, t).unwrap(), split(0, 1));
    s.acknowledge(&c2, ack(&[(0, 1)], 0, &[], &[]), t + Duration::from_secs(6)).unwrap();
    assert_eq!(s.jobs(&key())[0].epoch, 1, "every split reported: the next epoch");
}

#[test]
fn silent_clients_detach() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(5) });
    let c = s.register_client(client("j", 0, 0), t).unwrap().client_id;
    assert_eq!(s.attached(), BTreeSet::from([key()]));
    let window = Window { batches: 0, median_s: 0.0, p90_s: 0.0, mean_s: 0.0, wait_fraction: 0.0, workers: 0 };
    s.report_window(&c, window, t + Duration::from_secs(4)).unwrap();
    s.expire(t + Duration::from_secs(8));
    assert_eq!(s.attached(), BTreeSet::from([key()]), "reported at 4 s, alive until 9 s");
    s.expire(t + Duration::from_secs(10));
    assert!(s.attached().is_empty());
}

/// Workers a (holding split 0 of a 3-split job) and b, one client; a dies at 6 s.
fn a_dies_holding_split_0(client_timeout: u64) -> (DispatcherState, WorkerId, ClientId, Instant) {
    let t = Instant::now();
    let timeouts = Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(client_timeout) };
    let mut s = DispatcherState::new("t", timeouts);
    let a = s.register_worker(registration("a:1", 3), t).unwrap();
    let b = s.register_worker(registration("b:1", 3), t).unwrap();
    let c = s.register_client(client("j", 0, 0), t).unwrap().client_id;
    assert_eq!(s.next_split(&a, &"j".into(), &[], 0, t).unwrap(), split(0, 0));
    let later = t + Duration::from_secs(6);
    s.heartbeat(&b, Progress::default(), later).unwrap();
    s.report_window(
        &c,
        Window { batches: 1, median_s: 0.1, p90_s: 0.1, mean_s: 0.1, wait_fraction: 0.0, workers: 1 },
        later,
    )
    .unwrap();
    assert_eq!(s.listing(&key()).version, 2, "two workers registered");
    s.expire(later);
    (s, b, c, later)
}

#[test]
fn a_dead_workers_split_waits_for_the_clients_rows_and_comes_back_without_them() {
    let (mut s, b, c, t) = a_dies_holding_split_0(30);
    let listing = s.listing(&key());
    assert_eq!(
        (listing.workers.iter().map(|(a, _)| a.as_str()).collect::<Vec<_>>(), listing.version),
        (vec!["b:1"], 3)
    );
    let job = &s.jobs(&key())[0];
    assert_eq!((job.in_flight, job.recovering, job.requeued), (0, 1, 1));
    // Until the client has dropped a (acknowledged version 3), split 0 does not go out.
    assert_eq!(s.next_split(&b, &"j".into(), &[], 0, t).unwrap(), split(0, 1));
    let held = Held { epoch: 0, split: 0, positions: vec![3, 1] };
    s.acknowledge(&c, ack(&[], 2, std::slice::from_ref(&held), &[]), t).unwrap();
    assert_eq!(s.jobs(&key())[0].recovering, 1, "an acknowledgement of the old list does not count");
    s.acknowledge(&c, ack(&[], 3, &[], &[]), t).unwrap();
    assert_eq!(
        s.next_split(&b, &"j".into(), &[], 0, t).unwrap(),
        Assignment::Split { epoch: 0, split: 0, skip: vec![1, 3], echo: 0 }
    );
    assert_eq!(s.jobs(&key())[0].skipped, 2);
    // Done: the rows it delivered are forgotten with it.
    let epoch = s.acknowledge(&c, ack(&[(0, 0), (0, 1)], 3, &[], &[]), t).unwrap();
    assert_eq!(epoch, 0);
    assert_eq!(s.next_split(&b, &"j".into(), &[], 0, t).unwrap(), split(0, 2));
    assert_eq!(s.acknowledge(&c, ack(&[(0, 2)], 3, &[], &[]), t).unwrap(), 1, "the epoch closed");
    assert_eq!(s.listing(&key()).epochs, BTreeMap::from([(JobName::from("j"), 1)]));
}

#[test]
fn a_recovery_waits_for_a_silent_client_no_longer_than_its_timeout() {
    let (mut s, b, _c, t) = a_dies_holding_split_0(10);
    assert_eq!(s.jobs(&key())[0].recovering, 1);
    let later = t + Duration::from_secs(11);
    s.heartbeat(&b, Progress::default(), later).unwrap();
    s.expire(later);
    let job = &s.jobs(&key())[0];
    assert_eq!(job.recovering, 0, "the silent client expired: nothing to wait for");
    s.register_client(client("j", 0, 0), later).unwrap();
    assert_eq!(s.next_split(&b, &"j".into(), &[], 0, later).unwrap(), split(0, 0));
}

#[test]
fn a_client_that_never_acknowledges_holds_a_recovery_up_for_the_client_timeout() {
    let (mut s, b, c, t) = a_dies_holding_split_0(10);
    let window = Window { batches: 1, median_s: 0.1, p90_s: 0.1, mean_s: 0.1, wait_fraction: 0.0, workers: 1 };
    let later = t + Duration::from_secs(11);
    // The client stays alive (it reports windows) but never acknowledges the new list.
    s.report_window(&c, window, later).unwrap();
    s.heartbeat(&b, Progress::default(), later).unwrap();
    s.expire(later);
    let job = &s.jobs(&key())[0];
    assert_eq!((job.recovering, job.unacknowledged), (0, 1));
    assert_eq!(s.next_split(&b, &"j".into(), &[], 0, later).unwrap(), split(0, 0));
}

#[test]
fn a_client_leaving_cleanly_is_forgotten_and_one_that_discarded_batches_has_the_splits_redone() {
    let (mut s, b, c, t) = a_dies_holding_split_0(30);
    // The recovery waits for c; c leaves having read everything: nothing to wait for.
    s.leave(&c, false, t);
    assert!(s.attached().is_empty());
    let c2 = s.register_client(client("j", 0, 0), t).unwrap().client_id;
    assert_eq!(s.next_split(&b, &"j".into(), &[], 0, t).unwrap(), split(0, 0));
    assert_eq!(s.jobs(&key())[0].in_flight, 1, "a clean leave redoes nothing");
    s.leave(&c2, true, t);
    let job = &s.jobs(&key())[0];
    assert_eq!((job.in_flight, job.requeued), (0, 2), "what it discarded may hold a split's last batch");
}

#[test]
fn a_job_read_by_ranks_agrees_on_their_number_finishes_splits_with_all_and_publishes_quotas() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    let w = s.register_worker(registration("a:1", 1), t).unwrap();
    let err = s.register_client(client("j", 2, 2), t).unwrap_err();
    assert!(err.to_string().contains("not a rank"), "{err}");
    let r0 = s.register_client(client("j", 0, 2), t).unwrap().client_id;
    let err = s.register_client(client("j", 1, 3), t).unwrap_err();
    assert!(err.to_string().contains("every client of a job must declare the same"), "{err}");
    let r1 = s.register_client(client("j", 1, 2), t).unwrap().client_id;
    assert_eq!(s.next_split(&w, &"j".into(), &[], 0, t).unwrap(), split(0, 0));

    let got = |batches, ended| Received { batches, ended, ..Received::default() };
    assert_eq!(s.acknowledge(&r0, ack(&[(0, 0)], 0, &[], &[(0, got(3, true))]), t).unwrap(), 0, "rank 1 has not");
    assert_eq!(s.listing(&key()).quotas[&JobName::from("j")], [], "rank 1 has not reported a count");
    s.acknowledge(&r1, ack(&[], 0, &[], &[(0, got(2, false))]), t).unwrap();
    assert_eq!(
        s.listing(&key()).quotas[&JobName::from("j")],
        [(0, Quota { batches: 2, complete: false, order: None })]
    );
    let epoch = s.acknowledge(&r1, ack(&[(0, 0)], 0, &[], &[(0, got(2, true))]), t).unwrap();
    assert_eq!(epoch, 1, "both ranks reported the split");
    assert_eq!(s.listing(&key()).quotas[&JobName::from("j")], [(0, Quota { batches: 2, complete: true, order: None })]);
    let dropped = Received { batches: 3, ended: true, dropped_rows: 7, ..Received::default() };
    s.acknowledge(&r0, ack(&[], 0, &[], &[(0, dropped)]), t).unwrap();
    assert_eq!(s.delivery_statuses()[&key()].rows_dropped_for_equal_ranks, 7);

    // Once the job's clients are gone, a new run of it may have another number of ranks.
    s.leave(&r0, false, t);
    s.leave(&r1, false, t);
    s.register_client(client("j", 2, 4), t).unwrap();
}

#[test]
fn a_coordinated_job_is_declared_by_every_rank_and_its_quotas_carry_the_order() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    let coordinated = |rank| ClientRegistration { coordinated: true, ..client("j", rank, 2) };
    let err = s.register_client(ClientRegistration { coordinated: true, ..client("j", 0, 0) }, t).unwrap_err();
    assert!(err.to_string().contains("set consumers (2 or more)"), "{err}");
    let r0 = s.register_client(coordinated(0), t).unwrap().client_id;
    let err = s.register_client(client("j", 1, 2), t).unwrap_err();
    let want = "read by 2 consumer(s), coordinated, but this client declares 2 consumer(s), not coordinated";
    assert!(err.to_string().contains(want), "{err}");
    let r1 = s.register_client(coordinated(1), t).unwrap().client_id;
    let got = |n| Received { batches: n, rounds: [(WorkerId::from("w"), n)].into(), ..Received::default() };
    s.acknowledge(&r0, ack(&[], 0, &[], &[(0, got(2))]), t).unwrap();
    s.acknowledge(&r1, ack(&[], 0, &[], &[(0, got(1))]), t).unwrap();
    let quotas = &s.listing(&key()).quotas[&JobName::from("j")];
    let order = quotas[0].1.order.as_ref().expect("coordinated: an order");
    assert_eq!((order.base, order.rounds.len(), order.rounds[0].worker.as_str()), (0, 1, "w"));
}

#[test]
fn a_job_resumed_by_its_ranks_runs_anew_once_every_ranks_state_is_in_without_what_they_yielded() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    let w = s.register_worker(registration("a:1", 2), t).unwrap();
    let state = |rank: u32, positions: Vec<u32>| Resume {
        job: "j".into(),
        epoch: 4,
        batches: 7,
        consumers: 2,
        consumer_index: rank,
        yielded: vec![Held { epoch: 4, split: 1, positions }],
        merged: false,
    };
    let resuming =
        |rank, positions| ClientRegistration { resume: Some(state(rank, positions)), ..client("j", rank, 2) };

    let wrong = ClientRegistration { resume: Some(state(1, vec![])), ..client("j", 0, 2) };
    assert!(s.register_client(wrong, t).unwrap_err().to_string().contains("rank 1's, not rank 0's"));
    let r0 = s.register_client(resuming(0, vec![3, 1]), t).unwrap();
    assert_ne!(r0.job, "j", "a run of its own: nothing made for the job before reaches it");
    assert_eq!(
        s.next_split(&w, &r0.job, &[], 4, t).unwrap(),
        Assignment::Draining { epoch: 4 },
        "rank 1's state is not in"
    );
    let r1 = s.register_client(resuming(1, vec![2]), t).unwrap();
    assert_eq!(r1.job, r0.job, "saved at the same step: the same run");
    assert_eq!(s.next_split(&w, &r0.job, &[], 4, t).unwrap(), split(4, 0));
    let second = s.next_split(&w, &r0.job, &[], 4, t).unwrap();
    assert_eq!(second, Assignment::Split { epoch: 4, split: 1, skip: vec![1, 2, 3], echo: 0 });
    assert_eq!(s.listing(&key()).epochs[&r0.job], 4);

    // Resumed again from the same step (the first run crashed): a fresh run.
    let again = s.register_client(ClientRegistration { resume: Some(state(0, vec![])), ..client("j", 0, 2) }, t);
    assert_ne!(again.unwrap().job, r0.job);
}

#[test]
fn a_merged_state_resumes_the_job_read_by_another_number_of_ranks_once_all_of_them_are_in() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    let w = s.register_worker(registration("a:1", 2), t).unwrap();
    // Two ranks' states merged: their rows together, for three new ranks.
    let merged = Resume {
        job: "j".into(),
        epoch: 4,
        batches: 7,
        consumers: 2,
        consumer_index: 0,
        yielded: vec![Held { epoch: 4, split: 1, positions: vec![1, 2, 3] }],
        merged: true,
    };
    let resuming = |rank| ClientRegistration { resume: Some(merged.clone()), ..client("j", rank, 3) };
    let r0 = s.register_client(resuming(0), t).unwrap();
    let r2 = s.register_client(resuming(2), t).unwrap();
    assert_eq!(r2.job, r0.job);
    assert_eq!(s.next_split(&w, &r0.job, &[], 4, t).unwrap(), Assignment::Draining { epoch: 4 }, "rank 1 is not in");
    assert_eq!(s.register_client(resuming(1), t).unwrap().job, r0.job);
    assert_eq!(s.next_split(&w, &r0.job, &[], 4, t).unwrap(), split(4, 0));
    let second = s.next_split(&w, &r0.job, &[], 4, t).unwrap();
    assert_eq!(second, Assignment::Split { epoch: 4, split: 1, skip: vec![1, 2, 3], echo: 0 }, "the rows once");

    // A rank's own state still resumes only the job read by as many ranks.
    let own = Resume { merged: false, ..merged.clone() };
    let refused = s.register_client(ClientRegistration { resume: Some(own), ..client("j", 0, 3) }, t).unwrap_err();
    assert!(refused.to_string().contains("merge every rank's state"), "{refused}");
}

#[test]
fn splits_a_stopped_producer_returns_go_back_to_the_queue() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    s.register_client(client("j", 0, 0), t).unwrap();
    let w = s.register_worker(registration("a:1", 3), t).unwrap();
    assert_eq!(s.next_split(&w, &"j".into(), &[], 0, t).unwrap(), split(0, 0));
    assert_eq!(s.next_split(&w, &"j".into(), &[], 0, t).unwrap(), split(0, 1));
    // The worker's producer stopped (nobody read the epoch) and returns what it held, and a
    // split it never had, which stays where it is.
    s.give_back(&w, &"j".into(), 0, &[0, 1, 2], t).unwrap();
    assert_eq!(s.jobs(&key())[0].in_flight, 0);
    let mut again: Vec<u64> = (0..3)
        .map(|_| match s.next_split(&w, &"j".into(), &[], 0, t).unwrap() {
            Assignment::Split { split, .. } => split,
            other => panic!("{other:?}"),
        })
        .collect();
    again.sort_unstable();
    assert_eq!(again, [0, 1, 2], "the returned splits come back with the rest");
}

#[test]
fn workers_reports_are_merged_per_pipeline_and_leave_with_them() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(30) });
    let a = s.register_worker(registration("a:1", 2), t).unwrap();
    let b = s.register_worker(registration("b:1", 2), t).unwrap();
    assert_eq!(s.reports()[&key()], WorkersReport::default(), "a pipeline with workers and no warning: empty");
    let capped = |mix: Vec<u64>| Progress {
        warnings: vec!["shuffle buffer capped".into()],
        source_elements: mix,
        ..Progress::default()
    };
    s.heartbeat(&a, capped(vec![500, 250]), t).unwrap();
    s.heartbeat(&b, capped(vec![200, 50]), t).unwrap();
    let report = &s.reports()[&key()];
    assert_eq!(report.warnings, vec!["shuffle buffer capped".to_string()], "the same warning once");
    assert_eq!(report.source_shares, vec![0.7, 0.3], "the mix's elements summed over the workers");
    // The workers go (their spec changed): so does the report.
    s.expire(t + Duration::from_secs(6));
    assert!(s.reports().get(&key()).is_none_or(|r| *r == WorkersReport::default()));
}

#[test]
fn completions_sent_again_after_a_lost_answer_are_no_repeats_but_a_second_production_is() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    let c = s.register_client(client("j", 0, 0), t).unwrap().client_id;
    let w = s.register_worker(registration("a:1", 3), t).unwrap();
    for split in 0..3 {
        assert_eq!(s.next_split(&w, &"j".into(), &[], 0, t).unwrap(), self::split(0, split));
    }
    let again =
        |splits: &[(u64, u64)]| Acknowledgement { completed_again: splits.to_vec(), ..Acknowledgement::default() };
    s.acknowledge(&c, ack(&[(0, 0)], 0, &[], &[]), t).unwrap();
    // Its answer was lost: the client sends it again with the next completion.
    s.acknowledge(&c, Acknowledgement { completed: vec![(0, 1)], ..again(&[(0, 0)]) }, t).unwrap();
    assert_eq!(s.jobs(&key())[0].repeats, 0, "applied once, not a repeat");
    // One that never arrived (the request was lost, not its answer) is applied now.
    assert_eq!(s.acknowledge(&c, again(&[(0, 2)]), t).unwrap(), 1, "the epoch closed");
    s.acknowledge(&c, again(&[(0, 2)]), t).unwrap();
    assert_eq!(s.jobs(&key())[0].repeats, 0, "a finished epoch's, sent again: applied before");
    // A split's completion arriving fresh a second time: it was produced twice.
    s.acknowledge(&c, ack(&[(0, 1)], 0, &[], &[]), t).unwrap();
    assert_eq!(s.jobs(&key())[0].repeats, 1);
}

#[test]
fn a_job_whose_clients_all_left_gets_nothing_until_one_is_back() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    let leaving = s.register_client(client("j", 0, 0), t).unwrap().client_id;
    let w = s.register_worker(registration("w:1", 4), t).unwrap();
    let job = JobName::from("j");
    let Assignment::Split { split, .. } = s.next_split(&w, &job, &[], 0, t).unwrap() else { panic!() };
    s.leave(&leaving, false, t);
    // What the worker reports still counts; nothing new goes out, for nobody to read.
    assert_eq!(s.next_split(&w, &job, &[(0, split)], 0, t).unwrap(), Assignment::Draining { epoch: 0 });
    s.register_client(client("j", 0, 0), t).unwrap();
    let (mut got, mut done) = (vec![split], Vec::new());
    while let Assignment::Split { split, .. } = s.next_split(&w, &job, &done, 0, t).unwrap() {
        got.push(split);
        done = vec![(0, split)];
    }
    got.sort_unstable();
    assert_eq!(got, [0, 1, 2, 3], "the rest of the epoch, once a client is back");
}
