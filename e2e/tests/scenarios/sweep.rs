//! A hyperparameter sweep through the real control loop (docs/reuse.md): four trials, each its
//! own job, name one share group and read three epochs from the pipeline's two workers (pods on
//! the kubelet provider, processes the harness runs for the Deployment on the local one) at
//! 1x, 1x, 0.7x and 0.4x speed. The second 1x trial joins when the first begins its second
//! epoch; a worker is killed when the first trial is half-way through its second epoch, and the
//! 0.4x trial is dropped half-way through its own second (a trial that crashed: no goodbye). Every trial
//! gets every record of each epoch it finished once, the DataPipeline's status lists the group's
//! jobs and shows the splits they shared, and the fast trials never pause for the others.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use kube::api::{Api, Patch, PatchParams};
use stoker_api::DataPipeline;
use stoker_client::{Client, ClientOptions};
use stoker_e2e::k8s::{delete_namespace, fresh_namespace};
use stoker_e2e::{Check, Cluster, OperatorOptions, wait_for};

const SHARDS: i64 = 16;
const LINES: i64 = 150;
const EPOCHS: u64 = 3;
const NAME: &str = "sweep-input";
const GROUP: &str = "sweep-42";
/// The 1x trainer's step per batch of 10: slower than the workers' cap (2 x 25 batches/s per
/// job), so the trainers set the pace.
const STEP: Duration = Duration::from_millis(30);

/// What one trial read: records per epoch, and the longest wait for a batch before the worker
/// was killed (an epoch's first excepted: workers start, epochs turn).
#[derive(Default)]
struct Trial {
    epochs: Mutex<BTreeMap<u64, BTreeMap<i64, u32>>>,
    longest: Mutex<Duration>,
    /// Set when the worker is killed: waits after it are for the killed worker's splits.
    killed: Arc<AtomicBool>,
    /// Half-way through its second epoch (the one it began second).
    half_of_second: AtomicBool,
    began_second: AtomicBool,
}

impl Trial {
    /// Every record once in each epoch it finished (all `EPOCHS`, or `finished` of them).
    fn check(&self, name: &str, finished: usize) -> anyhow::Result<()> {
        let epochs = self.epochs.lock().unwrap();
        ensure!(epochs.len() >= finished, "{name}: read {} epochs, {finished} expected", epochs.len());
        for (epoch, ids) in epochs.iter().take(finished) {
            let repeats: u32 = ids.values().map(|n| n - 1).sum();
            ensure!(
                ids.len() as i64 == SHARDS * LINES && repeats == 0,
                "{name}: epoch {epoch} got {} of {} records, {repeats} of them again",
                ids.len(),
                SHARDS * LINES
            );
        }
        Ok(())
    }
}

/// Reads `EPOCHS` epochs at `speed`, recording into `trial`.
async fn train(url: String, options: ClientOptions, speed: f64, trial: Arc<Trial>) -> anyhow::Result<()> {
    let mut client = Client::from_dispatcher(&url, options).await?;
    for index in 0..EPOCHS {
        let epoch = client.epoch();
        if index == 1 {
            trial.began_second.store(true, Ordering::Relaxed);
        }
        let mut first = true;
        loop {
            let asked = Instant::now();
            let Some(batch) = client.next_in_epoch().await else { break };
            let waited = asked.elapsed();
            if !std::mem::take(&mut first) && !trial.killed.load(Ordering::Relaxed) {
                let mut longest = trial.longest.lock().unwrap();
                *longest = (*longest).max(waited);
            }
            let batch = batch?;
            let ids = batch.tensors["id"].data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()));
            let read = {
                let mut epochs = trial.epochs.lock().unwrap();
                let seen = epochs.entry(epoch).or_default();
                for id in ids {
                    *seen.entry(id).or_default() += 1;
                }
                seen.len() as i64
            };
            if index == 1 && read >= SHARDS * LINES / 2 {
                trial.half_of_second.store(true, Ordering::Relaxed);
            }
            tokio::time::sleep(STEP.div_f64(speed)).await;
        }
    }
    client.close(Duration::from_secs(5)).await;
    Ok(())
}

/// Waits for a trial's progress `flag`, checked every 20 ms: the faults are aimed at it
/// (`wait_for` backs off between checks, which would land them late).
async fn until(what: &str, flag: impl Fn() -> bool) -> anyhow::Result<()> {
    let waiting = async {
        while !flag() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(120), waiting).await.with_context(|| format!("{what} within 120 s"))
}

pub async fn sweep_shares_one_production(cluster: &dyn Cluster) -> anyhow::Result<()> {
    let Some(url) = super::dispatcher_or_skip(cluster, "sweep_shares_one_production") else { return Ok(()) };
    cluster.operator_start(OperatorOptions::default()).await?;
    let client = cluster.client();
    let ns = fresh_namespace(&client, "e2e-sweep").await?;
    let kubelet = cluster.run_workers(&ns)?;
    let data = cluster.workdir().join(format!("{ns}-data"));
    super::write_id_corpus(&data, SHARDS, LINES)?;
    let seen_as = cluster.worker_data(&data);
    let manifest = format!(
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {{name: {NAME}}}\nspec:\n  \
         source: {{uri: 'file://{}/', format: jsonl}}\n  batchSize: 10\n  shuffle: {{bufferSize: 200}}\n  \
         workers: {{min: 2, max: 2, env: [{{name: STOKER_MAX_BATCH_RATE, value: '25'}}]{}}}\n  \
         autoscaling: {{policy: {{windowSeconds: 2}}}}\n",
        seen_as.path,
        seen_as.more_fields()
    );
    let dp: DataPipeline = serde_yaml::from_str(&manifest)?;
    let pipelines = Api::<DataPipeline>::namespaced(client.clone(), &ns);
    pipelines.patch(NAME, &PatchParams::apply("e2e").force(), &Patch::Apply(&dp)).await?;

    let options = stoker_e2e::tenants::reader_options(&client, &ns, NAME).await?;
    let killed = Arc::new(AtomicBool::new(false));
    let trial = |job: &str, speed: f64| {
        let options = ClientOptions { job: job.into(), share: Some(GROUP.into()), prefetch: 4, ..options.clone() };
        let state = Arc::new(Trial { killed: killed.clone(), ..Trial::default() });
        (state.clone(), tokio::spawn(train(url.clone(), options, speed, state)))
    };
    let (a, a_run) = trial("trial-a", 1.0);
    let (c, c_run) = trial("trial-c", 0.7);
    let (d, d_run) = trial("trial-d", 0.4);
    until("trial-a to begin its second epoch", || a.began_second.load(Ordering::Relaxed)).await?;
    let (b, b_run) = trial("trial-b", 1.0);

    // The group in status: its four jobs, each with the group.
    let pipelines = &pipelines;
    wait_for(Duration::from_secs(60), "status to list the group's four jobs", || async move {
        let status = pipelines.get(NAME).await?.status.unwrap_or_default();
        let jobs: Vec<_> =
            status.jobs.iter().map(|j| (j.name.to_string(), j.share.as_ref().map(|s| s.to_string()))).collect();
        let expected: Vec<_> = ["trial-a", "trial-b", "trial-c", "trial-d"]
            .iter()
            .map(|j| (j.to_string(), Some(GROUP.to_string())))
            .collect();
        Ok(if jobs == expected { Check::Done(()) } else { Check::not_yet(format!("jobs {jobs:?}")) })
    })
    .await?;

    until("trial-a to be half-way through its second epoch", || a.half_of_second.load(Ordering::Relaxed)).await?;
    let workers = format!("{NAME}-workers");
    killed.store(true, Ordering::Relaxed);
    match &kubelet {
        Some(kubelet) => ensure!(kubelet.kill_one(&workers), "no worker process to kill"),
        None => {
            let pod = stoker_e2e::k8s::running_pod(&client, &ns, &workers, &[]).await?;
            cluster.crash_pod(&ns, &pod).await?;
            eprintln!("  worker pod {pod} crashed");
        }
    }
    until("trial-d to be half-way through its second epoch", || d.half_of_second.load(Ordering::Relaxed)).await?;
    d_run.abort();

    for (name, run) in [("trial-a", a_run), ("trial-b", b_run), ("trial-c", c_run)] {
        tokio::time::timeout(Duration::from_secs(180), run)
            .await
            .with_context(|| format!("{name} did not finish its epochs within 180 s"))?
            .with_context(|| format!("{name}'s task"))?
            .with_context(|| format!("{name}: an error reached the training loop"))?;
    }
    for (name, trial) in [("trial-a", &a), ("trial-b", &b), ("trial-c", &c)] {
        trial.check(name, EPOCHS as usize)?;
    }
    d.check("trial-d", 1)?;
    // The 1x trials never paused for the slower ones before the kill (after it, a trial waits
    // for the killed worker's splits to be made again on the other).
    for (name, trial) in [("trial-a", &a), ("trial-b", &b)] {
        let longest = *trial.longest.lock().unwrap();
        ensure!(longest < Duration::from_secs(4), "{name} waited {longest:?} for a batch");
    }

    // Status shows what the group shared.
    let delivery = wait_for(Duration::from_secs(30), "status to show the group's shared splits", || async move {
        let status = pipelines.get(NAME).await?.status.unwrap_or_default();
        let delivery = status.delivery.unwrap_or_default();
        Ok(if delivery.shared_deliveries > delivery.shared_productions && delivery.shared_productions > 0 {
            Check::Done(delivery)
        } else {
            Check::not_yet(format!("{delivery:?}"))
        })
    })
    .await?;
    eprintln!(
        "  four trials, one group: {} productions delivered {} times, {} missed by a slower trial and made again; \
         longest waits before the kill trial-a {:?}, trial-b {:?}",
        delivery.shared_productions,
        delivery.shared_deliveries,
        delivery.shared_missed,
        a.longest.lock().unwrap(),
        b.longest.lock().unwrap()
    );
    drop(kubelet);
    delete_namespace(&client, &ns, Duration::from_secs(120)).await
}
