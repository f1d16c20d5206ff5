//! Quantising q, k and v to FP8 for [`super::flash_attn_fp8`], with FlashAttention-3's incoherent
//! processing as an option.
//!
//! Each tensor is divided by its descale factor and rounded once (to nearest even, saturating)
//! to the format; the factor is `amax / format max` over the values it covers, so the largest of
//! them lands on the format's largest finite value. The factors are what [`super::Descale`]
//! accepts: one per tensor ([`Granularity::PerTensor`]), one per (sequence, kv head)
//! ([`Granularity::PerHead`]; q's heads share their kv head's factor, as the forward reads it),
//! or, as FlashAttention-3's block quantisation, one per block of [`super::DESCALE_BLOCK`] = 128
//! rows of each (sequence, head) of q and (sequence, kv head) of k and v
//! ([`Granularity::PerBlock`]; blocks count from each sequence's first row; the tables'
//! layout is [`super::Descale::per_block`]'s, padding entries 1).
//!
//! **Incoherent processing** ([`QuantizeOptions::incoherent`]): q and k are multiplied along
//! head_dim by `M = D·H/√d` before they are quantised, `H` the Walsh–Hadamard matrix of order d
//! (a power of two) and `D` a diagonal of ±1 drawn from a seed ([`Incoherent`]). `M` is
//! orthogonal, so `(qM)(kM)ᵀ = qkᵀ`: the attention is unchanged, while an outlier coordinate is
//! spread over all d coordinates of its row, which lowers `amax` relative to the typical value
//! and so the quantisation error of everything else. v is quantised as it is (it is not inside
//! the product). The transform runs in f64, as a fast Walsh–Hadamard transform (d·log2 d adds).
//!
//! ```
//! use flashattn::fp8::{flash_attn_fp8, quantize_qkv, QuantizeOptions};
//! use flashattn::{AttnOptions, TensorRef};
//! let (b, n, h, d) = (1, 6, 2, 16);
//! let x: Vec<f32> = (0..b * n * h * d).map(|i| ((i * 7 % 11) as f32 - 5.0) / 3.0).collect();
//! let t = TensorRef::contiguous(&x, &[b, n, h, d]);
//! let qkv = quantize_qkv(&t, &t, &t, &QuantizeOptions::default().incoherent(42))?;
//! let [q, k, v] = qkv.views();
//! let res = flash_attn_fp8(&q, &k, &v, &AttnOptions::default().descale(qkv.descale()))?;
//! assert_eq!(res.out.shape(), &[b, n, h, d]);
//! # Ok::<(), flashattn::Error>(())
//! ```

use super::{Descale, Fp8Format, Fp8Slice, Fp8TensorRef};
use crate::error::{ErrorKind, Result};
use crate::params::{self, AttnOptions, Params};
use crate::tensor::{Slice, TensorRef};
use rayon::prelude::*;

/// Which values one descale factor covers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Granularity {
    /// One factor for the whole tensor.
    PerTensor,
    /// One factor per (sequence, kv head): `[batch, heads_kv]`, as [`super::Descale`] takes it.
    #[default]
    PerHead,
    /// One factor per block of 128 rows of each (sequence, head) for q, `[batch, heads,
    /// q_blocks]`, and of each (sequence, kv head) for k and v, `[batch, heads_kv, k_blocks]`
    /// (see [`super::Descale::per_block`]).
    PerBlock,
}

/// How [`quantize_qkv`] quantises.
#[derive(Clone, Copy, Debug)]
pub struct QuantizeOptions {
    /// The FP8 format of the results (default e4m3).
    pub format: Fp8Format,
    /// Which values share a descale factor (default [`Granularity::PerHead`]).
    pub granularity: Granularity,
    /// Incoherent processing of q and k with the signs of this seed (default off).
    pub incoherent: Option<u64>,
}

impl Default for QuantizeOptions {
    fn default() -> Self {
        QuantizeOptions {
            format: Fp8Format::E4M3,
            granularity: Granularity::PerHead,
            incoherent: None,
        }
    }
}

impl QuantizeOptions {
    pub fn format(mut self, format: Fp8Format) -> Self {
        self.format = format;
        self
    }
    pub fn granularity(mut self, granularity: Granularity) -> Self {
        self.granularity = granularity;
        self
    }
    /// Applies `D·H/√d` to q and k, `D`'s signs drawn from `seed` (see [`Incoherent`]).
    pub fn incoherent(mut self, seed: u64) -> Self {
        self.incoherent = Some(seed);
        self
    }
}

/// The random-sign Hadamard transform of incoherent processing: a row `x` of q or k (head_dim
/// values) becomes `x·D·H/√d`. Sign `i` of `D` is the top bit of SplitMix64 of `seed + i`
/// (set: −1), so other implementations can draw the same signs.
#[derive(Clone, Debug)]
pub struct Incoherent {
    signs: Vec<f64>,
}

impl Incoherent {
    /// The transform of order `head_dim`, which must be a power of two
    /// ([`ErrorKind::IncoherentHeadDim`] otherwise).
    pub fn new(head_dim: usize, seed: u64) -> Result<Self> {
        if !head_dim.is_power_of_two() {
            return Err(ErrorKind::IncoherentHeadDim { head_dim }.into());
        }
        let signs = (0..head_dim as u64)
            .map(|i| {
                if splitmix64(seed.wrapping_add(i)) >> 63 == 1 {
                    -1.0
                } else {
                    1.0
                }
            })
            .collect();
        Ok(Incoherent { signs })
    }

    /// The diagonal of `D`.
    pub fn signs(&self) -> &[f64] {
        &self.signs
    }

    /// `row ← row·D·H/√d` in place (`row.len()` = head_dim).
    pub fn apply(&self, row: &mut [f64]) {
        assert_eq!(row.len(), self.signs.len(), "row length is not head_dim");
        for (x, s) in row.iter_mut().zip(&self.signs) {
            *x *= s;
        }
        walsh_hadamard(row);
        let norm = 1.0 / (row.len() as f64).sqrt();
        for x in row.iter_mut() {
            *x *= norm;
        }
    }
}

/// SplitMix64's output function on `x` (after its increment).
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The unnormalised fast Walsh–Hadamard transform, `x ← x·H` with `H` of order `x.len()` (a
/// power of two) in Sylvester's order: `H = [[H', H'], [H', −H']]`.
pub fn walsh_hadamard(x: &mut [f64]) {
    let n = x.len();
    assert!(n.is_power_of_two(), "length {n} is not a power of two");
    let mut h = 1;
    while h < n {
        for block in x.chunks_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (s, d) = (*u + *v, *u - *v);
                (*u, *v) = (s, d);
            }
        }
        h *= 2;
    }
}

/// One quantised tensor: contiguous FP8 values (the input's shape, row-major) and its descale
/// factors (1, `batch · heads_kv`, or a per-block table, as [`super::Descale`] takes them).
#[derive(Clone, Debug)]
pub struct Quantized {
    format: Fp8Format,
    bytes: Vec<u8>,
    shape: Vec<usize>,
    descale: Vec<f32>,
    granularity: Granularity,
    /// The factor index of each row (token, head) of the contiguous layout.
    factor_of_row: Vec<u32>,
}

impl Quantized {
    pub fn format(&self) -> Fp8Format {
        self.format
    }
    /// The FP8 values' bits, contiguous row-major in [`Self::shape`].
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// The descale factors: the value stored is `x / descale`, so `x ≈ fp8 · descale`.
    pub fn descale(&self) -> &[f32] {
        &self.descale
    }
    /// Which values one factor covers.
    pub fn granularity(&self) -> Granularity {
        self.granularity
    }
    /// A contiguous view for the FP8 calls.
    pub fn view(&self) -> Fp8TensorRef<'_> {
        let data = match self.format {
            Fp8Format::E4M3 => Fp8Slice::E4M3(bytemuck::cast_slice(&self.bytes)),
            Fp8Format::E5M2 => Fp8Slice::E5M2(bytemuck::cast_slice(&self.bytes)),
        };
        Fp8TensorRef::from_slice(
            data,
            &self.shape,
            &crate::tensor::contiguous_strides(&self.shape),
        )
    }
    /// `fp8 · descale` per element, in f64 (exact), contiguous row-major.
    pub fn dequantized(&self) -> Vec<f64> {
        let table = self.format.bf16_table();
        let d = self.shape.last().copied().unwrap_or(0).max(1);
        self.bytes
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                table[b as usize].to_f64() * self.descale[self.factor_of_row[i / d] as usize] as f64
            })
            .collect()
    }
}

/// q, k and v quantised by [`quantize_qkv`] or [`quantize_qkv_varlen`].
#[derive(Clone, Debug)]
pub struct QuantizedQkv {
    pub q: Quantized,
    pub k: Quantized,
    pub v: Quantized,
    /// The transform applied to q and k, if any.
    pub incoherent: Option<Incoherent>,
}

impl QuantizedQkv {
    /// Views of q, k and v for [`super::flash_attn_fp8`] (or the varlen and CUDA forms).
    pub fn views(&self) -> [Fp8TensorRef<'_>; 3] {
        [self.q.view(), self.k.view(), self.v.view()]
    }
    /// The three tensors' descale factors.
    /// The three tensors' descale factors (per block: [`Descale::per_block`] set).
    pub fn descale(&self) -> Descale<'_> {
        let d = Descale::default()
            .q(&self.q.descale)
            .k(&self.k.descale)
            .v(&self.v.descale);
        if self.q.granularity == Granularity::PerBlock {
            d.per_block()
        } else {
            d
        }
    }
}

/// Quantises a batched call's q `[batch, seqlen_q, heads, head_dim]` and k, v `[batch, seqlen_k,
/// heads_kv, head_dim]` (f32, f16 or bf16, any strides with a contiguous last dimension, checked
/// as [`crate::flash_attn`] checks them) to FP8, for [`super::flash_attn_fp8`]. Non-finite inputs
/// do not count towards a factor (NaN stays NaN; ±inf saturates). With `opts.incoherent`,
/// head_dim must be a power of two.
pub fn quantize_qkv(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    opts: &QuantizeOptions,
) -> Result<QuantizedQkv> {
    let p = params::batched(q, k, v, &AttnOptions::default())?;
    quantize_all(&p, [q, k, v], opts)
}

/// [`quantize_qkv`] for packed sequences: q `[total_q, heads, head_dim]`, k and v `[total_k,
/// heads_kv, head_dim]`, with `cu_seqlens_q` and `cu_seqlens_k` as [`crate::AttnOptions::varlen`];
/// per-head factors are per (sequence, kv head).
pub fn quantize_qkv_varlen(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    opts: &QuantizeOptions,
) -> Result<QuantizedQkv> {
    let p = params::varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, &AttnOptions::default())?;
    quantize_all(&p, [q, k, v], opts)
}

fn quantize_all(
    p: &Params,
    [q, k, v]: [&TensorRef; 3],
    opts: &QuantizeOptions,
) -> Result<QuantizedQkv> {
    let rot = opts
        .incoherent
        .map(|seed| Incoherent::new(p.head_dim, seed))
        .transpose()?;
    Ok(QuantizedQkv {
        q: quantize_one(p, q, Which::Q, rot.as_ref(), opts)?,
        k: quantize_one(p, k, Which::K, rot.as_ref(), opts)?,
        v: quantize_one(p, v, Which::V, None, opts)?,
        incoherent: rot,
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Which {
    Q,
    K,
    V,
}

/// One tensor: its rows (transformed if `rot`) into f64, the factors, then the rounding.
fn quantize_one(
    p: &Params,
    t: &TensorRef,
    which: Which,
    rot: Option<&Incoherent>,
    opts: &QuantizeOptions,
) -> Result<Quantized> {
    let d = p.head_dim;
    let (heads, layout) = match which {
        Which::Q => (p.heads, p.q),
        Which::K => (p.heads_kv, p.k),
        Which::V => (p.heads_kv, p.v),
    };
    // Each token of the contiguous result: (sequence, element offset of its head 0 in `t`,
    // position in its sequence).
    let mut tokens: Vec<(usize, usize, usize)> = Vec::new();
    let mut blocks = 0;
    for (b, s) in p.seqs.iter().enumerate() {
        let (len, base) = match which {
            Which::Q => (s.seqlen_q, s.q_base),
            Which::K => (s.seqlen_k, s.k_base),
            Which::V => (s.seqlen_k, s.v_base),
        };
        blocks = blocks.max(len.div_ceil(params::DESCALE_BLOCK));
        tokens.extend((0..len).map(|i| (b, base + i * layout.row_stride, i)));
    }
    let rows = tokens.len() * heads;
    let group = if which == Which::Q {
        p.heads / p.heads_kv
    } else {
        1
    };
    let factor_of_row: Vec<u32> = (0..rows)
        .map(|r| {
            let ((b, _, i), head) = (tokens[r / heads], r % heads);
            match opts.granularity {
                Granularity::PerTensor => 0,
                Granularity::PerHead => (b * p.heads_kv + head / group) as u32,
                Granularity::PerBlock => {
                    ((b * heads + head) * blocks + i / params::DESCALE_BLOCK) as u32
                }
            }
        })
        .collect();
    let n_factors = match opts.granularity {
        Granularity::PerTensor => 1,
        Granularity::PerHead => p.seqs.len() * p.heads_kv,
        Granularity::PerBlock => p.seqs.len() * heads * blocks,
    };
    let mut vals = crate::memory::try_filled("the quantised tensor's f64 copy", 0f64, rows * d)?;
    let data = t.data();
    if d > 0 {
        vals.par_chunks_mut(d).enumerate().for_each(|(r, row)| {
            let ((_, at0, _), head) = (tokens[r / heads], r % heads);
            load_row(data, at0 + head * layout.head_stride, row);
            if let Some(rot) = rot {
                rot.apply(row);
            }
        });
    }
    let mut amax = vec![0f64; n_factors];
    if d > 0 {
        for (row, &f) in vals.chunks(d).zip(&factor_of_row) {
            let m = row
                .iter()
                .filter(|x| x.is_finite())
                .fold(0f64, |m, x| m.max(x.abs()));
            amax[f as usize] = amax[f as usize].max(m);
        }
    }
    let fmax = opts.format.max() as f64;
    // amax / max, rounded once to f32 (never 0: an all-zero group takes 1).
    let descale: Vec<f32> = amax
        .iter()
        .map(|&a| {
            if a > 0.0 {
                ((a / fmax) as f32).max(f32::MIN_POSITIVE)
            } else {
                1.0
            }
        })
        .collect();
    let mut bytes = crate::memory::try_filled("the quantised tensor", 0u8, rows * d)?;
    let format = opts.format;
    if d > 0 {
        bytes
            .par_chunks_mut(d)
            .zip(vals.par_chunks(d))
            .zip(factor_of_row.par_iter())
            .for_each(|((out, row), &f)| {
                let s = descale[f as usize] as f64;
                for (o, &x) in out.iter_mut().zip(row) {
                    *o = format.quantise(x / s);
                }
            });
    }
    let shape = if p.packed {
        vec![tokens.len(), heads, d]
    } else {
        vec![t.shape()[0], t.shape()[1], heads, d]
    };
    Ok(Quantized {
        format,
        bytes,
        shape,
        descale,
        granularity: opts.granularity,
        factor_of_row,
    })
}

/// `out.len()` elements of `data` from `at`, widened to f64.
fn load_row(data: Slice, at: usize, out: &mut [f64]) {
    let n = out.len();
    match data {
        Slice::F32(x) => out
            .iter_mut()
            .zip(&x[at..at + n])
            .for_each(|(o, v)| *o = *v as f64),
        Slice::F16(x) => out
            .iter_mut()
            .zip(&x[at..at + n])
            .for_each(|(o, v)| *o = v.to_f64()),
        Slice::BF16(x) => out
            .iter_mut()
            .zip(&x[at..at + n])
            .for_each(|(o, v)| *o = v.to_f64()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast transform against `H` built by Sylvester's recursion, entry by entry.
    #[test]
    fn fast_transform_is_the_hadamard_matrix() {
        for n in [1usize, 2, 4, 8, 64] {
            // H[i][j] = (-1)^popcount(i & j) in Sylvester's order.
            for i in 0..n {
                let mut e = vec![0.0; n];
                e[i] = 1.0;
                walsh_hadamard(&mut e);
                for (j, &x) in e.iter().enumerate() {
                    let want = if (i & j).count_ones() % 2 == 0 {
                        1.0
                    } else {
                        -1.0
                    };
                    assert_eq!(x, want, "n {n} row {i} col {j}");
                }
            }
        }
    }

    #[test]
    fn signs_are_seeded_and_mixed() {
        let a = Incoherent::new(128, 7).unwrap();
        let b = Incoherent::new(128, 7).unwrap();
        let c = Incoherent::new(128, 8).unwrap();
        assert_eq!(a.signs(), b.signs());
        assert_ne!(a.signs(), c.signs());
        let neg = a.signs().iter().filter(|&&s| s < 0.0).count();
        assert!((40..=88).contains(&neg), "{neg} of 128 signs negative");
        assert!(matches!(
            Incoherent::new(96, 1).unwrap_err().kind(),
            ErrorKind::IncoherentHeadDim { head_dim: 96 }
        ));
    }
}
