//! The FP8 forward on a GPU, when there is one: every case, checked as on the CPU, and the output
//! poisoned before the kernel writes it (a missed element reads as NaN and fails the bound).

use super::*;
use flashattn::cuda::{self, CudaDevice, CudaFp8Tensor};

/// The whole FP8 buffer of tensor `t` on the device, viewed with its layout.
fn upload(dev: &CudaDevice, built: &Built, t: usize) -> CudaFp8Tensor {
    let whole = match &built.raw[t] {
        Raw::E4M3(d) => dev.upload_fp8(&Fp8TensorRef::contiguous(d, &[d.len()])),
        Raw::E5M2(d) => dev.upload_fp8(&Fp8TensorRef::contiguous(d, &[d.len()])),
    }
    .expect("upload");
    let (shape, strides) = &built.layouts[t];
    CudaFp8Tensor::from_buffer(whole.buffer().clone(), whole.format(), shape, strides)
}

/// The options of case `c`'s call: `opts` with its packed sequences and descale factors.
fn call_opts<'a>(
    c: &Case,
    built: &'a Built,
    opts: &flashattn::AttnOptions<'a>,
) -> flashattn::AttnOptions<'a> {
    flashattn::AttnOptions {
        cu_seqlens: c.packed.then_some((&built.cu_q[..], &built.cu_k[..])),
        descale: Some(built.descale()),
        ..opts.clone()
    }
}

/// Checks `out` of `call` against the bound of the kernel that ran it: with
/// `FLASHATTN_CUDA_FWD=sm90fp8`, e4m3 calls may run on fwd_sm90_fp8.cu, which rounds P to e4m3
/// (its bound is that rounding's). Whether it ran there.
fn check_by_kernel(
    dev: &CudaDevice,
    (c, built): (&Case, &Built),
    qkv: [&CudaFp8Tensor; 3],
    call: &flashattn::AttnOptions,
    out: &AttnOutput,
) -> bool {
    let opts = built.opts();
    let key = cuda::fp8_kernel_key(dev, qkv, call).expect("the call was accepted");
    let what = format!("{c:?} on the GPU, {}", key.name());
    if key.is_sm90() {
        super::emulated::check_p_e4m3(built, out, &built.expected(&opts).0, &what);
    } else {
        built.check_output(out, &built.expected(&opts), &what);
    }
    key.is_sm90()
}

#[test]
fn fp8_forward_on_the_gpu() {
    let dev = match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping the GPU FP8 forward tests: {e}");
            return;
        }
    };
    let (mut ran, mut on_sm90) = (0, 0);
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        // The kernels refuse learnable sinks (`sink`).
        for c in cases(format).into_iter().filter(|c| !c.sink) {
            let built = c.build();
            let opts = built.opts();
            let [q, k, v] = [0, 1, 2].map(|t| upload(&dev, &built, t));
            let call = call_opts(&c, &built, &opts);
            let res = cuda::flash_attn_fp8(&dev, &q, &k, &v, &call)
                .unwrap_or_else(|e| panic!("{c:?}: {e}"));
            let out = AttnOutput {
                out: res.out.to_host(&dev).expect("download out"),
                lse: res.lse.to_host(&dev).expect("download lse"),
            };
            // The `_into` form, into NaN-poisoned buffers: the same bits.
            let nan = |t: &cuda::CudaTensor| {
                let n = t.shape().iter().product();
                let t = match t.dtype() {
                    DType::F32 => dev.upload(&TensorRef::contiguous(&vec![f32::NAN; n], t.shape())),
                    _ => dev.upload(&TensorRef::contiguous(&vec![half::bf16::NAN; n], t.shape())),
                };
                t.expect("upload")
            };
            let (mut o, mut l) = (nan(&res.out), nan(&res.lse));
            let dst = cuda::CudaOutBuffers {
                out: &mut o,
                lse: &mut l,
            };
            cuda::flash_attn_fp8_into(&dev, &q, &k, &v, &call, dst)
                .unwrap_or_else(|e| panic!("{c:?}: into: {e}"));
            let bits = |t: &flashattn::Tensor| -> Vec<u32> {
                t.to_f32_vec().iter().map(|x| x.to_bits()).collect()
            };
            let into = [o, l].map(|t| bits(&t.to_host(&dev).expect("download")));
            assert_eq!(into, [bits(&out.out), bits(&out.lse)], "{c:?}: into");
            if check_by_kernel(&dev, (&c, &built), [&q, &k, &v], &call, &out) {
                on_sm90 += 1;
            }
            ran += 1;
        }
    }
    eprintln!(
        "{ran} FP8 forward cases on {} ({on_sm90} on fwd_sm90_fp8.cu)",
        dev.name()
    );
}

/// Per-block factors (`Descale::per_block`) on the GPU: `block_cases` at head_dim 64 (fwd.cu, e4m3
/// and e5m2) and, e4m3 at 128 and 256, on fwd_sm90_fp8.cu where `FLASHATTN_CUDA_FWD=sm90fp8`
/// picks it (else fwd.cu), each checked against its kernel's bound.
#[test]
fn fp8_per_block_on_the_gpu() {
    let dev = match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping the GPU FP8 per-block tests: {e}");
            return;
        }
    };
    let (mut ran, mut on_sm90) = (0, 0);
    let list = [
        (Fp8Format::E4M3, 64),
        (Fp8Format::E5M2, 64),
        (Fp8Format::E4M3, 128),
        (Fp8Format::E4M3, 256),
    ];
    for (format, d) in list {
        for c in block_cases(format, d) {
            let built = c.build();
            let opts = built.opts();
            let [q, k, v] = [0, 1, 2].map(|t| upload(&dev, &built, t));
            let call = call_opts(&c, &built, &opts);
            let res = cuda::flash_attn_fp8(&dev, &q, &k, &v, &call)
                .unwrap_or_else(|e| panic!("{c:?}: {e}"));
            let out = AttnOutput {
                out: res.out.to_host(&dev).expect("download out"),
                lse: res.lse.to_host(&dev).expect("download lse"),
            };
            if check_by_kernel(&dev, (&c, &built), [&q, &k, &v], &call, &out) {
                on_sm90 += 1;
            }
            ran += 1;
        }
    }
    eprintln!(
        "{ran} per-block FP8 forward cases on {} ({on_sm90} on fwd_sm90_fp8.cu)",
        dev.name()
    );
}
