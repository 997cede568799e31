//! The operator as the harness runs it: replicas, leader election through the Lease, failover,
//! restart, and its HTTP endpoints.

use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Endpoints;
use kube::api::Api;
use stoker_e2e::{Check, Cluster, LEASE_NAME, OPERATOR_NAMESPACE, OperatorOptions, wait_for};

/// The operator's lease duration (the chart's default).
pub(super) const LEASE: Duration = Duration::from_secs(15);
/// Lease duration plus slack.
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(60);
/// The chart's dispatcher Service.
const DISPATCHER: &str = "stoker-dispatcher";

async fn lease_holder(cluster: &dyn Cluster) -> anyhow::Result<Option<String>> {
    let lease = Api::<Lease>::namespaced(cluster.client(), OPERATOR_NAMESPACE).get_opt(LEASE_NAME).await?;
    Ok(lease.and_then(|l| l.spec).and_then(|s| s.holder_identity))
}

/// The pods behind the dispatcher Service (names from its Endpoints' target references).
async fn dispatcher_endpoints(cluster: &dyn Cluster) -> anyhow::Result<Vec<String>> {
    let endpoints = Api::<Endpoints>::namespaced(cluster.client(), OPERATOR_NAMESPACE).get_opt(DISPATCHER).await?;
    Ok(endpoints
        .into_iter()
        .flat_map(|e| e.subsets.unwrap_or_default())
        .flat_map(|s| s.addresses.unwrap_or_default())
        .filter_map(|a| a.target_ref.and_then(|r| r.name))
        .collect())
}

/// The instance that leads, and its identity in the Lease (`<name>_<process start>`).
pub(super) struct Leader {
    pub name: String,
    pub holder: String,
}

/// Waits until exactly one running instance leads and holds the Lease (and, on real pods, is
/// the dispatcher Service's only endpoint); `other_than`: a Lease identity that must not be
/// the holder's (a leader that stopped or crashed; a process restarted in its pod is another).
pub(super) async fn leader(cluster: &dyn Cluster, other_than: Option<&str>) -> anyhow::Result<Leader> {
    let what = match other_than {
        Some(old) => format!("an operator process other than {old} to lead and hold the Lease"),
        None => "one operator instance to lead and hold the Lease".to_string(),
    };
    wait_for(FAILOVER_TIMEOUT, what, || async move {
        let mut leaders = Vec::new();
        let mut seen = Vec::new();
        for i in cluster.operator_instances().await?.into_iter().filter(|i| i.running) {
            match cluster.operator_get(&i.name, "/readyz").await {
                Ok(r) if r.says_leading() => leaders.push(i.name.clone()),
                Ok(r) => seen.push(format!("{} /readyz {} {}", i.name, r.status, r.body.trim())),
                Err(e) => seen.push(format!("{}: {e:#}", i.name)),
            }
        }
        let holder = lease_holder(cluster).await?;
        let routed = if cluster.provider().real_pods() { Some(dispatcher_endpoints(cluster).await?) } else { None };
        let held_by = |name: &str| holder.as_deref().and_then(|h| h.rsplit_once('_')).is_some_and(|(n, _)| n == name);
        Ok(match leaders.as_slice() {
            [one]
                if holder.as_deref() != other_than
                    && held_by(one)
                    && routed.as_ref().is_none_or(|r| r == std::slice::from_ref(one)) =>
            {
                Check::Done(Leader { name: one.clone(), holder: holder.clone().unwrap_or_default() })
            }
            [_, _, ..] => Check::Abort(format!("more than one instance says it leads: {leaders:?}")),
            _ => Check::not_yet(format!(
                "leading: {leaders:?}, others: {seen:?}, lease holder: {holder:?}, dispatcher Service endpoints: \
                 {routed:?}"
            )),
        })
    })
    .await
}

pub async fn operator_leader_election(cluster: &dyn Cluster) -> anyhow::Result<()> {
    cluster.operator_start(OperatorOptions::default().replicas(2)).await?;
    let first = leader(cluster, None).await?;
    eprintln!("  leader: {} ({})", first.name, first.holder);

    // Health, readiness and metrics answer on every instance: a standby is Ready too (so
    // rollouts finish), and says it stands by.
    for i in cluster.operator_instances().await?.into_iter().filter(|i| i.running) {
        let health = cluster.operator_get(&i.name, "/healthz").await?;
        ensure!(health.status == 200, "{} /healthz answered {}", i.name, health.status);
        let ready = cluster.operator_get(&i.name, "/readyz").await?;
        let role = if i.name == first.name { "leading" } else { "standby" };
        ensure!(
            ready.status == 200 && ready.body.trim() == role,
            "{} /readyz should answer 200 {role:?}, answered {} {:?}",
            i.name,
            ready.status,
            ready.body
        );
        let metrics = cluster.operator_get(&i.name, "/metrics").await?;
        ensure!(
            metrics.status == 200 && metrics.body.contains("# TYPE"),
            "{} /metrics should be Prometheus text, got {} {:?}",
            i.name,
            metrics.status,
            metrics.body.chars().take(200).collect::<String>()
        );
    }

    // A leader that stops gracefully hands over to the standby.
    cluster.operator_kill(&first.name, true).await?;
    let second = leader(cluster, Some(&first.holder)).await.context("failover after the leader stopped")?;
    ensure!(second.name != first.name, "{} stopped, yet leads", first.name);
    eprintln!("  after stopping {}: leader {}", first.name, second.name);

    // A restart brings every instance back, with one leader.
    cluster.operator_restart().await?;
    let instances = cluster.operator_instances().await?;
    ensure!(
        instances.iter().filter(|i| i.running).count() == 2,
        "2 instances should run after a restart: {instances:?}"
    );
    leader(cluster, None).await?;
    Ok(())
}
