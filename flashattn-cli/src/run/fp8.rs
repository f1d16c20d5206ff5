//! `flashattn run` on FP8 inputs: q, k and v stored as F8_E4M3 or F8_E5M2, with optional
//! descale factors (forward only; `out` is BF16).

use super::cuda;
use crate::args::{Device, RunArgs};
use crate::buf::Fp8Buf;
use crate::error::{fail, Result};
use crate::output::write_atomically;
use crate::st_io;
use crate::threads::with_threads;
use flashattn::fp8::{self, Descale};
use safetensors::tensor::TensorView;
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
        get(name)?
            .map(|t| st_io::decode_descale(name, &t))
            .transpose()
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
    let d = Descale {
        q: dq.as_deref(),
        k: dk.as_deref(),
        v: dv.as_deref(),
        per_block: false,
    };
    let mut opts = args.attn_options(alibi.as_ref(), None).descale(d);
    if let Some((cq, ck)) = &cu {
        opts = opts.varlen(cq, ck);
    }
    let (qv, kv, vv) = (
        q.buf.view(&q.shape),
        k.buf.view(&k.shape),
        v.buf.view(&v.shape),
    );
    write_atomically(&args.output, || {
        let res = if args.device == Device::Cuda {
            cuda::compute_fp8(&qv, &kv, &vv, &opts)?
        } else {
            with_threads(args.threads, || fp8::flash_attn_fp8(&qv, &kv, &vv, &opts))??
        };
        st_io::serialize(&res, None)
    })
}
