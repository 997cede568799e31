//! Our policy. While the clients wait for data, multiply the workers (default 2x), but no
//! further than the measurement predicts is enough (the trainer's compute is the part of the
//! batch time not spent waiting), so the last step lands on the count instead of past it; the
//! first step that no longer speeds training up nearly in proportion tells where the trainer's
//! compute bound is: with batch time `t_from` at `from` workers (data-bound, so data time per
//! batch is `from * t_from` worker-seconds) and `t` at `n` (compute-bound, so compute is `t`),
//! the count that just keeps up is ceil(from * t_from / t). Go there, check once, and bisect
//! only if the check fails. That is about log2(optimum) + 1 decisions where adding one worker
//! at a time needs about the optimum.
//!
//! Robustness: every judgement takes two windows' mean batch times and wait fractions (the
//! client's exact throughput), after skipping the warm-up windows that follow each rescale:
//! averaged when they agree, the quicker window's when the other stalled (a leader change, a
//! worker replaced), since a stall taken in would make the next step overshoot. Once converged, only a change that lasts three windows re-opens
//! the search: batch time off by `reopenFactor` either way, or clients waiting for data again.
//!
//! A convergence while the clients still wait for data is never final: a step that did not
//! help may have been measured while something else held the workers back (a neighbour on the
//! node, a slow object store, another job's workers on the same cores), and that passes. While
//! the clients keep waiting below `max`, growth is re-tried after a minute of waiting, then
//! after twice as long each time a re-try does not help (at most 4 minutes), and at once when
//! the driver says that room appeared ([`Policy::reconsider`]). A re-try that does not help
//! costs one warm-up and two windows at more workers, then a step back.

use stoker_api::AutoscalingPolicy;

use stoker_api::window::Window;

use super::{Decision, Limits, Policy, PolicyState, ms};

/// Windows averaged per judgement.
const SAMPLES: usize = 2;
/// A window whose mean batch time is over this many times another's of the same judgement
/// was stalled: window means of hundreds of batches differ by a few percent with noise.
const STALLED: f64 = 1.2;
/// Below this wait fraction, clients are not waiting for data: more workers cannot help.
const WAIT_LOW: f64 = 0.05;
/// Above it after convergence, clients clearly wait for data again.
const WAIT_HIGH: f64 = 0.25;
/// Converged windows in a row that must disagree before the search re-opens.
const SUSTAINED: u32 = 3;
/// A step counts as data-bound when it delivered this share of the proportional speedup.
const PROPORTIONAL: f64 = 0.8;
/// Seconds of clients waiting at a converged count before growth is re-tried; doubled after
/// each re-try that does not help, up to `RETRY_MOST_S`.
const RETRY_FIRST_S: f64 = 60.0;
const RETRY_MOST_S: f64 = 240.0;

/// The batch time and wait fraction a judgement uses, of windows measured at one count: their
/// mean when they agree (noise), the quicker one's when one took over `STALLED` times the
/// other's. A stall (a leader change, a worker replaced mid-split) only ever adds time and
/// waiting, and in the mean it would make the count look further from keeping up than it is:
/// the next step would overshoot, and a count that is too high is never noticed afterwards
/// (the clients stop waiting), where one judged too low is grown again by the next window in
/// which they still wait.
fn judged(samples: &[(f64, f64)]) -> (f64, f64) {
    let quickest = samples.iter().copied().min_by(|a, b| a.0.total_cmp(&b.0)).unwrap_or((0.0, 0.0));
    let slowest = samples.iter().map(|s| s.0).fold(0.0, f64::max);
    if slowest > quickest.0 * STALLED {
        return quickest;
    }
    let k = samples.len() as f64;
    (samples.iter().map(|s| s.0).sum::<f64>() / k, samples.iter().map(|s| s.1).sum::<f64>() / k)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    Measuring,
    Growing {
        from: u32,
        t_from: f64,
        w_from: f64,
    },
    /// At the aimed count: is it as fast as `high` workers were?
    Verifying {
        high: u32,
        t_high: f64,
    },
    Bisecting {
        low: u32,
        high: u32,
        t_high: f64,
    },
    /// `t_ref`, `w_ref`: batch time and wait fraction when it converged; `retry_in`: windows
    /// of clients waiting for data still to pass before growth is re-tried.
    Converged {
        t_ref: f64,
        w_ref: f64,
        strikes: u32,
        retry_in: u32,
    },
    Idle {
        resume: u32,
    },
}

pub struct Ours {
    limits: Limits,
    growth: f64,
    threshold: f64,
    reopen: f64,
    warmup: u32,
    /// Workers running as far as this policy knows.
    n: u32,
    /// Windows still to skip after a start or a rescale.
    skip: u32,
    samples: Vec<(f64, f64)>,
    phase: Phase,
    window_s: f64,
    /// Windows of waiting before the next re-try of a data-bound convergence: `retry_first`
    /// windows, doubled after each re-try up to `retry_most`, back to the first once growing
    /// helps.
    retry_every: u32,
    retry_first: u32,
    retry_most: u32,
    /// Why the driver asked to reconsider a convergence, until a window with the clients
    /// waiting takes it up or the count changes.
    nudged: Option<String>,
    /// The wait fraction of the last window judged.
    last_wait: f64,
}

impl Ours {
    pub fn new(limits: Limits, policy: &AutoscalingPolicy, start: u32) -> Self {
        let window_s = f64::from(policy.window_seconds.max(1));
        let windows = |seconds: f64| (seconds / window_s).ceil().max(1.0) as u32;
        Ours {
            limits,
            growth: policy.growth_factor.max(1.1),
            threshold: policy.improvement_threshold,
            reopen: policy.reopen_factor.max(1.01),
            warmup: policy.warmup_windows,
            n: limits.clamp(start),
            skip: policy.warmup_windows,
            samples: Vec::new(),
            phase: Phase::Measuring,
            window_s,
            retry_every: windows(RETRY_FIRST_S),
            retry_first: windows(RETRY_FIRST_S),
            retry_most: windows(RETRY_MOST_S),
            nudged: None,
            last_wait: 0.0,
        }
    }

    /// A convergence at batch time `t_ref` and wait fraction `w_ref`.
    fn converged(&self, t_ref: f64, w_ref: f64) -> Phase {
        Phase::Converged { t_ref, w_ref, strikes: 0, retry_in: self.retry_every }
    }

    fn minutes(&self, windows: u32) -> f64 {
        f64::from(windows) * self.window_s / 60.0
    }

    fn go(&mut self, to: u32, phase: Phase, reason: String) -> Decision {
        let to = self.limits.clamp(to);
        self.phase = phase;
        self.nudged = None;
        self.samples.clear();
        if to == self.n {
            return Decision::Hold;
        }
        self.n = to;
        self.skip = self.warmup;
        Decision::Scale { to, reason }
    }

    fn converge(&mut self, t: f64, wait: f64) -> Decision {
        self.phase = self.converged(t, wait);
        self.samples.clear();
        Decision::Hold
    }

    /// The next count while growing from a data-bound measurement (batch time `t`, wait
    /// fraction `wait`): `growth` times more, but no more than the measurement says is enough.
    /// The trainer computes for the part of `t` not spent waiting, and the workers make a batch
    /// every `t`, so `n * t / compute` workers keep up: the last step lands there instead of
    /// overshooting to the next multiple (which cost as many idle workers for three windows).
    fn grow_target(&self, t: f64, wait: f64) -> u32 {
        let n = self.n;
        let multiplied = ((f64::from(n) * self.growth).ceil() as u32).max(n + 1);
        let compute = t * (1.0 - wait);
        let enough = if compute > 0.0 {
            // As in the aim, a measurement a hair above a whole count does not round up.
            ((f64::from(n) * t / compute - 0.05).ceil().min(f64::from(u32::MAX)) as u32).max(n + 1)
        } else {
            multiplied
        };
        self.limits.clamp(multiplied.min(enough))
    }

    fn grow(&mut self, t: f64, wait: f64, why: &str) -> Decision {
        let next = self.grow_target(t, wait);
        if next == self.n {
            return self.converge(t, wait);
        }
        let reason = format!(
            "{why}: clients waited {:.0}% of a {} batch time at {} workers; growing to {next}",
            wait * 100.0,
            ms(t),
            self.n
        );
        self.go(next, Phase::Growing { from: self.n, t_from: t, w_from: wait }, reason)
    }

    /// One judgement of the current count from averaged windows.
    fn judge(&mut self, t: f64, wait: f64) -> Decision {
        let n = self.n;
        match self.phase {
            Phase::Measuring => {
                if wait < WAIT_LOW {
                    return self.converge(t, wait);
                }
                self.grow(t, wait, "data-bound")
            }
            Phase::Growing { from, t_from, w_from } => {
                let speedup = t_from / t;
                let proportional = f64::from(n) / f64::from(from);
                let helped = speedup > 1.0 + self.threshold;
                let in_proportion = speedup >= 1.0 + (proportional - 1.0) * PROPORTIONAL && wait >= WAIT_LOW;
                // Growing helps again: whatever held the workers back before is gone.
                if helped {
                    self.retry_every = self.retry_first;
                }
                // Clients still waiting a lot: data-bound, whatever the speedup says.
                if in_proportion || (helped && wait >= WAIT_HIGH) {
                    self.grow(t, wait, &format!("{from} -> {n} workers sped batches up {speedup:.2}x"))
                } else if helped {
                    // Data-bound at `from` (data = from * t_from worker-seconds per batch);
                    // the trainer computes for the part of `t` not spent waiting.
                    let compute = t * (1.0 - wait);
                    let aim = ((f64::from(from) * t_from / compute) - 0.05).ceil().max(0.0) as u32;
                    let aim = aim.clamp(from + 1, n);
                    if aim == n {
                        return self.converge(t, wait);
                    }
                    let reason = format!(
                        "{from} -> {n} workers sped batches up only {speedup:.2}x ({} -> {}): the trainer needs about {aim}",
                        ms(t_from),
                        ms(t)
                    );
                    self.go(aim, Phase::Verifying { high: n, t_high: t }, reason)
                } else {
                    let reason = format!(
                        "{from} -> {n} workers did not speed batches up ({} -> {}): back to {from}",
                        ms(t_from),
                        ms(t)
                    );
                    self.go(from, self.converged(t_from, w_from), reason)
                }
            }
            Phase::Verifying { high, t_high } => {
                if t <= t_high * (1.0 + self.threshold) {
                    return self.converge(t, wait);
                }
                self.bisect(n, high, t_high, t, wait)
            }
            Phase::Bisecting { low, high, t_high } => {
                if t <= t_high * (1.0 + self.threshold) {
                    self.bisect(low, n, t_high, t, wait)
                } else {
                    self.bisect(n, high, t_high, t, wait)
                }
            }
            Phase::Converged { .. } | Phase::Idle { .. } => Decision::Hold,
        }
    }

    /// `low` is known too few, `high` enough.
    fn bisect(&mut self, low: u32, high: u32, t_high: f64, t: f64, wait: f64) -> Decision {
        if high <= low + 1 {
            if self.n == high {
                return self.converge(t, wait);
            }
            let reason = format!("{low} workers are too few ({}), {high} keep up ({})", ms(t), ms(t_high));
            // The wait at `high` was not kept; assume none, as it kept up.
            return self.go(high, self.converged(t_high, 0.0), reason);
        }
        let mid = low + (high - low) / 2;
        let reason = format!("searching between {low} (too few) and {high} workers: trying {mid}");
        self.go(mid, Phase::Bisecting { low, high, t_high }, reason)
    }

    /// After convergence: re-open on a change that lasts, and re-try growth while the clients
    /// keep waiting for data.
    fn watch(&mut self, w: &Window, t_ref: f64, w_ref: f64, strikes: u32, retry_in: u32) -> Decision {
        let (t, wait) = (w.mean_s, w.wait_fraction);
        let ratio = t / t_ref;
        // Waiting counts as a change only well above what it was at convergence: a count that
        // growing could not improve may keep some wait; that is what the re-tries are for.
        let waiting = wait > WAIT_HIGH.max(w_ref + 0.2);
        let off = waiting || ratio > self.reopen || ratio < 1.0 / self.reopen;
        let strikes = if off { strikes + 1 } else { 0 };
        let data_bound = wait > WAIT_HIGH && self.n < self.limits.max;
        let retry_in = if data_bound { retry_in.saturating_sub(1) } else { retry_in };
        self.phase = Phase::Converged { t_ref, w_ref, strikes, retry_in };
        // A nudge waits for a window whose clients wait: only then is there something to re-try.
        let nudged = if data_bound { self.nudged.take() } else { None };
        if strikes >= SUSTAINED && waiting {
            if self.grow_target(t, wait) != self.n {
                return self.grow(t, wait, "re-opening");
            }
        } else if data_bound && (retry_in == 0 || nudged.is_some()) {
            return self.retry(t, wait, nudged);
        } else if strikes < SUSTAINED {
            return Decision::Hold;
        } else if ratio > self.reopen {
            // The trainer got slower and does not wait: fewer workers keep up.
            let aim = self.limits.clamp((f64::from(self.n) * t_ref / t).ceil() as u32);
            if aim < self.n {
                let reason = format!(
                    "batch time rose {ratio:.1}x ({} -> {}) with clients not waiting: {aim} workers should keep up",
                    ms(t_ref),
                    ms(t)
                );
                return self.go(aim, Phase::Verifying { high: self.n, t_high: t }, reason);
            }
        }
        self.phase = Phase::Converged { t_ref: t, w_ref: wait, strikes: 0, retry_in };
        Decision::Hold
    }

    /// Grows again from a convergence whose clients still wait for data: the step that did not
    /// help may have been measured while something else held the workers back.
    fn retry(&mut self, t: f64, wait: f64, nudged: Option<String>) -> Decision {
        let waited = self.minutes(self.retry_every);
        self.retry_every = (self.retry_every * 2).min(self.retry_most);
        let why = match nudged {
            Some(why) => format!("re-trying growth at once: {why}"),
            None => format!("re-trying growth after {waited:.0} min of clients waiting at a converged count"),
        };
        let next = self.minutes(self.retry_every);
        self.grow(t, wait, &format!("{why} (if it does not help, next re-try in {next:.0} min)"))
    }
}

impl Policy for Ours {
    fn observe(&mut self, w: &Window) -> Decision {
        if let Phase::Idle { resume } = self.phase {
            self.n = self.limits.clamp(w.workers);
            return self.go(resume, Phase::Measuring, format!("clients are back: returning to {resume} workers"));
        }
        if w.workers != self.n {
            // Someone else changed the count (the budget, another job, a restart): measure afresh.
            self.n = w.workers;
            self.phase = Phase::Measuring;
            self.skip = self.warmup;
            self.samples.clear();
            self.nudged = None;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return Decision::Hold;
        }
        if w.batches == 0 || !w.mean_s.is_finite() || w.mean_s <= 0.0 {
            return Decision::Hold;
        }
        self.last_wait = w.wait_fraction;
        if let Phase::Converged { t_ref, w_ref, strikes, retry_in } = self.phase {
            return self.watch(w, t_ref, w_ref, strikes, retry_in);
        }
        self.samples.push((w.mean_s, w.wait_fraction));
        if self.samples.len() < SAMPLES {
            return Decision::Hold;
        }
        let (t, wait) = judged(&self.samples);
        self.samples.clear();
        self.judge(t, wait)
    }

    fn idle(&mut self) -> Decision {
        if let Phase::Idle { .. } = self.phase {
            return Decision::Hold;
        }
        let resume = self.n;
        let min = self.limits.clamp(self.limits.min);
        self.go(
            min,
            Phase::Idle { resume },
            format!("no client attached: scaling to min {min} (will return to {resume})"),
        )
    }

    fn reconsider(&mut self, why: &str) {
        if matches!(self.phase, Phase::Converged { .. }) {
            self.nudged = Some(why.to_string());
        }
    }

    fn retry_plan(&self) -> Option<String> {
        let Phase::Converged { retry_in, .. } = self.phase else { return None };
        (self.last_wait > WAIT_HIGH && self.n < self.limits.max).then(|| {
            format!(
                "clients waited {:.0}% of the batch time at the converged count ({}): growth is re-tried in {:.1} min, \
                 or at once when another pipeline stops",
                self.last_wait * 100.0,
                self.n,
                self.minutes(retry_in)
            )
        })
    }

    fn state(&self) -> PolicyState {
        match self.phase {
            Phase::Measuring => PolicyState::Measuring,
            Phase::Growing { .. } => PolicyState::Growing,
            Phase::Verifying { .. } => PolicyState::Bisecting,
            Phase::Bisecting { .. } => PolicyState::Bisecting,
            Phase::Converged { .. } => PolicyState::Converged,
            Phase::Idle { .. } => PolicyState::Idle,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(workers: u32, mean_s: f64, wait_fraction: f64) -> Window {
        Window { workers, batches: 100, median_s: mean_s, p90_s: mean_s, mean_s, wait_fraction }
    }

    /// Feeds windows at `workers` until the policy rescales (at most `most`); the windows fed
    /// and its decision.
    fn until_rescale(p: &mut Ours, workers: u32, mean_s: f64, wait: f64, most: u32) -> (u32, Decision) {
        for fed in 1..=most {
            if let d @ Decision::Scale { .. } = p.observe(&window(workers, mean_s, wait)) {
                return (fed, d);
            }
        }
        (most, Decision::Hold)
    }

    fn reason(d: &Decision) -> &str {
        match d {
            Decision::Scale { reason, .. } => reason,
            Decision::Hold => "",
        }
    }

    #[test]
    fn a_convergence_with_clients_waiting_is_retried_with_backoff_and_at_once_when_room_appears() {
        // Ten-second windows: re-tries after 6 windows of waiting, then 12, then 24 at most.
        let mut p = Ours::new(Limits { min: 1, max: 16 }, &AutoscalingPolicy::default(), 1);
        // 1 worker, clients waiting 2/3 of the time: grow to 2.
        let (_, d) = until_rescale(&mut p, 1, 0.09, 0.67, 10);
        assert!(matches!(d, Decision::Scale { to: 2, .. }), "{d:?}");
        // 2 workers no faster (something else holds them back): back to 1, converged, waiting.
        let (_, d) = until_rescale(&mut p, 2, 0.09, 0.67, 10);
        assert!(matches!(d, Decision::Scale { to: 1, .. }) && p.state() == PolicyState::Converged, "{d:?}");
        let plan = p.retry_plan().unwrap_or_default();
        assert!(plan.starts_with("clients waited 67% of the batch time at the converged count (1)"), "{plan}");
        assert!(plan.contains("growth is re-tried in 1.0 min"), "{plan}");
        // The warm-up after the step back, then a minute of waiting: re-try.
        let (fed, d) = until_rescale(&mut p, 1, 0.09, 0.67, 100);
        assert_eq!(fed, 1 + 6, "{d:?}");
        assert!(matches!(d, Decision::Scale { to: 2, .. }), "{d:?}");
        assert!(
            reason(&d).starts_with("re-trying growth after 1 min of clients waiting at a converged count"),
            "{d:?}"
        );
        assert!(reason(&d).contains("next re-try in 2 min"), "{d:?}");
        // It does not help again: back, and the next re-try waits twice as long.
        let (_, d) = until_rescale(&mut p, 2, 0.09, 0.67, 10);
        assert!(matches!(d, Decision::Scale { to: 1, .. }), "{d:?}");
        let (fed, _) = until_rescale(&mut p, 1, 0.09, 0.67, 100);
        assert_eq!(fed, 1 + 12);
        let (_, _) = until_rescale(&mut p, 2, 0.09, 0.67, 10);
        // The warm-up, then one window of waiting counts; the plan says what will happen.
        p.observe(&window(1, 0.09, 0.67));
        p.observe(&window(1, 0.09, 0.67));
        assert!(p.retry_plan().is_some_and(|plan| plan.contains("re-tried in 3.8 min")), "{:?}", p.retry_plan());
        // Windows without waiting neither count nor re-try.
        for _ in 0..50 {
            assert_eq!(p.observe(&window(1, 0.03, 0.0)), Decision::Hold);
        }
        assert_eq!(p.retry_plan(), None, "clients not waiting: nothing to re-try");
        // Room appeared while they did not wait: taken up at the first window they wait.
        p.reconsider("another pipeline stopped");
        assert_eq!(p.observe(&window(1, 0.03, 0.0)), Decision::Hold);
        let d = p.observe(&window(1, 0.09, 0.67));
        assert!(matches!(d, Decision::Scale { to: 2, .. }), "{d:?}");
        assert!(reason(&d).starts_with("re-trying growth at once: another pipeline stopped"), "{d:?}");
        // This time it helps in proportion: the search goes on from there.
        let (_, d) = until_rescale(&mut p, 2, 0.045, 0.33, 10);
        assert!(matches!(d, Decision::Scale { to: 3, .. }), "{d:?}");
    }

    #[test]
    fn at_max_or_without_waiting_a_convergence_stays() {
        let mut p = Ours::new(Limits { min: 1, max: 2 }, &AutoscalingPolicy::default(), 1);
        let (_, d) = until_rescale(&mut p, 1, 0.09, 0.67, 10);
        assert!(matches!(d, Decision::Scale { to: 2, .. }), "{d:?}");
        // At max and still waiting: converged there, never re-tried, nothing to re-try.
        let (fed, d) = until_rescale(&mut p, 2, 0.06, 0.5, 200);
        assert_eq!((fed, d), (200, Decision::Hold));
        p.reconsider("another pipeline stopped");
        assert_eq!(p.observe(&window(2, 0.06, 0.5)), Decision::Hold);
        assert_eq!(p.retry_plan(), None);
    }
}
