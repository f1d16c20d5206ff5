//! Software prefetch of the next tile ([`Ahead`]) while the current one computes.

use super::plan::TILE_KEYS_MAX;

/// Most prefetch runs of one tile: one per key and kv head of 8 kv heads, enough for every
/// head-major page of a tile with up to 8 kv heads (the runs past it are not prefetched).
const RUNS_CAP: usize = 8 * TILE_KEYS_MAX;

/// Up to [`RUNS_CAP`] element ranges `[start, end)` of a cache, in order. Not `Copy`: 4 KiB,
/// refilled in place.
#[derive(Debug)]
pub(crate) struct Runs {
    r: [(usize, usize); RUNS_CAP],
    n: usize,
}

impl Default for Runs {
    fn default() -> Self {
        Runs {
            r: [(0, 0); RUNS_CAP],
            n: 0,
        }
    }
}

impl Runs {
    /// Adds `[start, end)`, merged into the last range when it starts inside or right after it;
    /// dropped when [`RUNS_CAP`] ranges are taken (a prefetch is only a hint).
    fn push(&mut self, start: usize, end: usize) {
        match self.r[..self.n].last_mut() {
            Some(r) if start >= r.0 && start <= r.1 => r.1 = r.1.max(end),
            _ if self.n < RUNS_CAP => {
                self.r[self.n] = (start, end);
                self.n += 1;
            }
            _ => {}
        }
    }

    /// Sets the ranges to those holding the rows of all kv heads of the keys with row offsets
    /// `keys` (kv head 0; at most [`TILE_KEYS_MAX`]), adjacent ranges merged. Where a key's rows of
    /// all heads lie together (at most twice their data apart, as in flash-attn's
    /// `[.., seqlen, heads_kv, d]`), one range per key: one run for a tile of a contiguous cache,
    /// one per page of a paged one. Otherwise (e.g. head-major `[.., heads_kv, seqlen, d]`) one
    /// range per head and key, head by head: one run per kv head for a contiguous cache.
    fn fill(&mut self, keys: &[usize], l: crate::params::RowLayout, heads_kv: usize, d: usize) {
        self.n = 0;
        let span = (heads_kv - 1) * l.head_stride + d;
        if span <= 2 * heads_kv * d {
            keys.iter().for_each(|&k| self.push(k, k + span));
        } else {
            for h in 0..heads_kv {
                let at = h * l.head_stride;
                keys.iter().for_each(|&k| self.push(k + at, k + at + d));
            }
        }
    }
}

/// Software prefetch of the next tile, spread evenly over the current one.
///
/// Hardware prefetchers follow demand reads, so without this a tile's keys are fetched only when
/// the products reach them and the core waits for memory between bursts of arithmetic: the
/// single-thread f32 step at 32k keys took 46 ms without, 37 ms with the next tile's lines asked
/// for in bursts of ~500 per kv head (the extra requests block loads once the miss buffers fill),
/// and 25 ms with a few lines asked for per key, so that memory and arithmetic overlap (a busy
/// machine; relative figures). Both products step it, so requests keep going out during P·V.
/// Two tiles ahead measured no better (see [`TILE_KEYS`]). Every line is asked for: every
/// second (leaving the other to the adjacent-line prefetcher) measured 12.8-16.1 ms against
/// 11.4-12.9 ms (f32, 2 threads). `prefetcht1` (into L2): a tile is 64-128 KiB, more than the
/// 32 KiB L1. k and v are asked for in turns of [`TURN_BYTES`].
///
/// [`TILE_KEYS`]: super::plan::TILE_KEYS
pub(crate) struct Ahead {
    /// Byte addresses still to ask for in k and in v: runs `[i..n)`, the first from `next`;
    /// never dereferenced.
    k: Stream,
    v: Stream,
    lines_per_step: usize,
    /// Whose turn it is (v's when true), and the bytes left of it.
    on_v: bool,
    turn_left: usize,
}

/// Bytes of k's lines asked for before v's, and the other way round. Each step used to ask for
/// `lines_per_step` lines of each (turns of 256 bytes of f32 at the decode benchmark shape, 128 of bf16);
/// turns of 512 bytes took 0.91-0.97 of that time in f32 and 0.94-0.99 in bf16 (two threads, 32k
/// keys, six runs of `examples/decode_step` alternating the two, 2026-11-27, AVX-512 host);
/// turns of 1 KiB 0.95-0.99 / 0.94-1.00, 2 KiB 1.02-1.06 / 1.06-1.12, 4-64 KiB (64 KiB: k's whole
/// tile, then v's) 1.03-1.09. One thread: 0.94-1.02 / 0.92-0.96. With the cache in L3 (2048 f32
/// or 4096 bf16 keys, two threads) 512-byte turns took 1.02-1.06 of the time.
const TURN_BYTES: usize = 512;

#[derive(Default)]
struct Stream {
    runs: Runs,
    i: usize,
    next: usize,
}

impl Stream {
    /// Restarts on the byte addresses of the element runs of `keys` (see [`Runs::fill`]) in
    /// `buf`; returns their bytes.
    fn set<T>(
        &mut self,
        buf: &[T],
        keys: &[usize],
        l: crate::params::RowLayout,
        (heads_kv, d): (usize, usize),
    ) -> usize {
        let (base, size) = (buf.as_ptr() as usize, std::mem::size_of::<T>());
        self.runs.fill(keys, l, heads_kv, d);
        let mut bytes = 0;
        for r in &mut self.runs.r[..self.runs.n] {
            *r = (base + r.0 * size, base + r.1 * size);
            bytes += r.1 - r.0;
        }
        (self.i, self.next) = (0, self.runs.r[0].0);
        bytes
    }

    /// Whether every run has been asked for.
    #[inline(always)]
    fn done(&self) -> bool {
        self.i >= self.runs.n
    }

    /// Asks for up to `bytes` more bytes.
    #[inline(always)]
    fn step(&mut self, mut bytes: usize) {
        // Locals, written back once: the loop must not go through `self` per line (the first
        // version did, and took a fifth of the score product's time).
        let (mut i, mut next) = (self.i, self.next);
        while bytes > 0 && i < self.runs.n {
            let end = self.runs.r[i].1;
            let stop = end.min(next + bytes);
            bytes -= stop - next;
            // Four lines an iteration: the loop's own instructions were three of every four
            // (~6% of a bf16 step's instructions on AVX2).
            while next + 4 * CACHE_LINE <= stop {
                for l in 0..4 {
                    prefetch_line(next + l * CACHE_LINE);
                }
                next += 4 * CACHE_LINE;
            }
            while next < stop {
                prefetch_line(next);
                next += CACHE_LINE;
            }
            if next >= end {
                i += 1;
                if i < self.runs.n {
                    next = self.runs.r[i].0;
                }
            }
        }
        (self.i, self.next) = (i, next);
    }
}

impl Ahead {
    /// Nothing to ask for (until [`Ahead::set`]).
    pub fn none() -> Self {
        Ahead {
            k: Stream::default(),
            v: Stream::default(),
            lines_per_step: 0,
            on_v: true,
            turn_left: 0,
        }
    }

    /// Restarts on the rows of all `heads_kv` kv heads of the keys at row offsets `kk` in `k`
    /// and `vk` in `v`, asked for over `steps` calls of [`Ahead::step`].
    #[allow(clippy::type_complexity)]
    pub(super) fn set<T>(
        &mut self,
        (k, kk, kl): (&[T], &[usize], crate::params::RowLayout),
        (v, vk, vl): (&[T], &[usize], crate::params::RowLayout),
        shape: (usize, usize),
        steps: usize,
    ) {
        let kb = self.k.set(k, kk, kl, shape);
        let vb = self.v.set(v, vk, vl, shape);
        self.lines_per_step = kb.max(vb).div_ceil(CACHE_LINE).div_ceil(steps.max(1));
        // k's turn first.
        (self.on_v, self.turn_left) = (true, 0);
    }

    /// Asks for the lines of k and of v that `steps` steps are due: as many bytes as
    /// `lines_per_step` lines of each, from k and v in turns of [`TURN_BYTES`] (all of them from
    /// one stream once the other has none left).
    #[inline(always)]
    pub fn step(&mut self, steps: usize) {
        let mut bytes = 2 * steps * self.lines_per_step * CACHE_LINE;
        while bytes > 0 {
            if self.turn_left == 0 {
                (self.on_v, self.turn_left) = (!self.on_v, TURN_BYTES);
            }
            let (this, other) = match self.on_v {
                true => (&mut self.v, &mut self.k),
                false => (&mut self.k, &mut self.v),
            };
            if this.done() {
                other.step(bytes);
                return;
            }
            let x = bytes.min(self.turn_left);
            this.step(x);
            bytes -= x;
            self.turn_left -= x;
        }
    }
}

/// Asks for the cache line at byte address `addr` (x86-64; a no-op elsewhere). A prefetch
/// cannot fault and reads nothing the program observes.
#[inline(always)]
fn prefetch_line(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; the address is never dereferenced.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        _mm_prefetch::<_MM_HINT_T1>(addr as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

const CACHE_LINE: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    /// The decode benchmark shape's kv heads and head dim, and flash-attn's cache layout for them.
    fn issue_layout() -> ((usize, usize), crate::params::RowLayout) {
        let (heads_kv, d) = (8, 128);
        let dense = crate::params::RowLayout {
            row_stride: heads_kv * d,
            head_stride: d,
        };
        ((heads_kv, d), dense)
    }

    /// The prefetch runs of a tile: one for consecutive keys of a contiguous cache, one per page
    /// of a paged cache (keys on one page merged, pages in any order), one per kv head (and page)
    /// for a head-major layout, capped at RUNS_CAP.
    #[test]
    fn prefetch_runs_follow_pages() {
        use crate::params::RowLayout;
        let ((heads_kv, d), dense) = issue_layout();
        let runs = |keys: &[usize], l| {
            let mut r = Runs::default();
            r.fill(keys, l, heads_kv, d);
            r.r[..r.n].to_vec()
        };
        let contiguous: Vec<usize> = (5..21).map(|j| j * 1024).collect();
        assert_eq!(runs(&contiguous, dense), vec![(5 * 1024, 21 * 1024)]);
        // Page size 2 (2048 elements per page): pages 7 and 3 whole, the first key of 3's
        // neighbour 4 (merged with 3), then the first key of page 0.
        let paged = [
            7 * 2048,
            7 * 2048 + 1024,
            3 * 2048,
            3 * 2048 + 1024,
            4 * 2048,
            0,
        ];
        assert_eq!(
            runs(&paged, dense),
            vec![(7 * 2048, 8 * 2048), (3 * 2048, 4 * 2048 + 1024), (0, 1024)]
        );
        // Head-major [heads_kv, seqlen, d]: one key's heads span 7 × 4096 + 128 elements, so
        // one run per head of the 16 adjacent rows.
        let head_major = RowLayout {
            row_stride: d,
            head_stride: 4096 * d,
        };
        let keys: Vec<usize> = (5..21).map(|j| j * d).collect();
        let want: Vec<_> = (0..heads_kv)
            .map(|h| (h * 4096 * d + 5 * d, h * 4096 * d + 21 * d))
            .collect();
        assert_eq!(runs(&keys, head_major), want);
        // Head-major pages of 1 key: one run per key and head, up to RUNS_CAP, then dropped
        // (40 keys × 8 heads ask for more than the cap).
        let pages: Vec<usize> = (0..40).rev().map(|j| j * 2 * d).collect();
        let got = runs(&pages, head_major);
        assert!(40 * heads_kv > RUNS_CAP);
        assert_eq!(got.len(), RUNS_CAP);
        assert_eq!(got[0], (39 * 2 * d, 39 * 2 * d + d));
        assert_eq!(got[40], (4096 * d + 39 * 2 * d, 4096 * d + 39 * 2 * d + d));
    }

    /// The prefetcher asks for k and v in turns of TURN_BYTES, and for every line of both by the
    /// last step, also when v's tile is shorter than k's.
    #[test]
    fn prefetch_takes_turns_and_asks_for_every_line() {
        let ((heads_kv, d), dense) = issue_layout();
        let buf = vec![0f32; 64 * heads_kv * d];
        let (k, v) = buf.split_at(32 * heads_kv * d);
        let keys: Vec<usize> = (0..16).map(|j| j * heads_kv * d).collect();
        // Bytes asked for so far.
        let asked = |s: &Stream| {
            let done: usize = s.runs.r[..s.i].iter().map(|r| r.1 - r.0).sum();
            done + if s.done() {
                0
            } else {
                s.next - s.runs.r[s.i].0
            }
        };
        let steps = 2 * heads_kv * keys.len();
        let mut ah = Ahead::none();
        ah.set((k, &keys, dense), (v, &keys, dense), (heads_kv, d), steps);
        // 16 keys × 4 KiB of each over 256 steps: 4 lines of each a step, 512 bytes in all.
        assert_eq!(ah.lines_per_step, 4);
        ah.step(1);
        assert_eq!((asked(&ah.k), asked(&ah.v)), (TURN_BYTES, 0));
        ah.step(1);
        assert_eq!((asked(&ah.k), asked(&ah.v)), (TURN_BYTES, TURN_BYTES));
        for _ in 2..steps {
            ah.step(1);
        }
        assert!(ah.k.done() && ah.v.done());
        // v's run a quarter of k's: both get 512 bytes in turns until v's 16 KiB are asked for
        // (step 64), then k takes every step's 512 bytes: its other 48 KiB by step 160.
        let mut ah = Ahead::none();
        ah.set(
            (k, &keys, dense),
            (v, &keys[..4], dense),
            (heads_kv, d),
            steps,
        );
        for _ in 0..64 {
            ah.step(1);
        }
        assert!(ah.v.done() && asked(&ah.k) == 16 << 10);
        for _ in 64..159 {
            ah.step(1);
        }
        assert!(!ah.k.done());
        ah.step(1);
        assert!(ah.k.done());
    }
}
