//! The public options of the calls, [`AttnOptions`] and the decode call's [`KvCacheOptions`]
//! (with [`BlockTable`] and [`Rotary`]), and the checks of the attention options.

use super::check::{check_dtype, check_view};
use super::contract::LOG2_E;
use crate::block_mask::{BlockMask, MaskShape};
use crate::blocks::MaskMod;
use crate::cpu::simd::{self, Isa, Kernels};
use crate::dropout::Dropout;
use crate::error::{ErrorKind, Result};
use crate::score_fn::ScoreFn;
use crate::tensor::{DType, TensorRef};

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
    /// Packed variable-length sequences, `(cu_seqlens_q, cu_seqlens_k)` ([`AttnOptions::varlen`]):
    /// q is `[total_q, heads, head_dim]`, k and v `[total_k, heads_kv, head_dim]`, and sequence b
    /// holds q rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` and k/v rows
    /// `cu_seqlens_k[b]..cu_seqlens_k[b + 1]` (`batch + 1` entries each, from 0, non-decreasing).
    /// `None`: the batched layout `[batch, seqlen, heads, head_dim]`. Not for decode calls, whose
    /// packed queries are [`KvCacheOptions::cu_seqlens_q`] ([`crate::ErrorKind::VarlenInDecode`]).
    pub cu_seqlens: Option<(&'a [i32], &'a [i32])>,
    /// The dequantisation factors of FP8 inputs ([`AttnOptions::descale`]); only the FP8 calls
    /// take them (any other call: [`crate::ErrorKind::DescaleNotFp8`]).
    pub descale: Option<Descale<'a>>,
    /// A custom mask function ([`AttnOptions::mask_mod`]) or block mask
    /// ([`AttnOptions::block_mask`]): key j is visible to query i iff the causal and window rules
    /// and the mask allow it. CPU forward and backward only (any
    /// other call: [`crate::ErrorKind::MaskModUnsupported`]).
    pub mask_mod: Option<MaskMod>,
    /// A custom score function ([`AttnOptions::score_mod`], FlexAttention's `score_mod`). CPU
    /// forward and backward only (any other call: [`crate::ErrorKind::ScoreModUnsupported`]).
    pub score_mod: Option<ScoreFn>,
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
            cu_seqlens: None,
            descale: None,
            mask_mod: None,
            score_mod: None,
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
    /// Packed variable-length sequences (flash-attn's `flash_attn_varlen_func`): q
    /// `[total_q, heads, head_dim]`, k and v `[total_k, heads_kv, head_dim]`; sequence b holds q
    /// rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` and k/v rows `cu_seqlens_k[b]..cu_seqlens_k[b + 1]`
    /// and attends only within itself; masks apply per sequence; `lse` is `[heads, total_q]`.
    /// The two arrays live on the host on either backend.
    pub fn varlen(mut self, cu_seqlens_q: &'a [i32], cu_seqlens_k: &'a [i32]) -> Self {
        self.cu_seqlens = Some((cu_seqlens_q, cu_seqlens_k));
        self
    }
    /// A custom mask function, FlexAttention's `mask_mod`: query `q` of (sequence `batch`, head
    /// `head`) sees key `k` iff the causal and window rules allow it and `f` returns true; a row
    /// that sees no key gets out 0 and lse -inf. Coordinates are within each sequence, as the
    /// causal rule's. `f` must be pure (it is called from several threads, any number of times
    /// per pair); the CPU forward and backward evaluate it for every pair the built-in masks
    /// show, O(seqlen_q · seqlen_k) calls per head and pass, and skip the key blocks it hides
    /// whole. CPU forward and backward only.
    pub fn mask_mod(
        mut self,
        f: impl Fn(crate::MaskIndex) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.mask_mod = Some(MaskMod::new(f));
        self
    }
    /// A mask evaluated once ([`BlockMask`], FlexAttention's `block_mask`): as
    /// [`AttnOptions::mask_mod`] with the function the mask was built from, the same bits, but the
    /// kernels read block summaries and bit words instead of calling it. It takes the place of a
    /// `mask_mod` set before (there is one custom mask per call). Its batch and heads are the
    /// call's or 1 (shared); its lengths are the call's, or for packed sequences at least the
    /// longest one's ([`crate::ErrorKind::BlockMaskShape`]). CPU forward and backward only.
    pub fn block_mask(mut self, mask: BlockMask) -> Self {
        self.mask_mod = Some(MaskMod::from(mask));
        self
    }
    /// A custom score function, FlexAttention's `score_mod`: each visible score `s` (the scaled
    /// product `q·k·softmax_scale`, after softcap and ALiBi) becomes `f(s, (batch, head, q, k))`
    /// before the masks and the softmax, in the coordinates of [`AttnOptions::mask_mod`]; the
    /// backward multiplies dS by `f'(s)`. A score `f` makes -inf is hidden (a row whose scores
    /// all are: out 0, lse -inf, zero gradients); +inf or NaN makes its row's out and lse NaN.
    /// CPU forward and backward only ([`crate::ErrorKind::ScoreModUnsupported`] elsewhere).
    pub fn score_mod(mut self, f: ScoreFn) -> Self {
        self.score_mod = Some(f);
        self
    }
    /// The dequantisation factors of an FP8 call ([`crate::fp8`]); rejected by every other call.
    pub fn descale(mut self, descale: Descale<'a>) -> Self {
        self.descale = Some(descale);
        self
    }
}

/// Dequantisation factors (f32) of FP8 inputs ([`AttnOptions::descale`]): the true q is
/// `q_fp8 · q_descale`, likewise k and v. Each is either one value for the whole tensor or
/// `batch · heads_kv` values, row-major `[batch, heads_kv]` (`batch` = number of sequences; a
/// query head uses the factor of the kv head it reads). `None` means 1. Every factor must be
/// finite and > 0.
///
/// **Per block** ([`Descale::per_block`], FlashAttention-3's block quantisation): one factor per
/// [`crate::fp8::DESCALE_BLOCK`] = 128 rows of each (sequence, head) for q and of each (sequence,
/// kv head) for k and v, counted from each sequence's own first row. The tables are row-major
/// `[batch, heads, q_blocks]` for q and `[batch, heads_kv, k_blocks]` for k and v, with
/// `q_blocks = ceil(max seqlen_q / 128)` and `k_blocks = ceil(max seqlen_k / 128)` over the
/// sequences (batched calls: their one length); row `i` of sequence `b` and head `h` takes
/// entry `(b, h, i / 128)`. Entries past a shorter sequence's last block are padding, never read
/// nor checked; each one read must be finite and > 0. A table left `None` means 1.
#[derive(Clone, Copy, Debug, Default)]
pub struct Descale<'a> {
    pub q: Option<&'a [f32]>,
    pub k: Option<&'a [f32]>,
    pub v: Option<&'a [f32]>,
    /// The tables are per block of [`crate::fp8::DESCALE_BLOCK`] rows ([`Descale::per_block`]),
    /// not per (sequence, kv head) or per tensor.
    pub per_block: bool,
}

impl<'a> Descale<'a> {
    pub fn q(mut self, q: &'a [f32]) -> Self {
        self.q = Some(q);
        self
    }
    pub fn k(mut self, k: &'a [f32]) -> Self {
        self.k = Some(k);
        self
    }
    pub fn v(mut self, v: &'a [f32]) -> Self {
        self.v = Some(v);
        self
    }
    /// The tables hold one factor per block of [`crate::fp8::DESCALE_BLOCK`] rows (see
    /// [`Descale`]).
    pub fn per_block(mut self) -> Self {
        self.per_block = true;
        self
    }
}

/// Refuses descale factors on a call whose inputs are not FP8.
pub(crate) fn check_no_descale(opts: &AttnOptions) -> Result<()> {
    match opts.descale {
        Some(_) => Err(ErrorKind::DescaleNotFp8.into()),
        None => Ok(()),
    }
}

/// Refuses a mask or score function on a call that does not implement them (`call` names the
/// call).
pub(crate) fn check_no_mask_mod(opts: &AttnOptions, call: &'static str) -> Result<()> {
    if opts.mask_mod.is_some() {
        return Err(ErrorKind::MaskModUnsupported { call }.into());
    }
    match opts.score_mod {
        Some(_) => Err(ErrorKind::ScoreModUnsupported { call }.into()),
        None => Ok(()),
    }
}

/// Refuses a block mask made for another shape than the call's (`call`: its sequences, query
/// heads and, packed, its longest lengths).
pub(crate) fn check_block_mask(o: &CheckedOptions, call: MaskShape, packed: bool) -> Result<()> {
    match o.mask_mod.as_ref().and_then(MaskMod::block_mask) {
        Some(m) => m.check_call(call, packed),
        None => Ok(()),
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
    pub mask_mod: Option<MaskMod>,
    pub score_fn: Option<ScoreFn>,
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
        mask_mod: opts.mask_mod.clone(),
        score_fn: opts.score_mod.clone(),
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

/// The page table of a paged cache: `data` is `[batch, max_blocks_per_seq]` row-major; key `j` of
/// sequence b lives in page `data[b][j / page_size]`, row `j % page_size`. Only the entries a call
/// uses (the pages covering `cache_seqlens[b] + seqlen_new` keys) are read and checked.
#[derive(Clone, Copy, Debug)]
pub struct BlockTable<'a> {
    pub data: &'a [i32],
    pub batch: usize,
    pub max_blocks_per_seq: usize,
}

impl<'a> BlockTable<'a> {
    pub fn new(data: &'a [i32], batch: usize, max_blocks_per_seq: usize) -> Self {
        BlockTable {
            data,
            batch,
            max_blocks_per_seq,
        }
    }
}

/// Rotary position embedding of q and the appended keys: `cos`, `sin` `[seqlen_ro, rotary_dim / 2]`
/// (any float dtype), applied to the first `rotary_dim` dimensions of each head. `interleaved`:
/// pairs `(2i, 2i + 1)` rotate by angle i (GPT-J); otherwise pairs `(i, i + rotary_dim / 2)`
/// (GPT-NeoX), as flash-attn's `rotary_interleaved`.
///
/// As in flash-attn: new key t of sequence b is rotated at position `cache_seqlens[b] + t`; query i
/// at `cache_seqlens[b] + i` when the call is causal or windowed, and at `cache_seqlens[b]` (every
/// query) when it is neither. The rotated q stays in f32 inside the kernel; the rotated keys are
/// rounded to the cache's dtype when stored.
#[derive(Clone, Debug)]
pub struct Rotary<'a> {
    pub cos: TensorRef<'a>,
    pub sin: TensorRef<'a>,
    pub interleaved: bool,
}

/// Options of [`flash_attn_with_kvcache`] beyond q, the caches and `cache_seqlens`.
///
/// [`flash_attn_with_kvcache`]: crate::decode::flash_attn_with_kvcache
#[derive(Clone, Debug, Default)]
pub struct KvCacheOptions<'a> {
    /// Scale, causal, window, softcap, ALiBi and ISA as in [`crate::flash_attn`]; dropout must be 0,
    /// `cu_seqlens` unset (packed queries are [`KvCacheOptions::cu_seqlens_q`]); `descale` the k and
    /// v factors of FP8 caches ([`crate::fp8::flash_attn_with_kvcache_fp8`]; `q` unset), unset
    /// otherwise.
    pub attn: AttnOptions<'a>,
    /// New keys and values `[batch, seqlen_new, heads_kv, head_dim]` (q's dtype), or packed
    /// `[total_k_new, heads_kv, head_dim]` with `cu_seqlens_k_new`, written into the caches at
    /// positions `cache_seqlens[b]..` before attending.
    pub new_kv: Option<(TensorRef<'a>, TensorRef<'a>)>,
    /// Packed new keys and values of different lengths per sequence (flash-attn 3's
    /// `cu_seqlens_k_new`): `new_kv` is `[total_k_new, heads_kv, head_dim]` and sequence b appends
    /// rows `cu_seqlens_k_new[b]..cu_seqlens_k_new[b + 1]` (`batch + 1` entries from 0,
    /// non-decreasing; rows after the last sequence are ignored). With `cu_seqlens_q` this is one
    /// step of chunked prefill mixed with decoding: each sequence appends its chunk and attends it.
    pub cu_seqlens_k_new: Option<&'a [i32]>,
    /// Cache row of each batch row (`batch` entries, in `0..batch_cache`); default: row b. Not
    /// with `block_table`.
    pub cache_batch_idx: Option<&'a [i32]>,
    /// Paged caches: `k_cache`/`v_cache` are `[num_blocks, page_size, heads_kv, head_dim]`.
    pub block_table: Option<BlockTable<'a>>,
    /// Packed queries of different lengths per sequence (flash-attn's `flash_attn_varlen_func`
    /// over a KV cache, as serving engines run chunked prefill and decoding in one batch): q is
    /// `[total_q, heads, head_dim]` and sequence b's queries are rows
    /// `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` (`batch + 1` entries from 0, non-decreasing); out is
    /// `[total_q, heads, head_dim]` and lse `[heads, total_q]`, rows after the last sequence 0 and
    /// -inf. Each sequence attends its `cache_seqlens[b]` cached keys and the keys it appends,
    /// masks aligned to the bottom-right as usual.
    pub cu_seqlens_q: Option<&'a [i32]>,
    /// Left padding, flash-attn's `cache_leftpad`: sequence b's keys start at position
    /// `cache_leftpad[b]` (`batch` entries, `0..=cache_seqlens[b]`); keys before it are never
    /// read. The masks and ALiBi count positions from that start (bottom-right alignment over the
    /// `cache_seqlens[b] + seqlen_new - cache_leftpad[b]` keys left), which is the same as hiding
    /// the padded keys; appends still go to `cache_seqlens[b]..`, and rotary still rotates at
    /// cache positions, as in flash-attn. Default: 0. Works with paged caches too (flash-attn
    /// 2.x rejects that combination).
    pub cache_leftpad: Option<&'a [i32]>,
    pub rotary: Option<Rotary<'a>>,
    /// Number of key splits (flash-decoding), 1 to [`MAX_NUM_SPLITS`]; `None`: chosen from the
    /// shape and the rayon pool's thread count (see `cpu::decode::choose_splits`). Results agree
    /// across split counts up to rounding; a fixed count gives bit-identical results on any
    /// number of threads.
    ///
    /// [`MAX_NUM_SPLITS`]: crate::limits::MAX_NUM_SPLITS
    pub num_splits: Option<usize>,
}

impl<'a> KvCacheOptions<'a> {
    pub fn attn(mut self, attn: AttnOptions<'a>) -> Self {
        self.attn = attn;
        self
    }
    pub fn new_kv(mut self, k_new: TensorRef<'a>, v_new: TensorRef<'a>) -> Self {
        self.new_kv = Some((k_new, v_new));
        self
    }
    pub fn cache_batch_idx(mut self, idx: &'a [i32]) -> Self {
        self.cache_batch_idx = Some(idx);
        self
    }
    pub fn block_table(mut self, table: BlockTable<'a>) -> Self {
        self.block_table = Some(table);
        self
    }
    pub fn cu_seqlens_q(mut self, cu_seqlens_q: &'a [i32]) -> Self {
        self.cu_seqlens_q = Some(cu_seqlens_q);
        self
    }
    pub fn cu_seqlens_k_new(mut self, cu_seqlens_k_new: &'a [i32]) -> Self {
        self.cu_seqlens_k_new = Some(cu_seqlens_k_new);
        self
    }
    pub fn cache_leftpad(mut self, leftpad: &'a [i32]) -> Self {
        self.cache_leftpad = Some(leftpad);
        self
    }
    pub fn rotary(mut self, cos: TensorRef<'a>, sin: TensorRef<'a>, interleaved: bool) -> Self {
        self.rotary = Some(Rotary {
            cos,
            sin,
            interleaved,
        });
        self
    }
    pub fn num_splits(mut self, n: usize) -> Self {
        self.num_splits = Some(n);
        self
    }
    /// Forces the CPU kernels of one instruction set (tests, benchmarks).
    pub fn isa(mut self, isa: Isa) -> Self {
        self.attn.isa = Some(isa);
        self
    }
    /// The k and v factors of FP8 caches (`attn.descale`, see
    /// [`crate::fp8::flash_attn_with_kvcache_fp8`]).
    pub fn descale(mut self, descale: Descale<'a>) -> Self {
        self.attn.descale = Some(descale);
        self
    }
}
