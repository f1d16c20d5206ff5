//! The `flashattn` command: exact attention on safetensors files (`run`), a benchmark of
//! flashattn against naive attention (`bench`), the CPU's peak FLOP rate (`peak`), and a plot of
//! benchmark results (`plot`).

// Commands (each imports only the modules below it, never another command).
mod bench;
mod compile;
mod peak;
mod plot;
mod run;

// Shared pieces, one concern each.
mod accuracy;
mod alloc;
mod args;
mod bandwidth;
mod buf;
mod cpu_peak;
mod error;
mod inputs;
mod output;
mod report;
mod st_io;
mod threads;
mod timing;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// Every allocation is counted so `bench` can report each call's peak extra memory.
#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

#[derive(Parser, Debug)]
#[command(
    name = "flashattn",
    version,
    about = "Exact FlashAttention on the CPU: run it on safetensors files, benchmark it"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Attention on the tensors of IN.safetensors; writes `out` and `lse` to OUT.safetensors.
    Run(args::RunArgs),
    /// Benchmark flashattn against naive attention on seeded random data.
    ///
    /// With no arguments: batch 1, 4 heads, head_dim 64, f32, non-causal, sequence lengths 512,
    /// 2048, 8192 and 16448, on all cores; about 20 s on 2 cores at flashattn's
    /// ~145-155 GFLOP/s (naive at 8192, ~4 s a call, is the largest fixed cost). At 16448 naive
    /// attention would need 8.06 GiB for its N² score and probability matrices, so it is skipped
    /// (see --naive-max-gib) and only flashattn runs, showing its O(N) memory. Each measurement:
    /// median time of repeats after a warm-up, GFLOP/s under flashattn::flops::forward, peak
    /// memory allocated beyond what was live before the call, and the max abs error of 16 sampled
    /// output rows against an f64 reference.
    #[command(long_about)]
    Bench(args::BenchArgs),
    /// Measure this CPU's peak f32 FMA and bf16 dot-product rates (GFLOP/s, all threads at once).
    Peak(peak::PeakArgs),
    /// Draw GFLOP/s against sequence length from JSON results (bench/compare_torch.py's output or
    /// `bench --json` lines) into an SVG file.
    Plot(plot::PlotArgs),
    /// Compile CUDA kernel variants with NVRTC into the kernel disk cache ahead of time (no GPU
    /// needed), so that runs on a GPU of that architecture load them instead of compiling.
    Compile(compile::CompileArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Run(args) => run::run(args),
        Command::Bench(args) => bench::bench(args),
        Command::Peak(args) => peak::peak(args),
        Command::Plot(args) => plot::plot(args),
        Command::Compile(args) => compile::compile(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
