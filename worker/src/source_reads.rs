//! What was read from one source: bytes, and the time its requests took (summed: requests in
//! flight at once each count), for the worker's metrics. Whole-object reads (`source`) and a
//! Parquet file's ranged reads (`formats::parquet`) both count into it.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Default, Debug)]
pub struct SourceReads {
    pub bytes: AtomicU64,
    pub nanos: AtomicU64,
}

impl SourceReads {
    pub fn add(&self, bytes: u64, took: std::time::Duration) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.nanos.fetch_add(took.as_nanos().min(u128::from(u64::MAX)) as u64, Ordering::Relaxed);
    }
}
