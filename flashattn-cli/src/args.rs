//! The clap argument types that more than one command module reads: `run`'s and `bench`'s
//! flags, the `--device` and `--dtype` values, and the checks of `bench`'s shape flags.

use crate::error::{fail, Result};
use crate::st_io;
use flashattn::fp8::Fp8Format;
use flashattn::{AttnOptions, DType};
use std::path::PathBuf;

/// Default sequence lengths. The last one is chosen so that naive attention would need more than
/// 8 GiB for its score and probability matrices (8 · heads · N² bytes = 8.06 GiB at heads 4), which
/// is where the skip rule kicks in and only flashattn runs.
const DEFAULT_SEQLENS: &str = "512,2048,8192,16448";

/// Where `run` and `bench` compute.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The CPU kernels (SIMD, all cores).
    #[default]
    Cpu,
    /// NVIDIA GPU 0, kernels compiled by NVRTC at first use.
    Cuda,
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Input file with tensors q, k, v (F32, F16 or BF16, all the same; or F8_E4M3 / F8_E5M2,
    /// all the same, with optional F32 q_descale, k_descale, v_descale of 1 or batch · heads_kv
    /// values: forward only, `out` in BF16), optionally alibi_slopes
    /// (F32, [heads] or [batch, heads]) and cu_seqlens_q + cu_seqlens_k (I32; selects the packed
    /// layout q [total_q, heads, d], k/v [total_k, heads_kv, d]; otherwise q is
    /// [batch, seqlen_q, heads, d], k/v [batch, seqlen_k, heads_kv, d]), and optionally dout
    /// (q's shape and dtype), which runs the backward pass too. A file holding k_cache decodes
    /// instead: q, k_cache, v_cache, cache_seqlens (I32) and optionally k_new, v_new,
    /// block_table, cache_batch_idx, cache_leftpad, cu_seqlens_q (I32; packs q as
    /// [total_q, heads, d]), cu_seqlens_k_new (I32; packs k_new/v_new as
    /// [total_k_new, heads_kv, d]), rotary_cos, rotary_sin, alibi_slopes; k_cache and v_cache
    /// may be F8_E4M3 or F8_E5M2 (q and k_new/v_new then stay in their float dtype, with optional
    /// F32 k_descale, v_descale of 1 or batch · heads_kv values; the caches are written back FP8).
    pub input: PathBuf,
    /// Output file: gets `out` (q's dtype and shape) and `lse` (F32), and `dq`, `dk`, `dv` (the
    /// shapes and dtype of q, k, v) when the input holds `dout`, or the updated `k_cache` and
    /// `v_cache` when it holds k_cache. Written only on success,
    /// through a temporary file renamed into place; an existing file is untouched on failure.
    pub output: PathBuf,
    /// Causal mask aligned to the bottom-right corner (same as --window-right 0).
    #[arg(long)]
    pub causal: bool,
    /// Keys visible to the left of the diagonal; -1 = unbounded.
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub window_left: i64,
    /// Keys visible to the right of the diagonal; -1 = unbounded.
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub window_right: i64,
    /// Soft-cap the scores: softcap * tanh(scores / softcap).
    #[arg(long, allow_negative_numbers = true)]
    pub softcap: Option<f32>,
    /// Softmax scale (default 1/sqrt(head_dim)).
    #[arg(long, allow_negative_numbers = true)]
    pub scale: Option<f32>,
    /// Dropout probability on the attention probabilities, in [0, 1) (Philox mask keyed by --seed).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub dropout: f32,
    /// Seed of the dropout mask.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// KV-cache files: rotary embedding in GPT-J style (pairs 2i, 2i+1) instead of GPT-NeoX
    /// (pairs i, i + rotary_dim/2).
    #[arg(long)]
    pub rotary_interleaved: bool,
    /// KV-cache files: number of key splits (default: chosen from the shape and thread count).
    #[arg(long)]
    pub num_splits: Option<usize>,
    /// Where to compute: the CPU, or NVIDIA GPU 0 (the forward and KV-cache decoding; kernels
    /// compiled by NVRTC at first use).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
}

impl RunArgs {
    /// The attention options these flags ask for, with the file's ALiBi slopes and learnable
    /// sinks.
    pub fn attn_options<'a>(
        &self,
        alibi_slopes: Option<&'a st_io::Loaded>,
        learnable_sink: Option<&'a st_io::Loaded>,
    ) -> AttnOptions<'a> {
        AttnOptions {
            softmax_scale: self.scale,
            causal: self.causal,
            window: (self.window_left, self.window_right),
            softcap: self.softcap,
            alibi_slopes: alibi_slopes.map(|a| a.view()),
            learnable_sink: learnable_sink.map(|s| s.view()),
            dropout_p: self.dropout,
            seed: self.seed,
            isa: None,
            cu_seqlens: None,
            descale: None,
            mask_mod: None,
            score_mod: None,
        }
    }
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum DtypeArg {
    F32,
    F16,
    Bf16,
    /// FP8 E4M3 inputs (forward: q, k, v; --decode: the KV caches, with q and out in bf16).
    E4m3,
    /// FP8 E5M2 inputs (as e4m3).
    E5m2,
}

impl DtypeArg {
    /// The dtype the call computes in and returns (bf16 for the FP8 formats).
    pub fn dtype(self) -> DType {
        match self {
            DtypeArg::F32 => DType::F32,
            DtypeArg::F16 => DType::F16,
            DtypeArg::Bf16 | DtypeArg::E4m3 | DtypeArg::E5m2 => DType::BF16,
        }
    }
    pub fn fp8(self) -> Option<Fp8Format> {
        match self {
            DtypeArg::E4m3 => Some(Fp8Format::E4M3),
            DtypeArg::E5m2 => Some(Fp8Format::E5M2),
            _ => None,
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Batch size.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Query heads (default 4; 32 with --decode).
    #[arg(long)]
    pub heads: Option<usize>,
    /// Key/value heads (default: --heads; 8 with --decode); --heads must be a multiple of it.
    #[arg(long)]
    pub heads_kv: Option<usize>,
    /// Query sequence length(s), comma-separated (default 512,2048,8192,16448; with --decode
    /// the new query tokens per step, default 1).
    #[arg(long, value_delimiter = ',')]
    pub seqlen: Vec<usize>,
    /// Key sequence length(s): one for all, or one per --seqlen (default: same as the query's).
    #[arg(long, value_delimiter = ',')]
    pub seqlen_k: Vec<usize>,
    /// Head dimension (1..=256; default 64, 128 with --decode).
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// Element type of q, k, v and out (default f32; with --decode both f32 and bf16).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// Causal mask.
    #[arg(long)]
    pub causal: bool,
    /// With --dtype e4m3|e5m2: descale factors per block of 128 rows (FlashAttention-3's block
    /// quantisation) instead of one per tensor; every block gets the same factor, so the
    /// accuracy column is unchanged and the timing shows the per-block path's cost.
    #[arg(long)]
    pub fp8_per_block: bool,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// One JSON object per line per measurement instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Skip naive attention where its score matrices would need more than this many GiB (it is
    /// also skipped above half of MemAvailable).
    #[arg(long, default_value_t = 4.0)]
    pub naive_max_gib: f64,
    /// Run flashattn only.
    #[arg(long)]
    pub no_naive: bool,
    /// Time forward + backward (pass "fwd+bwd", FLOPs 3.5x the forward's) instead of the forward.
    #[arg(long)]
    pub backward: bool,
    /// Seconds of timed repeats to aim for per measurement (at least 3 repeats, or 1 when a single
    /// call already takes this long), after one warm-up call.
    #[arg(long, default_value_t = 0.5)]
    pub min_time: f64,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Skip measuring the CPU's peak FMA / bf16-dot rate (about 1.5 s) and the "% of peak" column.
    #[arg(long)]
    pub no_peak: bool,
    /// Time decoding with a KV cache instead (flash_attn_with_kvcache: one step appends
    /// --seqlen new tokens to a cache of --cache-len - seqlen tokens and attends all of it):
    /// median time, GB/s of k/v read, and the fraction of this machine's memory read bandwidth,
    /// measured in the same run. Defaults: batch 1, heads 32, kv heads 8, head_dim 128,
    /// cache 32768, f32 and bf16.
    #[arg(long)]
    pub decode: bool,
    /// --decode: cache length(s) in tokens, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "32768")]
    pub cache_len: Vec<usize>,
    /// --decode: a paged cache with this page size (tokens per page) and a shuffled block table.
    #[arg(long)]
    pub page_size: Option<usize>,
    /// --decode: store the cache head-major, `[batch or pages, heads_kv, tokens, d]` (as
    /// llama.cpp lays out a layer's cache), passed to flashattn as a strided view of the usual
    /// `[.., tokens, heads_kv, d]`.
    #[arg(long)]
    pub head_major: bool,
    /// --decode: number of key splits (default: chosen from the shape and thread count).
    #[arg(long)]
    pub num_splits: Option<usize>,
    /// --decode: keep the KV caches (and the 1 GiB buffer the read bandwidth is measured on) in
    /// ordinary 4 KiB pages. By default they are advised for transparent huge pages, as
    /// `flashattn::memory::kv_cache_vec` allocates a cache (Linux; PyTorch does the same with
    /// THP_MEM_ALLOC_ENABLE=1).
    #[arg(long)]
    pub no_huge_pages: bool,
    /// --decode: skip measuring the memory bandwidth (about 3 s at the start and ~0.15 s around
    /// each measurement) and the "% of bandwidth" column.
    #[arg(long)]
    pub no_bandwidth: bool,
    /// Where to run flashattn: the CPU, or NVIDIA GPU 0 (forward only; timed with CUDA events;
    /// no naive baseline there; compare with PyTorch by bench/compare_torch_cuda.py).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
}

impl BenchArgs {
    pub fn heads(&self) -> usize {
        self.heads.unwrap_or(if self.decode { 32 } else { 4 })
    }
    pub fn heads_kv(&self) -> usize {
        self.heads_kv.unwrap_or(if self.decode {
            8.min(self.heads())
        } else {
            self.heads()
        })
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(if self.decode { 128 } else { 64 })
    }
}

/// The query lengths: --seqlen, or the default of the mode.
pub fn seqlens(args: &BenchArgs) -> Vec<usize> {
    if !args.seqlen.is_empty() {
        args.seqlen.clone()
    } else if args.decode {
        vec![1]
    } else {
        DEFAULT_SEQLENS
            .split(',')
            .map(|x| x.parse().expect("a number"))
            .collect()
    }
}

/// Checks shared by both modes: sizes >= 1, heads a multiple of heads_kv, head_dim, min_time.
pub fn validate_common(args: &BenchArgs) -> Result<()> {
    let (heads, heads_kv, head_dim) = (args.heads(), args.heads_kv(), args.head_dim());
    if args.batch == 0 || heads == 0 || heads_kv == 0 {
        return fail("--batch, --heads and --heads-kv must be at least 1");
    }
    if !heads.is_multiple_of(heads_kv) {
        return fail(format!(
            "--heads ({heads}) must be a multiple of --heads-kv ({heads_kv})"
        ));
    }
    if head_dim == 0 || head_dim > flashattn::MAX_HEAD_DIM {
        return fail(format!(
            "--head-dim {head_dim} is out of range 1..={}",
            flashattn::MAX_HEAD_DIM
        ));
    }
    if !(args.min_time >= 0.0 && args.min_time.is_finite()) {
        return fail(format!(
            "--min-time {} must be a finite number >= 0",
            args.min_time
        ));
    }
    Ok(())
}
