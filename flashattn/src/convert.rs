//! Rows converted between f32 and the 16-bit element types: [`crate::tensor::Element::widen`]
//! and [`crate::tensor::Element::narrow`].

use half::{bf16, f16};

/// f16: `half`'s slice conversion (F16C where the CPU has it).
pub(crate) fn widen_f16(src: &[f16], out: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    src.convert_to_f32_slice(out)
}

/// bf16: `half`'s values (a NaN gets the quiet bit), as a loop over lanes that LLVM vectorises
/// (`half` converts bf16 slices element by element; in the backward's delta that widening was
/// most of its ~6% of the bf16 samples, d = 64, causal).
pub(crate) fn widen_bf16(src: &[bf16], out: &mut [f32]) {
    debug_assert_eq!(src.len(), out.len());
    for (o, x) in out.iter_mut().zip(src) {
        let b = x.to_bits() as u32;
        let quiet = if b & 0x7fff > 0x7f80 { 0x40 } else { 0 };
        *o = f32::from_bits((b | quiet) << 16);
    }
}

/// f16: `half`'s slice conversion (F16C where the CPU has it).
pub(crate) fn narrow_f16(src: &[f32], out: &mut [f16]) {
    use half::slice::HalfFloatSliceExt;
    out.convert_from_f32_slice(src)
}

/// bf16: `bf16::from_f32` per element, as a loop without branches that LLVM vectorises (`half`'s
/// bf16 slice conversion goes element by element: writing dK and dV through it took ~3.5-4.5% of
/// the bf16 backward's samples, AVX-512, N = 1024, d = 128). Adds one unit in the kept bits when
/// the dropped half is above one half ulp, or exactly one half with an odd kept bit; a NaN keeps
/// its top bits with the quiet bit set. The same bits as `bf16::from_f32` for every input.
pub(crate) fn narrow_bf16(src: &[f32], out: &mut [bf16]) {
    debug_assert_eq!(src.len(), out.len());
    for (o, &x) in out.iter_mut().zip(src) {
        let b = x.to_bits();
        let up = (b & 0x8000 != 0) && (b & 0x1_7fff != 0);
        let rounded = (b >> 16) + u32::from(up);
        let nan = b & 0x7fff_ffff > 0x7f80_0000;
        let bits = if nan { (b >> 16) | 0x40 } else { rounded };
        *o = bf16::from_bits(bits as u16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same bits as `half`'s widening for every bf16 pattern (NaN payloads, infinities,
    /// denormals, both zeros).
    #[test]
    fn widen_bf16_matches_half() {
        let src: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let mut got = vec![0f32; src.len()];
        widen_bf16(&src, &mut got);
        for (x, g) in src.iter().zip(&got) {
            assert_eq!(g.to_bits(), x.to_f32().to_bits(), "{:#06x}", x.to_bits());
        }
    }

    /// Every special case and a sweep of bit patterns round as `bf16::from_f32` does.
    #[test]
    fn narrow_bf16_matches_half() {
        let mut xs: Vec<f32> = [
            0.0,
            -0.0,
            1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            f32::EPSILON,
        ]
        .to_vec();
        // Halfway cases (odd and even kept bit), just above and below, denormals, NaN payloads.
        for base in [
            0x3f80_0000u32,
            0x3f81_0000,
            0x0001_0000,
            0x0000_8000,
            0x7f7f_0000,
        ] {
            for low in [0x7fff, 0x8000, 0x8001, 0xffff, 0x0001] {
                xs.push(f32::from_bits(base | low));
                xs.push(f32::from_bits((base | low) ^ 0x8000_0000));
            }
        }
        xs.push(f32::from_bits(0x7f80_0001));
        xs.push(f32::from_bits(0xff80_8000));
        let mut s = 1u32;
        for _ in 0..100_000 {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            xs.push(f32::from_bits(s));
        }
        let mut out = vec![bf16::ZERO; xs.len()];
        narrow_bf16(&xs, &mut out);
        for (x, o) in xs.iter().zip(&out) {
            assert_eq!(
                o.to_bits(),
                bf16::from_f32(*x).to_bits(),
                "{:#x}",
                x.to_bits()
            );
        }
    }
}
