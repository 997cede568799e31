//! A simulated worker, speaking to the dispatcher as `stoker-worker` does (worker/src/dispatched):
//! it registers (again under the same id when the dispatcher forgot it), heartbeats every
//! second with its counters, and asks for splits of the job's open epoch as fast as it gets
//! through them, and of the next while the open one drains. A split is "processed" in a set
//! time, and its completion goes to one of the pipeline's clients, as the real worker sends it
//! behind the split's last batch; the client acknowledges it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stoker_api::proto::{self, next_split_response::Next};

use super::route::{Completion, Route};
use super::rpc::{self, Failed, JOB, Rpc};
use super::tally::{Call, Tally};

/// The real worker's heartbeat interval (worker/src/main.rs).
pub const HEARTBEAT: Duration = Duration::from_secs(1);

pub struct SimWorker {
    pub index: usize,
    pub pipeline: usize,
    pub splits: u64,
    /// How long a split takes to produce.
    pub split_time: Duration,
    pub tally: Arc<Tally>,
    /// The pipeline's clients.
    pub route: Arc<Route>,
}

/// The worker's connection, its id and the dispatcher it is registered with.
struct Link {
    rpc: Rpc,
    registration: proto::RegisterWorkerRequest,
    id: Mutex<String>,
    incarnation: AtomicU64,
    tally: Arc<Tally>,
}

impl SimWorker {
    /// Registers, then heartbeats and produces until the runtime running it stops.
    pub async fn run(self, url: String) -> anyhow::Result<()> {
        let registration = proto::RegisterWorkerRequest {
            pipeline: Some(rpc::pipeline(self.pipeline)),
            // A pod address, as long as a real one; never dialled.
            address: format!("10.244.{}.{}:50052", self.index / 250, self.index % 250 + 1),
            threads: 8,
            splits: self.splits,
            plan_digest: format!("{:016x}", self.splits),
            worker_id: String::new(),
            cache_hints: Vec::new(),
            cache_mode: stoker_api::proto::CacheMode::Never.into(),
            shuffle_seed: Some(7),
        };
        let link = Arc::new(Link {
            rpc: rpc::connect(&url)?,
            registration,
            id: Mutex::new(String::new()),
            incarnation: AtomicU64::new(0),
            tally: self.tally.clone(),
        });
        link.register().await?;
        tokio::spawn(heartbeats(link.clone(), rpc::phase(self.index, HEARTBEAT)));
        self.produce(&link).await
    }

    /// Asks for splits of the open epoch, and of the next while the open one drains (the real
    /// worker runs a producer for each, the next one's asking only while the open one's is
    /// idle), until the runtime stops.
    async fn produce(&self, link: &Link) -> anyhow::Result<()> {
        let mut epoch = 0;
        // While the open epoch drains: when to ask for it again (the dispatcher's retry_ms).
        let mut draining_until: Option<Instant> = None;
        loop {
            if draining_until.is_none_or(|t| Instant::now() >= t) {
                match self.ask(link, epoch).await? {
                    (Next::Split(s), incarnation) => {
                        draining_until = None;
                        self.process(s, incarnation).await;
                        continue;
                    }
                    (Next::Finished(f), _) => {
                        (epoch, draining_until) = (epoch.max(f.epoch + 1), None);
                        continue;
                    }
                    (Next::Draining(d), _) => {
                        draining_until = Some(Instant::now() + Duration::from_millis(u64::from(d.retry_ms)));
                    }
                }
            }
            match self.ask(link, epoch + 1).await? {
                (Next::Split(s), incarnation) => self.process(s, incarnation).await,
                (Next::Finished(f), _) => (epoch, draining_until) = (epoch.max(f.epoch + 1), None),
                (Next::Draining(d), _) => {
                    let retry = Instant::now() + Duration::from_millis(u64::from(d.retry_ms));
                    tokio::time::sleep_until(draining_until.unwrap_or(retry).min(retry).into()).await;
                }
            }
        }
    }

    /// One NextSplit, timed from the call to the answer, with the incarnation of the
    /// dispatcher that answered; a split handed out is recorded.
    async fn ask(&self, link: &Link, epoch: u64) -> anyhow::Result<(Next, u64)> {
        let (response, took) = link
            .call(|mut rpc, worker_id| async move {
                let request = proto::NextSplitRequest { worker_id, job: JOB.into(), completed: Vec::new(), epoch };
                let start = Instant::now();
                let response = rpc.next_split(request).await;
                response.map(|r| (r.into_inner(), start.elapsed()))
            })
            .await?;
        self.tally.next_split(took);
        let next = response.next.ok_or_else(|| anyhow::anyhow!("NextSplit answered nothing"))?;
        match &next {
            Next::Split(s) => {
                self.tally.call(Call::Split);
                self.tally.handed(self.pipeline, response.incarnation, s.epoch, s.split, Instant::now());
            }
            Next::Draining(_) | Next::Finished(_) => self.tally.call(Call::Idle),
        }
        Ok((next, response.incarnation))
    }

    /// Produces the split (its time, give or take half), then sends its completion to a client
    /// of the pipeline, tagged with the dispatcher that handed it out as the real worker tags
    /// its batches. Every split taking exactly the same time kept the workers in step: all
    /// asked in the same millisecond, and the last of each burst waited for all the others.
    async fn process(&self, split: proto::SplitRef, incarnation: u64) {
        if !self.split_time.is_zero() {
            let spread = 0.5 + jitter(self.index as u64, split.epoch, split.split);
            tokio::time::sleep(self.split_time.mul_f64(spread)).await;
        }
        self.route.send(self.index, Completion { epoch: split.epoch, split: split.split, incarnation });
    }
}

impl Link {
    fn id(&self) -> String {
        self.id.lock().unwrap().clone()
    }

    /// Registers (under the id it has, if any), retrying while the dispatcher is unreachable.
    async fn register(&self) -> anyhow::Result<()> {
        let mut request = self.registration.clone();
        request.worker_id = self.id();
        loop {
            match self.rpc.clone().register_worker(request.clone()).await {
                Ok(response) => {
                    let response = response.into_inner();
                    *self.id.lock().unwrap() = response.worker_id;
                    if self.incarnation.swap(response.incarnation, Ordering::Relaxed) != response.incarnation {
                        self.tally.back(response.incarnation, true, Instant::now());
                    }
                    return Ok(());
                }
                Err(s) => match rpc::failed(s) {
                    Failed::Fatal(s) => anyhow::bail!("the dispatcher refused worker {}: {s}", request.address),
                    Failed::Forgotten | Failed::Retry => {
                        self.tally.call(Call::Error);
                        tokio::time::sleep(rpc::RETRY).await;
                    }
                },
            }
        }
    }

    /// Calls the dispatcher until it answers, registering again when it forgot this worker.
    async fn call<T, F, Fut>(&self, mut f: F) -> anyhow::Result<T>
    where
        F: FnMut(Rpc, String) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        loop {
            match f(self.rpc.clone(), self.id()).await {
                Ok(answer) => return Ok(answer),
                Err(s) => {
                    self.tally.call(Call::Error);
                    match rpc::failed(s) {
                        Failed::Forgotten => self.register().await?,
                        Failed::Retry => tokio::time::sleep(rpc::RETRY).await,
                        Failed::Fatal(s) => anyhow::bail!("worker {}: {s}", self.registration.address),
                    }
                }
            }
        }
    }
}

/// Heartbeats every `HEARTBEAT` from `phase` on with counters as the real worker's grow,
/// until the runtime stops.
async fn heartbeats(link: Arc<Link>, phase: Duration) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + phase, HEARTBEAT);
    let mut beats = 0u64;
    loop {
        tick.tick().await;
        beats += 1;
        let progress = progress(beats);
        link.call(|mut rpc, worker_id| {
            let progress = progress.clone();
            async move { rpc.worker_heartbeat(proto::WorkerHeartbeatRequest { worker_id, progress: Some(progress) }).await }
        })
        .await?;
        link.tally.call(Call::Heartbeat);
    }
}

/// A fraction in [0, 1) fixed by (worker, epoch, split): a run repeats its split times.
fn jitter(worker: u64, epoch: u64, split: u64) -> f64 {
    // SplitMix64's finaliser over the three.
    let mut x = worker.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ epoch.rotate_left(21) ^ split.rotate_left(42);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// A worker's counters after `beats` seconds of a pipeline of five transforms.
fn progress(beats: u64) -> proto::WorkerProgress {
    let elements = beats * 2_000;
    proto::WorkerProgress {
        records: elements,
        elements,
        batches: elements / 256,
        batch_bytes: elements * 150_000,
        skipped: [("corrupt_jpeg".to_string(), beats / 100)].into(),
        op_seconds: (1..=5).map(|op| beats as f64 * 0.15 * op as f64).collect(),
        op_elements_in: vec![elements; 5],
        op_elements_out: vec![elements; 5],
        error: String::new(),
        cache: None,
        warnings: Vec::new(),
        source_elements: vec![elements],
        sharing: None,
    }
}
