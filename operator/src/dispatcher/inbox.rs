//! The clients' batch-time windows, kept until the scaling loop takes them, grouped by the
//! (pipeline, job) they measure.

use std::collections::BTreeMap;

use stoker_api::window::Window;
use stoker_api::{ClientId, JobName};

use super::members::Client;
use crate::key::PipelineKey;

/// A client that reports but is never read (no scaling loop) would otherwise grow this
/// without bound.
const MAX_WINDOWS_PER_CLIENT: usize = 64;

/// What the autoscaler sees of one (pipeline, job).
#[derive(Clone, Debug, PartialEq)]
pub struct JobWindows {
    pub pipeline: PipelineKey,
    pub job: JobName,
    pub consumers: usize,
    /// Windows reported since the last call, from all the job's consumers.
    pub windows: Vec<Window>,
}

/// Windows not yet taken, per client id.
#[derive(Default)]
pub struct Inbox {
    windows: BTreeMap<ClientId, Vec<Window>>,
}

impl Inbox {
    pub fn push(&mut self, client: &ClientId, window: Window) {
        let windows = self.windows.entry(client.clone()).or_default();
        if windows.len() >= MAX_WINDOWS_PER_CLIENT {
            windows.remove(0);
        }
        windows.push(window);
    }

    /// A client that left: its windows go with it.
    pub fn forget(&mut self, client: &ClientId) {
        self.windows.remove(client);
    }

    /// Every (pipeline, job) with live `clients`, with the windows reported since the last call.
    pub fn take<'a>(&mut self, clients: impl IntoIterator<Item = (&'a ClientId, &'a Client)>) -> Vec<JobWindows> {
        let mut by_job: BTreeMap<(PipelineKey, JobName), JobWindows> = BTreeMap::new();
        for (id, client) in clients {
            let entry = by_job.entry((client.pipeline.clone(), client.job.clone())).or_insert_with(|| JobWindows {
                pipeline: client.pipeline.clone(),
                job: client.job.clone(),
                consumers: 0,
                windows: Vec::new(),
            });
            entry.consumers += 1;
            entry.windows.append(self.windows.entry(id.clone()).or_default());
        }
        by_job.into_values().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(batches: u64) -> Window {
        Window { workers: 1, batches, median_s: 0.1, p90_s: 0.1, mean_s: 0.1, wait_fraction: 0.0 }
    }

    #[test]
    fn a_silent_reader_keeps_only_the_newest_windows() {
        let mut inbox = Inbox::default();
        for b in 0..100 {
            inbox.push(&"c".into(), window(b));
        }
        let client = Client {
            pipeline: PipelineKey::new("ns", "p"),
            job: "j".into(),
            consumer_index: 0,
            last_seen: std::time::Instant::now(),
        };
        let id = ClientId::from("c");
        let taken = inbox.take([(&id, &client)]);
        let batches: Vec<u64> = taken[0].windows.iter().map(|w| w.batches).collect();
        assert_eq!(batches, (36..100).collect::<Vec<_>>());
        assert!(inbox.take([(&id, &client)])[0].windows.is_empty(), "taken once");
    }
}
