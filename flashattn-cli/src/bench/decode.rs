//! `flashattn bench --decode` on the CPU: decoding with a KV cache (time, GB/s of k/v read, and the
//! fraction of this machine's memory bandwidth, measured in the same run: once at the start, and
//! again around each measurement).

use crate::accuracy::last_rows_error;
use crate::args::{self, BenchArgs, DtypeArg};
use crate::bandwidth::{measure_bandwidth, Bandwidth, ReadProbe};
use crate::buf::{view, CacheBuffer, Fp8Buf};
use crate::error::{fail, CliError, Result};
use crate::inputs::{dequantized, fp8_descale, random_buffer, random_cache};
use crate::report::{emit, progress, to_json};
use crate::timing::measure;
use flashattn::fp8::{flash_attn_with_kvcache_fp8, Descale};
use flashattn::{
    flash_attn_with_kvcache, AttnOptions, BlockTable, DType, KvCacheOptions, TensorMut,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

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

/// Checks the options of `bench --decode` up front; returns the query lengths.
pub fn validate(args: &BenchArgs) -> Result<Vec<usize>> {
    args::validate_common(args)?;
    let sqs = args::seqlens(args);
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
    Ok(sqs)
}

/// `flashattn bench --decode` on the CPU, on the current rayon pool.
pub fn bench_in_pool(args: &BenchArgs, sqs: &[usize]) -> Result<()> {
    let dtypes: Vec<DType> = match args.dtype {
        Some(d) => vec![d.dtype()],
        None => vec![DtypeArg::F32.dtype(), DtypeArg::Bf16.dtype()],
    };
    let (batch, heads, heads_kv, d) = (args.batch, args.heads(), args.heads_kv(), args.head_dim());
    let threads = rayon::current_num_threads();
    let cases = dtypes.len() * args.cache_len.len() * sqs.len();
    let pb = progress(cases as u64);
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
        emit(&pb, to_json(&machine)?);
    } else {
        let bw = match bandwidth {
            Some(b) => format!(
                "memory bandwidth: read {:.1} GB/s, copy {:.1} GB/s (1 GiB buffers, median of {} runs, all threads); \
                 % of read bw against the read rate measured again around each row",
                b.read_gbps, b.copy_gbps, b.runs
            ),
            None => "memory bandwidth not measured (--no-bandwidth)".into(),
        };
        emit(
            &pb,
            format!("machine: ISA {}, {threads} threads; {bw}", machine.isa),
        );
        emit(
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
        emit(&pb, TABLE_HEADER.into());
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
                emit(
                    &pb,
                    if args.json {
                        to_json(&m)?
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
    let qb = random_buffer(&mut rng, "q", numel(&q_shape)?, dtype)?;
    let kn = random_buffer(&mut rng, "k_new", numel(&new_shape)?, dtype)?;
    let vn = random_buffer(&mut rng, "v_new", numel(&new_shape)?, dtype)?;
    // FP8 caches: random values over the format's range, dequantised by a power of two to
    // [-1.75, 1.75] (so the accuracy check reads them exactly in bf16).
    let fp8 = args.dtype.and_then(DtypeArg::fp8);
    let huge = !args.no_huge_pages;
    let descale = fp8.map(fp8_descale);
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
        (CacheBuffer::empty(), CacheBuffer::empty())
    } else {
        (
            random_cache(&mut rng, "k_cache", n_cache, dtype, huge)?,
            random_cache(&mut rng, "v_cache", n_cache, dtype, huge)?,
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
                measure(args.min_time, || {
                    flash_attn_with_kvcache_fp8(
                        &q,
                        &mut k,
                        &mut v,
                        &lens,
                        &opts.clone().descale(descale),
                    )
                })
            }
            _ => {
                let mut k = TensorMut::new(kc.slice_mut(), &cache_shape, &cache_strides);
                let mut v = TensorMut::new(vc.slice_mut(), &cache_shape, &cache_strides);
                measure(args.min_time, || {
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
            dequantized("k_cache in bf16", k8)?,
            dequantized("v_cache in bf16", v8)?,
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
