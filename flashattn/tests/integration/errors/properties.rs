//! Fuzzing the boundary: valid calls with arbitrary changes (shapes, strides, ranks, buffer
//! lengths, dtypes, cu_seqlens, every option, ALiBi slopes, the backward's out/lse/dout), any
//! integer or float including the extremes. No entry point may panic; flash_attn, naive and
//! reference must refuse the same calls with the same error; an accepted call on finite inputs
//! gives no NaN.

use super::*;
use crate::common::props::extremes::{f32s as float, i32s, i64s, usizes};
use crate::common::props::{assert_no_nan, config, scores_may_overflow, set_dim};
use flashattn::{flash_attn_backward, AttnOutput, Slice};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Change {
    /// (tensor: q k v alibi out lse dout, dim, value).
    Shape(usize, usize, usize),
    Stride(usize, usize, usize),
    Rank(usize, usize),
    BufLen(usize, usize),
    DType(usize, usize),
    CuQ(Vec<i32>),
    CuK(Vec<i32>),
    Window(i64, i64),
    Softcap(f32),
    Scale(f32),
    Dropout(f32),
    Slope(usize, f32),
    /// Learnable sinks on, `[heads]` of them with sink `.0 % heads` set to `.1`.
    Sink(usize, f32),
    /// Learnable sinks on, of this many entries (a wrong shape unless `heads`).
    SinkLen(usize),
    Causal,
}

fn changes() -> impl Strategy<Value = Vec<Change>> {
    let one = prop_oneof![
        (0..7usize, 0..5usize, usizes(0..12)).prop_map(|(t, d, v)| Change::Shape(t, d, v)),
        (0..7usize, 0..5usize, usizes(0..12)).prop_map(|(t, d, v)| Change::Stride(t, d, v)),
        (0..7usize, 0..6usize).prop_map(|(t, r)| Change::Rank(t, r)),
        (0..7usize, 0..5000usize).prop_map(|(t, n)| Change::BufLen(t, n)),
        (0..7usize, 0..3usize).prop_map(|(t, d)| Change::DType(t, d)),
        prop::collection::vec(i32s(-2..12), 0..5).prop_map(Change::CuQ),
        prop::collection::vec(i32s(-2..12), 0..5).prop_map(Change::CuK),
        (i64s(-3..12), i64s(-3..12)).prop_map(|(l, r)| Change::Window(l, r)),
        float().prop_map(Change::Softcap),
        float().prop_map(Change::Scale),
        float().prop_map(Change::Dropout),
        (0..8usize, float()).prop_map(|(i, x)| Change::Slope(i, x)),
        (0..8usize, float()).prop_map(|(i, x)| Change::Sink(i, x)),
        (0..9usize).prop_map(Change::SinkLen),
        Just(Change::Causal),
    ];
    prop::collection::vec(one, 1..=3)
}

/// One tensor of a call: dtype (0 f32, 1 f16, 2 bf16), buffer length, shape, strides.
#[derive(Clone, Debug)]
struct T {
    dtype: usize,
    len: usize,
    shape: Vec<usize>,
    strides: Vec<usize>,
}

impl T {
    fn new(dtype: usize, shape: &[usize]) -> Self {
        T {
            dtype,
            len: shape.iter().product(),
            shape: shape.to_vec(),
            strides: flashattn::tensor::contiguous_strides(shape),
        }
    }
}

/// Buffers of every dtype, sized for every tensor's length.
struct Bufs(Vec<f32>, Vec<f16>, Vec<bf16>);

impl Bufs {
    fn new() -> Self {
        let x: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.37).sin()).collect();
        Bufs(
            x.clone(),
            x.iter().map(|&v| f16::from_f32(v)).collect(),
            x.iter().map(|&v| bf16::from_f32(v)).collect(),
        )
    }
    fn view(&self, t: &T) -> TensorRef<'_> {
        let data = match t.dtype {
            0 => Slice::F32(&self.0[..t.len]),
            1 => Slice::F16(&self.1[..t.len]),
            _ => Slice::BF16(&self.2[..t.len]),
        };
        TensorRef::from_slice(data, &t.shape, &t.strides)
    }
}

fn apply(ts: &mut [T], ch: &Change) {
    match ch {
        Change::Shape(t, d, x) => set_dim(&mut ts[*t].shape, *d, *x),
        Change::Stride(t, d, x) => set_dim(&mut ts[*t].strides, *d, *x),
        Change::Rank(t, r) => {
            let t = &mut ts[*t];
            t.shape.resize(*r, 2);
            t.strides.resize(*r, 1);
        }
        Change::BufLen(t, n) => ts[*t].len = *n,
        Change::DType(t, d) => ts[*t].dtype = *d,
        _ => {}
    }
}

/// Runs every entry point of one layout on a changed call and checks the property.
fn check(packed: bool, dtype: usize, changes: &[Change]) {
    let (b, sq, sk, h, hk, d) = (2, 5, 7, 4, 2, 8);
    let (qs, ks, ls): (Vec<usize>, Vec<usize>, Vec<usize>) = if packed {
        (vec![sq, h, d], vec![sk, hk, d], vec![h, sq])
    } else {
        (vec![b, sq, h, d], vec![b, sk, hk, d], vec![b, h, sq])
    };
    // q k v alibi out lse dout.
    let mut ts = vec![
        T::new(dtype, &qs),
        T::new(dtype, &ks),
        T::new(dtype, &ks),
        T::new(0, &[h]),
        T::new(dtype, &qs),
        T::new(0, &ls),
        T::new(dtype, &qs),
    ];
    let (mut cq, mut ck) = (vec![0, 2, 5], vec![0, 7, 7]);
    let mut slopes = [0.25f32, 0.5, 0.125, 1.0, 0.3, 0.7, 0.9, 0.05];
    let mut opts_ch = Vec::new();
    let mut alibi = false;
    let mut sinks = [0.5f32, -1.0, 2.0, 0.25, 7.0, -3.0, 0.0, 1.5];
    let mut sink_len = None;
    for ch in changes {
        apply(&mut ts, ch);
        match ch {
            Change::CuQ(v) => cq = v.clone(),
            Change::CuK(v) => ck = v.clone(),
            Change::Slope(i, x) => {
                alibi = true;
                slopes[*i] = *x;
            }
            Change::Sink(i, x) => {
                sinks[*i % h] = *x;
                sink_len.get_or_insert(h);
            }
            Change::SinkLen(n) => sink_len = Some(*n),
            Change::Shape(3, ..) | Change::Stride(3, ..) | Change::Rank(3, _) => alibi = true,
            Change::BufLen(3, _) | Change::DType(3, _) => alibi = true,
            _ => opts_ch.push(ch.clone()),
        }
    }
    let bufs = Bufs::new();
    let slope_t = &mut ts[3];
    slope_t.len = slope_t.len.min(slopes.len());
    let slope_view = |t: &T| -> TensorRef<'_> {
        TensorRef::from_slice(Slice::F32(&slopes[..t.len]), &t.shape, &t.strides)
    };
    let mut opts = AttnOptions::default();
    if alibi {
        opts = opts.alibi_slopes(slope_view(&ts[3]));
    }
    if let Some(n) = sink_len {
        opts = opts.learnable_sink(TensorRef::contiguous(&sinks[..n], &[n]));
    }
    for ch in opts_ch {
        match ch {
            Change::Window(l, r) => opts.window = (l, r),
            Change::Softcap(x) => opts.softcap = Some(x),
            Change::Scale(x) => opts.softmax_scale = Some(x),
            Change::Dropout(x) => opts.dropout_p = x,
            Change::Causal => opts.causal = !opts.causal,
            _ => {}
        }
    }
    // Views whose buffers are shorter than asked for stay in bounds: the length is capped
    // by the buffer (a longer request just names more of it).
    for t in ts.iter_mut() {
        t.len = t.len.min(5000);
    }
    let [q, k, v, _, out, lse, dout] = [0, 1, 2, 3, 4, 5, 6].map(|i| bufs.view(&ts[i]));
    // The buffers hold values in [-1, 1]: NaN is allowed only where the scale makes the
    // scores themselves overflow f32 (data-dependent, so not refused; see docs/SEMANTICS.md).
    let may_overflow = scores_may_overflow(
        opts.softmax_scale,
        q.shape().last().map_or(0.0, |&d| d as f64),
    );
    let same = |a: &Result<AttnOutput, Error>, b: Result<(), Error>, what: &str| match (a, b) {
        (Err(x), Err(y)) => assert_eq!(format!("{x:?}"), format!("{y:?}"), "{what}"),
        (Ok(_), Ok(())) => {}
        (x, y) => panic!("{what}: flash {:?} but {y:?}", x.as_ref().map(drop)),
    };
    if packed {
        let f = flash_attn(&q, &k, &v, &opts.clone().varlen(&cq, &ck));
        let n = naive::attention_varlen(&q, &k, &v, &cq, &ck, &opts).map(drop);
        let r = reference::attention_varlen(&q, &k, &v, &cq, &ck, &opts).map(drop);
        same(&f, n, "naive");
        same(&f, r, "reference");
        if let (Ok(o), false) = (&f, may_overflow) {
            assert_no_nan(o);
        }
        let _ = flash_attn_backward(
            &q,
            &k,
            &v,
            &out,
            &lse,
            &dout,
            &opts.clone().varlen(&cq, &ck),
        );
    } else {
        let f = flash_attn(&q, &k, &v, &opts);
        let n = naive::attention(&q, &k, &v, &opts).map(drop);
        let r = reference::attention(&q, &k, &v, &opts).map(drop);
        same(&f, n, "naive");
        same(&f, r, "reference");
        if let (Ok(o), false) = (&f, may_overflow) {
            assert_no_nan(o);
        }
        let _ = flash_attn_backward(&q, &k, &v, &out, &lse, &dout, &opts);
    }
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn changed_calls_fail_cleanly(
        packed in any::<bool>(),
        dtype in 0..3usize,
        changes in changes(),
    ) {
        check(packed, dtype, &changes);
    }
}
