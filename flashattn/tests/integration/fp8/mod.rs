//! FP8 (e4m3, e5m2) forward: seeded cases checked against the f64 reference on the dequantised
//! inputs, with naive bf16 attention on the same (bf16-rounded) dequantised inputs as the yardstick
//! (see `common::check_bound`); strided views; packed sequences; every rejected input.

use crate::common::*;
use flashattn::fp8::{flash_attn_fp8, Descale, Fp8Format, Fp8TensorRef, F8E4M3, F8E5M2};
use flashattn::{naive, reference, AttnOptions, AttnOutput, DType, ErrorKind, TensorRef};
use half::bf16;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

#[cfg(feature = "cuda")]
mod emulated;
#[cfg(feature = "cuda")]
mod emulated_ws;
#[cfg(feature = "cuda")]
mod gpu;
mod properties;
mod quantize;

/// Raw FP8 values of one format.
enum Raw {
    E4M3(Vec<F8E4M3>),
    E5M2(Vec<F8E5M2>),
}

impl Raw {
    /// Quantises `x` (round to nearest even, saturating at the format's max).
    fn quantize(format: Fp8Format, x: &[f64]) -> Raw {
        match format {
            Fp8Format::E4M3 => Raw::E4M3(x.iter().map(|&v| F8E4M3::from_f64(v)).collect()),
            Fp8Format::E5M2 => Raw::E5M2(x.iter().map(|&v| F8E5M2::from_f64(v)).collect()),
        }
    }
    fn get(&self, i: usize) -> f64 {
        match self {
            Raw::E4M3(d) => d[i].to_f64(),
            Raw::E5M2(d) => d[i].to_f64(),
        }
    }
    fn view(&self, shape: &[usize], strides: &[usize]) -> Fp8TensorRef<'_> {
        match self {
            Raw::E4M3(d) => Fp8TensorRef::new(d, shape, strides),
            Raw::E5M2(d) => Fp8TensorRef::new(d, shape, strides),
        }
    }
}

#[derive(Clone, Debug)]
struct Case {
    format: Fp8Format,
    /// Sequence lengths; `packed` selects the varlen layout (else all lengths are equal).
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
    packed: bool,
    heads: usize,
    heads_kv: usize,
    d: usize,
    causal: bool,
    window: (i64, i64),
    softcap: Option<f32>,
    alibi: bool,
    /// One descale factor per (sequence, kv head) instead of one per tensor.
    per_head: bool,
    /// One descale factor per 128-row block of each (sequence, head) of q and (sequence, kv
    /// head) of k and v (`Descale::per_block`; overrides `per_head`).
    per_block: bool,
    /// Dequantised q and k this large (scores in the hundreds).
    huge: bool,
    /// q padded between heads and k stored head-major (`[b, heads_kv, s, d]`), as strided views.
    strided: bool,
    /// Dropout probability (seed = the case's seed).
    dropout: f32,
    /// Learnable sinks, one per query head (CPU only: the CUDA kernels refuse them).
    sink: bool,
    seed: u64,
}

impl Case {
    fn new(
        format: Fp8Format,
        b: usize,
        sq: usize,
        sk: usize,
        heads: (usize, usize),
        d: usize,
    ) -> Case {
        Case {
            format,
            lens_q: vec![sq; b],
            lens_k: vec![sk; b],
            packed: false,
            heads: heads.0,
            heads_kv: heads.1,
            d,
            causal: false,
            window: (-1, -1),
            softcap: None,
            alibi: false,
            per_head: true,
            per_block: false,
            huge: false,
            strided: false,
            dropout: 0.0,
            sink: false,
            seed: 1,
        }
    }
}

/// A built case: FP8 buffers, their descale factors, and the dequantised inputs in f32 (for the
/// reference: fp8 · descale, rounded once to f32) and bf16 (for the naive yardstick).
struct Built {
    case: Case,
    raw: [Raw; 3],
    /// (shape, strides) of the FP8 views of q, k, v.
    layouts: [(Vec<usize>, Vec<usize>); 3],
    descale: [Vec<f32>; 3],
    deq_f32: [Vec<f32>; 3],
    deq_bf16: [Vec<bf16>; 3],
    slopes: Vec<f32>,
    cu_q: Vec<i32>,
    cu_k: Vec<i32>,
    v_max: f64,
}

fn cu(lens: &[usize]) -> Vec<i32> {
    std::iter::once(0)
        .chain(lens.iter().scan(0, |acc, &x| {
            *acc += x as i32;
            Some(*acc)
        }))
        .collect()
}

impl Case {
    fn build(&self) -> Built {
        let mut g = rng(self.seed);
        let (b, h, hk, d) = (self.lens_q.len(), self.heads, self.heads_kv, self.d);
        let (tq, tk) = (
            self.lens_q.iter().sum::<usize>(),
            self.lens_k.iter().sum::<usize>(),
        );
        let fmax = self.format.max() as f64;
        // Descale factors: the amax of the dequantised tensor over the format's max, with amax
        // drawn per (sequence, kv head) (never a power of two, so no product is trivially exact).
        let amax = |g: &mut ChaCha8Rng, base: f64| base * g.gen_range(0.55..1.9);
        // Per block: [b, heads, ceil(max len / 128)] (q) and [b, heads_kv, ...] (k, v).
        let blocks = |lens: &[usize]| lens.iter().map(|l| l.div_ceil(128)).max().unwrap_or(0);
        let (nbq, nbk) = (blocks(&self.lens_q), blocks(&self.lens_k));
        let table_len = [b * h * nbq, b * hk * nbk, b * hk * nbk];
        let mut tensor = 0;
        let mut draw_descale = |g: &mut ChaCha8Rng, base: f64| -> Vec<f32> {
            let n = if self.per_block {
                table_len[tensor]
            } else if self.per_head {
                b * hk
            } else {
                1
            };
            tensor += 1;
            (0..n).map(|_| (amax(g, base) / fmax) as f32).collect()
        };
        let qk_base = if self.huge { 12.0 } else { 1.5 };
        let descale = [
            draw_descale(&mut g, qk_base),
            draw_descale(&mut g, qk_base),
            draw_descale(&mut g, 1.0),
        ];
        // Raw values spread over the format's range (U(-1, 1) · max), element order = token-major
        // logical order [token, head, x].
        let raw_vals = |g: &mut ChaCha8Rng, n: usize| -> Vec<f64> {
            (0..n).map(|_| g.gen_range(-1.0..1.0) * fmax).collect()
        };
        let logical = [
            raw_vals(&mut g, tq * h * d),
            raw_vals(&mut g, tk * hk * d),
            raw_vals(&mut g, tk * hk * d),
        ];
        // Sequence of each token, for the per-sequence descale.
        let seq_of = |lens: &[usize]| -> Vec<usize> {
            lens.iter()
                .enumerate()
                .flat_map(|(s, &l)| std::iter::repeat_n(s, l))
                .collect()
        };
        let seqs = [
            seq_of(&self.lens_q),
            seq_of(&self.lens_k),
            seq_of(&self.lens_k),
        ];
        // Position of each token in its sequence, for the per-block descale.
        let pos_of = |lens: &[usize]| -> Vec<usize> { lens.iter().flat_map(|&l| 0..l).collect() };
        let pos = [
            pos_of(&self.lens_q),
            pos_of(&self.lens_k),
            pos_of(&self.lens_k),
        ];
        let nblocks = [nbq, nbk, nbk];
        let heads = [h, hk, hk];
        let group = h / hk;
        let mut deq_f32: [Vec<f32>; 3] = Default::default();
        let mut deq_bf16: [Vec<bf16>; 3] = Default::default();
        let mut quantized: Vec<Vec<f64>> = Vec::new();
        for t in 0..3 {
            let raw = Raw::quantize(self.format, &logical[t]);
            let vals: Vec<f64> = (0..logical[t].len()).map(|i| raw.get(i)).collect();
            let nh = heads[t];
            let f = |i: usize| {
                let (tok, head) = (i / (nh * d), i / d % nh);
                let hk_of = if t == 0 { head / group } else { head };
                let s = descale[t][if self.per_block {
                    (seqs[t][tok] * nh + head) * nblocks[t] + pos[t][tok] / 128
                } else if self.per_head {
                    seqs[t][tok] * hk + hk_of
                } else {
                    0
                }];
                vals[i] * s as f64
            };
            deq_f32[t] = (0..vals.len()).map(|i| f(i) as f32).collect();
            deq_bf16[t] = (0..vals.len()).map(|i| bf16::from_f64(f(i))).collect();
            quantized.push(vals);
        }
        let v_max = quantized[2]
            .iter()
            .enumerate()
            .fold(0f64, |m, (i, _)| m.max(deq_f32[2][i].abs() as f64));
        // The FP8 buffers in their memory layout.
        let (sq, sk) = (self.lens_q[0], self.lens_k[0]);
        let token_major = |tokens: usize, nh: usize| -> (Vec<usize>, Vec<usize>) {
            if self.packed {
                (vec![tokens, nh, d], vec![nh * d, d, 1])
            } else {
                let s = tokens / b.max(1);
                (vec![b, s, nh, d], vec![s * nh * d, nh * d, d, 1])
            }
        };
        let mut layouts = [token_major(tq, h), token_major(tk, hk), token_major(tk, hk)];
        // Logical index -> buffer index of each tensor.
        let mut place: [Box<dyn Fn(usize) -> usize>; 3] =
            [Box::new(|i| i), Box::new(|i| i), Box::new(|i| i)];
        let mut lens = [quantized[0].len(), quantized[1].len(), quantized[2].len()];
        if self.strided {
            assert!(!self.packed);
            // q: heads 3 elements apart beyond d; k: head-major [b, hk, s, d].
            let hs = d + 3;
            layouts[0] = (vec![b, sq, h, d], vec![sq * h * hs, h * hs, hs, 1]);
            place[0] = Box::new(move |i| {
                let (row, x) = (i / d, i % d);
                row * hs + x
            });
            lens[0] = b * sq * h * hs;
            layouts[1] = (vec![b, sk, hk, d], vec![hk * sk * d, d, sk * d, 1]);
            place[1] = Box::new(move |i| {
                let (x, head, tok) = (i % d, i / d % hk, i / (d * hk));
                let (bb, s) = (tok / sk, tok % sk);
                ((bb * hk + head) * sk + s) * d + x
            });
        }
        let raw = [0, 1, 2].map(|t| {
            // Unaddressed padding holds NaN (e4m3 0x7f, e5m2 0x7f): a read of it would show.
            let mut buf = vec![f64::NAN; lens[t]];
            for (i, &x) in quantized[t].iter().enumerate() {
                buf[place[t](i)] = x;
            }
            Raw::quantize(self.format, &buf)
        });
        let slopes = (0..h).map(|i| 0.3 / (i + 1) as f32).collect();
        Built {
            case: self.clone(),
            raw,
            layouts,
            descale,
            deq_f32,
            deq_bf16,
            slopes,
            cu_q: cu(&self.lens_q),
            cu_k: cu(&self.lens_k),
            v_max,
        }
    }
}

impl Built {
    fn opts(&self) -> AttnOptions<'_> {
        let c = &self.case;
        let mut o = AttnOptions::default()
            .causal(c.causal)
            .window(c.window.0, c.window.1);
        if let Some(cap) = c.softcap {
            o = o.softcap(cap);
        }
        if c.alibi {
            o = o.alibi_slopes(TensorRef::contiguous(&self.slopes, &[c.heads]));
        }
        if c.dropout > 0.0 {
            o = o.dropout(c.dropout, c.seed);
        }
        if c.sink {
            o = o.learnable_sink(TensorRef::contiguous(&SINKS[..c.heads], &[c.heads]));
        }
        o
    }

    fn descale(&self) -> Descale<'_> {
        let d = Descale::default()
            .q(&self.descale[0])
            .k(&self.descale[1])
            .v(&self.descale[2]);
        if self.case.per_block {
            d.per_block()
        } else {
            d
        }
    }

    fn flash(&self, opts: &AttnOptions) -> flashattn::Result<AttnOutput> {
        let [q, k, v] = [0, 1, 2].map(|t| self.raw[t].view(&self.layouts[t].0, &self.layouts[t].1));
        if self.case.packed {
            flash_attn_fp8(
                &q,
                &k,
                &v,
                &opts
                    .clone()
                    .varlen(&self.cu_q, &self.cu_k)
                    .descale(self.descale()),
            )
        } else {
            flash_attn_fp8(&q, &k, &v, &opts.clone().descale(self.descale()))
        }
    }

    /// Contiguous token-major shapes of the dequantised tensors.
    fn deq_shape(&self, t: usize) -> Vec<usize> {
        let c = &self.case;
        let nh = if t == 0 { c.heads } else { c.heads_kv };
        let tokens: usize = if t == 0 {
            c.lens_q.iter().sum()
        } else {
            c.lens_k.iter().sum()
        };
        if c.packed {
            vec![tokens, nh, c.d]
        } else {
            let b = c.lens_q.len();
            vec![b, tokens / b.max(1), nh, c.d]
        }
    }

    /// The f64 reference on the dequantised inputs and naive bf16 attention on their bf16
    /// roundings (the yardstick).
    fn expected(&self, opts: &AttnOptions) -> (flashattn::reference::Reference, AttnOutput) {
        let c = &self.case;
        let shapes = [0, 1, 2].map(|t| self.deq_shape(t));
        let [qf, kf, vf] = [0, 1, 2].map(|t| TensorRef::contiguous(&self.deq_f32[t], &shapes[t]));
        let [qb, kb, vb] = [0, 1, 2].map(|t| TensorRef::contiguous(&self.deq_bf16[t], &shapes[t]));
        if c.packed {
            let (cq, ck) = (&self.cu_q, &self.cu_k);
            (
                reference::attention_varlen(&qf, &kf, &vf, cq, ck, opts).unwrap(),
                naive::attention_varlen(&qb, &kb, &vb, cq, ck, opts).unwrap(),
            )
        } else {
            (
                reference::attention(&qf, &kf, &vf, opts).unwrap(),
                naive::attention(&qb, &kb, &vb, opts).unwrap(),
            )
        }
    }

    /// `flash` against the expectations (`common::check_bound` in bf16).
    fn check_output(
        &self,
        flash: &AttnOutput,
        (r, nv): &(flashattn::reference::Reference, AttnOutput),
        what: &str,
    ) {
        let max_keys = self.case.lens_k.iter().copied().max().unwrap_or(0);
        check_bound(
            what,
            DType::BF16,
            flash,
            std::slice::from_ref(nv),
            r,
            self.v_max,
            max_keys,
        );
    }

    fn check(&self) {
        let what = format!("{:?}", self.case);
        let opts = self.opts();
        let expected = self.expected(&opts);
        for isa in flashattn::simd::available() {
            let flash = self
                .flash(&opts.clone().isa(isa))
                .unwrap_or_else(|e| panic!("{what} isa={isa}: {e}"));
            self.check_output(&flash, &expected, &format!("{what} isa={isa}"));
        }
    }

    /// The FP8 bytes of q, k and v (whole buffers, as laid out).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by the CUDA cases
    fn raw_bytes(&self) -> [Vec<u8>; 3] {
        [0, 1, 2].map(|t| match &self.raw[t] {
            Raw::E4M3(d) => d.iter().map(|x| x.to_bits()).collect(),
            Raw::E5M2(d) => d.iter().map(|x| x.to_bits()).collect(),
        })
    }
}

impl Case {
    /// Score products of the case (what the emulation's run time grows with).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by the CUDA cases
    fn cost(&self) -> usize {
        let pairs: usize = self
            .lens_q
            .iter()
            .zip(&self.lens_k)
            .map(|(q, k)| q * k)
            .sum();
        pairs * self.heads * self.d
    }
}

/// Sinks of up to 8 heads, from -3 to 5.
static SINKS: [f32; 8] = [0.5, -3.0, 2.0, 5.0, -0.5, 1.0, 3.5, 0.0];

fn cases(format: Fp8Format) -> Vec<Case> {
    let mut out = Vec::new();
    // (batch, seqlen_q, seqlen_k, (heads, heads_kv), head_dim)
    type Shape = (usize, usize, usize, (usize, usize), usize);
    let shapes: [Shape; 9] = [
        (1, 1, 1, (1, 1), 1),
        (2, 63, 63, (4, 2), 64),
        (1, 113, 203, (6, 2), 40),
        (1, 203, 113, (3, 1), 59),
        (2, 7, 129, (8, 8), 111),
        (1, 97, 97, (4, 1), 128),
        (1, 33, 70, (2, 2), 256),
        (3, 1, 301, (8, 2), 128),
        (1, 131, 131, (4, 4), 80),
    ];
    for (i, &(b, sq, sk, heads, d)) in shapes.iter().enumerate() {
        let mut c = Case::new(format, b, sq, sk, heads, d);
        c.seed = 100 + i as u64 + 50 * (format == Fp8Format::E5M2) as u64;
        match i % 5 {
            1 => c.causal = true,
            2 => {
                c.window = (17, 5);
                c.softcap = Some(20.0);
            }
            3 => {
                c.causal = true;
                c.alibi = true;
                c.per_head = false;
            }
            4 => c.huge = true,
            _ => {}
        }
        out.push(c);
    }
    // Scores in the hundreds, causal: a nearly one-hot softmax.
    let mut c = Case::new(format, 2, 77, 90, (4, 2), 64);
    (c.huge, c.causal, c.seed) = (true, true, 7);
    out.push(c);
    // Strided views (q padded between heads, k head-major).
    let mut c = Case::new(format, 2, 45, 61, (4, 2), 48);
    (c.strided, c.seed) = (true, 8);
    out.push(c);
    // Dropout (the CPU path's Philox mask, which the reference regenerates), with GQA.
    let mut c = Case::new(format, 2, 40, 57, (6, 2), 64);
    (c.dropout, c.causal, c.seed) = (0.2, true, 12);
    out.push(c);
    // Packed sequences (an empty one included), causal and plain.
    for (i, causal) in [false, true].into_iter().enumerate() {
        let mut c = Case::new(format, 1, 1, 1, (4, 2), 72);
        c.lens_q = vec![5, 0, 70, 33];
        c.lens_k = vec![7, 9, 65, 33];
        (c.packed, c.causal, c.seed) = (true, causal, 9 + i as u64);
        out.push(c);
    }
    // Per-block factors (FlashAttention-3's block quantisation): more than one 128-row block of
    // q and k, GQA, scores in the hundreds with a softcap; causal with ALiBi; packed sequences
    // whose blocks count from each one's first row (an empty one included).
    let mut c = Case::new(format, 2, 200, 300, (4, 2), 64);
    (c.per_block, c.huge, c.softcap, c.seed) = (true, true, Some(40.0), 15);
    out.push(c);
    let mut c = Case::new(format, 1, 260, 140, (3, 1), 40);
    (c.per_block, c.causal, c.alibi, c.seed) = (true, true, true, 16);
    out.push(c);
    let mut c = Case::new(format, 1, 1, 1, (4, 2), 32);
    c.lens_q = vec![5, 0, 200, 133];
    c.lens_k = vec![130, 9, 260, 33];
    (c.packed, c.per_block, c.causal, c.seed) = (true, true, true, 17);
    out.push(c);
    // Learnable sinks: causal with seqlen_q > seqlen_k (rows with no key), and packed.
    let mut c = Case::new(format, 2, 50, 31, (8, 2), 64);
    (c.sink, c.causal, c.seed) = (true, true, 13);
    out.push(c);
    let mut c = Case::new(format, 1, 1, 1, (4, 2), 40);
    c.lens_q = vec![9, 40];
    c.lens_k = vec![3, 41];
    (c.packed, c.sink, c.causal, c.seed) = (true, true, true, 14);
    out.push(c);
    out
}

/// Per-block cases for the CUDA kernels (head_dim `d`): more than one 128-row block of q and of
/// k, factors drawn per block (0.55 to 1.9 times a base: a neighbour block's factor is off by up
/// to 3.5x) and scores in the hundreds, so a score or P·V product scaled by another block's
/// factor shows; packed, causal, with blocks counted from each sequence's first row (an empty
/// sequence between); GQA with softcap and a window.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by the CUDA cases
fn block_cases(format: Fp8Format, d: usize) -> Vec<Case> {
    let mut out = Vec::new();
    let mut c = Case::new(format, 1, 150, 260, (2, 1), d);
    (c.per_block, c.huge, c.seed) = (true, true, 41);
    out.push(c);
    let mut c = Case::new(format, 1, 1, 1, (2, 1), d);
    c.lens_q = vec![130, 0, 40];
    c.lens_k = vec![200, 5, 140];
    (c.packed, c.per_block, c.huge, c.causal, c.seed) = (true, true, true, true, 42);
    out.push(c);
    let mut c = Case::new(format, 2, 129, 140, (4, 2), d);
    (c.per_block, c.huge, c.softcap, c.window, c.seed) = (true, true, Some(30.0), (150, 20), 43);
    out.push(c);
    out
}

#[test]
fn e4m3_matches_the_reference() {
    for c in cases(Fp8Format::E4M3) {
        c.build().check();
    }
}

#[test]
fn e5m2_matches_the_reference() {
    for c in cases(Fp8Format::E5M2) {
        c.build().check();
    }
}

/// Without descale factors the raw values are the inputs; a whole-tensor factor equals the same
/// factor given per (sequence, kv head).
#[test]
fn descale_defaults_and_broadcast() {
    let mut c = Case::new(Fp8Format::E4M3, 2, 20, 30, (4, 2), 32);
    c.per_head = false;
    let built = c.build();
    let opts = built.opts();
    let [q, k, v] = [0, 1, 2].map(|t| built.raw[t].view(&built.layouts[t].0, &built.layouts[t].1));
    let one = flash_attn_fp8(&q, &k, &v, &opts.clone().descale(built.descale())).unwrap();
    let spread = |x: &Vec<f32>| vec![x[0]; 2 * 2];
    let (dq, dk, dv) = (
        spread(&built.descale[0]),
        spread(&built.descale[1]),
        spread(&built.descale[2]),
    );
    let per = flash_attn_fp8(
        &q,
        &k,
        &v,
        &opts
            .clone()
            .descale(Descale::default().q(&dq).k(&dk).v(&dv)),
    )
    .unwrap();
    assert_bit_identical(&one, &per, "whole-tensor vs per-head descale");
    // No factors: the same as factors of 1.
    let ones = vec![1.0f32];
    let none = flash_attn_fp8(&q, &k, &v, &opts.clone().descale(Descale::default())).unwrap();
    let unit = flash_attn_fp8(
        &q,
        &k,
        &v,
        &opts
            .clone()
            .descale(Descale::default().q(&ones).k(&ones).v(&ones)),
    )
    .unwrap();
    assert_bit_identical(&none, &unit, "no descale vs descale 1");
    // And they differ from the descaled result (the factors are used).
    assert_ne!(bits(&none.out), bits(&one.out));
}

/// An FP8 forward entry point: the CPU call, or the CUDA launch description (validated as the
/// GPU call is); `Ok(())` when it accepts the input.
type Call<'a> = &'a dyn Fn(
    &Fp8TensorRef,
    &Fp8TensorRef,
    &Fp8TensorRef,
    Option<(&[i32], &[i32])>,
    &Descale,
    &AttnOptions,
) -> flashattn::Result<()>;

#[test]
fn rejects_bad_input_by_name() {
    rejects_bad_input_with(&|q, k, v, cu, d, o| {
        match cu {
            Some((cq, ck)) => flash_attn_fp8(q, k, v, &o.clone().varlen(cq, ck).descale(*d)),
            None => flash_attn_fp8(q, k, v, &o.clone().descale(*d)),
        }
        .map(|_| ())
    });
}

fn rejects_bad_input_with(call: Call) {
    let c = Case::new(Fp8Format::E4M3, 2, 5, 6, (4, 2), 16);
    let built = c.build();
    let [q, k, v] = [0, 1, 2].map(|t| built.raw[t].view(&built.layouts[t].0, &built.layouts[t].1));
    let opts = AttnOptions::default();
    let err = |d: Descale| {
        call(&q, &k, &v, None, &d, &opts)
            .unwrap_err()
            .kind()
            .clone()
    };

    // Mixed formats.
    let k5: Vec<F8E5M2> = vec![F8E5M2::from_f32(0.5); 2 * 6 * 2 * 16];
    let k5v = Fp8TensorRef::contiguous(&k5, &[2, 6, 2, 16]);
    let e = call(&q, &k5v, &v, None, &Descale::default(), &opts).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::Fp8Format {
                tensor: "k",
                expected: Fp8Format::E4M3,
                got: Fp8Format::E5M2
            }
        ),
        "{e}"
    );
    // Descale lengths: 1 or batch · heads_kv = 4.
    let three = [1.0f32; 3];
    assert!(matches!(
        err(Descale::default().k(&three)),
        ErrorKind::DescaleLength {
            tensor: "k_descale",
            got: 3,
            batch: 2,
            heads_kv: 2
        }
    ));
    let empty: [f32; 0] = [];
    assert!(matches!(
        err(Descale::default().v(&empty)),
        ErrorKind::DescaleLength {
            tensor: "v_descale",
            got: 0,
            ..
        }
    ));
    // Descale values: finite and > 0, the first bad index named.
    for bad in [0.0f32, -1.0, f32::NAN, f32::INFINITY, -0.0] {
        let d = [1.0, 2.0, bad, 0.5];
        match err(Descale::default().q(&d)) {
            ErrorKind::DescaleValue {
                tensor: "q_descale",
                index: 2,
                value,
            } => {
                assert!(value.to_bits() == bad.to_bits())
            }
            other => panic!("descale {bad}: {other:?}"),
        }
    }
    // Per-block tables: [batch, heads, q_blocks] = [2, 4, 1] for q, [2, 2, 1] for k and v.
    assert!(matches!(
        err(Descale::default().q(&three).per_block()),
        ErrorKind::DescaleBlockLength {
            tensor: "q_descale",
            got: 3,
            expected: 8,
            batch: 2,
            heads: 4,
            blocks: 1
        }
    ));
    let one = [1.0f32];
    assert!(matches!(
        err(Descale::default().v(&one).per_block()),
        ErrorKind::DescaleBlockLength {
            tensor: "v_descale",
            got: 1,
            expected: 4,
            heads: 2,
            ..
        }
    ));
    for bad in [0.0f32, -2.0, f32::NAN, f32::NEG_INFINITY] {
        let d = [1.0, 2.0, 0.5, bad];
        match err(Descale::default().k(&d).per_block()) {
            ErrorKind::DescaleValue {
                tensor: "k_descale",
                index: 3,
                value,
            } => assert!(value.to_bits() == bad.to_bits()),
            other => panic!("per-block descale {bad}: {other:?}"),
        }
    }
    // Per block, the extreme products are checked as the folded factors are.
    let (big, tiny) = ([1e30f32; 8], [1e-30f32; 4]);
    assert!(matches!(
        err(Descale::default().q(&big).k(&[1e30f32; 4]).per_block()),
        ErrorKind::Scale { .. }
    ));
    assert!(matches!(
        err(Descale::default().q(&[1e-30f32; 8]).k(&tiny).per_block()),
        ErrorKind::Scale { .. }
    ));
    assert!(matches!(
        err(Descale::default().v(&[1e36f32; 4]).per_block()),
        ErrorKind::DescaleRange { .. }
    ));
    // Finite factors whose product with the softmax scale overflows f32.
    let big = [1e30f32];
    assert!(matches!(
        err(Descale::default().q(&big).k(&big)),
        ErrorKind::Scale { .. }
    ));
    // ... or underflows: every score would be 0 (uniform attention) or lose its precision.
    let tiny = [1e-30f32];
    assert!(matches!(
        err(Descale::default().q(&tiny).k(&tiny)),
        ErrorKind::Scale { .. }
    ));
    // Factors so large that scores or outputs of the format's largest values leave f32: an
    // f32::MAX q factor was accepted and gave NaN (found by `properties::changed_calls_fail_
    // cleanly`).
    let huge = [f32::MAX];
    assert!(matches!(
        err(Descale::default().q(&huge)),
        ErrorKind::DescaleRange { .. }
    ));
    let v_big = [1e36f32];
    match err(Descale::default().v(&v_big)) {
        ErrorKind::DescaleRange { what, .. } => assert!(what.starts_with("outputs"), "{what}"),
        other => panic!("{other:?}"),
    }
    // ... or whose quotient by softcap underflows (the scale over softcap is a kernel constant).
    let e = call(
        &q,
        &k,
        &v,
        None,
        &Descale::default().q(&tiny),
        &AttnOptions::default().softcap(1e10),
    )
    .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Softcap { .. }), "{e}");
    // The usual checks apply to FP8 views: shapes, bounds, options.
    let short = Fp8TensorRef::new(&k5[..10], &[2, 6, 2, 16], &[192, 32, 16, 1]);
    let e = call(&short, &short, &short, None, &Descale::default(), &opts).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::OutOfBounds { tensor: "q", .. }),
        "{e}"
    );
    let kd = Fp8TensorRef::new(&k5, &[2, 6, 2, 8], &[192, 32, 16, 1]);
    let qd = Fp8TensorRef::new(&k5, &[2, 6, 2, 16], &[192, 32, 16, 1]);
    let e = call(&qd, &kd, &kd, None, &Descale::default(), &opts).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::Shape { tensor: "k", .. }),
        "{e}"
    );
    let e = call(
        &q,
        &k,
        &v,
        None,
        &Descale::default(),
        &AttnOptions::default().window(-2, 0),
    )
    .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Window { .. }), "{e}");
    let e = call(
        &q,
        &k,
        &v,
        Some((&[0, 3], &[0, 3])),
        &Descale::default(),
        &opts,
    )
    .unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::Rank { tensor: "q", .. }),
        "{e}"
    );
}

/// Per-block tables: entries past a shorter sequence's last block are padding, never read nor
/// checked (NaN there changes nothing); decode calls refuse per-block factors.
#[test]
fn per_block_padding_and_decode() {
    let mut c = Case::new(Fp8Format::E4M3, 1, 1, 1, (4, 2), 32);
    c.lens_q = vec![5, 130];
    c.lens_k = vec![140, 7];
    (c.packed, c.per_block, c.seed) = (true, true, 18);
    let built = c.build();
    let opts = built.opts();
    let plain = built.flash(&opts).unwrap();
    // q: [2, 4, 2], sequence 0's second block is padding; k, v: [2, 2, 2], sequence 1's.
    let mut dq = built.descale[0].clone();
    let (mut dk, mut dv) = (built.descale[1].clone(), built.descale[2].clone());
    for h in 0..4 {
        dq[h * 2 + 1] = f32::NAN;
    }
    for h in 0..2 {
        dk[(2 + h) * 2 + 1] = -1.0;
        dv[(2 + h) * 2 + 1] = 0.0;
    }
    let [q, k, v] = [0, 1, 2].map(|t| built.raw[t].view(&built.layouts[t].0, &built.layouts[t].1));
    let padded = flash_attn_fp8(
        &q,
        &k,
        &v,
        &opts
            .clone()
            .varlen(&built.cu_q, &built.cu_k)
            .descale(Descale::default().q(&dq).k(&dk).v(&dv).per_block()),
    )
    .unwrap();
    assert_bit_identical(&plain, &padded, "per-block padding");
    // The `_into` form writes the same bits into NaN-poisoned buffers.
    let mut out = vec![bf16::NAN; plain.out.shape().iter().product()];
    let mut lse = vec![f32::NAN; plain.lse.shape().iter().product()];
    flashattn::fp8::flash_attn_fp8_into(
        &q,
        &k,
        &v,
        &opts
            .clone()
            .varlen(&built.cu_q, &built.cu_k)
            .descale(built.descale()),
        flashattn::OutBuffers {
            out: flashattn::SliceMut::BF16(&mut out),
            lse: &mut lse,
        },
    )
    .unwrap();
    let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let got: Vec<f32> = out.iter().map(|x| x.to_f32()).collect();
    assert_eq!(
        bits(got),
        bits(plain.out.to_f32_vec()),
        "per-block into: out"
    );
    assert_eq!(
        bits(lse),
        bits(plain.lse.to_f32_vec()),
        "per-block into: lse"
    );
    // The range checks read the entries rows use, not padding: q factors of 1e-38 with k factors
    // of 1e35 make products near 1e-3 (a padding 1 beside them would make 1e-38 · 1e35 · 1 reach
    // past f32 through head_dim and the format's max, or 1e-38 · 1 underflow).
    let tiny_q = vec![1e-38f32; dq.len()];
    let big_k = vec![1e35f32; dk.len()];
    let ok = flash_attn_fp8(
        &q,
        &k,
        &v,
        &opts
            .clone()
            .varlen(&built.cu_q, &built.cu_k)
            .descale(Descale::default().q(&tiny_q).k(&big_k).per_block()),
    );
    assert!(ok.is_ok(), "{:?}", ok.err());
    // Decode on FP8 caches keeps per-(sequence, kv head) factors.
    let mut kc = vec![F8E4M3::from_f32(0.0); 16 * 2 * 8];
    let mut vc = kc.clone();
    let qd = vec![0.1f32; 4 * 8];
    let ones = [1.0f32; 2];
    let e = flashattn::fp8::flash_attn_with_kvcache_fp8(
        &TensorRef::contiguous(&qd, &[1, 1, 4, 8]),
        &mut flashattn::fp8::Fp8TensorMut::contiguous(&mut kc, &[1, 16, 2, 8]),
        &mut flashattn::fp8::Fp8TensorMut::contiguous(&mut vc, &[1, 16, 2, 8]),
        &[4],
        &flashattn::KvCacheOptions::default()
            .descale(Descale::default().k(&ones).v(&ones).per_block()),
    )
    .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::DescalePerBlock { .. }), "{e}");
}
