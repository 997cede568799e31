//! Autocache through a real API server: workers the harness runs mount the namespace's
//! stoker-cache claim (a shared directory here), write the entry during the first epoch, and
//! read it after; the DataPipeline's status and a CacheDecided event show the decision. After an
//! operator restart, a second pipeline with the same prefix finds the entry on the volume (the
//! restarted dispatcher knows only what workers report from it) and reads it without writing.

use anyhow::ensure;
use k8s_openapi::api::core::v1::{Event, PersistentVolumeClaim};
use kube::api::{Api, ListParams, Patch, PatchParams};
use std::time::{Duration, SystemTime};
use stoker_api::{CacheDecision, CacheStatus, DataPipeline};
use stoker_client::{Client, ClientOptions};
use stoker_e2e::k8s::{delete_namespace, fresh_namespace};
use stoker_e2e::{Check, Cluster, OperatorOptions, WorkerData, wait_for};

const FIRST: &str = "cached";
const SECOND: &str = "same-prefix";

/// A pipeline over `data` whose prefix (up to the hint at transform 1) is the same whatever
/// `after` and `cache` are.
/// `data`: where the workers read the records (`Cluster::worker_data`).
fn manifest(name: &str, data: &WorkerData, after: &str, cache: &str) -> anyhow::Result<DataPipeline> {
    let yaml = format!(
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {{name: {name}}}\nspec:\n  \
         source: {{uri: 'file://{}/', format: jsonl}}\n  \
         transforms: [{{selectFields: {{fields: [id, x]}}}}, {{autocache: {{}}}}, {after}]\n  \
         batchSize: 20\n  autoscaling: {{mode: Fixed, replicas: 2}}\n  \
         workers: {{{}}}\n  cache: {cache}\n",
        data.path, data.fields
    );
    Ok(stoker_api::from_yaml(&yaml)?)
}

/// Streams batches of a pipeline until aborted.
fn read(url: &str, ns: &str, name: &'static str) -> tokio::task::JoinHandle<Result<(), stoker_client::Error>> {
    let (url, ns) = (url.to_string(), ns.to_string());
    tokio::spawn(async move {
        let mut client = Client::from_dispatcher(&url, ClientOptions::new(ns, name)).await?;
        while let Some(batch) = client.next().await {
            batch?;
        }
        Ok(())
    })
}

async fn wait_for_get(pipelines: &Api<DataPipeline>, name: &str) -> anyhow::Result<CacheStatus> {
    wait_for(Duration::from_secs(90), format!("{name}'s status.cache to show a complete entry being read"), || {
        let pipelines = pipelines.clone();
        async move {
            let cache = pipelines.get(name).await?.status.and_then(|s| s.cache);
            Ok(match cache {
                Some(c) if c.decision == CacheDecision::Get && c.complete => Check::Done(c),
                other => Check::not_yet(format!("{other:?}")),
            })
        }
    })
    .await
}

async fn events_of(events: &Api<Event>, name: &str, reason: &str) -> anyhow::Result<Vec<String>> {
    let list = events.list(&ListParams::default()).await?;
    Ok(list
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some(reason) && e.involved_object.name.as_deref() == Some(name))
        .filter_map(|e| e.message.clone())
        .collect())
}

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
        let lines: String =
            (0..100).map(|i| format!("{{\"id\": {}, \"x\": [1.5, 2.5]}}\n", shard * 1000 + i)).collect();
        std::fs::write(data.join(format!("{shard}.jsonl")), lines)?;
    }
    let seen_as = cluster.worker_data(&data);
    let pipelines = Api::<DataPipeline>::namespaced(client.clone(), &ns);
    let apply = |dp: DataPipeline| {
        let pipelines = pipelines.clone();
        async move {
            let name = dp.metadata.name.clone().unwrap_or_default();
            pipelines.patch(&name, &PatchParams::apply("e2e").force(), &Patch::Apply(&dp)).await
        }
    };
    apply(manifest(
        FIRST,
        &seen_as,
        "{cast: {field: x, dtype: float16}}",
        "{mode: Always, accessMode: ReadWriteOnce}",
    )?)
    .await?;
    let first_reader = read(&url, &ns, FIRST);

    // Put while the first epoch runs, then Get once every split is on the volume.
    let cache = wait_for_get(&pipelines, FIRST).await?;
    let fingerprint = cache.fingerprint.clone().unwrap_or_default();
    ensure!(cache.at == Some(1) && fingerprint.starts_with("sha256:"), "{cache:?}");
    let events = Api::<Event>::namespaced(client.clone(), &ns);
    // The event follows the status it reports.
    wait_for(Duration::from_secs(30), "a CacheDecided event for the Get", || {
        let events = events.clone();
        async move {
            let decided = events_of(&events, FIRST, "CacheDecided").await?;
            Ok(if decided.iter().any(|m| m.starts_with("Get at transform 1")) {
                Check::Done(())
            } else {
                Check::not_yet(format!("{decided:?}"))
            })
        }
    })
    .await?;
    let table = cluster.kubectl(&["get", "dp", FIRST, "-n", &ns]).await?;
    let row = table.lines().find(|l| l.starts_with(FIRST)).unwrap_or_default();
    ensure!(
        table.lines().next().is_some_and(|h| h.contains("CACHE")) && row.split_whitespace().any(|c| c == "Get"),
        "`kubectl get dp` shows the decision:\n{table}"
    );

    // The entry is written once: its completion marker is not touched again.
    let entry = cluster.claim_dir(&ns, "stoker-cache").await?.join(fingerprint.trim_start_matches("sha256:"));
    let written = |file: &str| std::fs::metadata(entry.join(file)).and_then(|m| m.modified());
    let marked: SystemTime = written("complete").map_err(|e| anyhow::anyhow!("{}: {e}", entry.display()))?;

    // A restarted operator keeps no cache state in memory; the volume is the index.
    cluster.operator_restart().await?;
    apply(manifest(SECOND, &seen_as, "{cast: {field: x, dtype: float32}}", "{mode: Auto}")?).await?;
    let second_reader = read(&url, &ns, SECOND);
    let second = wait_for_get(&pipelines, SECOND).await?;
    ensure!(
        second.fingerprint.as_deref() == Some(fingerprint.as_str()) && second.at == Some(1),
        "same prefix, same entry: {second:?}"
    );
    ensure!(
        second.measured.as_ref().and_then(|m| m.put).is_none(),
        "{SECOND} read from its first split, never wrote: {second:?}"
    );
    let first = wait_for_get(&pipelines, FIRST).await?;
    ensure!(first.fingerprint == cache.fingerprint, "{FIRST} reads the same entry after the restart: {first:?}");
    let decided = events_of(&events, SECOND, "CacheDecided").await?;
    ensure!(!decided.iter().any(|m| m.starts_with("Put")), "{SECOND} never decided to write: {decided:?}");
    ensure!(written("complete")? == marked, "the entry was rewritten");

    // SECOND asks for the default ReadWriteMany; the claim FIRST made stays as it is, and says so.
    let differs = events_of(&events, SECOND, "CacheVolumeDiffers").await?;
    ensure!(
        differs.len() == 1 && differs[0].contains("accessMode ReadWriteMany (the claim has ReadWriteOnce)"),
        "a CacheVolumeDiffers warning for {SECOND}: {differs:?}"
    );
    let pvcs = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns).list(&ListParams::default()).await?;
    ensure!(
        pvcs.items.len() == 1,
        "one cache claim for the namespace, shared by both pipelines: {} claims",
        pvcs.items.len()
    );
    for reader in [first_reader, second_reader] {
        ensure!(!reader.is_finished(), "a reader stopped early: {:?}", reader.await);
        reader.abort();
    }
    drop(kubelet);
    delete_namespace(&client, &ns, Duration::from_secs(120)).await
}
