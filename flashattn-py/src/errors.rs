//! How failures reach Python: the library's typed errors become `flashattn.FlashAttnError` (a
//! `ValueError`) carrying the error kind's name; dtype problems found here become `TypeError`.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    _flashattn,
    FlashAttnError,
    PyValueError,
    "An input flashattn rejected: args are (message, kind), kind naming the problem."
);

/// A failure found by the binding itself, before the library is called.
#[derive(Debug)]
pub enum BindError {
    Type(String),
    Value(String),
    Lib(flashattn::Error),
}

impl From<flashattn::Error> for BindError {
    fn from(e: flashattn::Error) -> Self {
        BindError::Lib(e)
    }
}

/// The variant name of an error kind (`Shape`, `HeadDim`, ...), from its `Debug` form.
fn kind_name(e: &flashattn::Error) -> String {
    let debug = format!("{:?}", e.kind());
    debug
        .split(|c: char| !c.is_alphanumeric() && c != '_')
        .next()
        .unwrap_or("")
        .to_string()
}

impl From<BindError> for PyErr {
    fn from(e: BindError) -> PyErr {
        match e {
            BindError::Type(m) => PyTypeError::new_err(m),
            BindError::Value(m) => FlashAttnError::new_err((m, "Binding".to_string())),
            BindError::Lib(e) => FlashAttnError::new_err((e.to_string(), kind_name(&e))),
        }
    }
}
