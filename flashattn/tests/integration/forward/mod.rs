//! Forward-pass correctness: a seeded covering grid checked against the f64 reference with the naive
//! algorithm as the yardstick (see `common::check_bound`), plus targeted tests of varlen, masking,
//! determinism, GQA and the documented semantics.

use crate::common::grid::*;
use crate::common::*;
use flashattn::{flash_attn, naive, reference, AttnOptions, AttnOutput, DType, TensorRef};
use rand::seq::SliceRandom;
use rand::Rng;

mod determinism;
mod grid;
mod semantics;
mod varlen;

/// The logical values (row-major) of a placed tensor, read back from its buffer.
fn reference_values(inp: &Inputs, p: &Placement) -> Vec<f64> {
    let t = view(&inp.bufs, p);
    let all = match t.data() {
        flashattn::Slice::F32(d) => d.iter().map(|&x| x as f64).collect::<Vec<_>>(),
        flashattn::Slice::F16(d) => d.iter().map(|x| x.to_f64()).collect(),
        flashattn::Slice::BF16(d) => d.iter().map(|x| x.to_f64()).collect(),
    };
    let (s, st) = (&p.shape, &p.strides);
    let mut out = Vec::new();
    for a in 0..s[0] {
        for b in 0..s[1] {
            for c in 0..s[2] {
                for x in 0..s[3] {
                    out.push(all[a * st[0] + b * st[1] + c * st[2] + x * st[3]]);
                }
            }
        }
    }
    out
}
/// A packed problem: per-sequence lengths, plus `extra_q` tokens after the last sequence.
struct Packed {
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
    extra_q: usize,
    extra_k: usize,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    slopes: Vec<f32>,
}

impl Packed {
    #[allow(clippy::too_many_arguments)]
    fn new(
        lens_q: &[usize],
        lens_k: &[usize],
        extra_q: usize,
        extra_k: usize,
        heads: usize,
        heads_kv: usize,
        head_dim: usize,
        seed: u64,
    ) -> Packed {
        let mut r = rng(seed);
        let tq = lens_q.iter().sum::<usize>() + extra_q;
        let tk = lens_k.iter().sum::<usize>() + extra_k;
        let q = values(&mut r, tq * heads * head_dim, Dist::Normal);
        let k = values(&mut r, tk * heads_kv * head_dim, Dist::Normal);
        let v = values(&mut r, tk * heads_kv * head_dim, Dist::Uniform);
        let slopes = (0..lens_q.len() * heads)
            .map(|_| r.gen_range(0.01f32..0.3))
            .collect();
        Packed {
            lens_q: lens_q.to_vec(),
            lens_k: lens_k.to_vec(),
            extra_q,
            extra_k,
            q,
            k,
            v,
            slopes,
        }
    }
    fn cu(lens: &[usize]) -> Vec<i32> {
        std::iter::once(0)
            .chain(lens.iter().scan(0, |acc, &l| {
                *acc += l as i32;
                Some(*acc)
            }))
            .collect()
    }
    fn total_q(&self) -> usize {
        self.lens_q.iter().sum::<usize>() + self.extra_q
    }
    fn total_k(&self) -> usize {
        self.lens_k.iter().sum::<usize>() + self.extra_k
    }
}
