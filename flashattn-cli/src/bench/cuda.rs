//! `bench --device cuda`: the forward (or forward + backward) and `--decode` on the GPU through
//! `flashattn::cuda` (device 0), timed with CUDA events. Without a GPU these print the library's
//! typed error (no driver, no device, no NVRTC) and exit non-zero.

use crate::accuracy::last_rows_error;
use crate::args::{BenchArgs, DtypeArg};
use crate::buf::{numel, view, Fp8Buf};
use crate::error::Result;
use crate::inputs::{dequantized, fp8_descale, random_buffer, random_fp8, Fp8Factors};
use flashattn::cuda::{self, CudaDevice, KernelOrigin};
use flashattn::{AttnOptions, DType, TensorRef};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::time::Instant;

/// The shape of a GPU benchmark.
pub struct BenchConfig {
    pub batch: usize,
    pub heads: usize,
    pub heads_kv: usize,
    pub seqlens: Vec<(usize, usize)>,
    pub head_dim: usize,
    pub dtype: DType,
    /// FP8 q, k and v of this format (`dtype` is then bf16, out's): `cuda::flash_attn_fp8`.
    pub fp8: Option<flashattn::fp8::Fp8Format>,
    /// FP8: per-block descale tables instead of one factor per tensor ([`Fp8Factors`]).
    pub fp8_per_block: bool,
    pub causal: bool,
    /// Time forward + backward (pass "fwd+bwd", FLOPs 3.5x the forward's).
    pub backward: bool,
    pub min_time: f64,
    pub seed: u64,
    pub json: bool,
}

#[derive(Serialize)]
struct Machine {
    kind: &'static str,
    device: String,
    arch: String,
    sm_count: usize,
    nvrtc: String,
}

#[derive(Serialize)]
struct Measured {
    kind: &'static str,
    #[serde(rename = "impl")]
    implementation: &'static str,
    dtype: &'static str,
    batch: usize,
    heads: usize,
    heads_kv: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
    causal: bool,
    pass: &'static str,
    kernel: String,
    /// How the kernel was obtained at its first use in this process, and how long that took
    /// (an NVRTC compile, or a cubin from the disk cache).
    kernel_origin: &'static str,
    prepare_ms: f64,
    median_ms: f64,
    min_ms: f64,
    reps: usize,
    flops: f64,
    tflops: f64,
    /// Largest |out - f64 reference| over `err_rows` sampled rows.
    max_abs_err: f64,
    err_rows: usize,
}

/// Rows sampled for the error check.
const ERR_ROWS: usize = 16;

/// Times the forward on GPU 0 with CUDA events around each call (allocation of out/lse and the
/// launch included), after a warm-up, until `min_time` seconds and at least 10 calls; reports the
/// median. FLOPs by `flashattn::flops::forward`.
pub fn bench(cfg: &BenchConfig) -> Result<()> {
    let dev = CudaDevice::new(0)?;
    let nvrtc = cuda::nvrtc_version()?;
    let machine = Machine {
        kind: "machine",
        device: dev.name().to_string(),
        arch: dev.arch().target(),
        sm_count: dev.sm_count(),
        nvrtc: format!("{}.{}", nvrtc.0, nvrtc.1),
    };
    if cfg.json {
        println!("{}", serde_json::to_string(&machine).expect("serialisable"));
    } else {
        println!(
            "device: {} ({}, {} SMs), NVRTC {}; {}{} batch {} heads {}/{} head_dim {}{}",
            machine.device,
            machine.arch,
            machine.sm_count,
            machine.nvrtc,
            cfg.fp8.map_or(cfg.dtype.name(), |f| f.name()),
            if cfg.fp8_per_block {
                " (per-block factors)"
            } else {
                ""
            },
            cfg.batch,
            cfg.heads,
            cfg.heads_kv,
            cfg.head_dim,
            if cfg.causal { " causal" } else { "" }
        );
        println!(
            "{:>8} {:>8} {:>10} {:>11} {:>9} {:>6} {:>9}  kernel",
            "seqlen_q", "seqlen_k", "median_ms", "TFLOP/s", "first_use", "ms", "max_err"
        );
    }
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    for &(sq, sk) in &cfg.seqlens {
        let m = measure(&dev, cfg, sq, sk, &mut rng)?;
        if cfg.json {
            println!("{}", serde_json::to_string(&m).expect("serialisable"));
        } else {
            println!(
                "{:>8} {:>8} {:>10.4} {:>11.1} {:>9} {:>6.0} {:>9.2e}  {}",
                sq,
                sk,
                m.median_ms,
                m.tflops,
                m.kernel_origin,
                m.prepare_ms,
                m.max_abs_err,
                m.kernel
            );
        }
    }
    Ok(())
}

fn measure(
    dev: &CudaDevice,
    cfg: &BenchConfig,
    sq: usize,
    sk: usize,
    rng: &mut ChaCha8Rng,
) -> Result<Measured> {
    let (b, h, hkv, d) = (cfg.batch, cfg.heads, cfg.heads_kv, cfg.head_dim);
    let qs = [b, sq, h, d];
    let ks = [b, sk, hkv, d];
    let opts = AttnOptions::default().causal(cfg.causal);
    if let Some(f) = cfg.fp8 {
        return measure_fp8(dev, cfg, f, (sq, sk), rng, &opts);
    }
    let (nq, nk) = (numel(&qs)?, numel(&ks)?);
    let hq = random_buffer(rng, "q", nq, cfg.dtype)?;
    let hk = random_buffer(rng, "k", nk, cfg.dtype)?;
    let hv = random_buffer(rng, "v", nk, cfg.dtype)?;
    let (q, k, v) = (view(&hq, &qs), view(&hk, &ks), view(&hv, &ks));
    let (dq, dk, dv) = (dev.upload(&q)?, dev.upload(&k)?, dev.upload(&v)?);

    // First use: the kernel is compiled by NVRTC or loaded from the disk cache.
    let key = cuda::kernel_key(dev, &dq, &dk, &dv, &opts)?;
    let prepared = dev.prepare(&key)?;

    let run = || cuda::flash_attn(dev, &dq, &dk, &dv, &opts);
    let fwd_flops = flashattn::flops::forward(b, h, sq, sk, d, cfg.causal, (-1, -1));
    let (timing, flops, kernel) = if cfg.backward {
        let hd = random_buffer(rng, "dout", nq, cfg.dtype)?;
        let dd = dev.upload(&view(&hd, &qs))?;
        let fwd_bwd = || {
            let res = run()?;
            res.backward(dev, &dq, &dk, &dv, &dd, &opts)
        };
        let timing = time_events(dev, cfg.min_time, fwd_bwd)?;
        let flops = fwd_flops + flashattn::flops::backward(fwd_flops);
        let bwd = cuda::backward_kernel_key(&dq, &dk, &dv, &dd, &opts)?;
        (timing, flops, format!("{} + {}", key.name(), bwd.name()))
    } else {
        (time_events(dev, cfg.min_time, run)?, fwd_flops, key.name())
    };
    let res = run()?;
    let out = res.out.to_host(dev)?.to_f64_vec();
    finish(
        cfg,
        (sq, sk),
        [&q, &k, &v],
        &out,
        &opts,
        timing,
        flops,
        kernel,
        &prepared,
    )
}

/// [`measure`] for FP8 inputs (`bench --device cuda --dtype e4m3|e5m2`): random values over the
/// format's range, one power-of-two factor per tensor (the CPU bench's), the reference on the
/// dequantised values (exact in bf16).
fn measure_fp8(
    dev: &CudaDevice,
    cfg: &BenchConfig,
    format: flashattn::fp8::Fp8Format,
    (sq, sk): (usize, usize),
    rng: &mut ChaCha8Rng,
    opts: &AttnOptions,
) -> Result<Measured> {
    let (b, h, hkv, d) = (cfg.batch, cfg.heads, cfg.heads_kv, cfg.head_dim);
    let (qs, ks) = ([b, sq, h, d], [b, sk, hkv, d]);
    let (nq, nk) = (numel(&qs)?, numel(&ks)?);
    let hq = random_fp8(rng, "q", format, nq)?;
    let hk = random_fp8(rng, "k", format, nk)?;
    let hv = random_fp8(rng, "v", format, nk)?;
    let factors = Fp8Factors::new(format, cfg.fp8_per_block, b, (h, hkv), (sq, sk));
    let descale = factors.descale();
    let (fq, fk, fv) = (hq.view(&qs), hk.view(&ks), hv.view(&ks));
    let opts = &opts.clone().descale(descale);
    let key = cuda::launch_description_fp8(&fq, &fk, &fv, opts)?.key;
    let prepared = dev.prepare(&key)?;
    let (dq, dk, dv) = (
        dev.upload_fp8(&fq)?,
        dev.upload_fp8(&fk)?,
        dev.upload_fp8(&fv)?,
    );
    let run = || cuda::flash_attn_fp8(dev, &dq, &dk, &dv, opts);
    let flops = flashattn::flops::forward(b, h, sq, sk, d, cfg.causal, (-1, -1));
    let timing = time_events(dev, cfg.min_time, run)?;
    let out = run()?.out.to_host(dev)?.to_f64_vec();
    let (bq, bk, bv) = (
        dequantized("q in bf16", &hq)?,
        dequantized("k in bf16", &hk)?,
        dequantized("v in bf16", &hv)?,
    );
    let (q, k, v) = (view(&bq, &qs), view(&bk, &ks), view(&bv, &ks));
    finish(
        cfg,
        (sq, sk),
        [&q, &k, &v],
        &out,
        opts,
        timing,
        flops,
        key.name(),
        &prepared,
    )
}

/// The error of sampled rows of `out` against the f64 reference on `q, k, v`, and the row.
#[allow(clippy::too_many_arguments)]
fn finish(
    cfg: &BenchConfig,
    (sq, sk): (usize, usize),
    [q, k, v]: [&TensorRef; 3],
    out: &[f64],
    opts: &AttnOptions,
    (median_ms, min_ms, reps): (f64, f64, usize),
    flops: f64,
    kernel: String,
    prepared: &cuda::Prepared,
) -> Result<Measured> {
    let (b, h, hkv, d) = (cfg.batch, cfg.heads, cfg.heads_kv, cfg.head_dim);
    // Error of sampled rows against the f64 reference.
    let n = ERR_ROWS.min(b * h * sq);
    let mut max_abs_err = 0f64;
    for r in 0..n {
        let bh = r % (b * h);
        let i = if n > 1 { r * (sq - 1) / (n - 1) } else { 0 };
        let (bb, hh) = (bh / h, bh % h);
        let (want, _) = flashattn::reference::attention_row(q, k, v, opts, bb, hh, i)?;
        let base = ((bb * sq + i) * h + hh) * d;
        for (x, w) in out[base..base + d].iter().zip(&want) {
            let e = (x - w).abs();
            // NaN is reported as the error, not skipped by max().
            max_abs_err = if e.is_nan() {
                f64::NAN
            } else {
                max_abs_err.max(e)
            };
        }
    }
    Ok(Measured {
        kind: "measurement",
        implementation: "flashattn-cuda",
        dtype: cfg.fp8.map_or(cfg.dtype.name(), |f| f.name()),
        batch: b,
        heads: h,
        heads_kv: hkv,
        seqlen_q: sq,
        seqlen_k: sk,
        head_dim: d,
        causal: cfg.causal,
        pass: if cfg.backward { "fwd+bwd" } else { "forward" },
        kernel,
        kernel_origin: match prepared.origin {
            KernelOrigin::Memory => "memory",
            KernelOrigin::Disk => "disk",
            KernelOrigin::Compiled => "compiled",
        },
        prepare_ms: prepared.time.as_secs_f64() * 1e3,
        median_ms,
        min_ms,
        reps,
        flops,
        tflops: flops / (median_ms * 1e-3) / 1e12,
        max_abs_err,
        err_rows: n,
    })
}

/// Events that record timing (cudarc's default disables it).
fn cudarc_event_flags() -> cuda::cudarc::driver::sys::CUevent_flags {
    cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT
}

/// One `bench --decode --device cuda` row.
#[derive(Serialize)]
struct DecodeMeasured {
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
    num_splits: Option<usize>,
    causal: bool,
    kernel: String,
    median_ms: f64,
    min_ms: f64,
    reps: usize,
    /// Bytes of k and v one step reads (the whole cache of every sequence).
    kv_bytes: f64,
    gbps: f64,
    /// A device-to-device copy of 1 GiB, timed the same way: bytes read + written per second.
    copy_gbps: f64,
    /// Largest |out - f64 reference| over a few rows.
    max_abs_err: f64,
}

/// Median of CUDA-event times of `f` (each call queued alone between two events) after three
/// warm-up calls, until `min_time` seconds and at least 10 calls.
fn time_events<R>(
    dev: &CudaDevice,
    min_time: f64,
    mut f: impl FnMut() -> flashattn::Result<R>,
) -> Result<(f64, f64, usize)> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let timing = |e| {
        flashattn::Error::from(flashattn::ErrorKind::CudaDriver {
            call: "cuEventRecord / cuEventElapsedTime",
            message: format!("{e:?}"),
        })
    };
    let mut times_ms = Vec::new();
    let start_all = Instant::now();
    while times_ms.len() < 10
        || (start_all.elapsed().as_secs_f64() < min_time && times_ms.len() < 10_000)
    {
        let flags = Some(cudarc_event_flags());
        let start = dev.stream().record_event(flags).map_err(timing)?;
        let res = f()?;
        let end = dev.stream().record_event(flags).map_err(timing)?;
        end.synchronize().map_err(timing)?;
        times_ms.push(start.elapsed_ms(&end).map_err(timing)? as f64);
        drop(res);
    }
    times_ms.sort_by(f64::total_cmp);
    Ok((times_ms[times_ms.len() / 2], times_ms[0], times_ms.len()))
}

/// `bench --decode --device cuda`: one step (append `seqlen` tokens, attend the whole cache) of
/// `cuda::flash_attn_with_kvcache` per shape, timed with CUDA events; KV GB/s against a 1 GiB
/// device-to-device copy timed beside it.
pub fn bench_decode(args: &BenchArgs, sqs: &[usize]) -> Result<()> {
    use flashattn::{BlockTable, KvCacheOptions};
    use rand::seq::SliceRandom;
    let dev = CudaDevice::new(0)?;
    let dtypes: Vec<DType> = match args.dtype {
        Some(d) => vec![d.dtype()],
        None => vec![DType::F32, DType::BF16],
    };
    // --dtype e4m3|e5m2: FP8 caches (random values over the format's range, one power-of-two
    // factor, as the CPU bench); q, the new keys and out in bf16.
    let fp8 = args.dtype.and_then(DtypeArg::fp8);
    let (batch, heads, heads_kv, d) = (args.batch, args.heads(), args.heads_kv(), args.head_dim());
    // The copy rate: 1 GiB of f32 moved device to device.
    let n = 1usize << 28;
    let src = dev.stream().alloc_zeros::<f32>(n).map_err(|e| {
        flashattn::Error::from(flashattn::ErrorKind::CudaDriver {
            call: "cuMemAlloc",
            message: format!("{e:?}"),
        })
    })?;
    let mut dst = dev.stream().alloc_zeros::<f32>(n).map_err(|e| {
        flashattn::Error::from(flashattn::ErrorKind::CudaDriver {
            call: "cuMemAlloc",
            message: format!("{e:?}"),
        })
    })?;
    let (copy_ms, _, _) = time_events(&dev, 0.2, || {
        dev.stream().memcpy_dtod(&src, &mut dst).map_err(|e| {
            flashattn::Error::from(flashattn::ErrorKind::CudaDriver {
                call: "cuMemcpyDtoD",
                message: format!("{e:?}"),
            })
        })
    })?;
    drop((src, dst));
    let copy_gbps = 2.0 * (n * 4) as f64 / (copy_ms * 1e-3) / 1e9;
    if args.json {
        let machine = serde_json::json!({
            "kind": "machine",
            "device": dev.name(),
            "arch": dev.arch().target(),
            "sm_count": dev.sm_count(),
            "copy_gbps": copy_gbps,
        });
        println!("{machine}");
    } else {
        println!(
            "device: {} ({}, {} SMs); 1 GiB device copy {:.0} GB/s (read + write); batch {batch}, heads {heads} (kv {heads_kv}), head_dim {d}",
            dev.name(),
            dev.arch().target(),
            dev.sm_count(),
            copy_gbps
        );
        println!(
            "{:>5} {:>6} {:>9} {:>10} {:>9} {:>8} {:>9}  kernel",
            "dtype", "seqlen", "cache_len", "median_ms", "KV_GB/s", "of_copy", "max_err"
        );
    }
    for &dtype in &dtypes {
        for (ci, &cap) in args.cache_len.iter().enumerate() {
            for &sq in sqs {
                let mut rng = ChaCha8Rng::seed_from_u64(args.seed.wrapping_add(ci as u64));
                let (pages, rows, table, max_blocks) = match args.page_size {
                    None => (batch, cap, Vec::new(), 1),
                    Some(ps) => {
                        let mb = cap.div_ceil(ps);
                        let mut t: Vec<i32> = (0..(batch * mb) as i32).collect();
                        t.shuffle(&mut rng);
                        (batch * mb, ps, t, mb)
                    }
                };
                let cs = [pages, rows, heads_kv, d];
                let (qs, ns) = ([batch, sq, heads, d], [batch, sq, heads_kv, d]);
                let (nq, nn, nc) = (numel(&qs)?, numel(&ns)?, numel(&cs)?);
                let hq = random_buffer(&mut rng, "q", nq, dtype)?;
                let hkn = random_buffer(&mut rng, "k_new", nn, dtype)?;
                let hvn = random_buffer(&mut rng, "v_new", nn, dtype)?;
                let q = dev.upload(&view(&hq, &qs))?;
                let (kn, vn) = (dev.upload(&view(&hkn, &ns))?, dev.upload(&view(&hvn, &ns))?);
                let mut caches = match fp8 {
                    Some(f) => {
                        let max = f.max();
                        let mut draw = |what| {
                            let x = (0..nc).map(|_| rng.gen_range(-max..max));
                            Fp8Buf::quantize(what, f, x)
                        };
                        let (hk, hv) = (draw("k_cache")?, draw("v_cache")?);
                        DevCaches::Fp8(
                            dev.upload_fp8(&hk.view(&cs))?,
                            dev.upload_fp8(&hv.view(&cs))?,
                        )
                    }
                    None => {
                        let hk = random_buffer(&mut rng, "k_cache", nc, dtype)?;
                        let hv = random_buffer(&mut rng, "v_cache", nc, dtype)?;
                        DevCaches::Plain(dev.upload(&view(&hk, &cs))?, dev.upload(&view(&hv, &cs))?)
                    }
                };
                let lens = vec![(cap - sq) as i32; batch];
                let attn = AttnOptions::default().causal(args.causal);
                let mut opts = KvCacheOptions::default().attn(attn.clone());
                opts.num_splits = args.num_splits;
                if args.page_size.is_some() {
                    opts = opts.block_table(BlockTable::new(&table, batch, max_blocks));
                }
                let factor = fp8.map(fp8_descale);
                let descale = factor
                    .as_ref()
                    .map(|s| flashattn::fp8::Descale::default().k(s).v(s))
                    .unwrap_or_default();
                let mut step = || match &mut caches {
                    DevCaches::Plain(k, v) => cuda::flash_attn_with_kvcache(
                        &dev,
                        &q,
                        k,
                        v,
                        &lens,
                        Some((&kn, &vn)),
                        &opts,
                    ),
                    DevCaches::Fp8(k, v) => cuda::flash_attn_with_kvcache_fp8(
                        &dev,
                        &q,
                        k,
                        v,
                        &lens,
                        Some((&kn, &vn)),
                        &opts.clone().descale(descale),
                    ),
                };
                let (median_ms, min_ms, reps) = time_events(&dev, args.min_time, &mut step)?;
                let res = step()?;
                // The caches as appended, on the host (FP8: dequantised, exactly, to bf16), and
                // the launches the step made.
                let (hk, hv, launch) = match &caches {
                    DevCaches::Plain(k, v) => {
                        let (hk, hv) = (
                            k.to_host(&dev)?.into_buffer(),
                            v.to_host(&dev)?.into_buffer(),
                        );
                        // The launches the step made: the same device shape and split kernel.
                        let launch = cuda::decode_launch_description_with(
                            &view(&hq, &qs),
                            &view(&hk, &cs),
                            &view(&hv, &cs),
                            &lens,
                            &opts,
                            dev.shape(),
                            cuda::DecodeKernel::from_env(),
                        );
                        (hk, hv, launch)
                    }
                    DevCaches::Fp8(k, v) => {
                        let host = |t: &cuda::CudaFp8Tensor| -> Result<Fp8Buf> {
                            Ok(Fp8Buf::from_bits(t.format(), &t.to_host_bytes(&dev)?))
                        };
                        let (k8, v8) = (host(k)?, host(v)?);
                        let launch = cuda::decode_launch_description_fp8(
                            &view(&hq, &qs),
                            &k8.view(&cs),
                            &v8.view(&cs),
                            &lens,
                            &opts.clone().descale(descale),
                            dev.sm_count(),
                        );
                        (
                            dequantized("k_cache in bf16", &k8)?,
                            dequantized("v_cache in bf16", &v8)?,
                            launch,
                        )
                    }
                };
                // Accuracy: a few rows against the f64 reference, on the caches as appended.
                let max_abs_err = if args.page_size.is_none() {
                    last_rows_error(
                        &view(&hq, &qs),
                        (&view(&hk, &cs), &view(&hv, &cs)),
                        &attn,
                        &res.out.to_host(&dev)?.to_f64_vec(),
                    )?
                } else {
                    f64::NAN
                };
                let elem = match (fp8, dtype) {
                    (Some(_), _) => 1.0,
                    (None, DType::F32) => 4.0,
                    (None, _) => 2.0,
                };
                let kv_bytes = (batch * cap * heads_kv * d) as f64 * 2.0 * elem;
                let gbps = kv_bytes / (median_ms * 1e-3) / 1e9;
                let kernel = launch
                    .map(|l| format!("{} x{} splits", l.split.name(), l.splits))
                    .unwrap_or_default();
                let m = DecodeMeasured {
                    kind: "measurement",
                    implementation: "flashattn-cuda",
                    pass: "decode",
                    dtype: fp8.map_or(dtype.name(), |f| f.name()),
                    batch,
                    heads,
                    heads_kv,
                    head_dim: d,
                    seqlen_q: sq,
                    cache_len: cap,
                    page_size: args.page_size,
                    num_splits: args.num_splits,
                    causal: args.causal,
                    kernel,
                    median_ms,
                    min_ms,
                    reps,
                    kv_bytes,
                    gbps,
                    copy_gbps,
                    max_abs_err,
                };
                if args.json {
                    println!("{}", serde_json::to_string(&m).expect("serialisable"));
                } else {
                    println!(
                        "{:>5} {:>6} {:>9} {:>10.4} {:>9.0} {:>7.1}% {:>9.2e}  {}",
                        m.dtype,
                        sq,
                        cap,
                        m.median_ms,
                        m.gbps,
                        100.0 * m.gbps / copy_gbps,
                        m.max_abs_err,
                        m.kernel
                    );
                }
            }
        }
    }
    Ok(())
}

/// The caches a decode bench step reads, on the device.
enum DevCaches {
    Plain(cuda::CudaTensor, cuda::CudaTensor),
    Fp8(cuda::CudaFp8Tensor, cuda::CudaFp8Tensor),
}
