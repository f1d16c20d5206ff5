//! Printing the benchmarks' lines: a progress bar on the terminal, and the lines (table rows or
//! JSON objects) printed between its frames.

use crate::error::{CliError, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::time::Duration;

pub fn progress(steps: u64) -> ProgressBar {
    let pb = ProgressBar::new(steps);
    if let Ok(style) =
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
    {
        pb.set_style(style);
    }
    // Ticks keep the elapsed time moving during calls that last seconds.
    pb.enable_steady_tick(Duration::from_millis(250));
    pb
}

pub fn emit(pb: &ProgressBar, line: String) {
    // Printed between progress-bar frames so the two do not interleave on a terminal.
    pb.suspend(|| println!("{line}"));
}

pub fn to_json<T: Serialize>(x: &T) -> Result<String> {
    serde_json::to_string(x).map_err(|e| CliError(format!("cannot encode a JSON line: {e}")))
}
