//! DataPipelines through the operator: the samples become workers Deployments, Services and
//! the namespace's cache volume with an honest status; specs update and delete cleanly;
//! invalid specs are refused by the schema or marked Invalid; apply failures back off; and a
//! restarted operator writes nothing.

use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Event, PersistentVolumeClaim, Service};
use kube::api::{Api, ListParams};
use kube::{Resource, ResourceExt};
use stoker_api::{DataPipeline, Phase, condition};
use stoker_e2e::k8s::{delete_namespace, fresh_namespace, wait_until_gone};
use stoker_e2e::tools::workspace_root;
use stoker_e2e::{Check, Cluster, OperatorOptions, wait_for};

const TIMEOUT: Duration = Duration::from_secs(60);

/// (sample file, pipeline name, expected worker replicas, caches)
const SAMPLES: &[(&str, &str, i32, bool)] = &[
    ("manifests/samples/image-classification.yaml", "imagenet-train", 1, true),
    ("manifests/samples/text-jsonl.yaml", "corpus-jsonl", 2, false),
    ("manifests/samples/webdataset-fixed.yaml", "webdataset-eval", 4, true),
];

/// Invalid samples the API server's schema refuses: (file, a fragment of the error).
const SCHEMA_REFUSED: &[(&str, &str)] = &[
    ("manifests/samples/invalid/batchsize-zero.yaml", "batchSize"),
    ("manifests/samples/invalid/bad-enum.yaml", "Sometimes"),
    ("manifests/samples/invalid/two-keys-in-transform.yaml", "transforms"),
    ("manifests/samples/invalid/unknown-transform.yaml", "transforms"),
    ("manifests/samples/invalid/missing-source.yaml", "source"),
];

/// Invalid samples the operator marks Invalid: (file, pipeline name, a fragment of the message).
const OPERATOR_REFUSED: &[(&str, &str, &str)] = &[
    (
        "manifests/samples/invalid/min-greater-than-max.yaml",
        "invalid-min-greater-than-max",
        "min (5) is greater than max (2)",
    ),
    ("manifests/samples/invalid/unknown-scheme.yaml", "invalid-unknown-scheme", "unknown scheme \"ftp\""),
    ("manifests/samples/invalid/autocache-after-random.yaml", "invalid-autocache-after-random", "after the random op"),
    (
        "manifests/samples/invalid/fixed-without-replicas.yaml",
        "invalid-fixed-without-replicas",
        "mode Fixed needs replicas",
    ),
];

async fn apply_file(cluster: &dyn Cluster, ns: &str, file: &str) -> anyhow::Result<String> {
    cluster.kubectl(&["apply", "-n", ns, "-f", file]).await
}

/// Waits until the pipeline's status satisfies `done` for its current generation.
async fn wait_status(
    cluster: &dyn Cluster,
    ns: &str,
    name: &str,
    what: &str,
    done: impl Fn(&DataPipeline) -> bool,
) -> anyhow::Result<DataPipeline> {
    let api = Api::<DataPipeline>::namespaced(cluster.client(), ns);
    let done = &done;
    let api = &api;
    wait_for(TIMEOUT, format!("DataPipeline {ns}/{name}: {what}"), || async move {
        let dp = api.get(name).await?;
        let current = dp.status.as_ref().and_then(|s| s.observed_generation) == dp.metadata.generation;
        Ok(if current && done(&dp) { Check::Done(dp) } else { Check::not_yet(format!("status {:?}", dp.status)) })
    })
    .await
}

fn ready_condition(dp: &DataPipeline) -> Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    dp.status.as_ref()?.conditions.iter().find(|c| c.type_ == condition::READY)
}

async fn wait_deployment(cluster: &dyn Cluster, ns: &str, name: &str, replicas: i32) -> anyhow::Result<Deployment> {
    let api = Api::<Deployment>::namespaced(cluster.client(), ns);
    let api = &api;
    wait_for(TIMEOUT, format!("Deployment {ns}/{name} with {replicas} replicas"), || async move {
        Ok(match api.get_opt(name).await? {
            Some(d) if d.spec.replicas == Some(replicas) => Check::Done(d),
            Some(d) => Check::not_yet(format!("replicas {:?}", d.spec.replicas)),
            None => Check::not_yet("no Deployment yet"),
        })
    })
    .await
}

/// A value from the leader's /metrics: the sum of every series of `name` whose labels contain `labels`.
async fn leader_metric(cluster: &dyn Cluster, name: &str, labels: &str) -> anyhow::Result<f64> {
    let leader = cluster.operator_leader().await?.context("no operator leads")?;
    let body = cluster.operator_get(&leader, "/metrics").await?.body;
    Ok(body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(series, _)| (series == &name || series.starts_with(&format!("{name}{{"))) && series.contains(labels))
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .sum())
}

pub async fn samples_become_workers(cluster: &dyn Cluster) -> anyhow::Result<()> {
    cluster.operator_start(OperatorOptions::default()).await?;
    let client = cluster.client();
    let ns = fresh_namespace(&client, "e2e-samples").await?;
    for (file, _, _, _) in SAMPLES {
        apply_file(cluster, &ns, file).await?;
    }
    for &(_, name, replicas, caches) in SAMPLES {
        let dp = wait_status(cluster, &ns, name, "phase Pending with its workers counted", |dp| {
            let s = dp.status.as_ref().unwrap();
            s.phase == Some(Phase::Pending) && s.workers.as_ref().is_some_and(|w| w.desired == replicas)
        })
        .await?;
        let uid = dp.uid().context("pipeline uid")?;
        let workers = format!("{name}-workers");

        let deployment = wait_deployment(cluster, &ns, &workers, replicas).await?;
        let owner = deployment.owner_references().first().context("Deployment has an owner")?;
        ensure!(owner.uid == uid && owner.controller == Some(true), "Deployment owner {owner:?}");
        let pod = deployment.spec.template.spec.as_ref().context("pod spec")?;
        let env = pod.containers[0].env.as_ref().context("worker env")?;
        let pipeline = env.iter().find(|e| e.name == "STOKER_PIPELINE").and_then(|e| e.value.clone());
        ensure!(
            pipeline.as_deref().is_some_and(|p| p.contains(&format!("\"name\":\"{name}\""))),
            "the worker gets its pipeline: {pipeline:?}"
        );
        ensure!(
            pod.volumes
                .iter()
                .flatten()
                .any(|v| v.persistent_volume_claim.as_ref().is_some_and(|c| c.claim_name == "stoker-cache"))
                == caches,
            "cache volume mounted iff the pipeline caches"
        );
        // The sample's own volume (the text corpus's claim) survives the API server's schema and
        // reaches the pod.
        let mounts = pod.containers[0].volume_mounts.iter().flatten();
        let mounted: Vec<(&str, &str)> = mounts.map(|m| (m.name.as_str(), m.mount_path.as_str())).collect();
        let claims: Vec<&str> = pod
            .volumes
            .iter()
            .flatten()
            .filter_map(|v| Some(v.persistent_volume_claim.as_ref()?.claim_name.as_str()))
            .collect();
        let reads_corpus = mounted.contains(&("data", "/data")) && claims.contains(&"corpus");
        ensure!(reads_corpus == (name == "corpus-jsonl"), "{name}: mounts {mounted:?}, claims {claims:?}");

        let service = Api::<Service>::namespaced(client.clone(), &ns).get(&workers).await?;
        let spec = service.spec.as_ref().context("service spec")?;
        ensure!(spec.cluster_ip.as_deref() == Some("None"), "workers Service is headless");
        ensure!(
            spec.selector.as_ref() == deployment.spec.selector.match_labels.as_ref(),
            "Service selects the workers"
        );
        ensure!(service.owner_references().first().is_some_and(|o| o.uid == uid), "Service is owned by the pipeline");

        let ready = ready_condition(&dp).context("Ready condition")?;
        ensure!(ready.status == "False" && ready.reason == "WorkersNotReady", "{ready:?}");
        let summary = &dp.status.as_ref().unwrap().workers.as_ref().unwrap().summary;
        ensure!(summary.ends_with(&format!("/{replicas}")), "workers summary {summary}");
    }

    // The ops beyond the built-in image and record ones (python, tokenize, pack) and a mix of
    // sources survive the API server's structural schema with every field, and the operator
    // takes them.
    for file in ["manifests/samples/image-python-augment.yaml", "manifests/samples/llm-pretraining.yaml"] {
        apply_file(cluster, &ns, file).await?;
        let want = stoker_api::parse_manifest(&std::fs::read_to_string(workspace_root().join(file))?)?;
        let name = want.name_any();
        let got = wait_status(cluster, &ns, &name, "phase Pending", |dp| {
            dp.status.as_ref().and_then(|s| s.phase) == Some(Phase::Pending)
        })
        .await?;
        ensure!(
            got.spec.data_plane.transforms == want.spec.data_plane.transforms,
            "{name}: the API server kept {:?} of {:?}",
            got.spec.data_plane.transforms,
            want.spec.data_plane.transforms
        );
        ensure!(got.spec.data_plane.source == want.spec.data_plane.source, "{name}: {:?}", got.spec.data_plane.source);
        // The status lists a mix's sources with their normalised weights before any worker runs.
        let mix: Vec<(String, f64)> =
            got.status.iter().flat_map(|s| s.mix.iter().map(|m| (m.uri.clone(), m.weight))).collect();
        let expected: Vec<(String, f64)> =
            want.spec.data_plane.source.mix.iter().map(|m| (m.uri.clone(), m.weight)).collect();
        ensure!(mix == expected, "{name}: status.mix {mix:?}, weights {expected:?}");
    }

    // One shared cache volume for the namespace, owned by no pipeline.
    let pvcs = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns).list(&ListParams::default()).await?;
    let names: Vec<_> = pvcs.items.iter().map(|p| p.name_any()).collect();
    ensure!(names == ["stoker-cache"], "one cache PVC per namespace, got {names:?}");
    ensure!(pvcs.items[0].owner_references().is_empty(), "the cache PVC outlives pipelines");

    // `kubectl get dp` fills the printer columns.
    let table = cluster.kubectl(&["get", "dp", "-n", &ns]).await?;
    eprintln!("{table}");
    let header = table.lines().next().unwrap_or_default();
    for column in ["WORKERS", "BATCH TIME", "CACHE", "PHASE", "AGE"] {
        ensure!(header.contains(column), "column {column} in {header:?}");
    }
    let row = |name: &str| table.lines().find(|l| l.starts_with(name)).unwrap_or_default().to_string();
    ensure!(row("imagenet-train").contains("/1") && row("imagenet-train").contains("Undecided"), "{table}");
    ensure!(row("corpus-jsonl").contains("Compute") && row("corpus-jsonl").contains("Pending"), "{table}");

    delete_namespace(&client, &ns, Duration::from_secs(120)).await
}

pub async fn spec_changes_and_deletion(cluster: &dyn Cluster) -> anyhow::Result<()> {
    cluster.operator_start(OperatorOptions::default()).await?;
    let client = cluster.client();
    let ns = fresh_namespace(&client, "e2e-update").await?;
    apply_file(cluster, &ns, "manifests/samples/image-classification.yaml").await?;
    wait_deployment(cluster, &ns, "imagenet-train-workers", 1).await?;

    // A scaling change reaches the Deployment; a data-plane change reaches the workers' pipeline.
    cluster
        .kubectl(&[
            "patch",
            "dp",
            "imagenet-train",
            "-n",
            &ns,
            "--type=merge",
            "-p",
            r#"{"spec":{"workers":{"min":3},"batchSize":128}}"#,
        ])
        .await?;
    let deployment = wait_deployment(cluster, &ns, "imagenet-train-workers", 3).await?;
    let env = deployment.spec.template.spec.as_ref().unwrap().containers[0].env.clone().unwrap_or_default();
    let pipeline = env.iter().find(|e| e.name == "STOKER_PIPELINE").and_then(|e| e.value.clone()).unwrap_or_default();
    ensure!(pipeline.contains("\"batchSize\":128"), "workers see the new batch size: {pipeline}");
    let dp = wait_status(cluster, &ns, "imagenet-train", "3 workers desired", |dp| {
        dp.status.as_ref().unwrap().workers.as_ref().is_some_and(|w| w.desired == 3)
    })
    .await?;
    ensure!(dp.status.unwrap().observed_generation == dp.metadata.generation, "observedGeneration follows");

    // Deleting the pipeline garbage-collects its objects and keeps the namespace's cache volume.
    cluster.kubectl(&["delete", "dp", "imagenet-train", "-n", &ns, "--wait=true"]).await?;
    wait_until_gone(&Api::<Deployment>::namespaced(client.clone(), &ns), "imagenet-train-workers", TIMEOUT).await?;
    wait_until_gone(&Api::<Service>::namespaced(client.clone(), &ns), "imagenet-train-workers", TIMEOUT).await?;
    ensure!(
        Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns).get_opt("stoker-cache").await?.is_some(),
        "the cache volume survives the pipeline"
    );
    delete_namespace(&client, &ns, Duration::from_secs(120)).await
}

pub async fn invalid_specs_are_refused(cluster: &dyn Cluster) -> anyhow::Result<()> {
    cluster.operator_start(OperatorOptions::default()).await?;
    let client = cluster.client();
    let ns = fresh_namespace(&client, "e2e-invalid").await?;
    let dps = Api::<DataPipeline>::namespaced(client.clone(), &ns);

    for (file, fragment) in SCHEMA_REFUSED {
        // Server-side: kubectl's own client-side checks must not be what refuses it.
        let result = cluster.kubectl(&["apply", "-n", &ns, "--validate=false", "-f", file]).await;
        match result {
            Ok(out) => bail!("{file} should be refused by the CRD schema, but kubectl said: {out}"),
            Err(e) => ensure!(format!("{e:#}").contains(fragment), "{file}: error should mention {fragment}: {e:#}"),
        }
    }
    ensure!(dps.list(&ListParams::default()).await?.items.is_empty(), "nothing refused was stored");

    for (file, _, _) in OPERATOR_REFUSED {
        apply_file(cluster, &ns, file).await?;
    }
    for &(_, name, fragment) in OPERATOR_REFUSED {
        let dp = wait_status(cluster, &ns, name, "phase Invalid", |dp| {
            dp.status.as_ref().unwrap().phase == Some(Phase::Invalid)
        })
        .await?;
        let ready = ready_condition(&dp).context("Ready condition")?;
        ensure!(ready.reason == "InvalidSpec" && ready.message.contains(fragment), "{name}: {ready:?}");
        ensure!(
            Api::<Deployment>::namespaced(client.clone(), &ns).get_opt(&format!("{name}-workers")).await?.is_none(),
            "{name}: nothing is applied for an invalid spec"
        );
        let events = Api::<Event>::namespaced(client.clone(), &ns);
        let uid = dp.meta().uid.clone();
        wait_for(TIMEOUT, format!("a Warning InvalidSpec event for {name}"), || {
            let events = events.clone();
            let uid = uid.clone();
            async move {
                let list = events.list(&ListParams::default()).await?;
                Ok(
                    match list
                        .items
                        .iter()
                        .find(|e| e.involved_object.uid == uid && e.reason.as_deref() == Some("InvalidSpec"))
                    {
                        Some(e) if e.type_.as_deref() == Some("Warning") => Check::Done(()),
                        _ => Check::not_yet(format!("{} events", list.items.len())),
                    },
                )
            }
        })
        .await?;
    }

    // Invalid pipelines wait for a spec change instead of retrying.
    let before = leader_metric(cluster, "stoker_reconciles_total", "").await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = leader_metric(cluster, "stoker_reconciles_total", "").await?;
    ensure!(after - before <= 2.0, "no hot loop on invalid specs: {before} -> {after} reconciles in 5 s");

    // Fixing the spec is all it takes.
    cluster
        .kubectl(&[
            "patch",
            "dp",
            "invalid-min-greater-than-max",
            "-n",
            &ns,
            "--type=merge",
            "-p",
            r#"{"spec":{"workers":{"max":6}}}"#,
        ])
        .await?;
    wait_deployment(cluster, &ns, "invalid-min-greater-than-max-workers", 5).await?;
    wait_status(cluster, &ns, "invalid-min-greater-than-max", "phase Pending after the fix", |dp| {
        dp.status.as_ref().unwrap().phase == Some(Phase::Pending)
    })
    .await?;
    delete_namespace(&client, &ns, Duration::from_secs(120)).await
}

pub async fn apply_failures_degrade_and_back_off(cluster: &dyn Cluster) -> anyhow::Result<()> {
    cluster.operator_start(OperatorOptions::default()).await?;
    let client = cluster.client();
    let ns = fresh_namespace(&client, "e2e-degraded").await?;
    // The schema takes any quantity; the Deployment's own validation refuses a negative one.
    let manifest = r#"
apiVersion: stoker.dev/v1alpha1
kind: DataPipeline
metadata: {name: negative-cpu}
spec:
  source: {uri: "file:///data/x", format: jsonl}
  batchSize: 8
  workers: {resources: {requests: {cpu: "-1"}}}
"#;
    let failures_before = leader_metric(cluster, "stoker_reconcile_failures_total", "error=\"apply\"").await?;
    cluster.kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], manifest).await?;
    let dp = wait_status(cluster, &ns, "negative-cpu", "phase Degraded", |dp| {
        dp.status.as_ref().unwrap().phase == Some(Phase::Degraded)
    })
    .await?;
    let degraded = dp.status.as_ref().unwrap().conditions.iter().find(|c| c.type_ == condition::DEGRADED).cloned();
    let degraded = degraded.context("Degraded condition")?;
    ensure!(degraded.status == "True" && degraded.reason == "ApplyFailed", "{degraded:?}");
    ensure!(degraded.message.contains("negative-cpu-workers"), "the message names the object: {}", degraded.message);

    // Exponential backoff (1 s, 2 s, 4 s, ...): a handful of retries in 10 s, not a hot loop.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let failures =
        leader_metric(cluster, "stoker_reconcile_failures_total", "error=\"apply\"").await? - failures_before;
    ensure!((1.0..=7.0).contains(&failures), "{failures} failed applies in ~10 s: expected backoff");
    delete_namespace(&client, &ns, Duration::from_secs(120)).await
}

pub async fn restart_writes_nothing(cluster: &dyn Cluster) -> anyhow::Result<()> {
    cluster.operator_start(OperatorOptions::default()).await?;
    let client = cluster.client();
    let ns = fresh_namespace(&client, "e2e-restart").await?;
    for (file, _, _, _) in SAMPLES {
        apply_file(cluster, &ns, file).await?;
    }
    apply_file(cluster, &ns, OPERATOR_REFUSED[0].0).await?;
    for &(_, name, replicas, _) in SAMPLES {
        wait_status(cluster, &ns, name, "settled", |dp| {
            dp.status.as_ref().unwrap().workers.as_ref().is_some_and(|w| w.desired == replicas)
        })
        .await?;
    }
    wait_status(cluster, &ns, OPERATOR_REFUSED[0].1, "Invalid", |dp| {
        dp.status.as_ref().unwrap().phase == Some(Phase::Invalid)
    })
    .await?;

    let versions = || async {
        let mut all = Vec::new();
        let lp = ListParams::default();
        for o in Api::<DataPipeline>::namespaced(client.clone(), &ns).list(&lp).await?.items {
            all.push((format!("dp/{}", o.name_any()), o.resource_version()));
        }
        for o in Api::<Deployment>::namespaced(client.clone(), &ns).list(&lp).await?.items {
            all.push((format!("deployment/{}", o.name_any()), o.resource_version()));
        }
        for o in Api::<Service>::namespaced(client.clone(), &ns).list(&lp).await?.items {
            all.push((format!("service/{}", o.name_any()), o.resource_version()));
        }
        for o in Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns).list(&lp).await?.items {
            all.push((format!("pvc/{}", o.name_any()), o.resource_version()));
        }
        anyhow::Ok(all)
    };
    let before = versions().await?;

    cluster.operator_restart().await?;
    // The new leader has looked at every pipeline of the namespace (and all others).
    let pipelines = Api::<DataPipeline>::all(client.clone()).list(&ListParams::default()).await?.items.len() as f64;
    wait_for(TIMEOUT, format!("the restarted operator to reconcile all {pipelines} pipelines"), || async move {
        let n = leader_metric(cluster, "stoker_reconciles_total", "").await.unwrap_or(0.0);
        Ok(if n >= pipelines { Check::Done(()) } else { Check::not_yet(format!("{n} reconciles")) })
    })
    .await?;
    // Give a straggling write time to land before comparing.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = versions().await?;
    ensure!(before == after, "a restart must not write: before {before:?}\nafter {after:?}");
    delete_namespace(&client, &ns, Duration::from_secs(120)).await
}

pub async fn long_names_fit(cluster: &dyn Cluster) -> anyhow::Result<()> {
    cluster.operator_start(OperatorOptions::default()).await?;
    let client = cluster.client();
    let ns = fresh_namespace(&client, "e2e-names").await?;
    // A valid DataPipeline name (DNS subdomain, up to 253 characters) that is no valid Service name.
    let name = format!("{}.imagenet.{}", "a".repeat(100), "b".repeat(100));
    let manifest = format!(
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {{name: {name}}}\nspec:\n  \
         source: {{uri: 'file:///data/x', format: jsonl}}\n  batchSize: 8\n"
    );
    cluster.kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &manifest).await?;
    let dp = wait_status(cluster, &ns, &name, "phase Pending", |dp| {
        dp.status.as_ref().unwrap().phase == Some(Phase::Pending)
    })
    .await?;
    let uid = dp.uid();
    let deployments = Api::<Deployment>::namespaced(client.clone(), &ns).list(&ListParams::default()).await?.items;
    let owned: Vec<_> = deployments
        .iter()
        .filter(|d| d.owner_references().iter().any(|o| Some(&o.uid) == uid.as_ref()))
        .map(|d| d.name_any())
        .collect();
    ensure!(owned.len() == 1, "one workers Deployment for the long-named pipeline, got {owned:?}");
    ensure!(owned[0].len() <= 63 && owned[0].ends_with("-workers"), "Deployment name {:?}", owned[0]);
    let service = Api::<Service>::namespaced(client.clone(), &ns).get_opt(&owned[0]).await?;
    ensure!(service.is_some(), "the Service has the same 63-character name");
    delete_namespace(&client, &ns, Duration::from_secs(120)).await
}
