//! Decoding with a KV cache from the command line: `flashattn run` on a file that holds
//! `k_cache`/`v_cache`, and `flashattn bench --decode` (time, GB/s of k/v read, and the fraction
//! of this machine's memory bandwidth, measured in the same run: once at the start, and again
//! around each measurement).

use crate::bench::{self, view, BenchArgs, DtypeArg};
use crate::error::{fail, CliError, Result};
use crate::fp8::Fp8Buf;
use crate::run::{self, RunArgs};
use crate::st_io::{self, Loaded};
use crate::threads::with_threads;
use flashattn::decode::SliceMut;
use flashattn::fp8::{flash_attn_with_kvcache_fp8, Descale};
use flashattn::{
    flash_attn_with_kvcache, reference, AttnOptions, BlockTable, Buffer, DType, KvCacheOptions,
    TensorMut,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

// ---------------------------------------------------------------------------------------------
// flashattn run (KV cache files)
// ---------------------------------------------------------------------------------------------

/// Tensor names of a KV-cache input file; anything else is rejected (a typo must not silently
/// change the computation).
pub const ACCEPTED: [&str; 17] = [
    "q",
    "k_cache",
    "v_cache",
    "cache_seqlens",
    "k_new",
    "v_new",
    "block_table",
    "cache_batch_idx",
    "cache_leftpad",
    "cu_seqlens_q",
    "cu_seqlens_k_new",
    "rotary_cos",
    "rotary_sin",
    "alibi_slopes",
    "learnable_sink",
    "k_descale",
    "v_descale",
];

/// Whether `path` is a safetensors file whose header names a `k_cache` tensor (read from the
/// header alone). Any problem answers `false`, and the ordinary loader reports it.
pub fn is_kvcache_file(path: &Path) -> bool {
    st_io::header(path).is_some_and(|m| m.contains_key("k_cache"))
}

/// An I32 tensor of the expected rank, as (shape, values).
fn decode_i32(
    name: &str,
    t: &TensorView,
    rank: usize,
    layout: &str,
) -> Result<(Vec<usize>, Vec<i32>)> {
    if t.dtype() != Dtype::I32 {
        return fail(format!(
            "tensor `{name}` has dtype {:?}, expected I32",
            t.dtype()
        ));
    }
    if t.shape().len() != rank {
        return fail(format!(
            "tensor `{name}` has shape {:?}, expected rank {rank} {layout}",
            t.shape()
        ));
    }
    let vals = t
        .data()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((t.shape().to_vec(), vals))
}

/// `flashattn run` on a KV-cache file: appends `k_new`/`v_new` (if present) to the caches,
/// attends, and writes `out`, `lse` and the updated `k_cache`, `v_cache` to OUT.
pub fn run(args: &RunArgs) -> Result<()> {
    let shown = args.input.display();
    let bytes = st_io::read(&args.input)?;
    let st = st_io::parse(&bytes, &shown, &ACCEPTED, " in a KV-cache file")?;
    let get = |name: &str| st_io::tensor(&st, name, &shown);
    let float = |name: &str| -> Result<Option<Loaded>> {
        get(name)?
            .map(|t| st_io::decode_float(name, &t))
            .transpose()
    };
    let required = |name: &str| -> Result<Loaded> {
        float(name)?.ok_or_else(|| {
            CliError(format!(
                "{shown}: missing tensor `{name}` (q, k_cache, v_cache and cache_seqlens are required)"
            ))
        })
    };
    let q = required("q")?;
    // FP8 caches (F8_E4M3 / F8_E5M2, with optional `k_descale`/`v_descale`), or caches in q's dtype.
    let fp8 = get("k_cache")?.is_some_and(|t| matches!(t.dtype(), Dtype::F8_E4M3 | Dtype::F8_E5M2));
    let descale = |name: &str| -> Result<Option<Vec<f32>>> {
        let t = get(name)?;
        if t.is_some() && !fp8 {
            return fail(format!(
                "tensor `{name}` applies to FP8 caches only, and `k_cache` is not F8_E4M3 or F8_E5M2"
            ));
        }
        t.map(|t| crate::fp8::decode_descale(name, &t)).transpose()
    };
    let (k_descale, v_descale) = (descale("k_descale")?, descale("v_descale")?);
    let mut caches = if fp8 {
        let load = |name: &str| -> Result<Fp8Cache> {
            let t = get(name)?.ok_or_else(|| {
                CliError(format!("{shown}: missing tensor `{name}` (q, k_cache, v_cache and cache_seqlens are required)"))
            })?;
            let why = "but `k_cache` is FP8: both caches must be F8_E4M3 or F8_E5M2";
            Ok((Fp8Buf::load(name, &t, why)?, t.shape().to_vec()))
        };
        Caches::Fp8(load("k_cache")?, load("v_cache")?)
    } else {
        Caches::Float(required("k_cache")?, required("v_cache")?)
    };
    let cache_seqlens = match get("cache_seqlens")? {
        Some(t) => decode_i32("cache_seqlens", &t, 1, "[batch]")?.1,
        None => {
            return fail(format!(
                "{shown}: missing tensor `cache_seqlens` (q, k_cache, v_cache and cache_seqlens are required)"
            ))
        }
    };
    let k_new = float("k_new")?;
    let v_new = float("v_new")?;
    let (cos, sin) = (float("rotary_cos")?, float("rotary_sin")?);
    let alibi = float("alibi_slopes")?;
    let sink = float("learnable_sink")?;
    for (name, t) in [("alibi_slopes", &alibi), ("learnable_sink", &sink)] {
        if let Some(a) = t {
            if a.buf.dtype() != DType::F32 {
                return fail(format!(
                    "tensor `{name}` has dtype {}, expected F32",
                    a.buf.dtype()
                ));
            }
        }
    }
    // The optional I32 tensors: (shape, values).
    let index = |name: &str, rank: usize, layout: &str| -> Result<Option<(Vec<usize>, Vec<i32>)>> {
        get(name)?
            .map(|t| decode_i32(name, &t, rank, layout))
            .transpose()
    };
    let block_table = index("block_table", 2, "[batch, max_blocks_per_seq]")?;
    let batch_idx = index("cache_batch_idx", 1, "[batch]")?;
    let leftpad = index("cache_leftpad", 1, "[batch]")?;
    let cu_q = index("cu_seqlens_q", 1, "[batch + 1]")?;
    let cu_new = index("cu_seqlens_k_new", 1, "[batch + 1]")?;

    let mut opts = KvCacheOptions::default().attn(args.attn_options(alibi.as_ref(), sink.as_ref()));
    opts.num_splits = args.num_splits;
    match (&k_new, &v_new) {
        (Some(k), Some(v)) => opts = opts.new_kv(k.view(), v.view()),
        (None, None) => {}
        (Some(_), None) => {
            return fail("tensor `k_new` is present without `v_new`; appending needs both")
        }
        (None, Some(_)) => {
            return fail("tensor `v_new` is present without `k_new`; appending needs both")
        }
    }
    match (&cos, &sin) {
        (Some(c), Some(s)) => opts = opts.rotary(c.view(), s.view(), args.rotary_interleaved),
        (None, None) => {}
        (Some(_), None) => return fail("tensor `rotary_cos` is present without `rotary_sin`"),
        (None, Some(_)) => return fail("tensor `rotary_sin` is present without `rotary_cos`"),
    }
    if let Some((shape, data)) = &block_table {
        opts = opts.block_table(BlockTable::new(data, shape[0], shape[1]));
    }
    if let Some((_, idx)) = &batch_idx {
        opts = opts.cache_batch_idx(idx);
    }
    if let Some((_, lp)) = &leftpad {
        opts = opts.cache_leftpad(lp);
    }
    if let Some((_, cu)) = &cu_q {
        opts = opts.cu_seqlens_q(cu);
    }
    if let Some((_, cu)) = &cu_new {
        opts = opts.cu_seqlens_k_new(cu);
    }

    let (k_cache, v_cache) = match &mut caches {
        Caches::Float(k, v) => (k, v),
        Caches::Fp8(k, v) => {
            let descale = Descale {
                q: None,
                k: k_descale.as_deref(),
                v: v_descale.as_deref(),
            };
            return run_fp8_caches(args, &q, (k, v), &cache_seqlens, &descale, &opts);
        }
    };
    run::write_atomically(&args.output, || {
        let (k_shape, v_shape) = (k_cache.shape.clone(), v_cache.shape.clone());
        let res = if args.device == crate::cuda::Device::Cuda {
            crate::cuda::decode_run(&q, k_cache, v_cache, &cache_seqlens, &opts)?
        } else {
            with_threads(args.threads, || {
                let mut k = TensorMut::contiguous(slice_mut(&mut k_cache.buf), &k_shape);
                let mut v = TensorMut::contiguous(slice_mut(&mut v_cache.buf), &v_shape);
                flash_attn_with_kvcache(&q.view(), &mut k, &mut v, &cache_seqlens, &opts)
            })??
        };
        st_io::serialize_named(&[
            ("out", res.out.buffer(), res.out.shape()),
            ("lse", res.lse.buffer(), res.lse.shape()),
            ("k_cache", &k_cache.buf, &k_shape),
            ("v_cache", &v_cache.buf, &v_shape),
        ])
    })
}

/// `run` on FP8 caches: the call (on the CPU, or on GPU 0 with `--device cuda`), then `out`,
/// `lse` and the caches, written back FP8.
fn run_fp8_caches(
    args: &RunArgs,
    q: &Loaded,
    ((k, k_shape), (v, v_shape)): (&mut Fp8Cache, &mut Fp8Cache),
    cache_seqlens: &[i32],
    descale: &Descale,
    opts: &KvCacheOptions,
) -> Result<()> {
    run::write_atomically(&args.output, || {
        let res = if args.device == crate::cuda::Device::Cuda {
            crate::cuda::decode_run_fp8(
                q,
                ((&mut *k, k_shape), (&mut *v, v_shape)),
                cache_seqlens,
                descale,
                opts,
            )?
        } else {
            with_threads(args.threads, || {
                let strides = |s: &[usize]| flashattn::tensor::contiguous_strides(s);
                let mut kt = k.view_mut(k_shape, &strides(k_shape));
                let mut vt = v.view_mut(v_shape, &strides(v_shape));
                flash_attn_with_kvcache_fp8(
                    &q.view(),
                    &mut kt,
                    &mut vt,
                    cache_seqlens,
                    descale,
                    opts,
                )
            })??
        };
        let (out, lse) = (
            st_io::buffer_bytes(res.out.buffer()),
            st_io::buffer_bytes(res.lse.buffer()),
        );
        let (kc, vc) = (k.encoded(), v.encoded());
        st_io::serialize_encoded(&[
            ("out", out.0, res.out.shape(), out.1),
            ("lse", lse.0, res.lse.shape(), lse.1),
            ("k_cache", kc.0, k_shape, kc.1),
            ("v_cache", vc.0, v_shape, vc.1),
        ])
    })
}

/// An FP8 cache from a file: its values and shape.
type Fp8Cache = (Fp8Buf, Vec<usize>);

/// The caches of a KV-cache file: in q's dtype, or FP8.
enum Caches {
    Float(Loaded, Loaded),
    Fp8(Fp8Cache, Fp8Cache),
}

fn slice_mut(b: &mut Buffer) -> SliceMut<'_> {
    match b {
        Buffer::F32(d) => SliceMut::F32(d),
        Buffer::F16(d) => SliceMut::F16(d),
        Buffer::BF16(d) => SliceMut::BF16(d),
    }
}

// ---------------------------------------------------------------------------------------------
// Memory bandwidth
// ---------------------------------------------------------------------------------------------

/// Size of the buffers the bandwidth is measured on: far past every cache (L3 is 32 MiB on Zen 4).
const BW_BYTES: usize = 1 << 30;
/// Timed runs of each measurement (after one warm-up); the median is reported.
const BW_RUNS: usize = 5;
/// Work unit of the parallel loops: 4 MiB, 256 units over 1 GiB.
const BW_CHUNK: usize = (4 << 20) / 8;

/// This machine's memory bandwidth on the current rayon pool, GB/s (1e9 bytes/s).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Bandwidth {
    /// Median rate of summing a 1 GiB buffer (u64, all threads): reads only, like decoding.
    pub read_gbps: f64,
    /// Median rate of copying 1 GiB into another 1 GiB buffer, counted as bytes copied per
    /// second (the memory traffic is at least twice that).
    pub copy_gbps: f64,
    pub bytes: usize,
    pub runs: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Sum of a chunk with 8 independent lanes (vectorised by the compiler; memory-bound anyway).
fn sum_chunk(c: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut it = c.chunks_exact(8);
    for x in &mut it {
        for (a, y) in acc.iter_mut().zip(x) {
            *a = a.wrapping_add(*y);
        }
    }
    it.remainder()
        .iter()
        .chain(&acc)
        .fold(0u64, |s, y| s.wrapping_add(*y))
}

/// A 1 GiB buffer (every page written, so mapped) whose summing on all threads measures the
/// read rate: once at the start ([`measure_bandwidth`]), and again around each measurement
/// ([`ReadProbe::around`]), since a shared host's rate drifts over seconds.
pub struct ReadProbe {
    src: flashattn::memory::CacheBuf<u64>,
}

/// Read samples taken just before and just after each decode measurement (each ~35-40 ms).
const AROUND_RUNS: usize = 2;

impl ReadProbe {
    /// `huge`: the buffer advised for transparent huge pages, as the KV caches are (a
    /// sequential read measured as fast in either kind of page; see flashattn::memory).
    /// An error where the machine cannot hold the buffer (`--no-bandwidth` skips the probe).
    pub fn new(huge: bool) -> Result<ReadProbe> {
        // Element j of chunk i (BW_CHUNK elements each) holds (i ^ j) | 1, written once.
        let values = (0..BW_BYTES / 8).map(|x| ((x / BW_CHUNK) ^ (x % BW_CHUNK)) as u64 | 1);
        let what = "the bandwidth probe's buffer (--no-bandwidth skips it)";
        Ok(ReadProbe {
            src: crate::bench::cache_vec(what, huge, values)?,
        })
    }

    /// One timed sum of the buffer: GB/s.
    fn read_once(&self) -> f64 {
        let t = Instant::now();
        let s = self
            .src
            .par_chunks(BW_CHUNK)
            .map(sum_chunk)
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(s);
        BW_BYTES as f64 / t.elapsed().as_secs_f64() / 1e9
    }

    /// Runs `f` between [`AROUND_RUNS`] read samples before and as many after; returns its
    /// result and the median of the samples.
    pub fn around<R>(&self, f: impl FnOnce() -> R) -> (R, f64) {
        let mut reads: Vec<f64> = (0..AROUND_RUNS).map(|_| self.read_once()).collect();
        let r = f();
        reads.extend((0..AROUND_RUNS).map(|_| self.read_once()));
        (r, median(reads))
    }
}

/// Measures [`Bandwidth`] with `probe`'s buffer and a second one to copy into: `BW_RUNS + 1`
/// sums and copies, the first of each discarded. About 3 s on the 2-core machine.
pub fn measure_bandwidth(probe: &ReadProbe) -> Result<Bandwidth> {
    let src = &probe.src;
    let what = "the bandwidth probe's copy (--no-bandwidth skips it)";
    let mut dst = bench::try_vec(what, std::iter::repeat_n(0u64, src.len()))?;
    dst.par_chunks_mut(BW_CHUNK).for_each(|c| c.fill(1));
    let mut reads = Vec::new();
    let mut copies = Vec::new();
    for run in 0..=BW_RUNS {
        let read_gbps = probe.read_once();
        let t = Instant::now();
        dst.par_chunks_mut(BW_CHUNK)
            .zip(src.par_chunks(BW_CHUNK))
            .for_each(|(d, s)| d.copy_from_slice(s));
        std::hint::black_box(&dst);
        let copy = t.elapsed().as_secs_f64();
        if run > 0 {
            reads.push(read_gbps);
            copies.push(BW_BYTES as f64 / copy / 1e9);
        }
    }
    Ok(Bandwidth {
        read_gbps: median(reads),
        copy_gbps: median(copies),
        bytes: BW_BYTES,
        runs: BW_RUNS,
    })
}

// ---------------------------------------------------------------------------------------------
// flashattn bench --decode
// ---------------------------------------------------------------------------------------------

#[derive(Serialize, Debug)]
struct Machine {
    kind: &'static str,
    isa: String,
    threads: usize,
    /// `null` with --no-bandwidth.
    bandwidth: Option<Bandwidth>,
    /// What each measurement's "bandwidth_fraction" divides by.
    bandwidth_used: Option<&'static str>,
}

#[derive(Serialize, Debug)]
struct Measured {
    kind: &'static str,
    #[serde(rename = "impl")]
    implementation: &'static str,
    pass: &'static str,
    dtype: &'static str,
    batch: usize,
    heads: usize,
    heads_kv: usize,
    head_dim: usize,
    seqlen_q: usize,
    cache_len: usize,
    page_size: Option<usize>,
    head_major: bool,
    /// `null`: automatic.
    num_splits: Option<usize>,
    causal: bool,
    threads: usize,
    median_ms: f64,
    min_ms: f64,
    reps: usize,
    /// Bytes of k and v one call reads: batch · cache_len · heads_kv · head_dim · 2 · element size.
    kv_bytes: f64,
    gbps: f64,
    /// The read rate measured around this measurement: median of 2 samples just before and 2
    /// just after it (the machine line's figure is from the start of the run); `null` with
    /// --no-bandwidth.
    read_gbps_around: Option<f64>,
    /// gbps / read_gbps_around; `null` with --no-bandwidth.
    bandwidth_fraction: Option<f64>,
    peak_extra_bytes: u64,
    /// Largest |out - f64 reference| over a few sampled rows (contiguous caches only).
    max_abs_err: Option<f64>,
    /// Bytes of huge pages backing the k and v caches' mappings, each counted once (Linux
    /// `/proc/self/smaps`); `null` where unknown. 0 with --no-huge-pages unless the system gives huge pages to every
    /// mapping (THP `always`).
    huge_page_bytes: Option<usize>,
}

const TABLE_HEADER: &str =
    "dtype   cache_len  seqlen_q    median ms   KV GB/s  % of read bw  max abs err  huge pages";

fn table_row(m: &Measured) -> String {
    format!(
        "{:<6} {:>10} {:>9} {:>12.3} {:>9.2} {:>13} {:>12} {:>11}",
        m.dtype,
        m.cache_len,
        m.seqlen_q,
        m.median_ms,
        m.gbps,
        m.bandwidth_fraction
            .map_or("n/a".into(), |f| format!("{:.1}%", 100.0 * f)),
        m.max_abs_err.map_or("n/a".into(), |e| format!("{e:.2e}")),
        // The share of the k/v bytes in huge pages (a mapping can reach past a small cache).
        m.huge_page_bytes.map_or("n/a".into(), |b| format!(
            "{:.0}%",
            (100.0 * b as f64 / m.kv_bytes).min(100.0)
        )),
    )
}

/// `flashattn bench --decode`.
pub fn bench(args: &BenchArgs) -> Result<()> {
    bench::validate_common(args)?;
    let sqs = bench::seqlens(args);
    if sqs.contains(&0) || args.cache_len.contains(&0) {
        return fail("--seqlen and --cache-len values must be at least 1");
    }
    if let Some((&sq, &cap)) = sqs
        .iter()
        .flat_map(|s| args.cache_len.iter().map(move |c| (s, c)))
        .find(|(s, c)| s > c)
    {
        return fail(format!(
            "--seqlen {sq} is longer than --cache-len {cap}: each step appends seqlen tokens to the cache"
        ));
    }
    if args.page_size == Some(0) {
        return fail("--page-size must be at least 1");
    }
    if args.num_splits == Some(0) {
        return fail("--num-splits must be at least 1 (leave it out for automatic)");
    }
    if args.device == crate::cuda::Device::Cuda {
        return crate::cuda::bench_decode(args, &sqs);
    }
    with_threads(args.threads, || bench_in_pool(args, &sqs))?
}

fn bench_in_pool(args: &BenchArgs, sqs: &[usize]) -> Result<()> {
    let dtypes: Vec<DType> = match args.dtype {
        Some(d) => vec![d.dtype()],
        None => vec![DtypeArg::F32.dtype(), DtypeArg::Bf16.dtype()],
    };
    let (batch, heads, heads_kv, d) = (args.batch, args.heads(), args.heads_kv(), args.head_dim());
    let threads = rayon::current_num_threads();
    let cases = dtypes.len() * args.cache_len.len() * sqs.len();
    let pb = bench::progress(cases as u64);
    let probe = match args.no_bandwidth {
        true => None,
        false => Some(ReadProbe::new(!args.no_huge_pages)?),
    };
    let bandwidth = match &probe {
        Some(p) => {
            pb.set_message("measuring the memory bandwidth (1 GiB read and copy)");
            Some(measure_bandwidth(p)?)
        }
        None => None,
    };
    let machine = Machine {
        kind: "machine",
        isa: flashattn::simd::active()?.to_string(),
        threads,
        bandwidth,
        bandwidth_used: bandwidth.map(|_| "read_gbps_around"),
    };
    if args.json {
        bench::emit(&pb, bench::to_json(&machine)?);
    } else {
        let bw = match bandwidth {
            Some(b) => format!(
                "memory bandwidth: read {:.1} GB/s, copy {:.1} GB/s (1 GiB buffers, median of {} runs, all threads); \
                 % of read bw against the read rate measured again around each row",
                b.read_gbps, b.copy_gbps, b.runs
            ),
            None => "memory bandwidth not measured (--no-bandwidth)".into(),
        };
        bench::emit(
            &pb,
            format!("machine: ISA {}, {threads} threads; {bw}", machine.isa),
        );
        bench::emit(
            &pb,
            format!(
                "flashattn bench --decode: batch {batch}, heads {heads} (kv {heads_kv}), head_dim {d}, {}{}{}, \
                 {threads} threads; each step appends seqlen_q tokens and attends the whole cache; \
                 median of timed repeats after one warm-up",
                if args.causal { "causal" } else { "non-causal" },
                args.page_size
                    .map_or(String::new(), |p| format!(", paged ({p} tokens per page)")),
                if args.head_major { ", head-major cache" } else { "" }
            ),
        );
        bench::emit(&pb, TABLE_HEADER.into());
    }
    for &dtype in &dtypes {
        for (ci, &cap) in args.cache_len.iter().enumerate() {
            for &sq in sqs {
                pb.set_message(format!("{dtype} cache {cap} seqlen_q {sq}"));
                // --dtype e4m3|e5m2: FP8 caches; dtype (q, new keys, out) is then bf16.
                let m = bench_one(
                    args,
                    dtype,
                    cap,
                    sq,
                    args.seed.wrapping_add(ci as u64),
                    probe.as_ref(),
                )?;
                bench::emit(
                    &pb,
                    if args.json {
                        bench::to_json(&m)?
                    } else {
                        table_row(&m)
                    },
                );
                pb.inc(1);
            }
        }
    }
    pb.finish_and_clear();
    Ok(())
}

fn bench_one(
    args: &BenchArgs,
    dtype: DType,
    cap: usize,
    sq: usize,
    seed: u64,
    probe: Option<&ReadProbe>,
) -> Result<Measured> {
    let (batch, heads, heads_kv, d) = (args.batch, args.heads(), args.heads_kv(), args.head_dim());
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let numel = |dims: &[usize]| -> Result<usize> {
        dims.iter()
            .try_fold(1usize, |a, &x| a.checked_mul(x))
            .ok_or_else(|| CliError(format!("shape {dims:?} overflows")))
    };
    // Paged: cap.div_ceil(ps) pages per sequence, handed out in shuffled order.
    let (pages, page_rows, table, max_blocks) = match args.page_size {
        None => (batch, cap, Vec::new(), 1),
        Some(ps) => {
            let max_blocks = cap.div_ceil(ps);
            let n = batch * max_blocks;
            let mut table: Vec<i32> = (0..n as i32).collect();
            table.shuffle(&mut rng);
            (n, ps, table, max_blocks)
        }
    };
    let cache_shape = [pages, page_rows, heads_kv, d];
    // Element strides of the cache: flash-attn's row-major layout, or head-major storage.
    let cache_strides = if args.head_major {
        vec![heads_kv * page_rows * d, d, page_rows * d, 1]
    } else {
        flashattn::tensor::contiguous_strides(&cache_shape)
    };
    let q_shape = [batch, sq, heads, d];
    let new_shape = [batch, sq, heads_kv, d];
    let qb = bench::random_buffer(&mut rng, "q", numel(&q_shape)?, dtype)?;
    let kn = bench::random_buffer(&mut rng, "k_new", numel(&new_shape)?, dtype)?;
    let vn = bench::random_buffer(&mut rng, "v_new", numel(&new_shape)?, dtype)?;
    // FP8 caches: random values over the format's range, dequantised by a power of two to
    // [-1.75, 1.75] (so the accuracy check reads them exactly in bf16).
    let fp8 = args.dtype.and_then(DtypeArg::fp8);
    let huge = !args.no_huge_pages;
    let descale = fp8.map(bench::fp8_descale);
    let n_cache = numel(&cache_shape)?;
    let mut caches8 = match fp8 {
        Some(f) => {
            let mut draw = |what| {
                let max = f.max();
                let x = (0..n_cache).map(|_| rng.gen_range(-max..max));
                Fp8Buf::quantize_cache(what, f, x, huge)
            };
            Some((draw("k_cache")?, draw("v_cache")?))
        }
        None => None,
    };
    let (mut kc, mut vc) = if fp8.is_some() {
        (bench::CacheBuffer::empty(), bench::CacheBuffer::empty())
    } else {
        (
            bench::random_cache(&mut rng, "k_cache", n_cache, dtype, huge)?,
            bench::random_cache(&mut rng, "v_cache", n_cache, dtype, huge)?,
        )
    };
    // How much of the caches the kernel backed with huge pages (Linux; a hint it may not honour).
    let huge_page_bytes = flashattn::memory::huge_page_bytes_in(&match &caches8 {
        Some((k8, v8)) => [k8.byte_range(), v8.byte_range()],
        None => [kc.byte_range(), vc.byte_range()],
    });
    let lens = vec![(cap - sq) as i32; batch];
    let attn = AttnOptions::default().causal(args.causal);
    let mut opts = KvCacheOptions::default()
        .attn(attn.clone())
        .new_kv(view(&kn, &new_shape), view(&vn, &new_shape));
    opts.num_splits = args.num_splits;
    if args.page_size.is_some() {
        opts = opts.block_table(BlockTable::new(&table, batch, max_blocks));
    }
    let q = view(&qb, &q_shape);
    let (timing, read_gbps_around) = {
        let mut time_steps = || match (&mut caches8, &descale) {
            (Some((k8, v8)), Some(s)) => {
                let mut k = k8.view_mut(&cache_shape, &cache_strides);
                let mut v = v8.view_mut(&cache_shape, &cache_strides);
                let descale = Descale::default().k(s).v(s);
                bench::measure(args.min_time, || {
                    flash_attn_with_kvcache_fp8(&q, &mut k, &mut v, &lens, &descale, &opts)
                })
            }
            _ => {
                let mut k = TensorMut::new(kc.slice_mut(), &cache_shape, &cache_strides);
                let mut v = TensorMut::new(vc.slice_mut(), &cache_shape, &cache_strides);
                bench::measure(args.min_time, || {
                    flash_attn_with_kvcache(&q, &mut k, &mut v, &lens, &opts)
                })
            }
        };
        match probe {
            Some(p) => {
                let (t, read) = p.around(time_steps);
                (t?, Some(read))
            }
            None => (time_steps()?, None),
        }
    };
    // FP8: the caches as appended by the calls, dequantised (exactly, in bf16).
    let deq = match &caches8 {
        Some((k8, v8)) => Some((
            bench::dequantized("k_cache in bf16", k8)?,
            bench::dequantized("v_cache in bf16", v8)?,
        )),
        None => None,
    };
    let (ks, vs) = match &deq {
        Some((k, v)) => (k.as_slice(), v.as_slice()),
        None => (kc.as_slice(), vc.as_slice()),
    };
    // Accuracy: a few rows against the f64 reference, reading the cache (appended to by the
    // calls) as plain k/v `[batch, cap, heads_kv, d]` through the same strides.
    let max_abs_err = if args.page_size.is_none() {
        let strided = |b| flashattn::TensorRef::from_slice(b, &cache_shape, &cache_strides);
        Some(last_rows_error(
            &q,
            (&strided(ks), &strided(vs)),
            &attn,
            &timing.first.out.to_f64_vec(),
        )?)
    } else {
        None
    };
    let elem = match dtype {
        _ if fp8.is_some() => 1.0,
        DType::F32 => 4.0,
        _ => 2.0,
    };
    let kv_bytes = (batch * cap * heads_kv * d) as f64 * 2.0 * elem;
    let gbps = kv_bytes / timing.median_s / 1e9;
    Ok(Measured {
        kind: "measurement",
        implementation: "flashattn",
        pass: "decode",
        dtype: fp8.map_or(dtype.name(), |f| f.name()),
        batch,
        heads,
        heads_kv,
        head_dim: d,
        seqlen_q: sq,
        cache_len: cap,
        page_size: args.page_size,
        head_major: args.head_major,
        num_splits: args.num_splits,
        causal: args.causal,
        threads: rayon::current_num_threads(),
        median_ms: timing.median_s * 1e3,
        min_ms: timing.min_s * 1e3,
        reps: timing.reps,
        kv_bytes,
        gbps,
        read_gbps_around,
        bandwidth_fraction: read_gbps_around.map(|r| gbps / r),
        peak_extra_bytes: timing.peak_extra as u64,
        max_abs_err,
        huge_page_bytes,
    })
}

/// The largest |out - f64 reference| over three heads (first, middle, last) of the last query of
/// the last sequence, attending the caches `kv` (`[batch, cap, heads_kv, d]` views, as appended by
/// the timed steps); NaN when any element is NaN. `out` is the step's `[batch, sq, heads, d]`.
pub fn last_rows_error(
    q: &flashattn::TensorRef,
    (kv, vv): (&flashattn::TensorRef, &flashattn::TensorRef),
    attn: &AttnOptions,
    out: &[f64],
) -> Result<f64> {
    let (batch, sq, heads, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let mut worst = 0f64;
    for h in [0, heads / 2, heads - 1] {
        let (b, i) = (batch - 1, sq - 1);
        let (want, _) = reference::attention_row(q, kv, vv, attn, b, h, i)?;
        let at = ((b * sq + i) * heads + h) * d;
        for (x, w) in out[at..at + d].iter().zip(&want) {
            let e = (x - w).abs();
            worst = if e.is_nan() { f64::NAN } else { worst.max(e) };
        }
    }
    Ok(worst)
}
