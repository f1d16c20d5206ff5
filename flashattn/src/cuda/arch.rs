//! What kernel choices need to know of a GPU: its architecture ([`Arch`], what NVRTC compiles
//! for) and its shape ([`GpuShape`], the SM count and shared memory that launch choices depend
//! on).

/// A GPU architecture NVRTC compiles for: compute capability `major.minor`, with the `a`
/// (architecture-specific) suffix on 9.0 so Hopper-only instructions are available.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Arch {
    pub major: u32,
    pub minor: u32,
}

impl Arch {
    pub const SM80: Arch = Arch { major: 8, minor: 0 };
    pub const SM90: Arch = Arch { major: 9, minor: 0 };

    /// NVRTC's `--gpu-architecture` value.
    pub fn target(&self) -> String {
        let suffix = if (self.major, self.minor) == (9, 0) {
            "a"
        } else {
            ""
        };
        format!("sm_{}{}{}", self.major, self.minor, suffix)
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.target())
    }
}

/// What the launch choices need to know of the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuShape {
    pub sm_count: usize,
    /// Shared memory one block may opt in to, bytes.
    pub smem_optin: usize,
}

impl GpuShape {
    /// An H100 / H200 (SXM): 132 SMs, 227 KiB of shared memory per block.
    pub const HOPPER: GpuShape = GpuShape {
        sm_count: 132,
        smem_optin: 227 * 1024,
    };
}
