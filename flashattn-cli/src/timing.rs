//! Timing a CPU call: a warm-up, then timed repeats (median and minimum), each with the peak
//! memory it allocated beyond what was live before it.

use crate::alloc;
use crate::error::Result;
use std::time::Instant;

/// Cap on repeats of very short shapes, so `--min-time` is what bounds them in practice.
const MAX_REPS: usize = 1000;

pub struct Timing<R> {
    pub median_s: f64,
    pub min_s: f64,
    pub reps: usize,
    pub peak_extra: usize,
    /// The warm-up's result, kept for the accuracy check.
    pub first: R,
}

/// The numbers of a [`Timing`], whatever the call returned.
#[derive(Clone, Copy)]
pub struct Stats {
    pub median_s: f64,
    pub min_s: f64,
    pub reps: usize,
    pub peak_extra: usize,
}

impl<R> Timing<R> {
    pub fn stats(&self) -> Stats {
        Stats {
            median_s: self.median_s,
            min_s: self.min_s,
            reps: self.reps,
            peak_extra: self.peak_extra,
        }
    }
}

/// One timed, memory-counted call. The result is returned so it is dropped outside the timing.
fn timed_call<R>(f: &mut dyn FnMut() -> flashattn::Result<R>) -> Result<(R, f64, usize)> {
    let ((res, secs), peak) = alloc::peak_extra(|| {
        let t = Instant::now();
        let r = f();
        (r, t.elapsed().as_secs_f64())
    });
    Ok((res?, secs, peak))
}

/// A warm-up call (faults in fresh pages, wakes the pool), then timed repeats until `min_time`
/// seconds are spent: at least 3, or 1 when the warm-up alone took `min_time` (long shapes, where
/// a second and third repeat would cost more than they tell).
pub fn measure<R>(min_time: f64, mut f: impl FnMut() -> flashattn::Result<R>) -> Result<Timing<R>> {
    let (first, warm_s, mut peak_extra) = timed_call(&mut f)?;
    let min_reps = if warm_s >= min_time { 1 } else { 3 };
    let mut times = Vec::new();
    let mut spent = 0.0;
    while times.len() < min_reps || (spent < min_time && times.len() < MAX_REPS) {
        let (res, secs, peak) = timed_call(&mut f)?;
        drop(res);
        peak_extra = peak_extra.max(peak);
        times.push(secs);
        spent += secs;
    }
    times.sort_by(f64::total_cmp);
    let n = times.len();
    let median_s = if n % 2 == 1 {
        times[n / 2]
    } else {
        (times[n / 2 - 1] + times[n / 2]) / 2.0
    };
    Ok(Timing {
        median_s,
        min_s: times[0],
        reps: n,
        peak_extra,
        first,
    })
}
