//! `flashattn run IN OUT`: attention on the tensors of a safetensors file.

use crate::cuda::Device;
use crate::error::{CliError, Result};
use crate::st_io;
use crate::threads::with_threads;
use flashattn::{AttnGrads, AttnOptions, AttnOutput};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Input file with tensors q, k, v (F32, F16 or BF16, all the same; or F8_E4M3 / F8_E5M2,
    /// all the same, with optional F32 q_descale, k_descale, v_descale of 1 or batch · heads_kv
    /// values: forward only, `out` in BF16), optionally alibi_slopes
    /// (F32, [heads] or [batch, heads]) and cu_seqlens_q + cu_seqlens_k (I32; selects the packed
    /// layout q [total_q, heads, d], k/v [total_k, heads_kv, d]; otherwise q is
    /// [batch, seqlen_q, heads, d], k/v [batch, seqlen_k, heads_kv, d]), and optionally dout
    /// (q's shape and dtype), which runs the backward pass too. A file holding k_cache decodes
    /// instead: q, k_cache, v_cache, cache_seqlens (I32) and optionally k_new, v_new,
    /// block_table, cache_batch_idx, cache_leftpad, cu_seqlens_q (I32; packs q as
    /// [total_q, heads, d]), cu_seqlens_k_new (I32; packs k_new/v_new as
    /// [total_k_new, heads_kv, d]), rotary_cos, rotary_sin, alibi_slopes; k_cache and v_cache
    /// may be F8_E4M3 or F8_E5M2 (q and k_new/v_new then stay in their float dtype, with optional
    /// F32 k_descale, v_descale of 1 or batch · heads_kv values; the caches are written back FP8).
    pub input: PathBuf,
    /// Output file: gets `out` (q's dtype and shape) and `lse` (F32), and `dq`, `dk`, `dv` (the
    /// shapes and dtype of q, k, v) when the input holds `dout`, or the updated `k_cache` and
    /// `v_cache` when it holds k_cache. Written only on success,
    /// through a temporary file renamed into place; an existing file is untouched on failure.
    pub output: PathBuf,
    /// Causal mask aligned to the bottom-right corner (same as --window-right 0).
    #[arg(long)]
    pub causal: bool,
    /// Keys visible to the left of the diagonal; -1 = unbounded.
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub window_left: i64,
    /// Keys visible to the right of the diagonal; -1 = unbounded.
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub window_right: i64,
    /// Soft-cap the scores: softcap * tanh(scores / softcap).
    #[arg(long, allow_negative_numbers = true)]
    pub softcap: Option<f32>,
    /// Softmax scale (default 1/sqrt(head_dim)).
    #[arg(long, allow_negative_numbers = true)]
    pub scale: Option<f32>,
    /// Dropout probability on the attention probabilities, in [0, 1) (Philox mask keyed by --seed).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub dropout: f32,
    /// Seed of the dropout mask.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// KV-cache files: rotary embedding in GPT-J style (pairs 2i, 2i+1) instead of GPT-NeoX
    /// (pairs i, i + rotary_dim/2).
    #[arg(long)]
    pub rotary_interleaved: bool,
    /// KV-cache files: number of key splits (default: chosen from the shape and thread count).
    #[arg(long)]
    pub num_splits: Option<usize>,
    /// Where to compute: the CPU, or NVIDIA GPU 0 (the forward and KV-cache decoding; kernels
    /// compiled by NVRTC at first use).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
}

impl RunArgs {
    /// The attention options these flags ask for, with the file's ALiBi slopes and learnable
    /// sinks.
    pub fn attn_options<'a>(
        &self,
        alibi_slopes: Option<&'a st_io::Loaded>,
        learnable_sink: Option<&'a st_io::Loaded>,
    ) -> AttnOptions<'a> {
        AttnOptions {
            softmax_scale: self.scale,
            causal: self.causal,
            window: (self.window_left, self.window_right),
            softcap: self.softcap,
            alibi_slopes: alibi_slopes.map(|a| a.view()),
            learnable_sink: learnable_sink.map(|s| s.view()),
            dropout_p: self.dropout,
            seed: self.seed,
            isa: None,
        }
    }
}

pub fn run(args: &RunArgs) -> Result<()> {
    if crate::decode::is_kvcache_file(&args.input) {
        return crate::decode::run(args);
    }
    if crate::fp8::is_fp8_file(&args.input) {
        return crate::fp8::run(args);
    }
    let inputs = st_io::load(&args.input)?;
    write_atomically(&args.output, || {
        let (res, grads) = with_threads(args.threads, || compute(&inputs, args))??;
        st_io::serialize(&res, grads.as_ref().map(|g| (g, &inputs.qkv)))
    })
}

/// Computes the bytes of OUT with `produce` and writes them to `output` atomically. The temporary
/// file is created before computing, so an unwritable destination fails fast; it lives next to
/// OUT so the final rename stays on one filesystem (atomic), and it is deleted when dropped on
/// any error path, so a failure leaves an existing OUT untouched.
pub fn write_atomically(output: &Path, produce: impl FnOnce() -> Result<Vec<u8>>) -> Result<()> {
    let dir = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::Builder::new()
        .prefix(".flashattn-")
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| {
            CliError(format!(
                "cannot create a temporary file in {}: {e}",
                dir.display()
            ))
        })?;

    let bytes = produce()?;

    let shown = output.display();
    let write_err = |e: std::io::Error| CliError(format!("cannot write {shown}: {e}"));
    tmp.write_all(&bytes).map_err(write_err)?;
    tmp.as_file().sync_all().map_err(write_err)?;
    set_readable(tmp.as_file()).map_err(write_err)?;
    tmp.persist(output).map_err(|e| write_err(e.error))?;
    Ok(())
}

/// Forward, and backward when the file holds `dout`.
fn compute(inputs: &st_io::Inputs, args: &RunArgs) -> Result<(AttnOutput, Option<AttnGrads>)> {
    let opts = args.attn_options(inputs.alibi_slopes.as_ref(), inputs.learnable_sink.as_ref());
    let [q, k, v] = inputs.qkv.views();
    let dout = inputs.dout.as_ref().map(|t| t.view());
    if args.device == Device::Cuda {
        let cu = inputs
            .cu_seqlens
            .as_ref()
            .map(|(cq, ck)| (cq.as_slice(), ck.as_slice()));
        return crate::cuda::compute(&q, &k, &v, dout.as_ref(), cu, &opts);
    }
    match &inputs.cu_seqlens {
        Some((cq, ck)) => {
            let res = flashattn::flash_attn_varlen(&q, &k, &v, cq, ck, &opts)?;
            let grads = match &dout {
                Some(dout) => Some(flashattn::flash_attn_varlen_backward(
                    &q,
                    &k,
                    &v,
                    &res.out.view(),
                    &res.lse.view(),
                    dout,
                    cq,
                    ck,
                    &opts,
                )?),
                None => None,
            };
            Ok((res, grads))
        }
        None => {
            if q.shape().len() == 3 {
                // The likeliest cause of a rank-3 q is a packed file without its offsets.
                return Err(CliError(format!(
                    "tensor `q` has rank 3 (shape {:?}); the batched layout needs [batch, seqlen, heads, head_dim], \
                     the packed layout [total, heads, head_dim] needs tensors cu_seqlens_q and cu_seqlens_k",
                    q.shape()
                )));
            }
            let res = flashattn::flash_attn(&q, &k, &v, &opts)?;
            let grads = match &dout {
                Some(dout) => Some(res.backward(&q, &k, &v, dout, &opts)?),
                None => None,
            };
            Ok((res, grads))
        }
    }
}

/// Temporary files are created 0600; the result should have the usual permissions of a new file.
#[cfg(unix)]
fn set_readable(f: &std::fs::File) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    f.set_permissions(std::fs::Permissions::from_mode(0o644))
}

#[cfg(not(unix))]
fn set_readable(_: &std::fs::File) -> std::io::Result<()> {
    Ok(())
}
