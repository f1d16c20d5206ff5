//! One GPU and the stream flashattn launches on ([`CudaDevice`]): opening it, its properties, and
//! host-to-device copies. Uploading tensors is `buffer.rs`'s, getting kernels ready `loader.rs`'s.

use super::arch::{Arch, GpuShape};
use super::error::driver_err;
use super::key::KernelKey;
use super::probe;
use crate::error::{ErrorKind, Result};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One GPU (a CUDA context) and the stream flashattn launches on.
#[derive(Clone)]
pub struct CudaDevice {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) arch: Arch,
    pub(super) name: String,
    sm_count: usize,
    pub(super) smem_optin: usize,
    pub(super) kernels: Arc<Mutex<HashMap<KernelKey, CudaFunction>>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ctx.ordinal())
            .field("name", &self.name)
            .field("arch", &self.arch)
            .finish()
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` with a new stream. Without a driver, without a device, or with a bad
    /// ordinal this returns [`ErrorKind::CudaUnavailable`] / [`ErrorKind::CudaDriver`]; it never
    /// panics and prints nothing.
    ///
    /// The context is opened without cudarc's per-buffer event tracking
    /// (`CudaContext::disable_event_tracking`): flashattn queues everything on this device's one
    /// stream, which orders every use already. Buffers made through this device and then used on
    /// another stream are the caller's to synchronize; [`CudaDevice::with_stream`] keeps the
    /// tracking settings of the caller's context.
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        probe::driver()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            let message = e.to_string();
            if message.contains("NO_DEVICE") || message.contains("INVALID_DEVICE") {
                crate::Error::from(ErrorKind::CudaUnavailable {
                    reason: format!("device {ordinal}: {message}"),
                })
            } else {
                ErrorKind::CudaDriver {
                    call: "cuInit / cuDevicePrimaryCtxRetain",
                    message,
                }
                .into()
            }
        })?;
        // SAFETY: called on the context this function just made, before any buffer exists in
        // it (the flag covers buffers made afterwards). Every allocation, copy and launch of
        // flashattn through this device goes on its one stream, so the stream's order already
        // orders every use of every buffer; cudarc's per-buffer events would only add two
        // driver calls per buffer per launch (a decode launch passes ~10 buffers; with the
        // release-build memsets and the separate uploads this took ~20-25 us off a decode
        // step on an H100). A caller who uses these buffers on streams of their own
        // synchronizes them (documented on `CudaDevice::new`); `with_stream` leaves the
        // caller's context as it is.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        Self::from_parts(ctx, stream)
    }

    /// flashattn on a stream the caller owns (e.g. another library's), in that stream's context.
    pub fn with_stream(stream: Arc<CudaStream>) -> Result<CudaDevice> {
        Self::from_parts(stream.context().clone(), stream)
    }

    /// This device on another stream of its context (e.g. the stream a framework runs on now):
    /// the kernels compiled and loaded so far are shared by every such copy, so a process
    /// compiles each variant once whatever the streams. The caller orders the new stream's work
    /// with the old one's.
    pub fn on_stream(&self, stream: Arc<CudaStream>) -> CudaDevice {
        CudaDevice {
            stream,
            ..self.clone()
        }
    }

    fn from_parts(ctx: Arc<CudaContext>, stream: Arc<CudaStream>) -> Result<CudaDevice> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver_err("cuDeviceGetAttribute"))?;
        let attr = |a| {
            ctx.attribute(a)
                .map(|v| v.max(0) as usize)
                .map_err(driver_err("cuDeviceGetAttribute"))
        };
        Ok(CudaDevice {
            arch: Arch {
                major: major as u32,
                minor: minor as u32,
            },
            name: ctx.name().map_err(driver_err("cuDeviceGetName"))?,
            sm_count: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            smem_optin: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )?,
            ctx,
            stream,
            kernels: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn arch(&self) -> Arch {
        self.arch
    }
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }
    /// The SM count and shared memory per block that launch choices depend on.
    pub fn shape(&self) -> GpuShape {
        GpuShape {
            sm_count: self.sm_count,
            smem_optin: self.smem_optin,
        }
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))
    }

    pub(super) fn htod<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        v: &[T],
    ) -> Result<CudaSlice<T>> {
        if v.is_empty() {
            // The driver rejects zero-byte allocations; an empty tensor gets one unread element.
            return self
                .stream
                .alloc_zeros(1)
                .map_err(driver_err("cuMemAllocAsync"));
        }
        self.stream
            .clone_htod(v)
            .map_err(driver_err("cuMemcpyHtoDAsync"))
    }
}
