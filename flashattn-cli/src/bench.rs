//! `flashattn bench`: flashattn against naive (materialising) attention on seeded random data.

use crate::alloc;
use crate::error::{fail, CliError, Result};
use crate::fp8::Fp8Buf;
use crate::peak::{self, Peak};
use crate::threads::with_threads;
use flashattn::decode::SliceMut;
use flashattn::fp8::{self, Fp8Format};
use flashattn::memory::CacheBuf;
use flashattn::tensor::Slice;
use flashattn::{flops, naive, reference, AttnOptions, AttnOutput, Buffer, DType, TensorRef};
use half::{bf16, f16};
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::time::{Duration, Instant};

/// Default sequence lengths. The last one is chosen so that naive attention would need more than
/// 8 GiB for its score and probability matrices (8 · heads · N² bytes = 8.06 GiB at heads 4), which
/// is where the skip rule kicks in and only flashattn runs.
const DEFAULT_SEQLENS: &str = "512,2048,8192,16448";
/// Rows checked against the f64 oracle per measurement.
const ERR_ROWS: usize = 16;
/// Cap on repeats of very short shapes, so `--min-time` is what bounds them in practice.
const MAX_REPS: usize = 1000;
const GIB: f64 = (1u64 << 30) as f64;
const MIB: f64 = (1u64 << 20) as f64;

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
    #[arg(long, value_enum, default_value_t = crate::cuda::Device::Cpu)]
    pub device: crate::cuda::Device,
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

/// The fields every JSON line shares.
#[derive(Serialize, Clone, Debug)]
struct Config {
    dtype: &'static str,
    batch: usize,
    heads: usize,
    heads_kv: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
    causal: bool,
    pass: &'static str,
    threads: usize,
}

/// The first JSON line: what the run's numbers are relative to.
#[derive(Serialize, Debug)]
struct Machine {
    kind: &'static str,
    /// `flashattn::simd::active()`, e.g. "avx512+bf16".
    isa: String,
    threads: usize,
    /// Measured peaks in GFLOP/s on `threads` threads; `null` with --no-peak or where the
    /// instruction is missing.
    peak_f32_gflops: Option<f64>,
    peak_f32_method: Option<&'static str>,
    peak_bf16_gflops: Option<f64>,
    peak_bf16_method: Option<&'static str>,
    /// Which of the two the "peak_fraction" of this run's rows divides by ("f32" or "bf16").
    peak_used: Option<&'static str>,
    peak_secs_per_run: Option<f64>,
    peak_runs: Option<usize>,
}

#[derive(Serialize, Debug)]
struct Measured {
    kind: &'static str,
    #[serde(rename = "impl")]
    implementation: &'static str,
    #[serde(flatten)]
    config: Config,
    skipped: bool,
    median_ms: f64,
    min_ms: f64,
    reps: usize,
    flops: f64,
    gflops: f64,
    peak_extra_bytes: u64,
    /// `null` when not computed.
    max_abs_err: Option<f64>,
    err_rows: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    speedup_vs_naive: Option<f64>,
    /// GFLOP/s over the machine's measured peak for this dtype (see the "machine" line); `null`
    /// with --no-peak.
    peak_fraction: Option<f64>,
}

#[derive(Serialize, Debug)]
struct Skipped {
    kind: &'static str,
    #[serde(rename = "impl")]
    implementation: &'static str,
    #[serde(flatten)]
    config: Config,
    skipped: bool,
    reason: String,
    need_bytes: u64,
}

pub fn bench(args: &BenchArgs) -> Result<()> {
    if let Some(f) = args.dtype.and_then(DtypeArg::fp8) {
        if args.backward {
            return fail(format!(
                "--dtype {f}: FP8 runs the forward and --decode (FP8 KV caches); no --backward"
            ));
        }
    }
    if args.decode {
        return crate::decode::bench(args);
    }
    let cases = validate(args)?;
    if args.device == crate::cuda::Device::Cuda {
        return crate::cuda::bench(&crate::cuda::BenchConfig {
            batch: args.batch,
            heads: args.heads(),
            heads_kv: args.heads_kv(),
            seqlens: cases,
            head_dim: args.head_dim(),
            dtype: args.dtype.unwrap_or(DtypeArg::F32).dtype(),
            fp8: args.dtype.and_then(DtypeArg::fp8),
            causal: args.causal,
            backward: args.backward,
            min_time: args.min_time,
            seed: args.seed,
            json: args.json,
        });
    }
    with_threads(args.threads, || bench_in_pool(args, &cases))?
}

/// Checks the options up front, so a mistake is reported before minutes of benchmarking; returns
/// the (seqlen_q, seqlen_k) pairs.
fn validate(args: &BenchArgs) -> Result<Vec<(usize, usize)>> {
    validate_common(args)?;
    if args.naive_max_gib.is_nan() || args.naive_max_gib < 0.0 {
        return fail(format!(
            "--naive-max-gib {} must be >= 0",
            args.naive_max_gib
        ));
    }
    let seqlen = seqlens(args);
    let (heads, heads_kv, head_dim) = (args.heads(), args.heads_kv(), args.head_dim());
    let ks: Vec<usize> = match args.seqlen_k.len() {
        0 => seqlen.clone(),
        1 => vec![args.seqlen_k[0]; seqlen.len()],
        n if n == seqlen.len() => args.seqlen_k.clone(),
        n => {
            return fail(format!(
                "--seqlen-k has {n} values; give one, or one per --seqlen value ({})",
                seqlen.len()
            ))
        }
    };
    let cases: Vec<(usize, usize)> = seqlen.iter().copied().zip(ks).collect();
    if cases.is_empty() || cases.iter().any(|&(q, k)| q == 0 || k == 0) {
        return fail("--seqlen and --seqlen-k values must be at least 1");
    }
    for &(sq, sk) in &cases {
        let elems = |n: usize, h: usize| {
            [args.batch, n, h, head_dim]
                .iter()
                .try_fold(1usize, |a, &x| a.checked_mul(x))
        };
        if elems(sq, heads).is_none() || elems(sk, heads_kv).is_none() {
            return fail(format!("seqlen {sq}/{sk}: the tensors' sizes overflow"));
        }
    }
    Ok(cases)
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

/// The elements of `shape`, or an error where they pass `usize`.
pub fn numel(shape: &[usize]) -> Result<usize> {
    match shape.iter().try_fold(1usize, |n, &x| n.checked_mul(x)) {
        Some(n) => Ok(n),
        None => fail(format!(
            "shape {shape:?} has more elements than fit in memory"
        )),
    }
}

/// MemAvailable from /proc/meminfo, in bytes; `None` where there is no such file.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Random FP8 values over the format's range (an error naming `what` where the machine cannot
/// hold them).
pub fn random_fp8(
    rng: &mut ChaCha8Rng,
    what: &'static str,
    format: Fp8Format,
    n: usize,
) -> Result<Fp8Buf> {
    let max = format.max();
    Fp8Buf::quantize(what, format, (0..n).map(|_| rng.gen_range(-max..max)))
}

/// A power of two that takes the format's max to 1.75: dequantised values lie in [-1.75, 1.75]
/// and are exact in bf16.
pub fn fp8_descale(format: Fp8Format) -> [f32; 1] {
    [match format {
        Fp8Format::E4M3 => 2f32.powi(-8),
        Fp8Format::E5M2 => 2f32.powi(-15),
    }]
}

/// The dequantised values, in bf16 (exact).
pub fn dequantized(what: &'static str, x: &Fp8Buf) -> Result<Buffer> {
    let s = fp8_descale(x.format())[0];
    let vals = match x {
        Fp8Buf::E4M3(d) => try_vec(what, d.iter().map(|v| bf16::from_f32(v.to_f32() * s)))?,
        Fp8Buf::E5M2(d) => try_vec(what, d.iter().map(|v| bf16::from_f32(v.to_f32() * s)))?,
    };
    Ok(Buffer::BF16(vals))
}

/// The values of `x` in a `Vec`, or an error naming `what` where the allocator refuses them: a
/// benchmark asked for a shape larger than the machine fails with a message, not an abort.
pub fn try_vec<T>(what: &str, x: impl ExactSizeIterator<Item = T>) -> Result<Vec<T>> {
    let mut v = Vec::new();
    let n = x.len();
    if v.try_reserve_exact(n).is_err() {
        let bytes = n.saturating_mul(std::mem::size_of::<T>());
        return fail(format!(
            "out of memory: {bytes} bytes for {what} could not be allocated (choose a smaller shape)"
        ));
    }
    v.extend(x);
    Ok(v)
}

/// `n` random values in [-1, 1) of `dtype` (an error naming `what` where the machine cannot hold
/// them).
pub fn random_buffer(
    rng: &mut ChaCha8Rng,
    what: &'static str,
    n: usize,
    dtype: DType,
) -> Result<Buffer> {
    let vals = (0..n).map(|_| rng.gen_range(-1.0f32..1.0));
    Ok(match dtype {
        DType::F32 => Buffer::F32(try_vec(what, vals)?),
        DType::F16 => Buffer::F16(try_vec(what, vals.map(f16::from_f32))?),
        DType::BF16 => Buffer::BF16(try_vec(what, vals.map(bf16::from_f32))?),
    })
}

/// The values of `x` in a buffer for a KV cache ([`flashattn::memory::CacheBuf`]: on a 2 MiB
/// boundary), advised for transparent huge pages before its first write when `huge`; an error
/// naming `what` where the machine cannot hold them.
pub fn cache_vec<T: Copy>(
    what: &'static str,
    huge: bool,
    x: impl ExactSizeIterator<Item = T>,
) -> Result<CacheBuf<T>> {
    Ok(CacheBuf::try_from_iter_advised(what, x, huge)?)
}

/// A KV cache of the benchmarks in its dtype (see [`cache_vec`]).
pub enum CacheBuffer {
    F32(CacheBuf<f32>),
    F16(CacheBuf<f16>),
    BF16(CacheBuf<bf16>),
}

impl CacheBuffer {
    /// An empty buffer (a placeholder where the caches are FP8).
    pub fn empty() -> Self {
        CacheBuffer::BF16(CacheBuf::default())
    }
    pub fn as_slice(&self) -> Slice<'_> {
        match self {
            CacheBuffer::F32(d) => Slice::F32(d),
            CacheBuffer::F16(d) => Slice::F16(d),
            CacheBuffer::BF16(d) => Slice::BF16(d),
        }
    }
    pub fn slice_mut(&mut self) -> SliceMut<'_> {
        match self {
            CacheBuffer::F32(d) => SliceMut::F32(d),
            CacheBuffer::F16(d) => SliceMut::F16(d),
            CacheBuffer::BF16(d) => SliceMut::BF16(d),
        }
    }
    /// The address range of the buffer's bytes (see [`flashattn::memory::huge_page_bytes_in`]).
    pub fn byte_range(&self) -> std::ops::Range<usize> {
        match self {
            CacheBuffer::F32(d) => flashattn::memory::byte_range(d),
            CacheBuffer::F16(d) => flashattn::memory::byte_range(d),
            CacheBuffer::BF16(d) => flashattn::memory::byte_range(d),
        }
    }
}

/// [`random_buffer`]'s values as a KV cache buffer, in huge pages when `huge` (see
/// [`cache_vec`]).
pub fn random_cache(
    rng: &mut ChaCha8Rng,
    what: &'static str,
    n: usize,
    dtype: DType,
    huge: bool,
) -> Result<CacheBuffer> {
    let vals = (0..n).map(|_| rng.gen_range(-1.0f32..1.0));
    Ok(match dtype {
        DType::F32 => CacheBuffer::F32(cache_vec(what, huge, vals)?),
        DType::F16 => CacheBuffer::F16(cache_vec(what, huge, vals.map(f16::from_f32))?),
        DType::BF16 => CacheBuffer::BF16(cache_vec(what, huge, vals.map(bf16::from_f32))?),
    })
}

pub fn view<'a>(buf: &'a Buffer, shape: &[usize]) -> TensorRef<'a> {
    TensorRef::from_slice(
        buf.as_slice(),
        shape,
        &flashattn::tensor::contiguous_strides(shape),
    )
}

/// One row of the f64 oracle: (batch, head, query row, output row).
struct RefRow {
    b: usize,
    h: usize,
    i: usize,
    out: Vec<f64>,
}

/// Up to [`ERR_ROWS`] rows: (batch, head) pairs taken in turn, query rows spread evenly from the
/// first to the last (the last query sees the most keys, the first the fewest under a causal mask).
fn sample_rows(batch: usize, heads: usize, sq: usize) -> Vec<(usize, usize, usize)> {
    let n = ERR_ROWS.min(batch * heads * sq);
    let mut rows: Vec<(usize, usize, usize)> = (0..n)
        .map(|r| {
            let bh = r % (batch * heads);
            let i = if n > 1 { r * (sq - 1) / (n - 1) } else { 0 };
            (bh / heads, bh % heads, i)
        })
        .collect();
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// Largest |out - reference| over the sampled rows; NaN is reported, not hidden.
fn max_abs_err(
    res: &AttnOutput,
    refs: &[RefRow],
    sq: usize,
    heads: usize,
    d: usize,
) -> Option<f64> {
    if refs.is_empty() {
        return None;
    }
    let buf = res.out.buffer();
    let get = |idx: usize| -> Option<f64> {
        match buf {
            Buffer::F32(v) => v.get(idx).map(|&x| x as f64),
            Buffer::F16(v) => v.get(idx).map(|x| x.to_f64()),
            Buffer::BF16(v) => v.get(idx).map(|x| x.to_f64()),
        }
    };
    let mut worst = 0.0f64;
    for r in refs {
        let base = ((r.b * sq + r.i) * heads + r.h) * d;
        for (x, want) in r.out.iter().enumerate() {
            let e = (get(base + x)? - want).abs();
            if e > worst || e.is_nan() {
                worst = e;
                if e.is_nan() {
                    return Some(f64::NAN);
                }
            }
        }
    }
    Some(worst)
}

pub struct Timing<R> {
    pub median_s: f64,
    pub min_s: f64,
    pub reps: usize,
    pub peak_extra: usize,
    /// The warm-up's result, kept for the accuracy check.
    pub first: R,
}

/// The numbers of a [`Timing`], whatever the call returned.
#[derive(Clone, Copy)]
struct Stats {
    median_s: f64,
    min_s: f64,
    reps: usize,
    peak_extra: usize,
}

impl<R> Timing<R> {
    fn stats(&self) -> Stats {
        Stats {
            median_s: self.median_s,
            min_s: self.min_s,
            reps: self.reps,
            peak_extra: self.peak_extra,
        }
    }
}

/// One timed, memory-counted call. The result is returned so it is dropped outside the timing.
fn timed_call<R>(f: &mut dyn FnMut() -> flashattn::Result<R>) -> Result<(R, f64, usize)> {
    let ((res, secs), peak) = alloc::peak_extra(|| {
        let t = Instant::now();
        let r = f();
        (r, t.elapsed().as_secs_f64())
    });
    Ok((res?, secs, peak))
}

/// A warm-up call (faults in fresh pages, wakes the pool), then timed repeats until `min_time`
/// seconds are spent: at least 3, or 1 when the warm-up alone took `min_time` (long shapes, where
/// a second and third repeat would cost more than they tell).
pub fn measure<R>(min_time: f64, mut f: impl FnMut() -> flashattn::Result<R>) -> Result<Timing<R>> {
    let (first, warm_s, mut peak_extra) = timed_call(&mut f)?;
    let min_reps = if warm_s >= min_time { 1 } else { 3 };
    let mut times = Vec::new();
    let mut spent = 0.0;
    while times.len() < min_reps || (spent < min_time && times.len() < MAX_REPS) {
        let (res, secs, peak) = timed_call(&mut f)?;
        drop(res);
        peak_extra = peak_extra.max(peak);
        times.push(secs);
        spent += secs;
    }
    times.sort_by(f64::total_cmp);
    let n = times.len();
    let median_s = if n % 2 == 1 {
        times[n / 2]
    } else {
        (times[n / 2 - 1] + times[n / 2]) / 2.0
    };
    Ok(Timing {
        median_s,
        min_s: times[0],
        reps: n,
        peak_extra,
        first,
    })
}

/// Why naive attention is skipped at this size, if it is.
fn naive_skip_reason(need: u128, max_gib: f64, avail: Option<u64>) -> Option<String> {
    let need_gib = need as f64 / GIB;
    if need_gib > max_gib {
        return Some(format!(
            "naive attention would need {need_gib:.2} GiB for its score and probability matrices, over --naive-max-gib {max_gib}"
        ));
    }
    let half = avail? as f64 / 2.0 / GIB;
    (need_gib > half).then(|| {
        format!(
            "naive attention would need {need_gib:.2} GiB for its score and probability matrices, over half of MemAvailable ({half:.2} GiB)"
        )
    })
}

pub fn progress(steps: u64) -> ProgressBar {
    let pb = ProgressBar::new(steps);
    if let Ok(style) =
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
    {
        pb.set_style(style);
    }
    // Ticks keep the elapsed time moving during calls that last seconds.
    pb.enable_steady_tick(Duration::from_millis(250));
    pb
}

const TABLE_HEADER: &str =
    "impl       seqlen_q  seqlen_k    median ms     GFLOP/s  % of peak  peak extra MiB  max abs err  speed-up";

fn table_row(m: &Measured) -> String {
    let err = match m.max_abs_err {
        Some(e) => format!("{e:.2e}"),
        None => "n/a".into(),
    };
    let speedup = m
        .speedup_vs_naive
        .map_or(String::new(), |s| format!("{s:.2}x"));
    let of_peak = m
        .peak_fraction
        .map_or("n/a".into(), |f| format!("{:.1}%", 100.0 * f));
    format!(
        "{:<9} {:>9} {:>9} {:>12.3} {:>11.2} {:>10} {:>15.2} {:>12} {:>9}",
        m.implementation,
        m.config.seqlen_q,
        m.config.seqlen_k,
        m.median_ms,
        m.gflops,
        of_peak,
        m.peak_extra_bytes as f64 / MIB,
        err,
        speedup
    )
}

pub fn emit(pb: &ProgressBar, line: String) {
    // Printed between progress-bar frames so the two do not interleave on a terminal.
    pb.suspend(|| println!("{line}"));
}

pub fn to_json<T: Serialize>(x: &T) -> Result<String> {
    serde_json::to_string(x).map_err(|e| CliError(format!("cannot encode a JSON line: {e}")))
}

/// The peak this run's "% of peak" divides by: the bf16 dot-product rate for bf16 when the active
/// kernels multiply bf16 with `vdpbf16ps`, else the f32 FMA rate (f16 is computed in f32).
fn peak_for(peak: &Peak, dtype: DType, bf16_dot: bool) -> Option<(&'static str, f64)> {
    match (dtype, peak.bf16) {
        (DType::BF16, Some(r)) if bf16_dot => Some(("bf16", r.gflops)),
        _ => peak.f32.map(|r| ("f32", r.gflops)),
    }
}

/// The line printed above the table.
fn machine_line(m: &Machine) -> String {
    let rate = |g: Option<f64>, method: Option<&str>| match (g, method) {
        (Some(g), Some(method)) => format!("{g:.1} GFLOP/s ({method})"),
        _ => "unavailable".into(),
    };
    let peaks = match m.peak_runs {
        None => "peak not measured (--no-peak)".to_string(),
        Some(runs) => format!(
            "measured peak f32 {}, bf16 dot {} (best of {runs} runs of {:.2} s on all threads); \
             % of peak against {}",
            rate(m.peak_f32_gflops, m.peak_f32_method),
            rate(m.peak_bf16_gflops, m.peak_bf16_method),
            m.peak_secs_per_run.unwrap_or(0.0),
            m.peak_used.unwrap_or("nothing"),
        ),
    };
    format!("machine: ISA {}, {} threads; {peaks}", m.isa, m.threads)
}

fn bench_in_pool(args: &BenchArgs, cases: &[(usize, usize)]) -> Result<()> {
    let dtype = args.dtype.unwrap_or(DtypeArg::F32).dtype();
    let fp8 = args.dtype.and_then(DtypeArg::fp8);
    let dtype_name = fp8.map_or(dtype.name(), |f| f.name());
    let (batch, heads, d) = (args.batch, args.heads(), args.head_dim());
    let heads_kv = args.heads_kv();
    let threads = rayon::current_num_threads();
    let avail = mem_available();
    let opts = AttnOptions::default().causal(args.causal);
    let run_naive = !args.no_naive;
    let isa = flashattn::simd::active()?;
    let steps = cases.len() as u64 * if run_naive { 2 } else { 1 };
    let pb = progress(steps);

    let peak = if args.no_peak {
        None
    } else {
        pb.set_message("measuring the peak FLOP rate");
        Some(peak::measure(peak::DEFAULT_SECS))
    };
    let used = peak
        .as_ref()
        .and_then(|p| peak_for(p, dtype, isa.has_bf16_dot()));
    let machine = Machine {
        kind: "machine",
        isa: isa.to_string(),
        threads,
        peak_f32_gflops: peak.and_then(|p| p.f32).map(|r| r.gflops),
        peak_f32_method: peak.and_then(|p| p.f32).map(|r| r.method.name()),
        peak_bf16_gflops: peak.and_then(|p| p.bf16).map(|r| r.gflops),
        peak_bf16_method: peak.and_then(|p| p.bf16).map(|r| r.method.name()),
        peak_used: used.map(|u| u.0),
        peak_secs_per_run: peak.map(|_| peak::DEFAULT_SECS),
        peak_runs: peak.map(|_| peak::RUNS),
    };
    let peak_gflops = used.map(|u| u.1);
    emit(
        &pb,
        if args.json {
            to_json(&machine)?
        } else {
            machine_line(&machine)
        },
    );

    if !args.json {
        emit(
            &pb,
            format!(
                "flashattn bench: batch {batch}, heads {heads} (kv {heads_kv}), head_dim {d}, {dtype_name}, {}, {threads} threads; \
                 median of timed repeats after one warm-up; max abs err over {ERR_ROWS} rows vs the f64 reference",
                if args.causal { "causal" } else { "non-causal" }
            ),
        );
        emit(&pb, TABLE_HEADER.into());
    }

    for (n, &(sq, sk)) in cases.iter().enumerate() {
        let config = Config {
            dtype: dtype_name,
            batch,
            heads,
            heads_kv,
            seqlen_q: sq,
            seqlen_k: sk,
            head_dim: d,
            causal: args.causal,
            pass: if args.backward { "fwd+bwd" } else { "fwd" },
            threads,
        };
        pb.set_message(format!("seqlen {sq}x{sk}: preparing inputs"));
        let mut rng = ChaCha8Rng::seed_from_u64(args.seed.wrapping_add(n as u64));
        let (q_shape, kv_shape) = ([batch, sq, heads, d], [batch, sk, heads_kv, d]);
        // FP8: the stored values, and their dequantised bf16 copies (exact: the descale factor
        // is a power of two) for the reference and the naive comparison.
        let (nq, nkv) = (numel(&q_shape)?, numel(&kv_shape)?);
        let fp8_inputs = match fp8 {
            Some(f) => Some((
                random_fp8(&mut rng, "q", f, nq)?,
                random_fp8(&mut rng, "k", f, nkv)?,
                random_fp8(&mut rng, "v", f, nkv)?,
            )),
            None => None,
        };
        let (qb, kb, vb) = match &fp8_inputs {
            Some((q, k, v)) => (
                dequantized("q in bf16", q)?,
                dequantized("k in bf16", k)?,
                dequantized("v in bf16", v)?,
            ),
            None => (
                random_buffer(&mut rng, "q", nq, dtype)?,
                random_buffer(&mut rng, "k", nkv, dtype)?,
                random_buffer(&mut rng, "v", nkv, dtype)?,
            ),
        };
        let dob = random_buffer(&mut rng, "dout", nq, dtype)?;
        let dout = view(&dob, &q_shape);
        let (q, k, v) = (
            view(&qb, &q_shape),
            view(&kb, &kv_shape),
            view(&vb, &kv_shape),
        );
        let refs = sample_rows(batch, heads, sq)
            .into_iter()
            .map(|(b, h, i)| {
                reference::attention_row(&q, &k, &v, &opts, b, h, i).map(|(out, _lse)| RefRow {
                    b,
                    h,
                    i,
                    out,
                })
            })
            .collect::<flashattn::Result<Vec<_>>>()?;
        let fwd_flop = flops::forward(batch, heads, sq, sk, d, args.causal, opts.window);
        let flop = if args.backward {
            fwd_flop + flops::backward(fwd_flop)
        } else {
            fwd_flop
        };
        let record = |name: &'static str, t: Stats, err: Option<f64>| Measured {
            kind: "measurement",
            implementation: name,
            config: config.clone(),
            skipped: false,
            median_ms: t.median_s * 1e3,
            min_ms: t.min_s * 1e3,
            reps: t.reps,
            flops: flop,
            gflops: flop / t.median_s / 1e9,
            peak_extra_bytes: t.peak_extra as u64,
            max_abs_err: err,
            err_rows: refs.len(),
            speedup_vs_naive: None,
            peak_fraction: peak_gflops.map(|p| flop / t.median_s / 1e9 / p),
        };

        pb.set_message(format!("seqlen {sq}x{sk}: flashattn"));
        // Backward mode: forward, then backward from its out and lse (grads dropped inside the
        // timing); the accuracy column still checks the forward's out.
        let flash = measure(args.min_time, || {
            if let Some((q8, k8, v8)) = &fp8_inputs {
                let d = fp8_descale(q8.format());
                let descale = fp8::Descale::default().q(&d).k(&d).v(&d);
                return fp8::flash_attn_fp8(
                    &q8.view(&q_shape),
                    &k8.view(&kv_shape),
                    &v8.view(&kv_shape),
                    &descale,
                    &opts,
                );
            }
            let res = flashattn::flash_attn(&q, &k, &v, &opts)?;
            if args.backward {
                drop(res.backward(&q, &k, &v, &dout, &opts)?);
            }
            Ok(res)
        })?;
        let flash_err = max_abs_err(&flash.first, &refs, sq, heads, d);
        let mut flash_rec = record("flashattn", flash.stats(), flash_err);
        drop(flash);
        pb.inc(1);

        let mut lines = Vec::new();
        if run_naive {
            let need = naive::memory_bytes(batch, heads, sq, sk);
            match naive_skip_reason(need, args.naive_max_gib, avail) {
                Some(reason) => {
                    let skipped = Skipped {
                        kind: "measurement",
                        implementation: "naive",
                        config: config.clone(),
                        skipped: true,
                        need_bytes: u64::try_from(need).unwrap_or(u64::MAX),
                        reason,
                    };
                    lines.push(if args.json {
                        to_json(&skipped)?
                    } else {
                        format!("naive     {sq:>9} {sk:>9}  skipped: {}", skipped.reason)
                    });
                }
                None => {
                    pb.set_message(format!("seqlen {sq}x{sk}: naive"));
                    let naive_rec = if args.backward {
                        // The naive backward computes its own forward (S, P, out) first.
                        let t = measure(args.min_time, || {
                            naive::attention_backward(&q, &k, &v, &dout, &opts)
                        })?;
                        record("naive", t.stats(), None)
                    } else {
                        let t = measure(args.min_time, || naive::attention(&q, &k, &v, &opts))?;
                        let err = max_abs_err(&t.first, &refs, sq, heads, d);
                        record("naive", t.stats(), err)
                    };
                    // With FP8 inputs, naive runs in bf16 on their dequantised values.
                    let mut naive_rec = naive_rec;
                    naive_rec.config.dtype = dtype.name();
                    flash_rec.speedup_vs_naive = Some(naive_rec.median_ms / flash_rec.median_ms);
                    lines.push(if args.json {
                        to_json(&naive_rec)?
                    } else {
                        table_row(&naive_rec)
                    });
                }
            }
            pb.inc(1);
        }
        let flash_line = if args.json {
            to_json(&flash_rec)?
        } else {
            table_row(&flash_rec)
        };
        lines.insert(0, flash_line);
        for line in lines {
            emit(&pb, line);
        }
    }
    pb.finish_and_clear();
    Ok(())
}
