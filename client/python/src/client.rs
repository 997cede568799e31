//! `_core.Client`: a `stoker_client::Client` and the tokio runtime it runs on, usable from any
//! Python thread of the process that made it. Waiting for a batch releases the GIL; `close()`
//! ends a wait at once; a client carried into a forked child raises there instead of touching
//! a runtime whose threads stayed in the parent.

use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use stoker_client::{Batch, ClientOptions, Error};
use tokio::sync::Notify;

use crate::convert;

/// How long a wait for a batch runs before Python's signal handlers get a turn (Ctrl-C).
const SIGNAL_CHECK: Duration = Duration::from_millis(100);

/// How long `close()` waits for the dispatcher to hear that the client leaves.
const GOODBYE: Duration = Duration::from_secs(5);

#[pyclass(module = "stoker_client._core", name = "Client", frozen)]
pub struct PyClient {
    /// Dropped by hand: in a forked child it is leaked, never shut down (its threads are in the
    /// parent).
    runtime: ManuallyDrop<tokio::runtime::Runtime>,
    /// None once closed.
    client: Mutex<Option<stoker_client::Client>>,
    closed: AtomicBool,
    closing: Notify,
    /// The process that made it.
    pid: u32,
    dispatched: bool,
}

/// What one wait for a batch gave.
enum Waited {
    Item(Option<Result<Batch, Error>>),
    Closed,
    /// Nothing yet: time to check for signals.
    Nothing,
}

#[pymethods]
impl PyClient {
    /// Connects to `workers` (a fixed list) or registers with the dispatcher at `dispatcher`;
    /// `options` are `ClientOptions`' fields by name (see `convert::options`).
    #[new]
    #[pyo3(signature = (namespace, pipeline, workers = None, dispatcher = None, **options))]
    fn new(
        py: Python<'_>,
        namespace: String,
        pipeline: String,
        workers: Option<Vec<String>>,
        dispatcher: Option<String>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let mut o = ClientOptions::new(namespace, pipeline);
        // Python's default: batches from a worker on this host through shared memory.
        o.shared_memory = Some(PathBuf::from(stoker_client::shared::DIRECTORY));
        if let Some(options) = options {
            convert::options(&mut o, options)?;
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("stoker-client")
            .enable_all()
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("starting the client's runtime: {e}")))?;
        let made = py.detach(|| {
            runtime.block_on(async {
                match (workers, &dispatcher) {
                    (Some(workers), None) => stoker_client::Client::connect(workers, o).await,
                    (None, Some(url)) => stoker_client::Client::from_dispatcher(url, o).await,
                    _ => Err(Error::InvalidOptions("give either workers or a dispatcher".into())),
                }
            })
        });
        let client = match made {
            Ok(client) => client,
            Err(e) => {
                runtime.shutdown_background();
                return Err(convert::error(py, e));
            }
        };
        Ok(PyClient {
            runtime: ManuallyDrop::new(runtime),
            client: Mutex::new(Some(client)),
            closed: AtomicBool::new(false),
            closing: Notify::new(),
            pid: std::process::id(),
            dispatched: dispatcher.is_some(),
        })
    }

    /// The next batch as `convert::batch` gives it; None at the end (of the epoch with
    /// `in_epoch`, of every stream with a fixed list) or once closed.
    fn next(&self, py: Python<'_>, in_epoch: bool) -> PyResult<Option<Py<PyAny>>> {
        self.here()?;
        loop {
            let waited = py.detach(|| {
                if self.closed.load(Ordering::Acquire) {
                    return Waited::Closed;
                }
                let mut guard = self.client.lock().unwrap();
                let Some(client) = guard.as_mut() else { return Waited::Closed };
                self.runtime.block_on(async {
                    let next = async { if in_epoch { client.next_in_epoch().await } else { client.next().await } };
                    tokio::select! {
                        item = next => Waited::Item(item),
                        _ = self.closing.notified() => Waited::Closed,
                        _ = tokio::time::sleep(SIGNAL_CHECK) => Waited::Nothing,
                    }
                })
            });
            match waited {
                Waited::Item(Some(Ok(batch))) => return convert::batch(py, batch).map(Some),
                Waited::Item(Some(Err(e))) => return Err(convert::error(py, e)),
                Waited::Item(None) | Waited::Closed => return Ok(None),
                Waited::Nothing => py.check_signals()?,
            }
        }
    }

    /// Under the dispatcher, the epoch being read; with a fixed list 0.
    #[getter]
    fn epoch(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |c| c.epoch())
    }

    #[getter]
    fn open_epoch(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |c| c.open_epoch())
    }

    #[getter]
    fn dropped_rows(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |c| c.dropped_rows())
    }

    #[getter]
    fn dispatched(&self) -> bool {
        self.dispatched
    }

    /// Batches ready in the queue being read.
    fn ready(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |c| c.ready())
    }

    /// Under the dispatcher, the consumer's state as a dict that survives JSON.
    fn state(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        if !self.dispatched {
            return Err(PyTypeError::new_err("state needs the dispatcher"));
        }
        let state = self.with(py, |c| c.state())?.ok_or_else(|| PyRuntimeError::new_err("the client is closed"))?;
        convert::state_to_py(py, &state)
    }

    /// (batches, median, p90, total batch time, total wait, wait fraction), times in seconds.
    fn window(&self, py: Python<'_>) -> PyResult<(u64, f64, f64, f64, f64, f64)> {
        let w = self.with(py, |c| c.window())?;
        let s = |d: Duration| d.as_secs_f64();
        Ok((w.batches, s(w.median), s(w.p90), s(w.total_batch_time), s(w.total_wait), w.wait_fraction))
    }

    fn reset_window(&self, py: Python<'_>) -> PyResult<()> {
        self.here()?;
        py.detach(|| {
            if let Some(c) = self.client.lock().unwrap().as_mut() {
                c.reset_window();
            }
        });
        Ok(())
    }

    /// Stops every stream; under the dispatcher tells it the client leaves (waiting a few
    /// seconds at most for it to hear). Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        if std::process::id() != self.pid {
            // A forked child's copy: the parent's streams are the parent's to close.
            return Ok(());
        }
        self.closed.store(true, Ordering::Release);
        self.closing.notify_waiters();
        py.detach(|| {
            let client = self.client.lock().unwrap().take();
            if let Some(client) = client {
                self.runtime.block_on(client.close(GOODBYE));
            }
        });
        Ok(())
    }
}

impl PyClient {
    /// Fails in any process but the one that made the client.
    fn here(&self) -> PyResult<()> {
        if std::process::id() == self.pid {
            return Ok(());
        }
        Err(PyRuntimeError::new_err(format!(
            "this Stoker client was made in process {} and carried into process {} by a fork: \
             make a new client in this process (a DataLoader worker process makes its own)",
            self.pid,
            std::process::id()
        )))
    }

    /// `f` of the client, without the GIL (a `next()` in another thread may hold the client
    /// for up to `SIGNAL_CHECK`); a closed client's values are those of none.
    fn with<T: Default + Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&stoker_client::Client) -> T + Send,
    ) -> PyResult<T> {
        self.here()?;
        Ok(py.detach(|| self.client.lock().unwrap().as_ref().map(f).unwrap_or_default()))
    }
}

impl Drop for PyClient {
    fn drop(&mut self) {
        // SAFETY: taken once, here, and never used again.
        let runtime = unsafe { ManuallyDrop::take(&mut self.runtime) };
        if std::process::id() != self.pid {
            // A forked child: the runtime's threads and the client's connections are the
            // parent's; touching them here could hang.
            std::mem::forget(runtime);
            std::mem::forget(self.client.get_mut().map(Option::take));
            return;
        }
        let client = self.client.get_mut().ok().and_then(Option::take);
        {
            // Dropping the client aborts its streams and tells its follower to say goodbye,
            // which needs the runtime's context.
            let _entered = runtime.enter();
            drop(client);
        }
        runtime.shutdown_background();
    }
}
