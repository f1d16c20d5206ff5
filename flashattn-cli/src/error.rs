//! The binary's one error type: a message, printed as `error: <message>` on one line.

use std::fmt;

/// A user-facing failure. The message names the tensor, file or option at fault.
#[derive(Debug)]
pub struct CliError(pub String);

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CliError {}

impl From<flashattn::Error> for CliError {
    fn from(e: flashattn::Error) -> Self {
        // The library's messages already name the tensor and the values it rejected.
        CliError(e.to_string())
    }
}

pub type Result<T, E = CliError> = std::result::Result<T, E>;

/// Shorthand for `Err(CliError(...))` in `?`-style code.
pub fn fail<T>(msg: impl Into<String>) -> Result<T> {
    Err(CliError(msg.into()))
}
