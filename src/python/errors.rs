//! Library errors as Python exceptions of `kvpack.errors`, one class per
//! [`Error`] kind, each carrying the [`crate::Location`] text in
//! `.location` (for format errors).

use pyo3::prelude::*;

use crate::error::Error;

/// Converts a library error into the matching `kvpack.errors` exception.
pub fn to_py(e: Error) -> PyErr {
    Python::attach(|py| match raise(py, &e) {
        Ok(err) | Err(err) => err,
    })
}

fn raise(py: Python<'_>, e: &Error) -> PyResult<PyErr> {
    let module = py.import("kvpack.errors")?;
    let (class, location, errno) = match e {
        Error::Format { at, .. } => ("FormatError", Some(at.to_string()), None),
        Error::Parameter(_) => ("ParameterError", None, None),
        Error::Limits(_) => ("LimitsError", None, None),
        Error::Io { source, .. } => ("KvpackIOError", None, source.raw_os_error()),
        Error::Unsupported(_) => ("UnsupportedError", None, None),
    };
    let cls = module.getattr(class)?;
    let exc = cls.call1((e.to_string(), location, errno))?;
    Ok(PyErr::from_value(exc))
}

/// `Result<T, Error>` to `PyResult<T>`.
pub trait IntoPy<T> {
    /// Maps the error with [`to_py`].
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for crate::error::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
