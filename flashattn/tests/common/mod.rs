//! Shared helpers of the integration tests: seeded inputs in every dtype and memory layout, and the
//! error-bound checker that compares flashattn with the naive yardstick and the f64 oracle.
//!
//! Not every test binary uses every helper.
#![allow(dead_code)]

use flashattn::reference::Reference;
use flashattn::tensor::contiguous_strides;
use flashattn::{AttnOptions, AttnOutput, Buffer, DType, Element, Slice, Tensor, TensorRef};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fmt;

pub mod backward;
#[cfg(feature = "cuda")]
pub mod emu;
pub mod grid;
pub mod props;

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

// ---------------------------------------------------------------------------------------------
// Layouts: where q, k and v live in memory
// ---------------------------------------------------------------------------------------------

/// Memory layout of q, k and v (batched `[batch, seqlen, heads, head_dim]` views).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Three contiguous buffers.
    Contiguous,
    /// One buffer `[batch, seqlen, heads + 2 * heads_kv, d]` holding q, k and v side by side (the
    /// `qkvpacked` layout); when seqlen_q != seqlen_k, q is contiguous and only k/v are packed.
    Packed,
    /// Each tensor in its own buffer, with gaps between heads, rows and batches, and a leading offset.
    /// Gaps are filled with NaN, so reading one shows up in the output.
    Padded,
    /// `[batch, heads, seqlen, d]` in memory (head stride larger than row stride).
    HeadMajor,
    /// k and v stored once and broadcast over the batch (batch stride 0).
    BroadcastKv,
}

pub const LAYOUTS: [Layout; 5] = [
    Layout::Contiguous,
    Layout::Packed,
    Layout::Padded,
    Layout::HeadMajor,
    Layout::BroadcastKv,
];

/// Where one tensor lives: buffer index, offset of element 0, shape, strides.
#[derive(Clone, Debug)]
pub struct Placement {
    pub buf: usize,
    pub offset: usize,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

impl Placement {
    /// Every element index (relative to the buffer start) in row-major logical order.
    fn indices(&self) -> Vec<usize> {
        let n: usize = self.shape.iter().product();
        let mut out = Vec::with_capacity(n);
        let mut idx = vec![0usize; self.shape.len()];
        for _ in 0..n {
            out.push(
                self.offset
                    + idx
                        .iter()
                        .zip(&self.strides)
                        .map(|(i, s)| i * s)
                        .sum::<usize>(),
            );
            for dim in (0..idx.len()).rev() {
                idx[dim] += 1;
                if idx[dim] < self.shape[dim] {
                    break;
                }
                idx[dim] = 0;
            }
        }
        out
    }

    /// One past the largest element index addressed (0 for an empty tensor).
    fn extent(&self) -> usize {
        if self.shape.contains(&0) {
            return self.offset;
        }
        self.offset
            + self
                .shape
                .iter()
                .zip(&self.strides)
                .map(|(n, s)| (n - 1) * s)
                .sum::<usize>()
            + 1
    }
}

/// Lays out logical values into physical buffers (gaps NaN) and rounds them to `dtype`.
/// `tensors[i]` = (placement, logical row-major values); returns the buffers.
pub fn materialize(tensors: &[(&Placement, &[f64])], dtype: DType, n_bufs: usize) -> Vec<Buffer> {
    let mut raw: Vec<Vec<f64>> = vec![Vec::new(); n_bufs];
    for (p, _) in tensors {
        let len = &mut raw[p.buf];
        if len.len() < p.extent() + 3 {
            len.resize(p.extent() + 3, f64::NAN); // a little slack past the end, NaN too
        }
    }
    for (p, vals) in tensors {
        for (idx, &x) in p.indices().into_iter().zip(vals.iter()) {
            raw[p.buf][idx] = x;
        }
    }
    raw.iter().map(|r| to_buffer(r, dtype)).collect()
}

/// Placements of q, k, v for a batched problem; returns (q, k, v, number of buffers).
#[allow(clippy::too_many_arguments)]
pub fn batched_placements(
    layout: Layout,
    rng: &mut ChaCha8Rng,
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hkv: usize,
    d: usize,
) -> (Placement, Placement, Placement, usize) {
    let contiguous = |buf: usize, shape: [usize; 4]| Placement {
        buf,
        offset: 0,
        shape: shape.to_vec(),
        strides: contiguous_strides(&shape),
    };
    let qs = [b, sq, h, d];
    let ks = [b, sk, hkv, d];
    match layout {
        Layout::Contiguous => (contiguous(0, qs), contiguous(1, ks), contiguous(2, ks), 3),
        Layout::Packed => {
            if sq == sk {
                let w = h + 2 * hkv;
                let strides = vec![sq * w * d, w * d, d, 1];
                let at = |offset: usize, shape: [usize; 4]| Placement {
                    buf: 0,
                    offset,
                    shape: shape.to_vec(),
                    strides: strides.clone(),
                };
                (at(0, qs), at(h * d, ks), at((h + hkv) * d, ks), 1)
            } else {
                // kv packed as [b, sk, 2, hkv, d].
                let strides = vec![sk * 2 * hkv * d, 2 * hkv * d, d, 1];
                let at = |offset: usize| Placement {
                    buf: 1,
                    offset,
                    shape: ks.to_vec(),
                    strides: strides.clone(),
                };
                (contiguous(0, qs), at(0), at(hkv * d), 2)
            }
        }
        Layout::Padded => {
            let mut padded = |buf: usize, shape: [usize; 4]| {
                let head = d + rng.gen_range(0..4);
                let row = shape[2] * head + rng.gen_range(0..5);
                let batch = shape[1] * row + rng.gen_range(1..7);
                Placement {
                    buf,
                    offset: rng.gen_range(0..9),
                    shape: shape.to_vec(),
                    strides: vec![batch, row, head, 1],
                }
            };
            let q = padded(0, qs);
            let k = padded(1, ks);
            let v = padded(2, ks);
            (q, k, v, 3)
        }
        Layout::HeadMajor => {
            let hm = |buf: usize, shape: [usize; 4]| {
                let (s, n) = (shape[1], shape[2]);
                Placement {
                    buf,
                    offset: 0,
                    shape: shape.to_vec(),
                    strides: vec![n * s * d, d, s * d, 1],
                }
            };
            (hm(0, qs), hm(1, ks), hm(2, ks), 3)
        }
        Layout::BroadcastKv => {
            let mut k = contiguous(1, ks);
            let mut v = contiguous(2, ks);
            k.strides[0] = 0;
            v.strides[0] = 0;
            (contiguous(0, qs), k, v, 3)
        }
    }
}

/// A view of `p` inside `bufs`.
pub fn view<'a>(bufs: &'a [Buffer], p: &Placement) -> TensorRef<'a> {
    TensorRef::from_slice(
        slice_from(bufs[p.buf].as_slice(), p.offset),
        &p.shape,
        &p.strides,
    )
}

// ---------------------------------------------------------------------------------------------
// A batched test case
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Alibi {
    None,
    /// `[heads]`.
    PerHead,
    /// `[batch, heads]`.
    PerBatchHead,
}

/// One batched attention problem.
#[derive(Clone, Debug)]
pub struct Case {
    pub dtype: DType,
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub heads: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub window: (i64, i64),
    pub softcap: Option<f32>,
    pub scale: Option<f32>,
    pub alibi: Alibi,
    pub layout: Layout,
    pub dist: Dist,
    pub seed: u64,
}

impl Default for Case {
    fn default() -> Self {
        Case {
            dtype: DType::F32,
            batch: 1,
            seqlen_q: 16,
            seqlen_k: 16,
            heads: 1,
            heads_kv: 1,
            head_dim: 8,
            causal: false,
            window: (-1, -1),
            softcap: None,
            scale: None,
            alibi: Alibi::None,
            layout: Layout::Contiguous,
            dist: Dist::Uniform,
            seed: 0,
        }
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} b={} sq={} sk={} h={}/{} d={} causal={} window={:?} softcap={:?} scale={:?} alibi={:?} \
             layout={:?} dist={:?} seed={}",
            self.dtype,
            self.batch,
            self.seqlen_q,
            self.seqlen_k,
            self.heads,
            self.heads_kv,
            self.head_dim,
            self.causal,
            self.window,
            self.softcap,
            self.scale,
            self.alibi,
            self.layout,
            self.dist,
            self.seed
        )
    }
}

impl Case {
    /// Work of the f64 reference: multiply-adds of Q·Kᵀ (P·V costs the same again).
    pub fn cost(&self) -> usize {
        self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.head_dim
    }

    pub fn effective_scale(&self) -> f64 {
        self.scale
            .map_or(1.0 / (self.head_dim as f64).sqrt(), |s| s as f64)
    }

    pub fn build(&self) -> Inputs {
        let mut rng = rng(self.seed);
        let (b, sq, sk, h, hkv, d) = (
            self.batch,
            self.seqlen_q,
            self.seqlen_k,
            self.heads,
            self.heads_kv,
            self.head_dim,
        );
        let (pq, pk, pv, n_bufs) = batched_placements(self.layout, &mut rng, b, sq, sk, h, hkv, d);
        let mut q = values(&mut rng, b * sq * h * d, self.dist);
        let mut k = values(&mut rng, b * sk * hkv * d, self.dist);
        let v = values(&mut rng, b * sk * hkv * d, Dist::Uniform);
        if let Dist::Huge(target) = self.dist {
            // Scaled score std = scale · c² · sqrt(d) / 3 for U(-1, 1) entries times c.
            let scale = self.effective_scale().abs().max(1e-3);
            let c = (3.0 * target / (scale * (d as f64).sqrt())).sqrt();
            q.iter_mut().chain(k.iter_mut()).for_each(|x| *x *= c);
        }
        let bufs = materialize(&[(&pq, &q), (&pk, &k), (&pv, &v)], self.dtype, n_bufs);
        let alibi = match self.alibi {
            Alibi::None => None,
            Alibi::PerHead => Some((
                vec![h],
                (0..h).map(|_| rng.gen_range(0.01f32..0.5)).collect(),
            )),
            Alibi::PerBatchHead => Some((
                vec![b, h],
                (0..b * h).map(|_| rng.gen_range(0.01f32..0.5)).collect(),
            )),
        };
        Inputs {
            bufs,
            q: pq,
            k: pk,
            v: pv,
            alibi,
            case: self.clone(),
        }
    }
}

/// The materialised inputs of a [`Case`].
pub struct Inputs {
    pub bufs: Vec<Buffer>,
    pub q: Placement,
    pub k: Placement,
    pub v: Placement,
    /// (shape, slopes) of the ALiBi slopes.
    pub alibi: Option<(Vec<usize>, Vec<f32>)>,
    pub case: Case,
}

impl Inputs {
    /// The values of v as stored (rounded to the dtype), in logical order.
    pub fn v_values(&self) -> Vec<f64> {
        let all = Tensor::from_buffer(
            self.bufs[self.v.buf].clone(),
            &[self.bufs[self.v.buf].as_slice().len()],
        )
        .expect("1-d")
        .to_f64_vec();
        self.v.indices().into_iter().map(|i| all[i]).collect()
    }

    pub fn views(&self) -> (TensorRef<'_>, TensorRef<'_>, TensorRef<'_>) {
        (
            view(&self.bufs, &self.q),
            view(&self.bufs, &self.k),
            view(&self.bufs, &self.v),
        )
    }

    pub fn opts(&self) -> AttnOptions<'_> {
        let c = &self.case;
        let mut o = AttnOptions::default()
            .causal(c.causal)
            .window(c.window.0, c.window.1);
        o.softcap = c.softcap;
        o.softmax_scale = c.scale;
        if let Some((shape, slopes)) = &self.alibi {
            o = o.alibi_slopes(TensorRef::contiguous(slopes, shape));
        }
        o
    }

    pub fn flash(&self) -> AttnOutput {
        let (q, k, v) = self.views();
        flashattn::flash_attn(&q, &k, &v, &self.opts())
            .unwrap_or_else(|e| panic!("{}: flash_attn: {e}", self.case))
    }

    pub fn naive(&self) -> AttnOutput {
        let (q, k, v) = self.views();
        flashattn::naive::attention(&q, &k, &v, &self.opts())
            .unwrap_or_else(|e| panic!("{}: naive: {e}", self.case))
    }

    pub fn reference(&self) -> Reference {
        let (q, k, v) = self.views();
        flashattn::reference::attention(&q, &k, &v, &self.opts())
            .unwrap_or_else(|e| panic!("{}: reference: {e}", self.case))
    }

    /// `flash`, a call on these inputs with `opts` (the case's plus, e.g., learnable sinks),
    /// against the f64 reference with [`check_bound`], naive in both dot-product orders as the
    /// yardstick.
    pub fn check_with(&self, flash: &AttnOutput, what: &str, opts: &AttnOptions) -> Errors {
        let (q, k, v) = self.views();
        let order = flashattn::naive::DotOrder::Sequential;
        let naives = [
            flashattn::naive::attention(&q, &k, &v, opts).unwrap(),
            flashattn::naive::attention_with_order(&q, &k, &v, opts, order).unwrap(),
        ];
        let r = flashattn::reference::attention(&q, &k, &v, opts).unwrap();
        let v_max = self.v_values().iter().fold(0f64, |m, x| m.max(x.abs()));
        let what = format!("{} {what}", self.case);
        check_bound(
            &what,
            self.case.dtype,
            flash,
            &naives,
            &r,
            v_max,
            self.case.seqlen_k,
        )
    }

    /// Naive attention with the scores' dot products summed sequentially (as BLAS does).
    pub fn naive_sequential(&self) -> AttnOutput {
        let (q, k, v) = self.views();
        let order = flashattn::naive::DotOrder::Sequential;
        flashattn::naive::attention_with_order(&q, &k, &v, &self.opts(), order)
            .unwrap_or_else(|e| panic!("{}: naive: {e}", self.case))
    }

    /// Runs naive (both dot-product orders) and the reference once, and flash on every instruction
    /// set this CPU runs (the scalar twin included), and checks the error bound for each; returns
    /// the errors of the default instruction set.
    pub fn check(&self) -> Errors {
        let naive = [self.naive(), self.naive_sequential()];
        let reference = self.reference();
        let v_max = self.v_values().iter().fold(0f64, |m, x| m.max(x.abs()));
        let mut default = None;
        for isa in flashattn::simd::available() {
            let (q, k, v) = self.views();
            let flash = flashattn::flash_attn(&q, &k, &v, &self.opts().isa(isa))
                .unwrap_or_else(|e| panic!("{}: flash_attn ({isa}): {e}", self.case));
            let e = check_bound(
                &format!("{} isa={isa}", self.case),
                self.case.dtype,
                &flash,
                &naive,
                &reference,
                v_max,
                self.case.seqlen_k,
            );
            if isa == flashattn::simd::detected() {
                default = Some(e);
            }
        }
        default.expect("the detected ISA is available")
    }
}

// ---------------------------------------------------------------------------------------------
// The error bound
// ---------------------------------------------------------------------------------------------

/// Multiple of the naive algorithm's error that flashattn may reach.
pub const NAIVE_FACTOR: f64 = 2.0;
/// Rounding floor, in units of `dtype.epsilon()` (unit roundoff) times the largest reference
/// magnitude: absorbs the final rounding of the output to its dtype (at most 1 unit relative to the
/// element) when naive happens to be nearly exact (e.g. seqlen_k = 1, where both just copy v).
pub const FLOOR_UNITS: f64 = 4.0;
/// Score-rounding floor of out, in units of `eps_f32 · |s| · max|v|`, with `|s|` the magnitude of
/// the largest scores (estimated from the reference lse, see [`check_bound`]).
///
/// Why: flashattn works in the log2 domain and rounds `s · log2(e)` to f32 *before* subtracting the
/// row maximum, so each score carries an absolute error up to `eps_f32 · |s|` (plus a systematic
/// relative `eps_f32` from rounding `scale · log2(e)`), which moves out by up to
/// `2 · eps_f32 · |s| · max|v|`. Naive has the same error in general (it rounds `dot · scale`), but
/// not when the scale is a power of two (`d` = 1, 64, 256 with the default scale, or scale 0.5 / 2):
/// then its scores are exact products and, with scores of ~1e3 (`Dist::Huge`), it can beat flashattn
/// by more than 2x although flashattn is as accurate as any f32 score allows. Negligible for
/// ordinary scores (|s| of a few units) and for f16/bf16 (whose eps dominates).
pub const SCORE_UNITS: f64 = 2.0;

/// Measured errors of one comparison (max-abs against the f64 reference).
#[derive(Clone, Copy, Debug, Default)]
pub struct Errors {
    pub out_flash: f64,
    pub out_naive: f64,
    pub out_floor: f64,
    pub lse_flash: f64,
    pub lse_naive: f64,
    pub lse_floor: f64,
}

impl Errors {
    /// `err_flash / (2 · err_naive + floor)`: the check passes iff both are <= 1.
    /// An exact result (error 0) is 0 even when the bound is 0 (e.g. an all-zero output).
    pub fn normalised(&self) -> (f64, f64) {
        let ratio = |err: f64, naive: f64, floor: f64| {
            if err == 0.0 {
                0.0
            } else {
                err / (NAIVE_FACTOR * naive + floor)
            }
        };
        (
            ratio(self.out_flash, self.out_naive, self.out_floor),
            ratio(self.lse_flash, self.lse_naive, self.lse_floor),
        )
    }
}

impl fmt::Display for Errors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (no, nl) = self.normalised();
        write!(
            f,
            "out: flash {:.3e}, naive {:.3e}, floor {:.3e}, normalised {:.3}; \
             lse: flash {:.3e}, naive {:.3e}, floor {:.3e}, normalised {:.3}",
            self.out_flash,
            self.out_naive,
            self.out_floor,
            no,
            self.lse_flash,
            self.lse_naive,
            self.lse_floor,
            nl
        )
    }
}

/// Checks `flash` against the f64 `reference`, with `naive` as the yardstick:
///
/// - shapes and dtypes as documented (out in the input dtype, lse f32);
/// - no NaN in flash's out or lse (the library poisons out/lse with NaN before the kernels run, so
///   this also checks that every element was written);
/// - the -inf pattern of lse equals the reference's exactly, and those rows of out are exactly 0;
/// - `max|out_flash - ref| <= 2 · max|out_naive - ref| + floor` with
///   `floor = 4 · eps(dtype) · max|ref out| + 2 · eps_f32 · S · v_max`, and for lse over its finite
///   entries `max|lse_flash - ref| <= 2 · max|lse_naive - ref| + 4 · eps(dtype) · max(1, max|ref lse|)`;
///   `eps` is the unit roundoff [`DType::epsilon`], `v_max = max|v|`, and `S` bounds the largest
///   score of a row: `max(|lse|, |lse - ln(max_keys)|)` over rows (a row's max score lies in
///   `[lse - ln(keys), lse]`). See [`FLOOR_UNITS`] and [`SCORE_UNITS`].
///
/// `naive` holds one or more naive results (e.g. both [`flashattn::naive::DotOrder`]s); the
/// naive error is the largest of theirs.
///
/// Panics with the problem, both errors and the normalised error on failure.
pub fn check_bound(
    what: &str,
    dtype: DType,
    flash: &AttnOutput,
    naives: &[AttnOutput],
    r: &Reference,
    v_max: f64,
    max_keys: usize,
) -> Errors {
    assert_eq!(flash.out.dtype(), dtype, "{what}: out dtype");
    assert_eq!(flash.lse.dtype(), DType::F32, "{what}: lse dtype");
    assert_eq!(
        flash.out.shape(),
        r.out_shape.as_slice(),
        "{what}: out shape"
    );
    assert_eq!(
        flash.lse.shape(),
        r.lse_shape.as_slice(),
        "{what}: lse shape"
    );
    assert!(!naives.is_empty(), "{what}: no naive result");
    for naive in naives {
        assert_eq!(
            naive.out.shape(),
            r.out_shape.as_slice(),
            "{what}: naive out shape"
        );
        assert_eq!(
            naive.lse.shape(),
            r.lse_shape.as_slice(),
            "{what}: naive lse shape"
        );
    }
    let (fo, no) = (flash.out.to_f64_vec(), naives[0].out.to_f64_vec());
    let (fl, nl) = (flash.lse.to_f64_vec(), naives[0].lse.to_f64_vec());
    let eps = dtype.epsilon();

    // lse: NaN, the -inf pattern.
    let lse_shape = &r.lse_shape;
    let (heads, rows) = (
        lse_shape[lse_shape.len() - 2],
        lse_shape[lse_shape.len() - 1],
    );
    let d = r.out_shape[r.out_shape.len() - 1];
    let mut masked_rows = vec![false; fl.len()];
    for (i, (&f, &x)) in fl.iter().zip(&r.lse).enumerate() {
        assert!(!f.is_nan(), "{what}: lse[{i}] is NaN (reference {x})");
        assert!(
            x != f64::INFINITY && !x.is_nan(),
            "{what}: reference lse[{i}] = {x}"
        );
        assert_eq!(
            f == f64::NEG_INFINITY,
            x == f64::NEG_INFINITY,
            "{what}: lse[{i}] = {f} but reference {x}: the -inf (fully masked) pattern differs"
        );
        assert!(
            f != f64::INFINITY,
            "{what}: lse[{i}] = +inf (reference {x})"
        );
        masked_rows[i] = x == f64::NEG_INFINITY;
    }
    // Fully masked rows of out are exactly 0. lse index (.., h, row) <-> out row (.., row, h, ..).
    let batch = fl.len() / (heads * rows).max(1);
    for bi in 0..batch {
        for h in 0..heads {
            for row in 0..rows {
                if masked_rows[(bi * heads + h) * rows + row] {
                    let o = ((bi * rows + row) * heads + h) * d;
                    assert!(
                        fo[o..o + d].iter().all(|&x| x == 0.0),
                        "{what}: (b {bi}, row {row}, head {h}) sees no key but out is {:?}",
                        &fo[o..o + d.min(8)]
                    );
                }
            }
        }
    }

    // out: NaN, errors.
    let ref_out_max = r.out.iter().fold(0f64, |m, x| m.max(x.abs()));
    let ln_keys = (max_keys.max(1) as f64).ln();
    let score_max = r
        .lse
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f64, |m, x| m.max(x.abs()).max((x - ln_keys).abs()));
    let out_floor =
        FLOOR_UNITS * eps * ref_out_max + SCORE_UNITS * DType::F32.epsilon() * score_max * v_max;
    let mut e = Errors {
        out_floor,
        ..Errors::default()
    };
    let mut worst = 0;
    for (i, (&f, &x)) in fo.iter().zip(&r.out).enumerate() {
        assert!(x.is_finite(), "{what}: reference out[{i}] = {x}");
        assert!(
            !f.is_nan(),
            "{what}: out[{i}] is NaN (reference {x}): not written, or a NaN leaked in"
        );
        if (f - x).abs() > e.out_flash {
            e.out_flash = (f - x).abs();
            worst = i;
        }
    }
    for naive in naives {
        let no = naive.out.to_f64_vec();
        e.out_naive = no
            .iter()
            .zip(&r.out)
            .fold(e.out_naive, |m, (n, x)| m.max((n - x).abs()));
    }
    let ref_lse_max = r
        .lse
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f64, |m, x| m.max(x.abs()));
    e.lse_floor = FLOOR_UNITS * eps * ref_lse_max.max(1.0);
    let mut worst_lse = 0;
    for (i, (&f, &x)) in fl.iter().zip(&r.lse).enumerate() {
        if x.is_finite() && (f - x).abs() > e.lse_flash {
            e.lse_flash = (f - x).abs();
            worst_lse = i;
        }
    }
    for naive in naives {
        let nl = naive.lse.to_f64_vec();
        e.lse_naive = nl
            .iter()
            .zip(&r.lse)
            .filter(|(_, x)| x.is_finite())
            .fold(e.lse_naive, |m, (n, x)| m.max((n - x).abs()));
    }
    assert!(
        e.out_naive.is_finite() && e.lse_naive.is_finite(),
        "{what}: the naive yardstick itself broke (non-finite error): {e}"
    );
    let (n_out, n_lse) = e.normalised();
    assert!(
        n_out <= 1.0 && e.out_flash.is_finite(),
        "{what}: out error too large: {e}; worst at out[{worst}]: flash {} vs reference {} (naive {}); max|ref| {ref_out_max:.3e}",
        fo[worst],
        r.out[worst],
        no[worst]
    );
    assert!(
        n_lse <= 1.0 && e.lse_flash.is_finite(),
        "{what}: lse error too large: {e}; worst at lse[{worst_lse}]: flash {} vs reference {} (naive {})",
        fl[worst_lse],
        r.lse[worst_lse],
        nl[worst_lse]
    );
    e
}

/// Widens any element type's value to f64 (for hand-written expectations).
pub fn f64_of<T: Element>(x: T) -> f64 {
    x.to_f64()
}

// ---------------------------------------------------------------------------------------------
// A packed (varlen) case, for the backends that take `cu_seqlens` (GPU, emulated GPU kernels)
// ---------------------------------------------------------------------------------------------

/// Packed sequences of lengths `lens_q` / `lens_k`, with `extra_q` query rows after the last one.
#[derive(Clone, Debug)]
pub struct VarlenCase {
    pub dtype: DType,
    pub lens_q: Vec<usize>,
    pub lens_k: Vec<usize>,
    pub extra_q: usize,
    pub causal: bool,
    pub window: (i64, i64),
    pub heads: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub seed: u64,
}

/// The materialised inputs of a [`VarlenCase`].
pub struct VarlenInputs {
    pub case: VarlenCase,
    pub q: Buffer,
    pub k: Buffer,
    pub v: Buffer,
    pub v_max: f64,
    pub cu_q: Vec<i32>,
    pub cu_k: Vec<i32>,
    pub total_q: usize,
    pub total_k: usize,
}

impl VarlenCase {
    pub fn build(&self) -> VarlenInputs {
        let mut g = rng(self.seed);
        let (h, hkv, d) = (self.heads, self.heads_kv, self.head_dim);
        let total_q = self.lens_q.iter().sum::<usize>() + self.extra_q;
        let total_k = self.lens_k.iter().sum::<usize>();
        let cu = |l: &[usize]| {
            std::iter::once(0)
                .chain(l.iter().scan(0, |acc, &x| {
                    *acc += x as i32;
                    Some(*acc)
                }))
                .collect::<Vec<i32>>()
        };
        let qv = values(&mut g, total_q * h * d, Dist::Normal);
        let kv = values(&mut g, total_k * hkv * d, Dist::Normal);
        let vv = values(&mut g, total_k * hkv * d, Dist::Uniform);
        VarlenInputs {
            q: to_buffer(&qv, self.dtype),
            k: to_buffer(&kv, self.dtype),
            v: to_buffer(&vv, self.dtype),
            v_max: vv.iter().fold(0f64, |m, x| m.max(x.abs())),
            cu_q: cu(&self.lens_q),
            cu_k: cu(&self.lens_k),
            total_q,
            total_k,
            case: self.clone(),
        }
    }
}

impl VarlenInputs {
    pub fn views(&self) -> (TensorRef<'_>, TensorRef<'_>, TensorRef<'_>) {
        let (h, hkv, d) = (self.case.heads, self.case.heads_kv, self.case.head_dim);
        (
            TensorRef::from_slice(self.q.as_slice(), &[self.total_q, h, d], &[h * d, d, 1]),
            TensorRef::from_slice(self.k.as_slice(), &[self.total_k, hkv, d], &[hkv * d, d, 1]),
            TensorRef::from_slice(self.v.as_slice(), &[self.total_k, hkv, d], &[hkv * d, d, 1]),
        )
    }

    pub fn opts(&self) -> AttnOptions<'static> {
        AttnOptions::default()
            .causal(self.case.causal)
            .window(self.case.window.0, self.case.window.1)
    }

    /// Checks `flash` against the f64 reference with the naive yardstick, and the rows after the
    /// last sequence: out exactly 0, lse exactly -inf.
    pub fn check(&self, flash: &AttnOutput, backend: &str) {
        self.check_with(flash, backend, &self.opts())
    }

    /// [`Self::check`] of a call made with `opts` (the case's, plus e.g. learnable sinks, which
    /// rows after the last sequence do not get).
    pub fn check_with(&self, flash: &AttnOutput, backend: &str, opts: &AttnOptions) {
        let c = &self.case;
        let what = format!(
            "{} {backend} varlen q {:?}+{} k {:?} causal={} window={:?}",
            c.dtype, c.lens_q, c.extra_q, c.lens_k, c.causal, c.window
        );
        let (q, k, v) = self.views();
        let (cq, ck) = (&self.cu_q, &self.cu_k);
        let nv = flashattn::naive::attention_varlen(&q, &k, &v, cq, ck, opts).unwrap();
        let mut r = flashattn::reference::attention_varlen(&q, &k, &v, cq, ck, opts).unwrap();
        let (h, d, tq) = (c.heads, c.head_dim, self.total_q);
        let used = cq[c.lens_q.len()] as usize;
        // The oracle leaves lse 0.0 on rows after the last sequence (see tests/forward.rs).
        for hh in 0..h {
            r.lse[hh * tq + used..(hh + 1) * tq].fill(f64::NEG_INFINITY);
        }
        let max_keys = c.lens_k.iter().copied().max().unwrap_or(0);
        check_bound(
            &what,
            c.dtype,
            flash,
            std::slice::from_ref(&nv),
            &r,
            self.v_max,
            max_keys,
        );
        let out = flash.out.to_f64_vec();
        assert!(
            out[used * h * d..].iter().all(|&x| x == 0.0),
            "{what}: tail out"
        );
        let lse = flash.lse.to_f64_vec();
        for hh in 0..h {
            assert!(
                lse[hh * tq + used..(hh + 1) * tq]
                    .iter()
                    .all(|&x| x == f64::NEG_INFINITY),
                "{what}: tail lse"
            );
        }
    }
}

/// The learnable sink logits the CUDA sink tests use for `heads` heads: -1.25, 0.25, 1.75, ..
/// (below, near and above a row's typical LSE).
pub fn test_sinks(heads: usize) -> Vec<f32> {
    (0..heads).map(|h| 1.5 * h as f32 - 1.25).collect()
}

/// Packed batches with empty sequences, keys without queries and the reverse, rows after the last
/// sequence, causal and windowed.
#[allow(clippy::type_complexity)]
pub fn varlen_cases(
    dtype: DType,
    heads: usize,
    heads_kv: usize,
    head_dim: usize,
) -> Vec<VarlenCase> {
    let configs: [(&[usize], &[usize], usize, bool, (i64, i64)); 4] = [
        (&[5, 0, 70, 1], &[7, 9, 0, 65], 3, false, (-1, -1)),
        (&[33, 20, 0], &[20, 33, 0], 2, true, (-1, -1)),
        (&[1, 17, 64, 65], &[1, 17, 64, 65], 0, false, (9, 4)),
        (&[0, 0], &[0, 4], 4, false, (-1, -1)),
    ];
    configs
        .iter()
        .enumerate()
        .map(|(i, &(lq, lk, extra_q, causal, window))| VarlenCase {
            dtype,
            lens_q: lq.to_vec(),
            lens_k: lk.to_vec(),
            extra_q,
            causal,
            window,
            heads,
            heads_kv,
            head_dim,
            seed: 7000 + 10 * dtype as u64 + i as u64,
        })
        .collect()
}
