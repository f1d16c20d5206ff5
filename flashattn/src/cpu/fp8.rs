//! FP8 -> f32 / f16 / bf16 widening of KV-cache rows (exact: every FP8 value is a value of each of
//! those types), scalar and SIMD.
//!
//! One formula for both formats, on the magnitude bits `m = x & 0x7f`: placed at the top of an
//! f32's exponent and mantissa fields (`m << shift`, shift 20 for e4m3, 21 for e5m2), they read as
//! the FP8 value times `2^-bias_gap` (gap 120 = 127 - 7, resp. 112 = 127 - 15), FP8 subnormals as
//! f32 subnormals, so one multiplication by `2^gap` gives the value exactly. Magnitudes at or above
//! `special` (e4m3: 0x7f, its only NaN; e5m2: 0x7c.., its infinities and NaNs) get the f32
//! exponent field all ones instead, which keeps a zero mantissa (infinity) or a non-zero one
//! (NaN). The sign bit moves to bit 31.

use crate::cpu::simd::Isa;
use crate::dtype::Fp8Format;
use crate::tensor::SliceMut;
use crate::Element;
use half::{bf16, f16};

/// (shift, 2^gap, special) of a format (see the module documentation).
#[inline(always)]
fn consts(format: Fp8Format) -> (u32, f32, u32) {
    match format {
        Fp8Format::E4M3 => (20, f32::from_bits((127 + 120) << 23), 0x7f),
        Fp8Format::E5M2 => (21, f32::from_bits((127 + 112) << 23), 0x7c),
    }
}

/// The value of one FP8 bit pattern (the scalar twin of the SIMD kernels).
#[inline(always)]
pub(crate) fn to_f32(x: u8, format: Fp8Format) -> f32 {
    let (shift, gap, special) = consts(format);
    let m = (x & 0x7f) as u32;
    let mag = if m >= special {
        (m << shift) | 0x7f80_0000
    } else {
        (f32::from_bits(m << shift) * gap).to_bits()
    };
    f32::from_bits(mag | ((x as u32 & 0x80) << 24))
}

/// Widens `src` (FP8 bytes of `format`) into `dst` (same length), exactly, with `isa`'s
/// instructions where it has them.
pub(crate) fn widen<T: Element>(isa: Isa, format: Fp8Format, src: &[u8], dst: &mut [T]) {
    assert_eq!(src.len(), dst.len(), "fp8 widen: lengths");
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && isa.is_available() {
        // SAFETY: AVX-512F is available (checked above); the kernel reads src.len() bytes of src
        // and writes as many elements of dst, which has that length (asserted above).
        unsafe {
            match T::wrap_mut(dst) {
                SliceMut::F32(d) => avx512::widen_f32(format, src, d),
                SliceMut::BF16(d) if vbmi::available() => vbmi::widen16(
                    vbmi::tables(format, crate::DType::BF16),
                    src,
                    d.as_mut_ptr().cast(),
                ),
                SliceMut::F16(d) if vbmi::available() => vbmi::widen16(
                    vbmi::tables(format, crate::DType::F16),
                    src,
                    d.as_mut_ptr().cast(),
                ),
                SliceMut::BF16(d) => avx512::widen_bf16(format, src, d),
                SliceMut::F16(d) => avx512::widen_f16(format, src, d),
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && isa.is_available() {
        // SAFETY: AVX2 is available (checked above); lengths as for AVX-512.
        unsafe {
            match T::wrap_mut(dst) {
                SliceMut::F32(d) => avx2::widen_f32(format, src, d),
                SliceMut::BF16(d) => avx2::widen_bf16(format, src, d),
                SliceMut::F16(d) => scalar_f16(format, src, d),
            }
        }
        return;
    }
    let _ = isa;
    match T::wrap_mut(dst) {
        SliceMut::F32(d) => {
            for (o, &x) in d.iter_mut().zip(src) {
                *o = to_f32(x, format);
            }
        }
        // Truncation is exact: the value has at most 3 mantissa bits.
        SliceMut::BF16(d) => {
            for (o, &x) in d.iter_mut().zip(src) {
                *o = bf16::from_bits((to_f32(x, format).to_bits() >> 16) as u16);
            }
        }
        SliceMut::F16(d) => scalar_f16(format, src, d),
    }
}

fn scalar_f16(format: Fp8Format, src: &[u8], dst: &mut [f16]) {
    for (o, &x) in dst.iter_mut().zip(src) {
        *o = f16::from_f32(to_f32(x, format));
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{consts, to_f32};
    use crate::dtype::Fp8Format;
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// 16 FP8 bytes at `p` as f32 bits.
    #[inline(always)]
    unsafe fn lanes(p: *const u8, (shift, gap, special): (u32, f32, u32)) -> __m512i {
        let x = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
        let m = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
        let mag = _mm512_sllv_epi32(m, _mm512_set1_epi32(shift as i32));
        let scaled =
            _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(gap)));
        let spec = _mm512_cmpge_epu32_mask(m, _mm512_set1_epi32(special as i32));
        let v = _mm512_mask_or_epi32(scaled, spec, mag, _mm512_set1_epi32(0x7f80_0000));
        let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(x, _mm512_set1_epi32(0x80)));
        _mm512_or_si512(v, sign)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_f32(format: Fp8Format, src: &[u8], dst: &mut [f32]) {
        let c = consts(format);
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY (caller): i + 16 <= n <= src.len() = dst.len().
            let v = lanes(src.as_ptr().add(i), c);
            _mm512_storeu_si512(dst.as_mut_ptr().add(i) as *mut _, v);
        }
        for i in n..src.len() {
            dst[i] = to_f32(src[i], format);
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_bf16(format: Fp8Format, src: &[u8], dst: &mut [bf16]) {
        let c = consts(format);
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY (caller): i + 16 <= n <= src.len() = dst.len(); 16 bf16 are 32 bytes.
            let v = _mm512_srli_epi32::<16>(lanes(src.as_ptr().add(i), c));
            _mm256_storeu_si256(
                dst.as_mut_ptr().add(i) as *mut __m256i,
                _mm512_cvtepi32_epi16(v),
            );
        }
        for i in n..src.len() {
            dst[i] = bf16::from_bits((to_f32(src[i], format).to_bits() >> 16) as u16);
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_f16(format: Fp8Format, src: &[u8], dst: &mut [f16]) {
        let c = consts(format);
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY (caller): as widen_bf16; the conversion to f16 is exact for FP8 values.
            let v = _mm512_castsi512_ps(lanes(src.as_ptr().add(i), c));
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, h);
        }
        for i in n..src.len() {
            dst[i] = f16::from_f32(to_f32(src[i], format));
        }
    }
}

/// 16-bit targets (bf16, f16) by table lookup with AVX512_VBMI's byte permutes: the low and
/// the high byte of the 16-bit value of each of the 128 magnitudes are two 128-byte tables, each
/// in two registers that `vpermi2b` indexes by a byte's low 7 bits; the sign bit is or-ed into the
/// high byte, and the bytes interleaved. 64 values in ~10 instructions, where the arithmetic of
/// [`avx512`] takes ~12 per 16: decoding an e4m3 cache at the decode benchmark shape (32k keys, 8 kv
/// heads, d = 128, bf16 q) took 7.9 ms with that, against 6.0-6.4 ms for a bf16 cache.
#[cfg(target_arch = "x86_64")]
mod vbmi {
    use super::to_f32;
    use crate::dtype::Fp8Format;
    use crate::DType;
    use half::{bf16, f16};
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512vbmi")
            && std::arch::is_x86_feature_detected!("avx512bw")
    }

    /// Low bytes then high bytes (sign excluded) of the 16-bit values of magnitudes 0..128.
    pub(super) struct Tables([u8; 256]);

    pub(super) fn tables(format: Fp8Format, target: DType) -> &'static Tables {
        static T: OnceLock<[Tables; 4]> = OnceLock::new();
        let all = T.get_or_init(|| {
            let build = |format: Fp8Format, target: DType| {
                let mut t = [0u8; 256];
                for m in 0..128u8 {
                    let x = to_f32(m, format);
                    let bits = match target {
                        DType::F16 => f16::from_f32(x).to_bits(),
                        _ => bf16::from_f32(x).to_bits(),
                    };
                    t[m as usize] = bits as u8;
                    t[128 + m as usize] = (bits >> 8) as u8;
                }
                Tables(t)
            };
            [
                build(Fp8Format::E4M3, DType::BF16),
                build(Fp8Format::E4M3, DType::F16),
                build(Fp8Format::E5M2, DType::BF16),
                build(Fp8Format::E5M2, DType::F16),
            ]
        });
        let f = if format == Fp8Format::E4M3 { 0 } else { 2 };
        &all[f + usize::from(target == DType::F16)]
    }

    /// Widens `src` to 16-bit values at `dst` (`src.len()` of them), by `t`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub(super) unsafe fn widen16(t: &Tables, src: &[u8], dst: *mut u16) {
        let tp = t.0.as_ptr() as *const __m512i;
        // SAFETY: the tables are 256 bytes: four 64-byte loads.
        let (lo0, lo1) = (_mm512_loadu_si512(tp), _mm512_loadu_si512(tp.add(1)));
        let (hi0, hi1) = (_mm512_loadu_si512(tp.add(2)), _mm512_loadu_si512(tp.add(3)));
        let sign = _mm512_set1_epi8(0x80u8 as i8);
        // After the in-lane interleave, a holds values 0-7, 16-23, 32-39, 48-55 and b the rest:
        // these qword indices put them back in order.
        let first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
        let second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
        let n = src.len() / 64 * 64;
        for i in (0..n).step_by(64) {
            // SAFETY (caller): i + 64 <= n <= src.len(), and dst holds src.len() values.
            let x = _mm512_loadu_si512(src.as_ptr().add(i) as *const __m512i);
            let lo = _mm512_permutex2var_epi8(lo0, x, lo1);
            let hi = _mm512_permutex2var_epi8(hi0, x, hi1);
            // hi | (x & 0x80)
            let hi = _mm512_ternarylogic_epi32::<0xF8>(hi, x, sign);
            let a = _mm512_unpacklo_epi8(lo, hi);
            let b = _mm512_unpackhi_epi8(lo, hi);
            let o = dst.add(i) as *mut __m512i;
            _mm512_storeu_si512(o, _mm512_permutex2var_epi64(a, first, b));
            _mm512_storeu_si512(o.add(1), _mm512_permutex2var_epi64(a, second, b));
        }
        for (i, &x) in src.iter().enumerate().skip(n) {
            let m = (x & 0x7f) as usize;
            *dst.add(i) = t.0[m] as u16 | (t.0[128 + m] as u16 | (x & 0x80) as u16) << 8;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{consts, to_f32};
    use crate::dtype::Fp8Format;
    use half::bf16;
    use std::arch::x86_64::*;

    /// 8 FP8 bytes at `p` as f32 bits.
    #[inline(always)]
    unsafe fn lanes(p: *const u8, (shift, gap, special): (u32, f32, u32)) -> __m256i {
        let x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        let m = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
        let mag = _mm256_sllv_epi32(m, _mm256_set1_epi32(shift as i32));
        let scaled =
            _mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(gap)));
        // m and special are below 2^7: the signed compare is the unsigned one.
        let spec = _mm256_cmpgt_epi32(m, _mm256_set1_epi32(special as i32 - 1));
        let special_bits = _mm256_or_si256(mag, _mm256_set1_epi32(0x7f80_0000));
        let v = _mm256_blendv_epi8(scaled, special_bits, spec);
        let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(x, _mm256_set1_epi32(0x80)));
        _mm256_or_si256(v, sign)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn widen_f32(format: Fp8Format, src: &[u8], dst: &mut [f32]) {
        let c = consts(format);
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY (caller): i + 8 <= n <= src.len() = dst.len().
            let v = lanes(src.as_ptr().add(i), c);
            _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, v);
        }
        for i in n..src.len() {
            dst[i] = to_f32(src[i], format);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn widen_bf16(format: Fp8Format, src: &[u8], dst: &mut [bf16]) {
        let c = consts(format);
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY (caller): i + 16 <= n <= src.len() = dst.len(); 16 bf16 are 32 bytes.
            let a = _mm256_srli_epi32::<16>(lanes(src.as_ptr().add(i), c));
            let b = _mm256_srli_epi32::<16>(lanes(src.as_ptr().add(i + 8), c));
            // packus works per 128-bit lane: a0-3 b0-3 | a4-7 b4-7; the permute puts it in order.
            let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b));
            _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, packed);
        }
        for i in n..src.len() {
            dst[i] = bf16::from_bits((to_f32(src[i], format).to_bits() >> 16) as u16);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every bit pattern of both formats, through every kernel this CPU has, against the
    /// `float8` crate, for each target type; lengths cover the SIMD bodies and their tails.
    #[test]
    fn every_pattern_every_isa() {
        let src: Vec<u8> = (0..=255u8).chain(0..=36u8).collect();
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let want: Vec<f32> = src
                .iter()
                .map(|&b| match format {
                    Fp8Format::E4M3 => float8::F8E4M3::from_bits(b).to_f32(),
                    Fp8Format::E5M2 => float8::F8E5M2::from_bits(b).to_f32(),
                })
                .collect();
            let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
            for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
                for len in [src.len(), 255, 17, 8, 1, 0] {
                    let mut f = vec![f32::NAN; len];
                    widen(isa, format, &src[..len], &mut f);
                    let mut b = vec![bf16::NAN; len];
                    widen(isa, format, &src[..len], &mut b);
                    let mut h = vec![f16::NAN; len];
                    widen(isa, format, &src[..len], &mut h);
                    // The arithmetic 16-bit kernels, which the table ones replace where the CPU
                    // has AVX512_VBMI.
                    #[cfg(target_arch = "x86_64")]
                    if isa == Isa::Avx512 {
                        let (mut b2, mut h2) = (vec![bf16::NAN; len], vec![f16::NAN; len]);
                        // SAFETY: AVX-512F is available (the ISA is); equal lengths.
                        unsafe {
                            avx512::widen_bf16(format, &src[..len], &mut b2);
                            avx512::widen_f16(format, &src[..len], &mut h2);
                        }
                        for i in 0..len {
                            assert!(same(b2[i].to_f32(), want[i]), "{format} avx512 bf16 {i}");
                            assert!(same(h2[i].to_f32(), want[i]), "{format} avx512 f16 {i}");
                        }
                    }
                    for i in 0..len {
                        let ctx = format!("{format} {isa} len {len} byte {:#x}", src[i]);
                        assert!(same(f[i], want[i]), "{ctx}: f32 {} want {}", f[i], want[i]);
                        assert!(same(b[i].to_f32(), want[i]), "{ctx}: bf16 {}", b[i]);
                        assert!(same(h[i].to_f32(), want[i]), "{ctx}: f16 {}", h[i]);
                    }
                }
            }
        }
    }
}
