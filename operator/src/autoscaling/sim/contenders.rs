//! The policies compared, each fed what it would read in a cluster: ours and Cachew's rule the
//! clients' windows; HPA the workers' CPU utilisation; KEDA the prefetch queue; fixed pools
//! nothing.

use stoker_api::AutoscalingPolicy;

use super::drive::{Controller, Reported, Run, Until, drive};
use super::world::{Measurement, World};
use super::{SimConfig, Trainer};
use crate::autoscaling::policy::{self, Decision, Fixed, Hpa, Keda, Limits, hpa};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Contender {
    Ours,
    Cachew,
    /// HPA on CPU utilisation at its default 80% target.
    Hpa,
    /// KEDA on the batches missing from the prefetch queue, `per_worker` missing batches per
    /// worker as its target.
    Keda {
        per_worker: f64,
    },
    /// A fixed pool of `times` the optimum, as a user who profiled the job would size it.
    Fixed {
        times: u32,
    },
    /// `limits.max` workers from the start: the fastest training the bounds allow, what "best
    /// achievable" is measured against.
    Max,
}

impl Contender {
    /// The policies of the comparison, in the tables' order. KEDA twice: with a natural target
    /// (a worker per missing batch) and with one that lets an empty queue ask for `max`.
    pub fn all(config: &SimConfig) -> Vec<Contender> {
        vec![
            Contender::Ours,
            Contender::Cachew,
            Contender::Hpa,
            Contender::Keda { per_worker: 1.0 },
            Contender::Keda { per_worker: config.prefetch / f64::from(config.limits.max) },
            Contender::Fixed { times: 1 },
            Contender::Fixed { times: 2 },
        ]
    }

    pub fn name(&self) -> String {
        match self {
            Contender::Ours => "ours".into(),
            Contender::Cachew => "Cachew".into(),
            Contender::Hpa => "HPA, CPU 80%".into(),
            Contender::Keda { per_worker } => format!("KEDA, {per_worker} missing/worker"),
            Contender::Fixed { times: 1 } => "fixed at optimum".into(),
            Contender::Fixed { times } => format!("fixed at {times}x optimum"),
            Contender::Max => "max workers".into(),
        }
    }

    /// Workers at the start: autoscalers at the minimum, pools at their size.
    pub fn start(&self, limits: Limits, optimum: u32) -> u32 {
        match self {
            Contender::Fixed { times } => limits.clamp(optimum * times),
            Contender::Max => limits.clamp(limits.max),
            _ => limits.clamp(limits.min),
        }
    }

    /// What decides for one job within `limits`, starting at `start` workers.
    pub fn controller(&self, limits: Limits, start: u32, config: &SimConfig) -> Box<dyn Controller> {
        let defaults = AutoscalingPolicy::default();
        let reported = |policy| Box::new(Reported { policy, period: config.window_seconds });
        match *self {
            Contender::Ours => reported(policy::ours(limits, &defaults, start)),
            Contender::Cachew => reported(policy::cachew(limits, &defaults, start)),
            Contender::Fixed { .. } | Contender::Max => reported(Box::new(Fixed)),
            Contender::Hpa => Box::new(HpaOnCpu(Hpa::new(limits))),
            Contender::Keda { per_worker } => {
                Box::new(KedaOnQueue { keda: Keda::new(limits, per_worker), prefetch: config.prefetch })
            }
        }
    }

    /// One run of `steps` steps on `trainer`, whose optimum (sizing the fixed pools) is `optimum`.
    pub fn train(&self, trainer: &Trainer, config: &SimConfig, optimum: u32, steps: u64) -> Run {
        self.simulate(trainer, config, optimum, Until::Batches(steps))
    }

    /// One run on `trainer` until `until`.
    pub fn simulate(&self, trainer: &Trainer, config: &SimConfig, optimum: u32, until: Until) -> Run {
        let start = self.start(config.limits, optimum);
        let mut world = World::new(trainer.clone(), start);
        let mut controller = self.controller(config.limits, start, config);
        drive(&mut world, controller.as_mut(), config.prefetch, until)
    }
}

/// HPA reads the workers' CPU utilisation at each sync.
struct HpaOnCpu(Hpa);

impl Controller for HpaOnCpu {
    fn period(&self) -> f64 {
        hpa::SYNC_SECONDS
    }

    fn decide(&mut self, measured: &Measurement, world: &World) -> Decision {
        self.0.sync_cpu(world.clock, world.workers, measured.utilisation)
    }
}

/// KEDA's metric is the prefetch queue's capacity minus its ready batches, read at each of its
/// HPA's syncs.
struct KedaOnQueue {
    keda: Keda,
    prefetch: f64,
}

impl Controller for KedaOnQueue {
    fn period(&self) -> f64 {
        hpa::SYNC_SECONDS
    }

    fn decide(&mut self, measured: &Measurement, world: &World) -> Decision {
        self.keda.sync(world.clock, world.workers, self.prefetch - measured.ready)
    }
}
