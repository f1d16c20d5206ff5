//! How fast one core reads memory in order, with and without software prefetch, and with some
//! arithmetic per cache line: the yardstick behind the decode kernel's prefetch choices
//! (docs/PERFORMANCE.md, "Decoding with a KV cache"). x86-64 with AVX-512F only.
//!
//!     rustc -C opt-level=3 bench/prefetch_probe.rs -o /tmp/prefetch_probe && /tmp/prefetch_probe
//!
//! Each line: the median of 5 passes over a 1 GiB buffer, GB/s (1e9 bytes/s).
//! - `sum`: 4 × 64-byte loads per step, summed (the hardware prefetcher alone);
//! - `sum_pf T1|T0 <bytes>`: the same with a prefetch of the 4 lines `<bytes>` ahead;
//! - `work <n> nopf|pf16k`: `8n` FMAs per 256 bytes on top of the sum, without and with a
//!   `prefetcht1` 16 KiB ahead;
//! - `two streams, switch every <bytes>, work <n>`: two 512 MiB halves read in turns of
//!   `<bytes>` each (as k and v are), with `8n` FMAs per 256 bytes;
//! - `decode order, sub-blocks of <n> keys, pf <bool>`: the two halves read as an f32 decode
//!   kernel reads k and v (see `decode_order`), with and without software prefetch;
//! - `burst of <n> lines`: how much of a burst of `n` prefetches is still there to read 20 µs
//!   later (see `burst`): the median time to read the lines after no prefetch, `prefetcht0`,
//!   `prefetcht1`, and after loading them (the floor).

use std::arch::x86_64::*;
use std::time::Instant;
const N: usize = 1 << 28; // 256 Mi u32 = 1 GiB
/// The sum of `b` in 4 × 64-byte loads per step; with `PF`, a prefetch (hint `H`) of the 4 lines
/// `dist` bytes ahead of each step.
///
/// # Safety
/// AVX-512F present; `b.len()` a multiple of 64.
#[target_feature(enable = "avx512f")]
unsafe fn sum_pf<const H: i32, const PF: bool>(b: &[u32], dist: usize) -> u32 {
    let mut a = [_mm512_setzero_si512(); 4];
    let p = b.as_ptr();
    let mut i = 0;
    while i < b.len() {
        if PF {
            for l in 0..4 {
                _mm_prefetch::<H>((p as *const i8).wrapping_add(i * 4 + dist + 64 * l));
            }
        }
        for j in 0..4 {
            a[j] = _mm512_add_epi32(a[j], _mm512_loadu_si512(p.add(i + 16 * j).cast()));
        }
        i += 64;
    }
    let s = _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3]));
    _mm512_reduce_add_epi32(s) as u32
}
/// [`sum_pf`] without prefetch.
///
/// # Safety
/// As [`sum_pf`].
#[target_feature(enable = "avx512f")]
unsafe fn sum(b: &[u32]) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { sum_pf::<_MM_HINT_T0, false>(b, 0) }
}
/// `sum` plus `work` rounds of 8 independent FMAs per 256 bytes, optionally with a `prefetcht1`
/// `dist` bytes ahead (0: none).
///
/// # Safety
/// As [`sum`].
#[target_feature(enable = "avx512f")]
unsafe fn sum_work(b: &[u32], work: usize, dist: usize) -> f32 {
    let mut a = [_mm512_setzero_ps(); 8];
    let x = _mm512_set1_ps(1.0001);
    let p = b.as_ptr();
    let mut i = 0;
    while i < b.len() {
        if dist > 0 {
            for l in 0..4 {
                _mm_prefetch::<_MM_HINT_T1>((p as *const i8).wrapping_add(i * 4 + dist + 64 * l));
            }
        }
        for j in 0..4 {
            a[j] = _mm512_add_ps(
                a[j],
                _mm512_castsi512_ps(_mm512_loadu_si512(p.add(i + 16 * j).cast())),
            );
        }
        for _ in 0..work {
            for j in 0..8 {
                a[j] = _mm512_fmadd_ps(a[j], x, x);
            }
        }
        i += 64;
    }
    let mut s = 0.0;
    for j in 0..8 {
        s += _mm512_reduce_add_ps(a[j]);
    }
    s
}
/// Two buffers read in turns of `chunk` elements, with `work` rounds of 8 FMAs per 256 bytes.
///
/// # Safety
/// AVX-512F present; `a.len() == b.len()`, a multiple of `chunk`, itself a multiple of 64.
#[target_feature(enable = "avx512f")]
unsafe fn two_streams(a: &[u32], b: &[u32], chunk: usize, work: usize) -> f32 {
    let mut acc = [_mm512_setzero_ps(); 8];
    let x = _mm512_set1_ps(1.0001);
    let mut i = 0;
    while i < a.len() {
        for p in [a.as_ptr(), b.as_ptr()] {
            let mut j = i;
            while j < i + chunk {
                for l in 0..4 {
                    let v = _mm512_loadu_si512(p.add(j + 16 * l).cast());
                    acc[l] = _mm512_add_ps(acc[l], _mm512_castsi512_ps(v));
                }
                for _ in 0..work {
                    for a in acc.iter_mut() {
                        *a = _mm512_fmadd_ps(*a, x, x);
                    }
                }
                j += 64;
            }
        }
        i += chunk;
    }
    acc.iter().map(|a| _mm512_reduce_add_ps(*a)).sum()
}

/// The decode kernel's read pattern over an f32 cache of 8 kv heads × 128 dims (4 KiB per key):
/// `k` and `v` in tiles of 16 keys, k's tile then v's, each tile read in sub-blocks of `sub`
/// keys, and within a sub-block one kv head (512 bytes) at a time, key by key. `sub = 16` is the
/// kernel's order (one head over the whole tile), `sub = 1` memory order. With `pf`, the next
/// tile's lines are asked for (`prefetcht1`) one head row per row read, as the kernel spreads them.
///
/// # Safety
/// AVX-512F present; `k.len() == v.len()`, a multiple of 16 keys (16 × 1024 elements).
#[target_feature(enable = "avx512f")]
unsafe fn decode_order(k: &[u32], v: &[u32], sub: usize, pf: bool) -> f32 {
    const ROW: usize = 1024; // elements per key: 8 heads × 128
    const TILE: usize = 16;
    let mut acc = [_mm512_setzero_ps(); 8];
    let keys = k.len() / ROW;
    let mut t0 = 0;
    while t0 < keys {
        for p in [k.as_ptr(), v.as_ptr()] {
            // The next tile's 16 × 4 KiB, 8 lines per head row read (128 rows per tile).
            let mut next = (p as *const i8).wrapping_add((t0 + TILE) * ROW * 4);
            let mut s0 = t0;
            while s0 < t0 + TILE {
                for h in 0..8 {
                    for t in s0..s0 + sub {
                        if pf {
                            for l in 0..8 {
                                _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(64 * l));
                            }
                            next = next.wrapping_add(512);
                        }
                        let r = p.add(t * ROW + h * 128);
                        for l in 0..8 {
                            let x = _mm512_castsi512_ps(_mm512_loadu_si512(r.add(16 * l).cast()));
                            acc[l] = _mm512_add_ps(acc[l], x);
                        }
                    }
                }
                s0 += sub;
            }
        }
        t0 += TILE;
    }
    acc.iter().map(|a| _mm512_reduce_add_ps(*a)).sum()
}

/// For bursts of `lines` cache lines at random 128 KiB-aligned places of `b` (so that neither
/// the caches nor the hardware prefetchers hold them): the burst is asked for (mode 1:
/// `prefetcht0`, 2: `prefetcht1`), loaded (3), or left alone (0), the core spins 20 µs, then
/// the lines are read and timed. Returns the median read time per mode, ns.
///
/// # Safety
/// AVX-512F present; `b.len() >= 2 · 32768`; `lines` a multiple of 4, at most 2048.
#[target_feature(enable = "avx512f")]
unsafe fn burst(b: &[u32], lines: usize) -> [f64; 4] {
    let mut times: [Vec<f64>; 4] = Default::default();
    let mut seed = 12345u64;
    let slots = b.len() / 32768 - 1;
    for r in 0..1600 {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let burst = &b[(seed >> 33) as usize % slots * 32768..][..16 * lines];
        let p = burst.as_ptr();
        let mode = r % 4;
        for l in 0..lines {
            let a = p.add(16 * l);
            match mode {
                1 => _mm_prefetch::<_MM_HINT_T0>(a.cast()),
                2 => _mm_prefetch::<_MM_HINT_T1>(a.cast()),
                3 => _ = std::hint::black_box(*a),
                _ => {}
            }
        }
        let s = Instant::now();
        while s.elapsed().as_secs_f64() < 20e-6 {}
        let s = Instant::now();
        std::hint::black_box(sum(burst));
        times[mode].push(s.elapsed().as_secs_f64() * 1e9);
    }
    times.map(|mut t| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    })
}

fn main() {
    if !is_x86_feature_detected!("avx512f") {
        eprintln!("prefetch_probe: needs AVX-512F");
        std::process::exit(2);
    }
    let b: Vec<u32> = (0..N as u32).collect();
    let gb = (N * 4) as f64 / 1e9;
    let t = |name: &str, f: &dyn Fn() -> f64| {
        let mut v: Vec<f64> = (0..5)
            .map(|_| {
                let s = Instant::now();
                std::hint::black_box(f());
                gb / s.elapsed().as_secs_f64()
            })
            .collect();
        v.sort_by(f64::total_cmp);
        println!("{name:<44} {:.1} GB/s", v[2]);
    };
    // SAFETY: AVX-512F is present (checked above); every kernel reads only `b`'s elements (its
    // length is a multiple of 64), and a prefetch past the end is a hint that cannot fault.
    unsafe {
        t("sum", &|| sum(&b) as f64);
        for d in [1024usize, 4096, 16384, 65536] {
            t(&format!("sum_pf T1 {d}"), &|| {
                sum_pf::<_MM_HINT_T1, true>(&b, d) as f64
            });
            t(&format!("sum_pf T0 {d}"), &|| {
                sum_pf::<_MM_HINT_T0, true>(&b, d) as f64
            });
        }
        for w in [0usize, 2, 4, 8] {
            t(&format!("work {w} nopf"), &|| sum_work(&b, w, 0) as f64);
            t(&format!("work {w} pf16k"), &|| {
                sum_work(&b, w, 16384) as f64
            });
        }
        let (lo, hi) = b.split_at(N / 2);
        for chunk in [64usize, 1024, 16384, 262144] {
            for w in [0usize, 2, 4] {
                t(
                    &format!("two streams, switch every {} B, work {w}", chunk * 4),
                    &|| two_streams(lo, hi, chunk, w) as f64,
                );
            }
        }
        for lines in [8usize, 24, 64, 256, 1024] {
            let [none, t0, t1, loaded] = burst(&b, lines);
            println!(
                "burst of {lines} lines: read after none {none:.0} ns, T0 {t0:.0}, T1 {t1:.0}, \
                 loaded {loaded:.0}"
            );
        }
        for sub in [16usize, 4, 1] {
            for pf in [true, false] {
                t(
                    &format!("decode order, sub-blocks of {sub} keys, pf {pf}"),
                    &|| decode_order(lo, hi, sub, pf) as f64,
                );
            }
        }
    }
}
