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

mod common;

use common::*;
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

/// Asserts that an error kind matches a pattern, printing the kind when it does not.
macro_rules! assert_kind {
    ($kind:expr, $pat:pat) => {{
        let e = $kind;
        assert!(matches!(e, $pat), "{e:?}");
    }};
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
            descale,
            opts,
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

/// Runs a case and checks the caches and the result; returns the result.
fn check_case(c: &DCase) -> AttnOutput {
    check_case_with(c, |bl, c| bl.call(c))
}

/// What runs a call: the result and the caches afterwards.
type CallResult = (flashattn::Result<AttnOutput>, Buffer, Buffer);

/// [`check_case`] with the call made by `call` (the CPU path, or the CUDA kernels under host
/// emulation).
fn check_case_with(c: &DCase, mut call: impl FnMut(&Built, &DCase) -> CallResult) -> AttnOutput {
    let bl = build(c);
    let (res, kc_after, vc_after) = call(&bl, c);
    let flash = res.unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let (batch, sq, h, hkv, d) = (c.batch(), c.seqlen_q, c.heads, c.heads_kv, c.d);
    let eps = c.dtype.epsilon();

    // The caches afterwards.
    let (k_before, v_before) = (buf_bits(&bl.k_cache), buf_bits(&bl.v_cache));
    let (k_bits, v_bits) = (buf_bits(&kc_after), buf_bits(&vc_after));
    let (k_after, v_after) = (buf_f64(&kc_after), buf_f64(&vc_after));
    let mut written = vec![false; bl.map.len];
    let half = c.rotary.map_or(0, |r| r.0 / 2);
    let (k_new, v_new) = match (&bl.k_new, &bl.v_new) {
        (Some(k), Some(v)) => (buf_f64(&k.1), buf_f64(&v.1)),
        _ => (Vec::new(), Vec::new()),
    };
    for b in 0..batch {
        for t in 0..c.seqlen_new() {
            let pos = c.lens[b] + t;
            for hk in 0..hkv {
                let o = bl.map.offset(b, pos, hk);
                let src = ((b * c.seqlen_new() + t) * hkv + hk) * d;
                let (dk, dv) = bl.descale(b, hk, c);
                // k_new as stored (rounded to the dtype), rotated here in f64.
                let orig = k_new[src..src + d].to_vec();
                let mut want = orig.clone();
                if let (Some((cos, sin)), Some((_, inter))) = (&bl.cos_sin, c.rotary) {
                    rotate_f64(&mut want, cos, sin, half, pos, inter);
                }
                for x in 0..d {
                    written[o + x] = true;
                    if let Some(f) = &bl.fp8 {
                        // Rounded once to FP8 from want / k_descale (the kernel rotates in f32,
                        // so a value within ~1e-7 of a midpoint may go either way).
                        let (w, got) = (want[x] / dk, k_after[o + x]);
                        let best = buf_f64(&fp8_values(&[f.format.quantise(w)], f.format))[0];
                        assert!(
                            got == best || ((got - w).abs() - (best - w).abs()).abs() <= 1e-6 * w.abs(),
                            "{c:?}: k_cache (b {b}, pos {pos}, hk {hk}, {x}) = {got}, want {best} ({w})"
                        );
                        let vq = f.format.quantise(v_new[src + x] / dv);
                        assert_eq!(
                            v_after[o + x].to_bits(),
                            buf_f64(&fp8_values(&[vq], f.format))[0].to_bits(),
                            "{c:?}: v_cache (b {b}, pos {pos}, hk {hk}, {x})"
                        );
                        continue;
                    }
                    let pair = if half == 0 || x >= 2 * half {
                        orig[x].abs()
                    } else {
                        orig.iter().take(2 * half).fold(0f64, |m, y| m.max(y.abs()))
                    };
                    let tol = 4.0 * eps * pair * 2.0;
                    assert!(
                        (k_after[o + x] - want[x]).abs() <= tol,
                        "{c:?}: k_cache (b {b}, pos {pos}, hk {hk}, {x}) = {}, want {} (tol {tol:e})",
                        k_after[o + x],
                        want[x]
                    );
                    assert_eq!(
                        v_after[o + x],
                        v_new[src + x],
                        "{c:?}: v_cache (b {b}, pos {pos})"
                    );
                }
            }
        }
    }
    for i in 0..bl.map.len {
        if !written[i] {
            assert_eq!(k_bits[i], k_before[i], "{c:?}: k_cache[{i}] changed");
            assert_eq!(v_bits[i], v_before[i], "{c:?}: v_cache[{i}] changed");
        }
    }

    // The equivalent plain attention, per sequence.
    let half = c.rotary.map_or(0, |r| r.0 / 2);
    let mut ref_out = vec![0f64; batch * sq * h * d];
    let mut ref_lse = vec![0f64; batch * h * sq];
    let mut naive_out = [
        vec![0f64; batch * sq * h * d],
        vec![0f64; batch * sq * h * d],
    ];
    let mut naive_lse = [vec![0f64; batch * h * sq], vec![0f64; batch * h * sq]];
    let mut v_max = 0f64;
    let mut max_keys = 0;
    let q_stored = buf_f64(&bl.qb);
    for b in 0..batch {
        // cache_leftpad: the keys before c.first_key(b) do not exist for the oracle, which
        // aligns its masks to the sk keys that remain.
        let (lp, sk) = (c.first_key(b), c.seqlen_k(b) - c.first_key(b));
        max_keys = max_keys.max(sk);
        let mut qb = q_stored[b * sq * h * d..(b + 1) * sq * h * d].to_vec();
        if let (Some((cos, sin)), Some((_, inter))) = (&bl.cos_sin, c.rotary) {
            for i in 0..sq {
                for hh in 0..h {
                    let o = (i * h + hh) * d;
                    // flash-attn's rule: query i at cache_seqlens[b] + i under a causal or
                    // windowed mask, every query at cache_seqlens[b] without one.
                    let masked = c.causal || c.window != (-1, -1);
                    let pos = c.lens[b] + if masked { i } else { 0 };
                    rotate_f64(&mut qb[o..o + d], cos, sin, half, pos, inter);
                }
            }
            // The rotated q in q's dtype, rounded once from f64: flash-attn's contract (its
            // rotary embedding hands q over in its dtype), which flashattn follows on every
            // instruction set. With logits of ~30 the unrounded q moved the oracle 0.05 away
            // from a bf16 result that rounds it (a property-test draw, seed 23, 10000 cases).
            qb = buf_f64(&to_buffer(&qb, c.dtype));
        }
        let mut kb = Vec::with_capacity(sk * hkv * d);
        let mut vb = Vec::with_capacity(sk * hkv * d);
        for j in lp..lp + sk {
            for hk in 0..hkv {
                let o = bl.map.offset(b, j, hk);
                // FP8: the raw values times their factors (exact in f64).
                let (dk, dv) = bl.descale(b, hk, c);
                kb.extend(k_after[o..o + d].iter().map(|&x| x * dk));
                vb.extend(v_after[o..o + d].iter().map(|&x| x * dv));
            }
        }
        v_max = vb.iter().fold(v_max, |m, x| m.max(x.abs()));
        let (qs, ks) = ([1, sq, h, d], [1, sk, hkv, d]);
        let slopes = &bl.alibi[b * h..(b + 1) * h];
        let mut o = AttnOptions::default()
            .causal(c.causal)
            .window(c.window.0, c.window.1);
        o.softcap = c.softcap;
        if c.alibi {
            o = o.alibi_slopes(TensorRef::contiguous(slopes, &[h]));
        }
        if c.sink {
            o = o.learnable_sink(TensorRef::contiguous(&bl.sinks, &[h]));
        }
        // The oracle sees exact values: the rotated q and FP8 values times their factors in
        // f64 (rounded to f32 they would carry an error as large as f32 attention's own); naive
        // sees them rounded to the dtype, as a framework would.
        let r = reference::attention_f64((&qb, &qs), (&kb, &ks), (&vb, &ks), &o)
            .unwrap_or_else(|e| panic!("{c:?}: reference: {e}"));
        let (qn, kn, vn) = (
            to_buffer(&qb, c.dtype),
            to_buffer(&kb, c.dtype),
            to_buffer(&vb, c.dtype),
        );

        for (n, order) in [DotOrder::Lanes8, DotOrder::Sequential]
            .into_iter()
            .enumerate()
        {
            let nv = naive::attention_with_order(
                &view_of(&qn, &qs),
                &view_of(&kn, &ks),
                &view_of(&vn, &ks),
                &o,
                order,
            )
            .unwrap();
            naive_out[n][b * sq * h * d..(b + 1) * sq * h * d]
                .copy_from_slice(&nv.out.to_f64_vec());
            naive_lse[n][b * h * sq..(b + 1) * h * sq].copy_from_slice(&nv.lse.to_f64_vec());
        }
        ref_out[b * sq * h * d..(b + 1) * sq * h * d].copy_from_slice(&r.out);
        ref_lse[b * h * sq..(b + 1) * h * sq].copy_from_slice(&r.lse);
    }
    let out_shape = vec![batch, sq, h, d];
    let lse_shape = vec![batch, h, sq];
    let r = Reference {
        out: ref_out,
        lse: ref_lse,
        out_shape: out_shape.clone(),
        lse_shape: lse_shape.clone(),
    };
    let naives: Vec<AttnOutput> = (0..2)
        .map(|n| AttnOutput {
            out: Tensor::from_buffer(to_buffer(&naive_out[n], c.dtype), &out_shape).unwrap(),
            lse: Tensor::from_buffer(
                Buffer::F32(naive_lse[n].iter().map(|&x| x as f32).collect()),
                &lse_shape,
            )
            .unwrap(),
        })
        .collect();
    check_bound(
        &format!("{c:?}"),
        c.dtype,
        &flash,
        &naives,
        &r,
        v_max,
        max_keys,
    );
    flash
}

// ---------------------------------------------------------------------------------------------
// Coverage
// ---------------------------------------------------------------------------------------------

/// The masks the option grids run: (causal, window).
const MASKS: [(bool, (i64, i64)); 6] = [
    (false, (-1, -1)),
    (true, (-1, -1)),
    (false, (17, -1)),
    (true, (40, -1)),
    (false, (5, 2)),
    (false, (0, 0)),
];

/// Every dtype × masks, softcap, ALiBi, GQA ratios, seqlen_q 1 and > 1, appends or none.
#[test]
fn options_against_reference() {
    let masks = MASKS;
    let heads = [(1, 1), (4, 1), (6, 2), (8, 8), (32, 8)];
    let mut n = 0;
    for dtype in DTYPES {
        for (mi, &(causal, window)) in masks.iter().enumerate() {
            for (hi, &(h, hkv)) in heads.iter().enumerate() {
                n += 1;
                let c = DCase {
                    dtype,
                    seqlen_q: [1, 1, 3, 2, 4][(mi + hi) % 5],
                    heads: h,
                    heads_kv: hkv,
                    d: [16, 40, 64, 59, 128][(mi + 2 * hi) % 5],
                    cap: 240,
                    lens: [vec![203], vec![63, 113], vec![1, 0, 150]][(mi + hi) % 3].clone(),
                    new: [Some(4), None, Some(1), Some(2)][(mi + hi) % 4],
                    causal,
                    window,
                    softcap: [None, Some(30.0), Some(2.5)][(n) % 3],
                    alibi: n % 2 == 0,
                    seed: n as u64,
                    ..DCase::default()
                };
                let c = DCase {
                    seqlen_q: if c.new.is_some() {
                        c.seqlen_q.min(c.seqlen_new())
                    } else {
                        c.seqlen_q
                    },
                    ..c
                };
                check_case(&c);
            }
        }
    }
}

/// `cache_leftpad` (flash-attn's): keys before `cache_leftpad[b]` are hidden and the masks and
/// ALiBi count from there; against the oracle over the remaining keys in every dtype, with the
/// masks, ALiBi, softcap, rotary, GQA, contiguous, mapped and paged caches, 1 and 3 splits, and
/// pads of 0, inside the cache, at its end (only the appended keys remain) and, with nothing
/// appended, over the whole cache (no key: out 0, lse -inf).
#[test]
fn leftpad_hides_the_first_keys() {
    let masks = [MASKS[0], MASKS[1], MASKS[2], MASKS[4]];
    let stores = [
        Store::Contiguous,
        Store::Paged(7),
        Store::BatchIdx,
        Store::Gaps,
    ];
    let mut n = 0;
    for dtype in DTYPES {
        for (mi, &(causal, window)) in masks.iter().enumerate() {
            n += 1;
            let new = [Some(2), None, Some(3), Some(1)][mi];
            let c = DCase {
                dtype,
                seqlen_q: new.unwrap_or(2),
                heads: 8,
                heads_kv: 2,
                d: [16, 40, 64, 59][mi],
                cap: 96,
                lens: vec![63, 40, 1, 0, 31],
                leftpad: Some(if new.is_some() {
                    vec![0, 13, 1, 0, 30]
                } else {
                    vec![0, 13, 1, 0, 31]
                }),
                new,
                causal,
                window,
                softcap: [None, Some(5.0)][n % 2],
                alibi: n % 2 == 1,
                rotary: (mi == 2).then_some((8, n % 2 == 0)),
                store: stores[(mi + n) % 4],
                splits: [Some(1), Some(3), None][n % 3],
                seed: 700 + n as u64,
                ..DCase::default()
            };
            check_case(&c);
        }
    }
}

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

#[test]
fn packed_queries_match_per_sequence_calls() {
    let q_lens = [3usize, 0, 1, 6, 2, 4];
    let total = q_lens.iter().sum::<usize>() + 2;
    let cu = cumulative(&q_lens);
    let mut n = 0;
    for dtype in DTYPES {
        for mi in 0..4 {
            n += 1;
            let c = packed_case(dtype, mi, n, 900 + n as u64);
            let bl = build(&c);
            let (h, d) = (c.heads, c.d);
            let mut rng = common::rng(c.seed ^ 0xc0ffee);
            let qv = values(&mut rng, total * h * d, Dist::Normal);
            let qb = to_buffer(&qv, dtype);
            let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
            let call = |q: TensorRef, lens: &[i32], opts: &KvCacheOptions| {
                let (mut kc, mut vc) = (bl.k_cache.clone(), bl.v_cache.clone());
                let mut k = TensorMut::new(slice_mut(&mut kc), &bl.map.shape, &bl.map.strides);
                let mut v = TensorMut::new(slice_mut(&mut vc), &bl.map.shape, &bl.map.strides);
                flash_attn_with_kvcache(&q, &mut k, &mut v, lens, opts)
                    .unwrap_or_else(|e| panic!("{c:?}: {e}"))
            };
            let packed = call(
                view_of(&qb, &[total, h, d]),
                &lens,
                &bl.opts(&c).cu_seqlens_q(&cu),
            );
            assert_eq!(packed.out.shape(), &[total, h, d]);
            assert_eq!(packed.lse.shape(), &[h, total]);
            let (out, lse) = (packed.out.to_f64_vec(), packed.lse.to_f64_vec());
            for r in cu[q_lens.len()] as usize..total {
                assert!(out[r * h * d..(r + 1) * h * d].iter().all(|&x| x == 0.0));
                assert!((0..h).all(|hh| lse[hh * total + r] == f64::NEG_INFINITY));
            }
            for (b, &sq) in q_lens.iter().enumerate().filter(|x| *x.1 > 0) {
                let r0 = cu[b] as usize;
                let qs = to_buffer(&qv[r0 * h * d..(r0 + sq) * h * d], dtype);
                let own = Alone::new(&c, &bl, b);
                let alone = call(
                    view_of(&qs, &[1, sq, h, d]),
                    &lens[b..b + 1],
                    &own.opts(&c, &bl, b),
                );
                let what = format!("{c:?}: sequence {b}");
                let lse_at = |hh: usize, i: usize| lse[hh * total + r0 + i];
                assert_rows_match(&what, (&packed, r0, &lse_at), &alone, (sq, h, d));
                if dtype == DType::F32 {
                    // The oracle on the keys this sequence sees.
                    let (lp, sk) = (c.first_key(b), c.seqlen_k(b) - c.first_key(b));
                    let (mut kb, mut vb) = (Vec::new(), Vec::new());
                    let (kc, vc) = (buf_f64(&bl.k_cache), buf_f64(&bl.v_cache));
                    for j in lp..lp + sk {
                        for hk in 0..c.heads_kv {
                            let o = bl.map.offset(b, j, hk);
                            kb.extend(kc[o..o + d].iter().map(|&x| x as f32));
                            vb.extend(vc[o..o + d].iter().map(|&x| x as f32));
                        }
                    }
                    let q32: Vec<f32> = qv[r0 * h * d..(r0 + sq) * h * d]
                        .iter()
                        .map(|&x| x as f32)
                        .collect();
                    let mut ro = AttnOptions::default()
                        .causal(c.causal)
                        .window(c.window.0, c.window.1);
                    if c.alibi {
                        let slopes = &bl.alibi[b * h..(b + 1) * h];
                        ro = ro.alibi_slopes(TensorRef::contiguous(slopes, &[h]));
                    }
                    if c.sink {
                        ro = ro.learnable_sink(TensorRef::contiguous(&bl.sinks, &[h]));
                    }
                    let ks = [1, sk, c.heads_kv, d];
                    let r = reference::attention(
                        &TensorRef::contiguous(&q32, &[1, sq, h, d]),
                        &TensorRef::contiguous(&kb, &ks),
                        &TensorRef::contiguous(&vb, &ks),
                        &ro,
                    )
                    .unwrap();
                    for (x, y) in alone.out.to_f64_vec().iter().zip(&r.out) {
                        assert!((x - y).abs() <= 1e-5, "{what}: out {x} against {y}");
                    }
                }
            }
        }
    }
}

/// New keys of different lengths per sequence (`cu_seqlens_k_new`), with packed or batched
/// queries, and batched new keys with packed queries: the output, the LSEs and the caches
/// afterwards are those of one call per sequence with its own batched new keys, bit for bit.
#[test]
fn packed_new_keys_match_per_sequence_calls() {
    let new_lens = [3usize, 0, 1, 6, 2, 4];
    let cu_new = cumulative(&new_lens);
    let total_new = new_lens.iter().sum::<usize>() + 1;
    let batched_new = 2;
    let mut n = 0;
    // (queries packed, new keys packed).
    for (q_packed, new_packed) in [(true, true), (false, true), (true, false)] {
        for dtype in DTYPES {
            n += 1;
            let mi = n % 4;
            // Packed queries: a chunk per sequence as long as its new keys (chunked prefill), one
            // sequence with more; batched: 2 tokens per sequence.
            let q_lens: Vec<usize> = match (q_packed, new_packed) {
                (true, true) => new_lens
                    .iter()
                    .enumerate()
                    .map(|(b, &l)| l + (b == 2) as usize)
                    .collect(),
                (true, false) => vec![1, 0, 2, 1, 3, 1],
                _ => vec![2; new_lens.len()],
            };
            let seq_new: Vec<usize> = if new_packed {
                new_lens.to_vec()
            } else {
                vec![batched_new; new_lens.len()]
            };
            let c = DCase {
                // The most any sequence appends, so a paged store maps its pages.
                new: Some(6),
                rotary: (n % 3 != 1).then_some((if mi == 3 { 18 } else { 8 }, n % 2 == 0)),
                ..packed_case(dtype, mi, n, 1300 + n as u64)
            };
            let bl = build(&c);
            let (h, hkv, d, batch) = (c.heads, c.heads_kv, c.d, c.batch());
            let mut rng = common::rng(c.seed ^ 0xfeed);
            let total_q = q_lens.iter().sum::<usize>() + 2;
            let sq = q_lens[0];
            let q_rows = if q_packed { total_q } else { batch * sq };
            let qv = values(&mut rng, q_rows * h * d, Dist::Normal);
            let qb = to_buffer(&qv, dtype);
            let new_rows = if new_packed {
                total_new
            } else {
                batch * batched_new
            };
            let kn = buf_f64(&to_buffer(
                &values(&mut rng, new_rows * hkv * d, Dist::Normal),
                dtype,
            ));
            let vn = buf_f64(&to_buffer(
                &values(&mut rng, new_rows * hkv * d, Dist::Uniform),
                dtype,
            ));
            let (knb, vnb) = (to_buffer(&kn, dtype), to_buffer(&vn, dtype));
            let cu_q = cumulative(&q_lens);
            let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
            let call = |q: TensorRef,
                        lens: &[i32],
                        opts: &KvCacheOptions,
                        kv: &mut (Buffer, Buffer)| {
                let mut k = TensorMut::new(slice_mut(&mut kv.0), &bl.map.shape, &bl.map.strides);
                let mut v = TensorMut::new(slice_mut(&mut kv.1), &bl.map.shape, &bl.map.strides);
                flash_attn_with_kvcache(&q, &mut k, &mut v, lens, opts)
                    .unwrap_or_else(|e| panic!("{c:?}: {e}"))
            };
            let q_view = if q_packed {
                view_of(&qb, &[total_q, h, d])
            } else {
                view_of(&qb, &[batch, sq, h, d])
            };
            let new_shape = if new_packed {
                vec![new_rows, hkv, d]
            } else {
                vec![batch, batched_new, hkv, d]
            };
            let mut o = bl
                .opts(&c)
                .new_kv(view_of(&knb, &new_shape), view_of(&vnb, &new_shape));
            if q_packed {
                o = o.cu_seqlens_q(&cu_q);
            }
            if new_packed {
                o = o.cu_seqlens_k_new(&cu_new);
            }
            let mut caches = (bl.k_cache.clone(), bl.v_cache.clone());
            let all = call(q_view, &lens, &o, &mut caches);
            let lse = all.lse.to_f64_vec();
            if q_packed {
                let out = all.out.to_f64_vec();
                for r in cu_q[batch] as usize..total_q {
                    assert!(out[r * h * d..(r + 1) * h * d].iter().all(|&x| x == 0.0));
                    assert!((0..h).all(|hh| lse[hh * total_q + r] == f64::NEG_INFINITY));
                }
            }
            // One call per sequence, on caches that take each call's appends in turn.
            let mut one_by_one = (bl.k_cache.clone(), bl.v_cache.clone());
            for b in 0..batch {
                let (nq, nn) = (q_lens[b], seq_new[b]);
                let r0 = if q_packed { cu_q[b] as usize } else { b * sq };
                let qs = to_buffer(&qv[r0 * h * d..(r0 + nq) * h * d], dtype);
                let n0 = if new_packed {
                    cu_new[b] as usize
                } else {
                    b * batched_new
                };
                let rows = n0 * hkv * d..(n0 + nn) * hkv * d;
                let (kn_b, vn_b) = (
                    to_buffer(&kn[rows.clone()], dtype),
                    to_buffer(&vn[rows], dtype),
                );
                let own = Alone::new(&c, &bl, b);
                let mut ob = own.opts(&c, &bl, b).new_kv(
                    view_of(&kn_b, &[1, nn, hkv, d]),
                    view_of(&vn_b, &[1, nn, hkv, d]),
                );
                ob.rotary = o.rotary.clone();
                let q1 = view_of(&qs, &[1, nq, h, d]);
                let alone = call(q1, &lens[b..b + 1], &ob, &mut one_by_one);
                let what = format!("{c:?}: q packed {q_packed}, new packed {new_packed}, seq {b}");
                let lse_at = |hh: usize, i: usize| {
                    if q_packed {
                        lse[hh * total_q + r0 + i]
                    } else {
                        lse[(b * h + hh) * sq + i]
                    }
                };
                assert_rows_match(&what, (&all, r0, &lse_at), &alone, (nq, h, d));
            }
            let what = format!("{c:?}: q packed {q_packed}, new packed {new_packed}");
            assert_eq!(
                buf_bits(&caches.0),
                buf_bits(&one_by_one.0),
                "{what}: k_cache"
            );
            assert_eq!(
                buf_bits(&caches.1),
                buf_bits(&one_by_one.1),
                "{what}: v_cache"
            );
            assert_ne!(
                buf_bits(&caches.0),
                buf_bits(&bl.k_cache),
                "{what}: nothing appended"
            );
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

/// Odd head dims and cache lengths, rows with an empty cache, seqlen_q > seqlen_new, large scores.
#[test]
fn awkward_shapes() {
    let mut seed = 100;
    for dtype in DTYPES {
        for &(d, lens, new, sq) in &[
            (40usize, &[1usize, 63][..], Some(1usize), 1usize),
            (59, &[113, 0, 203], Some(3), 3),
            (111, &[203], None, 2),
            (1, &[0, 0], Some(2), 1),
            (256, &[63], Some(1), 1),
            (59, &[0], None, 1),    // no key at all: out 0, lse -inf
            (40, &[5], Some(2), 6), // seqlen_q > seqlen_new: first queries see only the cache
        ] {
            for dist in [Dist::Normal, Dist::Huge(300.0)] {
                seed += 1;
                check_case(&DCase {
                    dtype,
                    d,
                    lens: lens.to_vec(),
                    new,
                    seqlen_q: sq,
                    cap: 210,
                    heads: 6,
                    heads_kv: 3,
                    dist,
                    seed,
                    ..DCase::default()
                });
            }
        }
    }
}

/// Two property-test draws (seeds 23 and 26, 10000 cases) with rotary, ALiBi, causal masks and
/// logits of ~30 in bf16, on every instruction set: the AVX-512 kernels multiplied q rounded to
/// bf16 while the others kept the rotated q in f32, and their outputs differed by 0.05, past
/// the bound. Now every kernel rounds the rotated q to q's dtype (flash-attn's contract), and so
/// does the test's oracle.
#[test]
fn rotary_with_huge_logits_on_every_isa() {
    let base = DCase {
        dtype: DType::BF16,
        seqlen_q: 5,
        heads: 4,
        heads_kv: 1,
        d: 16,
        cap: 115,
        lens: vec![4],
        leftpad: None,
        new: Some(3),
        causal: true,
        window: (-1, -1),
        softcap: None,
        alibi: true,
        sink: false,
        rotary: Some((16, true)),
        store: Store::Gaps,
        splits: Some(1),
        isa: None,
        dist: Dist::Huge(30.0),
        seed: 16769291133991644983,
        fp8: None,
    };
    let fp8 = DCase {
        seqlen_q: 2,
        heads: 6,
        heads_kv: 2,
        d: 111,
        cap: 89,
        lens: vec![43, 21],
        window: (2, 5),
        sink: true,
        rotary: Some((90, true)),
        store: Store::Paged(6),
        splits: Some(4),
        seed: 4123520806240085775,
        fp8: Some(Fp8Format::E4M3),
        ..base.clone()
    };
    for c in [base, fp8] {
        let outs: Vec<Vec<f64>> = flashattn::simd::available()
            .into_iter()
            .map(|isa| {
                check_case(&DCase {
                    isa: Some(isa),
                    ..c.clone()
                })
                .out
                .to_f64_vec()
            })
            .collect();
        // The instruction sets agree to bf16's rounding of P (the AVX-512 bf16 P·V), not 0.05.
        for o in &outs[1..] {
            let diff = o
                .iter()
                .zip(&outs[0])
                .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
            assert!(diff < 1e-2, "{c:?}: instruction sets differ by {diff}");
        }
    }
}

/// Rotary: interleaved and not, rotary_dim < d, GQA, every dtype; k_new at positions
/// cache_seqlens[b] + i, q there too when causal and at cache_seqlens[b] when not (flash-attn).
#[test]
fn rotary_against_own_rotation() {
    let mut seed = 200;
    for dtype in DTYPES {
        for &(d, rot) in &[(64usize, 64usize), (64, 32), (40, 16), (59, 58), (128, 2)] {
            for inter in [false, true] {
                for causal in [true, false] {
                    seed += 1;
                    check_case(&DCase {
                        dtype,
                        d,
                        rotary: Some((rot, inter)),
                        causal,
                        lens: vec![37, 0, 90],
                        new: Some(2),
                        seqlen_q: 2,
                        heads: 8,
                        heads_kv: 2,
                        cap: 100,
                        seed,
                        ..DCase::default()
                    });
                }
            }
        }
    }
}

/// Paged caches of several page sizes, shuffled pages: each against the reference, and bit for
/// bit the contiguous result (tiles span pages, so both layouts run the same tiles over the same
/// values; only the addresses differ).
#[test]
fn paged_matches_contiguous() {
    let mut seed = 300;
    for dtype in DTYPES {
        for rotary in [None, Some((32, false))] {
            seed += 1;
            let base = DCase {
                dtype,
                d: 64,
                heads: 8,
                heads_kv: 2,
                lens: vec![203, 1, 0, 77],
                new: Some(3),
                seqlen_q: 3,
                cap: 256,
                alibi: true,
                softcap: Some(20.0),
                rotary,
                splits: Some(1),
                seed,
                ..DCase::default()
            };
            let contiguous = check_case(&base);
            for ps in [1, 3, 16, 256] {
                let paged = check_case(&DCase {
                    store: Store::Paged(ps),
                    ..base.clone()
                });
                assert_bit_identical(&contiguous, &paged, &format!("{dtype} page {ps}"));
            }
        }
    }
}

/// Caches behind cache_batch_idx and with gaps between heads/rows/batches (gaps hold NaN).
#[test]
fn batch_idx_and_strided_caches() {
    let mut seed = 400;
    for dtype in DTYPES {
        for store in [Store::BatchIdx, Store::Gaps] {
            seed += 1;
            check_case(&DCase {
                dtype,
                store,
                lens: vec![30, 0, 61],
                new: Some(2),
                seqlen_q: 2,
                d: 40,
                heads: 6,
                heads_kv: 2,
                cap: 64,
                rotary: Some((40, true)),
                seed,
                ..DCase::default()
            });
        }
    }
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

/// Split counts 1, 2, 3, 7 and automatic: each against the reference, and within rounding of each
/// other; with one split the merge is exact, so automatic on one thread equals 1 split bit for bit.
#[test]
fn split_counts_agree() {
    let mut seed = 500;
    for dtype in DTYPES {
        for (causal, window) in [(false, (-1, -1)), (true, (-1, -1)), (true, (100, -1))] {
            seed += 1;
            let base = DCase {
                dtype,
                d: 128,
                heads: 32,
                heads_kv: 8,
                lens: vec![1500, 3, 700],
                new: Some(1),
                cap: 1600,
                causal,
                window,
                seed,
                ..DCase::default()
            };
            let one = check_case(&DCase {
                splits: Some(1),
                ..base.clone()
            });
            for n in [2, 3, 7, 64] {
                let r = check_case(&DCase {
                    splits: Some(n),
                    ..base.clone()
                });
                close(&one, &r, dtype, &format!("{dtype} splits {n}"));
            }
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            let auto_one_thread = pool.install(|| check_case(&base));
            assert_bit_identical(&one, &auto_one_thread, "auto split count on one thread");
        }
    }
}

/// A split with no keys that starts at the end of a full cache (more splits than keys). Found by
/// the property test below: the page of its first key was looked up although it reads none, which
/// indexed past the block table (or a contiguous cache's one page) and panicked.
#[test]
fn empty_split_at_a_full_cache() {
    for dtype in DTYPES {
        for c in empty_split_cases(dtype) {
            check_case(&c);
        }
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

/// The portable scalar kernels (the twin of the AVX-512 ones) on the same cases.
#[test]
fn every_isa() {
    let mut seed = 600;
    for isa in flashattn::simd::available() {
        for dtype in DTYPES {
            seed += 1;
            check_case(&DCase {
                dtype,
                isa: Some(isa),
                d: 59,
                heads: 12,
                heads_kv: 3,
                lens: vec![203, 64],
                new: Some(2),
                seqlen_q: 2,
                cap: 210,
                alibi: true,
                softcap: Some(5.0),
                splits: Some(3),
                store: Store::Paged(16),
                seed,
                ..DCase::default()
            });
        }
    }
}

/// A fixed split count gives bit-identical results on 1 and 2 threads.
#[test]
fn thread_count_does_not_change_results() {
    let c = DCase {
        d: 64,
        heads: 8,
        heads_kv: 2,
        lens: vec![900, 400],
        cap: 1000,
        splits: Some(4),
        seed: 700,
        ..DCase::default()
    };
    let bl = build(&c);
    let runs: Vec<AttnOutput> = [1, 2]
        .iter()
        .map(|&t| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap();
            pool.install(|| bl.call(&c).0.unwrap())
        })
        .collect();
    assert_bit_identical(&runs[0], &runs[1], "1 vs 2 threads");
}

/// Shapes whose products run in sub-blocks of 4 or 8 keys (a key's rows of all kv heads over 4
/// KiB): f32 at d = 256 (4 keys), bf16 and f16 at d = 256 (8 keys, bf16 through its key-pair
/// path); contiguous and paged caches (pages of 5 and 16 tokens, so sub-blocks straddle pages),
/// cache lengths that leave partial sub-blocks, masks, several query rows, every ISA.
#[test]
fn sub_blocks_of_keys() {
    let mut seed = 900;
    for isa in flashattn::simd::available() {
        for dtype in DTYPES {
            for store in [Store::Contiguous, Store::Paged(5), Store::Paged(16)] {
                for (causal, window) in [(false, (-1, -1)), (true, (37, -1))] {
                    seed += 1;
                    check_case(&DCase {
                        dtype,
                        isa: Some(isa),
                        d: 256,
                        heads: 16,
                        heads_kv: 8,
                        lens: vec![203, 37],
                        new: Some(2),
                        seqlen_q: 2,
                        cap: 240,
                        causal,
                        window,
                        splits: Some(2),
                        store,
                        seed,
                        ..DCase::default()
                    });
                }
            }
        }
    }
}

/// Many query rows per kv head, where AVX-512 takes q transposed for the score product (16 or
/// more rows: MQA, several tokens per step): 16, 17 (a partial vector of rows), 32 and 96 rows
/// (6 vectors: a 4- and a 2-vector tile); even and odd head dims (bf16 with an odd d runs the
/// widening form); contiguous and paged caches; masks that differ from row to row; every ISA.
#[test]
fn many_rows_per_kv_head() {
    let mut seed = 1000;
    for isa in flashattn::simd::available() {
        for dtype in DTYPES {
            for (i, &shape) in [
                (32, 1, 1, 128),
                (16, 2, 2, 64),
                (17, 1, 1, 111),
                (32, 1, 3, 40),
            ]
            .iter()
            .enumerate()
            {
                seed += 1;
                check_case(&DCase {
                    causal: i % 2 == 1,
                    window: if i == 2 { (50, -1) } else { (-1, -1) },
                    softcap: (i == 3).then_some(20.0),
                    store: if i % 2 == 0 {
                        Store::Paged(7)
                    } else {
                        Store::Contiguous
                    },
                    splits: Some(3),
                    ..DCase::steps((dtype, isa), shape, (&[203, 61], 240), seed)
                });
            }
        }
    }
}

/// The decode benchmark shape, smaller cache: q [1, 1, 32, 128], kv heads 8, 4096 cached tokens.
#[test]
fn benchmark_shape_small_cache() {
    for dtype in [DType::F32, DType::BF16] {
        check_case(&DCase {
            dtype,
            d: 128,
            heads: 32,
            heads_kv: 8,
            lens: vec![4095],
            new: Some(1),
            cap: 4096,
            seed: 800,
            ..DCase::default()
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Bad input: typed errors, caches untouched
// ---------------------------------------------------------------------------------------------

/// The pieces of a call, each replaceable by a bad one.
struct Call<'a> {
    q: TensorRef<'a>,
    lens: Vec<i32>,
    opts: KvCacheOptions<'a>,
    k_shape: Vec<usize>,
    k_strides: Vec<usize>,
    v_shape: Vec<usize>,
    /// Use an f16 v_cache instead of the case's dtype.
    v_f16: bool,
}

/// The valid call of case `c` as a [`Call`], for the checks to break one thing of.
fn base_call<'a>(bl: &'a Built, c: &DCase) -> Call<'a> {
    Call {
        q: bl.q_view(c),
        lens: c.lens.iter().map(|&x| x as i32).collect(),
        opts: bl.opts(c),
        k_shape: bl.map.shape.clone(),
        k_strides: bl.map.strides.clone(),
        v_shape: bl.map.shape.clone(),
        v_f16: false,
    }
}

/// A q whose `out` no machine can hold (a stride-0 view of 2^51 rows: 2^60 bytes of out) is
/// `OutOfMemory`, and the append it carries has written nothing: the results are allocated
/// before the caches are written.
#[test]
fn results_too_large_to_allocate_write_nothing() {
    let c = DCase {
        lens: vec![10, 20],
        new: Some(2),
        seqlen_q: 2,
        cap: 32,
        causal: false,
        store: Store::Paged(8),
        ..DCase::default()
    };
    let bl = build(&c);
    assert!(bl.call(&c).0.is_ok(), "the base case is valid");
    let rows = 1usize << 51;
    let q = TensorRef::from_slice(bl.qb.as_slice(), &[2, rows, c.heads, c.d], &[0, 0, c.d, 1]);
    let e = expect_err(
        &bl,
        Call {
            q,
            ..base_call(&bl, &c)
        },
    );
    assert_eq!(
        e.kind(),
        &ErrorKind::OutOfMemory {
            what: "`out`",
            bytes: 2 * rows * c.heads * c.d * 4
        }
    );
}

/// Runs a bad call on copies of the caches: it must return an error (not panic), and leave both
/// caches bit-identical.
fn expect_err(bl: &Built, call: Call) -> Error {
    let (mut kc, mut vc) = (bl.k_cache.clone(), bl.v_cache.clone());
    let mut vc16 = Buffer::F16(vec![half::f16::ZERO; bl.map.len]);
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut k = TensorMut::new(slice_mut(&mut kc), &call.k_shape, &call.k_strides);
        let vbuf = if call.v_f16 { &mut vc16 } else { &mut vc };
        let v_strides = flashattn::tensor::contiguous_strides(&call.v_shape);
        let mut v = TensorMut::new(slice_mut(vbuf), &call.v_shape, &v_strides);
        flash_attn_with_kvcache(&call.q, &mut k, &mut v, &call.lens, &call.opts)
    }));
    let err = match res {
        Ok(Err(e)) => e,
        Ok(Ok(_)) => panic!("accepted an invalid input"),
        Err(_) => panic!("panicked instead of returning an error"),
    };
    assert_eq!(
        buf_bits(&kc),
        buf_bits(&bl.k_cache),
        "k_cache changed by a rejected call"
    );
    assert_eq!(
        buf_bits(&vc),
        buf_bits(&bl.v_cache),
        "v_cache changed by a rejected call"
    );
    err
}

#[test]
fn bad_input_is_a_typed_error_and_writes_nothing() {
    // A valid paged case with new keys and rotary; each check below breaks one thing.
    let c = DCase {
        lens: vec![10, 20],
        new: Some(2),
        seqlen_q: 2,
        cap: 32,
        rotary: Some((8, false)),
        store: Store::Paged(8),
        ..DCase::default()
    };
    let bl = build(&c);
    assert!(bl.call(&c).0.is_ok(), "the base case is valid");
    let base = || base_call(&bl, &c);
    let kind = |call: Call| expect_err(&bl, call).kind().clone();

    // Appending past the pages a sequence owns: 20 + 2 > 2 blocks · 8? No: max_blocks = 4 (32 /
    // 8), so 31 + 2 = 33 > 32 overflows.
    let e = expect_err(
        &bl,
        Call {
            lens: vec![10, 31],
            ..base()
        },
    );
    assert_eq!(
        e.kind(),
        &ErrorKind::CacheOverflow {
            batch: 1,
            cache_seqlen: 31,
            seqlen_new: 2,
            needed: 33,
            capacity: 32
        }
    );
    assert!(e.to_string().contains("nothing was written"), "{e}");
    assert_eq!(
        kind(Call {
            lens: vec![-1, 20],
            ..base()
        }),
        ErrorKind::IndexOutOfRange {
            tensor: "cache_seqlens",
            index: 0,
            value: -1,
            bound: i32::MAX as usize
        }
    );
    assert!(matches!(
        kind(Call {
            lens: vec![10],
            ..base()
        }),
        ErrorKind::IndexLength {
            tensor: "cache_seqlens",
            expected: 2,
            got: 1,
            ..
        }
    ));
    // A q with no elements and a batch of usize::MAX (a property-test draw, seed 51: it
    // panicked with a capacity overflow where the batch sized the sequence table).
    let no_q: Vec<f32> = Vec::new();
    assert!(matches!(
        kind(Call {
            q: TensorRef::contiguous(&no_q, &[usize::MAX, 0, 4, 16]),
            ..base()
        }),
        ErrorKind::IndexLength {
            tensor: "cache_seqlens",
            expected: usize::MAX,
            got: 2,
            ..
        }
    ));
    // Block table: an out-of-range and a negative entry among the used ones; wrong size.
    let mut table = bl.map.table.clone();
    table[1] = 1000;
    let n_blocks = bl.map.shape[0];
    assert_eq!(
        kind(Call {
            opts: bl.opts(&c).block_table(BlockTable::new(&table, 2, 4)),
            ..base()
        }),
        ErrorKind::IndexOutOfRange {
            tensor: "block_table",
            index: 1,
            value: 1000,
            bound: n_blocks
        }
    );
    let mut table = bl.map.table.clone();
    table[4] = -5;
    assert!(matches!(
        kind(Call {
            opts: bl.opts(&c).block_table(BlockTable::new(&table, 2, 4)),
            ..base()
        }),
        ErrorKind::IndexOutOfRange {
            tensor: "block_table",
            index: 4,
            value: -5,
            ..
        }
    ));
    assert!(matches!(
        kind(Call {
            opts: bl
                .opts(&c)
                .block_table(BlockTable::new(&bl.map.table[..7], 2, 4)),
            ..base()
        }),
        ErrorKind::IndexLength {
            tensor: "block_table",
            expected: 8,
            got: 7,
            ..
        }
    ));
    let idx = [0, 1];
    assert_eq!(
        kind(Call {
            opts: bl.opts(&c).cache_batch_idx(&idx),
            ..base()
        }),
        ErrorKind::PagedWithBatchIdx
    );
    // New keys: shape, dtype.
    let (kb, vb) = (&bl.k_new.as_ref().unwrap().1, &bl.v_new.as_ref().unwrap().1);
    let bad_shape = [2, 2, 2, 15];

    assert_kind!(
        kind(Call {
            opts: bl.opts(&c).new_kv(
                TensorRef::from_slice(kb.as_slice(), &bad_shape, &[64, 32, 16, 1]),
                view_of(vb, &[2, 2, 2, 16]),
            ),
            ..base()
        }),
        ErrorKind::Shape {
            tensor: "k_new",
            ..
        }
    );
    let v16 = vec![half::f16::ONE; 128];
    assert_kind!(
        kind(Call {
            opts: bl.opts(&c).new_kv(
                view_of(kb, &[2, 2, 2, 16]),
                TensorRef::contiguous(&v16, &[2, 2, 2, 16]),
            ),
            ..base()
        }),
        ErrorKind::DType {
            tensor: "v_new",
            ..
        }
    );
    // Caches: dtype and shape.
    assert_kind!(
        kind(Call {
            v_f16: true,
            ..base()
        }),
        ErrorKind::DType {
            tensor: "v_cache",
            ..
        }
    );
    let mut vs = bl.map.shape.clone();
    vs[0] -= 1;
    assert_kind!(
        kind(Call {
            v_shape: vs,
            ..base()
        }),
        ErrorKind::Shape {
            tensor: "v_cache",
            ..
        }
    );
    // k_cache strides that reach past the buffer.
    let mut ks = bl.map.strides.clone();
    ks[0] += 1;
    assert_kind!(
        kind(Call {
            k_strides: ks,
            ..base()
        }),
        ErrorKind::OutOfBounds {
            tensor: "k_cache",
            ..
        }
    );
    // Rotary: without new keys, too wide, too few positions.
    let mut o = bl.opts(&c);
    o.new_kv = None;
    assert_eq!(
        kind(Call { opts: o, ..base() }),
        ErrorKind::RotaryWithoutNewKv
    );
    let wide = vec![0.5f32; 64 * 9];
    let e = kind(Call {
        opts: bl.opts(&c).rotary(
            TensorRef::contiguous(&wide, &[64, 9]),
            TensorRef::contiguous(&wide, &[64, 9]),
            false,
        ),
        ..base()
    });
    assert_eq!(
        e,
        ErrorKind::RotaryDim {
            rotary_dim: 18,
            head_dim: 16
        }
    );
    // A table of no rows and usize::MAX columns: `2 · half` overflowed in the check (a panic
    // with overflow checks on; found by `properties::changed_calls_fail_cleanly`).
    let e = kind(Call {
        opts: bl.opts(&c).rotary(
            TensorRef::contiguous(&wide[..0], &[0, usize::MAX]),
            TensorRef::contiguous(&wide[..0], &[0, usize::MAX]),
            false,
        ),
        ..base()
    });
    assert_eq!(
        e,
        ErrorKind::RotaryDim {
            rotary_dim: usize::MAX,
            head_dim: 16
        }
    );
    let short = vec![0.5f32; 21 * 4];
    let e = kind(Call {
        opts: bl.opts(&c).rotary(
            TensorRef::contiguous(&short, &[21, 4]),
            TensorRef::contiguous(&short, &[21, 4]),
            false,
        ),
        ..base()
    });
    assert_eq!(
        e,
        ErrorKind::RotaryPositions {
            batch: 1,
            needed: 22,
            seqlen_ro: 21
        }
    );
    assert_kind!(
        kind(Call {
            opts: bl.opts(&c).rotary(
                TensorRef::contiguous(&short, &[21, 4]),
                TensorRef::contiguous(&short[..20 * 4], &[20, 4]),
                false,
            ),
            ..base()
        }),
        ErrorKind::Shape {
            tensor: "rotary_sin",
            ..
        }
    );
    // Options.
    assert_eq!(
        kind(Call {
            opts: bl.opts(&c).num_splits(0),
            ..base()
        }),
        ErrorKind::NumSplits { num_splits: 0 }
    );
    // More splits than any call may ask for: refused before anything is allocated (2^31 splits
    // tried to allocate 80 GB of partial results; found by `changed_calls_fail_cleanly`).
    for n in [flashattn::decode::MAX_NUM_SPLITS + 1, 1 << 31, usize::MAX] {
        assert_eq!(
            kind(Call {
                opts: bl.opts(&c).num_splits(n),
                ..base()
            }),
            ErrorKind::NumSplits { num_splits: n }
        );
    }
    let mut o = bl.opts(&c);
    o.attn = o.attn.dropout(0.1, 1);
    assert_eq!(
        kind(Call { opts: o, ..base() }),
        ErrorKind::DropoutInDecode { p: 0.1 }
    );
    let mut o = bl.opts(&c);
    o.attn = o.attn.window(-3, 0);
    assert_eq!(
        kind(Call { opts: o, ..base() }),
        ErrorKind::Window { left: -3, right: 0 }
    );
    let bad_slopes = [0.1f32; 3];
    let mut o = bl.opts(&c);
    o.attn = o
        .attn
        .alibi_slopes(TensorRef::contiguous(&bad_slopes, &[3]));
    assert!(matches!(
        kind(Call { opts: o, ..base() }),
        ErrorKind::AlibiShape { .. }
    ));
    // A slope whose bias overflows at the farthest key: sequence 1 attends 20 + 2 keys, so the
    // distance reaches 21 (slope · log2(e) · 21 overflows from |slope| ≈ 1.12e37 on).
    for bad in [-1.2e37f32, 1.2e37, f32::NAN] {
        let slopes = [0.1f32, 0.2, bad, 0.3];
        let mut o = bl.opts(&c);
        o.attn = o.attn.alibi_slopes(TensorRef::contiguous(&slopes, &[4]));
        assert_eq!(
            format!("{:?}", kind(Call { opts: o, ..base() })),
            format!(
                "{:?}",
                ErrorKind::AlibiSlope {
                    batch: 0,
                    head: 2,
                    slope: bad,
                    max_distance: 21
                }
            )
        );
    }
    // q: heads not a multiple of heads_kv, head_dim mismatch.
    let q3 = vec![0.5f32; 2 * 2 * 3 * 16];
    let e = kind(Call {
        q: TensorRef::contiguous(&q3, &[2, 2, 3, 16]),
        ..base()
    });
    assert_eq!(
        e,
        ErrorKind::HeadsNotMultiple {
            heads: 3,
            heads_kv: 2
        }
    );
    let q8 = vec![0.5f32; 2 * 2 * 4 * 8];
    assert_kind!(
        kind(Call {
            q: TensorRef::contiguous(&q8, &[2, 2, 4, 8]),
            ..base()
        }),
        ErrorKind::Shape {
            tensor: "k_cache",
            ..
        }
    );

    // Contiguous cache: cache_batch_idx out of range and of the wrong length; batch mismatch.
    let c2 = DCase {
        lens: vec![3, 4],
        cap: 8,
        store: Store::BatchIdx,
        ..DCase::default()
    };
    let bl2 = build(&c2);
    let base2 = || base_call(&bl2, &c2);
    let idx = [0, 4];
    assert_eq!(
        expect_err(
            &bl2,
            Call {
                opts: bl2.opts(&c2).cache_batch_idx(&idx),
                ..base2()
            }
        )
        .kind(),
        &ErrorKind::IndexOutOfRange {
            tensor: "cache_batch_idx",
            index: 1,
            value: 4,
            bound: 4
        }
    );
    let idx = [0];
    assert!(matches!(
        expect_err(
            &bl2,
            Call {
                opts: bl2.opts(&c2).cache_batch_idx(&idx),
                ..base2()
            }
        )
        .kind(),
        ErrorKind::IndexLength {
            tensor: "cache_batch_idx",
            ..
        }
    ));
    // cache_leftpad past its sequence's cache, negative, of the wrong length.
    for (lp, want) in [
        (
            &[0, 5][..],
            ErrorKind::IndexOutOfRange {
                tensor: "cache_leftpad",
                index: 1,
                value: 5,
                bound: 5,
            },
        ),
        (
            &[-1, 0][..],
            ErrorKind::IndexOutOfRange {
                tensor: "cache_leftpad",
                index: 0,
                value: -1,
                bound: 4,
            },
        ),
        (
            &[0][..],
            ErrorKind::IndexLength {
                tensor: "cache_leftpad",
                expected: 2,
                got: 1,
                what: "one per batch row of q",
            },
        ),
    ] {
        let call = Call {
            opts: bl2.opts(&c2).cache_leftpad(lp),
            ..base2()
        };
        assert_eq!(expect_err(&bl2, call).kind(), &want, "cache_leftpad {lp:?}");
    }
    // Packed queries (cu_seqlens_q): q [total_q, heads, d] with 3 rows for the batch of 2.
    let q3 = to_buffer(&vec![0.25; 3 * c2.heads * c2.d], c2.dtype);
    let q3v = || view_of(&q3, &[3, c2.heads, c2.d]);
    let no_new = || {
        let mut o = bl2.opts(&c2);
        o.new_kv = None;
        o
    };
    let packed_err = |q: TensorRef, cu: &[i32], opts: KvCacheOptions| {
        let opts = opts.cu_seqlens_q(cu);
        expect_err(&bl2, Call { q, opts, ..base2() }).kind().clone()
    };
    assert_kind!(
        packed_err(q3v(), &[0, 2, 1], no_new()),
        ErrorKind::CuSeqlens {
            tensor: "cu_seqlens_q",
            ..
        }
    );
    assert_kind!(
        packed_err(q3v(), &[0, 2, 4], no_new()),
        ErrorKind::CuSeqlens {
            tensor: "cu_seqlens_q",
            ..
        }
    );
    assert_kind!(
        packed_err(q3v(), &[0, 1, 2, 3], no_new()),
        ErrorKind::IndexLength {
            tensor: "cache_seqlens",
            ..
        }
    );
    assert_kind!(
        packed_err(bl2.q_view(&c2), &[0, 1, 2], no_new()),
        ErrorKind::Rank {
            tensor: "q",
            expected: 3,
            ..
        }
    );
    // Packed new keys (cu_seqlens_k_new): k_new/v_new [6, heads_kv, d] for the batch of 2.
    let kv6 = to_buffer(&vec![0.5; 6 * c2.heads_kv * c2.d], c2.dtype);
    let kv5 = to_buffer(&vec![0.5; 5 * c2.heads_kv * c2.d], c2.dtype);
    let packed_new = |rows: usize, v_rows: usize| {
        let (k, v) = (
            if rows == 6 { &kv6 } else { &kv5 },
            if v_rows == 6 { &kv6 } else { &kv5 },
        );
        bl2.opts(&c2).new_kv(
            view_of(k, &[rows, c2.heads_kv, c2.d]),
            view_of(v, &[v_rows, c2.heads_kv, c2.d]),
        )
    };
    let new_err = |cu: &[i32], opts: KvCacheOptions| {
        let opts = opts.cu_seqlens_k_new(cu);
        expect_err(&bl2, Call { opts, ..base2() }).kind().clone()
    };
    assert_eq!(
        new_err(&[0, 1, 2], no_new()),
        ErrorKind::CuSeqlensKNewWithoutNewKv
    );
    // The batched layout with cu_seqlens_k_new.
    assert_kind!(
        new_err(&[0, 1, 2], bl2.opts(&c2)),
        ErrorKind::Rank {
            tensor: "k_new",
            expected: 3,
            ..
        }
    );
    for cu in [
        &[0, 2][..],
        &[0, 2, 4, 6],
        &[1, 2, 4],
        &[0, 4, 2],
        &[0, 2, 7],
    ] {
        assert_kind!(
            new_err(cu, packed_new(6, 6)),
            ErrorKind::CuSeqlens {
                tensor: "cu_seqlens_k_new",
                ..
            }
        );
    }
    assert_kind!(
        new_err(&[0, 2, 5], packed_new(6, 5)),
        ErrorKind::Shape {
            tensor: "v_new",
            ..
        }
    );
    // Sequence 1 (4 cached of 8) cannot take 5 more; sequence 0 (3 cached) could take its 1:
    // nothing is written for either.
    assert_eq!(
        new_err(&[0, 1, 6], packed_new(6, 6)),
        ErrorKind::CacheOverflow {
            batch: 1,
            cache_seqlen: 4,
            seqlen_new: 5,
            needed: 9,
            capacity: 8
        }
    );
    let mut o = bl2.opts(&c2);
    o.cache_batch_idx = None; // 4 cache rows for a batch of 2, and no map
    assert!(matches!(
        expect_err(&bl2, Call { opts: o, ..base2() }).kind(),
        ErrorKind::Shape {
            tensor: "k_cache",
            ..
        }
    ));
    let e = expect_err(
        &bl2,
        Call {
            lens: vec![3, 8],
            ..base2()
        },
    );
    assert_eq!(
        e.kind(),
        &ErrorKind::CacheOverflow {
            batch: 1,
            cache_seqlen: 8,
            seqlen_new: 1,
            needed: 9,
            capacity: 8
        }
    );
}

/// Every message names the offending tensor or option.
#[test]
fn messages_name_the_problem() {
    let cases: Vec<(ErrorKind, &str)> = vec![
        (
            ErrorKind::IndexOutOfRange {
                tensor: "block_table",
                index: 3,
                value: 99,
                bound: 8,
            },
            "block_table",
        ),
        (ErrorKind::RotaryWithoutNewKv, "k_new"),
        (ErrorKind::CuSeqlensKNewWithoutNewKv, "cu_seqlens_k_new"),
        (ErrorKind::PagedWithBatchIdx, "cache_batch_idx"),
        (ErrorKind::NumSplits { num_splits: 0 }, "num_splits"),
        (ErrorKind::DropoutInDecode { p: 0.5 }, "dropout"),
        (
            ErrorKind::RotaryDim {
                rotary_dim: 18,
                head_dim: 16,
            },
            "rotary_dim 18",
        ),
    ];
    for (k, needle) in cases {
        let msg = Error::from(k).to_string();
        assert!(msg.contains(needle), "{msg:?} does not name {needle}");
    }
}

// ---------------------------------------------------------------------------------------------
// merge_attn_partials
// ---------------------------------------------------------------------------------------------

/// Attention over keys sharded in 3 (one shard empty: lse -inf), each shard a plain `flash_attn`,
/// merged: equals attention over all keys within rounding and
/// passes the reference bound. Batched and packed layouts.
#[test]
fn merge_reproduces_attention_over_shards() {
    let mut rng = rng(900);
    let (b, sq, h, hkv, d) = (2, 5, 4, 2, 24);
    let shards = [0usize, 70, 130];
    let sk: usize = shards.iter().sum();
    let q: Vec<f32> = (0..b * sq * h * d)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let k: Vec<f32> = (0..b * sk * hkv * d)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let v: Vec<f32> = (0..b * sk * hkv * d)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let qs = [b, sq, h, d];
    let qv = TensorRef::contiguous(&q, &qs);
    let opts = AttnOptions::default();
    let full_k = TensorRef::contiguous(&k, &[b, sk, hkv, d]);
    let full_v = TensorRef::contiguous(&v, &[b, sk, hkv, d]);
    let full = flash_attn(&qv, &full_k, &full_v, &opts).unwrap();
    let mut parts = Vec::new();
    let mut start = 0;
    for &n in &shards {
        // A view of keys start..start + n of every batch row: same strides, offset start.
        let strides = [sk * hkv * d, hkv * d, d, 1];
        let (ks, vs) = (&k[start * hkv * d..], &v[start * hkv * d..]);
        let kv = TensorRef::new(ks, &[b, n, hkv, d], &strides);
        let vv = TensorRef::new(vs, &[b, n, hkv, d], &strides);
        parts.push(flash_attn(&qv, &kv, &vv, &opts).unwrap());
        start += n;
    }
    let outs: Vec<TensorRef> = parts.iter().map(|p| p.out.view()).collect();
    let lses: Vec<TensorRef> = parts.iter().map(|p| p.lse.view()).collect();
    let merged = merge_attn_partials(&outs, &lses).unwrap();
    close(&full, &merged, DType::F32, "merged shards vs full");
    let r = reference::attention(&qv, &full_k, &full_v, &opts).unwrap();
    let nv = naive::attention(&qv, &full_k, &full_v, &opts).unwrap();
    check_bound("merged shards", DType::F32, &merged, &[nv], &r, 1.0, sk);
    // One partial: returned as is.
    let one = merge_attn_partials(&[full.out.view()], &[full.lse.view()]).unwrap();
    assert_bit_identical(&full, &one, "merge of one partial");

    // Packed layout: out [total, h, d], lse [h, total].
    let total = b * sq;
    let packed: Vec<(Vec<f32>, Vec<f32>)> = parts
        .iter()
        .map(|p| {
            let o = p.out.to_f32_vec();
            let l = p.lse.to_f32_vec();
            let mut lp = vec![0f32; h * total];
            for bb in 0..b {
                for hh in 0..h {
                    for i in 0..sq {
                        lp[hh * total + bb * sq + i] = l[(bb * h + hh) * sq + i];
                    }
                }
            }
            (o, lp)
        })
        .collect();
    let outs: Vec<TensorRef> = packed
        .iter()
        .map(|(o, _)| TensorRef::contiguous(o, &[total, h, d]))
        .collect();
    let lses: Vec<TensorRef> = packed
        .iter()
        .map(|(_, l)| TensorRef::contiguous(l, &[h, total]))
        .collect();
    let mp = merge_attn_partials(&outs, &lses).unwrap();
    assert_eq!(mp.out.shape(), &[total, h, d]);
    assert_eq!(mp.lse.shape(), &[h, total]);
    assert_eq!(
        bits(&mp.out),
        bits(&merged.out),
        "packed and batched merges agree"
    );
}

#[test]
fn merge_rejects_bad_partials() {
    let out = vec![0.5f32; 2 * 3 * 4];
    let lse = vec![0.1f32; 3 * 2];
    let o = TensorRef::contiguous(&out, &[1, 2, 3, 4]);
    let l = TensorRef::contiguous(&lse, &[1, 3, 2]);
    let err = |outs: &[TensorRef], lses: &[TensorRef]| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            merge_attn_partials(outs, lses)
        }))
        .expect("no panic")
        .expect_err("rejected")
        .kind()
        .clone()
    };
    assert_eq!(err(&[], &[]), ErrorKind::NoPartials);
    assert_eq!(
        err(std::slice::from_ref(&o), &[]),
        ErrorKind::PartialsCount { outs: 1, lses: 0 }
    );
    let o2 = TensorRef::contiguous(&out, &[1, 2, 4, 3]);
    assert!(matches!(
        err(&[o.clone(), o2], &[l.clone(), l.clone()]),
        ErrorKind::PartialMismatch {
            part: 1,
            tensor: "out_partials",
            ..
        }
    ));
    let l2 = TensorRef::contiguous(&lse, &[1, 2, 3]);
    assert!(matches!(
        err(std::slice::from_ref(&o), &[l2]),
        ErrorKind::PartialMismatch {
            part: 0,
            tensor: "lse_partials",
            ..
        }
    ));
    let mut bad = lse.clone();
    bad[4] = f32::NAN;
    let lb = TensorRef::contiguous(&bad, &[1, 3, 2]);
    assert!(matches!(
        err(&[o.clone(), o.clone()], &[l.clone(), lb]),
        ErrorKind::PartialLse {
            part: 1,
            index: 4,
            ..
        }
    ));
    let mut bad = lse.clone();
    bad[0] = f32::INFINITY;
    let lb = TensorRef::contiguous(&bad, &[1, 3, 2]);
    assert!(matches!(
        err(std::slice::from_ref(&o), &[lb]),
        ErrorKind::PartialLse {
            part: 0,
            index: 0,
            ..
        }
    ));
    let o16 = vec![half::f16::ONE; 24];
    assert!(matches!(
        err(
            &[o.clone(), TensorRef::contiguous(&o16, &[1, 2, 3, 4])],
            &[l.clone(), l.clone()]
        ),
        ErrorKind::PartialMismatch { part: 1, .. }
    ));
    let short = &out[..20];
    assert!(matches!(
        err(
            &[TensorRef::contiguous(short, &[1, 2, 3, 4])],
            std::slice::from_ref(&l)
        ),
        ErrorKind::OutOfBounds {
            tensor: "out_partials",
            ..
        }
    ));
}

/// A split that saw no key (lse -inf) contributes nothing, even if its out holds garbage.
#[test]
fn merge_ignores_empty_partials() {
    let a = vec![0.25f32, -0.5];
    let junk = vec![f32::NAN, 1e30];
    let (la, lj) = (vec![0.7f32], vec![f32::NEG_INFINITY]);
    let m = merge_attn_partials(
        &[
            TensorRef::contiguous(&junk, &[1, 1, 1, 2]),
            TensorRef::contiguous(&a, &[1, 1, 1, 2]),
        ],
        &[
            TensorRef::contiguous(&lj, &[1, 1, 1]),
            TensorRef::contiguous(&la, &[1, 1, 1]),
        ],
    )
    .unwrap();
    assert_eq!(m.out.to_f32_vec(), a);
    assert_eq!(m.lse.to_f32_vec(), la);
    let none = merge_attn_partials(
        &[TensorRef::contiguous(&junk, &[1, 1, 1, 2])],
        &[TensorRef::contiguous(&lj, &[1, 1, 1])],
    )
    .unwrap();
    assert_eq!(none.out.to_f32_vec(), vec![0.0, 0.0]);
    assert_eq!(none.lse.to_f32_vec(), vec![f32::NEG_INFINITY]);
}

/// More query rows than one work item holds (256 rows: positions × heads, at d <= 128), so a
/// sequence's queries are cut into blocks of unequal size (32 heads × 9 positions: blocks of 8
/// and 1 positions; 48 heads × 7: 5 and 2), each with its own key range under a causal or
/// windowed mask, merged over several splits; every ISA and dtype.
#[test]
fn query_blocks_of_unequal_size() {
    let mut seed = 2000;
    for isa in flashattn::simd::available() {
        for dtype in DTYPES {
            for (i, &shape) in [(32, 8, 9, 64), (48, 6, 7, 40)].iter().enumerate() {
                for splits in [None, Some(3)] {
                    seed += 1;
                    check_case(&DCase {
                        causal: i == 0,
                        window: if i == 1 { (30, 0) } else { (-1, -1) },
                        splits,
                        ..DCase::steps((dtype, isa), shape, (&[150, 61], 200), seed)
                    });
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The CUDA decode kernels, run on the CPU under host emulation
// ---------------------------------------------------------------------------------------------

/// Property tests: decode cases drawn by proptest over every option at once (dtypes, FP8 caches,
/// GQA ratios, head dims, batch rows of different lengths, appends, left pads, masks, softcap,
/// ALiBi, rotary, all four cache stores with any page size, split counts, instruction sets and
/// value distributions), each checked by [`check_case`] (the caches afterwards and out/lse against
/// the f64 reference). A failure shrinks to a small case and prints it.
mod properties {
    use super::*;
    use crate::common::props::extremes::{f32s as float, i32s, i64s, usizes};
    use crate::common::props::{assert_no_nan, config, scores_may_overflow, set_dim};
    use proptest::prelude::*;

    /// The options of a case, drawn independently and made consistent by [`case`].
    #[derive(Clone, Debug)]
    pub(super) struct Draw {
        /// (dtype, fp8 format: 0 none, 1 e4m3, 2 e5m2).
        dtype: (usize, usize),
        /// (heads_kv, group, head dim index, seqlen_q).
        shape: (usize, usize, usize, usize),
        /// (capacity, appended keys, cache_seqlens as fractions of the room left, left pads as
        /// fractions of each length).
        cache: (usize, usize, Vec<u16>, Option<Vec<u16>>),
        /// (causal, window left, window right, softcap, alibi, learnable sinks).
        mask: (bool, Option<u8>, Option<u8>, Option<u8>, bool, bool),
        layout: LayoutDraw,
        /// (value distribution, seed).
        values: (usize, u64),
    }

    /// (rotary: dim fraction and interleaved, store, page size, splits, isa index).
    type LayoutDraw = (
        Option<(u8, bool)>,
        usize,
        usize,
        Option<usize>,
        Option<usize>,
    );

    const HEAD_DIMS: [usize; 10] = [1, 2, 8, 16, 40, 59, 64, 111, 128, 256];

    pub(super) fn draws() -> impl Strategy<Value = Draw> {
        (
            (0..3usize, 0..3usize),
            (1..=4usize, 1..=4usize, 0..HEAD_DIMS.len(), 1..=5usize),
            (
                1..=150usize,
                0..=4usize,
                prop::collection::vec(any::<u16>(), 1..=4),
                prop::option::of(prop::collection::vec(any::<u16>(), 4)),
            ),
            (
                any::<bool>(),
                prop::option::of(0..48u8),
                prop::option::of(0..48u8),
                prop::option::of(1..=60u8),
                any::<bool>(),
                any::<bool>(),
            ),
            (
                prop::option::of((any::<u8>(), any::<bool>())),
                0..4usize,
                1..=40usize,
                prop::option::of(1..=6usize),
                prop::option::of(0..8usize),
            ),
            (0..3usize, any::<u64>()),
        )
            .prop_map(|(dtype, shape, cache, mask, layout, values)| Draw {
                dtype,
                shape,
                cache,
                mask,
                layout,
                values,
            })
    }

    /// `x` of 2^16 spread over `0..=n`.
    fn frac(x: u16, n: usize) -> usize {
        (x as usize * (n + 1)) >> 16
    }

    /// The valid case a draw stands for.
    pub(super) fn case(dr: &Draw) -> DCase {
        let (hkv, group, di, sq) = dr.shape;
        let d = HEAD_DIMS[di];
        let (cap, new, ref lens_raw, ref pads_raw) = dr.cache;
        let new = new.min(cap);
        let lens: Vec<usize> = lens_raw.iter().map(|&x| frac(x, cap - new)).collect();
        let leftpad = pads_raw
            .as_ref()
            .map(|p| lens.iter().zip(p).map(|(&len, &x)| frac(x, len)).collect());
        let (causal, left, right, softcap, alibi, sink) = dr.mask;
        let (rotary, store, page, splits, isa) = dr.layout;
        let isas = flashattn::simd::available();
        // Logits of ~30 (std) in f32: there the errors of flashattn and of naive both come from
        // f32 sums of products of ~100 and from rounding scores of that size, and their ratio has
        // a tail. Over 200 seeds of one such case (d = 256) the normalised error's median is 0.23
        // and its maximum 0.6-1.0, with or without FP8 caches, rotary and softcap; two of
        // thirteen runs of 3,000-4,000 cases stopped on a case over the bound (normalised
        // 1.12-1.22: d = 256, and d = 64 under a softcap of 1).
        // The fixed cases keep huge logits in f32 (`awkward_shapes`); here they would make the
        // property depend on the seed, so f32 draws take N(0, 1) instead.
        let dist = match (dr.values.0, DTYPES[dr.dtype.0]) {
            (2, DType::F32) => Dist::Normal,
            (i, _) => [Dist::Uniform, Dist::Normal, Dist::Huge(30.0)][i],
        };
        DCase {
            dtype: DTYPES[dr.dtype.0],
            fp8: [None, Some(Fp8Format::E4M3), Some(Fp8Format::E5M2)][dr.dtype.1],
            seqlen_q: sq,
            heads: hkv * group,
            heads_kv: hkv,
            d,
            cap,
            lens,
            leftpad,
            new: (new > 0).then_some(new),
            causal,
            window: (
                left.map_or(-1, |x| x as i64),
                right.map_or(-1, |x| x as i64),
            ),
            softcap: softcap.map(|s| s as f32 * 0.5),
            alibi,
            sink,
            // Rotary needs new keys and an even rotary_dim <= d.
            rotary: rotary
                .filter(|_| new > 0 && d >= 2)
                .map(|(x, inter)| (2 * (1 + frac(x as u16 * 257, d / 2 - 1)), inter)),
            store: [
                Store::Contiguous,
                Store::BatchIdx,
                Store::Gaps,
                Store::Paged(page),
            ][store],
            splits,
            isa: isa.map(|i| isas[i % isas.len()]),
            dist,
            seed: dr.values.1,
        }
    }

    proptest! {
        #![proptest_config(config(256))]

        #[test]
        fn any_decode_case_matches_the_reference(dr in draws()) {
            check_case(&case(&dr));
        }
    }

    /// One change to a valid call; most make it invalid.
    #[derive(Clone, Debug)]
    enum Change {
        Lens(usize, i32),
        LensCount(usize),
        Table(usize, i32),
        TableDims(usize, usize),
        BatchIdx(usize, i32),
        Leftpad(usize, i32),
        CuSeqlensQ(Vec<i32>),
        CuSeqlensKNew(Vec<i32>),
        KShape(usize, usize),
        KStride(usize, usize),
        VShape(usize, usize),
        QShape(usize, usize),
        NewKvShape(usize, usize),
        RotaryRows(usize, usize),
        Splits(usize),
        Window(i64, i64),
        Softcap(f32),
        Scale(f32),
        Dropout(f32),
        /// ALiBi on, with slope `.1` of the `[batch, heads]` slopes set to `.0`.
        Slope(usize, f32),
    }

    fn changes() -> impl Strategy<Value = Vec<Change>> {
        let one = prop_oneof![
            (0..4usize, i32s(-3..40)).prop_map(|(i, v)| Change::Lens(i, v)),
            (0..6usize).prop_map(Change::LensCount),
            (0..64usize, i32s(-3..40)).prop_map(|(i, v)| Change::Table(i, v)),
            (0..5usize, usizes(0..40)).prop_map(|(b, m)| Change::TableDims(b, m)),
            (0..4usize, i32s(-3..40)).prop_map(|(i, v)| Change::BatchIdx(i, v)),
            (0..4usize, i32s(-3..40)).prop_map(|(i, v)| Change::Leftpad(i, v)),
            prop::collection::vec(i32s(-3..40), 0..6).prop_map(Change::CuSeqlensQ),
            prop::collection::vec(i32s(-3..40), 0..6).prop_map(Change::CuSeqlensKNew),
            (0..5usize, usizes(0..40)).prop_map(|(d, v)| Change::KShape(d, v)),
            (0..5usize, usizes(0..40)).prop_map(|(d, v)| Change::KStride(d, v)),
            (0..5usize, usizes(0..40)).prop_map(|(d, v)| Change::VShape(d, v)),
            (0..5usize, usizes(0..40)).prop_map(|(d, v)| Change::QShape(d, v)),
            (0..5usize, usizes(0..40)).prop_map(|(d, v)| Change::NewKvShape(d, v)),
            (usizes(0..40), usizes(0..40)).prop_map(|(r, h)| Change::RotaryRows(r, h)),
            usizes(0..40).prop_map(Change::Splits),
            (i64s(-3..40), i64s(-3..40)).prop_map(|(l, r)| Change::Window(l, r)),
            float().prop_map(Change::Softcap),
            float().prop_map(Change::Scale),
            float().prop_map(Change::Dropout),
            (0..64usize, float()).prop_map(|(i, x)| Change::Slope(i, x)),
        ];
        prop::collection::vec(one, 1..=3)
    }

    /// `v[i % len] = x`, or `v` grown to `i + 1` entries when empty.
    fn set<T: Copy + Default>(v: &mut Vec<T>, i: usize, x: T) {
        if v.is_empty() {
            v.resize(i + 1, T::default());
        }
        let n = v.len();
        v[i % n] = x;
    }

    /// A call with the changes applied, on copies of the caches. It must not panic; when it is
    /// refused, both caches must be bit-identical to before.
    fn run_changed(c: &DCase, changes: &[Change]) {
        let bl = build(c);
        let (batch, sq, h, hkv, d) = (c.batch(), c.seqlen_q, c.heads, c.heads_kv, c.d);
        let mut lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
        let mut table = bl.map.table.clone();
        let (mut t_batch, mut t_blocks) = (batch, bl.map.max_blocks);
        let mut idx = bl.map.batch_idx.clone();
        let mut leftpad = bl.leftpad.clone();
        let (mut cu_q, mut cu_k_new) = (None, None);
        let (mut k_shape, mut k_strides) = (bl.map.shape.clone(), bl.map.strides.clone());
        let mut v_shape = bl.map.shape.clone();
        let mut q_shape = vec![batch, sq, h, d];
        let mut new_shape = vec![batch, c.seqlen_new(), hkv, d];
        let rot = c.rotary.map_or(0, |r| r.0);
        let mut ro_shape = vec![bl.seqlen_ro, rot / 2];
        let mut opts_changes = Vec::new();
        let mut slopes = (c.alibi || changes.iter().any(|ch| matches!(ch, Change::Slope(..))))
            .then(|| {
                let mut s = bl.alibi.clone();
                s.resize(batch * h, 0.5);
                s
            });
        for ch in changes {
            match ch.clone() {
                Change::Lens(i, v) => set(&mut lens, i, v),
                Change::LensCount(n) => lens.resize(n, 3),
                Change::Table(i, v) => set(&mut table, i, v),
                Change::TableDims(b, m) => (t_batch, t_blocks) = (b, m),
                Change::BatchIdx(i, v) => set(idx.get_or_insert_with(Vec::new), i, v),
                Change::Leftpad(i, v) => {
                    let lp = leftpad.get_or_insert_with(|| vec![0; batch]);
                    set(lp, i, v)
                }
                Change::CuSeqlensQ(v) => cu_q = Some(v),
                Change::CuSeqlensKNew(v) => cu_k_new = Some(v),
                Change::KShape(i, v) => set_dim(&mut k_shape, i, v),
                Change::KStride(i, v) => set_dim(&mut k_strides, i, v),
                Change::VShape(i, v) => set_dim(&mut v_shape, i, v),
                Change::QShape(i, v) => set_dim(&mut q_shape, i, v),
                Change::NewKvShape(i, v) => set_dim(&mut new_shape, i, v),
                Change::RotaryRows(r, hh) => ro_shape = vec![r, hh],
                Change::Slope(i, x) => {
                    let s = slopes.as_mut().expect("made for every Slope change");
                    let n = s.len();
                    s[i % n] = x;
                }
                other => opts_changes.push(other),
            }
        }
        let q_strides = flashattn::tensor::contiguous_strides(&q_shape);
        let new_strides = flashattn::tensor::contiguous_strides(&new_shape);
        let ro_strides = flashattn::tensor::contiguous_strides(&ro_shape);
        let mut opts = bl.opts(c);
        if let Store::Paged(_) = c.store {
            opts.block_table = Some(BlockTable::new(&table, t_batch, t_blocks));
        }
        opts.cache_batch_idx = idx.as_deref();
        opts.cache_leftpad = leftpad.as_deref();
        if let Some(s) = &slopes {
            opts.attn.alibi_slopes = Some(TensorRef::contiguous(s, &[batch, h]));
        }
        opts.cu_seqlens_q = cu_q.as_deref();
        opts.cu_seqlens_k_new = cu_k_new.as_deref();
        if let (Some((kb, vb)), Some(_)) = (
            bl.k_new
                .as_ref()
                .zip(bl.v_new.as_ref())
                .map(|(k, v)| (&k.1, &v.1)),
            opts.new_kv.as_ref(),
        ) {
            opts.new_kv = Some((
                TensorRef::from_slice(kb.as_slice(), &new_shape, &new_strides),
                TensorRef::from_slice(vb.as_slice(), &new_shape, &new_strides),
            ));
        }
        if let (Some((cos, sin)), Some(r)) = (&bl.cos_sin, opts.rotary.as_mut()) {
            r.cos = TensorRef::new(cos.as_slice(), &ro_shape, &ro_strides);
            r.sin = TensorRef::new(sin.as_slice(), &ro_shape, &ro_strides);
        }
        for ch in opts_changes {
            match ch {
                Change::Splits(n) => opts.num_splits = Some(n),
                Change::Window(l, r) => opts.attn.window = (l, r),
                Change::Softcap(x) => opts.attn.softcap = Some(x),
                Change::Scale(x) => opts.attn.softmax_scale = Some(x),
                Change::Dropout(x) => opts.attn.dropout_p = x,
                _ => unreachable!(),
            }
        }
        let q = TensorRef::from_slice(bl.qb.as_slice(), &q_shape, &q_strides);
        // The caches without their NaN poison: a changed call may read slots the case left
        // empty, and its result must still be free of NaN.
        let (k0, v0) = (without_nan(&bl.k_cache), without_nan(&bl.v_cache));
        let (mut kc, mut vc) = (k0.clone(), v0.clone());
        // v as the case lays it out (gaps included) unless its shape was changed.
        let v_strides = if v_shape == bl.map.shape {
            bl.map.strides.clone()
        } else {
            flashattn::tensor::contiguous_strides(&v_shape)
        };
        let res = {
            let mut k = TensorMut::new(slice_mut(&mut kc), &k_shape, &k_strides);
            let mut v = TensorMut::new(slice_mut(&mut vc), &v_shape, &v_strides);
            flash_attn_with_kvcache(&q, &mut k, &mut v, &lens, &opts)
        };
        match res {
            Err(e) => {
                assert!(!e.to_string().is_empty());
                assert_eq!(buf_bits(&kc), buf_bits(&k0), "k_cache changed: {e}");
                assert_eq!(buf_bits(&vc), buf_bits(&v0), "v_cache changed: {e}");
            }
            // Values in [-1, 1], rotated pairs up to sqrt(2): |q·k| <= 2 · head_dim.
            Ok(o) if !scores_may_overflow(opts.attn.softmax_scale, 2.0 * d as f64) => {
                assert_no_nan(&o)
            }
            Ok(_) => {}
        }
    }

    /// Small valid cases for [`run_changed`]: each store, appends, rotary, GQA.
    fn bases() -> impl Strategy<Value = DCase> {
        (0..4usize, any::<bool>(), 0..3usize, any::<u64>()).prop_map(|(store, rot, dt, seed)| {
            DCase {
                dtype: DTYPES[dt],
                heads: 4,
                heads_kv: 2,
                d: 8,
                seqlen_q: 2,
                new: Some(2),
                lens: vec![5, 0, 9],
                cap: 12,
                rotary: rot.then_some((4, false)),
                store: [
                    Store::Contiguous,
                    Store::BatchIdx,
                    Store::Gaps,
                    Store::Paged(4),
                ][store],
                seed,
                ..DCase::default()
            }
        })
    }

    /// LSE values for merges: ordinary ones, -inf (an empty partial), the f32 extremes, NaN and
    /// +inf (refused).
    fn lse_value() -> impl Strategy<Value = f32> {
        prop_oneof![
            4 => -30.0f32..30.0,
            1 => Just(f32::NEG_INFINITY),
            1 => Just(f32::INFINITY),
            1 => Just(f32::NAN),
            1 => Just(f32::MAX),
            1 => Just(-f32::MAX),
            1 => Just(87.0f32),
        ]
    }

    /// Partials of `[batch, seqlen_q, heads, d]` (or packed `[total, heads, d]`) with arbitrary
    /// LSEs, and an optional change of one partial's shape: the merge either refuses them or
    /// matches the f64 merge (out to 1e-5, lse to 1e-5 relative).
    fn run_merge(
        packed: bool,
        n: usize,
        dims: (usize, usize, usize),
        lses: &[f32],
        change: Option<(usize, usize, usize)>,
    ) {
        let (sq, h, d) = dims;
        let shape: Vec<usize> = if packed {
            vec![sq, h, d]
        } else {
            vec![1, sq, h, d]
        };
        let lse_shape: Vec<usize> = if packed { vec![h, sq] } else { vec![1, h, sq] };
        let rows = sq * h;
        let mut shapes = vec![(shape.clone(), lse_shape.clone()); n];
        if let (Some((p, dim, x)), true) = (change, n > 0) {
            let (s, l) = &mut shapes[p % n];
            let all = s.len() + l.len();
            match dim % all {
                i if i < s.len() => s[i] = x,
                i => l[i - s.len()] = x,
            }
        }
        let outs: Vec<Vec<f32>> = (0..n)
            .map(|p| {
                (0..rows * d)
                    .map(|i| ((i * 7 + p * 13) as f32 * 0.31).sin())
                    .collect()
            })
            .collect();
        let lse_vals: Vec<Vec<f32>> = (0..n)
            .map(|p| {
                (0..rows)
                    .map(|r| lses[(p * rows + r) % lses.len()])
                    .collect()
            })
            .collect();
        let views = |i: usize| -> Option<(TensorRef<'_>, TensorRef<'_>)> {
            let (s, l) = &shapes[i];
            let (ns, nl) = (s.iter().product::<usize>(), l.iter().product::<usize>());
            (ns <= outs[i].len() && nl <= lse_vals[i].len()).then(|| {
                (
                    TensorRef::contiguous(&outs[i][..ns], s),
                    TensorRef::contiguous(&lse_vals[i][..nl], l),
                )
            })
        };
        let Some(pairs) = (0..n).map(views).collect::<Option<Vec<_>>>() else {
            return; // a shape larger than its buffer: not a view one can build
        };
        let (o, l): (Vec<_>, Vec<_>) = pairs.into_iter().unzip();
        let Ok(m) = merge_attn_partials(&o, &l) else {
            return;
        };
        if shapes
            .iter()
            .any(|s| s != &(shape.clone(), lse_shape.clone()))
        {
            return; // accepted with another (consistent) shape: no panic is the property
        }
        let (mo, ml) = (m.out.to_f64_vec(), m.lse.to_f64_vec());
        for r in 0..rows {
            let (t, hh) = (r / h, r % h);
            let lse_at = hh * sq + t;
            let ls: Vec<f64> = (0..n).map(|p| lse_vals[p][lse_at] as f64).collect();
            let mx = ls.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let (want_lse, w): (f64, Vec<f64>) = if mx == f64::NEG_INFINITY {
                (mx, vec![0.0; n])
            } else {
                // Weights relative to the largest LSE (near f32::MAX, `mx + ln(sum)` rounds back
                // to `mx` even in f64).
                let sum: f64 = ls.iter().map(|x| (x - mx).exp()).sum();
                (
                    mx + sum.ln(),
                    ls.iter().map(|x| (x - mx).exp() / sum).collect(),
                )
            };
            let got_lse = ml[lse_at];
            if want_lse == f64::NEG_INFINITY {
                assert_eq!(got_lse, f64::NEG_INFINITY, "row {r}");
            } else {
                assert!(
                    (got_lse - want_lse).abs() <= 1e-5 * want_lse.abs().max(1.0),
                    "row {r}: lse {got_lse} want {want_lse}"
                );
            }
            for x in 0..d {
                let want: f64 = (0..n).map(|p| w[p] * outs[p][r * d + x] as f64).sum();
                let got = mo[r * d + x];
                assert!(
                    (got - want).abs() <= 1e-5,
                    "row {r}, {x}: out {got} want {want}"
                );
            }
        }
    }

    proptest! {
        #![proptest_config(config(512))]

        /// Arbitrary changes to a valid call (indices, lengths, shapes, strides, options, any
        /// integer or float including the extremes): never a panic, and a refused call writes
        /// nothing.
        #[test]
        fn changed_calls_fail_cleanly(c in bases(), changes in changes()) {
            run_changed(&c, &changes);
        }

        /// `merge_attn_partials` on any LSEs (and sometimes a partial of another shape):
        /// refused, or equal to the f64 merge; never a panic.
        #[test]
        fn merges_of_any_partials(
            packed in any::<bool>(),
            n in 0..5usize,
            dims in (1..6usize, 1..4usize, 1..9usize),
            lses in prop::collection::vec(lse_value(), 1..40),
            change in prop::option::weighted(0.2, (0..5usize, 0..7usize, 0..8usize)),
        ) {
            run_merge(packed, n, dims, &lses, change);
        }
    }
}

/// decode.cu (append, split, combine) compiled with g++ against `kernels/host_emulation.h` and run
/// with the launches the GPU path would make (`flashattn::cuda::decode_launch_description`), then
/// checked by `check_case_with` exactly as the CPU path: the caches afterwards and the result
/// against the f64 reference. As tests/cuda_emulated.rs for the forward: this checks the kernels'
/// indexing, paging, masking, rotary, splits and merge without a GPU, not their speed or the
/// hardware's own behaviour.
#[cfg(feature = "cuda")]
mod emulated {
    use super::*;
    use crate::common::emu::{bytes, from_bytes, have_compiler, Builds};
    use flashattn::cuda::{
        decode_launch_description, decode_launch_description_fp8, decode_launch_description_with,
        DecodeKernel, DecodeLaunch, GpuShape, KernelKey, KernelKind,
    };
    use flashattn::fp8::Fp8TensorRef;
    use std::process::Command;

    const DRIVER: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/cuda_emu/decode_driver.cpp"
    );
    const FP8_DRIVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cuda_emu/fp8_driver.cpp");
    /// The SM count the automatic split choice assumes (an H100 SXM's).
    const SM_COUNT: usize = 132;

    /// One binary per split-kernel variant, holding all three decode kernels (FA_DECODE_ENTRY 0).
    fn decode_builds() -> Builds {
        Builds::new(DRIVER, &[("FA_DECODE_ENTRY", "0")])
    }

    /// The launch numbers, in the order decode_driver.cpp reads them.
    fn params_text(d: &DecodeLaunch, k_len: usize, v_len: usize) -> String {
        let g = |g: (u32, u32, u32)| [g.0 as i64, g.1 as i64, g.2 as i64];
        let (ws_o, ws_lse) = d.workspace_len();
        let mut n: Vec<i64> = Vec::new();
        n.extend(g(d.split_grid()));
        n.extend(g(d.combine_grid()));
        n.extend(g(d.append_grid()));
        n.extend([
            d.split.smem_bytes() as i64,
            d.append.is_some() as i64,
            d.slopes.is_some() as i64,
            d.rot.is_some() as i64,
            d.batch as i64,
            d.heads as i64,
            d.heads_kv as i64,
            d.head_dim as i64,
            d.splits as i64,
        ]);
        n.extend(d.q_strides);
        n.extend(d.k_strides);
        n.extend(d.v_strides);
        n.extend(d.kn_strides);
        n.extend(d.vn_strides);
        n.extend([d.page_size as i64, d.max_blocks as i64]);
        let mut t: Vec<String> = n.iter().map(|x| x.to_string()).collect();
        t.push(format!("{:e}", d.softmax_scale));
        t.push(format!("{:e}", d.softcap));
        t.extend(
            [
                d.window.0 as i64,
                d.window.1 as i64,
                d.rot_half as i64,
                d.rot_interleaved as i64,
                d.rot_npos as i64,
                d.lse_head_stride,
                d.total_rows,
                d.vec_loads as i64,
                d.out_len as i64,
                d.lse_len as i64,
                ws_o as i64,
                ws_lse as i64,
                k_len as i64,
                v_len as i64,
                d.descale.is_some() as i64,
                d.e5m2 as i64,
                d.sink.is_some() as i64,
            ]
            .iter()
            .map(|x| x.to_string()),
        );
        t.join("\n")
    }

    /// FP8 bytes as the elements of their format.
    enum Fp8Elements {
        E4M3(Vec<F8E4M3>),
        E5M2(Vec<F8E5M2>),
    }

    fn fp8_view<'a>(e: &'a Fp8Elements, map: &CacheMap) -> Fp8TensorRef<'a> {
        match e {
            Fp8Elements::E4M3(x) => Fp8TensorRef::new(x, &map.shape, &map.strides),
            Fp8Elements::E5M2(x) => Fp8TensorRef::new(x, &map.shape, &map.strides),
        }
    }

    fn fp8_elements(b: &[u8], format: Fp8Format) -> Fp8Elements {
        match format {
            Fp8Format::E4M3 => Fp8Elements::E4M3(b.iter().map(|&x| F8E4M3::from_bits(x)).collect()),
            Fp8Format::E5M2 => Fp8Elements::E5M2(b.iter().map(|&x| F8E5M2::from_bits(x)).collect()),
        }
    }

    /// One call through the emulated kernels, on copies of the caches (FP8 caches with their
    /// factors when the case has them).
    fn call(builds: &mut Builds, bl: &Built, c: &DCase, tag: &str) -> CallResult {
        let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
        if let Some(f) = &bl.fp8 {
            return run_fp8(builds, &bl.q_view(c), bl, f, &lens, &bl.opts(c), tag);
        }
        run(builds, &bl.q_view(c), bl, &lens, &bl.opts(c), tag)
    }

    /// [`call`] through the tensor-core split kernel (the GPU path's default), which the case
    /// must allow (f16/bf16, aligned caches): a call that falls back to the CUDA-core kernel fails
    /// the test.
    fn call_tc(builds: &mut Builds, bl: &Built, c: &DCase, tag: &str) -> CallResult {
        let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
        run_with(
            builds,
            &bl.q_view(c),
            bl,
            &lens,
            &bl.opts(c),
            tag,
            DecodeKernel::TensorCore,
        )
    }

    /// A call on copies of `f`'s FP8 caches: the launches of
    /// `flashattn::cuda::flash_attn_with_kvcache_fp8`, run by the FA_FP8_CACHE build of the
    /// kernels; returns the caches afterwards as their raw values (as `Built::call`).
    fn run_fp8(
        builds: &mut Builds,
        q: &TensorRef,
        bl: &Built,
        f: &Fp8Caches,
        lens: &[i32],
        opts: &KvCacheOptions,
        tag: &str,
    ) -> CallResult {
        let descale = Descale::default().k(&f.k_descale).v(&f.v_descale);
        let d = {
            let (k, v) = (fp8_elements(&f.k, f.format), fp8_elements(&f.v, f.format));
            decode_launch_description_fp8(
                q,
                &fp8_view(&k, &bl.map),
                &fp8_view(&v, &bl.map),
                lens,
                &descale,
                opts,
                SM_COUNT,
            )
        };
        let values = |b: &[u8]| fp8_values(b, f.format);
        let d = match d {
            Ok(d) => d,
            Err(e) => return (Err(e), values(&f.k), values(&f.v)),
        };
        let (res, k, v) = execute(builds, q, &d, opts, (&f.k, &f.v), tag);
        (res, values(&k), values(&v))
    }

    /// A call with q and options of the caller's making, on copies of `bl`'s caches.
    fn run(
        builds: &mut Builds,
        q: &TensorRef,
        bl: &Built,
        lens: &[i32],
        opts: &KvCacheOptions,
        tag: &str,
    ) -> CallResult {
        run_with(builds, q, bl, lens, opts, tag, DecodeKernel::CudaCore)
    }

    /// [`run`] with the split kernel `kernel` (the tensor-core one must then be what runs).
    fn run_with(
        builds: &mut Builds,
        q: &TensorRef,
        bl: &Built,
        lens: &[i32],
        opts: &KvCacheOptions,
        tag: &str,
        kernel: DecodeKernel,
    ) -> CallResult {
        let dtype = q.dtype();
        let (kc, vc) = (bl.k_cache.clone(), bl.v_cache.clone());
        let kv = TensorRef::from_slice(kc.as_slice(), &bl.map.shape, &bl.map.strides);
        let vv = TensorRef::from_slice(vc.as_slice(), &bl.map.shape, &bl.map.strides);
        let gpu = GpuShape {
            sm_count: SM_COUNT,
            ..GpuShape::HOPPER
        };
        let d = match decode_launch_description_with(q, &kv, &vv, lens, opts, gpu, kernel) {
            Ok(d) => d,
            Err(e) => return (Err(e), kc, vc),
        };
        if kernel == DecodeKernel::TensorCore {
            assert!(d.split.decode_tc(), "{tag}: not the tensor-core kernel");
        }
        let (kb, vb) = (bytes(kc.as_slice()), bytes(vc.as_slice()));
        let (res, k_after, v_after) = execute(builds, q, &d, opts, (&kb, &vb), tag);
        (
            res,
            from_bytes(&k_after, dtype),
            from_bytes(&v_after, dtype),
        )
    }

    /// Runs the launches `d` of a call with q, `opts` and caches of these bytes; returns the
    /// result and the caches' bytes afterwards.
    fn execute(
        builds: &mut Builds,
        q: &TensorRef,
        d: &DecodeLaunch,
        opts: &KvCacheOptions,
        (kb, vb): (&[u8], &[u8]),
        tag: &str,
    ) -> (flashattn::Result<AttnOutput>, Vec<u8>, Vec<u8>) {
        let dtype = q.dtype();
        let dir = common::emu::case_dir("decode", tag);
        std::fs::create_dir_all(&dir).unwrap();
        let put = |name: &str, b: Vec<u8>| std::fs::write(dir.join(name), b).unwrap();
        // Cache lengths in elements (FP8: one byte each).
        let elem = match (d.descale.is_some(), dtype) {
            (true, _) => 1,
            (false, DType::F32) => 4,
            (false, _) => 2,
        };
        let (k_len, v_len) = (kb.len() / elem, vb.len() / elem);
        put("params.txt", params_text(d, k_len, v_len).into_bytes());
        put("q.bin", bytes(q.data()));
        put("k.bin", kb.to_vec());
        put("v.bin", vb.to_vec());
        for (name, t) in [("descale.bin", &d.descale), ("sink.bin", &d.sink)] {
            if let Some(t) = t {
                put(name, t.iter().flat_map(|x| x.to_le_bytes()).collect());
            }
        }
        put(
            "table.bin",
            d.table.iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
        put(
            "pages.bin",
            d.pages.iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
        if let Some((kn, vn)) = &opts.new_kv {
            put("kn.bin", bytes(kn.data()));
            put("vn.bin", bytes(vn.data()));
        }
        if let Some(s) = &d.slopes {
            put(
                "slopes.bin",
                s.iter().flat_map(|x| x.to_le_bytes()).collect(),
            );
        }
        if let Some(r) = &d.rot {
            put("rot.bin", r.iter().flat_map(|x| x.to_le_bytes()).collect());
        }
        let exe = builds.get(&d.split, &[]);
        common::emu::run_exe(&exe, &dir, tag);
        let read = |name: &str| std::fs::read(dir.join(name)).unwrap();
        let out = from_bytes(&read("out.bin"), dtype);
        let lse = from_bytes(&read("lse.bin"), DType::F32);
        let (k_after, v_after) = (read("k_out.bin"), read("v_out.bin"));
        let _ = std::fs::remove_dir_all(&dir);
        let res = AttnOutput {
            out: Tensor::from_buffer(out, &d.out_shape).expect("out length"),
            lse: Tensor::from_buffer(lse, &d.lse_shape).expect("lse length"),
        };
        (Ok(res), k_after, v_after)
    }

    /// Per dtype, four variants of the split kernel (head dims 32, 64, 128; masked or not;
    /// softcap; ALiBi) over every cache store, appends with and without rotary (both pair
    /// layouts), left padding, GQA, MQA and MHA, several query tokens, huge logits and split
    /// counts; run under emulation here and on the GPU by `gpu` below.
    pub(super) fn kernel_cases(dtype: DType) -> Vec<DCase> {
        vec![
            // The decode benchmark shape in small: 32 heads over 8, d 128, causal, paged, left padding.
            DCase {
                dtype,
                heads: 32,
                heads_kv: 8,
                d: 128,
                cap: 240,
                lens: vec![203],
                leftpad: Some(vec![29]),
                store: Store::Paged(16),
                splits: Some(3),
                seed: 1,
                ..DCase::default()
            },
            // No mask, softcap and ALiBi, rotary (GPT-NeoX pairs), three query tokens, left
            // padding, learnable sinks.
            DCase {
                dtype,
                heads: 6,
                heads_kv: 2,
                d: 59,
                seqlen_q: 3,
                new: Some(3),
                lens: vec![63, 113],
                leftpad: Some(vec![10, 37]),
                cap: 120,
                causal: false,
                softcap: Some(30.0),
                alibi: true,
                rotary: Some((32, false)),
                sink: true,
                seed: 2,
                ..DCase::default()
            },
            // A two-sided window, ALiBi, MQA, interleaved rotary, cache_batch_idx, an empty cache
            // (rows that see no key, with sinks: out 0, lse = the sink).
            DCase {
                dtype,
                heads: 4,
                heads_kv: 1,
                d: 40,
                seqlen_q: 2,
                new: Some(2),
                lens: vec![1, 0, 150],
                cap: 160,
                causal: false,
                window: (5, 2),
                alibi: true,
                rotary: Some((40, true)),
                store: Store::BatchIdx,
                splits: Some(2),
                sink: true,
                seed: 3,
                ..DCase::default()
            },
            // MHA, a left window, strided caches with gaps, no append, huge logits, and a
            // paged cache with pages of 7 rows (split counts below).
            DCase {
                dtype,
                heads: 8,
                heads_kv: 8,
                d: 16,
                new: None,
                lens: vec![90, 17],
                cap: 100,
                causal: false,
                window: (17, -1),
                store: Store::Gaps,
                dist: Dist::Huge(8.0),
                splits: Some(7),
                seed: 4,
                ..DCase::default()
            },
        ]
    }

    /// [`kernel_cases`], plus split counts 1, 5 and automatic over pages of 7 rows.
    #[test]
    fn decode_kernels_against_reference() {
        if !have_compiler() {
            return;
        }
        let mut builds = decode_builds();
        let mut n = 0;
        for dtype in DTYPES {
            let cases = kernel_cases(dtype);
            for (i, c) in cases.iter().enumerate() {
                let tag = format!("{dtype}_{i}");
                check_case_with(c, |bl, c| call(&mut builds, bl, c, &tag));
                n += 1;
            }
            // Split counts, automatic included, and a paged cache with small odd pages.
            for (j, splits) in [None, Some(1), Some(5)].into_iter().enumerate() {
                let c = DCase {
                    splits,
                    store: Store::Paged(7),
                    ..cases[0].clone()
                };
                let tag = format!("{dtype}_s{j}");
                check_case_with(&c, |bl, c| call(&mut builds, bl, c, &tag));
                n += 1;
            }
        }
        eprintln!("{n} decode cases emulated, {} kernel builds", builds.len());
    }

    /// Cases for the tensor-core split kernel (f16/bf16, head_dim and cache strides multiples of
    /// 8): [`kernel_cases`] with aligned head dims (64 and 40 padded to 64; 256 on a contiguous
    /// cache for the fourth), several row blocks (GQA 8 with 3 query tokens: 24 rows), splits
    /// automatic, 1, 5 and more than the keys over pages of 7 rows.
    fn tc_cases(dtype: DType) -> Vec<DCase> {
        let mut k = kernel_cases(dtype);
        k[1].d = 64;
        k[3].d = 256;
        k[3].store = Store::Contiguous;
        let mut cases = k.clone();
        cases.push(DCase {
            heads: 16,
            heads_kv: 2,
            seqlen_q: 3,
            new: Some(3),
            d: 96,
            lens: vec![130, 71],
            leftpad: Some(vec![29, 3]),
            cap: 140,
            causal: true,
            softcap: Some(20.0),
            store: Store::Paged(32),
            seed: 5,
            ..k[0].clone()
        });
        for splits in [None, Some(1), Some(5), Some(100)] {
            cases.push(DCase {
                splits,
                store: Store::Paged(7),
                ..k[0].clone()
            });
        }
        cases
    }

    /// The tensor-core split kernel (decode.cu, DECODE_TC) on [`tc_cases`], checked as every
    /// other decode call.
    #[test]
    fn tensor_core_decode_kernel_against_reference() {
        if !have_compiler() {
            return;
        }
        let mut builds = decode_builds();
        let mut n = 0;
        for dtype in [DType::F16, DType::BF16] {
            for (i, c) in tc_cases(dtype).iter().enumerate() {
                let tag = format!("tc_{dtype}_{i}");
                check_case_with(c, |bl, c| call_tc(&mut builds, bl, c, &tag));
                n += 1;
            }
        }
        eprintln!(
            "{n} tensor-core decode cases emulated, {} kernel builds",
            builds.len()
        );
    }

    /// [`empty_split_cases`]: more splits than keys, the last ones empty and starting at the end
    /// of a full cache.
    #[test]
    fn empty_splits_at_a_full_cache() {
        if !have_compiler() {
            return;
        }
        let mut builds = decode_builds();
        for dtype in DTYPES {
            for (i, c) in empty_split_cases(dtype).iter().enumerate() {
                let tag = format!("{dtype}_empty{i}");
                check_case_with(c, |bl, c| call(&mut builds, bl, c, &tag));
            }
        }
    }

    /// The decode property test's draws (`properties::draws`: every option, FP8 caches, any
    /// store and split count) through the kernels, checked as on the CPU.
    #[test]
    fn any_decode_case_on_the_kernels() {
        use proptest::test_runner::TestRunner;
        if !have_compiler() {
            return;
        }
        let builds = std::cell::RefCell::new(decode_builds());
        let mut runner = TestRunner::new(crate::common::props::config(24));
        runner
            .run(&super::properties::draws(), |dr| {
                let c = super::properties::case(&dr);
                check_case_with(&c, |bl, c| call(&mut builds.borrow_mut(), bl, c, "prop"));
                Ok(())
            })
            .unwrap();
        eprintln!("{} kernel builds", builds.borrow().len());
    }

    /// FP8 caches (`flashattn::cuda::flash_attn_with_kvcache_fp8`'s launches): [`kernel_cases`]
    /// with caches in e4m3 and e5m2 and factors per (sequence, kv head), q in every dtype; the
    /// same checks as the CPU's FP8 path (appended bytes, untouched bytes, result against the
    /// f64 reference on the dequantised caches).
    #[test]
    fn fp8_decode_kernels_against_reference() {
        if !have_compiler() {
            return;
        }
        let mut builds = decode_builds();
        let mut n = 0;
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for dtype in DTYPES {
                for (i, c) in kernel_cases(dtype).into_iter().enumerate() {
                    let c = DCase {
                        fp8: Some(format),
                        ..c
                    };
                    let tag = format!("{format}_{dtype}_{i}");
                    check_case_with(&c, |bl, c| call(&mut builds, bl, c, &tag));
                    n += 1;
                }
            }
        }
        eprintln!(
            "{n} FP8 decode cases emulated, {} kernel builds",
            builds.len()
        );
    }

    /// decode.cu's FP8 conversions against the `float8` crate's: all 256 bytes of each format
    /// widened (bit for bit; NaN as NaN), and quantisation (`Fp8Format::quantise`, round to
    /// nearest even, saturating) of values around every representable value and midpoint of
    /// both formats, subnormals, zeros of both signs, beyond the largest finite value, infinities
    /// and NaN.
    #[test]
    fn fp8_conversions_match_the_cpu() {
        if !have_compiler() {
            return;
        }
        let mut inputs = vec![
            0.0,
            -0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            1e-30,
            -1e-30,
            1e30,
            f64::MIN_POSITIVE,
        ];
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let vals = fp8_values(&(0..=255u8).collect::<Vec<_>>(), format);
            let mut v: Vec<f64> = buf_f64(&vals)
                .into_iter()
                .filter(|x| x.is_finite())
                .collect();
            v.sort_by(f64::total_cmp);
            for w in v.windows(2) {
                let mid = (w[0] + w[1]) / 2.0;
                for x in [
                    w[0],
                    mid,
                    w[0] + (mid - w[0]) * 0.999,
                    mid + (w[1] - mid) * 1e-3,
                ] {
                    inputs.extend([x, -x]);
                }
            }
            let max = format.max() as f64;
            inputs.extend([max * 1.03, max * 1.0625, max * 1.2, -max * 1.07, max * 4.0]);
        }
        let mut rng = common::rng(77);
        inputs.extend((0..2000).map(|_| rng.gen_range(-600.0..600.0f64)));
        // Any FP8 build of decode.cu holds the conversions: the f32 split kernel's.
        let key = KernelKey {
            kind: KernelKind::DecodeSplit,
            fp8: true,
            ..KernelKey::decode_helper(KernelKind::DecodeCombine, DType::F32)
        };
        let mut builds = Builds::new(FP8_DRIVER, &[("FA_DECODE_ENTRY", "0")]);
        let exe = builds.get(&key, &[]);
        let dir = common::emu::case_dir("fp8conv", "");
        std::fs::create_dir_all(&dir).unwrap();
        let raw: Vec<u8> = inputs.iter().flat_map(|x| x.to_le_bytes()).collect();
        std::fs::write(dir.join("in.bin"), raw).unwrap();
        let o = Command::new(&exe)
            .arg(&dir)
            .output()
            .expect("run the driver");
        assert!(o.status.success(), "fp8 driver failed: {o:?}");
        let widened = from_bytes(&std::fs::read(dir.join("widened.bin")).unwrap(), DType::F32);
        let quantised = std::fs::read(dir.join("quantised.bin")).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let widened = buf_f64(&widened);
        let n = inputs.len();
        for (f, format) in [Fp8Format::E4M3, Fp8Format::E5M2].into_iter().enumerate() {
            let want = buf_f64(&fp8_values(&(0..=255u8).collect::<Vec<_>>(), format));
            for b in 0..256 {
                let (got, want) = (widened[256 * f + b], want[b]);
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{format} byte {b:#04x}: widened to {got}, want {want}"
                );
            }
            for (i, &x) in inputs.iter().enumerate() {
                let (got, want) = (quantised[n * f + i], format.quantise(x));
                let nan = |b: u8| buf_f64(&fp8_values(&[b], format))[0].is_nan();
                assert!(
                    got == want || (nan(got) && nan(want)),
                    "{format}: {x:e} quantised to {got:#04x}, want {want:#04x}"
                );
            }
        }
        eprintln!("{} values quantised, 512 bytes widened", 2 * n);
    }

    /// Packed queries of different lengths (`cu_seqlens_q`, two rows after the last sequence)
    /// over every cache store, two of them with packed new keys (`cu_seqlens_k_new`): the
    /// emulated kernels against the CPU path (itself checked against the reference in
    /// `packed_queries_match_per_sequence_calls`), the caches afterwards bit for bit, the rows
    /// after the last sequence exactly 0 with lse -inf.
    #[test]
    fn packed_queries_and_new_keys_match_the_cpu() {
        packed_against_the_cpu(false);
    }

    /// The same on FP8 caches (e4m3 and e5m2 in turn, q in every dtype, factors per (sequence,
    /// kv head)), against the CPU's FP8 path: the caches' bytes afterwards identical.
    #[test]
    fn fp8_packed_queries_and_new_keys_match_the_cpu() {
        packed_against_the_cpu(true);
    }

    fn packed_against_the_cpu(fp8: bool) {
        if !have_compiler() {
            return;
        }
        let mut builds = decode_builds();
        let q_lens = [3usize, 0, 1, 6, 2, 4];
        let new_lens = [1usize, 0, 2, 1, 0, 3];
        let total = q_lens.iter().sum::<usize>() + 2;
        let total_new = new_lens.iter().sum::<usize>() + 1;
        let (cu, cu_new) = (cumulative(&q_lens), cumulative(&new_lens));
        let mut n = 0;
        for dtype in DTYPES {
            for mi in 0..4 {
                n += 1;
                let seed = if fp8 { 2900 } else { 1900 } + n as u64;
                let c = DCase {
                    fp8: fp8.then_some([Fp8Format::E4M3, Fp8Format::E5M2][n % 2]),
                    ..packed_case(dtype, mi, n, seed)
                };
                let bl = build(&c);
                let (h, hkv, d) = (c.heads, c.heads_kv, c.d);
                let mut rng = common::rng(c.seed ^ 0xbeef);
                let qb = to_buffer(&values(&mut rng, total * h * d, Dist::Normal), dtype);
                let knb = to_buffer(&values(&mut rng, total_new * hkv * d, Dist::Normal), dtype);
                let vnb = to_buffer(&values(&mut rng, total_new * hkv * d, Dist::Normal), dtype);
                let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
                let mut opts = bl.opts(&c).cu_seqlens_q(&cu);
                // New keys on the stores whose every row has room (the paged case's block
                // table maps only the pages its cached keys use).
                let appends = mi >= 2;
                if appends {
                    opts = opts.cu_seqlens_k_new(&cu_new).new_kv(
                        view_of(&knb, &[total_new, hkv, d]),
                        view_of(&vnb, &[total_new, hkv, d]),
                    );
                }
                let q = view_of(&qb, &[total, h, d]);
                let tag = format!("packed_{}{n}", if fp8 { "fp8_" } else { "" });
                // Both paths on copies of the caches; the caches afterwards as values.
                let ((emu, ke, ve), (cpu, kc, vc)) = match &bl.fp8 {
                    Some(f) => {
                        let emu = run_fp8(&mut builds, &q, &bl, f, &lens, &opts, &tag);
                        let (mut kc, mut vc) = (f.k.clone(), f.v.clone());
                        let descale = Descale::default().k(&f.k_descale).v(&f.v_descale);
                        let map = (f.format, &bl.map);
                        let cpu = call_fp8(&q, (&mut kc, &mut vc), map, &lens, &descale, &opts);
                        let values = |b: &[u8]| fp8_values(b, f.format);
                        (emu, (cpu, values(&kc), values(&vc)))
                    }
                    None => {
                        let emu = run(&mut builds, &q, &bl, &lens, &opts, &tag);
                        let (mut kc, mut vc) = (bl.k_cache.clone(), bl.v_cache.clone());
                        let cpu = {
                            let (sh, st) = (&bl.map.shape, &bl.map.strides);
                            let mut k = TensorMut::new(slice_mut(&mut kc), sh, st);
                            let mut v = TensorMut::new(slice_mut(&mut vc), sh, st);
                            flash_attn_with_kvcache(&q, &mut k, &mut v, &lens, &opts)
                        };
                        (emu, (cpu, kc, vc))
                    }
                };
                let emu = emu.unwrap_or_else(|e| panic!("{c:?}: {e}"));
                let cpu = cpu.unwrap();
                let what = format!("{c:?} packed, new keys {appends}");
                assert_eq!(buf_bits(&ke), buf_bits(&kc), "{what}: k_cache");
                assert_eq!(buf_bits(&ve), buf_bits(&vc), "{what}: v_cache");
                if appends {
                    assert_ne!(
                        buf_bits(&ke),
                        buf_bits(&bl.k_cache),
                        "{what}: nothing appended"
                    );
                }
                assert_eq!(emu.out.shape(), cpu.out.shape());
                assert_eq!(emu.lse.shape(), cpu.lse.shape());
                close(&cpu, &emu, dtype, &what);
                let (out, lse) = (emu.out.to_f64_vec(), emu.lse.to_f64_vec());
                assert!(out.iter().all(|x| x.is_finite()), "{what}: NaN in out");
                for r in cu[q_lens.len()] as usize..total {
                    assert!(out[r * h * d..(r + 1) * h * d].iter().all(|&x| x == 0.0));
                    assert!((0..h).all(|hh| lse[hh * total + r] == f64::NEG_INFINITY));
                }
            }
        }
    }

    /// The tensor-core split kernel is chosen only when asked for and when the call allows it
    /// (f16/bf16, head_dim and both caches' strides multiples of 8), and its automatic split
    /// count fills one wave of the CTAs its shared memory lets an SM hold (3 at head_dim 128 on a
    /// Hopper's 227 KiB, against 4 of the CUDA-core kernel).
    #[test]
    fn tensor_core_kernel_choice() {
        let gpu = GpuShape {
            sm_count: 8,
            ..GpuShape::HOPPER
        };
        let describe = |c: &DCase, gpu, kernel| {
            let bl = build(c);
            let kv = TensorRef::from_slice(bl.k_cache.as_slice(), &bl.map.shape, &bl.map.strides);
            let vv = TensorRef::from_slice(bl.v_cache.as_slice(), &bl.map.shape, &bl.map.strides);
            let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
            decode_launch_description_with(&bl.q_view(c), &kv, &vv, &lens, &bl.opts(c), gpu, kernel)
                .unwrap()
        };
        let c = DCase {
            dtype: DType::BF16,
            d: 128,
            lens: vec![4096],
            cap: 4100,
            splits: None,
            ..DCase::default()
        };
        let tc = describe(&c, gpu, DecodeKernel::TensorCore);
        assert!(tc.split.decode_tc());
        assert!(tc.split.name().contains("_tc"), "{}", tc.split.name());
        // 8 SMs x 3 CTAs over 2 kv heads; the CUDA-core kernel 8 x 4.
        assert_eq!(tc.splits, 12);
        let cc = describe(&c, gpu, DecodeKernel::CudaCore);
        assert!(!cc.split.decode_tc());
        assert_eq!(cc.splits, 16);
        // A device whose blocks may have less shared memory than the kernel's 70 KiB at d = 128
        // keeps the CUDA-core kernel.
        let small = GpuShape {
            smem_optin: 64 * 1024,
            ..gpu
        };
        assert!(!describe(&c, small, DecodeKernel::TensorCore)
            .split
            .decode_tc());
        for c in [
            DCase {
                dtype: DType::F32,
                ..c.clone()
            },
            DCase {
                d: 124,
                ..c.clone()
            },
            DCase {
                store: Store::Gaps,
                ..c.clone()
            },
        ] {
            assert!(
                !describe(&c, gpu, DecodeKernel::TensorCore)
                    .split
                    .decode_tc(),
                "{c:?}"
            );
        }
    }

    /// Invalid calls are refused before any launch is described (the GPU path validates with the
    /// same function, before anything is queued).
    #[test]
    fn bad_input_is_refused_before_launch() {
        let c = DCase {
            lens: vec![80],
            new: Some(1),
            cap: 80,
            ..DCase::default()
        };
        let bl = build(&c);
        let kv = TensorRef::from_slice(bl.k_cache.as_slice(), &bl.map.shape, &bl.map.strides);
        let vv = TensorRef::from_slice(bl.v_cache.as_slice(), &bl.map.shape, &bl.map.strides);
        let err = decode_launch_description(&bl.q_view(&c), &kv, &vv, &[80], &bl.opts(&c), 132)
            .unwrap_err();
        assert_kind!(err.kind(), ErrorKind::CacheOverflow { .. });
        let c = DCase {
            splits: Some(flashattn::decode::MAX_NUM_SPLITS + 1),
            ..DCase::default()
        };
        let bl = build(&c);
        let kv = TensorRef::from_slice(bl.k_cache.as_slice(), &bl.map.shape, &bl.map.strides);
        let vv = TensorRef::from_slice(bl.v_cache.as_slice(), &bl.map.shape, &bl.map.strides);
        let err = decode_launch_description(&bl.q_view(&c), &kv, &vv, &[50], &bl.opts(&c), 132)
            .unwrap_err();
        assert_kind!(err.kind(), ErrorKind::NumSplits { num_splits: 257 });
        // FP8 caches: the CPU's FP8 checks, before any launch is described.
        let c = DCase {
            fp8: Some(Fp8Format::E4M3),
            ..DCase::default()
        };
        let bl = build(&c);
        let f = bl.fp8.as_ref().unwrap();
        let (k4, v4) = (fp8_elements(&f.k, f.format), fp8_elements(&f.v, f.format));
        let v5 = fp8_elements(&f.v, Fp8Format::E5M2);
        let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
        let (q, opts, map) = (bl.q_view(&c), bl.opts(&c), &bl.map);
        let describe = |v: &Fp8Elements, d: &Descale| {
            let (k, v) = (fp8_view(&k4, map), fp8_view(v, map));
            decode_launch_description_fp8(&q, &k, &v, &lens, d, &opts, 132)
        };
        let good = Descale::default().k(&f.k_descale).v(&f.v_descale);
        let err = describe(&v5, &good).unwrap_err();
        assert_kind!(err.kind(), ErrorKind::Fp8CacheFormat { .. });
        let err = describe(&v4, &good.q(&[1.0])).unwrap_err();
        assert_kind!(err.kind(), ErrorKind::DescaleUnused { .. });
        let err = describe(&v4, &Descale::default().k(&[1.0, 2.0, 3.0])).unwrap_err();
        assert_kind!(err.kind(), ErrorKind::DescaleLength { .. });
        let err = describe(&v4, &Descale::default().v(&[f32::NAN])).unwrap_err();
        assert_kind!(err.kind(), ErrorKind::DescaleValue { .. });
        assert!(describe(&v4, &good).is_ok());
    }
}

/// The CUDA decode path on a GPU, on the cases the emulation runs, with the same checks (the
/// caches afterwards, the result against the f64 reference). Without a GPU it says why it skips.
#[cfg(feature = "cuda")]
mod gpu {
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
        if let Some(f) = &bl.fp8 {
            let mut k = upload_fp8(dev, &f.k, f.format, &bl.map);
            let mut v = upload_fp8(dev, &f.v, f.format, &bl.map);
            let res = cuda::flash_attn_with_kvcache_fp8(
                dev,
                &q,
                &mut k,
                &mut v,
                &lens,
                new.as_ref().map(|(a, b)| (a, b)),
                &Descale::default().k(&f.k_descale).v(&f.v_descale),
                &opts,
            )
            .map(host);
            return (res, download_fp8(dev, &k), download_fp8(dev, &v));
        }
        let mut k = upload(dev, &bl.k_cache, sh, st);
        let mut v = upload(dev, &bl.v_cache, sh, st);
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
}

// ---------------------------------------------------------------------------------------------
// FP8 caches
// ---------------------------------------------------------------------------------------------

/// FP8 caches (`flash_attn_with_kvcache_fp8`), both formats, q in every dtype, on every ISA of
/// this CPU: every store, masks, softcap, ALiBi, rotary appends, GQA/MQA, leftpad, several tokens
/// per step, split counts, awkward head dims; the appended bytes and out/lse checked as above on
/// the dequantised caches.
#[test]
fn fp8_caches_against_reference() {
    let mut n = 0;
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        for isa in flashattn::simd::available() {
            for dtype in DTYPES {
                n += 1;
                let seed = 9000 + n;
                let base = DCase {
                    dtype,
                    isa: Some(isa),
                    fp8: Some(format),
                    seed,
                    ..DCase::default()
                };
                let cases = [
                    // The decode benchmark shape, small: one token, GQA 4, d = 128.
                    DCase {
                        heads: 32,
                        heads_kv: 8,
                        d: 128,
                        lens: vec![300],
                        cap: 320,
                        ..base.clone()
                    },
                    DCase {
                        d: 59,
                        heads: 12,
                        heads_kv: 3,
                        lens: vec![203, 64],
                        new: Some(2),
                        seqlen_q: 2,
                        cap: 210,
                        alibi: true,
                        softcap: Some(5.0),
                        splits: Some(3),
                        store: Store::Paged(16),
                        ..base.clone()
                    },
                    DCase {
                        d: 40,
                        heads: 6,
                        heads_kv: 1,
                        lens: vec![113, 1, 63],
                        cap: 130,
                        rotary: Some((40, false)),
                        store: Store::Gaps,
                        window: (17, -1),
                        causal: false,
                        ..base.clone()
                    },
                    DCase {
                        d: 111,
                        heads: 4,
                        heads_kv: 4,
                        lens: vec![97, 40],
                        leftpad: Some(vec![9, 0]),
                        new: Some(3),
                        seqlen_q: 3,
                        cap: 101,
                        rotary: Some((64, true)),
                        store: Store::BatchIdx,
                        ..base.clone()
                    },
                    DCase {
                        d: 256,
                        heads: 8,
                        heads_kv: 2,
                        lens: vec![61],
                        new: None,
                        cap: 70,
                        store: Store::Paged(5),
                        splits: Some(2),
                        dist: Dist::Huge(30.0),
                        ..base.clone()
                    },
                    // Gaps between kv heads: each key's heads widened one by one.
                    DCase {
                        d: 33,
                        heads: 6,
                        heads_kv: 3,
                        lens: vec![45, 70],
                        new: Some(2),
                        cap: 80,
                        store: Store::Gaps,
                        ..base.clone()
                    },
                    // Many rows per kv head (MQA, 4 tokens): the outer-product score kernels.
                    DCase {
                        d: 64,
                        heads: 16,
                        heads_kv: 1,
                        lens: vec![150],
                        new: Some(4),
                        seqlen_q: 4,
                        cap: 160,
                        ..base.clone()
                    },
                ];
                for c in &cases {
                    check_case(c);
                }
            }
        }
    }
    assert!(n >= 6, "{n} combinations");
}

/// FP8 calls split over 1, 2, 5 and 16 key ranges agree up to rounding, and paged FP8 caches
/// give what contiguous ones give.
#[test]
fn fp8_splits_and_pages_agree() {
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        let base = DCase {
            dtype: DType::BF16,
            heads: 8,
            heads_kv: 2,
            d: 64,
            lens: vec![700, 333],
            cap: 720,
            fp8: Some(format),
            seed: 77,
            ..DCase::default()
        };
        let one = check_case(&DCase {
            splits: Some(1),
            ..base.clone()
        });
        for splits in [2, 5, 16] {
            let r = check_case(&DCase {
                splits: Some(splits),
                ..base.clone()
            });
            close(&one, &r, DType::BF16, &format!("{format} splits {splits}"));
        }
        for ps in [16, 7] {
            let r = check_case(&DCase {
                store: Store::Paged(ps),
                splits: Some(1),
                ..base.clone()
            });
            close(&one, &r, DType::BF16, &format!("{format} page size {ps}"));
        }
    }
}

/// FP8-specific bad input: mismatched cache formats, a q descale, bad factor lists, new keys
/// not in q's dtype; each a typed error, and the caches untouched.
#[test]
fn fp8_bad_input_is_a_typed_error_and_writes_nothing() {
    let c = DCase {
        dtype: DType::BF16,
        fp8: Some(Fp8Format::E4M3),
        ..DCase::default()
    };
    let bl = build(&c);
    let f = bl.fp8.as_ref().unwrap();
    let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
    let q = bl.q_view(&c);
    let opts = bl.opts(&c);
    let good = Descale::default().k(&f.k_descale).v(&f.v_descale);
    let run = |descale: &Descale, opts: &KvCacheOptions| {
        let (mut k, mut v) = (f.k.clone(), f.v.clone());
        let r = call_fp8(
            &q,
            (&mut k, &mut v),
            (f.format, &bl.map),
            &lens,
            descale,
            opts,
        );
        let kind = r.expect_err("bad input accepted").kind().clone();
        assert!(
            k == f.k && v == f.v,
            "a rejected call wrote the caches: {kind:?}"
        );
        kind
    };
    assert_kind!(
        run(&good.q(&[1.0]), &opts),
        ErrorKind::DescaleUnused {
            tensor: "q_descale"
        }
    );
    assert_kind!(
        run(&Descale::default().k(&[1.0, 2.0, 3.0]), &opts),
        ErrorKind::DescaleLength {
            tensor: "k_descale",
            got: 3,
            batch: 1,
            heads_kv: 2
        }
    );
    assert_kind!(
        run(&Descale::default().v(&[1.0, f32::NAN]), &opts),
        ErrorKind::DescaleValue {
            tensor: "v_descale",
            index: 1,
            ..
        }
    );
    assert_kind!(
        run(&Descale::default().k(&[0.0]), &opts),
        ErrorKind::DescaleValue {
            tensor: "k_descale",
            index: 0,
            ..
        }
    );
    // softmax_scale · k_descale overflows f32.
    let big = bl.opts(&c).attn(bl.attn_opts(&c).softmax_scale(4.0));
    assert_kind!(
        run(&Descale::default().k(&[f32::MAX]), &big),
        ErrorKind::Scale { .. }
    );
    // v_descale times the format's largest value leaves f32; so does a score of a unit q
    // against the largest key.
    assert_kind!(
        run(&Descale::default().v(&[1e36]), &opts),
        ErrorKind::DescaleRange { .. }
    );
    assert_kind!(
        run(&Descale::default().k(&[1e36]), &opts),
        ErrorKind::DescaleRange { .. }
    );
    // New keys in another dtype than q.
    let kn: Vec<f32> = vec![0.5; c.heads_kv * c.d];
    let shape = [1, 1, c.heads_kv, c.d];
    let other = bl.opts(&c).new_kv(
        TensorRef::contiguous(&kn, &shape),
        TensorRef::contiguous(&kn, &shape),
    );
    assert_kind!(
        run(&good, &other),
        ErrorKind::DType {
            tensor: "k_new",
            ..
        }
    );
    // An append past the capacity.
    let (mut k, mut v) = (f.k.clone(), f.v.clone());
    let full = [c.cap as i32];
    let r = call_fp8(
        &q,
        (&mut k, &mut v),
        (f.format, &bl.map),
        &full,
        &good,
        &opts,
    );
    assert!(r.is_err() && k == f.k && v == f.v);
    // Caches of two formats.
    let mut k8: Vec<F8E4M3> = f.k.iter().map(|&b| F8E4M3::from_bits(b)).collect();
    let mut v8: Vec<F8E5M2> = f.v.iter().map(|&b| F8E5M2::from_bits(b)).collect();
    let e = flash_attn_with_kvcache_fp8(
        &q,
        &mut Fp8TensorMut::new(&mut k8, &bl.map.shape, &bl.map.strides),
        &mut Fp8TensorMut::new(&mut v8, &bl.map.shape, &bl.map.strides),
        &lens,
        &good,
        &opts,
    )
    .unwrap_err();
    assert_kind!(
        e.kind().clone(),
        ErrorKind::Fp8CacheFormat {
            expected: Fp8Format::E4M3,
            got: Fp8Format::E5M2
        }
    );
    assert!(e.to_string().contains("v_cache"), "{e}");
}

/// Packed queries over FP8 caches (each sequence's descale factors indexed by its batch row):
/// the rows of the packed call are those of one call per sequence with its own factors, bit for
/// bit.
#[test]
fn fp8_packed_queries_match_per_sequence_calls() {
    let q_lens = [3usize, 0, 1, 6, 2, 4];
    let total = q_lens.iter().sum::<usize>() + 2;
    let cu = cumulative(&q_lens);
    for (mi, format) in [
        (0, Fp8Format::E4M3),
        (1, Fp8Format::E5M2),
        (3, Fp8Format::E4M3),
    ] {
        let c = DCase {
            fp8: Some(format),
            ..packed_case(DType::BF16, mi, mi + 1, 950 + mi as u64)
        };
        let bl = build(&c);
        let f = bl.fp8.as_ref().unwrap();
        let (h, hkv, d) = (c.heads, c.heads_kv, c.d);
        let mut rng = common::rng(c.seed ^ 0xc0ffee);
        let qv = values(&mut rng, total * h * d, Dist::Normal);
        let qb = to_buffer(&qv, c.dtype);
        let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
        let call = |q: TensorRef, lens: &[i32], descale: &Descale, opts: &KvCacheOptions| {
            let (mut k, mut v) = (f.k.clone(), f.v.clone());
            call_fp8(&q, (&mut k, &mut v), (format, &bl.map), lens, descale, opts)
                .unwrap_or_else(|e| panic!("{c:?}: {e}"))
        };
        let all = Descale::default().k(&f.k_descale).v(&f.v_descale);
        let packed = call(
            view_of(&qb, &[total, h, d]),
            &lens,
            &all,
            &bl.opts(&c).cu_seqlens_q(&cu),
        );
        let lse = packed.lse.to_f64_vec();
        for (b, &sq) in q_lens.iter().enumerate().filter(|x| *x.1 > 0) {
            let r0 = cu[b] as usize;
            let qs = to_buffer(&qv[r0 * h * d..(r0 + sq) * h * d], c.dtype);
            let own = Alone::new(&c, &bl, b);
            let rows = b * hkv..(b + 1) * hkv;
            let mine = Descale::default()
                .k(&f.k_descale[rows.clone()])
                .v(&f.v_descale[rows]);
            let alone = call(
                view_of(&qs, &[1, sq, h, d]),
                &lens[b..b + 1],
                &mine,
                &own.opts(&c, &bl, b),
            );
            let lse_at = |hh: usize, i: usize| lse[hh * total + r0 + i];
            let what = format!("{c:?}: sequence {b}");
            assert_rows_match(&what, (&packed, r0, &lse_at), &alone, (sq, h, d));
        }
    }
}
