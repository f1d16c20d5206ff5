//! `flashattn bench` on the CPU: the forward (or forward + backward) of flashattn against naive
//! attention, on seeded random data.

use crate::accuracy::{max_abs_err, sample_rows, RefRow, ERR_ROWS};
use crate::args::{self, BenchArgs, DtypeArg};
use crate::buf::{numel, view};
use crate::cpu_peak::{self, Peak};
use crate::error::{fail, Result};
use crate::inputs::{dequantized, random_buffer, random_fp8, Fp8Factors};
use crate::report::{emit, progress, to_json};
use crate::timing::{measure, Stats};
use flashattn::fp8;
use flashattn::{flops, naive, reference, AttnOptions, DType};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

const GIB: f64 = (1u64 << 30) as f64;
const MIB: f64 = (1u64 << 20) as f64;

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
    /// The cache sizes the CPU path sized its tiles by (`flashattn::simd::cache_sizes`).
    caches: String,
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

/// Checks the options up front, so a mistake is reported before minutes of benchmarking; returns
/// the (seqlen_q, seqlen_k) pairs.
pub fn validate(args: &BenchArgs) -> Result<Vec<(usize, usize)>> {
    args::validate_common(args)?;
    if args.naive_max_gib.is_nan() || args.naive_max_gib < 0.0 {
        return fail(format!(
            "--naive-max-gib {} must be >= 0",
            args.naive_max_gib
        ));
    }
    let seqlen = args::seqlens(args);
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

/// MemAvailable from /proc/meminfo, in bytes; `None` where there is no such file.
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
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
    format!(
        "machine: ISA {}, {} threads, caches {}; {peaks}",
        m.isa, m.threads, m.caches
    )
}

/// The CPU bench on the current rayon pool: the machine line, then one row per (seqlen_q,
/// seqlen_k) for flashattn and naive attention.
pub fn bench_in_pool(args: &BenchArgs, cases: &[(usize, usize)]) -> Result<()> {
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
        Some(cpu_peak::measure(cpu_peak::DEFAULT_SECS))
    };
    let used = peak
        .as_ref()
        .and_then(|p| peak_for(p, dtype, isa.has_bf16_dot()));
    let machine = Machine {
        kind: "machine",
        isa: isa.to_string(),
        caches: flashattn::simd::cache_sizes().to_string(),
        threads,
        peak_f32_gflops: peak.and_then(|p| p.f32).map(|r| r.gflops),
        peak_f32_method: peak.and_then(|p| p.f32).map(|r| r.method.name()),
        peak_bf16_gflops: peak.and_then(|p| p.bf16).map(|r| r.gflops),
        peak_bf16_method: peak.and_then(|p| p.bf16).map(|r| r.method.name()),
        peak_used: used.map(|u| u.0),
        peak_secs_per_run: peak.map(|_| cpu_peak::DEFAULT_SECS),
        peak_runs: peak.map(|_| cpu_peak::RUNS),
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
                "flashattn bench: batch {batch}, heads {heads} (kv {heads_kv}), head_dim {d}, {dtype_name}{}, {}, {threads} threads; \
                 median of timed repeats after one warm-up; max abs err over {ERR_ROWS} rows vs the f64 reference",
                if args.fp8_per_block { " (per-block factors)" } else { "" },
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
        let factors =
            fp8.map(|f| Fp8Factors::new(f, args.fp8_per_block, batch, (heads, heads_kv), (sq, sk)));
        let flash = measure(args.min_time, || {
            if let (Some((q8, k8, v8)), Some(factors)) = (&fp8_inputs, &factors) {
                let descale = factors.descale();
                return fp8::flash_attn_fp8(
                    &q8.view(&q_shape),
                    &k8.view(&kv_shape),
                    &v8.view(&kv_shape),
                    &opts.clone().descale(descale),
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
