//! The CUDA decode path on a GPU, on the cases the emulation runs, with the same checks (the
//! caches afterwards, the result against the f64 reference). Without a GPU it says why it skips.

use super::*;
use flashattn::cuda::{self, CudaDevice, CudaFp8Tensor, CudaTensor};
use flashattn::fp8::Fp8TensorRef;

fn upload(dev: &CudaDevice, b: &Buffer, shape: &[usize], strides: &[usize]) -> CudaTensor {
    let len = b.as_slice().len();
    let t = dev
        .upload(&TensorRef::from_slice(b.as_slice(), &[len], &[1]))
        .expect("upload");
    CudaTensor::from_buffer(t.into_buffer(), shape, strides)
}

/// The whole buffer behind a device tensor (gaps included).
fn download(dev: &CudaDevice, t: CudaTensor) -> Buffer {
    let buf = t.into_buffer();
    let len = buf.len();
    CudaTensor::from_buffer(buf, &[len], &[1])
        .to_host(dev)
        .expect("download")
        .into_buffer()
}

/// FP8 bytes on the device as a cache view (the whole buffer, gaps included).
fn upload_fp8(dev: &CudaDevice, b: &[u8], f: Fp8Format, map: &CacheMap) -> CudaFp8Tensor {
    let t = match f {
        Fp8Format::E4M3 => {
            let e: Vec<F8E4M3> = b.iter().map(|&x| F8E4M3::from_bits(x)).collect();
            dev.upload_fp8(&Fp8TensorRef::contiguous(&e, &[e.len()]))
        }
        Fp8Format::E5M2 => {
            let e: Vec<F8E5M2> = b.iter().map(|&x| F8E5M2::from_bits(x)).collect();
            dev.upload_fp8(&Fp8TensorRef::contiguous(&e, &[e.len()]))
        }
    }
    .expect("upload");
    CudaFp8Tensor::from_buffer(t.buffer().clone(), f, &map.shape, &map.strides)
}

fn download_fp8(dev: &CudaDevice, t: &CudaFp8Tensor) -> Buffer {
    let len = t.buffer().len();
    let whole = CudaFp8Tensor::from_buffer(t.buffer().clone(), t.format(), &[len], &[1]);
    fp8_values(&whole.to_host_bytes(dev).expect("download"), t.format())
}

fn call(dev: &CudaDevice, bl: &Built, c: &DCase) -> CallResult {
    call_with(dev, bl, c, false)
}

/// A device buffer of `n` NaNs of `dtype`, viewed contiguous with `shape`.
fn poisoned(dev: &CudaDevice, dtype: DType, shape: &[usize]) -> CudaTensor {
    let n = shape.iter().product();
    let b = match dtype {
        DType::F32 => Buffer::F32(vec![f32::NAN; n]),
        DType::F16 => Buffer::F16(vec![half::f16::NAN; n]),
        DType::BF16 => Buffer::BF16(vec![half::bf16::NAN; n]),
    };
    upload(
        dev,
        &b,
        shape,
        &flashattn::tensor::contiguous_strides(shape),
    )
}

/// The call, allocating its result or, with `into`, through the `_into` form into
/// NaN-poisoned buffers.
fn call_with(dev: &CudaDevice, bl: &Built, c: &DCase, into: bool) -> CallResult {
    let (sh, st) = (&bl.map.shape, &bl.map.strides);
    let q_shape = [c.batch(), c.seqlen_q, c.heads, c.d];
    let q = upload(
        dev,
        &bl.qb,
        &q_shape,
        &flashattn::tensor::contiguous_strides(&q_shape),
    );
    let new_shape = [c.batch(), c.seqlen_new(), c.heads_kv, c.d];
    let new_strides = flashattn::tensor::contiguous_strides(&new_shape);
    let new = match (&bl.k_new, &bl.v_new) {
        (Some((_, kb)), Some((_, vb))) => Some((
            upload(dev, kb, &new_shape, &new_strides),
            upload(dev, vb, &new_shape, &new_strides),
        )),
        _ => None,
    };
    let mut opts = bl.opts(c);
    opts.new_kv = None;
    let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
    let host = |r: cuda::CudaAttnOutput| AttnOutput {
        out: r.out.to_host(dev).expect("download out"),
        lse: r.lse.to_host(dev).expect("download lse"),
    };
    let (mut out, mut lse) = (
        poisoned(dev, c.dtype, &q_shape),
        poisoned(dev, DType::F32, &[c.batch(), c.heads, c.seqlen_q]),
    );
    if let Some(f) = &bl.fp8 {
        let mut k = upload_fp8(dev, &f.k, f.format, &bl.map);
        let mut v = upload_fp8(dev, &f.v, f.format, &bl.map);
        if into {
            let dst = cuda::CudaOutBuffers {
                out: &mut out,
                lse: &mut lse,
            };
            let res = cuda::flash_attn_with_kvcache_fp8_into(
                dev,
                &q,
                &mut k,
                &mut v,
                &lens,
                new.as_ref().map(|(a, b)| (a, b)),
                &opts
                    .clone()
                    .descale(Descale::default().k(&f.k_descale).v(&f.v_descale)),
                dst,
            )
            .map(|()| host(cuda::CudaAttnOutput { out, lse }));
            return (res, download_fp8(dev, &k), download_fp8(dev, &v));
        }
        let res = cuda::flash_attn_with_kvcache_fp8(
            dev,
            &q,
            &mut k,
            &mut v,
            &lens,
            new.as_ref().map(|(a, b)| (a, b)),
            &opts
                .clone()
                .descale(Descale::default().k(&f.k_descale).v(&f.v_descale)),
        )
        .map(host);
        return (res, download_fp8(dev, &k), download_fp8(dev, &v));
    }
    let mut k = upload(dev, &bl.k_cache, sh, st);
    let mut v = upload(dev, &bl.v_cache, sh, st);
    if into {
        let dst = cuda::CudaOutBuffers {
            out: &mut out,
            lse: &mut lse,
        };
        let res = cuda::flash_attn_with_kvcache_into(
            dev,
            &q,
            &mut k,
            &mut v,
            &lens,
            new.as_ref().map(|(a, b)| (a, b)),
            &opts,
            dst,
        )
        .map(|()| host(cuda::CudaAttnOutput { out, lse }));
        return (res, download(dev, k), download(dev, v));
    }
    let res = cuda::flash_attn_with_kvcache(
        dev,
        &q,
        &mut k,
        &mut v,
        &lens,
        new.as_ref().map(|(a, b)| (a, b)),
        &opts,
    )
    .map(host);
    (res, download(dev, k), download(dev, v))
}

#[test]
fn decode_on_the_gpu() {
    let dev = match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping the GPU decode tests: {e}");
            return;
        }
    };
    for dtype in DTYPES {
        for c in super::emulated::kernel_cases(dtype) {
            for splits in [c.splits, None, Some(1), Some(64)] {
                let c = DCase {
                    splits,
                    ..c.clone()
                };
                check_case_with(&c, |bl, c| call(&dev, bl, c));
            }
        }
    }
    // FP8 caches, both formats, q in every dtype.
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        for dtype in DTYPES {
            for c in super::emulated::kernel_cases(dtype) {
                for splits in [c.splits, None] {
                    let c = DCase {
                        splits,
                        fp8: Some(format),
                        ..c.clone()
                    };
                    check_case_with(&c, |bl, c| call(&dev, bl, c));
                }
            }
        }
    }
}

/// The `_into` forms (f32/f16/bf16 caches and e4m3 ones) into NaN-poisoned `out` and `lse`: checked
/// as the allocating calls (caches afterwards, result against the reference), and bit for bit the
/// allocating calls' out, lse and caches.
#[test]
fn decode_into_on_the_gpu() {
    let dev = match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping the GPU decode tests: {e}");
            return;
        }
    };
    let bits = |t: &flashattn::Tensor| -> Vec<u32> {
        t.to_f32_vec().iter().map(|x| x.to_bits()).collect()
    };
    for fp8 in [None, Some(Fp8Format::E4M3)] {
        for dtype in DTYPES {
            for c in super::emulated::kernel_cases(dtype) {
                let c = DCase { fp8, ..c.clone() };
                check_case_with(&c, |bl, c| {
                    let (a, ka, va) = call_with(&dev, bl, c, false);
                    let (b, kb, vb) = call_with(&dev, bl, c, true);
                    match (&a, &b) {
                        (Ok(x), Ok(y)) => {
                            assert_eq!(bits(&x.out), bits(&y.out), "{c:?}: out");
                            assert_eq!(bits(&x.lse), bits(&y.lse), "{c:?}: lse");
                        }
                        (Err(_), Err(_)) => {}
                        _ => panic!("{c:?}: one form failed: {a:?} / {b:?}"),
                    }
                    assert_eq!(buf_bits(&ka), buf_bits(&kb), "{c:?}: k cache");
                    assert_eq!(buf_bits(&va), buf_bits(&vb), "{c:?}: v cache");
                    (b, kb, vb)
                });
            }
        }
    }
}
