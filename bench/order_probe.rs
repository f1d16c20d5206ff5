//! Reads k and v the way the CPU decode kernel does, on several threads at once, with arithmetic
//! per load and with or without software prefetch: does reading in memory order let the hardware
//! prefetcher replace the kernel's `prefetcht1` of every line? (docs/PERFORMANCE.md, "Decoding
//! with a KV cache"). x86-64 with AVX-512F only.
//!
//!     rustc -C opt-level=3 -C target-cpu=native bench/order_probe.rs -o /tmp/order_probe
//!     CFGS=0:64:4,2:0:4,2:0:1 /tmp/order_probe 2
//!
//! The argument is the thread count (default 2); each thread owns a k and a v region of 128 MiB
//! (`MIB=n` changes it) in transparent huge pages, cut into tiles of 16 keys × 4 KiB (8 kv heads
//! × 128 f32, the decode benchmark shape), read k tile then v tile. `CFGS` lists configurations
//! `order:stride:fmas[:l1]`, run in turns over `ROUNDS` rounds (default 7), so that a shared host's
//! slow phases fall on all of them alike:
//! - order 0: each tile in sub-blocks of 8 keys, kv head by kv head (the kernel's f32 order: 8
//!   rows 4 KiB apart, 512 bytes each); order 1: the same in 4-key blocks; order 2: memory order;
//!   order 3: all of k, then all of v, in memory order (one stream at a time, as `flashattn
//!   bench --decode` reads its buffer to measure the read rate; the stride is ignored); order 4:
//!   k's tile in memory order (`KORD=o`: in order o instead), v's in the kernel's order, and
//!   only v's lines prefetched (half as many each step);
//! - stride: 0, no software prefetch; else a `prefetcht1` every `stride` bytes of the next tile,
//!   spread over the current one with k and v in turns of 512 bytes (as `cpu::decode::Ahead`);
//!   `TOUCH=1` turns those prefetches into one-byte loads; `BURST=n` asks for n steps' lines at
//!   once every n steps of 256 bytes (the f32 score kernel asks for 32 lines before each 2 KiB
//!   it reads: `BURST=8`);
//! - fmas: 1, 2 or 4 FMAs per 64-byte load (the kernel's products do 4 per load of k or v);
//! - l1 (optional, default 0): n loads, FMAs and stores of a 16 KiB per-thread accumulator per
//!   64-byte load (the L1 traffic of a memory-order P·V, whose accumulators cannot stay in
//!   registers); 100 + n: n loads and FMAs, no stores (the q reloads of a memory-order score
//!   product).
//!
//! `BF16=1` takes bf16's geometry (2 KiB a key, 256-byte rows; order 0 then walks the whole tile
//! head by head, as the bf16 kernel does); `REPS=n` makes n passes per thread and round (for
//! regions small enough to stay in cache, e.g. `MIB=1 REPS=200`).
//!
//! Prints per configuration the median, min and max GB/s (1e9 bytes/s) of all threads together,
//! and each round's figure.

use std::arch::x86_64::*;
use std::time::Instant;

/// Bytes of a key's rows of all kv heads (4 KiB: f32; `BF16=1`: 2 KiB) and of one kv head's row.
static ROW: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(4096);
static HEAD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(512);

fn row() -> usize {
    ROW.load(std::sync::atomic::Ordering::Relaxed)
}
const TILE_KEYS: usize = 16;

/// The software prefetch of the next tile: `per` bytes' worth of lines each step, from k and v
/// in turns of 512 bytes.
struct Ahead {
    stride: usize,
    touch: bool,
    k: usize,
    k_end: usize,
    v: usize,
    v_end: usize,
    on_v: bool,
    turn_left: usize,
    per: usize,
    /// Steps (of 256 bytes read) between prefetch bursts, and those left until the next.
    burst: usize,
    wait: usize,
}

impl Ahead {
    /// One step of 256 bytes read: a burst of `per` bytes' lines every `burst` steps.
    #[inline(always)]
    fn tick(&mut self) {
        if self.wait == 0 {
            self.wait = self.burst;
            self.step();
        }
        self.wait -= 1;
    }

    #[inline(always)]
    fn step(&mut self) {
        let mut bytes = self.per;
        while bytes > 0 {
            if self.turn_left == 0 {
                (self.on_v, self.turn_left) = (!self.on_v, 512);
            }
            let (at, end) = match self.on_v {
                true => (&mut self.v, self.v_end),
                false => (&mut self.k, self.k_end),
            };
            if *at >= end {
                if self.k >= self.k_end && self.v >= self.v_end {
                    return;
                }
                self.turn_left = 0;
                continue;
            }
            if self.touch {
                // SAFETY: `*at` lies inside the next tile of a live buffer.
                unsafe { std::ptr::read_volatile(*at as *const u8) };
            } else {
                // SAFETY: a prefetch is a hint and never faults.
                unsafe { _mm_prefetch::<_MM_HINT_T1>(*at as *const i8) };
            }
            *at += self.stride;
            bytes -= bytes.min(64);
            self.turn_left -= self.turn_left.min(64);
        }
    }
}

/// Reads `bytes` from `p` in 4 × 64-byte loads per step, `W` FMAs per load.
///
/// # Safety
/// AVX-512F present; `p..p + bytes` readable, `bytes` a multiple of 256.
#[target_feature(enable = "avx512f")]
unsafe fn read<const W: usize>(
    p: *const u8,
    bytes: usize,
    acc: &mut [__m512; 8],
    ahead: &mut Option<Ahead>,
    (l1, l1buf): (usize, *mut __m512),
) {
    let q = _mm512_set1_ps(1.0001);
    let mut i = 0;
    while i < bytes {
        if let Some(a) = ahead.as_mut() {
            a.tick();
        }
        for l in 0..4 {
            // SAFETY: the caller's contract.
            let x = unsafe { _mm512_loadu_ps(p.add(i + 64 * l).cast()) };
            for j in 0..W {
                acc[(2 * l + j) & 7] = _mm512_fmadd_ps(x, q, acc[(2 * l + j) & 7]);
            }
            // `l1` = n: n loads, FMAs and stores of an L1-resident accumulator per load, as a
            // memory-order P·V keeps its accumulators in memory.
            if l1 >= 100 {
                // `l1` = 100 + n: n loads from the buffer, FMAs into registers, no stores (the
                // q reloads of a memory-order score product).
                for j in 0..l1 - 100 {
                    let at = (((i >> 6) + l) * (l1 - 100) + j) & 255;
                    // SAFETY: as below.
                    let y = unsafe { _mm512_load_ps(l1buf.add(at).cast()) };
                    acc[j & 7] = _mm512_fmadd_ps(x, y, acc[j & 7]);
                }
            } else {
                for j in 0..l1 {
                    let at = (((i >> 6) + l) * l1 + j) & 255;
                    // SAFETY: `l1buf` is a thread's live 256-vector buffer; `at < 256`.
                    unsafe {
                        let a = l1buf.add(at);
                        _mm512_store_ps(a.cast(), _mm512_fmadd_ps(x, q, _mm512_load_ps(a.cast())));
                    }
                }
            }
        }
        i += 256;
    }
}

/// Reads one tile at `base` in `order`.
///
/// # Safety
/// As [`read`], for the tile's `TILE_KEYS · ROW` bytes.
#[target_feature(enable = "avx512f")]
unsafe fn tile<const W: usize>(
    base: *const u8,
    order: usize,
    acc: &mut [__m512; 8],
    ahead: &mut Option<Ahead>,
    l1: (usize, *mut __m512),
) {
    // SAFETY (all reads): the caller's contract; every piece lies inside the tile.
    unsafe {
        if order == 2 {
            return read::<W>(base, TILE_KEYS * row(), acc, ahead, l1);
        }
        let hb = HEAD.load(std::sync::atomic::Ordering::Relaxed);
        // bf16: the kernel takes the whole 16-key tile (32 KiB) kv head by kv head.
        let sub = match order {
            0 if hb == 256 => 16,
            0 => 8,
            _ => 4,
        };
        for s in (0..TILE_KEYS).step_by(sub) {
            for h in 0..row() / hb {
                for key in s..s + sub {
                    read::<W>(base.add(key * row() + h * hb), hb, acc, ahead, l1);
                }
            }
        }
    }
}

/// One pass over a thread's k and v regions.
///
/// # Safety
/// AVX-512F present; `k.len() == v.len()`.
#[target_feature(enable = "avx512f")]
unsafe fn pass<const W: usize>(
    k: &[u8],
    v: &[u8],
    order: usize,
    stride: usize,
    (touch, burst): (bool, usize),
    l1: usize,
) -> f32 {
    let mut acc = [_mm512_setzero_ps(); 8];
    // `l1`'s 16 KiB accumulator buffer (one per thread and pass).
    let mut l1buf = vec![_mm512_setzero_ps(); 256];
    let l1 = (l1, l1buf.as_mut_ptr());
    let tb = TILE_KEYS * row();
    let tiles = k.len() / tb;
    if order == 3 {
        // All of k, then all of v, in memory order, no prefetch: one stream at a time.
        for buf in [k, v] {
            // SAFETY: the whole region, read in memory order.
            unsafe { read::<W>(buf.as_ptr(), tiles * tb, &mut acc, &mut None, l1) };
        }
    } else {
        for t in 0..tiles {
            let mut ahead = (stride > 0 && t + 1 < tiles).then(|| {
                let (k0, v0) = (
                    k.as_ptr() as usize + (t + 1) * tb,
                    v.as_ptr() as usize + (t + 1) * tb,
                );
                Ahead {
                    stride,
                    touch,
                    k: k0,
                    k_end: if order == 4 { k0 } else { k0 + tb },
                    v: v0,
                    v_end: v0 + tb,
                    on_v: true,
                    turn_left: 0,
                    // The next tile's k and v (2 · tb bytes, one line each `stride`) over the
                    // current tile's 2 · tb / 256 steps.
                    per: 256 * 64 / stride * burst / if order == 4 { 2 } else { 1 },
                    burst,
                    wait: 0,
                }
            });
            // SAFETY: tile t lies inside both regions.
            unsafe {
                let (ko, vo) = if order == 4 {
                    (env("KORD", 2usize), 0)
                } else {
                    (order, order)
                };
                tile::<W>(k.as_ptr().add(t * tb), ko, &mut acc, &mut ahead, l1);
                tile::<W>(v.as_ptr().add(t * tb), vo, &mut acc, &mut ahead, l1);
            }
        }
    }
    let s = acc
        .iter()
        .chain(&l1buf)
        .fold(_mm512_setzero_ps(), |s, a| _mm512_add_ps(s, *a));
    _mm512_reduce_add_ps(s)
}

extern "C" {
    fn madvise(addr: *mut u8, len: usize, advice: i32) -> i32;
}

/// A region of `bytes` starting on a 2 MiB boundary, advised for huge pages, every byte written.
fn region(bytes: usize, seed: u8) -> (Vec<u8>, usize) {
    const HUGE: usize = 2 << 20;
    let mut v = vec![0u8; bytes + HUGE];
    let off = (HUGE - v.as_ptr() as usize % HUGE) % HUGE;
    // SAFETY: the range lies inside `v`; MADV_HUGEPAGE (14) only advises.
    unsafe { madvise(v.as_mut_ptr().add(off), bytes, 14) };
    for (i, x) in v[off..off + bytes].iter_mut().enumerate() {
        *x = ((i >> 6) as u8 ^ seed) & 0x3f;
    }
    (v, off)
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|x| x.parse().ok())
        .unwrap_or(default)
}

fn main() {
    assert!(is_x86_feature_detected!("avx512f"), "needs AVX-512F");
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|x| x.parse().ok())
        .unwrap_or(2);
    let bytes = env("MIB", 128usize) << 20;
    if std::env::var_os("BF16").is_some() {
        ROW.store(2048, std::sync::atomic::Ordering::Relaxed);
        HEAD.store(256, std::sync::atomic::Ordering::Relaxed);
    }
    let rounds = env("ROUNDS", 7usize);
    // `REPS=n`: n passes per thread and round (for regions small enough to stay in cache).
    let reps = env("REPS", 1usize).max(1);
    let touch = std::env::var_os("TOUCH").is_some();
    let burst = env("BURST", 1usize).max(1);
    let cfgs: Vec<[usize; 4]> = env("CFGS", "0:64:4,2:0:4,2:0:1".to_string())
        .split(',')
        .map(|c| {
            let v: Vec<usize> = c
                .split(':')
                .map(|x| x.parse().expect("CFGS: order:stride:fmas[:l1]"))
                .collect();
            [v[0], v[1], v[2], v.get(3).copied().unwrap_or(0)]
        })
        .collect();
    let regions: Vec<_> = (0..threads)
        .map(|t| (region(bytes, t as u8), region(bytes, t as u8 ^ 0x55)))
        .collect();
    let mut rates = vec![Vec::new(); cfgs.len()];
    for _ in 0..rounds {
        for (ci, &[order, stride, fmas, l1]) in cfgs.iter().enumerate() {
            let t = Instant::now();
            std::thread::scope(|s| {
                for ((k, ko), (v, vo)) in &regions {
                    let (k, v) = (&k[*ko..*ko + bytes], &v[*vo..*vo + bytes]);
                    s.spawn(move || {
                        for _ in 0..reps {
                            // SAFETY: AVX-512F checked above; k and v have the same length.
                            let r = unsafe {
                                match fmas {
                                    1 => pass::<1>(k, v, order, stride, (touch, burst), l1),
                                    2 => pass::<2>(k, v, order, stride, (touch, burst), l1),
                                    _ => pass::<4>(k, v, order, stride, (touch, burst), l1),
                                }
                            };
                            std::hint::black_box(r);
                        }
                    });
                }
            });
            rates[ci].push((reps * threads * 2 * bytes) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    for (c, r) in cfgs.iter().zip(&rates) {
        let mut s = r.clone();
        s.sort_by(f64::total_cmp);
        let each: Vec<String> = r.iter().map(|x| format!("{x:.1}")).collect();
        println!(
            "order {} stride {:4} fmas {} l1 {}{}: median {:5.1} GB/s (min {:5.1}, max {:5.1}); rounds {}",
            c[0],
            c[1],
            c[2],
            c[3],
            if touch && c[1] > 0 { " touch" } else { "" },
            s[s.len() / 2],
            s[0],
            s[s.len() - 1],
            each.join(" ")
        );
    }
}
