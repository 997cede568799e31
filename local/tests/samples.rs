//! The samples that need more than the machine offers (S3 data, a worker image with Python)
//! run under `stoker local` as a user trying them on a laptop would: the source pointed at
//! local files of the same format, the Python code taken from the repository instead of the
//! ConfigMap, and everything else as the sample has it. Needs `STOKER_PYTHON` naming a Python
//! with numpy (`make test` sets it).

use std::path::Path;
use std::time::Duration;

use stoker_client::{Client, ClientOptions};
use stoker_local::workers::{LocalWorkerConfig, worker_binary};
use stoker_local::{Local, LocalOptions};
use stoker_worker::corpus::{self, CorpusSpec};

fn samples() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/samples")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_augmentation_sample_runs_under_stoker_local() {
    let (data, logs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
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
    let local = Local::start(LocalOptions {
        namespace: "samples".into(),
        name: dp.metadata.name.clone().unwrap(),
        spec: dp.spec.clone(),
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
    let options = ClientOptions::new("samples", dp.metadata.name.as_deref().unwrap());
    let mut client = Client::from_dispatcher(&local.url, options).await.unwrap();
    let mut rows = 0;
    let reading = async {
        while let Some(batch) = client.next_in_epoch().await {
            let batch = batch.expect("no error");
            let image = &batch.tensors["image"];
            assert_eq!(image.dtype, stoker_api::DType::Float16, "normalize ran in Rust after the Python op");
            assert_eq!(&image.shape[1..], [224, 224, 3]);
            let values: Vec<f32> =
                image.data.chunks(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
            assert!(values.iter().all(|v| v.is_finite() && v.abs() < 3.0), "normalized pixels");
            rows += image.shape[0];
        }
    };
    tokio::time::timeout(Duration::from_secs(120), reading).await.expect("an epoch within 120 s");
    assert_eq!(rows, images, "every image once");
    assert!(local.warnings().is_empty(), "no element failed: {:?}", local.warnings());
    local.shutdown().await;
}
