//! The CUDA backend against the f64 reference, on the same cases as the CPU forward tests (the
//! covering grid of `common::grid` in f32, f16 and bf16, plus varlen), with the same error bound:
//! within 2x the naive algorithm's error in the same precision, plus a small floor.
//!
//! Without a GPU these tests print why they skip and pass; what can be checked without one is:
//! opening a device fails with a typed error, never a panic.
#![cfg(feature = "cuda")]

use crate::common::grid::grid;
use crate::common::*;
use flashattn::cuda::{self, CudaDevice, CudaTensor, DeviceBuffer};
use flashattn::{AttnOptions, AttnOutput, Buffer, DType, ErrorKind, TensorRef};

/// The GPU, or `None` after printing why there is none.
fn device() -> Option<CudaDevice> {
    match CudaDevice::new(0) {
        Ok(d) => {
            eprintln!("CUDA device: {} ({})", d.name(), d.arch());
            Some(d)
        }
        Err(e) => {
            eprintln!("skipping the GPU tests: {e}");
            None
        }
    }
}

#[test]
fn opening_a_device_never_panics() {
    match CudaDevice::new(0) {
        Ok(d) => eprintln!("device 0: {} {}", d.name(), d.arch()),
        Err(e) => assert!(
            matches!(
                e.kind(),
                ErrorKind::CudaUnavailable { .. } | ErrorKind::CudaDriver { .. }
            ),
            "unexpected error kind: {e}"
        ),
    }
    // An ordinal past the last device is an error too, whatever the machine has.
    assert!(CudaDevice::new(1 << 20).is_err());
}

/// Uploads a whole host buffer.
fn upload_buffer(dev: &CudaDevice, b: &Buffer) -> DeviceBuffer {
    let len = b.as_slice().len();
    let view = TensorRef::from_slice(b.as_slice(), &[len], &[1]);
    dev.upload(&view).expect("upload").into_buffer()
}

/// The device tensor of a test placement: the buffer uploaded as is, with the placement's strides
/// (so strided, packed and broadcast layouts reach the kernels), or a contiguous copy when the
/// placement starts at an offset (device tensors have none).
fn place(dev: &CudaDevice, bufs: &[Buffer], p: &Placement) -> CudaTensor {
    if p.offset == 0 {
        CudaTensor::from_buffer(upload_buffer(dev, &bufs[p.buf]), &p.shape, &p.strides)
    } else {
        dev.upload(&view(bufs, p)).expect("upload")
    }
}

fn to_host(dev: &CudaDevice, r: cuda::CudaAttnOutput) -> AttnOutput {
    AttnOutput {
        out: r.out.to_host(dev).expect("download out"),
        lse: r.lse.to_host(dev).expect("download lse"),
    }
}

fn run_grid(dtype: DType) {
    let Some(dev) = device() else { return };
    let mut kernels = std::collections::BTreeMap::<String, usize>::new();
    for case in grid(dtype) {
        let inputs = case.build();
        let naive = [inputs.naive(), inputs.naive_sequential()];
        let r = inputs.reference();
        let v_max = inputs.v_values().iter().fold(0f64, |m, x| m.max(x.abs()));
        let (q, k, v) = (
            place(&dev, &inputs.bufs, &inputs.q),
            place(&dev, &inputs.bufs, &inputs.k),
            place(&dev, &inputs.bufs, &inputs.v),
        );
        // Which kernel serves the case (FLASHATTN_CUDA_FWD=sm90 picks fwd_sm90.cu on Hopper).
        let kind = cuda::kernel_key(&dev, &q, &k, &v, &inputs.opts())
            .map_or("refused".into(), |key| format!("{:?}", key.kind));
        *kernels.entry(kind.clone()).or_default() += 1;
        let res = cuda::flash_attn(&dev, &q, &k, &v, &inputs.opts())
            .unwrap_or_else(|e| panic!("{case}: cuda::flash_attn: {e}"));
        let flash = to_host(&dev, res);
        check_bound(
            &format!("{case} cuda {kind}"),
            dtype,
            &flash,
            &naive,
            &r,
            v_max,
            case.seqlen_k,
        );
    }
    eprintln!(
        "{dtype} grid on {}: cases per forward kernel {kernels:?}",
        dev.name()
    );
}

#[test]
fn grid_f32() {
    run_grid(DType::F32);
}

#[test]
fn grid_f16() {
    run_grid(DType::F16);
}

#[test]
fn grid_bf16() {
    run_grid(DType::BF16);
}

/// Packed sequences (empty ones, keys without queries and the reverse, rows after the last
/// sequence) against the reference; the rows after the last sequence are out 0, lse -inf.
#[test]
fn varlen_matches_reference() {
    let Some(dev) = device() else { return };
    for dtype in DTYPES {
        for case in varlen_cases(dtype, 4, 2, 64) {
            let inputs = case.build();
            let (q, k, v) = inputs.views();
            let (dq, dk, dv) = (
                dev.upload(&q).unwrap(),
                dev.upload(&k).unwrap(),
                dev.upload(&v).unwrap(),
            );
            let res = cuda::flash_attn(
                &dev,
                &dq,
                &dk,
                &dv,
                &inputs.opts().varlen(&inputs.cu_q, &inputs.cu_k),
            )
            .unwrap_or_else(|e| panic!("{case:?}: {e}"));
            inputs.check(&to_host(&dev, res), "cuda");
        }
    }
}

/// Learnable sinks on the GPU: every third grid case of each dtype with a sink logit per head,
/// and packed batches (rows after the last sequence get no sink: out 0, lse -inf), against the
/// reference with the grid's bound (`cuda::emulated` runs the same kernels on the CPU).
#[test]
fn sinks_match_reference() {
    let Some(dev) = device() else { return };
    for dtype in DTYPES {
        for (i, case) in grid(dtype).into_iter().enumerate() {
            if i % 3 != 0 {
                continue;
            }
            let inputs = case.build();
            let sinks = test_sinks(case.heads);
            let opts = inputs
                .opts()
                .learnable_sink(TensorRef::contiguous(&sinks, &[case.heads]));
            let (q, k, v) = (
                place(&dev, &inputs.bufs, &inputs.q),
                place(&dev, &inputs.bufs, &inputs.k),
                place(&dev, &inputs.bufs, &inputs.v),
            );
            let res = cuda::flash_attn(&dev, &q, &k, &v, &opts)
                .unwrap_or_else(|e| panic!("{case}: cuda::flash_attn with sinks: {e}"));
            inputs.check_with(&to_host(&dev, res), "cuda sinks", &opts);
        }
        for case in varlen_cases(dtype, 4, 2, 64) {
            let inputs = case.build();
            let (q, k, v) = inputs.views();
            let sinks = test_sinks(4);
            let opts = inputs
                .opts()
                .learnable_sink(TensorRef::contiguous(&sinks, &[4]));
            let (dq, dk, dv) = (
                dev.upload(&q).unwrap(),
                dev.upload(&k).unwrap(),
                dev.upload(&v).unwrap(),
            );
            let res = cuda::flash_attn(
                &dev,
                &dq,
                &dk,
                &dv,
                &opts.clone().varlen(&inputs.cu_q, &inputs.cu_k),
            )
            .unwrap_or_else(|e| panic!("{case:?}: {e}"));
            inputs.check_with(&to_host(&dev, res), "cuda sinks", &opts);
        }
    }
}

/// Bad input is rejected before anything runs, with the CPU path's typed errors (a dropout
/// probability of 1 included).
#[test]
fn bad_input_is_a_typed_error() {
    let Some(dev) = device() else { return };
    let host = vec![half::bf16::from_f32(0.25); 2 * 16 * 4 * 64];
    let t = dev
        .upload(&TensorRef::contiguous(&host, &[2, 16, 4, 64]))
        .unwrap();
    let k3 = dev
        .upload(&TensorRef::contiguous(
            &host[..16 * 3 * 64],
            &[1, 16, 3, 64],
        ))
        .unwrap();
    let e = cuda::flash_attn(&dev, &t, &k3, &k3, &AttnOptions::default()).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Shape { .. }), "{e}");
    let e =
        cuda::flash_attn(&dev, &t, &t, &t, &AttnOptions::default().dropout(1.0, 1)).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Dropout { .. }), "{e}");
    let short =
        CudaTensor::from_buffer(t.buffer().clone(), &[2, 17, 4, 64], &[17 * 256, 256, 64, 1]);
    let e = cuda::flash_attn(&dev, &short, &t, &t, &AttnOptions::default()).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::OutOfBounds { .. }), "{e}");
}

/// The backward pass on the GPU: the CPU gradient grid's shapes and options (dropout included),
/// after the GPU forward (itself checked), against the f64 reference with the CPU backward's
/// bound; twice, bit for bit the same; and its typed errors.
mod backward {
    use super::device;
    use crate::common::backward::{cases, GradCase, GradData};
    use flashattn::cuda::{self, CudaDevice};
    use flashattn::{AttnOptions, Element, ErrorKind, TensorRef};

    fn case<T: Element>(dev: &CudaDevice, c: &GradCase) {
        case_with::<T>(dev, c, &c.opts);
    }

    /// [`case`] with options of the caller's (the case's plus learnable sinks).
    fn case_with<T: Element>(dev: &CudaDevice, c: &GradCase, opts: &AttnOptions) {
        let data = GradData::<T>::new(c);
        let views = data.views();
        let up = |t: &TensorRef| dev.upload(t).expect("upload");
        let [qd, kd, vd, dd] = views.each_ref().map(up);
        let ctx = format!("cuda backward seed={} opts={:?}", c.seed, opts);
        let fwd =
            cuda::flash_attn(dev, &qd, &kd, &vd, opts).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let host_fwd = flashattn::AttnOutput {
            out: fwd.out.to_host(dev).expect("download"),
            lse: fwd.lse.to_host(dev).expect("download"),
        };
        let r = data.check_forward(&host_fwd, opts, &ctx);
        let g = fwd
            .backward(dev, &qd, &kd, &vd, &dd, opts)
            .unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let host = |t: &cuda::CudaTensor| t.to_host(dev).expect("download");
        let (dq, dk, dv) = (host(&g.dq), host(&g.dk), host(&g.dv));
        let expected = data.expected(opts);
        data.check([&dq, &dk, &dv], &expected, &ctx);
        match (&g.dsink, &expected.0.dsink) {
            (Some(got), Some(_)) => data.check_dsink(&host(got), &expected, &r, &ctx),
            (None, None) => assert!(opts.learnable_sink.is_none(), "{ctx}"),
            _ => panic!("{ctx}: dsink present in some results only"),
        }
        // No atomics: a second run gives the same bits.
        let again = fwd.backward(dev, &qd, &kd, &vd, &dd, opts).unwrap();
        assert_eq!(host(&again.dq), dq, "{ctx}: dq differs between runs");
        assert_eq!(host(&again.dk), dk, "{ctx}: dk differs between runs");
    }

    /// Learnable sinks: every third case of the gradient grid, f32 and bf16, with a sink logit
    /// per head (out, lse, dq, dk, dv and dsink against the reference).
    #[test]
    fn gradients_with_sinks() {
        let Some(dev) = device() else { return };
        for (i, c) in cases(true).iter().enumerate().filter(|(i, _)| i % 3 == 0) {
            let heads = c.shape.3;
            let sinks = crate::common::test_sinks(heads);
            let opts = c
                .opts
                .clone()
                .learnable_sink(TensorRef::contiguous(&sinks, &[heads]));
            if i % 2 == 0 {
                case_with::<f32>(&dev, c, &opts);
            } else {
                case_with::<half::bf16>(&dev, c, &opts);
            }
        }
    }

    /// The CPU gradient grid, plus 1024 x 1024 with GQA 4 at d = 128: plain, causal, and causal
    /// with dropout; and the emulated sm_90a backward's cases at head dims 64, 96 and 128
    /// (`emulated_bwd90::extra_cases`), which bwd_sm90.cu serves with `FLASHATTN_SM90_BWD=1` on
    /// an H100/H200.
    fn grid<T: Element>() {
        let Some(dev) = device() else { return };
        let mut all = cases(true);
        all.extend(crate::cuda::emulated_bwd90::extra_cases());
        let causal = AttnOptions::default().causal(true);
        let big = [
            AttnOptions::default(),
            causal.clone(),
            causal.dropout(0.1, 77),
        ];
        for (n, opts) in big.into_iter().enumerate() {
            all.push(GradCase {
                seed: 800 + n as u64,
                shape: (1, 1024, 1024, 8, 2, 128),
                opts,
                logit_scale: 1.0,
            });
        }
        for c in &all {
            case::<T>(&dev, c);
        }
    }

    #[test]
    fn gradients_f32() {
        grid::<f32>();
    }

    #[test]
    fn gradients_f16() {
        grid::<half::f16>();
    }

    #[test]
    fn gradients_bf16() {
        grid::<half::bf16>();
    }

    /// A dout of the wrong shape and an lse of the wrong rank: typed errors, nothing launched.
    #[test]
    fn bad_input_is_a_typed_error() {
        let Some(dev) = device() else { return };
        let host = vec![half::bf16::from_f32(0.25); 2 * 16 * 4 * 64];
        let t = dev
            .upload(&TensorRef::contiguous(&host, &[2, 16, 4, 64]))
            .unwrap();
        let small = dev
            .upload(&TensorRef::contiguous(
                &host[..16 * 4 * 64],
                &[1, 16, 4, 64],
            ))
            .unwrap();
        let opts = AttnOptions::default();
        let fwd = cuda::flash_attn(&dev, &t, &t, &t, &opts).unwrap();
        let e = fwd.backward(&dev, &t, &t, &t, &small, &opts).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::Shape { tensor: "dout", .. }),
            "{e}"
        );
        let e =
            cuda::flash_attn_backward(&dev, &t, &t, &t, &fwd.out, &fwd.out, &t, &opts).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::Rank { tensor: "lse", .. }),
            "{e}"
        );
    }
}

/// The `_into` forms (forward, backward; batched and packed; with sinks): into caller buffers
/// poisoned with NaN they write the allocating forms' bits, and a bad destination is a typed
/// error that writes nothing.
mod into {
    use super::device;
    use crate::common::backward::{cases, GradData};
    use crate::common::{test_sinks, varlen_cases, DTYPES};
    use flashattn::cuda::{self, CudaDevice, CudaGradBuffers, CudaOutBuffers, CudaTensor};
    use flashattn::{AttnOptions, DType, Element, ErrorKind, Tensor, TensorRef};

    /// A contiguous device tensor of `shape` filled with NaN.
    fn poisoned<T: Element>(dev: &CudaDevice, shape: &[usize]) -> CudaTensor {
        let n = shape.iter().product();
        let host = vec![T::from_f32(f32::NAN); n];
        dev.upload(&TensorRef::contiguous(&host, shape))
            .expect("upload")
    }

    fn poisoned_as(dev: &CudaDevice, like: &CudaTensor) -> CudaTensor {
        match like.dtype() {
            DType::F32 => poisoned::<f32>(dev, like.shape()),
            DType::F16 => poisoned::<half::f16>(dev, like.shape()),
            DType::BF16 => poisoned::<half::bf16>(dev, like.shape()),
        }
    }

    fn host(dev: &CudaDevice, t: &CudaTensor) -> Tensor {
        t.to_host(dev).expect("download")
    }

    /// Every element NaN: nothing was written.
    fn untouched(dev: &CudaDevice, t: &CudaTensor, ctx: &str) {
        let h = host(dev, t);
        assert!(
            h.to_f32_vec().iter().all(|x| x.is_nan()),
            "{ctx}: a refused call wrote into its destination"
        );
    }

    /// Forward and backward, allocating and `_into`, batched (`cu` None) or packed.
    #[allow(clippy::too_many_arguments)]
    fn compare(
        dev: &CudaDevice,
        [q, k, v, dout]: [&CudaTensor; 4],
        cu: Option<(&[i32], &[i32])>,
        opts: &AttnOptions,
        ctx: &str,
    ) {
        let fwd = match cu {
            Some((cq, ck)) => cuda::flash_attn(dev, q, k, v, &opts.clone().varlen(cq, ck)),
            None => cuda::flash_attn(dev, q, k, v, opts),
        }
        .unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let (mut out, mut lse) = (poisoned_as(dev, &fwd.out), poisoned_as(dev, &fwd.lse));
        let dst = CudaOutBuffers {
            out: &mut out,
            lse: &mut lse,
        };
        match cu {
            Some((cq, ck)) => {
                cuda::flash_attn_into(dev, q, k, v, &opts.clone().varlen(cq, ck), dst)
            }
            None => cuda::flash_attn_into(dev, q, k, v, opts, dst),
        }
        .unwrap_or_else(|e| panic!("{ctx}: forward into: {e}"));
        assert_eq!(host(dev, &out), host(dev, &fwd.out), "{ctx}: out");
        assert_eq!(host(dev, &lse), host(dev, &fwd.lse), "{ctx}: lse");
        let (o, l) = (&fwd.out, &fwd.lse);
        let g = match cu {
            Some((cq, ck)) => {
                cuda::flash_attn_backward(dev, q, k, v, o, l, dout, &opts.clone().varlen(cq, ck))
            }
            None => cuda::flash_attn_backward(dev, q, k, v, o, l, dout, opts),
        }
        .unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let (mut dq, mut dk, mut dv) = (
            poisoned_as(dev, &g.dq),
            poisoned_as(dev, &g.dk),
            poisoned_as(dev, &g.dv),
        );
        let mut dsink = g.dsink.as_ref().map(|s| poisoned_as(dev, s));
        let dst = CudaGradBuffers {
            dq: &mut dq,
            dk: &mut dk,
            dv: &mut dv,
            dsink: dsink.as_mut(),
        };
        match cu {
            Some((cq, ck)) => cuda::flash_attn_backward_into(
                dev,
                q,
                k,
                v,
                o,
                l,
                dout,
                &opts.clone().varlen(cq, ck),
                dst,
            ),
            None => cuda::flash_attn_backward_into(dev, q, k, v, o, l, dout, opts, dst),
        }
        .unwrap_or_else(|e| panic!("{ctx}: backward into: {e}"));
        assert_eq!(host(dev, &dq), host(dev, &g.dq), "{ctx}: dq");
        assert_eq!(host(dev, &dk), host(dev, &g.dk), "{ctx}: dk");
        assert_eq!(host(dev, &dv), host(dev, &g.dv), "{ctx}: dv");
        match (&dsink, &g.dsink) {
            (Some(a), Some(b)) => assert_eq!(host(dev, a), host(dev, b), "{ctx}: dsink"),
            (None, None) => {}
            _ => panic!("{ctx}: dsink in one result only"),
        }
    }

    fn grid<T: Element>(dev: &CudaDevice) {
        for (i, c) in cases(true).iter().enumerate().filter(|(i, _)| i % 4 == 0) {
            let data = GradData::<T>::new(c);
            let views = data.views();
            let [q, k, v, dout] = views.each_ref().map(|t| dev.upload(t).expect("upload"));
            let heads = c.shape.3;
            let sinks = test_sinks(heads);
            let opts = if i % 8 == 0 {
                c.opts
                    .clone()
                    .learnable_sink(TensorRef::contiguous(&sinks, &[heads]))
            } else {
                c.opts.clone()
            };
            let ctx = format!("into {} seed={} opts={opts:?}", T::DTYPE, c.seed);
            compare(dev, [&q, &k, &v, &dout], None, &opts, &ctx);
        }
    }

    #[test]
    fn batched_matches_allocating() {
        let Some(dev) = device() else { return };
        grid::<f32>(&dev);
        grid::<half::f16>(&dev);
        grid::<half::bf16>(&dev);
    }

    #[test]
    fn packed_matches_allocating() {
        let Some(dev) = device() else { return };
        for dtype in DTYPES {
            for (i, case) in varlen_cases(dtype, 4, 2, 64).into_iter().enumerate() {
                let inputs = case.build();
                let (q, k, v) = inputs.views();
                let [q, k, v] = [q, k, v].map(|t| dev.upload(&t).expect("upload"));
                let sinks = test_sinks(4);
                let opts = if i % 2 == 0 {
                    inputs.opts()
                } else {
                    inputs
                        .opts()
                        .learnable_sink(TensorRef::contiguous(&sinks, &[4]))
                };
                let cu = Some((&inputs.cu_q[..], &inputs.cu_k[..]));
                // q stands in for dout (same shape and dtype).
                let ctx = format!("into packed {case:?}");
                compare(&dev, [&q, &k, &v, &q], cu, &opts, &ctx);
            }
        }
    }

    /// Wrong dtype, wrong length, a non-contiguous view, a missing or unexpected dsink: typed
    /// errors, every destination still NaN.
    #[test]
    fn bad_destinations_are_typed_errors_and_write_nothing() {
        let Some(dev) = device() else { return };
        let host_q = vec![half::bf16::from_f32(0.25); 2 * 16 * 4 * 64];
        let shape = [2, 16, 4, 64];
        let t = dev.upload(&TensorRef::contiguous(&host_q, &shape)).unwrap();
        let opts = AttnOptions::default();
        let fwd = cuda::flash_attn(&dev, &t, &t, &t, &opts).unwrap();
        let good = || poisoned::<half::bf16>(&dev, &shape);
        let (o, l) = (&fwd.out, &fwd.lse);
        // Forward: out in f32, lse too short.
        let (mut out32, mut lse) = (poisoned::<f32>(&dev, &shape), poisoned_as(&dev, l));
        let dst = CudaOutBuffers {
            out: &mut out32,
            lse: &mut lse,
        };
        let e = cuda::flash_attn_into(&dev, &t, &t, &t, &opts, dst).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::DType { tensor: "out", .. }),
            "{e}"
        );
        let (mut out, mut short) = (good(), poisoned::<f32>(&dev, &[2, 4, 15]));
        let dst = CudaOutBuffers {
            out: &mut out,
            lse: &mut short,
        };
        let e = cuda::flash_attn_into(&dev, &t, &t, &t, &opts, dst).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::DestinationLength { tensor: "lse", .. }),
            "{e}"
        );
        for (x, what) in [
            (&out32, "out"),
            (&lse, "lse"),
            (&out, "out"),
            (&short, "lse"),
        ] {
            untouched(&dev, x, what);
        }
        // Backward: dk of the wrong length, dv strided, a dsink the call has no sink for.
        let (mut dq, mut dk, mut dv) = (good(), good(), good());
        let mut dk_short = poisoned::<half::bf16>(&dev, &[2, 15, 4, 64]);
        let dst = CudaGradBuffers {
            dq: &mut dq,
            dk: &mut dk_short,
            dv: &mut dv,
            dsink: None,
        };
        let e = cuda::flash_attn_backward_into(&dev, &t, &t, &t, o, l, &t, &opts, dst).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::DestinationLength { tensor: "dk", .. }),
            "{e}"
        );
        // dv's buffer with q's shape, heads outermost: not contiguous.
        let mut dv_strided =
            CudaTensor::from_buffer(dv.buffer().clone(), &shape, &[4096, 64, 1024, 1]);
        let dst = CudaGradBuffers {
            dq: &mut dq,
            dk: &mut dk,
            dv: &mut dv_strided,
            dsink: None,
        };
        let e = cuda::flash_attn_backward_into(&dev, &t, &t, &t, o, l, &t, &opts, dst).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::Shape { tensor: "dv", .. }),
            "{e}"
        );
        let mut extra = poisoned::<f32>(&dev, &[4]);
        let dst = CudaGradBuffers {
            dq: &mut dq,
            dk: &mut dk,
            dv: &mut dv,
            dsink: Some(&mut extra),
        };
        let e = cuda::flash_attn_backward_into(&dev, &t, &t, &t, o, l, &t, &opts, dst).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                ErrorKind::DestinationLength {
                    tensor: "dsink",
                    ..
                }
            ),
            "{e}"
        );
        for (x, what) in [
            (&dq, "dq"),
            (&dk, "dk"),
            (&dv, "dv"),
            (&dk_short, "dk"),
            (&extra, "dsink"),
        ] {
            untouched(&dev, x, what);
        }
        // With sinks but no dsink destination.
        let sinks = test_sinks(4);
        let with_sink = opts.learnable_sink(TensorRef::contiguous(&sinks, &[4]));
        let fwd = cuda::flash_attn(&dev, &t, &t, &t, &with_sink).unwrap();
        let dst = CudaGradBuffers {
            dq: &mut dq,
            dk: &mut dk,
            dv: &mut dv,
            dsink: None,
        };
        let e = cuda::flash_attn_backward_into(
            &dev, &t, &t, &t, &fwd.out, &fwd.lse, &t, &with_sink, dst,
        )
        .unwrap_err();
        assert!(
            matches!(
                e.kind(),
                ErrorKind::DestinationLength {
                    tensor: "dsink",
                    ..
                }
            ),
            "{e}"
        );
        for (x, what) in [(&dq, "dq"), (&dk, "dk"), (&dv, "dv")] {
            untouched(&dev, x, what);
        }
    }
}
