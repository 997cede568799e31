//! The scaling loop: every round, windows from the dispatcher go through the `Driver` and its
//! rescales go to the `Scaler`; the book gets every pipeline's record.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use tokio::sync::watch;

use super::ScalingBook;
use super::budget::Caps;
use super::driver::{Driver, Rescale, Scaled};
use super::scaler::Scaler;
use crate::dispatcher::Dispatcher;

pub struct Loop<S> {
    pub dispatcher: Arc<Dispatcher>,
    pub book: Arc<ScalingBook>,
    pub scaler: S,
    /// Time between rounds: the policy's window.
    pub every: Duration,
    /// Caps on workers: cluster-wide and per namespace.
    pub caps: Caps,
}

impl<S: Scaler> Loop<S> {
    /// Runs rounds until `stop`; `pipelines` lists the ones in scope each round, and
    /// `after_round` sees each round's rescales and whether any record changed (for events,
    /// status and views).
    pub async fn run(
        self,
        pipelines: impl Fn(&ScalingBook) -> Vec<Scaled>,
        mut after_round: impl FnMut(&[Rescale], bool),
        mut stop: watch::Receiver<bool>,
    ) {
        let mut driver = Driver::default();
        let mut tick = tokio::time::interval(self.every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        let mut last = Instant::now();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.wait_for(|s| *s) => return,
            }
            let elapsed = last.elapsed();
            last = Instant::now();
            let scope = pipelines(&self.book);
            let windows = self.dispatcher.with_state(|s| s.take_windows());
            let waited = self.book.add_waits(&windows);
            let (rescales, records) =
                driver.round(elapsed, &Timestamp::now().to_string(), windows, &scope, self.caps, &self.book.all());
            let mut changed = waited;
            // Splits handed out from now on carry the factor.
            self.dispatcher.with_state(|s| {
                for (key, record) in &records {
                    if let Some(echo) = &record.echo {
                        s.set_echo(key, echo.factor);
                    }
                }
            });
            for (key, record) in records {
                changed |= self.book.update(&key, |r| *r = record);
            }
            changed |= self.book.set_caches(self.dispatcher.with_state(|s| s.cache_statuses()));
            changed |= self.book.set_deliveries(self.dispatcher.with_state(|s| s.delivery_statuses()));
            changed |= self.book.set_reports(self.dispatcher.with_state(|s| s.reports()));
            changed |= self.book.set_jobs(self.dispatcher.with_state(|s| s.job_statuses()));
            for r in &rescales {
                tracing::info!(pipeline = %r.pipeline, from = r.from, to = r.to, reason = %r.reason, "rescaling");
                if let Err(e) = self.scaler.scale(&r.pipeline, r.to).await {
                    tracing::warn!(pipeline = %r.pipeline, error = format!("{e:#}"), "rescaling failed");
                }
            }
            after_round(&rescales, changed);
        }
    }
}
