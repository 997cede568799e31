//! The one simulation loop every policy runs in: a window of training at the current worker
//! count, the controller's decision, the new count; until a number of windows or of steps.

use std::ops::DerefMut;

use super::world::{Measurement, World};
use super::{SimConfig, Trainer};
use crate::autoscaling::policy::{Decision, Policy};

/// What the loop asks of whatever decides the worker count.
pub trait Controller {
    /// Seconds of training between decisions.
    fn period(&self) -> f64;
    fn decide(&mut self, measured: &Measurement, world: &World) -> Decision;
    /// Another job stopped (see [`Policy::reconsider`]); baselines take no notice.
    fn reconsider(&mut self, _why: &str) {}
}

/// One of the product's policies (borrowed or owned), fed the windows clients report every
/// `period` seconds.
pub struct Reported<P> {
    pub policy: P,
    pub period: f64,
}

impl<P: DerefMut<Target: Policy>> Controller for Reported<P> {
    fn period(&self) -> f64 {
        self.period
    }

    fn decide(&mut self, measured: &Measurement, _world: &World) -> Decision {
        self.policy.observe(&measured.window)
    }

    fn reconsider(&mut self, why: &str) {
        self.policy.reconsider(why);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Until {
    Windows(u32),
    /// Steps trained: the last window ends at exactly this many.
    Batches(u64),
}

impl Until {
    /// Whether `windows` windows are all there is to run.
    pub fn ran(&self, windows: u32) -> bool {
        matches!(*self, Until::Windows(w) if windows >= w)
    }
}

/// What a policy did in one run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Run {
    /// (window index, simulated seconds, workers after) per rescale.
    pub decisions: Vec<(u32, f64, u32)>,
    /// Simulated seconds, workers and median batch time per window.
    pub trace: Vec<(f64, u32, f64)>,
    pub final_workers: u32,
    pub most_workers: u32,
    /// Simulated seconds of training.
    pub seconds: f64,
    /// Steps trained.
    pub batches: u64,
    /// The cost: workers times the seconds they ran.
    pub worker_seconds: f64,
    /// Seconds the trainer waited for data: the accelerator time lost to input.
    pub waited: f64,
}

impl Run {
    /// Simulated seconds until the last rescale (0 with none).
    pub fn time_to_converge(&self) -> f64 {
        self.decisions.last().map_or(0.0, |d| d.1)
    }

    /// Accounts for the window `world` just trained.
    fn record(&mut self, measured: &Measurement, world: &World) {
        let workers = world.workers;
        self.trace.push((world.clock, workers, measured.window.median_s));
        self.seconds = world.clock;
        self.batches = world.batches();
        self.worker_seconds += f64::from(workers) * measured.seconds;
        self.waited += measured.waited;
    }

    /// Accounts for a decision taken after window `index`.
    pub fn rescaled(&mut self, index: u32, clock: f64, to: u32) {
        self.decisions.push((index, clock, to));
        self.most_workers = self.most_workers.max(to);
    }
}

/// Trains one window of `period` seconds on `world` (fewer at the end of `until`'s steps) and
/// accounts for it in `run`; what it measured, unless those were the last steps.
pub fn train_window(world: &mut World, run: &mut Run, period: f64, prefetch: f64, until: Until) -> Option<Measurement> {
    let most = match until {
        Until::Batches(b) => b.saturating_sub(world.batches()),
        Until::Windows(_) => u64::MAX,
    };
    let measured = world.measure(period, prefetch, most);
    run.record(&measured, world);
    // The last window is judged too when counting windows: its decision shows in the final count.
    (!matches!(until, Until::Batches(b) if world.batches() >= b)).then_some(measured)
}

/// Runs `controller` on `world` until `until`.
pub fn drive(world: &mut World, controller: &mut dyn Controller, prefetch: f64, until: Until) -> Run {
    let mut out = Run { most_workers: world.workers, ..Run::default() };
    for index in 0.. {
        if until.ran(index) {
            break;
        }
        let Some(measured) = train_window(world, &mut out, controller.period(), prefetch, until) else { break };
        if let Decision::Scale { to, .. } = controller.decide(&measured, world) {
            world.workers = to;
            out.rescaled(index, world.clock, to);
        }
    }
    out.final_workers = world.workers;
    out
}

/// Runs `policy` on `trainer` for `config.windows` windows.
pub fn run(policy: &mut dyn Policy, trainer: &Trainer, config: &SimConfig, start: u32) -> Run {
    let mut world = World::new(trainer.clone(), start);
    let mut reported = Reported { policy, period: config.window_seconds };
    drive(&mut world, &mut reported, config.prefetch, Until::Windows(config.windows))
}
