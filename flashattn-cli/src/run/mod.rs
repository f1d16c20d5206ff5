//! `flashattn run IN OUT`: attention on the tensors of a safetensors file.

mod cuda;
mod fp8;
mod kvcache;

use crate::args::{Device, RunArgs};
use crate::error::{CliError, Result};
use crate::output::write_atomically;
use crate::st_io;
use crate::threads::with_threads;
use flashattn::{AttnGrads, AttnOutput};

pub fn run(args: &RunArgs) -> Result<()> {
    if kvcache::is_kvcache_file(&args.input) {
        return kvcache::run(args);
    }
    if fp8::is_fp8_file(&args.input) {
        return fp8::run(args);
    }
    let inputs = st_io::load(&args.input)?;
    write_atomically(&args.output, || {
        let (res, grads) = with_threads(args.threads, || compute(&inputs, args))??;
        st_io::serialize(&res, grads.as_ref().map(|g| (g, &inputs.qkv)))
    })
}

/// Forward, and backward when the file holds `dout`.
fn compute(inputs: &st_io::Inputs, args: &RunArgs) -> Result<(AttnOutput, Option<AttnGrads>)> {
    let mut opts = args.attn_options(inputs.alibi_slopes.as_ref(), inputs.learnable_sink.as_ref());
    let [q, k, v] = inputs.qkv.views();
    match &inputs.cu_seqlens {
        Some((cq, ck)) => opts = opts.varlen(cq, ck),
        None if q.shape().len() == 3 => {
            // The likeliest cause of a rank-3 q is a packed file without its offsets.
            return Err(CliError(format!(
                "tensor `q` has rank 3 (shape {:?}); the batched layout needs [batch, seqlen, heads, head_dim], \
                 the packed layout [total, heads, head_dim] needs tensors cu_seqlens_q and cu_seqlens_k",
                q.shape()
            )));
        }
        None => {}
    }
    let dout = inputs.dout.as_ref().map(|t| t.view());
    if args.device == Device::Cuda {
        return cuda::compute(&q, &k, &v, dout.as_ref(), &opts);
    }
    let res = flashattn::flash_attn(&q, &k, &v, &opts)?;
    let grads = match &dout {
        Some(dout) => Some(res.backward(&q, &k, &v, dout, &opts)?),
        None => None,
    };
    Ok((res, grads))
}
