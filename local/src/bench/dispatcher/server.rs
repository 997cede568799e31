//! The dispatcher under load: the operator's dispatcher (same timeouts, same window) served
//! over loopback gRPC by a single-threaded runtime on an OS thread of its own, pinned to one
//! core, so its CPU time is that thread's and nothing of the load generator's. Stopping it
//! drops the runtime: every task and connection ends at once, as when a leader's process dies.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use stoker_operator::autoscaling::ROUND;
use stoker_operator::dispatcher::{self, Dispatcher, Timeouts};
use tokio::sync::oneshot;

use super::usage;

/// How often clients report a window: what the operator tells them (its DISPATCHER_WINDOW).
const WINDOW: Duration = Duration::from_secs(1);

pub struct Served {
    pub addr: SocketAddr,
    pub dispatcher: Arc<Dispatcher>,
    /// The serving thread, for its CPU time.
    tid: i32,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Served {
    /// Starts a dispatcher knowing nothing on `addr` (port 0: any), on `cpu` when given.
    pub fn start(addr: SocketAddr, cpu: Option<usize>) -> anyhow::Result<Served> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<anyhow::Result<(SocketAddr, Arc<Dispatcher>, i32)>>();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("dispatcher".into())
            .spawn(move || {
                if let Some(cpu) = cpu {
                    usage::pin(cpu);
                }
                usage::count_this_thread();
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e).context("building the dispatcher's runtime"));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let listener = match bind(addr).await {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let bound = listener.local_addr().expect("a bound listener has an address");
                    // As the operator makes it: default timeouts, one-second windows.
                    let dispatcher = Dispatcher::new(Timeouts::default(), WINDOW);
                    dispatcher.spawn_expiry();
                    tokio::spawn(control_loop(dispatcher.clone()));
                    let _ = ready_tx.send(Ok((bound, dispatcher.clone(), usage::thread_id())));
                    let serving = dispatcher::serve(listener, dispatcher, None, std::future::pending());
                    tokio::select! {
                        served = serving => if let Err(e) = served {
                            tracing::error!(error = %e, "the benchmarked dispatcher stopped serving");
                        },
                        _ = stopped => {}
                    }
                });
                // The runtime drops here, with every connection's task.
            })
            .context("starting the dispatcher's thread")?;
        let (addr, dispatcher, tid) = ready_rx.recv().context("the dispatcher's thread ended before serving")??;
        Ok(Served { addr, dispatcher, tid, stop: Some(stop), thread: Some(thread) })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// CPU time the dispatcher's thread has used so far.
    pub fn cpu(&self) -> anyhow::Result<Duration> {
        usage::thread_cpu(self.tid)
    }

    /// Ends the dispatcher and every connection to it.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the dispatcher's thread panicked");
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Binds `addr`, waiting a little for a stopped dispatcher's socket to go.
async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => return Ok(l),
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::debug!(%addr, error = %e, "binding: retrying");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("binding {addr}")),
        }
    }
}

/// What the operator's scaling loop asks of the dispatcher every round, on the same core as
/// the RPCs: the clients' windows, and every pipeline's cache, delivery and worker reports.
async fn control_loop(dispatcher: Arc<Dispatcher>) {
    let mut tick = tokio::time::interval(ROUND);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        dispatcher.with_state(|s| {
            let windows = s.take_windows();
            let caches = s.cache_statuses();
            let deliveries = s.delivery_statuses();
            let reports = s.reports();
            std::hint::black_box((windows, caches, deliveries, reports));
        });
    }
}
