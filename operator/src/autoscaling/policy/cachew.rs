//! Cachew's rule (USENIX ATC 2022), the baseline: start at one worker; add one while batch time
//! improves by more than 7%; when it does not, step back one and stop; remove one while that
//! worsens batch time by less than 3%; after converging, re-open on a 1.5x change of batch
//! time. The window right after start and after each rescale is ignored. One worker per
//! decision, so it needs about as many decisions as the optimum has workers.

use stoker_api::AutoscalingPolicy;

use stoker_api::window::Window;

use super::{Decision, Limits, Policy, PolicyState, ms};

/// Cachew's down-step tolerance.
const DOWN_TOLERANCE: f64 = 0.03;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Measuring the first count.
    Start,
    /// Added a worker; `prev` is the batch time before.
    Up {
        prev: f64,
    },
    /// Removed a worker; `prev` is the batch time before.
    Down {
        prev: f64,
    },
    Converged {
        t_ref: f64,
    },
    Idle {
        resume: u32,
    },
}

pub struct Cachew {
    limits: Limits,
    improve: f64,
    reopen: f64,
    warmup: u32,
    n: u32,
    skip: u32,
    phase: Phase,
}

impl Cachew {
    pub fn new(limits: Limits, policy: &AutoscalingPolicy, start: u32) -> Self {
        Cachew {
            limits,
            improve: policy.improvement_threshold,
            reopen: policy.reopen_factor.max(1.01),
            warmup: policy.warmup_windows,
            n: limits.clamp(start),
            skip: policy.warmup_windows,
            phase: Phase::Start,
        }
    }

    fn go(&mut self, to: u32, phase: Phase, reason: String) -> Decision {
        let to = self.limits.clamp(to);
        self.phase = phase;
        if to == self.n {
            return Decision::Hold;
        }
        self.n = to;
        self.skip = self.warmup;
        Decision::Scale { to, reason }
    }

    fn up(&mut self, t: f64, why: &str) -> Decision {
        if self.limits.clamp(self.n + 1) == self.n {
            self.phase = Phase::Converged { t_ref: t };
            return Decision::Hold;
        }
        let to = self.n + 1;
        self.go(to, Phase::Up { prev: t }, format!("{why}: adding a worker ({})", ms(t)))
    }
}

impl Policy for Cachew {
    fn observe(&mut self, w: &Window) -> Decision {
        if let Phase::Idle { resume } = self.phase {
            self.n = self.limits.clamp(w.workers);
            return self.go(resume, Phase::Start, "clients are back".into());
        }
        if w.workers != self.n {
            self.n = w.workers;
            self.phase = Phase::Start;
            self.skip = self.warmup;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return Decision::Hold;
        }
        if w.batches == 0 || w.mean_s.is_nan() || w.mean_s <= 0.0 {
            return Decision::Hold;
        }
        let t = w.mean_s;
        match self.phase {
            Phase::Start => self.up(t, "start"),
            Phase::Up { prev } => {
                if t < prev * (1.0 - self.improve) {
                    self.up(t, "batch time improved by more than 7%")
                } else {
                    let to = self.n - 1;
                    self.go(
                        to,
                        Phase::Converged { t_ref: prev },
                        format!("no 7% improvement ({} -> {}): stepping back", ms(prev), ms(t)),
                    )
                }
            }
            Phase::Down { prev } => {
                if t <= prev * (1.0 + DOWN_TOLERANCE) && self.limits.clamp(self.n - 1) < self.n {
                    let to = self.n - 1;
                    self.go(to, Phase::Down { prev: t }, "removing a worker cost less than 3%: removing another".into())
                } else if t <= prev * (1.0 + DOWN_TOLERANCE) {
                    self.phase = Phase::Converged { t_ref: t };
                    Decision::Hold
                } else {
                    let to = self.n + 1;
                    self.go(
                        to,
                        Phase::Converged { t_ref: prev },
                        "removing a worker cost more than 3%: stepping back".into(),
                    )
                }
            }
            Phase::Converged { t_ref } => {
                let ratio = t / t_ref;
                if ratio > self.reopen {
                    self.up(t, "batch time rose 1.5x: re-opening")
                } else if ratio < 1.0 / self.reopen && self.limits.clamp(self.n.saturating_sub(1)) < self.n {
                    let to = self.n - 1;
                    self.go(to, Phase::Down { prev: t }, "batch time fell 1.5x: trying fewer workers".into())
                } else {
                    Decision::Hold
                }
            }
            Phase::Idle { .. } => Decision::Hold,
        }
    }

    fn idle(&mut self) -> Decision {
        if let Phase::Idle { .. } = self.phase {
            return Decision::Hold;
        }
        let resume = self.n;
        let min = self.limits.clamp(self.limits.min);
        self.go(min, Phase::Idle { resume }, "no client attached".into())
    }

    fn state(&self) -> PolicyState {
        match self.phase {
            Phase::Start => PolicyState::Measuring,
            Phase::Up { .. } | Phase::Down { .. } => PolicyState::Growing,
            Phase::Converged { .. } => PolicyState::Converged,
            Phase::Idle { .. } => PolicyState::Idle,
        }
    }
}
