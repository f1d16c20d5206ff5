//! `flashattn run` on FP8 inputs: q, k and v stored as F8_E4M3 or F8_E5M2, with optional
//! descale factors (forward only; `out` is BF16).

use crate::bench::cache_vec;
use crate::cuda::Device;
use crate::error::{fail, Result};
use crate::run::{write_atomically, RunArgs};
use crate::st_io;
use crate::threads::with_threads;
use flashattn::fp8::{self, Descale, Fp8Format, Fp8TensorRef, F8E4M3, F8E5M2};
use flashattn::memory::CacheBuf;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::path::Path;

/// The tensor names of an FP8 input file.
pub const ACCEPTED: [&str; 9] = [
    "q",
    "k",
    "v",
    "q_descale",
    "k_descale",
    "v_descale",
    "alibi_slopes",
    "cu_seqlens_q",
    "cu_seqlens_k",
];

/// Whether the file's `q` is FP8 (then `run` takes this path).
pub fn is_fp8_file(path: &Path) -> bool {
    st_io::header(path)
        .and_then(|m| {
            let dtype = m.get("q")?.get("dtype")?.as_str()?.to_owned();
            Some(dtype == "F8_E4M3" || dtype == "F8_E5M2")
        })
        .unwrap_or(false)
}

/// An owned FP8 buffer (a file's tensor, or the bench's random inputs), aligned as a KV cache
/// ([`crate::bench::cache_vec`]).
pub enum Fp8Buf {
    E4M3(CacheBuf<F8E4M3>),
    E5M2(CacheBuf<F8E5M2>),
}

impl Fp8Buf {
    /// `x` rounded to `format` (nearest even, saturating at its max).
    pub fn quantize(
        what: &'static str,
        format: Fp8Format,
        x: impl ExactSizeIterator<Item = f32>,
    ) -> Result<Self> {
        Self::quantize_cache(what, format, x, false)
    }
    /// [`Fp8Buf::quantize`] into a KV cache buffer, in huge pages when `huge` (see
    /// [`crate::bench::cache_vec`]); an error naming `what` where the machine cannot hold it.
    pub fn quantize_cache(
        what: &'static str,
        format: Fp8Format,
        x: impl ExactSizeIterator<Item = f32>,
        huge: bool,
    ) -> Result<Self> {
        Ok(match format {
            Fp8Format::E4M3 => Fp8Buf::E4M3(cache_vec(what, huge, x.map(F8E4M3::from_f32))?),
            Fp8Format::E5M2 => Fp8Buf::E5M2(cache_vec(what, huge, x.map(F8E5M2::from_f32))?),
        })
    }
    /// The address range of the buffer's bytes (see [`flashattn::memory::huge_page_bytes_in`]).
    pub fn byte_range(&self) -> std::ops::Range<usize> {
        match self {
            Fp8Buf::E4M3(d) => flashattn::memory::byte_range(d),
            Fp8Buf::E5M2(d) => flashattn::memory::byte_range(d),
        }
    }
    pub fn format(&self) -> Fp8Format {
        match self {
            Fp8Buf::E4M3(_) => Fp8Format::E4M3,
            Fp8Buf::E5M2(_) => Fp8Format::E5M2,
        }
    }
    /// A mutable view of `shape` with element `strides` (a KV cache).
    pub fn view_mut(&mut self, shape: &[usize], strides: &[usize]) -> fp8::Fp8TensorMut<'_> {
        match self {
            Fp8Buf::E4M3(d) => fp8::Fp8TensorMut::new(&mut d[..], shape, strides),
            Fp8Buf::E5M2(d) => fp8::Fp8TensorMut::new(&mut d[..], shape, strides),
        }
    }
    /// A contiguous view of `shape`.
    pub fn view(&self, shape: &[usize]) -> Fp8TensorRef<'_> {
        match self {
            Fp8Buf::E4M3(d) => Fp8TensorRef::contiguous(&d[..], shape),
            Fp8Buf::E5M2(d) => Fp8TensorRef::contiguous(&d[..], shape),
        }
    }
}

impl Fp8Buf {
    /// A file's FP8 tensor (`F8_E4M3` or `F8_E5M2`); `why` ends the message for other dtypes.
    pub fn load(name: &str, t: &TensorView, why: &str) -> Result<Self> {
        let bytes = t.data();
        Ok(match t.dtype() {
            Dtype::F8_E4M3 => Fp8Buf::from_bits(Fp8Format::E4M3, bytes),
            Dtype::F8_E5M2 => Fp8Buf::from_bits(Fp8Format::E5M2, bytes),
            other => return fail(format!("tensor `{name}` has dtype {other:?}, {why}")),
        })
    }
    /// Values of `format` from their bytes (no larger than the bytes the caller holds).
    pub fn from_bits(format: Fp8Format, bytes: &[u8]) -> Self {
        match format {
            Fp8Format::E4M3 => Fp8Buf::E4M3(CacheBuf::from_iter_advised(
                bytes.iter().map(|&b| F8E4M3::from_bits(b)),
                false,
            )),
            Fp8Format::E5M2 => Fp8Buf::E5M2(CacheBuf::from_iter_advised(
                bytes.iter().map(|&b| F8E5M2::from_bits(b)),
                false,
            )),
        }
    }
    /// The safetensors dtype and bytes.
    pub fn encoded(&self) -> (Dtype, Vec<u8>) {
        match self {
            Fp8Buf::E4M3(d) => (Dtype::F8_E4M3, d.iter().map(|x| x.to_bits()).collect()),
            Fp8Buf::E5M2(d) => (Dtype::F8_E5M2, d.iter().map(|x| x.to_bits()).collect()),
        }
    }
}

struct Fp8Loaded {
    buf: Fp8Buf,
    shape: Vec<usize>,
}

fn decode_fp8(name: &str, t: &TensorView) -> Result<Fp8Loaded> {
    let why = "but `q` is FP8: q, k and v must all be F8_E4M3 or all F8_E5M2";
    Ok(Fp8Loaded {
        buf: Fp8Buf::load(name, t, why)?,
        shape: t.shape().to_vec(),
    })
}

/// A descale tensor: F32, any shape; its element count (1, or batch · heads_kv) is checked by
/// the library.
pub fn decode_descale(name: &str, t: &TensorView) -> Result<Vec<f32>> {
    if t.dtype() != Dtype::F32 {
        return fail(format!(
            "tensor `{name}` has dtype {:?}, expected F32",
            t.dtype()
        ));
    }
    Ok(t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

pub fn run(args: &RunArgs) -> Result<()> {
    let shown = args.input.display();
    let bytes = st_io::read(&args.input)?;
    let st = st_io::parse(
        &bytes,
        &shown,
        &ACCEPTED,
        " in an FP8 file (FP8 inputs have a forward pass only, so no dout)",
    )?;
    let get = |name: &str| st_io::tensor(&st, name, &shown);
    let required = |name: &str| -> Result<Fp8Loaded> {
        match get(name)? {
            Some(t) => decode_fp8(name, &t),
            None => fail(format!(
                "{shown}: missing tensor `{name}` (q, k and v are required)"
            )),
        }
    };
    let (q, k, v) = (required("q")?, required("k")?, required("v")?);
    let descale = |name: &str| -> Result<Option<Vec<f32>>> {
        get(name)?.map(|t| decode_descale(name, &t)).transpose()
    };
    let (dq, dk, dv) = (
        descale("q_descale")?,
        descale("k_descale")?,
        descale("v_descale")?,
    );
    let alibi = st_io::decode_alibi(get("alibi_slopes")?)?;
    let cu =
        match (get("cu_seqlens_q")?, get("cu_seqlens_k")?) {
            (Some(cq), Some(ck)) => Some((
                st_io::decode_i32("cu_seqlens_q", &cq)?,
                st_io::decode_i32("cu_seqlens_k", &ck)?,
            )),
            (None, None) => None,
            _ => return fail(
                "the packed layout needs both `cu_seqlens_q` and `cu_seqlens_k`, the file has one",
            ),
        };
    let opts = args.attn_options(alibi.as_ref(), None);
    let d = Descale {
        q: dq.as_deref(),
        k: dk.as_deref(),
        v: dv.as_deref(),
    };
    let (qv, kv, vv) = (
        q.buf.view(&q.shape),
        k.buf.view(&k.shape),
        v.buf.view(&v.shape),
    );
    let cu = cu.as_ref().map(|(cq, ck)| (&cq[..], &ck[..]));
    write_atomically(&args.output, || {
        let res = if args.device == Device::Cuda {
            crate::cuda::compute_fp8(&qv, &kv, &vv, cu, &d, &opts)?
        } else {
            with_threads(args.threads, || match cu {
                Some((cq, ck)) => fp8::flash_attn_varlen_fp8(&qv, &kv, &vv, cq, ck, &d, &opts),
                None => fp8::flash_attn_fp8(&qv, &kv, &vv, &d, &opts),
            })??
        };
        st_io::serialize(&res, None)
    })
}
