//! Local mode with real processes: the autoscaler, driven by a synthetic trainer's batch
//! times, settles within one worker of the analytic optimum ceil(demand / per-worker rate),
//! where the per-worker rate is measured with one worker first.

use std::time::{Duration, Instant};

use stoker_client::trainer::{Stop, TrainerSpec, train};
use stoker_client::{Client, ClientOptions};
use stoker_local::workers::{LocalWorkerConfig, worker_binary};
use stoker_local::{Local, LocalOptions};

/// Each worker's cap; the machine has two cores, so the cap, not the CPU, must bind.
const WORKER_RATE: f64 = 20.0;

fn corpus(dir: &std::path::Path) {
    for shard in 0..16 {
        let lines: String =
            (0..200).map(|i| format!("{{\"id\": {}, \"x\": [1.0, 2.0, 3.0]}}\n", shard * 1000 + i)).collect();
        std::fs::write(dir.join(format!("{shard:02}.jsonl")), lines).unwrap();
    }
}

fn options(dir: &std::path::Path, logs: &std::path::Path, extra: &str) -> LocalOptions {
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: jsonl}}\nbatchSize: 10\nworkers: {{min: 1, max: 10}}\n{extra}",
        dir.display()
    );
    LocalOptions {
        namespace: "test".into(),
        name: "lines".into(),
        spec: stoker_api::from_yaml(&manifest).unwrap(),
        listen: "127.0.0.1:0".parse().unwrap(),
        workers: LocalWorkerConfig {
            binary: worker_binary(),
            dispatcher_url: String::new(),
            threads: 1,
            memory_budget: 32 << 20,
            max_batch_rate: Some(WORKER_RATE),
            log_dir: Some(logs.to_path_buf()),
            cache_dir: None,
            tls: None,
        },
        window: Some(Duration::from_secs(1)),
        budget: None,
        tls_dir: None,
    }
}

async fn client(local: &Local) -> Client {
    Client::from_dispatcher(&local.url, ClientOptions::new("test", "lines")).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_mode_converges_to_the_analytic_optimum() {
    assert!(
        worker_binary().is_file(),
        "{} is missing: run `cargo build --workspace --bins` first",
        worker_binary().display()
    );
    let (data, logs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    corpus(data.path());

    // One worker, a trainer that never computes: the batches it gets per second are the rate.
    let one =
        Local::start(options(data.path(), logs.path(), "autoscaling: {mode: Fixed, replicas: 1}\n")).await.unwrap();
    let mut c = client(&one).await;
    train(&mut c, &TrainerSpec::steady(Duration::ZERO), Stop { steps: Some(20), after: None }, |_, _| {})
        .await
        .unwrap();
    let measured = train(
        &mut c,
        &TrainerSpec::steady(Duration::ZERO),
        Stop { steps: None, after: Some(Duration::from_secs(4)) },
        |_, _| {},
    )
    .await
    .unwrap();
    drop(c);
    one.shutdown().await;
    let rate = measured.steps as f64 / measured.elapsed.as_secs_f64();
    assert!(
        (WORKER_RATE * 0.8..=WORKER_RATE * 1.1).contains(&rate),
        "one worker made {rate:.1} batches/s, cap {WORKER_RATE}"
    );

    // A trainer needing 10 ms per batch wants about 100 batches/s; its real step (a timer
    // sleep on a busy 2-core machine) is measured, since a 10% longer step changes the optimum.
    let compute = Duration::from_millis(10);
    let steps = Instant::now();
    for _ in 0..50 {
        tokio::time::sleep(compute).await;
    }
    let step = steps.elapsed().as_secs_f64() / 50.0;
    let optimum = (1.0 / (rate * step)).ceil() as u32;
    let local = Local::start(options(data.path(), logs.path(), "")).await.unwrap();
    let mut c = client(&local).await;
    let start = Instant::now();
    let mut done = false;
    while !done && start.elapsed() < Duration::from_secs(90) {
        train(
            &mut c,
            &TrainerSpec::steady(compute),
            Stop { steps: None, after: Some(Duration::from_secs(1)) },
            |_, _| {},
        )
        .await
        .unwrap();
        let record = local.record();
        done = record.converged;
    }
    let record = local.record();
    let rescales = local.rescales.borrow().clone();
    eprintln!(
        "measured {rate:.1} batches/s per worker and {:.1} ms per step, optimum {optimum}; converged={} at {} workers after {:?}; rescales: {rescales:#?}",
        step * 1e3,
        record.converged,
        record.workers,
        start.elapsed()
    );
    assert!(record.converged, "not converged within 90 s: {record:?}");
    assert!(record.workers.abs_diff(optimum) <= 1, "ended at {} workers, optimum {optimum}", record.workers);
    assert_eq!(local.workers.running(&local.key), record.workers as usize, "the processes follow the decision");
    let bound = (f64::from(optimum)).log2().ceil() as usize + 3;
    assert!(rescales.len() <= bound, "{} rescales, more than ceil(log2({optimum})) + 3", rescales.len());
    drop(c);
    local.shutdown().await;
}
