//! How a run reads: a paragraph for one run, a markdown row for a sweep.

use std::fmt::Write as _;
use std::time::Duration;

use super::Outcome;
use super::tally::{Call, quantile};

/// The figures a run's text and row are made of.
struct Figures {
    splits_per_s: f64,
    next_split_per_s: f64,
    acks_per_s: f64,
    acked_splits_per_s: f64,
    reports_per_s: f64,
    heartbeats_per_s: f64,
    errors: u64,
    p50: Option<Duration>,
    p99: Option<Duration>,
    max: Option<Duration>,
    ack_p50: Option<Duration>,
    ack_p99: Option<Duration>,
    /// Of the dispatcher's core, and of the load's.
    cpu: f64,
    load_cpu: f64,
    /// Other processes, in cores.
    others: f64,
    /// Dispatcher CPU and allocations per call it answered.
    cpu_per_call: Duration,
    allocations_per_call: f64,
}

fn figures(o: &Outcome) -> Figures {
    let s = o.elapsed.as_secs_f64().max(1e-9);
    let c = &o.calls;
    let rate = |n: u64| n as f64 / s;
    let calls = [Call::Split, Call::Idle, Call::Heartbeat, Call::Report, Call::Acknowledge, Call::Error]
        .iter()
        .map(|&k| c.count(k))
        .sum::<u64>()
        .max(1);
    let (mut next, mut acks) = (c.next_split.clone(), c.acknowledge.clone());
    Figures {
        splits_per_s: rate(c.count(Call::Split)),
        next_split_per_s: rate(c.count(Call::Split) + c.count(Call::Idle)),
        acks_per_s: rate(c.count(Call::Acknowledge)),
        acked_splits_per_s: rate(c.acked_splits),
        reports_per_s: rate(c.count(Call::Report)),
        heartbeats_per_s: rate(c.count(Call::Heartbeat)),
        errors: c.count(Call::Error),
        p50: quantile(&mut next, 0.5),
        p99: quantile(&mut next, 0.99),
        max: quantile(&mut next, 1.0),
        ack_p50: quantile(&mut acks, 0.5),
        ack_p99: quantile(&mut acks, 0.99),
        cpu: o.dispatcher_cpu.as_secs_f64() / s,
        load_cpu: o.load_cpu.as_secs_f64() / s,
        others: o.others_cpu.as_secs_f64() / s,
        cpu_per_call: o.dispatcher_cpu / calls as u32,
        allocations_per_call: o.heap.allocations as f64 / calls as f64,
    }
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.2} ms", d.as_secs_f64() * 1e3))
}

fn mb(bytes: i64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

/// One run, in a few lines.
pub fn text(o: &Outcome) -> String {
    let f = figures(o);
    let l = &o.load;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "Dispatcher under {} workers and {} consumers in {} pipeline(s), {} splits an epoch, a split taking {} ms; {:.1} s measured ({}).",
        l.workers,
        l.consumers,
        l.pipelines,
        l.splits,
        l.split_time.as_millis(),
        o.elapsed.as_secs_f64(),
        if o.pinned { "dispatcher and load on a core each" } else { "not pinned: fewer than 2 CPUs" }
    );
    let _ =
        writeln!(t, "  setup: every worker registered and every client watching after {:.2} s", o.setup.as_secs_f64());
    let _ = writeln!(
        t,
        "  NextSplit: {:.0}/s ({:.0} splits/s handed out); latency p50 {}, p99 {}, max {}",
        f.next_split_per_s,
        f.splits_per_s,
        ms(f.p50),
        ms(f.p99),
        ms(f.max)
    );
    let _ = writeln!(
        t,
        "  Acknowledge: {:.0}/s carrying {:.0} completions/s; latency p50 {}, p99 {}",
        f.acks_per_s,
        f.acked_splits_per_s,
        ms(f.ack_p50),
        ms(f.ack_p99)
    );
    let _ = writeln!(
        t,
        "  ReportWindow {:.0}/s, WorkerHeartbeat {:.0}/s; calls retried after an error: {}",
        f.reports_per_s, f.heartbeats_per_s, f.errors
    );
    let _ = writeln!(
        t,
        "  dispatcher CPU: {:.0}% of its core ({:.1} µs a call); the load's thread: {:.0}% of its core; other processes: {:.0}% of a core",
        f.cpu * 100.0,
        f.cpu_per_call.as_secs_f64() * 1e6,
        f.load_cpu * 100.0,
        f.others * 100.0
    );
    let _ = writeln!(
        t,
        "  dispatcher heap: {} held at the end ({} of it gained while measuring); {:.0} allocations a call; process RSS {} -> {}",
        mb(o.held),
        mb(o.heap.held()),
        f.allocations_per_call,
        mb(o.rss.0 as i64),
        mb(o.rss.1 as i64)
    );
    let d = &o.delivery;
    let _ = writeln!(
        t,
        "  delivery: {} epoch(s) complete over all pipelines; splits handed out twice by one dispatcher {}, taken twice {}, skipped {}; repeats the dispatcher counted {}",
        d.complete_epochs, d.handed_twice, d.taken_twice, d.skipped, o.repeats
    );
    if let Some(c) = &o.leader_change {
        let _ = writeln!(
            t,
            "  leader change: the new dispatcher served {:.0} ms after the old one stopped; every worker back after {:.2} s, every client after {:.2} s; splits handed out in every pipeline after {:.2} s",
            c.serving.as_secs_f64() * 1e3,
            c.workers_back.as_secs_f64(),
            c.clients_back.as_secs_f64(),
            c.splits_again.as_secs_f64()
        );
    }
    t
}

pub const TABLE_HEADER: &str = "| workers | consumers | pipelines | splits/s | NextSplit p50 | NextSplit p99 | acks/s | reports/s | dispatcher CPU | µs/call | allocs/call | heap held | load CPU | others' CPU |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|";

/// One run as a row under `TABLE_HEADER`.
pub fn row(o: &Outcome) -> String {
    let f = figures(o);
    let l = &o.load;
    format!(
        "| {} | {} | {} | {:.0} | {} | {} | {:.0} | {:.0} | {:.0}% | {:.1} | {:.0} | {} | {:.0}% | {:.0}% |",
        l.workers,
        l.consumers,
        l.pipelines,
        f.splits_per_s,
        ms(f.p50),
        ms(f.p99),
        f.acks_per_s,
        f.reports_per_s,
        f.cpu * 100.0,
        f.cpu_per_call.as_secs_f64() * 1e6,
        f.allocations_per_call,
        mb(o.held),
        f.load_cpu * 100.0,
        f.others * 100.0
    )
}
