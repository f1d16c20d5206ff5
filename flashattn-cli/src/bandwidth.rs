//! This machine's memory bandwidth, which `bench --decode` divides its KV GB/s by: measured once
//! at the start of the run, and again around each measurement.

use crate::buf::{cache_vec, try_vec};
use crate::error::Result;
use rayon::prelude::*;
use serde::Serialize;
use std::time::Instant;

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
            src: cache_vec(what, huge, values)?,
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
    let mut dst = try_vec(what, std::iter::repeat_n(0u64, src.len()))?;
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
