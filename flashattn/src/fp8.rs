//! FP8 inputs: attention over q, k and v stored as 8-bit floats (`e4m3`, the OCP E4M3FN format
//! without infinities, max 448; or `e5m2`, max 57344), each with optional dequantisation
//! ("descale") factors, as FlashAttention-3's FP8 forward.
//!
//! The stored values mean `q = q_fp8 · q_descale` (likewise k and v), with one factor for the whole
//! tensor or one per (sequence, kv head). Every FP8 value is exactly a bf16 value, so the inputs
//! are widened to bf16 without rounding and the bf16 forward runs on them (on AVX512_BF16, as the
//! tiles are built from the FP8 bytes; elsewhere into bf16 copies first); the descale factors are
//! never multiplied into the data: `softmax_scale · q_descale · k_descale` (one f64 product, rounded
//! once to f32) scales the raw dot products, and `v_descale` the finished output rows, so the only
//! roundings are those of the bf16 forward itself. `out` is bf16 (as FlashAttention-3), `lse` f32.
//!
//! **Per-block factors** ([`Descale::per_block`], FlashAttention-3's block quantisation): one
//! factor per [`DESCALE_BLOCK`] = 128 rows of each (sequence, head) of q and (sequence, kv head)
//! of k and v; the value meant is the FP8 value times its block's factor. The CPU forward
//! multiplies each value by its factor into f32 copies (one rounding, 2^-24 relative) and runs the
//! f32 forward on them, out rounded to bf16: the oracle of the CUDA kernels, which instead set the
//! score scale per key block and carry the v factors through P·V (see `cuda::flash_attn_fp8`).
//! The FP8 decode keeps per-(sequence, kv head) factors ([`ErrorKind::DescalePerBlock`]).
//!
//! Forward only: there is no FP8 backward (FlashAttention-3 has none either). Every other forward
//! option applies (causal, window, softcap, ALiBi, MQA/GQA, packed sequences, dropout). The
//! factors are an option like the others ([`AttnOptions::descale`]); FP8 keeps calls of its own
//! because its tensors ([`Fp8TensorRef`]) are another type. Working memory is the bf16 forward's
//! (without a bf16 dot product, plus bf16 copies of q, k and v).
//!
//! ```
//! use flashattn::fp8::{flash_attn_fp8, Descale, Fp8TensorRef, F8E4M3};
//! use flashattn::AttnOptions;
//! let (b, n, h, hk, d) = (1, 5, 4, 2, 16);
//! // Values quantised with a per-tensor scale: x ≈ fp8 · 0.01.
//! let q: Vec<F8E4M3> = (0..b * n * h * d).map(|i| F8E4M3::from_f32((i % 7) as f32 * 30.0)).collect();
//! let kv: Vec<F8E4M3> = (0..b * n * hk * d).map(|i| F8E4M3::from_f32((i % 5) as f32 - 2.0)).collect();
//! let (q, kv) = (
//!     Fp8TensorRef::contiguous(&q, &[b, n, h, d]),
//!     Fp8TensorRef::contiguous(&kv, &[b, n, hk, d]),
//! );
//! let descale = Descale::default().q(&[0.01]).k(&[0.02]).v(&[0.5]);
//! let opts = AttnOptions::default().causal(true).descale(descale);
//! let res = flash_attn_fp8(&q, &kv, &kv, &opts).unwrap();
//! assert_eq!(res.out.dtype(), flashattn::DType::BF16);
//! assert_eq!(res.lse.shape(), &[b, h, n]);
//! ```

use crate::cpu::forward::{forward_fp8, forward_fp8_into, Fp8Source};
use crate::decode::KvCacheOptions;
use crate::error::{ErrorKind, Result, TensorName};
use crate::output::{AttnOutput, OutBuffers};
use crate::params::AttnOptions;
use crate::params::{self, BlockDescales, Descales, Params};
use crate::tensor::{
    contiguous_strides, Buffer, DType, Element, SliceMut, Tensor, TensorRef, ViewDesc, ViewInfo,
};
pub use float8::{F8E4M3, F8E5M2};
use half::bf16;
use rayon::prelude::*;

pub use crate::dtype::Fp8Format;
pub use crate::params::{Descale, DESCALE_BLOCK};

mod quantize;
pub use quantize::{
    quantize_qkv, quantize_qkv_varlen, walsh_hadamard, Granularity, Incoherent, QuantizeOptions,
    Quantized, QuantizedQkv,
};

mod sealed {
    pub trait Sealed {}
    impl Sealed for float8::F8E4M3 {}
    impl Sealed for float8::F8E5M2 {}
}

/// An FP8 element type: [`F8E4M3`] or [`F8E5M2`] (from the `float8` crate, re-exported here).
pub trait Fp8Element: Copy + Send + Sync + sealed::Sealed + 'static {
    const FORMAT: Fp8Format;
    fn wrap(data: &[Self]) -> Fp8Slice<'_>;
    fn wrap_mut(data: &mut [Self]) -> Fp8SliceMut<'_>;
}

impl Fp8Element for F8E4M3 {
    const FORMAT: Fp8Format = Fp8Format::E4M3;
    fn wrap(data: &[Self]) -> Fp8Slice<'_> {
        Fp8Slice::E4M3(data)
    }
    fn wrap_mut(data: &mut [Self]) -> Fp8SliceMut<'_> {
        Fp8SliceMut::E4M3(data)
    }
}

impl Fp8Element for F8E5M2 {
    const FORMAT: Fp8Format = Fp8Format::E5M2;
    fn wrap(data: &[Self]) -> Fp8Slice<'_> {
        Fp8Slice::E5M2(data)
    }
    fn wrap_mut(data: &mut [Self]) -> Fp8SliceMut<'_> {
        Fp8SliceMut::E5M2(data)
    }
}

/// A borrowed buffer of FP8 values.
#[derive(Clone, Copy, Debug)]
pub enum Fp8Slice<'a> {
    E4M3(&'a [F8E4M3]),
    E5M2(&'a [F8E5M2]),
}

impl<'a> Fp8Slice<'a> {
    pub fn format(&self) -> Fp8Format {
        match self {
            Fp8Slice::E4M3(_) => Fp8Format::E4M3,
            Fp8Slice::E5M2(_) => Fp8Format::E5M2,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Fp8Slice::E4M3(d) => d.len(),
            Fp8Slice::E5M2(d) => d.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The raw bytes (one per value).
    pub fn bytes(&self) -> &'a [u8] {
        match *self {
            Fp8Slice::E4M3(d) => bytemuck::cast_slice(d),
            Fp8Slice::E5M2(d) => bytemuck::cast_slice(d),
        }
    }
}

/// A mutable borrowed buffer of FP8 values (a KV cache that a call appends to).
#[derive(Debug)]
pub enum Fp8SliceMut<'a> {
    E4M3(&'a mut [F8E4M3]),
    E5M2(&'a mut [F8E5M2]),
}

impl Fp8SliceMut<'_> {
    /// A shared view of the same values.
    pub fn as_slice(&self) -> Fp8Slice<'_> {
        match self {
            Fp8SliceMut::E4M3(d) => Fp8Slice::E4M3(d),
            Fp8SliceMut::E5M2(d) => Fp8Slice::E5M2(d),
        }
    }
    pub fn format(&self) -> Fp8Format {
        self.as_slice().format()
    }
    /// The raw bytes (one per value).
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Fp8SliceMut::E4M3(d) => bytemuck::cast_slice_mut(d),
            Fp8SliceMut::E5M2(d) => bytemuck::cast_slice_mut(d),
        }
    }
}

/// A strided, mutable view of a caller's FP8 buffer: how FP8 `k_cache` and `v_cache` are passed
/// to [`flash_attn_with_kvcache_fp8`], which writes appended keys and values in place.
#[derive(Debug)]
pub struct Fp8TensorMut<'a> {
    data: Fp8SliceMut<'a>,
    shape: Vec<usize>,
    strides: Vec<usize>,
}

impl<'a> Fp8TensorMut<'a> {
    /// A view with explicit strides (in elements). Checked when passed to a call.
    pub fn new<T: Fp8Element>(data: &'a mut [T], shape: &[usize], strides: &[usize]) -> Self {
        Fp8TensorMut {
            data: T::wrap_mut(data),
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        }
    }
    /// A contiguous row-major view.
    pub fn contiguous<T: Fp8Element>(data: &'a mut [T], shape: &[usize]) -> Self {
        Self::new(data, shape, &contiguous_strides(shape))
    }
    pub fn format(&self) -> Fp8Format {
        self.data.format()
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    /// A read-only view of the same tensor.
    pub fn view(&self) -> Fp8TensorRef<'_> {
        Fp8TensorRef::from_slice(self.data.as_slice(), &self.shape, &self.strides)
    }
}

/// A strided view of a caller's FP8 buffer (strides in elements, last dimension contiguous), as
/// [`TensorRef`] for the other dtypes.
#[derive(Clone, Debug)]
pub struct Fp8TensorRef<'a> {
    data: Fp8Slice<'a>,
    shape: Vec<usize>,
    strides: Vec<usize>,
}

impl<'a> Fp8TensorRef<'a> {
    /// A view with explicit strides (in elements). Checked when passed to an attention call.
    pub fn new<T: Fp8Element>(data: &'a [T], shape: &[usize], strides: &[usize]) -> Self {
        Self::from_slice(T::wrap(data), shape, strides)
    }
    /// A contiguous row-major view.
    pub fn contiguous<T: Fp8Element>(data: &'a [T], shape: &[usize]) -> Self {
        Self::new(data, shape, &contiguous_strides(shape))
    }
    pub fn from_slice(data: Fp8Slice<'a>, shape: &[usize], strides: &[usize]) -> Self {
        Fp8TensorRef {
            data,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        }
    }
    pub fn format(&self) -> Fp8Format {
        self.data.format()
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    pub fn data(&self) -> Fp8Slice<'a> {
        self.data
    }
}

/// Validation sees an FP8 view as what it computes in: bf16.
impl ViewDesc for Fp8TensorRef<'_> {
    fn dtype(&self) -> DType {
        DType::BF16
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn strides(&self) -> &[usize] {
        &self.strides
    }
    fn buffer_len(&self) -> usize {
        self.data.len()
    }
}

/// Attention over FP8 q, k and v, all three of one [`Fp8Format`], with their dequantisation
/// factors in `opts.descale` ([`AttnOptions::descale`]; unset: all 1; per tensor, per (sequence,
/// kv head) or per block of 128 rows, [`Descale`]): batched, q
/// `[batch, seqlen_q, heads, head_dim]` and k, v `[batch, seqlen_k, heads_kv, head_dim]`, or packed
/// with [`AttnOptions::varlen`] (q `[total_q, heads, head_dim]`, k, v `[total_k, heads_kv,
/// head_dim]`; per-sequence factors are indexed by sequence). Returns `out` in bf16 and `lse` in
/// f32, as [`crate::flash_attn`] (see the module documentation).
pub fn flash_attn_fp8(
    q: &Fp8TensorRef,
    k: &Fp8TensorRef,
    v: &Fp8TensorRef,
    opts: &AttnOptions,
) -> Result<AttnOutput> {
    let p = validate_forward([q, k, v], opts)?;
    if blocks(&p).is_some() {
        let out_shape = p.out_shape.clone();
        let res = forward_per_block(p, [q, k, v], opts)?;
        let out = f32_out(&res).iter().map(|&x| bf16::from_f32(x)).collect();
        return Ok(AttnOutput {
            out: Tensor::new_unchecked(Buffer::BF16(out), out_shape),
            lse: res.lse,
        });
    }
    if p.kernels.has_bf16_dot() {
        let (out, lse) = forward_fp8(&p, source(q), source(k), source(v))?;
        return Ok(AttnOutput {
            out: Tensor::new_unchecked(Buffer::BF16(out), p.out_shape.clone()),
            lse: Tensor::new_unchecked(Buffer::F32(lse), p.lse_shape.clone()),
        });
    }
    let copies = widen_qkv(&p, [q, k, v])?;
    let [qv, kv, vv] = copies.views([q, k, v]);
    let p = revalidate(p, [&qv, &kv, &vv], opts)?;
    crate::forward(&p, &qv, &kv, &vv)
}

/// [`flash_attn_fp8`] writing into caller-provided buffers ([`OutBuffers`]: `out` bf16, contiguous,
/// with q's shape; `lse` f32 with the call's lse shape): no allocation of them, no copy.
/// Everything, the destinations included, is validated first: on error nothing is written.
/// Every element of `out` and `lse` is written.
pub fn flash_attn_fp8_into(
    q: &Fp8TensorRef,
    k: &Fp8TensorRef,
    v: &Fp8TensorRef,
    opts: &AttnOptions,
    dst: OutBuffers,
) -> Result<()> {
    let p = validate_forward([q, k, v], opts)?;
    params::out_buffers(&p, DType::BF16, &dst)?;
    if blocks(&p).is_some() {
        let res = forward_per_block(p, [q, k, v], opts)?;
        let SliceMut::BF16(dst_out) = dst.out else {
            unreachable!("checked: out is bf16")
        };
        for (d, &x) in dst_out.iter_mut().zip(f32_out(&res)) {
            *d = bf16::from_f32(x);
        }
        let lse = res
            .lse
            .as_slice::<f32>()
            .expect("the f32 forward's lse is f32");
        dst.lse.copy_from_slice(lse);
        return Ok(());
    }
    if p.kernels.has_bf16_dot() {
        let SliceMut::BF16(out) = dst.out else {
            unreachable!("checked: out is bf16")
        };
        return forward_fp8_into(&p, (source(q), source(k), source(v)), out, dst.lse);
    }
    let copies = widen_qkv(&p, [q, k, v])?;
    let [qv, kv, vv] = copies.views([q, k, v]);
    let p = revalidate(p, [&qv, &kv, &vv], opts)?;
    crate::forward_into(&p, &qv, &kv, &vv, dst)
}

/// The checks of an FP8 forward call, shared by the CPU and the CUDA path, in this order: q, k
/// and v in one format; the shapes and options (the views seen as bf16, their bounds in elements
/// of one byte), batched or packed (`opts.cu_seqlens`); the descale factors (`opts.descale`).
/// Returns the validated call, its `descale` holding the folded score scales and the v factors.
pub(crate) fn validate_forward<V: Fp8View>(
    [q, k, v]: [&V; 3],
    opts: &AttnOptions,
) -> Result<Params> {
    check_formats(q, k, v)?;
    params::check_no_mask_mod(opts, "the FP8 calls")?;
    let mut p = params::layout(q, k, v, opts)?;
    let fmax = q.fp8_format().max() as f64;
    p.descale = Some(check_descale(&opts.descale.unwrap_or_default(), &p, fmax)?);
    Ok(p)
}

/// Contiguous copies of FP8 q, k and v in a wider element type: bf16 (`Widened`: what the forward
/// reads without a bf16 dot product, the f32 products) or f32 (`Dequantized`: with per-block
/// factors applied).
struct QkvCopies<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
}

type Widened = QkvCopies<bf16>;
type Dequantized = QkvCopies<f32>;

impl<T: Element> QkvCopies<T> {
    /// The copies as views of the shapes of `qkv`.
    fn views<'a>(&'a self, [q, k, v]: [&Fp8TensorRef; 3]) -> [TensorRef<'a>; 3] {
        [
            TensorRef::contiguous(&self.q, q.shape()),
            TensorRef::contiguous(&self.k, k.shape()),
            TensorRef::contiguous(&self.v, v.shape()),
        ]
    }
}

/// q, k and v of validated `p` widened to bf16 (exact).
fn widen_qkv(p: &Params, [q, k, v]: [&Fp8TensorRef; 3]) -> Result<Widened> {
    let isa = p.kernels.isa;
    Ok(Widened {
        q: widen("the bf16 copy of `q`", q, isa)?,
        k: widen("the bf16 copy of `k`", k, isa)?,
        v: widen("the bf16 copy of `v`", v, isa)?,
    })
}

/// The params of the contiguous bf16 copies of validated `p`'s inputs, with `p`'s folded factors.
/// The same shapes and options as accepted before, now over contiguous copies: only the layout
/// differs, so this cannot be rejected.
fn revalidate(mut p: Params, [q, k, v]: [&TensorRef; 3], opts: &AttnOptions) -> Result<Params> {
    let descales = p.descale.take();
    params::check_no_mask_mod(opts, "the FP8 calls")?;
    let mut p = params::layout(q, k, v, opts)?;
    p.descale = descales;
    Ok(p)
}

/// The view's bytes, read through its format's table.
fn source<'a>(t: &Fp8TensorRef<'a>) -> Fp8Source<'a> {
    Fp8Source {
        bytes: t.data().bytes(),
        table: t.format().bf16_table(),
    }
}

fn check_formats<V: Fp8View>(q: &V, k: &V, v: &V) -> Result<()> {
    for (tensor, t) in [("k", k), ("v", v)] {
        if t.fp8_format() != q.fp8_format() {
            return Err(ErrorKind::Fp8Format {
                tensor,
                expected: q.fp8_format(),
                got: t.fp8_format(),
            }
            .into());
        }
    }
    Ok(())
}

/// One factor list, checked, as one factor per (sequence, kv head) (`None`: all 1).
fn read_factors(tensor: TensorName, f: Option<&[f32]>, p: &Params) -> Result<Vec<f32>> {
    let (batch, heads_kv) = (p.seqs.len(), p.heads_kv);
    let n = batch * heads_kv;
    let Some(f) = f else {
        return Ok(vec![1.0; n]);
    };
    if f.len() != 1 && f.len() != n {
        return Err(ErrorKind::DescaleLength {
            tensor,
            got: f.len(),
            batch,
            heads_kv,
        }
        .into());
    }
    if let Some((index, &value)) = f
        .iter()
        .enumerate()
        .find(|(_, x)| !(x.is_finite() && **x > 0.0))
    {
        return Err(ErrorKind::DescaleValue {
            tensor,
            index,
            value,
        }
        .into());
    }
    Ok((0..n)
        .map(|i| f[if f.len() == 1 { 0 } else { i }])
        .collect())
}

/// Reads the three factor lists into one per (sequence, kv head), checked (or, per block, the
/// three tables: [`check_blocks`]); `fmax` is the largest finite value of the inputs' format.
fn check_descale(d: &Descale, p: &Params, fmax: f64) -> Result<Descales> {
    if d.per_block {
        return check_blocks(d, p, fmax);
    }
    let (dq, dk, dv) = (
        read_factors("q_descale", d.q, p)?,
        read_factors("k_descale", d.k, p)?,
        read_factors("v_descale", d.v, p)?,
    );
    fold_descale(&dq, &dk, dv, p, (fmax, fmax))
}

/// `softmax_scale · q_descale · k_descale` per (sequence, kv head), checked to fit f32, with the
/// v factors. `(q_max, kv_max)` bound the raw values of q and of the caches or k and v (their
/// format's largest finite value; 1 for a q that is not FP8, whose values are the caller's
/// data): with them the largest score and output element the factors allow must fit f32.
fn fold_descale(
    dq: &[f32],
    dk: &[f32],
    dv: Vec<f32>,
    p: &Params,
    (q_max, kv_max): (f64, f64),
) -> Result<Descales> {
    let scale = p.softmax_scale as f64;
    let score_scale: Vec<f32> = dq
        .iter()
        .zip(dk)
        .map(|(&a, &b)| (scale * a as f64 * b as f64) as f32)
        .collect();
    for &s in &score_scale {
        check_folded(s, p, (q_max, kv_max))?;
    }
    for &x in &dv {
        check_v_factor(x, kv_max)?;
    }
    Ok(Descales {
        score_scale,
        out_scale: dv,
        blocks: None,
    })
}

/// The checks of one folded score scale `s` (`softmax_scale · q_descale · k_descale`, see
/// [`fold_descale`]).
fn check_folded(s: f32, p: &Params, (q_max, kv_max): (f64, f64)) -> Result<()> {
    // Each factor is finite and > 0, but their product with the softmax scale may leave f32: it
    // must not underflow (unless the softmax scale is 0), and must pass a softmax scale's checks.
    if p.softmax_scale != 0.0 && s.abs() < f32::MIN_POSITIVE {
        return Err(ErrorKind::Scale { scale: s }.into());
    }
    params::check_score_scale(s, p.softcap)?;
    // A score is at most |s| · q_max · kv_max · head_dim (before the softcap, if any).
    let reach = s.abs() as f64 * q_max * kv_max * p.head_dim as f64;
    if reach * std::f64::consts::LOG2_E >= f32::MAX as f64 {
        return Err(ErrorKind::DescaleRange {
            what: "scores (softmax_scale · q_descale · k_descale · head_dim · the \
                   largest q and k values)",
            reach,
        }
        .into());
    }
    Ok(())
}

/// A v factor `x` with the largest raw v value `kv_max`: the outputs must fit f32.
fn check_v_factor(x: f32, kv_max: f64) -> Result<()> {
    let reach = x as f64 * kv_max;
    if reach >= f32::MAX as f64 {
        return Err(ErrorKind::DescaleRange {
            what: "outputs (v_descale · the largest v value)",
            reach,
        }
        .into());
    }
    Ok(())
}

impl BlockDescales {
    /// The tables as the CUDA forward kernels read them (params.cuh: FwdParams), appended to
    /// `table` (2 factors per (launched sequence, kv head)), whose v factors become the largest v
    /// factor each (sequence, kv head) uses (1 where it has no key). `launched` sequences (`p`'s,
    /// then possibly a tail of packed rows, whose factors are 1 and never scale a score), the
    /// longest with `max_q` query rows. The q table holds `softmax_scale · q_descale` (one f64
    /// product, rounded once), the v table `v_descale` over its pair's v factor (at most 1).
    /// Returns the fields `[block_q, block_k, block_v, q_blocks, k_blocks]`.
    #[cfg(feature = "cuda")]
    pub(crate) fn append_kernel_tables(
        &self,
        p: &Params,
        launched: usize,
        max_q: usize,
        table: &mut Vec<f32>,
    ) -> [i32; 5] {
        let (heads, hk) = (p.heads, p.heads_kv);
        let q_blocks = self.q_blocks.max(max_q.div_ceil(DESCALE_BLOCK));
        let k_blocks = self.k_blocks;
        let scale = p.softmax_scale as f64;
        let block_q = table.len();
        for b in 0..launched {
            for h in 0..heads {
                for i in 0..q_blocks {
                    table.push(if b < p.seqs.len() && i < self.q_blocks {
                        (scale * self.q[(b * heads + h) * self.q_blocks + i] as f64) as f32
                    } else {
                        1.0
                    });
                }
            }
        }
        let block_k = table.len();
        let pairs = |b: usize, h: usize| (b * hk + h) * k_blocks..(b * hk + h + 1) * k_blocks;
        for b in 0..launched {
            for h in 0..hk {
                if b < p.seqs.len() {
                    table.extend_from_slice(&self.k[pairs(b, h)]);
                } else {
                    table.extend(std::iter::repeat_n(1.0, k_blocks));
                }
            }
        }
        let block_v = table.len();
        for b in 0..launched {
            for h in 0..hk {
                if b >= p.seqs.len() {
                    table.extend(std::iter::repeat_n(1.0, k_blocks));
                    continue;
                }
                let used = p.seqs[b].seqlen_k.div_ceil(DESCALE_BLOCK);
                let v = &self.v[pairs(b, h)];
                let v_max = v[..used].iter().fold(0f32, |m, &x| m.max(x));
                let v_max = if v_max > 0.0 { v_max } else { 1.0 };
                table[2 * (b * hk + h) + 1] = v_max;
                table.extend(v.iter().map(|&x| x / v_max));
            }
        }
        [block_q, block_k, block_v, q_blocks, k_blocks].map(|x| x as i32)
    }
}

/// The per-block factors of `p`'s call, if it has them.
pub(crate) fn blocks(p: &Params) -> Option<&BlockDescales> {
    p.descale.as_ref().and_then(|d| d.blocks.as_ref())
}

/// One per-block table, checked: its length, then every entry a row reads (finite, > 0; `None`:
/// all 1). `len_of(b)` is sequence b's row count; padding entries become 1.
fn read_block_table(
    tensor: TensorName,
    f: Option<&[f32]>,
    p: &Params,
    heads: usize,
    len_of: fn(&crate::params::Seq) -> usize,
) -> Result<(usize, Vec<f32>)> {
    let batch = p.seqs.len();
    let blocks = p
        .seqs
        .iter()
        .map(|s| len_of(s).div_ceil(DESCALE_BLOCK))
        .max()
        .unwrap_or(0);
    let n = batch * heads * blocks;
    let Some(f) = f else {
        return Ok((blocks, vec![1.0; n]));
    };
    if f.len() != n {
        return Err(ErrorKind::DescaleBlockLength {
            tensor,
            got: f.len(),
            expected: n,
            batch,
            heads,
            blocks,
        }
        .into());
    }
    let mut table = vec![1.0; n];
    for (b, s) in p.seqs.iter().enumerate() {
        let used = len_of(s).div_ceil(DESCALE_BLOCK);
        for h in 0..heads {
            let row = (b * heads + h) * blocks;
            for index in row..row + used {
                let value = f[index];
                if !(value.is_finite() && value > 0.0) {
                    return Err(ErrorKind::DescaleValue {
                        tensor,
                        index,
                        value,
                    }
                    .into());
                }
                table[index] = value;
            }
        }
    }
    Ok((blocks, table))
}

/// The per-block tables of `d`, checked as [`fold_descale`] checks folded factors, on the
/// extremes of each (sequence, kv head): the largest and smallest products `softmax_scale ·
/// q_descale · k_descale` of its blocks, its largest v factor; and every factor times `fmax`
/// must fit f32 (the CPU path dequantises into f32). The folded `score_scale` is the softmax
/// scale and `out_scale` 1: the factors live in `blocks`.
fn check_blocks(d: &Descale, p: &Params, fmax: f64) -> Result<Descales> {
    let (q_blocks, q) = read_block_table("q_descale", d.q, p, p.heads, |s| s.seqlen_q)?;
    let (k_blocks, k) = read_block_table("k_descale", d.k, p, p.heads_kv, |s| s.seqlen_k)?;
    let (_, v) = read_block_table("v_descale", d.v, p, p.heads_kv, |s| s.seqlen_k)?;
    let scale = p.softmax_scale as f64;
    let group = p.heads / p.heads_kv;
    let extremes = |x: &[f32]| {
        x.iter().fold((f64::INFINITY, 0f64), |(lo, hi), &x| {
            (lo.min(x as f64), hi.max(x as f64))
        })
    };
    for t in [&q, &k, &v] {
        let (_, hi) = extremes(t);
        let reach = hi * fmax;
        if reach >= f32::MAX as f64 {
            return Err(ErrorKind::DescaleRange {
                what: "inputs (a descale factor · the format's largest value)",
                reach,
            }
            .into());
        }
    }
    // Over the entries the rows read (padding is neither checked nor used).
    for (b, s) in p.seqs.iter().enumerate() {
        let (q_used, k_used) = (
            s.seqlen_q.div_ceil(DESCALE_BLOCK),
            s.seqlen_k.div_ceil(DESCALE_BLOCK),
        );
        for hk in 0..p.heads_kv {
            let qf: Vec<f32> = (hk * group..(hk + 1) * group)
                .flat_map(|h| {
                    let row = (b * p.heads + h) * q_blocks;
                    q[row..row + q_used].iter().copied()
                })
                .collect();
            let row = (b * p.heads_kv + hk) * k_blocks;
            let (q_lo, q_hi) = extremes(&qf);
            let (k_lo, k_hi) = extremes(&k[row..row + k_used]);
            if q_used > 0 && k_used > 0 {
                for (a, c) in [(q_lo, k_lo), (q_hi, k_hi)] {
                    check_folded((scale * a * c) as f32, p, (fmax, fmax))?;
                }
            }
            let (_, v_hi) = extremes(&v[row..row + k_used]);
            check_v_factor(v_hi as f32, fmax)?;
        }
    }
    Ok(Descales {
        score_scale: vec![p.softmax_scale; p.seqs.len() * p.heads_kv],
        out_scale: vec![1.0; p.seqs.len() * p.heads_kv],
        blocks: Some(BlockDescales {
            q_blocks,
            k_blocks,
            q,
            k,
            v,
        }),
    })
}

/// The forward of validated `p` with per-block factors: the f32 forward on the dequantised
/// copies ([`dequantize_qkv`]); its `out` (f32, contiguous, q's shape) is rounded to bf16 by the
/// caller ([`f32_out`]), its `lse` is the call's.
fn forward_per_block(p: Params, qkv: [&Fp8TensorRef; 3], opts: &AttnOptions) -> Result<AttnOutput> {
    let (copies, p) = dequantize_qkv(p, qkv, opts)?;
    let [qv, kv, vv] = copies.views(qkv);
    crate::forward(&p, &qv, &kv, &vv)
}

/// The f32 `out` of [`forward_per_block`], borrowed (no copy before the rounding to bf16).
fn f32_out(res: &AttnOutput) -> &[f32] {
    res.out
        .as_slice::<f32>()
        .expect("the forward on f32 copies writes an f32 out")
}

/// Contiguous f32 copies of q, k and v of validated `p` (per-block factors), each element its
/// FP8 value times its block's factor (one rounding, to f32), and the params of the f32
/// forward over them (no factors left).
fn dequantize_qkv(
    p: Params,
    [q, k, v]: [&Fp8TensorRef; 3],
    opts: &AttnOptions,
) -> Result<(Dequantized, Params)> {
    let bd = blocks(&p).expect("per-block params");
    let copies = Dequantized {
        q: dequantize("the f32 copy of `q`", q, &p, bd, 0)?,
        k: dequantize("the f32 copy of `k`", k, &p, bd, 1)?,
        v: dequantize("the f32 copy of `v`", v, &p, bd, 2)?,
    };
    let [qv, kv, vv] = copies.views([q, k, v]);
    let mut opts = opts.clone();
    opts.descale = None;
    params::check_no_mask_mod(&opts, "the FP8 calls")?;
    let p = params::layout(&qv, &kv, &vv, &opts)?;
    Ok((copies, p))
}

/// Tensor `t` (0: q, 1: k, 2: v) of validated `p` dequantised with its per-block factors:
/// `fp8 · factor` rounded once to f32, contiguous row-major. Rows outside every sequence (packed
/// rows after the last one) take factor 1.
fn dequantize(
    what: &'static str,
    x: &Fp8TensorRef,
    p: &Params,
    bd: &BlockDescales,
    t: usize,
) -> Result<Vec<f32>> {
    let (bytes, format) = (x.data().bytes(), x.format());
    let (outer, strides) = (&x.shape()[..x.shape().len() - 1], x.strides());
    let d = *x.shape().last().expect("validated rank");
    let heads = if t == 0 { p.heads } else { p.heads_kv };
    let rows: usize = outer.iter().product();
    let tokens = rows / heads.max(1);
    // (sequence, position) of each token; u32::MAX for none.
    let mut seq_pos = vec![(u32::MAX, 0u32); tokens];
    for (b, s) in p.seqs.iter().enumerate() {
        let (row0, len) = if t == 0 {
            (s.out_row0, s.seqlen_q)
        } else {
            (s.k_row0, s.seqlen_k)
        };
        for i in 0..len {
            seq_pos[row0 + i] = (b as u32, i as u32);
        }
    }
    let mut out = crate::memory::try_filled(what, 0f32, rows * d)?;
    if d == 0 {
        return Ok(out);
    }
    out.par_chunks_mut(d).enumerate().for_each(|(r, row)| {
        let at = row_offset(outer, strides, r);
        let (b, i) = seq_pos[r / heads];
        let f = if b == u32::MAX {
            1.0
        } else {
            bd.factor(t, heads, b as usize, r % heads, i as usize)
        };
        for (o, &x) in row.iter_mut().zip(&bytes[at..at + d]) {
            *o = crate::cpu::fp8::to_f32(x, format) * f;
        }
    });
    Ok(out)
}

/// Element offset of row `r` of a view (`r` indexes all its dimensions but the last, row-major;
/// `outer` is the shape without the last dimension, `strides` the view's).
fn row_offset(outer: &[usize], strides: &[usize], mut r: usize) -> usize {
    let mut at = 0;
    for (&n, &s) in outer.iter().zip(&strides[..outer.len()]).rev() {
        at += (r % n) * s;
        r /= n;
    }
    at
}

/// The view's elements widened to bf16 (exact), contiguous row-major. The view was validated:
/// every element it addresses lies in its buffer and its last dimension is contiguous.
fn widen(what: &'static str, t: &Fp8TensorRef, isa: crate::cpu::simd::Isa) -> Result<Vec<bf16>> {
    let (bytes, format) = (t.data().bytes(), t.format());
    let (outer, strides) = (&t.shape()[..t.shape().len() - 1], t.strides());
    let d = *t.shape().last().expect("validated rank");
    let rows: usize = outer.iter().product();
    let mut out = crate::memory::try_filled(what, bf16::ZERO, rows * d)?;
    if d == 0 {
        return Ok(out);
    }
    out.par_chunks_mut(d * 256)
        .enumerate()
        .for_each(|(chunk, rows)| {
            for (i, row) in rows.chunks_mut(d).enumerate() {
                let at = row_offset(outer, strides, chunk * 256 + i);
                crate::cpu::fp8::widen(isa, format, &bytes[at..at + d], row);
            }
        });
    Ok(out)
}

/// Decoding with FP8 KV caches: [`crate::flash_attn_with_kvcache`] where `k_cache` and `v_cache`
/// hold FP8 values of one format (the true key is `k_fp8 · k_descale`, likewise v), as serving
/// engines keep their caches in FP8 to halve their memory (vLLM's `kv_cache_dtype="fp8"` with
/// `k_scale`/`v_scale`).
///
/// q stays in f32, f16 or bf16, and so does `out`; `opts.new_kv` (q's dtype) is appended
/// quantised: each new key (rotated first, with `opts.rotary`) and value is divided by its
/// descale factor and rounded once to the cache's format, saturating at its largest finite value
/// ([`Fp8Format::quantise`]). The factors are `opts.attn.descale` ([`KvCacheOptions::descale`]):
/// `k` and `v` hold 1 or `batch · heads_kv` factors (finite, > 0; per batch row of q, whichever
/// cache row it reads; unset: 1); `q` must be unset.
///
/// The attention itself is exact in q's dtype: every FP8 value is a value of f32, f16 and bf16,
/// so the cache's keys and values are widened without rounding (a few keys at a time, into a tile
/// the products of the other dtypes then read), `softmax_scale · k_descale` (rounded once) scales
/// the dot products and `v_descale` the finished rows. Every option of
/// [`crate::flash_attn_with_kvcache`] applies (paged caches, `cache_batch_idx`, `cache_leftpad`,
/// packed queries and new keys, split-KV, masks, softcap, ALiBi, GQA/MQA); the same validation
/// runs first, and a rejected call leaves the caches bit-identical.
///
/// ```
/// use flashattn::fp8::{flash_attn_with_kvcache_fp8, Descale, Fp8TensorMut, F8E4M3};
/// use flashattn::{KvCacheOptions, TensorRef};
/// let (cap, heads, heads_kv, d) = (64, 8, 2, 16);
/// let mut k_cache = vec![F8E4M3::from_f32(0.0); cap * heads_kv * d];
/// let mut v_cache = vec![F8E4M3::from_f32(0.0); cap * heads_kv * d];
/// let q = vec![0.1f32; heads * d];
/// let (k_new, v_new) = (vec![0.2f32; heads_kv * d], vec![0.3f32; heads_kv * d]);
/// let shape = [1, cap, heads_kv, d];
/// let res = flash_attn_with_kvcache_fp8(
///     &TensorRef::contiguous(&q, &[1, 1, heads, d]),
///     &mut Fp8TensorMut::contiguous(&mut k_cache, &shape),
///     &mut Fp8TensorMut::contiguous(&mut v_cache, &shape),
///     &[0],
///     &KvCacheOptions::default()
///         .descale(Descale::default().k(&[0.01]).v(&[0.01]))
///         .new_kv(
///             TensorRef::contiguous(&k_new, &[1, 1, heads_kv, d]),
///             TensorRef::contiguous(&v_new, &[1, 1, heads_kv, d]),
///         ),
/// )?;
/// assert_eq!(k_cache[0].to_f32(), 20.0); // 0.2 / 0.01, stored in e4m3
/// // One key: out is its value, 20 · 0.01 = 0.2 (0.3 / 0.01 = 30 is exact in e4m3 too).
/// assert!(res.out.to_f32_vec().iter().all(|&x| (x - 0.3).abs() < 1e-6));
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn flash_attn_with_kvcache_fp8(
    q: &TensorRef,
    k_cache: &mut Fp8TensorMut,
    v_cache: &mut Fp8TensorMut,
    cache_seqlens: &[i32],
    opts: &KvCacheOptions,
) -> Result<AttnOutput> {
    let (dp, dk) = validate_kvcache_call(q, (k_cache, v_cache), cache_seqlens, opts)?;
    // Every check passed. Only the results' allocation can still fail (`OutOfMemory`), and it
    // comes before the caches are written.
    let (mut out, mut lse) = crate::decode::new_results(&dp.p)?;
    let dst = (crate::decode::buffer_mut(&mut out), &mut lse[..]);
    kvcache_fp8(&dp, &dk, q, (k_cache, v_cache), opts, dst)?;
    Ok(crate::decode::results(&dp.p, out, lse))
}

/// [`flash_attn_with_kvcache_fp8`] writing `out` (q's dtype, contiguous, q's shape) and `lse`
/// into caller-provided buffers, as [`crate::flash_attn_with_kvcache_into`]: everything, the
/// destinations included, is validated first (on error nothing is written, the caches untouched).
pub fn flash_attn_with_kvcache_fp8_into(
    q: &TensorRef,
    k_cache: &mut Fp8TensorMut,
    v_cache: &mut Fp8TensorMut,
    cache_seqlens: &[i32],
    opts: &KvCacheOptions,
    dst: OutBuffers,
) -> Result<()> {
    let (dp, dk) = validate_kvcache_call(q, (k_cache, v_cache), cache_seqlens, opts)?;
    params::out_buffers(&dp.p, dp.p.dtype, &dst)?;
    kvcache_fp8(&dp, &dk, q, (k_cache, v_cache), opts, (dst.out, dst.lse))
}

fn validate_kvcache_call(
    q: &TensorRef,
    (k_cache, v_cache): (&Fp8TensorMut, &Fp8TensorMut),
    cache_seqlens: &[i32],
    opts: &KvCacheOptions,
) -> Result<(crate::params::DecodeParams, Vec<f32>)> {
    validate_kvcache(
        &ViewInfo::of(q),
        (&k_cache.view(), &v_cache.view()),
        opts.new_kv
            .as_ref()
            .map(|(k, v)| (ViewInfo::of(k), ViewInfo::of(v))),
        cache_seqlens,
        opts,
    )
}

/// The FP8 decode of validated `dp` (k factors `dk`) into `dst`.
fn kvcache_fp8(
    dp: &crate::params::DecodeParams,
    dk: &[f32],
    q: &TensorRef,
    (k_cache, v_cache): (&mut Fp8TensorMut, &mut Fp8TensorMut),
    opts: &KvCacheOptions,
    dst: (SliceMut, &mut [f32]),
) -> Result<()> {
    let format = k_cache.format();
    // The v factors, as folded (they scale the output rows unchanged).
    let dv = dp.p.descale.as_ref().map_or(&[][..], |d| &d.out_scale);
    crate::cpu::decode::run_fp8(
        dp,
        q,
        opts.new_kv.as_ref(),
        (k_cache.data.bytes_mut(), v_cache.data.bytes_mut()),
        format,
        (dk, dv),
        dst,
    )
}

/// An FP8 cache as validation sees it: its format and its view.
pub(crate) trait Fp8View: ViewDesc {
    fn fp8_format(&self) -> Fp8Format;
}

impl Fp8View for Fp8TensorRef<'_> {
    fn fp8_format(&self) -> Fp8Format {
        self.format()
    }
}

/// The checks of a decode call on FP8 caches, shared by the CPU and the CUDA path, in this order:
/// both caches in one format, no q factor, the call's shapes and options (the caches seen as
/// holding q's dtype: their bounds are in elements, one byte each; the new keys and values must
/// be in q's dtype), the k and v factors (`opts.attn.descale`). Returns the validated call, its `descale` holding the
/// score scales (`softmax_scale · k_descale`, rounded once) and the v factors, and the k factors
/// per (sequence, kv head), by which appended keys are divided.
pub(crate) fn validate_kvcache<C: Fp8View + ?Sized>(
    q: &ViewInfo,
    (k_cache, v_cache): (&C, &C),
    new_kv: Option<(ViewInfo, ViewInfo)>,
    cache_seqlens: &[i32],
    opts: &KvCacheOptions,
) -> Result<(crate::params::DecodeParams, Vec<f32>)> {
    let descale = opts.attn.descale.unwrap_or_default();
    let format = k_cache.fp8_format();
    if v_cache.fp8_format() != format {
        return Err(ErrorKind::Fp8CacheFormat {
            expected: format,
            got: v_cache.fp8_format(),
        }
        .into());
    }
    if descale.per_block {
        return Err(ErrorKind::DescalePerBlock {
            call: "a decode call on FP8 caches",
        }
        .into());
    }
    if descale.q.is_some() {
        return Err(ErrorKind::DescaleUnused {
            tensor: "q_descale",
        }
        .into());
    }
    let mut dp = crate::params::decode::validate_caches(
        q,
        &ViewInfo::with_dtype(k_cache, q.dtype),
        &ViewInfo::with_dtype(v_cache, q.dtype),
        new_kv.as_ref().map(|(k, v)| (k, v)),
        cache_seqlens,
        opts,
    )?;
    let dk = read_factors("k_descale", descale.k, &dp.p)?;
    let dv = read_factors("v_descale", descale.v, &dp.p)?;
    let ones = vec![1.0; dk.len()];
    let fmax = format.max() as f64;
    dp.p.descale = Some(fold_descale(&ones, &dk, dv, &dp.p, (1.0, fmax))?);
    Ok((dp, dk))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table against the formats' definitions, decoded here from the bits.
    #[test]
    fn tables_decode_every_bit_pattern() {
        for (format, exp_bits, bias) in [(Fp8Format::E4M3, 4, 7), (Fp8Format::E5M2, 5, 15)] {
            let man_bits = 7 - exp_bits;
            for bits in 0..=255u8 {
                let sign = if bits & 0x80 != 0 { -1.0 } else { 1.0 };
                let e = ((bits >> man_bits) & ((1 << exp_bits) - 1)) as i32;
                let m = (bits & ((1 << man_bits) - 1)) as f64;
                let all_ones = e == (1 << exp_bits) - 1;
                let got = format.bf16_table()[bits as usize].to_f64();
                match format {
                    Fp8Format::E4M3 if all_ones && m == 7.0 => assert!(got.is_nan(), "{bits:#x}"),
                    Fp8Format::E5M2 if all_ones && m != 0.0 => assert!(got.is_nan(), "{bits:#x}"),
                    Fp8Format::E5M2 if all_ones => assert_eq!(got, sign * f64::INFINITY),
                    _ => {
                        let want = if e == 0 {
                            sign * m / (1 << man_bits) as f64 * 2f64.powi(1 - bias)
                        } else {
                            sign * (1.0 + m / (1 << man_bits) as f64) * 2f64.powi(e - bias)
                        };
                        assert_eq!(got, want, "{format} bits {bits:#010b}");
                    }
                }
            }
            assert_eq!(
                format
                    .bf16_table()
                    .iter()
                    .filter(|x| x.is_finite())
                    .fold(0f32, |m, x| m.max(x.to_f32())),
                format.max()
            );
        }
    }
}
