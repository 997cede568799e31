//! `stoker-worker profile`: a pipeline run on a sample of its data on this machine, as one
//! worker of the given threads, measured op by op; `stoker profile` (local/src/profile) plans
//! from what it prints. One engine, three steps:
//!
//! 1. a warm-up on the first splits of epoch 1 (page cache, Python processes, the allocator's
//!    arenas), which also measures each element's bytes after every op: the ops run one at a
//!    time there, unfused, so its time is not used;
//! 2. the timed run: epoch 0's splits in the order a worker gets them, until `elements`
//!    records are read (whole splits: at least one);
//! 3. with a `decodeImage` followed by a `randomResizedCrop`: the two timed on the sample's
//!    JPEGs as they are and rewritten with restart markers, on one thread, alternating.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use stoker_api::{
    OpTotals, RestartMarkersWhatIf, SampleProfile, SampledOp, Transform, VolumeThroughput, WorkerPipeline,
};

use crate::apply::{self, ElementKey};
use crate::cache::store::CacheDir;
use crate::cached::PROBE_BYTES;
use crate::cpu_time::process_cpu;
use crate::element::Field;
use crate::engine::{Assigned, Engine, EngineConfig};
use crate::op_tally::OpTally;
use crate::ops::{add_restart_markers, is_jpeg};
use crate::restart_markers::SEGMENT_PX;

/// The JPEGs the restart-marker what-if times, the elements it looks through for them (a
/// corpus of PNGs is not read to its end), and its rounds per side.
const WHAT_IF_IMAGES: usize = 32;
const WHAT_IF_LOOKED_AT: usize = 256;
const WHAT_IF_ROUNDS: usize = 3;

pub struct SampleOptions {
    /// Records the timed run reads (it reads whole splits, at least one).
    pub elements: u64,
    pub threads: usize,
    pub memory_budget: usize,
    /// A directory on the cache volume to probe.
    pub cache_dir: Option<PathBuf>,
}

pub async fn sample(pipeline: WorkerPipeline, options: &SampleOptions) -> anyhow::Result<SampleProfile> {
    let config =
        EngineConfig { threads: options.threads.max(1), memory_budget: options.memory_budget, ..Default::default() };
    let engine = Arc::new(Engine::open(pipeline, config).await.context("opening the pipeline")?);

    engine.measure_op_sizes(true);
    run(&engine, 1, (options.elements / 4).max(1)).await.context("the warm-up run")?;
    engine.measure_op_sizes(false);
    let op_bytes = engine.stats.op_bytes.lock().unwrap().clone();

    let before = Counters::of(&engine);
    let (started, cpu) = (Instant::now(), process_cpu());
    let timed = run(&engine, 0, options.elements.max(1)).await.context("the timed run")?;
    let (wall_seconds, cpu_seconds) = (started.elapsed().as_secs_f64(), process_cpu() - cpu);
    let after = Counters::of(&engine);

    let ops = (after.ops.iter().zip(&before.ops).enumerate())
        .map(|(index, (a, b))| SampledOp {
            totals: OpTotals {
                seconds: a.time.saturating_sub(b.time).as_secs_f64(),
                elements_in: a.elements_in - b.elements_in,
                elements_out: a.elements_out - b.elements_out,
            },
            bytes_per_element: (op_bytes.iter())
                .find(|s| s.at as usize == index && s.elements > 0)
                .map(|s| s.bytes as f64 / s.elements as f64),
        })
        .collect();
    let cache_volume = match &options.cache_dir {
        Some(dir) => Some(probe(dir.clone()).await?),
        None => None,
    };
    let restart_markers = {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || restart_markers_what_if(&engine)).await??
    };
    Ok(SampleProfile {
        threads: engine.threads() as u32,
        splits: engine.mix().slots(),
        splits_sampled: timed.splits,
        records: after.records - before.records,
        rows: timed.rows,
        wall_seconds,
        cpu_seconds,
        read_bytes: after.read_bytes - before.read_bytes,
        batch_bytes: after.batch_bytes - before.batch_bytes,
        skipped: after.skipped - before.skipped,
        warnings: engine.stats.warnings(),
        ops,
        cache_volume,
        restart_markers,
    })
}

/// The engine's running totals, to take a run's share as the difference of two.
struct Counters {
    records: u64,
    batch_bytes: u64,
    skipped: u64,
    read_bytes: u64,
    ops: Vec<OpTally>,
}

impl Counters {
    fn of(engine: &Engine) -> Counters {
        let reads = engine.source_reads();
        Counters {
            records: engine.stats.records.load(Ordering::Relaxed),
            batch_bytes: engine.stats.batch_bytes.load(Ordering::Relaxed),
            skipped: engine.stats.skipped().values().sum(),
            read_bytes: reads.iter().map(|r| r.bytes.load(Ordering::Relaxed)).sum(),
            ops: engine.stats.ops.lock().unwrap().clone(),
        }
    }
}

struct Run {
    splits: u64,
    rows: u64,
}

/// Produces `epoch`'s splits, in the order a worker gets them, until `records` are read;
/// batches are dropped as they come.
async fn run(engine: &Arc<Engine>, epoch: u64, records: u64) -> anyhow::Result<Run> {
    let (tx, rx) = std::sync::mpsc::sync_channel(4);
    let producer = {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || {
            let mut splits = engine.mix().epoch(epoch);
            if let Some(seed) = engine.pipeline().data_plane.shuffle_seed() {
                stoker_api::order::shuffle(&mut splits, seed, epoch, |s| s.id);
            }
            let (stats, from) = (engine.stats.clone(), engine.stats.records.load(Ordering::Relaxed));
            let taken = std::cell::Cell::new(0u64);
            let assigned = (splits.into_iter())
                // Checked as the next split's read starts: the sample ends about a split late.
                .take_while(|_| taken.get() == 0 || stats.records.load(Ordering::Relaxed) - from < records)
                .inspect(|_| taken.set(taken.get() + 1))
                .map(Assigned::whole);
            engine.run_splits(epoch, assigned, &tx)?;
            anyhow::Ok(taken.get())
        })
    };
    let mut rows = 0;
    while let Ok(ready) = tokio::task::block_in_place(|| rx.recv()) {
        rows += ready.batch.rows.len() as u64;
    }
    let splits = producer.await??;
    Ok(Run { splits, rows })
}

async fn probe(dir: PathBuf) -> anyhow::Result<VolumeThroughput> {
    tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let volume = CacheDir::open(&dir).with_context(|| format!("opening {}", dir.display()))?;
        let t = volume.probe(PROBE_BYTES).with_context(|| format!("probing {}", dir.display()))?;
        Ok(VolumeThroughput {
            write_bytes_per_second: t.write_bytes_per_second,
            read_bytes_per_second: t.read_bytes_per_second,
        })
    })
    .await?
}

/// With a `decodeImage` whose next op is a `randomResizedCrop` of its field: the two, timed
/// on the first JPEGs of epoch 0 as they are and with restart markers.
fn restart_markers_what_if(engine: &Engine) -> anyhow::Result<Option<RestartMarkersWhatIf>> {
    let transforms = engine.transforms();
    let Some(decode) = transforms.list.windows(2).position(|pair| match pair {
        [Transform::DecodeImage(d), Transform::RandomResizedCrop(c)] => d.field == c.field,
        _ => false,
    }) else {
        return Ok(None);
    };
    let Transform::DecodeImage(d) = &transforms.list[decode] else { unreachable!("found above") };
    let key = |element: u64| ElementKey { seed: 0, epoch: 0, element };
    let mut tally = OpTally::for_ops(transforms.list.len());
    // The field as the decode gets it: after the ops before it.
    let (mut jpegs, mut looked_at) = (Vec::new(), 0);
    'reading: for split in engine.mix().epoch(0) {
        for element in engine.read_split(&split)? {
            if jpegs.len() == WHAT_IF_IMAGES || looked_at == WHAT_IF_LOOKED_AT {
                break 'reading;
            }
            looked_at += 1;
            let at_decode = apply::apply_range(transforms, 0..decode, element, key(0), &mut tally);
            let Ok(Some(element)) = at_decode else { continue };
            if let Some(bytes) = element.get(&d.field).and_then(Field::as_bytes).filter(|b| is_jpeg(b)) {
                let Ok((with_markers, _)) = add_restart_markers(bytes, SEGMENT_PX) else { continue };
                let mut rewritten = element.clone();
                rewritten.insert(d.field.clone(), Field::Bytes(with_markers.into()));
                jpegs.push((element, rewritten));
            }
        }
    }
    if jpegs.is_empty() {
        return Ok(None);
    }
    let mut time = |rewritten: bool| {
        let started = Instant::now();
        for (i, (as_is, with_markers)) in jpegs.iter().enumerate() {
            let element = if rewritten { with_markers } else { as_is }.clone();
            // Failures cost what they cost in a worker too.
            let _ = apply::apply_range(transforms, decode..decode + 2, element, key(i as u64), &mut tally);
        }
        started.elapsed()
    };
    let (mut as_is, mut with_markers) = (Duration::MAX, Duration::MAX);
    for round in 0..WHAT_IF_ROUNDS {
        for rewritten in if round % 2 == 0 { [false, true] } else { [true, false] } {
            let took = time(rewritten);
            let best = if rewritten { &mut with_markers } else { &mut as_is };
            *best = (*best).min(took);
        }
    }
    let per_image = |d: Duration| d.as_secs_f64() * 1e6 / jpegs.len() as f64;
    Ok(Some(RestartMarkersWhatIf {
        decode_index: decode as u32,
        images: jpegs.len() as u32,
        micros_as_they_are: per_image(as_is),
        micros_with_markers: per_image(with_markers),
    }))
}
