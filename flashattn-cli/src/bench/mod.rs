//! `flashattn bench`: flashattn against naive (materialising) attention on seeded random data.

mod cuda;
mod decode;
mod forward;

use crate::args::{BenchArgs, Device, DtypeArg};
use crate::error::{fail, Result};
use crate::threads::with_threads;

/// `flashattn bench`: checks the flags, then runs the mode they ask for (the forward or
/// `--decode`, on the CPU or with `--device cuda`).
pub fn bench(args: &BenchArgs) -> Result<()> {
    if let Some(f) = args.dtype.and_then(DtypeArg::fp8) {
        if args.backward {
            return fail(format!(
                "--dtype {f}: FP8 runs the forward and --decode (FP8 KV caches); no --backward"
            ));
        }
    }
    if args.fp8_per_block && (args.decode || args.dtype.and_then(DtypeArg::fp8).is_none()) {
        return fail(
            "--fp8-per-block: per-block descale factors need --dtype e4m3 or e5m2 and the forward (the FP8 decode keeps per-head factors)",
        );
    }
    if args.decode {
        let sqs = decode::validate(args)?;
        if args.device == Device::Cuda {
            return cuda::bench_decode(args, &sqs);
        }
        return with_threads(args.threads, || decode::bench_in_pool(args, &sqs))?;
    }
    let cases = forward::validate(args)?;
    if args.device == Device::Cuda {
        return cuda::bench(&cuda::BenchConfig {
            batch: args.batch,
            heads: args.heads(),
            heads_kv: args.heads_kv(),
            seqlens: cases,
            head_dim: args.head_dim(),
            dtype: args.dtype.unwrap_or(DtypeArg::F32).dtype(),
            fp8: args.dtype.and_then(DtypeArg::fp8),
            fp8_per_block: args.fp8_per_block,
            causal: args.causal,
            backward: args.backward,
            min_time: args.min_time,
            seed: args.seed,
            json: args.json,
        });
    }
    with_threads(args.threads, || forward::bench_in_pool(args, &cases))?
}
