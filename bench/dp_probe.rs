//! How fast one core runs `vdpbf16ps` in the patterns of the bf16 decode products, with no
//! memory traffic to speak of: the yardstick behind "the products' inner loops run at the
//! instruction's rate; the rest of their time is elsewhere" (docs/PERFORMANCE.md, "Decoding with
//! a KV cache"). x86-64 with AVX-512F and AVX512_BF16 only.
//!
//!     rustc -C opt-level=3 -C target-cpu=native bench/dp_probe.rs -o /tmp/dp_probe && /tmp/dp_probe
//!
//! - `quad`: the score kernel's inner loop (`scores_quad_tile::<1, 8>`): per 16 dims, two q
//!   vectors (2 rows each), 8 keys each broadcast from 256 bits, 16 `vdpbf16ps`;
//! - `pair`: a dword broadcast against two loaded vectors, 16 `vdpbf16ps` per step (the shape of
//!   the forward's bf16 GEMM);
//! - `pv`: the P·V tile `pv_tile_bf16::<4, 2>`: per key pair 4 loads, 4 unpacks, 4 broadcasts
//!   of a p pair, 16 `vdpbf16ps`;
//! - `walk <keys>`: `quad` over a cache of `keys` keys × 8 kv heads × 128 dims (2 KiB a key) in
//!   the kernel's order (tiles of 16 keys, head by head, blocks of 8 keys), each block's 16
//!   accumulators summed and stored, but none of the kernel's reductions into scores: ns per
//!   key for all 8 heads, against the 36 ns of 128 instructions at one per cycle (3.59 GHz).
//!
//! Each figure is the best of 5 runs.

use std::arch::x86_64::*;
use std::time::Instant;

type Bh = __m512bh;

#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn bh(x: __m512i) -> Bh {
    // SAFETY: both are 512-bit vectors of plain bits.
    unsafe { std::mem::transmute::<__m512i, Bh>(x) }
}

#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn sum_all(acc: &[__m512]) -> f32 {
    let t = acc
        .iter()
        .fold(_mm512_setzero_ps(), |t, a| _mm512_add_ps(t, *a));
    _mm512_reduce_add_ps(t)
}

/// One 16-dim step of the score kernel's loop: two q vectors (2 rows each) from `qp`, and for
/// each of 8 keys 16 dims broadcast from `key(j)`, 16 `vdpbf16ps` into `acc`.
///
/// SAFETY: `qp` points at 32 readable u32, each `key(j)` at 16 readable u16.
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn quad_step(acc: &mut [__m512; 16], qp: *const u32, key: impl Fn(usize) -> *const u16) {
    unsafe {
        let q0 = bh(_mm512_loadu_si512(qp.cast()));
        let q1 = bh(_mm512_loadu_si512(qp.add(16).cast()));
        for j in 0..8 {
            let kv = bh(_mm512_broadcast_i64x4(_mm256_loadu_si256(key(j).cast())));
            acc[2 * j] = _mm512_dpbf16_ps(acc[2 * j], q0, kv);
            acc[2 * j + 1] = _mm512_dpbf16_ps(acc[2 * j + 1], q1, kv);
        }
    }
}

/// SAFETY (all kernels): `k` holds at least 1024 elements, `q` at least 256.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn quad(k: &[u16], q: &[u32], iters: usize) -> f32 {
    unsafe {
        let mut acc = [_mm512_setzero_ps(); 16];
        for it in 0..iters {
            let s = it & 7;
            quad_step(&mut acc, q.as_ptr().add(s * 32), |j| {
                k.as_ptr().add(j * 128 + 16 * s)
            });
        }
        sum_all(&acc)
    }
}

#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pair(k: &[u16], q: &[u32], iters: usize) -> f32 {
    unsafe {
        let mut acc = [_mm512_setzero_ps(); 16];
        for it in 0..iters {
            let s = it & 7;
            let v0 = bh(_mm512_loadu_si512(k.as_ptr().add(s * 64).cast()));
            let v1 = bh(_mm512_loadu_si512(k.as_ptr().add(s * 64 + 32).cast()));
            for j in 0..8 {
                let p = bh(_mm512_set1_epi32(*q.as_ptr().add(s * 8 + j) as i32));
                acc[2 * j] = _mm512_dpbf16_ps(acc[2 * j], p, v0);
                acc[2 * j + 1] = _mm512_dpbf16_ps(acc[2 * j + 1], p, v1);
            }
        }
        sum_all(&acc)
    }
}

#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pv(k: &[u16], q: &[u32], iters: usize) -> f32 {
    unsafe {
        let mut acc = [_mm512_setzero_ps(); 16];
        for it in 0..iters {
            let s = it & 7;
            let (r0, r1) = (k.as_ptr().add(s * 128), k.as_ptr().add(s * 128 + 64));
            let mut v = [_mm512_setzero_si512(); 4];
            for j in 0..2 {
                let a = _mm512_loadu_si512(r0.add(j * 32).cast());
                let b = _mm512_loadu_si512(r1.add(j * 32).cast());
                v[2 * j] = _mm512_unpacklo_epi16(a, b);
                v[2 * j + 1] = _mm512_unpackhi_epi16(a, b);
            }
            for i in 0..4 {
                let p = bh(_mm512_set1_epi32(*q.as_ptr().add(s * 4 + i) as i32));
                for (x, vx) in v.iter().enumerate() {
                    acc[4 * i + x] = _mm512_dpbf16_ps(acc[4 * i + x], p, bh(*vx));
                }
            }
        }
        sum_all(&acc)
    }
}

/// SAFETY: `k` holds `keys · 1024` elements (`keys` a multiple of 16), `q` 2048, `out` 1024.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn walk(k: &[u16], keys: usize, q: &[u32], out: &mut [f32]) {
    unsafe {
        for t0 in (0..keys).step_by(16) {
            for hk in 0..8 {
                for kb in (0..16).step_by(8) {
                    let mut acc = [_mm512_setzero_ps(); 16];
                    for s in 0..8 {
                        quad_step(&mut acc, q.as_ptr().add(hk * 256 + s * 32), |j| {
                            k.as_ptr().add((t0 + kb + j) * 1024 + hk * 128 + 16 * s)
                        });
                    }
                    let t = acc
                        .iter()
                        .fold(_mm512_setzero_ps(), |t, a| _mm512_add_ps(t, *a));
                    _mm512_storeu_ps(out.as_mut_ptr().add(((t0 + kb) % 64) * 16), t);
                }
            }
        }
    }
}

fn best_of_5(mut f: impl FnMut()) -> f64 {
    (0..5)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    assert!(
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16"),
        "this probe needs AVX-512F and AVX512_BF16"
    );
    let k = vec![0x3f80u16; 2048];
    let q = vec![0x3f80_3f80u32; 2048];
    let iters = 20_000_000;
    type Kernel = unsafe fn(&[u16], &[u32], usize) -> f32;
    for (name, f) in [("quad", quad as Kernel), ("pair", pair), ("pv", pv)] {
        // SAFETY: k and q are large enough (see the kernels); the CPU has the features (above).
        let t = best_of_5(|| {
            std::hint::black_box(unsafe { f(&k, &q, iters) });
        });
        let dps = 16.0 * iters as f64;
        println!(
            "{name}: {:.3} ns a vdpbf16ps, {:.2} a cycle at 3.59 GHz",
            t * 1e9 / dps,
            dps / t / 3.59e9
        );
    }
    for keys in [16usize, 64, 256, 512, 2048] {
        let k = vec![0x3f80u16; keys * 1024];
        let mut out = vec![0f32; 1024];
        let reps = (20_000_000 / keys).max(1);
        // SAFETY: as `walk` asks; the CPU has the features (above).
        let t = best_of_5(|| {
            for _ in 0..reps {
                unsafe { walk(&k, keys, &q, &mut out) };
                std::hint::black_box(&out);
            }
        });
        let dps = (reps * keys * 8 * 16) as f64;
        println!(
            "walk {keys} keys ({} KiB): {:.1} ns a key, {:.2} vdpbf16ps a cycle",
            keys * 2,
            t * 1e9 / (reps * keys) as f64,
            dps / t / 3.59e9
        );
    }
}
