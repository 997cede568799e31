//! What Kubernetes' metrics pipeline gives HPA, read from local processes: the CPU time each
//! worker used, from the scheduler's per-thread accounting (`/proc/<pid>/task/*/schedstat`,
//! nanoseconds; `/proc/<pid>/stat` counts 10 ms ticks, too coarse for a rate-capped worker
//! over a sync period).

use std::collections::BTreeMap;

/// CPU seconds a process's live threads have run so far; None once it is gone.
pub fn process_seconds(pid: u32) -> Option<f64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut nanos = 0u64;
    for task in tasks.flatten() {
        // A thread that ended between the listing and the read simply no longer counts.
        let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else { continue };
        nanos += text.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
    }
    Some(nanos as f64 / 1e9)
}

/// CPU used by a changing set of processes between readings.
#[derive(Default)]
pub struct CpuMeter {
    last: BTreeMap<u32, f64>,
}

impl CpuMeter {
    /// CPU seconds `pids` used since the previous reading; a process first seen counts from
    /// its start (it started since), one gone since is not counted (as a deleted pod's metrics
    /// are not).
    pub fn used_since_last(&mut self, pids: &[u32]) -> f64 {
        let mut now = BTreeMap::new();
        let mut used = 0.0;
        for &pid in pids {
            if let Some(seconds) = process_seconds(pid) {
                used += seconds - self.last.get(&pid).copied().unwrap_or(0.0);
                now.insert(pid, seconds);
            }
        }
        self.last = now;
        used.max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_thread_of_this_process_is_counted() {
        let me = std::process::id();
        let mut meter = CpuMeter::default();
        meter.used_since_last(&[me]);
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < std::time::Duration::from_millis(200) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let used = meter.used_since_last(&[me]);
        // At least most of the 200 ms spun (other tests' threads may add to it).
        assert!(used >= 0.1, "{used} s");
        assert_eq!(process_seconds(u32::MAX), None);
    }
}
