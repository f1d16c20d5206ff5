//! Validation of a decode call ([`validate`]) into [`DecodeParams`]: the cache layout (contiguous
//! or paged), the appended keys and values, the rotary tables, and the [`Params`] of its
//! attention. Everything is checked before the caches are written.

use super::check::{
    check_cu_seqlens, check_dtype, check_shape, check_view, checked_product, layout_of, seq_table,
};
use super::contract::{Params, RowLayout, Seq, MAX_HEAD_DIM};
use super::options::{
    alibi_distance, check_alibi, check_no_descale, check_no_mask_mod, check_options, check_sink,
    KvCacheOptions,
};
use crate::error::{ErrorKind, Result, TensorName};
use crate::limits::MAX_NUM_SPLITS;
use crate::tensor::{Slice, TensorRef, ViewDesc};

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
    layout_of(t)
}

/// Validates a decode call on f32/f16/bf16 caches: refuses FP8 descale factors, then
/// [`validate_caches`].
pub(crate) fn validate<V: ViewDesc + ?Sized>(
    q: &V,
    k_cache: &V,
    v_cache: &V,
    new_kv: Option<(&V, &V)>,
    cache_seqlens: &[i32],
    opts: &KvCacheOptions,
) -> Result<DecodeParams> {
    check_no_descale(&opts.attn)?;
    validate_caches(q, k_cache, v_cache, new_kv, cache_seqlens, opts)
}

/// Validates a decode call: q, the caches and the new keys/values as views (host tensors for the
/// CPU path, device tensors for the CUDA path; `new_kv` takes the place of `opts.new_kv`); the
/// index arrays and the rotary tables of `opts` are read on the host. `opts.attn.descale` is not
/// read here (the FP8 decode checks it, `fp8::validate_kvcache`).
pub(crate) fn validate_caches<V: ViewDesc + ?Sized>(
    q: &V,
    k_cache: &V,
    v_cache: &V,
    new_kv: Option<(&V, &V)>,
    cache_seqlens: &[i32],
    opts: &KvCacheOptions,
) -> Result<DecodeParams> {
    if opts.attn.cu_seqlens.is_some() {
        return Err(ErrorKind::VarlenInDecode.into());
    }
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
            check_view("q", q, 4, Q_LAYOUT)?;
            let (batch, sq) = (q.shape()[0], q.shape()[1]);
            // Checked before anything is sized by batch: a q of shape [usize::MAX, 0, ..] holds
            // no elements, and sizing these by its batch panicked (capacity overflow; a decode
            // property-test draw, seed 51).
            one_per_row("cache_seqlens", cache_seqlens, batch)?;
            (batch, (0..batch).map(|b| b * sq).collect(), vec![sq; batch])
        }
        Some(cu) => {
            check_view("q", q, 3, "[total_q, heads, head_dim]")?;
            check_cu_seqlens("cu_seqlens_q", cu, cu.len().max(1), q.shape()[0])?;
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
    check_view("k_cache", k_cache, 4, cache_layout)?;
    check_view("v_cache", v_cache, 4, cache_layout)?;
    check_dtype("k_cache", k_cache, q.dtype())?;
    check_dtype("v_cache", v_cache, q.dtype())?;
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(ErrorKind::HeadDim {
            tensor: "q",
            head_dim,
        }
        .into());
    }
    let cs = k_cache.shape();
    let (n_pages, page_rows, heads_kv) = (cs[0], cs[1], cs[2]);
    check_shape(
        "k_cache",
        k_cache,
        &[n_pages, page_rows, heads_kv, head_dim],
    )?;
    check_shape("v_cache", v_cache, cs)?;
    if heads == 0 || heads_kv == 0 || heads % heads_kv != 0 {
        return Err(ErrorKind::HeadsNotMultiple { heads, heads_kv }.into());
    }
    check_no_mask_mod(&opts.attn, "flash_attn_with_kvcache (decode)")?;
    let o = check_options(&opts.attn, head_dim)?;
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
    checked_product("out", &out_shape, 4)?;
    checked_product("lse", &lse_shape, 4)?;

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
                    check_view("k_new", kn, 4, NEW_LAYOUT)?;
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
                    check_view("k_new", kn, 3, NEW_LAYOUT)?;
                    let total = kn.shape()[0];
                    check_cu_seqlens("cu_seqlens_k_new", cu, batch + 1, total)?;
                    let (starts, lens) = starts_and_lens(cu);
                    (starts, lens, vec![total, heads_kv, head_dim], NEW_LAYOUT)
                }
            };
            check_view("v_new", vn, nd.len(), layout)?;
            check_dtype("k_new", kn, q.dtype())?;
            check_dtype("v_new", vn, q.dtype())?;
            check_shape("k_new", kn, &nd)?;
            check_shape("v_new", vn, &nd)?;
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
            check_view("rotary_cos", &r.cos, 2, "[seqlen_ro, rotary_dim / 2]")?;
            check_view("rotary_sin", &r.sin, 2, "[seqlen_ro, rotary_dim / 2]")?;
            check_shape("rotary_sin", &r.sin, r.cos.shape())?;
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
            checked_product("rotary_cos", &[batch, n_pos, 2 * half], 4)?;
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
    let distance = alibi_distance((0..batch).map(|b| (q_lens[b], lens[b] + new_lens[b])));
    let alibi = check_alibi(&opts.attn, batch, heads, distance)?;
    let sink = check_sink(&opts.attn, heads)?;

    let q_layout = row_layout(q);
    let seqs = seq_table(lens.iter().enumerate().map(|(b, &len)| Seq {
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
        mask_mod: None,
        score_fn: None,
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
