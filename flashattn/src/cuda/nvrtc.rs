//! Compiling a kernel variant with NVRTC to a cubin (machine code for one architecture), through
//! NVRTC's C API: cudarc's safe wrapper returns PTX only, and a cubin both skips the driver's PTX
//! JIT at load time and lets the compile log report registers and spills (`ptxas -v`).

use super::arch::Arch;
use super::key::{
    KernelKey, COMMON_HEADERS, SM90_ATTN_CUH, SM90_CUH, SM90_FP8_CUH, SM90_WGMMA_CUH,
};
use super::probe;
use crate::error::{ErrorKind, Result};
use cudarc::nvrtc::sys;
use std::ffi::{c_char, CString};
use std::time::{Duration, Instant};

/// What NVRTC produced for one variant and architecture.
#[derive(Clone, Debug)]
pub struct CompiledKernel {
    pub key: KernelKey,
    pub arch: Arch,
    pub cubin: Vec<u8>,
    /// NVRTC's log, including ptxas's resource usage lines.
    pub log: String,
    /// From the log: registers per thread, and spill stores/loads in bytes.
    pub registers: Option<u32>,
    pub spill_stores: Option<u32>,
    pub spill_loads: Option<u32>,
    pub compile_time: Duration,
}

/// NVRTC's version (major, minor).
pub fn version() -> Result<(i32, i32)> {
    probe::nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: libnvrtc is loaded (probe); the out-pointers are valid for writes.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    check(r, "nvrtcVersion")?;
    Ok((major, minor))
}

fn check(r: sys::nvrtcResult, call: &'static str) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(ErrorKind::CudaDriver {
            call,
            message: format!("{r:?}"),
        }
        .into())
    }
}

/// Compiles `key` for `arch`. A compile error returns [`ErrorKind::KernelCompile`] with the log.
pub fn compile(key: &KernelKey, arch: Arch) -> Result<CompiledKernel> {
    probe::nvrtc()?;
    let (file, src) = key.source();
    let cstr = |s: &str| CString::new(s).expect("kernel sources and options contain no NUL");
    let (src_c, name_c) = (cstr(src), cstr(file));
    if !key.builds_for(arch) {
        return Err(ErrorKind::CudaUnsupported {
            feature: "an sm_90a kernel",
            detail: format!(
                " ({} compiles for compute capability 9.0 only, not {arch})",
                key.name()
            ),
        }
        .into());
    }
    // Every header a kernel may include, by the name it includes it under.
    let header_texts = COMMON_HEADERS.iter().copied().chain([
        ("sm90.cuh", SM90_CUH),
        ("sm90_wgmma.cuh", SM90_WGMMA_CUH),
        ("sm90_attn.cuh", SM90_ATTN_CUH),
        ("sm90_fp8.cuh", SM90_FP8_CUH),
    ]);
    let hdr_c: Vec<CString> = header_texts.clone().map(|h| cstr(h.1)).collect();
    let hdr_name_c: Vec<CString> = header_texts.map(|h| cstr(h.0)).collect();
    let mut options = vec![
        format!("--gpu-architecture={}", arch.target()),
        "-std=c++17".into(),
        // Resource usage (registers, spills) into the log.
        "--ptxas-options=-v".into(),
    ];
    options.extend(key.defines().into_iter().map(|(k, v)| format!("-D{k}={v}")));
    let options_c: Vec<CString> = options.iter().map(|o| cstr(o)).collect();
    let option_ptrs: Vec<*const c_char> = options_c.iter().map(|o| o.as_ptr()).collect();
    let headers: Vec<*const c_char> = hdr_c.iter().map(|h| h.as_ptr()).collect();
    let header_names: Vec<*const c_char> = hdr_name_c.iter().map(|h| h.as_ptr()).collect();

    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a live NUL-terminated string (owned above, outliving the calls);
    // `prog` is created before use and destroyed exactly once below.
    unsafe {
        check(
            sys::nvrtcCreateProgram(
                &mut prog,
                src_c.as_ptr(),
                name_c.as_ptr(),
                headers.len() as i32,
                headers.as_ptr(),
                header_names.as_ptr(),
            ),
            "nvrtcCreateProgram",
        )?;
        let start = Instant::now();
        let r = sys::nvrtcCompileProgram(prog, option_ptrs.len() as i32, option_ptrs.as_ptr());
        let compile_time = start.elapsed();
        let log = program_log(prog);
        let result = if r != sys::nvrtcResult::NVRTC_SUCCESS {
            Err(ErrorKind::KernelCompile {
                kernel: key.name(),
                arch: arch.target(),
                log: if log.is_empty() {
                    format!("{r:?}")
                } else {
                    log.clone()
                },
            }
            .into())
        } else {
            cubin(prog).map(|cubin| CompiledKernel {
                key: *key,
                arch,
                cubin,
                registers: log_number(&log, "Used ", " registers"),
                spill_stores: log_number(&log, "bytes stack frame, ", " bytes spill stores"),
                spill_loads: log_number(&log, "bytes spill stores, ", " bytes spill loads"),
                log,
                compile_time,
            })
        };
        sys::nvrtcDestroyProgram(&mut prog);
        result
    }
}

/// The program's compile log (empty if there is none).
///
/// # Safety
/// `prog` is a live NVRTC program.
unsafe fn program_log(prog: sys::nvrtcProgram) -> String {
    let mut n = 0usize;
    if sys::nvrtcGetProgramLogSize(prog, &mut n) != sys::nvrtcResult::NVRTC_SUCCESS || n == 0 {
        return String::new();
    }
    let mut buf = vec![0u8; n];
    if sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char)
        != sys::nvrtcResult::NVRTC_SUCCESS
    {
        return String::new();
    }
    buf.truncate(buf.iter().position(|&b| b == 0).unwrap_or(n));
    String::from_utf8_lossy(&buf).into_owned()
}

/// The compiled cubin.
///
/// # Safety
/// `prog` is a live NVRTC program that compiled successfully.
unsafe fn cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>> {
    let mut n = 0usize;
    check(sys::nvrtcGetCUBINSize(prog, &mut n), "nvrtcGetCUBINSize")?;
    let mut buf = vec![0u8; n];
    check(
        sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char),
        "nvrtcGetCUBIN",
    )?;
    Ok(buf)
}

/// The number between `before` and `after` on the first line of `log` that has both, e.g.
/// "Used 128 registers".
fn log_number(log: &str, before: &str, after: &str) -> Option<u32> {
    log.lines().find_map(|line| {
        let start = line.find(before)? + before.len();
        let end = start + line[start..].find(after)?;
        line[start..end].trim().parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use crate::cuda::nvrtc::log_number;

    #[test]
    fn reads_ptxas_resource_lines() {
        let log = "ptxas info    : Function properties for flash_fwd\n\
                   ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
                   ptxas info    : Used 56 registers, used 1 barriers, 8 bytes cumulative stack size";
        assert_eq!(log_number(log, "Used ", " registers"), Some(56));
        assert_eq!(
            log_number(log, "bytes stack frame, ", " bytes spill stores"),
            Some(4)
        );
        assert_eq!(
            log_number(log, "bytes spill stores, ", " bytes spill loads"),
            Some(12)
        );
        assert_eq!(log_number("nothing", "Used ", " registers"), None);
    }
}
