//! A model of workers feeding a trainer, to run policies against without processes.
//!
//! `n` workers together make `n * rate` batches per second into the client's prefetch queue
//! (capacity `prefetch` batches, production pauses when it is full, as backpressure does).
//! The trainer takes a batch (waiting if the queue is empty), then computes for its compute
//! time (with optional noise, periodic stalls, and a speed change after some windows). Batch
//! time and wait are measured exactly as the client measures them. The model is a fluid one
//! (fractional queue), deterministic for a seed.

use std::fmt::Write as _;

use stoker_api::AutoscalingPolicy;

use stoker_api::window::Window;

use super::budget::{self, Model, Wish};
use super::policy::{Decision, Limits, Policy};

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
    pub seed: u64,
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
            seed: 1,
        }
    }

    /// ceil(1 / (rate * compute)): the workers that keep up without stalls.
    pub fn analytic_optimum(&self) -> u32 {
        (1.0 / (self.rate * self.compute) - 1e-9).ceil().max(1.0) as u32
    }
}

#[derive(Clone, Copy, Debug)]
pub struct SimConfig {
    /// Seconds of training per window (as `windowSeconds`).
    pub window_seconds: f64,
    pub prefetch: f64,
    pub windows: u32,
    pub limits: Limits,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig { window_seconds: 10.0, prefetch: 8.0, windows: 120, limits: Limits { min: 1, max: 64 } }
    }
}

/// The trainer's side of the model.
pub struct World {
    trainer: Trainer,
    pub workers: u32,
    queue: f64,
    pub clock: f64,
    batch: u64,
    window: u32,
    rng: u64,
}

impl World {
    pub fn new(trainer: Trainer, workers: u32) -> Self {
        let rng = trainer.seed;
        World { trainer, workers, queue: 0.0, clock: 0.0, batch: 0, window: 0, rng }
    }

    fn unit(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn compute(&mut self) -> f64 {
        let t = &self.trainer;
        if t.stall_every.is_some_and(|n| n > 0 && self.batch % n == n - 1) {
            return t.stall;
        }
        let mut c = t.compute;
        if let Some((after, factor)) = t.speed_change
            && self.window >= after
        {
            c *= factor;
        }
        if t.noise > 0.0 {
            let (noise, u) = (t.noise, self.unit());
            c *= 1.0 + noise * (2.0 * u - 1.0);
        }
        c
    }

    /// One window of `seconds` of training (at least one batch) at the current worker count.
    pub fn window(&mut self, seconds: f64, prefetch: f64) -> Window {
        let produce = self.trainer.rate * f64::from(self.workers.max(1));
        let mut times = Vec::new();
        let (mut total, mut waited) = (0.0, 0.0);
        while times.is_empty() || total < seconds {
            let wait = if self.queue >= 1.0 {
                self.queue -= 1.0;
                0.0
            } else {
                let w = (1.0 - self.queue) / produce;
                self.queue = 0.0;
                w
            };
            let c = self.compute();
            self.queue = (self.queue + produce * c).min(prefetch);
            times.push(wait + c);
            total += wait + c;
            waited += wait;
            self.batch += 1;
        }
        self.clock += total;
        self.window += 1;
        times.sort_by(f64::total_cmp);
        let rank = |q: f64| times[((q * times.len() as f64).ceil() as usize).clamp(1, times.len()) - 1];
        let batches = times.len() as u64;
        Window {
            workers: self.workers,
            batches,
            median_s: rank(0.5),
            p90_s: rank(0.9),
            mean_s: total / batches as f64,
            wait_fraction: waited / total,
        }
    }
}

/// What a policy did in one run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Run {
    /// (window index, simulated seconds, workers after) per rescale.
    pub decisions: Vec<(u32, f64, u32)>,
    /// Workers and median batch time per window.
    pub trace: Vec<(f64, u32, f64)>,
    pub final_workers: u32,
    pub most_workers: u32,
}

impl Run {
    /// Simulated seconds until the last rescale (0 with none).
    pub fn time_to_converge(&self) -> f64 {
        self.decisions.last().map_or(0.0, |d| d.1)
    }
}

/// Runs `policy` on `trainer` for `config.windows` windows.
pub fn run(policy: &mut dyn Policy, trainer: &Trainer, config: &SimConfig, start: u32) -> Run {
    let mut world = World::new(trainer.clone(), start);
    let mut out = Run { most_workers: start, ..Run::default() };
    for i in 0..config.windows {
        let w = world.window(config.window_seconds, config.prefetch);
        out.trace.push((world.clock, world.workers, w.median_s));
        if let Decision::Scale { to, .. } = policy.observe(&w) {
            world.workers = to;
            out.decisions.push((i, world.clock, to));
            out.most_workers = out.most_workers.max(to);
        }
    }
    out.final_workers = world.workers;
    out
}

/// Batches per second at `n` workers in steady state (no noise).
pub fn throughput(trainer: &Trainer, n: u32, config: &SimConfig) -> f64 {
    let steady = Trainer { noise: 0.0, speed_change: None, ..trainer.clone() };
    let mut world = World::new(steady, n);
    world.window(60.0, config.prefetch);
    let start = world.clock;
    let w = world.window(240.0, config.prefetch);
    w.batches as f64 / (world.clock - start)
}

/// The fewest workers at which training is within 3% of its fastest: where adding workers
/// stops helping. Equals the analytic optimum without stalls; with stalls the prefetch queue
/// refills during them, so fewer workers may do.
pub fn optimum(trainer: &Trainer, config: &SimConfig) -> u32 {
    let most = config.limits.max.max(trainer.analytic_optimum());
    let best = throughput(trainer, most, config);
    (1..=most).find(|&n| throughput(trainer, n, config) >= 0.97 * best).unwrap_or(most)
}

/// One scenario of the comparison table.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: String,
    pub trainer: Trainer,
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

/// Markdown table: each scenario with our policy and Cachew's side by side.
pub fn comparison(config: &SimConfig) -> String {
    let policy = AutoscalingPolicy::default();
    let mut out = String::from(
        "| scenario | optimum | ours: final | ours: decisions | ours: time to converge | Cachew: final | Cachew: decisions | Cachew: time to converge |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for s in scenarios() {
        let opt = optimum(&s.trainer, config);
        let ours = run(super::policy::ours(config.limits, &policy, 1).as_mut(), &s.trainer, config, 1);
        let cachew = run(super::policy::cachew(config.limits, &policy, 1).as_mut(), &s.trainer, config, 1);
        let _ = writeln!(
            out,
            "| {} | {opt} | {} | {} | {:.0} s | {} | {} | {:.0} s |",
            s.name,
            ours.final_workers,
            ours.decisions.len(),
            ours.time_to_converge(),
            cachew.final_workers,
            cachew.decisions.len(),
            cachew.time_to_converge()
        );
    }
    out
}

/// Tenants over a shared budget: each has a trainer and our policy; every round each observes
/// a window at its granted count, and the budget is shared by marginal gain.
pub fn multi_tenant(trainers: &[Trainer], mins: &[u32], budget: u32, rounds: u32, config: &SimConfig) -> Vec<Vec<u32>> {
    let policy = AutoscalingPolicy::default();
    let mut worlds: Vec<World> = trainers.iter().zip(mins).map(|(t, &m)| World::new(t.clone(), m.max(1))).collect();
    let mut policies: Vec<Box<dyn Policy + Send>> = mins
        .iter()
        .map(|&m| super::policy::ours(Limits { min: m.max(1), max: config.limits.max }, &policy, m.max(1)))
        .collect();
    let mut wants: Vec<u32> = mins.iter().map(|&m| m.max(1)).collect();
    let mut models = vec![Model::default(); trainers.len()];
    let mut history = Vec::new();
    for _ in 0..rounds {
        let windows: Vec<Window> =
            worlds.iter_mut().map(|w| w.window(config.window_seconds, config.prefetch)).collect();
        for (i, w) in windows.iter().enumerate() {
            models[i].update(w);
            if let Decision::Scale { to, .. } = policies[i].observe(w) {
                wants[i] = to;
            }
        }
        let wishes = (0..worlds.len())
            .map(|i| Wish {
                key: format!("t{i:02}"),
                namespace: format!("t{i:02}"),
                min: mins[i].max(1),
                wants: wants[i],
                current: worlds[i].workers,
                model: Some(models[i]),
            })
            .collect();
        let grants = budget::share(wishes, Some(budget));
        let counts: Vec<u32> = (0..worlds.len()).map(|i| grants[&format!("t{i:02}")].granted).collect();
        for (w, &n) in worlds.iter_mut().zip(&counts) {
            w.workers = n;
        }
        history.push(counts);
    }
    history
}

/// A self-contained SVG of one run of each policy: workers (steps) and batch time over time.
pub fn convergence_svg(trainer: &Trainer, config: &SimConfig) -> String {
    let policy = AutoscalingPolicy::default();
    let ours = run(super::policy::ours(config.limits, &policy, 1).as_mut(), trainer, config, 1);
    let cachew = run(super::policy::cachew(config.limits, &policy, 1).as_mut(), trainer, config, 1);
    let (w, h, pad) = (720.0, 360.0, 50.0);
    // Enough to show both settled.
    let t_max = (ours.time_to_converge().max(cachew.time_to_converge()) * 1.4).max(60.0);
    let n_max = f64::from(ours.most_workers.max(cachew.most_workers).max(trainer.analytic_optimum()) + 1);
    let x = |t: f64| pad + (w - 2.0 * pad) * t / t_max;
    let y = |n: f64| h - pad - (h - 2.0 * pad) * n / n_max;
    let path = |run: &Run| {
        let mut d = format!("M{:.1},{:.1}", x(0.0), y(1.0));
        let mut prev = 0.0;
        for &(t, n, _) in run.trace.iter().filter(|p| p.0 <= t_max) {
            let _ = write!(d, " L{:.1},{:.1} L{:.1},{:.1}", x(prev), y(f64::from(n)), x(t), y(f64::from(n)));
            prev = t;
        }
        d
    };
    let opt = f64::from(trainer.analytic_optimum());
    let mut svg = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='12'>\n\
         <rect width='100%' height='100%' fill='white'/>\n\
         <text x='{pad}' y='20' font-size='14'>Workers over time: optimum {opt}, trainer {:.0} ms/batch, worker {:.1} batches/s</text>\n\
         <line x1='{pad}' y1='{:.1}' x2='{:.1}' y2='{:.1}' stroke='#999' stroke-dasharray='4 4'/>\n\
         <text x='{:.1}' y='{:.1}' fill='#666'>optimum</text>\n\
         <path d='{}' fill='none' stroke='#d62728' stroke-width='2'/>\n\
         <path d='{}' fill='none' stroke='#1f77b4' stroke-width='2'/>\n\
         <text x='{:.1}' y='40' fill='#1f77b4'>ours: {} decisions, converged at {:.0} s</text>\n\
         <text x='{:.1}' y='56' fill='#d62728'>Cachew: {} decisions, converged at {:.0} s</text>\n\
         <line x1='{pad}' y1='{:.1}' x2='{:.1}' y2='{:.1}' stroke='black'/>\n\
         <line x1='{pad}' y1='{pad}' x2='{pad}' y2='{:.1}' stroke='black'/>\n\
         <text x='{:.1}' y='{:.1}'>{t_max:.0} s</text><text x='10' y='{:.1}'>{n_max:.0}</text>\n",
        trainer.compute * 1e3,
        trainer.rate,
        y(opt),
        w - pad,
        y(opt),
        w - pad - 50.0,
        y(opt) - 4.0,
        path(&cachew),
        path(&ours),
        w - 330.0,
        ours.decisions.len(),
        ours.time_to_converge(),
        w - 330.0,
        cachew.decisions.len(),
        cachew.time_to_converge(),
        h - pad,
        w - pad,
        h - pad,
        h - pad,
        w - pad - 20.0,
        h - pad + 16.0,
        pad + 4.0,
    );
    svg.push_str("</svg>\n");
    svg
}
