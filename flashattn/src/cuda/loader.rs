//! Getting a kernel variant ready on a device: from the device's table of loaded kernels, the disk
//! cache (`cache.rs`), or NVRTC (`nvrtc.rs`); and [`precompile`], which fills the disk cache
//! ahead of time.

use super::arch::Arch;
use super::cache;
use super::device::CudaDevice;
use super::error::driver_err;
use super::key::KernelKey;
use super::nvrtc;
use crate::error::{ErrorKind, Result};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::CudaFunction;
use std::time::{Duration, Instant};

/// Where a kernel came from when it was first needed on this device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelOrigin {
    /// Already loaded on this device.
    Memory,
    /// A cubin from the disk cache.
    Disk,
    /// Compiled by NVRTC now (and written to the disk cache when one is available).
    Compiled,
}

/// How [`CudaDevice::prepare`] got a kernel, and how long it took.
#[derive(Clone, Copy, Debug)]
pub struct Prepared {
    pub origin: KernelOrigin,
    pub time: Duration,
}

/// What [`precompile`] did for one kernel variant.
#[derive(Clone, Debug)]
pub struct Precompiled {
    pub key: KernelKey,
    /// The compile time, `Ok(None)` for a variant already in the cache, or the compile error.
    pub compiled: std::result::Result<Option<Duration>, crate::Error>,
}

/// What [`precompile`] did: the NVRTC version it compiled with (part of every cache file's key)
/// and the outcome per variant.
#[derive(Clone, Debug)]
pub struct Precompile {
    pub nvrtc: (i32, i32),
    pub variants: Vec<Precompiled>,
}

/// Compiles `keys` for `arch` into the disk cache (see [`KernelOrigin::Disk`]) on all cores,
/// skipping variants whose cubin is already there, so that later processes on a GPU of that
/// architecture load kernels instead of compiling them. Needs NVRTC only, no GPU: a cache filled on
/// one machine serves another with the same NVRTC major.minor. Errors only when NVRTC is missing
/// or no cache directory is configured; per-variant compile errors are in the returned list.
pub fn precompile(keys: &[KernelKey], arch: Arch) -> Result<Precompile> {
    use rayon::prelude::*;
    let version = nvrtc::version()?;
    if cache::dir().is_none() {
        return Err(ErrorKind::CudaUnavailable {
            reason: "no kernel cache directory (FLASHATTN_CACHE_DIR is empty and HOME is unset)"
                .into(),
        }
        .into());
    }
    let variants = keys
        .par_iter()
        .map(|key| {
            let path = cache::path(key, arch, version).expect("checked above");
            if cache::exists(&path) {
                return Precompiled {
                    key: *key,
                    compiled: Ok(None),
                };
            }
            let compiled = nvrtc::compile(key, arch).map(|c| {
                cache::store(&path, &c.cubin);
                Some(c.compile_time)
            });
            Precompiled {
                key: *key,
                compiled,
            }
        })
        .collect();
    Ok(Precompile {
        nvrtc: version,
        variants,
    })
}

impl CudaDevice {
    /// Makes the kernel of `key` ready on this device: from memory, the disk cache, or NVRTC.
    pub fn prepare(&self, key: &KernelKey) -> Result<Prepared> {
        self.function(key).map(|(_, p)| p)
    }

    pub(super) fn function(&self, key: &KernelKey) -> Result<(CudaFunction, Prepared)> {
        let start = Instant::now();
        let mut kernels = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = kernels.get(key) {
            let p = Prepared {
                origin: KernelOrigin::Memory,
                time: start.elapsed(),
            };
            return Ok((f.clone(), p));
        }
        let nvrtc_version = nvrtc::version()?;
        let path = cache::path(key, self.arch, nvrtc_version);
        let cached = path.as_deref().and_then(cache::load);
        let (function, origin) = match cached.and_then(|c| self.load(key, c).ok()) {
            Some(f) => (f, KernelOrigin::Disk),
            None => {
                let compiled = nvrtc::compile(key, self.arch)?;
                if let Some(p) = &path {
                    cache::store(p, &compiled.cubin);
                }
                (self.load(key, compiled.cubin)?, KernelOrigin::Compiled)
            }
        };
        kernels.insert(*key, function.clone());
        let p = Prepared {
            origin,
            time: start.elapsed(),
        };
        Ok((function, p))
    }

    fn load(&self, key: &KernelKey, cubin: Vec<u8>) -> Result<CudaFunction> {
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(driver_err("cuModuleLoadData"))?;
        let f = module
            .load_function(key.entry())
            .map_err(driver_err("cuModuleGetFunction"))?;
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            key.smem_bytes() as i32,
        )
        .map_err(driver_err("cuFuncSetAttribute"))?;
        if key.min_blocks() > 1 {
            // Several CTAs of tens of KiB per SM (the tensor-core decode kernel): ask for the
            // largest shared-memory carve-out of the SM's L1 (a hint, in percent).
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )
            .map_err(driver_err("cuFuncSetAttribute"))?;
        }
        Ok(f)
    }
}
