//! `flashattn run` on a file that holds `k_cache`/`v_cache`: decoding with a KV cache.

use super::cuda;
use crate::args::{Device, RunArgs};
use crate::buf::Fp8Buf;
use crate::error::{fail, CliError, Result};
use crate::output::write_atomically;
use crate::st_io::{self, Loaded};
use crate::threads::with_threads;
use flashattn::decode::SliceMut;
use flashattn::fp8::{flash_attn_with_kvcache_fp8, Descale};
use flashattn::{flash_attn_with_kvcache, BlockTable, Buffer, DType, KvCacheOptions, TensorMut};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::path::Path;

/// Tensor names of a KV-cache input file; anything else is rejected (a typo must not silently
/// change the computation).
pub const ACCEPTED: [&str; 17] = [
    "q",
    "k_cache",
    "v_cache",
    "cache_seqlens",
    "k_new",
    "v_new",
    "block_table",
    "cache_batch_idx",
    "cache_leftpad",
    "cu_seqlens_q",
    "cu_seqlens_k_new",
    "rotary_cos",
    "rotary_sin",
    "alibi_slopes",
    "learnable_sink",
    "k_descale",
    "v_descale",
];

/// Whether `path` is a safetensors file whose header names a `k_cache` tensor (read from the
/// header alone). Any problem answers `false`, and the ordinary loader reports it.
pub fn is_kvcache_file(path: &Path) -> bool {
    st_io::header(path).is_some_and(|m| m.contains_key("k_cache"))
}

/// An I32 tensor of the expected rank, as (shape, values).
fn decode_i32(
    name: &str,
    t: &TensorView,
    rank: usize,
    layout: &str,
) -> Result<(Vec<usize>, Vec<i32>)> {
    if t.dtype() != Dtype::I32 {
        return fail(format!(
            "tensor `{name}` has dtype {:?}, expected I32",
            t.dtype()
        ));
    }
    if t.shape().len() != rank {
        return fail(format!(
            "tensor `{name}` has shape {:?}, expected rank {rank} {layout}",
            t.shape()
        ));
    }
    let vals = t
        .data()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((t.shape().to_vec(), vals))
}

/// `flashattn run` on a KV-cache file: appends `k_new`/`v_new` (if present) to the caches,
/// attends, and writes `out`, `lse` and the updated `k_cache`, `v_cache` to OUT.
pub fn run(args: &RunArgs) -> Result<()> {
    let shown = args.input.display();
    let bytes = st_io::read(&args.input)?;
    let st = st_io::parse(&bytes, &shown, &ACCEPTED, " in a KV-cache file")?;
    let get = |name: &str| st_io::tensor(&st, name, &shown);
    let float = |name: &str| -> Result<Option<Loaded>> {
        get(name)?
            .map(|t| st_io::decode_float(name, &t))
            .transpose()
    };
    let required = |name: &str| -> Result<Loaded> {
        float(name)?.ok_or_else(|| {
            CliError(format!(
                "{shown}: missing tensor `{name}` (q, k_cache, v_cache and cache_seqlens are required)"
            ))
        })
    };
    let q = required("q")?;
    // FP8 caches (F8_E4M3 / F8_E5M2, with optional `k_descale`/`v_descale`), or caches in q's dtype.
    let fp8 = get("k_cache")?.is_some_and(|t| matches!(t.dtype(), Dtype::F8_E4M3 | Dtype::F8_E5M2));
    let descale = |name: &str| -> Result<Option<Vec<f32>>> {
        let t = get(name)?;
        if t.is_some() && !fp8 {
            return fail(format!(
                "tensor `{name}` applies to FP8 caches only, and `k_cache` is not F8_E4M3 or F8_E5M2"
            ));
        }
        t.map(|t| st_io::decode_descale(name, &t)).transpose()
    };
    let (k_descale, v_descale) = (descale("k_descale")?, descale("v_descale")?);
    let mut caches = if fp8 {
        let load = |name: &str| -> Result<Fp8Cache> {
            let t = get(name)?.ok_or_else(|| {
                CliError(format!("{shown}: missing tensor `{name}` (q, k_cache, v_cache and cache_seqlens are required)"))
            })?;
            let why = "but `k_cache` is FP8: both caches must be F8_E4M3 or F8_E5M2";
            Ok((Fp8Buf::load(name, &t, why)?, t.shape().to_vec()))
        };
        Caches::Fp8(load("k_cache")?, load("v_cache")?)
    } else {
        Caches::Float(required("k_cache")?, required("v_cache")?)
    };
    let cache_seqlens = match get("cache_seqlens")? {
        Some(t) => decode_i32("cache_seqlens", &t, 1, "[batch]")?.1,
        None => {
            return fail(format!(
                "{shown}: missing tensor `cache_seqlens` (q, k_cache, v_cache and cache_seqlens are required)"
            ))
        }
    };
    let k_new = float("k_new")?;
    let v_new = float("v_new")?;
    let (cos, sin) = (float("rotary_cos")?, float("rotary_sin")?);
    let alibi = float("alibi_slopes")?;
    let sink = float("learnable_sink")?;
    for (name, t) in [("alibi_slopes", &alibi), ("learnable_sink", &sink)] {
        if let Some(a) = t {
            if a.buf.dtype() != DType::F32 {
                return fail(format!(
                    "tensor `{name}` has dtype {}, expected F32",
                    a.buf.dtype()
                ));
            }
        }
    }
    // The optional I32 tensors: (shape, values).
    let index = |name: &str, rank: usize, layout: &str| -> Result<Option<(Vec<usize>, Vec<i32>)>> {
        get(name)?
            .map(|t| decode_i32(name, &t, rank, layout))
            .transpose()
    };
    let block_table = index("block_table", 2, "[batch, max_blocks_per_seq]")?;
    let batch_idx = index("cache_batch_idx", 1, "[batch]")?;
    let leftpad = index("cache_leftpad", 1, "[batch]")?;
    let cu_q = index("cu_seqlens_q", 1, "[batch + 1]")?;
    let cu_new = index("cu_seqlens_k_new", 1, "[batch + 1]")?;

    let mut opts = KvCacheOptions::default().attn(args.attn_options(alibi.as_ref(), sink.as_ref()));
    opts.num_splits = args.num_splits;
    match (&k_new, &v_new) {
        (Some(k), Some(v)) => opts = opts.new_kv(k.view(), v.view()),
        (None, None) => {}
        (Some(_), None) => {
            return fail("tensor `k_new` is present without `v_new`; appending needs both")
        }
        (None, Some(_)) => {
            return fail("tensor `v_new` is present without `k_new`; appending needs both")
        }
    }
    match (&cos, &sin) {
        (Some(c), Some(s)) => opts = opts.rotary(c.view(), s.view(), args.rotary_interleaved),
        (None, None) => {}
        (Some(_), None) => return fail("tensor `rotary_cos` is present without `rotary_sin`"),
        (None, Some(_)) => return fail("tensor `rotary_sin` is present without `rotary_cos`"),
    }
    if let Some((shape, data)) = &block_table {
        opts = opts.block_table(BlockTable::new(data, shape[0], shape[1]));
    }
    if let Some((_, idx)) = &batch_idx {
        opts = opts.cache_batch_idx(idx);
    }
    if let Some((_, lp)) = &leftpad {
        opts = opts.cache_leftpad(lp);
    }
    if let Some((_, cu)) = &cu_q {
        opts = opts.cu_seqlens_q(cu);
    }
    if let Some((_, cu)) = &cu_new {
        opts = opts.cu_seqlens_k_new(cu);
    }

    let (k_cache, v_cache) = match &mut caches {
        Caches::Float(k, v) => (k, v),
        Caches::Fp8(k, v) => {
            let descale = Descale {
                q: None,
                k: k_descale.as_deref(),
                v: v_descale.as_deref(),
                per_block: false,
            };
            return run_fp8_caches(args, &q, (k, v), &cache_seqlens, &descale, &opts);
        }
    };
    write_atomically(&args.output, || {
        let (k_shape, v_shape) = (k_cache.shape.clone(), v_cache.shape.clone());
        let res = if args.device == Device::Cuda {
            cuda::decode_run(&q, k_cache, v_cache, &cache_seqlens, &opts)?
        } else {
            with_threads(args.threads, || {
                let mut k = TensorMut::contiguous(slice_mut(&mut k_cache.buf), &k_shape);
                let mut v = TensorMut::contiguous(slice_mut(&mut v_cache.buf), &v_shape);
                flash_attn_with_kvcache(&q.view(), &mut k, &mut v, &cache_seqlens, &opts)
            })??
        };
        st_io::serialize_named(&[
            ("out", res.out.buffer(), res.out.shape()),
            ("lse", res.lse.buffer(), res.lse.shape()),
            ("k_cache", &k_cache.buf, &k_shape),
            ("v_cache", &v_cache.buf, &v_shape),
        ])
    })
}

/// `run` on FP8 caches: the call (on the CPU, or on GPU 0 with `--device cuda`), then `out`,
/// `lse` and the caches, written back FP8.
fn run_fp8_caches(
    args: &RunArgs,
    q: &Loaded,
    ((k, k_shape), (v, v_shape)): (&mut Fp8Cache, &mut Fp8Cache),
    cache_seqlens: &[i32],
    descale: &Descale,
    opts: &KvCacheOptions,
) -> Result<()> {
    write_atomically(&args.output, || {
        let res = if args.device == Device::Cuda {
            cuda::decode_run_fp8(
                q,
                ((&mut *k, k_shape), (&mut *v, v_shape)),
                cache_seqlens,
                descale,
                opts,
            )?
        } else {
            with_threads(args.threads, || {
                let strides = |s: &[usize]| flashattn::tensor::contiguous_strides(s);
                let mut kt = k.view_mut(k_shape, &strides(k_shape));
                let mut vt = v.view_mut(v_shape, &strides(v_shape));
                flash_attn_with_kvcache_fp8(
                    &q.view(),
                    &mut kt,
                    &mut vt,
                    cache_seqlens,
                    &opts.clone().descale(*descale),
                )
            })??
        };
        let (out, lse) = (
            st_io::buffer_bytes(res.out.buffer()),
            st_io::buffer_bytes(res.lse.buffer()),
        );
        let (kc, vc) = (k.encoded(), v.encoded());
        st_io::serialize_encoded(&[
            ("out", out.0, res.out.shape(), out.1),
            ("lse", lse.0, res.lse.shape(), lse.1),
            ("k_cache", kc.0, k_shape, kc.1),
            ("v_cache", vc.0, v_shape, vc.1),
        ])
    })
}

/// An FP8 cache from a file: its values and shape.
type Fp8Cache = (Fp8Buf, Vec<usize>);

/// The caches of a KV-cache file: in q's dtype, or FP8.
enum Caches {
    Float(Loaded, Loaded),
    Fp8(Fp8Cache, Fp8Cache),
}

fn slice_mut(b: &mut Buffer) -> SliceMut<'_> {
    match b {
        Buffer::F32(d) => SliceMut::F32(d),
        Buffer::F16(d) => SliceMut::F16(d),
        Buffer::BF16(d) => SliceMut::BF16(d),
    }
}
