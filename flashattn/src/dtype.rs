//! The element formats: the types flashattn computes in ([`DType`]) and the FP8 storage formats
//! ([`Fp8Format`]). The bottom layer: it imports nothing from the crate.

use float8::{F8E4M3, F8E5M2};
use half::bf16;
use std::fmt;
use std::sync::OnceLock;

/// The element types flashattn computes in. Accumulation is always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    /// Unit roundoff of the format (half the distance from 1.0 to the next number).
    pub fn epsilon(self) -> f64 {
        match self {
            DType::F32 => f32::EPSILON as f64 / 2.0,
            DType::F16 => 2f64.powi(-11),
            DType::BF16 => 2f64.powi(-8),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The two FP8 formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits, no infinities (E4M3FN): max 448, NaN = `S.1111.111`.
    E4M3,
    /// 5 exponent bits, 2 mantissa bits, IEEE-like (infinities, NaNs): max 57344.
    E5M2,
}

impl Fp8Format {
    pub fn name(self) -> &'static str {
        match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::E5M2 => "e5m2",
        }
    }

    /// The largest finite value.
    pub fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// `x` rounded to nearest even in this format, saturating: finite values and infinities
    /// beyond the largest finite value become it (CUDA's `__NV_SATFINITE`); NaN stays NaN.
    pub fn quantise(self, x: f64) -> u8 {
        match self {
            Fp8Format::E4M3 => F8E4M3::from_f64(x).to_bits(),
            Fp8Format::E5M2 => F8E5M2::from_f64(x).to_bits(),
        }
    }

    /// The value of each of the 256 bit patterns as bf16 (exact: bf16 has more exponent and
    /// mantissa bits than either format; NaN stays NaN, e5m2's infinities stay infinite).
    pub fn bf16_table(self) -> &'static [bf16; 256] {
        static E4M3: OnceLock<[bf16; 256]> = OnceLock::new();
        static E5M2: OnceLock<[bf16; 256]> = OnceLock::new();
        let build =
            |to_f32: fn(u8) -> f32| std::array::from_fn(|bits| bf16::from_f32(to_f32(bits as u8)));
        match self {
            Fp8Format::E4M3 => E4M3.get_or_init(|| build(|b| F8E4M3::from_bits(b).to_f32())),
            Fp8Format::E5M2 => E5M2.get_or_init(|| build(|b| F8E5M2::from_bits(b).to_f32())),
        }
    }
}

impl fmt::Display for Fp8Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
