//! The plan of a decode call on the GPU: [`DecodeLaunch`], everything its launches pass besides
//! the tensors, computed on the host from a validated call (shared with the host emulation of
//! `kernels/decode.cu`), with the choice of the split kernel ([`DecodeKernel`]) and of the number
//! of key splits ([`choose_splits`]). The uploads and launches are `decode.rs`'s.

use super::arch::GpuShape;
use super::key::{KernelKey, KernelKind};
use super::launch::{sink_table, MAX_GRID_YZ, MAX_SEQLEN};
use super::params;
use crate::decode::KvCacheOptions;
use crate::error::{ErrorKind, Result};
use crate::fp8::{Fp8Format, Fp8TensorRef};
use crate::params::decode::validate;
use crate::params::DecodeParams;
use crate::tensor::{DType, TensorRef, ViewInfo};

/// Entries per launched sequence of the decode kernels' table (decode.cu: DECODE_FIELDS).
pub const DECODE_FIELDS: usize = 10;
/// Query rows of one decode CTA (decode.cu: BLOCK_M).
const DECODE_ROWS: usize = 16;
/// Automatic splits stop at this many keys per split: shorter ones spend more on the merge than
/// they gain in parallelism. (A first choice, not yet measured on a GPU.)
const MIN_SPLIT_KEYS_GPU: usize = 256;

/// Everything the decode launches pass besides the tensors, computed on the host from a validated
/// call: what the GPU path uploads and launches, and what the host emulation of decode.cu
/// (tests/integration/decode/emulated.rs) runs, so both exercise the same argument logic.
/// Returned by [`decode_launch_description_with`] and [`decode_launch_description_fp8`] (the
/// CLI's decode benchmark reports the splits and kernels from it).
#[derive(Clone, Debug)]
pub struct DecodeLaunch {
    pub split: KernelKey,
    pub combine: KernelKey,
    /// Present when the call appends new keys and values.
    pub append: Option<KernelKey>,
    pub splits: usize,
    /// Query row blocks per (sequence, kv head): ceil(max seqlen_q · group / 16).
    pub row_blocks: usize,
    /// Launched sequences: the batch, plus one for packed rows after the last sequence.
    pub seqs: usize,
    pub batch: usize,
    /// DECODE_FIELDS i64 per launched sequence.
    pub table: Vec<i64>,
    /// Page of (sequence, block), `batch · max_blocks` entries.
    pub pages: Vec<i32>,
    /// ALiBi slopes, one row of `heads` per launched sequence.
    pub slopes: Option<Vec<f32>>,
    /// Rotary cos/sin per (sequence, position offset): `rot_half` cos then `rot_half` sin, f32.
    pub rot: Option<Vec<f32>>,
    /// FP8 caches: three factors per (launched sequence, kv head), `3 · (b · heads_kv + hk)`:
    /// the score scale (`softmax_scale · k_descale`, rounded once), k_descale and v_descale.
    pub descale: Option<Vec<f32>>,
    /// Learnable sinks, `heads` logits per launched sequence (-inf for the tail of packed rows),
    /// folded in by `decode_combine`; `None` without sinks.
    pub sink: Option<Vec<f32>>,
    /// The kernels' parameter (all three take the same), its device addresses 0: the launch
    /// fills them in.
    pub params: params::DecodeParams,
    /// Largest seqlen_q of a launched sequence.
    pub max_q: usize,
    pub out_len: usize,
    pub lse_len: usize,
    pub out_shape: Vec<usize>,
    pub lse_shape: Vec<usize>,
}

impl DecodeLaunch {
    /// Grid of `decode_split`.
    pub fn split_grid(&self) -> (u32, u32, u32) {
        (
            (self.row_blocks * self.splits) as u32,
            self.params.heads_kv as u32,
            self.seqs as u32,
        )
    }
    /// Grid of `decode_combine` (a block per output row and 32 dims).
    pub fn combine_grid(&self) -> (u32, u32, u32) {
        (
            (self.max_q * self.params.heads as usize) as u32,
            (self.params.head_dim as usize).div_ceil(32) as u32,
            self.seqs as u32,
        )
    }
    /// Grid of `decode_append`.
    pub fn append_grid(&self) -> (u32, u32, u32) {
        (self.params.heads_kv as u32, 1, 1)
    }
    /// Elements of the partial outputs (f32) and of the partial LSEs.
    pub fn workspace_len(&self) -> (usize, usize) {
        let rows = self.splits * self.params.total_rows as usize;
        (rows * self.params.head_dim as usize, rows)
    }
    /// Nothing to attend: no query row.
    pub fn is_empty(&self) -> bool {
        self.out_len == 0 || self.seqs == 0
    }
}

/// Which `decode_split` kernel a call runs where both could: the tensor-core one (the default
/// since it beat the CUDA-core one at every timed bf16 shape on an H100, 2026-11-26: 1.3-1.6x;
/// f16/bf16 caches, not FP8, head_dim and cache strides multiples of 8 elements) or the CUDA-core
/// one (every other call). `FLASHATTN_CUDA_DECODE=cuda-core` keeps every call on the second (read
/// once per process).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DecodeKernel {
    CudaCore,
    #[default]
    TensorCore,
}

impl DecodeKernel {
    /// `FLASHATTN_CUDA_DECODE`: `cuda-core` for [`DecodeKernel::CudaCore`]; unset or anything
    /// else (`tc`) the default.
    pub fn from_env() -> DecodeKernel {
        static KERNEL: std::sync::OnceLock<DecodeKernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| match std::env::var("FLASHATTN_CUDA_DECODE").as_deref() {
            Ok("cuda-core") => DecodeKernel::CudaCore,
            _ => DecodeKernel::TensorCore,
        })
    }
}

/// CTAs per SM that automatic splits aim for with the CUDA-core split kernel (4 fit an SM by its
/// registers). The first GPU run (H200, 2026-11-26) had two: 264 CTAs of 4 warps for the decode
/// benchmark shape, 12% achieved occupancy, bound by memory latency.
const CTAS_PER_SM: usize = 4;

/// The number of key splits when the call names none: enough CTAs for `CTAS_PER_SM` per SM, but
/// no split shorter than 256 keys (`MIN_SPLIT_KEYS_GPU`) of the longest sequence.
pub fn choose_splits(ctas: usize, max_keys: usize, sm_count: usize) -> usize {
    choose_splits_for(ctas, max_keys, sm_count * CTAS_PER_SM)
}

/// [`choose_splits`] for a kernel of which `slots` CTAs fit the whole device at once (the
/// tensor-core split kernel is held to fewer per SM by its shared memory): one wave of CTAs.
///
/// When the CTAs without splits already fill more than one wave, the last wave may run mostly
/// empty (a batch of 64 sequences x 8 kv heads is 512 CTAs against the tensor-core kernel's 396
/// slots on an H100: two waves, the second 29% full). Then, of the counts up to
/// `MAX_WAVE_SPLITS` whose waves per unit of work, `ceil(ctas · s / slots) / s`, are within 5% of
/// the fewest, the smallest is taken if it saves a tenth or more against no split (512 CTAs: 3
/// splits, 4 waves of a third of the work each, 1.33 against 2). (Decided without a GPU: not yet
/// timed.)
pub fn choose_splits_for(ctas: usize, max_keys: usize, slots: usize) -> usize {
    if ctas == 0 || slots == 0 {
        return 1;
    }
    let by_len = (max_keys / MIN_SPLIT_KEYS_GPU).max(1);
    if ctas <= slots {
        return (slots / ctas).min(by_len).clamp(1, 128);
    }
    // Time per split count in units of one unsplit CTA's: waves x the work of one CTA.
    let time = |s: usize| (ctas * s).div_ceil(slots) as f64 / s as f64;
    let mut counts = 1..=by_len.min(MAX_WAVE_SPLITS);
    let fastest = counts.clone().map(time).fold(f64::INFINITY, f64::min);
    // The fewest splits within 5% of the fastest: each split adds fixed work the count ignores.
    let best = counts.find(|&s| time(s) <= 1.05 * fastest).unwrap_or(1);
    if time(best) <= 0.9 * time(1) {
        best
    } else {
        1
    }
}

/// Most splits [`choose_splits_for`] takes to even out the last wave of a call that fills the
/// GPU without splits (each split adds a partial row per query row to write and merge).
const MAX_WAVE_SPLITS: usize = 8;

pub(super) fn limit(what: &'static str, value: usize, limit: usize) -> Result<()> {
    if value > limit {
        return Err(ErrorKind::CudaLimit {
            what,
            value: value as u64,
            limit: limit as u64,
        }
        .into());
    }
    Ok(())
}

impl DecodeLaunch {
    /// The launches of validated `dp`, on a device of shape `gpu`, with the split kernel `kernel`
    /// where the call allows it (FP8 caches: their format and the k factors per (sequence, kv
    /// head); the score scales and v factors are in `dp.p.descale`); a typed error when a size is
    /// beyond what the kernels address.
    pub(crate) fn new(
        dp: &DecodeParams,
        gpu: GpuShape,
        fp8: Option<(Fp8Format, &[f32])>,
        kernel: DecodeKernel,
    ) -> Result<DecodeLaunch> {
        let p = &dp.p;
        let batch = p.seqs.len();
        let group = p.heads / p.heads_kv;
        // Packed rows after the last sequence: one more sequence that sees no key (out 0,
        // lse -inf), as the forward launches them.
        let used = p.seqs.last().map_or(0, |s| s.out_row0 + s.seqlen_q);
        let tail = (p.packed && used < p.total_q).then_some(used);
        let seqs = batch + tail.is_some() as usize;
        let mut table = Vec::with_capacity(seqs * DECODE_FIELDS);
        for (b, s) in p.seqs.iter().enumerate() {
            let (new_len, kn_base, vn_base) = dp
                .new_kv
                .as_ref()
                .map_or((0, 0, 0), |n| (n.lens[b], n.k_base[b], n.v_base[b]));
            table.extend(
                [
                    s.seqlen_q,
                    s.seqlen_k,
                    dp.leftpad[b],
                    s.q_base,
                    s.out_row0,
                    s.lse_base,
                    dp.cache_seqlens[b],
                    new_len,
                    kn_base,
                    vn_base,
                ]
                .map(|x| x as i64),
            );
        }
        if let Some(used) = tail {
            let rows = p.total_q - used;
            table.extend(
                [rows, 0, 0, used * p.q.row_stride, used, used, 0, 0, 0, 0].map(|x| x as i64),
            );
        }
        let max_q = (0..seqs)
            .map(|b| table[b * DECODE_FIELDS] as usize)
            .max()
            .unwrap_or(0);
        let max_k = p.seqs.iter().map(|s| s.seqlen_k).max().unwrap_or(0);
        for s in &p.seqs {
            limit("seqlen_q", s.seqlen_q, MAX_SEQLEN)?;
            limit("seqlen_k", s.seqlen_k, MAX_SEQLEN)?;
        }
        limit("batch", seqs, MAX_GRID_YZ)?;
        limit("heads_kv", p.heads_kv, MAX_GRID_YZ)?;
        limit("seqlen_q · heads", max_q * p.heads, i32::MAX as usize / 2)?;
        let row_blocks = (max_q * group).div_ceil(DECODE_ROWS);
        let masked = p.window_left.is_some() || p.window_right.is_some();
        // The tensor-core split kernel copies whole 16-byte chunks of both caches' rows.
        let aligned = [
            p.head_dim,
            dp.cache.k_page_stride,
            dp.cache.k.row_stride,
            dp.cache.k.head_stride,
            dp.cache.v_page_stride,
            dp.cache.v.row_stride,
            dp.cache.v.head_stride,
        ]
        .iter()
        .all(|x| x.is_multiple_of(8));
        let mut split = KernelKey {
            kind: KernelKind::DecodeSplit,
            dtype: p.dtype,
            head_dim: KernelKey::padded_head_dim(p.head_dim),
            masked,
            softcap: p.softcap.is_some(),
            alibi: p.alibi.is_some(),
            dropout: false,
            vec_load: kernel == DecodeKernel::TensorCore
                && p.dtype != DType::F32
                && fp8.is_none()
                && aligned,
            fp8: fp8.is_some(),
        };
        if split.smem_bytes() > gpu.smem_optin {
            // A device with less shared memory than the tensor-core kernel's stages need at this
            // head_dim keeps the CUDA-core kernel.
            split.vec_load = false;
        }
        // CTAs of the split kernel resident per SM: the CUDA-core kernel 4 (by its registers);
        // the tensor-core one what this device's shared memory holds (an SM has 1 KiB more than
        // a block may opt in to and keeps 1 KiB per block), at most what it was compiled for.
        let per_sm = if split.decode_tc() {
            ((gpu.smem_optin + 1024) / (split.smem_bytes() + 1024)).clamp(1, split.min_blocks())
        } else {
            CTAS_PER_SM
        };
        let splits = match dp.num_splits {
            // 1..=MAX_NUM_SPLITS, validated with the call.
            Some(n) => n,
            None => choose_splits_for(
                batch * p.heads_kv * row_blocks,
                max_k,
                gpu.sm_count * per_sm,
            ),
        };
        limit(
            "query row blocks · splits",
            row_blocks * splits,
            i32::MAX as usize,
        )?;
        let pages = dp
            .cache
            .pages
            .iter()
            .map(|&x| i32::try_from(x).map_err(|_| ()))
            .collect::<std::result::Result<Vec<i32>, ()>>()
            .map_err(|()| {
                crate::Error::from(ErrorKind::CudaLimit {
                    what: "cache pages",
                    value: dp.cache.pages.iter().copied().max().unwrap_or(0) as u64,
                    limit: i32::MAX as u64,
                })
            })?;
        limit("page_size", dp.cache.page_size, i32::MAX as usize)?;
        let slopes = p.alibi.as_ref().map(|a| {
            let mut a = a.clone();
            a.resize(seqs * p.heads, 0.0); // the tail sequence's row, never used
            a
        });
        // FP8 factors per (launched sequence, kv head); the tail sequence attends nothing.
        let descale = fp8.map(|(_, dk)| {
            let folded = p.descale.as_ref().expect("FP8 calls fold their factors");
            let mut t = Vec::with_capacity(3 * seqs * p.heads_kv);
            for ((&score, &k), &v) in folded.score_scale.iter().zip(dk).zip(&folded.out_scale) {
                t.extend([score, k, v]);
            }
            t.resize(3 * seqs * p.heads_kv, 1.0);
            t
        });
        let side = |w: Option<usize>| w.map_or(-1, |w| w.min(max_q + max_k) as i32);
        let rot = dp.rotary.as_ref();
        let new = dp.new_kv.as_ref();
        Ok(DecodeLaunch {
            split,
            combine: KernelKey::decode_helper(KernelKind::DecodeCombine, p.dtype),
            append: new.map(|_| KernelKey {
                fp8: fp8.is_some(),
                ..KernelKey::decode_helper(KernelKind::DecodeAppend, p.dtype)
            }),
            splits,
            row_blocks,
            seqs,
            batch,
            table,
            pages,
            slopes,
            rot: rot.map(|r| r.table.clone()),
            descale,
            sink: sink_table(p, seqs),
            params: params::DecodeParams {
                batch: batch as i32,
                heads: p.heads as i32,
                heads_kv: p.heads_kv as i32,
                head_dim: p.head_dim as i32,
                splits: splits as i32,
                q_row_stride: p.q.row_stride as i64,
                q_head_stride: p.q.head_stride as i64,
                k_page_stride: dp.cache.k_page_stride as i64,
                k_row_stride: dp.cache.k.row_stride as i64,
                k_head_stride: dp.cache.k.head_stride as i64,
                v_page_stride: dp.cache.v_page_stride as i64,
                v_row_stride: dp.cache.v.row_stride as i64,
                v_head_stride: dp.cache.v.head_stride as i64,
                kn_row_stride: new.map_or(0, |n| n.k.row_stride as i64),
                kn_head_stride: new.map_or(0, |n| n.k.head_stride as i64),
                vn_row_stride: new.map_or(0, |n| n.v.row_stride as i64),
                vn_head_stride: new.map_or(0, |n| n.v.head_stride as i64),
                page_size: dp.cache.page_size as i32,
                max_blocks: dp.cache.max_blocks as i32,
                softmax_scale: p.softmax_scale,
                softcap: p.softcap.unwrap_or(1.0),
                window_left: side(p.window_left),
                window_right: side(p.window_right),
                rot_half: rot.map_or(0, |r| r.half as i32),
                rot_interleaved: rot.is_some_and(|r| r.interleaved) as i32,
                rot_npos: rot.map_or(0, |r| r.n_pos as i32),
                lse_head_stride: p.lse_head_stride as i64,
                total_rows: (p.total_q * p.heads) as i64,
                vec_loads: [
                    p.head_dim,
                    dp.cache.k_page_stride,
                    dp.cache.k.row_stride,
                    dp.cache.k.head_stride,
                ]
                .iter()
                .all(|x| x.is_multiple_of(8)) as i32,
                fp8_e5m2: matches!(fp8, Some((Fp8Format::E5M2, _))) as i32,
                ..Default::default()
            },
            max_q,
            out_len: p.out_len(),
            lse_len: p.lse_len(),
            out_shape: p.out_shape.clone(),
            lse_shape: p.lse_shape.clone(),
        })
    }
}

/// The launches a decode call with these host views and options would make (validated as the
/// call would be) on a device of `sm_count` SMs with the CUDA-core split kernel, which the GPU
/// path runs where the tensor-core one cannot (the rest: [`decode_launch_description_with`]). For
/// the host emulation test of the kernels.
#[cfg(feature = "test-hooks")]
pub fn decode_launch_description(
    q: &TensorRef,
    k_cache: &TensorRef,
    v_cache: &TensorRef,
    cache_seqlens: &[i32],
    opts: &KvCacheOptions,
    sm_count: usize,
) -> Result<DecodeLaunch> {
    let gpu = GpuShape {
        sm_count,
        ..GpuShape::HOPPER
    };
    decode_launch_description_with(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        opts,
        gpu,
        DecodeKernel::CudaCore,
    )
}

/// The launches a decode call with these host views and options would make (validated as the
/// call would be) on a device of shape `gpu`, with the split kernel `kernel` where the call allows
/// it.
pub fn decode_launch_description_with(
    q: &TensorRef,
    k_cache: &TensorRef,
    v_cache: &TensorRef,
    cache_seqlens: &[i32],
    opts: &KvCacheOptions,
    gpu: GpuShape,
    kernel: DecodeKernel,
) -> Result<DecodeLaunch> {
    let new_kv = opts.new_kv.as_ref().map(|(k, v)| (k, v));
    let dp = validate(q, k_cache, v_cache, new_kv, cache_seqlens, opts)?;
    DecodeLaunch::new(&dp, gpu, None, kernel)
}

/// The launches of [`super::flash_attn_with_kvcache_fp8`] with these host views and options
/// (the factors in `opts.attn.descale`) on a device of `sm_count` SMs (validated as that call would be).
pub fn decode_launch_description_fp8(
    q: &TensorRef,
    k_cache: &Fp8TensorRef,
    v_cache: &Fp8TensorRef,
    cache_seqlens: &[i32],
    opts: &KvCacheOptions,
    sm_count: usize,
) -> Result<DecodeLaunch> {
    let (dp, dk) = crate::fp8::validate_kvcache(
        &ViewInfo::of(q),
        (k_cache, v_cache),
        opts.new_kv
            .as_ref()
            .map(|(k, v)| (ViewInfo::of(k), ViewInfo::of(v))),
        cache_seqlens,
        opts,
    )?;
    let gpu = GpuShape {
        sm_count,
        ..GpuShape::HOPPER
    };
    DecodeLaunch::new(
        &dp,
        gpu,
        Some((k_cache.format(), &dk)),
        DecodeKernel::CudaCore,
    )
}

#[cfg(test)]
mod tests {
    use super::{choose_splits, choose_splits_for};

    #[test]
    fn split_count_rule() {
        // The decode benchmark shape (32 heads over 8, 32k keys) on an H100 (132 SMs): 8 CTAs without splits; 66 fill four per SM.
        assert_eq!(choose_splits(8, 32768, 132), 66);
        // A short cache keeps splits of at least 256 keys.
        assert_eq!(choose_splits(8, 1000, 132), 3);
        assert_eq!(choose_splits(8, 100, 132), 1);
        // A batch of 64 sequences already fills the GPU (528 slots of the CUDA-core kernel).
        assert_eq!(choose_splits(64 * 8, 2048, 132), 1);
        // The tensor-core kernel's 396 slots: two waves, the second 29% full; 3 splits make 4
        // waves of a third of the work each (1.33 against 2 unsplit CTA times).
        assert_eq!(choose_splits_for(64 * 8, 2048, 396), 3);
        // Not when the sequences are too short to split (256 keys at least per split)...
        assert_eq!(choose_splits_for(64 * 8, 300, 396), 1);
        // 800 CTAs on 396 slots: 3 waves unsplit, the last 2% full; 8 splits would take 2.125,
        // 5 splits 11 waves of a fifth (2.2) is the fewest within 5% of that.
        assert_eq!(choose_splits_for(800, 4096, 396), 5);
        // 1000 CTAs: 3 waves (84% full); 7 splits 2.571, 3 splits 8 / 3 = 2.667 within 5%.
        assert_eq!(choose_splits_for(1000, 4096, 396), 3);
        // 790 CTAs: 2 waves nearly full; no count does better.
        assert_eq!(choose_splits_for(790, 4096, 396), 1);
        // The gain must be a tenth: 713 CTAs, 2 waves (90% full); 6 splits 11 / 6 = 1.833,
        // 0.92 of 2: not taken.
        assert_eq!(choose_splits_for(713, 4096, 396), 1);
        // Never more than 128, never 0.
        assert_eq!(choose_splits(1, 1 << 24, 1000), 128);
        assert_eq!(choose_splits(0, 0, 132), 1);
    }
}
