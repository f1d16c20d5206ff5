//! Decoding with a KV cache: flash-attn's `flash_attn_with_kvcache` on the CPU, and the exact merge
//! of partial attention results through their LSEs.
//!
//! A serving engine keeps the keys and values of every token generated so far in a cache and, per
//! step, attends one (or a few) new query tokens against all of it. That is bound by memory
//! bandwidth: at B = 1, 32 query heads over 8 kv heads, d = 128 and 32k cached tokens, one step
//! reads 128 MiB of bf16 k/v for 0.27 GFLOP (2 FLOP per byte), so the kernel's job is to stream the
//! cache once at the machine's copy rate (~27-31 GB/s on the 2-core Zen 4 of shared/FACTS.md), not
//! to maximise FLOP/s. Three things follow (see `crate::cpu::decode`):
//!
//! - the query heads of a kv group are one query block, so each k/v row is read once, not once
//!   per query head (4× less traffic at 32/8 heads);
//! - one query block cannot keep all cores busy, so the key range is split (flash-decoding): each
//!   split yields a partial `(out, lse)` and [`merge_attn_partials`]'s rule combines them exactly;
//! - the cache is read in place, from contiguous rows or from pages (`block_table`).
//!
//! The caller owns the cache. Allocated with [`crate::memory::kv_cache_vec`] it is advised for
//! transparent huge pages (Linux), which made a step at the shape above ~9% faster on the AVX2
//! host (see that module), and starts on a 2 MiB boundary, so that no vector load straddles two
//! cache lines (6-10% faster than over a `Vec` 16 bytes past a page with the cache in L2, ~3% in
//! bf16 at 32k keys; see [`crate::memory::CacheBuf`]).
//!
//! ```
//! use flashattn::{flash_attn_with_kvcache, AttnOptions, KvCacheOptions, TensorMut, TensorRef};
//! let (batch, cap, heads, heads_kv, d) = (1, 64, 8, 2, 16);
//! let mut k_cache = flashattn::memory::kv_cache_vec::<f32>(batch * cap * heads_kv * d);
//! let mut v_cache = flashattn::memory::kv_cache_vec::<f32>(batch * cap * heads_kv * d);
//! let q = vec![0.1f32; batch * heads * d]; // one new query token
//! let (k_new, v_new) = (vec![0.2f32; batch * heads_kv * d], vec![0.3f32; batch * heads_kv * d]);
//! let cache_seqlens = [10]; // tokens already cached
//! let opts = KvCacheOptions::default()
//!     .attn(AttnOptions::default().causal(true))
//!     .new_kv(
//!         TensorRef::contiguous(&k_new, &[batch, 1, heads_kv, d]),
//!         TensorRef::contiguous(&v_new, &[batch, 1, heads_kv, d]),
//!     );
//! let shape = [batch, cap, heads_kv, d];
//! let res = flash_attn_with_kvcache(
//!     &TensorRef::contiguous(&q, &[batch, 1, heads, d]),
//!     &mut TensorMut::contiguous(&mut k_cache[..], &shape),
//!     &mut TensorMut::contiguous(&mut v_cache[..], &shape),
//!     &cache_seqlens,
//!     &opts,
//! )?;
//! assert_eq!(res.out.shape(), &[batch, 1, heads, d]);
//! assert_eq!(k_cache[10 * heads_kv * d], 0.2); // the new key was appended at position 10
//! # Ok::<(), flashattn::Error>(())
//! ```
//!
//! Packed queries and new keys of different lengths per sequence (chunked prefill next to
//! decoding, as flash-attn 3's `cu_seqlens_q` and `cu_seqlens_k_new`):
//!
//! ```
//! use flashattn::{flash_attn_with_kvcache, KvCacheOptions, TensorMut, TensorRef};
//! let (cap, heads, heads_kv, d) = (32, 4, 2, 8);
//! let mut k_cache = vec![0.5f32; 2 * cap * heads_kv * d];
//! let mut v_cache = vec![1.0f32; 2 * cap * heads_kv * d];
//! // Sequence 0: a 3-token chunk of its prompt; sequence 1: one decoding step.
//! let cu = [0, 3, 4];
//! let q = vec![0.1f32; 4 * heads * d];
//! let (k_new, v_new) = (vec![0.2f32; 4 * heads_kv * d], vec![1.0f32; 4 * heads_kv * d]);
//! let cache_seqlens = [9, 29]; // tokens already cached; the new ones go after them
//! let shape = [2, cap, heads_kv, d];
//! let res = flash_attn_with_kvcache(
//!     &TensorRef::contiguous(&q, &[4, heads, d]),
//!     &mut TensorMut::contiguous(&mut k_cache[..], &shape),
//!     &mut TensorMut::contiguous(&mut v_cache[..], &shape),
//!     &cache_seqlens,
//!     &KvCacheOptions::default()
//!         .cu_seqlens_q(&cu)
//!         .cu_seqlens_k_new(&cu)
//!         .new_kv(
//!             TensorRef::contiguous(&k_new, &[4, heads_kv, d]),
//!             TensorRef::contiguous(&v_new, &[4, heads_kv, d]),
//!         ),
//! )?;
//! assert_eq!(res.out.shape(), &[4, heads, d]);
//! assert_eq!(res.lse.shape(), &[heads, 4]);
//! assert!(res.out.to_f32_vec().iter().all(|&x| (x - 1.0).abs() < 1e-6)); // v is all 1
//! // Sequence 1's new key went to its position 29.
//! assert_eq!(k_cache[(cap + 29) * heads_kv * d], 0.2);
//! # Ok::<(), flashattn::Error>(())
//! ```
//!
//! FP8 caches (e4m3/e5m2 with descale factors, q and out in f32/f16/bf16) take
//! [`crate::fp8::flash_attn_with_kvcache_fp8`], which shares this module's validation.
//!
//! This module owns the public types and all validation (everything is checked before the cache is
//! written: a rejected call leaves it bit-identical); the kernels are in `cpu::decode`.
//!
//! Semantics are flash-attn's, with one difference noted at [`Rotary`]: batch row b attends cache
//! positions `0..cache_seqlens[b] + seqlen_new` (`seqlen_new` being sequence b's count of new
//! keys, which packed ones make differ; after appending the new keys at
//! `cache_seqlens[b]`; from `cache_leftpad[b]` on when given), and causal/window masks and ALiBi
//! are aligned to the bottom-right corner of that length, as in [`crate::flash_attn`] (query i
//! sits at position `cache_seqlens[b] + seqlen_new - seqlen_q + i`).

use crate::cpu::simd::Isa;
use crate::error::{ErrorKind, Result, TensorName};
use crate::memory::try_filled;
use crate::output::AttnOutput;
use crate::params::{self, AttnOptions, Params, RowLayout, Seq, MAX_HEAD_DIM};
use crate::tensor::Element;
use crate::tensor::{DType, Slice, TensorRef, ViewDesc};

pub use crate::tensor::{SliceMut, TensorMut};

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
#[derive(Clone, Debug, Default)]
pub struct KvCacheOptions<'a> {
    /// Scale, causal, window, softcap, ALiBi and ISA as in [`crate::flash_attn`]; dropout must be 0.
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
    pub num_splits: Option<usize>,
}

/// Most key splits a decode call may ask for (`KvCacheOptions::num_splits`), on either backend:
/// each split adds a partial result per query row to the workspace (flash-attn allows 128).
pub use crate::limits::MAX_NUM_SPLITS;

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
}

/// Where key `j`, kv head `hk` of sequence b lives in a cache: page
/// `pages[b * max_blocks + j / page_size]`, at element
/// `page * page_stride + (j % page_size) * row.row_stride + hk * row.head_stride`. A contiguous
/// cache is the special case of one page per sequence (`page_size = seqlen_cache`, the page being
/// the sequence's cache row).
#[derive(Clone, Debug)]
pub(crate) struct CacheLayout {
    pub page_size: usize,
    pub max_blocks: usize,
    /// Page index per (sequence, block); entries past a sequence's last used block are 0.
    pub pages: Vec<usize>,
    pub k_page_stride: usize,
    pub v_page_stride: usize,
    pub k: RowLayout,
    pub v: RowLayout,
}

impl CacheLayout {
    /// Element offsets of (sequence b, key j, kv head 0) in k_cache and v_cache.
    #[inline]
    pub fn key_offsets(&self, b: usize, j: usize) -> (usize, usize) {
        let page = self.pages[b * self.max_blocks + j / self.page_size];
        let row = j % self.page_size;
        (
            page * self.k_page_stride + row * self.k.row_stride,
            page * self.v_page_stride + row * self.v.row_stride,
        )
    }

    /// [`CacheLayout::key_offsets`] of keys `j0..j0 + k.len()` (`k` and `v` of one length), with
    /// one division for the run instead of one per key.
    #[inline]
    pub fn key_offsets_run(&self, b: usize, j0: usize, k: &mut [usize], v: &mut [usize]) {
        // An empty run may start at the sequence's capacity (an empty split after a full cache),
        // where there is no page to look up.
        if k.is_empty() {
            return;
        }
        let (mut blk, mut row) = (j0 / self.page_size, j0 % self.page_size);
        let mut page = self.pages[b * self.max_blocks + blk];
        for (ko, vo) in k.iter_mut().zip(v.iter_mut()) {
            if row == self.page_size {
                (blk, row) = (blk + 1, 0);
                page = self.pages[b * self.max_blocks + blk];
            }
            *ko = page * self.k_page_stride + row * self.k.row_stride;
            *vo = page * self.v_page_stride + row * self.v.row_stride;
            row += 1;
        }
    }
}

/// New keys and values: per sequence, how many and the element offset of its first (kv head 0)
/// in k_new and v_new; row and head strides.
#[derive(Clone, Debug)]
pub(crate) struct NewKv {
    pub lens: Vec<usize>,
    pub k_base: Vec<usize>,
    pub v_base: Vec<usize>,
    pub k: RowLayout,
    pub v: RowLayout,
}

/// cos and sin of the positions a call uses, f32: for sequence b, `rows[b]` holds positions
/// `cache_seqlens[b]..cache_seqlens[b] + n_pos`, each `half` cos values then `half` sin values.
#[derive(Clone, Debug)]
pub(crate) struct RotaryParams {
    pub half: usize,
    pub interleaved: bool,
    pub n_pos: usize,
    pub table: Vec<f32>,
}

impl RotaryParams {
    /// (cos, sin) of sequence b's position `cache_seqlens[b] + t`.
    #[inline]
    pub fn at(&self, b: usize, t: usize) -> (&[f32], &[f32]) {
        let at = (b * self.n_pos + t) * 2 * self.half;
        let row = &self.table[at..at + 2 * self.half];
        row.split_at(self.half)
    }

    /// Rotates the first `2 · half` elements of `x` (one head row, f32) in place. Each pair is
    /// computed in f64 (the products are exact there) and rounded to f32 once, so a rotated q
    /// carries one rounding, not three: in f32 with logits of ~100 and d = 256 the three roundings
    /// of an f32 rotation were the largest error of the step (found by the decode property test).
    /// One rotation per query row and appended key: nothing next to the products.
    #[inline]
    pub fn rotate(&self, x: &mut [f32], b: usize, t: usize) {
        self.rotate_to::<f32>(x, b, t);
    }

    /// [`RotaryParams::rotate`] with each rotated element rounded once from f64 to `T` (held in
    /// `x` as f32, exactly): flash-attn's contract, whose rotary embedding hands q and the new
    /// keys over in their own dtype. Every CPU kernel then multiplies the same q, whatever its
    /// instruction set: the AVX-512 bf16 products need q as bf16 anyway, and with logits of ~30
    /// the other kernels' unrounded f32 q gave outputs 0.05 away from theirs (a decode
    /// property-test draw, 2026-11-28).
    #[inline]
    pub fn rotate_to<T: crate::Element>(&self, x: &mut [f32], b: usize, t: usize) {
        let (cos, sin) = self.at(b, t);
        let half = self.half;
        for (i, (&c, &s)) in cos.iter().zip(sin).enumerate() {
            let (i0, i1) = if self.interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (x0, x1, c, s) = (x[i0] as f64, x[i1] as f64, c as f64, s as f64);
            x[i0] = T::from_f64(x0 * c - x1 * s).to_f32();
            x[i1] = T::from_f64(x0 * s + x1 * c).to_f32();
        }
    }
}

/// A validated decode call: the whole contract between the API and the kernels.
#[derive(Clone, Debug)]
pub(crate) struct DecodeParams {
    /// q's layout, heads, options, masks and output offsets; `seqs[b].seqlen_k` is the number of
    /// keys sequence b attends (`cache_seqlens[b] + seqlen_new`); its k/v fields are unused.
    pub p: Params,
    pub cache: CacheLayout,
    pub cache_seqlens: Vec<usize>,
    /// First key position each sequence attends (`cache_leftpad`; 0 without it).
    pub leftpad: Vec<usize>,
    pub new_kv: Option<NewKv>,
    pub rotary: Option<RotaryParams>,
    pub num_splits: Option<usize>,
}

/// Decoding attention with a KV cache, as flash-attn's `flash_attn_with_kvcache`.
///
/// - q `[batch, seqlen_q, heads, head_dim]` (seqlen_q small, often 1), or packed
///   `[total_q, heads, head_dim]` with `opts.cu_seqlens_q` (queries of different lengths);
/// - `k_cache`, `v_cache` `[batch_cache, seqlen_cache, heads_kv, head_dim]`, or with
///   `opts.block_table` paged `[num_blocks, page_size, heads_kv, head_dim]` (any page size); q's
///   dtype, last dimension contiguous, other strides free;
/// - `cache_seqlens[b]` (`batch` entries, >= 0): tokens already in sequence b's cache.
///
/// With `opts.new_kv` (`[batch, seqlen_new, heads_kv, head_dim]`, or packed
/// `[total_k_new, heads_kv, head_dim]` with `opts.cu_seqlens_k_new`, seqlen_new then per sequence),
/// the new keys/values are first written at positions
/// `cache_seqlens[b]..cache_seqlens[b] + seqlen_new` (rotated, with `opts.rotary`); then each
/// sequence attends its first `cache_seqlens[b] + seqlen_new` keys (from `cache_leftpad[b]` on,
/// with `opts.cache_leftpad`) with the masks, softcap, ALiBi and GQA of [`crate::flash_attn`].
/// `cache_seqlens` itself is not updated (as in flash-attn).
/// Every input is validated before anything is written: on error the caches are untouched.
///
/// Returns `out` (q's dtype and shape) and `lse` (`[batch, heads, seqlen_q]`, packed
/// `[heads, total_q]`; f32, natural log).
/// Runs on the current rayon pool; the key range is split over the threads (`opts.num_splits`).
pub fn flash_attn_with_kvcache(
    q: &TensorRef,
    k_cache: &mut TensorMut,
    v_cache: &mut TensorMut,
    cache_seqlens: &[i32],
    opts: &KvCacheOptions,
) -> Result<AttnOutput> {
    let new_kv = opts.new_kv.as_ref().map(|(k, v)| (k, v));
    let dp = validate(
        q,
        &k_cache.view(),
        &v_cache.view(),
        new_kv,
        cache_seqlens,
        opts,
    )?;
    // Every check passed. Only the results' allocation can still fail (`OutOfMemory`), and it
    // comes before the caches are written.
    crate::cpu::decode::run(
        &dp,
        q,
        opts.new_kv.as_ref(),
        &mut k_cache.data,
        &mut v_cache.data,
    )
}

/// A non-negative `i32` entry, or the error naming it.
fn index_entry(tensor: TensorName, index: usize, value: i32, bound: usize) -> Result<usize> {
    if value < 0 || value as usize >= bound {
        return Err(ErrorKind::IndexOutOfRange {
            tensor,
            index,
            value: value as i64,
            bound,
        }
        .into());
    }
    Ok(value as usize)
}

/// An index array with one entry per batch row of q, or the error naming it.
fn one_per_row(tensor: TensorName, entries: &[i32], batch: usize) -> Result<()> {
    if entries.len() != batch {
        return Err(ErrorKind::IndexLength {
            tensor,
            expected: batch,
            got: entries.len(),
            what: "one per batch row of q",
        }
        .into());
    }
    Ok(())
}

fn row_layout<V: ViewDesc + ?Sized>(t: &V) -> RowLayout {
    params::layout_of(t)
}

/// Validates a decode call: q, the caches and the new keys/values as views (host tensors for the
/// CPU path, device tensors for the CUDA path; `new_kv` takes the place of `opts.new_kv`); the
/// index arrays and the rotary tables of `opts` are read on the host.
pub(crate) fn validate<V: ViewDesc + ?Sized>(
    q: &V,
    k_cache: &V,
    v_cache: &V,
    new_kv: Option<(&V, &V)>,
    cache_seqlens: &[i32],
    opts: &KvCacheOptions,
) -> Result<DecodeParams> {
    const Q_LAYOUT: &str = "[batch, seqlen_q, heads, head_dim]";
    let paged = opts.block_table.is_some();
    let cache_layout = if paged {
        "[num_blocks, page_size, heads_kv, head_dim]"
    } else {
        "[batch_cache, seqlen_cache, heads_kv, head_dim]"
    };
    // Queries per sequence: `[batch, seqlen_q, ..]`, or packed with cu_seqlens_q.
    let (batch, q_starts, q_lens) = match opts.cu_seqlens_q {
        None => {
            params::check_view("q", q, 4, Q_LAYOUT)?;
            let (batch, sq) = (q.shape()[0], q.shape()[1]);
            // Checked before anything is sized by batch: a q of shape [usize::MAX, 0, ..] holds
            // no elements, and sizing these by its batch panicked (capacity overflow; a decode
            // property-test draw, seed 51).
            one_per_row("cache_seqlens", cache_seqlens, batch)?;
            (batch, (0..batch).map(|b| b * sq).collect(), vec![sq; batch])
        }
        Some(cu) => {
            params::check_view("q", q, 3, "[total_q, heads, head_dim]")?;
            params::check_cu_seqlens("cu_seqlens_q", cu, cu.len().max(1), q.shape()[0])?;
            let (starts, lens) = starts_and_lens(cu);
            (cu.len() - 1, starts, lens)
        }
    };
    let packed = opts.cu_seqlens_q.is_some();
    let n = q.shape().len();
    let (heads, head_dim) = (q.shape()[n - 2], q.shape()[n - 1]);
    // Rows of out: every query position (packed: also rows after the last sequence).
    let total_q = if packed {
        q.shape()[0]
    } else {
        batch * q_lens.first().copied().unwrap_or(0)
    };
    let seqlen_q = q_lens.iter().copied().max().unwrap_or(0);
    params::check_view("k_cache", k_cache, 4, cache_layout)?;
    params::check_view("v_cache", v_cache, 4, cache_layout)?;
    params::check_dtype("k_cache", k_cache, q.dtype())?;
    params::check_dtype("v_cache", v_cache, q.dtype())?;
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(ErrorKind::HeadDim {
            tensor: "q",
            head_dim,
        }
        .into());
    }
    let cs = k_cache.shape();
    let (n_pages, page_rows, heads_kv) = (cs[0], cs[1], cs[2]);
    params::check_shape(
        "k_cache",
        k_cache,
        &[n_pages, page_rows, heads_kv, head_dim],
    )?;
    params::check_shape("v_cache", v_cache, cs)?;
    if heads == 0 || heads_kv == 0 || heads % heads_kv != 0 {
        return Err(ErrorKind::HeadsNotMultiple { heads, heads_kv }.into());
    }
    let o = params::check_options(&opts.attn, head_dim)?;
    if opts.attn.dropout_p != 0.0 {
        return Err(ErrorKind::DropoutInDecode {
            p: opts.attn.dropout_p,
        }
        .into());
    }
    let (out_shape, lse_shape) = if packed {
        (vec![total_q, heads, head_dim], vec![heads, total_q])
    } else {
        (
            vec![batch, seqlen_q, heads, head_dim],
            vec![batch, heads, seqlen_q],
        )
    };
    params::checked_product("out", &out_shape, 4)?;
    params::checked_product("lse", &lse_shape, 4)?;

    one_per_row("cache_seqlens", cache_seqlens, batch)?;
    for (index, &value) in cache_seqlens.iter().enumerate() {
        if value < 0 {
            return Err(ErrorKind::IndexOutOfRange {
                tensor: "cache_seqlens",
                index,
                value: value as i64,
                bound: i32::MAX as usize,
            }
            .into());
        }
    }
    let lens: Vec<usize> = cache_seqlens.iter().map(|&x| x as usize).collect();
    let leftpad = match opts.cache_leftpad {
        None => vec![0; batch],
        Some(lp) => {
            one_per_row("cache_leftpad", lp, batch)?;
            lp.iter()
                .zip(&lens)
                .enumerate()
                .map(|(b, (&x, &len))| index_entry("cache_leftpad", b, x, len + 1))
                .collect::<Result<Vec<_>>>()?
        }
    };

    // New keys and values: `[batch, seqlen_new, ..]`, or packed with cu_seqlens_k_new.
    let new_kv = match (new_kv, opts.cu_seqlens_k_new) {
        (None, None) => None,
        (None, Some(_)) => return Err(ErrorKind::CuSeqlensKNewWithoutNewKv.into()),
        (Some((kn, vn)), cu) => {
            let (starts, lens, nd, layout): (Vec<usize>, Vec<usize>, _, _) = match cu {
                None => {
                    const NEW_LAYOUT: &str = "[batch, seqlen_new, heads_kv, head_dim]";
                    params::check_view("k_new", kn, 4, NEW_LAYOUT)?;
                    let seqlen_new = kn.shape()[1];
                    (
                        (0..batch).collect(),
                        vec![seqlen_new; batch],
                        vec![batch, seqlen_new, heads_kv, head_dim],
                        NEW_LAYOUT,
                    )
                }
                Some(cu) => {
                    const NEW_LAYOUT: &str = "[total_k_new, heads_kv, head_dim]";
                    params::check_view("k_new", kn, 3, NEW_LAYOUT)?;
                    let total = kn.shape()[0];
                    params::check_cu_seqlens("cu_seqlens_k_new", cu, batch + 1, total)?;
                    let (starts, lens) = starts_and_lens(cu);
                    (starts, lens, vec![total, heads_kv, head_dim], NEW_LAYOUT)
                }
            };
            params::check_view("v_new", vn, nd.len(), layout)?;
            params::check_dtype("k_new", kn, q.dtype())?;
            params::check_dtype("v_new", vn, q.dtype())?;
            params::check_shape("k_new", kn, &nd)?;
            params::check_shape("v_new", vn, &nd)?;
            // Batched: sequence b starts at batch row b; packed: at row cu_seqlens_k_new[b].
            let (ks, vs) = (kn.strides()[0], vn.strides()[0]);
            Some(NewKv {
                k_base: starts[..batch].iter().map(|&s| s * ks).collect(),
                v_base: starts[..batch].iter().map(|&s| s * vs).collect(),
                lens,
                k: row_layout(kn),
                v: row_layout(vn),
            })
        }
    };
    let no_new = vec![0; batch];
    let new_lens: &[usize] = new_kv.as_ref().map_or(&no_new, |n| &n.lens);

    // Where each sequence's keys live, and that the appended ones fit.
    let (page_size, max_blocks, pages) = match (&opts.block_table, opts.cache_batch_idx) {
        (Some(_), Some(_)) => return Err(ErrorKind::PagedWithBatchIdx.into()),
        (Some(bt), None) => {
            if bt.batch != batch {
                return Err(ErrorKind::IndexLength {
                    tensor: "block_table",
                    expected: batch,
                    got: bt.batch,
                    what: "rows: one per batch row of q",
                }
                .into());
            }
            let expected = batch.saturating_mul(bt.max_blocks_per_seq);
            if bt.data.len() != expected {
                return Err(ErrorKind::IndexLength {
                    tensor: "block_table",
                    expected,
                    got: bt.data.len(),
                    what: "batch · max_blocks_per_seq, row-major",
                }
                .into());
            }
            let capacity = bt.max_blocks_per_seq.saturating_mul(page_rows);
            let mut pages = vec![0usize; expected];
            for (b, &len) in lens.iter().enumerate() {
                check_fits(b, len, new_lens[b], capacity)?;
                let used = (len + new_lens[b]).div_ceil(page_rows.max(1));
                for blk in 0..used {
                    let index = b * bt.max_blocks_per_seq + blk;
                    pages[index] = index_entry("block_table", index, bt.data[index], n_pages)?;
                }
            }
            (page_rows, bt.max_blocks_per_seq, pages)
        }
        (None, idx) => {
            let pages = match idx {
                Some(idx) => {
                    one_per_row("cache_batch_idx", idx, batch)?;
                    idx.iter()
                        .enumerate()
                        .map(|(i, &x)| index_entry("cache_batch_idx", i, x, n_pages))
                        .collect::<Result<Vec<_>>>()?
                }
                None => {
                    if n_pages != batch {
                        return Err(ErrorKind::Shape {
                            tensor: "k_cache",
                            expected: vec![batch, page_rows, heads_kv, head_dim],
                            got: cs.to_vec(),
                        }
                        .into());
                    }
                    (0..batch).collect()
                }
            };
            for (b, &len) in lens.iter().enumerate() {
                check_fits(b, len, new_lens[b], page_rows)?;
            }
            (page_rows, 1, pages)
        }
    };

    // Rotary embedding.
    let rotary = match &opts.rotary {
        None => None,
        Some(r) => {
            if new_kv.is_none() {
                return Err(ErrorKind::RotaryWithoutNewKv.into());
            }
            params::check_view("rotary_cos", &r.cos, 2, "[seqlen_ro, rotary_dim / 2]")?;
            params::check_view("rotary_sin", &r.sin, 2, "[seqlen_ro, rotary_dim / 2]")?;
            params::check_shape("rotary_sin", &r.sin, r.cos.shape())?;
            let (seqlen_ro, half) = (r.cos.shape()[0], r.cos.shape()[1]);
            // `half > head_dim / 2` is `2 · half > head_dim` without overflow.
            if half == 0 || half > head_dim / 2 {
                return Err(ErrorKind::RotaryDim {
                    rotary_dim: half.saturating_mul(2),
                    head_dim,
                }
                .into());
            }
            let n_pos = seqlen_q.max(new_lens.iter().copied().max().unwrap_or(0));
            for (b, &len) in lens.iter().enumerate() {
                let needed = len + n_pos;
                if needed > seqlen_ro {
                    return Err(ErrorKind::RotaryPositions {
                        batch: b,
                        needed,
                        seqlen_ro,
                    }
                    .into());
                }
            }
            params::checked_product("rotary_cos", &[batch, n_pos, 2 * half], 4)?;
            // Only the rows this call uses are read (a table may cover 100k+ positions).
            let (cst, sst) = (r.cos.strides(), r.sin.strides());
            let mut table = Vec::with_capacity(batch * n_pos * 2 * half);
            for &len in &lens {
                for t in 0..n_pos {
                    let pos = len + t;
                    table.extend((0..half).map(|i| element(&r.cos, pos * cst[0] + i)));
                    table.extend((0..half).map(|i| element(&r.sin, pos * sst[0] + i)));
                }
            }
            Some(RotaryParams {
                half,
                interleaved: r.interleaved,
                n_pos,
                table,
            })
        }
    };

    if let Some(n) = opts.num_splits {
        if n == 0 || n > MAX_NUM_SPLITS {
            return Err(ErrorKind::NumSplits { num_splits: n }.into());
        }
    }

    // ALiBi distances reach over the keys after the append (a left pad only shortens them).
    let distance = params::alibi_distance((0..batch).map(|b| (q_lens[b], lens[b] + new_lens[b])));
    let alibi = params::check_alibi(&opts.attn, batch, heads, distance)?;
    let sink = params::check_sink(&opts.attn, heads)?;

    let q_layout = row_layout(q);
    let seqs = params::seq_table(lens.iter().enumerate().map(|(b, &len)| Seq {
        seqlen_q: q_lens[b],
        seqlen_k: len + new_lens[b],
        q_base: if packed {
            q_starts[b] * q.strides()[0]
        } else {
            b * q.strides()[0]
        },
        k_base: 0,
        v_base: 0,
        out_row0: q_starts[b],
        // Packed lse is [heads, total_q]; batched [batch, heads, seqlen_q].
        lse_base: if packed {
            q_starts[b]
        } else {
            b * heads * seqlen_q
        },
        k_row0: 0,
    }))?;
    let p = Params {
        dtype: q.dtype(),
        heads,
        heads_kv,
        head_dim,
        seqs,
        q: q_layout,
        k: row_layout(k_cache),
        v: row_layout(v_cache),
        total_q,
        lse_head_stride: if packed { total_q } else { seqlen_q },
        out_shape,
        lse_shape,
        k_shape: cs.to_vec(),
        total_k: 0,
        softmax_scale: o.softmax_scale,
        softcap: o.softcap,
        window_left: o.window_left,
        window_right: o.window_right,
        alibi,
        sink,
        dropout: None,
        packed,
        kernels: o.kernels,
        descale: None,
    };
    Ok(DecodeParams {
        cache: CacheLayout {
            page_size,
            max_blocks,
            pages,
            k_page_stride: k_cache.strides()[0],
            v_page_stride: v_cache.strides()[0],
            k: row_layout(k_cache),
            v: row_layout(v_cache),
        },
        p,
        cache_seqlens: lens,
        leftpad,
        new_kv,
        rotary,
        num_splits: opts.num_splits,
    })
}

/// Validated cumulative lengths (`check_cu_seqlens`): each sequence's first row, and its length.
fn starts_and_lens(cu: &[i32]) -> (Vec<usize>, Vec<usize>) {
    let starts: Vec<usize> = cu.iter().map(|&x| x as usize).collect();
    let lens = starts.windows(2).map(|w| w[1] - w[0]).collect();
    (starts, lens)
}

/// `cache_seqlen + seqlen_new <= capacity`, or the overflow error.
fn check_fits(batch: usize, cache_seqlen: usize, seqlen_new: usize, capacity: usize) -> Result<()> {
    let needed = cache_seqlen.saturating_add(seqlen_new);
    if needed > capacity {
        return Err(ErrorKind::CacheOverflow {
            batch,
            cache_seqlen,
            seqlen_new,
            needed,
            capacity,
        }
        .into());
    }
    Ok(())
}

/// Element `at` of a validated tensor's buffer, widened to f32.
fn element(t: &TensorRef, at: usize) -> f32 {
    match t.data() {
        Slice::F32(d) => d[at],
        Slice::F16(d) => d[at].to_f32(),
        Slice::BF16(d) => d[at].to_f32(),
    }
}

/// Merges partial attention results computed over disjoint key sets of the same queries into the
/// result over all of them, exactly (up to rounding):
/// `lse = log Σ_s exp(lse_s)`, `out = Σ_s exp(lse_s − lse) · out_s`.
///
/// `outs[s]` and `lses[s]` are what a forward call returns for key set s: out
/// `[batch, seqlen_q, heads, head_dim]` with lse `[batch, heads, seqlen_q]`, or the packed
/// `[total_q, heads, head_dim]` with `[heads, total_q]`; every out of one shape and float dtype
/// (f32 keeps the partials exact; the result has their dtype), lse f32, any strides. A partial
/// whose row saw no key (lse -inf) contributes nothing; a row no partial saw is 0 with lse -inf.
/// This is the merge of split-KV decoding, and of attention sharded by keys across machines.
pub fn merge_attn_partials(outs: &[TensorRef], lses: &[TensorRef]) -> Result<AttnOutput> {
    if outs.is_empty() {
        return Err(ErrorKind::NoPartials.into());
    }
    if outs.len() != lses.len() {
        return Err(ErrorKind::PartialsCount {
            outs: outs.len(),
            lses: lses.len(),
        }
        .into());
    }
    let rank = outs[0].shape().len();
    let (layout, lse_layout) = match rank {
        3 => ("[total_q, heads, head_dim]", "[heads, total_q]"),
        _ => (
            "[batch, seqlen_q, heads, head_dim]",
            "[batch, heads, seqlen_q]",
        ),
    };
    let rank = if rank == 3 { 3 } else { 4 };
    let shape = outs[0].shape().to_vec();
    params::check_view("out_partials", &outs[0], rank, layout)?;
    let lse_shape: Vec<usize> = if rank == 3 {
        vec![shape[1], shape[0]]
    } else {
        vec![shape[0], shape[2], shape[1]]
    };
    let dtype = outs[0].dtype();
    for (part, (o, l)) in outs.iter().zip(lses).enumerate() {
        params::check_view("out_partials", o, rank, layout)?;
        params::check_view("lse_partials", l, rank - 1, lse_layout)?;
        for (tensor, t, expected, expected_dtype) in [
            ("out_partials", o, &shape, dtype),
            ("lse_partials", l, &lse_shape, DType::F32),
        ] {
            if t.shape() != expected.as_slice() || t.dtype() != expected_dtype {
                return Err(ErrorKind::PartialMismatch {
                    part,
                    tensor,
                    expected: expected.clone(),
                    got: t.shape().to_vec(),
                    expected_dtype,
                    got_dtype: t.dtype(),
                }
                .into());
            }
        }
    }
    params::checked_product("out", &shape, 4)?;
    // Gather every partial LSE as [part][row], row = (b, h, i) or (h, t) in lse order, and check it.
    let rows: usize = lse_shape.iter().product();
    let mut lse_all = Vec::new();
    let gathered = outs.len().saturating_mul(rows);
    lse_all
        .try_reserve_exact(gathered)
        .map_err(|_| ErrorKind::OutOfMemory {
            what: "the gathered partial LSEs",
            bytes: gathered.saturating_mul(4),
        })?;
    for (part, l) in lses.iter().enumerate() {
        let data = l.typed::<f32>().expect("dtype checked above");
        let st = l.strides();
        let start = lse_all.len();
        if rank == 3 {
            for h in 0..lse_shape[0] {
                lse_all.extend((0..lse_shape[1]).map(|t| data[h * st[0] + t * st[1]]));
            }
        } else {
            for b in 0..lse_shape[0] {
                for h in 0..lse_shape[1] {
                    lse_all
                        .extend((0..lse_shape[2]).map(|i| data[b * st[0] + h * st[1] + i * st[2]]));
                }
            }
        }
        if let Some((index, &value)) = lse_all[start..]
            .iter()
            .enumerate()
            .find(|(_, x)| x.is_nan() || **x == f32::INFINITY)
        {
            return Err(ErrorKind::PartialLse { part, index, value }.into());
        }
    }
    crate::tensor::with_dtype!(dtype, T => merge_typed::<T>(outs, &lse_all, &shape))
}

fn merge_typed<T: Element>(
    outs: &[TensorRef],
    lse_all: &[f32],
    shape: &[usize],
) -> Result<AttnOutput> {
    let d = shape[shape.len() - 1];
    let heads = shape[shape.len() - 2];
    let packed = shape.len() == 3;
    // Token rows of out: (b, i) flattened; lse row index of (token, h).
    let (batch, sq) = if packed {
        (1, shape[0])
    } else {
        (shape[0], shape[1])
    };
    let rows = batch * sq * heads;
    let n = outs.len();
    let mut out = try_filled("`out`", T::default(), rows * d)?;
    let mut lse = try_filled("`lse`", 0f32, rows)?;
    let mut parts = try_filled("the partial rows", 0f32, n.saturating_mul(d))?;
    let mut part_lse = vec![0f32; n];
    let mut row = vec![0f32; d];
    for b in 0..batch {
        for i in 0..sq {
            for h in 0..heads {
                let lse_row = if packed {
                    h * sq + i
                } else {
                    (b * heads + h) * sq + i
                };
                for (s, o) in outs.iter().enumerate() {
                    let st = o.strides();
                    let at = if packed {
                        i * st[0] + h * st[1]
                    } else {
                        b * st[0] + i * st[1] + h * st[2]
                    };
                    let data = o.typed::<T>().expect("dtype checked");
                    T::widen(&data[at..at + d], &mut parts[s * d..(s + 1) * d]);
                    part_lse[s] = lse_all[s * rows + lse_row];
                }
                lse[lse_row] = crate::cpu::decode::merge_row(&part_lse, &parts, d, &mut row);
                let token = b * sq + i;
                T::narrow(
                    &row,
                    &mut out[(token * heads + h) * d..(token * heads + h + 1) * d],
                );
            }
        }
    }
    let lse_shape = if packed {
        vec![heads, sq]
    } else {
        vec![batch, heads, sq]
    };
    Ok(AttnOutput {
        out: crate::Tensor::new_unchecked(T::wrap_vec(out), shape.to_vec()),
        lse: crate::Tensor::new_unchecked(crate::Buffer::F32(lse), lse_shape),
    })
}
