//! The samples that need more than the machine offers (S3 data, a worker image with Python)
//! run under `stoker local` as a user trying them on a laptop would: the source pointed at
//! local files of the same format, the Python code taken from the repository instead of the
//! ConfigMap, and everything else as the sample has it. Needs `STOKER_PYTHON` naming a Python
//! with numpy (`make test` sets it).

use std::path::Path;
use std::time::Duration;

use stoker_api::WorkersReport;
use stoker_client::{Client, ClientOptions};
use stoker_local::workers::{LocalWorkerConfig, worker_binary};
use stoker_local::{Local, LocalOptions};
use stoker_worker::corpus::{self, CorpusSpec};

fn samples() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/samples")
}

/// Starts `stoker local`'s dispatcher and workers for `spec` and reads one epoch with a client:
/// every batch, and the workers' report (with a mix, once it holds the shares).
async fn one_epoch(name: &str, spec: stoker_api::DataPipelineSpec) -> (Vec<stoker_api::Batch>, WorkersReport) {
    let mixed = spec.data_plane.source.mix.len();
    let logs = tempfile::tempdir().unwrap();
    let local = Local::start(LocalOptions {
        namespace: "samples".into(),
        name: name.into(),
        spec,
        listen: "127.0.0.1:0".parse().unwrap(),
        workers: LocalWorkerConfig {
            binary: worker_binary(),
            dispatcher_url: String::new(),
            threads: 2,
            memory_budget: 256 << 20,
            max_batch_rate: None,
            log_dir: Some(logs.path().to_path_buf()),
            cache_dir: None,
            tls: None,
        },
        window: Some(Duration::from_secs(1)),
        budget: None,
        tls_dir: None,
    })
    .await
    .unwrap();
    let mut client = Client::from_dispatcher(&local.url, ClientOptions::new("samples", name)).await.unwrap();
    let mut batches = Vec::new();
    let reading = async {
        while let Some(batch) = client.next_in_epoch().await {
            batches.push(batch.expect("no error"));
        }
    };
    tokio::time::timeout(Duration::from_secs(120), reading).await.expect("an epoch within 120 s");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let delivered: u64 = batches.iter().map(|b| b.rows.len() as u64).sum();
    let report = loop {
        let report = local.report();
        // The heartbeats lag the batches: wait for the last op to count what was delivered.
        let counted = report.ops.last().is_none_or(|op| op.elements_out >= delivered);
        if (report.source_shares.len() == mixed && counted) || tokio::time::Instant::now() > deadline {
            break report;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    local.shutdown().await;
    (batches, report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_augmentation_sample_runs_under_stoker_local() {
    let data = tempfile::tempdir().unwrap();
    let images = 24;
    corpus::generate(data.path(), &CorpusSpec { images, classes: 3, ..Default::default() }).unwrap();
    let text = std::fs::read_to_string(samples().join("image-python-augment.yaml")).unwrap();
    let mut dp = stoker_api::parse_manifest(&text).unwrap();
    let spec = &mut dp.spec;
    spec.data_plane.source.uri = format!("file://{}/", data.path().display());
    spec.data_plane.source.credentials_secret = None;
    spec.data_plane.batch_size = 8;
    for t in &mut spec.data_plane.transforms {
        if let stoker_api::Transform::Python(p) = t {
            p.path = Some(samples().join("python").display().to_string());
        }
    }
    let (batches, report) = one_epoch(dp.metadata.name.as_deref().unwrap(), dp.spec.clone()).await;
    let warnings = report.warnings;
    let mut rows = 0;
    for batch in &batches {
        let image = &batch.tensors["image"];
        assert_eq!(image.dtype, stoker_api::DType::Float16, "normalize ran in Rust after the Python op");
        assert_eq!(&image.shape[1..], [224, 224, 3]);
        let values: Vec<f32> = image.data.chunks(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
        assert!(values.iter().all(|v| v.is_finite() && v.abs() < 3.0), "normalized pixels");
        rows += image.shape[0];
    }
    assert_eq!(rows, images, "every image once");
    assert!(warnings.is_empty(), "no element failed: {warnings:?}");
}

/// A word-level tokenizer.json the `tokenizers` library loads: whitespace pre-tokenizer, the
/// words below, `</s>` = 2.
fn word_tokenizer(path: &Path, words: &[&str]) {
    let mut vocab = serde_json::Map::new();
    for (i, w) in ["[UNK]", "<s>", "</s>"].iter().chain(words).enumerate() {
        vocab.insert(w.to_string(), i.into());
    }
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    });
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, tokenizer.to_string()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_llm_pretraining_sample_runs_under_stoker_local() {
    llm_pretraining("llm-pretraining.yaml", |path, docs| {
        let lines: String =
            docs.iter().enumerate().map(|(i, text)| format!("{{\"text\": \"{text}\", \"id\": {i:>3}}}\n")).collect();
        std::fs::write(path.with_extension("jsonl"), lines).unwrap();
    })
    .await;
}

/// The same documents in Parquet files: a `text` column, and an `id` column never read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_llm_pretraining_sample_on_parquet_runs_under_stoker_local() {
    use std::sync::Arc;

    use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
    llm_pretraining("llm-pretraining-parquet.yaml", |path, docs| {
        let text = StringArray::from_iter_values(docs);
        let ids = Int64Array::from_iter_values(0..docs.len() as i64);
        let batch =
            RecordBatch::try_from_iter([("id", Arc::new(ids) as ArrayRef), ("text", Arc::new(text) as ArrayRef)])
                .unwrap();
        let out = std::fs::File::create(path.with_extension("parquet")).unwrap();
        let mut writer = parquet::arrow::ArrowWriter::try_new(out, batch.schema(), None).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
    })
    .await;
}

/// The DLRM sample over a Criteo-style table written here (three files, nulls in every
/// column): every row once, its dense vector and its buckets as the sample's ops define them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dlrm_sample_runs_under_stoker_local() {
    use std::sync::Arc;

    use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
    let data = tempfile::tempdir().unwrap();
    let count = |row: i64, i: i64| row * (i + 3) % 50 - 2;
    let category = |row: i64, c: i64| format!("{:08x}", (row * 31 + c * 7) % 1000);
    // Row r's i-th count is null when r % (i + 5) == 0, its c-th category when r % (c + 7) == 0.
    for file in 0..3 {
        let rows = file * 1000..(file + 1) * 1000;
        // `id` is not Criteo's: it lets the test find each row's expected values.
        let mut columns: Vec<(String, ArrayRef)> = vec![
            ("id".into(), Arc::new(Int64Array::from_iter_values(rows.clone()))),
            ("label".into(), Arc::new(Int64Array::from_iter_values(rows.clone().map(|r| r % 2)))),
        ];
        for i in 1..=13 {
            let values = rows.clone().map(|r| (r % (i + 5) != 0).then(|| count(r, i)));
            columns.push((format!("i{i}"), Arc::new(Int64Array::from_iter(values))));
        }
        for c in 1..=26 {
            let values = rows.clone().map(|r| (r % (c + 7) != 0).then(|| category(r, c)));
            columns.push((format!("c{c}"), Arc::new(StringArray::from_iter(values))));
        }
        let batch = RecordBatch::try_from_iter(columns).unwrap();
        let out = std::fs::File::create(data.path().join(format!("part-{file}.parquet"))).unwrap();
        let mut writer = parquet::arrow::ArrowWriter::try_new(out, batch.schema(), None).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
    }
    let text = std::fs::read_to_string(samples().join("dlrm-criteo.yaml")).unwrap();
    let mut dp = stoker_api::parse_manifest(&text).unwrap();
    dp.spec.data_plane.source.uri = format!("file://{}/", data.path().display());
    dp.spec.data_plane.source.credentials_secret = None;
    dp.spec.data_plane.batch_size = 100;
    assert_eq!(stoker_api::validate(&dp.spec), Ok(()));
    let (batches, report) = one_epoch("dlrm-criteo", dp.spec.clone()).await;
    let i64s = |t: &stoker_api::Tensor| -> Vec<i64> {
        t.data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
    };
    let mut seen = std::collections::BTreeSet::new();
    for batch in &batches {
        assert_eq!(batch.tensors["dense"].shape, [100, 13]);
        let dense: Vec<f32> =
            batch.tensors["dense"].data.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        let (c5, ids) = (i64s(&batch.tensors["c5"]), i64s(&batch.tensors["id"]));
        for (k, &r) in ids.iter().enumerate() {
            assert!(seen.insert(r), "row {r} twice");
            for i in 1..=13 {
                let filled = if r % (i + 5) == 0 { 0.0 } else { count(r, i) as f64 };
                assert_eq!(dense[k * 13 + i as usize - 1], filled.max(0.0).ln_1p() as f32, "row {r}'s i{i}");
            }
            let text = if r % 12 == 0 { String::new() } else { category(r, 5) };
            let bucket = stoker_worker::table::column::xxh64(text.as_bytes()) % 10_000_000;
            assert_eq!(c5[k], bucket as i64, "row {r}'s c5");
        }
    }
    assert_eq!(seen.len(), 3000, "every row once (dropRemainder: 3000 rows make 30 batches)");
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    // The columnar path tallies rows: each op was given every row and passed each on.
    assert_eq!(report.ops.len(), 5, "{:?}", report.ops);
    for op in &report.ops {
        assert!(op.elements_in >= 3000 && op.elements_out == op.elements_in, "{:?}", report.ops);
    }
}

/// Runs an LLM pretraining sample on ten files of 100 documents each, written by `write` (to
/// the path given, its extension set as the format has it): every token and separator once.
async fn llm_pretraining(sample: &str, write: impl Fn(&Path, &[String])) {
    let data = tempfile::tempdir().unwrap();
    let words = ["gpus", "wait", "for", "data", "stoker", "feeds", "them"];
    word_tokenizer(&data.path().join("tokenizer/tokenizer.json"), &words);
    // The sample mixes web 0.7 and code 0.3: seven web files and three code files of the same
    // bytes make an epoch read each file once.
    let mut tokens = 0;
    for (source, files) in [("web", 7), ("code", 3)] {
        std::fs::create_dir_all(data.path().join(source)).unwrap();
        for file in 0..files {
            let docs: Vec<String> = (0..100)
                .map(|i| {
                    let n = i % 40;
                    tokens += n + 1; // and the separator
                    let text: Vec<&str> = (0..n).map(|k| words[k % words.len()]).collect();
                    text.join(" ")
                })
                .collect();
            write(&data.path().join(format!("{source}/{file}")), &docs);
        }
    }
    let text = std::fs::read_to_string(samples().join(sample)).unwrap();
    let mut dp = stoker_api::parse_manifest(&text).unwrap();
    let spec = &mut dp.spec;
    let weights: Vec<f64> = spec.data_plane.source.mix.iter().map(|m| m.weight).collect();
    assert_eq!(weights, [0.7, 0.3], "the sample mixes two sources");
    for m in &mut spec.data_plane.source.mix {
        let source = m.uri.trim_end_matches('/').rsplit('/').next().unwrap().to_string();
        m.uri = format!("file://{}/{source}/", data.path().display());
    }
    spec.data_plane.batch_size = 4;
    // The tokenizer read through the object store, as from s3:// (the path form is tested in
    // client/python/tests/test_text.py).
    for t in &mut spec.data_plane.transforms {
        if let stoker_api::Transform::Tokenize(op) = t {
            op.tokenizer = format!("file://{}", data.path().join("tokenizer/tokenizer.json").display());
        }
    }
    assert_eq!(stoker_api::validate(spec), Ok(()));
    let (batches, report) = one_epoch(&dp.metadata.name.clone().unwrap(), dp.spec.clone()).await;
    let i32s = |t: &stoker_api::Tensor| -> Vec<i32> {
        t.data.chunks(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()
    };
    let (mut real, mut separators) = (0, 0);
    for batch in &batches {
        let ids = &batch.tensors["input_ids"];
        assert_eq!(&ids.shape[1..], [2048], "rows of the sample's length");
        assert_eq!(batch.tensors.keys().collect::<Vec<_>>(), ["input_ids", "position_ids", "segment_ids"]);
        let segments = i32s(&batch.tensors["segment_ids"]);
        let values = i32s(ids);
        real += segments.iter().filter(|s| **s > 0).count();
        separators += values.iter().zip(&segments).filter(|(v, s)| **v == 2 && **s > 0).count();
        assert!(values.iter().zip(&segments).all(|(v, s)| *s > 0 || *v == 0), "padding is padId");
    }
    assert_eq!(real, tokens, "every token and separator once");
    assert_eq!(separators, 1000, "one separator per document");
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    // Each op's tally: tokenize maps documents one to one; pack takes the documents and gives
    // the (far fewer) packed rows. Workers may have read ahead into the next epoch.
    let [.., tokenize, pack] = report.ops[..] else { panic!("tallies for each op: {:?}", report.ops) };
    assert!(tokenize.elements_in >= 1000 && tokenize.elements_out == tokenize.elements_in, "{tokenize:?}");
    assert!(pack.elements_in >= 1000 && pack.elements_out * 5 < pack.elements_in, "{pack:?}");
    assert!(pack.seconds > 0.0, "{pack:?}");
    // Packed rows per source: 7 to 3 as the files are, give or take a split read ahead.
    let shares = &report.source_shares;
    assert!(shares.len() == 2 && (shares[0] - 0.7).abs() < 0.08, "realised shares {shares:?}");
}
