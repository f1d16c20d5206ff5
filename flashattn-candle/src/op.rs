//! The candle custom op: the forward on CPU storages, the backward for candle's autograd.
//!
//! The forward keeps its `lse` (f32, `[batch, heads, seqlen_q]` or `[heads, total_q]`) in the op,
//! which candle's graph holds for as long as the result may be differentiated, and drops with it
//! otherwise: 1/head_dim of `out`'s elements, against a whole second forward to recompute it in
//! the backward. One op value serves one call (the public functions make a new one each time), so
//! the kept `lse` always belongs to the `out` that the backward receives.

use std::sync::Mutex;

use candle_core::{
    CpuStorage, CudaStorage, CustomOp3, Error, Layout, MetalStorage, Result, Shape, Tensor,
};

use crate::convert::{cpu, last_dim_contiguous, storage, tensor, view, wrap};
use crate::options::HostOptions;

pub(crate) struct FlashAttnOp {
    opts: HostOptions,
    /// The forward's log-sum-exp, set by `cpu_fwd`, read by `bwd`.
    lse: Mutex<Option<flashattn::Tensor>>,
}

impl FlashAttnOp {
    pub fn new(opts: HostOptions) -> Self {
        FlashAttnOp {
            opts,
            lse: Mutex::new(None),
        }
    }
}

fn poisoned() -> Error {
    Error::Msg("flashattn-candle: a forward on another thread panicked while storing lse".into())
}

impl CustomOp3 for FlashAttnOp {
    fn name(&self) -> &'static str {
        "flashattn"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (q, k, v) = (view(q, q_l, "q")?, view(k, k_l, "k")?, view(v, v_l, "v")?);
        let res = flashattn::flash_attn(&q, &k, &v, &self.opts.attn()).map_err(wrap)?;
        let shape = Shape::from(res.out.shape());
        *self.lse.lock().map_err(|_| poisoned())? = Some(res.lse);
        Ok((storage(res.out.into_buffer()), shape))
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        Err(Error::Msg(format!(
            "flashattn-candle: CUDA tensors are not supported by this op yet; {}",
            crate::UNSUPPORTED_DEVICE
        )))
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> Result<(MetalStorage, Shape)> {
        Err(Error::Msg(format!(
            "flashattn-candle: Metal tensors are not supported by this op; {}",
            crate::UNSUPPORTED_DEVICE
        )))
    }

    /// dq, dk, dv of `Σ out ∘ grad_out` by flashattn's backward, from the kept `lse`.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The gradient of a sum or a mean reaches here broadcast (all strides 0).
        let grad_out = last_dim_contiguous(grad_out)?;
        let grads = {
            let lse = self.lse.lock().map_err(|_| poisoned())?;
            let lse = lse.as_ref().ok_or_else(|| {
                Error::Msg("flashattn-candle: backward before the forward ran".into())
            })?;
            let (qs, q_l) = q.storage_and_layout();
            let (ks, k_l) = k.storage_and_layout();
            let (vs, v_l) = v.storage_and_layout();
            let (os, o_l) = out.storage_and_layout();
            let (gs, g_l) = grad_out.storage_and_layout();
            let q = view(cpu(&qs, "q")?, q_l, "q")?;
            let k = view(cpu(&ks, "k")?, k_l, "k")?;
            let v = view(cpu(&vs, "v")?, v_l, "v")?;
            let o = view(cpu(&os, "out")?, o_l, "out")?;
            let g = view(cpu(&gs, "grad_out")?, g_l, "grad_out")?;
            flashattn::flash_attn_backward(&q, &k, &v, &o, &lse.view(), &g, &self.opts.attn())
                .map_err(wrap)?
        };
        let device = q.device();
        Ok((
            Some(tensor(grads.dq, device)?),
            Some(tensor(grads.dk, device)?),
            Some(tensor(grads.dv, device)?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FlashAttnOptions;

    /// Without candle's `cuda` feature `CudaStorage` is a placeholder that can be built here, so
    /// the op's CUDA path runs on any host; the message must say what is unsupported.
    #[test]
    fn cuda_fwd_says_cuda_is_unsupported() {
        let op = FlashAttnOp::new(HostOptions::new(&FlashAttnOptions::default()).unwrap());
        let l = Layout::contiguous((1, 4, 2, 8));
        let s = CudaStorage;
        let err = op.cuda_fwd(&s, &l, &s, &l, &s, &l).unwrap_err().to_string();
        assert!(
            err.contains("CUDA tensors are not supported by this op yet"),
            "{err}"
        );
    }
}
