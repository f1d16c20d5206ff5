//! `--threads N`: the library runs on the current rayon pool, so a dedicated pool is built and the
//! work runs inside it.

use crate::error::{fail, CliError, Result};

pub fn with_threads<R: Send>(threads: Option<usize>, f: impl FnOnce() -> R + Send) -> Result<R> {
    match threads {
        None => Ok(f()),
        // rayon reads 0 as "choose for me", which would hide a mistake.
        Some(0) => fail("--threads must be at least 1"),
        Some(n) => {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .map_err(|e| CliError(format!("cannot start {n} threads: {e}")))?;
            Ok(pool.install(f))
        }
    }
}
