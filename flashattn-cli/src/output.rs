//! Writing an output file atomically: all of it on success, nothing on failure.

use crate::error::{CliError, Result};
use std::io::Write;
use std::path::Path;

/// Computes the bytes of OUT with `produce` and writes them to `output` atomically. The temporary
/// file is created before computing, so an unwritable destination fails fast; it lives next to
/// OUT so the final rename stays on one filesystem (atomic), and it is deleted when dropped on
/// any error path, so a failure leaves an existing OUT untouched.
pub fn write_atomically(output: &Path, produce: impl FnOnce() -> Result<Vec<u8>>) -> Result<()> {
    let dir = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::Builder::new()
        .prefix(".flashattn-")
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| {
            CliError(format!(
                "cannot create a temporary file in {}: {e}",
                dir.display()
            ))
        })?;

    let bytes = produce()?;

    let shown = output.display();
    let write_err = |e: std::io::Error| CliError(format!("cannot write {shown}: {e}"));
    tmp.write_all(&bytes).map_err(write_err)?;
    tmp.as_file().sync_all().map_err(write_err)?;
    set_readable(tmp.as_file()).map_err(write_err)?;
    tmp.persist(output).map_err(|e| write_err(e.error))?;
    Ok(())
}

/// Temporary files are created 0600; the result should have the usual permissions of a new file.
#[cfg(unix)]
fn set_readable(f: &std::fs::File) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    f.set_permissions(std::fs::Permissions::from_mode(0o644))
}

#[cfg(not(unix))]
fn set_readable(_: &std::fs::File) -> std::io::Result<()> {
    Ok(())
}
