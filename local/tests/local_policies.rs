//! The local policy comparison's baselines decide from real readings and scale real worker
//! processes: HPA from the workers' CPU over the calibrated request, KEDA from the client's
//! prefetch queue, Cachew's rule from the windows the client reports. One worker starts; the
//! trainer needs four, so each must ask for more.

use std::time::Duration;

use stoker_local::bench::policies::{self, run};
use stoker_local::workers::worker_binary;
use stoker_operator::autoscaling::sim::contenders::Contender;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_baseline_scales_local_workers_up_from_what_it_reads() {
    assert!(
        worker_binary().is_file(),
        "{} is missing: run `cargo build --workspace --bins` first",
        worker_binary().display()
    );
    let (dir, logs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let corpus = dir.path().join("corpus");
    stoker_local::demo::ensure_corpus(&corpus, 200).await.unwrap();
    let config = stoker_operator::autoscaling::sim::SimConfig { window_seconds: 2.0, ..policies::config() };
    let scenario = policies::scenario("optimum 4").unwrap();
    let (trainer, steps) = policies::shortened(&scenario, 10.0);
    let mut setting = run::Setting {
        corpus: &corpus,
        logs: logs.path(),
        config: &config,
        request: 0.0,
        period: Some(Duration::from_secs(2)),
    };
    setting.request =
        run::calibrate(&setting, trainer.rate, Duration::from_secs(1), Duration::from_secs(3)).await.unwrap();
    assert!(setting.request > 0.0 && setting.request < 1.5, "a capped worker uses {} cores", setting.request);

    for contender in [Contender::Hpa, Contender::Keda { per_worker: 1.0 }, Contender::Cachew] {
        let run = run::run(contender, &trainer, steps, 4, &setting).await.unwrap();
        eprintln!("{}: {run:?}", contender.name());
        assert_eq!(run.batches, steps, "{}", contender.name());
        let first = run.decisions.first().unwrap_or_else(|| panic!("{} never rescaled: {run:?}", contender.name()));
        assert!(first.2 > 1, "{} scaled down from 1 first: {run:?}", contender.name());
        assert!(run.most_workers >= 2 && run.worker_seconds > run.seconds, "{}: {run:?}", contender.name());
        assert!(run.waited > 0.0 && run.waited < run.seconds, "{}: {run:?}", contender.name());
    }
}
