//! What the host-emulation tests of the CUDA kernels share (tests/cuda_emulated.rs for the
//! forward, tests/decode.rs for decoding): the work folder, the g++ check, one emulation binary per
//! kernel variant, and raw little-endian buffers in and out.

use flashattn::cuda::KernelKey;
use flashattn::{Buffer, DType, Slice};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The kernel sources.
pub const KERNELS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/cuda/kernels");

pub fn work_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/cuda_emu");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Whether g++ can be used, printing why not (or failing when CI requires the test:
/// FLASHATTN_REQUIRE_EMULATION=1).
pub fn have_compiler() -> bool {
    let ok = Command::new("g++")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let required = std::env::var("FLASHATTN_REQUIRE_EMULATION").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "FLASHATTN_REQUIRE_EMULATION=1 but g++ is missing"
        );
        eprintln!("skipping the emulated CUDA kernels: no g++");
    }
    ok
}

/// One emulation binary per kernel variant (built once per test process, removed at the end):
/// `driver` (a .cpp file that includes the kernel source) compiled with the variant's defines,
/// `overrides` replacing some of them, and `extra` defines.
pub struct Builds {
    exes: HashMap<KernelKey, PathBuf>,
    driver: &'static str,
    overrides: &'static [(&'static str, &'static str)],
}

impl Builds {
    pub fn new(driver: &'static str, overrides: &'static [(&'static str, &'static str)]) -> Self {
        Builds {
            exes: HashMap::new(),
            driver,
            overrides,
        }
    }

    pub fn len(&self) -> usize {
        self.exes.len()
    }

    /// The binary of `key`, with `extra` defines (`-D` arguments) when it is first built.
    pub fn get(&mut self, key: &KernelKey, extra: &[String]) -> PathBuf {
        if let Some(p) = self.exes.get(key) {
            return p.clone();
        }
        // Unique per build: two tests of one process may build the same variant, and each
        // removes its own binaries when it ends.
        static BUILD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = BUILD.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let exe = work_dir().join(format!("{}_{}_{n}", key.name(), std::process::id()));
        let mut cmd = Command::new("g++");
        cmd.args(["-std=c++20", "-O1", "-pthread", "-DFA_HOST_EMULATION"])
            .arg(format!("-I{KERNELS}"))
            .args(extra);
        for (k, v) in key.defines() {
            let v = self
                .overrides
                .iter()
                .find(|o| o.0 == k)
                .map_or(v, |o| o.1.to_string());
            cmd.arg(format!("-D{k}={v}"));
        }
        let out = cmd
            .arg(self.driver)
            .arg("-o")
            .arg(&exe)
            .output()
            .expect("run g++");
        assert!(
            out.status.success(),
            "g++ failed for {}:\n{}",
            key.name(),
            String::from_utf8_lossy(&out.stderr)
        );
        self.exes.insert(*key, exe.clone());
        exe
    }
}

impl Drop for Builds {
    fn drop(&mut self) {
        for p in self.exes.values() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A buffer's elements as little-endian bytes.
pub fn bytes(s: Slice<'_>) -> Vec<u8> {
    match s {
        Slice::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Slice::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        Slice::BF16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
    }
}

/// Little-endian bytes as a buffer of `dtype`.
pub fn from_bytes(b: &[u8], dtype: DType) -> Buffer {
    match dtype {
        DType::F32 => Buffer::F32(
            b.chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ),
        DType::F16 => Buffer::F16(
            b.chunks(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes(c.try_into().unwrap())))
                .collect(),
        ),
        DType::BF16 => Buffer::BF16(
            b.chunks(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes(c.try_into().unwrap())))
                .collect(),
        ),
    }
}
