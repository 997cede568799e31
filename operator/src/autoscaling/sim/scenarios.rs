//! The trainers the policies are compared on, and the optimum worker count of each.

use super::world::World;
use super::{Contention, SimConfig, Trainer};

/// Every comparison run trains for as many steps as the trainer alone would take this long:
/// an hour at full speed. A search costs a policy a roughly fixed time, so shorter runs make
/// it weigh more.
pub const TRAINING_SECONDS: f64 = 3600.0;

/// Batches per second at `n` workers in steady state (no noise, no speed change).
pub fn throughput(trainer: &Trainer, n: u32, config: &SimConfig) -> f64 {
    let mut world = World::new(trainer.steady(), n);
    world.window(60.0, config.prefetch);
    let start = world.clock;
    let w = world.window(240.0, config.prefetch);
    w.batches as f64 / (world.clock - start)
}

/// The fewest workers at which training is within 3% of its fastest: where adding workers
/// stops helping. Equals the analytic optimum without stalls; with stalls the prefetch queue
/// refills during them, so fewer workers may do. Throughput never falls with more workers, so
/// a bisection finds it.
pub fn optimum(trainer: &Trainer, config: &SimConfig) -> u32 {
    let most = config.limits.max.max(trainer.analytic_optimum());
    let enough = 0.97 * throughput(trainer, most, config);
    let (mut low, mut high) = (0, most);
    while high > low + 1 {
        let mid = low + (high - low) / 2;
        if throughput(trainer, mid, config) >= enough {
            high = mid;
        } else {
            low = mid;
        }
    }
    high
}

/// One scenario of the comparison.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: String,
    pub trainer: Trainer,
}

impl Scenario {
    /// The steps every policy trains in this scenario ([`TRAINING_SECONDS`] at full speed).
    pub fn steps(&self) -> u64 {
        steps(&self.trainer)
    }
}

/// The steps a run of `trainer` trains: [`TRAINING_SECONDS`] at full speed.
pub fn steps(trainer: &Trainer) -> u64 {
    (TRAINING_SECONDS / trainer.mean_step()).round() as u64
}

/// The standard scenarios: optima 1..32, steady, noisy and with stalls.
pub fn scenarios() -> Vec<Scenario> {
    let mut all = Vec::new();
    for opt in [1, 2, 3, 4, 6, 8, 12, 16, 24, 32] {
        all.push(Scenario { name: format!("optimum {opt}"), trainer: Trainer::with_optimum(opt, 0.030) });
        all.push(Scenario {
            name: format!("optimum {opt}, 10% noise"),
            trainer: Trainer { noise: 0.1, seed: u64::from(opt), ..Trainer::with_optimum(opt, 0.030) },
        });
        all.push(Scenario {
            name: format!("optimum {opt}, 1 s stall every 4th batch"),
            trainer: Trainer { stall_every: Some(4), ..Trainer::with_optimum(opt, 0.030) },
        });
    }
    all
}

/// Workers slowed for a stretch while the search runs, then freed: a neighbour holding a
/// node's cores (adding workers does not help until it is gone), or every worker slowed (a slow
/// object store). Whatever the search concluded during the stretch must not outlive it.
pub fn contention_scenarios() -> Vec<Scenario> {
    let neighbour = |from_s, until_s, cores| Contention { from_s, until_s, factor: 1.0, cores };
    let slowed = |from_s, until_s, factor| Contention { from_s, until_s, factor, cores: f64::INFINITY };
    [
        (3, "a neighbour holds all but one worker's cores for the first 5 min", neighbour(0.0, 300.0, 1.0)),
        (8, "a neighbour holds all but four workers' cores from 1 to 6 min", neighbour(60.0, 360.0, 4.0)),
        (16, "a neighbour holds all but four workers' cores for the first 5 min", neighbour(0.0, 300.0, 4.0)),
        (16, "workers 2x slower for the first 10 min", slowed(0.0, 600.0, 0.5)),
        (8, "a neighbour holds all but four workers' cores all along", neighbour(0.0, f64::INFINITY, 4.0)),
    ]
    .into_iter()
    .map(|(opt, what, contention)| Scenario {
        name: format!("optimum {opt}, {what}"),
        trainer: Trainer { contention: Some(contention), ..Trainer::with_optimum(opt, 0.030) },
    })
    .collect()
}

/// The standard scenarios, trainers that get 2x faster or slower a third into the run, and
/// transient contention.
pub fn comparison_scenarios() -> Vec<Scenario> {
    let mut all = scenarios();
    all.extend(contention_scenarios());
    for (opt, factor) in [(8, 0.5), (8, 2.0), (16, 0.5), (16, 2.0)] {
        let trainer = Trainer::with_optimum(opt, 0.030);
        let at = steps(&trainer) / 3;
        let (how, now) = if factor < 1.0 { ("faster", opt * 2) } else { ("slower", opt / 2) };
        all.push(Scenario {
            name: format!("optimum {opt} -> {now}: trainer 2x {how} a third in"),
            trainer: Trainer { speed_change_at_batch: Some((at, factor)), ..trainer },
        });
    }
    all
}
