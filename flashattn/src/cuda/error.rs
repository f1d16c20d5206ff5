//! Driver errors as the crate's typed errors: every cudarc driver call of the backend maps its
//! `DriverError` through [`driver_err`], naming the call.

use crate::error::ErrorKind;
use cudarc::driver::DriverError;

pub(super) fn driver_err(call: &'static str) -> impl Fn(DriverError) -> crate::Error {
    move |e| {
        ErrorKind::CudaDriver {
            call,
            message: e.to_string(),
        }
        .into()
    }
}
