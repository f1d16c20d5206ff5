//! Fuzzing the FP8 boundary: a valid batched or packed call with 1-3 arbitrary changes (descale
//! arrays of any length and value, shapes and strides of q, k or v, cu_seqlens, softcap, scale,
//! window, dropout). The CPU path must not panic and gives no NaN when it accepts; with the CUDA
//! backend built, its launch description must accept and refuse exactly the same calls, with
//! the same errors.

use super::*;
use crate::common::props::extremes::{f32s, i32s, i64s, usizes};
use crate::common::props::{assert_no_nan, config, set_dim};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Change {
    /// (tensor q k v, factors).
    Descale(usize, Vec<f32>),
    Shape(usize, usize, usize),
    Stride(usize, usize, usize),
    CuQ(Vec<i32>),
    CuK(Vec<i32>),
    Softcap(f32),
    Scale(f32),
    Window(i64, i64),
    Dropout(f32),
}

fn changes() -> impl Strategy<Value = Vec<Change>> {
    let one = prop_oneof![
        (0..3usize, prop::collection::vec(f32s(), 0..6)).prop_map(|(t, v)| Change::Descale(t, v)),
        (0..3usize, 0..5usize, usizes(0..12)).prop_map(|(t, d, x)| Change::Shape(t, d, x)),
        (0..3usize, 0..5usize, usizes(0..12)).prop_map(|(t, d, x)| Change::Stride(t, d, x)),
        prop::collection::vec(i32s(-2..14), 0..5).prop_map(Change::CuQ),
        prop::collection::vec(i32s(-2..14), 0..5).prop_map(Change::CuK),
        f32s().prop_map(Change::Softcap),
        f32s().prop_map(Change::Scale),
        (i64s(-3..12), i64s(-3..12)).prop_map(|(l, r)| Change::Window(l, r)),
        f32s().prop_map(Change::Dropout),
    ];
    prop::collection::vec(one, 1..=3)
}

fn check(packed: bool, format: Fp8Format, changes: &[Change]) {
    let mut c = Case::new(format, 2, 5, 6, (4, 2), 16);
    if packed {
        c.packed = true;
        c.lens_q = vec![2, 3];
        c.lens_k = vec![6, 0];
    }
    let built = c.build();
    let mut layouts = built.layouts.clone();
    let mut descale = built.descale.clone();
    let (mut cq, mut ck) = (built.cu_q.clone(), built.cu_k.clone());
    let mut opts = built.opts();
    for ch in changes {
        match ch.clone() {
            Change::Descale(t, v) => descale[t] = v,
            Change::Shape(t, d, x) => set_dim(&mut layouts[t].0, d, x),
            Change::Stride(t, d, x) => set_dim(&mut layouts[t].1, d, x),
            Change::CuQ(v) => cq = v,
            Change::CuK(v) => ck = v,
            Change::Softcap(x) => opts.softcap = Some(x),
            Change::Scale(x) => opts.softmax_scale = Some(x),
            Change::Window(l, r) => opts.window = (l, r),
            Change::Dropout(x) => opts.dropout_p = x,
        }
    }
    // Views whose shape asks for more elements than the buffer are refused by validation,
    // not by building the view: `view` only records shape and strides.
    let [q, k, v] = [0, 1, 2].map(|t| built.raw[t].view(&layouts[t].0, &layouts[t].1));
    let d = Descale::default()
        .q(&descale[0])
        .k(&descale[1])
        .v(&descale[2]);
    let cu = packed.then_some((&cq[..], &ck[..]));
    let cpu = match cu {
        Some((a, b)) => flash_attn_fp8(&q, &k, &v, &opts.clone().varlen(a, b).descale(d)),
        None => flash_attn_fp8(&q, &k, &v, &opts.clone().descale(d)),
    };
    if let Ok(o) = &cpu {
        assert_no_nan(o);
    }
    #[cfg(feature = "cuda")]
    {
        let gpu = flashattn::cuda::launch_description_fp8(
            &q,
            &k,
            &v,
            &flashattn::AttnOptions {
                cu_seqlens: cu,
                descale: Some(d),
                ..opts.clone()
            },
        );
        match (&cpu, &gpu) {
            (Ok(_), Ok(_)) => {}
            (Err(a), Err(b)) => assert_eq!(format!("{a:?}"), format!("{b:?}")),
            (a, b) => panic!(
                "CPU {:?} but CUDA {:?}",
                a.as_ref().map(drop),
                b.as_ref().map(drop)
            ),
        }
    }
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn changed_calls_fail_cleanly(
        packed in any::<bool>(),
        e5m2 in any::<bool>(),
        changes in changes(),
    ) {
        let format = if e5m2 { Fp8Format::E5M2 } else { Fp8Format::E4M3 };
        check(packed, format, &changes);
    }
}
