//! The control loop through a real API server: a synthetic trainer streams from workers the
//! harness runs for the workers Deployment, its batch times drive the autoscaler, and the
//! Deployment's replicas and the DataPipeline's status follow the policy to convergence. An
//! operator restarted mid-scaling costs the trainer no error and the autoscaler no progress
//! (its history survives in status); the leading operator crashing (standby takes over once
//! the lease expires) only pauses the trainer; a worker killed mid-epoch afterwards loses no
//! element. Every epoch the trainer finished, those spanning the restart and the crash too,
//! held every element exactly once: the clients rejoined the new leader with what they had.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::ensure;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams};
use stoker_api::DataPipeline;
use stoker_client::Client;
use stoker_client::trainer::{Stop, TrainerSpec, train};
use stoker_e2e::k8s::{delete_namespace, fresh_namespace};
use stoker_e2e::{Check, Cluster, OperatorOptions, wait_for};

const SHARDS: i64 = 16;
const LINES: i64 = 200;
/// Each worker's cap in batches/s, and the trainer's compute per batch: the optimum is
/// ceil(1 / (20 * 0.010)) = 5 workers.
const WORKER_RATE: u32 = 20;
const COMPUTE: Duration = Duration::from_millis(10);
const OPTIMUM: i32 = 5;
const NAME: &str = "autoscaled";

/// What the trainer saw: ids per epoch, and steps.
#[derive(Default)]
struct Seen {
    epochs: Mutex<BTreeMap<u64, BTreeMap<i64, u32>>>,
    steps: AtomicU64,
    error: Mutex<Option<String>>,
}

/// The ids an epoch lacks, as ranges per shard ("shard 3: 120-139"), to tell a lost split
/// from lost batches.
fn missing(ids: &BTreeMap<i64, u32>) -> String {
    let mut out = Vec::new();
    for shard in 0..SHARDS {
        let mut ranges: Vec<(i64, i64)> = Vec::new();
        for i in (0..LINES).filter(|i| !ids.contains_key(&(shard * 1000 + i))) {
            match ranges.last_mut() {
                Some((_, end)) if *end + 1 == i => *end = i,
                _ => ranges.push((i, i)),
            }
        }
        if !ranges.is_empty() {
            let ranges: Vec<String> = ranges.iter().map(|(a, b)| format!("{a}-{b}")).collect();
            out.push(format!("shard {shard}: {}", ranges.join(",")));
        }
    }
    out.join("; ")
}

/// A scaling history in one line, the decisions' reasons last: "2 (51.7 ms) -> 4 (26.0 ms); reasons: ...".
fn path(history: &[stoker_api::ScalingStep]) -> String {
    let steps: Vec<String> = history
        .iter()
        .map(|h| format!("{} ({})", h.workers, h.batch_time_ms.map_or("-".into(), |ms| format!("{ms:.1} ms"))))
        .collect();
    let reasons: Vec<&str> = history.iter().map(|h| h.reason.as_str()).collect();
    format!("{}; reasons: {}", steps.join(" -> "), reasons.join(" | "))
}

async fn replicas(api: &Api<Deployment>) -> anyhow::Result<i32> {
    Ok(api.get_opt(&format!("{NAME}-workers")).await?.and_then(|d| d.spec.replicas).unwrap_or(0))
}

pub async fn batch_time_autoscaling(cluster: &dyn Cluster) -> anyhow::Result<()> {
    let Some(url) = super::dispatcher_or_skip(cluster, "batch_time_autoscaling") else { return Ok(()) };
    // Two replicas: a standby to take over when the leader crashes.
    cluster.operator_start(OperatorOptions::default().replicas(2)).await?;
    let client = cluster.client();
    let ns = fresh_namespace(&client, "e2e-autoscale").await?;
    let kubelet = cluster.run_workers(&ns)?;
    let data = cluster.workdir().join(format!("{ns}-data"));
    super::write_id_corpus(&data, SHARDS, LINES)?;
    let seen_as = cluster.worker_data(&data);
    let manifest = format!(
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {{name: {NAME}}}\nspec:\n  \
         source: {{uri: 'file://{}/', format: jsonl}}\n  batchSize: 10\n  \
         workers: {{min: 1, max: 8, env: [{{name: STOKER_MAX_BATCH_RATE, value: '{WORKER_RATE}'}}]{}}}\n  \
         autoscaling: {{policy: {{windowSeconds: 2, idleAfterSeconds: 3600}}}}\n",
        seen_as.path,
        seen_as.more_fields()
    );
    let dp: DataPipeline = serde_yaml::from_str(&manifest)?;
    let pipelines = Api::<DataPipeline>::namespaced(client.clone(), &ns);
    pipelines.patch(NAME, &PatchParams::apply("e2e").force(), &Patch::Apply(&dp)).await?;

    // The trainer runs in the background for the whole scenario.
    let seen = Arc::new(Seen::default());
    let trainer = {
        let seen = seen.clone();
        let url = url.clone();
        let options = stoker_e2e::tenants::reader_options(&client, &ns, NAME).await?;
        tokio::spawn(async move {
            let result = async {
                let mut client = Client::from_dispatcher(&url, options).await?;
                let record = |_: &stoker_client::trainer::TrainSummary, batch: &stoker_client::Batch| {
                    let ids = batch.tensors["id"].data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()));
                    let mut epochs = seen.epochs.lock().unwrap();
                    let epoch = epochs.entry(batch.epoch).or_default();
                    for id in ids {
                        *epoch.entry(id).or_default() += 1;
                    }
                    seen.steps.fetch_add(1, Ordering::Relaxed);
                };
                train(&mut client, &TrainerSpec::steady(COMPUTE), Stop::default(), record).await?;
                Ok::<(), stoker_client::Error>(())
            }
            .await;
            if let Err(e) = result {
                *seen.error.lock().unwrap() = Some(e.to_string());
            }
        })
    };
    let steps = || seen.steps.load(Ordering::Relaxed);
    let trainer_error = || seen.error.lock().unwrap().clone();
    // The trainer takes 100 more steps within `timeout` (after `what`).
    let keeps_training = |timeout: Duration, what: &'static str| async move {
        let before = steps();
        let waited = format!("the trainer to keep training {what}");
        wait_for(timeout, waited, || async move {
            let since = steps() - before;
            Ok(if since >= 100 {
                Check::Done(())
            } else {
                Check::not_yet(format!("{since} steps since; trainer error: {:?}", trainer_error()))
            })
        })
        .await
    };
    let trainer_ok = || -> anyhow::Result<()> {
        match seen.error.lock().unwrap().clone() {
            Some(e) => anyhow::bail!("the trainer got an error: {e}"),
            None => Ok(()),
        }
    };

    let deployments = Api::<Deployment>::namespaced(client.clone(), &ns);
    let deployments = &deployments;
    // Scaling under way: the autoscaler grew the Deployment past its start.
    wait_for(Duration::from_secs(90), "the autoscaler to grow the workers Deployment to 2 or more", || async move {
        let n = replicas(deployments).await?;
        Ok(if n >= 2 { Check::Done(()) } else { Check::not_yet(format!("replicas {n}")) })
    })
    .await?;
    trainer_ok()?;

    // Restart the operator mid-scaling: the trainer keeps getting batches.
    let epoch_at_restart = seen.epochs.lock().unwrap().keys().max().copied().unwrap_or(0);
    cluster.operator_restart().await?;
    keeps_training(Duration::from_secs(30), "across the operator restart").await?;
    trainer_ok()?;

    // Convergence: status says so, within one worker of the optimum, with a history.
    let pipelines = &pipelines;
    let dp = wait_for(
        Duration::from_secs(120),
        format!("the autoscaler to converge near {OPTIMUM} workers"),
        || async move {
            let dp = pipelines.get(NAME).await?;
            let status = dp.status.clone().unwrap_or_default();
            let converged = status.autoscaler.as_ref().is_some_and(|a| a.converged);
            let desired = status.workers.as_ref().map_or(0, |w| w.desired);
            Ok(if converged && (desired - OPTIMUM).abs() <= 1 {
                Check::Done(dp)
            } else {
                let state = status.autoscaler.as_ref().and_then(|a| a.state.clone());
                let history = status.autoscaler.as_ref().map(|a| path(&a.history)).unwrap_or_default();
                Check::not_yet(format!("converged {converged} ({state:?}), desired {desired}, path {history}"))
            })
        },
    )
    .await?;
    trainer_ok()?;
    let status = dp.status.unwrap_or_default();
    let desired = status.workers.as_ref().map_or(0, |w| w.desired);
    ensure!(replicas(deployments).await? == desired, "the Deployment runs what status says");
    ensure!(status.batch_time_ms.is_some_and(|ms| ms > 0.0), "status shows the batch time: {:?}", status.batch_time_ms);
    // Status shows how long the trainer waited for data, of its time in all.
    let wait = status.data_wait.clone().unwrap_or_default();
    ensure!(
        wait.total_seconds > 0.0
            && 0.0 <= wait.waiting_seconds
            && wait.waiting_seconds <= wait.total_seconds
            && (0.0..=1.0).contains(&wait.fraction),
        "status shows the trainer's wait for data: {:?}",
        status.data_wait
    );
    let history = status.autoscaler.map(|a| a.history).unwrap_or_default();
    eprintln!("  converged at {desired} workers: {}", path(&history));
    ensure!(
        !history.is_empty() && history.iter().all(|h| !h.reason.is_empty()),
        "every decision has a reason: {history:?}"
    );
    ensure!(history[0].workers == 2, "the history from before the restart is kept: {history:?}");
    let events = Api::<Event>::namespaced(client.clone(), &ns).list(&ListParams::default()).await?;
    ensure!(events.items.iter().any(|e| e.reason.as_deref() == Some("Rescaled")), "a Rescaled event per decision");

    // The leader stops (its pod deleted: it hands the lease over as it goes), then the next
    // one crashes (SIGKILL: no lease released, so the standby waits for it to expire). Each
    // time the standby leads within the lease time and the trainer only pauses.
    for graceful in [true, false] {
        // Two replicas again: the stopped one replaced (real pods) or restarted (local).
        cluster.operator_start(OperatorOptions::default().replicas(2)).await?;
        let old = super::operator::leader(cluster, None).await?;
        let since = Instant::now();
        cluster.operator_kill(&old.name, graceful).await?;
        // After a crash, the process the kubelet restarts in the same pod may lead next.
        let new = super::operator::leader(cluster, Some(&old.holder)).await?;
        let took = since.elapsed();
        let how = if graceful { "stopped" } else { "crashed" };
        eprintln!("  leader {} {how}: {} leads after {:.1} s", old.holder, new.holder, took.as_secs_f64());
        // A standby polls the lease every third of its duration.
        let bound = super::operator::LEASE + super::operator::LEASE / 3 + Duration::from_secs(5);
        ensure!(took <= bound, "after the leader {how}, the standby took {took:?} to lead, more than {bound:?}");
        keeps_training(Duration::from_secs(60), if graceful { "after the leader stopped" } else { "after it crashed" })
            .await?;
        trainer_ok()?;
    }

    // Kill workers mid-epoch; the epochs after it still deliver every element.
    let epoch_at_kill = seen.epochs.lock().unwrap().keys().max().copied().unwrap_or(0);
    let workers = format!("{NAME}-workers");
    match &kubelet {
        Some(kubelet) => ensure!(kubelet.kill_one(&workers), "no worker process to kill"),
        // Real pods: one deleted with no grace (the Deployment starts another), and another
        // crashed (SIGKILL where the harness owns the engine; the kubelet restarts it).
        None => {
            let deleted = stoker_e2e::k8s::delete_one_pod(&client, &ns, &workers).await?;
            let crashed = stoker_e2e::k8s::running_pod(&client, &ns, &workers, std::slice::from_ref(&deleted)).await?;
            cluster.crash_pod(&ns, &crashed).await?;
            eprintln!("  worker pod {deleted} deleted, {crashed} crashed");
        }
    }

    // No split lost: the epoch of the kill, and those after it, delivered every id.
    let complete = wait_for(Duration::from_secs(60), "an epoch after the kill to complete", || {
        let seen = seen.clone();
        async move {
            let epochs = seen.epochs.lock().unwrap();
            let last = epochs.keys().max().copied().unwrap_or(0);
            // The epoch in progress at the kill is the one that could lose a split. Workers
            // run at most one epoch ahead of the oldest unfinished one, so an epoch two
            // behind the newest is complete.
            let finished: Vec<u64> = epochs.keys().copied().filter(|e| *e >= epoch_at_kill && e + 1 < last).collect();
            Ok(if finished.is_empty() {
                let error = seen.error.lock().unwrap().clone();
                Check::not_yet(format!("epochs {:?}; trainer error: {error:?}", epochs.keys().collect::<Vec<_>>()))
            } else {
                Check::Done(finished)
            })
        }
    })
    .await?;
    ensure!(
        complete.iter().all(|&e| e > epoch_at_restart),
        "the epoch of the restart ({epoch_at_restart}) finished before the kill: both are checked"
    );
    // Every epoch the trainer finished: those of the scaling, the restart and the kill.
    let last = *complete.iter().max().expect("one at least");
    let epochs: Vec<(u64, BTreeMap<i64, u32>)> =
        seen.epochs.lock().unwrap().range(..=last).map(|(e, ids)| (*e, ids.clone())).collect();
    for (epoch, ids) in &epochs {
        let repeats: u32 = ids.values().map(|n| n - 1).sum();
        let got = ids.len() as i64;
        ensure!(
            got == SHARDS * LINES && repeats == 0,
            "epoch {epoch} delivered {got} of {} elements, {repeats} of them again (restart in epoch {epoch_at_restart}); missing: {}",
            SHARDS * LINES,
            missing(ids)
        );
    }
    trainer.abort();
    drop(kubelet);
    delete_namespace(&client, &ns, Duration::from_secs(120)).await
}
