//! The scratch buffers the CPU calls keep between calls (`flashattn::release_scratch`): a call
//! after another, with every kept buffer poisoned (NaN) in between, gives bit-identical results
//! to the first call, which had fresh buffers; the kept bytes are reported and freed.
//! (One test in its own binary: the kept buffers are process-wide.)

#[path = "integration/common/mod.rs"]
mod common;

use common::*;
use flashattn::{
    flash_attn, flash_attn_backward, poison_scratch, release_scratch, AttnOptions, Buffer, DType,
    TensorRef,
};

fn view<'a>(b: &'a Buffer, shape: &[usize]) -> TensorRef<'a> {
    TensorRef::from_slice(
        b.as_slice(),
        shape,
        &flashattn::tensor::contiguous_strides(shape),
    )
}

#[test]
fn kept_scratch_never_changes_results() {
    // GQA 8:1 over 1024 queries: every key block is visited often enough for the forward to pack
    // k and v into tiles (250 keys: the last tile is partly padding); the backward keeps query
    // tiles and a dQ copy.
    let (sq, sk, h, hkv, d) = (1024, 250, 16, 2, 64);
    for (n, dtype) in [DType::F32, DType::BF16].into_iter().enumerate() {
        let mut rng = rng(40 + n as u64);
        let qb = to_buffer(&values(&mut rng, sq * h * d, Dist::Normal), dtype);
        let kb = to_buffer(&values(&mut rng, sk * hkv * d, Dist::Normal), dtype);
        let vb = to_buffer(&values(&mut rng, sk * hkv * d, Dist::Normal), dtype);
        let dob = to_buffer(&values(&mut rng, sq * h * d, Dist::Normal), dtype);
        let (qs, ks) = ([1, sq, h, d], [1, sk, hkv, d]);
        let (q, k, v, dout) = (
            view(&qb, &qs),
            view(&kb, &ks),
            view(&vb, &ks),
            view(&dob, &qs),
        );
        let opts = AttnOptions::default();
        let run = || {
            let f = flash_attn(&q, &k, &v, &opts).unwrap();
            let (o, l) = (f.out.buffer().clone(), f.lse.buffer().clone());
            let g = flash_attn_backward(
                &q,
                &k,
                &v,
                &view(&o, &qs),
                &TensorRef::from_slice(l.as_slice(), f.lse.shape(), &[h * sq, sq, 1]),
                &dout,
                &opts,
            )
            .unwrap();
            [
                bits(&f.out),
                bits(&f.lse),
                bits(&g.dq),
                bits(&g.dk),
                bits(&g.dv),
            ]
        };
        release_scratch();
        flash_attn(&q, &k, &v, &opts).unwrap();
        assert!(release_scratch() > 0, "{dtype}: the forward kept no tiles");
        let fresh = run();
        let kept = release_scratch();
        assert!(kept > 0, "{dtype}: nothing was kept");
        assert_eq!(release_scratch(), 0, "{dtype}: released twice");
        run();
        poison_scratch();
        let reused = run();
        for (i, (a, b)) in fresh.iter().zip(&reused).enumerate() {
            assert!(
                a == b,
                "{dtype}: result {i} differs after a call on kept buffers"
            );
        }
    }
}
