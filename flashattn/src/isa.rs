//! The CPU instruction sets the kernels come in ([`Isa`]); which one runs is chosen in
//! `cpu::simd`. A bottom layer: it imports nothing from the crate.

use std::fmt;

/// An instruction set the CPU kernels can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Isa {
    /// Portable Rust, what LLVM makes of it for the build target; the reference twin.
    Scalar,
    /// x86-64 AVX2 + FMA (8 f32 lanes).
    Avx2,
    /// x86-64 AVX-512F (16 f32 lanes); bf16 products with `vdpbf16ps` when the CPU has AVX512_BF16.
    Avx512,
    /// aarch64 Advanced SIMD (4 f32 lanes).
    Neon,
}

impl Isa {
    /// Every instruction set, slowest first.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Neon, Isa::Avx2, Isa::Avx512];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    /// Parses a name as printed by [`Isa::name`].
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == name)
    }

    /// Whether this CPU can run the instruction set.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Whether bf16 products run as bf16 dot products (`vdpbf16ps`) rather than in f32.
    pub fn has_bf16_dot(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self == Isa::Avx512 {
            return self.is_available() && std::arch::is_x86_feature_detected!("avx512bf16");
        }
        false
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())?;
        if self.has_bf16_dot() {
            f.write_str("+bf16")?;
        }
        Ok(())
    }
}
