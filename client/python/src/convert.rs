//! Between the Rust client's types and Python's: options from keyword arguments, batches as
//! arrays over the Rust-owned bytes, resume states as dicts that survive JSON, errors as the
//! package's exceptions.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use stoker_api::proto::{HeldRows, ResumeState};
use stoker_client::{Batch, ClientOptions, DType, Error};

/// Sets `options` from Python keyword arguments named as its fields; an unknown name is a
/// TypeError, as Python's own calls make it.
pub fn options(options: &mut ClientOptions, given: &Bound<'_, PyDict>) -> PyResult<()> {
    for (key, value) in given.iter() {
        let key: String = key.extract()?;
        if value.is_none()
            && !matches!(
                key.as_str(),
                "start_epoch" | "epochs" | "token" | "ca_file" | "tls_server_name" | "resume" | "share"
            )
        {
            continue;
        }
        match key.as_str() {
            "job" => options.job = value.extract()?,
            "consumer_index" => options.consumer_index = value.extract()?,
            "consumers" => options.consumers = value.extract()?,
            "coordinated" => options.coordinated = value.extract()?,
            "share" => options.share = value.extract()?,
            "start_epoch" => options.start_epoch = value.extract()?,
            "epochs" => options.epochs = value.extract()?,
            "prefetch_next_epoch" => options.prefetch_next_epoch = value.extract()?,
            "prefetch" => options.prefetch = value.extract()?,
            "max_message_bytes" => options.max_message_bytes = value.extract()?,
            "max_batch_bytes" => options.max_batch_bytes = value.extract()?,
            "token" => options.token = value.extract()?,
            "ca_file" => options.tls_ca = value.extract::<Option<PathBuf>>()?,
            "tls_server_name" => options.tls_server_name = value.extract()?,
            "shared_memory" => {
                options.shared_memory =
                    value.extract::<bool>()?.then(|| PathBuf::from(stoker_client::shared::DIRECTORY))
            }
            "connect_timeout" => {
                let seconds: f64 = value.extract()?;
                options.connect_timeout = Duration::try_from_secs_f64(seconds)
                    .map_err(|_| PyValueError::new_err(format!("connect_timeout {seconds} is not a duration")))?;
            }
            "resume" => options.resume = if value.is_none() { None } else { Some(state_from_py(&value)?) },
            other => return Err(PyTypeError::new_err(format!("unexpected client option {other:?}"))),
        }
    }
    Ok(())
}

/// A batch as `(tensors, epoch, split, sequence, completes, rows, incarnation, round, copies)`:
/// tensors a list of `(name, array source, text shape, offsets)`, each source an object numpy
/// turns into the tensor's array without a copy (`np.asarray`); text comes as its bytes
/// (offsets, then the strings) with the strings' shape, other tensors with None; a jagged
/// tensor as its values with a source of its offsets (int64), others with None; rows such a source of
/// uint64; round `(worker, index)` or None; copies, where the pipeline echoes, such a source of
/// each row's echo copy (uint8), else None.
pub fn batch(py: Python<'_>, batch: Batch) -> PyResult<Py<PyAny>> {
    let copies = batch.echo.then(|| {
        let copies: Vec<u8> = batch.echo_copies().map(|c| c as u8).collect();
        Array { shape: vec![copies.len()], data: Owner::Copies(copies), typestr: "|u1" }
    });
    let copies = copies.map(|c| Py::new(py, c)).transpose()?;
    let tensors = batch
        .tensors
        .into_iter()
        .map(|(name, t)| {
            if let Some((offsets, values)) = t.jagged_parts() {
                let offsets = Array { shape: vec![offsets.len() / 8], data: Owner::Bytes(offsets), typestr: "<i8" };
                let shape = vec![values.len() / t.dtype.size()];
                let values = Array { shape, data: Owner::Bytes(values), typestr: typestr(t.dtype) };
                return Ok((name, Py::new(py, values)?, None, Some(Py::new(py, offsets)?)));
            }
            // Text arrives as its bytes; its shape is the strings'.
            let (shape, text_shape) =
                if t.dtype == DType::Bytes { (vec![t.data.len()], Some(t.shape)) } else { (t.shape, None) };
            let source = Array { data: Owner::Bytes(t.data), typestr: typestr(t.dtype), shape };
            Ok((name, Py::new(py, source)?, text_shape, None))
        })
        .collect::<PyResult<Vec<_>>>()?;
    let rows = Array { shape: vec![batch.rows.len()], data: Owner::Rows(batch.rows), typestr: "<u8" };
    let round = batch.round.map(|r| (r.worker, r.index));
    let parts = (
        tensors,
        batch.epoch,
        batch.split,
        batch.sequence,
        batch.completes,
        Py::new(py, rows)?,
        batch.incarnation,
        round,
        copies,
    );
    Ok(parts.into_pyobject(py)?.into_any().unbind())
}

fn typestr(dtype: DType) -> &'static str {
    match dtype {
        DType::Uint8 | DType::Bytes => "|u1",
        DType::Int32 => "<i4",
        DType::Int64 => "<i8",
        DType::Float16 => "<f2",
        DType::Float32 => "<f4",
        DType::Float64 => "<f8",
    }
}

/// Memory the Rust side owns (a received message, a mapped shared-memory file, a vector),
/// seen by numpy through the array interface: the array keeps this object, and so the
/// memory, alive; read-only.
#[pyclass(module = "stoker_client._core", frozen)]
pub struct Array {
    data: Owner,
    typestr: &'static str,
    shape: Vec<usize>,
}

enum Owner {
    Bytes(Bytes),
    Rows(Vec<u64>),
    Copies(Vec<u8>),
}

#[pymethods]
impl Array {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let address = match &self.data {
            Owner::Bytes(b) => b.as_ptr() as usize,
            Owner::Rows(r) => r.as_ptr() as usize,
            Owner::Copies(c) => c.as_ptr() as usize,
        };
        let interface = PyDict::new(py);
        interface.set_item("version", 3)?;
        interface.set_item("typestr", self.typestr)?;
        interface.set_item("shape", PyTuple::new(py, &self.shape)?)?;
        interface.set_item("data", (address, true))?;
        Ok(interface)
    }
}

/// A resume state as the dict `Client.state()` gives: {"job", "epoch", "batches", "consumers",
/// "consumer_index", "yielded": [[split, [positions, sorted]], ...]}, and "merged_ranks" in a
/// merged one (`merge_states`).
pub fn state_to_py(py: Python<'_>, state: &ResumeState) -> PyResult<Py<PyAny>> {
    let d = PyDict::new(py);
    d.set_item("job", &state.job)?;
    d.set_item("epoch", state.epoch)?;
    d.set_item("batches", state.batches)?;
    d.set_item("consumers", state.consumers)?;
    d.set_item("consumer_index", state.consumer_index)?;
    let yielded = PyList::empty(py);
    for held in &state.yielded {
        yielded.append((held.split, &held.positions))?;
    }
    d.set_item("yielded", yielded)?;
    if state.merged_ranks > 0 {
        d.set_item("merged_ranks", state.merged_ranks)?;
    }
    Ok(d.into_any().unbind())
}

/// The state a dict (from `state_to_py`, perhaps through JSON) says.
pub fn state_from_py(value: &Bound<'_, PyAny>) -> PyResult<ResumeState> {
    const KEYS: [&str; 6] = ["job", "epoch", "batches", "consumers", "consumer_index", "yielded"];
    let d = value.cast::<PyDict>().map_err(|_| PyTypeError::new_err("a resume state is a dict (Client.state())"))?;
    let missing: Vec<&str> = KEYS.iter().copied().filter(|k| !d.contains(k).unwrap_or(false)).collect();
    if !missing.is_empty() {
        return Err(PyValueError::new_err(format!(
            "not a resume state (Client.state()): it lacks {}",
            missing.join(", ")
        )));
    }
    let get = |k: &str| d.get_item(k)?.ok_or_else(|| PyKeyError::new_err(k.to_string()));
    let epoch: u64 = get("epoch")?.extract()?;
    // [[split, [positions]], ...], lists after JSON, tuples perhaps before.
    let yielded = get("yielded")?
        .try_iter()?
        .map(|pair| {
            let pair = pair?;
            let bad = || PyValueError::new_err("a resume state's \"yielded\" holds [split, [positions]] pairs");
            if pair.len().map_err(|_| bad())? != 2 {
                return Err(bad());
            }
            Ok((pair.get_item(0)?.extract::<u64>()?, pair.get_item(1)?.extract::<Vec<u32>>()?))
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(ResumeState {
        job: get("job")?.extract()?,
        epoch,
        batches: get("batches")?.extract()?,
        consumers: get("consumers")?.extract()?,
        consumer_index: get("consumer_index")?.extract()?,
        yielded: yielded.into_iter().map(|(split, positions)| HeldRows { epoch, split, positions }).collect(),
        merged_ranks: d.get_item("merged_ranks")?.map(|m| m.extract()).transpose()?.unwrap_or(0),
    })
}

/// The package's exception for an error of the Rust client (stoker_client/errors.py).
pub fn error(py: Python<'_>, e: Error) -> PyErr {
    let raise = |class: &str, args: Bound<'_, PyTuple>| -> PyErr {
        let made = py.import("stoker_client.errors").and_then(|m| m.getattr(class)).and_then(|c| c.call1(args));
        made.map(PyErr::from_value).unwrap_or_else(|failed| failed)
    };
    let message = e.to_string();
    let args = |items: Vec<String>| PyTuple::new(py, items);
    let made = match e {
        Error::NoWorkers | Error::InvalidOptions(_) => return PyValueError::new_err(message),
        Error::Connect { worker, source } => {
            args(vec![worker, "UNAVAILABLE".into(), format!("cannot connect: {}", chain(&source))])
                .map(|a| raise("WorkerError", a))
        }
        Error::Status { worker: peer, status } | Error::Dispatcher { url: peer, status } => {
            let code = code_name(status.code()).to_string();
            args(vec![peer, code, status.message().to_string()]).map(|a| raise("WorkerError", a))
        }
        Error::Tls { peer, problem } => args(vec![peer, problem]).map(|a| raise("TlsError", a)),
        Error::Protocol { .. } => args(vec![message]).map(|a| raise("ProtocolError", a)),
    };
    made.unwrap_or_else(|failed| failed)
}

/// An error and its sources, as one line; a source that only repeats what is said already
/// (transport errors name their source in their own message) is left out.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let said = s.to_string();
        if !out.contains(&said) {
            out.push_str(": ");
            out.push_str(&said);
        }
        source = s.source();
    }
    out
}

/// gRPC's name of a code, as Python's `StatusCode` members are named.
fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}
