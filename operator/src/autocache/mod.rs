//! The autocache decision, pure: measured profiles in, a choice out.
//!
//! For each `autocache` hint the first epoch measures, per element, the worker-seconds spent
//! up to the hint and the bytes produced there; the cache volume's real sequential write and
//! read throughput is probed (no table of storage speeds). Predicted epoch times:
//!
//! - compute everything: E * t_total / (N * C), with N workers of C threads each;
//! - read at hint h: reading E * bytes_h through the volume's bandwidth, shared by all N
//!   workers, overlapped with computing the rest: max(E * bytes_h / read, E * (t_total - t_h) / (N * C));
//! - write at h (the epoch that fills the cache): max(compute everything, E * bytes_h / write).
//!
//! Put at the hint whose read epoch is fastest, if the saving of one read epoch pays for the
//! write epoch's extra cost; else compute. `Always` caches at the last hint regardless;
//! `Never` never.

use stoker_api::CacheMode;

/// What the first epoch measured at one hint.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HintProfile {
    /// Index of the hint in spec.transforms.
    pub at: u32,
    /// Worker-seconds per element spent up to the hint.
    pub prefix_seconds: f64,
    /// Bytes per element at the hint.
    pub bytes: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    pub elements: f64,
    /// Worker-seconds per element for the whole pipeline.
    pub total_seconds: f64,
    pub hints: Vec<HintProfile>,
    /// Workers and threads per worker the next epochs will run with.
    pub workers: u32,
    pub threads: u32,
    /// The cache volume's probed throughput, bytes per second (shared by all workers).
    pub write_bytes_per_second: f64,
    pub read_bytes_per_second: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Choice {
    Compute,
    Put { at: u32 },
}

/// The choice and the numbers behind it, for status and the Event.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub choice: Choice,
    pub compute_epoch_seconds: f64,
    /// Predicted epoch reading the cache at the chosen hint, and the epoch writing it.
    pub read_epoch_seconds: Option<f64>,
    pub write_epoch_seconds: Option<f64>,
    pub reason: String,
}

impl Profile {
    fn parallel(&self) -> f64 {
        // In f64: a worker may register any thread count, and the product must not overflow.
        f64::from(self.workers.max(1)) * f64::from(self.threads.max(1))
    }

    pub fn compute_epoch(&self) -> f64 {
        self.elements * self.total_seconds / self.parallel()
    }

    pub fn read_epoch(&self, h: &HintProfile) -> f64 {
        let read = self.elements * h.bytes / self.read_bytes_per_second.max(1.0);
        let rest = self.elements * (self.total_seconds - h.prefix_seconds).max(0.0) / self.parallel();
        read.max(rest)
    }

    pub fn write_epoch(&self, h: &HintProfile) -> f64 {
        self.compute_epoch().max(self.elements * h.bytes / self.write_bytes_per_second.max(1.0))
    }
}

pub fn decide(mode: CacheMode, profile: &Profile) -> Decision {
    let compute = profile.compute_epoch();
    let numbers = |choice: Choice, h: Option<&HintProfile>, reason: String| Decision {
        choice,
        compute_epoch_seconds: compute,
        read_epoch_seconds: h.map(|h| profile.read_epoch(h)),
        write_epoch_seconds: h.map(|h| profile.write_epoch(h)),
        reason,
    };
    match mode {
        CacheMode::Never => numbers(Choice::Compute, None, "cache mode Never".into()),
        CacheMode::Always => match profile.hints.iter().max_by_key(|h| h.at) {
            Some(h) => numbers(
                Choice::Put { at: h.at },
                Some(h),
                format!("cache mode Always: the last hint, transform {}", h.at),
            ),
            None => numbers(Choice::Compute, None, "cache mode Always, but the pipeline has no autocache hint".into()),
        },
        CacheMode::Auto => {
            // On a tie the later hint wins: it saves more of the work that follows.
            let best =
                profile.hints.iter().rev().min_by(|a, b| profile.read_epoch(a).total_cmp(&profile.read_epoch(b)));
            match best {
                Some(h) => {
                    let (read, write) = (profile.read_epoch(h), profile.write_epoch(h));
                    let saving = compute - read;
                    let cost = write - compute;
                    if saving > 0.0 && saving > cost {
                        let reason = format!(
                            "reading at transform {} is predicted to take {read:.1} s an epoch instead of {compute:.1} s (writing it: {write:.1} s once)",
                            h.at
                        );
                        numbers(Choice::Put { at: h.at }, Some(h), reason)
                    } else {
                        let reason = format!(
                            "computing ({compute:.1} s an epoch) beats reading at transform {} ({read:.1} s, writing {write:.1} s once)",
                            h.at
                        );
                        numbers(Choice::Compute, Some(h), reason)
                    }
                }
                None => numbers(Choice::Compute, None, "the pipeline has no autocache hint".into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(hints: Vec<HintProfile>, read: f64, write: f64) -> Profile {
        Profile {
            elements: 1_000_000.0,
            total_seconds: 0.004,
            hints,
            workers: 4,
            threads: 4,
            write_bytes_per_second: write,
            read_bytes_per_second: read,
        }
    }

    #[test]
    fn any_worker_and_thread_counts_give_a_decision() {
        // The dispatcher's fuzz test found workers * threads overflowing u32 (a worker
        // registered with 2^32 - 1 threads): a panic in the heartbeat's handler.
        let mut p = profile(vec![HintProfile { at: 2, prefix_seconds: 0.0035, bytes: 150e3 }], 2e9, 1e9);
        (p.workers, p.threads) = (u32::MAX, u32::MAX);
        let d = decide(CacheMode::Auto, &p);
        assert!(d.compute_epoch_seconds > 0.0 && d.compute_epoch_seconds.is_finite(), "{d:?}");
    }

    #[test]
    fn an_expensive_prefix_and_a_cheap_read_is_put_at_that_hint() {
        // Decode + resize take 3.5 of 4 ms; 150 KB per element at the hint; a 2 GB/s volume.
        let p = profile(vec![HintProfile { at: 2, prefix_seconds: 0.0035, bytes: 150e3 }], 2e9, 1e9);
        let d = decide(CacheMode::Auto, &p);
        assert_eq!(d.choice, Choice::Put { at: 2 }, "{d:?}");
        assert!(d.read_epoch_seconds.unwrap() < d.compute_epoch_seconds / 2.0);
    }

    #[test]
    fn a_prefix_that_expands_the_data_20x_on_a_slow_volume_is_computed() {
        // 100 KB JPEGs decoded to 2 MB float tensors, on a 200 MB/s volume.
        let p = profile(vec![HintProfile { at: 1, prefix_seconds: 0.002, bytes: 2e6 }], 200e6, 200e6);
        let d = decide(CacheMode::Auto, &p);
        assert_eq!(d.choice, Choice::Compute, "{d:?}");
    }

    #[test]
    fn of_two_hints_the_one_with_the_fastest_read_epoch_wins() {
        let early = HintProfile { at: 1, prefix_seconds: 0.001, bytes: 100e3 };
        let late = HintProfile { at: 3, prefix_seconds: 0.0035, bytes: 150e3 };
        let d = decide(CacheMode::Auto, &profile(vec![early, late], 2e9, 1e9));
        assert_eq!(d.choice, Choice::Put { at: 3 }, "{d:?}");
        // When the later hint's data is 30x larger, on a 200 MB/s volume the earlier hint
        // wins: reading 20 KB per element takes 100 s an epoch, 600 KB takes 3000 s.
        let early = HintProfile { at: 1, prefix_seconds: 0.003, bytes: 20e3 };
        let late = HintProfile { at: 3, prefix_seconds: 0.0035, bytes: 600e3 };
        let d = decide(CacheMode::Auto, &profile(vec![early, late], 200e6, 200e6));
        assert_eq!(d.choice, Choice::Put { at: 1 }, "{d:?}");
        assert!((d.read_epoch_seconds.unwrap() - 100.0).abs() < 1e-6, "{d:?}");
    }

    #[test]
    fn modes_always_and_never_ignore_the_numbers() {
        let hints = vec![
            HintProfile { at: 1, prefix_seconds: 0.0, bytes: 1e9 },
            HintProfile { at: 4, prefix_seconds: 0.0, bytes: 1e9 },
        ];
        let p = profile(hints, 1e6, 1e6);
        assert_eq!(decide(CacheMode::Always, &p).choice, Choice::Put { at: 4 });
        assert_eq!(decide(CacheMode::Never, &p).choice, Choice::Compute);
        assert_eq!(decide(CacheMode::Auto, &p).choice, Choice::Compute);
    }
}
pub mod plan;
