//! `flashattn peak`: prints this CPU's measured peak f32 FMA and bf16 dot-product rates (see
//! [`crate::cpu_peak`]).

use crate::cpu_peak::{measure, Rate, DEFAULT_SECS, RUNS};
use crate::error::{fail, Result};
use crate::threads::with_threads;

#[derive(clap::Args, Debug)]
pub struct PeakArgs {
    /// Worker threads, all measured at once (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Seconds per run (the best of 3 runs is reported).
    #[arg(long, default_value_t = DEFAULT_SECS)]
    pub secs: f64,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `flashattn peak`: prints the measured peaks.
pub fn peak(args: &PeakArgs) -> Result<()> {
    if !(args.secs > 0.0 && args.secs <= 60.0) {
        return fail(format!("--secs {} must be in (0, 60]", args.secs));
    }
    let p = with_threads(args.threads, || measure(args.secs))?;
    if args.json {
        let line = serde_json::json!({
            "kind": "peak",
            "isa": flashattn::simd::active()?.to_string(),
            "threads": p.threads,
            "peak_f32_gflops": p.f32.map(|r| r.gflops),
            "peak_f32_method": p.f32.map(|r| r.method.name()),
            "peak_bf16_gflops": p.bf16.map(|r| r.gflops),
            "peak_bf16_method": p.bf16.map(|r| r.method.name()),
            "peak_secs_per_run": args.secs,
            "peak_runs": RUNS,
        });
        println!("{line}");
    } else {
        let rate = |r: Option<Rate>| match r {
            Some(r) => format!("{:.1} GFLOP/s ({})", r.gflops, r.method.name()),
            None => "unavailable".into(),
        };
        println!(
            "{} threads: f32 FMA {}, bf16 dot {}; best of {RUNS} runs of {:.2} s",
            p.threads,
            rate(p.f32),
            rate(p.bf16),
            args.secs
        );
    }
    Ok(())
}
