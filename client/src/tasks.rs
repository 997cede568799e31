//! The client's background tasks: worker streams, and in dispatcher mode the follower that
//! spawns them.

use std::sync::{Arc, Mutex};

use tokio::task::{AbortHandle, JoinHandle};

/// The client's background tasks, stopped when it is dropped. Cloned into the dispatcher
/// follower so that the streams it starts stop with the client too.
#[derive(Clone, Default)]
pub(crate) struct Tasks(Arc<Mutex<Vec<AbortHandle>>>);

impl Tasks {
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) -> AbortHandle {
        let handle = tokio::spawn(task).abort_handle();
        let mut tasks = self.0.lock().unwrap();
        tasks.retain(|t| !t.is_finished());
        tasks.push(handle.clone());
        handle
    }

    /// Like `spawn`, for a task its spawner also waits for.
    pub(crate) fn spawn_joinable(&self, task: impl Future<Output = ()> + Send + 'static) -> JoinHandle<()> {
        let handle = tokio::spawn(task);
        let mut tasks = self.0.lock().unwrap();
        tasks.retain(|t| !t.is_finished());
        tasks.push(handle.abort_handle());
        handle
    }

    pub(crate) fn abort_all(&self) {
        for task in self.0.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}
