//! `stoker bench dispatcher`'s load generator, small: its simulated workers and clients drive
//! a real dispatcher over loopback gRPC through whole epochs and a leader change, every split
//! of an epoch reaching the job once, and it records what it measures. Bounded by epochs
//! completed (with a time limit), not by speed: speed goals live in the benchmark.

use std::time::Duration;

use stoker_local::bench::dispatcher::tally::Call;
use stoker_local::bench::dispatcher::{self, Load};

#[test]
fn the_load_generator_delivers_every_split_once_through_a_leader_change_and_records_latencies() {
    let load = Load {
        workers: 20,
        consumers: 20,
        pipelines: 2,
        duration: Duration::from_secs(2),
        split_time: Duration::from_millis(1),
        splits: 64,
        epochs: 2,
        leader_change: true,
    };
    let o = dispatcher::run(&load).expect("the load ran");

    let d = &o.delivery;
    assert!(d.complete_epochs >= 2 * 2 + 2, "two epochs per pipeline, one more after the leader change: {d:?}");
    assert_eq!((d.handed_twice, d.taken_twice, d.skipped, o.repeats), (0, 0, 0, 0), "exactly once: {d:?}");

    assert!(!o.calls.next_split.is_empty(), "NextSplit latencies recorded");
    assert!(!o.calls.acknowledge.is_empty(), "Acknowledge latencies recorded");
    assert!(o.calls.count(Call::Split) > 0 && o.calls.acked_splits > 0, "splits handed out and acknowledged");
    assert!(o.calls.count(Call::Heartbeat) > 0, "workers heartbeat (every second, over two seconds)");
    assert!(o.calls.count(Call::Report) > 0, "clients report windows (every second, over two seconds)");
    assert!(o.dispatcher_cpu > Duration::ZERO, "the dispatcher's CPU time is read");

    let change = o.leader_change.as_ref().expect("a leader change was measured");
    assert!(change.workers_back >= change.serving && change.clients_back >= change.serving, "{change:?}");
    assert!(change.splits_again >= change.serving, "{change:?}");

    let text = dispatcher::report::text(&o);
    assert!(text.contains("NextSplit") && text.contains("leader change"), "{text}");
}
