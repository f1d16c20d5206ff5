//! Run-time selection of the CPU microkernels, and their contracts.
//!
//! The CPU path keeps query rows in SIMD lanes: q is held transposed (`qt[x][r]`), scores as
//! `st[c][r]` (key c, query row r), the output accumulator as `ot[x][r]`. Every block product of the
//! forward and backward passes is then one shape of matrix product, [`Kernels::gemm`]
//! (`C[i][j] (+)= Σ_k A[i, k] · B[k][j]` with A read by broadcasts at any strides and B, C read as
//! vectors along j), and the online softmax's per-row statistics are plain vertical vector
//! operations with no horizontal reductions. Lane counts are padded to [`LANES`].
//!
//! One table of function pointers per instruction set ([`Isa`]), chosen once: the best the CPU
//! has, or the one named by the `FLASHATTN_ISA` environment variable (`scalar`, `neon`,
//! `avx2`, `avx512`), or the one an [`crate::AttnOptions::isa`] call asks for. The scalar kernels are the
//! twins every SIMD kernel is tested against.

#[cfg(target_arch = "aarch64")]
pub(crate) mod aarch64_neon;
mod caches;
pub(crate) mod scalar;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_avx2;
#[cfg(target_arch = "x86_64")]
mod x86_avx2_bwd;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_avx512;
#[cfg(target_arch = "x86_64")]
mod x86_avx512_bwd;

use crate::error::{ErrorKind, Result};
use std::fmt;
use std::sync::OnceLock;

/// Lane padding of every lane-major buffer (query rows, padded head dims): one AVX-512 register of
/// f32. The narrower paths use multiples of it.
pub const LANES: usize = 16;

/// Products accumulate `kc` terms ([`Gemm::kc`]; f32 elements, or `kc / 2` bf16 pairs) in
/// registers, then add that partial sum to C: a dot product of length k then carries rounding
/// error growing like `kc + k / kc` rather than `k`, for one load-add-store of the tile per `kc`
/// steps. `KC` is the default: under 5% of a tile's instructions, on adder ports the FMAs do not
/// use. Without chunks, the f32 grid case d = 128, softcap 30, ALiBi exceeded 2× naive's error.
pub const KC: usize = 32;
/// The chunk of [`Kernels::gemm_scores`], whose rounding softcap can amplify.
pub const KC_SCORES: usize = 8;

/// Rounds `n` up to a multiple of [`LANES`].
#[inline]
pub const fn pad_lanes(n: usize) -> usize {
    n.div_ceil(LANES) * LANES
}

pub use crate::isa::Isa;
pub use caches::{cache_sizes, CacheSizes};

/// The best instruction set this CPU has (detected once).
pub fn detected() -> Isa {
    static BEST: OnceLock<Isa> = OnceLock::new();
    *BEST.get_or_init(|| {
        Isa::ALL
            .into_iter()
            .rev()
            .find(|i| i.is_available())
            .unwrap_or(Isa::Scalar)
    })
}

/// Every instruction set this CPU can run, slowest first.
pub fn available() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
}

/// The instruction set calls use when their options name none: `FLASHATTN_ISA` if set (read once),
/// else [`detected`]. An unknown or unavailable name in `FLASHATTN_ISA` is an error here and in
/// every attention call.
pub fn active() -> Result<Isa> {
    static FROM_ENV: OnceLock<Result<Isa>> = OnceLock::new();
    FROM_ENV
        .get_or_init(|| match std::env::var("FLASHATTN_ISA") {
            Err(_) => Ok(detected()),
            Ok(name) => match Isa::from_name(name.trim()) {
                Some(isa) => check_available(isa),
                None => Err(ErrorKind::IsaUnknown { name }.into()),
            },
        })
        .clone()
}

/// `isa` if this CPU runs it, else an error naming it and the best available one.
pub(crate) fn check_available(isa: Isa) -> Result<Isa> {
    if isa.is_available() {
        Ok(isa)
    } else {
        Err(ErrorKind::IsaUnavailable {
            requested: isa,
            best: detected(),
        }
        .into())
    }
}

/// Operands of one [`Kernels::gemm`] call: `C[i][j] (+)= Σ_{k < k} A[i·a_rs + k·a_cs] · B[k·b_rs + j]`
/// for `i < m`, `j < n`. `T` is f32, or u32 for bf16 pairs ([`Kernels::gemm_bf16`]).
#[derive(Clone, Copy, Debug)]
pub struct Gemm<'a, T> {
    pub m: usize,
    /// A multiple of [`LANES`].
    pub n: usize,
    pub k: usize,
    pub a: &'a [T],
    pub a_rs: usize,
    pub a_cs: usize,
    pub b: &'a [T],
    pub b_rs: usize,
    /// Add to C (true) or overwrite it (false).
    pub accumulate: bool,
    /// Terms summed in registers before they are added to C (see [`KC`]); at least 1.
    pub kc: usize,
}

impl<T> Gemm<'_, T> {
    /// Panics unless every element the product touches is inside its slice (checked once per call,
    /// so the kernels can index without checks).
    fn check(&self, c: &[f32], c_rs: usize) {
        assert!(
            self.n.is_multiple_of(LANES),
            "gemm: n = {} is not padded",
            self.n
        );
        assert!(self.kc >= 1, "gemm: kc = 0");
        if self.m == 0 || self.n == 0 {
            return;
        }
        // Checked arithmetic: a wrapped product would pass the comparison and let the kernels
        // run out of bounds.
        let c_end = span(self.m, c_rs, self.n);
        assert!(
            c_rs >= self.n && c_end.is_some_and(|e| e <= c.len()),
            "gemm: C too short"
        );
        if self.k == 0 {
            return;
        }
        let a_end = span(self.m, self.a_rs, 1)
            .and_then(|e| e.checked_add((self.k - 1).checked_mul(self.a_cs)?));
        assert!(
            a_end.is_some_and(|e| e <= self.a.len()),
            "gemm: A too short"
        );
        let b_end = span(self.k, self.b_rs, self.n);
        assert!(
            self.b_rs >= self.n && b_end.is_some_and(|e| e <= self.b.len()),
            "gemm: B too short"
        );
    }
}

/// `(rows - 1) · stride + extent` (rows >= 1), the length a strided operand spans; `None` on overflow.
fn span(rows: usize, stride: usize, extent: usize) -> Option<usize> {
    (rows - 1).checked_mul(stride)?.checked_add(extent)
}

/// `rows · n <= len` without overflow.
fn fits(rows: usize, n: usize, len: usize) -> bool {
    rows.checked_mul(n).is_some_and(|x| x <= len)
}

/// Raw kernel signatures. Safety contract of every `unsafe fn` here: the arguments passed the
/// checks of the matching safe method of [`Kernels`], and the CPU has the table's instruction set.
type GemmFn = unsafe fn(&Gemm<f32>, &mut [f32], usize);
type GemmBf16Fn = unsafe fn(&Gemm<u32>, &mut [f32], usize);
type MaxFn = unsafe fn(&mut [f32], usize, usize, f32, &mut [f32], &mut [f32], &mut [f32]);
type SoftmaxFn = unsafe fn(&mut [f32], usize, usize, &[f32], &mut [f32], &[f32]);
type StepFn =
    unsafe fn(&mut [f32], usize, usize, f32, &mut [f32], &mut [f32], &mut [f32], &mut [f32]);
type RescaleFn = unsafe fn(&mut [f32], usize, usize, &[f32]);
type GemmRescaledFn = unsafe fn(&Gemm<f32>, &mut [f32], usize, &[f32]);
type GemmBf16RescaledFn = unsafe fn(&Gemm<u32>, &mut [f32], usize, &[f32]);
type PairsFn = unsafe fn(&[f32], usize, usize, &mut [u32]);
type NarrowFn = unsafe fn(&[f32], &mut [u32]);
type ProbsDsFn = unsafe fn(&mut [f32], &mut [f32], usize, usize, f32, &[f32], &[f32], f32);

/// The microkernels of one instruction set.
pub struct Kernels {
    pub isa: Isa,
    gemm: GemmFn,
    /// A dedicated [`Kernels::gemm_scores`]; `None`: two chunked `gemm` calls and an add pass.
    gemm_scores: Option<GemmFn>,
    gemm_bf16: Option<GemmBf16Fn>,
    max_get_scale: MaxFn,
    online_softmax: SoftmaxFn,
    /// A dedicated [`Kernels::softmax_step`]; `None`: `max_get_scale`, then `online_softmax`
    /// (AVX2: fused, the pass that exponentiates also multiplies, and with its ports already
    /// busy it took 12.6-13.3% of the N = 1024 d = 64 forward's samples against 10.2% in two on
    /// an Intel core, and 1-2.5% more of the forward's CPU time than the two steps on a Zen 4).
    softmax_step: Option<StepFn>,
    rescale_o: RescaleFn,
    /// A dedicated [`Kernels::gemm_rescaled`]; `None`: `rescale_o`, then `gemm`.
    gemm_rescaled: Option<GemmRescaledFn>,
    /// A dedicated [`Kernels::gemm_bf16_rescaled`]; `None`: `rescale_o`, then `gemm_bf16`.
    gemm_bf16_rescaled: Option<GemmBf16RescaledFn>,
    pack_pairs_bf16: PairsFn,
    narrow_pairs_bf16: NarrowFn,
    /// Whether the backward takes bf16 inputs through [`Kernels::gemm_bf16`] (true) or widens
    /// them to f32 tiles for [`Kernels::gemm`]; see [`Kernels::backward_bf16_dot`].
    backward_bf16_dot: bool,
    /// A dedicated [`Kernels::probs_and_ds`] (the backward's P and dS in one pass); `None`: the
    /// backward takes its separate passes.
    probs_and_ds: Option<ProbsDsFn>,
    /// Decode's score and P·V kernels ([`DecodeKernels`]).
    pub(crate) decode: DecodeKernels,
}

/// Which kernels decode's two products run (cpu/decode: `scores` and `pv_acc` dispatch on this
/// and on the call's dtype and q form; the kernels stay in decode's files, one concern each).
/// Named here rather than as function pointers: the products' operand types are decode's, and
/// this table naming them would make `cpu::simd` and `cpu::decode` import each other.
/// Off x86 only `Portable` is made; the dispatch still names the others.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DecodeKernels {
    /// The portable loops (decode/scores.rs: `scores_portable`, decode/pv.rs: `pv_portable`).
    Portable,
    /// decode/avx2.rs (bf16 widened in even/odd pairs, f16 by F16C); the portable loops on a
    /// CPU without F16C.
    Avx2,
    /// decode/x86_scores.rs, x86_scores_qt.rs and x86_pv.rs, keys widened to f32 as loaded.
    Avx512,
    /// [`DecodeKernels::Avx512`], and for bf16 caches the `vdpbf16ps` kernels of those files.
    Avx512Bf16,
}

impl fmt::Debug for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Kernels({})", self.isa)
    }
}

static SCALAR: Kernels = Kernels {
    isa: Isa::Scalar,
    gemm: scalar::gemm,
    gemm_scores: None,
    gemm_bf16: None,
    max_get_scale: scalar::max_get_scale,
    online_softmax: scalar::online_softmax,
    softmax_step: None,
    rescale_o: scalar::rescale_o,
    gemm_rescaled: None,
    gemm_bf16_rescaled: None,
    pack_pairs_bf16: scalar::pack_pairs_bf16,
    narrow_pairs_bf16: scalar::narrow_pairs_bf16,
    backward_bf16_dot: false,
    probs_and_ds: None,
    decode: DecodeKernels::Portable,
};

#[cfg(target_arch = "aarch64")]
static NEON: Kernels = Kernels {
    isa: Isa::Neon,
    gemm: aarch64_neon::gemm,
    gemm_scores: None,
    gemm_bf16: None,
    max_get_scale: aarch64_neon::max_get_scale,
    online_softmax: aarch64_neon::online_softmax,
    softmax_step: None,
    rescale_o: aarch64_neon::rescale_o,
    gemm_rescaled: None,
    gemm_bf16_rescaled: None,
    pack_pairs_bf16: scalar::pack_pairs_bf16,
    narrow_pairs_bf16: scalar::narrow_pairs_bf16,
    backward_bf16_dot: false,
    probs_and_ds: None,
    decode: DecodeKernels::Portable,
};

#[cfg(target_arch = "x86_64")]
static AVX2: Kernels = Kernels {
    isa: Isa::Avx2,
    gemm: x86_avx2::gemm,
    gemm_scores: None,
    gemm_bf16: None,
    max_get_scale: x86_avx2::max_get_scale,
    online_softmax: x86_avx2::online_softmax,
    softmax_step: None,
    rescale_o: x86_avx2::rescale_o,
    gemm_rescaled: Some(x86_avx2::gemm_rescaled),
    gemm_bf16_rescaled: None,
    pack_pairs_bf16: scalar::pack_pairs_bf16,
    narrow_pairs_bf16: scalar::narrow_pairs_bf16,
    backward_bf16_dot: false,
    probs_and_ds: Some(x86_avx2_bwd::probs_and_ds),
    decode: DecodeKernels::Avx2,
};

#[cfg(target_arch = "x86_64")]
static AVX512: Kernels = Kernels {
    isa: Isa::Avx512,
    gemm: x86_avx512::gemm,
    gemm_scores: Some(x86_avx512::gemm_scores),
    gemm_bf16: None,
    max_get_scale: x86_avx512::max_get_scale,
    online_softmax: x86_avx512::online_softmax,
    softmax_step: Some(x86_avx512::softmax_step),
    rescale_o: x86_avx512::rescale_o,
    gemm_rescaled: Some(x86_avx512::gemm_rescaled),
    gemm_bf16_rescaled: None,
    pack_pairs_bf16: scalar::pack_pairs_bf16,
    narrow_pairs_bf16: scalar::narrow_pairs_bf16,
    backward_bf16_dot: false,
    probs_and_ds: Some(x86_avx512_bwd::probs_and_ds),
    decode: DecodeKernels::Avx512,
};

/// [`AVX512_BF16`] before the backward's bf16 choice ([`backward_bf16_dot_choice`]), made once.
#[cfg(target_arch = "x86_64")]
static AVX512_BF16_BASE: Kernels = Kernels {
    isa: Isa::Avx512,
    gemm: x86_avx512::gemm,
    gemm_scores: Some(x86_avx512::gemm_scores),
    gemm_bf16: Some(x86_avx512::gemm_bf16),
    max_get_scale: x86_avx512::max_get_scale,
    online_softmax: x86_avx512::online_softmax,
    softmax_step: Some(x86_avx512::softmax_step),
    rescale_o: x86_avx512::rescale_o,
    gemm_rescaled: Some(x86_avx512::gemm_rescaled),
    gemm_bf16_rescaled: Some(x86_avx512::gemm_bf16_rescaled),
    pack_pairs_bf16: x86_avx512::pack_pairs_bf16,
    narrow_pairs_bf16: x86_avx512::narrow_pairs_bf16,
    backward_bf16_dot: false,
    probs_and_ds: Some(x86_avx512_bwd::probs_and_ds),
    decode: DecodeKernels::Avx512Bf16,
};

/// The AVX-512 table with `vdpbf16ps` (built once, on first use).
#[cfg(target_arch = "x86_64")]
static AVX512_BF16: OnceLock<Kernels> = OnceLock::new();

/// Whether the backward takes bf16 inputs through the bf16 dot product on a table that has one:
/// [`backward_bf16_dot_rule`] with the `FLASHATTN_BWD_BF16` environment variable (read once, when
/// the table is made) and this CPU's vendor.
#[cfg(target_arch = "x86_64")]
fn backward_bf16_dot_choice() -> bool {
    let setting = std::env::var("FLASHATTN_BWD_BF16").ok();
    backward_bf16_dot_rule(setting.as_deref(), caches::cpu_is_intel())
}

/// The backward's bf16 path on a table with a bf16 dot product: `dot` or `f32` as `setting`
/// names it, else the dot product except on Intel CPUs.
///
/// On the Intel Xeon measured (AVX512_BF16) `vdpbf16ps` ran at half the f32 FMA's FLOP rate
/// (`flashattn peak`: 161 against 322 GFLOP/s on 2 cores), and the widened backward took
/// 0.70-0.78 of the dot-product backward's CPU time (bf16, N = 1024, 16 heads, d = 64 and 128).
/// On AMD Zen 4 the dot product runs at twice the FMA's rate (464 against 228) and the
/// dot-product backward took 0.55-0.57 of the widened one's CPU time at the same shapes.
/// The widened path rounds neither P̃ nor dS to bf16, so its gradients differ from the dot
/// path's in the last bits (both within the reference tolerances).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn backward_bf16_dot_rule(setting: Option<&str>, intel: bool) -> bool {
    match setting {
        Some("dot") => true,
        Some("f32") => false,
        _ => !intel,
    }
}

impl Kernels {
    /// The table of `isa`, or an error if this CPU cannot run it.
    pub fn for_isa(isa: Isa) -> Result<&'static Kernels> {
        let isa = check_available(isa)?;
        Ok(match isa {
            Isa::Scalar => &SCALAR,
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => &NEON,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => &AVX2,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if isa.has_bf16_dot() => AVX512_BF16.get_or_init(|| Kernels {
                backward_bf16_dot: backward_bf16_dot_choice(),
                ..AVX512_BF16_BASE
            }),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => &AVX512,
            #[allow(unreachable_patterns)]
            _ => unreachable!("check_available accepted an ISA this build has no kernels for"),
        })
    }

    /// `C[i][j] (+)= Σ_k A[i, k] · B[k][j]` in f32 (see [`Gemm`]); `c_rs` is C's row stride.
    pub fn gemm(&self, g: &Gemm<f32>, c: &mut [f32], c_rs: usize) {
        g.check(c, c_rs);
        // SAFETY: bounds checked above; the table exists only for an available ISA (for_isa).
        unsafe { (self.gemm)(g, c, c_rs) }
    }

    /// Scores `C = A·B` (overwritten) summed more accurately than [`Kernels::gemm`]: `k` is split in
    /// two halves, each summed in chunks of [`KC_SCORES`] into its own buffer (`tmp`, as long as
    /// C), then added: rounding grows like `8 + k/16 + 1` terms (17 at d = 128), below an 8-lane
    /// dot product's `k/8 + 3` (19). softcap turns the rounding of raw scores near tanh's zero
    /// crossing into output error, so with huge logits the chunk order decides the error; with
    /// `kc` 32 and no split the f32 grid's softcap cases measured up to 1.86× the naive error
    /// bound. Costs a few percent of the score product (more chunk flushes, one add pass).
    pub fn gemm_scores(&self, g: &Gemm<f32>, c: &mut [f32], c_rs: usize, tmp: &mut [f32]) {
        g.check(c, c_rs);
        if g.m == 0 || g.n == 0 {
            return;
        }
        if let Some(f) = self.gemm_scores {
            // SAFETY: bounds checked above; the table exists only for an available ISA.
            return unsafe { f(g, c, c_rs) };
        }
        let half = g.k / 2;
        if half < KC_SCORES {
            return self.gemm(
                &Gemm {
                    kc: KC_SCORES,
                    accumulate: false,
                    ..*g
                },
                c,
                c_rs,
            );
        }
        let lo = Gemm {
            k: half,
            kc: KC_SCORES,
            accumulate: false,
            ..*g
        };
        let hi = Gemm {
            k: g.k - half,
            a: &g.a[half * g.a_cs..],
            b: &g.b[half * g.b_rs..],
            ..lo
        };
        self.gemm(&lo, c, c_rs);
        self.gemm(&hi, tmp, c_rs);
        // Rows' first n columns only: C's padding columns are the caller's.
        for i in 0..g.m {
            let row = i * c_rs..i * c_rs + g.n;
            for (x, y) in c[row.clone()].iter_mut().zip(&tmp[row]) {
                *x += y;
            }
        }
    }

    /// The score product of an attention call: [`Kernels::gemm_scores`] where it costs nothing
    /// (a table with its own kernel, AVX-512) or where the call needs it (`softcap`); otherwise
    /// [`Kernels::gemm`] in chunks of [`KC`], which on AVX2 runs the product ~1.2x as fast as
    /// the portable `gemm_scores` (criterion `gemm/avx2/scores` against `scores_kc8`). Without
    /// softcap that is as accurate as the call needs: a score's rounding error then moves the
    /// output by about `eps_f32 · |s|` whichever order sums it, and `32 + k/32` terms (36 at d =
    /// 128) is still well below naive's sequential `k`; softcap maps raw scores of any size to
    /// `(-cap, cap)`, where the raw scores' error is no longer small against the output's
    /// rounding, so only there the finer chunks matter.
    pub fn scores(
        &self,
        g: &Gemm<f32>,
        c: &mut [f32],
        c_rs: usize,
        tmp: &mut [f32],
        softcap: bool,
    ) {
        if softcap || self.gemm_scores.is_some() {
            self.gemm_scores(g, c, c_rs, tmp)
        } else {
            self.gemm(
                &Gemm {
                    kc: KC,
                    accumulate: false,
                    ..*g
                },
                c,
                c_rs,
            )
        }
    }

    /// Whether [`Kernels::gemm_bf16`] is available.
    pub fn has_bf16_dot(&self) -> bool {
        self.gemm_bf16.is_some()
    }

    /// Whether the backward takes bf16 inputs through [`Kernels::gemm_bf16`] (P̃ and dS rounded
    /// to bf16 where they are operands); otherwise the inputs are widened to f32 tiles for
    /// [`Kernels::gemm`], as on CPUs without a bf16 dot product. Chosen once per table
    /// (`FLASHATTN_BWD_BF16=dot|f32`, else by CPU vendor).
    pub(crate) fn backward_bf16_dot(&self) -> bool {
        self.backward_bf16_dot
    }

    /// As [`Kernels::gemm`] over bf16 pairs: each u32 of A and B holds two bf16 (element 2k in the
    /// low half, 2k + 1 in the high half) and `k` counts pairs; products accumulate in f32.
    /// Panics if the table has no bf16 dot product.
    pub fn gemm_bf16(&self, g: &Gemm<u32>, c: &mut [f32], c_rs: usize) {
        let f = self.gemm_bf16.expect("gemm_bf16 on an ISA without it");
        g.check(c, c_rs);
        // SAFETY: as in `gemm`.
        unsafe { f(g, c, c_rs) }
    }

    /// The portable twin of [`Kernels::gemm_bf16`] (f64 sums), on every CPU: the oracle the
    /// `vdpbf16ps` kernel is tested against.
    pub fn gemm_bf16_twin(g: &Gemm<u32>, c: &mut [f32], c_rs: usize) {
        g.check(c, c_rs);
        // SAFETY: bounds checked above; the scalar kernel runs on any CPU.
        unsafe { scalar::gemm_bf16(g, c, c_rs) }
    }

    /// `dst[c · ds + r] = src[r · ss + c]` for `r < rows`, `c < cols` (the backward's query tiles
    /// and dQ rows): in 8×8 AVX blocks on the x86 tables, element by element elsewhere.
    pub(crate) fn transpose(
        &self,
        src: &[f32],
        ss: usize,
        (rows, cols): (usize, usize),
        dst: &mut [f32],
        ds: usize,
    ) {
        if rows == 0 || cols == 0 {
            return;
        }
        assert!(span(rows, ss, cols).is_some_and(|e| e <= src.len()) && ss >= cols);
        assert!(span(cols, ds, rows).is_some_and(|e| e <= dst.len()) && ds >= rows);
        #[cfg(target_arch = "x86_64")]
        if matches!(self.isa, Isa::Avx2 | Isa::Avx512) {
            // SAFETY: spans checked above; both tables' CPUs have AVX.
            unsafe { x86_avx2_bwd::transpose(src, ss, (rows, cols), dst, ds) };
            return;
        }
        for r in 0..rows {
            for c in 0..cols {
                dst[c * ds + r] = src[r * ss + c];
            }
        }
    }

    /// Whether the table has a dedicated [`Kernels::probs_and_ds`].
    pub(crate) fn has_probs_and_ds(&self) -> bool {
        self.probs_and_ds.is_some()
    }

    /// The backward's probabilities and dS of a tile (`cols` rows of `n` lanes) in one pass, where
    /// the table has a kernel for it (returns false and does nothing otherwise): per element
    /// `pt = exp2(pt · scale_log2 - lse_log2[r])` and `ds = pt · (ds - delta[r]) · scale`, with
    /// the same operations and roundings as the scale multiply, [`Kernels::online_softmax`] and
    /// the plain loop for dS one after the other (AVX2: those passes took ~3% of the f32
    /// backward's samples at d = 128, ~7% at d = 64).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn probs_and_ds(
        &self,
        pt: &mut [f32],
        ds: &mut [f32],
        (cols, n): (usize, usize),
        scale_log2: f32,
        lse_log2: &[f32],
        delta: &[f32],
        scale: f32,
    ) -> bool {
        let Some(f) = self.probs_and_ds else {
            return false;
        };
        assert!(n.is_multiple_of(LANES) && fits(cols, n, pt.len()) && fits(cols, n, ds.len()));
        assert!(lse_log2.len() >= n && delta.len() >= n);
        // SAFETY: lengths checked above; available ISA.
        unsafe { f(pt, ds, cols, n, scale_log2, lse_log2, delta, scale) };
        true
    }

    /// Online softmax, step 1, over `st` (`cols` rows of `n` lanes): scores are multiplied by
    /// `scale` in place (1 when the caller already scaled them); then per lane the new running
    /// maximum `row_max`, the factor `alpha = exp2(old - new)` that rescales what was accumulated
    /// (1 while the maximum is -inf) and the maximum to subtract, `m_sub` (0 while it is -inf, so
    /// that -inf - -inf never happens).
    #[allow(clippy::too_many_arguments)]
    pub fn max_get_scale(
        &self,
        st: &mut [f32],
        cols: usize,
        n: usize,
        scale: f32,
        row_max: &mut [f32],
        alpha: &mut [f32],
        m_sub: &mut [f32],
    ) {
        assert!(n.is_multiple_of(LANES) && fits(cols, n, st.len()));
        assert!(row_max.len() >= n && alpha.len() >= n && m_sub.len() >= n);
        // SAFETY: lengths checked above; available ISA.
        unsafe { (self.max_get_scale)(st, cols, n, scale, row_max, alpha, m_sub) }
    }

    /// Online softmax, step 2: `st = exp2(st - m_sub)` per lane, and
    /// `row_sum = row_sum · alpha + Σ_c st[c]`.
    pub fn online_softmax(
        &self,
        st: &mut [f32],
        cols: usize,
        n: usize,
        m_sub: &[f32],
        row_sum: &mut [f32],
        alpha: &[f32],
    ) {
        assert!(n.is_multiple_of(LANES) && fits(cols, n, st.len()));
        assert!(m_sub.len() >= n && row_sum.len() >= n && alpha.len() >= n);
        // SAFETY: lengths checked above; available ISA.
        unsafe { (self.online_softmax)(st, cols, n, m_sub, row_sum, alpha) }
    }

    /// Online softmax, steps 1 and 2 at once: as [`Kernels::max_get_scale`] then
    /// [`Kernels::online_softmax`] with that step's `m_sub` and `alpha`, with the same results bit
    /// for bit, but `st` is not stored scaled between them: each lane group's maximum is taken over
    /// the raw scores and scaled once (`max(s) · scale` = `max(s · scale)` for a finite `scale > 0`:
    /// rounding is monotone), and the exponent's argument is `s · scale - m_sub`, the same two
    /// roundings as before. Both passes run over a lane group's `cols` scores while they are in
    /// L1. Other scales (and tables without the kernel) take the two steps.
    #[allow(clippy::too_many_arguments)]
    pub fn softmax_step(
        &self,
        st: &mut [f32],
        cols: usize,
        n: usize,
        scale: f32,
        row_max: &mut [f32],
        alpha: &mut [f32],
        m_sub: &mut [f32],
        row_sum: &mut [f32],
    ) {
        match self.softmax_step {
            Some(f) if scale > 0.0 && scale.is_finite() => {
                assert!(n.is_multiple_of(LANES) && fits(cols, n, st.len()));
                assert!(
                    row_max.len() >= n
                        && alpha.len() >= n
                        && m_sub.len() >= n
                        && row_sum.len() >= n
                );
                // SAFETY: lengths checked above; available ISA.
                unsafe { f(st, cols, n, scale, row_max, alpha, m_sub, row_sum) }
            }
            _ => {
                self.max_get_scale(st, cols, n, scale, row_max, alpha, m_sub);
                self.online_softmax(st, cols, n, m_sub, row_sum, alpha);
            }
        }
    }

    /// Online softmax, step 3: `ot[x][r] *= alpha[r]` for `rows` rows of `n` lanes.
    pub fn rescale_o(&self, ot: &mut [f32], rows: usize, n: usize, alpha: &[f32]) {
        assert!(n.is_multiple_of(LANES) && fits(rows, n, ot.len()) && alpha.len() >= n);
        // SAFETY: lengths checked above; available ISA.
        unsafe { (self.rescale_o)(ot, rows, n, alpha) }
    }

    /// `C = C · col_scale + A·B` (per lane j of C, `g.n` lanes of rows `c_rs` apart;
    /// `g.accumulate`): the same bits as [`Kernels::rescale_o`] with `col_scale`, then
    /// [`Kernels::gemm`]. Where the table has a kernel for it, C is multiplied as the product's
    /// first chunk loads it, not in a pass of its own (the forward's `acc_o` rescale before its
    /// P·V product).
    pub fn gemm_rescaled(&self, g: &Gemm<f32>, c: &mut [f32], c_rs: usize, col_scale: &[f32]) {
        assert!(
            g.accumulate && col_scale.len() >= g.n,
            "gemm_rescaled: operands"
        );
        g.check(c, c_rs);
        match self.gemm_rescaled {
            // SAFETY: bounds checked above (C's rows, and col_scale's g.n lanes); available ISA.
            Some(f) if g.m > 0 && g.k > 0 => unsafe { f(g, c, c_rs, col_scale) },
            _ if c_rs == g.n => {
                self.rescale_o(c, g.m, c_rs, col_scale);
                self.gemm(g, c, c_rs);
            }
            _ => {
                for i in 0..g.m {
                    self.rescale_o(&mut c[i * c_rs..i * c_rs + g.n], 1, g.n, col_scale);
                }
                self.gemm(g, c, c_rs);
            }
        }
    }

    /// [`Kernels::gemm_rescaled`] over bf16 pairs: `C = C · col_scale + A·B` with the bits of
    /// [`Kernels::rescale_o`] then [`Kernels::gemm_bf16`] (the forward's bf16 P·V product).
    /// Panics if the table has no bf16 dot product.
    pub fn gemm_bf16_rescaled(&self, g: &Gemm<u32>, c: &mut [f32], c_rs: usize, col_scale: &[f32]) {
        assert!(
            g.accumulate && col_scale.len() >= g.n,
            "gemm_bf16_rescaled: operands"
        );
        g.check(c, c_rs);
        match self.gemm_bf16_rescaled {
            // SAFETY: bounds checked above (C's rows, and col_scale's g.n lanes); available ISA.
            Some(f) if g.m > 0 && g.k > 0 => unsafe { f(g, c, c_rs, col_scale) },
            _ => {
                for i in 0..g.m {
                    self.rescale_o(&mut c[i * c_rs..i * c_rs + g.n], 1, g.n, col_scale);
                }
                self.gemm_bf16(g, c, c_rs);
            }
        }
    }

    /// `src` rounded to bf16 in order, two to a u32: `out[i]` = `(src[2i], src[2i + 1])` (the
    /// pairs of adjacent lanes that [`Kernels::gemm_bf16`] takes along a row of A). Same
    /// rounding as [`Kernels::pack_pairs_bf16`]; `src` holds `2 · out.len()` values.
    pub fn narrow_pairs_bf16(&self, src: &[f32], out: &mut [u32]) {
        assert_eq!(src.len(), 2 * out.len(), "narrow_pairs_bf16: lengths");
        // SAFETY: lengths checked above; available ISA.
        unsafe { (self.narrow_pairs_bf16)(src, out) }
    }

    /// Rounds `cols` rows of `n` f32 lanes to bf16 pairs for [`Kernels::gemm_bf16`]'s B operand:
    /// `out[cp][r]` = (row 2cp, row 2cp + 1) of lane r; a missing odd row is 0.
    pub fn pack_pairs_bf16(&self, st: &[f32], cols: usize, n: usize, out: &mut [u32]) {
        assert!(
            n.is_multiple_of(LANES)
                && fits(cols, n, st.len())
                && fits(cols.div_ceil(2), n, out.len())
        );
        // SAFETY: lengths checked above; available ISA.
        unsafe { (self.pack_pairs_bf16)(st, cols, n, out) }
    }
}
