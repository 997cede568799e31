//! What `stoker profile` concludes from a sample run, pure: the measurements in; the workers a
//! target rate needs, the training loop's step time at each worker count against its step
//! with infinite preprocessing (DS-Analyzer's differential what-if), the autocache's verdict
//! and what caching at each hint would save, and advice, out.
//!
//! A worker's rate is measured, not derived from the ops' thread time: the sample run's rows
//! over its wall time, or, when the process used more cores than its threads (reading,
//! parsing, batching and the runtime run beside the transform threads), the rate its CPU time
//! gives on as many cores as threads: a worker of T threads is a pod of T cores. N workers are
//! predicted to make N times that (local/tests/profile.rs checks it under `stoker local`).

use stoker_api::proto::HintBytes;
use stoker_api::{DataPipelineSpec, OpTotals, ProfileStatus, SampleProfile, SourceFormat, Transform};
use stoker_operator::autocache::{self, plan::Measured};

/// What the user asks the profile to plan for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Target {
    /// Elements (batch rows) per second.
    Rate(f64),
    /// The trainer's step time with its data always ready, in milliseconds: a batch each.
    Step { ms: f64 },
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ask {
    pub target: Option<Target>,
    /// The workers the pipeline runs with now, for the what-if.
    pub workers_now: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Shares, cost per element and output per input of each op, as `status.profile` has them.
    pub profile: ProfileStatus,
    pub bytes_per_element: Vec<Option<f64>>,
    pub threads: u32,
    /// The cores the sample run's process used (its CPU time over its wall time).
    pub cores_used: f64,
    /// Batch rows per second the sample run made, on as many cores as it took.
    pub unheld_rate: f64,
    /// Batch rows per second one worker of `threads` threads makes held to as many cores:
    /// the rate the plan uses.
    pub rate_per_worker: f64,
    /// The transform threads' time outside the ops: waiting for reads, parsing, shuffling,
    /// batching.
    pub outside_ops_share: f64,
    pub read_bytes_per_record: f64,
    /// What the worker read, over the run's wall time.
    pub read_bytes_per_second: f64,
    pub batch_bytes_per_row: f64,
    /// Rows an epoch makes, estimated from the sampled splits.
    pub epoch_rows: f64,
    pub target_rate: Option<f64>,
    pub workers: Option<Workers>,
    pub step: Option<StepWhatIf>,
    pub cache: Option<CacheWhatIf>,
    pub advice: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Workers {
    /// The workers the target needs.
    pub needed: u32,
    /// `spec.workers.max`, when it is below `needed`.
    pub capped_at: Option<u32>,
    /// What `needed` workers are predicted to make.
    pub predicted_rate: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct StepWhatIf {
    /// The step with infinite preprocessing: the trainer's own.
    pub compute_ms: f64,
    pub batch_size: u32,
    /// The workers of now, and those the target needs (within `spec.workers.max`).
    pub now: u32,
    pub needed: u32,
    pub at: Vec<StepAt>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepAt {
    pub workers: u32,
    pub rate: f64,
    /// The loop's step: its compute, or waiting for the batch when the workers are slower.
    pub step_ms: f64,
    /// The share of the step spent waiting for data.
    pub stall: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct CacheWhatIf {
    /// The workers the verdict assumes (those the target needs, else those of now).
    pub workers: u32,
    pub decision: autocache::Decision,
    pub hints: Vec<HintWhatIf>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HintWhatIf {
    pub at: u32,
    pub bytes_per_element: f64,
    /// What an epoch's entry would hold.
    pub epoch_bytes: f64,
    /// The ops' thread time before the hint: what reading the cache there skips.
    pub saves_share: f64,
}

impl Plan {
    pub fn of(spec: &DataPipelineSpec, sample: &SampleProfile, ask: &Ask) -> Plan {
        let data = &spec.data_plane;
        let totals: Vec<OpTotals> = sample.ops.iter().map(|o| o.totals).collect();
        let thread_seconds = f64::from(sample.threads.max(1)) * sample.wall_seconds;
        let op_seconds: f64 = totals.iter().map(|t| t.seconds).sum();
        let rows = sample.rows.max(1) as f64;
        let unheld_rate = sample.rows as f64 / sample.wall_seconds.max(1e-9);
        let held_rate = f64::from(sample.threads.max(1)) * sample.rows as f64 / sample.cpu_seconds.max(1e-9);
        let rate_per_worker = unheld_rate.min(held_rate);
        let epoch_rows = rows / sample.splits_sampled.max(1) as f64 * sample.splits as f64;
        let target_rate = ask.target.map(|t| match t {
            Target::Rate(rate) => rate,
            Target::Step { ms } => f64::from(data.batch_size) * 1e3 / ms.max(1e-9),
        });
        let max = spec.workers.max.max(1) as u32;
        let workers = target_rate.map(|target| {
            let needed = ((target / rate_per_worker.max(1e-9)).ceil() as u32).max(1);
            Workers {
                needed,
                capped_at: (needed > max).then_some(max),
                predicted_rate: f64::from(needed) * rate_per_worker,
            }
        });
        let step = match ask.target {
            Some(Target::Step { ms }) => Some(step_what_if(ms, data.batch_size, rate_per_worker, ask, workers, max)),
            _ => None,
        };
        let cache_workers = workers.map_or(ask.workers_now, |w| w.needed.min(max)).max(1);
        let mut plan = Plan {
            profile: ProfileStatus::of(&data.transforms, &totals, None),
            bytes_per_element: sample.ops.iter().map(|o| o.bytes_per_element).collect(),
            threads: sample.threads,
            cores_used: sample.cpu_seconds / sample.wall_seconds.max(1e-9),
            unheld_rate,
            rate_per_worker,
            outside_ops_share: 1.0 - (op_seconds / thread_seconds.max(1e-9)).clamp(0.0, 1.0),
            read_bytes_per_second: sample.read_bytes as f64 / sample.wall_seconds.max(1e-9),
            read_bytes_per_record: sample.read_bytes as f64 / sample.records.max(1) as f64,
            batch_bytes_per_row: sample.batch_bytes as f64 / rows,
            epoch_rows,
            target_rate,
            workers,
            step,
            cache: cache_what_if(spec, sample, cache_workers),
            advice: Vec::new(),
        };
        plan.advice = advice(spec, sample, &plan, thread_seconds / rows);
        plan
    }
}

fn step_what_if(ms: f64, batch_size: u32, rate: f64, ask: &Ask, workers: Option<Workers>, max: u32) -> StepWhatIf {
    let needed = workers.map_or(1, |w| w.needed).min(max);
    let now = ask.workers_now.clamp(1, max);
    // 1, powers of two up to what the target needs, that, and the workers of now.
    let mut counts: Vec<u32> =
        std::iter::successors(Some(1u32), |n| n.checked_mul(2)).take_while(|&n| n < needed).collect();
    counts.extend([needed, now]);
    counts.sort_unstable();
    counts.dedup();
    let at = counts
        .into_iter()
        .map(|n| {
            let rate = f64::from(n) * rate;
            let step_ms = ms.max(f64::from(batch_size) * 1e3 / rate.max(1e-9));
            StepAt { workers: n, rate, step_ms, stall: 1.0 - ms / step_ms }
        })
        .collect();
    StepWhatIf { compute_ms: ms, batch_size, now, needed, at }
}

fn cache_what_if(spec: &DataPipelineSpec, sample: &SampleProfile, workers: u32) -> Option<CacheWhatIf> {
    let volume = sample.cache_volume?;
    let hints: Vec<u32> = (spec.data_plane.transforms.iter().enumerate())
        .filter(|(_, t)| matches!(t, Transform::Autocache(_)))
        .map(|(at, _)| at as u32)
        .collect();
    let measured = Measured {
        splits: sample.splits_sampled,
        elements: sample.records,
        op_seconds: sample.ops.iter().map(|o| o.totals.seconds).collect(),
        hint_bytes: (hints.iter())
            .filter_map(|&at| {
                let bytes = sample.ops.get(at as usize)?.bytes_per_element?;
                // As many elements as reached the hint, each of the mean size.
                let elements = sample.ops[at as usize].totals.elements_in.max(1);
                Some(HintBytes { at, elements, bytes: (bytes * elements as f64) as u64 })
            })
            .collect(),
        write_bytes_per_second: volume.write_bytes_per_second,
        read_bytes_per_second: volume.read_bytes_per_second,
        workers,
        threads: sample.threads,
    };
    let profile = measured.profile(hints.iter().copied(), sample.splits);
    Some(CacheWhatIf {
        workers,
        decision: autocache::decide(spec.cache.mode, &profile),
        hints: (profile.hints.iter())
            .map(|h| HintWhatIf {
                at: h.at,
                bytes_per_element: h.bytes,
                epoch_bytes: h.bytes * profile.elements,
                saves_share: (h.prefix_seconds / profile.total_seconds.max(1e-12)).min(1.0),
            })
            .collect(),
    })
}

/// Where a change to the data or the spec would help, from what was measured.
fn advice(spec: &DataPipelineSpec, sample: &SampleProfile, plan: &Plan, seconds_per_row: f64) -> Vec<String> {
    let mut advice = Vec::new();
    if let Some(rm) = sample.restart_markers {
        let ratio = rm.micros_with_markers / rm.micros_as_they_are.max(1e-9);
        let what = format!(
            "decodeImage + randomResizedCrop (transforms[{}..{}]) took {:.0} µs an image as the JPEGs are and {:.0} µs \
             with restart markers, on {} of the sample's JPEGs",
            rm.decode_index,
            rm.decode_index + 1,
            rm.micros_as_they_are,
            rm.micros_with_markers,
            rm.images
        );
        if ratio < 0.9 {
            let decoded = sample.ops.get(rm.decode_index as usize).map_or(0, |o| o.totals.elements_in) as f64;
            let saved = (rm.micros_as_they_are - rm.micros_with_markers) * 1e-6 * decoded / sample.rows.max(1) as f64;
            let rate = plan.rate_per_worker * seconds_per_row / (seconds_per_row - saved).max(seconds_per_row * 0.05);
            let mut line = format!(
                "Restart markers: {what}. Rewriting them once (`stoker-worker add-restart-markers`, docs/transforms.md) \
                 would make about {rate:.0} elements/s a worker instead of {:.0}",
                plan.rate_per_worker
            );
            if let (Some(target), Some(w)) = (plan.target_rate, plan.workers) {
                let needed = ((target / rate).ceil() as u32).max(1);
                line.push_str(&match needed < w.needed {
                    true => format!(": {needed} workers for the target instead of {}", w.needed),
                    false => format!(", still {} workers for the target", w.needed),
                });
            }
            advice.push(line + ".");
        } else {
            advice.push(format!("Restart markers would not help: {what}."));
        }
    }
    let outside = plan.outside_ops_share;
    match spec.data_plane.source.format {
        SourceFormat::Jsonl if outside >= 0.3 => advice.push(format!(
            "Format: {:.0}% of a worker's time is outside the ops (reading, parsing JSON, batching). A Parquet source \
             (`format: parquet`) reads only the columns the ops use, already typed, and runs the feature ops on columns.",
            outside * 100.0
        )),
        SourceFormat::ImageFolder if outside >= 0.3 => advice.push(format!(
            "Format: {:.0}% of a worker's time is outside the ops (waiting for reads, batching), reading one file \
             per image ({:.0} kB each). Tar shards (`format: webdataset`) read many images a request.",
            outside * 100.0,
            plan.read_bytes_per_record / 1e3
        )),
        _ if outside >= 0.5 => advice.push(format!(
            "{:.0}% of a worker's time is outside the ops: reading, parsing, shuffling and batching.",
            outside * 100.0
        )),
        _ => {}
    }
    advice.extend(sample.warnings.iter().map(|w| format!("The worker warns: {w}")));
    if sample.skipped > 0 {
        advice.push(format!(
            "{} of the sample's {} records were skipped as corrupt or failed (onError: skip): the worker's \
             stoker_worker_skipped_total says why.",
            sample.skipped, sample.records
        ));
    }
    advice
}

#[cfg(test)]
mod tests {
    use stoker_api::{RestartMarkersWhatIf, SampledOp, VolumeThroughput};

    use super::*;

    fn spec(yaml_transforms: &str, format: &str) -> DataPipelineSpec {
        stoker_api::from_yaml(&format!(
            "source: {{uri: 'file:///d/', format: {format}}}\ntransforms:\n{yaml_transforms}batchSize: 32\n\
             workers: {{min: 2, max: 6}}\ncache: {{mode: Auto}}\n"
        ))
        .unwrap()
    }

    fn images() -> DataPipelineSpec {
        spec(
            "- decodeImage: {channels: 3}\n- resize: {size: [64, 64]}\n- autocache: {}\n- randomResizedCrop: {size: [32, 32]}\n",
            "imageFolder",
        )
    }

    /// 1000 records in 2 s on 1 thread using 1 core; the ops took 0.8, 0.9, 0 and 0.2 s.
    fn sample() -> SampleProfile {
        let op = |seconds: f64, bytes: f64| SampledOp {
            totals: OpTotals { seconds, elements_in: 1000, elements_out: 1000 },
            bytes_per_element: Some(bytes),
        };
        SampleProfile {
            threads: 1,
            splits: 100,
            splits_sampled: 10,
            records: 1000,
            rows: 1000,
            wall_seconds: 2.0,
            cpu_seconds: 2.0,
            read_bytes: 50_000_000,
            batch_bytes: 12_000_000,
            skipped: 0,
            warnings: Vec::new(),
            ops: vec![op(0.8, 300_000.0), op(0.9, 12_288.0), op(0.0, 12_288.0), op(0.2, 3072.0)],
            cache_volume: Some(VolumeThroughput { write_bytes_per_second: 200e6, read_bytes_per_second: 400e6 }),
            restart_markers: None,
        }
    }

    fn ask(target: Option<Target>) -> Ask {
        Ask { target, workers_now: 2 }
    }

    #[test]
    fn the_workers_a_target_needs_at_the_measured_rate() {
        let plan = Plan::of(&images(), &sample(), &ask(Some(Target::Rate(1700.0))));
        assert_eq!(plan.rate_per_worker, 500.0);
        assert_eq!(plan.workers, Some(Workers { needed: 4, capped_at: None, predicted_rate: 2000.0 }));
        // The ops took 1.9 of the thread's 2 s.
        assert!((plan.outside_ops_share - 0.05).abs() < 1e-9);
        assert_eq!(plan.epoch_rows, 10_000.0);
        assert_eq!(plan.profile.dominant.as_ref().map(|d| d.index), Some(1));
        let plan = Plan::of(&images(), &sample(), &ask(Some(Target::Rate(5000.0))));
        assert_eq!(plan.workers, Some(Workers { needed: 10, capped_at: Some(6), predicted_rate: 5000.0 }));
    }

    #[test]
    fn a_worker_that_used_more_cores_than_threads_is_held_to_its_threads() {
        // 1.5 cores for one thread: in a pod of one core it makes two thirds of the rate.
        let sample = SampleProfile { cpu_seconds: 3.0, ..sample() };
        let plan = Plan::of(&images(), &sample, &ask(None));
        assert_eq!(plan.unheld_rate, 500.0);
        assert!((plan.rate_per_worker - 1000.0 / 3.0).abs() < 1e-9);
        assert!((plan.cores_used - 1.5).abs() < 1e-9);
        // Fewer cores than threads (waiting for reads): the rate measured stands.
        let sample = SampleProfile { cpu_seconds: 1.0, ..self::sample() };
        assert_eq!(Plan::of(&images(), &sample, &ask(None)).rate_per_worker, 500.0);
    }

    #[test]
    fn the_step_what_if_waits_for_data_until_the_target_count() {
        // 32 rows every 16 ms: 2000 elements/s, 4 workers of 500.
        let plan = Plan::of(&images(), &sample(), &ask(Some(Target::Step { ms: 16.0 })));
        assert_eq!(plan.target_rate, Some(2000.0));
        let step = plan.step.unwrap();
        let counts: Vec<u32> = step.at.iter().map(|a| a.workers).collect();
        assert_eq!(counts, [1, 2, 4]);
        // One worker: a batch every 64 ms, 16 of them computing.
        assert!((step.at[0].step_ms - 64.0).abs() < 1e-9 && (step.at[0].stall - 0.75).abs() < 1e-9);
        assert!((step.at[1].stall - 0.5).abs() < 1e-9);
        assert_eq!((step.at[2].step_ms, step.at[2].stall), (16.0, 0.0));
        // Capped by workers.max: the what-if stops there, still waiting.
        let plan = Plan::of(&images(), &sample(), &ask(Some(Target::Step { ms: 4.0 })));
        let last = *plan.step.unwrap().at.last().unwrap();
        assert_eq!(last.workers, 6);
        assert!(last.stall > 0.0);
    }

    #[test]
    fn the_cache_verdict_and_what_each_hint_saves() {
        let plan = Plan::of(&images(), &sample(), &ask(None));
        let cache = plan.cache.unwrap();
        assert_eq!(cache.workers, 2);
        assert_eq!(cache.hints.len(), 1);
        let h = cache.hints[0];
        assert_eq!(h.at, 2);
        assert_eq!(h.bytes_per_element, 12_288.0);
        assert_eq!(h.epoch_bytes, 12_288.0 * 10_000.0);
        // Decode and resize are 1.7 of the ops' 1.9 s.
        assert!((h.saves_share - 1.7 / 1.9).abs() < 1e-9);
        // Reading 12 kB an element at 400 MB/s beats computing 1.7 ms of it on two workers.
        assert_eq!(cache.decision.choice, autocache::Choice::Put { at: 2 });
        // Without a probed volume, no verdict.
        let unprobed = SampleProfile { cache_volume: None, ..sample() };
        assert_eq!(Plan::of(&images(), &unprobed, &ask(None)).cache, None);
    }

    #[test]
    fn advice_follows_the_measurements() {
        let crop = spec("- decodeImage: {channels: 3}\n- randomResizedCrop: {size: [32, 32]}\n", "imageFolder");
        let mut sample = sample();
        sample.ops.truncate(2);
        // Restart markers halve the decode and crop (1.7 ms to 0.85): 0.85 of the 2 ms a row saved.
        sample.restart_markers = Some(RestartMarkersWhatIf {
            decode_index: 0,
            images: 32,
            micros_as_they_are: 1700.0,
            micros_with_markers: 850.0,
        });
        let plan = Plan::of(&crop, &sample, &ask(Some(Target::Rate(1700.0))));
        assert_eq!(plan.advice.len(), 1, "{:?}", plan.advice);
        assert!(plan.advice[0].starts_with("Restart markers: "), "{}", plan.advice[0]);
        assert!(
            plan.advice[0]
                .contains("about 870 elements/s a worker instead of 500: 2 workers for the target instead of 4"),
            "{}",
            plan.advice[0]
        );
        sample.restart_markers.as_mut().unwrap().micros_with_markers = 1650.0;
        let plan = Plan::of(&crop, &sample, &ask(None));
        assert!(plan.advice[0].starts_with("Restart markers would not help: "), "{}", plan.advice[0]);

        // JSON lines parsed for 60% of the time: Parquet.
        let text = spec("- tokenize: {field: text, tokenizer: /t.json}\n", "jsonl");
        let sample = SampleProfile {
            ops: vec![SampledOp {
                totals: OpTotals { seconds: 0.8, elements_in: 1000, elements_out: 1000 },
                bytes_per_element: None,
            }],
            skipped: 3,
            ..self::sample()
        };
        let plan = Plan::of(&text, &sample, &ask(None));
        assert!(plan.advice[0].starts_with("Format: 60% of a worker's time is outside the ops"), "{:?}", plan.advice);
        assert!(plan.advice[1].starts_with("3 of the sample's 1000 records were skipped"), "{:?}", plan.advice);
    }
}
