//! A synthetic trainer: consumes batches like a training loop and spends a configured compute
//! time on each (sleeping, as a GPU step leaves the host CPU free). With noise, periodic
//! stalls (checkpoints, evaluation) and a speed change mid-run it reproduces what the
//! autoscaler sees from real jobs. Used by the demo, local mode and the tests.

use std::time::{Duration, Instant};

use crate::{Client, Error};

#[derive(Clone, Debug, PartialEq)]
pub struct TrainerSpec {
    /// Compute time per batch.
    pub compute: Duration,
    /// Multiplicative noise: each step takes compute * (1 ± noise), uniformly.
    pub noise: f64,
    /// Every `n`-th step takes `stall` instead (real logs show 1 s steps every few batches).
    pub stall_every: Option<u64>,
    pub stall: Duration,
    /// From this step (0-based) on, compute time is multiplied by the factor (the job got faster
    /// or slower). By step, not time, so every run of a comparison changes at the same point.
    pub speed_change: Option<(u64, f64)>,
    pub seed: u64,
}

impl TrainerSpec {
    pub fn steady(compute: Duration) -> Self {
        TrainerSpec {
            compute,
            noise: 0.0,
            stall_every: None,
            stall: Duration::from_secs(1),
            speed_change: None,
            seed: 1,
        }
    }

    /// The compute time of step `step` (0-based).
    pub fn step_time(&self, step: u64) -> Duration {
        if self.stall_every.is_some_and(|n| n > 0 && step % n == n - 1) {
            return self.stall;
        }
        let mut base = self.compute.as_secs_f64();
        if let Some((from, factor)) = self.speed_change
            && step >= from
        {
            base *= factor;
        }
        if self.noise > 0.0 {
            let unit =
                (splitmix(self.seed ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 11) as f64 / (1u64 << 53) as f64;
            base *= 1.0 + self.noise * (2.0 * unit - 1.0);
        }
        Duration::from_secs_f64(base.max(0.0))
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// When a run ends.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stop {
    pub steps: Option<u64>,
    pub after: Option<Duration>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainSummary {
    pub steps: u64,
    pub elements: u64,
    pub bytes: u64,
    pub elapsed: Duration,
    /// Time spent waiting for batches.
    pub waited: Duration,
    /// Batches ready in the client's prefetch queue, integrated over the run (batch-seconds):
    /// over a step's compute the queue is taken to move linearly from what the step's batch
    /// left to what the next call finds; while the trainer waits it is empty. Its increase over
    /// an interval, divided by the interval, is the mean a gauge of the queue would show.
    pub ready_batch_seconds: f64,
}

/// Trains on `client`'s batches until `stop`; `on_step` sees each batch and the running
/// summary after its step.
pub async fn train(
    client: &mut Client,
    spec: &TrainerSpec,
    stop: Stop,
    mut on_step: impl FnMut(&TrainSummary, &crate::Batch),
) -> Result<TrainSummary, Error> {
    let start = Instant::now();
    let mut summary = TrainSummary::default();
    loop {
        if stop.steps.is_some_and(|n| summary.steps >= n) || stop.after.is_some_and(|d| start.elapsed() >= d) {
            break;
        }
        let asked = Instant::now();
        let next = match stop.after {
            Some(d) => match tokio::time::timeout(d.saturating_sub(start.elapsed()), client.next()).await {
                Ok(next) => next,
                Err(_) => break,
            },
            None => client.next().await,
        };
        let Some(batch) = next else { break };
        let batch = batch?;
        summary.waited += asked.elapsed();
        summary.elements += batch.tensors.values().next().and_then(|t| t.shape.first().copied()).unwrap_or(0) as u64;
        summary.bytes += batch.payload_bytes() as u64;
        let (left, step) = (client.ready(), spec.step_time(summary.steps));
        tokio::time::sleep(step).await;
        summary.ready_batch_seconds += (left + client.ready()) as f64 / 2.0 * step.as_secs_f64();
        summary.steps += 1;
        summary.elapsed = start.elapsed();
        on_step(&summary, &batch);
    }
    summary.elapsed = start.elapsed();
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stalls_noise_and_speed_changes_shape_step_times() {
        let ms = Duration::from_millis;
        let mut spec = TrainerSpec::steady(ms(30));
        assert_eq!(spec.step_time(0), ms(30));
        spec.stall_every = Some(4);
        let times: Vec<Duration> = (0..8).map(|s| spec.step_time(s)).collect();
        assert_eq!(times, [ms(30), ms(30), ms(30), ms(1000), ms(30), ms(30), ms(30), ms(1000)]);
        spec.speed_change = Some((5, 2.0));
        let times: Vec<Duration> = (3..7).map(|s| spec.step_time(s)).collect();
        assert_eq!(times, [ms(1000), ms(30), ms(60), ms(60)], "stalls stay stalls");
        spec.speed_change = None;
        spec.noise = 0.1;
        let noisy: Vec<f64> = (0..200).filter(|s| s % 4 != 3).map(|s| spec.step_time(s).as_secs_f64()).collect();
        assert!(noisy.iter().all(|t| (0.027..=0.033).contains(t)), "within ±10%");
        let mean = noisy.iter().sum::<f64>() / noisy.len() as f64;
        assert!((mean - 0.030).abs() < 0.001, "unbiased: mean {mean}");
        assert_ne!(noisy[0], noisy[1], "not constant");
    }
}
