//! Seeded values in every dtype, and bit comparisons.

use super::*;

pub const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

// ---------------------------------------------------------------------------------------------
// Values
// ---------------------------------------------------------------------------------------------

/// How input values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Dist {
    /// U(-1, 1).
    Uniform,
    /// N(0, 1).
    Normal,
    /// q and k U(-1, 1) scaled so that the scaled scores have standard deviation `target` (their
    /// extremes reach a few times that); v stays U(-1, 1). Softmax is then nearly one-hot and any
    /// error in the scores is amplified.
    Huge(f64),
}

/// One value, never exactly zero.
pub fn sample(rng: &mut ChaCha8Rng, dist: Dist) -> f64 {
    loop {
        let x = match dist {
            Dist::Uniform | Dist::Huge(_) => rng.gen_range(-1.0..1.0),
            Dist::Normal => {
                // Box-Muller.
                let u1: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
                let u2: f64 = rng.gen::<f64>();
                (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
            }
        };
        if x.abs() > 1e-6 {
            return x;
        }
    }
}

pub fn values(rng: &mut ChaCha8Rng, n: usize, dist: Dist) -> Vec<f64> {
    (0..n).map(|_| sample(rng, dist)).collect()
}

/// Rounds f64 values into a buffer of `dtype` (round to nearest even, no double rounding).
pub fn to_buffer(vals: &[f64], dtype: DType) -> Buffer {
    match dtype {
        DType::F32 => Buffer::F32(vals.iter().map(|&x| x as f32).collect()),
        DType::F16 => Buffer::F16(vals.iter().map(|&x| f16::from_f64(x)).collect()),
        DType::BF16 => Buffer::BF16(vals.iter().map(|&x| bf16::from_f64(x)).collect()),
    }
}

/// The part of a borrowed buffer from element `offset` on.
pub fn slice_from(s: Slice<'_>, offset: usize) -> Slice<'_> {
    match s {
        Slice::F32(d) => Slice::F32(&d[offset..]),
        Slice::F16(d) => Slice::F16(&d[offset..]),
        Slice::BF16(d) => Slice::BF16(&d[offset..]),
    }
}

/// The bit patterns of a tensor's elements (for bit-for-bit comparisons).
pub fn bits(t: &Tensor) -> Vec<u32> {
    match t.buffer() {
        Buffer::F32(d) => d.iter().map(|x| x.to_bits()).collect(),
        Buffer::F16(d) => d.iter().map(|x| x.to_bits() as u32).collect(),
        Buffer::BF16(d) => d.iter().map(|x| x.to_bits() as u32).collect(),
    }
}

/// Asserts two results are identical bit for bit (shape, dtype, every element of out and lse).
pub fn assert_bit_identical(a: &AttnOutput, b: &AttnOutput, what: &str) {
    assert_eq!(a.out.shape(), b.out.shape(), "{what}: out shapes differ");
    assert_eq!(a.out.dtype(), b.out.dtype(), "{what}: out dtypes differ");
    assert_eq!(a.lse.shape(), b.lse.shape(), "{what}: lse shapes differ");
    let first_diff = |x: &[u32], y: &[u32]| x.iter().zip(y).position(|(p, q)| p != q);
    let (ao, bo) = (bits(&a.out), bits(&b.out));
    if let Some(i) = first_diff(&ao, &bo) {
        panic!(
            "{what}: out differs at flat index {i}: {} vs {}",
            a.out.to_f64_vec()[i],
            b.out.to_f64_vec()[i]
        );
    }
    let (al, bl) = (bits(&a.lse), bits(&b.lse));
    if let Some(i) = first_diff(&al, &bl) {
        panic!(
            "{what}: lse differs at flat index {i}: {} vs {}",
            a.lse.to_f64_vec()[i],
            b.lse.to_f64_vec()[i]
        );
    }
}
