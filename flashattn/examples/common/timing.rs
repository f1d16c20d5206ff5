//! Shared by the timing examples: CPU-time clocks and seeded input values.

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
