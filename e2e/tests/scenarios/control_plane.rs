//! The cluster under the suite is a real Kubernetes control plane: the API server answers, the
//! controller manager turns Deployments into ReplicaSets and Pods, and the garbage collector
//! deletes dependents.

use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use stoker_e2e::k8s::{delete_namespace, fresh_namespace, wait_until_gone};
use stoker_e2e::{Check, Cluster, Provider, wait_for};

const TIMEOUT: Duration = Duration::from_secs(60);

fn owned_by(meta: &kube::api::ObjectMeta, uid: &str) -> bool {
    meta.owner_references.iter().flatten().any(|o| o.uid == uid)
}

pub async fn control_plane_is_real(cluster: &dyn Cluster) -> anyhow::Result<()> {
    let client = cluster.client();

    // The version the local provider promises (kind runs whatever its node image has).
    let version = client.apiserver_version().await.context("GET /version")?;
    eprintln!("  API server {} ({})", version.git_version, cluster.provider());
    if cluster.provider() == Provider::Local {
        ensure!(
            version.git_version.starts_with("v1.20."),
            "the local control plane should be kube-apiserver v1.20.x, got {}",
            version.git_version
        );
    }

    let ns = fresh_namespace(&client, "e2e-control-plane").await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let replicasets: Api<ReplicaSet> = Api::namespaced(client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);

    // A Deployment becomes a ReplicaSet and two Pods that stay Pending (no kubelet locally; an
    // image that is not there and never pulled where a kubelet runs: no registry is asked).
    let deployment: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "pending"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "pending"}},
            "template": {
                "metadata": {"labels": {"app": "pending"}},
                // No grace: on a kubelet the pods' sandboxes would otherwise hold the
                // namespace's deletion for the default 30 s.
                "spec": {"terminationGracePeriodSeconds": 0, "containers": [{
                    "name": "main",
                    "image": "registry.invalid/stoker-e2e/never-pulled:0",
                    "imagePullPolicy": "Never"
                }]}
            }
        }
    }))?;
    let deployment =
        deployments.create(&PostParams::default(), &deployment).await.context("creating Deployment pending")?;
    let deployment_uid = deployment.metadata.uid.clone().context("the Deployment has no uid")?;

    let rs_uid = wait_for(TIMEOUT, "a ReplicaSet owned by Deployment pending", || async {
        let list = replicasets.list(&ListParams::default()).await?;
        Ok(match list.items.iter().find(|rs| owned_by(&rs.metadata, &deployment_uid)) {
            Some(rs) => Check::Done(rs.metadata.uid.clone().unwrap_or_default()),
            None => Check::not_yet(format!("{} ReplicaSets, none owned by the Deployment", list.items.len())),
        })
    })
    .await?;

    let check_pods = || async {
        let list = pods.list(&ListParams::default().labels("app=pending")).await?;
        let owned: Vec<&Pod> = list.items.iter().filter(|p| owned_by(&p.metadata, &rs_uid)).collect();
        let phases: Vec<String> = owned
            .iter()
            .map(|p| {
                let phase = p.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default();
                let node = p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
                format!("{} {phase} node={node:?}", p.metadata.name.clone().unwrap_or_default())
            })
            .collect();
        anyhow::Ok((
            owned.len(),
            owned.iter().all(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending")),
            phases,
        ))
    };
    wait_for(TIMEOUT, "2 Pods owned by the ReplicaSet", || async {
        let (count, _, phases) = check_pods().await?;
        Ok(if count == 2 { Check::Done(()) } else { Check::not_yet(format!("pods: {phases:?}")) })
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (count, all_pending, phases) = check_pods().await?;
    ensure!(count == 2 && all_pending, "the Deployment's 2 pods should stay Pending; they are: {phases:?}");
    if cluster.provider() == Provider::Local {
        let list = pods.list(&ListParams::default().labels("app=pending")).await?;
        ensure!(
            list.items.iter().all(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none()),
            "no pod can be scheduled without nodes: {phases:?}"
        );
    }

    // The garbage collector: a ConfigMap owned by the Deployment goes when the Deployment goes.
    let configmap: ConfigMap = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "owned-by-pending",
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "pending", "uid": deployment_uid}]
        },
        "data": {"owner": "pending"}
    }))?;
    configmaps.create(&PostParams::default(), &configmap).await.context("creating ConfigMap owned-by-pending")?;
    deployments.delete("pending", &DeleteParams::background()).await.context("deleting Deployment pending")?;
    wait_until_gone(&configmaps, "owned-by-pending", TIMEOUT)
        .await
        .context("the garbage collector should delete a ConfigMap whose owner Deployment was deleted")?;
    wait_for(TIMEOUT, "the Deployment's ReplicaSet and Pods to be garbage-collected", || async {
        let rs = replicasets.list(&ListParams::default()).await?.items.len();
        let p = pods.list(&ListParams::default()).await?.items.len();
        Ok(if rs == 0 && p == 0 { Check::Done(()) } else { Check::not_yet(format!("{rs} ReplicaSets, {p} Pods left")) })
    })
    .await?;

    // The namespace controller finalizes a deleted namespace.
    delete_namespace(&client, &ns, Duration::from_secs(120)).await
}
