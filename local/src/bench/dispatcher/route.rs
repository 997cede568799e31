//! How a simulated worker's completions reach its pipeline's clients: a real worker sends a
//! split's completion behind its last batch to whichever client streams it; here each
//! completion goes to the next client of the pipeline in turn.

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::mpsc;

/// A split a worker finished, and the dispatcher that handed it out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Completion {
    pub epoch: u64,
    pub split: u64,
    pub incarnation: u64,
}

/// One pipeline's clients.
pub struct Route {
    clients: Vec<mpsc::UnboundedSender<Completion>>,
    turn: AtomicUsize,
}

impl Route {
    pub fn new(clients: Vec<mpsc::UnboundedSender<Completion>>) -> Route {
        Route { clients, turn: AtomicUsize::new(0) }
    }

    /// Sends `completion` to a client of the pipeline; a client that stopped drops it.
    pub fn send(&self, worker: usize, completion: Completion) {
        if self.clients.is_empty() {
            return;
        }
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        let _ = self.clients[worker.wrapping_add(turn) % self.clients.len()].send(completion);
    }
}
