//! `python` transforms in real `stoker-worker` processes under a dispatcher: an exception, a
//! hang past the timeout, a process that exits and one that grows past its memory limit each
//! cost only their own element (onError: skip) and are summed up in the status warnings; with
//! onError: fail the pipeline stops and says why; a module that does not import is a clear
//! error. Needs `STOKER_PYTHON` naming a Python with numpy (`make test` sets it to its venv).

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use stoker_api::WorkerPipeline;
use stoker_client::{Client, ClientOptions};
use stoker_operator::autoscaling::Scaler;

const MODULE: &str = r#"
import os, time
import numpy as np

def troubled(element, rng):
    n = int(element["n"])
    if n % 50 == 7:
        raise ValueError(f"element {n} is bad")
    if n == 123:
        time.sleep(60)            # past timeoutSeconds
    if n == 321:
        os._exit(9)               # the process dies
    if n == 222:
        hog = np.ones(96 << 20)   # 768 MiB, past memoryLimitMib
        time.sleep(60)
    if n % 10 == 9:
        return None               # dropped on purpose
    print("a print goes to the log, not into the protocol")
    element["double"] = element["x"] * 2
    element["noise"] = rng.integers(0, 1000, size=3)
    element["tag"] = f"n={n}"
    return element

def clean(element, rng):
    element["noise"] = rng.integers(0, 1 << 30, size=4)
    return element
"#;

const N: i64 = 400;

fn expected() -> BTreeSet<i64> {
    (0..N).filter(|n| n % 50 != 7 && ![123, 321, 222].contains(n) && n % 10 != 9).collect()
}

/// 4 JSONL files of {"n", "x": [n, n + 0.5]} and the module in its own directory.
fn pipeline(dir: &std::path::Path, on_error: &str, module: &str) -> WorkerPipeline {
    pipeline_of(dir, on_error, module, "troubled")
}

fn pipeline_of(dir: &std::path::Path, on_error: &str, module: &str, function: &str) -> WorkerPipeline {
    let data = dir.join("data");
    let code = dir.join("code");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::create_dir_all(&code).unwrap();
    std::fs::write(code.join("user_ops.py"), MODULE).unwrap();
    for file in 0..4 {
        let rows: String =
            (file * 100..(file + 1) * 100).map(|n| format!("{{\"n\": {n}, \"x\": [{n}.0, {n}.5]}}\n")).collect();
        std::fs::write(data.join(format!("{file}.jsonl")), rows).unwrap();
    }
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: jsonl}}\nbatchSize: 10\npadValue: 0\nonError: {on_error}\nseed: 5\n\
         transforms:\n- python: {{module: {module}, function: {function}, path: '{}', timeoutSeconds: 2, memoryLimitMib: 256}}\n",
        data.display(),
        code.display()
    );
    WorkerPipeline::new("ns", "py", &stoker_api::from_yaml(&manifest).unwrap())
}

fn i64s(t: &stoker_api::Tensor) -> Vec<i64> {
    t.data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

fn f64s(t: &stoker_api::Tensor) -> Vec<f64> {
    t.data.chunks(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_cost_only_their_own_element_and_reach_the_status() {
    let dir = tempfile::tempdir().unwrap();
    let s = support::dispatched(pipeline(dir.path(), "skip", "user_ops"), Duration::from_secs(10), None).await;
    s.workers.scale(&s.key, 1).await.unwrap();
    let mut client = Client::from_dispatcher(&s.url, ClientOptions::new("ns", "py")).await.unwrap();
    let mut got = BTreeSet::new();
    let reading = async {
        while let Some(batch) = client.next_in_epoch().await {
            let batch = batch.expect("no error reaches the reader");
            let ns = i64s(&batch.tensors["n"]);
            let (x, double) = (f64s(&batch.tensors["x"]), f64s(&batch.tensors["double"]));
            assert_eq!(batch.tensors["noise"].shape, [ns.len(), 3]);
            assert_eq!(batch.tensors["tag"].shape[0], ns.len(), "a str comes back as bytes");
            for (i, n) in ns.iter().enumerate() {
                assert_eq!(&x[2 * i..2 * i + 2], &[*n as f64, *n as f64 + 0.5], "the input arrived whole");
                assert_eq!(&double[2 * i..2 * i + 2], &[2.0 * *n as f64, 2.0 * *n as f64 + 1.0]);
                assert!(got.insert(*n), "{n} delivered twice");
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(120), reading).await.expect("the epoch ends within 120 s");
    assert_eq!(got, expected(), "every element but the failed and dropped ones, once");

    // The summary comes with a heartbeat: each reason counted (the worker may be producing
    // the next epoch already, so counts only grow past this epoch's).
    let deadline = Instant::now() + Duration::from_secs(30);
    let reasons = ["python_exception", "python_timeout", "python_died", "python_memory"];
    let warning = loop {
        let warnings = s.report().warnings;
        let python = warnings.into_iter().find(|w| w.starts_with("transforms[0].python failed on"));
        if let Some(w) = python.as_ref().filter(|w| reasons.iter().all(|r| w.contains(r))) {
            break w.clone();
        }
        assert!(Instant::now() < deadline, "no summary of every kind of failure within 30 s; the last: {python:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(warning.contains("last: transforms[0].python user_ops.troubled:"), "{warning}");
    // The worker's metrics: a call per element, and the three processes the timeout, the exit
    // and the memory limit killed, each replaced (an exception kills nothing).
    let texts = s.scrape_workers().await;
    let calls = support::metric_sum(&texts, "stoker_worker_python_calls_total", &s.key);
    assert!(calls >= N as f64, "{calls} calls for {N} elements: {texts:?}");
    let restarts = support::metric_sum(&texts, "stoker_worker_python_restarts_total", &s.key);
    assert!(restarts >= 3.0, "{restarts} restarts: {texts:?}");
    let started = support::metric_sum(&texts, "stoker_worker_python_processes_started_total", &s.key);
    assert!(started >= 1.0 + restarts, "{started} processes started after {restarts} restarts");
    s.workers.stop_all().await;
}

/// Every row's draws, whichever worker of how many made it: {row: noise}.
async fn draws(dir: &std::path::Path, workers: u32) -> std::collections::BTreeMap<u64, Vec<i64>> {
    let s = support::dispatched(pipeline_of(dir, "fail", "user_ops", "clean"), Duration::from_secs(10), None).await;
    s.workers.scale(&s.key, workers).await.unwrap();
    let mut client = Client::from_dispatcher(&s.url, ClientOptions::new("ns", "py")).await.unwrap();
    let mut got = std::collections::BTreeMap::new();
    let reading = async {
        while let Some(batch) = client.next_in_epoch().await {
            let batch = batch.expect("no error");
            let noise = i64s(&batch.tensors["noise"]);
            for (i, row) in batch.rows.iter().enumerate() {
                assert!(got.insert(*row, noise[4 * i..4 * i + 4].to_vec()).is_none(), "row {row} twice");
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(120), reading).await.expect("the epoch ends within 120 s");
    s.workers.stop_all().await;
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draws_are_the_same_whatever_the_number_of_workers() {
    let dir = tempfile::tempdir().unwrap();
    let one = draws(dir.path(), 1).await;
    let two = draws(dir.path(), 2).await;
    assert_eq!(one.len(), N as usize);
    assert_eq!(one, two, "each row's generator depends on (seed, epoch, row, op) only");
    let distinct: BTreeSet<&Vec<i64>> = one.values().collect();
    assert_eq!(distinct.len(), one.len(), "every row draws its own numbers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_on_error_fail_the_first_exception_stops_the_pipeline_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let s = support::dispatched(pipeline(dir.path(), "fail", "user_ops"), Duration::from_secs(10), None).await;
    s.workers.scale(&s.key, 1).await.unwrap();
    let _client = Client::from_dispatcher(&s.url, ClientOptions::new("ns", "py")).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let error = loop {
        let warnings = s.report().warnings;
        if let Some(w) = warnings.into_iter().find(|w| w.starts_with("a worker stopped")) {
            break w;
        }
        assert!(Instant::now() < deadline, "no worker error in the warnings within 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(error.contains("transforms[0].python user_ops.troubled: raised ValueError: element"), "{error}");
    s.workers.stop_all().await;
}

#[test]
fn a_module_that_does_not_import_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let pipeline = pipeline(dir.path(), "skip", "no_such_module");
    let file = dir.path().join("pipeline.yaml");
    let manifest = format!(
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {{name: py, namespace: ns}}\nspec:\n{}",
        stoker_api::to_yaml(&pipeline.data_plane).unwrap().lines().map(|l| format!("  {l}\n")).collect::<String>()
    );
    std::fs::write(&file, manifest).unwrap();
    let out = std::process::Command::new(stoker_local::workers::worker_binary())
        .args(["--standalone", "--listen", "127.0.0.1:0", "--pipeline"])
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the worker refuses to start");
    assert!(stderr.contains("loading no_such_module.troubled") && stderr.contains("ModuleNotFoundError"), "{stderr}");
}
