//! The CUDA backend against the f64 reference, on the same cases as the CPU forward tests (the
//! covering grid of `common::grid` in f32, f16 and bf16, plus varlen), with the same error bound:
//! within 2x the naive algorithm's error in the same precision, plus a small floor.
//!
//! Without a GPU these tests print why they skip and pass; what can be checked without one is:
//! opening a device fails with a typed error, never a panic.
#![cfg(feature = "cuda")]

mod common;

use common::grid::grid;
use common::*;
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
        let res = cuda::flash_attn(&dev, &q, &k, &v, &inputs.opts())
            .unwrap_or_else(|e| panic!("{case}: cuda::flash_attn: {e}"));
        let flash = to_host(&dev, res);
        check_bound(
            &format!("{case} cuda"),
            dtype,
            &flash,
            &naive,
            &r,
            v_max,
            case.seqlen_k,
        );
    }
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
            let res = cuda::flash_attn_varlen(
                &dev,
                &dq,
                &dk,
                &dv,
                &inputs.cu_q,
                &inputs.cu_k,
                &inputs.opts(),
            )
            .unwrap_or_else(|e| panic!("{case:?}: {e}"));
            inputs.check(&to_host(&dev, res), "cuda");
        }
    }
}

/// Bad input is rejected before anything runs, with the CPU path's typed errors; dropout is
/// reported as unsupported rather than silently ignored.
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
        cuda::flash_attn(&dev, &t, &t, &t, &AttnOptions::default().dropout(0.1, 1)).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::CudaUnsupported { .. }), "{e}");
    let short =
        CudaTensor::from_buffer(t.buffer().clone(), &[2, 17, 4, 64], &[17 * 256, 256, 64, 1]);
    let e = cuda::flash_attn(&dev, &short, &t, &t, &AttnOptions::default()).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::OutOfBounds { .. }), "{e}");
}

/// The backward pass on the GPU: the CPU gradient grid's shapes and options (dropout aside),
/// after the GPU forward, against the f64 reference with the CPU backward's bound; twice, bit for
/// bit the same; and its typed errors.
mod backward {
    use super::device;
    use crate::common::backward::{check, data};
    use flashattn::cuda::{self, CudaDevice};
    use flashattn::{naive, reference, AttnOptions, Element, ErrorKind, TensorRef};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[allow(clippy::too_many_arguments)]
    fn case<T: Element>(
        dev: &CudaDevice,
        seed: u64,
        (b, sq, sk, h, hk, d): (usize, usize, usize, usize, usize, usize),
        opts: &AttnOptions,
        logit_scale: f32,
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let q: Vec<T> = data(&mut rng, b * sq * h * d, logit_scale);
        let k: Vec<T> = data(&mut rng, b * sk * hk * d, logit_scale);
        let v: Vec<T> = data(&mut rng, b * sk * hk * d, 1.0);
        let dout: Vec<T> = data(&mut rng, b * sq * h * d, 1.0);
        let (qt, kt, vt, dt) = (
            TensorRef::contiguous(&q, &[b, sq, h, d]),
            TensorRef::contiguous(&k, &[b, sk, hk, d]),
            TensorRef::contiguous(&v, &[b, sk, hk, d]),
            TensorRef::contiguous(&dout, &[b, sq, h, d]),
        );
        let up = |t: &TensorRef| dev.upload(t).expect("upload");
        let (qd, kd, vd, dd) = (up(&qt), up(&kt), up(&vt), up(&dt));
        let ctx = format!(
            "cuda backward {} b={b} sq={sq} sk={sk} h={h}/{hk} d={d} seed={seed} {opts:?}",
            T::DTYPE
        );
        let fwd =
            cuda::flash_attn(dev, &qd, &kd, &vd, opts).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let g = fwd
            .backward(dev, &qd, &kd, &vd, &dd, opts)
            .unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let host = |t: &cuda::CudaTensor| t.to_host(dev).expect("download");
        let (dq, dk, dv) = (host(&g.dq), host(&g.dk), host(&g.dv));
        let want = reference::attention_backward(&qt, &kt, &vt, &dt, opts).unwrap();
        let nv = naive::attention_backward(&qt, &kt, &vt, &dt, opts).unwrap();
        check("dq", &dq, &nv.dq, &want.dq, T::DTYPE, &ctx);
        check("dk", &dk, &nv.dk, &want.dk, T::DTYPE, &ctx);
        check("dv", &dv, &nv.dv, &want.dv, T::DTYPE, &ctx);
        // No atomics: a second run gives the same bits.
        let again = fwd.backward(dev, &qd, &kd, &vd, &dd, opts).unwrap();
        assert_eq!(host(&again.dq), dq, "{ctx}: dq differs between runs");
        assert_eq!(host(&again.dk), dk, "{ctx}: dk differs between runs");
    }

    fn grid<T: Element>() {
        let Some(dev) = device() else { return };
        let slopes_h4 = [0.25f32, 0.5, 0.125, 1.0];
        let shapes = [
            (1usize, 1usize, 1usize, 1usize, 1usize, 8usize),
            (2, 113, 203, 4, 2, 59),
            (1, 203, 113, 4, 1, 40),
            (1, 63, 65, 4, 4, 111),
            (1, 64, 64, 2, 1, 256),
            (2, 17, 1, 4, 2, 3),
            (2, 150, 300, 8, 8, 24),
            (1, 1024, 1024, 8, 2, 128),
        ];
        for (n, &shape) in shapes.iter().enumerate() {
            for variant in 0..4 {
                let opts = match variant {
                    0 => AttnOptions::default(),
                    1 => AttnOptions::default().causal(true),
                    2 => AttnOptions::default().window(7, 3).softcap(2.5),
                    _ if shape.3 == 4 => AttnOptions::default()
                        .causal(true)
                        .alibi_slopes(TensorRef::contiguous(&slopes_h4, &[4])),
                    _ => AttnOptions::default().window(-1, 5),
                };
                case::<T>(&dev, 100 * n as u64 + variant, shape, &opts, 1.0);
            }
        }
        let causal = AttnOptions::default().causal(true);
        case::<T>(&dev, 9, (1, 70, 90, 2, 1, 32), &causal, 6.0);
        // A narrow window whose first visible key is the last of a key block for some query
        // blocks (row 64 sees keys 63 and 64): the key range must start at that block.
        let narrow = AttnOptions::default().window(1, 0);
        case::<T>(&dev, 10, (1, 130, 130, 2, 1, 32), &narrow, 1.0);
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

    /// A dout of the wrong shape and dropout: typed errors, nothing launched.
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
        let drop = AttnOptions::default().dropout(0.1, 1);
        let e = fwd.backward(&dev, &t, &t, &t, &t, &drop).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::CudaUnsupported { .. }), "{e}");
    }
}
