//! Several jobs over one cluster's workers. With Stoker, a cluster-wide budget shared every
//! round by marginal gain ([`budget::share`]), and a finished job's workers go to the others.
//! Without it, what a platform team does: a ResourceQuota per namespace, i.e. a fixed share of
//! the cluster per tenant that each tenant's autoscaler (HPA, KEDA, Cachew's rule) or fixed
//! pool stays within, and that nobody else may use when the tenant does not.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use super::contenders::Contender;
use super::drive::{Run, Until, train_window};
use super::world::World;
use super::{SimConfig, Trainer};
use crate::autoscaling::budget::{self, Model, Wish};
use crate::autoscaling::policy::{Decision, Limits};

/// How the tenants share the workers.
#[derive(Clone, Debug, PartialEq)]
pub enum Sharing {
    /// Stoker's cluster-wide budget, shared by marginal gain every round.
    Budget(u32),
    /// A fixed quota per tenant: the most its autoscaler may run.
    Quotas(Vec<u32>),
}

impl Sharing {
    /// The budget split evenly (the first tenants get the remainder), each at least its min.
    pub fn even_quotas(budget: u32, mins: &[u32]) -> Sharing {
        let k = mins.len().max(1) as u32;
        Sharing::Quotas(
            mins.iter().enumerate().map(|(i, &m)| (budget / k + u32::from((i as u32) < budget % k)).max(m)).collect(),
        )
    }
}

/// The tenants' runs, and the worker counts of every round.
pub struct Shared {
    pub runs: Vec<Run>,
    pub history: Vec<Vec<u32>>,
}

/// Each tenant's job under `contender` (its trainer, its min), the workers shared as `sharing`
/// says, until each tenant's `until` (a tenant that has its steps stops and frees its
/// workers). Every round each unfinished tenant trains one period of its controller.
pub fn share_rounds(
    trainers: &[Trainer],
    mins: &[u32],
    contender: Contender,
    sharing: &Sharing,
    until: &[Until],
    config: &SimConfig,
) -> Shared {
    let limits = tenant_limits(sharing, mins, config);
    // Fixed pools are sized to their quota: the optimum is not for a tenant to have.
    let starts: Vec<u32> = limits.iter().map(|&l| contender.start(l, l.max)).collect();
    let mut worlds: Vec<World> = trainers.iter().zip(&starts).map(|(t, &n)| World::new(t.clone(), n)).collect();
    let mut controllers: Vec<_> =
        limits.iter().zip(&starts).map(|(&l, &n)| contender.controller(l, n, config)).collect();
    let mut runs: Vec<Run> = starts.iter().map(|&n| Run { most_workers: n, ..Run::default() }).collect();
    let mut wants = starts.clone();
    let mut models = vec![Model::default(); trainers.len()];
    let mut done = vec![false; trainers.len()];
    let mut history: Vec<Vec<u32>> = Vec::new();
    let mut was_serving: BTreeSet<usize> = (0..trainers.len()).collect();
    for round in 0.. {
        if done.iter().all(|&d| d) || until.iter().all(|u| u.ran(round)) {
            break;
        }
        let running: u32 = (0..worlds.len()).filter(|&i| !done[i]).map(|i| worlds[i].workers).sum();
        let share = config.node_cores.map_or(1.0, |cores| (cores / f64::from(running.max(1))).min(1.0));
        for i in 0..worlds.len() {
            worlds[i].share = share;
            if done[i] {
                continue;
            }
            let period = controllers[i].period();
            let Some(measured) = train_window(&mut worlds[i], &mut runs[i], period, config.prefetch, until[i]) else {
                done[i] = true;
                continue;
            };
            models[i].update(&measured.window);
            if let Decision::Scale { to, .. } = controllers[i].decide(&measured, &worlds[i]) {
                wants[i] = to;
            }
        }
        let counts: Vec<u32> = match sharing {
            Sharing::Budget(b) => grants(&worlds, &models, &limits, &wants, &done, *b),
            Sharing::Quotas(_) => (0..worlds.len()).map(|i| if done[i] { 0 } else { wants[i] }).collect(),
        };
        for i in (0..worlds.len()).filter(|&i| !done[i]) {
            if counts[i] != worlds[i].workers {
                worlds[i].workers = counts[i];
                runs[i].rescaled(round, worlds[i].clock, counts[i]);
            }
        }
        // As the operator's driver does: when a tenant is done, the others hear of it.
        let serving: BTreeSet<usize> = (0..worlds.len()).filter(|&i| !done[i]).collect();
        if budget::departed(&was_serving, &serving) {
            for &i in &serving {
                controllers[i].reconsider("another job stopped and gave its workers back");
            }
        }
        was_serving = serving;
        history.push(counts);
    }
    for (run, world) in runs.iter_mut().zip(&worlds) {
        run.final_workers = world.workers;
    }
    Shared { runs, history }
}

/// The budget shared by marginal gain among the unfinished tenants.
fn grants(
    worlds: &[World],
    models: &[Model],
    limits: &[Limits],
    wants: &[u32],
    done: &[bool],
    budget: u32,
) -> Vec<u32> {
    let key = |i: usize| format!("t{i:02}");
    let wishes = (0..worlds.len())
        .filter(|&i| !done[i])
        .map(|i| Wish {
            key: key(i),
            namespace: key(i),
            min: limits[i].min,
            wants: wants[i],
            current: worlds[i].workers,
            model: Some(models[i]),
        })
        .collect();
    let grants = budget::share(wishes, Some(budget));
    (0..worlds.len()).map(|i| grants.get(&key(i)).map_or(0, |g| g.granted)).collect()
}

/// Tenants over a shared budget: each has a trainer and our policy; every round each observes
/// a window at its granted count, and the budget is shared by marginal gain.
pub fn multi_tenant(trainers: &[Trainer], mins: &[u32], budget: u32, rounds: u32, config: &SimConfig) -> Vec<Vec<u32>> {
    let until = vec![Until::Windows(rounds); trainers.len()];
    share_rounds(trainers, mins, Contender::Ours, &Sharing::Budget(budget), &until, config).history
}

/// The tenants of the comparison: five jobs whose optima (33 workers together) are twice the
/// budget of 16, with mins.
pub const TENANT_OPTIMA: [u32; 5] = [4, 8, 3, 12, 6];
pub const TENANT_MINS: [u32; 5] = [1, 1, 2, 1, 3];
pub const TENANT_BUDGET: u32 = 16;

/// What one way of sharing did for all the tenants.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantsOutcome {
    pub name: String,
    /// Mean and longest training time of the tenants' jobs.
    pub mean_seconds: f64,
    pub last_seconds: f64,
    pub worker_seconds: f64,
    pub waited: f64,
    pub decisions: usize,
}

impl TenantsOutcome {
    /// The outcome of the tenants' `runs` shared as `name` says.
    pub fn of(name: String, runs: &[Run]) -> TenantsOutcome {
        let times: Vec<f64> = runs.iter().map(|r| r.seconds).collect();
        TenantsOutcome {
            name,
            mean_seconds: times.iter().sum::<f64>() / times.len().max(1) as f64,
            last_seconds: times.iter().copied().fold(0.0, f64::max),
            worker_seconds: runs.iter().map(|r| r.worker_seconds).sum(),
            waited: runs.iter().map(|r| r.waited).sum(),
            decisions: runs.iter().map(|r| r.decisions.len()).sum(),
        }
    }
}

/// The trainers of the tenants' jobs.
pub fn tenant_trainers() -> Vec<Trainer> {
    TENANT_OPTIMA.iter().map(|&o| Trainer::with_optimum(o, 0.030)).collect()
}

/// The ways of sharing `budget` between tenants of `mins` compared: ours over the budget,
/// every other contender within even quotas, and fixed pools at the quotas.
pub fn tenant_ways(config: &SimConfig, budget: u32, mins: &[u32]) -> Vec<(Contender, Sharing, String)> {
    let quotas = Sharing::even_quotas(budget, mins);
    let mut ways = vec![(Contender::Ours, Sharing::Budget(budget), "ours, shared budget".to_string())];
    for c in Contender::all(config).into_iter().filter(|c| !matches!(c, Contender::Ours | Contender::Fixed { .. })) {
        ways.push((c, quotas.clone(), format!("{}, even quotas", c.name())));
    }
    ways.push((Contender::Max, quotas, "fixed at quota".to_string()));
    ways
}

/// Each tenant's bounds under `sharing`: its min, and the budget's or its quota's max.
pub fn tenant_limits(sharing: &Sharing, mins: &[u32], config: &SimConfig) -> Vec<Limits> {
    (0..mins.len())
        .map(|i| {
            let max = match sharing {
                Sharing::Budget(_) => config.limits.max,
                Sharing::Quotas(q) => q[i],
            };
            Limits { min: mins[i].max(1), max: max.max(mins[i].max(1)) }
        })
        .collect()
}

/// Every way of sharing; each tenant trains the steps it would take an hour at full speed.
pub fn tenants_contest(config: &SimConfig) -> Vec<TenantsOutcome> {
    let trainers = tenant_trainers();
    let until = vec![Until::Batches(super::scenarios::steps(&trainers[0])); trainers.len()];
    tenant_ways(config, TENANT_BUDGET, &TENANT_MINS)
        .into_iter()
        .map(|(c, sharing, name)| {
            let shared = share_rounds(&trainers, &TENANT_MINS, c, &sharing, &until, config);
            TenantsOutcome::of(name, &shared.runs)
        })
        .collect()
}

/// Two jobs as in the real-process test (`local/tests/local_policies.rs`): each needs
/// [`NODE_OPTIMUM`] workers, the second is half as long, they share a budget of
/// [`NODE_BUDGET`], and all their workers run on one node with [`NODE_CORES`] workers' worth of
/// cores. While both run, a worker beyond the cores adds nothing, so a search then converges
/// low with its clients waiting; once the second is done, the first must grow again.
pub const NODE_OPTIMUM: u32 = 3;
pub const NODE_BUDGET: u32 = 4;
pub const NODE_CORES: f64 = 2.0;

/// Every way of sharing for the two jobs on one node; the first trains an hour's steps.
pub fn shared_node_contest(config: &SimConfig) -> Vec<TenantsOutcome> {
    let config = SimConfig { node_cores: Some(NODE_CORES), ..*config };
    let trainer = Trainer::with_optimum(NODE_OPTIMUM, 0.030);
    let steps = super::scenarios::steps(&trainer);
    let (trainers, mins) = ([trainer.clone(), trainer], [1, 1]);
    let until = [Until::Batches(steps), Until::Batches(steps / 2)];
    tenant_ways(&config, NODE_BUDGET, &mins)
        .into_iter()
        .map(|(c, sharing, name)| {
            let shared = share_rounds(&trainers, &mins, c, &sharing, &until, &config);
            TenantsOutcome::of(name, &shared.runs)
        })
        .collect()
}

/// Markdown: the tenants' setting, then one row per way of sharing.
pub fn tenants_table(outcomes: &[TenantsOutcome]) -> String {
    let Sharing::Quotas(quotas) = Sharing::even_quotas(TENANT_BUDGET, &TENANT_MINS) else { unreachable!() };
    let setting =
        format!("Optima {TENANT_OPTIMA:?}, mins {TENANT_MINS:?}, budget {TENANT_BUDGET} (even quotas {quotas:?}).");
    outcomes_table(&setting, outcomes)
}

/// Markdown: the two jobs on one node, then one row per way of sharing.
pub fn shared_node_table(outcomes: &[TenantsOutcome]) -> String {
    let setting = format!(
        "Two jobs of optimum {NODE_OPTIMUM}, the second half as long, budget {NODE_BUDGET} (even quotas 2 and 2), \
         all workers on one node with {NODE_CORES} workers' worth of cores."
    );
    outcomes_table(&setting, outcomes)
}

fn outcomes_table(setting: &str, outcomes: &[TenantsOutcome]) -> String {
    let mut out = format!(
        "{setting}\n\n\
         | policy | mean training time | last job done | worker-hours | waiting for data | decisions |\n\
         | --- | --- | --- | --- | --- | --- |\n"
    );
    for o in outcomes {
        let _ = writeln!(
            out,
            "| {} | {:.1} min | {:.1} min | {:.2} | {:.0} s | {} |",
            o.name,
            o.mean_seconds / 60.0,
            o.last_seconds / 60.0,
            o.worker_seconds / 3600.0,
            o.waited,
            o.decisions
        );
    }
    out
}
