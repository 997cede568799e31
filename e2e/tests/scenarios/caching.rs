//! Autocache through a real API server: workers the harness runs mount the namespace's
//! stoker-cache claim (a shared directory here), write the entry during the first epoch, and
//! read it after; the DataPipeline's status and a CacheDecided event show the decision.

use anyhow::ensure;
use k8s_openapi::api::core::v1::{Event, PersistentVolumeClaim};
use kube::api::{Api, ListParams, Patch, PatchParams};
use stoker_api::{CacheDecision, DataPipeline};
use stoker_client::{Client, ClientOptions};
use stoker_e2e::k8s::{delete_namespace, fresh_namespace};
use stoker_e2e::{Check, Cluster, OperatorOptions, wait_for};
use std::time::Duration;

const NAME: &str = "cached";

pub async fn cache_decision_in_status(cluster: &dyn Cluster) -> anyhow::Result<()> {
    let url = match cluster.dispatcher_url() {
        Ok(url) => url,
        Err(e) => {
            println!("cache_decision_in_status SKIPPED on the {} provider: {e:#}", cluster.provider());
            return Ok(());
        }
    };
    cluster.operator_start(OperatorOptions::default()).await?;
    let client = cluster.client();
    let ns = fresh_namespace(&client, "e2e-cache").await?;
    let kubelet = cluster.run_workers(&ns)?;
    let data = cluster.workdir().join(format!("{ns}-data"));
    std::fs::create_dir_all(&data)?;
    for shard in 0..8 {
        let lines: String = (0..100).map(|i| format!("{{\"id\": {}, \"x\": [1.5, 2.5]}}\n", shard * 1000 + i)).collect();
        std::fs::write(data.join(format!("{shard}.jsonl")), lines)?;
    }
    let manifest = format!(
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {{name: {NAME}}}\nspec:\n  \
         source: {{uri: 'file://{}/', format: jsonl}}\n  \
         transforms: [{{selectFields: {{fields: [id, x]}}}}, {{autocache: {{}}}}, {{cast: {{field: x, dtype: float16}}}}]\n  \
         batchSize: 20\n  autoscaling: {{mode: Fixed, replicas: 2}}\n  \
         cache: {{mode: Always, accessMode: ReadWriteOnce}}\n",
        data.display()
    );
    let dp: DataPipeline = stoker_api::from_yaml(&manifest)?;
    let pipelines = Api::<DataPipeline>::namespaced(client.clone(), &ns);
    pipelines.patch(NAME, &PatchParams::apply("e2e").force(), &Patch::Apply(&dp)).await?;

    let reader = {
        let (url, ns) = (url.clone(), ns.clone());
        tokio::spawn(async move {
            let mut client = Client::from_dispatcher(&url, ClientOptions::new(ns, NAME)).await?;
            while let Some(batch) = client.next().await {
                batch?;
            }
            Ok::<(), stoker_client::Error>(())
        })
    };

    // Put while the first epoch runs, then Get once every split is on the volume.
    let cache = wait_for(Duration::from_secs(90), "status.cache to show a complete entry being read", || {
        let pipelines = pipelines.clone();
        async move {
            let cache = pipelines.get(NAME).await?.status.and_then(|s| s.cache);
            Ok(match cache {
                Some(c) if c.decision == CacheDecision::Get && c.complete => Check::Done(c),
                other => Check::not_yet(format!("{other:?}")),
            })
        }
    })
    .await?;
    ensure!(cache.at == Some(1) && cache.fingerprint.as_deref().is_some_and(|f| f.starts_with("sha256:")), "{cache:?}");
    let pvcs = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns).list(&ListParams::default()).await?;
    ensure!(pvcs.items.len() == 1, "one cache claim for the namespace");
    // The event follows the status it reports.
    let events = Api::<Event>::namespaced(client.clone(), &ns);
    wait_for(Duration::from_secs(30), "a CacheDecided event for the Get", || {
        let events = events.clone();
        async move {
            let list = events.list(&ListParams::default()).await?;
            let decided: Vec<String> =
                list.items.iter().filter(|e| e.reason.as_deref() == Some("CacheDecided")).filter_map(|e| e.message.clone()).collect();
            Ok(if decided.iter().any(|m| m.starts_with("Get at transform 1")) { Check::Done(()) } else { Check::not_yet(format!("{decided:?}")) })
        }
    })
    .await?;
    let table = cluster.kubectl(&["get", "dp", NAME, "-n", &ns]).await?;
    let row = table.lines().find(|l| l.starts_with(NAME)).unwrap_or_default();
    ensure!(table.lines().next().is_some_and(|h| h.contains("CACHE")) && row.split_whitespace().any(|c| c == "Get"), "`kubectl get dp` shows the decision:\n{table}");
    reader.abort();
    drop(kubelet);
    delete_namespace(&client, &ns, Duration::from_secs(60)).await
}
