//! Share groups through the dispatcher's state: one production taken by the jobs of a group,
//! each getting every split once; a client naming another group refused; a production nobody
//! takes given back after the patience; a dead worker's productions forgotten.

use std::time::Duration;

use super::tests::{client as job_client, key, registration};
use super::*;

fn worker(address: &str, splits: u64) -> WorkerRegistration {
    WorkerRegistration { shuffle_seed: Some(3), ..registration(address, splits) }
}

fn client(job: &str, share: Option<&str>) -> ClientRegistration {
    ClientRegistration { share: share.map(Into::into), ..job_client(job, 0, 0) }
}

type Got = (Assignment, Option<SharedProduction>);

fn ask(s: &mut DispatcherState, w: &WorkerId, job: &str, done: &[(u64, u64)], epoch: u64, t: Instant) -> Got {
    s.next_production(w, &JobName::from(job), done, epoch, t).unwrap()
}

#[test]
fn jobs_of_a_group_take_one_production_and_each_gets_every_split_once() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    for job in ["a", "b"] {
        s.register_client(client(job, Some("sweep")), t).unwrap();
    }
    s.register_client(client("alone", None), t).unwrap();
    let w = s.register_worker(worker("w:1", 6), t).unwrap();
    let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
    let (mut done_a, mut done_b) = (Vec::new(), Vec::new());
    let mut productions = std::collections::BTreeSet::new();
    for _ in 0..6 {
        let (a, pa) = ask(&mut s, &w, "a", &done_a, 0, t);
        let (b, pb) = ask(&mut s, &w, "b", &done_b, 0, t);
        let (Assignment::Split { split: sa, .. }, Assignment::Split { split: sb, .. }) = (&a, &b) else {
            panic!("{a:?} {b:?}")
        };
        let (pa, pb) = (pa.unwrap(), pb.unwrap());
        assert_eq!((sa, pa.id), (sb, pb.id), "b takes the production a makes");
        assert_eq!((pa.takers, pb.takers), (2, 2));
        productions.insert(pa.id);
        (done_a, done_b) = (vec![(0, *sa)], vec![(0, *sb)]);
        got_a.push(*sa);
        got_b.push(*sb);
    }
    got_a.sort();
    assert_eq!(got_a, (0..6).collect::<Vec<_>>(), "every split once");
    assert_eq!(productions.len(), 6);
    let delivery = &s.delivery_statuses()[&key()];
    assert_eq!((delivery.shared_productions, delivery.shared_deliveries, delivery.shared_missed), (6, 12, 0));
    // Status lists each job with its group and what it took from the group's productions.
    let jobs = &s.job_statuses()[&key()];
    let listed: Vec<_> = jobs
        .iter()
        .map(|j| (j.name.as_str(), j.share.as_ref().map(ShareName::as_str), j.consumers, j.shared_taken))
        .collect();
    assert_eq!(listed, [("a", Some("sweep"), 1, 6), ("alone", None, 1, 0), ("b", Some("sweep"), 1, 6)]);
    // The job alone is produced for alone, and has its own epoch.
    let (alone, production) = ask(&mut s, &w, "alone", &[], 0, t);
    assert!(matches!(alone, Assignment::Split { epoch: 0, .. }) && production.is_none());
    // Both finish epoch 0 with their last completions.
    let (next_a, _) = ask(&mut s, &w, "a", &done_a, 0, t);
    assert_eq!(next_a, Assignment::Finished { epoch: 0 });
}

#[test]
fn a_client_must_name_its_jobs_group() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    s.register_client(client("a", Some("sweep")), t).unwrap();
    let err = s.register_client(client("a", Some("other")), t).unwrap_err();
    assert!(matches!(&err, DispatchError::Invalid(m) if m.contains("share group")), "{err:?}");
    let err = s.register_client(client("a", None), t).unwrap_err();
    assert!(matches!(err, DispatchError::Invalid(_)));
}

#[test]
fn a_production_no_member_takes_goes_back_to_its_queue_and_counts_as_missed() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    for job in ["a", "b"] {
        s.register_client(client(job, Some("sweep")), t).unwrap();
    }
    let w = s.register_worker(worker("w:1", 4), t).unwrap();
    let (first, _) = ask(&mut s, &w, "a", &[], 0, t);
    let Assignment::Split { split, .. } = first else { panic!("{first:?}") };
    // b's producer never comes for it; a goes on past the patience.
    let later = t + crate::dispatcher::share::PATIENCE + Duration::from_secs(1);
    let (next, production) = ask(&mut s, &w, "a", &[(0, split)], 0, later);
    assert!(matches!(next, Assignment::Split { .. }), "{next:?}");
    let Assignment::Split { split: second, .. } = next else { unreachable!() };
    assert_eq!(production.unwrap().takers, 2, "b takes part in the next one");
    let counts = s.share_counts(&key());
    assert_eq!(counts[0].1.missed.get(&JobName::from("b")), Some(&1));
    let missed: Vec<_> = s.job_statuses()[&key()].iter().map(|j| (j.name.to_string(), j.shared_missed)).collect();
    assert_eq!(missed, [("a".to_string(), 0), ("b".to_string(), 1)]);
    // b gets both: the missed split is back in its queue.
    let mut b = Vec::new();
    let mut done = Vec::new();
    while let (Assignment::Split { split, .. }, _) = ask(&mut s, &w, "b", &done, 0, later) {
        b.push(split);
        done = vec![(0, split)];
    }
    assert!(b.contains(&split) && b.contains(&second), "{b:?}");
}

#[test]
fn a_dead_workers_productions_are_forgotten_and_each_job_recovers_its_own() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    for job in ["a", "b"] {
        s.register_client(client(job, Some("sweep")), t).unwrap();
    }
    let dying = s.register_worker(worker("w:1", 3), t).unwrap();
    let (first, _) = ask(&mut s, &dying, "a", &[], 0, t);
    let Assignment::Split { split, .. } = first else { panic!() };
    let later = t + Duration::from_secs(60);
    let other = s.register_worker(worker("w:2", 3), later).unwrap();
    s.expire(later);
    // Both jobs' clients are gone too by now (60 s): register them again.
    for job in ["a", "b"] {
        s.register_client(client(job, Some("sweep")), later).unwrap();
    }
    let mut a = Vec::new();
    let mut done = Vec::new();
    while let (Assignment::Split { split, .. }, _) = ask(&mut s, &other, "a", &done, 0, later) {
        a.push(split);
        done = vec![(0, split)];
    }
    assert!(a.contains(&split), "the dead worker's split is produced again: {a:?}");
}

#[test]
fn a_job_whose_clients_left_and_came_back_gets_what_waited_for_it() {
    let t = Instant::now();
    let mut s = DispatcherState::new("t", Timeouts::default());
    s.register_client(client("a", Some("sweep")), t).unwrap();
    let b = s.register_client(client("b", Some("sweep")), t).unwrap().client_id;
    let w = s.register_worker(worker("w:1", 4), t).unwrap();
    let (first, _) = ask(&mut s, &w, "a", &[], 0, t);
    let Assignment::Split { split, .. } = first else { panic!("{first:?}") };
    // b's only client leaves cleanly before its producer took the production, and comes back.
    s.leave(&b, false, t);
    let listed: Vec<_> = s.job_statuses()[&key()].iter().map(|j| j.name.to_string()).collect();
    assert_eq!(listed, ["a"], "a job without clients is not listed");
    // a goes on meanwhile.
    ask(&mut s, &w, "a", &[(0, split)], 0, t);
    let later = t + crate::dispatcher::share::PATIENCE + Duration::from_secs(1);
    s.register_client(client("b", Some("sweep")), later).unwrap();
    let mut got = Vec::new();
    let mut done = Vec::new();
    while let (Assignment::Split { split, .. }, _) = ask(&mut s, &w, "b", &done, 0, later) {
        got.push(split);
        done = vec![(0, split)];
    }
    got.sort();
    assert_eq!(got, vec![0, 1, 2, 3], "the production that waited for it went back to its queue ({split})");
}
