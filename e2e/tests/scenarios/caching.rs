//! Autocache through a real API server: workers the harness runs mount the namespace's
//! stoker-cache claim (a shared directory here), write the entry during the first epoch, and
//! read it after; the DataPipeline's status and a CacheDecided event show the decision, and its
//! status.profile each op's share of the workers' time, with a DominantOpChanged event. After an
//! operator restart, a second pipeline with the same prefix finds the entry on the volume (the
//! restarted dispatcher knows only what workers report from it) and reads it without writing.
//! On real pods, every worker pod is then deleted at once: the new pods (uid 65532, on the same
//! claim) serve from the entry and write no chunk.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime};
use stoker_e2e::tenants::reader_options;

use anyhow::ensure;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Event, PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
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
fn read(url: &str, options: ClientOptions) -> tokio::task::JoinHandle<Result<(), stoker_client::Error>> {
    let url = url.to_string();
    tokio::spawn(async move {
        let mut client = Client::from_dispatcher(&url, options).await?;
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

/// Real pods: deletes every worker pod of [`FIRST`] at once (no grace); the Deployment's new
/// pods, non-root on the same claim, serve batches from the entry without writing to it.
async fn every_worker_pod_replaced(cluster: &dyn Cluster, ns: &str, url: &str, entry: &Path) -> anyhow::Result<()> {
    // The split chunks (the entry's other files record use: leases, last used).
    let chunks = entry.join("splits");
    let files = modified_times(&chunks)?;
    ensure!(!files.is_empty(), "the entry holds no chunk files");
    let workers = format!("{FIRST}-workers");
    let deployment = Api::<Deployment>::namespaced(cluster.client(), ns).get(&workers).await?;
    let labels = deployment.spec.selector.match_labels.unwrap_or_default();
    let selector = labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
    let want = deployment.spec.replicas.unwrap_or(1) as usize;
    let pods: Api<Pod> = Api::namespaced(cluster.client(), ns);
    let names = |list: &[Pod]| list.iter().filter_map(|p| p.metadata.name.clone()).collect::<Vec<_>>();
    let old = names(&pods.list(&ListParams::default().labels(&selector)).await?.items);
    pods.delete_collection(&DeleteParams::default().grace_period(0), &ListParams::default().labels(&selector)).await?;
    eprintln!("  deleted every worker pod of {FIRST}: {old:?}");
    let (pods, selector, old) = (&pods, &selector, &old);
    wait_for(Duration::from_secs(120), format!("{want} new Ready worker pods for {FIRST}"), || async move {
        let list = pods.list(&ListParams::default().labels(selector)).await?.items;
        let live: Vec<Pod> = list.into_iter().filter(|p| p.metadata.deletion_timestamp.is_none()).collect();
        let ready = live
            .iter()
            .filter(|p| {
                p.status
                    .iter()
                    .flat_map(|s| s.conditions.iter().flatten())
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            })
            .count();
        let now = names(&live);
        Ok(if ready == want && now.len() == want && now.iter().all(|n| !old.contains(n)) {
            Check::Done(())
        } else {
            Check::not_yet(format!("pods {now:?}, {ready} Ready"))
        })
    })
    .await?;
    // A reader of its own gets batches from the new pods.
    let mut reader = Client::from_dispatcher(url, reader_options(&cluster.client(), ns, FIRST).await?).await?;
    for n in 0..20 {
        let batch = tokio::time::timeout(Duration::from_secs(60), reader.next()).await;
        let batch = batch.map_err(|_| anyhow::anyhow!("batch {n} from the new pods: none within 60 s"))?;
        batch.ok_or_else(|| anyhow::anyhow!("the stream ended after {n} batches"))??;
    }
    let after = modified_times(&chunks)?;
    ensure!(after == files, "the new pods wrote chunks: {files:?} -> {after:?}");
    Ok(())
}

/// Every file of a directory and when it was last written.
fn modified_times(entry: &Path) -> anyhow::Result<BTreeMap<String, SystemTime>> {
    let mut files = BTreeMap::new();
    for file in std::fs::read_dir(entry)? {
        let file = file?;
        files.insert(file.file_name().to_string_lossy().into_owned(), file.metadata()?.modified()?);
    }
    Ok(files)
}

/// The workers' per-op tallies reach `status.profile` through their heartbeats, and the op it
/// names dominant is announced by an event.
async fn profile_in_status(pipelines: &Api<DataPipeline>, events: &Api<Event>) -> anyhow::Result<()> {
    let profile = wait_for(Duration::from_secs(60), format!("{FIRST}'s status.profile to name a dominant op"), || {
        let pipelines = pipelines.clone();
        async move {
            let profile = pipelines.get(FIRST).await?.status.and_then(|s| s.profile);
            Ok(match profile {
                Some(p) if p.dominant.is_some() => Check::Done(p),
                other => Check::not_yet(format!("{other:?}")),
            })
        }
    })
    .await?;
    let ops: Vec<&str> = profile.ops.iter().map(|o| o.op.as_str()).collect();
    ensure!(ops == ["selectFields", "autocache", "cast"], "one entry per transform: {profile:?}");
    let shares: f64 = profile.ops.iter().map(|o| o.share).sum();
    ensure!((shares - 1.0).abs() <= 0.02, "the shares add up to 1: {profile:?}");
    ensure!(profile.ops[2].out_per_in == Some(1.0), "a cast passes every element on: {profile:?}");
    let dominant = profile.dominant.clone().expect("waited for");
    wait_for(Duration::from_secs(30), "a DominantOpChanged event naming it", || {
        let events = events.clone();
        let named = dominant.to_string();
        async move {
            let changed = events_of(&events, FIRST, "DominantOpChanged").await?;
            Ok(if changed.iter().any(|m| m.contains(&named)) {
                Check::Done(())
            } else {
                Check::not_yet(format!("{changed:?}, want one naming {named}"))
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
    let Some(url) = super::dispatcher_or_skip(cluster, "cache_decision_in_status") else { return Ok(()) };
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
    let first_reader = read(&url, reader_options(&client, &ns, FIRST).await?);

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
    profile_in_status(&pipelines, &events).await?;
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
    let second_reader = read(&url, reader_options(&client, &ns, SECOND).await?);
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
    if cluster.provider().real_pods() {
        every_worker_pod_replaced(cluster, &ns, &url, &entry).await?;
        ensure!(written("complete")? == marked, "the entry was rewritten after the pods were replaced");
        let first = wait_for_get(&pipelines, FIRST).await?;
        ensure!(first.fingerprint == cache.fingerprint, "{FIRST} reads the same entry on new pods: {first:?}");
    }
    for reader in [first_reader, second_reader] {
        ensure!(!reader.is_finished(), "a reader stopped early: {:?}", reader.await);
        reader.abort();
    }
    drop(kubelet);
    delete_namespace(&client, &ns, Duration::from_secs(120)).await
}
