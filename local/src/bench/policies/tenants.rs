//! The simulation's tenants on processes: five jobs whose optima add up to twice a budget of
//! 16 workers, all training at once on one dispatcher. Ours is one scaling loop sharing the
//! budget; every baseline is each tenant's own controller within an even quota, as a
//! ResourceQuota per namespace would hold it. A job that has trained its steps is taken out
//! and its workers stop (with ours its share goes to the others).

use std::fmt::Write as _;

use stoker_operator::autoscaling::sim::tenants::{
    Sharing, TENANT_BUDGET, TENANT_MINS, TenantsOutcome, tenant_limits, tenant_trainers, tenant_ways, tenants_table,
};

use super::run::{self, Job};
use super::{Options, logs, setting};

/// Every way of sharing in turn, each tenant training `options.seconds` at full speed; each
/// outcome printed to `out` as it ends.
pub async fn contest(options: &Options, out: &mut (dyn std::io::Write + Send)) -> anyhow::Result<Vec<TenantsOutcome>> {
    let config = &options.config;
    let trainers = tenant_trainers();
    let steps = (options.seconds / trainers[0].mean_step()).round().max(1.0) as u64;
    let logs = logs(options).await?;
    let setting = setting(options, &logs, trainers[0].rate).await?;
    writeln!(
        out,
        "tenants: {steps} steps each; a worker uses {:.4} cores per batch a second (HPA's request: that times its cap)",
        setting.cores_per_rate
    )?;
    let mut outcomes = Vec::new();
    for (contender, sharing, name) in tenant_ways(config, TENANT_BUDGET, &TENANT_MINS) {
        let limits = tenant_limits(&sharing, &TENANT_MINS, config);
        let jobs: Vec<Job> = trainers
            .iter()
            .zip(limits)
            .enumerate()
            .map(|(i, (trainer, limits))| Job {
                name: format!("tenant-{i}"),
                trainer: trainer.clone(),
                steps,
                limits,
                start: contender.start(limits, limits.max),
            })
            .collect();
        let budget = match sharing {
            Sharing::Budget(b) => Some(b),
            Sharing::Quotas(_) => None,
        };
        let runs = run::run_jobs(contender, &jobs, budget, &setting).await?;
        let mut line = format!("  {name:<34}");
        for r in &runs {
            let _ = write!(line, " {:>5.0} s/{:>4.0} ws", r.seconds, r.worker_seconds);
        }
        writeln!(out, "{line}")?;
        out.flush()?;
        outcomes.push(TenantsOutcome::of(name, &runs));
    }
    Ok(outcomes)
}

/// The simulation's tenants table, for runs on processes.
pub fn report(outcomes: &[TenantsOutcome]) -> String {
    format!("Tenants over a budget, on local processes:\n\n{}", tenants_table(outcomes))
}
