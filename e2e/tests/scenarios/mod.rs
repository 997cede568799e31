//! The scenarios, one module per area. Each is an `async fn(&dyn Cluster) -> anyhow::Result<()>`
//! that runs on both providers; add it to [`ALL`] (they run in that order, sharing the cluster
//! and the operator, so leave the cluster as you found it: own namespaces, deleted at the end).

pub mod autoscaling;
pub mod caching;
pub mod chart;
pub mod control_plane;
pub mod dashboard;
pub mod operator;
pub mod pipelines;
pub mod sample_pods;
pub mod sweep;
pub mod tenancy;
pub mod tls;

use futures::future::BoxFuture;
use stoker_e2e::Cluster;

/// The dispatcher's URL from outside the cluster, or None (said, with why) where a provider
/// cannot reach it (kind): `scenario` is then skipped.
pub fn dispatcher_or_skip(cluster: &dyn Cluster, scenario: &str) -> Option<String> {
    match cluster.dispatcher_url() {
        Ok(url) => Some(url),
        Err(e) => {
            println!("{scenario} SKIPPED on the {} provider: {e:#}", cluster.provider());
            None
        }
    }
}

/// `shards` JSONL files of `lines` records `{"id": shard * 1000 + line}` in `dir`.
pub fn write_id_corpus(dir: &std::path::Path, shards: i64, lines: i64) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for shard in 0..shards {
        let records: String = (0..lines).map(|i| format!("{{\"id\": {}}}\n", shard * 1000 + i)).collect();
        std::fs::write(dir.join(format!("{shard:02}.jsonl")), records)?;
    }
    Ok(())
}

pub type ScenarioFn = for<'a> fn(&'a dyn Cluster) -> BoxFuture<'a, anyhow::Result<()>>;

pub struct Scenario {
    pub name: &'static str,
    pub run: ScenarioFn,
}

macro_rules! scenarios {
    ($($module:ident :: $func:ident),* $(,)?) => {
        &[$(Scenario { name: stringify!($func), run: |cluster| Box::pin($module::$func(cluster)) }),*]
    };
}

/// Every scenario, in run order.
pub static ALL: &[Scenario] = scenarios![
    control_plane::control_plane_is_real,
    chart::chart_installs,
    operator::operator_leader_election,
    pipelines::samples_become_workers,
    sample_pods::samples_run_as_pods,
    pipelines::spec_changes_and_deletion,
    pipelines::invalid_specs_are_refused,
    pipelines::apply_failures_degrade_and_back_off,
    pipelines::long_names_fit,
    pipelines::restart_writes_nothing,
    autoscaling::batch_time_autoscaling,
    caching::cache_decision_in_status,
    dashboard::dashboard_queries_have_data,
    sweep::sweep_shares_one_production,
    tenancy::tenancy_tokens_and_permissions,
    tls::tls_end_to_end,
    // Last: it reinstalls the chart, and the dispatcher Service's address changes.
    chart::chart_upgrade_and_uninstall,
];
