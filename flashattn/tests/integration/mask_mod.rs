//! Custom mask functions (`AttnOptions::mask_mod`, FlexAttention's `mask_mod`): document masks
//! (block-diagonal by segment ids), prefix-LM, a pseudo-random mask that depends on the sequence
//! and the query head, and one that empties some rows, each alone, with causal, with a window, and
//! causal with softcap and dropout;
//! GQA, seqlen_q != seqlen_k both ways, awkward shapes; f32 and bf16 on every instruction set.
//! Forward (out, lse) and backward (dq, dk, dv) against the f64 reference with the forward and
//! gradient grids' bounds (naive attention in the same precision, with the same mask, as the
//! yardstick). A function equal to the causal rule gives the causal option's bits; the calls
//! that do not implement a function refuse it.

use crate::common::backward::{GradCase, GradData, Shape};
use flashattn::decode::{flash_attn_with_kvcache, KvCacheOptions};
use flashattn::fp8::{flash_attn_fp8, Descale, Fp8TensorRef, F8E4M3};
use flashattn::{
    flash_attn, AttnOptions, Element, ErrorKind, MaskIndex, Tensor, TensorMut, TensorRef,
};
use half::bf16;

/// The masks under test, by name.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Kind {
    /// Query i and key j see each other iff they lie in the same document. Positions count in
    /// key coordinates (query i sits at key position `i + sk - sq`, as the causal rule aligns
    /// it); documents are cut at positions that depend on the sequence. Queries above key 0
    /// (seqlen_q > seqlen_k) belong to no document and see nothing.
    Document,
    /// Every query sees the first `prefix` keys, and the rest causally.
    PrefixLm,
    /// A pseudo-random half of the pairs, different per sequence and query head.
    Random,
    /// Rows `i % 7 == 3` see nothing, the others everything.
    EmptyRows,
}

pub(crate) const KINDS: [Kind; 4] = [
    Kind::Document,
    Kind::PrefixLm,
    Kind::Random,
    Kind::EmptyRows,
];

/// A 64-bit mix (splitmix64's finaliser), for the pseudo-random mask.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The document of key position `pos` of sequence `b`: cuts every 37 + 29·b positions and at 90,
/// so that documents of more than one 64-key block leave whole blocks hidden.
fn document(b: usize, pos: i64) -> i64 {
    if pos < 0 {
        return -1 - pos; // never a key's document
    }
    let pos = pos as usize;
    if pos >= 90 {
        return 1000;
    }
    (pos / (37 + 29 * b)) as i64
}

pub(crate) fn allows(kind: Kind, (sq, sk): (usize, usize), x: MaskIndex) -> bool {
    let offset = sk as i64 - sq as i64;
    match kind {
        Kind::Document => document(x.batch, x.q as i64 + offset) == document(x.batch, x.k as i64),
        Kind::PrefixLm => x.k < 20 || x.k as i64 <= x.q as i64 + offset,
        Kind::Random => {
            let key = (x.batch as u64) << 48 ^ (x.head as u64) << 40 ^ (x.q as u64) << 20;
            mix(key ^ x.k as u64) & 1 == 0
        }
        Kind::EmptyRows => x.q % 7 != 3,
    }
}

/// `base` with the mask of `kind` for sequences of these lengths.
fn with_mask(base: AttnOptions<'static>, kind: Kind, lens: (usize, usize)) -> AttnOptions<'static> {
    base.mask_mod(move |x| allows(kind, lens, x))
}

/// The built-in masks each function is combined with (the last with softcap and dropout, which
/// act on the scores and probabilities the function leaves).
pub(crate) fn builtins() -> [AttnOptions<'static>; 4] {
    [
        AttnOptions::default(),
        AttnOptions::default().causal(true),
        AttnOptions::default().window(40, 9),
        AttnOptions::default()
            .causal(true)
            .softcap(2.5)
            .dropout(0.2, 5),
    ]
}

/// (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim): GQA and MHA, seqlen_q below and above
/// seqlen_k, several key blocks, one row and one key, d = 40 and 64.
pub(crate) const SHAPES: [Shape; 4] = [
    (1, 113, 203, 4, 2, 40),
    (2, 203, 113, 4, 1, 64),
    (2, 130, 130, 2, 2, 64),
    (1, 1, 1, 2, 1, 40),
];

/// Forward and backward of every mask, built-in mask and shape against the reference, on every
/// instruction set.
fn run<T: Element>() {
    let mut hidden_rows = 0;
    for (n, &shape) in SHAPES.iter().enumerate() {
        let lens = (shape.1, shape.2);
        for (kk, &kind) in KINDS.iter().enumerate() {
            for (bi, base) in builtins().into_iter().enumerate() {
                let case = GradCase {
                    seed: (100 * n + 10 * kk + bi) as u64,
                    shape,
                    opts: with_mask(base.clone(), kind, lens),
                    logit_scale: 1.0,
                };
                let data = GradData::<T>::new(&case);
                let [q, k, v, dout] = data.views();
                let expected = data.expected(&case.opts);
                // The function changes the result where it hides a key the built-in masks show.
                let plain = flashattn::reference::attention(&q, &k, &v, &base).unwrap();
                for isa in flashattn::simd::available() {
                    let opts = case.opts.clone().isa(isa);
                    let ctx = format!("{kind:?} builtin {bi} {isa:?}");
                    let fwd = flash_attn(&q, &k, &v, &opts).unwrap();
                    let r = data.check_forward(&fwd, &opts, &ctx);
                    // Prefix-LM shows every key the causal rule shows: under it, nothing changes.
                    let superset = matches!(kind, Kind::PrefixLm) && (bi == 1 || bi == 3);
                    if shape.1 > 1 && !superset {
                        assert!(r.out != plain.out, "{ctx}: the function changed nothing");
                    }
                    hidden_rows += r.lse.iter().filter(|x| **x == f64::NEG_INFINITY).count();
                    let g = fwd.backward(&q, &k, &v, &dout, &opts).unwrap();
                    data.check_cancel([&g.dq, &g.dk, &g.dv], &expected, (&opts, &r), &ctx);
                }
            }
        }
    }
    assert!(hidden_rows > 0, "no row was emptied");
}

#[test]
fn mask_functions_match_the_reference_f32() {
    run::<f32>();
}

#[test]
fn mask_functions_match_the_reference_bf16() {
    run::<bf16>();
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_f64_vec().iter().map(|x| x.to_bits()).collect()
}

/// A function equal to the causal rule gives the causal option's bits, forward and backward, on
/// every instruction set: it visits the same blocks, and the forward's parts of the cut blocks
/// (causal only) compute each lane as the whole block does.
fn causal_equivalent<T: Element>() {
    for (n, &shape) in SHAPES.iter().enumerate() {
        let (sq, sk) = (shape.1, shape.2);
        let case = GradCase {
            seed: 7 + n as u64,
            shape,
            opts: AttnOptions::default(),
            logit_scale: 1.0,
        };
        let data = GradData::<T>::new(&case);
        let [q, k, v, dout] = data.views();
        for isa in flashattn::simd::available() {
            let causal = AttnOptions::default().causal(true).isa(isa);
            let by_fn = AttnOptions::default()
                .isa(isa)
                .mask_mod(move |x| x.k as i64 <= x.q as i64 + sk as i64 - sq as i64);
            let (a, b) = (
                flash_attn(&q, &k, &v, &causal).unwrap(),
                flash_attn(&q, &k, &v, &by_fn).unwrap(),
            );
            let ctx = format!("{shape:?} {isa:?}");
            assert_eq!(bits(&a.out), bits(&b.out), "out, {ctx}");
            assert_eq!(bits(&a.lse), bits(&b.lse), "lse, {ctx}");
            let ga = a.backward(&q, &k, &v, &dout, &causal).unwrap();
            let gb = b.backward(&q, &k, &v, &dout, &by_fn).unwrap();
            assert_eq!(bits(&ga.dq), bits(&gb.dq), "dq, {ctx}");
            assert_eq!(bits(&ga.dk), bits(&gb.dk), "dk, {ctx}");
            assert_eq!(bits(&ga.dv), bits(&gb.dv), "dv, {ctx}");
        }
    }
}

#[test]
fn a_causal_function_gives_the_causal_bits_f32() {
    causal_equivalent::<f32>();
}

#[test]
fn a_causal_function_gives_the_causal_bits_bf16() {
    causal_equivalent::<bf16>();
}

/// The function is called with the query head (not the kv head), the sequence index of a packed
/// call, and coordinates within each sequence: packed sequences give each one's batched result.
#[test]
fn packed_sequences_see_their_own_coordinates() {
    let (h, hk, d) = (4, 2, 40);
    let cu_q = [0i32, 70, 70, 183];
    let cu_k = [0i32, 90, 95, 298];
    let mask = |x: MaskIndex| !(x.q + 3 * x.head + 5 * x.batch + x.k).is_multiple_of(4);
    let case = GradCase {
        seed: 3,
        shape: (1, 183, 298, h, hk, d),
        opts: AttnOptions::default(),
        logit_scale: 1.0,
    };
    let data = GradData::<f32>::new(&case);
    let q = TensorRef::contiguous(&data.q, &[183, h, d]);
    let k = TensorRef::contiguous(&data.k, &[298, hk, d]);
    let v = TensorRef::contiguous(&data.v, &[298, hk, d]);
    let opts = AttnOptions::default().window(30, 50).mask_mod(mask);
    let got = flash_attn(&q, &k, &v, &opts.clone().varlen(&cu_q, &cu_k)).unwrap();
    let want = flashattn::reference::attention_varlen(&q, &k, &v, &cu_q, &cu_k, &opts).unwrap();
    let nv = flashattn::naive::attention_varlen(&q, &k, &v, &cu_q, &cu_k, &opts).unwrap();
    crate::common::check_bound(
        "packed",
        flashattn::DType::F32,
        &got,
        &[nv],
        &want,
        1.0,
        203,
    );
    // Sequence 2 alone, batched: its function sees batch 0 there, so shift it by 2.
    let (q2, k2) = (&data.q[70 * h * d..], &data.k[95 * hk * d..]);
    let v2 = &data.v[95 * hk * d..];
    let one = AttnOptions::default()
        .window(30, 50)
        .mask_mod(move |x| mask(MaskIndex { batch: 2, ..x }));
    let alone = flash_attn(
        &TensorRef::contiguous(q2, &[1, 113, h, d]),
        &TensorRef::contiguous(k2, &[1, 203, hk, d]),
        &TensorRef::contiguous(v2, &[1, 203, hk, d]),
        &one,
    )
    .unwrap();
    let packed = got.out.as_slice::<f32>().unwrap();
    assert_eq!(&packed[70 * h * d..], alone.out.as_slice::<f32>().unwrap());
}

/// The CUDA backend, FP8 and decoding refuse a function, naming it.
#[test]
fn calls_without_mask_functions_refuse_them() {
    assert_refused_elsewhere(&AttnOptions::default().mask_mod(|x| x.k <= x.q));
}

/// Checks that FP8, decoding and (where built) the CUDA backend refuse `opts`' custom mask with
/// `MaskModUnsupported`, naming both ways of giving one.
pub(crate) fn assert_refused_elsewhere(opts: &AttnOptions<'static>) {
    let (b, s, h, d) = (1, 4, 2, 8);
    let f8: Vec<F8E4M3> = (0..b * s * h * d)
        .map(|i| F8E4M3::from_f32((i % 5) as f32))
        .collect();
    let t8 = Fp8TensorRef::contiguous(&f8, &[b, s, h, d]);
    let fp8 = opts.clone().descale(Descale::default());
    let e = flash_attn_fp8(&t8, &t8, &t8, &fp8).unwrap_err();
    assert_eq!(
        e.kind(),
        &ErrorKind::MaskModUnsupported {
            call: "the FP8 calls"
        }
    );
    let message = e.to_string();
    assert!(
        message.contains("mask_mod") && message.contains("block_mask"),
        "{e}"
    );

    let x: Vec<f32> = (0..b * s * h * d).map(|i| (i as f32 * 0.3).cos()).collect();
    let q = TensorRef::contiguous(&x, &[b, s, h, d]);
    let cap = 8;
    let mut kc = vec![7.0f32; b * cap * h * d];
    let mut vc = kc.clone();
    let shape = [b, cap, h, d];
    let e = flash_attn_with_kvcache(
        &q,
        &mut TensorMut::contiguous(&mut kc[..], &shape),
        &mut TensorMut::contiguous(&mut vc[..], &shape),
        &[4],
        &KvCacheOptions::default().attn(opts.clone()),
    )
    .unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::MaskModUnsupported { .. }),
        "{e}"
    );
    #[cfg(feature = "cuda")]
    {
        let e = flashattn::cuda::launch_description(&q, &q, &q, opts).unwrap_err();
        assert_eq!(
            e.kind(),
            &ErrorKind::MaskModUnsupported {
                call: "the CUDA backend"
            }
        );
    }
}
