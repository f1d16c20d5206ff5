//! Finding the CUDA driver (libcuda) and NVRTC (libnvrtc) at run time.
//!
//! cudarc loads both lazily by name and **panics** when a library is missing, so nothing here calls
//! into cudarc before checking that the library it would load is present (`is_culib_present`
//! dlopens and closes it; that is clean). NVRTC is often not on the loader's search path: PyPI's
//! `nvidia-cuda-nvrtc` wheel (what CI and PyTorch install) puts it in
//! `site-packages/nvidia/cu13/lib`. When the default names fail, the directories below are tried
//! and the library is opened there **by full path**; its soname (`libnvrtc.so.13`) then satisfies
//! cudarc's later lookup by name. `libnvrtc-builtins` is opened first from the same directory,
//! since libnvrtc looks it up by name when it compiles.

use crate::error::{ErrorKind, Result};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Checks that libcuda can be loaded (cheap after the first call).
pub(crate) fn driver() -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only dlopens candidate names and drops the handles; it calls no
    // driver function.
    let present = *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() });
    if present {
        Ok(())
    } else {
        Err(ErrorKind::CudaUnavailable {
            reason: "the NVIDIA driver library (libcuda.so.1) is not installed".into(),
        }
        .into())
    }
}

/// Makes libnvrtc loadable by cudarc, searching the places listed in the module docs.
pub(crate) fn nvrtc() -> Result<()> {
    static FOUND: OnceLock<std::result::Result<(), Vec<String>>> = OnceLock::new();
    FOUND
        .get_or_init(find_nvrtc)
        .clone()
        .map_err(|searched| ErrorKind::NvrtcUnavailable { searched }.into())
}

fn find_nvrtc() -> std::result::Result<(), Vec<String>> {
    let mut searched = Vec::new();
    if let Some(p) = std::env::var_os("FLASHATTN_NVRTC") {
        let p = PathBuf::from(p);
        let dir = if p.is_dir() {
            p.clone()
        } else {
            p.parent().map(Path::to_path_buf).unwrap_or_default()
        };
        searched.push(p.display().to_string());
        if load_from(&dir, p.is_file().then_some(p.as_path())) {
            return Ok(());
        }
        // An explicit path that does not work is an error, not a reason to look elsewhere.
        return Err(searched);
    }
    // SAFETY: dlopen/dlclose of candidate names only, as in `driver`.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Ok(());
    }
    searched.push("the loader's search path (libnvrtc.so, libnvrtc.so.13, ...)".into());
    for dir in candidate_dirs() {
        searched.push(dir.display().to_string());
        if load_from(&dir, None) {
            return Ok(());
        }
    }
    Err(searched)
}

/// Directories that commonly hold libnvrtc: CUDA toolkits and Python wheels.
fn candidate_dirs() -> Vec<PathBuf> {
    let env = |k: &str| std::env::var_os(k).map(PathBuf::from);
    let mut dirs = Vec::new();
    for root in [env("CUDA_PATH"), env("CUDA_HOME")].into_iter().flatten() {
        dirs.push(root.join("lib64"));
        dirs.push(root.join("lib"));
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    dirs.push("/usr/local/cuda/targets/sbsa-linux/lib".into());
    let mut prefixes: Vec<PathBuf> = [env("VIRTUAL_ENV"), env("CONDA_PREFIX")]
        .into_iter()
        .flatten()
        .collect();
    if let Some(home) = env("HOME") {
        prefixes.push(home.join(".local"));
    }
    prefixes.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for py in pythons {
            for packages in ["site-packages", "dist-packages"] {
                for lib in ["nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"] {
                    dirs.push(py.join(packages).join(lib));
                }
            }
        }
    }
    dirs.retain(|d| d.is_dir());
    dirs
}

/// Opens libnvrtc-builtins and libnvrtc from `dir` (or `lib` itself) by full path and keeps them
/// loaded for the life of the process.
fn load_from(dir: &Path, lib: Option<&Path>) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    let mut names: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    let builtins = names
        .iter()
        .find(|n| n.starts_with("libnvrtc-builtins.so") && !n.contains(".alt."));
    let main = match lib {
        Some(p) => p.to_path_buf(),
        None => match names
            .iter()
            .find(|n| n.starts_with("libnvrtc.so.") && !n.contains(".alt."))
            .or_else(|| names.iter().find(|n| *n == "libnvrtc.so"))
        {
            Some(n) => dir.join(n),
            None => return false,
        },
    };
    // SAFETY: loading a shared library runs its initialisers; these are NVIDIA's libnvrtc and its
    // builtins, which cudarc would load anyway. The handles are leaked on purpose so that the
    // libraries stay mapped while cudarc holds function pointers into them.
    unsafe {
        if let Some(b) = builtins {
            match libloading::Library::new(dir.join(b)) {
                Ok(l) => std::mem::forget(l),
                Err(_) => return false,
            }
        }
        match libloading::Library::new(&main) {
            Ok(l) => std::mem::forget(l),
            Err(_) => return false,
        }
        cudarc::nvrtc::sys::is_culib_present()
    }
}
