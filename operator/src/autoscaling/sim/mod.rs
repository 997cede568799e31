//! A model of workers feeding a trainer, to run policies against without processes.
//!
//! `n` workers together make `n * rate` batches per second into the client's prefetch queue
//! (capacity `prefetch` batches, production pauses when it is full, as backpressure does).
//! The trainer takes a batch (waiting if the queue is empty), then computes for its compute
//! time (with optional noise, periodic stalls, and a speed change mid-run). Batch time and
//! wait are measured exactly as the client measures them. The model is a fluid one
//! (fractional queue), deterministic for a seed.
//!
//! Read in this order:
//!
//! 1. [`world`]: the model, and what one window of it measures;
//! 2. [`drive`]: the one loop every policy runs in;
//! 3. [`contenders`]: the policies compared (ours, Cachew's rule, HPA, KEDA, fixed pools) and
//!    what each reads from the model;
//! 4. [`scenarios`]: the trainers, and the optimum worker count of each;
//! 5. [`compare`]: training time, cost and waiting per policy and scenario, the goals, the
//!    tables;
//! 6. [`tenants`]: several jobs over one worker budget;
//! 7. [`group`]: the jobs of a share group, each seeing all the group's workers;
//! 8. [`plot`]: the figures.

pub mod compare;
pub mod contenders;
pub mod drive;
pub mod group;
pub mod plot;
pub mod scenarios;
pub mod tenants;
#[cfg(test)]
mod tests;
pub mod world;

pub use drive::{Run, run};
pub use plot::convergence_svg;
pub use scenarios::{Scenario, contention_scenarios, optimum, scenarios, throughput};
pub use tenants::multi_tenant;
pub use world::{Measurement, World};

use super::policy::Limits;

#[derive(Clone, Debug, PartialEq)]
pub struct Trainer {
    /// Batches per second one worker makes.
    pub rate: f64,
    /// Seconds of compute per batch.
    pub compute: f64,
    /// Multiplicative uniform noise on compute (0.1 = ±10%).
    pub noise: f64,
    /// Every `n`-th batch computes for `stall` seconds instead.
    pub stall_every: Option<u64>,
    pub stall: f64,
    /// From this window on, compute is multiplied by the factor.
    pub speed_change: Option<(u32, f64)>,
    /// From this batch on, compute is multiplied by the factor. The comparison uses this one:
    /// policies judge windows of different lengths, but every run trains the same batches.
    pub speed_change_at_batch: Option<(u64, f64)>,
    /// A stretch of the run during which something else slows the job's workers.
    pub contention: Option<Contention>,
    /// Once, at this simulated second, the trainer waits this many seconds more for its next
    /// batch: a leader change (workers out of splits until the new dispatcher serves them) or
    /// a worker replaced mid-split.
    pub outage: Option<(f64, f64)>,
    pub seed: u64,
}

/// A stretch of simulated time during which the job's workers are slowed, as a noisy
/// neighbour, a busy node or a slow object store would: each worker makes `factor` of its
/// rate, and all of them together at most `cores` workers' worth (a neighbour holding the
/// node's other cores, so that adding workers does not help until it is gone).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Contention {
    pub from_s: f64,
    pub until_s: f64,
    pub factor: f64,
    pub cores: f64,
}

impl Contention {
    /// Worker-equivalents that `n` workers make at simulated time `clock`.
    pub fn capacity(&self, n: f64, clock: f64) -> f64 {
        if (self.from_s..self.until_s).contains(&clock) { (n * self.factor).min(self.cores) } else { n }
    }
}

impl Trainer {
    /// A trainer whose optimum is exactly `opt` workers (of rate 1/(opt * compute)).
    pub fn with_optimum(opt: u32, compute: f64) -> Self {
        Trainer {
            rate: 1.0 / (f64::from(opt) * compute),
            compute,
            noise: 0.0,
            stall_every: None,
            stall: 1.0,
            speed_change: None,
            speed_change_at_batch: None,
            contention: None,
            outage: None,
            seed: 1,
        }
    }

    /// ceil(1 / (rate * compute)): the workers that keep up without stalls.
    pub fn analytic_optimum(&self) -> u32 {
        (1.0 / (self.rate * self.compute) - 1e-9).ceil().max(1.0) as u32
    }

    /// Mean seconds per batch of the trainer alone (stalls included, before any speed change):
    /// the fastest training can go.
    pub fn mean_step(&self) -> f64 {
        match self.stall_every {
            Some(n) if n > 0 => (self.compute * (n - 1) as f64 + self.stall) / n as f64,
            _ => self.compute,
        }
    }

    /// The same trainer without noise, speed changes, contention or outage: its steady state.
    pub fn steady(&self) -> Trainer {
        Trainer {
            noise: 0.0,
            speed_change: None,
            speed_change_at_batch: None,
            contention: None,
            outage: None,
            ..self.clone()
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct SimConfig {
    /// Seconds of training per window (as `windowSeconds`).
    pub window_seconds: f64,
    pub prefetch: f64,
    pub windows: u32,
    pub limits: Limits,
    /// Cores of the one node all the jobs' workers run on, in workers' worth; `None`: a core
    /// per worker. With more workers than cores, every worker gets the same share.
    pub node_cores: Option<f64>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            window_seconds: 10.0,
            prefetch: 8.0,
            windows: 120,
            limits: Limits { min: 1, max: 64 },
            node_cores: None,
        }
    }
}
