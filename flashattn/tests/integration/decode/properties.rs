//! Property tests: decode cases drawn by proptest over every option at once (dtypes, FP8 caches,
//! GQA ratios, head dims, batch rows of different lengths, appends, left pads, masks, softcap,
//! ALiBi, rotary, all four cache stores with any page size, split counts, instruction sets and
//! value distributions), each checked by [`check_case`] (the caches afterwards and out/lse against
//! the f64 reference). A failure shrinks to a small case and prints it.

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
    let mut slopes =
        (c.alibi || changes.iter().any(|ch| matches!(ch, Change::Slope(..)))).then(|| {
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
        Ok(o) if !scores_may_overflow(opts.attn.softmax_scale, 2.0 * d as f64) => assert_no_nan(&o),
        Ok(_) => {}
    }
}

/// Small valid cases for [`run_changed`]: each store, appends, rotary, GQA.
fn bases() -> impl Strategy<Value = DCase> {
    (0..4usize, any::<bool>(), 0..3usize, any::<u64>()).prop_map(|(store, rot, dt, seed)| DCase {
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
