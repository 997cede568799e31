//! Batches and bytes this worker's streams handed to their connections, per job: what the
//! metrics show per client. Jobs are the readers' names, so the set is capped: past
//! [`MAX_JOBS`] names, more jobs count under [`OTHER_JOBS`].

use std::collections::BTreeMap;
use std::sync::Mutex;

use stoker_api::JobName;

/// The most jobs counted by name.
pub const MAX_JOBS: usize = 64;
/// The label the jobs past [`MAX_JOBS`] share.
pub const OTHER_JOBS: &str = "(other)";

#[derive(Default, Debug)]
pub struct SentByJob(Mutex<BTreeMap<String, Sent>>);

#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct Sent {
    pub batches: u64,
    pub bytes: u64,
}

impl SentByJob {
    pub fn count(&self, job: &JobName, bytes: u64) {
        let mut jobs = self.0.lock().unwrap();
        let key = if jobs.contains_key(job.as_str()) || jobs.len() < MAX_JOBS { job.as_str() } else { OTHER_JOBS };
        // Per batch: a new key only the first time a job is seen.
        if !jobs.contains_key(key) {
            jobs.insert(key.to_string(), Sent::default());
        }
        let sent = jobs.get_mut(key).expect("inserted above");
        sent.batches += 1;
        sent.bytes += bytes;
    }

    pub fn snapshot(&self) -> BTreeMap<String, Sent> {
        self.0.lock().unwrap().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_past_the_cap_share_one_label() {
        let sent = SentByJob::default();
        for i in 0..MAX_JOBS + 10 {
            sent.count(&JobName::from(format!("job-{i}").as_str()), 100);
        }
        sent.count(&JobName::from("job-0"), 50);
        let snapshot = sent.snapshot();
        assert_eq!(snapshot.len(), MAX_JOBS + 1);
        assert_eq!(snapshot["job-0"], Sent { batches: 2, bytes: 150 });
        assert_eq!(snapshot[OTHER_JOBS], Sent { batches: 10, bytes: 1000 });
    }
}
