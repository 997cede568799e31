//! What serving `/metrics` costs preprocessing: epochs of the ResNet-50 transforms with the
//! endpoint off, and on while scraped every `scrape` (a Prometheus scrapes every 15-30 s), in
//! one process on one engine, the order of the two swapped every round. Both the rate and the
//! process's CPU time per image (which the scrapes are served from too) are compared: the CPU
//! time is the steadier of the two on a machine whose speed drifts.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::cached::SplitCache;
use crate::corpus::resnet50_train;
use crate::engine::{Engine, EngineConfig};
use crate::metrics::{self, WorkerMetrics};

pub async fn command(corpus: &Path, threads: usize, rounds: usize, scrape: Duration) -> anyhow::Result<()> {
    let uri = format!("file://{}/", corpus.canonicalize()?.display());
    let config = EngineConfig { threads, ..Default::default() };
    let engine = Arc::new(Engine::open(resnet50_train(&uri, 64), config).await?);
    let mut epoch = 0;
    // Warm: the corpus into the page cache, the allocator's arenas grown.
    super::timed_epoch(&engine, epoch, SplitCache::Compute).await?;
    let (mut rate_ratios, mut cpu_ratios) = (Vec::new(), Vec::new());
    for round in 1..=rounds.max(1) {
        let (mut rates, mut cpu_ms) = ([0.0; 2], [0.0; 2]);
        let mut scrapes = 0;
        for on in if round % 2 == 1 { [false, true] } else { [true, false] } {
            epoch += 1;
            let scraping = if on { Some(Scraping::start(&engine, scrape).await?) } else { None };
            let cpu = crate::cpu_time::process_cpu();
            let (images, seconds) = super::timed_epoch(&engine, epoch, SplitCache::Compute).await?;
            if let Some(scraping) = scraping {
                scrapes = scraping.stop().await?;
                anyhow::ensure!(scrapes > 0, "the endpoint was never scraped during the epoch");
            }
            let side = usize::from(on);
            rates[side] = images as f64 / seconds;
            cpu_ms[side] = (crate::cpu_time::process_cpu() - cpu) * 1e3 / images as f64;
        }
        println!(
            "round {round}: off {:.0} images/s, {:.3} CPU-ms/image; on {:.0} images/s, {:.3} CPU-ms/image \
             ({scrapes} scrapes, one every {} ms): on/off rate {:.4}, CPU {:.4}",
            rates[0],
            cpu_ms[0],
            rates[1],
            cpu_ms[1],
            scrape.as_millis(),
            rates[1] / rates[0],
            cpu_ms[1] / cpu_ms[0]
        );
        rate_ratios.push(rates[1] / rates[0]);
        cpu_ratios.push(cpu_ms[1] / cpu_ms[0]);
    }
    // The epochs' spread is wider than 1%: also what a scrape itself costs, measured alone (the
    // scraper's side of each request included, so an upper bound), as a share of the worker's
    // cores at this interval and at a Prometheus's 15 s.
    let scraping = Scraping::start(&engine, Duration::ZERO).await?;
    let cpu = crate::cpu_time::process_cpu();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let scrapes = scraping.stop().await?;
    let per_scrape = (crate::cpu_time::process_cpu() - cpu) / scrapes as f64;
    let share = |every: f64| per_scrape / every / threads as f64 * 100.0;
    println!(
        "one scrape: {:.0} CPU-us (mean of {scrapes}, back to back); every {} ms it takes {:.3}% of {threads} cores, \
         every 15 s {:.5}%",
        per_scrape * 1e6,
        scrape.as_millis(),
        share(scrape.as_secs_f64()),
        share(15.0)
    );
    for (what, mut ratios) in [("rate", rate_ratios), ("CPU per image", cpu_ratios)] {
        ratios.sort_by(f64::total_cmp);
        println!(
            "on/off {what} over {} rounds: median {:.4}, lowest {:.4}, highest {:.4} ({threads} threads)",
            ratios.len(),
            ratios[ratios.len() / 2],
            ratios[0],
            ratios[ratios.len() - 1]
        );
    }
    Ok(())
}

/// The endpoint served, and a scraper reading it every interval.
struct Scraping {
    stop: Arc<AtomicBool>,
    scraper: tokio::task::JoinHandle<anyhow::Result<u64>>,
    shutdown: tokio::sync::oneshot::Sender<()>,
}

impl Scraping {
    async fn start(engine: &Engine, every: Duration) -> anyhow::Result<Scraping> {
        let (shutdown, stopped) = tokio::sync::oneshot::channel::<()>();
        let addr = "127.0.0.1:0".parse()?;
        let bound = metrics::serve(addr, WorkerMetrics::of(engine), async move { drop(stopped.await) }).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let scraper = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut scrapes = 0;
                while !stop.load(Ordering::Relaxed) {
                    let text = metrics::scrape(bound).await?;
                    anyhow::ensure!(text.contains("stoker_worker_op_seconds_total"), "a scrape without the ops");
                    scrapes += 1;
                    tokio::time::sleep(every).await;
                }
                Ok(scrapes)
            })
        };
        Ok(Scraping { stop, scraper, shutdown })
    }

    /// Stops scraping and serving; the scrapes made.
    async fn stop(self) -> anyhow::Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        let scrapes = self.scraper.await??;
        let _ = self.shutdown.send(());
        Ok(scrapes)
    }
}
