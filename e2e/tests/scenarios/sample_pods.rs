//! The samples as real pods: each sample in manifests/samples runs as Ready worker pods that
//! serve batches through the dispatcher Service. Needs a kubelet (kind, kubelet providers).
//!
//! The samples name data this machine cannot reach (S3, GCS) and resources it does not have
//! (4 CPUs per worker on a 2-core node), so each is applied as a user trying it on a laptop
//! would: `text-jsonl` unchanged, on a `corpus` claim holding JSONL; the others with their
//! source pointed at local files of the same format and their resource requests dropped.
//! Everything else (transforms, batch size, autoscaling, cache, replicas) is the sample's own.
//! `image-python-augment` runs on the worker image with Python (`stoker-worker-python`, built
//! here by the Dockerfile's `worker-python` target) with its code from the ConfigMap its
//! comments say to create. Its batch shows the op ran in the pod: a worker that cannot start
//! its Python or import the module stops at startup, and a call that fails drops its element.
//! The Parquet samples: `dlrm-criteo` over a Criteo-style table written here (label, 13 counts,
//! 26 categories, nulls in each), its batch of 2048 checked for the shapes the sample's
//! comments promise; `llm-pretraining-parquet` unchanged, on the `corpus` claim holding its
//! two sources' Parquet files and a word-level tokenizer.json, its batch 256 rows of 2048 ids.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, PostParams};
use serde_yaml::{Mapping, Value};
use stoker_api::{DataPipeline, condition};
use stoker_client::Client;
use stoker_e2e::in_cluster::{REPOSITORY, TAG};
use stoker_e2e::k8s::{delete_namespace, fresh_namespace};
use stoker_e2e::tools::{Cmd, image_binary, workspace_root};
use stoker_e2e::{Check, Cluster, OperatorOptions, WorkerData, wait_for};

/// Time for a sample's pods to start and become Ready (images are local; the pipeline's source
/// is listed and the worker registers first).
const READY_TIMEOUT: Duration = Duration::from_secs(180);
/// JPEGs written for the image samples: more than the larger batch size (256).
const IMAGES: usize = 300;

/// (sample file, pipeline name, worker pods, the field every batch carries)
const SAMPLES: &[(&str, &str, i32, &str)] = &[
    ("manifests/samples/image-classification.yaml", "imagenet-train", 1, "image"),
    ("manifests/samples/text-jsonl.yaml", "corpus-jsonl", 2, "input_text"),
    ("manifests/samples/webdataset-fixed.yaml", "webdataset-eval", 4, "jpg"),
    ("manifests/samples/image-python-augment.yaml", PYTHON_SAMPLE, 1, "image"),
    ("manifests/samples/dlrm-criteo.yaml", "dlrm-criteo", 1, "dense"),
    ("manifests/samples/llm-pretraining-parquet.yaml", "llm-pretraining-parquet", 1, "input_ids"),
];
/// The sample with a `python` op.
const PYTHON_SAMPLE: &str = "imagenet-python-augment";

pub async fn samples_run_as_pods(cluster: &dyn Cluster) -> anyhow::Result<()> {
    if !cluster.provider().real_pods() {
        println!(
            "samples_run_as_pods SKIPPED on the {} provider: it has no kubelet to run pods (samples_become_workers \
             covers the objects)",
            cluster.provider()
        );
        return Ok(());
    }
    let url = cluster.dispatcher_url()?;
    cluster.operator_start(OperatorOptions::default()).await?;
    let client = cluster.client();
    let ns = fresh_namespace(&client, "e2e-sample-pods").await?;

    // Local data in each sample's format.
    let data = cluster.workdir().join(format!("{ns}-data"));
    write_images(&data.join("images"))?;
    write_webdataset(&data.join("images"), &data.join("webdataset")).await?;
    write_criteo(&data.join("criteo"))?;
    let seen_as = cluster.worker_data(&data);
    // text-jsonl reads its own claim `corpus` at /data/corpus/.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    let corpus: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "corpus"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }))?;
    claims.create(&PostParams::default(), &corpus).await?;
    let claim_dir = wait_for(Duration::from_secs(60), "the corpus claim to be bound", || async {
        match cluster.claim_dir(&ns, "corpus").await {
            Ok(dir) => Ok(Check::Done(dir)),
            Err(e) => Ok(Check::not_yet(format!("{e:#}"))),
        }
    })
    .await?;
    write_jsonl(&claim_dir.join("corpus"))?;
    write_text_parquet(&claim_dir)?;

    for &(file, name, _, _) in SAMPLES {
        let yaml = std::fs::read_to_string(workspace_root().join(file)).with_context(|| file.to_string())?;
        let mut sample: Value = serde_yaml::from_str(&yaml)?;
        let uri = match name {
            "imagenet-train" | PYTHON_SAMPLE => Some(format!("file://{}/images/", seen_as.path)),
            "webdataset-eval" => Some(format!("file://{}/webdataset/", seen_as.path)),
            "dlrm-criteo" => Some(format!("file://{}/criteo/", seen_as.path)),
            _ => None,
        };
        if let Some(uri) = uri {
            on_this_machine(&mut sample, &uri, &seen_as)?;
        }
        if name == PYTHON_SAMPLE {
            python_here(cluster, &ns, &mut sample).await?;
        }
        cluster.kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &serde_yaml::to_string(&sample)?).await?;
    }

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let pipelines: Api<DataPipeline> = Api::namespaced(client.clone(), &ns);
    for &(_, name, pods, field) in SAMPLES {
        let workers = format!("{name}-workers");
        let (deployments, pipelines, workers) = (&deployments, &pipelines, &workers);
        wait_for(READY_TIMEOUT, format!("{name}: {pods} Ready worker pods, and the pipeline Ready"), || async move {
            let ready = deployments.get_opt(workers).await?.and_then(|d| d.status).and_then(|s| s.ready_replicas);
            let dp = pipelines.get(name).await?;
            let condition = dp.status.iter().flat_map(|s| s.conditions.iter()).find(|c| c.type_ == condition::READY);
            let dp_ready = condition.is_some_and(|c| c.status == "True");
            Ok(if ready == Some(pods) && dp_ready {
                Check::Done(())
            } else {
                Check::not_yet(format!(
                    "ready pods {ready:?}, Ready condition {:?}",
                    condition.map(|c| (&c.status, &c.message))
                ))
            })
        })
        .await?;

        // And they serve: one batch through the dispatcher Service.
        let mut reader =
            Client::from_dispatcher(&url, stoker_e2e::tenants::reader_options(&client, &ns, name).await?).await?;
        let batch = tokio::time::timeout(Duration::from_secs(120), reader.next())
            .await
            .with_context(|| format!("{name}: no batch within 120 s"))?
            .with_context(|| format!("{name}: the stream ended before a batch"))??;
        let tensor = batch.tensors.get(field).with_context(|| {
            format!("{name}: the batch has no {field:?}: {:?}", batch.tensors.keys().collect::<Vec<_>>())
        })?;
        ensure!(tensor.shape.first().is_some_and(|&n| n > 0), "{name}: an empty batch: shape {:?}", tensor.shape);
        let promised: &[usize] = match name {
            "dlrm-criteo" => &[2048, 13],
            "llm-pretraining-parquet" => &[256, 2048],
            _ => &[],
        };
        ensure!(
            promised.is_empty() || tensor.shape == promised,
            "{name}: {field} is {:?}, the sample says {promised:?}",
            tensor.shape
        );
        eprintln!("  {name}: {pods} pods Ready; a batch with {field} {:?}", tensor.shape);
    }
    delete_namespace(&client, &ns, Duration::from_secs(120)).await
}

/// Points a sample at `uri` as `data` is seen by workers, drops what this machine cannot
/// provide (credentials for a cloud store, resource requests beyond its cores).
fn on_this_machine(sample: &mut Value, uri: &str, data: &WorkerData) -> anyhow::Result<()> {
    let spec = sample.get_mut("spec").and_then(Value::as_mapping_mut).context("a sample without spec")?;
    let source = spec.get_mut("source").and_then(Value::as_mapping_mut).context("a sample without source")?;
    source.insert("uri".into(), uri.into());
    source.remove("credentialsSecret");
    let workers = spec.entry("workers".into()).or_insert_with(|| Value::Mapping(Mapping::new()));
    let workers = workers.as_mapping_mut().context("spec.workers is not a mapping")?;
    workers.remove("resources");
    let access: Mapping = serde_yaml::from_str(&format!("{{{}}}", data.fields))?;
    for (key, value) in access {
        match (workers.get_mut(&key), value) {
            (Some(Value::Sequence(have)), Value::Sequence(more)) => have.extend(more),
            (None, value) => {
                workers.insert(key, value);
            }
            (Some(_), _) => bail!("spec.workers.{key:?} is not a list"),
        }
    }
    Ok(())
}

/// The Python sample as its comments say to run it: its code in the ConfigMap `augment-code`,
/// and the worker image with Python built here.
async fn python_here(cluster: &dyn Cluster, ns: &str, sample: &mut Value) -> anyhow::Result<()> {
    let code = workspace_root().join("manifests/samples/python/augment.py");
    let configmap = format!("--from-file={}", code.display());
    cluster.kubectl(&["create", "configmap", "augment-code", "-n", ns, &configmap]).await?;
    let image = format!("{REPOSITORY}/stoker-worker-python:{TAG}");
    let workers = sample.get_mut("spec").and_then(|s| s.get_mut("workers")).and_then(Value::as_mapping_mut);
    workers.context("the python sample has spec.workers")?.insert("image".into(), image.into());
    Ok(())
}

/// An ImageNet-like folder of JPEGs (`<class>/<n>.jpg`), by the worker's own generator.
fn write_images(dir: &Path) -> anyhow::Result<()> {
    // The build the images were made from (the worker crate is optimised in either).
    let worker = image_binary("stoker-worker")?;
    let out = std::process::Command::new(&worker)
        .args(["corpus", "--classes", "3", "--images", &IMAGES.to_string(), "--out"])
        .arg(dir)
        .output()
        .with_context(|| format!("running {}", worker.display()))?;
    ensure!(out.status.success(), "{} corpus: {}", worker.display(), String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// WebDataset shards of the same JPEGs: `<key>.jpg` and `<key>.cls` per sample, two tars.
async fn write_webdataset(images: &Path, dir: &Path) -> anyhow::Result<()> {
    let staging = dir.with_extension("staging");
    std::fs::create_dir_all(&staging)?;
    std::fs::create_dir_all(dir)?;
    let mut keys = Vec::new();
    for (class, entry) in std::fs::read_dir(images)?.enumerate() {
        let class_dir = entry?.path();
        let mut files: Vec<_> = std::fs::read_dir(&class_dir)?.collect::<Result<_, _>>()?;
        files.sort_by_key(|f| f.file_name());
        for file in files {
            let key = format!("{:06}", keys.len());
            std::fs::copy(file.path(), staging.join(format!("{key}.jpg")))?;
            std::fs::write(staging.join(format!("{key}.cls")), class.to_string())?;
            keys.push(key);
        }
    }
    for (shard, chunk) in keys.chunks(keys.len().div_ceil(2)).enumerate() {
        let members = chunk.iter().flat_map(|k| [format!("{k}.jpg"), format!("{k}.cls")]);
        let tar = dir.join(format!("shard-{shard}.tar"));
        Cmd::new("tar").arg("-cf").arg(&tar).arg("-C").arg(&staging).args(members).run().await?;
    }
    std::fs::remove_dir_all(&staging)?;
    Ok(())
}

/// JSONL in the text sample's fields: text, label, quality (half of it filtered out, and
/// still more than a batch of 1024 per worker).
fn write_jsonl(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for shard in 0..8 {
        let lines: String = (0..1500)
            .map(|i| {
                let quality = if i % 2 == 0 { 0.9 } else { 0.1 };
                format!("{{\"text\": \"document {shard}-{i}\", \"label\": {}, \"quality\": {quality}}}\n", i % 7)
            })
            .collect();
        std::fs::write(dir.join(format!("{shard}.jsonl")), lines)?;
    }
    Ok(())
}

/// Writes one Parquet file of `columns` at `path`.
fn write_parquet(path: &Path, columns: Vec<(String, arrow_array::ArrayRef)>) -> anyhow::Result<()> {
    let batch = arrow_array::RecordBatch::try_from_iter(columns)?;
    let mut writer = parquet::arrow::ArrowWriter::try_new(std::fs::File::create(path)?, batch.schema(), None)?;
    writer.write(&batch)?;
    writer.close()?;
    Ok(())
}

/// A Criteo-style table in two files of 3,000 rows (a batch of 2048 each, the sample dropping
/// the remainder): `label`, counts `i1`-`i13` and hex categories `c1`-`c26`, each null in some
/// rows.
fn write_criteo(dir: &Path) -> anyhow::Result<()> {
    use arrow_array::{ArrayRef, Int64Array, StringArray};
    use std::sync::Arc;
    std::fs::create_dir_all(dir)?;
    for file in 0..2i64 {
        let rows = file * 3000..(file + 1) * 3000;
        let mut columns = vec![(
            "label".to_string(),
            Arc::new(Int64Array::from_iter_values(rows.clone().map(|r| r % 2))) as ArrayRef,
        )];
        for i in 1..=13 {
            let counts = rows.clone().map(|r| (r % (i + 4) != 0).then_some(r * i % 97 - 3));
            columns.push((format!("i{i}"), Arc::new(Int64Array::from_iter(counts))));
        }
        for c in 1..=26 {
            let categories = rows.clone().map(|r| (r % (c + 6) != 0).then(|| format!("{:08x}", r * c % 5000)));
            columns.push((format!("c{c}"), Arc::new(StringArray::from_iter(categories))));
        }
        write_parquet(&dir.join(format!("part-{file}.parquet")), columns)?;
    }
    Ok(())
}

/// The LLM sample's data on its claim: `web/` (7 files) and `code/` (3 files) of 300
/// documents each in a `text` column (and an `id` column it does not read), and
/// `tokenizer/tokenizer.json`, a word-level tokenizer of the documents' words whose id 2 is
/// the end-of-document token the sample's `pack` puts between documents.
fn write_text_parquet(claim: &Path) -> anyhow::Result<()> {
    use arrow_array::{ArrayRef, Int64Array, StringArray};
    use std::sync::Arc;
    const WORDS: [&str; 6] = ["accelerators", "wait", "for", "batches", "stoker", "streams"];
    let vocab: Vec<String> =
        ["[UNK]", "<s>", "</s>"].iter().chain(&WORDS).enumerate().map(|(i, w)| format!("{w:?}: {i}")).collect();
    std::fs::create_dir_all(claim.join("tokenizer"))?;
    std::fs::write(
        claim.join("tokenizer/tokenizer.json"),
        format!(
            r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null, "pre_tokenizer": {{"type": "Whitespace"}}, "post_processor": null, "decoder": null, "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "[UNK]"}}}}"#,
            vocab.join(", ")
        ),
    )?;
    for (source, files) in [("web", 7), ("code", 3)] {
        std::fs::create_dir_all(claim.join(source))?;
        for file in 0..files {
            let docs = (0..300).map(|d: usize| {
                (0..(d * 7 + file) % 400).map(|k| WORDS[k % WORDS.len()]).collect::<Vec<_>>().join(" ")
            });
            let columns = vec![
                ("id".to_string(), Arc::new(Int64Array::from_iter_values(0..300)) as ArrayRef),
                ("text".to_string(), Arc::new(StringArray::from_iter_values(docs)) as ArrayRef),
            ];
            write_parquet(&claim.join(format!("{source}/{file}.parquet")), columns)?;
        }
    }
    Ok(())
}
