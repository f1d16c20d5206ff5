//! User options -> validated parameters. This is the only place that checks input: every shape,
//! stride, dtype, option and `cu_seqlens` entry is checked here once, and the kernels trust [`Params`].
//!
//! Batched and packed (varlen) layouts are reduced to one description: per sequence, the element
//! offset of its first row in q, k and v, its lengths, and where its rows go in `out` and `lse`.
//! Row `i`, head `h` of sequence `b` of q starts at `seqs[b].q_base + i * q.row_stride + h * q.head_stride`.

use crate::cpu::simd::{self, Isa, Kernels};
use crate::dropout::Dropout;
use crate::error::{CuSeqlensProblem, ErrorKind, Result, TensorName};
use crate::tensor::{DType, TensorRef, ViewDesc};

/// log2(e), folded into the softmax scale so the kernels can use exp2.
pub const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// Largest supported head dimension.
pub const MAX_HEAD_DIM: usize = 256;

/// The options of an attention call, as in flash-attn 2.x's `flash_attn_func`.
#[derive(Clone, Debug)]
pub struct AttnOptions<'a> {
    /// Multiplies Q·Kᵀ. `None`: 1/sqrt(head_dim). Scores are f32: a scale that takes the
    /// data's scores past the f32 range gives non-finite results (not refused, as that depends
    /// on the data).
    pub softmax_scale: Option<f32>,
    /// Causal mask aligned to the bottom-right corner: query i sees key j iff j <= i + seqlen_k - seqlen_q.
    /// Same as `window = (left, 0)`.
    pub causal: bool,
    /// Sliding window `(left, right)`, -1 meaning unbounded: query i sees key j iff
    /// `i + sk - sq - left <= j <= i + sk - sq + right`.
    pub window: (i64, i64),
    /// Scores become `softcap * tanh(scores / softcap)` (after scaling, before masks and bias).
    pub softcap: Option<f32>,
    /// ALiBi slopes, f32, shape `[heads]` or `[batch, heads]`: bias `-slope * |i + sk - sq - j|`.
    /// Each slope must be finite, with `slope · log2(e) · (max(sq, sk) - 1)` (its bias at the
    /// farthest key) finite in f32; otherwise [`crate::ErrorKind::AlibiSlope`].
    pub alibi_slopes: Option<TensorRef<'a>>,
    /// Learnable attention sinks (gpt-oss): f32 `[heads]`, one logit per head that joins every
    /// row's softmax normaliser without a value: `P_ij = exp(s_ij) / (Σ_j exp(s_ij) + exp(sink_h))`.
    /// The LSE includes it (a row that sees no key: out 0, lse = sink); the backward also returns
    /// its gradient ([`crate::AttnGrads::dsink`]). CPU only.
    pub learnable_sink: Option<TensorRef<'a>>,
    /// Probability of dropping an attention probability, in `[0, 1)`; kept ones are scaled by
    /// `1 / (1 - p)`. The mask comes from Philox keyed by `seed` (see [`crate::dropout`]).
    pub dropout_p: f32,
    /// Seed of the dropout mask; the same seed gives the same mask forward and backward.
    pub seed: u64,
    /// CPU instruction set of the kernels. `None`: [`crate::simd::active`] (the best this CPU has,
    /// or `FLASHATTN_ISA`). Naming one the CPU lacks is an error.
    pub isa: Option<Isa>,
}

impl Default for AttnOptions<'_> {
    fn default() -> Self {
        AttnOptions {
            softmax_scale: None,
            causal: false,
            window: (-1, -1),
            softcap: None,
            alibi_slopes: None,
            learnable_sink: None,
            dropout_p: 0.0,
            seed: 0,
            isa: None,
        }
    }
}

impl<'a> AttnOptions<'a> {
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }
    pub fn window(mut self, left: i64, right: i64) -> Self {
        self.window = (left, right);
        self
    }
    pub fn softmax_scale(mut self, scale: f32) -> Self {
        self.softmax_scale = Some(scale);
        self
    }
    pub fn softcap(mut self, softcap: f32) -> Self {
        self.softcap = Some(softcap);
        self
    }
    pub fn learnable_sink(mut self, sink: TensorRef<'a>) -> Self {
        self.learnable_sink = Some(sink);
        self
    }
    pub fn alibi_slopes(mut self, slopes: TensorRef<'a>) -> Self {
        self.alibi_slopes = Some(slopes);
        self
    }
    pub fn dropout(mut self, p: f32, seed: u64) -> Self {
        self.dropout_p = p;
        self.seed = seed;
        self
    }
    /// Forces the CPU kernels of one instruction set (tests, benchmarks).
    pub fn isa(mut self, isa: Isa) -> Self {
        self.isa = Some(isa);
        self
    }
}

/// Element strides of a q/k/v-like tensor's token and head dimensions (the last one is 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowLayout {
    pub row_stride: usize,
    pub head_stride: usize,
}

/// One sequence of the batch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Seq {
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    /// Element offsets of row 0, head 0 in q, k and v.
    pub q_base: usize,
    pub k_base: usize,
    pub v_base: usize,
    /// Token index of row 0 in the contiguous outputs (`b * seqlen_q` batched, `cu_seqlens_q[b]` packed).
    pub out_row0: usize,
    /// Index of (head 0, row 0) in `lse`.
    pub lse_base: usize,
    /// Token index of key 0 in the contiguous `dk`/`dv` (`b * seqlen_k` batched, `cu_seqlens_k[b]` packed).
    pub k_row0: usize,
}

/// Validated parameters: the whole contract between the API and the kernels.
#[derive(Clone, Debug)]
pub(crate) struct Params {
    pub dtype: DType,
    pub heads: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub seqs: Vec<Seq>,
    pub q: RowLayout,
    pub k: RowLayout,
    pub v: RowLayout,
    /// Total rows of `out` (batch * seqlen_q, or total_q when packed).
    pub total_q: usize,
    /// Distance between heads in `lse`.
    pub lse_head_stride: usize,
    pub out_shape: Vec<usize>,
    pub lse_shape: Vec<usize>,
    /// Shape of k and v (and so of `dk`, `dv`).
    pub k_shape: Vec<usize>,
    /// Total key rows (batch * seqlen_k, or total_k when packed).
    pub total_k: usize,
    pub softmax_scale: f32,
    pub softcap: Option<f32>,
    /// `None`: unbounded.
    pub window_left: Option<usize>,
    pub window_right: Option<usize>,
    /// Slopes per (batch, head), `batch * heads` entries.
    pub alibi: Option<Vec<f32>>,
    /// Learnable sink logits per head (natural log, like the scaled scores).
    pub sink: Option<Vec<f32>>,
    pub dropout: Option<Dropout>,
    /// Whether q is packed (`[total_q, heads, d]`) rather than batched.
    pub packed: bool,
    /// The CPU microkernels to run.
    pub kernels: &'static Kernels,
    /// FP8 dequantisation factors (forward only; see [`crate::fp8`]).
    pub descale: Option<Descales>,
}

/// The FP8 descale factors, folded: per (sequence b, kv head hk), at `b * heads_kv + hk`.
#[derive(Clone, Debug)]
pub(crate) struct Descales {
    /// `softmax_scale · q_descale · k_descale` (the product taken in f64, rounded once).
    pub score_scale: Vec<f32>,
    /// `v_descale`: multiplies the output rows.
    pub out_scale: Vec<f32>,
}

impl Params {
    /// Index into `out` of (sequence `b`, row `i`, head `h`, 0).
    #[inline]
    pub fn out_offset(&self, b: usize, i: usize, h: usize) -> usize {
        ((self.seqs[b].out_row0 + i) * self.heads + h) * self.head_dim
    }
    /// Index into `lse` of (sequence `b`, head `h`, row `i`).
    #[inline]
    pub fn lse_offset(&self, b: usize, h: usize, i: usize) -> usize {
        self.seqs[b].lse_base + h * self.lse_head_stride + i
    }
    /// Index into `dk`/`dv` of (sequence `b`, key `j`, kv head `hk`, 0).
    #[inline]
    pub fn dk_offset(&self, b: usize, j: usize, hk: usize) -> usize {
        ((self.seqs[b].k_row0 + j) * self.heads_kv + hk) * self.head_dim
    }
    pub fn dk_len(&self) -> usize {
        self.total_k * self.heads_kv * self.head_dim
    }
    /// The kv head that query head `h` reads.
    #[inline]
    pub fn kv_head(&self, h: usize) -> usize {
        h / (self.heads / self.heads_kv)
    }
    /// The factor of the raw dot products q·k of query head `h` in sequence `b`: `softmax_scale`,
    /// times the FP8 descale factors of q and k when there are any.
    #[inline]
    pub fn score_scale(&self, b: usize, h: usize) -> f32 {
        match &self.descale {
            Some(d) => d.score_scale[b * self.heads_kv + self.kv_head(h)],
            None => self.softmax_scale,
        }
    }
    /// The factor of the output rows of query head `h` in sequence `b` (FP8 `v_descale`; else 1).
    #[inline]
    pub fn out_descale(&self, b: usize, h: usize) -> f32 {
        self.descale
            .as_ref()
            .map_or(1.0, |d| d.out_scale[b * self.heads_kv + self.kv_head(h)])
    }
    pub fn alibi_slope(&self, b: usize, h: usize) -> Option<f32> {
        self.alibi.as_ref().map(|s| s[b * self.heads + h])
    }
    pub fn out_len(&self) -> usize {
        self.total_q * self.heads * self.head_dim
    }
    pub fn lse_len(&self) -> usize {
        self.total_q * self.heads
    }
}

/// Checks rank, stride count, contiguity of the last dimension and that every element the view
/// addresses lies inside its buffer.
pub(crate) fn check_view<V: ViewDesc + ?Sized>(
    name: TensorName,
    t: &V,
    rank: usize,
    layout: &'static str,
) -> Result<()> {
    if t.shape().len() != rank {
        return Err(ErrorKind::Rank {
            tensor: name,
            expected: rank,
            got: t.shape().len(),
            layout,
        }
        .into());
    }
    if t.strides().len() != rank {
        return Err(ErrorKind::StridesRank {
            tensor: name,
            dims: rank,
            strides: t.strides().len(),
        }
        .into());
    }
    let last = rank - 1;
    if t.shape()[last] > 1 && t.strides()[last] != 1 {
        return Err(ErrorKind::LastDimNotContiguous {
            tensor: name,
            stride: t.strides()[last],
        }
        .into());
    }
    if t.shape().contains(&0) {
        return Ok(());
    }
    // Each term is below 2^128 but their sum need not be: overflow means "far out of bounds".
    let max_index: Option<u128> = t
        .shape()
        .iter()
        .zip(t.strides())
        .try_fold(0u128, |acc, (&n, &s)| {
            acc.checked_add((n as u128 - 1).checked_mul(s as u128)?)
        });
    let needed = max_index
        .and_then(|m| m.checked_add(1))
        .unwrap_or(u128::MAX);
    if needed > t.buffer_len() as u128 {
        return Err(ErrorKind::OutOfBounds {
            tensor: name,
            shape: t.shape().to_vec(),
            strides: t.strides().to_vec(),
            needed,
            len: t.buffer_len(),
        }
        .into());
    }
    Ok(())
}

pub(crate) fn check_dtype<V: ViewDesc + ?Sized>(
    name: TensorName,
    t: &V,
    expected: DType,
) -> Result<()> {
    if t.dtype() != expected {
        return Err(ErrorKind::DType {
            tensor: name,
            expected,
            got: t.dtype(),
        }
        .into());
    }
    Ok(())
}

pub(crate) fn check_shape<V: ViewDesc + ?Sized>(
    name: TensorName,
    t: &V,
    expected: &[usize],
) -> Result<()> {
    if t.shape() != expected {
        return Err(ErrorKind::Shape {
            tensor: name,
            expected: expected.to_vec(),
            got: t.shape().to_vec(),
        }
        .into());
    }
    Ok(())
}

/// Element count of `dims`, if a buffer of that many `elem_bytes`-byte elements can be allocated
/// (at most `isize::MAX` bytes); otherwise `TooLarge`.
pub(crate) fn checked_product(
    name: TensorName,
    dims: &[usize],
    elem_bytes: usize,
) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| {
            n.checked_mul(elem_bytes)
                .is_some_and(|b| b <= isize::MAX as usize)
        })
        .ok_or_else(|| ErrorKind::TooLarge { tensor: name }.into())
}

/// Everything a call allocates in proportion to its shapes must be allocatable: out and dq
/// (q's shape), lse, dk and dv (k's shape), and the per-sequence table. f32 is the widest element.
fn check_sizes(
    q_shape: &[usize],
    k_shape: &[usize],
    batch: usize,
    heads: usize,
    rows: usize,
) -> Result<()> {
    checked_product("out", q_shape, 4)?;
    checked_product("k", k_shape, 4)?;
    checked_product("lse", &[rows, heads], 4)?;
    checked_product("q", &[batch], std::mem::size_of::<Seq>())?;
    Ok(())
}

/// The per-sequence table, allocated fallibly (see [`crate::memory::try_collect`]): a batched
/// call's batch is a shape entry, so stride-0 views of one element can ask for 2^50 empty
/// sequences.
pub(crate) fn seq_table(seqs: impl ExactSizeIterator<Item = Seq>) -> Result<Vec<Seq>> {
    crate::memory::try_collect("the per-sequence table", seqs)
}

/// Shared checks of q, k, v whatever the layout; returns (heads, heads_kv, head_dim).
fn check_qkv<V: ViewDesc + ?Sized>(
    q: &V,
    k: &V,
    v: &V,
    rank: usize,
    layout: &'static str,
) -> Result<(usize, usize, usize)> {
    check_view("q", q, rank, layout)?;
    check_view("k", k, rank, layout)?;
    check_view("v", v, rank, layout)?;
    check_dtype("k", k, q.dtype())?;
    check_dtype("v", v, q.dtype())?;
    let (qs, ks) = (q.shape(), k.shape());
    let head_dim = qs[rank - 1];
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(ErrorKind::HeadDim {
            tensor: "q",
            head_dim,
        }
        .into());
    }
    // k must agree with q on batch (batched layout) and head_dim.
    let mut k_expected = ks.to_vec();
    if rank == 4 {
        k_expected[0] = qs[0];
    }
    k_expected[rank - 1] = head_dim;
    check_shape("k", k, &k_expected)?;
    check_shape("v", v, ks)?;
    let (heads, heads_kv) = (qs[rank - 2], ks[rank - 2]);
    if heads == 0 || heads_kv == 0 || heads % heads_kv != 0 {
        return Err(ErrorKind::HeadsNotMultiple { heads, heads_kv }.into());
    }
    Ok((heads, heads_kv, head_dim))
}

pub(crate) fn layout_of<V: ViewDesc + ?Sized>(t: &V) -> RowLayout {
    let n = t.strides().len();
    RowLayout {
        row_stride: t.strides()[n - 3],
        head_stride: t.strides()[n - 2],
    }
}

/// Options shared by both layouts, validated.
pub(crate) struct CheckedOptions {
    pub softmax_scale: f32,
    pub softcap: Option<f32>,
    pub window_left: Option<usize>,
    pub window_right: Option<usize>,
    pub dropout: Option<Dropout>,
    pub kernels: &'static Kernels,
}

/// A score scale (the softmax scale, or FP8's folded `softmax_scale · q_descale · k_descale`)
/// with the softcap. The kernels fold them into f32 constants (scale · log2(e), scale / softcap,
/// softcap · log2(e)): each must be finite, and scale / softcap not lost to underflow, or every
/// score of the call would be NaN (inf · 0) or off.
pub(crate) fn check_score_scale(scale: f32, softcap: Option<f32>) -> Result<()> {
    if !(scale * LOG2_E).is_finite() {
        return Err(ErrorKind::Scale { scale }.into());
    }
    if let Some(softcap) = softcap {
        let pre = (scale / softcap).abs();
        if !(softcap > 0.0
            && (softcap * LOG2_E).is_finite()
            && (scale == 0.0 || pre >= f32::MIN_POSITIVE))
        {
            return Err(ErrorKind::Softcap { softcap }.into());
        }
    }
    Ok(())
}

pub(crate) fn check_options(opts: &AttnOptions, head_dim: usize) -> Result<CheckedOptions> {
    let softmax_scale = opts.softmax_scale.unwrap_or(1.0 / (head_dim as f32).sqrt());
    check_score_scale(softmax_scale, opts.softcap)?;
    let (left, right) = opts.window;
    if left < -1 || right < -1 {
        return Err(ErrorKind::Window { left, right }.into());
    }
    let bound = |w: i64| (w >= 0).then_some(w as usize);
    let window_right = if opts.causal { Some(0) } else { bound(right) };
    let p = opts.dropout_p;
    if !(0.0..1.0).contains(&p) {
        return Err(ErrorKind::Dropout { p }.into());
    }
    Ok(CheckedOptions {
        softmax_scale,
        softcap: opts.softcap,
        window_left: bound(left),
        window_right,
        dropout: Dropout::new(p, opts.seed),
        kernels: Kernels::for_isa(match opts.isa {
            Some(isa) => isa,
            None => simd::active()?,
        })?,
    })
}

/// Reads the learnable sinks: f32 `[heads]`, each finite with `sink · log2(e)` finite.
pub(crate) fn check_sink(opts: &AttnOptions, heads: usize) -> Result<Option<Vec<f32>>> {
    let Some(t) = &opts.learnable_sink else {
        return Ok(None);
    };
    check_dtype("learnable_sink", t, DType::F32)?;
    if t.shape() != [heads] {
        return Err(ErrorKind::SinkShape {
            got: t.shape().to_vec(),
            heads,
        }
        .into());
    }
    check_view("learnable_sink", t, 1, "[heads]")?;
    let data = t.typed::<f32>().expect("dtype checked above");
    let st = t.strides()[0];
    let sinks: Vec<f32> = (0..heads).map(|h| data[h * st]).collect();
    if let Some((head, &value)) = sinks
        .iter()
        .enumerate()
        .find(|(_, s)| !(**s * LOG2_E).is_finite())
    {
        return Err(ErrorKind::SinkValue { head, value }.into());
    }
    Ok(Some(sinks))
}

/// Reads ALiBi slopes into one f32 per (batch, head). `max_distance` is the call's largest
/// query-key distance |i + seqlen_k - seqlen_q - j|: max(seqlen_q, seqlen_k) - 1 over its
/// sequences ([`alibi_distance`]).
pub(crate) fn check_alibi(
    opts: &AttnOptions,
    batch: usize,
    heads: usize,
    max_distance: usize,
) -> Result<Option<Vec<f32>>> {
    let Some(slopes) = &opts.alibi_slopes else {
        return Ok(None);
    };
    check_dtype("alibi_slopes", slopes, DType::F32)?;
    let per_batch = match slopes.shape() {
        [h] if *h == heads => false,
        [b, h] if *b == batch && *h == heads => true,
        got => {
            return Err(ErrorKind::AlibiShape {
                got: got.to_vec(),
                batch,
                heads,
            }
            .into())
        }
    };
    check_view(
        "alibi_slopes",
        slopes,
        slopes.shape().len(),
        "[heads] or [batch, heads]",
    )?;
    let data = slopes.typed::<f32>().expect("dtype checked above");
    let st = slopes.strides();
    let mut out = Vec::with_capacity(batch * heads);
    for b in 0..batch {
        for h in 0..heads {
            let idx = if per_batch {
                b * st[0] + h * st[1]
            } else {
                h * st[0]
            };
            let slope = data[idx];
            // The kernels subtract `slope · log2(e) · distance`, computed in f32 as here: a NaN
            // or infinite slope, or one whose bias overflows for the farthest key, would make
            // scores of its head infinite and the softmax NaN (+inf bias), or hide the only
            // keys a row sees (-inf bias). The product grows with the distance, so the farthest
            // key's is the one to check.
            let slope_log2 = slope * LOG2_E;
            if !slope_log2.is_finite() || !(slope_log2 * max_distance as f32).is_finite() {
                return Err(ErrorKind::AlibiSlope {
                    batch: b,
                    head: h,
                    slope,
                    max_distance,
                }
                .into());
            }
            out.push(slope);
        }
    }
    Ok(Some(out))
}

/// The largest ALiBi distance |i + seqlen_k - seqlen_q - j| of sequences with these lengths.
pub(crate) fn alibi_distance(lens: impl IntoIterator<Item = (usize, usize)>) -> usize {
    lens.into_iter()
        .map(|(sq, sk)| sq.max(sk).saturating_sub(1))
        .max()
        .unwrap_or(0)
}

/// Validates a batched call: q `[batch, seqlen_q, heads, d]`, k/v `[batch, seqlen_k, heads_kv, d]`.
pub(crate) fn batched<V: ViewDesc + ?Sized>(
    q: &V,
    k: &V,
    v: &V,
    opts: &AttnOptions,
) -> Result<Params> {
    const LAYOUT: &str = "[batch, seqlen, heads, head_dim]";
    const PACKED: bool = false;
    let (heads, heads_kv, head_dim) = check_qkv(q, k, v, 4, LAYOUT)?;
    let (batch, seqlen_q, seqlen_k) = (q.shape()[0], q.shape()[1], k.shape()[1]);
    let o = check_options(opts, head_dim)?;
    let alibi = check_alibi(opts, batch, heads, alibi_distance([(seqlen_q, seqlen_k)]))?;
    let sink = check_sink(opts, heads)?;
    let out_shape = vec![batch, seqlen_q, heads, head_dim];
    check_sizes(
        &out_shape,
        k.shape(),
        batch,
        heads,
        batch.saturating_mul(seqlen_q),
    )?;
    let seqs = seq_table((0..batch).map(|b| Seq {
        seqlen_q,
        seqlen_k,
        q_base: b * q.strides()[0],
        k_base: b * k.strides()[0],
        v_base: b * v.strides()[0],
        out_row0: b * seqlen_q,
        lse_base: b * heads * seqlen_q,
        k_row0: b * seqlen_k,
    }))?;
    Ok(Params {
        dtype: q.dtype(),
        heads,
        heads_kv,
        head_dim,
        seqs,
        q: layout_of(q),
        k: layout_of(k),
        v: layout_of(v),
        total_q: batch * seqlen_q,
        lse_head_stride: seqlen_q,
        out_shape,
        lse_shape: vec![batch, heads, seqlen_q],
        k_shape: k.shape().to_vec(),
        total_k: batch * seqlen_k,
        softmax_scale: o.softmax_scale,
        softcap: o.softcap,
        window_left: o.window_left,
        window_right: o.window_right,
        alibi,
        sink,
        dropout: o.dropout,
        packed: PACKED,
        kernels: o.kernels,
        descale: None,
    })
}

pub(crate) fn check_cu_seqlens(
    name: TensorName,
    cu: &[i32],
    entries: usize,
    total: usize,
) -> Result<()> {
    let err = |problem| {
        Err(ErrorKind::CuSeqlens {
            tensor: name,
            problem,
        }
        .into())
    };
    if cu.len() != entries || entries == 0 {
        return err(CuSeqlensProblem::Length {
            expected: entries.max(1),
            got: cu.len(),
        });
    }
    if cu[0] != 0 {
        return err(CuSeqlensProblem::NotStartingAtZero { first: cu[0] });
    }
    for (index, w) in cu.windows(2).enumerate() {
        if w[1] < w[0] {
            return err(CuSeqlensProblem::Decreasing {
                index: index + 1,
                previous: w[0],
                value: w[1],
            });
        }
    }
    let last = cu[entries - 1];
    if last as usize > total {
        return err(CuSeqlensProblem::PastTensor { last, total });
    }
    Ok(())
}

/// Validates a packed call: q `[total_q, heads, d]`, k/v `[total_k, heads_kv, d]`, and the
/// cumulative sequence lengths (batch + 1 entries each).
pub(crate) fn varlen<V: ViewDesc + ?Sized>(
    q: &V,
    k: &V,
    v: &V,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    opts: &AttnOptions,
) -> Result<Params> {
    const LAYOUT: &str = "[total_tokens, heads, head_dim]";
    const PACKED: bool = true;
    let (heads, heads_kv, head_dim) = check_qkv(q, k, v, 3, LAYOUT)?;
    check_cu_seqlens(
        "cu_seqlens_q",
        cu_seqlens_q,
        cu_seqlens_q.len().max(1),
        q.shape()[0],
    )?;
    check_cu_seqlens(
        "cu_seqlens_k",
        cu_seqlens_k,
        cu_seqlens_q.len(),
        k.shape()[0],
    )?;
    let batch = cu_seqlens_q.len() - 1;
    let o = check_options(opts, head_dim)?;
    let lens = |cu: &[i32], b: usize| (cu[b + 1] - cu[b]) as usize;
    let distance =
        alibi_distance((0..batch).map(|b| (lens(cu_seqlens_q, b), lens(cu_seqlens_k, b))));
    let alibi = check_alibi(opts, batch, heads, distance)?;
    let sink = check_sink(opts, heads)?;
    let total_q = q.shape()[0];
    let out_shape = vec![total_q, heads, head_dim];
    check_sizes(&out_shape, k.shape(), batch, heads, total_q)?;
    let (ql, kl, vl) = (layout_of(q), layout_of(k), layout_of(v));
    let seqs = seq_table((0..batch).map(|b| {
        let (q0, k0) = (cu_seqlens_q[b] as usize, cu_seqlens_k[b] as usize);
        Seq {
            seqlen_q: cu_seqlens_q[b + 1] as usize - q0,
            seqlen_k: cu_seqlens_k[b + 1] as usize - k0,
            q_base: q0 * ql.row_stride,
            k_base: k0 * kl.row_stride,
            v_base: k0 * vl.row_stride,
            out_row0: q0,
            lse_base: q0,
            k_row0: k0,
        }
    }))?;
    Ok(Params {
        dtype: q.dtype(),
        heads,
        heads_kv,
        head_dim,
        seqs,
        q: ql,
        k: kl,
        v: vl,
        total_q,
        lse_head_stride: total_q,
        out_shape,
        lse_shape: vec![heads, total_q],
        k_shape: k.shape().to_vec(),
        total_k: k.shape()[0],
        softmax_scale: o.softmax_scale,
        softcap: o.softcap,
        window_left: o.window_left,
        window_right: o.window_right,
        alibi,
        sink,
        dropout: o.dropout,
        packed: PACKED,
        kernels: o.kernels,
        descale: None,
    })
}

/// A tensor laid out like q (`out`, `dout`): its row/head strides and, per sequence, the element
/// offset of row 0, head 0.
#[derive(Clone, Debug)]
pub(crate) struct QLike {
    pub layout: RowLayout,
    pub bases: Vec<usize>,
}

impl QLike {
    /// Element offset of (sequence b, row i, head h, 0).
    #[inline]
    pub fn offset(&self, b: usize, i: usize, h: usize) -> usize {
        self.bases[b] + i * self.layout.row_stride + h * self.layout.head_stride
    }
}

/// Checks a tensor that must have q's shape and dtype (any strides, last dimension contiguous).
pub(crate) fn q_like<V: ViewDesc + ?Sized>(name: TensorName, t: &V, p: &Params) -> Result<QLike> {
    let rank = p.out_shape.len();
    let layout = if p.packed {
        "[total_q, heads, head_dim]"
    } else {
        "[batch, seqlen_q, heads, head_dim]"
    };
    check_view(name, t, rank, layout)?;
    check_dtype(name, t, p.dtype)?;
    check_shape(name, t, &p.out_shape)?;
    let bases = crate::memory::try_collect(
        "the per-sequence table",
        p.seqs.iter().enumerate().map(|(b, s)| {
            if p.packed {
                s.out_row0 * t.strides()[0]
            } else {
                b * t.strides()[0]
            }
        }),
    )?;
    Ok(QLike {
        layout: layout_of(t),
        bases,
    })
}

/// What the backward pass reads besides q, k and v, validated.
#[derive(Clone, Debug)]
pub(crate) struct GradInputs {
    pub out: QLike,
    pub dout: QLike,
    /// The forward's LSE, gathered contiguous in `p.lse_shape` order.
    pub lse: Vec<f32>,
}

/// Validates `out`, `dout` (q's shape and dtype) and `lse` (f32, `p.lse_shape`).
pub(crate) fn grad_inputs(
    p: &Params,
    out: &TensorRef,
    lse: &TensorRef,
    dout: &TensorRef,
) -> Result<GradInputs> {
    let out = q_like("out", out, p)?;
    let dout = q_like("dout", dout, p)?;
    check_lse(p, lse)?;
    let data = lse.typed::<f32>().expect("dtype checked above");
    let st = lse.strides();
    // Sized up front (fallibly): lse's shape, not its buffer, sets the length.
    let mut gathered = crate::memory::try_filled("the gathered `lse`", 0f32, p.lse_len())?;
    let dst = gathered.iter_mut();
    if p.packed {
        let src = (0..p.heads).flat_map(|h| (0..p.total_q).map(move |i| h * st[0] + i * st[1]));
        dst.zip(src).for_each(|(x, at)| *x = data[at]);
    } else {
        let (batch, heads, sq) = (p.lse_shape[0], p.lse_shape[1], p.lse_shape[2]);
        let src = (0..batch).flat_map(|b| {
            (0..heads).flat_map(move |h| (0..sq).map(move |i| b * st[0] + h * st[1] + i * st[2]))
        });
        dst.zip(src).for_each(|(x, at)| *x = data[at]);
    }
    Ok(GradInputs {
        out,
        dout,
        lse: gathered,
    })
}

/// Checks the forward's `lse` handed to a backward call: f32, `p.lse_shape`, any strides.
pub(crate) fn check_lse<V: ViewDesc + ?Sized>(p: &Params, lse: &V) -> Result<()> {
    check_view(
        "lse",
        lse,
        p.lse_shape.len(),
        if p.packed {
            "[heads, total_q]"
        } else {
            "[batch, heads, seqlen_q]"
        },
    )?;
    check_dtype("lse", lse, DType::F32)?;
    check_shape("lse", lse, &p.lse_shape)
}

/// Checks a caller-provided destination: dtype `expected_dtype`, `shape`'s number of elements
/// (contiguous). The `_into` calls write nothing before every destination has passed.
pub(crate) fn destination(
    tensor: &'static str,
    (dtype, len): (DType, usize),
    expected_dtype: DType,
    shape: &[usize],
) -> Result<()> {
    if dtype != expected_dtype {
        return Err(ErrorKind::DType {
            tensor,
            expected: expected_dtype,
            got: dtype,
        }
        .into());
    }
    let expected: usize = shape.iter().product();
    if len != expected {
        return Err(ErrorKind::DestinationLength {
            tensor,
            expected,
            got: len,
            shape: shape.to_vec(),
        }
        .into());
    }
    Ok(())
}
