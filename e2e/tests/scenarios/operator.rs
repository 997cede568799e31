//! The operator as the harness runs it: replicas, leader election through the Lease, failover,
//! restart, and its HTTP endpoints.

use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use stoker_e2e::{Check, Cluster, LEASE_NAME, OPERATOR_NAMESPACE, OperatorOptions, wait_for};

/// Lease duration (15 s by default) plus slack.
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(60);

async fn lease_holder(cluster: &dyn Cluster) -> anyhow::Result<Option<String>> {
    let lease = Api::<Lease>::namespaced(cluster.client(), OPERATOR_NAMESPACE).get_opt(LEASE_NAME).await?;
    Ok(lease.and_then(|l| l.spec).and_then(|s| s.holder_identity))
}

/// Waits until exactly one running instance leads and holds the Lease; returns its name.
async fn leader(cluster: &dyn Cluster, other_than: Option<&str>) -> anyhow::Result<String> {
    let what = match other_than {
        Some(old) => format!("an operator instance other than {old} to lead and hold the Lease"),
        None => "one operator instance to lead and hold the Lease".to_string(),
    };
    wait_for(FAILOVER_TIMEOUT, what, || async move {
        let mut leaders = Vec::new();
        let mut seen = Vec::new();
        for i in cluster.operator_instances().await?.into_iter().filter(|i| i.running) {
            match cluster.operator_get(&i.name, "/readyz").await {
                Ok(r) if r.status == 200 => leaders.push(i.name.clone()),
                Ok(r) => seen.push(format!("{} /readyz {}", i.name, r.status)),
                Err(e) => seen.push(format!("{}: {e:#}", i.name)),
            }
        }
        let holder = lease_holder(cluster).await?;
        Ok(match leaders.as_slice() {
            [one] if Some(one.as_str()) != other_than && holder.as_deref() == Some(one.as_str()) => {
                Check::Done(one.clone())
            }
            [_, _, ..] => Check::Abort(format!("more than one instance is ready (leads): {leaders:?}")),
            _ => Check::not_yet(format!("ready: {leaders:?}, not ready: {seen:?}, lease holder: {holder:?}")),
        })
    })
    .await
}

pub async fn operator_leader_election(cluster: &dyn Cluster) -> anyhow::Result<()> {
    cluster.operator_start(OperatorOptions::default().replicas(2)).await?;
    let first = leader(cluster, None).await?;
    eprintln!("  leader: {first}");

    // Health and metrics answer on every instance; readiness only on the leader.
    for i in cluster.operator_instances().await?.into_iter().filter(|i| i.running) {
        let health = cluster.operator_get(&i.name, "/healthz").await?;
        ensure!(health.status == 200, "{} /healthz answered {}", i.name, health.status);
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
    cluster.operator_kill(&first, true).await?;
    let second = leader(cluster, Some(&first)).await.context("failover after the leader stopped")?;
    eprintln!("  after stopping {first}: leader {second}");

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
