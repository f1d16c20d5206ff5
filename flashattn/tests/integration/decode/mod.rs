//! Decoding with a KV cache (`flash_attn_with_kvcache`) and the merge of partials.
//!
//! Each case builds a cache (contiguous, behind `cache_batch_idx`, with gaps between rows and
//! heads, or paged with a shuffled block table), runs one call, then checks:
//! - the cache afterwards: the appended keys equal the test's own f64 rotation of `k_new`
//!   (rounded to the dtype, within rounding), `v_new` is copied exactly, every other element is
//!   bit-identical to before (slots past a sequence's length hold NaN, so reading one would show);
//! - out and lse against `flashattn::reference` (f64) on the equivalent plain attention: per
//!   sequence, q rotated by the test at flash-attn's positions (`cache_seqlens[b] + i` when causal
//!   or windowed, `cache_seqlens[b]` otherwise) and rounded to q's dtype, and the keys it should see
//!   (cache prefix + appended rows, from `cache_leftpad[b]` on when given), with `common::check_bound`'s derived bound (2× the naive
//!   error in the same precision plus a rounding floor; NaN never passes).
//!
//! Then: several split counts and page sizes agree, bad input of every kind is a typed error that
//! leaves the caches bit-identical, and `merge_attn_partials` reproduces attention over shards.
//!
//! FP8 caches (`flashattn::fp8::flash_attn_with_kvcache_fp8`) run through the same checks: the
//! caches are quantised with descale factors per (sequence, kv head), appended keys must be the
//! nearest FP8 value of the rotated key over its factor and appended values exactly the rounded
//! value over its factor, and the reference reads the dequantised caches.

use crate::common;

use crate::common::*;
use flashattn::decode::SliceMut;
use flashattn::fp8::{
    flash_attn_with_kvcache_fp8, Descale, Fp8Element, Fp8Format, Fp8TensorMut, F8E4M3, F8E5M2,
};
use flashattn::naive::DotOrder;
use flashattn::reference::Reference;
use flashattn::simd::Isa;
use flashattn::{
    flash_attn, flash_attn_with_kvcache, merge_attn_partials, naive, reference, AttnOptions,
    AttnOutput, BlockTable, Buffer, DType, Error, ErrorKind, KvCacheOptions, Tensor, TensorMut,
    TensorRef,
};
use rand::seq::SliceRandom;
use rand::Rng;

/// Asserts that an error kind matches a pattern, printing the kind when it does not.
macro_rules! assert_kind {
    ($kind:expr, $pat:pat) => {{
        let e = $kind;
        assert!(matches!(e, $pat), "{e:?}");
    }};
}

mod check;
mod coverage;
#[cfg(feature = "cuda")]
mod emulated;
mod errors;
mod fp8;
#[cfg(feature = "cuda")]
mod gpu;
mod merge;
mod packed;
mod properties;
mod splits;

use check::check_case;
#[cfg(feature = "cuda")]
use check::{check_case_with, CallResult};

// ---------------------------------------------------------------------------------------------
// A decode case
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum Store {
    /// `[batch, cap, heads_kv, d]`, contiguous.
    Contiguous,
    /// `[batch + 2, cap, heads_kv, d]` behind a shuffled `cache_batch_idx`.
    BatchIdx,
    /// Contiguous shape, with gaps (NaN) between heads, rows and batch rows.
    Gaps,
    /// `[num_blocks, page_size, heads_kv, d]` with a shuffled block table; unused entries -1.
    Paged(usize),
}

#[derive(Clone, Debug)]
struct DCase {
    dtype: DType,
    seqlen_q: usize,
    heads: usize,
    heads_kv: usize,
    d: usize,
    /// Capacity per sequence (seqlen_cache, or pages · page_size rounded up).
    cap: usize,
    /// cache_seqlens, one per batch row.
    lens: Vec<usize>,
    /// cache_leftpad, one per batch row; `None`: not passed.
    leftpad: Option<Vec<usize>>,
    /// seqlen_new; `None`: no new keys.
    new: Option<usize>,
    causal: bool,
    window: (i64, i64),
    softcap: Option<f32>,
    alibi: bool,
    /// Learnable sinks, one per query head (`Built::sinks`).
    sink: bool,
    /// (rotary_dim, interleaved).
    rotary: Option<(usize, bool)>,
    store: Store,
    splits: Option<usize>,
    isa: Option<Isa>,
    dist: Dist,
    seed: u64,
    /// FP8 caches of this format (`flash_attn_with_kvcache_fp8`), with descale factors per
    /// (sequence, kv head); q, the new keys and out stay in `dtype`.
    fp8: Option<Fp8Format>,
}

impl Default for DCase {
    fn default() -> Self {
        DCase {
            dtype: DType::F32,
            seqlen_q: 1,
            heads: 4,
            heads_kv: 2,
            d: 16,
            cap: 80,
            lens: vec![50],
            leftpad: None,
            new: Some(1),
            causal: true,
            window: (-1, -1),
            softcap: None,
            alibi: false,
            sink: false,
            rotary: None,
            store: Store::Contiguous,
            splits: None,
            isa: None,
            dist: Dist::Uniform,
            seed: 0,
            fp8: None,
        }
    }
}

impl DCase {
    /// A case of `sq` new tokens per sequence (appended, then attended) on one ISA: `shape` is
    /// (heads, heads_kv, sq, d); `lens` the cache_seqlens, `cap` the cache's capacity.
    fn steps(
        (dtype, isa): (DType, Isa),
        (heads, heads_kv, sq, d): (usize, usize, usize, usize),
        (lens, cap): (&[usize], usize),
        seed: u64,
    ) -> Self {
        DCase {
            dtype,
            isa: Some(isa),
            d,
            heads,
            heads_kv,
            lens: lens.to_vec(),
            new: Some(sq),
            seqlen_q: sq,
            cap,
            seed,
            ..DCase::default()
        }
    }

    fn batch(&self) -> usize {
        self.lens.len()
    }
    fn seqlen_new(&self) -> usize {
        self.new.unwrap_or(0)
    }
    fn seqlen_k(&self, b: usize) -> usize {
        self.lens[b] + self.seqlen_new()
    }
    /// The first key sequence b attends.
    fn first_key(&self, b: usize) -> usize {
        self.leftpad.as_ref().map_or(0, |lp| lp[b])
    }
}

/// Physical placement of the caches: element offset of (b, j, hk, 0) per the store.
struct CacheMap {
    shape: Vec<usize>,
    strides: Vec<usize>,
    len: usize,
    /// Page (or cache row) of (b, block).
    table: Vec<i32>,
    max_blocks: usize,
    page_size: usize,
    batch_idx: Option<Vec<i32>>,
}

impl CacheMap {
    fn offset(&self, b: usize, j: usize, hk: usize) -> usize {
        let page = self.table[b * self.max_blocks + j / self.page_size] as usize;
        page * self.strides[0] + (j % self.page_size) * self.strides[1] + hk * self.strides[2]
    }
}

fn cache_map(c: &DCase, rng: &mut rand_chacha::ChaCha8Rng) -> CacheMap {
    let (batch, hkv, d, cap) = (c.batch(), c.heads_kv, c.d, c.cap);
    match c.store {
        Store::Contiguous | Store::Gaps | Store::BatchIdx => {
            let rows = batch + if c.store == Store::BatchIdx { 2 } else { 0 };
            let shape = vec![rows, cap, hkv, d];
            let strides = if c.store == Store::Gaps {
                let head = d + 3;
                let row = hkv * head + 5;
                vec![cap * row + 7, row, head, 1]
            } else {
                flashattn::tensor::contiguous_strides(&shape)
            };
            let mut perm: Vec<i32> = (0..rows as i32).collect();
            if c.store == Store::BatchIdx {
                perm.shuffle(rng);
            }
            let table = perm[..batch].to_vec();
            CacheMap {
                len: rows * strides[0] + 11,
                shape,
                strides,
                batch_idx: (c.store == Store::BatchIdx).then(|| table.clone()),
                table,
                max_blocks: 1,
                page_size: cap,
            }
        }
        Store::Paged(ps) => {
            let max_blocks = cap.div_ceil(ps);
            let n_blocks = batch * max_blocks + 3;
            let mut pages: Vec<i32> = (0..n_blocks as i32).collect();
            pages.shuffle(rng);
            let mut table = vec![-1; batch * max_blocks];
            let mut next = 0;
            for b in 0..batch {
                // Only the blocks the call uses get pages; the rest stay -1 (never read).
                for blk in 0..c.seqlen_k(b).div_ceil(ps) {
                    table[b * max_blocks + blk] = pages[next];
                    next += 1;
                }
            }
            let shape = vec![n_blocks, ps, hkv, d];
            let strides = flashattn::tensor::contiguous_strides(&shape);
            CacheMap {
                len: n_blocks * strides[0],
                shape,
                strides,
                table,
                max_blocks,
                page_size: ps,
                batch_idx: None,
            }
        }
    }
}

/// cos/sin tables `[seqlen_ro, rot / 2]` (f32) of the usual θ_i = 10000^(-2i/rot).
fn rotary_tables(rot: usize, seqlen_ro: usize) -> (Vec<f32>, Vec<f32>) {
    let half = rot / 2;
    let mut cos = Vec::with_capacity(seqlen_ro * half);
    let mut sin = Vec::with_capacity(seqlen_ro * half);
    for pos in 0..seqlen_ro {
        for i in 0..half {
            let theta = 10000f64.powf(-2.0 * i as f64 / rot as f64);
            cos.push((pos as f64 * theta).cos() as f32);
            sin.push((pos as f64 * theta).sin() as f32);
        }
    }
    (cos, sin)
}

/// The test's own rotary embedding, in f64: rotates `x` (one head row) at table row `pos`.
fn rotate_f64(x: &mut [f64], cos: &[f32], sin: &[f32], half: usize, pos: usize, inter: bool) {
    for i in 0..half {
        let (c, s) = (cos[pos * half + i] as f64, sin[pos * half + i] as f64);
        let (a, b) = if inter {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + half)
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * c - x1 * s;
        x[b] = x0 * s + x1 * c;
    }
}

fn slice_mut(b: &mut Buffer) -> SliceMut<'_> {
    match b {
        Buffer::F32(d) => SliceMut::F32(d),
        Buffer::F16(d) => SliceMut::F16(d),
        Buffer::BF16(d) => SliceMut::BF16(d),
    }
}

/// A contiguous view of a whole buffer.
fn view_of<'a>(buf: &'a Buffer, shape: &[usize]) -> TensorRef<'a> {
    TensorRef::from_slice(
        buf.as_slice(),
        shape,
        &flashattn::tensor::contiguous_strides(shape),
    )
}

fn buf_f64(b: &Buffer) -> Vec<f64> {
    Tensor::from_buffer(b.clone(), &[b.as_slice().len()])
        .unwrap()
        .to_f64_vec()
}

fn buf_bits(b: &Buffer) -> Vec<u32> {
    bits(&Tensor::from_buffer(b.clone(), &[b.as_slice().len()]).unwrap())
}

/// `b` with its NaN elements (the poison of unused cache slots) replaced by 0.5.
fn without_nan(b: &Buffer) -> Buffer {
    fn fill<T: Copy>(v: &[T], is_nan: impl Fn(T) -> bool, x: T) -> Vec<T> {
        v.iter().map(|&y| if is_nan(y) { x } else { y }).collect()
    }
    match b {
        Buffer::F32(v) => Buffer::F32(fill(v, f32::is_nan, 0.5)),
        Buffer::F16(v) => Buffer::F16(fill(v, |y| y.is_nan(), half::f16::from_f32(0.5))),
        Buffer::BF16(v) => Buffer::BF16(fill(v, |y| y.is_nan(), half::bf16::from_f32(0.5))),
    }
}

/// Everything a case needs to call the library, built once.
struct Built {
    qb: Buffer,
    k_cache: Buffer,
    v_cache: Buffer,
    k_new: Option<(Vec<f64>, Buffer)>,
    v_new: Option<(Vec<f64>, Buffer)>,
    map: CacheMap,
    alibi: Vec<f32>,
    /// Learnable sinks `[heads]` in [-3, 6) (from their own generator: the other draws stay
    /// as they were).
    sinks: Vec<f32>,
    cos_sin: Option<(Vec<f32>, Vec<f32>)>,
    seqlen_ro: usize,
    leftpad: Option<Vec<i32>>,
    /// FP8 cases: the caches' bytes (`k_cache`/`v_cache` then hold their raw values, without
    /// the descale, as f32) and the descale factors per (sequence, kv head).
    fp8: Option<Fp8Caches>,
}

struct Fp8Caches {
    format: Fp8Format,
    k: Vec<u8>,
    v: Vec<u8>,
    k_descale: Vec<f32>,
    v_descale: Vec<f32>,
}

/// The raw values of FP8 bytes, as f32 (exact).
fn fp8_values(bytes: &[u8], format: Fp8Format) -> Buffer {
    Buffer::F32(
        bytes
            .iter()
            .map(|&b| match format {
                Fp8Format::E4M3 => F8E4M3::from_bits(b).to_f32(),
                Fp8Format::E5M2 => F8E5M2::from_bits(b).to_f32(),
            })
            .collect(),
    )
}

/// An FP8 type's conversions from and to its bits.
type BitsOf<E> = (fn(u8) -> E, fn(E) -> u8);

/// A call on FP8 caches given as bytes of `format`; the bytes are updated in place.
fn call_fp8(
    q: &TensorRef,
    (k, v): (&mut [u8], &mut [u8]),
    (format, map): (Fp8Format, &CacheMap),
    lens: &[i32],
    descale: &Descale,
    opts: &KvCacheOptions,
) -> flashattn::Result<AttnOutput> {
    fn typed<E: Fp8Element>(
        q: &TensorRef,
        (k, v): (&mut [u8], &mut [u8]),
        map: &CacheMap,
        lens: &[i32],
        descale: &Descale,
        opts: &KvCacheOptions,
        (from, to): BitsOf<E>,
    ) -> flashattn::Result<AttnOutput> {
        let mut kt: Vec<E> = k.iter().map(|&b| from(b)).collect();
        let mut vt: Vec<E> = v.iter().map(|&b| from(b)).collect();
        let res = flash_attn_with_kvcache_fp8(
            q,
            &mut Fp8TensorMut::new(&mut kt, &map.shape, &map.strides),
            &mut Fp8TensorMut::new(&mut vt, &map.shape, &map.strides),
            lens,
            &opts.clone().descale(*descale),
        );
        k.iter_mut().zip(&kt).for_each(|(o, &x)| *o = to(x));
        v.iter_mut().zip(&vt).for_each(|(o, &x)| *o = to(x));
        res
    }
    match format {
        Fp8Format::E4M3 => typed(
            q,
            (k, v),
            map,
            lens,
            descale,
            opts,
            (F8E4M3::from_bits, |x| x.to_bits()),
        ),
        Fp8Format::E5M2 => typed(
            q,
            (k, v),
            map,
            lens,
            descale,
            opts,
            (F8E5M2::from_bits, |x| x.to_bits()),
        ),
    }
}

fn build(c: &DCase) -> Built {
    let mut rng = rng(c.seed);
    let (batch, sq, h, hkv, d) = (c.batch(), c.seqlen_q, c.heads, c.heads_kv, c.d);
    // The layout draws from its own generator, so every store holds the same logical values.
    let map = cache_map(c, &mut common::rng(c.seed ^ 0x5eed_5eed));
    // Dist::Huge: q, k entries U(-1, 1)·s give scaled scores (default scale) of std s²/3.
    let scale_qk = match c.dist {
        Dist::Huge(target) => (3.0 * target).sqrt(),
        _ => 1.0,
    };
    let mut q = values(&mut rng, batch * sq * h * d, c.dist);
    q.iter_mut().for_each(|x| *x *= scale_qk);
    // Caches: NaN everywhere (gaps, unused slots and pages), random where a sequence has tokens.
    let mut kc = vec![f64::NAN; map.len];
    let mut vc = vec![f64::NAN; map.len];
    for b in 0..batch {
        for j in 0..c.lens[b] {
            for hk in 0..hkv {
                let o = map.offset(b, j, hk);
                for x in 0..d {
                    kc[o + x] = sample(&mut rng, c.dist) * scale_qk;
                    vc[o + x] = sample(&mut rng, Dist::Uniform);
                }
            }
        }
    }
    let new = |rng: &mut rand_chacha::ChaCha8Rng, s: f64, dist: Dist| {
        c.new.map(|n| {
            let mut vals = values(rng, batch * n * hkv * d, dist);
            vals.iter_mut().for_each(|x| *x *= s);
            let buf = to_buffer(&vals, c.dtype);
            (vals, buf)
        })
    };
    let k_new = new(&mut rng, scale_qk, c.dist);
    let v_new = new(&mut rng, 1.0, Dist::Uniform);
    // FP8: factors from an amax drawn per (sequence, kv head) around the values' range (never a
    // power of two; the new keys may exceed it and saturate), the caches quantised with them
    // (NaN stays NaN).
    let fp8 = c.fp8.map(|format| {
        let fmax = format.max() as f64;
        let mut g = common::rng(c.seed ^ 0xf8f8);
        let mut draw = |base: f64| -> Vec<f32> {
            (0..batch * hkv)
                .map(|_| (base * g.gen_range(0.55..1.9) / fmax) as f32)
                .collect()
        };
        let (k_descale, v_descale) = (draw(scale_qk), draw(1.0));
        let (mut k, mut v) = (vec![0u8; map.len], vec![0u8; map.len]);
        for i in 0..map.len {
            k[i] = format.quantise(kc[i]);
            v[i] = format.quantise(vc[i]);
        }
        for b in 0..batch {
            for j in 0..c.lens[b] {
                for hk in 0..hkv {
                    let o = map.offset(b, j, hk);
                    for x in o..o + d {
                        k[x] = format.quantise(kc[x] / k_descale[b * hkv + hk] as f64);
                        v[x] = format.quantise(vc[x] / v_descale[b * hkv + hk] as f64);
                    }
                }
            }
        }
        Fp8Caches {
            format,
            k,
            v,
            k_descale,
            v_descale,
        }
    });
    let (k_cache, v_cache) = match &fp8 {
        Some(f) => (fp8_values(&f.k, f.format), fp8_values(&f.v, f.format)),
        None => (to_buffer(&kc, c.dtype), to_buffer(&vc, c.dtype)),
    };
    let alibi = (0..batch * h)
        .map(|_| rng.gen_range(0.01f32..0.5))
        .collect();
    let seqlen_ro = c.cap + sq + 3;
    let mut sink_rng = common::rng(c.seed ^ 0x51c5);
    let sinks = (0..h).map(|_| sink_rng.gen_range(-3.0f32..6.0)).collect();
    Built {
        qb: to_buffer(&q, c.dtype),
        k_cache,
        v_cache,
        k_new,
        v_new,
        map,
        alibi,
        sinks,
        cos_sin: c.rotary.map(|(rot, _)| rotary_tables(rot, seqlen_ro)),
        seqlen_ro,
        leftpad: c
            .leftpad
            .as_ref()
            .map(|lp| lp.iter().map(|&x| x as i32).collect()),
        fp8,
    }
}

impl Built {
    fn attn_opts(&self, c: &DCase) -> AttnOptions<'_> {
        let mut o = AttnOptions::default()
            .causal(c.causal)
            .window(c.window.0, c.window.1);
        o.softcap = c.softcap;
        if c.alibi {
            o = o.alibi_slopes(TensorRef::contiguous(&self.alibi, &[c.batch(), c.heads]));
        }
        if c.sink {
            o = o.learnable_sink(TensorRef::contiguous(&self.sinks, &[c.heads]));
        }
        o
    }

    fn opts(&self, c: &DCase) -> KvCacheOptions<'_> {
        let (batch, hkv, d) = (c.batch(), c.heads_kv, c.d);
        let mut o = KvCacheOptions::default().attn(self.attn_opts(c));
        if let (Some((_, kb)), Some((_, vb))) = (&self.k_new, &self.v_new) {
            let shape = [batch, c.seqlen_new(), hkv, d];
            o = o.new_kv(
                TensorRef::from_slice(
                    kb.as_slice(),
                    &shape,
                    &flashattn::tensor::contiguous_strides(&shape),
                ),
                TensorRef::from_slice(
                    vb.as_slice(),
                    &shape,
                    &flashattn::tensor::contiguous_strides(&shape),
                ),
            );
        }
        if let Some(idx) = &self.map.batch_idx {
            o = o.cache_batch_idx(idx);
        }
        if let Store::Paged(_) = c.store {
            o = o.block_table(BlockTable::new(&self.map.table, batch, self.map.max_blocks));
        }
        if let Some(lp) = &self.leftpad {
            o = o.cache_leftpad(lp);
        }
        if let (Some((cos, sin)), Some((rot, inter))) = (&self.cos_sin, c.rotary) {
            let shape = [self.seqlen_ro, rot / 2];
            o = o.rotary(
                TensorRef::contiguous(cos, &shape),
                TensorRef::contiguous(sin, &shape),
                inter,
            );
        }
        if let Some(n) = c.splits {
            o = o.num_splits(n);
        }
        if let Some(isa) = c.isa {
            o = o.isa(isa);
        }
        o
    }

    fn q_view(&self, c: &DCase) -> TensorRef<'_> {
        let shape = [c.batch(), c.seqlen_q, c.heads, c.d];
        TensorRef::from_slice(
            self.qb.as_slice(),
            &shape,
            &flashattn::tensor::contiguous_strides(&shape),
        )
    }

    /// The descale factors of an FP8 case (per (sequence, kv head)), or 1.
    fn descale(&self, b: usize, hk: usize, c: &DCase) -> (f64, f64) {
        self.fp8.as_ref().map_or((1.0, 1.0), |f| {
            let i = b * c.heads_kv + hk;
            (f.k_descale[i] as f64, f.v_descale[i] as f64)
        })
    }

    /// One call on copies of the caches; returns the result and the caches afterwards (FP8
    /// caches as their raw values).
    fn call(&self, c: &DCase) -> (flashattn::Result<AttnOutput>, Buffer, Buffer) {
        if let Some(f) = &self.fp8 {
            let (mut k, mut v) = (f.k.clone(), f.v.clone());
            let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
            let descale = Descale::default().k(&f.k_descale).v(&f.v_descale);
            let res = call_fp8(
                &self.q_view(c),
                (&mut k, &mut v),
                (f.format, &self.map),
                &lens,
                &descale,
                &self.opts(c),
            );
            return (res, fp8_values(&k, f.format), fp8_values(&v, f.format));
        }
        let (mut kc, mut vc) = (self.k_cache.clone(), self.v_cache.clone());
        let res = {
            let mut k = TensorMut::new(slice_mut(&mut kc), &self.map.shape, &self.map.strides);
            let mut v = TensorMut::new(slice_mut(&mut vc), &self.map.shape, &self.map.strides);
            let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
            flash_attn_with_kvcache(&self.q_view(c), &mut k, &mut v, &lens, &self.opts(c))
        };
        (res, kc, vc)
    }
}

/// The masks the option grids run: (causal, window).
const MASKS: [(bool, (i64, i64)); 6] = [
    (false, (-1, -1)),
    (true, (-1, -1)),
    (false, (17, -1)),
    (true, (40, -1)),
    (false, (5, 2)),
    (false, (0, 0)),
];

/// `cu_seqlens_q` (packed queries of different lengths per sequence, as chunked prefill mixed
/// with decoding): every sequence's rows equal, bit for bit, a call with that sequence alone (same
/// cache, split count and options; such calls are checked against the oracle above), rows after
/// the last sequence are 0 with lse -inf, and f32 rows match the f64 oracle. Every dtype, masks,
/// ALiBi, GQA, left pads, contiguous, mapped and paged caches, 1 and 3 splits, a sequence with no
/// query and one with no key.
/// The packed-call tests' case: six sequences (one with an empty cache), mask set `mi` (0-3) with
/// its head dim and cache store; `n` alternates ALiBi and the split count.
fn packed_case(dtype: DType, mi: usize, n: usize, seed: u64) -> DCase {
    let (causal, window) = [MASKS[1], MASKS[0], MASKS[4], MASKS[3]][mi];
    DCase {
        dtype,
        heads: 6,
        heads_kv: 2,
        d: [16, 40, 64, 59][mi],
        cap: 72,
        lens: vec![20, 9, 0, 50, 6, 33],
        leftpad: (mi == 2).then(|| vec![0, 4, 0, 17, 6, 1]),
        new: None,
        causal,
        window,
        alibi: n.is_multiple_of(2),
        store: [
            Store::Contiguous,
            Store::Paged(8),
            Store::BatchIdx,
            Store::Gaps,
        ][mi],
        splits: Some([1, 3][n % 2]),
        sink: n % 3 != 1,
        seed,
        ..DCase::default()
    }
}

/// The index arrays of sequence b's call alone: its cache row, its leftpad.
struct Alone {
    row: [i32; 1],
    leftpad: Option<[i32; 1]>,
}

impl Alone {
    fn new(c: &DCase, bl: &Built, b: usize) -> Self {
        Alone {
            row: [bl.map.table[b * bl.map.max_blocks]],
            leftpad: c.leftpad.as_ref().map(|lp| [lp[b] as i32]),
        }
    }

    /// The options of sequence b alone, as a batch of one: its cache row or its row of the
    /// block table, its ALiBi slopes and leftpad, the case's mask and split count.
    fn opts<'a>(&'a self, c: &DCase, bl: &'a Built, b: usize) -> KvCacheOptions<'a> {
        let h = c.heads;
        let mut attn = bl.attn_opts(c);
        if c.alibi {
            let slopes = &bl.alibi[b * h..(b + 1) * h];
            attn = attn.alibi_slopes(TensorRef::contiguous(slopes, &[1, h]));
        }
        let mut o = KvCacheOptions::default()
            .attn(attn)
            .num_splits(c.splits.unwrap());
        o = match c.store {
            Store::Paged(_) => {
                let table = &bl.map.table[b * bl.map.max_blocks..(b + 1) * bl.map.max_blocks];
                o.block_table(BlockTable::new(table, 1, bl.map.max_blocks))
            }
            _ => o.cache_batch_idx(&self.row),
        };
        if let Some(lp) = &self.leftpad {
            o = o.cache_leftpad(lp);
        }
        o
    }
}

/// Asserts that `sq` query rows of a call's result (out rows from `r0`, LSEs where `lse_at(h,
/// i)` says) are those of sequence b's own call `alone`, bit for bit.
fn assert_rows_match(
    what: &str,
    (out, r0, lse_at): (&AttnOutput, usize, &dyn Fn(usize, usize) -> f64),
    alone: &AttnOutput,
    (sq, h, d): (usize, usize, usize),
) {
    assert_eq!(
        buf_bits(out.out.buffer())[r0 * h * d..(r0 + sq) * h * d],
        buf_bits(alone.out.buffer())[..],
        "{what}: out"
    );
    let al = alone.lse.to_f64_vec();
    for hh in 0..h {
        for i in 0..sq {
            let (x, y) = (lse_at(hh, i), al[hh * sq + i]);
            assert!(x.to_bits() == y.to_bits(), "{what}: lse {x} against {y}");
        }
    }
}

/// `[0, l0, l0 + l1, ..]` as i32.
fn cumulative(lens: &[usize]) -> Vec<i32> {
    let mut cu = vec![0i32];
    for &l in lens {
        cu.push(cu.last().unwrap() + l as i32);
    }
    cu
}

/// Max |a - b| within rounding: 8 units of the dtype's roundoff of the larger magnitude, and
/// lse within 1e-4 (f32 accumulations in a different order).
fn close(a: &AttnOutput, b: &AttnOutput, dtype: DType, what: &str) {
    let (ao, bo) = (a.out.to_f64_vec(), b.out.to_f64_vec());
    let scale = ao.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    let tol = 8.0 * dtype.epsilon().max(DType::F32.epsilon() * 64.0) * scale;
    for (i, (x, y)) in ao.iter().zip(&bo).enumerate() {
        assert!(
            (x - y).abs() <= tol,
            "{what}: out[{i}] {x} vs {y} (tol {tol:e})"
        );
    }
    for (i, (x, y)) in a
        .lse
        .to_f64_vec()
        .iter()
        .zip(b.lse.to_f64_vec())
        .enumerate()
    {
        assert!(
            x == &y || (x - y).abs() <= 1e-4 * (1.0 + x.abs()),
            "{what}: lse[{i}] {x} vs {y}"
        );
    }
}

/// The cases of [`empty_split_at_a_full_cache`] (also run on the CUDA kernels under emulation).
fn empty_split_cases(dtype: DType) -> Vec<DCase> {
    [
        (Store::Contiguous, 1, vec![0], 2),
        (Store::Paged(1), 2, vec![1], 3),
        (Store::Paged(3), 6, vec![0, 5, 3], 8),
        (Store::BatchIdx, 4, vec![2, 3], 5),
    ]
    .into_iter()
    .map(|(store, cap, lens, splits)| DCase {
        dtype,
        store,
        cap,
        lens,
        new: Some(1),
        splits: Some(splits),
        ..DCase::default()
    })
    .collect()
}
