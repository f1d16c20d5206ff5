//! What the host-emulation tests of the CUDA kernels share (`cuda::emulated` for the forward,
//! `decode::emulated` for decoding): the work folder, the g++ check, one emulation binary per
//! kernel variant, and raw little-endian buffers in and out.

use flashattn::cuda::{KernelKey, LaunchDescription};
use flashattn::{AttnOutput, Buffer, DType, Slice, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The kernel sources.
pub const KERNELS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/cuda/kernels");

/// A fresh work folder for one emulated call: `prefix`, the process, `tag` and a number no other
/// call of the process gets (tests of one process run in parallel, and two of them may use the
/// same tag: a drawn backward case's seed equalled a grid case's index, and one removed the
/// other's folder while it ran).
pub fn case_dir(prefix: &str, tag: &str) -> PathBuf {
    static CALL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    work_dir().join(format!("{prefix}_{}_{tag}_{n}", std::process::id()))
}

pub fn work_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/cuda_emu");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A kernel's source with one deliberate mistake, for the tests that show the emulation catches
/// it: `file` (under [`KERNELS`]) with `right`, which must stand in it exactly once, replaced by
/// `wrong`, in a work folder of its own.
pub struct BrokenKernel {
    dir: PathBuf,
    path: PathBuf,
}

impl BrokenKernel {
    pub fn new(tag: &str, file: &str, right: &str, wrong: &str) -> Self {
        let src = std::fs::read_to_string(format!("{KERNELS}/{file}")).unwrap();
        assert_eq!(
            src.matches(right).count(),
            1,
            "{file}: {right:?} moved or repeats: the test must follow it"
        );
        let dir = case_dir("broken", tag);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(file.replace(".cu", "_broken.cu"));
        std::fs::write(&path, src.replace(right, wrong)).unwrap();
        Self { dir, path }
    }

    /// The define that builds this source in place of the kernel's own ([`Builds::get`]).
    pub fn define(&self) -> String {
        format!("-DFA_KERNEL=\"{}\"", self.path.display())
    }

    /// Whether `run` (a case on this kernel, with its checks) failed. This kernel's folder and
    /// the work folders a failed run leaves (names starting with `work_prefix`; a run removes its
    /// own only after a success) are removed either way.
    pub fn fails(self, work_prefix: &str, run: impl FnOnce()) -> bool {
        eprintln!("the broken kernel's failure below is expected:");
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
        let _ = std::fs::remove_dir_all(&self.dir);
        for e in std::fs::read_dir(work_dir()).unwrap().flatten() {
            if e.file_name().to_string_lossy().starts_with(work_prefix) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        result.is_err()
    }
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
        cmd.args(["-std=c++17", "-O1", "-DFA_HOST_EMULATION"])
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

/// Work allowed per emulated case, `default` unless `FLASHATTN_EMU_BUDGET` says otherwise.
pub fn budget(default: usize) -> usize {
    std::env::var("FLASHATTN_EMU_BUDGET")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Whether to run every emulated case (`FLASHATTN_EMU_ALL=1`) where a test runs a representative
/// subset by default (the build of each kernel variant, g++, takes most of an emulated test's time).
pub fn all() -> bool {
    std::env::var("FLASHATTN_EMU_ALL").is_ok_and(|v| v == "1")
}

/// Runs an emulation binary on its work folder `dir`; a failure fails the test, naming `what`.
pub fn run_exe(exe: &Path, dir: &Path, what: &str) {
    let o = Command::new(exe)
        .arg(dir)
        .output()
        .expect("run the emulation");
    assert!(o.status.success(), "emulation of {what} failed: {o:?}");
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

const FWD_DRIVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cuda_emu/driver.cpp");

/// The forward drivers' builds: fwd.cu, fwd_f32.cu or fwd_sm90.cu, named to the driver by
/// FA_KERNEL.
pub fn forward_builds() -> Builds {
    Builds::new(FWD_DRIVER, &[])
}

fn exe(builds: &mut Builds, key: &KernelKey) -> std::path::PathBuf {
    let file = if key.kind == flashattn::cuda::KernelKind::ForwardSm90 && key.fp8 {
        "fwd_sm90_fp8.cu"
    } else if key.kind == flashattn::cuda::KernelKind::ForwardSm90 {
        "fwd_sm90.cu"
    } else if key.kind == flashattn::cuda::KernelKind::ForwardSm90Ws {
        "fwd_sm90_ws.cu"
    } else if key.dtype == DType::F32 {
        "fwd_f32.cu"
    } else {
        "fwd.cu"
    };
    builds.get(key, &[format!("-DFA_KERNEL=\"{KERNELS}/{file}\"")])
}

/// Runs the emulated forward kernel of `d` on q, k and v (their buffers' raw little-endian bytes:
/// elements of the key's dtype, or FP8 bytes for FP8 keys); `out` comes back in `out_dtype`.
pub fn run_forward(
    builds: &mut Builds,
    d: &LaunchDescription,
    [q, k, v]: [&[u8]; 3],
    out_dtype: DType,
    tag: &str,
) -> AttnOutput {
    let dir = case_dir("case", tag);
    std::fs::create_dir_all(&dir).unwrap();
    let nums: Vec<String> = [
        d.grid.0 as i64,
        d.grid.1 as i64,
        d.grid.2 as i64,
        d.threads as i64,
        d.smem_bytes as i64,
        d.table.is_some() as i64,
        d.slopes.is_some() as i64,
        d.out_len as i64,
        d.lse_len as i64,
        d.descale.is_some() as i64,
        d.sink.is_some() as i64,
    ]
    .iter()
    .map(|x| x.to_string())
    // The warp-specialised kernel's tensor maps (driver.cpp reads them when the kernel has them).
    .chain(d.tma.iter().flatten().flat_map(|m| {
        m.dims
            .iter()
            .chain(&m.strides)
            .map(|x| x.to_string())
            .chain([m.box_rows.to_string()])
            .collect::<Vec<_>>()
    }))
    // Then whether it takes its tiles from a counter (the dynamic scheduler).
    .chain(d.tma.map(|_| (d.tile_counter as i64).to_string()))
    .collect();
    // The kernel's parameter, byte for byte as a GPU launch passes it (its addresses 0: the
    // driver sets them to its buffers).
    std::fs::write(dir.join("params.bin"), d.params.as_bytes()).unwrap();
    std::fs::write(dir.join("params.txt"), nums.join("\n")).unwrap();
    std::fs::write(dir.join("q.bin"), q).unwrap();
    std::fs::write(dir.join("k.bin"), k).unwrap();
    std::fs::write(dir.join("v.bin"), v).unwrap();
    if let Some(t) = &d.table {
        std::fs::write(
            dir.join("table.bin"),
            t.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
        )
        .unwrap();
    }
    for (name, t) in [
        ("slopes.bin", &d.slopes),
        ("descale.bin", &d.descale),
        ("sink.bin", &d.sink),
    ] {
        if let Some(s) = t {
            std::fs::write(
                dir.join(name),
                s.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
            )
            .unwrap();
        }
    }
    if !d.is_empty() {
        let exe = exe(builds, &d.key);
        run_exe(&exe, &dir, &d.key.name());
    }
    let read = |name: &str| std::fs::read(dir.join(name)).unwrap_or_default();
    let (ob, lb) = (read("out.bin"), read("lse.bin"));
    let lse: Vec<f32> = lb
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let out = from_bytes(&ob, out_dtype);
    let _ = std::fs::remove_dir_all(&dir);
    // An empty description launched nothing and wrote no file: its shapes hold no element.
    AttnOutput {
        out: Tensor::from_buffer(out, &d.out_shape).expect("out length"),
        lse: Tensor::from_vec(lse, &d.lse_shape).expect("lse length"),
    }
}
