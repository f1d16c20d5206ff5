//! `pack_pairs_bf16` and `narrow_pairs_bf16` against the scalar twin.

use super::*;

/// f32 values that exercise the rounding to bf16: ties both ways, just above and below a tie,
/// overflow to infinity, infinities, NaNs (quiet, signalling, payload in the low half only),
/// zeros, the smallest normal, subnormals, and ordinary values.
fn rounding_values(rng: &mut ChaCha8Rng) -> f32 {
    let special = [
        0x3F80_8000, // 1 + 2^-8: a tie, rounds to even (down)
        0x3F81_8000, // a tie that rounds up
        0x3F80_8001, // just above a tie
        0x3F80_7FFF, // just below a tie
        0xBF81_8000, // negative tie
        0x7F7F_FFFF, // f32::MAX: rounds to +inf
        0xFF7F_FFFF,
        0x7F7F_7FFF, // largest value that does not overflow
        0x7F80_0000, // +inf
        0xFF80_0000,
        0x7FC0_0000, // quiet NaN
        0xFFC1_2345,
        0x7F80_0001, // signalling NaN, payload in the low half only
        0x7FA0_0000, // signalling NaN
        0x0000_0000,
        0x8000_0000,
        0x0080_0000, // smallest normal
        0x0080_8000, // smallest normal + a tie
        0x0000_0001, // subnormals
        0x8000_8000,
        0x007F_FFFF,
        0x0040_8000,
    ];
    if rng.gen_bool(0.3) {
        f32::from_bits(special[rng.gen_range(0..special.len())])
    } else {
        let mant: f32 = rng.gen_range(-2.0..2.0);
        mant * 2f32.powi(rng.gen_range(-40..40))
    }
}

#[test]
fn pack_pairs_bf16_equals_the_scalar_twin() {
    let scalar = scalar();
    for kern in simd_kernels() {
        for &n in &NS {
            for cols in [0, 1, 2, 3, 7, 8, 63, 64, 65] {
                let mut rng = common::rng((n * 100 + cols) as u64);
                let st: Vec<f32> = (0..cols * n).map(|_| rounding_values(&mut rng)).collect();
                let len = cols.div_ceil(2) * n;
                let tail = 0xDEAD_BEEFu32;
                let mut out = vec![tail; len + TAIL];
                let mut want = vec![tail; len + TAIL];
                kern.pack_pairs_bf16(&st, cols, n, &mut out);
                scalar.pack_pairs_bf16(&st, cols, n, &mut want);
                assert!(
                    out[len..].iter().all(|&x| x == tail),
                    "{}: out written after its end",
                    kern.isa
                );
                for (idx, (&got, &w)) in out[..len].iter().zip(&want).enumerate() {
                    let (cp, j) = (idx / n, idx % n);
                    for half in 0..2 {
                        let c = 2 * cp + half;
                        let g = (got >> (16 * half)) as u16;
                        let w = (w >> (16 * half)) as u16;
                        if c >= cols {
                            assert_eq!(g, 0, "{}: missing odd row not 0", kern.isa);
                            continue;
                        }
                        let x = st[c * n + j];
                        let flushed =
                            x.is_subnormal() && g == ((x.to_bits() >> 16) as u16 & 0x8000);
                        assert!(
                            g == w || flushed,
                            "{}: n={n} cols={cols} st[{c}][{j}] = {x:e} ({:#010x}) -> {g:#06x}, scalar {w:#06x}",
                            kern.isa,
                            x.to_bits()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn narrow_pairs_bf16_equals_the_scalar_twin() {
    let scalar = scalar();
    for kern in simd_kernels() {
        for pairs in [0usize, 1, 7, 8, 9, 15, 16, 17, 24, 32, 40, 64, 129] {
            let mut rng = common::rng(7000 + pairs as u64);
            let src: Vec<f32> = (0..2 * pairs).map(|_| rounding_values(&mut rng)).collect();
            let tail = 0xDEAD_BEEFu32;
            let mut out = vec![tail; pairs + TAIL];
            let mut want = vec![0u32; pairs];
            kern.narrow_pairs_bf16(&src, &mut out[..pairs]);
            scalar.narrow_pairs_bf16(&src, &mut want);
            assert!(
                out[pairs..].iter().all(|&x| x == tail),
                "{}: out written after its end",
                kern.isa
            );
            for (i, (&got, &w)) in out[..pairs].iter().zip(&want).enumerate() {
                for half in 0..2 {
                    let (g, w) = ((got >> (16 * half)) as u16, (w >> (16 * half)) as u16);
                    let x = src[2 * i + half];
                    // DAZ: a subnormal input may give a zero of its sign (see the module docs).
                    let flushed = x.is_subnormal() && g == ((x.to_bits() >> 16) as u16 & 0x8000);
                    assert!(
                        g == w || flushed,
                        "{}: pairs={pairs} src[{}] = {x:e} -> {g:#06x}, scalar {w:#06x}",
                        kern.isa,
                        2 * i + half
                    );
                }
            }
        }
        let msg = "narrow_pairs_bf16: lengths";
        assert_panics(
            &format!("{} narrow_pairs_bf16: out long", kern.isa),
            msg,
            || kern.narrow_pairs_bf16(&[0.0; 6], &mut [0u32; 4]),
        );
    }
}
