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
//! Robustness: every judgement uses window medians (a window's median ignores the odd 1 s
//! stall among 30 ms batches), averaged over two windows, after skipping the warm-up windows
//! that follow each rescale. Once converged, only a change that lasts three windows re-opens
//! the search: batch time off by `reopenFactor` either way, or clients waiting for data again.

use stoker_api::AutoscalingPolicy;

use stoker_api::window::Window;

use super::{Decision, Limits, Policy, PolicyState, ms};

/// Windows averaged per judgement.
const SAMPLES: usize = 2;
/// Below this wait fraction, clients are not waiting for data: more workers cannot help.
const WAIT_LOW: f64 = 0.05;
/// Above it after convergence, clients clearly wait for data again.
const WAIT_HIGH: f64 = 0.25;
/// Converged windows in a row that must disagree before the search re-opens.
const SUSTAINED: u32 = 3;
/// A step counts as data-bound when it delivered this share of the proportional speedup.
const PROPORTIONAL: f64 = 0.8;

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
    /// `t_ref`, `w_ref`: batch time and wait fraction when it converged.
    Converged {
        t_ref: f64,
        w_ref: f64,
        strikes: u32,
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
}

impl Ours {
    pub fn new(limits: Limits, policy: &AutoscalingPolicy, start: u32) -> Self {
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
        }
    }

    fn go(&mut self, to: u32, phase: Phase, reason: String) -> Decision {
        let to = self.limits.clamp(to);
        self.phase = phase;
        self.samples.clear();
        if to == self.n {
            return Decision::Hold;
        }
        self.n = to;
        self.skip = self.warmup;
        Decision::Scale { to, reason }
    }

    fn converge(&mut self, t: f64, wait: f64) -> Decision {
        self.phase = Phase::Converged { t_ref: t, w_ref: wait, strikes: 0 };
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
                    self.go(from, Phase::Converged { t_ref: t_from, w_ref: w_from, strikes: 0 }, reason)
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
            return self.go(high, Phase::Converged { t_ref: t_high, w_ref: 0.0, strikes: 0 }, reason);
        }
        let mid = low + (high - low) / 2;
        let reason = format!("searching between {low} (too few) and {high} workers: trying {mid}");
        self.go(mid, Phase::Bisecting { low, high, t_high }, reason)
    }

    /// After convergence: re-open only on a change that lasts.
    fn watch(&mut self, w: &Window, t_ref: f64, w_ref: f64, strikes: u32) -> Decision {
        let (t, wait) = (w.mean_s, w.wait_fraction);
        let ratio = t / t_ref;
        // Waiting counts only well above what it was at convergence: a count that growing
        // could not improve may keep some wait (stalls), and must not be re-tried forever.
        let waiting = wait > WAIT_HIGH.max(w_ref + 0.2);
        let off = waiting || ratio > self.reopen || ratio < 1.0 / self.reopen;
        let strikes = if off { strikes + 1 } else { 0 };
        self.phase = Phase::Converged { t_ref, w_ref, strikes };
        if strikes < SUSTAINED {
            return Decision::Hold;
        }
        if waiting {
            if self.grow_target(t, wait) == self.n {
                self.phase = Phase::Converged { t_ref: t, w_ref: wait, strikes: 0 };
                return Decision::Hold;
            }
            return self.grow(t, wait, "re-opening");
        }
        if ratio > self.reopen {
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
        self.phase = Phase::Converged { t_ref: t, w_ref: wait, strikes: 0 };
        Decision::Hold
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
        }
        if self.skip > 0 {
            self.skip -= 1;
            return Decision::Hold;
        }
        if w.batches == 0 || !w.mean_s.is_finite() || w.mean_s <= 0.0 {
            return Decision::Hold;
        }
        if let Phase::Converged { t_ref, w_ref, strikes } = self.phase {
            return self.watch(w, t_ref, w_ref, strikes);
        }
        self.samples.push((w.mean_s, w.wait_fraction));
        if self.samples.len() < SAMPLES {
            return Decision::Hold;
        }
        let k = self.samples.len() as f64;
        let t = self.samples.iter().map(|s| s.0).sum::<f64>() / k;
        let wait = self.samples.iter().map(|s| s.1).sum::<f64>() / k;
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
