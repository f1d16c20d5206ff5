//! Block masks (`AttnOptions::block_mask`, FlexAttention's `BlockMask`): built once from the
//! functions of the `mask_mod` tests, they give the function form's bits, forward (out, lse) and
//! backward (dq, dk, dv), with every built-in mask, GQA, seqlen_q != seqlen_k both ways and
//! packed sequences, on every instruction set; a mask shared over batch and heads, and one from
//! a dense boolean mask, give the same bits; a mask made for another shape is refused with the
//! dimension named, and the calls without custom masks refuse block masks too.

use crate::common::backward::{GradCase, GradData};
use crate::mask_mod::{allows, assert_refused_elsewhere, builtins, KINDS, SHAPES};
use flashattn::{
    flash_attn, AttnOptions, BlockMask, Element, ErrorKind, MaskIndex, MaskShape, Tensor, TensorRef,
};
use half::bf16;

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_f64_vec().iter().map(|x| x.to_bits()).collect()
}

/// Forward and backward of `a` and `b` on the same data: the same bits.
fn same_bits([q, k, v, dout]: [&TensorRef; 4], a: &AttnOptions, b: &AttnOptions, ctx: &str) {
    let (fa, fb) = (
        flash_attn(q, k, v, a).unwrap(),
        flash_attn(q, k, v, b).unwrap(),
    );
    assert_eq!(bits(&fa.out), bits(&fb.out), "out, {ctx}");
    assert_eq!(bits(&fa.lse), bits(&fb.lse), "lse, {ctx}");
    let ga = fa.backward(q, k, v, dout, a).unwrap();
    let gb = fb.backward(q, k, v, dout, b).unwrap();
    assert_eq!(bits(&ga.dq), bits(&gb.dq), "dq, {ctx}");
    assert_eq!(bits(&ga.dk), bits(&gb.dk), "dk, {ctx}");
    assert_eq!(bits(&ga.dv), bits(&gb.dv), "dv, {ctx}");
}

/// Every mask function of the `mask_mod` tests, with every built-in mask, shape and instruction
/// set: the block mask built from it gives its bits.
fn function_bits<T: Element>() {
    for (n, &shape) in SHAPES.iter().enumerate() {
        let (batch, sq, sk, heads) = (shape.0, shape.1, shape.2, shape.3);
        let mshape = MaskShape {
            batch,
            heads,
            seqlen_q: sq,
            seqlen_k: sk,
        };
        for (kk, &kind) in KINDS.iter().enumerate() {
            let f = move |x| allows(kind, (sq, sk), x);
            let bm = BlockMask::from_fn(mshape, f).unwrap();
            for (bi, base) in builtins().into_iter().enumerate() {
                let case = GradCase {
                    seed: (100 * n + 10 * kk + bi) as u64,
                    shape,
                    opts: AttnOptions::default(),
                    logit_scale: 1.0,
                };
                let data = GradData::<T>::new(&case);
                let [q, k, v, dout] = data.views();
                for isa in flashattn::simd::available() {
                    let by_fn = base.clone().isa(isa).mask_mod(f);
                    let by_blocks = base.clone().isa(isa).block_mask(bm.clone());
                    let ctx = format!("{shape:?} {kind:?} builtin {bi} {isa:?}");
                    same_bits([&q, &k, &v, &dout], &by_fn, &by_blocks, &ctx);
                }
            }
        }
    }
}

#[test]
fn block_masks_give_the_function_bits_f32() {
    function_bits::<f32>();
}

#[test]
fn block_masks_give_the_function_bits_bf16() {
    function_bits::<bf16>();
}

/// A mask that does not depend on the sequence or the head, built with batch and heads 1 and
/// from a dense boolean mask, serves every (sequence, head): the function's bits.
#[test]
fn shared_and_dense_masks_serve_every_head() {
    let shape = (2, 203, 113, 4, 2, 59);
    let (sq, sk) = (shape.1, shape.2);
    let f = move |x: MaskIndex| (x.q * 5 + x.k * 3) % 11 < 7 || x.k + 90 == x.q;
    let one = MaskShape {
        batch: 1,
        heads: 1,
        seqlen_q: sq,
        seqlen_k: sk,
    };
    let dense: Vec<bool> = (0..sq * sk)
        .map(|x| {
            f(MaskIndex {
                batch: 0,
                head: 0,
                q: x / sk,
                k: x % sk,
            })
        })
        .collect();
    let from_dense = BlockMask::from_dense(one, &dense).unwrap();
    let case = GradCase {
        seed: 11,
        shape,
        opts: AttnOptions::default(),
        logit_scale: 1.0,
    };
    let data = GradData::<f32>::new(&case);
    let [q, k, v, dout] = data.views();
    let by_fn = AttnOptions::default().window(70, 20).mask_mod(f);
    for bm in [BlockMask::from_fn(one, f).unwrap(), from_dense] {
        let by_blocks = AttnOptions::default().window(70, 20).block_mask(bm);
        same_bits([&q, &k, &v, &dout], &by_fn, &by_blocks, "shared");
    }
}

/// Packed sequences read the mask at their own coordinates, (sequence b, row within it): a mask
/// of the longest lengths gives the function's bits.
#[test]
fn packed_sequences_read_their_own_rows() {
    let (h, hk, d) = (4, 2, 40);
    let cu_q = [0i32, 70, 70, 183];
    let cu_k = [0i32, 90, 95, 298];
    let f = |x: MaskIndex| !(x.q + 3 * x.head + 5 * x.batch + x.k).is_multiple_of(4);
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
    let dout = TensorRef::contiguous(&data.dout, &[183, h, d]);
    // Longer than every sequence (113 x 203 the longest), as a padded batch would make it.
    let mshape = MaskShape {
        batch: 3,
        heads: h,
        seqlen_q: 130,
        seqlen_k: 250,
    };
    let bm = BlockMask::from_fn(mshape, f).unwrap();
    for base in builtins() {
        let by_fn = base.clone().mask_mod(f).varlen(&cu_q, &cu_k);
        let by_blocks = base.block_mask(bm.clone()).varlen(&cu_q, &cu_k);
        same_bits([&q, &k, &v, &dout], &by_fn, &by_blocks, "packed");
    }
    // Shorter than the longest sequence: refused.
    let short = BlockMask::from_fn(
        MaskShape {
            seqlen_k: 202,
            ..mshape
        },
        f,
    )
    .unwrap();
    let e = flash_attn(
        &q,
        &k,
        &v,
        &AttnOptions::default()
            .block_mask(short)
            .varlen(&cu_q, &cu_k),
    )
    .unwrap_err();
    assert_eq!(
        e.kind(),
        &ErrorKind::BlockMaskShape {
            dim: "seqlen_k",
            mask: 202,
            call: 203,
            packed: true
        }
    );
}

/// A mask made for another batch, head count or length is refused, naming the dimension; batch
/// and heads of 1 are accepted.
#[test]
fn masks_of_another_shape_are_refused() {
    let (b, sq, sk, h, d) = (2, 10, 12, 3, 8);
    let x: Vec<f32> = (0..b * sk * h * d)
        .map(|i| (i as f32 * 0.7).sin())
        .collect();
    let q = TensorRef::contiguous(&x[..b * sq * h * d], &[b, sq, h, d]);
    let k = TensorRef::contiguous(&x, &[b, sk, h, d]);
    let call = MaskShape {
        batch: b,
        heads: h,
        seqlen_q: sq,
        seqlen_k: sk,
    };
    let f = |x: MaskIndex| x.k <= x.q + 2;
    let run = |s: MaskShape| {
        let bm = BlockMask::from_fn(s, f).unwrap();
        flash_attn(&q, &k, &k, &AttnOptions::default().block_mask(bm))
    };
    for (s, dim, mask, got) in [
        (MaskShape { batch: 3, ..call }, "batch", 3, b),
        (MaskShape { heads: 2, ..call }, "heads", 2, h),
        (
            MaskShape {
                seqlen_q: 11,
                ..call
            },
            "seqlen_q",
            11,
            sq,
        ),
        (
            MaskShape {
                seqlen_k: 13,
                ..call
            },
            "seqlen_k",
            13,
            sk,
        ),
    ] {
        let e = run(s).unwrap_err();
        assert_eq!(
            e.kind(),
            &ErrorKind::BlockMaskShape {
                dim,
                mask,
                call: got,
                packed: false
            }
        );
        assert!(e.to_string().contains(dim), "{e}");
    }
    let shared = MaskShape {
        batch: 1,
        heads: 1,
        ..call
    };
    let a = run(shared).unwrap();
    let want = flash_attn(&q, &k, &k, &AttnOptions::default().mask_mod(f)).unwrap();
    assert_eq!(bits(&a.out), bits(&want.out));
    let e = BlockMask::from_dense(shared, &[true; 5]).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::BlockMaskInput { .. }), "{e}");
}

/// FP8, decoding and the CUDA backend refuse a block mask as they refuse a function.
#[test]
fn calls_without_custom_masks_refuse_block_masks() {
    let shape = MaskShape {
        batch: 1,
        heads: 1,
        seqlen_q: 4,
        seqlen_k: 4,
    };
    let bm = BlockMask::from_fn(shape, |x| x.k <= x.q).unwrap();
    assert_refused_elsewhere(&AttnOptions::default().block_mask(bm));
}
