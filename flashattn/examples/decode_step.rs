//! Times one decoding step at the decode benchmark shape (B = 1, 32 / 8 heads, d = 128) on the current
//! rayon pool, for quick A/B runs and profiling: `cargo run --release -p flashattn --example
//! decode_step -- [f32|bf16] [cache_len] [reps] [configurations]`, e.g. `HUGE_PAGES=1 ...
//! decode_step -- f32 32768 40 "" USE_HUGE=1` for 4 KiB against huge pages, or `PAD=16
//! HUGE_PAGES=1 ... decode_step -- f32 128 3000 USE_HUGE=1 USE_PAD=1` for key rows 16 elements
//! further apart than the contiguous cache's (a strided view, in huge pages as the `USE_HUGE`
//! copy; f32 rows of the decode benchmark shape are 4 KiB apart, L1's way size). A configuration with
//! `READ=1` sums the caches' bytes on all threads instead of calling (e.g. `HUGE_PAGES=1 ...
//! decode_step -- f32 32768 30 USE_HUGE=1 "USE_HUGE=1 READ=1"`): the step against a plain read of
//! the same memory, alternated call by call. `flashattn bench --decode` is the benchmark of record
//! (bandwidth measured beside it, accuracy checked); this only repeats the call. Each line also
//! gives the calls' process CPU time (all threads), which a loaded host disturbs less than wall time.
use flashattn::decode::{flash_attn_with_kvcache, KvCacheOptions, TensorMut};
use flashattn::TensorRef;
use half::bf16;
use std::time::Instant;

#[path = "common/timing.rs"]
mod timing;

fn lcg(s: &mut u64) -> f32 {
    *s = s
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn run<T: flashattn::tensor::Element>(cap: usize, reps: usize, conv: fn(f32) -> T, cfgs: &[String])
where
    for<'a> flashattn::decode::SliceMut<'a>: From<&'a mut [T]>,
{
    let (heads, heads_kv, d) = (32, 8, 128);
    let mut s = 7u64;
    let q: Vec<T> = (0..heads * d).map(|_| conv(lcg(&mut s))).collect();
    let n = cap * heads_kv * d;
    let s0 = s;
    let mut k: Vec<T> = (0..n).map(|_| conv(lcg(&mut s))).collect();
    let mut v: Vec<T> = (0..n).map(|_| conv(lcg(&mut s))).collect();
    // `HUGE_PAGES=1`: a second copy of the caches as `kv_cache_vec` allocates them (advised for
    // transparent huge pages, starting on a 2 MiB boundary, where the `Vec`s above start 16 bytes
    // past a page with glibc), which the configurations select with `USE_HUGE=1`.
    let huge = |s: &mut u64| flashattn::memory::kv_cache_from_iter((0..n).map(|_| conv(lcg(s))));
    let empty = flashattn::memory::CacheBuf::default;
    let (mut kh, mut vh) = match std::env::var_os("HUGE_PAGES") {
        Some(_) => {
            let mut s = s0;
            (huge(&mut s), huge(&mut s))
        }
        None => (empty(), empty()),
    };
    // `PAD=E`: a second copy of the caches whose key rows are E elements further apart than
    // heads_kv · d (strided views), which the configurations select with `USE_PAD=1`.
    let pad: usize = std::env::var("PAD")
        .ok()
        .and_then(|x| x.parse().ok())
        .unwrap_or(0);
    let rs = heads_kv * d + pad;
    let padded = |src: &[T]| -> flashattn::memory::CacheBuf<T> {
        let mut out = flashattn::memory::kv_cache_from_iter((0..cap * rs).map(|_| conv(0.0)));
        for (o, i) in out.chunks_exact_mut(rs).zip(src.chunks_exact(heads_kv * d)) {
            o[..heads_kv * d].copy_from_slice(i);
        }
        out
    };
    let (mut kp, mut vp) = if pad > 0 {
        (padded(&k), padded(&v))
    } else {
        (empty(), empty())
    };
    let shape = [1, cap, heads_kv, d];
    let qv = TensorRef::contiguous(&q, &[1, 1, heads, d]);
    let lens = [cap as i32];
    let opts = KvCacheOptions::default();
    // Configurations (environment settings, `A=1 B=2` each) alternate call by call, so that a
    // shared host's slow phases fall on all of them alike.
    let mut times = vec![Vec::new(); cfgs.len()];
    let mut cpu = vec![Vec::new(); cfgs.len()];
    for rep in 0..reps + 1 {
        for (ci, cfg) in cfgs.iter().enumerate() {
            for kv in cfg.split_whitespace() {
                if let Some((k, v)) = kv.split_once('=') {
                    // SAFETY (edition 2021: safe): no other thread reads the environment now.
                    std::env::set_var(k, v);
                }
            }
            let use_pad = std::env::var_os("USE_PAD").is_some() && !kp.is_empty();
            let ((kb, vb), row) = if use_pad {
                ((&mut kp[..], &mut vp[..]), rs)
            } else if std::env::var_os("USE_HUGE").is_some() && !kh.is_empty() {
                ((&mut kh[..], &mut vh[..]), heads_kv * d)
            } else {
                ((&mut k[..], &mut v[..]), heads_kv * d)
            };
            let strides = [cap * row, row, d, 1];
            let mut kc = TensorMut::new(&mut kb[..], &shape, &strides);
            let mut vc = TensorMut::new(&mut vb[..], &shape, &strides);
            let mut opts = opts.clone();
            opts.num_splits = std::env::var("SPLITS").ok().and_then(|x| x.parse().ok());
            // `READ=1`: instead of the step, a plain read of the same caches (see `read`).
            let plain_read = std::env::var("READ").as_deref() == Ok("1");
            let (t, c0) = (
                Instant::now(),
                timing::cpu_secs(libc::CLOCK_PROCESS_CPUTIME_ID),
            );
            if plain_read {
                std::hint::black_box(read(&kb[..], &vb[..]));
            } else {
                let r = flash_attn_with_kvcache(&qv, &mut kc, &mut vc, &lens, &opts).unwrap();
                std::hint::black_box(r);
            }
            if rep > 0 {
                times[ci].push(t.elapsed().as_secs_f64() * 1e3);
                cpu[ci].push((timing::cpu_secs(libc::CLOCK_PROCESS_CPUTIME_ID) - c0) * 1e3);
            }
            for kv in cfg.split_whitespace() {
                if let Some((k, _)) = kv.split_once('=') {
                    std::env::remove_var(k);
                }
            }
        }
    }
    let bytes = 2.0 * n as f64 * std::mem::size_of::<T>() as f64;
    for ((cfg, mut times), cpu) in cfgs.iter().zip(times).zip(cpu) {
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        println!(
            "{:>5} cap {cap} [{cfg}]: median {med:.4} ms, min {:.4} ms, {:.1} GB/s, {:.0} ns/key/thread; CPU median {:.4} ms, min {:.4} ms",
            std::any::type_name::<T>().rsplit("::").next().unwrap_or(""),
            times[0],
            bytes / med / 1e6,
            med * 1e6 / cap as f64 * rayon::current_num_threads() as f64,
            timing::median(cpu.clone()),
            cpu.iter().copied().fold(f64::INFINITY, f64::min),
        );
    }
}

/// The caches' bytes summed on all threads in 4 MiB chunks (as `flashattn bench --decode`
/// measures the read rate on its own buffer): the step's time against a plain read of the same
/// memory, in the same alternation.
fn read<T: flashattn::tensor::Element>(k: &[T], v: &[T]) -> u64 {
    use rayon::prelude::*;
    let bytes = |b: &[T]| {
        // SAFETY: the element types (f32, f16, bf16) have no padding, so every byte of an
        // initialised slice is initialised; u8 has alignment 1.
        unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<u8>(), std::mem::size_of_val(b)) }
    };
    [k, v]
        .into_iter()
        .map(|b| {
            bytes(b)
                .par_chunks(4 << 20)
                .map(sum_bytes)
                .reduce(|| 0, u64::wrapping_add)
        })
        .fold(0, u64::wrapping_add)
}

/// The wrapping sum of a chunk's bytes as u64 words (vectorised by the compiler).
fn sum_bytes(c: &[u8]) -> u64 {
    let mut acc = [0u64; 8];
    let mut it = c.chunks_exact(64);
    for x in &mut it {
        for (a, y) in acc.iter_mut().zip(x.chunks_exact(8)) {
            *a = a.wrapping_add(u64::from_le_bytes(y.try_into().unwrap()));
        }
    }
    let tail: u64 = it.remainder().iter().map(|&b| b as u64).sum();
    acc.iter().fold(tail, |s, y| s.wrapping_add(*y))
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let dt = a.get(1).map(String::as_str).unwrap_or("f32");
    let cap = a.get(2).and_then(|x| x.parse().ok()).unwrap_or(32768);
    let reps = a.get(3).and_then(|x| x.parse().ok()).unwrap_or(20);
    let mut cfgs: Vec<String> = a.iter().skip(4).cloned().collect();
    if cfgs.is_empty() {
        cfgs.push(String::new());
    }
    match dt {
        "bf16" => run::<bf16>(cap, reps, bf16::from_f32, &cfgs),
        "f16" => run::<half::f16>(cap, reps, half::f16::from_f32, &cfgs),
        _ => run::<f32>(cap, reps, |x| x, &cfgs),
    }
}
