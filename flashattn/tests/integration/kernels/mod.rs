//! The SIMD microkernels of `flashattn::simd` against their scalar twins (the `Isa::Scalar` table)
//! and against f64 computations, for every instruction set this CPU has: edge sizes, strides,
//! both accumulate modes, chunk lengths, masked (-inf) and huge scores, bf16 rounding, and the
//! bounds checks of the safe wrappers.
//!
//! Every product test writes a sentinel into C outside the `m × n` block the kernel may write
//! (the padding columns `n..c_rs` of each row and the rows after the last) and checks its bits
//! afterwards; in overwrite mode the block itself starts as NaN, so a kernel that reads it fails.
//!
//! # Error bound of the f32 products
//!
//! Let u = 2^-24 be the unit roundoff and EPS = f32::EPSILON = 2u. A kernel sums the k products of
//! one element in chunks of at most `kc` terms, each chunk by FMAs into a register starting at 0
//! (one rounding per term: the chunk sum carries error ≤ γ_kc · Σ|a·b| over its terms, where
//! γ_j = j·u / (1 - j·u)), then adds the q = ⌈k / kc⌉ chunk sums one by one into C (one rounding
//! per addition, and in accumulate mode C's initial value is one more term). Standard recursive
//! summation analysis (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1 and §4.2)
//! gives, per element,
//!
//! |ĉ - c| ≤ γ_{kc + q} · (Σ_k |a_ik · b_kj| + |c0_ij|)
//!
//! and γ_{kc+q} < (kc + q + 2) · EPS for every size here, which is the tolerance used (against an
//! f64 sum whose own error, ≤ k · 2^-53 · Σ|a·b|, is negligible). [`Kernels::gemm_scores`] sums two
//! halves in chunks of [`KC_SCORES`] and adds them: at most KC_SCORES + ⌈k/2 / KC_SCORES⌉ + 1 ≤
//! KC_SCORES + ⌈k / KC_SCORES⌉ + 1 roundings, so the same formula with kc = KC_SCORES holds.
//! The bf16 products are exact in f32 (8 + 8 significant bits); a chunk holds P = ⌈kc / 2⌉ pairs
//! with at most two roundings each (`vdpbf16ps` adds both products of a pair), so the bound is
//! (2P + ⌈k / P⌉ + 2) · EPS · Σ|a·b| with k counting pairs. With small integer data every sum is
//! exact and the kernels must agree with the scalar twin (or f64) bit for bit.
//!
//! # Softmax steps
//!
//! Scaling (`st *= scale`), maxima and `rescale_o` are single IEEE operations: they must match the
//! scalar twin exactly. The exponentials (`alpha`, the probabilities) are checked against f64
//! `2^x` of the same f32 argument within 3e-7 relative (the kernels' degree-7 polynomial is ~2 ulp),
//! and exactly 0 below -126 as documented; `row_sum` within its summation bound plus that.
//!
//! # bf16 packing
//!
//! `pack_pairs_bf16` and `narrow_pairs_bf16` must equal the scalar twin (`half`'s round-to-nearest-even) bit for bit, ties,
//! infinities, overflow to infinity and NaN included, except for subnormal f32 inputs: AVX512_BF16's
//! `vcvtneps2bf16` treats them as zero (DAZ) and gives a zero of the same sign, where `half` rounds
//! them to a bf16 subnormal. Either answer is accepted there.

use crate::common;

use flashattn::simd::{self, Gemm, Isa, Kernels, KC, KC_SCORES};
use half::bf16;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::panic::{catch_unwind, AssertUnwindSafe};

mod bounds;
mod gemm;
mod packing;
mod softmax;

const EPS: f64 = f32::EPSILON as f64;

/// What the kernels must leave untouched outside the block they write (an unusual finite value
/// of moderate size, so that adding anything but a tiny value to it changes its bits).
const SENTINEL: f32 = -1234.5677;
/// What the block to overwrite starts as (a quiet NaN with a payload).
const POISON: u32 = 0x7FC0_BAD0;

const MS: [usize; 11] = [0, 1, 2, 3, 4, 5, 7, 63, 64, 65, 113];
const NS: [usize; 7] = [16, 32, 48, 64, 80, 128, 256];
const KS: [usize; 14] = [0, 1, 2, 7, 8, 9, 31, 32, 33, 59, 64, 111, 128, 256];
const KCS: [usize; 4] = [1, 8, 32, 64];

fn scalar() -> &'static Kernels {
    Kernels::for_isa(Isa::Scalar).unwrap()
}

/// The SIMD tables of this CPU (empty on CPUs with none: then the comparisons pass trivially).
fn simd_kernels() -> Vec<&'static Kernels> {
    let ks: Vec<_> = simd::available()
        .into_iter()
        .filter(|&i| i != Isa::Scalar)
        .map(|i| Kernels::for_isa(i).unwrap())
        .collect();
    if ks.is_empty() {
        eprintln!("no SIMD instruction set on this CPU: nothing to compare");
    }
    ks
}

/// The table with the best instruction set (for the `#[should_panic]` tests).
fn best() -> &'static Kernels {
    Kernels::for_isa(simd::detected()).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Operands
// ---------------------------------------------------------------------------------------------

/// Strides and paddings of one product.
#[derive(Clone, Copy, Debug)]
struct Layout {
    /// A stored transposed (`a_rs = 1`, `a_cs = m + a_pad`) rather than by rows
    /// (`a_rs = k + a_pad`, `a_cs = 1`).
    a_transposed: bool,
    /// Neither of A's strides 1 (`a_rs = 2`, `a_cs = 2m + 1 + a_pad`), overriding
    /// `a_transposed`: the kernels' general addressing, beside the two layouts the passes use.
    a_spread: bool,
    a_pad: usize,
    /// `b_rs = n + b_pad`.
    b_pad: usize,
    /// `c_rs = n + c_pad`.
    c_pad: usize,
}

const LAYOUTS: [Layout; 5] = [
    Layout {
        a_transposed: false,
        a_spread: false,
        a_pad: 0,
        b_pad: 0,
        c_pad: 0,
    },
    Layout {
        a_transposed: true,
        a_spread: false,
        a_pad: 1,
        b_pad: 5,
        c_pad: 3,
    },
    Layout {
        a_transposed: false,
        a_spread: false,
        a_pad: 3,
        b_pad: 16,
        c_pad: 16,
    },
    Layout {
        a_transposed: true,
        a_spread: false,
        a_pad: 0,
        b_pad: 0,
        c_pad: 7,
    },
    Layout {
        a_transposed: false,
        a_spread: true,
        a_pad: 2,
        b_pad: 0,
        c_pad: 5,
    },
];

/// One product's operands, in any element type (`f32`, or `u32` bf16 pairs).
struct Operands<T> {
    m: usize,
    n: usize,
    k: usize,
    a: Vec<T>,
    a_rs: usize,
    a_cs: usize,
    b: Vec<T>,
    b_rs: usize,
    c_rs: usize,
    /// Rows of C after the last one the product writes.
    c_extra_rows: usize,
}

impl<T: Copy> Operands<T> {
    /// Operands of exactly the length the bounds checks require (A and B empty when nothing is
    /// read), elements drawn by `draw`.
    fn new(
        (m, n, k): (usize, usize, usize),
        lay: Layout,
        mut draw: impl FnMut() -> T,
    ) -> Operands<T> {
        let (a_rs, a_cs) = if lay.a_spread {
            (2, 2 * m + 1 + lay.a_pad)
        } else if lay.a_transposed {
            (1, m + lay.a_pad)
        } else {
            (k + lay.a_pad, 1)
        };
        let b_rs = n + lay.b_pad;
        let a_len = if m == 0 || k == 0 {
            0
        } else {
            (m - 1) * a_rs + (k - 1) * a_cs + 1
        };
        let b_len = if k == 0 { 0 } else { (k - 1) * b_rs + n };
        Operands {
            m,
            n,
            k,
            a: (0..a_len).map(|_| draw()).collect(),
            a_rs,
            a_cs,
            b: (0..b_len).map(|_| draw()).collect(),
            b_rs,
            c_rs: n + lay.c_pad,
            c_extra_rows: 2,
        }
    }

    fn gemm(&self, accumulate: bool, kc: usize) -> Gemm<'_, T> {
        Gemm {
            m: self.m,
            n: self.n,
            k: self.k,
            a: &self.a,
            a_rs: self.a_rs,
            a_cs: self.a_cs,
            b: &self.b,
            b_rs: self.b_rs,
            accumulate,
            kc,
        }
    }

    fn a_at(&self, i: usize, k: usize) -> T {
        self.a[i * self.a_rs + k * self.a_cs]
    }

    fn b_at(&self, k: usize, j: usize) -> T {
        self.b[k * self.b_rs + j]
    }

    /// `(Σ_k a·b, Σ_k |a·b|)` in f64 for every (i, j), row-major `m × n`, with `widen` giving the
    /// terms of one element pair (one term for f32, two for a bf16 pair).
    fn reference(&self, dot: impl Fn(T, T) -> (f64, f64)) -> (Vec<f64>, Vec<f64>) {
        let (m, n) = (self.m, self.n);
        let mut sum = vec![0f64; m * n];
        let mut abs = vec![0f64; m * n];
        for i in 0..m {
            for k in 0..self.k {
                let a = self.a_at(i, k);
                for j in 0..n {
                    let (s, t) = dot(a, self.b_at(k, j));
                    sum[i * n + j] += s;
                    abs[i * n + j] += t;
                }
            }
        }
        (sum, abs)
    }

    fn c_len(&self) -> usize {
        (self.m + self.c_extra_rows) * self.c_rs
    }

    fn in_block(&self, idx: usize) -> Option<(usize, usize)> {
        let (i, j) = (idx / self.c_rs, idx % self.c_rs);
        (i < self.m && j < self.n).then_some((i, j))
    }

    /// C as the kernel gets it: the sentinel outside the block; inside, `c0` (accumulate) or
    /// NaN (overwrite).
    fn c_initial(&self, accumulate: bool, c0: &[f32]) -> Vec<f32> {
        (0..self.c_len())
            .map(|idx| match self.in_block(idx) {
                Some((i, j)) if accumulate => c0[i * self.n + j],
                Some(_) => f32::from_bits(POISON),
                None => SENTINEL,
            })
            .collect()
    }
}

fn f32_dot(a: f32, b: f32) -> (f64, f64) {
    let p = a as f64 * b as f64;
    (p, p.abs())
}

fn widen_pair(p: u32) -> (f64, f64) {
    (
        bf16::from_bits(p as u16).to_f64(),
        bf16::from_bits((p >> 16) as u16).to_f64(),
    )
}

fn bf16_dot(a: u32, b: u32) -> (f64, f64) {
    let ((a0, a1), (b0, b1)) = (widen_pair(a), widen_pair(b));
    (a0 * b0 + a1 * b1, (a0 * b0).abs() + (a1 * b1).abs())
}

/// A bf16 pair of values drawn by `draw`, rounded to nearest even.
fn bf16_pair(mut draw: impl FnMut() -> f32) -> u32 {
    let lo = bf16::from_f32(draw()).to_bits() as u32;
    let hi = bf16::from_f32(draw()).to_bits() as u32;
    lo | hi << 16
}

fn uniform(rng: &mut ChaCha8Rng) -> f32 {
    rng.gen_range(-1.0f32..1.0)
}

/// A small integer in -8..=8: sums of up to 256 products of two stay exact in f32.
fn small_int(rng: &mut ChaCha8Rng) -> f32 {
    rng.gen_range(-8i32..=8) as f32
}

// ---------------------------------------------------------------------------------------------
// Checks of one product's result
// ---------------------------------------------------------------------------------------------

/// What one run was, for failure messages.
struct Run<'a> {
    what: &'a str,
    isa: Isa,
    accumulate: bool,
    kc: usize,
    lay: Layout,
}

/// Checks C after a product: the block against `sum` (+ `c0`) within `bound_terms · EPS · Σ|·|`
/// (exactly when `bound_terms` is 0), everything else bit-identical to the sentinel.
fn check_c<T: Copy>(
    ops: &Operands<T>,
    run: &Run<'_>,
    c: &[f32],
    c0: &[f32],
    (sum, abs): (&[f64], &[f64]),
    bound_terms: f64,
) {
    let ctx = || {
        format!(
            "{} on {}: m={} n={} k={} accumulate={} kc={} {:?}",
            run.what, run.isa, ops.m, ops.n, ops.k, run.accumulate, run.kc, run.lay
        )
    };
    assert_eq!(c.len(), ops.c_len(), "{}: C length changed", ctx());
    for (idx, &got) in c.iter().enumerate() {
        match ops.in_block(idx) {
            None => assert_eq!(
                got.to_bits(),
                SENTINEL.to_bits(),
                "{}: C[{idx}] (row {}, column {}) is outside the block but was written ({got})",
                ctx(),
                idx / ops.c_rs,
                idx % ops.c_rs
            ),
            Some((i, j)) => {
                let e = i * ops.n + j;
                let (init, init_abs) = if run.accumulate {
                    (c0[e] as f64, (c0[e] as f64).abs())
                } else {
                    (0.0, 0.0)
                };
                let want = init + sum[e];
                let tol = bound_terms * EPS * (abs[e] + init_abs);
                let err = (got as f64 - want).abs();
                assert!(
                    got.is_finite() && err <= tol,
                    "{}: C[{i}][{j}] = {got:e}, f64 {want:e}, error {err:e} > bound {tol:e}",
                    ctx()
                );
            }
        }
    }
}

/// The f32 bound's number of EPS units: `kc + ⌈k / kc⌉ + 2` (see the module docs).
fn f32_bound_terms(k: usize, kc: usize) -> f64 {
    (kc + k.div_ceil(kc) + 2) as f64
}

/// The bf16 bound's number of EPS units for `k` pairs: `2P + ⌈k / P⌉ + 2`, `P = ⌈kc / 2⌉`.
fn bf16_bound_terms(k: usize, kc: usize) -> f64 {
    let p = kc.div_ceil(2);
    (2 * p + k.div_ceil(p) + 2) as f64
}

/// Every (m, n, k) of the grid, with a layout cycling through [`LAYOUTS`] and a seed.
fn grid() -> impl Iterator<Item = ((usize, usize, usize), Layout, u64)> {
    let mut idx = 0u64;
    let mut out = Vec::new();
    for &m in &MS {
        for &n in &NS {
            for &k in &KS {
                out.push(((m, n, k), LAYOUTS[idx as usize % LAYOUTS.len()], idx));
                idx += 1;
            }
        }
    }
    out.into_iter()
}

/// The grid's f32 operands as the score product gets them (C rows unpadded, as the forward
/// pass calls it), each drawn from `seed_base` plus its index.
fn score_cases(seed_base: u64) -> impl Iterator<Item = (Layout, Operands<f32>)> {
    grid().map(move |(shape, lay, seed)| {
        let lay = Layout { c_pad: 0, ..lay };
        let mut rng = common::rng(seed_base + seed);
        (lay, Operands::new(shape, lay, || uniform(&mut rng)))
    })
}

const TAIL: usize = 16;

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    match p.downcast::<String>() {
        Ok(s) => *s,
        Err(p) => p
            .downcast::<&str>()
            .map(|s| s.to_string())
            .unwrap_or_default(),
    }
}

/// `f` panics with a message containing `expected`.
fn assert_panics(what: &str, expected: &str, f: impl FnOnce()) {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(()) => panic!("{what}: did not panic"),
        Err(p) => {
            let msg = panic_message(p);
            assert!(
                msg.contains(expected),
                "{what}: panicked with {msg:?}, want {expected:?}"
            );
        }
    }
}

/// A valid product: m = 4, n = 32, k = 8, A by rows (a_rs = 8), b_rs = 32, c_rs = 32.
struct Valid {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}
