//! The engine's side of autocache: the fingerprints of the pipeline's hints, what one split
//! does with the cache (the dispatcher's directive), and the counters the dispatcher decides
//! from. The files themselves are `cache::store`'s.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use stoker_api::fingerprint::{CACHE_FORMAT_VERSION, ShardVersion, fingerprint};
use stoker_api::{Transform, WorkerPipeline, proto};

use crate::cache::store::{CacheDir, Entry, LeaseKind, Throughput};
use crate::source::Shard;

/// A lease older than this is a holder that died.
const LEASE_TTL: Duration = Duration::from_secs(60);
/// An incomplete entry nobody wrote to for this long was abandoned (a killed writer, or a
/// decision against caching), and is removed.
const INCOMPLETE_TTL: Duration = Duration::from_secs(600);
/// Bytes written and read back to measure the volume.
pub const PROBE_BYTES: usize = 64 << 20;

#[derive(Clone, Debug)]
pub struct CacheConfig {
    pub dir: PathBuf,
    /// Entries are evicted, least recently used first, while the volume holds more.
    pub cap_bytes: u64,
}

/// What one split does with the cache.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum SplitCache {
    #[default]
    Compute,
    /// Compute, and write the elements at hint `at` (unless the entry has the split already).
    Put { at: u32, fingerprint: String },
    /// Read the elements at hint `at` and run only the transforms after it.
    Get { at: u32, fingerprint: String },
}

impl SplitCache {
    pub fn from_directive(d: Option<&proto::CacheDirective>) -> SplitCache {
        use proto::cache_directive::Action;
        match d.map(|d| (d.action(), d)) {
            Some((Action::Put, d)) => SplitCache::Put { at: d.at, fingerprint: d.fingerprint.clone() },
            Some((Action::Get, d)) => SplitCache::Get { at: d.at, fingerprint: d.fingerprint.clone() },
            _ => SplitCache::Compute,
        }
    }
}

pub struct EngineCache {
    dir: CacheDir,
    cap_bytes: u64,
    /// Names this process in tmp files and leases.
    holder: String,
    splits: u64,
    /// (transform index, fingerprint) of each autocache hint, in pipeline order.
    pub hints: Vec<(u32, String)>,
    hint_bytes: Mutex<Vec<proto::HintBytes>>,
    splits_measured: AtomicU64,
    splits_written: AtomicU64,
    splits_read: AtomicU64,
    elements_read: AtomicU64,
    complete: Mutex<BTreeSet<String>>,
    corrupt: Mutex<Option<(String, String)>>,
    probe: Mutex<Option<Throughput>>,
}

impl EngineCache {
    pub fn new(
        config: &CacheConfig,
        pipeline: &WorkerPipeline,
        shards: &[Shard],
        listing_order: Option<u64>,
        splits: u64,
    ) -> std::io::Result<EngineCache> {
        let dir = CacheDir::open(&config.dir)?;
        let versions: Vec<ShardVersion> = shards
            .iter()
            .map(|s| ShardVersion { name: s.path.clone(), size: s.size, version: s.version.clone() })
            .collect();
        let hints = pipeline
            .data_plane
            .transforms
            .iter()
            .enumerate()
            .filter(|(_, t)| matches!(t, Transform::Autocache(_)))
            .map(|(at, _)| {
                (
                    at as u32,
                    fingerprint(
                        &pipeline.data_plane.source.describe(),
                        pipeline.data_plane.source.format,
                        &pipeline.data_plane.source.columns,
                        &versions,
                        listing_order,
                        &pipeline.data_plane.transforms,
                        at,
                    ),
                )
            })
            .collect();
        let cache = EngineCache {
            dir,
            cap_bytes: config.cap_bytes,
            holder: format!("{}-{}", hostname(), std::process::id()),
            splits,
            hints,
            hint_bytes: Mutex::default(),
            splits_measured: AtomicU64::new(0),
            splits_written: AtomicU64::new(0),
            splits_read: AtomicU64::new(0),
            elements_read: AtomicU64::new(0),
            complete: Mutex::default(),
            corrupt: Mutex::default(),
            probe: Mutex::default(),
        };
        cache.evict();
        Ok(cache)
    }

    /// Measures the volume (once, in the background of the first epoch).
    pub fn probe(&self) {
        match self.dir.probe(PROBE_BYTES) {
            Ok(t) => {
                tracing::info!(
                    write_mb_s = t.write_bytes_per_second / 1e6,
                    read_mb_s = t.read_bytes_per_second / 1e6,
                    "probed the cache volume"
                );
                *self.probe.lock().unwrap() = Some(t);
            }
            Err(e) => {
                tracing::warn!(error = %e, "probing the cache volume failed; the cache decision waits for a probe")
            }
        }
    }

    pub fn entry(&self, fingerprint: &str) -> Entry {
        self.dir.entry(fingerprint)
    }

    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// The hints and whether their entries are complete, for registering with the dispatcher.
    pub fn seen(&self) -> Vec<proto::CacheHint> {
        self.hints
            .iter()
            .map(|(at, fp)| proto::CacheHint {
                at: *at,
                fingerprint: fp.clone(),
                complete: self.dir.entry(fp).is_complete(),
            })
            .collect()
    }

    pub fn progress(&self) -> proto::CacheProgress {
        let probe = *self.probe.lock().unwrap();
        let corrupt = self.corrupt.lock().unwrap().clone().unwrap_or_default();
        proto::CacheProgress {
            hints: self.hint_bytes.lock().unwrap().clone(),
            write_bytes_per_second: probe.as_ref().map_or(0.0, |p| p.write_bytes_per_second),
            read_bytes_per_second: probe.as_ref().map_or(0.0, |p| p.read_bytes_per_second),
            complete: self.complete.lock().unwrap().iter().cloned().collect(),
            corrupt: corrupt.0,
            corrupt_detail: corrupt.1,
            splits_written: self.splits_written.load(Ordering::Relaxed),
            splits_read: self.splits_read.load(Ordering::Relaxed),
            elements_read: self.elements_read.load(Ordering::Relaxed),
            splits_measured: self.splits_measured.load(Ordering::Relaxed),
        }
    }

    /// A split computed from the source, with the elements and bytes measured at its hints.
    pub fn measured(&self, sizes: &[proto::HintBytes]) {
        let mut hint_bytes = self.hint_bytes.lock().unwrap();
        for size in sizes {
            proto::HintBytes::add_into(&mut hint_bytes, size);
        }
        self.splits_measured.fetch_add(1, Ordering::Relaxed);
    }

    /// A split's chunk file is in place: the entry completes if it was the last one.
    pub fn written(&self, fingerprint: &str, at: u32) {
        self.splits_written.fetch_add(1, Ordering::Relaxed);
        let entry = self.dir.entry(fingerprint);
        match entry.try_complete(self.splits, at, CACHE_FORMAT_VERSION) {
            Ok(true) => {
                if self.complete.lock().unwrap().insert(fingerprint.to_string()) {
                    tracing::info!(%fingerprint, at, "cache entry complete");
                }
                self.evict();
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(%fingerprint, error = %e, "completing the cache entry failed"),
        }
    }

    pub fn read(&self, elements: u64) {
        self.splits_read.fetch_add(1, Ordering::Relaxed);
        self.elements_read.fetch_add(elements, Ordering::Relaxed);
    }

    /// Takes a lease on the entry for the split about to be read or written.
    pub fn lease(&self, entry: &Entry, kind: LeaseKind) {
        let now = SystemTime::now();
        let result = match kind {
            LeaseKind::Reader => entry.touch_used(now).and_then(|()| entry.lease(kind, &self.holder, now)),
            LeaseKind::Writer => entry.lease(kind, &self.holder, now),
        };
        if let Err(e) = result {
            tracing::warn!(entry = %entry.dir().display(), error = %e, "taking a cache lease failed");
        }
    }

    /// A record failed its checksum: nobody may read the entry again.
    pub fn corrupt(&self, fingerprint: &str, detail: String) {
        tracing::error!(%fingerprint, %detail, "corrupt cache entry: dropping it and computing instead");
        if let Err(e) = self.dir.entry(fingerprint).drop_corrupt() {
            tracing::warn!(%fingerprint, error = %e, "dropping the corrupt cache entry failed");
        }
        self.complete.lock().unwrap().remove(fingerprint);
        *self.corrupt.lock().unwrap() = Some((fingerprint.to_string(), detail));
    }

    fn evict(&self) {
        match self.dir.evict(self.cap_bytes, SystemTime::now(), LEASE_TTL, INCOMPLETE_TTL) {
            Ok(evicted) => {
                for e in evicted {
                    tracing::info!(fingerprint = %e.fingerprint, bytes = e.bytes, reason = %e.reason, "evicted a cache entry");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cache eviction failed"),
        }
    }
}

fn hostname() -> String {
    std::env::var("POD_NAME").or_else(|_| std::env::var("HOSTNAME")).unwrap_or_else(|_| "worker".into())
}
