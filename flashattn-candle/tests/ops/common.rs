//! Seeded cases and the error bounds: flashattn-candle against flashattn's f64 reference, with
//! naive attention in the same precision as the yardstick.
//!
//! Forward: `max|out - ref| <= 2 · max|naive - ref| + 4 · eps · max|ref|`. Gradients:
//! `max|grad - ref| <= 3 · max|naive - ref| + 4 · eps · max|ref| + 16 · eps`, naive being the
//! larger error of flashattn's two naive backwards (the rule of flashattn's own tests); the same
//! bound holds with candle's own autograd through matmul-softmax-matmul as the naive.

use candle_core::{DType as CDType, Device, Tensor, Var, WithDType, D};
use flashattn::{DType, Element, TensorRef};
use flashattn_candle::FlashAttnOptions;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// An element type both crates know.
pub trait Elem: Element + WithDType {
    const FLASH_DTYPE: DType;
}
impl Elem for f32 {
    const FLASH_DTYPE: DType = DType::F32;
}
impl Elem for half::f16 {
    const FLASH_DTYPE: DType = DType::F16;
}
impl Elem for half::bf16 {
    const FLASH_DTYPE: DType = DType::BF16;
}

#[derive(Clone, Debug)]
pub struct Case {
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub heads: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub window: (Option<usize>, Option<usize>),
    pub softcap: Option<f32>,
    pub alibi: bool,
}

impl Case {
    pub fn new(
        batch: usize,
        seqlen_q: usize,
        seqlen_k: usize,
        heads: usize,
        head_dim: usize,
    ) -> Self {
        Case {
            batch,
            seqlen_q,
            seqlen_k,
            heads,
            heads_kv: heads,
            head_dim,
            causal: false,
            window: (None, None),
            softcap: None,
            alibi: false,
        }
    }
    pub fn causal(mut self) -> Self {
        self.causal = true;
        self
    }
    pub fn gqa(mut self, heads_kv: usize) -> Self {
        self.heads_kv = heads_kv;
        self
    }
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window = (left, right);
        self
    }
    pub fn softcap(mut self, softcap: f32) -> Self {
        self.softcap = Some(softcap);
        self
    }
    pub fn alibi(mut self) -> Self {
        self.alibi = true;
        self
    }
    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_q, self.heads, self.head_dim]
    }
    pub fn k_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_k, self.heads_kv, self.head_dim]
    }
    /// Whether some query row sees no key (the naive candle softmax would give NaN there): row i
    /// sees keys up to `i + seqlen_k - seqlen_q + right`, so row 0 sees none when that is < 0; a
    /// left bound alone never empties a row.
    pub fn has_empty_rows(&self) -> bool {
        let right_bound = if self.causal { Some(0) } else { self.window.1 };
        right_bound.is_some_and(|r| self.seqlen_q > self.seqlen_k + r)
    }
}

/// One case's data, in `T`, as flat row-major buffers.
pub struct Data<T> {
    pub case: Case,
    pub q: Vec<T>,
    pub k: Vec<T>,
    pub v: Vec<T>,
    pub dout: Vec<T>,
    pub slopes: Vec<f32>,
}

fn fill<T: Elem>(rng: &mut ChaCha8Rng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| T::from_f32(rng.gen_range(-1.0f32..1.0)))
        .collect()
}

impl<T: Elem> Data<T> {
    pub fn new(case: &Case, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let nq: usize = case.q_shape().iter().product();
        let nk: usize = case.k_shape().iter().product();
        let slopes = (0..case.heads).map(|h| 0.5f32.powi(h as i32 + 1)).collect();
        Data {
            case: case.clone(),
            q: fill(&mut rng, nq),
            k: fill(&mut rng, nk),
            v: fill(&mut rng, nk),
            dout: fill(&mut rng, nq),
            slopes,
        }
    }

    pub fn views(&self) -> [TensorRef<'_>; 4] {
        let (qs, ks) = (self.case.q_shape(), self.case.k_shape());
        [
            TensorRef::contiguous(&self.q, &qs),
            TensorRef::contiguous(&self.k, &ks),
            TensorRef::contiguous(&self.v, &ks),
            TensorRef::contiguous(&self.dout, &qs),
        ]
    }

    pub fn flash_opts(&self) -> flashattn::AttnOptions<'_> {
        let c = &self.case;
        let side = |w: Option<usize>| w.map_or(-1, |w| w as i64);
        let mut o = flashattn::AttnOptions::default()
            .causal(c.causal)
            .window(side(c.window.0), side(c.window.1));
        if let Some(s) = c.softcap {
            o = o.softcap(s);
        }
        if c.alibi {
            o = o.alibi_slopes(TensorRef::contiguous(&self.slopes, &[c.heads]));
        }
        o
    }

    pub fn candle_opts(&self) -> FlashAttnOptions {
        let c = &self.case;
        let mut o = FlashAttnOptions::default()
            .causal(c.causal)
            .window(c.window.0, c.window.1);
        if let Some(s) = c.softcap {
            o = o.softcap(s);
        }
        if c.alibi {
            o = o.alibi_slopes(&Tensor::new(self.slopes.as_slice(), &Device::Cpu).unwrap());
        }
        o
    }

    /// q, k, v and dout as candle tensors.
    pub fn tensors(&self) -> [Tensor; 4] {
        let (qs, ks) = (self.case.q_shape(), self.case.k_shape());
        let t = |d: &[T], s: [usize; 4]| Tensor::from_vec(d.to_vec(), &s, &Device::Cpu).unwrap();
        [
            t(&self.q, qs),
            t(&self.k, ks),
            t(&self.v, ks),
            t(&self.dout, qs),
        ]
    }
}

pub fn to_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(CDType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

pub fn max_abs(x: &[f64]) -> f64 {
    x.iter().fold(0.0, |m, v| m.max(v.abs()))
}

pub fn max_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .fold(0.0, |m, (a, b)| m.max((a - b).abs()))
}

/// Asserts `got` (finite) is within `factor · naive_err + 4 · eps · max|want| + extra_eps · eps`.
pub fn check_bound(
    name: &str,
    got: &[f64],
    naive_err: f64,
    want: &[f64],
    (dtype, factor, extra_eps): (DType, f64, f64),
    ctx: &str,
) {
    assert!(
        got.iter().all(|x| x.is_finite()),
        "{name} has NaN/inf, {ctx}"
    );
    let err = max_err(got, want);
    let eps = dtype.epsilon();
    let bound = factor * naive_err + 4.0 * eps * max_abs(want) + extra_eps * eps;
    assert!(
        err <= bound,
        "{name}: max abs err {err:e} > bound {bound:e} (naive {naive_err:e}, max|ref| {:e}), {ctx}",
        max_abs(want)
    );
}

/// Naive attention in candle ops (matmul, softmax, matmul) in the tensors' dtype, batched
/// `[batch, seqlen, heads, head_dim]`, with the case's masks, ALiBi and softcap; no row may be
/// fully masked.
pub fn candle_naive<T: Elem>(data: &Data<T>, q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    let c = &data.case;
    let group = c.heads / c.heads_kv;
    let dt = q.dtype();
    let heads_of = |t: &Tensor| -> Tensor {
        // [b, s, hk, d] -> [b, hk, s, d] -> [b, h, s, d], query head h reading kv head h / group.
        let t = t.transpose(1, 2).unwrap();
        let (b, hk, s, d) = t.dims4().unwrap();
        t.unsqueeze(2)
            .unwrap()
            .broadcast_as((b, hk, group, s, d))
            .unwrap()
            .reshape((b, hk * group, s, d))
            .unwrap()
    };
    let qh = q.transpose(1, 2).unwrap().contiguous().unwrap();
    let (kh, vh) = (heads_of(k), heads_of(v));
    let scale = 1.0 / (c.head_dim as f64).sqrt();
    let mut s = (qh.matmul(&kh.t().unwrap().contiguous().unwrap()).unwrap() * scale).unwrap();
    if let Some(cap) = c.softcap {
        s = ((s / cap as f64).unwrap().tanh().unwrap() * cap as f64).unwrap();
    }
    // Additive bias [heads, sq, sk]: ALiBi, and -inf outside the mask.
    let (sq, sk) = (c.seqlen_q, c.seqlen_k);
    let right = if c.causal { Some(0) } else { c.window.1 };
    let mut bias = vec![0f32; c.heads * sq * sk];
    for h in 0..c.heads {
        for i in 0..sq {
            for j in 0..sk {
                let diag = (i + sk) as i64 - sq as i64;
                let (j, at) = (j as i64, (h * sq + i) * sk + j);
                let out_left = c.window.0.is_some_and(|l| j < diag - l as i64);
                let out_right = right.is_some_and(|r| j > diag + r as i64);
                bias[at] = if out_left || out_right {
                    f32::NEG_INFINITY
                } else if c.alibi {
                    -data.slopes[h] * (diag - j).abs() as f32
                } else {
                    0.0
                };
            }
        }
    }
    let bias = Tensor::from_vec(bias, (1, c.heads, sq, sk), &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap();
    let s = s.broadcast_add(&bias).unwrap();
    let row_max = s.max_keepdim(D::Minus1).unwrap().detach();
    let e = s.broadcast_sub(&row_max).unwrap().exp().unwrap();
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
    p.matmul(&vh.contiguous().unwrap())
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
}

/// The gradients of `Σ out ∘ dout` through `f`, with q, k and v as `Var`s.
pub fn grads_of(
    [q, k, v, dout]: &[Tensor; 4],
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
) -> [Vec<f64>; 3] {
    let (q, k, v) = (
        Var::from_tensor(q).unwrap(),
        Var::from_tensor(k).unwrap(),
        Var::from_tensor(v).unwrap(),
    );
    let out = f(q.as_tensor(), k.as_tensor(), v.as_tensor());
    let loss = (out * dout).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    [&q, &k, &v].map(|x| to_f64(g.get(x.as_tensor()).expect("a gradient")))
}
