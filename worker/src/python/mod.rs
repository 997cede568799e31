//! `python` transforms: the user's functions run in a pool of Python processes beside the
//! Rust ops. Each transform thread that reaches a `python` op takes an idle process (or starts
//! one: at most one per thread, so every core is used and none is oversubscribed), hands it the
//! element through shared memory, and gives it back. A process that hangs past the op's
//! timeout, dies, or grows past its memory limit is dropped (killed) and the element reported;
//! the next call starts a fresh one. No other element is lost.

mod exchange;
mod process;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stoker_api::Transform;

use crate::apply::ElementKey;
use crate::element::Element;
use exchange::{Reply, Request, Shared};
use process::PythonProcess;

/// The most bytes an element the function returns may hold.
const MAX_ELEMENT: usize = stoker_api::bounds::MAX_ELEMENT_BYTES as usize;

/// The `python` ops of a pipeline and the interpreter that runs them.
pub struct PythonOps {
    /// `STOKER_PYTHON`, else `python3`: a Python with numpy.
    pub python: String,
    /// Every op's `path`, in op order, deduplicated.
    pub paths: Vec<String>,
    pub ops: Vec<PythonOp>,
}

pub struct PythonOp {
    pub index: usize,
    pub spec: stoker_api::Python,
}

impl PythonOps {
    /// The pipeline's `python` ops, or None when it has none.
    pub fn of(transforms: &[Transform]) -> Option<PythonOps> {
        let ops: Vec<PythonOp> = transforms
            .iter()
            .enumerate()
            .filter_map(|(index, t)| match t {
                Transform::Python(spec) => Some(PythonOp { index, spec: spec.clone() }),
                _ => None,
            })
            .collect();
        if ops.is_empty() {
            return None;
        }
        let mut paths: Vec<String> = Vec::new();
        for path in ops.iter().filter_map(|op| op.spec.path.clone()) {
            if !paths.contains(&path) {
                paths.push(path);
            }
        }
        let python = std::env::var("STOKER_PYTHON").unwrap_or_else(|_| "python3".into());
        Some(PythonOps { python, paths, ops })
    }
}

/// Why a call gave no element.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Failure {
    /// The function raised; the process lives on.
    #[error("raised {0}")]
    Exception(String),
    #[error("did not return within {0:?}; its process was replaced")]
    Timeout(Duration),
    #[error("its process reached {resident} bytes resident, above the limit of {limit}; it was replaced")]
    Memory { resident: u64, limit: u64 },
    #[error("its process died ({0}); it was replaced")]
    Died(String),
    /// The function's output has no Stoker form or is too large.
    #[error("returned an unusable element: {0}")]
    BadOutput(String),
    /// No process could be started: the same for every element (the engine stops).
    #[error("cannot start Python: {0}")]
    Start(String),
}

impl Failure {
    /// A stable label for metrics and the status summary.
    pub fn reason(&self) -> &'static str {
        match self {
            Failure::Exception(_) => "python_exception",
            Failure::Timeout(_) => "python_timeout",
            Failure::Memory { .. } => "python_memory",
            Failure::Died(_) => "python_died",
            Failure::BadOutput(_) => "python_bad_output",
            Failure::Start(_) => "python_start",
        }
    }
}

pub struct PythonPool {
    ops: PythonOps,
    idle: Mutex<Vec<PythonProcess>>,
    counts: Arc<PythonCounts>,
}

/// What the pool did, for the worker's metrics.
#[derive(Default, Debug)]
pub struct PythonCounts {
    /// Calls per op index (a batched call counts once).
    pub calls: Mutex<BTreeMap<usize, u64>>,
    /// Processes started: the first, one more per thread that found none idle, and each
    /// replacement.
    pub started: AtomicU64,
    /// Processes a call killed (a timeout, its memory limit, a crash, a reply it could not
    /// read): the next call starts a fresh one.
    pub lost: AtomicU64,
}

impl PythonPool {
    /// Starts one process, so that a module that does not import stops the pipeline at once
    /// with the reason rather than failing every element.
    pub fn start(ops: PythonOps) -> Result<PythonPool, String> {
        let first = PythonProcess::start(&ops)?;
        let counts = Arc::new(PythonCounts { started: AtomicU64::new(1), ..Default::default() });
        Ok(PythonPool { ops, idle: Mutex::new(vec![first]), counts })
    }

    /// The pool's counters, shared.
    pub fn counts(&self) -> Arc<PythonCounts> {
        self.counts.clone()
    }

    fn op(&self, index: usize) -> &PythonOp {
        self.ops.ops.iter().find(|op| op.index == index).expect("the pool knows every python op")
    }

    /// One call of op `index` on an idle process (or a new one): `request` lays the input out
    /// in the process's shared memory, `read` turns the reply into the result. A failed call
    /// has killed its process, so only a process that answered goes back to the pool.
    fn exchange<Q: serde::Serialize, R>(
        &self,
        index: usize,
        request: impl FnOnce(&mut Shared) -> std::io::Result<Q>,
        read: impl FnOnce(Reply, &Shared) -> Result<R, Failure>,
    ) -> Result<R, Failure> {
        let op = self.op(index);
        *self.counts.calls.lock().unwrap_or_else(|e| e.into_inner()).entry(index).or_default() += 1;
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut process = match idle {
            Some(p) => p,
            None => {
                let started = PythonProcess::start(&self.ops).map_err(Failure::Start)?;
                self.counts.started.fetch_add(1, Ordering::Relaxed);
                started
            }
        };
        // A process not given back (an early return below) is dropped, which kills it.
        let lost = |failure: Failure| {
            self.counts.lost.fetch_add(1, Ordering::Relaxed);
            failure
        };
        let request = request(process.shared())
            .map_err(|e| lost(Failure::Died(format!("writing the input to shared memory: {e}"))))?;
        let timeout = Duration::from_secs(op.spec.timeout_seconds.into());
        let reply = process.call(&request, timeout, u64::from(op.spec.memory_limit_mib) << 20).map_err(lost)?;
        let result = match reply {
            Reply::Error { error, traceback } => {
                tracing::warn!(op = index, module = %op.spec.module, function = %op.spec.function, %traceback, "a python transform raised");
                Err(Failure::Exception(error))
            }
            reply => read(reply, process.shared()),
        };
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).push(process);
        result
    }

    /// Runs op `index` (a `python` op of the pipeline) on `element`: Some(element), or None
    /// when the function dropped it.
    pub fn call(&self, index: usize, key: ElementKey, element: Element) -> Result<Option<Element>, Failure> {
        let layout = self.op(index).spec.layout;
        self.exchange(
            index,
            |shared| {
                let (fields, out) = exchange::place(element, shared, 0, layout)?;
                let rng = [key.seed, key.epoch, key.element, index as u64];
                Ok(Request { op: index, rng, size: shared.len(), out, fields })
            },
            |reply, shared| match reply {
                Reply::Ok { fields, .. } => {
                    exchange::take(&fields, shared, MAX_ELEMENT).map(Some).map_err(Failure::BadOutput)
                }
                Reply::Drop => Ok(None),
                other => Err(Failure::BadOutput(format!("an unexpected reply {other:?}"))),
            },
        )
    }

    /// Runs batched op `index` on `elements` in one call: one result per element, in order. A
    /// failure of the call (an exception, a timeout, a dead process, a list of the wrong
    /// length) is every element's.
    pub fn call_batch(
        &self,
        index: usize,
        elements: Vec<(ElementKey, Element)>,
    ) -> Vec<Result<Option<Element>, Failure>> {
        let n = elements.len();
        let layout = self.op(index).spec.layout;
        let results = self.exchange(
            index,
            |shared| {
                let (mut placed, mut rngs, mut out) = (Vec::with_capacity(n), Vec::with_capacity(n), 0);
                for (key, element) in elements {
                    let (fields, end) = exchange::place(element, shared, out, layout)?;
                    placed.push(fields);
                    rngs.push([key.seed, key.epoch, key.element, index as u64]);
                    out = end;
                }
                Ok(exchange::BatchRequest { op: index, rngs, size: shared.len(), out, elements: placed })
            },
            |reply, shared| match reply {
                Reply::Ok { elements: Some(outputs), .. } if outputs.len() == n => Ok(outputs
                    .iter()
                    .map(|fields| match fields {
                        Some(fields) => {
                            exchange::take(fields, shared, MAX_ELEMENT).map(Some).map_err(Failure::BadOutput)
                        }
                        None => Ok(None),
                    })
                    .collect()),
                other => Err(Failure::BadOutput(format!("an unexpected reply to a batch of {n}: {other:?}"))),
            },
        );
        results.unwrap_or_else(|failure| vec![Err(failure); n])
    }
}
