//! Batch-time and wait accounting with made-up instants: the math, not the wall clock.

use std::time::{Duration, Instant};

use stoker_client::stats::{BatchTimes, Meter};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn window_summarises_recorded_batches() {
    let mut t = BatchTimes::default();
    // Ten batches of 10..=100 ms, each with a 5 ms wait.
    for i in 1..=10 {
        t.record(ms(10 * i), ms(5));
    }
    let w = t.window();
    assert_eq!(w.batches, 10);
    assert_eq!(w.median, ms(50));
    assert_eq!(w.p90, ms(90));
    assert_eq!(w.total_batch_time, ms(550));
    assert_eq!(w.total_wait, ms(50));
    assert!((w.wait_fraction - 50.0 / 550.0).abs() < 1e-12);
}

#[test]
fn quantiles_ignore_recording_order_and_resist_spikes() {
    let mut t = BatchTimes::default();
    // Real logs: a 1 s stall every fourth batch among 30 ms ones.
    for i in 0..40 {
        t.record(if i % 4 == 3 { ms(1000) } else { ms(30) }, Duration::ZERO);
    }
    let w = t.window();
    assert_eq!(w.median, ms(30));
    assert_eq!(w.p90, ms(1000));
    assert_eq!(w.wait_fraction, 0.0);
}

#[test]
fn empty_and_reset_windows_are_zero() {
    let mut t = BatchTimes::default();
    assert_eq!(t.window().batches, 0);
    assert_eq!(t.window().median, Duration::ZERO);
    assert_eq!(t.window().wait_fraction, 0.0);
    t.record(ms(7), ms(7));
    assert_eq!(t.window().wait_fraction, 1.0);
    t.reset();
    assert_eq!(t.window(), Default::default());
}

#[test]
fn meter_pairs_each_wait_with_the_interval_it_starts() {
    let t0 = Instant::now();
    let at = |n: u64| t0 + ms(n);
    let mut m = Meter::default();
    // Call 1 at 0 waits 40 ms; the trainer computes 60 ms; call 2 at 100 waits 0; compute 30;
    // call 3 at 130 waits 10; compute 90; call 4 at 230.
    m.call_started(at(0));
    m.delivered(at(0), at(40));
    assert_eq!(m.window().batches, 0, "a batch's time is known only at the next call");
    m.call_started(at(100));
    m.delivered(at(100), at(100));
    m.call_started(at(130));
    m.delivered(at(130), at(140));
    m.call_started(at(230));
    let w = m.window();
    assert_eq!(w.batches, 3);
    assert_eq!(w.total_batch_time, ms(230));
    assert_eq!(w.total_wait, ms(50));
    assert_eq!(w.median, ms(100));
    assert_eq!(w.p90, ms(100));
    assert!((w.wait_fraction - 50.0 / 230.0).abs() < 1e-12);
}

#[test]
fn meter_reset_keeps_the_batch_in_progress() {
    let t0 = Instant::now();
    let mut m = Meter::default();
    m.call_started(t0);
    m.delivered(t0, t0 + ms(5));
    m.call_started(t0 + ms(20));
    m.delivered(t0 + ms(20), t0 + ms(20));
    m.reset();
    assert_eq!(m.window().batches, 0);
    // The batch delivered before the reset is closed by the next call and lands in the new window.
    m.call_started(t0 + ms(50));
    assert_eq!(m.window().batches, 1);
    assert_eq!(m.window().total_batch_time, ms(30));
}

#[test]
fn calls_without_a_batch_record_nothing() {
    let t0 = Instant::now();
    let mut m = Meter::default();
    m.call_started(t0);
    m.call_started(t0 + ms(10));
    assert_eq!(m.window().batches, 0);
}
