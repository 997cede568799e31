//! The engine as a batch source: epochs run on their own thread, and ready batches are shared
//! among the connected consumers, each batch going to one of them (standalone mode; the
//! dispatcher will assign splits and epochs per job).

use std::sync::Arc;

use futures::StreamExt;
use tonic::Status;

use crate::engine::{Engine, EngineError};
use crate::stream::{BatchSource, Batches, Subscription};

pub struct EngineSource {
    ready: Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<crate::engine::Ready>>>,
    /// Why the engine stopped, once it failed: every stream then ends with it, so a consumer
    /// raises the reason instead of taking the end of its batches for the end of the epoch.
    failed: Arc<std::sync::OnceLock<String>>,
}

impl EngineSource {
    /// Starts producing `epochs` epochs (None: until stopped). The producer blocks while the
    /// memory budget is exhausted, i.e. while consumers are slow.
    pub fn start(engine: Engine, epochs: Option<u64>) -> (Self, std::thread::JoinHandle<Result<(), EngineError>>) {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let failed = Arc::new(std::sync::OnceLock::new());
        let failure = failed.clone();
        let producer = std::thread::Builder::new()
            .name("stoker-engine".into())
            .spawn(move || {
                let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<crate::engine::Ready>(1);
                // Bridges the engine's blocking channel into the async one. Each batch keeps its
                // budget share until the stream has sent it (see budget::attach).
                let bridge = std::thread::spawn(move || {
                    for ready in ready_rx {
                        if tx.blocking_send(ready).is_err() {
                            break;
                        }
                    }
                });
                // One producer for every epoch: the stream reads them in order, so an
                // epoch's rows wait for the batches of the one before that it did not take.
                let producer = engine.producer();
                let mut epoch = 0;
                let result = loop {
                    if epochs.is_some_and(|n| epoch >= n) {
                        break Ok(());
                    }
                    tracing::info!(epoch, splits = engine.mix().slots(), "epoch starts");
                    if let Err(e) = engine.run_epoch_as(&producer, epoch, &ready_tx) {
                        tracing::error!(epoch, error = %e, "the pipeline failed; its consumers get the error");
                        let _ = failure.set(e.to_string());
                        break Err(e);
                    }
                    let stats = &engine.stats;
                    tracing::info!(
                        epoch,
                        batches = stats.batches.load(std::sync::atomic::Ordering::Relaxed),
                        skipped = ?stats.skipped(),
                        "epoch done"
                    );
                    epoch += 1;
                };
                drop(ready_tx);
                let _ = bridge.join();
                result
            })
            .expect("spawning the engine thread");
        (EngineSource { ready: Arc::new(tokio::sync::Mutex::new(rx)), failed }, producer)
    }
}

impl BatchSource for EngineSource {
    fn subscribe(&self, subscription: &Subscription) -> Result<Batches, Status> {
        tracing::info!(job = %subscription.job, reading = ?subscription.reading, "consumer attached");
        let (ready, failed) = (self.ready.clone(), self.failed.clone());
        Ok(futures::stream::unfold(Some(ready), move |ready| {
            let failed = failed.clone();
            async move {
                let ready = ready?;
                let next = ready.lock().await.recv().await;
                match next {
                    Some(next) => Some((Ok(next.into_outgoing()), Some(ready))),
                    // The engine is done: the end of the stream, or its failure, once.
                    None => failed
                        .get()
                        .map(|reason| (Err(Status::internal(format!("the worker's pipeline failed: {reason}"))), None)),
                }
            }
        })
        .boxed())
    }
}
