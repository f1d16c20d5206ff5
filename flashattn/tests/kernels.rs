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

mod common;

use flashattn::simd::{self, Gemm, Isa, Kernels, KC, KC_SCORES};
use half::bf16;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::panic::{catch_unwind, AssertUnwindSafe};

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
    a_pad: usize,
    /// `b_rs = n + b_pad`.
    b_pad: usize,
    /// `c_rs = n + c_pad`.
    c_pad: usize,
}

const LAYOUTS: [Layout; 4] = [
    Layout {
        a_transposed: false,
        a_pad: 0,
        b_pad: 0,
        c_pad: 0,
    },
    Layout {
        a_transposed: true,
        a_pad: 1,
        b_pad: 5,
        c_pad: 3,
    },
    Layout {
        a_transposed: false,
        a_pad: 3,
        b_pad: 16,
        c_pad: 16,
    },
    Layout {
        a_transposed: true,
        a_pad: 0,
        b_pad: 0,
        c_pad: 7,
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
        let (a_rs, a_cs) = if lay.a_transposed {
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

// ---------------------------------------------------------------------------------------------
// f32 products
// ---------------------------------------------------------------------------------------------

/// Every size of the grid, both accumulate modes, every chunk length, on every SIMD table, against
/// f64 within the derived bound; C outside the block untouched.
#[test]
fn gemm_matches_f64_within_the_chunked_summation_bound() {
    let kernels = simd_kernels();
    if kernels.is_empty() {
        return;
    }
    for (shape, lay, seed) in grid() {
        let mut rng = common::rng(0x6e33_0000 + seed);
        let ops = Operands::new(shape, lay, || uniform(&mut rng));
        let c0: Vec<f32> = (0..ops.m * ops.n).map(|_| uniform(&mut rng)).collect();
        let (sum, abs) = ops.reference(f32_dot);
        for kern in &kernels {
            for accumulate in [false, true] {
                for kc in KCS {
                    let mut c = ops.c_initial(accumulate, &c0);
                    kern.gemm(&ops.gemm(accumulate, kc), &mut c, ops.c_rs);
                    let run = Run {
                        what: "gemm",
                        isa: kern.isa,
                        accumulate,
                        kc,
                        lay,
                    };
                    let terms = if ops.k == 0 {
                        0.0
                    } else {
                        f32_bound_terms(ops.k, kc)
                    };
                    check_c(&ops, &run, &c, &c0, (&sum, &abs), terms);
                }
            }
        }
    }
}

/// With small integers every sum is exact: the SIMD kernels must equal the scalar twin exactly,
/// on every layout, both modes and every chunk length.
#[test]
fn gemm_equals_the_scalar_twin_on_exact_sums() {
    let kernels = simd_kernels();
    let scalar = scalar();
    for &m in &[0, 1, 3, 4, 5, 64, 113] {
        for &n in &[16, 48, 80, 256] {
            for &k in &[0, 1, 9, 33, 256] {
                for (li, lay) in LAYOUTS.into_iter().enumerate() {
                    let mut rng = common::rng(0x1e7 + (m * 1_000_000 + n * 1000 + k) as u64);
                    let ops = Operands::new((m, n, k), lay, || small_int(&mut rng));
                    let c0: Vec<f32> = (0..m * n).map(|_| small_int(&mut rng)).collect();
                    for accumulate in [false, true] {
                        let mut want = ops.c_initial(accumulate, &c0);
                        scalar.gemm(&ops.gemm(accumulate, 32), &mut want, ops.c_rs);
                        for kern in &kernels {
                            for kc in KCS {
                                let mut c = ops.c_initial(accumulate, &c0);
                                kern.gemm(&ops.gemm(accumulate, kc), &mut c, ops.c_rs);
                                let same = c
                                    .iter()
                                    .zip(&want)
                                    .all(|(x, y)| x == y || x.to_bits() == y.to_bits());
                                assert!(
                                    same,
                                    "gemm on {}: m={m} n={n} k={k} layout {li} accumulate={accumulate} kc={kc} differs from scalar",
                                    kern.isa
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `gemm_scores` (k split in two halves, chunks of KC_SCORES, overwrite) on every SIMD table and
/// the scalar one, against f64. C's rows are not padded here (c_rs = n, as the forward pass calls
/// it); the rows after the block must be untouched.
#[test]
fn gemm_scores_matches_f64_within_its_bound() {
    let mut kernels = simd_kernels();
    kernels.push(scalar());
    for (lay, ops) in score_cases(0x5c0_0000) {
        let (sum, abs) = ops.reference(f32_dot);
        for kern in &kernels {
            // `accumulate` is ignored: scores are always overwritten.
            for accumulate in [false, true] {
                let mut c = ops.c_initial(false, &[]);
                let mut tmp = vec![f32::from_bits(POISON); ops.c_len()];
                kern.gemm_scores(&ops.gemm(accumulate, KC), &mut c, ops.c_rs, &mut tmp);
                let run = Run {
                    what: "gemm_scores",
                    isa: kern.isa,
                    accumulate: false,
                    kc: KC_SCORES,
                    lay,
                };
                let terms = if ops.k == 0 {
                    0.0
                } else {
                    f32_bound_terms(ops.k, KC_SCORES) + 1.0
                };
                check_c(&ops, &run, &c, &[], (&sum, &abs), terms);
            }
        }
    }
}

/// A dedicated `gemm_scores` kernel (AVX-512) adds in the same order as the portable split (two
/// chunked `gemm` calls and an add pass), so every SIMD table gives the same scores (up to the sign
/// of a zero).
#[test]
fn gemm_scores_gives_the_same_bits_on_every_simd_table() {
    let kernels = simd_kernels();
    if kernels.len() < 2 {
        return;
    }
    for (lay, ops) in score_cases(0x5b17_0000) {
        let run = |kern: &Kernels| {
            let mut c = ops.c_initial(false, &[]);
            let mut tmp = vec![0f32; ops.c_len()];
            kern.gemm_scores(&ops.gemm(false, KC), &mut c, ops.c_rs, &mut tmp);
            c
        };
        let first = run(kernels[0]);
        for kern in &kernels[1..] {
            let c = run(kern);
            let at = c.iter().zip(&first).position(|(x, y)| x != y);
            assert!(
                at.is_none(),
                "gemm_scores: {} and {} differ at C[{}] ({:e} vs {:e}): m={} n={} k={} {lay:?}",
                kernels[0].isa,
                kern.isa,
                at.unwrap(),
                c[at.unwrap()],
                first[at.unwrap()],
                ops.m,
                ops.n,
                ops.k
            );
        }
    }
}

/// Every table's `gemm_scores` (the dedicated AVX-512 kernel, the fallback elsewhere)
/// gives the bits of its contract computed with the same table's `gemm`: k split in two halves
/// (one when a half is shorter than `KC_SCORES`), each summed in chunks of `KC_SCORES` from its
/// start, the second half added to the first.
#[test]
fn gemm_scores_is_two_chunked_halves_of_gemm() {
    for kern in simd_kernels().into_iter().chain([scalar()]) {
        for (lay, ops) in score_cases(0x2a17_0000) {
            if ops.m == 0 {
                // A is then empty and the halves below cannot slice it; gemm_scores itself
                // handles no rows (gemm_scores_with_no_rows_touches_nothing).
                continue;
            }
            let mut c = ops.c_initial(false, &[]);
            let mut tmp = vec![0f32; ops.c_len()];
            kern.gemm_scores(&ops.gemm(false, KC), &mut c, ops.c_rs, &mut tmp);
            // The contract, by hand.
            let g = ops.gemm(false, KC_SCORES);
            let half = if ops.k / 2 < KC_SCORES {
                ops.k
            } else {
                ops.k / 2
            };
            let mut want = ops.c_initial(false, &[]);
            kern.gemm(&Gemm { k: half, ..g }, &mut want, ops.c_rs);
            if half < ops.k {
                let hi = Gemm {
                    k: ops.k - half,
                    a: &ops.a[half * ops.a_cs..],
                    b: &ops.b[half * ops.b_rs..],
                    ..g
                };
                let mut t = ops.c_initial(false, &[]);
                kern.gemm(&hi, &mut t, ops.c_rs);
                for i in 0..ops.m {
                    for j in 0..ops.n {
                        want[i * ops.c_rs + j] += t[i * ops.c_rs + j];
                    }
                }
            }
            let at = c
                .iter()
                .zip(&want)
                .position(|(x, y)| x.to_bits() != y.to_bits() && x != y);
            assert!(
                at.is_none(),
                "{}: gemm_scores differs from its two halves at C[{}] ({:e} vs {:e}): m={} n={} k={} {lay:?}",
                kern.isa,
                at.unwrap(),
                c[at.unwrap()],
                want[at.unwrap()],
                ops.m,
                ops.n,
                ops.k
            );
        }
    }
}

/// `Kernels::scores`, the attention calls' score product: with softcap, `gemm_scores`'s bits on
/// every table; without, `gemm_scores`'s on a table with its own kernel (AVX-512) and elsewhere
/// one `gemm` overwrite in chunks of `KC`, within that order's f64 bound. C's block and the scratch
/// start poisoned, C's other elements as sentinels that must stay.
#[test]
fn scores_take_the_split_only_with_softcap_or_for_free() {
    for kern in simd_kernels().into_iter().chain([scalar()]) {
        for (lay, ops) in score_cases(0x5c07_0000) {
            let (sum, abs) = ops.reference(f32_dot);
            let run = |f: &dyn Fn(&mut [f32], &mut [f32])| {
                let mut c = ops.c_initial(false, &[]);
                let mut tmp = vec![f32::from_bits(POISON); ops.c_len()];
                f(&mut c, &mut tmp);
                c
            };
            let g = ops.gemm(true, KC);
            let split = run(&|c, t| kern.gemm_scores(&g, c, ops.c_rs, t));
            let one_pass = run(&|c, _| kern.gemm(&ops.gemm(false, KC), c, ops.c_rs));
            for softcap in [true, false] {
                let got = run(&|c, t| kern.scores(&g, c, ops.c_rs, t, softcap));
                let split_expected = softcap || kern.isa == Isa::Avx512;
                let want = if split_expected { &split } else { &one_pass };
                let at = got
                    .iter()
                    .zip(want)
                    .position(|(x, y)| x.to_bits() != y.to_bits() && x != y);
                assert!(
                    at.is_none(),
                    "{}: scores (softcap {softcap}) differ from {} at C[{}]: m={} n={} k={} {lay:?}",
                    kern.isa,
                    if split_expected { "gemm_scores" } else { "gemm" },
                    at.unwrap(),
                    ops.m,
                    ops.n,
                    ops.k
                );
                let (kc, terms) = match (split_expected, ops.k) {
                    (_, 0) => (KC, 0.0),
                    (true, k) => (KC_SCORES, f32_bound_terms(k, KC_SCORES) + 1.0),
                    (false, k) => (KC, f32_bound_terms(k, KC)),
                };
                let what = Run {
                    what: "scores",
                    isa: kern.isa,
                    accumulate: false,
                    kc,
                    lay,
                };
                check_c(&ops, &what, &got, &[], (&sum, &abs), terms);
            }
        }
    }
}

/// `gemm_scores` with padded C rows (c_rs > n) and a scratch buffer holding stale data: the
/// padding columns of C must stay as they were, as they do with `gemm`.
#[test]
fn gemm_scores_leaves_padding_columns_of_c_untouched() {
    for kern in simd_kernels().into_iter().chain([scalar()]) {
        let lay = Layout {
            a_transposed: false,
            a_pad: 0,
            b_pad: 0,
            c_pad: 16,
        };
        let mut rng = common::rng(77);
        let ops = Operands::new((4, 16, 64), lay, || uniform(&mut rng));
        let (sum, abs) = ops.reference(f32_dot);
        let mut c = ops.c_initial(false, &[]);
        let mut tmp = vec![1.0f32; ops.c_len()];
        kern.gemm_scores(&ops.gemm(false, KC), &mut c, ops.c_rs, &mut tmp);
        let run = Run {
            what: "gemm_scores",
            isa: kern.isa,
            accumulate: false,
            kc: KC_SCORES,
            lay,
        };
        check_c(
            &ops,
            &run,
            &c,
            &[],
            (&sum, &abs),
            f32_bound_terms(64, KC_SCORES) + 1.0,
        );
    }
}

/// `gemm_scores` with m = 0 has nothing to read or write, like `gemm` (whose check accepts any A
/// and C when m = 0): it must neither touch C nor panic on an empty A or C.
#[test]
fn gemm_scores_with_no_rows_touches_nothing() {
    let mut failures = Vec::new();
    for kern in simd_kernels().into_iter().chain([scalar()]) {
        let isa = kern.isa;
        let b = vec![0.5f32; 32 * 16];
        let a = vec![0.5f32; 32];
        let g = Gemm {
            m: 0,
            n: 16,
            k: 32,
            a: &a,
            a_rs: 32,
            a_cs: 1,
            b: &b,
            b_rs: 16,
            accumulate: false,
            kc: KC,
        };
        let mut c = vec![SENTINEL; 16];
        let mut tmp = vec![1.0f32; 16];
        kern.gemm_scores(&g, &mut c, 16, &mut tmp);
        if c.iter().any(|x| x.to_bits() != SENTINEL.to_bits()) {
            failures.push(format!("{isa}: C was written: {c:?}"));
        }
        let no_a = Gemm { a: &[], ..g };
        if catch_unwind(AssertUnwindSafe(|| {
            kern.gemm_scores(&no_a, &mut [0.0; 16], 16, &mut [0.0; 16])
        }))
        .is_err()
        {
            failures.push(format!("{isa}: panicked on an empty A"));
        }
        if catch_unwind(AssertUnwindSafe(|| {
            kern.gemm_scores(&g, &mut [], 16, &mut [0.0; 16])
        }))
        .is_err()
        {
            failures.push(format!("{isa}: panicked on an empty C"));
        }
        // gemm itself, for comparison, accepts all three.
        kern.gemm(&no_a, &mut [], 16);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------------------------
// bf16 products
// ---------------------------------------------------------------------------------------------

fn bf16_kernels() -> Vec<&'static Kernels> {
    let ks: Vec<_> = simd_kernels()
        .into_iter()
        .filter(|k| k.has_bf16_dot())
        .collect();
    if ks.is_empty() {
        eprintln!("no bf16 dot product on this CPU: gemm_bf16 not tested");
    }
    ks
}

/// `gemm_bf16` over the same grid (k counts pairs) against f64 of the unpacked bf16 values.
#[test]
fn gemm_bf16_matches_f64_within_the_chunked_summation_bound() {
    let kernels = bf16_kernels();
    if kernels.is_empty() {
        return;
    }
    for (shape, lay, seed) in grid() {
        let mut rng = common::rng(0xbf16_0000 + seed);
        let ops = Operands::new(shape, lay, || bf16_pair(|| uniform(&mut rng)));
        let c0: Vec<f32> = (0..ops.m * ops.n).map(|_| uniform(&mut rng)).collect();
        let (sum, abs) = ops.reference(bf16_dot);
        for kern in &kernels {
            for accumulate in [false, true] {
                for kc in KCS {
                    let mut c = ops.c_initial(accumulate, &c0);
                    kern.gemm_bf16(&ops.gemm(accumulate, kc), &mut c, ops.c_rs);
                    let run = Run {
                        what: "gemm_bf16",
                        isa: kern.isa,
                        accumulate,
                        kc,
                        lay,
                    };
                    let terms = if ops.k == 0 {
                        0.0
                    } else {
                        bf16_bound_terms(ops.k, kc)
                    };
                    check_c(&ops, &run, &c, &c0, (&sum, &abs), terms);
                }
            }
        }
    }
}

/// With small integers the bf16 products and their sums are exact: results equal f64 exactly.
#[test]
fn gemm_bf16_is_exact_on_exact_sums() {
    for kern in bf16_kernels() {
        for &m in &[1, 3, 4, 5, 64, 113] {
            for &n in &[16, 48, 80, 256] {
                for &k in &[1, 9, 33, 128] {
                    for lay in LAYOUTS {
                        let mut rng = common::rng(0xe8 + (m * 1_000_000 + n * 1000 + k) as u64);
                        let ops =
                            Operands::new((m, n, k), lay, || bf16_pair(|| small_int(&mut rng)));
                        let c0: Vec<f32> = (0..m * n).map(|_| small_int(&mut rng)).collect();
                        let (sum, abs) = ops.reference(bf16_dot);
                        for accumulate in [false, true] {
                            for kc in KCS {
                                let mut c = ops.c_initial(accumulate, &c0);
                                kern.gemm_bf16(&ops.gemm(accumulate, kc), &mut c, ops.c_rs);
                                let run = Run {
                                    what: "gemm_bf16 (exact)",
                                    isa: kern.isa,
                                    accumulate,
                                    kc,
                                    lay,
                                };
                                check_c(&ops, &run, &c, &c0, (&sum, &abs), 0.0);
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "gemm_bf16 on an ISA without it")]
fn gemm_bf16_panics_on_a_table_without_it() {
    let p = [0u32; 16];
    let g = Gemm {
        m: 1,
        n: 16,
        k: 1,
        a: &p,
        a_rs: 1,
        a_cs: 1,
        b: &p,
        b_rs: 16,
        accumulate: false,
        kc: KC,
    };
    scalar().gemm_bf16(&g, &mut [0.0; 16], 16);
}

// ---------------------------------------------------------------------------------------------
// Online softmax
// ---------------------------------------------------------------------------------------------

/// Softmax state of `n` lanes, with a sentinel tail after lane n in every buffer.
#[derive(Clone)]
struct State {
    row_max: Vec<f32>,
    row_sum: Vec<f32>,
    alpha: Vec<f32>,
    m_sub: Vec<f32>,
}

const TAIL: usize = 16;

fn with_tail(mut v: Vec<f32>) -> Vec<f32> {
    v.extend(std::iter::repeat_n(SENTINEL, TAIL));
    v
}

fn tail_untouched(v: &[f32], from: usize) -> bool {
    v[from..].iter().all(|x| x.to_bits() == SENTINEL.to_bits())
}

impl State {
    fn new(n: usize) -> State {
        State {
            row_max: with_tail(vec![f32::NEG_INFINITY; n]),
            row_sum: with_tail(vec![0.0; n]),
            alpha: with_tail(vec![f32::from_bits(POISON); n]),
            m_sub: with_tail(vec![f32::from_bits(POISON); n]),
        }
    }
}

/// `2^x` in f64 for an f32 argument, with the kernels' documented cut: exactly 0 below -126.
fn exp2_want(x: f32) -> f64 {
    if x < -126.0 {
        0.0
    } else {
        (x as f64).exp2()
    }
}

/// `got` is `2^x` within 3e-7 relative (exactly 0 where the contract says so); no NaN.
fn check_exp2(got: f32, x: f32, ctx: &dyn Fn() -> String) {
    let want = exp2_want(x);
    if want == 0.0 {
        assert!(got == 0.0, "{}: 2^{x:e} = {got:e}, want exactly 0", ctx());
    } else {
        let rel = (got as f64 - want).abs() / want;
        assert!(
            rel <= 3e-7,
            "{}: 2^{x:e} = {got:e}, f64 {want:e}, relative error {rel:e}",
            ctx()
        );
    }
}

/// Floats equal, -0 == +0, and no NaN where the other has none.
fn same(x: f32, y: f32) -> bool {
    x == y || (x.is_nan() && y.is_nan())
}

/// One softmax block through `kern` (max_get_scale, online_softmax, rescale_o), checked against
/// the scalar twin and f64. Advances `state` and `ot` with the kernel's results.
#[allow(clippy::too_many_arguments)]
fn softmax_step(
    kern: &Kernels,
    st_in: &[f32],
    cols: usize,
    n: usize,
    scale: f32,
    state: &mut State,
    ot: &mut [f32],
    ctx: &dyn Fn() -> String,
) {
    let scalar = scalar();
    let d = ot.len() / n;
    // --- max_get_scale: st *= scale, running max, alpha, m_sub.
    let before = state.clone();
    let mut st = with_tail(st_in.to_vec());
    let mut st_ref = st.clone();
    let mut sref = state.clone();
    kern.max_get_scale(
        &mut st,
        cols,
        n,
        scale,
        &mut state.row_max,
        &mut state.alpha,
        &mut state.m_sub,
    );
    scalar.max_get_scale(
        &mut st_ref,
        cols,
        n,
        scale,
        &mut sref.row_max,
        &mut sref.alpha,
        &mut sref.m_sub,
    );
    let c = || {
        format!(
            "{} max_get_scale(cols={cols}, n={n}, scale={scale:e})",
            ctx()
        )
    };
    for (i, (x, y)) in st.iter().zip(&st_ref).enumerate() {
        assert_eq!(
            x.to_bits(),
            y.to_bits(),
            "{}: scaled st[{i}] = {x:e}, scalar {y:e}",
            c()
        );
    }
    for name in ["row_max", "m_sub", "alpha"] {
        let (v, t) = match name {
            "row_max" => (&state.row_max, &sref.row_max),
            "m_sub" => (&state.m_sub, &sref.m_sub),
            _ => (&state.alpha, &sref.alpha),
        };
        assert!(tail_untouched(v, n), "{}: {name} written after lane n", c());
        if name != "alpha" {
            for j in 0..n {
                assert!(
                    same(v[j], t[j]),
                    "{}: {name}[{j}] = {:e}, scalar {:e}",
                    c(),
                    v[j],
                    t[j]
                );
            }
        }
    }
    for j in 0..n {
        let (old, new) = (before.row_max[j], state.row_max[j]);
        let block_max = (0..cols)
            .map(|c| st_ref[c * n + j])
            .fold(f32::NEG_INFINITY, f32::max);
        assert!(
            same(new, old.max(block_max)),
            "{}: row_max[{j}] = {new:e}",
            c()
        );
        let cl = || format!("{} lane {j} (old max {old:e}, new {new:e})", c());
        assert!(
            !state.alpha[j].is_nan() && !state.m_sub[j].is_nan(),
            "{}: NaN",
            cl()
        );
        if new == f32::NEG_INFINITY {
            // A lane that has seen only masked keys.
            assert_eq!(
                state.alpha[j],
                1.0,
                "{}: alpha of a fully masked lane",
                cl()
            );
            assert_eq!(
                state.m_sub[j].to_bits(),
                0f32.to_bits(),
                "{}: m_sub of a fully masked lane",
                cl()
            );
        } else {
            check_exp2(state.alpha[j], old - new, &cl);
            check_exp2(sref.alpha[j], old - new, &|| {
                format!("{} (scalar twin)", cl())
            });
        }
    }
    // --- online_softmax: st = exp2(st - m_sub), row_sum = row_sum·alpha + Σ st.
    let scaled = st.clone();
    let mut st_ref = st.clone();
    let mut sum_ref = state.row_sum.clone();
    let sum_before = state.row_sum.clone();
    kern.online_softmax(
        &mut st,
        cols,
        n,
        &state.m_sub,
        &mut state.row_sum,
        &state.alpha,
    );
    scalar.online_softmax(
        &mut st_ref,
        cols,
        n,
        &state.m_sub,
        &mut sum_ref,
        &state.alpha,
    );
    let c = || format!("{} online_softmax(cols={cols}, n={n})", ctx());
    assert!(
        tail_untouched(&st, cols * n),
        "{}: st written after cols·n",
        c()
    );
    assert!(
        tail_untouched(&state.row_sum, n),
        "{}: row_sum written after lane n",
        c()
    );
    for j in 0..n {
        let mut want = sum_before[j] as f64 * state.alpha[j] as f64;
        let mut mag = want.abs();
        for col in 0..cols {
            let x = scaled[col * n + j] - state.m_sub[j];
            let cl = || format!("{} st[{col}][{j}]", c());
            check_exp2(st[col * n + j], x, &cl);
            check_exp2(st_ref[col * n + j], x, &|| {
                format!("{} (scalar twin)", cl())
            });
            if state.row_max[j] == f32::NEG_INFINITY {
                assert_eq!(
                    st[col * n + j].to_bits(),
                    0,
                    "{}: probability of a fully masked lane",
                    cl()
                );
            }
            want += exp2_want(x);
            mag += exp2_want(x);
        }
        let tol = ((cols + 2) as f64 * EPS + 3e-7) * mag;
        for (who, got) in [("kernel", state.row_sum[j]), ("scalar twin", sum_ref[j])] {
            let err = (got as f64 - want).abs();
            assert!(
                got.is_finite() && err <= tol,
                "{}: {who} row_sum[{j}] = {got:e}, f64 {want:e}, error {err:e} > {tol:e}",
                c()
            );
        }
        if state.row_max[j] == f32::NEG_INFINITY {
            assert_eq!(
                state.row_sum[j],
                0.0,
                "{}: row_sum of a fully masked lane",
                c()
            );
        }
    }
    // --- rescale_o: ot *= alpha, a single multiply: bit-identical to the twin.
    let mut o = with_tail(ot.to_vec());
    let mut o_ref = o.clone();
    kern.rescale_o(&mut o, d, n, &state.alpha);
    scalar.rescale_o(&mut o_ref, d, n, &state.alpha);
    for (i, (x, y)) in o.iter().zip(&o_ref).enumerate() {
        assert_eq!(
            x.to_bits(),
            y.to_bits(),
            "{} rescale_o(rows={d}, n={n}): ot[{i}]",
            ctx()
        );
    }
    ot.copy_from_slice(&o[..ot.len()]);
}

/// How one block's scores are drawn.
#[derive(Clone, Copy, Debug)]
enum Scores {
    /// N(0, 1)·8 (in the log2 domain, after scale ~1).
    Normal,
    /// Some entries -inf (masked), lanes `j % 7 == 3` and the lane group 16..32 -inf throughout.
    Masked,
    /// As `Masked`, and every lane fully masked (all -inf): the first blocks of a causal row.
    AllMasked,
    /// Entries of ±1e30 (after the scale) among normal ones.
    Huge,
}

fn draw_scores(rng: &mut ChaCha8Rng, kind: Scores, cols: usize, n: usize, scale: f32) -> Vec<f32> {
    let mut st = vec![0f32; cols * n];
    for c in 0..cols {
        for j in 0..n {
            let normal = rng.gen_range(-8.0f32..8.0);
            let masked = j % 7 == 3 || (16..32).contains(&j);
            st[c * n + j] = match kind {
                Scores::Normal => normal,
                Scores::AllMasked => f32::NEG_INFINITY,
                Scores::Masked if masked || rng.gen_bool(0.3) => f32::NEG_INFINITY,
                Scores::Masked => normal,
                Scores::Huge => match rng.gen_range(0..4) {
                    0 => 1e30 / scale,
                    1 => -1e30 / scale,
                    _ => normal,
                },
            };
        }
    }
    st
}

/// Blocks of several widths through the three softmax steps on every SIMD table, running state
/// carried between blocks, for every lane count; scores normal, masked, fully masked and huge,
/// with positive, zero and negative scales.
#[test]
fn softmax_steps_match_the_scalar_twin_and_f64() {
    let kernels = simd_kernels();
    // (scores of each block, scale). -inf entries only with positive scales: -inf·0 is NaN and
    // -inf·(negative) is +inf, which the forward pass never produces (it scales before masking).
    let scenarios: [(&[Scores], f32); 9] = [
        (&[Scores::Normal, Scores::Normal, Scores::Normal], 1.0),
        (&[Scores::Normal, Scores::Normal], 0.180_336_88), // log2(e)/8
        (&[Scores::Masked, Scores::Normal, Scores::Masked], 1.0),
        (
            &[
                Scores::AllMasked,
                Scores::AllMasked,
                Scores::Masked,
                Scores::Masked,
            ],
            1.0,
        ),
        (&[Scores::AllMasked, Scores::Normal], 0.5),
        (&[Scores::Huge, Scores::Normal, Scores::Huge], 1.0),
        (&[Scores::Normal, Scores::Huge], 2.0),
        (&[Scores::Normal, Scores::Normal], 0.0),
        (&[Scores::Normal, Scores::Huge, Scores::Normal], -0.75),
    ];
    let col_sets: [&[usize]; 3] = [&[1, 2, 7, 0], &[64, 65, 3], &[113, 5]];
    let d = 3;
    for kern in &kernels {
        for &n in &NS {
            for (si, &(blocks, scale)) in scenarios.iter().enumerate() {
                for (ci, cols_set) in col_sets.iter().enumerate() {
                    let mut rng = common::rng((si * 1000 + ci * 10_000 + n) as u64);
                    let mut state = State::new(n);
                    let mut ot: Vec<f32> = (0..d * n).map(|_| uniform(&mut rng)).collect();
                    for (b, &kind) in blocks.iter().enumerate() {
                        let cols = cols_set[b % cols_set.len()];
                        let st = draw_scores(&mut rng, kind, cols, n, scale);
                        let ctx =
                            || format!("{}: n={n} scenario {si} ({kind:?}, block {b})", kern.isa);
                        softmax_step(kern, &st, cols, n, scale, &mut state, &mut ot, &ctx);
                    }
                    // A lane masked throughout keeps the initial state exactly.
                    if blocks
                        .iter()
                        .all(|s| matches!(s, Scores::Masked | Scores::AllMasked))
                    {
                        for j in (0..n).filter(|j| j % 7 == 3 || (16..32).contains(j)) {
                            assert_eq!(state.row_max[j], f32::NEG_INFINITY);
                            assert_eq!(state.row_sum[j], 0.0);
                        }
                    }
                }
            }
        }
    }
}

/// exp2 across its whole range through `online_softmax` (m_sub = 0, alpha = 1): within 3e-7 of
/// f64 `2^x`, exactly 0 below -126 and for -inf, exactly 1 at 0.
#[test]
fn online_softmax_exp2_is_accurate_over_its_range() {
    let n = 64;
    let mut xs: Vec<f32> = vec![
        0.0,
        -0.0,
        -1e-45,
        -1e-30,
        -1.0,
        -0.5,
        -125.99999,
        -126.0,
        -126.00001,
        -127.0,
        -149.5,
        -1e30,
        f32::NEG_INFINITY,
        -f32::MAX,
    ];
    let mut x = -130.0f32;
    while x <= 0.0 {
        xs.push(x);
        x += 0.000_731;
    }
    xs.resize(xs.len().next_multiple_of(n), -3.25);
    let cols = xs.len() / n;
    let m_sub = vec![0f32; n];
    let alpha = vec![1f32; n];
    for kern in simd_kernels().into_iter().chain([scalar()]) {
        let mut st = xs.clone();
        let mut row_sum = vec![0f32; n];
        kern.online_softmax(&mut st, cols, n, &m_sub, &mut row_sum, &alpha);
        for (&got, &x) in st.iter().zip(&xs) {
            check_exp2(got, x, &|| format!("{} exp2", kern.isa));
        }
        assert_eq!(st[0], 1.0);
        assert_eq!(st[1], 1.0);
        assert_eq!(st[12].to_bits(), 0);
    }
}

// ---------------------------------------------------------------------------------------------
// bf16 packing
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Bounds checks: a panic, never an out-of-bounds access
// ---------------------------------------------------------------------------------------------

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

impl Valid {
    fn new() -> Valid {
        Valid {
            a: vec![1.0; 3 * 8 + 8],
            b: vec![1.0; 7 * 32 + 32],
            c: vec![0.0; 3 * 32 + 32],
        }
    }
    fn gemm(&self) -> Gemm<'_, f32> {
        Gemm {
            m: 4,
            n: 32,
            k: 8,
            a: &self.a,
            a_rs: 8,
            a_cs: 1,
            b: &self.b,
            b_rs: 32,
            accumulate: true,
            kc: KC,
        }
    }
}

/// Each way a product's operands can be too short, on every table (f32 and, where present, bf16).
#[test]
fn gemm_bounds_are_checked_on_every_isa() {
    let tables: Vec<_> = simd::available()
        .into_iter()
        .map(|i| Kernels::for_isa(i).unwrap())
        .collect();
    for kern in tables {
        let v = Valid::new();
        let isa = kern.isa;
        let mut c = v.c.clone();
        kern.gemm(&v.gemm(), &mut c, 32); // the valid call passes
        let run = |what: &str, expected: &str, g: Gemm<'_, f32>, c_len: usize, c_rs: usize| {
            let mut c = vec![0.0; c_len];
            assert_panics(&format!("{isa} gemm: {what}"), expected, || {
                kern.gemm(&g, &mut c, c_rs)
            });
            if kern.has_bf16_dot() {
                let a = vec![0x3F80_3F80u32; g.a.len()];
                let b = vec![0x3F80_3F80u32; g.b.len()];
                let gb = Gemm {
                    a: &a,
                    b: &b,
                    m: g.m,
                    n: g.n,
                    k: g.k,
                    a_rs: g.a_rs,
                    a_cs: g.a_cs,
                    b_rs: g.b_rs,
                    accumulate: g.accumulate,
                    kc: g.kc,
                };
                let mut c = vec![0.0; c_len];
                assert_panics(&format!("{isa} gemm_bf16: {what}"), expected, || {
                    kern.gemm_bf16(&gb, &mut c, c_rs)
                });
            }
        };
        run("C one short", "C too short", v.gemm(), v.c.len() - 1, 32);
        run("c_rs < n", "C too short", v.gemm(), v.c.len(), 16);
        run(
            "A one short",
            "A too short",
            Gemm {
                a: &v.a[..v.a.len() - 1],
                ..v.gemm()
            },
            v.c.len(),
            32,
        );
        run(
            "A transposed, one short",
            "A too short",
            Gemm {
                a_rs: 1,
                a_cs: 4,
                a: &v.a[..7 * 4 + 3],
                ..v.gemm()
            },
            v.c.len(),
            32,
        );
        run(
            "B one short",
            "B too short",
            Gemm {
                b: &v.b[..v.b.len() - 1],
                ..v.gemm()
            },
            v.c.len(),
            32,
        );
        run(
            "b_rs < n",
            "B too short",
            Gemm {
                b_rs: 16,
                ..v.gemm()
            },
            v.c.len(),
            32,
        );
        run(
            "n not padded",
            "not padded",
            Gemm { n: 24, ..v.gemm() },
            v.c.len(),
            32,
        );
        run(
            "kc = 0",
            "kc = 0",
            Gemm { kc: 0, ..v.gemm() },
            v.c.len(),
            32,
        );
    }
}

#[test]
#[should_panic(expected = "C too short")]
fn gemm_panics_on_a_short_c() {
    let v = Valid::new();
    best().gemm(&v.gemm(), &mut v.c.clone()[..v.c.len() - 1], 32);
}

#[test]
#[should_panic(expected = "A too short")]
fn gemm_panics_on_a_short_a() {
    let v = Valid::new();
    best().gemm(
        &Gemm {
            a: &v.a[..v.a.len() - 1],
            ..v.gemm()
        },
        &mut v.c.clone(),
        32,
    );
}

#[test]
#[should_panic(expected = "B too short")]
fn gemm_panics_on_a_short_b() {
    let v = Valid::new();
    best().gemm(
        &Gemm {
            b: &v.b[..v.b.len() - 1],
            ..v.gemm()
        },
        &mut v.c.clone(),
        32,
    );
}

#[test]
#[should_panic(expected = "not padded")]
fn gemm_panics_on_unpadded_n() {
    let v = Valid::new();
    best().gemm(&Gemm { n: 17, ..v.gemm() }, &mut v.c.clone(), 32);
}

#[test]
#[should_panic(expected = "C too short")]
fn gemm_scores_panics_on_a_short_c() {
    let v = Valid::new();
    let mut tmp = v.c.clone();
    best().gemm_scores(&v.gemm(), &mut v.c.clone()[..v.c.len() - 1], 32, &mut tmp);
}

/// A row stride so large that `(m - 1) · c_rs + n` wraps around: the check must still reject it.
/// (In the dev profile overflow checks make the check itself panic; without them the wrapped sum
/// passes and row 1 is written 64 bytes *before* C.)
#[test]
#[should_panic]
fn gemm_check_does_not_wrap_around_on_huge_strides() {
    let b = vec![1.0f32; 16];
    let a = vec![1.0f32; 1];
    let mut buf = vec![SENTINEL; 64];
    let g = Gemm {
        m: 2,
        n: 16,
        k: 1,
        a: &a,
        a_rs: 0,
        a_cs: 1,
        b: &b,
        b_rs: 16,
        accumulate: false,
        kc: KC,
    };
    // Row 1 would land at C - 16 floats, inside `buf`, so no crash hides the outcome.
    best().gemm(&g, &mut buf[32..], usize::MAX - 15);
}

#[test]
fn softmax_bounds_are_checked_on_every_isa() {
    for kern in simd::available()
        .into_iter()
        .map(|i| Kernels::for_isa(i).unwrap())
    {
        let isa = kern.isa;
        let n = 32;
        let v = |len: usize| vec![0f32; len];
        let msg = "assertion failed";
        let (mut rm, mut al, mut ms) = (v(n), v(n), v(n));
        assert_panics(&format!("{isa} max_get_scale: st short"), msg, || {
            kern.max_get_scale(&mut v(2 * n - 1), 2, n, 1.0, &mut rm, &mut al, &mut ms)
        });
        assert_panics(&format!("{isa} max_get_scale: unpadded"), msg, || {
            kern.max_get_scale(
                &mut v(2 * 24),
                2,
                24,
                1.0,
                &mut v(24),
                &mut v(24),
                &mut v(24),
            )
        });
        for short in 0..3 {
            let mut bufs = [v(n), v(n), v(n)];
            bufs[short].pop();
            let [a, b, c] = &mut bufs;
            assert_panics(
                &format!("{isa} max_get_scale: state {short} short"),
                msg,
                || kern.max_get_scale(&mut v(2 * n), 2, n, 1.0, a, b, c),
            );
        }
        assert_panics(&format!("{isa} online_softmax: st short"), msg, || {
            kern.online_softmax(&mut v(3 * n - 1), 3, n, &v(n), &mut v(n), &v(n))
        });
        assert_panics(&format!("{isa} online_softmax: row_sum short"), msg, || {
            kern.online_softmax(&mut v(3 * n), 3, n, &v(n), &mut v(n - 1), &v(n))
        });
        assert_panics(&format!("{isa} online_softmax: alpha short"), msg, || {
            kern.online_softmax(&mut v(3 * n), 3, n, &v(n), &mut v(n), &v(n - 1))
        });
        assert_panics(&format!("{isa} online_softmax: unpadded"), msg, || {
            kern.online_softmax(&mut v(3 * 8), 3, 8, &v(8), &mut v(8), &v(8))
        });
        assert_panics(&format!("{isa} rescale_o: ot short"), msg, || {
            kern.rescale_o(&mut v(4 * n - 1), 4, n, &v(n))
        });
        assert_panics(&format!("{isa} rescale_o: alpha short"), msg, || {
            kern.rescale_o(&mut v(4 * n), 4, n, &v(n - 1))
        });
        assert_panics(&format!("{isa} pack_pairs_bf16: out short"), msg, || {
            kern.pack_pairs_bf16(&v(3 * n), 3, n, &mut vec![0u32; 2 * n - 1])
        });
        assert_panics(&format!("{isa} pack_pairs_bf16: st short"), msg, || {
            kern.pack_pairs_bf16(&v(3 * n - 1), 3, n, &mut vec![0u32; 2 * n])
        });
    }
}

#[test]
#[should_panic(expected = "assertion failed")]
fn online_softmax_panics_on_a_short_st() {
    let n = 16;
    best().online_softmax(
        &mut vec![0.0; 2 * n - 1],
        2,
        n,
        &[0.0; 16],
        &mut [0.0; 16],
        &[1.0; 16],
    );
}

#[test]
#[should_panic(expected = "assertion failed")]
fn rescale_o_panics_on_unpadded_n() {
    best().rescale_o(&mut [0.0; 40], 2, 20, &[1.0; 20]);
}
