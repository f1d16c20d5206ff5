//! Shared by the timing examples: CPU-time clocks, seeded input values, medians and the shape
//! arguments; each example uses a part of it.
#![allow(dead_code)]

/// Seconds of CPU time on `clock` (`libc::CLOCK_PROCESS_CPUTIME_ID` or
/// `libc::CLOCK_THREAD_CPUTIME_ID`).
pub fn cpu_secs(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to write.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// `len` values in [-1, 1) from a linear congruential generator seeded by `seed`.
pub fn values(len: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The arguments the CPU-time examples share: `N D [words...] [THREADS] [REPS]`, the words
/// (`causal`, `bwd`, `bf16`) anywhere after N and D.
pub struct ShapeArgs {
    pub n: usize,
    pub d: usize,
    pub threads: usize,
    pub reps: usize,
    words: Vec<String>,
}

impl ShapeArgs {
    /// From the process's arguments: N (default 1024), D (64), THREADS (2), REPS (5).
    pub fn from_env() -> ShapeArgs {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let n = args.first().and_then(|s| s.parse().ok()).unwrap_or(1024);
        let d = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(64);
        let nums: Vec<usize> = args[2.min(args.len())..]
            .iter()
            .filter_map(|s| s.parse().ok())
            .collect();
        ShapeArgs {
            n,
            d,
            threads: nums.first().copied().unwrap_or(2),
            reps: nums.get(1).copied().unwrap_or(5),
            words: args,
        }
    }

    /// Whether `word` was given.
    pub fn has(&self, word: &str) -> bool {
        self.words.iter().any(|a| a == word)
    }
}
