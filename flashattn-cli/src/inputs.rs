//! The benchmarks' seeded random inputs: float tensors and KV caches in [-1, 1), FP8 values over
//! their format's range with a power-of-two descale factor, and those values dequantised.

use crate::buf::{cache_vec, try_vec, CacheBuffer, Fp8Buf};
use crate::error::Result;
use flashattn::fp8::Fp8Format;
use flashattn::{Buffer, DType};
use half::{bf16, f16};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Random FP8 values over the format's range (an error naming `what` where the machine cannot
/// hold them).
pub fn random_fp8(
    rng: &mut ChaCha8Rng,
    what: &'static str,
    format: Fp8Format,
    n: usize,
) -> Result<Fp8Buf> {
    let max = format.max();
    Fp8Buf::quantize(what, format, (0..n).map(|_| rng.gen_range(-max..max)))
}

/// A power of two that takes the format's max to 1.75: dequantised values lie in [-1.75, 1.75]
/// and are exact in bf16.
pub fn fp8_descale(format: Fp8Format) -> [f32; 1] {
    [match format {
        Fp8Format::E4M3 => 2f32.powi(-8),
        Fp8Format::E5M2 => 2f32.powi(-15),
    }]
}

/// The descale factors of an FP8 benchmark: [`fp8_descale`]'s factor for every tensor, one per
/// tensor or, `per_block`, in FlashAttention-3's per-block tables (`[batch, heads, blocks of
/// DESCALE_BLOCK rows]`, every entry that factor), so the dequantised values, the reference and
/// the accuracy column are the same either way and only the kernels' factor handling differs.
pub struct Fp8Factors {
    q: Vec<f32>,
    kv: Vec<f32>,
    per_block: bool,
}

impl Fp8Factors {
    /// `heads` and `heads_kv` of a batch of `batch` sequences of `seqlen_q` queries, `seqlen_k` keys.
    pub fn new(
        format: Fp8Format,
        per_block: bool,
        batch: usize,
        (heads, heads_kv): (usize, usize),
        (seqlen_q, seqlen_k): (usize, usize),
    ) -> Self {
        let s = fp8_descale(format)[0];
        let table = |heads: usize, seqlen: usize| {
            let blocks = seqlen.div_ceil(flashattn::fp8::DESCALE_BLOCK);
            vec![s; if per_block { batch * heads * blocks } else { 1 }]
        };
        Self {
            q: table(heads, seqlen_q),
            kv: table(heads_kv, seqlen_k),
            per_block,
        }
    }

    pub fn descale(&self) -> flashattn::fp8::Descale<'_> {
        let d = flashattn::fp8::Descale::default()
            .q(&self.q)
            .k(&self.kv)
            .v(&self.kv);
        if self.per_block {
            d.per_block()
        } else {
            d
        }
    }
}

/// The dequantised values, in bf16 (exact).
pub fn dequantized(what: &'static str, x: &Fp8Buf) -> Result<Buffer> {
    let s = fp8_descale(x.format())[0];
    let vals = match x {
        Fp8Buf::E4M3(d) => try_vec(what, d.iter().map(|v| bf16::from_f32(v.to_f32() * s)))?,
        Fp8Buf::E5M2(d) => try_vec(what, d.iter().map(|v| bf16::from_f32(v.to_f32() * s)))?,
    };
    Ok(Buffer::BF16(vals))
}

/// `n` random values in [-1, 1) of `dtype` (an error naming `what` where the machine cannot hold
/// them).
pub fn random_buffer(
    rng: &mut ChaCha8Rng,
    what: &'static str,
    n: usize,
    dtype: DType,
) -> Result<Buffer> {
    let vals = (0..n).map(|_| rng.gen_range(-1.0f32..1.0));
    Ok(match dtype {
        DType::F32 => Buffer::F32(try_vec(what, vals)?),
        DType::F16 => Buffer::F16(try_vec(what, vals.map(f16::from_f32))?),
        DType::BF16 => Buffer::BF16(try_vec(what, vals.map(bf16::from_f32))?),
    })
}

/// [`random_buffer`]'s values as a KV cache buffer, in huge pages when `huge` (see
/// [`cache_vec`]).
pub fn random_cache(
    rng: &mut ChaCha8Rng,
    what: &'static str,
    n: usize,
    dtype: DType,
    huge: bool,
) -> Result<CacheBuffer> {
    let vals = (0..n).map(|_| rng.gen_range(-1.0f32..1.0));
    Ok(match dtype {
        DType::F32 => CacheBuffer::F32(cache_vec(what, huge, vals)?),
        DType::F16 => CacheBuffer::F16(cache_vec(what, huge, vals.map(f16::from_f32))?),
        DType::BF16 => CacheBuffer::BF16(cache_vec(what, huge, vals.map(bf16::from_f32))?),
    })
}
