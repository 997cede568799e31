//! Automatic data echoing, pure: once per judged window of a pipeline whose `echo` has a
//! `maxFactor`, what held its workers and how long its clients waited in, the echo factor out.
//!
//! Echoing (Choi et al.) trades fresh data for speed: each element is repeated instead of the
//! trainer waiting for the next. Workers are the better cure, so the factor rises only while
//! the autoscaler cannot add them (held at `workers.max`, by the cluster-wide budget or by the
//! namespace's cap) and the clients still wait; it falls one step each window in which
//! workers can be added again, so the autoscaler, seeing the wait come back, grows instead.
//! Once the clients stop waiting at a limit, a step down is tried after a few calm windows; if
//! the wait comes back the factor returns and the next try waits twice as long.

use std::fmt;

use super::budget::Cap;

/// The clients waited longer than this share of their time: raise the factor.
pub const RAISE_ABOVE: f64 = 0.05;
/// The clients waited less than this share: calm.
pub const CALM_BELOW: f64 = 0.01;
/// Calm windows in a row before a step down is tried (doubling after each failed try).
pub const CALM_WINDOWS: u32 = 3;

/// What keeps the pipeline from more workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// It runs `workers.max`, and its policy wants no fewer.
    WorkersMax(u32),
    /// The cluster-wide budget or the namespace's cap granted fewer than the policy wants.
    Cap(Cap),
}

impl fmt::Display for Held {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Held::WorkersMax(max) => write!(f, "workers.max ({max})"),
            Held::Cap(cap) => f.write_str(cap.describe()),
        }
    }
}

/// One judged window of the pipeline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Seen {
    /// None: workers can be added.
    pub held: Option<Held>,
    /// Share of the clients' time spent waiting for data (the slowest job's).
    pub wait_fraction: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct EchoPolicy {
    max: u32,
    factor: u32,
    /// Calm windows in a row at the current factor.
    calm: u32,
    /// Calm windows needed before the next step down.
    patience: u32,
    /// A step down being tried: the factor it came from.
    trying_from: Option<u32>,
    reason: String,
}

impl EchoPolicy {
    /// A pipeline whose echo may go up to `max`, starting without repeats.
    pub fn new(max: u32) -> Self {
        EchoPolicy {
            max: max.max(1),
            factor: 1,
            calm: 0,
            patience: CALM_WINDOWS,
            trying_from: None,
            reason: "no window judged yet".into(),
        }
    }

    pub fn factor(&self) -> u32 {
        self.factor
    }

    /// Why the factor is what it is, for status.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The next window; returns whether the factor changed.
    pub fn observe(&mut self, seen: Seen) -> bool {
        let before = self.factor;
        let waited = format!("the clients waited {:.0}% of the time", seen.wait_fraction * 100.0);
        match seen.held {
            None => {
                self.trying_from = None;
                self.calm = 0;
                self.patience = CALM_WINDOWS;
                if self.factor > 1 {
                    self.factor -= 1;
                    self.reason = format!("workers can be added: echo {before} -> {}", self.factor);
                } else {
                    self.reason = "workers can be added: no echo".into();
                }
            }
            Some(held) if seen.wait_fraction > RAISE_ABOVE => {
                self.calm = 0;
                if let Some(from) = self.trying_from.take() {
                    // The step down brought the wait back: return, and try again later.
                    self.factor = from;
                    self.patience = self.patience.saturating_mul(2);
                    self.reason = format!(
                        "held by {held} and {waited} at echo {before}: back to {from}, a step down tried again after \
                         {} calm windows",
                        self.patience
                    );
                } else if self.factor < self.max {
                    self.factor += 1;
                    self.reason = format!("held by {held} and {waited}: echo {before} -> {}", self.factor);
                } else {
                    self.reason = format!("held by {held} and {waited}: echo at maxFactor {}", self.max);
                }
            }
            Some(held) if seen.wait_fraction < CALM_BELOW => {
                self.trying_from = None;
                self.calm += 1;
                if self.factor > 1 && self.calm >= self.patience {
                    self.calm = 0;
                    self.trying_from = Some(self.factor);
                    self.factor -= 1;
                    self.reason = format!("held by {held}, {waited}: trying echo {before} -> {}", self.factor);
                } else {
                    self.reason = format!("held by {held}, {waited}: echo {} kept", self.factor);
                }
            }
            Some(held) => {
                // Between the thresholds: the factor serves; a step down being tried held.
                self.trying_from = None;
                self.calm = 0;
                self.reason = format!("held by {held}, {waited}: echo {} kept", self.factor);
            }
        }
        self.factor != before
    }

    /// No client attached: no echo until they return.
    pub fn idle(&mut self) {
        *self = EchoPolicy { reason: "no client attached: no echo".into(), ..EchoPolicy::new(self.max) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AT_MAX: Option<Held> = Some(Held::WorkersMax(1));

    /// A trainer that needs `need` elements' worth of rows per second from workers that make
    /// `made` elements per second: with echo f the rows come at f * made, and the clients wait
    /// for the share of their time the rows fall short.
    fn wait(factor: u32, need: f64, made: f64) -> f64 {
        (1.0 - f64::from(factor) * made / need).max(0.0)
    }

    fn run(policy: &mut EchoPolicy, held: Option<Held>, need: f64, made: f64, windows: usize) -> Vec<u32> {
        (0..windows)
            .map(|_| {
                policy.observe(Seen { held, wait_fraction: wait(policy.factor(), need, made) });
                policy.factor()
            })
            .collect()
    }

    #[test]
    fn held_at_a_limit_while_waiting_it_rises_step_by_step_to_what_keeps_the_trainer_fed() {
        // One worker makes a third of what the trainer needs: echo 3 feeds it.
        let mut p = EchoPolicy::new(8);
        let factors = run(&mut p, AT_MAX, 3.0, 1.0, 12);
        assert_eq!(factors[..3], [2, 3, 3], "one step per window, up to the need");
        assert!(factors.iter().all(|&f| f <= 3), "never above what was needed: {factors:?}");
        assert!(p.reason().contains("workers.max (1)"), "{}", p.reason());
    }

    #[test]
    fn a_step_down_that_brings_the_wait_back_is_undone_and_tried_later_and_later() {
        let mut p = EchoPolicy::new(8);
        let factors = run(&mut p, AT_MAX, 3.0, 1.0, 60);
        // From echo 3 a step down to 2 (wait 33%) returns to 3 at once; the tries thin out.
        let tries: Vec<usize> = factors.windows(2).enumerate().filter(|(_, w)| w[1] < w[0]).map(|(i, _)| i).collect();
        assert!(tries.len() >= 2, "{factors:?}");
        let gaps: Vec<usize> = tries.windows(2).map(|t| t[1] - t[0]).collect();
        assert!(gaps.windows(2).all(|g| g[1] > g[0]), "each try waits longer: {gaps:?}");
        let at_two = factors.iter().skip(1).filter(|&&f| f == 2).count();
        assert_eq!(at_two, tries.len(), "each step down lasts one window: {factors:?}");
        assert!(p.reason().contains("echo 3 kept") || p.reason().contains("back to 3"), "{}", p.reason());
    }

    #[test]
    fn it_never_goes_past_max_factor() {
        let mut p = EchoPolicy::new(2);
        let factors = run(&mut p, Some(Held::Cap(Cap::Cluster)), 10.0, 1.0, 6);
        assert_eq!(factors, [2, 2, 2, 2, 2, 2]);
        assert!(p.reason().contains("maxFactor 2") && p.reason().contains("budget"), "{}", p.reason());
    }

    #[test]
    fn when_workers_can_be_added_it_falls_to_one_step_by_step() {
        let mut p = EchoPolicy::new(8);
        run(&mut p, AT_MAX, 4.0, 1.0, 4);
        assert_eq!(p.factor(), 4);
        // The budget was raised: the autoscaler adds workers, and the echo goes.
        assert_eq!(run(&mut p, None, 4.0, 1.0, 5), [3, 2, 1, 1, 1]);
        assert!(p.reason().contains("workers can be added"), "{}", p.reason());
    }

    #[test]
    fn a_trainer_that_slows_down_gets_less_echo_once_calm() {
        let mut p = EchoPolicy::new(8);
        run(&mut p, AT_MAX, 3.0, 1.0, 3);
        assert_eq!(p.factor(), 3);
        // The trainer now needs no more than the worker makes: the echo steps down to 1.
        let factors = run(&mut p, AT_MAX, 1.0, 1.0, 3 * CALM_WINDOWS as usize);
        assert_eq!(*factors.last().unwrap(), 1, "{factors:?}");
    }

    #[test]
    fn without_waiting_or_clients_there_is_no_echo() {
        let mut p = EchoPolicy::new(8);
        assert_eq!(run(&mut p, AT_MAX, 1.0, 2.0, 10), vec![1; 10], "fed: no echo");
        run(&mut p, AT_MAX, 4.0, 1.0, 3);
        p.idle();
        assert_eq!((p.factor(), p.reason()), (1, "no client attached: no echo"));
    }
}
