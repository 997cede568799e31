use super::*;
use stoker_api::ClientId;

/// `job`'s next split of `epoch` for `worker`, computing everything, at `t`.
fn hand_out(job: &mut Job, epoch: u64, worker: &str, plan: &Plan, t: Instant) -> Assignment {
    job.hand_out(epoch, plan, HandOut { worker: &worker.into(), directive: &Directive::Compute, echo: 0, now: t })
}

fn split(epoch: u64, split: u64) -> Assignment {
    Assignment::Split { epoch, split, skip: Vec::new(), echo: 0 }
}

const ONE: Reporter = Reporter::Client { rank: 0, consumers: 1 };

fn plan(splits: u64) -> Plan {
    Plan { splits, order: None }
}

#[test]
fn splits_go_out_in_order_and_an_epoch_ends_when_all_are_done() {
    let t = Instant::now();
    let mut job = Job::starting(0, &plan(3));
    let got: Vec<Assignment> = (0..3).map(|_| hand_out(&mut job, 0, "w", &plan(3), t)).collect();
    assert_eq!(got, vec![split(0, 0), split(0, 1), split(0, 2)]);
    assert_eq!(job.complete(&[(0, 0), (0, 2)], ONE, &plan(3), t), None);
    let s = job.summary(&"j".into(), 3);
    assert_eq!((s.epoch, s.done, s.in_flight, s.holders), (0, 2, 1, 1));
    let (action, _) = job.complete(&[(0, 1)], ONE, &plan(3), t).expect("the epoch is done");
    assert_eq!(action, CacheDecision::Compute);
    assert_eq!(job.summary(&"j".into(), 3).epoch, 1);
}

#[test]
fn an_epoch_runs_at_most_one_ahead() {
    let t = Instant::now();
    let mut job = Job::starting(4, &plan(1));
    assert_eq!(hand_out(&mut job, 5, "a", &plan(1), t), Assignment::Draining { epoch: 5 }, "epoch 4 first");
    assert_eq!(hand_out(&mut job, 4, "a", &plan(1), t), split(4, 0));
    assert_eq!(hand_out(&mut job, 4, "a", &plan(1), t), Assignment::Draining { epoch: 4 });
    assert_eq!(hand_out(&mut job, 5, "a", &plan(1), t), split(5, 0));
    assert_eq!(hand_out(&mut job, 6, "a", &plan(1), t), Assignment::Draining { epoch: 6 });
    assert_eq!(hand_out(&mut job, 3, "a", &plan(1), t), Assignment::Finished { epoch: 3 });
    job.complete(&[(4, 0)], ONE, &plan(1), t);
    assert_eq!(hand_out(&mut job, 4, "a", &plan(1), t), Assignment::Finished { epoch: 4 });
}

#[test]
fn requeued_splits_come_back_first_and_a_second_completion_is_a_repeat() {
    let t = Instant::now();
    let mut job = Job::starting(0, &plan(3));
    hand_out(&mut job, 0, "a", &plan(3), t);
    hand_out(&mut job, 0, "b", &plan(3), t);
    job.requeue(|w| w == "a");
    assert_eq!(job.summary(&"j".into(), 3).requeued, 1);
    assert_eq!(hand_out(&mut job, 0, "b", &plan(3), t), split(0, 0), "the lost split first");
    job.complete(&[(0, 0)], ONE, &plan(3), t);
    // a was only slow: its late report of the same split is a repeat.
    job.complete(&[(0, 0)], ONE, &plan(3), t);
    assert_eq!(job.summary(&"j".into(), 3).repeats, 1);
}

#[test]
fn a_split_completed_while_queued_again_leaves_the_queue() {
    let t = Instant::now();
    let mut job = Job::starting(0, &plan(2));
    assert_eq!(hand_out(&mut job, 0, "a", &plan(2), t), split(0, 0));
    job.requeue(|w| w == "a");
    // a was only slow: its split is done, and not handed out again.
    job.complete(&[(0, 0)], ONE, &plan(2), t);
    assert_eq!(hand_out(&mut job, 0, "b", &plan(2), t), split(0, 1));
    assert_eq!(hand_out(&mut job, 0, "b", &plan(2), t), Assignment::Draining { epoch: 0 });
}

#[test]
fn a_completion_from_a_finished_epoch_or_beyond_the_plan_is_a_repeat() {
    let t = Instant::now();
    let mut job = Job::starting(0, &plan(1));
    hand_out(&mut job, 0, "a", &plan(1), t);
    assert!(job.complete(&[(0, 0)], ONE, &plan(1), t).is_some());
    job.complete(&[(0, 0), (1, 7)], ONE, &plan(1), t);
    assert_eq!(job.summary(&"j".into(), 1).repeats, 2);
}

#[test]
fn an_epoch_is_named_by_what_most_of_its_splits_did_with_the_cache() {
    let t = Instant::now();
    let hint = crate::autocache::plan::Hint { at: 1, fingerprint: "f".into() };
    let mut job = Job::starting(0, &plan(3));
    job.hand_out(
        0,
        &plan(3),
        HandOut { worker: &"a".into(), directive: &Directive::Get(hint.clone()), echo: 0, now: t },
    );
    job.hand_out(0, &plan(3), HandOut { worker: &"a".into(), directive: &Directive::Get(hint), echo: 0, now: t });
    hand_out(&mut job, 0, "a", &plan(3), t);
    let (action, _) = job.complete(&[(0, 0), (0, 1), (0, 2)], ONE, &plan(3), t).unwrap();
    assert_eq!(action, CacheDecision::Get);
}

#[test]
fn with_a_seed_each_epoch_goes_out_in_its_own_order_and_every_split_once() {
    let t = Instant::now();
    let seeded = Plan { splits: 32, order: Some(7) };
    let epoch_order = |job: &mut Job, epoch: u64| -> Vec<u64> {
        let got: Vec<u64> = (0..32)
            .map(|_| {
                match job.hand_out(
                    epoch,
                    &seeded,
                    HandOut { worker: &"w".into(), directive: &Directive::Compute, echo: 0, now: t },
                ) {
                    Assignment::Split { epoch: e, split, .. } if e == epoch => split,
                    other => panic!("{other:?}"),
                }
            })
            .collect();
        let done: Vec<(u64, u64)> = got.iter().map(|&s| (epoch, s)).collect();
        assert!(job.complete(&done, ONE, &seeded, t).is_some(), "epoch {epoch} done");
        got
    };
    let mut job = Job::starting(0, &seeded);
    let (first, second) = (epoch_order(&mut job, 0), epoch_order(&mut job, 1));
    for order in [&first, &second] {
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..32).collect::<Vec<_>>(), "every split once");
        assert_ne!(*order, (0..32).collect::<Vec<_>>(), "not plan order");
    }
    assert_ne!(first, second, "a fresh order each epoch");
    // The same seed repeats the same orders: a restarted job sees them again.
    let mut again = Job::starting(0, &seeded);
    assert_eq!(epoch_order(&mut again, 0), first);
    // A job first seen at epoch 1 (a restarted dispatcher) hands out epoch 1's order.
    assert_eq!(epoch_order(&mut Job::starting(1, &seeded), 1), second);
}

#[test]
fn a_dead_workers_split_with_no_client_to_ask_goes_back_at_once_and_keeps_what_was_delivered() {
    let t = Instant::now();
    let mut job = Job::starting(0, &plan(2));
    assert_eq!(hand_out(&mut job, 0, "a", &plan(2), t), split(0, 0));
    job.recover(&"a".into(), 1, &BTreeSet::new(), t);
    assert_eq!(hand_out(&mut job, 0, "b", &plan(2), t), split(0, 0));
    // b dies too; the client that got rows from both acknowledges each time.
    let clients = BTreeSet::from([ClientId::from("c")]);
    job.acknowledge(&"c".into(), 1, &[Held { epoch: 0, split: 0, positions: vec![0, 1] }], t);
    job.recover(&"b".into(), 2, &clients, t);
    job.acknowledge(&"c".into(), 2, &[Held { epoch: 0, split: 0, positions: vec![5] }], t);
    let again = hand_out(&mut job, 0, "d", &plan(2), t);
    assert_eq!(again, Assignment::Split { epoch: 0, split: 0, skip: vec![0, 1, 5], echo: 0 }, "both attempts' rows");
}

#[test]
fn a_job_read_by_ranks_finishes_a_split_once_every_rank_reported_it() {
    let t = Instant::now();
    let mut job = Job::starting(0, &plan(1));
    hand_out(&mut job, 0, "a", &plan(1), t);
    let rank = |rank| Reporter::Client { rank, consumers: 3 };
    assert_eq!(job.complete(&[(0, 0)], rank(1), &plan(1), t), None);
    assert_eq!(job.complete(&[(0, 0)], rank(1), &plan(1), t), None, "the same rank twice is not two");
    assert_eq!(job.complete(&[(0, 0)], rank(0), &plan(1), t), None);
    assert!(job.complete(&[(0, 0)], rank(2), &plan(1), t).is_some(), "all three: the epoch is done");
    let s = job.summary(&"j".into(), 1);
    assert_eq!((s.epoch, s.repeats), (1, 0));
}

#[test]
fn a_resumed_job_hands_its_epoch_out_without_the_rows_yielded_before() {
    let t = Instant::now();
    let yielded = [
        Held { epoch: 3, split: 1, positions: vec![4, 0] },
        Held { epoch: 3, split: 1, positions: vec![2] },
        Held { epoch: 2, split: 0, positions: vec![9] },
    ];
    let gathered = Gathered { epoch: 3, rows: yielded.to_vec(), ..Gathered::default() };
    let mut job = Job::rebuilt(&gathered, &plan(2), 2);
    assert_eq!(job.epoch(), 3);
    assert_eq!(hand_out(&mut job, 3, "w", &plan(2), t), split(3, 0), "another epoch's rows");
    let resumed = hand_out(&mut job, 3, "w", &plan(2), t);
    assert_eq!(resumed, Assignment::Split { epoch: 3, split: 1, skip: vec![0, 2, 4], echo: 0 }, "both ranks' rows");
}

#[test]
fn a_rebuilt_job_is_done_with_what_every_rank_completed_and_goes_on_into_the_next_epoch() {
    let t = Instant::now();
    let both = BTreeSet::from([0, 1]);
    let gathered = Gathered {
        epoch: 5,
        rows: vec![
            Held { epoch: 5, split: 2, positions: vec![1] },
            Held { epoch: 6, split: 0, positions: vec![7] },
            Held { epoch: 5, split: 0, positions: vec![3] },
        ],
        completed: [((5, 0), both.clone()), ((5, 1), both), ((5, 2), BTreeSet::from([1]))].into(),
        incomplete: true,
    };
    let mut job = Job::rebuilt(&gathered, &plan(3), 2);
    assert_eq!(job.epoch(), 5);
    let again = hand_out(&mut job, 5, "w", &plan(3), t);
    assert_eq!(again, Assignment::Split { epoch: 5, split: 2, skip: vec![1], echo: 0 }, "rank 0 may lack rows of it");
    assert!(job.complete(&[(5, 2)], Reporter::Client { rank: 0, consumers: 2 }, &plan(3), t).is_some());
    assert_eq!(job.epoch(), 6, "rank 1 had reported it: epoch 5 is done");
    let next = hand_out(&mut job, 6, "w", &plan(3), t);
    assert_eq!(next, Assignment::Split { epoch: 6, split: 0, skip: vec![7], echo: 0 }, "the next epoch's rows too");
    let s = job.summary(&"j".into(), 3);
    assert_eq!((s.repeats, s.unacknowledged), (0, 1), "went on without a client");

    let all = Gathered { epoch: 1, completed: [((1, 0), BTreeSet::from([0]))].into(), ..Gathered::default() };
    assert_eq!(Job::rebuilt(&all, &plan(1), 0).epoch(), 2, "an epoch every split of which is done is over");
}

#[test]
fn a_completion_sent_again_is_applied_for_the_rank_that_had_not_reported_it() {
    let t = Instant::now();
    let mut job = Job::starting(0, &plan(2));
    let rank = |rank| Reporter::Client { rank, consumers: 2 };
    assert_eq!(hand_out(&mut job, 0, "w", &plan(2), t), split(0, 0));
    job.complete(&[(0, 0)], rank(0), &plan(2), t);
    assert_eq!(job.unapplied(&[(0, 0)], rank(0)), [], "rank 0 reported it");
    assert_eq!(job.unapplied(&[(0, 0), (0, 1)], rank(1)), [(0, 0), (0, 1)], "rank 1 reported neither");
    job.complete(&[(0, 0)], rank(1), &plan(2), t);
    assert_eq!(job.unapplied(&[(0, 0)], rank(1)), [], "done");
    job.complete(&[(0, 1)], rank(0), &plan(2), t);
    job.complete(&[(0, 1)], rank(1), &plan(2), t);
    assert_eq!(job.epoch(), 1);
    assert_eq!(job.unapplied(&[(0, 1)], rank(1)), [], "a finished epoch's were applied");
    assert_eq!(job.summary(&"j".into(), 2).repeats, 0);
}

#[test]
fn a_split_handed_out_again_keeps_its_first_echo_factor() {
    let t = Instant::now();
    let mut job = Job::starting(0, &plan(3));
    let with = |split, echo| Assignment::Split { epoch: 0, split, skip: Vec::new(), echo };
    assert_eq!(
        job.hand_out(0, &plan(3), HandOut { worker: &"a".into(), directive: &Directive::Compute, echo: 2, now: t }),
        with(0, 2)
    );
    job.requeue(|w| w == "a");
    // The factor rose meanwhile: the split produced again names the same copies as before.
    assert_eq!(
        job.hand_out(0, &plan(3), HandOut { worker: &"b".into(), directive: &Directive::Compute, echo: 3, now: t }),
        with(0, 2)
    );
    assert_eq!(
        job.hand_out(0, &plan(3), HandOut { worker: &"b".into(), directive: &Directive::Compute, echo: 3, now: t }),
        with(1, 3),
        "a new split the new factor"
    );
}
