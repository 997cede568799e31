//! The `stoker_client._core` extension: the Rust client (`stoker-client`) bound to Python. The
//! Python package around it (`stoker_client`) only adapts names, numpy arrays and PyTorch.

mod client;
mod convert;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<client::PyClient>()?;
    m.add_class::<convert::Array>()?;
    m.add_function(wrap_pyfunction!(merge_states, m)?)?;
    Ok(())
}

/// One state from the states (dicts) every rank of a job saved at the same step: it resumes
/// the job read by any number of ranks (`stoker_client::merge_states`).
#[pyfunction]
fn merge_states(py: Python<'_>, states: Vec<Bound<'_, PyAny>>) -> PyResult<Py<PyAny>> {
    let states = states.iter().map(convert::state_from_py).collect::<PyResult<Vec<_>>>()?;
    let merged = stoker_client::merge_states(&states).map_err(pyo3::exceptions::PyValueError::new_err)?;
    convert::state_to_py(py, &merged)
}
